//! GPU throughput of the PTX kernels, each against its baseline measured in the
//! same run: device-to-device copy bandwidth for the memory-bound kernels
//! (softmax cross-entropy, f16/bf16 casts and sums, LSTM pointwise), and
//! TFLOP/s for the GEMMs (`scripts/gpu-check` adds `torch.matmul`'s figure on
//! the same device and prints the ratio).
//!
//! Timing: CUDA events around each launch on the stream, after warm-up runs;
//! the median of many runs is reported. Bandwidth counts the bytes a kernel
//! must read plus write once; the copy baseline moves the same number of bytes
//! (half read, half written). Every result is also printed as a tab-separated
//! `RESULT` line that `scripts/gpu-check` collects into its summary.
//!
//! Run: `gpu_throughput [--quick]` on a machine with a GPU (`--quick` uses
//! small sizes, to check that everything runs).

use half::{bf16, f16};
use ringtrain_cuda::{
    fp16, gemm, lstm, optim, softmax, Gpu, GpuBuffer, GpuTimer, NonFiniteFlag, Result, Transpose,
};

struct Bench {
    gpu: Gpu,
    timer: GpuTimer,
    warmup: usize,
    runs: usize,
}

impl Bench {
    fn time(&self, mut work: impl FnMut() -> Result<()>) -> Result<f64> {
        for _ in 0..self.warmup {
            work()?;
        }
        self.gpu.synchronize()?;
        Ok(f64::from(self.timer.median_ms(self.runs, work)?))
    }

    /// Median time of a device copy moving `bytes` in total (bytes/2 read, bytes/2 written).
    fn copy_ms(&self, bytes: usize) -> Result<f64> {
        let n = (bytes / 2).div_ceil(4).max(1);
        let src = self.gpu.zeros::<f32>(n)?;
        let mut dst = self.gpu.zeros::<f32>(n)?;
        self.time(|| self.gpu.copy(&src, &mut dst))
    }

    /// Prints one bandwidth line and its RESULT record.
    fn report_bandwidth(&self, name: &str, bytes: usize, ours_ms: f64) -> Result<()> {
        let copy_ms = self.copy_ms(bytes)?;
        let gbs = |ms: f64| bytes as f64 / (ms * 1e-3) / 1e9;
        let (ours, base) = (gbs(ours_ms), gbs(copy_ms));
        println!(
            "{name:<44} {:>10.3} ms {:>9.1} GB/s | copy {:>9.3} ms {:>9.1} GB/s | ratio {:>5.2}",
            ours_ms,
            ours,
            copy_ms,
            base,
            ours / base
        );
        println!(
            "RESULT\t{name}\tGB/s\t{ours:.1}\tcopy {base:.1}\t{:.3}",
            ours / base
        );
        Ok(())
    }
}

fn uniform(n: usize, seed: u32) -> Vec<f32> {
    // A cheap deterministic generator is enough for timing inputs.
    let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) * 8.0 - 4.0
        })
        .collect()
}

fn softmax_benches(b: &Bench, rows: usize, vocab: usize) -> Result<()> {
    let gpu = &b.gpu;
    let mut logits = gpu.upload(&uniform(rows * vocab, 1))?;
    let labels: Vec<u32> = (0..rows).map(|r| (r * 7919 % vocab) as u32).collect();
    let labels = gpu.upload(&labels)?;
    let mask = gpu.upload(&vec![1.0f32; rows])?;
    let mut loss = gpu.zeros::<f32>(rows)?;
    let mut lse = gpu.zeros::<f32>(rows)?;
    let bytes_fwd = rows * vocab * 4 + rows * 16;
    let ms = b.time(|| {
        softmax::softmax_xent_forward_online(
            gpu, &logits, &labels, &mask, &mut loss, &mut lse, rows, vocab,
        )
    })?;
    b.report_bandwidth(
        &format!("softmax_xent_forward {rows}x{vocab}"),
        bytes_fwd,
        ms,
    )?;
    let bytes_bwd = 2 * rows * vocab * 4 + rows * 12;
    let ms = b.time(|| {
        softmax::softmax_xent_backward(gpu, &mut logits, &lse, &labels, &mask, 1.0, rows, vocab)
    })?;
    b.report_bandwidth(
        &format!("softmax_xent_backward {rows}x{vocab}"),
        bytes_bwd,
        ms,
    )
}

