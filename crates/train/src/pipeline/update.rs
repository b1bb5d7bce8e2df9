//! [`PipelineUpdate`]: the update of a pipeline stage, and the gathering of every
//! stage's parameters and optimizer state onto rank 0 for a checkpoint.

use std::ops::Range;
use std::time::Instant;

use ringtrain_collective::Communicator;
use ringtrain_kernels::GradScale;

use super::StageInfo;
use crate::config::ValidatedConfig;
use crate::error::Result;
use crate::optimizer::OptimizerState;
use crate::strategy::{
    correction_factor, DeviceStepInputs, Replicated, StepContext, StepInputs, StepOutcome,
};
use crate::trainable::{HostGrads, ParamSpec};

/// Each stage updates its own parameters with its own optimizer state; the clipping
/// norm is global (the stages' squared norms summed on the control plane). With D > 1
/// replicas of the pipeline, each stage first sums its gradients with the same stage of
/// the other replicas by the replicated strategy's all-reduce over a subgroup of those
/// D ranks (fusion, packing and the f16 wire apply as they do without a pipeline).
pub struct PipelineUpdate {
    comm: Communicator,
    info: StageInfo,
    max_gradient_norm: f32,
    replicas: Option<Box<Replicated>>,
    replica_count: usize,
    ctx: StepContext,
}

impl PipelineUpdate {
    /// The update of the stage `info` describes for the model's tensors `specs`; `comm`
    /// (the world) carries the checkpoint gathers and, with replicas, makes the stage's
    /// subgroup (collective: every rank calls it at the same point).
    ///
    /// # Errors
    /// The collective's, when the subgroup or its reduction cannot start.
    pub fn new(
        cfg: &ValidatedConfig,
        comm: Communicator,
        info: StageInfo,
        specs: &[ParamSpec],
    ) -> Result<Self> {
        let stages = cfg.pipeline_stages();
        let replica_count = cfg.world() / stages;
        let replicas = if replica_count > 1 {
            let group: Vec<usize> = (0..replica_count)
                .map(|r| r * stages + info.stage)
                .collect();
            let sub = comm.subgroup(&group)?;
            let own = info.own_params();
            let own_specs: Vec<ParamSpec> = specs
                .iter()
                .filter(|s| s.range.start >= own.start && s.range.end <= own.end)
                .map(|s| ParamSpec {
                    name: s.name.clone(),
                    range: s.range.start - own.start..s.range.end - own.start,
                })
                .collect();
            Some(Box::new(Replicated::new(cfg, sub, &own_specs)?))
        } else {
            None
        };
        Ok(PipelineUpdate {
            comm,
            info,
            max_gradient_norm: cfg.config().run.max_gradient_norm,
            replicas,
            replica_count,
            ctx: StepContext::default(),
        })
    }

    /// Before backward: how gradients travel between the replicas.
    pub fn begin_step(&mut self, ctx: StepContext) {
        self.ctx = ctx;
        if let Some(r) = self.replicas.as_mut() {
            r.begin_step(ctx);
        }
    }

    /// A finished gradient range (the stage hands its whole buffer over at the end of
    /// its pass): its own part goes to the replicas' reduction.
    ///
    /// # Errors
    /// The reduction's.
    pub fn on_ready(&mut self, range: Range<usize>, grads: &[f32]) -> Result<()> {
        let own = self.info.own_params();
        let Some(r) = self.replicas.as_mut() else {
            return Ok(());
        };
        if range.start > own.start || range.end < own.end {
            return Err(crate::error::Error::Internal(format!(
                "the stage reported gradient range {range:?}, not its whole range {own:?}"
            )));
        }
        let at = own.start - range.start..own.end - range.start;
        r.on_ready(0..own.len(), &grads[at])
    }

    /// Whether a stage that updates on its device copies its summed gradients to the
    /// host: only with replicas to reduce them with.
    pub fn exchanges_gradients(&self) -> bool {
        self.replicas.is_some()
    }

