//! `ringtrain predict` from fixture files, `sweep --predict`, the report's gradient
//! ready-times the model is calibrated on, and `predict --validate` under mpirun.
//!
//! The fixtures in `tests/data` come from real runs of a debug build on a shared 2-core
//! machine:
//!
//! ```text
//! ringtrain train --use-synthetic-data --num-units 32 --vocab-size 400 --src-max-len 10 \
//!     --batch-size 8 --warmup-batches 2 --timed-batches 8 --threads 1 \
//!     --json-report predict-one-rank.json
//! ringtrain launch --np 2 -- bench allreduce --algorithms auto,ring,mpi --min-bytes 4K \
//!     --max-bytes 4M --step-factor 4 --small-tensors 0 --fusion-tensors 0 \
//!     --json predict-bench-2ranks.json
//! ```
//!
//! The tests check the table's structure and the model's monotonic properties, never the
//! figures themselves.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use support::{output_within, ringtrain, texts, TINY};

const LIMIT: Duration = Duration::from_secs(120);

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

/// Runs `ringtrain args...`; (success, stdout, stderr).
fn run(args: &[&str]) -> (bool, String, String) {
    let mut cmd = ringtrain();
    cmd.args(args);
    let out = output_within(cmd, LIMIT, "ringtrain");
    let (stdout, stderr) = texts(&out);
    (out.status.success(), stdout, stderr)
}

/// `predict` with the fixture report and `extra`, its rows from `--json`.
fn predict_rows(extra: &[&str]) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let report = data("predict-one-rank.json");
    let mut args = vec![
        "predict",
        "--report",
        report.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = run(&args);
    assert!(ok, "{stdout}\n{stderr}");
    let rows: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    rows.as_array().unwrap().clone()
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no number `{key}` in {v}"))
}

