//! Chrome-trace timeline of the fusion engine: one JSON file per rank, one row per tensor,
//! with its phases (`queued`, `copy_in`, `all_reduce`, `copy_out`). Open it in
//! `chrome://tracing` or Perfetto.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};

#[derive(Serialize)]
struct TraceEvent {
    name: String,
    cat: &'static str,
    ph: &'static str,
    ts: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    pid: usize,
    tid: usize,
    args: serde_json::Value,
}

#[derive(Serialize)]
struct TraceFile<'a> {
    #[serde(rename = "traceEvents")]
    trace_events: &'a [TraceEvent],
    #[serde(rename = "displayTimeUnit")]
    display_time_unit: &'static str,
}

/// Collects phase events in memory and writes them as Chrome-trace JSON.
#[derive(Default)]
pub(crate) struct Timeline {
    path: Option<PathBuf>,
    rank: usize,
    origin: Option<Instant>,
    rows: HashMap<String, usize>,
    events: Vec<TraceEvent>,
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

impl Timeline {
    pub(crate) fn new(path: Option<&Path>, rank: usize, origin: Instant) -> Self {
        Timeline {
            path: path.map(|p| timeline_path_for_rank(p, rank)),
            rank,
            origin: Some(origin),
            rows: HashMap::new(),
            events: Vec::new(),
        }
    }

    pub(crate) fn enabled(&self) -> bool {
        self.path.is_some()
    }

    fn micros(&self, t: Instant) -> f64 {
        match self.origin {
            Some(o) => t.saturating_duration_since(o).as_secs_f64() * 1e6,
            None => 0.0,
        }
    }

    fn row(&mut self, tensor: &str) -> usize {
        if let Some(&r) = self.rows.get(tensor) {
            return r;
        }
        let r = self.rows.len() + 1;
        self.rows.insert(tensor.to_owned(), r);
        self.events.push(TraceEvent {
            name: "thread_name".into(),
            cat: "__metadata",
            ph: "M",
            ts: 0.0,
            dur: None,
            pid: self.rank,
            tid: r,
            args: serde_json::json!({ "name": tensor }),
        });
        r
    }

    /// Records phase `phase` of `tensor` from `start` to `end`.
    pub(crate) fn phase(
        &mut self,
        tensor: &str,
        phase: &'static str,
        start: Instant,
        end: Instant,
        args: serde_json::Value,
    ) {
        if !self.enabled() {
            return;
        }
        let tid = self.row(tensor);
        let ts = self.micros(start);
        let dur = (self.micros(end) - ts).max(0.0);
        self.events.push(TraceEvent {
            name: phase.to_owned(),
            cat: "tensor",
            ph: "X",
            ts,
            dur: Some(dur),
            pid: self.rank,
            tid,
            args,
        });
    }

    /// Writes the file (when a path was given).
    pub(crate) fn write(&self) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let err = |source: std::io::Error| Error::Timeline {
            path: path.display().to_string(),
            source,
        };
        let file = TraceFile {
            trace_events: &self.events,
            display_time_unit: "ms",
        };
        let text = serde_json::to_vec(&file).map_err(|e| err(std::io::Error::other(e)))?;
        std::fs::write(path, text).map_err(err)
    }
}
