//! The CPU backend: ringtrain-kernels for the LSTM and softmax kernels (their `par` twins
//! on more than one thread), the `gemm` crate for matrix products, buffers in `Vec<f32>`.
//!
//! With [`GemmPrecision::Bf16`] ([`CpuBackend::with_precision`]) matrix products take bf16
//! operands and accumulate in f32 (`ringtrain_kernels::gemm_bf16`, on the fastest path the
//! CPU has); everything else stays f32. As on the GPU, the parameters are cast once per
//! pass (the whole parameter buffer, on the first product of the pass that reads it).
//!
//! Activations are cast where they are produced: inside a pass, the operations whose
//! outputs feed matrix products (the embedding's `gather_rows`, the LSTM step's hidden
//! state, the LSTM backward step's gate gradients, the softmax gradient) also write a bf16
//! copy of what they wrote, kept beside the f32 buffer (which the pointwise and backward
//! kernels read) until the pass ends; every product that reads those elements then uses
//! the copy. Any other write to a buffer (every backend operation that writes says what
//! it wrote) drops the copy of the elements written, and a product whose operand is not
//! wholly covered by a copy casts it itself, as do products outside a pass. Either way an
//! operand is the round-to-nearest-even bf16 of the f32 values the product reads, so the
//! results do not depend on where the cast happened ([`CpuBackend::cast_where_produced`]
//! turns it off to compare; [`CpuBackend::bf16_casts`] counts the elements cast where).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rayon::ThreadPool;
use ringtrain_kernels as kernels;
use ringtrain_kernels::bf16;
use ringtrain_kernels::gemm_bf16::{Bf16Path, MatRef, PackedB};

use super::operands::{self, arg, GemmMatrix};
use super::{
    Backend, Binary, CheckedIds, CheckedTargets, Executor, GemmPrecision, InPlace, Layout,
    LstmBackwardStep, LstmForwardStep, Staged, Unary, View, ViewMut,
};
use crate::error::{Error, Result};

/// Token ids staged on the CPU: a copy of the checked ids.
#[derive(Debug, Clone)]
pub struct CpuIds {
    ids: Vec<u32>,
    bound: usize,
}

impl CpuIds {
    /// The ids.
    pub fn as_slice(&self) -> &[u32] {
        &self.ids
    }
}

impl Staged for CpuIds {
    fn rows(&self) -> usize {
        self.ids.len()
    }
    fn bound(&self) -> usize {
        self.bound
    }
}

/// Softmax targets staged on the CPU: copies of the checked labels and mask.
#[derive(Debug, Clone)]
pub struct CpuTargets {
    labels: Vec<u32>,
    mask: Vec<f32>,
    vocab: usize,
}

impl CpuTargets {
    /// The labels, one per row.
    pub fn labels(&self) -> &[u32] {
        &self.labels
    }

    /// The mask weights, one per row.
    pub fn mask(&self) -> &[f32] {
        &self.mask
    }
}

impl Staged for CpuTargets {
    fn rows(&self) -> usize {
        self.labels.len()
    }
    fn bound(&self) -> usize {
        self.vocab
    }
}

/// CPU backend. With one thread every operation runs serially on the caller's thread; with
/// more, the backend owns a rayon pool of that many threads and runs the parallel kernels
/// (bit-identical to the serial ones) and multi-threaded GEMMs inside it.
pub struct CpuBackend {
    threads: usize,
    pool: Option<Arc<ThreadPool>>,
    launches: AtomicU64,
    precision: GemmPrecision,
    cast_where_produced: bool,
    bf16: Mutex<Bf16Operands>,
}

/// Elements cast to bf16 for the matrix products, since the backend was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Bf16Casts {
    /// Parameters (once per pass).
    pub params: u64,
    /// Activations and gradients cast where they were produced.
    pub where_produced: u64,
    /// Operands cast by the product that reads them.
    pub on_products: u64,
}

/// The bf16 copies of matrix-product operands.
#[derive(Default)]
struct Bf16Operands {
    /// The parameter buffer of the pass in progress: address and length.
    pass: Option<(usize, usize)>,
    /// Its bf16 copy, once cast in this pass.
    params: Vec<bf16>,
    params_cast: bool,
    /// Other operands (A, B), cast on every product.
    scratch: [Vec<bf16>; 2],
    /// bf16 copies of what producers wrote in this pass, by buffer (address, length).
    produced: HashMap<(usize, usize), Produced>,
    /// Storage of the last pass's copies, kept for reuse.
    spare: Vec<Vec<bf16>>,
    /// Parameters read as B, packed once per pass for the products that read them (a
    /// recurrent weight is B to every time step), by where and how they are read.
    packed: HashMap<PackedKey, PackedB>,
    casts: Bf16Casts,
}

