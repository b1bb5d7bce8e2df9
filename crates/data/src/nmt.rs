//! Parallel text corpora for translation: loading, length limits, sharding, bucketing,
//! shuffling and batching.
//!
//! # Files
//!
//! A corpus is two files with one sentence per line, tokens separated by whitespace; line
//! `i` of the target file translates line `i` of the source file. Tokens missing from the
//! vocabulary become `<unk>` and are counted in [`CorpusStats`]. A pair with an empty side
//! is skipped (as TensorFlow NMT does) and counted. Files with different line counts, a
//! missing or empty file, and invalid UTF-8 are errors naming the file (and line).
//!
//! # Length limits
//!
//! [`LengthLimits`] caps source and target lengths (in tokens, before `<s>`/`</s>`). A longer
//! side is cut to the limit ([`OverLimit::Truncate`], the default, as TensorFlow NMT does) or
//! the whole pair is dropped ([`OverLimit::Skip`]); both are counted.
//!
//! # One epoch on one rank
//!
//! 1. All pairs are put in one order: a permutation drawn from `(seed, epoch)` when
//!    shuffling, file order otherwise. Every rank computes the same order, so **all ranks
//!    must use the same seed**.
//! 2. Rank `r` of `size` takes the slice [`rank_range`]`(n, r, size)` of
//!    that order: the shards are disjoint and every pair is used by exactly one rank per
//!    epoch. When `n % size != 0` the first `n % size` ranks get one pair more; nothing is
//!    dropped.
//! 3. The shard is grouped by target length with [`bucket_of`] and each
//!    bucket is cut into batches of this rank's batch size, in shard order. The last batch of
//!    a bucket may be smaller; it is kept, or dropped when `drop_partial` is set.
//! 4. When shuffling, the batches' order is shuffled with `(seed, epoch, rank)`.
//!
//! Ranks can therefore have slightly different numbers of batches per epoch. Synchronous
//! training should run a fixed number of steps on the endless [`NmtBatcher::stream`] (what
//! the throughput benchmark does), or agree on the minimum of
//! [`NmtBatcher::batches_in_epoch`] over ranks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::batch::NmtBatch;
use crate::bucketing::{bucket_of, check_buckets};
use crate::error::{Error, Result};
use crate::line_reader::LineReader;
use crate::position::EpochPosition;
use crate::sharding::{rank_range, BatchSizing};
use crate::vocab::Vocab;

/// What to do with a sentence longer than its limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OverLimit {
    /// Keep the first `max_len` tokens (TensorFlow NMT's behaviour).
    #[default]
    Truncate,
    /// Drop the whole pair.
    Skip,
}

/// Sentence length limits, in tokens, not counting `<s>`/`</s>`. `None` means no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LengthLimits {
    /// Longest source sentence kept as is.
    pub src_max_len: Option<usize>,
    /// Longest target sentence kept as is.
    pub tgt_max_len: Option<usize>,
    /// What happens to a longer one.
    pub over_limit: OverLimit,
}

/// What loading a corpus did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CorpusStats {
    /// Lines in each file.
    pub lines: usize,
    /// Pairs kept.
    pub pairs_kept: usize,
    /// Kept pairs with at least one side cut to its limit.
    pub truncated: usize,
    /// Pairs dropped for a side over its limit ([`OverLimit::Skip`]).
    pub skipped_too_long: usize,
    /// Pairs dropped because a side had no tokens.
    pub skipped_empty: usize,
    /// Source tokens kept.
    pub source_tokens: usize,
    /// Target tokens kept.
    pub target_tokens: usize,
    /// Kept source tokens that were not in the source vocabulary (now `<unk>`).
    pub source_unk: usize,
    /// Kept target tokens that were not in the target vocabulary (now `<unk>`).
    pub target_unk: usize,
}

/// A parallel corpus held in memory as token ids.
#[derive(Clone, Debug)]
pub struct ParallelCorpus {
    source_path: PathBuf,
    src_ids: Vec<u32>,
    src_offsets: Vec<usize>,
    tgt_ids: Vec<u32>,
    tgt_offsets: Vec<usize>,
    stats: CorpusStats,
}

