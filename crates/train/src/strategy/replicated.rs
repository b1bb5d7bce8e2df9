//! `replicated`: every rank sums the gradients by all-reduce and applies the same update.
//!
//! Two ways to reduce:
//! - overlapped (`--overlap-backward`, on by default on cuda): each gradient range the model reports finished during backward
//!   is handed at once to the collective's [`FusionEngine`], whose background thread
//!   fuses ready tensors (threshold and cycle time from the config) and reduces them
//!   while backward goes on;
//! - after backward (the CPU default): the flat gradient buffer is
//!   all-reduced in place as one tensor, or, with `--gradient-repacking N` /
//!   `--agg-small-grads-max-bytes B`, the gradient list goes through the collective's
//!   [`GradientPacker`], exactly as tf_cnn_benchmarks packs and aggregates.
//!
//! With f16 gradients the tensors travel and are summed as f16; an overflow on any
//! rank shows up as a non-finite sum (identical on every rank) or in the summed
//! overflow flags, so every rank skips the same steps.
//!
//! A device-resident model (the GPU model) copies each gradient range into its pinned
//! host exchange buffer, already cast for the wire on the device; after backward the
//! ring reduces that buffer in place (one flat buffer, or through the packer), and the
//! model copies it back and updates on the device. The overlapped reduction hands the
//! fusion engine each range of the exchange buffer itself
//! ([`FusionEngine::submit_external`]): the sums land there in place, with no other host
//! copy of the gradients. The overflow flags come from the device's non-finite checks.
//! With one rank nothing leaves the device. A GPU pipeline stage's replicas reduce its
//! exchange buffer the same way ([`Replicated::reduce_exchanged`]).

use std::ops::Range;
use std::time::{Duration, Instant};

use half::f16;
use ringtrain_collective::{
    AllReduceOptions, Communicator, DType, EventSink, ExternalTensor, FusionConfig, FusionEngine,
    GradientPacker, GradientSpec, Handle, PackingConfig, Tensor, TensorMut,
};

use super::{
    correction_factor, to_wire_f16, update_replica, DeviceStepInputs, StepContext, StepInputs,
    StepOutcome, StepStats, Wire,
};
use crate::config::{Reduction, ValidatedConfig};
use crate::error::{Error, Result};
use crate::trainable::{DeviceResident, HostGrads, HostGradsMut, ParamSpec};

enum Mode {
    Overlapped {
        engine: FusionEngine,
        pending: Vec<(Range<usize>, Handle)>,
        local_overflow: bool,
    },
    /// After backward: through the packer, or (no packing options) as one flat buffer.
    Packed {
        comm: Communicator,
        packer: Option<GradientPacker>,
    },
}

/// The all-reduce strategy.
pub struct Replicated {
    mode: Mode,
    specs: Vec<ParamSpec>,
    max_gradient_norm: f32,
    ctx: StepContext,
    /// Ranks of the communicator.
    size: usize,
    /// How the gradients are all-reduced (`--allreduce-algorithm`).
    options: AllReduceOptions,
}

impl Replicated {
    /// Sets up overlapped or packed reduction for the tensors in `specs`.
    ///
    /// # Errors
    /// The collective's, when the packer's plan or the fusion engine fails.
    pub fn new(cfg: &ValidatedConfig, comm: Communicator, specs: &[ParamSpec]) -> Result<Self> {
        Self::with_events(cfg, comm, specs, None)
    }