/// A parameter operand read as B: its first element, row stride, whether it is stored
/// transposed, and its `k × n` shape.
type PackedKey = (usize, usize, bool, usize, usize);

/// The bf16 copy of a buffer's produced elements: `data[i]` is the bf16 of the buffer's
/// element `i` for every `i` in one of the `valid` ranges.
struct Produced {
    data: Vec<bf16>,
    /// Disjoint, in no particular order.
    valid: Vec<Range<usize>>,
}

impl Produced {
    fn covers(&self, range: &Range<usize>) -> bool {
        // Ranges are merged when added, so one range covers all of a covered operand.
        self.valid
            .iter()
            .any(|v| v.start <= range.start && range.end <= v.end)
    }

    fn remove(&mut self, cut: &Range<usize>) {
        let mut kept = Vec::with_capacity(self.valid.len() + 1);
        for v in self.valid.drain(..) {
            if v.end <= cut.start || cut.end <= v.start {
                kept.push(v);
                continue;
            }
            if v.start < cut.start {
                kept.push(v.start..cut.start);
            }
            if cut.end < v.end {
                kept.push(cut.end..v.end);
            }
        }
        self.valid = kept;
    }

    fn add(&mut self, range: Range<usize>) {
        let (mut start, mut end) = (range.start, range.end);
        self.valid.retain(|v| {
            if v.end < start || end < v.start {
                true
            } else {
                start = start.min(v.start);
                end = end.max(v.end);
                false
            }
        });
        self.valid.push(start..end);
    }
}

/// Where an operand's bf16 copy lies.
#[derive(Clone, Copy)]
enum Bf16Source {
    /// In the pass's parameter copy, at the same offsets as in the f32 buffer.
    Params,
    /// In scratch slot `i`, from the operand's first element.
    Scratch(usize),
    /// In the copy made where the buffer (address, length) was produced, at the same
    /// offsets as in the f32 buffer.
    Produced((usize, usize)),
}

fn key(buf: &[f32]) -> (usize, usize) {
    (buf.as_ptr() as usize, buf.len())
}

fn cast_into(src: &[f32], dst: &mut [bf16], parallel: bool) -> kernels::Result<()> {
    if parallel {
        kernels::par::f32_to_bf16(src, dst)
    } else {
        kernels::f32_to_bf16(src, dst)
    }
}

impl Bf16Operands {
    /// Casts what the operand `range` of `buf` needs and says where the copy lies.
    fn prepare(
        &mut self,
        slot: usize,
        buf: &[f32],
        range: Range<usize>,
        parallel: bool,
    ) -> Result<Bf16Source> {
        if self.pass == Some(key(buf)) {
            if !self.params_cast {
                self.params.resize(buf.len(), bf16::ZERO);
                cast_into(buf, &mut self.params, parallel)?;
                self.params_cast = true;
                self.casts.params += buf.len() as u64;
            }
            return Ok(Bf16Source::Params);
        }
        if self
            .produced
            .get(&key(buf))
            .is_some_and(|p| p.covers(&range))
        {
            return Ok(Bf16Source::Produced(key(buf)));
        }
        let dst = &mut self.scratch[slot];
        dst.resize(range.len(), bf16::ZERO);
        self.casts.on_products += range.len() as u64;
        cast_into(&buf[range], dst, parallel)?;
        Ok(Bf16Source::Scratch(slot))
    }

    /// Records that `range` of `buf` was written: its bf16 copy, if any, is stale.
    fn written(&mut self, buf: &[f32], range: &Range<usize>) {
        if let Some(p) = self.produced.get_mut(&key(buf)) {
            p.remove(range);
        }
    }

    /// Casts `range` of `buf`, just written by a producer, into the buffer's bf16 copy (in
    /// a pass; outside one the range is only marked written).
    fn produce(&mut self, buf: &[f32], range: Range<usize>, parallel: bool) -> Result<()> {
        let src = &buf[range.clone()];
        if !self.produce_with(key(buf), range.clone(), |dst| cast_into(src, dst, parallel))? {
            self.written(buf, &range);
        }
        Ok(())
    }

