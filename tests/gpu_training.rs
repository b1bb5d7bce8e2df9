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
    train, DeviceKind, LstmImpl, ModelKind, OptimizerKind, OverlapMode, RunReport, TrainConfig,
    VariableUpdate,
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
            cfg.data.eval_data = vec![files.nmt_dev_src.clone(), files.nmt_dev_tgt.clone()];
        } else {
            cfg.data.data = vec![files.lm_train.clone(), files.lm_vocab.clone()];
            cfg.data.eval_data = vec![files.lm_valid.clone()];
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
/// scalars come back. Two ranks move exactly the gradients each way: 4 bytes per
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
