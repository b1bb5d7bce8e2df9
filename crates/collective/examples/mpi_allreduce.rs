//! Every rank contributes its rank number; every rank checks the sum.
//!
//! ```text
//! cargo build --release -p ringtrain-collective --features mpi --example mpi_allreduce
//! mpirun -np 4 target/release/examples/mpi_allreduce
//! ```

use ringtrain_collective::{Algorithm, AllReduceOptions, Communicator, Result};

fn main() -> Result<()> {
    let mut comm = Communicator::mpi()?;
    let (rank, size) = (comm.rank(), comm.size());
    let expected = (size * (size - 1) / 2) as f32;
    for algorithm in [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::Mpi,
    ] {
        let mut grads = vec![rank as f32; 1 << 20];
        comm.all_reduce(&mut grads, &AllReduceOptions::sum().algorithm(algorithm))?;
        assert!(
            grads.iter().all(|&g| g == expected),
            "{algorithm}: wrong sum"
        );
    }
    let mut params = vec![rank as f64; 1000];
    comm.broadcast(&mut params, 0)?;
    assert!(params.iter().all(|&p| p == 0.0));
    if rank == 0 {
        println!("all-reduce and broadcast agree on {size} ranks");
    }
    Ok(())
}
