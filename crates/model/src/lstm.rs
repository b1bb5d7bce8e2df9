//! The LSTM layer, in two implementations that compute the same function.
//!
//! - [`LstmImpl::Fused`] follows cuDNN's recipe: one matrix product `X·W_ih` for all time
//!   steps at once, then per step one 4-gate product `h_prev·W_hh` and one fused pointwise
//!   kernel. Backward runs one pointwise kernel and one product per step, then the weight
//!   gradients as single products over all `steps * batch` rows
//!   (`dW_ih = Xᵀ·dGates`, `dW_hh = H_prevᵀ·dGates`) and `dX = dGates·W_ihᵀ`.
//! - [`LstmImpl::Stepwise`] follows TensorFlow's `dynamic_rnn` with a basic LSTM cell:
//!   per step and per gate separate products for the input and recurrent parts, a bias
//!   add and an activation per gate, and separate element-wise operations for the cell
//!   update; backward likewise per step, with the weight gradients accumulated step by step.
//!
//! Weights: `w_ih: [input, 4H]`, `w_hh: [H, 4H]`, `bias: [4H]`, gate blocks `i | f | g | o`.
//! A layer may run in reverse time order (the backward direction of a bidirectional
//! encoder); its outputs are still stored in time order. Its input may come in parts
//! (`LayerInput`: the two directions of the bi encoder layer below, read as one input
//! of their summed width without copying them side by side): `X·W_ih` is then the sum of
//! each part times its block of rows of `W_ih`.
//!
//! With a `StepMask` (source lengths), a step at a padded position leaves the state as
//! it was (`h`, `c` are the previous step's) and gets no gradient: after each step the new
//! state is blended `keep·new + hold·prev` with 0/1 masks, and backward splits the
//! incoming gradient the same way (the `hold` part passes to the previous step unchanged,
//! the cell sees only the `keep` part). A backward-direction layer thus starts at each
//! sentence's last real token from its initial state, as TF's `dynamic_rnn` with
//! `sequence_length` does, and a forward one ends with the state at it.

use std::ops::Range;

use crate::backend::{
    view, view_mut, Backend, Binary, InPlace, Layout, LstmBackwardStep, LstmForwardStep, Unary,
};
use crate::error::Result;
use crate::params::{ParamInit, ParamLayout};

/// Which implementation an LSTM layer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LstmImpl {
    /// cuDNN-style: all-steps input product, one 4-gate product and one fused pointwise
    /// kernel per step.
    #[default]
    Fused,
    /// TensorFlow `dynamic_rnn`-style: per step, per gate products and separate
    /// element-wise operations.
    Stepwise,
}

impl LstmImpl {
    /// The name [`std::str::FromStr`] reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            LstmImpl::Fused => "fused",
            LstmImpl::Stepwise => "stepwise",
        }
    }
}

impl std::fmt::Display for LstmImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LstmImpl {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fused" => Ok(LstmImpl::Fused),
            "stepwise" => Ok(LstmImpl::Stepwise),
            other => Err(crate::error::invalid_value(
                "lstm",
                other,
                "use `fused` or `stepwise`",
            )),
        }
    }
}

/// One LSTM layer: sizes, direction and where its tensors live in the flat buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LstmLayer {
    pub(crate) input: usize,
    pub(crate) hidden: usize,
    pub(crate) reverse: bool,
    w_ih: Range<usize>,
    w_hh: Range<usize>,
    bias: Range<usize>,
}

/// Initial state of a layer: `h` and `c` (`[batch, H]` each) at the given offsets.
pub(crate) struct InitState<'a, Buf> {
    pub(crate) h: &'a Buf,
    pub(crate) h_offset: usize,
    pub(crate) c: &'a Buf,
    pub(crate) c_offset: usize,
}

/// Where `dX` goes: `buf[offset..]`, overwritten or added to.
pub(crate) struct GradTarget<'a, Buf> {
    pub(crate) buf: &'a mut Buf,
    pub(crate) offset: usize,
    pub(crate) accumulate: bool,
}

/// One part of a layer's input: `[steps, batch, width]` time-major, at `offset` of `buf`.
pub(crate) struct LayerInput<'a, Buf> {
    pub(crate) buf: &'a Buf,
    pub(crate) offset: usize,
    pub(crate) width: usize,
}

