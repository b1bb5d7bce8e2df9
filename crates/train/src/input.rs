//! The input pipeline a rank trains on: synthetic batches or a sharded corpus, read
//! ahead on a background thread, and where it stands so that a resumed run reads on.
//!
//! # Position and resume
//!
//! Every batch the prefetch thread makes travels with the position of the stream just
//! after it ([`InputPosition`]: the source, seed, worker count, batch size, and the
//! epoch and batch of a corpus or the generator state of synthetic data). The training
//! loop keeps the position of the last batch it *consumed*, not of the last one read
//! ahead, and checkpoints store it for every rank.
//!
//! On `--resume` ([`BatchSource::resume`], before the first batch is read):
//! - with the same worker count, batch size, seed and source, each rank continues from
//!   its own saved position: the run reads exactly the batches an uninterrupted run
//!   would have;
//! - with another worker count (or batch size or seed), the shards are re-cut: a corpus
//!   restarts the earliest epoch any rank of the checkpoint was in, from its first batch,
//!   with the new shards (that epoch's examples already trained on are seen again, none
//!   is skipped); synthetic data continues rank `r`'s generator where rank `r` saved one
//!   and starts a new rank's generator from its beginning;
//! - a checkpoint without input positions, or of another source, starts the input from
//!   its first batch.

use std::path::Path;
use std::sync::Arc;

use ringtrain_data::{
    lm_eval_batches, nmt_eval_batches, EpochPosition, LengthLimits, LmBatcher, LmCorpus, LmStream,
    NmtBatcher, NmtBatcherConfig, NmtStream, OverLimit, ParallelCorpus, Prefetcher, SyntheticLm,
    SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig, SyntheticPosition, Vocab,
};
use serde::{Deserialize, Serialize};

use crate::config::{DataSource, HeldOutSource, ValidatedConfig};
use crate::error::{Error, Result};
use crate::evaluation::HeldOut;
use crate::trainable::Batch;

/// Batches queued ahead of the training loop.
pub const PREFETCH_DEPTH: usize = 4;

/// Which input a position belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InputKind {
    /// Synthetic translation batches.
    SyntheticNmt,
    /// Synthetic language-model batches.
    SyntheticLm,
    /// A parallel corpus (`--data SRC,TGT,SRC_VOCAB,TGT_VOCAB`).
    Translation,
    /// A language-model text (`--data TEXT[,VOCAB]`).
    Text,
}

/// Where a stream stands (see [`ringtrain_data::EpochPosition`] and
/// [`ringtrain_data::SyntheticPosition`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamPosition {
    /// A synthetic generator's state.
    Synthetic(SyntheticPosition),
    /// A corpus's epoch and the batches of it consumed.
    Epoch(EpochPosition),
}

/// Where one rank's input stands after the last batch training consumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputPosition {
    /// The source.
    pub kind: InputKind,
    /// Seed of the synthetic generators and of the corpus shuffles.
    pub seed: u64,
    /// Workers the data was sharded over.
    pub workers: usize,
    /// The rank (worker) this position is of.
    pub rank: usize,
    /// This rank's batch size.
    pub batch_size: usize,
    /// The stream's position.
    pub stream: StreamPosition,
}

impl InputPosition {
    /// Whether `self` (a saved position) continues exactly in a pipeline positioned like
    /// `now`: same source, seed, sharding and batch.
    fn continues_in(&self, now: &InputPosition) -> bool {
        self.kind == now.kind
            && self.seed == now.seed
            && self.workers == now.workers
            && self.rank == now.rank
            && self.batch_size == now.batch_size
    }
}

/// Where the training loop takes its batches from: the [`InputPipeline`]'s
/// [`InputBatches`], or any iterator of batches (a test's, or a caller's own data, which
/// knows no position and is positioned by its caller).
pub trait BatchSource {
    /// The next batch; `None` when the input ended.
    fn next_batch(&mut self) -> Option<ringtrain_data::Result<Batch>>;

    /// Where the input stands after the last batch handed out (`None`: not known).
    fn position(&self) -> Option<InputPosition> {
        None
    }

    /// Moves the input to continue from `saved` (every rank's position in a checkpoint,
    /// by rank) before the first batch is read; returns a line saying what it did.
    ///
    /// # Errors
    /// When batches were already read, or the input cannot be rebuilt.
    fn resume(&mut self, saved: &[Option<InputPosition>]) -> Result<Option<String>> {
        let _ = saved;
        Ok(None)
    }
}

