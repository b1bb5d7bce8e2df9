//! Training on the GPU through the trainer: two ranks (threads over the collective's local
//! transport, both on GPU 0) train NMT and RNNLM with the CUDA backend and end with the
//! parameters the same run reaches on the CPU backend. This covers the trainer's GPU path:
//! the device-resident update (SGD and Adam, clipping, f16 gradients cast and checked on
//! the device) for one and two ranks, gradient ranges copied once each way through the
//! pinned exchange buffer (with and without the overlapped reduction), the host mirrors
//! of `parameter_server`, the bytes a step moves between host and device, and checkpoints
//! and `--resume`. Needs the `cuda` feature and a GPU (device 0, or the emulated driver);
//! built by `scripts/build-gpu-bundle` and run by `scripts/gpu-check`.
#![cfg(feature = "cuda")]

mod training_runs;

use ringtrain::collective::Communicator;
use ringtrain::train::{
    build_pipeline_stage, train, DeviceKind, LstmImpl, ModelKind, OptimizerKind, OverlapMode,
    RunReport, TrainConfig, TrainableModel, VariableUpdate,
};
use training_runs::{batches, config, initial_model, max_diff, run, with};

/// CPU and GPU differ in GEMM summation order and in the approximate exponentials of the
/// activations (about 1e-6 relative per operation); four SGD steps of this small model keep
/// the parameters within this bound (the model-level test allows the same after five).
const BACKEND_TOLERANCE: f32 = 1e-4;

fn on(device: DeviceKind, cfg: &TrainConfig, ranks: usize) -> Vec<Vec<f32>> {
    run(&with(cfg, |c| c.run.device = device), ranks)
}

fn check(cfg: TrainConfig, what: &str) {
    check_ranks(cfg, what, 2)
}

fn check_ranks(cfg: TrainConfig, what: &str, ranks: usize) {
    let cpu = on(DeviceKind::Cpu, &cfg, ranks);
    let gpu = on(DeviceKind::Cuda, &cfg, ranks);
    if ranks > 1 {
        assert_eq!(
            max_diff(&gpu[0], &gpu[1]),
            0.0,
            "{what}: the two GPU replicas diverged"
        );
    }
    let d = max_diff(&gpu[0], &cpu[0]);
    assert!(
        d <= BACKEND_TOLERANCE,
        "{what}: GPU and CPU parameters differ by {d:e} after training"
    );
    // Rank 0's initial parameters (the run broadcasts them): training must have moved them.
    let start = initial_model(&cfg, 100);
    assert!(
        max_diff(start.params().expect("settled"), &gpu[0]) > 1e-3,
        "{what}: training did not change the parameters"
    );
}

#[test]
fn nmt_trains_to_the_cpu_parameters_with_and_without_overlap() {
    // The gradient path is the same for both LSTM implementations (the stepwise one is
    // compared with the CPU in the model crate's cuda_backend test): fused only here.
    for overlap_backward in [OverlapMode::Off, OverlapMode::On] {
        let cfg = with(&config(ModelKind::Nmt, VariableUpdate::Replicated), |c| {
            c.data.batch_size = 3;
            c.exchange.overlap_backward = overlap_backward;
            c.model.encoder_type = LstmImpl::Fused.into();
        });
        check(cfg, &format!("nmt overlap={overlap_backward}"));
    }
}

#[test]
fn rnnlm_trains_to_the_cpu_parameters() {
    let cfg = with(&config(ModelKind::Rnnlm, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 3;
        c.exchange.overlap_backward = OverlapMode::On;
    });
    check(cfg, "rnnlm");
}

#[test]
fn fp16_gradients_on_the_wire_train_like_the_cpu() {
    let cfg = with(&config(ModelKind::Nmt, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 3;
        c.exchange.fp16_gradients = true;
    });
    check(cfg, "nmt fp16 gradients");
}

#[test]
fn parameter_server_on_the_gpu_trains_like_the_cpu() {
    let cfg = with(
        &config(ModelKind::Nmt, VariableUpdate::ParameterServer),
        |c| c.data.batch_size = 2,
    );
    check(cfg, "nmt parameter_server");
}

#[test]
fn a_model_too_big_for_the_gpu_is_refused_before_it_is_built() {
    use ringtrain::collective::Communicator;
    use ringtrain::train::{run_rank, LocalRank, LocalRankSource};

    let mut cfg = TrainConfig::default();
    cfg.run.device = DeviceKind::Cuda;
    cfg.run.threads = 1;
    cfg.data.vocab_size = 5_000_000;
    cfg.model.num_units = 4096;
    let cfg = cfg.validate(1).expect("valid flags");
    let errors = Communicator::run_local(1, |comm| {
        let local = LocalRank {
            rank: 0,
            size: 1,
            source: LocalRankSource::Default,
        };
        Ok::<_, ringtrain::train::Error>(
            run_rank(&cfg, comm, local, &mut |_| {})
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default(),
        )
    })
    .expect("the local transport runs");
    let err = errors
        .into_iter()
        .next()
        .and_then(|r| r.ok())
        .unwrap_or_default();
    assert!(
        err.contains("on GPU 0") && err.contains("biggest term is") && err.contains("GiB"),
        "{err}"
    );
}

