//! `parameter_server`: parameter tensors live on server ranks, which average the
//! workers' gradients, apply the optimizer and send the parameters back.
//!
//! Placement follows tf_cnn_benchmarks' greedy load balancing: tensors are taken in
//! model order and each goes to the server holding the fewest bytes so far (ties to
//! the lowest server). With `--ps-ranks 0` every rank is both worker and server (each
//! owns a shard); with `--ps-ranks K` the last K ranks are dedicated servers and the
//! others are workers.
//!
//! Per step, for each server: the workers' gradients of its tensors are summed onto
//! it, it divides by the examples of the step, clips with the global norm (the
//! servers' squared norms are summed first) and applies the optimizer to its tensors;
//! then it broadcasts its updated tensors to every rank.
//!
//! This strategy updates on the host: with `--device cuda` the model keeps pinned host
//! mirrors of its parameters and gradients (each gradient crosses to the host and each
//! parameter back once per step), where every other strategy updates on the device.

use std::time::Instant;

use ringtrain_collective::{AllReduceOptions, Communicator};
use ringtrain_kernels::GradScale;

use super::{
    correction_factor, to_wire_f16, StepContext, StepInputs, StepOutcome, StepStats, Wire,
};
use crate::config::ValidatedConfig;
use crate::error::Result;
use crate::optimizer::{Optimizer, OptimizerState};
use crate::trainable::ParamSpec;

/// Server index (0..servers) for each tensor, in order: each tensor goes to the server
/// with the fewest bytes so far, ties to the lowest index.
pub fn greedy_placement(tensor_bytes: &[usize], servers: usize) -> Vec<usize> {
    let servers = servers.max(1);
    let mut load = vec![0usize; servers];
    tensor_bytes
        .iter()
        .map(|&bytes| {
            let (best, _) = load
                .iter()
                .enumerate()
                .min_by_key(|&(i, l)| (*l, i))
                .unwrap_or((0, &0));
            load[best] += bytes;
            best
        })
        .collect()
}

/// The parameter-server strategy.
pub struct ParameterServer {
    comm: Communicator,
    rank: usize,
    /// Ranks that own shards.
    server_ranks: Vec<usize>,
    /// Tensor indices owned by each server (by position in `server_ranks`).
    owned: Vec<Vec<usize>>,
    specs: Vec<ParamSpec>,
    workers: usize,
    max_gradient_norm: f32,
    ctx: StepContext,
}

impl ParameterServer {
    /// Places the tensors and keeps the communicator.
    pub fn new(cfg: &ValidatedConfig, comm: Communicator, specs: &[ParamSpec]) -> Self {
        let world = comm.size();
        let rank = comm.rank();
        // Dedicated servers are the ranks after the workers; with none, every rank serves.
        let first_server = if cfg.workers() < world {
            cfg.workers()
        } else {
            0
        };
        let server_ranks: Vec<usize> = (first_server..world).collect();
        let bytes: Vec<usize> = specs.iter().map(|s| s.range.len() * 4).collect();
        let place = greedy_placement(&bytes, server_ranks.len());
        let mut owned = vec![Vec::new(); server_ranks.len()];
        for (t, s) in place.into_iter().enumerate() {
            owned[s].push(t);
        }
        ParameterServer {
            comm,
            rank,
            workers: cfg.workers(),
            server_ranks,
            owned,
            specs: specs.to_vec(),
            max_gradient_norm: cfg.config().run.max_gradient_norm,
            ctx: StepContext::default(),
        }
    }

    pub(super) fn begin_step(&mut self, ctx: StepContext) {
        self.ctx = ctx;
    }

    /// Whether this rank computes gradients.
    fn is_worker(&self) -> bool {
        self.rank < self.workers
    }

    /// Names of the tensors each server rank owns, as (rank, names).
    pub fn placement(&self) -> Vec<(usize, Vec<String>)> {
        self.server_ranks
            .iter()
            .zip(&self.owned)
            .map(|(&r, ts)| (r, ts.iter().map(|&t| self.specs[t].name.clone()).collect()))
            .collect()
    }

    pub(super) fn into_comm(self) -> Communicator {
        self.comm
    }

    fn gather(&self, server: usize, flat: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(
            self.owned[server]
                .iter()
                .map(|&t| self.specs[t].range.len())
                .sum(),
        );
        for &t in &self.owned[server] {
            out.extend_from_slice(&flat[self.specs[t].range.clone()]);
        }
        out
    }

    fn scatter(&self, server: usize, packed: &[f32], flat: &mut [f32]) {
        let mut at = 0;
        for &t in &self.owned[server] {
            let r = self.specs[t].range.clone();
            let n = r.len();
            flat[r].copy_from_slice(&packed[at..at + n]);
            at += n;
        }
    }

    /// Workers other than `owner` send `packed` to it; the owner receives from each in
    /// rank order and returns the sum. Every other rank returns `None`.
    fn reduce_to_owner<T: ringtrain_collective::Element>(
        &mut self,
        owner: usize,
        mut packed: Vec<T>,
    ) -> Result<Option<Vec<T>>> {
        let transport = self.comm.transport();
        if owner == self.rank {
            if !self.is_worker() {
                packed.iter_mut().for_each(|x| *x = T::from_f64(0.0));
            }
            let mut incoming = packed.clone();
            for peer in (0..self.workers).filter(|&p| p != owner) {
                transport.recv(peer, bytemuck::cast_slice_mut(&mut incoming))?;
                T::sum_into(&mut packed, &incoming)?;
            }
            Ok(Some(packed))
        } else {
            if self.is_worker() {
                transport.send(owner, bytemuck::cast_slice(&packed))?;
            }
            Ok(None)
        }
    }

