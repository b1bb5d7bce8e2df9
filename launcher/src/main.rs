//! The `ringtrain` command: train one rank under mpirun, launch mpirun for you, sweep
//! rank counts, benchmark collectives.
//!
//! ```text
//! ringtrain launch --np 2 -- train --use-synthetic-data
//! ringtrain sweep --np 1,2 -- train --use-synthetic-data --variable-update replicated
//! ringtrain predict --report one-rank.json --link ib-ndr --np 8,64,1024
//! mpirun -np 4 ringtrain train --model rnnlm --batch-size 32
//! ```

use clap::{Parser, Subcommand};

mod bench_allreduce;
mod error;
mod launch;
mod plot;
mod predict;
mod sweep;
mod train_cmd;

use error::LauncherError;

/// Data-parallel LSTM training over MPI, measured the way tf_cnn_benchmarks users expect.
#[derive(Debug, Parser)]
#[command(name = "ringtrain", version, about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Train one rank (start several with mpirun or `ringtrain launch`).
    Train(ringtrain_train::TrainConfig),
    /// Run mpirun with the right variables and binding: `ringtrain launch --np 2 -- train ...`.
    Launch(launch::LaunchArgs),
    /// Run the same training at several rank counts and print the speedup table.
    Sweep(sweep::SweepArgs),
    /// Predict words/s, speedup and efficiency at N ranks per strategy from a 1-rank
    /// report and a link (measured or described); `--validate` checks it here.
    Predict(predict::PredictArgs),
    /// Benchmarks (run under mpirun): `ringtrain bench allreduce`.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// All-reduce bandwidth table: ring against MPI_Allreduce, and tensor fusion.
    Allreduce(bench_allreduce::AllreduceBenchArgs),
}

/// A whole number of at least 1 (rank counts).
pub(crate) fn positive_count(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(v) => Ok(v),
        Err(_) => Err("expected a whole number such as 2".into()),
    }
}

fn run(cli: Cli) -> Result<(), LauncherError> {
    match cli.command {
        Command::Train(args) => train_cmd::run(&args),
        Command::Launch(args) => launch::run(&args),
        Command::Sweep(args) => sweep::run(&args),
        Command::Predict(args) => predict::run(&args),
        Command::Bench(BenchCommand::Allreduce(args)) => {
            bench_allreduce::run(&args).map_err(|e| LauncherError::Bench(e.to_string()))
        }
    }
}

fn main() {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        // One write of the whole line: the ranks of an mpirun job share one stderr, and
        // `eprintln!` writes its pieces separately, so two ranks' errors could interleave.
        let line = format!("ringtrain: error: {e}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
        std::process::exit(e.exit_code());
    }
}
