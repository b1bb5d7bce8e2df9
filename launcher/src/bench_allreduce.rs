//! `ringtrain bench allreduce`: an nccl-tests-style all-reduce table (ring against
//! `MPI_Allreduce`, same run), the many-small-tensors case (per-tensor `MPI_Allreduce`
//! against tensor fusion) and the fusion overhead (a fused step of many small tensors
//! against one all-reduce of the same total bytes). Run it under mpirun:
//!
//! ```text
//! mpirun -np 4 ringtrain bench allreduce --min-bytes 64K --max-bytes 64M --json allreduce.json
//! ```
//!
//! The `--json` file is one array: the table's rows (nccl-tests' fields), then two entries
//! per fusion-overhead case, `{"case": "fusion_overhead", "ranks": R, "tensors": N,
//! "tensor_bytes": B, "ratio": X, ...}` with the two times the ratio comes from, one per
//! way of submitting (`"submission": "each"`, one `submit` per tensor as a backward pass
//! does, or `"group"`, one `all_reduce_group` for all of them). Both repeat the same
//! tensors step after step, as training does, so both measure the engine's steady state:
//! for `each` that is a repeated step of single submissions, held and reduced as one
//! cached group (see the fusion module's docs).

use std::path::PathBuf;

/// Options of `ringtrain bench allreduce`.
#[derive(Debug, Clone, clap::Args)]
pub struct AllreduceBenchArgs {
    /// Smallest message (bytes; K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "4K", value_parser = parse_bytes)]
    pub min_bytes: usize,
    /// Largest message.
    #[arg(long, default_value = "256M", value_parser = parse_bytes)]
    pub max_bytes: usize,
    /// Each size is this many times the previous one.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..))]
    pub step_factor: u64,
    /// Element type: f32, f64, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Algorithms to measure, comma-separated (ring, mpi, rd, hd, direct, sg, shm, auto); with
    /// mpi among them, each other algorithm's bus bandwidth over MPI's is printed (`vs mpi`).
    #[arg(long, value_delimiter = ',', default_value = "ring,mpi")]
    pub algorithms: Vec<String>,
    /// Untimed iterations per size and algorithm.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed iterations per size and algorithm (default: about 1 GiB of data, 3 to 200;
    /// at least 1).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Ring pipeline segment size.
    #[arg(long, default_value = "256K", value_parser = parse_bytes)]
    pub segment_bytes: usize,
    /// Write the table rows as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Tensors per step in the many-small-tensors case (0 skips it).
    #[arg(long, default_value_t = 1000)]
    pub small_tensors: usize,
    /// Bytes per tensor in the many-small-tensors case.
    #[arg(long, default_value = "1K", value_parser = parse_bytes)]
    pub small_tensor_bytes: usize,
    /// Timed steps in the many-small-tensors case.
    #[arg(long, default_value_t = 20)]
    pub small_steps: usize,
    /// Fusion cycle time in microseconds for the many-small-tensors case.
    #[arg(long, default_value_t = 1000)]
    pub cycle_time_us: u64,
    /// Tensor counts of the fusion-overhead cases, comma-separated (`0` skips them).
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    pub fusion_tensors: Vec<usize>,
    /// Bytes per tensor of the fusion-overhead cases, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,4K", value_parser = parse_bytes)]
    pub fusion_tensor_bytes: Vec<usize>,
    /// Timed steps per fusion-overhead case (each step: one fused step and one
    /// all-reduce, taking turns; the medians are compared).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..))]
    pub fusion_steps: u64,
    /// Draw the table's bus bandwidth against message size, a line per algorithm, into
    /// this SVG file (rank 0; an existing one is replaced).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Write a Chrome-trace timeline of the fused case (`FILE` becomes `FILE.rank<R>.json`).
    #[arg(long)]
    pub timeline: Option<PathBuf>,
    /// Seconds a collective may wait on other ranks without progress before the job is
    /// aborted (a warning names them at half); `0` or `off` waits for ever.
    #[arg(long, default_value_t = ringtrain_collective::DEFAULT_STALL_TIMEOUT.as_secs_f64(), value_parser = parse_seconds)]
    pub stall_timeout: f64,
}

