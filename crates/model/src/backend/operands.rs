//! The operand checks both backends run before an operation (see the module docs of
//! [`crate::backend`]): each returns the element ranges the operation touches, or the
//! first problem in argument order, shapes and strides before bounds.

use std::ops::Range;

use super::{
    invalid_view, Backend, Layout, LstmBackwardStep, LstmForwardStep, Staged, View, ViewMut,
};
use crate::error::{Error, Result};

/// One operand as the checks see it: its name, layout and the length of its buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Arg {
    what: &'static str,
    layout: Layout,
    buf_len: usize,
}

/// `v` (a [`View`] or a [`ViewMut`]) as operand `what`.
pub(crate) fn arg<B: Backend + ?Sized>(
    be: &B,
    what: &'static str,
    v: &impl Operand<B::Buffer>,
) -> Arg {
    Arg {
        what,
        layout: v.layout(),
        buf_len: be.len(v.buf()),
    }
}

/// What [`arg`] reads from a view.
pub(crate) trait Operand<Buf> {
    fn layout(&self) -> Layout;
    fn buf(&self) -> &Buf;
}

impl<Buf> Operand<Buf> for View<'_, Buf> {
    fn layout(&self) -> Layout {
        self.layout
    }
    fn buf(&self) -> &Buf {
        self.buf
    }
}

impl<Buf> Operand<Buf> for ViewMut<'_, Buf> {
    fn layout(&self) -> Layout {
        self.layout
    }
    fn buf(&self) -> &Buf {
        self.buf
    }
}

impl Arg {
    /// An operand of `layout` in a buffer of `buf_len` elements.
    pub(crate) fn new(what: &'static str, layout: Layout, buf_len: usize) -> Arg {
        Arg {
            what,
            layout,
            buf_len,
        }
    }

    fn invalid(&self, reason: impl Into<String>) -> Error {
        invalid_view(self.what, self.layout, reason)
    }

    /// The bounds check ([`Layout::check`]).
    fn range(&self) -> Result<Range<usize>> {
        self.layout.check(self.buf_len, self.what)
    }

    fn contiguous(&self) -> Result<()> {
        if self.layout.is_contiguous() {
            Ok(())
        } else {
            Err(self.invalid(
                "this operation reads and writes consecutive elements: pass a contiguous layout",
            ))
        }
    }

    /// Contiguous and `[rows, cols]`.
    fn matrix(&self, (rows, cols): (usize, usize)) -> Result<()> {
        self.contiguous()?;
        if self.layout.shape() == (rows, cols) {
            Ok(())
        } else {
            Err(self.invalid(format!("expected a [{rows}, {cols}] matrix")))
        }
    }

    /// Contiguous with `len` elements, any shape; `of` says what the length is.
    fn vector(&self, len: usize, of: impl FnOnce() -> String) -> Result<()> {
        self.contiguous()?;
        if self.layout.len() == len {
            Ok(())
        } else {
            Err(self.invalid(format!("expected {len} elements ({})", of())))
        }
    }
}

/// The ranges of `args`, bounds-checked in order.
fn ranges<const N: usize>(args: [Arg; N]) -> Result<[Range<usize>; N]> {
    let mut out: [Range<usize>; N] = std::array::from_fn(|_| 0..0);
    for (range, a) in out.iter_mut().zip(&args) {
        *range = a.range()?;
    }
    Ok(out)
}

/// Element-wise operations and reductions (fill, copy, unary, binary, in-place, sum):
/// every operand contiguous, all as long as the first.
pub(crate) fn elementwise<const N: usize>(args: [Arg; N]) -> Result<[Range<usize>; N]> {
    if let Some(first) = args.first() {
        let len = first.layout.len();
        for a in &args {
            a.vector(len, || format!("as many as `{}`", first.what))?;
        }
    }
    ranges(args)
}

/// Column sums and row bias adds: a contiguous `[rows, cols]` matrix and a contiguous
/// vector of `cols` elements. Returns `[matrix, vector]`.
pub(crate) fn matrix_and_row(matrix: Arg, row: Arg) -> Result<[Range<usize>; 2]> {
    matrix.contiguous()?;
    row.vector(matrix.layout.cols(), || {
        format!("one per column of `{}`", matrix.what)
    })?;
    ranges([matrix, row])
}

/// Gather and scatter-add of rows by id: `rows` (`[ids.rows(), width]`) and `table`
/// (`[table_rows, width]` with `table_rows >= ids.bound()`), both contiguous. Returns
/// `[rows, table]` and `width`.
pub(crate) fn rows_by_id(
    ids: &impl Staged,
    rows: Arg,
    table: Arg,
) -> Result<([Range<usize>; 2], usize)> {
    table.contiguous()?;
    let (table_rows, width) = table.layout.shape();
    if ids.bound() > table_rows {
        return Err(table.invalid(format!(
            "the ids were checked against {} rows: the table needs at least that many",
            ids.bound()
        )));
    }
    rows.matrix((ids.rows(), width))?;
    Ok((ranges([rows, table])?, width))
}

