//! Parallel twins of the hot kernels (feature `rayon`), with the same names, signatures
//! and errors as the serial functions.
//!
//! Work is split over batch rows (LSTM), logit rows (softmax), blocks of
//! [`crate::gemm_bf16::MC`] rows of C (bf16 matrix products) or fixed blocks of
//! [`PAR_BLOCK`] elements (element-wise kernels). Every element is computed by the same
//! code as in the serial kernel and no value is ever combined across blocks in an order
//! rayon chooses, so the results equal the serial ones bit for bit whatever the thread
//! count.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rayon::prelude::*;

use crate::error::{check_len, Result};
use crate::precision::HalfFloat;
use crate::{lstm, optim, precision, reduce, softmax};

/// Elements per parallel task in the element-wise kernels.
pub const PAR_BLOCK: usize = 1 << 14;

/// Parallel [`crate::lstm_pointwise_forward`] (over batch rows).
///
/// # Errors
/// As the serial kernel.
#[allow(clippy::too_many_arguments)]
pub fn lstm_pointwise_forward(
    gates: &[f32],
    bias: &[f32],
    c_prev: &[f32],
    c: &mut [f32],
    h: &mut [f32],
    act: &mut [f32],
    batch: usize,
    hidden: usize,
) -> Result<()> {
    lstm::check_forward(gates, bias, c_prev, c, h, act, batch, hidden)?;
    if batch == 0 || hidden == 0 {
        return Ok(());
    }
    gates
        .par_chunks_exact(4 * hidden)
        .zip(c_prev.par_chunks_exact(hidden))
        .zip(c.par_chunks_exact_mut(hidden))
        .zip(h.par_chunks_exact_mut(hidden))
        .zip(act.par_chunks_exact_mut(4 * hidden))
        .for_each(|((((g, cp), c), h), a)| lstm::forward_row(g, bias, cp, c, h, a));
    Ok(())
}

/// Parallel [`crate::lstm_pointwise_forward_step`] (over batch rows).
///
/// # Errors
/// As the serial kernel.
#[allow(clippy::too_many_arguments)]
pub fn lstm_pointwise_forward_step(
    input_proj: &[f32],
    recurrent: &[f32],
    bias: &[f32],
    c_prev: &[f32],
    c: &mut [f32],
    h: &mut [f32],
    act: &mut [f32],
    step: usize,
    steps: usize,
    batch: usize,
    hidden: usize,
) -> Result<()> {
    let proj = lstm::check_forward_step(
        input_proj, recurrent, bias, c_prev, c, h, act, step, steps, batch, hidden,
    )?;
    if batch == 0 || hidden == 0 {
        return Ok(());
    }
    proj.par_chunks_exact(4 * hidden)
        .zip(recurrent.par_chunks_exact(4 * hidden))
        .zip(c_prev.par_chunks_exact(hidden))
        .zip(c.par_chunks_exact_mut(hidden))
        .zip(h.par_chunks_exact_mut(hidden))
        .zip(act.par_chunks_exact_mut(4 * hidden))
        .for_each(|(((((x, r), cp), c), h), a)| {
            lstm::forward_step_row(x, r, bias, cp, c, h, a);
        });
    Ok(())
}

/// Parallel [`crate::lstm_pointwise_backward`] (over batch rows).
///
/// # Errors
/// As the serial kernel.
#[allow(clippy::too_many_arguments)]
pub fn lstm_pointwise_backward(
    act: &[f32],
    c_prev: &[f32],
    c: &[f32],
    dh: &[f32],
    dc: &[f32],
    dgates: &mut [f32],
    dc_prev: &mut [f32],
    batch: usize,
    hidden: usize,
) -> Result<()> {
    lstm::check_backward(act, c_prev, c, dh, dc, dgates, dc_prev, batch, hidden)?;
    if batch == 0 || hidden == 0 {
        return Ok(());
    }
    act.par_chunks_exact(4 * hidden)
        .zip(c_prev.par_chunks_exact(hidden))
        .zip(c.par_chunks_exact(hidden))
        .zip(dh.par_chunks_exact(hidden))
        .zip(dc.par_chunks_exact(hidden))
        .zip(dgates.par_chunks_exact_mut(4 * hidden))
        .zip(dc_prev.par_chunks_exact_mut(hidden))
        .for_each(|((((((a, cp), c), dh), dc), dg), dcp)| {
            lstm::backward_row(a, cp, c, dh, dc, dg, dcp);
        });
    Ok(())
}

