//! Criterion benchmarks of the hot CPU kernels: each serial kernel is the baseline for its
//! `par` twin, the two-pass softmax is the baseline for the online one, and plain scalar
//! loops with `std`'s `exp`/`tanh` are the baseline for the LSTM and softmax forwards. After the
//! measurements the bench prints, from criterion's own estimates of this run, a table with
//! the baseline, our figure and the ratio.
//!
//! Run: `cargo bench -p ringtrain --no-default-features --bench kernels`

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain::kernels::{self as k, bf16, f16, par};

/// LSTM shape of the NMT model's layers (batch 128, 1024 units).
const BATCH: usize = 128;
const HIDDEN: usize = 1024;
/// Softmax shape: 64 target tokens over a 32k vocabulary.
const ROWS: usize = 64;
const VOCAB: usize = 32_000;
/// Element-wise kernels: 4M f32 (a 16 MB gradient bucket).
const ELEMENTS: usize = 1 << 22;

fn random(seed: u64, len: usize, spread: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(-spread..spread)).collect()
}

/// Kernel signatures shared by the serial and parallel versions.
type LstmForward =
    fn(&[f32], &[f32], &[f32], &mut [f32], &mut [f32], &mut [f32], usize, usize) -> k::Result<()>;
type LstmBackward = fn(
    &[f32],
    &[f32],
    &[f32],
    &[f32],
    &[f32],
    &mut [f32],
    &mut [f32],
    usize,
    usize,
) -> k::Result<()>;
type SoftmaxForward =
    fn(&[f32], &[u32], &[f32], &mut [f32], &mut [f32], usize, usize) -> k::Result<()>;
type SoftmaxBackward = fn(&mut [f32], &[f32], &[u32], &[f32], f32, usize, usize) -> k::Result<()>;
type ToF16 = fn(&[f32], f32, &mut [f16]) -> k::Result<bool>;
type ToBf16 = fn(&[f32], f32, &mut [bf16]) -> k::Result<bool>;
type Adam =
    fn(&mut [f32], &[f32], &mut [f32], &mut [f32], f32, f32, f32, f32, f32, u32) -> k::Result<()>;

/// Baseline: the pointwise LSTM forward written plainly with `std`'s scalar `exp`/`tanh`.
#[allow(clippy::too_many_arguments)]
fn lstm_forward_plain_std(
    gates: &[f32],
    bias: &[f32],
    c_prev: &[f32],
    c: &mut [f32],
    h: &mut [f32],
    act: &mut [f32],
    batch: usize,
    hidden: usize,
) -> k::Result<()> {
    let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
    for b in 0..batch {
        for j in 0..hidden {
            let at = |gate: usize| b * 4 * hidden + gate * hidden + j;
            let i = sigmoid(gates[at(0)] + bias[j]);
            let f = sigmoid(gates[at(1)] + bias[hidden + j]);
            let g = (gates[at(2)] + bias[2 * hidden + j]).tanh();
            let o = sigmoid(gates[at(3)] + bias[3 * hidden + j]);
            let cn = f * c_prev[b * hidden + j] + i * g;
            c[b * hidden + j] = cn;
            h[b * hidden + j] = o * cn.tanh();
            act[at(0)] = i;
            act[at(1)] = f;
            act[at(2)] = g;
            act[at(3)] = o;
        }
    }
    Ok(())
}

/// Baseline: two-pass softmax cross-entropy written plainly with `std`'s scalar `exp`/`ln`.
fn softmax_forward_plain_std(
    logits: &[f32],
    labels: &[u32],
    mask: &[f32],
    loss: &mut [f32],
    lse: &mut [f32],
    rows: usize,
    vocab: usize,
) -> k::Result<()> {
    for r in 0..rows {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let sum: f32 = row.iter().map(|&x| (x - max).exp()).sum();
        lse[r] = max + sum.ln();
        loss[r] = mask[r] * (lse[r] - row[labels[r] as usize]);
    }
    Ok(())
}

