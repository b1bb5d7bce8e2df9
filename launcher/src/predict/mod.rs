//! `ringtrain predict`: a scaling model that says what N ranks would do, calibrated from
//! what was measured here or from a described machine.
//!
//! ```text
//! ringtrain train --json-report one.json ...             # one rank: the compute profile
//! ringtrain launch --np 2 -- bench allreduce --json ar.json   # the link's alpha and beta
//! ringtrain predict --report one.json --bench ar.json --np 8,64,1024
//! ringtrain predict --report one.json --link ib-ndr --np 8,64,1024
//! ringtrain predict --validate                           # predict 2 and 3 ranks, measure them
//! ringtrain predict --seeds                              # the seeds' 8 x P100 tables
//! ```
//!
//! # Calibration
//!
//! - **Compute**, from a 1-rank `train --json-report`: the mean step's data wait,
//!   forward, backward and optimizer seconds, the words per step, and `gradient_ready`:
//!   each gradient range backward handed to the exchange, its size and when (seconds
//!   after backward began); and `compute_quantiles`: the step's compute at the 0th to
//!   100th percentile over the timed steps, how much one rank's step varies.
//! - **Link**, either fitted to a `bench allreduce --json` table (the rows of one
//!   algorithm, `auto` when measured, else `ring`, on 2 ranks or more; least squares of
//!   the ring formula below on the relative error, so that small sizes fix alpha and
//!   large ones beta), or described: `--link` presets with their published bandwidths
//!   and latencies ([`links`]), or `--alpha-us A --beta-ns-per-byte B`.
//!
//! # The model
//!
//! For N ranks, alpha the latency per message, beta the seconds per byte, G the f32
//! gradient bytes (halved by `--fp16-gradients`), C = data + forward + backward +
//! optimizer of one rank:
//!
//! - ring all-reduce of B bytes: `ring(N, B) = 2(N-1)/N * B * beta + 2(N-1) * alpha`;
//!   on a machine of nodes of K ranks (`--ranks-per-node`, `--node-link`) over the slower
//!   of the two links once N > K, or with `--allreduce-algorithm hier` the hierarchical
//!   all-reduce, `ring_within(K, B) + ring_across(N/K, B/K)` ([`model::Network`]), whose
//!   step across takes `beta * K / nics` when the K ranks of a node share fewer NICs
//!   (`--nics-per-node`);
//! - **replicated**, repacking R: `C + R * ring(N, G/R)`; after backward: `C + sum of
//!   ring(N, b)` over the fusion buffers b (consecutive ranges joined up to the fusion
//!   threshold); overlapped: the fusion engine wakes every cycle time, fuses the ranges
//!   ready by then and reduces them one buffer after another while backward runs; at the
//!   end of backward the rest goes at once; the step is `C + max(0, end of the last
//!   reduction - end of backward)`;
//! - **parameter_server** with K servers (K = 0: a shard on every rank): tensors placed
//!   greedily on the least loaded server as the strategy does; a server of load L and W
//!   workers besides itself takes W*L in and sends W*L out: `2 W L beta + 2 W T alpha`
//!   for its T tensors; the busiest server is the term ("server link"), and each server
//!   updates only its own tensors; N - K ranks train;
//! - **independent**: `C`;
//! - **pipeline** K stages x D replicas (N = K D), M micro-batches: a stage computes
//!   (forward + backward)/K, plus the bubble `(forward + backward)/K * (K-1)/M` (a
//!   fraction `(K-1)/(M+K-1)` of the stage's time), plus its boundary traffic
//!   `2M (alpha + A/M * beta)` with A = batch x sequence length x units x 4 bytes, plus
//!   the all-reduce of its G/K over the D replicas after backward; D replicas train.
//!
//! A synchronised step (every strategy but independent) also waits for its slowest
//! rank: **stragglers** is `E[max of W draws] - mean`, W the training ranks, each rank's
//! step drawn independently from the 1-rank run's distribution (its quantiles, linear
//! between them: `integral of Q(u) W u^(W-1) du`); a pipeline stage's is 1/K of it.
//! Ranks that run in waves on shared cores (below) wait once per wave, for the slowest
//! of that wave. It grows with W but never past the slowest step the calibration saw
//! less the mean; a profile without quantiles (the seeds', older reports) predicts
//! none. On the 2-core machine of the `--validate` figures in README, the 1-rank steps
//! of 0.8 ms spread by 0.13 ms (standard deviation) and the term came to 18–94 µs at 2
//! ranks, where 2-rank timelines showed the slower rank 71–96 µs behind the mean of the
//! two.
//!
//! words/s = training ranks x words per step / step; speedup = words/s / the 1-rank
//! words/s of the profile; efficiency = speedup / N. The bottleneck is the largest term:
//! compute, stragglers, bandwidth, latency, bubble, server link, stage link, shared
//! cores ([`model::Terms::named`]).
//!
//! **Shared cores.** The model describes the machine it predicts: the cores (hardware
//! threads) of the node its ranks share, and the threads each rank computes with. A
//! run's report records both (`host`: the node's online cores, whatever mpirun bound
//! the rank to, and the rank's `--threads`); with a link measured here (`--bench`,
//! `--validate`) the calibration run's node is the machine predicted; a described link
//! (`--link`, `--alpha-us`) is a machine with a core or GPU per rank; a cuda run
//! computes on its GPUs and shares no cores; `--cores-per-node C` says it (0: none).
//! When N ranks of T threads want more than the C cores, a synchronised step (replicated,
//! parameter servers, pipeline) runs in waves: it ends only when every rank has computed
//! and reduced, and a rank waiting for the others polls MPI on its core, so the
//! scheduler does not interleave ranks within a step; whole ranks run `floor(C / T)` at
//! a time, `W = ceil(N / floor(C / T))` waves (N when one rank has more threads than
//! cores). The term **shared cores** is `(W - 1) x` the rest of the step, the reduction's
//! own CPU work included. Independent ranks never wait for each other and time-share:
//! `(max(1, N T / C) / max(1, T / C) - 1) x compute`. Measured on a 2-core machine, 3
//! ranks of the `--validate` model ran forward and backward at their 1-rank speed and
//! spent the difference waiting in the all-reduce: whole ranks in turns, not a
//! fine-grained share of 1.5x.
//!
//! # Limits
//!
//! The model knows what the report measured, the link and the node's cores; it does
//! not know contention beyond the cores (memory bandwidth and caches shared by ranks on
//! one node: on the 2-core machine two independent ranks computed 0–9 % slower than
//! one alone; other programs on a busy machine), ranks whose steps vary together rather
//! than independently, the scheduler's own cost of switching ranks that share cores (they yield
//! in MPI while they wait), a pipeline's uneven stages (it assumes equal ones) or how a
//! stage's steps vary (it takes 1/K of the whole model's spread, as if the spread were
//! spread over the layers; noise of the whole step, such as a pre-empted core, would not
//! shrink, and independent noise per layer would shrink only as 1/sqrt(K)), or another
//! framework's overheads (see [`seeds`]).

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use crate::error::{LauncherError, Result};

