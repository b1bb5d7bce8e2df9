//! Where an operand lives inside its buffer: the 2-D strided [`Layout`], and the views
//! [`View`] / [`ViewMut`] that pair a buffer with one (candle's `Layout` and tensor views,
//! cut down to the two dimensions the models use).

use std::fmt;
use std::ops::Range;

use crate::error::{Error, Result};

/// A `[rows, cols]` matrix of elements inside a flat buffer.
///
/// Element `(r, c)` is buffer element `offset + r * row_stride + c * col_stride`. A dense
/// row-major matrix ([`Layout::matrix`]) has `col_stride == 1` and `row_stride == cols`; a
/// larger row stride ([`Layout::with_row_stride`]) addresses a block of columns of a wider
/// matrix, such as one gate block of a `[rows, 4H]` matrix. [`Layout::t`] swaps the two
/// dimensions and the two strides: the transpose of a stored matrix, for free. A vector
/// is a `[1, len]` matrix ([`Layout::contiguous`]).
///
/// A layout is plain arithmetic: nothing ties it to a buffer until an operation checks it
/// against one with [`Layout::check`], which every backend operation does for every operand.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Layout {
    offset: usize,
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl fmt::Debug for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}, {}] at {} strides ({}, {})",
            self.rows, self.cols, self.offset, self.row_stride, self.col_stride
        )
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

impl Layout {
    /// `len` consecutive elements from `offset`, as a `[1, len]` matrix.
    pub const fn contiguous(offset: usize, len: usize) -> Layout {
        Layout {
            offset,
            rows: 1,
            cols: len,
            row_stride: len,
            col_stride: 1,
        }
    }

    /// A dense row-major `[rows, cols]` matrix from `offset`.
    pub const fn matrix(offset: usize, rows: usize, cols: usize) -> Layout {
        Layout {
            offset,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// Any `[rows, cols]` layout with the given `(row_stride, col_stride)`.
    pub const fn strided(
        offset: usize,
        (rows, cols): (usize, usize),
        (row_stride, col_stride): (usize, usize),
    ) -> Layout {
        Layout {
            offset,
            rows,
            cols,
            row_stride,
            col_stride,
        }
    }

    /// The same matrix with rows `row_stride` elements apart.
    pub const fn with_row_stride(self, row_stride: usize) -> Layout {
        Layout { row_stride, ..self }
    }

    /// The transpose: `[cols, rows]` with the strides swapped, over the same elements.
    pub const fn t(self) -> Layout {
        Layout {
            offset: self.offset,
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
        }
    }

    /// Rows `start..start + len` of the matrix (same columns and strides). Not checked
    /// against `rows`: the operation that uses the result checks it against its buffer.
    pub const fn narrow_rows(self, start: usize, len: usize) -> Layout {
        Layout {
            offset: self
                .offset
                .saturating_add(start.saturating_mul(self.row_stride)),
            rows: len,
            ..self
        }
    }

    /// Columns `start..start + len` of the matrix (same rows and strides), e.g. gate block
    /// `k` of a `[rows, 4H]` matrix is `narrow_cols(k * H, H)`. Not checked against `cols`.
    pub const fn narrow_cols(self, start: usize, len: usize) -> Layout {
        Layout {
            offset: self
                .offset
                .saturating_add(start.saturating_mul(self.col_stride)),
            cols: len,
            ..self
        }
    }

    /// Buffer index of element `(0, 0)`.
    pub const fn offset(&self) -> usize {
        self.offset
    }

    /// Number of rows.
    pub const fn rows(&self) -> usize {
        self.rows
    }

    /// Number of columns.
    pub const fn cols(&self) -> usize {
        self.cols
    }

    /// `(rows, cols)`.
    pub const fn shape(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Elements between the starts of consecutive rows.
    pub const fn row_stride(&self) -> usize {
        self.row_stride
    }

    /// Elements between consecutive columns of a row.
    pub const fn col_stride(&self) -> usize {
        self.col_stride
    }

    /// Number of elements, `rows * cols` (saturating).
    pub const fn len(&self) -> usize {
        self.rows.saturating_mul(self.cols)
    }

    /// True when the layout has no elements.
    pub const fn is_empty(&self) -> bool {
        self.rows == 0 || self.cols == 0
    }

    /// True when the elements, in row-major order, are the consecutive buffer elements
    /// `offset..offset + len` (strides of dimensions of extent 1 do not matter).
    pub const fn is_contiguous(&self) -> bool {
        self.is_empty()
            || ((self.cols == 1 || self.col_stride == 1)
                && (self.rows == 1 || self.row_stride == self.cols))
    }

    /// The buffer elements the layout can touch: from `offset` to one past its last
    /// element (empty at `offset` for an empty layout); `None` when the end overflows.
    pub fn span(&self) -> Option<Range<usize>> {
        if self.is_empty() {
            return Some(self.offset..self.offset);
        }
        let last = (self.rows - 1)
            .checked_mul(self.row_stride)?
            .checked_add((self.cols - 1).checked_mul(self.col_stride)?)?;
        let end = self.offset.checked_add(last)?.checked_add(1)?;
        Some(self.offset..end)
    }

    /// The bounds check of every backend operation: [`Layout::span`] if it lies inside a
    /// buffer of `buf_len` elements.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] naming the operand `what` when the span ends past `buf_len`
    /// (or overflows).
    pub fn check(&self, buf_len: usize, what: &'static str) -> Result<Range<usize>> {
        match self.span() {
            Some(span) if span.end <= buf_len => Ok(span),
            span => Err(Error::OutOfBounds {
                what,
                end: span.map_or(usize::MAX, |s| s.end),
                len: buf_len,
            }),
        }
    }
}

/// A read-only operand: a buffer and where the operand lies in it.
pub struct View<'a, Buf> {
    /// The buffer.
    pub buf: &'a Buf,
    /// Where the operand lies in `buf`.
    pub layout: Layout,
}

impl<Buf> Clone for View<'_, Buf> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<Buf> Copy for View<'_, Buf> {}

impl<Buf> fmt::Debug for View<'_, Buf> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("View")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl<'a, Buf> View<'a, Buf> {
    /// The transposed operand (see [`Layout::t`]).
    pub fn t(self) -> View<'a, Buf> {
        View {
            buf: self.buf,
            layout: self.layout.t(),
        }
    }
}

