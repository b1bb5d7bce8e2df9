//! Training on the GPU through the trainer: two ranks (threads over the collective's local
//! transport, both on GPU 0) train NMT and RNNLM with the CUDA backend and end with the
//! parameters the same run reaches on the CPU backend. This covers the trainer's GPU path:
//! pinned host mirrors, gradient ranges copied on the copy stream while backward runs
//! (with and without the overlapped reduction), f16 gradients on the wire, and the
//! parameter upload after each update. Needs the `cuda` feature and a GPU (device 0);
//! built by `scripts/build-gpu-bundle` and run by `scripts/gpu-check`.
#![cfg(feature = "cuda")]

mod training_runs;

use ringtrain::collective::Communicator;
use ringtrain::train::{
    train, DeviceKind, LstmImpl, ModelKind, OverlapMode, RunReport, TrainConfig, VariableUpdate,
};
use training_runs::{batches, config, initial_model, max_diff, run, with};

/// CPU and GPU differ in GEMM summation order and in the approximate exponentials of the
/// activations (about 1e-6 relative per operation); four SGD steps of this small model keep
/// the parameters within this bound (the model-level test allows the same after five).
const BACKEND_TOLERANCE: f32 = 1e-4;

fn on(device: DeviceKind, cfg: &TrainConfig) -> Vec<Vec<f32>> {
    run(&with(cfg, |c| c.run.device = device), 2)
}

fn check(cfg: TrainConfig, what: &str) {
    let cpu = on(DeviceKind::Cpu, &cfg);
    let gpu = on(DeviceKind::Cuda, &cfg);
    assert_eq!(
        max_diff(&gpu[0], &gpu[1]),
        0.0,
        "{what}: the two GPU replicas diverged"
    );
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