pub mod calibrate;
pub mod links;
pub mod model;
pub mod seeds;
mod validate;

use model::{Exchange, Link, Network, Nodes, Prediction, Profile, Sharing, Strategy};

/// Where the link's alpha and beta come from (shared by `predict` and `sweep --predict`).
#[derive(Debug, Clone, Default, Args)]
pub struct LinkArgs {
    /// A `bench allreduce --json` table to fit alpha and beta to.
    #[arg(long)]
    pub bench: Option<PathBuf>,
    /// The algorithm of the bench table to fit (default: auto when measured, else ring).
    #[arg(long)]
    pub algorithm: Option<String>,
    /// A described link: nvlink-h100, pcie4, pcie5, ib-hdr, ib-ndr, p100-pcie.
    #[arg(long, value_parser = links::preset)]
    pub link: Option<links::Preset>,
    /// Latency per message in microseconds (with --beta-ns-per-byte).
    #[arg(long)]
    pub alpha_us: Option<f64>,
    /// Nanoseconds per byte, 1 / bandwidth (with --alpha-us): 0.1 is 10 GB/s.
    #[arg(long)]
    pub beta_ns_per_byte: Option<f64>,
    /// Ranks per node, for a machine of nodes (with --node-link): the link above is then
    /// the one between nodes, a link per rank (a NIC per GPU) unless --nics-per-node says
    /// fewer; rank counts fill whole nodes.
    #[arg(long, requires = "node_link", value_parser = crate::positive_count)]
    pub ranks_per_node: Option<usize>,
    /// Links between nodes per node (with --ranks-per-node; default: one per rank): the
    /// ranks that send across at once share them, as the hierarchical all-reduce's do.
    #[arg(long, requires = "ranks_per_node", value_parser = crate::positive_count)]
    pub nics_per_node: Option<usize>,
    /// The link between the ranks of a node (with --ranks-per-node), a preset as --link
    /// takes, e.g. nvlink-h100.
    #[arg(long, value_parser = links::preset, requires = "ranks_per_node")]
    pub node_link: Option<links::Preset>,
}

