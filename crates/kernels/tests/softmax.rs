//! Softmax cross-entropy against f64 references, finite differences and error cases.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_kernels::{
    bf16, f32_to_bf16, softmax_xent_backward, softmax_xent_forward, softmax_xent_forward_backward,
    softmax_xent_forward_online, Error,
};

type Forward = fn(
    &[f32],
    &[u32],
    &[f32],
    &mut [f32],
    &mut [f32],
    usize,
    usize,
) -> ringtrain_kernels::Result<()>;
const FORWARDS: [(&str, Forward); 2] = [
    ("two-pass", softmax_xent_forward),
    ("online", softmax_xent_forward_online),
];

struct Batch {
    logits: Vec<f32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
    rows: usize,
    vocab: usize,
}

fn batch(seed: u64, rows: usize, vocab: usize, spread: f32) -> Batch {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Batch {
        logits: (0..rows * vocab)
            .map(|_| rng.gen_range(-spread..spread))
            .collect(),
        labels: (0..rows).map(|_| rng.gen_range(0..vocab as u32)).collect(),
        mask: (0..rows)
            .map(|r| if r % 4 == 3 { 0.0 } else { 1.0 })
            .collect(),
        rows,
        vocab,
    }
}

/// f64 reference: (loss, lse) per row.
fn reference(b: &Batch) -> (Vec<f64>, Vec<f64>) {
    let mut loss = vec![0.0; b.rows];
    let mut lse = vec![0.0; b.rows];
    for r in 0..b.rows {
        let row: Vec<f64> = b.logits[r * b.vocab..(r + 1) * b.vocab]
            .iter()
            .map(|&x| f64::from(x))
            .collect();
        let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
        lse[r] = l;
        let w = f64::from(b.mask[r]);
        loss[r] = if w == 0.0 {
            0.0
        } else {
            w * (l - row[b.labels[r] as usize])
        };
    }
    (loss, lse)
}

fn run(f: Forward, b: &Batch) -> (Vec<f32>, Vec<f32>) {
    let (mut loss, mut lse) = (vec![f32::NAN; b.rows], vec![f32::NAN; b.rows]);
    f(
        &b.logits, &b.labels, &b.mask, &mut loss, &mut lse, b.rows, b.vocab,
    )
    .unwrap();
    (loss, lse)
}

/// Forward tolerance: relative 1e-6 of |lse| (the f32 rounding of a value of that size)
/// plus 2e-6 absolute.
fn forward_tol(lse: f64) -> f64 {
    1e-6 * lse.abs() + 2e-6
}

fn check_forward(b: &Batch) {
    let (want_loss, want_lse) = reference(b);
    for (name, f) in FORWARDS {
        let (loss, lse) = run(f, b);
        for r in 0..b.rows {
            let tol = forward_tol(want_lse[r]);
            assert!(
                (f64::from(lse[r]) - want_lse[r]).abs() <= tol,
                "{name} lse[{r}] {} vs {}",
                lse[r],
                want_lse[r]
            );
            assert!(
                (f64::from(loss[r]) - want_loss[r]).abs() <= 2.0 * tol,
                "{name} loss[{r}] {} vs {}",
                loss[r],
                want_loss[r]
            );
        }
    }
}

#[test]
fn forward_matches_f64_reference() {
    check_forward(&batch(1, 9, 37, 5.0));
    check_forward(&batch(2, 3, 1000, 20.0));
}

