//! Held-out evaluation (`--eval-data`, `--eval-every`) and time to quality
//! (`--target-perplexity`) on the shipped corpus, ranks as threads over the local
//! transport, driven through `run_rank` with the real input pipeline:
//!
//! - every rank's part adds up to the whole held-out set, at any rank count and with a
//!   dedicated parameter server;
//! - an evaluation changes nothing training computes (parameters, optimizer state, the
//!   input position: the checkpoint of a run that evaluates every step has the bits of
//!   one that never does);
//! - the target perplexity stops every rank at the same step and reports it;
//! - after `--resume` the schedule goes on at the same step numbers;
//! - the evaluations' time is not in the words/s figures.

use std::path::Path;
use std::time::Duration;

use ringtrain_collective::Communicator;
use ringtrain_data::BundledCorpus;
use ringtrain_train::trainable::ReadyCallback;
use ringtrain_train::{
    build_model, local_rank, run_rank, train_evaluating, Batch, Checkpoint, HeldOut, InputPipeline,
    ModelKind, ParamSpec, PassOutput, RunReport, TrainConfig, TrainableModel, VariableUpdate,
};

const MAX_LEN: usize = 6;

fn config(model: ModelKind) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.model = model;
    cfg.model.num_units = 8;
    cfg.run.threads = 1;
    cfg.run.seed = 3;
    cfg.run.warmup_batches = 1;
    cfg.run.timed_batches = 3;
    cfg.output.display_every = 1;
    cfg.data.src_max_len = MAX_LEN;
    cfg.data.batch_size = 16;
    let files = BundledCorpus::in_repo();
    match model {
        ModelKind::Nmt => {
            cfg.data.data = vec![
                files.nmt_train_src,
                files.nmt_train_tgt,
                files.nmt_vocab_src,
                files.nmt_vocab_tgt,
            ];
            cfg.data.eval_data = vec![files.nmt_dev_src, files.nmt_dev_tgt];
        }
        ModelKind::Rnnlm => {
            cfg.data.data = vec![files.lm_train, files.lm_vocab];
            cfg.data.eval_data = vec![files.lm_valid];
        }
    }
    cfg
}

/// Runs `cfg` on `ranks` ranks: every rank's log lines (rank 0's only are kept) and
/// report.
fn run(cfg: &TrainConfig, ranks: usize) -> Vec<(Vec<String>, RunReport)> {
    let cfg = cfg.validate(ranks).expect("a valid test config");
    Communicator::run_local(ranks, |comm| {
        let local = local_rank(&comm)?;
        let mut lines = Vec::new();
        let outcome = run_rank(&cfg, comm, local, &mut |line| lines.push(line.to_string()))?;
        Ok::<_, ringtrain_train::Error>((lines, outcome.report))
    })
    .expect("the local transport runs")
    .into_iter()
    .map(|r| r.expect("every rank trains"))
    .collect()
}

/// Target tokens of the held-out files as the loss counts them: each sentence's target
/// words cut to `MAX_LEN`, plus its `</s>` (NMT); every token but the first of the
/// text, `<eos>` after each line included (LM).
fn expected_tokens(model: ModelKind) -> f64 {
    let files = BundledCorpus::in_repo();
    let count = |path: &Path| -> Vec<usize> {
        std::fs::read_to_string(path)
            .expect("bundled file")
            .lines()
            .map(|l| l.split_whitespace().count())
            .collect()
    };
    match model {
        ModelKind::Nmt => count(&files.nmt_dev_tgt)
            .iter()
            .map(|&n| n.min(MAX_LEN) + 1)
            .sum::<usize>() as f64,
        ModelKind::Rnnlm => {
            let words: usize = count(&files.lm_valid).iter().map(|n| n + 1).sum();
            (words - 1) as f64
        }
    }
}

