//! The crate's error type.

use std::time::Duration;

/// Everything that can go wrong in a collective operation.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A caller passed a value the library cannot use.
    #[error("invalid value `{value}` for {name}: {reason}")]
    InvalidValue {
        /// Which argument or setting.
        name: &'static str,
        /// The offending value, printed.
        value: String,
        /// What is wrong and what to do instead.
        reason: &'static str,
    },
    /// The requested algorithm needs something this transport lacks.
    #[error("algorithm `{algorithm}` is not available on the {transport} transport: {hint}")]
    AlgorithmUnavailable {
        /// The algorithm asked for.
        algorithm: &'static str,
        /// The transport in use.
        transport: &'static str,
        /// What to do instead.
        hint: &'static str,
    },
    /// The transport failed to move bytes (peer gone, length disagreement, MPI failure).
    #[error("transport error on rank {rank}: {detail}")]
    Transport {
        /// The rank that saw the failure.
        rank: usize,
        /// What happened.
        detail: String,
    },
    /// Ranks submitted the same tensor name with different dtypes or lengths.
    #[error("tensor `{name}`: ranks disagree on its shape ({detail}); every rank must submit the same name with the same dtype and length")]
    TensorMismatch {
        /// Tensor name.
        name: String,
        /// Each rank's dtype and length.
        detail: String,
    },
    /// Ranks hold different values of settings they must share
    /// ([`crate::Communicator::check_same_values`]).
    #[error("ranks were started with different {what}: {differences}; start every rank with the same {what}")]
    SettingsDiffer {
        /// What the values are (`flags`, `fusion engine settings`).
        what: String,
        /// Each name whose value differs, with which ranks hold which value.
        differences: String,
    },
    /// A tensor was submitted on some ranks but not on the others within the stall timeout.
    #[error("tensor `{name}` was submitted on ranks {submitted:?} but not on ranks {missing:?} within {waited:?}: every rank must submit every tensor")]
    Stalled {
        /// Tensor name.
        name: String,
        /// Ranks that submitted it.
        submitted: Vec<usize>,
        /// Ranks that did not.
        missing: Vec<usize>,
        /// How long the submitting ranks waited.
        waited: Duration,
    },
    /// A wait on other ranks made no progress for the stall timeout (a rank stopped,
    /// stuck or gone). Over MPI the job is aborted instead (see `stall` in the crate docs).
    #[error("rank {rank}: stalled for {waited:.1?} in {operation}{context}, waiting for {waiting_for}: that rank is stopped, stuck or gone (or far behind); check it, or raise the stall timeout if such waits are expected")]
    StallTimeout {
        /// The rank that waited.
        rank: usize,
        /// The ranks it waited for, described.
        waiting_for: String,
        /// The collective it was in.
        operation: String,
        /// What the program was doing (` (step 3)`), or empty.
        context: String,
        /// How long it waited.
        waited: Duration,
    },
    /// The same name was submitted twice on one rank before the first completed.
    #[error("tensor `{name}` is already in flight on rank {rank}: wait for its handle before submitting the name again")]
    DuplicateName {
        /// Tensor name.
        name: String,
        /// Rank that submitted it twice.
        rank: usize,
    },
    /// The fusion engine has stopped (shut down, or its background thread failed).
    #[error("the fusion engine has stopped: {reason}")]
    EngineStopped {
        /// Why.
        reason: String,
    },
    /// A kernel rejected its arguments (a bug in this crate if it happens).
    #[error("reduction kernel failed: {0}")]
    Kernel(#[from] ringtrain_kernels::Error),
    /// Writing the timeline failed.
    #[error("cannot write timeline {path}: {source}; pass a path in a writable directory")]
    Timeline {
        /// File path.
        path: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Result alias used throughout the crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn invalid(name: &'static str, value: impl ToString, reason: &'static str) -> Self {
        Error::InvalidValue {
            name,
            value: value.to_string(),
            reason,
        }
    }
}
