//! The CPU backend in bf16 (`CpuBackend::with_precision(_, GemmPrecision::Bf16)`): matrix
//! products on bf16 operands with f32 accumulation, everything else f32.
//!
//! - At the `train_step` benchmark's configuration (NMT vocab 8000, 256 units, 2 bi
//!   encoder + 2 decoder layers, length 30, batch 64) the loss per token in bf16 is within
//!   2e-2 of f32.
//! - The gradients stay close to f32's (relative norm of the difference below 5e-2) for
//!   both models, serial and on two threads; the two thread counts give the same bits.
//! - f16 is refused on the CPU.

mod toy;

use ringtrain_model::{
    BiLayerInput, CpuBackend, EncoderKind, GemmPrecision, LstmImpl, Model, NmtConfig, NmtModel,
    RnnLm, SourceLengths,
};

fn backend(threads: usize, precision: GemmPrecision) -> CpuBackend {
    match CpuBackend::with_precision(threads, precision) {
        Ok(b) => b,
        Err(e) => panic!("cpu backend: {e}"),
    }
}

/// `|a - b| / |b|` over whole vectors.
fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        diff += f64::from(x - y).powi(2);
        norm += f64::from(*y).powi(2);
    }
    (diff / norm).sqrt()
}

fn bench_config() -> NmtConfig {
    NmtConfig {
        src_vocab: 8000,
        tgt_vocab: 8000,
        emb: 256,
        hidden: 256,
        layers: 2,
        encoder: EncoderKind::Bi,
        lstm: LstmImpl::Fused,
        source_lengths: SourceLengths::Off,
        bi_layer_input: BiLayerInput::Own,
        init_scale: 0.1,
        forget_bias: 1.0,
    }
}

#[test]
fn the_loss_in_bf16_is_within_2e_2_of_f32_at_the_benchmark_configuration() {
    let config = bench_config();
    let data = toy::NmtData::random(&config, 64, 30, 30, 5);
    let loss = |precision| {
        let mut model = NmtModel::new(backend(2, precision), config.clone(), 11).expect("model");
        let stats = model
            .forward_backward(&data.view(), &mut |_, _| {})
            .expect("step");
        stats.loss_sum / stats.tokens
    };
    let (f32_loss, bf16_loss) = (loss(GemmPrecision::F32), loss(GemmPrecision::Bf16));
    println!("loss per token: f32 {f32_loss:.6}, bf16 {bf16_loss:.6}");
    assert!(f32_loss.is_finite() && f32_loss > 1.0, "{f32_loss}");
    assert!(
        (bf16_loss - f32_loss).abs() < 2e-2,
        "loss per token: bf16 {bf16_loss} against f32 {f32_loss}"
    );
}

#[test]
fn nmt_gradients_in_bf16_stay_close_to_f32_and_threads_give_the_same_bits() {
    let config = NmtConfig {
        src_vocab: 40,
        tgt_vocab: 50,
        emb: 24,
        hidden: 32,
        init_scale: 0.3,
        ..toy::tiny_nmt(EncoderKind::Bi, 2, LstmImpl::Fused)
    };
    let data = toy::NmtData::random(&config, 6, 7, 8, 3);
    let run = |threads, precision| {
        let mut model =
            NmtModel::new(backend(threads, precision), config.clone(), 9).expect("model");
        model
            .forward_backward(&data.view(), &mut |_, _| {})
            .expect("step");
        model.grads().clone()
    };
    let reference = run(1, GemmPrecision::F32);
    let serial = run(1, GemmPrecision::Bf16);
    let parallel = run(2, GemmPrecision::Bf16);
    assert_ne!(
        serial, reference,
        "bf16 rounds the operands: some gradient differs"
    );
    let rel = relative_difference(&serial, &reference);
    println!("nmt: relative gradient difference bf16 / f32 {rel:.2e}");
    assert!(rel < 5e-2, "relative gradient difference {rel}");
    assert_eq!(
        serial.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        parallel.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "1 and 2 threads"
    );
}

#[test]
fn rnnlm_gradients_in_bf16_stay_close_to_f32() {
    let config = ringtrain_model::LmConfig {
        vocab: 60,
        emb: 24,
        hidden: 32,
        init_scale: 0.3,
        ..toy::tiny_lm(2, LstmImpl::Fused)
    };
    let data = toy::LmData::random(&config, 5, 9, 4);
    let run = |precision| {
        let mut model = RnnLm::new(backend(1, precision), config.clone(), 2).expect("model");
        let stats = model
            .forward_backward(&data.view(), &mut |_, _| {})
            .expect("step");
        (stats.loss_sum, model.grads().clone())
    };
    let (loss32, grads32) = run(GemmPrecision::F32);
    let (loss16, grads16) = run(GemmPrecision::Bf16);
    assert!(
        (loss16 - loss32).abs() / loss32 < 1e-2,
        "{loss16} vs {loss32}"
    );
    let rel = relative_difference(&grads16, &grads32);
    assert!(
        rel > 0.0 && rel < 5e-2,
        "relative gradient difference {rel}"
    );
}

#[test]
fn f16_is_refused_on_the_cpu_and_the_path_is_named() {
    let err = CpuBackend::with_precision(1, GemmPrecision::F16).unwrap_err();
    assert!(err.to_string().contains("use bf16"), "{err}");
    let b = backend(1, GemmPrecision::Bf16);
    assert_eq!(b.precision(), GemmPrecision::Bf16);
    let path = b.bf16_path().expect("a bf16 path");
    assert!(path.available(), "{}", path.name());
    assert_eq!(backend(1, GemmPrecision::F32).bf16_path(), None);
}
