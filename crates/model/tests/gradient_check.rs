//! Finite-difference gradient checks of every model at tiny size.
//!
//! For a few random elements of every parameter tensor, the analytic gradient of the summed
//! loss is compared with the central difference `(L(p + e) - L(p - e)) / 2e`, e = 1e-2,
//! computed from the f64 loss sums. Tolerance: |fd - analytic| <= 2e-4 + 2e-2 * |fd|. Half
//! the samples of each tensor are its largest analytic gradients, and each tensor must have
//! a sampled |fd| above 2 * 2e-4, so every tensor is checked where its gradient matters.

mod toy;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_model::{EncoderKind, LstmImpl, Model, NmtModel, RnnLm};

const EPS: f32 = 1e-2;
const ABS_TOL: f64 = 2e-4;
const REL_TOL: f64 = 2e-2;

/// Checks `samples` random elements of every tensor of `model` on `batch`; returns how many
/// elements had a non-negligible gradient (so a test can insist the check meant something).
fn check_model<M>(model: &mut M, batch: &M::Batch<'_>, samples: usize, seed: u64) -> usize
where
    M: Model<Backend = ringtrain_model::CpuBackend>,
{
    let stats = model
        .forward_backward(batch, &mut |_, _| {})
        .expect("forward_backward");
    assert!(stats.loss_sum.is_finite() && stats.loss_sum > 0.0);
    let analytic = model.grads().clone();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let entries = model.layout().entries().to_vec();
    let mut significant = 0;
    for e in &entries {
        let mut tensor_significant = 0;
        // Half the samples at random, half where the analytic gradient is largest.
        let mut by_size: Vec<usize> = (e.offset..e.offset + e.len).collect();
        by_size.sort_by(|&a, &b| analytic[b].abs().total_cmp(&analytic[a].abs()));
        let mut picks: Vec<usize> = by_size.into_iter().take(samples / 2).collect();
        picks.extend((0..samples - picks.len()).map(|_| e.offset + rng.gen_range(0..e.len)));
        let mut max_fd = 0.0f64;
        for idx in picks {
            let orig = model.params()[idx];
            model.params_mut()[idx] = orig + EPS;
            let plus = model.forward_loss(batch).expect("forward").loss_sum;
            model.params_mut()[idx] = orig - EPS;
            let minus = model.forward_loss(batch).expect("forward").loss_sum;
            model.params_mut()[idx] = orig;
            let fd = (plus - minus) / (2.0 * f64::from(EPS));
            let an = f64::from(analytic[idx]);
            assert!(
                (fd - an).abs() <= ABS_TOL + REL_TOL * fd.abs(),
                "{} element {}: finite difference {fd} vs analytic {an}",
                e.name,
                idx - e.offset
            );
            if fd.abs() > 1e-3 {
                tensor_significant += 1;
            }
            max_fd = max_fd.max(fd.abs());
        }
        assert!(
            max_fd > 2.0 * ABS_TOL,
            "{}: largest sampled gradient {max_fd:.3e} is too small for a meaningful check",
            e.name
        );
        significant += tensor_significant;
    }
    significant
}

#[test]
fn nmt_bi_encoder_gradients_match_finite_differences() {
    let config = toy::tiny_nmt(EncoderKind::Bi, 4, LstmImpl::Fused);
    let data = toy::NmtData::random(&config, 3, 4, 3, 11);
    let mut model = NmtModel::new(toy::cpu(1), config, 5).expect("model");
    let significant = check_model(&mut model, &data.view(), 6, 1);
    assert!(
        significant > 40,
        "only {significant} sampled gradients were non-negligible"
    );
}

#[test]
fn nmt_uni_encoder_gradients_match_finite_differences() {
    let config = toy::tiny_nmt(EncoderKind::Uni, 2, LstmImpl::Fused);
    let data = toy::NmtData::random(&config, 3, 4, 3, 12);
    let mut model = NmtModel::new(toy::cpu(1), config, 6).expect("model");
    let significant = check_model(&mut model, &data.view(), 6, 2);
    assert!(
        significant > 20,
        "only {significant} sampled gradients were non-negligible"
    );
}

#[test]
fn nmt_stepwise_gradients_match_finite_differences() {
    let config = toy::tiny_nmt(EncoderKind::Bi, 2, LstmImpl::Stepwise);
    let data = toy::NmtData::random(&config, 2, 3, 3, 13);
    let mut model = NmtModel::new(toy::cpu(1), config, 7).expect("model");
    let significant = check_model(&mut model, &data.view(), 6, 3);
    assert!(
        significant > 20,
        "only {significant} sampled gradients were non-negligible"
    );
}

#[test]
fn rnnlm_gradients_match_finite_differences() {
    let config = toy::tiny_lm(2, LstmImpl::Fused);
    let data = toy::LmData::random(&config, 3, 5, 14);
    let mut model = RnnLm::new(toy::cpu(1), config, 8).expect("model");
    let significant = check_model(&mut model, &data.view(), 6, 4);
    assert!(
        significant > 20,
        "only {significant} sampled gradients were non-negligible"
    );
}

/// Source lengths on and concatenated bi layers, both implementations: the masked
/// recurrence (held state at padding, gradient passed through it) is differentiated right.
#[test]
fn nmt_source_lengths_and_concat_gradients_match_finite_differences() {
    for lstm in [LstmImpl::Fused, LstmImpl::Stepwise] {
        let config = ringtrain_model::NmtConfig {
            source_lengths: ringtrain_model::SourceLengths::On,
            bi_layer_input: ringtrain_model::BiLayerInput::Concat,
            ..toy::tiny_nmt(EncoderKind::Bi, 4, lstm)
        };
        let data = toy::NmtData::random(&config, 3, 4, 3, 15);
        assert_eq!(data.src_lengths, [4, 3, 2]);
        let mut model = NmtModel::new(toy::cpu(1), config, 9).expect("model");
        let significant = check_model(&mut model, &data.view(), 6, 5);
        assert!(
            significant > 40,
            "{lstm:?}: only {significant} sampled gradients were non-negligible"
        );
    }
}