#[test]
fn every_ranks_part_adds_up_to_the_whole_held_out_set() {
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let expected = expected_tokens(model);
        let mut cfg = config(model);
        cfg.run.eval_every = 2;
        for (ranks, ps_ranks) in [(1, 0), (2, 0), (3, 0), (3, 1)] {
            let mut cfg = cfg.clone();
            if ps_ranks > 0 {
                cfg.exchange.variable_update = VariableUpdate::ParameterServer;
                cfg.exchange.ps_ranks = ps_ranks;
            }
            let results = run(&cfg, ranks);
            let (lines, report) = &results[0];
            let steps: Vec<u64> = report.eval.iter().map(|e| e.step).collect();
            assert_eq!(steps, [2, 4], "{model} on {ranks} ranks: {lines:?}");
            for e in &report.eval {
                assert_eq!(
                    e.tokens, expected,
                    "{model} on {ranks} ranks ({ps_ranks} ps)"
                );
                assert!(e.loss.is_finite() && e.loss > 0.0, "{e:?}");
                assert!((e.perplexity - e.loss.exp()).abs() < 1e-9 * e.perplexity);
            }
            // Every rank holds the same figures.
            for (_, other) in &results[1..] {
                assert_eq!(other.eval, report.eval);
            }
            let logged = lines.iter().filter(|l| l.contains("eval\tstep")).count();
            assert_eq!(logged, 2, "{lines:?}");
            assert!(
                lines
                    .iter()
                    .any(|l| l.contains("held-out") && l.contains("dev.en")
                        || l.contains("valid.txt")),
                "{lines:?}"
            );
        }
    }
}

#[test]
fn evaluating_changes_nothing_that_training_computes() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    for model in [ModelKind::Nmt, ModelKind::Rnnlm] {
        let with_eval = dir.path().join(format!("{model}-eval.ckpt"));
        let without = dir.path().join(format!("{model}-plain.ckpt"));
        let mut cfg = config(model);
        cfg.run.eval_every = 1;
        cfg.output.checkpoint = Some(with_eval.clone());
        let evaluated = run(&cfg, 2);
        assert_eq!(evaluated[0].1.eval.len(), 4);
        let mut plain = config(model);
        plain.data.eval_data.clear();
        plain.output.checkpoint = Some(without.clone());
        let trained = run(&plain, 2);
        assert!(trained[0].1.eval.is_empty());
        let (a, b) = (
            Checkpoint::load(&with_eval).expect("checkpoint"),
            Checkpoint::load(&without).expect("checkpoint"),
        );
        let bits = |c: &Checkpoint| c.params.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b), "{model}: parameters");
        assert_eq!(
            format!("{:?}", a.optimizer),
            format!("{:?}", b.optimizer),
            "{model}: optimizer state"
        );
        assert_eq!(a.input, b.input, "{model}: input positions");
        assert_eq!(
            evaluated[0].1.final_loss, trained[0].1.final_loss,
            "{model}: training loss"
        );
    }
}

#[test]
fn the_target_perplexity_stops_every_rank_at_the_same_step() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ck = dir.path().join("stop.ckpt");
    let mut cfg = config(ModelKind::Nmt);
    cfg.run.eval_every = 2;
    cfg.run.timed_batches = 7;
    // Any model reaches a perplexity below this: the first evaluation stops the run.
    cfg.run.target_perplexity = Some(1e9);
    cfg.output.checkpoint = Some(ck.clone());
    let results = run(&cfg, 2);
    for (_, report) in &results {
        assert_eq!(report.steps, 2);
        let q = report.time_to_quality.expect("a target was set");
        assert!(q.reached && q.step == Some(2), "{q:?}");
        assert!(q.words.is_some_and(|w| w > 0.0), "{q:?}");
        let (train, wall) = (
            q.training_seconds.unwrap_or(-1.0),
            q.seconds.unwrap_or(-1.0),
        );
        assert!(train > 0.0 && wall >= train, "{q:?}");
        assert_eq!(report.eval.len(), 1);
    }
    let lines = &results[0].0;
    assert!(
        lines
            .iter()
            .any(|l| l.contains("target perplexity") && l.contains("reached at step 2")),
        "{lines:?}"
    );
    assert_eq!(Checkpoint::load(&ck).expect("checkpoint").step, 2);

    // A target no model of this size reaches: the run goes on to the end and says so.
    cfg.run.target_perplexity = Some(1.0001);
    cfg.output.checkpoint = None;
    let results = run(&cfg, 2);
    let (lines, report) = &results[0];
    assert_eq!(report.steps, 8);
    let q = report.time_to_quality.expect("a target was set");
    assert!(!q.reached && q.step.is_none(), "{q:?}");
    let best = report
        .eval
        .iter()
        .map(|e| e.perplexity)
        .fold(f64::INFINITY, f64::min);
    assert_eq!(q.perplexity, Some(best));
    assert!(lines.iter().any(|l| l.contains("not reached")), "{lines:?}");
}

