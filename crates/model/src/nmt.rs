//! The NMT encoder-decoder (no attention) of the benchmark the users ran.
//!
//! Source and target embeddings `[vocab, emb]`; an encoder that is either
//! - uni: `layers` stacked LSTM layers whose final states initialise the decoder's layers
//!   one to one, or
//! - bi: `layers / 2` layers per direction; a layer above the first reads, by
//!   [`BiLayerInput`], both directions of the layer below side by side (`concat`, `2H`
//!   wide: the seeds' `cudnn_lstm` encoder) or only its own direction's (`own`: TF's
//!   `bidirectional_dynamic_rnn` over multi-layer cells, the seeds' `dynamic_rnn`); final
//!   states are interleaved fw0, bw0, fw1, bw1, ... and become the initial `(h, c)` of
//!   decoder layers 0, 1, 2, 3, ...;
//!
//! a decoder of `layers` LSTM layers over the target input (BOS + target); an output
//! projection `hidden -> tgt_vocab` without bias over all target positions (computed a
//! chunk of rows at a time, see [`crate::LOGITS_CHUNK_ELEMENTS`]); and the summed masked
//! softmax cross-entropy against the target output (target + EOS).
//! Encoder outputs are not otherwise used.
//!
//! Source padding, by [`SourceLengths`]: `off` processes it like any token (cuDNN's LSTM,
//! the seeds' `cudnn_lstm`); `on` reads each sentence only up to its real length
//! ([`NmtBatchView::src_lengths`], as TF's `dynamic_rnn` with `sequence_length`): padded
//! positions leave every encoder layer's state unchanged and get no gradient, the forward
//! direction hands the decoder its state at the last real token, and the backward
//! direction starts there from zeros. Both are semantics of the model, not of the LSTM
//! implementation: [`LstmImpl::Fused`] and [`LstmImpl::Stepwise`] compute the same
//! function for every combination.

use crate::backend::{view, view_mut, Backend, CheckedIds, CheckedTargets, InPlace, Layout};
use crate::embedding::{Embedding, EmbeddingWork};
use crate::error::{batch_error, invalid_value, Result};
use crate::lstm::{GradTarget, InitState, LayerInput, LstmImpl, LstmLayer, LstmWork, StepMask};
use crate::lstm_lm::{LstmLm, LstmLmShape, LstmLmWork};
use crate::memory::{self, MemoryEstimate};
use crate::model::{
    check_init, check_len, check_positive, check_sizes, impl_model, GradsReady, Model, StepStats,
};
use crate::params::ParamLayout;
use crate::stage::{
    check_boundary, check_units, units_from_layout, write_from, BoundaryReader, PipelineModel,
    PipelineUnit,
};
use std::ops::Range;

/// Encoder kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncoderKind {
    /// Bidirectional: `layers / 2` layers per direction.
    #[default]
    Bi,
    /// Unidirectional: `layers` layers.
    Uni,
}

impl EncoderKind {
    /// The name [`std::str::FromStr`] reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            EncoderKind::Bi => "bi",
            EncoderKind::Uni => "uni",
        }
    }
}

impl std::fmt::Display for EncoderKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for EncoderKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "bi" => Ok(EncoderKind::Bi),
            "uni" => Ok(EncoderKind::Uni),
            other => Err(invalid_value("encoder", other, "use `bi` or `uni`")),
        }
    }
}

/// Whether the encoder reads each source sentence only up to its real length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceLengths {
    /// Padding is processed like any token (cuDNN's LSTM; the seeds' `cudnn_lstm`).
    #[default]
    Off,
    /// Padded positions neither change the encoder state nor get gradient (TF's
    /// `dynamic_rnn` with `sequence_length`; the seeds' `dynamic_rnn`).
    On,
}

impl SourceLengths {
    /// The name [`std::str::FromStr`] reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            SourceLengths::Off => "off",
            SourceLengths::On => "on",
        }
    }
}

impl std::fmt::Display for SourceLengths {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SourceLengths {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(SourceLengths::Off),
            "on" => Ok(SourceLengths::On),
            other => Err(invalid_value("source_lengths", other, "use `on` or `off`")),
        }
    }
}

/// What a bi encoder layer above the first reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BiLayerInput {
    /// Its own direction's layer below, `H` wide (TF's `bidirectional_dynamic_rnn` over
    /// multi-layer cells; the seeds' `dynamic_rnn`).
    #[default]
    Own,
    /// Both directions of the layer below side by side, `2H` wide (cuDNN's bidirectional
    /// LSTM; the seeds' `cudnn_lstm`).
    Concat,
}

