//! What every model that updates on its device shares for the gradient exchange (a
//! whole model, [`super::GpuTrainable`], and a pipeline stage, `GpuPipelineStage`): the
//! page-locked host exchange buffer its gradients are copied into once and reduced in
//! place ([`PinnedCopies`]), and the f16 wire whose dynamic loss scale lives on the
//! device ([`start_loss_scale`], [`cast_to_wire`], [`cast_back_from_wire`],
//! [`step_loss_scale`]).

use std::collections::VecDeque;
use std::ops::Range;

use half::f16;
use ringtrain_cuda::{
    fp16 as device_fp16, AsDevSlice, AsDevSliceMut, DeviceLossScale, Element, Gpu, GpuBuffer,
    LossScaleState, NonFiniteFlag, PinnedBuffer, StreamMark,
};

use crate::error::{gpu_err, Error, Result};
use crate::optimizer::LossScaler;

/// A buffer or state the exchange needs but was not set up: a bug of the adapter.
pub(crate) fn missing(what: &str) -> Error {
    Error::Internal(format!("the device-resident pass has no {what}"))
}

/// Takes a landed range of a pinned buffer.
pub(crate) type Deliver<'a, T> = dyn FnMut(Range<usize>, &mut [T]) -> Result<()> + 'a;

/// A pinned host buffer, and the ranges queued into it not yet handed over.
pub(crate) struct PinnedCopies<T: Element> {
    pub(crate) host: PinnedBuffer<T>,
    pub(crate) pending: VecDeque<Range<usize>>,
    /// Each copy's start and end marks on the copy stream (`None`: copies are not timed).
    pub(crate) timed: Option<Vec<(Range<usize>, StreamMark, StreamMark)>>,
}

impl<T: Element> PinnedCopies<T> {
    /// A pinned buffer of `len` elements on `gpu`, nothing queued.
    ///
    /// # Errors
    /// Device errors of the allocation.
    pub(crate) fn new(gpu: &Gpu, len: usize) -> Result<Self> {
        Ok(PinnedCopies {
            host: gpu.pinned::<T>(len).map_err(gpu_err)?,
            pending: VecDeque::new(),
            timed: None,
        })
    }

    /// Queues copying `src` (the device's `range`) into the host buffer.
    ///
    /// # Errors
    /// Device errors; a range outside either buffer.
    pub(crate) fn start(&mut self, range: Range<usize>, src: &GpuBuffer<T>) -> Result<()> {
        let view = src.slice(range.clone()).map_err(gpu_err)?;
        match self.timed.as_mut() {
            Some(marks) => {
                let timed = self
                    .host
                    .download_async_timed(range.clone(), &view)
                    .map_err(gpu_err)?;
                if let Some((start, end)) = timed {
                    marks.push((range.clone(), start, end));
                }
            }
            None => self
                .host
                .download_async(range.clone(), &view)
                .map_err(gpu_err)?,
        }
        self.pending.push_back(range);
        Ok(())
    }

    /// Hands the landed ranges at the front of `pending` to `deliver`, in order; with
    /// `block`, waits for each in turn until none is left.
    ///
    /// # Errors
    /// Device errors; the first error of `deliver`.
    pub(crate) fn hand_over(&mut self, block: bool, deliver: &mut Deliver<'_, T>) -> Result<()> {
        while let Some(front) = self.pending.front().cloned() {
            if !block && !self.host.is_ready(front.clone()).map_err(gpu_err)? {
                break;
            }
            self.pending.pop_front();
            let grads = self.host.wait_mut(front.clone()).map_err(gpu_err)?;
            deliver(front, grads)?;
        }
        Ok(())
    }
}

/// Keeps the dynamic loss scale in `slot` on the device from now on, starting from
/// `scaler` (a new one, or a checkpoint's): allocated on first use, overwritten after.
///
/// # Errors
/// Device errors.
pub(crate) fn start_loss_scale(
    gpu: &Gpu,
    slot: &mut Option<DeviceLossScale>,
    scaler: LossScaler,
) -> Result<()> {
    let on_device = LossScaleState {
        scale: scaler.scale,
        clean_steps: scaler.clean_steps,
        growth_interval: scaler.growth_interval,
        skipped_steps: scaler.skipped_steps,
    };
    match slot.as_mut() {
        Some(loss_scale) => loss_scale.write(on_device).map_err(gpu_err)?,
        None => *slot = Some(DeviceLossScale::new(gpu, on_device).map_err(gpu_err)?),
    }
    Ok(())
}

/// The loss scale kept on the device, downloaded; `None` when none is kept.
///
/// # Errors
/// Device errors.
pub(crate) fn read_loss_scale(loss_scale: Option<&DeviceLossScale>) -> Result<Option<LossScaler>> {
    let Some(loss_scale) = loss_scale else {
        return Ok(None);
    };
    let s = loss_scale.read().map_err(gpu_err)?;
    Ok(Some(LossScaler {
        scale: s.scale,
        clean_steps: s.clean_steps,
        growth_interval: s.growth_interval,
        skipped_steps: s.skipped_steps,
    }))
}

/// Casts `src` to f16 for the wire into `dst`: multiplied by the wire's `factor` times
/// the loss scale, read on the device; sets `flag` when a value is not finite in f16.
///
/// # Errors
/// Device errors; no loss scale on the device.
pub(crate) fn cast_to_wire(
    gpu: &Gpu,
    src: &impl AsDevSlice<f32>,
    factor: f32,
    loss_scale: Option<&DeviceLossScale>,
    dst: &mut impl AsDevSliceMut<f16>,
    flag: &mut NonFiniteFlag,
) -> Result<()> {
    let loss_scale = loss_scale.ok_or_else(|| missing("loss scale"))?;
    device_fp16::f32_to_f16_loss_scaled(gpu, src, factor, loss_scale, dst, flag).map_err(gpu_err)
}

/// Casts the (reduced) f16 gradients `half` back to f32 into `grads`, multiplied by
/// `correction` over the loss scale, read on the device.
///
/// # Errors
/// Device errors; no loss scale on the device.
pub(crate) fn cast_back_from_wire(
    gpu: &Gpu,
    half: &impl AsDevSlice<f16>,
    correction: f32,
    loss_scale: Option<&DeviceLossScale>,
    grads: &mut impl AsDevSliceMut<f32>,
) -> Result<()> {
    let loss_scale = loss_scale.ok_or_else(|| missing("loss scale"))?;
    device_fp16::f16_to_f32_loss_unscaled(gpu, half, correction, loss_scale, grads).map_err(gpu_err)
}

/// The loss scale on the device takes the step's outcome (the policy of
/// [`LossScaler::update`]): halved after a `skipped` step, doubled after enough clean
/// ones. Nothing when the device keeps no loss scale.
///
/// # Errors
/// Device errors.
pub(crate) fn step_loss_scale(
    gpu: &Gpu,
    loss_scale: Option<&mut DeviceLossScale>,
    skipped: bool,
) -> Result<()> {
    match loss_scale {
        Some(loss_scale) => {
            device_fp16::loss_scale_update(gpu, loss_scale, skipped).map_err(gpu_err)
        }
        None => Ok(()),
    }
}
