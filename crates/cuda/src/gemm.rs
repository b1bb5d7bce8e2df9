//! Matrix products (`ptx/gemm.ptx`): `C = alpha * op(A) · op(B) + beta * C`.
//!
//! All matrices are row-major; C is always f32 `[m, n]` with row stride `ldc`.
//! [`Transpose`] picks how A and B are stored:
//! * `NN`: A `[m, k]` (`lda >= k`), B `[k, n]` (`ldb >= n`)
//! * `NT`: A `[m, k]` (`lda >= k`), B `[n, k]` (`ldb >= k`): A·Bᵀ
//! * `TN`: A `[k, m]` (`lda >= m`), B `[k, n]` (`ldb >= n`): Aᵀ·B
//!
//! f32 uses SIMT kernels (64x64 tiles); f16 and bf16 use tensor cores
//! (`mma.sync` m16n8k16, f32 accumulate, 128x128 tiles) and need `lda` and
//! `ldb` to be multiples of 8 and A and B to start 16-byte aligned. When
//! `beta == 0`, C is not read (it may hold NaN).

use crate::signature::{KernelSignature, Param::*, PtxModule};

/// The PTX text of `ptx/gemm.ptx`.
pub const PTX: &str = include_str!("../../../ptx/gemm.ptx");

const GEMM: &[crate::signature::Param] = &[Ptr, Ptr, Ptr, U32, U32, U32, U32, U32, U32, F32, F32];

/// Every entry of `ptx/gemm.ptx`.
pub const KERNELS: &[KernelSignature] = &[
    KernelSignature {
        name: "gemm_f32_nn",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_f32_nt",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_f32_tn",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_f16_nn",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_f16_nt",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_f16_tn",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_bf16_nn",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_bf16_nt",
        params: GEMM,
    },
    KernelSignature {
        name: "gemm_bf16_tn",
        params: GEMM,
    },
];

/// `ptx/gemm.ptx` with its declarations.
pub const MODULE: PtxModule = PtxModule {
    name: "gemm",
    file: "ptx/gemm.ptx",
    text: PTX,
    kernels: KERNELS,
};

/// How A and B are stored (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transpose {
    /// A `[m, k]`, B `[k, n]`.
    NN,
    /// A `[m, k]`, B `[n, k]`: A·Bᵀ.
    NT,
    /// A `[k, m]`, B `[k, n]`: Aᵀ·B.
    TN,
}

impl Transpose {
    /// The entry-name suffix (`"nn"`, `"nt"`, `"tn"`).
    pub fn suffix(self) -> &'static str {
        match self {
            Transpose::NN => "nn",
            Transpose::NT => "nt",
            Transpose::TN => "tn",
        }
    }

    /// Stored (rows, cols) of A and of B for an m x n x k product.
    pub fn stored_shapes(self, m: usize, n: usize, k: usize) -> ((usize, usize), (usize, usize)) {
        match self {
            Transpose::NN => ((m, k), (k, n)),
            Transpose::NT => ((m, k), (n, k)),
            Transpose::TN => ((k, m), (k, n)),
        }
    }
}

#[cfg(feature = "cuda")]
pub use launchers::*;

#[cfg(feature = "cuda")]
mod launchers {
    use half::{bf16, f16};

    use super::{Transpose, MODULE};
    use crate::error::{Error, Result};
    use crate::memory::{AsDevSlice, AsDevSliceMut, Element};
    use crate::runtime::{Gpu, KernelArg, LaunchConfig};

    /// The shape of one product, with leading dimensions.
    #[derive(Clone, Copy)]
    struct Problem {
        m: usize,
        n: usize,
        k: usize,
        lda: usize,
        ldb: usize,
        ldc: usize,
    }

    /// Elements a stored `[rows, cols]` matrix with row stride `ld` spans.
    fn span(rows: usize, cols: usize, ld: usize) -> Option<usize> {
        if rows == 0 || cols == 0 {
            Some(0)
        } else {
            (rows - 1).checked_mul(ld)?.checked_add(cols)
        }
    }

    fn check_matrix(
        arg: &'static str,
        ld_arg: &'static str,
        (rows, cols): (usize, usize),
        ld: usize,
        len: usize,
    ) -> Result<()> {
        if ld < cols {
            return Err(Error::InvalidValue {
                name: ld_arg,
                value: ld.to_string(),
                reason: "the leading dimension must be at least the stored row length (k or m or n, see the Transpose docs)",
            });
        }
        let limit = crate::KERNEL_INDEX_LIMIT;
        let needed = span(rows, cols, ld).ok_or(Error::TooLarge {
            arg,
            value: usize::MAX,
            limit,
        })?;
        if needed > limit || ld > limit {
            return Err(Error::TooLarge {
                arg,
                value: needed.max(ld),
                limit,
            });
        }
        if len < needed {
            return Err(Error::TooShort {
                arg,
                needed,
                actual: len,
            });
        }
        Ok(())
    }

