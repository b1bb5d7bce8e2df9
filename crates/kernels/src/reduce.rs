//! Element-wise reductions the collectives apply to received buffers: sum-into, min/max
//! and scaling, for f32, f64, f16 and bf16, plus the [`ReduceElement`] trait that lets a
//! collective be generic over the element type.
//!
//! f16 and bf16 are widened to f32, combined in f32 and rounded back to nearest even:
//! `acc = f16(f32(acc) + f32(src))`, which is what the GPU reduction kernels do too.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::error::{check_len, Result};

/// Elements widened per stack buffer in the f16/bf16 kernels.
const WIDEN_BLOCK: usize = 256;

/// `acc[i] += src[i]`.
///
/// # Errors
/// `ShapeMismatch` naming `src` when `src.len() != acc.len()`.
pub fn sum_into_f32(acc: &mut [f32], src: &[f32]) -> Result<()> {
    check_len("src", src.len(), acc.len())?;
    sum_into_f32_block(acc, src);
    Ok(())
}

#[inline]
pub(crate) fn sum_into_f32_block(acc: &mut [f32], src: &[f32]) {
    for (a, &s) in acc.iter_mut().zip(src) {
        *a += s;
    }
}

/// `acc[i] += src[i]`.
///
/// # Errors
/// `ShapeMismatch` naming `src` when `src.len() != acc.len()`.
pub fn sum_into_f64(acc: &mut [f64], src: &[f64]) -> Result<()> {
    check_len("src", src.len(), acc.len())?;
    for (a, &s) in acc.iter_mut().zip(src) {
        *a += s;
    }
    Ok(())
}

/// Widens both blocks to f32, applies `op`, rounds the result back into `acc`.
#[inline]
fn widened_combine<H: HalfFloatSliceExt + ?Sized>(
    acc: &mut H,
    src: &H,
    len: usize,
    op: impl Fn(f32, f32) -> f32,
) {
    let mut a = [0.0f32; WIDEN_BLOCK];
    let mut b = [0.0f32; WIDEN_BLOCK];
    let (a, b) = (&mut a[..len], &mut b[..len]);
    acc.convert_to_f32_slice(a);
    src.convert_to_f32_slice(b);
    for (x, &y) in a.iter_mut().zip(b.iter()) {
        *x = op(*x, y);
    }
    acc.convert_from_f32_slice(a);
}

/// `acc[i] = H(f32(acc[i]) + f32(src[i]))` for a 16-bit float `H`.
fn sum_into_half<H>(acc: &mut [H], src: &[H]) -> Result<()>
where
    [H]: HalfFloatSliceExt,
{
    check_len("src", src.len(), acc.len())?;
    for (a, s) in acc.chunks_mut(WIDEN_BLOCK).zip(src.chunks(WIDEN_BLOCK)) {
        let len = a.len();
        widened_combine(a, s, len, |x, y| x + y);
    }
    Ok(())
}

/// `acc[i] = f16(f32(acc[i]) + f32(src[i]))`, rounded to nearest even.
///
/// # Errors
/// `ShapeMismatch` naming `src` when `src.len() != acc.len()`.
pub fn sum_into_f16(acc: &mut [f16], src: &[f16]) -> Result<()> {
    sum_into_half(acc, src)
}

/// `acc[i] = bf16(f32(acc[i]) + f32(src[i]))`, rounded to nearest even.
///
/// # Errors
/// `ShapeMismatch` naming `src` when `src.len() != acc.len()`.
pub fn sum_into_bf16(acc: &mut [bf16], src: &[bf16]) -> Result<()> {
    sum_into_half(acc, src)
}

/// `buf[i] *= factor`.
pub fn scale_f32(buf: &mut [f32], factor: f32) {
    for x in buf.iter_mut() {
        *x *= factor;
    }
}

/// `buf[i] *= factor`.
pub fn scale_f64(buf: &mut [f64], factor: f64) {
    for x in buf.iter_mut() {
        *x *= factor;
    }
}

/// `buf[i] = H(f32(buf[i]) * factor)` for a 16-bit float `H`.
fn scale_half<H>(buf: &mut [H], factor: f32)
where
    [H]: HalfFloatSliceExt,
{
    let mut wide = [0.0f32; WIDEN_BLOCK];
    for block in buf.chunks_mut(WIDEN_BLOCK) {
        let w = &mut wide[..block.len()];
        block.convert_to_f32_slice(w);
        scale_f32(w, factor);
        block.convert_from_f32_slice(w);
    }
}

/// `buf[i] = f16(f32(buf[i]) * factor)`, rounded to nearest even.
pub fn scale_f16(buf: &mut [f16], factor: f32) {
    scale_half(buf, factor);
}