    /// Has `fill` write the bf16 copy of `range` of the buffer `buf` (its [`key`]): a
    /// producer that casts its output as it writes it, instead of a pass over it after.
    /// Returns false, without calling `fill`, outside a pass or for an empty range (the
    /// caller then marks the range written).
    fn produce_with(
        &mut self,
        buf: (usize, usize),
        range: Range<usize>,
        fill: impl FnOnce(&mut [bf16]) -> kernels::Result<()>,
    ) -> Result<bool> {
        if self.pass.is_none() || range.is_empty() {
            return Ok(false);
        }
        let len = buf.1;
        let spare = &mut self.spare;
        let p = self.produced.entry(buf).or_insert_with(|| Produced {
            // The storage of a copy of the same length in the last pass, if any.
            data: match spare.iter().position(|d| d.len() == len) {
                Some(i) => spare.swap_remove(i),
                None => Vec::new(),
            },
            valid: Vec::new(),
        });
        if p.data.len() != len {
            p.data.resize(len, bf16::ZERO);
        }
        p.remove(&range);
        fill(&mut p.data[range.clone()])?;
        self.casts.where_produced += range.len() as u64;
        p.add(range);
        Ok(true)
    }

    /// Drops every produced copy, keeping its storage for the next pass (and only that:
    /// storage the last pass did not reuse is freed, so lengths that change from batch to
    /// batch do not pile up).
    fn forget_produced(&mut self) {
        if self.produced.is_empty() {
            return;
        }
        self.spare.clear();
        for (_, p) in self.produced.drain() {
            self.spare.push(p.data);
        }
    }

    /// The strided view of an operand (`rows × cols`) prepared at `source`.
    fn view(
        &self,
        source: Bf16Source,
        m: &GemmMatrix,
        rows: usize,
        cols: usize,
    ) -> Result<MatRef<'_>> {
        let data: &[bf16] = match source {
            Bf16Source::Params => &self.params[m.range.clone()],
            Bf16Source::Scratch(slot) => &self.scratch[slot],
            Bf16Source::Produced(key) => match self.produced.get(&key) {
                Some(p) => &p.data[m.range.clone()],
                None => unreachable!("a produced copy is kept while its product runs"),
            },
        };
        let (rs, cs) = if m.trans { (1, m.ld) } else { (m.ld, 1) };
        Ok(MatRef::strided(data, rows, cols, rs, cs)?)
    }
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .field("launches", &self.launches())
            .finish()
    }
}