/// Held-out evaluation on the GPU: the forward-only loss after each update (the new
/// parameters uploaded first) matches the CPU run's, for both models, two ranks each
/// evaluating its part of the shipped dev/valid set.
#[test]
fn held_out_evaluation_on_the_gpu_matches_the_cpu() {
    use ringtrain::data::BundledCorpus;
    use ringtrain::train::{local_rank, run_rank};

    let files = BundledCorpus::in_repo();
    // The first lines of each held-out file: every evaluation runs the whole set, and on
    // the emulated driver a few batches of it say as much as all of them.
    let dir = tempfile::tempdir().expect("a temporary directory");
    let head = |path: &std::path::Path, lines: usize| -> std::path::PathBuf {
        let text = std::fs::read_to_string(path).expect("the bundled corpus reads");
        let kept: String = text.lines().take(lines).map(|l| format!("{l}\n")).collect();
        let out = dir.path().join(path.file_name().expect("a file name"));
        std::fs::write(&out, kept).expect("the temporary file is written");
        out
    };
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let mut cfg = TrainConfig::default();
        cfg.model.model = model;
        cfg.model.num_units = 8;
        cfg.run.threads = 1;
        cfg.run.warmup_batches = 1;
        cfg.run.timed_batches = 2;
        cfg.run.eval_every = 1;
        cfg.output.display_every = 0;
        cfg.data.src_max_len = 6;
        cfg.data.batch_size = 8;
        if model == ModelKind::Nmt {
            cfg.data.data = vec![
                files.nmt_train_src.clone(),
                files.nmt_train_tgt.clone(),
                files.nmt_vocab_src.clone(),
                files.nmt_vocab_tgt.clone(),
            ];
            cfg.data.eval_data = vec![head(&files.nmt_dev_src, 24), head(&files.nmt_dev_tgt, 24)];
        } else {
            cfg.data.data = vec![files.lm_train.clone(), files.lm_vocab.clone()];
            cfg.data.eval_data = vec![head(&files.lm_valid, 24)];
        }
        let losses = |device: DeviceKind| -> Vec<f64> {
            let cfg = with(&cfg, |c| c.run.device = device)
                .validate(2)
                .expect("valid flags");
            let reports = Communicator::run_local(2, |comm| {
                let local = local_rank(&comm)?;
                run_rank(&cfg, comm, local, &mut |_| {}).map(|o| o.report)
            })
            .expect("the local transport runs");
            let report = reports.into_iter().next().expect("rank 0").expect("trains");
            report.eval.iter().map(|e| e.loss).collect()
        };
        let (cpu, gpu) = (losses(DeviceKind::Cpu), losses(DeviceKind::Cuda));
        assert_eq!(cpu.len(), 3, "{model}");
        assert_eq!(gpu.len(), 3, "{model}");
        for (c, g) in cpu.iter().zip(&gpu) {
            assert!(
                (c - g).abs() <= 1e-4 * c.abs(),
                "{model}: held-out loss {g} on the GPU, {c} on the CPU ({gpu:?} vs {cpu:?})"
            );
        }
        assert!(
            gpu[0] != gpu[2],
            "{model}: the updates did not reach the evaluation"
        );
    }
}

/// One rank's run of `cfg`, returning its report.
fn report_of(cfg: &TrainConfig) -> RunReport {
    let run = cfg.validate(1).expect("a valid test config");
    let mut reports = Communicator::run_local(1, |comm| {
        let mut model = initial_model(cfg, 100);
        let mut data = batches(&run, 0).into_iter();
        train(&run, comm, model.as_mut(), &mut data, &mut |_| {})
            .unwrap()
            .report
    })
    .unwrap();
    reports.remove(0)
}

#[test]
fn the_report_counts_host_device_bytes_and_peak_memory_on_cuda_only() {
    let cfg = with(&config(ModelKind::Nmt, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 3;
    });
    let cpu = report_of(&with(&cfg, |c| c.run.device = DeviceKind::Cpu));
    assert_eq!(cpu.host_device_bytes_per_step, None);
    assert_eq!(cpu.peak_device_bytes, None);
    let json = serde_json::to_value(&cpu).unwrap();
    assert!(json.get("host_device_bytes_per_step").is_none(), "{json}");

    let gpu = report_of(&with(&cfg, |c| c.run.device = DeviceKind::Cuda));
    let bytes = gpu
        .host_device_bytes_per_step
        .expect("a cuda run reports its host<->device bytes");
    // Every step sends its batch (token ids) to the device and reads scalars (the loss)
    // back; the counts come from the copy calls, one rank here, so they are this rank's.
    assert!(bytes.to_device > 0.0 && bytes.to_host > 0.0, "{bytes:?}");
    assert_eq!(gpu.per_rank[0].host_device_bytes_per_step, Some(bytes));
    let json = serde_json::to_value(&gpu).unwrap();
    assert_eq!(
        json["host_device_bytes_per_step"]["to_device"].as_f64(),
        Some(bytes.to_device),
        "{json}"
    );
    assert!(json["host_device_bytes_per_step"]["to_host"]
        .as_f64()
        .is_some());
    // The parameters alone are on the device (f32) during the run.
    let peak = gpu
        .peak_device_bytes
        .expect("a cuda run reports its peak device memory");
    assert!(
        peak >= 4 * gpu.parameters as u64,
        "{peak} < 4 x {} parameters",
        gpu.parameters
    );
    assert_eq!(json["peak_device_bytes"].as_u64(), Some(peak));
}

/// Once gradients are exchanged, a cuda run's report lists when each gradient range was
/// ready in backward (the scaling model's input; the launcher's tests check the cpu's):
/// every parameter once, in the order the ranges came.
#[test]
fn the_report_lists_the_exchanged_gradient_ranges_on_cuda() {
    // One timed step: the emulated driver is slow.
    let cfg = with(&small_nmt(), |c| {
        c.run.warmup_batches = 0;
        c.run.timed_batches = 1;
    });
    let report = gpu_report(&cfg, 2);
    let ready = &report.per_rank[0].gradient_ready;
    let covered: usize = ready.iter().map(|r| r.elements).sum();
    assert_eq!(covered, report.parameters, "{ready:?}");
    assert!(
        ready.windows(2).all(|w| w[0].seconds <= w[1].seconds),
        "{ready:?}"
    );
}

/// Adam's step size in these tests: Adam divides by the root of the second moment, so
/// the backends' last-bit differences in small gradients move a parameter by up to about
/// the step size; 1e-3 keeps four steps within [`BACKEND_TOLERANCE`].
const ADAM_LR: f32 = 1e-3;

