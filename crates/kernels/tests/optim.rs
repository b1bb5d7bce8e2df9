//! Optimizer steps against hand-written f64 versions of PyTorch's update rules, and
//! global-norm clipping.

use ringtrain_kernels::{
    adam_step, adam_step_scaled, adamw_step, clip_by_global_norm, clip_factor, scale_f32,
    sgd_momentum_step, sgd_step, sgd_step_scaled, sum_of_squares, sum_of_squares_scaled, Error,
    GradScale, SQUARES_BLOCK,
};

const P0: [f32; 4] = [0.5, -1.25, 2.0, 0.0];
const GRADS: [[f32; 4]; 3] = [
    [0.1, -0.2, 0.3, 1.0],
    [-0.4, 0.05, 0.3, -1.0],
    [0.0, 0.7, -0.2, 2.0],
];

fn assert_close(got: &[f32], want: &[f64], tol: f64, what: &str) {
    for (n, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{n}]: got {g}, want {w}"
        );
    }
}

#[test]
fn sgd_matches_pytorch() {
    let (lr, wd) = (0.1f32, 0.01f32);
    let mut p = P0.to_vec();
    let mut want: Vec<f64> = P0.iter().map(|&x| f64::from(x)).collect();
    for g in GRADS {
        sgd_step(&mut p, &g, lr, wd).unwrap();
        for (w, &g) in want.iter_mut().zip(&g) {
            *w -= f64::from(lr) * (f64::from(g) + f64::from(wd) * *w);
        }
        assert_close(&p, &want, 1e-6, "sgd");
    }
    // First step by hand: p0 = 0.5, g = 0.1: 0.5 - 0.1 * (0.1 + 0.005) = 0.4895.
    let mut p = [0.5f32];
    sgd_step(&mut p, &[0.1], 0.1, 0.01).unwrap();
    assert!((p[0] - 0.4895).abs() < 1e-7);
}

fn momentum_reference(
    lr: f64,
    momentum: f64,
    dampening: f64,
    wd: f64,
    nesterov: bool,
) -> Vec<Vec<f64>> {
    let mut p: Vec<f64> = P0.iter().map(|&x| f64::from(x)).collect();
    let mut buf = [0.0f64; 4];
    let mut out = Vec::new();
    for (step, g) in GRADS.iter().enumerate() {
        for n in 0..4 {
            let mut d = f64::from(g[n]) + wd * p[n];
            buf[n] = if step == 0 {
                d
            } else {
                momentum * buf[n] + (1.0 - dampening) * d
            };
            d = if nesterov {
                d + momentum * buf[n]
            } else {
                buf[n]
            };
            p[n] -= lr * d;
        }
        out.push(p.clone());
    }
    out
}

#[test]
fn momentum_sgd_matches_pytorch() {
    for (momentum, dampening, wd, nesterov) in [
        (0.9f32, 0.0f32, 0.0f32, false),
        (0.9, 0.1, 1e-2, false),
        (0.8, 0.0, 1e-3, true),
    ] {
        let lr = 0.05f32;
        let want = momentum_reference(
            f64::from(lr),
            f64::from(momentum),
            f64::from(dampening),
            f64::from(wd),
            nesterov,
        );
        let mut p = P0.to_vec();
        let mut buf = vec![123.0f32; 4]; // ignored on the first step
        for (step, g) in GRADS.iter().enumerate() {
            sgd_momentum_step(
                &mut p,
                g,
                &mut buf,
                lr,
                momentum,
                dampening,
                wd,
                nesterov,
                step == 0,
            )
            .unwrap();
            assert_close(&p, &want[step], 1e-6, "momentum");
        }
    }
    let err = sgd_momentum_step(
        &mut [0.0],
        &[0.0],
        &mut [0.0],
        0.1,
        0.0,
        0.0,
        0.0,
        true,
        true,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidValue {
            name: "nesterov",
            ..
        }
    ));
}

fn adam_reference(lr: f64, b1: f64, b2: f64, eps: f64, wd: f64, decoupled: bool) -> Vec<Vec<f64>> {
    let mut p: Vec<f64> = P0.iter().map(|&x| f64::from(x)).collect();
    let mut m = [0.0f64; 4];
    let mut v = [0.0f64; 4];
    let mut out = Vec::new();
    for (t, g) in GRADS.iter().enumerate() {
        let step = (t + 1) as i32;
        for n in 0..4 {
            let mut g = f64::from(g[n]);
            if decoupled {
                p[n] *= 1.0 - lr * wd;
            } else {
                g += wd * p[n];
            }
            m[n] = b1 * m[n] + (1.0 - b1) * g;
            v[n] = b2 * v[n] + (1.0 - b2) * g * g;
            let bc1 = 1.0 - b1.powi(step);
            let bc2 = 1.0 - b2.powi(step);
            p[n] -= (lr / bc1) * m[n] / (v[n].sqrt() / bc2.sqrt() + eps);
        }
        out.push(p.clone());
    }
    out
}