/// Ranges of a softmax operation's operands, and its shape.
pub(crate) struct SoftmaxRanges<const N: usize> {
    pub(crate) logits: Range<usize>,
    pub(crate) per_row: [Range<usize>; N],
    /// The target rows the logits are scored against.
    pub(crate) targets: Range<usize>,
    pub(crate) rows: usize,
    pub(crate) vocab: usize,
}

/// The softmax cross-entropy: contiguous `[rows, vocab]` logits, targets checked against
/// at most `vocab` with rows `first_row..first_row + rows`, and contiguous per-row
/// operands of `rows` elements. The ranges' `targets` are the rows of the targets used.
pub(crate) fn softmax<const N: usize>(
    logits: Arg,
    targets: &impl Staged,
    first_row: usize,
    per_row: [Arg; N],
) -> Result<SoftmaxRanges<N>> {
    logits.contiguous()?;
    let (rows, vocab) = logits.layout.shape();
    let used = first_row..first_row.saturating_add(rows);
    if used.end > targets.rows() {
        return Err(invalid_view(
            "softmax targets",
            format!("{} rows", targets.rows()),
            format!(
                "expected a label for each row of `{}` ({rows}) from target row {first_row} on",
                logits.what
            ),
        ));
    }
    if targets.bound() > vocab {
        return Err(logits.invalid(format!(
            "the labels were checked against a vocabulary of {}: the logits need that many columns",
            targets.bound()
        )));
    }
    for a in &per_row {
        a.vector(rows, || format!("one per row of `{}`", logits.what))?;
    }
    Ok(SoftmaxRanges {
        logits: logits.range()?,
        per_row: ranges(per_row)?,
        targets: used,
        rows,
        vocab,
    })
}

/// A GEMM operand after the checks: its range and how it is stored.
#[derive(Debug, Clone)]
pub(crate) struct GemmMatrix {
    /// The elements the operand spans in its buffer.
    pub(crate) range: Range<usize>,
    /// Stored transposed: element `(r, c)` at `c * ld + r` (else at `r * ld + c`).
    pub(crate) trans: bool,
    /// Stride of the non-unit dimension, at least the extent of the unit one.
    pub(crate) ld: usize,
}

/// A checked product `C[m, n] = A[m, k]·B[k, n]` with a row-major `C`.
#[derive(Debug, Clone)]
pub(crate) struct GemmOperands {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) a: GemmMatrix,
    pub(crate) b: GemmMatrix,
    /// Row-major (`trans == false`).
    pub(crate) c: GemmMatrix,
    /// The call's `C` was column-major: the product is computed as `Cᵀ = Bᵀ·Aᵀ`, so `a`
    /// above is the call's `B` (transposed) and `b` its `A`.
    pub(crate) swapped: bool,
}

/// How a GEMM operand of `layout` is stored: `(trans, ld)`, or `None` when neither stride
/// is a unit stride with the other covering the unit dimension.
fn gemm_storage(layout: &Layout) -> Option<(bool, usize)> {
    let (rows, cols) = layout.shape();
    let (rs, cs) = (layout.row_stride(), layout.col_stride());
    let row_major = ((cs == 1 || cols <= 1) && (rows <= 1 || rs >= cols))
        .then(|| (false, if rows <= 1 { rs.max(cols) } else { rs }));
    let col_major = ((rs == 1 || rows <= 1) && (cols <= 1 || cs >= rows))
        .then(|| (true, if cols <= 1 { cs.max(rows) } else { cs }));
    // A layout of a single row or column fits both: keep the one its strides say.
    if rs == 1 && cs != 1 {
        col_major.or(row_major)
    } else {
        row_major.or(col_major)
    }
}

/// The matrix product's operands: shapes `[m, k]·[k, n] -> [m, n]`, one unit stride each.
pub(crate) fn gemm(a: Arg, b: Arg, c: Arg) -> Result<GemmOperands> {
    let (m, k) = a.layout.shape();
    let n = b.layout.cols();
    if b.layout.rows() != k {
        return Err(b.invalid(format!(
            "expected {k} rows, the columns of `{}` (shapes [m, k]·[k, n])",
            a.what
        )));
    }
    if c.layout.shape() != (m, n) {
        return Err(c.invalid(format!("expected the [{m}, {n}] product")));
    }
    let storage = |x: &Arg| {
        gemm_storage(&x.layout).ok_or_else(|| {
            x.invalid(
                "a GEMM operand needs a unit stride in one dimension and, in the other, a stride at \
                 least the extent of the first (a row-major matrix, a block of its columns, or the \
                 transpose of either)",
            )
        })
    };
    let (sa, sb, sc) = (storage(&a)?, storage(&b)?, storage(&c)?);
    let [ra, rb, rc] = ranges([a, b, c])?;
    let matrix = |range, (trans, ld)| GemmMatrix { range, trans, ld };
    Ok(if sc.0 {
        // Cᵀ[n, m] = Bᵀ·Aᵀ, row-major: transposing flips how each operand is stored.
        GemmOperands {
            m: n,
            n: m,
            k,
            a: matrix(rb, (!sb.0, sb.1)),
            b: matrix(ra, (!sa.0, sa.1)),
            c: matrix(rc, (false, sc.1)),
            swapped: true,
        }
    } else {
        GemmOperands {
            m,
            n,
            k,
            a: matrix(ra, sa),
            b: matrix(rb, sb),
            c: matrix(rc, sc),
            swapped: false,
        }
    })
}