impl<I> BatchSource for I
where
    I: Iterator<Item = ringtrain_data::Result<Batch>> + ?Sized,
{
    fn next_batch(&mut self) -> Option<ringtrain_data::Result<Batch>> {
        self.next()
    }
}

/// One rank's stream of batches, before it is handed to the prefetch thread.
enum Stream {
    SyntheticNmt(SyntheticNmt),
    SyntheticLm(SyntheticLm),
    Translation {
        batcher: NmtBatcher,
        stream: NmtStream,
    },
    Text {
        batcher: LmBatcher,
        stream: LmStream,
    },
}

impl Stream {
    fn next(&mut self) -> Option<Batch> {
        match self {
            Stream::SyntheticNmt(gen) => Some(Batch::Nmt(gen.next_batch())),
            Stream::SyntheticLm(gen) => Some(Batch::Lm(gen.next_batch())),
            Stream::Translation { stream, .. } => stream.next().map(Batch::Nmt),
            Stream::Text { stream, .. } => stream.next().map(Batch::Lm),
        }
    }

    fn position(&self) -> StreamPosition {
        match self {
            Stream::SyntheticNmt(gen) => StreamPosition::Synthetic(gen.position()),
            Stream::SyntheticLm(gen) => StreamPosition::Synthetic(gen.position()),
            Stream::Translation { stream, .. } => StreamPosition::Epoch(stream.position()),
            Stream::Text { stream, .. } => StreamPosition::Epoch(stream.position()),
        }
    }

    /// Moves to `position`; false when it is of another kind of stream.
    fn seek(&mut self, position: StreamPosition) -> bool {
        match (self, position) {
            (Stream::SyntheticNmt(gen), StreamPosition::Synthetic(p)) => gen.seek(p),
            (Stream::SyntheticLm(gen), StreamPosition::Synthetic(p)) => gen.seek(p),
            (Stream::Translation { batcher, stream }, StreamPosition::Epoch(p)) => {
                *stream = batcher.stream_at(p)
            }
            (Stream::Text { batcher, stream }, StreamPosition::Epoch(p)) => {
                *stream = batcher.stream_at(p)
            }
            _ => return false,
        }
        true
    }
}

/// A rank's batches, made ahead on a background thread that starts at the first batch
/// (so that [`BatchSource::resume`] can move the stream first), each with the position
/// after it.
pub struct InputBatches {
    pending: Option<Stream>,
    running: Option<Prefetcher<(Batch, InputPosition)>>,
    /// The position after the last batch handed out (the start before any).
    last: InputPosition,
}

impl InputBatches {
    fn new(
        stream: Stream,
        kind: InputKind,
        seed: u64,
        workers: usize,
        rank: usize,
        batch_size: usize,
    ) -> Self {
        let last = InputPosition {
            kind,
            seed,
            workers,
            rank,
            batch_size,
            stream: stream.position(),
        };
        InputBatches {
            pending: Some(stream),
            running: None,
            last,
        }
    }

    fn start(&mut self) -> ringtrain_data::Result<()> {
        if let Some(mut stream) = self.pending.take() {
            let template = self.last;
            let source = std::iter::from_fn(move || {
                let batch = stream.next()?;
                let position = InputPosition {
                    stream: stream.position(),
                    ..template
                };
                Some(Ok((batch, position)))
            });
            self.running = Some(Prefetcher::spawn(source, PREFETCH_DEPTH)?);
        }
        Ok(())
    }
}

impl BatchSource for InputBatches {
    fn next_batch(&mut self) -> Option<ringtrain_data::Result<Batch>> {
        if let Err(e) = self.start() {
            return Some(Err(e));
        }
        match self.running.as_mut()?.next()? {
            Ok((batch, position)) => {
                self.last = position;
                Some(Ok(batch))
            }
            Err(e) => Some(Err(e)),
        }
    }

    fn position(&self) -> Option<InputPosition> {
        Some(self.last)
    }

