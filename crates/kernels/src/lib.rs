//! CPU kernels for ringtrain: the LSTM cell's pointwise part, softmax cross-entropy,
//! f16/bf16 casts with a loss scale, optimizer steps on f32 master weights, and the
//! element-wise reductions the collectives apply.
//!
//! They are pure functions on slices: no allocation in the hot paths, no I/O, no global
//! state, `#![no_std]`. They serve twice: as the CPU backend's fast path, and as the
//! reference the GPU (PTX) kernels are tested against, which use the same names, argument
//! order and layouts.
//!
//! ```
//! use ringtrain_kernels::{init_lstm_bias, lstm_pointwise_forward, softmax_xent_forward};
//!
//! // One LSTM step for batch 2, hidden 3: `gates` holds x·W_ih + h_prev·W_hh.
//! let (batch, hidden) = (2, 3);
//! let gates = vec![0.5f32; batch * 4 * hidden];
//! let mut bias = vec![0.0f32; 4 * hidden];
//! init_lstm_bias(&mut bias, hidden, ringtrain_kernels::DEFAULT_FORGET_BIAS)?;
//! let c_prev = vec![0.0f32; batch * hidden];
//! let (mut c, mut h) = (vec![0.0f32; batch * hidden], vec![0.0f32; batch * hidden]);
//! let mut act = vec![0.0f32; batch * 4 * hidden];
//! lstm_pointwise_forward(&gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden)?;
//! assert!(h.iter().all(|&v| v > 0.0 && v < 1.0));
//!
//! // Cross-entropy of two rows over a vocabulary of 4; the second row is padding.
//! let logits = [1.0f32, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0];
//! let (mut loss, mut lse) = ([0.0f32; 2], [0.0f32; 2]);
//! softmax_xent_forward(&logits, &[3, 0], &[1.0, 0.0], &mut loss, &mut lse, 2, 4)?;
//! assert!((loss[0] - 0.4401897).abs() < 1e-6);
//! assert_eq!(loss[1], 0.0);
//! # Ok::<(), ringtrain_kernels::Error>(())
//! ```
//!
//! # Layouts and conventions
//!
//! - **Row-major everywhere.** A `[rows, cols]` matrix keeps element `(r, c)` at
//!   `r * cols + c`; `[steps, batch, 4H]` keeps `(t, b, n)` at `(t * batch + b) * 4H + n`.
//! - **LSTM gate order `i, f, g, o`.** A `[batch, 4H]` row holds four blocks, each `H`
//!   (= `hidden`) wide: gate k (i = 0, f = 1, g = 2, o = 3), unit j, batch row b is at
//!   `b * 4H + k * H + j`. The input, forget and output gates use the logistic sigmoid,
//!   the candidate g uses tanh; `c = f * c_prev + i * g` and `h = o * tanh(c)`.
//! - **LSTM weights** (reference cell): `w_ih: [input, 4H]`, `w_hh: [H, 4H]`, so
//!   `gates = x·w_ih + h_prev·w_hh + bias`.
//! - **Forget-gate bias.** [`init_lstm_bias`] sets the bias to zero except the forget
//!   block (`bias[H..2H]`), which gets [`DEFAULT_FORGET_BIAS`] = 1.0 unless the caller
//!   chooses otherwise.
//! - **Softmax rows** are `[rows, vocab]` logits with `u32` labels and an f32 mask per
//!   row (1.0 real token, 0.0 padding).
//! - **Half precision** is `half::f16` / `half::bf16`; narrowing rounds to nearest, ties to
//!   even.
//!
//! # Math and determinism
//!
//! All arithmetic is f32 (optimizer scalars and norms are formed in f64), and the results
//! are the same bits with and without `std`:
//! - `exp`, `tanh` and the sigmoid in the softmax and LSTM loops are the crate's own
//!   branch-free polynomial versions (within 2 ulp for `exp` and 4 ulp for `tanh` of the
//!   exact value, checked against f64 in the tests), because a library call per element
//!   would stop those loops from vectorising;
//! - `log` (once per softmax row) and `pow` come from the `libm` crate;
//! - `sqrt` is correctly rounded by IEEE 754, so `f32::sqrt` (with `std`, vectorisable)
//!   and `libm::sqrtf` (without) give the same bits.
//!
//! None of the arithmetic is contracted into FMA (Rust never does that on its own), so
//! building with wider vectors (`RUSTFLAGS="-C target-cpu=native"`) changes the speed, not
//! the bits. The same holds at run time: with `std` on x86-64, the LSTM and softmax row
//! kernels, the bf16 cast and the bf16 product's packing are compiled a second time for
//! AVX-512 (F, BW, DQ, VL), and that twin runs where the CPU has it (Intel Skylake-SP and
//! later Xeons, AMD Zen 4 and Zen 5); a plain build for the x86-64 baseline gets the
//! 512-bit loops without `target-cpu`.
//!
//! Reductions inside a row use a fixed order of interleaved lanes. The `par` module
//! (feature `rayon`) splits work over rows or fixed blocks only, so its results equal the
//! serial kernels bit for bit. Compare GPU results with these kernels bit for bit only for
//! the casts and reductions; the transcendental kernels agree to a few ulp.
//!
//! # Errors
//!
//! Every kernel checks all slice lengths (and label ranges) before it writes anything and
//! returns [`Error::ShapeMismatch`] naming the first wrong argument,
//! [`Error::LabelOutOfRange`] or [`Error::InvalidValue`].
//!
//! # Features
//!
//! - `alloc`: [`lstm_cell_reference`], and [`gemm_bf16`]: matrix products of bf16
//!   operands with f32 accumulation (AMX-BF16 tiles on Intel Sapphire Rapids and later
//!   Xeons under Linux, else AVX-512 BF16 or f32 multiply-adds of the widened operands on
//!   AVX-512 or AVX2, whichever the CPU has and runs faster, detected at run time with
//!   `std`; a portable path everywhere).
//! - `std` (default): `alloc`, plus `std::error::Error` through `thiserror`, and the CPU
//!   feature detection of the bf16 product (on Linux, `libc` asks for the AMX tile state).
//! - `rayon`: `std`, plus the parallel twins in `par`.
#![no_std]
#![warn(missing_docs)]

#[cfg(feature = "alloc")]
extern crate alloc;
#[cfg(feature = "std")]
extern crate std;

mod error;
#[cfg(feature = "alloc")]
pub mod gemm_bf16;
pub mod lstm;
pub mod optim;
#[cfg(feature = "rayon")]
pub mod par;
pub mod precision;
pub mod reduce;
pub mod softmax;
mod vector_math;
mod wide;

pub use error::{Error, Result, Value};
pub use lstm::*;
pub use optim::*;
pub use precision::*;
pub use reduce::*;
pub use softmax::*;

/// The half-precision types the kernels use (re-exported from `half`).
pub use half::{bf16, f16};
