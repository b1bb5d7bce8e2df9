//! Variable-update strategies: who reduces the gradients, and who applies the update.
//!
//! - [`Replicated`]: every rank keeps all parameters; gradients are summed by all-reduce
//!   (overlapped with backward through the collective's fusion engine, or packed the
//!   tf_cnn_benchmarks way with `--gradient-repacking` / `--agg-small-grads-*`), and every
//!   rank applies the same update.
//! - [`ParameterServer`]: parameter tensors are placed greedily by size on server ranks;
//!   each owner receives the summed gradient of its tensors, averages it, applies the
//!   optimizer and sends the parameters back.
//! - [`Independent`]: no communication in the step (the ideal-scaling baseline).
//!
//! The step contract: the trainer gives the strategy one [`StepContext`] per step before
//! backward (how gradients travel), hands it each finished gradient range during
//! backward ([`Strategy::on_ready`]), then the buffers and this rank's figures at the end
//! ([`Strategy::finish_step`]). Gradient data moves on the strategy's communicator; the
//! step's figures are summed on the trainer's [`Control`] plane.
//!
//! A model that updates on its device ([`DeviceResident`], the GPU model) goes through
//! [`Strategy::on_exchanged`] and [`Strategy::finish_device_step`] instead: the strategy
//! reduces the host exchange buffer the model copied its gradients into, in place, and
//! the model applies the update on its device. `parameter_server` updates on the host
//! only (its servers apply the optimizer to the shards they own there), so the GPU
//! model keeps host mirrors under it.

use std::ops::Range;

use half::f16;
use ringtrain_collective::Communicator;
use ringtrain_kernels::GradScale;

use crate::config::{ValidatedConfig, VariableUpdate};
use crate::control::Control;
use crate::error::Result;
use crate::optimizer::{Optimizer, OptimizerState};
use crate::pipeline::PipelineUpdate;
use crate::trainable::{DeviceResident, HostGrads, ParamSpec};

mod independent;
mod parameter_server;
mod replicated;

pub use independent::Independent;
pub use parameter_server::{greedy_placement, ParameterServer};
pub use replicated::Replicated;

/// How one step's gradients travel between ranks, decided by the trainer before
/// backward and given to the strategy once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Wire {
    /// As f32, unscaled.
    F32,
    /// As f16, multiplied by the loss scale over the step's expected examples (so that
    /// the sum neither overflows nor underflows); divided out afterwards.
    F16 {
        /// The host's factor: the loss scale over the expected examples where the scale
        /// is a host value, or `1 / examples` where a device-resident model keeps the
        /// scale in device memory and multiplies it in itself.
        scale: f32,
    },
}

impl Wire {
    /// The factor the gradients carry on the wire (1 for f32).
    pub fn scale(self) -> f32 {
        match self {
            Wire::F32 => 1.0,
            Wire::F16 { scale } => scale,
        }
    }
}

/// What the trainer tells the strategy about a step before backward.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepContext {
    /// How the gradients travel.
    pub wire: Wire,
}

impl Default for StepContext {
    fn default() -> Self {
        StepContext { wire: Wire::F32 }
    }
}

/// Per-step figures a rank contributes; after the exchange, the sums over all ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Sum of token losses.
    pub loss_sum: f64,
    /// Target tokens with a loss.
    pub target_tokens: f64,
    /// Words (source + target).
    pub words: f64,
    /// Examples (rows).
    pub examples: f64,
    /// 1 when this rank's f16 gradients overflowed (after the exchange: ranks that did).
    pub overflow: f64,
}

impl StepStats {
    const LEN: usize = 5;

    fn to_array(self) -> [f64; Self::LEN] {
        [
            self.loss_sum,
            self.target_tokens,
            self.words,
            self.examples,
            self.overflow,
        ]
    }

    fn from_slice(v: &[f64]) -> Self {
        StepStats {
            loss_sum: v[0],
            target_tokens: v[1],
            words: v[2],
            examples: v[3],
            overflow: v[4],
        }
    }

    /// Sums the figures over the ranks (on the control plane).
    pub(crate) fn summed(self, control: &mut Control) -> Result<StepStats> {
        let mut v = self.to_array();
        control.sum(&mut v)?;
        Ok(StepStats::from_slice(&v))
    }

    /// Loss per target token.
    pub fn mean_loss(&self) -> f64 {
        if self.target_tokens > 0.0 {
            self.loss_sum / self.target_tokens
        } else {
            0.0
        }
    }
}

/// What a rank hands the strategy at the end of its backward pass.
pub struct StepInputs<'a> {
    /// Flat parameters (updated in place).
    pub params: &'a mut [f32],
    /// Flat gradients of the summed loss, `∂loss_sum/∂θ` (overwritten).
    pub grads: &'a mut [f32],
    /// This rank's figures.
    pub local: StepStats,
    /// The optimizer (state for the whole buffer).
    pub optimizer: &'a mut Optimizer,
    /// The control plane, for the step's figures.
    pub control: &'a mut Control,
}

