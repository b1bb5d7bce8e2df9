//! Synthetic data: uniform random token ids of a fixed length, as the benchmark's
//! `--use_synthetic_data` runs used.
//!
//! Each rank draws from its own ChaCha8 generator seeded with `seed + rank` (wrapping), so
//! ranks see different data and a rerun with the same seed sees the same data, on any
//! platform.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::batch::{LmBatch, NmtBatch};
use crate::error::{Error, Result};
use crate::position::SyntheticPosition;

/// Shape of synthetic translation batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticNmtConfig {
    /// Source ids are drawn from `0..src_vocab_size`.
    pub src_vocab_size: usize,
    /// Target ids are drawn from `0..tgt_vocab_size`.
    pub tgt_vocab_size: usize,
    /// Every source, target-input and target-output sequence has exactly this length
    /// (the benchmark's `src_max_len`).
    pub seq_len: usize,
    /// Sentences per batch on this rank.
    pub batch_size: usize,
    /// Base seed; rank `r` uses `seed + r`.
    pub seed: u64,
}

/// Endless synthetic translation batches.
///
/// Source, target input and target output are each `[seq_len, batch]` uniform ids drawn
/// independently; the mask is all 1.0, so [`NmtBatch::words`] is `2 * batch * seq_len`.
///
/// ```
/// use ringtrain_data::{SyntheticNmt, SyntheticNmtConfig};
/// let cfg = SyntheticNmtConfig { src_vocab_size: 100, tgt_vocab_size: 50, seq_len: 7, batch_size: 4, seed: 1 };
/// let batch = SyntheticNmt::new(cfg, 0)?.next_batch();
/// assert_eq!(batch.words(), 2 * 4 * 7);
/// # Ok::<(), ringtrain_data::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct SyntheticNmt {
    cfg: SyntheticNmtConfig,
    rng: ChaCha8Rng,
    produced: u64,
}

impl SyntheticNmt {
    /// A generator for rank `rank`.
    ///
    /// # Errors
    /// When a vocabulary size, the length or the batch size is 0, or a vocabulary is larger
    /// than `u32` ids can address.
    pub fn new(cfg: SyntheticNmtConfig, rank: usize) -> Result<Self> {
        check_vocab("source vocabulary size", cfg.src_vocab_size)?;
        check_vocab("target vocabulary size", cfg.tgt_vocab_size)?;
        check_positive("sequence length", cfg.seq_len)?;
        check_positive("batch size", cfg.batch_size)?;
        Ok(SyntheticNmt {
            cfg,
            rng: rank_rng(cfg.seed, rank),
            produced: 0,
        })
    }

    /// Where the stream stands: the batches handed out and the generator's state.
    pub fn position(&self) -> SyntheticPosition {
        SyntheticPosition {
            batches: self.produced,
            word_pos: self.rng.get_word_pos(),
        }
    }

    /// Moves the stream to `position` (from [`SyntheticNmt::position`] of a generator of
    /// the same seed and rank): the next batch is the one that generator made next.
    pub fn seek(&mut self, position: SyntheticPosition) {
        self.rng.set_word_pos(position.word_pos);
        self.produced = position.batches;
    }

    /// The next batch.
    pub fn next_batch(&mut self) -> NmtBatch {
        let SyntheticNmtConfig {
            src_vocab_size,
            tgt_vocab_size,
            seq_len,
            batch_size,
            ..
        } = self.cfg;
        let cells = batch_size * seq_len;
        let source = uniform_ids(&mut self.rng, batch_size, seq_len, src_vocab_size);
        let target_input = uniform_ids(&mut self.rng, batch_size, seq_len, tgt_vocab_size);
        let target_output = uniform_ids(&mut self.rng, batch_size, seq_len, tgt_vocab_size);
        self.produced += 1;
        NmtBatch {
            batch_size,
            src_len: seq_len,
            tgt_len: seq_len,
            source,
            source_lengths: vec![seq_len; batch_size],
            target_input,
            target_output,
            target_mask: vec![1.0; cells],
            target_lengths: vec![seq_len; batch_size],
        }
    }
}

impl Iterator for SyntheticNmt {
    type Item = NmtBatch;

    fn next(&mut self) -> Option<NmtBatch> {
        Some(self.next_batch())
    }
}

/// Shape of synthetic language-model batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SyntheticLmConfig {
    /// Ids are drawn from `0..vocab_size`.
    pub vocab_size: usize,
    /// Time steps per row.
    pub steps: usize,
    /// Rows per batch on this rank.
    pub batch_size: usize,
    /// Base seed; rank `r` uses `seed + r`.
    pub seed: u64,
}

/// Endless synthetic language-model batches: inputs and targets `[steps, batch]` uniform
/// ids drawn independently, mask all 1.0, [`LmBatch::words`] = `batch * steps`. Only the
/// first batch is marked `first_in_epoch`.
#[derive(Clone, Debug)]
pub struct SyntheticLm {
    cfg: SyntheticLmConfig,
    rng: ChaCha8Rng,
    produced: u64,
}

impl SyntheticLm {
    /// A generator for rank `rank`. Errors as [`SyntheticNmt::new`].
    pub fn new(cfg: SyntheticLmConfig, rank: usize) -> Result<Self> {
        check_vocab("vocabulary size", cfg.vocab_size)?;
        check_positive("number of steps", cfg.steps)?;
        check_positive("batch size", cfg.batch_size)?;
        Ok(SyntheticLm {
            cfg,
            rng: rank_rng(cfg.seed, rank),
            produced: 0,
        })
    }

