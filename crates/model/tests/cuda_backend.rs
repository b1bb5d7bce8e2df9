//! The CUDA backend against the CPU backend (needs a CUDA device: built into the GPU bundle
//! by scripts/build-gpu-bundle, run by scripts/gpu-check).
//!
//! Tolerances, stated once:
//! * bit-exact: fill, copy, gather/scatter of embedding rows, column sums of up to 256
//!   rows, bias adds, element-wise add/mul and the in-place gradient products;
//! * the operand checks: the same calls rejected with the same errors on both;
//! * taller column sums (chunks of 256 rows): (256 + rows/256)·2^-24·Σ|x| per column;
//! * sigmoid / tanh: 2e-6 absolute (ex2.approx-based, see ptx/model_ops.ptx);
//! * GEMM, every combination of transposed A, B and C: 1e-5 of max|C| (f32 accumulation
//!   in another order);
//! * sum: (2^-24 + n·2^-52)·Σ|x| (ptx/model_ops.ptx);
//! * whole models (f32): summed loss within 1e-5 relative, every gradient tensor within
//!   1e-4 of its largest CPU element (at least 1e-6 absolute), launch counts equal;
//! * 5 SGD steps (lr 0.5): every parameter within 1e-4 absolute of the CPU's;
//! * bf16 / f16 GEMM operands (mixed precision): loss within 2e-2 relative, and a product
//!   of two transposed operands within 2e-2 of max|C|.
#![cfg(feature = "cuda")]

mod toy;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_model::GemmPrecision;
use ringtrain_model::{
    view, view_mut, Backend, BiLayerInput, Binary, CheckedIds, CheckedTargets, CpuBackend,
    CudaBackend, EncoderKind, Error, InPlace, Layout, LmConfig, LstmBackwardStep, LstmForwardStep,
    LstmImpl, Model, NmtConfig, NmtModel, RnnLm, SourceLengths, Unary,
};

fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("these tests need CUDA device 0: {e}"),
    }
}

fn gpu_with(precision: GemmPrecision) -> CudaBackend {
    match CudaBackend::with_precision(0, precision) {
        Ok(b) => b,
        Err(e) => panic!("these tests need CUDA device 0: {e}"),
    }
}

fn random(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
}

/// A host vector on both backends.
fn both(
    cpu: &CpuBackend,
    gpu: &CudaBackend,
    host: &[f32],
) -> (Vec<f32>, ringtrain_cuda::GpuBuffer<f32>) {
    let mut c = cpu.zeros(host.len()).unwrap();
    cpu.upload(host, &mut c, 0).unwrap();
    let mut g = gpu.zeros(host.len()).unwrap();
    gpu.upload(host, &mut g, 0).unwrap();
    (c, g)
}

fn fetch(gpu: &CudaBackend, buf: &ringtrain_cuda::GpuBuffer<f32>) -> Vec<f32> {
    let mut host = vec![0.0; gpu.len(buf)];
    gpu.download(buf, 0, &mut host).unwrap();
    host
}

