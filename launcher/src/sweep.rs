//! `ringtrain sweep`: the same training at several rank counts, summarised in the seeds'
//! table (ranks | batch size | time for the timed batches | words/s | speedup).
//! When the runs have `--target-perplexity`, the table adds their time to quality: the
//! steps, words and time each rank count took to reach the held-out perplexity (training
//! time, and wall time with the evaluations), so that fixed total batch and fixed batch
//! per rank can be compared by how soon they reach a quality, not by words/s alone.
//!
//! With `--compare data,pipeline` each rank count runs twice, data-parallel and as a
//! pipeline of as many stages as ranks (`--pipeline-stages N` is added to the command,
//! which keeps its `--micro-batches`), and the sweep prints seed 004's comparison
//! (experiment, model, ranks, batch (micro-batches), throughput, speedup against the
//! data-parallel run at the first count) and its per-batch split (time per batch,
//! transfer time, backward time). Give the batch as `--total-batch-size` so that both
//! experiments train on the same batch: the data-parallel run splits it over the ranks,
//! the pipeline cuts it into micro-batches.
//!
//! With `--predict 8,64,1024` (and a link: `--bench`, `--link` or `--alpha-us` with
//! `--beta-ns-per-byte`) the scaling model of `ringtrain predict`, calibrated on the
//! sweep's 1-rank run, appends its rows for those counts, marked predicted (the ranks
//! cell says `(predicted: BOTTLENECK)`, the JSON row has `"predicted": true`).
//!
//! A `--timeline FILE` in the training command gives every run a file of its own:
//! `FILE` with `.np2` (or `.pipeline-np2` with `--compare`) before its extension.
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

    /// Draw the sweep into this SVG file (an existing one is replaced): speedup against
    /// ranks with the ideal line, beside the step's breakdown as a stacked bar per run.
    #[arg(long)]
    pub plot: Option<PathBuf>,

    /// Directory for each run's JSON report (default: the system temp directory).
    #[arg(long)]
    pub report_dir: Option<PathBuf>,

    /// Compare parallelisms at each rank count: `data,pipeline` runs each count as
    /// data-parallel replicas and as a pipeline of that many stages, and prints seed
    /// 004's comparison table and per-batch split instead of the scaling table.
    #[arg(long, value_delimiter = ',', value_parser = parse_experiment)]
    pub compare: Vec<Experiment>,

    /// Rank counts to predict after the measured ones, comma-separated, e.g. 8,64,1024:
    /// the scaling model of `ringtrain predict`, calibrated on the sweep's 1-rank run
    /// (`--np` must include 1) and the link of --bench, --link or --alpha-us with
    /// --beta-ns-per-byte. The rows are marked predicted.
    #[arg(long, value_delimiter = ',', value_parser = crate::positive_count)]
    pub predict: Vec<usize>,

    /// The link for --predict.
    #[command(flatten)]
    pub link: crate::predict::LinkArgs,

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
    /// `true` for a row of the scaling model (`--predict`), not a run.
    #[serde(default)]
    pub predicted: bool,
    /// The model's bottleneck term (predicted rows only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bottleneck: Option<String>,
}

/// One way to use the ranks, for `--compare`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Experiment {
    /// Data-parallel replicas.
    Data,
    /// One pipeline, a stage per rank.
    Pipeline,
}

fn parse_experiment(s: &str) -> std::result::Result<Experiment, String> {
    match s {
        "data" => Ok(Experiment::Data),
        "pipeline" => Ok(Experiment::Pipeline),
        other => Err(format!(
            "`{other}` is not an experiment: use data or pipeline"
        )),
    }
}

/// A row of seed 004's comparison table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareRow {
    /// `Dataparallel-2rank`, `Pipeline-2rank`.
    pub experiment: String,
    /// The model, as the run describes it.
    pub model: String,
    /// Ranks.
    pub ranks: usize,
    /// Examples per step over all ranks, with the micro-batches of a pipeline:
    /// `64(4 micro-batches)`.
    pub batch: String,
    /// Words/s over all ranks.
    pub throughput: f64,
    /// Throughput against the data-parallel run at the first rank count.
    pub speedup: f64,
    /// Seconds per timed batch.
    pub time_per_batch: f64,
    /// Seconds per batch moving data between ranks: gradient exchange (data), or
    /// waiting on neighbours' activations and gradients (pipeline, mean over stages).
    pub transfer_time: f64,
    /// Seconds per batch in backward (mean over ranks).
    pub backward_time: f64,
}