    /// A device stage's summed gradients (`range`: its whole own range) once their copy
    /// to its pinned host exchange buffer has landed, cast for the wire on the device: the
    /// replicas' reduction takes that buffer itself, to sum it in place.
    ///
    /// # Errors
    /// The reduction's; [`crate::error::Error::Internal`] for a range that is not the
    /// stage's own.
    pub fn on_exchanged(&mut self, range: Range<usize>, grads: HostGrads<'_>) -> Result<()> {
        let own = self.info.own_params();
        let Some(r) = self.replicas.as_mut() else {
            return Ok(());
        };
        if range != own {
            return Err(crate::error::Error::Internal(format!(
                "the stage exchanged gradient range {range:?}, not its own range {own:?}"
            )));
        }
        r.on_exchanged(0..own.len(), grads)
    }

    /// Lets go of the exchange buffer's range handed on by [`Self::on_exchanged`] after
    /// the stage's pass failed.
    pub fn release_exchanged(&mut self) {
        if let Some(r) = self.replicas.as_mut() {
            r.release_exchanged();
        }
    }

    /// Stops the replicas' reduction and returns the world communicator.
    ///
    /// # Errors
    /// The fusion engine's, when its thread failed.
    pub fn shutdown(self) -> Result<Communicator> {
        if let Some(r) = self.replicas {
            r.shutdown()?;
        }
        Ok(self.comm)
    }

