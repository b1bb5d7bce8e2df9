//! [`ValidatedConfig`]: a [`TrainConfig`] whose every value was checked, once, for a
//! given number of ranks, with its `auto` values resolved.

use std::path::PathBuf;
use std::time::Duration;

use ringtrain_data::BatchSizing;
use ringtrain_model::{BiLayerInput, EncoderKind, GemmPrecision, LstmImpl, SourceLengths};

use super::{DeviceKind, ModelKind, ModelOptions, OptimizerKind, OverlapMode, TrainConfig};
use super::{
    EncoderType, PipelineBalance, VariableUpdate, DEFAULT_ADAM_LEARNING_RATE,
    DEFAULT_SGD_LEARNING_RATE,
};
use crate::error::{Error, Result};

/// Where a run's batches come from, as `--use-synthetic-data` / `--data` resolve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// Uniform random token ids of `--vocab-size`.
    Synthetic,
    /// A parallel corpus with its two vocabularies.
    Translation {
        /// Source sentences.
        source: PathBuf,
        /// Target sentences (one per source line).
        target: PathBuf,
        /// Source vocabulary.
        source_vocab: PathBuf,
        /// Target vocabulary.
        target_vocab: PathBuf,
    },
    /// A language-model text, with its vocabulary or one built from the text.
    Text {
        /// The training text.
        text: PathBuf,
        /// The vocabulary (`None`: built from the text).
        vocab: Option<PathBuf>,
    },
}

/// The held-out set `--eval-data` names (read with the training vocabularies).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeldOutSource {
    /// Held-out sentence pairs of a translation corpus.
    Translation {
        /// Source sentences.
        source: PathBuf,
        /// Target sentences (one per source line).
        target: PathBuf,
    },
    /// A held-out language-model text.
    Text {
        /// The text.
        text: PathBuf,
    },
}

/// A [`TrainConfig`] checked for a world of [`ValidatedConfig::world`] ranks, with its
/// `auto` values resolved: the trainer accepts nothing else, so no part of it checks a
/// flag again. Made by [`TrainConfig::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedConfig {
    config: TrainConfig,
    world: usize,
    workers: usize,
    batch: BatchSizing,
    learning_rate: f32,
    overlap_backward: bool,
    cycle_time: Duration,
    total_steps: usize,
    stall_timeout: Option<Duration>,
    data: DataSource,
    held_out: Option<HeldOutSource>,
    stages: usize,
}

/// How the replicated strategy reduces the gradients, as the flags decide it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Packed or aggregated the tf_cnn_benchmarks way, after backward
    /// (`--gradient-repacking`, `--agg-small-grads-max-bytes`).
    Packed,
    /// The flat gradient buffer as one tensor, after backward.
    AfterBackward,
    /// Each range as backward finishes it, through the fusion engine.
    Overlapped,
}

/// The model semantics `--encoder-type`, `--source-lengths` and `--bi-layer-input` select:
/// a seed's name selects its model, and an explicit flag that says otherwise is an error
/// naming both; after `fused` or `stepwise` each flag takes its value or the model crate's
/// default.
fn model_semantics(model: &ModelOptions) -> Result<(SourceLengths, BiLayerInput)> {
    let Some((seed_lengths, seed_input)) = model.encoder_type.seed_semantics() else {
        return Ok((
            model.source_lengths.unwrap_or_default(),
            model.bi_layer_input.unwrap_or_default(),
        ));
    };
    let contradiction = |flag: &'static str, given: String, seed: String| {
        Error::invalid(
            flag,
            given,
            format!(
                "--encoder-type {} is the seeds' model, which has {flag} {seed}; leave {flag} \
                 out, or use --encoder-type {} to combine the implementation with other \
                 semantics",
                model.encoder_type,
                EncoderType::from(model.encoder_type.lstm_impl())
            ),
        )
    };
    match model.source_lengths {
        Some(given) if given != seed_lengths => {
            return Err(contradiction(
                "--source-lengths",
                given.to_string(),
                seed_lengths.to_string(),
            ))
        }
        _ => {}
    }
    match model.bi_layer_input {
        Some(given) if given != seed_input => {
            return Err(contradiction(
                "--bi-layer-input",
                given.to_string(),
                seed_input.to_string(),
            ))
        }
        _ => {}
    }
    Ok((seed_lengths, seed_input))
}

/// `Err(InvalidValue)` naming `flag` unless `value >= 1`.
fn at_least_one(flag: &'static str, value: usize) -> Result<()> {
    if value == 0 {
        return Err(Error::invalid(flag, value, "must be at least 1"));
    }
    Ok(())
}

