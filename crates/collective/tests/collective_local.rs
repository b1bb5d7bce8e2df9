//! Property tests of the collectives over the local (threads) transport: every rank count
//! 1–9, lengths 0–5000 (primes included), every dtype and op, algorithms, packing and
//! fusion settings. Inputs are small integers so the exact result is representable in
//! every dtype; results are checked against it and for identical bits on every rank.

use std::time::Duration;

use half::{bf16, f16};
use proptest::prelude::*;
use ringtrain_collective::{
    ring_chunk_range, Algorithm, AllReduceOptions, Communicator, DType, Element, Error,
    ExternalTensor, FusionConfig, FusionEngine, GradientPacker, GradientSpec, PackingConfig,
    ReduceOp, Tensor, TensorMut, TensorNames, WireCompression,
};

/// Small integer input of rank `rank` at element `i`: in [-3, 3].
fn input(rank: usize, i: usize, salt: usize) -> f64 {
    ((i * 7 + rank * 5 + salt * 3) % 7) as f64 - 3.0
}

fn exact(op: ReduceOp, size: usize, i: usize, salt: usize) -> f64 {
    let vals = (0..size).map(|r| input(r, i, salt));
    match op {
        ReduceOp::Sum | ReduceOp::Average => vals.sum(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    }
}

/// Expected result in `T`: the exact value, scaled the way the library scales (through the
/// kernels), so Average is compared bit for bit too.
fn expected<T: Element>(opts: &AllReduceOptions, size: usize, len: usize, salt: usize) -> Vec<T> {
    let mut v: Vec<T> = (0..len)
        .map(|i| T::from_f64(exact(opts.op, size, i, salt) * opts.prescale))
        .collect();
    let post = if opts.op == ReduceOp::Average {
        opts.postscale / size as f64
    } else {
        opts.postscale
    };
    if post != 1.0 {
        T::scale(&mut v, post);
    }
    v
}

/// An input with NaN and infinities among small exact values, at rank `rank` and
/// element `i`: about one element in six of each rank is NaN or infinite.
fn non_finite_input(rank: usize, i: usize, salt: usize) -> f64 {
    const VALUES: [f64; 17] = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.25,
        -1.0,
        2.0,
        0.5,
        -0.25,
        3.0,
        -2.0,
        1.0,
        0.75,
        -0.5,
        1.5,
        -3.0,
        0.125,
        4.0,
    ];
    VALUES[(i * 7 + rank * 13 + salt * 11) % VALUES.len()]
}

/// The documented result for one element: NaN when any input is NaN (and for a sum of
/// +inf and -inf), else the exact sum, minimum or maximum.
fn non_finite_reference(op: ReduceOp, vals: impl Iterator<Item = f64> + Clone) -> f64 {
    if vals.clone().any(f64::is_nan) {
        return f64::NAN;
    }
    match op {
        ReduceOp::Sum | ReduceOp::Average => vals.sum(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    }
}

/// Equal values, or NaN on both sides (NaN payloads may differ between algorithms).
fn same_value<T: Element>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            let (x, y) = (x.to_f64(), y.to_f64());
            (x.is_nan() && y.is_nan()) || x == y
        })
}

fn check_non_finite<T: Element>(
    size: usize,
    nodes: usize,
    len: usize,
    op: ReduceOp,
    algorithm: Algorithm,
    segment: usize,
    salt: usize,
) -> Result<(), TestCaseError> {
    let opts = AllReduceOptions::with_op(op).algorithm(algorithm);
    let outs = Communicator::run_local_on_nodes(&layout(size, nodes), |mut comm| {
        comm.set_segment_bytes(segment);
        let r = comm.rank();
        let mut v: Vec<T> = (0..len)
            .map(|i| T::from_f64(non_finite_input(r, i, salt)))
            .collect();
        comm.all_reduce(&mut v, &opts).map(|_| v)
    })
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut want: Vec<T> = (0..len)
        .map(|i| {
            T::from_f64(non_finite_reference(
                op,
                (0..size).map(|r| non_finite_input(r, i, salt)),
            ))
        })
        .collect();
    if op == ReduceOp::Average {
        T::scale(&mut want, 1.0 / size as f64);
    }
    let first = outs[0]
        .as_ref()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (rank, out) in outs.iter().enumerate() {
        let out = out
            .as_ref()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(bits(out), bits(first), "rank {} differs from rank 0", rank);
    }
    prop_assert!(
        same_value(first, &want),
        "{} {} {} size {} len {}: {:?} instead of {:?}",
        T::NAME,
        op,
        algorithm,
        size,
        len,
        first,
        want
    );
    Ok(())
}

/// `size` ranks spread over `nodes` nodes (at most one per rank), the first nodes taking
/// one more where they do not divide evenly: `layout(5, 2)` is `[3, 2]`.
fn layout(size: usize, nodes: usize) -> Vec<usize> {
    let nodes = nodes.clamp(1, size.max(1));
    (0..nodes)
        .map(|j| ring_chunk_range(size, nodes, j).len())
        .collect()
}

fn bits<T: Element>(v: &[T]) -> Vec<u8> {
    T::into_tensor(v.to_vec()).as_bytes().to_vec()
}

fn check_all_reduce<T: Element>(
    size: usize,
    nodes: usize,
    len: usize,
    opts: AllReduceOptions,
    segment: usize,
    salt: usize,
) -> Result<(), TestCaseError> {
    let outs = Communicator::run_local_on_nodes(&layout(size, nodes), |mut comm| {
        comm.set_segment_bytes(segment);
        let r = comm.rank();
        let mut v: Vec<T> = (0..len).map(|i| T::from_f64(input(r, i, salt))).collect();
        comm.all_reduce(&mut v, &opts).map(|_| v)
    })
    .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let want = expected::<T>(&opts, size, len, salt);
    let first = outs[0]
        .as_ref()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    for (rank, out) in outs.iter().enumerate() {
        let out = out
            .as_ref()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(bits(out), bits(first), "rank {} differs from rank 0", rank);
    }
    prop_assert_eq!(
        bits(first),
        bits(&want),
        "{} {:?} size {} len {}",
        T::NAME,
        opts,
        size,
        len
    );
    Ok(())
}

/// The pieces `cuts` (element offsets, any order, any value) make of `len` elements, or
/// pieces of 7 elements when `tiny` (small enough to be copied into one buffer).
fn piece_lengths(len: usize, cuts: &[usize], tiny: bool) -> Vec<usize> {
    if tiny {
        let mut lens = vec![7; len / 7];
        lens.push(len % 7);
        return lens;
    }
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (len + 1)).collect();
    at.push(0);
    at.push(len);
    at.sort_unstable();
    at.windows(2).map(|w| w[1] - w[0]).collect()
}

/// `all_reduce_pieces` over pieces of `lens` gives every rank the exact result for small
/// integers, and for inputs whose sums depend on their order the bits `all_reduce` gives
/// the same elements in one buffer, with the same options and segment size.
fn check_pieces<T: Element>(
    size: usize,
    nodes: usize,
    lens: &[usize],
    opts: AllReduceOptions,
    segment: usize,
    salt: usize,
) -> Result<(), TestCaseError> {
    let len: usize = lens.iter().sum();
    let split = |input: &[T]| -> Vec<Vec<T>> {
        let mut at = 0;
        lens.iter()
            .map(|&n| {
                at += n;
                input[at - n..at].to_vec()
            })
            .collect()
    };
    let outs =
        Communicator::run_local_on_nodes(&layout(size, nodes), |mut comm| -> Result<_, Error> {
            comm.set_segment_bytes(segment);
            let r = comm.rank();
            let mut reduce = |input: &[T]| -> Result<Vec<T>, Error> {
                let mut owned = split(input);
                let mut pieces: Vec<&mut [T]> =
                    owned.iter_mut().map(|v| v.as_mut_slice()).collect();
                comm.all_reduce_pieces(&mut pieces, &opts)?;
                Ok(owned.concat())
            };
            let small: Vec<T> = (0..len).map(|i| T::from_f64(input(r, i, salt))).collect();
            let small = reduce(&small)?;
            let odd: Vec<T> = (0..len)
                .map(|i| T::from_f64(order_sensitive_input(r, i + salt)))
                .collect();
            let joined = reduce(&odd)?;
            let mut whole = odd;
            comm.all_reduce(&mut whole, &opts)?;
            Ok((small, joined, whole))
        })
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let want = expected::<T>(&opts, size, len, salt);
    for (rank, out) in outs.into_iter().enumerate() {
        let (small, joined, whole) = out.map_err(|e| TestCaseError::fail(e.to_string()))?;
        let case = format!("rank {rank}: {} {opts:?}, pieces {lens:?}", T::NAME);
        prop_assert_eq!(bits(&small), bits(&want), "{}: not the exact result", &case);
        prop_assert_eq!(
            bits(&joined),
            bits(&whole),
            "{}: not one buffer's bits",
            &case
        );
    }
    Ok(())
}

fn ops() -> impl Strategy<Value = ReduceOp> {
    prop_oneof![
        Just(ReduceOp::Sum),
        Just(ReduceOp::Average),
        Just(ReduceOp::Min),
        Just(ReduceOp::Max)
    ]
}

