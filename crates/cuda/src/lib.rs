//! ringtrain-cuda: the CUDA runtime for ringtrain's hand-written PTX kernels.
//!
//! The kernels in `ptx/` are PTX written by hand (not generated from CUDA C),
//! one file per kernel family. Each is the GPU twin of a `ringtrain-kernels`
//! CPU function, with the same name, the same argument order and the same
//! row-major layouts; this crate loads them and launches them safely.
//!
//! # Terms
//!
//! * **Context**: the driver's state for one device (its memory, its loaded
//!   code). ringtrain uses each device's primary context, one per device index.
//! * **Module**: one PTX file loaded into a context. The driver compiles the PTX
//!   text for the device when it is loaded (so one text, `.target sm_80`, runs on
//!   A100, H100 and H200). Each file is loaded once per context and cached.
//! * **Stream**: an in-order queue of device work. Launches and copies return
//!   as soon as they are queued; the host waits only when it synchronizes or
//!   copies results back.
//! * **Entry / kernel**: a `.entry` function in a PTX file, launched on a grid of
//!   thread blocks with a list of parameters.
//!
//! [`Gpu`] bundles one device's context, a compute stream, a copy stream and the
//! module cache. [`PinnedBuffer`] is page-locked host memory whose copies to and from
//! the device run asynchronously (downloads on the copy stream, overlapping later
//! kernels) and are tracked per element range, so host code only sees finished data.
//! [`GpuBuffer`] owns device memory; kernels take borrowed views
//! ([`DevSlice`], [`DevSliceMut`]) so outputs cannot alias inputs. One Rust
//! module per PTX file ([`lstm`], [`softmax`], [`fp16`], [`optim`], [`gemm`],
//! [`model_ops`]) embeds the file with `include_str!`, declares every entry's
//! parameter list ([`KernelSignature`]) and, with the `cuda` feature, holds the
//! typed launchers that check lengths and return [`Error`] instead of launching
//! bad work.
//!
//! # Layers
//!
//! With the `cuda` feature the runtime is built in layers, each module using only
//! the ones below it (as in cust, whose `context`, `stream` and `memory` sit below
//! `module` and `function`):
//!
//! 1. `context` (private): driver error checks, and one device's context with its
//!    compute and copy streams.
//! 2. `memory` ([`GpuBuffer`], [`DevSlice`], [`DevSliceMut`], [`Element`]), and
//!    `pinned` ([`PinnedBuffer`]) on top of it: buffers hold their device's context
//!    to copy on its streams, wait for them and free; they know nothing of modules
//!    or launches.
//! 3. `runtime`: [`Gpu`] (the context plus the module cache, one shared `Gpu` per
//!    device index), [`LaunchConfig`], [`KernelArg`] and [`Gpu::launch`]. Its
//!    memory methods ([`Gpu::alloc`], [`Gpu::upload`], [`Gpu::pinned`], ...)
//!    forward to layer 2.
//! 4. The launchers, one module per PTX file (`fp16` also owns [`NonFiniteFlag`],
//!    the one-word buffer its kernels set), and `timing` ([`GpuTimer`]).
//!
//! `error` and `signature` (the entries' declarations, also built without the
//! `cuda` feature) sit below all of them.
//!
//! # Features
//!
//! * default (no features): the PTX texts, the signature table and the PTX
//!   entry parser. This needs no CUDA installation, so the check that every
//!   `.entry` matches its declaration runs in plain `cargo test`.
//! * `cuda`: adds cust, the runtime and the launchers. cust links `libcuda`, so
//!   binaries built with it start only where an NVIDIA driver is installed
//!   (`scripts/build-gpu-bundle` builds them against a stub library here).
//!
//! # Example
//!
//! Without a GPU: every PTX entry agrees with its Rust declaration.
//!
//! ```
//! use ringtrain_cuda::{lstm, Param, MODULES};
//!
//! for module in MODULES {
//!     module.verify()?; // parses the PTX text and compares every .entry
//! }
//! let fwd = lstm::MODULE.kernel("lstm_pointwise_forward")?;
//! assert_eq!(fwd.params.len(), 8);
//! assert_eq!(fwd.params[6], Param::U32); // batch
//! # Ok::<(), ringtrain_cuda::Error>(())
//! ```
//!
//! With the `cuda` feature and a GPU: an LSTM step's pointwise part.
//!
//! ```no_run
//! # #[cfg(feature = "cuda")]
//! # fn main() -> ringtrain_cuda::Result<()> {
//! use ringtrain_cuda::{lstm, Gpu, GpuTimer};
//!
//! let (batch, hidden) = (64, 512);
//! let gpu = Gpu::new(0)?; // context + stream of device 0
//! let gates = gpu.upload(&vec![0.1f32; batch * 4 * hidden])?;
//! let bias = gpu.zeros::<f32>(4 * hidden)?;
//! let c_prev = gpu.zeros::<f32>(batch * hidden)?;
//! let mut c = gpu.alloc::<f32>(batch * hidden)?;
//! let mut h = gpu.alloc::<f32>(batch * hidden)?;
//! let mut act = gpu.alloc::<f32>(batch * 4 * hidden)?;
//!
//! let timer = GpuTimer::new(&gpu)?;
//! timer.start()?;
//! lstm::lstm_pointwise_forward(
//!     &gpu, &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
//! )?;
//! timer.stop()?;
//! println!("{} ms, h[0] = {}", timer.elapsed_ms()?, h.to_host()?[0]);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "cuda"))]
//! # fn main() {}
//! ```
#![warn(missing_docs)]
// The launchers mirror the CPU kernels' argument lists, which are long by design.
#![allow(clippy::too_many_arguments)]

mod error;
pub mod signature;

pub mod fp16;
pub mod gemm;
pub mod lstm;
pub mod model_ops;
pub mod optim;
pub mod softmax;

#[cfg(feature = "cuda")]
mod context;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
mod runtime;
#[cfg(feature = "cuda")]
mod timing;

pub use error::{Error, Result};
pub use gemm::Transpose;
pub use signature::{
    compare_entries, parse_ptx_entries, KernelSignature, Param, ParsedEntry, PtxModule,
};

#[cfg(feature = "cuda")]
pub use fp16::NonFiniteFlag;
#[cfg(feature = "cuda")]
pub use memory::{AsDevSlice, AsDevSliceMut, DevSlice, DevSliceMut, Element, GpuBuffer};
#[cfg(feature = "cuda")]
pub use pinned::PinnedBuffer;
#[cfg(feature = "cuda")]
pub use runtime::{Gpu, KernelArg, LaunchConfig};
#[cfg(feature = "cuda")]
pub use timing::GpuTimer;

/// Every PTX module of the crate, in `ptx/` file-name order.
pub const MODULES: [&PtxModule; 6] = [
    &fp16::MODULE,
    &gemm::MODULE,
    &lstm::MODULE,
    &model_ops::MODULE,
    &optim::MODULE,
    &softmax::MODULE,
];
