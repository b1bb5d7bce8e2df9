//! Held-out evaluation and time to quality.
//!
//! With `--eval-data` every worker loads its part of the held-out set once
//! ([`HeldOut`]: every sentence pair, or every next-token prediction of a text, exactly
//! once over the workers, in batches of the worker's training batch size; see
//! [`ringtrain_data::held_out`]). Every `--eval-every` steps and after the last step,
//! [`evaluate`] runs the model forward only over the rank's part (no gradient is used,
//! no parameter, optimizer state or training input position changes, and the models
//! have no dropout to switch off), gathers every rank's loss sum and token count on the
//! control plane, and adds them up in rank order, so that every rank holds the same
//! figures bit for bit and takes the same decisions from them:
//!
//! - **loss** = summed token cross-entropy (natural log) / target tokens, padding not
//!   counted (NMT: the target words and each sentence's `</s>`; LM: every predicted
//!   token);
//! - **perplexity** = exp(loss).
//!
//! The time an evaluation takes is kept out of the throughput figures (which time the
//! training steps alone) and reported beside them ([`EvalRecord::seconds`]).
//!
//! With `--target-perplexity P` the run stops after the first evaluation whose
//! perplexity is at most `P`, and [`TimeToQuality`] reports the step, the words trained
//! on and the time it took: training time (the steps alone) and wall time (with the
//! evaluations). Words and time are those of this process (after `--resume`, from the
//! resume on); the step counts the checkpoint's steps too.
//!
//! The language model is evaluated window by window (window `k + 1` of a column continues
//! window `k`) and carries its LSTM state across the windows as in training, from zeros at
//! the held-out set's first window; the training run's carried state is set aside during
//! the evaluation and put back after it.

use serde::{Deserialize, Serialize};

use crate::control::Control;
use crate::error::{Error, Result};
use crate::trainable::{Batch, TrainableModel};

/// One rank's part of the held-out set, in batches.
#[derive(Debug, Clone, Default)]
pub struct HeldOut {
    batches: Vec<Batch>,
}

impl HeldOut {
    /// A rank's part made of `batches`.
    pub fn from_batches(batches: Vec<Batch>) -> Self {
        HeldOut { batches }
    }

    /// The batches.
    pub fn batches(&self) -> &[Batch] {
        &self.batches
    }

    /// Target tokens (the 1.0 entries of the masks) over the batches.
    pub fn target_tokens(&self) -> usize {
        self.batches
            .iter()
            .map(|b| match b {
                Batch::Nmt(b) => b.target_words(),
                Batch::Lm(b) => b.words(),
            })
            .sum()
    }
}

/// One evaluation, as the log and the JSON report show it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    /// The step after which it ran (a resumed checkpoint's steps included).
    pub step: u64,
    /// Loss per target token over the whole held-out set.
    pub loss: f64,
    /// exp(loss).
    pub perplexity: f64,
    /// Target tokens the loss is over (the whole set: every rank's part).
    pub tokens: f64,
    /// Wall time of the evaluation (slowest rank, as every rank waits for the sum).
    pub seconds: f64,
}

impl EvalRecord {
    /// The log line of an evaluation.
    pub fn log_line(&self) -> String {
        format!(
            "  eval\tstep {}\tloss: {:.4}\tperplexity: {:.2}\t({:.2} s, not in words/sec)",
            self.step, self.loss, self.perplexity, self.seconds
        )
    }
}

/// Whether and when a run reached `--target-perplexity`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TimeToQuality {
    /// The target perplexity.
    pub target: f64,
    /// Whether an evaluation reached it (perplexity <= target).
    pub reached: bool,
    /// The step of the evaluation that reached it.
    pub step: Option<u64>,
    /// The perplexity of that evaluation; when not reached, the best one seen.
    pub perplexity: Option<f64>,
    /// Words (source + target, all ranks) trained on up to that step, warm-up included.
    pub words: Option<f64>,
    /// Seconds of training steps up to that step (evaluations left out).
    pub training_seconds: Option<f64>,
    /// Wall seconds from the first step to the end of that evaluation, evaluations
    /// included.
    pub seconds: Option<f64>,
}

impl TimeToQuality {
    /// Not reached (yet); `best` is the lowest perplexity seen.
    pub fn not_reached(target: f64, best: Option<f64>) -> Self {
        TimeToQuality {
            target,
            reached: false,
            step: None,
            perplexity: best,
            words: None,
            training_seconds: None,
            seconds: None,
        }
    }

    /// The log line.
    pub fn log_line(&self) -> String {
        match (self.reached, self.step) {
            (true, Some(step)) => format!(
                "ringtrain: target perplexity {} reached at step {step} (perplexity {:.2}): {:.0} words, {:.2} s of training, {:.2} s with evaluations",
                self.target,
                self.perplexity.unwrap_or(f64::NAN),
                self.words.unwrap_or(0.0),
                self.training_seconds.unwrap_or(0.0),
                self.seconds.unwrap_or(0.0)
            ),
            _ => format!(
                "ringtrain: target perplexity {} not reached (best held-out perplexity {}): train longer (--timed-batches) or set a higher target",
                self.target,
                self.perplexity
                    .map_or_else(|| "none".to_string(), |p| format!("{p:.2}"))
            ),
        }
    }
}

/// Loss sum and target tokens of this rank's part of the held-out set under `model`
/// (none: this rank holds no part, as a dedicated parameter server).
///
/// # Errors
/// The model's.
pub fn local_loss(model: &mut dyn TrainableModel, held_out: Option<&HeldOut>) -> Result<[f64; 2]> {
    let out = model.evaluate(held_out.map_or(&[][..], HeldOut::batches))?;
    Ok([out.loss_sum, out.target_tokens])
}

/// Evaluates `model` on the held-out set after step `step` (collective: every rank
/// calls it; see the module docs). A rank's model failure fails every rank.
///
/// # Errors
/// [`Error::InvalidValue`] naming `--eval-data` when the set holds no target token over
/// all ranks, or when the loss is not finite; the model's (on the failing rank;
/// [`Error::OtherRanksFailed`] on the others); transport errors.
pub fn evaluate(
    model: &mut dyn TrainableModel,
    held_out: Option<&HeldOut>,
    control: &mut Control,
    step: u64,
) -> Result<EvalRecord> {
    let start = std::time::Instant::now();
    let local = local_loss(model, held_out);
    let local = control.agree("to evaluate on the held-out set", local)?;
    let all: Vec<[f64; 2]> = control.gather(&local)?;
    // Every rank adds the same values in the same order: the same result everywhere.
    let (loss_sum, tokens) = all
        .iter()
        .fold((0.0, 0.0), |(l, t), r| (l + r[0], t + r[1]));
    if tokens <= 0.0 {
        return Err(Error::invalid(
            "--eval-data",
            "(no target token)",
            "the held-out set gave no token to evaluate: give held-out files with text",
        ));
    }
    let loss = loss_sum / tokens;
    if !loss.is_finite() {
        return Err(Error::invalid(
            "held-out loss",
            loss,
            format!(
                "the model's loss at step {step} is not finite: training diverged; lower \
                 --learning-rate or set --max-gradient-norm"
            ),
        ));
    }
    let seconds = control
        .gather(&start.elapsed().as_secs_f64())?
        .into_iter()
        .fold(0.0, f64::max);
    Ok(EvalRecord {
        step,
        loss,
        perplexity: loss.exp(),
        tokens,
        seconds,
    })
}
