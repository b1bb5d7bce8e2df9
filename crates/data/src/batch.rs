//! The batches the trainer consumes.
//!
//! Every 2-D array is a flat `Vec` in **batch-major, row-major** order: element
//! `(b, t)` of a `[batch, len]` array is at `b * len + t`. Use
//! [`to_time_major`] when a model wants `[len, batch]`.
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

use crate::vocab::{BOS_ID, EOS_ID};

/// A batch for the encoder-decoder translation model.
#[derive(Clone, Debug, PartialEq)]
pub struct NmtBatch {
    /// Sentences in this batch.
    pub batch_size: usize,
    /// Padded source length (columns of [`NmtBatch::source`]).
    pub src_len: usize,
    /// Padded decoder length (columns of the `target_*` arrays).
    pub tgt_len: usize,
    /// Source ids `[batch, src_len]`; padding is [`EOS_ID`].
    pub source: Vec<u32>,
    /// Real source tokens per sentence.
    pub source_lengths: Vec<usize>,
    /// Decoder inputs `[batch, tgt_len]`: `<s>` then the target; padding is [`EOS_ID`].
    pub target_input: Vec<u32>,
    /// Decoder labels `[batch, tgt_len]`: the target then `</s>`; padding is [`EOS_ID`].
    pub target_output: Vec<u32>,
    /// `[batch, tgt_len]`: 1.0 at real decoder positions, 0.0 at padding.
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
            source[b * src_len..b * src_len + src.len()].copy_from_slice(src);
            let row = b * tgt_len;
            target_input[row] = BOS_ID;
            target_input[row + 1..row + 1 + tgt.len()].copy_from_slice(tgt);
            target_output[row..row + tgt.len()].copy_from_slice(tgt);
            target_output[row + tgt.len()] = EOS_ID;
            target_mask[row..row + tgt.len() + 1].fill(1.0);
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

    /// The source ids as `[src_len, batch]`.
    pub fn source_time_major(&self) -> Vec<u32> {
        to_time_major(&self.source, self.batch_size, self.src_len)
    }

    /// The target input ids as `[tgt_len, batch]`.
    pub fn target_input_time_major(&self) -> Vec<u32> {
        to_time_major(&self.target_input, self.batch_size, self.tgt_len)
    }

    /// The target output ids as `[tgt_len, batch]`.
    pub fn target_output_time_major(&self) -> Vec<u32> {
        to_time_major(&self.target_output, self.batch_size, self.tgt_len)
    }

    /// The mask as `[tgt_len, batch]`.
    pub fn target_mask_time_major(&self) -> Vec<f32> {
        to_time_major(&self.target_mask, self.batch_size, self.tgt_len)
    }
}

/// A batch for the language model: predict `targets` from `inputs`.
#[derive(Clone, Debug, PartialEq)]
pub struct LmBatch {
    /// Rows (independent text streams) in this batch.
    pub batch_size: usize,
    /// Time steps per row.
    pub steps: usize,
    /// Input ids `[batch, steps]`; padding is 0.
    pub inputs: Vec<u32>,
    /// Target ids `[batch, steps]` (each input's next token); padding is 0.
    pub targets: Vec<u32>,
    /// `[batch, steps]`: 1.0 at real positions, 0.0 at padding (only in the last window
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

    /// The inputs as `[steps, batch]`.
    pub fn inputs_time_major(&self) -> Vec<u32> {
        to_time_major(&self.inputs, self.batch_size, self.steps)
    }

    /// The targets as `[steps, batch]`.
    pub fn targets_time_major(&self) -> Vec<u32> {
        to_time_major(&self.targets, self.batch_size, self.steps)
    }

    /// The mask as `[steps, batch]`.
    pub fn mask_time_major(&self) -> Vec<f32> {
        to_time_major(&self.mask, self.batch_size, self.steps)
    }
}

/// Transposes a batch-major `[batch, len]` array into time-major `[len, batch]`.
/// Entries missing from a `data` shorter than `batch * len` come out as `T::default()`;
/// extra entries are ignored.
pub fn to_time_major<T: Copy + Default>(data: &[T], batch: usize, len: usize) -> Vec<T> {
    let mut out = vec![T::default(); batch * len];
    for (b, row) in data.chunks(len.max(1)).take(batch).enumerate() {
        for (t, &value) in row.iter().enumerate() {
            out[t * batch + b] = value;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_pairs_pads_and_counts() {
        let batch = NmtBatch::from_pairs(&[(vec![5, 6, 7], vec![8]), (vec![9], vec![10, 11, 12])]);
        assert_eq!((batch.batch_size, batch.src_len, batch.tgt_len), (2, 3, 4));
        assert_eq!(batch.source, [5, 6, 7, 9, EOS_ID, EOS_ID]);
        assert_eq!(
            batch.target_input,
            [BOS_ID, 8, EOS_ID, EOS_ID, BOS_ID, 10, 11, 12]
        );
        assert_eq!(
            batch.target_output,
            [8, EOS_ID, EOS_ID, EOS_ID, 10, 11, 12, EOS_ID]
        );
        assert_eq!(batch.target_mask, [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(batch.source_lengths, [3, 1]);
        assert_eq!(batch.target_lengths, [2, 4]);
        assert_eq!(batch.words(), 4 + 6);
        assert_eq!(batch.source_time_major(), [5, 9, 6, EOS_ID, 7, EOS_ID]);
        assert_eq!(
            batch.target_mask_time_major(),
            [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
        );
    }

    #[test]
    fn lm_words_count_mask() {
        let batch = LmBatch {
            batch_size: 2,
            steps: 2,
            inputs: vec![1, 2, 3, 0],
            targets: vec![2, 3, 4, 0],
            mask: vec![1.0, 1.0, 1.0, 0.0],
            first_in_epoch: true,
        };
        assert_eq!(batch.words(), 3);
        assert_eq!(batch.inputs_time_major(), [1, 3, 2, 0]);
    }
}
