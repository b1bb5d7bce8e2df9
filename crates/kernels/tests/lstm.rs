//! LSTM kernels against f64 references, finite differences and error cases.

use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_kernels::{
    init_lstm_bias, lstm_cell_reference, lstm_pointwise_backward, lstm_pointwise_forward,
    lstm_pointwise_forward_step, Error, DEFAULT_FORGET_BIAS,
};

fn random(rng: &mut ChaCha8Rng, len: usize, spread: f32) -> Vec<f32> {
    (0..len).map(|_| rng.gen_range(-spread..spread)).collect()
}

fn sigmoid64(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// f64 forward of the pointwise cell: returns (c, h, act).
fn forward64(
    pre: &[f64],
    c_prev: &[f64],
    batch: usize,
    hidden: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0; batch * hidden];
    let mut h = vec![0.0; batch * hidden];
    let mut act = vec![0.0; batch * 4 * hidden];
    for b in 0..batch {
        for j in 0..hidden {
            let at = |k: usize| b * 4 * hidden + k * hidden + j;
            let i = sigmoid64(pre[at(0)]);
            let f = sigmoid64(pre[at(1)]);
            let g = pre[at(2)].tanh();
            let o = sigmoid64(pre[at(3)]);
            let cn = f * c_prev[b * hidden + j] + i * g;
            c[b * hidden + j] = cn;
            h[b * hidden + j] = o * cn.tanh();
            act[at(0)] = i;
            act[at(1)] = f;
            act[at(2)] = g;
            act[at(3)] = o;
        }
    }
    (c, h, act)
}

fn pre_activations(gates: &[f32], bias: &[f32], hidden: usize) -> Vec<f64> {
    gates
        .iter()
        .enumerate()
        .map(|(n, &g)| f64::from(g) + f64::from(bias[n % (4 * hidden)]))
        .collect()
}

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{n}]: got {g}, want {w}, error {err}"
        );
    }
}

struct Case {
    gates: Vec<f32>,
    bias: Vec<f32>,
    c_prev: Vec<f32>,
    batch: usize,
    hidden: usize,
}

fn case(seed: u64, batch: usize, hidden: usize) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    Case {
        gates: random(&mut rng, batch * 4 * hidden, 3.0),
        bias: random(&mut rng, 4 * hidden, 0.5),
        c_prev: random(&mut rng, batch * hidden, 2.0),
        batch,
        hidden,
    }
}

fn run_forward(k: &Case) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (n, g) = (k.batch * k.hidden, k.batch * 4 * k.hidden);
    let (mut c, mut h, mut act) = (vec![0.0; n], vec![0.0; n], vec![0.0; g]);
    lstm_pointwise_forward(
        &k.gates, &k.bias, &k.c_prev, &mut c, &mut h, &mut act, k.batch, k.hidden,
    )
    .expect("shapes are consistent");
    (c, h, act)
}

/// Forward tolerance: f32 evaluation of a few transcendental functions.
const FORWARD_TOL: f64 = 2e-6;

#[test]
fn forward_matches_f64_reference() {
    let k = case(1, 5, 7);
    let (c, h, act) = run_forward(&k);
    let c_prev64: Vec<f64> = k.c_prev.iter().map(|&x| f64::from(x)).collect();
    let (c64, h64, act64) = forward64(
        &pre_activations(&k.gates, &k.bias, k.hidden),
        &c_prev64,
        k.batch,
        k.hidden,
    );
    assert_close(&c, &c64, FORWARD_TOL, "c");
    assert_close(&h, &h64, FORWARD_TOL, "h");
    assert_close(&act, &act64, FORWARD_TOL, "act");
}

#[test]
fn forward_saturates_without_nan() {
    let (batch, hidden) = (2, 3);
    let gates: Vec<f32> = (0..batch * 4 * hidden)
        .map(|n| if n % 2 == 0 { 1e4 } else { -1e4 })
        .collect();
    let bias = vec![0.0; 4 * hidden];
    let c_prev = vec![1.5; batch * hidden];
    let k = Case {
        gates,
        bias,
        c_prev,
        batch,
        hidden,
    };
    let (c, h, act) = run_forward(&k);
    assert!(c.iter().chain(&h).chain(&act).all(|v| v.is_finite()));
    assert!(act.iter().all(|&a| a == 0.0 || a.abs() == 1.0), "{act:?}");
}

