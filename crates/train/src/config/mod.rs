//! Training configuration: every choice a run makes, in five groups, with the seeds'
//! flag names.
//!
//! | group | what it decides |
//! |---|---|
//! | [`ModelOptions`] | which model, its LSTM implementation and shape |
//! | [`DataOptions`] | synthetic or corpus input, vocabulary, batch size and length |
//! | [`ExchangeOptions`] | how ranks share gradients: strategy, packing, fusion, f16 |
//! | [`RunOptions`] | device, threads, optimizer, steps and seed |
//! | [`OutputOptions`] | progress lines, checkpoints, the JSON report, the timeline |
//!
//! Each field is declared once, with its documentation (which is also its `--help`
//! text), its flag and its default: one declaration gives the struct, its [`Default`]
//! and, with the crate feature `cli`, its clap arguments (`ringtrain train` flattens the
//! five groups). A [`TrainConfig`] is what the user asked for, `auto` values and all;
//! [`TrainConfig::validate`] checks every value once, against the number of ranks, and
//! resolves the `auto` ones into a [`ValidatedConfig`], the only form the trainer runs.
//!
//! ```
//! use ringtrain_train::{TrainConfig, VariableUpdate};
//!
//! let mut cfg = TrainConfig::default();
//! cfg.exchange.variable_update = VariableUpdate::ParameterServer;
//! cfg.exchange.ps_ranks = 1;
//! let run = cfg.validate(3)?; // 3 ranks: 2 workers and a dedicated server
//! assert_eq!(run.workers(), 2);
//! assert!(!run.overlap_backward()); // `auto` on the CPU
//! let err = cfg.validate(1).unwrap_err().to_string();
//! assert!(err.contains("--ps-ranks"), "{err}");
//! # Ok::<(), ringtrain_train::Error>(())
//! ```

use std::path::PathBuf;

use ringtrain_collective::fusion::{DEFAULT_CYCLE_TIME, DEFAULT_THRESHOLD_BYTES};
use ringtrain_collective::{Algorithm, DEFAULT_STALL_TIMEOUT};
use ringtrain_model::{BiLayerInput, EncoderKind, GemmPrecision, SourceLengths};
use serde::{Deserialize, Serialize};

use crate::timeline::StepWindow;

mod choices;
mod validated;

pub use choices::{
    parse_bi_layer_input, parse_encoder_kind, parse_gemm_precision, parse_source_lengths,
    DeviceKind, EncoderType, ModelKind, OptimizerKind, OverlapMode, PipelineBalance,
    PipelineSchedule, VariableUpdate,
};
pub use validated::{DataSource, HeldOutSource, Reduction, ValidatedConfig};

/// Default `--timeline-layer-bytes`: backward ranges from 64 KiB get their own event.
pub const DEFAULT_TIMELINE_LAYER_BYTES: usize = 64 * 1024;

/// Adam's learning rate when `--learning-rate` is not given (PyTorch's default).
pub const DEFAULT_ADAM_LEARNING_RATE: f32 = 1e-3;

/// Plain SGD's learning rate when `--learning-rate` is not given.
pub const DEFAULT_SGD_LEARNING_RATE: f32 = 1.0;

/// Reads a flag's value with the type's own parser, keeping only the reason (clap adds
/// the flag and the value).
#[cfg(feature = "cli")]
fn parse<T: std::str::FromStr<Err = crate::Error>>(s: &str) -> Result<T, String> {
    s.parse::<T>().map_err(|e| e.reason())
}

#[cfg(feature = "cli")]
fn source_lengths(s: &str) -> Result<SourceLengths, String> {
    parse_source_lengths(s).map_err(|e| e.reason())
}

#[cfg(feature = "cli")]
fn bi_layer_input(s: &str) -> Result<BiLayerInput, String> {
    parse_bi_layer_input(s).map_err(|e| e.reason())
}

#[cfg(feature = "cli")]
fn encoder_kind(s: &str) -> Result<EncoderKind, String> {
    parse_encoder_kind(s).map_err(|e| e.reason())
}

#[cfg(feature = "cli")]
fn gemm_precision(s: &str) -> Result<GemmPrecision, String> {
    parse_gemm_precision(s).map_err(|e| e.reason())
}

/// A number, as the flag's text says it; range checks come with [`TrainConfig::validate`].
/// `nan` and `inf` are not numbers here.
#[cfg(feature = "cli")]
fn finite(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err("expected a finite number such as 0.001".into()),
    }
}

