//! `replicated`: every rank sums the gradients by all-reduce and applies the same update.
//!
//! Two ways to reduce:
//! - overlapped (default): each gradient range the model reports finished during backward
//!   is handed at once to the collective's [`FusionEngine`], whose background thread
//!   fuses ready tensors (threshold and cycle time from the config) and reduces them
//!   while backward goes on;
//! - after backward (overlap off, the CPU default): the flat gradient buffer is
//!   all-reduced in place as one tensor, or, with `--gradient-repacking N` /
//!   `--agg-small-grads-max-bytes B`, the gradient list goes through the collective's
//!   [`GradientPacker`], exactly as tf_cnn_benchmarks packs and aggregates.
//!
//! With f16 gradients the tensors travel and are summed as f16; an overflow on any
//! rank shows up as a non-finite sum (identical on every rank) or in the summed
//! overflow flags, so every rank skips the same steps.

use std::ops::Range;
use std::time::{Duration, Instant};

use half::f16;
use ringtrain_collective::{
    AllReduceOptions, Communicator, DType, FusionConfig, FusionEngine, GradientPacker,
    GradientSpec, Handle, PackingConfig, ReduceOp, Tensor, TensorMut,
};

use super::{correction_factor, update_replica, StepInputs, StepOutcome, StepStats};
use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::trainable::ParamSpec;

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
    rank: usize,
    world: usize,
    fp16: bool,
    wire_scale: f32,
}

