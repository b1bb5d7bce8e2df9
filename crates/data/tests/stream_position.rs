//! A stream rebuilt and moved to a saved position hands out exactly the batches the
//! original stream hands out next, across epoch boundaries, for the bundled corpora and
//! the synthetic generators. Case counts follow `PROPTEST_CASES`.

use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use ringtrain_data::{
    BatchSizing, BundledCorpus, EpochPosition, LengthLimits, LmBatcher, LmCorpus, NmtBatcher,
    NmtBatcherConfig, ParallelCorpus, SyntheticNmt, SyntheticNmtConfig, Vocab,
};

fn nmt_corpus() -> Arc<ParallelCorpus> {
    static CORPUS: OnceLock<Arc<ParallelCorpus>> = OnceLock::new();
    Arc::clone(CORPUS.get_or_init(|| {
        let files = BundledCorpus::in_repo();
        let src = Vocab::nmt_from_file(&files.nmt_vocab_src).expect("bundled vocab");
        let tgt = Vocab::nmt_from_file(&files.nmt_vocab_tgt).expect("bundled vocab");
        Arc::new(
            ParallelCorpus::load(
                &files.nmt_train_src,
                &files.nmt_train_tgt,
                &src,
                &tgt,
                &LengthLimits::default(),
            )
            .expect("bundled corpus"),
        )
    }))
}

fn lm_corpus() -> Arc<LmCorpus> {
    static CORPUS: OnceLock<Arc<LmCorpus>> = OnceLock::new();
    Arc::clone(CORPUS.get_or_init(|| {
        let files = BundledCorpus::in_repo();
        let vocab = Vocab::lm_from_file(&files.lm_vocab).expect("bundled vocab");
        Arc::new(LmCorpus::load(&files.lm_train, &vocab).expect("bundled text"))
    }))
}

proptest! {
    #[test]
    fn nmt_stream_resumes_at_its_position(
        consumed in 0usize..400,
        size in 1usize..4,
        rank_pick in 0usize..4,
        batch in 1usize..40,
        seed in any::<u64>(),
    ) {
        let rank = rank_pick % size;
        let batcher = NmtBatcher::new(
            nmt_corpus(),
            NmtBatcherConfig::new(BatchSizing::PerRank(batch), seed),
            rank,
            size,
        )
        .expect("valid batcher");
        let mut straight = batcher.stream(0);
        for _ in 0..consumed {
            straight.next().expect("endless");
        }
        let saved = straight.position();
        let mut resumed = batcher.stream_at(saved);
        for _ in 0..3 {
            prop_assert_eq!(resumed.next(), straight.next());
        }
        prop_assert_eq!(resumed.position(), straight.position());
        let first_epoch = batcher.batches_in_epoch(0);
        prop_assert_eq!(saved.epoch == 0, consumed <= first_epoch);
    }

    #[test]
    fn lm_stream_resumes_at_its_position(
        consumed in 0usize..300,
        batch in 1usize..12,
        steps in 1usize..30,
    ) {
        let batcher = LmBatcher::new(lm_corpus(), BatchSizing::PerRank(batch), steps, 1, 2)
            .expect("valid batcher");
        let mut straight = batcher.stream();
        for _ in 0..consumed {
            straight.next().expect("endless");
        }
        let saved = straight.position();
        let per_epoch = batcher.batches_per_epoch();
        prop_assert_eq!(
            saved,
            EpochPosition {
                epoch: (consumed.saturating_sub(1) / per_epoch) as u64,
                batch: if consumed == 0 { 0 } else { ((consumed - 1) % per_epoch + 1) as u64 },
            }
        );
        let mut resumed = batcher.stream_at(saved);
        for _ in 0..3 {
            prop_assert_eq!(resumed.next(), straight.next());
        }
        prop_assert_eq!(resumed.position(), straight.position());
    }

    #[test]
    fn synthetic_stream_resumes_at_its_position(consumed in 0usize..50, seed in any::<u64>()) {
        let cfg = SyntheticNmtConfig {
            src_vocab_size: 50,
            tgt_vocab_size: 7,
            seq_len: 4,
            batch_size: 3,
            seed,
        };
        let mut straight = SyntheticNmt::new(cfg, 2).expect("valid");
        for _ in 0..consumed {
            straight.next_batch();
        }
        let mut resumed = SyntheticNmt::new(cfg, 2).expect("valid");
        resumed.seek(straight.position());
        prop_assert_eq!(resumed.next_batch(), straight.next_batch());
    }
}
