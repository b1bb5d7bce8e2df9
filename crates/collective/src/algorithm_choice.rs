//! Which algorithm [`crate::Algorithm::Auto`] runs: the switch points between direct,
//! recursive doubling, scatter-gather, halving-doubling, the ring and shared memory
//! measured with `ringtrain bench allreduce` (against `MPI_Allreduce` in the same runs),
//! kept beside the measurements that chose them
//! (`algorithm_choice.md`, shown below; `scripts/measure-algorithm-choice` measures them
//! again).
//!
//! For every measured rank count the table lists, by message size, the fastest of them;
//! rank counts above the largest measured one use its row (see [`measured_choice`]).
//! Where every rank maps one shared-memory segment, the shared-memory all-reduce takes
//! over from a size per rank count ([`shared_memory_from`]); where some rank cannot, the
//! table of the others decides.
//! [`crate::Communicator::set_auto_threshold_bytes`] replaces the table with a fixed
//! two-way rule.
//!
//! `MPI_Allreduce` is not a candidate, even where it was measured faster: a rank that
//! waits inside it cannot say which rank it waits for (MPI does not tell), and every
//! reduction of the fusion engine and the trainer runs `auto`, whose stall errors name
//! the stopped rank. Choose [`crate::Algorithm::Mpi`] explicitly to use it.
//!
#![doc = include_str!("algorithm_choice.md")]

use crate::options::Algorithm;

/// Switch points per rank count: `(ranks, [(below_bytes, algorithm), ...])`, sizes
/// increasing; the algorithm of the first entry whose `below_bytes` exceeds the message
/// size is chosen (`usize::MAX` ends every row). Keep in step with
/// `algorithm_choice.md` (a test compares them).
pub const SWITCH_POINTS: &[(usize, &[(usize, Algorithm)])] = &[
    (
        2,
        &[
            (64 << 10, Algorithm::RecursiveDoubling),
            (usize::MAX, Algorithm::Ring),
        ],
    ),
    (
        3,
        &[
            (32 << 10, Algorithm::Direct),
            (64 << 10, Algorithm::RecursiveDoubling),
            (1 << 20, Algorithm::ScatterGather),
            (usize::MAX, Algorithm::Ring),
        ],
    ),
    (
        4,
        &[
            (16 << 10, Algorithm::Direct),
            (128 << 10, Algorithm::RecursiveDoubling),
            (2 << 20, Algorithm::ScatterGather),
            (usize::MAX, Algorithm::HalvingDoubling),
        ],
    ),
];

/// From which message size `auto` takes the shared-memory all-reduce
/// ([`Algorithm::SharedMemory`]) where every rank maps one segment: `(ranks,
/// from_bytes)`, rank counts increasing. Keep in step with `algorithm_choice.md` (a test
/// compares them).
pub const SHARED_MEMORY_FROM: &[(usize, usize)] = &[(2, 4), (3, 512), (4, 512)];

/// The size from which `auto` takes [`Algorithm::SharedMemory`] on `ranks` ranks that
/// share a segment: the row of the largest measured count at most `ranks` (the first
/// row below it). Messages smaller than that take [`measured_choice`].
pub fn shared_memory_from(ranks: usize) -> usize {
    SHARED_MEMORY_FROM
        .iter()
        .rev()
        .find(|(r, _)| *r <= ranks)
        .or(SHARED_MEMORY_FROM.first())
        .map_or(usize::MAX, |(_, from)| *from)
}

/// The measured choice for `bytes` bytes on `ranks` ranks (before the transport's
/// abilities are considered). Above the largest measured rank count, every count takes
/// recursive doubling where the row says direct and halving-doubling where it says
/// scatter-gather (both send N − 1 messages per rank in a step, and were measured at 4
/// ranks at most), and a count that is not a power of two then takes the ring where
/// that gives halving-doubling.
pub fn measured_choice(ranks: usize, bytes: usize) -> Algorithm {
    let largest = SWITCH_POINTS.last().map_or(0, |(r, _)| *r);
    let chosen = row_choice(ranks, bytes);
    if ranks <= largest {
        return chosen;
    }
    match chosen {
        Algorithm::Direct => Algorithm::RecursiveDoubling,
        Algorithm::HalvingDoubling | Algorithm::ScatterGather if !ranks.is_power_of_two() => {
            Algorithm::Ring
        }
        Algorithm::ScatterGather => Algorithm::HalvingDoubling,
        _ => chosen,
    }
}