#[test]
fn forward_is_finite_for_huge_logits() {
    let vocab = 13;
    let rows = 3;
    let mut logits = vec![0.0f32; rows * vocab];
    for (n, x) in logits.iter_mut().enumerate() {
        *x = if n % 3 == 0 { 1e4 } else { -1e4 };
    }
    // An all -1e4 row.
    for x in &mut logits[2 * vocab..] {
        *x = -1e4;
    }
    let b = Batch {
        logits,
        labels: vec![0, 1, 5],
        mask: vec![1.0, 1.0, 1.0],
        rows,
        vocab,
    };
    check_forward(&b);
    for (name, f) in FORWARDS {
        let (loss, lse) = run(f, &b);
        assert!(
            loss.iter().chain(&lse).all(|v| v.is_finite()),
            "{name}: {loss:?} {lse:?}"
        );
        // Row 0 has five maxima (columns 0, 3, .., 12) and its label is one of them; row 1's
        // label is 2e4 below its maxima.
        assert!((loss[0] - 5.0f32.ln()).abs() < 1e-3, "{name}: {}", loss[0]);
        assert!(
            (loss[1] - (2e4 + 4.0f32.ln())).abs() < 2e-2,
            "{name}: {}",
            loss[1]
        );
    }
    let mut grad = b.logits.clone();
    let (_, lse) = run(softmax_xent_forward, &b);
    softmax_xent_backward(&mut grad, &lse, &b.labels, &b.mask, 1.0, rows, vocab).unwrap();
    assert!(grad.iter().all(|v| v.is_finite()));
}

#[test]
fn online_equals_two_pass_within_tolerance() {
    for (seed, rows, vocab, spread) in [(3, 7, 1, 1.0), (4, 5, 8, 50.0), (5, 4, 4099, 30.0)] {
        let b = batch(seed, rows, vocab, spread);
        let (loss2, lse2) = run(softmax_xent_forward, &b);
        let (loss1, lse1) = run(softmax_xent_forward_online, &b);
        for r in 0..rows {
            let tol = 1e-6 * f64::from(lse2[r]).abs() + 1e-6;
            assert!((f64::from(lse1[r]) - f64::from(lse2[r])).abs() <= tol);
            assert!((f64::from(loss1[r]) - f64::from(loss2[r])).abs() <= 2.0 * tol);
        }
    }
}

#[test]
fn padded_rows_get_zero_loss_and_gradient_and_any_label() {
    let mut b = batch(6, 4, 5, 3.0);
    b.mask = vec![1.0, 0.0, 0.5, 0.0];
    b.labels[1] = 999; // not checked: the row is padding
    b.labels[3] = u32::MAX;
    for (_, f) in FORWARDS {
        let (loss, lse) = run(f, &b);
        assert_eq!(loss[1], 0.0);
        assert_eq!(loss[3], 0.0);
        assert!(lse.iter().all(|v| v.is_finite()));
        let (full, _) = reference(&Batch {
            mask: vec![1.0; 4],
            labels: vec![b.labels[0], 0, b.labels[2], 0],
            logits: b.logits.clone(),
            ..b
        });
        assert!(
            (f64::from(loss[2]) - 0.5 * full[2]).abs() < 1e-5,
            "mask weight"
        );
    }
    let (_, lse) = run(softmax_xent_forward, &b);
    let mut grad = b.logits.clone();
    softmax_xent_backward(&mut grad, &lse, &b.labels, &b.mask, 1.0, 4, 5).unwrap();
    assert!(grad[5..10].iter().chain(&grad[15..20]).all(|&g| g == 0.0));
}

#[test]
fn backward_matches_f64_formula() {
    let b = batch(7, 6, 29, 6.0);
    let scale = 0.25f32;
    let (_, lse) = run(softmax_xent_forward, &b);
    let (_, lse64) = reference(&b);
    let mut grad = b.logits.clone();
    softmax_xent_backward(&mut grad, &lse, &b.labels, &b.mask, scale, b.rows, b.vocab).unwrap();
    for r in 0..b.rows {
        for v in 0..b.vocab {
            let x = f64::from(b.logits[r * b.vocab + v]);
            let onehot = if v == b.labels[r] as usize { 1.0 } else { 0.0 };
            let want = ((x - lse64[r]).exp() - onehot) * f64::from(scale) * f64::from(b.mask[r]);
            let got = f64::from(grad[r * b.vocab + v]);
            // exp(x - lse) carries the absolute error of lse (~1e-6 * |lse|) as a relative one.
            assert!(
                (got - want).abs() <= 4e-7 + 2e-6 * want.abs(),
                "grad[{r},{v}] {got} vs {want}"
            );
        }
    }
}

