//! The `par` kernels equal the serial ones bit for bit, for any shape and thread count.
#![cfg(feature = "rayon")]

use half::{bf16, f16};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_kernels as k;
use ringtrain_kernels::par::{self, PAR_BLOCK};

fn random(seed: u64, len: usize, spread: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(-spread..spread)).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `f` on pools of 1, 3 and 4 threads.
fn on_pools(f: impl Fn() + Sync) {
    for threads in [1, 3, 4] {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a small thread pool can be built")
            .install(&f);
    }
}

fn check_lstm(batch: usize, hidden: usize, seed: u64) {
    let (n, g) = (batch * hidden, batch * 4 * hidden);
    let steps = 2;
    let gates = random(seed, g, 4.0);
    let proj = random(seed + 1, steps * g, 2.0);
    let bias = random(seed + 2, 4 * hidden, 1.0);
    let c_prev = random(seed + 3, n, 2.0);
    let dh = random(seed + 4, n, 1.0);
    let dc = random(seed + 5, n, 1.0);

    let (mut c, mut h, mut act) = (vec![0.0; n], vec![0.0; n], vec![0.0; g]);
    k::lstm_pointwise_forward(
        &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
    )
    .unwrap();
    let (mut cs, mut hs, mut acts) = (vec![0.0; n], vec![0.0; n], vec![0.0; g]);
    k::lstm_pointwise_forward_step(
        &proj, &gates, &bias, &c_prev, &mut cs, &mut hs, &mut acts, 1, steps, batch, hidden,
    )
    .unwrap();
    let (mut dg, mut dcp) = (vec![0.0; g], vec![0.0; n]);
    k::lstm_pointwise_backward(
        &act, &c_prev, &c, &dh, &dc, &mut dg, &mut dcp, batch, hidden,
    )
    .unwrap();

    on_pools(|| {
        let (mut c2, mut h2, mut act2) = (vec![0.0; n], vec![0.0; n], vec![0.0; g]);
        par::lstm_pointwise_forward(
            &gates, &bias, &c_prev, &mut c2, &mut h2, &mut act2, batch, hidden,
        )
        .unwrap();
        assert_eq!(bits(&c), bits(&c2));
        assert_eq!(bits(&h), bits(&h2));
        assert_eq!(bits(&act), bits(&act2));
        let (mut c2, mut h2, mut act2) = (vec![0.0; n], vec![0.0; n], vec![0.0; g]);
        par::lstm_pointwise_forward_step(
            &proj, &gates, &bias, &c_prev, &mut c2, &mut h2, &mut act2, 1, steps, batch, hidden,
        )
        .unwrap();
        assert_eq!(bits(&cs), bits(&c2));
        assert_eq!(bits(&hs), bits(&h2));
        assert_eq!(bits(&acts), bits(&act2));
        let (mut dg2, mut dcp2) = (vec![0.0; g], vec![0.0; n]);
        par::lstm_pointwise_backward(
            &act, &c_prev, &c, &dh, &dc, &mut dg2, &mut dcp2, batch, hidden,
        )
        .unwrap();
        assert_eq!(bits(&dg), bits(&dg2));
        assert_eq!(bits(&dcp), bits(&dcp2));
    });
}

type FusedSoftmax = fn(
    &mut [f32],
    &[u32],
    &[f32],
    &mut [f32],
    &mut [f32],
    f32,
    usize,
    usize,
    Option<&mut [k::bf16]>,
) -> k::Result<()>;

type SoftmaxForward =
    fn(&[f32], &[u32], &[f32], &mut [f32], &mut [f32], usize, usize) -> k::Result<()>;

