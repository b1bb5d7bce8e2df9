//! `--timeline FILE`: a Chrome-trace timeline of training, every rank's on one clock, in
//! one file. Open it in `chrome://tracing` (Load) or drop it on <https://ui.perfetto.dev>.
//!
//! Each rank records into its own [`EventSink`] (the collective's recorder, the one the
//! `bench allreduce --timeline` uses) while it trains; at the end rank 0 gathers every
//! rank's events over the control plane ([`Control::gather`]), moves them onto its
//! clock and writes one file atomically ([`write_atomically`]). Process row `pid` is the
//! rank; its rows (`tid`) are:
//!
//! - `train`: per step an event `step N` (category `step`) holding the step's phases
//!   (category `phase`): `data_wait`, `forward`, `backward`, the exchange
//!   (`exchange`), `optimizer`, and after the step `eval` and `checkpoint` when they
//!   run; inside `backward`, one event per gradient range of at least
//!   `--timeline-layer-bytes` (category `layer`, named after the parameters it
//!   covers), from the previous range's end to the moment backward reported it ready;
//!   the last checkpoint of a run, written after the last step, is `final_checkpoint`
//!   (category `run`);
//! - `negotiation` and one row per fused tensor (`grad.<first element>`): the fusion
//!   engine's `negotiate`, `queued`, `copy_in`, `all_reduce` and `copy_out`
//!   (overlapped reduction only);
//! - on cuda, `gpu (CUDA events)`: the device's own times of its work, measured with
//!   CUDA events: the pass (`gpu forward+backward`), each gradient range's
//!   device-to-host copy (`d2h <range>`), the host-to-device copy of the reduced
//!   gradients and the update (`gpu h2d+update`).
//!
//! `--timeline-steps A..B` keeps steps A to B (both included, numbered as the log
//! numbers them; after `--resume` numbers go on from the checkpoint's), so a long run's
//! file stays small; the sinks pause outside the window.
//!
//! **One clock.** Each rank counts microseconds from its own start. At the start of the
//! run the ranks run [`CLOCK_ROUNDS`] rounds of a barrier (an all-reduce on the control
//! plane) followed by a clock read; rank `r`'s offset is the median over the rounds of
//! its reading minus rank 0's, and its uncertainty half the spread of those differences
//! (how unevenly the ranks leave a barrier). Rank 0 subtracts each rank's offset from its
//! events. The method, the offsets and the uncertainties are stated in the file's
//! `otherData.clock_sync`.
//!
//! With no `--timeline` nothing here runs: the trainer holds `None`, reads no clock for
//! it and allocates nothing.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Instant;

use ringtrain_collective::timeline::{encode_trace, EventSink, TraceEvent};
use serde::{Deserialize, Serialize};

use crate::config::ValidatedConfig;
use crate::control::Control;
use crate::error::{Error, Result};
use crate::outputs::write_atomically;
use crate::trainable::{DeviceSpan, ParamSpec};

/// Barrier rounds of the clock synchronisation at the start.
pub const CLOCK_ROUNDS: usize = 8;

/// The row of the training loop's phases.
pub const TRAIN_ROW: &str = "train";

/// The row of the device's own times (cuda).
pub const GPU_ROW: &str = "gpu (CUDA events)";

/// `--timeline-steps A..B`: steps A to B, both included (1 <= A <= B).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct StepWindow {
    /// First step kept.
    pub first: u64,
    /// Last step kept.
    pub last: u64,
}

impl StepWindow {
    /// Whether step `step` is kept.
    pub fn contains(&self, step: u64) -> bool {
        (self.first..=self.last).contains(&step)
    }

    /// Checks `1 <= first <= last`.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] naming `--timeline-steps`.
    pub fn check(&self) -> Result<()> {
        let bad = |reason: String| Error::invalid("--timeline-steps", self, reason);
        if self.first == 0 {
            return Err(bad(
                "steps are numbered from 1, as the log numbers them; use e.g. 1..10".into(),
            ));
        }
        if self.last < self.first {
            return Err(bad(format!(
                "the last step {} comes before the first {}; give A..B with A <= B, e.g. {}..{}",
                self.last, self.first, self.last, self.first
            )));
        }
        Ok(())
    }
}

