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
        /// The command that ran.
        command: String,
    },
    /// Writing an output file failed.
    #[error("writing `{path}` failed: {source}")]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A benchmark failed.
    #[error("benchmark failed: {0}")]
    Bench(String),
}

/// `Result` with [`LauncherError`].
pub type Result<T> = std::result::Result<T, LauncherError>;