/// A number, as the flag's text says it (f64); range checks come with
/// [`TrainConfig::validate`]. `nan` and `inf` are not numbers here.
#[cfg(feature = "cli")]
fn finite_f64(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err("expected a finite number such as 150".into()),
    }
}

/// Seconds, or `off` (the same as 0); range checks come with [`TrainConfig::validate`].
#[cfg(feature = "cli")]
fn seconds_or_off(s: &str) -> Result<f64, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(0.0);
    }
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err("expected a number of seconds such as 60, or `off`".into()),
    }
}

/// Declares one group of options: for each field its docs, its clap `#[arg(...)]` (used
/// with feature `cli`) and, after `=`, its default (else `Default::default()`: `false`,
/// `None`, empty). Emits the struct, `Default`, serde and, with `cli`, `clap::Args`.
macro_rules! options {
    (
        $(#[$smeta:meta])*
        pub struct $name:ident {
            $(
                $(#[doc = $doc:literal])*
                #[arg($($arg:tt)*)]
                $field:ident : $ty:ty $(= $default:expr)?
            ),* $(,)?
        }
    ) => {
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[cfg_attr(feature = "cli", derive(clap::Args))]
        $(#[$smeta])*
        pub struct $name {
            $(
                $(#[doc = $doc])*
                #[cfg_attr(feature = "cli", arg($($arg)* $(, default_value_t = $default)?))]
                pub $field: $ty,
            )*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $( $field: options!(@default $($default)?), )* }
            }
        }
    };
    (@default $default:expr) => { $default };
    (@default) => { Default::default() };
}

options! {
    /// What is trained: the model, its LSTM implementation and its shape.
    #[cfg_attr(feature = "cli", command(next_help_heading = "Model"))]
    pub struct ModelOptions {
        /// Model: `nmt` (LSTM encoder-decoder without attention) or `rnnlm` (LSTM
        /// language model).
        #[arg(long, value_parser = parse::<ModelKind>)]
        model: ModelKind = ModelKind::Nmt,
        /// LSTM implementation: `fused` (input GEMM for all steps at once) or `stepwise`
        /// (one cell per step); or a seed's whole model: `cudnn_lstm` (fused,
        /// --source-lengths off, --bi-layer-input concat) or `dynamic_rnn` (stepwise,
        /// --source-lengths on, --bi-layer-input own).
        #[arg(long, alias = "encoder_type", value_parser = parse::<EncoderType>)]
        encoder_type: EncoderType = EncoderType::Fused,
        /// NMT encoder: `on` stops at each sentence's real end (padding neither changes
        /// the state nor gets gradient, as TF's dynamic_rnn with sequence_length); `off`
        /// reads padding like any token. Default: off, or what a seed's --encoder-type
        /// selects.
        #[arg(long, value_parser = source_lengths)]
        source_lengths: Option<SourceLengths>,
        /// Bi encoder layers above the first read `concat` (both directions of the layer
        /// below, 2 x units wide, as cuDNN) or `own` (their own direction's, as TF's
        /// bidirectional_dynamic_rnn). Default: own, or what a seed's --encoder-type
        /// selects.
        #[arg(long, value_parser = bi_layer_input)]
        bi_layer_input: Option<BiLayerInput>,
        /// Encoder direction: `uni` or `bi` (half the encoder layers each way).
        #[arg(long, value_parser = encoder_kind)]
        direction: EncoderKind = EncoderKind::Uni,
        /// Encoder layers (NMT) or LSTM layers (RNNLM).
        #[arg(long, alias = "num_encoder_layers")]
        num_encoder_layers: usize = 2,
        /// Decoder layers (NMT; as many as encoder layers).
        #[arg(long, alias = "num_decoder_layers")]
        num_decoder_layers: usize = 2,
        /// Hidden units per LSTM layer, also the embedding size.
        #[arg(long, alias = "num_units")]
        num_units: usize = 64,
    }
}

options! {
    /// What the model reads: synthetic ids or a corpus, and the batch shape.
    #[cfg_attr(feature = "cli", command(next_help_heading = "Data"))]
    // Files written before a field existed read it as its default.
    #[serde(default)]
    pub struct DataOptions {
        /// Train on uniform random token ids (the default when no --data is given).
        #[arg(long, alias = "use_synthetic_data", num_args = 0..=1, default_missing_value = "true")]
        use_synthetic_data: Option<bool>,
        /// Corpus files, comma-separated: NMT `SRC,TGT,SRC_VOCAB,TGT_VOCAB`; RNNLM
        /// `TEXT[,VOCAB]`.
        #[arg(long, value_delimiter = ',')]
        data: Vec<PathBuf>,
        /// Vocabulary size of each side for synthetic data (real data takes the vocab
        /// files').
        #[arg(long, alias = "vocab_size")]
        vocab_size: usize = 2000,
        /// Examples per rank per step (fixed batch per rank).
        #[arg(long, alias = "batch_size")]
        batch_size: usize = 32,
        /// Examples per step over all ranks, split as evenly as possible (overrides
        /// --batch-size; uneven splits are fine, gradients are weighted by examples).
        #[arg(long, alias = "total_batch_size")]
        total_batch_size: Option<usize>,
        /// Sequence length: synthetic sequences are exactly this long; real ones are cut
        /// to it.
        #[arg(long, alias = "src_max_len")]
        src_max_len: usize = 20,
        /// Most tokens of a corpus file, in percent, that its vocabulary may not know
        /// (they read as `<unk>`); more fails at start, as swapped or wrong vocabulary
        /// files do. 100 turns the check off.
        #[arg(long, value_parser = finite)]
        max_unk_percent: f32 = 5.0,
        /// Held-out files, comma-separated: NMT `SRC,TGT` (read with --data's
        /// vocabularies), RNNLM `TEXT` (read with the training vocabulary). Evaluated
        /// every --eval-every steps and once at the end: loss per target token and
        /// perplexity over the whole set, without updating anything.
        #[arg(long, value_delimiter = ',')]
        eval_data: Vec<PathBuf>,
    }
}

options! {
    /// How ranks share gradients and parameters, and how a pipeline cuts the model.
    #[cfg_attr(feature = "cli", command(next_help_heading = "Gradient exchange"))]
    // Files written before a field existed read it as its default.
    #[serde(default)]
    pub struct ExchangeOptions {
        /// How ranks share gradients: `replicated` (all-reduce; see --overlap-backward),
        /// `parameter_server` (tensors placed greedily on server ranks that average,
        /// update and send back), or `independent` (no communication; the ideal-scaling
        /// baseline).
        #[arg(long, alias = "variable_update", value_parser = parse::<VariableUpdate>)]
        variable_update: VariableUpdate = VariableUpdate::Replicated,
        /// Parameter-server ranks: 0 = every rank owns a shard; K = the last K ranks are
        /// dedicated servers and do not train.
        #[arg(long, alias = "ps_ranks")]
        ps_ranks: usize = 0,
        /// Flatten all gradients, cut them into N equal packs and all-reduce each (0 =
        /// off; replaces the overlapped reduction).
        #[arg(long, alias = "gradient_repacking")]
        gradient_repacking: usize = 0,
        /// Adjacent gradients of at most this many bytes are reduced as one tensor (0 =
        /// off).
        #[arg(long, alias = "agg_small_grads_max_bytes")]
        agg_small_grads_max_bytes: usize = 0,
        /// Most gradients in one small-gradient group.
        #[arg(long, alias = "agg_small_grads_max_group")]
        agg_small_grads_max_group: usize = 10,
        /// Tensor-fusion buffer threshold in bytes (overlapped reduction).
        #[arg(long)]
        fusion_threshold_bytes: usize = DEFAULT_THRESHOLD_BYTES,
        /// Tensor-fusion cycle time in milliseconds.
        #[arg(long)]
        cycle_time_ms: f64 = DEFAULT_CYCLE_TIME.as_secs_f64() * 1e3,
        /// Start all-reducing gradient ranges while backward still runs (replicated):
        /// `on`, `off`, or `auto` = on for `--device cuda`, off for `--device cpu`, where
        /// the rank's compute threads already use its cores and the reduction thread
        /// would only take cycles from backward (measured: overlap on 1-core ranks was
        /// slower).
        #[arg(long, value_parser = parse::<OverlapMode>)]
        overlap_backward: OverlapMode = OverlapMode::Auto,
        /// Exchange gradients as f16 with dynamic loss scaling (start 2^16, halve and
        /// skip the step on overflow, double after 2000 clean steps).
        #[arg(long, alias = "fp16_gradients")]
        fp16_gradients: bool,
        /// All-reduce algorithm for the gradients (`replicated`): `auto` (the fastest
        /// measured for the rank count and size on one node), `hier` (hierarchical: within
        /// each node, then across nodes; for jobs on several nodes, like Horovod's
        /// HOROVOD_HIERARCHICAL_ALLREDUCE), or one by name: `ring`, `rd`, `hd`, `direct`,
        /// `sg`, `shm` (every rank on one node), `mpi` (`MPI_Allreduce`).
        #[arg(long)]
        allreduce_algorithm: Algorithm = Algorithm::Auto,
        /// Seconds a collective may wait on other ranks without progress (a rank
        /// stopped, stuck or on a dead node): at half, a warning names the ranks waited
        /// for and the operation and step; at the timeout every waiting rank prints an
        /// error and the job is aborted (`MPI_Abort`, exit status 3). `0` or `off`
        /// waits for ever.
        #[arg(long, value_parser = seconds_or_off)]
        stall_timeout: f64 = DEFAULT_STALL_TIMEOUT.as_secs_f64(),
        /// Pipeline stages K: the model's units (RNNLM: embedding, each LSTM layer,
        /// projection + loss; NMT: source embedding + encoder, each decoder layer (the
        /// first with the target embedding), projection + loss) are cut into K
        /// consecutive stages, one per rank, that pass activations forward and their
        /// gradients back. The rank count must be a multiple of K; 1 = no pipeline.
        #[arg(long)]
        pipeline_stages: usize = 1,
        /// Micro-batches M each stage splits a batch into (pipeline): gradients are
        /// summed over them before the one update of the batch. At most the batch size.
        #[arg(long)]
        micro_batches: usize = 1,
        /// Pipeline schedule: `gpipe` (all M forward, then all M backward) or `1f1b` (one
        /// forward, one backward).
        #[arg(long, value_parser = parse::<PipelineSchedule>)]
        pipeline_schedule: PipelineSchedule = PipelineSchedule::Gpipe,
        /// Units per pipeline stage, comma-separated, e.g. `2,1,1` (K numbers that add up
        /// to the model's units). Default: balanced by parameter count.
        #[arg(long, value_delimiter = ',')]
        pipeline_split: Vec<usize>,
        /// How the default split balances the stages: `params` (the split whose largest
        /// stage holds the fewest parameters) or `time` (rank 0 times a forward and
        /// backward of each unit on a warm-up micro-batch of synthetic data and every
        /// rank takes the split whose slowest stage takes the least time). Not with
        /// `--pipeline-split`.
        #[arg(long, value_parser = parse::<PipelineBalance>)]
        pipeline_balance: PipelineBalance = PipelineBalance::Params,
    }
}

options! {
    /// How the run trains: device, threads, optimizer, steps, seed.
    #[cfg_attr(feature = "cli", command(next_help_heading = "Run"))]
    // Files written before a field existed read it as its default.
    #[serde(default)]
    pub struct RunOptions {
        /// Device: `cpu`, or `cuda` (needs a build with `--features cuda`; the GPU is the
        /// local rank).
        #[arg(long, value_parser = parse::<DeviceKind>)]
        device: DeviceKind = DeviceKind::Cpu,
        /// Operand precision of the matrix products: `f32`, or `f16` / `bf16` (mixed
        /// precision: 16-bit operands with f32 accumulation, f32 master weights, optimizer,
        /// pointwise kernels and loss). On the CPU `f32` or `bf16` (AMX-BF16 or AVX-512 BF16
        /// where the CPU has it, chosen at run time); `f16` needs `--device cuda`.
        #[arg(long, alias = "gemm_precision", value_parser = gemm_precision)]
        gemm_precision: GemmPrecision = GemmPrecision::F32,
        /// CPU threads per rank (0 = cores divided by the ranks on this node).
        #[arg(long)]
        threads: usize = 0,
        /// Optimizer: `adam` (default, learning rate 1e-3) or `sgd` (default learning
        /// rate 1).
        #[arg(long, value_parser = parse::<OptimizerKind>)]
        optimizer: OptimizerKind = OptimizerKind::Adam,
        /// Learning rate (default: 1e-3 for Adam, 1.0 for SGD).
        #[arg(long, alias = "learning_rate", allow_hyphen_values = true, value_parser = finite)]
        learning_rate: Option<f32>,
        /// Clip gradients to this global norm (0 = no clipping).
        #[arg(long, alias = "max_gradient_norm", allow_hyphen_values = true, value_parser = finite)]
        max_gradient_norm: f32 = 5.0,
        /// Batches run before timing starts (not counted). After --resume the first
        /// batches of the new process are warm-up again.
        #[arg(long, alias = "warmup_batches")]
        warmup_batches: usize = 10,
        /// Batches timed after the warm-up. After --resume: this many more (step numbers
        /// go on from the checkpoint's).
        #[arg(long, alias = "timed_batches", alias = "num_batches")]
        timed_batches: usize = 20,
        /// Seed for the initial parameters and synthetic data.
        #[arg(long)]
        seed: u64 = 1,
        /// Evaluate on --eval-data every N steps (step numbers go on after --resume), and
        /// once at the end; 0 = only at the end.
        #[arg(long)]
        eval_every: usize = 0,
        /// Stop when the held-out perplexity reaches this value (<=) at an evaluation,
        /// and report the steps, words and time it took (needs --eval-data; a number
        /// above 1).
        #[arg(long, value_parser = finite_f64)]
        target_perplexity: Option<f64>,
        /// Check the flags and the input, print the memory one rank needs at this batch
        /// size (host, and with --device cuda its GPU), the memory it has, and the largest
        /// --batch-size the same checks accept, then exit without training.
        #[arg(long)]
        dry_run: bool,
    }
}

options! {
    /// What the run writes: progress lines, checkpoints, the JSON report, the timeline.
    #[cfg_attr(feature = "cli", command(next_help_heading = "Output"))]
    // Files written before a field existed read it as its default.
    #[serde(default)]
    pub struct OutputOptions {
        /// Print a progress line every N steps (0 = only the final table).
        #[arg(long, alias = "display_every")]
        display_every: usize = 10,
        /// Checkpoint file: written atomically at the end (and every --checkpoint-every
        /// steps). Its directory must exist and be writable (checked before the first
        /// step); an existing file is refused unless --resume or --overwrite-checkpoint.
        #[arg(long)]
        checkpoint: Option<PathBuf>,
        /// Also write the checkpoint every N steps (0 = only at the end).
        #[arg(long)]
        checkpoint_every: usize = 0,
        /// Load --checkpoint before training and continue from it: parameters, optimizer
        /// state, step and every rank's input position. With the same number of workers,
        /// batch size and seed each rank reads on after its last trained batch (the run
        /// ends with the bits of an uninterrupted one); with another number, the shards are
        /// re-cut and a corpus restarts the checkpoint's epoch from its first batch, while
        /// synthetic ranks continue their own streams (new ranks start theirs).
        #[arg(long)]
        resume: bool,
        /// Replace an existing --checkpoint file without resuming from it (without this
        /// flag or --resume, an existing checkpoint is refused before training).
        #[arg(long)]
        overwrite_checkpoint: bool,
        /// Write the run report (config, words/s over all ranks, per-rank figures, time
        /// breakdown, launches per batch) as JSON to this file (rank 0). Its directory
        /// must exist and be writable (checked before the first step); an existing
        /// report is replaced, as each run's report is that run's output.
        #[arg(long, alias = "json_report")]
        json_report: Option<PathBuf>,
        /// Write a Chrome-trace timeline of training to this file (rank 0 merges every
        /// rank's row onto one clock at the end; open it in chrome://tracing or Perfetto).
        /// Its directory must exist and be writable (checked before the first step); an
        /// existing file is refused unless --overwrite-timeline.
        #[arg(long)]
        timeline: Option<PathBuf>,
        /// Keep only steps A to B (both included, numbered as the log numbers them) in
        /// the --timeline, so long runs stay small. Default: every step.
        #[arg(long, value_parser = parse::<StepWindow>)]
        timeline_steps: Option<StepWindow>,
        /// Backward ranges of at least this many bytes of gradient get their own event
        /// in the --timeline (smaller ones are only part of `backward`).
        #[arg(long)]
        timeline_layer_bytes: usize = DEFAULT_TIMELINE_LAYER_BYTES,
        /// Replace an existing --timeline file (without this flag it is refused before
        /// training).
        #[arg(long)]
        overwrite_timeline: bool,
    }
}

/// Everything a training run needs to know, as the user asked for it. Defaults give a
/// small NMT model that trains at a few thousand words/s on one CPU core.
///
/// Serialised flat (the groups' fields side by side), as reports and checkpoints store it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct TrainConfig {
    /// The model.
    #[serde(flatten)]
    #[cfg_attr(feature = "cli", command(flatten))]
    pub model: ModelOptions,
    /// The input.
    #[serde(flatten)]
    #[cfg_attr(feature = "cli", command(flatten))]
    pub data: DataOptions,
    /// The gradient exchange.
    #[serde(flatten)]
    #[cfg_attr(feature = "cli", command(flatten))]
    pub exchange: ExchangeOptions,
    /// Device, optimizer and steps.
    #[serde(flatten)]
    #[cfg_attr(feature = "cli", command(flatten))]
    pub run: RunOptions,
    /// What the run writes.
    #[serde(flatten)]
    #[cfg_attr(feature = "cli", command(flatten))]
    pub output: OutputOptions,
}

impl TrainConfig {
    /// Every flag the ranks of one run must share, as `(flag, value)` pairs in a fixed
    /// order (values as compact JSON). Only `--threads` is left out: it is per node (its
    /// `auto` is the node's cores over its ranks) and a node may have more cores than
    /// another. Output paths count although rank 0 alone writes them: a rank started
    /// with another `--checkpoint` or `--resume` was started by mistake.
    ///
    /// # Errors
    /// [`Error::Json`](crate::error::Error::Json) when a value does not serialise (validation refuses paths that
    /// are not UTF-8, the one way that happens).
    pub fn shared_flags(&self) -> crate::Result<Vec<(String, String)>> {
        let json = serde_json::to_value(self).map_err(|source| crate::Error::Json {
            action: "listing the flags ranks share",
            source,
        })?;
        let serde_json::Value::Object(fields) = json else {
            return Err(crate::Error::Internal(
                "the config did not serialise to a JSON object".into(),
            ));
        };
        Ok(fields
            .into_iter()
            .filter(|(name, _)| name != "threads")
            .map(|(name, value)| (format!("--{}", name.replace('_', "-")), value.to_string()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_round_trips_through_flat_json() {
        let mut cfg = TrainConfig::default();
        cfg.run.seed = 77;
        cfg.data.total_batch_size = Some(9);
        cfg.model.encoder_type = EncoderType::Stepwise;
        cfg.exchange.allreduce_algorithm = Algorithm::Hierarchical;
        let text = serde_json::to_string(&cfg).unwrap_or_default();
        assert!(text.contains("\"encoder_type\":\"stepwise\""), "{text}");
        assert!(text.contains("\"allreduce_algorithm\":\"hier\""), "{text}");
        assert!(
            text.contains("\"seed\":77") && !text.contains("\"run\""),
            "{text}"
        );
        let back: TrainConfig = serde_json::from_str(&text).unwrap_or_default();
        assert_eq!(back, cfg);
    }

    #[test]
    fn shared_flags_are_every_flag_but_threads_by_its_command_line_name() {
        let cfg = TrainConfig::default();
        let flags = cfg.shared_flags().unwrap_or_default();
        let value = |name: &str| {
            flags
                .iter()
                .find(|(flag, _)| flag == name)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(value("--batch-size").as_deref(), Some("32"));
        assert_eq!(value("--checkpoint").as_deref(), Some("null"));
        assert_eq!(value("--resume").as_deref(), Some("false"));
        assert_eq!(value("--threads"), None);
        let mut local = cfg.clone();
        local.run.threads = 7;
        assert_eq!(local.shared_flags().unwrap_or_default(), flags);
    }

    /// Every serialised field is a flag of the same name, so a mismatch message names
    /// flags the user can find in `--help`.
    #[cfg(feature = "cli")]
    #[test]
    fn shared_flag_names_are_command_line_flags() {
        use clap::CommandFactory;

        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            cfg: TrainConfig,
        }
        let cmd = Cli::command();
        let longs: Vec<String> = cmd
            .get_arguments()
            .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
            .collect();
        let flags = TrainConfig::default().shared_flags().unwrap_or_default();
        assert!(flags.len() > 30, "{flags:?}");
        for (flag, _) in flags {
            assert!(longs.contains(&flag), "{flag} is not a flag: {longs:?}");
        }
    }
}
