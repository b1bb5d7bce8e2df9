//! The run report: what rank 0 prints at the end and writes with `--json-report`.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::evaluation::{EvalRecord, TimeToQuality};
use crate::throughput::{RateStats, StepBreakdown};

/// Bytes copied between host and device memory per timed step (the mean over the timed
/// steps), counted by the copy calls the step actually made (ringtrain-cuda's copy
/// functions), not computed from sizes. Runs on `--device cuda` only; a process counts
/// all of its copies, so ranks run as threads of one process share the count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HostDeviceBytes {
    /// Host -> device.
    pub to_device: f64,
    /// Device -> host.
    pub to_host: f64,
}

/// One gradient range as backward finished it: which elements, and when (the mean over
/// the timed steps). The scaling model (`ringtrain predict`) reads these to tell how much
/// of an all-reduce can hide behind backward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct GradientReady {
    /// First element of the range in the flat gradient buffer.
    pub start: usize,
    /// Elements in the range (f32: 4 bytes each).
    pub elements: usize,
    /// Seconds after backward began that the range was final and handed to the
    /// exchange (mean over the timed steps).
    pub seconds: f64,
}

/// One rank's own figures over the timed batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Examples per step it trained on (0 for a dedicated parameter server).
    pub batch_size: usize,
    /// Words it processed in the timed batches.
    pub words: f64,
    /// Its wall time for the timed batches.
    pub seconds: f64,
    /// words / seconds.
    pub words_per_sec: f64,
    /// Its mean time per step in each phase.
    pub breakdown: StepBreakdown,
    /// Kernel launches per batch (cuda: every kernel of the step, the optimizer's
    /// included; cpu: the pass's kernel calls).
    pub launches_per_batch: f64,
    /// Host <-> device bytes per timed step (absent on cpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_device_bytes_per_step: Option<HostDeviceBytes>,
    /// The most device memory its process held in buffers at once (the allocator's
    /// high-water mark, without the driver's context; absent on cpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes: Option<u64>,
    /// Its pipeline stage's time split (absent without a pipeline).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_stage: Option<StageFigures>,
    /// The gradient ranges its backward handed over, in the order it did, with when
    /// (empty for a rank that trains nothing, and for a device-resident model whose
    /// gradients stay on the device: one rank on cuda).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gradient_ready: Vec<GradientReady>,
    /// Its timed steps' compute (wall time less the communication wait) at the 0th,
    /// 1st, ..., 100th percentile, seconds (see
    /// [`crate::ThroughputSummary::compute_quantiles`]). The scaling model reads them to
    /// tell how long a synchronised step waits for its slowest rank.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub compute_quantiles: Vec<f64>,
}

/// One pipeline stage's mean time per timed batch.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageFigures {
    /// The stage, `0..stages`.
    pub stage: usize,
    /// The model's units it runs, e.g. `embedding, layer 0`.
    pub units: String,
    /// Seconds in its forward and backward passes.
    pub compute: f64,
    /// Seconds blocked on a neighbour: sending, receiving and idle (the bubble).
    pub wait: f64,
    /// `wait / (compute + wait)`.
    pub bubble_fraction: f64,
    /// The most micro-batches whose activations the stage held at once: M under GPipe,
    /// at most `min(K - stage, M)` under 1F1B.
    #[serde(default)]
    pub peak_activation_slots: usize,
    /// The bytes of those micro-batches' activation workspaces (the model's estimate
    /// for each workspace's shape).
    #[serde(default)]
    pub peak_activation_bytes: f64,
    /// Elements of each per-parameter state vector of the stage's optimizer (Adam's m
    /// and v; 0 for SGD): the length of the stage's parameter range. Absent for a stage
    /// that keeps its optimizer on its device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_state_elements: Option<usize>,
}

/// The pipeline of a pipelined run, as the report holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PipelineReport {
    /// Stages K.
    pub stages: usize,
    /// Micro-batches M per batch.
    pub micro_batches: usize,
    /// `gpipe` or `1f1b`.
    pub schedule: String,
    /// The measured bubble: the mean over the stages of their idle fractions.
    pub bubble_fraction: f64,
    /// `(K - 1) / (M + K - 1)`: the bubble of K equal stages.
    pub bubble_formula: f64,
    /// The most micro-batches whose activations any stage held at once.
    #[serde(default)]
    pub peak_activation_slots: usize,
    /// The most activation bytes any stage held at once.
    #[serde(default)]
    pub peak_activation_bytes: f64,
    /// Each stage's figures (replica 0's stages first).
    pub per_stage: Vec<StageFigures>,
}