/// Seconds, or `off` (0).
fn parse_seconds(s: &str) -> Result<f64, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(0.0);
    }
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 && v <= (1u64 << 32) as f64 => Ok(v),
        _ => Err("expected seconds from 0 to 2^32 such as 60, or `off`".into()),
    }
}

impl AllreduceBenchArgs {
    /// `--stall-timeout` as the collective takes it (`None`: off).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    fn stall_timeout(&self) -> Option<std::time::Duration> {
        let d = std::time::Duration::from_secs_f64(self.stall_timeout);
        (!d.is_zero()).then(|| d.max(std::time::Duration::from_millis(1)))
    }
}

/// Parses `4096`, `4K`, `4KiB`, `64M`, `1G` (powers of 1024).
fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| {
        format!("`{s}` is not a size: use a number with an optional K, M or G suffix, e.g. 64K")
    })?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("`{s}` has an unknown unit `{unit}`: use K, M or G")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// One line of the table (field names as in nccl-tests).
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub struct AllreduceRow {
    /// Message size in bytes.
    pub bytes: usize,
    /// Elements.
    pub count: usize,
    /// Element type.
    pub dtype: String,
    /// Algorithm (`ring`, `mpi`, ...).
    pub algorithm: String,
    /// Time per all-reduce in microseconds (slowest rank).
    pub time_us: f64,
    /// bytes / time, GB/s.
    pub algbw: f64,
    /// algbw * 2 (N - 1) / N, GB/s.
    pub busbw: f64,
    /// Elements that differ from the exact expected result.
    pub wrong: usize,
}

/// One fusion-overhead case: a fused step of `tensors` tensors of `tensor_bytes` bytes
/// against one all-reduce of the same total bytes, same options, same run.
#[derive(Debug, Clone, serde::Serialize)]
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub struct FusionOverheadEntry {
    /// Always `fusion_overhead`.
    pub case: &'static str,
    /// Ranks.
    pub ranks: usize,
    /// Tensors per step.
    pub tensors: usize,
    /// Bytes per tensor (f32).
    pub tensor_bytes: usize,
    /// `each` (one `submit` per tensor) or `group` (one `all_reduce_group`).
    pub submission: &'static str,
    /// Median fused step (submit the tensors, wait for them) in microseconds, slowest rank.
    pub fused_us: f64,
    /// Median all-reduce of `tensors * tensor_bytes` bytes in microseconds, slowest rank.
    pub all_reduce_us: f64,
    /// `fused_us / all_reduce_us`.
    pub ratio: f64,
}

/// The bus bandwidth of `rows` against message size, a line per algorithm.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub fn busbw_chart(rows: &[AllreduceRow], ranks: usize) -> crate::plot::Chart {
    let mut lines: Vec<crate::plot::Line> = Vec::new();
    for r in rows {
        let point = (r.bytes as f64, r.busbw);
        match lines.iter_mut().find(|l| l.name == r.algorithm) {
            Some(line) => line.points.push(point),
            None => lines.push(crate::plot::Line {
                name: r.algorithm.clone(),
                points: vec![point],
                predicted: false,
            }),
        }
    }
    let dtype = rows.first().map_or("", |r| r.dtype.as_str());
    crate::plot::Chart::Busbw {
        title: format!("all-reduce bus bandwidth, {ranks} ranks, {dtype}"),
        lines,
    }
}

