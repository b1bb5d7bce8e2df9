//! The crate's error type.

/// Everything that can go wrong in ringtrain-cuda.
///
/// Every message names the offending input, its value, and what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A device slice does not have the number of elements the shape needs.
    #[error(
        "`{arg}` has {actual} elements, expected {expected}: check the batch/hidden/rows/vocab/n you passed"
    )]
    ShapeMismatch {
        /// Argument name.
        arg: &'static str,
        /// Elements the shape needs.
        expected: usize,
        /// Elements the slice has.
        actual: usize,
    },
    /// A device slice is shorter than the strided matrix it must hold.
    #[error("`{arg}` has {actual} elements but the matrix with its leading dimension spans {needed}: pass a larger buffer or smaller m/n/k/ld")]
    TooShort {
        /// Argument name.
        arg: &'static str,
        /// Elements the matrix spans.
        needed: usize,
        /// Elements the slice has.
        actual: usize,
    },
    /// A size does not fit the kernels' 32-bit element indices.
    #[error("`{arg}` = {value} is too large: the kernels index with 32-bit integers, so it must be at most {limit}; split the work into smaller launches")]
    TooLarge {
        /// Argument name.
        arg: &'static str,
        /// The value given.
        value: usize,
        /// The largest value accepted.
        limit: usize,
    },
    /// An argument has a value the kernel cannot accept.
    #[error("invalid value `{value}` for {name}: {reason}")]
    InvalidValue {
        /// Argument name.
        name: &'static str,
        /// The value given, formatted.
        value: String,
        /// Why it is rejected and what to pass instead.
        reason: &'static str,
    },
    /// A pointer is not aligned as a vectorized kernel requires.
    #[error("`{arg}` at device address {address:#x} is not {required}-byte aligned: {reason}")]
    Misaligned {
        /// Argument name.
        arg: &'static str,
        /// The device address.
        address: u64,
        /// Alignment required, in bytes.
        required: u64,
        /// What to do.
        reason: &'static str,
    },
    /// A launch's arguments do not match the kernel's declared signature, or a
    /// PTX entry does not match its declaration.
    #[error("kernel `{kernel}`: {reason}")]
    SignatureMismatch {
        /// Kernel (entry) name.
        kernel: String,
        /// What differs.
        reason: String,
    },
    /// No kernel of that name is declared for the module.
    #[error("module `{module}` declares no kernel named `{kernel}`: see the module's KERNELS table for the names")]
    UnknownKernel {
        /// PTX module name.
        module: &'static str,
        /// Requested kernel name.
        kernel: String,
    },
    /// The PTX text could not be parsed for its entry list.
    #[error("cannot parse PTX `{file}` at line {line}: {reason}")]
    PtxParse {
        /// File name (or `"<text>"`).
        file: String,
        /// 1-based line.
        line: usize,
        /// What was wrong.
        reason: String,
    },
    /// A call into the CUDA driver failed.
    #[cfg(feature = "cuda")]
    #[error("CUDA driver error while {during}: {source:?} (is an NVIDIA driver installed and a GPU visible? check nvidia-smi and CUDA_VISIBLE_DEVICES)")]
    Driver {
        /// What was being done.
        during: &'static str,
        /// The driver's error.
        #[source]
        source: cust::error::CudaError,
    },
    /// The device had no room for an allocation.
    #[cfg(feature = "cuda")]
    #[error("out of device memory: allocating {bytes} bytes failed while this process held {held} bytes ({free} of the device's {total} bytes free): use a smaller batch size or model, or fewer processes on this GPU")]
    OutOfMemory {
        /// Bytes asked for.
        bytes: usize,
        /// Bytes this process's allocations held at the time.
        held: u64,
        /// Free device memory as the driver reported it after the failure (0: unknown).
        free: usize,
        /// The device's memory (0: unknown).
        total: usize,
    },
    /// A direct driver call failed (memory, copies, launches).
    #[cfg(feature = "cuda")]
    #[error("CUDA driver error while {during}: {name} (code {code}); an earlier asynchronous launch may have failed: rerun with CUDA_LAUNCH_BLOCKING=1 to find it")]
    DriverCall {
        /// What was being done.
        during: &'static str,
        /// The CUresult code.
        code: u32,
        /// The driver's name for the code.
        name: String,
    },
}

/// The crate's result type.
pub type Result<T> = core::result::Result<T, Error>;

#[cfg(feature = "cuda")]
/// Checks that a slice has exactly `expected` elements.
pub(crate) fn check_len(arg: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            arg,
            expected,
            actual,
        })
    }
}

#[cfg(feature = "cuda")]
/// Converts a size to the kernels' `u32`, or says it is too large.
pub(crate) fn to_u32(arg: &'static str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| Error::TooLarge {
        arg,
        value,
        limit: u32::MAX as usize,
    })
}

#[cfg(feature = "cuda")]
/// `a * b` as a size that the kernels can index, or an error naming `arg`.
pub(crate) fn checked_elements(arg: &'static str, a: usize, b: usize) -> Result<usize> {
    let limit = u32::MAX as usize;
    match a.checked_mul(b) {
        Some(v) if v <= limit => Ok(v),
        Some(v) => Err(Error::TooLarge {
            arg,
            value: v,
            limit,
        }),
        None => Err(Error::TooLarge {
            arg,
            value: usize::MAX,
            limit,
        }),
    }
}

/// The largest element count or index span the kernels address (they index with signed
/// 32-bit arithmetic): a longer buffer, or a matrix operand spanning more, is refused
/// with [`Error::TooLarge`].
pub const KERNEL_INDEX_LIMIT: usize = i32::MAX as usize;

#[cfg(feature = "cuda")]
/// `n` as the kernels' `u32` element count, or an error naming `arg` when it is above
/// `i32::MAX`.
pub(crate) fn kernel_count(arg: &'static str, n: usize) -> Result<u32> {
    if n > KERNEL_INDEX_LIMIT {
        return Err(Error::TooLarge {
            arg,
            value: n,
            limit: KERNEL_INDEX_LIMIT,
        });
    }
    Ok(n as u32)
}

#[cfg(feature = "cuda")]
/// `a * b` when it is at most `i32::MAX`, or an error naming `arg`.
pub(crate) fn kernel_product(arg: &'static str, a: usize, b: usize) -> Result<usize> {
    match a.checked_mul(b) {
        Some(v) if v <= KERNEL_INDEX_LIMIT => Ok(v),
        other => Err(Error::TooLarge {
            arg,
            value: other.unwrap_or(usize::MAX),
            limit: KERNEL_INDEX_LIMIT,
        }),
    }
}