impl LinkArgs {
    /// Whether any link source was given.
    pub fn given(&self) -> bool {
        self.bench.is_some()
            || self.link.is_some()
            || self.alpha_us.is_some()
            || self.beta_ns_per_byte.is_some()
            || self.ranks_per_node.is_some()
    }

    /// The network: the link and, with --ranks-per-node, the nodes; and how they were
    /// found.
    ///
    /// # Errors
    /// As [`LinkArgs::resolve_link`].
    pub fn resolve(&self) -> Result<(Network, String)> {
        let (across, how) = self.resolve_link()?;
        match (self.ranks_per_node, &self.node_link) {
            (Some(ranks), Some(within)) => {
                let nics = self.nics_per_node.unwrap_or(ranks);
                let between = if nics >= ranks {
                    "a link per rank".to_string()
                } else {
                    format!("{nics} per node, shared by its ranks")
                };
                Ok((
                    Network {
                        across,
                        nodes: Some(Nodes {
                            nics,
                            ..Nodes::nic_per_rank(ranks, within.link())
                        }),
                    },
                    format!(
                        "nodes of {ranks} ranks, within: {}; between nodes, {between}: {how}",
                        within.description
                    ),
                ))
            }
            _ => Ok((across.into(), how)),
        }
    }

    /// The link (between nodes, on a machine of nodes), and how it was found.
    ///
    /// # Errors
    /// [`LauncherError::InvalidValue`] when none or more than one source is given, a
    /// custom value is not a finite number at least 0, or the bench table is unusable.
    fn resolve_link(&self) -> Result<(Link, String)> {
        let sources = [
            self.bench.is_some(),
            self.link.is_some(),
            self.alpha_us.is_some() || self.beta_ns_per_byte.is_some(),
        ];
        let count = sources.iter().filter(|&&s| s).count();
        if count != 1 {
            return Err(LauncherError::invalid(
                "--bench/--link/--alpha-us",
                format!("{count} link sources"),
                "give exactly one: --bench FILE (a `bench allreduce --json` table), --link \
                 NAME (a described machine), or --alpha-us A --beta-ns-per-byte B",
            ));
        }
        if let Some(path) = &self.bench {
            let fit = calibrate::read_link(path, self.algorithm.as_deref())?;
            let how = format!(
                "fitted to {} ({} rows of `{}`, worst row {:.0} % off the fit)",
                path.display(),
                fit.rows,
                fit.algorithm,
                fit.max_relative_error * 100.0
            );
            return Ok((fit.link, how));
        }
        if let Some(p) = &self.link {
            return Ok((p.link(), p.description.to_string()));
        }
        let check = |name: &'static str, v: Option<f64>, other: &str| match v {
            Some(v) if v.is_finite() && v >= 0.0 => Ok(v),
            Some(v) => Err(LauncherError::invalid(
                name,
                v,
                "must be a finite number of at least 0",
            )),
            None => Err(LauncherError::invalid(
                name,
                "(missing)",
                format!("a custom link needs both --alpha-us and --beta-ns-per-byte; {other}"),
            )),
        };
        let a = check("--alpha-us", self.alpha_us, "add --alpha-us, e.g. 5")?;
        let b = check(
            "--beta-ns-per-byte",
            self.beta_ns_per_byte,
            "add --beta-ns-per-byte, e.g. 0.1 for 10 GB/s",
        )?;
        Ok((
            Link {
                alpha: a * 1e-6,
                beta: b * 1e-9,
            },
            format!("custom: alpha {a} us, beta {b} ns/byte"),
        ))
    }
}

/// A strategy family for `--strategies`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StrategyKind {
    /// All-reduce.
    Replicated,
    /// Parameter servers.
    ParameterServer,
    /// No exchange.
    Independent,
    /// Pipeline K x D.
    Pipeline,
}

fn parse_strategy(s: &str) -> std::result::Result<StrategyKind, String> {
    match s.trim() {
        "replicated" => Ok(StrategyKind::Replicated),
        "parameter_server" => Ok(StrategyKind::ParameterServer),
        "independent" => Ok(StrategyKind::Independent),
        "pipeline" => Ok(StrategyKind::Pipeline),
        other => Err(format!(
            "`{other}` is not a strategy: use replicated, parameter_server, independent or pipeline"
        )),
    }
}

fn on_off(s: &str) -> std::result::Result<bool, String> {
    match s.trim() {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        _ => Err("use on or off".into()),
    }
}

