//! Flags of `ringtrain train`, named after tf_cnn_benchmarks' and the TF NMT code's
//! (the underscore spellings are accepted as aliases).

use std::path::PathBuf;

use clap::Args;
use ringtrain_train::{
    DataPaths, DeviceKind, Direction, EncoderType, GemmPrecisionKind, ModelKind, OptimizerKind,
    TrainConfig, VariableUpdate,
};

fn parse<T: std::str::FromStr<Err = ringtrain_train::Error>>(s: &str) -> Result<T, String> {
    s.parse::<T>().map_err(|e| match e {
        ringtrain_train::Error::InvalidConfig { reason, .. } => reason,
        other => other.to_string(),
    })
}

fn parse_positive(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(v) => Ok(v),
        Err(_) => Err("expected a whole number such as 32".into()),
    }
}

fn parse_rate(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err("expected a positive number such as 0.001".into()),
    }
}

fn parse_norm(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => Err("expected 0 (no clipping) or a positive number such as 5".into()),
    }
}

/// When to overlap the gradient reduction with backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OverlapMode {
    /// On for `--device cuda`, off for `--device cpu`.
    Auto,
    /// Always overlap.
    On,
    /// Reduce after backward.
    Off,
}

/// `ringtrain train`: runs one rank (start it with mpirun, or through `ringtrain launch`).
#[derive(Debug, Clone, Args)]
pub struct TrainArgs {
    /// Model: `nmt` (LSTM encoder-decoder without attention) or `rnnlm` (LSTM language model).
    #[arg(long, default_value = "nmt", value_parser = parse::<ModelKind>)]
    pub model: ModelKind,

    /// How ranks share gradients: `replicated` (all-reduce; see --overlap-backward),
    /// `parameter_server` (tensors placed greedily on server ranks that average, update
    /// and send back), or `independent` (no communication; the ideal-scaling baseline).
    #[arg(long, alias = "variable_update", default_value = "replicated", value_parser = parse::<VariableUpdate>)]
    pub variable_update: VariableUpdate,

    /// Parameter-server ranks: 0 = every rank owns a shard; K = the last K ranks are
    /// dedicated servers and do not train.
    #[arg(long, alias = "ps_ranks", default_value_t = 0)]
    pub ps_ranks: usize,

    /// Flatten all gradients, cut them into N equal packs and all-reduce each (0 = off;
    /// replaces the overlapped reduction).
    #[arg(long, alias = "gradient_repacking", default_value_t = 0)]
    pub gradient_repacking: usize,

    /// Adjacent gradients of at most this many bytes are reduced as one tensor (0 = off).
    #[arg(long, alias = "agg_small_grads_max_bytes", default_value_t = 0)]
    pub agg_small_grads_max_bytes: usize,

    /// Most gradients in one small-gradient group.
    #[arg(long, alias = "agg_small_grads_max_group", default_value_t = 10, value_parser = parse_positive)]
    pub agg_small_grads_max_group: usize,

    /// Tensor-fusion buffer threshold in bytes (overlapped reduction).
    #[arg(long, default_value_t = 64 << 20)]
    pub fusion_threshold_bytes: usize,

    /// Tensor-fusion cycle time in milliseconds.
    #[arg(long, default_value_t = 1.0)]
    pub cycle_time_ms: f64,

    /// Start all-reducing gradient ranges while backward still runs (replicated):
    /// `on`, `off`, or `auto` = on for `--device cuda`, off for `--device cpu`, where the
    /// rank's compute threads already use its cores and the reduction thread would only
    /// take cycles from backward (measured: overlap on 1-core ranks was slower).
    #[arg(long, value_enum, default_value = "auto")]
    pub overlap_backward: OverlapMode,

    /// LSTM implementation: `fused` (input GEMM for all steps at once; alias `cudnn_lstm`)
    /// or `stepwise` (one cell per step; alias `dynamic_rnn`).
    #[arg(long, alias = "encoder_type", default_value = "fused", value_parser = parse::<EncoderType>)]
    pub encoder_type: EncoderType,

    /// Encoder direction: `uni` or `bi` (half the encoder layers each way).
    #[arg(long, default_value = "uni", value_parser = parse::<Direction>)]
    pub direction: Direction,

    /// Encoder layers (NMT) or LSTM layers (RNNLM).
    #[arg(long, alias = "num_encoder_layers", default_value_t = 2, value_parser = parse_positive)]
    pub num_encoder_layers: usize,

    /// Decoder layers (NMT).
    #[arg(long, alias = "num_decoder_layers", default_value_t = 2, value_parser = parse_positive)]
    pub num_decoder_layers: usize,

    /// Hidden units per LSTM layer, also the embedding size.
    #[arg(long, alias = "num_units", default_value_t = 64, value_parser = parse_positive)]
    pub num_units: usize,

    /// Vocabulary size of each side for synthetic data (real data takes the vocab files').
    #[arg(long, alias = "vocab_size", default_value_t = 2000, value_parser = parse_positive)]
    pub vocab_size: usize,

    /// Examples per rank per step (fixed batch per rank).
    #[arg(long, alias = "batch_size", default_value_t = 32, value_parser = parse_positive)]
    pub batch_size: usize,

    /// Examples per step over all ranks, split as evenly as possible (overrides
    /// --batch-size; uneven splits are fine, gradients are weighted by examples).
    #[arg(long, alias = "total_batch_size", value_parser = parse_positive)]
    pub total_batch_size: Option<usize>,

