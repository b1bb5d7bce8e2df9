//! The bf16 matrix products against the exact (f64) product of the same bf16 operands,
//! on every path this CPU has, over shapes that cross every block edge and the three
//! layouts a backend uses (NN, NT, TN).
//!
//! A path the CPU lacks is reported as skipped, with the reason, by
//! `every_path_this_cpu_lacks_is_reported_with_the_reason` (run it with `--show-output` to
//! see the report; `scripts/test` does); the portable path is always tested, and so are
//! the software models of the AVX2, AVX-512 BF16 and AMX instructions, which run those
//! paths' packing and tile walking on any CPU.

use proptest::prelude::*;
use ringtrain_kernels::bf16;
use ringtrain_kernels::gemm_bf16::{
    gemm_bf16, gemm_bf16_modelled, gemm_bf16_packed, Bf16Path, KernelTimes, MatRef, PackedB,
    AMX_MR, AMX_PAIRS, AVX2_MR, KC, MC, MR, NC, NR,
};

/// A way to compute the product: a path on this CPU (B packed by the product, or ahead),
/// or a path's software model.
#[derive(Debug, Clone, Copy)]
enum Runner {
    Hardware(Bf16Path),
    Packed(Bf16Path),
    Model(Bf16Path),
}

impl Runner {
    fn run(
        self,
        a: MatRef<'_>,
        b: MatRef<'_>,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) -> ringtrain_kernels::Result<()> {
        match self {
            Runner::Hardware(p) => gemm_bf16(p, a, b, c, ldc, accumulate),
            Runner::Packed(p) => gemm_bf16_packed(a, &PackedB::new(p, b)?, c, ldc, accumulate),
            Runner::Model(p) => gemm_bf16_modelled(p, a, b, c, ldc, accumulate),
        }
    }

    fn name(self) -> String {
        match self {
            Runner::Hardware(p) => p.name().to_string(),
            Runner::Packed(p) => format!("{} (B packed ahead)", p.name()),
            Runner::Model(p) => format!("{} (software model)", p.name()),
        }
    }
}

/// The paths with instructions of their own, which have software models.
const MODELLED: [Bf16Path; 4] = [
    Bf16Path::Avx2Fma,
    Bf16Path::Avx512Fma,
    Bf16Path::Avx512Bf16,
    Bf16Path::Amx,
];

/// The paths this CPU can run (B packed by the product and ahead), and the models of the
/// AVX2, AVX-512 and AMX paths.
fn runnable() -> Vec<Runner> {
    Bf16Path::runnable()
        .into_iter()
        .flat_map(|p| [Runner::Hardware(p), Runner::Packed(p)])
        .chain(MODELLED.map(Runner::Model))
        .collect()
}

#[derive(Debug, Clone, Copy)]
enum Layout {
    /// A and B stored as they are used.
    Nn,
    /// B stored transposed (`[n, k]`).
    Nt,
    /// A stored transposed (`[k, m]`).
    Tn,
}

impl Layout {
    /// A `[m, k]` and B `[k, n]` as views of `a_data` and `b_data` stored in this layout.
    fn views<'a>(
        self,
        a_data: &'a [bf16],
        b_data: &'a [bf16],
        m: usize,
        n: usize,
        k: usize,
    ) -> (MatRef<'a>, MatRef<'a>) {
        match self {
            Layout::Nn => (
                MatRef::row_major(a_data, m, k).unwrap(),
                MatRef::row_major(b_data, k, n).unwrap(),
            ),
            Layout::Nt => (
                MatRef::row_major(a_data, m, k).unwrap(),
                MatRef::row_major(b_data, n, k).unwrap().t(),
            ),
            Layout::Tn => (
                MatRef::row_major(a_data, k, m).unwrap().t(),
                MatRef::row_major(b_data, k, n).unwrap(),
            ),
        }
    }
}

