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
//! encoder); its outputs are still stored in time order.

use std::ops::Range;

use crate::backend::{Backend, Binary, Gemm, InPlace, LstmStep, Unary};
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
            other => Err(crate::error::config_error(
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

impl<Buf> LstmWork<Buf> {
    /// A workspace for `steps` x `batch` of a layer with `hidden` units.
    pub(crate) fn new<B: Backend<Buffer = Buf>>(
        be: &B,
        hidden: usize,
        steps: usize,
        batch: usize,
    ) -> Result<Self> {
        let rows = steps * batch;
        Ok(LstmWork {
            rows_capacity: rows,
            batch_capacity: batch,
            gates: be.zeros(rows * 4 * hidden)?,
            act: be.zeros(rows * 4 * hidden)?,
            cells: be.zeros((rows + batch) * hidden)?,
            hiddens: be.zeros((rows + batch) * hidden)?,
            tanh_c: be.zeros(rows * hidden)?,
            dh: be.zeros(rows * hidden)?,
            dc: be.zeros(batch * hidden)?,
            dc_next: be.zeros(batch * hidden)?,
            rec: be.zeros(batch * 4 * hidden)?,
            tmp: be.zeros(batch * hidden)?,
            dh0: be.zeros(batch * hidden)?,
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

    /// The `s`-th step in forward processing order.
    fn step(&self, s: usize, steps: usize, batch: usize) -> LstmStep {
        let t = if self.reverse { steps - 1 - s } else { s };
        let (prev_slot, out_slot) = if self.reverse { (t + 1, t) } else { (t, t + 1) };
        LstmStep {
            step: t,
            steps,
            batch,
            hidden: self.hidden,
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
        let slot = if self.reverse { steps * bh } else { 0 };
        match init {
            Some(s) => {
                be.copy(s.h, s.h_offset, &mut w.hiddens, slot, bh)?;
                be.copy(s.c, s.c_offset, &mut w.cells, slot, bh)
            }
            None => {
                be.fill(&mut w.hiddens, slot, bh, 0.0)?;
                be.fill(&mut w.cells, slot, bh, 0.0)
            }
        }
    }

    /// Forward over `steps` time steps of `batch` rows. `x` at `x_offset` is the input
    /// `[steps, batch, input]`; the output lands in `w.hiddens` at [`Self::output_offset`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<B: Backend>(
        &self,
        be: &B,
        imp: LstmImpl,
        params: &B::Buffer,
        x: &B::Buffer,
        x_offset: usize,
        init: Option<InitState<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
    ) -> Result<()> {
        match imp {
            LstmImpl::Fused => self.forward_fused(be, params, x, x_offset, init, w, steps, batch),
            LstmImpl::Stepwise => {
                self.forward_stepwise(be, params, x, x_offset, init, w, steps, batch)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_fused<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        x: &B::Buffer,
        x_offset: usize,
        init: Option<InitState<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
    ) -> Result<()> {
        let (h, g4) = (self.hidden, 4 * self.hidden);
        let bh = batch * h;
        let input_proj = Gemm::nn(steps * batch, g4, self.input).at(x_offset, self.w_ih.start, 0);
        be.gemm(x, params, &mut w.gates, &input_proj)?;
        self.set_initial(be, init, w, steps, batch)?;
        for s in 0..steps {
            let at = self.step(s, steps, batch);
            let recurrent = Gemm::nn(batch, g4, h).at(at.prev_slot * bh, self.w_hh.start, 0);
            be.gemm(&w.hiddens, params, &mut w.rec, &recurrent)?;
            be.lstm_forward_step(
                &w.gates,
                &w.rec,
                params,
                self.bias.start,
                &mut w.cells,
                &mut w.hiddens,
                &mut w.act,
                &at,
            )?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_stepwise<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        x: &B::Buffer,
        x_offset: usize,
        init: Option<InitState<'_, B::Buffer>>,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
    ) -> Result<()> {
        let (h, g4, input) = (self.hidden, 4 * self.hidden, self.input);
        let bh = batch * h;
        let n = steps * bh;
        let (gi, gf, gg, go) = (0, n, 2 * n, 3 * n);
        self.set_initial(be, init, w, steps, batch)?;
        for s in 0..steps {
            let at = self.step(s, steps, batch);
            let blk = at.step * bh;
            let (prev, out) = (at.prev_slot * bh, at.out_slot * bh);
            let xo = x_offset + at.step * batch * input;
            for k in 0..4 {
                let z = Gemm::nn(batch, h, input)
                    .at(xo, self.w_ih.start + k * h, k * n + blk)
                    .strides(input, g4, h);
                be.gemm(x, params, &mut w.gates, &z)?;
            }
            for k in 0..4 {
                let z = Gemm::nn(batch, h, h)
                    .at(prev, self.w_hh.start + k * h, k * n + blk)
                    .strides(h, g4, h)
                    .accumulate(true);
                be.gemm(&w.hiddens, params, &mut w.gates, &z)?;
            }
            for k in 0..4 {
                be.add_row_bias(
                    params,
                    self.bias.start + k * h,
                    &mut w.gates,
                    k * n + blk,
                    batch,
                    h,
                )?;
            }
            for k in 0..4 {
                let f = if k == 2 { Unary::Tanh } else { Unary::Sigmoid };
                be.unary(f, &w.gates, k * n + blk, &mut w.act, k * n + blk, bh)?;
            }
            // c = f * c_prev + i * g ; h = o * tanh(c)
            be.binary(
                Binary::Mul,
                &w.act,
                gf + blk,
                &w.cells,
                prev,
                &mut w.tmp,
                0,
                bh,
            )?;
            be.binary(
                Binary::Mul,
                &w.act,
                gi + blk,
                &w.act,
                gg + blk,
                &mut w.cells,
                out,
                bh,
            )?;
            be.in_place(InPlace::Add, &w.tmp, 0, &mut w.cells, out, bh)?;
            be.unary(Unary::Tanh, &w.cells, out, &mut w.tanh_c, blk, bh)?;
            be.binary(
                Binary::Mul,
                &w.act,
                go + blk,
                &w.tanh_c,
                blk,
                &mut w.hiddens,
                out,
                bh,
            )?;
        }
        Ok(())
    }

    /// Backward after [`Self::forward`] with the same arguments.
    ///
    /// Before the call `w.dh` holds the gradient w.r.t. every output step and `w.dc` the
    /// gradient w.r.t. the final cell state. Writes the weight gradients into `grads`
    /// (calling `on_ready` once per tensor, in buffer order, as each is final), `dX` into
    /// `dx` when given, `dh0` into `w.dh0` when `need_dh0`, and leaves the gradient w.r.t.
    /// the initial cell state in `w.dc`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        imp: LstmImpl,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        x: &B::Buffer,
        x_offset: usize,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        dx: Option<GradTarget<'_, B::Buffer>>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        match imp {
            LstmImpl::Fused => self.backward_fused(
                be, params, grads, x, x_offset, w, steps, batch, need_dh0, dx, on_ready,
            ),
            LstmImpl::Stepwise => self.backward_stepwise(
                be, params, grads, x, x_offset, w, steps, batch, need_dh0, dx, on_ready,
            ),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_fused<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        x: &B::Buffer,
        x_offset: usize,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        dx: Option<GradTarget<'_, B::Buffer>>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        let (h, g4, input) = (self.hidden, 4 * self.hidden, self.input);
        let (bh, bg) = (batch * h, batch * g4);
        let rows = steps * batch;
        let mut last_step: Option<usize> = None;
        for s in (0..steps).rev() {
            let at = self.step(s, steps, batch);
            if let Some(next) = last_step {
                // dh_t += dgates_{t+1} · W_hhᵀ (the recurrent path).
                let rec = Gemm::nt(batch, h, g4)
                    .at(next * bg, self.w_hh.start, at.step * bh)
                    .strides(g4, g4, h)
                    .accumulate(true);
                be.gemm(&w.gates, params, &mut w.dh, &rec)?;
            }
            be.lstm_backward_step(
                &w.act,
                &w.cells,
                &w.dh,
                &w.dc,
                &mut w.gates,
                &mut w.dc_next,
                &at,
            )?;
            std::mem::swap(&mut w.dc, &mut w.dc_next);
            last_step = Some(at.step);
        }
        let first = last_step.unwrap_or(0);
        if need_dh0 {
            let dh0 = Gemm::nt(batch, h, g4)
                .at(first * bg, self.w_hh.start, 0)
                .strides(g4, g4, h);
            be.gemm(&w.gates, params, &mut w.dh0, &dh0)?;
        }
        let dw_ih = Gemm::tn(input, g4, rows).at(x_offset, 0, self.w_ih.start);
        be.gemm(x, &w.gates, grads, &dw_ih)?;
        on_ready(self.w_ih.clone(), grads);
        let h_prev_offset = if self.reverse { bh } else { 0 };
        let dw_hh = Gemm::tn(h, g4, rows).at(h_prev_offset, 0, self.w_hh.start);
        be.gemm(&w.hiddens, &w.gates, grads, &dw_hh)?;
        on_ready(self.w_hh.clone(), grads);
        be.column_sums(&w.gates, 0, rows, g4, grads, self.bias.start, false)?;
        on_ready(self.bias.clone(), grads);
        if let Some(dx) = dx {
            let spec = Gemm::nt(rows, input, g4)
                .at(0, self.w_ih.start, dx.offset)
                .accumulate(dx.accumulate);
            be.gemm(&w.gates, params, dx.buf, &spec)?;
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn backward_stepwise<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        x: &B::Buffer,
        x_offset: usize,
        w: &mut LstmWork<B::Buffer>,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        mut dx: Option<GradTarget<'_, B::Buffer>>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        let (h, g4, input) = (self.hidden, 4 * self.hidden, self.input);
        let bh = batch * h;
        let n = steps * bh;
        let (gi, gf, gg, go) = (0, n, 2 * n, 3 * n);
        let mut last_step: Option<usize> = None;
        for s in (0..steps).rev() {
            let at = self.step(s, steps, batch);
            let blk = at.step * bh;
            let prev = at.prev_slot * bh;
            let first = last_step.is_none();
            if let Some(next) = last_step {
                for k in 0..4 {
                    let rec = Gemm::nt(batch, h, h)
                        .at(k * n + next * bh, self.w_hh.start + k * h, blk)
                        .strides(h, g4, h)
                        .accumulate(true);
                    be.gemm(&w.gates, params, &mut w.dh, &rec)?;
                }
            }
            // Output gate: dz_o = dh * tanh(c) * o(1-o).
            be.binary(
                Binary::Mul,
                &w.dh,
                blk,
                &w.tanh_c,
                blk,
                &mut w.gates,
                go + blk,
                bh,
            )?;
            be.in_place(
                InPlace::MulSigmoidGrad,
                &w.act,
                go + blk,
                &mut w.gates,
                go + blk,
                bh,
            )?;
            // dc += dh * o * (1 - tanh(c)^2).
            be.binary(Binary::Mul, &w.dh, blk, &w.act, go + blk, &mut w.tmp, 0, bh)?;
            be.in_place(InPlace::MulTanhGrad, &w.tanh_c, blk, &mut w.tmp, 0, bh)?;
            be.in_place(InPlace::Add, &w.tmp, 0, &mut w.dc, 0, bh)?;
            // dz_i = dc * g * i(1-i); dz_g = dc * i * (1-g^2); dz_f = dc * c_prev * f(1-f).
            for (gate, factor, factor_offset, activation_grad) in [
                (gi, &w.act, gg + blk, InPlace::MulSigmoidGrad),
                (gg, &w.act, gi + blk, InPlace::MulTanhGrad),
                (gf, &w.cells, prev, InPlace::MulSigmoidGrad),
            ] {
                let dz = gate + blk;
                be.binary(
                    Binary::Mul,
                    &w.dc,
                    0,
                    factor,
                    factor_offset,
                    &mut w.gates,
                    dz,
                    bh,
                )?;
                be.in_place(activation_grad, &w.act, dz, &mut w.gates, dz, bh)?;
            }
            // dc_prev = dc * f.
            be.binary(
                Binary::Mul,
                &w.dc,
                0,
                &w.act,
                gf + blk,
                &mut w.dc_next,
                0,
                bh,
            )?;
            std::mem::swap(&mut w.dc, &mut w.dc_next);
            let xo = x_offset + at.step * batch * input;
            for k in 0..4 {
                let spec = Gemm::tn(input, h, batch)
                    .at(xo, k * n + blk, self.w_ih.start + k * h)
                    .strides(input, h, g4)
                    .accumulate(!first);
                be.gemm(x, &w.gates, grads, &spec)?;
            }
            for k in 0..4 {
                let spec = Gemm::tn(h, h, batch)
                    .at(prev, k * n + blk, self.w_hh.start + k * h)
                    .strides(h, h, g4)
                    .accumulate(!first);
                be.gemm(&w.hiddens, &w.gates, grads, &spec)?;
            }
            for k in 0..4 {
                be.column_sums(
                    &w.gates,
                    k * n + blk,
                    batch,
                    h,
                    grads,
                    self.bias.start + k * h,
                    !first,
                )?;
            }
            if let Some(dx) = dx.as_mut() {
                for k in 0..4 {
                    let spec = Gemm::nt(batch, input, h)
                        .at(
                            k * n + blk,
                            self.w_ih.start + k * h,
                            dx.offset + at.step * batch * input,
                        )
                        .strides(h, g4, input)
                        .accumulate(k > 0 || dx.accumulate);
                    be.gemm(&w.gates, params, dx.buf, &spec)?;
                }
            }
            last_step = Some(at.step);
        }
        if need_dh0 {
            let first = last_step.unwrap_or(0);
            for k in 0..4 {
                let spec = Gemm::nt(batch, h, h)
                    .at(k * n + first * bh, self.w_hh.start + k * h, 0)
                    .strides(h, g4, h)
                    .accumulate(k > 0);
                be.gemm(&w.gates, params, &mut w.dh0, &spec)?;
            }
        }
        on_ready(self.w_ih.clone(), grads);
        on_ready(self.w_hh.clone(), grads);
        on_ready(self.bias.clone(), grads);
        Ok(())
    }
}