    /// Sequence length: synthetic sequences are exactly this long; real ones are cut to it.
    #[arg(long, alias = "src_max_len", default_value_t = 20, value_parser = parse_positive)]
    pub src_max_len: usize,

    /// Train on uniform random token ids (the default when no --data is given).
    #[arg(long, alias = "use_synthetic_data", num_args = 0..=1, default_missing_value = "true")]
    pub use_synthetic_data: Option<bool>,

    /// Corpus files, comma-separated: NMT `SRC,TGT,SRC_VOCAB,TGT_VOCAB`; RNNLM `TEXT[,VOCAB]`.
    #[arg(long, value_delimiter = ',')]
    pub data: Vec<PathBuf>,

    /// Batches run before timing starts (not counted).
    #[arg(long, alias = "warmup_batches", default_value_t = 10)]
    pub warmup_batches: usize,

    /// Batches timed after the warm-up.
    #[arg(long, alias = "timed_batches", alias = "num_batches", default_value_t = 20, value_parser = parse_positive)]
    pub timed_batches: usize,

    /// Print a progress line every N steps (0 = only the final table).
    #[arg(long, alias = "display_every", default_value_t = 10)]
    pub display_every: usize,

    /// Optimizer: `adam` (default, learning rate 1e-3) or `sgd` (default learning rate 1).
    #[arg(long, default_value = "adam", value_parser = parse::<OptimizerKind>)]
    pub optimizer: OptimizerKind,

    /// Learning rate (default: 1e-3 for Adam, 1.0 for SGD).
    #[arg(long, alias = "learning_rate", allow_hyphen_values = true, value_parser = parse_rate)]
    pub learning_rate: Option<f32>,

    /// Clip gradients to this global norm (0 = no clipping).
    #[arg(long, alias = "max_gradient_norm", default_value_t = 5.0, allow_hyphen_values = true, value_parser = parse_norm)]
    pub max_gradient_norm: f32,

    /// Exchange gradients as f16 with dynamic loss scaling (start 2^16, halve and skip the
    /// step on overflow, double after 2000 clean steps).
    #[arg(long, alias = "fp16_gradients")]
    pub fp16_gradients: bool,

    /// Device: `cpu`, or `cuda` (needs a build with `--features cuda`; the GPU is the local rank).
    #[arg(long, default_value = "cpu", value_parser = parse::<DeviceKind>)]
    pub device: DeviceKind,

    /// Operand precision of the GPU matrix products: `f32`, or `f16` / `bf16` (mixed
    /// precision: tensor-core products with f32 accumulation, f32 master weights).
    /// `--device cuda` only.
    #[arg(long, alias = "gemm_precision", default_value = "f32", value_parser = parse::<GemmPrecisionKind>)]
    pub gemm_precision: GemmPrecisionKind,

    /// CPU threads per rank (0 = cores divided by the ranks on this node).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,

    /// Seed for the initial parameters and synthetic data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,

    /// Checkpoint file: written atomically at the end (and every --checkpoint-every steps).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,

    /// Also write the checkpoint every N steps (0 = only at the end).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: usize,

    /// Load --checkpoint before training and continue from it.
    #[arg(long)]
    pub resume: bool,

    /// Write the run report (config, words/s over all ranks, per-rank figures, time
    /// breakdown, launches per batch) as JSON to this file (rank 0).
    #[arg(long, alias = "json_report")]
    pub json_report: Option<PathBuf>,
}

impl TrainArgs {
    /// The training configuration these flags describe.
    pub fn to_config(&self) -> TrainConfig {
        let mut it = self.data.iter().cloned();
        let data = DataPaths {
            train_src: it.next(),
            train_tgt: if self.model == ModelKind::Nmt {
                it.next()
            } else {
                None
            },
            vocab_src: it.next(),
            vocab_tgt: it.next(),
        };
        TrainConfig {
            model: self.model,
            encoder_type: self.encoder_type,
            direction: self.direction,
            num_encoder_layers: self.num_encoder_layers,
            num_decoder_layers: self.num_decoder_layers,
            num_units: self.num_units,
            vocab_size: self.vocab_size,
            batch_size: self.batch_size,
            total_batch_size: self.total_batch_size,
            src_max_len: self.src_max_len,
            use_synthetic_data: self.use_synthetic_data.unwrap_or(self.data.is_empty()),
            data,
            warmup_batches: self.warmup_batches,
            timed_batches: self.timed_batches,
            display_every: self.display_every,
            optimizer: self.optimizer,
            learning_rate: self.learning_rate,
            max_gradient_norm: self.max_gradient_norm,
            fp16_gradients: self.fp16_gradients,
            variable_update: self.variable_update,
            gradient_repacking: self.gradient_repacking,
            agg_small_grads_max_bytes: self.agg_small_grads_max_bytes,
            agg_small_grads_max_group: self.agg_small_grads_max_group,
            fusion_threshold_bytes: self.fusion_threshold_bytes,
            cycle_time_ms: self.cycle_time_ms,
            overlap_backward: match self.overlap_backward {
                OverlapMode::On => true,
                OverlapMode::Off => false,
                OverlapMode::Auto => self.device == DeviceKind::Cuda,
            },
            ps_ranks: self.ps_ranks,
            device: self.device,
            gemm_precision: self.gemm_precision,
            threads: self.threads,
            seed: self.seed,
            checkpoint: self.checkpoint.clone(),
            checkpoint_every: self.checkpoint_every,
            resume: self.resume,
            json_report: self.json_report.clone(),
        }
    }
}
