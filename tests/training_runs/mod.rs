//! Shared by the training-equivalence tests: a small config, seeded synthetic global
//! batches sliced per worker, and a multi-rank run over the collective's local transport.

use ringtrain::collective::Communicator;
use ringtrain::data::{SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig};
use ringtrain::train::{
    build_model, train, Batch, BatchSplit, EncoderType, ModelKind, OptimizerKind, TrainConfig,
    VariableUpdate,
};

pub const VOCAB: usize = 40;
pub const STEPS: usize = 4;

pub fn config(model: ModelKind, update: VariableUpdate) -> TrainConfig {
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
pub fn batches(
    cfg: &TrainConfig,
    split: &BatchSplit,
    w: usize,
) -> Vec<ringtrain::data::Result<Batch>> {
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
pub fn run(cfg: &TrainConfig, ranks: usize) -> Vec<Vec<f32>> {
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

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
