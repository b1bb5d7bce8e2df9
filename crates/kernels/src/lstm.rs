//! LSTM cell: bias initialisation, the pointwise (non-GEMM) part of the forward and
//! backward pass, and a whole-cell reference.
//!
//! The matrix products `x·W_ih` and `h_prev·W_hh` are done by the caller (a GEMM); these
//! kernels take the resulting pre-activations and do everything else. Layouts (row-major,
//! gate order `i, f, g, o`) are described once, in the crate-level docs.

use crate::error::{check_len, checked_product, Error, Result, Value};
use crate::vector_math::{sigmoid, tanh};
use crate::wide::wide_twin;

/// Forget-gate bias used by [`init_lstm_bias`] callers unless told otherwise (the
/// TensorFlow `forget_bias=1.0` default, which keeps the cell open early in training).
pub const DEFAULT_FORGET_BIAS: f32 = 1.0;

/// Writes zeros into `bias` (`[4H]`) except the forget block (`bias[H..2H]`), which gets
/// `forget_bias`.
///
/// # Errors
/// `ShapeMismatch` when `bias.len() != 4 * hidden`.
pub fn init_lstm_bias(bias: &mut [f32], hidden: usize, forget_bias: f32) -> Result<()> {
    let gates = checked_product("hidden", 4, hidden)?;
    check_len("bias", bias.len(), gates)?;
    bias.fill(0.0);
    bias[hidden..2 * hidden].fill(forget_bias);
    Ok(())
}

/// Element counts `(batch * H, batch * 4H)` after checking they fit in `usize`.
#[inline]
pub(crate) fn lstm_sizes(batch: usize, hidden: usize) -> Result<(usize, usize)> {
    let state = checked_product("batch", batch, hidden)?;
    let gates = checked_product("hidden", state, 4)?;
    Ok((state, gates))
}

/// Length checks of the cell inputs and outputs both forward kernels share.
#[inline]
#[allow(clippy::too_many_arguments)]
fn check_cell_io(
    bias: &[f32],
    c_prev: &[f32],
    c: &[f32],
    h: &[f32],
    act: &[f32],
    hidden: usize,
    state: usize,
    gate_len: usize,
) -> Result<()> {
    check_len("bias", bias.len(), 4 * hidden)?;
    check_len("c_prev", c_prev.len(), state)?;
    check_len("c", c.len(), state)?;
    check_len("h", h.len(), state)?;
    check_len("act", act.len(), gate_len)?;
    Ok(())
}

/// Length checks of [`lstm_pointwise_forward`]; returns `(batch * H, batch * 4H)`.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_forward(
    gates: &[f32],
    bias: &[f32],
    c_prev: &[f32],
    c: &[f32],
    h: &[f32],
    act: &[f32],
    batch: usize,
    hidden: usize,
) -> Result<(usize, usize)> {
    let (state, gate_len) = lstm_sizes(batch, hidden)?;
    check_len("gates", gates.len(), gate_len)?;
    check_cell_io(bias, c_prev, c, h, act, hidden, state, gate_len)?;
    Ok((state, gate_len))
}

/// Length checks of [`lstm_pointwise_forward_step`]; returns the slice of `input_proj`
/// that belongs to `step`.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_forward_step<'a>(
    input_proj: &'a [f32],
    recurrent: &[f32],
    bias: &[f32],
    c_prev: &[f32],
    c: &[f32],
    h: &[f32],
    act: &[f32],
    step: usize,
    steps: usize,
    batch: usize,
    hidden: usize,
) -> Result<&'a [f32]> {
    let (state, gate_len) = lstm_sizes(batch, hidden)?;
    let proj_len = checked_product("steps", steps, gate_len)?;
    if step >= steps {
        return Err(Error::InvalidValue {
            name: "step",
            value: Value::Count(step),
            reason: "must be below `steps`; time steps count from 0",
        });
    }
    check_len("input_proj", input_proj.len(), proj_len)?;
    check_len("recurrent", recurrent.len(), gate_len)?;
    check_cell_io(bias, c_prev, c, h, act, hidden, state, gate_len)?;
    Ok(&input_proj[step * gate_len..(step + 1) * gate_len])
}

