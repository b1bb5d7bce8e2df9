//! The input pipeline a rank trains on: synthetic batches or a sharded corpus, read
//! ahead on a background thread.

use std::path::Path;
use std::sync::Arc;

use ringtrain_data::{
    LengthLimits, LmBatcher, LmCorpus, NmtBatcher, NmtBatcherConfig, OverLimit, ParallelCorpus,
    Prefetcher, SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig, Vocab,
};

use crate::config::{DataSource, ValidatedConfig};
use crate::error::{Error, Result};
use crate::trainable::Batch;

/// Batches queued ahead of the training loop.
pub const PREFETCH_DEPTH: usize = 4;

/// A rank's batches and the vocabulary sizes the model must use.
pub struct InputPipeline {
    /// What loading found worth a line in the log (the corpus's unknown-token rates).
    pub notes: Vec<String>,
    /// Infinite stream of this rank's batches.
    pub batches: Prefetcher<Batch>,
    /// Source (or LM) vocabulary size.
    pub src_vocab_size: usize,
    /// Target vocabulary size (NMT; equals the source size for the LM).
    pub tgt_vocab_size: usize,
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
        match cfg.data_source() {
            DataSource::Synthetic if nmt => {
                let mut gen = SyntheticNmt::new(
                    SyntheticNmtConfig {
                        src_vocab_size: data.vocab_size,
                        tgt_vocab_size: data.vocab_size,
                        seq_len: data.src_max_len,
                        batch_size: local,
                        seed,
                    },
                    worker,
                )?;
                let source = std::iter::from_fn(move || Some(Ok(Batch::Nmt(gen.next_batch()))));
                Ok(InputPipeline {
                    notes: Vec::new(),
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: data.vocab_size,
                    tgt_vocab_size: data.vocab_size,
                })
            }
            DataSource::Synthetic => {
                let mut gen = SyntheticLm::new(
                    SyntheticLmConfig {
                        vocab_size: data.vocab_size,
                        steps: data.src_max_len,
                        batch_size: local,
                        seed,
                    },
                    worker,
                )?;
                let source = std::iter::from_fn(move || Some(Ok(Batch::Lm(gen.next_batch()))));
                Ok(InputPipeline {
                    notes: Vec::new(),
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: data.vocab_size,
                    tgt_vocab_size: data.vocab_size,
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
                let corpus = ParallelCorpus::load(
                    source,
                    target,
                    &src_vocab,
                    &tgt_vocab,
                    &LengthLimits {
                        src_max_len: Some(data.src_max_len),
                        tgt_max_len: Some(data.src_max_len),
                        over_limit: OverLimit::Truncate,
                    },
                )?;
                let stats = corpus.stats();
                let notes = vec![
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
                let source = batcher.stream(0).map(|b| Ok(Batch::Nmt(b)));
                Ok(InputPipeline {
                    notes,
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: src_vocab.len(),
                    tgt_vocab_size: tgt_vocab.len(),
                })
            }
            DataSource::Text { text, vocab } => {
                let (corpus, vocab, notes) = match vocab {
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
                let batcher =
                    LmBatcher::new(Arc::new(corpus), sizing, data.src_max_len, worker, workers)?;
                let source = batcher.stream().map(|b| Ok(Batch::Lm(b)));
                Ok(InputPipeline {
                    notes,
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: vocab.len(),
                    tgt_vocab_size: vocab.len(),
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
