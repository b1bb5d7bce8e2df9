//! The training loop of one rank, in three parts:
//!
//! - setup (`setup`): ranks check they share the flags and the model, resume a
//!   checkpoint, broadcast rank 0's parameters, start the strategy and the optimizer;
//! - the steps (`step`): batch, forward and backward with gradient ranges handed to the
//!   strategy as they finish, exchange, update; the loop here measures, logs,
//!   evaluates on the held-out set (stopping at a target perplexity, see
//!   [`crate::evaluation`]) and checkpoints;
//! - the summary (`summary`): every rank's figures, gathered on the control plane,
//!   become the [`RunReport`].

use std::time::Instant;

use ringtrain_collective::Communicator;

use crate::config::ValidatedConfig;
use crate::error::{Error, Result};
use crate::evaluation::{evaluate, EvalRecord, HeldOut, TimeToQuality};
use crate::input::BatchSource;
use crate::interrupt;
use crate::report::RunReport;
use crate::strategy::StepStats;
use crate::throughput::{format_step_line, rate_stats, ThroughputMeter};
use crate::trainable::TrainableModel;

mod setup;
mod step;
mod summary;

use setup::Session;
use summary::TimedTotals;

/// Writes the checkpoint after step `i` of `total`; a stop seen while writing becomes an
/// [`crate::Error::Interrupted`] that names the checkpoint still in place.
fn save(
    session: &mut Session<'_>,
    path: &std::path::Path,
    model: &mut dyn TrainableModel,
    i: usize,
    total: usize,
) -> Result<()> {
    session
        .save_checkpoint(path, model)
        .map_err(|e| match interrupt::requested() {
            Some(signal) => session.interrupted(
                signal,
                format!("while writing the checkpoint after step {i} of {total}"),
            ),
            None => e,
        })
}

/// Ends the session with `error`. A stop is this rank's alone (a signal to one rank, or
/// one seen a step earlier than the others): the other ranks wait for it in the next
/// collective, and shutting the communicators down (`MPI_Finalize` waits for every rank)
/// would wait for them in turn, forever. A stopped rank of a multi-rank run therefore
/// leaves its communicators as they are; it exits without finalizing, and mpirun ends
/// the job.
fn leave(session: Session<'_>, error: Error) -> Error {
    if matches!(error, Error::Interrupted { .. }) && session.cfg.world() > 1 {
        std::mem::forget(session);
    }
    error
}

/// What a finished run hands back.
pub struct TrainOutcome {
    /// The report (identical on every rank).
    pub report: RunReport,
    /// The communicator, for whatever the caller does next.
    pub comm: Communicator,
}

/// Where log lines go (rank 0 prints them; other ranks pass a sink that drops them).
pub type LogSink<'a> = dyn FnMut(&str) + 'a;

/// Trains `model` on `batches` for `cfg.total_steps()` steps with the strategy
/// `--variable-update` over `comm`. Every rank calls it with the same config. Rank 0's
/// log lines go to `log`.
///
/// With `--resume` the run continues the checkpoint's: parameters, optimizer state and
/// loss scale are restored, `batches` moves to the input position each rank saved
/// ([`BatchSource::resume`]; an iterator of batches is positioned by its caller), step
/// numbers go on from the checkpoint's step, and rank 0 logs "resumed from step N of
/// FILE". `--warmup-batches W --timed-batches N` then run W + N more steps, the first W
/// of them warm-up again: a new process allocates and starts up anew, which is what the
/// warm-up keeps out of the measurement.
///
/// # Errors
/// Everything the steps can fail with; ranks started with different flags, and failures
/// of one rank to load or write a checkpoint, fail every rank.
pub fn train(
    cfg: &ValidatedConfig,
    comm: Communicator,
    model: &mut dyn TrainableModel,
    batches: &mut dyn BatchSource,
    log: &mut LogSink<'_>,
) -> Result<TrainOutcome> {
    train_evaluating(cfg, comm, model, batches, None, log)
}

