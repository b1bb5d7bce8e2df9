//! Binds the model crate's NMT and RNNLM models (CPU backend) to [`TrainableModel`], and
//! holds what this adapter shares with the GPU one: [`TrainsOnBatch`], which turns a data
//! [`Batch`] into the model's time-major batch, and the timed pass.

use std::ops::Range;
use std::time::Instant;

use ringtrain_model::{
    Backend, CpuBackend, CudaBackend, EncoderKind, GradsReady, LmConfig, LstmImpl, Model,
    NmtConfig, NmtModel, ParamLayout, RnnLm, StepStats,
};

use crate::config::{DeviceKind, Direction, EncoderType, ModelKind, TrainConfig};
use crate::error::{Error, Result};
use crate::trainable::{Batch, ParamSpec, PassOutput, ReadyCallback, TrainableModel};

/// A model of the model crate whose buffers live in host memory.
pub struct ModelAdapter<M> {
    model: M,
    specs: Vec<ParamSpec>,
    description: String,
    staged: TimeMajorBatch,
}

impl<M: Model> ModelAdapter<M> {
    fn wrap(model: M, description: String) -> Self {
        ModelAdapter {
            specs: param_specs(model.layout()),
            model,
            description,
            staged: TimeMajorBatch::default(),
        }
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.model
    }
}

/// One [`ParamSpec`] per tensor of `layout`, in buffer order.
pub(crate) fn param_specs(layout: &ParamLayout) -> Vec<ParamSpec> {
    layout
        .entries()
        .iter()
        .map(|e| ParamSpec {
            name: e.name.clone(),
            range: e.offset..e.offset + e.len,
        })
        .collect()
}

/// A data batch copied to the time-major layout the models read (token (t, b) at
/// `t * batch + b`), in host buffers reused from pass to pass.
#[derive(Debug, Default)]
pub struct TimeMajorBatch {
    batch: usize,
    src_len: usize,
    tgt_len: usize,
    /// NMT source ids; LM input ids.
    src: Vec<u32>,
    /// NMT decoder input ids (unused by the LM).
    tgt_in: Vec<u32>,
    /// NMT decoder output ids; LM next-token ids.
    tgt_out: Vec<u32>,
    /// Target weights.
    mask: Vec<f32>,
}

/// A model of the model crate that trains on one kind of [`Batch`].
pub trait TrainsOnBatch: Model {
    /// Copies `batch` into `staged` in the layout of the model's batches.
    ///
    /// # Errors
    /// `InvalidConfig` naming `--model` when `batch` is for the other model.
    fn stage(batch: &Batch, staged: &mut TimeMajorBatch) -> Result<()>;

    /// [`Model::forward_backward`] on the batch last staged into `staged`.
    ///
    /// # Errors
    /// The model's errors.
    fn forward_backward_staged(
        &mut self,
        staged: &TimeMajorBatch,
        on_grads_ready: &mut GradsReady<'_, <Self::Backend as Backend>::Buffer>,
    ) -> ringtrain_model::Result<StepStats>;
}

impl<B: Backend> TrainsOnBatch for NmtModel<B> {
    fn stage(batch: &Batch, staged: &mut TimeMajorBatch) -> Result<()> {
        let Batch::Nmt(b) = batch else {
            return Err(wrong_batch("nmt"));
        };
        staged.batch = b.batch_size;
        staged.src_len = b.src_len;
        staged.tgt_len = b.tgt_len;
        transpose_into(&b.source, b.batch_size, b.src_len, &mut staged.src);
        transpose_into(&b.target_input, b.batch_size, b.tgt_len, &mut staged.tgt_in);
        transpose_into(
            &b.target_output,
            b.batch_size,
            b.tgt_len,
            &mut staged.tgt_out,
        );
        transpose_into(&b.target_mask, b.batch_size, b.tgt_len, &mut staged.mask);
        Ok(())
    }

    fn forward_backward_staged(
        &mut self,
        staged: &TimeMajorBatch,
        on_grads_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> ringtrain_model::Result<StepStats> {
        let view = ringtrain_model::NmtBatchView {
            batch: staged.batch,
            src_len: staged.src_len,
            tgt_len: staged.tgt_len,
            src: &staged.src,
            tgt_in: &staged.tgt_in,
            tgt_out: &staged.tgt_out,
            tgt_mask: &staged.mask,
        };
        self.forward_backward(&view, on_grads_ready)
    }
}

impl<B: Backend> TrainsOnBatch for RnnLm<B> {
    fn stage(batch: &Batch, staged: &mut TimeMajorBatch) -> Result<()> {
        let Batch::Lm(b) = batch else {
            return Err(wrong_batch("rnnlm"));
        };
        staged.batch = b.batch_size;
        staged.src_len = b.steps;
        staged.tgt_len = b.steps;
        transpose_into(&b.inputs, b.batch_size, b.steps, &mut staged.src);
        transpose_into(&b.targets, b.batch_size, b.steps, &mut staged.tgt_out);
        transpose_into(&b.mask, b.batch_size, b.steps, &mut staged.mask);
        Ok(())
    }

