//! A tiny NMT model learns to copy its source (target = source) with Adam.
//!
//! Bound: after 300 Adam steps (lr 1e-2) the mean per-token loss of a fresh batch falls
//! below 0.1 nats, from about ln(8) = 2.08 at initialisation.

mod toy;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_model::{
    BiLayerInput, EncoderKind, LstmImpl, Model, NmtBatchView, NmtConfig, NmtModel, SourceLengths,
};

const BOS: u32 = 0;
const EOS: u32 = 1;

struct CopyBatch {
    src: Vec<u32>,
    tgt_in: Vec<u32>,
    tgt_out: Vec<u32>,
    mask: Vec<f32>,
}

/// Time-major copy batch: tgt_in = BOS + src, tgt_out = src + EOS.
fn copy_batch(rng: &mut ChaCha8Rng, vocab: u32, batch: usize, len: usize) -> CopyBatch {
    let src: Vec<u32> = (0..len * batch).map(|_| rng.gen_range(2..vocab)).collect();
    let mut tgt_in = vec![BOS; batch];
    tgt_in.extend_from_slice(&src);
    let mut tgt_out = src.clone();
    tgt_out.extend(std::iter::repeat_n(EOS, batch));
    let mask = vec![1.0; (len + 1) * batch];
    CopyBatch {
        src,
        tgt_in,
        tgt_out,
        mask,
    }
}

fn view(b: &CopyBatch, batch: usize, len: usize) -> NmtBatchView<'_> {
    NmtBatchView {
        batch,
        src_len: len,
        tgt_len: len + 1,
        src: &b.src,
        tgt_in: &b.tgt_in,
        tgt_out: &b.tgt_out,
        tgt_mask: &b.mask,
        src_lengths: None,
    }
}

#[test]
fn copy_task_loss_falls_with_adam() {
    let config = NmtConfig {
        src_vocab: 8,
        tgt_vocab: 8,
        emb: 16,
        hidden: 32,
        layers: 2,
        encoder: EncoderKind::Bi,
        lstm: LstmImpl::Fused,
        source_lengths: SourceLengths::Off,
        bi_layer_input: BiLayerInput::Own,
        init_scale: 0.1,
        forget_bias: 1.0,
    };
    let (batch, len) = (32, 4);
    let mut model = NmtModel::new(toy::cpu(1), config, 1).expect("model");
    let n = model.layout().total_len();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let probe = copy_batch(&mut rng, 8, batch, len);
    let initial = model
        .forward_loss(&view(&probe, batch, len))
        .expect("loss")
        .mean_loss();
    assert!((initial - 8f64.ln()).abs() < 0.2, "initial loss {initial}");
    for step in 1..=300u32 {
        let data = copy_batch(&mut rng, 8, batch, len);
        let stats = model
            .forward_backward(&view(&data, batch, len), &mut |_, _| {})
            .expect("step");
        let (params, grads) = model.params_and_grads_mut();
        // Mean loss gradient: scale the summed-loss gradient by 1/tokens.
        let inv_tokens = (1.0 / stats.tokens) as f32;
        grads.iter_mut().for_each(|g| *g *= inv_tokens);
        ringtrain_kernels::adam_step(
            params, grads, &mut m, &mut v, 1e-2, 0.9, 0.999, 1e-8, 0.0, step,
        )
        .expect("adam");
    }
    let fresh = copy_batch(&mut rng, 8, batch, len);
    let final_loss = model
        .forward_loss(&view(&fresh, batch, len))
        .expect("loss")
        .mean_loss();
    assert!(
        final_loss < 0.1,
        "copy task loss {final_loss} did not fall below 0.1 (from {initial})"
    );
}
