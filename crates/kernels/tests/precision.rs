//! f32 <-> f16/bf16 casts: rounding, loss scale, non-finite detection.

use half::{bf16, f16};
use proptest::prelude::*;
use ringtrain_kernels::{
    bf16_to_f32_unscaled, f16_to_f32_unscaled, f32_to_bf16_scaled, f32_to_f16_scaled,
    has_non_finite_f32, Error,
};

fn to_f16(src: &[f32], scale: f32) -> (Vec<f16>, bool) {
    let mut dst = vec![f16::from_bits(0x1234); src.len()];
    let flag = f32_to_f16_scaled(src, scale, &mut dst).unwrap();
    (dst, flag)
}

fn to_bf16(src: &[f32], scale: f32) -> (Vec<bf16>, bool) {
    let mut dst = vec![bf16::from_bits(0x1234); src.len()];
    let flag = f32_to_bf16_scaled(src, scale, &mut dst).unwrap();
    (dst, flag)
}

#[test]
fn f16_rounds_to_nearest_even() {
    // 1 + 2^-11 is halfway between 1 and the next f16 (1 + 2^-10): ties go to even (1.0).
    // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 and 1 + 2^-9: ties go to 1 + 2^-9.
    let src = [
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-11) + 2f32.powi(-20),
        65504.0,
        65519.0,
        -2.5,
        2f32.powi(-24),
        2f32.powi(-26),
    ];
    let (dst, flag) = to_f16(&src, 1.0);
    assert!(!flag);
    let got: Vec<u16> = dst.iter().map(|h| h.to_bits()).collect();
    assert_eq!(
        got,
        [
            0x3c00, // 1.0
            0x3c02, // 1 + 2^-9
            0x3c01, // just above the tie rounds up
            0x7bff, // 65504, the largest finite f16
            0x7bff, // below the rounding boundary 65520
            0xc100, // -2.5
            0x0001, // smallest subnormal
            0x0000, // underflows to zero
        ]
    );
}

#[test]
fn bf16_rounds_to_nearest_even() {
    // bf16 keeps 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7.
    let src = [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 3.0e38, -0.0];
    let (dst, flag) = to_bf16(&src, 1.0);
    assert!(!flag);
    let got: Vec<u16> = dst.iter().map(|h| h.to_bits()).collect();
    assert_eq!(got, [0x3f80, 0x3f82, 0x7f62, 0x8000]);
}

#[test]
fn overflow_after_scaling_is_flagged_and_every_element_written() {
    // 70000 * 1 overflows f16 (max 65504); 1 * 70000 does as well through the scale.
    let (dst, flag) = to_f16(&[1.0, 70000.0, 2.0], 1.0);
    assert!(flag);
    assert_eq!(dst[0], f16::ONE);
    assert_eq!(dst[1], f16::INFINITY);
    assert_eq!(dst[2].to_f32(), 2.0);
    let (dst, flag) = to_f16(&[1.0, -0.5], 70000.0);
    assert!(flag);
    assert_eq!(dst[0], f16::INFINITY);
    assert_eq!(dst[1], f16::from_f32(-35000.0));
    // 65519 * 1 rounds down to 65504, 65520 rounds up to Inf.
    assert!(!to_f16(&[65519.0], 1.0).1);
    assert!(to_f16(&[65520.0], 1.0).1);
    // bf16 has the f32 range: the same values are fine, 3.4e38 * 2 is not.
    assert!(!to_bf16(&[70000.0], 1.0).1);
    assert!(to_bf16(&[3.4e38], 2.0).1);
}

#[test]
fn planted_inf_and_nan_are_flagged_anywhere() {
    for len in [1usize, 7, 255, 256, 257, 1000] {
        for at in [0, len / 2, len - 1] {
            for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
                let mut src = vec![0.5f32; len];
                src[at] = bad;
                assert!(to_f16(&src, 1.0).1, "f16 len {len} at {at} {bad}");
                assert!(to_bf16(&src, 1.0).1, "bf16 len {len} at {at} {bad}");
                assert!(has_non_finite_f32(&src), "f32 len {len} at {at} {bad}");
            }
            let clean = vec![65504.0f32; len];
            assert!(!to_f16(&clean, 1.0).1);
            assert!(!has_non_finite_f32(&clean));
        }
    }
    assert!(!has_non_finite_f32(&[]));
    assert!(!has_non_finite_f32(&[
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE
    ]));
}

