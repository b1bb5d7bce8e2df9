//! Reduced-precision casts for mixed-precision training: f32 to f16/bf16 with a loss
//! scale and a non-finite flag, and back to f32 with the inverse scale.
//!
//! Conversions round to nearest, ties to even, through `half`'s conversions (the same
//! rounding as the GPU's `cvt.rn`), so CPU and GPU results can be compared bit for bit.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{check_len, Result};
use crate::wide::wide_twin;

/// Elements converted per stack buffer.
const CAST_BLOCK: usize = 256;

/// Exponent bits of an f32; all set means Inf or NaN.
const F32_EXP_MASK: u32 = 0x7f80_0000;

/// A 16-bit float format the casts handle (f16 or bf16).
pub(crate) trait HalfFloat: Copy + Send + Sync
where
    [Self]: HalfFloatSliceExt,
{
    /// Exponent bits; all set means Inf or NaN.
    const EXP_MASK: u16;
    /// The raw bit pattern.
    fn bits(self) -> u16;
    /// `dst[i] = src[i]` rounded to nearest, ties to even (`half`'s conversion).
    fn convert_block(src: &[f32], dst: &mut [Self]);
}

impl HalfFloat for f16 {
    const EXP_MASK: u16 = 0x7c00;
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
    #[inline(always)]
    fn convert_block(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl HalfFloat for bf16 {
    const EXP_MASK: u16 = 0x7f80;
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
    #[inline(always)]
    fn convert_block(src: &[f32], dst: &mut [Self]) {
        bf16_from_f32_block(src, dst);
    }
}

wide_twin! {
    /// `dst[i]` = the bf16 of `src[i]`, bit for bit `bf16::from_f32`: NaN keeps its sign
    /// and high payload and is made quiet; everything else rounds to nearest, ties to
    /// even, by adding `0x7fff` plus the kept low bit (so that the loop has no branch
    /// and vectorises).
    #[inline(never)]
    pub(crate) fn bf16_from_f32_block(src: &[f32], dst: &mut [bf16]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            let x = x.to_bits();
            let nan = x & 0x7fff_ffff > F32_EXP_MASK;
            let rounded = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
            let quiet = (x >> 16) | 0x0040;
            *d = bf16::from_bits(if nan { quiet } else { rounded } as u16);
        }
    }
}

/// Converts a block and reports whether any output is non-finite.
#[inline]
pub(crate) fn f32_to_half_scaled_block<H: HalfFloat>(src: &[f32], scale: f32, dst: &mut [H]) -> bool
where
    [H]: HalfFloatSliceExt,
{
    let mut scaled = [0.0f32; CAST_BLOCK];
    let mut non_finite = false;
    for (s, d) in src.chunks(CAST_BLOCK).zip(dst.chunks_mut(CAST_BLOCK)) {
        let buf = &mut scaled[..s.len()];
        for (b, &x) in buf.iter_mut().zip(s) {
            *b = x * scale;
        }
        H::convert_block(buf, d);
        non_finite |= d.iter().fold(false, |acc, h| {
            acc | (h.bits() & H::EXP_MASK == H::EXP_MASK)
        });
    }
    non_finite
}

/// Widens a block and multiplies it by `inv_scale`.
#[inline]
pub(crate) fn half_to_f32_unscaled_block<H: HalfFloat>(src: &[H], inv_scale: f32, dst: &mut [f32])
where
    [H]: HalfFloatSliceExt,
{
    src.convert_to_f32_slice(dst);
    for x in dst.iter_mut() {
        *x *= inv_scale;
    }
}

/// `dst[i] = f16(src[i] * scale)`, rounded to nearest even. Writes every element and
/// returns `Ok(true)` when any `dst` element is Inf or NaN (a non-finite input, or an
/// overflow past 65504 after scaling): the caller should then skip the step and lower
/// the loss scale.
///
/// # Errors
/// `ShapeMismatch` naming `dst` when `dst.len() != src.len()`.
pub fn f32_to_f16_scaled(src: &[f32], scale: f32, dst: &mut [f16]) -> Result<bool> {
    check_len("dst", dst.len(), src.len())?;
    Ok(f32_to_half_scaled_block(src, scale, dst))
}

/// `dst[i] = bf16(src[i])`, rounded to nearest even (NaN stays NaN): the cast of matrix
/// product operands, without a scale or a non-finite flag (the same bits as
/// [`f32_to_bf16_scaled`] with scale 1, in one pass).
///
/// # Errors
/// `ShapeMismatch` naming `dst` when `dst.len() != src.len()`.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    check_len("dst", dst.len(), src.len())?;
    bf16_from_f32_block(src, dst);
    Ok(())
}

/// `dst[i] = bf16(src[i] * scale)`, rounded to nearest even; returns `Ok(true)` when any
/// `dst` element is Inf or NaN. Writes every element.
///
/// # Errors
/// `ShapeMismatch` naming `dst` when `dst.len() != src.len()`.
pub fn f32_to_bf16_scaled(src: &[f32], scale: f32, dst: &mut [bf16]) -> Result<bool> {
    check_len("dst", dst.len(), src.len())?;
    Ok(f32_to_half_scaled_block(src, scale, dst))
}

/// `dst[i] = f32(src[i]) * inv_scale` (the widening is exact).
///
/// # Errors
/// `ShapeMismatch` naming `dst` when `dst.len() != src.len()`.
pub fn f16_to_f32_unscaled(src: &[f16], inv_scale: f32, dst: &mut [f32]) -> Result<()> {
    check_len("dst", dst.len(), src.len())?;
    half_to_f32_unscaled_block(src, inv_scale, dst);
    Ok(())
}

/// `dst[i] = f32(src[i]) * inv_scale` (the widening is exact).
///
/// # Errors
/// `ShapeMismatch` naming `dst` when `dst.len() != src.len()`.
pub fn bf16_to_f32_unscaled(src: &[bf16], inv_scale: f32, dst: &mut [f32]) -> Result<()> {
    check_len("dst", dst.len(), src.len())?;
    half_to_f32_unscaled_block(src, inv_scale, dst);
    Ok(())
}

/// `true` when any element of `x` is Inf or NaN. Looks at every element (no early exit),
/// which lets the loop vectorise.
pub fn has_non_finite_f32(x: &[f32]) -> bool {
    x.iter().fold(false, |acc, v| {
        acc | (v.to_bits() & F32_EXP_MASK == F32_EXP_MASK)
    })
}
