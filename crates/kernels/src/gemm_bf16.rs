//! Matrix products of bf16 operands with f32 accumulation: `C = A·B` or `C += A·B`, with
//! A `[m, k]` and B `[k, n]` in any strides (so every layout a backend uses, NN, NT and
//! TN, is a view of the stored matrix) and C row-major `[m, n]` with row stride `ldc`.
//!
//! ```
//! use ringtrain_kernels::gemm_bf16::{gemm_bf16, Bf16Path, MatRef};
//! use ringtrain_kernels::bf16;
//!
//! // A [2, 3] row-major, B [2, 3] row-major used transposed (NT): C = A·Bᵀ, [2, 2].
//! let a: Vec<bf16> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].iter().map(|&x| bf16::from_f32(x)).collect();
//! let b = a.clone();
//! let mut c = vec![0.0f32; 4];
//! let path = Bf16Path::detect();
//! gemm_bf16(path, MatRef::row_major(&a, 2, 3)?, MatRef::row_major(&b, 2, 3)?.t(), &mut c, 2, false)?;
//! assert_eq!(c, [14.0, 32.0, 32.0, 77.0]);
//! # Ok::<(), ringtrain_kernels::Error>(())
//! ```
//!
//! # Paths
//!
//! [`Bf16Path::detect`] picks the fastest path the CPU has, at run time (once per
//! process), in this order, except that on a CPU with both AVX-512 paths it times their
//! micro-kernels on one block and takes `avx512-fma` where that is clearly faster
//! ([`KernelTimes`]):
//! - [`Bf16Path::Amx`]: AMX-BF16 tile registers, `TDPBF16PS` (a 16 × 16 block of f32 from
//!   16 rows of A times 16 columns of B, 32 bf16 deep, in one instruction). CPUs with
//!   AMX-BF16 and AMX-TILE: Intel Sapphire Rapids (4th generation Xeon Scalable) and later
//!   Xeons (Emerald Rapids, Granite Rapids). It is used on Linux only, where the process
//!   must ask the kernel for the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, Linux 5.16
//!   and later); when the kernel refuses, the next path is taken.
//! - [`Bf16Path::Avx512Bf16`]: `VDPBF16PS`, which multiplies pairs of bf16 and adds both
//!   products to an f32 lane. CPUs with AVX-512 BF16 where it is the faster of the two
//!   AVX-512 paths: AMD Zen 4 and Zen 5 (`VDPBF16PS` does twice the work of an f32
//!   multiply-add there, at the same rate).
//! - [`Bf16Path::Avx512Fma`]: f32 fused multiply-adds on 512-bit vectors, of A widened to
//!   f32 in its pack and B's words widened in registers (a shift or a mask per word of
//!   two bf16, once for all the rows of a block), in the AVX-512 BF16 kernel's blocks.
//!   CPUs with AVX-512 F but no bf16 instruction (Intel Skylake-SP, Cascade Lake and Ice
//!   Lake Xeons, Intel's client CPUs with AVX-512), and Intel Xeons with AVX-512 BF16
//!   whose AMX cannot be used (Sapphire Rapids and later under a hypervisor that hides
//!   AMX): on an Emerald Rapids core, loops of independent instructions on registers
//!   measured 0.75 ns per 512-bit `VDPBF16PS` against 0.18 ns per f32 multiply-add, so
//!   the bf16 instruction, with twice the work, has half the multiply-adds' rate.
//! - [`Bf16Path::Avx2Fma`]: the same on 256-bit vectors. CPUs with AVX2 and FMA but
//!   neither AVX-512 nor a bf16 instruction: Intel Haswell to Comet Lake, AMD Zen 1 to
//!   Zen 3.
//!
//!   The two FMA paths have no bf16 arithmetic to gain from, so they run at about the
//!   speed of an f32 product (a smaller B pack is all bf16 saves there), but not at the
//!   portable path's speed, which is several times slower. A product of two bf16 is exact
//!   in f32, so each fused multiply-add rounds exactly where the portable path's add does:
//!   they give the portable path's bits whenever no product is subnormal or overflows.
//! - [`Bf16Path::Portable`]: every other CPU (and `no_std` builds, which cannot ask the
//!   CPU). It gives the same bits as the f32 product of the operands widened to f32, each
//!   element accumulated in order of `k` with one rounding per multiply and per add.
//!
//! Every path can also be named (tests and benchmarks run each one the CPU has:
//! [`Bf16Path::runnable`]), and [`gemm_bf16_modelled`] runs a path with its instructions
//! modelled in software, on any CPU, through the same driver, packing and tile walking,
//! which is how the packing of the AVX-512 and AMX paths is tested on CPUs without them.
//!
//! # Accuracy
//!
//! The operands are exact bf16 values; products of two bf16 are exact in f32, so the
//! only rounding is the f32 accumulation: every path is within `k · 2⁻²⁴ · Σ|a·b|` of the
//! exact (f64) product of the same operands, which the tests check. `VDPBF16PS` adds the
//! two products of a pair to the lane one after the other, treats subnormal inputs as
//! zero and flushes subnormal results to zero, so it differs from the portable path in
//! the last bits.
//!
//! # Blocking
//!
//! Every path shares one driver (the classic Goto layout): B is packed into panels of
//! [`NR`] columns times [`KC`] rows, as pairs of consecutive `k` in one 32-bit word, A into
//! panels of [`MR`] rows ([`AVX2_MR`] on the AVX2 path, [`AMX_MR`] on AMX), and a
//! micro-kernel keeps an `MR × NR` block of C in registers
//! while it walks `k`, reading and writing C in place (a block at an edge of C goes
//! through a small buffer, and the first block of `k` of a product that does not
//! accumulate starts from zero instead of reading C). Edges are zero-padded in the packs,
//! so any shape works, including 1 and sizes that are not multiples of the block. A
//! matrix that is B to many products (a recurrent weight) can be packed once,
//! [`PackedB`], and multiplied with [`gemm_bf16_packed`].
//!
//! The vector kernels' A panels hold each row whole (pairs `0..pairs` of row 0, then of
//! row 1, ...), so a row-major A packs by copying rows. The AMX micro-kernel computes an
//! [`AMX_MR`] × [`NR`] block of C (2 × 2 tiles of 16 × 16 f32) and walks `k` in steps of
//! [`AMX_PAIRS`] pairs (32 bf16, one tile row). Its B panels are the same pack,
//! zero-padded to a multiple of [`AMX_PAIRS`] pairs; a B tile (16 pairs × 16 columns, the
//! layout `TDPBF16PS` calls VNNI) is 16 rows of that panel read with its row stride. Its A
//! panels hold, for each step, the 32 rows one after the other, each 16 pairs long: an A
//! tile is 16 rows of that, read with a stride of one row; a C tile is 16 rows of C read
//! with C's row stride.
//!
//! The rayon twins (`par::gemm_bf16`, `par::gemm_bf16_packed`) give each thread a
//! rectangle of C: rows when C has more row blocks than column panels (B is then packed
//! once, its panels shared out among the threads, and read by all), else columns (one
//! time step of a recurrence, 64 rows), each task packing the columns it reads.

use alloc::vec;
use alloc::vec::Vec;

use half::bf16;
use half::slice::HalfFloatSliceExt;

use crate::error::{Error, Result, Value};
use crate::wide::wide_twin;

/// Rows of C the portable and AVX-512 micro-kernels compute at once.
pub const MR: usize = 8;
/// Rows of C the AMX micro-kernel computes at once (two tiles of 16 rows).
pub const AMX_MR: usize = 32;
/// Rows of C the AVX2 micro-kernel computes at once: 4 rows × 16 columns of sums (8
/// vectors of 8 f32) and the widened B pair row (4 vectors) fit its 16 vector registers.
pub const AVX2_MR: usize = 4;
/// k-pairs per step of the AMX micro-kernel (one tile row of 64 bytes).
pub const AMX_PAIRS: usize = 16;
/// Columns of C a micro-kernel computes at once (two 16-lane f32 vectors).
pub const NR: usize = 32;
/// `k` per packed block (a multiple of 2: k is packed in pairs).
pub const KC: usize = 256;
/// Rows of A per packed block (a multiple of [`MR`]).
pub const MC: usize = 128;
/// Columns of B per packed block (a multiple of [`NR`]).
pub const NC: usize = 2048;

// The packs are sized for MC × KC / 2 and NC × KC / 2 words: the padding to AMX steps
// must not grow them, and A panels must tile MC exactly.
const _: () = assert!(
    (KC / 2).is_multiple_of(AMX_PAIRS)
        && MC.is_multiple_of(AMX_MR)
        && MC.is_multiple_of(MR)
        && MC.is_multiple_of(AVX2_MR)
);

/// A read-only strided view of a bf16 matrix: element `(r, c)` is
/// `data[r * row_stride + c * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    data: &'a [bf16],
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> MatRef<'a> {
    /// A row-major `[rows, cols]` matrix stored in the first `rows * cols` elements.
    pub fn row_major(data: &'a [bf16], rows: usize, cols: usize) -> Result<Self> {
        Self::strided(data, rows, cols, cols, 1)
    }

    /// A `[rows, cols]` view with the given strides (checked against `data`'s length).
    pub fn strided(
        data: &'a [bf16],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self> {
        let span = if rows == 0 || cols == 0 {
            0
        } else {
            (rows - 1) * row_stride + (cols - 1) * col_stride + 1
        };
        if data.len() < span {
            return Err(Error::ShapeMismatch {
                arg: "data",
                expected: span,
                actual: data.len(),
            });
        }
        Ok(MatRef {
            data,
            rows,
            cols,
            row_stride,
            col_stride,
        })
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Columns `start..end` of the view (`end` clamped to the columns).
    pub fn col_range(self, start: usize, end: usize) -> Self {
        self.t().row_range(start, end).t()
    }

    /// Rows `start..end` of the view (`end` clamped to the rows).
    pub fn row_range(self, start: usize, end: usize) -> Self {
        let end = end.min(self.rows);
        let start = start.min(end);
        MatRef {
            data: if start == end {
                &[]
            } else {
                &self.data[start * self.row_stride..]
            },
            rows: end - start,
            ..self
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    #[cfg(test)]
    fn bits(&self, r: usize, c: usize) -> u32 {
        u32::from(self.data[r * self.row_stride + c * self.col_stride].to_bits())
    }
}

/// Which kernel computes the product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Path {
    /// Plain f32 arithmetic on the widened operands (every CPU).
    Portable,
    /// f32 fused multiply-adds of the operands widened in registers, on 256-bit vectors
    /// (AVX2 and FMA).
    Avx2Fma,
    /// The same on 512-bit vectors (AVX-512 F).
    Avx512Fma,
    /// `VDPBF16PS` on 512-bit vectors (AVX-512 F and BF16).
    Avx512Bf16,
    /// `TDPBF16PS` on AMX tile registers (AMX-TILE and AMX-BF16, on Linux).
    Amx,
}

/// What [`Bf16Path::detect`] measured on a CPU with both AVX-512 paths (and no AMX) to
/// choose between them: each path's micro-kernel on the same L1-resident block
/// ([`MR`] × [`NR`] of C, [`KC`] deep), the best of several timings taken in turns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KernelTimes {
    /// Nanoseconds per block on the `avx512-bf16` path (`VDPBF16PS`).
    pub avx512_bf16_ns: f64,
    /// Nanoseconds per block on the `avx512-fma` path (f32 multiply-adds of the widened
    /// operands).
    pub avx512_fma_ns: f64,
}

impl KernelTimes {
    /// How much faster the `avx512-fma` kernel must be to be chosen: a CPU where the two
    /// are close keeps `VDPBF16PS`, so that timing noise cannot move the choice (and the
    /// last bits of the products) from one run to the next.
    pub const FMA_MARGIN: f64 = 0.9;

