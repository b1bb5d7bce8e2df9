//! What the model computes, apart from how: source lengths, the bi encoder's layer input,
//! the RNNLM's carried state, and the parameter counts of the seeds' configurations.

mod toy;

use ringtrain_model::{
    BiLayerInput, EncoderKind, LmBatchView, LmState, LstmImpl, Model, NmtBatchView, NmtConfig,
    NmtModel, RnnLm, SourceLengths, StepStats,
};

const IMPLS: [LstmImpl; 2] = [LstmImpl::Fused, LstmImpl::Stepwise];

fn nmt_config(encoder: EncoderKind, lstm: LstmImpl, sl: SourceLengths) -> NmtConfig {
    NmtConfig {
        src_vocab: 9,
        tgt_vocab: 8,
        emb: 6,
        hidden: 5,
        source_lengths: sl,
        bi_layer_input: BiLayerInput::Concat,
        init_scale: 0.4,
        ..toy::tiny_nmt(encoder, 4, lstm)
    }
}

fn step(
    model: &mut NmtModel<ringtrain_model::CpuBackend>,
    b: &NmtBatchView<'_>,
) -> (StepStats, Vec<f32>) {
    let stats = model.forward_backward(b, &mut |_, _| {}).expect("step");
    (stats, model.grads().clone())
}

/// The id only padded source positions use (no real token is it).
const PAD_ONLY: u32 = 8;

/// Toy data whose padded source positions all hold `PAD_ONLY`, real ones never.
fn padded_data(c: &NmtConfig, seed: u64) -> toy::NmtData {
    let mut data = toy::NmtData::random(c, 4, 5, 4, seed);
    for t in 0..data.src_len {
        for b in 0..data.batch {
            let cell = &mut data.src[t * data.batch + b];
            if t >= data.src_lengths[b] {
                *cell = PAD_ONLY;
            } else if *cell == PAD_ONLY {
                *cell = 1;
            }
        }
    }
    assert_eq!(data.src_lengths, [5, 4, 3, 2]);
    data
}

fn embedding_row(
    model: &NmtModel<ringtrain_model::CpuBackend>,
    grads: &[f32],
    id: u32,
) -> Vec<f32> {
    let e = model
        .layout()
        .entries()
        .iter()
        .find(|e| e.name == "embedding/src")
        .expect("source embedding");
    let width = model.config().emb;
    let start = e.offset + id as usize * width;
    grads[start..start + width].to_vec()
}

#[test]
fn padded_source_tokens_change_nothing_with_source_lengths() {
    for encoder in [EncoderKind::Uni, EncoderKind::Bi] {
        for lstm in IMPLS {
            let config = nmt_config(encoder, lstm, SourceLengths::On);
            let data = padded_data(&config, 31);
            let mut other = padded_data(&config, 31);
            for t in 0..other.src_len {
                for b in 0..other.batch {
                    if t >= other.src_lengths[b] {
                        other.src[t * other.batch + b] = (t + b) as u32 % 8;
                    }
                }
            }
            let mut model = NmtModel::new(toy::cpu(1), config.clone(), 2).expect("model");
            let (sa, ga) = step(&mut model, &data.view());
            let pad_row = embedding_row(&model, &ga, PAD_ONLY);
            let (sb, gb) = step(&mut model, &other.view());
            let what = format!("{encoder:?} {lstm:?}");
            assert_eq!(sa.loss_sum, sb.loss_sum, "{what}: loss");
            assert_eq!(ga, gb, "{what}: gradients");
            assert!(
                pad_row.iter().all(|&g| g == 0.0),
                "{what}: the padding-only id's embedding row got gradient {pad_row:?}"
            );

            // Without source lengths the same padding is read: loss and the row change.
            let config = NmtConfig {
                source_lengths: SourceLengths::Off,
                ..config
            };
            let mut model = NmtModel::new(toy::cpu(1), config, 2).expect("model");
            let (sa, ga) = step(&mut model, &data.view());
            let (sb, _) = step(&mut model, &other.view());
            assert_ne!(sa.loss_sum, sb.loss_sum, "{what}: off reads padding");
            assert!(embedding_row(&model, &ga, PAD_ONLY)
                .iter()
                .any(|&g| g != 0.0));
        }
    }
}