    /// [`Replicated::new`], the fusion engine recording its phases into `events` (a
    /// `--timeline`'s sink; only the overlapped reduction has such phases).
    ///
    /// # Errors
    /// As [`Replicated::new`].
    pub fn with_events(
        cfg: &ValidatedConfig,
        comm: Communicator,
        specs: &[ParamSpec],
        events: Option<&EventSink>,
    ) -> Result<Self> {
        let exchange = &cfg.config().exchange;
        let size = comm.size();
        let options = AllReduceOptions::sum().algorithm(exchange.allreduce_algorithm);
        // One element with the chosen algorithm before the first step: what it sets up
        // (a shared-memory segment, the nodes of a hierarchical one) is made now, and an
        // algorithm that cannot run here fails now, on every rank.
        let mut comm = comm;
        comm.all_reduce(&mut [0.0f32], &options)?;
        let mode = match cfg.reduction() {
            Reduction::Packed => {
                let dtype = if exchange.fp16_gradients {
                    DType::F16
                } else {
                    DType::F32
                };
                let grad_specs = specs
                    .iter()
                    .map(|s| GradientSpec {
                        name: s.name.clone(),
                        dtype,
                        len: s.range.len(),
                    })
                    .collect();
                let packer = GradientPacker::new(
                    grad_specs,
                    PackingConfig {
                        gradient_repacking: exchange.gradient_repacking,
                        agg_small_grads_max_bytes: exchange.agg_small_grads_max_bytes,
                        agg_small_grads_max_group: exchange.agg_small_grads_max_group,
                    },
                )?;
                Mode::Packed {
                    comm,
                    packer: Some(packer),
                }
            }
            Reduction::AfterBackward => Mode::Packed { comm, packer: None },
            Reduction::Overlapped => {
                let config = FusionConfig {
                    threshold_bytes: exchange.fusion_threshold_bytes,
                    cycle_time: cfg.cycle_time(),
                    options,
                    // A gradient submitted on some ranks only: warned about at half the
                    // stall timeout, failed on every rank at the timeout.
                    stall_warning: cfg.stall_timeout().map_or(Duration::MAX, |t| t / 2),
                    stall_error: cfg.stall_timeout().map_or(Duration::MAX, |t| t - t / 2),
                    events: events.cloned(),
                    ..FusionConfig::default()
                };
                Mode::Overlapped {
                    engine: FusionEngine::start(comm, config)?,
                    pending: Vec::new(),
                    local_overflow: false,
                }
            }
        };
        Ok(Replicated {
            mode,
            specs: specs.to_vec(),
            max_gradient_norm: cfg.config().run.max_gradient_norm,
            ctx: StepContext::default(),
            size,
            options,
        })
    }

    /// Whether gradient ranges are reduced while backward runs.
    pub fn is_overlapped(&self) -> bool {
        matches!(self.mode, Mode::Overlapped { .. })
    }

    pub(crate) fn begin_step(&mut self, ctx: StepContext) {
        self.ctx = ctx;
        if let Mode::Overlapped {
            pending,
            local_overflow,
            ..
        } = &mut self.mode
        {
            pending.clear();
            *local_overflow = false;
        }
    }

    pub(crate) fn on_ready(&mut self, range: Range<usize>, grads: &[f32]) -> Result<()> {
        let Mode::Overlapped {
            engine,
            pending,
            local_overflow,
        } = &mut self.mode
        else {
            return Ok(());
        };
        if grads.len() != range.len() {
            return Err(Error::Internal(format!(
                "gradient range {range:?} came with {} values",
                grads.len()
            )));
        }
        let name = format!("grad.{}", range.start);
        let tensor: Tensor = match self.ctx.wire {
            Wire::F16 { scale } => {
                let (half, overflow) = to_wire_f16(grads, scale)?;
                *local_overflow |= overflow;
                half.into()
            }
            Wire::F32 => grads.to_vec().into(),
        };
        let handle = engine.submit(&name, tensor)?;
        pending.push((range, handle));
        Ok(())
    }

    /// Whether a device-resident model must copy its gradients to the host: only when
    /// there are other ranks to reduce with.
    pub(super) fn exchanges_gradients(&self) -> bool {
        self.size > 1
    }

    /// A device-resident model's range in its host exchange buffer: handed to the fusion
    /// engine to be reduced in place there, when reducing while backward runs.
    ///
    /// The range must stay where it is, untouched, until [`Self::reduce_exchanged`] (in
    /// [`Self::finish_device_step`], or a pipeline stage's) or [`Self::release_exchanged`]:
    /// the device-resident models keep their exchange buffer from the pass to the update,
    /// and the trainer releases the ranges when a step fails between them.
    pub(crate) fn on_exchanged(&mut self, range: Range<usize>, grads: HostGrads<'_>) -> Result<()> {
        let Mode::Overlapped {
            engine, pending, ..
        } = &mut self.mode
        else {
            return Ok(());
        };
        let tensor = match grads {
            HostGrads::F32(g) => ExternalTensor::new(g),
            HostGrads::F16(g) => ExternalTensor::new(g),
        };
        if tensor.len() != range.len() {
            return Err(Error::Internal(format!(
                "gradient range {range:?} came with {} values",
                tensor.len()
            )));
        }
        let name = format!("grad.{}", range.start);
        // SAFETY: the range lies in the model's exchange buffer, which stays allocated and
        // is neither read nor written (no copy into it is queued, nothing reads it) until
        // `reduce_exchanged` (of this strategy's or a pipeline stage's device step) has
        // waited for this handle. A step that fails before then drops the handle
        // (`release_exchanged`, `begin_step`), which takes the values out of the buffer
        // before anything else touches it.
        let handle = unsafe { engine.submit_external(&name, tensor)? };
        pending.push((range, handle));
        Ok(())
    }

