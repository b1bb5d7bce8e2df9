//! Every PTX kernel against its CPU twin in ringtrain-kernels (GEMM against a
//! plain f64 matmul). Needs the `cuda` feature and a GPU (device 0); built by
//! `scripts/build-gpu-bundle` and run by `scripts/gpu-check`.
//!
//! Each test draws fresh random inputs (seeded, so failures reproduce) for
//! several shapes, including sizes that are not multiples of the block, tile
//! or 16-byte vector width and views that start at unaligned element offsets.
//! Outputs are poisoned with NaN (all-ones bytes) before each launch, so an
//! element the kernel forgets to write fails the comparison.
#![cfg(feature = "cuda")]

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_cuda::model_ops::RowIds;
use ringtrain_cuda::{
    fp16, gemm, lstm, model_ops, optim, softmax, AsDevSlice, DeviceLossScale, DeviceMemoryUse,
    Error, Gpu, GpuBuffer, GpuTimer, KernelArg, KernelLaunches, LaunchConfig, LossScaleState,
    NonFiniteFlag, TransferBytes, Transpose,
};
use ringtrain_kernels as cpu;

const POISON: u8 = 0xFF; // all-ones bytes: NaN in f32, f16 and bf16

fn gpu() -> Gpu {
    match Gpu::new(0) {
        Ok(gpu) => gpu,
        Err(e) => panic!("these tests need a CUDA device 0: {e}"),
    }
}

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn uniform(rng: &mut ChaCha8Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(lo..hi)).collect()
}

fn poisoned<T: ringtrain_cuda::Element>(gpu: &Gpu, n: usize) -> GpuBuffer<T> {
    let mut buf = gpu.alloc::<T>(n).unwrap();
    buf.fill_bytes(POISON).unwrap();
    buf
}

/// Asserts |got - want| <= abs + rel * |want| elementwise (NaN never passes).
fn assert_close(what: &str, got: &[f32], want: &[f32], abs: f32, rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        let bound = abs + rel * w.abs();
        assert!(
            err <= bound,
            "{what}[{i}]: gpu {g} vs cpu {w} (|diff| {err} > bound {bound})"
        );
    }
}

fn assert_bits_eq<T: bytemuck::Pod + std::fmt::Debug>(
    what: &str,
    got: &[T],
    want: &[T],
    is_nan: impl Fn(&T) -> bool,
) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let same = bytemuck::bytes_of(g) == bytemuck::bytes_of(w) || (is_nan(g) && is_nan(w));
        assert!(
            same,
            "{what}[{i}]: gpu {g:?} vs cpu {w:?} (bit-exact expected)"
        );
    }
}

// ---------------------------------------------------------------- LSTM

const LSTM_SHAPES: &[(usize, usize)] = &[(1, 1), (3, 5), (7, 33), (2, 257), (64, 512), (5, 1000)];
// Activations use ex2.approx: 1e-6 absolute plus 1e-6 relative.
const LSTM_ABS: f32 = 2e-6;
const LSTM_REL: f32 = 2e-6;

#[test]
fn lstm_pointwise_forward_matches_cpu() {
    let gpu = gpu();
    let mut rng = rng(1);
    for &(batch, hidden) in LSTM_SHAPES {
        let gates = uniform(&mut rng, batch * 4 * hidden, -6.0, 6.0);
        let bias = uniform(&mut rng, 4 * hidden, -1.0, 1.0);
        let c_prev = uniform(&mut rng, batch * hidden, -3.0, 3.0);
        let (mut c, mut h, mut act) = (
            vec![0.0; batch * hidden],
            vec![0.0; batch * hidden],
            vec![0.0; batch * 4 * hidden],
        );
        cpu::lstm_pointwise_forward(
            &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
        )
        .unwrap();
        let (dg, db, dcp) = (
            gpu.upload(&gates).unwrap(),
            gpu.upload(&bias).unwrap(),
            gpu.upload(&c_prev).unwrap(),
        );
        let mut gc = poisoned::<f32>(&gpu, batch * hidden);
        let mut gh = poisoned::<f32>(&gpu, batch * hidden);
        let mut gact = poisoned::<f32>(&gpu, batch * 4 * hidden);
        lstm::lstm_pointwise_forward(
            &gpu, &dg, &db, &dcp, &mut gc, &mut gh, &mut gact, batch, hidden,
        )
        .unwrap();
        let tag = format!("forward {batch}x{hidden}");
        assert_close(
            &format!("{tag} c"),
            &gc.to_host().unwrap(),
            &c,
            LSTM_ABS,
            LSTM_REL,
        );
        assert_close(
            &format!("{tag} h"),
            &gh.to_host().unwrap(),
            &h,
            LSTM_ABS,
            LSTM_REL,
        );
        assert_close(
            &format!("{tag} act"),
            &gact.to_host().unwrap(),
            &act,
            LSTM_ABS,
            LSTM_REL,
        );
    }
}

#[test]
fn lstm_pointwise_forward_step_matches_cpu_at_every_step() {
    let gpu = gpu();
    let mut rng = rng(2);
    let steps = 3;
    for &(batch, hidden) in LSTM_SHAPES {
        let g = batch * 4 * hidden;
        let proj = uniform(&mut rng, steps * g, -4.0, 4.0);
        let rec = uniform(&mut rng, g, -2.0, 2.0);
        let bias = uniform(&mut rng, 4 * hidden, -1.0, 1.0);
        let c_prev = uniform(&mut rng, batch * hidden, -3.0, 3.0);
        let (dp, dr, db, dcp) = (
            gpu.upload(&proj).unwrap(),
            gpu.upload(&rec).unwrap(),
            gpu.upload(&bias).unwrap(),
            gpu.upload(&c_prev).unwrap(),
        );
        for step in 0..steps {
            let (mut c, mut h, mut act) = (
                vec![0.0; batch * hidden],
                vec![0.0; batch * hidden],
                vec![0.0; g],
            );
            cpu::lstm_pointwise_forward_step(
                &proj, &rec, &bias, &c_prev, &mut c, &mut h, &mut act, step, steps, batch, hidden,
            )
            .unwrap();
            let mut gc = poisoned::<f32>(&gpu, batch * hidden);
            let mut gh = poisoned::<f32>(&gpu, batch * hidden);
            let mut gact = poisoned::<f32>(&gpu, g);
            lstm::lstm_pointwise_forward_step(
                &gpu, &dp, &dr, &db, &dcp, &mut gc, &mut gh, &mut gact, step, steps, batch, hidden,
            )
            .unwrap();
            let tag = format!("step {step} {batch}x{hidden}");
            assert_close(
                &format!("{tag} c"),
                &gc.to_host().unwrap(),
                &c,
                LSTM_ABS,
                LSTM_REL,
            );
            assert_close(
                &format!("{tag} h"),
                &gh.to_host().unwrap(),
                &h,
                LSTM_ABS,
                LSTM_REL,
            );
            assert_close(
                &format!("{tag} act"),
                &gact.to_host().unwrap(),
                &act,
                LSTM_ABS,
                LSTM_REL,
            );
        }
        let err = lstm::lstm_pointwise_forward_step(
            &gpu,
            &dp,
            &dr,
            &db,
            &dcp,
            &mut poisoned::<f32>(&gpu, batch * hidden),
            &mut poisoned::<f32>(&gpu, batch * hidden),
            &mut poisoned::<f32>(&gpu, g),
            steps,
            steps,
            batch,
            hidden,
        )
        .unwrap_err();
        assert!(err.to_string().contains("step"), "{err}");
    }
}