/// The comparison rows of `runs` (experiment and report, in run order).
pub fn compare_rows(runs: &[(Experiment, RunReport)]) -> Vec<CompareRow> {
    let base = runs
        .iter()
        .find(|(e, _)| *e == Experiment::Data)
        .map_or(0.0, |(_, r)| r.words_per_sec);
    runs.iter()
        .map(|(experiment, r)| {
            let (name, batch, transfer) = match (experiment, &r.pipeline) {
                (Experiment::Pipeline, Some(p)) => (
                    "Pipeline",
                    format!("{}({} micro-batches)", r.global_batch_size, p.micro_batches),
                    p.per_stage.iter().map(|s| s.wait).sum::<f64>()
                        / p.per_stage.len().max(1) as f64
                        + r.breakdown.communication,
                ),
                _ => (
                    "Dataparallel",
                    r.global_batch_size.to_string(),
                    r.breakdown.communication,
                ),
            };
            CompareRow {
                experiment: format!("{name}-{}rank", r.ranks),
                model: r.config.model.model.to_string(),
                ranks: r.ranks,
                batch,
                throughput: r.words_per_sec,
                speedup: if base > 0.0 {
                    r.words_per_sec / base
                } else {
                    0.0
                },
                time_per_batch: r.timed_seconds / r.timed_batches.max(1) as f64,
                transfer_time: transfer,
                backward_time: r.breakdown.backward,
            }
        })
        .collect()
}

/// Seed 004's two tables: the comparison, then the per-batch split.
pub fn compare_markdown(rows: &[CompareRow]) -> String {
    let mut s = String::from(
        "| Experiment | Model | Ranks | Batch size | Throughput (words/s) | Speed up |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.1}/s | {:.3}x |\n",
            r.experiment, r.model, r.ranks, r.batch, r.throughput, r.speedup
        ));
    }
    s.push_str(
        "\n| Train method | Ranks | Batch size | Time per batch (s) | Data transfer time (s) | Backward time (s) |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.4} | {:.4} | {:.4} |\n",
            r.experiment, r.ranks, r.batch, r.time_per_batch, r.transfer_time, r.backward_time
        ));
    }
    s
}