#[test]
fn forward_step_equals_forward_on_summed_projection() {
    let (steps, batch, hidden) = (3, 4, 5);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let width = batch * 4 * hidden;
    let proj = random(&mut rng, steps * width, 2.0);
    let rec = random(&mut rng, width, 2.0);
    let bias = random(&mut rng, 4 * hidden, 0.5);
    let c_prev = random(&mut rng, batch * hidden, 1.0);
    for step in 0..steps {
        let (mut c, mut h, mut act) = (
            vec![0.0; batch * hidden],
            vec![0.0; batch * hidden],
            vec![0.0; width],
        );
        lstm_pointwise_forward_step(
            &proj, &rec, &bias, &c_prev, &mut c, &mut h, &mut act, step, steps, batch, hidden,
        )
        .unwrap();
        // Same pre-activation sum, in the same order, through the plain kernel.
        let gates: Vec<f32> = proj[step * width..(step + 1) * width]
            .iter()
            .zip(&rec)
            .map(|(&x, &r)| x + r)
            .collect();
        let k = Case {
            gates,
            bias: bias.clone(),
            c_prev: c_prev.clone(),
            batch,
            hidden,
        };
        let (c2, h2, act2) = run_forward(&k);
        assert_eq!(bits(&c), bits(&c2), "c at step {step}");
        assert_eq!(bits(&h), bits(&h2), "h at step {step}");
        assert_eq!(bits(&act), bits(&act2), "act at step {step}");
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn reference_cell_matches_f64_matmul_then_pointwise() {
    let (batch, input, hidden) = (3, 5, 4);
    let width = 4 * hidden;
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let x = random(&mut rng, batch * input, 1.0);
    let h_prev = random(&mut rng, batch * hidden, 1.0);
    let c_prev = random(&mut rng, batch * hidden, 1.0);
    let w_ih = random(&mut rng, input * width, 0.5);
    let w_hh = random(&mut rng, hidden * width, 0.5);
    let mut bias = vec![0.0; width];
    init_lstm_bias(&mut bias, hidden, DEFAULT_FORGET_BIAS).unwrap();
    let (mut h, mut c) = (vec![0.0; batch * hidden], vec![0.0; batch * hidden]);
    lstm_cell_reference(
        &x, &h_prev, &c_prev, &w_ih, &w_hh, &bias, &mut h, &mut c, batch, input, hidden,
    )
    .unwrap();

    let mut pre = vec![0.0f64; batch * width];
    for b in 0..batch {
        for n in 0..width {
            let mut s = f64::from(bias[n]);
            for k in 0..input {
                s += f64::from(x[b * input + k]) * f64::from(w_ih[k * width + n]);
            }
            for k in 0..hidden {
                s += f64::from(h_prev[b * hidden + k]) * f64::from(w_hh[k * width + n]);
            }
            pre[b * width + n] = s;
        }
    }
    let c_prev64: Vec<f64> = c_prev.iter().map(|&v| f64::from(v)).collect();
    let (c64, h64, _) = forward64(&pre, &c_prev64, batch, hidden);
    // The f32 matmul adds rounding of order 1e-6 per term.
    assert_close(&c, &c64, 1e-5, "c");
    assert_close(&h, &h64, 1e-5, "h");
}

/// Scalar loss `sum(wh * h) + sum(wc * c)` in f64 from f32 kernel outputs.
fn loss_of(c: &[f32], h: &[f32], wc: &[f32], wh: &[f32]) -> f64 {
    let lc: f64 = c
        .iter()
        .zip(wc)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum();
    let lh: f64 = h
        .iter()
        .zip(wh)
        .map(|(&a, &b)| f64::from(a) * f64::from(b))
        .sum();
    lc + lh
}

fn run_backward(k: &Case, act: &[f32], c: &[f32], dh: &[f32], dc: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let mut dgates = vec![0.0; k.batch * 4 * k.hidden];
    let mut dc_prev = vec![0.0; k.batch * k.hidden];
    lstm_pointwise_backward(
        act,
        &k.c_prev,
        c,
        dh,
        dc,
        &mut dgates,
        &mut dc_prev,
        k.batch,
        k.hidden,
    )
    .unwrap();
    (dgates, dc_prev)
}

#[test]
fn backward_matches_finite_differences_of_the_f32_kernel() {
    let k = case(3, 3, 4);
    let mut rng = ChaCha8Rng::seed_from_u64(4);
    let n = k.batch * k.hidden;
    let wh = random(&mut rng, n, 1.0);
    let wc = random(&mut rng, n, 1.0);
    let (c, _, act) = run_forward(&k);
    // dL/dh = wh, dL/dc (from later steps) = wc.
    let (dgates, dc_prev) = run_backward(&k, &act, &c, &wh, &wc);

    // Central differences through lstm_pointwise_forward itself; eps balances the O(eps^2)
    // truncation against f32 rounding of order 1e-7 / eps.
    let eps = 1e-2f32;
    let tol = 2e-3;
    for (idx, &analytic) in dgates.iter().enumerate() {
        let mut plus = Case {
            gates: k.gates.clone(),
            bias: k.bias.clone(),
            c_prev: k.c_prev.clone(),
            ..k
        };
        plus.gates[idx] += eps;
        let (cp, hp, _) = run_forward(&plus);
        plus.gates[idx] -= 2.0 * eps;
        let (cm, hm, _) = run_forward(&plus);
        let numeric =
            (loss_of(&cp, &hp, &wc, &wh) - loss_of(&cm, &hm, &wc, &wh)) / (2.0 * f64::from(eps));
        let analytic = f64::from(analytic);
        assert!(
            (numeric - analytic).abs() <= tol * (1.0 + numeric.abs()),
            "dgates[{idx}]: analytic {analytic}, numeric {numeric}"
        );
    }
    for (idx, &analytic) in dc_prev.iter().enumerate() {
        let mut plus = Case {
            gates: k.gates.clone(),
            bias: k.bias.clone(),
            c_prev: k.c_prev.clone(),
            ..k
        };
        plus.c_prev[idx] += eps;
        let (cp, hp, _) = run_forward(&plus);
        plus.c_prev[idx] -= 2.0 * eps;
        let (cm, hm, _) = run_forward(&plus);
        let numeric =
            (loss_of(&cp, &hp, &wc, &wh) - loss_of(&cm, &hm, &wc, &wh)) / (2.0 * f64::from(eps));
        let analytic = f64::from(analytic);
        assert!(
            (numeric - analytic).abs() <= tol * (1.0 + numeric.abs()),
            "dc_prev[{idx}]: analytic {analytic}, numeric {numeric}"
        );
    }
}

#[test]
fn backward_matches_finite_differences_in_f64() {
    // The f64 model has negligible rounding, so the kernel's f32 gradient must agree to
    // f32 precision with a central difference of step 1e-5.
    let k = case(5, 2, 6);
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let n = k.batch * k.hidden;
    let wh = random(&mut rng, n, 1.0);
    let wc = random(&mut rng, n, 1.0);
    let (c, _, act) = run_forward(&k);
    let (dgates, dc_prev) = run_backward(&k, &act, &c, &wh, &wc);

    let pre = pre_activations(&k.gates, &k.bias, k.hidden);
    let c_prev: Vec<f64> = k.c_prev.iter().map(|&v| f64::from(v)).collect();
    let loss64 = |pre: &[f64], c_prev: &[f64]| {
        let (c, h, _) = forward64(pre, c_prev, k.batch, k.hidden);
        c.iter()
            .zip(&wc)
            .map(|(a, &b)| a * f64::from(b))
            .sum::<f64>()
            + h.iter()
                .zip(&wh)
                .map(|(a, &b)| a * f64::from(b))
                .sum::<f64>()
    };
    let eps = 1e-5;
    for idx in 0..pre.len() {
        let (mut p, mut m) = (pre.clone(), pre.clone());
        p[idx] += eps;
        m[idx] -= eps;
        let numeric = (loss64(&p, &c_prev) - loss64(&m, &c_prev)) / (2.0 * eps);
        let err = (numeric - f64::from(dgates[idx])).abs();
        assert!(err <= 1e-5 * (1.0 + numeric.abs()), "dgates[{idx}]: {err}");
    }
    for idx in 0..c_prev.len() {
        let (mut p, mut m) = (c_prev.clone(), c_prev.clone());
        p[idx] += eps;
        m[idx] -= eps;
        let numeric = (loss64(&pre, &p) - loss64(&pre, &m)) / (2.0 * eps);
        let err = (numeric - f64::from(dc_prev[idx])).abs();
        assert!(err <= 1e-5 * (1.0 + numeric.abs()), "dc_prev[{idx}]: {err}");
    }
}

#[test]
fn init_bias_sets_only_the_forget_block() {
    let hidden = 3;
    let mut bias = vec![7.0; 4 * hidden];
    init_lstm_bias(&mut bias, hidden, 2.5).unwrap();
    assert_eq!(
        bias,
        [0.0, 0.0, 0.0, 2.5, 2.5, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    );
    let err = init_lstm_bias(&mut bias, 4, 1.0).unwrap_err();
    assert_eq!(
        err,
        Error::ShapeMismatch {
            arg: "bias",
            expected: 16,
            actual: 12
        }
    );
}

#[test]
fn wrong_lengths_name_the_argument_and_write_nothing() {
    let (batch, hidden) = (2, 3);
    let gates = vec![0.0; batch * 4 * hidden];
    let bias = vec![0.0; 4 * hidden];
    let c_prev = vec![0.0; batch * hidden];
    let mut c = vec![9.0; batch * hidden];
    let mut h = vec![9.0; batch * hidden - 1];
    let mut act = vec![9.0; batch * 4 * hidden];
    let err = lstm_pointwise_forward(
        &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
    )
    .unwrap_err();
    assert_eq!(
        err,
        Error::ShapeMismatch {
            arg: "h",
            expected: 6,
            actual: 5
        }
    );
    assert!(c.iter().chain(&act).all(|&v| v == 9.0), "nothing written");
    assert!(err.to_string().contains("`h` has 5 elements, expected 6"));

    let mut h = vec![0.0; batch * hidden];
    let err = lstm_pointwise_forward(&gates, &bias[1..], &c_prev, &mut c, &mut h, &mut act, 2, 3)
        .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { arg: "bias", .. }));

    let proj = vec![0.0; 2 * batch * 4 * hidden];
    let err = lstm_pointwise_forward_step(
        &proj, &gates, &bias, &c_prev, &mut c, &mut h, &mut act, 2, 2, batch, hidden,
    )
    .unwrap_err();
    assert!(matches!(err, Error::InvalidValue { name: "step", .. }));
    let err = lstm_pointwise_forward_step(
        &proj, &gates, &bias, &c_prev, &mut c, &mut h, &mut act, 0, 3, batch, hidden,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        Error::ShapeMismatch {
            arg: "input_proj",
            expected: 72,
            actual: 48
        }
    ));

    let mut dgates = vec![0.0; batch * 4 * hidden];
    let mut dc_prev = vec![0.0; batch * hidden + 2];
    let err = lstm_pointwise_backward(
        &act,
        &c_prev,
        &c,
        &h,
        &c,
        &mut dgates,
        &mut dc_prev,
        batch,
        hidden,
    )
    .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { arg: "dc_prev", .. }));

    let err = lstm_pointwise_forward(&[], &[], &[], &mut [], &mut [], &mut [], usize::MAX, 2)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidValue { .. }));
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
    fn forward_and_backward_match_f64_for_any_shape(
        batch in 1usize..6, hidden in 1usize..12, seed in any::<u64>()
    ) {
        let k = case(seed, batch, hidden);
        let (c, h, act) = run_forward(&k);
        let c_prev64: Vec<f64> = k.c_prev.iter().map(|&x| f64::from(x)).collect();
        let (c64, h64, act64) =
            forward64(&pre_activations(&k.gates, &k.bias, hidden), &c_prev64, batch, hidden);
        assert_close(&c, &c64, FORWARD_TOL, "c");
        assert_close(&h, &h64, FORWARD_TOL, "h");
        assert_close(&act, &act64, FORWARD_TOL, "act");

        // Backward against the f64 chain rule evaluated on the f64 activations.
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
        let dh = random(&mut rng, batch * hidden, 1.0);
        let dc = random(&mut rng, batch * hidden, 1.0);
        let (dgates, dc_prev) = run_backward(&k, &act, &c, &dh, &dc);
        let mut want_dg = vec![0.0f64; batch * 4 * hidden];
        let mut want_dcp = vec![0.0f64; batch * hidden];
        for b in 0..batch {
            for j in 0..hidden {
                let s = b * hidden + j;
                let at = |g: usize| b * 4 * hidden + g * hidden + j;
                let (i, f, g, o) = (act64[at(0)], act64[at(1)], act64[at(2)], act64[at(3)]);
                let tc = c64[s].tanh();
                let dct = f64::from(dc[s]) + f64::from(dh[s]) * o * (1.0 - tc * tc);
                want_dg[at(0)] = dct * g * i * (1.0 - i);
                want_dg[at(1)] = dct * c_prev64[s] * f * (1.0 - f);
                want_dg[at(2)] = dct * i * (1.0 - g * g);
                want_dg[at(3)] = f64::from(dh[s]) * tc * o * (1.0 - o);
                want_dcp[s] = dct * f;
            }
        }
        assert_close(&dgates, &want_dg, 1e-5, "dgates");
        assert_close(&dc_prev, &want_dcp, 1e-5, "dc_prev");
    }
}