/// The machine rank 0 ran on, as the scaling model (`ringtrain predict`) needs it to tell
/// whether ranks shared its cores.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HostFigures {
    /// Hardware threads online on the node, whatever the rank was bound to
    /// ([`crate::device::node_cores`]).
    pub cores: usize,
    /// CPU threads each rank computed with (`--threads`, or the cores divided over the
    /// node's ranks when it is 0).
    pub threads_per_rank: usize,
    /// Ranks of the run on rank 0's node.
    pub ranks_on_node: usize,
}

/// Everything a run measured, as written by `--json-report`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// The configuration that ran, as given (`auto` values unresolved).
    pub config: TrainConfig,
    /// The strategy as it ran, e.g. `replicated (overlapped with backward)`.
    #[serde(default)]
    pub strategy: String,
    /// Model description.
    pub model: String,
    /// Trainable parameters.
    pub parameters: usize,
    /// MPI ranks (or threads) in the run.
    pub ranks: usize,
    /// Ranks that computed gradients.
    pub workers: usize,
    /// Examples per step over all workers.
    pub global_batch_size: usize,
    /// Steps completed (including warm-up and any resumed ones).
    pub steps: u64,
    /// Timed batches.
    pub timed_batches: usize,
    /// Wall time of the timed batches (slowest rank).
    pub timed_seconds: f64,
    /// Words in the timed batches over all ranks.
    pub timed_words: f64,
    /// timed_words / timed_seconds: the headline figure, total over ranks.
    pub words_per_sec: f64,
    /// Mean ± jitter of the per-step rates seen by rank 0.
    pub per_step_words_per_sec: RateStats,
    /// Each rank's own figures.
    pub per_rank: Vec<RankFigures>,
    /// Mean per-step breakdown over the workers.
    pub breakdown: StepBreakdown,
    /// Mean kernel launches per batch over the workers.
    pub launches_per_batch: f64,
    /// Mean host <-> device bytes per timed step over the workers (absent on cpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_device_bytes_per_step: Option<HostDeviceBytes>,
    /// The largest rank's peak device memory in buffers (see [`RankFigures`]; absent on
    /// cpu).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_device_bytes: Option<u64>,
    /// What the memory check at start estimated rank 0's device would hold (the figure it
    /// compared with the free device memory; absent on cpu and where no check ran):
    /// beside `peak_device_bytes`, how close the estimate is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_device_bytes: Option<u64>,
    /// Loss per target token of the last step.
    pub final_loss: f64,
    /// Steps skipped for f16 overflow.
    pub skipped_steps: u64,
    /// Final loss scale (fp16 gradients only).
    pub loss_scale: Option<f32>,
    /// The held-out evaluations (`--eval-data`), in step order; their time is not in
    /// the throughput figures.
    #[serde(default)]
    pub eval: Vec<EvalRecord>,
    /// When `--target-perplexity` was reached (`None`: no target was set).
    #[serde(default)]
    pub time_to_quality: Option<TimeToQuality>,
    /// The pipeline's stages, micro-batches, schedule and bubble (absent without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineReport>,
    /// Rank 0's machine: its cores and the threads per rank (absent in reports of older
    /// versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostFigures>,
}