impl BiLayerInput {
    /// The name [`std::str::FromStr`] reads back.
    pub fn as_str(self) -> &'static str {
        match self {
            BiLayerInput::Own => "own",
            BiLayerInput::Concat => "concat",
        }
    }
}

impl std::fmt::Display for BiLayerInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for BiLayerInput {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "own" => Ok(BiLayerInput::Own),
            "concat" => Ok(BiLayerInput::Concat),
            other => Err(invalid_value(
                "bi_layer_input",
                other,
                "use `concat` or `own`",
            )),
        }
    }
}

/// Sizes and choices of an [`NmtModel`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NmtConfig {
    /// Source vocabulary size.
    pub src_vocab: usize,
    /// Target vocabulary size (projection width).
    pub tgt_vocab: usize,
    /// Embedding width.
    pub emb: usize,
    /// LSTM hidden units.
    pub hidden: usize,
    /// Decoder layers; the encoder has as many (bi: half per direction).
    pub layers: usize,
    /// Encoder kind.
    pub encoder: EncoderKind,
    /// LSTM implementation of every layer.
    pub lstm: LstmImpl,
    /// Whether the encoder stops at each sentence's real end.
    #[serde(default)]
    pub source_lengths: SourceLengths,
    /// What bi encoder layers above the first read (no effect on a uni encoder).
    #[serde(default)]
    pub bi_layer_input: BiLayerInput,
    /// Half-width of the uniform initialisation (TF NMT: 0.1).
    pub init_scale: f32,
    /// Initial value of the LSTM forget-gate bias (TF's `forget_bias`, 1.0).
    pub forget_bias: f32,
}

impl NmtConfig {
    /// Registers the model's tensors in `layout`, in backward order.
    fn register(&self, layout: &mut ParamLayout) -> Result<(LstmLm, Vec<LstmLayer>, Embedding)> {
        let c = self;
        let shape = LstmLmShape {
            vocab: c.tgt_vocab,
            emb: c.emb,
            hidden: c.hidden,
            layers: c.layers,
            init_scale: c.init_scale,
            forget_bias: c.forget_bias,
        };
        let decoder = LstmLm::register(layout, "decoder", "embedding/tgt", &shape)?;
        let (depth, stride) = c.encoder_shape();
        let mut encoder = Vec::with_capacity(c.layers);
        for d in (0..depth).rev() {
            let input = if d == 0 {
                c.emb
            } else {
                c.hidden * c.sources_per_layer()
            };
            let mut group = Vec::with_capacity(stride);
            for r in 0..stride {
                let name = match c.encoder {
                    EncoderKind::Uni => format!("encoder/layer_{d}"),
                    EncoderKind::Bi => {
                        format!("encoder/{}/layer_{d}", if r == 0 { "fw" } else { "bw" })
                    }
                };
                group.push(LstmLayer::register(
                    layout,
                    &name,
                    input,
                    c.hidden,
                    r == 1,
                    c.init_scale,
                    c.forget_bias,
                )?);
            }
            encoder.push(group);
        }
        encoder.reverse();
        let encoder: Vec<LstmLayer> = encoder.into_iter().flatten().collect();
        let src_emb =
            Embedding::register(layout, "embedding/src", c.src_vocab, c.emb, c.init_scale)?;
        Ok((decoder, encoder, src_emb))
    }

    /// How many layers below an encoder layer above the first reads: 2 for a bi encoder
    /// with `concat`, else 1.
    fn sources_per_layer(&self) -> usize {
        match (self.encoder, self.bi_layer_input) {
            (EncoderKind::Bi, BiLayerInput::Concat) => 2,
            _ => 1,
        }
    }

    /// (depth, layers per depth) of the encoder.
    fn encoder_shape(&self) -> (usize, usize) {
        match self.encoder {
            EncoderKind::Uni => (self.layers, 1),
            EncoderKind::Bi => (self.layers / 2, 2),
        }
    }

    /// The number of parameters (f32 values) of the model.
    ///
    /// # Errors
    /// `InvalidValue` for a bad config, or one whose count does not fit in `usize`.
    pub fn param_count(&self) -> Result<usize> {
        self.validate()?;
        let mut layout = ParamLayout::new();
        self.register(&mut layout)?;
        Ok(layout.total_len())
    }

