//! `independent`: every rank trains its own replica on its own batches with no
//! communication during the step: the ideal-scaling baseline the seeds compare with.
//! Only the initial broadcast and the final summary touch the network.

use std::time::Instant;

use ringtrain_collective::Communicator;

use super::StepInputs;
use super::{correction_factor, to_wire_f16, update_replica, DeviceStepInputs, StepContext};
use super::{StepOutcome, Wire};
use crate::config::ValidatedConfig;
use crate::error::Result;

/// The no-communication strategy.
pub struct Independent {
    comm: Communicator,
    max_gradient_norm: f32,
    ctx: StepContext,
}

impl Independent {
    /// Keeps the communicator for the caller, unused during the steps.
    pub fn new(cfg: &ValidatedConfig, comm: Communicator) -> Self {
        Independent {
            comm,
            max_gradient_norm: cfg.config().run.max_gradient_norm,
            ctx: StepContext::default(),
        }
    }

    pub(super) fn begin_step(&mut self, ctx: StepContext) {
        self.ctx = ctx;
    }

    pub(super) fn into_comm(self) -> Communicator {
        self.comm
    }

    /// The device-resident twin of [`Independent::finish_step`]: the f16 round trip, the
    /// overflow check and the update all run on the model's device.
    pub(super) fn finish_device_step(
        &mut self,
        inputs: DeviceStepInputs<'_>,
    ) -> Result<StepOutcome> {
        let DeviceStepInputs {
            model,
            mut local,
            control: _,
        } = inputs;
        let start = Instant::now();
        let wire = self.ctx.wire;
        let cast_overflow = model.cast_overflowed()?;
        let correction = correction_factor(wire, local.examples);
        let update = model.update(correction, self.max_gradient_norm, cast_overflow)?;
        local.overflow = f64::from(u8::from(update.skipped));
        Ok(StepOutcome {
            stats: local,
            skipped: update.skipped,
            grad_norm: update.grad_norm,
            communication_seconds: 0.0,
            optimizer_seconds: start.elapsed().as_secs_f64(),
        })
    }

    pub(super) fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        let StepInputs {
            params,
            grads,
            mut local,
            optimizer,
            control: _,
        } = inputs;
        let start = Instant::now();
        let wire = self.ctx.wire;
        let wire_overflow = match wire {
            // f16 gradients: round them through f16 as the wire would, catching overflow.
            Wire::F16 { scale } => {
                let (half, overflow) = to_wire_f16(grads, scale)?;
                ringtrain_kernels::par::f16_to_f32_unscaled(&half, 1.0, grads)?;
                overflow
            }
            Wire::F32 => false,
        };
        let grad_norm = if wire_overflow {
            None
        } else {
            let correction = correction_factor(wire, local.examples);
            update_replica(params, grads, correction, self.max_gradient_norm, optimizer)?
        };
        local.overflow = f64::from(u8::from(grad_norm.is_none()));
        Ok(StepOutcome {
            stats: local,
            skipped: grad_norm.is_none(),
            grad_norm: grad_norm.unwrap_or(0.0),
            communication_seconds: 0.0,
            optimizer_seconds: start.elapsed().as_secs_f64(),
        })
    }
}