/// Parallel [`crate::softmax_xent_forward`] (over rows).
///
/// # Errors
/// As the serial kernel.
pub fn softmax_xent_forward(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    rows: usize,
    vocab: usize,
) -> Result<()> {
    softmax_forward_rows(
        logits,
        labels,
        mask,
        loss,
        lse,
        rows,
        vocab,
        softmax::forward_row,
    )
}

/// Parallel [`crate::softmax_xent_forward_online`] (over rows).
///
/// # Errors
/// As the serial kernel.
pub fn softmax_xent_forward_online(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    rows: usize,
    vocab: usize,
) -> Result<()> {
    softmax_forward_rows(
        logits,
        labels,
        mask,
        loss,
        lse,
        rows,
        vocab,
        softmax::forward_row_online,
    )
}

/// Validates a softmax forward call, then writes `(loss, lse)` of every row with `row_fn`
/// in parallel.
#[allow(clippy::too_many_arguments)]
fn softmax_forward_rows(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    rows: usize,
    vocab: usize,
    row_fn: impl Fn(&[f32], u32, f32) -> (f32, f32) + Sync,
) -> Result<()> {
    softmax::check_forward(logits, labels, mask, loss, lse, rows, vocab)?;
    logits
        .par_chunks_exact(vocab)
        .zip(labels.par_iter())
        .zip(mask.par_iter())
        .zip(loss.par_iter_mut().zip(lse.par_iter_mut()))
        .for_each(|(((row, &label), &weight), (loss, lse))| {
            (*loss, *lse) = row_fn(row, label, weight);
        });
    Ok(())
}

/// Parallel [`crate::softmax_xent_backward`] (over rows).
///
/// # Errors
/// As the serial kernel.
pub fn softmax_xent_backward(
    logits: &mut [f32],
    lse: &[f32],
    labels: &[u32],
    mask: &[f32],
    scale: f32,
    rows: usize,
    vocab: usize,
) -> Result<()> {
    softmax::check_backward(logits, lse, labels, mask, rows, vocab)?;
    logits
        .par_chunks_exact_mut(vocab)
        .zip(lse.par_iter())
        .zip(labels.par_iter())
        .zip(mask.par_iter())
        .for_each(|(((row, &lse), &label), &weight)| {
            softmax::backward_row(row, lse, label, weight, scale);
        });
    Ok(())
}

/// Parallel [`crate::softmax_xent_forward_backward`] (over rows).
///
/// # Errors
/// As the serial kernel.
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
    softmax::check_forward_backward(
        logits,
        labels,
        mask,
        loss,
        lse,
        rows,
        vocab,
        bf16_copy.as_deref(),
    )?;
    let rows_of = logits
        .par_chunks_exact_mut(vocab)
        .zip(labels.par_iter().zip(mask.par_iter()))
        .zip(loss.par_iter_mut().zip(lse.par_iter_mut()));
    let row = |((row, (&label, &weight)), (loss, lse)): (_, (&mut f32, &mut f32))| {
        let row: &mut [f32] = row;
        (*loss, *lse) = softmax::forward_backward_row(row, label, weight, scale);
        row
    };
    match bf16_copy {
        Some(copy) => rows_of
            .zip(copy.par_chunks_exact_mut(vocab))
            .for_each(|(r, out)| precision::bf16_from_f32_block(row(r), out)),
        None => rows_of.for_each(|r| {
            row(r);
        }),
    }
    Ok(())
}

/// Parallel cast of f32 to a 16-bit float (fixed blocks; the flag is an OR over blocks).
fn f32_to_half_scaled<H: HalfFloat>(src: &[f32], scale: f32, dst: &mut [H]) -> Result<bool>
where
    [H]: HalfFloatSliceExt,
{
    check_len("dst", dst.len(), src.len())?;
    Ok(src
        .par_chunks(PAR_BLOCK)
        .zip(dst.par_chunks_mut(PAR_BLOCK))
        .map(|(s, d)| precision::f32_to_half_scaled_block(s, scale, d))
        .reduce(|| false, |a, b| a | b))
}

/// Parallel widening of a 16-bit float to f32 (fixed blocks).
fn half_to_f32_unscaled<H: HalfFloat>(src: &[H], inv_scale: f32, dst: &mut [f32]) -> Result<()>
where
    [H]: HalfFloatSliceExt,
{
    check_len("dst", dst.len(), src.len())?;
    src.par_chunks(PAR_BLOCK)
        .zip(dst.par_chunks_mut(PAR_BLOCK))
        .for_each(|(s, d)| precision::half_to_f32_unscaled_block(s, inv_scale, d));
    Ok(())
}

