//! Training configuration: every choice a run makes, with the seeds' flag names.
//!
//! Each enum parses from the spelling its command-line flag accepts ([`std::str::FromStr`]),
//! and the parse error names the flag, the value and the accepted values.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

macro_rules! string_enum {
    (
        $(#[$meta:meta])*
        $name:ident, flag = $flag:literal {
            $( $(#[$vmeta:meta])* $variant:ident => $canon:literal $(| $alias:literal)* ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every accepted canonical spelling, for help texts and errors.
            pub const NAMES: &'static [&'static str] = &[$($canon),+];

            /// The canonical spelling of this value.
            pub fn as_str(self) -> &'static str {
                match self { $( $name::$variant => $canon ),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
                    $( $canon $(| $alias)* => Ok($name::$variant), )+
                    _ => Err(Error::invalid(
                        $flag,
                        s,
                        format!("expected one of: {}", Self::NAMES.join(", ")),
                    )),
                }
            }
        }
    };
}

string_enum! {
    /// Which model to train.
    ModelKind, flag = "--model" {
        /// LSTM encoder-decoder without attention (the seeds' NMT benchmark).
        Nmt => "nmt",
        /// LSTM language model (PTB style).
        Rnnlm => "rnnlm",
    }
}

string_enum! {
    /// How an LSTM layer runs over time.
    EncoderType, flag = "--encoder-type" {
        /// One input GEMM for all steps, then the recurrence (cuDNN-style); alias `cudnn_lstm`.
        Fused => "fused" | "cudnn_lstm" | "cudnn",
        /// One cell call per time step (TF `dynamic_rnn` style); alias `dynamic_rnn`.
        Stepwise => "stepwise" | "dynamic_rnn",
    }
}

string_enum! {
    /// Encoder direction.
    Direction, flag = "--direction" {
        /// Unidirectional encoder.
        Uni => "uni",
        /// Bidirectional encoder: half the layers per direction.
        Bi => "bi",
    }
}

string_enum! {
    /// How gradients and parameters are shared between ranks (`--variable-update`).
    VariableUpdate, flag = "--variable-update" {
        /// Every rank keeps a copy; gradients are all-reduced; every rank applies the update.
        Replicated => "replicated" | "horovod",
        /// Parameters are sharded over server ranks that average, update and send back.
        ParameterServer => "parameter_server" | "ps",
        /// No communication at all: the ideal-scaling baseline.
        Independent => "independent",
    }
}

string_enum! {
    /// Which optimizer updates the parameters.
    OptimizerKind, flag = "--optimizer" {
        /// Adam (PyTorch's definition), the default with learning rate 1e-3.
        Adam => "adam",
        /// Plain stochastic gradient descent.
        Sgd => "sgd",
    }
}

string_enum! {
    /// Where the model runs.
    DeviceKind, flag = "--device" {
        /// CPU backend (threads from `--threads`).
        Cpu => "cpu",
        /// CUDA backend (needs the `cuda` build feature); device = local rank.
        Cuda => "cuda" | "gpu",
    }
}

string_enum! {
    /// Operand precision of the GPU matrix products (`--gemm-precision`).
    GemmPrecisionKind, flag = "--gemm-precision" {
        /// f32 operands, f32 GEMM.
        F32 => "f32" | "fp32",
        /// Operands rounded to f16, tensor-core GEMM with f32 accumulation (mixed precision).
        F16 => "f16" | "fp16",
        /// Operands rounded to bf16, tensor-core GEMM with f32 accumulation (mixed precision).
        Bf16 => "bf16",
    }
}

/// Files of a real corpus (`--data`); unused with synthetic data.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPaths {
    /// NMT: source sentences; RNNLM: the training text.
    pub train_src: Option<PathBuf>,
    /// NMT: target sentences (same line count as the source).
    pub train_tgt: Option<PathBuf>,
    /// NMT: source vocabulary (one token per line); RNNLM: optional vocabulary.
    pub vocab_src: Option<PathBuf>,
    /// NMT: target vocabulary.
    pub vocab_tgt: Option<PathBuf>,
}