#[test]
fn adam_and_adamw_match_pytorch() {
    let (lr, b1, b2, eps) = (1e-2f32, 0.9f32, 0.999f32, 1e-8f32);
    for wd in [0.0f32, 0.1] {
        for decoupled in [false, true] {
            let want = adam_reference(
                f64::from(lr),
                f64::from(b1),
                f64::from(b2),
                f64::from(eps),
                f64::from(wd),
                decoupled,
            );
            let mut p = P0.to_vec();
            let (mut m, mut v) = (vec![0.0f32; 4], vec![0.0f32; 4]);
            for (t, g) in GRADS.iter().enumerate() {
                let step = t as u32 + 1;
                if decoupled {
                    adamw_step(&mut p, g, &mut m, &mut v, lr, b1, b2, eps, wd, step).unwrap();
                } else {
                    adam_step(&mut p, g, &mut m, &mut v, lr, b1, b2, eps, wd, step).unwrap();
                }
                assert_close(&p, &want[t], 2e-6, "adam");
            }
        }
    }
    // First Adam step moves every parameter with a non-zero gradient by about lr.
    let mut p = [1.0f32, 1.0];
    adam_step(
        &mut p,
        &[0.3, -5.0],
        &mut [0.0; 2],
        &mut [0.0; 2],
        0.01,
        0.9,
        0.999,
        1e-8,
        0.0,
        1,
    )
    .unwrap();
    assert!(
        (p[0] - 0.99).abs() < 1e-6 && (p[1] - 1.01).abs() < 1e-6,
        "{p:?}"
    );
}

#[test]
fn optimizer_errors_name_the_argument() {
    let mut p = [0.0f32; 3];
    assert_eq!(
        sgd_step(&mut p, &[0.0; 2], 0.1, 0.0).unwrap_err(),
        Error::ShapeMismatch {
            arg: "grads",
            expected: 3,
            actual: 2
        }
    );
    let err = sgd_momentum_step(
        &mut p,
        &[0.0; 3],
        &mut [0.0; 4],
        0.1,
        0.9,
        0.0,
        0.0,
        false,
        true,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        Error::ShapeMismatch {
            arg: "momentum_buf",
            ..
        }
    ));
    let (g, mut m, mut v) = ([1.0f32; 3], [0.0f32; 3], [0.0f32; 2]);
    let err = adam_step(&mut p, &g, &mut m, &mut v, 0.1, 0.9, 0.999, 1e-8, 0.0, 1).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { arg: "v", .. }));
    let mut v = [0.0f32; 3];
    let err = adamw_step(&mut p, &g, &mut m, &mut v, 0.1, 0.9, 0.999, 1e-8, 0.0, 0).unwrap_err();
    assert!(matches!(err, Error::InvalidValue { name: "step", .. }));
    let err = adam_step(&mut p, &g, &mut m, &mut v, 0.1, 1.0, 0.999, 1e-8, 0.0, 1).unwrap_err();
    assert!(matches!(err, Error::InvalidValue { name: "beta1", .. }));
    let err = adam_step(&mut p, &g, &mut m, &mut v, -0.1, 0.9, 0.999, 1e-8, 0.0, 1).unwrap_err();
    assert!(matches!(err, Error::InvalidValue { name: "lr", .. }));
    let err = sgd_step(&mut p, &g, 0.1, f32::NAN).unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidValue {
            name: "weight_decay",
            ..
        }
    ));
    let err = sgd_momentum_step(&mut p, &g, &mut m, 0.1, -0.9, 0.0, 0.0, false, true).unwrap_err();
    assert!(matches!(
        err,
        Error::InvalidValue {
            name: "momentum",
            ..
        }
    ));
    assert!(
        err.to_string()
            .contains("invalid value `-0.9` for momentum"),
        "{err}"
    );
    assert_eq!(p, [0.0; 3], "nothing written on error");
    assert_eq!(m, [0.0; 3]);
}

