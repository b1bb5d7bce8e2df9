//! The operand layout: spans, transposes, narrowing and the one bounds check, against
//! the elements a layout addresses, enumerated.

use proptest::prelude::*;
use ringtrain_model::{Error, Layout};

/// Buffer index of every element of `l`, row-major.
fn elements(l: &Layout) -> Vec<usize> {
    let mut out = Vec::new();
    for r in 0..l.rows() {
        for c in 0..l.cols() {
            out.push(l.offset() + r * l.row_stride() + c * l.col_stride());
        }
    }
    out
}

fn layouts() -> impl Strategy<Value = Layout> {
    (0usize..20, 0usize..7, 0usize..7, 0usize..9, 0usize..9).prop_map(
        |(offset, rows, cols, row_stride, col_stride)| {
            Layout::strided(offset, (rows, cols), (row_stride, col_stride))
        },
    )
}

/// Cases per property: `PROPTEST_CASES` when set (a long soak), else `quick`, this
/// file's default, sized for CI.
fn cases(quick: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(quick)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(256)))]

    #[test]
    fn the_span_covers_exactly_the_first_to_the_last_element(l in layouts()) {
        let span = l.span().expect("small layouts do not overflow");
        let els = elements(&l);
        prop_assert_eq!(els.len(), l.len());
        prop_assert_eq!(l.is_empty(), els.is_empty());
        match (els.iter().min(), els.iter().max()) {
            (Some(&lo), Some(&hi)) => {
                prop_assert_eq!(span.start, lo);
                prop_assert_eq!(span.end, hi + 1);
            }
            _ => prop_assert_eq!(span, l.offset()..l.offset()),
        }
    }

    #[test]
    fn check_accepts_exactly_the_buffers_that_hold_the_span(l in layouts(), len in 0usize..80) {
        let span = l.span().expect("small layouts do not overflow");
        match l.check(len, "x") {
            Ok(range) => {
                prop_assert!(span.end <= len);
                prop_assert_eq!(range, span);
            }
            Err(Error::OutOfBounds { what, end, len: got }) => {
                prop_assert!(span.end > len);
                prop_assert_eq!((what, end, got), ("x", span.end, len));
            }
            Err(other) => prop_assert!(false, "unexpected error {other}"),
        }
    }

    #[test]
    fn transpose_swaps_indices_over_the_same_elements(l in layouts()) {
        let t = l.t();
        prop_assert_eq!(t.shape(), (l.cols(), l.rows()));
        prop_assert_eq!(t.t(), l);
        prop_assert_eq!(t.span(), l.span());
        let (els, tels) = (elements(&l), elements(&t));
        for r in 0..l.rows() {
            for c in 0..l.cols() {
                prop_assert_eq!(els[r * l.cols() + c], tels[c * l.rows() + r]);
            }
        }
    }

    #[test]
    fn contiguous_means_consecutive_in_row_major_order(l in layouts()) {
        let consecutive = elements(&l)
            .iter()
            .enumerate()
            .all(|(i, &e)| e == l.offset() + i);
        prop_assert_eq!(l.is_contiguous(), consecutive);
    }

    #[test]
    fn narrowing_selects_the_sub_matrix(
        (offset, rows, cols, pad, r0, nr, c0, nc) in (0usize..10, 1usize..7, 1usize..7, 0usize..4)
            .prop_flat_map(|(offset, rows, cols, pad)| {
                (Just(offset), Just(rows), Just(cols), Just(pad), 0..=rows, 0..=cols)
            })
            .prop_flat_map(|(offset, rows, cols, pad, r0, c0)| {
                (Just(offset), Just(rows), Just(cols), Just(pad), Just(r0), 0..=rows - r0, Just(c0), 0..=cols - c0)
            }),
    ) {
        let l = Layout::matrix(offset, rows, cols).with_row_stride(cols + pad);
        let sub = l.narrow_rows(r0, nr).narrow_cols(c0, nc);
        prop_assert_eq!(sub.shape(), (nr, nc));
        let els = elements(&l);
        let subs = elements(&sub);
        for r in 0..nr {
            for c in 0..nc {
                prop_assert_eq!(subs[r * nc + c], els[(r0 + r) * cols + c0 + c]);
            }
        }
        // a non-empty sub-matrix of a checked matrix is inside the same buffer
        let len = l.span().unwrap().end;
        prop_assert!(sub.is_empty() || sub.check(len, "sub").is_ok());
    }

    #[test]
    fn dense_constructors_are_contiguous(offset in 0usize..50, rows in 0usize..9, cols in 0usize..9) {
        let m = Layout::matrix(offset, rows, cols);
        prop_assert!(m.is_contiguous());
        prop_assert_eq!(m.span(), Some(offset..offset + rows * cols));
        let v = Layout::contiguous(offset, cols);
        prop_assert_eq!((v.shape(), v.is_contiguous()), ((1, cols), true));
        prop_assert!(v.t().is_contiguous());
    }
}

#[test]
fn overflowing_layouts_are_out_of_bounds_not_a_panic() {
    let huge = Layout::strided(7, (3, 2), (usize::MAX / 2, 1));
    assert_eq!(huge.span(), None);
    assert!(matches!(
        huge.check(100, "huge"),
        Err(Error::OutOfBounds {
            what: "huge",
            end: usize::MAX,
            len: 100
        })
    ));
    let far = Layout::matrix(0, 4, 4).narrow_rows(usize::MAX, 1);
    assert!(far.check(16, "far").is_err());
}
