//! The batches the trainer consumes.
//!
//! Every 2-D array is a flat `Vec` in **time-major** order, the layout the models read:
//! token `t` of example `b` of a `[len, batch]` array is at `t * batch + b`. Examples
//! are the batch's *columns*; [`NmtBatch::columns`] and [`LmBatch::columns`] cut a
//! batch into the examples one rank takes.
//!
//! # Word counts
//!
//! Throughput is reported in words per second with the benchmark's rule
//! "words = source words + target words":
//!
//! * source words = real (non-padding) source tokens, `sum(source_lengths)`;
//! * target words = real decoder positions, `sum(target_lengths)`, which is the number of
//!   1.0 entries of the mask: the target tokens plus the one added `</s>` (or `<s>` on the
//!   input side), as TensorFlow NMT counts `target_sequence_length`.
//!
//! For synthetic data every position is real, so a batch of `b` sequences of length `L`
//! counts `2 * b * L` words.

use std::ops::Range;

use crate::vocab::{BOS_ID, EOS_ID};

/// A batch for the encoder-decoder translation model.
#[derive(Clone, Debug, PartialEq)]
pub struct NmtBatch {
    /// Sentences in this batch.
    pub batch_size: usize,
    /// Padded source length: the steps of [`NmtBatch::source`].
    pub src_len: usize,
    /// Padded decoder length: the steps of the `target_*` arrays.
    pub tgt_len: usize,
    /// Source ids `[src_len, batch]`; padding is [`EOS_ID`].
    pub source: Vec<u32>,
    /// Real source tokens per sentence.
    pub source_lengths: Vec<usize>,
    /// Decoder inputs `[tgt_len, batch]`: `<s>` then the target; padding is [`EOS_ID`].
    pub target_input: Vec<u32>,
    /// Decoder labels `[tgt_len, batch]`: the target then `</s>`; padding is [`EOS_ID`].
    pub target_output: Vec<u32>,
    /// `[tgt_len, batch]`: 1.0 at real decoder positions, 0.0 at padding.
    pub target_mask: Vec<f32>,
    /// Real decoder positions per sentence (target tokens + 1).
    pub target_lengths: Vec<usize>,
}

impl NmtBatch {
    /// Builds a padded batch from `(source, target)` sentences of ids (without `<s>` or
    /// `</s>`): target input = `<s>` + target, target output = target + `</s>`.
    pub fn from_pairs<S, T>(pairs: &[(S, T)]) -> NmtBatch
    where
        S: AsRef<[u32]>,
        T: AsRef<[u32]>,
    {
        let batch_size = pairs.len();
        let src_len = pairs
            .iter()
            .map(|(s, _)| s.as_ref().len())
            .max()
            .unwrap_or(0);
        let tgt_len = pairs
            .iter()
            .map(|(_, t)| t.as_ref().len() + 1)
            .max()
            .unwrap_or(0);
        let mut source = vec![EOS_ID; batch_size * src_len];
        let mut target_input = vec![EOS_ID; batch_size * tgt_len];
        let mut target_output = vec![EOS_ID; batch_size * tgt_len];
        let mut target_mask = vec![0.0; batch_size * tgt_len];
        let mut source_lengths = Vec::with_capacity(batch_size);
        let mut target_lengths = Vec::with_capacity(batch_size);
        for (b, (src, tgt)) in pairs.iter().enumerate() {
            let (src, tgt) = (src.as_ref(), tgt.as_ref());
            for (t, &id) in src.iter().enumerate() {
                source[t * batch_size + b] = id;
            }
            target_input[b] = BOS_ID;
            for (t, &id) in tgt.iter().enumerate() {
                target_input[(t + 1) * batch_size + b] = id;
                target_output[t * batch_size + b] = id;
            }
            target_output[tgt.len() * batch_size + b] = EOS_ID;
            for t in 0..=tgt.len() {
                target_mask[t * batch_size + b] = 1.0;
            }
            source_lengths.push(src.len());
            target_lengths.push(tgt.len() + 1);
        }
        NmtBatch {
            batch_size,
            src_len,
            tgt_len,
            source,
            source_lengths,
            target_input,
            target_output,
            target_mask,
            target_lengths,
        }
    }

    /// Real source tokens in the batch.
    pub fn source_words(&self) -> usize {
        self.source_lengths.iter().sum()
    }

    /// Real decoder positions in the batch (the 1.0 entries of the mask).
    pub fn target_words(&self) -> usize {
        self.target_lengths.iter().sum()
    }

    /// Source words + target words: what the throughput meter counts (see the module docs).
    pub fn words(&self) -> usize {
        self.source_words() + self.target_words()
    }

