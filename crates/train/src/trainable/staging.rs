//! A data batch as the model's batch: the data crate makes batches time-major, the
//! layout the models read, so staging only borrows the batch's arrays.

use ringtrain_model::{Backend, GradsReady, Model, NmtModel, RnnLm, StepStats};

use super::Batch;
use crate::error::{Error, Result};

/// A model of the model crate that trains on one kind of [`Batch`].
pub trait TrainsOnBatch: Model {
    /// [`Model::forward_backward`] on `batch`, viewed as the model's batch.
    ///
    /// # Errors
    /// `InvalidValue` naming `--model` when `batch` is for the other model; the model's
    /// errors.
    fn train_on(
        &mut self,
        batch: &Batch,
        on_grads_ready: &mut GradsReady<'_, <Self::Backend as Backend>::Buffer>,
    ) -> Result<StepStats>;
}

impl<B: Backend> TrainsOnBatch for NmtModel<B> {
    fn train_on(
        &mut self,
        batch: &Batch,
        on_grads_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<StepStats> {
        let Batch::Nmt(b) = batch else {
            return Err(wrong_batch("nmt"));
        };
        let view = ringtrain_model::NmtBatchView {
            batch: b.batch_size,
            src_len: b.src_len,
            tgt_len: b.tgt_len,
            src: &b.source,
            tgt_in: &b.target_input,
            tgt_out: &b.target_output,
            tgt_mask: &b.target_mask,
            src_lengths: Some(&b.source_lengths),
        };
        Ok(self.forward_backward(&view, on_grads_ready)?)
    }
}

impl<B: Backend> TrainsOnBatch for RnnLm<B> {
    fn train_on(
        &mut self,
        batch: &Batch,
        on_grads_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<StepStats> {
        let Batch::Lm(b) = batch else {
            return Err(wrong_batch("rnnlm"));
        };
        let view = ringtrain_model::LmBatchView {
            batch: b.batch_size,
            len: b.steps,
            inputs: &b.inputs,
            targets: &b.targets,
            mask: &b.mask,
            first_in_epoch: b.first_in_epoch,
        };
        Ok(self.forward_backward(&view, on_grads_ready)?)
    }
}

fn wrong_batch(model: &str) -> Error {
    Error::invalid(
        "--model",
        model,
        "the input pipeline produced batches for the other model; build the pipeline from the same config",
    )
}