/// A written operand: a buffer borrowed mutably and where the operand lies in it.
pub struct ViewMut<'a, Buf> {
    /// The buffer.
    pub buf: &'a mut Buf,
    /// Where the operand lies in `buf`.
    pub layout: Layout,
}

impl<Buf> fmt::Debug for ViewMut<'_, Buf> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ViewMut")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl<Buf> ViewMut<'_, Buf> {
    /// A shorter-lived mutable view of the same operand.
    pub fn reborrow(&mut self) -> ViewMut<'_, Buf> {
        ViewMut {
            buf: self.buf,
            layout: self.layout,
        }
    }

    /// A read-only view of the same operand.
    pub fn as_view(&self) -> View<'_, Buf> {
        View {
            buf: self.buf,
            layout: self.layout,
        }
    }
}

/// `buf` at `layout`, read-only.
pub fn view<Buf>(buf: &Buf, layout: Layout) -> View<'_, Buf> {
    View { buf, layout }
}

/// `buf` at `layout`, to be written.
pub fn view_mut<Buf>(buf: &mut Buf, layout: Layout) -> ViewMut<'_, Buf> {
    ViewMut { buf, layout }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_and_matrix_spans() {
        assert_eq!(Layout::contiguous(3, 4).span(), Some(3..7));
        assert_eq!(Layout::matrix(2, 3, 5).span(), Some(2..17));
        assert_eq!(
            Layout::matrix(2, 3, 5).with_row_stride(8).span(),
            Some(2..23)
        );
        assert_eq!(Layout::matrix(9, 0, 5).span(), Some(9..9));
        assert_eq!(Layout::matrix(9, 5, 0).span(), Some(9..9));
    }

    #[test]
    fn transpose_swaps_shape_and_strides_over_the_same_span() {
        let l = Layout::matrix(4, 3, 5).with_row_stride(7);
        let t = l.t();
        assert_eq!(t.shape(), (5, 3));
        assert_eq!((t.row_stride(), t.col_stride()), (1, 7));
        assert_eq!(t.span(), l.span());
        assert_eq!(t.t(), l);
        assert!(!t.is_contiguous());
        assert!(Layout::contiguous(1, 6).t().is_contiguous());
    }

    #[test]
    fn narrowing_moves_the_offset_by_the_strides() {
        let w = Layout::matrix(10, 4, 12);
        let gate = w.narrow_cols(6, 3);
        assert_eq!(
            (gate.offset(), gate.shape(), gate.row_stride()),
            (16, (4, 3), 12)
        );
        let rows = w.narrow_rows(2, 2);
        assert_eq!((rows.offset(), rows.shape()), (34, (2, 12)));
        assert!(rows.is_contiguous());
        assert!(!gate.is_contiguous());
    }

    #[test]
    fn check_names_the_operand_and_the_end() {
        let err = Layout::matrix(2, 3, 5)
            .check(16, "gemm C")
            .expect_err("ends at 17");
        assert!(
            matches!(
                err,
                Error::OutOfBounds {
                    what: "gemm C",
                    end: 17,
                    len: 16
                }
            ),
            "{err}"
        );
        assert_eq!(
            Layout::matrix(2, 3, 5).check(17, "gemm C").ok(),
            Some(2..17)
        );
        // an empty operand must still start inside (or at the end of) the buffer
        assert!(Layout::contiguous(5, 0).check(5, "x").is_ok());
        assert!(Layout::contiguous(6, 0).check(5, "x").is_err());
        let huge = Layout::strided(1, (usize::MAX, 2), (usize::MAX, 1));
        assert_eq!(huge.span(), None);
        let err = huge.check(10, "huge").expect_err("overflow");
        assert!(
            matches!(
                err,
                Error::OutOfBounds {
                    end: usize::MAX,
                    ..
                }
            ),
            "{err}"
        );
    }
}