    fn resume(&mut self, saved: &[Option<InputPosition>]) -> Result<Option<String>> {
        let now = self.last;
        let Some(stream) = self.pending.as_mut() else {
            return Err(Error::Internal(
                "the input can only be resumed before its first batch is read".into(),
            ));
        };
        let saved_of_kind: Vec<&InputPosition> = saved
            .iter()
            .flatten()
            .filter(|p| p.kind == now.kind)
            .collect();
        let mine = saved.get(now.rank).copied().flatten();
        let note = match mine {
            Some(p) if p.continues_in(&now) && stream.seek(p.stream) => match p.stream {
                StreamPosition::Synthetic(s) => format!(
                    "input continues after batch {} of each rank's synthetic stream",
                    s.batches
                ),
                StreamPosition::Epoch(e) => format!(
                    "input continues at epoch {}, after batch {} of each rank's shard",
                    e.epoch, e.batch
                ),
            },
            _ if saved_of_kind.is_empty() => {
                "the checkpoint holds no position of this input: it starts from its first batch"
                    .to_string()
            }
            _ => {
                let then = saved_of_kind[0];
                let seed = if then.seed == now.seed {
                    ""
                } else {
                    " and another --seed"
                };
                let change = format!(
                    "the checkpoint's input was sharded over {} worker(s) with batch {}, this run uses {} with batch {}{seed}",
                    then.workers, then.batch_size, now.workers, now.batch_size
                );
                match now.stream {
                    StreamPosition::Synthetic(_) => {
                        let own = mine.filter(|p| p.kind == now.kind && p.seed == now.seed);
                        if let Some(p) = own {
                            stream.seek(p.stream);
                        }
                        format!(
                            "{change}: each rank continues its own synthetic stream where the checkpoint has one, a new rank starts its stream"
                        )
                    }
                    StreamPosition::Epoch(_) => {
                        let epoch = saved_of_kind
                            .iter()
                            .filter_map(|p| match p.stream {
                                StreamPosition::Epoch(e) => Some(e.epoch),
                                StreamPosition::Synthetic(_) => None,
                            })
                            .min()
                            .unwrap_or(0);
                        stream.seek(StreamPosition::Epoch(EpochPosition { epoch, batch: 0 }));
                        format!(
                            "{change}: the shards are re-cut and epoch {epoch} restarts from its first batch (its examples already trained on are seen again)"
                        )
                    }
                }
            }
        };
        self.last.stream = stream.position();
        Ok(Some(note))
    }
}

/// A rank's batches and the vocabulary sizes the model must use.
pub struct InputPipeline {
    /// What loading found worth a line in the log (the corpus's unknown-token rates).
    pub notes: Vec<String>,
    /// Infinite stream of this rank's batches.
    pub batches: InputBatches,
    /// Source (or LM) vocabulary size.
    pub src_vocab_size: usize,
    /// Target vocabulary size (NMT; equals the source size for the LM).
    pub tgt_vocab_size: usize,
    /// This worker's part of the `--eval-data` held-out set, read with the training
    /// vocabularies (`None` without `--eval-data`).
    pub held_out: Option<HeldOut>,
}

/// The longest source and decoder sequences of this run's batches, which the memory
/// estimate sizes the model's workspaces by: synthetic batches are exactly
/// `--src-max-len` steps on both sides, as a language model's windows are; a corpus's
/// sentences are cut to `--src-max-len` (the limits [`InputPipeline::new`] loads it
/// with), and the decoder's sequences are one longer (`<s>` + target, target + `</s>`).
pub fn max_sequence_lengths(cfg: &ValidatedConfig) -> (usize, usize) {
    let len = cfg.config().data.src_max_len;
    match cfg.data_source() {
        DataSource::Translation { .. } => (len, len.saturating_add(1)),
        DataSource::Synthetic | DataSource::Text { .. } => (len, len),
    }
}

