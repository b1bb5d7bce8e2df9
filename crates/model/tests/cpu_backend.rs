//! CPU backend operations against plain-loop references, and the operand checks both
//! backends share.

mod toy;

use proptest::prelude::*;
use ringtrain_model::{
    view, view_mut, Backend, Binary, CheckedIds, CheckedTargets, CpuBackend, Error, Layout,
    LstmForwardStep, Unary,
};

/// Element `(r, c)` of `l`.
fn at(l: &Layout, r: usize, c: usize) -> usize {
    l.offset() + r * l.row_stride() + c * l.col_stride()
}

/// A·B with plain loops in f64, added to (or replacing) C; any layouts.
fn reference_gemm(
    (a, la): (&[f32], Layout),
    (b, lb): (&[f32], Layout),
    (c, lc): (&mut [f32], Layout),
    accumulate: bool,
) {
    let (m, k) = la.shape();
    let n = lb.cols();
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for p in 0..k {
                acc += f64::from(a[at(&la, i, p)]) * f64::from(b[at(&lb, p, j)]);
            }
            let dst = &mut c[at(&lc, i, j)];
            *dst = if accumulate {
                *dst + acc as f32
            } else {
                acc as f32
            };
        }
    }
}

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| {
            (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 16) % 200) as f32 / 100.0
                - 1.0
        })
        .collect()
}

/// A `[rows, cols]` operand at `off`, rows `pad` elements apart beyond their length,
/// stored transposed when `trans` (then `[cols, rows]` is what is stored).
fn operand(off: usize, (rows, cols): (usize, usize), pad: usize, trans: bool) -> Layout {
    if trans {
        Layout::matrix(off, cols, rows)
            .with_row_stride(rows + pad)
            .t()
    } else {
        Layout::matrix(off, rows, cols).with_row_stride(cols + pad)
    }
}

fn buffer_for(l: &Layout, seed: u32) -> Vec<f32> {
    values(l.span().map_or(0, |s| s.end), seed)
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
    #![proptest_config(ProptestConfig::with_cases(cases(48)))]
    #[test]
    fn gemm_matches_reference_for_every_transpose(
        m in 1usize..40, n in 1usize..40, k in 1usize..40,
        trans_a: bool, trans_b: bool, trans_c: bool, accumulate: bool,
        pad in 0usize..3, off in 0usize..5, threads in 1usize..3,
    ) {
        let la = operand(off, (m, k), pad, trans_a);
        let lb = operand(2 * off, (k, n), pad, trans_b);
        let lc = operand(off, (m, n), pad, trans_c);
        let (a, b, c0) = (buffer_for(&la, 1), buffer_for(&lb, 2), buffer_for(&lc, 3));
        let mut want = c0.clone();
        reference_gemm((&a, la), (&b, lb), (&mut want, lc), accumulate);
        let backend = toy::cpu(threads);
        let mut got = c0.clone();
        backend.gemm(view(&a, la), view(&b, lb), view_mut(&mut got, lc), accumulate).unwrap();
        for (i, (x, y)) in got.iter().zip(&want).enumerate() {
            prop_assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "element {i}: {x} vs {y}");
        }
    }
}

#[test]
fn gemm_rejects_views_past_the_buffer() {
    let backend = toy::cpu(1);
    let (a, b) = (vec![0.0f32; 6], vec![0.0f32; 6]);
    let mut c = vec![0.0f32; 3];
    let err = backend
        .gemm(
            view(&a, Layout::matrix(0, 2, 3)),
            view(&b, Layout::matrix(0, 3, 2)),
            view_mut(&mut c, Layout::matrix(0, 2, 2)),
            false,
        )
        .expect_err("C too small");
    assert!(
        matches!(
            err,
            Error::OutOfBounds {
                what: "gemm C",
                end: 4,
                len: 3
            }
        ),
        "{err}"
    );
    let err = backend
        .gemm(
            view(&a, Layout::matrix(4, 1, 3)),
            view(&b, Layout::matrix(0, 3, 2)),
            view_mut(&mut c, Layout::matrix(0, 1, 2)),
            false,
        )
        .expect_err("A offset");
    assert!(
        matches!(err, Error::OutOfBounds { what: "gemm A", .. }),
        "{err}"
    );
    assert_eq!(backend.launches(), 0, "rejected calls launch nothing");
}

/// `err` is an `InvalidView` naming `name`.
fn assert_invalid(err: Error, name: &str) {
    assert!(
        matches!(&err, Error::InvalidView { name: n, .. } if *n == name),
        "expected InvalidView naming `{name}`, got: {err}"
    );
}