impl RunReport {
    /// Writes the report as pretty JSON, atomically (see
    /// [`crate::outputs::write_atomically`]); an existing report is replaced.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file; [`Error::Interrupted`] on SIGINT/SIGTERM.
    pub fn write_json(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|source| Error::Json {
            action: "serialising the run report",
            source,
        })?;
        crate::outputs::write_atomically(path, (text + "\n").as_bytes(), "writing the JSON report")
    }

    /// Reads a report written by [`RunReport::write_json`].
    pub fn read_json(path: &Path) -> Result<Self> {
        let text = fs::read_to_string(path).map_err(|source| Error::Io {
            action: "reading the JSON report",
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| Error::Json {
            action: "parsing the JSON report",
            source,
        })
    }

    /// Batch size per worker as the seeds' tables show it (a range when uneven).
    pub fn batch_size_label(&self) -> String {
        let sizes: Vec<usize> = self
            .per_rank
            .iter()
            .map(|r| r.batch_size)
            .filter(|&b| b > 0)
            .collect();
        match (sizes.iter().min(), sizes.iter().max()) {
            (Some(a), Some(b)) if a == b => a.to_string(),
            (Some(a), Some(b)) => format!("{a}-{b}"),
            _ => self.config.data.batch_size.to_string(),
        }
    }

    /// The final table rank 0 prints: totals, then one row per rank, then the breakdown.
    pub fn final_table(&self) -> String {
        let mut s = String::new();
        s.push_str(&format!(
            "\n{} | {} ranks ({} workers) | {} | {} parameters\n\n",
            self.model, self.ranks, self.workers, self.strategy, self.parameters
        ));
        s.push_str(&format!(
            "| ranks | batch size | total time for {} batches (s) | words/s | per-step words/s |\n",
            self.timed_batches
        ));
        s.push_str("|---|---|---|---|---|\n");
        s.push_str(&format!(
            "| {} | {} | {:.3} | {:.1} | {:.1} +/- {:.1} |\n\n",
            self.ranks,
            self.batch_size_label(),
            self.timed_seconds,
            self.words_per_sec,
            self.per_step_words_per_sec.mean,
            self.per_step_words_per_sec.jitter
        ));
        s.push_str("| rank | batch size | words | time (s) | words/s |\n|---|---|---|---|---|\n");
        for r in &self.per_rank {
            s.push_str(&format!(
                "| {} | {} | {:.0} | {:.3} | {:.1} |\n",
                r.rank, r.batch_size, r.words, r.seconds, r.words_per_sec
            ));
        }
        let b = &self.breakdown;
        s.push_str(&format!(
            "\nper step (ms): data {:.2} | forward {:.2} | backward {:.2} | communication {:.2} | optimizer {:.2}; \
             launches/batch {:.0}; final loss {:.4}\n",
            b.data_wait * 1e3,
            b.forward * 1e3,
            b.backward * 1e3,
            b.communication * 1e3,
            b.optimizer * 1e3,
            self.launches_per_batch,
            self.final_loss
        ));
        if let Some(e) = self.eval.last() {
            let seconds: f64 = self.eval.iter().map(|e| e.seconds).sum();
            s.push_str(&format!(
                "held-out after step {}: loss {:.4}, perplexity {:.2} ({} evaluation(s), {seconds:.2} s, not in words/s)\n",
                e.step,
                e.loss,
                e.perplexity,
                self.eval.len()
            ));
        }
        if let Some(q) = &self.time_to_quality {
            s.push_str(&q.log_line().replace("ringtrain: ", ""));
            s.push('\n');
        }
        if let Some(bytes) = self.host_device_bytes_per_step {
            s.push_str(&format!(
                "host<->device per step: {:.0} bytes to the device, {:.0} to the host\n",
                bytes.to_device, bytes.to_host
            ));
        }
        if let Some(peak) = self.peak_device_bytes {
            let mib = |bytes: u64| bytes as f64 / (1u64 << 20) as f64;
            let estimate = self
                .estimated_device_bytes
                .map(|e| format!("; the estimate at start: {:.1} MiB", mib(e)))
                .unwrap_or_default();
            s.push_str(&format!(
                "peak device memory in buffers: {:.1} MiB (largest rank{estimate})\n",
                mib(peak)
            ));
        }
        if let Some(p) = &self.pipeline {
            s.push_str(&format!(
                "pipeline: {} stages x {} micro-batches ({}): bubble {:.1}% measured, {:.1}% by (K-1)/(M+K-1)\n",
                p.stages,
                p.micro_batches,
                p.schedule,
                p.bubble_fraction * 100.0,
                p.bubble_formula * 100.0
            ));
            for f in &p.per_stage {
                s.push_str(&format!(
                    "  stage {} ({}): compute {:.2} ms | send/receive wait {:.2} ms | bubble {:.1}% | \
                     peak activation workspaces {} ({:.1} KiB)\n",
                    f.stage,
                    f.units,
                    f.compute * 1e3,
                    f.wait * 1e3,
                    f.bubble_fraction * 100.0,
                    f.peak_activation_slots,
                    f.peak_activation_bytes / 1024.0
                ));
            }
        }
        s.push_str(&format!("total words/s: {:.1}\n", self.words_per_sec));
        s
    }
}
