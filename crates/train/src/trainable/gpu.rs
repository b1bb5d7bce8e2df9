//! [`GpuTrainable`]: a model of the model crate on the CUDA backend.
//!
//! **Device-resident (every strategy but `parameter_server`).** Parameters, gradients
//! and the optimizer's state (Adam's moments) live on the GPU; the global-norm clip, the
//! non-finite check of f16 gradients and the update run there as the kernels of
//! `ptx/optim.ptx` and `ptx/fp16.ptx` ([`DeviceResident`]). With f16 gradients the
//! dynamic loss scale lives on the device too: the casts read it there and a kernel
//! halves or doubles it after each update ([`DeviceLossScale`]). Per step the host sends
//! the batch and reads back a few scalars (the loss, the non-finite flag, the gradient
//! norm). With several ranks each gradient range backward finishes is cast for the wire
//! on the device (f16 with `--fp16-gradients`), copied once into a page-locked host
//! exchange buffer ([`PinnedBuffer`]) on the GPU's copy stream while backward goes on,
//! reduced there in place by the ring, and copied back once before the update. The host
//! parameter buffer is filled only for the initial broadcast, a resume, checkpoints and
//! the end of the run ([`DeviceResident::download_params`]).
//!
//! **Host mirrors (`parameter_server`).** The parameter servers apply the optimizer on
//! the host to the shards they own, so this mode keeps pinned host mirrors of the
//! parameters and gradients: each final gradient range is copied to the host on the copy
//! stream as backward finishes it, and the parameters the host changed are copied up
//! ahead of the next pass's kernels.
//!
//! In both modes ranges are handed on in the order backward finished them once their
//! copies have landed, and every copy has finished when a pass returns, also after an
//! error; were a mirror ever not settled, its accessors return [`Error::Internal`].

use std::ops::Range;
use std::time::{Duration, Instant};

use half::f16;
use ringtrain_cuda::optim as device_optim;
use ringtrain_cuda::{
    fp16 as device_fp16, DeviceLossScale, Gpu, GpuBuffer, NonFiniteFlag, PinnedBuffer, StreamMark,
};
use ringtrain_model::{Backend, CudaBackend, Model};

use super::device_exchange::{
    cast_back_from_wire, cast_to_wire, missing, read_loss_scale, start_loss_scale, step_loss_scale,
    PinnedCopies,
};
use super::pass::{run_forward, run_pass, Delivery};
use super::staging::TrainsOnBatch;
use super::{
    param_specs, Batch, DeviceOptimizer, DeviceResident, DeviceSpan, DeviceUpdate,
    ExchangeCallback, HostGrads, HostGradsMut, ParamSpec, PassOutput, ReadyCallback,
    TrainableModel,
};
use crate::config::OptimizerKind;
use crate::error::{gpu_err, Error, Result};
use crate::optimizer::{LossScaler, OptimizerState};
use crate::strategy::Wire;

/// A model on the CUDA backend, updated on the device or (for the parameter servers)
/// through pinned host mirrors.
pub struct GpuTrainable<M> {
    model: M,
    specs: Vec<ParamSpec>,
    description: String,
    gpu: Gpu,
    params_host: PinnedBuffer<f32>,
    /// The host parameters changed since they were last copied to the device.
    params_dirty: bool,
    /// The device parameters changed since they were last copied to the host.
    host_stale: bool,
    mode: Mode,
    /// CUDA-event marks of a timeline (`None`: nothing is timed).
    timing: Option<Box<DeviceTiming>>,
}

/// Marks of the device work of one step, for [`DeviceResident::take_device_spans`].
#[derive(Default)]
struct DeviceTiming {
    /// A mark at the start of the pass (the device idle) and the host time it was taken.
    anchor: Option<(StreamMark, Instant)>,
    /// What ran between two marks.
    spans: Vec<(String, StreamMark, StreamMark, serde_json::Value)>,
}

