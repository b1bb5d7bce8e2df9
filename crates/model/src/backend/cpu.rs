//! The CPU backend: ringtrain-kernels for the LSTM and softmax kernels (their `par` twins
//! on more than one thread), the `gemm` crate for matrix products, buffers in `Vec<f32>`.

use std::sync::atomic::{AtomicU64, Ordering};

use rayon::ThreadPool;
use ringtrain_kernels as kernels;

use super::{
    check_add_row_bias, check_binary, check_column_sums, check_gather_rows, check_gemm,
    check_in_place, check_lstm_backward_step, check_lstm_forward_step, check_scatter_add_rows,
    check_softmax_xent_backward, check_softmax_xent_forward, check_two_slots, check_unary, span,
    Backend, Binary, Gemm, InPlace, LstmStep, Unary,
};
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
        check_gemm(g, a.len(), b.len(), c.len())?;
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
        let [t, d] = check_gather_rows(
            table.len(),
            table_offset,
            table_rows,
            width,
            ids,
            dst.len(),
            dst_offset,
        )?;
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
        let [s, t] = check_scatter_add_rows(
            src.len(),
            src_offset,
            ids,
            width,
            table.len(),
            table_offset,
            table_rows,
        )?;
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
        let [s, d] = check_column_sums(src.len(), src_offset, rows, cols, dst.len(), dst_offset)?;
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
        let [b, d] =
            check_add_row_bias(bias.len(), bias_offset, dst.len(), dst_offset, rows, cols)?;
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
        let [rx, rd] = check_unary(x.len(), x_offset, dst.len(), dst_offset, len)?;
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
        let [ra, rb, rd] = check_binary(
            a.len(),
            a_offset,
            b.len(),
            b_offset,
            dst.len(),
            dst_offset,
            len,
        )?;
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
        let [rx, rd] = check_in_place(x.len(), x_offset, dst.len(), dst_offset, len)?;
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
        let spans = check_lstm_forward_step(
            at,
            input_proj.len(),
            recurrent.len(),
            bias.len(),
            bias_offset,
            cells.len(),
            hiddens.len(),
            act.len(),
        )?;
        let bh = at.batch * at.hidden;
        let (c_prev, c) = two_slots(cells, at.prev_slot, at.out_slot, bh, "lstm cell slots")?;
        self.launched();
        let h = &mut hiddens[spans.hidden];
        let act = &mut act[spans.act];
        let (proj, rec, bias) = (
            &input_proj[spans.input_proj],
            &recurrent[spans.recurrent],
            &bias[spans.bias],
        );
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
        let s = check_lstm_backward_step(
            at,
            act.len(),
            cells.len(),
            dh.len(),
            dc.len(),
            dgates.len(),
            dc_prev.len(),
        )?;
        self.launched();
        let (act, c_prev, c, dh, dc) = (
            &act[s.act],
            &cells[s.c_prev],
            &cells[s.c],
            &dh[s.dh],
            &dc[s.dc],
        );
        let (dgates, dc_prev) = (&mut dgates[s.dgates], &mut dc_prev[s.dc_prev]);
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
        let [l, lo, ls] =
            check_softmax_xent_forward(rows, vocab, logits.len(), loss.len(), lse.len())?;
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
        let [l, ls] = check_softmax_xent_backward(rows, vocab, logits.len(), lse.len())?;
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

/// Slot `read` (shared) and slot `write` (exclusive) of `[slots, len]` `buf`.
fn two_slots<'a>(
    buf: &'a mut [f32],
    read: usize,
    write: usize,
    len: usize,
    what: &'static str,
) -> Result<(&'a [f32], &'a mut [f32])> {
    check_two_slots(buf.len(), read, write, len, what)?;
    if read < write {
        let (lo, hi) = buf.split_at_mut(write * len);
        Ok((&lo[read * len..(read + 1) * len], &mut hi[..len]))
    } else {
        let (lo, hi) = buf.split_at_mut(read * len);
        Ok((&hi[..len], &mut lo[write * len..(write + 1) * len]))
    }
}
