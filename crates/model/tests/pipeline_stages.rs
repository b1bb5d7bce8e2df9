//! A model cut into pipeline stages computes what the whole model computes: the stages'
//! forward passes in order, boundary tensors handed on, then their backward passes in
//! reverse give the same loss and the same gradients, for every cut, both models, both
//! LSTM implementations and the NMT semantics options.

use std::ops::Range;

use ringtrain_model::{
    BiLayerInput, CpuBackend, EncoderKind, LmBatchView, LmConfig, LstmImpl, Model, NmtBatchView,
    NmtConfig, NmtModel, PipelineModel, RnnLm, SourceLengths,
};

/// Every way to cut `n` units into consecutive non-empty stages (at most 3 stages).
fn cuts(n: usize) -> Vec<Vec<Range<usize>>> {
    let mut out = vec![vec![0..n]];
    for a in 1..n {
        out.push(vec![0..a, a..n]);
        for b in a + 1..n {
            out.push(vec![0..a, a..b, b..n]);
        }
    }
    out
}

/// Runs `stages` of `model` one after the other on `batch`, each with its slot of
/// `slots` (kept from batch to batch: an RNNLM stage carries its state there); returns the loss and the
/// gradients each stage wrote to its own units' parameter range.
fn staged<M: PipelineModel<Backend = CpuBackend>>(
    model: &mut M,
    batch: &M::Batch<'_>,
    stages: &[Range<usize>],
    slots: &mut [M::Slot],
) -> (f64, Vec<f32>) {
    let units = model.pipeline_units();
    let mut boundary = Vec::new();
    let mut loss = 0.0;
    for (s, units) in stages.iter().enumerate() {
        let mut out = Vec::new();
        let stats = model
            .stage_forward(&mut slots[s], batch, units.clone(), &boundary, &mut out)
            .unwrap_or_else(|e| panic!("forward of stage {s} {units:?}: {e}"));
        loss += stats.loss_sum;
        boundary = out;
    }
    assert!(boundary.is_empty(), "the last stage sends nothing on");
    let mut grads = vec![f32::NAN; model.layout().total_len()];
    for (s, stage_units) in stages.iter().enumerate().rev() {
        let mut back = Vec::new();
        model
            .stage_backward(
                &mut slots[s],
                stage_units.clone(),
                &boundary,
                &mut back,
                &mut |_, _| {},
            )
            .unwrap_or_else(|e| panic!("backward of stage {s}: {e}"));
        let range = units[stage_units.start]
            .params
            .start
            .min(units[stage_units.end - 1].params.start)
            ..units[stage_units.start]
                .params
                .end
                .max(units[stage_units.end - 1].params.end);
        grads[range.clone()].copy_from_slice(&model.grads()[range]);
        boundary = back;
    }
    assert!(boundary.is_empty(), "the first stage sends nothing back");
    (loss, grads)
}

fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
            "{what}: element {i}: staged {x} whole {y}"
        );
    }
}

#[test]
fn units_cover_the_parameter_buffer_in_backward_order() {
    let lm = RnnLm::new(
        CpuBackend::new(1).unwrap(),
        lm_config(LstmImpl::Fused, 3),
        1,
    )
    .unwrap();
    let units = lm.pipeline_units();
    assert_eq!(units.len(), 5);
    assert_eq!(units[0].name, "embedding");
    assert_eq!(
        units[4].params.start, 0,
        "the projection comes first in the buffer"
    );
    assert_eq!(units[0].params.end, lm.layout().total_len());
    for pair in units.windows(2) {
        assert_eq!(pair[1].params.end, pair[0].params.start, "{pair:?}");
    }
}

fn lm_config(lstm: LstmImpl, layers: usize) -> LmConfig {
    LmConfig {
        vocab: 11,
        emb: 5,
        hidden: 4,
        layers,
        lstm,
        init_scale: 0.3,
        forget_bias: 1.0,
    }
}

