//! LSTM pointwise kernels (`ptx/lstm.ptx`), GPU twins of `ringtrain_kernels::lstm`.
//!
//! Same names, argument order and layouts as the CPU functions (row-major;
//! gate blocks `i | f | g | o` in a `[batch, 4H]` row), with the [`Gpu`](crate::Gpu)
//! first. Activations use `ex2.approx` and agree with the CPU kernels to about
//! 1e-6 absolute (see the PTX file's header for the bound).

use crate::signature::{KernelSignature, Param::*, PtxModule};

/// The PTX text of `ptx/lstm.ptx`.
pub const PTX: &str = include_str!("../../../ptx/lstm.ptx");

/// Every entry of `ptx/lstm.ptx`.
pub const KERNELS: &[KernelSignature] = &[
    KernelSignature {
        name: "lstm_pointwise_forward",
        params: &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32],
    },
    KernelSignature {
        name: "lstm_pointwise_forward_step",
        params: &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32],
    },
    KernelSignature {
        name: "lstm_pointwise_backward",
        params: &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32],
    },
];

/// `ptx/lstm.ptx` with its declarations.
pub const MODULE: PtxModule = PtxModule {
    name: "lstm",
    file: "ptx/lstm.ptx",
    text: PTX,
    kernels: KERNELS,
};

#[cfg(feature = "cuda")]
pub use launchers::*;

#[cfg(feature = "cuda")]
mod launchers {
    use super::MODULE;
    use crate::error::{check_len, checked_elements, kernel_count, Error, Result};
    use crate::memory::{AsDevSlice, AsDevSliceMut};
    use crate::runtime::{Gpu, KernelArg};

    /// Checks `batch` and `hidden` and returns (cells = batch*H, gates = batch*4H).
    fn dims(batch: usize, hidden: usize) -> Result<(usize, usize)> {
        let gates = checked_elements("batch * 4 * hidden", batch, hidden.saturating_mul(4))?;
        kernel_count("batch * 4 * hidden", gates)?;
        Ok((batch * hidden, gates))
    }

    /// Length checks of the cell inputs and outputs both forward kernels share;
    /// `lens` holds the lengths of `[bias, c_prev, c, h, act]`.
    fn check_cell_io(hidden: usize, cells: usize, gate_len: usize, lens: [usize; 5]) -> Result<()> {
        let [bias, c_prev, c, h, act] = lens;
        check_len("bias", 4 * hidden, bias)?;
        check_len("c_prev", cells, c_prev)?;
        check_len("c", cells, c)?;
        check_len("h", cells, h)?;
        check_len("act", gate_len, act)
    }