    /// The memory a model of this config needs to train on batches of `batch` sentences
    /// of at most `src_len` / `tgt_len` tokens: parameters, gradients and the forward
    /// and backward workspaces (of the model itself: optimizer state and gradient
    /// exchange buffers are the trainer's to add).
    ///
    /// # Errors
    /// As [`NmtConfig::param_count`].
    pub fn memory_estimate(
        &self,
        batch: usize,
        src_len: usize,
        tgt_len: usize,
    ) -> Result<MemoryEstimate> {
        let params = self.param_count()? as f64;
        let (depth, stride) = self.encoder_shape();
        let mut est = MemoryEstimate::default();
        est.add_f32("parameters", params);
        est.add_f32("gradients", params);
        est.add_f32(
            "encoder activations",
            memory::embedding_work_elements(src_len * batch, self.emb)
                + (depth * stride) as f64 * memory::lstm_work_elements(self.hidden, src_len, batch),
        );
        est.add_f32(
            "decoder activations",
            memory::embedding_work_elements(tgt_len * batch, self.emb)
                + self.layers as f64 * memory::lstm_work_elements(self.hidden, tgt_len, batch),
        );
        est.add_f32(
            "output projection",
            memory::projection_work_elements(tgt_len * batch, self.hidden, self.tgt_vocab),
        );
        if self.source_lengths == SourceLengths::On {
            let rows = (src_len * batch) as f64;
            est.add_f32(
                "source length masks",
                2.0 * rows * self.hidden as f64 + 2.0 * rows + self.hidden as f64,
            );
        }
        Ok(est)
    }

    /// Elements of the largest activation operand a matrix product of the training step
    /// reads, at the same batch shape as [`NmtConfig::memory_estimate`]: a chunk of the
    /// logits' gradient (at most [`crate::LOGITS_CHUNK_ELEMENTS`] of the `batch x
    /// tgt_len` rows of `tgt_vocab`), or the gates of the longer sequence's LSTM layers
    /// (4 x hidden per row), or an embedded sequence.
    pub fn largest_gemm_operand(&self, batch: usize, src_len: usize, tgt_len: usize) -> f64 {
        let (b, steps) = (batch as f64, src_len.max(tgt_len) as f64);
        let widest = (4 * self.hidden).max(self.emb) as f64;
        memory::logits_chunk_elements(batch * tgt_len, self.tgt_vocab).max(b * steps * widest)
    }

    /// The CPU benchmark configuration: vocab 8000 each side, emb 256, hidden 256,
    /// 2 layers, bi encoder, fused LSTM, padding processed.
    pub fn benchmark() -> Self {
        NmtConfig {
            src_vocab: 8000,
            tgt_vocab: 8000,
            emb: 256,
            hidden: 256,
            layers: 2,
            encoder: EncoderKind::Bi,
            lstm: LstmImpl::Fused,
            source_lengths: SourceLengths::Off,
            bi_layer_input: BiLayerInput::Own,
            init_scale: 0.1,
            forget_bias: ringtrain_kernels::DEFAULT_FORGET_BIAS,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// `InvalidValue` naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        check_sizes(&[
            ("src_vocab", self.src_vocab),
            ("tgt_vocab", self.tgt_vocab),
            ("emb", self.emb),
            ("hidden", self.hidden),
            ("layers", self.layers),
        ])?;
        if self.encoder == EncoderKind::Bi && !self.layers.is_multiple_of(2) {
            return Err(invalid_value(
                "layers",
                self.layers,
                "a bi encoder needs an even layer count (layers/2 per direction): use an even number or encoder uni",
            ));
        }
        check_init(
            self.init_scale,
            self.forget_bias,
            "must be finite and >= 0 (TF NMT uses 0.1)",
        )
    }
}

/// One NMT batch borrowed from the caller, time-major: token (t, b) at `t * batch + b`.
/// (`ringtrain_data::NmtBatch` is the owned batch the data pipeline makes, in the same
/// layout: the trainer lends its arrays to a view without copying.)
#[derive(Debug, Clone, Copy)]
pub struct NmtBatchView<'a> {
    /// Sentences in the batch.
    pub batch: usize,
    /// Source steps.
    pub src_len: usize,
    /// Target steps.
    pub tgt_len: usize,
    /// Source ids `[src_len * batch]`.
    pub src: &'a [u32],
    /// Decoder input ids (BOS + target) `[tgt_len * batch]`.
    pub tgt_in: &'a [u32],
    /// Decoder output ids (target + EOS) `[tgt_len * batch]`.
    pub tgt_out: &'a [u32],
    /// Target weights `[tgt_len * batch]`: 1.0 real token, 0.0 padding.
    pub tgt_mask: &'a [f32],
    /// Real source tokens of each sentence (`[batch]`, each at most `src_len`; padding
    /// follows them). Required when the model uses [`SourceLengths::On`], ignored
    /// otherwise.
    pub src_lengths: Option<&'a [usize]>,
}

/// A checked batch with its ids and targets staged on the backend, for one pass.
struct StagedNmt<B: Backend> {
    batch: usize,
    src_len: usize,
    tgt_len: usize,
    src: B::Ids,
    tgt_in: B::Ids,
    tgt_out: B::Targets,
    tokens: f64,
    /// With source lengths: 1.0 at real source positions, 0.0 at padding, `[src_len *
    /// batch]` time-major.
    keep: Option<Vec<f32>>,
}