impl InputPipeline {
    /// Builds worker `worker`'s pipeline.
    ///
    /// # Errors
    /// The data crate's: unreadable or malformed corpora and vocabularies, a corpus too
    /// small for the batch; [`Error::TooManyUnknownTokens`] for a corpus its vocabulary
    /// does not match.
    pub fn new(cfg: &ValidatedConfig, worker: usize) -> Result<Self> {
        let (data, workers) = (&cfg.config().data, cfg.workers());
        let sizing = cfg.batch();
        let local = sizing.local_batch_size(worker, workers)?;
        let seed = cfg
            .config()
            .run
            .seed
            .wrapping_mul(0x9E37_79B9)
            .wrapping_add(17);
        let nmt = cfg.config().model.model == crate::config::ModelKind::Nmt;
        let batches = |stream: Stream, kind: InputKind| {
            InputBatches::new(stream, kind, seed, workers, worker, local)
        };
        match cfg.data_source() {
            DataSource::Synthetic if nmt => {
                let gen = SyntheticNmt::new(
                    SyntheticNmtConfig {
                        src_vocab_size: data.vocab_size,
                        tgt_vocab_size: data.vocab_size,
                        seq_len: data.src_max_len,
                        batch_size: local,
                        seed,
                    },
                    worker,
                )?;
                Ok(InputPipeline {
                    notes: Vec::new(),
                    batches: batches(Stream::SyntheticNmt(gen), InputKind::SyntheticNmt),
                    src_vocab_size: data.vocab_size,
                    tgt_vocab_size: data.vocab_size,
                    held_out: None,
                })
            }
            DataSource::Synthetic => {
                let gen = SyntheticLm::new(
                    SyntheticLmConfig {
                        vocab_size: data.vocab_size,
                        steps: data.src_max_len,
                        batch_size: local,
                        seed,
                    },
                    worker,
                )?;
                Ok(InputPipeline {
                    notes: Vec::new(),
                    batches: batches(Stream::SyntheticLm(gen), InputKind::SyntheticLm),
                    src_vocab_size: data.vocab_size,
                    tgt_vocab_size: data.vocab_size,
                    held_out: None,
                })
            }
            DataSource::Translation {
                source,
                target,
                source_vocab,
                target_vocab,
            } => {
                let src_vocab = Vocab::nmt_from_file(source_vocab)?;
                let tgt_vocab = Vocab::nmt_from_file(target_vocab)?;
                let limits = LengthLimits {
                    src_max_len: Some(data.src_max_len),
                    tgt_max_len: Some(data.src_max_len),
                    over_limit: OverLimit::Truncate,
                };
                let corpus = ParallelCorpus::load(source, target, &src_vocab, &tgt_vocab, &limits)?;
                let stats = corpus.stats();
                let mut notes = vec![
                    unknown_rate(
                        source,
                        source_vocab,
                        stats.source_unk,
                        stats.source_tokens,
                        data.max_unk_percent,
                    )?,
                    unknown_rate(
                        target,
                        target_vocab,
                        stats.target_unk,
                        stats.target_tokens,
                        data.max_unk_percent,
                    )?,
                ];
                let held_out = match cfg.held_out_source() {
                    Some(HeldOutSource::Translation { source, target }) => {
                        let held =
                            ParallelCorpus::load(source, target, &src_vocab, &tgt_vocab, &limits)?;
                        let stats = held.stats();
                        notes.push(unknown_rate(
                            source,
                            source_vocab,
                            stats.source_unk,
                            stats.source_tokens,
                            data.max_unk_percent,
                        )?);
                        notes.push(unknown_rate(
                            target,
                            target_vocab,
                            stats.target_unk,
                            stats.target_tokens,
                            data.max_unk_percent,
                        )?);
                        notes.push(format!(
                            "held-out {}: {} sentence pairs ({} cut to --src-max-len {}, {} with an empty side skipped), {} per worker per batch",
                            source.display(),
                            stats.pairs_kept,
                            stats.truncated,
                            data.src_max_len,
                            stats.skipped_empty,
                            local
                        ));
                        let batches = nmt_eval_batches(&held, worker, workers, local);
                        Some(HeldOut::from_batches(
                            batches.into_iter().map(Batch::Nmt).collect(),
                        ))
                    }
                    _ => None,
                };
                let batcher = NmtBatcher::new(
                    Arc::new(corpus),
                    NmtBatcherConfig {
                        batch: sizing,
                        num_buckets: 5,
                        bucket_width: 10,
                        shuffle: true,
                        seed,
                        drop_partial: false,
                    },
                    worker,
                    workers,
                )?;
                let stream = batcher.stream(0);
                Ok(InputPipeline {
                    notes,
                    batches: batches(
                        Stream::Translation { batcher, stream },
                        InputKind::Translation,
                    ),
                    src_vocab_size: src_vocab.len(),
                    tgt_vocab_size: tgt_vocab.len(),
                    held_out,
                })
            }
            DataSource::Text { text, vocab } => {
                let vocab_path = vocab.clone();
                let (corpus, vocab, mut notes) = match vocab {
                    Some(path) => {
                        let vocab = Vocab::lm_from_file(path)?;
                        let corpus = LmCorpus::load(text, &vocab)?;
                        // Every line ends in <eos>, which the file does not hold.
                        let words = corpus.tokens().len() - corpus.lines();
                        let note = unknown_rate(
                            text,
                            path,
                            corpus.unk_count(),
                            words,
                            data.max_unk_percent,
                        )?;
                        (corpus, vocab, vec![note])
                    }
                    None => {
                        let (corpus, vocab) = LmCorpus::load_building_vocab(text)?;
                        (corpus, vocab, Vec::new())
                    }
                };
                let held_out = match cfg.held_out_source() {
                    Some(HeldOutSource::Text { text: held_path }) => {
                        let held = LmCorpus::load(held_path, &vocab)?;
                        let words = held.tokens().len() - held.lines();
                        let vocab_name = match &vocab_path {
                            Some(path) => path.display().to_string(),
                            None => format!("the vocabulary built from {}", text.display()),
                        };
                        notes.push(unknown_rate(
                            held_path,
                            std::path::Path::new(&vocab_name),
                            held.unk_count(),
                            words,
                            data.max_unk_percent,
                        )?);
                        let batches =
                            lm_eval_batches(&held, worker, workers, local, data.src_max_len);
                        Some(HeldOut::from_batches(
                            batches.into_iter().map(Batch::Lm).collect(),
                        ))
                    }
                    _ => None,
                };
                let batcher =
                    LmBatcher::new(Arc::new(corpus), sizing, data.src_max_len, worker, workers)?;
                let stream = batcher.stream();
                Ok(InputPipeline {
                    notes,
                    batches: batches(Stream::Text { batcher, stream }, InputKind::Text),
                    src_vocab_size: vocab.len(),
                    tgt_vocab_size: vocab.len(),
                    held_out,
                })
            }
        }
    }
}

