//! The crate's one error type and the length checks every kernel runs first.

/// What a kernel rejected. Every kernel validates all of its arguments before it writes
/// anything, so an `Err` leaves every output buffer untouched.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum Error {
    /// A slice does not have the length the shape arguments imply.
    #[error(
        "`{arg}` has {actual} elements, expected {expected}: check the batch/hidden/rows/vocab you passed"
    )]
    ShapeMismatch {
        /// Name of the offending argument, as written in the kernel's signature.
        arg: &'static str,
        /// Length implied by the shape arguments.
        expected: usize,
        /// Length of the slice that was passed.
        actual: usize,
    },
    /// A label of a row with a non-zero mask is not a valid class index.
    #[error(
        "label {label} in row {row} is out of range for vocab {vocab}: labels must be below the vocab size, or give the row mask 0.0"
    )]
    LabelOutOfRange {
        /// Row whose label is out of range.
        row: usize,
        /// The offending label.
        label: u32,
        /// Number of classes (columns of the logits).
        vocab: usize,
    },
    /// A scalar argument is outside the range the kernel accepts.
    #[error("invalid value `{value}` for {name}: {reason}")]
    InvalidValue {
        /// Name of the offending argument, as written in the kernel's signature.
        name: &'static str,
        /// The value that was passed.
        value: Value,
        /// What is wrong and what to pass instead.
        reason: &'static str,
    },
}

/// A scalar argument's value as [`Error::InvalidValue`] reports it (no allocation: the
/// crate is `no_std`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    /// A count or index.
    Count(usize),
    /// A real number.
    Real(f32),
    /// A switch.
    Flag(bool),
}

impl core::fmt::Display for Value {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Value::Count(n) => write!(f, "{n}"),
            Value::Real(x) => write!(f, "{x}"),
            Value::Flag(b) => write!(f, "{b}"),
        }
    }
}

/// `core::result::Result` with this crate's [`Error`].
pub type Result<T> = core::result::Result<T, Error>;

/// `Err(ShapeMismatch)` naming `arg` unless `actual == expected`.
#[inline]
pub(crate) fn check_len(arg: &'static str, actual: usize, expected: usize) -> Result<()> {
    if actual == expected {
        Ok(())
    } else {
        Err(Error::ShapeMismatch {
            arg,
            expected,
            actual,
        })
    }
}

/// `a * b`, or `Err(InvalidValue)` naming `arg` (with `a`) when the product overflows
/// `usize`.
#[inline]
pub(crate) fn checked_product(arg: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b).ok_or(Error::InvalidValue {
        name: arg,
        value: Value::Count(a),
        reason: "the buffer size it implies overflows usize; pass the real shape",
    })
}
