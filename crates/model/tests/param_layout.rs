//! Parameter layout: unique names, backward order, flat buffer sizes, and the
//! `on_grads_ready` ranges covering the gradient buffer exactly once in order.

mod toy;

use std::collections::HashSet;
use std::ops::Range;

use ringtrain_model::{EncoderKind, LstmImpl, Model, NmtModel, ParamLayout, RnnLm};

fn assert_unique_and_contiguous(layout: &ParamLayout) {
    let mut names = HashSet::new();
    let mut next = 0;
    for e in layout.entries() {
        assert!(names.insert(e.name.clone()), "duplicate name {}", e.name);
        assert_eq!(e.offset, next, "{} does not follow its predecessor", e.name);
        assert_eq!(e.len, e.shape.iter().product::<usize>(), "{}", e.name);
        next += e.len;
    }
    assert_eq!(layout.total_len(), next);
}

fn names(layout: &ParamLayout) -> Vec<String> {
    layout.entries().iter().map(|e| e.name.clone()).collect()
}

fn layer(prefix: &str) -> Vec<String> {
    ["w_ih", "w_hh", "bias"]
        .iter()
        .map(|t| format!("{prefix}/{t}"))
        .collect()
}

/// Ranges reported during backward: consecutive, ascending, exactly the tensors in order.
fn assert_ready_ranges(ready: &[Range<usize>], layout: &ParamLayout) {
    let expected: Vec<Range<usize>> = layout.entries().iter().map(|e| e.range()).collect();
    assert_eq!(ready, expected.as_slice());
    let mut covered = vec![0u8; layout.total_len()];
    for r in ready {
        covered[r.clone()].iter_mut().for_each(|c| *c += 1);
    }
    assert!(
        covered.iter().all(|&c| c == 1),
        "gradient buffer not covered exactly once"
    );
}

#[test]
fn nmt_bi_layout_is_in_backward_order() {
    let config = toy::tiny_nmt(EncoderKind::Bi, 4, LstmImpl::Fused);
    let (h, e, vs, vt) = (
        config.hidden,
        config.emb,
        config.src_vocab,
        config.tgt_vocab,
    );
    let model = NmtModel::new(toy::cpu(1), config, 1).expect("model");
    let layout = model.layout();
    assert_unique_and_contiguous(layout);
    let mut expected = vec!["proj/kernel".to_string()];
    for l in (0..4).rev() {
        expected.extend(layer(&format!("decoder/layer_{l}")));
    }
    expected.push("embedding/tgt".into());
    for d in (0..2).rev() {
        expected.extend(layer(&format!("encoder/fw/layer_{d}")));
        expected.extend(layer(&format!("encoder/bw/layer_{d}")));
    }
    expected.push("embedding/src".into());
    assert_eq!(names(layout), expected);
    let shape = |n: &str| layout.get(n).map(|e| e.shape.clone());
    assert_eq!(shape("proj/kernel"), Some(vec![h, vt]));
    assert_eq!(shape("decoder/layer_0/w_ih"), Some(vec![e, 4 * h]));
    assert_eq!(shape("decoder/layer_1/w_ih"), Some(vec![h, 4 * h]));
    assert_eq!(shape("encoder/bw/layer_1/w_ih"), Some(vec![h, 4 * h]));
    assert_eq!(shape("encoder/fw/layer_0/w_hh"), Some(vec![h, 4 * h]));
    assert_eq!(shape("decoder/layer_3/bias"), Some(vec![4 * h]));
    assert_eq!(shape("embedding/src"), Some(vec![vs, e]));
    assert_eq!(shape("embedding/tgt"), Some(vec![vt, e]));
    let lstm = |input: usize| input * 4 * h + h * 4 * h + 4 * h;
    let total = h * vt + lstm(e) + 3 * lstm(h) + vt * e + 2 * lstm(e) + 2 * lstm(h) + vs * e;
    assert_eq!(layout.total_len(), total);
    assert_eq!(model.params().len(), total);
    assert_eq!(model.grads().len(), total);
}

