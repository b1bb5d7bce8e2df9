//! The [`Backend`] trait: buffers, matrix products and the kernels' operations, as the
//! LSTM layers and models issue them.
//!
//! Every operation (everything but [`Backend::zeros`], [`Backend::upload`] and
//! [`Backend::download`]) counts as one launch in [`Backend::launches`]: on a GPU each is
//! one kernel launch, on the CPU one call into a kernel or GEMM routine. The models report
//! the launches a batch issued in [`crate::StepStats::launches`].
//!
//! Operands are whole buffers plus element offsets: a model keeps a few large buffers (one
//! flat parameter buffer, one flat gradient buffer, a workspace per layer) and addresses
//! tensors inside them. Every operation checks its views against the buffer lengths and
//! returns [`crate::Error::OutOfBounds`] instead of touching memory outside them.

mod layout;

pub mod cpu;
pub mod cuda;

pub use cpu::CpuBackend;
pub use cuda::CudaBackend;
#[cfg(feature = "cuda")]
pub use cuda::GemmPrecision;
pub use layout::{view, view_mut, Layout, View, ViewMut};

use std::ops::Range;

use crate::error::{Error, Result};

/// One matrix product `C = op(A)·op(B)` (or `C += op(A)·op(B)` when `accumulate`).
///
/// All matrices are row-major inside their buffers. `op(A)` is `[m, k]`: element `(i, p)`
/// is `A[a_offset + i*lda + p]`, or `A[a_offset + p*lda + i]` when `trans_a` (A stored as
/// `[k, m]`). Likewise `op(B)` is `[k, n]`, stored `[n, k]` when `trans_b`. `C` is `[m, n]`
/// at `c_offset` with row stride `ldc`. Row strides larger than the row let a product
/// address one gate block of a `[rows, 4H]` matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// First element of `A`.
    pub a_offset: usize,
    /// Row stride of `A` as stored.
    pub lda: usize,
    /// `A` is stored `[k, m]`.
    pub trans_a: bool,
    /// First element of `B`.
    pub b_offset: usize,
    /// Row stride of `B` as stored.
    pub ldb: usize,
    /// `B` is stored `[n, k]`.
    pub trans_b: bool,
    /// First element of `C`.
    pub c_offset: usize,
    /// Row stride of `C`.
    pub ldc: usize,
    /// Add the product to `C` instead of overwriting it.
    pub accumulate: bool,
}

impl Gemm {
    /// `C[m,n] = A[m,k]·B[k,n]`, all dense at offset 0.
    pub fn nn(m: usize, n: usize, k: usize) -> Self {
        Gemm {
            m,
            n,
            k,
            a_offset: 0,
            lda: k,
            trans_a: false,
            b_offset: 0,
            ldb: n,
            trans_b: false,
            c_offset: 0,
            ldc: n,
            accumulate: false,
        }
    }

    /// `C[m,n] = A[m,k]·Bᵀ` with `B` stored dense `[n, k]`.
    pub fn nt(m: usize, n: usize, k: usize) -> Self {
        Gemm {
            ldb: k,
            trans_b: true,
            ..Gemm::nn(m, n, k)
        }
    }

    /// `C[m,n] = Aᵀ·B[k,n]` with `A` stored dense `[k, m]`.
    pub fn tn(m: usize, n: usize, k: usize) -> Self {
        Gemm {
            lda: m,
            trans_a: true,
            ..Gemm::nn(m, n, k)
        }
    }

    /// Sets the three offsets.
    pub fn at(self, a_offset: usize, b_offset: usize, c_offset: usize) -> Self {
        Gemm {
            a_offset,
            b_offset,
            c_offset,
            ..self
        }
    }

    /// Sets the three row strides.
    pub fn strides(self, lda: usize, ldb: usize, ldc: usize) -> Self {
        Gemm {
            lda,
            ldb,
            ldc,
            ..self
        }
    }

    /// Sets `accumulate`.
    pub fn accumulate(self, accumulate: bool) -> Self {
        Gemm { accumulate, ..self }
    }

    /// Floating-point operations of the product (2·m·n·k).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

/// Element-wise function of one operand: `dst = f(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unary {
    /// Logistic sigmoid `1 / (1 + e^-x)`.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
}