/// How the replicated exchange runs, overriding the calibration run's flags.
#[derive(Debug, Clone, Default, Args)]
pub struct ExchangeOverrides {
    /// Overlap the all-reduce with backward: on or off (default: as the report ran).
    #[arg(long, value_parser = on_off)]
    pub overlap: Option<bool>,
    /// Fusion threshold in bytes (default: the report's).
    #[arg(long)]
    pub fusion_threshold_bytes: Option<usize>,
    /// Fusion cycle time in milliseconds (default: the report's).
    #[arg(long)]
    pub cycle_time_ms: Option<f64>,
    /// Gradient repacking into R packs, 0 = off (default: the report's).
    #[arg(long)]
    pub gradient_repacking: Option<usize>,
    /// f16 on the wire: on or off (default: the report's --fp16-gradients).
    #[arg(long, value_parser = on_off)]
    pub fp16_gradients: Option<bool>,
    /// The gradients' all-reduce: `hier` predicts the hierarchical one on a network of
    /// nodes (--ranks-per-node), any other a ring (default: the report's
    /// --allreduce-algorithm).
    #[arg(long)]
    pub allreduce_algorithm: Option<ringtrain_collective::Algorithm>,
}

/// `ringtrain predict ...`
#[derive(Debug, Clone, Args)]
pub struct PredictArgs {
    /// A 1-rank `train --json-report` file: the compute profile.
    #[arg(long, required_unless_present_any = ["validate", "seeds"])]
    pub report: Option<PathBuf>,
    /// Where alpha and beta come from.
    #[command(flatten)]
    pub link: LinkArgs,
    /// Rank counts to predict, comma-separated (default 2,4,8,64,1024; with --validate
    /// 2,3).
    #[arg(long = "np", value_delimiter = ',', value_parser = crate::positive_count)]
    pub np: Vec<usize>,
    /// Strategies, comma-separated: replicated, parameter_server, independent, pipeline
    /// (default: all four).
    #[arg(long, value_delimiter = ',', value_parser = parse_strategy)]
    pub strategies: Vec<StrategyKind>,
    /// Dedicated parameter-server ranks K (0 = a shard on every rank; default: the
    /// report's --ps-ranks).
    #[arg(long)]
    pub ps_servers: Option<usize>,
    /// Pipeline stages K.
    #[arg(long, default_value_t = 2)]
    pub pipeline_stages: usize,
    /// Micro-batches M per batch of a pipeline.
    #[arg(long, default_value_t = 4)]
    pub micro_batches: usize,
    /// The replicated exchange.
    #[command(flatten)]
    pub exchange: ExchangeOverrides,
    /// Cores (hardware threads) of the node that its ranks share, CPU runs only; 0 =
    /// every rank has cores of its own (default: with --bench, the cores the report's run
    /// recorded, the machine both were measured on; with a described link, 0).
    #[arg(long)]
    pub cores_per_node: Option<usize>,
    /// Also write the rows as JSON to this file (an existing one is replaced).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Draw the predicted table into this SVG file (an existing one is replaced): speedup
    /// against ranks per strategy, dashed, with the ideal line, beside each row's step
    /// split into the model's terms as a stacked bar.
    #[arg(long, conflicts_with_all = ["validate", "seeds"])]
    pub plot: Option<PathBuf>,
    /// Calibrate on one rank here, predict --np (default 2,3), run them and print the
    /// error per row: runs `train` (the command after `--`, or a small default) and
    /// `bench allreduce` under mpirun itself.
    #[arg(long, conflicts_with_all = ["report", "seeds"])]
    pub validate: bool,
    /// Rounds --validate makes; each calibrates, measures the link and runs every count
    /// back to back, and each row compares the median prediction with the median run.
    #[arg(long, default_value_t = 5, value_parser = crate::positive_count)]
    pub rounds: usize,
    /// Predict the seeds' 8 x P100 tables from their 1-GPU rows and the p100-pcie link,
    /// and print the error per row.
    #[arg(long, conflicts_with = "report")]
    pub seeds: bool,
    /// The mpirun program (--validate).
    #[arg(long, default_value = "mpirun", env = "RINGTRAIN_MPIRUN")]
    pub mpirun: String,
    /// Extra arguments passed to mpirun (--validate).
    #[arg(long = "mpi-arg", allow_hyphen_values = true)]
    pub mpi_args: Vec<String>,
    /// The training command for --validate, after `--`, e.g. `-- train --num-units 32`.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<String>,
}

/// The rank counts `predict` shows without `--np`.
pub const DEFAULT_COUNTS: &[usize] = &[2, 4, 8, 64, 1024];

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct PredictedRow {
    /// Always true: these rows are predicted, not measured.
    pub predicted: bool,
    /// The cores the ranks were taken to share (0: none) and the threads per rank.
    pub sharing: Sharing,
    /// The prediction.
    #[serde(flatten)]
    pub prediction: Prediction,
}