    /// The path these times choose: `avx512-fma` where its kernel took at most
    /// [`KernelTimes::FMA_MARGIN`] of the `avx512-bf16` kernel's time, else `avx512-bf16`.
    pub fn choice(&self) -> Bf16Path {
        if self.avx512_fma_ns <= Self::FMA_MARGIN * self.avx512_bf16_ns {
            Bf16Path::Avx512Fma
        } else {
            Bf16Path::Avx512Bf16
        }
    }
}

impl Bf16Path {
    /// The fastest path this CPU has (the portable one without `std`, which cannot ask),
    /// chosen once per process (see the module docs for the order, and
    /// [`Bf16Path::avx512_times`] for the one choice made by timing).
    pub fn detect() -> Self {
        #[cfg(feature = "std")]
        {
            static DETECTED: std::sync::OnceLock<Bf16Path> = std::sync::OnceLock::new();
            *DETECTED.get_or_init(Bf16Path::choose)
        }
        #[cfg(not(feature = "std"))]
        Bf16Path::choose()
    }

    /// The kernel times that chose between `avx512-bf16` and `avx512-fma` on this CPU
    /// (measured once per process, about a millisecond), or `None` where the CPU does not
    /// have both paths or has AMX, which is taken first.
    pub fn avx512_times() -> Option<KernelTimes> {
        if Bf16Path::Amx.available() || !Bf16Path::Avx512Bf16.available() {
            return None;
        }
        avx512::times()
    }

    fn choose() -> Self {
        if Bf16Path::Amx.available() {
            Bf16Path::Amx
        } else if Bf16Path::Avx512Bf16.available() {
            Bf16Path::avx512_times().map_or(Bf16Path::Avx512Bf16, |t| t.choice())
        } else if Bf16Path::Avx512Fma.available() {
            Bf16Path::Avx512Fma
        } else if Bf16Path::Avx2Fma.available() {
            Bf16Path::Avx2Fma
        } else {
            Bf16Path::Portable
        }
    }

    /// Every path this CPU can run, the portable one first.
    pub fn runnable() -> Vec<Bf16Path> {
        Bf16Path::ALL
            .into_iter()
            .filter(|p| p.available())
            .collect()
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Bf16Path::Portable => true,
            Bf16Path::Avx2Fma => avx2::available(),
            Bf16Path::Avx512Fma => avx512::fma_available(),
            Bf16Path::Avx512Bf16 => avx512::available(),
            Bf16Path::Amx => amx::available(),
        }
    }

    /// Why the path cannot run here (`None` when it can), for reports and skipped tests.
    pub fn unavailable_reason(self) -> Option<&'static str> {
        (!self.available()).then_some(match self {
            Bf16Path::Portable => "",
            Bf16Path::Avx2Fma => avx2::MISSING,
            Bf16Path::Avx512Fma => avx512::MISSING_F,
            Bf16Path::Avx512Bf16 => avx512::MISSING,
            Bf16Path::Amx => amx::missing(),
        })
    }

    /// The name (`portable`, `avx2-fma`, `avx512-fma`, `avx512-bf16`, `amx-bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Portable => "portable",
            Bf16Path::Avx2Fma => "avx2-fma",
            Bf16Path::Avx512Fma => "avx512-fma",
            Bf16Path::Avx512Bf16 => "avx512-bf16",
            Bf16Path::Amx => "amx-bf16",
        }
    }

    /// Every path, the portable one first, then from the slowest to the fastest.
    pub const ALL: [Bf16Path; 5] = [
        Bf16Path::Portable,
        Bf16Path::Avx2Fma,
        Bf16Path::Avx512Fma,
        Bf16Path::Avx512Bf16,
        Bf16Path::Amx,
    ];
}

/// A micro-kernel: `pairs` k-pairs (a multiple of its [`Kernel::step`]) of an A panel
/// (`rows` rows of `pairs` pairs, each one word or, for a kernel with `a_width` 2, two
/// widened ones; row `i` at `a + i * lda`: a packed panel, or a row-major A read in place)
/// and a packed B panel (`pairs * NR` words), accumulated into the `rows × NR` block of C
/// at `c` with row stride `ldc` floats; with `zero` the block's old values are not read
/// and the sums start at +0.0 (the same bits as a block of zeros).
type MicroKernel = unsafe fn(
    pairs: usize,
    a: *const u32,
    lda: usize,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    zero: bool,
);

/// What runs on the driver's thread before the first micro-kernel call of a product, and
/// after the last.
type Session = (unsafe fn(), unsafe fn());

/// A micro-kernel and the shape of the packs it reads.
#[derive(Clone, Copy)]
pub(crate) struct Kernel {
    run: MicroKernel,
    /// Rows of C per call (rows of an A panel).
    rows: usize,
    /// k-pairs per step: the packs are zero-padded to a multiple of it (a tile row of the
    /// AMX kernel).
    step: usize,
    /// Words per pair in an A panel: 1 (the pair's two bf16 in one word) or 2 (each widened
    /// to f32 ahead, element `k` then `k + 1`, for a kernel that broadcasts f32 from
    /// memory: [`Kernel::wide_a`]).
    a_width: usize,
    /// Called on the driver's thread before its first micro-kernel call and after its
    /// last (the AMX tile configuration, loaded once per product rather than per call).
    session: Option<Session>,
}

const PORTABLE: Kernel = Kernel::vector(portable_kernel);

impl Kernel {
    const fn vector(run: MicroKernel) -> Self {
        Kernel {
            run,
            rows: MR,
            step: 1,
            a_width: 1,
            session: None,
        }
    }

    /// An `MR`-row kernel that reads its A panel widened to f32 ahead (two words per pair).
    const fn wide_a(run: MicroKernel) -> Self {
        Kernel {
            a_width: 2,
            ..Kernel::vector(run)
        }
    }

    const fn avx2(run: MicroKernel) -> Self {
        Kernel {
            rows: AVX2_MR,
            ..Kernel::vector(run)
        }
    }

    const fn amx(run: MicroKernel, session: Option<Session>) -> Self {
        Kernel {
            rows: AMX_MR,
            step: AMX_PAIRS,
            session,
            ..Kernel::vector(run)
        }
    }
}

/// The kernel of `path`, or why this CPU cannot run it.
pub(crate) fn kernel_for(path: Bf16Path) -> Result<Kernel> {
    let kernel = match path {
        Bf16Path::Portable => Some(PORTABLE),
        Bf16Path::Avx2Fma => avx2::kernel().map(Kernel::avx2),
        Bf16Path::Avx512Fma => avx512::fma_kernel().map(Kernel::wide_a),
        Bf16Path::Avx512Bf16 => avx512::kernel().map(Kernel::vector),
        Bf16Path::Amx => amx::kernel(),
    };
    kernel.ok_or(Error::InvalidValue {
        name: "path",
        value: Value::Count(path as usize),
        reason: match path {
            Bf16Path::Amx => "this CPU (or OS) cannot run AMX-BF16: use Bf16Path::detect()",
            Bf16Path::Avx2Fma => "this CPU lacks AVX2 or FMA: use Bf16Path::detect()",
            Bf16Path::Avx512Fma => "this CPU lacks AVX-512 F: use Bf16Path::detect()",
            _ => "this CPU lacks AVX-512 BF16: use Bf16Path::detect()",
        },
    })
}

/// `C = A·B` (`accumulate == false`) or `C += A·B`, A `[m, k]`, B `[k, n]`, C row-major
/// with row stride `ldc` (its first `(m - 1) * ldc + n` elements are used), on `path`.
///
/// Checks every shape first and writes nothing on an error; a path this CPU lacks is
/// [`Error::InvalidValue`] (use [`Bf16Path::detect`]).
pub fn gemm_bf16(
    path: Bf16Path,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<()> {
    let kernel = kernel_for(path)?;
    drive(kernel, a, b, c, ldc, accumulate)
}

/// [`gemm_bf16`] as `path` computes it, with the path's instructions (`VFMADD231PS`,
/// `VDPBF16PS`, `TDPBF16PS` and the tile loads and stores) modelled in software, on any CPU. It runs
/// the same driver, packing and tile walking as the hardware path, so it tests them on
/// CPUs without the instructions; it is slow, and meant for tests.
///
/// The models follow the instruction set reference, rounding to nearest even: `VDPBF16PS`
/// and `TDPBF16PS` read subnormal bf16 inputs as zero and flush subnormal results to zero;
/// `VFMADD231PS` (the FMA paths) rounds the exact `a · b + c` once and keeps subnormals, as
/// under MXCSR's defaults. The portable path is its own model.
pub fn gemm_bf16_modelled(
    path: Bf16Path,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<()> {
    let kernel = match path {
        Bf16Path::Portable => PORTABLE,
        Bf16Path::Avx2Fma => Kernel::avx2(modelled_avx2_kernel),
        Bf16Path::Avx512Fma => Kernel::wide_a(modelled_fma_kernel),
        Bf16Path::Avx512Bf16 => Kernel::vector(modelled_vector_kernel),
        // The model's tiles are configured by each call (as LDTILECFG leaves them: every
        // tile the kernel reads is loaded first), so it needs no session.
        Bf16Path::Amx => Kernel::amx(modelled_amx_kernel, None),
    };
    drive(kernel, a, b, c, ldc, accumulate)
}

pub(crate) fn check(a: &MatRef<'_>, b: &MatRef<'_>, c: &[f32], ldc: usize) -> Result<()> {
    check_shapes(a, b.rows, b.cols, c, ldc)
}

/// [`check`] for a B of `k` rows and `n` columns.
pub(crate) fn check_shapes(
    a: &MatRef<'_>,
    k: usize,
    n: usize,
    c: &[f32],
    ldc: usize,
) -> Result<()> {
    if a.cols != k {
        return Err(Error::ShapeMismatch {
            arg: "b (rows)",
            expected: a.cols,
            actual: k,
        });
    }
    let m = a.rows;
    if m > 0 && n > 0 && ldc < n {
        return Err(Error::InvalidValue {
            name: "ldc",
            value: Value::Count(ldc),
            reason: "the row stride of C must be at least its columns (n)",
        });
    }
    let span = if m == 0 || n == 0 {
        0
    } else {
        (m - 1) * ldc + n
    };
    if c.len() < span {
        return Err(Error::ShapeMismatch {
            arg: "c",
            expected: span,
            actual: c.len(),
        });
    }
    Ok(())
}

/// B packed ahead, for one path: a matrix that is B to many products (a layer's weight,
/// read by every time step of a recurrence) is packed once, and each product reads the
/// packs instead of packing it again. [`gemm_bf16_packed`] multiplies with it (and
/// `par::gemm_bf16_packed`, with the `rayon` feature).
///
/// ```
/// use ringtrain_kernels::gemm_bf16::{gemm_bf16, gemm_bf16_packed, Bf16Path, MatRef, PackedB};
/// use ringtrain_kernels::bf16;
///
/// let w: Vec<bf16> = (0..12).map(|i| bf16::from_f32(i as f32)).collect();
/// let x: Vec<bf16> = (0..6).map(|i| bf16::from_f32(1.0 - i as f32)).collect();
/// let path = Bf16Path::detect();
/// let packed = PackedB::new(path, MatRef::row_major(&w, 3, 4)?)?;
/// let (mut c1, mut c2) = (vec![0.0f32; 8], vec![0.0f32; 8]);
/// gemm_bf16_packed(MatRef::row_major(&x, 2, 3)?, &packed, &mut c1, 4, false)?;
/// gemm_bf16(path, MatRef::row_major(&x, 2, 3)?, MatRef::row_major(&w, 3, 4)?, &mut c2, 4, false)?;
/// assert_eq!(c1, c2);
/// # Ok::<(), ringtrain_kernels::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PackedB {
    path: Bf16Path,
    /// The kernel's k-pairs per step (the packs are padded to it).
    step: usize,
    k: usize,
    n: usize,
    data: Vec<u32>,
}

/// One block of a [`PackedB`]: columns `jc..jc + nc`, rows `pc..pc + kc`, `pairs` k-pairs
/// per panel, its panels at `offset` in the packed words.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PackedBlock {
    pub jc: usize,
    pub nc: usize,
    pub pc: usize,
    pub kc: usize,
    pub pairs: usize,
    pub offset: usize,
}

