use super::cached::{PastSlots, Votes, MAX_SLOT_VOTE_BYTES};
use super::*;

/// The engine's counters: (tensors accepted by group id, cached-group steps, rounds,
/// armed reductions).
fn counters(engine: &FusionEngine) -> (usize, usize, usize, usize) {
    match &*engine.core.lock() {
        CoreState::Running(r) => {
            let e = &r.engine;
            (e.by_group_id, e.cached_steps, e.rounds, e.armed_rounds)
        }
        CoreState::Ended(_) => (usize::MAX, usize::MAX, usize::MAX, usize::MAX),
    }
}

/// From its third step on (the names are registered by the first and their ids noted
/// by the second), a group submitted again takes the cached-group step: no look-up of
/// a name, no queue entry. A changed shape goes the long way, where the tensors whose
/// shape stayed go by their ids.
#[test]
fn a_group_submitted_again_goes_by_its_ids() {
    let outs = Communicator::run_local(2, |comm| -> Result<Vec<(usize, usize)>> {
        let engine = FusionEngine::start(comm, FusionConfig::default())?;
        let names = TensorNames::new(["a", "b", "c"]);
        let mut counts = Vec::new();
        for step in 0..5 {
            let b_len = if step == 4 { 3 } else { 2 };
            let tensors = vec![vec![1.0f32; 2], vec![1.0f32; b_len], vec![1.0f32; 2]];
            let out = engine.all_reduce_group(&names, tensors)?;
            assert_eq!(out[1].clone().into_vec::<f32>()?, vec![2.0; b_len]);
            let (by_id, cached, _, _) = counters(&engine);
            counts.push((by_id, cached));
        }
        engine.shutdown()?;
        Ok(counts)
    })
    .expect("run");
    for out in outs {
        assert_eq!(
            out.expect("rank"),
            vec![(0, 0), (0, 0), (0, 1), (0, 2), (2, 2)]
        );
    }
}

/// Values whose sums depend on their order (not small integers), rank- and tensor-
/// dependent.
fn odd_values(rank: usize, k: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| 1.0 / (1.0 + (rank * 7919 + k * 104_729 + i * 31) as f32 % 977.0) + 1e3)
        .collect()
}

/// The armed group's way of voting, if the engine is armed.
fn votes(engine: &FusionEngine) -> Option<Votes> {
    match &*engine.core.lock() {
        CoreState::Running(r) => r.engine.armed.as_ref().map(|a| a.votes),
        CoreState::Ended(_) => None,
    }
}