/// The replicated exchange of the report's config with `o`'s overrides.
pub fn exchange_of(report: &ringtrain_train::RunReport, o: &ExchangeOverrides) -> Exchange {
    let e = &report.config.exchange;
    let overlap = match e.overlap_backward {
        ringtrain_train::OverlapMode::On => true,
        ringtrain_train::OverlapMode::Off => false,
        ringtrain_train::OverlapMode::Auto => {
            report.config.run.device == ringtrain_train::DeviceKind::Cuda
        }
    };
    Exchange {
        overlap: o.overlap.unwrap_or(overlap),
        fusion_threshold: o.fusion_threshold_bytes.unwrap_or(e.fusion_threshold_bytes) as f64,
        cycle_time: o.cycle_time_ms.unwrap_or(e.cycle_time_ms).max(0.0) * 1e-3,
        repacking: o.gradient_repacking.unwrap_or(e.gradient_repacking),
        f16: o.fp16_gradients.unwrap_or(e.fp16_gradients),
        hierarchical: o.allreduce_algorithm.unwrap_or(e.allreduce_algorithm)
            == ringtrain_collective::Algorithm::Hierarchical,
    }
}

/// The strategy the report's run used, with `o`'s overrides.
pub fn strategy_of(report: &ringtrain_train::RunReport, o: &ExchangeOverrides) -> Strategy {
    let e = &report.config.exchange;
    match e.variable_update {
        ringtrain_train::VariableUpdate::Replicated => Strategy::Replicated(exchange_of(report, o)),
        ringtrain_train::VariableUpdate::ParameterServer => Strategy::ParameterServer {
            servers: e.ps_ranks,
            f16: o.fp16_gradients.unwrap_or(e.fp16_gradients),
        },
        ringtrain_train::VariableUpdate::Independent => Strategy::Independent,
    }
}

/// The cores the predicted ranks share: `--cores-per-node` when given (0: none), else,
/// for a link measured here (`--bench`), the cores the calibration run recorded; a
/// described link (`--link`, `--alpha-us`) is a machine with a core or GPU per rank. The
/// threads per rank are the calibration run's. A run on cuda computes on its GPU: its
/// ranks share no cores. Returns the sharing and how it was found.
///
/// # Errors
/// [`LauncherError::InvalidValue`] for `--cores-per-node` with a cuda report.
pub fn sharing_of(
    report: &ringtrain_train::RunReport,
    cores_per_node: Option<usize>,
    link_measured_here: bool,
) -> Result<(Sharing, String)> {
    let cuda = report.config.run.device == ringtrain_train::DeviceKind::Cuda;
    if cuda {
        if let Some(c) = cores_per_node.filter(|&c| c > 0) {
            return Err(LauncherError::invalid(
                "--cores-per-node",
                c,
                "the report is of a cuda run, whose ranks compute on a GPU each and share \
                 no cores; drop --cores-per-node",
            ));
        }
        return Ok((
            Sharing::NONE,
            "one GPU per rank: no cores shared".to_string(),
        ));
    }
    let host = report.host;
    let threads = host
        .map(|h| h.threads_per_rank)
        .filter(|&t| t > 0)
        .unwrap_or(report.config.run.threads)
        .max(1);
    let (cores, how) = match (cores_per_node, host) {
        (Some(0), _) => (0, "--cores-per-node 0".to_string()),
        (Some(c), _) => (c, "--cores-per-node".to_string()),
        (None, Some(h)) if link_measured_here && h.cores > 0 => (
            h.cores,
            "recorded by the calibration run; --cores-per-node 0 predicts a core per rank"
                .to_string(),
        ),
        (None, None) if link_measured_here => (
            0,
            "the report does not record its cores (an older version); --cores-per-node C \
             says them"
                .to_string(),
        ),
        (None, _) => (0, "a described machine".to_string()),
    };
    let sharing = Sharing {
        cores,
        threads_per_rank: threads,
    };
    let text = if cores == 0 {
        format!("none shared, a core (or GPU) per rank ({how})")
    } else {
        format!("{cores} shared by the ranks, {threads} thread(s) each ({how})")
    };
    Ok((sharing, text))
}

/// The rows for `counts` x `strategies`, in that order (rank counts a strategy cannot
/// use are left out).
pub fn rows(
    profile: &Profile,
    network: Network,
    strategies: &[Strategy],
    counts: &[usize],
    sharing: Sharing,
) -> Vec<PredictedRow> {
    let mut out = Vec::new();
    for s in strategies {
        for &n in counts {
            if s.fits(n) {
                out.push(PredictedRow {
                    predicted: true,
                    sharing,
                    prediction: model::predict(profile, network, s, n, sharing),
                });
            }
        }
    }
    out
}