#[test]
fn nmt_uni_and_rnnlm_layouts() {
    let model = NmtModel::new(
        toy::cpu(1),
        toy::tiny_nmt(EncoderKind::Uni, 2, LstmImpl::Fused),
        1,
    )
    .expect("model");
    assert_unique_and_contiguous(model.layout());
    let mut expected = vec!["proj/kernel".to_string()];
    expected.extend(layer("decoder/layer_1"));
    expected.extend(layer("decoder/layer_0"));
    expected.push("embedding/tgt".into());
    expected.extend(layer("encoder/layer_1"));
    expected.extend(layer("encoder/layer_0"));
    expected.push("embedding/src".into());
    assert_eq!(names(model.layout()), expected);

    let lm = RnnLm::new(toy::cpu(1), toy::tiny_lm(2, LstmImpl::Fused), 1).expect("lm");
    assert_unique_and_contiguous(lm.layout());
    let mut expected = vec!["proj/kernel".to_string()];
    expected.extend(layer("lm/layer_1"));
    expected.extend(layer("lm/layer_0"));
    expected.push("embedding/lm".into());
    assert_eq!(names(lm.layout()), expected);
}

#[test]
fn grads_ready_ranges_cover_buffer_once_in_order() {
    for lstm in [LstmImpl::Fused, LstmImpl::Stepwise] {
        for encoder in [EncoderKind::Bi, EncoderKind::Uni] {
            let config = toy::tiny_nmt(encoder, 4, lstm);
            let data = toy::NmtData::random(&config, 2, 3, 4, 9);
            let mut model = NmtModel::new(toy::cpu(1), config, 2).expect("model");
            // Poison the gradients: a range reported ready must already hold its final
            // values when reported, and the final buffer must be fully overwritten.
            model.grads_mut().iter_mut().for_each(|g| *g = f32::NAN);
            let mut ready = Vec::new();
            let mut snapshots = Vec::new();
            model
                .forward_backward(&data.view(), &mut |r, grads: &Vec<f32>| {
                    snapshots.push(grads[r.clone()].to_vec());
                    ready.push(r);
                })
                .expect("step");
            assert_ready_ranges(&ready, model.layout());
            for (r, snap) in ready.iter().zip(&snapshots) {
                assert_eq!(
                    &model.grads()[r.clone()],
                    snap.as_slice(),
                    "range {r:?} changed after it was reported ready"
                );
            }
            assert!(model.grads().iter().all(|g| g.is_finite()));
        }
    }
    let config = toy::tiny_lm(2, LstmImpl::Fused);
    let data = toy::LmData::random(&config, 2, 3, 9);
    let mut lm = RnnLm::new(toy::cpu(1), config, 2).expect("lm");
    let mut ready = Vec::new();
    lm.forward_backward(&data.view(), &mut |r, _| ready.push(r))
        .expect("step");
    assert_ready_ranges(&ready, lm.layout());
}

#[test]
fn init_is_seeded_uniform_with_forget_bias() {
    let config = toy::tiny_nmt(EncoderKind::Bi, 2, LstmImpl::Fused);
    let h = config.hidden;
    let a = NmtModel::new(toy::cpu(1), config.clone(), 7).expect("model");
    let b = NmtModel::new(toy::cpu(1), config.clone(), 7).expect("model");
    let c = NmtModel::new(toy::cpu(1), config, 8).expect("model");
    assert_eq!(a.params(), b.params());
    assert_ne!(a.params(), c.params());
    for e in a.layout().entries() {
        let v = &a.params()[e.range()];
        if e.name.ends_with("/bias") {
            for (j, &x) in v.iter().enumerate() {
                let want = if (h..2 * h).contains(&j) { 1.0 } else { 0.0 };
                assert_eq!(x, want, "{}[{j}]", e.name);
            }
        } else {
            assert!(
                v.iter().all(|x| x.abs() <= 0.5),
                "{} outside ±init_scale",
                e.name
            );
            assert!(
                v.iter().any(|x| x.abs() > 0.1),
                "{} looks not initialised",
                e.name
            );
        }
    }
}
