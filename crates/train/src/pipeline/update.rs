//! [`PipelineUpdate`]: the update of a pipeline stage, and the gathering of every
//! stage's parameters and optimizer state onto rank 0 for a checkpoint.

use std::ops::Range;
use std::time::Instant;

use ringtrain_collective::Communicator;

use super::StageInfo;
use crate::config::ValidatedConfig;
use crate::error::Result;
use crate::optimizer::{Optimizer, OptimizerState};
use crate::strategy::{correction_factor, StepInputs, StepOutcome, Wire};

/// Each stage updates its own parameters with its own optimizer state; the clipping
/// norm is global (the stages' squared norms summed on the control plane).
pub struct PipelineUpdate {
    comm: Communicator,
    info: StageInfo,
    max_gradient_norm: f32,
}

impl PipelineUpdate {
    /// The update of the stage `info` describes; `comm` carries the checkpoint gathers.
    pub fn new(cfg: &ValidatedConfig, comm: Communicator, info: StageInfo) -> Self {
        PipelineUpdate {
            comm,
            info,
            max_gradient_norm: cfg.config().run.max_gradient_norm,
        }
    }

    /// The communicator, for the caller.
    pub fn into_comm(self) -> Communicator {
        self.comm
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
        local.overflow = f64::from(u8::from(ringtrain_kernels::has_non_finite_f32(g)));
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
        let correction = correction_factor(Wire::F32, stats.examples);
        if correction != 1.0 {
            ringtrain_kernels::par::scale_f32(g, correction);
        }
        let mut squares = [ringtrain_kernels::sum_of_squares(g)];
        control.sum(&mut squares)?;
        let norm = squares[0].sqrt();
        if self.max_gradient_norm > 0.0 {
            let factor = ringtrain_kernels::clip_factor(norm, self.max_gradient_norm);
            if factor != 1.0 {
                ringtrain_kernels::par::scale_f32(g, factor);
            }
        }
        optimizer.begin_step();
        optimizer.apply_range(own.clone(), &mut params[own], g)?;
        outcome.grad_norm = norm;
        outcome.optimizer_seconds = update.elapsed().as_secs_f64();
        Ok(outcome)
    }

    /// `values` with every stage's range filled in from that stage, on rank 0 (the other
    /// ranks send theirs and get their own values back). Collective.
    fn gather_ranges(&mut self, values: &[f32]) -> Result<Vec<f32>> {
        let mut out = values.to_vec();
        let rank = self.comm.rank();
        let first = rank - self.info.stage;
        let transport = self.comm.transport();
        if self.info.stage == 0 {
            for s in 1..self.info.stages {
                let range: Range<usize> = self.info.params[s].clone();
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out[range]);
                transport.recv(first + s, bytes)?;
            }
        } else {
            let own = self.info.own_params();
            transport.send(first, bytemuck::cast_slice(&values[own]))?;
        }
        Ok(out)
    }

    /// Every stage's parameters on rank 0 (see [`Self::gather_ranges`]).
    ///
    /// # Errors
    /// Transport errors.
    pub fn gather_params(&mut self, params: &[f32]) -> Result<Vec<f32>> {
        self.gather_ranges(params)
    }

    /// Every stage's optimizer state on rank 0.
    ///
    /// # Errors
    /// Transport errors.
    pub fn gather_optimizer_state(&mut self, optimizer: &Optimizer) -> Result<OptimizerState> {
        match optimizer.state() {
            OptimizerState::Sgd => Ok(OptimizerState::Sgd),
            OptimizerState::Adam { m, v, step } => {
                let (m, v, step) = (m.clone(), v.clone(), *step);
                let m = self.gather_ranges(&m)?;
                let v = self.gather_ranges(&v)?;
                Ok(OptimizerState::Adam { m, v, step })
            }
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