/// The rows as markdown.
pub fn markdown(rows: &[PredictedRow]) -> String {
    let mut s = String::from(
        "| strategy | ranks | step (ms) | words/s | speedup | efficiency | bottleneck |\n|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let p = &r.prediction;
        s.push_str(&format!(
            "| {} | {} | {:.3} | {:.1} | {:.2} | {:.1} % | {} |\n",
            p.strategy,
            p.ranks,
            p.step_seconds * 1e3,
            p.words_per_sec,
            p.speedup,
            p.efficiency * 100.0,
            p.bottleneck
        ));
    }
    s
}

fn write_json<T: Serialize>(path: &std::path::Path, value: &T) -> Result<()> {
    let json =
        serde_json::to_string_pretty(value).map_err(|e| LauncherError::Bench(e.to_string()))?;
    ringtrain_train::outputs::write_atomically(
        path,
        (json + "\n").as_bytes(),
        "writing the predicted table",
    )?;
    Ok(())
}

/// `ringtrain predict`.
pub fn run(args: &PredictArgs) -> Result<()> {
    if let Some(path) = &args.json {
        ringtrain_train::outputs::check_output_file("--json", path, "predict.json")?;
    }
    if let Some(path) = &args.plot {
        ringtrain_train::outputs::check_output_file("--plot", path, "predict.svg")?;
    }
    if args.pipeline_stages == 0 || args.micro_batches == 0 {
        return Err(LauncherError::invalid(
            "--pipeline-stages/--micro-batches",
            format!("{}/{}", args.pipeline_stages, args.micro_batches),
            "both must be at least 1",
        ));
    }
    if !args.validate && !args.command.is_empty() {
        return Err(LauncherError::invalid(
            "COMMAND",
            args.command.join(" "),
            "a training command is only run by --validate; add --validate or drop it",
        ));
    }
    if (args.seeds || args.validate) && args.link.given() {
        return Err(LauncherError::invalid(
            "--bench/--link/--alpha-us",
            "(given)",
            if args.seeds {
                "--seeds uses the seeds' own machine (the p100-pcie link); drop the link flags"
            } else {
                "--validate measures the link here itself; drop the link flags"
            },
        ));
    }
    if args.seeds {
        let rows = seeds::seed_rows();
        println!(
            "The seeds' 8 x P100 tables, predicted from their 1-GPU rows and {}:\n",
            links::P100_PCIE.description
        );
        print!("{}", seeds::seed_markdown(&rows));
        if let Some(path) = &args.json {
            write_json(path, &rows)?;
        }
        return Ok(());
    }
    if args.validate {
        return validate::run(args);
    }
    let Some(report_path) = &args.report else {
        return Err(LauncherError::invalid(
            "--report",
            "(missing)",
            calibrate::MAKE_REPORT,
        ));
    };
    let (network, how) = args.link.resolve()?;
    let (profile, report) = calibrate::read_profile(report_path)?;
    let strategies = strategies(args, &report);
    let counts = if args.np.is_empty() {
        DEFAULT_COUNTS.to_vec()
    } else {
        args.np.clone()
    };
    let (sharing, sharing_how) =
        sharing_of(&report, args.cores_per_node, args.link.bench.is_some())?;
    let table = rows(&profile, network, &strategies, &counts, sharing);
    println!(
        "calibration: {} ({:.0} words/step, compute {:.3} ms: forward {:.3}, backward {:.3}, \
         optimizer {:.3}; {} gradient ranges, {:.0} bytes)",
        report_path.display(),
        profile.words_per_step,
        profile.compute() * 1e3,
        profile.forward * 1e3,
        profile.backward * 1e3,
        profile.optimizer * 1e3,
        profile.ready.len(),
        profile.gradient_bytes()
    );
    let figures = |link: Link| {
        format!(
            "alpha {:.2} us, bandwidth {:.3} GB/s",
            link.alpha * 1e6,
            link.bandwidth() / 1e9
        )
    };
    match network.nodes {
        Some(nodes) => println!(
            "link: {how}: within {}, between {}",
            figures(nodes.within),
            figures(network.across)
        ),
        None => println!("link: {how}: {}", figures(network.across)),
    }
    println!("cores: {sharing_how}");
    if !profile.ready_measured {
        println!(
            "note: the report has no gradient ready-times (one rank on cuda keeps its \
             gradients on the device); the whole gradient counts as ready at the end of \
             backward, so nothing overlaps"
        );
    }
    if let Some(bench) = &args.link.bench {
        // Each algorithm's fit, for comparison; the rows use the one named above.
        for fit in calibrate::read_all_links(bench)? {
            println!(
                "  fit of `{}`: alpha {:.2} us, bandwidth {:.3} GB/s ({} rows, worst {:.0} % off)",
                fit.algorithm,
                fit.link.alpha * 1e6,
                fit.link.bandwidth() / 1e9,
                fit.rows,
                fit.max_relative_error * 100.0
            );
        }
    }
    println!();
    print!("{}", markdown(&table));
    if let Some(path) = &args.json {
        write_json(path, &table)?;
    }
    if let Some(path) = &args.plot {
        crate::plot::write_svg("--plot", path, &charts(&table))?;
        println!("plot written to {}", path.display());
    }
    Ok(())
}

