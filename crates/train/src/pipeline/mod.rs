//! Pipeline parallelism: the model cut into K consecutive stages, one per rank, each
//! batch split into M micro-batches that flow through the stages (GPipe).
//!
//! - [`plan_stages`]: which of the model's units ([`ringtrain_model::PipelineUnit`]) each
//!   stage runs: `--pipeline-split` by hand, else balanced ([`balance_by_cost`]) by
//!   parameter count (the split whose largest stage holds the fewest parameters), or with
//!   `--pipeline-balance time` by measured time ([`measure_unit_costs`]: rank 0 times a
//!   forward and backward of each unit on a warm-up micro-batch; [`agree_unit_costs`]
//!   hands its figures to every rank, which all take the split whose slowest stage is
//!   the fastest).
//! - [`schedule`]: the order of a stage's passes: [`PipelineSchedule::Gpipe`] runs every
//!   micro-batch's forward, then every backward (fill, drain); [`PipelineSchedule::OneFOneB`]
//!   starts backward as soon as the last stage can, alternating one forward and one
//!   backward (the same bubble, at most `min(K - stage, M)` micro-batches in flight on a
//!   stage).
//! - [`PipelineTrainable`] (host memory) and `GpuPipelineStage` (feature `cuda`): one
//!   stage as the trainer's model. Both run the same schedule loop: a pass receives the
//!   boundary tensor from the stage before (activations; for the NMT decoder's stages
//!   also the encoder's final `(h, c)` of every decoder layer past the boundary, see
//!   [`ringtrain_model::stage`]), sends its own on, and on the way back exchanges their
//!   gradients, all point-to-point through the collective crate's transport (MPI, or
//!   the local transport's threads). A send and the receive that follows it go as one
//!   [`ringtrain_collective::Transport::sendrecv_vec`], so neighbours that send to each
//!   other at once (1F1B) do not deadlock on blocking sends. Boundary tensors are host
//!   `f32` vectors: a GPU stage downloads what it sends and uploads what it receives,
//!   as gradients are staged for the ring.
//! - Activation memory: a micro-batch holds an activation workspace from its forward to
//!   its backward, then hands it to the next micro-batch's forward
//!   ([`ringtrain_model::PipelineModel::move_activations`]), so a stage holds as many
//!   workspaces as it has micro-batches in flight: M under GPipe, `min(K - stage, M)`
//!   under 1F1B. The report gives each stage's peak count and bytes.
//! - [`PipelineUpdate`]: the update. Each stage's gradients are summed over the
//!   micro-batches (the loss is a sum, so this is the whole batch's gradient), divided
//!   by the batch's examples, clipped with the global norm (the stages' squared norms
//!   summed on the control plane) and applied by the stage's own optimizer state to its
//!   own parameters, once per batch: the same update as the unpipelined step. A GPU
//!   stage sums, clips and updates on its device and sends only its squared norm (and,
//!   with replicas, its summed gradients once each way) through the host.
//!
//! Each stage's optimizer state (Adam's moments) covers its own parameter range only,
//! on the host or on its device. Its parameter and gradient buffers are still the
//! model's whole flat buffers (the model crate allocates a model's buffers whole and
//! addresses its tensors by their offsets in them; cutting them to a range would need
//! models built from a range of their layout): a stage reads and writes only its own
//! range of them, and its activation workspace is the whole model's too, of which it uses
//! its units' part. Checkpoints gather every stage's range of the parameters and of the
//! optimizer state on rank 0, so a pipelined and an unpipelined run write the same file
//! format and resume each other. Every stage of a replica reads the replica's batches;
//! only the last stage counts its words and loss.
//!
//! Measured per stage: compute (its passes), wait (blocked on a neighbour: transfer and
//! bubble), and the bubble fraction `wait / (compute + wait)`, reported beside the
//! formula `(K - 1) / (M + K - 1)` of equal stages.

use std::ops::Range;

use ringtrain_model::PipelineUnit;

use crate::config::PipelineSchedule;
use crate::error::{Error, Result};

mod balance;
#[cfg(feature = "cuda")]
mod device;
mod stage;
mod update;

pub use balance::{agree_unit_costs, measure_unit_costs, warm_up_batch};
#[cfg(feature = "cuda")]
pub use device::GpuPipelineStage;
pub use stage::{PipelineTrainable, StageInfo, StageTimes, StagesOnBatch};
pub use update::PipelineUpdate;