/// Element-wise function of two operands: `dst = f(a, b)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// `a + b`.
    Add,
    /// `a * b`.
    Mul,
}

/// Element-wise update of `dst` by `x`: `dst = f(dst, x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InPlace {
    /// `dst += x`.
    Add,
    /// `dst *= x * (1 - x)`: gradient through a sigmoid whose output is `x`.
    MulSigmoidGrad,
    /// `dst *= 1 - x²`: gradient through a tanh whose output is `x`.
    MulTanhGrad,
}

/// Where one time step of an LSTM layer reads and writes.
///
/// `input_proj`, `act`, `dh` and `dgates` hold all steps in time order (`[steps, batch, W]`);
/// the cell and hidden states live in `steps + 1` slots of `[batch, H]` so that the step's
/// previous state (`prev_slot`) and new state (`out_slot`) sit in one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LstmStep {
    /// Time index of the step (which block of the per-step buffers).
    pub step: usize,
    /// Number of steps of the layer.
    pub steps: usize,
    /// Batch rows.
    pub batch: usize,
    /// Hidden units H.
    pub hidden: usize,
    /// Slot of `h_prev`/`c_prev`.
    pub prev_slot: usize,
    /// Slot the step's `h`/`c` are written to.
    pub out_slot: usize,
}

/// Compute backend of the models: owns memory of type [`Backend::Buffer`] and runs the
/// operations a training step needs on it.
pub trait Backend: Send {
    /// A buffer of f32 elements in the backend's memory.
    type Buffer: Send;

    /// Short name for reports (`"cpu"`).
    fn name(&self) -> &'static str;
    /// A new buffer of `len` zeros.
    fn zeros(&self, len: usize) -> Result<Self::Buffer>;
    /// Number of elements of `buf`.
    fn len(&self, buf: &Self::Buffer) -> usize;
    /// Copies host `src` into `dst[offset..offset + src.len()]`.
    fn upload(&self, src: &[f32], dst: &mut Self::Buffer, offset: usize) -> Result<()>;
    /// Copies `src[offset..offset + dst.len()]` to host `dst`.
    fn download(&self, src: &Self::Buffer, offset: usize, dst: &mut [f32]) -> Result<()>;
    /// Operations issued since the backend was created.
    fn launches(&self) -> u64;
    /// Called by the models when a pass (forward, or forward and backward) starts, with
    /// their parameter buffer, which then stays unchanged until [`Backend::end_pass`]: a
    /// backend may keep values derived from the parameters for that long (the CUDA backend
    /// casts each weight tensor to 16 bits once per pass in mixed precision). Default:
    /// nothing.
    fn begin_pass(&self, _params: &Self::Buffer) {}
    /// Ends the pass [`Backend::begin_pass`] started; derived values are stale from now on.
    fn end_pass(&self) {}

