//! Chrome-trace timelines: the one recorder and the one encoder every timeline of the
//! workspace goes through. Open the files in `chrome://tracing` or Perfetto
//! (<https://ui.perfetto.dev>).
//!
//! - [`EventSink`] records complete events (`"ph": "X"`) on named rows (`tid`s, each
//!   named once by a `thread_name` metadata event) of one process row (`pid`, the
//!   rank), time-stamped in microseconds since the sink's origin. It is cheap to clone
//!   and shared between threads: the fusion engine's background thread and the trainer
//!   record into the same sink. Recording can be paused ([`EventSink::set_recording`])
//!   to keep a window of a long run.
//! - [`encode_trace`] writes events as a Chrome-trace JSON object
//!   (`{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`).
//!
//! The fusion engine records, per tensor row, the phases `queued`, `copy_in`,
//! `all_reduce` and `copy_out` (a fused group reduced where its tensors lie has no
//! copies: its `all_reduce` says `"in_place": true`), and `negotiate` on a row of its
//! own, either into a sink
//! it is given ([`crate::FusionConfig::events`]) or into its own, written per rank to
//! [`crate::FusionConfig::timeline`] (`name.json` becomes `name.rank<R>.json`).
//!
//! ```
//! use std::time::{Duration, Instant};
//! use ringtrain_collective::timeline::{encode_trace, EventSink};
//!
//! let origin = Instant::now();
//! let sink = EventSink::new(0, origin);
//! sink.span("train", "forward", "phase", origin, origin + Duration::from_micros(5), serde_json::json!({}));
//! let json: serde_json::Value =
//!     serde_json::from_slice(&encode_trace(&sink.events(), serde_json::json!({}))?)?;
//! let events = json["traceEvents"].as_array().unwrap();
//! assert_eq!(events.len(), 2); // the row's name, then the event
//! assert_eq!(events[1]["dur"], 5.0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// One Chrome-trace event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// What happened (`forward`, `all_reduce`, `thread_name`).
    pub name: String,
    /// Category (`step`, `phase`, `tensor`; `__metadata` for names of rows).
    pub cat: String,
    /// Phase type: `X` (complete event with a duration) or `M` (metadata).
    pub ph: String,
    /// Start in microseconds.
    pub ts: f64,
    /// Duration in microseconds (complete events only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// Process row: the rank.
    pub pid: usize,
    /// Row within the process.
    pub tid: usize,
    /// Details shown when the event is selected.
    #[serde(default)]
    pub args: serde_json::Value,
}

impl TraceEvent {
    /// The metadata event that names row `tid` of process `pid`.
    pub fn thread_name(pid: usize, tid: usize, name: &str) -> TraceEvent {
        Self::metadata("thread_name", pid, tid, name)
    }

    /// The metadata event that names process row `pid`.
    pub fn process_name(pid: usize, name: &str) -> TraceEvent {
        Self::metadata("process_name", pid, 0, name)
    }

    fn metadata(kind: &str, pid: usize, tid: usize, name: &str) -> TraceEvent {
        TraceEvent {
            name: kind.into(),
            cat: "__metadata".into(),
            ph: "M".into(),
            ts: 0.0,
            dur: None,
            pid,
            tid,
            args: serde_json::json!({ "name": name }),
        }
    }

    /// End of a complete event (its start for others).
    pub fn end(&self) -> f64 {
        self.ts + self.dur.unwrap_or(0.0)
    }
}

#[derive(Serialize)]
struct TraceFile<'a> {
    #[serde(rename = "traceEvents")]
    trace_events: &'a [TraceEvent],
    #[serde(rename = "displayTimeUnit")]
    display_time_unit: &'static str,
    #[serde(rename = "otherData")]
    other_data: serde_json::Value,
}

/// `events` as a Chrome-trace JSON file, with `metadata` under `otherData`.
///
/// # Errors
/// A value that does not serialise (not for events made here).
pub fn encode_trace(
    events: &[TraceEvent],
    metadata: serde_json::Value,
) -> serde_json::Result<Vec<u8>> {
    serde_json::to_vec(&TraceFile {
        trace_events: events,
        display_time_unit: "ms",
        other_data: metadata,
    })
}

#[derive(Debug, Default)]
struct SinkState {
    rows: HashMap<String, usize>,
    events: Vec<TraceEvent>,
}

#[derive(Debug)]
struct SinkInner {
    pid: usize,
    origin: Instant,
    recording: AtomicBool,
    state: Mutex<SinkState>,
}

/// A shared, thread-safe recorder of one process row's events (see the module docs).
#[derive(Debug, Clone)]
pub struct EventSink {
    inner: Arc<SinkInner>,
}