#[test]
fn lstm_pointwise_backward_matches_cpu() {
    let gpu = gpu();
    let mut rng = rng(3);
    for &(batch, hidden) in LSTM_SHAPES {
        let (cells, g) = (batch * hidden, batch * 4 * hidden);
        // Realistic saved activations: run the CPU forward first.
        let gates = uniform(&mut rng, g, -4.0, 4.0);
        let bias = uniform(&mut rng, 4 * hidden, -1.0, 1.0);
        let c_prev = uniform(&mut rng, cells, -2.0, 2.0);
        let (mut c, mut h, mut act) = (vec![0.0; cells], vec![0.0; cells], vec![0.0; g]);
        cpu::lstm_pointwise_forward(
            &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
        )
        .unwrap();
        let dh = uniform(&mut rng, cells, -1.0, 1.0);
        let dc = uniform(&mut rng, cells, -1.0, 1.0);
        let (mut dgates, mut dc_prev) = (vec![0.0; g], vec![0.0; cells]);
        cpu::lstm_pointwise_backward(
            &act,
            &c_prev,
            &c,
            &dh,
            &dc,
            &mut dgates,
            &mut dc_prev,
            batch,
            hidden,
        )
        .unwrap();
        let up = |v: &[f32]| gpu.upload(v).unwrap();
        let (da, dcp, dcc, ddh, ddc) = (up(&act), up(&c_prev), up(&c), up(&dh), up(&dc));
        let mut gdg = poisoned::<f32>(&gpu, g);
        let mut gdcp = poisoned::<f32>(&gpu, cells);
        lstm::lstm_pointwise_backward(
            &gpu, &da, &dcp, &dcc, &ddh, &ddc, &mut gdg, &mut gdcp, batch, hidden,
        )
        .unwrap();
        let tag = format!("backward {batch}x{hidden}");
        assert_close(
            &format!("{tag} dgates"),
            &gdg.to_host().unwrap(),
            &dgates,
            LSTM_ABS,
            1e-5,
        );
        assert_close(
            &format!("{tag} dc_prev"),
            &gdcp.to_host().unwrap(),
            &dc_prev,
            LSTM_ABS,
            1e-5,
        );
    }
}

