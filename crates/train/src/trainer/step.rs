//! One training step: batch, forward and backward (gradient ranges handed to the
//! strategy as backward finishes them), exchange and update.

use std::ops::Range;
use std::time::{Duration, Instant};

use super::setup::{LossScaling, Session};
use crate::error::{Error, Result};
use crate::input::BatchSource;
use crate::strategy::{DeviceStepInputs, StepContext, StepInputs, StepOutcome, StepStats, Wire};
use crate::throughput::StepBreakdown;
use crate::trainable::TrainableModel;

/// What one step did on this rank.
pub(super) struct StepResult {
    /// The strategy's outcome (figures summed over the ranks that took part).
    pub(super) outcome: StepOutcome,
    /// This rank's own figures.
    pub(super) local: StepStats,
    /// Where this rank's time went.
    pub(super) breakdown: StepBreakdown,
    /// Kernel launches of this rank's step: on cuda every kernel launched (the model's
    /// and the optimizer's, counted where they are issued), on cpu the pass's backend
    /// operations.
    pub(super) launches: u64,
    /// Wall time of the step.
    pub(super) elapsed: Duration,
    /// Each gradient range backward reported finished, in the order it did: (first
    /// element, elements, seconds after backward began).
    pub(super) ready: Vec<(usize, usize, f64)>,
}

