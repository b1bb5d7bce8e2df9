//! What the training loop needs from a model, the batch it feeds it, and the adapters
//! that bind the model crate's models to it.
//!
//! The loop and the variable-update strategies see a model as one flat `f32` parameter
//! buffer (with named ranges, one per tensor) and a `forward_backward` call that fills a
//! flat gradient buffer of the same length and reports ranges as soon as backward has
//! finished them, so communication can start while backward continues.
//!
//! - [`staging`]: a data batch as the model's batch view (both are time-major: no copy);
//! - [`pass`]: one timed pass, handing finished gradient ranges on through a [`pass::Delivery`];
//! - [`CpuTrainable`]: a model whose buffers are host memory, ranges delivered at once;
//! - `GpuTrainable` (feature `cuda`): a model on the GPU that keeps its parameters,
//!   gradients and optimizer state there and updates on the device ([`DeviceResident`]);
//!   under `parameter_server` it keeps pinned host mirrors instead and is updated on the
//!   host like a CPU model; `device_exchange` (feature `cuda`) holds what it shares with
//!   a GPU pipeline stage: the pinned exchange buffer and the f16 wire whose loss scale
//!   lives on the device;
//! - [`build_model`]: the model a configuration asks for, on its device.

use std::ops::Range;

use half::f16;
use ringtrain_data::{LmBatch, NmtBatch};

use crate::config::OptimizerKind;
use crate::error::Result;
use crate::optimizer::{LossScaler, OptimizerState};
use crate::strategy::Wire;

mod build;
mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod device_exchange;
#[cfg(feature = "cuda")]
mod device_optimizer;
#[cfg(feature = "cuda")]
mod gpu;
pub mod pass;
pub mod staging;

pub use build::{build_model, build_pipeline_stage, check_memory, plan_memory, MemoryPlan};
pub use cpu::CpuTrainable;
#[cfg(feature = "cuda")]
pub(crate) use device_optimizer::DeviceOptimizer;
#[cfg(feature = "cuda")]
pub use gpu::GpuTrainable;

/// One tensor of the flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Name, e.g. `encoder/l0/w_ih`.
    pub name: String,
    /// Elements of the flat buffer it occupies.
    pub range: Range<usize>,
}

/// One [`ParamSpec`] per tensor of `layout`, in buffer order.
pub fn param_specs(layout: &ringtrain_model::ParamLayout) -> Vec<ParamSpec> {
    layout
        .entries()
        .iter()
        .map(|e| ParamSpec {
            name: e.name.clone(),
            range: e.offset..e.offset + e.len,
        })
        .collect()
}

/// A batch for either model (time-major, as the data crate makes it).
#[derive(Debug, Clone)]
pub enum Batch {
    /// Source and target sentences.
    Nmt(NmtBatch),
    /// Language-model windows.
    Lm(LmBatch),
}

impl Batch {
    /// Words the throughput meter counts: source + target (NMT), predicted tokens (LM).
    pub fn words(&self) -> usize {
        match self {
            Batch::Nmt(b) => b.words(),
            Batch::Lm(b) => b.words(),
        }
    }

    /// Examples (columns) in the batch: the unit gradients are averaged over.
    pub fn examples(&self) -> usize {
        match self {
            Batch::Nmt(b) => b.batch_size,
            Batch::Lm(b) => b.batch_size,
        }
    }

    /// Examples `examples` of this batch as a batch of their own (one rank's share of a
    /// global batch). Examples past the end are dropped.
    pub fn columns(&self, examples: Range<usize>) -> Batch {
        match self {
            Batch::Nmt(b) => Batch::Nmt(b.columns(examples)),
            Batch::Lm(b) => Batch::Lm(b.columns(examples)),
        }
    }
}

/// What one forward + backward pass produced besides the gradients.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PassOutput {
    /// Sum of the masked token losses of the batch.
    pub loss_sum: f64,
    /// Target tokens that carried a loss.
    pub target_tokens: f64,
    /// Seconds spent in forward (including the loss).
    pub forward_seconds: f64,
    /// Seconds spent in backward.
    pub backward_seconds: f64,
    /// Kernel launches (or kernel calls on the CPU) the pass issued.
    pub launches: u64,
}

/// Called with each gradient range as soon as backward has finished writing it.
pub type ReadyCallback<'a> = dyn FnMut(Range<usize>, &[f32]) -> Result<()> + 'a;