/// The predicted table's charts: speedup against ranks, a dashed line per strategy
/// (from its 1-rank point), and the step of each strategy at the largest rank count
/// split into the model's terms.
pub fn charts(rows: &[PredictedRow]) -> Vec<crate::plot::Chart> {
    use crate::plot::{Bar, Chart, Line};

    let largest = rows.iter().map(|r| r.prediction.ranks).max().unwrap_or(1);
    let mut lines: Vec<Line> = Vec::new();
    let mut bars = Vec::new();
    for r in rows {
        let p = &r.prediction;
        let point = (p.ranks as f64, p.speedup);
        match lines.iter_mut().find(|l| l.name == p.strategy) {
            Some(line) => line.points.push(point),
            None => lines.push(Line {
                name: p.strategy.clone(),
                points: vec![(1.0, 1.0), point],
                predicted: true,
            }),
        }
        if p.ranks != largest {
            continue;
        }
        let t = &p.terms;
        let short = p.strategy.split_whitespace().next().unwrap_or_default();
        bars.push(Bar {
            label: format!("{short}, {} ranks", p.ranks),
            parts: t.named().iter().map(|n| n.1).collect(),
        });
    }
    let phases = model::Terms::default().named().map(|n| n.0);
    vec![
        Chart::Speedup {
            title: "predicted speedup".to_string(),
            lines,
        },
        Chart::Breakdown {
            title: "predicted step, by term".to_string(),
            phases: phases.iter().map(|s| s.to_string()).collect(),
            bars,
        },
    ]
}