fn check_softmax(rows: usize, vocab: usize, seed: u64) {
    let logits = random(seed, rows * vocab, 30.0);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let labels: Vec<u32> = (0..rows).map(|_| rng.gen_range(0..vocab as u32)).collect();
    let mask: Vec<f32> = (0..rows).map(|r| [1.0, 0.0, 0.5][r % 3]).collect();
    let run = |f: SoftmaxForward| {
        let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        f(&logits, &labels, &mask, &mut loss, &mut lse, rows, vocab).unwrap();
        (loss, lse)
    };
    let serial = run(k::softmax_xent_forward);
    let online = run(k::softmax_xent_forward_online);
    let mut grad = logits.clone();
    k::softmax_xent_backward(&mut grad, &serial.1, &labels, &mask, 0.125, rows, vocab).unwrap();
    on_pools(|| {
        let p = run(par::softmax_xent_forward);
        assert_eq!((bits(&serial.0), bits(&serial.1)), (bits(&p.0), bits(&p.1)));
        let p = run(par::softmax_xent_forward_online);
        assert_eq!((bits(&online.0), bits(&online.1)), (bits(&p.0), bits(&p.1)));
        let mut grad2 = logits.clone();
        par::softmax_xent_backward(&mut grad2, &serial.1, &labels, &mask, 0.125, rows, vocab)
            .unwrap();
        assert_eq!(bits(&grad), bits(&grad2));
        for with_copy in [false, true] {
            let run_fused = |fused: FusedSoftmax| {
                let mut grad = logits.clone();
                let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
                let mut copy = vec![k::bf16::ZERO; grad.len()];
                let out = with_copy.then_some(&mut copy[..]);
                let (l, m) = (&labels, &mask);
                fused(
                    &mut grad, l, m, &mut loss, &mut lse, 0.125, rows, vocab, out,
                )
                .unwrap();
                let copy: Vec<u16> = copy.iter().map(|c| c.to_bits()).collect();
                (bits(&grad), bits(&loss), bits(&lse), copy)
            };
            assert_eq!(
                run_fused(k::softmax_xent_forward_backward),
                run_fused(par::softmax_xent_forward_backward)
            );
        }
    });
}