/// One pass of a stage's schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward of micro-batch `i`.
    Forward(usize),
    /// Backward of micro-batch `i`.
    Backward(usize),
}

/// The passes stage `stage` of `stages` runs for `micro` micro-batches, in order. Every
/// stage runs the forwards in ascending order and the backwards in ascending order, so
/// the messages between two neighbours arrive in the order they are read.
pub fn schedule(kind: PipelineSchedule, stages: usize, stage: usize, micro: usize) -> Vec<Pass> {
    match kind {
        PipelineSchedule::Gpipe => (0..micro)
            .map(Pass::Forward)
            .chain((0..micro).map(Pass::Backward))
            .collect(),
        PipelineSchedule::OneFOneB => {
            let warmup = (stages - stage - 1).min(micro);
            let mut passes: Vec<Pass> = (0..warmup).map(Pass::Forward).collect();
            for i in warmup..micro {
                passes.push(Pass::Forward(i));
                passes.push(Pass::Backward(i - warmup));
            }
            passes.extend((micro - warmup..micro).map(Pass::Backward));
            passes
        }
    }
}

/// The bubble fraction of K equal stages over M micro-batches: `(K - 1) / (M + K - 1)`.
pub fn bubble_formula(stages: usize, micro: usize) -> f64 {
    let (k, m) = (stages as f64, micro as f64);
    if k + m <= 1.0 {
        return 0.0;
    }
    (k - 1.0) / (m + k - 1.0)
}

/// Examples `0..examples` cut into `micro` near-equal consecutive ranges (the first
/// `examples % micro` one longer); fewer when there are fewer examples than `micro`.
pub fn micro_batch_ranges(examples: usize, micro: usize) -> Vec<Range<usize>> {
    let m = micro.min(examples).max(1);
    let (base, extra) = (examples / m, examples % m);
    let mut start = 0;
    (0..m)
        .map(|i| {
            let len = base + usize::from(i < extra);
            let r = start..start + len;
            start += len;
            r
        })
        .collect()
}

/// The unit range of each of `stages` stages over `units`: `split` (units per stage)
/// when given, else the consecutive split whose largest stage has the fewest parameters.
///
/// # Errors
/// `InvalidValue` naming `--pipeline-stages` / `--pipeline-split` when they do not fit
/// the units (validation checks them first; this guards the model's own count).
pub fn plan_stages(
    units: &[PipelineUnit],
    stages: usize,
    split: &[usize],
) -> Result<Vec<Range<usize>>> {
    let n = units.len();
    if stages == 0 || stages > n {
        return Err(Error::invalid(
            "--pipeline-stages",
            stages,
            format!("the model has {n} units to cut: use 1 to {n} stages"),
        ));
    }
    if !split.is_empty() {
        if split.len() != stages || split.contains(&0) || split.iter().sum::<usize>() != n {
            return Err(Error::invalid(
                "--pipeline-split",
                format!("{split:?}"),
                format!("give {stages} numbers of at least 1 that add up to the {n} units"),
            ));
        }
        let mut start = 0;
        return Ok(split
            .iter()
            .map(|&len| {
                start += len;
                start - len..start
            })
            .collect());
    }
    let sizes: Vec<f64> = units.iter().map(|u| u.params.len() as f64).collect();
    Ok(balance_by_cost(&sizes, stages))
}

