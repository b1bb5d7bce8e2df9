//! Training data for ringtrain: synthetic batches, parallel (translation) and PTB-style
//! (language-model) text corpora, vocabularies, length buckets, per-rank sharding, batch
//! splitting over ranks, and a background prefetch thread.
//!
//! The trainer asks this crate for an endless stream of batches for its rank:
//!
//! * [`SyntheticNmt`] / [`SyntheticLm`]: uniform random ids, every sequence exactly the
//!   configured length, seeded with `seed + rank`.
//! * [`ParallelCorpus`] + [`NmtBatcher`]: translation pairs, sharded so each rank sees a
//!   disjoint part of every epoch, bucketed by target length, shuffled with a seed.
//! * [`LmCorpus`] + [`LmBatcher`]: one token stream cut into columns, rank by rank.
//! * [`Prefetcher`]: any of the above on a background thread with a bounded queue.
//! * [`nmt_eval_batches`] / [`lm_eval_batches`]: a held-out set once, in full, split
//!   over the ranks (see [`held_out`]).
//!
//! Batches ([`NmtBatch`], [`LmBatch`]) are time-major `[len, batch]` arrays of `u32` ids with
//! a 1.0/0.0 mask, the layout the models read; [`NmtBatch::words`] counts source + target words for the throughput meter
//! (see [`batch`] for the exact rule). [`BatchSizing`] gives a rank's batch size for a fixed
//! per-rank batch or a fixed total split over ranks.
//!
//! ```
//! use std::sync::Arc;
//! use ringtrain_data::{BatchSizing, LmBatcher, LmCorpus, Prefetcher, SyntheticNmt, SyntheticNmtConfig};
//!
//! // Rank 1 of 2, synthetic translation data as in the benchmark (length 100 there).
//! let cfg = SyntheticNmtConfig { src_vocab_size: 1000, tgt_vocab_size: 1000, seq_len: 10, batch_size: 8, seed: 42 };
//! let mut batches = Prefetcher::spawn_infallible(SyntheticNmt::new(cfg, 1)?, 2)?;
//! let batch = batches.next().expect("endless")?;
//! assert_eq!((batch.batch_size, batch.src_len, batch.words()), (8, 10, 2 * 8 * 10));
//!
//! // A total batch of 10 over 3 ranks is split 4, 3, 3.
//! assert_eq!(BatchSizing::Total(10).local_batch_size(0, 3)?, 4);
//!
//! // The bundled PTB-style text, rank 0 of 3.
//! let files = ringtrain_data::BundledCorpus::in_repo();
//! let (text, vocab) = LmCorpus::load_building_vocab(&files.lm_train)?;
//! let lm = LmBatcher::new(Arc::new(text), BatchSizing::Total(10), 20, 0, 3)?;
//! let first = lm.epoch().next().expect("a window");
//! assert_eq!((first.batch_size, first.steps), (4, 20));
//! assert!(first.inputs.iter().all(|&id| (id as usize) < vocab.len()));
//! # Ok::<(), ringtrain_data::Error>(())
//! ```
#![warn(missing_docs)]

pub mod batch;
mod bucketing;
mod bundled;
mod error;
pub mod held_out;
mod line_reader;
pub mod lm;
pub mod nmt;
mod position;
mod prefetch;
mod sharding;
mod synthetic;
pub mod vocab;

pub use batch::{LmBatch, NmtBatch};
pub use bucketing::bucket_of;
pub use bundled::BundledCorpus;
pub use error::{Error, Result};
pub use held_out::{lm_eval_batches, nmt_eval_batches};
pub use lm::{LmBatcher, LmCorpus, LmEpoch, LmStream};
pub use nmt::{
    CorpusStats, LengthLimits, NmtBatcher, NmtBatcherConfig, NmtEpoch, NmtStream, OverLimit,
    ParallelCorpus,
};
pub use position::{EpochPosition, SyntheticPosition};
pub use prefetch::Prefetcher;
pub use sharding::{rank_range, rank_share, BatchSizing};
pub use synthetic::{SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig};
pub use vocab::{
    Vocab, BOS, BOS_ID, EOS, EOS_ID, LM_EOS, LM_EOS_ID, LM_SPECIALS, NMT_SPECIALS, UNK, UNK_ID,
};
