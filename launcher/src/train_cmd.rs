//! `ringtrain train`: one rank of a training run.

use ringtrain_collective::Communicator;

use crate::error::Result;
use crate::train_args::TrainArgs;

/// Opens the world communicator: MPI when built with it (a world of one without
/// mpirun), otherwise a single local rank.
fn world() -> Result<Communicator> {
    #[cfg(feature = "mpi")]
    {
        Ok(Communicator::mpi()?)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let mut comms = Communicator::local(1)?;
        Ok(comms.remove(0))
    }
}

/// The local rank: from the launcher's variables, else (under MPI) from a split of the
/// shared-memory communicator, which every rank of the job performs together.
fn local_rank() -> Option<ringtrain_train::LocalRank> {
    if let Some(local) = ringtrain_train::local_rank_from_env() {
        return Some(local);
    }
    #[cfg(feature = "mpi")]
    {
        use mpi::topology::{Communicator as _, SimpleCommunicator};
        if mpi::environment::is_initialized() {
            let world = SimpleCommunicator::world();
            let shared = world.split_shared(world.rank());
            return Some(ringtrain_train::LocalRank {
                rank: usize::try_from(shared.rank()).unwrap_or(0),
                size: usize::try_from(shared.size()).unwrap_or(1).max(1),
                source: ringtrain_train::LocalRankSource::SharedMemorySplit,
            });
        }
    }
    None
}

/// Runs one rank with these flags; rank 0 prints progress and the final table.
pub fn run(args: &TrainArgs) -> Result<()> {
    let cfg = args.to_config();
    cfg.validate()?;
    let comm = world()?;
    let local = local_rank();
    let rank = comm.rank();
    let outcome = ringtrain_train::run_rank(&cfg, comm, local, &mut |line: &str| {
        if rank == 0 {
            println!("{line}");
        }
    })?;
    if rank == 0 {
        println!("{}", outcome.report.final_table());
    }
    Ok(())
}