impl ParallelCorpus {
    /// Loads `src`/`tgt` (one sentence per line) with the given vocabularies and limits.
    ///
    /// # Errors
    /// A missing or empty file, invalid UTF-8, different line counts, a limit of 0, or no
    /// pair left after the limits; each error names the file (and line).
    pub fn load(
        src: &Path,
        tgt: &Path,
        src_vocab: &Vocab,
        tgt_vocab: &Vocab,
        limits: &LengthLimits,
    ) -> Result<Self> {
        for (name, limit) in [
            ("source max length", limits.src_max_len),
            ("target max length", limits.tgt_max_len),
        ] {
            if limit == Some(0) {
                return Err(Error::invalid(name, 0, "use at least 1 token, or no limit"));
            }
        }
        let mut src_reader = LineReader::open(src, "source sentences, one per line")?;
        let mut tgt_reader = LineReader::open(tgt, "target sentences, one per line")?;
        let mut corpus = ParallelCorpus {
            source_path: src.to_path_buf(),
            src_ids: Vec::new(),
            src_offsets: vec![0],
            tgt_ids: Vec::new(),
            tgt_offsets: vec![0],
            stats: CorpusStats::default(),
        };
        let mut src_tokens: Vec<Option<u32>> = Vec::new();
        let mut tgt_tokens: Vec<Option<u32>> = Vec::new();
        loop {
            let src_line = src_reader.next_line()?;
            let tgt_line = tgt_reader.next_line()?;
            let (src_text, tgt_text) = match (src_line, tgt_line) {
                (None, None) => break,
                (Some((_, s)), Some((_, t))) => (s, t),
                _ => {
                    return Err(Error::LineCountMismatch {
                        source_path: src_reader.path().to_path_buf(),
                        target_path: tgt_reader.path().to_path_buf(),
                        source_lines: src_reader.count_to_end()?,
                        target_lines: tgt_reader.count_to_end()?,
                    })
                }
            };
            corpus.stats.lines += 1;
            src_tokens.clear();
            src_tokens.extend(src_text.split_whitespace().map(|w| src_vocab.id(w)));
            tgt_tokens.clear();
            tgt_tokens.extend(tgt_text.split_whitespace().map(|w| tgt_vocab.id(w)));
            corpus.add_pair(&mut src_tokens, &mut tgt_tokens, limits);
        }
        if corpus.stats.pairs_kept == 0 {
            let s = &corpus.stats;
            return Err(Error::NoExamples {
                path: src.to_path_buf(),
                detail: format!(
                    "{} lines, {} with an empty side, {} over the length limit",
                    s.lines, s.skipped_empty, s.skipped_too_long
                ),
            });
        }
        log::info!(
            "loaded {} / {} sentence pairs from {} and {} ({} truncated, {} skipped as too long, {} skipped as empty, {} + {} unknown tokens)",
            corpus.stats.pairs_kept,
            corpus.stats.lines,
            src.display(),
            tgt.display(),
            corpus.stats.truncated,
            corpus.stats.skipped_too_long,
            corpus.stats.skipped_empty,
            corpus.stats.source_unk,
            corpus.stats.target_unk,
        );
        Ok(corpus)
    }

    /// A corpus from sentence pairs already given as ids (without `<s>`/`</s>`); `name`
    /// stands for the file in messages. Pairs with an empty side are skipped and counted, as
    /// when loading files; unknown-token counts are 0.
    ///
    /// # Errors
    /// When no pair has two non-empty sides.
    pub fn from_id_pairs<I, S, T>(pairs: I, name: &str) -> Result<Self>
    where
        I: IntoIterator<Item = (S, T)>,
        S: AsRef<[u32]>,
        T: AsRef<[u32]>,
    {
        let mut corpus = ParallelCorpus {
            source_path: PathBuf::from(name),
            src_ids: Vec::new(),
            src_offsets: vec![0],
            tgt_ids: Vec::new(),
            tgt_offsets: vec![0],
            stats: CorpusStats::default(),
        };
        let limits = LengthLimits::default();
        for (src, tgt) in pairs {
            corpus.stats.lines += 1;
            let mut src: Vec<Option<u32>> = src.as_ref().iter().map(|&id| Some(id)).collect();
            let mut tgt: Vec<Option<u32>> = tgt.as_ref().iter().map(|&id| Some(id)).collect();
            corpus.add_pair(&mut src, &mut tgt, &limits);
        }
        if corpus.is_empty() {
            return Err(Error::NoExamples {
                path: corpus.source_path,
                detail: format!(
                    "{} pairs given, {} with an empty side",
                    corpus.stats.lines, corpus.stats.skipped_empty
                ),
            });
        }
        Ok(corpus)
    }

