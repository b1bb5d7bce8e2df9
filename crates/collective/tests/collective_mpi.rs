//! Multi-rank runs over the MPI transport: the outer tests re-run this test executable
//! under `mpirun -np N` (oversubscribed), selecting one `#[ignore]`d worker test, and
//! check mpirun's exit status and output. A worker asserts its own results and exits
//! non-zero on failure; the outer test kills mpirun after a timeout.
#![cfg(feature = "mpi")]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use half::{bf16, f16};
use ringtrain_collective::{
    Algorithm, AllReduceOptions, Communicator, DType, Element, Error, FusionConfig, FusionEngine,
    GradientPacker, GradientSpec, PackingConfig, ReduceOp, Tensor, TensorMut, TensorNames,
    NODE_ENV,
};

const TIMEOUT: Duration = Duration::from_secs(90);

/// Runs `worker` under `mpirun -np ranks`; returns (success, combined output).
fn mpirun(ranks: usize, worker: &str) -> (bool, String) {
    mpirun_env(ranks, worker, &[])
}

/// [`mpirun`] with extra environment variables for the workers.
fn mpirun_env(ranks: usize, worker: &str, env: &[(&str, &str)]) -> (bool, String) {
    let exe = std::env::current_exe().expect("test executable path");
    let mut child = Command::new("mpirun")
        .arg("-np")
        .arg(ranks.to_string())
        .arg(exe)
        .args([
            "--ignored",
            "--exact",
            worker,
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env("RINGTRAIN_MPI_WORKER", "1")
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun must be installed (Open MPI); see scripts/setup");
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for mpirun") {
            break Some(status);
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = format!(
        "{}\n--- stderr ---\n{}",
        out_thread.join().unwrap_or_default(),
        err_thread.join().unwrap_or_default()
    );
    match status {
        Some(s) => (s.success(), output),
        None => (false, format!("mpirun killed after {TIMEOUT:?}\n{output}")),
    }
}

fn input(rank: usize, i: usize) -> f64 {
    ((i * 5 + rank * 3) % 7) as f64 - 3.0
}

fn exact(op: ReduceOp, size: usize, i: usize) -> f64 {
    let vals = (0..size).map(|r| input(r, i));
    match op {
        ReduceOp::Sum | ReduceOp::Average => vals.sum(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    }
}

/// Checks every rank holds the same bytes.
fn same_on_every_rank(comm: &mut Communicator, bytes: &[u8]) -> Result<bool, Error> {
    let all = comm.all_gather(bytes)?;
    Ok(all.iter().all(|b| b == &all[0]))
}

/// Every algorithm, `MPI_Allreduce` and `auto` included.
const ALGORITHMS: [Algorithm; 9] = [
    Algorithm::Ring,
    Algorithm::RecursiveDoubling,
    Algorithm::HalvingDoubling,
    Algorithm::Direct,
    Algorithm::ScatterGather,
    Algorithm::SharedMemory,
    Algorithm::Hierarchical,
    Algorithm::Auto,
    Algorithm::Mpi,
];

fn check_algorithms<T: Element>(comm: &mut Communicator) -> Result<(), Error> {
    check_these::<T>(comm, &ALGORITHMS)
}

/// Every length and operation with each of `algorithms`: the exact result, the same
/// bits on every rank.
fn check_these<T: Element>(comm: &mut Communicator, algorithms: &[Algorithm]) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for &len in &[0usize, 1, 2, 3, 5, 7, 1009, 4999, 70_001] {
        for op in [
            ReduceOp::Sum,
            ReduceOp::Average,
            ReduceOp::Min,
            ReduceOp::Max,
        ] {
            for &alg in algorithms {
                comm.set_segment_bytes(if len % 2 == 0 { 4096 } else { 256 * 1024 });
                let mut v: Vec<T> = (0..len).map(|i| T::from_f64(input(r, i))).collect();
                let opts = AllReduceOptions::with_op(op).algorithm(alg);
                comm.all_reduce(&mut v, &opts)?;
                let mut want: Vec<T> = (0..len).map(|i| T::from_f64(exact(op, n, i))).collect();
                if op == ReduceOp::Average {
                    T::scale(&mut want, 1.0 / n as f64);
                }
                assert!(
                    v == want,
                    "rank {r}: {} {op} {alg} len {len} differs from the exact result",
                    T::NAME
                );
                let bytes = T::into_tensor(v).as_bytes().to_vec();
                assert!(
                    same_on_every_rank(comm, &bytes)?,
                    "{} {op} {alg} len {len}: ranks differ",
                    T::NAME
                );
            }
        }
    }
    Ok(())
}

/// `all_reduce_pieces` over MPI (several pieces through datatypes, pipeline segments
/// across pieces, pieces copied into one buffer where small) gives the exact result for
/// small integers, and for order-sensitive inputs the bits of `all_reduce` on one buffer,
/// with every algorithm. Each layout is reduced twice, the second time through the
/// layout cache's datatypes.
fn check_pieces<T: Element>(comm: &mut Communicator) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for &len in &[4999usize, 70_001] {
        let large = [0usize, 300, 1, 0, 2000, len - 2301];
        let tiny: Vec<usize> = (0..len).step_by(17).map(|i| 17.min(len - i)).collect();
        for lens in [&large[..], &tiny[..]] {
            for alg in ALGORITHMS {
                comm.set_segment_bytes(if len % 2 == 0 { 256 * 1024 } else { 4096 });
                let opts = AllReduceOptions::sum().algorithm(alg);
                for pass in 0..2 {
                    for small in [true, false] {
                        let value = |i: usize| {
                            if small {
                                input(r, i)
                            } else {
                                order_sensitive_input(r, i)
                            }
                        };
                        let mut owned: Vec<Vec<T>> = Vec::new();
                        let mut at = 0;
                        for &k in lens {
                            owned.push((at..at + k).map(|i| T::from_f64(value(i))).collect());
                            at += k;
                        }
                        let mut pieces: Vec<&mut [T]> =
                            owned.iter_mut().map(|v| v.as_mut_slice()).collect();
                        comm.all_reduce_pieces(&mut pieces, &opts)?;
                        let got = owned.concat();
                        let want: Vec<T> = if small {
                            (0..len)
                                .map(|i| T::from_f64(exact(ReduceOp::Sum, n, i)))
                                .collect()
                        } else {
                            let mut whole: Vec<T> =
                                (0..len).map(|i| T::from_f64(value(i))).collect();
                            comm.all_reduce(&mut whole, &opts)?;
                            whole
                        };
                        assert!(
                            T::into_tensor(got).as_bytes() == T::into_tensor(want).as_bytes(),
                            "rank {r}: {} {alg} len {len} in {} pieces (pass {pass}, small {small}): not the bits of one buffer",
                            T::NAME,
                            lens.len()
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

/// NaN, infinities and finite values at rank `rank`, element `i`. Element 0 is NaN on
/// rank 0 and 0.25 elsewhere (the case `MPI_MIN` used to lose), element 1 the same with
/// the NaN on the last rank.
fn non_finite_input(rank: usize, size: usize, i: usize) -> f64 {
    const VALUES: [f64; 7] = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.25,
        -1.0,
        2.0,
        f64::NAN,
    ];
    match i {
        0 => [f64::NAN, 0.25][usize::from(rank != 0)],
        1 => [f64::NAN, 0.25][usize::from(rank != size - 1)],
        _ => VALUES[(i * 5 + rank * 3) % VALUES.len()],
    }
}

fn non_finite_reference(op: ReduceOp, size: usize, i: usize) -> f64 {
    let vals = (0..size).map(|r| non_finite_input(r, size, i));
    if vals.clone().any(f64::is_nan) {
        return f64::NAN;
    }
    match op {
        ReduceOp::Sum | ReduceOp::Average => {
            vals.sum::<f64>()
                / if op == ReduceOp::Average {
                    size as f64
                } else {
                    1.0
                }
        }
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    }
}

/// Every algorithm, and `native_all_reduce_into`, gives the documented result for NaN
/// and infinities: NaN when any rank has NaN.
fn check_non_finite<T: Element>(comm: &mut Communicator) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for &len in &[2usize, 3, 17, 1000] {
        let input: Vec<T> = (0..len)
            .map(|i| T::from_f64(non_finite_input(r, n, i)))
            .collect();
        for op in [
            ReduceOp::Sum,
            ReduceOp::Average,
            ReduceOp::Min,
            ReduceOp::Max,
        ] {
            let want: Vec<f64> = (0..len).map(|i| non_finite_reference(op, n, i)).collect();
            let check = |what: &str, got: &[T]| {
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let g = g.to_f64();
                    assert!(
                        (g.is_nan() && w.is_nan()) || g == *w,
                        "rank {r}: {} {op} {what} len {len}: element {i} is {g}, expected {w}",
                        T::NAME
                    );
                }
            };
            for alg in ALGORITHMS {
                let mut v = input.clone();
                comm.all_reduce(&mut v, &AllReduceOptions::with_op(op).algorithm(alg))?;
                check(alg.name(), &v);
            }
            let mut out = input.clone();
            comm.native_all_reduce_into(&input, &mut out, op)?;
            check("native_all_reduce_into", &out);
        }
    }
    Ok(())
}

/// Inputs whose sum depends on the order it is taken in: fractions at magnitudes 1e-3
/// to 1e3 of both signs, so that a different grouping rounds differently.
fn order_sensitive_input(rank: usize, i: usize) -> f64 {
    let scale = [1.0, 1000.0, -1000.0, 0.001][(i + rank) % 4];
    ((i * 31 + rank * 17) % 13) as f64 * 0.37 * scale
}

/// The direct, scatter-gather and shared-memory all-reduces give, on every rank, the bits of the sum
/// taken in rank order `((x0 + x1) + x2) ...`, each addition rounded to `T` (IEEE
/// addition of two `T` values, done in f64 and rounded once, which is exact for f32, f16
/// and bf16).
fn check_rank_order<T: Element>(comm: &mut Communicator) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for (algorithm, &len) in [
        Algorithm::Direct,
        Algorithm::ScatterGather,
        Algorithm::SharedMemory,
    ]
    .into_iter()
    .flat_map(|a| [1usize, 7, 1000, 70_001].iter().map(move |len| (a, len)))
    {
        let inputs: Vec<Vec<T>> = (0..n)
            .map(|rank| {
                (0..len)
                    .map(|i| T::from_f64(order_sensitive_input(rank, i)))
                    .collect()
            })
            .collect();
        let want: Vec<T> = (0..len)
            .map(|i| {
                inputs[1..].iter().fold(inputs[0][i], |acc, x| {
                    T::from_f64(acc.to_f64() + x[i].to_f64())
                })
            })
            .collect();
        let mut v = inputs[r].clone();
        comm.all_reduce(&mut v, &AllReduceOptions::sum().algorithm(algorithm))?;
        assert!(
            v == want,
            "rank {r}: {} {algorithm} len {len} is not the sum in rank order",
            T::NAME
        );
    }
    Ok(())
}

#[test]
#[ignore = "MPI worker: run by the mpirun tests below"]
fn mpi_worker_collectives() {
    if std::env::var_os("RINGTRAIN_MPI_WORKER").is_none() {
        return;
    }
    let mut comm = Communicator::mpi().expect("MPI init");
    let (r, n) = (comm.rank(), comm.size());
    // mpirun started every rank on this host: one node, by the host's name.
    assert_eq!(
        comm.nodes().expect("nodes"),
        vec![(0..n).collect::<Vec<_>>()]
    );
    check_algorithms::<f32>(&mut comm).expect("f32");
    check_algorithms::<f64>(&mut comm).expect("f64");
    check_algorithms::<f16>(&mut comm).expect("f16");
    check_algorithms::<bf16>(&mut comm).expect("bf16");
    check_non_finite::<f32>(&mut comm).expect("f32 non-finite");
    check_non_finite::<f64>(&mut comm).expect("f64 non-finite");
    check_non_finite::<f16>(&mut comm).expect("f16 non-finite");
    check_non_finite::<bf16>(&mut comm).expect("bf16 non-finite");
    check_rank_order::<f32>(&mut comm).expect("f32 rank order");
    check_rank_order::<f64>(&mut comm).expect("f64 rank order");
    check_rank_order::<f16>(&mut comm).expect("f16 rank order");
    check_rank_order::<bf16>(&mut comm).expect("bf16 rank order");
    check_pieces::<f32>(&mut comm).expect("f32 pieces");
    check_pieces::<bf16>(&mut comm).expect("bf16 pieces");

    // Broadcast from every root, all-gather with per-rank sizes, reduce-scatter, barrier.
    for root in 0..n {
        let mut b: Vec<f32> = (0..1001)
            .map(|i| if r == root { i as f32 } else { -1.0 })
            .collect();
        comm.broadcast(&mut b, root).expect("broadcast");
        assert!(
            b.iter().enumerate().all(|(i, &x)| x == i as f32),
            "broadcast from {root}"
        );
    }
    let mine: Vec<u64> = (0..r * 3 + 1).map(|i| (r * 100 + i) as u64).collect();
    let all = comm.all_gather(&mine).expect("all_gather");
    for (src, g) in all.iter().enumerate() {
        assert_eq!(
            g,
            &(0..src * 3 + 1)
                .map(|i| (src * 100 + i) as u64)
                .collect::<Vec<_>>()
        );
    }
    let mut rs: Vec<f64> = (0..777).map(|i| input(r, i)).collect();
    let range = comm
        .reduce_scatter(&mut rs, &AllReduceOptions::sum())
        .expect("reduce_scatter");
    for i in range {
        assert_eq!(rs[i], exact(ReduceOp::Sum, n, i));
    }
    comm.barrier().expect("barrier");

    // Gradient packing.
    let specs: Vec<GradientSpec> = (0..9)
        .map(|g| GradientSpec::new(format!("v{g}"), DType::ALL[g % 4], 50 * g + 3))
        .collect();
    let mut packer = GradientPacker::new(
        specs.clone(),
        PackingConfig {
            gradient_repacking: 3,
            agg_small_grads_max_bytes: 400,
            agg_small_grads_max_group: 2,
        },
    )
    .expect("plan");
    let mut grads: Vec<Tensor> = specs
        .iter()
        .map(|s| {
            let mut t = Tensor::zeros(s.dtype, s.len);
            if let Tensor::F32(v) = &mut t {
                v.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = input(r, i) as f32);
            }
            t
        })
        .collect();
    let mut views: Vec<TensorMut<'_>> = grads.iter_mut().map(|t| t.as_tensor_mut()).collect();
    packer
        .all_reduce(&mut comm, &mut views, &AllReduceOptions::sum())
        .expect("packed all-reduce");
    for t in &grads {
        if let Tensor::F32(v) = t {
            assert!(v
                .iter()
                .enumerate()
                .all(|(i, &x)| x as f64 == exact(ReduceOp::Sum, n, i)));
        }
    }

    // Every rank of this mpirun runs on this machine: one node.
    let node = comm.node_rank().expect("node rank");
    assert_eq!((node.rank, node.size), (r, n), "node rank");

    // A duplicate for control messages, used on this thread while the fusion engine's
    // thread reduces on the original: messages must not mix (MPI_THREAD_MULTIPLE).
    let mut control = comm.duplicate().expect("duplicate");

    // Tensor fusion, with ranks submitting in different orders.
    let engine = FusionEngine::start(
        comm,
        FusionConfig {
            threshold_bytes: 8192,
            cycle_time: Duration::from_micros(500),
            ..FusionConfig::default()
        },
    )
    .expect("engine");
    let mut order: Vec<usize> = (0..100).collect();
    if r % 2 == 1 {
        order.reverse();
    }
    let handles: Vec<_> = order
        .iter()
        .map(|&k| {
            let v: Vec<f32> = (0..k * 13 + 1).map(|i| input(r, i) as f32).collect();
            engine.submit(&format!("grad{k}"), v).expect("submit")
        })
        .collect();
    for round in 0..20 {
        let mut v = [input(r, round), -input(r, round)];
        control
            .all_reduce(&mut v, &AllReduceOptions::with_op(ReduceOp::Max))
            .expect("control all-reduce beside the engine");
        assert_eq!(v[0], exact(ReduceOp::Max, n, round));
        assert_eq!(-v[1], exact(ReduceOp::Min, n, round));
    }
    let out = engine.synchronize(handles).expect("synchronize");
    for (&k, t) in order.iter().zip(out) {
        let v = t.into_vec::<f32>().expect("f32");
        assert_eq!(v.len(), k * 13 + 1);
        assert!(
            v.iter()
                .enumerate()
                .all(|(i, &x)| x as f64 == exact(ReduceOp::Sum, n, i)),
            "grad{k}"
        );
    }
    engine.shutdown().expect("shutdown");
    println!("COLLECTIVES-OK rank {r} of {n}");
}

#[test]
#[ignore = "MPI worker: run by the mpirun tests below"]
fn mpi_worker_mismatch() {
    if std::env::var_os("RINGTRAIN_MPI_WORKER").is_none() {
        return;
    }
    let comm = Communicator::mpi().expect("MPI init");
    let (r, n) = (comm.rank(), comm.size());
    // An engine whose fusion threshold differs on the last rank does not start, on any
    // rank, and says which setting differs where.
    let threshold = if r == n - 1 { 4096 } else { 8192 };
    let config = FusionConfig {
        threshold_bytes: threshold,
        ..FusionConfig::default()
    };
    let dup = comm.duplicate().expect("duplicate");
    let Err(err) = FusionEngine::start(dup, config) else {
        panic!("different thresholds must not start");
    };
    let want = format!(
        "threshold_bytes: {} = 8192, rank {} = 4096",
        ranks_before(n - 1),
        n - 1
    );
    assert!(
        matches!(err, Error::SettingsDiffer { .. }) && err.to_string().contains(&want),
        "{err}"
    );
    let engine = FusionEngine::start(comm, FusionConfig::default()).expect("engine");
    let len = if r == n - 1 { 11 } else { 10 };
    let bad = engine
        .submit("embedding/grad", vec![1.0f32; len])
        .expect("submit");
    let good = engine
        .submit("softmax/grad", vec![1.0f32; 5])
        .expect("submit");
    let err = bad.wait().expect_err("a length mismatch must fail");
    let msg = err.to_string();
    assert!(matches!(err, Error::TensorMismatch { .. }), "{msg}");
    assert!(
        msg.contains("embedding/grad") && msg.contains(&format!("rank {}: f32[11]", n - 1)),
        "{msg}"
    );
    let good = good.wait().expect("the agreed tensor still reduces");
    assert_eq!(good.into_vec::<f32>().expect("f32"), vec![n as f32; 5]);
    // A group reduced step after step (from its third step on without a round of its
    // own), then a changed shape on the last rank: the same error on every rank. Small
    // tensors (votes in slots of the fused buffer) and large ones (reduced in place over
    // shared memory, votes in its flags).
    let sum = (n * (n + 1) / 2) as f32;
    for (prefix, w, b) in [("layer", 6, 2), ("large", 4000, 1000)] {
        let group = TensorNames::new([format!("{prefix}/w"), format!("{prefix}/b")]);
        for _ in 0..5 {
            let out = engine
                .all_reduce_group(
                    &group,
                    vec![vec![(r + 1) as f32; w], vec![(r + 1) as f32; b]],
                )
                .expect("group step");
            assert_eq!(out[0].clone().into_vec::<f32>().expect("f32"), vec![sum; w]);
            assert_eq!(out[1].clone().into_vec::<f32>().expect("f32"), vec![sum; b]);
        }
        let b_len = if r == n - 1 { b + 1 } else { b };
        let err = engine
            .all_reduce_group(&group, vec![vec![1.0f32; w], vec![1.0f32; b_len]])
            .expect_err("a changed shape on one rank must fail");
        let group_msg = err.to_string();
        assert!(
            group_msg.contains(&format!("{prefix}/b"))
                && group_msg.contains(&format!("rank {}: f32[{}]", n - 1, b + 1)),
            "{group_msg}"
        );
    }
    engine.shutdown().expect("shutdown");
    println!("MISMATCH-OK rank {r}: {msg}");
}

/// `rank 0` or `ranks 0-K` for the ranks before `last`, as the errors name them.
fn ranks_before(last: usize) -> String {
    match last {
        1 => "rank 0".to_string(),
        _ => format!("ranks 0-{}", last - 1),
    }
}

/// Ranks of one host told by [`NODE_ENV`] that they are on nodes of
/// `RINGTRAIN_TEST_RANKS_PER_NODE` ranks (by rank): the nodes found, and the hierarchical
/// all-reduce across them, exact and the same on every rank, in every dtype.
#[test]
#[ignore = "MPI worker: run by the mpirun tests below"]
fn mpi_worker_nodes() {
    let Some(per_node) = std::env::var("RINGTRAIN_TEST_RANKS_PER_NODE").ok() else {
        return;
    };
    let per_node: usize = per_node.parse().expect("ranks per node");
    let world_rank: usize = std::env::var("OMPI_COMM_WORLD_RANK")
        .expect("started by Open MPI's mpirun")
        .parse()
        .expect("rank");
    // Before MPI starts any thread.
    std::env::set_var(NODE_ENV, format!("node{}", world_rank / per_node));
    let mut comm = Communicator::mpi().expect("MPI init");
    let (r, n) = (comm.rank(), comm.size());
    let want: Vec<Vec<usize>> = (0..n.div_ceil(per_node))
        .map(|j| (j * per_node..((j + 1) * per_node).min(n)).collect())
        .collect();
    assert_eq!(comm.nodes().expect("nodes"), want);
    // Every rank but 0 in a subgroup: its members find their places on their nodes
    // among themselves, while rank 0 takes no part.
    let members: Vec<usize> = if r == 0 { vec![0] } else { (1..n).collect() };
    let sub = comm.subgroup(&members).expect("subgroup");
    if r > 0 {
        let node = sub.node_rank().expect("the subgroup's node rank");
        let first_member = (r / per_node * per_node).max(1);
        let last = ((r / per_node + 1) * per_node).min(n);
        assert_eq!(
            (node.rank, node.size),
            (r - first_member, last - first_member)
        );
    }
    drop(sub);
    let algorithms = [Algorithm::Hierarchical, Algorithm::Auto];
    check_these::<f32>(&mut comm, &algorithms).expect("f32");
    check_these::<f64>(&mut comm, &algorithms).expect("f64");
    check_these::<f16>(&mut comm, &algorithms).expect("f16");
    check_these::<bf16>(&mut comm, &algorithms).expect("bf16");
    println!("NODES-OK rank {r}");
}

/// Two nodes of two ranks, and an uneven layout (two and one), on this host.
#[test]
fn mpirun_hierarchical_all_reduce_over_nodes_of_one_host() {
    for ranks in [4, 3] {
        let (ok, output) = mpirun_env(
            ranks,
            "mpi_worker_nodes",
            &[("RINGTRAIN_TEST_RANKS_PER_NODE", "2")],
        );
        assert!(ok, "mpirun -np {ranks} mpi_worker_nodes failed:\n{output}");
        assert_eq!(output.matches("NODES-OK").count(), ranks, "{output}");
    }
}

fn expect_ok(ranks: usize, worker: &str, marker: &str) {
    let start = Instant::now();
    let (ok, output) = mpirun(ranks, worker);
    assert!(ok, "mpirun -np {ranks} {worker} failed:\n{output}");
    let hits = output.matches(marker).count();
    assert_eq!(
        hits, ranks,
        "expected {ranks} lines with {marker}:\n{output}"
    );
    eprintln!("mpirun -np {ranks} {worker}: {:?}", start.elapsed());
}

#[test]
fn mpirun_collectives_2_ranks() {
    expect_ok(2, "mpi_worker_collectives", "COLLECTIVES-OK");
}

#[test]
fn mpirun_collectives_3_ranks() {
    expect_ok(3, "mpi_worker_collectives", "COLLECTIVES-OK");
}

#[test]
fn mpirun_collectives_4_ranks() {
    expect_ok(4, "mpi_worker_collectives", "COLLECTIVES-OK");
}

#[test]
fn mpirun_mismatch_fails_on_every_rank_in_seconds() {
    for ranks in [2, 3, 4] {
        let start = Instant::now();
        expect_ok(ranks, "mpi_worker_mismatch", "MISMATCH-OK");
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "mismatch took {:?}",
            start.elapsed()
        );
    }
}

/// Stall timeout of the stall test: short, so that the test is quick.
const STALL_TIMEOUT: Duration = Duration::from_secs(4);

#[test]
#[ignore = "MPI worker: run by the mpirun tests below"]
fn mpi_worker_stall() {
    if std::env::var_os("RINGTRAIN_MPI_WORKER").is_none() {
        return;
    }
    let mode = std::env::var("RINGTRAIN_STALL_MODE").expect("mode");
    let pid_dir = std::env::var("RINGTRAIN_STALL_PID_DIR").expect("pid dir");
    let comm = Communicator::mpi().expect("MPI init");
    comm.set_stall_timeout(Some(STALL_TIMEOUT));
    let (r, n) = (comm.rank(), comm.size());
    let stop_here = |step: usize| {
        if r == n - 1 && step == 5 {
            // Leave the pid for the test to kill, then stop this whole process, as a
            // stopped or stuck rank would.
            let pid = std::process::id().to_string();
            std::fs::write(format!("{pid_dir}/rank{r}.pid"), &pid).expect("pid file");
            let _ = Command::new("kill").args(["-STOP", &pid]).status();
        }
    };
    match mode.as_str() {
        "fusion" => {
            let engine = FusionEngine::start(comm, FusionConfig::default()).expect("engine");
            for step in 0.. {
                stop_here(step);
                let h = engine.submit("grad", vec![1.0f32; 1000]).expect("submit");
                h.wait().expect("reduce");
            }
        }
        _ => {
            let mut comm = comm;
            let alg: Algorithm = mode.parse().expect("algorithm");
            for step in 0.. {
                stop_here(step);
                comm.set_stall_context(format!("step {step}"));
                let mut v = vec![1.0f32; 1000];
                comm.all_reduce(&mut v, &AllReduceOptions::sum().algorithm(alg))
                    .expect("all-reduce");
            }
        }
    }
}

/// A rank stopped with SIGSTOP: every other rank reports it within the stall timeout
/// and the job ends with a failure, whichever algorithm waits for it.
#[test]
fn mpirun_stopped_rank_aborts_the_job_naming_it() {
    for (ranks, mode) in [
        (2, "ring"),
        (3, "rd"),
        (3, "direct"),
        (3, "sg"),
        (2, "mpi"),
        (3, "fusion"),
    ] {
        let dir = tempfile::tempdir().expect("tempdir");
        let dir_text = dir.path().display().to_string();
        let start = Instant::now();
        let (ok, output) = mpirun_env(
            ranks,
            "mpi_worker_stall",
            &[
                ("RINGTRAIN_STALL_MODE", mode),
                ("RINGTRAIN_STALL_PID_DIR", &dir_text),
            ],
        );
        let took = start.elapsed();
        // Whatever happened, leave no stopped process behind.
        if let Ok(pid) = std::fs::read_to_string(dir.path().join(format!("rank{}.pid", ranks - 1)))
        {
            let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
        }
        assert!(!ok, "{mode} at {ranks} ranks: mpirun succeeded:\n{output}");
        assert!(
            took < STALL_TIMEOUT + Duration::from_secs(30),
            "{mode} at {ranks} ranks: took {took:?}:\n{output}"
        );
        assert!(
            output.contains("stalled for") && output.contains("aborting the job"),
            "{mode} at {ranks} ranks: no stall error:\n{output}"
        );
        assert!(
            output.contains("WARNING: no progress for"),
            "{mode} at {ranks} ranks: no warning at half the timeout:\n{output}"
        );
        let stopped = format!("rank {}", ranks - 1);
        if mode == "mpi" {
            assert!(output.contains("MPI does not say which"), "{output}");
        } else {
            assert!(
                output.contains(&format!("waiting for {stopped}")),
                "{mode} at {ranks} ranks: the stopped {stopped} is not named:\n{output}"
            );
        }
    }
}