#[test]
fn predict_from_a_report_and_a_bench_prints_every_strategy_and_count() {
    let bench = data("predict-bench-2ranks.json");
    let report = data("predict-one-rank.json");
    let (ok, stdout, stderr) = run(&[
        "predict",
        "--report",
        report.to_str().unwrap(),
        "--bench",
        bench.to_str().unwrap(),
        "--np",
        "2,4,8,64,1024",
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("link: fitted to"), "{stdout}");
    let table: Vec<&str> = stdout.lines().filter(|l| l.starts_with('|')).collect();
    assert!(
        table[0].contains("strategy")
            && table[0].contains("words/s")
            && table[0].contains("bottleneck"),
        "{stdout}"
    );
    let columns = table[0].matches('|').count();
    assert!(table.iter().all(|l| l.matches('|').count() == columns));
    // Four strategies, five counts (all even: a pipeline of 2 stages fits each).
    assert_eq!(table.len() - 2, 4 * 5, "{stdout}");

    let rows = predict_rows(&["--bench", bench.to_str().unwrap(), "--np", "2,4,8,64,1024"]);
    assert_eq!(rows.len(), 20);
    let odd = predict_rows(&["--bench", bench.to_str().unwrap(), "--np", "3"]);
    assert_eq!(odd.len(), 3, "a pipeline of 2 stages cannot use 3 ranks");
    let names = [
        "compute",
        "stragglers",
        "bandwidth",
        "latency",
        "bubble",
        "server link",
        "stage link",
        "shared cores",
    ];
    for r in &rows {
        assert_eq!(r["predicted"], true, "{r}");
        for key in ["words_per_sec", "speedup", "efficiency", "step_seconds"] {
            assert!(f(r, key).is_finite() && f(r, key) > 0.0, "{key} in {r}");
        }
        let b = r["bottleneck"].as_str().unwrap();
        assert!(names.contains(&b), "{r}");
        let terms: f64 = names
            .iter()
            .map(|n| f(&r["terms"], &n.replace(' ', "_")))
            .sum();
        assert!((terms - f(r, "step_seconds")).abs() <= 1e-9 * terms, "{r}");
        let ranks = r["ranks"].as_u64().unwrap() as f64;
        assert!((f(r, "efficiency") * ranks - f(r, "speedup")).abs() < 1e-9 * ranks);
    }
    // Independent replicas scale linearly.
    for r in rows.iter().filter(|r| r["strategy"] == "independent") {
        assert!((f(r, "efficiency") - 1.0).abs() < 1e-9, "{r}");
    }
}

#[test]
fn more_bandwidth_never_predicts_fewer_words_and_more_ranks_never_fewer_for_independent() {
    let mut by_beta: Vec<BTreeMap<(String, u64), f64>> = Vec::new();
    for beta in ["10", "1", "0.1", "0.01"] {
        let rows = predict_rows(&[
            "--alpha-us",
            "5",
            "--beta-ns-per-byte",
            beta,
            "--np",
            "2,4,8,64,1024",
            "--overlap",
            "on",
        ]);
        by_beta.push(
            rows.iter()
                .map(|r| {
                    (
                        (
                            r["strategy"].as_str().unwrap().to_string(),
                            r["ranks"].as_u64().unwrap(),
                        ),
                        f(r, "words_per_sec"),
                    )
                })
                .collect(),
        );
    }
    // Independent replicas: more ranks, more words/s.
    let mut by_ranks: Vec<(u64, f64)> = by_beta[0]
        .iter()
        .filter(|((s, _), _)| s == "independent")
        .map(|((_, n), w)| (*n, *w))
        .collect();
    by_ranks.sort_by_key(|r| r.0);
    assert_eq!(by_ranks.len(), 5);
    assert!(by_ranks.windows(2).all(|w| w[1].1 > w[0].1), "{by_ranks:?}");
    for pair in by_beta.windows(2) {
        for (key, slower) in &pair[0] {
            let faster = pair[1][key];
            assert!(
                faster >= *slower * (1.0 - 1e-12),
                "{key:?}: {faster} < {slower}"
            );
        }
    }
    // A described link: NDR has more bandwidth than HDR at the same latency.
    let hdr = predict_rows(&["--link", "ib-hdr", "--np", "8,64"]);
    let ndr = predict_rows(&["--link", "ib-ndr", "--np", "8,64"]);
    for (h, n) in hdr.iter().zip(&ndr) {
        assert_eq!(h["strategy"], n["strategy"]);
        assert!(f(n, "words_per_sec") >= f(h, "words_per_sec") * (1.0 - 1e-12));
    }
    // f16 on the wire never loses words/s; repacking is a row of its own.
    let f32_rows = predict_rows(&["--link", "p100-pcie", "--strategies", "replicated"]);
    let f16_rows = predict_rows(&[
        "--link",
        "p100-pcie",
        "--strategies",
        "replicated",
        "--fp16-gradients",
        "on",
    ]);
    for (a, b) in f32_rows.iter().zip(&f16_rows) {
        assert!(f(b, "words_per_sec") >= f(a, "words_per_sec"));
        assert!(b["strategy"].as_str().unwrap().ends_with("f16"), "{b}");
    }
}

/// Runs `ringtrain predict args...`, which must fail with every one of `needles` in its
/// stderr.
fn refused(args: &[&str], needles: &[&str]) {
    let mut all = vec!["predict"];
    all.extend_from_slice(args);
    let (ok, stdout, stderr) = run(&all);
    assert!(!ok, "`ringtrain {}` succeeded:\n{stdout}", all.join(" "));
    for needle in needles {
        assert!(stderr.contains(needle), "no `{needle}` in:\n{stderr}");
    }
}

#[test]
fn unusable_inputs_name_the_file_and_what_to_run() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nothing.json");
    let missing = missing.to_str().unwrap();
    refused(
        &["--report", missing, "--link", "pcie4"],
        &[
            "for --report",
            "nothing.json",
            "ringtrain train --json-report",
        ],
    );

    let report = data("predict-one-rank.json");
    let report = report.to_str().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "[1, 2").unwrap();
    refused(
        &["--report", report, "--bench", bad.to_str().unwrap()],
        &[
            "for --bench",
            "bad.json",
            "not JSON",
            "bench allreduce --json",
        ],
    );

    // A report of 2 ranks is refused: the model is calibrated on one.
    let text = std::fs::read_to_string(report).unwrap();
    let mut two: Value = serde_json::from_str(&text).unwrap();
    two["ranks"] = Value::from(2);
    let two_path = dir.path().join("two.json");
    std::fs::write(&two_path, two.to_string()).unwrap();
    refused(
        &["--report", two_path.to_str().unwrap(), "--link", "pcie4"],
        &["report of 2 ranks"],
    );

    refused(&["--report", report], &["give exactly one"]);
    refused(
        &["--report", report, "--link", "pcie4", "--", "train"],
        &["only run by --validate"],
    );
    refused(&["--report", report, "--link", "ethernet"], &["ib-ndr"]);
}

