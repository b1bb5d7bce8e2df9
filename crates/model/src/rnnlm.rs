//! An RNN language model: embedding, `layers` stacked LSTM layers, a projection
//! `hidden -> vocab` without bias, and the summed masked softmax cross-entropy.
//!
//! The LSTM state is carried from one window to the next, as TF's PTB language model does
//! (truncated backpropagation through time): a window starts from the final `(h, c)` of
//! every layer of the window before it, taken as a constant, so the gradient stops at the
//! window boundary. It starts from zeros instead when the batch is marked
//! [`LmBatchView::first_in_epoch`], when there is no carried state (a new model: a run
//! that resumes from a checkpoint starts its first window from zeros, as the state is not
//! checkpointed), and after [`RnnLm::reset_state`]. Each model (each rank) carries the
//! state of its own batch rows. [`RnnLm::swap_state`] sets the training state aside, e.g.
//! for a pass over held-out text.

use crate::backend::{view, view_mut, Layout};
use crate::backend::{Backend, CheckedIds, CheckedTargets};
use crate::error::batch_error;
use crate::error::Result;
use crate::lstm::{InitState, LstmImpl};
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
    /// Registers the model's tensors in `layout`, in backward order.
    fn register(&self, layout: &mut ParamLayout) -> Result<LstmLm> {
        let shape = LstmLmShape {
            vocab: self.vocab,
            emb: self.emb,
            hidden: self.hidden,
            layers: self.layers,
            init_scale: self.init_scale,
            forget_bias: self.forget_bias,
        };
        LstmLm::register(layout, "lm", "embedding/lm", &shape)
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

    /// The memory a model of this config needs to train on batches of `batch` windows
    /// of `steps` tokens: parameters, gradients and the forward and backward workspaces
    /// (optimizer state and gradient exchange buffers are the trainer's to add).
    ///
    /// # Errors
    /// As [`LmConfig::param_count`].
    pub fn memory_estimate(&self, batch: usize, steps: usize) -> Result<MemoryEstimate> {
        let params = self.param_count()? as f64;
        let mut est = MemoryEstimate::default();
        est.add_f32("parameters", params);
        est.add_f32("gradients", params);
        est.add_f32(
            "LSTM activations",
            memory::embedding_work_elements(steps * batch, self.emb)
                + self.layers as f64 * memory::lstm_work_elements(self.hidden, steps, batch),
        );
        est.add_f32(
            "output projection",
            memory::projection_work_elements(steps * batch, self.hidden, self.vocab),
        );
        est.add_f32(
            "carried LSTM state",
            2.0 * self.layers as f64 * batch as f64 * self.hidden as f64,
        );
        Ok(est)
    }

    /// Elements of the largest activation operand a matrix product of the training step
    /// reads, at the shape of [`LmConfig::memory_estimate`]: a chunk of the logits'
    /// gradient (at most [`crate::LOGITS_CHUNK_ELEMENTS`] of the `batch x steps` rows of
    /// `vocab`), the gates (4 x hidden per row) or an embedded window.
    pub fn largest_gemm_operand(&self, batch: usize, steps: usize) -> f64 {
        let rows = batch * steps;
        let widest = (4 * self.hidden).max(self.emb) as f64;
        memory::logits_chunk_elements(rows, self.vocab).max(rows as f64 * widest)
    }

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
    /// `InvalidValue` naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        check_sizes(&[
            ("vocab", self.vocab),
            ("emb", self.emb),
            ("hidden", self.hidden),
            ("layers", self.layers),
        ])?;
        check_init(
            self.init_scale,
            self.forget_bias,
            "must be finite and >= 0 (usually 0.1)",
        )
    }
}

/// One language-model batch borrowed from the caller, time-major: token (t, b) at
/// `t * batch + b`. (`ringtrain_data::LmBatch` is the owned batch the data pipeline
/// makes, in the same layout: the trainer lends its arrays to a view without copying.)
#[derive(Debug, Clone, Copy)]
pub struct LmBatchView<'a> {
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
    /// True for the first window of an epoch: start from zeros rather than the carried
    /// state.
    pub first_in_epoch: bool,
}

/// The LSTM state an [`RnnLm`] carries from one window to the next: per layer, the final
/// `h` and `c` (`[batch, hidden]` each) of the last window. `Default` is no state.
pub struct LmState<Buf> {
    carried: Option<Carried<Buf>>,
}

struct Carried<Buf> {
    batch: usize,
    h: Vec<Buf>,
    c: Vec<Buf>,
}

