//! `ringtrain predict --validate`: calibrate on one rank here, predict the other counts,
//! run them, and print the error per row.
//!
//! Steps (each under mpirun, as `sweep` runs them): the training command on one rank with
//! `--json-report` (the profile); `bench allreduce` of the `auto` algorithm on 2 ranks,
//! from 4 KiB to the gradient's size (the link); the prediction of every count; the
//! training command at every count (the measurement). The command gets `--threads 1`
//! unless it sets `--threads`; the cores the ranks share and the threads per rank are
//! those the calibration run recorded (`--cores-per-node` overrides the cores), so that
//! ranks sharing the cores are part of the prediction ([`super::model::Sharing`]). Every run is
//! made `--rounds` times (default 3) and the fastest kept, as the `scaling` benchmark
//! does: other load on the machine only ever slows a run down.

use std::path::{Path, PathBuf};

use ringtrain_train::RunReport;
use serde::Serialize;

use super::{calibrate, model, sharing_of, strategy_of, PredictArgs};
use crate::error::{LauncherError, Result};
use crate::launch::{self, LaunchArgs, Machine};

/// The training command when none is given: a small NMT model, a few seconds a run.
pub const DEFAULT_COMMAND: &[&str] = &[
    "train",
    "--use-synthetic-data",
    "--num-units",
    "32",
    "--vocab-size",
    "400",
    "--src-max-len",
    "10",
    "--batch-size",
    "8",
    "--warmup-batches",
    "5",
    "--timed-batches",
    "40",
];

/// The rank counts `--validate` runs without `--np`.
pub const DEFAULT_COUNTS: &[usize] = &[2, 3];

/// One validated row.
#[derive(Debug, Clone, Serialize)]
pub struct ValidatedRow {
    /// Ranks.
    pub ranks: usize,
    /// The strategy.
    pub strategy: String,
    /// The model's words/s.
    pub predicted: f64,
    /// The run's words/s.
    pub measured: f64,
    /// (predicted - measured) / measured, percent.
    pub error_percent: f64,
    /// The model's bottleneck term.
    pub bottleneck: &'static str,
    /// The cores the model took the ranks to share (0: a core per rank).
    pub cores: usize,
    /// The threads per rank it took.
    pub threads_per_rank: usize,
}

/// The command with `--threads 1` added when it has no `--threads`, and without any
/// `--json-report` (each run gets its own).
pub fn prepared_command(command: &[String]) -> Vec<String> {
    let mut out: Vec<String> = if command.is_empty() {
        DEFAULT_COMMAND.iter().map(|s| s.to_string()).collect()
    } else {
        command.to_vec()
    };
    let mut kept = Vec::new();
    let mut skip = false;
    for a in out.drain(..) {
        if skip {
            skip = false;
            continue;
        }
        if a == "--json-report" {
            skip = true;
            continue;
        }
        if a.starts_with("--json-report=") {
            continue;
        }
        kept.push(a);
    }
    if !kept
        .iter()
        .any(|a| a == "--threads" || a.starts_with("--threads="))
    {
        kept.push("--threads".to_string());
        kept.push("1".to_string());
    }
    kept
}

fn launch_one(args: &PredictArgs, exe: &Path, np: usize, command: Vec<String>) -> Result<()> {
    let launch_args = LaunchArgs {
        np,
        hostfile: None,
        mpirun: args.mpirun.clone(),
        mpi_args: args.mpi_args.clone(),
        dry_run: false,
        command,
    };
    launch::execute(&launch::plan(&launch_args, Machine::current(), exe))
}

fn train_report(
    args: &PredictArgs,
    exe: &Path,
    command: &[String],
    np: usize,
    path: &Path,
) -> Result<RunReport> {
    let mut cmd = command.to_vec();
    cmd.push("--json-report".to_string());
    cmd.push(path.display().to_string());
    launch_one(args, exe, np, cmd)?;
    let report = RunReport::read_json(path)?;
    let _ = std::fs::remove_file(path);
    Ok(report)
}

/// The fastest of `--rounds` runs of `command` on `np` ranks.
fn fastest(
    args: &PredictArgs,
    exe: &Path,
    command: &[String],
    np: usize,
    path: &Path,
) -> Result<RunReport> {
    let mut best: Option<RunReport> = None;
    for _ in 0..args.rounds.max(1) {
        let report = train_report(args, exe, command, np, path)?;
        if best
            .as_ref()
            .is_none_or(|b| report.words_per_sec > b.words_per_sec)
        {
            best = Some(report);
        }
    }
    best.ok_or_else(|| LauncherError::Bench("no run finished".to_string()))
}

/// The rows as markdown, ending with the line `prediction error: max X %`.
pub fn markdown(rows: &[ValidatedRow]) -> String {
    let mut s = String::from(
        "| ranks | strategy | predicted words/s | measured words/s | error | bottleneck |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:+.1} % | {} |\n",
            r.ranks, r.strategy, r.predicted, r.measured, r.error_percent, r.bottleneck
        ));
    }
    let worst = rows
        .iter()
        .map(|r| r.error_percent.abs())
        .fold(0.0, f64::max);
    s.push_str(&format!("\nprediction error: max {worst:.1} %\n"));
    s
}

