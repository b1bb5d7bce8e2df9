//! Horovod-style collectives for data-parallel training: a pipelined ring all-reduce,
//! recursive doubling and a one-step direct all-reduce for small messages,
//! scatter-gather (two direct steps) and halving-doubling for mid-sized ones, a
//! shared-memory all-reduce for the ranks of one node, a hierarchical one for ranks on
//! several nodes, broadcast, all-gather,
//! reduce-scatter and barrier, tf_cnn_benchmarks' gradient packing, and Horovod's tensor
//! fusion with asynchronous submission, name negotiation and stall detection.
//!
//! The algorithms are written once against a small [`Transport`] (rank, size and
//! point-to-point bytes). Two transports exist:
//!
//! - [`LocalTransport`]: N ranks as threads of one process, for tests and single-process
//!   use;
//! - `MpiTransport` (feature `mpi`): rsmpi point-to-point over `MPI_COMM_WORLD`, one
//!   process per rank under `mpirun`. It also offers `MPI_Allreduce` itself as
//!   [`Algorithm::Mpi`], the baseline the benchmarks compare with.
//!
//! Where the ranks span several nodes, [`Algorithm::Hierarchical`] reduces within each
//! node, then across nodes, then shares the result within each node
//! ([`hierarchical`]); [`Communicator::nodes`] says which ranks share a node.
//!
//! Where every rank is on one node, [`Algorithm::SharedMemory`] reduces through a memory
//! segment the ranks map (`/dev/shm`) instead of messages, and [`Algorithm::Auto`] takes
//! it from a few hundred bytes or kilobytes up ([`algorithm_choice`]); where a rank cannot
//! map it, every rank learns so at once and `auto` chooses among the others
//! ([`shared_memory`]).
//!
//! Every wait on other ranks is bounded by a stall timeout
//! ([`Communicator::set_stall_timeout`], default 60 s): a rank that stops responding is
//! named by the ranks waiting for it, and the job is aborted instead of hanging (see
//! [`stall`]). Ranks whose settings differ (the fusion engine's threshold, operation,
//! algorithm, scales or wire type; a gradient plan's; the communicator's segment size and
//! algorithm overrides) are told so on every rank by [`FusionEngine::start`] and by a
//! plan's first [`GradientPacker::all_reduce`], naming each setting and each rank's
//! value, before they send messages the others do not expect
//! ([`Communicator::check_same_values`] makes the same check of a caller's own list).
//!
//! [`Communicator::duplicate`] gives a second communicator over the same ranks
//! (`MPI_Comm_dup`) for control messages beside the data path, and
//! [`Communicator::node_rank`] says which ranks share a node (the device a rank uses).
//!
//! Terms: a *rank* is one participant (a thread here, a process under MPI). *All-reduce*
//! leaves every rank with the element-wise reduction of all ranks' buffers; every rank
//! ends with identical bits, whatever the algorithm. f16 and bf16 are reduced through f32
//! (`f16(f32(a) + f32(b))`, via `ringtrain-kernels`).
//!
//! # Example: four ranks as threads
//!
//! ```
//! use ringtrain_collective::{AllReduceOptions, Algorithm, Communicator};
//!
//! let results = Communicator::run_local(4, |mut comm| {
//!     // Rank r contributes r + 1 in every element: the sum is 1 + 2 + 3 + 4 = 10.
//!     let mut grads = vec![(comm.rank() + 1) as f32; 1000];
//!     comm.all_reduce(&mut grads, &AllReduceOptions::sum().algorithm(Algorithm::Ring))?;
//!     let mut avg = vec![(comm.rank() + 1) as f64; 3];
//!     comm.all_reduce(&mut avg, &AllReduceOptions::average())?;
//!     Ok::<_, ringtrain_collective::Error>((grads, avg))
//! })?;
//! for r in results {
//!     let (grads, avg) = r?;
//!     assert!(grads.iter().all(|&x| x == 10.0));
//!     assert_eq!(avg, vec![2.5; 3]);
//! }
//! # Ok::<(), ringtrain_collective::Error>(())
//! ```
//!
//! # Example: tensor fusion
//!
//! ```
//! use ringtrain_collective::{Communicator, FusionConfig, FusionEngine};
//!
//! let out = Communicator::run_local(2, |comm| {
//!     let engine = FusionEngine::start(comm, FusionConfig::default())?;
//!     // Submit like a backward pass does: many small named gradients.
//!     let handles = (0..10)
//!         .map(|i| engine.submit(&format!("layer{i}/grad"), vec![1.0f32; 256]))
//!         .collect::<Result<Vec<_>, _>>()?;
//!     let reduced = engine.synchronize(handles)?;
//!     engine.shutdown()?;
//!     Ok::<_, ringtrain_collective::Error>(reduced)
//! })?;
//! for reduced in out {
//!     for t in reduced? {
//!         assert!(t.into_vec::<f32>()?.iter().all(|&x| x == 2.0));
//!     }
//! }
//! # Ok::<(), ringtrain_collective::Error>(())
//! ```
//!
//! # Under mpirun
//!
//! With feature `mpi`, one process per rank (see `examples/mpi_allreduce.rs`, run with
//! `mpirun -np 4 target/release/examples/mpi_allreduce`):
//!
//! ```no_run
//! # #[cfg(feature = "mpi")]
//! # fn main() -> Result<(), ringtrain_collective::Error> {
//! use ringtrain_collective::{AllReduceOptions, Communicator};
//!
//! let mut comm = Communicator::mpi()?; // MPI_Init; a world of 1 without mpirun
//! let mut params = vec![comm.rank() as f32; 1 << 20];
//! comm.broadcast(&mut params, 0)?; // everyone starts from rank 0's parameters
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce(&mut grads, &AllReduceOptions::average())?;
//! assert!(grads.iter().all(|&g| g == 1.0));
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "mpi"))]
//! # fn main() {}
//! ```
#![warn(missing_docs)]

mod agreement;
pub mod algorithm_choice;
mod communicator;
mod dtype;
mod error;
pub mod fusion;
pub mod hierarchical;
#[cfg(feature = "mpi")]
mod mpi_transport;
mod negotiation;
mod options;
mod packing;
mod pieces;
pub mod shared_memory;
pub mod stall;
mod subgroup;
pub mod timeline;
mod transport;

/// The `half` crate whose `f16` / `bf16` the collectives reduce.
pub use half;

pub use communicator::{
    min_in_place_piece_bytes, ring_chunk_range, Communicator, DEFAULT_AUTO_THRESHOLD_BYTES,
    DEFAULT_SEGMENT_BYTES, MIN_IN_PLACE_PIECE_BYTES, MIN_SHARED_MEMORY_PIECE_BYTES,
};
pub use dtype::{DType, Element, Tensor, TensorMut};
pub use error::{Error, Result};
pub use fusion::{ExternalTensor, FusionConfig, FusionEngine, GroupHandle, Handle, TensorNames};
#[cfg(feature = "mpi")]
pub use mpi_transport::MpiTransport;
pub use options::{Algorithm, AllReduceOptions, ReduceOp, WireCompression};
pub use packing::{GradientPacker, GradientSpec, PackingConfig, ReductionUnit, UnitPiece};
pub use stall::{StallWatch, DEFAULT_STALL_TIMEOUT, STALL_EXIT_CODE};
pub use subgroup::SubgroupTransport;
pub use timeline::{timeline_path_for_rank, EventSink, TraceEvent};
pub use transport::{LocalTransport, NodeRank, Transport, NODE_ENV};