    /// Sums the step's figures (the trainer lets only the last stage count the batch's
    /// words and examples, and only it has a loss), divides the gradients by the examples, clips to the global norm and applies
    /// the optimizer to this stage's parameters. A non-finite gradient on any stage
    /// skips the update on every stage.
    ///
    /// # Errors
    /// Control-plane and optimizer errors.
    pub fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        let StepInputs {
            params,
            grads,
            mut local,
            optimizer,
            control,
        } = inputs;
        let start = Instant::now();
        let own = self.info.own_params();
        let g = &mut grads[own.clone()];
        if let Some(r) = self.replicas.as_mut() {
            r.reduce(g, &mut local)?;
        }
        if ringtrain_kernels::has_non_finite_f32(g) {
            local.overflow = 1.0;
        }
        let stats = local.summed(control)?;
        let communication = start.elapsed().as_secs_f64();
        let mut outcome = StepOutcome {
            stats,
            skipped: stats.overflow > 0.0,
            communication_seconds: communication,
            ..StepOutcome::default()
        };
        if outcome.skipped {
            return Ok(outcome);
        }
        let update = Instant::now();
        // The norm of the averaged gradients, and the update reading them through the
        // averaging and clipping factors (see `update_replica`).
        let correction = correction_factor(self.ctx.wire, stats.examples);
        // Every replica of a stage holds the same gradients: count them once.
        let mut squares = [ringtrain_kernels::par::sum_of_squares_scaled(g, correction)
            / self.replica_count as f64];
        control.sum(&mut squares)?;
        let norm = squares[0].sqrt();
        let clip = if self.max_gradient_norm > 0.0 {
            ringtrain_kernels::clip_factor(norm, self.max_gradient_norm)
        } else {
            1.0
        };
        optimizer.begin_step();
        // The stage's optimizer state covers its own range only.
        let scale = GradScale(correction, clip);
        optimizer.apply_scaled(0..own.len(), &mut params[own], g, scale)?;
        outcome.grad_norm = norm;
        outcome.optimizer_seconds = update.elapsed().as_secs_f64();
        Ok(outcome)
    }

    /// [`Self::finish_step`] for a stage that updates on its device: the replicas reduce
    /// the gradients in place in the stage's pinned host exchange buffer (f16 cast on the
    /// device with its loss scale under `--fp16-gradients`), the stage reports its squared
    /// norm, every rank (all stages, all replicas) agrees on the overflow flags and skips
    /// together, and the stages agree on the global norm before each applies its update
    /// with the correction and the clip folded into one factor. The loss scale on the
    /// device takes the agreed outcome in the update, as the host's would.
    ///
    /// # Errors
    /// Control-plane, transport and device errors.
    pub fn finish_device_step(&mut self, inputs: DeviceStepInputs<'_>) -> Result<StepOutcome> {
        let DeviceStepInputs {
            model,
            mut local,
            control,
        } = inputs;
        let start = Instant::now();
        if let Some(r) = self.replicas.as_mut() {
            // In place in the stage's pinned exchange buffer; the overflow flag of this
            // rank's f16 cast comes from the device.
            r.reduce_exchanged(&mut *model, &mut local)?;
        }
        // The reduced gradients back on the device (cast back from the wire there): a sum
        // that overflowed f16 is not finite.
        let raw = model.gradient_sum_of_squares()?;
        if !raw.is_finite() {
            local.overflow = 1.0;
        }
        let stats = local.summed(control)?;
        let communication = start.elapsed().as_secs_f64();
        let mut outcome = StepOutcome {
            stats,
            skipped: stats.overflow > 0.0,
            communication_seconds: communication,
            ..StepOutcome::default()
        };
        let update = Instant::now();
        if outcome.skipped {
            model.update(1.0, 0.0, true)?;
            return Ok(outcome);
        }
        let correction = correction_factor(self.ctx.wire, stats.examples);
        let c = f64::from(correction);
        // Every replica of a stage holds the same gradients: count them once.
        let mut squares = [raw * c * c / self.replica_count as f64];
        control.sum(&mut squares)?;
        let norm = squares[0].sqrt();
        let factor = if self.max_gradient_norm > 0.0 {
            ringtrain_kernels::clip_factor(norm, self.max_gradient_norm)
        } else {
            1.0
        };
        model.update(correction * factor, 0.0, false)?;
        outcome.grad_norm = norm;
        outcome.optimizer_seconds = update.elapsed().as_secs_f64();
        Ok(outcome)
    }

    /// The whole buffer on rank 0 from every stage's `own` values (the values of its
    /// range, in stage order; the other ranks send theirs and get them back unchanged).
    /// Collective over the stages of this rank's replica.
    fn gather_ranges(&mut self, own: &[f32]) -> Result<Vec<f32>> {
        let rank = self.comm.rank();
        let first = rank - self.info.stage;
        let transport = self.comm.transport();
        if self.info.stage == 0 {
            let total = self.info.params.iter().map(|r| r.end).max().unwrap_or(0);
            let mut out = vec![0.0; total];
            out[self.info.own_params()].copy_from_slice(own);
            for s in 1..self.info.stages {
                let range: Range<usize> = self.info.params[s].clone();
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out[range]);
                transport.recv(first + s, bytes)?;
            }
            Ok(out)
        } else {
            transport.send(first, bytemuck::cast_slice(own))?;
            Ok(own.to_vec())
        }
    }

    /// Every stage's parameters on rank 0 (see `gather_ranges`); `params` is the
    /// whole buffer, of which this stage's range is current.
    ///
    /// # Errors
    /// Transport errors.
    pub fn gather_params(&mut self, params: &[f32]) -> Result<Vec<f32>> {
        let own = self.info.own_params();
        self.gather_ranges(&params[own])
    }

    /// Every stage's optimizer state on rank 0, from each stage's own (the length of
    /// its range).
    ///
    /// # Errors
    /// Transport errors.
    pub fn gather_optimizer_state(&mut self, state: &OptimizerState) -> Result<OptimizerState> {
        match state {
            OptimizerState::Sgd => Ok(OptimizerState::Sgd),
            OptimizerState::Adam { m, v, step } => {
                let step = *step;
                let m = self.gather_ranges(m)?;
                let v = self.gather_ranges(v)?;
                Ok(OptimizerState::Adam { m, v, step })
            }
        }
    }

    /// This stage's part of a whole model's optimizer state (a checkpoint's).
    ///
    /// # Errors
    /// `InvalidValue` naming `--checkpoint` when the state does not cover this stage's
    /// range.
    pub fn own_optimizer_state(&self, state: OptimizerState) -> Result<OptimizerState> {
        let own = self.info.own_params();
        match state {
            OptimizerState::Sgd => Ok(OptimizerState::Sgd),
            OptimizerState::Adam { m, v, step } => match (m.get(own.clone()), v.get(own.clone())) {
                (Some(m), Some(v)) => Ok(OptimizerState::Adam {
                    m: m.to_vec(),
                    v: v.to_vec(),
                    step,
                }),
                _ => Err(crate::error::Error::invalid(
                    "--checkpoint",
                    format!("Adam state of {} elements", m.len()),
                    format!(
                        "pipeline stage {} updates elements {own:?}: resume from a checkpoint \
                         of the same model",
                        self.info.stage
                    ),
                )),
            },
        }
    }
}

impl std::fmt::Debug for PipelineUpdate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PipelineUpdate")
            .field("info", &self.info)
            .finish()
    }
}