/// `buf[i] = bf16(f32(buf[i]) * factor)`, rounded to nearest even.
pub fn scale_bf16(buf: &mut [bf16], factor: f32) {
    scale_half(buf, factor);
}

/// NaN-propagating minimum: NaN if either operand is NaN (the first NaN wins).
#[inline(always)]
fn nan_min_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() {
        a
    } else if b.is_nan() || b < a {
        b
    } else {
        a
    }
}

/// NaN-propagating maximum: NaN if either operand is NaN (the first NaN wins).
#[inline(always)]
fn nan_max_f64(a: f64, b: f64) -> f64 {
    if a.is_nan() {
        a
    } else if b.is_nan() || b > a {
        b
    } else {
        a
    }
}

/// Applies a NaN-propagating selection element-wise; the result is always one of the two
/// inputs, so no rounding happens.
fn select_into<T: ReduceElement>(
    acc: &mut [T],
    src: &[T],
    pick: impl Fn(f64, f64) -> f64,
) -> Result<()> {
    check_len("src", src.len(), acc.len())?;
    for (a, &s) in acc.iter_mut().zip(src) {
        let (x, y) = (a.to_f64(), s.to_f64());
        let chosen = pick(x, y);
        // Compare bit patterns through f64 so a NaN choice is recognised too.
        if chosen.to_bits() != x.to_bits() {
            *a = s;
        }
    }
    Ok(())
}

/// Element types the collectives reduce. Implemented for `f32`, `f64`, `f16` and `bf16`.
pub trait ReduceElement: Copy + Send + Sync + PartialEq + core::fmt::Debug + 'static {
    /// Short type name: `"f32"`, `"f64"`, `"f16"` or `"bf16"`.
    const NAME: &'static str;
    /// Size of one element in bytes.
    const BYTES: usize;
    /// `acc[i] += src[i]` (f16/bf16 through f32, rounded to nearest even).
    ///
    /// # Errors
    /// `ShapeMismatch` naming `src` when the lengths differ.
    fn sum_into(acc: &mut [Self], src: &[Self]) -> Result<()>;
    /// `acc[i] = min(acc[i], src[i])`; NaN if either is NaN.
    ///
    /// # Errors
    /// `ShapeMismatch` naming `src` when the lengths differ.
    fn min_into(acc: &mut [Self], src: &[Self]) -> Result<()> {
        select_into(acc, src, nan_min_f64)
    }
    /// `acc[i] = max(acc[i], src[i])`; NaN if either is NaN.
    ///
    /// # Errors
    /// `ShapeMismatch` naming `src` when the lengths differ.
    fn max_into(acc: &mut [Self], src: &[Self]) -> Result<()> {
        select_into(acc, src, nan_max_f64)
    }
    /// `buf[i] *= factor` (f16/bf16/f32 with `factor` rounded to f32, computed in f32).
    fn scale(buf: &mut [Self], factor: f64);
    /// Nearest value of this type (round to nearest even).
    fn from_f64(x: f64) -> Self;
    /// Exact widening to f64.
    fn to_f64(self) -> f64;
}

impl ReduceElement for f32 {
    const NAME: &'static str = "f32";
    const BYTES: usize = 4;
    fn sum_into(acc: &mut [Self], src: &[Self]) -> Result<()> {
        sum_into_f32(acc, src)
    }
    fn scale(buf: &mut [Self], factor: f64) {
        scale_f32(buf, factor as f32);
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl ReduceElement for f64 {
    const NAME: &'static str = "f64";
    const BYTES: usize = 8;
    fn sum_into(acc: &mut [Self], src: &[Self]) -> Result<()> {
        sum_into_f64(acc, src)
    }
    fn scale(buf: &mut [Self], factor: f64) {
        scale_f64(buf, factor);
    }
    fn from_f64(x: f64) -> Self {
        x
    }
    fn to_f64(self) -> f64 {
        self
    }
}

impl ReduceElement for f16 {
    const NAME: &'static str = "f16";
    const BYTES: usize = 2;
    fn sum_into(acc: &mut [Self], src: &[Self]) -> Result<()> {
        sum_into_f16(acc, src)
    }
    fn scale(buf: &mut [Self], factor: f64) {
        scale_f16(buf, factor as f32);
    }
    fn from_f64(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
}

impl ReduceElement for bf16 {
    const NAME: &'static str = "bf16";
    const BYTES: usize = 2;
    fn sum_into(acc: &mut [Self], src: &[Self]) -> Result<()> {
        sum_into_bf16(acc, src)
    }
    fn scale(buf: &mut [Self], factor: f64) {
        scale_bf16(buf, factor as f32);
    }
    fn from_f64(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}