fn fp16_benches(b: &Bench, n: usize) -> Result<()> {
    let gpu = &b.gpu;
    let src = gpu.upload(&uniform(n, 2))?;
    let mut h = gpu.zeros::<f16>(n)?;
    let mut bh = gpu.zeros::<bf16>(n)?;
    let mut out = gpu.zeros::<f32>(n)?;
    let mut flag = NonFiniteFlag::new(gpu)?;
    let ms = b.time(|| fp16::f32_to_f16_scaled(gpu, &src, 1024.0, &mut h, &mut flag))?;
    b.report_bandwidth(&format!("f32_to_f16_scaled n={n}"), 6 * n, ms)?;
    let ms = b.time(|| fp16::f32_to_bf16_scaled(gpu, &src, 1024.0, &mut bh, &mut flag))?;
    b.report_bandwidth(&format!("f32_to_bf16_scaled n={n}"), 6 * n, ms)?;
    let ms = b.time(|| fp16::f16_to_f32_unscaled(gpu, &h, 1.0 / 1024.0, &mut out))?;
    b.report_bandwidth(&format!("f16_to_f32_unscaled n={n}"), 6 * n, ms)?;
    let ms = b.time(|| fp16::bf16_to_f32_unscaled(gpu, &bh, 1.0 / 1024.0, &mut out))?;
    b.report_bandwidth(&format!("bf16_to_f32_unscaled n={n}"), 6 * n, ms)?;
    let h2 = gpu.zeros::<f16>(n)?;
    let ms = b.time(|| fp16::sum_into_f16(gpu, &mut h, &h2))?;
    b.report_bandwidth(&format!("sum_into_f16 n={n}"), 6 * n, ms)?;
    let b2 = gpu.zeros::<bf16>(n)?;
    let ms = b.time(|| fp16::sum_into_bf16(gpu, &mut bh, &b2))?;
    b.report_bandwidth(&format!("sum_into_bf16 n={n}"), 6 * n, ms)?;
    let ms = b.time(|| fp16::has_non_finite_f32(gpu, &src, &mut flag))?;
    b.report_bandwidth(&format!("has_non_finite_f32 n={n}"), 4 * n, ms)?;
    let mut p = gpu.upload(&uniform(n, 3))?;
    let (mut m, mut v) = (gpu.zeros::<f32>(n)?, gpu.zeros::<f32>(n)?);
    let ms = b.time(|| {
        optim::adam_step(
            gpu, &mut p, &src, &mut m, &mut v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 3,
        )
    })?;
    b.report_bandwidth(&format!("adam_step n={n}"), 28 * n, ms)
}