#[test]
fn unscale_multiplies_the_exact_widening() {
    let src: Vec<f16> = [1.0f32, -3.5, 1024.0, 0.0]
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let mut dst = vec![0.0f32; 4];
    f16_to_f32_unscaled(&src, 0.25, &mut dst).unwrap();
    assert_eq!(dst, [0.25, -0.875, 256.0, 0.0]);
    let src: Vec<bf16> = [3.0f32, -1e30].iter().map(|&x| bf16::from_f32(x)).collect();
    let mut dst = vec![0.0f32; 2];
    bf16_to_f32_unscaled(&src, 2.0, &mut dst).unwrap();
    assert_eq!(dst, [6.0, bf16::from_f32(-1e30).to_f32() * 2.0]);
}

#[test]
fn length_mismatch_names_dst() {
    let mut small = vec![f16::ZERO; 2];
    let err = f32_to_f16_scaled(&[1.0; 3], 1.0, &mut small).unwrap_err();
    assert_eq!(
        err,
        Error::ShapeMismatch {
            arg: "dst",
            expected: 3,
            actual: 2
        }
    );
    assert!(small.iter().all(|h| *h == f16::ZERO));
    let mut small = vec![bf16::ZERO; 4];
    assert!(f32_to_bf16_scaled(&[1.0; 3], 1.0, &mut small).is_err());
    assert!(f16_to_f32_unscaled(&[f16::ONE; 2], 1.0, &mut [0.0; 3]).is_err());
    assert!(bf16_to_f32_unscaled(&[bf16::ONE; 2], 1.0, &mut [0.0; 1]).is_err());
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
    #![proptest_config(ProptestConfig::with_cases(cases(64)))]

    /// Bit-for-bit equal to half's portable software conversion of `x * scale`, and
    /// within half an f16 ulp of the f64 value.
    #[test]
    fn casts_equal_the_software_rounding(
        src in prop::collection::vec(-70000.0f32..70000.0, 1..600),
        scale in prop::sample::select(vec![1.0f32, 0.5, 8.0, 1024.0, 1.0 / 3.0]),
    ) {
        let (h, h_flag) = to_f16(&src, scale);
        let (b, b_flag) = to_bf16(&src, scale);
        let mut any_inf = false;
        for (n, &x) in src.iter().enumerate() {
            let scaled = x * scale;
            let want = f16::from_f32_const(scaled);
            prop_assert_eq!(h[n].to_bits(), want.to_bits());
            prop_assert_eq!(b[n].to_bits(), bf16::from_f32_const(scaled).to_bits());
            any_inf |= want.is_infinite();
            if want.is_finite() && scaled.abs() >= 6.2e-5 {
                let err = (f64::from(h[n].to_f32()) - f64::from(scaled)).abs();
                prop_assert!(err <= f64::from(scaled.abs()) * 2f64.powi(-11));
            }
        }
        prop_assert_eq!(h_flag, any_inf);
        prop_assert!(!b_flag);

        // Round trip back with the inverse scale.
        let mut back = vec![0.0f32; src.len()];
        f16_to_f32_unscaled(&h, 1.0 / scale, &mut back).unwrap();
        for (n, &v) in back.iter().enumerate() {
            prop_assert_eq!(v.to_bits(), (h[n].to_f32() * (1.0 / scale)).to_bits());
        }
    }
}

#[test]
fn bf16_cast_gives_halfs_bits_for_every_kind_of_f32() {
    // Every sign and exponent with low bits at and around the rounding tie, plus a
    // pseudo-random sweep of all 2^32 patterns (NaNs with payloads, infinities,
    // subnormals, the largest finite values that round to infinity).
    let mut patterns = Vec::new();
    for high in 0u32..=0x1ff {
        for low in [
            0u32, 1, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1_7fff, 0x1_8000, 0x7f_ffff,
        ] {
            patterns.push((high << 23) | low);
        }
    }
    let mut s = 0x2545_f491_4f6c_dd1d_u64;
    for _ in 0..1 << 20 {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        patterns.push((s >> 32) as u32);
    }
    let src: Vec<f32> = patterns.iter().map(|&b| f32::from_bits(b)).collect();
    let (got, _) = to_bf16(&src, 1.0);
    for (&x, g) in src.iter().zip(&got) {
        // The cast multiplies by the scale first (which quiets a signalling NaN).
        let want = bf16::from_f32(x * 1.0);
        assert_eq!(
            g.to_bits(),
            want.to_bits(),
            "f32 bits {:#010x}",
            x.to_bits()
        );
    }
    // The plain cast (no scale) converts each value itself.
    let mut plain = vec![bf16::ZERO; src.len()];
    ringtrain_kernels::f32_to_bf16(&src, &mut plain).unwrap();
    for (&x, g) in src.iter().zip(&plain) {
        let want = bf16::from_f32(x);
        assert_eq!(
            g.to_bits(),
            want.to_bits(),
            "f32 bits {:#010x}",
            x.to_bits()
        );
    }
    assert!(ringtrain_kernels::f32_to_bf16(&src, &mut plain[1..]).is_err());
}
