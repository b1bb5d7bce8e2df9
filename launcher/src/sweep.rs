//! `ringtrain sweep`: the same training at several rank counts, summarised in the seeds'
//! table (ranks | batch size | time for the timed batches | words/s | speedup).
//! When the runs have `--target-perplexity`, the table adds their time to quality: the
//! steps, words and time each rank count took to reach the held-out perplexity (training
//! time, and wall time with the evaluations), so that fixed total batch and fixed batch
//! per rank can be compared by how soon they reach a quality, not by words/s alone.
//!
//! `--json` and `--report-dir` are checked before the first count runs. When a count
//! fails (or the sweep is stopped), the table of the counts that finished is printed
//! (and written to `--json`) before the error.

use std::path::PathBuf;

use clap::Args;
use ringtrain_train::{RunReport, TimeToQuality};
use serde::{Deserialize, Serialize};

use ringtrain_train::outputs::check_output_file;

use crate::error::{LauncherError, Result};
use crate::launch::{self, LaunchArgs, Machine};

/// `ringtrain sweep --np 1,2,4 -- train ...`
#[derive(Debug, Clone, Args)]
pub struct SweepArgs {
    /// Rank counts to run, comma-separated; speedups are relative to the first.
    #[arg(long = "np", value_delimiter = ',', required = true, value_parser = crate::positive_count)]
    pub np: Vec<usize>,

    /// Open MPI hostfile for multi-machine runs.
    #[arg(long)]
    pub hostfile: Option<PathBuf>,

    /// The mpirun program to run.
    #[arg(long, default_value = "mpirun", env = "RINGTRAIN_MPIRUN")]
    pub mpirun: String,

    /// Extra arguments passed to mpirun as they are.
    #[arg(long = "mpi-arg", allow_hyphen_values = true)]
    pub mpi_args: Vec<String>,

    /// Also write the table as JSON to this file (an existing one is replaced).
    #[arg(long)]
    pub json: Option<PathBuf>,

    /// Directory for each run's JSON report (default: the system temp directory).
    #[arg(long)]
    pub report_dir: Option<PathBuf>,

    /// The training command, after `--`, e.g. `-- train --use-synthetic-data`.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<String>,
}

/// One row of the sweep table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepRow {
    /// Ranks.
    pub ranks: usize,
    /// Batch size per rank (a range when uneven).
    pub batch_size: String,
    /// Wall time of the timed batches.
    pub timed_seconds: f64,
    /// Timed batches.
    pub timed_batches: usize,
    /// Words/s over all ranks.
    pub words_per_sec: f64,
    /// words/s relative to the first row.
    pub speedup: f64,
    /// words/s per rank relative to the first row's per rank (1.0 = linear scaling).
    pub efficiency: f64,
    /// When the run reached `--target-perplexity` (absent without a target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_to_quality: Option<TimeToQuality>,
}

/// Builds the rows from reports in run order.
pub fn rows(reports: &[RunReport]) -> Vec<SweepRow> {
    let base = reports.first().map_or(0.0, |r| r.words_per_sec);
    let base_ranks = reports.first().map_or(1, |r| r.ranks) as f64;
    reports
        .iter()
        .map(|r| {
            let speedup = if base > 0.0 {
                r.words_per_sec / base
            } else {
                0.0
            };
            SweepRow {
                ranks: r.ranks,
                batch_size: r.batch_size_label(),
                timed_seconds: r.timed_seconds,
                timed_batches: r.timed_batches,
                words_per_sec: r.words_per_sec,
                speedup,
                efficiency: speedup * base_ranks / r.ranks as f64,
                time_to_quality: r.time_to_quality,
            }
        })
        .collect()
}

/// The markdown table the seeds' reports use, with the time-to-quality columns when a
/// run had a target perplexity.
pub fn markdown(rows: &[SweepRow]) -> String {
    let batches = rows.first().map_or(0, |r| r.timed_batches);
    let target = rows
        .iter()
        .find_map(|r| r.time_to_quality.map(|q| q.target));
    let mut s = format!(
        "| ranks | batch size | total time for {batches} batches (s) | words/s | speedup |"
    );
    let mut rule = "|---|---|---|---|---|".to_string();
    if let Some(target) = target {
        s.push_str(&format!(
            " steps to perplexity {target} | words to {target} | training time to {target} (s) | time with evaluations (s) |"
        ));
        rule.push_str("---|---|---|---|");
    }
    s.push('\n');
    s.push_str(&rule);
    s.push('\n');
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {:.3} | {:.1} | {:.2} |",
            r.ranks, r.batch_size, r.timed_seconds, r.words_per_sec, r.speedup
        ));
        if target.is_some() {
            s.push_str(&quality_cells(r.time_to_quality.as_ref()));
        }
        s.push('\n');
    }
    s
}

/// The four time-to-quality cells of a row.
fn quality_cells(q: Option<&TimeToQuality>) -> String {
    match q {
        Some(TimeToQuality {
            reached: true,
            step: Some(step),
            words,
            training_seconds,
            seconds,
            ..
        }) => format!(
            " {step} | {:.0} | {:.3} | {:.3} |",
            words.unwrap_or(0.0),
            training_seconds.unwrap_or(0.0),
            seconds.unwrap_or(0.0)
        ),
        Some(q) => {
            let best = q
                .perplexity
                .map_or_else(|| "none".to_string(), |p| format!("{p:.2}"));
            format!(" not reached (best {best}) | - | - | - |")
        }
        None => " (no target) | - | - | - |".to_string(),
    }
}

