//! `--timeline FILE`: the file rank 0 writes is Chrome-trace JSON whose every event has
//! its fields, whose phases nest inside their step, which holds every rank's rows on one
//! clock, which keeps only the `--timeline-steps` window, and which is refused when it
//! exists unless `--overwrite-timeline`. Ranks are threads over the collective's local
//! transport, driven through `run_rank`.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use ringtrain_collective::Communicator;
use ringtrain_data::BundledCorpus;
use ringtrain_train::{local_rank, run_rank, OverlapMode, StepWindow, TrainConfig};
use serde_json::Value;

fn config(timeline: &Path) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.num_units = 8;
    cfg.run.threads = 1;
    cfg.run.seed = 3;
    cfg.run.warmup_batches = 1;
    cfg.run.timed_batches = 3;
    cfg.output.display_every = 0;
    cfg.data.vocab_size = 30;
    cfg.data.batch_size = 4;
    cfg.data.src_max_len = 6;
    // Gradient ranges reach the fusion engine while backward runs: its phases show.
    cfg.exchange.overlap_backward = OverlapMode::On;
    cfg.output.timeline = Some(timeline.to_path_buf());
    // Every gradient range gets its own backward event.
    cfg.output.timeline_layer_bytes = 0;
    cfg
}

/// Runs `cfg` on `ranks` ranks; each rank's result.
fn run(cfg: &TrainConfig, ranks: usize) -> Vec<ringtrain_train::Result<()>> {
    let cfg = cfg.validate(ranks).expect("a valid test config");
    Communicator::run_local(ranks, |comm| {
        let local = local_rank(&comm)?;
        run_rank(&cfg, comm, local, &mut |_| {})?;
        Ok(())
    })
    .expect("the local transport runs")
}

fn run_ok(cfg: &TrainConfig, ranks: usize) {
    for (rank, r) in run(cfg, ranks).into_iter().enumerate() {
        if let Err(e) = r {
            panic!("rank {rank} failed: {e}");
        }
    }
}

/// The file's events after checking every field of every event; the file's metadata.
fn load(path: &Path) -> (Vec<Value>, Value) {
    let text = std::fs::read_to_string(path).expect("the timeline is written");
    let json: Value = serde_json::from_str(&text).expect("the timeline is JSON");
    let events = json["traceEvents"]
        .as_array()
        .expect("a traceEvents array")
        .clone();
    assert!(!events.is_empty());
    for e in &events {
        assert!(e["name"].as_str().is_some_and(|n| !n.is_empty()), "{e}");
        assert!(
            e["pid"].as_u64().is_some() && e["tid"].as_u64().is_some(),
            "{e}"
        );
        assert!(e["ts"].as_f64().is_some_and(f64::is_finite), "{e}");
        match e["ph"].as_str() {
            Some("X") => {
                assert!(e["dur"].as_f64().is_some_and(|d| d >= 0.0), "{e}");
                assert!(e["cat"].as_str().is_some(), "{e}");
            }
            Some("M") => {
                let kind = e["name"].as_str().unwrap_or_default();
                assert!(kind == "thread_name" || kind == "process_name", "{e}");
                assert!(e["args"]["name"].as_str().is_some(), "{e}");
            }
            other => panic!("unexpected ph {other:?}: {e}"),
        }
    }
    (events, json["otherData"].clone())
}

fn spans(events: &[Value]) -> impl Iterator<Item = &Value> {
    events.iter().filter(|e| e["ph"] == "X")
}

fn name(e: &Value) -> &str {
    e["name"].as_str().unwrap_or_default()
}