fn algorithms() -> impl Strategy<Value = Algorithm> {
    prop_oneof![
        Just(Algorithm::Ring),
        Just(Algorithm::RecursiveDoubling),
        Just(Algorithm::HalvingDoubling),
        Just(Algorithm::Direct),
        Just(Algorithm::ScatterGather),
        Just(Algorithm::SharedMemory),
        Just(Algorithm::Hierarchical),
        Just(Algorithm::Auto)
    ]
}

const PRIMES: [usize; 8] = [2, 3, 5, 7, 997, 1009, 2999, 4999];

fn lengths() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..12,
        0usize..=5000,
        proptest::sample::select(PRIMES.to_vec())
    ]
}

/// Cases per property: `PROPTEST_CASES` when set (a long soak), else `quick`, this
/// file's default, sized for CI.
fn cases(quick: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(quick)
}

/// `PROPTEST_CASES` sets the number of cases (checked in a child process, so the
/// variable never changes under other tests running in this one).
#[test]
fn proptest_cases_follows_the_environment() {
    if let Ok(expected) = std::env::var("RINGTRAIN_EXPECT_CASES") {
        let runs = std::cell::Cell::new(0u32);
        let mut runner =
            proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(cases(5)));
        runner
            .run(&(0u32..10), |_| {
                runs.set(runs.get() + 1);
                Ok(())
            })
            .expect("the property holds");
        assert_eq!(runs.get().to_string(), expected, "cases run");
        return;
    }
    for (env, expected) in [(Some("3"), "3"), (None, "5")] {
        let mut child =
            std::process::Command::new(std::env::current_exe().expect("test executable"));
        child
            .args([
                "--exact",
                "proptest_cases_follows_the_environment",
                "--test-threads",
                "1",
            ])
            .env("RINGTRAIN_EXPECT_CASES", expected)
            .env_remove("PROPTEST_CASES");
        if let Some(v) = env {
            child.env("PROPTEST_CASES", v);
        }
        let out = child.output().expect("the test executable runs");
        assert!(
            out.status.success(),
            "PROPTEST_CASES={env:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(64)))]

    #[test]
    fn all_reduce_is_exact_and_identical_on_every_rank(
        size in 1usize..=9,
        nodes in 1usize..=3,
        len in lengths(),
        dtype in proptest::sample::select(DType::ALL.to_vec()),
        op in ops(),
        algorithm in algorithms(),
        segment in prop_oneof![Just(8usize), 16usize..2048, Just(256 * 1024)],
        prescale in prop_oneof![Just(1.0f64), Just(2.0)],
        postscale in prop_oneof![Just(1.0f64), Just(0.5)],
        salt in 0usize..7,
    ) {
        let opts = AllReduceOptions { op, algorithm, prescale, postscale, compression: WireCompression::None };
        match dtype {
            DType::F32 => check_all_reduce::<f32>(size, nodes, len, opts, segment, salt)?,
            DType::F64 => check_all_reduce::<f64>(size, nodes, len, opts, segment, salt)?,
            DType::F16 => check_all_reduce::<f16>(size, nodes, len, opts, segment, salt)?,
            DType::BF16 => check_all_reduce::<bf16>(size, nodes, len, opts, segment, salt)?,
        }
    }

    #[test]
    fn nan_and_infinities_give_the_documented_result_with_every_algorithm(
        size in 1usize..=9,
        nodes in 1usize..=3,
        len in lengths(),
        dtype in proptest::sample::select(DType::ALL.to_vec()),
        op in ops(),
        algorithm in algorithms(),
        segment in prop_oneof![Just(8usize), 16usize..2048, Just(256 * 1024)],
        salt in 0usize..17,
    ) {
        match dtype {
            DType::F32 => check_non_finite::<f32>(size, nodes, len, op, algorithm, segment, salt)?,
            DType::F64 => check_non_finite::<f64>(size, nodes, len, op, algorithm, segment, salt)?,
            DType::F16 => check_non_finite::<f16>(size, nodes, len, op, algorithm, segment, salt)?,
            DType::BF16 => check_non_finite::<bf16>(size, nodes, len, op, algorithm, segment, salt)?,
        }
    }

    #[test]
    fn all_reduce_in_pieces_gives_the_bits_of_one_buffer(
        size in 1usize..=6,
        nodes in 1usize..=3,
        len in lengths(),
        cuts in proptest::collection::vec(0usize..=5000, 0..8),
        tiny in proptest::bool::weighted(0.2),
        dtype in proptest::sample::select(DType::ALL.to_vec()),
        op in ops(),
        algorithm in algorithms(),
        segment in prop_oneof![Just(8usize), 16usize..2048, Just(256 * 1024)],
        prescale in prop_oneof![Just(1.0f64), Just(2.0)],
        postscale in prop_oneof![Just(1.0f64), Just(0.5)],
        compression in prop_oneof![
            3 => Just(WireCompression::None),
            1 => Just(WireCompression::F16),
            1 => Just(WireCompression::Bf16)
        ],
        salt in 0usize..7,
    ) {
        let lens = piece_lengths(len, &cuts, tiny);
        let opts = AllReduceOptions { op, algorithm, prescale, postscale, compression };
        match dtype {
            DType::F32 => check_pieces::<f32>(size, nodes, &lens, opts, segment, salt)?,
            DType::F64 => check_pieces::<f64>(size, nodes, &lens, opts, segment, salt)?,
            DType::F16 => check_pieces::<f16>(size, nodes, &lens, opts, segment, salt)?,
            DType::BF16 => check_pieces::<bf16>(size, nodes, &lens, opts, segment, salt)?,
        }
    }

    #[test]
    fn wire_compression_of_f32_is_exact_for_small_integers(
        size in 1usize..=9,
        len in lengths(),
        op in ops(),
        compression in prop_oneof![Just(WireCompression::F16), Just(WireCompression::Bf16)],
        salt in 0usize..7,
    ) {
        let opts = AllReduceOptions { op, compression, ..AllReduceOptions::default() };
        check_all_reduce::<f32>(size, 1, len, opts, 1024, salt)?;
    }

    #[test]
    fn broadcast_all_gather_reduce_scatter_and_barrier(
        size in 1usize..=9,
        len in lengths(),
        root_pick in 0usize..9,
        gather_lens in proptest::collection::vec(0usize..300, 9),
    ) {
        let root = root_pick % size;
        let outs = Communicator::run_local(size, |mut comm| -> Result<_, Error> {
            let r = comm.rank();
            let mut b: Vec<f64> = (0..len).map(|i| if r == root { i as f64 } else { -1.0 }).collect();
            comm.broadcast(&mut b, root)?;
            let mine: Vec<u32> = (0..gather_lens[r]).map(|i| (r * 1000 + i) as u32).collect();
            let gathered = comm.all_gather(&mine)?;
            let mut rs: Vec<f32> = (0..len).map(|i| input(r, i, 0) as f32).collect();
            let range = comm.reduce_scatter(&mut rs, &AllReduceOptions::sum())?;
            comm.barrier()?;
            Ok((b, gathered, rs[range.clone()].to_vec(), range))
        }).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (rank, out) in outs.into_iter().enumerate() {
            let (b, gathered, chunk, range) = out.map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(b.iter().enumerate().all(|(i, &x)| x == i as f64));
            prop_assert_eq!(gathered.len(), size);
            for (src, g) in gathered.iter().enumerate() {
                let want: Vec<u32> = (0..gather_lens[src]).map(|i| (src * 1000 + i) as u32).collect();
                prop_assert_eq!(g, &want);
            }
            prop_assert_eq!(range.clone(), ring_chunk_range(len, size, rank));
            for (k, &x) in chunk.iter().enumerate() {
                prop_assert_eq!(x as f64, exact(ReduceOp::Sum, size, range.start + k, 0));
            }
        }
    }

    #[test]
    fn gradient_packing_reduces_every_gradient_exactly(
        size in 1usize..=6,
        grads in proptest::collection::vec((proptest::sample::select(DType::ALL.to_vec()), 0usize..400), 1..14),
        repacking in 0usize..6,
        agg_bytes in prop_oneof![Just(0usize), 1usize..1024],
        agg_group in 1usize..6,
    ) {
        let specs: Vec<GradientSpec> = grads.iter().enumerate()
            .map(|(i, &(d, l))| GradientSpec::new(format!("v{i}"), d, l)).collect();
        let config = PackingConfig {
            gradient_repacking: repacking,
            agg_small_grads_max_bytes: agg_bytes,
            agg_small_grads_max_group: agg_group,
        };
        // Every element of every gradient appears in exactly one unit.
        let plan = GradientPacker::new(specs.clone(), config).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut covered: Vec<Vec<u8>> = specs.iter().map(|s| vec![0; s.len]).collect();
        for u in plan.units() {
            if agg_bytes > 0 && u.pieces.len() > 1 && repacking == 0 {
                prop_assert!(u.pieces.len() <= agg_group);
            }
            for p in &u.pieces {
                prop_assert_eq!(specs[p.grad].dtype, u.dtype);
                for c in &mut covered[p.grad][p.offset..p.offset + p.len] { *c += 1; }
            }
        }
        prop_assert!(covered.iter().flatten().all(|&c| c == 1));

        let outs = Communicator::run_local(size, |mut comm| -> Result<Vec<Tensor>, Error> {
            let r = comm.rank();
            let mut packer = GradientPacker::new(specs.clone(), config)?;
            let mut tensors: Vec<Tensor> = specs.iter().enumerate().map(|(g, s)| {
                let mut t = Tensor::zeros(s.dtype, s.len);
                fill(&mut t, r, g);
                t
            }).collect();
            // Twice: the plan and its buffer are reused.
            for _ in 0..2 {
                for (g, t) in tensors.iter_mut().enumerate() { fill(t, r, g); }
                let mut views: Vec<TensorMut<'_>> = tensors.iter_mut().map(|t| t.as_tensor_mut()).collect();
                packer.all_reduce(&mut comm, &mut views, &AllReduceOptions::sum())?;
            }
            Ok(tensors)
        }).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for out in outs {
            let tensors = out.map_err(|e| TestCaseError::fail(e.to_string()))?;
            for (g, t) in tensors.into_iter().enumerate() {
                let mut want = Tensor::zeros(t.dtype(), t.len());
                fill_expected(&mut want, size, g);
                prop_assert_eq!(t.as_bytes(), want.as_bytes(), "gradient {}", g);
            }
        }
    }
}

/// The packer reduces each unit where its pieces lie in the gradients, with the bits of
/// the definition (the unit's pieces concatenated, all-reduced as one buffer, split back)
/// for inputs whose sums depend on their order: gradients large enough to be reduced in
/// place, packs that cut through them, and small gradients and packs aggregated (packs of
/// one gradient aggregated together make one piece of it), with each algorithm.
#[test]
fn gradient_packing_gives_the_bits_of_concatenating_reducing_and_splitting() {
    let lens = [5000usize, 3, 7000, 40, 2, 9000];
    let specs: Vec<GradientSpec> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| GradientSpec::new(format!("v{i}"), DType::F32, l))
        .collect();
    for (repacking, agg_bytes) in [(0, 0), (4, 0), (0, 256), (40, 4096)] {
        let config = PackingConfig {
            gradient_repacking: repacking,
            agg_small_grads_max_bytes: agg_bytes,
            agg_small_grads_max_group: 4,
        };
        for algorithm in [
            Algorithm::Ring,
            Algorithm::HalvingDoubling,
            Algorithm::ScatterGather,
            Algorithm::Direct,
            Algorithm::SharedMemory,
            Algorithm::Auto,
        ] {
            let opts = AllReduceOptions::sum().algorithm(algorithm);
            let outs = Communicator::run_local(3, |mut comm| -> Result<_, Error> {
                let r = comm.rank();
                let mut packer = GradientPacker::new(specs.clone(), config)?;
                let grads: Vec<Vec<f32>> = lens
                    .iter()
                    .enumerate()
                    .map(|(g, &l)| {
                        (0..l)
                            .map(|i| order_sensitive_input(r, i + 10_000 * g) as f32)
                            .collect()
                    })
                    .collect();
                let mut want = grads.clone();
                for unit in packer.units() {
                    let mut joined: Vec<f32> = unit
                        .pieces
                        .iter()
                        .flat_map(|p| want[p.grad][p.offset..p.offset + p.len].to_vec())
                        .collect();
                    comm.all_reduce(&mut joined, &opts)?;
                    let mut at = 0;
                    for p in &unit.pieces {
                        want[p.grad][p.offset..p.offset + p.len]
                            .copy_from_slice(&joined[at..at + p.len]);
                        at += p.len;
                    }
                }
                let mut got = grads;
                let mut views: Vec<TensorMut<'_>> = got
                    .iter_mut()
                    .map(|g| TensorMut::from(&mut g[..]))
                    .collect();
                packer.all_reduce(&mut comm, &mut views, &opts)?;
                let merged = packer
                    .units()
                    .iter()
                    .any(|u| u.pieces.windows(2).any(|w| w[0].grad == w[1].grad));
                Ok((got, want, merged))
            })
            .expect("run");
            for (rank, out) in outs.into_iter().enumerate() {
                let (got, want, merged) = out.expect("rank");
                if repacking == 40 {
                    assert!(merged, "packs of one gradient were aggregated together");
                }
                for (g, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        bits(a),
                        bits(b),
                        "rank {rank}, gradient {g}, {algorithm}, repacking {repacking}, agg {agg_bytes}"
                    );
                }
            }
        }
    }
}