/// A gradient range in the host buffer it was copied into for the exchange: f32, or
/// f16 when the device cast it for the wire. Mutable, so that the exchange can reduce it
/// in place there.
#[derive(Debug)]
pub enum HostGrads<'a> {
    /// f32 gradients.
    F32(&'a mut [f32]),
    /// f16 gradients carrying the wire's scale.
    F16(&'a mut [f16]),
}

/// The whole host exchange buffer, for a reduction in place.
#[derive(Debug)]
pub enum HostGradsMut<'a> {
    /// f32 gradients.
    F32(&'a mut [f32]),
    /// f16 gradients carrying the wire's scale.
    F16(&'a mut [f16]),
}

/// Called with each gradient range of a device-resident pass once its copy to the host
/// exchange buffer has landed.
pub type ExchangeCallback<'a> = dyn FnMut(Range<usize>, HostGrads<'_>) -> Result<()> + 'a;

/// What the device-resident update of one step did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DeviceUpdate {
    /// The update was skipped: told to, or the gradients held an Inf or NaN.
    pub skipped: bool,
    /// Global gradient norm before clipping (0 when skipped).
    pub grad_norm: f64,
}

/// Device work timed with CUDA events, placed on the host's clock (a `--timeline`'s GPU
/// row): the device times between marks, counted from a mark recorded at the start of the
/// pass while the device was idle, added to the host time of that moment.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceSpan {
    /// What ran (`gpu forward+backward`, `d2h 0..64`, `h2d`, `gpu update`).
    pub name: String,
    /// When it started.
    pub start: std::time::Instant,
    /// When it ended.
    pub end: std::time::Instant,
    /// Details (elements, bytes).
    pub args: serde_json::Value,
}

/// A model that keeps its parameters, gradients and optimizer state on its device:
/// clipping and the update run there, and the host sees only the gradients a multi-rank
/// exchange needs (once each way) and a few scalars per step.
pub trait DeviceResident {
    /// Allocates the optimizer's state on the device (zeros). Call once before the
    /// first update.
    ///
    /// # Errors
    /// Device errors.
    fn start_optimizer(&mut self, kind: OptimizerKind, learning_rate: f32) -> Result<()>;
    /// Keeps the dynamic loss scale of f16 gradients on the device from now on, starting
    /// from `scaler` (a new one, or a checkpoint's): the casts read it there and
    /// [`DeviceResident::update`] applies the growth/backoff policy of
    /// [`LossScaler::update`] there, so no step moves it between host and device (both
    /// GPU models do: a whole model and a pipeline stage). Returns false when the model
    /// leaves the scale to the host (the default).
    ///
    /// # Errors
    /// Device errors.
    fn start_loss_scaler(&mut self, scaler: LossScaler) -> Result<bool> {
        let _ = scaler;
        Ok(false)
    }
    /// The loss scale kept on the device, downloaded (for a checkpoint or a report);
    /// `None` when the device keeps none.
    ///
    /// # Errors
    /// Device errors.
    fn loss_scaler(&mut self) -> Result<Option<LossScaler>> {
        Ok(None)
    }
    /// Forward and backward on `batch`. Each gradient range is cast for `wire` on the
    /// device (f16 with its scale, setting the device's non-finite flag; a model that
    /// keeps the loss scale on the device multiplies it in there, see
    /// [`DeviceResident::start_loss_scaler`]), and, with `to_host`, copied into the host
    /// exchange buffer and handed to `on_ready` once landed, while backward goes on.
    /// Without `to_host` no gradient leaves the device.
    ///
    /// # Errors
    /// The model's, the device's, or the first error `on_ready` returned.
    fn forward_backward_exchanging(
        &mut self,
        batch: &Batch,
        wire: Wire,
        to_host: bool,
        on_ready: &mut ExchangeCallback<'_>,
    ) -> Result<PassOutput>;
    /// Whether the last pass's f16 cast met a value that is not finite in f16 (reads the
    /// device's flag; false for an f32 wire).
    ///
    /// # Errors
    /// Device errors.
    fn cast_overflowed(&mut self) -> Result<bool>;
    /// The host exchange buffer the last pass copied its gradients into, to be reduced
    /// in place.
    ///
    /// # Errors
    /// [`crate::Error::Internal`] when the last pass did not copy to the host.
    fn exchanged_grads(&mut self) -> Result<HostGradsMut<'_>>;
    /// The update: brings the exchanged (reduced) gradients back to the device once,
    /// undoes the wire's cast, multiplies them by `correction` (divided by the device's
    /// loss scale when it keeps one), clips them to `max_gradient_norm` (0: no clipping)
    /// and applies the optimizer, unless `skip` or a gradient is not finite (the
    /// device's flag). A loss scale kept on the device then takes the step's outcome.
    ///
    /// # Errors
    /// Device errors; an update before [`DeviceResident::start_optimizer`].
    fn update(
        &mut self,
        correction: f32,
        max_gradient_norm: f32,
        skip: bool,
    ) -> Result<DeviceUpdate>;
    /// The squared L2 norm of the gradients the next [`DeviceResident::update`] applies
    /// (the exchanged ones brought back to the device first), for a norm over several
    /// models: a pipeline's stages sum theirs. Not finite when a gradient is not.
    ///
    /// # Errors
    /// Device errors; [`crate::Error::Internal`] for a model that is no pipeline stage.
    fn gradient_sum_of_squares(&mut self) -> Result<f64> {
        Err(crate::Error::Internal(
            "only a pipeline stage reports its gradients' norm before the update".into(),
        ))
    }
    /// The optimizer's state, downloaded (for a checkpoint).
    ///
    /// # Errors
    /// Device errors.
    fn optimizer_state(&mut self) -> Result<OptimizerState>;
    /// Replaces the optimizer's state with `state` (a checkpoint's), uploading it.
    ///
    /// # Errors
    /// `InvalidValue` naming `--optimizer` for another optimizer's state; a state of
    /// another size; device errors.
    fn load_optimizer_state(&mut self, state: OptimizerState) -> Result<()>;
    /// Times the device work of the following passes and updates with CUDA events
    /// (for a timeline), or stops timing it. Off until turned on; the default
    /// implementation times nothing.
    fn set_device_timing(&mut self, on: bool) {
        let _ = on;
    }
    /// The device work timed since the last call (empty when timing is off).
    ///
    /// # Errors
    /// Device errors reading the events.
    fn take_device_spans(&mut self) -> Result<Vec<DeviceSpan>> {
        Ok(Vec::new())
    }
    /// Copies the device's parameters into the host view that
    /// [`TrainableModel::params`] returns (for a checkpoint, or after training).
    ///
    /// # Errors
    /// Device errors.
    fn download_params(&mut self) -> Result<()>;
}