/// Removes `--json-report X` / `--json-report=X` from a command (the sweep sets its own).
fn without_json_report(command: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in command {
        if skip {
            skip = false;
            continue;
        }
        if a == "--json-report" || a == "--json_report" {
            skip = true;
            continue;
        }
        if a.starts_with("--json-report=") || a.starts_with("--json_report=") {
            continue;
        }
        out.push(a.clone());
    }
    out
}

/// `ringtrain sweep`.
pub fn run(args: &SweepArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|source| LauncherError::Spawn {
        program: "ringtrain (own executable path)".to_string(),
        source,
    })?;
    if let Some(path) = &args.json {
        check_output_file("--json", path, "sweep.json")?;
    }
    let dir = args.report_dir.clone().unwrap_or_else(std::env::temp_dir);
    let base_cmd = without_json_report(&args.command);
    let mut reports = Vec::new();
    let mut failure = None;
    for &np in &args.np {
        let report_path = dir.join(format!(
            "ringtrain-sweep-{}-np{np}.json",
            std::process::id()
        ));
        if reports.is_empty() {
            check_output_file("--report-dir", &report_path, "report.json")?;
        }
        match run_count(args, &exe, &base_cmd, np, &report_path) {
            Ok(report) => reports.push(report),
            Err(e) => {
                failure = Some((np, e));
                break;
            }
        }
    }
    if !reports.is_empty() {
        print_rows(args, &rows(&reports))?;
    }
    match failure {
        None => Ok(()),
        Some((np, e)) => {
            let done: Vec<String> = reports.iter().map(|r| r.ranks.to_string()).collect();
            eprintln!(
                "ringtrain sweep: stopped at {np} ranks; {}",
                if done.is_empty() {
                    "no rank count finished".to_string()
                } else {
                    format!(
                        "the table above has the counts that finished ({})",
                        done.join(", ")
                    )
                }
            );
            Err(e)
        }
    }
}

/// One rank count: launches it and reads its report.
fn run_count(
    args: &SweepArgs,
    exe: &std::path::Path,
    base_cmd: &[String],
    np: usize,
    report_path: &std::path::Path,
) -> Result<RunReport> {
    let mut command = base_cmd.to_vec();
    command.push("--json-report".to_string());
    command.push(report_path.display().to_string());
    let launch_args = LaunchArgs {
        np,
        hostfile: args.hostfile.clone(),
        mpirun: args.mpirun.clone(),
        mpi_args: args.mpi_args.clone(),
        dry_run: false,
        command,
    };
    let plan = launch::plan(&launch_args, Machine::current(), exe);
    launch::execute(&plan)?;
    let report = RunReport::read_json(report_path)?;
    if args.report_dir.is_none() {
        let _ = std::fs::remove_file(report_path);
    }
    Ok(report)
}

/// Prints the table and its JSON, and writes the JSON to `--json`.
fn print_rows(args: &SweepArgs, rows: &[SweepRow]) -> Result<()> {
    println!("\n{}", markdown(rows));
    let json =
        serde_json::to_string_pretty(rows).map_err(|e| LauncherError::Bench(e.to_string()))?;
    println!("{json}");
    if let Some(path) = &args.json {
        ringtrain_train::outputs::write_atomically(
            path,
            (json + "\n").as_bytes(),
            "writing the sweep table",
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ranks: usize, q: Option<TimeToQuality>) -> SweepRow {
        SweepRow {
            ranks,
            batch_size: "8".into(),
            timed_seconds: 1.0,
            timed_batches: 4,
            words_per_sec: 100.0,
            speedup: 1.0,
            efficiency: 1.0,
            time_to_quality: q,
        }
    }

    #[test]
    fn time_to_quality_columns_appear_with_a_target() {
        let plain = markdown(&[row(1, None)]);
        assert!(!plain.contains("perplexity"), "{plain}");
        let json = serde_json::to_string(&row(1, None)).unwrap_or_default();
        assert!(!json.contains("time_to_quality"), "{json}");

        let reached = TimeToQuality {
            target: 50.0,
            reached: true,
            step: Some(120),
            perplexity: Some(48.5),
            words: Some(9000.0),
            training_seconds: Some(3.5),
            seconds: Some(4.25),
        };
        let missed = TimeToQuality::not_reached(50.0, Some(61.0));
        let table = markdown(&[row(1, Some(reached)), row(2, Some(missed))]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].contains("steps to perplexity 50"), "{table}");
        assert_eq!(lines[0].matches('|').count(), lines[1].matches('|').count());
        assert!(
            lines[2].contains("| 120 | 9000 | 3.500 | 4.250 |"),
            "{table}"
        );
        assert!(lines[3].contains("not reached (best 61.00)"), "{table}");
        let json = serde_json::to_string(&row(1, Some(reached))).unwrap_or_default();
        assert!(
            json.contains("\"time_to_quality\":{\"target\":50.0,\"reached\":true,\"step\":120"),
            "{json}"
        );
    }

    #[test]
    fn json_report_flags_are_replaced() {
        let cmd: Vec<String> = [
            "train",
            "--json-report",
            "a.json",
            "--seed",
            "3",
            "--json-report=b.json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(without_json_report(&cmd), vec!["train", "--seed", "3"]);
    }
}