fn fill(t: &mut Tensor, rank: usize, salt: usize) {
    match t {
        Tensor::F32(v) => v
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = input(rank, i, salt) as f32),
        Tensor::F64(v) => v
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = input(rank, i, salt)),
        Tensor::F16(v) => v
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = f16::from_f64(input(rank, i, salt))),
        Tensor::BF16(v) => v
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = bf16::from_f64(input(rank, i, salt))),
    }
}

fn fill_expected(t: &mut Tensor, size: usize, salt: usize) {
    let e = |i: usize| exact(ReduceOp::Sum, size, i, salt);
    match t {
        Tensor::F32(v) => v.iter_mut().enumerate().for_each(|(i, x)| *x = e(i) as f32),
        Tensor::F64(v) => v.iter_mut().enumerate().for_each(|(i, x)| *x = e(i)),
        Tensor::F16(v) => v
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = f16::from_f64(e(i))),
        Tensor::BF16(v) => v
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = bf16::from_f64(e(i))),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(24)))]

    #[test]
    fn fusion_reduces_every_tensor_in_any_submission_order(
        size in 1usize..=5,
        tensors in proptest::collection::vec((proptest::sample::select(DType::ALL.to_vec()), 0usize..600), 1..40),
        threshold in prop_oneof![Just(1usize), 64usize..4096, Just(64 << 20)],
        op in prop_oneof![Just(ReduceOp::Sum), Just(ReduceOp::Max)],
        seed in 0u64..1000,
    ) {
        let config = FusionConfig {
            threshold_bytes: threshold,
            cycle_time: Duration::from_micros(200),
            options: AllReduceOptions::with_op(op),
            ..FusionConfig::default()
        };
        let outs = Communicator::run_local(size, |comm| -> Result<Vec<(usize, Tensor)>, Error> {
            let r = comm.rank();
            let engine = FusionEngine::start(comm, config.clone())?;
            // Each rank submits in its own order.
            let mut order: Vec<usize> = (0..tensors.len()).collect();
            let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(r as u64 + 1);
            for i in (1..order.len()).rev() {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                order.swap(i, (state >> 33) as usize % (i + 1));
            }
            // Two steps with the same names: the second announces them by id.
            let mut out = Vec::new();
            for _step in 0..2 {
                let mut handles = Vec::new();
                for &g in &order {
                    let (d, l) = tensors[g];
                    let mut t = Tensor::zeros(d, l);
                    fill(&mut t, r, g);
                    handles.push(engine.submit(&format!("t{g}"), t)?);
                }
                out = engine.synchronize(handles)?;
            }
            engine.shutdown()?;
            Ok(order.into_iter().zip(out).collect())
        }).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for out in outs {
            for (g, t) in out.map_err(|e| TestCaseError::fail(e.to_string()))? {
                let mut want = Tensor::zeros(t.dtype(), t.len());
                let e = |i: usize| exact(op, size, i, g);
                match &mut want {
                    Tensor::F32(v) => v.iter_mut().enumerate().for_each(|(i, x)| *x = e(i) as f32),
                    Tensor::F64(v) => v.iter_mut().enumerate().for_each(|(i, x)| *x = e(i)),
                    Tensor::F16(v) => v.iter_mut().enumerate().for_each(|(i, x)| *x = f16::from_f64(e(i))),
                    Tensor::BF16(v) => v.iter_mut().enumerate().for_each(|(i, x)| *x = bf16::from_f64(e(i))),
                }
                prop_assert_eq!(t.as_bytes(), want.as_bytes(), "tensor t{}", g);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(12)))]

    /// Duplicates (taken in the same order on every rank, possibly of duplicates) carry
    /// their own messages: a control all-reduce on a duplicate while the fusion engine
    /// reduces on the original, from another thread, gets exact results on both.
    #[test]
    fn duplicates_carry_their_own_messages_beside_the_fusion_engine(
        size in 1usize..6,
        nested in any::<bool>(),
        len in 1usize..300,
    ) {
        let outs = Communicator::run_local(size, |comm| {
            let r = comm.rank();
            let node = comm.node_rank()?;
            assert_eq!((node.rank, node.size), (r, size));
            let first = comm.duplicate()?;
            let mut control = if nested { first.duplicate()? } else { first };
            let engine = FusionEngine::start(comm, FusionConfig::default())?;
            let handle = engine.submit("g", vec![(r + 1) as f32; len])?;
            let mut v = [r as f64, -(r as f64), 1.0];
            control.all_reduce(&mut v, &AllReduceOptions::with_op(ReduceOp::Max))?;
            let reduced = handle.wait()?.into_vec::<f32>()?;
            engine.shutdown()?;
            Ok::<_, Error>((v, reduced))
        })
        .expect("run");
        let sum = (size * (size + 1) / 2) as f32;
        for out in outs {
            let (v, reduced) = out.expect("rank");
            prop_assert_eq!(v, [(size - 1) as f64, 0.0, 1.0]);
            prop_assert!(reduced.iter().all(|&x| x == sum));
        }
    }
}