/// `command` for `experiment` at `np` ranks: data-parallel without the pipeline flags,
/// or a pipeline of `np` stages (its own `--pipeline-stages` replaced).
pub fn experiment_command(command: &[String], experiment: Experiment, np: usize) -> Vec<String> {
    let drop: &[&str] = match experiment {
        Experiment::Data => &[
            "--pipeline-stages",
            "--micro-batches",
            "--pipeline-schedule",
            "--pipeline-split",
        ],
        Experiment::Pipeline => &["--pipeline-stages", "--pipeline-split"],
    };
    let mut out = Vec::new();
    let mut skip = false;
    for a in command {
        if skip {
            skip = false;
            continue;
        }
        if drop.contains(&a.as_str()) {
            skip = true;
            continue;
        }
        if drop.iter().any(|d| a.starts_with(&format!("{d}="))) {
            continue;
        }
        out.push(a.clone());
    }
    if experiment == Experiment::Pipeline {
        out.push("--pipeline-stages".to_string());
        out.push(np.to_string());
    }
    out
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
                predicted: false,
                bottleneck: None,
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
        let ranks = if r.predicted {
            format!(
                "{} (predicted: {})",
                r.ranks,
                r.bottleneck.as_deref().unwrap_or("-")
            )
        } else {
            r.ranks.to_string()
        };
        s.push_str(&format!(
            "| {ranks} | {} | {:.3} | {:.1} | {:.2} |",
            r.batch_size, r.timed_seconds, r.words_per_sec, r.speedup
        ));
        if target.is_some() && r.predicted {
            s.push_str(" - | - | - | - |");
        } else if target.is_some() {
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

/// `command` with its `--timeline FILE` (if any) made the run's own: `FILE` with
/// `.LABEL` before its extension (`trace.json` → `trace.np2.json`), so that every run of
/// a sweep writes a timeline of its own instead of the second being refused.
pub fn with_run_timeline(command: &[String], label: &str) -> Vec<String> {
    let own = |path: &str| {
        let p = std::path::Path::new(path);
        let stem = p
            .file_stem()
            .map_or_else(|| "timeline".into(), |s| s.to_string_lossy().into_owned());
        let ext = p
            .extension()
            .map_or_else(|| "json".into(), |e| e.to_string_lossy().into_owned());
        p.with_file_name(format!("{stem}.{label}.{ext}"))
            .display()
            .to_string()
    };
    let mut out = Vec::with_capacity(command.len());
    let mut next_is_path = false;
    for a in command {
        if next_is_path {
            out.push(own(a));
            next_is_path = false;
        } else if a == "--timeline" {
            out.push(a.clone());
            next_is_path = true;
        } else if let Some(path) = a.strip_prefix("--timeline=") {
            out.push(format!("--timeline={}", own(path)));
        } else {
            out.push(a.clone());
        }
    }
    out
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
    if let Some(path) = &args.plot {
        check_output_file("--plot", path, "sweep.svg")?;
    }
    let link = predict_link(args)?;
    let dir = args.report_dir.clone().unwrap_or_else(std::env::temp_dir);
    let base_cmd = without_json_report(&args.command);
    if !args.compare.is_empty() {
        return run_compare(args, &exe, &base_cmd, &dir);
    }
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
        match run_count(args, &exe, &base_cmd, np, &report_path, &format!("np{np}")) {
            Ok(report) => reports.push(report),
            Err(e) => {
                failure = Some((np, e));
                break;
            }
        }
    }
    if !reports.is_empty() {
        let mut table = rows(&reports);
        if let Some(link) = link {
            table.extend(predicted_rows(&reports, &table, link, &args.predict)?);
        }
        print_rows(args, &table)?;
        let runs: Vec<(String, &RunReport)> = reports
            .iter()
            .map(|r| (r.config.model.model.to_string(), r))
            .collect();
        // The predicted rows continue the measured line from its last point.
        let predicted: Vec<(f64, f64)> = table
            .iter()
            .filter(|r| r.predicted)
            .map(|r| (r.ranks as f64, r.speedup))
            .collect();
        let extension = match (table.iter().rfind(|r| !r.predicted), predicted.is_empty()) {
            (Some(last), false) => std::iter::once((last.ranks as f64, last.speedup))
                .chain(predicted)
                .collect(),
            _ => Vec::new(),
        };
        write_plot(args, &runs, extension)?;
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

/// The link of `--predict`, checked before any run: `None` without `--predict`.
///
/// # Errors
/// [`LauncherError::InvalidValue`]: `--predict` without 1 in `--np`, with `--compare`, or
/// without exactly one link; a link without `--predict`; an unusable bench table.
fn predict_link(args: &SweepArgs) -> Result<Option<crate::predict::model::Network>> {
    let counts = args
        .predict
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    if args.predict.is_empty() {
        if args.link.given() {
            return Err(LauncherError::invalid(
                "--bench/--link/--alpha-us",
                "(given)",
                "a link is only used by --predict: add --predict 8,64,1024 or drop it",
            ));
        }
        return Ok(None);
    }
    if !args.compare.is_empty() {
        return Err(LauncherError::invalid(
            "--predict",
            counts,
            "cannot be combined with --compare; run `ringtrain predict` on a 1-rank report",
        ));
    }
    if !args.np.contains(&1) {
        return Err(LauncherError::invalid(
            "--predict",
            counts,
            "the model is calibrated on the sweep's 1-rank run: add 1 to --np",
        ));
    }
    Ok(Some(args.link.resolve()?.0))
}

/// The `--predict` rows: the model calibrated on the 1-rank report, for the strategy the
/// runs used; speedups against the table's first row, like the measured ones.
fn predicted_rows(
    reports: &[RunReport],
    measured: &[SweepRow],
    network: crate::predict::model::Network,
    counts: &[usize],
) -> Result<Vec<SweepRow>> {
    use crate::predict::{calibrate, model, strategy_of, ExchangeOverrides};
    let Some(one) = reports.iter().find(|r| r.ranks == 1) else {
        return Ok(Vec::new());
    };
    let profile = calibrate::profile_of(one, std::path::Path::new("(the sweep's 1-rank run)"))?;
    let strategy = strategy_of(one, &ExchangeOverrides::default());
    let base = measured.first().map_or(0.0, |r| r.words_per_sec);
    let base_ranks = measured.first().map_or(1, |r| r.ranks) as f64;
    let batches = one.timed_batches;
    Ok(counts
        .iter()
        .filter(|&&n| strategy.fits(n))
        .map(|&n| {
            // The predicted counts are machines larger than this one: a rank per core or GPU.
            let p = model::predict(&profile, network, &strategy, n, model::Sharing::NONE);
            let speedup = if base > 0.0 {
                p.words_per_sec / base
            } else {
                0.0
            };
            SweepRow {
                ranks: n,
                batch_size: one.batch_size_label(),
                timed_seconds: p.step_seconds * batches as f64,
                timed_batches: batches,
                words_per_sec: p.words_per_sec,
                speedup,
                efficiency: speedup * base_ranks / n as f64,
                time_to_quality: None,
                predicted: true,
                bottleneck: Some(p.bottleneck.to_string()),
            }
        })
        .collect())
}

/// `ringtrain sweep --compare`: every count, every experiment, then seed 004's tables
/// (of what finished, when a run fails).
fn run_compare(
    args: &SweepArgs,
    exe: &std::path::Path,
    base_cmd: &[String],
    dir: &std::path::Path,
) -> Result<()> {
    let mut runs = Vec::new();
    let mut failure = None;
    'counts: for &np in &args.np {
        for &experiment in &args.compare {
            let name = experiment_name(experiment);
            let report_path = dir.join(format!(
                "ringtrain-sweep-{}-{name}-np{np}.json",
                std::process::id()
            ));
            if runs.is_empty() {
                check_output_file("--report-dir", &report_path, "report.json")?;
            }
            let cmd = experiment_command(base_cmd, experiment, np);
            match run_count(args, exe, &cmd, np, &report_path, &format!("{name}-np{np}")) {
                Ok(report) => runs.push((experiment, report)),
                Err(e) => {
                    failure = Some((np, name, e));
                    break 'counts;
                }
            }
        }
    }
    if !runs.is_empty() {
        let rows = compare_rows(&runs);
        println!("\n{}", compare_markdown(&rows));
        let json =
            serde_json::to_string_pretty(&rows).map_err(|e| LauncherError::Bench(e.to_string()))?;
        println!("{json}");
        if let Some(path) = &args.json {
            ringtrain_train::outputs::write_atomically(
                path,
                (json + "\n").as_bytes(),
                "writing the sweep table",
            )?;
        }
        let plotted: Vec<(String, &RunReport)> = runs
            .iter()
            .map(|(e, r)| (experiment_name(*e).to_string(), r))
            .collect();
        write_plot(args, &plotted, Vec::new())?;
    }
    match failure {
        None => Ok(()),
        Some((np, name, e)) => {
            eprintln!(
                "ringtrain sweep: the {name} run at {np} ranks failed; the tables above hold \
                 the runs that finished"
            );
            Err(e)
        }
    }
}

/// The sweep's charts: speedup against ranks, a line per series (`runs` are
/// `(series, report)` in run order; speedups are against the first run), with the
/// ideal line and the `predicted` points (`(ranks, speedup)`, dashed; none without
/// `--predict`), and the step breakdown as a stacked bar per run.
pub fn charts(
    runs: &[(String, &RunReport)],
    predicted: Vec<(f64, f64)>,
) -> Vec<crate::plot::Chart> {
    use crate::plot::{breakdown_phases, Bar, Chart, Line};

    let base = runs.first().map_or(0.0, |(_, r)| r.words_per_sec);
    let mut lines: Vec<Line> = Vec::new();
    let mut bars = Vec::new();
    let mut phases = Vec::new();
    for (series, r) in runs {
        let speedup = if base > 0.0 {
            r.words_per_sec / base
        } else {
            0.0
        };
        let point = (r.ranks as f64, speedup);
        match lines.iter_mut().find(|l| &l.name == series) {
            Some(line) => line.points.push(point),
            None => lines.push(Line {
                name: series.clone(),
                points: vec![point],
                predicted: false,
            }),
        }
        let (names, parts) = breakdown_phases(&r.breakdown);
        phases = names;
        let ranks = match r.ranks {
            1 => "1 rank".to_string(),
            n => format!("{n} ranks"),
        };
        let label = if runs.iter().all(|(s, _)| s == series) {
            ranks
        } else {
            format!("{series}, {ranks}")
        };
        bars.push(Bar { label, parts });
    }
    if !predicted.is_empty() {
        lines.push(Line {
            name: "scaling model".to_string(),
            points: predicted,
            predicted: true,
        });
    }
    vec![
        Chart::Speedup {
            title: "speedup against ranks".to_string(),
            lines,
        },
        Chart::Breakdown {
            title: "step breakdown".to_string(),
            phases,
            bars,
        },
    ]
}

fn write_plot(
    args: &SweepArgs,
    runs: &[(String, &RunReport)],
    predicted: Vec<(f64, f64)>,
) -> Result<()> {
    if let Some(path) = &args.plot {
        crate::plot::write_svg("--plot", path, &charts(runs, predicted))?;
        println!("plot written to {}", path.display());
    }
    Ok(())
}

fn experiment_name(e: Experiment) -> &'static str {
    match e {
        Experiment::Data => "data",
        Experiment::Pipeline => "pipeline",
    }
}

/// One rank count: launches it and reads its report.
fn run_count(
    args: &SweepArgs,
    exe: &std::path::Path,
    base_cmd: &[String],
    np: usize,
    report_path: &std::path::Path,
    label: &str,
) -> Result<RunReport> {
    let mut command = with_run_timeline(base_cmd, label);
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
            predicted: false,
            bottleneck: None,
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
    fn every_run_of_a_sweep_gets_its_own_timeline_file() {
        let cmd: Vec<String> = [
            "train",
            "--timeline",
            "out/trace.json",
            "--timeline-steps",
            "2..3",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            with_run_timeline(&cmd, "np2"),
            [
                "train",
                "--timeline",
                "out/trace.np2.json",
                "--timeline-steps",
                "2..3"
            ]
        );
        let cmd = vec!["train".to_string(), "--timeline=trace".to_string()];
        assert_eq!(
            with_run_timeline(&cmd, "data-np4"),
            ["train", "--timeline=trace.data-np4.json"]
        );
        let plain = vec![
            "train".to_string(),
            "--threads".to_string(),
            "1".to_string(),
        ];
        assert_eq!(with_run_timeline(&plain, "np1"), plain);
    }

    #[test]
    fn predicted_rows_are_marked_in_markdown_and_json() {
        let mut p = row(8, None);
        p.predicted = true;
        p.bottleneck = Some("bandwidth".into());
        let table = markdown(&[row(1, None), p.clone()]);
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[2].starts_with("| 1 | 8 |"), "{table}");
        assert!(
            lines[3].starts_with("| 8 (predicted: bandwidth) |"),
            "{table}"
        );
        let json = serde_json::to_string(&p).unwrap_or_default();
        assert!(json.contains("\"predicted\":true"), "{json}");
        assert!(json.contains("\"bottleneck\":\"bandwidth\""), "{json}");
        let json = serde_json::to_string(&row(1, None)).unwrap_or_default();
        assert!(json.contains("\"predicted\":false") && !json.contains("bottleneck"));
    }

    #[test]
    fn compare_commands_add_or_drop_the_pipeline_flags() {
        let cmd: Vec<String> = [
            "train",
            "--micro-batches",
            "4",
            "--pipeline-stages=3",
            "--total-batch-size",
            "8",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            experiment_command(&cmd, Experiment::Data, 2),
            vec!["train", "--total-batch-size", "8"]
        );
        assert_eq!(
            experiment_command(&cmd, Experiment::Pipeline, 2),
            vec![
                "train",
                "--micro-batches",
                "4",
                "--total-batch-size",
                "8",
                "--pipeline-stages",
                "2"
            ]
        );
        assert!(parse_experiment("model").is_err());
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
