//! The model a configuration asks for, built on its device.

use ringtrain_model::{CpuBackend, LmConfig, MemoryEstimate, NmtConfig, NmtModel, RnnLm};

use ringtrain_collective::Communicator;

use super::{CpuTrainable, TrainableModel};
use crate::config::{
    DeviceKind, ModelKind, OptimizerKind, PipelineBalance, ValidatedConfig, VariableUpdate,
};
use crate::device::{check_host_memory, LocalRank};
use crate::error::Result;
use crate::pipeline::{
    agree_unit_costs, measure_unit_costs, warm_up_batch, PipelineTrainable, StagesOnBatch,
};

/// Builds the model `cfg` asks for with the given vocabulary sizes, on the CPU with
/// `threads` threads, or for `--device cuda` on GPU `local_rank % device count` (so
/// several ranks may share one GPU).
///
/// # Errors
/// The model crate's (sizes, thread pool), or a GPU error; `--device cuda` in a build
/// without the `cuda` feature says to rebuild with it.
pub fn build_model(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    local_rank: usize,
    threads: usize,
) -> Result<Box<dyn TrainableModel>> {
    let shape = ModelShape::new(cfg, src_vocab, tgt_vocab);
    let seed = cfg.config().run.seed;
    match cfg.config().run.device {
        DeviceKind::Cpu => {
            let backend =
                CpuBackend::with_precision(threads.max(1), cfg.config().run.gemm_precision)?;
            Ok(match shape {
                ModelShape::Nmt(nmt, description) => Box::new(CpuTrainable::new(
                    NmtModel::new(backend, nmt, seed)?,
                    description,
                )),
                ModelShape::Lm(lm, description) => Box::new(CpuTrainable::new(
                    RnnLm::new(backend, lm, seed)?,
                    description,
                )),
            })
        }
        DeviceKind::Cuda => on_gpu(cfg, shape, local_rank),
    }
}

/// Builds the pipeline stage `cfg.pipeline_stage(comm.rank())` of the model `cfg` asks
/// for, on the CPU with `threads` threads, or for `--device cuda` on GPU
/// `local_rank % device count` (updated there); its activations travel over `comm`.
///
/// # Errors
/// As [`build_model`]; `InvalidValue` when the stages do not fit the model.
pub fn build_pipeline_stage(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    local_rank: usize,
    threads: usize,
    mut comm: Communicator,
) -> Result<Box<dyn TrainableModel>> {
    let seed = cfg.config().run.seed;
    let shape = ModelShape::new(cfg, src_vocab, tgt_vocab);
    let vocab = (src_vocab, tgt_vocab);
    if cfg.config().run.device == DeviceKind::Cuda {
        return stage_on_gpu(cfg, shape, local_rank, comm, vocab);
    }
    let backend = CpuBackend::with_precision(threads.max(1), cfg.config().run.gemm_precision)?;
    Ok(match shape {
        ModelShape::Nmt(nmt, description) => {
            let mut model = NmtModel::new(backend, nmt, seed)?;
            let costs = unit_costs(cfg, &mut model, &mut comm, vocab)?;
            Box::new(PipelineTrainable::new(
                model,
                comm,
                cfg,
                description,
                costs.as_deref(),
            )?)
        }
        ModelShape::Lm(lm, description) => {
            let mut model = RnnLm::new(backend, lm, seed)?;
            let costs = unit_costs(cfg, &mut model, &mut comm, vocab)?;
            Box::new(PipelineTrainable::new(
                model,
                comm,
                cfg,
                description,
                costs.as_deref(),
            )?)
        }
    })
}

/// The unit costs `--pipeline-balance time` balances the stages by: rank 0 times
/// `model`'s units on a warm-up micro-batch and every rank gets its figures (collective
/// over `comm`); `None` for the balance by parameter count or a split by hand.
///
/// # Errors
/// Rank 0's measurement error (on every rank); transport errors.
fn unit_costs<M: StagesOnBatch>(
    cfg: &ValidatedConfig,
    model: &mut M,
    comm: &mut Communicator,
    (src_vocab, tgt_vocab): (usize, usize),
) -> Result<Option<Vec<f64>>> {
    let exchange = &cfg.config().exchange;
    if exchange.pipeline_balance != PipelineBalance::Time || !exchange.pipeline_split.is_empty() {
        return Ok(None);
    }
    let units = model.pipeline_units().len();
    let measured = (comm.rank() == 0).then(|| {
        warm_up_batch(cfg, src_vocab, tgt_vocab).and_then(|batch| measure_unit_costs(model, &batch))
    });
    agree_unit_costs(comm, measured, units).map(Some)
}