impl PackedBlock {
    /// Words the block's panels take.
    pub fn len(&self) -> usize {
        self.nc.next_multiple_of(NR) * self.pairs
    }
}

impl PackedB {
    /// Packs `b` (`[k, n]`, any strides) for `path`.
    ///
    /// # Errors
    /// [`Error::InvalidValue`] when this CPU cannot run `path`.
    pub fn new(path: Bf16Path, b: MatRef<'_>) -> Result<Self> {
        Self::packed_with(path, &b, |b, block, out| {
            pack_b(b, block.pc, block.kc, block.jc, block.nc, block.pairs, out)
        })
    }

    /// A `[k, n]` pack for `path` whose words are still to be written (every one is, by
    /// packing each of [`Self::blocks`]).
    fn unfilled(path: Bf16Path, k: usize, n: usize) -> Result<Self> {
        let step = kernel_for(path)?.step;
        let len = n.div_ceil(NC) * NC.min(n).next_multiple_of(NR) * Self::pairs_of(step, k);
        Ok(PackedB {
            path,
            step,
            k,
            n,
            data: vec![0; len],
        })
    }

    /// k-pairs of every block of one column block together.
    fn pairs_of(step: usize, k: usize) -> usize {
        (k / KC) * (KC / 2) + (k % KC).div_ceil(2).next_multiple_of(step)
    }

    /// The block holding columns from `jc` (a multiple of [`NC`]) and rows from `pc` (a
    /// multiple of [`KC`]).
    pub(crate) fn block(&self, jc: usize, pc: usize) -> PackedBlock {
        let (nc, kc) = (NC.min(self.n - jc), KC.min(self.k - pc));
        let width = NC.min(self.n).next_multiple_of(NR);
        PackedBlock {
            jc,
            nc,
            pc,
            kc,
            pairs: kc.div_ceil(2).next_multiple_of(self.step),
            // Every column block before this one is `width` wide and holds every row;
            // every row block before this one holds KC / 2 pairs (a multiple of the step).
            offset: (jc / NC) * width * Self::pairs_of(self.step, self.k)
                + nc.next_multiple_of(NR) * (pc / KC) * (KC / 2),
        }
    }

    /// Every block, in the order of the packed words.
    pub(crate) fn blocks(&self) -> Vec<PackedBlock> {
        (0..self.n)
            .step_by(NC)
            .flat_map(|jc| (0..self.k).step_by(KC).map(move |pc| self.block(jc, pc)))
            .collect()
    }

    /// A `[k, n]` pack of `b` for `path`, its blocks' panels packed by `pack_panels`
    /// (given each block and its words: the serial packer, or a parallel one).
    pub(crate) fn packed_with(
        path: Bf16Path,
        b: &MatRef<'_>,
        mut pack_panels: impl FnMut(&MatRef<'_>, PackedBlock, &mut [u32]),
    ) -> Result<Self> {
        let mut packed = Self::unfilled(path, b.rows, b.cols)?;
        for block in packed.blocks() {
            pack_panels(
                b,
                block,
                &mut packed.data[block.offset..block.offset + block.len()],
            );
        }
        Ok(packed)
    }

    /// The path it was packed for.
    pub fn path(&self) -> Bf16Path {
        self.path
    }

    /// Rows (`k`).
    pub fn rows(&self) -> usize {
        self.k
    }

    /// Columns (`n`).
    pub fn cols(&self) -> usize {
        self.n
    }
}

/// `C = A·B` or `C += A·B` with B packed ahead, on the path it was packed for; otherwise as
/// [`gemm_bf16`].
///
/// # Errors
/// As [`gemm_bf16`].
pub fn gemm_bf16_packed(
    a: MatRef<'_>,
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<()> {
    let kernel = kernel_for(b.path)?;
    check_shapes(&a, b.k, b.n, c, ldc)?;
    // SAFETY: the shapes were checked against `c`, and the exclusive borrow keeps every
    // other access out.
    unsafe {
        drive_raw(
            kernel,
            a,
            BSource::Packed(b, 0..b.n),
            c.as_mut_ptr(),
            ldc,
            accumulate,
        )
    };
    Ok(())
}

/// Where the driver takes B from.
#[derive(Clone)]
pub(crate) enum BSource<'a> {
    /// A view, packed block by block as the product goes.
    View(MatRef<'a>),
    /// Columns `range` of a matrix packed ahead (the range starts at a multiple of
    /// [`NR`]); C's column 0 is the range's first.
    Packed(&'a PackedB, core::ops::Range<usize>),
}

/// The blocked driver shared by every path.
fn drive(
    kernel: Kernel,
    a: MatRef<'_>,
    b: MatRef<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) -> Result<()> {
    check(&a, &b, c, ldc)?;
    // SAFETY: `check` found `c` long enough for an `a.rows × b.cols` product with row
    // stride `ldc`, and the exclusive borrow keeps every other access out.
    unsafe { drive_raw(kernel, a, BSource::View(b), c.as_mut_ptr(), ldc, accumulate) };
    Ok(())
}

/// The driver on a raw C: `C = A·B` or `C += A·B` into element `(i, j)` at
/// `c + i * ldc + j`. B is packed once per block of [`KC`] × [`NC`] (or was packed
/// ahead), A once per block of [`MC`] × [`KC`] inside it, and each micro-kernel call keeps
/// its B panel in L1 while it walks the A panels.
///
/// # Safety
/// A's columns equal B's rows; `ldc` is at least B's (or the range's) columns; a packed
/// B was packed for `kernel`'s path; and for every `i < a.rows` and `j` below B's columns
/// the float at `c + i * ldc + j` may be read and written by this call, with no other
/// access to those floats while it runs.
pub(crate) unsafe fn drive_raw(
    kernel: Kernel,
    a: MatRef<'_>,
    b: BSource<'_>,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // Global columns `first..last` of B; C's column 0 is `first`.
    let (first, last) = match &b {
        BSource::View(v) => (0, v.cols),
        BSource::Packed(_, range) => (range.start, range.end),
    };
    let (m, n, k) = (a.rows, last - first, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                // SAFETY: row `row < m` of C, `n` floats, is ours (the caller's contract).
                unsafe { core::slice::from_raw_parts_mut(c.add(row * ldc), n) }.fill(0.0);
            }
        }
        return;
    }
    let rows = kernel.rows;
    let max_pairs = KC.min(k).div_ceil(2).next_multiple_of(kernel.step);
    // Each pack is sized for the largest block this product has (B's only when it is
    // packed here).
    let b_words = match b {
        BSource::View(_) => NC.min(n).next_multiple_of(NR) * max_pairs,
        BSource::Packed(..) => 0,
    };
    let mut b_pack: Vec<u32> = vec![0; b_words];
    let a_panel_words = |pairs: usize| pairs * rows * kernel.a_width;
    let mut a_pack: Vec<u32> = vec![0; MC.min(m).div_ceil(rows) * a_panel_words(max_pairs)];
    let mut edge = [0.0f32; AMX_MR * NR];
    if let Some((begin, _)) = kernel.session {
        // SAFETY: a kernel with a session is one whose CPU features were checked when it
        // was chosen; the session ends below, on this thread, and nothing between returns
        // early.
        unsafe { begin() };
    }
    // Column blocks end at the multiples of NC (of B's global columns).
    let mut jc = first;
    while jc < last {
        let block_end = last.min((jc / NC + 1) * NC);
        let nc = block_end - jc;
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let pairs = kc.div_ceil(2).next_multiple_of(kernel.step);
            // The block's panels, and the panel of its column `jc` (panel 0 when packed
            // here).
            let (panels, first_panel): (&[u32], usize) = match &b {
                BSource::View(v) => {
                    pack_b(v, pc, kc, jc, nc, pairs, &mut b_pack);
                    (&b_pack, 0)
                }
                BSource::Packed(p, _) => {
                    let block = p.block(jc - jc % NC, pc);
                    (
                        &p.data[block.offset..block.offset + block.len()],
                        (jc % NC) / NR,
                    )
                }
            };
            // The first block of k starts from zero unless the product accumulates.
            let zero = !accumulate && pc == 0;
            let direct = direct_a(&a, pc, kc, kernel);
            for ic in (0..m).step_by(MC) {
                let mc = MC.min(m - ic);
                // Rows `ic..ic + in_place` are read in place, the others packed.
                let in_place = if direct.is_some() { mc - mc % rows } else { 0 };
                if in_place < mc {
                    pack_a(
                        &a,
                        ic + in_place,
                        mc - in_place,
                        pc,
                        kc,
                        kernel,
                        &mut a_pack,
                    );
                }
                for jr in (0..nc).step_by(NR) {
                    let nr = NR.min(nc - jr);
                    let b_panel = &panels[(first_panel + jr / NR) * pairs * NR..][..pairs * NR];
                    for ir in (0..mc).step_by(rows) {
                        let mr = rows.min(mc - ir);
                        let (a_panel, lda) = match direct {
                            // SAFETY: rows `ic + ir..ic + ir + rows` of A are inside it (a
                            // full panel), and each holds `kc = 2 * pairs` elements from
                            // column `pc`, where `top` points (`direct_a`).
                            Some((top, lda)) if ir < in_place => {
                                (unsafe { top.add((ic + ir) * lda) }, lda)
                            }
                            _ => {
                                let (q, words) = ((ir - in_place) / rows, a_panel_words(pairs));
                                (
                                    a_pack[q * words..][..words].as_ptr(),
                                    pairs * kernel.a_width,
                                )
                            }
                        };
                        // SAFETY: (ic + ir, jc - first + jr) is inside C.
                        let block = unsafe { c.add((ic + ir) * ldc + jc - first + jr) };
                        if mr == rows && nr == NR {
                            // SAFETY: the A panel holds `rows` rows of `pairs` pairs `lda`
                            // words apart, the B panel `pairs * NR` words (above), `pairs` is a
                            // multiple of the kernel's step, and the `rows × NR` block of C
                            // at `block` is inside C (a full block); `kernel` is the
                            // portable one, a software model, or one whose CPU features
                            // were checked when it was chosen.
                            unsafe {
                                (kernel.run)(
                                    pairs,
                                    a_panel,
                                    lda,
                                    b_panel.as_ptr(),
                                    block,
                                    ldc,
                                    zero,
                                )
                            };
                            continue;
                        }
                        // A block at an edge of C goes through `edge` (`rows × NR`).
                        let edge = &mut edge[..rows * NR];
                        edge.fill(0.0);
                        if !zero {
                            for i in 0..mr {
                                // SAFETY: row i < mr of the block has nr floats inside C.
                                let row =
                                    unsafe { core::slice::from_raw_parts(block.add(i * ldc), nr) };
                                edge[i * NR..i * NR + nr].copy_from_slice(row);
                            }
                        }
                        // SAFETY: as above, with the block in `edge` (row stride NR).
                        unsafe {
                            (kernel.run)(
                                pairs,
                                a_panel,
                                lda,
                                b_panel.as_ptr(),
                                edge.as_mut_ptr(),
                                NR,
                                zero,
                            )
                        };
                        for i in 0..mr {
                            // SAFETY: as above.
                            unsafe { core::slice::from_raw_parts_mut(block.add(i * ldc), nr) }
                                .copy_from_slice(&edge[i * NR..i * NR + nr]);
                        }
                    }
                }
            }
        }
        jc = block_end;
    }
    if let Some((_, end)) = kernel.session {
        // SAFETY: the session began above, on this thread.
        unsafe { end() };
    }
}

