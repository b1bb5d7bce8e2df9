//! ringtrain-model: the models ringtrain trains, on a pluggable compute [`Backend`].
//!
//! - [`Backend`]: buffers, matrix products and the ringtrain-kernels operations, on
//!   operands that are views ([`View`], [`ViewMut`]: a buffer and a 2-D strided
//!   [`Layout`] inside it), checked by code both backends share. [`CpuBackend`] runs them
//!   with ringtrain-kernels (their rayon twins on more than one thread) and the `gemm`
//!   crate; [`CudaBackend`] (feature `cuda`) runs them as the PTX kernels of ringtrain-cuda
//!   on one GPU; without the feature it returns [`Error::NotCompiledWithCuda`].
//! - LSTM layers in two implementations with the same numbers and different launch
//!   counts ([`LstmImpl::Fused`], cuDNN-style; [`LstmImpl::Stepwise`], TF `dynamic_rnn`-style).
//!   What the model computes is chosen apart from them: [`SourceLengths`] (whether the
//!   encoder stops at each sentence's real end) and [`BiLayerInput`] (what the upper
//!   layers of a bi encoder read). The RNNLM carries its LSTM state from window to window
//!   ([`LmState`]).
//! - [`NmtModel`]: the NMT encoder-decoder (bi or uni encoder, no attention) and [`RnnLm`],
//!   both with a bias-free output projection and the summed masked softmax cross-entropy.
//!   A pass checks its batch ([`NmtBatchView`], [`LmBatchView`]) once and stages its ids
//!   and targets on the backend once ([`CheckedIds`], [`Backend::stage_ids`]), for forward
//!   and backward.
//! - Parameters: a named, ordered list ([`ParamLayout`]) laid out in ONE flat parameter
//!   buffer and ONE flat gradient buffer, in the order backward finishes the gradients
//!   (projection first, embeddings last), so a trainer can start reducing the first
//!   ranges while backward still runs (the `on_grads_ready` callback of
//!   [`Model::forward_backward`]).
//!
//! Conventions: matrices row-major; batches time-major (token (t, b) at `t * batch + b`);
//! LSTM gate blocks `i | f | g | o`; the loss is the SUM over target tokens (the reported
//! loss is `loss_sum / tokens`) and gradients are those of the sum.
//!
//! ```
//! use ringtrain_model::{
//!     BiLayerInput, CpuBackend, EncoderKind, LstmImpl, Model, NmtBatchView, NmtConfig, NmtModel,
//!     SourceLengths,
//! };
//!
//! let config = NmtConfig {
//!     src_vocab: 12, tgt_vocab: 10, emb: 8, hidden: 8, layers: 2,
//!     encoder: EncoderKind::Bi, lstm: LstmImpl::Fused, source_lengths: SourceLengths::On,
//!     bi_layer_input: BiLayerInput::Concat, init_scale: 0.1, forget_bias: 1.0,
//! };
//! let mut model = NmtModel::new(CpuBackend::new(1)?, config, 42)?;
//! // 2 sentences, source length 3, target length 2, time-major.
//! let src = [1, 2, 3, 4, 5, 6];
//! let tgt_in = [0, 0, 7, 8];
//! let tgt_out = [7, 8, 1, 1];
//! let mask = [1.0, 1.0, 1.0, 0.0];
//! let lengths = [3, 2]; // the second sentence's last source token is padding
//! let batch = NmtBatchView {
//!     batch: 2, src_len: 3, tgt_len: 2, src: &src, tgt_in: &tgt_in, tgt_out: &tgt_out,
//!     tgt_mask: &mask, src_lengths: Some(&lengths),
//! };
//! let mut ready = Vec::new();
//! let stats = model.forward_backward(&batch, &mut |range, _grads: &Vec<f32>| ready.push(range))?;
//! assert_eq!(stats.tokens, 3.0);
//! assert!((stats.mean_loss() - (10f64).ln()).abs() < 0.1); // near uniform at init
//! assert_eq!(ready.first().map(|r| r.start), Some(0));
//! assert_eq!(ready.last().map(|r| r.end), Some(model.layout().total_len()));
//! # Ok::<(), ringtrain_model::Error>(())
//! ```
//!
//! The backend on its own: operands are views of buffers; `.t()` transposes one for free.
//!
//! ```
//! use ringtrain_model::{view, view_mut, Backend, CpuBackend, Layout};
//!
//! let cpu = CpuBackend::new(1)?;
//! let a = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // [2, 3]
//! let mut c = vec![0.0; 4];
//! // C = A·Aᵀ: [2, 3]·[3, 2]
//! cpu.gemm(
//!     view(&a, Layout::matrix(0, 2, 3)),
//!     view(&a, Layout::matrix(0, 2, 3)).t(),
//!     view_mut(&mut c, Layout::matrix(0, 2, 2)),
//!     false,
//! )?;
//! assert_eq!(c, [14.0, 32.0, 32.0, 77.0]);
//! // A view past the end of its buffer is an error naming the operand, not a panic.
//! let err = cpu.sum(view(&a, Layout::contiguous(4, 3))).unwrap_err();
//! assert!(err.to_string().contains("sum source"));
//! # Ok::<(), ringtrain_model::Error>(())
//! ```
#![warn(missing_docs)]

pub mod backend;
mod embedding;
mod error;
pub mod lstm;
mod lstm_lm;
pub mod memory;
mod model;
pub mod nmt;
pub mod params;
pub mod rnnlm;
pub mod stage;

pub use backend::{
    view, view_mut, Backend, Bf16Casts, Binary, CheckedIds, CheckedTargets, CpuBackend,
    CudaBackend, Executor, GemmPrecision, InPlace, Layout, LstmBackwardStep, LstmForwardStep,
    Staged, Unary, View, ViewMut,
};
pub use embedding::LOGITS_CHUNK_ELEMENTS;
pub use error::{Error, Result};
pub use lstm::LstmImpl;
pub use memory::{MemoryEstimate, MemoryTerm};
pub use model::{GradsReady, Model, StepStats};
pub use nmt::{BiLayerInput, EncoderKind, NmtBatchView, NmtConfig, NmtModel, SourceLengths};
pub use params::{ParamEntry, ParamInit, ParamLayout};
pub use rnnlm::{LmBatchView, LmConfig, LmState, RnnLm};
pub use stage::{PipelineModel, PipelineUnit};
