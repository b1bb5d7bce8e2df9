//! The model's generic f32 operations (`ptx/model_ops.ptx`): the GPU twins of
//! the ops of `ringtrain_model::Backend` that have no kernel family of their
//! own (fill, embedding gather and scatter-add, column sums, bias add,
//! sigmoid/tanh and their gradients, elementwise add/mul, sum), and the
//! transpose a GEMM of two transposed operands copies one of them with.
//!
//! The embedding operations take their ids as a `RowIds`: checked against a
//! row bound and uploaded (with the grouping the scatter needs) once, then
//! used by any number of launches.
//!
//! All are bit-identical to the CPU backend except `unary_sigmoid` /
//! `unary_tanh` (ex2.approx, 1e-6 absolute, like `ptx/lstm.ptx`), [`sum`]
//! (f64 per block, rounded to f32 per block; see the PTX header for the bound)
//! and `column_sums_chunked` on more than `COLUMN_SUM_CHUNK_ROWS` rows
//! (deterministic chunked sums, re-associated against the CPU's row order).

use crate::signature::{KernelSignature, Param::*, PtxModule};

/// The PTX text of `ptx/model_ops.ptx`.
pub const PTX: &str = include_str!("../../../ptx/model_ops.ptx");

const UNARY: &[crate::signature::Param] = &[Ptr, Ptr, U32];
const BINARY: &[crate::signature::Param] = &[Ptr, Ptr, Ptr, U32];

/// Every entry of `ptx/model_ops.ptx`.
pub const KERNELS: &[KernelSignature] = &[
    KernelSignature {
        name: "fill",
        params: &[Ptr, F32, U32],
    },
    KernelSignature {
        name: "gather_rows",
        params: &[Ptr, Ptr, Ptr, U32, U32, U32],
    },
    KernelSignature {
        name: "scatter_add_rows",
        params: &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32],
    },
    KernelSignature {
        name: "column_sums",
        params: &[Ptr, Ptr, U32, U32, U32],
    },
    KernelSignature {
        name: "column_sums_partial",
        params: &[Ptr, Ptr, U32, U32, U32],
    },
    KernelSignature {
        name: "column_sums_combine",
        params: &[Ptr, Ptr, U32, U32, U32],
    },
    KernelSignature {
        name: "add_row_bias",
        params: &[Ptr, Ptr, U32, U32],
    },
    KernelSignature {
        name: "unary_sigmoid",
        params: UNARY,
    },
    KernelSignature {
        name: "unary_tanh",
        params: UNARY,
    },
    KernelSignature {
        name: "binary_add",
        params: BINARY,
    },
    KernelSignature {
        name: "binary_mul",
        params: BINARY,
    },
    KernelSignature {
        name: "in_place_add",
        params: UNARY,
    },
    KernelSignature {
        name: "in_place_mul_sigmoid_grad",
        params: UNARY,
    },
    KernelSignature {
        name: "in_place_mul_tanh_grad",
        params: UNARY,
    },
    KernelSignature {
        name: "sum_partials",
        params: UNARY,
    },
    KernelSignature {
        name: "transpose",
        params: &[Ptr, Ptr, U32, U32, U32],
    },
];

/// `ptx/model_ops.ptx` with its declarations.
pub const MODULE: PtxModule = PtxModule {
    name: "model_ops",
    file: "ptx/model_ops.ptx",
    text: PTX,
    kernels: KERNELS,
};

#[cfg(feature = "cuda")]
pub use launchers::*;

#[cfg(feature = "cuda")]
mod launchers {
    use super::MODULE;
    use crate::error::{check_len, kernel_count, kernel_product, Error, Result};
    use crate::memory::{AsDevSlice, AsDevSliceMut, DevSlice, GpuBuffer};
    use crate::runtime::{Gpu, KernelArg, LaunchConfig, GRID_STRIDE_BLOCK as BLOCK};

