//! `ringtrain train`: one rank of a training run.

use ringtrain_collective::Communicator;
use ringtrain_train::TrainConfig;

use crate::error::Result;

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

/// Runs one rank with these flags; rank 0 prints progress and the final table.
///
/// # Errors
/// A flag that is wrong (before any work), or anything the run fails with.
pub fn run(cfg: &TrainConfig) -> Result<()> {
    let comm = world()?;
    let cfg = cfg.validate(comm.size())?;
    // SIGINT/SIGTERM stop the run at the next step boundary with one line saying what
    // was interrupted and which checkpoint is the last good one.
    ringtrain_train::interrupt::install()?;
    let local = ringtrain_train::local_rank(&comm)?;
    let rank = comm.rank();
    if cfg.config().run.dry_run {
        let plan = ringtrain_train::plan_rank(&cfg, rank, &local)?;
        if rank == 0 {
            println!("ringtrain: {plan}");
        }
        return Ok(());
    }
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