#[test]
fn disagreeing_shapes_and_unusable_strides_are_rejected_naming_the_operand() {
    let backend = toy::cpu(1);
    let buf = values(64, 1);
    let mut out = vec![0.0f32; 64];
    let gemm = |a: Layout, b: Layout, c: Layout, out: &mut Vec<f32>| {
        backend
            .gemm(view(&buf, a), view(&buf, b), view_mut(out, c), false)
            .expect_err("rejected")
    };
    let (a23, b32, c22) = (
        Layout::matrix(0, 2, 3),
        Layout::matrix(0, 3, 2),
        Layout::matrix(0, 2, 2),
    );
    assert_invalid(gemm(a23, Layout::matrix(0, 2, 2), c22, &mut out), "gemm B");
    assert_invalid(gemm(a23, b32, Layout::matrix(0, 3, 2), &mut out), "gemm C");
    // no unit stride
    let every_other = Layout::strided(0, (2, 3), (6, 2));
    assert_invalid(gemm(every_other, b32, c22, &mut out), "gemm A");
    // rows overlapping: a row stride shorter than the row
    assert_invalid(gemm(a23.with_row_stride(2), b32, c22, &mut out), "gemm A");
    assert_invalid(gemm(a23, b32, c22.with_row_stride(1), &mut out), "gemm C");

    let err = backend
        .binary(
            Binary::Add,
            view(&buf, Layout::contiguous(0, 8)),
            view(&buf, Layout::contiguous(8, 7)),
            view_mut(&mut out, Layout::contiguous(0, 8)),
        )
        .expect_err("lengths differ");
    assert_invalid(err, "binary input b");
    let err = backend
        .unary(
            Unary::Tanh,
            view(&buf, Layout::matrix(0, 2, 3).with_row_stride(4)),
            view_mut(&mut out, Layout::contiguous(0, 6)),
        )
        .expect_err("strided input");
    assert_invalid(err, "unary input");
    let err = backend
        .column_sums(
            view(&buf, Layout::matrix(0, 4, 3)),
            view_mut(&mut out, Layout::contiguous(0, 4)),
            false,
        )
        .expect_err("one sum per column");
    assert_invalid(err, "column_sums destination");

    // ids checked against 5 rows do not fit a table of 4
    let ids = backend
        .stage_ids(CheckedIds::new("ids", &[4, 0], 5).unwrap())
        .unwrap();
    let err = backend
        .gather_rows(
            view(&buf, Layout::matrix(0, 4, 3)),
            &ids,
            view_mut(&mut out, Layout::matrix(0, 2, 3)),
        )
        .expect_err("table too short for the ids' bound");
    assert_invalid(err, "gather table");
    let err = backend
        .gather_rows(
            view(&buf, Layout::matrix(0, 5, 3)),
            &ids,
            view_mut(&mut out, Layout::matrix(0, 3, 3)),
        )
        .expect_err("one row per id");
    assert_invalid(err, "gather destination");

    let targets = backend
        .stage_targets(CheckedTargets::new("labels", &[1, 2, 0], &[1.0; 3], 4).unwrap())
        .unwrap();
    let (mut loss, mut lse) = (vec![0.0f32; 4], vec![0.0f32; 4]);
    let err = backend
        .softmax_xent_forward(
            view(&buf, Layout::matrix(0, 4, 4)),
            &targets,
            0,
            view_mut(&mut loss, Layout::contiguous(0, 4)),
            view_mut(&mut lse, Layout::contiguous(0, 4)),
        )
        .expect_err("4 rows of logits, 3 labels");
    assert_invalid(err, "softmax targets");
    let err = backend
        .softmax_xent_forward(
            view(&buf, Layout::matrix(0, 2, 4)),
            &targets,
            2,
            view_mut(&mut loss, Layout::contiguous(0, 2)),
            view_mut(&mut lse, Layout::contiguous(0, 2)),
        )
        .expect_err("2 rows of logits from target row 2 of 3");
    assert_invalid(err, "softmax targets");
    let err = backend
        .softmax_xent_forward(
            view(&buf, Layout::matrix(0, 3, 3)),
            &targets,
            0,
            view_mut(&mut loss, Layout::contiguous(0, 3)),
            view_mut(&mut lse, Layout::contiguous(0, 3)),
        )
        .expect_err("labels checked against 4 classes, 3 logits per row");
    assert_invalid(err, "softmax logits");

    // c written over c_prev
    let (batch, hidden) = (2, 3);
    let (mut cells, mut h, mut act) = (vec![0.0f32; 12], vec![0.0f32; 6], vec![0.0f32; 24]);
    let slot = |i: usize| Layout::matrix(i * 3, batch, hidden);
    let gates = Layout::matrix(0, batch, 4 * hidden);
    let err = backend
        .lstm_forward_step(LstmForwardStep {
            input_proj: view(&buf, gates),
            recurrent: view(&buf, gates),
            bias: view(&buf, Layout::contiguous(0, 4 * hidden)),
            cells: &mut cells,
            c_prev: slot(0),
            c: slot(1),
            h: view_mut(&mut h, slot(0)),
            act: view_mut(&mut act, gates),
        })
        .expect_err("slots overlap");
    assert_invalid(err, "lstm c");
    assert_eq!(backend.launches(), 0, "rejected calls launch nothing");
}