#[test]
fn lstm_launchers_reject_wrong_lengths() {
    let gpu = gpu();
    let (batch, hidden) = (4, 8);
    let gates = gpu.zeros::<f32>(batch * 4 * hidden - 1).unwrap();
    let bias = gpu.zeros::<f32>(4 * hidden).unwrap();
    let c_prev = gpu.zeros::<f32>(batch * hidden).unwrap();
    let (mut c, mut h) = (
        gpu.zeros::<f32>(batch * hidden).unwrap(),
        gpu.zeros::<f32>(batch * hidden).unwrap(),
    );
    let mut act = gpu.zeros::<f32>(batch * 4 * hidden).unwrap();
    let err = lstm::lstm_pointwise_forward(
        &gpu, &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::ShapeMismatch {
                arg: "gates",
                expected: 128,
                actual: 127
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------- softmax

const SOFTMAX_SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (3, 7),
    (5, 31),
    (17, 1000),
    (9, 1024), // largest warp-per-row vocab
    (4, 1025), // smallest block-per-row vocab
    (3, 5003),
    (6, 10001),
    (3, 50000),
];

struct SoftmaxCase {
    logits: Vec<f32>,
    labels: Vec<u32>,
    mask: Vec<f32>,
}

fn softmax_case(rng: &mut ChaCha8Rng, rows: usize, vocab: usize) -> SoftmaxCase {
    let logits = uniform(rng, rows * vocab, -12.0, 12.0);
    let labels = (0..rows).map(|_| rng.gen_range(0..vocab as u32)).collect();
    // Mostly real tokens, some padding, some fractional weights.
    let mask = (0..rows)
        .map(|r| match r % 5 {
            3 => 0.0,
            4 => 0.5,
            _ => 1.0,
        })
        .collect();
    SoftmaxCase {
        logits,
        labels,
        mask,
    }
}

#[test]
fn softmax_xent_forward_matches_cpu_for_warp_and_block_rows() {
    let gpu = gpu();
    let mut rng = rng(4);
    for &(rows, vocab) in SOFTMAX_SHAPES {
        let case = softmax_case(&mut rng, rows, vocab);
        let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        cpu::softmax_xent_forward(
            &case.logits,
            &case.labels,
            &case.mask,
            &mut loss,
            &mut lse,
            rows,
            vocab,
        )
        .unwrap();
        // Offset 0 and a view starting one element in (unaligned rows).
        for offset in [0usize, 1] {
            let mut padded = vec![0.0f32; offset];
            padded.extend_from_slice(&case.logits);
            let dlog = gpu.upload(&padded).unwrap();
            let view = dlog.slice(offset..offset + rows * vocab).unwrap();
            let (dl, dm) = (
                gpu.upload(&case.labels).unwrap(),
                gpu.upload(&case.mask).unwrap(),
            );
            let mut gloss = poisoned::<f32>(&gpu, rows);
            let mut glse = poisoned::<f32>(&gpu, rows);
            softmax::softmax_xent_forward(
                &gpu, &view, &dl, &dm, &mut gloss, &mut glse, rows, vocab,
            )
            .unwrap();
            let glse = glse.to_host().unwrap();
            let tag = format!("{rows}x{vocab} offset {offset}");
            let lse_abs: Vec<f32> = lse.iter().map(|l| 2e-6 * l.abs().max(1.0) + 1e-6).collect();
            for (i, ((g, w), b)) in glse.iter().zip(&lse).zip(&lse_abs).enumerate() {
                assert!((g - w).abs() <= *b, "{tag} lse[{i}]: gpu {g} vs cpu {w}");
            }
            for (i, (g, w)) in gloss.to_host().unwrap().iter().zip(&loss).enumerate() {
                let bound = lse_abs[i] + 2e-6 * w.abs();
                assert!(
                    (g - w).abs() <= bound,
                    "{tag} loss[{i}]: gpu {g} vs cpu {w}"
                );
                if case.mask[i] == 0.0 {
                    assert_eq!(*g, 0.0, "{tag}: masked row {i} must have loss 0");
                }
            }
        }
    }
}

#[test]
fn softmax_forward_marks_out_of_range_labels_with_nan_only_when_unmasked() {
    let gpu = gpu();
    for vocab in [100usize, 3000] {
        let rows = 3;
        let logits = gpu.upload(&vec![0.5f32; rows * vocab]).unwrap();
        let labels = gpu.upload(&[vocab as u32, vocab as u32 + 7, 1]).unwrap();
        let mask = gpu.upload(&[1.0f32, 0.0, 1.0]).unwrap();
        let (mut loss, mut lse) = (poisoned::<f32>(&gpu, rows), poisoned::<f32>(&gpu, rows));
        softmax::softmax_xent_forward(
            &gpu, &logits, &labels, &mask, &mut loss, &mut lse, rows, vocab,
        )
        .unwrap();
        let loss = loss.to_host().unwrap();
        assert!(
            loss[0].is_nan(),
            "vocab {vocab}: unmasked bad label gives NaN, got {}",
            loss[0]
        );
        assert_eq!(loss[1], 0.0, "vocab {vocab}: masked bad label gives 0");
        let want = (vocab as f32).ln(); // all logits equal: loss = log(vocab)
        assert!(
            (loss[2] - want).abs() < 1e-5 * want.max(1.0),
            "vocab {vocab}: {} vs {want}",
            loss[2]
        );
    }
}

#[test]
fn softmax_xent_backward_matches_cpu() {
    let gpu = gpu();
    let mut rng = rng(5);
    for &(rows, vocab) in SOFTMAX_SHAPES {
        let case = softmax_case(&mut rng, rows, vocab);
        let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
        cpu::softmax_xent_forward(
            &case.logits,
            &case.labels,
            &case.mask,
            &mut loss,
            &mut lse,
            rows,
            vocab,
        )
        .unwrap();
        let scale = 1.0 / 37.0;
        let mut grad = case.logits.clone();
        cpu::softmax_xent_backward(
            &mut grad,
            &lse,
            &case.labels,
            &case.mask,
            scale,
            rows,
            vocab,
        )
        .unwrap();
        for offset in [0usize, 3] {
            let mut padded = vec![7.0f32; offset];
            padded.extend_from_slice(&case.logits);
            let mut dlog = gpu.upload(&padded).unwrap();
            let (dlse, dl, dm) = (
                gpu.upload(&lse).unwrap(),
                gpu.upload(&case.labels).unwrap(),
                gpu.upload(&case.mask).unwrap(),
            );
            let mut view = dlog.slice_mut(offset..offset + rows * vocab).unwrap();
            softmax::softmax_xent_backward(&gpu, &mut view, &dlse, &dl, &dm, scale, rows, vocab)
                .unwrap();
            let got = dlog.to_host().unwrap();
            assert!(
                got[..offset].iter().all(|&x| x == 7.0),
                "backward wrote before its view"
            );
            // |p_gpu - p_cpu| <= 2e-6 p + 1e-7, times |scale * mask|.
            for (i, (g, w)) in got[offset..].iter().zip(&grad).enumerate() {
                let k = (scale * case.mask[i / vocab]).abs();
                let bound = 4e-6 * w.abs() + 2e-7 * k + 1e-12;
                assert!(
                    (g - w).abs() <= bound,
                    "{rows}x{vocab} offset {offset} grad[{i}]: gpu {g} vs cpu {w}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------- fp16 / bf16

const CAST_LENGTHS: &[usize] = &[1, 7, 8, 9, 31, 1000, 4099, 100_003];
const OFFSETS: &[(usize, usize)] = &[(0, 0), (1, 0), (0, 3), (3, 3), (4, 4), (8, 0), (5, 1)];

/// Values spanning f16's range: tiny (subnormal after the cast), normal, large.
fn wide_values(rng: &mut ChaCha8Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let mag = 2f32.powf(rng.gen_range(-30.0..15.0));
            if rng.gen_bool(0.5) {
                mag
            } else {
                -mag
            }
        })
        .collect()
}

fn f16_is_nan(x: &f16) -> bool {
    x.is_nan()
}
fn bf16_is_nan(x: &bf16) -> bool {
    x.is_nan()
}
fn f32_is_nan(x: &f32) -> bool {
    x.is_nan()
}

#[test]
fn f32_to_f16_and_bf16_scaled_are_bit_exact_and_flag_overflow() {
    let gpu = gpu();
    let mut rng = rng(6);
    for &n in CAST_LENGTHS {
        for &(os, od) in OFFSETS {
            let src = wide_values(&mut rng, n);
            let scale = 4.0;
            let mut want16 = vec![f16::ZERO; n];
            let over16 = cpu::f32_to_f16_scaled(&src, scale, &mut want16).unwrap();
            let mut want_b = vec![bf16::ZERO; n];
            let over_b = cpu::f32_to_bf16_scaled(&src, scale, &mut want_b).unwrap();

            let mut padded = vec![0.0f32; os];
            padded.extend_from_slice(&src);
            let dsrc = gpu.upload(&padded).unwrap();
            let sview = dsrc.slice(os..os + n).unwrap();
            let mut d16 = poisoned::<f16>(&gpu, od + n);
            let mut db = poisoned::<bf16>(&gpu, od + n);
            let mut flag16 = NonFiniteFlag::new(&gpu).unwrap();
            let mut flag_b = NonFiniteFlag::new(&gpu).unwrap();
            fp16::f32_to_f16_scaled(
                &gpu,
                &sview,
                scale,
                &mut d16.slice_mut(od..od + n).unwrap(),
                &mut flag16,
            )
            .unwrap();
            fp16::f32_to_bf16_scaled(
                &gpu,
                &sview,
                scale,
                &mut db.slice_mut(od..od + n).unwrap(),
                &mut flag_b,
            )
            .unwrap();
            let tag = format!("n {n} offsets {os},{od}");
            assert_bits_eq(
                &format!("{tag} f16"),
                &d16.to_host().unwrap()[od..],
                &want16,
                f16_is_nan,
            );
            assert_bits_eq(
                &format!("{tag} bf16"),
                &db.to_host().unwrap()[od..],
                &want_b,
                bf16_is_nan,
            );
            assert_eq!(flag16.is_set().unwrap(), over16, "{tag}: f16 overflow flag");
            assert_eq!(flag_b.is_set().unwrap(), over_b, "{tag}: bf16 flag");
        }
    }
}

/// The casts read the loss scale where it lies on the device (bit-exact with the CPU
/// casts at factor x scale and factor / scale), `loss_scale_update` halves it on an
/// overflow and doubles it after the growth interval, and every launcher call is one
/// counted launch that copies nothing.
#[test]
fn the_loss_scale_in_device_memory_scales_the_casts_and_follows_its_policy() {
    let gpu = gpu();
    let mut rng = rng(17);
    let n = 1003;
    let src: Vec<f32> = wide_values(&mut rng, n)
        .iter()
        .map(|x| x / 1024.0)
        .collect();
    let dsrc = gpu.upload(&src).unwrap();
    let start = LossScaleState {
        scale: 512.0,
        clean_steps: 0,
        growth_interval: 2,
        skipped_steps: (1 << 32) + 3,
    };
    let mut loss = DeviceLossScale::new(&gpu, start).unwrap();
    assert_eq!(loss.read().unwrap(), start);
    let cast = |loss: &DeviceLossScale, factor: f32| {
        let mut half = poisoned::<f16>(&gpu, n);
        let mut flag = NonFiniteFlag::new(&gpu).unwrap();
        let (launched, copied) = (KernelLaunches::this_thread(), TransferBytes::this_thread());
        fp16::f32_to_f16_loss_scaled(&gpu, &dsrc, factor, loss, &mut half, &mut flag).unwrap();
        let mut back = poisoned::<f32>(&gpu, n);
        fp16::f16_to_f32_loss_unscaled(&gpu, &half, 3.0, loss, &mut back).unwrap();
        assert_eq!(KernelLaunches::this_thread() - launched, 2);
        assert_eq!(
            TransferBytes::this_thread().since(copied),
            TransferBytes::default()
        );
        (
            half.to_host().unwrap(),
            back.to_host().unwrap(),
            flag.is_set().unwrap(),
        )
    };
    let check = |loss: &DeviceLossScale, scale: f32| {
        let (half, back, flagged) = cast(loss, 0.25);
        let mut want = vec![f16::ZERO; n];
        let over = cpu::f32_to_f16_scaled(&src, 0.25 * scale, &mut want).unwrap();
        assert_bits_eq(&format!("scale {scale}: cast"), &half, &want, f16_is_nan);
        assert_eq!(flagged, over, "scale {scale}: flag");
        let mut wide = vec![0.0f32; n];
        cpu::f16_to_f32_unscaled(&want, 3.0 / scale, &mut wide).unwrap();
        assert_bits_eq(&format!("scale {scale}: back"), &back, &wide, f32_is_nan);
    };
    check(&loss, 512.0);
    let mut expect = start;
    for overflow in [true, false, false, false, true] {
        let launched = KernelLaunches::this_thread();
        fp16::loss_scale_update(&gpu, &mut loss, overflow).unwrap();
        assert_eq!(KernelLaunches::this_thread() - launched, 1);
        if overflow {
            expect.scale = (expect.scale * 0.5).max(1.0);
            expect.clean_steps = 0;
            expect.skipped_steps += 1;
        } else {
            expect.clean_steps += 1;
            if expect.clean_steps >= expect.growth_interval {
                expect.scale *= 2.0;
                expect.clean_steps = 0;
            }
        }
        assert_eq!(loss.read().unwrap(), expect, "after overflow = {overflow}");
    }
    assert_eq!(expect.scale, 256.0);
    check(&loss, 256.0);
    let floor = LossScaleState {
        scale: 1.0,
        ..start
    };
    loss.write(floor).unwrap();
    fp16::loss_scale_update(&gpu, &mut loss, true).unwrap();
    assert_eq!(
        loss.read().unwrap().scale,
        1.0,
        "the scale stays at least 1"
    );
}

#[test]
fn non_finite_flag_fires_on_planted_inf_and_nan_anywhere() {
    let gpu = gpu();
    let n = 1003;
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        for pos in [0usize, 2, 5, 500, 999, 1002] {
            let mut src = vec![1.5f32; n];
            src[pos] = bad;
            let dsrc = gpu.upload(&src).unwrap();
            for offset in [0usize, 1] {
                let view = dsrc.slice(offset..n).unwrap();
                let expect = pos >= offset;
                let mut flag = NonFiniteFlag::new(&gpu).unwrap();
                fp16::has_non_finite_f32(&gpu, &view, &mut flag).unwrap();
                assert_eq!(
                    flag.is_set().unwrap(),
                    expect,
                    "has_non_finite {bad} at {pos}, view from {offset}"
                );
                let mut flag = NonFiniteFlag::new(&gpu).unwrap();
                let mut dst = poisoned::<f16>(&gpu, n - offset);
                fp16::f32_to_f16_scaled(&gpu, &view, 1.0, &mut dst, &mut flag).unwrap();
                assert_eq!(
                    flag.is_set().unwrap(),
                    expect,
                    "f32_to_f16 {bad} at {pos}, view from {offset}"
                );
                let mut flag = NonFiniteFlag::new(&gpu).unwrap();
                let mut dst = poisoned::<bf16>(&gpu, n - offset);
                fp16::f32_to_bf16_scaled(&gpu, &view, 1.0, &mut dst, &mut flag).unwrap();
                assert_eq!(
                    flag.is_set().unwrap(),
                    expect,
                    "f32_to_bf16 {bad} at {pos}, view from {offset}"
                );
            }
        }
    }
    // A clean tensor leaves the flag clear, and reset clears a set flag.
    let clean = gpu.upload(&vec![65504.0f32; 77]).unwrap();
    let mut flag = NonFiniteFlag::new(&gpu).unwrap();
    fp16::has_non_finite_f32(&gpu, &clean, &mut flag).unwrap();
    assert!(!flag.is_set().unwrap());
    let mut dst = poisoned::<f16>(&gpu, 77);
    fp16::f32_to_f16_scaled(&gpu, &clean, 2.0, &mut dst, &mut flag).unwrap();
    assert!(flag.is_set().unwrap(), "65504 * 2 overflows f16");
    flag.reset().unwrap();
    assert!(!flag.is_set().unwrap());
}

#[test]
fn f16_and_bf16_to_f32_unscaled_are_bit_exact() {
    let gpu = gpu();
    let mut rng = rng(7);
    for &n in CAST_LENGTHS {
        for &(os, od) in OFFSETS {
            let vals = wide_values(&mut rng, n);
            let h: Vec<f16> = vals.iter().map(|&v| f16::from_f32(v)).collect();
            let b: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
            let inv = 0.25;
            let (mut want_h, mut want_b) = (vec![0.0f32; n], vec![0.0f32; n]);
            cpu::f16_to_f32_unscaled(&h, inv, &mut want_h).unwrap();
            cpu::bf16_to_f32_unscaled(&b, inv, &mut want_b).unwrap();
            let mut hp = vec![f16::ZERO; os];
            hp.extend_from_slice(&h);
            let mut bp = vec![bf16::ZERO; os];
            bp.extend_from_slice(&b);
            let (dh, db) = (gpu.upload(&hp).unwrap(), gpu.upload(&bp).unwrap());
            let mut out_h = poisoned::<f32>(&gpu, od + n);
            let mut out_b = poisoned::<f32>(&gpu, od + n);
            fp16::f16_to_f32_unscaled(
                &gpu,
                &dh.slice(os..os + n).unwrap(),
                inv,
                &mut out_h.slice_mut(od..od + n).unwrap(),
            )
            .unwrap();
            fp16::bf16_to_f32_unscaled(
                &gpu,
                &db.slice(os..os + n).unwrap(),
                inv,
                &mut out_b.slice_mut(od..od + n).unwrap(),
            )
            .unwrap();
            let tag = format!("n {n} offsets {os},{od}");
            assert_bits_eq(
                &format!("{tag} f16->f32"),
                &out_h.to_host().unwrap()[od..],
                &want_h,
                f32_is_nan,
            );
            assert_bits_eq(
                &format!("{tag} bf16->f32"),
                &out_b.to_host().unwrap()[od..],
                &want_b,
                f32_is_nan,
            );
        }
    }
}

#[test]
fn sum_into_f16_and_bf16_are_bit_exact() {
    let gpu = gpu();
    let mut rng = rng(8);
    for &n in CAST_LENGTHS {
        for &(oa, os) in OFFSETS {
            let a = wide_values(&mut rng, n);
            let s = wide_values(&mut rng, n);
            let ah: Vec<f16> = a.iter().map(|&v| f16::from_f32(v)).collect();
            let sh: Vec<f16> = s.iter().map(|&v| f16::from_f32(v)).collect();
            let ab: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
            let sb: Vec<bf16> = s.iter().map(|&v| bf16::from_f32(v)).collect();
            let (mut want_h, mut want_b) = (ah.clone(), ab.clone());
            cpu::sum_into_f16(&mut want_h, &sh).unwrap();
            cpu::sum_into_bf16(&mut want_b, &sb).unwrap();

            let pad_h = |v: &[f16], o: usize| [vec![f16::ZERO; o], v.to_vec()].concat();
            let pad_b = |v: &[bf16], o: usize| [vec![bf16::ZERO; o], v.to_vec()].concat();
            let mut dah = gpu.upload(&pad_h(&ah, oa)).unwrap();
            let dsh = gpu.upload(&pad_h(&sh, os)).unwrap();
            let mut dab = gpu.upload(&pad_b(&ab, oa)).unwrap();
            let dsb = gpu.upload(&pad_b(&sb, os)).unwrap();
            fp16::sum_into_f16(
                &gpu,
                &mut dah.slice_mut(oa..oa + n).unwrap(),
                &dsh.slice(os..os + n).unwrap(),
            )
            .unwrap();
            fp16::sum_into_bf16(
                &gpu,
                &mut dab.slice_mut(oa..oa + n).unwrap(),
                &dsb.slice(os..os + n).unwrap(),
            )
            .unwrap();
            let tag = format!("n {n} offsets {oa},{os}");
            assert_bits_eq(
                &format!("{tag} f16 sum"),
                &dah.to_host().unwrap()[oa..],
                &want_h,
                f16_is_nan,
            );
            assert_bits_eq(
                &format!("{tag} bf16 sum"),
                &dab.to_host().unwrap()[oa..],
                &want_b,
                bf16_is_nan,
            );
        }
    }
}

// ---------------------------------------------------------------- optimizers

const OPTIM_LENGTHS: &[usize] = &[1, 255, 256, 257, 10_007];

#[test]
fn sgd_and_momentum_are_bit_exact_over_several_steps() {
    let gpu = gpu();
    let mut rng = rng(9);
    for &n in OPTIM_LENGTHS {
        for (nesterov, dampening, wd) in [(false, 0.0, 0.0), (false, 0.1, 1e-4), (true, 0.0, 1e-2)]
        {
            let mut p = uniform(&mut rng, n, -1.0, 1.0);
            let mut buf = vec![0.0f32; n];
            let mut p_sgd = p.clone();
            let mut dp = gpu.upload(&p).unwrap();
            let mut dp_sgd = gpu.upload(&p).unwrap();
            let mut dbuf = poisoned::<f32>(&gpu, n); // first step must not read it
            for step in 0..4 {
                let g = uniform(&mut rng, n, -1.0, 1.0);
                let dg = gpu.upload(&g).unwrap();
                let first = step == 0;
                cpu::sgd_momentum_step(
                    &mut p, &g, &mut buf, 0.05, 0.9, dampening, wd, nesterov, first,
                )
                .unwrap();
                optim::sgd_momentum_step(
                    &gpu, &mut dp, &dg, &mut dbuf, 0.05, 0.9, dampening, wd, nesterov, first,
                )
                .unwrap();
                cpu::sgd_step(&mut p_sgd, &g, 0.05, wd).unwrap();
                optim::sgd_step(&gpu, &mut dp_sgd, &dg, 0.05, wd).unwrap();
            }
            let tag = format!("n {n} nesterov {nesterov} dampening {dampening} wd {wd}");
            assert_bits_eq(
                &format!("{tag} momentum params"),
                &dp.to_host().unwrap(),
                &p,
                f32_is_nan,
            );
            assert_bits_eq(
                &format!("{tag} momentum buffer"),
                &dbuf.to_host().unwrap(),
                &buf,
                f32_is_nan,
            );
            assert_bits_eq(
                &format!("{tag} sgd params"),
                &dp_sgd.to_host().unwrap(),
                &p_sgd,
                f32_is_nan,
            );
        }
    }
}

#[test]
fn adam_and_adamw_match_cpu_over_several_steps() {
    let gpu = gpu();
    let mut rng = rng(10);
    for &n in OPTIM_LENGTHS {
        for (adamw, wd) in [(false, 0.0), (false, 1e-2), (true, 1e-2)] {
            let mut p = uniform(&mut rng, n, -1.0, 1.0);
            let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
            let mut dp = gpu.upload(&p).unwrap();
            let (mut dm, mut dv) = (gpu.zeros::<f32>(n).unwrap(), gpu.zeros::<f32>(n).unwrap());
            for step in 1..=5u32 {
                let g = uniform(&mut rng, n, -1.0, 1.0);
                let dg = gpu.upload(&g).unwrap();
                if adamw {
                    cpu::adamw_step(&mut p, &g, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, wd, step)
                        .unwrap();
                    optim::adamw_step(
                        &gpu, &mut dp, &dg, &mut dm, &mut dv, 1e-3, 0.9, 0.999, 1e-8, wd, step,
                    )
                    .unwrap();
                } else {
                    cpu::adam_step(&mut p, &g, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, wd, step)
                        .unwrap();
                    optim::adam_step(
                        &gpu, &mut dp, &dg, &mut dm, &mut dv, 1e-3, 0.9, 0.999, 1e-8, wd, step,
                    )
                    .unwrap();
                }
            }
            let tag = format!("n {n} adamw {adamw} wd {wd}");
            assert_close(
                &format!("{tag} params"),
                &dp.to_host().unwrap(),
                &p,
                1e-7,
                1e-6,
            );
            assert_close(&format!("{tag} m"), &dm.to_host().unwrap(), &m, 1e-9, 1e-6);
            assert_close(&format!("{tag} v"), &dv.to_host().unwrap(), &v, 1e-12, 1e-6);
        }
    }
    let mut dp = gpu.zeros::<f32>(4).unwrap();
    let dg = gpu.zeros::<f32>(4).unwrap();
    let (mut dm, mut dv) = (gpu.zeros::<f32>(4).unwrap(), gpu.zeros::<f32>(4).unwrap());
    let err = optim::adam_step(
        &gpu, &mut dp, &dg, &mut dm, &mut dv, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0,
    )
    .unwrap_err();
    assert!(err.to_string().contains("step"), "{err}");
}

#[test]
fn global_norm_clipping_matches_cpu() {
    let gpu = gpu();
    let mut rng = rng(11);
    let sizes = [1usize, 300, 70_001];
    for max_norm in [0.5f32, 1e6] {
        let mut host: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&n| uniform(&mut rng, n, -1.0, 1.0))
            .collect();
        let mut devs: Vec<GpuBuffer<f32>> = host.iter().map(|h| gpu.upload(h).unwrap()).collect();
        let want_sq: f64 = host.iter().map(|h| cpu::sum_of_squares(h)).sum();
        let mut refs: Vec<&mut [f32]> = host.iter_mut().map(|h| h.as_mut_slice()).collect();
        let total = cpu::clip_by_global_norm(&mut refs, max_norm);
        let mut norm_sq = gpu.zeros::<f64>(1).unwrap();
        let mut views: Vec<_> = devs.iter_mut().map(|d| d.as_mut_slice()).collect();
        optim::clip_by_global_norm(&gpu, &mut views, max_norm, &mut norm_sq).unwrap();
        let got_sq = norm_sq.to_host().unwrap()[0];
        assert!(
            (got_sq - want_sq).abs() <= 1e-12 * want_sq,
            "sum of squares {got_sq} vs {want_sq}"
        );
        assert!((got_sq.sqrt() - total).abs() <= 1e-9 * total);
        for (d, h) in devs.iter().zip(&host) {
            assert_close(
                &format!("clipped to {max_norm}"),
                &d.to_host().unwrap(),
                h,
                1e-7,
                1e-6,
            );
        }
    }
}

#[test]
fn scale_f32_is_bit_exact() {
    let gpu = gpu();
    let mut rng = rng(12);
    for &n in OPTIM_LENGTHS {
        let mut x = uniform(&mut rng, n, -3.0, 3.0);
        let mut d = gpu.upload(&x).unwrap();
        cpu::scale_f32(&mut x, 0.3);
        optim::scale_f32(&gpu, &mut d, 0.3).unwrap();
        assert_bits_eq("scale_f32", &d.to_host().unwrap(), &x, f32_is_nan);
    }
}

// ---------------------------------------------------------------- GEMM

/// C = alpha * op(A) op(B) + beta * C in f64 from stored row-major matrices.
fn matmul_f64(
    t: Transpose,
    a: &[f32],
    b: &[f32],
    c: &[f32],
    (m, n, k): (usize, usize, usize),
    (lda, ldb, ldc): (usize, usize, usize),
    (alpha, beta): (f32, f32),
) -> (Vec<f64>, Vec<f64>) {
    let mut out = vec![0.0f64; m * n];
    let mut mag = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            let (mut acc, mut abs) = (0.0f64, 0.0f64);
            for p in 0..k {
                let av = match t {
                    Transpose::TN => a[p * lda + i],
                    _ => a[i * lda + p],
                } as f64;
                let bv = match t {
                    Transpose::NT => b[j * ldb + p],
                    _ => b[p * ldb + j],
                } as f64;
                acc += av * bv;
                abs += (av * bv).abs();
            }
            let prev = if beta == 0.0 {
                0.0
            } else {
                beta as f64 * c[i * ldc + j] as f64
            };
            out[i * n + j] = alpha as f64 * acc + prev;
            mag[i * n + j] = (alpha as f64).abs() * abs + prev.abs();
        }
    }
    (out, mag)
}

/// Worst-case relative error (against the sum of |products|) of k products
/// accumulated in f32 plus the alpha/beta step: (k + 4) * 2^-23.
fn f32_bound(k: usize) -> f64 {
    (k + 4) as f64 * f64::from(f32::EPSILON)
}

const GEMM_SHAPES: &[(usize, usize, usize)] = &[
    (1, 1, 1),
    (17, 33, 9),
    (64, 64, 64),
    (130, 70, 100),
    (257, 129, 31),
    (5, 300, 260),
];

fn check_gemm(tag: &str, got: &[f32], ldc: usize, want: &[f64], mag: &[f64], n: usize, rel: f64) {
    for (idx, (w, s)) in want.iter().zip(mag).enumerate() {
        let (i, j) = (idx / n, idx % n);
        let g = got[i * ldc + j] as f64;
        let bound = rel * s + 1e-30;
        assert!(
            (g - w).abs() <= bound,
            "{tag} C[{i},{j}]: gpu {g} vs f64 {w} (bound {bound})"
        );
    }
}

#[test]
fn gemm_f32_matches_f64_matmul_for_all_transposes() {
    let gpu = gpu();
    let mut rng = rng(13);
    for t in [Transpose::NN, Transpose::NT, Transpose::TN] {
        for &(m, n, k) in GEMM_SHAPES {
            for (alpha, beta) in [(1.0f32, 0.0f32), (0.5, -1.5)] {
                let ((ar, ac), (br, bc)) = t.stored_shapes(m, n, k);
                let (lda, ldb, ldc) = (ac + 3, bc + 1, n + 2);
                let a = uniform(&mut rng, ar * lda, -1.0, 1.0);
                let b = uniform(&mut rng, br * ldb, -1.0, 1.0);
                let c0 = uniform(&mut rng, m * ldc, -1.0, 1.0);
                let (da, db) = (gpu.upload(&a).unwrap(), gpu.upload(&b).unwrap());
                let mut dc = if beta == 0.0 {
                    poisoned::<f32>(&gpu, m * ldc) // beta == 0 must not read C
                } else {
                    gpu.upload(&c0).unwrap()
                };
                gemm::gemm_f32(
                    &gpu, t, &da, &db, &mut dc, m, n, k, lda, ldb, ldc, alpha, beta,
                )
                .unwrap();
                let (want, mag) =
                    matmul_f64(t, &a, &b, &c0, (m, n, k), (lda, ldb, ldc), (alpha, beta));
                let tag = format!("f32 {t:?} {m}x{n}x{k} alpha {alpha} beta {beta}");
                check_gemm(
                    &tag,
                    &dc.to_host().unwrap(),
                    ldc,
                    &want,
                    &mag,
                    n,
                    f32_bound(k),
                );
            }
        }
    }
}

#[test]
fn gemm_f16_and_bf16_match_f64_matmul_for_all_transposes() {
    let gpu = gpu();
    let mut rng = rng(14);
    for t in [Transpose::NN, Transpose::NT, Transpose::TN] {
        for &(m, n, k) in GEMM_SHAPES {
            let ((ar, ac), (br, bc)) = t.stored_shapes(m, n, k);
            let (lda, ldb, ldc) = (ac.next_multiple_of(8) + 8, bc.next_multiple_of(8), n + 1);
            let a32 = uniform(&mut rng, ar * lda, -1.0, 1.0);
            let b32 = uniform(&mut rng, br * ldb, -1.0, 1.0);
            let c0 = uniform(&mut rng, m * ldc, -1.0, 1.0);
            for (alpha, beta) in [(1.0f32, 0.0f32), (2.0, 0.5)] {
                // f16: reference from the rounded inputs.
                let ah: Vec<f16> = a32.iter().map(|&x| f16::from_f32(x)).collect();
                let bh: Vec<f16> = b32.iter().map(|&x| f16::from_f32(x)).collect();
                let ar32: Vec<f32> = ah.iter().map(|x| x.to_f32()).collect();
                let br32: Vec<f32> = bh.iter().map(|x| x.to_f32()).collect();
                let (want, mag) = matmul_f64(
                    t,
                    &ar32,
                    &br32,
                    &c0,
                    (m, n, k),
                    (lda, ldb, ldc),
                    (alpha, beta),
                );
                let (da, db) = (gpu.upload(&ah).unwrap(), gpu.upload(&bh).unwrap());
                let mut dc = if beta == 0.0 {
                    poisoned::<f32>(&gpu, m * ldc)
                } else {
                    gpu.upload(&c0).unwrap()
                };
                gemm::gemm_f16(
                    &gpu, t, &da, &db, &mut dc, m, n, k, lda, ldb, ldc, alpha, beta,
                )
                .unwrap();
                let tag = format!("f16 {t:?} {m}x{n}x{k} alpha {alpha} beta {beta}");
                check_gemm(
                    &tag,
                    &dc.to_host().unwrap(),
                    ldc,
                    &want,
                    &mag,
                    n,
                    2.0 * f32_bound(k),
                );

                let ab: Vec<bf16> = a32.iter().map(|&x| bf16::from_f32(x)).collect();
                let bb: Vec<bf16> = b32.iter().map(|&x| bf16::from_f32(x)).collect();
                let ar32: Vec<f32> = ab.iter().map(|x| x.to_f32()).collect();
                let br32: Vec<f32> = bb.iter().map(|x| x.to_f32()).collect();
                let (want, mag) = matmul_f64(
                    t,
                    &ar32,
                    &br32,
                    &c0,
                    (m, n, k),
                    (lda, ldb, ldc),
                    (alpha, beta),
                );
                let (da, db) = (gpu.upload(&ab).unwrap(), gpu.upload(&bb).unwrap());
                let mut dc = if beta == 0.0 {
                    poisoned::<f32>(&gpu, m * ldc)
                } else {
                    gpu.upload(&c0).unwrap()
                };
                gemm::gemm_bf16(
                    &gpu, t, &da, &db, &mut dc, m, n, k, lda, ldb, ldc, alpha, beta,
                )
                .unwrap();
                let tag = format!("bf16 {t:?} {m}x{n}x{k} alpha {alpha} beta {beta}");
                check_gemm(
                    &tag,
                    &dc.to_host().unwrap(),
                    ldc,
                    &want,
                    &mag,
                    n,
                    2.0 * f32_bound(k),
                );
            }
        }
    }
}

#[test]
fn gemm_tensor_core_launcher_rejects_bad_leading_dims_and_alignment() {
    let gpu = gpu();
    let a = gpu.zeros::<f16>(64 * 64).unwrap();
    let b = gpu.zeros::<f16>(64 * 64).unwrap();
    let mut c = gpu.zeros::<f32>(64 * 64).unwrap();
    let err = gemm::gemm_f16(
        &gpu,
        Transpose::NN,
        &a,
        &b,
        &mut c,
        8,
        8,
        12,
        12,
        8,
        8,
        1.0,
        0.0,
    )
    .unwrap_err();
    assert!(err.to_string().contains("lda"), "{err}");
    let shifted = a.slice(1..64 * 64).unwrap();
    let err = gemm::gemm_f16(
        &gpu,
        Transpose::NN,
        &shifted,
        &b,
        &mut c,
        8,
        8,
        8,
        8,
        8,
        8,
        1.0,
        0.0,
    )
    .unwrap_err();
    assert!(matches!(err, Error::Misaligned { arg: "a", .. }), "{err}");
    let err = gemm::gemm_f32(
        &gpu,
        Transpose::NN,
        &gpu.zeros::<f32>(10).unwrap(),
        &gpu.zeros::<f32>(64).unwrap(),
        &mut c,
        4,
        4,
        4,
        4,
        4,
        4,
        1.0,
        0.0,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::TooShort {
                arg: "a",
                needed: 16,
                actual: 10
            }
        ),
        "{err}"
    );
}