impl CpuBackend {
    /// A CPU backend on `threads` threads (at least 1).
    ///
    /// # Errors
    /// `InvalidValue` when `threads == 0`; `ThreadPool` when the pool cannot start.
    pub fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(crate::error::invalid_value(
                "threads",
                threads,
                "the CPU backend needs at least 1 thread",
            ));
        }
        let pool = if threads > 1 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("ringtrain-cpu-{i}"))
                .build()
                .map_err(|e| Error::ThreadPool {
                    threads,
                    reason: e.to_string(),
                })?;
            Some(Arc::new(pool))
        } else {
            None
        };
        Ok(CpuBackend {
            threads,
            pool,
            launches: AtomicU64::new(0),
            precision: GemmPrecision::F32,
            cast_where_produced: true,
            bf16: Mutex::new(Bf16Operands::default()),
        })
    }

    /// A backend whose matrix products run in `precision`: f32, or bf16 operands with f32
    /// accumulation (see the module docs).
    ///
    /// # Errors
    /// As [`CpuBackend::new`]; `InvalidValue` for f16, which the CPU does not multiply in.
    pub fn with_precision(threads: usize, precision: GemmPrecision) -> Result<Self> {
        if precision == GemmPrecision::F16 {
            return Err(crate::error::invalid_value(
                "precision",
                precision,
                "the CPU backend multiplies in f32 or bf16: use bf16 (or f16 on a GPU)",
            ));
        }
        Ok(CpuBackend {
            precision,
            ..CpuBackend::new(threads)?
        })
    }

    /// The precision of the matrix products.
    pub fn precision(&self) -> GemmPrecision {
        self.precision
    }

    /// Whether activations are cast to bf16 where they are produced (the default; see the
    /// module docs) or by every product that reads them (`false`). The results are the
    /// same bits either way; only the work differs.
    pub fn cast_where_produced(mut self, on: bool) -> Self {
        self.cast_where_produced = on;
        self
    }

    /// Elements cast to bf16 so far, by where they were cast.
    pub fn bf16_casts(&self) -> Bf16Casts {
        self.bf16.lock().unwrap_or_else(|e| e.into_inner()).casts
    }

    /// Records that `range` of `buf` was written (bf16 only).
    fn written(&self, buf: &[f32], range: &Range<usize>) {
        if self.precision == GemmPrecision::Bf16 {
            let mut ops = self.bf16.lock().unwrap_or_else(|e| e.into_inner());
            ops.written(buf, range);
        }
    }

    /// Records that a producer wrote `range` of `buf`, and casts it there (bf16 only).
    fn produced(&self, buf: &[f32], range: Range<usize>) -> Result<()> {
        if self.precision != GemmPrecision::Bf16 {
            return Ok(());
        }
        let mut ops = self.bf16.lock().unwrap_or_else(|e| e.into_inner());
        if !self.cast_where_produced {
            ops.written(buf, &range);
            return Ok(());
        }
        let ops = &mut *ops;
        self.run(|parallel| ops.produce(buf, range, parallel))
    }

    /// The checked operands of a softmax forward (`logits` as [`arg`] gives them), as one
    /// launch whose loss and lse rows are written.
    fn softmax_forward_operands(
        &self,
        logits: operands::Arg,
        targets: &CpuTargets,
        first_row: usize,
        loss: &ViewMut<'_, Vec<f32>>,
        lse: &ViewMut<'_, Vec<f32>>,
    ) -> Result<operands::SoftmaxRanges<2>> {
        let ranges = operands::softmax(
            logits,
            targets,
            first_row,
            [
                arg(self, "softmax loss", loss),
                arg(self, "softmax lse", lse),
            ],
        )?;
        self.launched();
        let [lo, ls] = &ranges.per_row;
        self.written(loss.buf, lo);
        self.written(lse.buf, ls);
        Ok(ranges)
    }

    /// The bf16 path the matrix products take (`None` in f32).
    pub fn bf16_path(&self) -> Option<Bf16Path> {
        (self.precision == GemmPrecision::Bf16).then(Bf16Path::detect)
    }

    /// The checked product `g` in bf16 (operands cast as the module docs say).
    fn gemm_bf16(
        &self,
        g: &operands::GemmOperands,
        (a_buf, b_buf): (&[f32], &[f32]),
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<()> {
        let path = Bf16Path::detect();
        let mut ops = self.bf16.lock().unwrap_or_else(|e| e.into_inner());
        let ops = &mut *ops;
        let c = &mut c[g.c.range.start..];
        let ldc = g.c.ld;
        self.run(|parallel| {
            let sa = ops.prepare(0, a_buf, g.a.range.clone(), parallel)?;
            let sb = ops.prepare(1, b_buf, g.b.range.clone(), parallel)?;
            if matches!(sb, Bf16Source::Params) {
                // A parameter read as B: packed once per pass, then read by every
                // product of the pass that reads it the same way.
                let key = (g.b.range.start, g.b.ld, g.b.trans, g.k, g.n);
                if !ops.packed.contains_key(&key) {
                    let b = ops.view(sb, &g.b, g.k, g.n)?;
                    let packed = if parallel {
                        kernels::par::pack_b(path, b)?
                    } else {
                        PackedB::new(path, b)?
                    };
                    ops.packed.insert(key, packed);
                }
                let a = ops.view(sa, &g.a, g.m, g.k)?;
                let b = &ops.packed[&key];
                return Ok(if parallel {
                    kernels::par::gemm_bf16_packed(a, b, c, ldc, accumulate)
                } else {
                    kernels::gemm_bf16::gemm_bf16_packed(a, b, c, ldc, accumulate)
                }?);
            }
            let a = ops.view(sa, &g.a, g.m, g.k)?;
            let b = ops.view(sb, &g.b, g.k, g.n)?;
            Ok(if parallel {
                kernels::par::gemm_bf16(path, a, b, c, ldc, accumulate)
            } else {
                kernels::gemm_bf16::gemm_bf16(path, a, b, c, ldc, accumulate)
            }?)
        })
    }

    /// Number of threads the backend computes with.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn launched(&self) {
        self.launches.fetch_add(1, Ordering::Relaxed);
    }

    /// Runs `f` inside the pool (parallel) or on the caller's thread (serial); `f` gets
    /// `true` when it may use parallel kernels.
    fn run<R: Send>(&self, f: impl FnOnce(bool) -> R + Send) -> R {
        match &self.pool {
            Some(pool) => pool.install(|| f(true)),
            None => f(false),
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Ids = CpuIds;
    type Targets = CpuTargets;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn executor(&self) -> Executor {
        self.pool.clone().map(Executor::on).unwrap_or_default()
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        let buf = vec![0.0; len];
        // A new buffer may lie where a dropped one did.
        self.written(&buf, &(0..len));
        Ok(buf)
    }

    fn begin_pass(&self, params: &Vec<f32>) {
        let mut ops = self.bf16.lock().unwrap_or_else(|e| e.into_inner());
        ops.pass = Some((params.as_ptr() as usize, params.len()));
        ops.params_cast = false;
        ops.packed.clear();
        ops.forget_produced();
    }

    fn end_pass(&self) {
        let mut ops = self.bf16.lock().unwrap_or_else(|e| e.into_inner());
        ops.pass = None;
        ops.params_cast = false;
        ops.packed.clear();
        ops.forget_produced();
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn upload(&self, src: &[f32], dst: &mut Vec<f32>, offset: usize) -> Result<()> {
        let r = Layout::contiguous(offset, src.len()).check(dst.len(), "upload destination")?;
        self.written(dst, &r);
        dst[r].copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Vec<f32>, offset: usize, dst: &mut [f32]) -> Result<()> {
        let r = Layout::contiguous(offset, dst.len()).check(src.len(), "download source")?;
        dst.copy_from_slice(&src[r]);
        Ok(())
    }

    fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    fn stage_ids(&self, ids: CheckedIds<'_>) -> Result<CpuIds> {
        Ok(CpuIds {
            ids: ids.ids().to_vec(),
            bound: ids.bound(),
        })
    }

    fn stage_targets(&self, targets: CheckedTargets<'_>) -> Result<CpuTargets> {
        Ok(CpuTargets {
            labels: targets.labels().to_vec(),
            mask: targets.mask().to_vec(),
            vocab: targets.vocab(),
        })
    }

    fn fill(&self, dst: ViewMut<'_, Vec<f32>>, value: f32) -> Result<()> {
        let [r] = operands::elementwise([arg(self, "fill destination", &dst)])?;
        self.launched();
        self.written(dst.buf, &r);
        dst.buf[r].fill(value);
        Ok(())
    }

    fn copy(&self, src: View<'_, Vec<f32>>, dst: ViewMut<'_, Vec<f32>>) -> Result<()> {
        let [rs, rd] = operands::elementwise([
            arg(self, "copy source", &src),
            arg(self, "copy destination", &dst),
        ])?;
        self.launched();
        self.written(dst.buf, &rd);
        dst.buf[rd].copy_from_slice(&src.buf[rs]);
        Ok(())
    }

    fn gemm(
        &self,
        a: View<'_, Vec<f32>>,
        b: View<'_, Vec<f32>>,
        c: ViewMut<'_, Vec<f32>>,
        accumulate: bool,
    ) -> Result<()> {
        let g = operands::gemm(
            arg(self, "gemm A", &a),
            arg(self, "gemm B", &b),
            arg(self, "gemm C", &c),
        )?;
        self.launched();
        self.written(c.buf, &g.c.range);
        let (m, n, k) = (g.m, g.n, g.k);
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            if !accumulate {
                for row in 0..m {
                    let start = g.c.range.start + row * g.c.ld;
                    c.buf[start..start + n].fill(0.0);
                }
            }
            return Ok(());
        }
        // A column-major C was turned around (Cᵀ = Bᵀ·Aᵀ): so are the buffers.
        let (a_buf, b_buf) = if g.swapped {
            (b.buf, a.buf)
        } else {
            (a.buf, b.buf)
        };
        if self.precision == GemmPrecision::Bf16 {
            return self.gemm_bf16(&g, (a_buf, b_buf), c.buf, accumulate);
        }
        let strides = |x: &GemmMatrix| {
            if x.trans {
                (1, x.ld as isize)
            } else {
                (x.ld as isize, 1)
            }
        };
        let ((a_rs, a_cs), (b_rs, b_cs)) = (strides(&g.a), strides(&g.b));
        let c_rs = g.c.ld as isize;
        let a_ptr = a_buf[g.a.range.start..].as_ptr();
        let b_ptr = b_buf[g.b.range.start..].as_ptr();
        let c_ptr = c.buf[g.c.range.start..].as_mut_ptr();
        // Raw pointers are not Send; carry them as addresses into the pool.
        let (a_addr, b_addr, c_addr) = (a_ptr as usize, b_ptr as usize, c_ptr as usize);
        let threads = self.threads;
        self.run(move |parallel| {
            let parallelism = if parallel {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            };
            // SAFETY: the operand checks above guarantee that every element the strided
            // views of A ([m, k]), B ([k, n]) and the row-major C ([m, n], row stride
            // ldc >= n) address lies inside their buffers (their spans were checked); `c` is
            // borrowed mutably, so it cannot alias `a` or `b`; the buffers outlive this
            // call, which blocks until the product is done.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c_addr as *mut f32,
                    1,
                    c_rs,
                    accumulate,
                    a_addr as *const f32,
                    a_cs,
                    a_rs,
                    b_addr as *const f32,
                    b_cs,
                    b_rs,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    parallelism,
                );
            }
        });
        Ok(())
    }

    fn gather_rows(
        &self,
        table: View<'_, Vec<f32>>,
        ids: &CpuIds,
        dst: ViewMut<'_, Vec<f32>>,
    ) -> Result<()> {
        let ([d, t], width) = operands::rows_by_id(
            ids,
            arg(self, "gather destination", &dst),
            arg(self, "gather table", &table),
        )?;
        self.launched();
        let table = &table.buf[t];
        for (row, &id) in dst.buf[d.clone()]
            .chunks_exact_mut(width.max(1))
            .zip(&ids.ids)
        {
            let src = id as usize * width;
            row.copy_from_slice(&table[src..src + width]);
        }
        // Embeddings feed the first layer's input projection.
        self.produced(dst.buf, d)
    }

    fn scatter_add_rows(
        &self,
        src: View<'_, Vec<f32>>,
        ids: &CpuIds,
        table: ViewMut<'_, Vec<f32>>,
    ) -> Result<()> {
        let ([s, t], width) = operands::rows_by_id(
            ids,
            arg(self, "scatter source", &src),
            arg(self, "scatter table", &table),
        )?;
        self.launched();
        self.written(table.buf, &t);
        let table = &mut table.buf[t];
        for (row, &id) in src.buf[s].chunks_exact(width.max(1)).zip(&ids.ids) {
            let dst = id as usize * width;
            for (d, x) in table[dst..dst + width].iter_mut().zip(row) {
                *d += x;
            }
        }
        Ok(())
    }

    fn column_sums(
        &self,
        src: View<'_, Vec<f32>>,
        dst: ViewMut<'_, Vec<f32>>,
        accumulate: bool,
    ) -> Result<()> {
        let [s, d] = operands::matrix_and_row(
            arg(self, "column_sums source", &src),
            arg(self, "column_sums destination", &dst),
        )?;
        self.launched();
        self.written(dst.buf, &d);
        let cols = src.layout.cols();
        let dst = &mut dst.buf[d];
        if !accumulate {
            dst.fill(0.0);
        }
        for row in src.buf[s].chunks_exact(cols.max(1)) {
            for (d, x) in dst.iter_mut().zip(row) {
                *d += x;
            }
        }
        Ok(())
    }

    fn add_row_bias(&self, bias: View<'_, Vec<f32>>, dst: ViewMut<'_, Vec<f32>>) -> Result<()> {
        let [d, b] = operands::matrix_and_row(
            arg(self, "bias destination", &dst),
            arg(self, "bias", &bias),
        )?;
        self.launched();
        self.written(dst.buf, &d);
        let cols = dst.layout.cols();
        let bias = &bias.buf[b];
        for row in dst.buf[d].chunks_exact_mut(cols.max(1)) {
            for (x, b) in row.iter_mut().zip(bias) {
                *x += b;
            }
        }
        Ok(())
    }

    fn unary(&self, op: Unary, x: View<'_, Vec<f32>>, dst: ViewMut<'_, Vec<f32>>) -> Result<()> {
        let [rx, rd] = operands::elementwise([
            arg(self, "unary input", &x),
            arg(self, "unary output", &dst),
        ])?;
        self.launched();
        self.written(dst.buf, &rd);
        let pairs = dst.buf[rd].iter_mut().zip(&x.buf[rx]);
        match op {
            Unary::Sigmoid => pairs.for_each(|(d, &x)| *d = 1.0 / (1.0 + (-x).exp())),
            Unary::Tanh => pairs.for_each(|(d, &x)| *d = x.tanh()),
        }
        Ok(())
    }

    fn binary(
        &self,
        op: Binary,
        a: View<'_, Vec<f32>>,
        b: View<'_, Vec<f32>>,
        dst: ViewMut<'_, Vec<f32>>,
    ) -> Result<()> {
        let [ra, rb, rd] = operands::elementwise([
            arg(self, "binary input a", &a),
            arg(self, "binary input b", &b),
            arg(self, "binary output", &dst),
        ])?;
        self.launched();
        self.written(dst.buf, &rd);
        let triples = dst.buf[rd].iter_mut().zip(a.buf[ra].iter().zip(&b.buf[rb]));
        match op {
            Binary::Add => triples.for_each(|(d, (&a, &b))| *d = a + b),
            Binary::Mul => triples.for_each(|(d, (&a, &b))| *d = a * b),
        }
        Ok(())
    }

    fn in_place(
        &self,
        op: InPlace,
        x: View<'_, Vec<f32>>,
        dst: ViewMut<'_, Vec<f32>>,
    ) -> Result<()> {
        let [rx, rd] = operands::elementwise([
            arg(self, "in-place input", &x),
            arg(self, "in-place output", &dst),
        ])?;
        self.launched();
        self.written(dst.buf, &rd);
        let pairs = dst.buf[rd].iter_mut().zip(&x.buf[rx]);
        match op {
            InPlace::Add => pairs.for_each(|(d, &x)| *d += x),
            InPlace::MulSigmoidGrad => pairs.for_each(|(d, &x)| *d *= x * (1.0 - x)),
            InPlace::MulTanhGrad => pairs.for_each(|(d, &x)| *d *= 1.0 - x * x),
        }
        Ok(())
    }

    fn lstm_forward_step(&self, s: LstmForwardStep<'_, Vec<f32>>) -> Result<()> {
        let r = operands::lstm_forward(self, &s)?;
        self.launched();
        self.written(s.cells, &r.c);
        self.written(s.act.buf, &r.act);
        let h_range = r.h.clone();
        let (c_prev, c) = read_write(s.cells, r.c_prev, r.c);
        let (h, act) = (&mut s.h.buf[r.h], &mut s.act.buf[r.act]);
        let (proj, rec, bias) = (
            &s.input_proj.buf[r.input_proj],
            &s.recurrent.buf[r.recurrent],
            &s.bias.buf[r.bias],
        );
        let (batch, hidden) = (r.batch, r.hidden);
        // The kernel reads block `step` of an input projection of `steps` blocks: this
        // step's block is the only one.
        self.run(move |parallel| {
            if parallel {
                kernels::par::lstm_pointwise_forward_step(
                    proj, rec, bias, c_prev, c, h, act, 0, 1, batch, hidden,
                )
            } else {
                kernels::lstm_pointwise_forward_step(
                    proj, rec, bias, c_prev, c, h, act, 0, 1, batch, hidden,
                )
            }
        })?;
        // The hidden state feeds the next step's recurrent product, the next layer's input
        // projection and the output projection.
        self.produced(s.h.buf, h_range)
    }

    fn lstm_backward_step(&self, s: LstmBackwardStep<'_, Vec<f32>>) -> Result<()> {
        let r = operands::lstm_backward(self, &s)?;
        self.launched();
        self.written(s.dc_prev.buf, &r.dc_prev);
        let dgates_range = r.dgates.clone();
        let (act, c_prev, c, dh, dc) = (
            &s.act.buf[r.act],
            &s.c_prev.buf[r.c_prev],
            &s.c.buf[r.c],
            &s.dh.buf[r.dh],
            &s.dc.buf[r.dc],
        );
        let (dgates, dc_prev) = (&mut s.dgates.buf[r.dgates], &mut s.dc_prev.buf[r.dc_prev]);
        let (batch, hidden) = (r.batch, r.hidden);
        self.run(move |parallel| {
            if parallel {
                kernels::par::lstm_pointwise_backward(
                    act, c_prev, c, dh, dc, dgates, dc_prev, batch, hidden,
                )
            } else {
                kernels::lstm_pointwise_backward(
                    act, c_prev, c, dh, dc, dgates, dc_prev, batch, hidden,
                )
            }
        })?;
        // The gate gradients feed the products for the input, the previous hidden state
        // and the weights.
        self.produced(s.dgates.buf, dgates_range)
    }

    fn softmax_xent_forward(
        &self,
        logits: View<'_, Vec<f32>>,
        targets: &CpuTargets,
        first_row: usize,
        loss: ViewMut<'_, Vec<f32>>,
        lse: ViewMut<'_, Vec<f32>>,
    ) -> Result<()> {
        let operands::SoftmaxRanges {
            logits: l,
            per_row: [lo, ls],
            targets: t,
            rows,
            vocab,
        } = self.softmax_forward_operands(
            arg(self, "softmax logits", &logits),
            targets,
            first_row,
            &loss,
            &lse,
        )?;
        let (logits, loss, lse) = (&logits.buf[l], &mut loss.buf[lo], &mut lse.buf[ls]);
        let (labels, mask) = (&targets.labels[t.clone()], &targets.mask[t]);
        self.run(move |parallel| {
            if parallel {
                kernels::par::softmax_xent_forward(logits, labels, mask, loss, lse, rows, vocab)
            } else {
                kernels::softmax_xent_forward(logits, labels, mask, loss, lse, rows, vocab)
            }
        })?;
        Ok(())
    }

    fn softmax_xent_backward(
        &self,
        logits: ViewMut<'_, Vec<f32>>,
        lse: View<'_, Vec<f32>>,
        targets: &CpuTargets,
        first_row: usize,
        scale: f32,
    ) -> Result<()> {
        let operands::SoftmaxRanges {
            logits: l,
            per_row: [ls],
            targets: t,
            rows,
            vocab,
        } = operands::softmax(
            arg(self, "softmax logits", &logits),
            targets,
            first_row,
            [arg(self, "softmax lse", &lse)],
        )?;
        self.launched();
        let (grad, lse) = (&mut logits.buf[l.clone()], &lse.buf[ls]);
        let (labels, mask) = (&targets.labels[t.clone()], &targets.mask[t]);
        self.run(|parallel| {
            if parallel {
                kernels::par::softmax_xent_backward(grad, lse, labels, mask, scale, rows, vocab)
            } else {
                kernels::softmax_xent_backward(grad, lse, labels, mask, scale, rows, vocab)
            }
        })?;
        // The logits' gradient feeds the output projection's two products.
        self.produced(logits.buf, l)
    }

    fn softmax_xent_forward_backward(
        &self,
        logits: ViewMut<'_, Vec<f32>>,
        targets: &CpuTargets,
        first_row: usize,
        loss: ViewMut<'_, Vec<f32>>,
        lse: ViewMut<'_, Vec<f32>>,
        scale: f32,
    ) -> Result<()> {
        let operands::SoftmaxRanges {
            logits: l,
            per_row: [lo, ls],
            targets: t,
            rows,
            vocab,
        } = self.softmax_forward_operands(
            arg(self, "softmax logits", &logits),
            targets,
            first_row,
            &loss,
            &lse,
        )?;
        let buf = key(logits.buf);
        let grad = &mut logits.buf[l.clone()];
        let (loss, lse) = (&mut loss.buf[lo], &mut lse.buf[ls]);
        let (labels, mask) = (&targets.labels[t.clone()], &targets.mask[t]);
        let mut fused = |copy: Option<&mut [bf16]>| {
            self.run(|parallel| {
                let f = if parallel {
                    kernels::par::softmax_xent_forward_backward
                } else {
                    kernels::softmax_xent_forward_backward
                };
                f(
                    &mut *grad, labels, mask, &mut *loss, &mut *lse, scale, rows, vocab, copy,
                )
            })
        };
        // The logits' gradient feeds the output projection's two products: in bf16 (in a
        // pass), each row is cast as it is written.
        if self.precision == GemmPrecision::Bf16 && self.cast_where_produced {
            let mut ops = self.bf16.lock().unwrap_or_else(|e| e.into_inner());
            if ops.produce_with(buf, l.clone(), |copy| fused(Some(copy)))? {
                return Ok(());
            }
        }
        fused(None)?;
        self.produced(logits.buf, l)
    }

    fn sum(&self, src: View<'_, Vec<f32>>) -> Result<f64> {
        let [r] = operands::elementwise([arg(self, "sum source", &src)])?;
        self.launched();
        Ok(src.buf[r].iter().map(|&x| f64::from(x)).sum())
    }
}

/// `read` (shared) and `write` (exclusive) of `buf`: two disjoint ranges inside it.
fn read_write(buf: &mut [f32], read: Range<usize>, write: Range<usize>) -> (&[f32], &mut [f32]) {
    if read.start < write.start {
        let (lo, hi) = buf.split_at_mut(write.start);
        (&lo[read], &mut hi[..write.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(read.start);
        (&hi[..read.len()], &mut lo[write])
    }
}