    pub(super) fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        let StepInputs {
            params,
            grads,
            mut local,
            optimizer,
            control,
        } = inputs;
        let wire = self.ctx.wire;
        let comm_start = Instant::now();
        let mut my_server = None;
        let mut my_grads: Vec<f32> = Vec::new();
        let mut overflow_local = false;
        // 1. Workers send each server the gradients of its tensors; the server sums them.
        for s in 0..self.server_ranks.len() {
            let owner = self.server_ranks[s];
            let packed = self.gather(s, grads);
            if let Wire::F16 { scale } = wire {
                let (half, overflow) = to_wire_f16(&packed, scale)?;
                overflow_local |= overflow;
                if let Some(sum) = self.reduce_to_owner(owner, half)? {
                    let mut out = vec![0.0f32; sum.len()];
                    ringtrain_kernels::par::f16_to_f32_unscaled(&sum, 1.0, &mut out)?;
                    my_server = Some(s);
                    my_grads = out;
                }
            } else if let Some(sum) = self.reduce_to_owner(owner, packed)? {
                my_server = Some(s);
                my_grads = sum;
            }
        }
        // 2. Sum the step figures with each server's squared norm and overflow flag.
        local.overflow = f64::from(u8::from(overflow_local));
        let owned_non_finite = ringtrain_kernels::has_non_finite_f32(&my_grads);
        let mut v = [0.0f64; StepStats::LEN + 2];
        v[..StepStats::LEN].copy_from_slice(&local.to_array());
        v[StepStats::LEN] = ringtrain_kernels::sum_of_squares(&my_grads);
        v[StepStats::LEN + 1] = f64::from(u8::from(owned_non_finite));
        control.sum(&mut v)?;
        let stats = StepStats::from_slice(&v[..StepStats::LEN]);
        let skipped =
            stats.overflow > 0.0 || v[StepStats::LEN + 1] > 0.0 || !v[StepStats::LEN].is_finite();
        let mut communication_seconds = comm_start.elapsed().as_secs_f64();

        let mut optimizer_seconds = 0.0;
        let mut grad_norm = 0.0;
        if !skipped {
            // 3. Owners average, clip and update their tensors.
            let opt_start = Instant::now();
            let correction = correction_factor(wire, stats.examples);
            grad_norm = v[StepStats::LEN].sqrt() * f64::from(correction.abs());
            let clip = if self.max_gradient_norm > 0.0 {
                ringtrain_kernels::clip_factor(grad_norm, self.max_gradient_norm)
            } else {
                1.0
            };
            optimizer.begin_step();
            if let Some(s) = my_server {
                // The update reads the gradients through the averaging and clipping
                // factors (one product: the norm above is of the unscaled sums).
                let scale = GradScale(correction * clip, 1.0);
                let mut at = 0;
                for &t in &self.owned[s] {
                    let r = self.specs[t].range.clone();
                    let n = r.len();
                    let g = &my_grads[at..at + n];
                    optimizer.apply_scaled(r.clone(), &mut params[r], g, scale)?;
                    at += n;
                }
            }
            optimizer_seconds = opt_start.elapsed().as_secs_f64();
            // 4. Owners send their updated tensors to everyone.
            let bcast_start = Instant::now();
            for s in 0..self.server_ranks.len() {
                let owner = self.server_ranks[s];
                let mut packed = self.gather(s, params);
                self.comm.broadcast(&mut packed, owner)?;
                if owner != self.rank {
                    self.scatter(s, &packed, params);
                }
            }
            communication_seconds += bcast_start.elapsed().as_secs_f64();
        }
        Ok(StepOutcome {
            stats,
            skipped,
            grad_norm,
            communication_seconds,
            optimizer_seconds,
        })
    }

    /// Zeroes the optimizer state outside this rank's shard (after loading a full one).
    pub fn localize_optimizer_state(&self, optimizer: &mut Optimizer) {
        let mine: Vec<usize> = self
            .server_ranks
            .iter()
            .position(|&r| r == self.rank)
            .map(|s| self.owned[s].clone())
            .unwrap_or_default();
        if let OptimizerState::Adam { m, v, .. } = optimizer.state_mut() {
            let mut keep = vec![false; m.len()];
            for t in mine {
                for k in self.specs[t].range.clone() {
                    keep[k] = true;
                }
            }
            for (k, &kp) in keep.iter().enumerate() {
                if !kp {
                    m[k] = 0.0;
                    v[k] = 0.0;
                }
            }
        }
    }

    /// Assembles every server's shard of the optimizer state on every rank.
    pub fn gather_optimizer_state(&mut self, optimizer: &Optimizer) -> Result<OptimizerState> {
        match optimizer.state() {
            OptimizerState::Sgd => Ok(OptimizerState::Sgd),
            OptimizerState::Adam { m, v, step } => {
                // Outside its shard a rank's moments are zero, so the sum is the union.
                let mut m = m.clone();
                let mut v = v.clone();
                self.comm.all_reduce(&mut m, &AllReduceOptions::sum())?;
                self.comm.all_reduce(&mut v, &AllReduceOptions::sum())?;
                Ok(OptimizerState::Adam { m, v, step: *step })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_placement_balances_bytes_in_model_order() {
        // 100 -> s0; 60 -> s1; 50 -> s1 (60 < 100); 40 -> s0 (100 < 110); 10 -> s1 (110 < 140)
        assert_eq!(
            greedy_placement(&[100, 60, 50, 40, 10], 2),
            vec![0, 1, 1, 0, 1]
        );
        assert_eq!(greedy_placement(&[5, 5, 5], 3), vec![0, 1, 2]);
        assert_eq!(greedy_placement(&[5, 5], 1), vec![0, 0]);
    }
}