/// The cached-group step fuses the tensors in the order the general path does (by id,
/// not by their place in the group), and the armed step keeps every element in its
/// ring chunk or reduces the tensors where they lie in that order, so their results are
/// the general path's bit for bit, at 2 to 4 ranks over a ring (whose order of additions
/// depends on an element's place in the buffer) with every operation, and each other
/// algorithm (the hierarchical one over two nodes); for small groups (votes in slots) and large ones (votes first, reduced in
/// place where the algorithm allows, or votes with the flags of the shared-memory
/// reduction in place), with and without scaling.
#[test]
fn a_cached_group_step_gives_the_general_paths_bits() {
    use crate::{Algorithm, ReduceOp};
    let cases = [
        (Algorithm::Ring, ReduceOp::Sum, 1.0),
        (Algorithm::Ring, ReduceOp::Average, 1.0),
        (Algorithm::Ring, ReduceOp::Min, 1.0),
        (Algorithm::Ring, ReduceOp::Max, 1.0),
        (Algorithm::Ring, ReduceOp::Sum, 0.5),
        (Algorithm::RecursiveDoubling, ReduceOp::Sum, 1.0),
        (Algorithm::HalvingDoubling, ReduceOp::Sum, 1.0),
        (Algorithm::Direct, ReduceOp::Sum, 1.0),
        (Algorithm::ScatterGather, ReduceOp::Sum, 1.0),
        (Algorithm::ScatterGather, ReduceOp::Min, 1.0),
        (Algorithm::SharedMemory, ReduceOp::Sum, 1.0),
        (Algorithm::SharedMemory, ReduceOp::Max, 1.0),
        (Algorithm::SharedMemory, ReduceOp::Average, 1.0),
        (Algorithm::SharedMemory, ReduceOp::Sum, 0.5),
        (Algorithm::Hierarchical, ReduceOp::Sum, 1.0),
        (Algorithm::Hierarchical, ReduceOp::Average, 0.5),
        (Algorithm::Auto, ReduceOp::Max, 1.0),
        (Algorithm::Auto, ReduceOp::Average, 1.0),
    ];
    for (size, scale) in [(2, 1), (3, 1), (4, 1), (2, 600), (3, 600)] {
        // Two nodes (one, two, or two ranks each), which only the hierarchical
        // all-reduce looks at.
        let layout = [size - size / 2, size / 2];
        for (algorithm, op, prescale) in cases {
            let options = AllReduceOptions {
                prescale,
                ..AllReduceOptions::with_op(op).algorithm(algorithm)
            };
            let config = FusionConfig {
                options,
                ..FusionConfig::default()
            };
            let lens = [5usize, 1, 17, 0, 9, 33, 2].map(|n| n * scale);
            let bytes = lens.iter().sum::<usize>() * 4;
            let outs =
                Communicator::run_local_on_nodes(&layout, |comm| -> Result<(usize, usize)> {
                    let r = comm.rank();
                    let resolved = comm.resolve_algorithm(algorithm, bytes);
                    let in_place = comm.reduces_in_place(DType::F32, &options, lens.len(), bytes);
                    let want_votes = match (prescale == 1.0, in_place, resolved) {
                        // Its shares are not the ring's chunks that slots keep apart.
                        (_, _, Algorithm::Hierarchical) => Votes::First,
                        (true, true, Algorithm::SharedMemory) => Votes::InFlags,
                        (true, false, _) => Votes::InSlots,
                        (true, true, _) if bytes <= MAX_SLOT_VOTE_BYTES => Votes::InSlots,
                        _ => Votes::First,
                    };
                    let engine = FusionEngine::start(comm, config.clone())?;
                    let names: Vec<String> = (0..lens.len()).map(|k| format!("g{k}")).collect();
                    // Registered in this order: ids 0, 1, 2, ...
                    // Submitted as one group, so that one cycle fuses them all whatever the
                    // background thread's timing (tensors submitted one by one may be split
                    // over two cycles, whose sums differ in their last bits).
                    let all = TensorNames::new(&names);
                    let mut general = Vec::new();
                    for _ in 0..2 {
                        let tensors: Vec<Vec<f32>> =
                            (0..lens.len()).map(|k| odd_values(r, k, lens[k])).collect();
                        general = engine.submit_group(&all, tensors)?.wait()?;
                    }
                    // The group lists them in another order.
                    let order = [4usize, 0, 6, 2, 5, 1, 3];
                    let group = TensorNames::new(order.iter().map(|&k| &names[k]));
                    for _ in 0..3 {
                        let tensors: Vec<Vec<f32>> =
                            order.iter().map(|&k| odd_values(r, k, lens[k])).collect();
                        let out = engine.all_reduce_group(&group, tensors)?;
                        for (place, &k) in order.iter().enumerate() {
                            let got: Vec<u32> = out[place]
                                .clone()
                                .into_vec::<f32>()?
                                .iter()
                                .map(|v| v.to_bits())
                                .collect();
                            let want: Vec<u32> = general[k]
                                .clone()
                                .into_vec::<f32>()?
                                .iter()
                                .map(|v| v.to_bits())
                                .collect();
                            assert_eq!(got, want, "{algorithm} {op:?}, {size} ranks, tensor {k}");
                        }
                    }
                    let (_, cached, _, armed) = counters(&engine);
                    assert_eq!(
                        votes(&engine),
                        Some(want_votes),
                        "{algorithm} {op:?} x{prescale}, {size} ranks, {bytes} bytes"
                    );
                    engine.shutdown()?;
                    Ok((cached, armed))
                })
                .expect("run");
            for out in outs {
                // The group's first step notes its ids; the second is a cached step
                // with a round, the third an armed one.
                assert_eq!(
                    out.expect("rank"),
                    (2, 1),
                    "{algorithm} {op:?} x{prescale}, {size} ranks, {bytes} bytes: (cached steps, armed rounds)"
                );
            }
        }
    }
}