    fn add_pair(
        &mut self,
        src: &mut Vec<Option<u32>>,
        tgt: &mut Vec<Option<u32>>,
        limits: &LengthLimits,
    ) {
        if src.is_empty() || tgt.is_empty() {
            self.stats.skipped_empty += 1;
            return;
        }
        let src_over = limits.src_max_len.is_some_and(|max| src.len() > max);
        let tgt_over = limits.tgt_max_len.is_some_and(|max| tgt.len() > max);
        if src_over || tgt_over {
            match limits.over_limit {
                OverLimit::Skip => {
                    self.stats.skipped_too_long += 1;
                    return;
                }
                OverLimit::Truncate => {
                    self.stats.truncated += 1;
                    if let Some(max) = limits.src_max_len {
                        src.truncate(max);
                    }
                    if let Some(max) = limits.tgt_max_len {
                        tgt.truncate(max);
                    }
                }
            }
        }
        self.stats.pairs_kept += 1;
        self.stats.source_tokens += src.len();
        self.stats.target_tokens += tgt.len();
        self.stats.source_unk += src.iter().filter(|id| id.is_none()).count();
        self.stats.target_unk += tgt.iter().filter(|id| id.is_none()).count();
        let unk = crate::vocab::UNK_ID;
        self.src_ids.extend(src.iter().map(|id| id.unwrap_or(unk)));
        self.src_offsets.push(self.src_ids.len());
        self.tgt_ids.extend(tgt.iter().map(|id| id.unwrap_or(unk)));
        self.tgt_offsets.push(self.tgt_ids.len());
    }

    /// Number of sentence pairs.
    pub fn len(&self) -> usize {
        self.src_offsets.len() - 1
    }

    /// True when there are no pairs (never the case for a loaded corpus).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What loading did.
    pub fn stats(&self) -> &CorpusStats {
        &self.stats
    }

    /// The source file this corpus was loaded from.
    pub fn source_path(&self) -> &Path {
        &self.source_path
    }

    /// Pair `i` as `(source ids, target ids)`, without `<s>`/`</s>`.
    pub fn pair(&self, i: usize) -> Option<(&[u32], &[u32])> {
        if i >= self.len() {
            return None;
        }
        Some((
            &self.src_ids[self.src_offsets[i]..self.src_offsets[i + 1]],
            &self.tgt_ids[self.tgt_offsets[i]..self.tgt_offsets[i + 1]],
        ))
    }

    fn target_len(&self, i: usize) -> usize {
        self.tgt_offsets[i + 1] - self.tgt_offsets[i]
    }
}

/// How [`NmtBatcher`] forms batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NmtBatcherConfig {
    /// Batch size per rank or in total.
    pub batch: BatchSizing,
    /// Number of length buckets (TensorFlow NMT default 5; 1 turns bucketing off).
    pub num_buckets: usize,
    /// Tokens per bucket (TensorFlow NMT default 10).
    pub bucket_width: usize,
    /// Shuffle pairs and batch order every epoch.
    pub shuffle: bool,
    /// Seed of the shuffles; must be the same on every rank.
    pub seed: u64,
    /// Drop the last, smaller batch of each bucket instead of keeping it.
    pub drop_partial: bool,
}