/// Length checks of [`lstm_pointwise_backward`].
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_backward(
    act: &[f32],
    c_prev: &[f32],
    c: &[f32],
    dh: &[f32],
    dc: &[f32],
    dgates: &[f32],
    dc_prev: &[f32],
    batch: usize,
    hidden: usize,
) -> Result<()> {
    let (state, gate_len) = lstm_sizes(batch, hidden)?;
    check_len("act", act.len(), gate_len)?;
    check_len("c_prev", c_prev.len(), state)?;
    check_len("c", c.len(), state)?;
    check_len("dh", dh.len(), state)?;
    check_len("dc", dc.len(), state)?;
    check_len("dgates", dgates.len(), gate_len)?;
    check_len("dc_prev", dc_prev.len(), state)?;
    Ok(())
}

/// One batch row: `act` holds the pre-activations (bias included) on entry and the
/// activations on exit; writes `c` and `h`. All of `c_prev`, `c`, `h` are `H` long and
/// `act` is `4H` long.
#[inline(always)]
fn activate_row(act: &mut [f32], c_prev: &[f32], c: &mut [f32], h: &mut [f32]) {
    let hidden = c.len();
    let (act_i, rest) = act.split_at_mut(hidden);
    let (act_f, rest) = rest.split_at_mut(hidden);
    let (act_g, act_o) = rest.split_at_mut(hidden);
    // Re-slicing to `hidden` lets the compiler drop the bounds checks below.
    let act_o = &mut act_o[..hidden];
    let c_prev = &c_prev[..hidden];
    let h = &mut h[..hidden];
    for j in 0..hidden {
        let i = sigmoid(act_i[j]);
        let f = sigmoid(act_f[j]);
        let g = tanh(act_g[j]);
        let o = sigmoid(act_o[j]);
        let c_new = f * c_prev[j] + i * g;
        act_i[j] = i;
        act_f[j] = f;
        act_g[j] = g;
        act_o[j] = o;
        c[j] = c_new;
        h[j] = o * tanh(c_new);
    }
}

wide_twin! {
    /// Forward of one batch row of [`lstm_pointwise_forward`].
    #[inline(never)]
    pub(crate) fn forward_row(
        gates: &[f32],
        bias: &[f32],
        c_prev: &[f32],
        c: &mut [f32],
        h: &mut [f32],
        act: &mut [f32],
    ) {
        for ((a, &g), &b) in act.iter_mut().zip(gates).zip(bias) {
            *a = g + b;
        }
        activate_row(act, c_prev, c, h);
    }
}

wide_twin! {
    /// Forward of one batch row of [`lstm_pointwise_forward_step`].
    #[inline(never)]
    pub(crate) fn forward_step_row(
        input_proj: &[f32],
        recurrent: &[f32],
        bias: &[f32],
        c_prev: &[f32],
        c: &mut [f32],
        h: &mut [f32],
        act: &mut [f32],
    ) {
        for (((a, &x), &r), &b) in act.iter_mut().zip(input_proj).zip(recurrent).zip(bias) {
            *a = (x + r) + b;
        }
        activate_row(act, c_prev, c, h);
    }
}

