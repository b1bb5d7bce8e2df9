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
pub(crate) fn nmt_view(b: &ringtrain_data::NmtBatch) -> ringtrain_model::NmtBatchView<'_> {
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
pub(crate) fn lm_view(b: &ringtrain_data::LmBatch) -> ringtrain_model::LmBatchView<'_> {
    ringtrain_model::LmBatchView {
        batch: b.batch_size,
        len: b.steps,
        inputs: &b.inputs,
        targets: &b.targets,
        mask: &b.mask,
        first_in_epoch: b.first_in_epoch,
    }
}

pub(crate) fn wrong_batch(model: &str) -> Error {
    Error::invalid(
        "--model",
        model,
        "the input pipeline produced batches for the other model; build the pipeline from the same config",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use ringtrain_data::LmBatch;
    use ringtrain_model::{CpuBackend, LmConfig, LstmImpl};

    fn lm() -> RnnLm<CpuBackend> {
        let config = LmConfig {
            vocab: 9,
            emb: 4,
            hidden: 5,
            layers: 2,
            lstm: LstmImpl::Fused,
            init_scale: 0.5,
            forget_bias: 1.0,
        };
        RnnLm::new(CpuBackend::new(1).expect("cpu backend"), config, 7).expect("model")
    }

    /// Window `w` of a fixed 2-column text stream, 3 steps long.
    fn window(w: u32, first_in_epoch: bool) -> Batch {
        let ids = |shift: u32| (0..6).map(|i| (i * 5 + w * 3 + shift) % 9).collect();
        Batch::Lm(LmBatch {
            batch_size: 2,
            steps: 3,
            inputs: ids(0),
            targets: ids(1),
            mask: vec![1.0; 6],
            first_in_epoch,
        })
    }

    /// The held-out windows carry the state from one to the next, as training does, and
    /// the training run's own carried state is the same after the evaluation as before.
    #[test]
    fn held_out_windows_carry_the_state_and_leave_the_training_state_alone() {
        let held_out = [window(5, true), window(6, false)];
        let mut model = lm();
        let carried = model.held_out_loss(&held_out).expect("evaluates").loss_sum;
        let mut one_by_one = lm();
        let first = one_by_one.loss_on(&held_out[0]).expect("window 1").loss_sum;
        let second = one_by_one.loss_on(&held_out[1]).expect("window 2").loss_sum;
        let from_zeros = lm().loss_on(&window(6, true)).expect("window 2").loss_sum;
        assert_eq!(carried, first + second);
        assert_ne!(second, from_zeros, "the carried state made no difference");

        // Training carries a state; an evaluation in between leaves it as it was.
        let mut trained = lm();
        trained.loss_on(&window(0, true)).expect("window 1");
        let mut evaluated = lm();
        evaluated.loss_on(&window(0, true)).expect("window 1");
        evaluated.held_out_loss(&held_out).expect("evaluates");
        let next = |m: &mut RnnLm<CpuBackend>| m.loss_on(&window(1, false)).expect("window 2");
        assert_eq!(next(&mut trained).loss_sum, next(&mut evaluated).loss_sum);
    }
}
