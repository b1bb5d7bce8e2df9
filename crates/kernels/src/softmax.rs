//! Softmax cross-entropy over `[rows, vocab]` logits with `u32` labels and a padding mask.
//!
//! `labels` is `[rows]`; `mask` is `[rows]` (1.0 = real token, 0.0 = padding, any other
//! weight allowed). A row with mask 0.0 gets loss 0 and a zero gradient and its label is
//! not checked; a row with a non-zero mask and `label >= vocab` is
//! [`Error::LabelOutOfRange`].
//!
//! Every row is reduced in the same fixed order (eight interleaved lanes, then the lanes
//! in order, then the tail), so the serial and the parallel kernels agree bit for bit.

use half::bf16;

use crate::error::{check_len, checked_product, Error, Result, Value};
use crate::vector_math::exp;
use crate::wide::wide_twin;

/// Number of interleaved accumulators a row reduction uses (one SIMD register of f32).
const LANES: usize = 8;

/// Length, vocab and label checks shared by the forward kernels.
#[inline]
pub(crate) fn check_forward(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &[f32],
    lse: &[f32],
    rows: usize,
    vocab: usize,
) -> Result<()> {
    check_common(logits, labels, mask, rows, vocab)?;
    check_len("loss", loss.len(), rows)?;
    check_len("lse", lse.len(), rows)?;
    check_labels(labels, mask, vocab)
}

/// Length, vocab and label checks of the backward kernel.
#[inline]
pub(crate) fn check_backward(
    logits: &[f32],
    lse: &[f32],
    labels: &[u32],
    mask: &[f32],
    rows: usize,
    vocab: usize,
) -> Result<()> {
    check_common(logits, labels, mask, rows, vocab)?;
    check_len("lse", lse.len(), rows)?;
    check_labels(labels, mask, vocab)
}

fn check_common(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    rows: usize,
    vocab: usize,
) -> Result<()> {
    if vocab == 0 {
        return Err(Error::InvalidValue {
            name: "vocab",
            value: Value::Count(0),
            reason: "must be at least 1 (the number of classes, i.e. columns of `logits`)",
        });
    }
    check_len(
        "logits",
        logits.len(),
        checked_product("rows", rows, vocab)?,
    )?;
    check_len("labels", labels.len(), rows)?;
    check_len("mask", mask.len(), rows)
}

fn check_labels(labels: &[u32], mask: &[f32], vocab: usize) -> Result<()> {
    for (row, (&label, &weight)) in labels.iter().zip(mask).enumerate() {
        if weight != 0.0 && label as usize >= vocab {
            return Err(Error::LabelOutOfRange { row, label, vocab });
        }
    }
    Ok(())
}

/// Largest element of a non-empty row (NaN elements are skipped; they poison the sum).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    // Compare-and-select (a single maxps) rather than f32::max: NaN compares false and is
    // skipped either way.
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = if x > *lane { x } else { *lane };
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(tail) {
        *lane = if x > *lane { x } else { *lane };
    }
    lanes.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x))
}

/// `sum(exp(row - max))`.
#[inline(always)]
fn row_sum_exp(row: &[f32], max: f32) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += exp(x - max);
        }
    }
    for (lane, &x) in lanes.iter_mut().zip(tail) {
        *lane += exp(x - max);
    }
    lanes.iter().sum()
}

wide_twin! {
    /// `(loss, lse)` of one row with the two-pass algorithm. `label` must be in range
    /// unless `weight == 0.0`.
    #[inline]
    pub(crate) fn forward_row(row: &[f32], label: u32, weight: f32) -> (f32, f32) {
        let max = row_max(row);
        let lse = max + libm::logf(row_sum_exp(row, max));
        (row_loss(row, label, weight, lse), lse)
    }
}

#[inline(always)]
fn row_loss(row: &[f32], label: u32, weight: f32, lse: f32) -> f32 {
    if weight == 0.0 {
        0.0
    } else {
        weight * (lse - row[label as usize])
    }
}

/// One step of the online recurrence for one lane: running max `m`, sum `s` of
/// `exp(x - m)`. Branch-free: exactly one of the two exponentials is 1, so only
/// `exp(-|x - m|)` is evaluated.
#[inline(always)]
fn online_update(m: &mut f32, s: &mut f32, x: f32) {
    let bigger = x > *m;
    let e = exp(-(x - *m).abs());
    *s = if bigger { *s * e + 1.0 } else { *s + e };
    *m = if bigger { x } else { *m };
}

