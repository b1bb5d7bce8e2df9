//! Property tests: sharding, batch splitting, bucketing, synthetic determinism, and the
//! per-epoch coverage of the NMT and LM batchers.

use std::collections::BTreeSet;
use std::sync::Arc;

use proptest::prelude::*;
use ringtrain_data::{
    bucket_of, lm_eval_batches, nmt_eval_batches, rank_range, rank_share, BatchSizing, LmBatcher,
    LmCorpus, NmtBatcher, NmtBatcherConfig, ParallelCorpus, SyntheticLm, SyntheticLmConfig,
    SyntheticNmt, SyntheticNmtConfig, BOS_ID, EOS_ID,
};

/// Cases per property: `PROPTEST_CASES` when set (a long soak), else `quick`, this
/// file's default, sized for CI.
fn cases(quick: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(quick)
}

fn config() -> ProptestConfig {
    ProptestConfig::with_cases(cases(48))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn rank_ranges_are_disjoint_complete_and_balanced(total in 0usize..500, size in 1usize..17) {
        let mut next = 0;
        for rank in 0..size {
            let range = rank_range(total, rank, size);
            prop_assert_eq!(range.start, next);
            prop_assert_eq!(range.len(), rank_share(total, rank, size));
            next = range.end;
        }
        prop_assert_eq!(next, total);
        let shares: Vec<usize> = (0..size).map(|r| rank_share(total, r, size)).collect();
        let (min, max) = (shares.iter().min().copied(), shares.iter().max().copied());
        prop_assert!(max.unwrap_or(0) - min.unwrap_or(0) <= 1);
        // Larger shares come first.
        prop_assert!(shares.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn total_batch_splits_sum_to_total(total in 1usize..300, size in 1usize..9) {
        let sizing = BatchSizing::Total(total);
        if total < size {
            prop_assert!(sizing.local_batch_size(0, size).is_err());
        } else {
            let sum: usize = (0..size)
                .map(|r| sizing.local_batch_size(r, size).unwrap_or(0))
                .sum();
            prop_assert_eq!(sum, total);
            prop_assert_eq!(sizing.global_batch_size(size), total);
        }
    }

    #[test]
    fn per_rank_batches_tile_the_global_batch(batch in 1usize..64, size in 1usize..9) {
        let sizing = BatchSizing::PerRank(batch);
        let mut next = 0;
        for rank in 0..size {
            let range = sizing.local_range(rank, size).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(range.start, next);
            prop_assert_eq!(range.len(), batch);
            next = range.end;
        }
        prop_assert_eq!(next, sizing.global_batch_size(size));
    }

    #[test]
    fn buckets_are_bounded_and_monotone(len in 0usize..400, width in 1usize..20, buckets in 1usize..8) {
        let b = bucket_of(len, width, buckets);
        prop_assert!(b < buckets);
        prop_assert!(bucket_of(len + 1, width, buckets) >= b);
        if len / width < buckets {
            prop_assert_eq!(b, len / width);
        }
    }

    #[test]
    fn synthetic_data_is_reproducible_and_differs_by_rank(
        seed in any::<u64>(), rank in 0usize..8, len in 1usize..12, batch in 1usize..6, vocab in 2usize..50,
    ) {
        let cfg = SyntheticNmtConfig { src_vocab_size: vocab, tgt_vocab_size: vocab + 3, seq_len: len, batch_size: batch, seed };
        let a: Vec<_> = SyntheticNmt::new(cfg, rank).map_err(|e| TestCaseError::fail(e.to_string()))?.take(3).collect();
        let b: Vec<_> = SyntheticNmt::new(cfg, rank).map_err(|e| TestCaseError::fail(e.to_string()))?.take(3).collect();
        prop_assert_eq!(&a, &b);
        for batch_data in &a {
            prop_assert!(batch_data.source.iter().all(|&id| (id as usize) < vocab));
            prop_assert!(batch_data.target_input.iter().all(|&id| (id as usize) < vocab + 3));
            prop_assert_eq!(batch_data.words(), 2 * batch * len);
        }
        let other: Vec<_> = SyntheticNmt::new(cfg, rank + 1).map_err(|e| TestCaseError::fail(e.to_string()))?.take(3).collect();
        // 9 * batch * len ids drawn from >= 2 values: equal by chance with probability <= 2^-9.
        prop_assert_ne!(&a, &other);
        let lm = SyntheticLmConfig { vocab_size: vocab, steps: len, batch_size: batch, seed };
        let x: Vec<_> = SyntheticLm::new(lm, rank).map_err(|e| TestCaseError::fail(e.to_string()))?.take(2).collect();
        let y: Vec<_> = SyntheticLm::new(lm, rank).map_err(|e| TestCaseError::fail(e.to_string()))?.take(2).collect();
        prop_assert_eq!(x, y);
    }
}

/// Pairs whose ids encode their index, with varied target lengths.
fn id_corpus(n: usize, lengths: &[usize]) -> Arc<ParallelCorpus> {
    let pairs: Vec<(Vec<u32>, Vec<u32>)> = (0..n)
        .map(|i| {
            let tgt_len = lengths[i % lengths.len()].max(1);
            (vec![10 + i as u32], vec![10 + i as u32; tgt_len])
        })
        .collect();
    Arc::new(ParallelCorpus::from_id_pairs(pairs, "generated").expect("non-empty"))
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn nmt_epoch_shards_are_disjoint_and_complete(
        n in 1usize..120, size in 1usize..6, batch in 1usize..12, per_rank in any::<bool>(),
        shuffle in any::<bool>(), seed in any::<u64>(), epoch in 0u64..4,
        lengths in proptest::collection::vec(1usize..60, 1..8),
    ) {
        prop_assume!(if per_rank { n >= batch * size } else { n >= batch && batch >= size });
        let corpus = id_corpus(n, &lengths);
        let sizing = if per_rank { BatchSizing::PerRank(batch) } else { BatchSizing::Total(batch) };
        let mut cfg = NmtBatcherConfig::new(sizing, seed);
        cfg.shuffle = shuffle;
        let mut seen = BTreeSet::new();
        let mut count = 0;
        for rank in 0..size {
            let batcher = NmtBatcher::new(Arc::clone(&corpus), cfg, rank, size)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let local = batcher.local_batch_size();
            let plan = batcher.epoch_plan(epoch);
            let mut rank_count = 0;
            for (indices, batch_data) in plan.iter().zip(batcher.epoch(epoch)) {
                prop_assert!(!indices.is_empty() && indices.len() <= local);
                prop_assert_eq!(batch_data.batch_size, indices.len());
                // All sentences of a batch share a bucket.
                let buckets: BTreeSet<usize> = indices
                    .iter()
                    .map(|&i| bucket_of(corpus.pair(i).map_or(0, |(_, t)| t.len()), 10, 5))
                    .collect();
                prop_assert_eq!(buckets.len(), 1);
                // The batch holds exactly the planned pairs (ids encode the index).
                for (row, &i) in indices.iter().enumerate() {
                    // Time-major: step 0 of example `row`.
                    prop_assert_eq!(batch_data.source[row], 10 + i as u32);
                    prop_assert_eq!(batch_data.target_input[row], BOS_ID);
                }
                for &i in indices {
                    prop_assert!(seen.insert(i), "pair {} used twice", i);
                }
                rank_count += indices.len();
            }
            prop_assert_eq!(rank_count, rank_share(n, rank, size));
            count += rank_count;
        }
        prop_assert_eq!(count, n);
        prop_assert_eq!(seen.len(), n);
    }

    #[test]
    fn nmt_epochs_are_reproducible(n in 8usize..80, seed in any::<u64>(), epoch in 0u64..5) {
        let corpus = id_corpus(n, &[3, 15, 27]);
        let cfg = NmtBatcherConfig::new(BatchSizing::PerRank(4), seed);
        let a = NmtBatcher::new(Arc::clone(&corpus), cfg, 1, 2).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let b = NmtBatcher::new(Arc::clone(&corpus), cfg, 1, 2).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(a.epoch_plan(epoch), b.epoch_plan(epoch));
        prop_assert_eq!(a.epoch(epoch).collect::<Vec<_>>(), b.epoch(epoch).collect::<Vec<_>>());
    }

    #[test]
    fn lm_windows_cover_every_column_once(
        tokens in 20usize..400, size in 1usize..5, batch in 1usize..5, steps in 1usize..9, per_rank in any::<bool>(),
    ) {
        let global = if per_rank { batch * size } else { batch.max(size) };
        prop_assume!(tokens / global >= 2);
        let sizing = if per_rank { BatchSizing::PerRank(batch) } else { BatchSizing::Total(batch.max(size)) };
        let text: Vec<u32> = (0..tokens as u32).collect();
        let corpus = Arc::new(LmCorpus::from_ids(text, "generated"));
        let column_len = tokens / global;
        let mut predicted = BTreeSet::new();
        let mut per_rank_batches = BTreeSet::new();
        for rank in 0..size {
            let batcher = LmBatcher::new(Arc::clone(&corpus), sizing, steps, rank, size)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(batcher.dropped_tail_tokens(), tokens - column_len * global);
            per_rank_batches.insert(batcher.batches_per_epoch());
            for (w, lm_batch) in batcher.epoch().enumerate() {
                prop_assert_eq!(lm_batch.first_in_epoch, w == 0);
                for cell in 0..lm_batch.batch_size * lm_batch.steps {
                    if lm_batch.mask[cell] == 1.0 {
                        // The text is 0, 1, 2, ...: the target follows the input.
                        prop_assert_eq!(lm_batch.targets[cell], lm_batch.inputs[cell] + 1);
                        prop_assert!(predicted.insert(lm_batch.targets[cell]));
                    }
                }
            }
        }
        prop_assert_eq!(per_rank_batches.len(), 1);
        // Every token except each column's first is predicted exactly once.
        prop_assert_eq!(predicted.len(), global * (column_len - 1));
    }
}

#[test]
fn nmt_batch_marks_eos_in_target_output() {
    let corpus = id_corpus(3, &[2]);
    let batcher = NmtBatcher::new(
        corpus,
        NmtBatcherConfig::new(BatchSizing::PerRank(3), 0),
        0,
        1,
    )
    .expect("valid");
    let batch = batcher.epoch(0).next().expect("a batch");
    assert_eq!(batch.tgt_len, 3);
    // Time-major: the last step (2) of each of the 3 examples.
    for example in 0..3 {
        assert_eq!(batch.target_output[2 * 3 + example], EOS_ID);
    }
}

#[test]
fn drop_partial_keeps_only_full_batches() {
    let corpus = id_corpus(50, &[3, 15, 27]);
    let mut cfg = NmtBatcherConfig::new(BatchSizing::PerRank(4), 3);
    cfg.drop_partial = true;
    let batcher = NmtBatcher::new(Arc::clone(&corpus), cfg, 0, 2).expect("valid");
    let sizes: Vec<usize> = batcher.epoch(0).map(|b| b.batch_size).collect();
    assert!(!sizes.is_empty());
    assert!(sizes.iter().all(|&s| s == 4), "{sizes:?}");
    // 25 pairs per rank in three buckets cannot all be used in batches of 4.
    assert!(sizes.len() * 4 < 25);
    // A batch larger than any bucket leaves nothing: an error, not an empty stream.
    cfg.batch = BatchSizing::PerRank(20);
    let err = NmtBatcher::new(corpus, cfg, 0, 2).expect_err("no full batch");
    assert!(err.to_string().contains("drop_partial"), "{err}");
}

#[test]
fn shuffling_changes_between_epochs_and_the_stream_continues() {
    let corpus = id_corpus(60, &[5]);
    let cfg = NmtBatcherConfig::new(BatchSizing::PerRank(60), 11);
    let batcher = NmtBatcher::new(Arc::clone(&corpus), cfg, 0, 1).expect("valid");
    // One batch per epoch holding every pair, in a seeded order that changes per epoch.
    let epoch0 = batcher.epoch_plan(0);
    let epoch1 = batcher.epoch_plan(1);
    assert_eq!(epoch0.len(), 1);
    assert_ne!(epoch0, epoch1);
    let mut sorted = epoch1[0].clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..60).collect::<Vec<_>>());
    let mut stream = batcher.stream(0);
    let streamed: Vec<_> = stream.by_ref().take(3).collect();
    assert_eq!(streamed[0], batcher.epoch(0).next().expect("batch"));
    assert_eq!(streamed[2], batcher.epoch(2).next().expect("batch"));
    assert_eq!(stream.epoch(), 2);
    // Without shuffling the order is the file order.
    let mut fixed = cfg;
    fixed.shuffle = false;
    let plain = NmtBatcher::new(corpus, fixed, 0, 1).expect("valid");
    assert_eq!(plain.epoch_plan(3), vec![(0..60).collect::<Vec<_>>()]);
}