/// Everything a training run needs to know. Defaults give a small NMT model that trains
/// at a few thousand words/s on one CPU core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Model to train.
    pub model: ModelKind,
    /// LSTM implementation.
    pub encoder_type: EncoderType,
    /// Encoder direction (NMT only).
    pub direction: Direction,
    /// Encoder layers (NMT) or LSTM layers (RNNLM).
    pub num_encoder_layers: usize,
    /// Decoder layers (NMT only).
    pub num_decoder_layers: usize,
    /// Hidden size, also the embedding size.
    pub num_units: usize,
    /// Vocabulary size of each side (synthetic data; real data takes it from the vocab files).
    pub vocab_size: usize,
    /// Examples per rank per step (`--batch-size`), used unless `total_batch_size` is set.
    pub batch_size: usize,
    /// Examples per step over all ranks, split as evenly as possible (`--total-batch-size`).
    pub total_batch_size: Option<usize>,
    /// Sequence length: synthetic sequences have exactly this length; real ones are cut to it.
    pub src_max_len: usize,
    /// Use uniform random token ids instead of a corpus.
    pub use_synthetic_data: bool,
    /// Corpus files.
    pub data: DataPaths,
    /// Batches run before timing starts.
    pub warmup_batches: usize,
    /// Batches timed after the warm-up.
    pub timed_batches: usize,
    /// Print a log line every this many steps (0 = only the summary).
    pub display_every: usize,
    /// Optimizer.
    pub optimizer: OptimizerKind,
    /// Learning rate (None = the optimizer's default: Adam 1e-3, SGD 1.0).
    pub learning_rate: Option<f32>,
    /// Global-norm clip (0 = no clipping).
    pub max_gradient_norm: f32,
    /// Exchange gradients as f16 with dynamic loss scaling.
    pub fp16_gradients: bool,
    /// How ranks share gradients and parameters.
    pub variable_update: VariableUpdate,
    /// Split the flat gradient into this many packs before reducing (0 = off).
    pub gradient_repacking: usize,
    /// Gradients of at most this many bytes standing next to each other are reduced together (0 = off).
    pub agg_small_grads_max_bytes: usize,
    /// Most gradients in one small-gradient group.
    pub agg_small_grads_max_group: usize,
    /// Fusion buffer threshold in bytes for overlapped reduction.
    pub fusion_threshold_bytes: usize,
    /// Fusion cycle time in milliseconds.
    pub cycle_time_ms: f64,
    /// Start reducing gradient ranges while backward still runs (replicated only). Off by
    /// default: on CPU ranks the reduction thread competes with backward for the cores.
    pub overlap_backward: bool,
    /// Parameter-server ranks (0 = every rank owns a shard).
    pub ps_ranks: usize,
    /// Device kind.
    pub device: DeviceKind,
    /// Operand precision of the GPU matrix products (f32 master weights either way).
    pub gemm_precision: GemmPrecisionKind,
    /// CPU threads per rank (0 = cores / local ranks).
    pub threads: usize,
    /// Seed for parameters and synthetic data.
    pub seed: u64,
    /// Checkpoint file written at the end (and every `checkpoint_every` steps).
    pub checkpoint: Option<PathBuf>,
    /// Write the checkpoint every this many steps (0 = only at the end).
    pub checkpoint_every: usize,
    /// Load `checkpoint` before training.
    pub resume: bool,
    /// Write a JSON report here (rank 0).
    pub json_report: Option<PathBuf>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: ModelKind::Nmt,
            encoder_type: EncoderType::Fused,
            direction: Direction::Uni,
            num_encoder_layers: 2,
            num_decoder_layers: 2,
            num_units: 64,
            vocab_size: 2000,
            batch_size: 32,
            total_batch_size: None,
            src_max_len: 20,
            use_synthetic_data: true,
            data: DataPaths::default(),
            warmup_batches: 10,
            timed_batches: 20,
            display_every: 10,
            optimizer: OptimizerKind::Adam,
            learning_rate: None,
            max_gradient_norm: 5.0,
            fp16_gradients: false,
            variable_update: VariableUpdate::Replicated,
            gradient_repacking: 0,
            agg_small_grads_max_bytes: 0,
            agg_small_grads_max_group: 10,
            fusion_threshold_bytes: 64 << 20,
            cycle_time_ms: 1.0,
            overlap_backward: false,
            ps_ranks: 0,
            device: DeviceKind::Cpu,
            gemm_precision: GemmPrecisionKind::F32,
            threads: 0,
            seed: 1,
            checkpoint: None,
            checkpoint_every: 0,
            resume: false,
            json_report: None,
        }
    }
}