#[test]
fn the_seeds_tables_are_predicted_row_by_row() {
    let (ok, stdout, stderr) = run(&["predict", "--seeds"]);
    assert!(ok, "{stdout}\n{stderr}");
    let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("| 0")).collect();
    // Ten tables of 8 GPUs (one of 7), from 2 GPUs up.
    assert_eq!(rows.len(), 9 * 7 + 6, "{stdout}");
    assert!(rows.iter().all(|r| r.contains(" % |")));
    let last = stdout.lines().last().unwrap();
    assert!(
        last.starts_with("prediction error: max ") && last.ends_with(" %"),
        "{last}"
    );
}

#[test]
fn the_report_lists_every_gradient_range_once_in_backward_order() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("one.json");
    let mut args = vec!["train"];
    args.extend_from_slice(TINY);
    args.extend_from_slice(&["--json-report", report.to_str().unwrap()]);
    let (ok, stdout, stderr) = run(&args);
    assert!(ok, "{stdout}\n{stderr}");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    // The step's spread: 101 quantiles of the timed steps' compute, from the fastest
    // step to the slowest.
    let quantiles: Vec<f64> = json["per_rank"][0]["compute_quantiles"]
        .as_array()
        .unwrap_or_else(|| panic!("no compute_quantiles: {json}"))
        .iter()
        .map(|q| q.as_f64().unwrap())
        .collect();
    assert_eq!(quantiles.len(), 101, "{quantiles:?}");
    assert!(quantiles[0] > 0.0, "{quantiles:?}");
    assert!(quantiles.windows(2).all(|w| w[0] <= w[1]), "{quantiles:?}");
    let ready = json["per_rank"][0]["gradient_ready"].as_array().unwrap();
    assert!(ready.len() > 1, "{ready:?}");
    let mut spans: Vec<(u64, u64)> = ready
        .iter()
        .map(|r| {
            (
                r["start"].as_u64().unwrap(),
                r["elements"].as_u64().unwrap(),
            )
        })
        .collect();
    let times: Vec<f64> = ready.iter().map(|r| f(r, "seconds")).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    assert!(times.iter().all(|t| *t >= 0.0));
    let backward = f(&json["breakdown"], "backward");
    assert!(
        times.last().copied().unwrap_or(0.0) <= backward * 1.5 + 1e-3,
        "{times:?} {backward}"
    );
    spans.sort_unstable();
    let mut at = 0;
    for (start, len) in spans {
        assert_eq!(start, at, "ranges overlap or leave a gap");
        at += len;
    }
    assert_eq!(at, json["parameters"].as_u64().unwrap());
}

/// The hardware threads this machine has online (what the trainer records).
fn node_cores() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .map(|list| {
            list.trim()
                .split(',')
                .map(|part| match part.split_once('-') {
                    Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
                    None => 1,
                })
                .sum()
        })
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

#[test]
fn the_report_records_the_nodes_cores_even_when_mpirun_binds_the_rank() {
    // One rank of one thread: `launch` binds it to a core, yet the model needs the
    // cores the ranks of a larger run would share.
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("one.json");
    let mut args = vec!["launch", "--np", "1", "--", "train"];
    args.extend_from_slice(TINY);
    args.extend_from_slice(&["--json-report", report.to_str().unwrap()]);
    let (ok, stdout, stderr) = run(&args);
    assert!(ok, "{stdout}\n{stderr}");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    let host = &json["host"];
    assert_eq!(host["cores"].as_u64(), Some(node_cores() as u64), "{host}");
    assert_eq!(host["threads_per_rank"].as_u64(), Some(1), "{host}");
    assert_eq!(host["ranks_on_node"].as_u64(), Some(1), "{host}");
}