/// The NMT test model, one layer each side and 8 units (the emulated driver is slow),
/// batch 3 per worker.
fn small_nmt() -> TrainConfig {
    with(&config(ModelKind::Nmt, VariableUpdate::Replicated), |c| {
        c.data.batch_size = 3;
        c.model.num_units = 8;
        c.model.num_encoder_layers = 1;
        c.model.num_decoder_layers = 1;
    })
}

/// Adam (or SGD) with a clipping norm the gradients exceed, so the clip acts.
fn clipped(cfg: &TrainConfig, optimizer: OptimizerKind) -> TrainConfig {
    with(cfg, |c| {
        c.run.optimizer = optimizer;
        c.run.max_gradient_norm = 0.5;
        if optimizer == OptimizerKind::Adam {
            c.run.learning_rate = Some(ADAM_LR);
        }
    })
}

/// The device-resident update (clip and optimizer on the device) equals the host's, on
/// one rank (nothing exchanged) and on two (the pinned exchange buffer), in f32 and with
/// f16 gradients cast and checked on the device.
#[test]
fn the_device_update_trains_like_the_cpu_on_one_and_two_ranks() {
    let base = small_nmt();
    // The GPU model updates on its device, except under parameter_server.
    let cuda = with(&base, |c| c.run.device = DeviceKind::Cuda);
    assert!(initial_model(&cuda, 100).device_resident().is_some());
    let servers = with(&cuda, |c| {
        c.exchange.variable_update = VariableUpdate::ParameterServer;
    });
    assert!(initial_model(&servers, 100).device_resident().is_none());
    for optimizer in [OptimizerKind::Sgd, OptimizerKind::Adam] {
        check_ranks(clipped(&base, optimizer), &format!("1 rank {optimizer}"), 1);
    }
    check_ranks(
        with(&clipped(&base, OptimizerKind::Adam), |c| {
            c.exchange.fp16_gradients = true;
        }),
        "1 rank adam fp16",
        1,
    );
    for fp16_gradients in [false, true] {
        let cfg = with(&clipped(&base, OptimizerKind::Adam), |c| {
            c.exchange.fp16_gradients = fp16_gradients;
            c.exchange.overlap_backward = OverlapMode::Off;
        });
        check_ranks(cfg, &format!("2 ranks adam fp16={fp16_gradients}"), 2);
    }
}

/// Rank 0's report of a `ranks`-rank run of `cfg` on the GPU.
fn gpu_report(cfg: &TrainConfig, ranks: usize) -> RunReport {
    let cfg = with(cfg, |c| c.run.device = DeviceKind::Cuda);
    let run = cfg.validate(ranks).expect("a valid test config");
    let mut reports = Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        let mut model = initial_model(&cfg, 100);
        let mut data = batches(&run, rank).into_iter();
        train(&run, comm, model.as_mut(), &mut data, &mut |_| {})
            .unwrap()
            .report
    })
    .unwrap();
    reports.remove(0)
}

/// Rank 0's host<->device bytes per timed step, as (to device, to host).
fn bytes_per_step(report: &RunReport) -> (f64, f64) {
    let b = report.per_rank[0]
        .host_device_bytes_per_step
        .expect("a cuda run counts its copies");
    (b.to_device, b.to_host)
}

/// One rank moves no gradient or parameter in a timed step: the batch goes up and a few
/// scalars come back (with f16 gradients too: the loss scale never crosses). Two ranks move exactly the gradients each way: 4 bytes per
/// parameter, 2 with f16 gradients (the same run without exchange, `independent`, moves
/// the same batches and scalars).
#[test]
fn a_step_moves_only_the_batch_scalars_and_the_exchanged_gradients() {
    let base = with(&small_nmt(), |c| {
        c.exchange.overlap_backward = OverlapMode::On;
        c.run.optimizer = OptimizerKind::Adam;
        c.run.learning_rate = Some(ADAM_LR);
    });
    let one = gpu_report(&base, 1);
    let params = one.parameters as f64;
    let (up, down) = bytes_per_step(&one);
    assert!(up > 0.0 && down > 0.0, "{up} / {down} bytes");
    assert!(
        up < params && down <= 64.0,
        "one rank moved {up} bytes up and {down} down per step ({params} parameters)"
    );
    // With f16 gradients the loss scale stays on the device: one rank sends the same
    // bytes and reads back only the cast's non-finite flag (4 bytes) more.
    let half = bytes_per_step(&gpu_report(
        &with(&base, |c| c.exchange.fp16_gradients = true),
        1,
    ));
    assert_eq!(
        (half.0, half.1),
        (up, down + 4.0),
        "one rank with f16 gradients moved {half:?} bytes, with f32 ({up}, {down})"
    );
    for (fp16_gradients, width) in [(false, 4.0), (true, 2.0)] {
        let cfg = with(&base, |c| c.exchange.fp16_gradients = fp16_gradients);
        let exchanged = bytes_per_step(&gpu_report(&cfg, 2));
        let kept = bytes_per_step(&gpu_report(
            &with(&cfg, |c| {
                c.exchange.variable_update = VariableUpdate::Independent
            }),
            2,
        ));
        // Per-step means over the timed steps: whole bytes up to the division's rounding.
        assert_eq!(
            (
                (exchanged.0 - kept.0).round(),
                (exchanged.1 - kept.1).round()
            ),
            (width * params, width * params),
            "fp16={fp16_gradients}: two ranks moved {exchanged:?} bytes, without the exchange {kept:?}"
        );
    }
}

/// The optimizer's time is part of the report's step breakdown on both devices.
#[test]
fn the_step_breakdown_reports_the_optimizer_time_on_both_devices() {
    let cfg = small_nmt();
    for device in [DeviceKind::Cpu, DeviceKind::Cuda] {
        let report = report_of(&with(&cfg, |c| c.run.device = device));
        let json = serde_json::to_value(&report).unwrap();
        let optimizer = json["per_rank"][0]["breakdown"]["optimizer"].as_f64();
        assert!(optimizer.is_some_and(|t| t > 0.0), "{device}: {json}");
        // One rank on cuda keeps its gradients on the device: no range reaches the host.
        let ready = &report.per_rank[0].gradient_ready;
        assert_eq!(
            ready.is_empty(),
            device == DeviceKind::Cuda,
            "{device}: {ready:?}"
        );
    }
}

