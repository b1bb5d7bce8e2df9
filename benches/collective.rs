//! Collectives over the local (threads) transport.
//!
//! - `all_reduce/<ranks>/<bytes>/{ring,rd}`: the ring against recursive doubling (the
//!   small-message algorithm) on the same data.
//! - `small_tensors/<ranks>`: 1000 tensors of 1 KiB per step, each all-reduced on its own
//!   (baseline) against the fusion engine.
//! - `pieces/<ranks>/<piece bytes>/{buffer,in_place}`: a message of 1000 pieces over shared
//!   memory, copied into one buffer and back (baseline) against reduced where the pieces
//!   lie: where the crossover lies decides `MIN_SHARED_MEMORY_PIECE_BYTES`.
//!
//! After criterion's own report a summary prints the baseline, ours and the ratio, each
//! pair measured in this run.

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use ringtrain::collective::{
    Algorithm, AllReduceOptions, Communicator, FusionConfig, FusionEngine, Tensor,
};

const SMALL_TENSORS: usize = 1000;
const SMALL_LEN: usize = 256; // 1 KiB of f32
const PIECE_BYTES: [usize; 4] = [64, 128, 256, 1024];

/// Runs `iters` all-reduces on every rank; returns the slowest rank's time.
fn time_all_reduce(ranks: usize, len: usize, algorithm: Algorithm, iters: u64) -> Duration {
    let times = Communicator::run_local(ranks, |mut comm| {
        let mut buf = vec![1.0f32; len];
        let opts = AllReduceOptions::sum().algorithm(algorithm);
        comm.barrier().expect("barrier");
        let start = Instant::now();
        for _ in 0..iters {
            comm.all_reduce(&mut buf, &opts).expect("all_reduce");
        }
        start.elapsed()
    })
    .expect("local ranks");
    times.into_iter().max().unwrap_or_default()
}

/// Runs `iters` shared-memory all-reduces of [`SMALL_TENSORS`] pieces of `piece_bytes`
/// each on every rank, through one buffer or where they lie; returns the slowest rank's
/// time.
fn time_pieces(ranks: usize, piece_bytes: usize, in_place: bool, iters: u64) -> Duration {
    let times = Communicator::run_local(ranks, |mut comm| {
        comm.set_min_in_place_piece_bytes(Some(if in_place { 0 } else { usize::MAX }));
        let mut tensors = vec![vec![1.0f32; piece_bytes / 4]; SMALL_TENSORS];
        let opts = AllReduceOptions::sum().algorithm(Algorithm::SharedMemory);
        comm.barrier().expect("barrier");
        let start = Instant::now();
        for _ in 0..iters {
            let mut pieces: Vec<&mut [f32]> = tensors.iter_mut().map(|t| &mut t[..]).collect();
            comm.all_reduce_pieces(&mut pieces, &opts)
                .expect("all_reduce_pieces");
        }
        start.elapsed()
    })
    .expect("local ranks");
    times.into_iter().max().unwrap_or_default()
}

/// Untimed steps before the timed ones: the engine learns a step's names in its first
/// steps and reduces them as one armed group from the third on (see the fusion docs).
const WARMUP_STEPS: u64 = 3;

/// Steps of 1000 small tensors, per-tensor (`fused = false`) or through the engine, after
/// [`WARMUP_STEPS`] untimed ones.
fn time_small_tensors(ranks: usize, fused: bool, steps: u64) -> Duration {
    let times = Communicator::run_local(ranks, |mut comm| {
        let names: Vec<String> = (0..SMALL_TENSORS)
            .map(|i| format!("layer{i}/grad"))
            .collect();
        let mut tensors: Vec<Vec<f32>> = (0..SMALL_TENSORS).map(|_| vec![1.0; SMALL_LEN]).collect();
        if !fused {
            let opts = AllReduceOptions::sum();
            let mut start = Instant::now();
            for step in 0..WARMUP_STEPS + steps {
                if step == WARMUP_STEPS {
                    comm.barrier().expect("barrier");
                    start = Instant::now();
                }
                for t in tensors.iter_mut() {
                    comm.all_reduce(t, &opts).expect("all_reduce");
                }
            }
            return start.elapsed();
        }
        let mut other = comm.duplicate().expect("duplicate");
        let engine = FusionEngine::start(comm, FusionConfig::default()).expect("engine");
        let mut start = Instant::now();
        for step in 0..WARMUP_STEPS + steps {
            if step == WARMUP_STEPS {
                other.barrier().expect("barrier");
                start = Instant::now();
            }
            let handles: Vec<_> = names
                .iter()
                .zip(tensors.drain(..))
                .map(|(n, t)| engine.submit(n, t).expect("submit"))
                .collect();
            for t in engine.synchronize(handles).expect("synchronize") {
                tensors.push(Tensor::into_vec(t).expect("f32"));
            }
        }
        let elapsed = start.elapsed();
        engine.shutdown().expect("shutdown");
        elapsed
    })
    .expect("local ranks");
    times.into_iter().max().unwrap_or_default()
}

