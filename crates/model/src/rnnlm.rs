//! An RNN language model: embedding, `layers` stacked LSTM layers, a projection
//! `hidden -> vocab` without bias, and the summed masked softmax cross-entropy.

use crate::backend::Backend;
use crate::embedding::{Embedding, EmbeddingWork, Projection, ProjectionWork};
use crate::error::{config_error, Result};
use crate::lstm::{GradTarget, LstmImpl, LstmLayer, LstmWork};
use crate::model::{
    check_ids, check_labels, check_len, check_positive, GradsReady, Model, StepStats,
};
use crate::params::ParamLayout;

/// Sizes and choices of an [`RnnLm`].
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LmConfig {
    /// Vocabulary size (embedding rows and projection width).
    pub vocab: usize,
    /// Embedding width.
    pub emb: usize,
    /// LSTM hidden units.
    pub hidden: usize,
    /// LSTM layers.
    pub layers: usize,
    /// LSTM implementation of every layer.
    pub lstm: LstmImpl,
    /// Half-width of the uniform initialisation (0.1).
    pub init_scale: f32,
    /// Initial value of the LSTM forget-gate bias (1.0).
    pub forget_bias: f32,
}

impl LmConfig {
    /// The PTB-style configuration of the users' RNNLM runs: vocab 10,001, emb and hidden
    /// 256, 2 layers, fused LSTM.
    pub fn ptb() -> Self {
        LmConfig {
            vocab: 10_001,
            emb: 256,
            hidden: 256,
            layers: 2,
            lstm: LstmImpl::Fused,
            init_scale: 0.1,
            forget_bias: ringtrain_kernels::DEFAULT_FORGET_BIAS,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// `InvalidConfig` naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        for (field, value) in [
            ("vocab", self.vocab),
            ("emb", self.emb),
            ("hidden", self.hidden),
            ("layers", self.layers),
        ] {
            if value == 0 {
                return Err(config_error(field, value, "must be at least 1"));
            }
        }
        if !(self.init_scale.is_finite() && self.init_scale >= 0.0) {
            return Err(config_error(
                "init_scale",
                self.init_scale,
                "must be finite and >= 0 (usually 0.1)",
            ));
        }
        if !self.forget_bias.is_finite() {
            return Err(config_error(
                "forget_bias",
                self.forget_bias,
                "must be finite (usually 1.0)",
            ));
        }
        Ok(())
    }
}

/// One language-model batch, time-major: token (t, b) at `t * batch + b`.
#[derive(Debug, Clone, Copy)]
pub struct LmBatch<'a> {
    /// Sequences in the batch.
    pub batch: usize,
    /// Steps.
    pub len: usize,
    /// Input ids `[len * batch]`.
    pub inputs: &'a [u32],
    /// Next-token ids `[len * batch]`.
    pub targets: &'a [u32],
    /// Target weights `[len * batch]`: 1.0 real token, 0.0 padding.
    pub mask: &'a [f32],
}

struct LmWork<Buf> {
    len: usize,
    batch: usize,
    emb: EmbeddingWork<Buf>,
    layers: Vec<LstmWork<Buf>>,
    head: ProjectionWork<Buf>,
}

/// The RNN language model on backend `B`. Parameter order (backward order):
/// `proj/kernel`, `lm/layer_{L-1}/...` down to `lm/layer_0/...`, `embedding/lm`.
pub struct RnnLm<B: Backend> {
    backend: B,
    config: LmConfig,
    layout: ParamLayout,
    params: B::Buffer,
    grads: B::Buffer,
    proj: Projection,
    layers: Vec<LstmLayer>,
    emb: Embedding,
    work: Option<LmWork<B::Buffer>>,
}

impl<B: Backend> std::fmt::Debug for RnnLm<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RnnLm")
            .field("backend", &self.backend.name())
            .field("config", &self.config)
            .field("params", &self.layout.total_len())
            .finish()
    }
}