/// The memory worker `worker`'s model needs on its device: parameters, gradients and
/// workspaces at the longest batch; and the elements of the largest activation operand of
/// its matrix products.
///
/// # Errors
/// `InvalidValue` naming the size flags when the model's parameter count overflows.
fn model_estimate(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    worker: usize,
) -> Result<(MemoryEstimate, f64)> {
    let batch = cfg.local_batch_size(worker).max(1);
    let (src_len, tgt_len) = crate::input::max_sequence_lengths(cfg);
    let estimate = match ModelShape::new(cfg, src_vocab, tgt_vocab) {
        ModelShape::Nmt(nmt, _) => nmt
            .memory_estimate(batch, src_len, tgt_len)
            .map(|e| (e, nmt.largest_gemm_operand(batch, src_len, tgt_len))),
        ModelShape::Lm(lm, _) => lm
            .memory_estimate(batch, src_len)
            .map(|e| (e, lm.largest_gemm_operand(batch, src_len))),
    };
    estimate.map_err(|e| {
        crate::error::Error::invalid(
            "--num-units",
            cfg.config().model.num_units,
            format!(
                "with --vocab-size / the vocabularies ({src_vocab}, {tgt_vocab}) the model is \
                 too big to address ({e}): use smaller sizes"
            ),
        )
    })
}

/// Fails, before the model is built, when worker `worker` would need more memory than
/// its node has available: on the host, the model (on the CPU), the optimizer's state
/// and the gradient exchange's copy, for each of the node's `local.size` ranks; with
/// `--device cuda`, also the model on its GPU (with the optimizer's state, and the
/// 16-bit copies of `--gemm-precision f16|bf16`), shared by the ranks that pick that GPU.
/// Returns that device estimate in bytes (`None` on cpu), for the run's report.
///
/// # Errors
/// [`Error::NotEnoughMemory`](crate::Error::NotEnoughMemory) with the estimate and its
/// biggest term; `InvalidValue` for a model too big to address; GPU errors.
pub fn check_memory(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    worker: usize,
    local: &LocalRank,
) -> Result<Option<u64>> {
    let (mut model, largest_operand) = model_estimate(cfg, src_vocab, tgt_vocab, worker)?;
    let params = model.terms.first().map_or(0.0, |t| t.bytes);
    let mut on_device = None;
    let mut host = MemoryEstimate::default();
    let adam = cfg.config().run.optimizer == OptimizerKind::Adam;
    let exchange = cfg.config().exchange.variable_update;
    match cfg.config().run.device {
        DeviceKind::Cpu => {
            host.terms.extend(model.terms.iter().cloned());
            if adam {
                host.add_bytes("Adam moments", 2.0 * params);
            }
        }
        DeviceKind::Cuda if exchange == VariableUpdate::ParameterServer => {
            // The pinned host mirrors of the parameters and the gradients; the update
            // runs on the host.
            host.add_bytes("host parameters", params);
            host.add_bytes("host gradients", params);
            if adam {
                host.add_bytes("Adam moments", 2.0 * params);
            }
            add_half_gemm_copies(cfg, &mut model, params, largest_operand);
            check_device_memory(&model, local)?;
            on_device = Some(model.total_bytes() as u64);
        }
        DeviceKind::Cuda => {
            // The host parameters (broadcast, checkpoints); the update runs on the
            // device, with the optimizer's state there.
            host.add_bytes("host parameters", params);
            if adam {
                model.add_bytes("Adam moments", 2.0 * params);
            }
            add_half_gemm_copies(cfg, &mut model, params, largest_operand);
            check_device_memory(&model, local)?;
            on_device = Some(model.total_bytes() as u64);
        }
    }
    if exchange != VariableUpdate::Independent {
        host.add_bytes("gradient exchange", params);
    }
    check_host_memory(&host, local.size)?;
    Ok(on_device)
}

