//! [`GpuPipelineStage`]: one pipeline stage on the CUDA backend, updated on its device.
//!
//! The stage's model lives on its GPU (one per rank; ranks on a one-GPU machine share
//! device 0, as data-parallel runs do). Its micro-batches run there; the boundary
//! tensors between stages are staged device → host → device (downloaded after a pass,
//! sent point-to-point, uploaded by the neighbour's pass), as gradients are for the ring.
//! The stage's gradients are summed over the micro-batches on the device (an
//! accumulator the length of its parameter range); the optimizer's state (Adam's
//! moments) covers that range only and lives on the device too, and the clipping and the
//! update run there ([`DeviceResident`]). The squared norm of the stage's gradients comes
//! to the host as one scalar for the global norm the stages sum on the control plane.
//!
//! Only with D > 1 replicas does the summed gradient leave the device, as the
//! data-parallel GPU path's gradients do (the pieces are shared,
//! `crate::trainable::device_exchange`): once device → pinned host exchange buffer,
//! where the replicas' reduction sums it in place (no other host copy), and once back
//! before the update. With f16 gradients the cast runs on the device before the copy,
//! multiplied by the dynamic loss scale, which lives on the device too
//! ([`DeviceResident::start_loss_scaler`]): the cast sets the device's non-finite flag
//! (every rank, all stages and replicas, agrees on the flags and skips together), the
//! reduced sum is cast back and unscaled on the device, and the update applies the
//! agreed outcome to the scale there, so no step moves the scale between host and device.
//!
//! The host parameter buffer (whole, as the model's flat buffer on the device is) is
//! filled only for the initial broadcast, a resume, checkpoints and the end of the run.

use std::ops::Range;

use half::f16;
use ringtrain_cuda::optim as device_optim;
use ringtrain_cuda::{DeviceLossScale, Gpu, GpuBuffer, NonFiniteFlag};
use ringtrain_model::CudaBackend;

use super::stage::{held_out_not_pipelined, StageRunner};
use super::{StageInfo, StageTimes, StagesOnBatch};
use crate::config::{OptimizerKind, ValidatedConfig};
use crate::error::{gpu_err, Error, Result};
use crate::optimizer::{LossScaler, OptimizerState};
use crate::strategy::Wire;
use crate::trainable::device_exchange::{
    cast_back_from_wire, cast_to_wire, missing, read_loss_scale, start_loss_scale, step_loss_scale,
    PinnedCopies,
};
use crate::trainable::{
    param_specs, Batch, DeviceOptimizer, DeviceResident, DeviceUpdate, ExchangeCallback, HostGrads,
    HostGradsMut, ParamSpec, PassOutput, ReadyCallback, TrainableModel,
};

/// One pipeline stage on the GPU (see the `pipeline::device` module docs).
pub struct GpuPipelineStage<M: StagesOnBatch> {
    model: M,
    runner: StageRunner<M>,
    gpu: Gpu,
    specs: Vec<ParamSpec>,
    description: String,
    /// The stage's gradients summed over the micro-batches (its range's length).
    acc: GpuBuffer<f32>,
    /// `acc` cast to f16 for the wire (allocated on first use).
    half: Option<GpuBuffer<f16>>,
    /// The pinned host exchange buffers the replicas reduce in place (allocated on first
    /// use).
    host_f32: Option<PinnedCopies<f32>>,
    host_f16: Option<PinnedCopies<f16>>,
    /// The wire of the last pass's copy to the host, until the reduced values are back
    /// on the device (`None`: nothing is on the host to bring back).
    exchanged: Option<Wire>,
    /// The last pass cast its gradients to f16 (the loss scale takes the step's outcome).
    last_half: bool,
    /// The device's "a value was Inf or NaN" flag of the f16 cast.
    flag: NonFiniteFlag,
    /// The dynamic loss scale of f16 gradients (from [`DeviceResident::start_loss_scaler`]).
    loss_scale: Option<DeviceLossScale>,
    norm_sq: GpuBuffer<f64>,
    /// The optimizer's state on the device, for the stage's own parameter range.
    optimizer: Option<DeviceOptimizer>,
    params_host: Vec<f32>,
    /// The host parameters changed since they were last copied to the device.
    params_dirty: bool,
    /// The device parameters changed since they were last copied to the host.
    host_stale: bool,
}

