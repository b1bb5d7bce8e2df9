//! The NMT encoder-decoder (no attention) of the benchmark the users ran.
//!
//! Source and target embeddings `[vocab, emb]`; an encoder that is either
//! - uni: `layers` stacked LSTM layers whose final states initialise the decoder's layers
//!   one to one, or
//! - bi: `layers / 2` layers per direction, the second layer of a direction seeing only
//!   that direction's first layer; final states are interleaved fw0, bw0, fw1, bw1, ... and
//!   become the initial `(h, c)` of decoder layers 0, 1, 2, 3, ...;
//!
//! a decoder of `layers` LSTM layers over the target input (BOS + target); an output
//! projection `hidden -> tgt_vocab` without bias over all target positions at once; and
//! the summed masked softmax cross-entropy against the target output (target + EOS).
//! Encoder outputs are not otherwise used. Source padding is processed like any token.

use crate::backend::{view, view_mut, Backend, CheckedIds, CheckedTargets, InPlace, Layout};
use crate::embedding::{Embedding, EmbeddingWork};
use crate::error::{invalid_value, Result};
use crate::lstm::{GradTarget, InitState, LstmImpl, LstmLayer, LstmWork};
use crate::lstm_lm::{LstmLm, LstmLmShape, LstmLmWork};
use crate::memory::{self, MemoryEstimate};
use crate::model::{
    check_init, check_len, check_positive, check_sizes, impl_model, GradsReady, Model, StepStats,
};
use crate::params::ParamLayout;

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
            let input = if d == 0 { c.emb } else { c.hidden };
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
            "output logits",
            memory::projection_work_elements(tgt_len * batch, self.tgt_vocab),
        );
        Ok(est)
    }

    /// The CPU benchmark configuration: vocab 8000 each side, emb 256, hidden 256,
    /// 2 layers, bi encoder, fused LSTM.
    pub fn benchmark() -> Self {
        NmtConfig {
            src_vocab: 8000,
            tgt_vocab: 8000,
            emb: 256,
            hidden: 256,
            layers: 2,
            encoder: EncoderKind::Bi,
            lstm: LstmImpl::Fused,
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
        if self.encoder == EncoderKind::Bi && self.layers % 2 != 0 {
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
}

struct NmtWork<Buf> {
    src_len: usize,
    tgt_len: usize,
    batch: usize,
    src_emb: EmbeddingWork<Buf>,
    encoder: Vec<LstmWork<Buf>>,
    decoder: LstmLmWork<Buf>,
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
        let be = &self.backend;
        Ok(StagedNmt {
            batch: b.batch,
            src_len: b.src_len,
            tgt_len: b.tgt_len,
            src: be.stage_ids(src)?,
            tgt_in: be.stage_ids(tgt_in)?,
            tgt_out: be.stage_targets(tgt_out)?,
            tokens: b.tgt_mask.iter().map(|&m| f64::from(m)).sum(),
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
        };
        self.work = Some(work);
        Ok(())
    }

    /// Forward pass; returns (loss sum, tokens).
    fn forward(&mut self, b: &StagedNmt<B>) -> Result<(f64, f64)> {
        self.ensure_work(b)?;
        let Some(w) = self.work.as_mut() else {
            return Ok((0.0, 0.0));
        };
        let be = &self.backend;
        let imp = self.config.lstm;
        let (batch, ts, tt) = (b.batch, b.src_len, b.tgt_len);
        let (depth, stride) = self.config.encoder_shape();
        debug_assert!(w.encoder.iter().all(|lw| lw.fits(ts, batch)));
        debug_assert!(w.decoder.layers.iter().all(|lw| lw.fits(tt, batch)));
        self.src_emb
            .forward(be, &self.params, &b.src, &mut w.src_emb)?;
        for d in 0..depth {
            for r in 0..stride {
                let i = d * stride + r;
                let layer = &self.encoder[i];
                let (below, rest) = w.encoder.split_at_mut(i);
                let (x, x_offset) = if d == 0 {
                    (&w.src_emb.out, 0)
                } else {
                    (
                        &below[i - stride].hiddens,
                        self.encoder[i - stride].output_offset(batch),
                    )
                };
                layer.forward(
                    be,
                    imp,
                    &self.params,
                    x,
                    x_offset,
                    None,
                    &mut rest[0],
                    ts,
                    batch,
                )?;
            }
        }
        let (encoder, encoder_work) = (&self.encoder, &w.encoder);
        let loss = self.decoder.forward_loss(
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
        )?;
        Ok((loss, b.tokens))
    }

    fn backward(
        &mut self,
        b: &StagedNmt<B>,
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
        self.decoder.backward(
            be,
            imp,
            &self.params,
            &mut self.grads,
            &b.tgt_in,
            &b.tgt_out,
            tt,
            batch,
            true,
            &mut w.decoder,
            on_ready,
        )?;
        for d in (0..depth).rev() {
            for r in 0..stride {
                let i = d * stride + r;
                let layer = &self.encoder[i];
                let (below, rest) = w.encoder.split_at_mut(i);
                let lw = &mut rest[0];
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
                let (x, x_offset, dx) = if d == 0 {
                    (
                        &w.src_emb.out,
                        0,
                        GradTarget {
                            buf: &mut w.src_emb.dx,
                            offset: 0,
                            accumulate: r > 0,
                        },
                    )
                } else {
                    let lower = &mut below[i - stride];
                    (
                        &lower.hiddens,
                        self.encoder[i - stride].output_offset(batch),
                        GradTarget {
                            buf: &mut lower.dh,
                            offset: 0,
                            accumulate: false,
                        },
                    )
                };
                layer.backward(
                    be,
                    imp,
                    &self.params,
                    &mut self.grads,
                    x,
                    x_offset,
                    lw,
                    ts,
                    batch,
                    false,
                    Some(dx),
                    on_ready,
                )?;
            }
        }
        self.src_emb
            .backward(be, &mut self.grads, &b.src, &w.src_emb, on_ready)
    }
}

impl_model!(NmtModel, NmtBatchView);
