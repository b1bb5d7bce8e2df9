//! The corpus in data/ loads, and its vocabulary files are exactly what the text gives.

use std::sync::Arc;

use ringtrain_data::{
    BatchSizing, BundledCorpus, LengthLimits, LmBatcher, LmCorpus, NmtBatcher, NmtBatcherConfig,
    ParallelCorpus, Vocab, LM_SPECIALS, NMT_SPECIALS, UNK_ID,
};

fn lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .expect("bundled file is readable")
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn vocab_files_match_the_text() {
    let files = BundledCorpus::in_repo();
    for (text, vocab_file, specials) in [
        (
            &files.nmt_train_src,
            &files.nmt_vocab_src,
            &NMT_SPECIALS[..],
        ),
        (
            &files.nmt_train_tgt,
            &files.nmt_vocab_tgt,
            &NMT_SPECIALS[..],
        ),
        (&files.lm_train, &files.lm_vocab, &LM_SPECIALS[..]),
    ] {
        let built = Vocab::build_from_text(lines(text), specials, None).expect("builds");
        let loaded = Vocab::from_file(vocab_file, specials).expect("loads");
        assert_eq!(
            built,
            loaded,
            "{} is stale: run scripts/prepare-corpus",
            vocab_file.display()
        );
        assert!(loaded.len() > 100);
    }
}

#[test]
fn nmt_splits_load_and_batch() {
    let files = BundledCorpus::in_repo();
    let src_vocab = Vocab::nmt_from_file(&files.nmt_vocab_src).expect("vocab");
    let tgt_vocab = Vocab::nmt_from_file(&files.nmt_vocab_tgt).expect("vocab");
    let limits = LengthLimits::default();
    let train = ParallelCorpus::load(
        &files.nmt_train_src,
        &files.nmt_train_tgt,
        &src_vocab,
        &tgt_vocab,
        &limits,
    )
    .expect("train loads");
    assert_eq!(train.len(), 600);
    assert_eq!(train.stats().source_unk + train.stats().target_unk, 0);
    for (src, tgt) in [
        (&files.nmt_dev_src, &files.nmt_dev_tgt),
        (&files.nmt_test_src, &files.nmt_test_tgt),
    ] {
        let split = ParallelCorpus::load(src, tgt, &src_vocab, &tgt_vocab, &limits).expect("loads");
        assert_eq!(split.len(), 80);
    }
    let batcher = NmtBatcher::new(
        Arc::new(train),
        NmtBatcherConfig::new(BatchSizing::PerRank(32), 5),
        0,
        2,
    )
    .expect("batcher");
    let words: usize = batcher.epoch(0).map(|b| b.words()).sum();
    let stats = batcher.corpus().stats().clone();
    // Rank 0 sees about half of the corpus: 300 pairs.
    assert!(words > 0 && words < stats.source_tokens + stats.target_tokens + 600);
    let pairs: usize = batcher.epoch(0).map(|b| b.batch_size).sum();
    assert_eq!(pairs, 300);
}

#[test]
fn lm_splits_load_and_batch() {
    let files = BundledCorpus::in_repo();
    let vocab = Vocab::lm_from_file(&files.lm_vocab).expect("vocab");
    let train = LmCorpus::load(&files.lm_train, &vocab).expect("train");
    assert_eq!(train.lines(), 1500);
    assert_eq!(train.unk_count(), 0);
    let valid = LmCorpus::load(&files.lm_valid, &vocab).expect("valid");
    assert_eq!(valid.lines(), 150);
    assert!(valid.tokens().iter().all(|&id| (id as usize) < vocab.len()));
    let (built, built_vocab) = LmCorpus::load_building_vocab(&files.lm_train).expect("builds");
    assert_eq!(built_vocab, vocab);
    assert_eq!(built.tokens(), train.tokens());
    assert!(
        train.tokens().contains(&UNK_ID),
        "the text has literal <unk> names"
    );
    let batcher = LmBatcher::new(Arc::new(train), BatchSizing::Total(20), 35, 1, 2).expect("ok");
    assert_eq!(batcher.local_batch_size(), 10);
    assert!(batcher.batches_per_epoch() > 5);
    assert_eq!(
        batcher
            .stream()
            .take(batcher.batches_per_epoch() + 1)
            .count(),
        batcher.batches_per_epoch() + 1
    );
}

/// The held-out files (README's default `--eval-data`) share no sentence with the
/// training files: a held-out perplexity measures generalisation, not recall. Lines are
/// compared with their whitespace normalised, as the corpus readers split them; for
/// NMT a pair counts as seen when either side occurs in training.
#[test]
fn held_out_files_share_no_line_with_the_training_files() {
    let files = BundledCorpus::in_repo();
    let normal = |path: &std::path::Path| -> std::collections::HashSet<String> {
        lines(path)
            .iter()
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|l| !l.is_empty())
            .collect()
    };
    for (train, held_out) in [
        (&files.nmt_train_src, &files.nmt_dev_src),
        (&files.nmt_train_tgt, &files.nmt_dev_tgt),
        (&files.nmt_train_src, &files.nmt_test_src),
        (&files.nmt_train_tgt, &files.nmt_test_tgt),
        (&files.lm_train, &files.lm_valid),
        (&files.lm_train, &files.lm_test),
    ] {
        let seen = normal(train);
        let held = normal(held_out);
        assert!(!held.is_empty(), "{} is empty", held_out.display());
        let shared: Vec<&String> = held.intersection(&seen).collect();
        assert!(
            shared.is_empty(),
            "{} shares {} line(s) with {}, e.g. {:?}",
            held_out.display(),
            shared.len(),
            train.display(),
            shared.first()
        );
    }
}