/// A cuda run with a checkpoint after step 2 of 4, resumed for the last 2 steps, ends with
/// the parameters of the uninterrupted cuda run; both match the cpu run. The checkpoint
/// holds the device's parameters and Adam's moments.
#[test]
fn a_resumed_cuda_run_continues_exactly_as_an_uninterrupted_one() {
    use ringtrain::train::{build_model, Checkpoint, OptimizerState};

    let dir = tempfile::tempdir().unwrap();
    let base = with(&clipped(&small_nmt(), OptimizerKind::Adam), |c| {
        c.run.warmup_batches = 0;
    });
    let leg = |device: DeviceKind, name: &str, from: usize, to: usize, resume: bool| {
        let cfg = with(&base, |c| {
            c.run.device = device;
            c.run.timed_batches = to - from;
            c.output.checkpoint = Some(dir.path().join(name));
            c.output.resume = resume;
        });
        let run = cfg.validate(2).expect("a valid test config");
        let mut params = Communicator::run_local(2, |comm| {
            let rank = comm.rank();
            let mut model = build_model(&run, training_runs::VOCAB, training_runs::VOCAB, 0, 1)?;
            let mut data = batches(&run, rank).into_iter().skip(from).take(to - from);
            train(&run, comm, model.as_mut(), &mut data, &mut |_| {})?;
            Ok::<_, ringtrain::train::Error>(model.params()?.to_vec())
        })
        .unwrap();
        params.remove(0).expect("trains")
    };
    let straight = leg(DeviceKind::Cuda, "straight.ckpt", 0, 4, false);
    let cpu = leg(DeviceKind::Cpu, "cpu.ckpt", 0, 4, false);
    let first = leg(DeviceKind::Cuda, "run.ckpt", 0, 2, false);
    let ck = Checkpoint::load(&dir.path().join("run.ckpt")).unwrap();
    assert_eq!(ck.step, 2);
    assert_eq!(
        ck.params, first,
        "the checkpoint holds the device's parameters"
    );
    match &ck.optimizer {
        OptimizerState::Adam { step, m, v } => {
            assert_eq!(*step, 2);
            assert!(m.iter().any(|x| *x != 0.0) && v.iter().any(|x| *x != 0.0));
        }
        other => panic!("expected Adam state, found {other:?}"),
    }
    let resumed = leg(DeviceKind::Cuda, "run.ckpt", 2, 4, true);
    let d = max_diff(&resumed, &straight);
    assert!(d <= 1e-6, "the resumed cuda run differs by {d:e}");
    let d = max_diff(&straight, &cpu);
    assert!(d <= BACKEND_TOLERANCE, "cuda and cpu differ by {d:e}");
    assert!(
        max_diff(&first, &straight) > 1e-4,
        "the last steps changed nothing"
    );
}

/// `--timeline` on cuda: each rank's file row has the device's own times, measured with
/// CUDA events, on a row of its own: the pass, every gradient range's device-to-host
/// copy, the host-to-device copy of the sums and the update, each inside its step.
#[test]
fn the_timeline_has_a_gpu_row_per_rank_inside_the_steps() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("trace.json");
    let cfg = with(&small_nmt(), |c| {
        c.run.device = DeviceKind::Cuda;
        c.run.warmup_batches = 1;
        c.run.timed_batches = 1;
        c.exchange.overlap_backward = OverlapMode::On;
        c.output.timeline = Some(path.clone());
    });
    let run = cfg.validate(2).expect("a valid test config");
    Communicator::run_local(2, |comm| {
        let rank = comm.rank();
        let mut model = initial_model(&cfg, 100);
        let mut data = batches(&run, rank).into_iter();
        train(&run, comm, model.as_mut(), &mut data, &mut |_| {}).map(drop)
    })
    .expect("the local transport runs")
    .into_iter()
    .for_each(|r| r.expect("the rank trains"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("written")).expect("JSON");
    let events = json["traceEvents"].as_array().expect("events");
    for rank in 0..2u64 {
        let gpu_row = events
            .iter()
            .find(|e| {
                e["pid"] == rank
                    && e["name"] == "thread_name"
                    && e["args"]["name"] == "gpu (CUDA events)"
            })
            .and_then(|e| e["tid"].as_u64())
            .expect("a GPU row");
        let steps: Vec<(f64, f64)> = events
            .iter()
            .filter(|e| e["pid"] == rank && e["cat"] == "step")
            .map(|e| {
                let ts = e["ts"].as_f64().unwrap();
                (ts, ts + e["dur"].as_f64().unwrap())
            })
            .collect();
        assert_eq!(steps.len(), 2, "rank {rank}");
        let gpu: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| e["pid"] == rank && e["tid"] == gpu_row && e["ph"] == "X")
            .collect();
        let names: Vec<&str> = gpu.iter().filter_map(|e| e["name"].as_str()).collect();
        for expected in ["gpu forward+backward", "h2d", "gpu update"] {
            assert_eq!(
                names.iter().filter(|n| **n == expected).count(),
                2,
                "rank {rank}: one {expected} per step: {names:?}"
            );
        }
        assert!(
            names.iter().any(|n| n.starts_with("d2h ")),
            "rank {rank}: {names:?}"
        );
        for e in gpu {
            let ts = e["ts"].as_f64().unwrap();
            let end = ts + e["dur"].as_f64().unwrap();
            assert!(
                steps.iter().any(|&(a, b)| ts >= a - 1.0 && end <= b + 1.0),
                "rank {rank}: outside its step: {e}"
            );
        }
    }
}