/// The step masks of source lengths on the backend: `keep`/`hold` `[steps * batch, H]`,
/// made per pass as the outer products of the `[steps * batch]` columns with `ones`.
struct SourceMasks<Buf> {
    keep: Buf,
    hold: Buf,
    keep_col: Buf,
    hold_col: Buf,
    ones: Buf,
}

struct NmtWork<Buf> {
    src_len: usize,
    tgt_len: usize,
    batch: usize,
    src_emb: EmbeddingWork<Buf>,
    encoder: Vec<LstmWork<Buf>>,
    decoder: LstmLmWork<Buf>,
    masks: Option<SourceMasks<Buf>>,
}

/// The NMT encoder-decoder on backend `B` (see the module docs).
pub struct NmtModel<B: Backend> {
    backend: B,
    config: NmtConfig,
    layout: ParamLayout,
    params: B::Buffer,
    grads: B::Buffer,
    /// Target embedding, decoder layers and output projection.
    decoder: LstmLm,
    /// Uni: layer l at index l. Bi: depth d, direction r (0 fw, 1 bw) at `2d + r`.
    encoder: Vec<LstmLayer>,
    src_emb: Embedding,
    work: Option<NmtWork<B::Buffer>>,
}

impl<B: Backend> NmtModel<B> {
    /// Builds the model and initialises its parameters from `seed`.
    ///
    /// # Errors
    /// `InvalidValue` for a bad config; backend errors.
    pub fn new(backend: B, config: NmtConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut layout = ParamLayout::new();
        let (decoder, encoder, src_emb) = config.register(&mut layout)?;
        let params = backend.zeros(layout.total_len())?;
        let grads = backend.zeros(layout.total_len())?;
        let mut model = NmtModel {
            backend,
            config,
            layout,
            params,
            grads,
            decoder,
            encoder,
            src_emb,
            work: None,
        };
        model.init_params(seed)?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &NmtConfig {
        &self.config
    }

    /// Checks `b` and stages its ids and targets on the backend.
    fn stage(&self, b: &NmtBatchView<'_>) -> Result<StagedNmt<B>> {
        check_positive("batch", b.batch)?;
        check_positive("src_len", b.src_len)?;
        check_positive("tgt_len", b.tgt_len)?;
        let src_rows = b.src_len * b.batch;
        let tgt_rows = b.tgt_len * b.batch;
        check_len("src", b.src, src_rows, "src_len * batch")?;
        check_len("tgt_in", b.tgt_in, tgt_rows, "tgt_len * batch")?;
        check_len("tgt_out", b.tgt_out, tgt_rows, "tgt_len * batch")?;
        check_len("tgt_mask", b.tgt_mask, tgt_rows, "tgt_len * batch")?;
        let c = &self.config;
        let src = CheckedIds::new("src", b.src, c.src_vocab)?;
        let tgt_in = CheckedIds::new("tgt_in", b.tgt_in, c.tgt_vocab)?;
        let tgt_out = CheckedTargets::new("tgt_out", b.tgt_out, b.tgt_mask, c.tgt_vocab)?;
        let keep = match c.source_lengths {
            SourceLengths::Off => None,
            SourceLengths::On => Some(source_keep_mask(b)?),
        };
        let be = &self.backend;
        Ok(StagedNmt {
            batch: b.batch,
            src_len: b.src_len,
            tgt_len: b.tgt_len,
            src: be.stage_ids(src)?,
            tgt_in: be.stage_ids(tgt_in)?,
            tgt_out: be.stage_targets(tgt_out)?,
            tokens: b.tgt_mask.iter().map(|&m| f64::from(m)).sum(),
            keep,
        })
    }

    /// Workspaces big enough for `b` (allocated only when a batch outgrows them).
    fn ensure_work(&mut self, b: &StagedNmt<B>) -> Result<()> {
        let (mut src_len, mut tgt_len, mut batch) = (b.src_len, b.tgt_len, b.batch);
        if let Some(w) = &self.work {
            if b.src_len <= w.src_len && b.tgt_len <= w.tgt_len && b.batch <= w.batch {
                return Ok(());
            }
            src_len = src_len.max(w.src_len);
            tgt_len = tgt_len.max(w.tgt_len);
            batch = batch.max(w.batch);
        }
        self.work = None;
        let be = &self.backend;
        let (h, e) = (self.config.hidden, self.config.emb);
        let work = NmtWork {
            src_len,
            tgt_len,
            batch,
            src_emb: EmbeddingWork::new(be, src_len * batch, e)?,
            encoder: (0..self.encoder.len())
                .map(|_| LstmWork::new(be, h, src_len, batch))
                .collect::<Result<_>>()?,
            decoder: self.decoder.work(be, tgt_len, batch)?,
            masks: match self.config.source_lengths {
                SourceLengths::Off => None,
                SourceLengths::On => {
                    let rows = src_len * batch;
                    let mut ones = be.zeros(h)?;
                    be.upload(&vec![1.0; h], &mut ones, 0)?;
                    Some(SourceMasks {
                        keep: be.zeros(rows * h)?,
                        hold: be.zeros(rows * h)?,
                        keep_col: be.zeros(rows)?,
                        hold_col: be.zeros(rows)?,
                        ones,
                    })
                }
            },
        };
        self.work = Some(work);
        Ok(())
    }

    /// Forward pass; returns (loss sum, tokens).
    fn forward(&mut self, b: &StagedNmt<B>, differentiate: bool) -> Result<(f64, f64)> {
        let loss = self.forward_units(b, 0..self.unit_count(), differentiate)?;
        Ok((loss.unwrap_or(0.0), b.tokens))
    }

    /// The pipeline units: the encoder (with the source embedding), the decoder layers
    /// (the first with the target embedding), the projection with the loss.
    fn unit_count(&self) -> usize {
        self.config.layers + 2
    }

    /// The decoder network's units (see [`LstmLm::unit_count`]) of the model's `units`.
    fn decoder_units(units: &Range<usize>) -> Range<usize> {
        let start = if units.start <= 1 { 0 } else { units.start };
        start..units.end.max(start)
    }

    /// Forward over `units`; the loss when they hold the projection. A decoder layer
    /// whose encoder layer is not among them reads the encoder's final state where the
    /// encoder would have left it in the work (a pipeline stage puts it there).
    fn forward_units(
        &mut self,
        b: &StagedNmt<B>,
        units: Range<usize>,
        differentiate: bool,
    ) -> Result<Option<f64>> {
        self.ensure_work(b)?;
        let Some(w) = self.work.as_mut() else {
            return Ok(None);
        };
        if !units.contains(&0) {
            return self.forward_decoder(b, units, differentiate);
        }
        let be = &self.backend;
        let imp = self.config.lstm;
        let (batch, ts, tt) = (b.batch, b.src_len, b.tgt_len);
        let (depth, stride) = self.config.encoder_shape();
        debug_assert!(w.encoder.iter().all(|lw| lw.fits(ts, batch)));
        debug_assert!(w.decoder.layers.iter().all(|lw| lw.fits(tt, batch)));
        self.src_emb
            .forward(be, &self.params, &b.src, &mut w.src_emb)?;
        let NmtWork {
            src_emb,
            encoder: encoder_work,
            masks,
            ..
        } = w;
        let mask = match (masks.as_mut(), b.keep.as_deref()) {
            (Some(m), Some(keep)) => Some(expand_masks(be, m, keep, self.config.hidden)?),
            _ => None,
        };
        for d in 0..depth {
            for r in 0..stride {
                let (below, rest) = encoder_work.split_at_mut(d * stride);
                let x = layer_inputs(
                    &self.config,
                    &self.encoder,
                    (d, r),
                    below,
                    &src_emb.out,
                    batch,
                );
                self.encoder[d * stride + r].forward(
                    be,
                    imp,
                    &self.params,
                    &x,
                    None,
                    mask,
                    &mut rest[r],
                    ts,
                    batch,
                )?;
            }
        }
        self.forward_decoder(b, units, differentiate)
    }

    /// The decoder part of [`Self::forward_units`].
    fn forward_decoder(
        &mut self,
        b: &StagedNmt<B>,
        units: Range<usize>,
        differentiate: bool,
    ) -> Result<Option<f64>> {
        let Some(w) = self.work.as_mut() else {
            return Ok(None);
        };
        if units.end <= 1 {
            return Ok(None);
        }
        let be = &self.backend;
        let imp = self.config.lstm;
        let (batch, ts, tt) = (b.batch, b.src_len, b.tgt_len);
        let (encoder, encoder_work) = (&self.encoder, &w.encoder);
        self.decoder.forward_units(
            be,
            imp,
            &self.params,
            &b.tgt_in,
            &b.tgt_out,
            tt,
            batch,
            &mut w.decoder,
            |l| {
                let final_offset = encoder[l].final_offset(ts, batch);
                Some(InitState {
                    h: &encoder_work[l].hiddens,
                    h_offset: final_offset,
                    c: &encoder_work[l].cells,
                    c_offset: final_offset,
                })
            },
            Self::decoder_units(&units),
            differentiate,
        )
    }

    fn backward(
        &mut self,
        b: &StagedNmt<B>,
        on_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<()> {
        self.backward_units(b, 0..self.unit_count(), on_ready)
    }

    /// Backward over `units` (after [`Self::forward_units`] over them). A stage that
    /// ends before the projection finds the gradient w.r.t. its output in the work: the
    /// decoder layer's `dh`, and `dh0`/`dc` of the decoder layers past it.
    fn backward_units(
        &mut self,
        b: &StagedNmt<B>,
        units: Range<usize>,
        on_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<()> {
        let Some(w) = self.work.as_mut() else {
            return Ok(());
        };
        let be = &self.backend;
        let imp = self.config.lstm;
        let (batch, ts, tt) = (b.batch, b.src_len, b.tgt_len);
        let bh = batch * self.config.hidden;
        let (depth, stride) = self.config.encoder_shape();
        if units.end > 1 {
            self.decoder.backward_units(
                be,
                imp,
                &self.params,
                &mut self.grads,
                &b.tgt_in,
                tt,
                batch,
                true,
                &mut w.decoder,
                on_ready,
                Self::decoder_units(&units),
            )?;
        }
        if !units.contains(&0) {
            return Ok(());
        }
        for d in (0..depth).rev() {
            for r in 0..stride {
                let i = d * stride + r;
                let layer = &self.encoder[i];
                let (below, rest) = w.encoder.split_at_mut(d * stride);
                let lw = &mut rest[r];
                let dec = &w.decoder.layers[i];
                let final_dh = Layout::contiguous(layer.final_dh_offset(ts, batch), bh);
                let state = Layout::contiguous(0, bh);
                if d + 1 == depth {
                    be.fill(view_mut(&mut lw.dh, Layout::contiguous(0, ts * bh)), 0.0)?;
                    be.copy(view(&dec.dh0, state), view_mut(&mut lw.dh, final_dh))?;
                } else {
                    be.in_place(
                        InPlace::Add,
                        view(&dec.dh0, state),
                        view_mut(&mut lw.dh, final_dh),
                    )?;
                }
                be.copy(view(&dec.dc, state), view_mut(&mut lw.dc, state))?;
                let mask = w
                    .masks
                    .as_ref()
                    .map(|m| StepMask {
                        keep: &m.keep,
                        hold: &m.hold,
                    })
                    .filter(|_| b.keep.is_some());
                let mut x = Vec::with_capacity(2);
                let mut dx = Vec::with_capacity(2);
                if d == 0 {
                    x.push(LayerInput {
                        buf: &w.src_emb.out,
                        offset: 0,
                        width: self.config.emb,
                    });
                    dx.push(GradTarget {
                        buf: &mut w.src_emb.dx,
                        offset: 0,
                        accumulate: r > 0,
                    });
                } else {
                    let lower = (d - 1) * stride;
                    let concat = self.config.sources_per_layer() == 2;
                    for (j, lower_work) in below[lower..].iter_mut().enumerate() {
                        if !concat && j != r {
                            continue;
                        }
                        let LstmWork { hiddens, dh, .. } = lower_work;
                        let source = &self.encoder[lower + j];
                        x.push(LayerInput {
                            buf: &*hiddens,
                            offset: source.output_offset(batch),
                            width: source.hidden,
                        });
                        dx.push(GradTarget {
                            buf: dh,
                            offset: 0,
                            accumulate: concat && r > 0,
                        });
                    }
                }
                layer.backward(
                    be,
                    imp,
                    &self.params,
                    &mut self.grads,
                    &x,
                    mask,
                    lw,
                    ts,
                    batch,
                    false,
                    &mut dx,
                    on_ready,
                )?;
            }
        }
        self.src_emb
            .backward(be, &mut self.grads, &b.src, &w.src_emb, on_ready)
    }
}

impl_model!(NmtModel, NmtBatchView);

/// A micro-batch of an [`NmtModel`] pipeline stage: its activations and staged batch
/// between forward and backward.
pub struct NmtSlot<B: Backend> {
    work: Option<NmtWork<B::Buffer>>,
    staged: Option<StagedNmt<B>>,
}

impl<B: Backend> Default for NmtSlot<B> {
    fn default() -> Self {
        NmtSlot {
            work: None,
            staged: None,
        }
    }
}

impl<B: Backend> NmtModel<B> {
    /// Runs `f` with `slot`'s workspace in place of the model's own.
    fn with_slot<T>(&mut self, slot: &mut NmtSlot<B>, f: impl FnOnce(&mut Self) -> T) -> T {
        std::mem::swap(&mut self.work, &mut slot.work);
        let out = f(self);
        std::mem::swap(&mut self.work, &mut slot.work);
        out
    }

    /// Moves the boundary tensor in front of unit `at` (`at >= 1`) between `data` and
    /// the work: the activations of decoder layer `at - 2` (when `at >= 2`), then the
    /// final `(h, c)` of the encoder layers of decoder layers `at - 1 ..` (forward), or
    /// their gradients (backward: `dh`, then `dh0`, `dc` of those decoder layers).
    /// `Some(reader)` uploads from it; `None` appends to `out`.
    #[allow(clippy::too_many_arguments)]
    fn move_boundary(
        &mut self,
        b: &StagedNmt<B>,
        at: usize,
        gradients: bool,
        reader: Option<&[f32]>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let Some(w) = self.work.as_mut() else {
            return Ok(());
        };
        let be = &self.backend;
        let (batch, ts, tt) = (b.batch, b.src_len, b.tgt_len);
        let bh = batch * self.config.hidden;
        let layers = self.config.layers;
        let expected = if at >= 2 { tt * bh } else { 0 } + 2 * (layers + 1 - at) * bh;
        if let Some(data) = reader {
            let name = if gradients {
                "pipeline gradients"
            } else {
                "pipeline activations"
            };
            check_boundary(name, data.len(), expected)?;
        }
        let mut reader = reader.map(BoundaryReader::new);
        let mut part = |buf: &mut B::Buffer, offset: usize, len: usize| -> Result<()> {
            match reader.as_mut() {
                Some(r) => r.read_into(be, buf, offset, len),
                None => write_from(be, buf, offset, len, out),
            }
        };
        if at >= 2 {
            if gradients {
                let (buf, offset, len) =
                    self.decoder
                        .unit_output_grad(&mut w.decoder, at - 1, tt, batch);
                part(buf, offset, len)?;
            } else {
                let (buf, offset, len) =
                    self.decoder
                        .unit_output_mut(&mut w.decoder, at - 1, tt, batch);
                part(buf, offset, len)?;
            }
        }
        for j in at - 1..layers {
            if gradients {
                let dec = &mut w.decoder.layers[j];
                part(&mut dec.dh0, 0, bh)?;
                part(&mut dec.dc, 0, bh)?;
            } else {
                let offset = self.encoder[j].final_offset(ts, batch);
                let enc = &mut w.encoder[j];
                part(&mut enc.hiddens, offset, bh)?;
                part(&mut enc.cells, offset, bh)?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> PipelineModel for NmtModel<B> {
    type Slot = NmtSlot<B>;

    fn move_activations(from: &mut NmtSlot<B>, to: &mut NmtSlot<B>) {
        to.work = from.work.take();
    }

    fn holds_activations(slot: &NmtSlot<B>) -> bool {
        slot.work.is_some()
    }

    fn activation_bytes(&self, slot: &NmtSlot<B>) -> f64 {
        slot.work.as_ref().map_or(0.0, |w| {
            crate::stage::workspace_bytes(
                self.config.memory_estimate(w.batch, w.src_len, w.tgt_len),
            )
        })
    }

    fn pipeline_units(&self) -> Vec<PipelineUnit> {
        let layers = self.config.layers;
        let mut names = vec!["source embedding + encoder".to_string()];
        names.push("target embedding + decoder layer 0".to_string());
        names.extend((1..layers).map(|l| format!("decoder layer {l}")));
        names.push("projection + loss".to_string());
        units_from_layout(&self.layout, names, |name| {
            if name == "embedding/src" || name.starts_with("encoder/") {
                Some(0)
            } else if name == "embedding/tgt" {
                Some(1)
            } else if name == "proj/kernel" {
                Some(layers + 1)
            } else {
                let rest = name.strip_prefix("decoder/layer_")?;
                let l: usize = rest.split('/').next()?.parse().ok()?;
                Some(l + 1)
            }
        })
    }

    fn stage_forward(
        &mut self,
        slot: &mut NmtSlot<B>,
        batch: &NmtBatchView<'_>,
        units: Range<usize>,
        input: &[f32],
        output: &mut Vec<f32>,
    ) -> Result<StepStats> {
        check_units(&units, self.unit_count())?;
        let start = self.backend.launches();
        let staged = self.stage(batch)?;
        self.backend.begin_pass(&self.params);
        let n = self.unit_count();
        let result: Result<Option<f64>> = self.with_slot(slot, |m| {
            m.ensure_work(&staged)?;
            if units.start > 0 {
                m.move_boundary(&staged, units.start, false, Some(input), &mut Vec::new())?;
            }
            // A stage's backward follows.
            let loss = m.forward_units(&staged, units.clone(), true)?;
            if units.end < n {
                m.move_boundary(&staged, units.end, false, None, output)?;
            }
            Ok(loss)
        });
        self.backend.end_pass();
        let loss = result?;
        let tokens = if loss.is_some() { staged.tokens } else { 0.0 };
        slot.staged = Some(staged);
        Ok(StepStats {
            loss_sum: loss.unwrap_or(0.0),
            tokens,
            launches: self.backend.launches() - start,
        })
    }

    fn stage_backward(
        &mut self,
        slot: &mut NmtSlot<B>,
        units: Range<usize>,
        output_grad: &[f32],
        input_grad: &mut Vec<f32>,
        on_grads_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<StepStats> {
        check_units(&units, self.unit_count())?;
        let start = self.backend.launches();
        let Some(staged) = slot.staged.take() else {
            return Err(batch_error(
                "pipeline slot",
                "empty",
                "backward needs the micro-batch's forward pass first",
            ));
        };
        self.backend.begin_pass(&self.params);
        let n = self.unit_count();
        let result: Result<()> = self.with_slot(slot, |m| {
            if units.end < n {
                m.move_boundary(&staged, units.end, true, Some(output_grad), &mut Vec::new())?;
            }
            m.backward_units(&staged, units.clone(), on_grads_ready)?;
            if units.start > 0 {
                m.move_boundary(&staged, units.start, true, None, input_grad)?;
            }
            Ok(())
        });
        self.backend.end_pass();
        result?;
        Ok(StepStats {
            launches: self.backend.launches() - start,
            ..StepStats::default()
        })
    }
}

/// The input parts of encoder layer (`d`, `r`) of a model with `config` and `encoder`
/// layers: the source embeddings for `d == 0`; above, the layer(s) below in `below` (by
/// [`BiLayerInput`]).
fn layer_inputs<'a, Buf>(
    config: &NmtConfig,
    encoder: &[LstmLayer],
    (d, r): (usize, usize),
    below: &'a [LstmWork<Buf>],
    src_emb: &'a Buf,
    batch: usize,
) -> Vec<LayerInput<'a, Buf>> {
    if d == 0 {
        return vec![LayerInput {
            buf: src_emb,
            offset: 0,
            width: config.emb,
        }];
    }
    let (_, stride) = config.encoder_shape();
    let lower = (d - 1) * stride;
    let sources = if config.sources_per_layer() == 2 {
        lower..lower + 2
    } else {
        lower + r..lower + r + 1
    };
    sources
        .map(|j| LayerInput {
            buf: &below[j].hiddens,
            offset: encoder[j].output_offset(batch),
            width: encoder[j].hidden,
        })
        .collect()
}

/// The `keep` column of a batch with source lengths: 1.0 where `t < src_lengths[b]`, at
/// `t * batch + b`.
fn source_keep_mask(b: &NmtBatchView<'_>) -> Result<Vec<f32>> {
    let Some(lengths) = b.src_lengths else {
        return Err(batch_error(
            "src_lengths",
            "none",
            "the model reads source lengths (source_lengths on): give each sentence's real \
             length",
        ));
    };
    check_len("src_lengths", lengths, b.batch, "batch")?;
    if let Some((i, &len)) = lengths.iter().enumerate().find(|(_, &l)| l > b.src_len) {
        return Err(batch_error(
            "src_lengths",
            format!("{len} at sentence {i}"),
            format!("a length is at most src_len ({})", b.src_len),
        ));
    }
    let mut keep = vec![0.0; b.src_len * b.batch];
    for (i, &len) in lengths.iter().enumerate() {
        for t in 0..len {
            keep[t * b.batch + i] = 1.0;
        }
    }
    Ok(keep)
}

/// Uploads the `keep` column (and its complement) and expands both to `[rows, hidden]`
/// step masks: 2 uploads, 2 launches.
fn expand_masks<'a, B: Backend>(
    be: &B,
    m: &'a mut SourceMasks<B::Buffer>,
    keep: &[f32],
    hidden: usize,
) -> Result<StepMask<'a, B::Buffer>> {
    let rows = keep.len();
    let hold: Vec<f32> = keep.iter().map(|k| 1.0 - k).collect();
    be.upload(keep, &mut m.keep_col, 0)?;
    be.upload(&hold, &mut m.hold_col, 0)?;
    for (col, out) in [(&m.keep_col, &mut m.keep), (&m.hold_col, &mut m.hold)] {
        be.gemm(
            view(col, Layout::matrix(0, rows, 1)),
            view(&m.ones, Layout::matrix(0, 1, hidden)),
            view_mut(out, Layout::matrix(0, rows, hidden)),
            false,
        )?;
    }
    Ok(StepMask {
        keep: &m.keep,
        hold: &m.hold,
    })
}
