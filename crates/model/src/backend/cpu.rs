//! The CPU backend: ringtrain-kernels for the LSTM and softmax kernels (their `par` twins
//! on more than one thread), the `gemm` crate for matrix products, buffers in `Vec<f32>`.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use rayon::ThreadPool;
use ringtrain_kernels as kernels;

use super::{Backend, Binary, Gemm, InPlace, LstmStep, Unary};
use crate::error::{Error, Result};

/// CPU backend. With one thread every operation runs serially on the caller's thread; with
/// more, the backend owns a rayon pool of that many threads and runs the parallel kernels
/// (bit-identical to the serial ones) and multi-threaded GEMMs inside it.
pub struct CpuBackend {
    threads: usize,
    pool: Option<ThreadPool>,
    launches: AtomicU64,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("threads", &self.threads)
            .field("launches", &self.launches())
            .finish()
    }
}

/// `offset..offset + len` if it fits in `buf_len`, else `OutOfBounds` naming `what`.
fn span(what: &'static str, offset: usize, len: usize, buf_len: usize) -> Result<Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= buf_len => Ok(offset..end),
        _ => Err(Error::OutOfBounds {
            what,
            end: offset.saturating_add(len),
            len: buf_len,
        }),
    }
}

/// Elements a strided `[rows, cols]` matrix view with row stride `ld` spans.
fn strided_extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