/// This rank's stage of the pipeline of `cfg` over `ranks` ranks, its parameters seeded
/// per rank (the broadcast makes them equal), on a duplicate of `comm`.
fn seeded_stage(
    cfg: &TrainConfig,
    ranks: usize,
    comm: &Communicator,
) -> ringtrain::train::Result<Box<dyn TrainableModel>> {
    let seeded = with(cfg, |c| c.run.seed = 100 + comm.rank() as u64)
        .validate(ranks)
        .expect("valid");
    let stage_comm = comm.duplicate()?;
    build_pipeline_stage(
        &seeded,
        training_runs::VOCAB,
        training_runs::VOCAB,
        0,
        1,
        stage_comm,
    )
}

/// Final parameters of a `stages`-stage pipeline on the GPU over `ranks` ranks (threads
/// over the local transport, every stage on GPU 0), each stage's own range taken from
/// that stage of replica 0; the other replicas must hold the same.
fn gpu_pipeline(cfg: &TrainConfig, stages: usize, ranks: usize) -> Vec<f32> {
    let cfg = with(cfg, |c| {
        c.run.device = DeviceKind::Cuda;
        c.exchange.pipeline_stages = stages;
    });
    let run = cfg.validate(ranks).expect("a valid pipeline config");
    let per_stage = Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        let mut model = seeded_stage(&cfg, ranks, &comm)?;
        assert!(
            model.device_resident().is_some(),
            "a GPU stage updates there"
        );
        let mut data = batches(&run, run.data_worker(rank)).into_iter();
        let out = train(&run, comm, model.as_mut(), &mut data, &mut |_| {})?;
        let pipeline = out.report.pipeline.expect("the report holds the pipeline");
        assert_eq!(pipeline.stages, stages);
        let (info, _) = model.pipeline_stage().expect("a pipeline stage");
        Ok::<_, ringtrain::train::Error>((info.own_params(), model.params()?.to_vec()))
    })
    .expect("the local transport runs");
    let per_stage: Vec<_> = per_stage
        .into_iter()
        .map(|stage| stage.expect("the stage trains"))
        .collect();
    let parts: Vec<_> = per_stage
        .iter()
        .map(|(own, p)| (own.clone(), &p[..]))
        .collect();
    assemble_stages(&parts, stages)
}

/// The whole parameter vector from every rank's `(own range, parameters)`: each stage's
/// range from replica 0's rank of it (ranks `0..stages`), the other replicas' ranks
/// checked to hold the same bits.
fn assemble_stages(parts: &[(std::ops::Range<usize>, &[f32])], stages: usize) -> Vec<f32> {
    let mut full = parts[0].1.to_vec();
    for (rank, (own, params)) in parts.iter().enumerate() {
        if rank < stages {
            full[own.clone()].copy_from_slice(&params[own.clone()]);
        } else {
            let d = max_diff(&full[own.clone()], &params[own.clone()]);
            assert_eq!(
                d,
                0.0,
                "replica {} of stage {} diverged",
                rank / stages,
                rank % stages
            );
        }
    }
    full
}

/// A 2-stage pipeline with each stage on the GPU (boundary tensors staged through the
/// host, gradients summed over the micro-batches, clipped to the global norm and applied
/// by Adam on the device) ends with the parameters of one CPU rank training on the whole
/// batch: NMT under GPipe, RNNLM under 1F1B, 3 micro-batches of a batch of 4. Its
/// checkpoint (every stage's parameters and its range of Adam's moments, gathered from
/// the devices) equals the CPU run's.
#[test]
fn a_two_stage_gpu_pipeline_trains_like_one_cpu_rank() {
    use ringtrain::train::config::PipelineSchedule;
    use ringtrain::train::{Checkpoint, OptimizerState};
    let dir = tempfile::tempdir().expect("a temporary directory");
    let tiny = |model: ModelKind| {
        with(&config(model, VariableUpdate::Replicated), |c| {
            c.data.batch_size = 4;
            c.data.src_max_len = 3;
            c.model.num_units = 4;
            c.model.num_encoder_layers = 1;
            c.model.num_decoder_layers = 1;
            c.run.warmup_batches = 1;
            c.run.timed_batches = 1;
        })
    };
    for (model, schedule) in [
        (ModelKind::Nmt, PipelineSchedule::Gpipe),
        (ModelKind::Rnnlm, PipelineSchedule::OneFOneB),
    ] {
        let (gpu_ck, cpu_ck) = (
            dir.path().join(format!("{model}-gpu.ck")),
            dir.path().join(format!("{model}-cpu.ck")),
        );
        let whole = clipped(&tiny(model), OptimizerKind::Adam);
        let cfg = with(&whole, |c| {
            c.exchange.micro_batches = 3;
            c.exchange.pipeline_schedule = schedule;
            c.output.checkpoint = Some(gpu_ck.clone());
        });
        let gpu = gpu_pipeline(&cfg, 2, 2);
        let cpu = {
            let whole = with(&whole, |c| c.output.checkpoint = Some(cpu_ck.clone()));
            let run = whole.validate(1).expect("a valid config");
            Communicator::run_local(1, |comm| {
                let mut model = initial_model(&whole, 100);
                let mut data = batches(&run, 0).into_iter();
                train(&run, comm, model.as_mut(), &mut data, &mut |_| {}).unwrap();
                model.params().expect("settled").to_vec()
            })
            .expect("one rank")
            .remove(0)
        };
        let d = max_diff(&gpu, &cpu);
        assert!(
            d <= BACKEND_TOLERANCE,
            "{model} {schedule}: the GPU pipeline and one CPU rank differ by {d:e}"
        );
        let start = initial_model(&whole, 100);
        assert!(
            max_diff(start.params().expect("settled"), &gpu) > 1e-3,
            "{model}: training did not change the parameters"
        );
        let (g, c) = (
            Checkpoint::load(&gpu_ck).expect("the pipeline's checkpoint"),
            Checkpoint::load(&cpu_ck).expect("the CPU run's checkpoint"),
        );
        assert_eq!(g.step, c.step);
        let d = max_diff(&g.params, &c.params);
        assert!(
            d <= BACKEND_TOLERANCE,
            "{model}: checkpoint parameters differ by {d:e}"
        );
        match (&g.optimizer, &c.optimizer) {
            (
                OptimizerState::Adam { m, v, step },
                OptimizerState::Adam {
                    m: cm,
                    v: cv,
                    step: cs,
                },
            ) => {
                assert_eq!(step, cs);
                let (dm, dv) = (max_diff(m, cm), max_diff(v, cv));
                assert!(
                    dm <= BACKEND_TOLERANCE && dv <= BACKEND_TOLERANCE,
                    "{model}: Adam's moments differ by {dm:e} / {dv:e}"
                );
            }
            other => panic!("Adam state expected: {other:?}"),
        }
    }
}

