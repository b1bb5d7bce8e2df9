//! `exp`, `tanh` and the sigmoid of the softmax and LSTM hot loops.
//!
//! `libm::expf` / `libm::tanhf` are accurate but an opaque call per element, which stops
//! the row loops from vectorising. These versions are straight-line f32/i32 arithmetic
//! (range reduction, polynomials, an exponent splice, selects instead of branches), so
//! LLVM turns the loops that call them into SIMD code. They are deterministic (no FMA
//! contraction, no table, no platform call: the same bits with and without `std`) and
//! within a few ulp of the exact value, which the tests below check against f64.

/// `log2(e)`.
const LOG2_E: f32 = core::f32::consts::LOG2_E;
/// High part of `ln 2`: few significant bits, so `n * LN2_HI` is exact for |n| <= 2^14.
const LN2_HI: f32 = 0.693_359_4;
/// `ln 2 - LN2_HI`.
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding then subtracting `1.5 * 2^23` rounds an f32 of magnitude < 2^22 to the nearest
/// integer (ties to even), and leaves that integer in the low mantissa bits.
const ROUND_MAGIC: f32 = 12_582_912.0;
/// Below this `e^x` rounds to 0 even as a subnormal.
const MIN_ARG: f32 = -104.0;
/// Above this `e^x` overflows to +inf.
const MAX_ARG: f32 = 89.0;

/// `e^x` in f32: +inf above ~88.72, 0 below ~-103.97, NaN for NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // Plain compare-and-select (one maxps/minps each): NaN fails the first comparison and
    // becomes MIN_ARG, so the integer exponent arithmetic stays in range; the NaN is put
    // back at the end. `f32::clamp` would keep the NaN, `f32::max` costs extra NaN fix-ups.
    let low_clamped = if x > MIN_ARG { x } else { MIN_ARG };
    let clamped = if low_clamped < MAX_ARG {
        low_clamped
    } else {
        MAX_ARG
    };
    // x = n ln2 + r with |r| <= ln2 / 2.
    let shifted = clamped * LOG2_E + ROUND_MAGIC;
    let n_f = shifted - ROUND_MAGIC;
    let n = (shifted.to_bits() as i32) - (ROUND_MAGIC.to_bits() as i32);
    let r = (clamped - n_f * LN2_HI) - n_f * LN2_LO;
    // Taylor polynomial of degree 7; truncation error < 5e-9 relative on |r| <= ln2 / 2.
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2^n as two normal powers of two, so n in [-150, 129] neither wraps nor flushes
    // before the final (single) rounding.
    let n_low = n >> 1;
    let n_high = n - n_low;
    let scale_low = f32::from_bits(((n_low + 127) as u32) << 23);
    let scale_high = f32::from_bits(((n_high + 127) as u32) << 23);
    let y = p * scale_high * scale_low;
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// Below this |x| [`tanh`] uses its odd Taylor polynomial (no cancellation); above it,
/// `(1 - e^-2|x|) / (1 + e^-2|x|)`.
const TANH_SERIES_LIMIT: f32 = 0.25;

/// `tanh(x)` in f32: odd in x, exactly ±1 for |x| > ~9, NaN for NaN.
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let a = x.abs();
    // Large |x|: e in (0, 0.61], so 1 - e and 1 + e lose nothing to cancellation.
    let e = exp(-2.0 * a);
    let large = (1.0 - e) / (1.0 + e);
    // Small |x|: x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835; the next term is below
    // 1e-8 relative at |x| = 0.25.
    let x2 = a * a;
    let p = 62.0 / 2835.0;
    let p = p * x2 - 17.0 / 315.0;
    let p = p * x2 + 2.0 / 15.0;
    let p = p * x2 - 1.0 / 3.0;
    let small = a + a * (x2 * p);
    let magnitude = if a < TANH_SERIES_LIMIT { small } else { large };
    // Restores the sign (NaN keeps its own bits through the large branch's arithmetic).
    f32::from_bits(magnitude.to_bits() | (x.to_bits() & 0x8000_0000))
}

/// Logistic sigmoid `1 / (1 + e^-x)`; exactly 0 or 1 when saturated, never NaN for
/// non-NaN x.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Correctly rounded square root (IEEE 754 requires it, so every implementation gives the
/// same bits). With `std` this is `f32::sqrt`, which LLVM vectorises (`sqrtps`); without,
/// `libm::sqrtf`.
#[inline(always)]
pub(crate) fn sqrt(x: f32) -> f32 {
    #[cfg(feature = "std")]
    {
        x.sqrt()
    }
    #[cfg(not(feature = "std"))]
    {
        libm::sqrtf(x)
    }
}

#[cfg(test)]
mod tests {
    use super::{exp, sigmoid, tanh};

    /// Relative error against f64, in units of f32 epsilon; absolute below the normal range.
    fn error_ulps(x: f32) -> f64 {
        let exact = libm::exp(f64::from(x));
        let got = f64::from(exp(x));
        let tiny = f64::from(f32::MIN_POSITIVE);
        (got - exact).abs() / exact.max(tiny) / f64::from(f32::EPSILON)
    }

    #[test]
    fn exp_is_within_two_ulp_over_the_whole_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.5 {
            worst = worst.max(error_ulps(x));
            x += 0.000_731;
        }
        assert!(worst < 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn tanh_is_within_four_ulp_over_the_whole_range() {
        let mut worst = 0.0f64;
        let mut x = -12.0f32;
        while x < 12.0 {
            let exact = libm::tanh(f64::from(x));
            let err = (f64::from(tanh(x)) - exact).abs() / exact.abs().max(1e-30);
            worst = worst.max(err / f64::from(f32::EPSILON));
            x += 0.000_173;
        }
        assert!(worst < 4.0, "worst error {worst} ulp");
        // Tiny arguments: tanh(x) = x to f32 precision.
        for x in [1e-30f32, -3e-8, 1e-4, -0.01] {
            let exact = libm::tanh(f64::from(x));
            assert!(
                (f64::from(tanh(x)) - exact).abs() <= exact.abs() * 2e-7,
                "{x}"
            );
        }
        assert_eq!(tanh(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh(20.0), 1.0);
        assert_eq!(tanh(-1e4), -1.0);
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn sqrt_equals_libm_bit_for_bit() {
        let mut x = 1e-30f32;
        while x < 1e30 {
            assert_eq!(super::sqrt(x).to_bits(), libm::sqrtf(x).to_bits(), "{x}");
            x *= 1.000_37;
        }
        assert!(super::sqrt(-1.0).is_nan());
    }

    #[test]
    fn sigmoid_saturates_cleanly() {
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(1e4), 1.0);
        assert_eq!(sigmoid(-1e4), 0.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        let exact = 1.0 / (1.0 + libm::exp(-1.5));
        assert!((f64::from(sigmoid(1.5)) - exact).abs() < 2e-7 * exact);
    }

    #[test]
    fn exp_handles_the_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e4), 0.0);
        assert!(exp(f32::NAN).is_nan());
        // Subnormal results are rounded once, not flushed.
        let sub = exp(-100.0);
        let exact = libm::exp(-100.0) as f32;
        assert!(sub > 0.0 && (sub - exact).abs() <= f32::from_bits(1) * 2.0);
        let near_max = exp(88.7);
        assert!(near_max.is_finite() && near_max > 3.0e38);
    }
}