#[test]
fn sweep_appends_predicted_rows_marked_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sweep.json");
    let plot = dir.path().join("sweep.svg");
    let mut args = vec![
        "sweep",
        "--np",
        "1",
        "--predict",
        "4,64",
        "--link",
        "ib-hdr",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        plot.to_str().unwrap(),
        "--",
        "train",
    ];
    args.extend_from_slice(TINY);
    let (ok, stdout, stderr) = run(&args);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("| 4 (predicted: "), "{stdout}");
    assert!(stdout.contains("| 64 (predicted: "), "{stdout}");
    let rows: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    let marks: Vec<(u64, bool)> = rows
        .iter()
        .map(|r| {
            (
                r["ranks"].as_u64().unwrap(),
                r["predicted"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(marks, vec![(1, false), (4, true), (64, true)]);
    assert!(rows[1]["bottleneck"].is_string());
    // The plot extends the measured point with the predicted ones, dashed.
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.contains("scaling model (predicted)"), "{svg}");
    assert_eq!(svg.matches("<circle").count(), 1, "one measured point");

    // Checked before any run: --predict needs the 1-rank run to calibrate on.
    let (ok, stdout, stderr) = run(&[
        "sweep",
        "--np",
        "2",
        "--predict",
        "8",
        "--link",
        "pcie4",
        "--",
        "train",
    ]);
    assert!(!ok);
    assert!(stderr.contains("add 1 to --np"), "{stderr}");
    assert!(!stdout.contains("words/s"), "{stdout}");
}

#[test]
fn validate_runs_calibrates_measures_and_ends_with_the_largest_error() {
    // The default counts: 2 and 3 ranks.
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("validated.json");
    let mut args = vec![
        "predict",
        "--validate",
        "--rounds",
        "1",
        "--json",
        json.to_str().unwrap(),
        "--",
        "train",
    ];
    args.extend_from_slice(TINY);
    let (ok, stdout, stderr) = run(&args);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("calibration, median of 1 round(s): 1 rank"),
        "{stdout}"
    );
    // The round's line: its calibration, and each count predicted (with the wait for
    // the slowest rank) and measured.
    let round = stdout
        .lines()
        .find(|l| l.starts_with("round 1: 1 rank "))
        .unwrap_or_else(|| panic!("no round line: {stdout}"));
    for n in [2, 3] {
        assert!(
            round.contains(&format!("; {n} ranks predicted ")) && round.contains("stragglers"),
            "{round}"
        );
    }
    // The model assumed the node's cores (not the one core mpirun bound the calibration
    // rank to) and the calibration's one thread per rank, and says so.
    let cores = node_cores();
    assert!(
        stdout.contains(&format!(
            "{cores} cores shared by the ranks, 1 thread(s) each"
        )),
        "{stdout}"
    );
    // The runs' own tables stay out of the output; the rounds' lines say what they did.
    assert!(!stdout.contains("total words/s:"), "{stdout}");
    let rows: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for r in rows {
        assert_eq!(r["cores"].as_u64(), Some(cores as u64), "{r}");
        assert_eq!(r["threads_per_rank"].as_u64(), Some(1), "{r}");
        let three_on_fewer_cores = r["ranks"].as_u64() == Some(3) && cores < 3;
        assert_eq!(
            r["bottleneck"] == "shared cores",
            three_on_fewer_cores,
            "{r}"
        );
    }
    let table: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("| ranks | strategy | predicted"))
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(table.len(), 4, "{stdout}");
    assert!(table[2].starts_with("| 2 | replicated"), "{stdout}");
    assert!(table[3].starts_with("| 3 | replicated"), "{stdout}");
    let columns = table[0].matches('|').count();
    for row in &table[2..] {
        assert_eq!(row.matches('|').count(), columns, "{stdout}");
        assert!(row.contains(" % |"), "{stdout}");
    }
    let last = stdout.lines().last().unwrap();
    let value = last
        .strip_prefix("prediction error: max ")
        .and_then(|v| v.strip_suffix(" %"))
        .unwrap_or_else(|| panic!("last line: {last}"));
    assert!(value.parse::<f64>().is_ok(), "{last}");
}