    fn launch_gemm<T: Element>(
        gpu: &Gpu,
        dtype: &'static str,
        tile: usize,
        transpose: Transpose,
        a: &impl AsDevSlice<T>,
        b: &impl AsDevSlice<T>,
        c: &mut impl AsDevSliceMut<f32>,
        p: Problem,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let (a, b, c) = (a.dev_slice(), b.dev_slice(), c.dev_slice_mut());
        let (a_shape, b_shape) = transpose.stored_shapes(p.m, p.n, p.k);
        check_matrix("a", "lda", a_shape, p.lda, a.len())?;
        check_matrix("b", "ldb", b_shape, p.ldb, b.len())?;
        check_matrix("c", "ldc", (p.m, p.n), p.ldc, c.len())?;
        if p.m == 0 || p.n == 0 {
            return Ok(());
        }
        if tile == 128 {
            for (arg, ld) in [("lda", p.lda), ("ldb", p.ldb)] {
                if ld % 8 != 0 {
                    return Err(Error::InvalidValue {
                        name: arg,
                        value: ld.to_string(),
                        reason: "the f16/bf16 tensor-core GEMM loads rows in 16-byte chunks: pad the leading dimension to a multiple of 8",
                    });
                }
            }
            for (arg, address) in [("a", a.device_ptr()), ("b", b.device_ptr())] {
                if address % 16 != 0 {
                    return Err(Error::Misaligned {
                        arg,
                        address,
                        required: 16,
                        reason: "start the view at an element offset that is a multiple of 8",
                    });
                }
            }
        }
        let grid_y = p.m.div_ceil(tile);
        if grid_y > 65_535 {
            return Err(Error::TooLarge {
                arg: "m",
                value: p.m,
                limit: 65_535 * tile,
            });
        }
        let config = LaunchConfig {
            grid: (p.n.div_ceil(tile) as u32, grid_y as u32, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        let args = [
            gpu.arg("a", &a)?,
            gpu.arg("b", &b)?,
            gpu.arg_mut("c", &c)?,
            KernelArg::U32(p.m as u32),
            KernelArg::U32(p.n as u32),
            KernelArg::U32(p.k as u32),
            KernelArg::U32(p.lda as u32),
            KernelArg::U32(p.ldb as u32),
            KernelArg::U32(p.ldc as u32),
            KernelArg::F32(alpha),
            KernelArg::F32(beta),
        ];
        let kernel = match (dtype, transpose) {
            ("f32", Transpose::NN) => "gemm_f32_nn",
            ("f32", Transpose::NT) => "gemm_f32_nt",
            ("f32", Transpose::TN) => "gemm_f32_tn",
            ("f16", Transpose::NN) => "gemm_f16_nn",
            ("f16", Transpose::NT) => "gemm_f16_nt",
            ("f16", Transpose::TN) => "gemm_f16_tn",
            ("bf16", Transpose::NN) => "gemm_bf16_nn",
            ("bf16", Transpose::NT) => "gemm_bf16_nt",
            _ => "gemm_bf16_tn",
        };
        // SAFETY: a, b and c are live views on this GPU whose lengths cover
        // every element the product addresses (checked above with the leading
        // dimensions); c is the only written buffer and is borrowed mutably.
        unsafe { gpu.launch(&MODULE, kernel, config, &args) }
    }

    /// f32 product on SIMT cores: `C = alpha * op(A)·op(B) + beta * C`.
    pub fn gemm_f32(
        gpu: &Gpu,
        transpose: Transpose,
        a: &impl AsDevSlice<f32>,
        b: &impl AsDevSlice<f32>,
        c: &mut impl AsDevSliceMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        lda: usize,
        ldb: usize,
        ldc: usize,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let p = Problem {
            m,
            n,
            k,
            lda,
            ldb,
            ldc,
        };
        launch_gemm(gpu, "f32", 64, transpose, a, b, c, p, alpha, beta)
    }

    /// f16 inputs, f32 accumulate and output, on tensor cores.
    pub fn gemm_f16(
        gpu: &Gpu,
        transpose: Transpose,
        a: &impl AsDevSlice<f16>,
        b: &impl AsDevSlice<f16>,
        c: &mut impl AsDevSliceMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        lda: usize,
        ldb: usize,
        ldc: usize,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let p = Problem {
            m,
            n,
            k,
            lda,
            ldb,
            ldc,
        };
        launch_gemm(gpu, "f16", 128, transpose, a, b, c, p, alpha, beta)
    }

    /// bf16 inputs, f32 accumulate and output, on tensor cores.
    pub fn gemm_bf16(
        gpu: &Gpu,
        transpose: Transpose,
        a: &impl AsDevSlice<bf16>,
        b: &impl AsDevSlice<bf16>,
        c: &mut impl AsDevSliceMut<f32>,
        m: usize,
        n: usize,
        k: usize,
        lda: usize,
        ldb: usize,
        ldc: usize,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        let p = Problem {
            m,
            n,
            k,
            lda,
            ldb,
            ldc,
        };
        launch_gemm(gpu, "bf16", 128, transpose, a, b, c, p, alpha, beta)
    }
}