/// Parallel [`crate::f32_to_f16_scaled`] (fixed blocks; the flag is an OR over blocks).
///
/// # Errors
/// As the serial kernel.
pub fn f32_to_f16_scaled(src: &[f32], scale: f32, dst: &mut [f16]) -> Result<bool> {
    f32_to_half_scaled(src, scale, dst)
}

/// Parallel [`crate::f32_to_bf16_scaled`] (fixed blocks; the flag is an OR over blocks).
///
/// # Errors
/// As the serial kernel.
pub fn f32_to_bf16_scaled(src: &[f32], scale: f32, dst: &mut [bf16]) -> Result<bool> {
    f32_to_half_scaled(src, scale, dst)
}

/// Parallel [`crate::f32_to_bf16`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) -> Result<()> {
    check_len("dst", dst.len(), src.len())?;
    src.par_chunks(PAR_BLOCK)
        .zip(dst.par_chunks_mut(PAR_BLOCK))
        .for_each(|(s, d)| crate::precision::bf16_from_f32_block(s, d));
    Ok(())
}

/// Parallel [`crate::f16_to_f32_unscaled`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
pub fn f16_to_f32_unscaled(src: &[f16], inv_scale: f32, dst: &mut [f32]) -> Result<()> {
    half_to_f32_unscaled(src, inv_scale, dst)
}

/// Parallel [`crate::bf16_to_f32_unscaled`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
pub fn bf16_to_f32_unscaled(src: &[bf16], inv_scale: f32, dst: &mut [f32]) -> Result<()> {
    half_to_f32_unscaled(src, inv_scale, dst)
}

/// Parallel [`crate::sum_into_f32`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
pub fn sum_into_f32(acc: &mut [f32], src: &[f32]) -> Result<()> {
    check_len("src", src.len(), acc.len())?;
    acc.par_chunks_mut(PAR_BLOCK)
        .zip(src.par_chunks(PAR_BLOCK))
        .for_each(|(a, s)| reduce::sum_into_f32_block(a, s));
    Ok(())
}

/// Parallel [`crate::scale_f32`] (fixed blocks).
pub fn scale_f32(buf: &mut [f32], factor: f32) {
    buf.par_chunks_mut(PAR_BLOCK)
        .for_each(|b| reduce::scale_f32(b, factor));
}

/// Parallel [`crate::sgd_step`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
pub fn sgd_step(params: &mut [f32], grads: &[f32], lr: f32, weight_decay: f32) -> Result<()> {
    sgd_step_scaled(params, grads, lr, weight_decay, optim::GradScale::ONE)
}

/// Parallel [`crate::sgd_step_scaled`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
pub fn sgd_step_scaled(
    params: &mut [f32],
    grads: &[f32],
    lr: f32,
    weight_decay: f32,
    scale: optim::GradScale,
) -> Result<()> {
    optim::check_sgd(params, grads, lr, weight_decay, scale)?;
    params
        .par_chunks_mut(PAR_BLOCK)
        .zip(grads.par_chunks(PAR_BLOCK))
        .for_each(|(p, g)| optim::sgd_block(p, g, lr, weight_decay, scale));
    Ok(())
}

/// Parallel [`crate::sum_of_squares_scaled`] (its blocks, summed in the same order).
pub fn sum_of_squares_scaled(x: &[f32], scale: f32) -> f64 {
    let blocks: std::vec::Vec<f64> = x
        .par_chunks(optim::SQUARES_BLOCK)
        .map(|block| optim::squares_block(block, scale))
        .collect();
    blocks.into_iter().sum()
}

/// Parallel [`crate::sgd_momentum_step`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
#[allow(clippy::too_many_arguments)]
pub fn sgd_momentum_step(
    params: &mut [f32],
    grads: &[f32],
    momentum_buf: &mut [f32],
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: bool,
    first_step: bool,
) -> Result<()> {
    let hyper = [lr, momentum, dampening, weight_decay];
    let step =
        optim::MomentumStep::checked(params, grads, momentum_buf, hyper, nesterov, first_step)?;
    params
        .par_chunks_mut(PAR_BLOCK)
        .zip(grads.par_chunks(PAR_BLOCK))
        .zip(momentum_buf.par_chunks_mut(PAR_BLOCK))
        .for_each(|((p, g), b)| step.apply(p, g, b));
    Ok(())
}

/// Parallel [`crate::adam_step`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step: u32,
) -> Result<()> {
    adam_step_scaled(
        params,
        grads,
        m,
        v,
        [lr, beta1, beta2, eps, weight_decay],
        step,
        optim::GradScale::ONE,
    )
}

