//! `independent`: every rank trains its own replica on its own batches with no
//! communication during the step: the ideal-scaling baseline the seeds compare with.
//! Only the initial broadcast and the final summary touch the network.

use std::time::Instant;

use ringtrain_collective::Communicator;

use super::{correction_factor, update_replica, StepInputs, StepOutcome};
use crate::error::Result;

/// The no-communication strategy.
pub struct Independent {
    comm: Communicator,
}

impl Independent {
    /// Keeps the communicator for the final summary only.
    pub fn new(comm: Communicator) -> Self {
        Independent { comm }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks in the world.
    pub fn world(&self) -> usize {
        self.comm.size()
    }

    pub(super) fn comm(&mut self) -> &mut Communicator {
        &mut self.comm
    }

    pub(super) fn into_comm(self) -> Communicator {
        self.comm
    }

    pub(super) fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        let StepInputs {
            params,
            grads,
            mut local,
            wire_scale,
            max_gradient_norm,
            optimizer,
        } = inputs;
        let start = Instant::now();
        let overflow = if wire_scale != 1.0 {
            // fp16 gradients: round them through f16 as the wire would, catching overflow.
            let mut half = vec![half::f16::ZERO; grads.len()];
            let overflow = ringtrain_kernels::par::f32_to_f16_scaled(grads, wire_scale, &mut half)?;
            ringtrain_kernels::par::f16_to_f32_unscaled(&half, 1.0, grads)?;
            overflow
        } else {
            ringtrain_kernels::has_non_finite_f32(grads)
        };
        local.overflow = f64::from(u8::from(overflow));
        let mut grad_norm = 0.0;
        if !overflow {
            let correction = correction_factor(wire_scale, local.examples);
            grad_norm = update_replica(params, grads, correction, max_gradient_norm, optimizer)?;
        }
        Ok(StepOutcome {
            stats: local,
            skipped: overflow,
            grad_norm,
            communication_seconds: 0.0,
            optimizer_seconds: start.elapsed().as_secs_f64(),
        })
    }
}