fn benches(c: &mut Criterion) {
    for ranks in [2, 4] {
        let mut group = c.benchmark_group(format!("all_reduce/{ranks}"));
        group.sample_size(10);
        for bytes in [4 << 10, 256 << 10, 4 << 20] {
            group.throughput(Throughput::Bytes(bytes as u64));
            for (name, alg) in [
                ("ring", Algorithm::Ring),
                ("rd", Algorithm::RecursiveDoubling),
            ] {
                group.bench_with_input(BenchmarkId::new(name, bytes), &bytes, |b, &bytes| {
                    b.iter_custom(|iters| time_all_reduce(ranks, bytes / 4, alg, iters))
                });
            }
        }
        group.finish();
        for piece_bytes in PIECE_BYTES {
            let mut group = c.benchmark_group(format!("pieces/{ranks}/{piece_bytes}"));
            group.sample_size(10);
            for (name, in_place) in [("buffer", false), ("in_place", true)] {
                group.bench_function(name, |b| {
                    b.iter_custom(|iters| time_pieces(ranks, piece_bytes, in_place, iters))
                });
            }
            group.finish();
        }
        let mut group = c.benchmark_group(format!("small_tensors/{ranks}"));
        group.sample_size(10);
        for (name, fused) in [("per_tensor", false), ("fused", true)] {
            group.bench_function(name, |b| {
                b.iter_custom(|iters| time_small_tensors(ranks, fused, iters))
            });
        }
        group.finish();
    }
}

fn summary() {
    println!("\nsummary (local transport, same run): baseline, ours, ratio baseline/ours");
    for ranks in [2, 4] {
        for bytes in [4usize << 10, 4 << 20] {
            let iters = if bytes > 1 << 20 { 20 } else { 500 };
            let rd = time_all_reduce(ranks, bytes / 4, Algorithm::RecursiveDoubling, iters);
            let ring = time_all_reduce(ranks, bytes / 4, Algorithm::Ring, iters);
            println!(
                "  {ranks} ranks {bytes:>8} B all-reduce: recursive doubling {:>9.1} us, ring {:>9.1} us, ratio {:.2}",
                rd.as_secs_f64() * 1e6 / iters as f64,
                ring.as_secs_f64() * 1e6 / iters as f64,
                rd.as_secs_f64() / ring.as_secs_f64()
            );
        }
        for piece_bytes in PIECE_BYTES {
            let iters = 200;
            let buffer = time_pieces(ranks, piece_bytes, false, iters);
            let in_place = time_pieces(ranks, piece_bytes, true, iters);
            println!(
                "  {ranks} ranks {SMALL_TENSORS} x {piece_bytes:>4} B shared memory: through a buffer {:>8.1} us, in place {:>8.1} us, ratio {:.2}",
                buffer.as_secs_f64() * 1e6 / iters as f64,
                in_place.as_secs_f64() * 1e6 / iters as f64,
                buffer.as_secs_f64() / in_place.as_secs_f64()
            );
        }
        let steps = 10;
        let per = time_small_tensors(ranks, false, steps);
        let fused = time_small_tensors(ranks, true, steps);
        println!(
            "  {ranks} ranks {SMALL_TENSORS} x 1 KiB step: per-tensor all-reduce {:>8.3} ms, fusion {:>8.3} ms, ratio {:.1}",
            per.as_secs_f64() * 1e3 / steps as f64,
            fused.as_secs_f64() * 1e3 / steps as f64,
            per.as_secs_f64() / fused.as_secs_f64()
        );
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    benches(&mut c);
    c.final_summary();
    summary();
}
