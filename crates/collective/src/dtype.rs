//! Element types the collectives move and reduce, and type-erased tensors.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};
use ringtrain_kernels::ReduceElement;

use crate::error::{Error, Result};

/// The element type of a tensor, as named on the wire and in error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// IEEE half precision (`half::f16`).
    F16,
    /// bfloat16 (`half::bf16`).
    BF16,
}

impl DType {
    /// All element types, in wire-code order.
    pub const ALL: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// Lower-case name: `f32`, `f64`, `f16`, `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::F16 => 2,
            DType::BF16 => 3,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" | "float" => Ok(DType::F32),
            "f64" | "float64" | "double" => Ok(DType::F64),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => Err(Error::invalid("dtype", s, "use one of f32, f64, f16, bf16")),
        }
    }
}

/// An element type the collectives can reduce: the kernels' [`ReduceElement`] plus a
/// plain-bytes view ([`bytemuck::Pod`]) for the wire.
pub trait Element: ReduceElement + bytemuck::Pod {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Wraps a vector of this type as a [`Tensor`].
    fn into_tensor(v: Vec<Self>) -> Tensor;
    /// Takes the vector back out of a [`Tensor`] of this type.
    fn from_tensor(t: Tensor) -> std::result::Result<Vec<Self>, Tensor>;
    /// Borrows a mutable slice as a [`TensorMut`].
    fn tensor_mut(s: &mut [Self]) -> TensorMut<'_>;
    /// Borrows the elements of a [`Tensor`] of this type; `None` for another type.
    fn elements_mut(t: &mut Tensor) -> Option<&mut [Self]>;
}

macro_rules! element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            fn into_tensor(v: Vec<Self>) -> Tensor {
                Tensor::$variant(v)
            }
            fn from_tensor(t: Tensor) -> std::result::Result<Vec<Self>, Tensor> {
                match t {
                    Tensor::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
            fn tensor_mut(s: &mut [Self]) -> TensorMut<'_> {
                TensorMut::$variant(s)
            }
            fn elements_mut(t: &mut Tensor) -> Option<&mut [Self]> {
                match t {
                    Tensor::$variant(v) => Some(v),
                    _ => None,
                }
            }
        }
        impl From<Vec<$t>> for Tensor {
            fn from(v: Vec<$t>) -> Tensor {
                Tensor::$variant(v)
            }
        }
        impl<'a> From<&'a mut [$t]> for TensorMut<'a> {
            fn from(s: &'a mut [$t]) -> TensorMut<'a> {
                TensorMut::$variant(s)
            }
        }
    };
}

/// An owned tensor of any supported element type (what the fusion engine takes and gives back).
#[derive(Clone, Debug, PartialEq)]
pub enum Tensor {
    /// f32 elements.
    F32(Vec<f32>),
    /// f64 elements.
    F64(Vec<f64>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    BF16(Vec<bf16>),
}

/// A borrowed, mutable tensor of any supported element type.
#[derive(Debug)]
pub enum TensorMut<'a> {
    /// f32 elements.
    F32(&'a mut [f32]),
    /// f64 elements.
    F64(&'a mut [f64]),
    /// f16 elements.
    F16(&'a mut [f16]),
    /// bf16 elements.
    BF16(&'a mut [bf16]),
}

element!(f32, F32);
element!(f64, F64);
element!(f16, F16);
element!(bf16, BF16);

impl Tensor {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::F32(_) => DType::F32,
            Tensor::F64(_) => DType::F64,
            Tensor::F16(_) => DType::F16,
            Tensor::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Tensor::F32(v) => v.len(),
            Tensor::F64(v) => v.len(),
            Tensor::F16(v) => v.len(),
            Tensor::BF16(v) => v.len(),
        }
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    /// A zero-filled tensor of the given type and length.
    pub fn zeros(dtype: DType, len: usize) -> Tensor {
        match dtype {
            DType::F32 => Tensor::F32(vec![0.0; len]),
            DType::F64 => Tensor::F64(vec![0.0; len]),
            DType::F16 => Tensor::F16(vec![f16::ZERO; len]),
            DType::BF16 => Tensor::BF16(vec![bf16::ZERO; len]),
        }
    }

    /// Takes the elements out as `Vec<T>`; an error names both types when they differ.
    pub fn into_vec<T: Element>(self) -> Result<Vec<T>> {
        let dtype = self.dtype();
        T::from_tensor(self).map_err(|_| {
            Error::invalid(
                "tensor element type",
                dtype,
                "ask for the element type the tensor was submitted with",
            )
        })
    }

    /// Borrows the tensor mutably.
    pub fn as_tensor_mut(&mut self) -> TensorMut<'_> {
        match self {
            Tensor::F32(v) => TensorMut::F32(v),
            Tensor::F64(v) => TensorMut::F64(v),
            Tensor::F16(v) => TensorMut::F16(v),
            Tensor::BF16(v) => TensorMut::BF16(v),
        }
    }

    /// The elements as raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Tensor::F32(v) => bytemuck::cast_slice(v),
            Tensor::F64(v) => bytemuck::cast_slice(v),
            Tensor::F16(v) => bytemuck::cast_slice(v),
            Tensor::BF16(v) => bytemuck::cast_slice(v),
        }
    }

    /// The elements as raw mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Tensor::F32(v) => bytemuck::cast_slice_mut(v),
            Tensor::F64(v) => bytemuck::cast_slice_mut(v),
            Tensor::F16(v) => bytemuck::cast_slice_mut(v),
            Tensor::BF16(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

impl TensorMut<'_> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorMut::F32(_) => DType::F32,
            TensorMut::F64(_) => DType::F64,
            TensorMut::F16(_) => DType::F16,
            TensorMut::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorMut::F32(v) => v.len(),
            TensorMut::F64(v) => v.len(),
            TensorMut::F16(v) => v.len(),
            TensorMut::BF16(v) => v.len(),
        }
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            TensorMut::F32(v) => bytemuck::cast_slice(v),
            TensorMut::F64(v) => bytemuck::cast_slice(v),
            TensorMut::F16(v) => bytemuck::cast_slice(v),
            TensorMut::BF16(v) => bytemuck::cast_slice(v),
        }
    }

    /// The elements as raw mutable bytes.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            TensorMut::F32(v) => bytemuck::cast_slice_mut(v),
            TensorMut::F64(v) => bytemuck::cast_slice_mut(v),
            TensorMut::F16(v) => bytemuck::cast_slice_mut(v),
            TensorMut::BF16(v) => bytemuck::cast_slice_mut(v),
        }
    }
}
