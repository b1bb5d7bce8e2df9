//! The crate's error type.

/// Everything the model crate can reject.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A CPU kernel rejected its arguments.
    #[error("kernel error: {0}")]
    Kernel(#[from] ringtrain_kernels::Error),
    /// A model configuration value is unusable.
    #[error("invalid value `{value}` for model config {name}: {reason}")]
    InvalidValue {
        /// The configuration field.
        name: &'static str,
        /// The value that was given.
        value: String,
        /// What is wrong and what to use instead.
        reason: String,
    },
    /// A batch does not match its own sizes or the model's vocabularies.
    #[error("invalid value `{value}` for batch field {name}: {reason}")]
    InvalidBatch {
        /// The batch field.
        name: &'static str,
        /// The value (or length) that was given.
        value: String,
        /// What is wrong and what to pass instead.
        reason: String,
    },
    /// A backend operation was asked to read or write past the end of a buffer.
    #[error("backend view `{what}` ends at element {end} but the buffer holds {len}: the caller computed a wrong offset or size")]
    OutOfBounds {
        /// Which operand of the operation.
        what: &'static str,
        /// One past the last element the operation would touch.
        end: usize,
        /// Length of the buffer.
        len: usize,
    },
    /// A backend operand has a shape or strides its operation cannot take: it disagrees
    /// with another operand, or is strided where the operation needs consecutive elements.
    #[error("invalid value `{value}` for backend operand {name}: {reason}")]
    InvalidView {
        /// Which operand of the operation.
        name: &'static str,
        /// Its layout (or the value that disagrees).
        value: String,
        /// What the operation needs instead.
        reason: String,
    },
    /// The CUDA backend was requested from a build without the `cuda` feature.
    #[error("the CUDA backend (device {device}) was requested but ringtrain-model was built without the `cuda` feature: rebuild with `--features cuda` (needs libcuda at link time) or use the CPU backend")]
    NotCompiledWithCuda {
        /// The device index that was requested.
        device: usize,
    },
    /// A GPU driver call or kernel launch of the CUDA backend failed.
    #[cfg(feature = "cuda")]
    #[error("GPU error: {0}; check that the device exists and has free memory, and that the NVIDIA driver works (nvidia-smi)")]
    Cuda(#[from] ringtrain_cuda::Error),
    /// The CPU backend could not start its worker threads.
    #[error("cannot start a rayon pool of {threads} threads: {reason}")]
    ThreadPool {
        /// Requested thread count.
        threads: usize,
        /// The pool builder's message.
        reason: String,
    },
}

/// Result with the crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// `InvalidValue` for `name` with `value` and `reason`.
pub(crate) fn invalid_value(
    name: &'static str,
    value: impl ToString,
    reason: impl Into<String>,
) -> Error {
    Error::InvalidValue {
        name,
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// `InvalidBatch` for `name` with `value` and `reason`.
pub(crate) fn batch_error(
    name: &'static str,
    value: impl ToString,
    reason: impl Into<String>,
) -> Error {
    Error::InvalidBatch {
        name,
        value: value.to_string(),
        reason: reason.into(),
    }
}