impl<Buf: Clone> Clone for LmState<Buf> {
    fn clone(&self) -> Self {
        LmState {
            carried: self.carried.as_ref().map(|s| Carried {
                batch: s.batch,
                h: s.h.clone(),
                c: s.c.clone(),
            }),
        }
    }
}

impl<Buf> Default for LmState<Buf> {
    fn default() -> Self {
        LmState { carried: None }
    }
}

impl<Buf> LmState<Buf> {
    /// True when there is a carried state (the next window that is not
    /// `first_in_epoch` starts from it).
    pub fn is_carried(&self) -> bool {
        self.carried.is_some()
    }
}

/// A checked batch with its ids and targets staged on the backend, for one pass.
struct StagedLm<B: Backend> {
    batch: usize,
    len: usize,
    inputs: B::Ids,
    targets: B::Targets,
    tokens: f64,
    first_in_epoch: bool,
}

struct LmWork<Buf> {
    len: usize,
    batch: usize,
    net: LstmLmWork<Buf>,
}

/// The RNN language model on backend `B`. Parameter order (backward order):
/// `proj/kernel`, `lm/layer_{L-1}/...` down to `lm/layer_0/...`, `embedding/lm`.
pub struct RnnLm<B: Backend> {
    backend: B,
    config: LmConfig,
    layout: ParamLayout,
    params: B::Buffer,
    grads: B::Buffer,
    net: LstmLm,
    work: Option<LmWork<B::Buffer>>,
    state: LmState<B::Buffer>,
}

impl<B: Backend> RnnLm<B> {
    /// Builds the model and initialises its parameters from `seed`.
    ///
    /// # Errors
    /// `InvalidValue` for a bad config; backend errors.
    pub fn new(backend: B, config: LmConfig, seed: u64) -> Result<Self> {
        config.validate()?;
        let mut layout = ParamLayout::new();
        let net = config.register(&mut layout)?;
        let params = backend.zeros(layout.total_len())?;
        let grads = backend.zeros(layout.total_len())?;
        let mut model = RnnLm {
            backend,
            config,
            layout,
            params,
            grads,
            net,
            work: None,
            state: LmState::default(),
        };
        model.init_params(seed)?;
        Ok(model)
    }

    /// The configuration.
    pub fn config(&self) -> &LmConfig {
        &self.config
    }

    /// Drops the carried state: the next window starts from zeros.
    pub fn reset_state(&mut self) {
        self.state = LmState::default();
    }

    /// Exchanges the carried state with `other` (set the training state aside with an
    /// empty [`LmState`] before passes over other text, and swap it back after).
    pub fn swap_state(&mut self, other: &mut LmState<B::Buffer>) {
        std::mem::swap(&mut self.state, other);
    }

    /// The carried state.
    pub fn state(&self) -> &LmState<B::Buffer> {
        &self.state
    }

    /// Checks `b` and stages its ids and targets on the backend.
    fn stage(&self, b: &LmBatchView<'_>) -> Result<StagedLm<B>> {
        check_positive("batch", b.batch)?;
        check_positive("len", b.len)?;
        let rows = b.len * b.batch;
        check_len("inputs", b.inputs, rows, "len * batch")?;
        check_len("targets", b.targets, rows, "len * batch")?;
        check_len("mask", b.mask, rows, "len * batch")?;
        let vocab = self.config.vocab;
        let inputs = CheckedIds::new("inputs", b.inputs, vocab)?;
        let targets = CheckedTargets::new("targets", b.targets, b.mask, vocab)?;
        if let Some(carried) = &self.state.carried {
            if !b.first_in_epoch && carried.batch != b.batch {
                return Err(batch_error(
                    "batch",
                    b.batch,
                    format!(
                        "the carried LSTM state is for {} rows: a window that continues the \
                         previous one needs as many (mark it first_in_epoch to start from zeros)",
                        carried.batch
                    ),
                ));
            }
        }
        Ok(StagedLm {
            batch: b.batch,
            len: b.len,
            inputs: self.backend.stage_ids(inputs)?,
            targets: self.backend.stage_targets(targets)?,
            tokens: b.mask.iter().map(|&m| f64::from(m)).sum(),
            first_in_epoch: b.first_in_epoch,
        })
    }

    fn ensure_work(&mut self, b: &StagedLm<B>) -> Result<()> {
        let (mut len, mut batch) = (b.len, b.batch);
        if let Some(w) = &self.work {
            if b.len <= w.len && b.batch <= w.batch {
                return Ok(());
            }
            len = len.max(w.len);
            batch = batch.max(w.batch);
        }
        self.work = None;
        let work = LmWork {
            len,
            batch,
            net: self.net.work(&self.backend, len, batch)?,
        };
        self.work = Some(work);
        Ok(())
    }