/// `out[j]` = the pair (`lo[j]`, `hi[j]`) for the `NR` columns of a panel row (fixed
/// length, so that it compiles to a few vector instructions).
#[inline(always)]
fn interleave(lo: &[bf16], hi: &[bf16], out: &mut [u32]) {
    let (Ok(lo), Ok(hi), Ok(out)) = (
        <&[u16; NR]>::try_from(lo.reinterpret_cast()),
        <&[u16; NR]>::try_from(hi.reinterpret_cast()),
        <&mut [u32; NR]>::try_from(out),
    ) else {
        unreachable!("panel rows are NR long");
    };
    for j in 0..NR {
        out[j] = u32::from(lo[j]) | (u32::from(hi[j]) << 16);
    }
}

/// Two bf16 (element `k` in the low half, `k + 1` in the high half) as one word.
#[inline]
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

wide_twin! {
    /// Packs B's rows `pc..pc + kc`, columns `jc..jc + nc` into panels of [`NR`] columns,
    /// `pairs` k-pairs each (zero past `kc` and `nc`): panel `q`, pair `p`, column `j` at
    /// `(q * pairs + p) * NR + j`. Full panels of a B with unit column stride (NN) or unit
    /// row stride (B stored transposed, NT) are copied along memory.
    pub(crate) fn pack_b(
        b: &MatRef<'_>,
        pc: usize,
        kc: usize,
        jc: usize,
        nc: usize,
        pairs: usize,
        out: &mut [u32],
    ) {
        let (rs, cs) = (b.row_stride, b.col_stride);
        // Pairs with both of their k inside the block.
        let full = kc / 2;
        for (q, j0) in (0..nc).step_by(NR).enumerate() {
            let panel = &mut out[q * pairs * NR..(q + 1) * pairs * NR];
            let (col0, cols) = (jc + j0, NR.min(nc - j0));
            let mut done = 0;
            if cols == NR && cs == 1 {
                for (p, dst) in panel.chunks_exact_mut(NR).take(full).enumerate() {
                    let k0 = pc + 2 * p;
                    interleave(
                        &b.data[k0 * rs + col0..][..NR],
                        &b.data[(k0 + 1) * rs + col0..][..NR],
                        dst,
                    );
                }
                done = full;
            } else if cols == NR && rs == 1 {
                // Each column's k run is contiguous: read it in order (the panel, NR words
                // per pair, stays in L1 while its columns are written).
                for j in 0..NR {
                    let column = &b.data[(col0 + j) * cs + pc..][..2 * full];
                    for (p, two) in column.chunks_exact(2).enumerate() {
                        panel[p * NR + j] = pair(two[0], two[1]);
                    }
                }
                done = full;
            }
            let at = |kk: usize, j: usize| {
                if j < cols && kk < pc + kc {
                    b.data[kk * rs + (col0 + j) * cs]
                } else {
                    bf16::ZERO
                }
            };
            for p in done..pairs {
                let k0 = pc + 2 * p;
                for j in 0..NR {
                    panel[p * NR + j] = pair(at(k0, j), at(k0 + 1, j));
                }
            }
        }
    }
}

wide_twin! {
    /// Packs A's rows `ic..ic + mc`, columns `pc..pc + kc` into panels of `kernel.rows`
    /// rows, zero-padded to a multiple of `kernel.step` pairs: panel `q`, row `i`, pair
    /// `p` at `(q * rows + i) * pairs + p`, so that each row is whole, as in a row-major A
    /// (which the driver reads in place where it can, see [`direct_a`]). A kernel with
    /// `a_width` 2 gets each pair as two words, the f32 bits of element `k` then of
    /// `k + 1`, at `((q * rows + i) * pairs + p) * 2`. Full panels of an A with unit column
    /// stride (NN, NT) or unit row stride (A stored transposed, TN) are copied along
    /// memory.
    fn pack_a(
        a: &MatRef<'_>,
        ic: usize,
        mc: usize,
        pc: usize,
        kc: usize,
        kernel: Kernel,
        out: &mut [u32],
    ) {
        let (rows, width) = (kernel.rows, kernel.a_width);
        let (rs, cs) = (a.row_stride, a.col_stride);
        let pairs = kc.div_ceil(2).next_multiple_of(kernel.step);
        let full = kc / 2;
        // Row `i`'s words in a panel, and how pair `p` of elements (x0, x1) is written there.
        let row_words = pairs * width;
        let put = |row: &mut [u32], p: usize, x0: bf16, x1: bf16| {
            if width == 1 {
                row[p] = pair(x0, x1);
            } else {
                row[2 * p] = widen_bits(x0);
                row[2 * p + 1] = widen_bits(x1);
            }
        };
        for (q, i0) in (0..mc).step_by(rows).enumerate() {
            let panel = &mut out[q * rows * row_words..(q + 1) * rows * row_words];
            let (row0, live) = (ic + i0, rows.min(mc - i0));
            let mut done = 0;
            if live == rows && cs == 1 {
                // Each row contiguous in A: a copy, row by row.
                for (i, dst) in panel.chunks_exact_mut(row_words).enumerate() {
                    let src: &[u16] = a.data[(row0 + i) * rs + pc..][..2 * full].reinterpret_cast();
                    if width == 1 {
                        for (d, two) in dst[..full].iter_mut().zip(src.chunks_exact(2)) {
                            *d = u32::from(two[0]) | (u32::from(two[1]) << 16);
                        }
                    } else {
                        for (d, &x) in dst[..2 * full].iter_mut().zip(src) {
                            *d = u32::from(x) << 16;
                        }
                    }
                }
                done = full;
            } else if live == rows && rs == 1 {
                // Each k's rows contiguous in A: read them in order.
                for p in 0..full {
                    let k0 = pc + 2 * p;
                    let r0 = &a.data[k0 * cs + row0..][..rows];
                    let r1 = &a.data[(k0 + 1) * cs + row0..][..rows];
                    for (row, (&x0, &x1)) in panel.chunks_exact_mut(row_words).zip(r0.iter().zip(r1)) {
                        put(row, p, x0, x1);
                    }
                }
                done = full;
            }
            let at = |i: usize, kk: usize| {
                if i < live && kk < pc + kc {
                    a.data[(row0 + i) * rs + kk * cs]
                } else {
                    bf16::ZERO
                }
            };
            for p in done..pairs {
                let k0 = pc + 2 * p;
                for (i, row) in panel.chunks_exact_mut(row_words).enumerate() {
                    put(row, p, at(i, k0), at(i, k0 + 1));
                }
            }
        }
    }
}

/// A's block of columns `pc..pc + kc` as the micro-kernel's A rows in place, `(first
/// word, words between rows)`, when A is row-major there with every row starting on a
/// pair (4-byte aligned), `kc` is whole steps of pairs (no padding) and the kernel reads
/// each pair as one word (`a_width` 1); else `None`, and the block is packed.
fn direct_a(a: &MatRef<'_>, pc: usize, kc: usize, kernel: Kernel) -> Option<(*const u32, usize)> {
    let whole = kc.is_multiple_of(2) && (kc / 2).is_multiple_of(kernel.step);
    let pairs_in_one_word = kernel.a_width == 1;
    let aligned = (a.data.as_ptr() as usize).is_multiple_of(4)
        && a.row_stride.is_multiple_of(2)
        && pc.is_multiple_of(2);
    (a.col_stride == 1 && whole && aligned && pairs_in_one_word && a.rows > 0)
        .then(|| (a.data[pc..].as_ptr().cast::<u32>(), a.row_stride / 2))
}

#[inline]
fn widen(bits: u32) -> f32 {
    f32::from_bits(bits << 16)
}

/// The f32 bits of `x` (exact: bf16 is f32's upper half).
#[inline(always)]
fn widen_bits(x: bf16) -> u32 {
    u32::from(x.to_bits()) << 16
}

/// The portable micro-kernel: each element adds `a[k]·b[k]` then `a[k+1]·b[k+1]`, each
/// product and sum rounded to f32 (the widened f32 product, in order of `k`).
///
/// # Safety
/// `MR` rows of `pairs` words at `a + i * lda` (`lda >= pairs`) and `pairs * NR` words at
/// `b` are readable, and `MR` rows of `NR` floats at `c + i * ldc` (`ldc >= NR`) are
/// readable and writable.
unsafe fn portable_kernel(
    pairs: usize,
    a: *const u32,
    lda: usize,
    b: *const u32,
    c: *mut f32,
    ldc: usize,
    zero: bool,
) {
    // SAFETY: the caller guarantees these lengths.
    let (a, b) = unsafe {
        (
            core::slice::from_raw_parts(a, (MR - 1) * lda + pairs),
            core::slice::from_raw_parts(b, pairs * NR),
        )
    };
    let mut tile = [0.0f32; MR * NR];
    if !zero {
        for (i, row) in tile.chunks_exact_mut(NR).enumerate() {
            // SAFETY: row i < MR of the block (the caller's contract).
            row.copy_from_slice(unsafe { core::slice::from_raw_parts(c.add(i * ldc), NR) });
        }
    }
    let (mut b0, mut b1) = ([0.0f32; NR], [0.0f32; NR]);
    for p in 0..pairs {
        // Widen the pair row of B once for all MR rows of A.
        for (j, &w) in b[p * NR..(p + 1) * NR].iter().enumerate() {
            b0[j] = widen(w & 0xffff);
            b1[j] = widen(w >> 16);
        }
        for i in 0..MR {
            let w = a[i * lda + p];
            let (a0, a1) = (widen(w & 0xffff), widen(w >> 16));
            let row = &mut tile[i * NR..(i + 1) * NR];
            for ((acc, &x0), &x1) in row.iter_mut().zip(&b0).zip(&b1) {
                *acc += a0 * x0;
                *acc += a1 * x1;
            }
        }
    }
    for (i, row) in tile.chunks_exact(NR).enumerate() {
        // SAFETY: as above.
        unsafe { core::slice::from_raw_parts_mut(c.add(i * ldc), NR) }.copy_from_slice(row);
    }
}

