//! Training on the GPU through the trainer: two ranks (threads over the collective's local
//! transport, both on GPU 0) train NMT and RNNLM with the CUDA backend and end with the
//! parameters the same run reaches on the CPU backend. This covers the trainer's GPU path:
//! pinned host mirrors, gradient ranges copied on the copy stream while backward runs
//! (with and without the overlapped reduction), f16 gradients on the wire, and the
//! parameter upload after each update. Needs the `cuda` feature and a GPU (device 0);
//! built by `scripts/build-gpu-bundle` and run by `scripts/gpu-check`.
#![cfg(feature = "cuda")]

mod training_runs;

use ringtrain::train::{DeviceKind, LstmImpl, ModelKind, OverlapMode, TrainConfig, VariableUpdate};
use training_runs::{config, initial_model, max_diff, run, with};

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
