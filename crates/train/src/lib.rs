//! ringtrain-train: the training loop that joins models, data and collectives.
//!
//! One call to [`train`] runs one rank: rank 0 broadcasts the initial parameters, then
//! every step reads a batch, runs forward and backward, exchanges gradients with the
//! chosen [`VariableUpdate`] strategy (`replicated` all-reduce overlapped with backward,
//! sharded `parameter_server`, or `independent`), clips to the global norm and applies
//! Adam or SGD. The [`ThroughputMeter`] follows the seeds' rule (warm-up batches excluded,
//! words = source + target over all ranks, jitter = 1.4826 × MAD), and the run ends in a
//! [`RunReport`] that rank 0 prints and writes as JSON. [`Checkpoint`]s are written
//! atomically with a magic number, version, config and crc32.
//!
//! ```
//! use std::time::Duration;
//! use ringtrain_train::{BatchSplit, StepBreakdown, ThroughputMeter};
//!
//! // A total batch of 10 over 3 ranks: 4, 3, 3.
//! assert_eq!(BatchSplit::total(10, 3).shares(), &[4, 3, 3]);
//!
//! // One warm-up step (not counted), then two timed steps of 1000 words each.
//! let mut meter = ThroughputMeter::new(1);
//! let b = StepBreakdown::default();
//! meter.record_step(1, Duration::from_secs(5), 1000.0, 3.0, b);
//! meter.record_step(2, Duration::from_millis(500), 1000.0, 2.9, b);
//! meter.record_step(3, Duration::from_millis(500), 1000.0, 2.8, b);
//! let s = meter.summary();
//! assert_eq!(s.timed_batches, 2);
//! assert!((s.words_per_sec - 2000.0).abs() < 1e-9);
//! ```
#![warn(missing_docs)]

pub mod batch_split;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
#[cfg(feature = "cuda")]
pub mod gpu_adapter;
pub mod input;
pub mod model_adapter;
pub mod optimizer;
pub mod report;
pub mod run;
pub mod strategy;
pub mod throughput;
pub mod trainable;
pub mod trainer;

pub use batch_split::BatchSplit;
pub use checkpoint::{Checkpoint, CHECKPOINT_MAGIC, CHECKPOINT_VERSION};
pub use config::{
    DataPaths, DeviceKind, Direction, EncoderType, GemmPrecisionKind, ModelKind, OptimizerKind,
    TrainConfig, VariableUpdate,
};
pub use device::{local_rank_from_env, LocalRank, LocalRankSource};
pub use error::{Error, Result};
pub use input::InputPipeline;
pub use model_adapter::{build_model, ModelAdapter};
pub use optimizer::{LossScaler, Optimizer, OptimizerState};
pub use report::{RankFigures, RunReport};
pub use run::run_rank;
pub use strategy::{greedy_placement, StepOutcome, StepStats, Strategy};
pub use throughput::{RateStats, StepBreakdown, ThroughputMeter, ThroughputSummary};
pub use trainable::{Batch, ParamSpec, PassOutput, TrainableModel};
pub use trainer::{train, TrainOutcome};