/// Runs the validation.
pub fn run(args: &PredictArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|source| LauncherError::Spawn {
        program: "ringtrain (own executable path)".to_string(),
        source,
    })?;
    let counts = if args.np.is_empty() {
        DEFAULT_COUNTS.to_vec()
    } else {
        args.np.clone()
    };
    let command = prepared_command(&args.command);
    if let Some(cores) = args.cores_per_node.filter(|&c| c > 0 && on_cuda(&command)) {
        // Refused before any run, as the calibration would refuse it after one.
        return Err(LauncherError::invalid(
            "--cores-per-node",
            cores,
            "the command trains on cuda, whose ranks compute on a GPU each and share no \
             cores; drop --cores-per-node",
        ));
    }
    let dir = std::env::temp_dir();
    let file = |name: &str| -> PathBuf {
        dir.join(format!(
            "ringtrain-predict-{}-{name}.json",
            std::process::id()
        ))
    };

    eprintln!("ringtrain predict: calibrating on 1 rank");
    let one_path = file("np1");
    let one = fastest(args, &exe, &command, 1, &one_path)?;
    let profile = calibrate::profile_of(&one, &one_path)?;

    let bench_path = file("bench");
    let max = (profile.gradient_bytes() as usize)
        .max(8192)
        .next_power_of_two();
    eprintln!("ringtrain predict: measuring the link on 2 ranks (4 KiB to {max} bytes)");
    let bench = vec![
        "bench".to_string(),
        "allreduce".to_string(),
        "--algorithms".to_string(),
        "auto".to_string(),
        "--min-bytes".to_string(),
        "4K".to_string(),
        "--max-bytes".to_string(),
        max.to_string(),
        "--step-factor".to_string(),
        "4".to_string(),
        "--iters".to_string(),
        "20".to_string(),
        "--small-tensors".to_string(),
        "0".to_string(),
        "--fusion-tensors".to_string(),
        "0".to_string(),
        "--json".to_string(),
        bench_path.display().to_string(),
    ];
    launch_one(args, &exe, 2, bench)?;
    let fit = calibrate::read_link(&bench_path, Some("auto"));
    let _ = std::fs::remove_file(&bench_path);
    let fit = fit?;
    // The calibration run recorded the cores of this machine, where every count runs.
    let (sharing, _) = sharing_of(&one, args.cores_per_node, true)?;
    let (cores, threads) = (sharing.cores, sharing.threads_per_rank);
    let strategy = strategy_of(&one, &args.exchange);
    println!(
        "calibration: 1 rank {:.1} words/s, compute {:.3} ms per step ({} gradient ranges, \
         {:.0} bytes); link `auto` on 2 ranks: alpha {:.2} us, {:.3} GB/s (worst bench row \
         {:.0} % off the fit); {cores} cores shared by the ranks, {threads} thread(s) each \
         (0 cores: a core per rank)",
        one.words_per_sec,
        profile.compute() * 1e3,
        profile.ready.len(),
        profile.gradient_bytes(),
        fit.link.alpha * 1e6,
        if fit.link.beta > 0.0 {
            1e-9 / fit.link.beta
        } else {
            f64::INFINITY
        },
        fit.max_relative_error * 100.0
    );
    let mut rows = Vec::new();
    for &n in &counts {
        let p = model::predict(&profile, fit.link, &strategy, n, sharing);
        eprintln!("ringtrain predict: measuring {n} ranks");
        if sharing.oversubscribed(n) {
            println!(
                "note: {n} ranks x {threads} thread(s) on {cores} cores: a step runs in {} \
                 waves of ranks (term `shared cores`)",
                sharing.waves(n)
            );
        }
        let measured = fastest(args, &exe, &command, n, &file(&format!("np{n}")))?;
        rows.push(ValidatedRow {
            ranks: n,
            strategy: p.strategy.clone(),
            predicted: p.words_per_sec,
            measured: measured.words_per_sec,
            error_percent: if measured.words_per_sec > 0.0 {
                (p.words_per_sec - measured.words_per_sec) / measured.words_per_sec * 100.0
            } else {
                0.0
            },
            bottleneck: p.bottleneck,
            cores,
            threads_per_rank: threads,
        });
    }
    if let Some(path) = &args.json {
        super::write_json(path, &rows)?;
    }
    print!("\n{}", markdown(&rows));
    Ok(())
}

/// Whether the command trains on cuda (`--device cuda`).
fn on_cuda(command: &[String]) -> bool {
    command
        .windows(2)
        .any(|w| w[0] == "--device" && w[1] == "cuda")
        || command.iter().any(|a| a == "--device=cuda")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_command_gets_one_thread_and_loses_its_report() {
        let c = prepared_command(&strings(&[
            "train",
            "--json-report",
            "x.json",
            "--seed",
            "1",
        ]));
        assert_eq!(c, strings(&["train", "--seed", "1", "--threads", "1"]));
        let c = prepared_command(&strings(&["train", "--threads=2"]));
        assert_eq!(c, strings(&["train", "--threads=2"]));
        assert_eq!(prepared_command(&[])[0], "train");
        assert!(on_cuda(&strings(&["train", "--device", "cuda"])));
        assert!(on_cuda(&strings(&["train", "--device=cuda"])));
        assert!(!on_cuda(&prepared_command(&[])));
    }

    #[test]
    fn the_table_ends_with_the_largest_error() {
        let row = |ranks, error_percent| ValidatedRow {
            ranks,
            strategy: "replicated".into(),
            predicted: 1.0,
            measured: 1.0,
            error_percent,
            bottleneck: "compute",
            cores: 2,
            threads_per_rank: 1,
        };
        let md = markdown(&[row(2, 3.0), row(3, -12.5)]);
        assert_eq!(md.lines().last(), Some("prediction error: max 12.5 %"));
    }
}