    fn forward_backward_staged(
        &mut self,
        staged: &TimeMajorBatch,
        on_grads_ready: &mut GradsReady<'_, B::Buffer>,
    ) -> ringtrain_model::Result<StepStats> {
        let view = ringtrain_model::LmBatchView {
            batch: staged.batch,
            len: staged.src_len,
            inputs: &staged.src,
            targets: &staged.tgt_out,
            mask: &staged.mask,
        };
        self.forward_backward(&view, on_grads_ready)
    }
}

/// Runs one pass, handing each final gradient range to `on_range` (the first error stops
/// the forwarding and is returned after the pass), and times forward (until the first
/// gradient range is final) and backward (the rest).
pub(crate) fn timed_pass<Buf>(
    run: impl FnOnce(&mut dyn FnMut(Range<usize>, &Buf)) -> ringtrain_model::Result<StepStats>,
    mut on_range: impl FnMut(Range<usize>, &Buf) -> Result<()>,
) -> Result<PassOutput> {
    let start = Instant::now();
    let mut first_ready: Option<Instant> = None;
    let mut failure: Option<Error> = None;
    let stats = run(&mut |range: Range<usize>, grads: &Buf| {
        first_ready.get_or_insert_with(Instant::now);
        if failure.is_none() {
            if let Err(e) = on_range(range, grads) {
                failure = Some(e);
            }
        }
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(pass_output(&stats, start, first_ready))
}

/// A pass's output from the model's stats: forward runs from `start` until the first
/// gradient range was final (`first_ready`), backward from then until now.
pub(crate) fn pass_output(
    stats: &StepStats,
    start: Instant,
    first_ready: Option<Instant>,
) -> PassOutput {
    let end = Instant::now();
    let split = first_ready.unwrap_or(end);
    PassOutput {
        loss_sum: stats.loss_sum,
        target_tokens: stats.tokens,
        forward_seconds: split.duration_since(start).as_secs_f64(),
        backward_seconds: end.duration_since(split).as_secs_f64(),
        launches: stats.launches,
    }
}

fn wrong_batch(model: &str) -> Error {
    Error::invalid(
        "--model",
        model,
        "the input pipeline produced batches for the other model; build the pipeline from the same config",
    )
}

impl<M> TrainableModel for ModelAdapter<M>
where
    M: TrainsOnBatch + Send,
    M::Backend: Backend<Buffer = Vec<f32>>,
{
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    fn params(&self) -> &[f32] {
        self.model.params()
    }
    fn params_mut(&mut self) -> &mut [f32] {
        self.model.params_mut()
    }
    fn params_and_grads_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        let (p, g) = self.model.params_and_grads_mut();
        (p, g)
    }
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        M::stage(batch, &mut self.staged)?;
        let (model, staged) = (&mut self.model, &self.staged);
        timed_pass(
            |cb| model.forward_backward_staged(staged, cb),
            |range, grads: &Vec<f32>| on_ready(range.clone(), &grads[range]),
        )
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}

/// Batch-major `[batch, len]` to time-major `[len, batch]`, reusing `out`.
pub(crate) fn transpose_into<T: Copy>(data: &[T], batch: usize, len: usize, out: &mut Vec<T>) {
    out.clear();
    out.reserve(batch * len);
    for t in 0..len {
        out.extend((0..batch).map(|b| data[b * len + t]));
    }
}

fn lstm_impl(e: EncoderType) -> LstmImpl {
    match e {
        EncoderType::Fused => LstmImpl::Fused,
        EncoderType::Stepwise => LstmImpl::Stepwise,
    }
}

/// Builds the model `cfg` asks for with the given vocabulary sizes, on the CPU with
/// `threads` threads, or for `--device cuda` on GPU `local_rank % device count` (so
/// several ranks may share one GPU).
pub fn build_model(
    cfg: &TrainConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    local_rank: usize,
    threads: usize,
) -> Result<Box<dyn TrainableModel>> {
    let seed = cfg.seed;
    let (nmt, lm, description) = model_configs(cfg, src_vocab, tgt_vocab)?;
    match cfg.device {
        DeviceKind::Cpu => {
            let backend = CpuBackend::new(threads.max(1))?;
            match cfg.model {
                ModelKind::Nmt => Ok(Box::new(ModelAdapter::wrap(
                    NmtModel::new(backend, nmt, seed)?,
                    description,
                ))),
                ModelKind::Rnnlm => Ok(Box::new(ModelAdapter::wrap(
                    RnnLm::new(backend, lm, seed)?,
                    description,
                ))),
            }
        }
        DeviceKind::Cuda => build_on_gpu(cfg, nmt, lm, description, local_rank),
    }
}

#[cfg(feature = "cuda")]
fn build_on_gpu(
    cfg: &TrainConfig,
    nmt: NmtConfig,
    lm: LmConfig,
    description: String,
    local_rank: usize,
) -> Result<Box<dyn TrainableModel>> {
    use crate::config::GemmPrecisionKind;
    use crate::gpu_adapter::GpuModelAdapter;
    use ringtrain_model::GemmPrecision;
    let (model, seed) = (cfg.model, cfg.seed);
    let precision = match cfg.gemm_precision {
        GemmPrecisionKind::F32 => GemmPrecision::F32,
        GemmPrecisionKind::F16 => GemmPrecision::F16,
        GemmPrecisionKind::Bf16 => GemmPrecision::Bf16,
    };
    let count = CudaBackend::device_count()?;
    if count == 0 {
        return Err(Error::invalid(
            "--device",
            "cuda",
            "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), or use --device cpu",
        ));
    }
    let backend = CudaBackend::with_precision(local_rank % count, precision)?;
    let description = format!(
        "{description}, GPU {} ({} matrix products)",
        backend.device(),
        cfg.gemm_precision
    );
    match model {
        ModelKind::Nmt => Ok(Box::new(GpuModelAdapter::wrap(
            NmtModel::new(backend, nmt, seed)?,
            description,
        )?)),
        ModelKind::Rnnlm => Ok(Box::new(GpuModelAdapter::wrap(
            RnnLm::new(backend, lm, seed)?,
            description,
        )?)),
    }
}

#[cfg(not(feature = "cuda"))]
fn build_on_gpu(
    _cfg: &TrainConfig,
    _nmt: NmtConfig,
    _lm: LmConfig,
    _description: String,
    local_rank: usize,
) -> Result<Box<dyn TrainableModel>> {
    // Without the feature this returns the model crate's "rebuild with --features cuda".
    let gpu = CudaBackend::new(local_rank)?;
    Err(Error::invalid(
        "--device",
        "cuda",
        format!("GPU {} needs a build with --features cuda", gpu.device()),
    ))
}

/// The NMT and LM configurations (and a description of the one `cfg` selects).
fn model_configs(
    cfg: &TrainConfig,
    src_vocab: usize,
    tgt_vocab: usize,
) -> Result<(NmtConfig, LmConfig, String)> {
    if cfg.model == ModelKind::Nmt && cfg.num_encoder_layers != cfg.num_decoder_layers {
        return Err(Error::invalid(
            "--num-decoder-layers",
            cfg.num_decoder_layers,
            format!(
                "the encoder's final states initialise the decoder, so it needs as many layers as \
                 --num-encoder-layers ({})",
                cfg.num_encoder_layers
            ),
        ));
    }
    let nmt = NmtConfig {
        src_vocab,
        tgt_vocab,
        emb: cfg.num_units,
        hidden: cfg.num_units,
        layers: cfg.num_encoder_layers,
        encoder: match cfg.direction {
            Direction::Uni => EncoderKind::Uni,
            Direction::Bi => EncoderKind::Bi,
        },
        lstm: lstm_impl(cfg.encoder_type),
        ..NmtConfig::benchmark()
    };
    let lm = LmConfig {
        vocab: src_vocab,
        emb: cfg.num_units,
        hidden: cfg.num_units,
        layers: cfg.num_encoder_layers,
        lstm: lstm_impl(cfg.encoder_type),
        init_scale: 0.1,
        forget_bias: 1.0,
    };
    let description = match cfg.model {
        ModelKind::Nmt => format!(
            "nmt {} {} {}+{} layers, {} units, vocab {}/{}",
            cfg.encoder_type,
            cfg.direction,
            nmt.layers,
            nmt.layers,
            nmt.hidden,
            src_vocab,
            tgt_vocab
        ),
        ModelKind::Rnnlm => format!(
            "rnnlm {} {} layers, {} units, vocab {}",
            cfg.encoder_type, lm.layers, lm.hidden, src_vocab
        ),
    };
    Ok((nmt, lm, description))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_is_batch_major_to_time_major() {
        let mut out = Vec::new();
        transpose_into(&[1, 2, 3, 4, 5, 6], 2, 3, &mut out);
        assert_eq!(out, vec![1, 4, 2, 5, 3, 6]);
    }

    #[test]
    fn cuda_without_the_feature_says_so_and_layer_mismatch_names_the_flag() {
        let cfg = TrainConfig {
            device: DeviceKind::Cuda,
            ..TrainConfig::default()
        };
        let err = build_model(&cfg, 50, 50, 0, 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("cuda"), "{err}");
        let cfg = TrainConfig {
            num_decoder_layers: 3,
            ..TrainConfig::default()
        };
        let err = build_model(&cfg, 50, 50, 0, 1)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("--num-decoder-layers") && err.contains('3'),
            "{err}"
        );
    }
}