impl Replicated {
    /// Sets up overlapped or packed reduction for the tensors in `specs`.
    pub fn new(cfg: &TrainConfig, comm: Communicator, specs: &[ParamSpec]) -> Result<Self> {
        let rank = comm.rank();
        let world = comm.size();
        let packed = cfg.gradient_repacking > 0
            || cfg.agg_small_grads_max_bytes > 0
            || !cfg.overlap_backward;
        let dtype = if cfg.fp16_gradients {
            DType::F16
        } else {
            DType::F32
        };
        let tf_packing = cfg.gradient_repacking > 0 || cfg.agg_small_grads_max_bytes > 0;
        let mode = if packed && !tf_packing {
            Mode::Packed { comm, packer: None }
        } else if packed {
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
                    gradient_repacking: cfg.gradient_repacking,
                    agg_small_grads_max_bytes: cfg.agg_small_grads_max_bytes,
                    agg_small_grads_max_group: cfg.agg_small_grads_max_group,
                },
            )?;
            Mode::Packed {
                comm,
                packer: Some(packer),
            }
        } else {
            let config = FusionConfig {
                threshold_bytes: cfg.fusion_threshold_bytes,
                cycle_time: Duration::from_secs_f64(cfg.cycle_time_ms / 1000.0),
                options: AllReduceOptions::sum(),
                ..FusionConfig::default()
            };
            Mode::Overlapped {
                engine: FusionEngine::start(comm, config)?,
                pending: Vec::new(),
                local_overflow: false,
            }
        };
        Ok(Replicated {
            mode,
            specs: specs.to_vec(),
            rank,
            world,
            fp16: cfg.fp16_gradients,
            wire_scale: 1.0,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the world.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Whether gradient ranges are reduced while backward runs.
    pub fn is_overlapped(&self) -> bool {
        matches!(self.mode, Mode::Overlapped { .. })
    }

    pub(super) fn begin_step(&mut self, fp16: bool, wire_scale: f32) {
        self.fp16 = fp16;
        self.wire_scale = wire_scale;
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

    pub(super) fn on_ready(&mut self, range: Range<usize>, grads: &[f32]) -> Result<()> {
        let Mode::Overlapped {
            engine,
            pending,
            local_overflow,
        } = &mut self.mode
        else {
            return Ok(());
        };
        if grads.len() != range.len() {
            return Err(Error::RankMismatch(format!(
                "gradient range {range:?} came with {} values",
                grads.len()
            )));
        }
        let name = format!("grad.{}", range.start);
        let tensor: Tensor = if self.fp16 {
            let mut half = vec![f16::ZERO; grads.len()];
            *local_overflow |=
                ringtrain_kernels::par::f32_to_f16_scaled(grads, self.wire_scale, &mut half)?;
            half.into()
        } else {
            grads.to_vec().into()
        };
        let handle = engine.submit(&name, tensor)?;
        pending.push((range, handle));
        Ok(())
    }

    pub(super) fn finish_step(&mut self, inputs: StepInputs<'_>) -> Result<StepOutcome> {
        let StepInputs {
            params,
            grads,
            mut local,
            wire_scale,
            max_gradient_norm,
            optimizer,
        } = inputs;
        let comm_start = Instant::now();
        let fp16 = self.fp16;
        let stats = match &mut self.mode {
            Mode::Overlapped {
                engine,
                pending,
                local_overflow,
            } => {
                local.overflow = f64::from(u8::from(*local_overflow));
                let covered: usize = pending.iter().map(|(r, _)| r.len()).sum();
                if covered != grads.len() {
                    return Err(Error::RankMismatch(format!(
                        "backward reported {covered} of {} gradient elements ready",
                        grads.len()
                    )));
                }
                let stats_handle =
                    engine.submit("step.stats", Tensor::from(local.to_array().to_vec()))?;
                let (ranges, handles): (Vec<_>, Vec<_>) = pending.drain(..).unzip();
                let mut reduced = engine.synchronize(handles)?;
                let stats_vec = stats_handle.wait()?.into_vec::<f64>()?;
                for (range, tensor) in ranges.into_iter().zip(reduced.drain(..)) {
                    let dst = &mut grads[range];
                    if fp16 {
                        let half = tensor.into_vec::<f16>()?;
                        ringtrain_kernels::par::f16_to_f32_unscaled(&half, 1.0, dst)?;
                    } else {
                        let v = tensor.into_vec::<f32>()?;
                        dst.copy_from_slice(&v);
                    }
                }
                StepStats::from_slice(&stats_vec)
            }
            Mode::Packed { comm, packer } => {
                if fp16 {
                    let mut half = vec![f16::ZERO; grads.len()];
                    let overflow =
                        ringtrain_kernels::par::f32_to_f16_scaled(grads, wire_scale, &mut half)?;
                    local.overflow = f64::from(u8::from(overflow));
                    match packer {
                        Some(packer) => {
                            let mut tensors = split_tensors(&mut half, &self.specs);
                            packer.all_reduce(comm, &mut tensors, &AllReduceOptions::sum())?;
                        }
                        None => comm.all_reduce(&mut half, &AllReduceOptions::sum())?,
                    }
                    ringtrain_kernels::par::f16_to_f32_unscaled(&half, 1.0, grads)?;
                } else {
                    match packer {
                        Some(packer) => {
                            let mut tensors = split_tensors(grads, &self.specs);
                            packer.all_reduce(comm, &mut tensors, &AllReduceOptions::sum())?;
                        }
                        None => comm.all_reduce(grads, &AllReduceOptions::sum())?,
                    }
                }
                let mut v = local.to_array();
                comm.all_reduce(&mut v, &AllReduceOptions::sum())?;
                StepStats::from_slice(&v)
            }
        };
        let communication_seconds = comm_start.elapsed().as_secs_f64();
        let opt_start = Instant::now();
        // Every replica holds the same bits, so this test agrees everywhere.
        let overflow = stats.overflow > 0.0 || ringtrain_kernels::has_non_finite_f32(grads);
        let mut grad_norm = 0.0;
        if !overflow {
            let correction = correction_factor(if fp16 { wire_scale } else { 1.0 }, stats.examples);
            grad_norm = update_replica(params, grads, correction, max_gradient_norm, optimizer)?;
        }
        Ok(StepOutcome {
            stats,
            skipped: overflow,
            grad_norm,
            communication_seconds,
            optimizer_seconds: opt_start.elapsed().as_secs_f64(),
        })
    }

    pub(super) fn all_reduce_f64(&mut self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        match &mut self.mode {
            Mode::Packed { comm, .. } => comm.all_reduce(buf, &AllReduceOptions::with_op(op))?,
            Mode::Overlapped { engine, .. } => {
                if op != ReduceOp::Sum {
                    // The fusion engine reduces with one op; other ops go through a
                    // per-rank slot vector summed, then folded here.
                    let world = self.world;
                    let n = buf.len();
                    let mut slots = vec![0.0f64; n * world];
                    slots[self.rank * n..(self.rank + 1) * n].copy_from_slice(buf);
                    let summed = engine
                        .submit("summary.slots", Tensor::from(slots))?
                        .wait()?
                        .into_vec::<f64>()?;
                    for (i, out) in buf.iter_mut().enumerate() {
                        let column = (0..world).map(|r| summed[r * n + i]);
                        *out = fold(op, column);
                    }
                } else {
                    let summed = engine
                        .submit("summary.sum", Tensor::from(buf.to_vec()))?
                        .wait()?
                        .into_vec::<f64>()?;
                    buf.copy_from_slice(&summed);
                }
            }
        }
        Ok(())
    }

    pub(super) fn shutdown(self) -> Result<Communicator> {
        match self.mode {
            Mode::Packed { comm, .. } => Ok(comm),
            Mode::Overlapped { engine, .. } => Ok(engine.shutdown()?),
        }
    }
}

fn fold(op: ReduceOp, values: impl Iterator<Item = f64>) -> f64 {
    match op {
        ReduceOp::Max => values.fold(f64::NEG_INFINITY, f64::max),
        ReduceOp::Min => values.fold(f64::INFINITY, f64::min),
        ReduceOp::Sum => values.sum(),
        ReduceOp::Average => {
            let (s, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
            s / n.max(1) as f64
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