impl<B: Backend> RnnLm<B> {
    /// Builds the model and initialises its parameters from `seed`.
    ///
    /// # Errors
    /// `InvalidConfig` for a bad config; backend errors.
    pub fn new(backend: B, config: LmConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let c = &config;
        let mut layout = ParamLayout::new();
        let proj =
            Projection::register(&mut layout, "proj/kernel", c.hidden, c.vocab, c.init_scale)?;
        let mut layers = Vec::with_capacity(c.layers);
        for l in (0..c.layers).rev() {
            let input = if l == 0 { c.emb } else { c.hidden };
            let name = format!("lm/layer_{l}");
            layers.push(LstmLayer::register(
                &mut layout,
                &name,
                input,
                c.hidden,
                false,
                c.init_scale,
                c.forget_bias,
            )?);
        }
        layers.reverse();
        let emb = Embedding::register(&mut layout, "embedding/lm", c.vocab, c.emb, c.init_scale)?;
        let params = backend.zeros(layout.total_len())?;
        let grads = backend.zeros(layout.total_len())?;
        let mut model = RnnLm {
            backend,
            config,
            layout,
            params,
            grads,
            proj,
            layers,
            emb,
            work: None,
        };
        model.init_params(seed)?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &LmConfig {
        &self.config
    }

    fn validate(&self, b: &LmBatch<'_>) -> Result<()> {
        check_positive("batch", b.batch)?;
        check_positive("len", b.len)?;
        let rows = b.len * b.batch;
        check_len("inputs", b.inputs, rows, "len * batch")?;
        check_len("targets", b.targets, rows, "len * batch")?;
        check_len("mask", b.mask, rows, "len * batch")?;
        check_ids("inputs", b.inputs, self.config.vocab)?;
        check_labels("targets", b.targets, b.mask, self.config.vocab)
    }

    fn ensure_work(&mut self, b: &LmBatch<'_>) -> Result<()> {
        let (mut len, mut batch) = (b.len, b.batch);
        if let Some(w) = &self.work {
            if b.len <= w.len && b.batch <= w.batch {
                return Ok(());
            }
            len = len.max(w.len);
            batch = batch.max(w.batch);
        }
        self.work = None;
        let be = &self.backend;
        let c = &self.config;
        let work = LmWork {
            len,
            batch,
            emb: EmbeddingWork::new(be, len * batch, c.emb)?,
            layers: (0..self.layers.len())
                .map(|_| LstmWork::new(be, c.hidden, len, batch))
                .collect::<Result<_>>()?,
            head: ProjectionWork::new(be, len * batch, c.vocab)?,
        };
        self.work = Some(work);
        Ok(())
    }

    fn forward(&mut self, b: &LmBatch<'_>) -> Result<(f64, f64)> {
        self.validate(b)?;
        self.ensure_work(b)?;
        let Some(w) = self.work.as_mut() else {
            return Ok((0.0, 0.0));
        };
        let be = &self.backend;
        let imp = self.config.lstm;
        self.emb.forward(be, &self.params, b.inputs, &mut w.emb)?;
        for l in 0..self.layers.len() {
            let (below, rest) = w.layers.split_at_mut(l);
            let (x, x_offset) = if l == 0 {
                (&w.emb.out, 0)
            } else {
                (
                    &below[l - 1].hiddens,
                    self.layers[l - 1].output_offset(b.batch),
                )
            };
            self.layers[l].forward(
                be,
                imp,
                &self.params,
                x,
                x_offset,
                None,
                &mut rest[0],
                b.len,
                b.batch,
            )?;
        }
        let top = self.layers.len() - 1;
        let loss = self.proj.forward(
            be,
            &self.params,
            &w.layers[top].hiddens,
            self.layers[top].output_offset(b.batch),
            b.len * b.batch,
            b.targets,
            b.mask,
            &mut w.head,
        )?;
        let tokens = b.mask.iter().map(|&m| f64::from(m)).sum();
        Ok((loss, tokens))
    }

    fn backward(
        &mut self,
        b: &LmBatch<'_>,
        on_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<()> {
        let Some(w) = self.work.as_mut() else {
            return Ok(());
        };
        let be = &self.backend;
        let imp = self.config.lstm;
        let bh = b.batch * self.config.hidden;
        let top = self.layers.len() - 1;
        {
            let top_work = &mut w.layers[top];
            self.proj.backward(
                be,
                &self.params,
                &mut self.grads,
                &top_work.hiddens,
                self.layers[top].output_offset(b.batch),
                b.len * b.batch,
                b.targets,
                b.mask,
                &mut w.head,
                GradTarget {
                    buf: &mut top_work.dh,
                    offset: 0,
                    accumulate: false,
                },
                on_ready,
            )?;
        }
        for l in (0..self.layers.len()).rev() {
            let (below, rest) = w.layers.split_at_mut(l);
            let lw = &mut rest[0];
            be.fill(&mut lw.dc, 0, bh, 0.0)?;
            let (x, x_offset, dx) = if l == 0 {
                (
                    &w.emb.out,
                    0,
                    GradTarget {
                        buf: &mut w.emb.dx,
                        offset: 0,
                        accumulate: false,
                    },
                )
            } else {
                let lower = &mut below[l - 1];
                (
                    &lower.hiddens,
                    self.layers[l - 1].output_offset(b.batch),
                    GradTarget {
                        buf: &mut lower.dh,
                        offset: 0,
                        accumulate: false,
                    },
                )
            };
            self.layers[l].backward(
                be,
                imp,
                &self.params,
                &mut self.grads,
                x,
                x_offset,
                lw,
                b.len,
                b.batch,
                false,
                Some(dx),
                on_ready,
            )?;
        }
        self.emb
            .backward(be, &mut self.grads, b.inputs, &w.emb, on_ready)
    }
}

impl<B: Backend> Model for RnnLm<B> {
    type Backend = B;
    type Batch<'a> = LmBatch<'a>;

    fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    fn backend(&self) -> &B {
        &self.backend
    }
    fn params(&self) -> &B::Buffer {
        &self.params
    }
    fn params_mut(&mut self) -> &mut B::Buffer {
        &mut self.params
    }
    fn grads(&self) -> &B::Buffer {
        &self.grads
    }
    fn grads_mut(&mut self) -> &mut B::Buffer {
        &mut self.grads
    }
    fn params_and_grads_mut(&mut self) -> (&mut B::Buffer, &mut B::Buffer) {
        (&mut self.params, &mut self.grads)
    }
    fn init_params(&mut self, seed: u64) -> Result<()> {
        let values = self.layout.initial_values(seed)?;
        self.backend.upload(&values, &mut self.params, 0)
    }
    fn forward_loss(&mut self, batch: &LmBatch<'_>) -> Result<StepStats> {
        let start = self.backend.launches();
        let (loss_sum, tokens) = self.forward(batch)?;
        Ok(StepStats {
            loss_sum,
            tokens,
            launches: self.backend.launches() - start,
        })
    }
    fn forward_backward(
        &mut self,
        batch: &LmBatch<'_>,
        on_grads_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<StepStats> {
        let start = self.backend.launches();
        let (loss_sum, tokens) = self.forward(batch)?;
        self.backward(batch, on_grads_ready)?;
        Ok(StepStats {
            loss_sum,
            tokens,
            launches: self.backend.launches() - start,
        })
    }
}