fn check_elementwise(len: usize, seed: u64) {
    let mut src = random(seed, len, 80000.0);
    if len > 5 {
        src[len / 2] = f32::NAN;
    }
    let grads = random(seed + 1, len, 1.0);
    let p0 = random(seed + 2, len, 1.0);

    let mut h = vec![f16::ZERO; len];
    let hf = k::f32_to_f16_scaled(&src, 0.75, &mut h).unwrap();
    let mut b = vec![bf16::ZERO; len];
    let bf = k::f32_to_bf16_scaled(&src, 0.75, &mut b).unwrap();
    let mut hw = vec![0.0; len];
    k::f16_to_f32_unscaled(&h, 1.0 / 0.75, &mut hw).unwrap();
    let mut bw = vec![0.0; len];
    k::bf16_to_f32_unscaled(&b, 1.0 / 0.75, &mut bw).unwrap();
    let mut sum = p0.clone();
    k::sum_into_f32(&mut sum, &grads).unwrap();
    k::scale_f32(&mut sum, 0.3);

    let mut sgd = p0.clone();
    k::sgd_step(&mut sgd, &grads, 0.1, 1e-3).unwrap();
    let mut mom = p0.clone();
    let mut buf = grads.clone();
    k::sgd_momentum_step(
        &mut mom, &grads, &mut buf, 0.1, 0.9, 0.1, 1e-3, false, false,
    )
    .unwrap();
    let mut nest = p0.clone();
    let mut nbuf = vec![0.0; len];
    k::sgd_momentum_step(&mut nest, &grads, &mut nbuf, 0.1, 0.9, 0.0, 0.0, true, true).unwrap();
    let mut adam = p0.clone();
    let (mut m, mut v) = (grads.clone(), vec![0.01; len]);
    k::adam_step(
        &mut adam, &grads, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 3,
    )
    .unwrap();
    let scale = k::GradScale(0.3, 0.9);
    let squares = k::sum_of_squares_scaled(&src, 0.75);
    let mut sgd_scaled = p0.clone();
    k::sgd_step_scaled(&mut sgd_scaled, &grads, 0.1, 1e-3, scale).unwrap();
    let mut adam_scaled = p0.clone();
    let (mut ms, mut vs) = (grads.clone(), vec![0.01; len]);
    let hyper = [1e-3, 0.9, 0.999, 1e-8, 1e-2];
    k::adam_step_scaled(&mut adam_scaled, &grads, &mut ms, &mut vs, hyper, 3, scale).unwrap();
    let mut adamw = p0.clone();
    let (mut mw, mut vw) = (grads.clone(), vec![0.01; len]);
    k::adamw_step(
        &mut adamw, &grads, &mut mw, &mut vw, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 3,
    )
    .unwrap();

    on_pools(|| {
        let mut h2 = vec![f16::ZERO; len];
        assert_eq!(par::f32_to_f16_scaled(&src, 0.75, &mut h2).unwrap(), hf);
        assert!(h.iter().zip(&h2).all(|(a, b)| a.to_bits() == b.to_bits()));
        let mut b2 = vec![bf16::ZERO; len];
        assert_eq!(par::f32_to_bf16_scaled(&src, 0.75, &mut b2).unwrap(), bf);
        assert!(b.iter().zip(&b2).all(|(a, b)| a.to_bits() == b.to_bits()));
        let mut w = vec![0.0; len];
        par::f16_to_f32_unscaled(&h, 1.0 / 0.75, &mut w).unwrap();
        assert_eq!(bits(&hw), bits(&w));
        par::bf16_to_f32_unscaled(&b, 1.0 / 0.75, &mut w).unwrap();
        assert_eq!(bits(&bw), bits(&w));
        let mut s = p0.clone();
        par::sum_into_f32(&mut s, &grads).unwrap();
        par::scale_f32(&mut s, 0.3);
        assert_eq!(bits(&sum), bits(&s));

        let mut p = p0.clone();
        par::sgd_step(&mut p, &grads, 0.1, 1e-3).unwrap();
        assert_eq!(bits(&sgd), bits(&p));
        let (mut p, mut bf) = (p0.clone(), grads.clone());
        par::sgd_momentum_step(&mut p, &grads, &mut bf, 0.1, 0.9, 0.1, 1e-3, false, false).unwrap();
        assert_eq!((bits(&mom), bits(&buf)), (bits(&p), bits(&bf)));
        let (mut p, mut bf) = (p0.clone(), vec![0.0; len]);
        par::sgd_momentum_step(&mut p, &grads, &mut bf, 0.1, 0.9, 0.0, 0.0, true, true).unwrap();
        assert_eq!((bits(&nest), bits(&nbuf)), (bits(&p), bits(&bf)));
        let (mut p, mut m2, mut v2) = (p0.clone(), grads.clone(), vec![0.01; len]);
        par::adam_step(
            &mut p, &grads, &mut m2, &mut v2, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 3,
        )
        .unwrap();
        assert_eq!(bits(&adam), bits(&p));
        assert_eq!((bits(&m), bits(&v)), (bits(&m2), bits(&v2)));
        let (mut p, mut m2, mut v2) = (p0.clone(), grads.clone(), vec![0.01; len]);
        par::adamw_step(
            &mut p, &grads, &mut m2, &mut v2, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 3,
        )
        .unwrap();
        assert_eq!(bits(&adamw), bits(&p));
        assert_eq!((bits(&mw), bits(&vw)), (bits(&m2), bits(&v2)));

        let par_squares = par::sum_of_squares_scaled(&src, 0.75);
        assert_eq!(
            squares.to_bits(),
            par_squares.to_bits(),
            "{squares} {par_squares}"
        );
        assert_eq!(squares.is_finite(), len <= 5, "the NaN is seen");
        let mut p = p0.clone();
        par::sgd_step_scaled(&mut p, &grads, 0.1, 1e-3, scale).unwrap();
        assert_eq!(bits(&sgd_scaled), bits(&p));
        let (mut p, mut m2, mut v2) = (p0.clone(), grads.clone(), vec![0.01; len]);
        par::adam_step_scaled(&mut p, &grads, &mut m2, &mut v2, hyper, 3, scale).unwrap();
        assert_eq!(bits(&adam_scaled), bits(&p));
        assert_eq!((bits(&ms), bits(&vs)), (bits(&m2), bits(&v2)));
    });
}

#[test]
fn lstm_par_equals_serial() {
    check_lstm(37, 19, 1);
    check_lstm(1, 1, 2);
}

#[test]
fn softmax_par_equals_serial() {
    check_softmax(33, 517, 3);
    check_softmax(1, 1, 4);
}

#[test]
fn elementwise_par_equals_serial_across_blocks() {
    check_elementwise(3 * PAR_BLOCK + 17, 5);
    check_elementwise(1, 6);
}