/// A subgroup's node rank counts its own members on the node, and only they take part:
/// ranks 1-3 of two nodes of two ranks are rank 0 of one node and ranks 0 and 1 of the
/// other.
#[test]
fn a_subgroup_s_node_rank_counts_its_members_on_the_node() {
    let outs = Communicator::run_local_on_nodes(&[2, 2], |comm| {
        let r = comm.rank();
        let members: Vec<usize> = if r == 0 { vec![0] } else { vec![1, 2, 3] };
        let sub = comm.subgroup(&members)?;
        if r == 0 {
            return Ok::<_, Error>(None);
        }
        let node = sub.node_rank()?;
        Ok(Some((node.rank, node.size)))
    })
    .expect("run");
    let got: Vec<Option<(usize, usize)>> = outs.into_iter().map(|o| o.expect("rank")).collect();
    assert_eq!(got, [None, Some((0, 1)), Some((0, 2)), Some((1, 2))]);
}

#[test]
fn fusion_mismatch_is_an_error_on_every_rank() {
    let outs = Communicator::run_local(3, |comm| {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default()).expect("start");
        let len = if r == 2 { 11 } else { 10 };
        let bad = engine
            .submit("decoder/w", vec![1.0f32; len])
            .expect("submit");
        let good = engine.submit("decoder/b", vec![1.0f32; 4]).expect("submit");
        let bad = bad.wait();
        let good = good.wait();
        engine.shutdown().expect("shutdown");
        (bad, good)
    })
    .expect("run");
    for (bad, good) in outs {
        let msg = bad.expect_err("mismatch must fail").to_string();
        assert!(msg.contains("decoder/w"), "{msg}");
        assert!(
            msg.contains("rank 0: f32[10]") && msg.contains("rank 2: f32[11]"),
            "{msg}"
        );
        assert_eq!(
            good.expect("good tensor").into_vec::<f32>().expect("f32"),
            vec![3.0; 4]
        );
    }
}

#[test]
fn fusion_stall_becomes_an_error_naming_the_missing_ranks() {
    let config = FusionConfig {
        stall_warning: Duration::from_millis(100),
        stall_error: Duration::from_millis(100),
        ..FusionConfig::default()
    };
    let outs = Communicator::run_local(3, |comm| {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, config.clone()).expect("start");
        let lonely = (r == 0).then(|| {
            engine
                .submit("only/on/rank0", vec![1.0f64; 3])
                .expect("submit")
        });
        let result = match lonely {
            Some(h) => h.wait().map(|_| ()),
            None => {
                // The other ranks learn of it through synchronize once it has failed.
                let mut seen = None;
                for _ in 0..200 {
                    if let Some(e) = engine.take_foreign_failure() {
                        seen = Some(e);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                seen.map_or(Ok(()), Err)
            }
        };
        engine.shutdown().expect("shutdown");
        result
    })
    .expect("run");
    for out in outs {
        let msg = out.expect_err("stall must fail").to_string();
        assert!(msg.contains("only/on/rank0"), "{msg}");
        assert!(msg.contains("not on ranks [1, 2]"), "{msg}");
    }
}

/// A fusion config that writes its timeline into a fresh directory (kept while the first
/// value lives), and the timeline's path.
fn timeline_config() -> (tempfile::TempDir, std::path::PathBuf, FusionConfig) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("trace.json");
    let config = FusionConfig {
        timeline: Some(path.clone()),
        ..FusionConfig::default()
    };
    (dir, path, config)
}

/// The events of rank `rank`'s timeline file for `path`, checked to be JSON.
fn timeline_events(path: &std::path::Path, rank: usize) -> Vec<serde_json::Value> {
    let file = ringtrain_collective::timeline_path_for_rank(path, rank);
    let text = std::fs::read_to_string(&file).expect("timeline written");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    match json["traceEvents"].take() {
        serde_json::Value::Array(events) => events,
        other => panic!("traceEvents is not an array: {other}"),
    }
}

#[test]
fn fusion_timeline_is_chrome_trace_json_with_every_phase() {
    let (_dir, path, config) = timeline_config();
    Communicator::run_local(2, |comm| {
        let engine = FusionEngine::start(comm, config.clone()).expect("start");
        let hs = vec![
            engine.submit("a", vec![1.0f32; 8]).expect("submit"),
            engine.submit("b", vec![1.0f32; 8]).expect("submit"),
        ];
        engine.synchronize(hs).expect("sync");
        engine.shutdown().expect("shutdown");
    })
    .expect("run");
    for rank in 0..2 {
        let events = timeline_events(&path, rank);
        let phases: Vec<&str> = events
            .iter()
            .filter(|e| e["ph"] == "X")
            .filter_map(|e| e["name"].as_str())
            .collect();
        for p in ["negotiate", "queued", "copy_in", "all_reduce", "copy_out"] {
            assert!(
                phases.contains(&p),
                "rank {rank} lacks phase {p}: {phases:?}"
            );
        }
        assert!(events.iter().all(|e| e["pid"] == rank));
    }
}

/// Tensors of at least `MIN_IN_PLACE_PIECE_BYTES` are fused without the fusion buffer
/// (where `auto` takes an algorithm that reduces in place):
/// reduced where they lie, their rows show one `all_reduce` marked `in_place` and no
/// copies. Small ones go through the fusion buffer. Both give the bits of one
/// all-reduce of the tensors laid end to end.
#[test]
fn large_tensors_are_fused_in_place_with_the_fusion_buffers_bits() {
    let (_dir, path, config) = timeline_config();
    // Above the pieces' minimum, and together past the sizes `auto` reduces directly.
    let large = 8 * ringtrain_collective::MIN_IN_PLACE_PIECE_BYTES;
    // Below the smallest piece any algorithm reduces in place (half of it, in f32).
    let small = ringtrain_collective::MIN_IN_PLACE_PIECE_BYTES
        .min(ringtrain_collective::MIN_SHARED_MEMORY_PIECE_BYTES)
        / 8;
    let outs = Communicator::run_local(3, |comm| -> Result<(), Error> {
        let r = comm.rank();
        let mut other = comm.duplicate()?;
        let engine = FusionEngine::start(comm, config.clone())?;
        for (group, n, len) in [("small", 4, small), ("large", 3, large)] {
            let names = TensorNames::new((0..n).map(|k| format!("{group}{k}")));
            let tensors: Vec<Vec<f32>> = (0..n)
                .map(|k| {
                    (0..len)
                        .map(|i| order_sensitive_input(r, i + len * k) as f32)
                        .collect()
                })
                .collect();
            let mut one_buffer = tensors.concat();
            let out = engine.submit_group(&names, tensors)?.wait()?;
            other.all_reduce(&mut one_buffer, &AllReduceOptions::default())?;
            let got: Vec<f32> = out
                .into_iter()
                .map(|t| t.into_vec::<f32>())
                .collect::<Result<Vec<_>, _>>()?
                .concat();
            assert_eq!(bits(&got), bits(&one_buffer), "rank {r}, {group} tensors");
        }
        engine.shutdown()?;
        Ok(())
    })
    .expect("run");
    for (rank, out) in outs.into_iter().enumerate() {
        out.expect("rank");
        let events = timeline_events(&path, rank);
        let spans: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
        let count = |name: &str, in_place: bool| {
            spans
                .iter()
                .filter(|e| e["name"] == name && (e["args"]["in_place"] == true) == in_place)
                .count()
        };
        // The small group is copied (four tensors, each way); the large one is reduced
        // in place: three rows, no copies.
        assert_eq!(count("copy_in", false), 4, "rank {rank}");
        assert_eq!(count("copy_out", false), 4, "rank {rank}");
        assert_eq!(count("all_reduce", false), 4, "rank {rank}");
        assert_eq!(count("all_reduce", true), 3, "rank {rank}");
    }
}

#[test]
fn fusion_phases_go_into_a_shared_sink_only_while_it_records() {
    use ringtrain_collective::EventSink;
    let origin = std::time::Instant::now();
    let outs = Communicator::run_local(2, |comm| {
        let sink = EventSink::new(comm.rank(), origin);
        let config = FusionConfig {
            events: Some(sink.clone()),
            ..FusionConfig::default()
        };
        let engine = FusionEngine::start(comm, config).expect("start");
        sink.set_recording(false);
        let hs = vec![engine.submit("hidden", vec![1.0f32; 8]).expect("submit")];
        engine.synchronize(hs).expect("sync");
        sink.set_recording(true);
        let hs = vec![
            engine.submit("a", vec![1.0f32; 8]).expect("submit"),
            engine.submit("b", vec![1.0f32; 8]).expect("submit"),
        ];
        engine.synchronize(hs).expect("sync");
        engine.shutdown().expect("shutdown");
        sink.events()
    })
    .expect("run");
    for (rank, events) in outs.into_iter().enumerate() {
        let spans: Vec<_> = events.iter().filter(|e| e.ph == "X").collect();
        let names: Vec<&str> = spans.iter().map(|e| e.name.as_str()).collect();
        for p in ["negotiate", "queued", "copy_in", "all_reduce", "copy_out"] {
            assert!(names.contains(&p), "rank {rank} lacks {p}: {names:?}");
        }
        let row = |tid: usize| {
            events
                .iter()
                .find(|e| e.ph == "M" && e.tid == tid)
                .and_then(|e| e.args["name"].as_str())
                .unwrap_or_default()
                .to_owned()
        };
        let rows: Vec<String> = spans.iter().map(|e| row(e.tid)).collect();
        assert!(!rows.iter().any(|r| r == "hidden"), "{rows:?}");
        assert!(rows.iter().any(|r| r == "a") && rows.iter().any(|r| r == "b"));
        assert!(events.iter().all(|e| e.pid == rank));
        assert!(spans
            .iter()
            .all(|e| e.dur.is_some_and(|d| d >= 0.0) && e.ts >= 0.0));
    }
}

