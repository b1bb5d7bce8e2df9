//! End to end under mpirun: `ringtrain launch` at 2 and 3 ranks and `ringtrain sweep`,
//! checking the printed table and the JSON report.

mod support;

use std::process::Output;

fn ringtrain(args: &[String]) -> Output {
    support::with_mpi_env(env!("CARGO_BIN_EXE_ringtrain"))
        .args(args)
        .output()
        .expect("the ringtrain binary runs")
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

const TINY: &[&str] = &[
    "--num-units",
    "8",
    "--vocab-size",
    "60",
    "--src-max-len",
    "5",
    "--warmup-batches",
    "2",
    "--timed-batches",
    "3",
    "--threads",
    "1",
];

fn launch(np: usize, extra: &[&str], report: &std::path::Path) -> (String, serde_json::Value) {
    let mut args = strings(&["launch", "--np", &np.to_string(), "--", "train"]);
    args.extend(strings(TINY));
    args.extend(strings(extra));
    args.push("--json-report".into());
    args.push(report.display().to_string());
    let out = ringtrain(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "launch --np {np} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stderr.contains("mpirun -np"),
        "launch prints the command it runs: {stderr}"
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(report).unwrap()).unwrap();
    (stdout, json)
}

#[test]
fn two_ranks_replicated_print_the_table_and_write_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r2.json");
    let (stdout, json) = launch(2, &["--batch-size", "4"], &report);
    assert!(
        stdout.contains("| ranks | batch size | total time for 3 batches (s) | words/s |"),
        "{stdout}"
    );
    assert!(stdout.contains("| 2 | 4 |"), "{stdout}");
    assert!(
        stdout
            .trim_end()
            .lines()
            .last()
            .unwrap()
            .starts_with("total words/s:"),
        "{stdout}"
    );
    assert_eq!(json["ranks"], 2);
    assert_eq!(json["timed_batches"], 3);
    let per_rank = json["per_rank"].as_array().unwrap();
    assert_eq!(per_rank.len(), 2);
    // words = source + target over all ranks: 2 ranks x 4 x (5 + 5) per batch, 3 timed batches
    assert_eq!(
        json["timed_words"].as_f64().unwrap(),
        2.0 * 4.0 * 10.0 * 3.0
    );
    let total = json["words_per_sec"].as_f64().unwrap();
    let sum: f64 = per_rank.iter().map(|r| r["words"].as_f64().unwrap()).sum();
    assert_eq!(sum, 240.0);
    assert!(total > 0.0);
    for key in [
        "data_wait",
        "forward",
        "backward",
        "communication",
        "optimizer",
    ] {
        assert!(
            json["breakdown"][key].as_f64().is_some(),
            "breakdown lacks {key}"
        );
    }
    assert!(json["launches_per_batch"].as_f64().unwrap() > 0.0);
    assert_eq!(json["config"]["variable_update"], "replicated");
}

#[test]
fn three_ranks_uneven_total_batch_and_parameter_server() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r3.json");
    let (stdout, json) = launch(3, &["--total-batch-size", "10"], &report);
    assert!(stdout.contains("| 3 | 3-4 |"), "{stdout}");
    let sizes: Vec<u64> = json["per_rank"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["batch_size"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, vec![4, 3, 3]);
    assert_eq!(json["global_batch_size"], 10);

    let report = dir.path().join("ps.json");
    let (_, json) = launch(
        3,
        &[
            "--batch-size",
            "2",
            "--variable-update",
            "parameter_server",
            "--ps-ranks",
            "1",
        ],
        &report,
    );
    assert_eq!(json["workers"], 2);
    assert_eq!(json["per_rank"][2]["batch_size"], 0);
    assert!(json["final_loss"].as_f64().unwrap().is_finite());
}