impl TrainConfig {
    /// The learning rate in effect (the optimizer's default when none was given).
    pub fn effective_learning_rate(&self) -> f32 {
        self.learning_rate.unwrap_or(match self.optimizer {
            OptimizerKind::Adam => 1e-3,
            OptimizerKind::Sgd => 1.0,
        })
    }

    /// Total steps run: warm-up plus timed.
    pub fn total_steps(&self) -> usize {
        self.warmup_batches + self.timed_batches
    }

    /// Checks values that do not depend on the rank count. Errors name the flag and value.
    pub fn validate(&self) -> Result<()> {
        let positive = |flag: &'static str, v: usize| {
            if v == 0 {
                Err(Error::invalid(flag, v, "must be at least 1"))
            } else {
                Ok(())
            }
        };
        positive("--num-units", self.num_units)?;
        if self.device == DeviceKind::Cpu && self.gemm_precision != GemmPrecisionKind::F32 {
            return Err(Error::invalid(
                "--gemm-precision",
                self.gemm_precision,
                "16-bit matrix products are a GPU option: use it with --device cuda (the CPU backend multiplies in f32)",
            ));
        }
        positive("--num-encoder-layers", self.num_encoder_layers)?;
        if self.model == ModelKind::Nmt {
            positive("--num-decoder-layers", self.num_decoder_layers)?;
            if self.direction == Direction::Bi && self.num_encoder_layers % 2 != 0 {
                return Err(Error::invalid(
                    "--num-encoder-layers",
                    self.num_encoder_layers,
                    "a bidirectional encoder needs an even layer count (half per direction)",
                ));
            }
        }
        if self.vocab_size < 4 {
            return Err(Error::invalid(
                "--vocab-size",
                self.vocab_size,
                "must be at least 4 (special tokens plus words)",
            ));
        }
        positive("--batch-size", self.batch_size)?;
        if let Some(t) = self.total_batch_size {
            positive("--total-batch-size", t)?;
        }
        positive("--src-max-len", self.src_max_len)?;
        positive("--timed-batches", self.timed_batches)?;
        if let Some(lr) = self.learning_rate {
            if !(lr.is_finite() && lr > 0.0) {
                return Err(Error::invalid(
                    "--learning-rate",
                    lr,
                    "must be a positive finite number",
                ));
            }
        }
        if !(self.max_gradient_norm.is_finite() && self.max_gradient_norm >= 0.0) {
            return Err(Error::invalid(
                "--max-gradient-norm",
                self.max_gradient_norm,
                "must be 0 (off) or a positive finite number",
            ));
        }
        if self.agg_small_grads_max_bytes > 0 && self.agg_small_grads_max_group == 0 {
            return Err(Error::invalid(
                "--agg-small-grads-max-group",
                0,
                "must be at least 1 when --agg-small-grads-max-bytes is set",
            ));
        }
        if !(self.cycle_time_ms.is_finite() && self.cycle_time_ms >= 0.0) {
            return Err(Error::invalid(
                "--cycle-time-ms",
                self.cycle_time_ms,
                "must be >= 0",
            ));
        }
        if self.resume && self.checkpoint.is_none() {
            return Err(Error::invalid(
                "--resume",
                "true",
                "needs --checkpoint FILE naming the checkpoint to load",
            ));
        }
        if !self.use_synthetic_data && self.data.train_src.is_none() {
            return Err(Error::invalid(
                "--data",
                "(none)",
                "give corpus files with --data, or pass --use-synthetic-data",
            ));
        }
        Ok(())
    }

    /// Checks values against the world size.
    pub fn validate_for_world(&self, world: usize) -> Result<()> {
        if self.variable_update == VariableUpdate::ParameterServer
            && self.ps_ranks >= world
            && self.ps_ranks > 0
        {
            return Err(Error::invalid(
                "--ps-ranks",
                self.ps_ranks,
                format!(
                    "needs fewer server ranks than the {world} ranks launched (at least one worker); \
                     use --ps-ranks 0 to give every rank a shard"
                ),
            ));
        }
        if let Some(total) = self.total_batch_size {
            let workers = self.worker_count(world);
            if total < workers {
                return Err(Error::invalid(
                    "--total-batch-size",
                    total,
                    format!("must be at least the number of worker ranks ({workers})"),
                ));
            }
        }
        Ok(())
    }

    /// crc32 of the flags every rank must share (paths written only by rank 0 and the
    /// per-node thread count are left out), to catch ranks started with different flags.
    pub fn fingerprint(&self) -> u32 {
        let shared = TrainConfig {
            json_report: None,
            checkpoint: None,
            threads: 0,
            ..self.clone()
        };
        crc32fast::hash(
            serde_json::to_string(&shared)
                .unwrap_or_default()
                .as_bytes(),
        )
    }

    /// The strategy as the logs and reports name it, e.g. `replicated (overlapped with backward)`.
    pub fn strategy_label(&self) -> String {
        match self.variable_update {
            VariableUpdate::Replicated
                if self.gradient_repacking > 0 || self.agg_small_grads_max_bytes > 0 =>
            {
                "replicated (packed, after backward)".to_string()
            }
            VariableUpdate::Replicated if self.overlap_backward => {
                "replicated (overlapped with backward)".to_string()
            }
            VariableUpdate::Replicated => "replicated (after backward)".to_string(),
            VariableUpdate::ParameterServer if self.ps_ranks == 0 => {
                "parameter_server (a shard on every rank)".to_string()
            }
            VariableUpdate::ParameterServer => format!(
                "parameter_server ({} dedicated server ranks)",
                self.ps_ranks
            ),
            VariableUpdate::Independent => "independent".to_string(),
        }
    }

    /// Ranks that compute gradients (all but dedicated parameter servers).
    pub fn worker_count(&self, world: usize) -> usize {
        if self.variable_update == VariableUpdate::ParameterServer && self.ps_ranks > 0 {
            world.saturating_sub(self.ps_ranks)
        } else {
            world
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_parse_aliases_and_reject_unknown_with_flag_name() {
        assert_eq!(
            "cudnn_lstm".parse::<EncoderType>().unwrap(),
            EncoderType::Fused
        );
        assert_eq!(
            "dynamic_rnn".parse::<EncoderType>().unwrap(),
            EncoderType::Stepwise
        );
        assert_eq!(
            "parameter-server".parse::<VariableUpdate>().unwrap(),
            VariableUpdate::ParameterServer
        );
        let err = "lstm9".parse::<ModelKind>().unwrap_err().to_string();
        assert!(
            err.contains("--model") && err.contains("lstm9") && err.contains("rnnlm"),
            "{err}"
        );
    }

    #[test]
    fn validate_names_the_flag_and_value() {
        let cfg = TrainConfig {
            batch_size: 0,
            ..TrainConfig::default()
        };
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("--batch-size") && err.contains('0'), "{err}");
        let cfg = TrainConfig {
            direction: Direction::Bi,
            num_encoder_layers: 3,
            ..TrainConfig::default()
        };
        assert!(cfg
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--num-encoder-layers"));
        let cfg = TrainConfig {
            variable_update: VariableUpdate::ParameterServer,
            ps_ranks: 2,
            ..TrainConfig::default()
        };
        assert!(cfg
            .validate_for_world(2)
            .unwrap_err()
            .to_string()
            .contains("--ps-ranks"));
        assert!(cfg.validate_for_world(3).is_ok());
        assert_eq!(cfg.worker_count(3), 1);
    }

    #[test]
    fn config_round_trips_through_json() {
        let cfg = TrainConfig {
            seed: 77,
            total_batch_size: Some(9),
            ..TrainConfig::default()
        };
        let text = serde_json::to_string(&cfg).unwrap();
        let back: TrainConfig = serde_json::from_str(&text).unwrap();
        assert_eq!(back, cfg);
    }
}