fn values(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            bf16::from_f32(((s >> 11) % 4001) as f32 / 1000.0 - 2.0)
        })
        .collect()
}

/// Checks `path` on `C (m × n, row stride ldc) (+)= A·B` against the f64 product of the
/// same operands: within the f32 accumulation bound `(k + 2) · 2⁻²⁴ · (Σ|a·b| + |c|)`.
fn check(path: Runner, layout: Layout, m: usize, n: usize, k: usize, accumulate: bool) {
    let ldc = n + 3;
    let a_data = values(m * k, (m * 31 + k) as u64);
    let b_data = values(k * n, (n * 17 + k) as u64 + 7);
    let (a, b) = layout.views(&a_data, &b_data, m, n, k);
    let at = |i: usize, kk: usize| -> f64 {
        match layout {
            Layout::Tn => a_data[kk * m + i].to_f64(),
            _ => a_data[i * k + kk].to_f64(),
        }
    };
    let bt = |kk: usize, j: usize| -> f64 {
        match layout {
            Layout::Nt => b_data[j * k + kk].to_f64(),
            _ => b_data[kk * n + j].to_f64(),
        }
    };
    let c0: Vec<f32> = (0..m * ldc).map(|i| (i % 7) as f32 * 0.25 - 0.5).collect();
    let mut c = c0.clone();
    path.run(a, b, &mut c, ldc, accumulate).unwrap();
    let unit = 2f64.powi(-24);
    for i in 0..m {
        for j in 0..n {
            let start = if accumulate {
                f64::from(c0[i * ldc + j])
            } else {
                0.0
            };
            let (mut exact, mut magnitude) = (start, start.abs());
            for kk in 0..k {
                let t = at(i, kk) * bt(kk, j);
                exact += t;
                magnitude += t.abs();
            }
            let bound = (k as f64 + 2.0) * unit * magnitude + 1e-30;
            let got = f64::from(c[i * ldc + j]);
            assert!(
                (got - exact).abs() <= bound,
                "{} {layout:?} m {m} n {n} k {k}: C[{i}][{j}] = {got}, exact {exact}, bound {bound}",
                path.name()
            );
        }
        // The padding between rows is not touched.
        for j in n..ldc {
            if i + 1 < m {
                assert_eq!(c[i * ldc + j], c0[i * ldc + j], "padding of row {i}");
            }
        }
    }
}

#[test]
fn every_path_this_cpu_lacks_is_reported_with_the_reason() {
    for path in Bf16Path::ALL {
        match path.unavailable_reason() {
            None => println!("bf16 GEMM path {}: tested", path.name()),
            Some(why) => println!("bf16 GEMM path {}: SKIPPED: {why}", path.name()),
        }
    }
    for path in MODELLED {
        println!(
            "bf16 GEMM path {} (software model of its instructions): tested",
            path.name()
        );
    }
    assert!(
        Bf16Path::Portable.available(),
        "the portable path runs everywhere"
    );
    assert!(Bf16Path::detect().available());
    // The first path the CPU has in this order is the one chosen, except that the two
    // AVX-512 paths are chosen between by their timed kernels (and only then).
    let first = [
        Bf16Path::Amx,
        Bf16Path::Avx512Bf16,
        Bf16Path::Avx512Fma,
        Bf16Path::Avx2Fma,
        Bf16Path::Portable,
    ]
    .into_iter()
    .find(|p| p.available());
    let times = Bf16Path::avx512_times();
    assert_eq!(times.is_some(), first == Some(Bf16Path::Avx512Bf16));
    let chosen = match times {
        Some(t) => {
            println!(
                "AVX-512 kernels timed here: avx512-bf16 {:.0} ns, avx512-fma {:.0} ns per block",
                t.avx512_bf16_ns, t.avx512_fma_ns
            );
            assert!(t.avx512_bf16_ns > 0.0 && t.avx512_fma_ns > 0.0, "{t:?}");
            t.choice()
        }
        None => first.unwrap(),
    };
    assert_eq!(Bf16Path::detect(), chosen);
    assert_eq!(
        Bf16Path::runnable(),
        Bf16Path::ALL
            .into_iter()
            .filter(|p| p.available())
            .collect::<Vec<_>>()
    );
    println!("bf16 GEMM path chosen here: {}", Bf16Path::detect().name());
}