#[test]
fn a_failed_later_round_keeps_the_table_of_the_rounds_before_it_and_leaves_no_report_behind() {
    // An mpirun that starts the first three runs (round 1 at `--np 2`: the calibration,
    // the link, 2 ranks) and the fourth (round 2's calibration), then refuses.
    let dir = tempfile::tempdir().unwrap();
    let count = dir.path().join("runs");
    let mpirun = dir.path().join("mpirun-four-times");
    std::fs::write(
        &mpirun,
        format!(
            "#!/bin/sh\nn=$(($(cat '{0}' 2>/dev/null || echo 0) + 1))\necho $n > '{0}'\n\
             if [ $n -gt 4 ]; then echo 'refusing run '$n >&2; exit 3; fi\nexec mpirun \"$@\"\n",
            count.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&mpirun, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let tmp = dir.path().join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let json = dir.path().join("validated.json");
    let mut args = vec![
        "predict",
        "--validate",
        "--rounds",
        "3",
        "--np",
        "2",
        "--mpirun",
        mpirun.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
        "--",
        "train",
    ];
    args.extend_from_slice(TINY);
    let mut cmd = ringtrain();
    cmd.args(&args).env("TMPDIR", &tmp);
    let out = output_within(cmd, LIMIT, "ringtrain predict --validate");
    let (stdout, stderr) = texts(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(std::fs::read_to_string(&count).unwrap().trim(), "5");
    // Round 1's line and its table come out, named as the rounds before the failure.
    assert!(stdout.contains("round 1: 1 rank "), "{stdout}");
    assert!(!stdout.contains("round 2:"), "{stdout}");
    assert!(
        stdout.contains("from the 1 round(s) before round 2, which failed:"),
        "{stdout}"
    );
    assert!(stdout.contains("| 2 | replicated"), "{stdout}");
    assert!(stdout.contains("prediction error: max "), "{stdout}");
    // The error is the failed run's, and --json (rows of whole validations) is left out.
    assert!(stderr.contains("the ranks failed"), "{stderr}");
    assert!(
        stderr.contains("--json not written: round 2 of 3 failed"),
        "{stderr}"
    );
    assert!(!json.exists());
    // No report of any run is left in the temporary directory.
    let left: Vec<String> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("ringtrain-predict"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn predict_draws_the_speedup_per_strategy_and_the_terms_of_the_largest_count() {
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("predict.svg");
    let report = data("predict-one-rank.json");
    let (ok, stdout, stderr) = run(&[
        "predict",
        "--report",
        report.to_str().unwrap(),
        "--link",
        "pcie4",
        "--np",
        "2,8",
        "--strategies",
        "replicated,independent",
        "--plot",
        plot.to_str().unwrap(),
    ]);
    assert!(ok, "{stdout}\n{stderr}");
    let svg = std::fs::read_to_string(&plot).unwrap();
    for text in [
        "predicted speedup",
        "independent (predicted)",
        "ideal (linear)",
        "predicted step, by term",
        "replicated, 8 ranks",
        "independent, 8 ranks",
        "bandwidth",
    ] {
        assert!(svg.contains(text), "the plot lacks `{text}`");
    }
    assert!(
        !svg.contains(", 2 ranks"),
        "bars only for the largest count"
    );
    // The plot is checked before any work, and --validate draws none.
    refused(
        &[
            "--report",
            report.to_str().unwrap(),
            "--link",
            "pcie4",
            "--plot",
            dir.path().to_str().unwrap(),
        ],
        &["--plot", "is a directory"],
    );
}
