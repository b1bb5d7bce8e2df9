//! Subgroups reduce among their own ranks only, and their messages never mix with the
//! parent communicator's.

use std::time::Duration;

use ringtrain_collective::{Algorithm, AllReduceOptions, Communicator};

#[test]
fn subgroups_reduce_among_their_members_only() {
    let out = Communicator::run_local(4, |mut comm| {
        let rank = comm.rank();
        let members: Vec<usize> = (0..4).filter(|r| r % 2 == rank % 2).collect();
        let mut sub = comm.subgroup(&members).unwrap();
        assert_eq!((sub.rank(), sub.size()), (rank / 2, 2));
        // A message on the parent in flight does not reach the subgroup.
        let mut whole = [rank as f32 + 1.0];
        let mut part = [rank as f32 + 1.0; 5];
        sub.all_reduce(&mut part, &AllReduceOptions::sum()).unwrap();
        comm.all_reduce(&mut whole, &AllReduceOptions::sum())
            .unwrap();
        let gathered = sub.all_gather(&[rank as u32]).unwrap();
        (part[0], whole[0], gathered)
    })
    .unwrap();
    // Even ranks: 1 + 3; odd: 2 + 4; everyone: 10.
    assert_eq!(out[0].0, 4.0);
    assert_eq!(out[2].0, 4.0);
    assert_eq!(out[1].0, 6.0);
    assert_eq!(out[3].0, 6.0);
    assert!(out.iter().all(|o| o.1 == 10.0));
    assert_eq!(out[3].2, vec![vec![1], vec![3]]);
}

#[test]
fn a_group_without_this_rank_is_an_error() {
    let out = Communicator::run_local(2, |comm| {
        comm.subgroup(&[1 - comm.rank()])
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    assert!(out
        .iter()
        .all(|e| e.as_deref().is_some_and(|e| e.contains("subgroup"))));
}

/// The direct and scatter-gather all-reduces map their peers through the subgroup: three
/// of five ranks sum among themselves while the other two do the same beside them.
#[test]
fn direct_and_scatter_gather_all_reduces_stay_within_the_subgroup() {
    for algorithm in [Algorithm::Direct, Algorithm::ScatterGather] {
        let out = Communicator::run_local(5, |comm| {
            let rank = comm.rank();
            let members: Vec<usize> = (0..5).filter(|r| r % 2 == rank % 2).collect();
            let mut sub = comm.subgroup(&members).unwrap();
            let mut v = [rank as f32 + 1.0; 7];
            let opts = AllReduceOptions::sum().algorithm(algorithm);
            sub.all_reduce(&mut v, &opts).unwrap();
            v
        })
        .unwrap();
        // Even ranks: 1 + 3 + 5; odd: 2 + 4; in every chunk.
        for (rank, v) in out.iter().enumerate() {
            let want = if rank % 2 == 0 { 9.0 } else { 6.0 };
            assert_eq!(v, &[want; 7], "{algorithm}, rank {rank}");
        }
    }
}

/// A subgroup's shared-memory all-reduce that stalls: the waiting rank and the rank it
/// waits for are named by their numbers in the whole communicator (ranks 0 and 2), not
/// in the subgroup (0 and 1).
#[test]
fn a_stall_in_a_subgroup_names_ranks_as_the_whole_job_numbers_them() {
    let out = Communicator::run_local(3, |comm| {
        let rank = comm.rank();
        let members: Vec<usize> = if rank == 1 { vec![1] } else { vec![0, 2] };
        let mut sub = comm.subgroup(&members).unwrap();
        sub.set_stall_timeout(Some(Duration::from_millis(300)));
        let shm = AllReduceOptions::sum().algorithm(Algorithm::SharedMemory);
        // The segment mapped, then rank 2 stops taking part.
        sub.all_reduce(&mut [1.0f32; 64], &shm).unwrap();
        if rank != 0 {
            std::thread::sleep(Duration::from_secs(2));
            return None;
        }
        sub.all_reduce(&mut [1.0f32; 64], &shm)
            .err()
            .map(|e| e.to_string())
    })
    .unwrap();
    let msg = out[0].as_deref().expect("rank 0's wait fails");
    assert!(
        msg.starts_with("rank 0:") && msg.contains("waiting for rank 2"),
        "{msg}"
    );
}