/// Runs the benchmark on this rank (every rank of the mpirun job must run it).
#[cfg(feature = "mpi")]
pub fn run(args: &AllreduceBenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    use ringtrain_collective::{Communicator, DType};

    let dtype: DType = args.dtype.parse()?;
    let algorithms = args
        .algorithms
        .iter()
        .map(|a| a.parse())
        .collect::<Result<Vec<ringtrain_collective::Algorithm>, _>>()?;
    if args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        return Err(format!(
            "--min-bytes {} and --max-bytes {}: need 0 < min <= max",
            args.min_bytes, args.max_bytes
        )
        .into());
    }
    if args.iters == Some(0) {
        return Err(
            "invalid value `0` for --iters: a time needs at least one timed iteration; pass \
             --iters 1 or more, or leave it out for about 1 GiB of data per size"
                .into(),
        );
    }
    let mut comm = Communicator::mpi()?;
    comm.set_stall_timeout(args.stall_timeout());
    check_outputs(&mut comm, args)?;
    comm.set_segment_bytes(args.segment_bytes);
    check_memory(&mut comm, args, dtype.size_bytes())?;
    let rows = match dtype {
        DType::F32 => measure::table::<f32>(&mut comm, args, &algorithms)?,
        DType::F64 => measure::table::<f64>(&mut comm, args, &algorithms)?,
        DType::F16 => {
            measure::table::<ringtrain_collective::half::f16>(&mut comm, args, &algorithms)?
        }
        DType::BF16 => {
            measure::table::<ringtrain_collective::half::bf16>(&mut comm, args, &algorithms)?
        }
    };
    let wrong: usize = rows.iter().map(|r| r.wrong).sum();
    let comm = if args.small_tensors > 0 {
        measure::small_tensors(comm, args)?
    } else {
        comm
    };
    let (comm, overhead) = measure::fusion_overhead(comm, args)?;
    if comm.rank() == 0 {
        if let Some(path) = &args.json {
            let mut entries = Vec::with_capacity(rows.len() + overhead.len());
            for r in &rows {
                entries.push(serde_json::to_value(r)?);
            }
            for o in &overhead {
                entries.push(serde_json::to_value(o)?);
            }
            let text = serde_json::to_string_pretty(&entries)?;
            ringtrain_train::outputs::write_atomically(
                path,
                text.as_bytes(),
                "writing the --json table",
            )?;
            println!("# rows written to {}", path.display());
        }
        if let Some(path) = &args.plot {
            crate::plot::write_svg("--plot", path, &[busbw_chart(&rows, comm.size())])?;
            println!("# plot written to {}", path.display());
        }
    }
    drop(comm);
    if wrong > 0 {
        return Err(format!("{wrong} elements differed from the exact result").into());
    }
    Ok(())
}

/// The bytes one rank allocates: the input, the expected result and the working copy at
/// the largest size, the communicator's receive scratch of the same size, and the
/// many-small-tensors case (its tensors, the fusion buffer and the engine's copies).
#[cfg(feature = "mpi")]
fn bench_bytes_per_rank(args: &AllreduceBenchArgs, element_bytes: usize) -> Option<u128> {
    let max = (args.max_bytes / element_bytes.max(1) * element_bytes) as u128;
    let small_len = (args.small_tensor_bytes / 4).max(1) as u128 * 4;
    let small = if args.small_tensors > 0 {
        (args.small_tensors as u128)
            .checked_mul(small_len)?
            .checked_mul(3)?
    } else {
        0
    };
    // The fusion-overhead cases: the tensors, the engine's fusion buffer and the one
    // contiguous buffer of the same size, one case at a time.
    let mut overhead = 0u128;
    for &n in &args.fusion_tensors {
        for &b in &args.fusion_tensor_bytes {
            let case = (n as u128)
                .checked_mul((b / 4).max(1) as u128 * 4)?
                .checked_mul(3)?;
            overhead = overhead.max(case);
        }
    }
    max.checked_mul(4)?.checked_add(small.max(overhead))
}