/// What a rank hands the strategy at the end of a device-resident pass.
pub struct DeviceStepInputs<'a> {
    /// The model, holding its gradients (and, after an exchange, the host copy of them).
    pub model: &'a mut dyn DeviceResident,
    /// This rank's figures.
    pub local: StepStats,
    /// The control plane, for the step's figures.
    pub control: &'a mut Control,
}

/// What the strategy did with one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepOutcome {
    /// Figures summed over the ranks that took part (this rank's own for independent).
    pub stats: StepStats,
    /// The update was skipped because some rank's f16 gradients overflowed.
    pub skipped: bool,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Seconds of communication not hidden behind backward.
    pub communication_seconds: f64,
    /// Seconds of clipping and optimizer.
    pub optimizer_seconds: f64,
}

/// One of the strategies.
pub enum Strategy {
    /// All-reduce of gradients.
    Replicated(Replicated),
    /// Sharded parameter servers.
    ParameterServer(ParameterServer),
    /// No communication.
    Independent(Independent),
    /// A pipeline stage updating its own parameters.
    Pipeline(PipelineUpdate),
}

impl Strategy {
    /// Builds the strategy `cfg` asks for over `comm` (the parameters must already be
    /// the same on every rank).
    ///
    /// # Errors
    /// The collective's, when the fusion engine or the packer cannot start.
    pub fn new(cfg: &ValidatedConfig, comm: Communicator, specs: &[ParamSpec]) -> Result<Self> {
        Self::with_events(cfg, comm, specs, None)
    }

    /// [`Strategy::new`], the fusion engine (if any) recording its phases into `events`.
    ///
    /// # Errors
    /// As [`Strategy::new`].
    pub fn with_events(
        cfg: &ValidatedConfig,
        comm: Communicator,
        specs: &[ParamSpec],
        events: Option<&ringtrain_collective::EventSink>,
    ) -> Result<Self> {
        Ok(match cfg.config().exchange.variable_update {
            VariableUpdate::Replicated => {
                Strategy::Replicated(Replicated::with_events(cfg, comm, specs, events)?)
            }
            VariableUpdate::ParameterServer => {
                Strategy::ParameterServer(ParameterServer::new(cfg, comm, specs))
            }
            VariableUpdate::Independent => Strategy::Independent(Independent::new(cfg, comm)),
        })
    }

    /// Whether gradients are averaged over all workers' examples (false: over this rank's own).
    pub fn averages_globally(&self) -> bool {
        !matches!(self, Strategy::Independent(_))
    }

    /// Called before backward of each step.
    pub fn begin_step(&mut self, ctx: StepContext) {
        match self {
            Strategy::Replicated(s) => s.begin_step(ctx),
            Strategy::ParameterServer(s) => s.begin_step(ctx),
            Strategy::Independent(s) => s.begin_step(ctx),
            Strategy::Pipeline(s) => s.begin_step(ctx),
        }
    }

    /// Called by backward with each finished gradient range.
    ///
    /// # Errors
    /// The collective's, when the overlapped reduction cannot take the range.
    pub fn on_ready(&mut self, range: Range<usize>, grads: &[f32]) -> Result<()> {
        match self {
            Strategy::Replicated(s) => s.on_ready(range, grads),
            Strategy::Pipeline(s) => s.on_ready(range, grads),
            _ => Ok(()),
        }
    }

    /// Whether a device-resident model's gradients must come to the host this step
    /// (false when there is no other rank to reduce with).
    pub fn exchanges_gradients(&self) -> bool {
        match self {
            Strategy::Replicated(s) => s.exchanges_gradients(),
            Strategy::Pipeline(s) => s.exchanges_gradients(),
            Strategy::ParameterServer(_) => true,
            Strategy::Independent(_) => false,
        }
    }

    /// Lets go of the exchange buffer's ranges [`Strategy::on_exchanged`] handed on, after a
    /// device-resident pass failed: nothing writes into that buffer afterwards.
    pub fn release_exchanged(&mut self) {
        match self {
            Strategy::Replicated(s) => s.release_exchanged(),
            Strategy::Pipeline(s) => s.release_exchanged(),
            _ => {}
        }
    }

    /// Called during a device-resident backward with each gradient range once its copy
    /// to the host exchange buffer has landed.
    ///
    /// # Errors
    /// The collective's, when the overlapped reduction cannot take the range.
    pub fn on_exchanged(&mut self, range: Range<usize>, grads: HostGrads<'_>) -> Result<()> {
        match self {
            Strategy::Replicated(s) => s.on_exchanged(range, grads),
            Strategy::Pipeline(s) => s.on_exchanged(range, grads),
            _ => Ok(()),
        }
    }

    /// Reduces a device-resident model's gradients (in its host exchange buffer) and
    /// has the model apply the update on its device.
    ///
    /// # Errors
    /// Transport or device errors; [`crate::Error::Internal`] for `parameter_server`,
    /// which updates on the host.
    pub fn finish_device_step(&mut self, inputs: DeviceStepInputs<'_>) -> Result<StepOutcome> {
        match self {
            Strategy::Replicated(s) => s.finish_device_step(inputs),
            Strategy::Independent(s) => s.finish_device_step(inputs),
            Strategy::ParameterServer(_) => Err(crate::error::Error::Internal(
                "parameter_server updates on the host: build the model with host mirrors".into(),
            )),
            Strategy::Pipeline(s) => s.finish_device_step(inputs),
        }
    }