impl DeviceTiming {
    /// A mark on the compute stream, only when timing.
    fn mark(timing: &Option<Box<DeviceTiming>>, gpu: &Gpu) -> Result<Option<StreamMark>> {
        match timing {
            Some(_) => Ok(Some(StreamMark::on_compute(gpu).map_err(gpu_err)?)),
            None => Ok(None),
        }
    }

    /// Records `name` from `start` to `end` (both given only when timing).
    fn span(
        timing: &mut Option<Box<DeviceTiming>>,
        name: &str,
        start: Option<StreamMark>,
        end: Option<StreamMark>,
        args: serde_json::Value,
    ) {
        if let (Some(t), Some(start), Some(end)) = (timing.as_mut(), start, end) {
            t.spans.push((name.to_owned(), start, end, args));
        }
    }
}

/// Where the update runs.
enum Mode {
    /// On the host, through the pinned gradient mirror.
    HostMirrors(PinnedCopies<f32>),
    /// On the device.
    Resident(Box<ResidentState>),
}

/// The device-resident update's buffers.
struct ResidentState {
    optimizer: Option<DeviceOptimizer>,
    /// The device's "a value was Inf or NaN" flag (f16 cast, gradient check).
    flag: NonFiniteFlag,
    /// The squared global gradient norm, accumulated on the device.
    norm_sq: GpuBuffer<f64>,
    /// The dynamic loss scale of f16 gradients (from [`DeviceResident::start_loss_scaler`]).
    loss_scale: Option<DeviceLossScale>,
    /// The gradients cast to f16 for the wire (allocated on first use).
    half: Option<GpuBuffer<f16>>,
    /// The host exchange buffers (allocated on first use).
    host_f32: Option<PinnedCopies<f32>>,
    host_f16: Option<PinnedCopies<f16>>,
    /// How the last pass's gradients left backward: the wire, and whether to the host.
    last: Option<(Wire, bool)>,
}

/// A pinned mirror that an in-flight copy makes unreadable: a bug of this adapter.
fn unsettled(mirror: &str) -> Error {
    Error::Internal(format!(
        "the pinned {mirror} mirror was read while a copy into it was in flight"
    ))
}

impl Delivery<GpuBuffer<f32>> for PinnedCopies<f32> {
    fn finished(
        &mut self,
        range: Range<usize>,
        grads: &GpuBuffer<f32>,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<()> {
        self.start(range, grads)?;
        self.hand_over(false, &mut |r, g| on_ready(r, g))
    }

    fn drain(&mut self, on_ready: &mut ReadyCallback<'_>) -> Result<()> {
        self.hand_over(true, &mut |r, g| on_ready(r, g))
    }
}

/// The device-resident pass's delivery: casts each final range for the wire and, when
/// the gradients are exchanged, copies it to the host buffer and hands it on once landed.
struct Exchanging<'s, 'c, 'cb> {
    gpu: &'s Gpu,
    wire: Wire,
    to_host: bool,
    flag: &'s mut NonFiniteFlag,
    loss_scale: Option<&'s DeviceLossScale>,
    half: Option<&'s mut GpuBuffer<f16>>,
    host_f32: Option<&'s mut PinnedCopies<f32>>,
    host_f16: Option<&'s mut PinnedCopies<f16>>,
    on_ready: &'c mut ExchangeCallback<'cb>,
}

impl Exchanging<'_, '_, '_> {
    fn hand_over(&mut self, block: bool) -> Result<()> {
        let on_ready = &mut *self.on_ready;
        if let Some(copies) = self.host_f32.as_deref_mut() {
            copies.hand_over(block, &mut |r, g| on_ready(r, HostGrads::F32(g)))?;
        }
        if let Some(copies) = self.host_f16.as_deref_mut() {
            copies.hand_over(block, &mut |r, g| on_ready(r, HostGrads::F16(g)))?;
        }
        Ok(())
    }
}

