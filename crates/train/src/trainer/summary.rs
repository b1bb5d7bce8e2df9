//! After the last step: every rank's own figures, gathered on the control plane, make
//! the run's report.

use super::setup::Session;
use crate::config::DeviceKind;
use crate::error::Result;
use crate::optimizer::{LossScaler, OptimizerState};
use crate::pipeline::bubble_formula;
use crate::report::{
    GradientReady, HostDeviceBytes, PipelineReport, RankFigures, RunReport, StageFigures,
};
use crate::strategy::StepStats;
use crate::throughput::{words_per_sec, StepBreakdown, ThroughputSummary};
use crate::trainable::TrainableModel;

/// What one rank counted over the timed batches, besides its meter's summary.
#[derive(Debug, Clone, Default)]
pub(super) struct TimedTotals {
    /// This rank's own words in the timed batches.
    pub(super) words: f64,
    /// This rank's kernel launches in the timed batches.
    pub(super) launches: f64,
    /// Bytes this rank copied host -> device and device -> host in the timed batches
    /// (`None` on cpu).
    pub(super) copied: Option<(u64, u64)>,
    /// This rank's pipeline stage and its compute and wait seconds over the timed
    /// batches (`None` without a pipeline).
    pub(super) stage: Option<(usize, String, f64, f64)>,
    /// The most micro-batches (and their activation bytes) this rank's pipeline stage
    /// held at once in a timed batch.
    pub(super) activations: (usize, f64),
    /// The gradient ranges of the timed steps in backward's order, with their
    /// ready-times summed over the timed steps.
    pub(super) ready: Vec<GradientReady>,
    /// Timed steps whose ready-times `ready` sums.
    pub(super) ready_steps: usize,
}

/// Bytes this rank's thread has copied between host and device so far, as (to device,
/// to host): ringtrain-cuda's counters, incremented by its copy functions (per thread,
/// so ranks that share a process as threads count only their own). `None` on cpu.
pub(super) fn copied_bytes(device: DeviceKind) -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    if device == DeviceKind::Cuda {
        let t = ringtrain_cuda::TransferBytes::this_thread();
        return Some((t.to_device, t.to_host));
    }
    let _ = device;
    None
}

/// Kernels this thread has launched so far (ringtrain-cuda's count, taken where every
/// launch is issued: the model's and the optimizer's). `None` on cpu.
pub(super) fn kernel_launches(device: DeviceKind) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if device == DeviceKind::Cuda {
        return Some(ringtrain_cuda::KernelLaunches::this_thread());
    }
    let _ = device;
    None
}

/// The most device memory this process has held in buffers at once (ringtrain-cuda's
/// allocator high-water mark). `None` on cpu.
fn peak_device_bytes(device: DeviceKind) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if device == DeviceKind::Cuda {
        return Some(ringtrain_cuda::DeviceMemoryUse::process().peak);
    }
    let _ = device;
    None
}

impl TimedTotals {
    /// Adds one timed step of `model`'s pipeline stage, if it is one.
    pub(super) fn add_stage(&mut self, model: &dyn TrainableModel) {
        if let Some((info, times)) = model.pipeline_stage() {
            let (compute, wait) = self.stage.as_ref().map_or((0.0, 0.0), |s| (s.2, s.3));
            self.stage = Some((
                info.stage,
                info.unit_names.clone(),
                compute + times.compute,
                wait + times.wait,
            ));
            self.activations = (
                self.activations.0.max(times.peak_activation_slots),
                self.activations.1.max(times.peak_activation_bytes),
            );
        }
    }

    /// Adds one timed step's gradient ranges (first element, elements, seconds after
    /// backward began). A step whose ranges differ from the earlier steps' (it should
    /// not happen: backward reports the same ranges every step) starts the sums anew.
    pub(super) fn add_ready(&mut self, ready: &[(usize, usize, f64)]) {
        let same = self.ready.len() == ready.len()
            && self
                .ready
                .iter()
                .zip(ready)
                .all(|(a, b)| a.start == b.0 && a.elements == b.1);
        if !same {
            self.ready.clear();
            self.ready_steps = 0;
        }
        if self.ready.is_empty() {
            self.ready = ready
                .iter()
                .map(|&(start, elements, _)| GradientReady {
                    start,
                    elements,
                    seconds: 0.0,
                })
                .collect();
        }
        for (sum, r) in self.ready.iter_mut().zip(ready) {
            sum.seconds += r.2;
        }
        self.ready_steps += 1;
    }

    /// Adds the bytes copied between the counts `before` and `after` of one timed step.
    pub(super) fn add_copied(&mut self, before: Option<(u64, u64)>, after: Option<(u64, u64)>) {
        if let (Some(b), Some(a)) = (before, after) {
            let sum = self.copied.unwrap_or((0, 0));
            self.copied = Some((
                sum.0 + a.0.saturating_sub(b.0),
                sum.1 + a.1.saturating_sub(b.1),
            ));
        }
    }
}