/// The name of row `tid` of process `pid`.
fn row_names(events: &[Value]) -> HashMap<(u64, u64), String> {
    events
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| {
            (
                (e["pid"].as_u64().unwrap(), e["tid"].as_u64().unwrap()),
                e["args"]["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Every event that is not a step or the run's own lies within a step of its rank (a
/// microsecond of slack for the rounding of the clock offsets); returns the step numbers
/// per rank.
fn check_nesting(events: &[Value]) -> HashMap<u64, BTreeSet<u64>> {
    let mut steps: HashMap<u64, Vec<(u64, f64, f64)>> = HashMap::new();
    for e in spans(events).filter(|e| e["cat"] == "step") {
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        let n = e["args"]["step"].as_u64().expect("a step number");
        assert_eq!(name(e), format!("step {n}"));
        steps
            .entry(e["pid"].as_u64().unwrap())
            .or_default()
            .push((n, ts, ts + dur));
    }
    for e in spans(events).filter(|e| e["cat"] != "step" && e["cat"] != "run") {
        let pid = e["pid"].as_u64().unwrap();
        let (ts, end) = (
            e["ts"].as_f64().unwrap(),
            e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
        );
        let inside = steps
            .get(&pid)
            .is_some_and(|s| s.iter().any(|&(_, a, b)| ts >= a - 1.0 && end <= b + 1.0));
        assert!(inside, "not inside a step of rank {pid}: {e}");
    }
    steps
        .into_iter()
        .map(|(pid, s)| (pid, s.into_iter().map(|(n, ..)| n).collect()))
        .collect()
}

#[test]
fn two_ranks_write_one_file_with_both_rows_and_nested_phases() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let mut cfg = config(&path);
    cfg.output.checkpoint = Some(dir.path().join("run.ckpt"));
    cfg.output.checkpoint_every = 2;
    run_ok(&cfg, 2);
    let (events, meta) = load(&path);
    let steps = check_nesting(&events);
    let all: BTreeSet<u64> = (1..=4).collect();
    assert_eq!(steps.get(&0), Some(&all), "rank 0's steps");
    assert_eq!(steps.get(&1), Some(&all), "rank 1's steps");
    let rows = row_names(&events);
    for rank in 0..2u64 {
        let names: BTreeSet<&str> = spans(&events)
            .filter(|e| e["pid"] == rank)
            .map(name)
            .collect();
        for phase in [
            "data_wait",
            "forward",
            "backward",
            "exchange",
            "optimizer",
            "checkpoint",
            "negotiate",
            "queued",
            "all_reduce",
        ] {
            assert!(
                names.contains(phase),
                "rank {rank} lacks {phase}: {names:?}"
            );
        }
        assert!(
            names.iter().any(|n| n.starts_with("backward ")),
            "rank {rank} has no per-layer backward event: {names:?}"
        );
        assert_eq!(rows.get(&(rank, 0)).map(String::as_str), Some("train"));
        assert!(rows.contains_key(&(rank, 1)), "rank {rank}'s fusion rows");
        assert!(
            events
                .iter()
                .any(|e| e["name"] == "process_name" && e["pid"] == rank),
            "rank {rank} is named"
        );
    }
    // Per-layer events lie inside their backward.
    for e in spans(&events).filter(|e| e["cat"] == "layer") {
        let (ts, end) = (
            e["ts"].as_f64().unwrap(),
            e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap(),
        );
        let inside = spans(&events).any(|b| {
            name(b) == "backward"
                && b["pid"] == e["pid"]
                && ts >= b["ts"].as_f64().unwrap() - 1e-3
                && end <= b["ts"].as_f64().unwrap() + b["dur"].as_f64().unwrap() + 1e-3
        });
        assert!(inside, "outside its backward: {e}");
    }
    assert_eq!(meta["ranks"], 2);
    let sync = &meta["clock_sync"];
    assert_eq!(sync["rounds"], 8);
    assert!(sync["method"]
        .as_str()
        .is_some_and(|m| m.contains("barrier")));
    assert_eq!(sync["offsets_us"].as_array().map(Vec::len), Some(2));
    assert_eq!(sync["offsets_us"][0], 0.0);
    assert_eq!(sync["uncertainty_us"].as_array().map(Vec::len), Some(2));
    // One process: the ranks started within the test's lifetime of each other.
    let offset = sync["offsets_us"][1].as_f64().unwrap().abs();
    assert!(offset < 60e6, "{offset}");
}

#[test]
fn the_window_keeps_only_its_steps_and_the_file_is_not_replaced_unasked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let mut cfg = config(&path);
    cfg.run.timed_batches = 5;
    cfg.output.timeline_steps = Some(StepWindow { first: 2, last: 3 });
    run_ok(&cfg, 2);
    let (events, meta) = load(&path);
    let steps = check_nesting(&events);
    let window: BTreeSet<u64> = [2, 3].into();
    assert_eq!(steps.get(&0), Some(&window));
    assert_eq!(steps.get(&1), Some(&window));
    assert_eq!(meta["timeline_steps"], "2..3");

    // The file exists now: another run refuses it before training, on every rank...
    let before = std::fs::read(&path).unwrap();
    for (rank, r) in run(&cfg, 2).into_iter().enumerate() {
        let err = r.expect_err("an existing timeline is refused").to_string();
        if rank == 0 {
            assert!(
                err.contains("--timeline") && err.contains("--overwrite-timeline"),
                "{err}"
            );
        }
    }
    assert_eq!(std::fs::read(&path).unwrap(), before, "left as it was");
    // ...unless asked to replace it.
    cfg.output.overwrite_timeline = true;
    cfg.output.timeline_steps = Some(StepWindow { first: 1, last: 1 });
    run_ok(&cfg, 1);
    let (events, _) = load(&path);
    let steps = check_nesting(&events);
    assert_eq!(steps.len(), 1, "one rank");
    assert_eq!(steps.get(&0), Some(&[1].into()));
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "trace.json")
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
}

#[test]
fn evaluation_shows_inside_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let mut cfg = config(&path);
    let files = BundledCorpus::in_repo();
    cfg.data.vocab_size = TrainConfig::default().data.vocab_size;
    cfg.data.data = vec![
        files.nmt_train_src,
        files.nmt_train_tgt,
        files.nmt_vocab_src,
        files.nmt_vocab_tgt,
    ];
    cfg.data.eval_data = vec![files.nmt_dev_src, files.nmt_dev_tgt];
    cfg.data.batch_size = 16;
    cfg.run.eval_every = 2;
    run_ok(&cfg, 1);
    let (events, _) = load(&path);
    check_nesting(&events);
    let evals = spans(&events).filter(|e| name(e) == "eval").count();
    assert_eq!(evals, 2, "after steps 2 and 4");
}