/// The timed choice between the AVX-512 paths takes `avx512-fma` only where its kernel
/// is faster by the margin, so that a CPU where the two are close keeps one path.
#[test]
fn the_fma_kernel_is_chosen_only_where_it_is_clearly_faster() {
    let times = |bf16, fma| KernelTimes {
        avx512_bf16_ns: bf16,
        avx512_fma_ns: fma,
    };
    // Emerald Rapids: VDPBF16PS at half the multiply-adds' rate.
    assert_eq!(times(1500.0, 800.0).choice(), Bf16Path::Avx512Fma);
    assert_eq!(times(1000.0, 900.0).choice(), Bf16Path::Avx512Fma);
    assert_eq!(times(1000.0, 950.0).choice(), Bf16Path::Avx512Bf16);
    assert_eq!(times(1000.0, 1000.0).choice(), Bf16Path::Avx512Bf16);
    // Zen 4 and 5: VDPBF16PS does twice the work at the multiply-adds' rate.
    assert_eq!(times(700.0, 1400.0).choice(), Bf16Path::Avx512Bf16);
}

#[test]
fn each_model_adds_in_the_order_its_instruction_does() {
    // Row 0 of A holds pairs (big, 1), row 1 pairs (1, big), one AMX step deep; B is ones
    // and C starts at -16 big. A 1 added next to a multiple of big is lost, so the result
    // shows the order of the additions:
    // - portable, in order of k: row 0 ends on big - big + 1 = 1, row 1 on 0; so do the
    //   FMA paths, whose fused multiply-adds take the same order;
    // - VDPBF16PS adds the odd product of each pair first: row 0 ends on 0, row 1 on 1;
    // - TDPBF16PS sums the even and the odd products apart and adds their sum to C:
    //   16 big + 16 rounds to 16 big, so both rows end on 0.
    let big = bf16::from_f32(1.0e8);
    let k = 2 * AMX_PAIRS;
    let a_data: Vec<bf16> = (0..2 * k)
        .map(|i| {
            let (row, kk) = (i / k, i % k);
            if (kk % 2 == 0) == (row == 0) {
                big
            } else {
                bf16::ONE
            }
        })
        .collect();
    let b_data = vec![bf16::ONE; k];
    let a = MatRef::row_major(&a_data, 2, k).unwrap();
    let b = MatRef::row_major(&b_data, k, 1).unwrap();
    let start = -(AMX_PAIRS as f32) * big.to_f32();
    for (path, want) in [
        (Bf16Path::Portable, [1.0, 0.0]),
        (Bf16Path::Avx2Fma, [1.0, 0.0]),
        (Bf16Path::Avx512Fma, [1.0, 0.0]),
        (Bf16Path::Avx512Bf16, [0.0, 1.0]),
        (Bf16Path::Amx, [0.0, 0.0]),
    ] {
        let mut c = [start; 2];
        gemm_bf16_modelled(path, a, b, &mut c, 1, true).unwrap();
        assert_eq!(c, want, "{}", path.name());
    }
}