/// `MemAvailable` of `/proc/meminfo` in bytes, where the system has one.
#[cfg(feature = "mpi")]
fn available_memory() -> Option<u128> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u128 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses, on every rank alike, when the ranks of one node would allocate more than
/// the node has available.
#[cfg(feature = "mpi")]
fn check_memory(
    comm: &mut ringtrain_collective::Communicator,
    args: &AllreduceBenchArgs,
    element_bytes: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    use ringtrain_collective::{Algorithm, AllReduceOptions, ReduceOp};

    let node = comm.node_rank()?;
    let per_rank = bench_bytes_per_rank(args, element_bytes);
    let on_node = per_rank.and_then(|b| b.checked_mul(node.size as u128));
    let available = available_memory();
    let too_big = match (on_node, available) {
        (None, _) => true,
        (Some(need), Some(avail)) => need > avail,
        (Some(_), None) => false,
    };
    // Every rank must take the same decision, or the refusing ones leave the others
    // waiting in the first collective.
    let mut flag = [u8::from(too_big) as f64];
    comm.all_reduce(
        &mut flag,
        &AllReduceOptions::with_op(ReduceOp::Max).algorithm(Algorithm::RecursiveDoubling),
    )?;
    if flag[0] == 0.0 {
        return Ok(());
    }
    let gib = |b: u128| b as f64 / (1u64 << 30) as f64;
    Err(match (per_rank, available) {
        (Some(per_rank), Some(avail)) => format!(
            "--max-bytes {} needs about {:.2} GiB per rank ({} bytes: 4 buffers of the largest \
             size plus the small-tensor case), {:.2} GiB for the {} ranks on this node, but \
             {:.2} GiB are available: lower --max-bytes or run fewer ranks per node",
            args.max_bytes,
            gib(per_rank),
            per_rank,
            gib(per_rank * node.size as u128),
            node.size,
            gib(avail)
        ),
        _ => format!(
            "--max-bytes {}, --small-tensors {} x --small-tensor-bytes {} and the \
             --fusion-tensors x --fusion-tensor-bytes cases are too large to allocate on one \
             node: lower them",
            args.max_bytes, args.small_tensors, args.small_tensor_bytes
        ),
    }
    .into())
}

/// Checks, before anything is measured, the files each rank will write (`--json` on rank
/// 0, its own `--timeline` file on every rank); every rank fails when one cannot write,
/// and a rank that cannot write prints its reason itself, before the ranks agree.
#[cfg(feature = "mpi")]
fn check_outputs(
    comm: &mut ringtrain_collective::Communicator,
    args: &AllreduceBenchArgs,
) -> Result<(), Box<dyn std::error::Error>> {
    use ringtrain_train::outputs::check_output_file;

    let rank = comm.rank();
    let mut local = Ok(());
    if let (0, Some(path)) = (rank, &args.json) {
        local = check_output_file("--json", path, "allreduce.json");
    }
    if let (0, Ok(()), Some(path)) = (rank, &local, &args.plot) {
        local = check_output_file("--plot", path, "busbw.svg");
    }
    if let (Ok(()), Some(path)) = (&local, &args.timeline) {
        let own = ringtrain_collective::timeline_path_for_rank(path, rank);
        local = check_output_file("--timeline", &own, "timeline.json");
    }
    // A rank that cannot write says why before the collective: once any rank is past
    // it, every failing rank's message is written, so mpirun ending the job when the
    // first rank exits cannot lose it.
    if let Err(e) = &local {
        let line = format!("ringtrain: error: {e}\n");
        let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    }
    let mut failed = [f64::from(u8::from(local.is_err()))];
    comm.all_reduce(&mut failed, &ringtrain_collective::AllReduceOptions::sum())?;
    if failed[0] > 0.0 {
        return Err(format!(
            "{} rank(s) cannot write their output files; see their error messages",
            failed[0]
        )
        .into());
    }
    Ok(())
}

/// Without MPI there is nothing to compare against.
#[cfg(not(feature = "mpi"))]
pub fn run(args: &AllreduceBenchArgs) -> Result<(), Box<dyn std::error::Error>> {
    let _ = args;
    Err("`ringtrain bench allreduce` needs MPI: rebuild with the `mpi` feature (the default) and run it under mpirun".into())
}

#[cfg(feature = "mpi")]
mod measure {
    use std::time::{Duration, Instant};