#[test]
fn both_operands_transposed_and_a_transposed_result() {
    // A·B with A and B both stored transposed, on small integers.
    let backend = toy::cpu(1);
    let at_stored = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]; // Aᵀ: [[1, 2, 3], [4, 5, 6]], A = [3, 2]
    let bt_stored = vec![1.0f32, 0.0, 1.0, 1.0]; // Bᵀ: [[1, 0], [1, 1]], B = [[1, 1], [0, 1]]
    let mut c = vec![0.0f32; 6];
    backend
        .gemm(
            view(&at_stored, Layout::matrix(0, 2, 3)).t(),
            view(&bt_stored, Layout::matrix(0, 2, 2)).t(),
            view_mut(&mut c, Layout::matrix(0, 3, 2)),
            false,
        )
        .unwrap();
    // A = [[1, 4], [2, 5], [3, 6]]; A·B = [[1, 5], [2, 7], [3, 9]]
    assert_eq!(c, [1.0, 5.0, 2.0, 7.0, 3.0, 9.0]);
    // The same product written transposed: Cᵀ stored [2, 3].
    let mut ct = vec![0.0f32; 6];
    backend
        .gemm(
            view(&at_stored, Layout::matrix(0, 2, 3)).t(),
            view(&bt_stored, Layout::matrix(0, 2, 2)).t(),
            view_mut(&mut ct, Layout::matrix(0, 2, 3).t()),
            false,
        )
        .unwrap();
    assert_eq!(ct, [1.0, 2.0, 3.0, 5.0, 7.0, 9.0]);
}

#[test]
fn gather_scatter_and_column_sums() {
    let backend = CpuBackend::new(1).unwrap();
    let table: Vec<f32> = (0..12).map(|x| x as f32).collect(); // [4, 3]
    let ids = backend
        .stage_ids(CheckedIds::new("ids", &[2, 0, 2], 4).unwrap())
        .unwrap();
    let mut out = vec![0.0f32; 9];
    let rows3 = Layout::matrix(0, 3, 3);
    backend
        .gather_rows(
            view(&table, Layout::matrix(0, 4, 3)),
            &ids,
            view_mut(&mut out, rows3),
        )
        .unwrap();
    assert_eq!(out, [6.0, 7.0, 8.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
    let mut grad = vec![0.0f32; 12];
    backend
        .scatter_add_rows(
            view(&out, rows3),
            &ids,
            view_mut(&mut grad, Layout::matrix(0, 4, 3)),
        )
        .unwrap();
    assert_eq!(
        grad,
        [0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 12.0, 14.0, 16.0, 0.0, 0.0, 0.0]
    );
    let mut sums = vec![1.0f32; 3];
    let three = Layout::contiguous(0, 3);
    backend
        .column_sums(view(&out, rows3), view_mut(&mut sums, three), true)
        .unwrap();
    assert_eq!(sums, [13.0, 16.0, 19.0]);
    backend
        .column_sums(view(&out, rows3), view_mut(&mut sums, three), false)
        .unwrap();
    assert_eq!(sums, [12.0, 15.0, 18.0]);
    assert_eq!(backend.launches(), 4);
}

#[test]
fn ids_and_targets_are_checked_once_when_made() {
    let err = CheckedIds::new("src", &[0, 3, 4], 4).expect_err("id 4 of 4 rows");
    assert!(
        matches!(err, Error::InvalidBatch { name: "src", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("4 at position 2"), "{err}");
    let ok = CheckedIds::new("src", &[0, 3], 4).unwrap();
    assert_eq!((ok.ids(), ok.bound()), (&[0u32, 3][..], 4));

    // a label outside the vocabulary is allowed on a padding row (mask 0) only
    assert!(CheckedTargets::new("tgt_out", &[1, 99], &[1.0, 0.0], 4).is_ok());
    let err = CheckedTargets::new("tgt_out", &[1, 99], &[1.0, 1.0], 4).expect_err("label 99");
    assert!(
        matches!(
            err,
            Error::InvalidBatch {
                name: "tgt_out",
                ..
            }
        ),
        "{err}"
    );
    let err = CheckedTargets::new("tgt_out", &[1, 2], &[1.0, f32::NAN], 4).expect_err("NaN");
    assert!(
        matches!(err, Error::InvalidBatch { name: "mask", .. }),
        "{err}"
    );
    let err = CheckedTargets::new("tgt_out", &[1, 2], &[1.0], 4).expect_err("short mask");
    assert!(
        matches!(err, Error::InvalidBatch { name: "mask", .. }),
        "{err}"
    );
}