#[test]
fn mpi_algorithm_on_the_local_transport_fails_on_every_rank() {
    let outs = Communicator::run_local(2, |mut comm| {
        let mut v = vec![1.0f32; 4];
        comm.all_reduce(&mut v, &AllReduceOptions::sum().algorithm(Algorithm::Mpi))
    })
    .expect("run");
    for out in outs {
        assert!(out.expect_err("no MPI here").to_string().contains("mpi"));
    }
}

#[test]
fn submitting_a_name_twice_before_it_completes_is_an_error() {
    let outs = Communicator::run_local(2, |comm| {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default()).expect("start");
        let result = if r == 0 {
            let first = engine.submit("w", vec![1.0f32; 4]).expect("submit");
            // "w" cannot complete before rank 1 submits it, 200 ms from now.
            let second = engine.submit("w", vec![1.0f32; 4]).expect("submit");
            let dup = second.wait().expect_err("duplicate must fail").to_string();
            assert!(dup.contains("`w`") && dup.contains("rank 0"), "{dup}");
            first.wait()
        } else {
            std::thread::sleep(Duration::from_millis(200));
            engine.submit("w", vec![1.0f32; 4]).expect("submit").wait()
        };
        engine.shutdown().expect("shutdown");
        result
    })
    .expect("run");
    for out in outs {
        assert_eq!(
            out.expect("reduced").into_vec::<f32>().expect("f32"),
            vec![2.0; 4]
        );
    }
}

/// Submits `(name, len)` f32 tensors filled with `rank + 1` and synchronizes.
fn fused_step(
    engine: &FusionEngine,
    r: usize,
    tensors: &[(&str, usize)],
) -> Result<Vec<Vec<f32>>, Error> {
    let handles = tensors
        .iter()
        .map(|&(name, len)| engine.submit(name, vec![(r + 1) as f32; len]))
        .collect::<Result<Vec<_>, _>>()?;
    engine
        .synchronize(handles)?
        .into_iter()
        .map(|t| t.into_vec::<f32>())
        .collect()
}

/// The response cache across steps: the same names in other orders (cache hits), a shape
/// that changes on every rank (a miss, reduced and cached anew), a shape that changes on
/// one rank only (a mismatch on every rank, which clears the cache entry) and the next
/// step after it (agreed again).
#[test]
fn fusion_cache_follows_names_orders_and_shapes_across_steps() {
    let outs = Communicator::run_local(3, |comm| -> Result<(), String> {
        let r = comm.rank();
        let config = FusionConfig {
            cycle_time: Duration::from_micros(200),
            ..FusionConfig::default()
        };
        let engine = FusionEngine::start(comm, config).map_err(|e| e.to_string())?;
        let sum = 6.0f32;
        let check = |out: Vec<Vec<f32>>, lens: &[usize], step: &str| -> Result<(), String> {
            let got: Vec<usize> = out.iter().map(Vec::len).collect();
            if got != lens || out.iter().flatten().any(|&x| x != sum) {
                return Err(format!("rank {r}, {step}: got {out:?}"));
            }
            Ok(())
        };
        let first = [("a", 5), ("b", 7), ("c", 1)];
        let out = fused_step(&engine, r, &first).map_err(|e| e.to_string())?;
        check(out, &[5, 7, 1], "first step")?;
        // Each rank its own order; every name is a cache hit.
        for step in 0..3 {
            let mut order = first.to_vec();
            order.rotate_left((r + step) % 3);
            let lens: Vec<usize> = order.iter().map(|t| t.1).collect();
            let out = fused_step(&engine, r, &order).map_err(|e| e.to_string())?;
            check(out, &lens, "reordered step")?;
        }
        // "b" grows on every rank.
        let out =
            fused_step(&engine, r, &[("a", 5), ("b", 9), ("c", 1)]).map_err(|e| e.to_string())?;
        check(out, &[5, 9, 1], "b resized everywhere")?;
        let out =
            fused_step(&engine, r, &[("b", 9), ("a", 5), ("c", 1)]).map_err(|e| e.to_string())?;
        check(out, &[9, 5, 1], "b cached at its new size")?;
        // "c" changes on rank 2 only: it fails on every rank, the others are reduced.
        let c_len = if r == 2 { 2 } else { 1 };
        let handles = [("a", 5), ("b", 9), ("c", c_len)]
            .iter()
            .map(|&(n, l)| engine.submit(n, vec![(r + 1) as f32; l]))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let mut results = handles.into_iter().map(|h| h.wait());
        let (a, b, c) = (results.next(), results.next(), results.next());
        check(
            vec![
                a.ok_or("no a")?
                    .map_err(|e| e.to_string())?
                    .into_vec::<f32>()
                    .map_err(|e| e.to_string())?,
                b.ok_or("no b")?
                    .map_err(|e| e.to_string())?
                    .into_vec::<f32>()
                    .map_err(|e| e.to_string())?,
            ],
            &[5, 9],
            "a and b beside the mismatch",
        )?;
        let msg = match c.ok_or("no c")? {
            Ok(t) => return Err(format!("rank {r}: mismatched c was reduced: {t:?}")),
            Err(e) => e.to_string(),
        };
        if !(msg.contains("`c`")
            && msg.contains("rank 0: f32[1]")
            && msg.contains("rank 2: f32[2]"))
        {
            return Err(format!("rank {r}: {msg}"));
        }
        // Agreed again on the next step.
        let out =
            fused_step(&engine, r, &[("c", 1), ("a", 5), ("b", 9)]).map_err(|e| e.to_string())?;
        check(out, &[1, 5, 9], "after the mismatch")?;
        engine.shutdown().map_err(|e| e.to_string())?;
        Ok(())
    })
    .expect("run");
    for out in outs {
        out.expect("rank");
    }
}

/// A name every rank submitted once, submitted again on rank 0 only: the cache bit alone
/// does not make it ready; it fails as a stall on every rank, naming the missing ranks,
/// and the tensor every rank submitted beside it is reduced.
#[test]
fn a_cached_name_submitted_on_one_rank_only_fails_as_a_stall_on_every_rank() {
    let config = FusionConfig {
        stall_warning: Duration::from_millis(100),
        stall_error: Duration::from_millis(100),
        cycle_time: Duration::from_micros(200),
        ..FusionConfig::default()
    };
    let outs = Communicator::run_local(3, |comm| {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, config.clone()).expect("start");
        let both = fused_step(&engine, r, &[("x", 3), ("y", 2)]).expect("first step");
        assert!(both.iter().flatten().all(|&v| v == 6.0), "{both:?}");
        let x = engine.submit("x", vec![1.0f32; 3]).expect("submit");
        let y = (r == 0).then(|| engine.submit("y", vec![1.0f32; 2]).expect("submit"));
        let x = x
            .wait()
            .expect("x is reduced")
            .into_vec::<f32>()
            .expect("f32");
        assert_eq!(x, vec![3.0; 3]);
        let result = match y {
            Some(h) => h.wait().map(|_| ()),
            None => {
                let mut seen = None;
                for _ in 0..300 {
                    if let Some(e) = engine.take_foreign_failure() {
                        seen = Some(e);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                seen.map_or(Ok(()), Err)
            }
        };
        engine.shutdown().expect("shutdown");
        result
    })
    .expect("run");
    for out in outs {
        let msg = out.expect_err("the stall must fail").to_string();
        assert!(
            msg.contains("`y`") && msg.contains("not on ranks [1, 2]"),
            "{msg}"
        );
    }
}

/// A cached name submitted twice before it completes is refused like a new one.
#[test]
fn submitting_a_cached_name_twice_before_it_completes_is_an_error() {
    let outs = Communicator::run_local(2, |comm| {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default()).expect("start");
        fused_step(&engine, r, &[("w", 4)]).expect("first step");
        let result = if r == 0 {
            let first = engine.submit("w", vec![1.0f32; 4]).expect("submit");
            let second = engine.submit("w", vec![1.0f32; 4]).expect("submit");
            let dup = second.wait().expect_err("duplicate must fail").to_string();
            assert!(dup.contains("`w`") && dup.contains("rank 0"), "{dup}");
            first.wait()
        } else {
            std::thread::sleep(Duration::from_millis(200));
            engine.submit("w", vec![1.0f32; 4]).expect("submit").wait()
        };
        engine.shutdown().expect("shutdown");
        result
    })
    .expect("run");
    for out in outs {
        assert_eq!(
            out.expect("reduced").into_vec::<f32>().expect("f32"),
            vec![2.0; 4]
        );
    }
}

