//! The `ringtrain` command's errors.

/// Everything the command can fail with.
#[derive(Debug, thiserror::Error)]
pub enum LauncherError {
    /// Training failed on this rank.
    #[error(transparent)]
    Train(#[from] ringtrain_train::Error),
    /// The collective layer failed (MPI start-up, transport).
    #[error(transparent)]
    Collective(#[from] ringtrain_collective::Error),
    /// mpirun is not installed.
    #[error("`{program}` was not found on PATH: run scripts/setup (it installs Open MPI), or pass --mpirun /path/to/mpirun")]
    MpirunMissing {
        /// The program looked for.
        program: String,
    },
    /// A program could not be started.
    #[error("could not start `{program}`: {source}")]
    Spawn {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// mpirun returned a failure.
    #[error("the ranks failed ({status}); command was: {command}")]
    RanksFailed {
        /// Exit status.
        status: String,
        /// The status to exit with: mpirun's exit code, or 128 + the signal that killed it.
        code: i32,
        /// The command that ran.
        command: String,
    },
    /// The launcher was asked to stop; it passed the signal on to mpirun and waited.
    #[error("stopped by {signal}: passed it on to mpirun, which ended with {status}")]
    Interrupted {
        /// The signal received.
        signal: &'static str,
        /// How mpirun ended.
        status: String,
        /// The status to exit with (mpirun's, or 128 + the signal).
        code: i32,
    },
    /// A signal handler could not be installed.
    #[error("installing the signal handlers failed: {0}")]
    Signals(#[source] std::io::Error),
    /// A plot could not be drawn.
    #[error("could not draw the plot for {flag} `{}`: {reason}", path.display())]
    Plot {
        /// The option that asked for it.
        flag: &'static str,
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        reason: String,
    },
    /// A value the user gave (a flag, or a file a flag names) is wrong.
    #[error("invalid value `{value}` for {name}: {reason}")]
    InvalidValue {
        /// The flag, e.g. `--report`.
        name: &'static str,
        /// The offending value as given.
        value: String,
        /// What is wrong and what to do instead.
        reason: String,
    },
    /// A benchmark failed.
    #[error("benchmark failed: {0}")]
    Bench(String),
}

impl LauncherError {
    /// The process's exit status for this error: mpirun's own for failed or stopped runs,
    /// 128 + the signal for a rank stopped by SIGINT/SIGTERM, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            LauncherError::RanksFailed { code, .. } | LauncherError::Interrupted { code, .. } => {
                *code
            }
            LauncherError::Train(ringtrain_train::Error::Interrupted { signal, .. }) => {
                128 + signal
            }
            _ => 1,
        }
    }
}

impl LauncherError {
    /// Shorthand for [`LauncherError::InvalidValue`].
    pub fn invalid(name: &'static str, value: impl ToString, reason: impl Into<String>) -> Self {
        LauncherError::InvalidValue {
            name,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// `Result` with [`LauncherError`].
pub type Result<T> = std::result::Result<T, LauncherError>;
