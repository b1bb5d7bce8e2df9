//! The training loop of one rank.

use std::path::Path;
use std::time::Instant;

use ringtrain_collective::{Communicator, ReduceOp};

use crate::batch_split::BatchSplit;
use crate::checkpoint::Checkpoint;
use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::optimizer::{LossScaler, Optimizer};
use crate::report::{RankFigures, RunReport};
use crate::strategy::{StepInputs, StepStats, Strategy};
use crate::throughput::{format_step_line, StepBreakdown, ThroughputMeter};
use crate::trainable::{Batch, TrainableModel};

/// What a finished run hands back.
pub struct TrainOutcome {
    /// The report (identical on every rank).
    pub report: RunReport,
    /// The communicator, for whatever the caller does next.
    pub comm: Communicator,
}

/// Where log lines go (rank 0 prints them; other ranks pass a sink that drops them).
pub type LogSink<'a> = dyn FnMut(&str) + 'a;

/// Turns a per-rank success or failure into the same outcome on every rank.
fn agree<T>(strategy: &mut Strategy, what: &str, local: Result<T>) -> Result<T> {
    let mut failed = [f64::from(u8::from(local.is_err()))];
    strategy.all_reduce_f64(&mut failed, ReduceOp::Sum)?;
    match local {
        Err(e) => Err(e),
        Ok(_) if failed[0] > 0.0 => Err(Error::RankMismatch(format!(
            "{} rank(s) failed {what}; see their error messages",
            failed[0]
        ))),
        Ok(v) => Ok(v),
    }
}

fn agree_comm<T>(comm: &mut Communicator, what: &str, local: Result<T>) -> Result<T> {
    let mut failed = [f64::from(u8::from(local.is_err()))];
    comm.all_reduce(&mut failed, &ringtrain_collective::AllReduceOptions::sum())?;
    match local {
        Err(e) => Err(e),
        Ok(_) if failed[0] > 0.0 => Err(Error::RankMismatch(format!(
            "{} rank(s) failed {what}; see their error messages",
            failed[0]
        ))),
        Ok(v) => Ok(v),
    }
}

fn save_checkpoint(
    path: &Path,
    cfg: &TrainConfig,
    strategy: &mut Strategy,
    model: &dyn TrainableModel,
    optimizer: &Optimizer,
    scaler: Option<LossScaler>,
    step: u64,
) -> Result<()> {
    let state = strategy.gather_optimizer_state(optimizer)?;
    let local = if strategy.rank() == 0 {
        Checkpoint {
            config: cfg.clone(),
            step,
            params: model.params().to_vec(),
            optimizer: state,
            loss_scaler: scaler,
        }
        .save(path)
    } else {
        Ok(())
    };
    agree(strategy, "to write the checkpoint", local)
}