impl<M> GpuPipelineStage<M>
where
    M: StagesOnBatch<Backend = CudaBackend> + Send,
{
    /// Stage `cfg.pipeline_stage(comm.rank())` of `model` (on its GPU), exchanging
    /// boundary tensors with its neighbours over `comm`, balanced by `unit_costs` (see
    /// [`super::PipelineTrainable::new`]).
    ///
    /// # Errors
    /// `InvalidValue` when the stages do not fit the model's units; GPU errors.
    pub fn new(
        model: M,
        comm: ringtrain_collective::Communicator,
        cfg: &ValidatedConfig,
        description: String,
        unit_costs: Option<&[f64]>,
    ) -> Result<Self> {
        let runner = StageRunner::new(&model, comm, cfg, unit_costs)?;
        let own = runner.info().own_params();
        let gpu = model.backend().gpu().clone();
        let params_host = model.params().to_host().map_err(gpu_err)?;
        Ok(GpuPipelineStage {
            specs: param_specs(model.layout()),
            acc: gpu.zeros::<f32>(own.len()).map_err(gpu_err)?,
            norm_sq: gpu.zeros::<f64>(1).map_err(gpu_err)?,
            half: None,
            host_f32: None,
            host_f16: None,
            exchanged: None,
            last_half: false,
            flag: NonFiniteFlag::new(&gpu).map_err(gpu_err)?,
            loss_scale: None,
            optimizer: None,
            params_host,
            params_dirty: false,
            host_stale: false,
            model,
            runner,
            gpu,
            description,
        })
    }

    fn own(&self) -> Range<usize> {
        self.runner.info().own_params()
    }

    /// Copies the host parameters to the device when they changed.
    fn upload_params(&mut self) -> Result<()> {
        if self.params_dirty {
            self.model
                .params_mut()
                .copy_from_host(&self.params_host)
                .map_err(gpu_err)?;
            self.params_dirty = false;
        }
        Ok(())
    }

    /// Brings the replicas' reduced gradients back to the device, once (an f16 wire's
    /// cast back to f32 there, divided by the loss scale: `acc` then carries the wire's
    /// own factor only, as the host's f32 sum would).
    fn upload_exchanged(&mut self) -> Result<()> {
        let Some(wire) = self.exchanged.take() else {
            return Ok(());
        };
        let n = self.acc.len();
        match wire {
            Wire::F32 => {
                let copies = self
                    .host_f32
                    .as_mut()
                    .ok_or_else(|| missing("f32 exchange buffer"))?;
                copies
                    .host
                    .upload_async(0..n, &mut self.acc)
                    .map_err(gpu_err)?;
                copies.host.wait_all().map_err(gpu_err)?;
            }
            Wire::F16 { .. } => {
                let half = self.half.as_mut().ok_or_else(|| missing("f16 buffer"))?;
                let copies = self
                    .host_f16
                    .as_mut()
                    .ok_or_else(|| missing("f16 exchange buffer"))?;
                copies.host.upload_async(0..n, half).map_err(gpu_err)?;
                cast_back_from_wire(
                    &self.gpu,
                    half,
                    1.0,
                    self.loss_scale.as_ref(),
                    &mut self.acc,
                )?;
                // The next pass may write the buffer again only once the copy read it.
                copies.host.wait_all().map_err(gpu_err)?;
            }
        }
        Ok(())
    }

    /// The pass's tail with replicas: `acc` cast for `wire` on the device, copied once
    /// into the pinned exchange buffer and handed to `on_ready` (as the stage's own
    /// range) once landed.
    fn copy_to_host(&mut self, wire: Wire, on_ready: &mut ExchangeCallback<'_>) -> Result<()> {
        let own = self.own();
        let n = own.len();
        let gpu = self.gpu.clone();
        match wire {
            Wire::F16 { scale } => {
                if self.half.is_none() {
                    self.half = Some(gpu.alloc::<f16>(n).map_err(gpu_err)?);
                }
                if self.host_f16.is_none() {
                    self.host_f16 = Some(PinnedCopies::new(&gpu, n)?);
                }
                let half = self.half.as_mut().ok_or_else(|| missing("f16 buffer"))?;
                // The wire's factor times the loss scale, read on the device.
                let loss_scale = self.loss_scale.as_ref();
                cast_to_wire(&gpu, &self.acc, scale, loss_scale, half, &mut self.flag)?;
                let copies = self
                    .host_f16
                    .as_mut()
                    .ok_or_else(|| missing("f16 exchange buffer"))?;
                copies.pending.clear();
                copies.start(0..n, half)?;
                copies.hand_over(true, &mut |_, g| on_ready(own.clone(), HostGrads::F16(g)))
            }
            Wire::F32 => {
                if self.host_f32.is_none() {
                    self.host_f32 = Some(PinnedCopies::new(&gpu, n)?);
                }
                let copies = self
                    .host_f32
                    .as_mut()
                    .ok_or_else(|| missing("f32 exchange buffer"))?;
                copies.pending.clear();
                copies.start(0..n, &self.acc)?;
                copies.hand_over(true, &mut |_, g| on_ready(own.clone(), HostGrads::F32(g)))
            }
        }
    }

    fn stage_optimizer(&mut self) -> Result<&mut DeviceOptimizer> {
        self.optimizer.as_mut().ok_or_else(|| {
            Error::Internal("the stage's device optimizer was used before it started".into())
        })
    }

    /// The length of the state the stage's optimizer holds (its own range): for tests
    /// and checks.
    pub fn optimizer_len(&self) -> Option<usize> {
        self.optimizer.as_ref().map(DeviceOptimizer::state_len)
    }
}