/// Groups submitted in one message (`all_reduce_group` on rank 0, `submit_group` on rank
/// 1): exact results in the order of the names, whether the other ranks submit the same
/// tensors one by one or as a group of another order; a
/// count that does not match the names is refused before anything is queued; a name
/// twice in one group fails that place only.
#[test]
fn submitted_groups_mix_with_single_submissions_and_other_orders() {
    let outs = Communicator::run_local(3, |comm| -> Result<(), String> {
        let r = comm.rank();
        let engine =
            FusionEngine::start(comm, FusionConfig::default()).map_err(|e| e.to_string())?;
        let names = ["g/a", "g/b", "g/c", "g/d"];
        let lens = [3usize, 1, 6, 2];
        let tensors = |order: &[usize]| -> Vec<Vec<f32>> {
            order
                .iter()
                .map(|&i| vec![(r + 1) as f32; lens[i]])
                .collect()
        };
        for step in 0..3 {
            // Rank 0 groups in name order, rank 1 groups in reverse, rank 2 submits each.
            let order: Vec<usize> = match r {
                0 => vec![0, 1, 2, 3],
                1 => vec![3, 2, 1, 0],
                _ => vec![1, 3, 0, 2],
            };
            let out: Vec<Vec<f32>> = if r < 2 {
                let group = TensorNames::new(order.iter().map(|&i| names[i]));
                let reduced = if r == 0 {
                    engine.all_reduce_group(&group, tensors(&order))
                } else {
                    engine
                        .submit_group(&group, tensors(&order))
                        .and_then(|h| h.wait())
                };
                reduced
                    .map_err(|e| e.to_string())?
                    .into_iter()
                    .map(|t| t.into_vec::<f32>().map_err(|e| e.to_string()))
                    .collect::<Result<_, _>>()?
            } else {
                let list: Vec<(&str, usize)> = order.iter().map(|&i| (names[i], lens[i])).collect();
                fused_step(&engine, r, &list).map_err(|e| e.to_string())?
            };
            for (k, &i) in order.iter().enumerate() {
                if out[k] != vec![6.0f32; lens[i]] {
                    return Err(format!(
                        "rank {r}, step {step}: {} gave {:?}",
                        names[i], out[k]
                    ));
                }
            }
        }
        let err = engine
            .submit_group(&TensorNames::new(["x", "y"]), vec![vec![1.0f32]])
            .expect_err("two names, one tensor")
            .to_string();
        if !(err.contains("1 (for 2 names)") && err.contains("one tensor per name")) {
            return Err(err);
        }
        // "dup" twice in one group: the second place fails, the first is reduced.
        let group = TensorNames::new(["dup", "dup"]);
        let h = engine
            .submit_group(&group, vec![vec![1.0f32; 2], vec![1.0f32; 2]])
            .map_err(|e| e.to_string())?;
        let err = h.wait().expect_err("a name twice").to_string();
        if !(err.contains("`dup`") && err.contains(&format!("rank {r}"))) {
            return Err(err);
        }
        engine.shutdown().map_err(|e| e.to_string())?;
        Ok(())
    })
    .expect("run");
    for out in outs {
        out.expect("rank");
    }
}

#[test]
fn unwritable_timeline_path_fails_at_start_naming_the_file() {
    let comm = Communicator::local(1).expect("local").remove(0);
    let config = FusionConfig {
        timeline: Some("/nonexistent-dir/trace.json".into()),
        ..FusionConfig::default()
    };
    let err = FusionEngine::start(comm, config).expect_err("unwritable");
    let msg = err.to_string();
    assert!(msg.contains("/nonexistent-dir/trace.rank0.json"), "{msg}");
}

/// A rank that stops taking part: the others' waits end with an error naming it after the
/// stall timeout, instead of blocking for ever.
#[test]
fn a_stalled_rank_is_named_by_the_waiting_ranks() {
    for algorithm in [
        Algorithm::Ring,
        Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling,
        Algorithm::Direct,
        Algorithm::ScatterGather,
        Algorithm::SharedMemory,
        Algorithm::Hierarchical,
    ] {
        let outs = Communicator::run_local(3, |mut comm| {
            comm.set_stall_timeout(Some(Duration::from_millis(300)));
            comm.set_stall_context("step 7");
            if comm.rank() == 2 {
                // Stuck: alive (its endpoints stay open) but not taking part.
                std::thread::sleep(Duration::from_secs(3));
                return Ok(());
            }
            let mut v = vec![1.0f32; 100];
            comm.all_reduce(&mut v, &AllReduceOptions::sum().algorithm(algorithm))
        })
        .expect("threads");
        let mut named = false;
        for out in &outs[..2] {
            let err = out.as_ref().expect_err("a stalled rank must fail the wait");
            let msg = err.to_string();
            match err {
                Error::StallTimeout { .. } => {
                    assert!(
                        msg.contains("step 7") && msg.contains("all-reduce"),
                        "{msg}"
                    );
                    named |= msg.contains("waiting for rank 2");
                }
                // A rank whose wait ended first has left; its partners see that at once.
                Error::Transport { .. } => assert!(msg.contains("gone away"), "{msg}"),
                other => panic!("unexpected error: {other}"),
            }
        }
        assert!(named, "{algorithm}: no rank named rank 2: {outs:?}");
    }
}

#[test]
fn stall_timeout_off_waits_for_a_slow_rank() {
    let outs = Communicator::run_local(2, |mut comm| {
        comm.set_stall_timeout(None);
        assert_eq!(comm.stall_timeout(), None);
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        let mut v = vec![1.0f32; 10];
        comm.all_reduce(&mut v, &AllReduceOptions::sum()).map(|_| v)
    })
    .expect("threads");
    for out in outs {
        assert_eq!(out.expect("no stall error when off"), vec![2.0f32; 10]);
    }
}

/// Halving-doubling at every rank count from 1 to 9 (powers of two, and the fold-in of
/// the ranks beyond one), with lengths below the rank count, odd lengths and windows that
/// halve to nothing: exact, and the same bits on every rank.
#[test]
fn halving_doubling_is_exact_at_every_rank_count_and_length() {
    for size in 1..=9 {
        for len in [0usize, 1, 2, 3, 5, 8, 17, 1000] {
            let opts = AllReduceOptions::sum().algorithm(Algorithm::HalvingDoubling);
            check_all_reduce::<f32>(size, 1, len, opts, 64, size + len)
                .unwrap_or_else(|e| panic!("{size} ranks, length {len}: {e}"));
        }
    }
}

/// The direct, scatter-gather and shared-memory all-reduces at every rank count from 1 to 9 and
/// short, odd and long lengths (lengths below the rank count leave chunks empty), every
/// dtype and op: exact, and the same bits on every rank.
#[test]
fn direct_and_scatter_gather_are_exact_at_every_rank_count_length_and_dtype() {
    for algorithm in [
        Algorithm::Direct,
        Algorithm::ScatterGather,
        Algorithm::SharedMemory,
    ] {
        for size in 1..=9 {
            for len in [0usize, 1, 2, 3, 5, 8, 17, 1000] {
                for op in [
                    ReduceOp::Sum,
                    ReduceOp::Average,
                    ReduceOp::Min,
                    ReduceOp::Max,
                ] {
                    let opts = AllReduceOptions::with_op(op).algorithm(algorithm);
                    let salt = size + len;
                    check_all_reduce::<f32>(size, 1, len, opts, 64, salt)
                        .and_then(|_| check_all_reduce::<f64>(size, 1, len, opts, 64, salt))
                        .and_then(|_| check_all_reduce::<f16>(size, 1, len, opts, 64, salt))
                        .and_then(|_| check_all_reduce::<bf16>(size, 1, len, opts, 64, salt))
                        .unwrap_or_else(|e| {
                            panic!("{algorithm}, {size} ranks, length {len}, {op}: {e}")
                        });
                }
            }
        }
    }
}

/// Inputs whose sum depends on the order it is taken in: fractions at magnitudes 1e-3
/// to 1e3 of both signs, so that a different grouping rounds differently.
fn order_sensitive_input(rank: usize, i: usize) -> f64 {
    let scale = [1.0, 1000.0, -1000.0, 0.001][(i + rank) % 4];
    ((i * 31 + rank * 17) % 13) as f64 * 0.37 * scale
}

/// Rank `rank`'s input and the sum in rank order, `((x0 + x1) + x2) ...`, each addition
/// rounded to `T` (IEEE addition of two `T` values, done in f64 and rounded once, which
/// is exact for f32, f16 and bf16).
fn rank_order_sum<T: Element>(size: usize, len: usize) -> (Vec<Vec<T>>, Vec<T>) {
    let inputs: Vec<Vec<T>> = (0..size)
        .map(|r| {
            (0..len)
                .map(|i| T::from_f64(order_sensitive_input(r, i)))
                .collect()
        })
        .collect();
    let sum = (0..len)
        .map(|i| {
            inputs[1..].iter().fold(inputs[0][i], |acc, x| {
                T::from_f64(acc.to_f64() + x[i].to_f64())
            })
        })
        .collect();
    (inputs, sum)
}

