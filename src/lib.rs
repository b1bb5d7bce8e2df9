//! ringtrain: data-parallel LSTM training over MPI, one rank per device.
//!
//! This facade re-exports the workspace's crates under short names, so one dependency
//! gives all of them:
//!
//! - [`kernels`]: `no_std` CPU kernels on slices (LSTM cell, softmax cross-entropy,
//!   f16/bf16 casts with loss scale, optimizers, reductions);
//! - [`collective`]: the Horovod-style collectives (ring all-reduce, broadcast,
//!   all-gather, gradient packing, tensor fusion) over MPI or threads;
//! - [`model`]: the `Backend` trait, fused and stepwise LSTM layers, NMT and RNNLM;
//! - [`data`]: synthetic data, corpora, vocabularies, bucketing, sharding, prefetch;
//! - [`train`]: the training loop, variable-update strategies, throughput meter,
//!   checkpoints;
//! - `cuda` (feature `cuda`): the runtime for the PTX kernels in `ptx/`.
//!
//! The `ringtrain` command (package `ringtrain-launcher`) runs the trainer under mpirun.
//!
//! # Example
//!
//! Four ranks as threads average their gradients with the ring all-reduce, then each
//! applies the same Adam step with the CPU kernel:
//!
//! ```
//! use ringtrain::collective::{AllReduceOptions, Communicator};
//!
//! let results = Communicator::run_local(4, |mut comm| {
//!     let rank = comm.rank() as f32;
//!     let mut grads = vec![rank; 10];
//!     comm.all_reduce(&mut grads, &AllReduceOptions::average())
//!         .expect("all ranks take part");
//!     let (mut params, mut m, mut v) = (vec![1.0f32; 10], vec![0.0; 10], vec![0.0; 10]);
//!     ringtrain::kernels::adam_step(
//!         &mut params, &grads, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1,
//!     )
//!     .expect("lengths match");
//!     params
//! })
//! .expect("local ranks run");
//! // Every rank saw the mean gradient 1.5 and took the same step.
//! assert!(results.iter().all(|p| p == &results[0]));
//! assert!((results[0][0] - (1.0 - 1e-3)).abs() < 1e-6);
//! ```
#![warn(missing_docs)]

pub use ringtrain_collective as collective;
#[cfg(feature = "cuda")]
pub use ringtrain_cuda as cuda;
pub use ringtrain_data as data;
pub use ringtrain_kernels as kernels;
pub use ringtrain_model as model;
pub use ringtrain_train as train;
