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

    /// [`Model::forward_loss`] on `batch` (no gradients), viewed as the model's batch.
    ///
    /// # Errors
    /// As [`TrainsOnBatch::train_on`].
    fn loss_on(&mut self, batch: &Batch) -> Result<StepStats>;

    /// [`TrainsOnBatch::loss_on`] over a whole held-out part, in order, summed. A model
    /// that carries state from one batch to the next carries it across `batches` and
    /// leaves the training run's carried state as it found it.
    ///
    /// # Errors
    /// As [`TrainsOnBatch::train_on`].
    fn held_out_loss(&mut self, batches: &[Batch]) -> Result<StepStats> {
        summed_losses(self, batches)
    }
}

/// [`TrainsOnBatch::loss_on`] over `batches`, in order, summed.
fn summed_losses<M: TrainsOnBatch + ?Sized>(model: &mut M, batches: &[Batch]) -> Result<StepStats> {
    let mut sum = StepStats::default();
    for batch in batches {
        let stats = model.loss_on(batch)?;
        sum.loss_sum += stats.loss_sum;
        sum.tokens += stats.tokens;
        sum.launches += stats.launches;
    }
    Ok(sum)
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
        Ok(self.forward_backward(&nmt_view(b), on_grads_ready)?)
    }

    fn loss_on(&mut self, batch: &Batch) -> Result<StepStats> {
        let Batch::Nmt(b) = batch else {
            return Err(wrong_batch("nmt"));
        };
        Ok(self.forward_loss(&nmt_view(b))?)
    }
}

/// `b` as the translation model's batch.
fn nmt_view(b: &ringtrain_data::NmtBatch) -> ringtrain_model::NmtBatchView<'_> {
    ringtrain_model::NmtBatchView {
        batch: b.batch_size,
        src_len: b.src_len,
        tgt_len: b.tgt_len,
        src: &b.source,
        tgt_in: &b.target_input,
        tgt_out: &b.target_output,
        tgt_mask: &b.target_mask,
        src_lengths: Some(&b.source_lengths),
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
        Ok(self.forward_backward(&lm_view(b), on_grads_ready)?)
    }

    fn loss_on(&mut self, batch: &Batch) -> Result<StepStats> {
        let Batch::Lm(b) = batch else {
            return Err(wrong_batch("rnnlm"));
        };
        Ok(self.forward_loss(&lm_view(b))?)
    }

    /// The held-out text is read window after window like the training text (its first
    /// batch starts an epoch), so the state is carried across it; the training run's
    /// carried state is set aside meanwhile and put back after, also on an error.
    fn held_out_loss(&mut self, batches: &[Batch]) -> Result<StepStats> {
        let mut training_state = ringtrain_model::LmState::default();
        self.swap_state(&mut training_state);
        let result = summed_losses(self, batches);
        self.swap_state(&mut training_state);
        result
    }
}

/// `b` as the language model's batch.
fn lm_view(b: &ringtrain_data::LmBatch) -> ringtrain_model::LmBatchView<'_> {
    ringtrain_model::LmBatchView {
        batch: b.batch_size,
        len: b.steps,
        inputs: &b.inputs,
        targets: &b.targets,
        mask: &b.mask,
        first_in_epoch: b.first_in_epoch,
    }
}

fn wrong_batch(model: &str) -> Error {
    Error::invalid(
        "--model",
        model,
        "the input pipeline produced batches for the other model; build the pipeline from the same config",
    )
}