/// 2 GPU stages x 2 replicas: each stage's summed gradients cross to the host once, are
/// all-reduced with the same stage of the other replica and come back for the update on
/// the device; the result equals one CPU rank on the whole batch (RNNLM, 1F1B, Adam
/// with clipping).
#[test]
fn a_gpu_pipeline_with_two_replicas_trains_like_one_cpu_rank() {
    use ringtrain::train::config::PipelineSchedule;
    let whole = clipped(
        &with(&config(ModelKind::Rnnlm, VariableUpdate::Replicated), |c| {
            c.data.total_batch_size = Some(4);
            c.data.src_max_len = 3;
            c.model.num_units = 4;
            c.model.num_encoder_layers = 1;
            c.run.warmup_batches = 1;
            c.run.timed_batches = 1;
        }),
        OptimizerKind::Adam,
    );
    let hybrid = with(&whole, |c| {
        c.exchange.micro_batches = 2;
        c.exchange.pipeline_schedule = PipelineSchedule::OneFOneB;
    });
    let gpu = gpu_pipeline(&hybrid, 2, 4);
    let run = whole.validate(1).expect("a valid config");
    let cpu = Communicator::run_local(1, |comm| {
        let mut model = initial_model(&whole, 100);
        let mut data = batches(&run, 0).into_iter();
        train(&run, comm, model.as_mut(), &mut data, &mut |_| {}).unwrap();
        model.params().expect("settled").to_vec()
    })
    .expect("one rank")
    .remove(0);
    let d = max_diff(&gpu, &cpu);
    assert!(
        d <= BACKEND_TOLERANCE,
        "2 GPU stages x 2 replicas and one CPU rank differ by {d:e}"
    );
}

/// Rank 0's parameters, report and (cuda) device loss scale after steps `from..to` of
/// `cfg` on two ranks, writing the checkpoint `path` (resuming from it with `resume`).
fn fp16_leg(
    cfg: &TrainConfig,
    path: &std::path::Path,
    from: usize,
    to: usize,
    resume: bool,
) -> (Vec<f32>, RunReport, Option<ringtrain::train::LossScaler>) {
    let cfg = with(cfg, |c| {
        c.run.warmup_batches = 0;
        c.run.timed_batches = to - from;
        c.output.checkpoint = Some(path.to_path_buf());
        c.output.resume = resume;
    });
    let run = cfg.validate(2).expect("a valid test config");
    let mut out = Communicator::run_local(2, |comm| {
        let rank = comm.rank();
        let mut model =
            ringtrain::train::build_model(&run, training_runs::VOCAB, training_runs::VOCAB, 0, 1)?;
        let mut data = batches(&run, rank).into_iter().skip(from).take(to - from);
        let report = train(&run, comm, model.as_mut(), &mut data, &mut |_| {})?.report;
        let on_device = match model.device_resident() {
            Some(device) => device.loss_scaler()?,
            None => None,
        };
        Ok::<_, ringtrain::train::Error>((model.params()?.to_vec(), report, on_device))
    })
    .unwrap();
    out.remove(0).expect("trains")
}

/// f16 gradients with the loss scale on the device: from a checkpoint whose scale grows
/// after every clean step (and is large enough to overflow f16 soon), the cuda run
/// resumes, doubles the scale, skips an overflowed step on every rank and halves it,
/// exactly as the host's scale does on the cpu, and writes the same scale into its
/// checkpoint; the device, not the host, holds it at the end.
#[test]
fn the_device_loss_scale_skips_grows_and_resumes_like_the_host_one() {
    use ringtrain::train::{Checkpoint, LossScaler};
    let dir = tempfile::tempdir().unwrap();
    let base = with(&clipped(&small_nmt(), OptimizerKind::Adam), |c| {
        c.exchange.fp16_gradients = true;
    });
    let start = dir.path().join("start.ckpt");
    fp16_leg(
        &with(&base, |c| c.run.device = DeviceKind::Cpu),
        &start,
        0,
        1,
        false,
    );
    let mut ck = Checkpoint::load(&start).unwrap();
    // 2^20 passes these gradients in f16 and 2^21 overflows them (the cpu run checks it).
    ck.loss_scaler = Some(LossScaler {
        scale: 2f32.powi(20),
        clean_steps: 0,
        growth_interval: 1,
        skipped_steps: 0,
    });
    let leg = |device: DeviceKind| {
        let path = dir.path().join(format!("{device}.ckpt"));
        ck.save(&path).unwrap();
        let (params, report, on_device) =
            fp16_leg(&with(&base, |c| c.run.device = device), &path, 1, 4, true);
        let written = Checkpoint::load(&path).unwrap().loss_scaler;
        (params, report, on_device, written)
    };
    let (cpu, cpu_report, cpu_device, cpu_scaler) = leg(DeviceKind::Cpu);
    let scaler = cpu_scaler.expect("an f16 run checkpoints its loss scale");
    assert_eq!(cpu_device, None);
    // Interval 1: every clean step doubles the scale, so fewer skips than steps means
    // it grew too.
    assert!(
        (1..3).contains(&scaler.skipped_steps),
        "the cpu run should skip one or two of its 3 steps: {scaler:?}"
    );
    let (gpu, gpu_report, gpu_device, gpu_scaler) = leg(DeviceKind::Cuda);
    assert_eq!(
        gpu_scaler,
        Some(scaler),
        "the checkpoints' loss scales differ"
    );
    assert_eq!(
        gpu_device,
        Some(scaler),
        "the device does not hold the loss scale"
    );
    assert_eq!(
        (gpu_report.skipped_steps, gpu_report.loss_scale),
        (cpu_report.skipped_steps, cpu_report.loss_scale)
    );
    let d = max_diff(&gpu, &cpu);
    assert!(d <= BACKEND_TOLERANCE, "cuda and cpu differ by {d:e}");
}