#[test]
fn too_few_pairs_for_the_ranks_is_an_error() {
    // Also fewer than one step's batch over all ranks: batches would be smaller than
    // the report says.
    let corpus = id_corpus(7, &[1]);
    let err = NmtBatcher::new(
        Arc::clone(&corpus),
        NmtBatcherConfig::new(BatchSizing::PerRank(4), 0),
        0,
        2,
    )
    .expect_err("7 pairs, 2 ranks of 4");
    assert!(
        err.to_string()
            .contains("only 7 sentence pairs, fewer than one step's 8"),
        "{err}"
    );
    assert!(NmtBatcher::new(
        Arc::clone(&corpus),
        NmtBatcherConfig::new(BatchSizing::Total(7), 0),
        0,
        2
    )
    .is_ok());
    let corpus = id_corpus(2, &[1]);
    let err = NmtBatcher::new(
        corpus,
        NmtBatcherConfig::new(BatchSizing::PerRank(1), 0),
        0,
        3,
    )
    .expect_err("2 pairs, 3 ranks");
    assert!(err.to_string().contains("only 2 sentence pairs"), "{err}");
}

proptest! {
    #![proptest_config(config())]

    /// Over all ranks, the held-out translation batches hold every pair exactly once, in
    /// batches of at most the batch size; masked positions are exactly the targets + 1.
    #[test]
    fn nmt_eval_batches_hold_every_pair_once(
        pairs in 1usize..60, size in 1usize..6, batch in 1usize..9,
    ) {
        let corpus = ParallelCorpus::from_id_pairs(
            (0..pairs).map(|i| (vec![7u32; 1 + i % 4], vec![100 + i as u32; 1 + i % 3])),
            "p",
        ).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut seen = Vec::new();
        let mut tokens = 0.0;
        for rank in 0..size {
            for b in nmt_eval_batches(&corpus, rank, size, batch) {
                prop_assert!(b.batch_size >= 1 && b.batch_size <= batch);
                seen.extend_from_slice(&b.target_output[..b.batch_size]);
                tokens += b.target_mask.iter().map(|&m| f64::from(m)).sum::<f64>();
            }
        }
        seen.sort_unstable();
        prop_assert_eq!(seen, (0..pairs).map(|i| 100 + i as u32).collect::<Vec<_>>());
        let expected: usize = (0..pairs).map(|i| 1 + i % 3 + 1).sum();
        prop_assert_eq!(tokens, expected as f64);
    }

    /// Over all ranks, the held-out LM batches predict every next token exactly once.
    #[test]
    fn lm_eval_batches_predict_every_token_once(
        len in 2usize..300, size in 1usize..6, batch in 1usize..9, steps in 1usize..12,
    ) {
        let corpus = LmCorpus::from_ids((0..len as u32).collect(), "t");
        let mut predicted = Vec::new();
        for rank in 0..size {
            for b in lm_eval_batches(&corpus, rank, size, batch, steps) {
                prop_assert!(b.batch_size <= batch && b.steps <= steps);
                for i in 0..b.mask.len() {
                    if b.mask[i] == 1.0 {
                        prop_assert_eq!(b.targets[i], b.inputs[i] + 1);
                        predicted.push(b.targets[i]);
                    }
                }
            }
        }
        predicted.sort_unstable();
        prop_assert_eq!(predicted, (1..len as u32).collect::<Vec<_>>());
    }
}
