//! The input pipeline a rank trains on: synthetic batches or a sharded corpus, read
//! ahead on a background thread.

use std::sync::Arc;

use ringtrain_data::{
    BatchSizing, LengthLimits, LmBatcher, LmCorpus, NmtBatcher, NmtBatcherConfig, OverLimit,
    ParallelCorpus, Prefetcher, SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig,
    Vocab,
};

use crate::config::{ModelKind, TrainConfig};
use crate::error::{Error, Result};
use crate::trainable::Batch;

/// Batches queued ahead of the training loop.
pub const PREFETCH_DEPTH: usize = 4;

/// A rank's batches and the vocabulary sizes the model must use.
pub struct InputPipeline {
    /// Infinite stream of this rank's batches.
    pub batches: Prefetcher<Batch>,
    /// Source (or LM) vocabulary size.
    pub src_vocab_size: usize,
    /// Target vocabulary size (NMT; equals the source size for the LM).
    pub tgt_vocab_size: usize,
}

fn sizing(cfg: &TrainConfig) -> BatchSizing {
    match cfg.total_batch_size {
        Some(t) => BatchSizing::Total(t),
        None => BatchSizing::PerRank(cfg.batch_size),
    }
}

fn required<'a>(
    path: &'a Option<std::path::PathBuf>,
    what: &'static str,
) -> Result<&'a std::path::Path> {
    path.as_deref().ok_or_else(|| {
        Error::invalid(
            "--data",
            "(incomplete)",
            format!("the {what} file is missing: give --data SRC,TGT,SRC_VOCAB,TGT_VOCAB (NMT) or --data TEXT[,VOCAB] (RNNLM)"),
        )
    })
}

impl InputPipeline {
    /// Builds worker `worker`'s pipeline out of `workers`.
    pub fn new(cfg: &TrainConfig, worker: usize, workers: usize) -> Result<Self> {
        let local = sizing(cfg).local_batch_size(worker, workers)?;
        let seed = cfg.seed.wrapping_mul(0x9E37_79B9).wrapping_add(17);
        match (cfg.model, cfg.use_synthetic_data) {
            (ModelKind::Nmt, true) => {
                let mut gen = SyntheticNmt::new(
                    SyntheticNmtConfig {
                        src_vocab_size: cfg.vocab_size,
                        tgt_vocab_size: cfg.vocab_size,
                        seq_len: cfg.src_max_len,
                        batch_size: local,
                        seed,
                    },
                    worker,
                )?;
                let source = std::iter::from_fn(move || Some(Ok(Batch::Nmt(gen.next_batch()))));
                Ok(InputPipeline {
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: cfg.vocab_size,
                    tgt_vocab_size: cfg.vocab_size,
                })
            }
            (ModelKind::Rnnlm, true) => {
                let mut gen = SyntheticLm::new(
                    SyntheticLmConfig {
                        vocab_size: cfg.vocab_size,
                        steps: cfg.src_max_len,
                        batch_size: local,
                        seed,
                    },
                    worker,
                )?;
                let source = std::iter::from_fn(move || Some(Ok(Batch::Lm(gen.next_batch()))));
                Ok(InputPipeline {
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: cfg.vocab_size,
                    tgt_vocab_size: cfg.vocab_size,
                })
            }
            (ModelKind::Nmt, false) => {
                let d = &cfg.data;
                let src_vocab = Vocab::nmt_from_file(required(&d.vocab_src, "source vocabulary")?)?;
                let tgt_vocab = Vocab::nmt_from_file(required(&d.vocab_tgt, "target vocabulary")?)?;
                let corpus = ParallelCorpus::load(
                    required(&d.train_src, "source text")?,
                    required(&d.train_tgt, "target text")?,
                    &src_vocab,
                    &tgt_vocab,
                    &LengthLimits {
                        src_max_len: Some(cfg.src_max_len),
                        tgt_max_len: Some(cfg.src_max_len),
                        over_limit: OverLimit::Truncate,
                    },
                )?;
                let batcher = NmtBatcher::new(
                    Arc::new(corpus),
                    NmtBatcherConfig {
                        batch: sizing(cfg),
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
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: src_vocab.len(),
                    tgt_vocab_size: tgt_vocab.len(),
                })
            }
            (ModelKind::Rnnlm, false) => {
                let d = &cfg.data;
                let text = required(&d.train_src, "training text")?;
                let (corpus, vocab) = match &d.vocab_src {
                    Some(v) => {
                        let vocab = Vocab::lm_from_file(v)?;
                        (LmCorpus::load(text, &vocab)?, vocab)
                    }
                    None => LmCorpus::load_building_vocab(text)?,
                };
                let batcher = LmBatcher::new(
                    Arc::new(corpus),
                    sizing(cfg),
                    cfg.src_max_len,
                    worker,
                    workers,
                )?;
                let source = batcher.stream().map(|b| Ok(Batch::Lm(b)));
                Ok(InputPipeline {
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: vocab.len(),
                    tgt_vocab_size: vocab.len(),
                })
            }
        }
    }
}