    /// Row ids on the device for [`gather_rows`] and [`scatter_add_rows`].
    ///
    /// Built only by [`RowIds::stage`], which checks every id against a bound on the host
    /// and uploads, in one device buffer, the ids and the grouping the scatter launches
    /// with: the rows ordered by id (a stable counting sort), cut into one segment per
    /// distinct id. So a launcher can rely on what the buffer holds without reading it,
    /// and the ids cross to the device once for any number of launches.
    /// [`RowIds::into_storage`] hands the buffer back for the next staging.
    pub struct RowIds {
        /// `ids (rows) | order (rows) | seg_start (segments + 1) | seg_id (segments)`.
        storage: GpuBuffer<u32>,
        rows: usize,
        bound: usize,
        segments: usize,
    }

    impl std::fmt::Debug for RowIds {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("RowIds")
                .field("rows", &self.rows)
                .field("bound", &self.bound)
                .field("segments", &self.segments)
                .finish()
        }
    }

    impl RowIds {
        /// Checks that every id is below `bound`, groups the rows by id, and uploads ids
        /// and grouping into `storage` (reallocated, to a power of two, when it is too
        /// small: pass a zero-length buffer to allocate). Waits for the stream, like every
        /// upload.
        ///
        /// Host work is O(ids + largest id): the grouping counts ids by value.
        ///
        /// # Errors
        /// `InvalidValue` naming the first id `>= bound`; `TooLarge` when `bound` or the
        /// number of ids does not fit the kernels' 32-bit indices; GPU errors.
        pub fn stage(
            gpu: &Gpu,
            ids: &[u32],
            bound: usize,
            storage: GpuBuffer<u32>,
        ) -> Result<RowIds> {
            let rows = ids.len();
            kernel_count("bound", bound)?;
            kernel_count("rows", rows)?;
            let mut top = 0u32;
            for (r, &id) in ids.iter().enumerate() {
                if id as usize >= bound {
                    return Err(Error::InvalidValue {
                        name: "ids",
                        value: format!("ids[{r}] = {id} (bound {bound})"),
                        reason:
                            "every id must be below the bound (the embedding table's row count)",
                    });
                }
                top = top.max(id);
            }
            // Stable counting sort of the row indices by id.
            let values = if rows == 0 { 0 } else { top as usize + 1 };
            let mut counts = vec![0u32; values + 1];
            for &id in ids {
                counts[id as usize + 1] += 1;
            }
            for i in 1..counts.len() {
                counts[i] += counts[i - 1];
            }
            let mut host = Vec::with_capacity(4 * rows + 1);
            host.extend_from_slice(ids);
            host.resize(2 * rows, 0);
            let mut next = counts.clone();
            for (r, &id) in ids.iter().enumerate() {
                host[rows + next[id as usize] as usize] = r as u32;
                next[id as usize] += 1;
            }
            let distinct: Vec<u32> = (0..values as u32)
                .filter(|&id| counts[id as usize + 1] > counts[id as usize])
                .collect();
            host.extend(distinct.iter().map(|&id| counts[id as usize]));
            host.push(rows as u32);
            host.extend_from_slice(&distinct);
            let mut storage = storage;
            if storage.len() < host.len() {
                drop(storage); // free the old one first
                storage = gpu.alloc::<u32>(host.len().next_power_of_two())?;
            }
            gpu.copy_from_host(&host, &mut storage.slice_mut(0..host.len())?)?;
            Ok(RowIds {
                storage,
                rows,
                bound,
                segments: distinct.len(),
            })
        }

        /// Number of ids.
        pub fn rows(&self) -> usize {
            self.rows
        }

        /// Every id is below this.
        pub fn bound(&self) -> usize {
            self.bound
        }

        /// Number of distinct ids.
        pub fn segments(&self) -> usize {
            self.segments
        }

        /// The device buffer, for the next [`RowIds::stage`].
        pub fn into_storage(self) -> GpuBuffer<u32> {
            self.storage
        }

        /// Part `start..start + len` of the storage.
        fn part(&self, start: usize, len: usize) -> Result<DevSlice<'_, u32>> {
            self.storage.slice(start..start + len)
        }

        /// A table of `table_rows` rows holds every id.
        fn check_table(&self, table_rows: usize) -> Result<()> {
            if self.bound > table_rows {
                return Err(Error::InvalidValue {
                    name: "table_rows",
                    value: format!("{table_rows} (ids checked against {})", self.bound),
                    reason: "the ids were staged for a larger table: stage them with a bound of at most table_rows",
                });
            }
            Ok(())
        }
    }

    /// `dst[i] = value`.
    pub fn fill(gpu: &Gpu, dst: &mut impl AsDevSliceMut<f32>, value: f32) -> Result<()> {
        let dst = dst.dev_slice_mut();
        let n = kernel_count("dst", dst.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg_mut("dst", &dst)?,
            KernelArg::F32(value),
            KernelArg::U32(n),
        ];
        // SAFETY: a live view of n elements on this GPU, borrowed mutably.
        unsafe { gpu.launch(&MODULE, "fill", gpu.grid_stride(dst.len()), &args) }
    }

    /// Embedding lookup: `dst[r, :] = table[ids[r], :]` (`table` is
    /// `[table_rows, width]` with `table_rows >= ids.bound()`, `dst` is
    /// `[ids.rows(), width]`).
    pub fn gather_rows(
        gpu: &Gpu,
        table: &impl AsDevSlice<f32>,
        ids: &RowIds,
        dst: &mut impl AsDevSliceMut<f32>,
        table_rows: usize,
        width: usize,
    ) -> Result<()> {
        let (table, dst) = (table.dev_slice(), dst.dev_slice_mut());
        let rows = ids.rows();
        check_len(
            "table",
            kernel_product("table_rows * width", table_rows, width)?,
            table.len(),
        )?;
        let n = kernel_product("rows * width", rows, width)?;
        check_len("dst", n, dst.len())?;
        ids.check_table(table_rows)?;
        if n == 0 {
            return Ok(());
        }
        let ids_view = ids.part(0, rows)?;
        let args = [
            gpu.arg("table", &table)?,
            gpu.arg("ids", &ids_view)?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(table_rows as u32),
            KernelArg::U32(width as u32),
            KernelArg::U32(rows as u32),
        ];
        // SAFETY: live, length-checked views on this GPU; `ids_view` holds `rows` ids,
        // each below ids.bound() <= table_rows (a RowIds is only built by checking them),
        // and the kernel also compares every id with table_rows before it reads the table
        // (an id outside it yields a NaN row); dst is borrowed mutably.
        unsafe { gpu.launch(&MODULE, "gather_rows", gpu.grid_stride(n), &args) }
    }

    /// Embedding gradient: `table[ids[r], :] += src[r, :]` for r = 0, 1, ... in
    /// order (bit-identical to the CPU loop). The rows come grouped by id (staged
    /// with the ids), so each table row is updated by one thread per column
    /// without atomics.
    pub fn scatter_add_rows(
        gpu: &Gpu,
        src: &impl AsDevSlice<f32>,
        ids: &RowIds,
        table: &mut impl AsDevSliceMut<f32>,
        table_rows: usize,
        width: usize,
    ) -> Result<()> {
        let (src, table) = (src.dev_slice(), table.dev_slice_mut());
        let rows = ids.rows();
        check_len(
            "src",
            kernel_product("rows * width", rows, width)?,
            src.len(),
        )?;
        check_len(
            "table",
            kernel_product("table_rows * width", table_rows, width)?,
            table.len(),
        )?;
        ids.check_table(table_rows)?;
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let segments = ids.segments();
        let work = kernel_product("segments * width", segments, width)?;
        let (order_v, start_v, id_v) = (
            ids.part(rows, rows)?,
            ids.part(2 * rows, segments + 1)?,
            ids.part(2 * rows + segments + 1, segments)?,
        );
        let args = [
            gpu.arg("src", &src)?,
            gpu.arg("order", &order_v)?,
            gpu.arg("seg_start", &start_v)?,
            gpu.arg("seg_id", &id_v)?,
            gpu.arg_mut("table", &table)?,
            KernelArg::U32(table_rows as u32),
            KernelArg::U32(width as u32),
            KernelArg::U32(segments as u32),
        ];
        // SAFETY: live, length-checked views on this GPU; the grouping was built by
        // RowIds::stage from the checked ids: order is a permutation of 0..rows,
        // seg_start has segments + 1 ascending entries from 0 to rows, and seg_id holds
        // distinct ids below ids.bound() <= table_rows (the kernel also skips a segment
        // whose id is not below table_rows); table is borrowed mutably and each
        // (segment, column) element is written by one thread.
        unsafe { gpu.launch(&MODULE, "scatter_add_rows", gpu.grid_stride(work), &args) }
    }

    /// `dst = srcᵀ`: `dst[c * rows + r] = src[r * ld + c]` for a `[rows, cols]` matrix
    /// stored with row stride `ld` (`src` holds at least `(rows - 1) * ld + cols`
    /// elements); `dst` is the dense `[cols, rows]` transpose. Bit-exact (moves only).
    pub fn transpose(
        gpu: &Gpu,
        src: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
        rows: usize,
        cols: usize,
        ld: usize,
    ) -> Result<()> {
        let (src, dst) = (src.dev_slice(), dst.dev_slice_mut());
        let n = kernel_product("rows * cols", rows, cols)?;
        check_len("dst", n, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        if ld < cols {
            return Err(Error::InvalidValue {
                name: "ld",
                value: format!("{ld} (cols = {cols})"),
                reason: "the row stride must be at least the row length",
            });
        }
        let ld32 = kernel_count("ld", ld)?;
        let needed = (rows - 1)
            .checked_mul(ld)
            .and_then(|x| x.checked_add(cols))
            .ok_or(Error::TooLarge {
                arg: "(rows - 1) * ld + cols",
                value: usize::MAX,
                limit: usize::MAX,
            })?;
        if src.len() < needed {
            return Err(Error::TooShort {
                arg: "src",
                needed,
                actual: src.len(),
            });
        }
        let args = [
            gpu.arg("src", &src)?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(rows as u32),
            KernelArg::U32(cols as u32),
            KernelArg::U32(ld32),
        ];
        // SAFETY: live views on this GPU: src holds the (rows - 1) * ld + cols elements
        // the kernel reads (r < rows, c < cols, ld >= cols), dst the rows * cols it
        // writes, and dst is borrowed mutably.
        unsafe { gpu.launch(&MODULE, "transpose", gpu.grid_stride(n), &args) }
    }

    /// `dst[c] = (accumulate ? dst[c] : 0) + sum over rows of src[r, c]`, rows in order.
    pub fn column_sums(
        gpu: &Gpu,
        src: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
        rows: usize,
        cols: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (src, dst) = (src.dev_slice(), dst.dev_slice_mut());
        check_len("src", kernel_product("rows * cols", rows, cols)?, src.len())?;
        check_len("dst", cols, dst.len())?;
        let rows32 = kernel_count("rows", rows)?;
        if cols == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg("src", &src)?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(rows32),
            KernelArg::U32(cols as u32),
            KernelArg::U32(accumulate as u32),
        ];
        // SAFETY: live, length-checked views on this GPU; dst borrowed mutably.
        unsafe { gpu.launch(&MODULE, "column_sums", gpu.grid_stride(cols), &args) }
    }

    /// Rows per chunk of [`column_sums_chunked`].
    pub const COLUMN_SUM_CHUNK_ROWS: usize = 256;

    /// Elements of the `partials` scratch [`column_sums_chunked`] needs.
    pub fn column_sums_scratch_len(rows: usize, cols: usize) -> usize {
        rows.div_ceil(COLUMN_SUM_CHUNK_ROWS) * cols
    }

    /// [`column_sums`] for tall matrices (an LSTM bias gradient: batch·steps rows, 4H
    /// columns): sums of chunks of [`COLUMN_SUM_CHUNK_ROWS`] rows on a 2-D grid into
    /// `partials` (at least [`column_sums_scratch_len`] elements), then the chunks in
    /// order. Deterministic; bit-identical to the CPU when `rows` fits one chunk (then it
    /// launches [`column_sums`]), otherwise the sum is re-associated by chunks.
    pub fn column_sums_chunked(
        gpu: &Gpu,
        src: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
        rows: usize,
        cols: usize,
        accumulate: bool,
        partials: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        if rows <= COLUMN_SUM_CHUNK_ROWS {
            return column_sums(gpu, src, dst, rows, cols, accumulate);
        }
        let (src, dst, partials) = (
            src.dev_slice(),
            dst.dev_slice_mut(),
            partials.dev_slice_mut(),
        );
        check_len("src", kernel_product("rows * cols", rows, cols)?, src.len())?;
        check_len("dst", cols, dst.len())?;
        let chunks = rows.div_ceil(COLUMN_SUM_CHUNK_ROWS);
        let needed = kernel_product("chunks * cols", chunks, cols)?;
        if partials.len() < needed {
            return Err(Error::ShapeMismatch {
                arg: "partials",
                expected: needed,
                actual: partials.len(),
            });
        }
        if cols == 0 {
            return Ok(());
        }
        let grid_x = gpu.grid_for(cols, BLOCK);
        let grid_y = chunks.min(65_535) as u32;
        let partial_args = [
            gpu.arg("src", &src)?,
            gpu.arg_mut("partials", &partials)?,
            KernelArg::U32(rows as u32),
            KernelArg::U32(cols as u32),
            KernelArg::U32(COLUMN_SUM_CHUNK_ROWS as u32),
        ];
        let grid_2d = LaunchConfig {
            grid: (grid_x, grid_y, 1),
            block: (BLOCK, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: live, length-checked views on this GPU; partials holds chunks * cols
        // floats and is borrowed mutably; each (chunk, column) is written by one thread.
        unsafe { gpu.launch(&MODULE, "column_sums_partial", grid_2d, &partial_args)? };
        let combine_args = [
            gpu.arg("partials", &partials.as_slice())?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(chunks as u32),
            KernelArg::U32(cols as u32),
            KernelArg::U32(accumulate as u32),
        ];
        // SAFETY: as above; the combine runs after the partial sums on the same stream;
        // dst is borrowed mutably.
        unsafe {
            gpu.launch(
                &MODULE,
                "column_sums_combine",
                gpu.grid_stride(cols),
                &combine_args,
            )
        }
    }

    /// `dst[r, c] += bias[c]`.
    pub fn add_row_bias(
        gpu: &Gpu,
        bias: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let (bias, dst) = (bias.dev_slice(), dst.dev_slice_mut());
        check_len("bias", cols, bias.len())?;
        let n = kernel_product("rows * cols", rows, cols)?;
        check_len("dst", n, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg("bias", &bias)?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(rows as u32),
            KernelArg::U32(cols as u32),
        ];
        // SAFETY: live, length-checked views on this GPU; dst borrowed mutably.
        unsafe { gpu.launch(&MODULE, "add_row_bias", gpu.grid_stride(n), &args) }
    }

    fn unary(
        gpu: &Gpu,
        kernel: &'static str,
        x: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        let (x, dst) = (x.dev_slice(), dst.dev_slice_mut());
        check_len("dst", x.len(), dst.len())?;
        let n = kernel_count("x", x.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg("x", &x)?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(n),
        ];
        // SAFETY: live views of n elements on this GPU; dst borrowed mutably.
        unsafe { gpu.launch(&MODULE, kernel, gpu.grid_stride(x.len()), &args) }
    }

    /// `dst = sigmoid(x)`.
    pub fn unary_sigmoid(
        gpu: &Gpu,
        x: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        unary(gpu, "unary_sigmoid", x, dst)
    }

    /// `dst = tanh(x)`.
    pub fn unary_tanh(
        gpu: &Gpu,
        x: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        unary(gpu, "unary_tanh", x, dst)
    }

    /// `dst += x`.
    pub fn in_place_add(
        gpu: &Gpu,
        x: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        unary(gpu, "in_place_add", x, dst)
    }

    /// `dst *= x * (1 - x)` (x is a sigmoid output).
    pub fn in_place_mul_sigmoid_grad(
        gpu: &Gpu,
        x: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        unary(gpu, "in_place_mul_sigmoid_grad", x, dst)
    }

    /// `dst *= 1 - x * x` (x is a tanh output).
    pub fn in_place_mul_tanh_grad(
        gpu: &Gpu,
        x: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        unary(gpu, "in_place_mul_tanh_grad", x, dst)
    }

    fn binary(
        gpu: &Gpu,
        kernel: &'static str,
        a: &impl AsDevSlice<f32>,
        b: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        let (a, b, dst) = (a.dev_slice(), b.dev_slice(), dst.dev_slice_mut());
        check_len("b", a.len(), b.len())?;
        check_len("dst", a.len(), dst.len())?;
        let n = kernel_count("a", a.len())?;
        if n == 0 {
            return Ok(());
        }
        let args = [
            gpu.arg("a", &a)?,
            gpu.arg("b", &b)?,
            gpu.arg_mut("dst", &dst)?,
            KernelArg::U32(n),
        ];
        // SAFETY: live views of n elements on this GPU; dst borrowed mutably.
        unsafe { gpu.launch(&MODULE, kernel, gpu.grid_stride(a.len()), &args) }
    }

    /// `dst = a + b`.
    pub fn binary_add(
        gpu: &Gpu,
        a: &impl AsDevSlice<f32>,
        b: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        binary(gpu, "binary_add", a, b, dst)
    }

    /// `dst = a * b`.
    pub fn binary_mul(
        gpu: &Gpu,
        a: &impl AsDevSlice<f32>,
        b: &impl AsDevSlice<f32>,
        dst: &mut impl AsDevSliceMut<f32>,
    ) -> Result<()> {
        binary(gpu, "binary_mul", a, b, dst)
    }

    /// Sum of `x`: per-block f64 sums rounded to f32 on the device, added in
    /// f64 on the host. Waits for the stream (it returns a host value).
    pub fn sum(gpu: &Gpu, x: &impl AsDevSlice<f32>) -> Result<f64> {
        let x = x.dev_slice();
        let n = kernel_count("x", x.len())?;
        if n == 0 {
            return Ok(0.0);
        }
        let blocks = x
            .len()
            .div_ceil(BLOCK as usize)
            .min(gpu.multiprocessors() as usize * 4);
        let mut partials = gpu.alloc::<f32>(blocks)?;
        let partials_view = partials.as_mut_slice();
        let args = [
            gpu.arg("x", &x)?,
            gpu.arg_mut("partials", &partials_view)?,
            KernelArg::U32(n),
        ];
        // SAFETY: x is a live view of n elements on this GPU; partials holds
        // one float per block of the launch.
        unsafe {
            gpu.launch(
                &MODULE,
                "sum_partials",
                LaunchConfig::linear(blocks as u32, BLOCK),
                &args,
            )?;
        }
        Ok(partials.to_host()?.iter().map(|&p| f64::from(p)).sum())
    }
}