impl Session<'_> {
    /// This rank's figures over the timed batches.
    fn rank_figures(&self, meter: &ThroughputSummary, timed: TimedTotals) -> RankFigures {
        let seconds = meter.timed_seconds;
        let (peak_slots, peak_bytes) = timed.activations;
        // Elements of each per-parameter state vector (Adam's m and v; none for SGD)
        // of the host optimizer; a device-resident model's is on its device.
        let optimizer_state_elements = self.optimizer.as_ref().map(|o| match o.state() {
            OptimizerState::Sgd => 0,
            OptimizerState::Adam { m, .. } => m.len(),
        });
        RankFigures {
            rank: self.rank,
            batch_size: self.batch_size,
            words: timed.words,
            seconds,
            words_per_sec: words_per_sec(timed.words, seconds),
            breakdown: meter.mean_breakdown,
            launches_per_batch: timed.launches / meter.timed_batches.max(1) as f64,
            host_device_bytes_per_step: timed.copied.map(|(to_device, to_host)| {
                let steps = meter.timed_batches.max(1) as f64;
                HostDeviceBytes {
                    to_device: to_device as f64 / steps,
                    to_host: to_host as f64 / steps,
                }
            }),
            peak_device_bytes: peak_device_bytes(self.cfg.config().run.device),
            gradient_ready: timed
                .ready
                .iter()
                .map(|r| GradientReady {
                    seconds: r.seconds / timed.ready_steps.max(1) as f64,
                    ..*r
                })
                .collect(),
            compute_quantiles: meter.compute_quantiles.clone(),
            pipeline_stage: timed.stage.clone().map(|(stage, units, compute, wait)| {
                let steps = meter.timed_batches.max(1) as f64;
                StageFigures {
                    stage,
                    units,
                    compute: compute / steps,
                    wait: wait / steps,
                    bubble_fraction: if compute + wait > 0.0 {
                        wait / (compute + wait)
                    } else {
                        0.0
                    },
                    peak_activation_slots: peak_slots,
                    peak_activation_bytes: peak_bytes,
                    optimizer_state_elements,
                }
            }),
        }
    }

    /// Gathers every rank's figures and assembles the report (identical on every rank):
    /// words over all ranks, time of the slowest, breakdown and launches averaged over the
    /// workers; `last` is the last step's summed figures.
    ///
    /// # Errors
    /// Transport or serialisation errors of the gather; the model's parameter view.
    pub(super) fn report(
        &mut self,
        model: &dyn TrainableModel,
        meter: &ThroughputSummary,
        timed: TimedTotals,
        last: StepStats,
        scaler: Option<LossScaler>,
    ) -> Result<RunReport> {
        let mine = self.rank_figures(meter, timed);
        let per_rank: Vec<RankFigures> = self.control.gather(&mine)?;
        let workers: Vec<&RankFigures> = per_rank.iter().filter(|r| r.batch_size > 0).collect();
        let n = workers.len().max(1) as f64;
        let mean = |f: fn(&RankFigures) -> f64| workers.iter().map(|r| f(r)).sum::<f64>() / n;
        let breakdown = StepBreakdown {
            data_wait: mean(|r| r.breakdown.data_wait),
            forward: mean(|r| r.breakdown.forward),
            backward: mean(|r| r.breakdown.backward),
            communication: mean(|r| r.breakdown.communication),
            optimizer: mean(|r| r.breakdown.optimizer),
        };
        let launches_per_batch = mean(|r| r.launches_per_batch);
        let counted: Vec<HostDeviceBytes> = workers
            .iter()
            .filter_map(|r| r.host_device_bytes_per_step)
            .collect();
        let host_device_bytes_per_step = (!counted.is_empty()).then(|| {
            let k = counted.len() as f64;
            HostDeviceBytes {
                to_device: counted.iter().map(|b| b.to_device).sum::<f64>() / k,
                to_host: counted.iter().map(|b| b.to_host).sum::<f64>() / k,
            }
        });
        let peak_device_bytes = per_rank.iter().filter_map(|r| r.peak_device_bytes).max();
        let timed_seconds = per_rank.iter().map(|r| r.seconds).fold(0.0, f64::max);
        let timed_words: f64 = per_rank.iter().map(|r| r.words).sum();
        let per_stage: Vec<StageFigures> = per_rank
            .iter()
            .filter_map(|r| r.pipeline_stage.clone())
            .collect();
        let pipeline = (self.cfg.is_pipelined() && !per_stage.is_empty()).then(|| {
            let exchange = &self.cfg.config().exchange;
            let stages = self.cfg.pipeline_stages();
            PipelineReport {
                stages,
                micro_batches: exchange.micro_batches,
                schedule: exchange.pipeline_schedule.to_string(),
                bubble_fraction: per_stage.iter().map(|f| f.bubble_fraction).sum::<f64>()
                    / per_stage.len() as f64,
                bubble_formula: bubble_formula(stages, exchange.micro_batches),
                peak_activation_slots: per_stage
                    .iter()
                    .map(|f| f.peak_activation_slots)
                    .max()
                    .unwrap_or(0),
                peak_activation_bytes: per_stage
                    .iter()
                    .map(|f| f.peak_activation_bytes)
                    .fold(0.0, f64::max),
                per_stage,
            }
        });
        Ok(RunReport {
            config: self.cfg.config().clone(),
            strategy: match self.cfg.pipeline_label() {
                Some(pipeline) => format!("{} | {pipeline}", self.cfg.strategy_label()),
                None => self.cfg.strategy_label(),
            },
            model: model.describe(),
            parameters: model.params()?.len(),
            ranks: per_rank.len(),
            workers: self.cfg.workers(),
            global_batch_size: self.cfg.global_batch_size(),
            steps: self.step,
            timed_batches: meter.timed_batches,
            timed_seconds,
            timed_words,
            words_per_sec: words_per_sec(timed_words, timed_seconds),
            per_step_words_per_sec: meter.per_step,
            per_rank,
            breakdown,
            launches_per_batch,
            host_device_bytes_per_step,
            peak_device_bytes,
            estimated_device_bytes: None,
            final_loss: last.mean_loss(),
            skipped_steps: scaler.map_or(0, |s| s.skipped_steps),
            loss_scale: scaler.map(|s| s.scale),
            eval: Vec::new(),
            time_to_quality: None,
            pipeline,
            host: None,
        })
    }
}