#[test]
fn rnnlm_stages_compute_the_whole_models_loss_and_gradients() {
    for lstm in [LstmImpl::Fused, LstmImpl::Stepwise] {
        let (batch, len) = (3, 4);
        let inputs: Vec<u32> = (0..batch * len).map(|i| (i * 7 % 11) as u32).collect();
        let targets: Vec<u32> = (0..batch * len).map(|i| (i * 5 % 11) as u32).collect();
        let mut mask = vec![1.0; batch * len];
        mask[batch * len - 1] = 0.0;
        for cut in cuts(4) {
            let mut whole = RnnLm::new(CpuBackend::new(1).unwrap(), lm_config(lstm, 2), 3).unwrap();
            let mut piped = RnnLm::new(CpuBackend::new(1).unwrap(), lm_config(lstm, 2), 3).unwrap();
            let mut slots: Vec<_> = cut.iter().map(|_| Default::default()).collect();
            // Two windows: the second starts from the state the first carried.
            for first in [true, false] {
                let view = LmBatchView {
                    batch,
                    len,
                    inputs: &inputs,
                    targets: &targets,
                    mask: &mask,
                    first_in_epoch: first,
                };
                let stats = whole.forward_backward(&view, &mut |_, _| {}).unwrap();
                let (loss, grads) = staged(&mut piped, &view, &cut, &mut slots);
                assert!(
                    (loss - stats.loss_sum).abs() < 1e-4,
                    "{cut:?}: {loss} vs {}",
                    stats.loss_sum
                );
                assert_close(
                    &format!("{lstm:?} {cut:?} first {first}"),
                    &grads,
                    whole.grads(),
                );
            }
        }
    }
}

#[test]
fn nmt_stages_compute_the_whole_models_loss_and_gradients() {
    let (batch, ts, tt) = (2, 3, 4);
    let src: Vec<u32> = (0..batch * ts).map(|i| (i * 7 % 9 + 1) as u32).collect();
    let tgt_in: Vec<u32> = (0..batch * tt).map(|i| (i * 3 % 8) as u32).collect();
    let tgt_out: Vec<u32> = (0..batch * tt).map(|i| (i * 5 % 8) as u32).collect();
    let mut mask = vec![1.0; batch * tt];
    mask[batch * tt - 1] = 0.0;
    let lengths = [3, 2];
    for (encoder, lstm, lengths_on, input) in [
        (
            EncoderKind::Uni,
            LstmImpl::Fused,
            SourceLengths::Off,
            BiLayerInput::Own,
        ),
        (
            EncoderKind::Bi,
            LstmImpl::Stepwise,
            SourceLengths::On,
            BiLayerInput::Own,
        ),
        (
            EncoderKind::Bi,
            LstmImpl::Fused,
            SourceLengths::On,
            BiLayerInput::Concat,
        ),
    ] {
        let config = NmtConfig {
            src_vocab: 10,
            tgt_vocab: 8,
            emb: 4,
            hidden: 3,
            layers: 2,
            encoder,
            lstm,
            source_lengths: lengths_on,
            bi_layer_input: input,
            init_scale: 0.3,
            forget_bias: 1.0,
        };
        let view = NmtBatchView {
            batch,
            src_len: ts,
            tgt_len: tt,
            src: &src,
            tgt_in: &tgt_in,
            tgt_out: &tgt_out,
            tgt_mask: &mask,
            src_lengths: Some(&lengths),
        };
        let mut whole = NmtModel::new(CpuBackend::new(1).unwrap(), config.clone(), 5).unwrap();
        let stats = whole.forward_backward(&view, &mut |_, _| {}).unwrap();
        let mut piped = NmtModel::new(CpuBackend::new(1).unwrap(), config.clone(), 5).unwrap();
        for cut in cuts(4) {
            let mut slots: Vec<_> = cut.iter().map(|_| Default::default()).collect();
            let (loss, grads) = staged(&mut piped, &view, &cut, &mut slots);
            assert!((loss - stats.loss_sum).abs() < 1e-4, "{cut:?}");
            assert_close(
                &format!("{encoder:?} {lstm:?} {cut:?}"),
                &grads,
                whole.grads(),
            );
        }
    }
}

#[test]
fn a_boundary_of_the_wrong_length_is_an_error_not_a_panic() {
    let mut lm = RnnLm::new(
        CpuBackend::new(1).unwrap(),
        lm_config(LstmImpl::Fused, 2),
        1,
    )
    .unwrap();
    let ids = [1u32; 4];
    let mask = [1.0; 4];
    let view = LmBatchView {
        batch: 2,
        len: 2,
        inputs: &ids,
        targets: &ids,
        mask: &mask,
        first_in_epoch: true,
    };
    let mut slot = Default::default();
    let err = lm
        .stage_forward(&mut slot, &view, 1..4, &[0.0; 3], &mut Vec::new())
        .unwrap_err()
        .to_string();
    assert!(err.contains("pipeline activations"), "{err}");
    let err = lm
        .stage_backward(
            &mut Default::default(),
            0..4,
            &[],
            &mut Vec::new(),
            &mut |_, _| {},
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("forward pass first"), "{err}");
}