wide_twin! {
    /// `(loss, lse)` of one row in a single pass with the online recurrence.
    #[inline]
    pub(crate) fn forward_row_online(row: &[f32], label: u32, weight: f32) -> (f32, f32) {
        // f32::MIN rather than -inf keeps `x - m` finite-or-(-inf) for every x, so the
        // recurrence never forms inf - inf.
        let mut maxes = [f32::MIN; LANES];
        let mut sums = [0.0f32; LANES];
        let chunks = row.chunks_exact(LANES);
        let tail = chunks.remainder();
        for chunk in chunks {
            for ((m, s), &x) in maxes.iter_mut().zip(sums.iter_mut()).zip(chunk) {
                online_update(m, s, x);
            }
        }
        for ((m, s), &x) in maxes.iter_mut().zip(sums.iter_mut()).zip(tail) {
            online_update(m, s, x);
        }
        let max = maxes.iter().fold(f32::MIN, |a, &b| a.max(b));
        let sum: f32 = maxes
            .iter()
            .zip(&sums)
            .map(|(&m, &s)| s * exp(m - max))
            .sum();
        let lse = max + libm::logf(sum);
        (row_loss(row, label, weight, lse), lse)
    }
}

wide_twin! {
    /// Gradient of one row, in place. `label` must be in range unless `weight == 0.0`.
    #[inline]
    pub(crate) fn backward_row(row: &mut [f32], lse: f32, label: u32, weight: f32, scale: f32) {
        if weight == 0.0 {
            row.fill(0.0);
            return;
        }
        let k = scale * weight;
        let label = label as usize;
        let at_label = row[label];
        for x in row.iter_mut() {
            *x = exp(*x - lse) * k;
        }
        row[label] = (exp(at_label - lse) - 1.0) * k;
    }
}

/// Validates a forward call, then writes `(loss, lse)` of every row with `row_fn`.
#[allow(clippy::too_many_arguments)]
#[inline]
fn forward_rows(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    rows: usize,
    vocab: usize,
    row_fn: impl Fn(&[f32], u32, f32) -> (f32, f32),
) -> Result<()> {
    check_forward(logits, labels, mask, loss, lse, rows, vocab)?;
    let it = logits
        .chunks_exact(vocab)
        .zip(labels)
        .zip(mask)
        .zip(loss.iter_mut().zip(lse.iter_mut()));
    for (((row, &label), &weight), (loss, lse)) in it {
        (*loss, *lse) = row_fn(row, label, weight);
    }
    Ok(())
}

/// Softmax cross-entropy forward, two passes per row (max, then sum of exponentials).
///
/// Writes `lse[r] = log(sum_v exp(logits[r, v]))` for every row and
/// `loss[r] = mask[r] * (lse[r] - logits[r, labels[r]])` (0 where `mask[r] == 0.0`).
/// Finite for finite logits of any magnitude (tested at ±1e4).
///
/// # Errors
/// `InvalidValue` when `vocab == 0`; `ShapeMismatch` naming the slice whose length
/// disagrees with `rows`/`vocab`; `LabelOutOfRange` for the first unmasked row whose
/// label is `>= vocab`. Nothing is written on error.
pub fn softmax_xent_forward(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    rows: usize,
    vocab: usize,
) -> Result<()> {
    forward_rows(logits, labels, mask, loss, lse, rows, vocab, forward_row)
}

/// Same contract as [`softmax_xent_forward`], computed in a single pass over each row with
/// the online recurrence (running max, sum rescaled whenever the max grows).
///
/// Agrees with the two-pass kernel to a few ulp of `lse` (the tests allow a relative
/// 1e-6 of `|lse|` plus 1e-6).
///
/// # Errors
/// As [`softmax_xent_forward`].
pub fn softmax_xent_forward_online(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    rows: usize,
    vocab: usize,
) -> Result<()> {
    forward_rows(
        logits,
        labels,
        mask,
        loss,
        lse,
        rows,
        vocab,
        forward_row_online,
    )
}