impl CpuBackend {
    /// A CPU backend on `threads` threads (at least 1).
    ///
    /// # Errors
    /// `InvalidConfig` when `threads == 0`; `ThreadPool` when the pool cannot start.
    pub fn new(threads: usize) -> Result<Self> {
        if threads == 0 {
            return Err(crate::error::config_error(
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
            Some(pool)
        } else {
            None
        };
        Ok(CpuBackend {
            threads,
            pool,
            launches: AtomicU64::new(0),
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

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn upload(&self, src: &[f32], dst: &mut Vec<f32>, offset: usize) -> Result<()> {
        let r = span("upload destination", offset, src.len(), dst.len())?;
        dst[r].copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Vec<f32>, offset: usize, dst: &mut [f32]) -> Result<()> {
        let r = span("download source", offset, dst.len(), src.len())?;
        dst.copy_from_slice(&src[r]);
        Ok(())
    }

    fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    fn fill(&self, dst: &mut Vec<f32>, offset: usize, len: usize, value: f32) -> Result<()> {
        let r = span("fill destination", offset, len, dst.len())?;
        self.launched();
        dst[r].fill(value);
        Ok(())
    }

    fn copy(
        &self,
        src: &Vec<f32>,
        src_offset: usize,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        let rs = span("copy source", src_offset, len, src.len())?;
        let rd = span("copy destination", dst_offset, len, dst.len())?;
        self.launched();
        dst[rd].copy_from_slice(&src[rs]);
        Ok(())
    }

    fn gemm(&self, a: &Vec<f32>, b: &Vec<f32>, c: &mut Vec<f32>, g: &Gemm) -> Result<()> {
        let (a_rows, a_cols) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (b_rows, b_cols) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        if g.lda < a_cols || g.ldb < b_cols || g.ldc < g.n {
            return Err(Error::OutOfBounds {
                what: "gemm row stride shorter than the row",
                end: a_cols.max(b_cols).max(g.n),
                len: g.lda.min(g.ldb).min(g.ldc),
            });
        }
        span(
            "gemm A",
            g.a_offset,
            strided_extent(a_rows, a_cols, g.lda),
            a.len(),
        )?;
        span(
            "gemm B",
            g.b_offset,
            strided_extent(b_rows, b_cols, g.ldb),
            b.len(),
        )?;
        span(
            "gemm C",
            g.c_offset,
            strided_extent(g.m, g.n, g.ldc),
            c.len(),
        )?;
        self.launched();
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 {
            if !g.accumulate {
                for row in 0..g.m {
                    let start = g.c_offset + row * g.ldc;
                    c[start..start + g.n].fill(0.0);
                }
            }
            return Ok(());
        }
        let (a_rs, a_cs) = if g.trans_a {
            (1, g.lda as isize)
        } else {
            (g.lda as isize, 1)
        };
        let (b_rs, b_cs) = if g.trans_b {
            (1, g.ldb as isize)
        } else {
            (g.ldb as isize, 1)
        };
        let a_ptr = a[g.a_offset..].as_ptr();
        let b_ptr = b[g.b_offset..].as_ptr();
        let c_ptr = c[g.c_offset..].as_mut_ptr();
        // Raw pointers are not Send; carry them as addresses into the pool.
        let (a_addr, b_addr, c_addr) = (a_ptr as usize, b_ptr as usize, c_ptr as usize);
        let threads = self.threads;
        let (m, n, k, ldc, accumulate) = (g.m, g.n, g.k, g.ldc as isize, g.accumulate);
        self.run(move |parallel| {
            let parallelism = if parallel {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            };
            // SAFETY: the span checks above guarantee that every element the strided views
            // of A ([a_rows, a_cols], stride lda), B and C ([m, n], stride ldc) address lies
            // inside `a`, `b` and `c`; `c` is borrowed mutably, so it cannot alias `a` or `b`;
            // the buffers outlive this call, which blocks until the product is done.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    c_addr as *mut f32,
                    1,
                    ldc,
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
        table: &Vec<f32>,
        table_offset: usize,
        table_rows: usize,
        width: usize,
        ids: &[u32],
        dst: &mut Vec<f32>,
        dst_offset: usize,
    ) -> Result<()> {
        let t = span(
            "gather table",
            table_offset,
            table_rows * width,
            table.len(),
        )?;
        let d = span(
            "gather destination",
            dst_offset,
            ids.len() * width,
            dst.len(),
        )?;
        check_ids(ids, table_rows)?;
        self.launched();
        let table = &table[t];
        for (row, &id) in dst[d].chunks_exact_mut(width.max(1)).zip(ids) {
            let src = id as usize * width;
            row.copy_from_slice(&table[src..src + width]);
        }
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        src: &Vec<f32>,
        src_offset: usize,
        ids: &[u32],
        width: usize,
        table: &mut Vec<f32>,
        table_offset: usize,
        table_rows: usize,
    ) -> Result<()> {
        let s = span("scatter source", src_offset, ids.len() * width, src.len())?;
        let t = span(
            "scatter table",
            table_offset,
            table_rows * width,
            table.len(),
        )?;
        check_ids(ids, table_rows)?;
        self.launched();
        let table = &mut table[t];
        for (row, &id) in src[s].chunks_exact(width.max(1)).zip(ids) {
            let dst = id as usize * width;
            for (d, x) in table[dst..dst + width].iter_mut().zip(row) {
                *d += x;
            }
        }
        Ok(())
    }

    fn column_sums(
        &self,
        src: &Vec<f32>,
        src_offset: usize,
        rows: usize,
        cols: usize,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        accumulate: bool,
    ) -> Result<()> {
        let s = span("column_sums source", src_offset, rows * cols, src.len())?;
        let d = span("column_sums destination", dst_offset, cols, dst.len())?;
        self.launched();
        let dst = &mut dst[d];
        if !accumulate {
            dst.fill(0.0);
        }
        for row in src[s].chunks_exact(cols.max(1)) {
            for (d, x) in dst.iter_mut().zip(row) {
                *d += x;
            }
        }
        Ok(())
    }

    fn add_row_bias(
        &self,
        bias: &Vec<f32>,
        bias_offset: usize,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        let b = span("bias", bias_offset, cols, bias.len())?;
        let d = span("bias destination", dst_offset, rows * cols, dst.len())?;
        self.launched();
        let bias = &bias[b];
        for row in dst[d].chunks_exact_mut(cols.max(1)) {
            for (x, b) in row.iter_mut().zip(bias) {
                *x += b;
            }
        }
        Ok(())
    }

    fn unary(
        &self,
        op: Unary,
        x: &Vec<f32>,
        x_offset: usize,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        let rx = span("unary input", x_offset, len, x.len())?;
        let rd = span("unary output", dst_offset, len, dst.len())?;
        self.launched();
        let pairs = dst[rd].iter_mut().zip(&x[rx]);
        match op {
            Unary::Sigmoid => pairs.for_each(|(d, &x)| *d = 1.0 / (1.0 + (-x).exp())),
            Unary::Tanh => pairs.for_each(|(d, &x)| *d = x.tanh()),
        }
        Ok(())
    }

    fn binary(
        &self,
        op: Binary,
        a: &Vec<f32>,
        a_offset: usize,
        b: &Vec<f32>,
        b_offset: usize,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        let ra = span("binary input a", a_offset, len, a.len())?;
        let rb = span("binary input b", b_offset, len, b.len())?;
        let rd = span("binary output", dst_offset, len, dst.len())?;
        self.launched();
        let triples = dst[rd].iter_mut().zip(a[ra].iter().zip(&b[rb]));
        match op {
            Binary::Add => triples.for_each(|(d, (&a, &b))| *d = a + b),
            Binary::Mul => triples.for_each(|(d, (&a, &b))| *d = a * b),
        }
        Ok(())
    }

    fn in_place(
        &self,
        op: InPlace,
        x: &Vec<f32>,
        x_offset: usize,
        dst: &mut Vec<f32>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        let rx = span("in-place input", x_offset, len, x.len())?;
        let rd = span("in-place output", dst_offset, len, dst.len())?;
        self.launched();
        let pairs = dst[rd].iter_mut().zip(&x[rx]);
        match op {
            InPlace::Add => pairs.for_each(|(d, &x)| *d += x),
            InPlace::MulSigmoidGrad => pairs.for_each(|(d, &x)| *d *= x * (1.0 - x)),
            InPlace::MulTanhGrad => pairs.for_each(|(d, &x)| *d *= 1.0 - x * x),
        }
        Ok(())
    }

    fn lstm_forward_step(
        &self,
        input_proj: &Vec<f32>,
        recurrent: &Vec<f32>,
        bias: &Vec<f32>,
        bias_offset: usize,
        cells: &mut Vec<f32>,
        hiddens: &mut Vec<f32>,
        act: &mut Vec<f32>,
        at: &LstmStep,
    ) -> Result<()> {
        let (bh, g) = (at.batch * at.hidden, 4 * at.batch * at.hidden);
        let proj = span("lstm input_proj", 0, at.steps * g, input_proj.len())?;
        let rec = span("lstm recurrent", 0, g, recurrent.len())?;
        let b = span("lstm bias", bias_offset, 4 * at.hidden, bias.len())?;
        let a = span("lstm act", at.step * g, g, act.len())?;
        let (c_prev, c) = two_slots(cells, at.prev_slot, at.out_slot, bh, "lstm cell slots")?;
        let h = span("lstm hidden slot", at.out_slot * bh, bh, hiddens.len())?;
        self.launched();
        let h = &mut hiddens[h];
        let act = &mut act[a];
        let (proj, rec, bias) = (&input_proj[proj], &recurrent[rec], &bias[b]);
        let (step, steps, batch, hidden) = (at.step, at.steps, at.batch, at.hidden);
        self.run(move |parallel| {
            if parallel {
                kernels::par::lstm_pointwise_forward_step(
                    proj, rec, bias, c_prev, c, h, act, step, steps, batch, hidden,
                )
            } else {
                kernels::lstm_pointwise_forward_step(
                    proj, rec, bias, c_prev, c, h, act, step, steps, batch, hidden,
                )
            }
        })?;
        Ok(())
    }

    fn lstm_backward_step(
        &self,
        act: &Vec<f32>,
        cells: &Vec<f32>,
        dh: &Vec<f32>,
        dc: &Vec<f32>,
        dgates: &mut Vec<f32>,
        dc_prev: &mut Vec<f32>,
        at: &LstmStep,
    ) -> Result<()> {
        let (bh, g) = (at.batch * at.hidden, 4 * at.batch * at.hidden);
        let a = span("lstm act", at.step * g, g, act.len())?;
        let cp = span("lstm c_prev slot", at.prev_slot * bh, bh, cells.len())?;
        let c = span("lstm c slot", at.out_slot * bh, bh, cells.len())?;
        let dhr = span("lstm dh", at.step * bh, bh, dh.len())?;
        let dcr = span("lstm dc", 0, bh, dc.len())?;
        let dg = span("lstm dgates", at.step * g, g, dgates.len())?;
        let dcp = span("lstm dc_prev", 0, bh, dc_prev.len())?;
        self.launched();
        let (act, c_prev, c, dh, dc) = (&act[a], &cells[cp], &cells[c], &dh[dhr], &dc[dcr]);
        let (dgates, dc_prev) = (&mut dgates[dg], &mut dc_prev[dcp]);
        let (batch, hidden) = (at.batch, at.hidden);
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
        Ok(())
    }

    fn softmax_xent_forward(
        &self,
        logits: &Vec<f32>,
        labels: &[u32],
        mask: &[f32],
        loss: &mut Vec<f32>,
        lse: &mut Vec<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<()> {
        let l = span("softmax logits", 0, rows * vocab, logits.len())?;
        let lo = span("softmax loss", 0, rows, loss.len())?;
        let ls = span("softmax lse", 0, rows, lse.len())?;
        self.launched();
        let (logits, loss, lse) = (&logits[l], &mut loss[lo], &mut lse[ls]);
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
        logits: &mut Vec<f32>,
        lse: &Vec<f32>,
        labels: &[u32],
        mask: &[f32],
        scale: f32,
        rows: usize,
        vocab: usize,
    ) -> Result<()> {
        let l = span("softmax logits", 0, rows * vocab, logits.len())?;
        let ls = span("softmax lse", 0, rows, lse.len())?;
        self.launched();
        let (logits, lse) = (&mut logits[l], &lse[ls]);
        self.run(move |parallel| {
            if parallel {
                kernels::par::softmax_xent_backward(logits, lse, labels, mask, scale, rows, vocab)
            } else {
                kernels::softmax_xent_backward(logits, lse, labels, mask, scale, rows, vocab)
            }
        })?;
        Ok(())
    }

    fn sum(&self, src: &Vec<f32>, offset: usize, len: usize) -> Result<f64> {
        let r = span("sum source", offset, len, src.len())?;
        self.launched();
        Ok(src[r].iter().map(|&x| f64::from(x)).sum())
    }
}

/// Every id below `rows`, else `OutOfBounds` naming the first bad one.
fn check_ids(ids: &[u32], rows: usize) -> Result<()> {
    match ids.iter().find(|&&id| id as usize >= rows) {
        Some(&id) => Err(Error::OutOfBounds {
            what: "embedding row id",
            end: id as usize + 1,
            len: rows,
        }),
        None => Ok(()),
    }
}

/// Slot `read` (shared) and slot `write` (exclusive) of `[slots, len]` `buf`.
fn two_slots<'a>(
    buf: &'a mut [f32],
    read: usize,
    write: usize,
    len: usize,
    what: &'static str,
) -> Result<(&'a [f32], &'a mut [f32])> {
    let end = read.max(write).saturating_add(1).saturating_mul(len);
    if read == write || end > buf.len() {
        return Err(Error::OutOfBounds {
            what,
            end,
            len: buf.len(),
        });
    }
    if read < write {
        let (lo, hi) = buf.split_at_mut(write * len);
        Ok((&lo[read * len..(read + 1) * len], &mut hi[..len]))
    } else {
        let (lo, hi) = buf.split_at_mut(read * len);
        Ok((&hi[..len], &mut lo[write * len..(write + 1) * len]))
    }
}