fn check_sums_in_rank_order<T: Element>(algorithm: Algorithm, size: usize, len: usize) {
    let (inputs, want) = rank_order_sum::<T>(size, len);
    let outs = Communicator::run_local(size, |mut comm| {
        let mut v = inputs[comm.rank()].clone();
        comm.all_reduce(&mut v, &AllReduceOptions::sum().algorithm(algorithm))
            .map(|_| v)
    })
    .expect("threads");
    for (rank, out) in outs.into_iter().enumerate() {
        let out = out.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(
            bits(&out),
            bits(&want),
            "{algorithm} {} at {size} ranks, length {len}: rank {rank} is not the sum in rank order",
            T::NAME
        );
    }
}

/// Every rank of the direct, scatter-gather and shared-memory all-reduces ends with the bits of the sum
/// taken in rank order, for inputs whose sum depends on the order (recursive doubling's
/// order, for one, gives other bits at 3 ranks and up).
#[test]
fn direct_and_scatter_gather_sum_in_rank_order_with_identical_bits_on_every_rank() {
    for algorithm in [
        Algorithm::Direct,
        Algorithm::ScatterGather,
        Algorithm::SharedMemory,
    ] {
        for size in 2..=9 {
            for len in [1usize, 7, 64, 1000] {
                check_sums_in_rank_order::<f32>(algorithm, size, len);
                check_sums_in_rank_order::<f64>(algorithm, size, len);
                check_sums_in_rank_order::<f16>(algorithm, size, len);
                check_sums_in_rank_order::<bf16>(algorithm, size, len);
            }
        }
    }
}

/// Tensors submitted as the caller's memory are summed in place there: fused with each
/// other and with owned tensors, over four steps (from the second on from the response
/// cache; the same step again, which owned tensors alone would make a held group, stays
/// on the general path); the handles give back empty tensors, so no copy of the values
/// comes back.
#[test]
fn external_tensors_are_reduced_in_the_callers_memory() {
    let outs = Communicator::run_local(3, |comm| -> Result<(), String> {
        let r = comm.rank();
        let engine =
            FusionEngine::start(comm, FusionConfig::default()).map_err(|e| e.to_string())?;
        let mut flat = vec![0.0f32; 10];
        let mut half_buf = vec![f16::ZERO; 5];
        for step in 0..4usize {
            let salt = (step * 10) as f32;
            for (i, x) in flat.iter_mut().enumerate() {
                *x = (r + 1) as f32 * (i as f32 + 1.0) + salt;
            }
            half_buf.fill(f16::from_f32((r + 1) as f32));
            let start = flat.as_ptr();
            let (a, rest) = flat.split_at_mut(3);
            let (b, c) = rest.split_at_mut(4);
            let mut handles = Vec::new();
            for (name, piece) in [("a", a), ("b", b), ("c", c)] {
                // SAFETY: `flat` outlives the handles, which are all waited for below
                // before it is read or written again.
                let h = unsafe { engine.submit_external(name, ExternalTensor::new(piece)) };
                handles.push(h.map_err(|e| e.to_string())?);
            }
            // SAFETY: as above, for `half_buf`.
            let h = unsafe { engine.submit_external("h", ExternalTensor::new(&mut half_buf[..])) };
            handles.push(h.map_err(|e| e.to_string())?);
            handles.push(
                engine
                    .submit("owned", vec![(r + 1) as f32; 2])
                    .map_err(|e| e.to_string())?,
            );
            let out = engine.synchronize(handles).map_err(|e| e.to_string())?;
            let lens: Vec<usize> = out.iter().map(Tensor::len).collect();
            assert_eq!(lens, [0, 0, 0, 0, 2], "rank {r} step {step}");
            assert_eq!(out[0].dtype(), DType::F32);
            assert_eq!(out[3].dtype(), DType::F16);
            assert_eq!(out[4].clone().into_vec::<f32>().unwrap(), vec![6.0; 2]);
            assert_eq!(flat.as_ptr(), start);
            let want: Vec<f32> = (0..10)
                .map(|i| 6.0 * (i as f32 + 1.0) + 3.0 * salt)
                .collect();
            assert_eq!(flat, want, "rank {r} step {step}");
            assert_eq!(
                half_buf,
                vec![f16::from_f32(6.0); 5],
                "rank {r} step {step}"
            );
        }
        engine.shutdown().map_err(|e| e.to_string())?;
        Ok(())
    })
    .expect("run");
    for out in outs {
        out.expect("rank");
    }
}

/// A handle of the caller's memory dropped unwaited takes the values along: the caller
/// may write its memory at once, the other ranks still get the values it had, and the
/// engine never writes the sums into it.
#[test]
fn an_external_handle_dropped_unwaited_leaves_the_callers_memory_alone() {
    let outs = Communicator::run_local(2, |comm| -> Result<Vec<f32>, String> {
        let r = comm.rank();
        let engine =
            FusionEngine::start(comm, FusionConfig::default()).map_err(|e| e.to_string())?;
        let result = if r == 0 {
            let mut mine = vec![1.0f32; 4];
            // SAFETY: the handle is dropped before `mine` is written again.
            let h = unsafe { engine.submit_external("x", ExternalTensor::new(&mut mine[..])) };
            // "x" cannot complete before rank 1 submits it, 200 ms from now.
            drop(h.map_err(|e| e.to_string())?);
            mine.fill(99.0);
            // Rank 1 reduces "x" while this rank waits on a later tensor.
            let later = engine
                .submit("y", vec![1.0f32; 1])
                .map_err(|e| e.to_string())?;
            later.wait().map_err(|e| e.to_string())?;
            Ok(mine)
        } else {
            std::thread::sleep(Duration::from_millis(200));
            let h = engine
                .submit("x", vec![2.0f32; 4])
                .map_err(|e| e.to_string())?;
            let sum = h.wait().map_err(|e| e.to_string())?;
            let y = engine
                .submit("y", vec![1.0f32; 1])
                .map_err(|e| e.to_string())?;
            y.wait().map_err(|e| e.to_string())?;
            sum.into_vec::<f32>().map_err(|e| e.to_string())
        };
        engine.shutdown().map_err(|e| e.to_string())?;
        result
    })
    .expect("run");
    let outs: Vec<Vec<f32>> = outs.into_iter().map(|o| o.expect("rank")).collect();
    assert_eq!(
        outs[0],
        vec![99.0; 4],
        "the engine wrote into dropped memory"
    );
    assert_eq!(outs[1], vec![3.0; 4]);
}

/// The same group every step goes by the ids its names had before: each tensor gets its
/// own sum, also when one rank groups the names another way, when a shape changes on every
/// rank (looked up again) and when a group is submitted while its twin is still queued.
#[test]
fn a_group_submitted_every_step_keeps_each_tensor_in_its_place() {
    let outs = Communicator::run_local(3, |comm| -> Result<(), String> {
        let r = comm.rank();
        let engine =
            FusionEngine::start(comm, FusionConfig::default()).map_err(|e| e.to_string())?;
        let names = TensorNames::new(["g0", "g1", "g2", "g3"]);
        let reversed = TensorNames::new(["g3", "g2", "g1", "g0"]);
        for step in 0..6usize {
            // Step 4 changes the shape of g2 on every rank.
            let len = |i: usize| if step >= 4 && i == 2 { 5 } else { 2 + i };
            let value = |rank: usize, i: usize| ((rank + 1) * 10 + i + step * 100) as f32;
            let order: Vec<usize> = if r == 1 && step % 2 == 1 {
                vec![3, 2, 1, 0]
            } else {
                vec![0, 1, 2, 3]
            };
            let group = if order[0] == 3 { &reversed } else { &names };
            let tensors: Vec<Vec<f32>> = order.iter().map(|&i| vec![value(r, i); len(i)]).collect();
            let out = engine
                .all_reduce_group(group, tensors)
                .map_err(|e| e.to_string())?;
            for (k, &i) in order.iter().enumerate() {
                let got = out[k]
                    .clone()
                    .into_vec::<f32>()
                    .map_err(|e| e.to_string())?;
                let want = (0..3).map(|q| value(q, i)).sum::<f32>();
                assert_eq!(got, vec![want; len(i)], "rank {r} step {step} tensor g{i}");
            }
        }
        // Twice the same group before either is reduced: the second is a duplicate.
        let first = engine
            .submit_group(&names, (0..4).map(|i| vec![1.0f32; 2 + i]).collect())
            .map_err(|e| e.to_string())?;
        if r == 0 {
            let second = engine
                .submit_group(&names, (0..4).map(|i| vec![1.0f32; 2 + i]).collect())
                .map_err(|e| e.to_string())?;
            let dup = second.wait().expect_err("a duplicate").to_string();
            assert!(dup.contains("`g0`"), "{dup}");
        }
        let out = first.wait().map_err(|e| e.to_string())?;
        assert_eq!(out[3].clone().into_vec::<f32>().unwrap(), vec![3.0; 5]);
        engine.shutdown().map_err(|e| e.to_string())?;
        Ok(())
    })
    .expect("run");
    for out in outs {
        out.expect("rank");
    }
}