/// Real and padded positions of a pass: `keep` is 1.0 at real (step, row) positions and
/// 0.0 at padding, `hold` is `1 - keep`; both `[steps, batch, H]` time-major.
pub(crate) struct StepMask<'a, Buf> {
    pub(crate) keep: &'a Buf,
    pub(crate) hold: &'a Buf,
}

impl<Buf> Clone for StepMask<'_, Buf> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<Buf> Copy for StepMask<'_, Buf> {}

/// One time step in a layer's processing order: which block of the per-step buffers it
/// uses, and the state slots it reads and writes.
///
/// `gates`, `act`, `dh` and `tanh_c` hold all steps in time order; the cell and hidden
/// states live in `steps + 1` slots of `[batch, H]` so that the previous state
/// (`prev_slot`) and the new one (`out_slot`) of a step sit in one buffer.
#[derive(Debug, Clone, Copy)]
struct Step {
    /// Time index.
    t: usize,
    /// Slot of `h_prev`/`c_prev`.
    prev_slot: usize,
    /// Slot the step's `h`/`c` are written to.
    out_slot: usize,
}

/// Per-layer workspace, allocated for a (steps, batch) capacity and reused.
pub(crate) struct LstmWork<Buf> {
    rows_capacity: usize,
    batch_capacity: usize,
    /// Fused: input projection `[steps, batch, 4H]`; stepwise: gate-major pre-activations
    /// `[4, steps*batch, H]`. Backward overwrites it with the gate gradients.
    gates: Buf,
    /// Activations, same layout as `gates`.
    act: Buf,
    /// Cell states, `steps + 1` slots of `[batch, H]`.
    pub(crate) cells: Buf,
    /// Hidden states, `steps + 1` slots; the layer output is `steps` consecutive slots.
    pub(crate) hiddens: Buf,
    /// Stepwise: `tanh(c)` per step, `[steps, batch, H]`.
    tanh_c: Buf,
    /// Gradient w.r.t. the layer outputs, `[steps, batch, H]` in time order.
    pub(crate) dh: Buf,
    /// Gradient w.r.t. the cell state being carried back; after backward, w.r.t. `c0`.
    pub(crate) dc: Buf,
    dc_next: Buf,
    /// Fused: `h_prev·W_hh` of the current step, `[batch, 4H]`.
    rec: Buf,
    /// Stepwise scratch, `[batch, H]`.
    tmp: Buf,
    /// Gradient w.r.t. `h0` (when asked for), `[batch, H]`.
    pub(crate) dh0: Buf,
}

#[cfg(test)]
impl LstmWork<Vec<f32>> {
    /// f32 values held (CPU workspaces), to check [`LstmWork::lens`] against.
    pub(crate) fn allocated(&self) -> usize {
        [
            &self.gates,
            &self.act,
            &self.cells,
            &self.hiddens,
            &self.tanh_c,
            &self.dh,
            &self.dc,
            &self.dc_next,
            &self.rec,
            &self.tmp,
            &self.dh0,
        ]
        .iter()
        .map(|b| b.len())
        .sum()
    }
}

impl<Buf> LstmWork<Buf> {
    /// The f32 lengths of the buffers, in field order (`gates`, `act`, `cells`,
    /// `hiddens`, `tanh_c`, `dh`, `dc`, `dc_next`, `rec`, `tmp`, `dh0`), in f64 so that a
    /// memory estimate of any size can be made from them without overflow.
    pub(crate) fn lens(hidden: usize, steps: usize, batch: usize) -> [f64; 11] {
        let (h, b) = (hidden as f64, batch as f64);
        let rows = steps as f64 * b;
        [
            rows * 4.0 * h,
            rows * 4.0 * h,
            (rows + b) * h,
            (rows + b) * h,
            rows * h,
            rows * h,
            b * h,
            b * h,
            b * 4.0 * h,
            b * h,
            b * h,
        ]
    }