impl EventSink {
    /// A sink for process row `pid`, its timestamps counted from `origin`; recording.
    pub fn new(pid: usize, origin: Instant) -> EventSink {
        EventSink {
            inner: Arc::new(SinkInner {
                pid,
                origin,
                recording: AtomicBool::new(true),
                state: Mutex::default(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SinkState> {
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The process row.
    pub fn pid(&self) -> usize {
        self.inner.pid
    }

    /// Microseconds from the origin to `t` (0 before it).
    pub fn micros(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.inner.origin).as_secs_f64() * 1e6
    }

    /// Starts or pauses recording: spans given while paused are dropped.
    pub fn set_recording(&self, on: bool) {
        self.inner.recording.store(on, Ordering::Relaxed);
    }

    /// Whether spans are recorded now.
    pub fn is_recording(&self) -> bool {
        self.inner.recording.load(Ordering::Relaxed)
    }

    /// The row named `row`, named by a metadata event the first time it is used. Rows
    /// are numbered from 0 in order of first use.
    pub fn row(&self, row: &str) -> usize {
        let mut state = self.lock();
        Self::row_in(&mut state, self.inner.pid, row)
    }

    fn row_in(state: &mut SinkState, pid: usize, row: &str) -> usize {
        if let Some(&tid) = state.rows.get(row) {
            return tid;
        }
        let tid = state.rows.len();
        state.rows.insert(row.to_owned(), tid);
        state.events.push(TraceEvent::thread_name(pid, tid, row));
        tid
    }

    /// Records `name` (category `cat`) on row `row` from `start` to `end` (when
    /// recording).
    pub fn span(
        &self,
        row: &str,
        name: &str,
        cat: &str,
        start: Instant,
        end: Instant,
        args: serde_json::Value,
    ) {
        if !self.is_recording() {
            return;
        }
        let ts = self.micros(start);
        let dur = (self.micros(end) - ts).max(0.0);
        self.span_micros(row, name, cat, ts, dur, args);
    }

    /// [`EventSink::span`] with the start and the duration in microseconds.
    pub fn span_micros(
        &self,
        row: &str,
        name: &str,
        cat: &str,
        ts: f64,
        dur: f64,
        args: serde_json::Value,
    ) {
        if !self.is_recording() {
            return;
        }
        let pid = self.inner.pid;
        let mut state = self.lock();
        let tid = Self::row_in(&mut state, pid, row);
        state.events.push(TraceEvent {
            name: name.to_owned(),
            cat: cat.to_owned(),
            ph: "X".into(),
            ts,
            dur: Some(dur),
            pid,
            tid,
            args,
        });
    }

    /// A copy of every event recorded so far, row names first where they were first used.
    pub fn events(&self) -> Vec<TraceEvent> {
        self.lock().events.clone()
    }
}

/// `dir/name.json` becomes `dir/name.rank3.json` for rank 3.
pub fn timeline_path_for_rank(path: &Path, rank: usize) -> PathBuf {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "timeline".into());
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_else(|| "json".into());
    path.with_file_name(format!("{stem}.rank{rank}.{ext}"))
}

/// The fusion engine's timeline: nothing (no clock reads) when off, else a sink, and
/// the per-rank file it is written to at the end (when the engine owns the sink).
#[derive(Default)]
pub(crate) struct Timeline {
    sink: Option<EventSink>,
    path: Option<PathBuf>,
}

impl Timeline {
    /// Records into `shared` when given, else into a sink of its own written to `path`'s
    /// rank file (when given).
    pub(crate) fn new(
        path: Option<&Path>,
        shared: Option<&EventSink>,
        rank: usize,
        origin: Instant,
    ) -> Self {
        let path = path.map(|p| timeline_path_for_rank(p, rank));
        let sink = match (shared, &path) {
            (Some(s), _) => Some(s.clone()),
            (None, Some(_)) => Some(EventSink::new(rank, origin)),
            (None, None) => None,
        };
        Timeline { sink, path }
    }

    /// Whether events are recorded now (false without a timeline, and while paused).
    pub(crate) fn enabled(&self) -> bool {
        self.sink.as_ref().is_some_and(EventSink::is_recording)
    }

    /// Records phase `phase` of `tensor` (its own row) from `start` to `end`.
    pub(crate) fn phase(
        &mut self,
        tensor: &str,
        phase: &'static str,
        start: Instant,
        end: Instant,
        args: serde_json::Value,
    ) {
        if let Some(sink) = &self.sink {
            sink.span(tensor, phase, "tensor", start, end, args);
        }
    }

    /// Records a negotiation round from `start` to `end` on the row `negotiation`.
    pub(crate) fn negotiation(&mut self, start: Instant, end: Instant, args: serde_json::Value) {
        if let Some(sink) = &self.sink {
            sink.span("negotiation", "negotiate", "negotiation", start, end, args);
        }
    }

    /// Writes the rank's file (when a path was given).
    pub(crate) fn write(&self) -> Result<()> {
        let (Some(path), Some(sink)) = (&self.path, &self.sink) else {
            return Ok(());
        };
        let err = |source: std::io::Error| Error::Timeline {
            path: path.display().to_string(),
            source,
        };
        let text = encode_trace(&sink.events(), serde_json::json!({ "rank": sink.pid() }))
            .map_err(|e| err(std::io::Error::other(e)))?;
        // Through a temporary file beside it: readers see the old file or the new one.
        let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
        tmp_name.push(format!(".tmp.{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map_err(err)
    }
}