// ---------------------------------------------------------------- model ops

const OP_LENGTHS: &[usize] = &[1, 255, 257, 10_007];

#[test]
fn model_elementwise_ops_are_bit_exact() {
    let gpu = gpu();
    let mut rng = rng(15);
    for &n in OP_LENGTHS {
        let a = uniform(&mut rng, n, -2.0, 2.0);
        let b = uniform(&mut rng, n, -2.0, 2.0);
        let (da, db) = (gpu.upload(&a).unwrap(), gpu.upload(&b).unwrap());
        let mut out = poisoned::<f32>(&gpu, n);
        model_ops::fill(&gpu, &mut out, 0.25).unwrap();
        assert!(
            out.to_host().unwrap().iter().all(|&x| x == 0.25),
            "fill n {n}"
        );
        model_ops::binary_add(&gpu, &da, &db, &mut out).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_bits_eq("binary_add", &out.to_host().unwrap(), &want, f32_is_nan);
        model_ops::binary_mul(&gpu, &da, &db, &mut out).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x * y).collect();
        assert_bits_eq("binary_mul", &out.to_host().unwrap(), &want, f32_is_nan);
        let mut acc = gpu.upload(&b).unwrap();
        model_ops::in_place_add(&gpu, &da, &mut acc).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| y + x).collect();
        assert_bits_eq("in_place_add", &acc.to_host().unwrap(), &want, f32_is_nan);
        let mut acc = gpu.upload(&b).unwrap();
        model_ops::in_place_mul_sigmoid_grad(&gpu, &da, &mut acc).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| y * (x * (1.0 - x))).collect();
        assert_bits_eq(
            "in_place_mul_sigmoid_grad",
            &acc.to_host().unwrap(),
            &want,
            f32_is_nan,
        );
        let mut acc = gpu.upload(&b).unwrap();
        model_ops::in_place_mul_tanh_grad(&gpu, &da, &mut acc).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| y * (1.0 - x * x)).collect();
        assert_bits_eq(
            "in_place_mul_tanh_grad",
            &acc.to_host().unwrap(),
            &want,
            f32_is_nan,
        );
        model_ops::unary_sigmoid(&gpu, &da, &mut out).unwrap();
        let want: Vec<f32> = a
            .iter()
            .map(|&x| (1.0 / (1.0 + (-f64::from(x)).exp())) as f32)
            .collect();
        assert_close("unary_sigmoid", &out.to_host().unwrap(), &want, 1e-6, 0.0);
        model_ops::unary_tanh(&gpu, &da, &mut out).unwrap();
        let want: Vec<f32> = a.iter().map(|&x| f64::from(x).tanh() as f32).collect();
        assert_close("unary_tanh", &out.to_host().unwrap(), &want, 1e-6, 0.0);
        let total = model_ops::sum(&gpu, &da).unwrap();
        let exact: f64 = a.iter().map(|&x| f64::from(x)).sum();
        let mag: f64 = a.iter().map(|&x| f64::from(x).abs()).sum();
        let bound = (2f64.powi(-24) + n as f64 * 2f64.powi(-52)) * mag;
        assert!(
            (total - exact).abs() <= bound,
            "sum n {n}: {total} vs {exact}"
        );
    }
}