    /// Where the stream stands: the batches handed out and the generator's state.
    pub fn position(&self) -> SyntheticPosition {
        SyntheticPosition {
            batches: self.produced,
            word_pos: self.rng.get_word_pos(),
        }
    }

    /// Moves the stream to `position` (from [`SyntheticLm::position`] of a generator of
    /// the same seed and rank): the next batch is the one that generator made next.
    pub fn seek(&mut self, position: SyntheticPosition) {
        self.rng.set_word_pos(position.word_pos);
        self.produced = position.batches;
    }

    /// The next batch.
    pub fn next_batch(&mut self) -> LmBatch {
        let SyntheticLmConfig {
            vocab_size,
            steps,
            batch_size,
            ..
        } = self.cfg;
        let inputs = uniform_ids(&mut self.rng, batch_size, steps, vocab_size);
        let targets = uniform_ids(&mut self.rng, batch_size, steps, vocab_size);
        self.produced += 1;
        LmBatch {
            batch_size,
            steps,
            inputs,
            targets,
            mask: vec![1.0; batch_size * steps],
            first_in_epoch: self.produced == 1,
        }
    }
}

impl Iterator for SyntheticLm {
    type Item = LmBatch;

    fn next(&mut self) -> Option<LmBatch> {
        Some(self.next_batch())
    }
}

fn rank_rng(seed: u64, rank: usize) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed.wrapping_add(rank as u64))
}

/// A time-major `[len, batch]` array of uniform ids below `vocab_size`, drawn example
/// by example (so the ids of an example do not depend on the batch layout).
fn uniform_ids(rng: &mut ChaCha8Rng, batch: usize, len: usize, vocab_size: usize) -> Vec<u32> {
    // `vocab_size` was checked to fit in u32 by the constructors.
    let upper = vocab_size as u32;
    let mut ids = vec![0; batch * len];
    for b in 0..batch {
        for t in 0..len {
            ids[t * batch + b] = rng.gen_range(0..upper);
        }
    }
    ids
}

fn check_positive(name: &'static str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(Error::invalid(name, value, "it must be at least 1"));
    }
    Ok(())
}

fn check_vocab(name: &'static str, value: usize) -> Result<()> {
    check_positive(name, value)?;
    if u32::try_from(value).is_err() {
        return Err(Error::invalid(
            name,
            value,
            format!("token ids are u32, so at most {} tokens", u32::MAX),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SyntheticNmtConfig {
        SyntheticNmtConfig {
            src_vocab_size: 30,
            tgt_vocab_size: 20,
            seq_len: 5,
            batch_size: 3,
            seed: 9,
        }
    }

    #[test]
    fn shapes_ranges_and_words() {
        let batch = SyntheticNmt::new(cfg(), 2).expect("valid").next_batch();
        assert_eq!(batch.source.len(), 15);
        assert_eq!(batch.target_input.len(), 15);
        assert!(batch.source.iter().all(|&id| id < 30));
        assert!(batch.target_output.iter().all(|&id| id < 20));
        assert!(batch.target_mask.iter().all(|&m| m == 1.0));
        assert_eq!(batch.words(), 2 * 3 * 5);
    }

    #[test]
    fn bad_configs_are_errors() {
        for bad in [
            SyntheticNmtConfig {
                src_vocab_size: 0,
                ..cfg()
            },
            SyntheticNmtConfig {
                seq_len: 0,
                ..cfg()
            },
            SyntheticNmtConfig {
                batch_size: 0,
                ..cfg()
            },
        ] {
            assert!(SyntheticNmt::new(bad, 0).is_err());
        }
        let lm = SyntheticLmConfig {
            vocab_size: 10,
            steps: 0,
            batch_size: 2,
            seed: 0,
        };
        assert!(SyntheticLm::new(lm, 0).is_err());
    }

    #[test]
    fn lm_batches_mark_only_the_first() {
        let cfg = SyntheticLmConfig {
            vocab_size: 10,
            steps: 4,
            batch_size: 2,
            seed: 3,
        };
        let batches: Vec<LmBatch> = SyntheticLm::new(cfg, 0).expect("valid").take(3).collect();
        assert!(batches[0].first_in_epoch);
        assert!(!batches[1].first_in_epoch && !batches[2].first_in_epoch);
        assert_eq!(batches[0].words(), 8);
        assert!(batches[1].inputs.iter().all(|&id| id < 10));
    }

    #[test]
    fn a_generator_moved_to_a_saved_position_continues_the_stream() {
        let mut straight = SyntheticNmt::new(cfg(), 1).expect("valid");
        for _ in 0..3 {
            straight.next_batch();
        }
        let saved = straight.position();
        assert_eq!(saved.batches, 3);
        let mut resumed = SyntheticNmt::new(cfg(), 1).expect("valid");
        resumed.seek(saved);
        for _ in 0..2 {
            assert_eq!(resumed.next_batch(), straight.next_batch());
        }
        assert_eq!(resumed.position(), straight.position());

        let lm = SyntheticLmConfig {
            vocab_size: 10,
            steps: 3,
            batch_size: 2,
            seed: 4,
        };
        let mut straight = SyntheticLm::new(lm, 0).expect("valid");
        straight.next_batch();
        let mut resumed = SyntheticLm::new(lm, 0).expect("valid");
        resumed.seek(straight.position());
        let (a, b) = (resumed.next_batch(), straight.next_batch());
        assert_eq!(a, b);
        assert!(!a.first_in_epoch);
    }
}