/// An `MR × NR` micro-kernel that keeps its block of C in `MR × 2` vectors of 16 lanes: it
/// starts them from C (or from zero), runs `$pair` for each pair of `k` on them (`$acc`)
/// and stores them back; the frame of `vector_kernel!` and `fma_kernel!`, for the hardware
/// (`$ops` = intrinsics) and the software models alike.
macro_rules! block_kernel {
    (
        $(#[$attr:meta])* fn $name:ident, $ops:path,
        |$acc:ident, $a:ident, $lda:ident, $b:ident, $p:ident| $pair:block
    ) => {
        $(#[$attr])*
        unsafe fn $name(
            pairs: usize,
            $a: *const u32,
            $lda: usize,
            $b: *const u32,
            c: *mut f32,
            ldc: usize,
            zero: bool,
        ) {
            use $ops as ops;
            use $crate::gemm_bf16::{MR, NR};
            // SAFETY (whole body): the caller guarantees `MR` rows of `pairs` pairs at
            // `a + i * lda` and `pairs * NR` words at `b`, as the kernel's packs lay them
            // out (`MicroKernel`), and that `MR` rows of `NR` floats at `c + i * ldc` are
            // readable and writable; every offset below is inside.
            unsafe {
                let mut $acc = [[ops::zero(); 2]; MR];
                if !zero {
                    for (i, row) in $acc.iter_mut().enumerate() {
                        row[0] = ops::load(c.add(i * ldc));
                        row[1] = ops::load(c.add(i * ldc + 16));
                    }
                }
                for $p in 0..pairs $pair
                for (i, row) in $acc.iter().enumerate() {
                    ops::store(c.add(i * ldc), row[0]);
                    ops::store(c.add(i * ldc + 16), row[1]);
                }
            }
        }
    };
}

/// The vector micro-kernel (one `dot` of a pair per accumulator and pair of `k`), written
/// once for the hardware (`$ops` = the intrinsics; the `avx512-bf16` kernel writes the same
/// loop out in assembly, see `avx512::avx512_kernel`) and for the software model of the
/// same instructions that tests the packing and indexing on CPUs without them.
macro_rules! vector_kernel {
    ($(#[$attr:meta])* fn $name:ident, $ops:path) => {
        block_kernel!($(#[$attr])* fn $name, $ops, |acc, a, lda, b, p| {
            let b0 = ops::load_pairs(b.add(p * NR));
            let b1 = ops::load_pairs(b.add(p * NR + 16));
            for (i, row) in acc.iter_mut().enumerate() {
                let w = ops::broadcast(*a.add(i * lda + p));
                row[0] = ops::dot(row[0], w, b0);
                row[1] = ops::dot(row[1], w, b1);
            }
        });
    };
}

/// Lane-by-lane vector operations the software models share, for vectors of any width
/// (each model names its own vector types, which fix the width).
mod model_lanes {
    pub unsafe fn load<const N: usize>(p: *const f32) -> [f32; N] {
        // SAFETY: the caller guarantees N readable floats.
        unsafe { core::ptr::read_unaligned(p as *const [f32; N]) }
    }
    pub unsafe fn store<const N: usize>(p: *mut f32, v: [f32; N]) {
        // SAFETY: the caller guarantees N writable floats.
        unsafe { core::ptr::write_unaligned(p as *mut [f32; N], v) }
    }
    pub unsafe fn load_words<const N: usize>(p: *const u32) -> [u32; N] {
        // SAFETY: the caller guarantees N readable words.
        unsafe { core::ptr::read_unaligned(p as *const [u32; N]) }
    }
    pub fn splat<const N: usize>(w: u32) -> [u32; N] {
        [w; N]
    }
    /// Each word's even (low) bf16, widened.
    pub fn even<const N: usize>(w: [u32; N]) -> [f32; N] {
        w.map(super::widen)
    }
    /// Each word's odd (high) bf16, widened.
    pub fn odd<const N: usize>(w: [u32; N]) -> [f32; N] {
        w.map(|x| super::widen(x >> 16))
    }
    /// `VFMADD231PS`: `a · b + acc` in each lane, rounded once.
    pub fn fma<const N: usize>(a: [f32; N], b: [f32; N], acc: [f32; N]) -> [f32; N] {
        core::array::from_fn(|l| libm::fmaf(a[l], b[l], acc[l]))
    }
}

/// A software model of the AVX-512 BF16 operations the vector kernel uses, lane by lane
/// as the instruction set reference describes `VDPBF16PS` (the high pair first, subnormal
/// inputs as zero, subnormal results flushed to zero).
#[allow(dead_code)]
mod model_ops {
    pub use super::model_lanes::{load, load_words as load_pairs, splat as broadcast, store};

    pub type F32x16 = [f32; 16];
    pub type Pairs = [u32; 16];

    pub fn zero() -> F32x16 {
        [0.0; 16]
    }
    fn daz(x: f32) -> f32 {
        if x.is_subnormal() {
            0.0f32.copysign(x)
        } else {
            x
        }
    }
    fn half(w: u32, high: bool) -> f32 {
        daz(super::widen(if high { w >> 16 } else { w & 0xffff }))
    }
    pub fn dot(acc: F32x16, a: Pairs, b: Pairs) -> F32x16 {
        let mut out = acc;
        for l in 0..16 {
            let hi = daz(out[l] + half(a[l], true) * half(b[l], true));
            out[l] = daz(hi + half(a[l], false) * half(b[l], false));
        }
        out
    }
}

vector_kernel!(
    /// The vector kernel on the software model.
    fn modelled_vector_kernel,
    model_ops
);

/// The `avx512-fma` micro-kernel's body over `MR × 2` vectors of 16 lanes, written once for
/// the hardware (`$ops` = the AVX-512 F intrinsics) and for the software model of the same
/// instructions. Its A panel is widened to f32 ahead ([`Kernel::wide_a`]), so each row's
/// operand is one broadcast from memory with no arithmetic; for each pair of `k` it widens
/// the pair's B words into the even (`k`) and odd (`k + 1`) operands once for the `MR`
/// rows (a shift and a mask), and each sum takes the even product, then the odd one, by a
/// fused multiply-add: the order of the portable kernel. The even products of all `MR`
/// rows come before the odd ones, so the two multiply-adds of a pair into one accumulator
/// are `2 * MR` instructions apart.
///
/// Widening the rows of A in the loop instead (the vector kernel with two fused
/// multiply-adds as its `dot`) costs two more vector operations per row and pair, which on
/// CPUs that issue 512-bit operations on two ports compete with the multiply-adds; README's
/// bf16 section has the measurements.
macro_rules! fma_kernel {
    ($(#[$attr:meta])* fn $name:ident, $ops:path) => {
        block_kernel!($(#[$attr])* fn $name, $ops, |acc, a, lda, b, p| {
            let w0 = ops::load_pairs(b.add(p * NR));
            let w1 = ops::load_pairs(b.add(p * NR + 16));
            let (even0, odd0) = (ops::even(w0), ops::odd(w0));
            let (even1, odd1) = (ops::even(w1), ops::odd(w1));
            for (i, row) in acc.iter_mut().enumerate() {
                let x0 = ops::broadcast_f32(a.add(i * lda + 2 * p));
                row[0] = ops::fma(x0, even0, row[0]);
                row[1] = ops::fma(x0, even1, row[1]);
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let x1 = ops::broadcast_f32(a.add(i * lda + 2 * p + 1));
                row[0] = ops::fma(x1, odd0, row[0]);
                row[1] = ops::fma(x1, odd1, row[1]);
            }
        });
    };
}

/// A software model of the AVX-512 F operations of the `avx512-fma` kernel, lane by lane:
/// the broadcast of a widened A element, the widening of B's words (a shift or a mask), and
/// `VFMADD231PS` (one rounding of the exact `a · b + c`, subnormals kept).
#[allow(dead_code)]
mod model_fma_ops {
    pub use super::model_lanes::{even, fma, load, load_words as load_pairs, odd, store};

    pub fn zero() -> [f32; 16] {
        [0.0; 16]
    }
    pub unsafe fn broadcast_f32(p: *const u32) -> [f32; 16] {
        // SAFETY: the caller guarantees a readable word.
        [f32::from_bits(unsafe { *p }); 16]
    }
}

fma_kernel!(
    /// The `avx512-fma` kernel on the software model.
    fn modelled_fma_kernel,
    model_fma_ops
);

/// The AVX2 micro-kernel's body over 8-lane vectors, written once for the hardware (`$ops`
/// = the intrinsics) and for a software model of the same instructions, as
/// `vector_kernel!` is. It computes the `AVX2_MR × NR` block of C as two halves of 16
/// columns; for each pair of `k` it widens the half's B words into the even (`k`) and odd
/// (`k + 1`) operands once for the four rows, and each sum takes the even product, then the
/// odd one, by a fused multiply-add: the order of the portable kernel.
macro_rules! avx2_kernel {
    ($(#[$attr:meta])* fn $name:ident, $ops:path) => {
        $(#[$attr])*
        unsafe fn $name(
            pairs: usize,
            a: *const u32,
            lda: usize,
            b: *const u32,
            c: *mut f32,
            ldc: usize,
            zero: bool,
        ) {
            use $ops as ops;
            use $crate::gemm_bf16::{AVX2_MR, NR};
            // SAFETY (whole body): the caller guarantees `AVX2_MR` rows of `pairs` words at
            // `a + i * lda`, `pairs * NR` words at `b`, and that `AVX2_MR` rows of `NR`
            // floats at `c + i * ldc` are readable and writable; every offset below is
            // inside.
            unsafe {
                for half in [0, NR / 2] {
                    let mut acc = [[ops::zero(); 2]; AVX2_MR];
                    if !zero {
                        for (i, row) in acc.iter_mut().enumerate() {
                            row[0] = ops::load(c.add(i * ldc + half));
                            row[1] = ops::load(c.add(i * ldc + half + 8));
                        }
                    }
                    for p in 0..pairs {
                        let w0 = ops::load_words(b.add(p * NR + half));
                        let w1 = ops::load_words(b.add(p * NR + half + 8));
                        let (even0, odd0) = (ops::even(w0), ops::odd(w0));
                        let (even1, odd1) = (ops::even(w1), ops::odd(w1));
                        for (i, row) in acc.iter_mut().enumerate() {
                            let w = ops::splat(*a.add(i * lda + p));
                            let (even, odd) = (ops::even(w), ops::odd(w));
                            row[0] = ops::fma(even, even0, row[0]);
                            row[0] = ops::fma(odd, odd0, row[0]);
                            row[1] = ops::fma(even, even1, row[1]);
                            row[1] = ops::fma(odd, odd1, row[1]);
                        }
                    }
                    for (i, row) in acc.iter().enumerate() {
                        ops::store(c.add(i * ldc + half), row[0]);
                        ops::store(c.add(i * ldc + half + 8), row[1]);
                    }
                }
            }
        }
    };
}

/// A software model of the AVX2 operations the AVX2 kernel uses, lane by lane: the
/// widening is a shift or a mask of each word, and `VFMADD231PS` one rounding (to nearest
/// even) of the exact `a · b + c`, subnormals kept (MXCSR's defaults).
#[allow(dead_code)]
mod model_avx2_ops {
    pub use super::model_lanes::{even, fma, load, load_words, odd, splat, store};

    pub fn zero() -> [f32; 8] {
        [0.0; 8]
    }
}

avx2_kernel!(
    /// The AVX2 kernel on the software model.
    fn modelled_avx2_kernel,
    model_avx2_ops
);

/// The tile configuration the AMX kernel loads (`LDTILECFG`'s 64-byte block): palette 1,
/// tiles 0 to 7 of 16 rows × 64 bytes (tiles 0–3: C as 16 × 16 f32; 4, 5: A as 16 rows
/// × 16 pairs; 6, 7: B as 16 pairs × 16 columns), every other byte zero as the format
/// requires.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

static TILE_CONFIG: TileConfig = {
    let mut cfg = [0u8; 64];
    cfg[0] = 1; // palette 1; byte 1 (start row) 0; bytes 2..16 reserved.
    let mut t = 0;
    while t < 8 {
        cfg[16 + 2 * t] = 64; // colsb, little-endian u16 at 16 + 2 t
        cfg[48 + t] = 16; // rows at 48 + t
        t += 1;
    }
    TileConfig(cfg)
};

/// 64 zero bytes: the row a C tile that starts from zero is loaded from, 16 times.
#[repr(C, align(64))]
struct ZeroRow([u8; 64]);

static ZERO_ROW: ZeroRow = ZeroRow([0; 64]);

/// The AMX micro-kernel's body, written once for the hardware (`$ops::Tiles` = the tile
/// instructions through `asm!`) and for the software model of the same instructions, as
/// `vector_kernel!` is. The tiles are configured with [`TILE_CONFIG`] (on the hardware once
/// per product, by the kernel's session; the model takes it on each call). C's
/// `AMX_MR × NR` block is tiles 0 (rows 0–15, columns 0–15), 1 (rows 0–15, columns
/// 16–31), 2 and 3 (rows 16–31); each step of 16 k-pairs loads the step's two A tiles (4:
/// rows 0–15, 5: rows 16–31, each row 16 pairs of its A row, `lda` words apart) and two B
/// tiles (6: columns 0–15, 7: columns 16–31), then `C[r][c] += A[r] · B[c]`.
macro_rules! amx_kernel {
    ($(#[$attr:meta])* fn $name:ident, $ops:path) => {
        $(#[$attr])*
        unsafe fn $name(
            pairs: usize,
            a: *const u32,
            lda: usize,
            b: *const u32,
            c: *mut f32,
            ldc: usize,
            zero: bool,
        ) {
            use $ops as ops;
            use $crate::gemm_bf16::{AMX_PAIRS, NR, ZERO_ROW};
            // Bytes between rows: of C, of A, and of a B panel (NR words).
            let c_row = ldc * 4;
            let a_row = lda * 4;
            const B_ROW: usize = NR * 4;
            // SAFETY (whole body): the caller guarantees `pairs` is a multiple of AMX_PAIRS,
            // `AMX_MR` rows of `pairs` words at `a + i * lda`, `pairs * NR` words at `b`,
            // and that `AMX_MR` rows of `NR` floats at `c + i * ldc` are readable and
            // writable; every tile below reads or writes 16 rows of 64 bytes inside them
            // (or, for a block that starts from zero, the 64 zero bytes of ZERO_ROW 16
            // times, with stride 0).
            unsafe {
                let mut t = ops::Tiles::configured(&$crate::gemm_bf16::TILE_CONFIG);
                let c = c.cast::<u8>();
                if zero {
                    let z = ZERO_ROW.0.as_ptr();
                    t.load::<0>(z, 0);
                    t.load::<1>(z, 0);
                    t.load::<2>(z, 0);
                    t.load::<3>(z, 0);
                } else {
                    t.load::<0>(c, c_row);
                    t.load::<1>(c.add(64), c_row);
                    t.load::<2>(c.add(16 * c_row), c_row);
                    t.load::<3>(c.add(16 * c_row + 64), c_row);
                }
                for s in 0..pairs / AMX_PAIRS {
                    let a_step = a.add(s * AMX_PAIRS).cast::<u8>();
                    let b_step = b.add(s * AMX_PAIRS * NR).cast::<u8>();
                    t.load::<4>(a_step, a_row);
                    t.load::<5>(a_step.add(16 * a_row), a_row);
                    t.load::<6>(b_step, B_ROW);
                    t.load::<7>(b_step.add(64), B_ROW);
                    t.dot::<0, 4, 6>();
                    t.dot::<1, 4, 7>();
                    t.dot::<2, 5, 6>();
                    t.dot::<3, 5, 7>();
                }
                t.store::<0>(c, c_row);
                t.store::<1>(c.add(64), c_row);
                t.store::<2>(c.add(16 * c_row), c_row);
                t.store::<3>(c.add(16 * c_row + 64), c_row);
            }
        }
    };
}

/// A software model of the AMX tile instructions the AMX kernel uses, after the
/// instruction set reference (Intel SDM, vol. 2, "LDTILECFG", "TILELOADD", "TILESTORED",
/// "TDPBF16PS"):
/// - `LDTILECFG` takes each tile's rows and bytes per row from the block and zeroes every
///   tile; `TILELOADD` reads `rows` rows of `colsb` bytes at `base + r * stride` and
///   zeroes the rest of the tile; `TILESTORED` writes the same rows back.
/// - `TDPBF16PS tC, tA, tB`: for each row `m` of C and column `n`, two f32 sums, of the
///   even and of the odd bf16 of each pair, start at zero and take `A[m].bf16[2k] ·
///   B[k].bf16[2n]` and `A[m].bf16[2k+1] · B[k].bf16[2n+1]` for `k` in order, each an
///   FMA with round to nearest even; then `C[m][n] += even + odd`. Subnormal inputs read
///   as zero and subnormal results are flushed to zero; MXCSR plays no part. (The older
///   reference and the intrinsics guide write the loop as `C[m][n] += even product` then
///   `+= odd product` per `k`; both orders are within the same accumulation bound, which
///   is what the tests check on hardware.)
mod model_tiles {
    use super::{widen, TileConfig};

    const TILES: usize = 8;
    /// 16 rows of 16 dwords.
    const WORDS: usize = 256;

    pub struct Tiles {
        rows: [usize; TILES],
        colsb: [usize; TILES],
        data: [[u32; WORDS]; TILES],
    }

    fn daz(x: f32) -> f32 {
        if x.is_subnormal() {
            0.0f32.copysign(x)
        } else {
            x
        }
    }

    fn half(w: u32, high: bool) -> f32 {
        daz(widen(if high { w >> 16 } else { w & 0xffff }))
    }

    impl Tiles {
        pub fn configured(cfg: &TileConfig) -> Tiles {
            let cfg = &cfg.0;
            assert_eq!(cfg[0], 1, "palette 1");
            let mut t = Tiles {
                rows: [0; TILES],
                colsb: [0; TILES],
                data: [[0; WORDS]; TILES],
            };
            for i in 0..TILES {
                t.rows[i] = usize::from(cfg[48 + i]);
                t.colsb[i] = usize::from(u16::from_le_bytes([cfg[16 + 2 * i], cfg[17 + 2 * i]]));
                assert!(t.rows[i] <= 16 && t.colsb[i] <= 64 && t.colsb[i].is_multiple_of(4));
            }
            t
        }

        /// # Safety
        /// `rows[T]` rows of `colsb[T]` bytes at `p + r * stride` are readable.
        pub unsafe fn load<const T: usize>(&mut self, p: *const u8, stride: usize) {
            self.data[T] = [0; WORDS];
            for r in 0..self.rows[T] {
                for w in 0..self.colsb[T] / 4 {
                    // SAFETY: the caller guarantees the rows are readable.
                    self.data[T][r * 16 + w] =
                        unsafe { core::ptr::read_unaligned(p.add(r * stride + 4 * w).cast()) };
                }
            }
        }

        /// # Safety
        /// `rows[T]` rows of `colsb[T]` bytes at `p + r * stride` are writable.
        pub unsafe fn store<const T: usize>(&self, p: *mut u8, stride: usize) {
            for r in 0..self.rows[T] {
                for w in 0..self.colsb[T] / 4 {
                    // SAFETY: the caller guarantees the rows are writable.
                    unsafe {
                        core::ptr::write_unaligned(
                            p.add(r * stride + 4 * w).cast(),
                            self.data[T][r * 16 + w],
                        )
                    };
                }
            }
        }

        pub fn dot<const C: usize, const A: usize, const B: usize>(&mut self) {
            assert!(self.rows[A] == self.rows[C] && self.rows[B] == self.colsb[A] / 4);
            for m in 0..self.rows[C] {
                for n in 0..self.colsb[C] / 4 {
                    let (mut even, mut odd) = (0.0f32, 0.0f32);
                    for k in 0..self.colsb[A] / 4 {
                        let (a, b) = (self.data[A][m * 16 + k], self.data[B][k * 16 + n]);
                        even = daz(libm::fmaf(half(a, false), half(b, false), even));
                        odd = daz(libm::fmaf(half(a, true), half(b, true), odd));
                    }
                    let c = &mut self.data[C][m * 16 + n];
                    *c = daz(f32::from_bits(*c) + daz(even + odd)).to_bits();
                }
            }
        }
    }
}

/// The model's `Tiles` under the name the AMX kernel body uses.
mod model_amx_ops {
    pub use super::model_tiles::Tiles;
}

amx_kernel!(
    /// The AMX kernel on the software model.
    fn modelled_amx_kernel,
    model_amx_ops
);

#[cfg(all(feature = "std", target_arch = "x86_64"))]
mod amx {
    //! The AMX-BF16 path: detection (once per process) and the tile instructions.

    use super::Kernel;
    use std::sync::OnceLock;

    /// `Ok` when this process may use the AMX tiles, else why not.
    fn state() -> Result<(), &'static str> {
        static STATE: OnceLock<Result<(), &'static str>> = OnceLock::new();
        *STATE.get_or_init(probe)
    }

    pub fn available() -> bool {
        state().is_ok()
    }

    pub fn missing() -> &'static str {
        state().err().unwrap_or("")
    }

    pub fn kernel() -> Option<Kernel> {
        available().then_some(Kernel::amx(
            amx_kernel,
            Some((hw_tiles::begin, hw_tiles::end)),
        ))
    }

    fn probe() -> Result<(), &'static str> {
        use core::arch::x86_64::{__cpuid, __cpuid_count};

        const NO_AMX: &str =
            "the CPU has no AMX-BF16 and AMX-TILE (Intel Sapphire Rapids or later Xeons)";
        if __cpuid(0).eax < 7 {
            return Err(NO_AMX);
        }
        let edx = __cpuid_count(7, 0).edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return Err(NO_AMX);
        }
        // OSXSAVE: the OS manages extended state, and XGETBV may be used.
        if __cpuid(1).ecx & (1 << 27) == 0 {
            return Err(
                "the operating system has not enabled XSAVE (CPUID OSXSAVE), which AMX needs",
            );
        }
        // SAFETY: OSXSAVE is set, so XGETBV (the `xsave` feature) is available.
        let xcr0 = unsafe { xcr0() };
        if xcr0 & (1 << 17) == 0 || xcr0 & (1 << 18) == 0 {
            return Err(
                "the operating system has not enabled the AMX tile state (XCR0 bits 17 and 18)",
            );
        }
        request_tile_state()
    }

    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        core::arch::x86_64::_xgetbv(0)
    }

    /// Linux gives a process the AMX tile data state only when it asks:
    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`.
    #[cfg(target_os = "linux")]
    fn request_tile_state() -> Result<(), &'static str> {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and touches no
        // memory of ours; it only changes which extended states the process may use.
        let r = unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err("Linux refused this process the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM needs Linux 5.16 or later)")
        }
    }

    #[cfg(not(target_os = "linux"))]
    fn request_tile_state() -> Result<(), &'static str> {
        Err("the AMX path is used on Linux only, where the process asks the kernel for the tile state")
    }

    /// The AMX tile instructions, one `asm!` each. The compiler never allocates the tile
    /// registers, so they keep their contents from one block to the next; no block uses
    /// any vector register, so nothing here needs AVX-512.
    mod hw_tiles {
        use crate::gemm_bf16::{TileConfig, TILE_CONFIG};
        use core::arch::asm;

        pub struct Tiles(());

        impl Tiles {
            /// The handle of the tiles the session configured.
            ///
            /// # Safety
            /// [`begin`] ran on this thread, and [`end`] not since.
            #[inline(always)]
            pub unsafe fn configured(_cfg: &TileConfig) -> Tiles {
                Tiles(())
            }

            /// # Safety
            /// 16 rows of 64 bytes at `p + r * stride` are readable.
            #[inline(always)]
            pub unsafe fn load<const T: usize>(&mut self, p: *const u8, stride: usize) {
                // SAFETY: the caller guarantees the rows are readable; tile T is
                // configured.
                unsafe {
                    asm!(
                        "tileloadd tmm{t}, [{p} + {s} * 1]",
                        t = const T,
                        p = in(reg) p,
                        s = in(reg) stride,
                        options(nostack, preserves_flags)
                    )
                };
            }

            /// # Safety
            /// 16 rows of 64 bytes at `p + r * stride` are writable.
            #[inline(always)]
            pub unsafe fn store<const T: usize>(&self, p: *mut u8, stride: usize) {
                // SAFETY: the caller guarantees the rows are writable; tile T is
                // configured.
                unsafe {
                    asm!(
                        "tilestored [{p} + {s} * 1], tmm{t}",
                        t = const T,
                        p = in(reg) p,
                        s = in(reg) stride,
                        options(nostack, preserves_flags)
                    )
                };
            }

            /// # Safety
            /// The CPU has AMX-BF16; the tiles are configured.
            #[inline(always)]
            pub unsafe fn dot<const C: usize, const A: usize, const B: usize>(&mut self) {
                // SAFETY: register operands only; the shapes agree by the configuration.
                unsafe {
                    asm!(
                        "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
                        c = const C,
                        a = const A,
                        b = const B,
                        options(nostack, preserves_flags)
                    )
                };
            }
        }

        /// Loads [`TILE_CONFIG`] (the session of the AMX kernel begins).
        ///
        /// # Safety
        /// The CPU has AMX-TILE and the process may use the tile state.
        pub unsafe fn begin() {
            // SAFETY: `TILE_CONFIG` is 64 readable bytes of a valid palette-1
            // configuration.
            unsafe {
                asm!(
                    "ldtilecfg [{}]",
                    in(reg) TILE_CONFIG.0.as_ptr(),
                    options(nostack, preserves_flags)
                )
            };
        }

        /// Gives the tile state back (the registers return to their initial state).
        ///
        /// # Safety
        /// The CPU has AMX-TILE.
        pub unsafe fn end() {
            // SAFETY: TILERELEASE has no operands.
            unsafe { asm!("tilerelease", options(nostack, preserves_flags)) };
        }
    }

    mod hw_amx_ops {
        pub use super::hw_tiles::Tiles;
    }

    amx_kernel!(
        /// The AMX-BF16 micro-kernel (no vector registers: it needs AMX only).
        fn amx_kernel,
        hw_amx_ops
    );
}

#[cfg(not(all(feature = "std", target_arch = "x86_64")))]
mod amx {
    use super::Kernel;

    pub fn available() -> bool {
        false
    }

    pub fn missing() -> &'static str {
        "AMX-BF16 needs an x86-64 CPU and the `std` feature to detect it"
    }

    pub fn kernel() -> Option<Kernel> {
        None
    }
}

#[cfg(all(feature = "std", target_arch = "x86_64"))]
mod avx2 {
    use super::MicroKernel;

    pub const MISSING: &str =
        "the CPU lacks AVX2 or FMA (Intel Haswell, AMD Zen and later have both)";

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    pub fn kernel() -> Option<MicroKernel> {
        available().then_some(avx2_kernel as MicroKernel)
    }

    /// The AVX2 and FMA operations the AVX2 kernel uses.
    mod hw_ops {
        use core::arch::x86_64::*;

        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn load(p: *const f32) -> __m256 {
            // SAFETY: the caller guarantees 8 readable floats.
            unsafe { _mm256_loadu_ps(p) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn store(p: *mut f32, v: __m256) {
            // SAFETY: the caller guarantees 8 writable floats.
            unsafe { _mm256_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn load_words(p: *const u32) -> __m256i {
            // SAFETY: the caller guarantees 8 readable words.
            unsafe { _mm256_loadu_si256(p.cast()) }
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn splat(w: u32) -> __m256i {
            _mm256_set1_epi32(w as i32)
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn even(w: __m256i) -> __m256 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn odd(w: __m256i) -> __m256 {
            _mm256_castsi256_ps(_mm256_and_si256(
                w,
                _mm256_set1_epi32(0xffff_0000_u32 as i32),
            ))
        }
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn fma(a: __m256, b: __m256, acc: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, acc)
        }
    }

    avx2_kernel!(
        /// The AVX2 micro-kernel.
        #[target_feature(enable = "avx2,fma")]
        fn avx2_kernel,
        hw_ops
    );
}

#[cfg(not(all(feature = "std", target_arch = "x86_64")))]
mod avx2 {
    use super::MicroKernel;

    pub const MISSING: &str =
        "AVX2 and FMA need an x86-64 CPU and the `std` feature to detect them";

    pub fn available() -> bool {
        false
    }

    pub fn kernel() -> Option<MicroKernel> {
        None
    }
}

#[cfg(all(feature = "std", target_arch = "x86_64"))]
mod avx512 {
    use super::{KernelTimes, MicroKernel, KC, MR, NR};

    pub const MISSING: &str = "the CPU has no AVX-512 BF16 (avx512f and avx512bf16)";

    pub const MISSING_F: &str = "the CPU has no AVX-512 F";

    pub fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }

    pub fn kernel() -> Option<MicroKernel> {
        available().then_some(avx512_kernel as MicroKernel)
    }

    pub fn fma_available() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
    }

    pub fn fma_kernel() -> Option<MicroKernel> {
        fma_available().then_some(avx512_fma_kernel as MicroKernel)
    }

    /// The two kernels timed on one block, measured on the first call.
    pub fn times() -> Option<KernelTimes> {
        static TIMES: std::sync::OnceLock<Option<KernelTimes>> = std::sync::OnceLock::new();
        *TIMES.get_or_init(|| available().then(time_kernels))
    }

    /// The best of seven timings of each kernel on an `MR × NR` block, `KC` deep, its
    /// panels in L1 (the two kernels take turns, so that a change of clock or load falls
    /// on both).
    fn time_kernels() -> KernelTimes {
        use std::time::Instant;
        const PAIRS: usize = KC / 2;
        const CALLS: u32 = 64;
        // Every bf16 1.0 (0x3f80): normal values, no subnormal slow path.
        let b = std::vec![0x3f80_3f80u32; PAIRS * NR];
        let a_pairs = std::vec![0x3f80_3f80u32; MR * PAIRS];
        let a_wide = std::vec![1.0f32.to_bits(); MR * 2 * PAIRS];
        let mut c = [0.0f32; MR * NR];
        let runs: [(MicroKernel, &[u32], usize); 2] = [
            (avx512_kernel, &a_pairs, PAIRS),
            (avx512_fma_kernel, &a_wide, 2 * PAIRS),
        ];
        let mut best = [f64::INFINITY; 2];
        for _ in 0..7 {
            for ((kernel, a, lda), best) in runs.iter().zip(&mut best) {
                let start = Instant::now();
                for _ in 0..CALLS {
                    // SAFETY: the CPU has AVX-512 F and BF16 (`available`, checked by the
                    // caller); `a` holds `MR` rows of `lda` words, `b` `PAIRS * NR`
                    // words, `c` the `MR × NR` block with row stride `NR`.
                    unsafe {
                        kernel(
                            PAIRS,
                            a.as_ptr(),
                            *lda,
                            b.as_ptr(),
                            c.as_mut_ptr(),
                            NR,
                            true,
                        )
                    };
                    core::hint::black_box(&mut c);
                }
                *best = best.min(start.elapsed().as_secs_f64() * 1e9 / f64::from(CALLS));
            }
        }
        KernelTimes {
            avx512_bf16_ns: best[0],
            avx512_fma_ns: best[1],
        }
    }

    /// The AVX-512 F operations of the `avx512-fma` kernel (`fma_kernel!`).
    mod hw_fma_ops {
        use core::arch::x86_64::*;

        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn load(p: *const f32) -> __m512 {
            // SAFETY: the caller guarantees 16 readable floats.
            unsafe { _mm512_loadu_ps(p) }
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn store(p: *mut f32, v: __m512) {
            // SAFETY: the caller guarantees 16 writable floats.
            unsafe { _mm512_storeu_ps(p, v) }
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn load_pairs(p: *const u32) -> __m512i {
            // SAFETY: the caller guarantees 16 readable words.
            unsafe { _mm512_loadu_si512(p.cast()) }
        }
        /// Each word's even (low) bf16, widened: a shift.
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn even(w: __m512i) -> __m512 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
        }
        /// Each word's odd (high) bf16, widened: a mask.
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn odd(w: __m512i) -> __m512 {
            _mm512_castsi512_ps(_mm512_and_si512(
                w,
                _mm512_set1_epi32(0xffff_0000_u32 as i32),
            ))
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn broadcast_f32(p: *const u32) -> __m512 {
            // SAFETY: the caller guarantees a readable word.
            _mm512_set1_ps(f32::from_bits(unsafe { *p }))
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        pub unsafe fn fma(a: __m512, b: __m512, acc: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, acc)
        }
    }

    fma_kernel!(
        /// The AVX-512 F micro-kernel of the `avx512-fma` path.
        #[target_feature(enable = "avx512f")]
        fn avx512_fma_kernel,
        hw_fma_ops
    );

    /// The AVX-512 BF16 operations of the vector kernel: `hw_fma_ops`' loads and stores,
    /// the pairs typed as bf16, and `dot` one `VDPBF16PS` (the reference the assembly
    /// loop of [`avx512_kernel`] is tested against).
    #[cfg(test)]
    mod hw_ops {
        use core::arch::x86_64::*;

        pub use super::hw_fma_ops::{load, store, zero};

        #[inline]
        #[target_feature(enable = "avx512f,avx512bf16")]
        pub unsafe fn load_pairs(p: *const u32) -> __m512bh {
            // SAFETY: the caller guarantees 16 readable words; a vector of 32 bf16 has
            // the size and layout of a vector of 16 words.
            unsafe { core::mem::transmute::<__m512i, __m512bh>(super::hw_fma_ops::load_pairs(p)) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bf16")]
        pub unsafe fn broadcast(w: u32) -> __m512bh {
            // SAFETY: the same size and layout, as above.
            unsafe { core::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(w as i32)) }
        }
        #[inline]
        #[target_feature(enable = "avx512f,avx512bf16")]
        pub unsafe fn dot(acc: __m512, a: __m512bh, b: __m512bh) -> __m512 {
            _mm512_dpbf16_ps(acc, a, b)
        }
    }

    #[cfg(test)]
    vector_kernel!(
        /// The vector kernel on the AVX-512 BF16 intrinsics, as the compiler schedules it.
        #[target_feature(enable = "avx512f,avx512bf16")]
        fn avx512_intrinsics_kernel,
        hw_ops
    );

    /// [`avx512_intrinsics_kernel`] where the CPU has AVX-512 BF16.
    #[cfg(test)]
    pub fn intrinsics_kernel() -> Option<MicroKernel> {
        available().then_some(avx512_intrinsics_kernel as MicroKernel)
    }

    /// The AVX-512 BF16 micro-kernel: the vector kernel's `MR × NR` block and order of
    /// additions (one `VDPBF16PS` per accumulator and pair, pairs in order), its loop over
    /// `k` written out so that each `VDPBF16PS` takes its A word straight from memory,
    /// broadcast by the instruction itself (`m32bcst`), instead of a broadcast into a
    /// register that two instructions then read. The bits are the same (each product of
    /// a pair is exact, whichever operand comes first); README's bf16 section says what
    /// it was measured to gain, and how.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn avx512_kernel(
        pairs: usize,
        a: *const u32,
        lda: usize,
        b: *const u32,
        c: *mut f32,
        ldc: usize,
        zero: bool,
    ) {
        use super::{MR, NR};
        use core::arch::x86_64::*;
        const _: () = assert!(MR == 8 && NR == 32, "the loop below is written for 8 x 32");
        if pairs == 0 {
            return;
        }
        // SAFETY (whole body): the caller guarantees `MR` rows of `pairs` words at
        // `a + i * lda`, `pairs * NR` words at `b`, and that `MR` rows of `NR` floats at
        // `c + i * ldc` are readable and writable; the loop reads word `p < pairs` of each
        // row of A and the `NR` words of pair `p` of B, and nothing else.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; MR];
            if !zero {
                for (i, row) in acc.iter_mut().enumerate() {
                    row[0] = _mm512_loadu_ps(c.add(i * ldc));
                    row[1] = _mm512_loadu_ps(c.add(i * ldc + 16));
                }
            }
            core::arch::asm!(
                "2:",
                "vmovups {b0}, [{b}]",
                "vmovups {b1}, [{b} + 64]",
                "vdpbf16ps {c00}, {b0}, dword ptr [{a0} + {p}]{{1to16}}",
                "vdpbf16ps {c01}, {b1}, dword ptr [{a0} + {p}]{{1to16}}",
                "vdpbf16ps {c10}, {b0}, dword ptr [{a1} + {p}]{{1to16}}",
                "vdpbf16ps {c11}, {b1}, dword ptr [{a1} + {p}]{{1to16}}",
                "vdpbf16ps {c20}, {b0}, dword ptr [{a2} + {p}]{{1to16}}",
                "vdpbf16ps {c21}, {b1}, dword ptr [{a2} + {p}]{{1to16}}",
                "vdpbf16ps {c30}, {b0}, dword ptr [{a3} + {p}]{{1to16}}",
                "vdpbf16ps {c31}, {b1}, dword ptr [{a3} + {p}]{{1to16}}",
                "vdpbf16ps {c40}, {b0}, dword ptr [{a4} + {p}]{{1to16}}",
                "vdpbf16ps {c41}, {b1}, dword ptr [{a4} + {p}]{{1to16}}",
                "vdpbf16ps {c50}, {b0}, dword ptr [{a5} + {p}]{{1to16}}",
                "vdpbf16ps {c51}, {b1}, dword ptr [{a5} + {p}]{{1to16}}",
                "vdpbf16ps {c60}, {b0}, dword ptr [{a6} + {p}]{{1to16}}",
                "vdpbf16ps {c61}, {b1}, dword ptr [{a6} + {p}]{{1to16}}",
                "vdpbf16ps {c70}, {b0}, dword ptr [{a7} + {p}]{{1to16}}",
                "vdpbf16ps {c71}, {b1}, dword ptr [{a7} + {p}]{{1to16}}",
                "add {b}, 128",
                "add {p}, 4",
                "cmp {p}, {end}",
                "jne 2b",
                a0 = in(reg) a,
                a1 = in(reg) a.add(lda),
                a2 = in(reg) a.add(2 * lda),
                a3 = in(reg) a.add(3 * lda),
                a4 = in(reg) a.add(4 * lda),
                a5 = in(reg) a.add(5 * lda),
                a6 = in(reg) a.add(6 * lda),
                a7 = in(reg) a.add(7 * lda),
                b = inout(reg) b => _,
                p = inout(reg) 0usize => _,
                end = in(reg) pairs * 4,
                b0 = out(zmm_reg) _,
                b1 = out(zmm_reg) _,
                c00 = inout(zmm_reg) acc[0][0],
                c01 = inout(zmm_reg) acc[0][1],
                c10 = inout(zmm_reg) acc[1][0],
                c11 = inout(zmm_reg) acc[1][1],
                c20 = inout(zmm_reg) acc[2][0],
                c21 = inout(zmm_reg) acc[2][1],
                c30 = inout(zmm_reg) acc[3][0],
                c31 = inout(zmm_reg) acc[3][1],
                c40 = inout(zmm_reg) acc[4][0],
                c41 = inout(zmm_reg) acc[4][1],
                c50 = inout(zmm_reg) acc[5][0],
                c51 = inout(zmm_reg) acc[5][1],
                c60 = inout(zmm_reg) acc[6][0],
                c61 = inout(zmm_reg) acc[6][1],
                c70 = inout(zmm_reg) acc[7][0],
                c71 = inout(zmm_reg) acc[7][1],
                options(nostack, readonly),
            );
            for (i, row) in acc.iter().enumerate() {
                _mm512_storeu_ps(c.add(i * ldc), row[0]);
                _mm512_storeu_ps(c.add(i * ldc + 16), row[1]);
            }
        }
    }
}

#[cfg(not(all(feature = "std", target_arch = "x86_64")))]
mod avx512 {
    use super::MicroKernel;

    pub const MISSING: &str = "AVX-512 BF16 needs an x86-64 CPU and the `std` feature to detect it";

    pub const MISSING_F: &str = "AVX-512 F needs an x86-64 CPU and the `std` feature to detect it";

    pub fn available() -> bool {
        false
    }

    pub fn kernel() -> Option<MicroKernel> {
        None
    }

    pub fn fma_available() -> bool {
        false
    }

    pub fn fma_kernel() -> Option<MicroKernel> {
        None
    }

    pub fn times() -> Option<super::KernelTimes> {
        None
    }

    #[cfg(all(test, feature = "std"))]
    pub fn intrinsics_kernel() -> Option<MicroKernel> {
        None
    }
}

/// An `m × k` A and a `k × n` B over `a` and `b` in each layout the backend multiplies:
/// both row-major (NN), B given as its transpose (NT), A given as its transpose (TN).
#[cfg(test)]
pub(crate) fn each_layout<'a>(
    a: &'a [bf16],
    b: &'a [bf16],
    (m, n, k): (usize, usize, usize),
) -> [(MatRef<'a>, MatRef<'a>); 3] {
    let row_major = |data, rows, cols| MatRef::row_major(data, rows, cols).expect("in range");
    [
        (row_major(a, m, k), row_major(b, k, n)),
        (row_major(a, m, k), row_major(b, n, k).t()),
        (row_major(a, k, m).t(), row_major(b, k, n)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &MatRef<'_>, b: &MatRef<'_>, c: &mut [f32], ldc: usize) {
        for i in 0..a.rows {
            for j in 0..b.cols {
                let mut acc = c[i * ldc + j];
                for k in 0..a.cols {
                    acc += widen(a.bits(i, k)) * widen(b.bits(k, j));
                }
                c[i * ldc + j] = acc;
            }
        }
    }

    fn values(n: usize, seed: u32) -> Vec<bf16> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                bf16::from_f32((s % 2001) as f32 / 1000.0 - 1.0)
            })
            .collect()
    }

    #[test]
    fn the_modelled_vector_kernel_is_within_the_accumulation_bound_across_block_edges() {
        // Shapes across MR, NR, KC, MC and NC edges, odd k.
        for &(m, n, k) in &[(1, 1, 1), (9, 33, 257), (130, 40, 3), (3, 1030, 5)] {
            let a_data = values(m * k, 1);
            let b_data = values(k * n, 2);
            let a = MatRef::row_major(&a_data, m, k).unwrap();
            let b = MatRef::row_major(&b_data, k, n).unwrap();
            let mut want = vec![0.5f32; m * n];
            naive(&a, &b, &mut want, n);
            let mut got = vec![0.5f32; m * n];
            drive(
                Kernel::vector(modelled_vector_kernel),
                a,
                b,
                &mut got,
                n,
                true,
            )
            .unwrap();
            for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                let bound = 4.0 * (k as f32 + 1.0) * f32::EPSILON * (k as f32 + 0.5);
                assert!(
                    (g - w).abs() <= bound,
                    "({m},{n},{k}) element {idx}: {g} vs {w}"
                );
            }
        }
    }

    /// The assembly loop of the AVX-512 BF16 kernel gives the bits of the same kernel on
    /// the intrinsics, as the compiler schedules it (the same instructions, in the same
    /// order per accumulator), across row, column and `k` block edges, the three layouts
    /// and both starts of C; on a CPU without AVX-512 BF16 it says so and checks nothing.
    #[test]
    #[cfg(feature = "std")]
    fn the_assembly_avx512_kernel_gives_the_intrinsics_kernels_bits() {
        let (Ok(asm), Some(intrinsics)) = (
            kernel_for(Bf16Path::Avx512Bf16),
            avx512::intrinsics_kernel(),
        ) else {
            std::println!("SKIPPED: {}", avx512::MISSING);
            return;
        };
        let reference = Kernel::vector(intrinsics);
        for &(m, n, k) in &[
            (1, 1, 1),
            (9, 33, 257),
            (MC + MR + 3, 2 * NR + 5, 2 * KC + 3),
        ] {
            let a_data = values(m * k, 3);
            let b_data = values(k * n, 4);
            let layouts = each_layout(&a_data, &b_data, (m, n, k));
            for (layout, &(a, b)) in layouts.iter().enumerate() {
                for accumulate in [false, true] {
                    let c0: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 * 0.25 - 0.5).collect();
                    let (mut want, mut got) = (c0.clone(), c0);
                    drive(reference, a, b, &mut want, n, accumulate).unwrap();
                    drive(asm, a, b, &mut got, n, accumulate).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert!(
                        bits(&got) == bits(&want),
                        "({m},{n},{k}) layout {layout}, accumulate {accumulate}"
                    );
                }
            }
        }
    }

    /// `a` copied into a fresh buffer at an element offset that puts its first element on
    /// a 4-byte boundary (`aligned`) or off one; the buffer and the offset.
    fn placed(a: &[bf16], aligned: bool) -> (Vec<bf16>, usize) {
        let mut store = vec![bf16::ZERO; a.len() + 1];
        let on_boundary = (store.as_ptr() as usize).is_multiple_of(4);
        let offset = usize::from(on_boundary != aligned);
        store[offset..offset + a.len()].copy_from_slice(a);
        (store, offset)
    }

    #[test]
    fn an_a_read_in_place_gives_the_bits_of_the_same_a_packed() {
        // k even and whole AMX steps in every block, so that every kernel may read A in
        // place; m past a whole number of panels, so that the last rows are packed even
        // then.
        let (m, n, k) = (MC + AMX_MR + 9, NR + 5, KC + 4 * AMX_PAIRS);
        let a_data = values(m * k, 5);
        let b_data = values(k * n, 6);
        let b = MatRef::row_major(&b_data, k, n).unwrap();
        let mut kernels = vec![
            ("portable", PORTABLE),
            ("vector model", Kernel::vector(modelled_vector_kernel)),
            ("AVX2 model", Kernel::avx2(modelled_avx2_kernel)),
            ("AMX model", Kernel::amx(modelled_amx_kernel, None)),
        ];
        for path in Bf16Path::runnable() {
            let kernel = kernel_for(path).unwrap();
            if kernel.a_width == 1 {
                kernels.push((path.name(), kernel));
            }
        }
        let (in_place, at) = placed(&a_data, true);
        let (packed, packed_at) = placed(&a_data, false);
        let a = MatRef::row_major(&in_place[at..], m, k).unwrap();
        let a_packed = MatRef::row_major(&packed[packed_at..], m, k).unwrap();
        for (name, kernel) in kernels {
            assert!(
                direct_a(&a, 0, KC, kernel).is_some(),
                "{name}: read in place"
            );
            assert!(
                direct_a(&a_packed, 0, KC, kernel).is_none(),
                "{name}: packed"
            );
            for accumulate in [false, true] {
                let mut want = vec![0.25f32; m * n];
                drive(kernel, a_packed, b, &mut want, n, accumulate).unwrap();
                let mut got = vec![0.25f32; m * n];
                drive(kernel, a, b, &mut got, n, accumulate).unwrap();
                let bits = |c: &[f32]| c.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{name}, accumulate {accumulate}");
            }
        }
        // A kernel that reads A widened to f32 never reads it in place.
        let wide = Kernel::wide_a(modelled_fma_kernel);
        assert!(direct_a(&a, 0, KC, wide).is_none());
        // Neither an odd row stride nor an odd k block is read in place.
        let odd_rows = MatRef::strided(&in_place[at..], m, k - 1, k - 1, 1).unwrap();
        assert!(direct_a(&odd_rows, 0, KC, PORTABLE).is_none());
        assert!(direct_a(&a, 0, KC - 1, PORTABLE).is_none());
        // A k block of pairs that is not whole AMX steps is packed on that path only.
        let amx = Kernel::amx(modelled_amx_kernel, None);
        assert!(direct_a(&a, 0, 2 * AMX_PAIRS + 2, amx).is_none());
        assert!(direct_a(&a, 0, 2 * AMX_PAIRS + 2, PORTABLE).is_some());
    }

    #[test]
    fn the_portable_path_equals_the_widened_f32_product_bit_for_bit() {
        let (m, n, k) = (17, 35, 261);
        let a_data = values(m * k, 3);
        let b_data = values(n * k, 4);
        let a = MatRef::row_major(&a_data, m, k).unwrap();
        let b = MatRef::row_major(&b_data, n, k).unwrap().t();
        let mut want = vec![0.0f32; m * n];
        naive(&a, &b, &mut want, n);
        let mut got = vec![1.0f32; m * n];
        gemm_bf16(Bf16Path::Portable, a, b, &mut got, n, false).unwrap();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn the_model_of_vdpbf16ps_adds_the_high_pair_first_and_flushes_subnormals() {
        let big = bf16::from_f32(1.0e8);
        let one = bf16::ONE;
        // a = (1, big) times b = (1, 1) onto -big: the high product cancels first, then 1
        // is added exactly (the other order would lose the 1 against big).
        let out = model_ops::dot(
            [-big.to_f32(); 16],
            [pair(one, big); 16],
            [pair(one, one); 16],
        );
        assert_eq!(out, [1.0; 16]);
        let tiny = f32::MIN_POSITIVE / 4.0;
        assert_eq!(model_ops::dot([tiny; 16], [0; 16], [0; 16]), [0.0; 16]);
    }
}