/// With `--gemm-precision f16|bf16`, what the GPU's 16-bit products hold (the
/// parameters being `param_bytes` of f32).
fn add_half_gemm_copies(
    cfg: &ValidatedConfig,
    model: &mut MemoryEstimate,
    param_bytes: f64,
    largest_operand: f64,
) {
    if cfg.config().run.gemm_precision != ringtrain_model::GemmPrecision::F32 {
        model.add_half_gemm_copies(param_bytes / 4.0, largest_operand);
    }
}

#[cfg(feature = "cuda")]
fn check_device_memory(model: &MemoryEstimate, local: &LocalRank) -> Result<()> {
    use ringtrain_model::CudaBackend;

    let count = CudaBackend::device_count()?;
    if count == 0 {
        return Ok(()); // building the model says there is no GPU
    }
    let device = local.rank % count;
    let sharing = local.size / count + usize::from(device < local.size % count);
    let gpu = ringtrain_cuda::Gpu::new(device).map_err(ringtrain_model::Error::from)?;
    let (free, _) = gpu.memory_info().map_err(ringtrain_model::Error::from)?;
    crate::device::check_memory(model, sharing.max(1), free as f64, &format!("GPU {device}"))
}

#[cfg(not(feature = "cuda"))]
fn check_device_memory(_: &MemoryEstimate, _: &LocalRank) -> Result<()> {
    Ok(()) // validation refuses --device cuda in this build
}

/// The model crate's configuration of the model `cfg` selects, and its description.
enum ModelShape {
    Nmt(NmtConfig, String),
    Lm(LmConfig, String),
}

impl ModelShape {
    fn new(cfg: &ValidatedConfig, src_vocab: usize, tgt_vocab: usize) -> Self {
        let m = &cfg.config().model;
        // `fused`, or a seed's name with the implementation it runs: `dynamic_rnn (stepwise)`.
        let lstm = match m.encoder_type.seed_semantics() {
            Some(_) => format!("{} ({})", m.encoder_type, cfg.lstm_impl()),
            None => cfg.lstm_impl().to_string(),
        };
        match m.model {
            ModelKind::Nmt => ModelShape::Nmt(
                NmtConfig {
                    src_vocab,
                    tgt_vocab,
                    emb: m.num_units,
                    hidden: m.num_units,
                    layers: m.num_encoder_layers,
                    encoder: m.direction,
                    lstm: cfg.lstm_impl(),
                    source_lengths: cfg.source_lengths(),
                    bi_layer_input: cfg.bi_layer_input(),
                    ..NmtConfig::benchmark()
                },
                format!(
                    "nmt {lstm} {} {}+{} layers, {} units, source lengths {}, bi-layer input {}, \
                     vocab {}/{}",
                    m.direction,
                    m.num_encoder_layers,
                    m.num_decoder_layers,
                    m.num_units,
                    cfg.source_lengths(),
                    cfg.bi_layer_input(),
                    src_vocab,
                    tgt_vocab
                ),
            ),
            ModelKind::Rnnlm => ModelShape::Lm(
                LmConfig {
                    vocab: src_vocab,
                    emb: m.num_units,
                    hidden: m.num_units,
                    layers: m.num_encoder_layers,
                    lstm: cfg.lstm_impl(),
                    init_scale: 0.1,
                    forget_bias: 1.0,
                },
                format!(
                    "rnnlm {lstm} {} layers, {} units, vocab {}",
                    m.num_encoder_layers, m.num_units, src_vocab
                ),
            ),
        }
    }
}

/// The CUDA backend on GPU `local_rank % device count`.
#[cfg(feature = "cuda")]
fn gpu_backend(cfg: &ValidatedConfig, local_rank: usize) -> Result<ringtrain_model::CudaBackend> {
    use crate::error::Error;
    use ringtrain_model::CudaBackend;

    let count = CudaBackend::device_count()?;
    if count == 0 {
        return Err(Error::invalid(
            "--device",
            "cuda",
            "no CUDA device is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), or use --device cpu",
        ));
    }
    Ok(CudaBackend::with_precision(
        local_rank % count,
        cfg.config().run.gemm_precision,
    )?)
}

