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
//! In every strategy rank 0 broadcasts the initial parameters first.

use std::ops::Range;

use ringtrain_collective::{AllReduceOptions, Communicator, ReduceOp};

use crate::config::{TrainConfig, VariableUpdate};
use crate::error::{Error, Result};
use crate::optimizer::{Optimizer, OptimizerState};
use crate::trainable::ParamSpec;

mod independent;
mod parameter_server;
mod replicated;

pub use independent::Independent;
pub use parameter_server::{greedy_placement, ParameterServer};
pub use replicated::Replicated;

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
    /// Factor applied to the gradients when they are cast to f16 for the exchange
    /// (loss scale / expected examples; 1 for f32 gradients). Divided out afterwards.
    pub wire_scale: f32,
    /// Global-norm clip (0 = off).
    pub max_gradient_norm: f32,
    /// The optimizer (state for the whole buffer).
    pub optimizer: &'a mut Optimizer,
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
}

impl Strategy {
    /// Builds the strategy for `cfg`, after rank 0 has broadcast `params` to every rank.
    pub fn new(
        cfg: &TrainConfig,
        mut comm: Communicator,
        specs: &[ParamSpec],
        params: &mut [f32],
    ) -> Result<Self> {
        cfg.validate_for_world(comm.size())?;
        check_same_everywhere(
            &mut comm,
            "the training flags (fingerprint)",
            f64::from(cfg.fingerprint()),
        )?;
        check_same_everywhere(&mut comm, "parameter count", params.len() as f64)?;
        comm.broadcast(params, 0)?;
        Ok(match cfg.variable_update {
            VariableUpdate::Replicated => Strategy::Replicated(Replicated::new(cfg, comm, specs)?),
            VariableUpdate::ParameterServer => {
                Strategy::ParameterServer(ParameterServer::new(cfg, comm, specs)?)
            }
            VariableUpdate::Independent => Strategy::Independent(Independent::new(comm)),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        match self {
            Strategy::Replicated(s) => s.rank(),
            Strategy::ParameterServer(s) => s.rank(),
            Strategy::Independent(s) => s.rank(),
        }
    }

    /// Ranks in the world.
    pub fn world(&self) -> usize {
        match self {
            Strategy::Replicated(s) => s.world(),
            Strategy::ParameterServer(s) => s.world(),
            Strategy::Independent(s) => s.world(),
        }
    }

    /// Whether this rank computes gradients (dedicated parameter servers do not).
    pub fn is_worker(&self) -> bool {
        match self {
            Strategy::ParameterServer(s) => s.is_worker(),
            _ => true,
        }
    }

    /// Index of this rank among the workers (its data shard).
    pub fn worker_index(&self) -> usize {
        self.rank()
    }

    /// Ranks that compute gradients.
    pub fn workers(&self) -> usize {
        match self {
            Strategy::ParameterServer(s) => s.workers(),
            _ => self.world(),
        }
    }

    /// Whether gradients are averaged over all workers' examples (false: over this rank's own).
    pub fn averages_globally(&self) -> bool {
        !matches!(self, Strategy::Independent(_))
    }

    /// Called before backward of each step with the f16 wire scale (see [`StepInputs::wire_scale`]).
    pub fn begin_step(&mut self, fp16: bool, wire_scale: f32) {
        if let Strategy::Replicated(s) = self {
            s.begin_step(fp16, wire_scale);
        }
    }

    /// Called by backward with each finished gradient range.
    pub fn on_ready(&mut self, range: Range<usize>, grads: &[f32]) -> Result<()> {
        match self {
            Strategy::Replicated(s) => s.on_ready(range, grads),
            _ => Ok(()),
        }
    }

    /// Exchanges gradients and applies the update.
    pub fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        match self {
            Strategy::Replicated(s) => s.finish_step(inputs),
            Strategy::ParameterServer(s) => s.finish_step(inputs),
            Strategy::Independent(s) => s.finish_step(inputs),
        }
    }

    /// Element-wise reduction of a small f64 vector over all ranks (summaries, reports).
    pub fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        let comm = match self {
            Strategy::Replicated(s) => return s.all_reduce_f64(buf, op),
            Strategy::ParameterServer(s) => s.comm(),
            Strategy::Independent(s) => s.comm(),
        };
        comm.all_reduce(buf, &AllReduceOptions::with_op(op))?;
        Ok(())
    }

    /// The full optimizer state on every rank (parameter servers hold only their shard's).
    pub fn gather_optimizer_state(&mut self, optimizer: &Optimizer) -> Result<OptimizerState> {
        match self {
            Strategy::ParameterServer(s) => s.gather_optimizer_state(optimizer),
            _ => Ok(optimizer.state().clone()),
        }
    }

    /// Keeps only this rank's shard of a freshly loaded optimizer state (parameter servers).
    pub fn localize_optimizer_state(&self, optimizer: &mut Optimizer) {
        if let Strategy::ParameterServer(s) = self {
            s.localize_optimizer_state(optimizer);
        }
    }

    /// Stops background work and returns the communicator (collective: every rank calls it).
    pub fn shutdown(self) -> Result<Communicator> {
        match self {
            Strategy::Replicated(s) => s.shutdown(),
            Strategy::ParameterServer(s) => Ok(s.into_comm()),
            Strategy::Independent(s) => Ok(s.into_comm()),
        }
    }
}

/// Errors on every rank when ranks hold different values of `what`.
pub fn check_same_everywhere(comm: &mut Communicator, what: &str, value: f64) -> Result<()> {
    let mut v = [value, -value];
    comm.all_reduce(&mut v, &AllReduceOptions::with_op(ReduceOp::Max))?;
    let (max, min) = (v[0], -v[1]);
    if max != min {
        return Err(Error::RankMismatch(format!(
            "{what} differs between ranks (from {min} to {max}; this rank has {value}): \
             start every rank with the same flags"
        )));
    }
    Ok(())
}

/// The shared tail of a step once every replica holds the summed gradient: divide by
/// the examples (and undo the wire scale), clip to the global norm, apply the optimizer.
/// Returns the norm before clipping.
pub(crate) fn update_replica(
    params: &mut [f32],
    grads: &mut [f32],
    correction: f32,
    max_gradient_norm: f32,
    optimizer: &mut Optimizer,
) -> Result<f64> {
    if correction != 1.0 {
        ringtrain_kernels::par::scale_f32(grads, correction);
    }
    let norm = ringtrain_kernels::sum_of_squares(grads).sqrt();
    if max_gradient_norm > 0.0 {
        let factor = ringtrain_kernels::clip_factor(norm, max_gradient_norm);
        if factor != 1.0 {
            ringtrain_kernels::par::scale_f32(grads, factor);
        }
    }
    optimizer.step(params, grads)?;
    Ok(norm)
}

/// Factor that turns summed gradients carrying `wire_scale` into gradients averaged
/// over `examples`.
pub(crate) fn correction_factor(wire_scale: f32, examples: f64) -> f32 {
    if examples <= 0.0 {
        return 0.0;
    }
    (1.0 / (f64::from(wire_scale) * examples)) as f32
}