#[test]
fn bad_timeline_flags_fail_before_training_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.json");
    let err = |cfg: &TrainConfig| cfg.validate(1).unwrap_err().to_string();

    let mut cfg = config(&path);
    cfg.output.timeline_steps = Some(StepWindow { first: 5, last: 2 });
    let e = err(&cfg);
    assert!(
        e.contains("invalid value `5..2` for --timeline-steps") && e.contains("A <= B"),
        "{e}"
    );
    cfg.output.timeline_steps = Some(StepWindow { first: 0, last: 2 });
    assert!(err(&cfg).contains("--timeline-steps"));

    let mut cfg = config(&path);
    cfg.output.timeline = None;
    cfg.output.timeline_steps = Some(StepWindow { first: 1, last: 2 });
    let e = err(&cfg);
    assert!(
        e.contains("--timeline-steps") && e.contains("needs --timeline"),
        "{e}"
    );

    let mut cfg = config(&path);
    cfg.output.timeline = None;
    cfg.output.overwrite_timeline = true;
    let e = err(&cfg);
    assert!(
        e.contains("--overwrite-timeline") && e.contains("needs --timeline"),
        "{e}"
    );

    // A window past the run's steps (1 warm-up + 3 timed) would record nothing.
    let mut cfg = config(&path);
    cfg.output.timeline_steps = Some(StepWindow { first: 5, last: 9 });
    for r in run(&cfg, 2) {
        let e = r.expect_err("refused").to_string();
        assert!(
            e.contains("--timeline-steps") && e.contains("trains steps 1 to 4"),
            "{e}"
        );
    }
    assert!(!path.exists(), "nothing written");

    // A directory, a missing directory, and the checkpoint's path: refused at the start.
    for (bad, says) in [
        (dir.path().to_path_buf(), "is a directory"),
        (dir.path().join("missing").join("t.json"), "mkdir"),
        (dir.path().join("run.ckpt"), "also the --checkpoint"),
    ] {
        let mut cfg = config(&bad);
        cfg.output.checkpoint = Some(dir.path().join("run.ckpt"));
        let results = run(&cfg, 1);
        let e = results
            .into_iter()
            .next()
            .unwrap()
            .expect_err("refused")
            .to_string();
        assert!(e.contains("--timeline") && e.contains(says), "{e}");
    }
    assert!(!dir.path().join("run.ckpt").exists(), "no step was run");
}