impl Session<'_> {
    /// How this step's gradients travel: f16 gradients carry loss scale / examples (a
    /// device that keeps the loss scale multiplies it in there: the wire says 1 / examples).
    fn step_context(&self) -> StepContext {
        let expected = if self.strategy.averages_globally() {
            self.cfg.global_batch_size()
        } else {
            self.batch_size
        };
        let per_example = |loss_scale: f32| Wire::F16 {
            scale: (f64::from(loss_scale) / expected.max(1) as f64) as f32,
        };
        let wire = match self.scaler {
            Some(LossScaling::Host(s)) => per_example(s.scale),
            Some(LossScaling::Device) => per_example(1.0),
            None => Wire::F32,
        };
        StepContext { wire }
    }

    /// Runs the run's step `self.step + 1` on `model` with the next batch of `batches`.
    ///
    /// # Errors
    /// [`Error::InputEnded`] when the input runs dry; the model's, the strategy's and the
    /// input's errors.
    pub(super) fn step(
        &mut self,
        model: &mut dyn TrainableModel,
        batches: &mut dyn BatchSource,
    ) -> Result<StepResult> {
        let start = Instant::now();
        let launched = super::summary::kernel_launches(self.cfg.config().run.device);
        let mut breakdown = StepBreakdown::default();
        let ctx = self.step_context();
        // The timeline of this step, when one is recorded: `None` costs no clock read.
        let timeline = self.timeline.as_ref().filter(|t| t.recording());
        if let Some(t) = &self.timeline {
            if let Some(device) = model.device_resident() {
                device.set_device_timing(t.recording());
            }
        }
        self.strategy.begin_step(ctx);
        let mut local = StepStats::default();
        let mut launches = 0;
        let mut ready = Vec::new();
        if self.batch_size > 0 {
            let wait = Instant::now();
            let batch = batches.next_batch().ok_or(Error::InputEnded {
                rank: self.rank,
                step: self.step as usize + 1,
            })??;
            // The batch is consumed: a checkpoint from here on resumes after it.
            self.input = batches.position();
            let got = Instant::now();
            breakdown.data_wait = got.duration_since(wait).as_secs_f64();
            let strategy = &mut self.strategy;
            let exchange = strategy.exchanges_gradients();
            // When each gradient range was handed over: the timeline draws them, and the
            // report keeps them from the start of backward (forward's time is taken off
            // below, once the pass has measured it).
            let pass_start = Instant::now();
            let mut handed: Vec<(Range<usize>, Instant)> = Vec::new();
            let mut note = |range: &Range<usize>| {
                handed.push((range.clone(), Instant::now()));
            };
            let pass = match model.device_resident() {
                Some(device) => device.forward_backward_exchanging(
                    &batch,
                    ctx.wire,
                    exchange,
                    &mut |range, grads| {
                        note(&range);
                        strategy.on_exchanged(range, grads)
                    },
                ),
                None => model.forward_backward(&batch, &mut |range, grads| {
                    note(&range);
                    strategy.on_ready(range, grads)
                }),
            };
            // Ranges of a device's exchange buffer handed on before a failure are let go
            // of before anything else can touch that buffer.
            let pass = pass.inspect_err(|_| strategy.release_exchanged())?;
            if let Some(t) = timeline {
                let end = Instant::now();
                let args = serde_json::json!({});
                t.span("data_wait", "phase", wait, got, args.clone());
                let split = (got + Duration::from_secs_f64(pass.forward_seconds)).min(end);
                let fwd_args = serde_json::json!({ "launches": pass.launches });
                t.span("forward", "phase", got, split, fwd_args);
                t.span("backward", "phase", split, end, args);
                t.backward_ranges(split, &handed);
            }
            ready = handed
                .iter()
                .map(|(range, at)| {
                    let since = at.duration_since(pass_start).as_secs_f64();
                    (
                        range.start,
                        range.len(),
                        (since - pass.forward_seconds).max(0.0),
                    )
                })
                .collect();
            breakdown.forward = pass.forward_seconds;
            breakdown.backward = pass.backward_seconds;
            launches = pass.launches;
            // Every stage of a pipeline reads the batch; the last one counts it.
            let counts = model
                .pipeline_stage()
                .is_none_or(|(info, _)| info.is_last());
            let share = if counts { 1.0 } else { 0.0 };
            local = StepStats {
                loss_sum: pass.loss_sum,
                target_tokens: pass.target_tokens,
                words: share * batch.words() as f64,
                examples: share * batch.examples() as f64,
                overflow: 0.0,
            };
        } else {
            // A dedicated parameter server contributes nothing to the gradient sum.
            model.params_and_grads_mut()?.1.fill(0.0);
        }
        let finish_start = timeline.map(|_| Instant::now());
        let outcome = match (self.optimizer.as_mut(), model.device_resident()) {
            (Some(optimizer), _) => {
                let (params, grads) = model.params_and_grads_mut()?;
                self.strategy.finish_step(StepInputs {
                    params,
                    grads,
                    local,
                    optimizer,
                    control: &mut self.control,
                })?
            }
            (None, Some(device)) => self.strategy.finish_device_step(DeviceStepInputs {
                model: device,
                local,
                control: &mut self.control,
            })?,
            (None, None) => return Err(super::setup::no_optimizer()),
        };
        if let (Some(t), Some(from)) = (timeline, finish_start) {
            let end = Instant::now();
            let exchanged =
                (from + Duration::from_secs_f64(outcome.communication_seconds)).min(end);
            let args = serde_json::json!({});
            t.span("exchange", "phase", from, exchanged, args.clone());
            let updating = end
                .checked_sub(Duration::from_secs_f64(outcome.optimizer_seconds))
                .map_or(exchanged, |u| u.max(exchanged));
            t.span("optimizer", "phase", updating, end, args);
            if let Some(device) = model.device_resident() {
                for span in device.take_device_spans()? {
                    t.device_span(&span);
                }
            }
        }
        breakdown.communication = outcome.communication_seconds;
        breakdown.optimizer = outcome.optimizer_seconds;
        // A loss scale on the device took the outcome in the update.
        if let Some(LossScaling::Host(s)) = self.scaler.as_mut() {
            s.update(outcome.skipped);
        }
        if let (Some(before), Some(after)) = (
            launched,
            super::summary::kernel_launches(self.cfg.config().run.device),
        ) {
            launches = after - before;
        }
        self.step += 1;
        Ok(StepResult {
            outcome,
            local,
            breakdown,
            launches,
            elapsed: start.elapsed(),
            ready,
        })
    }
}
