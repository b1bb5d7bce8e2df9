//! f32 <-> f16/bf16 casts with loss scaling and f16/bf16 sums (`ptx/fp16.ptx`),
//! GPU twins of `ringtrain_kernels::precision` and `ringtrain_kernels::reduce`.
//!
//! Results are bit-identical to the CPU kernels (round to nearest even; NaN
//! payloads aside). Where the CPU function returns "some element was Inf/NaN",
//! the GPU launcher sets a [`NonFiniteFlag`] on the device instead, so
//! mixed-precision steps need no host round trip per tensor.
//!
//! A dynamic loss scale can live on the device too ([`DeviceLossScale`]): the
//! `*_loss_scaled` / `*_loss_unscaled` casts read it from device memory, and
//! [`loss_scale_update`] applies the growth/backoff policy there, so a training
//! step neither uploads nor downloads it.
//! The kernels use 16-byte vector loads and stores and handle any length and
//! any element offset (misaligned views fall back to element-wise access).

use crate::signature::{KernelSignature, Param::*, PtxModule};

/// The PTX text of `ptx/fp16.ptx`.
pub const PTX: &str = include_str!("../../../ptx/fp16.ptx");

/// Every entry of `ptx/fp16.ptx`.
pub const KERNELS: &[KernelSignature] = &[
    KernelSignature {
        name: "f32_to_f16_scaled",
        params: &[Ptr, F32, Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "f32_to_bf16_scaled",
        params: &[Ptr, F32, Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "f16_to_f32_unscaled",
        params: &[Ptr, F32, Ptr, U32],
    },
    KernelSignature {
        name: "bf16_to_f32_unscaled",
        params: &[Ptr, F32, Ptr, U32],
    },
    KernelSignature {
        name: "sum_into_f16",
        params: &[Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "sum_into_bf16",
        params: &[Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "has_non_finite_f32",
        params: &[Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "f32_to_f16_loss_scaled",
        params: &[Ptr, F32, Ptr, Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "f16_to_f32_loss_unscaled",
        params: &[Ptr, F32, Ptr, Ptr, U32],
    },
    KernelSignature {
        name: "loss_scale_update",
        params: &[Ptr, U32],
    },
];

/// A dynamic loss scale and its bookkeeping, as [`DeviceLossScale`] holds them on the
/// device (and as the host reads or writes them, for checkpoints).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaleState {
    /// The current scale.
    pub scale: f32,
    /// Clean steps since the last change.
    pub clean_steps: u32,
    /// Clean steps needed before the scale doubles.
    pub growth_interval: u32,
    /// Steps skipped because of an overflow.
    pub skipped_steps: u64,
}

impl LossScaleState {
    /// The device layout: `{ f32 scale, u32 clean, u32 interval, u32 unused, u64 skipped }`.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn to_words(self) -> [u32; 6] {
        [
            self.scale.to_bits(),
            self.clean_steps,
            self.growth_interval,
            0,
            self.skipped_steps as u32,
            (self.skipped_steps >> 32) as u32,
        ]
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn from_words(w: &[u32]) -> Option<LossScaleState> {
        match *w {
            [scale, clean_steps, growth_interval, _, lo, hi] => Some(LossScaleState {
                scale: f32::from_bits(scale),
                clean_steps,
                growth_interval,
                skipped_steps: u64::from(lo) | (u64::from(hi) << 32),
            }),
            _ => None,
        }
    }
}

/// `ptx/fp16.ptx` with its declarations.
pub const MODULE: PtxModule = PtxModule {
    name: "fp16",
    file: "ptx/fp16.ptx",
    text: PTX,
    kernels: KERNELS,
};

#[cfg(feature = "cuda")]
pub use launchers::*;

#[cfg(feature = "cuda")]
mod launchers {
    use half::{bf16, f16};

    use super::{LossScaleState, MODULE};
    use crate::error::{check_len, kernel_count, Error, Result};
    use crate::memory::{AsDevSlice, AsDevSliceMut, DevSlice, DevSliceMut, Element, GpuBuffer};
    use crate::runtime::{Gpu, KernelArg, LaunchConfig};

    /// A device-side "some value was Inf or NaN" flag (one `u32`).
    ///
    /// Kernels only ever set it to 1; [`NonFiniteFlag::reset`] clears it. Reading it
    /// ([`NonFiniteFlag::is_set`]) waits for the queued work, so check it once per
    /// step (e.g. for dynamic loss scaling), not after every tensor.
    #[derive(Debug)]
    pub struct NonFiniteFlag {
        word: GpuBuffer<u32>,
    }

    impl NonFiniteFlag {
        /// A cleared flag on `gpu`.
        pub fn new(gpu: &Gpu) -> Result<NonFiniteFlag> {
            Ok(NonFiniteFlag {
                word: gpu.zeros(1)?,
            })
        }
        /// Queues clearing the flag.
        pub fn reset(&mut self) -> Result<()> {
            self.word.fill_bytes(0)
        }
        /// Waits for queued work and reads the flag.
        pub fn is_set(&self) -> Result<bool> {
            Ok(self.word.to_host()?[0] != 0)
        }
        fn view(&mut self) -> DevSliceMut<'_, u32> {
            self.word.as_mut_slice()
        }
    }

    /// A dynamic loss scale in device memory ([`LossScaleState`], six `u32` words).
    ///
    /// The casts [`f32_to_f16_loss_scaled`] and [`f16_to_f32_loss_unscaled`] read the
    /// scale where it lies and [`loss_scale_update`] changes it there; the host copies it
    /// only when asked ([`DeviceLossScale::read`], [`DeviceLossScale::write`]).
    #[derive(Debug)]
    pub struct DeviceLossScale {
        words: GpuBuffer<u32>,
    }

    impl DeviceLossScale {
        /// `state` uploaded to `gpu`.
        pub fn new(gpu: &Gpu, state: LossScaleState) -> Result<DeviceLossScale> {
            Ok(DeviceLossScale {
                words: gpu.upload(&state.to_words())?,
            })
        }
        /// Replaces the state with `state` (an upload).
        pub fn write(&mut self, state: LossScaleState) -> Result<()> {
            self.words.copy_from_host(&state.to_words())
        }
        /// Waits for queued work and downloads the state.
        pub fn read(&self) -> Result<LossScaleState> {
            let words = self.words.to_host()?;
            check_len("loss scale state", 6, words.len())?;
            LossScaleState::from_words(&words).ok_or(Error::ShapeMismatch {
                arg: "loss scale state",
                expected: 6,
                actual: words.len(),
            })
        }
        /// The scale's word, for the casts.
        fn scale(&self) -> Result<DevSlice<'_, u32>> {
            self.words.slice(0..1)
        }
    }

    /// One thread per 8-element vector.
    fn config(gpu: &Gpu, n: usize) -> LaunchConfig {
        gpu.grid_stride(n.div_ceil(8))
    }

    fn to_half<H: Element>(
        gpu: &Gpu,
        kernel: &'static str,
        src: &impl AsDevSlice<f32>,
        scale: f32,
        dst: &mut impl AsDevSliceMut<H>,
        flag: &mut NonFiniteFlag,
    ) -> Result<()> {
        let (src, dst) = (src.dev_slice(), dst.dev_slice_mut());
        check_len("dst", src.len(), dst.len())?;
        let n = kernel_count("n (elements)", src.len())?;
        if n == 0 {
            return Ok(());
        }
        let flag = flag.view();
        let args = [
            gpu.arg("src", &src)?,
            KernelArg::F32(scale),
            gpu.arg_mut("dst", &dst)?,
            gpu.arg_mut("flag", &flag)?,
            KernelArg::U32(n),
        ];
        // SAFETY: src and dst are live views of n elements on this GPU, dst is
        // borrowed mutably; the flag is a live one-word buffer.
        unsafe { gpu.launch(&MODULE, kernel, config(gpu, src.len()), &args) }
    }

    fn from_half<H: Element>(
        gpu: &Gpu,
        kernel: &'static str,
        src: &impl AsDevSlice<H>,
        inv_scale: f32,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        let (src, dst) = (src.dev_slice(), dst.dev_slice_mut());
        check_len("dst", src.len(), dst.len())?;
        let n = kernel_count("n (elements)", src.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg("src", &src)?,
            KernelArg::F32(inv_scale),
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(n),
        ];
        // SAFETY: src and dst are live views of n elements on this GPU, dst is
        // borrowed mutably.
        unsafe { gpu.launch(&MODULE, kernel, config(gpu, src.len()), &args) }
    }

    fn sum_into<H: Element>(
        gpu: &Gpu,
        kernel: &'static str,
        acc: &mut impl AsDevSliceMut<H>,
        src: &impl AsDevSlice<H>,
    ) -> Result<()> {
        let (acc, src) = (acc.dev_slice_mut(), src.dev_slice());
        check_len("src", acc.len(), src.len())?;
        let n = kernel_count("n (elements)", acc.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg_mut("acc", &acc)?,
            gpu.arg("src", &src)?,
            KernelArg::U32(n),
        ];
        // SAFETY: acc and src are live views of n elements on this GPU; acc is
        // borrowed mutably, so src cannot alias it.
        unsafe { gpu.launch(&MODULE, kernel, config(gpu, acc.len()), &args) }
    }

    /// `dst[i] = f16(src[i] * scale)`; sets `flag` when any `dst` element is Inf or NaN.
    pub fn f32_to_f16_scaled(
        gpu: &Gpu,
        src: &impl AsDevSlice<f32>,
        scale: f32,
        dst: &mut impl AsDevSliceMut<f16>,
        flag: &mut NonFiniteFlag,
    ) -> Result<()> {
        to_half(gpu, "f32_to_f16_scaled", src, scale, dst, flag)
    }

    /// `dst[i] = bf16(src[i] * scale)`; sets `flag` when any `dst` element is Inf or NaN.
    pub fn f32_to_bf16_scaled(
        gpu: &Gpu,
        src: &impl AsDevSlice<f32>,
        scale: f32,
        dst: &mut impl AsDevSliceMut<bf16>,
        flag: &mut NonFiniteFlag,
    ) -> Result<()> {
        to_half(gpu, "f32_to_bf16_scaled", src, scale, dst, flag)
    }

    /// `dst[i] = f32(src[i]) * inv_scale`.
    pub fn f16_to_f32_unscaled(
        gpu: &Gpu,
        src: &impl AsDevSlice<f16>,
        inv_scale: f32,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        from_half(gpu, "f16_to_f32_unscaled", src, inv_scale, dst)
    }

    /// `dst[i] = f32(src[i]) * inv_scale`.
    pub fn bf16_to_f32_unscaled(
        gpu: &Gpu,
        src: &impl AsDevSlice<bf16>,
        inv_scale: f32,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        from_half(gpu, "bf16_to_f32_unscaled", src, inv_scale, dst)
    }

    /// `acc[i] = f16(f32(acc[i]) + f32(src[i]))` (the all-reduce's f16 sum).
    pub fn sum_into_f16(
        gpu: &Gpu,
        acc: &mut impl AsDevSliceMut<f16>,
        src: &impl AsDevSlice<f16>,
    ) -> Result<()> {
        sum_into(gpu, "sum_into_f16", acc, src)
    }

    /// `acc[i] = bf16(f32(acc[i]) + f32(src[i]))`.
    pub fn sum_into_bf16(
        gpu: &Gpu,
        acc: &mut impl AsDevSliceMut<bf16>,
        src: &impl AsDevSlice<bf16>,
    ) -> Result<()> {
        sum_into(gpu, "sum_into_bf16", acc, src)
    }

    /// `dst[i] = f16(src[i] * (factor * scale))` with `scale` read from `loss_scale` on
    /// the device; sets `flag` when any `dst` element is Inf or NaN.
    pub fn f32_to_f16_loss_scaled(
        gpu: &Gpu,
        src: &impl AsDevSlice<f32>,
        factor: f32,
        loss_scale: &DeviceLossScale,
        dst: &mut impl AsDevSliceMut<f16>,
        flag: &mut NonFiniteFlag,
    ) -> Result<()> {
        let (src, dst) = (src.dev_slice(), dst.dev_slice_mut());
        check_len("dst", src.len(), dst.len())?;
        let n = kernel_count("n (elements)", src.len())?;
        if n == 0 {
            return Ok(());
        }
        let scale = loss_scale.scale()?;
        let flag = flag.view();
        let args = [
            gpu.arg("src", &src)?,
            KernelArg::F32(factor),
            gpu.arg("loss_scale", &scale)?,
            gpu.arg_mut("dst", &dst)?,
            gpu.arg_mut("flag", &flag)?,
            KernelArg::U32(n),
        ];
        // SAFETY: src and dst are live views of n elements on this GPU, dst is
        // borrowed mutably; the scale and the flag are live one-word buffers.
        unsafe {
            gpu.launch(
                &MODULE,
                "f32_to_f16_loss_scaled",
                config(gpu, src.len()),
                &args,
            )
        }
    }

    /// `dst[i] = f32(src[i]) * (factor / scale)` with `scale` read from `loss_scale` on
    /// the device.
    pub fn f16_to_f32_loss_unscaled(
        gpu: &Gpu,
        src: &impl AsDevSlice<f16>,
        factor: f32,
        loss_scale: &DeviceLossScale,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        let (src, dst) = (src.dev_slice(), dst.dev_slice_mut());
        check_len("dst", src.len(), dst.len())?;
        let n = kernel_count("n (elements)", src.len())?;
        if n == 0 {
            return Ok(());
        }
        let scale = loss_scale.scale()?;
        let args = [
            gpu.arg("src", &src)?,
            KernelArg::F32(factor),
            gpu.arg("loss_scale", &scale)?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(n),
        ];
        // SAFETY: src and dst are live views of n elements on this GPU, dst is
        // borrowed mutably; the scale is a live one-word buffer.
        unsafe {
            gpu.launch(
                &MODULE,
                "f16_to_f32_loss_unscaled",
                config(gpu, src.len()),
                &args,
            )
        }
    }

    /// One step of dynamic loss scaling on the device: after an `overflow` (the step
    /// was skipped) the scale halves (not below 1), otherwise it doubles (not above
    /// `f32::MAX / 2`) once `growth_interval` clean steps have passed.
    pub fn loss_scale_update(
        gpu: &Gpu,
        loss_scale: &mut DeviceLossScale,
        overflow: bool,
    ) -> Result<()> {
        let words = loss_scale.words.as_mut_slice();
        let args = [
            gpu.arg_mut("state", &words)?,
            KernelArg::U32(u32::from(overflow)),
        ];
        let one = LaunchConfig {
            grid: (1, 1, 1),
            block: (1, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: the state is a live, mutably borrowed buffer of the six words the
        // kernel reads and writes.
        unsafe { gpu.launch(&MODULE, "loss_scale_update", one, &args) }
    }

    /// Sets `flag` when any element of `x` is Inf or NaN.
    pub fn has_non_finite_f32(
        gpu: &Gpu,
        x: &impl AsDevSlice<f32>,
        flag: &mut NonFiniteFlag,
    ) -> Result<()> {
        let x = x.dev_slice();
        let n = kernel_count("n (elements)", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let flag = flag.view();
        let args = [
            gpu.arg("x", &x)?,
            gpu.arg_mut("flag", &flag)?,
            KernelArg::U32(n),
        ];
        // SAFETY: x is a live view of n elements on this GPU; flag a live word.
        unsafe {
            gpu.launch(
                &MODULE,
                "has_non_finite_f32",
                gpu.grid_stride(x.len().div_ceil(4)),
                &args,
            )
        }
    }
}