fn bench_lstm(c: &mut Criterion) {
    let (n, g) = (BATCH * HIDDEN, BATCH * 4 * HIDDEN);
    let gates = random(1, g, 3.0);
    let bias = random(2, 4 * HIDDEN, 0.5);
    let c_prev = random(3, n, 1.0);
    let dh = random(4, n, 1.0);
    let dc = random(5, n, 1.0);
    let (mut cc, mut h, mut act) = (vec![0.0; n], vec![0.0; n], vec![0.0; g]);
    let (mut dg, mut dcp) = (vec![0.0; g], vec![0.0; n]);

    let mut group = c.benchmark_group("lstm_pointwise_forward");
    group.throughput(Throughput::Elements(n as u64));
    let forwards: [(&str, LstmForward); 3] = [
        ("plain_std", lstm_forward_plain_std),
        ("serial", k::lstm_pointwise_forward),
        ("par", par::lstm_pointwise_forward),
    ];
    for (name, f) in forwards {
        group.bench_function(name, |b| {
            b.iter(|| {
                f(
                    black_box(&gates),
                    &bias,
                    &c_prev,
                    &mut cc,
                    &mut h,
                    &mut act,
                    BATCH,
                    HIDDEN,
                )
                .unwrap()
            })
        });
    }
    group.finish();

    let mut group = c.benchmark_group("lstm_pointwise_backward");
    group.throughput(Throughput::Elements(n as u64));
    let backwards: [(&str, LstmBackward); 2] = [
        ("serial", k::lstm_pointwise_backward),
        ("par", par::lstm_pointwise_backward),
    ];
    for (name, f) in backwards {
        group.bench_function(name, |b| {
            b.iter(|| {
                f(
                    black_box(&act),
                    &c_prev,
                    &cc,
                    &dh,
                    &dc,
                    &mut dg,
                    &mut dcp,
                    BATCH,
                    HIDDEN,
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

fn bench_softmax(c: &mut Criterion) {
    let logits = random(6, ROWS * VOCAB, 10.0);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let labels: Vec<u32> = (0..ROWS).map(|_| rng.gen_range(0..VOCAB as u32)).collect();
    let mask = vec![1.0f32; ROWS];
    let (mut loss, mut lse) = (vec![0.0; ROWS], vec![0.0; ROWS]);

    let mut group = c.benchmark_group("softmax_xent_forward");
    group.throughput(Throughput::Elements((ROWS * VOCAB) as u64));
    let forwards: [(&str, SoftmaxForward); 5] = [
        ("plain_std", softmax_forward_plain_std),
        ("serial", k::softmax_xent_forward),
        ("par", par::softmax_xent_forward),
        ("online_serial", k::softmax_xent_forward_online),
        ("online_par", par::softmax_xent_forward_online),
    ];
    for (name, f) in forwards {
        group.bench_function(name, |b| {
            b.iter(|| {
                f(
                    black_box(&logits),
                    &labels,
                    &mask,
                    &mut loss,
                    &mut lse,
                    ROWS,
                    VOCAB,
                )
                .unwrap()
            })
        });
    }
    group.finish();

    k::softmax_xent_forward(&logits, &labels, &mask, &mut loss, &mut lse, ROWS, VOCAB).unwrap();
    let mut grad = logits.clone();
    let mut group = c.benchmark_group("softmax_xent_backward");
    group.throughput(Throughput::Elements((ROWS * VOCAB) as u64));
    let backwards: [(&str, SoftmaxBackward); 2] = [
        ("serial", k::softmax_xent_backward),
        ("par", par::softmax_xent_backward),
    ];
    for (name, f) in backwards {
        group.bench_function(name, |b| {
            b.iter(|| {
                // Restoring the logits is part of both variants' time alike.
                grad.copy_from_slice(&logits);
                f(
                    &mut grad,
                    &lse,
                    &labels,
                    &mask,
                    1.0 / ROWS as f32,
                    ROWS,
                    VOCAB,
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

fn bench_casts(c: &mut Criterion) {
    let src = random(8, ELEMENTS, 100.0);
    let mut h = vec![f16::ZERO; ELEMENTS];
    let mut bh = vec![bf16::ZERO; ELEMENTS];

    let mut group = c.benchmark_group("f32_to_f16_scaled");
    group.throughput(Throughput::Elements(ELEMENTS as u64));
    let to_f16: [(&str, ToF16); 2] = [
        ("serial", k::f32_to_f16_scaled),
        ("par", par::f32_to_f16_scaled),
    ];
    for (name, f) in to_f16 {
        group.bench_function(name, |b| {
            b.iter(|| f(black_box(&src), 128.0, &mut h).unwrap())
        });
    }
    group.finish();

    let mut group = c.benchmark_group("f32_to_bf16_scaled");
    group.throughput(Throughput::Elements(ELEMENTS as u64));
    let to_bf16: [(&str, ToBf16); 2] = [
        ("serial", k::f32_to_bf16_scaled),
        ("par", par::f32_to_bf16_scaled),
    ];
    for (name, f) in to_bf16 {
        group.bench_function(name, |b| {
            b.iter(|| f(black_box(&src), 128.0, &mut bh).unwrap())
        });
    }
    group.finish();
}

fn bench_adam(c: &mut Criterion) {
    let grads = random(9, ELEMENTS, 1.0);
    let mut params = random(10, ELEMENTS, 1.0);
    let (mut m, mut v) = (vec![0.0f32; ELEMENTS], vec![0.0f32; ELEMENTS]);
    let mut group = c.benchmark_group("adam_step");
    group.throughput(Throughput::Elements(ELEMENTS as u64));
    let adams: [(&str, Adam); 2] = [("serial", k::adam_step), ("par", par::adam_step)];
    for (name, f) in adams {
        group.bench_function(name, |b| {
            b.iter(|| {
                f(
                    &mut params,
                    black_box(&grads),
                    &mut m,
                    &mut v,
                    1e-3,
                    0.9,
                    0.999,
                    1e-8,
                    0.0,
                    10,
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

/// Mean time per iteration (ns) that criterion estimated in this run.
fn mean_ns(dir: &Path, group: &str, name: &str) -> Option<f64> {
    let path = dir
        .join(group)
        .join(name)
        .join("new")
        .join("estimates.json");
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["mean"]["point_estimate"].as_f64()
}

fn print_ratios(dir: &Path) {
    let pairs = [
        ("lstm_pointwise_forward", "plain_std", "serial"),
        ("lstm_pointwise_forward", "serial", "par"),
        ("lstm_pointwise_backward", "serial", "par"),
        ("softmax_xent_forward", "plain_std", "serial"),
        ("softmax_xent_forward", "serial", "par"),
        ("softmax_xent_forward", "serial", "online_serial"),
        ("softmax_xent_forward", "online_serial", "online_par"),
        ("softmax_xent_backward", "serial", "par"),
        ("f32_to_f16_scaled", "serial", "par"),
        ("f32_to_bf16_scaled", "serial", "par"),
        ("adam_step", "serial", "par"),
    ];
    println!(
        "\n{:<26} {:>14} {:>14} {:>14} {:>14} {:>9}",
        "kernel", "baseline", "baseline ms", "ours", "ours ms", "speedup"
    );
    for (group, base, ours) in pairs {
        match (mean_ns(dir, group, base), mean_ns(dir, group, ours)) {
            (Some(b), Some(o)) => println!(
                "{group:<26} {base:>14} {:>14.3} {ours:>14} {:>14.3} {:>8.2}x",
                b / 1e6,
                o / 1e6,
                b / o
            ),
            _ => println!("{group:<26} (not measured in this run)"),
        }
    }
    println!("threads available to rayon: {}", available_threads());
}

fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn main() {
    let dir: PathBuf = Path::new(env!("CARGO_TARGET_TMPDIR")).join("criterion-kernels");
    let mut c = Criterion::default()
        .output_directory(&dir)
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    bench_lstm(&mut c);
    bench_softmax(&mut c);
    bench_casts(&mut c);
    bench_adam(&mut c);
    c.final_summary();
    print_ratios(&dir);
}
