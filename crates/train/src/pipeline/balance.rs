//! `--pipeline-balance time`: the cost of each unit, measured on rank 0 and agreed by
//! every rank before the stages are planned.
//!
//! Rank 0 runs a warm-up micro-batch of synthetic data of the run's shape (sentence
//! length `--src-max-len`, the largest micro-batch of a replica) through every unit,
//! one unit at a time (the boundary tensor of each feeding the next), forward and then
//! backward, twice: the first pass allocates the workspaces, the second is timed. Each
//! timed pass ends with a one-element read of the gradient buffer, which waits for a
//! GPU's queued kernels, so a unit's time is its own. The costs go to every rank in one
//! broadcast (on the stages' communicator, before any stage exchanges a tensor); every
//! rank then takes the same split from the same figures ([`super::balance_by_cost`]).
//! A measurement that fails on rank 0 is broadcast as such and ends every rank with an
//! error.

use std::time::Instant;

use ringtrain_collective::Communicator;
use ringtrain_data::{SyntheticLm, SyntheticLmConfig, SyntheticNmt, SyntheticNmtConfig};
use ringtrain_model::{view, Backend, Layout};

use super::StagesOnBatch;
use crate::config::{ModelKind, ValidatedConfig};
use crate::error::{Error, Result};
use crate::trainable::Batch;

/// A micro-batch of synthetic data of the shape `cfg`'s pipeline runs: the largest
/// micro-batch of replica 0's batch, sentences of `--src-max-len` tokens.
///
/// # Errors
/// The data crate's, for sizes it cannot make.
pub fn warm_up_batch(cfg: &ValidatedConfig, src_vocab: usize, tgt_vocab: usize) -> Result<Batch> {
    let c = cfg.config();
    let micro = c.exchange.micro_batches.max(1);
    let batch_size = cfg.local_batch_size(0).div_ceil(micro).max(1);
    let seq_len = c.data.src_max_len.max(1);
    let seed = c.run.seed;
    Ok(match c.model.model {
        ModelKind::Nmt => Batch::Nmt(
            SyntheticNmt::new(
                SyntheticNmtConfig {
                    src_vocab_size: src_vocab,
                    tgt_vocab_size: tgt_vocab,
                    seq_len,
                    batch_size,
                    seed,
                },
                0,
            )?
            .next_batch(),
        ),
        ModelKind::Rnnlm => Batch::Lm(
            SyntheticLm::new(
                SyntheticLmConfig {
                    vocab_size: src_vocab,
                    steps: seq_len,
                    batch_size,
                    seed,
                },
                0,
            )?
            .next_batch(),
        ),
    })
}

/// Seconds of a forward and a backward of each of `model`'s units on `batch` (see the
/// module docs).
///
/// # Errors
/// The model's.
pub fn measure_unit_costs<M: StagesOnBatch>(model: &mut M, batch: &Batch) -> Result<Vec<f64>> {
    let n = model.pipeline_units().len();
    let mut costs = vec![0.0; n];
    for timed in [false, true] {
        let mut slots: Vec<M::Slot> = (0..n).map(|_| M::Slot::default()).collect();
        let mut boundary = Vec::new();
        for (u, slot) in slots.iter_mut().enumerate() {
            let start = Instant::now();
            let mut out = Vec::new();
            model.stage_forward_on(slot, batch, u..u + 1, &boundary, &mut out)?;
            wait_for_device(model)?;
            if timed {
                costs[u] += start.elapsed().as_secs_f64();
            }
            boundary = out;
        }
        let mut grad = Vec::new();
        for (u, slot) in slots.iter_mut().enumerate().rev() {
            let start = Instant::now();
            let mut input_grad = Vec::new();
            model.stage_backward(slot, u..u + 1, &grad, &mut input_grad, &mut |_, _| {})?;
            wait_for_device(model)?;
            if timed {
                costs[u] += start.elapsed().as_secs_f64();
            }
            grad = input_grad;
        }
    }
    Ok(costs)
}

/// Reads one gradient element: on a GPU, after the kernels queued before it.
fn wait_for_device<M: StagesOnBatch>(model: &M) -> Result<()> {
    let grads = model.grads();
    if model.backend().len(grads) > 0 {
        model.backend().sum(view(grads, Layout::contiguous(0, 1)))?;
    }
    Ok(())
}

/// Every rank's copy of rank 0's unit costs for `units` units: rank 0 passes its
/// measurement, the others `None` (collective over `comm`).
///
/// # Errors
/// Rank 0's measurement error there; elsewhere `OtherRanksFailed`-style `InvalidValue`
/// naming `--pipeline-balance` when rank 0 could not measure; transport errors.
pub fn agree_unit_costs(
    comm: &mut Communicator,
    measured: Option<Result<Vec<f64>>>,
    units: usize,
) -> Result<Vec<f64>> {
    // Slot 0 says whether rank 0 measured (1) or failed (0).
    let mut buf = vec![0.0f64; units + 1];
    let mut failure = None;
    match measured {
        Some(Ok(costs)) if costs.len() == units => {
            buf[0] = 1.0;
            buf[1..].copy_from_slice(&costs);
        }
        Some(Ok(costs)) => {
            failure = Some(Error::Internal(format!(
                "measured {} unit costs for a model of {units} units",
                costs.len()
            )));
        }
        Some(Err(e)) => failure = Some(e),
        None => {}
    }
    comm.broadcast(&mut buf, 0)?;
    if let Some(e) = failure {
        return Err(e);
    }
    if buf[0] != 1.0 {
        return Err(Error::invalid(
            "--pipeline-balance",
            "time",
            "rank 0 could not time the model's units (its error says why): use \
             --pipeline-balance params, or --pipeline-split",
        ));
    }
    Ok(buf[1..].to_vec())
}