/// Trains `model` on `batches` for `cfg.warmup_batches + cfg.timed_batches` steps with
/// the strategy `cfg.variable_update` over `comm`. Every rank calls it with the same
/// config. Rank 0's log lines go to `log`.
pub fn train(
    cfg: &TrainConfig,
    mut comm: Communicator,
    model: &mut dyn TrainableModel,
    batches: &mut dyn Iterator<Item = ringtrain_data::Result<Batch>>,
    log: &mut LogSink<'_>,
) -> Result<TrainOutcome> {
    cfg.validate()?;
    let specs = model.param_specs();
    let n_params = model.params().len();
    let covered: usize = specs.iter().map(|s| s.range.len()).sum();
    if covered != n_params {
        return Err(Error::RankMismatch(format!(
            "the model's tensors cover {covered} elements but its buffer has {n_params}"
        )));
    }
    let rank = comm.rank();
    let world = comm.size();
    cfg.validate_for_world(world)?;

    // Resume before the initial broadcast: rank 0's loaded parameters then reach everyone.
    let mut resumed: Option<Checkpoint> = None;
    if cfg.resume {
        let path = cfg.checkpoint.as_deref().unwrap_or(Path::new(""));
        let loaded = Checkpoint::load(path).and_then(|ck| {
            ck.check_compatible(cfg, n_params, path)?;
            Ok(ck)
        });
        let ck = agree_comm(&mut comm, "to load the checkpoint", loaded)?;
        model.params_mut().copy_from_slice(&ck.params);
        resumed = Some(ck);
    }

    let mut strategy = Strategy::new(cfg, comm, &specs, model.params_mut())?;
    let workers = strategy.workers();
    let is_worker = strategy.is_worker();
    let split = BatchSplit::from_config(cfg, workers);
    let mut optimizer = Optimizer::new(cfg.optimizer, cfg.effective_learning_rate(), n_params);
    let mut scaler = cfg.fp16_gradients.then(LossScaler::default);
    let mut step: u64 = 0;
    if let Some(ck) = resumed {
        step = ck.step;
        optimizer.load_state(ck.optimizer)?;
        strategy.localize_optimizer_state(&mut optimizer);
        if cfg.fp16_gradients {
            scaler = Some(ck.loss_scaler.unwrap_or_default());
        }
    }
    if rank == 0 {
        log(&format!(
            "ringtrain: {} | {} parameters | {} ranks, {} workers | {} | batch {} per worker ({} total) | {}",
            model.describe(),
            n_params,
            world,
            workers,
            cfg.strategy_label(),
            split.of(0),
            split.global(),
            cfg.optimizer
        ));
        log("  step\twords/sec: mean +/- jitter\tloss");
    }

    let mut meter = ThroughputMeter::new(cfg.warmup_batches);
    let mut local_timed_words = 0.0f64;
    let mut local_timed_launches = 0.0f64;
    let mut last = StepStats::default();
    for i in 1..=cfg.total_steps() {
        let step_start = Instant::now();
        let mut breakdown = StepBreakdown::default();
        let expected = if strategy.averages_globally() {
            split.global()
        } else {
            split.of(strategy.worker_index())
        } as f64;
        // f16 gradients carry loss scale / examples on the wire; f32 ones travel as they are.
        let wire_scale = match scaler {
            Some(s) => (f64::from(s.scale) / expected.max(1.0)) as f32,
            None => 1.0,
        };
        strategy.begin_step(cfg.fp16_gradients, wire_scale);
        let mut local = StepStats::default();
        let mut launches = 0u64;
        if is_worker {
            let t = Instant::now();
            let batch = match batches.next() {
                Some(b) => b?,
                None => {
                    return Err(Error::RankMismatch(format!(
                        "rank {rank}'s input ended at step {i}; the input pipeline must not run dry"
                    )))
                }
            };
            breakdown.data_wait = t.elapsed().as_secs_f64();
            let strategy_ref = &mut strategy;
            let pass = model.forward_backward(&batch, &mut |r, g| strategy_ref.on_ready(r, g))?;
            breakdown.forward = pass.forward_seconds;
            breakdown.backward = pass.backward_seconds;
            launches = pass.launches;
            local = StepStats {
                loss_sum: pass.loss_sum,
                target_tokens: pass.target_tokens,
                words: batch.words() as f64,
                examples: batch.examples() as f64,
                overflow: 0.0,
            };
        } else {
            // A dedicated parameter server contributes nothing to the gradient sum.
            model.params_and_grads_mut().1.fill(0.0);
        }
        let (params, grads) = model.params_and_grads_mut();
        let outcome = strategy.finish_step(StepInputs {
            params,
            grads,
            local,
            wire_scale,
            max_gradient_norm: cfg.max_gradient_norm,
            optimizer: &mut optimizer,
        })?;
        breakdown.communication = outcome.communication_seconds;
        breakdown.optimizer = outcome.optimizer_seconds;
        if let Some(s) = scaler.as_mut() {
            s.update(outcome.skipped);
        }
        step += 1;
        let elapsed = step_start.elapsed();
        let global_words = if strategy.averages_globally() {
            outcome.stats.words
        } else {
            local.words * workers as f64
        };
        last = outcome.stats;
        let loss = outcome.stats.mean_loss();
        if meter.record_step(i, elapsed, global_words, loss, breakdown) {
            local_timed_words += local.words;
            local_timed_launches += launches as f64;
        }
        if rank == 0
            && cfg.display_every > 0
            && (i % cfg.display_every == 0 || i == cfg.total_steps())
        {
            let stats = if i > cfg.warmup_batches {
                meter.current()
            } else {
                crate::throughput::rate_stats(&[global_words / elapsed.as_secs_f64().max(1e-12)])
            };
            let mut line = format_step_line(i, stats, loss);
            if i <= cfg.warmup_batches {
                line.push_str("\t(warm-up)");
            }
            if outcome.skipped {
                line.push_str(&format!(
                    "\t(f16 overflow: step skipped, loss scale now {})",
                    scaler.map_or(0.0, |s| s.scale)
                ));
            }
            log(&line);
        }
        if let Some(path) = cfg.checkpoint.as_deref() {
            if cfg.checkpoint_every > 0 && step % cfg.checkpoint_every as u64 == 0 {
                save_checkpoint(path, cfg, &mut strategy, &*model, &optimizer, scaler, step)?;
            }
        }
    }
    if let Some(path) = cfg.checkpoint.as_deref() {
        if cfg.checkpoint_every == 0 || step % cfg.checkpoint_every as u64 != 0 {
            save_checkpoint(path, cfg, &mut strategy, &*model, &optimizer, scaler, step)?;
        }
    }

    // Summary over ranks: each rank fills its slot, the sum assembles the table.
    let summary = meter.summary();
    const SLOT: usize = 9;
    let mut slots = vec![0.0f64; SLOT * world];
    let b = summary.mean_breakdown;
    let timed_n = summary.timed_batches.max(1) as f64;
    slots[rank * SLOT..(rank + 1) * SLOT].copy_from_slice(&[
        if is_worker {
            split.of(strategy.worker_index()) as f64
        } else {
            0.0
        },
        local_timed_words,
        summary.timed_seconds,
        b.data_wait,
        b.forward,
        b.backward,
        b.communication,
        b.optimizer,
        local_timed_launches / timed_n,
    ]);
    strategy.all_reduce_f64(&mut slots, ReduceOp::Sum)?;
    let per_rank: Vec<RankFigures> = (0..world)
        .map(|r| {
            let s = &slots[r * SLOT..(r + 1) * SLOT];
            RankFigures {
                rank: r,
                batch_size: s[0] as usize,
                words: s[1],
                seconds: s[2],
                words_per_sec: if s[2] > 0.0 { s[1] / s[2] } else { 0.0 },
                breakdown: StepBreakdown {
                    data_wait: s[3],
                    forward: s[4],
                    backward: s[5],
                    communication: s[6],
                    optimizer: s[7],
                },
                launches_per_batch: s[8],
            }
        })
        .collect();
    let worker_rows: Vec<&RankFigures> = per_rank.iter().filter(|r| r.batch_size > 0).collect();
    let wn = worker_rows.len().max(1) as f64;
    let mean = |f: &dyn Fn(&RankFigures) -> f64| worker_rows.iter().map(|r| f(r)).sum::<f64>() / wn;
    let timed_seconds = per_rank.iter().map(|r| r.seconds).fold(0.0, f64::max);
    let timed_words: f64 = per_rank.iter().map(|r| r.words).sum();
    let mean_breakdown = StepBreakdown {
        data_wait: mean(&|r| r.breakdown.data_wait),
        forward: mean(&|r| r.breakdown.forward),
        backward: mean(&|r| r.breakdown.backward),
        communication: mean(&|r| r.breakdown.communication),
        optimizer: mean(&|r| r.breakdown.optimizer),
    };
    let launches_per_batch = mean(&|r| r.launches_per_batch);
    drop(worker_rows);
    let report = RunReport {
        config: cfg.clone(),
        model: model.describe(),
        parameters: n_params,
        ranks: world,
        workers,
        global_batch_size: split.global(),
        steps: step,
        timed_batches: summary.timed_batches,
        timed_seconds,
        timed_words,
        words_per_sec: if timed_seconds > 0.0 {
            timed_words / timed_seconds
        } else {
            0.0
        },
        per_step_words_per_sec: summary.per_step,
        per_rank,
        breakdown: mean_breakdown,
        launches_per_batch,
        final_loss: last.mean_loss(),
        skipped_steps: scaler.map_or(0, |s| s.skipped_steps),
        loss_scale: scaler.map(|s| s.scale),
    };
    let comm = strategy.shutdown()?;
    Ok(TrainOutcome { report, comm })
}