    fn forward(&mut self, b: &StagedLm<B>, differentiate: bool) -> Result<(f64, f64)> {
        let all = 0..self.net.unit_count();
        let loss = self.forward_units(b, all, differentiate)?;
        Ok((loss.unwrap_or(0.0), b.tokens))
    }

    /// Forward over the network's `units` (see [`LstmLm::unit_count`]); the loss when
    /// they hold the projection. The carried state of the units' layers moves on. With
    /// `differentiate`, a backward follows (see [`LstmLm::forward_units`]).
    fn forward_units(
        &mut self,
        b: &StagedLm<B>,
        units: Range<usize>,
        differentiate: bool,
    ) -> Result<Option<f64>> {
        self.ensure_work(b)?;
        let Some(w) = self.work.as_mut() else {
            return Ok(None);
        };
        let be = &self.backend;
        if b.first_in_epoch {
            self.state.carried = None;
        }
        let carried = self.state.carried.as_ref();
        let loss = self.net.forward_units(
            be,
            self.config.lstm,
            &self.params,
            &b.inputs,
            &b.targets,
            b.len,
            b.batch,
            &mut w.net,
            |l| {
                carried.map(|s| InitState {
                    h: &s.h[l],
                    h_offset: 0,
                    c: &s.c[l],
                    c_offset: 0,
                })
            },
            units.clone(),
            differentiate,
        )?;
        // The final state of every layer becomes the next window's initial state; backward
        // reads the initial state from the layer's own workspace, so it can be replaced now.
        let bh = b.batch * self.config.hidden;
        let mut next = match self.state.carried.take() {
            Some(s) => s,
            None => Carried {
                batch: b.batch,
                h: (0..self.net.layers.len())
                    .map(|_| be.zeros(bh))
                    .collect::<Result<_>>()?,
                c: (0..self.net.layers.len())
                    .map(|_| be.zeros(bh))
                    .collect::<Result<_>>()?,
            },
        };
        for (l, layer) in self.net.layers.iter().enumerate() {
            if !units.contains(&(l + 1)) {
                continue;
            }
            let last = Layout::contiguous(layer.final_offset(b.len, b.batch), bh);
            let to = Layout::contiguous(0, bh);
            be.copy(
                view(&w.net.layers[l].hiddens, last),
                view_mut(&mut next.h[l], to),
            )?;
            be.copy(
                view(&w.net.layers[l].cells, last),
                view_mut(&mut next.c[l], to),
            )?;
        }
        self.state.carried = Some(next);
        Ok(loss)
    }

    /// [`Self::forward_units`] as a pipeline stage: `input` is the output of the unit
    /// before `units`, the output of their last unit is appended to `output`.
    fn stage_forward_units(
        &mut self,
        b: &StagedLm<B>,
        units: Range<usize>,
        input: &[f32],
        output: &mut Vec<f32>,
    ) -> Result<Option<f64>> {
        check_units(&units, self.net.unit_count())?;
        self.ensure_work(b)?;
        if units.start > 0 {
            let Some(w) = self.work.as_mut() else {
                return Ok(None);
            };
            let (buf, offset, len) =
                self.net
                    .unit_output_mut(&mut w.net, units.start - 1, b.len, b.batch);
            check_boundary("pipeline activations", input.len(), len)?;
            BoundaryReader::new(input).read_into(&self.backend, buf, offset, len)?;
        }
        // A stage's backward follows.
        let loss = self.forward_units(b, units.clone(), true)?;
        if units.end < self.net.unit_count() {
            if let Some(w) = self.work.as_ref() {
                let (buf, offset, len) =
                    self.net.unit_output(&w.net, units.end - 1, b.len, b.batch);
                write_from(&self.backend, buf, offset, len, output)?;
            }
        }
        Ok(loss)
    }