#[test]
fn sweep_prints_the_seeds_table_and_json() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("sweep.json");
    let plot_path = dir.path().join("sweep.svg");
    let mut args = strings(&[
        "sweep",
        "--np",
        "1,2",
        "--json",
        &json_path.display().to_string(),
        "--plot",
        &plot_path.display().to_string(),
        "--",
        "train",
    ]);
    args.extend(strings(TINY));
    args.extend(strings(&[
        "--batch-size",
        "2",
        "--variable-update",
        "independent",
        "--timeline",
    ]));
    args.push(dir.path().join("trace.json").display().to_string());
    let out = ringtrain(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout
            .contains("| ranks | batch size | total time for 3 batches (s) | words/s | speedup |"),
        "{stdout}"
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["ranks"], 1);
    assert_eq!(rows[1]["ranks"], 2);
    assert_eq!(rows[0]["speedup"].as_f64().unwrap(), 1.0);
    assert!(rows[1]["speedup"].as_f64().unwrap() > 0.0);
    assert!(
        stdout.contains("| 1 | 2 |") && stdout.contains("| 2 | 2 |"),
        "{stdout}"
    );
    // The plot: the speedup chart (measured points, the ideal line) beside the
    // breakdown's stacked bars, one per rank count.
    let svg = std::fs::read_to_string(&plot_path).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
    for text in [
        "speedup against ranks",
        "ideal (linear)",
        "step breakdown",
        "1 rank",
        "2 ranks",
        "backward",
    ] {
        assert!(svg.contains(text), "the plot lacks `{text}`");
    }
    assert_eq!(svg.matches("<circle").count(), 2, "a point per rank count");
    // Every run wrote a timeline of its own.
    for np in [1, 2] {
        let trace = dir.path().join(format!("trace.np{np}.json"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        assert!(
            v["traceEvents"].as_array().is_some_and(|e| !e.is_empty()),
            "{trace:?}"
        );
    }
}

#[test]
fn ranks_started_with_different_output_flags_name_each_flag_and_value() {
    let dir = tempfile::tempdir().unwrap();
    let rank_args = |checkpoint: &str, display: &str| {
        let mut args = strings(&["-np", "1", env!("CARGO_BIN_EXE_ringtrain"), "train"]);
        args.extend(strings(TINY));
        args.extend(strings(&["--display-every", display, "--checkpoint"]));
        args.push(dir.path().join(checkpoint).display().to_string());
        args
    };
    let mut args = rank_args("a.ckpt", "1");
    args.push(":".into());
    args.extend(rank_args("b.ckpt", "1"));
    let out = support::with_mpi_env("mpirun")
        .args(&args)
        .output()
        .expect("mpirun runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("ranks were started with different flags: --checkpoint: rank 0 = ")
            && stderr.contains("a.ckpt\", rank 1 = ")
            && stderr.contains("b.ckpt"),
        "{stderr}"
    );
    assert!(!stderr.contains("--display-every"), "{stderr}");
    assert!(!stderr.contains("MPI_ERR"), "{stderr}");
    assert!(
        !dir.path().join("a.ckpt").exists() && !dir.path().join("b.ckpt").exists(),
        "nothing was trained or written"
    );
}

/// Under mpirun, `--eval-data` and `--target-perplexity` reach the JSON report (`eval`
/// entries, `time_to_quality`) and the sweep's time-to-quality columns: the first
/// evaluation (step 2) reaches a target every model reaches, on every rank count.
#[test]
fn sweep_with_a_target_perplexity_reports_time_to_quality() {
    let corpus = ringtrain_data::BundledCorpus::in_repo();
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("sweep.json");
    let reports = dir.path().join("reports");
    std::fs::create_dir(&reports).unwrap();
    let mut args = strings(&[
        "sweep",
        "--np",
        "1,2",
        "--json",
        &json_path.display().to_string(),
        "--report-dir",
        &reports.display().to_string(),
        "--",
        "train",
    ]);
    args.extend(strings(TINY));
    args.extend(strings(&[
        "--model",
        "rnnlm",
        "--batch-size",
        "4",
        "--eval-every",
        "2",
        "--target-perplexity",
        "1e9",
        "--data",
    ]));
    args.push(format!(
        "{},{}",
        corpus.lm_train.display(),
        corpus.lm_vocab.display()
    ));
    args.push("--eval-data".into());
    args.push(corpus.lm_valid.display().to_string());
    let out = ringtrain(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("steps to perplexity 1000000000")
            && stdout.contains("eval\tstep 2")
            && stdout.contains("reached at step 2"),
        "{stdout}"
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    for row in rows.as_array().unwrap() {
        let q = &row["time_to_quality"];
        assert_eq!(q["reached"], true, "{row}");
        assert_eq!(q["step"], 2, "{row}");
        assert!(q["words"].as_f64().unwrap() > 0.0, "{row}");
    }
    let mut seen = 0;
    for entry in std::fs::read_dir(&reports).unwrap() {
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(entry.unwrap().path()).unwrap()).unwrap();
        let eval = report["eval"].as_array().unwrap();
        assert_eq!(eval.len(), 1, "{report}");
        for key in ["step", "loss", "perplexity", "seconds"] {
            assert!(eval[0][key].is_number(), "{key}: {report}");
        }
        assert_eq!(report["steps"], 2);
        seen += 1;
    }
    assert_eq!(seen, 2);
}

#[test]
fn two_pipeline_stages_under_mpirun_report_the_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("pipeline.json");
    let (stdout, json) = launch(
        2,
        &[
            "--batch-size",
            "6",
            "--pipeline-stages",
            "2",
            "--micro-batches",
            "3",
            "--pipeline-schedule",
            "1f1b",
        ],
        &report,
    );
    assert!(
        stdout.contains("pipeline: 2 stages x 3 micro-batches (1f1b)")
            && stdout.contains("25.0% by (K-1)/(M+K-1)")
            && stdout.contains("balanced by parameter count"),
        "{stdout}"
    );
    assert!(
        stdout.contains("stage 1 (target embedding + decoder layer 0, decoder layer 1, projection + loss): compute"),
        "{stdout}"
    );
    let p = &json["pipeline"];
    assert_eq!(p["stages"], 2);
    assert_eq!(p["micro_batches"], 3);
    assert_eq!(p["schedule"], "1f1b");
    assert!((p["bubble_formula"].as_f64().unwrap() - 0.25).abs() < 1e-12);
    let bubble = p["bubble_fraction"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&bubble), "{bubble}");
    // One replica of 6 sentences of 5 + 5 words per batch, counted once, 3 timed batches.
    assert_eq!(json["timed_words"].as_f64().unwrap(), 6.0 * 10.0 * 3.0);
    assert!(json["final_loss"].as_f64().unwrap() > 0.0);
}