wide_twin! {
    /// Backward of one batch row of [`lstm_pointwise_backward`].
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_row(
        act: &[f32],
        c_prev: &[f32],
        c: &[f32],
        dh: &[f32],
        dc: &[f32],
        dgates: &mut [f32],
        dc_prev: &mut [f32],
    ) {
        let hidden = c.len();
        let (act_i, rest) = act.split_at(hidden);
        let (act_f, rest) = rest.split_at(hidden);
        let (act_g, act_o) = rest.split_at(hidden);
        let act_o = &act_o[..hidden];
        let (d_i, rest) = dgates.split_at_mut(hidden);
        let (d_f, rest) = rest.split_at_mut(hidden);
        let (d_g, d_o) = rest.split_at_mut(hidden);
        let d_o = &mut d_o[..hidden];
        let c_prev = &c_prev[..hidden];
        let dh = &dh[..hidden];
        let dc = &dc[..hidden];
        let dc_prev = &mut dc_prev[..hidden];
        for j in 0..hidden {
            let (i, f, g, o) = (act_i[j], act_f[j], act_g[j], act_o[j]);
            let tanh_c = tanh(c[j]);
            let dc_total = dc[j] + dh[j] * o * (1.0 - tanh_c * tanh_c);
            d_i[j] = dc_total * g * (i * (1.0 - i));
            d_f[j] = dc_total * c_prev[j] * (f * (1.0 - f));
            d_g[j] = dc_total * i * (1.0 - g * g);
            d_o[j] = dh[j] * tanh_c * (o * (1.0 - o));
            dc_prev[j] = dc_total * f;
        }
    }
}

/// Pointwise LSTM forward: adds `bias` to the pre-activations, applies the gate
/// non-linearities and computes the new cell and hidden state.
///
/// - `gates`: `[batch, 4H]` pre-activations `x·W_ih + h_prev·W_hh`, without bias.
/// - `bias`: `[4H]`. `c_prev`: `[batch, H]`.
/// - Writes `c`, `h` (`[batch, H]`) and `act` (`[batch, 4H]`, the activations
///   `i, f, g, o` that [`lstm_pointwise_backward`] needs).
///
/// # Errors
/// `ShapeMismatch` naming the first slice whose length disagrees with `batch`/`hidden`.
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
    check_forward(gates, bias, c_prev, c, h, act, batch, hidden)?;
    if batch == 0 || hidden == 0 {
        return Ok(());
    }
    let rows = gates
        .chunks_exact(4 * hidden)
        .zip(c_prev.chunks_exact(hidden))
        .zip(c.chunks_exact_mut(hidden))
        .zip(h.chunks_exact_mut(hidden))
        .zip(act.chunks_exact_mut(4 * hidden));
    for ((((g, cp), c), h), a) in rows {
        forward_row(g, bias, cp, c, h, a);
    }
    Ok(())
}

/// Pointwise LSTM forward of time step `step` of a fused layer whose input projection
/// was computed once for all steps.
///
/// Pre-activations are `(input_proj[step] + recurrent) + bias`, where `input_proj` is
/// `[steps, batch, 4H]` (`x_t·W_ih` for every step) and `recurrent` is `[batch, 4H]`
/// (`h_prev·W_hh` for this step). Writes `c`, `h` (`[batch, H]`) and `act`
/// (`[batch, 4H]`) as [`lstm_pointwise_forward`] does.
///
/// # Errors
/// `InvalidValue` when `step >= steps`; `ShapeMismatch` naming the first slice whose
/// length disagrees with the shape arguments.
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
    let proj = check_forward_step(
        input_proj, recurrent, bias, c_prev, c, h, act, step, steps, batch, hidden,
    )?;
    if batch == 0 || hidden == 0 {
        return Ok(());
    }
    let rows = proj
        .chunks_exact(4 * hidden)
        .zip(recurrent.chunks_exact(4 * hidden))
        .zip(c_prev.chunks_exact(hidden))
        .zip(c.chunks_exact_mut(hidden))
        .zip(h.chunks_exact_mut(hidden))
        .zip(act.chunks_exact_mut(4 * hidden));
    for (((((x, r), cp), c), h), a) in rows {
        forward_step_row(x, r, bias, cp, c, h, a);
    }
    Ok(())
}