/// [`train`], evaluating on `held_out` (this rank's part of `--eval-data`; `None` for a
/// rank that holds none) every `--eval-every` steps and after the last step, and
/// stopping early at `--target-perplexity` (see [`crate::evaluation`]). Rank 0 logs a
/// line per evaluation; the report lists them and the time to quality.
///
/// # Errors
/// As [`train`]; a held-out set without any token over all ranks.
pub fn train_evaluating(
    cfg: &ValidatedConfig,
    comm: Communicator,
    model: &mut dyn TrainableModel,
    batches: &mut dyn BatchSource,
    held_out: Option<&HeldOut>,
    log: &mut LogSink<'_>,
) -> Result<TrainOutcome> {
    let mut session = Session::start(cfg, comm, model, batches)?;
    let rank = session.rank;
    let run = &cfg.config().run;
    let output = &cfg.config().output;
    if rank == 0 {
        log(&format!(
            "ringtrain: {} | {} parameters | {} ranks, {} workers | {} | batch {} per worker ({} total) | {}",
            model.describe(),
            model.params()?.len(),
            cfg.world(),
            cfg.workers(),
            cfg.strategy_label(),
            cfg.local_batch_size(0),
            cfg.global_batch_size(),
            run.optimizer
        ));
        if let Some(note) = &session.resumed {
            log(&format!("ringtrain: {note}"));
        }
        log("  step\twords/sec: mean +/- jitter\tloss");
    }

    let mut meter = ThroughputMeter::new(run.warmup_batches);
    let mut timed = TimedTotals::default();
    let mut last = StepStats::default();
    let total = cfg.total_steps();
    let target = run.target_perplexity;
    let mut evals: Vec<EvalRecord> = Vec::new();
    let mut quality = target.map(|t| TimeToQuality::not_reached(t, None));
    // Words of every rank and step time since this process's first step.
    let (mut trained_words, mut training_seconds) = (0.0, 0.0);
    let started = Instant::now();
    for i in 1..=total {
        // A stop (SIGINT/SIGTERM) is honoured between steps, never inside one. Step
        // numbers go on from a resumed checkpoint's.
        if let Some(signal) = interrupt::requested() {
            let last = session.step + total as u64 - (i as u64 - 1);
            let during = if i == 1 {
                format!("in setup, before step {} of {last}", session.step + 1)
            } else {
                format!("after step {} of {last}", session.step)
            };
            let e = session.interrupted(signal, during);
            return Err(leave(session, e));
        }
        session.control.set_step(session.step as usize + 1);
        // The step's event covers its evaluation and checkpoint (timeline only).
        let step_start = session
            .timeline
            .as_ref()
            .filter(|t| t.begin_step(session.step + 1))
            .map(|_| Instant::now());
        let copied_before = summary::copied_bytes(run.device);
        let done = session.step(model, batches)?;
        let copied_after = summary::copied_bytes(run.device);
        // Warm-up counts this process's steps.
        let step = session.step as usize;
        let global_words = if session.strategy.averages_globally() {
            done.outcome.stats.words
        } else {
            done.local.words * cfg.workers() as f64
        };
        last = done.outcome.stats;
        trained_words += global_words;
        training_seconds += done.elapsed.as_secs_f64();
        let loss = last.mean_loss();
        if meter.record_step(step, done.elapsed, global_words, loss, done.breakdown) {
            timed.words += done.local.words;
            timed.launches += done.launches as f64;
            timed.add_copied(copied_before, copied_after);
            timed.add_stage(&*model);
            timed.add_ready(&done.ready);
        }
        if rank == 0
            && output.display_every > 0
            && (step.is_multiple_of(output.display_every) || i == total)
        {
            let warmup = i <= run.warmup_batches;
            let stats = if warmup {
                rate_stats(&[global_words / done.elapsed.as_secs_f64().max(1e-12)])
            } else {
                meter.current()
            };
            let mut line = format_step_line(step, stats, loss);
            if warmup {
                line.push_str("\t(warm-up)");
            }
            if done.outcome.skipped {
                line.push_str(&format!(
                    "\t(f16 overflow: step skipped, loss scale now {})",
                    session.loss_scaler(model)?.map_or(0.0, |s| s.scale)
                ));
            }
            log(&line);
        }
        let mut reached = false;
        if cfg.evaluates_after(session.step, i == total) {
            let eval_start = step_start.map(|_| Instant::now());
            let record = evaluate(model, held_out, &mut session.control, session.step)?;
            if let (Some(t), Some(from)) = (&session.timeline, eval_start) {
                let args = serde_json::json!({ "perplexity": record.perplexity });
                t.span("eval", "phase", from, Instant::now(), args);
            }
            if rank == 0 {
                log(&record.log_line());
            }
            evals.push(record);
            if let Some(q) = quality.as_mut() {
                // Every rank holds the same record, so every rank decides alike.
                if record.perplexity <= q.target {
                    *q = TimeToQuality {
                        target: q.target,
                        reached: true,
                        step: Some(session.step),
                        perplexity: Some(record.perplexity),
                        words: Some(trained_words),
                        training_seconds: Some(training_seconds),
                        seconds: Some(started.elapsed().as_secs_f64()),
                    };
                    reached = true;
                } else {
                    let best = q
                        .perplexity
                        .map_or(record.perplexity, |b| b.min(record.perplexity));
                    q.perplexity = Some(best);
                }
            }
        }
        if let Some(path) = output.checkpoint.as_deref() {
            let every = output.checkpoint_every as u64;
            if every > 0 && session.step % every == 0 {
                let saving = step_start.map(|_| Instant::now());
                if let Err(e) = save(&mut session, path, &mut *model, i, total) {
                    return Err(leave(session, e));
                }
                if let (Some(t), Some(from)) = (&session.timeline, saving) {
                    t.span(
                        "checkpoint",
                        "phase",
                        from,
                        Instant::now(),
                        serde_json::json!({}),
                    );
                }
            }
        }
        if let (Some(t), Some(from)) = (&session.timeline, step_start) {
            let args = serde_json::json!({
                "step": session.step,
                "loss": loss,
                "words": done.local.words,
                "skipped": done.outcome.skipped,
            });
            t.span(
                &format!("step {}", session.step),
                "step",
                from,
                Instant::now(),
                args,
            );
        }
        if reached {
            break;
        }
    }
    if let (Some(q), 0) = (&quality, rank) {
        log(&q.log_line());
    }
    if let Some(path) = output.checkpoint.as_deref() {
        let every = output.checkpoint_every as u64;
        if every == 0 || session.step % every != 0 {
            let saving = session
                .timeline
                .as_ref()
                .filter(|t| t.recording())
                .map(|_| Instant::now());
            if let Err(e) = save(&mut session, path, &mut *model, total, total) {
                return Err(leave(session, e));
            }
            if let (Some(t), Some(from)) = (&session.timeline, saving) {
                let args = serde_json::json!({ "step": session.step });
                t.span("final_checkpoint", "run", from, Instant::now(), args);
            }
        }
    }
    // A model that updated on its device leaves the run with its host parameters current.
    if let Some(device) = model.device_resident() {
        device.download_params()?;
    }
    let scaler = session.loss_scaler(model)?;
    let mut report = session.report(&*model, &meter.summary(), timed, last, scaler)?;
    report.eval = evals;
    report.time_to_quality = quality;
    if let Some(timeline) = session.timeline.take() {
        timeline.finish(&mut session.control)?;
    }
    let comm = session.strategy.shutdown()?;
    Ok(TrainOutcome { report, comm })
}
