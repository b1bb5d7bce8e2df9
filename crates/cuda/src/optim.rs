//! Optimizer steps on f32 master weights and global-norm clipping
//! (`ptx/optim.ptx`), GPU twins of `ringtrain_kernels::optim` (PyTorch's
//! definitions) and `ringtrain_kernels::scale_f32`.
//!
//! Clipping runs without a host round trip: [`sum_of_squares`] accumulates
//! into a one-element f64 device buffer and [`scale_by_clip_factor`] reads the
//! norm from it on the device. [`clip_by_global_norm`] does both for a list of
//! gradients.

use crate::signature::{KernelSignature, Param::*, PtxModule};

/// The PTX text of `ptx/optim.ptx`.
pub const PTX: &str = include_str!("../../../ptx/optim.ptx");

const ADAM: &[crate::signature::Param] = &[Ptr, Ptr, Ptr, Ptr, F32, F32, F32, F32, F32, U32, U32];

/// Every entry of `ptx/optim.ptx`.
pub const KERNELS: &[KernelSignature] = &[
    KernelSignature {
        name: "sgd_step",
        params: &[Ptr, Ptr, F32, F32, U32],
    },
    KernelSignature {
        name: "sgd_momentum_step",
        params: &[Ptr, Ptr, Ptr, F32, F32, F32, F32, U32, U32, U32],
    },
    KernelSignature {
        name: "adam_step",
        params: ADAM,
    },
    KernelSignature {
        name: "adamw_step",
        params: ADAM,
    },
    KernelSignature {
        name: "scale_f32",
        params: &[Ptr, F32, U32],
    },
    KernelSignature {
        name: "sum_of_squares",
        params: &[Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "scale_by_clip_factor",
        params: &[Ptr, Ptr, F32, U32],
    },
];

/// `ptx/optim.ptx` with its declarations.
pub const MODULE: PtxModule = PtxModule {
    name: "optim",
    file: "ptx/optim.ptx",
    text: PTX,
    kernels: KERNELS,
};

#[cfg(feature = "cuda")]
pub use launchers::*;

#[cfg(feature = "cuda")]
mod launchers {
    use super::MODULE;
    use crate::error::{check_len, kernel_count, Error, Result};
    use crate::memory::{AsDevSlice, AsDevSliceMut, DevSliceMut, GpuBuffer};
    use crate::runtime::{Gpu, KernelArg, LaunchConfig, GRID_STRIDE_BLOCK as BLOCK};

    /// `p -= lr * (g + weight_decay * p)`.
    pub fn sgd_step(
        gpu: &Gpu,
        params: &mut impl AsDevSliceMut<f32>,
        grads: &impl AsDevSlice<f32>,
        lr: f32,
        weight_decay: f32,
    ) -> Result<()> {
        let (params, grads) = (params.dev_slice_mut(), grads.dev_slice());
        check_len("grads", params.len(), grads.len())?;
        let n = kernel_count("n (elements)", params.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg_mut("params", &params)?,
            gpu.arg("grads", &grads)?,
            KernelArg::F32(lr),
            KernelArg::F32(weight_decay),
            KernelArg::U32(n),
        ];
        // SAFETY: live, length-checked views on this GPU; params is the only
        // written buffer and is borrowed mutably.
        unsafe { gpu.launch(&MODULE, "sgd_step", gpu.grid_stride(params.len()), &args) }
    }

    /// PyTorch SGD with momentum (see `ringtrain_kernels::sgd_momentum_step`).
    pub fn sgd_momentum_step(
        gpu: &Gpu,
        params: &mut impl AsDevSliceMut<f32>,
        grads: &impl AsDevSlice<f32>,
        momentum_buf: &mut impl AsDevSliceMut<f32>,
        lr: f32,
        momentum: f32,
        dampening: f32,
        weight_decay: f32,
        nesterov: bool,
        first_step: bool,
    ) -> Result<()> {
        if nesterov && (momentum <= 0.0 || dampening != 0.0) {
            return Err(Error::InvalidValue {
                name: "nesterov",
                value: format!("true (momentum = {momentum}, dampening = {dampening})"),
                reason: "Nesterov momentum needs momentum > 0 and dampening 0 (as in PyTorch)",
            });
        }
        let (params, grads) = (params.dev_slice_mut(), grads.dev_slice());
        let momentum_buf = momentum_buf.dev_slice_mut();
        check_len("grads", params.len(), grads.len())?;
        check_len("momentum_buf", params.len(), momentum_buf.len())?;
        let n = kernel_count("n (elements)", params.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg_mut("params", &params)?,
            gpu.arg("grads", &grads)?,
            gpu.arg_mut("momentum_buf", &momentum_buf)?,
            KernelArg::F32(lr),
            KernelArg::F32(momentum),
            KernelArg::F32(dampening),
            KernelArg::F32(weight_decay),
            KernelArg::U32(nesterov as u32),
            KernelArg::U32(first_step as u32),
            KernelArg::U32(n),
        ];
        // SAFETY: live, length-checked views on this GPU; the two written
        // buffers are distinct mutable borrows.
        unsafe {
            gpu.launch(
                &MODULE,
                "sgd_momentum_step",
                gpu.grid_stride(params.len()),
                &args,
            )
        }
    }

    fn adam_like(
        gpu: &Gpu,
        kernel: &'static str,
        params: &mut impl AsDevSliceMut<f32>,
        grads: &impl AsDevSlice<f32>,
        m: &mut impl AsDevSliceMut<f32>,
        v: &mut impl AsDevSliceMut<f32>,
        hyper: [f32; 5],
        step: u32,
    ) -> Result<()> {
        if step == 0 {
            return Err(Error::InvalidValue {
                name: "step",
                value: "0".into(),
                reason: "Adam steps count from 1 (the bias corrections divide by 1 - beta^step)",
            });
        }
        let [lr, beta1, beta2, eps, weight_decay] = hyper;
        for (arg, beta) in [("beta1", beta1), ("beta2", beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(Error::InvalidValue {
                    name: arg,
                    value: beta.to_string(),
                    reason: "must be in [0, 1), e.g. 0.9 for beta1 and 0.999 for beta2",
                });
            }
        }
        let (params, grads) = (params.dev_slice_mut(), grads.dev_slice());
        let (m, v) = (m.dev_slice_mut(), v.dev_slice_mut());
        check_len("grads", params.len(), grads.len())?;
        check_len("m", params.len(), m.len())?;
        check_len("v", params.len(), v.len())?;
        let n = kernel_count("n (elements)", params.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg_mut("params", &params)?,
            gpu.arg("grads", &grads)?,
            gpu.arg_mut("m", &m)?,
            gpu.arg_mut("v", &v)?,
            KernelArg::F32(lr),
            KernelArg::F32(beta1),
            KernelArg::F32(beta2),
            KernelArg::F32(eps),
            KernelArg::F32(weight_decay),
            KernelArg::U32(step),
            KernelArg::U32(n),
        ];
        // SAFETY: live, length-checked views on this GPU; the three written
        // buffers are distinct mutable borrows.
        unsafe { gpu.launch(&MODULE, kernel, gpu.grid_stride(params.len()), &args) }
    }

    /// PyTorch Adam with L2 weight decay; `step` counts from 1.
    pub fn adam_step(
        gpu: &Gpu,
        params: &mut impl AsDevSliceMut<f32>,
        grads: &impl AsDevSlice<f32>,
        m: &mut impl AsDevSliceMut<f32>,
        v: &mut impl AsDevSliceMut<f32>,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        step: u32,
    ) -> Result<()> {
        let hyper = [lr, beta1, beta2, eps, weight_decay];
        adam_like(gpu, "adam_step", params, grads, m, v, hyper, step)
    }

    /// PyTorch AdamW (decoupled weight decay); `step` counts from 1.
    pub fn adamw_step(
        gpu: &Gpu,
        params: &mut impl AsDevSliceMut<f32>,
        grads: &impl AsDevSlice<f32>,
        m: &mut impl AsDevSliceMut<f32>,
        v: &mut impl AsDevSliceMut<f32>,
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        step: u32,
    ) -> Result<()> {
        let hyper = [lr, beta1, beta2, eps, weight_decay];
        adam_like(gpu, "adamw_step", params, grads, m, v, hyper, step)
    }

    /// `buf[i] *= factor`.
    pub fn scale_f32(gpu: &Gpu, buf: &mut impl AsDevSliceMut<f32>, factor: f32) -> Result<()> {
        let buf = buf.dev_slice_mut();
        let n = kernel_count("n (elements)", buf.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg_mut("buf", &buf)?,
            KernelArg::F32(factor),
            KernelArg::U32(n),
        ];
        // SAFETY: a live view of n elements on this GPU, borrowed mutably.
        unsafe { gpu.launch(&MODULE, "scale_f32", gpu.grid_stride(buf.len()), &args) }
    }

    fn check_accumulator(acc: &GpuBuffer<f64>) -> Result<()> {
        check_len("acc (a one-element f64 accumulator)", 1, acc.len())
    }

    /// Adds the sum of squares of `x` (accumulated in f64) into `acc[0]`.
    /// Clear `acc` first (`fill_bytes(0)`) to start a new norm.
    pub fn sum_of_squares(
        gpu: &Gpu,
        x: &impl AsDevSlice<f32>,
        acc: &mut GpuBuffer<f64>,
    ) -> Result<()> {
        check_accumulator(acc)?;
        let x = x.dev_slice();
        let n = kernel_count("n (elements)", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let acc = acc.as_mut_slice();
        let grid = (x.len().div_ceil(BLOCK as usize)).min(gpu.multiprocessors() as usize * 8);
        let args = [
            gpu.arg("x", &x)?,
            gpu.arg_mut("acc", &acc)?,
            KernelArg::U32(n),
        ];
        // SAFETY: x is a live view of n elements on this GPU; acc a live f64.
        unsafe {
            gpu.launch(
                &MODULE,
                "sum_of_squares",
                LaunchConfig::linear(grid as u32, BLOCK),
                &args,
            )
        }
    }

    /// `buf *= min(1, max_norm / (sqrt(norm_sq[0]) + 1e-6))`, reading `norm_sq` on the device.
    pub fn scale_by_clip_factor(
        gpu: &Gpu,
        buf: &mut impl AsDevSliceMut<f32>,
        norm_sq: &GpuBuffer<f64>,
        max_norm: f32,
    ) -> Result<()> {
        check_accumulator(norm_sq)?;
        let buf = buf.dev_slice_mut();
        let n = kernel_count("n (elements)", buf.len())?;
        if n == 0 {
            return Ok(());
        }
        let norm = norm_sq.as_slice();
        let args = [
            gpu.arg_mut("buf", &buf)?,
            gpu.arg("norm_sq", &norm)?,
            KernelArg::F32(max_norm),
            KernelArg::U32(n),
        ];
        // SAFETY: buf is a live view of n elements on this GPU, borrowed
        // mutably; norm_sq is a separate live buffer.
        unsafe {
            gpu.launch(
                &MODULE,
                "scale_by_clip_factor",
                gpu.grid_stride(buf.len()),
                &args,
            )
        }
    }

    /// Clips all `grads` together by their global L2 norm (PyTorch
    /// `clip_grad_norm_`), entirely on the device. On return (after the queued
    /// work runs) `norm_sq[0]` holds the squared total norm before clipping;
    /// read it with `norm_sq.to_host()` when needed.
    pub fn clip_by_global_norm(
        gpu: &Gpu,
        grads: &mut [DevSliceMut<'_, f32>],
        max_norm: f32,
        norm_sq: &mut GpuBuffer<f64>,
    ) -> Result<()> {
        if max_norm.is_nan() || max_norm <= 0.0 {
            return Err(Error::InvalidValue {
                name: "max_norm",
                value: max_norm.to_string(),
                reason: "the clipping norm must be a positive number",
            });
        }
        check_accumulator(norm_sq)?;
        norm_sq.fill_bytes(0)?;
        for g in grads.iter() {
            sum_of_squares(gpu, g, norm_sq)?;
        }
        for g in grads.iter_mut() {
            scale_by_clip_factor(gpu, g, norm_sq, max_norm)?;
        }
        Ok(())
    }
}