#[test]
fn model_row_ops_are_bit_exact() {
    let gpu = gpu();
    let mut rng = rng(16);
    for &(rows, width, table_rows) in &[
        (1usize, 1usize, 1usize),
        (7, 33, 5),
        (100, 512, 37),
        (3, 1000, 2),
    ] {
        let table = uniform(&mut rng, table_rows * width, -1.0, 1.0);
        let ids: Vec<u32> = (0..rows)
            .map(|_| rng.gen_range(0..table_rows as u32))
            .collect();
        let dtable = gpu.upload(&table).unwrap();
        let mut dst = poisoned::<f32>(&gpu, rows * width);
        let staged = RowIds::stage(&gpu, &ids, table_rows, gpu.alloc(0).unwrap()).unwrap();
        model_ops::gather_rows(&gpu, &dtable, &staged, &mut dst, table_rows, width).unwrap();
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&id| table[id as usize * width..(id as usize + 1) * width].to_vec())
            .collect();
        assert_bits_eq("gather_rows", &dst.to_host().unwrap(), &want, f32_is_nan);

        let src = uniform(&mut rng, rows * width, -1.0, 1.0);
        let dsrc = gpu.upload(&src).unwrap();
        let mut dgrad = gpu.upload(&table).unwrap();
        model_ops::scatter_add_rows(&gpu, &dsrc, &staged, &mut dgrad, table_rows, width).unwrap();
        let mut want = table.clone();
        for (r, &id) in ids.iter().enumerate() {
            for c in 0..width {
                want[id as usize * width + c] += src[r * width + c];
            }
        }
        assert_bits_eq(
            "scatter_add_rows",
            &dgrad.to_host().unwrap(),
            &want,
            f32_is_nan,
        );

        for accumulate in [false, true] {
            let start = uniform(&mut rng, width, -1.0, 1.0);
            let mut dsums = if accumulate {
                gpu.upload(&start).unwrap()
            } else {
                poisoned::<f32>(&gpu, width)
            };
            model_ops::column_sums(&gpu, &dsrc, &mut dsums, rows, width, accumulate).unwrap();
            let want: Vec<f32> = (0..width)
                .map(|c| {
                    let mut acc = if accumulate { start[c] } else { 0.0 };
                    for r in 0..rows {
                        acc += src[r * width + c];
                    }
                    acc
                })
                .collect();
            assert_bits_eq("column_sums", &dsums.to_host().unwrap(), &want, f32_is_nan);
        }

        let bias = uniform(&mut rng, width, -1.0, 1.0);
        let dbias = gpu.upload(&bias).unwrap();
        let mut dout = gpu.upload(&src).unwrap();
        model_ops::add_row_bias(&gpu, &dbias, &mut dout, rows, width).unwrap();
        let want: Vec<f32> = src
            .iter()
            .enumerate()
            .map(|(i, x)| x + bias[i % width])
            .collect();
        assert_bits_eq("add_row_bias", &dout.to_host().unwrap(), &want, f32_is_nan);
    }
    // ids are checked when staged, and staged ids only index tables that hold their bound
    let err = RowIds::stage(&gpu, &[0, 4], 4, gpu.alloc(0).unwrap()).unwrap_err();
    assert!(err.to_string().contains("ids[1] = 4"), "{err}");
    let staged = RowIds::stage(&gpu, &[0, 4], 5, gpu.alloc(0).unwrap()).unwrap();
    let dtable = gpu.zeros::<f32>(8).unwrap();
    let mut dst = gpu.zeros::<f32>(4).unwrap();
    let err = model_ops::gather_rows(&gpu, &dtable, &staged, &mut dst, 4, 2).unwrap_err();
    assert!(err.to_string().contains("table_rows"), "{err}");
    // the storage is reused by the next staging when it is large enough
    let storage = staged.into_storage();
    let before = storage.device_ptr();
    let again = RowIds::stage(&gpu, &[1, 1, 0], 2, storage).unwrap();
    assert_eq!((again.rows(), again.segments()), (3, 2));
    assert_eq!(again.into_storage().device_ptr(), before);
}