    /// Waits until the ranges [`Self::on_exchanged`] handed to the engine are summed in
    /// place; returns how many elements they cover (`None` when nothing is overlapped).
    fn wait_exchanged(&mut self) -> Result<Option<usize>> {
        match &mut self.mode {
            Mode::Overlapped {
                engine, pending, ..
            } if self.size > 1 => {
                let covered: usize = pending.iter().map(|(r, _)| r.len()).sum();
                let handles = pending.drain(..).map(|(_, h)| h).collect();
                engine.synchronize(handles)?;
                Ok(Some(covered))
            }
            _ => Ok(None),
        }
    }

    /// Lets go of the exchange buffer's ranges handed to the engine in a step that failed
    /// before its update: the engine keeps copies of their values and writes no sum into
    /// the buffer any more.
    pub(crate) fn release_exchanged(&mut self) {
        if let Mode::Overlapped { pending, .. } = &mut self.mode {
            pending.clear();
        }
    }

    /// Reduces the model's host exchange buffer in place (several ranks), sums the
    /// figures, and has the model update on its device.
    pub(super) fn finish_device_step(
        &mut self,
        inputs: DeviceStepInputs<'_>,
    ) -> Result<StepOutcome> {
        let DeviceStepInputs {
            model,
            mut local,
            control,
        } = inputs;
        let comm_start = Instant::now();
        let wire = self.ctx.wire;
        self.reduce_exchanged(&mut *model, &mut local)?;
        let stats = local.summed(control)?;
        let communication_seconds = comm_start.elapsed().as_secs_f64();
        let opt_start = Instant::now();
        // Every replica holds the same sums, so the device's non-finite check agrees
        // everywhere too.
        let correction = correction_factor(wire, stats.examples);
        let update = model.update(correction, self.max_gradient_norm, stats.overflow > 0.0)?;
        Ok(StepOutcome {
            stats,
            skipped: update.skipped,
            grad_norm: update.grad_norm,
            communication_seconds,
            optimizer_seconds: opt_start.elapsed().as_secs_f64(),
        })
    }

    /// Sums a device-resident model's host exchange buffer over the ranks in place (a
    /// pipeline stage's over its replicas), and notes in `local.overflow` whether this
    /// rank's f16 cast on the device met a value that is not finite.
    ///
    /// # Errors
    /// The collective's; the model's, when the buffer is not there or not settled.
    pub(crate) fn reduce_exchanged(
        &mut self,
        model: &mut dyn DeviceResident,
        local: &mut StepStats,
    ) -> Result<()> {
        // The ranges handed over during backward are summed in the exchange buffer
        // itself: wait for them before anything else reads or writes it.
        let overlapped = self.wait_exchanged()?;
        local.overflow = f64::from(u8::from(model.cast_overflowed()?));
        if self.exchanges_gradients() {
            let host = model.exchanged_grads()?;
            let total = match &host {
                HostGradsMut::F32(g) => g.len(),
                HostGradsMut::F16(g) => g.len(),
            };
            match &mut self.mode {
                Mode::Overlapped { .. } => {
                    let covered = overlapped.unwrap_or_default();
                    if covered != total {
                        return Err(Error::Internal(format!(
                            "backward reported {covered} of {total} gradient elements ready"
                        )));
                    }
                }
                Mode::Packed { comm, packer } => {
                    let options = self.options;
                    match (host, packer) {
                        (HostGradsMut::F32(g), Some(packer)) => {
                            packer.all_reduce(comm, &mut split_tensors(g, &self.specs), &options)?
                        }
                        (HostGradsMut::F16(g), Some(packer)) => {
                            packer.all_reduce(comm, &mut split_tensors(g, &self.specs), &options)?
                        }
                        (HostGradsMut::F32(g), None) => comm.all_reduce(g, &options)?,
                        (HostGradsMut::F16(g), None) => comm.all_reduce(g, &options)?,
                    }
                }
            }
        }
        Ok(())
    }