/// Ranges of [`LstmForwardStep`]'s operands, and `(batch, hidden)`.
pub(crate) struct LstmForwardRanges {
    pub(crate) input_proj: Range<usize>,
    pub(crate) recurrent: Range<usize>,
    pub(crate) bias: Range<usize>,
    pub(crate) c_prev: Range<usize>,
    pub(crate) c: Range<usize>,
    pub(crate) h: Range<usize>,
    pub(crate) act: Range<usize>,
    pub(crate) batch: usize,
    pub(crate) hidden: usize,
}

/// The fused forward step: every operand contiguous, `c_prev`, `c`, `h` `[batch, H]`,
/// `input_proj`, `recurrent`, `act` `[batch, 4H]`, `4H` bias elements, and `c` apart from
/// `c_prev` in the cells buffer.
pub(crate) fn lstm_forward<B: Backend + ?Sized>(
    be: &B,
    s: &LstmForwardStep<'_, B::Buffer>,
) -> Result<LstmForwardRanges> {
    let cells_len = be.len(s.cells);
    let c = Arg::new("lstm c", s.c, cells_len);
    let c_prev = Arg::new("lstm c_prev", s.c_prev, cells_len);
    let (input_proj, recurrent, bias) = (
        arg(be, "lstm input_proj", &s.input_proj),
        arg(be, "lstm recurrent", &s.recurrent),
        arg(be, "lstm bias", &s.bias),
    );
    let (h, act) = (arg(be, "lstm h", &s.h), arg(be, "lstm act", &s.act));
    c.contiguous()?;
    let (batch, hidden) = c.layout.shape();
    let gates = (batch, hidden.saturating_mul(4));
    c_prev.matrix((batch, hidden))?;
    h.matrix((batch, hidden))?;
    input_proj.matrix(gates)?;
    recurrent.matrix(gates)?;
    bias.vector(gates.1, || "4 gates of H".into())?;
    act.matrix(gates)?;
    let [input_proj, recurrent, bias, c_prev, c, h, act] =
        ranges([input_proj, recurrent, bias, c_prev, c, h, act])?;
    if c.start < c_prev.end && c_prev.start < c.end {
        return Err(invalid_view(
            "lstm c",
            s.c,
            format!(
                "overlaps `lstm c_prev` ({}) in the cells buffer: read and write different slots",
                s.c_prev
            ),
        ));
    }
    Ok(LstmForwardRanges {
        input_proj,
        recurrent,
        bias,
        c_prev,
        c,
        h,
        act,
        batch,
        hidden,
    })
}

/// Ranges of [`LstmBackwardStep`]'s operands, and `(batch, hidden)`.
pub(crate) struct LstmBackwardRanges {
    pub(crate) act: Range<usize>,
    pub(crate) c_prev: Range<usize>,
    pub(crate) c: Range<usize>,
    pub(crate) dh: Range<usize>,
    pub(crate) dc: Range<usize>,
    pub(crate) dgates: Range<usize>,
    pub(crate) dc_prev: Range<usize>,
    pub(crate) batch: usize,
    pub(crate) hidden: usize,
}

/// The fused backward step: every operand contiguous, `act` and `dgates` `[batch, 4H]`,
/// the rest `[batch, H]`.
pub(crate) fn lstm_backward<B: Backend + ?Sized>(
    be: &B,
    s: &LstmBackwardStep<'_, B::Buffer>,
) -> Result<LstmBackwardRanges> {
    let c = arg(be, "lstm c", &s.c);
    c.contiguous()?;
    let (batch, hidden) = c.layout.shape();
    let gates = (batch, hidden.saturating_mul(4));
    let args = [
        (arg(be, "lstm act", &s.act), gates),
        (arg(be, "lstm c_prev", &s.c_prev), (batch, hidden)),
        (c, (batch, hidden)),
        (arg(be, "lstm dh", &s.dh), (batch, hidden)),
        (arg(be, "lstm dc", &s.dc), (batch, hidden)),
        (arg(be, "lstm dgates", &s.dgates), gates),
        (arg(be, "lstm dc_prev", &s.dc_prev), (batch, hidden)),
    ];
    for (a, shape) in &args {
        a.matrix(*shape)?;
    }
    let [act, c_prev, c, dh, dc, dgates, dc_prev] = ranges(args.map(|(a, _)| a))?;
    Ok(LstmBackwardRanges {
        act,
        c_prev,
        c,
        dh,
        dc,
        dgates,
        dc_prev,
        batch,
        hidden,
    })
}