    /// A workspace for `steps` x `batch` of a layer with `hidden` units.
    pub(crate) fn new<B: Backend<Buffer = Buf>>(
        be: &B,
        hidden: usize,
        steps: usize,
        batch: usize,
    ) -> Result<Self> {
        let [gates, act, cells, hiddens, tanh_c, dh, dc, dc_next, rec, tmp, dh0] =
            Self::lens(hidden, steps, batch).map(|n| n as usize);
        Ok(LstmWork {
            rows_capacity: steps * batch,
            batch_capacity: batch,
            gates: be.zeros(gates)?,
            act: be.zeros(act)?,
            cells: be.zeros(cells)?,
            hiddens: be.zeros(hiddens)?,
            tanh_c: be.zeros(tanh_c)?,
            dh: be.zeros(dh)?,
            dc: be.zeros(dc)?,
            dc_next: be.zeros(dc_next)?,
            rec: be.zeros(rec)?,
            tmp: be.zeros(tmp)?,
            dh0: be.zeros(dh0)?,
        })
    }

    /// True when the workspace is big enough for `steps` x `batch`.
    pub(crate) fn fits(&self, steps: usize, batch: usize) -> bool {
        steps * batch <= self.rows_capacity && batch <= self.batch_capacity
    }
}

impl LstmLayer {
    /// Registers the layer's tensors `{prefix}/w_ih`, `{prefix}/w_hh`, `{prefix}/bias`.
    pub(crate) fn register(
        layout: &mut ParamLayout,
        prefix: &str,
        input: usize,
        hidden: usize,
        reverse: bool,
        init_scale: f32,
        forget_bias: f32,
    ) -> Result<Self> {
        let uniform = ParamInit::Uniform { scale: init_scale };
        let w_ih = layout.push(format!("{prefix}/w_ih"), &[input, 4 * hidden], uniform)?;
        let w_hh = layout.push(format!("{prefix}/w_hh"), &[hidden, 4 * hidden], uniform)?;
        let bias = layout.push(
            format!("{prefix}/bias"),
            &[4 * hidden],
            ParamInit::LstmBias {
                hidden,
                forget_bias,
            },
        )?;
        let g4 = 4 * hidden;
        Ok(LstmLayer {
            input,
            hidden,
            reverse,
            w_ih: w_ih..w_ih + input * g4,
            w_hh: w_hh..w_hh + hidden * g4,
            bias: bias..bias + g4,
        })
    }

    /// Offset in `hiddens` of the layer output (`steps` time-ordered `[batch, H]` blocks).
    pub(crate) fn output_offset(&self, batch: usize) -> usize {
        if self.reverse {
            0
        } else {
            batch * self.hidden
        }
    }

    /// Offset in `hiddens`/`cells` of the final state (after the last processed step).
    pub(crate) fn final_offset(&self, steps: usize, batch: usize) -> usize {
        if self.reverse {
            0
        } else {
            steps * batch * self.hidden
        }
    }

    /// Offset in `dh` of the block that holds the gradient of the final hidden state.
    pub(crate) fn final_dh_offset(&self, steps: usize, batch: usize) -> usize {
        if self.reverse {
            0
        } else {
            (steps - 1) * batch * self.hidden
        }
    }

    /// `W_ih` in the parameter buffer, `[input, 4H]`.
    fn w_ih_matrix(&self) -> Layout {
        Layout::matrix(self.w_ih.start, self.input, 4 * self.hidden)
    }

    /// `W_hh` in the parameter buffer, `[H, 4H]`.
    fn w_hh_matrix(&self) -> Layout {
        Layout::matrix(self.w_hh.start, self.hidden, 4 * self.hidden)
    }

    /// The bias in the parameter buffer, `4H` elements.
    fn bias_vector(&self) -> Layout {
        Layout::contiguous(self.bias.start, 4 * self.hidden)
    }

    /// The `s`-th step in forward processing order.
    fn step(&self, s: usize, steps: usize) -> Step {
        let t = if self.reverse { steps - 1 - s } else { s };
        let (prev_slot, out_slot) = if self.reverse { (t + 1, t) } else { (t, t + 1) };
        Step {
            t,
            prev_slot,
            out_slot,
        }
    }

    /// Writes the initial state into its slot (zeros when `init` is `None`): 2 launches.
    fn set_initial<B: Backend>(
        &self,
        be: &B,
        init: Option<InitState<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
    ) -> Result<()> {
        let bh = batch * self.hidden;
        let slot = Layout::contiguous(if self.reverse { steps * bh } else { 0 }, bh);
        match init {
            Some(s) => {
                let (h, c) = (
                    Layout::contiguous(s.h_offset, bh),
                    Layout::contiguous(s.c_offset, bh),
                );
                be.copy(view(s.h, h), view_mut(&mut w.hiddens, slot))?;
                be.copy(view(s.c, c), view_mut(&mut w.cells, slot))
            }
            None => {
                be.fill(view_mut(&mut w.hiddens, slot), 0.0)?;
                be.fill(view_mut(&mut w.cells, slot), 0.0)
            }
        }
    }