/// The shared-memory all-reduce of a message of many pieces of its segment (both sets of
/// slots taking turns, call after call), given as several slices: the bits of the direct
/// all-reduce of one buffer, on every rank, every dtype.
#[test]
fn shared_memory_through_many_segments_and_pieces_gives_the_direct_bits() {
    fn check<T: Element>(size: usize) {
        let lens = [1usize, 130, 7, 999, 64];
        let total: usize = lens.iter().sum();
        let outs = Communicator::run_local(size, |mut comm| -> Result<_, Error> {
            let r = comm.rank();
            let input: Vec<T> = (0..total)
                .map(|i| T::from_f64(order_sensitive_input(r, i)))
                .collect();
            let mut direct = input.clone();
            comm.all_reduce(
                &mut direct,
                &AllReduceOptions::sum().algorithm(Algorithm::Direct),
            )?;
            // 64-byte slots: the message goes through the segment in dozens of pieces.
            comm.set_segment_bytes(64);
            let mut results = Vec::new();
            for _ in 0..3 {
                let mut flat = input.clone();
                let mut slices: Vec<&mut [T]> = Vec::new();
                let mut rest = &mut flat[..];
                for &len in &lens {
                    let (head, tail) = rest.split_at_mut(len);
                    slices.push(head);
                    rest = tail;
                }
                comm.all_reduce_pieces(
                    &mut slices,
                    &AllReduceOptions::sum().algorithm(Algorithm::SharedMemory),
                )?;
                results.push(flat);
            }
            Ok((direct, results))
        })
        .expect("threads");
        for (rank, out) in outs.into_iter().enumerate() {
            let (direct, results) = out.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            for got in results {
                assert_eq!(
                    bits(&got),
                    bits(&direct),
                    "{} at {size} ranks, rank {rank}",
                    T::NAME
                );
            }
        }
    }
    for size in [2, 3, 5] {
        check::<f32>(size);
        check::<f64>(size);
        check::<f16>(size);
        check::<bf16>(size);
    }
}

/// A rank without shared memory: an explicit shared-memory all-reduce fails on every rank,
/// naming that rank, and `auto` still reduces (among the other algorithms).
#[test]
fn without_shared_memory_on_one_rank_every_rank_is_told_and_auto_goes_on() {
    let outs = Communicator::run_local(3, |mut comm| {
        if comm.rank() == 1 {
            comm.set_shared_memory_dir(None);
        }
        let mut v = vec![1.0f32; 4096];
        let explicit = comm.all_reduce(
            &mut v,
            &AllReduceOptions::sum().algorithm(Algorithm::SharedMemory),
        );
        let mut w = vec![1.0f32; 4096];
        let auto = comm.all_reduce(&mut w, &AllReduceOptions::sum()).map(|_| w);
        (explicit, auto)
    })
    .expect("threads");
    for (rank, (explicit, auto)) in outs.into_iter().enumerate() {
        let msg = explicit
            .expect_err("no segment: the explicit call fails")
            .to_string();
        assert!(
            msg.contains("rank 1") && msg.contains("shared memory turned off"),
            "rank {rank}: {msg}"
        );
        assert_eq!(
            auto.expect("auto goes on"),
            vec![3.0f32; 4096],
            "rank {rank}"
        );
    }
}

/// Rank 0 cannot make the segment where it is told to: every rank gets the reason, with
/// the path.
#[test]
fn a_segment_directory_that_is_missing_fails_every_rank_with_its_path() {
    let outs = Communicator::run_local(2, |mut comm| {
        comm.set_shared_memory_dir(Some("/nonexistent-shm-dir".into()));
        let mut v = vec![1.0f32; 10];
        comm.all_reduce(
            &mut v,
            &AllReduceOptions::sum().algorithm(Algorithm::SharedMemory),
        )
    })
    .expect("threads");
    for out in outs {
        let msg = out.expect_err("no directory").to_string();
        assert!(
            msg.contains("rank 0") && msg.contains("/nonexistent-shm-dir"),
            "{msg}"
        );
    }
}

/// The segment's file is gone once every rank has mapped it, so nothing is left behind
/// however the job ends; reductions go on through the mapping.
#[test]
fn the_segment_file_is_removed_once_every_rank_has_mapped_it() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let outs = Communicator::run_local(3, |mut comm| {
        comm.set_shared_memory_dir(Some(dir.path().to_path_buf()));
        let opts = AllReduceOptions::sum().algorithm(Algorithm::SharedMemory);
        let mut v = vec![1.0f32; 100];
        comm.all_reduce(&mut v, &opts)?;
        comm.barrier()?;
        let left = std::fs::read_dir(dir.path()).expect("listable").count();
        comm.all_reduce(&mut v, &opts)?;
        Ok::<_, Error>((left, v))
    })
    .expect("threads");
    for out in outs {
        let (left, v) = out.expect("reduced");
        assert_eq!(left, 0, "files left in the segment directory");
        assert_eq!(v, vec![9.0f32; 100]);
    }
}

/// A rank that never comes to the segment's making: rank 0's wait for it ends at the
/// stall timeout, and the file rank 0 made is gone.
#[test]
fn a_segment_that_a_rank_never_maps_leaves_no_file() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let outs = Communicator::run_local(2, |mut comm| {
        comm.set_stall_timeout(Some(Duration::from_millis(300)));
        comm.set_shared_memory_dir(Some(dir.path().to_path_buf()));
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(1));
            return Ok(());
        }
        let mut v = vec![1.0f32; 100];
        comm.all_reduce(
            &mut v,
            &AllReduceOptions::sum().algorithm(Algorithm::SharedMemory),
        )
    })
    .expect("threads");
    let msg = outs[0].as_ref().expect_err("rank 1 never came").to_string();
    assert!(msg.contains("waiting for rank 1"), "{msg}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).expect("listable").collect();
    assert!(left.is_empty(), "files left: {left:?}");
}

/// A rank that stops after the segment is made: the others wait on its flag and name it
/// at the stall timeout.
#[test]
fn a_rank_that_stops_between_shared_memory_reductions_is_named() {
    let outs = Communicator::run_local(3, |mut comm| {
        comm.set_stall_timeout(Some(Duration::from_millis(300)));
        let opts = AllReduceOptions::sum().algorithm(Algorithm::SharedMemory);
        let mut v = vec![1.0f32; 100];
        comm.all_reduce(&mut v, &opts)?;
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_secs(2));
            return Ok(());
        }
        comm.all_reduce(&mut v, &opts)
    })
    .expect("threads");
    for out in &outs[..2] {
        let msg = out.as_ref().expect_err("rank 2 stopped").to_string();
        assert!(
            msg.contains("waiting for rank 2") && msg.contains("shared-memory all-reduce"),
            "{msg}"
        );
    }
}

/// Which groups of pieces are reduced where they lie: with shared memory from
/// `MIN_SHARED_MEMORY_PIECE_BYTES` on average, with the message-passing algorithms from
/// `MIN_IN_PLACE_PIECE_BYTES`, never with direct or `MPI_Allreduce`;
/// `set_min_in_place_piece_bytes` moves both, a duplicate keeps the setting, and `None`
/// brings the measured sizes back.
#[test]
fn pieces_are_reduced_in_place_from_each_algorithms_size_and_the_setting_moves_it() {
    use ringtrain_collective::{MIN_IN_PLACE_PIECE_BYTES, MIN_SHARED_MEMORY_PIECE_BYTES};
    let outs = Communicator::run_local(2, |mut comm| -> Result<(), Error> {
        let pieces = 1000;
        let in_place = |comm: &Communicator, algorithm: Algorithm, piece: usize| {
            let opts = AllReduceOptions::sum().algorithm(algorithm);
            comm.reduces_in_place(DType::F32, &opts, pieces, pieces * piece)
        };
        for (algorithm, least) in [
            (Algorithm::SharedMemory, MIN_SHARED_MEMORY_PIECE_BYTES),
            (Algorithm::Ring, MIN_IN_PLACE_PIECE_BYTES),
            (Algorithm::ScatterGather, MIN_IN_PLACE_PIECE_BYTES),
        ] {
            assert!(in_place(&comm, algorithm, least), "{algorithm}");
            assert!(!in_place(&comm, algorithm, least - 4), "{algorithm}");
        }
        assert!(!in_place(&comm, Algorithm::Direct, 1 << 20));
        comm.set_min_in_place_piece_bytes(Some(16));
        let dup = comm.duplicate()?;
        for c in [&comm, &dup] {
            assert!(in_place(c, Algorithm::SharedMemory, 16));
            assert!(in_place(c, Algorithm::Ring, 16));
            assert!(!in_place(c, Algorithm::Ring, 12));
            assert!(!in_place(c, Algorithm::Direct, 1 << 20));
        }
        comm.set_min_in_place_piece_bytes(None);
        assert!(!in_place(
            &comm,
            Algorithm::SharedMemory,
            MIN_SHARED_MEMORY_PIECE_BYTES - 4
        ));
        Ok(())
    })
    .expect("threads");
    for out in outs {
        out.expect("rank");
    }
}

/// The engine is shared between threads, and its handles move between them (a backward
/// pass may submit on one thread and wait on another): a change that made any of them
/// `!Send` or `!Sync` stops this test from compiling.
#[test]
fn the_engine_and_its_handles_can_cross_threads() {
    fn send_and_sync<T: Send + Sync>() {}
    send_and_sync::<FusionEngine>();
    send_and_sync::<ringtrain_collective::Handle>();
    send_and_sync::<ringtrain_collective::GroupHandle>();
    send_and_sync::<TensorNames>();
}
