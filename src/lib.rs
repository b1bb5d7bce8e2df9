//! ringtrain: data-parallel LSTM training over MPI (facade crate).
#![warn(missing_docs)]
pub use ringtrain_collective as collective;
pub use ringtrain_data as data;
pub use ringtrain_kernels as kernels;
pub use ringtrain_model as model;
pub use ringtrain_train as train;
#[cfg(feature = "cuda")]
pub use ringtrain_cuda as cuda;