impl TrainConfig {
    /// Checks every value, for a run over `world` ranks, and resolves the `auto` ones:
    /// the learning rate (the optimizer's default), `--overlap-backward auto` (on for
    /// cuda), synthetic data (when no `--data` is given), and the corpus files.
    ///
    /// # Errors
    /// `InvalidValue` naming the first flag that is wrong, with its value and what to do.
    pub fn validate(&self, world: usize) -> Result<ValidatedConfig> {
        let TrainConfig {
            model,
            data,
            exchange,
            run,
            output,
        } = self;
        at_least_one("number of ranks", world)?;

        at_least_one("--num-units", model.num_units)?;
        let (source_lengths, bi_layer_input) = model_semantics(model)?;
        at_least_one("--num-encoder-layers", model.num_encoder_layers)?;
        at_least_one("--num-decoder-layers", model.num_decoder_layers)?;
        if model.model == ModelKind::Nmt {
            if model.direction == EncoderKind::Bi && model.num_encoder_layers % 2 != 0 {
                return Err(Error::invalid(
                    "--num-encoder-layers",
                    model.num_encoder_layers,
                    "a bidirectional encoder needs an even layer count (half per direction)",
                ));
            }
            if model.num_encoder_layers != model.num_decoder_layers {
                return Err(Error::invalid(
                    "--num-decoder-layers",
                    model.num_decoder_layers,
                    format!(
                        "the encoder's final states initialise the decoder, so it needs as many \
                         layers as --num-encoder-layers ({})",
                        model.num_encoder_layers
                    ),
                ));
            }
        }

        if data.vocab_size < 4 {
            return Err(Error::invalid(
                "--vocab-size",
                data.vocab_size,
                "must be at least 4 (special tokens plus words)",
            ));
        }
        at_least_one("--batch-size", data.batch_size)?;
        at_least_one("--src-max-len", data.src_max_len)?;
        let source = data_source(self)?;
        let held_out = held_out_source(self, &source)?;
        if !(0.0..=100.0).contains(&data.max_unk_percent) {
            return Err(Error::invalid(
                "--max-unk-percent",
                data.max_unk_percent,
                "must be a percentage from 0 to 100 (100 turns the check off)",
            ));
        }

        at_least_one(
            "--agg-small-grads-max-group",
            exchange.agg_small_grads_max_group,
        )?;
        at_least_one("--fusion-threshold-bytes", exchange.fusion_threshold_bytes)?;
        let cycle_time =
            Duration::try_from_secs_f64(exchange.cycle_time_ms / 1e3).map_err(|_| {
                Error::invalid(
                    "--cycle-time-ms",
                    exchange.cycle_time_ms,
                    "must be a finite number of milliseconds >= 0, such as 1",
                )
            })?;
        let stall_timeout = match Duration::try_from_secs_f64(exchange.stall_timeout) {
            Ok(d) if d.is_zero() => None,
            // Below a millisecond every wait would look like a stall.
            Ok(d) if d >= Duration::from_millis(1) && d <= Duration::from_secs(1 << 32) => Some(d),
            _ => {
                return Err(Error::invalid(
                    "--stall-timeout",
                    exchange.stall_timeout,
                    "must be 0 or `off` (no check), or seconds from 0.001 to 2^32, such as 60",
                ))
            }
        };
        let parameter_server = exchange.variable_update == VariableUpdate::ParameterServer;
        if parameter_server && exchange.ps_ranks > 0 && exchange.ps_ranks >= world {
            return Err(Error::invalid(
                "--ps-ranks",
                exchange.ps_ranks,
                format!(
                    "needs fewer server ranks than the {world} ranks launched (at least one \
                     worker); use --ps-ranks 0 to give every rank a shard"
                ),
            ));
        }
        let stages = pipeline_stages(self, world)?;
        let workers = if parameter_server && exchange.ps_ranks > 0 {
            world - exchange.ps_ranks
        } else {
            world / stages
        };
        let batch = match data.total_batch_size {
            Some(total) => {
                at_least_one("--total-batch-size", total)?;
                if total < workers {
                    return Err(Error::invalid(
                        "--total-batch-size",
                        total,
                        format!("must be at least the number of worker ranks ({workers})"),
                    ));
                }
                BatchSizing::Total(total)
            }
            None => BatchSizing::PerRank(data.batch_size),
        };
        if stages > 1 {
            let smallest = (0..workers)
                .filter_map(|w| batch.local_batch_size(w, workers).ok())
                .min()
                .unwrap_or(0);
            if exchange.micro_batches > smallest {
                return Err(Error::invalid(
                    "--micro-batches",
                    exchange.micro_batches,
                    format!(
                        "a micro-batch needs at least one example, and a pipeline replica's \
                         batch has {smallest} (--batch-size / --total-batch-size): use at most \
                         {smallest} micro-batches or a bigger batch"
                    ),
                ));
            }
        }

        if run.device == DeviceKind::Cuda && !cfg!(feature = "cuda") {
            return Err(Error::invalid(
                "--device",
                run.device,
                "this build has no GPU support: rebuild with `--features cuda` (needs libcuda at \
                 link time; see scripts/build-gpu-bundle), or use --device cpu",
            ));
        }
        if run.device == DeviceKind::Cpu && run.gemm_precision == GemmPrecision::F16 {
            return Err(Error::invalid(
                "--gemm-precision",
                run.gemm_precision,
                "the CPU backend multiplies in f32 or bf16: use bf16 on the CPU (f16 needs \
                 --device cuda)",
            ));
        }
        let learning_rate = match run.learning_rate {
            Some(lr) if !(lr.is_finite() && lr > 0.0) => {
                return Err(Error::invalid(
                    "--learning-rate",
                    lr,
                    "must be a positive finite number",
                ))
            }
            Some(lr) => lr,
            None => match run.optimizer {
                OptimizerKind::Adam => DEFAULT_ADAM_LEARNING_RATE,
                OptimizerKind::Sgd => DEFAULT_SGD_LEARNING_RATE,
            },
        };
        if !(run.max_gradient_norm.is_finite() && run.max_gradient_norm >= 0.0) {
            return Err(Error::invalid(
                "--max-gradient-norm",
                run.max_gradient_norm,
                "must be 0 (off) or a positive finite number",
            ));
        }
        at_least_one("--timed-batches", run.timed_batches)?;
        let total_steps = run
            .warmup_batches
            .checked_add(run.timed_batches)
            .ok_or_else(|| {
                Error::invalid(
                    "--timed-batches",
                    run.timed_batches,
                    format!(
                        "with --warmup-batches {} the step count overflows: the accepted range \
                         is 1 to {}",
                        run.warmup_batches,
                        usize::MAX - run.warmup_batches
                    ),
                )
            })?;
        let max_threads = crate::device::max_cpu_threads();
        if run.threads > max_threads {
            return Err(Error::invalid(
                "--threads",
                run.threads,
                format!(
                    "the accepted range is 0 (auto: the cores over the ranks of the node) to \
                     {max_threads} ({} per core of this machine)",
                    crate::device::MAX_THREADS_PER_CORE
                ),
            ));
        }

        for (flag, path) in [
            ("--checkpoint", &output.checkpoint),
            ("--json-report", &output.json_report),
            ("--timeline", &output.timeline),
        ] {
            if let Some(path) = path {
                utf8_path(flag, path)?;
            }
        }
        if output.resume && output.checkpoint.is_none() {
            return Err(Error::invalid(
                "--resume",
                "true",
                "needs --checkpoint FILE naming the checkpoint to load",
            ));
        }
        if let Some(window) = &output.timeline_steps {
            window.check()?;
            if output.timeline.is_none() {
                return Err(Error::invalid(
                    "--timeline-steps",
                    window,
                    "needs --timeline FILE naming the timeline to write",
                ));
            }
        }
        if output.overwrite_timeline && output.timeline.is_none() {
            return Err(Error::invalid(
                "--overwrite-timeline",
                "true",
                "needs --timeline FILE naming the timeline to replace",
            ));
        }
        if output.overwrite_checkpoint && output.checkpoint.is_none() {
            return Err(Error::invalid(
                "--overwrite-checkpoint",
                "true",
                "needs --checkpoint FILE naming the checkpoint to replace",
            ));
        }

        let overlap_backward = match exchange.overlap_backward {
            OverlapMode::On => true,
            OverlapMode::Off => false,
            OverlapMode::Auto => run.device == DeviceKind::Cuda,
        };
        let mut config = self.clone();
        config.model.source_lengths = Some(source_lengths);
        config.model.bi_layer_input = Some(bi_layer_input);
        Ok(ValidatedConfig {
            config,
            world,
            workers,
            batch,
            learning_rate,
            overlap_backward,
            cycle_time,
            total_steps,
            stall_timeout,
            data: source,
            held_out,
            stages,
        })
    }
}