    use ringtrain_collective::{
        Algorithm, AllReduceOptions, Communicator, Element, FusionConfig, FusionEngine, ReduceOp,
        TensorNames,
    };

    use super::{AllreduceBenchArgs, AllreduceRow, FusionOverheadEntry};

    type BoxResult<T> = Result<T, Box<dyn std::error::Error>>;

    /// The slowest rank's value.
    fn max_over_ranks(comm: &mut Communicator, x: f64) -> BoxResult<f64> {
        let mut v = [x];
        comm.all_reduce(
            &mut v,
            &AllReduceOptions::with_op(ReduceOp::Max).algorithm(Algorithm::RecursiveDoubling),
        )?;
        Ok(v[0])
    }

    /// Small non-negative integers: exact sums in every dtype for up to 64 ranks.
    fn input_value(rank: usize, i: usize) -> f64 {
        ((i + rank) % 3) as f64
    }

    /// One all-reduce: `mpi` out of place (`MPI_Allreduce`, as nccl-tests measures it),
    /// the others in place on `dst`.
    fn run_once<T: Element>(
        comm: &mut Communicator,
        alg: Algorithm,
        src: &[T],
        dst: &mut [T],
    ) -> BoxResult<()> {
        if alg == Algorithm::Mpi {
            comm.native_all_reduce_into(src, dst, ReduceOp::Sum)?;
        } else {
            comm.all_reduce(dst, &AllReduceOptions::sum().algorithm(alg))?;
        }
        Ok(())
    }