impl Delivery<GpuBuffer<f32>> for Exchanging<'_, '_, '_> {
    fn finished(
        &mut self,
        range: Range<usize>,
        grads: &GpuBuffer<f32>,
        _on_ready: &mut ReadyCallback<'_>,
    ) -> Result<()> {
        match self.wire {
            Wire::F16 { scale } => {
                let half = self
                    .half
                    .as_deref_mut()
                    .ok_or_else(|| missing("f16 buffer"))?;
                let src = grads.slice(range.clone()).map_err(gpu_err)?;
                let mut dst = half.slice_mut(range.clone()).map_err(gpu_err)?;
                // The wire's factor times the loss scale, read on the device.
                cast_to_wire(self.gpu, &src, scale, self.loss_scale, &mut dst, self.flag)?;
                if self.to_host {
                    let copies = self
                        .host_f16
                        .as_deref_mut()
                        .ok_or_else(|| missing("f16 exchange buffer"))?;
                    copies.start(range, half)?;
                }
            }
            Wire::F32 => {
                if self.to_host {
                    let copies = self
                        .host_f32
                        .as_deref_mut()
                        .ok_or_else(|| missing("f32 exchange buffer"))?;
                    copies.start(range, grads)?;
                }
            }
        }
        self.hand_over(false)
    }

    fn drain(&mut self, _on_ready: &mut ReadyCallback<'_>) -> Result<()> {
        self.hand_over(true)
    }
}

