//! Splitting work over ranks: example shards and per-rank batch sizes.
//!
//! `total` items over `size` ranks: every rank gets `total / size`, and the first
//! `total % size` ranks get one more (10 over 3 gives 4, 3, 3). Rank `r`'s items are the
//! contiguous range starting after the items of ranks `0..r`, so the ranges are disjoint
//! and together cover `0..total` exactly.

use std::ops::Range;

use crate::error::{Error, Result};

/// How many of `total` items rank `rank` of `size` gets (see the module docs).
/// Returns 0 when `size` is 0 or `rank >= size`.
pub fn rank_share(total: usize, rank: usize, size: usize) -> usize {
    if size == 0 || rank >= size {
        return 0;
    }
    total / size + usize::from(rank < total % size)
}

/// The contiguous range of `0..total` that rank `rank` of `size` owns.
/// Empty when `size` is 0 or `rank >= size`.
pub fn rank_range(total: usize, rank: usize, size: usize) -> Range<usize> {
    if size == 0 || rank >= size {
        return total..total;
    }
    let base = total / size;
    let extra = total % size;
    let start = rank * base + rank.min(extra);
    start..start + rank_share(total, rank, size)
}

/// How the batch size given on the command line is read when there are several ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchSizing {
    /// Every rank processes this many examples per step; the global batch grows with
    /// the number of ranks ("fixed batch per device").
    PerRank(usize),
    /// This many examples per step over all ranks together, split with [`rank_share`]
    /// (uneven splits allowed: 10 over 3 ranks is 4, 3, 3).
    Total(usize),
}

impl BatchSizing {
    /// This rank's batch size.
    ///
    /// # Errors
    /// When `size` is 0, `rank >= size`, the batch size is 0, or a total batch is smaller
    /// than the number of ranks (some rank would get no examples).
    pub fn local_batch_size(&self, rank: usize, size: usize) -> Result<usize> {
        Ok(self.local_range(rank, size)?.len())
    }

    /// The examples of all ranks together in one step.
    pub fn global_batch_size(&self, size: usize) -> usize {
        match *self {
            BatchSizing::PerRank(batch) => batch.saturating_mul(size),
            BatchSizing::Total(total) => total,
        }
    }

    /// This rank's columns of the global batch: `rank * batch ..` for a per-rank batch,
    /// [`rank_range`] for a total batch. Errors as [`BatchSizing::local_batch_size`].
    pub fn local_range(&self, rank: usize, size: usize) -> Result<Range<usize>> {
        if size == 0 {
            return Err(Error::invalid(
                "number of ranks",
                size,
                "at least one rank is needed",
            ));
        }
        if rank >= size {
            return Err(Error::invalid(
                "rank",
                rank,
                format!("ranks are numbered 0..{size}; check the launcher"),
            ));
        }
        match *self {
            BatchSizing::PerRank(0) | BatchSizing::Total(0) => Err(Error::invalid(
                "batch size",
                0,
                "the batch size must be at least 1",
            )),
            BatchSizing::PerRank(batch) => Ok(rank * batch..(rank + 1) * batch),
            BatchSizing::Total(total) if total < size => Err(Error::invalid(
                "total batch size",
                total,
                format!(
                    "a total batch split over {size} ranks must be at least {size} so that \
                     every rank gets an example; raise it or use a per-rank batch"
                ),
            )),
            BatchSizing::Total(total) => Ok(rank_range(total, rank, size)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ten_over_three_is_four_three_three() {
        let shares: Vec<usize> = (0..3).map(|r| rank_share(10, r, 3)).collect();
        assert_eq!(shares, [4, 3, 3]);
        assert_eq!(rank_range(10, 0, 3), 0..4);
        assert_eq!(rank_range(10, 1, 3), 4..7);
        assert_eq!(rank_range(10, 2, 3), 7..10);
    }

    #[test]
    fn batch_sizing_rules() {
        assert_eq!(BatchSizing::Total(10).local_batch_size(0, 3).ok(), Some(4));
        assert_eq!(BatchSizing::Total(10).local_batch_size(2, 3).ok(), Some(3));
        assert_eq!(BatchSizing::PerRank(8).local_range(2, 4).ok(), Some(16..24));
        assert_eq!(BatchSizing::PerRank(8).global_batch_size(4), 32);
        assert!(BatchSizing::Total(2).local_batch_size(0, 3).is_err());
        assert!(BatchSizing::PerRank(0).local_batch_size(0, 1).is_err());
        assert!(BatchSizing::PerRank(4).local_batch_size(3, 3).is_err());
        assert!(BatchSizing::PerRank(4).local_batch_size(0, 0).is_err());
        let err = BatchSizing::Total(2)
            .local_batch_size(0, 3)
            .expect_err("too small");
        assert!(
            err.to_string()
                .contains("invalid value `2` for total batch size"),
            "{err}"
        );
    }
}
