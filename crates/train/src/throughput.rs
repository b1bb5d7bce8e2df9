//! Throughput measurement following the seeds' rule.
//!
//! The first `warmup` batches are not counted (allocation and start-up would distort
//! them); the next batches are timed. words = source words + target words, summed over
//! all ranks; words/s = words in the timed batches / wall time of the timed batches.
//! Per-step rates give the jitter printed beside the mean, as tf_cnn_benchmarks does:
//! jitter = 1.4826 × median absolute deviation.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Where one step's time went, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepBreakdown {
    /// Waiting for the next batch from the input pipeline.
    pub data_wait: f64,
    /// Forward pass (including the loss).
    pub forward: f64,
    /// Backward pass (communication that overlaps it is counted here, not twice).
    pub backward: f64,
    /// Gradient or parameter exchange not hidden behind backward.
    pub communication: f64,
    /// Clipping, loss-scale bookkeeping and the optimizer update.
    pub optimizer: f64,
}

impl StepBreakdown {
    /// Sum of all phases.
    pub fn total(&self) -> f64 {
        self.data_wait + self.forward + self.backward + self.communication + self.optimizer
    }

    fn add(&mut self, o: &StepBreakdown) {
        self.data_wait += o.data_wait;
        self.forward += o.forward;
        self.backward += o.backward;
        self.communication += o.communication;
        self.optimizer += o.optimizer;
    }

    fn scaled(&self, f: f64) -> StepBreakdown {
        StepBreakdown {
            data_wait: self.data_wait * f,
            forward: self.forward * f,
            backward: self.backward * f,
            communication: self.communication * f,
            optimizer: self.optimizer * f,
        }
    }
}

/// One finished step as the meter saw it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// 1-based step number.
    pub step: usize,
    /// Wall time of the step in seconds.
    pub seconds: f64,
    /// Words (source + target) processed in this step over all ranks.
    pub words: f64,
    /// Mean loss per target token.
    pub loss: f64,
    /// Where the time went on this rank.
    pub breakdown: StepBreakdown,
}

/// mean ± jitter of a set of per-step rates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RateStats {
    /// Arithmetic mean of the per-step rates.
    pub mean: f64,
    /// 1.4826 × median absolute deviation of the per-step rates.
    pub jitter: f64,
}

/// Median of a non-empty slice (sorted copy; mean of the middle two for even lengths).
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// 1.4826 × median(|x - median(x)|): a robust standard deviation.
pub fn jitter(values: &[f64]) -> f64 {
    let m = median(values);
    let dev: Vec<f64> = values.iter().map(|x| (x - m).abs()).collect();
    1.4826 * median(&dev)
}

/// How many quantiles [`ThroughputSummary::compute_quantiles`] holds: the 0th, 1st, ...,
/// 100th percentile.
pub const COMPUTE_QUANTILES: usize = 101;

/// `count` (at least 2) quantiles of `values`, evenly spaced from the smallest (0) to the
/// largest (1), each interpolated linearly between the two sorted values around it;
/// empty for no values.
pub fn quantiles(values: &[f64], count: usize) -> Vec<f64> {
    if values.is_empty() || count < 2 {
        return Vec::new();
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let last = (v.len() - 1) as f64;
    (0..count)
        .map(|k| {
            let at = k as f64 / (count - 1) as f64 * last;
            let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
            v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
        })
        .collect()
}

/// Mean and jitter of per-step rates.
pub fn rate_stats(rates: &[f64]) -> RateStats {
    if rates.is_empty() {
        return RateStats::default();
    }
    RateStats {
        mean: rates.iter().sum::<f64>() / rates.len() as f64,
        jitter: jitter(rates),
    }
}

/// Counts words and time per step, separating warm-up from timed batches.
#[derive(Debug, Clone)]
pub struct ThroughputMeter {
    warmup: usize,
    timed: Vec<StepRecord>,
    warmup_seen: usize,
}

/// What the meter measured over the timed batches.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ThroughputSummary {
    /// Number of timed batches.
    pub timed_batches: usize,
    /// Wall time of the timed batches in seconds.
    pub timed_seconds: f64,
    /// Words (source + target, all ranks) in the timed batches.
    pub timed_words: f64,
    /// timed_words / timed_seconds.
    pub words_per_sec: f64,
    /// Mean and jitter of the per-step rates.
    pub per_step: RateStats,
    /// Mean time per timed step for each phase.
    pub mean_breakdown: StepBreakdown,
    /// The timed steps' own compute (wall time less the communication wait) at the
    /// 0th, 1st, ..., 100th percentile ([`COMPUTE_QUANTILES`] values; empty before the
    /// first timed step): how much a rank's step varies, which decides how long the
    /// ranks of a synchronised step wait for the slowest.
    #[serde(default)]
    pub compute_quantiles: Vec<f64>,
    /// Loss of the last step.
    pub final_loss: f64,
}

impl ThroughputMeter {
    /// A meter that ignores the first `warmup` steps.
    pub fn new(warmup: usize) -> Self {
        ThroughputMeter {
            warmup,
            timed: Vec::new(),
            warmup_seen: 0,
        }
    }

