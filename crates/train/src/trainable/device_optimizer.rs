//! [`DeviceOptimizer`]: the optimizer's state in device buffers and its update, one
//! implementation for every model that updates on its device (a whole model,
//! [`super::GpuTrainable`], and a pipeline stage, `GpuPipelineStage`, over its own
//! parameter range).

use ringtrain_cuda::optim as device_optim;
use ringtrain_cuda::{AsDevSlice, AsDevSliceMut, Gpu, GpuBuffer};

use crate::config::OptimizerKind;
use crate::error::{gpu_err, Error, Result};
use crate::optimizer::{OptimizerState, ADAM_BETA1, ADAM_BETA2, ADAM_EPS};

/// The optimizer's state on the device, for `len` parameters.
pub(crate) struct DeviceOptimizer {
    kind: OptimizerKind,
    lr: f32,
    /// Adam's first and second moments.
    moments: Option<(GpuBuffer<f32>, GpuBuffer<f32>)>,
    /// Adam's updates applied so far.
    step: u32,
}

impl DeviceOptimizer {
    /// `kind` with `learning_rate` for `len` parameters, its state zeros on `gpu`.
    ///
    /// # Errors
    /// Device errors of the allocations.
    pub(crate) fn new(
        gpu: &Gpu,
        kind: OptimizerKind,
        learning_rate: f32,
        len: usize,
    ) -> Result<Self> {
        let moments = match kind {
            OptimizerKind::Sgd => None,
            OptimizerKind::Adam => Some((
                gpu.zeros::<f32>(len).map_err(gpu_err)?,
                gpu.zeros::<f32>(len).map_err(gpu_err)?,
            )),
        };
        Ok(DeviceOptimizer {
            kind,
            lr: learning_rate,
            moments,
            step: 0,
        })
    }

    /// The elements of the state per moment (0 for SGD, which keeps none).
    pub(crate) fn state_len(&self) -> usize {
        self.moments.as_ref().map_or(0, |(m, _)| m.len())
    }

    /// One update of `params` with `grads` (final: averaged, clipped) on the device.
    ///
    /// # Errors
    /// Device errors; lengths that differ from the state's.
    pub(crate) fn apply(
        &mut self,
        gpu: &Gpu,
        params: &mut impl AsDevSliceMut<f32>,
        grads: &impl AsDevSlice<f32>,
    ) -> Result<()> {
        match (&mut self.moments, self.kind) {
            (None, OptimizerKind::Sgd) => {
                device_optim::sgd_step(gpu, params, grads, self.lr, 0.0).map_err(gpu_err)
            }
            (Some((m, v)), OptimizerKind::Adam) => {
                self.step += 1;
                device_optim::adam_step(
                    gpu, params, grads, m, v, self.lr, ADAM_BETA1, ADAM_BETA2, ADAM_EPS, 0.0,
                    self.step,
                )
                .map_err(gpu_err)
            }
            (_, kind) => Err(Error::Internal(format!(
                "the device optimizer {kind} has the other optimizer's state"
            ))),
        }
    }

    /// The state, downloaded (for a checkpoint).
    ///
    /// # Errors
    /// Device errors.
    pub(crate) fn state(&self) -> Result<OptimizerState> {
        Ok(match &self.moments {
            None => OptimizerState::Sgd,
            Some((m, v)) => OptimizerState::Adam {
                m: m.to_host().map_err(gpu_err)?,
                v: v.to_host().map_err(gpu_err)?,
                step: self.step,
            },
        })
    }

    /// Replaces the state with `state` (a checkpoint's), uploading it; `owner` names
    /// what holds the parameters in the error of a state of another size.
    ///
    /// # Errors
    /// `InvalidValue` naming `--optimizer` for another optimizer's state; a state of
    /// another size; device errors.
    pub(crate) fn load_state(&mut self, state: OptimizerState, owner: &str) -> Result<()> {
        let n = self.state_len();
        match (state, &mut self.moments) {
            (OptimizerState::Sgd, None) => {}
            (OptimizerState::Adam { m, v, step }, Some((dm, dv))) => {
                if m.len() != n || v.len() != n {
                    return Err(Error::Internal(format!(
                        "Adam state has {} / {} elements but the {owner} has {n} parameters",
                        m.len(),
                        v.len()
                    )));
                }
                dm.copy_from_host(&m).map_err(gpu_err)?;
                dv.copy_from_host(&v).map_err(gpu_err)?;
                self.step = step;
            }
            (_, _) => {
                return Err(Error::invalid(
                    "--optimizer",
                    self.kind,
                    "the checkpoint was written with the other optimizer; resume with the same --optimizer",
                ))
            }
        }
        Ok(())
    }
}