/// The strategies `args` asks for, shaped by the report's flags.
fn strategies(args: &PredictArgs, report: &ringtrain_train::RunReport) -> Vec<Strategy> {
    let kinds = if args.strategies.is_empty() {
        vec![
            StrategyKind::Replicated,
            StrategyKind::ParameterServer,
            StrategyKind::Independent,
            StrategyKind::Pipeline,
        ]
    } else {
        args.strategies.clone()
    };
    let exchange = exchange_of(report, &args.exchange);
    kinds
        .iter()
        .map(|k| match k {
            StrategyKind::Replicated => Strategy::Replicated(exchange),
            StrategyKind::ParameterServer => Strategy::ParameterServer {
                servers: args.ps_servers.unwrap_or(report.config.exchange.ps_ranks),
                f16: exchange.f16,
            },
            StrategyKind::Independent => Strategy::Independent,
            StrategyKind::Pipeline => Strategy::Pipeline {
                stages: args.pipeline_stages,
                micro_batches: args.micro_batches,
                exchange,
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_report() -> ringtrain_train::RunReport {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/predict-one-rank.json");
        ringtrain_train::RunReport::read_json(&path).expect("fixture report")
    }

    #[test]
    fn the_cores_come_from_the_calibration_or_the_described_machine() {
        let mut report = fixture_report();
        report.host = Some(ringtrain_train::HostFigures {
            cores: 2,
            threads_per_rank: 1,
            ranks_on_node: 1,
        });
        let two = Sharing {
            cores: 2,
            threads_per_rank: 1,
        };
        // A link measured here: the machine the report recorded.
        let (s, how) = sharing_of(&report, None, true).expect("sharing");
        assert_eq!(s, two);
        assert!(how.contains("recorded by the calibration run"), "{how}");
        // A described machine: a core per rank, unless told otherwise.
        assert_eq!(
            sharing_of(&report, None, false).expect("sharing").0.cores,
            0
        );
        assert_eq!(
            sharing_of(&report, Some(0), true).expect("sharing").0.cores,
            0
        );
        assert_eq!(
            sharing_of(&report, Some(8), false)
                .expect("sharing")
                .0
                .cores,
            8
        );
        // A report without the record (an older version) shares nothing, and says so.
        report.host = None;
        let (s, how) = sharing_of(&report, None, true).expect("sharing");
        assert_eq!(s.cores, 0);
        assert!(how.contains("--cores-per-node"), "{how}");
        // A cuda run's ranks have a GPU each: never shared, and the flag is refused.
        report.config.run.device = ringtrain_train::DeviceKind::Cuda;
        report.host = Some(ringtrain_train::HostFigures {
            cores: 2,
            threads_per_rank: 1,
            ranks_on_node: 1,
        });
        assert_eq!(
            sharing_of(&report, None, true).expect("sharing").0,
            Sharing::NONE
        );
        let e = sharing_of(&report, Some(2), true).unwrap_err().to_string();
        assert!(
            e.starts_with("invalid value `2` for --cores-per-node"),
            "{e}"
        );
        // So a GPU preset predicts the same with or without a node's cores.
        let (profile, _) = calibrate::read_profile(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/data/predict-one-rank.json"),
        )
        .expect("profile");
        let link = Network::from(links::NVLINK_H100.link());
        let s = Strategy::Replicated(exchange_of(&report, &ExchangeOverrides::default()));
        let gpu = sharing_of(&report, None, true).expect("sharing").0;
        assert_eq!(
            rows(&profile, link, &[s], &[8, 64], gpu)[1].prediction,
            rows(&profile, link, &[s], &[8, 64], Sharing::NONE)[1].prediction
        );
    }

    #[test]
    fn link_sources_are_exactly_one() {
        let none = LinkArgs::default();
        let e = none.resolve().unwrap_err().to_string();
        assert!(e.contains("give exactly one"), "{e}");
        let half = LinkArgs {
            alpha_us: Some(5.0),
            ..LinkArgs::default()
        };
        let e = half.resolve().unwrap_err().to_string();
        assert!(e.contains("--beta-ns-per-byte"), "{e}");
        let negative = LinkArgs {
            alpha_us: Some(-1.0),
            beta_ns_per_byte: Some(0.1),
            ..LinkArgs::default()
        };
        let e = negative.resolve().unwrap_err().to_string();
        assert!(e.starts_with("invalid value `-1` for --alpha-us"), "{e}");
        let custom = LinkArgs {
            alpha_us: Some(5.0),
            beta_ns_per_byte: Some(0.1),
            ..LinkArgs::default()
        };
        let (network, _) = custom.resolve().expect("link");
        let link = network.across;
        assert!((link.alpha - 5e-6).abs() < 1e-15 && (link.beta - 1e-10).abs() < 1e-20);
        assert_eq!(network.nodes, None);
        let both = LinkArgs {
            link: Some(links::IB_HDR),
            ..custom.clone()
        };
        assert!(both.resolve().is_err());
    }

    /// `--ranks-per-node` with `--node-link`: the link given is the one between nodes, the
    /// preset the one within, and the description says both; clap asks for the two
    /// together.
    #[test]
    fn nodes_take_the_node_link_within_and_the_link_between() {
        let args = LinkArgs {
            link: Some(links::IB_NDR),
            ranks_per_node: Some(8),
            node_link: Some(links::NVLINK_H100),
            ..LinkArgs::default()
        };
        let (network, how) = args.resolve().expect("network");
        assert_eq!(network.across, links::IB_NDR.link());
        assert_eq!(
            network.nodes,
            Some(Nodes::nic_per_rank(8, links::NVLINK_H100.link()))
        );
        assert!(
            how.contains("nodes of 8 ranks")
                && how.contains("a link per rank")
                && how.contains("InfiniBand NDR"),
            "{how}"
        );
        let shared = LinkArgs {
            nics_per_node: Some(2),
            ..args.clone()
        };
        let (shared_network, shared_how) = shared.resolve().expect("network");
        assert_eq!(shared_network.nodes.map(|n| n.nics), Some(2));
        assert!(
            shared_how.contains("2 per node, shared by its ranks"),
            "{shared_how}"
        );

        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            link: LinkArgs,
        }
        let alone = Cli::try_parse_from(["predict", "--link", "ib-ndr", "--ranks-per-node", "8"]);
        let e = alone.err().expect("refused").to_string();
        assert!(e.contains("--node-link"), "{e}");
        let nics_alone =
            Cli::try_parse_from(["predict", "--link", "ib-ndr", "--nics-per-node", "1"]);
        let e = nics_alone.err().expect("refused").to_string();
        assert!(e.contains("--ranks-per-node"), "{e}");
        let nodes = [
            "--link",
            "ib-ndr",
            "--ranks-per-node",
            "8",
            "--node-link",
            "nvlink-h100",
        ];
        for (extra, want) in [
            (&[][..], network),
            (&["--nics-per-node", "2"][..], shared_network),
        ] {
            let args = ["predict"].iter().chain(&nodes).chain(extra);
            let parsed = Cli::try_parse_from(args).expect("parsed");
            assert_eq!(parsed.link.resolve().expect("network").0, want);
        }
    }
}