impl<M: Model<Backend = CudaBackend>> GpuTrainable<M> {
    /// Wraps `model` for the device-resident update (`resident`), or with host mirrors
    /// for an update on the host (`parameter_server`); reads the initial parameters into
    /// the host buffer.
    ///
    /// # Errors
    /// GPU errors of the allocations or the copy.
    pub fn new(model: M, description: String, resident: bool) -> Result<Self> {
        let specs = param_specs(model.layout());
        let total = model.layout().total_len();
        let gpu = model.backend().gpu().clone();
        let mut params_host = gpu.pinned::<f32>(total).map_err(gpu_err)?;
        model.backend().download(
            model.params(),
            0,
            params_host.as_mut_slice().map_err(gpu_err)?,
        )?;
        let mode = if resident {
            Mode::Resident(Box::new(ResidentState {
                optimizer: None,
                flag: NonFiniteFlag::new(&gpu).map_err(gpu_err)?,
                norm_sq: gpu.zeros::<f64>(1).map_err(gpu_err)?,
                loss_scale: None,
                half: None,
                host_f32: None,
                host_f16: None,
                last: None,
            }))
        } else {
            Mode::HostMirrors(PinnedCopies::new(&gpu, total)?)
        };
        Ok(GpuTrainable {
            model,
            specs,
            description,
            gpu,
            params_host,
            params_dirty: false,
            host_stale: false,
            mode,
            timing: None,
        })
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.model
    }
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> GpuTrainable<M> {
    /// Queues the copy of the host parameters to the device when they changed since
    /// the last one (ahead of the next kernels on the compute stream).
    fn upload_params(&mut self) -> Result<()> {
        if self.params_dirty {
            let n = self.params_host.len();
            self.params_host
                .upload_async(0..n, self.model.params_mut())
                .map_err(gpu_err)?;
            self.params_dirty = false;
        }
        Ok(())
    }

    /// Waits for every copy of the pinned buffers; the first error of `result` wins.
    fn settle<T>(&mut self, result: Result<T>) -> Result<T> {
        let mut settled = self.params_host.wait_all().map_err(gpu_err);
        let mut wait = |host: Option<&mut PinnedBuffer<f32>>| {
            if let (Some(h), Ok(())) = (host, &settled) {
                settled = h.wait_all().map_err(gpu_err);
            }
        };
        match &mut self.mode {
            Mode::HostMirrors(copies) => wait(Some(&mut copies.host)),
            Mode::Resident(state) => {
                wait(state.host_f32.as_mut().map(|c| &mut c.host));
                if let (Some(c), Ok(())) = (state.host_f16.as_mut(), &settled) {
                    settled = c.host.wait_all().map_err(gpu_err);
                }
            }
        }
        let output = result?;
        settled?;
        Ok(output)
    }

    fn resident(&mut self) -> Result<&mut ResidentState> {
        match &mut self.mode {
            Mode::Resident(state) => Ok(state),
            Mode::HostMirrors(_) => Err(Error::Internal(
                "the model keeps host mirrors: it is updated on the host".into(),
            )),
        }
    }

    /// One device-resident pass; copies may still be in flight when it returns early.
    fn resident_pass(
        &mut self,
        batch: &Batch,
        wire: Wire,
        to_host: bool,
        on_ready: &mut ExchangeCallback<'_>,
    ) -> Result<PassOutput> {
        self.upload_params()?;
        let n = self.params_host.len();
        let gpu = self.gpu.clone();
        // The anchor of the step's device times: the device is idle here (the last
        // update ended with a read of its result, and no copy outlives a pass).
        if let Some(t) = self.timing.as_mut() {
            t.spans.clear();
            t.anchor = Some((
                StreamMark::on_compute(&gpu).map_err(gpu_err)?,
                Instant::now(),
            ));
        }
        let timed = self.timing.is_some();
        let pass_start = DeviceTiming::mark(&self.timing, &gpu)?;
        let Mode::Resident(state) = &mut self.mode else {
            return Err(missing("device-resident state"));
        };
        state.last = None;
        state.flag.reset().map_err(gpu_err)?;
        let half = matches!(wire, Wire::F16 { .. });
        if half && state.half.is_none() {
            state.half = Some(gpu.alloc::<f16>(n).map_err(gpu_err)?);
        }
        if to_host && !half && state.host_f32.is_none() {
            state.host_f32 = Some(PinnedCopies::new(&gpu, n)?);
        }
        if to_host && half && state.host_f16.is_none() {
            state.host_f16 = Some(PinnedCopies::new(&gpu, n)?);
        }
        for pending in [
            state.host_f32.as_mut().map(|c| &mut c.pending),
            state.host_f16.as_mut().map(|c| &mut c.pending),
        ]
        .into_iter()
        .flatten()
        {
            pending.clear();
        }
        for copies in [state.host_f32.as_mut().map(|c| &mut c.timed)]
            .into_iter()
            .chain([state.host_f16.as_mut().map(|c| &mut c.timed)])
            .flatten()
        {
            *copies = timed.then(Vec::new);
        }
        let ResidentState {
            flag,
            loss_scale,
            half: half_buf,
            host_f32,
            host_f16,
            ..
        } = &mut **state;
        let host_f32 = host_f32.as_mut().filter(|_| to_host && !half);
        let host_f16 = host_f16.as_mut().filter(|_| to_host && half);
        let mut delivery = Exchanging {
            gpu: &gpu,
            wire,
            to_host,
            flag,
            loss_scale: loss_scale.as_ref(),
            half: half_buf.as_mut().filter(|_| half),
            host_f32,
            host_f16,
            on_ready,
        };
        let model = &mut self.model;
        let output = run_pass(
            |ready| model.train_on(batch, ready),
            &mut delivery,
            &mut |_, _| Ok(()),
        )?;
        state.last = Some((wire, to_host));
        let pass_end = DeviceTiming::mark(&self.timing, &gpu)?;
        let args = serde_json::json!({ "launches": output.launches });
        DeviceTiming::span(
            &mut self.timing,
            "gpu forward+backward",
            pass_start,
            pass_end,
            args,
        );
        if let Some(t) = self.timing.as_mut() {
            let element_bytes = if half { 2 } else { 4 };
            let copies = state
                .host_f32
                .as_mut()
                .and_then(|c| c.timed.take())
                .into_iter()
                .chain(state.host_f16.as_mut().and_then(|c| c.timed.take()))
                .flatten();
            for (range, start, end) in copies {
                let args = serde_json::json!({
                    "elements": range.len(),
                    "bytes": range.len() * element_bytes,
                });
                let name = format!("d2h {}..{}", range.start, range.end);
                t.spans.push((name, start, end, args));
            }
        }
        Ok(output)
    }

    /// The update's device work; see [`DeviceResident::update`].
    fn resident_update(
        &mut self,
        correction: f32,
        max_gradient_norm: f32,
        skip: bool,
    ) -> Result<DeviceUpdate> {
        let gpu = self.gpu.clone();
        let update_start = DeviceTiming::mark(&self.timing, &gpu)?;
        let Mode::Resident(state) = &mut self.mode else {
            return Err(missing("device-resident state"));
        };
        let (wire, to_host) = state.last.take().ok_or_else(|| {
            Error::Internal("a device-resident update without a pass before it".into())
        })?;
        let half = matches!(wire, Wire::F16 { .. });
        let (params, grads) = self.model.params_and_grads_mut();
        let n = grads.len();
        // The correction still to apply after the cast back to f32.
        let mut correction = correction;
        match wire {
            Wire::F16 { .. } => {
                let half = state.half.as_mut().ok_or_else(|| missing("f16 buffer"))?;
                if to_host {
                    let copies = state
                        .host_f16
                        .as_mut()
                        .ok_or_else(|| missing("f16 exchange buffer"))?;
                    copies.host.upload_async(0..n, half).map_err(gpu_err)?;
                }
                // Back to f32 with the correction over the loss scale, read on the device.
                cast_back_from_wire(&gpu, half, correction, state.loss_scale.as_ref(), grads)?;
                correction = 1.0;
            }
            Wire::F32 => {
                if to_host {
                    let copies = state
                        .host_f32
                        .as_mut()
                        .ok_or_else(|| missing("f32 exchange buffer"))?;
                    copies.host.upload_async(0..n, grads).map_err(gpu_err)?;
                }
            }
        }
        // The host-to-device copy of the reduced gradients (with the f16 wire, and its
        // cast back to f32), then the update from there.
        let update_from = if to_host && self.timing.is_some() {
            let copied = DeviceTiming::mark(&self.timing, &gpu)?;
            let element_bytes = if matches!(wire, Wire::F16 { .. }) {
                2
            } else {
                4
            };
            let args = serde_json::json!({ "bytes": n * element_bytes });
            DeviceTiming::span(&mut self.timing, "h2d", update_start, copied, args);
            DeviceTiming::mark(&self.timing, &gpu)?
        } else {
            update_start
        };
        state.flag.reset().map_err(gpu_err)?;
        device_fp16::has_non_finite_f32(&gpu, grads, &mut state.flag).map_err(gpu_err)?;
        if skip || state.flag.is_set().map_err(gpu_err)? {
            step_loss_scale(&gpu, state.loss_scale.as_mut().filter(|_| half), true)?;
            let end = DeviceTiming::mark(&self.timing, &gpu)?;
            let args = serde_json::json!({ "skipped": true });
            DeviceTiming::span(&mut self.timing, "gpu update", update_from, end, args);
            return Ok(DeviceUpdate {
                skipped: true,
                grad_norm: 0.0,
            });
        }
        if correction != 1.0 {
            device_optim::scale_f32(&gpu, grads, correction).map_err(gpu_err)?;
        }
        state.norm_sq.fill_bytes(0).map_err(gpu_err)?;
        device_optim::sum_of_squares(&gpu, grads, &mut state.norm_sq).map_err(gpu_err)?;
        if max_gradient_norm > 0.0 {
            device_optim::scale_by_clip_factor(&gpu, grads, &state.norm_sq, max_gradient_norm)
                .map_err(gpu_err)?;
        }
        let optimizer = state.optimizer.as_mut().ok_or_else(|| {
            Error::Internal("a device-resident update before start_optimizer".into())
        })?;
        optimizer.apply(&gpu, params, grads)?;
        step_loss_scale(&gpu, state.loss_scale.as_mut().filter(|_| half), false)?;
        self.host_stale = true;
        let end = DeviceTiming::mark(&self.timing, &gpu)?;
        let args = serde_json::json!({ "skipped": false });
        DeviceTiming::span(&mut self.timing, "gpu update", update_from, end, args);
        let norm_sq = state.norm_sq.to_host().map_err(gpu_err)?;
        Ok(DeviceUpdate {
            skipped: false,
            grad_norm: norm_sq.first().copied().unwrap_or(0.0).sqrt(),
        })
    }
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> DeviceResident for GpuTrainable<M> {
    fn start_optimizer(&mut self, kind: OptimizerKind, learning_rate: f32) -> Result<()> {
        let n = self.params_host.len();
        let optimizer = DeviceOptimizer::new(&self.gpu, kind, learning_rate, n)?;
        self.resident()?.optimizer = Some(optimizer);
        Ok(())
    }

    fn start_loss_scaler(&mut self, scaler: LossScaler) -> Result<bool> {
        let gpu = self.gpu.clone();
        let state = self.resident()?;
        start_loss_scale(&gpu, &mut state.loss_scale, scaler)?;
        Ok(true)
    }

    fn loss_scaler(&mut self) -> Result<Option<LossScaler>> {
        read_loss_scale(self.resident()?.loss_scale.as_ref())
    }

    fn forward_backward_exchanging(
        &mut self,
        batch: &Batch,
        wire: Wire,
        to_host: bool,
        on_ready: &mut ExchangeCallback<'_>,
    ) -> Result<PassOutput> {
        let result = self.resident_pass(batch, wire, to_host, on_ready);
        // No copy may outlive the pass: the ring reads and writes the buffers next.
        self.settle(result)
    }

    fn set_device_timing(&mut self, on: bool) {
        match (on, self.timing.is_some()) {
            (true, false) => self.timing = Some(Box::default()),
            (false, true) => self.timing = None,
            _ => {}
        }
    }

    fn take_device_spans(&mut self) -> Result<Vec<DeviceSpan>> {
        let Some(timing) = self.timing.as_mut() else {
            return Ok(Vec::new());
        };
        let spans = std::mem::take(&mut timing.spans);
        let Some((anchor, host)) = timing.anchor.take() else {
            return Ok(Vec::new());
        };
        let at = |mark: &StreamMark| -> Result<Instant> {
            let ms = mark.ms_since(&anchor).map_err(gpu_err)?;
            Ok(host + Duration::from_secs_f64(f64::from(ms.max(0.0)) / 1e3))
        };
        spans
            .into_iter()
            .map(|(name, start, end, args)| {
                Ok(DeviceSpan {
                    name,
                    start: at(&start)?,
                    end: at(&end)?,
                    args,
                })
            })
            .collect()
    }

    fn cast_overflowed(&mut self) -> Result<bool> {
        let state = self.resident()?;
        match state.last {
            Some((Wire::F16 { .. }, _)) => {
                let set = state.flag.is_set().map_err(gpu_err)?;
                state.flag.reset().map_err(gpu_err)?;
                Ok(set)
            }
            _ => Ok(false),
        }
    }

    fn exchanged_grads(&mut self) -> Result<HostGradsMut<'_>> {
        let state = self.resident()?;
        let not_copied =
            || Error::Internal("the last pass did not copy its gradients to the host".into());
        match state.last {
            Some((Wire::F32, true)) => {
                let copies = state.host_f32.as_mut().ok_or_else(not_copied)?;
                let host = copies
                    .host
                    .settled_mut()
                    .ok_or_else(|| unsettled("gradient"))?;
                Ok(HostGradsMut::F32(host))
            }
            Some((Wire::F16 { .. }, true)) => {
                let copies = state.host_f16.as_mut().ok_or_else(not_copied)?;
                let host = copies
                    .host
                    .settled_mut()
                    .ok_or_else(|| unsettled("gradient"))?;
                Ok(HostGradsMut::F16(host))
            }
            _ => Err(not_copied()),
        }
    }

    fn update(
        &mut self,
        correction: f32,
        max_gradient_norm: f32,
        skip: bool,
    ) -> Result<DeviceUpdate> {
        let result = self.resident_update(correction, max_gradient_norm, skip);
        // The exchange buffers' uploads must have read them before the next pass.
        self.settle(result)
    }

    fn optimizer_state(&mut self) -> Result<OptimizerState> {
        let optimizer = self.resident()?.optimizer.as_ref().ok_or_else(|| {
            Error::Internal("the device optimizer's state was read before it started".into())
        })?;
        optimizer.state()
    }

    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        let optimizer = self.resident()?.optimizer.as_mut().ok_or_else(|| {
            Error::Internal("the device optimizer's state was loaded before it started".into())
        })?;
        optimizer.load_state(state, "model")
    }