/// The pipeline units of the model `cfg` asks for: RNNLM embedding, LSTM layers,
/// projection; NMT encoder, decoder layers, projection.
pub(crate) fn pipeline_units(cfg: &TrainConfig) -> usize {
    match cfg.model.model {
        ModelKind::Nmt => cfg.model.num_decoder_layers + 2,
        ModelKind::Rnnlm => cfg.model.num_encoder_layers + 2,
    }
}

/// Checks the pipeline flags for `world` ranks and returns the stage count K.
fn pipeline_stages(cfg: &TrainConfig, world: usize) -> Result<usize> {
    let exchange = &cfg.exchange;
    let stages = exchange.pipeline_stages;
    at_least_one("--pipeline-stages", stages)?;
    at_least_one("--micro-batches", exchange.micro_batches)?;
    if stages == 1 {
        if exchange.micro_batches > 1 {
            return Err(Error::invalid(
                "--micro-batches",
                exchange.micro_batches,
                "micro-batches are a pipeline's: give --pipeline-stages 2 or more, or leave \
                 --micro-batches out",
            ));
        }
        if exchange.pipeline_balance != PipelineBalance::Params {
            return Err(Error::invalid(
                "--pipeline-balance",
                exchange.pipeline_balance,
                "a balance is a pipeline's: give --pipeline-stages 2 or more, or leave \
                 --pipeline-balance out",
            ));
        }
        if !exchange.pipeline_split.is_empty() {
            return Err(Error::invalid(
                "--pipeline-split",
                join(&exchange.pipeline_split),
                "a split is a pipeline's: give --pipeline-stages 2 or more, or leave \
                 --pipeline-split out",
            ));
        }
        return Ok(1);
    }
    let units = pipeline_units(cfg);
    let layers_flag = match cfg.model.model {
        ModelKind::Nmt => "--num-decoder-layers",
        ModelKind::Rnnlm => "--num-encoder-layers",
    };
    if stages > units {
        return Err(Error::invalid(
            "--pipeline-stages",
            stages,
            format!(
                "the {} model can be cut into at most {units} stages ({units} units with \
                 {layers_flag} {}): use fewer stages or more layers",
                cfg.model.model,
                units - 2
            ),
        ));
    }
    if !world.is_multiple_of(stages) {
        return Err(Error::invalid(
            "--pipeline-stages",
            stages,
            format!(
                "the {world} ranks launched must be a multiple of the stages (K stages x D \
                 data-parallel replicas): launch a multiple of {stages} ranks or change \
                 --pipeline-stages"
            ),
        ));
    }
    if exchange.variable_update == VariableUpdate::ParameterServer {
        return Err(Error::invalid(
            "--variable-update",
            exchange.variable_update,
            "a pipeline's stages each own and update their parameters: use replicated (or \
             independent) with --pipeline-stages",
        ));
    }
    if !exchange.pipeline_split.is_empty() && exchange.pipeline_balance != PipelineBalance::Params {
        return Err(Error::invalid(
            "--pipeline-balance",
            exchange.pipeline_balance,
            "--pipeline-split sets the stages by hand, leaving nothing to balance: give one \
             of --pipeline-split and --pipeline-balance",
        ));
    }
    if !exchange.pipeline_split.is_empty() {
        let split = &exchange.pipeline_split;
        let sum: usize = split.iter().sum();
        if split.len() != stages || split.contains(&0) || sum != units {
            return Err(Error::invalid(
                "--pipeline-split",
                join(split),
                format!(
                    "give {stages} numbers of at least 1 (one per --pipeline-stages) that add \
                     up to the model's {units} units"
                ),
            ));
        }
    }
    if !cfg.data.eval_data.is_empty() {
        return Err(Error::invalid(
            "--eval-data",
            "given",
            "held-out evaluation does not run through a pipeline yet: leave --eval-data out \
             with --pipeline-stages",
        ));
    }
    if exchange.fp16_gradients && world == stages {
        return Err(Error::invalid(
            "--fp16-gradients",
            "true",
            "a single pipeline exchanges no gradients between replicas: leave it out with \
             --pipeline-stages",
        ));
    }
    Ok(stages)
}