/// Ranks 0 and 2 take the cached-group step while rank 1 submits the group without
/// `y`: the others' bits differ, so the step goes on as the general path, `x` and `z`
/// are reduced, and `y` fails on every rank as a stall naming rank 1.
#[test]
fn a_rank_that_submits_another_group_fails_the_missing_tensor_on_every_rank() {
    let config = FusionConfig {
        stall_warning: Duration::from_millis(100),
        stall_error: Duration::from_millis(100),
        cycle_time: Duration::from_micros(200),
        ..FusionConfig::default()
    };
    let outs = Communicator::run_local(3, |comm| -> Result<String> {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, config.clone())?;
        let all = TensorNames::new(["x", "y", "z"]);
        for _ in 0..3 {
            let out = engine.all_reduce_group(&all, vec![vec![1.0f32; 2]; 3])?;
            assert_eq!(out[1].clone().into_vec::<f32>()?, vec![3.0; 2]);
        }
        let (_, cached, _, _) = counters(&engine);
        assert_eq!(cached, 1);
        let err = if r == 1 {
            let fewer = TensorNames::new(["x", "z"]);
            let out = engine.all_reduce_group(&fewer, vec![vec![1.0f32; 2]; 2])?;
            for t in out {
                assert_eq!(t.into_vec::<f32>()?, vec![3.0; 2]);
            }
            let mut seen = None;
            for _ in 0..500 {
                if let Some(e) = engine.take_foreign_failure() {
                    seen = Some(e);
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            seen.expect("the stall of y reaches rank 1")
        } else {
            engine
                .all_reduce_group(&all, vec![vec![1.0f32; 2]; 3])
                .expect_err("y was not submitted on rank 1")
        };
        let (_, cached, _, _) = counters(&engine);
        assert_eq!(cached, 1, "rank {r}: no cached step with other bits");
        engine.shutdown()?;
        Ok(err.to_string())
    })
    .expect("run");
    for out in outs {
        let msg = out.expect("rank");
        assert!(
            msg.contains("`y`") && msg.contains("not on ranks [1]"),
            "{msg}"
        );
    }
}

/// While armed, a rank that submits the group's tensors one by one votes against the
/// armed reduction; every rank still gets the sums (through rounds) and, once the group
/// comes from every rank again, is armed again.
///
/// With votes in slots (small tensors), votes first (tensors reduced where they lie by
/// the ring, which a vote against must leave as they were) and votes in the flags of the
/// shared-memory reduction in place (`auto` at this size), which must leave them too.
#[test]
fn single_submissions_on_one_rank_end_the_armed_group_and_still_reduce() {
    use crate::Algorithm;
    for (scale, algorithm, want_votes) in [
        (1, Algorithm::Auto, Votes::InSlots),
        (10_000, Algorithm::Ring, Votes::First),
        (10_000, Algorithm::Auto, Votes::InFlags),
    ] {
        single_submissions_end_the_armed_group(scale, algorithm, want_votes);
    }
}

fn single_submissions_end_the_armed_group(
    scale: usize,
    algorithm: crate::Algorithm,
    want_votes: Votes,
) {
    let config = FusionConfig {
        options: AllReduceOptions::sum().algorithm(algorithm),
        ..FusionConfig::default()
    };
    let outs = Communicator::run_local(3, |comm| -> Result<(usize, usize)> {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, config.clone())?;
        let names = TensorNames::new(["a", "b"]);
        let (a, b) = (3 * scale, 5 * scale);
        let step = |single: bool| -> Result<()> {
            let out = if single {
                let handles = vec![
                    engine.submit("a", vec![r as f32; a])?,
                    engine.submit("b", vec![1.0f32; b])?,
                ];
                engine.synchronize(handles)?
            } else {
                engine.all_reduce_group(&names, vec![vec![r as f32; a], vec![1.0f32; b]])?
            };
            assert_eq!(out[0].clone().into_vec::<f32>()?, vec![3.0; a]);
            assert_eq!(out[1].clone().into_vec::<f32>()?, vec![3.0; b]);
            Ok(())
        };
        for _ in 0..4 {
            step(false)?;
        }
        assert_eq!(votes(&engine), Some(want_votes), "rank {r}, x{scale}");
        let (_, cached, _, armed) = counters(&engine);
        step(r == 1)?;
        for _ in 0..3 {
            step(false)?;
        }
        let (_, cached_after, _, armed_after) = counters(&engine);
        engine.shutdown()?;
        Ok((cached_after - cached, armed_after - armed))
    })
    .expect("run");
    for (r, out) in outs.into_iter().enumerate() {
        // The vote against (one armed reduction), then: ranks 0 and 2 a cached step
        // with its round, and all three a cached step that arms again and two armed.
        let want = if r == 1 { (3, 3) } else { (4, 3) };
        assert_eq!(out.expect("rank"), want, "rank {r}, x{scale}");
    }
}

/// While armed, a rank that changes one tensor's shape votes against the group, and
/// every rank gets the mismatch error naming the tensor and each rank's shape.
#[test]
fn a_changed_shape_on_one_rank_ends_the_armed_group_with_a_mismatch() {
    let outs = Communicator::run_local(2, |comm| -> Result<String> {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default())?;
        let names = TensorNames::new(["a", "b"]);
        for _ in 0..4 {
            engine.all_reduce_group(&names, vec![vec![1.0f32; 2], vec![1.0f32; 3]])?;
        }
        let b_len = if r == 1 { 4 } else { 3 };
        let err = engine
            .all_reduce_group(&names, vec![vec![1.0f32; 2], vec![1.0f32; b_len]])
            .expect_err("the shapes of b differ");
        engine.shutdown()?;
        Ok(err.to_string())
    })
    .expect("run");
    for out in outs {
        let msg = out.expect("rank");
        assert!(
            msg.contains("`b`") && msg.contains("rank 0: f32[3], rank 1: f32[4]"),
            "{msg}"
        );
    }
}

