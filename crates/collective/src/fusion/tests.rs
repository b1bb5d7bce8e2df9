use super::cached::chunk_of;
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

/// The cached-group step fuses the tensors in the order the general path does (by id,
/// not by their place in the group), and the armed step keeps every element in its
/// ring chunk, so their results are the general path's bit for bit, at 2 to 4 ranks
/// over a ring (whose order of additions depends on an element's place in the
/// buffer) with every operation, and each other algorithm.
#[test]
fn a_cached_group_step_gives_the_general_paths_bits() {
    let cases = [
        (crate::Algorithm::Ring, crate::ReduceOp::Sum),
        (crate::Algorithm::Ring, crate::ReduceOp::Average),
        (crate::Algorithm::Ring, crate::ReduceOp::Min),
        (crate::Algorithm::Ring, crate::ReduceOp::Max),
        (crate::Algorithm::RecursiveDoubling, crate::ReduceOp::Sum),
        (crate::Algorithm::HalvingDoubling, crate::ReduceOp::Sum),
        (crate::Algorithm::Direct, crate::ReduceOp::Sum),
        (crate::Algorithm::ScatterGather, crate::ReduceOp::Sum),
        (crate::Algorithm::ScatterGather, crate::ReduceOp::Min),
        (crate::Algorithm::Auto, crate::ReduceOp::Max),
    ];
    for size in [2, 3, 4] {
        for (algorithm, op) in cases {
            let config = FusionConfig {
                options: AllReduceOptions::with_op(op).algorithm(algorithm),
                ..FusionConfig::default()
            };
            let outs = Communicator::run_local(size, |comm| -> Result<(usize, usize)> {
                let r = comm.rank();
                let engine = FusionEngine::start(comm, config.clone())?;
                let lens = [5usize, 1, 17, 0, 9, 33, 2];
                let names: Vec<String> = (0..lens.len()).map(|k| format!("g{k}")).collect();
                // Registered in this order: ids 0, 1, 2, ...
                let mut general = Vec::new();
                for _ in 0..2 {
                    let handles = names
                        .iter()
                        .enumerate()
                        .map(|(k, n)| engine.submit(n, odd_values(r, k, lens[k])))
                        .collect::<Result<Vec<_>>>()?;
                    general = engine.synchronize(handles)?;
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
                    "{algorithm} {op:?}, {size} ranks: (cached steps, armed rounds)"
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
#[test]
fn single_submissions_on_one_rank_end_the_armed_group_and_still_reduce() {
    let outs = Communicator::run_local(3, |comm| -> Result<(usize, usize)> {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default())?;
        let names = TensorNames::new(["a", "b"]);
        let step = |single: bool| -> Result<()> {
            let out = if single {
                let handles = vec![
                    engine.submit("a", vec![r as f32; 3])?,
                    engine.submit("b", vec![1.0f32; 5])?,
                ];
                engine.synchronize(handles)?
            } else {
                engine.all_reduce_group(&names, vec![vec![r as f32; 3], vec![1.0f32; 5]])?
            };
            assert_eq!(out[0].clone().into_vec::<f32>()?, vec![3.0; 3]);
            assert_eq!(out[1].clone().into_vec::<f32>()?, vec![3.0; 5]);
            Ok(())
        };
        for _ in 0..4 {
            step(false)?;
        }
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
        assert_eq!(out.expect("rank"), want, "rank {r}");
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

/// Every element lies in the ring chunk `chunk_of` names.
#[test]
fn chunk_of_agrees_with_the_ring_chunks() {
    for n in 1..9 {
        for len in 0..40 {
            for c in 0..n {
                for at in ring_chunk_range(len, n, c) {
                    assert_eq!(chunk_of(len, n, at), c, "len {len}, {n} ranks, at {at}");
                }
            }
        }
    }
}

/// A rank that stops submitting while the others take armed cached-group steps: its
/// engine votes against the group once idle, and the others' step ends with the
/// general path's stall error naming it and the tensor, instead of waiting for ever.
#[test]
fn a_rank_that_stops_is_named_by_the_armed_step() {
    let config = FusionConfig {
        stall_warning: Duration::from_millis(200),
        stall_error: Duration::from_millis(200),
        ..FusionConfig::default()
    };
    let outs = Communicator::run_local(3, |comm| -> Result<()> {
        let r = comm.rank();
        let engine = FusionEngine::start(comm, config.clone())?;
        let names = TensorNames::new(["u", "v"]);
        for _ in 0..4 {
            engine.all_reduce_group(&names, vec![vec![1.0f32; 4]; 2])?;
        }
        let armed = match &*engine.core.lock() {
            CoreState::Running(r) => r.engine.armed.is_some(),
            CoreState::Ended(_) => false,
        };
        assert!(armed, "rank {r}");
        if r == 2 {
            std::thread::sleep(Duration::from_secs(4));
            drop(engine);
            return Ok(());
        }
        let result = engine.all_reduce_group(&names, vec![vec![1.0f32; 4]; 2]);
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
            "{msg}"
        );
    }
}

/// A rank that stops taking part in the armed reduction itself: the others' wait ends
/// with an error naming it after the communicator's stall timeout.
#[test]
fn a_rank_stuck_in_the_armed_reduction_is_named_at_the_stall_timeout() {
    let outs = Communicator::run_local(3, |comm| -> Result<()> {
        comm.set_stall_timeout(Some(Duration::from_millis(300)));
        let r = comm.rank();
        let engine = FusionEngine::start(comm, FusionConfig::default())?;
        let names = TensorNames::new(["u", "v"]);
        for _ in 0..4 {
            engine.all_reduce_group(&names, vec![vec![1.0f32; 4]; 2])?;
        }
        if r == 2 {
            // Holds its engine (as a rank stuck in a device call would hold its
            // thread): no cycle of its own, no vote.
            let guard = engine.core.lock();
            std::thread::sleep(Duration::from_secs(2));
            drop(guard);
            drop(engine);
            return Ok(());
        }
        let result = engine.all_reduce_group(&names, vec![vec![1.0f32; 4]; 2]);
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
            "{msg}"
        );
    }
    assert!(named, "{outs:?}");
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