#[test]
fn clipping_follows_clip_grad_norm() {
    // Norm of [3, 4] and [12] is 13.
    let mut a = vec![3.0f32, 4.0];
    let mut b = vec![12.0f32];
    let total = clip_by_global_norm(&mut [&mut a, &mut b], 6.5);
    assert_eq!(total, 13.0);
    let factor = 6.5 / (13.0 + 1e-6);
    assert_close(&a, &[3.0 * factor, 4.0 * factor], 1e-7, "a");
    assert_close(&b, &[12.0 * factor], 1e-7, "b");

    // Below the limit nothing changes.
    let mut a = vec![0.3f32, -0.4];
    let total = clip_by_global_norm(&mut [&mut a], 1.0);
    assert!((total - 0.5).abs() < 1e-7);
    assert_eq!(a, [0.3, -0.4]);

    assert_eq!(clip_factor(0.0, 1.0), 1.0);
    assert_eq!(clip_factor(f64::INFINITY, 1.0), 0.0);
    assert!(clip_factor(f64::NAN, 1.0).is_nan());
    assert!((clip_factor(4.0, 1.0) - 0.25).abs() < 1e-7);

    let x: Vec<f32> = (1..=7).map(|n| n as f32).collect();
    assert_eq!(sum_of_squares(&x), 140.0);
    assert_eq!(sum_of_squares(&[]), 0.0);
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn updates_through_a_grad_scale_give_the_bits_of_scaling_the_gradients_first() {
    let n = 1000;
    let grads: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
        .collect();
    let p0: Vec<f32> = (0..n)
        .map(|i| ((i * 17 % 89) as f32 - 44.0) * 0.01)
        .collect();
    let scale = GradScale(1.0 / 3.0, 0.7);
    let mut scaled = grads.clone();
    scale_f32(&mut scaled, scale.0);
    scale_f32(&mut scaled, scale.1);

    let (mut want, mut got) = (p0.clone(), p0.clone());
    sgd_step(&mut want, &scaled, 0.1, 1e-3).unwrap();
    sgd_step_scaled(&mut got, &grads, 0.1, 1e-3, scale).unwrap();
    assert_eq!(bits(&got), bits(&want));

    let hyper = [1e-3, 0.9, 0.999, 1e-8, 1e-2];
    let (mut want, mut mw, mut vw) = (p0.clone(), grads.clone(), vec![0.01; n]);
    let [lr, b1, b2, eps, wd] = hyper;
    adam_step(&mut want, &scaled, &mut mw, &mut vw, lr, b1, b2, eps, wd, 4).unwrap();
    let (mut got, mut mg, mut vg) = (p0.clone(), grads.clone(), vec![0.01; n]);
    adam_step_scaled(&mut got, &grads, &mut mg, &mut vg, hyper, 4, scale).unwrap();
    assert_eq!(
        (bits(&got), bits(&mg), bits(&vg)),
        (bits(&want), bits(&mw), bits(&vw))
    );

    // The norm of the scaled gradients, in one pass: the same bits as after scaling.
    assert_eq!(
        sum_of_squares_scaled(&grads, scale.0).to_bits(),
        sum_of_squares(&{
            let mut g = grads.clone();
            scale_f32(&mut g, scale.0);
            g
        })
        .to_bits()
    );

    // A factor that is negative or not finite is named before anything is written.
    let names_grad_scale = |err: Error| {
        matches!(
            err,
            Error::InvalidValue {
                name: "grad_scale",
                ..
            }
        )
    };
    for bad in [GradScale(-1.0, 1.0), GradScale(1.0, f32::NAN)] {
        let mut p = p0.clone();
        let err = sgd_step_scaled(&mut p, &grads, 0.1, 0.0, bad).unwrap_err();
        assert!(names_grad_scale(err), "sgd, {bad:?}");
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let err = adam_step_scaled(&mut p, &grads, &mut m, &mut v, hyper, 1, bad).unwrap_err();
        assert!(names_grad_scale(err), "adam, {bad:?}");
        assert_eq!(bits(&p), bits(&p0));
    }
}

#[test]
fn the_sum_of_squares_is_finite_exactly_when_every_scaled_element_is() {
    let mut x = vec![f32::MAX; 2 * SQUARES_BLOCK + 3];
    assert!(
        sum_of_squares_scaled(&x, 1.0).is_finite(),
        "f32::MAX squared fits in f64"
    );
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        x[SQUARES_BLOCK + 1] = bad;
        assert!(!sum_of_squares_scaled(&x, 0.5).is_finite(), "{bad}");
    }
    // A finite element that the scale takes past f32's range is not finite either, as
    // it would not be after scaling first.
    assert!(!sum_of_squares_scaled(&[f32::MAX], 4.0).is_finite());
}