/// Tensors walked into the slotted buffer put every element `c` places past its own
/// position, `c` its ring chunk, leave the slots (after each chunk) alone, and come back
/// whole; for every split of the elements into tensors tried, empty tensors and empty
/// chunks (fewer elements than ranks) included.
#[test]
fn a_walk_past_the_slots_keeps_every_element_in_its_ring_chunk() {
    for n in 1..9 {
        for len in 0..40 {
            let chunk_of = |at: usize| (0..n).find(|&c| ring_chunk_range(len, n, c).contains(&at));
            for piece in [1, 2, 3, 7, 40] {
                let values: Vec<usize> = (0..len).map(|i| 1000 + i).collect();
                let mut sizes: Vec<usize> = values.chunks(piece).map(<[usize]>::len).collect();
                sizes.insert(sizes.len() / 2, 0);
                let mut buf = vec![0usize; len + n];
                let mut walk = PastSlots::new(len, n);
                let mut rest = &values[..];
                for &m in &sizes {
                    walk.scatter(&mut buf, &rest[..m]);
                    rest = &rest[m..];
                }
                for (at, v) in values.iter().enumerate() {
                    let c = chunk_of(at).expect("in a chunk");
                    assert_eq!(buf[at + c], *v, "len {len}, {n} ranks, at {at}");
                }
                for c in 0..n {
                    assert_eq!(buf[ring_chunk_range(len, n, c).end + c], 0, "slot {c}");
                }
                let mut walk = PastSlots::new(len, n);
                let mut back = Vec::new();
                for &m in &sizes {
                    let mut dst = vec![0usize; m];
                    walk.gather(&buf, &mut dst);
                    back.extend(dst);
                }
                assert_eq!(back, values, "len {len}, {n} ranks, pieces of {piece}");
            }
        }
    }
}

/// A rank that stops submitting while the others take armed cached-group steps: its
/// engine votes against the group once idle, and the others' step ends with the
/// general path's stall error naming it and the tensor, instead of waiting for ever;
/// for groups and for repeated steps of single submissions, with votes in slots (small
/// tensors) and in the flags of the shared-memory reduction (large ones, `auto`).
#[test]
fn a_rank_that_stops_is_named_by_the_armed_step() {
    for single in [false, true] {
        for len in [4, 10_000] {
            a_rank_that_stops(single, len);
        }
    }
}

fn a_rank_that_stops(single: bool, len: usize) {
    let config = FusionConfig {
        stall_warning: Duration::from_millis(200),
        stall_error: Duration::from_millis(200),
        ..FusionConfig::default()
    };
    let outs = Communicator::run_local(3, |comm| -> Result<()> {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, config.clone())?;
        let names = TensorNames::new(["u", "v"]);
        let step = || -> Result<Vec<Tensor>> {
            if single {
                let handles = vec![
                    engine.submit("u", vec![1.0f32; len])?,
                    engine.submit("v", vec![1.0f32; len])?,
                ];
                engine.synchronize(handles)
            } else {
                engine.all_reduce_group(&names, vec![vec![1.0f32; len]; 2])
            }
        };
        for _ in 0..4 {
            step()?;
        }
        let want = if len > 4 {
            Votes::InFlags
        } else {
            Votes::InSlots
        };
        assert_eq!(
            votes(&engine),
            Some(want),
            "rank {r}, single {single}, {len}"
        );
        if r == 2 {
            std::thread::sleep(Duration::from_secs(4));
            drop(engine);
            return Ok(());
        }
        let result = step();
        drop(engine);
        result.map(|_| ())
    })
    .expect("run");
    for out in &outs[..2] {
        let msg = out
            .as_ref()
            .expect_err("a stopped rank must fail the step")
            .to_string();
        assert!(
            msg.contains("`u`") && msg.contains("not on ranks [2]"),
            "single {single}, {len} elements: {msg}"
        );
    }
}

/// A rank that stops taking part in the armed reduction itself: the others' wait ends
/// with an error naming it after the communicator's stall timeout.
///
/// With votes in slots (small tensors) and in the flags of the shared-memory reduction
/// (large ones, `auto`).
#[test]
fn a_rank_stuck_in_the_armed_reduction_is_named_at_the_stall_timeout() {
    for (len, want_votes) in [(4, Votes::InSlots), (10_000, Votes::InFlags)] {
        a_rank_stuck_in_the_armed_reduction(len, want_votes);
    }
}