/// A pipeline stage on its GPU, updated there.
#[cfg(feature = "cuda")]
fn stage_on_gpu(
    cfg: &ValidatedConfig,
    shape: ModelShape,
    local_rank: usize,
    mut comm: Communicator,
    vocab: (usize, usize),
) -> Result<Box<dyn TrainableModel>> {
    use crate::pipeline::GpuPipelineStage;

    let run = &cfg.config().run;
    let backend = gpu_backend(cfg, local_rank)?;
    let on = |description: String| {
        format!(
            "{description}, GPU {} ({} matrix products)",
            backend.device(),
            run.gemm_precision
        )
    };
    Ok(match shape {
        ModelShape::Nmt(nmt, description) => {
            let description = on(description);
            let mut model = NmtModel::new(backend, nmt, run.seed)?;
            let costs = unit_costs(cfg, &mut model, &mut comm, vocab)?;
            Box::new(GpuPipelineStage::new(
                model,
                comm,
                cfg,
                description,
                costs.as_deref(),
            )?)
        }
        ModelShape::Lm(lm, description) => {
            let description = on(description);
            let mut model = RnnLm::new(backend, lm, run.seed)?;
            let costs = unit_costs(cfg, &mut model, &mut comm, vocab)?;
            Box::new(GpuPipelineStage::new(
                model,
                comm,
                cfg,
                description,
                costs.as_deref(),
            )?)
        }
    })
}

#[cfg(not(feature = "cuda"))]
fn stage_on_gpu(
    _cfg: &ValidatedConfig,
    _shape: ModelShape,
    local_rank: usize,
    _comm: Communicator,
    _vocab: (usize, usize),
) -> Result<Box<dyn TrainableModel>> {
    // As for `on_gpu`: validation refuses `--device cuda` in this build.
    Err(ringtrain_model::Error::NotCompiledWithCuda { device: local_rank }.into())
}

#[cfg(feature = "cuda")]
fn on_gpu(
    cfg: &ValidatedConfig,
    shape: ModelShape,
    local_rank: usize,
) -> Result<Box<dyn TrainableModel>> {
    use super::GpuTrainable;

    let run = &cfg.config().run;
    let backend = gpu_backend(cfg, local_rank)?;
    // The parameter servers update their shards on the host; every other strategy
    // updates on the device.
    let resident =
        cfg.config().exchange.variable_update != crate::config::VariableUpdate::ParameterServer;
    let on = |description: String| {
        format!(
            "{description}, GPU {} ({} matrix products)",
            backend.device(),
            run.gemm_precision
        )
    };
    Ok(match shape {
        ModelShape::Nmt(nmt, description) => {
            let description = on(description);
            Box::new(GpuTrainable::new(
                NmtModel::new(backend, nmt, run.seed)?,
                description,
                resident,
            )?)
        }
        ModelShape::Lm(lm, description) => {
            let description = on(description);
            Box::new(GpuTrainable::new(
                RnnLm::new(backend, lm, run.seed)?,
                description,
                resident,
            )?)
        }
    })
}

#[cfg(not(feature = "cuda"))]
fn on_gpu(
    _cfg: &ValidatedConfig,
    _shape: ModelShape,
    local_rank: usize,
) -> Result<Box<dyn TrainableModel>> {
    // Validation refuses `--device cuda` in this build; a caller that skipped it gets
    // the model crate's "rebuild with --features cuda".
    Err(ringtrain_model::Error::NotCompiledWithCuda { device: local_rank }.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TrainConfig;

    #[test]
    fn the_description_names_the_shape() {
        let Ok(cfg) = TrainConfig::default().validate(1) else {
            panic!("the default config is valid");
        };
        let model = build_model(&cfg, 50, 40, 0, 1).map(|m| m.describe());
        assert_eq!(
            model.ok().as_deref(),
            Some(
                "nmt fused uni 2+2 layers, 64 units, source lengths off, bi-layer input own, \
                 vocab 50/40"
            )
        );
        let mut seed = TrainConfig::default();
        seed.model.encoder_type = crate::config::EncoderType::DynamicRnn;
        let Ok(cfg) = seed.validate(1) else {
            panic!("the seed's config is valid");
        };
        let model = build_model(&cfg, 50, 40, 0, 1).map(|m| m.describe());
        assert_eq!(
            model.ok().as_deref(),
            Some(
                "nmt dynamic_rnn (stepwise) uni 2+2 layers, 64 units, source lengths on, \
                 bi-layer input own, vocab 50/40"
            )
        );
    }
}