    fn download_params(&mut self) -> Result<()> {
        if self.host_stale {
            let host = self.params_host.as_mut_slice().map_err(gpu_err)?;
            self.model
                .backend()
                .download(self.model.params(), 0, host)?;
            self.host_stale = false;
        }
        Ok(())
    }
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> TrainableModel for GpuTrainable<M> {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    fn params(&self) -> Result<&[f32]> {
        if self.host_stale {
            return Err(Error::Internal(
                "the device holds newer parameters: download them first (DeviceResident::download_params)".into(),
            ));
        }
        self.params_host
            .settled()
            .ok_or_else(|| unsettled("parameter"))
    }
    fn params_mut(&mut self) -> Result<&mut [f32]> {
        self.download_params()?;
        self.params_dirty = true;
        self.params_host
            .settled_mut()
            .ok_or_else(|| unsettled("parameter"))
    }
    fn params_and_grads_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        let Mode::HostMirrors(grads) = &mut self.mode else {
            return Err(Error::Internal(
                "the model keeps its gradients on the device: it is updated there (DeviceResident::update)".into(),
            ));
        };
        self.params_dirty = true;
        Ok((
            self.params_host
                .settled_mut()
                .ok_or_else(|| unsettled("parameter"))?,
            grads
                .host
                .settled_mut()
                .ok_or_else(|| unsettled("gradient"))?,
        ))
    }
    /// One pass: each final gradient range goes device → pinned host on the copy stream,
    /// then to `on_ready` (see the module docs).
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        if let Mode::Resident(_) = self.mode {
            return self.forward_backward_exchanging(batch, Wire::F32, true, &mut |r, g| match g {
                HostGrads::F32(g) => on_ready(r, g),
                HostGrads::F16(_) => Err(missing("f32 gradients")),
            });
        }
        let result = self.upload_params().and_then(|()| {
            let Mode::HostMirrors(grads) = &mut self.mode else {
                return Err(missing("host mirrors"));
            };
            grads.pending.clear();
            let model = &mut self.model;
            run_pass(|ready| model.train_on(batch, ready), grads, on_ready)
        });
        // No copy may outlive the pass: the trainer reads and writes both mirrors next.
        self.settle(result)
    }
    /// Forward only, after the parameter copy a change of the host parameters needs;
    /// the loss comes back to the host with the forward kernels.
    fn evaluate(&mut self, batches: &[Batch]) -> Result<PassOutput> {
        let result = self.upload_params().and_then(|()| {
            let model = &mut self.model;
            run_forward(|| model.held_out_loss(batches))
        });
        // The parameter copy must have landed before the trainer writes the buffer again.
        self.settle(result)
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
    fn device_resident(&mut self) -> Option<&mut dyn DeviceResident> {
        match self.mode {
            Mode::Resident(_) => Some(self),
            Mode::HostMirrors(_) => None,
        }
    }
}
