//! CPU backend operations against plain-loop references.

mod toy;

use proptest::prelude::*;
use ringtrain_model::{Backend, CpuBackend, Error, Gemm};

/// op(A)·op(B) with plain loops in f64, added to (or replacing) C.
fn reference_gemm(a: &[f32], b: &[f32], c: &mut [f32], g: &Gemm) {
    for i in 0..g.m {
        for j in 0..g.n {
            let mut acc = 0.0f64;
            for p in 0..g.k {
                let x = if g.trans_a {
                    a[g.a_offset + p * g.lda + i]
                } else {
                    a[g.a_offset + i * g.lda + p]
                };
                let y = if g.trans_b {
                    b[g.b_offset + j * g.ldb + p]
                } else {
                    b[g.b_offset + p * g.ldb + j]
                };
                acc += f64::from(x) * f64::from(y);
            }
            let dst = &mut c[g.c_offset + i * g.ldc + j];
            *dst = if g.accumulate {
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn gemm_matches_reference(
        m in 1usize..40, n in 1usize..40, k in 1usize..40,
        trans_a: bool, trans_b: bool, accumulate: bool,
        pad in 0usize..3, off in 0usize..5, threads in 1usize..3,
    ) {
        let (a_rows, a_cols) = if trans_a { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if trans_b { (n, k) } else { (k, n) };
        let spec = Gemm {
            m, n, k,
            a_offset: off, lda: a_cols + pad, trans_a,
            b_offset: 2 * off, ldb: b_cols + pad, trans_b,
            c_offset: off, ldc: n + pad, accumulate,
        };
        let a = values(off + a_rows * (a_cols + pad), 1);
        let b = values(2 * off + b_rows * (b_cols + pad), 2);
        let c0 = values(off + m * (n + pad), 3);
        let mut want = c0.clone();
        reference_gemm(&a, &b, &mut want, &spec);
        let backend = toy::cpu(threads);
        let mut got = c0.clone();
        backend.gemm(&a, &b, &mut got, &spec).unwrap();
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
        .gemm(&a, &b, &mut c, &Gemm::nn(2, 2, 3))
        .expect_err("C too small");
    assert!(
        matches!(err, Error::OutOfBounds { what: "gemm C", .. }),
        "{err}"
    );
    let err = backend
        .gemm(&a, &b, &mut c, &Gemm::nn(1, 2, 3).at(4, 0, 0))
        .expect_err("A offset");
    assert!(
        matches!(err, Error::OutOfBounds { what: "gemm A", .. }),
        "{err}"
    );
}

#[test]
fn gather_scatter_and_column_sums() {
    let backend = CpuBackend::new(1).unwrap();
    let table: Vec<f32> = (0..12).map(|x| x as f32).collect(); // [4, 3]
    let ids = [2u32, 0, 2];
    let mut out = vec![0.0f32; 9];
    backend
        .gather_rows(&table, 0, 4, 3, &ids, &mut out, 0)
        .unwrap();
    assert_eq!(out, [6.0, 7.0, 8.0, 0.0, 1.0, 2.0, 6.0, 7.0, 8.0]);
    let mut grad = vec![0.0f32; 12];
    backend
        .scatter_add_rows(&out, 0, &ids, 3, &mut grad, 0, 4)
        .unwrap();
    assert_eq!(
        grad,
        [0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 12.0, 14.0, 16.0, 0.0, 0.0, 0.0]
    );
    let err = backend
        .gather_rows(&table, 0, 4, 3, &[4], &mut out, 0)
        .expect_err("id 4 of 4 rows");
    assert!(matches!(err, Error::OutOfBounds { .. }), "{err}");
    let mut sums = vec![1.0f32; 3];
    backend
        .column_sums(&out, 0, 3, 3, &mut sums, 0, true)
        .unwrap();
    assert_eq!(sums, [13.0, 16.0, 19.0]);
    backend
        .column_sums(&out, 0, 3, 3, &mut sums, 0, false)
        .unwrap();
    assert_eq!(sums, [12.0, 15.0, 18.0]);
    // The rejected gather launched nothing.
    assert_eq!(backend.launches(), 4);
}