    /// Records a finished step; returns true when it was a timed one.
    pub fn record(&mut self, rec: StepRecord) -> bool {
        if self.warmup_seen < self.warmup {
            self.warmup_seen += 1;
            false
        } else {
            self.timed.push(rec);
            true
        }
    }

    /// Records a step from its duration.
    pub fn record_step(
        &mut self,
        step: usize,
        elapsed: Duration,
        words: f64,
        loss: f64,
        breakdown: StepBreakdown,
    ) -> bool {
        self.record(StepRecord {
            step,
            seconds: elapsed.as_secs_f64(),
            words,
            loss,
            breakdown,
        })
    }

    /// The timed steps recorded so far.
    pub fn timed_steps(&self) -> &[StepRecord] {
        &self.timed
    }

    /// Per-step rates (words/s) of the timed steps so far.
    pub fn rates(&self) -> Vec<f64> {
        self.timed
            .iter()
            .filter(|r| r.seconds > 0.0)
            .map(|r| r.words / r.seconds)
            .collect()
    }

    /// mean ± jitter of the timed steps so far.
    pub fn current(&self) -> RateStats {
        rate_stats(&self.rates())
    }

    /// Summary of the timed steps.
    pub fn summary(&self) -> ThroughputSummary {
        let timed_seconds: f64 = self.timed.iter().map(|r| r.seconds).sum();
        let timed_words: f64 = self.timed.iter().map(|r| r.words).sum();
        let mut sum = StepBreakdown::default();
        for r in &self.timed {
            sum.add(&r.breakdown);
        }
        let n = self.timed.len().max(1) as f64;
        ThroughputSummary {
            timed_batches: self.timed.len(),
            timed_seconds,
            timed_words,
            words_per_sec: words_per_sec(timed_words, timed_seconds),
            per_step: self.current(),
            mean_breakdown: sum.scaled(1.0 / n),
            compute_quantiles: quantiles(
                &self
                    .timed
                    .iter()
                    .map(|r| (r.seconds - r.breakdown.communication).max(0.0))
                    .collect::<Vec<_>>(),
                COMPUTE_QUANTILES,
            ),
            final_loss: self.timed.last().map_or(f64::NAN, |r| r.loss),
        }
    }
}

/// `words / seconds`, 0 for no time (nothing was timed).
pub fn words_per_sec(words: f64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        words / seconds
    } else {
        0.0
    }
}

/// The tf_cnn_benchmarks-style log line: `step  words/sec: mean +/- jitter (jitter = ...)  loss`.
pub fn format_step_line(step: usize, stats: RateStats, loss: f64) -> String {
    format!(
        "{step:>6}\twords/sec: {:.1} +/- {:.1} (jitter = {:.1})\tloss: {loss:.4}",
        stats.mean, stats.jitter, stats.jitter
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_jitter_match_hand_computation() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        // deviations from 3: 2,1,0,1,7 -> median 1
        let j = jitter(&[1.0, 2.0, 3.0, 4.0, 10.0]);
        assert!((j - 1.4826).abs() < 1e-12);
    }

    #[test]
    fn quantiles_run_from_the_smallest_to_the_largest_value() {
        let q = quantiles(&[4.0, 1.0, 3.0, 2.0, 5.0], 5);
        assert_eq!(q, vec![1.0, 2.0, 3.0, 4.0, 5.0]);
        // Between sorted values: 1 and 2 at a quarter of the way from the first to the
        // second of 2 values.
        assert_eq!(quantiles(&[2.0, 1.0], 5), vec![1.0, 1.25, 1.5, 1.75, 2.0]);
        assert_eq!(quantiles(&[7.0], 3), vec![7.0, 7.0, 7.0]);
        assert!(quantiles(&[], 3).is_empty());
    }

    #[test]
    fn warmup_is_excluded_and_rate_is_words_over_time() {
        let mut m = ThroughputMeter::new(2);
        let b = StepBreakdown {
            forward: 0.1,
            ..Default::default()
        };
        // warm-up steps are slow and must not count
        assert!(!m.record_step(1, Duration::from_secs(10), 5.0, 1.0, b));
        assert!(!m.record_step(2, Duration::from_secs(10), 5.0, 1.0, b));
        assert!(m.record_step(3, Duration::from_millis(500), 100.0, 2.0, b));
        assert!(m.record_step(4, Duration::from_millis(1500), 300.0, 3.0, b));
        let s = m.summary();
        assert_eq!(s.timed_batches, 2);
        assert!((s.timed_seconds - 2.0).abs() < 1e-12);
        assert!((s.words_per_sec - 200.0).abs() < 1e-9);
        assert!((s.per_step.mean - 200.0).abs() < 1e-9);
        assert!((s.mean_breakdown.forward - 0.1).abs() < 1e-12);
        assert_eq!(s.final_loss, 3.0);
        // The two timed steps' compute: 0.5 and 1.5 s, the 50th percentile between.
        assert_eq!(s.compute_quantiles.len(), COMPUTE_QUANTILES);
        assert_eq!(s.compute_quantiles[0], 0.5);
        assert_eq!(s.compute_quantiles[50], 1.0);
        assert_eq!(s.compute_quantiles[100], 1.5);
        let line = format_step_line(4, s.per_step, s.final_loss);
        assert!(line.contains("words/sec: 200.0 +/- 0.0"), "{line}");
    }
}