impl NmtBatcherConfig {
    /// TensorFlow NMT's defaults (5 buckets of width 10, shuffled, partial batches kept).
    pub fn new(batch: BatchSizing, seed: u64) -> Self {
        NmtBatcherConfig {
            batch,
            num_buckets: 5,
            bucket_width: 10,
            shuffle: true,
            seed,
            drop_partial: false,
        }
    }
}

/// Makes this rank's batches of a [`ParallelCorpus`] (see the module docs).
///
/// ```
/// use std::sync::Arc;
/// use ringtrain_data::{BatchSizing, BundledCorpus, LengthLimits, NmtBatcher, NmtBatcherConfig, ParallelCorpus, Vocab};
/// let files = BundledCorpus::in_repo();
/// let src_vocab = Vocab::nmt_from_file(&files.nmt_vocab_src)?;
/// let tgt_vocab = Vocab::nmt_from_file(&files.nmt_vocab_tgt)?;
/// let corpus = ParallelCorpus::load(&files.nmt_train_src, &files.nmt_train_tgt, &src_vocab, &tgt_vocab, &LengthLimits::default())?;
/// let batcher = NmtBatcher::new(Arc::new(corpus), NmtBatcherConfig::new(BatchSizing::Total(32), 7), 1, 2)?;
/// let first = batcher.epoch(0).next().expect("a batch");
/// assert!(first.batch_size <= 16);
/// # Ok::<(), ringtrain_data::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct NmtBatcher {
    corpus: Arc<ParallelCorpus>,
    cfg: NmtBatcherConfig,
    rank: usize,
    size: usize,
    local_batch: usize,
}

impl NmtBatcher {
    /// The batcher of rank `rank` of `size`.
    ///
    /// # Errors
    /// Invalid batch size or bucket settings, or fewer pairs than one step takes over
    /// all ranks.
    pub fn new(
        corpus: Arc<ParallelCorpus>,
        cfg: NmtBatcherConfig,
        rank: usize,
        size: usize,
    ) -> Result<Self> {
        let local_batch = cfg.batch.local_batch_size(rank, size)?;
        check_buckets(cfg.bucket_width, cfg.num_buckets)?;
        let global = cfg.batch.global_batch_size(size);
        if corpus.len() < global {
            return Err(Error::invalid(
                "batch size",
                local_batch,
                format!(
                    "{} has only {} sentence pairs, fewer than one step's {global} over {size} \
                     rank(s): every batch would be smaller than asked; use a smaller batch, \
                     fewer ranks or a larger corpus",
                    corpus.source_path().display(),
                    corpus.len()
                ),
            ));
        }
        let batcher = NmtBatcher {
            corpus,
            cfg,
            rank,
            size,
            local_batch,
        };
        if batcher.batches_in_epoch(0) == 0 {
            return Err(Error::invalid(
                "batch size",
                local_batch,
                format!(
                    "with drop_partial set, no bucket of rank {rank}'s {} pairs fills a batch; \
                     keep partial batches or use a smaller batch",
                    rank_range(batcher.corpus.len(), rank, size).len()
                ),
            ));
        }
        Ok(batcher)
    }

    /// This rank's batch size.
    pub fn local_batch_size(&self) -> usize {
        self.local_batch
    }

    /// The corpus being batched.
    pub fn corpus(&self) -> &Arc<ParallelCorpus> {
        &self.corpus
    }

    /// The indices of the pairs in each of this rank's batches of `epoch`, in order.
    pub fn epoch_plan(&self, epoch: u64) -> Vec<Vec<usize>> {
        let n = self.corpus.len();
        let mut order: Vec<usize> = (0..n).collect();
        if self.cfg.shuffle {
            order.shuffle(&mut epoch_rng(self.cfg.seed, epoch, 0));
        }
        let shard = &order[rank_range(n, self.rank, self.size)];
        let mut buckets: Vec<Vec<usize>> = vec![Vec::new(); self.cfg.num_buckets];
        for &i in shard {
            let bucket = bucket_of(
                self.corpus.target_len(i),
                self.cfg.bucket_width,
                self.cfg.num_buckets,
            );
            buckets[bucket].push(i);
        }
        let mut batches: Vec<Vec<usize>> = buckets
            .iter()
            .flat_map(|bucket| bucket.chunks(self.local_batch))
            .filter(|chunk| !self.cfg.drop_partial || chunk.len() == self.local_batch)
            .map(<[usize]>::to_vec)
            .collect();
        if self.cfg.shuffle {
            batches.shuffle(&mut epoch_rng(self.cfg.seed, epoch, 1 + self.rank as u64));
        }
        batches
    }