/// On cuda the report's launches per batch count every kernel of the step, the
/// optimizer's too (they are counted where they are launched, not by the model's pass).
#[test]
fn launches_per_batch_count_the_optimizer_kernels() {
    let launches = |report: &RunReport| report.per_rank[0].launches_per_batch;
    // One rank: the clip is one kernel more (the norm is taken either way).
    let one = |max_gradient_norm: f32| {
        launches(&gpu_report(
            &with(&small_nmt(), |c| {
                c.run.max_gradient_norm = max_gradient_norm
            }),
            1,
        ))
    };
    let (plain, clipping) = (one(0.0), one(0.5));
    assert_eq!(
        clipping - plain,
        1.0,
        "the clip is one kernel: {plain} / {clipping}"
    );
    // Two ranks with f16 gradients: a cast per gradient range backward hands over, the
    // cast back (which applies the correction: no separate scaling) and the loss scale's
    // update.
    let two = |fp16_gradients: bool| {
        gpu_report(
            &with(&small_nmt(), |c| c.exchange.fp16_gradients = fp16_gradients),
            2,
        )
    };
    let (wide, half) = (two(false), two(true));
    let ranges = half.per_rank[0].gradient_ready.len() as f64;
    assert!(ranges > 0.0, "{:?}", half.per_rank[0].gradient_ready);
    assert_eq!(
        launches(&half) - launches(&wide),
        ranges + 1.0,
        "f32: {}, f16: {}, {ranges} gradient ranges",
        launches(&wide),
        launches(&half)
    );
}

/// What one rank of a pipeline run ends with.
struct StageRun {
    /// Its stage's range of the flat parameter buffer.
    own: std::ops::Range<usize>,
    /// Its parameters (its own range current).
    params: Vec<f32>,
    /// Its report.
    report: RunReport,
    /// The loss scale its device keeps (`None` on cpu, or with f32 gradients).
    device_scale: Option<ringtrain::train::LossScaler>,
}

/// Every rank's [`StageRun`] of a `stages`-stage pipeline of `cfg` (its device as set)
/// over `ranks` ranks (threads over the local transport, every GPU stage on GPU 0),
/// training on batches `from..to`.
fn pipeline_ranks(
    cfg: &TrainConfig,
    stages: usize,
    ranks: usize,
    from: usize,
    to: usize,
) -> Vec<StageRun> {
    let cfg = with(cfg, |c| c.exchange.pipeline_stages = stages);
    let run = cfg.validate(ranks).expect("a valid pipeline config");
    Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        let mut model = seeded_stage(&cfg, ranks, &comm)?;
        let mut data = batches(&run, run.data_worker(rank))
            .into_iter()
            .skip(from)
            .take(to - from);
        let report = train(&run, comm, model.as_mut(), &mut data, &mut |_| {})?.report;
        let (info, _) = model.pipeline_stage().expect("a pipeline stage");
        let device_scale = match model.device_resident() {
            Some(device) => device.loss_scaler()?,
            None => None,
        };
        Ok::<_, ringtrain::train::Error>(StageRun {
            own: info.own_params(),
            params: model.params()?.to_vec(),
            report,
            device_scale,
        })
    })
    .expect("the local transport runs")
    .into_iter()
    .map(|r| r.expect("the stage trains"))
    .collect()
}

/// The whole parameters of a pipeline run: each stage's own range from replica 0; every
/// other replica must hold the same.
fn pipeline_params(runs: &[StageRun], stages: usize) -> Vec<f32> {
    let parts: Vec<_> = runs
        .iter()
        .map(|r| (r.own.clone(), &r.params[..]))
        .collect();
    assemble_stages(&parts, stages)
}

/// The tiny RNNLM of the pipeline tests: 4 units, windows of 3, `batch` examples per
/// replica, Adam with clipping, 2 micro-batches under 1F1B.
fn tiny_pipelined_lm(batch: usize) -> TrainConfig {
    tiny_pipelined_lm_with(batch, OptimizerKind::Adam)
}

/// [`tiny_pipelined_lm`] with `optimizer`.
fn tiny_pipelined_lm_with(batch: usize, optimizer: OptimizerKind) -> TrainConfig {
    use ringtrain::train::config::PipelineSchedule;
    clipped(
        &with(&config(ModelKind::Rnnlm, VariableUpdate::Replicated), |c| {
            c.data.batch_size = batch;
            c.data.src_max_len = 3;
            c.model.num_units = 4;
            c.model.num_encoder_layers = 1;
            c.exchange.micro_batches = 2;
            c.exchange.pipeline_schedule = PipelineSchedule::OneFOneB;
        }),
        optimizer,
    )
}

/// 2 GPU stages x 2 replicas with f16 gradients: each stage casts its summed gradients to
/// f16 on the device with the loss scale kept there, and the replicas reduce them in the
/// pinned exchange buffer. Resumed from a checkpoint whose scale grows after every clean
/// step (and soon overflows f16), the GPU pipeline (reducing overlapped with backward, and
/// after it) skips an overflowed step on every rank and grows the scale exactly as the
/// CPU pipeline's host scale does, writes the same scale into its checkpoint, holds it on
/// every rank's device, and ends with the CPU pipeline's parameters; with Adam and with
/// SGD.
#[test]
fn a_gpu_pipeline_with_replicas_keeps_the_f16_loss_scale_on_the_device_like_the_cpu_one() {
    for optimizer in [OptimizerKind::Adam, OptimizerKind::Sgd] {
        f16_pipeline_keeps_the_loss_scale_on_the_device(optimizer);
    }
}

