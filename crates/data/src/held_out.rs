//! Held-out (evaluation) batches: every example of a held-out set exactly once, split
//! over the ranks, in batches of the training batch size.
//!
//! Training streams are endless and shuffled; an evaluation reads a held-out set once,
//! in full, and each rank reads its own part so that the ranks' loss sums add up to the
//! set's.
//!
//! * **Translation** ([`nmt_eval_batches`]): rank `r` of `size` takes the sentence pairs
//!   [`rank_range`]`(pairs, r, size)`, ordered by source then target length (less
//!   padding), cut into batches of `batch` pairs; the last batch is smaller when the
//!   share does not divide evenly. Padding carries mask 0: only real target tokens (and
//!   each sentence's `</s>`) count.
//! * **Language model** ([`lm_eval_batches`]): the text is one token stream with
//!   `tokens - 1` predictions (each token predicts the next). Rank `r` takes the
//!   contiguous predictions [`rank_range`]`(tokens - 1, r, size)` and cuts them into
//!   `min(batch, share)` contiguous columns (lengths differing by at most one); batch
//!   `k` holds window `k` (`steps` positions) of every column, the positions past a
//!   column's end masked. Every prediction is counted exactly once, and window `k + 1`
//!   of a column continues where window `k` ended, so a model that carries its state
//!   from one window to the next can do so here as in training (`first_in_epoch` marks
//!   batch 0).

use crate::batch::{LmBatch, NmtBatch};
use crate::lm::LmCorpus;
use crate::nmt::ParallelCorpus;
use crate::sharding::rank_range;

/// Rank `rank` of `size`'s held-out translation batches of at most `batch` pairs (see
/// the module docs). Empty when the rank's share is empty or `batch` is 0.
pub fn nmt_eval_batches(
    corpus: &ParallelCorpus,
    rank: usize,
    size: usize,
    batch: usize,
) -> Vec<NmtBatch> {
    if batch == 0 {
        return Vec::new();
    }
    let mut pairs: Vec<(&[u32], &[u32])> = rank_range(corpus.len(), rank, size)
        .filter_map(|i| corpus.pair(i))
        .collect();
    pairs.sort_by_key(|(s, t)| (s.len(), t.len()));
    pairs.chunks(batch).map(NmtBatch::from_pairs).collect()
}

/// Rank `rank` of `size`'s held-out language-model batches: at most `batch` columns,
/// windows of at most `steps` positions (see the module docs). Empty when the rank's
/// share is empty or `batch` or `steps` is 0.
pub fn lm_eval_batches(
    corpus: &LmCorpus,
    rank: usize,
    size: usize,
    batch: usize,
    steps: usize,
) -> Vec<LmBatch> {
    let tokens = corpus.tokens();
    let predictions = tokens.len().saturating_sub(1);
    let share = rank_range(predictions, rank, size);
    if share.is_empty() || batch == 0 || steps == 0 {
        return Vec::new();
    }
    let columns = batch.min(share.len());
    let spans: Vec<std::ops::Range<usize>> = (0..columns)
        .map(|c| {
            let r = rank_range(share.len(), c, columns);
            share.start + r.start..share.start + r.end
        })
        .collect();
    let longest = spans.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut batches = Vec::new();
    let mut start = 0;
    while start < longest {
        let len = steps.min(longest - start);
        let mut inputs = vec![0; len * columns];
        let mut targets = vec![0; len * columns];
        let mut mask = vec![0.0; len * columns];
        for (c, span) in spans.iter().enumerate() {
            for t in 0..len {
                let pos = span.start + start + t;
                if pos < span.end {
                    inputs[t * columns + c] = tokens[pos];
                    targets[t * columns + c] = tokens[pos + 1];
                    mask[t * columns + c] = 1.0;
                }
            }
        }
        batches.push(LmBatch {
            batch_size: columns,
            steps: len,
            inputs,
            targets,
            mask,
            first_in_epoch: start == 0,
        });
        start += len;
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lm_windows_cover_every_prediction_once_and_continue_by_column() {
        // Tokens 10..=20: predictions 10->11 .. 19->20 (10 of them), over 2 ranks.
        let corpus = LmCorpus::from_ids((10..=20).collect(), "t");
        let b0 = lm_eval_batches(&corpus, 0, 2, 2, 2);
        // Rank 0: predictions at positions 0..5, columns 0..3 and 3..5; windows of 2.
        assert_eq!(b0.len(), 2);
        assert_eq!((b0[0].batch_size, b0[0].steps), (2, 2));
        assert_eq!(b0[0].inputs, [10, 13, 11, 14]);
        assert_eq!(b0[0].targets, [11, 14, 12, 15]);
        assert!(b0[0].first_in_epoch && !b0[1].first_in_epoch);
        assert_eq!(b0[1].steps, 1);
        assert_eq!(b0[1].inputs, [12, 0]);
        assert_eq!(b0[1].mask, [1.0, 0.0]);
        let words: usize = (0..2)
            .flat_map(|r| lm_eval_batches(&corpus, r, 2, 2, 2))
            .map(|b| b.words())
            .sum();
        assert_eq!(words, 10);
    }

    #[test]
    fn nmt_batches_hold_every_pair_once_with_a_smaller_last_batch() {
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = (0..7u32)
            .map(|i| (vec![5; 1 + (i as usize % 3)], vec![6 + i]))
            .collect();
        let corpus = ParallelCorpus::from_id_pairs(pairs, "p").unwrap_or_else(|e| panic!("{e}"));
        let b = nmt_eval_batches(&corpus, 0, 1, 3);
        assert_eq!(
            b.iter().map(|b| b.batch_size).collect::<Vec<_>>(),
            [3, 3, 1]
        );
        let mut targets: Vec<u32> = b
            .iter()
            .flat_map(|b| b.target_output[..b.batch_size].to_vec())
            .collect();
        targets.sort_unstable();
        assert_eq!(targets, (6..13).collect::<Vec<_>>());
        assert!(nmt_eval_batches(&corpus, 0, 1, 0).is_empty());
    }
}