impl fmt::Display for StepWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.first, self.last)
    }
}

impl FromStr for StepWindow {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let syntax = || {
            Error::invalid(
                "--timeline-steps",
                s,
                "expected A..B, the first and last step to keep (both included), e.g. 10..20",
            )
        };
        let (a, b) = s.trim().split_once("..").ok_or_else(syntax)?;
        let number = |t: &str| t.trim().parse::<u64>().map_err(|_| syntax());
        let window = StepWindow {
            first: number(a)?,
            last: number(b)?,
        };
        window.check()?;
        Ok(window)
    }
}

impl TryFrom<String> for StepWindow {
    type Error = Error;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<StepWindow> for String {
    fn from(w: StepWindow) -> String {
        w.to_string()
    }
}

/// Checks that `--timeline-steps` overlaps the steps of this run, which trains steps
/// `first_step` to `first_step + total - 1` (numbers go on after `--resume`).
///
/// # Errors
/// [`Error::InvalidValue`] naming `--timeline-steps` and the run's steps.
pub fn check_window(cfg: &ValidatedConfig, first_step: u64) -> Result<()> {
    let Some(window) = cfg.config().output.timeline_steps else {
        return Ok(());
    };
    let last_step = first_step + cfg.total_steps() as u64 - 1;
    if window.first > last_step || window.last < first_step {
        return Err(Error::invalid(
            "--timeline-steps",
            window,
            format!(
                "this run trains steps {first_step} to {last_step}; choose a window that \
                 overlaps them"
            ),
        ));
    }
    Ok(())
}

/// How the ranks' clocks were put on rank 0's (see the module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClockSync {
    /// The method, in words.
    pub method: String,
    /// Barrier rounds.
    pub rounds: usize,
    /// Per rank: microseconds its clock reads ahead of rank 0's (subtracted).
    pub offsets_us: Vec<f64>,
    /// Per rank: half the spread of the per-round differences, in microseconds.
    pub uncertainty_us: Vec<f64>,
}

impl ClockSync {
    /// Offsets from each rank's clock readings after the same barriers (`stamps[r][k]`:
    /// rank `r`'s reading after barrier `k`).
    pub fn from_stamps(stamps: &[Vec<f64>]) -> ClockSync {
        let reference = stamps.first().cloned().unwrap_or_default();
        let mut offsets_us = Vec::with_capacity(stamps.len());
        let mut uncertainty_us = Vec::with_capacity(stamps.len());
        for own in stamps {
            let mut diffs: Vec<f64> = own.iter().zip(&reference).map(|(t, r)| t - r).collect();
            diffs.sort_by(f64::total_cmp);
            let median = match diffs.len() {
                0 => 0.0,
                n if n % 2 == 1 => diffs[n / 2],
                n => (diffs[n / 2 - 1] + diffs[n / 2]) / 2.0,
            };
            let spread = match (diffs.first(), diffs.last()) {
                (Some(lo), Some(hi)) => (hi - lo) / 2.0,
                _ => 0.0,
            };
            offsets_us.push(median);
            uncertainty_us.push(spread);
        }
        ClockSync {
            method: format!(
                "{} rounds of a barrier (all-reduce on the control communicator) then a clock \
                 read on every rank; offset = median over the rounds of (rank's reading - rank \
                 0's), uncertainty = half the spread of those differences",
                reference.len()
            ),
            rounds: reference.len(),
            offsets_us,
            uncertainty_us,
        }
    }
}

/// One rank's timeline of a run with `--timeline`.
pub(crate) struct TrainTimeline {
    sink: EventSink,
    path: PathBuf,
    window: Option<StepWindow>,
    layer_bytes: usize,
    specs: Vec<ParamSpec>,
    sync: ClockSync,
    rank: usize,
    world: usize,
}

