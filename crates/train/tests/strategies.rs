//! The variable-update strategies against a small exact model, over the local thread
//! transport: N ranks × batch B must end with the parameters of 1 rank × batch N·B.

use std::ops::Range;

use ringtrain_collective::Communicator;
use ringtrain_data::{SyntheticNmt, SyntheticNmtConfig};
use ringtrain_train::{
    train, Batch, OptimizerKind, OverlapMode, ParamSpec, PassOutput, TrainConfig, TrainableModel,
    ValidatedConfig, VariableUpdate,
};

/// Token-level softmax regression: logits = emb[input] · proj + bias, label = target.
/// Small enough that every gradient is exact; three tensors so parameter servers split it.
struct TokenRegression {
    vocab: usize,
    dim: usize,
    params: Vec<f32>,
    grads: Vec<f32>,
    /// Multiplies every gradient (to provoke f16 overflow).
    gain: f32,
}

impl TokenRegression {
    fn new(vocab: usize, dim: usize, seed: u64) -> Self {
        let n = vocab * dim * 2 + vocab;
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let params: Vec<f32> = (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.5
            })
            .collect();
        TokenRegression {
            vocab,
            dim,
            grads: vec![0.0; params.len()],
            gain: 1.0,
            params,
        }
    }
    fn emb(&self) -> Range<usize> {
        0..self.vocab * self.dim
    }
    fn proj(&self) -> Range<usize> {
        self.vocab * self.dim..2 * self.vocab * self.dim
    }
    fn bias(&self) -> Range<usize> {
        2 * self.vocab * self.dim..self.params.len()
    }
}

impl TrainableModel for TokenRegression {
    fn param_specs(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec {
                name: "emb".into(),
                range: self.emb(),
            },
            ParamSpec {
                name: "proj".into(),
                range: self.proj(),
            },
            ParamSpec {
                name: "bias".into(),
                range: self.bias(),
            },
        ]
    }
    fn params(&self) -> ringtrain_train::Result<&[f32]> {
        Ok(&self.params)
    }
    fn params_mut(&mut self) -> ringtrain_train::Result<&mut [f32]> {
        Ok(&mut self.params)
    }
    fn params_and_grads_mut(&mut self) -> ringtrain_train::Result<(&mut [f32], &mut [f32])> {
        Ok((&mut self.params, &mut self.grads))
    }
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ringtrain_train::trainable::ReadyCallback<'_>,
    ) -> ringtrain_train::Result<PassOutput> {
        let Batch::Nmt(b) = batch else {
            panic!("test model takes NMT batches")
        };
        let (v, d) = (self.vocab, self.dim);
        let mut grads = std::mem::take(&mut self.grads);
        grads.fill(0.0);
        let (emb, proj, bias) = (self.emb(), self.proj(), self.bias());
        let mut out = PassOutput::default();
        let mut logits = vec![0.0f64; v];
        for i in 0..b.batch_size * b.tgt_len {
            let m = b.target_mask[i];
            if m == 0.0 {
                continue;
            }
            let x = b.target_input[i] as usize % v;
            let y = b.target_output[i] as usize % v;
            let e = &self.params[emb.start + x * d..emb.start + (x + 1) * d];
            for (c, l) in logits.iter_mut().enumerate() {
                *l = f64::from(self.params[bias.start + c])
                    + (0..d)
                        .map(|k| f64::from(e[k]) * f64::from(self.params[proj.start + k * v + c]))
                        .sum::<f64>();
            }
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
            out.loss_sum += f64::from(m) * (max + z.ln() - logits[y]);
            out.target_tokens += f64::from(m);
            for c in 0..v {
                let p = (logits[c] - max).exp() / z - if c == y { 1.0 } else { 0.0 };
                let g = (p * f64::from(m) * f64::from(self.gain)) as f32;
                grads[bias.start + c] += g;
                for k in 0..d {
                    grads[proj.start + k * v + c] += e[k] * g;
                    grads[emb.start + x * d + k] += self.params[proj.start + k * v + c] * g;
                }
            }
        }
        // Report the tensors in reverse order, as backward would finish them.
        let mut result = Ok(());
        for r in [bias, proj, emb] {
            if result.is_ok() {
                result = on_ready(r.clone(), &grads[r]);
            }
        }
        self.grads = grads;
        result.map(|()| out)
    }
    fn evaluate(&mut self, batches: &[Batch]) -> ringtrain_train::Result<PassOutput> {
        let saved = self.grads.clone();
        let mut sum = PassOutput::default();
        let result = batches.iter().try_for_each(|batch| {
            let out = self.forward_backward(batch, &mut |_, _| Ok(()))?;
            sum.loss_sum += out.loss_sum;
            sum.target_tokens += out.target_tokens;
            Ok(())
        });
        self.grads = saved;
        result.map(|()| sum)
    }
    fn describe(&self) -> String {
        format!("token regression v{} d{}", self.vocab, self.dim)
    }
}