    pub(super) fn table<T: Element>(
        comm: &mut Communicator,
        args: &AllreduceBenchArgs,
        algorithms: &[Algorithm],
    ) -> BoxResult<Vec<AllreduceRow>> {
        let (rank, size) = (comm.rank(), comm.size());
        let nodes: Vec<String> = comm.nodes()?.iter().map(|n| n.len().to_string()).collect();
        if rank == 0 {
            println!(
                "# ringtrain all-reduce benchmark: {size} ranks on {} node(s) ({} ranks), transport {}, dtype {}, ring segment {} bytes",
                nodes.len(),
                nodes.join(" + "),
                comm.transport_name(),
                T::NAME,
                comm.segment_bytes()
            );
            println!("# time_us: slowest rank; busbw = algbw * 2(N-1)/N; wrong: elements differing from the exact sum");
            println!(
                "{:>12} {:>11} {:>5} {:>5} {:>12} {:>9} {:>9} {:>6} {:>9}",
                "bytes", "count", "dtype", "alg", "time_us", "algbw", "busbw", "wrong", "vs mpi"
            );
        }
        let max_count = args.max_bytes / T::BYTES;
        let input: Vec<T> = (0..max_count)
            .map(|i| T::from_f64(input_value(rank, i)))
            .collect();
        let expected: Vec<T> = (0..max_count)
            .map(|i| T::from_f64((0..size).map(|r| input_value(r, i)).sum()))
            .collect();
        let mut buf = input.clone();
        let mut rows = Vec::new();
        let mut bytes = args.min_bytes;
        let mut skipped = Vec::new();
        while bytes <= args.max_bytes {
            let count = bytes / T::BYTES;
            if count == 0 {
                // Below one element: nothing to reduce.
                skipped.push(bytes);
                match bytes.checked_mul(args.step_factor as usize) {
                    Some(next) => bytes = next,
                    None => break,
                }
                continue;
            }
            let bytes_exact = count * T::BYTES;
            let iters = args
                .iters
                .unwrap_or_else(|| ((1usize << 30) / bytes_exact).clamp(3, 200));
            // The algorithms take turns in rounds, so that a change in machine load hits
            // them alike.
            let rounds = iters.clamp(1, 4);
            let per_round = iters.div_ceil(rounds);
            let src = &input[..count];
            let dst = &mut buf[..count];
            for &alg in algorithms {
                dst.copy_from_slice(src);
                for _ in 0..args.warmup {
                    run_once(comm, alg, src, dst)?;
                }
            }
            let mut elapsed = vec![0.0f64; algorithms.len()];
            for _ in 0..rounds {
                for (k, &alg) in algorithms.iter().enumerate() {
                    comm.barrier()?;
                    let start = Instant::now();
                    for _ in 0..per_round {
                        run_once(comm, alg, src, dst)?;
                    }
                    elapsed[k] += start.elapsed().as_secs_f64();
                }
            }
            let mut size_rows = Vec::new();
            for (k, &alg) in algorithms.iter().enumerate() {
                let local = elapsed[k] / (rounds * per_round) as f64;
                let secs = max_over_ranks(comm, local)?;
                // Correctness: one more run from the original input, checked exactly.
                dst.copy_from_slice(src);
                run_once(comm, alg, src, dst)?;
                let wrong_here = dst
                    .iter()
                    .zip(&expected[..count])
                    .filter(|(a, b)| a != b)
                    .count();
                let mut wrong = [wrong_here as f64];
                comm.all_reduce(
                    &mut wrong,
                    &AllReduceOptions::sum().algorithm(Algorithm::RecursiveDoubling),
                )?;
                let algbw = bytes_exact as f64 / secs / 1e9;
                let busbw = algbw * 2.0 * (size as f64 - 1.0) / size as f64;
                size_rows.push(AllreduceRow {
                    bytes: bytes_exact,
                    count,
                    dtype: T::NAME.to_string(),
                    algorithm: alg.name().to_string(),
                    time_us: secs * 1e6,
                    algbw,
                    busbw,
                    wrong: wrong[0] as usize,
                });
            }
            // Each algorithm's bus bandwidth over MPI_Allreduce's, from this run.
            let mpi = size_rows
                .iter()
                .find(|r| r.algorithm == Algorithm::Mpi.name())
                .map(|r| r.busbw)
                .filter(|&b| b > 0.0);
            if rank == 0 {
                for r in &size_rows {
                    let ratio_text = match mpi {
                        Some(mpi) if r.algorithm != Algorithm::Mpi.name() => {
                            format!("{:.2}x", r.busbw / mpi)
                        }
                        _ => String::new(),
                    };
                    println!(
                        "{:>12} {:>11} {:>5} {:>5} {:>12.1} {:>9.3} {:>9.3} {:>6} {:>9}",
                        r.bytes,
                        r.count,
                        r.dtype,
                        r.algorithm,
                        r.time_us,
                        r.algbw,
                        r.busbw,
                        r.wrong,
                        ratio_text
                    );
                }
            }
            rows.extend(size_rows);
            match bytes.checked_mul(args.step_factor as usize) {
                Some(next) => bytes = next,
                None => break,
            }
        }
        if rank == 0 && !skipped.is_empty() {
            let list: Vec<String> = skipped.iter().map(|b| b.to_string()).collect();
            println!(
                "# skipped sizes below one {} element ({} bytes): {}",
                T::NAME,
                T::BYTES,
                list.join(", ")
            );
        }
        Ok(rows)
    }