    /// Checks that the parts of `x` add up to the layer's input width.
    fn check_parts<Buf>(&self, x: &[LayerInput<'_, Buf>]) {
        debug_assert_eq!(x.iter().map(|p| p.width).sum::<usize>(), self.input);
    }

    /// Rows `[start, start + width)` of `W_ih`: the block that multiplies one input part.
    fn w_ih_rows(&self, start: usize, width: usize) -> Layout {
        self.w_ih_matrix().narrow_rows(start, width)
    }

    /// With source lengths, after a step wrote its new `h` and `c` into `out_slot`: keeps
    /// them at real positions and puts back the previous state at padded ones
    /// (`keep·new + hold·prev`), using `rec` and `tmp` as scratch: 8 launches.
    fn hold_padded_state<B: Backend>(
        &self,
        be: &B,
        mask: StepMask<'_, B::Buffer>,
        w: &mut LstmWork<B::Buffer>,
        at: Step,
        batch: usize,
    ) -> Result<()> {
        let bh = batch * self.hidden;
        let block = Layout::contiguous(at.t * bh, bh);
        let prev = Layout::contiguous(at.prev_slot * bh, bh);
        let out = Layout::contiguous(at.out_slot * bh, bh);
        let scratch = Layout::contiguous(0, bh);
        for state in [&mut w.hiddens, &mut w.cells] {
            be.binary(
                Binary::Mul,
                view(mask.keep, block),
                view(state, out),
                view_mut(&mut w.rec, scratch),
            )?;
            be.binary(
                Binary::Mul,
                view(mask.hold, block),
                view(state, prev),
                view_mut(&mut w.tmp, scratch),
            )?;
            be.in_place(
                InPlace::Add,
                view(&w.tmp, scratch),
                view_mut(&mut w.rec, scratch),
            )?;
            be.copy(view(&w.rec, scratch), view_mut(state, out))?;
        }
        Ok(())
    }

    /// With source lengths, before the backward of step `t`: splits the gradients that
    /// reach the step's `h` (`dh` block `t`) and `c` (`dc`) into the part the cell sees
    /// (`keep·d`, left in place) and the part that passes through a padded step unchanged
    /// (`hold·d`, kept in `rec` blocks 1 (`h`) and 2 (`c`) for [`Self::pass_held_grads`]):
    /// 6 launches.
    fn split_padded_grads<B: Backend>(
        &self,
        be: &B,
        mask: StepMask<'_, B::Buffer>,
        w: &mut LstmWork<B::Buffer>,
        t: usize,
        batch: usize,
    ) -> Result<()> {
        let bh = batch * self.hidden;
        let block = Layout::contiguous(t * bh, bh);
        let state = Layout::contiguous(0, bh);
        let scratch = Layout::contiguous(0, bh);
        for (grad, at, held) in [(&mut w.dh, block, 1), (&mut w.dc, state, 2)] {
            be.binary(
                Binary::Mul,
                view(mask.hold, block),
                view(grad, at),
                view_mut(&mut w.rec, Layout::contiguous(held * bh, bh)),
            )?;
            be.binary(
                Binary::Mul,
                view(mask.keep, block),
                view(grad, at),
                view_mut(&mut w.rec, scratch),
            )?;
            be.copy(view(&w.rec, scratch), view_mut(grad, at))?;
        }
        Ok(())
    }

    /// After the backward of a step split by [`Self::split_padded_grads`]: adds the held
    /// `c` gradient to `dc` (now the gradient w.r.t. `c_prev`) and the held `h` gradient
    /// to `dh` block `next` (the step processed next, whose output is this step's
    /// `h_prev`); after the last processed step the held `h` gradient stays in `rec`
    /// block 1 for `dh0`: 2 launches or 1.
    fn pass_held_grads<B: Backend>(
        &self,
        be: &B,
        w: &mut LstmWork<B::Buffer>,
        next: Option<usize>,
        batch: usize,
    ) -> Result<()> {
        let bh = batch * self.hidden;
        let held_c = Layout::contiguous(2 * bh, bh);
        let state = Layout::contiguous(0, bh);
        be.in_place(
            InPlace::Add,
            view(&w.rec, held_c),
            view_mut(&mut w.dc, state),
        )?;
        if let Some(t) = next {
            be.in_place(
                InPlace::Add,
                view(&w.rec, Layout::contiguous(bh, bh)),
                view_mut(&mut w.dh, Layout::contiguous(t * bh, bh)),
            )?;
        }
        Ok(())
    }

    /// The time index of the step processed after the one at processing position `s`.
    fn next_t(&self, s: usize, steps: usize) -> Option<usize> {
        (s > 0).then(|| self.step(s - 1, steps).t)
    }

    /// Forward over `steps` time steps of `batch` rows. `x` is the input
    /// `[steps, batch, input]`, in parts whose widths add up to `input`; the output lands
    /// in `w.hiddens` at [`Self::output_offset`]. With `mask`, padded positions hold the
    /// state (see the module docs).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<B: Backend>(
        &self,
        be: &B,
        imp: LstmImpl,
        params: &B::Buffer,
        x: &[LayerInput<'_, B::Buffer>],
        init: Option<InitState<'_, B::Buffer>>,
        mask: Option<StepMask<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
    ) -> Result<()> {
        self.check_parts(x);
        match imp {
            LstmImpl::Fused => self.forward_fused(be, params, x, init, mask, w, steps, batch),
            LstmImpl::Stepwise => self.forward_stepwise(be, params, x, init, mask, w, steps, batch),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_fused<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        x: &[LayerInput<'_, B::Buffer>],
        init: Option<InitState<'_, B::Buffer>>,
        mask: Option<StepMask<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
    ) -> Result<()> {
        let (h, g4) = (self.hidden, 4 * self.hidden);
        let rows = steps * batch;
        // [steps * batch, 4H]: the input projection of every step, then the activations.
        let gates = Layout::matrix(0, rows, g4);
        let slot = |i: usize| Layout::matrix(i * batch * h, batch, h);
        let rec = Layout::matrix(0, batch, g4);
        let mut row = 0;
        for (p, part) in x.iter().enumerate() {
            be.gemm(
                view(part.buf, Layout::matrix(part.offset, rows, part.width)),
                view(params, self.w_ih_rows(row, part.width)),
                view_mut(&mut w.gates, gates),
                p > 0,
            )?;
            row += part.width;
        }
        self.set_initial(be, init, w, steps, batch)?;
        for s in 0..steps {
            let at = self.step(s, steps);
            let block = gates.narrow_rows(at.t * batch, batch);
            be.gemm(
                view(&w.hiddens, slot(at.prev_slot)),
                view(params, self.w_hh_matrix()),
                view_mut(&mut w.rec, rec),
                false,
            )?;
            be.lstm_forward_step(LstmForwardStep {
                input_proj: view(&w.gates, block),
                recurrent: view(&w.rec, rec),
                bias: view(params, self.bias_vector()),
                cells: &mut w.cells,
                c_prev: slot(at.prev_slot),
                c: slot(at.out_slot),
                h: view_mut(&mut w.hiddens, slot(at.out_slot)),
                act: view_mut(&mut w.act, block),
            })?;
            if let Some(mask) = mask {
                self.hold_padded_state(be, mask, w, at, batch)?;
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_stepwise<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        x: &[LayerInput<'_, B::Buffer>],
        init: Option<InitState<'_, B::Buffer>>,
        mask: Option<StepMask<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
    ) -> Result<()> {
        let h = self.hidden;
        let bh = batch * h;
        let n = steps * bh;
        let slot = |i: usize| Layout::matrix(i * bh, batch, h);
        let tmp = Layout::matrix(0, batch, h);
        self.set_initial(be, init, w, steps, batch)?;
        for s in 0..steps {
            let at = self.step(s, steps);
            let blk = at.t * bh;
            // Gate k of this step in the gate-major [4, steps * batch, H] buffers.
            let z = |k: usize| Layout::matrix(k * n + blk, batch, h);
            let block = Layout::matrix(blk, batch, h);
            let (prev, out) = (slot(at.prev_slot), slot(at.out_slot));
            for k in 0..4 {
                let mut row = 0;
                for (p, part) in x.iter().enumerate() {
                    let xt =
                        Layout::matrix(part.offset + at.t * batch * part.width, batch, part.width);
                    be.gemm(
                        view(part.buf, xt),
                        view(
                            params,
                            self.w_ih_rows(row, part.width).narrow_cols(k * h, h),
                        ),
                        view_mut(&mut w.gates, z(k)),
                        p > 0,
                    )?;
                    row += part.width;
                }
            }
            for k in 0..4 {
                be.gemm(
                    view(&w.hiddens, prev),
                    view(params, self.w_hh_matrix().narrow_cols(k * h, h)),
                    view_mut(&mut w.gates, z(k)),
                    true,
                )?;
            }
            for k in 0..4 {
                let bias = Layout::contiguous(self.bias.start + k * h, h);
                be.add_row_bias(view(params, bias), view_mut(&mut w.gates, z(k)))?;
            }
            for k in 0..4 {
                let f = if k == 2 { Unary::Tanh } else { Unary::Sigmoid };
                be.unary(f, view(&w.gates, z(k)), view_mut(&mut w.act, z(k)))?;
            }
            // c = f * c_prev + i * g ; h = o * tanh(c)
            let (i, f, g, o) = (z(0), z(1), z(2), z(3));
            be.binary(
                Binary::Mul,
                view(&w.act, f),
                view(&w.cells, prev),
                view_mut(&mut w.tmp, tmp),
            )?;
            be.binary(
                Binary::Mul,
                view(&w.act, i),
                view(&w.act, g),
                view_mut(&mut w.cells, out),
            )?;
            be.in_place(InPlace::Add, view(&w.tmp, tmp), view_mut(&mut w.cells, out))?;
            be.unary(
                Unary::Tanh,
                view(&w.cells, out),
                view_mut(&mut w.tanh_c, block),
            )?;
            be.binary(
                Binary::Mul,
                view(&w.act, o),
                view(&w.tanh_c, block),
                view_mut(&mut w.hiddens, out),
            )?;
            if let Some(mask) = mask {
                self.hold_padded_state(be, mask, w, at, batch)?;
            }
        }
        Ok(())
    }

    /// Backward after [`Self::forward`] with the same arguments.
    ///
    /// Before the call `w.dh` holds the gradient w.r.t. every output step and `w.dc` the
    /// gradient w.r.t. the final cell state. Writes the weight gradients into `grads`
    /// (calling `on_ready` once per tensor, in buffer order, as each is final), `dX` of
    /// input part `p` into `dx[p]` (`dx` empty: no `dX`), `dh0` into `w.dh0` when
    /// `need_dh0`, and leaves the gradient w.r.t. the initial cell state in `w.dc`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        imp: LstmImpl,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        x: &[LayerInput<'_, B::Buffer>],
        mask: Option<StepMask<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        dx: &mut [GradTarget<'_, B::Buffer>],
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        self.check_parts(x);
        debug_assert!(dx.is_empty() || dx.len() == x.len());
        match imp {
            LstmImpl::Fused => self.backward_fused(
                be, params, grads, x, mask, w, steps, batch, need_dh0, dx, on_ready,
            ),
            LstmImpl::Stepwise => self.backward_stepwise(
                be, params, grads, x, mask, w, steps, batch, need_dh0, dx, on_ready,
            ),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_fused<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        x: &[LayerInput<'_, B::Buffer>],
        mask: Option<StepMask<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        dx: &mut [GradTarget<'_, B::Buffer>],
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        let h = self.hidden;
        let g4 = 4 * h;
        let bh = batch * h;
        let rows = steps * batch;
        let gates = Layout::matrix(0, rows, g4);
        let slot = |i: usize| Layout::matrix(i * bh, batch, h);
        let state = Layout::matrix(0, batch, h);
        let mut last_step: Option<usize> = None;
        for s in (0..steps).rev() {
            let at = self.step(s, steps);
            let dh = Layout::matrix(at.t * bh, batch, h);
            if let Some(next) = last_step {
                // dh_t += dgates_{t+1} · W_hhᵀ (the recurrent path).
                be.gemm(
                    view(&w.gates, gates.narrow_rows(next * batch, batch)),
                    view(params, self.w_hh_matrix()).t(),
                    view_mut(&mut w.dh, dh),
                    true,
                )?;
            }
            if let Some(mask) = mask {
                self.split_padded_grads(be, mask, w, at.t, batch)?;
            }
            let block = gates.narrow_rows(at.t * batch, batch);
            be.lstm_backward_step(LstmBackwardStep {
                act: view(&w.act, block),
                c_prev: view(&w.cells, slot(at.prev_slot)),
                c: view(&w.cells, slot(at.out_slot)),
                dh: view(&w.dh, dh),
                dc: view(&w.dc, state),
                dgates: view_mut(&mut w.gates, block),
                dc_prev: view_mut(&mut w.dc_next, state),
            })?;
            std::mem::swap(&mut w.dc, &mut w.dc_next);
            if mask.is_some() {
                self.pass_held_grads(be, w, self.next_t(s, steps), batch)?;
            }
            last_step = Some(at.t);
        }
        let first = last_step.unwrap_or(0);
        if need_dh0 {
            be.gemm(
                view(&w.gates, gates.narrow_rows(first * batch, batch)),
                view(params, self.w_hh_matrix()).t(),
                view_mut(&mut w.dh0, state),
                false,
            )?;
            if mask.is_some() && steps > 0 {
                let held_h = Layout::contiguous(bh, bh);
                be.in_place(
                    InPlace::Add,
                    view(&w.rec, held_h),
                    view_mut(&mut w.dh0, state),
                )?;
            }
        }
        // dW_ih = Xᵀ·dGates, dW_hh = H_prevᵀ·dGates, then dX and db (below).
        let mut row = 0;
        for part in x {
            be.gemm(
                view(part.buf, Layout::matrix(part.offset, rows, part.width)).t(),
                view(&w.gates, gates),
                view_mut(grads, self.w_ih_rows(row, part.width)),
                false,
            )?;
            row += part.width;
        }
        on_ready(self.w_ih.clone(), grads);
        let h_prev_offset = if self.reverse { bh } else { 0 };
        be.gemm(
            view(&w.hiddens, Layout::matrix(h_prev_offset, rows, h)).t(),
            view(&w.gates, gates),
            view_mut(grads, self.w_hh_matrix()),
            false,
        )?;
        on_ready(self.w_hh.clone(), grads);
        // dX = dGates·W_ihᵀ, before db: the products that read dGates run back to back
        // (a GPU in 16 bits casts dGates once for them).
        let mut row = 0;
        for (part, dx) in x.iter().zip(dx.iter_mut()) {
            be.gemm(
                view(&w.gates, gates),
                view(params, self.w_ih_rows(row, part.width)).t(),
                view_mut(dx.buf, Layout::matrix(dx.offset, rows, part.width)),
                dx.accumulate,
            )?;
            row += part.width;
        }
        be.column_sums(
            view(&w.gates, gates),
            view_mut(grads, self.bias_vector()),
            false,
        )?;
        on_ready(self.bias.clone(), grads);
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_stepwise<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        x: &[LayerInput<'_, B::Buffer>],
        mask: Option<StepMask<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        dx: &mut [GradTarget<'_, B::Buffer>],
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        let h = self.hidden;
        let bh = batch * h;
        let n = steps * bh;
        let slot = |i: usize| Layout::matrix(i * bh, batch, h);
        // Gate k of step t in the gate-major [4, steps * batch, H] buffers.
        let z = |k: usize, t: usize| Layout::matrix(k * n + t * bh, batch, h);
        // Gate block k of W_hh: [H, H] with row stride 4H.
        let w_hh = |k: usize| self.w_hh_matrix().narrow_cols(k * h, h);
        let state = Layout::matrix(0, batch, h);
        let mut last_step: Option<usize> = None;
        for s in (0..steps).rev() {
            let at = self.step(s, steps);
            let t = at.t;
            let block = Layout::matrix(t * bh, batch, h);
            let prev = slot(at.prev_slot);
            let first = last_step.is_none();
            if let Some(next) = last_step {
                for k in 0..4 {
                    be.gemm(
                        view(&w.gates, z(k, next)),
                        view(params, w_hh(k)).t(),
                        view_mut(&mut w.dh, block),
                        true,
                    )?;
                }
            }
            if let Some(mask) = mask {
                self.split_padded_grads(be, mask, w, t, batch)?;
            }
            let (zi, zf, zg, zo) = (z(0, t), z(1, t), z(2, t), z(3, t));
            // Output gate: dz_o = dh * tanh(c) * o(1-o).
            be.binary(
                Binary::Mul,
                view(&w.dh, block),
                view(&w.tanh_c, block),
                view_mut(&mut w.gates, zo),
            )?;
            be.in_place(
                InPlace::MulSigmoidGrad,
                view(&w.act, zo),
                view_mut(&mut w.gates, zo),
            )?;
            // dc += dh * o * (1 - tanh(c)^2).
            be.binary(
                Binary::Mul,
                view(&w.dh, block),
                view(&w.act, zo),
                view_mut(&mut w.tmp, state),
            )?;
            be.in_place(
                InPlace::MulTanhGrad,
                view(&w.tanh_c, block),
                view_mut(&mut w.tmp, state),
            )?;
            be.in_place(
                InPlace::Add,
                view(&w.tmp, state),
                view_mut(&mut w.dc, state),
            )?;
            // dz_i = dc * g * i(1-i); dz_g = dc * i * (1-g^2); dz_f = dc * c_prev * f(1-f).
            for (dz, factor, factor_at, activation_grad) in [
                (zi, &w.act, zg, InPlace::MulSigmoidGrad),
                (zg, &w.act, zi, InPlace::MulTanhGrad),
                (zf, &w.cells, prev, InPlace::MulSigmoidGrad),
            ] {
                be.binary(
                    Binary::Mul,
                    view(&w.dc, state),
                    view(factor, factor_at),
                    view_mut(&mut w.gates, dz),
                )?;
                be.in_place(
                    activation_grad,
                    view(&w.act, dz),
                    view_mut(&mut w.gates, dz),
                )?;
            }
            // dc_prev = dc * f.
            be.binary(
                Binary::Mul,
                view(&w.dc, state),
                view(&w.act, zf),
                view_mut(&mut w.dc_next, state),
            )?;
            std::mem::swap(&mut w.dc, &mut w.dc_next);
            let mut row = 0;
            for part in x {
                let xt = Layout::matrix(part.offset + t * batch * part.width, batch, part.width);
                for k in 0..4 {
                    be.gemm(
                        view(part.buf, xt).t(),
                        view(&w.gates, z(k, t)),
                        view_mut(grads, self.w_ih_rows(row, part.width).narrow_cols(k * h, h)),
                        !first,
                    )?;
                }
                row += part.width;
            }
            for k in 0..4 {
                be.gemm(
                    view(&w.hiddens, prev).t(),
                    view(&w.gates, z(k, t)),
                    view_mut(grads, w_hh(k)),
                    !first,
                )?;
            }
            for k in 0..4 {
                let bias = Layout::contiguous(self.bias.start + k * h, h);
                be.column_sums(view(&w.gates, z(k, t)), view_mut(grads, bias), !first)?;
            }
            let mut row = 0;
            for (part, dx) in x.iter().zip(dx.iter_mut()) {
                let dxt = Layout::matrix(dx.offset + t * batch * part.width, batch, part.width);
                for k in 0..4 {
                    be.gemm(
                        view(&w.gates, z(k, t)),
                        view(
                            params,
                            self.w_ih_rows(row, part.width).narrow_cols(k * h, h),
                        )
                        .t(),
                        view_mut(dx.buf, dxt),
                        k > 0 || dx.accumulate,
                    )?;
                }
                row += part.width;
            }
            if mask.is_some() {
                self.pass_held_grads(be, w, self.next_t(s, steps), batch)?;
            }
            last_step = Some(t);
        }
        if need_dh0 {
            let first = last_step.unwrap_or(0);
            for k in 0..4 {
                be.gemm(
                    view(&w.gates, z(k, first)),
                    view(params, w_hh(k)).t(),
                    view_mut(&mut w.dh0, state),
                    k > 0,
                )?;
            }
            if mask.is_some() && steps > 0 {
                let held_h = Layout::contiguous(bh, bh);
                be.in_place(
                    InPlace::Add,
                    view(&w.rec, held_h),
                    view_mut(&mut w.dh0, state),
                )?;
            }
        }
        on_ready(self.w_ih.clone(), grads);
        on_ready(self.w_hh.clone(), grads);
        on_ready(self.bias.clone(), grads);
        Ok(())
    }
}
