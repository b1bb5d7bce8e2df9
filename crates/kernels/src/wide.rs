//! Row kernels compiled three times: for the baseline x86-64 the crate builds for, for
//! AVX2 and for AVX-512, the widest the CPU has taken at run time (with `std`, which can
//! ask).
//!
//! The twins run the same source with wider vectors. The row kernels use no fused
//! multiply-add and no reassociation (Rust never contracts or reorders float arithmetic on
//! its own), and their lane sums keep their fixed lane count, so every twin gives the same
//! bits on every input; the tests of each kernel hold for whichever twin the CPU takes.

/// Whether this CPU runs the AVX-512 twins (F, BW, DQ and VL; the answer is cached by
/// the standard library).
#[cfg(all(feature = "std", target_arch = "x86_64"))]
#[inline]
pub(crate) fn has_avx512() -> bool {
    #[cfg(test)]
    if tests::WIDEST.with(|w| w.get()) < tests::Twin::Avx512 {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

/// Whether this CPU runs the AVX2 twins (AVX2; cached by the standard library).
#[cfg(all(feature = "std", target_arch = "x86_64"))]
#[inline]
pub(crate) fn has_avx2() -> bool {
    #[cfg(test)]
    if tests::WIDEST.with(|w| w.get()) < tests::Twin::Avx2 {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx2")
}

/// `fn $name(args) -> R { body }`, its body compiled three times: for the baseline, for
/// AVX2 and for AVX-512; the widest the CPU has runs.
macro_rules! wide_twin {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(all(feature = "std", target_arch = "x86_64"))]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl")]
                fn wide($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if $crate::wide::has_avx512() {
                    // SAFETY: the CPU has every feature `wide` is compiled for (checked
                    // just above).
                    return unsafe { wide($($arg),*) };
                }
                if $crate::wide::has_avx2() {
                    // SAFETY: the CPU has AVX2, which `avx2` is compiled for (checked just
                    // above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

pub(crate) use wide_twin;

#[cfg(all(test, feature = "std", target_arch = "x86_64"))]
mod tests {
    extern crate alloc;
    use alloc::vec;
    use alloc::vec::Vec;
    use core::cell::Cell;

    use half::bf16;

    use crate::gemm_bf16::{gemm_bf16, Bf16Path};

    /// The twins, narrowest first.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
    pub(super) enum Twin {
        Baseline,
        Avx2,
        Avx512,
    }

    std::thread_local! {
        /// The widest twin this thread's kernels may take (the CPU permitting).
        pub(super) static WIDEST: Cell<Twin> = const { Cell::new(Twin::Avx512) };
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 20_001) as f32 / 1000.0 - 10.0
            })
            .collect()
    }

    /// Every kernel with a twin, on inputs that reach every branch of its row loop; the
    /// outputs as bits.
    fn outputs() -> Vec<Vec<u32>> {
        let (batch, hidden, vocab) = (3, 37, 70);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut out = Vec::new();
        // LSTM pointwise: forward (whole sequence and one step), backward.
        let gates = values(batch * 4 * hidden, 1);
        let bias = values(4 * hidden, 2);
        let c_prev = values(batch * hidden, 3);
        let (mut c, mut h, mut act) = (
            vec![0.0; batch * hidden],
            vec![0.0; batch * hidden],
            vec![0.0; batch * 4 * hidden],
        );
        crate::lstm_pointwise_forward(
            &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
        )
        .unwrap();
        out.extend([bits(&c), bits(&h), bits(&act)]);
        let recurrent = values(batch * 4 * hidden, 4);
        crate::lstm_pointwise_forward_step(
            &gates, &recurrent, &bias, &c_prev, &mut c, &mut h, &mut act, 0, 1, batch, hidden,
        )
        .unwrap();
        out.extend([bits(&c), bits(&h), bits(&act)]);
        let (dh, dc) = (values(batch * hidden, 5), values(batch * hidden, 6));
        let (mut dgates, mut dc_prev) = (vec![0.0; batch * 4 * hidden], vec![0.0; batch * hidden]);
        crate::lstm_pointwise_backward(
            &act,
            &c_prev,
            &c,
            &dh,
            &dc,
            &mut dgates,
            &mut dc_prev,
            batch,
            hidden,
        )
        .unwrap();
        out.extend([bits(&dgates), bits(&dc_prev)]);
        // Softmax cross-entropy: both forwards, then the backward (one padded row).
        let logits = values(batch * vocab, 7);
        let (labels, mask) = ([5u32, 69, 0], [1.0f32, 1.0, 0.0]);
        let (mut loss, mut lse) = (vec![0.0; batch], vec![0.0; batch]);
        crate::softmax_xent_forward(&logits, &labels, &mask, &mut loss, &mut lse, batch, vocab)
            .unwrap();
        out.extend([bits(&loss), bits(&lse)]);
        let (mut loss2, mut lse2) = (vec![0.0; batch], vec![0.0; batch]);
        crate::softmax_xent_forward_online(
            &logits, &labels, &mask, &mut loss2, &mut lse2, batch, vocab,
        )
        .unwrap();
        out.extend([bits(&loss2), bits(&lse2)]);
        let mut grad = logits.clone();
        crate::softmax_xent_backward(&mut grad, &lse, &labels, &mask, 0.5, batch, vocab).unwrap();
        out.push(bits(&grad));
        // The fused forward and backward, with its bf16 copy.
        let mut fused = logits.clone();
        let mut copy = vec![bf16::ZERO; fused.len()];
        crate::softmax_xent_forward_backward(
            &mut fused,
            &labels,
            &mask,
            &mut loss2,
            &mut lse2,
            0.5,
            batch,
            vocab,
            Some(&mut copy),
        )
        .unwrap();
        out.extend([bits(&fused), bits(&loss2), bits(&lse2)]);
        out.push(copy.iter().map(|x| u32::from(x.to_bits())).collect());
        // The scaled sum of squares (its block loop has a twin), tail included.
        let squares = crate::sum_of_squares_scaled(&values(4099, 11), 0.3);
        let squares = squares.to_bits();
        out.push(vec![squares as u32, (squares >> 32) as u32]);
        // The bf16 cast, and bf16 products in the three layouts (their packing has twins).
        let wide = values(4099, 8);
        let mut cast = vec![bf16::ZERO; wide.len()];
        crate::f32_to_bf16(&wide, &mut cast).unwrap();
        out.push(cast.iter().map(|x| u32::from(x.to_bits())).collect());
        let (m, n, k) = (41, 70, 45);
        let a: Vec<bf16> = values(m * k, 9).into_iter().map(bf16::from_f32).collect();
        let b: Vec<bf16> = values(k * n, 10).into_iter().map(bf16::from_f32).collect();
        for (av, bv) in crate::gemm_bf16::each_layout(&a, &b, (m, n, k)) {
            let mut prod = vec![0.0f32; m * n];
            gemm_bf16(Bf16Path::detect(), av, bv, &mut prod, n, false).unwrap();
            out.push(bits(&prod));
        }
        out
    }

    /// The outputs with kernels that take at most `widest`.
    fn outputs_up_to(widest: Twin) -> Vec<Vec<u32>> {
        WIDEST.with(|w| w.set(widest));
        let out = outputs();
        WIDEST.with(|w| w.set(Twin::Avx512));
        out
    }

    #[test]
    fn every_twin_gives_the_same_bits() {
        let baseline = outputs_up_to(Twin::Baseline);
        assert!(
            !baseline.iter().all(|o| o.iter().all(|&x| x == 0)),
            "outputs were written"
        );
        for (twin, runs) in [
            (Twin::Avx2, super::has_avx2()),
            (Twin::Avx512, super::has_avx512()),
        ] {
            if !runs {
                std::println!("wide twins: {twin:?} SKIPPED (this CPU lacks it)");
                continue;
            }
            let wide = outputs_up_to(twin);
            for (i, (t, b)) in wide.iter().zip(&baseline).enumerate() {
                assert_eq!(t, b, "{twin:?} output {i}");
            }
            std::println!("wide twins: the {twin:?} twin ran, and gave the baseline's bits");
        }
    }
}