#[test]
fn sweep_compares_data_parallel_with_a_pipeline_at_the_same_rank_count() {
    let dir = tempfile::tempdir().unwrap();
    let json_path = dir.path().join("compare.json");
    let plot_path = dir.path().join("compare.svg");
    let mut args = strings(&[
        "sweep",
        "--np",
        "2",
        "--compare",
        "data,pipeline",
        "--json",
        &json_path.display().to_string(),
        "--plot",
        &plot_path.display().to_string(),
        "--",
        "train",
    ]);
    args.extend(strings(TINY));
    args.extend(strings(&[
        "--total-batch-size",
        "4",
        "--micro-batches",
        "2",
    ]));
    let out = ringtrain(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(
            "| Experiment | Model | Ranks | Batch size | Throughput (words/s) | Speed up |"
        ) && stdout.contains("| Train method | Ranks | Batch size | Time per batch (s) | Data transfer time (s) | Backward time (s) |"),
        "{stdout}"
    );
    assert!(
        stdout.contains("| Dataparallel-2rank | nmt | 2 | 4 |")
            && stdout.contains("| Pipeline-2rank | nmt | 2 | 4(2 micro-batches) |"),
        "{stdout}"
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["speedup"].as_f64().unwrap(), 1.0);
    for row in rows {
        for key in [
            "throughput",
            "time_per_batch",
            "transfer_time",
            "backward_time",
        ] {
            assert!(row[key].as_f64().unwrap() >= 0.0, "{key}: {row}");
        }
    }
    assert!(rows[1]["throughput"].as_f64().unwrap() > 0.0);
    let svg = std::fs::read_to_string(&plot_path).unwrap();
    for text in ["data, 2 ranks", "pipeline, 2 ranks", "communication"] {
        assert!(svg.contains(text), "the plot lacks `{text}`");
    }
}

#[test]
fn two_ranks_write_one_timeline_with_both_ranks_rows() {
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("r.json");
    let trace = dir.path().join("trace.json");
    let trace_arg = trace.display().to_string();
    launch(
        2,
        &[
            "--batch-size",
            "4",
            "--overlap-backward",
            "on",
            "--timeline",
            &trace_arg,
            "--timeline-steps",
            "2..4",
        ],
        &report,
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    for rank in 0..2u64 {
        let mut steps: Vec<&str> = events
            .iter()
            .filter(|e| e["pid"] == rank && e["cat"] == "step")
            .filter_map(|e| e["name"].as_str())
            .collect();
        steps.sort_unstable();
        assert_eq!(steps, ["step 2", "step 3", "step 4"], "rank {rank}");
        for phase in ["forward", "backward", "all_reduce"] {
            assert!(
                events
                    .iter()
                    .any(|e| e["pid"] == rank && e["name"] == phase),
                "rank {rank} lacks {phase}"
            );
        }
    }
    for e in events.iter().filter(|e| e["ph"] == "X") {
        for field in ["name", "cat", "ts", "dur", "pid", "tid"] {
            assert!(!e[field].is_null(), "{field} missing: {e}");
        }
    }
    let sync = &json["otherData"]["clock_sync"];
    assert_eq!(sync["offsets_us"].as_array().map(Vec::len), Some(2));
    // No file of another rank, and no temporary file, is left beside it.
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}