    /// Exchanges gradients and applies the update.
    ///
    /// # Errors
    /// Transport, kernel or optimizer errors.
    pub fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        match self {
            Strategy::Replicated(s) => s.finish_step(inputs),
            Strategy::ParameterServer(s) => s.finish_step(inputs),
            Strategy::Independent(s) => s.finish_step(inputs),
            Strategy::Pipeline(s) => s.finish_step(inputs),
        }
    }

    /// The full optimizer state on every rank (parameter servers hold only their shard's).
    ///
    /// # Errors
    /// Transport errors.
    pub fn gather_optimizer_state(&mut self, optimizer: &Optimizer) -> Result<OptimizerState> {
        match self {
            Strategy::ParameterServer(s) => s.gather_optimizer_state(optimizer),
            Strategy::Pipeline(s) => s.gather_optimizer_state(optimizer.state()),
            _ => Ok(optimizer.state().clone()),
        }
    }

    /// The full parameters on rank 0 for a checkpoint (pipeline stages each hold only
    /// their own range up to date; collective).
    ///
    /// # Errors
    /// Transport errors.
    pub fn gather_params(&mut self, params: &[f32]) -> Result<Vec<f32>> {
        match self {
            Strategy::Pipeline(s) => s.gather_params(params),
            _ => Ok(params.to_vec()),
        }
    }

    /// The part of a whole model's optimizer state (a checkpoint's) this rank's
    /// optimizer holds: a pipeline stage's range; the whole state otherwise.
    ///
    /// # Errors
    /// `InvalidValue` when the state does not cover the stage's range.
    pub fn own_optimizer_state(&self, state: OptimizerState) -> Result<OptimizerState> {
        match self {
            Strategy::Pipeline(s) => s.own_optimizer_state(state),
            _ => Ok(state),
        }
    }

    /// The whole optimizer state on rank 0 from a pipeline stage's own `state` (a device
    /// stage's, downloaded; collective over the stages); `state` itself otherwise.
    ///
    /// # Errors
    /// Transport errors.
    pub fn gather_stage_optimizer_state(
        &mut self,
        state: OptimizerState,
    ) -> Result<OptimizerState> {
        match self {
            Strategy::Pipeline(s) => s.gather_optimizer_state(&state),
            _ => Ok(state),
        }
    }

    /// Keeps only this rank's shard of a freshly loaded optimizer state (parameter servers).
    pub fn localize_optimizer_state(&self, optimizer: &mut Optimizer) {
        if let Strategy::ParameterServer(s) = self {
            s.localize_optimizer_state(optimizer);
        }
    }

    /// Stops background work and returns the communicator (collective: every rank calls it).
    ///
    /// # Errors
    /// The fusion engine's, when its thread failed.
    pub fn shutdown(self) -> Result<Communicator> {
        match self {
            Strategy::Replicated(s) => s.shutdown(),
            Strategy::ParameterServer(s) => Ok(s.into_comm()),
            Strategy::Independent(s) => Ok(s.into_comm()),
            Strategy::Pipeline(s) => s.shutdown(),
        }
    }
}

/// The shared tail of a step once every replica holds the summed gradient: divide by
/// the examples (and undo the wire scale), clip to the global norm, apply the optimizer.
/// Returns the norm before clipping, or `None` (and nothing updated) when a gradient is
/// not finite: the step is skipped. One pass over the gradients takes the norm and the
/// overflow test; the optimizer reads them through the correction and the clipping
/// factor, which leave the gradients as they were.
pub(crate) fn update_replica(
    params: &mut [f32],
    grads: &[f32],
    correction: f32,
    max_gradient_norm: f32,
    optimizer: &mut Optimizer,
) -> Result<Option<f64>> {
    let squares = ringtrain_kernels::par::sum_of_squares_scaled(grads, correction);
    if !squares.is_finite() {
        return Ok(None);
    }
    let norm = squares.sqrt();
    let clip = if max_gradient_norm > 0.0 {
        ringtrain_kernels::clip_factor(norm, max_gradient_norm)
    } else {
        1.0
    };
    optimizer.step_scaled(params, grads, GradScale(correction, clip))?;
    Ok(Some(norm))
}

/// Factor that turns summed gradients carrying `wire`'s scale into gradients averaged
/// over `examples`.
pub(crate) fn correction_factor(wire: Wire, examples: f64) -> f32 {
    if examples <= 0.0 {
        return 0.0;
    }
    (1.0 / (f64::from(wire.scale()) * examples)) as f32
}

/// `grads` cast to f16 with `scale` for the wire; true when a value overflowed (or was
/// not finite).
pub(crate) fn to_wire_f16(grads: &[f32], scale: f32) -> Result<(Vec<f16>, bool)> {
    let mut half = vec![f16::ZERO; grads.len()];
    let overflow = ringtrain_kernels::par::f32_to_f16_scaled(grads, scale, &mut half)?;
    Ok((half, overflow))
}
