//! The exponential of the softmax and sigmoid hot loops.
//!
//! `libm::expf` is accurate but an opaque call per element, which stops the row loops from
//! vectorising. This version is straight-line f32/i32 arithmetic (range reduction, a
//! polynomial, an exponent splice), so LLVM turns the loops that call it into SIMD code.
//! It is deterministic (no FMA contraction, no table, no platform call) and within a few
//! ulp of the exact value, which the crate's tests check against f64.

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
#[allow(clippy::manual_clamp)] // `clamp` keeps NaN; max/min map it into range (fixed below)
pub(crate) fn exp(x: f32) -> f32 {
    // NaN becomes MIN_ARG here so the integer exponent arithmetic stays in range.
    let clamped = x.max(MIN_ARG).min(MAX_ARG);
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

#[cfg(test)]
mod tests {
    use super::exp;

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
