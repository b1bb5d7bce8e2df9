//! The model a configuration asks for, built on its device.

use ringtrain_model::{CpuBackend, LmConfig, MemoryEstimate, NmtConfig, NmtModel, RnnLm};

use ringtrain_collective::Communicator;

use super::{CpuTrainable, TrainableModel};
use crate::config::{
    DeviceKind, ModelKind, OptimizerKind, PipelineBalance, ValidatedConfig, VariableUpdate,
};
use crate::device::{LocalRank, Room};
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

/// The memory the model needs on its device at `batch` sentences per step: parameters,
/// gradients and workspaces at the longest batch; and the elements of the largest
/// activation operand of its matrix products.
///
/// # Errors
/// `InvalidValue` naming the size flags when the model's parameter count overflows.
fn model_estimate(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    batch: usize,
) -> Result<(MemoryEstimate, f64)> {
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

/// What one rank needs at a batch size: on the host, the model (on the CPU), the
/// optimizer's state and the gradient exchange's copy; with `--device cuda`, on its GPU
/// the model with the optimizer's state (the parameter server keeps its state on the
/// host) and the 16-bit copies of `--gemm-precision f16|bf16`.
struct Needs {
    host: MemoryEstimate,
    device: Option<MemoryEstimate>,
    /// Elements of the largest activation operand of a matrix product.
    largest_operand: f64,
}

/// The most elements a GPU matrix product's operand may span (the kernels index with
/// 32-bit integers); `None` in a build without GPU support.
#[cfg(feature = "cuda")]
const GPU_OPERAND_LIMIT: Option<f64> = Some(ringtrain_cuda::KERNEL_INDEX_LIMIT as f64);
#[cfg(not(feature = "cuda"))]
const GPU_OPERAND_LIMIT: Option<f64> = None;

impl Needs {
    /// Whether the GPU's kernels can index the largest operand (true on cpu).
    fn indexable(&self) -> bool {
        self.device.is_none() || GPU_OPERAND_LIMIT.is_none_or(|l| self.largest_operand <= l)
    }

    /// The first check these needs fail against `rooms`, in the order a run reports
    /// them: the GPU's memory (a model too big for the GPU says so with its biggest
    /// term), the kernels' indexing, the host's memory. `None`: they fit.
    fn shortfall<'a>(&'a self, rooms: &'a Rooms) -> Option<Shortfall<'a>> {
        if let (Some(need), Some(room)) = (&self.device, &rooms.device) {
            if !room.holds(need) {
                return Some(Shortfall::Memory(need, room));
            }
        }
        if !self.indexable() {
            return Some(Shortfall::Indexing);
        }
        match &rooms.host {
            Some(room) if !room.holds(&self.host) => Some(Shortfall::Memory(&self.host, room)),
            _ => None,
        }
    }
}

/// The memory a rank may use: its node's host memory and its share of its GPU (`None`
/// where not known, or on cpu).
struct Rooms {
    host: Option<Room>,
    device: Option<Room>,
}

impl Rooms {
    fn of(cfg: &ValidatedConfig, local: &LocalRank) -> Result<Rooms> {
        Ok(Rooms {
            host: Room::host(local.size),
            device: device_room(cfg, local)?,
        })
    }
}

/// What does not fit.
enum Shortfall<'a> {
    /// The estimate exceeds its room.
    Memory(&'a MemoryEstimate, &'a Room),
    /// A matrix operand outgrows the GPU kernels' 32-bit indexing.
    Indexing,
}

fn needs_at(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    batch: usize,
) -> Result<Needs> {
    let (mut model, largest_operand) = model_estimate(cfg, src_vocab, tgt_vocab, batch)?;
    let params = model.terms.first().map_or(0.0, |t| t.bytes);
    let mut host = MemoryEstimate::default();
    let adam = cfg.config().run.optimizer == OptimizerKind::Adam;
    let exchange = cfg.config().exchange.variable_update;
    let device = match cfg.config().run.device {
        DeviceKind::Cpu => {
            host.terms.append(&mut model.terms);
            if adam {
                host.add_bytes("Adam moments", 2.0 * params);
            }
            None
        }
        DeviceKind::Cuda => {
            // The host parameters (broadcast, checkpoints).
            host.add_bytes("host parameters", params);
            if exchange == VariableUpdate::ParameterServer {
                // The pinned host mirror of the gradients; the update runs on the host.
                host.add_bytes("host gradients", params);
                if adam {
                    host.add_bytes("Adam moments", 2.0 * params);
                }
            } else if adam {
                model.add_bytes("Adam moments", 2.0 * params);
            }
            if cfg.config().run.gemm_precision != ringtrain_model::GemmPrecision::F32 {
                model.add_half_gemm_copies(params / 4.0, largest_operand);
            }
            Some(model)
        }
    };
    if exchange != VariableUpdate::Independent {
        host.add_bytes("gradient exchange", params);
    }
    Ok(Needs {
        host,
        device,
        largest_operand,
    })
}