impl<M> DeviceResident for GpuPipelineStage<M>
where
    M: StagesOnBatch<Backend = CudaBackend> + Send,
{
    fn start_optimizer(&mut self, kind: OptimizerKind, learning_rate: f32) -> Result<()> {
        let n = self.own().len();
        self.optimizer = Some(DeviceOptimizer::new(&self.gpu, kind, learning_rate, n)?);
        Ok(())
    }

    fn start_loss_scaler(&mut self, scaler: LossScaler) -> Result<bool> {
        start_loss_scale(&self.gpu, &mut self.loss_scale, scaler)?;
        Ok(true)
    }

    fn loss_scaler(&mut self) -> Result<Option<LossScaler>> {
        read_loss_scale(self.loss_scale.as_ref())
    }

    /// The stage's passes; the summed gradients stay on the device unless `to_host`
    /// (replicas), when they are cast for `wire` on the device and copied once into the
    /// pinned exchange buffer (see the module docs).
    fn forward_backward_exchanging(
        &mut self,
        batch: &Batch,
        wire: Wire,
        to_host: bool,
        on_ready: &mut ExchangeCallback<'_>,
    ) -> Result<PassOutput> {
        self.upload_params()?;
        self.exchanged = None;
        self.last_half = false;
        self.flag.reset().map_err(gpu_err)?;
        let out = self.runner.run(&mut self.model, batch, &mut self.acc)?;
        if to_host {
            self.last_half = matches!(wire, Wire::F16 { .. });
            let copied = self.copy_to_host(wire, on_ready);
            // Whatever `on_ready` did, the copy has landed: the update brings it back.
            self.exchanged = Some(wire);
            copied?;
        }
        Ok(out)
    }

    fn cast_overflowed(&mut self) -> Result<bool> {
        if !self.last_half {
            return Ok(false);
        }
        let set = self.flag.is_set().map_err(gpu_err)?;
        self.flag.reset().map_err(gpu_err)?;
        Ok(set)
    }

    fn exchanged_grads(&mut self) -> Result<HostGradsMut<'_>> {
        let not_copied =
            || Error::Internal("the last pass did not copy its gradients to the host".into());
        let unsettled = || {
            Error::Internal(
                "the stage's pinned exchange buffer was read while a copy into it was in flight"
                    .into(),
            )
        };
        match self.exchanged {
            Some(Wire::F32) => {
                let copies = self.host_f32.as_mut().ok_or_else(not_copied)?;
                let host = copies.host.settled_mut().ok_or_else(unsettled)?;
                Ok(HostGradsMut::F32(host))
            }
            Some(Wire::F16 { .. }) => {
                let copies = self.host_f16.as_mut().ok_or_else(not_copied)?;
                let host = copies.host.settled_mut().ok_or_else(unsettled)?;
                Ok(HostGradsMut::F16(host))
            }
            None => Err(not_copied()),
        }
    }

    fn gradient_sum_of_squares(&mut self) -> Result<f64> {
        self.upload_exchanged()?;
        self.norm_sq.fill_bytes(0).map_err(gpu_err)?;
        device_optim::sum_of_squares(&self.gpu, &self.acc, &mut self.norm_sq).map_err(gpu_err)?;
        let sq = self.norm_sq.to_host().map_err(gpu_err)?;
        Ok(sq.first().copied().unwrap_or(0.0))
    }

    fn update(
        &mut self,
        correction: f32,
        max_gradient_norm: f32,
        skip: bool,
    ) -> Result<DeviceUpdate> {
        self.upload_exchanged()?;
        // The loss scale takes the outcome every rank agreed on.
        let loss_scale = self.loss_scale.as_mut().filter(|_| self.last_half);
        if skip {
            step_loss_scale(&self.gpu, loss_scale, true)?;
            return Ok(DeviceUpdate {
                skipped: true,
                grad_norm: 0.0,
            });
        }
        let gpu = self.gpu.clone();
        if correction != 1.0 {
            device_optim::scale_f32(&gpu, &mut self.acc, correction).map_err(gpu_err)?;
        }
        let mut grad_norm = 0.0;
        if max_gradient_norm > 0.0 {
            self.norm_sq.fill_bytes(0).map_err(gpu_err)?;
            device_optim::sum_of_squares(&gpu, &self.acc, &mut self.norm_sq).map_err(gpu_err)?;
            device_optim::scale_by_clip_factor(
                &gpu,
                &mut self.acc,
                &self.norm_sq,
                max_gradient_norm,
            )
            .map_err(gpu_err)?;
            let sq = self.norm_sq.to_host().map_err(gpu_err)?;
            grad_norm = sq.first().copied().unwrap_or(0.0).sqrt();
        }
        let own = self.own();
        let optimizer = self.optimizer.as_mut().ok_or_else(|| {
            Error::Internal("a device-resident update before start_optimizer".into())
        })?;
        let mut params = self.model.params_mut().slice_mut(own).map_err(gpu_err)?;
        optimizer.apply(&gpu, &mut params, &self.acc)?;
        let loss_scale = self.loss_scale.as_mut().filter(|_| self.last_half);
        step_loss_scale(&gpu, loss_scale, false)?;
        self.host_stale = true;
        Ok(DeviceUpdate {
            skipped: false,
            grad_norm,
        })
    }

    /// This stage's own state (the length of its range).
    fn optimizer_state(&mut self) -> Result<OptimizerState> {
        self.stage_optimizer()?.state()
    }

    /// Loads this stage's own state (the length of its range).
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()> {
        self.stage_optimizer()?.load_state(state, "stage")
    }

    fn download_params(&mut self) -> Result<()> {
        if self.host_stale {
            self.params_host = self.model.params().to_host().map_err(gpu_err)?;
            self.host_stale = false;
        }
        Ok(())
    }
}