#[test]
fn transpose_is_bit_exact() {
    let gpu = gpu();
    let mut rng = rng(17);
    for &(rows, cols, ld) in &[
        (1usize, 1usize, 1usize),
        (3, 5, 7),
        (64, 33, 40),
        (257, 3, 3),
    ] {
        let mut src = uniform(&mut rng, (rows - 1) * ld + cols, -1.0, 1.0);
        src[0] = f32::NAN;
        if src.len() > 2 {
            src[1] = -0.0;
            src[2] = f32::INFINITY;
        }
        let dsrc = gpu.upload(&src).unwrap();
        let mut dst = poisoned::<f32>(&gpu, rows * cols);
        model_ops::transpose(&gpu, &dsrc, &mut dst, rows, cols, ld).unwrap();
        let want: Vec<f32> = (0..cols)
            .flat_map(|c| (0..rows).map(move |r| (r, c)))
            .map(|(r, c)| src[r * ld + c])
            .collect();
        assert_bits_eq("transpose", &dst.to_host().unwrap(), &want, f32_is_nan);
    }
    let dsrc = gpu.zeros::<f32>(10).unwrap();
    let mut dst = gpu.zeros::<f32>(12).unwrap();
    assert!(
        model_ops::transpose(&gpu, &dsrc, &mut dst, 3, 4, 4).is_err(),
        "src too short"
    );
}

