//! Which algorithm [`crate::Algorithm::Auto`] runs: the switch points measured with
//! `ringtrain bench allreduce`, kept beside the measurements that chose them
//! (`algorithm_choice.md`, shown below).
//!
//! For every measured rank count the table lists, by message size, the algorithm that
//! was fastest; rank counts above the largest measured one use its row, and a choice of
//! `MPI_Allreduce` on a transport without it ([`crate::LocalTransport`]) becomes
//! recursive doubling below [`crate::DEFAULT_AUTO_THRESHOLD_BYTES`] and ring above.
//! [`crate::Communicator::set_auto_threshold_bytes`] replaces the table with that
//! two-way rule.
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
            (16 << 10, Algorithm::RecursiveDoubling),
            (usize::MAX, Algorithm::Ring),
        ],
    ),
    (
        3,
        &[
            (512, Algorithm::RecursiveDoubling),
            (256 << 10, Algorithm::Mpi),
            (usize::MAX, Algorithm::Ring),
        ],
    ),
    (
        4,
        &[
            (512, Algorithm::RecursiveDoubling),
            (256 << 10, Algorithm::Mpi),
            (usize::MAX, Algorithm::Ring),
        ],
    ),
];

/// The measured choice for `bytes` bytes on `ranks` ranks (before the transport's
/// abilities are considered).
pub fn measured_choice(ranks: usize, bytes: usize) -> Algorithm {
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

    /// The "Switch points" table of the markdown, as `(ranks, below_bytes, algorithm)`.
    fn documented() -> Vec<(usize, usize, Algorithm)> {
        let text = include_str!("algorithm_choice.md");
        let start = text
            .find("## Switch points")
            .expect("the markdown has a Switch points section");
        text[start..]
            .lines()
            .filter(|l| l.starts_with('|'))
            .skip(2)
            .take_while(|l| !l.trim().is_empty())
            .map(|l| {
                let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
                let ranks = cells[0].parse().expect("ranks");
                let below = match cells[1] {
                    "any" => usize::MAX,
                    b => b.parse().expect("below bytes"),
                };
                (ranks, below, cells[2].parse().expect("algorithm"))
            })
            .collect()
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
    fn rows_increase_end_open_and_never_say_auto() {
        for (ranks, row) in SWITCH_POINTS {
            assert!(row.windows(2).all(|w| w[0].0 < w[1].0), "ranks {ranks}");
            assert_eq!(row.last().map(|e| e.0), Some(usize::MAX), "ranks {ranks}");
            assert!(row.iter().all(|(_, a)| *a != Algorithm::Auto));
        }
    }

    #[test]
    fn choice_follows_the_row_of_the_rank_count() {
        // 4 bytes on 2 ranks: one exchange; 256 MiB: the ring on every rank count.
        assert_eq!(measured_choice(2, 4), Algorithm::RecursiveDoubling);
        for ranks in [2, 3, 4, 64] {
            assert_eq!(measured_choice(ranks, 256 << 20), Algorithm::Ring);
        }
        // Unmeasured rank counts take the largest measured row below them.
        for bytes in [4, 4096, 64 << 10, 1 << 20] {
            assert_eq!(measured_choice(1024, bytes), measured_choice(4, bytes));
        }
    }
}
