//! Training on the GPU through the trainer: two ranks (threads over the collective's local
//! transport, both on GPU 0) train NMT and RNNLM with the CUDA backend and end with the
//! parameters the same run reaches on the CPU backend. This covers the trainer's GPU path:
//! pinned host mirrors, gradient ranges copied on the copy stream while backward runs
//! (with and without the overlapped reduction), f16 gradients on the wire, and the
//! parameter upload after each update. Needs the `cuda` feature and a GPU (device 0);
//! built by `scripts/build-gpu-bundle` and run by `scripts/gpu-check`.
#![cfg(feature = "cuda")]

mod training_runs;

use ringtrain::train::{
    build_model, DeviceKind, EncoderType, ModelKind, TrainConfig, VariableUpdate,
};
use training_runs::{config, max_diff, run, VOCAB};

/// CPU and GPU differ in GEMM summation order and in the approximate exponentials of the
/// activations (about 1e-6 relative per operation); four SGD steps of this small model keep
/// the parameters within this bound (the model-level test allows the same after five).
const BACKEND_TOLERANCE: f32 = 1e-4;

fn on(device: DeviceKind, cfg: &TrainConfig) -> Vec<Vec<f32>> {
    run(
        &TrainConfig {
            device,
            ..cfg.clone()
        },
        2,
    )
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
    let start = build_model(
        &TrainConfig {
            seed: 100,
            ..cfg.clone()
        },
        VOCAB,
        VOCAB,
        0,
        1,
    )
    .expect("the CPU model builds");
    assert!(
        max_diff(start.params(), &gpu[0]) > 1e-3,
        "{what}: training did not change the parameters"
    );
}

#[test]
fn nmt_trains_to_the_cpu_parameters_with_and_without_overlap() {
    // The gradient path is the same for both LSTM implementations (the stepwise one is
    // compared with the CPU in the model crate's cuda_backend test): fused only here.
    for overlap_backward in [false, true] {
        let cfg = TrainConfig {
            batch_size: 3,
            overlap_backward,
            encoder_type: EncoderType::Fused,
            ..config(ModelKind::Nmt, VariableUpdate::Replicated)
        };
        check(cfg, &format!("nmt overlap={overlap_backward}"));
    }
}

#[test]
fn rnnlm_trains_to_the_cpu_parameters() {
    let cfg = TrainConfig {
        batch_size: 3,
        overlap_backward: true,
        ..config(ModelKind::Rnnlm, VariableUpdate::Replicated)
    };
    check(cfg, "rnnlm");
}

#[test]
fn fp16_gradients_on_the_wire_train_like_the_cpu() {
    let cfg = TrainConfig {
        batch_size: 3,
        fp16_gradients: true,
        ..config(ModelKind::Nmt, VariableUpdate::Replicated)
    };
    check(cfg, "nmt fp16 gradients");
}

#[test]
fn parameter_server_on_the_gpu_trains_like_the_cpu() {
    let cfg = TrainConfig {
        batch_size: 2,
        ..config(ModelKind::Nmt, VariableUpdate::ParameterServer)
    };
    check(cfg, "nmt parameter_server");
}