/// Pointwise LSTM backward.
///
/// Inputs: `act` (`[batch, 4H]`, from the forward), `c_prev` and `c` (`[batch, H]`),
/// `dh` (gradient of the loss w.r.t. `h`) and `dc` (gradient reaching `c` from step
/// t+1; zeros at the last step), both `[batch, H]`.
///
/// Writes `dgates` (`[batch, 4H]`, gradient w.r.t. the pre-activations, which is also
/// the per-row bias gradient) and `dc_prev` (`[batch, H]`).
///
/// # Errors
/// `ShapeMismatch` naming the first slice whose length disagrees with `batch`/`hidden`.
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
    check_backward(act, c_prev, c, dh, dc, dgates, dc_prev, batch, hidden)?;
    if batch == 0 || hidden == 0 {
        return Ok(());
    }
    let rows = act
        .chunks_exact(4 * hidden)
        .zip(c_prev.chunks_exact(hidden))
        .zip(c.chunks_exact(hidden))
        .zip(dh.chunks_exact(hidden))
        .zip(dc.chunks_exact(hidden))
        .zip(dgates.chunks_exact_mut(4 * hidden))
        .zip(dc_prev.chunks_exact_mut(hidden));
    for ((((((a, cp), c), dh), dc), dg), dcp) in rows {
        backward_row(a, cp, c, dh, dc, dg, dcp);
    }
    Ok(())
}

/// Whole LSTM cell with plain loops, as a reference for tests (feature `alloc`).
///
/// `gates = x·w_ih + h_prev·w_hh + bias` with `x: [batch, input]`,
/// `h_prev, c_prev: [batch, H]`, `w_ih: [input, 4H]`, `w_hh: [H, 4H]`, `bias: [4H]`;
/// then `c = f*c_prev + i*g`, `h = o*tanh(c)` written to `h` and `c` (`[batch, H]`).
///
/// # Errors
/// `ShapeMismatch` naming the first slice whose length disagrees with the shape arguments.
#[cfg(feature = "alloc")]
#[allow(clippy::too_many_arguments)]
pub fn lstm_cell_reference(
    x: &[f32],
    h_prev: &[f32],
    c_prev: &[f32],
    w_ih: &[f32],
    w_hh: &[f32],
    bias: &[f32],
    h: &mut [f32],
    c: &mut [f32],
    batch: usize,
    input: usize,
    hidden: usize,
) -> Result<()> {
    let (state, _) = lstm_sizes(batch, hidden)?;
    let width = checked_product("hidden", 4, hidden)?;
    check_len("x", x.len(), checked_product("input", batch, input)?)?;
    check_len("h_prev", h_prev.len(), state)?;
    check_len("c_prev", c_prev.len(), state)?;
    check_len("w_ih", w_ih.len(), checked_product("input", input, width)?)?;
    check_len(
        "w_hh",
        w_hh.len(),
        checked_product("hidden", hidden, width)?,
    )?;
    check_len("bias", bias.len(), width)?;
    check_len("h", h.len(), state)?;
    check_len("c", c.len(), state)?;

    let mut gates = alloc::vec![0.0f32; width];
    for b in 0..batch {
        for n in 0..width {
            let mut sum = bias[n];
            for k in 0..input {
                sum += x[b * input + k] * w_ih[k * width + n];
            }
            for k in 0..hidden {
                sum += h_prev[b * hidden + k] * w_hh[k * width + n];
            }
            gates[n] = sum;
        }
        for j in 0..hidden {
            let i = sigmoid(gates[j]);
            let f = sigmoid(gates[hidden + j]);
            let g = tanh(gates[2 * hidden + j]);
            let o = sigmoid(gates[3 * hidden + j]);
            let c_new = f * c_prev[b * hidden + j] + i * g;
            c[b * hidden + j] = c_new;
            h[b * hidden + j] = o * tanh(c_new);
        }
    }
    Ok(())
}