fn lstm_benches(b: &Bench, batch: usize, hidden: usize, steps: usize) -> Result<()> {
    let gpu = &b.gpu;
    let (cells, g) = (batch * hidden, batch * 4 * hidden);
    let gates = gpu.upload(&uniform(g, 4))?;
    let bias = gpu.upload(&uniform(4 * hidden, 5))?;
    let c_prev = gpu.upload(&uniform(cells, 6))?;
    let (mut c, mut h) = (gpu.zeros::<f32>(cells)?, gpu.zeros::<f32>(cells)?);
    let mut act = gpu.zeros::<f32>(g)?;
    // Unique bytes: gates + act (4H each) and c_prev, c, h per cell; bias once.
    let bytes = 4 * (2 * g + 3 * cells + 4 * hidden);
    let ms = b.time(|| {
        lstm::lstm_pointwise_forward(
            gpu, &gates, &bias, &c_prev, &mut c, &mut h, &mut act, batch, hidden,
        )
    })?;
    b.report_bandwidth(
        &format!("lstm_pointwise_forward {batch}x{hidden}"),
        bytes,
        ms,
    )?;
    let proj = gpu.upload(&uniform(steps * g, 7))?;
    let bytes_step = 4 * (3 * g + 3 * cells + 4 * hidden);
    let ms = b.time(|| {
        lstm::lstm_pointwise_forward_step(
            gpu,
            &proj,
            &gates,
            &bias,
            &c_prev,
            &mut c,
            &mut h,
            &mut act,
            steps / 2,
            steps,
            batch,
            hidden,
        )
    })?;
    b.report_bandwidth(
        &format!("lstm_pointwise_forward_step {batch}x{hidden}"),
        bytes_step,
        ms,
    )?;
    let (dh, dc) = (
        gpu.upload(&uniform(cells, 8))?,
        gpu.upload(&uniform(cells, 9))?,
    );
    let mut dgates = gpu.zeros::<f32>(g)?;
    let mut dc_prev = gpu.zeros::<f32>(cells)?;
    let bytes_bwd = 4 * (2 * g + 6 * cells);
    let ms = b.time(|| {
        lstm::lstm_pointwise_backward(
            gpu,
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
    })?;
    b.report_bandwidth(
        &format!("lstm_pointwise_backward {batch}x{hidden}"),
        bytes_bwd,
        ms,
    )
}

fn gemm_bench(b: &Bench, dtype: &str, t: Transpose, m: usize, n: usize, k: usize) -> Result<()> {
    let gpu = &b.gpu;
    let ((ar, ac), (br, bc)) = t.stored_shapes(m, n, k);
    let mut c: GpuBuffer<f32> = gpu.alloc(m * n)?;
    let ms = match dtype {
        "f32" => {
            let a = gpu.upload(&uniform(ar * ac, 10))?;
            let bm = gpu.upload(&uniform(br * bc, 11))?;
            b.time(|| gemm::gemm_f32(gpu, t, &a, &bm, &mut c, m, n, k, ac, bc, n, 1.0, 0.0))?
        }
        "f16" => {
            let a: Vec<f16> = uniform(ar * ac, 10)
                .iter()
                .map(|&x| f16::from_f32(x))
                .collect();
            let bm: Vec<f16> = uniform(br * bc, 11)
                .iter()
                .map(|&x| f16::from_f32(x))
                .collect();
            let (a, bm) = (gpu.upload(&a)?, gpu.upload(&bm)?);
            b.time(|| gemm::gemm_f16(gpu, t, &a, &bm, &mut c, m, n, k, ac, bc, n, 1.0, 0.0))?
        }
        _ => {
            let a: Vec<bf16> = uniform(ar * ac, 10)
                .iter()
                .map(|&x| bf16::from_f32(x))
                .collect();
            let bm: Vec<bf16> = uniform(br * bc, 11)
                .iter()
                .map(|&x| bf16::from_f32(x))
                .collect();
            let (a, bm) = (gpu.upload(&a)?, gpu.upload(&bm)?);
            b.time(|| gemm::gemm_bf16(gpu, t, &a, &bm, &mut c, m, n, k, ac, bc, n, 1.0, 0.0))?
        }
    };
    let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
    let name = format!("gemm_{dtype}_{} {m}x{n}x{k}", t.suffix());
    println!("{name:<44} {ms:>10.3} ms {tflops:>9.1} TFLOP/s (torch.matmul: see gpu-check)");
    println!("RESULT\t{name}\tTFLOP/s\t{tflops:.1}\ttorch\t-");
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_throughput: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let gpu = Gpu::new(0)?;
    println!(
        "device 0: {} ({} SMs){}",
        gpu.name(),
        gpu.multiprocessors(),
        if quick { ", quick sizes" } else { "" }
    );
    let timer = GpuTimer::new(&gpu)?;
    let b = Bench {
        gpu,
        timer,
        warmup: 3,
        runs: if quick { 5 } else { 20 },
    };
    // The seeds' shapes: batch 384, length 100, vocab 50,000, hidden 512.
    let (rows, m) = if quick { (384, 384) } else { (38_400, 38_400) };
    softmax_benches(&b, rows, 50_000)?;
    softmax_benches(&b, rows, 10_001)?;
    softmax_benches(&b, rows, 1000)?;
    fp16_benches(&b, if quick { (1 << 20) + 3 } else { (1 << 26) + 3 })?;
    lstm_benches(&b, 384, 512, 100)?;
    lstm_benches(&b, 3840, 1024, 10)?;
    let gb = Bench {
        runs: if quick { 3 } else { 10 },
        ..b
    };
    for n in [2048, 50_000] {
        for t in [Transpose::NN, Transpose::NT, Transpose::TN] {
            gemm_bench(&gb, "bf16", t, m, n, 512)?;
        }
        gemm_bench(&gb, "f16", Transpose::NN, m, n, 512)?;
        gemm_bench(&gb, "f32", Transpose::NN, m, n, 512)?;
    }
    Ok(())
}