/// A model the trainer can train.
///
/// The host views of the parameters and gradients are fallible: a device model keeps
/// host mirrors whose copies must have landed, and a broken invariant there is reported
/// as [`crate::Error::Internal`], not papered over.
pub trait TrainableModel: Send {
    /// The tensors of the flat parameter buffer, in buffer order, covering it exactly.
    fn param_specs(&self) -> Vec<ParamSpec>;
    /// The flat parameters. A device-resident model's host view is filled for the
    /// broadcast, checkpoints and after training ([`DeviceResident::download_params`]).
    ///
    /// # Errors
    /// [`crate::Error::Internal`] when a device mirror is not settled, or when the device
    /// holds newer parameters than the host view.
    fn params(&self) -> Result<&[f32]>;
    /// The flat parameters, for broadcasts and checkpoints.
    ///
    /// # Errors
    /// As [`TrainableModel::params`].
    fn params_mut(&mut self) -> Result<&mut [f32]>;
    /// The flat parameters and the flat gradients (same layout), for the update.
    ///
    /// # Errors
    /// As [`TrainableModel::params`].
    fn params_and_grads_mut(&mut self) -> Result<(&mut [f32], &mut [f32])>;
    /// Forward and backward on `batch`. Overwrites the gradient buffer with
    /// `∂(loss_sum)/∂θ` (the gradient of the summed token losses) and calls `on_ready`
    /// for disjoint ranges that together cover the buffer, each as soon as it is final.
    ///
    /// # Errors
    /// The model's, the device's, or the first error `on_ready` returned.
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput>;
    /// Forward only over `batches` (one rank's held-out part, in order): the summed token
    /// loss and the tokens it covers. Leaves the parameters and any state the model
    /// carries for training as they are, and the gradient buffer unspecified until the
    /// next [`TrainableModel::forward_backward`] overwrites it; `backward_seconds` is 0.
    ///
    /// # Errors
    /// The model's or the device's.
    fn evaluate(&mut self, batches: &[Batch]) -> Result<PassOutput>;
    /// A short description for logs (`nmt fused uni 2+2 layers, 64 units, ...`).
    fn describe(&self) -> String;
    /// Where this model sits in a pipeline, and the time split of its last batch
    /// (`None`: the whole model, not a pipeline stage).
    fn pipeline_stage(&self) -> Option<(crate::pipeline::StageInfo, crate::pipeline::StageTimes)> {
        None
    }
    /// The model's device-resident side, when it updates on its device; `None` (the
    /// default) for a model the trainer updates through the host views above.
    fn device_resident(&mut self) -> Option<&mut dyn DeviceResident> {
        None
    }
}