    /// GPU twin of `ringtrain_kernels::lstm_pointwise_forward`: gates (`[batch, 4H]`,
    /// without bias) + bias (`[4H]`) and `c_prev` give `c`, `h` (`[batch, H]`) and the
    /// saved activations `act` (`[batch, 4H]`).
    pub fn lstm_pointwise_forward(
        gpu: &Gpu,
        gates: &impl AsDevSlice<f32>,
        bias: &impl AsDevSlice<f32>,
        c_prev: &impl AsDevSlice<f32>,
        c: &mut impl AsDevSliceMut<f32>,
        h: &mut impl AsDevSliceMut<f32>,
        act: &mut impl AsDevSliceMut<f32>,
        batch: usize,
        hidden: usize,
    ) -> Result<()> {
        let (cells, gate_len) = dims(batch, hidden)?;
        let (gates, bias, c_prev) = (gates.dev_slice(), bias.dev_slice(), c_prev.dev_slice());
        let (c, h, act) = (c.dev_slice_mut(), h.dev_slice_mut(), act.dev_slice_mut());
        check_len("gates", gate_len, gates.len())?;
        let io_lens = [bias.len(), c_prev.len(), c.len(), h.len(), act.len()];
        check_cell_io(hidden, cells, gate_len, io_lens)?;
        if cells == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg("gates", &gates)?,
            gpu.arg("bias", &bias)?,
            gpu.arg("c_prev", &c_prev)?,
            gpu.arg_mut("c", &c)?,
            gpu.arg_mut("h", &h)?,
            gpu.arg_mut("act", &act)?,
            KernelArg::U32(batch as u32),
            KernelArg::U32(hidden as u32),
        ];
        // SAFETY: every pointer comes from a live, length-checked view on this
        // GPU; the outputs are distinct mutable borrows, so nothing aliases.
        unsafe {
            gpu.launch(
                &MODULE,
                "lstm_pointwise_forward",
                gpu.grid_stride(cells),
                &args,
            )
        }
    }

    /// GPU twin of `ringtrain_kernels::lstm_pointwise_forward_step`: pre-activations
    /// are `input_proj[step]` (`input_proj` is `[steps, batch, 4H]`, x·W_ih for all
    /// steps) + `recurrent` (`[batch, 4H]`) + `bias`.
    pub fn lstm_pointwise_forward_step(
        gpu: &Gpu,
        input_proj: &impl AsDevSlice<f32>,
        recurrent: &impl AsDevSlice<f32>,
        bias: &impl AsDevSlice<f32>,
        c_prev: &impl AsDevSlice<f32>,
        c: &mut impl AsDevSliceMut<f32>,
        h: &mut impl AsDevSliceMut<f32>,
        act: &mut impl AsDevSliceMut<f32>,
        step: usize,
        steps: usize,
        batch: usize,
        hidden: usize,
    ) -> Result<()> {
        let (cells, gate_len) = dims(batch, hidden)?;
        if step >= steps {
            return Err(Error::InvalidValue {
                name: "step",
                value: format!("{step} (steps = {steps})"),
                reason: "step must be below steps",
            });
        }
        let proj_len = steps.checked_mul(gate_len).ok_or(Error::TooLarge {
            arg: "steps * batch * 4 * hidden",
            value: usize::MAX,
            limit: usize::MAX,
        })?;
        let (input_proj, recurrent) = (input_proj.dev_slice(), recurrent.dev_slice());
        let (bias, c_prev) = (bias.dev_slice(), c_prev.dev_slice());
        let (c, h, act) = (c.dev_slice_mut(), h.dev_slice_mut(), act.dev_slice_mut());
        check_len("input_proj", proj_len, input_proj.len())?;
        check_len("recurrent", gate_len, recurrent.len())?;
        let io_lens = [bias.len(), c_prev.len(), c.len(), h.len(), act.len()];
        check_cell_io(hidden, cells, gate_len, io_lens)?;
        if cells == 0 {
            return Ok(());
        }
        let steps32 = crate::error::to_u32("steps", steps)?;
        let args = [
            gpu.arg("input_proj", &input_proj)?,
            gpu.arg("recurrent", &recurrent)?,
            gpu.arg("bias", &bias)?,
            gpu.arg("c_prev", &c_prev)?,
            gpu.arg_mut("c", &c)?,
            gpu.arg_mut("h", &h)?,
            gpu.arg_mut("act", &act)?,
            KernelArg::U32(step as u32),
            KernelArg::U32(steps32),
            KernelArg::U32(batch as u32),
            KernelArg::U32(hidden as u32),
        ];
        // SAFETY: pointers from live, length-checked views on this GPU (the
        // kernel reads input_proj[step], inside the checked length); outputs
        // are distinct mutable borrows.
        unsafe {
            gpu.launch(
                &MODULE,
                "lstm_pointwise_forward_step",
                gpu.grid_stride(cells),
                &args,
            )
        }
    }

    /// GPU twin of `ringtrain_kernels::lstm_pointwise_backward`: from the saved
    /// activations, `c_prev`, `c`, `dh` and `dc` (gradient reaching c from step t+1)
    /// computes `dgates` (`[batch, 4H]`, w.r.t. pre-activations) and `dc_prev`.
    pub fn lstm_pointwise_backward(
        gpu: &Gpu,
        act: &impl AsDevSlice<f32>,
        c_prev: &impl AsDevSlice<f32>,
        c: &impl AsDevSlice<f32>,
        dh: &impl AsDevSlice<f32>,
        dc: &impl AsDevSlice<f32>,
        dgates: &mut impl AsDevSliceMut<f32>,
        dc_prev: &mut impl AsDevSliceMut<f32>,
        batch: usize,
        hidden: usize,
    ) -> Result<()> {
        let (cells, gate_len) = dims(batch, hidden)?;
        let (act, c_prev, c) = (act.dev_slice(), c_prev.dev_slice(), c.dev_slice());
        let (dh, dc) = (dh.dev_slice(), dc.dev_slice());
        let (dgates, dc_prev) = (dgates.dev_slice_mut(), dc_prev.dev_slice_mut());
        check_len("act", gate_len, act.len())?;
        check_len("c_prev", cells, c_prev.len())?;
        check_len("c", cells, c.len())?;
        check_len("dh", cells, dh.len())?;
        check_len("dc", cells, dc.len())?;
        check_len("dgates", gate_len, dgates.len())?;
        check_len("dc_prev", cells, dc_prev.len())?;
        if cells == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg("act", &act)?,
            gpu.arg("c_prev", &c_prev)?,
            gpu.arg("c", &c)?,
            gpu.arg("dh", &dh)?,
            gpu.arg("dc", &dc)?,
            gpu.arg_mut("dgates", &dgates)?,
            gpu.arg_mut("dc_prev", &dc_prev)?,
            KernelArg::U32(batch as u32),
            KernelArg::U32(hidden as u32),
        ];
        // SAFETY: pointers from live, length-checked views on this GPU; the
        // outputs are distinct mutable borrows.
        unsafe {
            gpu.launch(
                &MODULE,
                "lstm_pointwise_backward",
                gpu.grid_stride(cells),
                &args,
            )
        }
    }
}