fn a_rank_stuck_in_the_armed_reduction(len: usize, want_votes: Votes) {
    let outs = Communicator::run_local(3, |comm| -> Result<()> {
        comm.set_stall_timeout(Some(Duration::from_millis(300)));
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default())?;
        let names = TensorNames::new(["u", "v"]);
        for _ in 0..4 {
            engine.all_reduce_group(&names, vec![vec![1.0f32; len]; 2])?;
        }
        assert_eq!(votes(&engine), Some(want_votes), "rank {r}, {len} elements");
        if r == 2 {
            // Holds its engine (as a rank stuck in a device call would hold its
            // thread): no cycle of its own, no vote.
            let guard = engine.core.lock();
            std::thread::sleep(Duration::from_secs(2));
            drop(guard);
            drop(engine);
            return Ok(());
        }
        let result = engine.all_reduce_group(&names, vec![vec![1.0f32; len]; 2]);
        drop(engine);
        result.map(|_| ())
    })
    .expect("run");
    let mut named = false;
    for out in &outs[..2] {
        let msg = out
            .as_ref()
            .expect_err("a stopped rank must fail the step")
            .to_string();
        named |= msg.contains("waiting for rank 2");
        assert!(
            msg.contains("waiting for rank") || msg.contains("gone away"),
            "{len} elements: {msg}"
        );
    }
    assert!(named, "{len} elements: {outs:?}");
}

/// The first cached-group step of a group is one negotiation round (the one its bits
/// take anyway), in which every rank asks to arm; every later step of the same group
/// is one armed reduction and no round at all.
#[test]
fn a_cached_group_step_after_the_first_takes_no_round() {
    let outs = Communicator::run_local(3, |comm| -> Result<Vec<(usize, usize, usize)>> {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default())?;
        let names = TensorNames::new(["p", "q", "s", "t"]);
        let mut deltas = Vec::new();
        for _ in 0..6 {
            let (_, cached0, rounds0, armed0) = counters(&engine);
            let tensors: Vec<Vec<f32>> = (0..4).map(|k| vec![(r + k) as f32; 3]).collect();
            let out = engine.all_reduce_group(&names, tensors)?;
            for (k, t) in out.into_iter().enumerate() {
                assert_eq!(t.into_vec::<f32>()?, vec![(3 + 3 * k) as f32; 3]);
            }
            let (_, cached1, rounds1, armed1) = counters(&engine);
            deltas.push((cached1 - cached0, rounds1 - rounds0, armed1 - armed0));
        }
        engine.shutdown()?;
        Ok(deltas)
    })
    .expect("run");
    for out in outs {
        let deltas = out.expect("rank");
        // Step 3 is a cached step with its round (idle rounds of the background thread
        // may add to it on a loaded machine); from step 4 on, no round.
        assert_eq!((deltas[2].0, deltas[2].2), (1, 0), "{deltas:?}");
        assert!(deltas[2].1 >= 1, "{deltas:?}");
        assert_eq!(deltas[3..], [(1, 0, 1); 3], "{deltas:?}");
    }
}

/// A long cycle time: the background thread never queues what a repeated step holds
/// before its `synchronize` (which is what these tests look at), however loaded the
/// machine.
fn patient() -> FusionConfig {
    FusionConfig {
        cycle_time: Duration::from_secs(30),
        ..FusionConfig::default()
    }
}