/// Fails, before the model is built, when worker `worker` would need more memory than
/// it has ([`Needs`] against [`Rooms`]): on the host for each of the node's `local.size`
/// ranks; with `--device cuda`, on its GPU for each of the ranks that pick that GPU.
/// Returns the device estimate in bytes (`None` on cpu), for the run's report.
///
/// # Errors
/// [`Error::NotEnoughMemory`](crate::Error::NotEnoughMemory) with the estimate and its
/// biggest term; `InvalidValue` for a model too big to address, or (on cuda, once the
/// memory fits) a batch whose largest matrix operand the GPU kernels cannot index with
/// 32-bit integers, naming the largest `--batch-size` they can; GPU errors.
pub fn check_memory(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    worker: usize,
    local: &LocalRank,
) -> Result<Option<u64>> {
    let batch = cfg.local_batch_size(worker).max(1);
    let needs = needs_at(cfg, src_vocab, tgt_vocab, batch)?;
    match needs.shortfall(&Rooms::of(cfg, local)?) {
        None => Ok(needs.device.map(|d| d.total_bytes() as u64)),
        Some(Shortfall::Memory(estimate, room)) => Err(room.refusal(estimate)),
        Some(Shortfall::Indexing) => {
            let largest = largest_fitting(batch, |b| {
                Ok(needs_at(cfg, src_vocab, tgt_vocab, b)?.indexable())
            })?;
            let fix = if largest > 0 {
                format!(
                    "use --batch-size {largest} or less, or a shorter --src-max-len or fewer \
                     --num-units"
                )
            } else {
                "even --batch-size 1 is too large: use a shorter --src-max-len or fewer --num-units"
                    .into()
            };
            Err(crate::Error::invalid(
                "--batch-size",
                batch,
                format!(
                    "one matrix product's operand would hold {:.0} elements (the gates' of \
                     the longest batch, or a chunk of the logits' gradient), more than the {} \
                     the GPU kernels index with 32-bit integers: {fix}",
                    needs.largest_operand,
                    GPU_OPERAND_LIMIT.unwrap_or_default()
                ),
            ))
        }
    }
}

/// What `ringtrain train --dry-run` says: one rank's needs at its batch size, the room it
/// has, and the largest batch size the same checks accept (the estimate fits the room;
/// on the GPU, the kernels' 32-bit indexing reaches every operand).
#[derive(Debug, Clone)]
pub struct MemoryPlan {
    /// The rank's batch size (sentences or windows per step).
    pub batch: usize,
    /// Host memory one rank needs, and what is available to each of the node's ranks.
    pub host: (MemoryEstimate, Option<Room>),
    /// GPU memory one rank needs, and its share of the GPU's free memory (`None` on cpu).
    pub device: Option<(MemoryEstimate, Option<Room>)>,
    /// The largest batch size [`check_memory`] accepts with these rooms (`None` when no
    /// room is known; 0 when not even one sentence fits).
    pub largest_batch: Option<usize>,
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use ringtrain_model::memory::format_bytes;
        let line = |f: &mut std::fmt::Formatter<'_>,
                    what: &str,
                    est: &MemoryEstimate,
                    room: &Option<Room>| {
            let room = room
                .as_ref()
                .map_or("(available memory unknown)".to_string(), |r| {
                    format!(
                        "of {} available to each of {} rank(s) on {}",
                        format_bytes(r.per_rank()),
                        r.ranks,
                        r.place
                    )
                });
            writeln!(f, "  {what}: needs {est} per rank, {room}")
        };
        writeln!(
            f,
            "dry run at batch size {} per rank (nothing is trained):",
            self.batch
        )?;
        if let Some((est, room)) = &self.device {
            line(f, "device", est, room)?;
        }
        line(f, "host", &self.host.0, &self.host.1)?;
        let by = if self.device.is_some() {
            "by the memory estimate and the GPU kernels' 32-bit indexing"
        } else {
            "by the memory estimate"
        };
        match self.largest_batch {
            Some(0) => write!(f, "  not even batch size 1 fits ({by})"),
            Some(b) => write!(f, "  largest --batch-size that fits: {b} ({by})"),
            None => write!(
                f,
                "  largest --batch-size: unknown (no available memory to compare)"
            ),
        }
    }
}

