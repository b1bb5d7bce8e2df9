//! The fused and the stepwise LSTM give the same loss and gradients, for every combination
//! of the model's semantic options (source lengths on/off, bi-layer input concat/own, uni
//! and bi encoders), and the serial and 2-thread CPU backends agree.
//!
//! Tolerance: loss within 1e-5 relative; every gradient element within
//! 1e-5 + 1e-4 * max|grad| of its tensor (the two differ only in summation order and in
//! how the sigmoid/tanh are evaluated).

mod toy;

use ringtrain_model::{
    BiLayerInput, EncoderKind, LstmImpl, Model, NmtModel, RnnLm, SourceLengths, StepStats,
};

fn assert_same(
    name: &str,
    a: (StepStats, Vec<f32>),
    b: (StepStats, Vec<f32>),
    layout: &ringtrain_model::ParamLayout,
) {
    let (sa, ga) = a;
    let (sb, gb) = b;
    assert_eq!(sa.tokens, sb.tokens);
    let rel = (sa.loss_sum - sb.loss_sum).abs() / sa.loss_sum.abs();
    assert!(
        rel < 1e-5,
        "{name}: loss {} vs {}",
        sa.loss_sum,
        sb.loss_sum
    );
    for e in layout.entries() {
        let (ta, tb) = (&ga[e.range()], &gb[e.range()]);
        let scale = ta.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.0, "{name}: {} has an all-zero gradient", e.name);
        for (i, (x, y)) in ta.iter().zip(tb).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 + 1e-4 * scale,
                "{name}: {}[{i}] = {x} vs {y} (tensor max {scale})",
                e.name
            );
        }
    }
}

/// The semantic options of an NMT run.
#[derive(Debug, Clone, Copy)]
struct Semantics {
    source_lengths: SourceLengths,
    bi_layer_input: BiLayerInput,
}

const TODAY: Semantics = Semantics {
    source_lengths: SourceLengths::Off,
    bi_layer_input: BiLayerInput::Own,
};

fn every_semantics() -> Vec<Semantics> {
    let mut all = Vec::new();
    for source_lengths in [SourceLengths::Off, SourceLengths::On] {
        for bi_layer_input in [BiLayerInput::Own, BiLayerInput::Concat] {
            all.push(Semantics {
                source_lengths,
                bi_layer_input,
            });
        }
    }
    all
}

fn nmt_run(
    encoder: EncoderKind,
    lstm: LstmImpl,
    threads: usize,
    semantics: Semantics,
) -> (StepStats, Vec<f32>, ringtrain_model::ParamLayout) {
    let config = ringtrain_model::NmtConfig {
        hidden: 16,
        emb: 12,
        src_vocab: 20,
        tgt_vocab: 24,
        init_scale: 0.3,
        source_lengths: semantics.source_lengths,
        bi_layer_input: semantics.bi_layer_input,
        ..toy::tiny_nmt(encoder, 4, lstm)
    };
    let data = toy::NmtData::random(&config, 5, 6, 7, 21);
    let mut model = NmtModel::new(toy::cpu(threads), config, 3).expect("model");
    let stats = model
        .forward_backward(&data.view(), &mut |_, _| {})
        .expect("step");
    (stats, model.grads().clone(), model.layout().clone())
}

#[test]
fn nmt_bi_fused_equals_stepwise() {
    for sem in every_semantics() {
        let (sf, gf, layout) = nmt_run(EncoderKind::Bi, LstmImpl::Fused, 1, sem);
        let (ss, gs, _) = nmt_run(EncoderKind::Bi, LstmImpl::Stepwise, 1, sem);
        assert_same(&format!("nmt bi {sem:?}"), (sf, gf), (ss, gs), &layout);
    }
}

#[test]
fn nmt_uni_fused_equals_stepwise() {
    for sem in every_semantics() {
        let (sf, gf, layout) = nmt_run(EncoderKind::Uni, LstmImpl::Fused, 1, sem);
        let (ss, gs, _) = nmt_run(EncoderKind::Uni, LstmImpl::Stepwise, 1, sem);
        assert_same(&format!("nmt uni {sem:?}"), (sf, gf), (ss, gs), &layout);
    }
}

#[test]
fn rnnlm_fused_equals_stepwise() {
    let run = |lstm| {
        let config = ringtrain_model::LmConfig {
            hidden: 16,
            emb: 12,
            vocab: 30,
            init_scale: 0.3,
            ..toy::tiny_lm(3, lstm)
        };
        let data = toy::LmData::random(&config, 4, 9, 22);
        let next = toy::LmData::random(&config, 4, 9, 23);
        let mut model = RnnLm::new(toy::cpu(1), config, 4).expect("model");
        model
            .forward_backward(&data.view(), &mut |_, _| {})
            .expect("step");
        // The second window starts from the state the first one carried.
        let view = ringtrain_model::LmBatchView {
            first_in_epoch: false,
            ..next.view()
        };
        let stats = model.forward_backward(&view, &mut |_, _| {}).expect("step");
        (stats, model.grads().clone(), model.layout().clone())
    };
    let (sf, gf, layout) = run(LstmImpl::Fused);
    let (ss, gs, _) = run(LstmImpl::Stepwise);
    assert_same("rnnlm", (sf, gf), (ss, gs), &layout);
}

#[test]
fn two_threads_equal_one_thread() {
    for sem in [TODAY, every_semantics()[3]] {
        let (s1, g1, layout) = nmt_run(EncoderKind::Bi, LstmImpl::Fused, 1, sem);
        let (s2, g2, _) = nmt_run(EncoderKind::Bi, LstmImpl::Fused, 2, sem);
        assert_same(&format!("threads {sem:?}"), (s1, g1), (s2, g2), &layout);
    }
}