/// Softmax cross-entropy backward, in place over the logits:
/// `logits[r, v] = (exp(logits[r, v] - lse[r]) - [v == labels[r]]) * (scale * mask[r])`.
///
/// `scale * mask[r]` is formed once per row; rows with `mask[r] == 0.0` become exactly 0.
/// Pass `scale = 1 / (number of real tokens)` for a mean loss, times the loss scale when
/// training in reduced precision.
///
/// # Errors
/// As [`softmax_xent_forward`]; nothing is written on error.
pub fn softmax_xent_backward(
    logits: &mut [f32],
    lse: &[f32],
    labels: &[u32],
    mask: &[f32],
    scale: f32,
    rows: usize,
    vocab: usize,
) -> Result<()> {
    check_backward(logits, lse, labels, mask, rows, vocab)?;
    let it = logits
        .chunks_exact_mut(vocab)
        .zip(lse)
        .zip(labels)
        .zip(mask);
    for (((row, &lse), &label), &weight) in it {
        backward_row(row, lse, label, weight, scale);
    }
    Ok(())
}

/// [`softmax_xent_forward`] and then [`softmax_xent_backward`] with `scale`, in one
/// kernel: each row is read from memory once, and each exponential taken once (kept in
/// the row, then scaled by `scale * mask[r] / sum`). `loss` and `lse` get the forward's
/// bits; the gradient that replaces the logits is within a few ulp of the backward's
/// (`exp(x - lse)` there against `exp(x - max) / sum` here). With `bf16_copy`, each
/// gradient row is also cast to bf16 there while it is in cache (the bits of
/// [`crate::f32_to_bf16`]): the operand of products that read the gradient in bf16.
///
/// # Errors
/// As [`softmax_xent_forward`], and `ShapeMismatch` naming `bf16_copy` when its length
/// is not the logits'; nothing is written on error.
#[allow(clippy::too_many_arguments)]
pub fn softmax_xent_forward_backward(
    logits: &mut [f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    scale: f32,
    rows: usize,
    vocab: usize,
    bf16_copy: Option<&mut [bf16]>,
) -> Result<()> {
    check_forward_backward(
        logits,
        labels,
        mask,
        loss,
        lse,
        rows,
        vocab,
        bf16_copy.as_deref(),
    )?;
    let mut copy = bf16_copy.map(|c| c.chunks_exact_mut(vocab));
    let it = logits
        .chunks_exact_mut(vocab)
        .zip(labels.iter().zip(mask))
        .zip(loss.iter_mut().zip(lse.iter_mut()));
    for ((row, (&label, &weight)), (loss, lse)) in it {
        (*loss, *lse) = forward_backward_row(row, label, weight, scale);
        if let Some(out) = copy.as_mut().and_then(|c| c.next()) {
            crate::precision::bf16_from_f32_block(row, out);
        }
    }
    Ok(())
}

/// Argument checks of [`softmax_xent_forward_backward`] and its parallel twin.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_forward_backward(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &[f32],
    lse: &[f32],
    rows: usize,
    vocab: usize,
    bf16_copy: Option<&[bf16]>,
) -> Result<()> {
    check_forward(logits, labels, mask, loss, lse, rows, vocab)?;
    match bf16_copy {
        Some(c) => check_len("bf16_copy", c.len(), logits.len()),
        None => Ok(()),
    }
}

wide_twin! {
    /// One row of [`softmax_xent_forward_backward`]: `(loss, lse)` as [`forward_row`]
    /// gives them, and the row replaced by its gradient. `label` must be in range unless
    /// `weight == 0.0`.
    #[inline]
    pub(crate) fn forward_backward_row(
        row: &mut [f32],
        label: u32,
        weight: f32,
        scale: f32,
    ) -> (f32, f32) {
        let max = row_max(row);
        let at_label = if weight == 0.0 { 0.0 } else { row[label as usize] };
        // The sum of `row_sum_exp`, lane by lane in the same order, keeping each term.
        let mut lanes = [0.0f32; LANES];
        let mut chunks = row.chunks_exact_mut(LANES);
        for chunk in chunks.by_ref() {
            for (lane, x) in lanes.iter_mut().zip(chunk) {
                *x = exp(*x - max);
                *lane += *x;
            }
        }
        for (lane, x) in lanes.iter_mut().zip(chunks.into_remainder()) {
            *x = exp(*x - max);
            *lane += *x;
        }
        let sum: f32 = lanes.iter().sum();
        let lse = max + libm::logf(sum);
        if weight == 0.0 {
            row.fill(0.0);
            return (0.0, lse);
        }
        let k = scale * weight;
        let label = label as usize;
        let e_label = row[label];
        let factor = k / sum;
        for x in row.iter_mut() {
            *x *= factor;
        }
        row[label] = (e_label / sum - 1.0) * k;
        (weight * (lse - at_label), lse)
    }
}