#[test]
fn every_path_is_within_the_accumulation_bound_across_every_block_edge() {
    for path in runnable() {
        for &(m, n, k) in &[
            (MR + 1, NR + 1, KC + 1),
            // AVX2: rows across its 4-row panels, columns across its 16-column halves.
            (AVX2_MR + 3, NR / 2 + 3, 9),
            (MC + 3, 2 * NR - 1, 2 * KC + 3),
            (2, NC + 5, 7),
            // AMX: rows across its 16-row tiles and 32-row panels, k across its 32-deep
            // steps and the KC blocks (the last one shorter than a step).
            (AMX_MR + 17, NR + 16, 2 * AMX_PAIRS + 1),
            (2 * AMX_MR - 1, 17, KC + 2 * AMX_PAIRS + 5),
        ] {
            for layout in [Layout::Nn, Layout::Nt, Layout::Tn] {
                check(path, layout, m, n, k, true);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn every_path_is_within_the_accumulation_bound_for_any_shape(
        m in 1usize..40,
        n in 1usize..70,
        k in 1usize..90,
        layout in prop_oneof![Just(Layout::Nn), Just(Layout::Nt), Just(Layout::Tn)],
        accumulate in any::<bool>(),
    ) {
        for path in runnable() {
            check(path, layout, m, n, k, accumulate);
        }
    }
}

#[test]
fn the_portable_path_equals_the_f32_product_of_the_widened_operands_bit_for_bit() {
    let (m, n, k) = (MR * 2 + 3, NR + 7, KC + 9);
    let a_data = values(k * m, 11);
    let b_data = values(n * k, 12);
    // TN and NT at once: A stored [k, m], B stored [n, k].
    let a = MatRef::row_major(&a_data, k, m).unwrap().t();
    let b = MatRef::row_major(&b_data, n, k).unwrap().t();
    let mut c = vec![0.0f32; m * n];
    gemm_bf16(Bf16Path::Portable, a, b, &mut c, n, false).unwrap();
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for kk in 0..k {
                acc += a_data[kk * m + i].to_f32() * b_data[j * k + kk].to_f32();
            }
            assert_eq!(c[i * n + j].to_bits(), acc.to_bits(), "C[{i}][{j}]");
        }
    }
}

/// The FMA paths' fused multiply-adds round where the portable path's adds do (a product
/// of two bf16 is exact in f32), so with no product subnormal or overflowing they give the
/// portable path's bits: their models everywhere, the hardware where the CPU has it, in
/// the three layouts and across their row panels, column halves and the k blocks.
#[test]
fn the_fma_paths_give_the_portable_paths_bits() {
    let (m, n, k) = (MC + AVX2_MR + MR + 1, NR + NR / 2 + 3, KC + 7);
    let mut runners = Vec::new();
    for path in [Bf16Path::Avx2Fma, Bf16Path::Avx512Fma] {
        runners.push(Runner::Model(path));
        if path.available() {
            runners.extend([Runner::Hardware(path), Runner::Packed(path)]);
        }
    }
    let a_data = values(m * k, 21);
    let b_data = values(k * n, 22);
    for layout in [Layout::Nn, Layout::Nt, Layout::Tn] {
        let (a, b) = layout.views(&a_data, &b_data, m, n, k);
        for accumulate in [false, true] {
            let c0: Vec<f32> = (0..m * n).map(|i| (i % 9) as f32 * 0.125 - 0.5).collect();
            let mut want = c0.clone();
            gemm_bf16(Bf16Path::Portable, a, b, &mut want, n, accumulate).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for runner in &runners {
                let mut got = c0.clone();
                runner.run(a, b, &mut got, n, accumulate).unwrap();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{} {layout:?}, accumulate {accumulate}",
                    runner.name()
                );
            }
        }
    }
}

#[test]
fn zero_sized_products_write_only_what_they_must() {
    for path in runnable() {
        let a = [bf16::ONE; 6];
        // k = 0: C = 0 without accumulate, unchanged with it.
        let mut c = vec![5.0f32; 4];
        let empty: [bf16; 0] = [];
        let a0 = MatRef::row_major(&empty, 2, 0).unwrap();
        let b0 = MatRef::row_major(&empty, 0, 2).unwrap();
        path.run(a0, b0, &mut c, 2, true).unwrap();
        assert_eq!(c, [5.0; 4]);
        path.run(a0, b0, &mut c, 2, false).unwrap();
        assert_eq!(c, [0.0; 4]);
        // m = 0: nothing at all.
        let mut c = vec![5.0f32; 4];
        let am = MatRef::row_major(&a, 0, 3).unwrap();
        let b = MatRef::row_major(&a, 3, 2).unwrap();
        path.run(am, b, &mut c, 2, false).unwrap();
        assert_eq!(c, [5.0; 4]);
    }
}