    /// 1000 tensors of 1 KiB per step: per-tensor MPI_Allreduce against tensor fusion.
    pub(super) fn small_tensors(
        mut comm: Communicator,
        args: &AllreduceBenchArgs,
    ) -> BoxResult<Communicator> {
        let (rank, size) = (comm.rank(), comm.size());
        let n = args.small_tensors;
        let len = (args.small_tensor_bytes / 4).max(1);
        let steps = args.small_steps.max(1);
        let warmup = 3;
        let names: Vec<String> = (0..n).map(|i| format!("layer{i}/grad")).collect();
        let mut tensors: Vec<Vec<f32>> = (0..n).map(|_| vec![1.0f32; len]).collect();
        let mut out = vec![0.0f32; len];

        // Baseline: one MPI_Allreduce per tensor, as a framework without fusion does.
        let mut baseline = 0.0;
        for step in 0..warmup + steps {
            comm.barrier()?;
            let start = Instant::now();
            for t in &tensors {
                comm.native_all_reduce_into(t, &mut out, ReduceOp::Sum)?;
            }
            if step >= warmup {
                baseline += start.elapsed().as_secs_f64();
            }
        }
        if out.iter().any(|&x| x != size as f32) {
            return Err("per-tensor MPI_Allreduce gave a wrong sum".into());
        }
        let baseline = max_over_ranks(&mut comm, baseline / steps as f64)?;

        // Fusion: submit every tensor as a backward pass would, then synchronize.
        let config = FusionConfig {
            cycle_time: Duration::from_micros(args.cycle_time_us),
            timeline: args.timeline.clone(),
            ..FusionConfig::default()
        };
        let engine = FusionEngine::start(comm, config)?;
        let mut fused = 0.0;
        let mut wrong = 0usize;
        for step in 0..warmup + steps {
            for t in tensors.iter_mut() {
                t.fill(1.0);
            }
            // Line the ranks up without touching the engine's communicator: each rank's
            // first submission already waits for the others.
            let start = Instant::now();
            let mut handles = Vec::with_capacity(n);
            for (name, t) in names.iter().zip(tensors.drain(..)) {
                handles.push(engine.submit(name, t)?);
            }
            let reduced = engine.synchronize(handles)?;
            if step >= warmup {
                fused += start.elapsed().as_secs_f64();
            }
            for t in reduced {
                let v = t.into_vec::<f32>()?;
                wrong += v.iter().filter(|&&x| x != size as f32).count();
                tensors.push(v);
            }
        }
        let mut comm = engine.shutdown()?;
        let fused = max_over_ranks(&mut comm, fused / steps as f64)?;
        if rank == 0 {
            println!(
                "# many small tensors: {n} x {} bytes f32 per step, {size} ranks, {steps} timed steps, fusion cycle {} us",
                len * 4,
                args.cycle_time_us
            );
            println!("{:>28} {:>14}", "method", "ms per step");
            println!(
                "{:>28} {:>14.3}",
                "per-tensor MPI_Allreduce",
                baseline * 1e3
            );
            println!("{:>28} {:>14.3}", "ringtrain fusion", fused * 1e3);
            println!(
                "{:>28} {:>13.1}x",
                "speedup (baseline/fusion)",
                baseline / fused
            );
        }
        if wrong > 0 {
            return Err(format!("fusion gave {wrong} wrong elements on rank {rank}").into());
        }
        Ok(comm)
    }