// ---------------------------------------------------------------- runtime

#[test]
fn each_module_is_loaded_once_per_context_and_gpus_are_shared_per_index() {
    let gpu = gpu();
    let again = Gpu::new(0).unwrap();
    let mut x = gpu.upload(&[1.0f32, 2.0, 3.0]).unwrap();
    optim::scale_f32(&gpu, &mut x, 2.0).unwrap();
    let loaded = gpu.loaded_modules();
    assert!(loaded >= 1);
    optim::scale_f32(&again, &mut x, 2.0).unwrap();
    optim::sgd_step(&again, &mut x, &gpu.zeros::<f32>(3).unwrap(), 0.1, 0.0).unwrap();
    assert_eq!(gpu.loaded_modules(), loaded, "same module loaded again");
    assert_eq!(
        again.loaded_modules(),
        loaded,
        "Gpu::new(0) must share the context and cache"
    );
    assert_eq!(x.to_host().unwrap(), vec![4.0, 8.0, 12.0]);
    assert!(Gpu::new(usize::MAX).is_err());
}

#[test]
fn launches_are_checked_against_the_declared_signature() {
    let gpu = gpu();
    let mut buf = gpu.upload(&[1.0f32; 4]).unwrap();
    let ptr = buf.as_mut_slice().device_ptr();
    let cfg = LaunchConfig::linear(1, 32);
    // SAFETY: the argument lists are rejected before anything is launched.
    let wrong_kind = unsafe {
        gpu.launch(
            &optim::MODULE,
            "scale_f32",
            cfg,
            &[KernelArg::Ptr(ptr), KernelArg::U32(2), KernelArg::U32(4)],
        )
    };
    assert!(
        matches!(wrong_kind, Err(Error::SignatureMismatch { .. })),
        "{wrong_kind:?}"
    );
    // SAFETY: as above.
    let too_few = unsafe { gpu.launch(&optim::MODULE, "scale_f32", cfg, &[KernelArg::Ptr(ptr)]) };
    assert!(
        matches!(too_few, Err(Error::SignatureMismatch { .. })),
        "{too_few:?}"
    );
    // SAFETY: as above.
    let unknown = unsafe { gpu.launch(&optim::MODULE, "no_such_kernel", cfg, &[]) };
    assert!(
        matches!(unknown, Err(Error::UnknownKernel { .. })),
        "{unknown:?}"
    );
    assert_eq!(buf.to_host().unwrap(), vec![1.0; 4], "nothing ran");
}

#[test]
fn timer_measures_queued_work_and_copies_round_trip() {
    let gpu = gpu();
    let n = 1 << 22;
    let src = gpu.upload(&vec![3.0f32; n]).unwrap();
    let mut dst = poisoned::<f32>(&gpu, n);
    let timer = GpuTimer::new(&gpu).unwrap();
    let ms = timer.median_ms(5, || gpu.copy(&src, &mut dst)).unwrap();
    assert!(ms > 0.0 && ms.is_finite(), "{ms}");
    assert!(dst.to_host().unwrap().iter().all(|&x| x == 3.0));
    assert_eq!(src.as_slice().len(), n);
    assert_eq!(src.dev_slice().device(), gpu.ordinal());
}

#[test]
fn views_copy_to_and_from_the_host_without_touching_neighbours() {
    let gpu = gpu();
    let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 7.0).collect();
    let mut buf = poisoned::<f32>(&gpu, host.len());
    // upload the middle, leaving the ends poisoned
    gpu.copy_from_host(&host[3..997], &mut buf.slice_mut(3..997).unwrap())
        .unwrap();
    let all = buf.to_host().unwrap();
    assert!(all[..3].iter().chain(&all[997..]).all(|x| x.is_nan()));
    assert_bits_eq("uploaded view", &all[3..997], &host[3..997], |x: &f32| {
        x.is_nan()
    });
    // download a part (as a gradient range is) into the middle of a host buffer
    let mut out = [-1.0f32; 20];
    gpu.copy_to_host(&buf.slice(500..510).unwrap(), &mut out[5..15])
        .unwrap();
    assert_bits_eq(
        "downloaded view",
        &out[5..15],
        &host[500..510],
        |x: &f32| x.is_nan(),
    );
    assert!(out[..5].iter().chain(&out[15..]).all(|&x| x == -1.0));
    // lengths must agree
    let mut short = [0.0f32; 3];
    assert!(matches!(
        gpu.copy_to_host(&buf.slice(0..4).unwrap(), &mut short),
        Err(Error::ShapeMismatch { .. })
    ));
}