fn assert_bits_equal(what: &str, cpu: &[f32], gpu: &[f32]) {
    assert_eq!(cpu.len(), gpu.len(), "{what}: lengths");
    for (i, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        assert!(
            c.to_bits() == g.to_bits() || (c.is_nan() && g.is_nan()),
            "{what}: element {i}: cpu {c:e}, gpu {g:e}"
        );
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn max_abs(a: &[f32]) -> f32 {
    a.iter().map(|x| x.abs()).fold(0.0, f32::max)
}

#[test]
fn element_wise_and_embedding_ops_are_bit_identical() {
    let (cpu, gpu) = (toy::cpu(1), gpu());
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let (rows, cols) = (37, 45);
    let x = random(&mut rng, rows * cols + 3, 3.0);
    let y = random(&mut rng, rows * cols + 3, 3.0);
    let sig: Vec<f32> = (0..rows * cols).map(|_| rng.gen_range(0.0..1.0)).collect();
    let (xc, xg) = both(&cpu, &gpu, &x);
    let (yc, yg) = both(&cpu, &gpu, &y);
    let (sc, sg) = both(&cpu, &gpu, &sig);
    let n = rows * cols;
    let mut oc = cpu.zeros(n + 5).unwrap();
    let mut og = gpu.zeros(n + 5).unwrap();

    let flat = Layout::contiguous;
    cpu.fill(view_mut(&mut oc, flat(2, n)), -1.25).unwrap();
    gpu.fill(view_mut(&mut og, flat(2, n)), -1.25).unwrap();
    assert_bits_equal("fill", &oc, &fetch(&gpu, &og));
    cpu.copy(view(&xc, flat(3, n)), view_mut(&mut oc, flat(1, n)))
        .unwrap();
    gpu.copy(view(&xg, flat(3, n)), view_mut(&mut og, flat(1, n)))
        .unwrap();
    assert_bits_equal("copy", &oc, &fetch(&gpu, &og));
    for op in [Binary::Add, Binary::Mul] {
        cpu.binary(
            op,
            view(&xc, flat(1, n)),
            view(&yc, flat(2, n)),
            view_mut(&mut oc, flat(3, n)),
        )
        .unwrap();
        gpu.binary(
            op,
            view(&xg, flat(1, n)),
            view(&yg, flat(2, n)),
            view_mut(&mut og, flat(3, n)),
        )
        .unwrap();
        assert_bits_equal(&format!("{op:?}"), &oc, &fetch(&gpu, &og));
    }
    for op in [InPlace::Add, InPlace::MulSigmoidGrad, InPlace::MulTanhGrad] {
        cpu.in_place(op, view(&sc, flat(0, n)), view_mut(&mut oc, flat(4, n)))
            .unwrap();
        gpu.in_place(op, view(&sg, flat(0, n)), view_mut(&mut og, flat(4, n)))
            .unwrap();
        assert_bits_equal(&format!("{op:?}"), &oc, &fetch(&gpu, &og));
    }
    let matrix = Layout::matrix(1, rows, cols);
    cpu.add_row_bias(view(&xc, flat(5, cols)), view_mut(&mut oc, matrix))
        .unwrap();
    gpu.add_row_bias(view(&xg, flat(5, cols)), view_mut(&mut og, matrix))
        .unwrap();
    assert_bits_equal("add_row_bias", &oc, &fetch(&gpu, &og));
    for accumulate in [false, true] {
        let src = Layout::matrix(2, rows, cols);
        cpu.column_sums(view(&xc, src), view_mut(&mut oc, flat(7, cols)), accumulate)
            .unwrap();
        gpu.column_sums(view(&xg, src), view_mut(&mut og, flat(7, cols)), accumulate)
            .unwrap();
        assert_bits_equal("column_sums", &oc, &fetch(&gpu, &og));
    }
    // embeddings: repeated ids, table at an offset
    let (table_rows, width) = (11, cols);
    let ids: Vec<u32> = (0..rows).map(|r| [3, 0, 3, 10, 7][r % 5]).collect();
    let checked = CheckedIds::new("ids", &ids, table_rows).unwrap();
    let (ids_c, ids_g) = (
        cpu.stage_ids(checked).unwrap(),
        gpu.stage_ids(checked).unwrap(),
    );
    let (table, rows_at) = (
        Layout::matrix(1, table_rows, width),
        Layout::matrix(2, rows, width),
    );
    cpu.gather_rows(view(&xc, table), &ids_c, view_mut(&mut oc, rows_at))
        .unwrap();
    gpu.gather_rows(view(&xg, table), &ids_g, view_mut(&mut og, rows_at))
        .unwrap();
    assert_bits_equal("gather_rows", &oc, &fetch(&gpu, &og));
    let (mut tc, mut tg) = both(&cpu, &gpu, &y);
    let (src, table) = (
        Layout::matrix(0, rows, width),
        Layout::matrix(3, table_rows, width),
    );
    // twice with the same staged ids: staged once, used by any number of launches
    for _ in 0..2 {
        cpu.scatter_add_rows(view(&xc, src), &ids_c, view_mut(&mut tc, table))
            .unwrap();
        gpu.scatter_add_rows(view(&xg, src), &ids_g, view_mut(&mut tg, table))
            .unwrap();
        assert_bits_equal("scatter_add_rows", &tc, &fetch(&gpu, &tg));
    }
    // ids checked against more rows than the table has: an error on both, before any work
    let small = Layout::matrix(0, 3, width);
    for err in [
        cpu.gather_rows(view(&xc, small), &ids_c, view_mut(&mut oc, rows_at))
            .expect_err("cpu"),
        gpu.gather_rows(view(&xg, small), &ids_g, view_mut(&mut og, rows_at))
            .expect_err("gpu"),
    ] {
        assert!(
            matches!(
                err,
                Error::InvalidView {
                    name: "gather table",
                    ..
                }
            ),
            "{err}"
        );
    }
    assert_eq!(
        cpu.launches(),
        gpu.launches(),
        "one launch per operation on both"
    );
}

#[test]
fn activations_gemm_softmax_and_sum_agree_within_tolerance() {
    let (cpu, gpu) = (toy::cpu(1), gpu());
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let n = 2000;
    let x = random(&mut rng, n, 12.0);
    let (xc, xg) = both(&cpu, &gpu, &x);
    let mut oc = cpu.zeros(n).unwrap();
    let mut og = gpu.zeros(n).unwrap();
    let flat = Layout::contiguous;
    for op in [Unary::Sigmoid, Unary::Tanh] {
        cpu.unary(op, view(&xc, flat(0, n)), view_mut(&mut oc, flat(0, n)))
            .unwrap();
        gpu.unary(op, view(&xg, flat(0, n)), view_mut(&mut og, flat(0, n)))
            .unwrap();
        let err = max_abs_diff(&oc, &fetch(&gpu, &og));
        assert!(err <= 2e-6, "{op:?}: max abs diff {err:e}");
    }
    // sum: the documented bound
    let total = gpu.sum(view(&xg, flat(3, n - 3))).unwrap();
    let exact = cpu.sum(view(&xc, flat(3, n - 3))).unwrap();
    let abs: f64 = x[3..].iter().map(|&v| f64::from(v.abs())).sum();
    let bound = (2f64.powi(-24) + (n as f64) * 2f64.powi(-52)) * abs;
    assert!(
        (total - exact).abs() <= bound,
        "sum {total} vs {exact} (bound {bound:e})"
    );
    // tall column sums (chunks of 256 rows): within (256 + rows/256)·2^-24·Σ|x| per column
    let (rows, cols) = (1000, 33);
    let tall = random(&mut rng, rows * cols, 2.0);
    let (tc, tg) = both(&cpu, &gpu, &tall);
    let (mut sc, mut sg) = (cpu.zeros(cols).unwrap(), gpu.zeros(cols).unwrap());
    let (src, dst) = (Layout::matrix(0, rows, cols), flat(0, cols));
    cpu.column_sums(view(&tc, src), view_mut(&mut sc, dst), false)
        .unwrap();
    gpu.column_sums(view(&tg, src), view_mut(&mut sg, dst), false)
        .unwrap();
    let got = fetch(&gpu, &sg);
    for c in 0..cols {
        let abs: f32 = (0..rows).map(|r| tall[r * cols + c].abs()).sum();
        let bound = (256.0 + rows as f32 / 256.0) * 2f32.powi(-24) * abs;
        let err = (got[c] - sc[c]).abs();
        assert!(err <= bound, "tall column_sums[{c}]: {err:e} > {bound:e}");
    }
    // GEMMs in every layout (A, B and C each as stored or transposed), with offsets,
    // padded strides and accumulation; both operands transposed copies the smaller one
    let (m, nn, k) = (33, 70, 45);
    let a = random(&mut rng, 4000, 1.0);
    let b = random(&mut rng, 4000, 1.0);
    let (ac, ag) = both(&cpu, &gpu, &a);
    let (bc, bg) = both(&cpu, &gpu, &b);
    let mut cc = cpu.zeros(3000).unwrap();
    let mut cg = gpu.zeros(3000).unwrap();
    let stored = |off: usize, (r, c): (usize, usize), pad: usize, trans: bool| {
        if trans {
            Layout::matrix(off, c, r).with_row_stride(r + pad).t()
        } else {
            Layout::matrix(off, r, c).with_row_stride(c + pad)
        }
    };
    for case in 0..16usize {
        let (ta, tb, tc) = (case & 1 != 0, case & 2 != 0, case & 4 != 0);
        let accumulate = case & 8 != 0;
        // a wide and a tall product, so that each operand of TT is the smaller once
        let (m, nn) = if case % 3 == 0 { (nn, m) } else { (m, nn) };
        let (la, lb, lc) = (
            stored(5, (m, k), case % 3, ta),
            stored(7, (k, nn), 2, tb),
            stored(3, (m, nn), case % 2, tc),
        );
        cpu.gemm(
            view(&ac, la),
            view(&bc, lb),
            view_mut(&mut cc, lc),
            accumulate,
        )
        .unwrap();
        gpu.gemm(
            view(&ag, la),
            view(&bg, lb),
            view_mut(&mut cg, lc),
            accumulate,
        )
        .unwrap();
        let err = max_abs_diff(&cc, &fetch(&gpu, &cg)) / max_abs(&cc);
        assert!(
            err <= 1e-5,
            "A {la} B {lb} C {lc} accumulate {accumulate}: relative error {err:e}"
        );
    }
    // shapes that disagree are the same error on both
    for err in [
        cpu.gemm(
            view(&ac, Layout::matrix(0, 4, 5)),
            view(&bc, Layout::matrix(0, 4, 5)),
            view_mut(&mut cc, Layout::matrix(0, 4, 5)),
            false,
        )
        .expect_err("cpu"),
        gpu.gemm(
            view(&ag, Layout::matrix(0, 4, 5)),
            view(&bg, Layout::matrix(0, 4, 5)),
            view_mut(&mut cg, Layout::matrix(0, 4, 5)),
            false,
        )
        .expect_err("gpu"),
    ] {
        assert!(
            matches!(err, Error::InvalidView { name: "gemm B", .. }),
            "{err}"
        );
    }
    // softmax forward and backward
    let (rows, vocab) = (9, 301);
    let logits = random(&mut rng, rows * vocab, 6.0);
    let labels: Vec<u32> = (0..rows as u32).map(|r| (r * 37) % vocab as u32).collect();
    let mask: Vec<f32> = (0..rows).map(|r| if r == 4 { 0.0 } else { 1.0 }).collect();
    let (mut lc, mut lg) = both(&cpu, &gpu, &logits);
    let (mut loss_c, mut lse_c) = (cpu.zeros(rows).unwrap(), cpu.zeros(rows).unwrap());
    let (mut loss_g, mut lse_g) = (gpu.zeros(rows).unwrap(), gpu.zeros(rows).unwrap());
    let checked = CheckedTargets::new("labels", &labels, &mask, vocab).unwrap();
    let (targets_c, targets_g) = (
        cpu.stage_targets(checked).unwrap(),
        gpu.stage_targets(checked).unwrap(),
    );
    let (lm, per_row) = (Layout::matrix(0, rows, vocab), flat(0, rows));
    cpu.softmax_xent_forward(
        view(&lc, lm),
        &targets_c,
        0,
        view_mut(&mut loss_c, per_row),
        view_mut(&mut lse_c, per_row),
    )
    .unwrap();
    gpu.softmax_xent_forward(
        view(&lg, lm),
        &targets_g,
        0,
        view_mut(&mut loss_g, per_row),
        view_mut(&mut lse_g, per_row),
    )
    .unwrap();
    assert!(
        max_abs_diff(&loss_c, &fetch(&gpu, &loss_g)) <= 4e-5,
        "softmax loss"
    );
    assert!(
        max_abs_diff(&lse_c, &fetch(&gpu, &lse_g)) <= 4e-5,
        "softmax lse"
    );
    // A chunk of rows 5..9 against the targets' rows 5..9, as the output projection
    // scores a batch in chunks: the same rows as the whole.
    let (first, n) = (5, 4);
    let chunk = Layout::matrix(first * vocab, n, vocab);
    let (mut chunk_loss_g, mut chunk_lse_g) = (gpu.zeros(n).unwrap(), gpu.zeros(n).unwrap());
    gpu.softmax_xent_forward(
        view(&lg, chunk),
        &targets_g,
        first,
        view_mut(&mut chunk_loss_g, flat(0, n)),
        view_mut(&mut chunk_lse_g, flat(0, n)),
    )
    .unwrap();
    assert!(
        max_abs_diff(&loss_c[first..], &fetch(&gpu, &chunk_loss_g)) <= 4e-5,
        "softmax loss of a chunk"
    );
    let err = gpu
        .softmax_xent_forward(
            view(&lg, chunk),
            &targets_g,
            first + 1,
            view_mut(&mut chunk_loss_g, flat(0, n)),
            view_mut(&mut chunk_lse_g, flat(0, n)),
        )
        .expect_err("rows 6..10 of 9 targets");
    assert!(
        matches!(
            err,
            Error::InvalidView {
                name: "softmax targets",
                ..
            }
        ),
        "{err}"
    );
    cpu.softmax_xent_backward(
        view_mut(&mut lc, lm),
        view(&lse_c, per_row),
        &targets_c,
        0,
        0.5,
    )
    .unwrap();
    // the backward step sees the CPU's lse on both sides (the forward's lse differs by
    // up to 2e-6 relative, which would move the probabilities by as much)
    let lse_same = act_c_on(&gpu, &lse_c);
    gpu.softmax_xent_backward(
        view_mut(&mut lg, lm),
        view(&lse_same, per_row),
        &targets_g,
        0,
        0.5,
    )
    .unwrap();
    assert!(
        max_abs_diff(&lc, &fetch(&gpu, &lg)) <= 4e-6,
        "softmax gradient"
    );
    // one LSTM step forward and backward: step 1 of 2, c_prev in slot 1, c in slot 2
    let (batch, hidden, steps) = (3, 16, 2);
    let g4 = 4 * batch * hidden;
    let gates = Layout::matrix(g4, batch, 4 * hidden);
    let slot = |i: usize| Layout::matrix(i * batch * hidden, batch, hidden);
    let (proj_c, proj_g) = both(&cpu, &gpu, &random(&mut rng, steps * g4, 2.0));
    let (rec_c, rec_g) = both(&cpu, &gpu, &random(&mut rng, g4, 2.0));
    let (bias_c, bias_g) = both(&cpu, &gpu, &random(&mut rng, 4 * hidden + 2, 1.0));
    let (mut cells_c, mut cells_g) = both(&cpu, &gpu, &random(&mut rng, 3 * batch * hidden, 1.0));
    let (mut h_c, mut h_g) = both(&cpu, &gpu, &vec![0.0; 3 * batch * hidden]);
    let (mut act_c, mut act_g) = both(&cpu, &gpu, &vec![0.0; steps * g4]);
    let rec = Layout::matrix(0, batch, 4 * hidden);
    let bias = flat(2, 4 * hidden);
    cpu.lstm_forward_step(LstmForwardStep {
        input_proj: view(&proj_c, gates),
        recurrent: view(&rec_c, rec),
        bias: view(&bias_c, bias),
        cells: &mut cells_c,
        c_prev: slot(1),
        c: slot(2),
        h: view_mut(&mut h_c, slot(2)),
        act: view_mut(&mut act_c, gates),
    })
    .unwrap();
    gpu.lstm_forward_step(LstmForwardStep {
        input_proj: view(&proj_g, gates),
        recurrent: view(&rec_g, rec),
        bias: view(&bias_g, bias),
        cells: &mut cells_g,
        c_prev: slot(1),
        c: slot(2),
        h: view_mut(&mut h_g, slot(2)),
        act: view_mut(&mut act_g, gates),
    })
    .unwrap();
    for (what, c, g) in [
        ("c", &cells_c, &cells_g),
        ("h", &h_c, &h_g),
        ("act", &act_c, &act_g),
    ] {
        let err = max_abs_diff(c, &fetch(&gpu, g));
        assert!(err <= 4e-6, "lstm forward {what}: {err:e}");
    }
    let (dh_c, dh_g) = both(&cpu, &gpu, &random(&mut rng, steps * batch * hidden, 1.0));
    let (dc_c, dc_g) = both(&cpu, &gpu, &random(&mut rng, batch * hidden, 1.0));
    let (mut dg_c, mut dg_g) = both(&cpu, &gpu, &vec![0.0; steps * g4]);
    let (mut dcp_c, mut dcp_g) = both(&cpu, &gpu, &vec![0.0; batch * hidden]);
    let (dh, state) = (slot(1), slot(0));
    cpu.lstm_backward_step(LstmBackwardStep {
        act: view(&act_c, gates),
        c_prev: view(&cells_c, slot(1)),
        c: view(&cells_c, slot(2)),
        dh: view(&dh_c, dh),
        dc: view(&dc_c, state),
        dgates: view_mut(&mut dg_c, gates),
        dc_prev: view_mut(&mut dcp_c, state),
    })
    .unwrap();
    let (act_same, cells_same) = (act_c_on(&gpu, &act_c), act_c_on(&gpu, &cells_c));
    gpu.lstm_backward_step(LstmBackwardStep {
        act: view(&act_same, gates),
        c_prev: view(&cells_same, slot(1)),
        c: view(&cells_same, slot(2)),
        dh: view(&dh_g, dh),
        dc: view(&dc_g, state),
        dgates: view_mut(&mut dg_g, gates),
        dc_prev: view_mut(&mut dcp_g, state),
    })
    .unwrap();
    assert!(
        max_abs_diff(&dg_c, &fetch(&gpu, &dg_g)) <= 4e-6,
        "lstm backward dgates"
    );
    assert!(
        max_abs_diff(&dcp_c, &fetch(&gpu, &dcp_g)) <= 4e-6,
        "lstm backward dc_prev"
    );
}

/// A CPU-side buffer copied to the GPU (so a backward step sees identical inputs).
fn act_c_on(gpu: &CudaBackend, act: &[f32]) -> ringtrain_cuda::GpuBuffer<f32> {
    let mut g = gpu.zeros(act.len()).unwrap();
    gpu.upload(act, &mut g, 0).unwrap();
    g
}

fn small_nmt(lstm: LstmImpl) -> NmtConfig {
    NmtConfig {
        src_vocab: 41,
        tgt_vocab: 48,
        emb: 16,
        hidden: 24,
        layers: 2,
        encoder: EncoderKind::Bi,
        lstm,
        source_lengths: SourceLengths::Off,
        bi_layer_input: BiLayerInput::Own,
        init_scale: 0.3,
        forget_bias: 1.0,
    }
}

fn small_lm(lstm: LstmImpl) -> LmConfig {
    LmConfig {
        vocab: 56,
        emb: 16,
        hidden: 24,
        layers: 2,
        lstm,
        init_scale: 0.3,
        forget_bias: 1.0,
    }
}

/// The launches of a training pass's softmax on the CUDA backend beyond the CPU's: the CPU
/// takes its forward and backward in one kernel, the CUDA backend in two launches.
const CUDA_SOFTMAX_LAUNCHES_BEYOND_CPU: u64 = 1;

/// Compares losses, launch counts and every gradient tensor of one training pass.
fn compare_pass(
    what: &str,
    cpu_stats: ringtrain_model::StepStats,
    gpu_stats: ringtrain_model::StepStats,
    layout: &ringtrain_model::ParamLayout,
    cpu_grads: &[f32],
    gpu_grads: &[f32],
) {
    let rel = (cpu_stats.loss_sum - gpu_stats.loss_sum).abs() / cpu_stats.loss_sum.abs().max(1e-12);
    assert!(
        rel <= 1e-5,
        "{what}: loss {} vs {} (relative {rel:e})",
        cpu_stats.loss_sum,
        gpu_stats.loss_sum
    );
    assert_eq!(cpu_stats.tokens, gpu_stats.tokens, "{what}: tokens");
    assert_eq!(
        cpu_stats.launches + CUDA_SOFTMAX_LAUNCHES_BEYOND_CPU,
        gpu_stats.launches,
        "{what}: launches per batch (the same operations; a training pass's softmax is one \
         CPU kernel and two CUDA launches)"
    );
    for e in layout.entries() {
        let (c, g) = (&cpu_grads[e.range()], &gpu_grads[e.range()]);
        let tol = (1e-4 * max_abs(c)).max(1e-6);
        let err = max_abs_diff(c, g);
        assert!(
            err <= tol,
            "{what}: gradient {} differs by {err:e} (tolerance {tol:e})",
            e.name
        );
    }
}

#[test]
fn nmt_loss_and_gradients_match_the_cpu() {
    for lstm in [LstmImpl::Fused, LstmImpl::Stepwise] {
        nmt_matches_the_cpu(small_nmt(lstm), (7, 6), "2 layers");
    }
}

/// A 4-layer bi encoder (2 per direction, so that `concat` matters) with the semantic
/// options `sl` and `input`; source length 3, so the toy batch of 5 pads its sentences to
/// lengths 3, 2, 1, 3, 2.
/// Narrower than [`small_nmt`]: the emulated driver's time grows with the threads launched.
fn with_semantics(lstm: LstmImpl, sl: SourceLengths, input: BiLayerInput) -> NmtConfig {
    NmtConfig {
        src_vocab: 19,
        tgt_vocab: 23,
        emb: 8,
        hidden: 8,
        layers: 4,
        source_lengths: sl,
        bi_layer_input: input,
        ..small_nmt(lstm)
    }
}

/// Every combination of source lengths and bi-layer input, fused.
#[test]
fn nmt_semantics_fused_match_the_cpu() {
    for sl in [SourceLengths::Off, SourceLengths::On] {
        for input in [BiLayerInput::Own, BiLayerInput::Concat] {
            let config = with_semantics(LstmImpl::Fused, sl, input);
            nmt_matches_the_cpu(config, (3, 2), "4 layers");
        }
    }
}

/// Source lengths on with concatenated bi-layer input, stepwise. The emulator runs the
/// stepwise launches slowly, so this is the one combination: off is the 2-layer case above,
/// the bi-layer input is built above the LSTM implementation (fused covers both), and the
/// CPU tests compare fused with stepwise for every combination.
#[test]
fn nmt_semantics_stepwise_match_the_cpu() {
    let config = with_semantics(LstmImpl::Stepwise, SourceLengths::On, BiLayerInput::Concat);
    nmt_matches_the_cpu(config, (3, 2), "4 layers");
}

fn nmt_matches_the_cpu(config: NmtConfig, (src_len, tgt_len): (usize, usize), note: &str) {
    let lstm = config.lstm;
    let what = format!(
        "nmt {lstm:?} {note}, source lengths {}, bi-layer input {}",
        config.source_lengths, config.bi_layer_input
    );
    let data = toy::NmtData::random(&config, 5, src_len, tgt_len, 11);
    let mut on_cpu = NmtModel::new(toy::cpu(1), config.clone(), 3).unwrap();
    let mut on_gpu = NmtModel::new(gpu(), config, 3).unwrap();
    let mut ranges = Vec::new();
    let cs = on_cpu
        .forward_backward(&data.view(), &mut |_, _| {})
        .unwrap();
    let gs = on_gpu
        .forward_backward(&data.view(), &mut |r, _| ranges.push(r))
        .unwrap();
    assert_eq!(ranges.first().map(|r| r.start), Some(0));
    assert_eq!(
        ranges.last().map(|r| r.end),
        Some(on_gpu.layout().total_len())
    );
    let gpu_grads = fetch(on_gpu.backend(), on_gpu.grads());
    compare_pass(&what, cs, gs, on_cpu.layout(), on_cpu.grads(), &gpu_grads);
}

#[test]
fn rnnlm_loss_and_gradients_match_the_cpu() {
    for lstm in [LstmImpl::Fused, LstmImpl::Stepwise] {
        let config = small_lm(lstm);
        let data = toy::LmData::random(&config, 6, 9, 12);
        let next = toy::LmData::random(&config, 6, 9, 13);
        let mut on_cpu = RnnLm::new(toy::cpu(1), config.clone(), 4).unwrap();
        let mut on_gpu = RnnLm::new(gpu(), config, 4).unwrap();
        on_cpu.forward_loss(&data.view()).unwrap();
        on_gpu.forward_loss(&data.view()).unwrap();
        // The second window starts from the state the first one carried, on both.
        let view = ringtrain_model::LmBatchView {
            first_in_epoch: false,
            ..next.view()
        };
        let cs = on_cpu.forward_backward(&view, &mut |_, _| {}).unwrap();
        let gs = on_gpu.forward_backward(&view, &mut |_, _| {}).unwrap();
        let gpu_grads = fetch(on_gpu.backend(), on_gpu.grads());
        compare_pass(
            &format!("rnnlm {lstm:?}"),
            cs,
            gs,
            on_cpu.layout(),
            on_cpu.grads(),
            &gpu_grads,
        );
    }
}

#[test]
fn sgd_steps_end_with_the_same_parameters() {
    let config = small_nmt(LstmImpl::Fused);
    let mut on_cpu = NmtModel::new(toy::cpu(1), config.clone(), 5).unwrap();
    let mut on_gpu = NmtModel::new(gpu(), config.clone(), 5).unwrap();
    let total = on_cpu.layout().total_len();
    let (mut params, mut grads) = (vec![0.0f32; total], vec![0.0f32; total]);
    let uploader = gpu();
    let lr = 0.5 / 30.0;
    for step in 0..5 {
        let data = toy::NmtData::random(&config, 5, 7, 6, 100 + step);
        on_cpu
            .forward_backward(&data.view(), &mut |_, _| {})
            .unwrap();
        let (p, g) = on_cpu.params_and_grads_mut();
        p.iter_mut().zip(g.iter()).for_each(|(p, g)| *p -= lr * g);
        on_gpu
            .forward_backward(&data.view(), &mut |_, _| {})
            .unwrap();
        on_gpu
            .backend()
            .download(on_gpu.grads(), 0, &mut grads)
            .unwrap();
        on_gpu
            .backend()
            .download(on_gpu.params(), 0, &mut params)
            .unwrap();
        params
            .iter_mut()
            .zip(&grads)
            .for_each(|(p, g)| *p -= lr * g);
        // a second handle on the same device (same context and stream) writes the
        // updated parameters back while the model is borrowed mutably
        uploader.upload(&params, on_gpu.params_mut(), 0).unwrap();
    }
    on_gpu
        .backend()
        .download(on_gpu.params(), 0, &mut params)
        .unwrap();
    let err = max_abs_diff(on_cpu.params(), &params);
    assert!(
        err <= 1e-4,
        "parameters after 5 SGD steps differ by {err:e}"
    );
}

#[test]
fn mixed_precision_gemms_keep_the_loss_close() {
    for precision in [GemmPrecision::Bf16, GemmPrecision::F16] {
        let config = small_nmt(LstmImpl::Fused);
        let data = toy::NmtData::random(&config, 8, 7, 6, 13);
        let mut f32_model = NmtModel::new(gpu(), config.clone(), 6).unwrap();
        let mut mixed = NmtModel::new(gpu_with(precision), config, 6).unwrap();
        let a = f32_model
            .forward_backward(&data.view(), &mut |_, _| {})
            .unwrap();
        let b = mixed
            .forward_backward(&data.view(), &mut |_, _| {})
            .unwrap();
        let rel = (a.loss_sum - b.loss_sum).abs() / a.loss_sum.abs();
        assert!(
            rel <= 2e-2,
            "{precision:?}: loss {} vs f32 {} ({rel:e})",
            b.loss_sum,
            a.loss_sum
        );
        assert!(b.loss_sum.is_finite());
        assert_eq!(a.launches, b.launches, "{precision:?}: launch count");
    }
}

#[test]
fn mixed_precision_gemm_of_two_transposed_operands() {
    // Strides that are multiples of 8, so the transposed copy feeds the tensor-core GEMM;
    // m <= n transposes A (then NT), m > n transposes B (then TN).
    let cpu = toy::cpu(1);
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    for precision in [GemmPrecision::Bf16, GemmPrecision::F16] {
        let gpu = gpu_with(precision);
        for (m, n, k) in [(24, 40, 32), (24, 16, 32)] {
            let (a, b) = (random(&mut rng, k * m, 1.0), random(&mut rng, n * k, 1.0));
            let (ac, ag) = both(&cpu, &gpu, &a);
            let (bc, bg) = both(&cpu, &gpu, &b);
            let (mut cc, mut cg) = (cpu.zeros(m * n).unwrap(), gpu.zeros(m * n).unwrap());
            let (la, lb, lc) = (
                Layout::matrix(0, k, m).t(),
                Layout::matrix(0, n, k).t(),
                Layout::matrix(0, m, n),
            );
            cpu.gemm(view(&ac, la), view(&bc, lb), view_mut(&mut cc, lc), false)
                .unwrap();
            gpu.gemm(view(&ag, la), view(&bg, lb), view_mut(&mut cg, lc), false)
                .unwrap();
            let err = max_abs_diff(&cc, &fetch(&gpu, &cg)) / max_abs(&cc);
            assert!(
                err <= 2e-2,
                "{precision:?} {m}x{n}x{k}: relative error {err:e}"
            );
        }
    }
}

/// `A·B` of host matrices on a new backend in `precision` (no cast of an earlier product
/// to reuse).
fn product_alone(
    precision: GemmPrecision,
    (a, la): (&[f32], Layout),
    (b, lb): (&[f32], Layout),
    lc: Layout,
) -> Vec<f32> {
    let gpu = gpu_with(precision);
    let (mut ag, mut bg) = (gpu.zeros(a.len()).unwrap(), gpu.zeros(b.len()).unwrap());
    gpu.upload(a, &mut ag, 0).unwrap();
    gpu.upload(b, &mut bg, 0).unwrap();
    let mut cg = gpu.zeros(lc.len()).unwrap();
    gpu.gemm(view(&ag, la), view(&bg, lb), view_mut(&mut cg, lc), false)
        .unwrap();
    fetch(&gpu, &cg)
}

#[test]
fn mixed_precision_products_reuse_a_cast_only_while_it_is_current() {
    // A product whose activation operand was cast for the product before it reads that
    // cast (one launch fewer), unless something wrote the operand since: another
    // operation, or the product before writing over it. Every result is bit for bit the
    // product computed alone.
    use ringtrain_cuda::KernelLaunches;
    let (m, k, n, j) = (16, 24, 32, 8);
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for precision in [GemmPrecision::Bf16, GemmPrecision::F16] {
        let gpu = gpu_with(precision);
        let x_host = random(&mut rng, m * k, 1.0);
        let mut x = gpu.zeros(m * k).unwrap();
        gpu.upload(&x_host, &mut x, 0).unwrap();
        // The pass's parameters: w [k, n], e [m, j], f [j, k], one after the other.
        let (w_at, e_at, f_at) = (0, k * n, k * n + m * j);
        let params_host = random(&mut rng, f_at + j * k, 1.0);
        let mut params = gpu.zeros(params_host.len()).unwrap();
        gpu.upload(&params_host, &mut params, 0).unwrap();
        let (lx, lw, lc) = (
            Layout::matrix(0, m, k),
            Layout::matrix(w_at, k, n),
            Layout::matrix(0, m, n),
        );
        let mut c = gpu.zeros(m * n).unwrap();
        let mut x_times_w = |x: &ringtrain_cuda::GpuBuffer<f32>, what: &str| {
            let before = KernelLaunches::this_thread();
            gpu.gemm(view(x, lx), view(&params, lw), view_mut(&mut c, lc), false)
                .unwrap();
            let launches = KernelLaunches::this_thread() - before;
            let want = product_alone(
                precision,
                (&fetch(&gpu, x), lx),
                (&params_host[w_at..w_at + k * n], Layout::matrix(0, k, n)),
                lc,
            );
            assert_bits_equal(&format!("{precision:?}: {what}"), &want, &fetch(&gpu, &c));
            launches
        };
        gpu.begin_pass(&params);
        let first = x_times_w(&x, "x·w");
        let again = x_times_w(&x, "x·w again");
        assert_eq!(
            first - again,
            2,
            "{precision:?}: the second product casts neither x (held) nor w (this pass's)"
        );
        // x written by a product (x = e·f): its cast is out of date.
        let (le, lf) = (Layout::matrix(e_at, m, j), Layout::matrix(f_at, j, k));
        gpu.gemm(
            view(&params, le),
            view(&params, lf),
            view_mut(&mut x, lx),
            false,
        )
        .unwrap();
        let after_product = x_times_w(&x, "x·w after x = e·f");
        assert_eq!(after_product - again, 1, "{precision:?}: x cast again");
        // x written by another operation.
        gpu.fill(view_mut(&mut x, Layout::contiguous(0, m * k)), 0.25)
            .unwrap();
        let after_fill = x_times_w(&x, "x·w after a fill");
        assert_eq!(after_fill - again, 1, "{precision:?}: x cast again");
        gpu.end_pass();
    }
}

#[test]
fn mixed_precision_recasts_the_weights_when_they_change_between_passes() {
    // 16-bit copies of the weights are made once per pass: a pass after new weights were
    // uploaded must use the new ones, exactly as a model created with them does.
    for precision in [GemmPrecision::Bf16, GemmPrecision::F16] {
        let config = small_nmt(LstmImpl::Fused);
        let data = toy::NmtData::random(&config, 8, 7, 6, 21);
        let mut model = NmtModel::new(gpu_with(precision), config.clone(), 6).unwrap();
        let before = model
            .forward_backward(&data.view(), &mut |_, _| {})
            .unwrap();
        model.init_params(9).unwrap();
        let after = model
            .forward_backward(&data.view(), &mut |_, _| {})
            .unwrap();
        let mut fresh = NmtModel::new(gpu_with(precision), config, 9).unwrap();
        let want = fresh
            .forward_backward(&data.view(), &mut |_, _| {})
            .unwrap();
        assert_ne!(
            before.loss_sum, after.loss_sum,
            "{precision:?}: new weights, same loss"
        );
        assert_eq!(
            after.loss_sum.to_bits(),
            want.loss_sum.to_bits(),
            "{precision:?}: stale 16-bit weights after the update ({} vs {})",
            after.loss_sum,
            want.loss_sum
        );
        assert_bits_equal(
            &format!("{precision:?} gradients after the update"),
            &fetch(fresh.backend(), fresh.grads()),
            &fetch(model.backend(), model.grads()),
        );
    }
}

#[test]
fn a_missing_device_is_an_error_that_names_it() {
    let err = CudaBackend::new(4096)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("4096"), "{err}");
}