/// A padded sentence gives the loss and gradients it gives alone, unpadded: the encoder
/// hands the decoder its state at the last real token (forward direction) and starts at
/// it (backward direction).
#[test]
fn padded_sentence_equals_the_sentence_alone() {
    for encoder in [EncoderKind::Uni, EncoderKind::Bi] {
        for lstm in IMPLS {
            let config = nmt_config(encoder, lstm, SourceLengths::On);
            let data = padded_data(&config, 32);
            let mut model = NmtModel::new(toy::cpu(1), config.clone(), 3).expect("model");
            let (all, g_all) = step(&mut model, &data.view());
            let mut loss_sum = 0.0;
            let mut g_sum = vec![0.0f64; g_all.len()];
            for b in 0..data.batch {
                let len = data.src_lengths[b];
                let column = |v: &[u32], steps: usize| -> Vec<u32> {
                    (0..steps).map(|t| v[t * data.batch + b]).collect()
                };
                let src = column(&data.src, len);
                let tgt_in = column(&data.tgt_in, data.tgt_len);
                let tgt_out = column(&data.tgt_out, data.tgt_len);
                let mask: Vec<f32> = (0..data.tgt_len)
                    .map(|t| data.mask[t * data.batch + b])
                    .collect();
                let lengths = [len];
                let alone = NmtBatchView {
                    batch: 1,
                    src_len: len,
                    tgt_len: data.tgt_len,
                    src: &src,
                    tgt_in: &tgt_in,
                    tgt_out: &tgt_out,
                    tgt_mask: &mask,
                    src_lengths: Some(&lengths),
                };
                let (s, g) = step(&mut model, &alone);
                loss_sum += s.loss_sum;
                for (acc, x) in g_sum.iter_mut().zip(g) {
                    *acc += f64::from(x);
                }
            }
            let what = format!("{encoder:?} {lstm:?}");
            assert!(
                (all.loss_sum - loss_sum).abs() <= 1e-5 * loss_sum.abs(),
                "{what}: batch loss {} vs sentences alone {loss_sum}",
                all.loss_sum
            );
            let scale = g_sum.iter().fold(0.0f64, |m, x| m.max(x.abs()));
            for (i, (a, b)) in g_all.iter().zip(&g_sum).enumerate() {
                assert!(
                    (f64::from(*a) - b).abs() <= 1e-5 * scale,
                    "{what}: gradient {i}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn source_lengths_on_needs_lengths_that_fit() {
    let config = nmt_config(EncoderKind::Bi, LstmImpl::Fused, SourceLengths::On);
    let data = padded_data(&config, 33);
    let mut model = NmtModel::new(toy::cpu(1), config, 3).expect("model");
    let missing = NmtBatchView {
        src_lengths: None,
        ..data.view()
    };
    let err = model.forward_loss(&missing).unwrap_err().to_string();
    assert!(err.contains("src_lengths"), "{err}");
    let long = [5, 6, 1, 1];
    let too_long = NmtBatchView {
        src_lengths: Some(&long),
        ..data.view()
    };
    let err = model.forward_loss(&too_long).unwrap_err().to_string();
    assert!(err.contains("src_lengths") && err.contains('6'), "{err}");
}

/// Parameters of one LSTM layer: `[input + H, 4H]` weights and a `4H` bias.
fn lstm_params(input: usize, h: usize) -> usize {
    (input + h) * 4 * h + 4 * h
}

#[test]
fn concat_layers_read_both_directions() {
    let (emb, h, src, tgt) = (6, 5, 9, 8);
    for (input, own_width) in [(BiLayerInput::Concat, 2 * h), (BiLayerInput::Own, h)] {
        let config = NmtConfig {
            bi_layer_input: input,
            ..nmt_config(EncoderKind::Bi, LstmImpl::Fused, SourceLengths::Off)
        };
        let model = NmtModel::new(toy::cpu(1), config.clone(), 1).expect("model");
        for dir in ["fw", "bw"] {
            let name = format!("encoder/{dir}/layer_1/w_ih");
            let e = model.layout().entries().iter().find(|e| e.name == name);
            assert_eq!(e.map(|e| e.len), Some(own_width * 4 * h), "{name}");
        }
        let decoder = lstm_params(emb, h) + 3 * lstm_params(h, h);
        let encoder = 2 * lstm_params(emb, h) + 2 * lstm_params(own_width, h);
        let expected = (src + tgt) * emb + h * tgt + decoder + encoder;
        assert_eq!(config.param_count().ok(), Some(expected), "{input:?}");
        assert_eq!(model.layout().total_len(), expected);
    }
}

/// The seeds' configuration: vocabulary 50,000 each side, 512 units (embeddings too),
/// 4 encoder layers (bi: 2 per direction) and 4 decoder layers. Counted here from the
/// layer formula, and checked against the model and README.
#[test]
fn seed_configuration_parameter_counts() {
    let (v, h) = (50_000, 512);
    let embeddings = 2 * v * h;
    let projection = h * v;
    let decoder = 4 * lstm_params(h, h);
    let own_encoder = 4 * lstm_params(h, h);
    let concat_encoder = 2 * lstm_params(h, h) + 2 * lstm_params(2 * h, h);
    let dynamic_rnn = embeddings + projection + decoder + own_encoder;
    let cudnn_lstm = embeddings + projection + decoder + concat_encoder;
    let readme = include_str!("../../../README.md");
    for (name, lstm, sl, input, count) in [
        (
            "cudnn_lstm",
            LstmImpl::Fused,
            SourceLengths::Off,
            BiLayerInput::Concat,
            cudnn_lstm,
        ),
        (
            "dynamic_rnn",
            LstmImpl::Stepwise,
            SourceLengths::On,
            BiLayerInput::Own,
            dynamic_rnn,
        ),
    ] {
        let config = NmtConfig {
            src_vocab: v,
            tgt_vocab: v,
            emb: h,
            hidden: h,
            layers: 4,
            encoder: EncoderKind::Bi,
            lstm,
            source_lengths: sl,
            bi_layer_input: input,
            init_scale: 0.1,
            forget_bias: 1.0,
        };
        assert_eq!(config.param_count().ok(), Some(count), "{name}");
        let printed = count
            .to_string()
            .as_bytes()
            .rchunks(3)
            .rev()
            .map(|c| std::str::from_utf8(c).unwrap_or_default())
            .collect::<Vec<_>>()
            .join(",");
        let line = format!("`{name}` | {printed}");
        assert!(readme.contains(&line), "README lacks the row `{line}`");
    }
}

fn lm(lstm: LstmImpl) -> RnnLm<ringtrain_model::CpuBackend> {
    let config = ringtrain_model::LmConfig {
        vocab: 11,
        emb: 6,
        hidden: 5,
        init_scale: 0.4,
        ..toy::tiny_lm(2, lstm)
    };
    RnnLm::new(toy::cpu(1), config, 4).expect("model")
}

fn window<'a>(d: &'a toy::LmData, first_in_epoch: bool) -> LmBatchView<'a> {
    LmBatchView {
        first_in_epoch,
        ..d.view()
    }
}

/// Two windows of one stream, and both as one window of twice the length.
fn stream(seed: u64) -> (toy::LmData, toy::LmData, toy::LmData) {
    let mut whole = toy::LmData::random(&lm(LstmImpl::Fused).config().clone(), 3, 8, seed);
    whole.mask.iter_mut().for_each(|m| *m = 1.0);
    let half = |range: std::ops::Range<usize>| {
        let rows = range.len() * whole.batch;
        let cells = range.start * whole.batch..range.start * whole.batch + rows;
        toy::LmData {
            batch: whole.batch,
            len: range.len(),
            inputs: whole.inputs[cells.clone()].to_vec(),
            targets: whole.targets[cells.clone()].to_vec(),
            mask: whole.mask[cells].to_vec(),
        }
    };
    let (a, b) = (half(0..4), half(4..8));
    (a, b, whole)
}

#[test]
fn lm_carries_state_across_windows() {
    for lstm in IMPLS {
        let (a, b, whole) = stream(41);
        let mut model = lm(lstm);
        let one_pass = model
            .forward_loss(&window(&whole, true))
            .expect("pass")
            .loss_sum;
        let first = model.forward_loss(&window(&a, true)).expect("a").loss_sum;
        assert!(model.state().is_carried());
        let carried = model.forward_loss(&window(&b, false)).expect("b").loss_sum;
        let fresh = model.forward_loss(&window(&b, true)).expect("b").loss_sum;
        assert!(
            (first + carried - one_pass).abs() <= 1e-5 * one_pass,
            "{lstm:?}: windows {first} + {carried} vs one pass {one_pass}"
        );
        assert!(
            (carried - fresh).abs() > 1e-4,
            "{lstm:?}: the carried state made no difference ({carried} vs {fresh})"
        );
        // first_in_epoch resets: window b from zeros equals a new model's window b.
        let mut new = lm(lstm);
        let new_b = new.forward_loss(&window(&b, true)).expect("b").loss_sum;
        assert_eq!(fresh, new_b, "{lstm:?}: first_in_epoch starts from zeros");
        // So does reset_state, and a model that has carried nothing starts from zeros.
        model.forward_loss(&window(&a, true)).expect("a");
        model.reset_state();
        let reset = model.forward_loss(&window(&b, false)).expect("b").loss_sum;
        assert_eq!(reset, new_b, "{lstm:?}: reset_state");
        let mut resumed = lm(lstm);
        let resumed_b = resumed
            .forward_loss(&window(&b, false))
            .expect("b")
            .loss_sum;
        assert_eq!(resumed_b, new_b, "{lstm:?}: no carried state");
    }
}

/// Truncated backpropagation: the gradient of window 2 is that of its loss with the carried
/// state held constant (finite differences from the same state), not the gradient through
/// window 1 (the one-pass gradient of window 2's loss alone).
#[test]
fn lm_gradient_stops_at_the_window_boundary() {
    for lstm in IMPLS {
        let (a, b, mut whole) = stream(42);
        let mut model = lm(lstm);
        model.forward_loss(&window(&a, true)).expect("a");
        let state: LmState<Vec<f32>> = model.state().clone();
        model
            .forward_backward(&window(&b, false), &mut |_, _| {})
            .expect("b");
        let truncated = model.grads().clone();

        let eps = 1e-2f32;
        let mut checked = 0;
        for idx in (0..truncated.len()).step_by(7) {
            let orig = model.params()[idx];
            let mut loss_at = |value: f32| {
                model.params_mut()[idx] = value;
                let mut s = state.clone();
                model.swap_state(&mut s);
                model.forward_loss(&window(&b, false)).expect("b").loss_sum
            };
            let fd = (loss_at(orig + eps) - loss_at(orig - eps)) / (2.0 * f64::from(eps));
            model.params_mut()[idx] = orig;
            let an = f64::from(truncated[idx]);
            assert!(
                (fd - an).abs() <= 2e-4 + 2e-2 * fd.abs(),
                "{lstm:?} element {idx}: finite difference {fd} vs truncated gradient {an}"
            );
            checked += usize::from(fd.abs() > 1e-3);
        }
        assert!(
            checked > 20,
            "{lstm:?}: only {checked} non-negligible gradients"
        );

        // Full backpropagation through both windows gives window 2's loss another gradient.
        let cells = a.len * a.batch;
        whole.mask[..cells].iter_mut().for_each(|m| *m = 0.0);
        model
            .forward_backward(&window(&whole, true), &mut |_, _| {})
            .expect("whole");
        let through = model.grads();
        let differs = truncated
            .iter()
            .zip(through)
            .filter(|(x, y)| (*x - *y).abs() > 1e-4)
            .count();
        assert!(differs > 0, "{lstm:?}: truncation changed no gradient");
    }
}

#[test]
fn lm_window_of_another_batch_size_must_start_an_epoch() {
    let mut model = lm(LstmImpl::Fused);
    let config = model.config().clone();
    let three = toy::LmData::random(&config, 3, 4, 43);
    let two = toy::LmData::random(&config, 2, 4, 44);
    model.forward_loss(&window(&three, true)).expect("three");
    let err = model
        .forward_loss(&window(&two, false))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("batch") && err.contains("first_in_epoch"),
        "{err}"
    );
    model
        .forward_loss(&window(&two, true))
        .expect("a new epoch may change it");
}