/// Runs `body` on `size` local ranks, each with an engine of [`patient`] settings (shut
/// down after it), and returns each rank's result; any rank's error fails the test.
fn on_patient_engines<T: Send>(
    size: usize,
    body: impl Fn(&FusionEngine) -> Result<T> + Sync,
) -> Vec<T> {
    let outs = Communicator::run_local(size, |comm| -> Result<T> {
        let engine = FusionEngine::start(comm, patient())?;
        let out = body(&engine)?;
        engine.shutdown()?;
        Ok(out)
    })
    .expect("run");
    outs.into_iter()
        .enumerate()
        .map(|(r, out)| out.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

/// One step of single submissions: tensor `k` of `lens` under `names[k]` with
/// [`odd_values`] of (rank, `k` + `salt`), in the order of `order`, synchronized in
/// reverse order; returns the results by `k`.
fn single_step(
    engine: &FusionEngine,
    names: &[&str],
    lens: &[usize],
    order: &[usize],
    salt: usize,
) -> Result<Vec<Vec<f32>>> {
    let r = engine.rank();
    let mut handles: Vec<(usize, Handle)> = Vec::new();
    for &k in order {
        let h = engine.submit(names[k], odd_values(r, k + salt, lens[k]))?;
        handles.push((k, h));
    }
    handles.reverse();
    let (ks, hs): (Vec<usize>, Vec<Handle>) = handles.into_iter().unzip();
    let out = engine.synchronize(hs)?;
    let mut by_k = vec![Vec::new(); names.len()];
    for (k, t) in ks.into_iter().zip(out) {
        by_k[k] = t.into_vec::<f32>()?;
    }
    Ok(by_k)
}

/// The sums of [`odd_values`] over `size` ranks, added in rank order.
fn odd_sums(size: usize, lens: &[usize], salt: usize) -> Vec<Vec<f32>> {
    (0..lens.len())
        .map(|k| {
            (0..lens[k])
                .map(|i| (0..size).map(|r| odd_values(r, k + salt, lens[k])[i]).sum())
                .collect()
        })
        .collect()
}

/// True when `got` has every tensor of `want`, each as long, within 1e-3 element by
/// element.
fn close_to(got: &[Vec<f32>], want: &[Vec<f32>]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| g.len() == w.len() && g.iter().zip(w).all(|(a, b)| (a - b).abs() <= 1e-3))
}

/// Single submissions that repeat the last synchronized step, name for name, are
/// reduced as one cached group: the second such step registers the group, the third
/// takes the cached-group step with its round, and every later one is an armed
/// reduction without a round. The results are the general path's bit for bit, and
/// come back in the order of the handles given to `synchronize`.
#[test]
fn a_repeated_step_of_single_submissions_becomes_an_armed_group() {
    for size in [2, 3] {
        on_patient_engines(size, |engine| -> Result<()> {
            let names = ["w0", "b0", "w1", "b1", "w2"];
            let lens = [40, 3, 17, 1, 64];
            let order = [0, 1, 2, 3, 4];
            let mut deltas = Vec::new();
            let mut results = Vec::new();
            for _ in 0..6 {
                let (_, cached0, rounds0, armed0) = counters(engine);
                results.push(single_step(engine, &names, &lens, &order, 0)?);
                let (_, cached1, rounds1, armed1) = counters(engine);
                deltas.push((cached1 - cached0, rounds1 - rounds0, armed1 - armed0));
            }
            // The general path (steps 1 and 2) and the cached ones give the same bits;
            // within a few ulps of the sums added in rank order.
            for step in &results[1..] {
                assert_eq!(step, &results[0], "size {size}");
            }
            let want = odd_sums(size, &lens, 0);
            assert!(close_to(&results[0], &want), "{:?}", results[0]);
            assert_eq!(
                deltas[..2].iter().map(|d| d.0).sum::<usize>(),
                0,
                "{deltas:?}"
            );
            assert_eq!((deltas[2].0, deltas[2].2), (1, 0), "{deltas:?}");
            assert_eq!(deltas[3..], [(1, 0, 1); 3], "{deltas:?}");
            Ok(())
        });
    }
}

/// A repeated step that one rank departs from (another order, then a changed shape)
/// goes the general path on every rank: the sums still arrive, the changed shape fails
/// on every rank naming the tensor, and the steps after it are cached again.
#[test]
fn a_rank_that_departs_from_the_repeated_step_still_gets_its_sums() {
    let errors = on_patient_engines(3, |engine| -> Result<String> {
        let r = engine.rank();
        let names = ["p", "q", "s", "t"];
        let lens = [5, 9, 2, 30];
        let order = [0, 1, 2, 3];
        let want = odd_sums(3, &lens, 7);
        let close = |got: &[Vec<f32>]| close_to(got, &want);
        for _ in 0..4 {
            assert!(close(&single_step(engine, &names, &lens, &order, 7)?));
        }
        let swapped = if r == 1 { [0, 2, 1, 3] } else { order };
        assert!(close(&single_step(engine, &names, &lens, &swapped, 7)?));
        for _ in 0..3 {
            assert!(close(&single_step(engine, &names, &lens, &order, 7)?));
        }
        let (_, cached, _, _) = counters(engine);
        let mut changed = lens;
        if r == 2 {
            changed[1] = 10;
        }
        let err =
            single_step(engine, &names, &changed, &order, 7).expect_err("the shapes of q differ");
        for _ in 0..4 {
            assert!(close(&single_step(engine, &names, &lens, &order, 7)?));
        }
        let (_, cached_after, _, _) = counters(engine);
        assert!(
            cached_after > cached,
            "rank {r}: cached again after the mismatch"
        );
        Ok(err.to_string())
    });
    for msg in errors {
        assert!(msg.contains("`q`") && msg.contains("10"), "{msg}");
    }
}

/// The names of the three-tensor step that the repeated-step tests take.
const STEP: [&str; 3] = ["a", "b", "c"];

/// Submits tensor `k` of [`STEP`] on `engine`: four elements of `rank + k`, which sum to
/// [`step_sum`]`(k)` over 2 ranks.
fn submit_step(engine: &FusionEngine, k: usize) -> Result<Handle> {
    engine.submit(STEP[k], vec![(engine.rank() + k) as f32; 4])
}

/// Tensor `k` of [`STEP`] reduced over 2 ranks.
fn step_sum(k: usize) -> Vec<f32> {
    vec![(1 + 2 * k) as f32; 4]
}

/// The handles of a repeated step waited one by one, a part at a time, or some dropped
/// unwaited: the held tensors go the general path, and every result still arrives.
#[test]
fn a_repeated_step_waited_in_parts_or_dropped_in_part_still_reduces() {
    on_patient_engines(2, |engine| -> Result<()> {
        let submit = |k: usize| submit_step(engine, k);
        let whole = || -> Result<()> {
            let hs = (0..3).map(submit).collect::<Result<Vec<_>>>()?;
            for (k, t) in engine.synchronize(hs)?.into_iter().enumerate() {
                assert_eq!(t.into_vec::<f32>()?, step_sum(k));
            }
            Ok(())
        };
        for _ in 0..4 {
            whole()?;
        }
        // One by one.
        let hs = (0..3).map(submit).collect::<Result<Vec<_>>>()?;
        for (k, h) in hs.into_iter().enumerate() {
            assert_eq!(h.wait()?.into_vec::<f32>()?, step_sum(k));
        }
        // A part, then the rest.
        whole()?;
        let mut hs = (0..3).map(submit).collect::<Result<Vec<_>>>()?;
        let last = hs.split_off(1);
        assert_eq!(
            engine.synchronize(hs)?[0].clone().into_vec::<f32>()?,
            step_sum(0)
        );
        let rest = engine.synchronize(last)?;
        assert_eq!(rest[1].clone().into_vec::<f32>()?, step_sum(2));
        // One dropped unwaited.
        whole()?;
        let mut hs = (0..3).map(submit).collect::<Result<Vec<_>>>()?;
        drop(hs.remove(1));
        let out = engine.synchronize(hs)?;
        assert_eq!(out[1].clone().into_vec::<f32>()?, step_sum(2));
        whole()
    });
}

/// The handles of a held step carry their names and keep their engine: one shut down
/// before they are waited still gives their sums (every rank submitted them, so the
/// last cycles reduce them), one dropped unwaited after it lets its result go, and once
/// those handles are gone nothing keeps the engine (the learned names, which the
/// handles share, no longer lead back to it from the engine's side).
#[test]
fn held_handles_outlive_their_engine_and_then_let_it_go() {
    let outs = Communicator::run_local(2, |comm| -> Result<()> {
        let engine = FusionEngine::start(comm, patient())?;
        let submit = |k: usize| submit_step(&engine, k);
        for _ in 0..3 {
            let hs = (0..3).map(submit).collect::<Result<Vec<_>>>()?;
            engine.synchronize(hs)?;
        }
        assert_eq!(
            engine.core.repeated().spares(),
            3,
            "a held step's handles give their references back to the next"
        );
        let mut hs = (0..3).map(submit).collect::<Result<Vec<_>>>()?;
        assert_eq!(engine.core.repeated().spares(), 0, "and it takes them");
        assert!(
            hs.iter().all(|h| matches!(h.owner, Owner::Held { .. })),
            "the fourth step is held"
        );
        let got: Vec<&str> = hs.iter().map(Handle::name).collect();
        assert_eq!(got, STEP);
        assert!(format!("{:?}", hs[1]).contains("\"b\""), "{:?}", hs[1]);
        let core = Arc::downgrade(&engine.core);
        engine.shutdown()?;
        assert!(core.upgrade().is_some(), "the handles keep the engine");
        drop(hs.pop());
        for (k, h) in hs.into_iter().enumerate() {
            assert_eq!(h.wait()?.into_vec::<f32>()?, step_sum(k));
        }
        assert!(core.upgrade().is_none(), "nothing else keeps it");
        Ok(())
    })
    .expect("run");
    for (r, out) in outs.into_iter().enumerate() {
        out.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// A group submitted in the middle of a held step (its batch's ticket drawn between the
/// step's reserved ones): the step and the group still reduce to their sums on every
/// rank, whether a cycle queued the held tensors first or `synchronize` found the group
/// queued.
#[test]
fn a_group_submitted_in_the_middle_of_a_held_step_still_reduces() {
    on_patient_engines(2, |engine| -> Result<()> {
        let r = engine.rank();
        let submit = |k: usize| submit_step(engine, k);
        let group = TensorNames::new(["g0", "g1"]);
        for step in 0..6 {
            let mut hs = vec![submit(0)?];
            let gh = (step >= 2)
                .then(|| {
                    let tensors = vec![vec![(r + 10) as f32; 3], vec![(r + 20) as f32; 2]];
                    engine.submit_group(&group, tensors)
                })
                .transpose()?;
            hs.push(submit(1)?);
            hs.push(submit(2)?);
            // The first is held; the others too unless the cycle the group's submission
            // wakes has queued the step by then.
            if step >= 1 {
                assert!(matches!(hs[0].owner, Owner::Held { .. }), "step {step}");
            }
            for (k, t) in engine.synchronize(hs)?.into_iter().enumerate() {
                assert_eq!(t.into_vec::<f32>()?, step_sum(k));
            }
            if let Some(gh) = gh {
                let got = gh.wait()?;
                assert_eq!(got[0].clone().into_vec::<f32>()?, vec![21.0; 3]);
                assert_eq!(got[1].clone().into_vec::<f32>()?, vec![41.0; 2]);
            }
        }
        Ok(())
    });
}

/// A rank whose steps take another order from some step on, departing from the learned
/// one after its first tensor, learns the new order from that step and holds its steps
/// again from the next: the cached-group steps resume on every rank.
#[test]
fn a_rank_that_changes_its_order_for_good_learns_the_new_one() {
    let cached_by_rank = on_patient_engines(3, |engine| -> Result<Vec<usize>> {
        let r = engine.rank();
        let names = ["p", "q", "s", "t"];
        let lens = [5, 9, 2, 30];
        let want = odd_sums(3, &lens, 3);
        let mut cached = Vec::new();
        for step in 0..9 {
            let order = if r == 1 && step >= 4 {
                [0, 2, 1, 3]
            } else {
                [0, 1, 2, 3]
            };
            let got = single_step(engine, &names, &lens, &order, 3)?;
            assert!(close_to(&got, &want), "rank {r} step {step}: {got:?}");
            cached.push(counters(engine).1);
        }
        Ok(cached)
    });
    for (r, cached) in cached_by_rank.into_iter().enumerate() {
        // Step 4 departs on rank 1 (and teaches it the new order); from step 5 on every
        // rank holds its step again: one cached step each.
        let last: Vec<usize> = cached[5..].windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(last, [1, 1, 1], "rank {r}: {cached:?}");
    }
}

/// Where one rank has no shared memory, `auto` arms a large group with a vote first (the
/// segment's absence is settled by the group's own reductions, the same on every rank),
/// never with the flags of a shared-memory reduction, and every step still reduces.
#[test]
fn without_shared_memory_an_armed_group_votes_without_it() {
    let outs = Communicator::run_local(3, |mut comm| -> Result<Option<Votes>> {
        let r = comm.rank();
        if r == 1 {
            comm.set_shared_memory_dir(None);
        }
        let engine = FusionEngine::start(comm, FusionConfig::default())?;
        let names = TensorNames::new(["a", "b"]);
        for _ in 0..4 {
            let out = engine
                .all_reduce_group(&names, vec![vec![r as f32; 30_000], vec![1.0f32; 50_000]])?;
            assert_eq!(out[0].clone().into_vec::<f32>()?, vec![3.0; 30_000]);
            assert_eq!(out[1].clone().into_vec::<f32>()?, vec![3.0; 50_000]);
        }
        let armed = votes(&engine);
        engine.shutdown()?;
        Ok(armed)
    })
    .expect("run");
    for (r, out) in outs.into_iter().enumerate() {
        assert_eq!(out.expect("rank"), Some(Votes::First), "rank {r}");
    }
}

/// Engines started with different settings fail on every rank at once, naming each
/// setting that differs and each rank's value, before any tensor is reduced; without the
/// check the ranks fuse different buffers (a length error at best) or quietly compute
/// different sums.
#[test]
fn engines_started_with_different_settings_fail_on_every_rank() {
    use crate::{Algorithm, ReduceOp};
    let outs = Communicator::run_local(3, |mut comm| {
        let r = comm.rank();
        let mut config = FusionConfig::default();
        if r == 1 {
            config.threshold_bytes = 1024;
            config.options.op = ReduceOp::Average;
        }
        if r == 2 {
            config.options.algorithm = Algorithm::Ring;
            comm.set_segment_bytes(4096);
        }
        // Settings that are each rank's own do not count.
        config.cycle_time = Duration::from_millis(1 + r as u64);
        config.stall_warning = Duration::from_secs(10 + r as u64);
        FusionEngine::start(comm, config).map(|engine| engine.shutdown())
    })
    .expect("run");
    for out in outs {
        let message = out.err().map(|e| e.to_string()).unwrap_or_default();
        for want in [
            "ranks were started with different fusion engine settings: ",
            "threshold_bytes: ranks 0, 2 = 67108864, rank 1 = 1024",
            "op: ranks 0, 2 = sum, rank 1 = average",
            "algorithm: ranks 0-1 = auto, rank 2 = ring",
            "segment_bytes: ranks 0-1 = ",
        ] {
            assert!(message.contains(want), "{want} not in: {message}");
        }
        assert!(
            !message.contains("cycle") && !message.contains("stall"),
            "{message}"
        );
    }
    // The same settings start.
    let outs = Communicator::run_local(2, |comm| {
        let config = FusionConfig {
            cycle_time: Duration::from_millis(1 + comm.rank() as u64),
            ..FusionConfig::default()
        };
        FusionEngine::start(comm, config)?.shutdown()
    })
    .expect("run");
    assert!(outs.iter().all(Result::is_ok), "{outs:?}");
}
