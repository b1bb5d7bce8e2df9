//! How many examples each rank takes per step.
//!
//! With a fixed batch per rank every worker takes `--batch-size`. With a fixed total
//! batch (`--total-batch-size T`) the first `T % workers` workers take one example more
//! than the others, so any total works (the TF benchmarks could only split evenly).
//! Gradients are then averaged weighted by each rank's share, so the result equals the
//! single-rank step on the whole batch.

use crate::config::TrainConfig;

/// Examples per rank for a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchSplit {
    per_worker: Vec<usize>,
}

impl BatchSplit {
    /// Every worker takes `batch` examples.
    pub fn per_rank(batch: usize, workers: usize) -> Self {
        BatchSplit {
            per_worker: vec![batch; workers],
        }
    }

    /// `total` examples split over `workers`; the first `total % workers` get one more.
    pub fn total(total: usize, workers: usize) -> Self {
        let workers = workers.max(1);
        let base = total / workers;
        let extra = total % workers;
        BatchSplit {
            per_worker: (0..workers)
                .map(|w| base + usize::from(w < extra))
                .collect(),
        }
    }

    /// The split a config asks for.
    pub fn from_config(cfg: &TrainConfig, workers: usize) -> Self {
        match cfg.total_batch_size {
            Some(t) => Self::total(t, workers),
            None => Self::per_rank(cfg.batch_size, workers),
        }
    }

    /// Examples for worker `w`.
    pub fn of(&self, worker: usize) -> usize {
        self.per_worker.get(worker).copied().unwrap_or(0)
    }

    /// Examples over all workers.
    pub fn global(&self) -> usize {
        self.per_worker.iter().sum()
    }

    /// Index of worker `w`'s first example within the global batch.
    pub fn offset(&self, worker: usize) -> usize {
        self.per_worker.iter().take(worker).sum()
    }

    /// Number of workers.
    pub fn workers(&self) -> usize {
        self.per_worker.len()
    }

    /// Every worker's share.
    pub fn shares(&self) -> &[usize] {
        &self.per_worker
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn total_split_covers_the_batch_and_differs_by_at_most_one(total in 1usize..500, workers in 1usize..9) {
            prop_assume!(total >= workers);
            let s = BatchSplit::total(total, workers);
            prop_assert_eq!(s.global(), total);
            let max = s.shares().iter().max().copied().unwrap();
            let min = s.shares().iter().min().copied().unwrap();
            prop_assert!(max - min <= 1);
            prop_assert_eq!(s.offset(workers - 1) + s.of(workers - 1), total);
        }
    }

    #[test]
    fn uneven_split_puts_extra_examples_first() {
        assert_eq!(BatchSplit::total(10, 3).shares(), &[4, 3, 3]);
        assert_eq!(BatchSplit::per_rank(8, 2).global(), 16);
    }
}
