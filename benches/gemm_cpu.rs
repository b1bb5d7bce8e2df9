//! Compares the two well-kept pure-Rust GEMM crates, `gemm` and `matrixmultiply`, at the
//! shapes the ringtrain CPU backend multiplies during one NMT training step
//! (batch 64, length 30, emb/hidden 256, vocab 8000), for the three layouts it uses:
//! NN (forward), NT (gradient w.r.t. the input) and TN (weight gradient over all steps).
//!
//! Run: `cargo bench -p ringtrain --bench gemm_cpu`. Prints GFLOP/s of each crate with one
//! and two threads and the ratio gemm / matrixmultiply; then, at the same shapes, our bf16
//! kernels (`ringtrain_kernels::gemm_bf16`, f32 accumulation; a table per path this CPU
//! can run, the path the backend takes named) against the `gemm` crate's f32 product, and
//! the ratio bf16 / f32; last, the backend's path against `torch.mm` in bf16 at the same
//! shapes and layouts (`benches/torch_mm_cpu.py`; run scripts/bench-setup first if torch
//! is missing, else that table says why it was not measured), and the ratio ours / torch;
//! and, for the `avx512-bf16`, `avx512-fma` and `avx2-fma` paths, the same figures against the
//! instruction's own peak (a loop of independent `VDPBF16PS` or `VFMADD231PS` on registers)
//! with the ratio ours / peak.

use std::hint::black_box;
use std::time::{Duration, Instant};

/// Which operand is stored transposed: C[m,n] = op(A)·op(B), all row-major.
#[derive(Clone, Copy)]
enum Layout {
    /// A is [m,k], B is [k,n].
    Nn,
    /// A is [m,k], B is stored [n,k].
    Nt,
    /// A is stored [k,m], B is [k,n].
    Tn,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Nn => "NN",
            Layout::Nt => "NT",
            Layout::Tn => "TN",
        }
    }
    /// (row stride, column stride) of op(A) and op(B) in their row-major storage.
    fn strides(self, m: usize, n: usize, k: usize) -> ((isize, isize), (isize, isize)) {
        let (m, n, k) = (m as isize, n as isize, k as isize);
        match self {
            Layout::Nn => ((k, 1), (n, 1)),
            Layout::Nt => ((k, 1), (1, k)),
            Layout::Tn => ((1, m), (n, 1)),
        }
    }
}

struct Shape {
    what: &'static str,
    m: usize,
    n: usize,
    k: usize,
    layout: Layout,
}