    /// The median of `v` (not empty).
    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        let m = v.len() / 2;
        if v.len() % 2 == 1 {
            v[m]
        } else {
            (v[m - 1] + v[m]) / 2.0
        }
    }

    /// For every `--fusion-tensors` x `--fusion-tensor-bytes` case: a fused step of N f32
    /// tensors (submit each and synchronize; then, in steps of their own, one
    /// `all_reduce_group`) against one all-reduce of the same total bytes with the same
    /// options, taking turns step by step; prints the ratio of the medians.
    pub(super) fn fusion_overhead(
        comm: Communicator,
        args: &AllreduceBenchArgs,
    ) -> BoxResult<(Communicator, Vec<FusionOverheadEntry>)> {
        let cases: Vec<(usize, usize)> = args
            .fusion_tensors
            .iter()
            .filter(|&&n| n > 0)
            .flat_map(|&n| args.fusion_tensor_bytes.iter().map(move |&b| (n, b)))
            .collect();
        if cases.is_empty() {
            return Ok((comm, Vec::new()));
        }
        let (rank, size) = (comm.rank(), comm.size());
        let opts = AllReduceOptions::sum();
        // The one all-reduce runs on a duplicate while the engine holds `comm`.
        let mut other = comm.duplicate()?;
        let config = FusionConfig {
            cycle_time: Duration::from_micros(args.cycle_time_us),
            options: opts,
            ..FusionConfig::default()
        };
        let engine = FusionEngine::start(comm, config)?;
        let steps = args.fusion_steps as usize;
        let warmup = 3;
        let mut entries = Vec::with_capacity(cases.len());
        let mut wrong = 0usize;
        if rank == 0 {
            println!(
                "# fusion overhead: a fused step of N f32 tensors (submission `each`: one submit per tensor, then synchronize; `group`: one all_reduce_group, in steps of its own) against one {} all-reduce of the same total bytes taken in turns with each; {size} ranks, {steps} timed steps each, medians of the slowest rank, fusion cycle {} us",
                opts.algorithm, args.cycle_time_us
            );
            println!(
                "{:>8} {:>12} {:>12} {:>10} {:>14} {:>14} {:>16}",
                "tensors",
                "tensor_bytes",
                "total_bytes",
                "submission",
                "allreduce_us",
                "fused_us",
                "fusion_overhead"
            );
        }
        for (n, tensor_bytes) in cases {
            let len = (tensor_bytes / 4).max(1);
            let names: Vec<String> = (0..n)
                .map(|i| format!("overhead/{n}x{tensor_bytes}/{i}"))
                .collect();
            let mut tensors: Vec<Vec<f32>> = (0..n).map(|_| vec![1.0f32; len]).collect();
            let mut flat = vec![1.0f32; n * len];
            let group = TensorNames::new(&names);
            // One way of submitting after the other, each against its own baseline taken
            // in turns with it: a step of one way would end the other's steady state (an
            // engine armed for a cached group reduces it without a round until any other
            // cycle comes).
            for submission in ["each", "group"] {
                let mut fused_times = Vec::with_capacity(steps);
                let mut flat_times = Vec::with_capacity(steps);
                for step in 0..warmup + steps {
                    flat.fill(1.0);
                    other.barrier()?;
                    let start = Instant::now();
                    other.all_reduce(&mut flat, &opts)?;
                    let one = start.elapsed().as_secs_f64();
                    wrong += flat.iter().filter(|&&x| x != size as f32).count();

                    for t in tensors.iter_mut() {
                        t.fill(1.0);
                    }
                    other.barrier()?;
                    let start = Instant::now();
                    let reduced = if submission == "each" {
                        let mut handles = Vec::with_capacity(n);
                        for (name, t) in names.iter().zip(tensors.drain(..)) {
                            handles.push(engine.submit(name, t)?);
                        }
                        engine.synchronize(handles)?
                    } else {
                        engine.all_reduce_group(&group, std::mem::take(&mut tensors))?
                    };
                    let fused = start.elapsed().as_secs_f64();
                    for t in reduced {
                        let v = t.into_vec::<f32>()?;
                        wrong += v.iter().filter(|&&x| x != size as f32).count();
                        tensors.push(v);
                    }
                    if step >= warmup {
                        flat_times.push(one);
                        fused_times.push(fused);
                    }
                }
                let all_reduce = max_over_ranks(&mut other, median(&mut flat_times))?;
                let fused = max_over_ranks(&mut other, median(&mut fused_times))?;
                let ratio = fused / all_reduce;
                if rank == 0 {
                    println!(
                        "{:>8} {:>12} {:>12} {:>10} {:>14.1} {:>14.1} {:>15.2}x",
                        n,
                        len * 4,
                        n * len * 4,
                        submission,
                        all_reduce * 1e6,
                        fused * 1e6,
                        ratio
                    );
                }
                entries.push(FusionOverheadEntry {
                    case: "fusion_overhead",
                    ranks: size,
                    tensors: n,
                    tensor_bytes: len * 4,
                    submission,
                    fused_us: fused * 1e6,
                    all_reduce_us: all_reduce * 1e6,
                    ratio,
                });
            }
        }
        let comm = engine.shutdown()?;
        drop(other);
        if wrong > 0 {
            return Err(format!(
                "the fusion-overhead cases gave {wrong} wrong elements on rank {rank}"
            )
            .into());
        }
        Ok((comm, entries))
    }
}