/// Parallel [`crate::adam_step_scaled`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
pub fn adam_step_scaled(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hyper: [f32; 5],
    step: u32,
    scale: optim::GradScale,
) -> Result<()> {
    let s = optim::check_adam(params, grads, m, v, hyper, step, false, scale)?;
    adam_par(&s, params, grads, m, v);
    Ok(())
}

/// Parallel [`crate::adamw_step`] (fixed blocks).
///
/// # Errors
/// As the serial kernel.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step: u32,
) -> Result<()> {
    let hyper = [lr, beta1, beta2, eps, weight_decay];
    let s = optim::check_adam(
        params,
        grads,
        m,
        v,
        hyper,
        step,
        true,
        optim::GradScale::ONE,
    )?;
    adam_par(&s, params, grads, m, v);
    Ok(())
}

fn adam_par(s: &optim::AdamStep, params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32]) {
    params
        .par_chunks_mut(PAR_BLOCK)
        .zip(grads.par_chunks(PAR_BLOCK))
        .zip(m.par_chunks_mut(PAR_BLOCK))
        .zip(v.par_chunks_mut(PAR_BLOCK))
        .for_each(|(((p, g), m), v)| s.apply(p, g, m, v));
}

/// Parallel [`crate::gemm_bf16::gemm_bf16`]: C split into one rectangle per thread of the
/// pool, along its rows ([`crate::gemm_bf16::AMX_MR`] at a time) when it has more row
/// blocks than column panels, else along its columns ([`crate::gemm_bf16::NR`] at a
/// time), so that a product with few rows (one time step of a recurrence) still uses
/// every thread. Split by rows, B is packed once, by every thread a share of its panels,
/// and read by all; split by columns, each task packs the columns it reads. Each element
/// of C is computed by the same micro-kernel in the same order as in the serial product,
/// so the results are the same bits.
///
/// # Errors
/// As the serial kernel.
pub fn gemm_bf16(
    path: crate::gemm_bf16::Bf16Path,
    a: crate::gemm_bf16::MatRef<'_>,
    b: crate::gemm_bf16::MatRef<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<()> {
    use crate::gemm_bf16::{check, drive_raw, kernel_for, BSource};

    let kernel = kernel_for(path)?;
    check(&a, &b, c, ldc)?;
    let c = SendPtr(c.as_mut_ptr());
    match split(a.rows(), b.cols(), a.cols()) {
        // SAFETY: `check` found `c` long enough, and the borrow is exclusive.
        Split::None => unsafe { drive_raw(kernel, a, BSource::View(b), c.0, ldc, accumulate) },
        Split::Rows(part) => {
            let packed = pack_b(path, b)?;
            // SAFETY: as in `rows`.
            unsafe { rows(kernel, a, &packed, c, ldc, accumulate, part) };
        }
        // SAFETY: as in `cols`.
        Split::Cols(part) => unsafe {
            let b_cols = |start, end| BSource::View(b.col_range(start, end));
            cols(kernel, a, b.cols(), b_cols, c, ldc, accumulate, part)
        },
    }
    Ok(())
}

/// Parallel [`crate::gemm_bf16::gemm_bf16_packed`], split as [`gemm_bf16`] (every task
/// reads the one packed B). The same bits as the serial product.
///
/// # Errors
/// As the serial kernel.
pub fn gemm_bf16_packed(
    a: crate::gemm_bf16::MatRef<'_>,
    b: &crate::gemm_bf16::PackedB,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<()> {
    use crate::gemm_bf16::{check_shapes, drive_raw, kernel_for, BSource};

    let kernel = kernel_for(b.path())?;
    check_shapes(&a, b.rows(), b.cols(), c, ldc)?;
    let c = SendPtr(c.as_mut_ptr());
    match split(a.rows(), b.cols(), a.cols()) {
        // SAFETY: the shapes were checked against `c`, and the borrow is exclusive.
        Split::None => unsafe {
            drive_raw(
                kernel,
                a,
                BSource::Packed(b, 0..b.cols()),
                c.0,
                ldc,
                accumulate,
            )
        },
        // SAFETY: as in `rows`.
        Split::Rows(part) => unsafe { rows(kernel, a, b, c, ldc, accumulate, part) },
        // SAFETY: as in `cols` (`part`, hence a task's first column, is a multiple of NR,
        // as a packed range must start).
        Split::Cols(part) => unsafe {
            let b_cols = |start, end| BSource::Packed(b, start..end);
            cols(kernel, a, b.cols(), b_cols, c, ldc, accumulate, part)
        },
    }
    Ok(())
}

/// How a product is shared among the pool's threads.
enum Split {
    /// On the calling thread.
    None,
    /// Rows of C, this many per task.
    Rows(usize),
    /// Columns of C, this many per task.
    Cols(usize),
}

/// The split of an `m × n` product over `k`.
fn split(m: usize, n: usize, k: usize) -> Split {
    use crate::gemm_bf16::{AMX_MR, NR};

    /// Below this many multiply-adds a product runs on the calling thread.
    const SERIAL_BELOW: usize = 1 << 16;
    let threads = rayon::current_num_threads();
    let by_rows = m.div_ceil(AMX_MR) >= n.div_ceil(NR);
    let (len, unit) = if by_rows { (m, AMX_MR) } else { (n, NR) };
    let part = len.div_ceil(threads).next_multiple_of(unit);
    if threads == 1 || m * n * k < SERIAL_BELOW || part >= len {
        Split::None
    } else if by_rows {
        Split::Rows(part)
    } else {
        Split::Cols(part)
    }
}

/// Parallel [`crate::gemm_bf16::PackedB::new`]: `b` packed ahead for `path`, the panels
/// of each block shared among the pool's threads. The same words as the serial packer.
///
/// # Errors
/// As the serial packer.
pub fn pack_b(
    path: crate::gemm_bf16::Bf16Path,
    b: crate::gemm_bf16::MatRef<'_>,
) -> Result<crate::gemm_bf16::PackedB> {
    use crate::gemm_bf16::{pack_b, PackedB, NR};

    PackedB::packed_with(path, &b, |b, block, out| {
        out.par_chunks_mut(block.pairs * NR)
            .enumerate()
            .for_each(|(q, panel)| {
                let jc = block.jc + q * NR;
                let nc = NR.min(block.jc + block.nc - jc);
                pack_b(b, block.pc, block.kc, jc, nc, block.pairs, panel);
            });
    })
}

/// Columns of C split into tasks of `part` columns, the task of columns `start..end`
/// reading `b(start, end)`.
///
/// # Safety
/// `c` holds the whole `a.rows() × n` product with row stride `ldc`, which nothing else
/// reads or writes until this returns; `b(start, end)` is those columns of B, packed for
/// `kernel`'s path if packed.
#[allow(clippy::too_many_arguments)]
unsafe fn cols<'b>(
    kernel: crate::gemm_bf16::Kernel,
    a: crate::gemm_bf16::MatRef<'_>,
    n: usize,
    b: impl Fn(usize, usize) -> crate::gemm_bf16::BSource<'b> + Sync,
    c: SendPtr,
    ldc: usize,
    accumulate: bool,
    part: usize,
) {
    use crate::gemm_bf16::drive_raw;

    (0..n).into_par_iter().step_by(part).for_each(|start| {
        let end = (start + part).min(n);
        // SAFETY: the tasks' column ranges are disjoint and inside C (the caller's
        // contract).
        unsafe { drive_raw(kernel, a, b(start, end), c.at(start), ldc, accumulate) }
    });
}

/// Rows of C split into tasks of `part` rows, every task reading the one packed B.
///
/// # Safety
/// `c` holds the whole `a.rows() × b.cols()` product with row stride `ldc`, which nothing
/// else reads or writes until this returns; `b` was packed for `kernel`'s path.
unsafe fn rows(
    kernel: crate::gemm_bf16::Kernel,
    a: crate::gemm_bf16::MatRef<'_>,
    b: &crate::gemm_bf16::PackedB,
    c: SendPtr,
    ldc: usize,
    accumulate: bool,
    part: usize,
) {
    use crate::gemm_bf16::{drive_raw, BSource};

    (0..a.rows())
        .into_par_iter()
        .step_by(part)
        .for_each(|start| {
            let end = (start + part).min(a.rows());
            // SAFETY: the tasks' row ranges are disjoint and inside C (the caller's
            // contract).
            unsafe {
                drive_raw(
                    kernel,
                    a.row_range(start, end),
                    BSource::Packed(b, 0..b.cols()),
                    c.at(start * ldc),
                    ldc,
                    accumulate,
                )
            }
        });
}

/// C's pointer, shared by the tasks that write disjoint parts of it.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);

// SAFETY: the tasks given a `SendPtr` write disjoint elements through it (see its use).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer `offset` floats further.
    ///
    /// # Safety
    /// The result is inside the allocation.
    unsafe fn at(self, offset: usize) -> *mut f32 {
        // SAFETY: the caller's contract.
        unsafe { self.0.add(offset) }
    }
}
