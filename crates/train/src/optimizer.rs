//! Optimizers over flat f32 parameter buffers, with state kept per element so that a
//! parameter-server shard can update just the ranges it owns.

use std::ops::Range;

use ringtrain_kernels::GradScale;
use serde::{Deserialize, Serialize};

use crate::config::OptimizerKind;
use crate::error::{Error, Result};

/// Adam's PyTorch defaults.
pub const ADAM_BETA1: f32 = 0.9;
/// Adam's PyTorch defaults.
pub const ADAM_BETA2: f32 = 0.999;
/// Adam's PyTorch defaults.
pub const ADAM_EPS: f32 = 1e-8;

/// State an optimizer carries between steps (what a checkpoint saves).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum OptimizerState {
    /// SGD keeps nothing.
    Sgd,
    /// Adam's moments, one per parameter element, and the number of updates applied.
    Adam {
        /// First moment.
        m: Vec<f32>,
        /// Second moment.
        v: Vec<f32>,
        /// Updates applied so far (the next one is `step + 1`).
        step: u32,
    },
}

/// An optimizer with its state for a flat parameter buffer of fixed length.
#[derive(Debug, Clone)]
pub struct Optimizer {
    kind: OptimizerKind,
    lr: f32,
    len: usize,
    state: OptimizerState,
}

impl Optimizer {
    /// A fresh optimizer for `len` parameter elements.
    pub fn new(kind: OptimizerKind, lr: f32, len: usize) -> Self {
        let state = match kind {
            OptimizerKind::Sgd => OptimizerState::Sgd,
            OptimizerKind::Adam => OptimizerState::Adam {
                m: vec![0.0; len],
                v: vec![0.0; len],
                step: 0,
            },
        };
        Optimizer {
            kind,
            lr,
            len,
            state,
        }
    }

    /// Which optimizer this is.
    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    /// The learning rate.
    pub fn learning_rate(&self) -> f32 {
        self.lr
    }

    /// The state (for checkpoints).
    pub fn state(&self) -> &OptimizerState {
        &self.state
    }

    /// Mutable state (parameter servers zero and combine shards of it).
    pub fn state_mut(&mut self) -> &mut OptimizerState {
        &mut self.state
    }

    /// Replaces the state with one loaded from a checkpoint, checking it fits.
    pub fn load_state(&mut self, state: OptimizerState) -> Result<()> {
        match (&state, self.kind) {
            (OptimizerState::Sgd, OptimizerKind::Sgd) => {}
            (OptimizerState::Adam { m, v, .. }, OptimizerKind::Adam) => {
                if m.len() != self.len || v.len() != self.len {
                    return Err(Error::Internal(format!(
                        "Adam state has {} / {} elements but the model has {} parameters",
                        m.len(),
                        v.len(),
                        self.len
                    )));
                }
            }
            (_, kind) => {
                return Err(Error::invalid(
                    "--optimizer",
                    kind,
                    "the checkpoint was written with the other optimizer; resume with the same --optimizer",
                ))
            }
        }
        self.state = state;
        Ok(())
    }

    /// Marks the start of one update (Adam counts steps for its bias correction).
    /// Call once per applied step, before [`Optimizer::apply_range`] calls of that step.
    pub fn begin_step(&mut self) {
        if let OptimizerState::Adam { step, .. } = &mut self.state {
            *step += 1;
        }
    }

    /// Updates `params[range]` from `grads` (both slices cover exactly `range`).
    pub fn apply_range(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
    ) -> Result<()> {
        self.apply_scaled(range, params, grads, GradScale::ONE)
    }

    /// [`Optimizer::apply_range`] on the gradients read through `scale` (the bits of
    /// scaling them first, without the passes over them).
    pub fn apply_scaled(
        &mut self,
        range: Range<usize>,
        params: &mut [f32],
        grads: &[f32],
        scale: GradScale,
    ) -> Result<()> {
        if range.end > self.len || params.len() != range.len() || grads.len() != range.len() {
            return Err(Error::Internal(format!(
                "optimizer range {range:?} with {} params / {} grads does not fit {} elements",
                params.len(),
                grads.len(),
                self.len
            )));
        }
        match &mut self.state {
            OptimizerState::Sgd => {
                ringtrain_kernels::par::sgd_step_scaled(params, grads, self.lr, 0.0, scale)?
            }
            OptimizerState::Adam { m, v, step } => ringtrain_kernels::par::adam_step_scaled(
                params,
                grads,
                &mut m[range.clone()],
                &mut v[range],
                [self.lr, ADAM_BETA1, ADAM_BETA2, ADAM_EPS, 0.0],
                (*step).max(1),
                scale,
            )?,
        }
        Ok(())
    }

    /// One full update of every parameter.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) -> Result<()> {
        self.step_scaled(params, grads, GradScale::ONE)
    }

    /// One full update of every parameter from the gradients read through `scale` (the
    /// bits of scaling them first, without the passes over them).
    pub fn step_scaled(
        &mut self,
        params: &mut [f32],
        grads: &[f32],
        scale: GradScale,
    ) -> Result<()> {
        self.begin_step();
        let n = params.len();
        self.apply_scaled(0..n, params, grads, scale)
    }
}

/// Dynamic loss scaling for f16 gradients: start at 2^16, halve on overflow (the step is
/// skipped), double after `growth_interval` clean steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// Current scale.
    pub scale: f32,
    /// Clean steps since the last change.
    pub clean_steps: u32,
    /// Clean steps needed before doubling.
    pub growth_interval: u32,
    /// Steps skipped because of overflow.
    pub skipped_steps: u64,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: 65536.0,
            clean_steps: 0,
            growth_interval: 2000,
            skipped_steps: 0,
        }
    }
}

impl LossScaler {
    /// Feeds the outcome of one step (overflow agreed by all ranks); returns true when
    /// the step must be skipped.
    pub fn update(&mut self, overflow: bool) -> bool {
        if overflow {
            self.scale = (self.scale * 0.5).max(1.0);
            self.clean_steps = 0;
            self.skipped_steps += 1;
            true
        } else {
            self.clean_steps += 1;
            if self.clean_steps >= self.growth_interval {
                self.scale = (self.scale * 2.0).min(f32::MAX / 2.0);
                self.clean_steps = 0;
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_scaler_halves_on_overflow_and_doubles_after_interval() {
        let mut s = LossScaler {
            growth_interval: 3,
            ..LossScaler::default()
        };
        assert!(s.update(true));
        assert_eq!(s.scale, 32768.0);
        assert!(!s.update(false));
        assert!(!s.update(false));
        assert_eq!(s.scale, 32768.0);
        assert!(!s.update(false));
        assert_eq!(s.scale, 65536.0);
        assert_eq!(s.skipped_steps, 1);
    }

    #[test]
    fn sgd_and_adam_update_ranges_like_whole_buffers() {
        for kind in [OptimizerKind::Sgd, OptimizerKind::Adam] {
            let grads: Vec<f32> = (0..10).map(|i| i as f32 * 0.1 - 0.4).collect();
            let mut whole = vec![1.0f32; 10];
            let mut a = Optimizer::new(kind, 0.01, 10);
            a.step(&mut whole, &grads).unwrap();
            let mut parts = vec![1.0f32; 10];
            let mut b = Optimizer::new(kind, 0.01, 10);
            b.begin_step();
            b.apply_range(0..4, &mut parts[0..4], &grads[0..4]).unwrap();
            b.apply_range(4..10, &mut parts[4..10], &grads[4..10])
                .unwrap();
            assert_eq!(whole, parts);
            assert_ne!(whole, vec![1.0f32; 10]);
        }
    }
}
