//! `ringtrain predict --validate`: calibrate on one rank here, predict the other counts,
//! run them, and print the error per row.
//!
//! Each of `--rounds` rounds (default 5) runs, under mpirun as `sweep` runs them, back to
//! back: the training command on one rank with `--json-report` (the profile); `bench
//! allreduce` of the `auto` algorithm on 2 ranks, from 4 KiB to the gradient's size (the
//! link); and the training command at every count (the measurement), each predicted from
//! that round's profile and link. A row compares the median prediction with the median
//! measurement over the rounds. Rounds, rather than all calibrations first, because the
//! machine moves under the runs: on a shared 2-core virtual machine the same 256 KiB
//! all-reduce took 45 µs in one run and 125 µs in the next, a few seconds later; and a
//! median set against a median drops the one round in five that other programs slowed.
//!
//! The command gets `--threads 1` unless it sets `--threads`; the cores the ranks share
//! and the threads per rank are those the calibration run recorded (`--cores-per-node`
//! overrides the cores), so that ranks sharing the cores are part of the prediction
//! ([`super::model::Sharing`]).
//!
//! The runs' reports go to a directory of their own under the system's temporary
//! directory, removed when the validation ends, however it ends. A round that fails after
//! others completed ends the validation with its error, after the table of the rounds
//! before it (which `--json` does not get: its rows are for whole validations).

use std::path::Path;

use ringtrain_train::throughput::median;
use ringtrain_train::RunReport;
use serde::Serialize;

use super::{calibrate, model, sharing_of, strategy_of, PredictArgs};
use crate::error::{LauncherError, Result};
use crate::launch::{self, LaunchArgs, Machine};

/// The training command when none is given: a small NMT model, under a second a run on
/// one rank, timing enough steps (500) that their spread, which the model's
/// stragglers term reads, is measured and not guessed from a handful.
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
    "500",
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
    // The runs' own tables would bury the rounds' lines: their reports say it all.
    let plan = launch::LaunchPlan {
        quiet: true,
        ..launch::plan(&launch_args, Machine::current(), exe)
    };
    launch::execute(&plan)
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
    Ok(RunReport::read_json(path)?)
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
    let reports = tempfile::Builder::new()
        .prefix("ringtrain-predict-")
        .tempdir()
        .map_err(|source| ringtrain_train::Error::Io {
            action: "creating a directory for the runs' reports in",
            path: std::env::temp_dir(),
            source,
        })?;

    // Each round calibrates, measures the link and runs every count back to back, so
    // that the machine's state (its other load, where its virtual cores sit) is the same
    // for a round's prediction and its measurement.
    let mut rounds: Vec<Round> = Vec::new();
    let mut shape = None;
    let mut failed = None;
    for round in 1..=args.rounds {
        match run_round(
            args,
            &exe,
            &command,
            &counts,
            round,
            reports.path(),
            &mut shape,
        ) {
            Ok(r) => {
                println!("{}", r.line(round));
                rounds.push(r);
            }
            Err(e) if !rounds.is_empty() => {
                failed = Some((round, e));
                break;
            }
            Err(e) => return Err(e),
        }
    }
    let (sharing, _) = shape.ok_or_else(|| LauncherError::Bench("no round ran".to_string()))?;
    let one: Vec<f64> = rounds.iter().map(|r| r.one).collect();
    let compute: Vec<f64> = rounds.iter().map(|r| r.profile.compute()).collect();
    let alpha: Vec<f64> = rounds.iter().map(|r| r.fit.link.alpha).collect();
    let bandwidth: Vec<f64> = rounds.iter().map(|r| r.fit.link.bandwidth()).collect();
    let first = &rounds[0].profile;
    println!(
        "calibration, median of {} round(s): 1 rank {:.1} words/s, compute {:.3} ms per \
         step ({} gradient ranges, {:.0} bytes); link `auto` on 2 ranks: alpha {:.2} us, \
         {:.3} GB/s; {} cores shared by the ranks, {} thread(s) each (0 cores: a core per \
         rank)",
        rounds.len(),
        median(&one),
        median(&compute) * 1e3,
        first.ready.len(),
        first.gradient_bytes(),
        median(&alpha) * 1e6,
        median(&bandwidth) / 1e9,
        sharing.cores,
        sharing.threads_per_rank,
    );
    let rows: Vec<ValidatedRow> = counts
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let of_count: Vec<&(model::Prediction, f64)> =
                rounds.iter().map(|r| &r.counted[i]).collect();
            let predicted = median(
                &of_count
                    .iter()
                    .map(|c| c.0.words_per_sec)
                    .collect::<Vec<_>>(),
            );
            let measured = median(&of_count.iter().map(|c| c.1).collect::<Vec<_>>());
            // The bottleneck of the round whose prediction lies nearest the median.
            let nearest = of_count
                .iter()
                .min_by(|a, b| {
                    (a.0.words_per_sec - predicted)
                        .abs()
                        .total_cmp(&(b.0.words_per_sec - predicted).abs())
                })
                .map(|c| &c.0);
            ValidatedRow {
                ranks: n,
                strategy: nearest.map(|p| p.strategy.clone()).unwrap_or_default(),
                predicted,
                measured,
                error_percent: if measured > 0.0 {
                    (predicted - measured) / measured * 100.0
                } else {
                    0.0
                },
                bottleneck: nearest.map_or("compute", |p| p.bottleneck),
                cores: sharing.cores,
                threads_per_rank: sharing.threads_per_rank,
            }
        })
        .collect();
    if let Some((round, e)) = failed {
        print!(
            "\nfrom the {} round(s) before round {round}, which failed:\n{}",
            rounds.len(),
            markdown(&rows)
        );
        if args.json.is_some() {
            eprintln!(
                "ringtrain predict: --json not written: round {round} of {} failed",
                args.rounds
            );
        }
        return Err(e);
    }
    if let Some(path) = &args.json {
        super::write_json(path, &rows)?;
    }
    print!("\n{}", markdown(&rows));
    Ok(())
}