    /// Sums `grads` over the replicas (the exchange of [`Self::finish_step`], without
    /// the update), noting in `local.overflow` whether this rank's f16 wire overflowed.
    ///
    /// # Errors
    /// The collective's.
    pub(crate) fn reduce(&mut self, grads: &mut [f32], local: &mut StepStats) -> Result<()> {
        let (wire, options) = (self.ctx.wire, self.options);
        match &mut self.mode {
            Mode::Overlapped {
                engine,
                pending,
                local_overflow,
            } => {
                local.overflow = f64::from(u8::from(*local_overflow));
                let covered: usize = pending.iter().map(|(r, _)| r.len()).sum();
                if covered != grads.len() {
                    return Err(Error::Internal(format!(
                        "backward reported {covered} of {} gradient elements ready",
                        grads.len()
                    )));
                }
                let (ranges, handles): (Vec<_>, Vec<_>) = pending.drain(..).unzip();
                let reduced = engine.synchronize(handles)?;
                for (range, tensor) in ranges.into_iter().zip(reduced) {
                    let dst = &mut grads[range];
                    match wire {
                        Wire::F16 { .. } => {
                            let half = tensor.into_vec::<f16>()?;
                            ringtrain_kernels::par::f16_to_f32_unscaled(&half, 1.0, dst)?;
                        }
                        Wire::F32 => dst.copy_from_slice(&tensor.into_vec::<f32>()?),
                    }
                }
            }
            Mode::Packed { comm, packer } => match wire {
                Wire::F16 { scale } => {
                    let (mut half, overflow) = to_wire_f16(grads, scale)?;
                    local.overflow = f64::from(u8::from(overflow));
                    match packer {
                        Some(packer) => {
                            let mut tensors = split_tensors(&mut half, &self.specs);
                            packer.all_reduce(comm, &mut tensors, &options)?;
                        }
                        None => comm.all_reduce(&mut half, &options)?,
                    }
                    ringtrain_kernels::par::f16_to_f32_unscaled(&half, 1.0, grads)?;
                }
                Wire::F32 => match packer {
                    Some(packer) => {
                        let mut tensors = split_tensors(grads, &self.specs);
                        packer.all_reduce(comm, &mut tensors, &options)?;
                    }
                    None => comm.all_reduce(grads, &options)?,
                },
            },
        }
        Ok(())
    }

    pub(super) fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        let StepInputs {
            params,
            grads,
            mut local,
            optimizer,
            control,
        } = inputs;
        let comm_start = Instant::now();
        let wire = self.ctx.wire;
        self.reduce(grads, &mut local)?;
        let stats = local.summed(control)?;
        let communication_seconds = comm_start.elapsed().as_secs_f64();
        let opt_start = Instant::now();
        // Every replica holds the same bits, so the test of a finite norm agrees
        // everywhere.
        let grad_norm = if stats.overflow > 0.0 {
            None
        } else {
            let correction = correction_factor(wire, stats.examples);
            update_replica(params, grads, correction, self.max_gradient_norm, optimizer)?
        };
        Ok(StepOutcome {
            stats,
            skipped: grad_norm.is_none(),
            grad_norm: grad_norm.unwrap_or(0.0),
            communication_seconds,
            optimizer_seconds: opt_start.elapsed().as_secs_f64(),
        })
    }

    pub(crate) fn shutdown(self) -> Result<Communicator> {
        match self.mode {
            Mode::Packed { comm, .. } => Ok(comm),
            Mode::Overlapped { engine, .. } => Ok(engine.shutdown()?),
        }
    }
}