impl TrainTimeline {
    /// The timeline of this rank when `--timeline` was given (collective: every rank
    /// calls it, and synchronises its clock with the others).
    ///
    /// # Errors
    /// Transport errors.
    pub(crate) fn start(
        cfg: &ValidatedConfig,
        control: &mut Control,
        specs: &[ParamSpec],
    ) -> Result<Option<TrainTimeline>> {
        let output = &cfg.config().output;
        let Some(path) = output.timeline.clone() else {
            return Ok(None);
        };
        let rank = control.rank();
        let sink = EventSink::new(rank, Instant::now());
        sink.row(TRAIN_ROW);
        let mut stamps = Vec::with_capacity(CLOCK_ROUNDS);
        for _ in 0..CLOCK_ROUNDS {
            control.sum(&mut [0.0])?;
            stamps.push(sink.micros(Instant::now()));
        }
        let sync = ClockSync::from_stamps(&control.gather(&stamps)?);
        // Nothing is recorded before the first step of the window.
        sink.set_recording(false);
        Ok(Some(TrainTimeline {
            sink,
            path,
            window: output.timeline_steps,
            layer_bytes: output.timeline_layer_bytes,
            specs: specs.to_vec(),
            sync,
            rank,
            world: cfg.world(),
        }))
    }

    /// The sink the fusion engine records into.
    pub(crate) fn sink(&self) -> &EventSink {
        &self.sink
    }

    /// Starts recording for step `step` when it is in the window (else pauses);
    /// whether it records.
    pub(crate) fn begin_step(&self, step: u64) -> bool {
        let on = self.window.is_none_or(|w| w.contains(step));
        self.sink.set_recording(on);
        on
    }

    /// Whether this step is recorded.
    pub(crate) fn recording(&self) -> bool {
        self.sink.is_recording()
    }

    /// Records `name` on the training row.
    pub(crate) fn span(
        &self,
        name: &str,
        cat: &str,
        start: Instant,
        end: Instant,
        args: serde_json::Value,
    ) {
        self.sink.span(TRAIN_ROW, name, cat, start, end, args);
    }

    /// Records device work timed with CUDA events on the GPU row.
    pub(crate) fn device_span(&self, span: &DeviceSpan) {
        self.sink.span(
            GPU_ROW,
            &span.name,
            "gpu",
            span.start,
            span.end,
            span.args.clone(),
        );
    }

    /// One event per gradient range of at least `--timeline-layer-bytes` (f32), from the
    /// previous range's ready time (the first: `backward_start`) to its own.
    pub(crate) fn backward_ranges(
        &self,
        backward_start: Instant,
        ready: &[(Range<usize>, Instant)],
    ) {
        let mut from = backward_start;
        for (range, at) in ready {
            let at = (*at).max(from);
            let bytes = range.len() * std::mem::size_of::<f32>();
            if bytes >= self.layer_bytes && bytes > 0 {
                let args = serde_json::json!({
                    "elements": range.len(),
                    "bytes": bytes,
                    "range": format!("{}..{}", range.start, range.end),
                });
                let name = format!("backward {}", self.range_name(range));
                self.span(&name, "layer", from, at, args);
            }
            from = at;
        }
    }

    /// The parameters `range` covers: `name` or `first..last (n tensors)`.
    fn range_name(&self, range: &Range<usize>) -> String {
        let covered: Vec<&str> = self
            .specs
            .iter()
            .filter(|s| s.range.start < range.end && range.start < s.range.end)
            .map(|s| s.name.as_str())
            .collect();
        match covered.as_slice() {
            [] => format!("{}..{}", range.start, range.end),
            [one] => (*one).to_string(),
            [first, .., last] => format!("{first}..{last} ({} tensors)", covered.len()),
        }
    }

    /// Gathers every rank's events on rank 0, puts them on rank 0's clock and writes the
    /// file there (collective; every rank learns whether it worked).
    ///
    /// # Errors
    /// The write's error on rank 0, [`Error::OtherRanksFailed`] elsewhere; transport and
    /// JSON errors.
    pub(crate) fn finish(self, control: &mut Control) -> Result<()> {
        self.sink.set_recording(false);
        let mut own = vec![TraceEvent::process_name(
            self.rank,
            &format!("rank {}", self.rank),
        )];
        own.extend(self.sink.events());
        let all = control.gather(&own)?;
        let local = if self.rank == 0 {
            self.write(all)
        } else {
            Ok(())
        };
        control.agree("to write the timeline", local)
    }

