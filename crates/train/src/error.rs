//! The one error type of `ringtrain-train`.

use std::path::PathBuf;

/// A GPU runtime error as the trainer's error (through the model crate's, which names
/// the device operation).
#[cfg(feature = "cuda")]
pub(crate) fn gpu_err(e: ringtrain_cuda::Error) -> Error {
    ringtrain_model::Error::from(e).into()
}

/// Everything that can go wrong while configuring, running or checkpointing training.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A value (usually a command-line flag) is not acceptable.
    #[error("invalid value `{value}` for {name}: {reason}")]
    InvalidValue {
        /// The flag or field, e.g. `--batch-size`.
        name: &'static str,
        /// The offending value as the user wrote it.
        value: String,
        /// What is wrong and what to do instead.
        reason: String,
    },
    /// A file could not be read, written, synced or renamed.
    #[error("{action} `{path}` failed: {source}")]
    Io {
        /// What was being done ("writing checkpoint", "reading report"...).
        action: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A checkpoint file is damaged or not a ringtrain checkpoint.
    #[error(
        "checkpoint `{path}` is corrupt: {reason}; delete it or point --checkpoint at a good file"
    )]
    CheckpointCorrupt {
        /// The file concerned.
        path: PathBuf,
        /// What check failed.
        reason: String,
    },
    /// A checkpoint in a format version this build does not read.
    #[error(
        "checkpoint `{path}` has format version {found}, but this build reads version {expected} only \
         (version {expected} adds the input position and the step a resumed run continues from); \
         resume it with the ringtrain that wrote it, or start a new run without --resume"
    )]
    CheckpointVersion {
        /// The file concerned.
        path: PathBuf,
        /// The version in the file.
        found: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// A valid checkpoint that was written for a different model or run shape.
    #[error(
        "checkpoint `{path}` does not match this run: {field} is {found} in the checkpoint but {expected} now; \
         resume with the flags it was written with, or start without --resume"
    )]
    CheckpointMismatch {
        /// The file concerned.
        path: PathBuf,
        /// The field that differs.
        field: String,
        /// The value this run uses.
        expected: String,
        /// The value stored in the checkpoint.
        found: String,
    },
    /// An existing checkpoint would be replaced by a run that does not resume it.
    #[error(
        "checkpoint `{path}` already exists ({holds}); pass --resume to continue from it, \
         --overwrite-checkpoint to replace it, or choose another --checkpoint path"
    )]
    CheckpointExists {
        /// The file concerned.
        path: PathBuf,
        /// What its header says it holds (step and flags), or why it cannot be read.
        holds: String,
    },
    /// SIGINT or SIGTERM stopped the run.
    #[error("interrupted by {} {during}; {checkpoint}", crate::interrupt::signal_name(*signal))]
    Interrupted {
        /// The signal's number (the process exits with 128 + it).
        signal: i32,
        /// What was interrupted ("after step 7 of 20", "in setup, before step 1 of 20").
        during: String,
        /// The last good checkpoint, or that there is none.
        checkpoint: String,
    },
    /// A signal handler could not be installed.
    #[error("installing the {signal} handler failed: {source}")]
    SignalHandler {
        /// The signal.
        signal: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Other ranks failed a step this rank passed; their own errors say why.
    #[error("{ranks} rank(s) failed {what}; see their error messages")]
    OtherRanksFailed {
        /// How many ranks failed.
        ranks: usize,
        /// What they were doing ("to load the checkpoint").
        what: String,
    },
    /// A rank's input pipeline ended although training needs an endless stream.
    #[error("rank {rank}'s input ended at step {step}; the input pipeline must not run dry")]
    InputEnded {
        /// The rank.
        rank: usize,
        /// The step that found no batch.
        step: usize,
    },
    /// An invariant of ringtrain itself does not hold: a bug, not a usage error.
    #[error("internal error: {0}; this is a bug in ringtrain, please report it")]
    Internal(String),
    /// A configuration needs more memory than the machine has available.
    #[error(
        "not enough memory: this configuration needs {estimate} per rank, more than the \
         {available} available to each of the {local_ranks} rank(s) on {place}; the biggest \
         term is {biggest}: use a smaller --vocab-size, --num-units, --batch-size or \
         --src-max-len, or fewer ranks per node"
    )]
    NotEnoughMemory {
        /// The estimate with its terms.
        estimate: String,
        /// Memory available per rank.
        available: String,
        /// Where: `this node` (host memory) or `GPU N`.
        place: String,
        /// Ranks sharing that memory.
        local_ranks: usize,
        /// The biggest term and its size.
        biggest: String,
    },
    /// A corpus file reads mostly as `<unk>` with its vocabulary.
    #[error(
        "{}: {percent:.1} % of its {tokens} tokens are not in the vocabulary {} (at most \
         {limit} % may be): check that this vocabulary belongs to this text (source and \
         target swapped?), or raise --max-unk-percent",
        text.display(),
        vocab.display()
    )]
    TooManyUnknownTokens {
        /// The corpus file.
        text: std::path::PathBuf,
        /// Its vocabulary file.
        vocab: std::path::PathBuf,
        /// Tokens read.
        tokens: usize,
        /// Percent of them unknown.
        percent: f64,
        /// `--max-unk-percent`.
        limit: f32,
    },
    /// Serialising or parsing JSON (config, report) failed.
    #[error("{action} failed: {source}")]
    Json {
        /// What was being done.
        action: &'static str,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// An error from the model crate (shapes, backend, missing CUDA support).
    #[error(transparent)]
    Model(#[from] ringtrain_model::Error),
    /// An error from the data crate (corpora, vocabularies, batching).
    #[error(transparent)]
    Data(#[from] ringtrain_data::Error),
    /// An error from the collective crate (transport, all-reduce, broadcast).
    #[error(transparent)]
    Collective(#[from] ringtrain_collective::Error),
    /// An error from a CPU kernel (optimizer, clipping, casts).
    #[error("kernel error: {0}")]
    Kernel(#[from] ringtrain_kernels::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// Shorthand for [`Error::InvalidValue`].
    pub fn invalid(name: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        Error::InvalidValue {
            name,
            value: value.to_string(),
            reason: reason.into(),
        }
    }

    /// What is wrong, without the value's name (for parsers whose caller names it).
    pub fn reason(&self) -> String {
        match self {
            Error::InvalidValue { reason, .. } => reason.clone(),
            other => other.to_string(),
        }
    }
}