/// `values` comma-separated, as the flag takes them.
fn join(values: &[usize]) -> String {
    values
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// `Err(InvalidValue)` naming `flag` when `path` is not UTF-8: reports and checkpoints
/// record the flags as JSON, and ranks compare them as text.
fn utf8_path(flag: &'static str, path: &std::path::Path) -> Result<()> {
    if path.to_str().is_none() {
        return Err(Error::invalid(
            flag,
            path.display(),
            "the path is not valid UTF-8: rename the file or pick another path",
        ));
    }
    Ok(())
}

/// The held-out set `--eval-data` names, checked with `--eval-every` and
/// `--target-perplexity`, which need it.
fn held_out_source(cfg: &TrainConfig, training: &DataSource) -> Result<Option<HeldOutSource>> {
    let files = &cfg.data.eval_data;
    let run = &cfg.run;
    if let Some(target) = run.target_perplexity {
        if !(target.is_finite() && target > 1.0) {
            return Err(Error::invalid(
                "--target-perplexity",
                target,
                "must be a finite number above 1 (a perplexity is at least 1, reached only \
                 by a model that is always certain and right), such as 150",
            ));
        }
    }
    if files.is_empty() {
        if run.eval_every > 0 {
            return Err(Error::invalid(
                "--eval-every",
                run.eval_every,
                "needs --eval-data naming the held-out files to evaluate on",
            ));
        }
        if let Some(target) = run.target_perplexity {
            return Err(Error::invalid(
                "--target-perplexity",
                target,
                "is measured on a held-out set: give --eval-data (e.g. the corpus's dev or \
                 valid files)",
            ));
        }
        return Ok(None);
    }
    for path in files {
        utf8_path("--eval-data", path)?;
    }
    let shown = || {
        files
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    match (training, files.as_slice()) {
        (DataSource::Synthetic, _) => Err(Error::invalid(
            "--eval-data",
            shown(),
            "held-out files are read with the training corpus's vocabulary: give --data too \
             (synthetic data has no vocabulary)",
        )),
        (DataSource::Translation { .. }, [source, target]) => {
            Ok(Some(HeldOutSource::Translation {
                source: source.clone(),
                target: target.clone(),
            }))
        }
        (DataSource::Text { .. }, [text]) => Ok(Some(HeldOutSource::Text { text: text.clone() })),
        (DataSource::Translation { .. }, _) => Err(Error::invalid(
            "--eval-data",
            shown(),
            "NMT needs two held-out files: --eval-data SRC,TGT (read with --data's \
             vocabularies), e.g. data/nmt/dev.en,data/nmt/dev.xx",
        )),
        (DataSource::Text { .. }, _) => Err(Error::invalid(
            "--eval-data",
            shown(),
            "the RNNLM needs one held-out text: --eval-data TEXT, e.g. data/lm/valid.txt",
        )),
    }
}

/// The input `--use-synthetic-data` and `--data` ask for.
fn data_source(cfg: &TrainConfig) -> Result<DataSource> {
    let files = &cfg.data.data;
    let shown = || {
        if files.is_empty() {
            "(none)".to_string()
        } else {
            files
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(",")
        }
    };
    for path in files {
        utf8_path("--data", path)?;
    }
    match (cfg.data.use_synthetic_data, files.is_empty()) {
        (Some(true), false) => {
            return Err(Error::invalid(
                "--data",
                shown(),
                "--use-synthetic-data trains on random ids and would ignore these files: \
                 give one or the other",
            ))
        }
        (Some(true), true) | (None, true) => return Ok(DataSource::Synthetic),
        _ => {}
    }
    match (cfg.model.model, files.as_slice()) {
        (ModelKind::Nmt, [source, target, source_vocab, target_vocab]) => {
            Ok(DataSource::Translation {
                source: source.clone(),
                target: target.clone(),
                source_vocab: source_vocab.clone(),
                target_vocab: target_vocab.clone(),
            })
        }
        (ModelKind::Rnnlm, [text]) => Ok(DataSource::Text {
            text: text.clone(),
            vocab: None,
        }),
        (ModelKind::Rnnlm, [text, vocab]) => Ok(DataSource::Text {
            text: text.clone(),
            vocab: Some(vocab.clone()),
        }),
        (ModelKind::Nmt, _) => Err(Error::invalid(
            "--data",
            shown(),
            "NMT needs four files: --data SRC,TGT,SRC_VOCAB,TGT_VOCAB (or --use-synthetic-data)",
        )),
        (ModelKind::Rnnlm, _) => Err(Error::invalid(
            "--data",
            shown(),
            "the RNNLM needs --data TEXT or --data TEXT,VOCAB (or --use-synthetic-data)",
        )),
    }
}

impl ValidatedConfig {
    /// The configuration as the user gave it (`auto` values unresolved), with the model
    /// semantics `source_lengths` and `bi_layer_input` filled in with what they resolve to
    /// (see [`ValidatedConfig::source_lengths`]): what reports and checkpoints record.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// The LSTM implementation `--encoder-type` runs.
    pub fn lstm_impl(&self) -> LstmImpl {
        self.config.model.encoder_type.lstm_impl()
    }

    /// Whether the NMT encoder stops at each sentence's real end: `--source-lengths`, or
    /// what a seed's `--encoder-type` selects, or the model crate's default (off).
    pub fn source_lengths(&self) -> SourceLengths {
        self.config.model.source_lengths.unwrap_or_default()
    }

    /// What bi encoder layers above the first read: `--bi-layer-input`, or what a seed's
    /// `--encoder-type` selects, or the model crate's default (own).
    pub fn bi_layer_input(&self) -> BiLayerInput {
        self.config.model.bi_layer_input.unwrap_or_default()
    }

    /// Ranks the configuration was checked for.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Ranks that compute gradients (all but dedicated parameter servers, which are the
    /// last `--ps-ranks` ranks).
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// Whether `rank` computes gradients.
    pub fn is_worker(&self, rank: usize) -> bool {
        self.data_worker(rank) < self.workers
    }

    /// Pipeline stages per replica (`--pipeline-stages`; 1 without a pipeline).
    pub fn pipeline_stages(&self) -> usize {
        self.stages
    }

    /// Whether the model is cut into pipeline stages.
    pub fn is_pipelined(&self) -> bool {
        self.stages > 1
    }

    /// The data worker (replica) `rank` reads the batches of: the rank itself without a
    /// pipeline; with one, ranks `r * K .. (r + 1) * K` are the K stages of replica `r`
    /// and read its batches alike.
    pub fn data_worker(&self, rank: usize) -> usize {
        rank / self.stages
    }

    /// `rank`'s pipeline stage (0 without a pipeline).
    pub fn pipeline_stage(&self, rank: usize) -> usize {
        rank % self.stages
    }

    /// How many examples each worker takes per step.
    pub fn batch(&self) -> BatchSizing {
        self.batch
    }

    /// Worker `worker`'s examples per step (0 for a dedicated parameter server).
    pub fn local_batch_size(&self, worker: usize) -> usize {
        self.batch
            .local_batch_size(worker, self.workers)
            .unwrap_or(0)
    }

    /// Examples per step over all workers.
    pub fn global_batch_size(&self) -> usize {
        self.batch.global_batch_size(self.workers)
    }

    /// The learning rate in effect (the optimizer's default when none was given).
    pub fn learning_rate(&self) -> f32 {
        self.learning_rate
    }

    /// Whether the replicated strategy reduces gradient ranges while backward runs.
    pub fn overlap_backward(&self) -> bool {
        self.overlap_backward
    }

    /// The fusion engine's cycle time.
    pub fn cycle_time(&self) -> Duration {
        self.cycle_time
    }

    /// How long a collective may wait on other ranks without progress (`None`: for
    /// ever).
    pub fn stall_timeout(&self) -> Option<Duration> {
        self.stall_timeout
    }

    /// Where the batches come from.
    pub fn data_source(&self) -> &DataSource {
        &self.data
    }

    /// The held-out set (`None`: no `--eval-data`).
    pub fn held_out_source(&self) -> Option<&HeldOutSource> {
        self.held_out.as_ref()
    }

    /// Whether the run evaluates after step `step` (counted from the start of training,
    /// a resumed checkpoint's steps included) when `last` is its final step: every
    /// `--eval-every` steps and at the end, given `--eval-data`.
    pub fn evaluates_after(&self, step: u64, last: bool) -> bool {
        let every = self.config.run.eval_every as u64;
        self.held_out.is_some() && (last || (every > 0 && step.is_multiple_of(every)))
    }

    /// Steps run: warm-up plus timed.
    pub fn total_steps(&self) -> usize {
        self.total_steps
    }

    /// How the replicated strategy reduces (packing wins over overlap).
    pub fn reduction(&self) -> Reduction {
        let exchange = &self.config.exchange;
        if exchange.gradient_repacking > 0 || exchange.agg_small_grads_max_bytes > 0 {
            Reduction::Packed
        } else if self.overlap_backward {
            Reduction::Overlapped
        } else {
            Reduction::AfterBackward
        }
    }

    /// The strategy as the logs and reports name it, e.g. `replicated (overlapped with
    /// backward)`.
    pub fn strategy_label(&self) -> String {
        let ps_ranks = self.config.exchange.ps_ranks;
        match (self.config.exchange.variable_update, self.reduction()) {
            (VariableUpdate::Replicated, Reduction::Packed) => {
                "replicated (packed, after backward)".to_string()
            }
            (VariableUpdate::Replicated, Reduction::Overlapped) => {
                "replicated (overlapped with backward)".to_string()
            }
            (VariableUpdate::Replicated, Reduction::AfterBackward) => {
                "replicated (after backward)".to_string()
            }
            (VariableUpdate::ParameterServer, _) if ps_ranks == 0 => {
                "parameter_server (a shard on every rank)".to_string()
            }
            (VariableUpdate::ParameterServer, _) => {
                format!("parameter_server ({ps_ranks} dedicated server ranks)")
            }
            (VariableUpdate::Independent, _) => "independent".to_string(),
        }
    }

    /// The pipeline as the logs and reports name it, e.g. `pipeline 2 stages x 4
    /// micro-batches (gpipe)`; `None` without one.
    pub fn pipeline_label(&self) -> Option<String> {
        let exchange = &self.config.exchange;
        self.is_pipelined().then(|| {
            let balance = match (
                exchange.pipeline_split.is_empty(),
                exchange.pipeline_balance,
            ) {
                (false, _) => "split by hand",
                (true, PipelineBalance::Params) => "balanced by parameter count",
                (true, PipelineBalance::Time) => "balanced by measured time",
            };
            format!(
                "pipeline {} stages x {} micro-batches ({}, {balance})",
                self.stages, exchange.micro_batches, exchange.pipeline_schedule
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn error(cfg: &TrainConfig, world: usize) -> String {
        cfg.validate(world)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    fn pipelined(stages: usize, micro: usize) -> TrainConfig {
        let mut cfg = TrainConfig::default();
        cfg.exchange.pipeline_stages = stages;
        cfg.exchange.micro_batches = micro;
        cfg.data.batch_size = 8;
        cfg
    }

    #[test]
    fn pipeline_flags_that_cannot_work_fail_naming_the_flags() {
        let ok = pipelined(2, 4).validate(2);
        assert_eq!(ok.as_ref().map(|r| r.pipeline_stages()).ok(), Some(2));
        assert_eq!(ok.as_ref().map(|r| r.workers()).ok(), Some(1));
        assert_eq!(ok.as_ref().map(|r| r.data_worker(1)).ok(), Some(0));
        assert_eq!(ok.as_ref().map(|r| r.local_batch_size(0)).ok(), Some(8));
        // The default NMT has 2 decoder layers: 4 units.
        let e = error(&pipelined(5, 1), 5);
        assert!(
            e.contains("--pipeline-stages") && e.contains("at most 4"),
            "{e}"
        );
        let e = error(&pipelined(2, 0), 2);
        assert!(
            e.contains("--micro-batches") && e.contains("at least 1"),
            "{e}"
        );
        let e = error(&pipelined(2, 9), 2);
        assert!(e.contains("--micro-batches") && e.contains("8"), "{e}");
        let mut total = pipelined(2, 4);
        total.data.total_batch_size = Some(3);
        let e = error(&total, 2);
        assert!(e.contains("--micro-batches"), "{e}");
        let e = error(&pipelined(2, 1), 3);
        assert!(
            e.contains("--pipeline-stages") && e.contains("multiple"),
            "{e}"
        );
        let mut ps = pipelined(2, 2);
        ps.exchange.variable_update = VariableUpdate::ParameterServer;
        let e = error(&ps, 2);
        assert!(
            e.contains("--variable-update") && e.contains("--pipeline-stages"),
            "{e}"
        );
        let mut split = pipelined(2, 2);
        split.exchange.pipeline_split = vec![1, 2];
        let e = error(&split, 2);
        assert!(
            e.contains("--pipeline-split") && e.contains("4 units"),
            "{e}"
        );
        let e = error(&pipelined(1, 2), 1);
        assert!(
            e.contains("--micro-batches") && e.contains("--pipeline-stages"),
            "{e}"
        );
        let mut rnnlm = pipelined(5, 1);
        rnnlm.model.model = ModelKind::Rnnlm;
        let e = error(&rnnlm, 5);
        assert!(e.contains("--num-encoder-layers"), "{e}");
        // 2 stages x 2 replicas.
        let hybrid = pipelined(2, 2).validate(4);
        assert_eq!(hybrid.as_ref().map(|r| r.workers()).ok(), Some(2));
        assert_eq!(hybrid.as_ref().map(|r| r.data_worker(3)).ok(), Some(1));
        assert_eq!(hybrid.as_ref().map(|r| r.pipeline_stage(3)).ok(), Some(1));
    }

    #[test]
    fn the_pipeline_balance_flag_says_what_is_wrong() {
        let e = "speed"
            .parse::<PipelineBalance>()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("`speed`") && e.contains("--pipeline-balance") && e.contains("time"),
            "{e}"
        );
        assert_eq!(
            "time".parse::<PipelineBalance>().ok(),
            Some(PipelineBalance::Time)
        );
        let mut timed = pipelined(2, 2);
        timed.exchange.pipeline_balance = PipelineBalance::Time;
        let label = timed.validate(2).ok().and_then(|r| r.pipeline_label());
        assert!(
            label
                .as_deref()
                .is_some_and(|l| l.contains("balanced by measured time")),
            "{label:?}"
        );
        // Nothing to balance: a split by hand, or no pipeline.
        let mut both = timed.clone();
        both.exchange.pipeline_split = vec![2, 2];
        let e = error(&both, 2);
        assert!(
            e.contains("--pipeline-balance") && e.contains("--pipeline-split"),
            "{e}"
        );
        let mut single = TrainConfig::default();
        single.exchange.pipeline_balance = PipelineBalance::Time;
        let e = error(&single, 1);
        assert!(
            e.contains("--pipeline-balance") && e.contains("--pipeline-stages"),
            "{e}"
        );
    }

    #[test]
    fn seed_names_select_the_seeds_models() {
        let cases = [
            (
                EncoderType::Fused,
                LstmImpl::Fused,
                SourceLengths::Off,
                BiLayerInput::Own,
            ),
            (
                EncoderType::Stepwise,
                LstmImpl::Stepwise,
                SourceLengths::Off,
                BiLayerInput::Own,
            ),
            (
                EncoderType::CudnnLstm,
                LstmImpl::Fused,
                SourceLengths::Off,
                BiLayerInput::Concat,
            ),
            (
                EncoderType::DynamicRnn,
                LstmImpl::Stepwise,
                SourceLengths::On,
                BiLayerInput::Own,
            ),
        ];
        for (encoder_type, lstm, lengths, input) in cases {
            let mut cfg = TrainConfig::default();
            cfg.model.encoder_type = encoder_type;
            let run = cfg.validate(1).expect("valid");
            assert_eq!(
                (run.lstm_impl(), run.source_lengths(), run.bi_layer_input()),
                (lstm, lengths, input),
                "{encoder_type}"
            );
            // The config reports and checkpoints record names the resolved semantics.
            let echoed = serde_json::to_string(run.config()).expect("json");
            for field in [
                format!("\"source_lengths\":\"{lengths}\""),
                format!("\"bi_layer_input\":\"{input}\""),
                format!("\"encoder_type\":\"{encoder_type}\""),
            ] {
                assert!(
                    echoed.contains(&field),
                    "{encoder_type}: {field} in {echoed}"
                );
            }
            // Flags that agree with a seed's name are accepted.
            cfg.model.source_lengths = Some(lengths);
            cfg.model.bi_layer_input = Some(input);
            assert_eq!(
                cfg.validate(1).map(|r| r.source_lengths()).ok(),
                Some(lengths)
            );
        }
        // fused and stepwise take the semantic flags as given.
        let mut cfg = TrainConfig::default();
        cfg.model.encoder_type = EncoderType::Stepwise;
        cfg.model.source_lengths = Some(SourceLengths::On);
        cfg.model.bi_layer_input = Some(BiLayerInput::Concat);
        let run = cfg.validate(1).expect("valid");
        assert_eq!(
            (run.lstm_impl(), run.source_lengths(), run.bi_layer_input()),
            (LstmImpl::Stepwise, SourceLengths::On, BiLayerInput::Concat)
        );
    }

    #[test]
    fn a_semantic_flag_that_contradicts_a_seed_name_names_both_flags() {
        let mut cfg = TrainConfig::default();
        cfg.model.encoder_type = EncoderType::DynamicRnn;
        cfg.model.source_lengths = Some(SourceLengths::Off);
        let err = error(&cfg, 1);
        assert!(
            err.contains("--source-lengths")
                && err.contains("`off`")
                && err.contains("--encoder-type dynamic_rnn")
                && err.contains("--encoder-type stepwise"),
            "{err}"
        );
        let mut cfg = TrainConfig::default();
        cfg.model.encoder_type = EncoderType::CudnnLstm;
        cfg.model.bi_layer_input = Some(BiLayerInput::Own);
        let err = error(&cfg, 1);
        assert!(
            err.contains("--bi-layer-input")
                && err.contains("--encoder-type cudnn_lstm")
                && err.contains("concat")
                && err.contains("--encoder-type fused"),
            "{err}"
        );
    }

    #[test]
    fn each_bad_value_is_named_with_its_flag() {
        let mut cfg = TrainConfig::default();
        cfg.data.batch_size = 0;
        let err = error(&cfg, 1);
        assert!(err.contains("--batch-size") && err.contains('0'), "{err}");

        let mut cfg = TrainConfig::default();
        cfg.model.direction = EncoderKind::Bi;
        cfg.model.num_encoder_layers = 3;
        cfg.model.num_decoder_layers = 3;
        assert!(error(&cfg, 1).contains("--num-encoder-layers"));

        let mut cfg = TrainConfig::default();
        cfg.model.num_decoder_layers = 3;
        let err = error(&cfg, 1);
        assert!(
            err.contains("--num-decoder-layers") && err.contains('3'),
            "{err}"
        );

        let mut cfg = TrainConfig::default();
        cfg.exchange.variable_update = VariableUpdate::ParameterServer;
        cfg.exchange.ps_ranks = 2;
        assert!(error(&cfg, 2).contains("--ps-ranks"));
        let run = cfg.validate(3).ok();
        assert_eq!(run.as_ref().map(ValidatedConfig::workers), Some(1));
        assert_eq!(run.map(|r| r.is_worker(1)), Some(false));

        let mut cfg = TrainConfig::default();
        cfg.data.total_batch_size = Some(2);
        assert!(error(&cfg, 3).contains("--total-batch-size"));

        let mut cfg = TrainConfig::default();
        cfg.run.gemm_precision = GemmPrecision::F16;
        let err = error(&cfg, 1);
        assert!(
            err.contains("--gemm-precision") && err.contains("use bf16 on the CPU"),
            "{err}"
        );
        cfg.run.gemm_precision = GemmPrecision::Bf16;
        assert!(cfg.validate(1).is_ok(), "bf16 runs on the CPU");

        let mut cfg = TrainConfig::default();
        cfg.output.resume = true;
        assert!(error(&cfg, 1).contains("--checkpoint"));
        let mut cfg = TrainConfig::default();
        cfg.output.overwrite_checkpoint = true;
        let err = error(&cfg, 1);
        assert!(
            err.contains("--overwrite-checkpoint") && err.contains("--checkpoint FILE"),
            "{err}"
        );

        let mut cfg = TrainConfig::default();
        cfg.exchange.cycle_time_ms = 1e30;
        assert!(error(&cfg, 1).contains("--cycle-time-ms"));
        cfg.exchange.cycle_time_ms = -1.0;
        assert!(error(&cfg, 1).contains("--cycle-time-ms"));

        let mut cfg = TrainConfig::default();
        cfg.exchange.stall_timeout = -1.0;
        assert!(error(&cfg, 1).contains("--stall-timeout"));
        cfg.exchange.stall_timeout = 1e30;
        assert!(error(&cfg, 1).contains("--stall-timeout"));
        cfg.exchange.stall_timeout = 0.0;
        assert_eq!(cfg.validate(1).map(|v| v.stall_timeout()).ok(), Some(None));
        cfg.exchange.stall_timeout = 4.0;
        assert_eq!(
            cfg.validate(1).map(|v| v.stall_timeout()).ok(),
            Some(Some(Duration::from_secs(4)))
        );

        let mut cfg = TrainConfig::default();
        cfg.exchange.fusion_threshold_bytes = 0;
        assert!(error(&cfg, 1).contains("--fusion-threshold-bytes"));

        let mut cfg = TrainConfig::default();
        cfg.run.device = DeviceKind::Cuda;
        assert_eq!(
            error(&cfg, 1).contains("--features cuda"),
            !cfg!(feature = "cuda")
        );

        let mut cfg = TrainConfig::default();
        cfg.model.model = ModelKind::Rnnlm;
        cfg.model.num_decoder_layers = 0;
        assert!(error(&cfg, 1).contains("--num-decoder-layers"));

        let mut cfg = TrainConfig::default();
        cfg.data.data = vec!["a.txt".into()];
        let err = error(&cfg, 1);
        assert!(err.contains("--data") && err.contains("a.txt"), "{err}");
        // One file too many is an error too, not ignored.
        cfg.model.model = ModelKind::Rnnlm;
        cfg.data.data = vec!["a.txt".into(), "v.txt".into(), "extra.txt".into()];
        let err = error(&cfg, 1);
        assert!(err.contains("extra.txt"), "{err}");

        let mut cfg = TrainConfig::default();
        cfg.data.use_synthetic_data = Some(true);
        cfg.model.model = ModelKind::Rnnlm;
        cfg.data.data = vec!["a.txt".into()];
        let err = error(&cfg, 1);
        assert!(
            err.contains("--data") && err.contains("--use-synthetic-data"),
            "{err}"
        );

        let mut cfg = TrainConfig::default();
        cfg.run.timed_batches = usize::MAX;
        let err = error(&cfg, 1);
        assert!(
            err.contains("--timed-batches") && err.contains("accepted range is 1 to"),
            "{err}"
        );

        let mut cfg = TrainConfig::default();
        cfg.run.threads = 100_000;
        let err = error(&cfg, 1);
        assert!(
            err.contains("--threads") && err.contains("accepted range is 0"),
            "{err}"
        );
        cfg.run.threads = crate::device::max_cpu_threads();
        assert!(cfg.validate(1).is_ok());
    }

    #[test]
    fn held_out_flags_are_checked_before_any_work() {
        let corpus = |model: ModelKind| {
            let mut cfg = TrainConfig::default();
            cfg.model.model = model;
            cfg.data.data = match model {
                ModelKind::Nmt => vec!["s".into(), "t".into(), "sv".into(), "tv".into()],
                ModelKind::Rnnlm => vec!["train.txt".into()],
            };
            cfg
        };
        // --eval-every and --target-perplexity need --eval-data.
        let mut cfg = corpus(ModelKind::Nmt);
        cfg.run.eval_every = 5;
        let err = error(&cfg, 1);
        assert!(
            err.contains("--eval-every") && err.contains("--eval-data"),
            "{err}"
        );
        let mut cfg = corpus(ModelKind::Nmt);
        cfg.run.target_perplexity = Some(100.0);
        let err = error(&cfg, 1);
        assert!(
            err.contains("--target-perplexity") && err.contains("--eval-data"),
            "{err}"
        );
        // A perplexity is above 1: 1, below and non-finite targets are refused.
        for bad in [1.0, 0.5, -3.0, f64::NAN, f64::INFINITY] {
            let mut cfg = corpus(ModelKind::Rnnlm);
            cfg.data.eval_data = vec!["valid.txt".into()];
            cfg.run.target_perplexity = Some(bad);
            let err = error(&cfg, 1);
            assert!(
                err.contains("--target-perplexity") && err.contains("above 1"),
                "{bad}: {err}"
            );
        }
        // The file count follows the model; synthetic data has no vocabulary to read with.
        let mut cfg = corpus(ModelKind::Nmt);
        cfg.data.eval_data = vec!["dev.en".into()];
        let err = error(&cfg, 1);
        assert!(
            err.contains("--eval-data") && err.contains("SRC,TGT"),
            "{err}"
        );
        let mut cfg = corpus(ModelKind::Rnnlm);
        cfg.data.eval_data = vec!["a.txt".into(), "b.txt".into()];
        let err = error(&cfg, 1);
        assert!(
            err.contains("--eval-data") && err.contains("b.txt"),
            "{err}"
        );
        let mut cfg = TrainConfig::default();
        cfg.data.eval_data = vec!["dev.en".into(), "dev.xx".into()];
        let err = error(&cfg, 1);
        assert!(
            err.contains("--eval-data") && err.contains("--data"),
            "{err}"
        );

        // 0 = only at the end; N = every N steps and at the end.
        let mut cfg = corpus(ModelKind::Nmt);
        cfg.data.eval_data = vec!["dev.en".into(), "dev.xx".into()];
        cfg.run.target_perplexity = Some(1.5);
        let run = cfg.validate(2).ok();
        let at = |run: &Option<ValidatedConfig>, step, last| {
            run.as_ref().map(|r| r.evaluates_after(step, last))
        };
        assert_eq!(
            run.as_ref().and_then(|r| r.held_out_source().cloned()),
            Some(HeldOutSource::Translation {
                source: "dev.en".into(),
                target: "dev.xx".into()
            })
        );
        assert_eq!(at(&run, 5, false), Some(false));
        assert_eq!(at(&run, 5, true), Some(true));
        cfg.run.eval_every = 4;
        let run = cfg.validate(2).ok();
        assert_eq!(at(&run, 8, false), Some(true));
        assert_eq!(at(&run, 9, false), Some(false));
        let run = corpus(ModelKind::Nmt).validate(1).ok();
        assert_eq!(at(&run, 9, true), Some(false));
    }

    #[cfg(unix)]
    #[test]
    fn paths_that_are_not_utf8_are_refused_by_flag() {
        use std::os::unix::ffi::OsStrExt;
        let bad = std::path::PathBuf::from(std::ffi::OsStr::from_bytes(b"run\xff.ckpt"));
        let mut cfg = TrainConfig::default();
        cfg.output.checkpoint = Some(bad.clone());
        assert!(error(&cfg, 1).contains("--checkpoint"));
        let mut cfg = TrainConfig::default();
        cfg.output.json_report = Some(bad.clone());
        assert!(error(&cfg, 1).contains("--json-report"));
        let mut cfg = TrainConfig::default();
        cfg.model.model = ModelKind::Rnnlm;
        cfg.data.data = vec![bad];
        assert!(error(&cfg, 1).contains("--data"));
    }

    #[test]
    fn auto_values_resolve_once() {
        let run = TrainConfig::default().validate(2).ok();
        let run = run.as_ref();
        assert_eq!(run.map(ValidatedConfig::learning_rate), Some(1e-3));
        assert_eq!(run.map(ValidatedConfig::overlap_backward), Some(false));
        assert_eq!(
            run.map(|r| r.data_source().clone()),
            Some(DataSource::Synthetic)
        );
        assert_eq!(run.map(ValidatedConfig::global_batch_size), Some(64));

        let mut cfg = TrainConfig::default();
        if cfg!(feature = "cuda") {
            cfg.run.device = DeviceKind::Cuda;
        } else {
            cfg.exchange.overlap_backward = OverlapMode::On;
        }
        cfg.run.optimizer = OptimizerKind::Sgd;
        cfg.model.model = ModelKind::Rnnlm;
        cfg.data.data = vec!["ptb.txt".into()];
        let run = cfg.validate(1).ok();
        let run = run.as_ref();
        assert_eq!(run.map(ValidatedConfig::learning_rate), Some(1.0));
        assert_eq!(run.map(ValidatedConfig::overlap_backward), Some(true));
        assert_eq!(
            run.map(|r| r.data_source().clone()),
            Some(DataSource::Text {
                text: "ptb.txt".into(),
                vocab: None
            })
        );
    }
}
