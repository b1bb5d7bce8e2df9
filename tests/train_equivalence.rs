//! Data parallelism must not change the mathematics: N ranks × batch B with replicated
//! averaging and SGD end with the parameters of 1 rank × batch N·B (NMT and RNNLM), and
//! the parameter-server strategy ends where replicated does. Ranks are threads over the
//! collective's local transport.

use ringtrain::collective::Communicator;
use ringtrain::data::{SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig};
use ringtrain::train::{
    build_model, train, Batch, BatchSplit, EncoderType, ModelKind, OptimizerKind, TrainConfig,
    VariableUpdate,
};

const VOCAB: usize = 40;
const STEPS: usize = 4;

fn config(model: ModelKind, update: VariableUpdate) -> TrainConfig {
    TrainConfig {
        model,
        variable_update: update,
        encoder_type: EncoderType::Fused,
        num_encoder_layers: 2,
        num_decoder_layers: 2,
        num_units: 12,
        vocab_size: VOCAB,
        src_max_len: 6,
        optimizer: OptimizerKind::Sgd,
        learning_rate: Some(0.5),
        max_gradient_norm: 0.0,
        warmup_batches: 1,
        timed_batches: STEPS - 1,
        display_every: 0,
        threads: 1,
        ..TrainConfig::default()
    }
}

/// Global batches sliced into worker `w`'s rows.
fn batches(cfg: &TrainConfig, split: &BatchSplit, w: usize) -> Vec<ringtrain::data::Result<Batch>> {
    let global = split.global();
    let mut out = Vec::new();
    match cfg.model {
        ModelKind::Nmt => {
            let mut g = SyntheticNmt::new(
                SyntheticNmtConfig {
                    src_vocab_size: VOCAB,
                    tgt_vocab_size: VOCAB,
                    seq_len: cfg.src_max_len,
                    batch_size: global,
                    seed: 5,
                },
                0,
            )
            .unwrap();
            for _ in 0..STEPS {
                out.push(Batch::Nmt(g.next_batch()));
            }
        }
        ModelKind::Rnnlm => {
            let mut g = SyntheticLm::new(
                SyntheticLmConfig {
                    vocab_size: VOCAB,
                    steps: cfg.src_max_len,
                    batch_size: global,
                    seed: 5,
                },
                0,
            )
            .unwrap();
            for _ in 0..STEPS {
                out.push(Batch::Lm(g.next_batch()));
            }
        }
    }
    let start = split.offset(w);
    out.into_iter()
        .map(|b| Ok(b.slice_rows(start..start + split.of(w))))
        .collect()
}

/// Final parameters of every rank.
fn run(cfg: &TrainConfig, ranks: usize) -> Vec<Vec<f32>> {
    let workers = cfg.worker_count(ranks);
    let split = BatchSplit::from_config(cfg, workers);
    Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        // Different initial values per rank: rank 0's broadcast must make them equal.
        let init = TrainConfig {
            seed: 100 + rank as u64,
            ..cfg.clone()
        };
        let mut model = build_model(&init, VOCAB, VOCAB, 0, 1).unwrap();
        let mut data = if rank < workers {
            batches(cfg, &split, rank)
        } else {
            Vec::new()
        }
        .into_iter();
        let out = train(cfg, comm, model.as_mut(), &mut data, &mut |_| {}).unwrap();
        assert_eq!(out.report.steps as usize, STEPS);
        model.params().to_vec()
    })
    .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn check_data_parallel(model: ModelKind) {
    let per_rank = TrainConfig {
        batch_size: 3,
        ..config(model, VariableUpdate::Replicated)
    };
    let single = run(
        &TrainConfig {
            batch_size: 6,
            ..per_rank.clone()
        },
        1,
    );
    for overlap_backward in [false, true] {
        let ranks = run(
            &TrainConfig {
                overlap_backward,
                ..per_rank.clone()
            },
            2,
        );
        assert_eq!(max_diff(&ranks[0], &ranks[1]), 0.0, "replicas diverged");
        let d = max_diff(&ranks[0], &single[0]);
        assert!(
            d <= 1e-5,
            "{model}: 2 ranks x 3 vs 1 rank x 6 differ by {d} (overlap {overlap_backward})"
        );
    }
    // The run must have moved the parameters for the comparison to mean anything.
    let start = build_model(
        &TrainConfig {
            seed: 100,
            ..per_rank.clone()
        },
        VOCAB,
        VOCAB,
        0,
        1,
    )
    .unwrap();
    assert!(
        max_diff(start.params(), &single[0]) > 1e-3,
        "{model}: training did not change the parameters"
    );
}

#[test]
fn nmt_two_ranks_equal_one_rank_with_the_whole_batch() {
    check_data_parallel(ModelKind::Nmt);
}

#[test]
fn rnnlm_two_ranks_equal_one_rank_with_the_whole_batch() {
    check_data_parallel(ModelKind::Rnnlm);
}

#[test]
fn nmt_uneven_total_batch_over_three_ranks_equals_one_rank() {
    let cfg = TrainConfig {
        total_batch_size: Some(7),
        ..config(ModelKind::Nmt, VariableUpdate::Replicated)
    };
    let ranks = run(&cfg, 3); // 3, 2, 2
    let single = run(&cfg, 1);
    let d = max_diff(&ranks[2], &single[0]);
    assert!(
        d <= 1e-5,
        "total batch 7 over 3 ranks vs 1 rank differ by {d}"
    );
}

#[test]
fn parameter_server_gives_the_parameters_replicated_gives() {
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let repl = TrainConfig {
            batch_size: 2,
            ..config(model, VariableUpdate::Replicated)
        };
        let a = run(&repl, 2);
        let b = run(
            &TrainConfig {
                variable_update: VariableUpdate::ParameterServer,
                ..repl.clone()
            },
            2,
        );
        let d = max_diff(&a[0], &b[1]);
        assert!(
            d <= 1e-5,
            "{model}: parameter_server vs replicated differ by {d}"
        );
    }
}
