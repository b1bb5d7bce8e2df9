//! Launch counts per batch equal the counts derived below, and fused < stepwise.
//!
//! Fused LSTM layer of T steps. Forward: input GEMM, 2 initial-state writes, and per step
//! a recurrent GEMM and a pointwise kernel. Backward: T-1 recurrent GEMMs, T pointwise
//! kernels, the dh0 GEMM when the initial state is trainable, dW_ih, dW_hh, db and dX.
//!
//! Stepwise layer. Forward per step: 4 input GEMMs, 4 recurrent GEMMs, 4 bias adds,
//! 4 activations and 5 cell operations (21). Backward per step: 4 recurrent GEMMs (not at
//! the first processed step), 12 element-wise operations, 12 weight-gradient operations
//! and 4 dX GEMMs; then 4 dh0 GEMMs when needed.
//!
//! Around the layers. Forward: 1 gather per embedding; projection GEMM, softmax and loss
//! sum (the logits fit one chunk here); in a training pass the CPU's softmax also leaves
//! the loss's gradient (one launch for both), and the projection's dW and dH GEMMs follow
//! while the chunk is held. Backward: the copy of dW_proj into the gradients; 1 zero-fill
//! of dc per decoder or LM layer; per
//! encoder layer a dh set-up (top: fill and copy of the decoder's dh0; below: 1 add) and a
//! copy of the decoder's dc0; fill and scatter-add per embedding. The RNNLM copies each
//! layer's final `h` and `c` after forward (the state it carries to the next window).

mod toy;

use ringtrain_model::{EncoderKind, LstmImpl, Model, NmtConfig, NmtModel, RnnLm};

fn layer_forward(lstm: LstmImpl, t: u64) -> u64 {
    match lstm {
        LstmImpl::Fused => 1 + 2 + 2 * t,
        LstmImpl::Stepwise => 2 + 21 * t,
    }
}

fn layer_backward(lstm: LstmImpl, t: u64, dh0: bool) -> u64 {
    match lstm {
        LstmImpl::Fused => (t - 1) + t + u64::from(dh0) + 3 + 1,
        LstmImpl::Stepwise => 4 * (t - 1) + 12 * t + 12 * t + 4 * t + 4 * u64::from(dh0),
    }
}

/// The projection of one chunk of logits: GEMM, softmax, loss sum.
const PROJECTION_FORWARD: u64 = 3;
/// ...in a training pass also its dW and dH GEMMs...
const PROJECTION_GRADIENTS: u64 = 2;
/// ...and backward's copy of dW into the gradients.
const PROJECTION_BACKWARD: u64 = 1;

fn nmt_expected(c: &NmtConfig, ts: u64, tt: u64) -> u64 {
    let l = c.layers as u64;
    let tops = match c.encoder {
        EncoderKind::Bi => 2,
        EncoderKind::Uni => 1,
    };
    let forward = 2
        + l * layer_forward(c.lstm, ts)
        + l * layer_forward(c.lstm, tt)
        + PROJECTION_FORWARD
        + PROJECTION_GRADIENTS;
    let decoder_backward = l * (1 + layer_backward(c.lstm, tt, true));
    let encoder_backward = l * (1 + layer_backward(c.lstm, ts, false)) + tops * 2 + (l - tops);
    forward + PROJECTION_BACKWARD + decoder_backward + 2 + encoder_backward + 2
}

fn nmt_measured(c: NmtConfig, ts: usize, tt: usize) -> u64 {
    let data = toy::NmtData::random(&c, 3, ts, tt, 1);
    let mut model = NmtModel::new(toy::cpu(1), c, 1).expect("model");
    let first = model
        .forward_backward(&data.view(), &mut |_, _| {})
        .expect("step")
        .launches;
    let second = model
        .forward_backward(&data.view(), &mut |_, _| {})
        .expect("step")
        .launches;
    assert_eq!(
        first, second,
        "launch count must not depend on workspace allocation"
    );
    first
}

#[test]
fn nmt_launch_counts_match_formula() {
    for encoder in [EncoderKind::Bi, EncoderKind::Uni] {
        for layers in [2, 4] {
            let (ts, tt) = (5, 4);
            let fused = toy::tiny_nmt(encoder, layers, LstmImpl::Fused);
            let stepwise = toy::tiny_nmt(encoder, layers, LstmImpl::Stepwise);
            let (ef, es) = (
                nmt_expected(&fused, ts as u64, tt as u64),
                nmt_expected(&stepwise, ts as u64, tt as u64),
            );
            let (mf, ms) = (nmt_measured(fused, ts, tt), nmt_measured(stepwise, ts, tt));
            assert_eq!(mf, ef, "fused {encoder:?} {layers} layers");
            assert_eq!(ms, es, "stepwise {encoder:?} {layers} layers");
            assert!(mf < ms);
        }
    }
}

#[test]
fn benchmark_config_launch_counts() {
    // The CPU benchmark shape (length 30 both sides); counted on a tiny model of the
    // same structure, since counts do not depend on widths or batch.
    let fused = NmtConfig {
        src_vocab: 7,
        tgt_vocab: 6,
        emb: 4,
        hidden: 4,
        ..NmtConfig::benchmark()
    };
    let stepwise = NmtConfig {
        lstm: LstmImpl::Stepwise,
        ..fused.clone()
    };
    assert_eq!(nmt_expected(&fused, 30, 30), 526);
    assert_eq!(nmt_expected(&stepwise, 30, 30), 6380);
    assert_eq!(nmt_measured(fused, 30, 30), 526);
    assert_eq!(nmt_measured(stepwise, 30, 30), 6380);
}

#[test]
fn rnnlm_launch_counts_match_formula() {
    for lstm in [LstmImpl::Fused, LstmImpl::Stepwise] {
        let config = toy::tiny_lm(3, lstm);
        let t = 6u64;
        let data = toy::LmData::random(&config, 2, t as usize, 3);
        let mut model = RnnLm::new(toy::cpu(1), config, 1).expect("model");
        let measured = model
            .forward_backward(&data.view(), &mut |_, _| {})
            .expect("step")
            .launches;
        let carry = 3 * 2;
        let expected = 1
            + 3 * layer_forward(lstm, t)
            + PROJECTION_FORWARD
            + PROJECTION_GRADIENTS
            + carry
            + PROJECTION_BACKWARD
            + 3 * (1 + layer_backward(lstm, t, false))
            + 2;
        assert_eq!(measured, expected, "{lstm:?}");
        let forward_only = model.forward_loss(&data.view()).expect("forward").launches;
        assert_eq!(
            forward_only,
            1 + 3 * layer_forward(lstm, t) + PROJECTION_FORWARD + carry,
            "{lstm:?} forward"
        );
    }
}