    fn write(&self, all: Vec<Vec<TraceEvent>>) -> Result<()> {
        let mut merged = Vec::with_capacity(all.iter().map(Vec::len).sum());
        for (rank, events) in all.into_iter().enumerate() {
            let offset = self.sync.offsets_us.get(rank).copied().unwrap_or(0.0);
            merged.extend(events.into_iter().map(|mut e| {
                if e.ph == "X" {
                    e.ts -= offset;
                }
                e
            }));
        }
        let metadata = serde_json::json!({
            "ranks": self.world,
            "time_unit": "microseconds on rank 0's clock",
            "timeline_steps": self.window.map(|w| w.to_string()),
            "timeline_layer_bytes": self.layer_bytes,
            "clock_sync": self.sync,
        });
        let bytes = encode_trace(&merged, metadata).map_err(|source| Error::Json {
            action: "encoding the timeline",
            source,
        })?;
        write_atomically(&self.path, &bytes, "writing the timeline")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_parse_and_bad_ones_name_the_flag() {
        let w: StepWindow = "3..7".parse().unwrap();
        assert_eq!(w, StepWindow { first: 3, last: 7 });
        assert!(w.contains(3) && w.contains(7) && !w.contains(2) && !w.contains(8));
        assert_eq!(
            " 5..5 ".parse::<StepWindow>().ok(),
            Some(StepWindow { first: 5, last: 5 })
        );
        for (bad, says) in [
            ("7..3", "comes before the first"),
            ("0..3", "numbered from 1"),
            ("3", "expected A..B"),
            ("a..b", "expected A..B"),
            ("3..", "expected A..B"),
            ("-1..4", "expected A..B"),
        ] {
            let err = bad.parse::<StepWindow>().unwrap_err().to_string();
            assert!(
                err.contains("--timeline-steps") && err.contains(says) && err.contains(bad.trim()),
                "{bad}: {err}"
            );
        }
        let json = serde_json::to_string(&w).unwrap();
        assert_eq!(json, "\"3..7\"");
        assert_eq!(serde_json::from_str::<StepWindow>(&json).unwrap(), w);
        assert!(serde_json::from_str::<StepWindow>("\"9..1\"").is_err());
    }

    #[test]
    fn ranges_from_the_threshold_get_events_named_after_their_parameters() {
        let spec = |name: &str, range: Range<usize>| ParamSpec {
            name: name.into(),
            range,
        };
        let origin = Instant::now();
        let timeline = TrainTimeline {
            sink: EventSink::new(0, origin),
            path: PathBuf::from("unused.json"),
            window: None,
            layer_bytes: 64,
            specs: vec![spec("a/w", 0..16), spec("b/w", 16..20), spec("b/b", 20..24)],
            sync: ClockSync::from_stamps(&[vec![0.0]]),
            rank: 0,
            world: 1,
        };
        let at = |us: u64| origin + std::time::Duration::from_micros(us);
        // 16 elements (64 bytes): its own event; 4 (16 bytes): only part of backward;
        // 8 over two tensors: 32 bytes, below the threshold too.
        timeline.backward_ranges(
            at(10),
            &[(16..20, at(30)), (0..16, at(70)), (16..24, at(90))],
        );
        let spans: Vec<_> = timeline
            .sink
            .events()
            .into_iter()
            .filter(|e| e.ph == "X")
            .collect();
        assert_eq!(spans.len(), 1, "{spans:?}");
        assert_eq!(spans[0].name, "backward a/w");
        assert_eq!(spans[0].cat, "layer");
        assert!((spans[0].ts - 30.0).abs() < 1e-6 && (spans[0].end() - 70.0).abs() < 1e-6);
        assert_eq!(timeline.range_name(&(16..24)), "b/w..b/b (2 tensors)");
        assert_eq!(timeline.range_name(&(30..40)), "30..40");
    }

    #[test]
    fn offsets_are_medians_of_the_differences_to_rank_0() {
        let sync = ClockSync::from_stamps(&[
            vec![10.0, 20.0, 30.0],
            vec![110.0, 121.0, 129.0],
            vec![5.0, 15.0, 25.0],
        ]);
        assert_eq!(sync.rounds, 3);
        assert_eq!(sync.offsets_us, [0.0, 100.0, -5.0]);
        assert_eq!(sync.uncertainty_us, [0.0, 1.0, 0.0]);
        assert!(sync.method.contains("barrier"), "{}", sync.method);
    }
}