#[test]
fn par_errors_match_serial() {
    let mut loss = [0.0f32; 2];
    let mut lse = [0.0f32; 2];
    let err = par::softmax_xent_forward(&[0.0; 6], &[0, 3], &[1.0, 1.0], &mut loss, &mut lse, 2, 3)
        .unwrap_err();
    assert_eq!(
        err,
        k::Error::LabelOutOfRange {
            row: 1,
            label: 3,
            vocab: 3
        }
    );
    let err = par::adam_step(
        &mut [0.0; 2],
        &[0.0; 2],
        &mut [0.0; 2],
        &mut [0.0; 1],
        0.1,
        0.9,
        0.999,
        1e-8,
        0.0,
        1,
    )
    .unwrap_err();
    assert!(matches!(err, k::Error::ShapeMismatch { arg: "v", .. }));
    let err = par::lstm_pointwise_backward(
        &[0.0; 8],
        &[0.0; 2],
        &[0.0; 2],
        &[0.0; 2],
        &[0.0; 1],
        &mut [0.0; 8],
        &mut [0.0; 2],
        1,
        2,
    )
    .unwrap_err();
    assert!(matches!(err, k::Error::ShapeMismatch { arg: "dc", .. }));
    assert!(par::f32_to_f16_scaled(&[1.0; 3], 1.0, &mut [f16::ZERO; 2]).is_err());
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
    #![proptest_config(ProptestConfig::with_cases(cases(24)))]

    #[test]
    fn par_equals_serial_for_any_shape(
        batch in 1usize..40, hidden in 1usize..24, vocab in 1usize..300,
        len in 1usize..40_000, seed in any::<u64>()
    ) {
        check_lstm(batch, hidden, seed);
        check_softmax(batch, vocab, seed);
        check_elementwise(len, seed);
    }
}

#[test]
fn gemm_bf16_par_equals_serial_on_every_path_this_cpu_has() {
    use ringtrain_kernels::gemm_bf16::{Bf16Path, MatRef, MC, NC, NR};

    let to_bf16 = |v: Vec<f32>| v.into_iter().map(bf16::from_f32).collect::<Vec<_>>();
    // Split by rows: several MC blocks and a short last block. Split by columns: few rows
    // (one step of a recurrence), columns across several NR panels and a short last one,
    // and across two column blocks (NC), so that a task's columns start inside a block.
    // C has a row stride > n in each.
    for (m, n, kk, ldc) in [
        (2 * MC + 37, 45, 70, 50),
        (19, 9 * NR + 5, 70, 9 * NR + 8),
        (7, NC + 3 * NR + 9, 40, NC + 3 * NR + 9),
    ] {
        let a_data = to_bf16(random(41, kk * m, 1.0));
        let b_data = to_bf16(random(42, n * kk, 1.0));
        for path in Bf16Path::ALL.into_iter().filter(|p| p.available()) {
            for accumulate in [false, true] {
                // TN and NT: A stored [k, m], B stored [n, k].
                let a = MatRef::row_major(&a_data, kk, m).unwrap().t();
                let b = MatRef::row_major(&b_data, n, kk).unwrap().t();
                let c0 = random(43, (m - 1) * ldc + n, 1.0);
                let mut serial = c0.clone();
                k::gemm_bf16::gemm_bf16(path, a, b, &mut serial, ldc, accumulate).unwrap();
                let packed = k::gemm_bf16::PackedB::new(path, b).unwrap();
                on_pools(|| {
                    let mut parallel = c0.clone();
                    par::gemm_bf16(path, a, b, &mut parallel, ldc, accumulate).unwrap();
                    assert_eq!(
                        bits(&parallel),
                        bits(&serial),
                        "{} m {m} n {n} accumulate {accumulate}",
                        path.name()
                    );
                    // B packed ahead by the serial and by the parallel packer.
                    for packed in [packed.clone(), par::pack_b(path, b).unwrap()] {
                        let mut parallel = c0.clone();
                        par::gemm_bf16_packed(a, &packed, &mut parallel, ldc, accumulate).unwrap();
                        assert_eq!(
                            bits(&parallel),
                            bits(&serial),
                            "{} B packed ahead, m {m} n {n} accumulate {accumulate}",
                            path.name()
                        );
                    }
                });
            }
        }
    }
}

#[test]
fn the_plain_bf16_cast_in_parallel_equals_the_serial_one() {
    let src = random(51, 3 * PAR_BLOCK + 17, 1e3);
    let mut serial = vec![bf16::ZERO; src.len()];
    k::f32_to_bf16(&src, &mut serial).unwrap();
    on_pools(|| {
        let mut parallel = vec![bf16::ZERO; src.len()];
        par::f32_to_bf16(&src, &mut parallel).unwrap();
        assert_eq!(bits16(&parallel), bits16(&serial));
        assert!(par::f32_to_bf16(&src, &mut parallel[1..]).is_err());
    });
}

fn bits16(x: &[bf16]) -> Vec<u16> {
    x.iter().map(|v| v.to_bits()).collect()
}