/// The algorithm the table's row for `ranks` names for `bytes`.
fn row_choice(ranks: usize, bytes: usize) -> Algorithm {
    let row = SWITCH_POINTS
        .iter()
        .rev()
        .find(|(r, _)| *r <= ranks)
        .or(SWITCH_POINTS.first())
        .map(|(_, row)| *row)
        .unwrap_or(&[]);
    row.iter()
        .find(|(below, _)| bytes < *below)
        .map(|(_, a)| *a)
        .unwrap_or(Algorithm::Ring)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cells of the first table after `heading` in the markdown: its rows after the
    /// header and the separator.
    fn markdown_table(heading: &str) -> Vec<Vec<String>> {
        let text = include_str!("algorithm_choice.md");
        let start = text
            .find(heading)
            .unwrap_or_else(|| panic!("the markdown has a {heading} section"));
        text[start..]
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .skip(2)
            .map(|l| {
                l.trim_matches('|')
                    .split('|')
                    .map(|c| c.trim().to_string())
                    .collect()
            })
            .collect()
    }

    /// The "Switch points" table of the markdown, as `(ranks, below_bytes, algorithm)`.
    fn documented() -> Vec<(usize, usize, Algorithm)> {
        markdown_table("## Switch points")
            .iter()
            .map(|cells| {
                let ranks = cells[0].parse().expect("ranks");
                let below = match cells[1].as_str() {
                    "any" => usize::MAX,
                    b => b.parse().expect("below bytes"),
                };
                (ranks, below, cells[2].parse().expect("algorithm"))
            })
            .collect()
    }

    #[test]
    fn auto_resolves_through_the_table_unless_a_threshold_is_set() {
        for ranks in [2usize, 3, 4, 6] {
            crate::Communicator::run_local(ranks, |mut comm| {
                // Once a rank has no shared memory, every rank knows it after the first
                // all-reduce that would use it, and the table of the others decides.
                if comm.rank() == ranks - 1 {
                    comm.set_shared_memory_dir(None);
                }
                let mut v = vec![1.0f32; 1 << 12];
                comm.all_reduce(&mut v, &crate::AllReduceOptions::sum())
                    .unwrap();
                assert_eq!(v, vec![ranks as f32; 1 << 12]);
                for bytes in [4usize, 4 << 10, 8 << 10, 64 << 10, 128 << 10, 1 << 20] {
                    assert_eq!(
                        comm.resolve_algorithm(Algorithm::Auto, bytes),
                        measured_choice(ranks, bytes),
                        "{ranks} ranks, {bytes} bytes"
                    );
                    assert_eq!(
                        comm.resolve_algorithm(Algorithm::Mpi, bytes),
                        Algorithm::Mpi
                    );
                }
                comm.set_auto_threshold_bytes(100);
                assert_eq!(
                    comm.resolve_algorithm(Algorithm::Auto, 99),
                    Algorithm::RecursiveDoubling
                );
                assert_eq!(
                    comm.resolve_algorithm(Algorithm::Auto, 100),
                    Algorithm::Ring
                );
            })
            .unwrap();
        }
    }

    /// The "Shared memory" table of the markdown, as `(ranks, from_bytes)`.
    fn documented_shared_memory() -> Vec<(usize, usize)> {
        markdown_table("## Shared memory")
            .iter()
            .map(|cells| {
                (
                    cells[0].parse().expect("ranks"),
                    cells[1].parse().expect("from bytes"),
                )
            })
            .collect()
    }

    #[test]
    fn the_markdown_and_the_shared_memory_table_agree() {
        assert_eq!(documented_shared_memory(), SHARED_MEMORY_FROM.to_vec());
        assert!(SHARED_MEMORY_FROM.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn shared_memory_takes_over_from_the_size_of_the_rank_counts_row() {
        for &(ranks, from) in SHARED_MEMORY_FROM {
            assert_eq!(shared_memory_from(ranks), from);
        }
        let (smallest, first) = SHARED_MEMORY_FROM[0];
        let (largest, last) = *SHARED_MEMORY_FROM.last().unwrap();
        assert_eq!(shared_memory_from(smallest - 1), first);
        assert_eq!(shared_memory_from(largest + 5), last);
        // A communicator that has not tried a segment counts on one; the message below
        // the switch takes the table's choice.
        for ranks in [2usize, 3, 4, 8] {
            let comm = crate::Communicator::local(ranks).unwrap().remove(0);
            let from = shared_memory_from(ranks);
            assert_eq!(
                comm.resolve_algorithm(Algorithm::Auto, from),
                Algorithm::SharedMemory
            );
            assert_eq!(
                comm.resolve_algorithm(Algorithm::Auto, from - 4),
                measured_choice(ranks, from - 4)
            );
        }
    }

    #[test]
    fn the_markdown_and_the_table_agree() {
        let code: Vec<(usize, usize, Algorithm)> = SWITCH_POINTS
            .iter()
            .flat_map(|(r, row)| row.iter().map(move |(b, a)| (*r, *b, *a)))
            .collect();
        assert_eq!(documented(), code);
    }

    #[test]
    fn rows_increase_end_open_and_name_our_algorithms_only() {
        for (ranks, row) in SWITCH_POINTS {
            assert!(row.windows(2).all(|w| w[0].0 < w[1].0), "ranks {ranks}");
            assert_eq!(row.last().map(|e| e.0), Some(usize::MAX), "ranks {ranks}");
            // Only algorithms whose stall errors name the rank waited for.
            assert!(row.iter().all(|(_, a)| matches!(
                a,
                Algorithm::RecursiveDoubling
                    | Algorithm::HalvingDoubling
                    | Algorithm::Ring
                    | Algorithm::Direct
                    | Algorithm::ScatterGather
            )));
        }
    }

    #[test]
    fn choice_follows_the_row_of_the_rank_count() {
        // 4 bytes: one exchange of the whole message at 2 ranks, one step of direct
        // messages at 3 and 4, recursive doubling above the measured counts.
        assert_eq!(measured_choice(2, 4), Algorithm::RecursiveDoubling);
        assert_eq!(measured_choice(3, 4), Algorithm::Direct);
        assert_eq!(measured_choice(4, 4), Algorithm::Direct);
        assert_eq!(measured_choice(64, 4), Algorithm::RecursiveDoubling);
        // Every switch of each measured row.
        assert_eq!(measured_choice(2, 64 << 10), Algorithm::Ring);
        assert_eq!(measured_choice(2, 32 << 10), Algorithm::RecursiveDoubling);
        assert_eq!(measured_choice(3, (32 << 10) - 4), Algorithm::Direct);
        assert_eq!(measured_choice(3, 32 << 10), Algorithm::RecursiveDoubling);
        assert_eq!(measured_choice(3, 64 << 10), Algorithm::ScatterGather);
        assert_eq!(measured_choice(3, (1 << 20) - 4), Algorithm::ScatterGather);
        assert_eq!(measured_choice(3, 1 << 20), Algorithm::Ring);
        assert_eq!(measured_choice(4, (16 << 10) - 4), Algorithm::Direct);
        assert_eq!(measured_choice(4, 16 << 10), Algorithm::RecursiveDoubling);
        assert_eq!(measured_choice(4, 128 << 10), Algorithm::ScatterGather);
        assert_eq!(measured_choice(4, (2 << 20) - 4), Algorithm::ScatterGather);
        assert_eq!(measured_choice(4, 2 << 20), Algorithm::HalvingDoubling);
        assert_eq!(measured_choice(4, 256 << 20), Algorithm::HalvingDoubling);
        // Unmeasured rank counts: the 4-rank row, with recursive doubling instead of
        // direct, halving-doubling instead of scatter-gather, and the ring instead of
        // halving-doubling unless the count is a power of two.
        for bytes in [4, 4096, 8 << 10] {
            assert_eq!(measured_choice(4, bytes), Algorithm::Direct);
            assert_eq!(measured_choice(1024, bytes), Algorithm::RecursiveDoubling);
            assert_eq!(measured_choice(6, bytes), Algorithm::RecursiveDoubling);
        }
        for bytes in [16 << 10, 64 << 10] {
            assert_eq!(measured_choice(1024, bytes), measured_choice(4, bytes));
            assert_eq!(measured_choice(6, bytes), measured_choice(4, bytes));
        }
        assert_eq!(measured_choice(1024, 256 << 10), Algorithm::HalvingDoubling);
        assert_eq!(measured_choice(6, 256 << 10), Algorithm::Ring);
        assert_eq!(measured_choice(1024, 1 << 20), Algorithm::HalvingDoubling);
        assert_eq!(measured_choice(6, 1 << 20), Algorithm::Ring);
        assert_eq!(measured_choice(6, 4 << 20), Algorithm::Ring);
        assert_eq!(measured_choice(8, 1 << 20), Algorithm::HalvingDoubling);
    }
}
