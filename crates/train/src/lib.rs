//! ringtrain-train: the training loop that joins models, data and collectives.
//!
//! A run starts from a [`TrainConfig`] (five groups of options; with feature `cli` they
//! are also `ringtrain train`'s flags), validated once into a [`ValidatedConfig`] for the
//! number of ranks. [`run_rank`] then builds one rank: the input pipeline
//! ([`InputPipeline`]), the model on its device ([`build_model`], a [`TrainableModel`]),
//! and calls [`train`]: rank 0 broadcasts the initial parameters, then every step reads a
//! batch, runs forward and backward, exchanges gradients with the chosen
//! [`VariableUpdate`] strategy (`replicated` all-reduce overlapped with backward, sharded
//! `parameter_server`, or `independent`), clips to the global norm and applies Adam or
//! SGD. Agreements between ranks and the final summaries travel on a control plane of
//! their own ([`control::Control`], a duplicate communicator), never beside the gradients.
//! The [`ThroughputMeter`] follows the seeds' rule (warm-up batches excluded, words =
//! source + target over all ranks, jitter = 1.4826 × MAD), and the run ends in a
//! [`RunReport`] that rank 0 prints and writes as JSON. [`Checkpoint`]s are written
//! atomically with a magic number, version, config and crc32, and hold every rank's
//! [`InputPosition`], so that a resumed run reads on where the checkpointed one stopped.
//!
//! ```
//! use std::time::Duration;
//! use ringtrain_train::{StepBreakdown, ThroughputMeter, TrainConfig};
//!
//! // A total batch of 10 over 3 ranks: 4, 3, 3.
//! let mut cfg = TrainConfig::default();
//! cfg.data.total_batch_size = Some(10);
//! let run = cfg.validate(3)?;
//! assert_eq!((0..3).map(|r| run.local_batch_size(r)).collect::<Vec<_>>(), [4, 3, 3]);
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
//! # Ok::<(), ringtrain_train::Error>(())
//! ```
#![warn(missing_docs)]

pub mod checkpoint;
pub mod config;
pub mod control;
pub mod device;
pub mod error;
pub mod evaluation;
pub mod input;
pub mod interrupt;
pub mod optimizer;
pub mod outputs;
pub mod pipeline;
pub mod report;
pub mod run;
pub mod strategy;
pub mod throughput;
pub mod timeline;
pub mod trainable;
pub mod trainer;

pub use checkpoint::{Checkpoint, CHECKPOINT_MAGIC, CHECKPOINT_VERSION};
pub use config::{
    DataOptions, DataSource, DeviceKind, EncoderType, ExchangeOptions, HeldOutSource, ModelKind,
    ModelOptions, OptimizerKind, OutputOptions, OverlapMode, RunOptions, TrainConfig,
    ValidatedConfig, VariableUpdate,
};
pub use device::{local_rank, local_rank_from_env, LocalRank, LocalRankSource, Room};
pub use error::{Error, Result};
pub use evaluation::{EvalRecord, HeldOut, TimeToQuality};
pub use input::{
    BatchSource, InputBatches, InputKind, InputPipeline, InputPosition, StreamPosition,
};
pub use optimizer::{LossScaler, Optimizer, OptimizerState};
pub use report::{
    GradientReady, HostDeviceBytes, HostFigures, PipelineReport, RankFigures, RunReport,
    StageFigures,
};
pub use ringtrain_model::{BiLayerInput, EncoderKind, GemmPrecision, LstmImpl, SourceLengths};
pub use run::{plan_rank, run_rank};
pub use strategy::{
    greedy_placement, DeviceStepInputs, StepContext, StepOutcome, StepStats, Strategy, Wire,
};
pub use throughput::{RateStats, StepBreakdown, ThroughputMeter, ThroughputSummary};
pub use timeline::StepWindow;
pub use trainable::{
    build_model, build_pipeline_stage, Batch, DeviceSpan, MemoryPlan, ParamSpec, PassOutput,
    TrainableModel,
};
pub use trainer::{train, train_evaluating, TrainOutcome};