/// The consecutive split of units with costs `costs` into `stages` non-empty stages
/// whose largest stage cost (the sum of its units') is the least; of equal splits, the
/// one found first (each stage's start as early as it can be, from the last stage back),
/// so the same costs always give the same split. `stages` must be 1 to `costs.len()`.
pub fn balance_by_cost(costs: &[f64], stages: usize) -> Vec<Range<usize>> {
    let n = costs.len();
    if stages == 0 || stages > n {
        return Vec::new();
    }
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |acc, &c| {
            *acc += c;
            Some(*acc)
        }))
        .collect();
    let cost = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[k][j]: the least largest stage cutting units 0..j into k stages; cut[k][j]
    // where the last of them starts.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages + 1];
    let mut cut = vec![vec![0; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for k in 1..=stages {
        for j in k..=n {
            for i in (k - 1)..j {
                if best[k - 1][i] == f64::INFINITY {
                    continue;
                }
                let c = best[k - 1][i].max(cost(i, j));
                if c < best[k][j] {
                    best[k][j] = c;
                    cut[k][j] = i;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(stages);
    let mut end = n;
    for k in (1..=stages).rev() {
        let start = cut[k][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    ranges
}

/// The range of the flat parameter buffer units `range` of `units` occupy.
pub fn param_range(units: &[PipelineUnit], range: &Range<usize>) -> Range<usize> {
    units[range.clone()]
        .iter()
        .map(|u| u.params.clone())
        .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
        .unwrap_or(0..0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn units(sizes: &[usize]) -> Vec<PipelineUnit> {
        let total: usize = sizes.iter().sum();
        let mut end = total;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                end -= s;
                PipelineUnit {
                    name: format!("u{i}"),
                    params: end..end + s,
                }
            })
            .collect()
    }

    #[test]
    fn schedules_run_every_pass_once_forward_before_backward() {
        for kind in [PipelineSchedule::Gpipe, PipelineSchedule::OneFOneB] {
            for stages in 1..5 {
                for micro in 1..7 {
                    for stage in 0..stages {
                        let passes = schedule(kind, stages, stage, micro);
                        assert_eq!(passes.len(), 2 * micro);
                        for i in 0..micro {
                            let f = passes.iter().position(|p| *p == Pass::Forward(i));
                            let b = passes.iter().position(|p| *p == Pass::Backward(i));
                            assert!(f < b, "{kind:?} {stages} {stage} {micro}: {passes:?}");
                        }
                    }
                }
            }
        }
        use Pass::*;
        assert_eq!(
            schedule(PipelineSchedule::OneFOneB, 3, 0, 4),
            [
                Forward(0),
                Forward(1),
                Forward(2),
                Backward(0),
                Forward(3),
                Backward(1),
                Backward(2),
                Backward(3)
            ]
        );
        assert_eq!(
            schedule(PipelineSchedule::OneFOneB, 3, 2, 2),
            [Forward(0), Backward(0), Forward(1), Backward(1)]
        );
    }

    #[test]
    fn micro_batches_cover_the_batch_near_evenly() {
        assert_eq!(micro_batch_ranges(7, 3), [0..3, 3..5, 5..7]);
        assert_eq!(micro_batch_ranges(2, 3), [0..1, 1..2]);
        let whole = micro_batch_ranges(4, 1);
        assert_eq!((whole.len(), whole.first()), (1, Some(&(0..4))));
    }

    #[test]
    fn balance_by_parameters_and_by_hand() {
        // A big projection last: it gets a stage of its own.
        let u = units(&[10, 5, 5, 30]);
        assert_eq!(plan_stages(&u, 2, &[]).ok(), Some(vec![0..3, 3..4]));
        assert_eq!(plan_stages(&u, 3, &[]).ok(), Some(vec![0..1, 1..3, 3..4]));
        assert_eq!(plan_stages(&u, 2, &[1, 3]).ok(), Some(vec![0..1, 1..4]));
        assert_eq!(param_range(&u, &(1..3)), 30..40);
        let err = plan_stages(&u, 2, &[2, 1]).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("--pipeline-split")));
        let err = plan_stages(&u, 5, &[]).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("--pipeline-stages")));
        assert!((bubble_formula(2, 4) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn a_split_by_cost_minimises_the_slowest_stage_and_is_deterministic() {
        // A slow projection last gets a stage of its own, whatever the parameters say.
        let costs = [3.0, 1.0, 1.0, 6.0];
        assert_eq!(balance_by_cost(&costs, 2), [0..3, 3..4]);
        assert_eq!(balance_by_cost(&costs, 3), [0..1, 1..3, 3..4]);
        // A slow first unit instead.
        assert_eq!(balance_by_cost(&[9.0, 1.0, 1.0, 1.0], 2), [0..1, 1..4]);
        // Ties: the same costs give the same split, every time.
        let even = [2.0, 2.0, 2.0, 2.0];
        let first = balance_by_cost(&even, 2);
        assert_eq!(first, [0..2, 2..4]);
        for _ in 0..10 {
            assert_eq!(balance_by_cost(&even, 2), first);
        }
        assert_eq!(balance_by_cost(&[1.0, 1.0, 1.0], 3), [0..1, 1..2, 2..3]);
        assert!(balance_by_cost(&[1.0], 2).is_empty());
        // The parameter balance is the same search over parameter counts.
        let u = units(&[3, 1, 1, 4]);
        assert_eq!(
            plan_stages(&u, 2, &[]).ok(),
            Some(balance_by_cost(&[3.0, 1.0, 1.0, 4.0], 2))
        );
    }
}