const VOCAB: usize = 16;
const LEN: usize = 5;
const STEPS: usize = 4;

/// Global batches of `cfg`'s global batch size; worker `worker` takes its examples.
fn batches_for(
    cfg: &ValidatedConfig,
    worker: usize,
    seed: u64,
) -> Vec<ringtrain_data::Result<Batch>> {
    let mut gen = SyntheticNmt::new(
        SyntheticNmtConfig {
            src_vocab_size: VOCAB,
            tgt_vocab_size: VOCAB,
            seq_len: LEN,
            batch_size: cfg.global_batch_size(),
            seed,
        },
        0,
    )
    .unwrap();
    let mine = cfg.batch().local_range(worker, cfg.workers()).unwrap();
    (0..STEPS)
        .map(|_| Ok(Batch::Nmt(gen.next_batch()).columns(mine.clone())))
        .collect()
}

fn config(update: VariableUpdate, optimizer: OptimizerKind) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.exchange.variable_update = update;
    cfg.run.optimizer = optimizer;
    cfg.run.learning_rate = Some(if optimizer == OptimizerKind::Sgd {
        0.5
    } else {
        0.01
    });
    cfg.run.max_gradient_norm = 0.0;
    cfg.run.warmup_batches = 1;
    cfg.run.timed_batches = STEPS - 1;
    cfg.output.display_every = 0;
    cfg.data.use_synthetic_data = Some(true);
    cfg
}

/// `cfg` with `change` applied.
fn with(cfg: &TrainConfig, change: impl FnOnce(&mut TrainConfig)) -> TrainConfig {
    let mut cfg = cfg.clone();
    change(&mut cfg);
    cfg
}

/// Trains on `ranks` threads; returns every rank's final parameters.
fn run(cfg: &TrainConfig, ranks: usize) -> Vec<Vec<f32>> {
    let cfg = cfg.validate(ranks).unwrap();
    Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        // Every rank starts from different values: the broadcast from rank 0 must fix that.
        let mut model = TokenRegression::new(VOCAB, 4, 7 + rank as u64);
        let mut batches = if cfg.is_worker(rank) {
            batches_for(&cfg, rank, 99)
        } else {
            Vec::new()
        }
        .into_iter();
        let outcome = train(&cfg, comm, &mut model, &mut batches, &mut |_| {}).unwrap();
        assert_eq!(outcome.report.steps, STEPS as u64);
        model.params.clone()
    })
    .unwrap()
}

fn single(cfg: &TrainConfig, global_batch: usize) -> Vec<f32> {
    let cfg = with(cfg, |c| {
        c.data.batch_size = global_batch;
        c.data.total_batch_size = None;
        c.exchange.variable_update = VariableUpdate::Replicated;
        c.exchange.ps_ranks = 0;
    });
    run(&cfg, 1).remove(0)
}

fn assert_close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: max difference {worst} > {tol}");
}

fn initial() -> Vec<f32> {
    TokenRegression::new(VOCAB, 4, 7).params
}