/// Splits a flat buffer into one tensor per parameter, in spec order.
fn split_tensors<'a, T>(mut flat: &'a mut [T], specs: &[ParamSpec]) -> Vec<TensorMut<'a>>
where
    &'a mut [T]: Into<TensorMut<'a>>,
{
    let mut out = Vec::with_capacity(specs.len());
    let mut at = 0;
    for s in specs {
        let skip = s.range.start - at;
        let rest = std::mem::take(&mut flat);
        let (_, rest) = rest.split_at_mut(skip);
        let (piece, rest) = rest.split_at_mut(s.range.len());
        out.push(piece.into());
        flat = rest;
        at = s.range.end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{OverlapMode, TrainConfig};

    /// `--allreduce-algorithm hier` on four ranks laid out on two nodes: the gradients,
    /// reduced after backward and overlapped, get the bits of a hierarchical all-reduce of
    /// the same gradients, which on these inputs differ from every one-level order (so the
    /// option reached the reduction).
    #[test]
    fn the_chosen_algorithm_reduces_the_gradients() {
        use ringtrain_collective::Algorithm;
        let len = 4096;
        // 1, 2^24, 1, -2^24 turned by one rank per element: each order of additions
        // rounds some element differently.
        let grads = |r: usize| -> Vec<f32> {
            (0..len)
                .map(|i| [1.0, 16_777_216.0, 1.0, -16_777_216.0][(r + i) % 4])
                .collect()
        };
        for overlap in [OverlapMode::Off, OverlapMode::On] {
            let outs = Communicator::run_local_on_nodes(&[2, 2], |comm| -> Result<_> {
                let r = comm.rank();
                let mut cfg = TrainConfig::default();
                cfg.exchange.overlap_backward = overlap;
                cfg.exchange.allreduce_algorithm = Algorithm::Hierarchical;
                let cfg = cfg.validate(4)?;
                let mut other = comm.duplicate()?;
                let specs = [ParamSpec {
                    name: "w".into(),
                    range: 0..len,
                }];
                let mut s = Replicated::new(&cfg, comm, &specs)?;
                let mut reduced = grads(r);
                s.begin_step(StepContext::default());
                s.on_ready(0..len, &reduced)?;
                s.reduce(&mut reduced, &mut StepStats::default())?;
                s.shutdown()?;
                let mut by = |algorithm| -> Result<Vec<f32>> {
                    let mut v = grads(r);
                    other.all_reduce(&mut v, &AllReduceOptions::sum().algorithm(algorithm))?;
                    Ok(v)
                };
                let one_level = [by(Algorithm::Ring)?, by(Algorithm::Direct)?];
                Ok((reduced, by(Algorithm::Hierarchical)?, one_level))
            })
            .expect("run");
            for (rank, out) in outs.into_iter().enumerate() {
                let (reduced, hier, one_level) = out.expect("rank");
                assert_eq!(reduced, hier, "{overlap}: rank {rank}");
                for other in one_level {
                    assert_ne!(reduced, other, "{overlap}: rank {rank}");
                }
            }
        }
    }

    /// The overlapped device path: each range of the exchange buffer is summed where it
    /// lies, in f32 and f16, with no copy made for the engine and none written back (the
    /// sums are there as soon as the ranges are waited for, before any copy back could
    /// run); a failed step's ranges are let go of without a sum landing in them.
    #[test]
    fn exchanged_ranges_are_summed_in_the_exchange_buffer_itself() {
        let outs = Communicator::run_local(2, |comm| -> Result<(Vec<f32>, Vec<f16>, Vec<f32>)> {
            let r = comm.rank();
            let mut cfg = TrainConfig::default();
            cfg.exchange.overlap_backward = OverlapMode::On;
            let cfg = cfg.validate(2)?;
            let specs = [
                ParamSpec {
                    name: "a".into(),
                    range: 0..3,
                },
                ParamSpec {
                    name: "b".into(),
                    range: 3..8,
                },
            ];
            let mut s = Replicated::new(&cfg, comm, &specs)?;
            assert!(s.is_overlapped());
            let mut flat: Vec<f32> = (0..8).map(|i| ((r + 1) * i) as f32).collect();
            let at = flat.as_ptr();
            s.begin_step(StepContext::default());
            for range in [3..8, 0..3] {
                s.on_exchanged(range.clone(), HostGrads::F32(&mut flat[range]))?;
            }
            assert_eq!(s.wait_exchanged()?, Some(8));
            assert_eq!(flat.as_ptr(), at);
            let mut half = vec![f16::from_f32((r + 1) as f32); 8];
            s.begin_step(StepContext::default());
            for range in [0..3, 3..8] {
                s.on_exchanged(range.clone(), HostGrads::F16(&mut half[range]))?;
            }
            assert_eq!(s.wait_exchanged()?, Some(8));
            // A step that fails after handing on a range: rank 0 lets go of it at once
            // and writes the buffer, rank 1 hands it on later.
            let mut failed = vec![(r + 1) as f32; 8];
            s.begin_step(StepContext::default());
            if r == 0 {
                s.on_exchanged(0..8, HostGrads::F32(&mut failed[..]))?;
                s.release_exchanged();
                failed.fill(-1.0);
            } else {
                std::thread::sleep(Duration::from_millis(100));
                s.on_exchanged(0..8, HostGrads::F32(&mut failed[..]))?;
                assert_eq!(s.wait_exchanged()?, Some(8));
            }
            s.shutdown()?;
            Ok((flat, half, failed))
        })
        .expect("run");
        for (rank, out) in outs.into_iter().enumerate() {
            let (flat, half, failed) = out.expect("rank");
            let want: Vec<f32> = (0..8).map(|i| (3 * i) as f32).collect();
            assert_eq!(flat, want, "rank {rank}");
            assert_eq!(half, vec![f16::from_f32(3.0); 8], "rank {rank}");
            let failed_want = if rank == 0 { -1.0 } else { 3.0 };
            assert_eq!(failed, vec![failed_want; 8], "rank {rank}");
        }
    }
}