/// The log line of `text`'s unknown-token rate under `vocab`, or
/// [`Error::TooManyUnknownTokens`] when it exceeds `limit` percent.
fn unknown_rate(
    text: &Path,
    vocab: &Path,
    unknown: usize,
    tokens: usize,
    limit: f32,
) -> Result<String> {
    let percent = 100.0 * unknown as f64 / tokens.max(1) as f64;
    if percent > f64::from(limit) {
        return Err(Error::TooManyUnknownTokens {
            text: text.to_path_buf(),
            vocab: vocab.to_path_buf(),
            tokens,
            percent,
            limit,
        });
    }
    Ok(format!(
        "{}: {unknown} of {tokens} tokens ({percent:.2} %) are not in {} and read as <unk>",
        text.display(),
        vocab.display()
    ))
}

#[cfg(test)]
mod tests {
    use ringtrain_data::BundledCorpus;

    use super::*;
    use crate::config::{ModelKind, TrainConfig};

    fn nmt(vocab_src: &Path, vocab_tgt: &Path) -> TrainConfig {
        let c = BundledCorpus::in_repo();
        let mut cfg = TrainConfig::default();
        cfg.data.data = vec![
            c.nmt_train_src,
            c.nmt_train_tgt,
            vocab_src.to_path_buf(),
            vocab_tgt.to_path_buf(),
        ];
        cfg
    }

    fn pipeline(cfg: &TrainConfig, world: usize) -> Result<InputPipeline> {
        InputPipeline::new(&cfg.validate(world)?, 0)
    }

    #[test]
    fn the_unknown_rate_is_reported_and_swapped_vocabularies_fail_naming_both_files() {
        let c = BundledCorpus::in_repo();
        let ok = pipeline(&nmt(&c.nmt_vocab_src, &c.nmt_vocab_tgt), 1);
        let notes = ok.map(|p| p.notes).unwrap_or_default();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[0].contains("train.en")
                && notes[0].contains("vocab.en")
                && notes[0].contains('%'),
            "{notes:?}"
        );

        let mut swapped = nmt(&c.nmt_vocab_tgt, &c.nmt_vocab_src);
        let err = pipeline(&swapped, 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("train.en")
                && err.contains("vocab.xx")
                && err.contains("--max-unk-percent"),
            "{err}"
        );
        swapped.data.max_unk_percent = 100.0;
        assert!(pipeline(&swapped, 1).is_ok());

        let mut lm = TrainConfig::default();
        lm.model.model = ModelKind::Rnnlm;
        let dir = tempfile::tempdir().map_err(|e| Error::Internal(e.to_string()));
        let other = dir.map(|d| {
            let path = d.path().join("other.vocab");
            std::fs::write(&path, "<unk>\n<eos>\nzebra\nquark\n").ok();
            (d, path)
        });
        let Ok((_dir, other)) = other else {
            panic!("no temporary directory");
        };
        lm.data.data = vec![c.lm_train.clone(), other];
        let err = pipeline(&lm, 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("train.txt") && err.contains("other.vocab"),
            "{err}"
        );
        lm.data.data = vec![c.lm_train, c.lm_vocab];
        assert!(pipeline(&lm, 1).is_ok());
    }

    #[test]
    fn a_corpus_smaller_than_one_step_is_refused() {
        let c = BundledCorpus::in_repo();
        let mut cfg = nmt(&c.nmt_vocab_src, &c.nmt_vocab_tgt);
        cfg.data.batch_size = 400;
        let err = pipeline(&cfg, 2)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("train.en") && err.contains("600 sentence pairs") && err.contains("800"),
            "{err}"
        );
        assert!(pipeline(&cfg, 1).is_ok());
    }
}