#[test]
fn the_fused_forward_backward_gives_the_forwards_bits_and_the_backwards_gradient() {
    // Rows masked out (every fourth), labels at both ends, logits of a wide spread.
    let mut b = batch(11, 9, 301, 30.0);
    b.labels[0] = 0;
    b.labels[1] = 300;
    let scale = 0.5;
    let (want_loss, want_lse) = run(softmax_xent_forward, &b);
    let mut want = b.logits.clone();
    softmax_xent_backward(
        &mut want, &want_lse, &b.labels, &b.mask, scale, b.rows, b.vocab,
    )
    .unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    // The fused kernel on `logits` (in place), with a bf16 copy when one is given: the
    // loss and lse rows.
    let fused = |logits: &mut [f32], copy: Option<&mut [bf16]>| {
        let (mut loss, mut lse) = (vec![0.0; b.rows], vec![0.0; b.rows]);
        let (labels, mask) = (&b.labels, &b.mask);
        softmax_xent_forward_backward(
            logits, labels, mask, &mut loss, &mut lse, scale, b.rows, b.vocab, copy,
        )
        .map(|()| (loss, lse))
    };
    for with_copy in [false, true] {
        let mut got = b.logits.clone();
        let mut copy = vec![bf16::from_f32(7.0); got.len()];
        let (loss, lse) = fused(&mut got, with_copy.then_some(&mut copy[..])).unwrap();
        assert_eq!(
            (bits(&loss), bits(&lse)),
            (bits(&want_loss), bits(&want_lse))
        );
        for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
            // A few ulp of the larger of the two terms (p·k and k at the label).
            let bound = 4.0 * f32::EPSILON * (w.abs() + scale) + 1e-30;
            assert!((g - w).abs() <= bound, "element {i}: {g} against {w}");
        }
        // Masked rows are exactly zero, as the backward leaves them.
        assert!(got[3 * b.vocab..4 * b.vocab]
            .iter()
            .all(|&g| g.to_bits() == 0));
        if with_copy {
            let mut cast = vec![bf16::ZERO; got.len()];
            f32_to_bf16(&got, &mut cast).unwrap();
            assert!(copy
                .iter()
                .zip(&cast)
                .all(|(a, c)| a.to_bits() == c.to_bits()));
        } else {
            assert!(
                copy.iter().all(|c| c.to_f32() == 7.0),
                "no copy asked, none written"
            );
        }
    }
    // A copy of the wrong length is named, and nothing is written.
    let mut untouched = b.logits.clone();
    let mut short = vec![bf16::ZERO; untouched.len() - 1];
    let err = fused(&mut untouched, Some(&mut short)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ShapeMismatch {
                arg: "bf16_copy",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(bits(&untouched), bits(&b.logits));
    assert!(short.iter().all(|c| c.to_bits() == 0));
}

#[test]
fn gradient_matches_finite_differences() {
    // Mean loss over the real rows; central differences of the f64 reference loss at the
    // f32 logits, step 1e-6.
    let b = batch(8, 4, 11, 4.0);
    let real: f32 = b.mask.iter().sum();
    let scale = 1.0 / real;
    let (_, lse) = run(softmax_xent_forward, &b);
    let mut grad = b.logits.clone();
    softmax_xent_backward(&mut grad, &lse, &b.labels, &b.mask, scale, b.rows, b.vocab).unwrap();

    let total = |logits: &[f64]| -> f64 {
        let mut sum = 0.0;
        for r in 0..b.rows {
            let row = &logits[r * b.vocab..(r + 1) * b.vocab];
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            if b.mask[r] != 0.0 {
                sum += f64::from(b.mask[r]) * (l - row[b.labels[r] as usize]);
            }
        }
        sum / f64::from(real)
    };
    let base: Vec<f64> = b.logits.iter().map(|&x| f64::from(x)).collect();
    let eps = 1e-6;
    for idx in 0..base.len() {
        let (mut p, mut m) = (base.clone(), base.clone());
        p[idx] += eps;
        m[idx] -= eps;
        let numeric = (total(&p) - total(&m)) / (2.0 * eps);
        let got = f64::from(grad[idx]);
        assert!(
            (numeric - got).abs() <= 1e-6,
            "grad[{idx}]: analytic {got}, numeric {numeric}"
        );
    }
}

#[test]
fn errors_name_the_argument_and_write_nothing() {
    let b = batch(9, 3, 4, 1.0);
    let (mut loss, mut lse) = (vec![7.0f32; 3], vec![7.0f32; 3]);
    for (_, f) in FORWARDS {
        let err = f(
            &b.logits,
            &b.labels,
            &b.mask,
            &mut loss[..2],
            &mut lse,
            3,
            4,
        )
        .unwrap_err();
        assert_eq!(
            err,
            Error::ShapeMismatch {
                arg: "loss",
                expected: 3,
                actual: 2
            }
        );
        let err = f(
            &b.logits[1..],
            &b.labels,
            &b.mask,
            &mut loss,
            &mut lse,
            3,
            4,
        )
        .unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { arg: "logits", .. }));
        let err = f(
            &b.logits,
            &b.labels,
            &b.mask[..1],
            &mut loss,
            &mut lse,
            3,
            4,
        )
        .unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { arg: "mask", .. }));
        let err = f(&[], &[], &[], &mut [], &mut [], 0, 0).unwrap_err();
        assert!(matches!(err, Error::InvalidValue { name: "vocab", .. }));
        let labels = [0, 4, 1];
        let err = f(&b.logits, &labels, &b.mask, &mut loss, &mut lse, 3, 4).unwrap_err();
        assert_eq!(
            err,
            Error::LabelOutOfRange {
                row: 1,
                label: 4,
                vocab: 4
            }
        );
        assert!(err.to_string().contains("label 4 in row 1"));
        assert!(
            loss.iter().chain(&lse).all(|&v| v == 7.0),
            "nothing written"
        );
    }
    let mut grad = b.logits.clone();
    let err = softmax_xent_backward(&mut grad, &lse, &[0, 9, 0], &b.mask, 1.0, 3, 4).unwrap_err();
    assert!(matches!(
        err,
        Error::LabelOutOfRange {
            row: 1,
            label: 9,
            ..
        }
    ));
    let err =
        softmax_xent_backward(&mut grad, &lse[..2], &b.labels, &b.mask, 1.0, 3, 4).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { arg: "lse", .. }));
    assert_eq!(grad, b.logits, "nothing written");
}

/// Cases per property: `PROPTEST_CASES` when set (a long soak), else `quick`, this
/// file's default, sized for CI.
fn cases(quick: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(quick)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(48)))]

    #[test]
    fn any_shape_matches_reference(
        rows in 1usize..7, vocab in 1usize..70, spread in 0.1f32..40.0, seed in any::<u64>()
    ) {
        let b = batch(seed, rows, vocab, spread);
        check_forward(&b);
        // Gradient rows of real tokens sum to zero (softmax sums to one).
        let (_, lse) = run(softmax_xent_forward, &b);
        let mut grad = b.logits.clone();
        softmax_xent_backward(&mut grad, &lse, &b.labels, &b.mask, 1.0, rows, vocab).unwrap();
        for r in 0..rows {
            let s: f64 = grad[r * vocab..(r + 1) * vocab].iter().map(|&g| f64::from(g)).sum();
            prop_assert!(s.abs() <= 2e-6 * vocab as f64, "row {} sums to {}", r, s);
        }
    }
}
