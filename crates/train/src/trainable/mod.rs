//! What the training loop needs from a model, and the batch type it feeds it.
//!
//! The loop and the variable-update strategies see a model as one flat `f32` parameter
//! buffer (with named ranges, one per tensor) and a `forward_backward` call that fills a
//! flat gradient buffer of the same length and reports ranges as soon as backward has
//! finished them, so communication can start while backward continues.

use std::ops::Range;

use ringtrain_data::{LmBatch, NmtBatch};

use crate::error::Result;

/// One tensor of the flat parameter buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Name, e.g. `encoder/l0/w_ih`.
    pub name: String,
    /// Elements of the flat buffer it occupies.
    pub range: Range<usize>,
}

/// A batch for either model.
#[derive(Debug, Clone)]
pub enum Batch {
    /// Source and target sentences.
    Nmt(NmtBatch),
    /// Language-model windows.
    Lm(LmBatch),
}

impl Batch {
    /// Words the throughput meter counts: source + target (NMT), predicted tokens (LM).
    pub fn words(&self) -> usize {
        match self {
            Batch::Nmt(b) => b.words(),
            Batch::Lm(b) => b.words(),
        }
    }

    /// Rows `rows` of this batch as a batch of their own (for splitting one global batch
    /// over ranks). Rows past the end are dropped.
    pub fn slice_rows(&self, rows: Range<usize>) -> Batch {
        fn cut<T: Clone>(v: &[T], width: usize, rows: &Range<usize>) -> Vec<T> {
            v[rows.start * width..rows.end * width].to_vec()
        }
        match self {
            Batch::Nmt(b) => {
                let rows = rows.start.min(b.batch_size)..rows.end.min(b.batch_size);
                Batch::Nmt(NmtBatch {
                    batch_size: rows.len(),
                    src_len: b.src_len,
                    tgt_len: b.tgt_len,
                    source: cut(&b.source, b.src_len, &rows),
                    source_lengths: b.source_lengths[rows.clone()].to_vec(),
                    target_input: cut(&b.target_input, b.tgt_len, &rows),
                    target_output: cut(&b.target_output, b.tgt_len, &rows),
                    target_mask: cut(&b.target_mask, b.tgt_len, &rows),
                    target_lengths: b.target_lengths[rows].to_vec(),
                })
            }
            Batch::Lm(b) => {
                let rows = rows.start.min(b.batch_size)..rows.end.min(b.batch_size);
                Batch::Lm(LmBatch {
                    batch_size: rows.len(),
                    steps: b.steps,
                    inputs: cut(&b.inputs, b.steps, &rows),
                    targets: cut(&b.targets, b.steps, &rows),
                    mask: cut(&b.mask, b.steps, &rows),
                    first_in_epoch: b.first_in_epoch,
                })
            }
        }
    }

    /// Examples (rows) in the batch: the unit gradients are averaged over.
    pub fn examples(&self) -> usize {
        match self {
            Batch::Nmt(b) => b.batch_size,
            Batch::Lm(b) => b.batch_size,
        }
    }
}

/// What one forward + backward pass produced besides the gradients.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PassOutput {
    /// Sum of the masked token losses of the batch.
    pub loss_sum: f64,
    /// Target tokens that carried a loss.
    pub target_tokens: f64,
    /// Seconds spent in forward (including the loss).
    pub forward_seconds: f64,
    /// Seconds spent in backward.
    pub backward_seconds: f64,
    /// Kernel launches (or kernel calls on the CPU) the pass issued.
    pub launches: u64,
}

/// Called with each gradient range as soon as backward has finished writing it.
pub type ReadyCallback<'a> = dyn FnMut(Range<usize>, &[f32]) -> Result<()> + 'a;

/// A model the trainer can train.
pub trait TrainableModel: Send {
    /// The tensors of the flat parameter buffer, in buffer order, covering it exactly.
    fn param_specs(&self) -> Vec<ParamSpec>;
    /// The flat parameters.
    fn params(&self) -> &[f32];
    /// The flat parameters, for broadcasts and checkpoints.
    fn params_mut(&mut self) -> &mut [f32];
    /// The flat parameters and the flat gradients (same layout), for the update.
    fn params_and_grads_mut(&mut self) -> (&mut [f32], &mut [f32]);
    /// Forward and backward on `batch`. Overwrites the gradient buffer with
    /// `∂(loss_sum)/∂θ` (the gradient of the summed token losses) and calls `on_ready`
    /// for disjoint ranges that together cover the buffer, each as soon as it is final.
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput>;
    /// A short description for logs (`nmt fused uni 2+2 layers, 64 units, ...`).
    fn describe(&self) -> String;
}