    /// `dst[offset..offset + len] = value`.
    fn fill(&self, dst: &mut Self::Buffer, offset: usize, len: usize, value: f32) -> Result<()>;
    /// `dst[dst_offset..][..len] = src[src_offset..][..len]`.
    fn copy(
        &self,
        src: &Self::Buffer,
        src_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;
    /// The matrix product described by `spec` (see [`Gemm`]).
    fn gemm(
        &self,
        a: &Self::Buffer,
        b: &Self::Buffer,
        c: &mut Self::Buffer,
        spec: &Gemm,
    ) -> Result<()>;
    /// Embedding lookup: row `r` of `dst` (at `dst_offset`, `width` wide) = row `ids[r]` of
    /// the `[table_rows, width]` table at `table_offset`.
    #[allow(clippy::too_many_arguments)]
    fn gather_rows(
        &self,
        table: &Self::Buffer,
        table_offset: usize,
        table_rows: usize,
        width: usize,
        ids: &[u32],
        dst: &mut Self::Buffer,
        dst_offset: usize,
    ) -> Result<()>;
    /// Embedding gradient: row `ids[r]` of the table at `table_offset` += row `r` of `src`.
    /// Rows are added in order `r = 0, 1, ...` (deterministic).
    #[allow(clippy::too_many_arguments)]
    fn scatter_add_rows(
        &self,
        src: &Self::Buffer,
        src_offset: usize,
        ids: &[u32],
        width: usize,
        table: &mut Self::Buffer,
        table_offset: usize,
        table_rows: usize,
    ) -> Result<()>;
    /// `dst[c] (+)= sum over r of src[r, c]` for a dense `[rows, cols]` matrix (bias gradient).
    #[allow(clippy::too_many_arguments)]
    fn column_sums(
        &self,
        src: &Self::Buffer,
        src_offset: usize,
        rows: usize,
        cols: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// `dst[r, c] += bias[c]` for a dense `[rows, cols]` matrix.
    fn add_row_bias(
        &self,
        bias: &Self::Buffer,
        bias_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        rows: usize,
        cols: usize,
    ) -> Result<()>;
    /// `dst[..len] = op(x[..len])`.
    fn unary(
        &self,
        op: Unary,
        x: &Self::Buffer,
        x_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;
    /// `dst[..len] = op(a[..len], b[..len])`.
    #[allow(clippy::too_many_arguments)]
    fn binary(
        &self,
        op: Binary,
        a: &Self::Buffer,
        a_offset: usize,
        b: &Self::Buffer,
        b_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;
    /// `dst[..len] = op(dst[..len], x[..len])`.
    fn in_place(
        &self,
        op: InPlace,
        x: &Self::Buffer,
        x_offset: usize,
        dst: &mut Self::Buffer,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;
    /// Fused LSTM pointwise forward of one step (kernel `lstm_pointwise_forward_step`):
    /// pre-activations `input_proj[step] + recurrent + bias`; writes `c` and `h` into slot
    /// `out_slot` of `cells`/`hiddens` (reading `c_prev` from `prev_slot`) and the
    /// activations into block `step` of `act`.
    #[allow(clippy::too_many_arguments)]
    fn lstm_forward_step(
        &self,
        input_proj: &Self::Buffer,
        recurrent: &Self::Buffer,
        bias: &Self::Buffer,
        bias_offset: usize,
        cells: &mut Self::Buffer,
        hiddens: &mut Self::Buffer,
        act: &mut Self::Buffer,
        at: &LstmStep,
    ) -> Result<()>;
    /// Fused LSTM pointwise backward of one step (kernel `lstm_pointwise_backward`):
    /// from block `step` of `act` and `dh`, the cell slots, and `dc` (`[batch, H]` at 0),
    /// writes block `step` of `dgates` and `dc_prev` (`[batch, H]` at 0).
    #[allow(clippy::too_many_arguments)]
    fn lstm_backward_step(
        &self,
        act: &Self::Buffer,
        cells: &Self::Buffer,
        dh: &Self::Buffer,
        dc: &Self::Buffer,
        dgates: &mut Self::Buffer,
        dc_prev: &mut Self::Buffer,
        at: &LstmStep,
    ) -> Result<()>;
    /// Masked softmax cross-entropy forward over `[rows, vocab]` logits at offset 0:
    /// per-row `loss` and log-sum-exp `lse` (both at offset 0).
    #[allow(clippy::too_many_arguments)]
    fn softmax_xent_forward(
        &self,
        logits: &Self::Buffer,
        labels: &[u32],
        mask: &[f32],
        loss: &mut Self::Buffer,
        lse: &mut Self::Buffer,
        rows: usize,
        vocab: usize,
    ) -> Result<()>;
    /// Softmax cross-entropy backward, in place over the logits:
    /// `logits = (softmax - onehot) * scale * mask`.
    #[allow(clippy::too_many_arguments)]
    fn softmax_xent_backward(
        &self,
        logits: &mut Self::Buffer,
        lse: &Self::Buffer,
        labels: &[u32],
        mask: &[f32],
        scale: f32,
        rows: usize,
        vocab: usize,
    ) -> Result<()>;
    /// Sum of `src[offset..offset + len]`, accumulated in f64.
    fn sum(&self, src: &Self::Buffer, offset: usize, len: usize) -> Result<f64>;
}

// Operand checks shared by the backends: each returns the element ranges an operation
// reads and writes, or `OutOfBounds` naming the first operand that does not fit, so that
// every backend rejects the same calls with the same error.

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

/// Slots `read` and `write` of a `[slots, len]` buffer of `buf_len` elements are distinct
/// and inside it, else `OutOfBounds` naming `what`.
fn check_two_slots(
    buf_len: usize,
    read: usize,
    write: usize,
    len: usize,
    what: &'static str,
) -> Result<()> {
    let end = read.max(write).saturating_add(1).saturating_mul(len);
    if read == write || end > buf_len {
        return Err(Error::OutOfBounds {
            what,
            end,
            len: buf_len,
        });
    }
    Ok(())
}

/// Ranges of `A`, `B` and `C` that the product `g` addresses in buffers of `a_len`,
/// `b_len` and `c_len` elements.
fn check_gemm(g: &Gemm, a_len: usize, b_len: usize, c_len: usize) -> Result<[Range<usize>; 3]> {
    let (a_rows, a_cols) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
    let (b_rows, b_cols) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
    if g.lda < a_cols || g.ldb < b_cols || g.ldc < g.n {
        return Err(Error::OutOfBounds {
            what: "gemm row stride shorter than the row",
            end: a_cols.max(b_cols).max(g.n),
            len: g.lda.min(g.ldb).min(g.ldc),
        });
    }
    let a = span(
        "gemm A",
        g.a_offset,
        strided_extent(a_rows, a_cols, g.lda),
        a_len,
    )?;
    let b = span(
        "gemm B",
        g.b_offset,
        strided_extent(b_rows, b_cols, g.ldb),
        b_len,
    )?;
    let c = span("gemm C", g.c_offset, strided_extent(g.m, g.n, g.ldc), c_len)?;
    Ok([a, b, c])
}

/// Ranges `[table, dst]` of [`Backend::gather_rows`], after checking every id.
#[allow(clippy::too_many_arguments)]
fn check_gather_rows(
    table_len: usize,
    table_offset: usize,
    table_rows: usize,
    width: usize,
    ids: &[u32],
    dst_len: usize,
    dst_offset: usize,
) -> Result<[Range<usize>; 2]> {
    let table = span("gather table", table_offset, table_rows * width, table_len)?;
    let dst = span("gather destination", dst_offset, ids.len() * width, dst_len)?;
    check_ids(ids, table_rows)?;
    Ok([table, dst])
}

/// Ranges `[src, table]` of [`Backend::scatter_add_rows`], after checking every id.
#[allow(clippy::too_many_arguments)]
fn check_scatter_add_rows(
    src_len: usize,
    src_offset: usize,
    ids: &[u32],
    width: usize,
    table_len: usize,
    table_offset: usize,
    table_rows: usize,
) -> Result<[Range<usize>; 2]> {
    let src = span("scatter source", src_offset, ids.len() * width, src_len)?;
    let table = span("scatter table", table_offset, table_rows * width, table_len)?;
    check_ids(ids, table_rows)?;
    Ok([src, table])
}

/// Ranges `[src, dst]` of [`Backend::column_sums`].
fn check_column_sums(
    src_len: usize,
    src_offset: usize,
    rows: usize,
    cols: usize,
    dst_len: usize,
    dst_offset: usize,
) -> Result<[Range<usize>; 2]> {
    Ok([
        span("column_sums source", src_offset, rows * cols, src_len)?,
        span("column_sums destination", dst_offset, cols, dst_len)?,
    ])
}

/// Ranges `[bias, dst]` of [`Backend::add_row_bias`].
fn check_add_row_bias(
    bias_len: usize,
    bias_offset: usize,
    dst_len: usize,
    dst_offset: usize,
    rows: usize,
    cols: usize,
) -> Result<[Range<usize>; 2]> {
    Ok([
        span("bias", bias_offset, cols, bias_len)?,
        span("bias destination", dst_offset, rows * cols, dst_len)?,
    ])
}

/// Ranges `[x, dst]` of [`Backend::unary`].
fn check_unary(
    x_len: usize,
    x_offset: usize,
    dst_len: usize,
    dst_offset: usize,
    len: usize,
) -> Result<[Range<usize>; 2]> {
    Ok([
        span("unary input", x_offset, len, x_len)?,
        span("unary output", dst_offset, len, dst_len)?,
    ])
}

/// Ranges `[a, b, dst]` of [`Backend::binary`].
fn check_binary(
    a_len: usize,
    a_offset: usize,
    b_len: usize,
    b_offset: usize,
    dst_len: usize,
    dst_offset: usize,
    len: usize,
) -> Result<[Range<usize>; 3]> {
    Ok([
        span("binary input a", a_offset, len, a_len)?,
        span("binary input b", b_offset, len, b_len)?,
        span("binary output", dst_offset, len, dst_len)?,
    ])
}

/// Ranges `[x, dst]` of [`Backend::in_place`].
fn check_in_place(
    x_len: usize,
    x_offset: usize,
    dst_len: usize,
    dst_offset: usize,
    len: usize,
) -> Result<[Range<usize>; 2]> {
    Ok([
        span("in-place input", x_offset, len, x_len)?,
        span("in-place output", dst_offset, len, dst_len)?,
    ])
}

/// What [`Backend::lstm_forward_step`] addresses besides the two cell slots.
struct LstmForwardSpans {
    input_proj: Range<usize>,
    recurrent: Range<usize>,
    bias: Range<usize>,
    act: Range<usize>,
    hidden: Range<usize>,
}

/// Ranges of [`Backend::lstm_forward_step`], after checking the cell slots of `cells_len`.
#[allow(clippy::too_many_arguments)]
fn check_lstm_forward_step(
    at: &LstmStep,
    input_proj_len: usize,
    recurrent_len: usize,
    bias_len: usize,
    bias_offset: usize,
    cells_len: usize,
    hiddens_len: usize,
    act_len: usize,
) -> Result<LstmForwardSpans> {
    let (bh, g) = (at.batch * at.hidden, 4 * at.batch * at.hidden);
    let input_proj = span("lstm input_proj", 0, at.steps * g, input_proj_len)?;
    let recurrent = span("lstm recurrent", 0, g, recurrent_len)?;
    let bias = span("lstm bias", bias_offset, 4 * at.hidden, bias_len)?;
    let act = span("lstm act", at.step * g, g, act_len)?;
    check_two_slots(cells_len, at.prev_slot, at.out_slot, bh, "lstm cell slots")?;
    let hidden = span("lstm hidden slot", at.out_slot * bh, bh, hiddens_len)?;
    Ok(LstmForwardSpans {
        input_proj,
        recurrent,
        bias,
        act,
        hidden,
    })
}

/// What [`Backend::lstm_backward_step`] addresses.
struct LstmBackwardSpans {
    act: Range<usize>,
    c_prev: Range<usize>,
    c: Range<usize>,
    dh: Range<usize>,
    dc: Range<usize>,
    dgates: Range<usize>,
    dc_prev: Range<usize>,
}

/// Ranges of [`Backend::lstm_backward_step`] in buffers of the given lengths.
fn check_lstm_backward_step(
    at: &LstmStep,
    act_len: usize,
    cells_len: usize,
    dh_len: usize,
    dc_len: usize,
    dgates_len: usize,
    dc_prev_len: usize,
) -> Result<LstmBackwardSpans> {
    let (bh, g) = (at.batch * at.hidden, 4 * at.batch * at.hidden);
    Ok(LstmBackwardSpans {
        act: span("lstm act", at.step * g, g, act_len)?,
        c_prev: span("lstm c_prev slot", at.prev_slot * bh, bh, cells_len)?,
        c: span("lstm c slot", at.out_slot * bh, bh, cells_len)?,
        dh: span("lstm dh", at.step * bh, bh, dh_len)?,
        dc: span("lstm dc", 0, bh, dc_len)?,
        dgates: span("lstm dgates", at.step * g, g, dgates_len)?,
        dc_prev: span("lstm dc_prev", 0, bh, dc_prev_len)?,
    })
}

/// Ranges `[logits, loss, lse]` of [`Backend::softmax_xent_forward`].
fn check_softmax_xent_forward(
    rows: usize,
    vocab: usize,
    logits_len: usize,
    loss_len: usize,
    lse_len: usize,
) -> Result<[Range<usize>; 3]> {
    Ok([
        span("softmax logits", 0, rows * vocab, logits_len)?,
        span("softmax loss", 0, rows, loss_len)?,
        span("softmax lse", 0, rows, lse_len)?,
    ])
}

/// Ranges `[logits, lse]` of [`Backend::softmax_xent_backward`].
fn check_softmax_xent_backward(
    rows: usize,
    vocab: usize,
    logits_len: usize,
    lse_len: usize,
) -> Result<[Range<usize>; 2]> {
    Ok([
        span("softmax logits", 0, rows * vocab, logits_len)?,
        span("softmax lse", 0, rows, lse_len)?,
    ])
}
