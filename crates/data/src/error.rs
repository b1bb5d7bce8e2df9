//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading or batching training data.
///
/// Every message names the input (file, line, value) and says what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened or read.
    #[error("cannot read {}: {source}; check that the path exists and is readable", path.display())]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },

    /// A file could not be written.
    #[error("cannot write {}: {source}; check that the directory exists and is writable", path.display())]
    Write {
        /// The file that failed.
        path: PathBuf,
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },

    /// A file that must hold data holds none.
    #[error("{} is empty ({what}); give a file with at least one non-empty line", path.display())]
    EmptyFile {
        /// The empty file.
        path: PathBuf,
        /// What the file was expected to hold.
        what: &'static str,
    },

    /// A line is not valid UTF-8.
    #[error("{}:{line}: invalid UTF-8 at byte {byte_offset} of the line; re-encode the file as UTF-8 (e.g. `iconv -t UTF-8`)", path.display())]
    InvalidUtf8 {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Offset of the first invalid byte within the line.
        byte_offset: usize,
    },

    /// A vocabulary file lists the same token twice.
    #[error("{}: token {token:?} appears on line {first_line} and again on line {second_line}; remove the duplicate (ids are line positions, so each token must appear once)", path.display())]
    DuplicateToken {
        /// The vocabulary file (or source name).
        path: PathBuf,
        /// The repeated token.
        token: String,
        /// Line of the first occurrence (1-based).
        first_line: usize,
        /// Line of the repeat (1-based).
        second_line: usize,
    },

    /// A vocabulary line is not a single token.
    #[error("{}:{line}: vocabulary line {value:?} is not a single token ({problem}); write one token per line without spaces", path.display())]
    BadVocabLine {
        /// The vocabulary file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The offending line.
        value: String,
        /// What is wrong with it.
        problem: &'static str,
    },

    /// A special token sits somewhere other than its reserved line.
    #[error("{}:{line}: special token {token:?} must be on line {expected_line} (the first lines must be {specials:?}) or absent everywhere (then they are added); move it to line {expected_line} or remove it", path.display())]
    MisplacedSpecialToken {
        /// The vocabulary file.
        path: PathBuf,
        /// The special token.
        token: String,
        /// Where it was found (1-based).
        line: usize,
        /// Where it must be (1-based).
        expected_line: usize,
        /// The full list of special tokens in order.
        specials: Vec<String>,
    },

    /// Some special tokens are in the vocabulary file and others are not.
    #[error("{}: the vocabulary contains the special tokens {present:?} but not {missing:?}; the first lines must be {specials:?} in that order, or leave all of them out and they are added in front", path.display())]
    IncompleteSpecialTokens {
        /// The vocabulary file.
        path: PathBuf,
        /// Specials found in the file.
        present: Vec<String>,
        /// Specials missing from the file.
        missing: Vec<String>,
        /// The full list of special tokens in order.
        specials: Vec<String>,
    },

    /// Source and target files of a parallel corpus have different line counts.
    #[error("{} has {source_lines} lines but {} has {target_lines}; a parallel corpus needs one target line per source line", source_path.display(), target_path.display())]
    LineCountMismatch {
        /// Source-language file.
        source_path: PathBuf,
        /// Target-language file.
        target_path: PathBuf,
        /// Lines in the source file.
        source_lines: usize,
        /// Lines in the target file.
        target_lines: usize,
    },

    /// Loading left no usable example.
    #[error("{}: no usable examples ({detail}); check the length limits and that the file holds text", path.display())]
    NoExamples {
        /// The corpus file.
        path: PathBuf,
        /// Why every line was rejected.
        detail: String,
    },

    /// A configuration value is out of range.
    #[error("invalid value `{value}` for {name}: {reason}")]
    InvalidValue {
        /// The parameter name as the user knows it.
        name: &'static str,
        /// The value given.
        value: String,
        /// What it must satisfy.
        reason: String,
    },

    /// The language-model corpus is too short for the requested batch layout.
    #[error("{}: {tokens} tokens cannot fill {columns} batch columns with at least 2 tokens each; use a smaller batch or a longer text", path.display())]
    CorpusTooSmall {
        /// The corpus file.
        path: PathBuf,
        /// Tokens in the corpus.
        tokens: usize,
        /// Global batch columns requested.
        columns: usize,
    },

    /// The prefetch thread panicked while producing a batch.
    #[error("the data prefetch thread panicked: {message}; this is a bug in the batch source, please report it")]
    PrefetchPanicked {
        /// The panic payload, when it was a string.
        message: String,
    },

    /// The prefetch thread could not be started.
    #[error("cannot start the data prefetch thread: {source}; the system may be out of threads or memory")]
    PrefetchSpawn {
        /// The operating-system error.
        #[source]
        source: std::io::Error,
    },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn invalid(
        name: &'static str,
        value: impl ToString,
        reason: impl Into<String>,
    ) -> Self {
        Error::InvalidValue {
            name,
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}