#[test]
fn bad_shapes_are_refused_before_anything_is_written() {
    let a_data = [bf16::ONE; 12];
    let a = MatRef::row_major(&a_data, 3, 4).unwrap();
    let b = MatRef::row_major(&a_data, 3, 4).unwrap();
    let mut c = vec![7.0f32; 12];
    let err = gemm_bf16(Bf16Path::Portable, a, b, &mut c, 4, false).unwrap_err();
    assert!(err.to_string().contains("b (rows)"), "{err}");
    let b = MatRef::row_major(&a_data, 4, 3).unwrap();
    let err = gemm_bf16(Bf16Path::Portable, a, b, &mut c[..8], 3, false).unwrap_err();
    assert!(
        err.to_string().contains("`c` has 8 elements, expected 9"),
        "{err}"
    );
    let err = gemm_bf16(Bf16Path::Portable, a, b, &mut c, 2, false).unwrap_err();
    assert!(err.to_string().contains("for ldc"), "{err}");
    assert_eq!(c, [7.0; 12], "nothing written");
    let err = MatRef::row_major(&a_data, 4, 4).unwrap_err();
    assert!(
        err.to_string()
            .contains("`data` has 12 elements, expected 16"),
        "{err}"
    );
    for path in Bf16Path::ALL {
        if let Some(why) = path.unavailable_reason() {
            let err = gemm_bf16(path, a, b, &mut c, 3, false).unwrap_err();
            assert!(err.to_string().contains("Bf16Path::detect"), "{why}: {err}");
        }
    }
}

#[test]
fn a_b_packed_ahead_gives_the_bits_of_a_b_packed_by_the_product() {
    // Columns across two column blocks (NC) and rows of B across three k blocks (KC).
    let (m, n, k) = (MR + 3, NC + 37, 2 * KC + 3);
    for path in Bf16Path::runnable() {
        for layout in [Layout::Nn, Layout::Nt] {
            let a_data = values(m * k, 5);
            let b_data = values(k * n, 6);
            let a = MatRef::row_major(&a_data, m, k).unwrap();
            let b = match layout {
                Layout::Nt => MatRef::row_major(&b_data, n, k).unwrap().t(),
                _ => MatRef::row_major(&b_data, k, n).unwrap(),
            };
            let packed = PackedB::new(path, b).unwrap();
            assert_eq!((packed.rows(), packed.cols(), packed.path()), (k, n, path));
            for accumulate in [false, true] {
                let c0: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32 - 2.0).collect();
                let (mut want, mut got) = (c0.clone(), c0);
                gemm_bf16(path, a, b, &mut want, n, accumulate).unwrap();
                gemm_bf16_packed(a, &packed, &mut got, n, accumulate).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{} {layout:?}", path.name());
            }
        }
    }
}

#[test]
fn a_packed_b_of_the_wrong_shape_is_refused_before_anything_is_written() {
    let b_data = values(6, 1);
    let packed = PackedB::new(
        Bf16Path::Portable,
        MatRef::row_major(&b_data, 3, 2).unwrap(),
    )
    .unwrap();
    let a_data = values(8, 2);
    let mut c = vec![7.0f32; 8];
    let err = gemm_bf16_packed(
        MatRef::row_major(&a_data, 2, 4).unwrap(),
        &packed,
        &mut c,
        2,
        false,
    )
    .unwrap_err();
    assert!(err.to_string().contains("b (rows)"), "{err}");
    assert_eq!(c, [7.0; 8]);
}