    /// Backward over `units` as a pipeline stage (after [`Self::stage_forward_units`]).
    fn stage_backward_units(
        &mut self,
        b: &StagedLm<B>,
        units: Range<usize>,
        output_grad: &[f32],
        input_grad: &mut Vec<f32>,
        on_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<()> {
        check_units(&units, self.net.unit_count())?;
        let Some(w) = self.work.as_mut() else {
            return Err(batch_error(
                "pipeline slot",
                "empty",
                "backward needs the micro-batch's forward pass first",
            ));
        };
        let be = &self.backend;
        if units.end < self.net.unit_count() {
            let (buf, offset, len) =
                self.net
                    .unit_output_grad(&mut w.net, units.end - 1, b.len, b.batch);
            check_boundary("pipeline gradients", output_grad.len(), len)?;
            BoundaryReader::new(output_grad).read_into(be, buf, offset, len)?;
        }
        self.net.backward_units(
            be,
            self.config.lstm,
            &self.params,
            &mut self.grads,
            &b.inputs,
            b.len,
            b.batch,
            false,
            &mut w.net,
            on_ready,
            units.clone(),
        )?;
        if units.start > 0 {
            let (buf, offset, len) =
                self.net
                    .unit_output_grad(&mut w.net, units.start - 1, b.len, b.batch);
            write_from(be, buf, offset, len, input_grad)?;
        }
        Ok(())
    }

    fn backward(
        &mut self,
        b: &StagedLm<B>,
        on_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<()> {
        let Some(w) = self.work.as_mut() else {
            return Ok(());
        };
        self.net.backward(
            &self.backend,
            self.config.lstm,
            &self.params,
            &mut self.grads,
            &b.inputs,
            b.len,
            b.batch,
            false,
            &mut w.net,
            on_ready,
        )
    }
}

impl_model!(RnnLm, LmBatchView);

/// A micro-batch of an [`RnnLm`] pipeline stage: its activations and staged batch
/// between forward and backward, and the LSTM state its rows carry to the next window.
pub struct LmSlot<B: Backend> {
    work: Option<LmWork<B::Buffer>>,
    staged: Option<StagedLm<B>>,
    state: LmState<B::Buffer>,
}

impl<B: Backend> Default for LmSlot<B> {
    fn default() -> Self {
        LmSlot {
            work: None,
            staged: None,
            state: LmState::default(),
        }
    }
}

impl<B: Backend> RnnLm<B> {
    /// Runs `f` with `slot`'s workspace and carried state in place of the model's own.
    fn with_slot<T>(&mut self, slot: &mut LmSlot<B>, f: impl FnOnce(&mut Self) -> T) -> T {
        std::mem::swap(&mut self.work, &mut slot.work);
        std::mem::swap(&mut self.state, &mut slot.state);
        let out = f(self);
        std::mem::swap(&mut self.work, &mut slot.work);
        std::mem::swap(&mut self.state, &mut slot.state);
        out
    }
}

impl<B: Backend> PipelineModel for RnnLm<B> {
    type Slot = LmSlot<B>;

    fn move_activations(from: &mut LmSlot<B>, to: &mut LmSlot<B>) {
        to.work = from.work.take();
    }

    fn holds_activations(slot: &LmSlot<B>) -> bool {
        slot.work.is_some()
    }

    fn activation_bytes(&self, slot: &LmSlot<B>) -> f64 {
        slot.work.as_ref().map_or(0.0, |w| {
            crate::stage::workspace_bytes(self.config.memory_estimate(w.batch, w.len))
        })
    }

    fn pipeline_units(&self) -> Vec<PipelineUnit> {
        let layers = self.config.layers;
        let mut names = vec!["embedding".to_string()];
        names.extend((0..layers).map(|l| format!("layer {l}")));
        names.push("projection + loss".to_string());
        units_from_layout(&self.layout, names, |name| {
            if name == "embedding/lm" {
                Some(0)
            } else if name == "proj/kernel" {
                Some(layers + 1)
            } else {
                let rest = name.strip_prefix("lm/layer_")?;
                let l: usize = rest.split('/').next()?.parse().ok()?;
                Some(l + 1)
            }
        })
    }

    fn stage_forward(
        &mut self,
        slot: &mut LmSlot<B>,
        batch: &LmBatchView<'_>,
        units: Range<usize>,
        input: &[f32],
        output: &mut Vec<f32>,
    ) -> Result<StepStats> {
        let start = self.backend.launches();
        let staged = self.stage(batch)?;
        self.backend.begin_pass(&self.params);
        let result = self.with_slot(slot, |m| {
            m.stage_forward_units(&staged, units, input, output)
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
        slot: &mut LmSlot<B>,
        units: Range<usize>,
        output_grad: &[f32],
        input_grad: &mut Vec<f32>,
        on_grads_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> Result<StepStats> {
        let start = self.backend.launches();
        let Some(staged) = slot.staged.take() else {
            return Err(batch_error(
                "pipeline slot",
                "empty",
                "backward needs the micro-batch's forward pass first",
            ));
        };
        self.backend.begin_pass(&self.params);
        let result = self.with_slot(slot, |m| {
            m.stage_backward_units(&staged, units, output_grad, input_grad, on_grads_ready)
        });
        self.backend.end_pass();
        result?;
        Ok(StepStats {
            launches: self.backend.launches() - start,
            ..StepStats::default()
        })
    }
}