#[test]
fn replicated_overlapped_two_ranks_equal_one_rank_with_double_batch() {
    let cfg = with(
        &config(VariableUpdate::Replicated, OptimizerKind::Sgd),
        |c| {
            c.data.batch_size = 4;
            c.exchange.overlap_backward = OverlapMode::On;
        },
    );
    let ranks = run(&cfg, 2);
    let reference = single(&cfg, 8);
    let after_backward = run(
        &with(&cfg, |c| c.exchange.overlap_backward = OverlapMode::Off),
        2,
    );
    assert_close(
        &after_backward[1],
        &reference,
        1e-5,
        "2x4 reduced after backward vs 1x8",
    );
    assert_close(&ranks[0], &ranks[1], 0.0, "replicas");
    assert_close(&ranks[0], &reference, 1e-5, "2x4 vs 1x8");
    // With global-norm clipping active the result must still match.
    let clipped = with(&cfg, |c| c.run.max_gradient_norm = 0.05);
    let ranks_clipped = run(&clipped, 2);
    assert_close(
        &ranks_clipped[0],
        &single(&clipped, 8),
        1e-5,
        "clipped 2x4 vs 1x8",
    );
    assert!(ranks_clipped[0]
        .iter()
        .zip(&ranks[0])
        .any(|(a, b)| (a - b).abs() > 1e-4));
    // Training moved the parameters (the test would pass trivially otherwise).
    assert!(reference
        .iter()
        .zip(initial())
        .any(|(a, b)| (a - b).abs() > 1e-3));
}

#[test]
fn replicated_packed_and_aggregated_equal_one_rank() {
    let base = with(
        &config(VariableUpdate::Replicated, OptimizerKind::Sgd),
        |c| c.data.batch_size = 3,
    );
    let reference = single(&base, 9);
    for cfg in [
        with(&base, |c| c.exchange.gradient_repacking = 2),
        with(&base, |c| {
            c.exchange.agg_small_grads_max_bytes = 1024;
            c.exchange.agg_small_grads_max_group = 2;
        }),
    ] {
        let ranks = run(&cfg, 3);
        assert_close(&ranks[2], &reference, 1e-5, "packed 3x3 vs 1x9");
    }
}

#[test]
fn uneven_total_batch_is_weighted_by_examples() {
    let cfg = with(
        &config(VariableUpdate::Replicated, OptimizerKind::Sgd),
        |c| c.data.total_batch_size = Some(10),
    );
    let ranks = run(&cfg, 3); // 4, 3, 3
    let reference = single(&cfg, 10);
    assert_close(&ranks[1], &reference, 1e-5, "total 10 over 3 ranks vs 1x10");
}

#[test]
fn parameter_server_equals_replicated() {
    let repl = with(
        &config(VariableUpdate::Replicated, OptimizerKind::Adam),
        |c| c.data.batch_size = 4,
    );
    let reference = run(&repl, 2);
    let ps = with(&repl, |c| {
        c.exchange.variable_update = VariableUpdate::ParameterServer
    });
    let shards = run(&ps, 2);
    assert_close(&shards[0], &shards[1], 0.0, "ps replicas");
    assert_close(&shards[0], &reference[0], 1e-5, "ps vs replicated");
    // Dedicated server: 3 ranks, the last one serves, two workers train.
    let out = run(&with(&ps, |c| c.exchange.ps_ranks = 1), 3);
    assert_close(&out[2], &reference[0], 1e-5, "dedicated ps vs replicated");
    assert_close(
        &out[0],
        &reference[0],
        1e-5,
        "dedicated ps worker vs replicated",
    );
    // SGD with and without clipping: the averaging itself must be right.
    let repl_sgd = with(
        &config(VariableUpdate::Replicated, OptimizerKind::Sgd),
        |c| {
            c.data.batch_size = 4;
            c.run.max_gradient_norm = 0.05;
        },
    );
    let ps_sgd = with(&repl_sgd, |c| {
        c.exchange.variable_update = VariableUpdate::ParameterServer
    });
    let a = run(&repl_sgd, 2);
    let b = run(&ps_sgd, 2);
    assert_close(&b[1], &a[0], 1e-5, "ps vs replicated, sgd with clipping");
    assert_close(
        &run(&with(&ps_sgd, |c| c.run.max_gradient_norm = 0.0), 2)[0],
        &single(&config(VariableUpdate::Replicated, OptimizerKind::Sgd), 8),
        1e-5,
        "ps 2x4 vs 1x8",
    );
}