#[test]
fn pinned_downloads_see_earlier_kernels_and_uploads_reach_later_ones() {
    let gpu = gpu();
    let n = 100_003;
    let host: Vec<f32> = (0..n).map(|i| (i % 977) as f32 - 400.0).collect();
    let mut dev = gpu.upload(&host).unwrap();
    // A kernel queued before the download: the download must see its result.
    optim::scale_f32(&gpu, &mut dev, 2.0).unwrap();
    let mut pinned = gpu.pinned::<f32>(n).unwrap();
    assert_eq!(pinned.settled().map(<[f32]>::len), Some(n));
    let cut = 40_000;
    pinned
        .download_async(cut..n, &dev.slice(cut..n).unwrap())
        .unwrap();
    pinned
        .download_async(0..cut, &dev.slice(0..cut).unwrap())
        .unwrap();
    assert_eq!(pinned.copies_in_flight(), 2);
    assert!(
        pinned.settled().is_none(),
        "no whole-buffer view while copies run"
    );
    while !pinned.is_ready(0..cut).unwrap() {
        std::thread::yield_now();
    }
    let doubled: Vec<f32> = host.iter().map(|x| x * 2.0).collect();
    assert_bits_eq(
        "first range",
        pinned.wait(0..cut).unwrap(),
        &doubled[..cut],
        f32_is_nan,
    );
    assert_bits_eq(
        "second range",
        pinned.wait(cut..n).unwrap(),
        &doubled[cut..],
        f32_is_nan,
    );
    assert_eq!(pinned.copies_in_flight(), 0);

    // Host edits, an upload on the compute stream, then a kernel that reads the upload.
    pinned.as_mut_slice().unwrap()[..cut].fill(1.5);
    let mut dst = poisoned::<f32>(&gpu, cut);
    pinned.upload_async(0..cut, &mut dst).unwrap();
    optim::scale_f32(&gpu, &mut dst, 4.0).unwrap();
    assert!(dst.to_host().unwrap().iter().all(|&x| x == 6.0));
    pinned.wait_all().unwrap();
    assert!(pinned.settled().is_some());

    // Bad ranges and lengths are errors, not copies.
    assert!(matches!(
        pinned.download_async(n - 1..n + 1, &dev.slice(0..2).unwrap()),
        Err(Error::InvalidValue { name: "range", .. })
    ));
    assert!(matches!(
        pinned.download_async(0..3, &dev.slice(0..4).unwrap()),
        Err(Error::ShapeMismatch { arg: "src", .. })
    ));
    assert_eq!(pinned.copies_in_flight(), 0);
}

#[test]
fn tall_column_sums_add_fixed_chunks_in_order() {
    let gpu = gpu();
    let mut r = rng(91);
    let chunk = model_ops::COLUMN_SUM_CHUNK_ROWS;
    for &(rows, cols, accumulate) in &[
        (chunk + 1, 7, false),
        (3 * chunk + 17, 300, true),
        (40, 5, true),
    ] {
        let src = uniform(&mut r, rows * cols, -2.0, 2.0);
        let dst0 = uniform(&mut r, cols, -1.0, 1.0);
        let d_src = gpu.upload(&src).unwrap();
        let mut d_dst = gpu.upload(&dst0).unwrap();
        let mut partials = poisoned::<f32>(&gpu, model_ops::column_sums_scratch_len(rows, cols));
        model_ops::column_sums_chunked(
            &gpu,
            &d_src,
            &mut d_dst,
            rows,
            cols,
            accumulate,
            &mut partials,
        )
        .unwrap();
        let got = d_dst.to_host().unwrap();
        // reference: f32 sums of each chunk in row order, then the chunks in order
        // (one chunk: the CPU's order exactly)
        let mut want = if accumulate {
            dst0.clone()
        } else {
            vec![0.0; cols]
        };
        if rows <= chunk {
            for row in src.chunks(cols) {
                want.iter_mut().zip(row).for_each(|(w, x)| *w += x);
            }
        } else {
            for block in src.chunks(chunk * cols) {
                let mut part = vec![0.0f32; cols];
                for row in block.chunks(cols) {
                    part.iter_mut().zip(row).for_each(|(p, x)| *p += x);
                }
                want.iter_mut().zip(&part).for_each(|(w, p)| *w += p);
            }
        }
        assert_bits_eq("column_sums_chunked", &got, &want, |x: &f32| x.is_nan());
    }
}

#[test]
fn transfer_counters_add_exactly_the_bytes_each_copy_moves() {
    let gpu = gpu();
    let before = TransferBytes::this_thread();
    let host: Vec<f32> = (0..1000).map(|i| i as f32).collect();
    let mut buf = gpu.upload(&host).unwrap(); // 4000 to the device
    buf.copy_from_host(&host).unwrap(); // 4000
    let halves: Vec<f16> = vec![f16::from_f32(1.5); 333];
    let mut hbuf = gpu.upload(&halves).unwrap(); // 666
    gpu.copy_from_host(&halves[..100], &mut hbuf.slice_mut(10..110).unwrap())
        .unwrap(); // 200
    let mut other = gpu.alloc::<f32>(1000).unwrap();
    gpu.copy(&buf, &mut other).unwrap(); // device to device: not counted
    assert_eq!(other.to_host().unwrap(), host); // 4000 to the host
    let mut back = vec![0f32; 250];
    gpu.copy_to_host(&buf.slice(500..750).unwrap(), &mut back)
        .unwrap(); // 1000
    buf.copy_to_host(&mut vec![0f32; 1000]).unwrap(); // 4000
    let mut pinned = gpu.pinned::<f32>(1000).unwrap();
    pinned
        .download_async(100..400, &buf.slice(0..300).unwrap())
        .unwrap(); // 1200
    pinned
        .upload_async(0..50, &mut other.slice_mut(950..1000).unwrap())
        .unwrap(); // 200
    pinned.wait_all().unwrap();
    let moved = TransferBytes::this_thread().since(before);
    assert_eq!(
        moved,
        TransferBytes {
            to_device: 4000 + 4000 + 666 + 200 + 200,
            to_host: 4000 + 1000 + 4000 + 1200,
        }
    );
    let process = TransferBytes::process();
    assert!(process.to_device >= moved.to_device && process.to_host >= moved.to_host);
}

#[test]
fn the_allocator_high_water_mark_follows_the_buffers_held() {
    let gpu = gpu();
    let start = DeviceMemoryUse::process();
    let a = gpu.alloc::<f32>(1 << 20).unwrap(); // 4 MiB
    let b = gpu.zeros::<f16>(1 << 20).unwrap(); // 2 MiB
    let both = DeviceMemoryUse::process();
    drop(a);
    let after = DeviceMemoryUse::process();
    drop(b);
    let end = DeviceMemoryUse::process();
    // Other tests run one at a time (--test-threads=1 in the GPU scripts): exact.
    assert_eq!(both.held, start.held + (6 << 20));
    assert!(both.peak >= start.held + (6 << 20));
    assert_eq!(after.held, start.held + (2 << 20));
    assert_eq!(end.held, start.held);
    assert!(end.peak >= both.peak);
}

#[test]
fn an_allocation_larger_than_the_device_is_out_of_memory_and_names_its_size() {
    let gpu = gpu();
    let (_, total) = gpu.memory_info().unwrap();
    let held = DeviceMemoryUse::process().held;
    // More f32 elements than the whole device holds: the driver refuses at once.
    let len = total / 4 + (1 << 20);
    let err = match gpu.alloc::<f32>(len) {
        Ok(_) => panic!(
            "allocating {} bytes on a {total}-byte device succeeded",
            len * 4
        ),
        Err(e) => e,
    };
    match &err {
        Error::OutOfMemory {
            bytes,
            held: held_then,
            total: reported,
            ..
        } => {
            assert_eq!(*bytes, len * 4);
            assert_eq!(*held_then, held);
            assert_eq!(*reported, total);
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.starts_with("out of device memory"), "{text}");
    assert!(text.contains("smaller batch size"), "{text}");
    // Nothing was counted as held, and the device still allocates.
    assert_eq!(DeviceMemoryUse::process().held, held);
    drop(gpu.alloc::<f32>(1024).unwrap());
}
