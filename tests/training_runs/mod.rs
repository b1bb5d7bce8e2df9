//! Shared by the training-equivalence tests: a small config, seeded synthetic global
//! batches sliced per worker, and a multi-rank run over the collective's local transport.

use ringtrain::collective::Communicator;
use ringtrain::data::{SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig};
use ringtrain::train::{
    build_model, train, Batch, LstmImpl, ModelKind, OptimizerKind, TrainConfig, ValidatedConfig,
    VariableUpdate,
};

pub const VOCAB: usize = 40;
pub const STEPS: usize = 4;

pub fn config(model: ModelKind, update: VariableUpdate) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.model = model;
    cfg.model.encoder_type = LstmImpl::Fused.into();
    cfg.model.num_encoder_layers = 2;
    cfg.model.num_decoder_layers = 2;
    cfg.model.num_units = 12;
    cfg.exchange.variable_update = update;
    cfg.data.vocab_size = VOCAB;
    cfg.data.src_max_len = 6;
    cfg.run.optimizer = OptimizerKind::Sgd;
    cfg.run.learning_rate = Some(0.5);
    cfg.run.max_gradient_norm = 0.0;
    cfg.run.warmup_batches = 1;
    cfg.run.timed_batches = STEPS - 1;
    cfg.run.threads = 1;
    cfg.output.display_every = 0;
    cfg
}

/// `cfg` with `change` applied.
pub fn with(cfg: &TrainConfig, change: impl FnOnce(&mut TrainConfig)) -> TrainConfig {
    let mut cfg = cfg.clone();
    change(&mut cfg);
    cfg
}

/// Global batches cut into worker `w`'s examples.
pub fn batches(cfg: &ValidatedConfig, w: usize) -> Vec<ringtrain::data::Result<Batch>> {
    let global = cfg.global_batch_size();
    let src_max_len = cfg.config().data.src_max_len;
    let mut out = Vec::new();
    match cfg.config().model.model {
        ModelKind::Nmt => {
            let mut g = SyntheticNmt::new(
                SyntheticNmtConfig {
                    src_vocab_size: VOCAB,
                    tgt_vocab_size: VOCAB,
                    seq_len: src_max_len,
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
                    steps: src_max_len,
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
    let mine = cfg
        .batch()
        .local_range(w, cfg.workers())
        .expect("worker of the run");
    out.into_iter()
        .map(|b| Ok(b.columns(mine.clone())))
        .collect()
}

/// Final parameters of every rank.
pub fn run(cfg: &TrainConfig, ranks: usize) -> Vec<Vec<f32>> {
    let run = cfg.validate(ranks).expect("a valid test config");
    Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        // Different initial values per rank: rank 0's broadcast must make them equal.
        let mut model = initial_model(cfg, 100 + rank as u64);
        let mut data = if run.is_worker(rank) {
            batches(&run, rank)
        } else {
            Vec::new()
        }
        .into_iter();
        let out = train(&run, comm, model.as_mut(), &mut data, &mut |_| {}).unwrap();
        assert_eq!(out.report.steps as usize, STEPS);
        model.params().expect("settled parameters").to_vec()
    })
    .unwrap()
}

/// The model `cfg` builds with parameters drawn from `seed`, on one rank.
pub fn initial_model(cfg: &TrainConfig, seed: u64) -> Box<dyn ringtrain::train::TrainableModel> {
    let cfg = with(cfg, |c| c.run.seed = seed)
        .validate(1)
        .expect("a valid test config");
    build_model(&cfg, VOCAB, VOCAB, 0, 1).expect("the model builds")
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