    /// Number of this rank's batches in `epoch`.
    pub fn batches_in_epoch(&self, epoch: u64) -> usize {
        self.epoch_plan(epoch).len()
    }

    /// This rank's batches of `epoch`.
    pub fn epoch(&self, epoch: u64) -> NmtEpoch {
        let plan = self.epoch_plan(epoch);
        NmtEpoch {
            corpus: Arc::clone(&self.corpus),
            planned: plan.len(),
            plan: plan.into_iter(),
        }
    }

    /// Endless batches: epoch `start_epoch`, then the next, and so on.
    pub fn stream(&self, start_epoch: u64) -> NmtStream {
        NmtStream {
            batcher: self.clone(),
            epoch: start_epoch,
            current: self.epoch(start_epoch),
        }
    }

    /// Endless batches from `position` (from [`NmtStream::position`] of a batcher with
    /// the same corpus, configuration, rank and size): the batch after the last one that
    /// stream handed out. A batch count past the epoch's end starts the next epoch.
    pub fn stream_at(&self, position: EpochPosition) -> NmtStream {
        let mut stream = self.stream(position.epoch);
        let skip = usize::try_from(position.batch).unwrap_or(usize::MAX);
        // Only the plan's index lists are skipped; no batch is built for them.
        for _ in 0..skip.min(stream.current.planned) {
            stream.current.plan.next();
        }
        stream
    }
}

/// One epoch of one rank's batches (from [`NmtBatcher::epoch`]).
#[derive(Clone, Debug)]
pub struct NmtEpoch {
    corpus: Arc<ParallelCorpus>,
    planned: usize,
    plan: std::vec::IntoIter<Vec<usize>>,
}

impl Iterator for NmtEpoch {
    type Item = NmtBatch;

    fn next(&mut self) -> Option<NmtBatch> {
        let indices = self.plan.next()?;
        let pairs: Vec<(&[u32], &[u32])> = indices
            .iter()
            .filter_map(|&i| self.corpus.pair(i))
            .collect();
        Some(NmtBatch::from_pairs(&pairs))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.plan.size_hint()
    }
}

impl ExactSizeIterator for NmtEpoch {}

/// Endless batches, epoch after epoch (from [`NmtBatcher::stream`]). It ends only if an
/// epoch has no batch for this rank (possible only with `drop_partial`).
#[derive(Clone, Debug)]
pub struct NmtStream {
    batcher: NmtBatcher,
    epoch: u64,
    current: NmtEpoch,
}

impl NmtStream {
    /// The epoch the next batch comes from (or the one just finished).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Where the stream stands: its epoch and the batches of it handed out.
    pub fn position(&self) -> EpochPosition {
        EpochPosition {
            epoch: self.epoch,
            batch: (self.current.planned - self.current.plan.len()) as u64,
        }
    }
}

impl Iterator for NmtStream {
    type Item = NmtBatch;

    fn next(&mut self) -> Option<NmtBatch> {
        if let Some(batch) = self.current.next() {
            return Some(batch);
        }
        self.epoch += 1;
        self.current = self.batcher.epoch(self.epoch);
        self.current.next()
    }
}

/// A generator for one `(seed, epoch, purpose)`: purpose 0 is the shared pair order,
/// `1 + rank` a rank's batch order.
fn epoch_rng(seed: u64, epoch: u64, purpose: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(mix64(seed ^ mix64(purpose)));
    rng.set_stream(epoch);
    rng
}

/// A 64-bit finaliser (the SplitMix64 output function) to decorrelate nearby seeds.
fn mix64(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