/// Runs round `round`: the calibration, the link, and every count predicted and
/// measured, each run's report a file in `dir`. The first round fixes `shape` (the cores
/// the ranks share and the strategy), from its calibration run.
fn run_round(
    args: &PredictArgs,
    exe: &Path,
    command: &[String],
    counts: &[usize],
    round: usize,
    dir: &Path,
    shape: &mut Option<(model::Sharing, model::Strategy)>,
) -> Result<Round> {
    eprintln!(
        "ringtrain predict: round {round} of {}: calibrating on 1 rank",
        args.rounds
    );
    let one_path = dir.join("np1.json");
    let one = train_report(args, exe, command, 1, &one_path)?;
    let profile = calibrate::profile_of(&one, &one_path)?;
    let fit = measure_link(args, exe, &profile, &dir.join("bench.json"))?;
    let (sharing, strategy) = match shape {
        Some(s) => *s,
        None => {
            // The calibration run recorded the cores of this machine, where every count
            // runs.
            let (sharing, _) = sharing_of(&one, args.cores_per_node, true)?;
            let s = (sharing, strategy_of(&one, &args.exchange));
            *shape = Some(s);
            for &n in counts {
                if sharing.oversubscribed(n) {
                    println!(
                        "note: {n} ranks x {} thread(s) on {} cores: a step runs in {} \
                         waves of ranks (term `shared cores`)",
                        sharing.threads_per_rank,
                        sharing.cores,
                        sharing.waves(n)
                    );
                }
            }
            s
        }
    };
    let mut counted = Vec::new();
    for &n in counts {
        eprintln!("ringtrain predict: round {round}: measuring {n} ranks");
        let predicted = model::predict(&profile, fit.link, &strategy, n, sharing);
        let measured = train_report(args, exe, command, n, &dir.join(format!("np{n}.json")))?;
        counted.push((predicted, measured.words_per_sec));
    }
    Ok(Round {
        one: one.words_per_sec,
        profile,
        fit,
        counted,
    })
}

/// One round: the calibration, the link, and each count's prediction and measured
/// words/s.
struct Round {
    one: f64,
    profile: model::Profile,
    fit: calibrate::Fit,
    counted: Vec<(model::Prediction, f64)>,
}

impl Round {
    /// The round's line: its calibration, its link and each count's figures.
    fn line(&self, round: usize) -> String {
        let mut s = format!(
            "round {round}: 1 rank {:.1} words/s, link alpha {:.2} us {:.3} GB/s",
            self.one,
            self.fit.link.alpha * 1e6,
            self.fit.link.bandwidth() / 1e9
        );
        for (p, measured) in &self.counted {
            s.push_str(&format!(
                "; {} ranks predicted {:.1} (stragglers {:.0} us), measured {:.1}",
                p.ranks,
                p.words_per_sec,
                p.terms.stragglers * 1e6,
                measured
            ));
        }
        s
    }
}

/// Fits the link to `bench allreduce` of the `auto` algorithm on 2 ranks, from 4 KiB to
/// the gradient's size.
fn measure_link(
    args: &PredictArgs,
    exe: &Path,
    profile: &model::Profile,
    path: &Path,
) -> Result<calibrate::Fit> {
    let max = (profile.gradient_bytes() as usize)
        .max(8192)
        .next_power_of_two();
    eprintln!("ringtrain predict: measuring the link on 2 ranks (4 KiB to {max} bytes)");
    let mut bench: Vec<String> = [
        "bench",
        "allreduce",
        "--algorithms",
        "auto",
        "--min-bytes",
        "4K",
        "--step-factor",
        "4",
        "--iters",
        "20",
        "--small-tensors",
        "0",
        "--fusion-tensors",
        "0",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    bench.extend([
        "--max-bytes".to_string(),
        max.to_string(),
        "--json".to_string(),
        path.display().to_string(),
    ]);
    launch_one(args, exe, 2, bench)?;
    calibrate::read_link(path, Some("auto"))
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
