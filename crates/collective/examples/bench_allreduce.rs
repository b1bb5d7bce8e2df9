//! Stand-alone build of `ringtrain bench allreduce` (the same module the `ringtrain`
//! binary mounts), for running the benchmark without the launcher:
//!
//! ```text
//! cargo build --release -p ringtrain-collective --features mpi --example bench_allreduce
//! mpirun -np 2 target/release/examples/bench_allreduce --min-bytes 64K --max-bytes 64M
//! ```

#[path = "../../../launcher/src/bench_allreduce.rs"]
mod bench_allreduce;

use clap::Parser;

/// All-reduce benchmark: ring against MPI_Allreduce, and tensor fusion against
/// per-tensor MPI_Allreduce. Run under mpirun.
#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: bench_allreduce::AllreduceBenchArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = bench_allreduce::run(&cli.args) {
        eprintln!("bench_allreduce: error: {e}");
        std::process::exit(1);
    }
}