/// The plan of worker `worker` ([`MemoryPlan`]): what [`check_memory`] compares, and the
/// largest batch size it accepts.
///
/// # Errors
/// As [`check_memory`], except that too little memory is a figure here, not an error.
pub fn plan_memory(
    cfg: &ValidatedConfig,
    src_vocab: usize,
    tgt_vocab: usize,
    worker: usize,
    local: &LocalRank,
) -> Result<MemoryPlan> {
    let batch = cfg.local_batch_size(worker).max(1);
    let now = needs_at(cfg, src_vocab, tgt_vocab, batch)?;
    let rooms = Rooms::of(cfg, local)?;
    let largest_batch = if rooms.host.is_none() && rooms.device.is_none() {
        None
    } else {
        Some(largest_fitting(batch, |b| {
            Ok(needs_at(cfg, src_vocab, tgt_vocab, b)?
                .shortfall(&rooms)
                .is_none())
        })?)
    };
    Ok(MemoryPlan {
        batch,
        host: (now.host, rooms.host),
        device: now.device.map(|d| (d, rooms.device)),
        largest_batch,
    })
}

/// The largest `b >= 1` with `fits(b)` (0 when `fits(1)` is false), for a `fits` that
/// holds up to some size and not above it: doubling from `start`, then bisection.
fn largest_fitting(start: usize, fits: impl Fn(usize) -> Result<bool>) -> Result<usize> {
    let (mut good, mut bad) = (0usize, None);
    let mut b = start.max(1);
    while bad.is_none() {
        if fits(b)? {
            good = b;
            match b.checked_mul(2) {
                Some(next) if next <= 1 << 40 => b = next,
                _ => return Ok(good), // past any memory there is
            }
        } else {
            bad = Some(b);
        }
    }
    let mut bad = bad.unwrap_or(good + 1);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(good)
}

/// The free memory of the GPU this rank picks (`local.rank % device count`), shared by
/// the node's ranks that pick it; `None` without a GPU (building the model then says so).
#[cfg(feature = "cuda")]
fn device_room(cfg: &ValidatedConfig, local: &LocalRank) -> Result<Option<Room>> {
    use ringtrain_model::CudaBackend;

    if cfg.config().run.device != DeviceKind::Cuda {
        return Ok(None);
    }
    let count = CudaBackend::device_count()?;
    if count == 0 {
        return Ok(None);
    }
    let device = local.rank % count;
    let sharing = local.size / count + usize::from(device < local.size % count);
    let gpu = ringtrain_cuda::Gpu::new(device).map_err(ringtrain_model::Error::from)?;
    let (free, _) = gpu.memory_info().map_err(ringtrain_model::Error::from)?;
    Ok(Some(Room {
        place: format!("GPU {device}"),
        available: free as f64,
        ranks: sharing.max(1),
    }))
}

#[cfg(not(feature = "cuda"))]
fn device_room(_: &ValidatedConfig, _: &LocalRank) -> Result<Option<Room>> {
    Ok(None) // validation refuses --device cuda in this build
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

    #[test]
    fn the_largest_fitting_batch_is_found_from_above_and_below() {
        for limit in [0usize, 1, 2, 3, 31, 32, 33, 384, 385, 1000, 65_537] {
            for start in [1usize, 7, 384, 5000] {
                let got = largest_fitting(start, |b| Ok(b <= limit)).unwrap();
                assert_eq!(got, limit, "start {start}");
            }
        }
        // Fitting everywhere stops at a size past any memory.
        assert_eq!(largest_fitting(3, |_| Ok(true)).unwrap(), 3 << 38);
        // An error is passed on.
        assert!(largest_fitting(3, |b| if b > 5 {
            Err(crate::Error::Internal("x".into()))
        } else {
            Ok(true)
        })
        .is_err());
    }
}
