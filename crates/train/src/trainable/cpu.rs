//! [`CpuTrainable`]: a model of the model crate whose buffers live in host memory.

use ringtrain_model::{Backend, Model};

use super::pass::{run_forward, run_pass, AtOnce};
use super::staging::TrainsOnBatch;
use super::{param_specs, Batch, ParamSpec, PassOutput, ReadyCallback, TrainableModel};
use crate::error::Result;

/// A host-memory model as a [`TrainableModel`]: the trainer reads and writes the model's
/// own buffers, and each gradient range reaches it the moment backward finishes it.
pub struct CpuTrainable<M> {
    model: M,
    specs: Vec<ParamSpec>,
    description: String,
}

impl<M: Model> CpuTrainable<M> {
    /// Wraps `model`; `description` is what the logs call it.
    pub fn new(model: M, description: String) -> Self {
        CpuTrainable {
            specs: param_specs(model.layout()),
            model,
            description,
        }
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.model
    }
}

impl<M> TrainableModel for CpuTrainable<M>
where
    M: TrainsOnBatch + Send,
    M::Backend: Backend<Buffer = Vec<f32>>,
{
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    fn params(&self) -> Result<&[f32]> {
        Ok(self.model.params())
    }
    fn params_mut(&mut self) -> Result<&mut [f32]> {
        Ok(self.model.params_mut())
    }
    fn params_and_grads_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        let (p, g) = self.model.params_and_grads_mut();
        Ok((p, g))
    }
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        let model = &mut self.model;
        run_pass(|ready| model.train_on(batch, ready), &mut AtOnce, on_ready)
    }
    fn evaluate(&mut self, batches: &[Batch]) -> Result<PassOutput> {
        let model = &mut self.model;
        run_forward(|| model.held_out_loss(batches))
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}