#[test]
fn after_resume_the_schedule_keeps_its_step_numbers() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let ck = dir.path().join("resume.ckpt");
    let mut cfg = config(ModelKind::Rnnlm);
    cfg.run.eval_every = 3;
    cfg.output.checkpoint = Some(ck);
    let first = run(&cfg, 2);
    let steps: Vec<u64> = first[0].1.eval.iter().map(|e| e.step).collect();
    assert_eq!(steps, [3, 4]);
    cfg.output.resume = true;
    let second = run(&cfg, 2);
    let steps: Vec<u64> = second[0].1.eval.iter().map(|e| e.step).collect();
    assert_eq!(steps, [6, 8]);
}

/// A model whose evaluation takes at least `pause`: the rest is the real model's.
struct SlowEvaluation {
    inner: Box<dyn TrainableModel>,
    pause: Duration,
}

impl TrainableModel for SlowEvaluation {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.inner.param_specs()
    }
    fn params(&self) -> ringtrain_train::Result<&[f32]> {
        self.inner.params()
    }
    fn params_mut(&mut self) -> ringtrain_train::Result<&mut [f32]> {
        self.inner.params_mut()
    }
    fn params_and_grads_mut(&mut self) -> ringtrain_train::Result<(&mut [f32], &mut [f32])> {
        self.inner.params_and_grads_mut()
    }
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> ringtrain_train::Result<PassOutput> {
        self.inner.forward_backward(batch, on_ready)
    }
    fn evaluate(&mut self, batches: &[Batch]) -> ringtrain_train::Result<PassOutput> {
        std::thread::sleep(self.pause);
        self.inner.evaluate(batches)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
}

/// The evaluations' time stays out of the timed steps: two evaluations of at least a
/// second each, around steps that take milliseconds, leave the timed seconds (the words/s
/// denominator) under a second and are reported on their own.
#[test]
fn evaluation_time_is_kept_out_of_the_throughput() {
    let mut cfg = config(ModelKind::Nmt);
    cfg.run.warmup_batches = 0;
    cfg.run.timed_batches = 4;
    cfg.run.eval_every = 2;
    let run = cfg.validate(1).expect("a valid test config");
    let report = Communicator::run_local(1, |comm| {
        let pipeline = InputPipeline::new(&run, 0)?;
        let held_out = pipeline.held_out.expect("--eval-data was given");
        // One batch per evaluation: the pause is paid once per evaluation.
        let held_out = HeldOut::from_batches(held_out.batches()[..1].to_vec());
        let inner = build_model(&run, pipeline.src_vocab_size, pipeline.tgt_vocab_size, 0, 1)?;
        let mut model = SlowEvaluation {
            inner,
            pause: Duration::from_secs(1),
        };
        let mut batches = pipeline.batches;
        train_evaluating(
            &run,
            comm,
            &mut model,
            &mut batches,
            Some(&held_out),
            &mut |_| {},
        )
        .map(|o| o.report)
    })
    .expect("the local transport runs")
    .remove(0)
    .expect("trains");
    assert_eq!(report.eval.len(), 2);
    for e in &report.eval {
        assert!(e.seconds >= 1.0, "{e:?}");
    }
    assert!(
        report.timed_seconds < 1.0,
        "the timed steps took {} s: the evaluations' 2 s were counted",
        report.timed_seconds
    );
}