impl<M> TrainableModel for GpuPipelineStage<M>
where
    M: StagesOnBatch<Backend = CudaBackend> + Send,
{
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    fn params(&self) -> Result<&[f32]> {
        if self.host_stale {
            return Err(Error::Internal(
                "the device holds newer parameters: download them first (DeviceResident::download_params)".into(),
            ));
        }
        Ok(&self.params_host)
    }
    fn params_mut(&mut self) -> Result<&mut [f32]> {
        self.download_params()?;
        self.params_dirty = true;
        Ok(&mut self.params_host)
    }
    fn params_and_grads_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        Err(Error::Internal(
            "the stage keeps its gradients on the device: it is updated there (DeviceResident::update)".into(),
        ))
    }
    /// The stage's passes, its summed gradients handed on (as its own range) once
    /// copied to the host.
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        self.forward_backward_exchanging(batch, Wire::F32, true, &mut |r, g| match g {
            HostGrads::F32(g) => on_ready(r, g),
            HostGrads::F16(_) => Err(Error::Internal(
                "a pipeline stage hands on f32 gradients".into(),
            )),
        })
    }
    fn evaluate(&mut self, _batches: &[Batch]) -> Result<PassOutput> {
        Err(held_out_not_pipelined())
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
    fn pipeline_stage(&self) -> Option<(StageInfo, StageTimes)> {
        Some((self.runner.info().clone(), self.runner.times()))
    }
    fn device_resident(&mut self) -> Option<&mut dyn DeviceResident> {
        Some(self)
    }
}