/// [`a_gpu_pipeline_with_replicas_keeps_the_f16_loss_scale_on_the_device_like_the_cpu_one`]
/// with `optimizer`.
fn f16_pipeline_keeps_the_loss_scale_on_the_device(optimizer: OptimizerKind) {
    use ringtrain::train::{Checkpoint, LossScaler};
    let dir = tempfile::tempdir().expect("a temporary directory");
    let base = with(&tiny_pipelined_lm_with(2, optimizer), |c| {
        c.exchange.fp16_gradients = true;
        c.run.warmup_batches = 0;
    });
    let leg = |device: DeviceKind, overlap: OverlapMode, path: &std::path::Path, from, to| {
        let cfg = with(&base, |c| {
            c.run.device = device;
            c.run.timed_batches = to - from;
            c.exchange.overlap_backward = overlap;
            c.output.checkpoint = Some(path.to_path_buf());
            c.output.resume = from > 0;
        });
        pipeline_ranks(&cfg, 2, 4, from, to)
    };
    let start = dir.path().join("start.ckpt");
    leg(DeviceKind::Cpu, OverlapMode::Off, &start, 0, 1);
    let mut ck = Checkpoint::load(&start).expect("the first leg's checkpoint");
    // 2^20 passes these gradients in f16 and a few doublings overflow them (the cpu run
    // checks it skips).
    ck.loss_scaler = Some(LossScaler {
        scale: 2f32.powi(20),
        clean_steps: 0,
        growth_interval: 1,
        skipped_steps: 0,
    });
    let resumed = |device: DeviceKind, overlap: OverlapMode| {
        let path = dir.path().join(format!("{device}-{overlap}.ckpt"));
        ck.save(&path).expect("the start checkpoint is written");
        let runs = leg(device, overlap, &path, 1, 4);
        let written = Checkpoint::load(&path)
            .expect("the leg's checkpoint")
            .loss_scaler;
        (runs, written)
    };
    let (cpu, cpu_scaler) = resumed(DeviceKind::Cpu, OverlapMode::Off);
    let scaler = cpu_scaler.expect("an f16 run checkpoints its loss scale");
    assert!(
        (1..3).contains(&scaler.skipped_steps),
        "{optimizer}: the cpu pipeline should skip one or two of its 3 steps: {scaler:?}"
    );
    assert!(cpu.iter().all(|r| r.device_scale.is_none()));
    let cpu_params = pipeline_params(&cpu, 2);
    for overlap in [OverlapMode::On, OverlapMode::Off] {
        let (gpu, gpu_scaler) = resumed(DeviceKind::Cuda, overlap);
        assert_eq!(
            gpu_scaler,
            Some(scaler),
            "{optimizer} {overlap}: the checkpoints' loss scales differ"
        );
        for (rank, run) in gpu.iter().enumerate() {
            assert_eq!(
                run.device_scale,
                Some(scaler),
                "{optimizer} {overlap}: rank {rank}'s device does not hold the loss scale"
            );
        }
        let (g, c) = (&gpu[0].report, &cpu[0].report);
        assert_eq!(
            (g.skipped_steps, g.loss_scale),
            (c.skipped_steps, c.loss_scale),
            "{optimizer} {overlap}"
        );
        let d = max_diff(&pipeline_params(&gpu, 2), &cpu_params);
        assert!(
            d <= BACKEND_TOLERANCE,
            "{optimizer} {overlap}: the GPU and CPU pipelines differ by {d:e}"
        );
    }
}

/// A GPU stage's summed gradients cross to the host only with replicas, once each way, in
/// its pinned exchange buffer: against the same stages without replicas (whose steps move
/// the batch, the boundary tensors and a few scalars), a step with 2 replicas moves
/// exactly 4 more bytes per parameter of the stage each way, and with f16 gradients (cast
/// on the device) 2, plus the read of the cast's non-finite flag (4 bytes); the loss
/// scale never crosses.
#[test]
fn a_gpu_stage_moves_its_gradients_only_to_its_replicas_and_in_f16_half_the_bytes() {
    let base = with(&tiny_pipelined_lm(2), |c| {
        c.run.device = DeviceKind::Cuda;
        c.run.warmup_batches = 1;
        c.run.timed_batches = 1;
    });
    let bytes = |cfg: &TrainConfig, ranks: usize| -> Vec<(f64, f64, usize)> {
        let runs = pipeline_ranks(cfg, 2, ranks, 0, 2);
        let per_rank = &runs[0].report.per_rank;
        runs.iter()
            .enumerate()
            .map(|(rank, run)| {
                let b = per_rank[rank]
                    .host_device_bytes_per_step
                    .expect("a cuda run counts its copies");
                (b.to_device, b.to_host, run.own.len())
            })
            .collect()
    };
    let alone = bytes(&base, 2);
    for (fp16_gradients, width, flag) in [(false, 4.0, 0.0), (true, 2.0, 4.0)] {
        let cfg = with(&base, |c| c.exchange.fp16_gradients = fp16_gradients);
        let replicated = bytes(&cfg, 4);
        for (rank, &(up, down, own)) in replicated.iter().enumerate() {
            let (alone_up, alone_down, alone_own) = alone[rank % 2];
            assert_eq!(own, alone_own);
            let own = own as f64;
            assert_eq!(
                ((up - alone_up).round(), (down - alone_down).round()),
                (width * own, width * own + flag),
                "fp16={fp16_gradients} rank {rank} ({own} parameters in its stage): \
                 ({up}, {down}) bytes per step, without replicas ({alone_up}, {alone_down})"
            );
        }
    }
}
