//! The input pipeline a rank trains on: synthetic batches or a sharded corpus, read
//! ahead on a background thread.

use std::sync::Arc;

use ringtrain_data::{
    LengthLimits, LmBatcher, LmCorpus, NmtBatcher, NmtBatcherConfig, OverLimit, ParallelCorpus,
    Prefetcher, SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig, Vocab,
};

use crate::config::{DataSource, ValidatedConfig};
use crate::error::Result;
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

impl InputPipeline {
    /// Builds worker `worker`'s pipeline.
    ///
    /// # Errors
    /// The data crate's: unreadable or malformed corpora and vocabularies, a corpus too
    /// small for the batch.
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
                    batches: Prefetcher::spawn(source, PREFETCH_DEPTH)?,
                    src_vocab_size: src_vocab.len(),
                    tgt_vocab_size: tgt_vocab.len(),
                })
            }
            DataSource::Text { text, vocab } => {
                let (corpus, vocab) = match vocab {
                    Some(v) => {
                        let vocab = Vocab::lm_from_file(v)?;
                        (LmCorpus::load(text, &vocab)?, vocab)
                    }
                    None => LmCorpus::load_building_vocab(text)?,
                };
                let batcher =
                    LmBatcher::new(Arc::new(corpus), sizing, data.src_max_len, worker, workers)?;
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