fn gemm_crate(s: &Shape, a: &[f32], b: &[f32], c: &mut [f32], threads: usize) {
    let ((ars, acs), (brs, bcs)) = s.layout.strides(s.m, s.n, s.k);
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: a, b and c hold m*k, k*n and m*n elements (checked by the caller), and the
    // strides above address only elements inside them; c does not alias a or b.
    unsafe {
        gemm::gemm(
            s.m,
            s.n,
            s.k,
            c.as_mut_ptr(),
            1,
            s.n as isize,
            false,
            a.as_ptr(),
            acs,
            ars,
            b.as_ptr(),
            bcs,
            brs,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

fn matrixmultiply_rows(s: &Shape, row0: usize, rows: usize, a: &[f32], b: &[f32], c: &mut [f32]) {
    let ((ars, acs), (brs, bcs)) = s.layout.strides(s.m, s.n, s.k);
    let a_off = row0 as isize * ars;
    // SAFETY: rows row0..row0+rows of op(A) lie inside `a` (offset row0*ars plus strides
    // within m*k elements); `c` is exactly those rows of C (rows*n elements) and does not
    // alias a or b.
    unsafe {
        matrixmultiply::sgemm(
            rows,
            s.k,
            s.n,
            1.0,
            a.as_ptr().offset(a_off),
            ars,
            acs,
            b.as_ptr(),
            brs,
            bcs,
            0.0,
            c.as_mut_ptr(),
            s.n as isize,
            1,
        );
    }
}

fn matrixmultiply_crate(s: &Shape, a: &[f32], b: &[f32], c: &mut [f32], threads: usize) {
    if threads <= 1 {
        matrixmultiply_rows(s, 0, s.m, a, b, c);
        return;
    }
    // Two threads: split C's rows in halves (what the CPU backend would do with rayon).
    let half = s.m / 2;
    let (c0, c1) = c.split_at_mut(half * s.n);
    rayon::join(
        || matrixmultiply_rows(s, 0, half, a, b, c0),
        || matrixmultiply_rows(s, half, s.m - half, a, b, c1),
    );
}

/// A and B of `s`'s product: small values with a pattern, the same for every table.
fn operands(s: &Shape) -> (Vec<f32>, Vec<f32>) {
    let a = (0..s.m * s.k)
        .map(|i| ((i % 97) as f32 - 48.0) * 0.01)
        .collect();
    let b = (0..s.k * s.n)
        .map(|i| ((i % 89) as f32 - 44.0) * 0.01)
        .collect();
    (a, b)
}

/// A table of GFLOP/s: a baseline's and ours, with 1 and 2 threads, per shape, with the
/// ratio ours / baseline, ending with the geometric means of the ratios.
struct Table {
    sum_log_ratio: [f64; 2],
    rows: usize,
}

impl Table {
    /// Prints the header: the baseline's and our column names.
    fn new(baseline: &str, ours: &str) -> Table {
        println!(
            "{:<32} {:>4} {:>5} {:>5} {:>5} | {:>8} {:>8} {:>6} | {:>8} {:>8} {:>6}",
            "product",
            "op",
            "M",
            "N",
            "K",
            format!("{baseline} 1t"),
            format!("{ours} 1t"),
            "ratio",
            format!("{baseline} 2t"),
            format!("{ours} 2t"),
            "ratio"
        );
        Table {
            sum_log_ratio: [0.0; 2],
            rows: 0,
        }
    }

    /// Prints the row of `s`: (baseline, ours) GFLOP/s with 1 and with 2 threads.
    fn row(&mut self, s: &Shape, figures: [(f64, f64); 2]) {
        for (sum, (baseline, ours)) in self.sum_log_ratio.iter_mut().zip(figures) {
            *sum += (ours / baseline).ln();
        }
        self.rows += 1;
        let [(b1, o1), (b2, o2)] = figures;
        println!(
            "{:<32} {:>4} {:>5} {:>5} {:>5} | {b1:>8.1} {o1:>8.1} {:>6.2} | {b2:>8.1} {o2:>8.1} {:>6.2}",
            s.what,
            s.layout.name(),
            s.m,
            s.n,
            s.k,
            o1 / b1,
            o2 / b2
        );
    }

    /// Prints the geometric means of the ratios, named `what`.
    fn geometric_means(&self, what: &str) {
        let n = self.rows.max(1) as f64;
        println!(
            "geometric mean ratio {what}: 1 thread {:.2}, 2 threads {:.2}",
            (self.sum_log_ratio[0] / n).exp(),
            (self.sum_log_ratio[1] / n).exp()
        );
    }
}

/// Median seconds per call over repeated runs filling about `budget`.
fn time_it(budget: Duration, f: impl FnMut()) -> f64 {
    let samples = sorted_times(budget, f);
    samples[samples.len() / 2]
}

/// Seconds of each call of `f` (after one warm-up call), at least 5 calls and until
/// `budget` has passed, from the fastest.
fn sorted_times(budget: Duration, mut f: impl FnMut()) -> Vec<f64> {
    f();
    let mut samples = Vec::new();
    let start = Instant::now();
    while start.elapsed() < budget || samples.len() < 5 {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(|x, y| x.total_cmp(y));
    samples
}

fn main() {
    let (b, t, e, h, v) = (64usize, 30usize, 256usize, 256usize, 8000usize);
    let rows = b * t;
    let shapes = [
        Shape {
            what: "input proj x*W_ih, all steps",
            m: rows,
            n: 4 * h,
            k: e,
            layout: Layout::Nn,
        },
        Shape {
            what: "input proj, emb 512",
            m: rows,
            n: 4 * h,
            k: 512,
            layout: Layout::Nn,
        },
        Shape {
            what: "recurrent h*W_hh, one step",
            m: b,
            n: 4 * h,
            k: h,
            layout: Layout::Nn,
        },
        Shape {
            what: "logits h*W_proj",
            m: rows,
            n: v,
            k: h,
            layout: Layout::Nn,
        },
        Shape {
            what: "dX = dGates*W_ih^T",
            m: rows,
            n: e,
            k: 4 * h,
            layout: Layout::Nt,
        },
        Shape {
            what: "dH = dLogits*W_proj^T",
            m: rows,
            n: h,
            k: v,
            layout: Layout::Nt,
        },
        Shape {
            what: "dW_ih = X^T*dGates",
            m: e,
            n: 4 * h,
            k: rows,
            layout: Layout::Tn,
        },
        Shape {
            what: "dW_proj = H^T*dLogits",
            m: h,
            n: v,
            k: rows,
            layout: Layout::Tn,
        },
    ];
    let budget = Duration::from_millis(300);
    let pool2 = rayon::ThreadPoolBuilder::new().num_threads(2).build();
    let pool2 = match pool2 {
        Ok(p) => p,
        Err(err) => {
            eprintln!("gemm_cpu: cannot start a 2-thread rayon pool: {err}");
            std::process::exit(1);
        }
    };
    println!("gemm_cpu: GFLOP/s (baseline = matrixmultiply 0.3, ours = gemm 0.19), ratio = gemm / matrixmultiply");
    let mut table = Table::new("mm", "gemm");
    for s in &shapes {
        let (a, bm) = operands(s);
        let mut c1 = vec![0.0f32; s.m * s.n];
        let mut c2 = vec![0.0f32; s.m * s.n];
        // Both crates must agree before their speed means anything.
        gemm_crate(s, &a, &bm, &mut c1, 1);
        matrixmultiply_crate(s, &a, &bm, &mut c2, 1);
        let max_diff = c1
            .iter()
            .zip(&c2)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        if max_diff > 1e-2 {
            eprintln!("gemm_cpu: {} results differ by {max_diff}", s.what);
            std::process::exit(1);
        }
        let flop = 2.0 * (s.m * s.n * s.k) as f64;
        let mut row = Vec::new();
        for threads in [1usize, 2] {
            let (tm, tg) = pool2.install(|| {
                let tm = time_it(budget, || {
                    matrixmultiply_crate(s, black_box(&a), &bm, &mut c2, threads)
                });
                let tg = time_it(budget, || {
                    gemm_crate(s, black_box(&a), &bm, &mut c1, threads)
                });
                (tm, tg)
            });
            let (gm, gg) = (flop / tm * 1e-9, flop / tg * 1e-9);
            row.push((gm, gg));
        }
        table.row(s, [(row[0].0, row[0].1), (row[1].0, row[1].1)]);
    }
    table.geometric_means("gemm / matrixmultiply");
    bf16_table(&shapes, budget, &pool2);
}

/// Our bf16 products (operands already bf16, f32 accumulation) against the `gemm`
/// crate's f32 product at the same shapes: one table per path this CPU can run, the one
/// the backend takes (`Bf16Path::detect`) named.
fn bf16_table(shapes: &[Shape], budget: Duration, pool2: &rayon::ThreadPool) {
    use ringtrain_kernels::gemm_bf16::Bf16Path;

    println!();
    println!(
        "gemm_cpu bf16: the backend takes path `{}` on this CPU",
        Bf16Path::detect().name()
    );
    for p in Bf16Path::ALL {
        if let Some(why) = p.unavailable_reason() {
            println!("  path {} not on this CPU: {why}", p.name());
        }
    }
    let detected = Bf16Path::detect();
    let mut ours = Vec::new();
    for path in Bf16Path::runnable() {
        let figures = bf16_path_table(path, shapes, budget, pool2);
        if path == detected {
            ours = figures;
        }
    }
    torch_table(detected, shapes, &ours, budget);
    peak_table(detected, shapes, &ours, budget, pool2);
}

/// The backend's path (its figures in `ours`) against the peak of the instruction it is
/// built on, where that peak is measured: `VDPBF16PS` for `avx512-bf16`, `VFMADD231PS` on
/// 512 or 256 bits for `avx512-fma` and `avx2-fma`.
fn peak_table(
    path: ringtrain_kernels::gemm_bf16::Bf16Path,
    shapes: &[Shape],
    ours: &[[f64; 2]],
    budget: Duration,
    pool2: &rayon::ThreadPool,
) {
    use ringtrain_kernels::gemm_bf16::Bf16Path;

    println!();
    let peak = match path {
        Bf16Path::Avx512Bf16 => dpbf16_peak(budget, pool2),
        Bf16Path::Avx2Fma => fma_peak(FmaWidth::Avx2, budget, pool2),
        Bf16Path::Avx512Fma => fma_peak(FmaWidth::Avx512, budget, pool2),
        _ => None,
    };
    let Some(Peak {
        instruction,
        independent,
        gflops: peak,
    }) = peak
    else {
        println!(
            "gemm_cpu bf16 against the instruction's peak: measured for paths `avx512-bf16`, `avx512-fma` and `avx2-fma` only (this CPU takes `{}`)",
            path.name()
        );
        return;
    };
    println!(
        "gemm_cpu bf16: GFLOP/s (baseline = {instruction} peak, {independent} independent instructions on registers: {:.1} on 1 thread, {:.1} on 2; ours = path `{}`), ratio = ours / peak",
        peak[0],
        peak[1],
        path.name()
    );
    let mut table = Table::new("peak", "ours");
    for (s, o) in shapes.iter().zip(ours) {
        table.row(s, [(peak[0], o[0]), (peak[1], o[1])]);
    }
    table.geometric_means(&format!("ours / {instruction} peak"));
}

/// An instruction's peak, as a loop of independent instructions on registers reaches it.
struct Peak {
    /// The instruction.
    instruction: &'static str,
    /// How many independent instructions the loop keeps in flight.
    independent: usize,
    /// GFLOP/s on 1 thread and on 2.
    gflops: [f64; 2],
}

/// GFLOP/s of `run`, which does `flops` each call: on one thread, and on both of `pool2`'s
/// threads at once; from the fastest call, since a peak is what the instruction reaches
/// when nothing else takes the core (a shared machine's other work only lowers it).
#[cfg(target_arch = "x86_64")]
fn one_and_two_threads(
    budget: Duration,
    pool2: &rayon::ThreadPool,
    flops: f64,
    run: impl Fn() + Sync,
) -> [f64; 2] {
    let one = sorted_times(budget, &run)[0];
    let two = sorted_times(budget, || {
        pool2.broadcast(|_| run());
    })[0];
    [flops / one / 1e9, 2.0 * flops / two / 1e9]
}

/// The vector width of an FMA path's peak.
#[derive(Clone, Copy)]
enum FmaWidth {
    /// 256 bits (AVX2 and FMA), the `avx2-fma` path.
    Avx2,
    /// 512 bits (AVX-512 F), the `avx512-fma` path.
    Avx512,
}

/// GFLOP/s of `VFMADD231PS` on 256- or 512-bit vectors at its peak on 1 and on 2 threads: a
/// loop of 12 independent instructions on registers (no memory traffic; more than the
/// instruction's latency times its throughput), the ceiling of the `avx2-fma` or
/// `avx512-fma` path; `None` where the CPU lacks the instructions.
fn fma_peak(width: FmaWidth, budget: Duration, pool2: &rayon::ThreadPool) -> Option<Peak> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;

        const INDEPENDENT: usize = 12;

        /// `fn $name(rounds)`: `rounds` rounds of `INDEPENDENT` `VFMADD231PS` on `$lanes`
        /// floats, compiled for `$features`; a sum of the accumulators.
        macro_rules! fma_loop {
            ($name:ident, $features:literal, $vector:ty, $lanes:literal, $set1:ident, $zero:ident, $fmadd:ident, $add:ident) => {
                /// # Safety
                /// The CPU has the features the loop is compiled for.
                #[target_feature(enable = $features)]
                unsafe fn $name(rounds: usize) -> f32 {
                    let (a, b) = ($set1(1.0), $set1(0.5));
                    let mut acc = [$zero(); INDEPENDENT];
                    for _ in 0..rounds {
                        for x in acc.iter_mut() {
                            *x = $fmadd(a, b, *x);
                        }
                    }
                    let sum = acc.iter().fold($zero(), |s, &x| $add(s, x));
                    // SAFETY: a vector of `$lanes` floats has the size and layout of the array.
                    unsafe { std::mem::transmute::<$vector, [f32; $lanes]>(sum) }
                        .iter()
                        .sum()
                }
            };
        }
        fma_loop!(
            fma256,
            "avx2,fma",
            __m256,
            8,
            _mm256_set1_ps,
            _mm256_setzero_ps,
            _mm256_fmadd_ps,
            _mm256_add_ps
        );
        fma_loop!(
            fma512,
            "avx512f",
            __m512,
            16,
            _mm512_set1_ps,
            _mm512_setzero_ps,
            _mm512_fmadd_ps,
            _mm512_add_ps
        );

        let (lanes, has, fma_loop): (usize, bool, unsafe fn(usize) -> f32) = match width {
            FmaWidth::Avx2 => (
                8,
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma"),
                fma256,
            ),
            FmaWidth::Avx512 => (16, std::arch::is_x86_feature_detected!("avx512f"), fma512),
        };
        if !has {
            return None;
        }
        const ROUNDS: usize = 1 << 16;
        // Instructions of `lanes` lanes, each a multiply and an add.
        let flops = (ROUNDS * INDEPENDENT * lanes * 2) as f64;
        // SAFETY: the CPU has the features `fma_loop` is compiled for (checked above).
        let run = || {
            black_box(unsafe { fma_loop(black_box(ROUNDS)) });
        };
        Some(Peak {
            instruction: "VFMADD231PS",
            independent: INDEPENDENT,
            gflops: one_and_two_threads(budget, pool2, flops, run),
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (width, budget, pool2);
        None
    }
}

/// GFLOP/s of `VDPBF16PS` at its peak on 1 and on 2 threads: a loop of 24 independent
/// instructions on registers (no memory traffic), the ceiling of the `avx512-bf16` path;
/// `None` where the CPU lacks the instruction.
fn dpbf16_peak(budget: Duration, pool2: &rayon::ThreadPool) -> Option<Peak> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm512_add_ps, _mm512_reduce_add_ps, _mm512_setzero_ps};
        use std::arch::x86_64::{_mm512_cvtne2ps_pbh, _mm512_dpbf16_ps, _mm512_set1_ps};

        const INDEPENDENT: usize = 24;

        /// `rounds` rounds of `INDEPENDENT` `VDPBF16PS`; the sum of the accumulators.
        ///
        /// # Safety
        /// The CPU has AVX-512 F and BF16.
        #[target_feature(enable = "avx512f,avx512bf16")]
        unsafe fn dot_loop(rounds: usize) -> f32 {
            let ones = _mm512_set1_ps(1.0);
            let (a, b) = (
                _mm512_cvtne2ps_pbh(ones, ones),
                _mm512_cvtne2ps_pbh(ones, ones),
            );
            let mut acc = [_mm512_setzero_ps(); INDEPENDENT];
            for _ in 0..rounds {
                for x in acc.iter_mut() {
                    *x = _mm512_dpbf16_ps(*x, a, b);
                }
            }
            let sum = acc
                .iter()
                .fold(_mm512_setzero_ps(), |s, &x| _mm512_add_ps(s, x));
            _mm512_reduce_add_ps(sum)
        }

        if !(std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16"))
        {
            return None;
        }
        const ROUNDS: usize = 1 << 16;
        // Instructions of 16 lanes, each two multiply-adds.
        let flops = (ROUNDS * INDEPENDENT * 16 * 4) as f64;
        // SAFETY: the CPU has the features `dot_loop` is compiled for (checked above).
        let run = || {
            black_box(unsafe { dot_loop(black_box(ROUNDS)) });
        };
        Some(Peak {
            instruction: "VDPBF16PS",
            independent: INDEPENDENT,
            gflops: one_and_two_threads(budget, pool2, flops, run),
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (budget, pool2);
        None
    }
}

/// GFLOP/s of `torch.mm` in bf16 at `shapes` on `threads` threads
/// (`benches/torch_mm_cpu.py`).
fn torch_mm(shapes: &[Shape], threads: usize, budget: Duration) -> Result<Vec<f64>, String> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/torch_mm_cpu.py");
    let mut cmd = std::process::Command::new("python3");
    cmd.args([
        script,
        "--dtype",
        "bf16",
        "--threads",
        &threads.to_string(),
        "--budget",
        &budget.as_secs_f64().to_string(),
    ]);
    for s in shapes {
        cmd.arg("--shape")
            .arg(format!("{},{},{},{}", s.m, s.n, s.k, s.layout.name()));
    }
    let out = cmd.output().map_err(|e| {
        format!("could not run python3 ({e}): install Python 3, then run scripts/bench-setup")
    })?;
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or("benches/torch_mm_cpu.py printed no JSON line")?;
    let v: serde_json::Value = serde_json::from_str(line)
        .map_err(|e| format!("bad JSON from benches/torch_mm_cpu.py: {e}"))?;
    v["gflops"]
        .as_array()
        .filter(|g| g.len() == shapes.len())
        .and_then(|g| g.iter().map(|x| x.as_f64()).collect())
        .ok_or_else(|| {
            format!(
                "benches/torch_mm_cpu.py: expected {} figures in {line}",
                shapes.len()
            )
        })
}

/// Our bf16 products on the backend's path (`ours`: GFLOP/s with 1 and 2 threads, from
/// its table above) against `torch.mm` in bf16 at the same shapes and layouts.
fn torch_table(
    path: ringtrain_kernels::gemm_bf16::Bf16Path,
    shapes: &[Shape],
    ours: &[[f64; 2]],
    budget: Duration,
) {
    println!();
    let torch = match (torch_mm(shapes, 1, budget), torch_mm(shapes, 2, budget)) {
        (Ok(one), Ok(two)) => [one, two],
        (Err(e), _) | (_, Err(e)) => {
            println!("gemm_cpu bf16 against torch.mm bf16: not measured: {e}");
            return;
        }
    };
    println!(
        "gemm_cpu bf16: GFLOP/s (baseline = torch.mm bf16, ours = ringtrain bf16 path `{}`), ratio = ours / torch",
        path.name()
    );
    let mut table = Table::new("torch", "ours");
    for (i, s) in shapes.iter().enumerate() {
        let (t, o) = ([torch[0][i], torch[1][i]], ours[i]);
        table.row(s, [(t[0], o[0]), (t[1], o[1])]);
    }
    table.geometric_means(&format!("ours ({}) / torch.mm bf16", path.name()));
}

/// [`bf16_table`] for one path; returns its GFLOP/s per shape with 1 and 2 threads.
fn bf16_path_table(
    path: ringtrain_kernels::gemm_bf16::Bf16Path,
    shapes: &[Shape],
    budget: Duration,
    pool2: &rayon::ThreadPool,
) -> Vec<[f64; 2]> {
    use ringtrain_kernels::bf16;
    use ringtrain_kernels::gemm_bf16::MatRef;

    println!();
    println!(
        "gemm_cpu bf16: GFLOP/s (baseline = gemm 0.19 f32, ours = ringtrain bf16 path `{}`), ratio = bf16 / f32",
        path.name()
    );
    let mut table = Table::new("f32", "bf16");
    let mut figures = Vec::with_capacity(shapes.len());
    for s in shapes {
        let (a, bm) = operands(s);
        let a16: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
        let b16: Vec<bf16> = bm.iter().map(|&x| bf16::from_f32(x)).collect();
        let views = || {
            let (a_rows, a_cols, b_rows, b_cols) = match s.layout {
                Layout::Nn => (s.m, s.k, s.k, s.n),
                Layout::Nt => (s.m, s.k, s.n, s.k),
                Layout::Tn => (s.k, s.m, s.k, s.n),
            };
            let a = MatRef::row_major(&a16, a_rows, a_cols).expect("A's shape");
            let b = MatRef::row_major(&b16, b_rows, b_cols).expect("B's shape");
            match s.layout {
                Layout::Nn => (a, b),
                Layout::Nt => (a, b.t()),
                Layout::Tn => (a.t(), b),
            }
        };
        let (av, bv) = views();
        let mut c32 = vec![0.0f32; s.m * s.n];
        let mut c16 = vec![0.0f32; s.m * s.n];
        gemm_crate(s, &a, &bm, &mut c32, 1);
        if let Err(e) = ringtrain_kernels::gemm_bf16::gemm_bf16(path, av, bv, &mut c16, s.n, false)
        {
            eprintln!("gemm_cpu: bf16 {}: {e}", s.what);
            std::process::exit(1);
        }
        // The operands differ by bf16 rounding only: the products must agree closely.
        let scale = c32.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1.0);
        let max_diff = c32
            .iter()
            .zip(&c16)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        if max_diff > 2e-2 * scale {
            eprintln!(
                "gemm_cpu: bf16 {} differs from f32 by {max_diff} (scale {scale})",
                s.what
            );
            std::process::exit(1);
        }
        let flop = 2.0 * (s.m * s.n * s.k) as f64;
        let mut row = Vec::new();
        for threads in [1usize, 2] {
            let (t32, t16) = pool2.install(|| {
                let t32 = time_it(budget, || {
                    gemm_crate(s, black_box(&a), &bm, &mut c32, threads)
                });
                let t16 = time_it(budget, || {
                    let result = if threads > 1 {
                        ringtrain_kernels::par::gemm_bf16(path, av, bv, &mut c16, s.n, false)
                    } else {
                        ringtrain_kernels::gemm_bf16::gemm_bf16(path, av, bv, &mut c16, s.n, false)
                    };
                    black_box(result).expect("checked above");
                });
                (t32, t16)
            });
            let (g32, g16) = (flop / t32 * 1e-9, flop / t16 * 1e-9);
            row.push((g32, g16));
        }
        figures.push([row[0].1, row[1].1]);
        table.row(s, [(row[0].0, row[0].1), (row[1].0, row[1].1)]);
    }
    table.geometric_means(&format!("bf16 ({}) / f32", path.name()));
    figures
}