#[test]
fn independent_replicas_train_only_on_their_own_data() {
    let cfg = with(
        &config(VariableUpdate::Independent, OptimizerKind::Sgd),
        |c| c.data.batch_size = 4,
    );
    let ranks = run(&cfg, 2);
    // Rank 0's data is examples 0..4 of each global batch of 8.
    let two_ranks = cfg.validate(2).unwrap();
    let alone = cfg.validate(1).unwrap();
    let own = Communicator::run_local(1, |comm| {
        let mut model = TokenRegression::new(VOCAB, 4, 7);
        let mut batches = batches_for(&two_ranks, 0, 99).into_iter();
        train(&alone, comm, &mut model, &mut batches, &mut |_| {}).unwrap();
        model.params.clone()
    })
    .unwrap();
    assert_close(
        &ranks[0],
        &own[0],
        1e-6,
        "independent rank 0 vs its own data alone",
    );
    assert!(ranks[0]
        .iter()
        .zip(&ranks[1])
        .any(|(a, b)| (a - b).abs() > 1e-4));
}

#[test]
fn fp16_gradients_track_f32_training() {
    let cfg = with(
        &config(VariableUpdate::Replicated, OptimizerKind::Sgd),
        |c| {
            c.data.batch_size = 4;
            c.exchange.fp16_gradients = true;
        },
    );
    let ranks = run(&cfg, 2);
    let overlapped = run(
        &with(&cfg, |c| c.exchange.overlap_backward = OverlapMode::On),
        2,
    );
    assert_close(
        &overlapped[0],
        &ranks[0],
        1e-6,
        "fp16 overlapped vs after backward",
    );
    let reference = single(&with(&cfg, |c| c.exchange.fp16_gradients = false), 8);
    assert_close(&ranks[0], &ranks[1], 0.0, "fp16 replicas");
    assert_close(&ranks[0], &reference, 2e-3, "fp16 vs f32");
}

#[test]
fn ranks_with_different_flags_fail_on_every_rank_instead_of_hanging() {
    let results = Communicator::run_local(2, |comm| {
        let rank = comm.rank();
        let mut cfg = config(VariableUpdate::Replicated, OptimizerKind::Sgd);
        if rank == 1 {
            cfg.data.batch_size = 5;
        }
        let cfg = cfg.validate(2).unwrap();
        let mut model = TokenRegression::new(VOCAB, 4, 7);
        let mut batches = batches_for(&cfg, rank, 1).into_iter();
        train(&cfg, comm, &mut model, &mut batches, &mut |_| {})
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    for err in results {
        let err = err.expect("a mismatch must be an error");
        assert!(
            err.contains("--batch-size: rank 0 = 32, rank 1 = 5"),
            "{err}"
        );
    }
}

#[test]
fn f16_overflow_skips_the_step_on_every_rank_and_halves_the_loss_scale() {
    let cfg = with(
        &config(VariableUpdate::Replicated, OptimizerKind::Sgd),
        |c| {
            c.data.batch_size = 4;
            c.exchange.fp16_gradients = true;
        },
    );
    let cfg = cfg.validate(2).unwrap();
    let out = Communicator::run_local(2, |comm| {
        let rank = comm.rank();
        let mut model = TokenRegression::new(VOCAB, 4, 7);
        // Gradients of 1e5 times the loss overflow f16 at every scale this short run reaches.
        model.gain = 1e5;
        let mut batches = batches_for(&cfg, rank, 99).into_iter();
        let report = train(&cfg, comm, &mut model, &mut batches, &mut |_| {})
            .unwrap()
            .report;
        (
            report.skipped_steps,
            report.loss_scale,
            model.params.clone(),
        )
    })
    .unwrap();
    let start = initial();
    for (skipped, scale, params) in out {
        assert_eq!(
            skipped, STEPS as u64,
            "every step overflowed and was skipped"
        );
        assert_eq!(scale, Some(65536.0 / (1u32 << STEPS) as f32));
        assert_close(
            &params,
            &start,
            0.0,
            "skipped steps leave the parameters alone",
        );
    }
}