    /// Examples `examples` of this batch as a batch of their own (the columns one rank
    /// takes of a global batch). Examples past the end are dropped.
    pub fn columns(&self, examples: Range<usize>) -> NmtBatch {
        let examples = clamp(examples, self.batch_size);
        NmtBatch {
            batch_size: examples.len(),
            src_len: self.src_len,
            tgt_len: self.tgt_len,
            source: cut_columns(&self.source, self.batch_size, &examples),
            source_lengths: self.source_lengths[examples.clone()].to_vec(),
            target_input: cut_columns(&self.target_input, self.batch_size, &examples),
            target_output: cut_columns(&self.target_output, self.batch_size, &examples),
            target_mask: cut_columns(&self.target_mask, self.batch_size, &examples),
            target_lengths: self.target_lengths[examples].to_vec(),
        }
    }
}

/// A batch for the language model: predict `targets` from `inputs`.
#[derive(Clone, Debug, PartialEq)]
pub struct LmBatch {
    /// Examples (independent text streams) in this batch: its columns.
    pub batch_size: usize,
    /// Time steps per example.
    pub steps: usize,
    /// Input ids `[steps, batch]`; padding is 0.
    pub inputs: Vec<u32>,
    /// Target ids `[steps, batch]` (each input's next token); padding is 0.
    pub targets: Vec<u32>,
    /// `[steps, batch]`: 1.0 at real positions, 0.0 at padding (only in the last window
    /// of an epoch).
    pub mask: Vec<f32>,
    /// True for the first window of an epoch: reset the carried recurrent state.
    pub first_in_epoch: bool,
}

impl LmBatch {
    /// Predicted tokens in the batch (the 1.0 entries of the mask).
    pub fn words(&self) -> usize {
        self.mask.iter().filter(|&&m| m != 0.0).count()
    }

    /// Examples `examples` of this batch as a batch of their own (see
    /// [`NmtBatch::columns`]).
    pub fn columns(&self, examples: Range<usize>) -> LmBatch {
        let examples = clamp(examples, self.batch_size);
        LmBatch {
            batch_size: examples.len(),
            steps: self.steps,
            inputs: cut_columns(&self.inputs, self.batch_size, &examples),
            targets: cut_columns(&self.targets, self.batch_size, &examples),
            mask: cut_columns(&self.mask, self.batch_size, &examples),
            first_in_epoch: self.first_in_epoch,
        }
    }
}

/// `range` cut to `0..len` (empty when reversed).
fn clamp(range: Range<usize>, len: usize) -> Range<usize> {
    let end = range.end.min(len);
    range.start.min(end)..end
}

/// Columns `examples` of a time-major array with `batch` columns (of each step, the
/// columns it has).
fn cut_columns<T: Copy>(data: &[T], batch: usize, examples: &Range<usize>) -> Vec<T> {
    data.chunks(batch.max(1))
        .flat_map(|step| step[clamp(examples.clone(), step.len())].iter().copied())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_pairs_pads_and_counts() {
        let batch = NmtBatch::from_pairs(&[(vec![5, 6, 7], vec![8]), (vec![9], vec![10, 11, 12])]);
        assert_eq!((batch.batch_size, batch.src_len, batch.tgt_len), (2, 3, 4));
        // Time-major: step t of both sentences, then step t + 1.
        assert_eq!(batch.source, [5, 9, 6, EOS_ID, 7, EOS_ID]);
        assert_eq!(
            batch.target_input,
            [BOS_ID, BOS_ID, 8, 10, EOS_ID, 11, EOS_ID, 12]
        );
        assert_eq!(
            batch.target_output,
            [8, 10, EOS_ID, 11, EOS_ID, 12, EOS_ID, EOS_ID]
        );
        assert_eq!(batch.target_mask, [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]);
        assert_eq!(batch.source_lengths, [3, 1]);
        assert_eq!(batch.target_lengths, [2, 4]);
        assert_eq!(batch.words(), 4 + 6);
        let second = batch.columns(1..2);
        assert_eq!(second.batch_size, 1);
        assert_eq!(second.source, [9, EOS_ID, EOS_ID]);
        assert_eq!(second.target_input, [BOS_ID, 10, 11, 12]);
        assert_eq!(second.target_output, [10, 11, 12, EOS_ID]);
        assert_eq!(
            (second.source_lengths, second.target_lengths),
            (vec![1], vec![4])
        );
    }

    #[test]
    fn lm_words_count_mask() {
        let batch = LmBatch {
            batch_size: 2,
            steps: 2,
            inputs: vec![1, 3, 2, 0],
            targets: vec![2, 4, 3, 0],
            mask: vec![1.0, 1.0, 1.0, 0.0],
            first_in_epoch: true,
        };
        assert_eq!(batch.words(), 3);
        let second = batch.columns(1..5);
        assert_eq!(
            (second.batch_size, second.inputs, second.mask),
            (1, vec![3, 0], vec![1.0, 0.0])
        );
    }
}
