//! [`PipelineTrainable`]: one pipeline stage of a host-memory model as the trainer's model,
//! and the schedule loop it shares with the GPU stage (`StageRunner`).

use std::ops::Range;
use std::time::Instant;

use ringtrain_collective::Communicator;
use ringtrain_model::{
    view, view_mut, Backend, InPlace, Layout, NmtModel, PipelineModel, RnnLm, StepStats,
};

use super::{balance_by_cost, micro_batch_ranges, param_range, plan_stages, schedule, Pass};
use crate::config::{PipelineSchedule, ValidatedConfig};
use crate::error::{Error, Result};
use crate::trainable::staging::{lm_view, nmt_view, wrong_batch};
use crate::trainable::{param_specs, Batch, ParamSpec, PassOutput, ReadyCallback, TrainableModel};

/// A pipeline model that runs its stages on the trainer's [`Batch`].
pub trait StagesOnBatch: PipelineModel {
    /// [`PipelineModel::stage_forward`] on `batch`, viewed as the model's batch.
    ///
    /// # Errors
    /// `InvalidValue` naming `--model` when `batch` is for the other model; the model's.
    fn stage_forward_on(
        &mut self,
        slot: &mut Self::Slot,
        batch: &Batch,
        units: Range<usize>,
        input: &[f32],
        output: &mut Vec<f32>,
    ) -> Result<StepStats>;
}

impl<B: Backend> StagesOnBatch for NmtModel<B> {
    fn stage_forward_on(
        &mut self,
        slot: &mut Self::Slot,
        batch: &Batch,
        units: Range<usize>,
        input: &[f32],
        output: &mut Vec<f32>,
    ) -> Result<StepStats> {
        let Batch::Nmt(b) = batch else {
            return Err(wrong_batch("nmt"));
        };
        Ok(self.stage_forward(slot, &nmt_view(b), units, input, output)?)
    }
}

impl<B: Backend> StagesOnBatch for RnnLm<B> {
    fn stage_forward_on(
        &mut self,
        slot: &mut Self::Slot,
        batch: &Batch,
        units: Range<usize>,
        input: &[f32],
        output: &mut Vec<f32>,
    ) -> Result<StepStats> {
        let Batch::Lm(b) = batch else {
            return Err(wrong_batch("rnnlm"));
        };
        Ok(self.stage_forward(slot, &lm_view(b), units, input, output)?)
    }
}

/// Where a stage sits in its pipeline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StageInfo {
    /// This stage, `0..stages`.
    pub stage: usize,
    /// Stages K.
    pub stages: usize,
    /// The model's units this stage runs.
    pub units: Range<usize>,
    /// Every stage's range of the flat parameter buffer, in stage order.
    pub params: Vec<Range<usize>>,
    /// The names of this stage's units, comma-separated.
    pub unit_names: String,
}

impl StageInfo {
    /// This stage's range of the flat parameter buffer.
    pub fn own_params(&self) -> Range<usize> {
        self.params[self.stage].clone()
    }

    /// Whether this stage computes the loss.
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

/// Where one stage's time went in one batch (seconds).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StageTimes {
    /// Forward and backward passes.
    pub compute: f64,
    /// Blocked on a neighbour: sending, receiving and waiting for it (the bubble).
    pub wait: f64,
    /// Micro-batches the batch was cut into.
    pub micro_batches: usize,
    /// The most activation workspaces the stage held at once, counted after each
    /// forward: a micro-batch holds one from its forward to its backward, then hands it
    /// to the next (M under GPipe, at most `min(K - stage, M)` under 1F1B).
    pub peak_activation_slots: usize,
    /// The bytes of those workspaces at that peak (the model's estimate for each
    /// workspace's shape).
    pub peak_activation_bytes: f64,
}

/// The schedule of one stage over a batch, whatever the backend: runs the passes,
/// exchanges the boundary tensors, sums the stage's gradients over the micro-batches into
/// an accumulator of the backend's (on a GPU it stays there), and keeps the activation
/// workspaces of the micro-batches in flight (see [`StageTimes::peak_activation_slots`]).
pub(crate) struct StageRunner<M: PipelineModel> {
    comm: Communicator,
    info: StageInfo,
    kind: PipelineSchedule,
    micro_batches: usize,
    /// A slot per micro-batch index, kept from batch to batch (an RNNLM's rows carry
    /// their state in it); it holds a workspace only between its forward and backward.
    slots: Vec<M::Slot>,
    /// Workspaces of micro-batches whose backward is done, for the next forwards.
    spare: Vec<M::Slot>,
    times: StageTimes,
}

impl<M> StageRunner<M>
where
    M: StagesOnBatch + Send,
{
    /// Stage `cfg.pipeline_stage(comm.rank())` of `model` (see [`PipelineTrainable::new`]),
    /// the stages balanced by `unit_costs` when given (every rank passes the same).
    pub(crate) fn new(
        model: &M,
        comm: Communicator,
        cfg: &ValidatedConfig,
        unit_costs: Option<&[f64]>,
    ) -> Result<Self> {
        let exchange = &cfg.config().exchange;
        let units = model.pipeline_units();
        let stages = cfg.pipeline_stages();
        let mut plan = plan_stages(&units, stages, &exchange.pipeline_split)?;
        if let Some(costs) = unit_costs.filter(|_| exchange.pipeline_split.is_empty()) {
            let by_cost = balance_by_cost(costs, stages);
            if by_cost.len() != stages {
                return Err(Error::Internal(format!(
                    "{} unit costs cannot balance {stages} stages",
                    costs.len()
                )));
            }
            plan = by_cost;
        }
        let stage = cfg.pipeline_stage(comm.rank());
        let names: Vec<&str> = units[plan[stage].clone()]
            .iter()
            .map(|u| u.name.as_str())
            .collect();
        let info = StageInfo {
            stage,
            stages,
            units: plan[stage].clone(),
            params: plan.iter().map(|r| param_range(&units, r)).collect(),
            unit_names: names.join(", "),
        };
        Ok(StageRunner {
            comm,
            info,
            kind: exchange.pipeline_schedule,
            micro_batches: exchange.micro_batches,
            slots: Vec::new(),
            spare: Vec::new(),
            times: StageTimes::default(),
        })
    }

    pub(crate) fn info(&self) -> &StageInfo {
        &self.info
    }

    pub(crate) fn times(&self) -> StageTimes {
        self.times
    }

    /// Receives from `from` (after sending `pending` on, as one exchange when both are
    /// due), as f32 values.
    fn exchange(
        &self,
        pending: Option<(usize, Vec<f32>)>,
        from: Option<usize>,
    ) -> Result<Vec<f32>> {
        let transport = self.comm.transport();
        let bytes = match (pending, from) {
            (Some((to, data)), Some(from)) => {
                transport.sendrecv_vec(to, bytemuck::cast_slice(&data), from)?
            }
            (None, Some(from)) => transport.recv_vec(from)?,
            (Some((to, data)), None) => {
                transport.send(to, bytemuck::cast_slice(&data))?;
                Vec::new()
            }
            (None, None) => Vec::new(),
        };
        if bytes.len() % 4 != 0 {
            return Err(Error::Internal(format!(
                "a pipeline neighbour sent {} bytes, not whole f32 values",
                bytes.len()
            )));
        }
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Gives micro-batch `i` a workspace: a spare one when there is one (the model
    /// allocates one otherwise, on its forward).
    fn lend_workspace(&mut self, i: usize) {
        if !M::holds_activations(&self.slots[i]) {
            if let Some(mut spare) = self.spare.pop() {
                M::move_activations(&mut spare, &mut self.slots[i]);
            }
        }
    }

    /// The activation workspaces the stage holds (in micro-batches' slots and spare),
    /// and their bytes.
    fn workspaces_held(&self, model: &M) -> (usize, f64) {
        self.slots
            .iter()
            .chain(&self.spare)
            .filter(|s| M::holds_activations(s))
            .fold((0, 0.0), |(n, b), s| (n + 1, b + model.activation_bytes(s)))
    }

    /// Takes micro-batch `i`'s workspace back after its backward.
    fn return_workspace(&mut self, i: usize) {
        if M::holds_activations(&self.slots[i]) {
            let mut spare = M::Slot::default();
            M::move_activations(&mut self.slots[i], &mut spare);
            self.spare.push(spare);
        }
    }

    /// The stage's passes over `batch`: leaves the gradient of the batch's summed loss
    /// w.r.t. the stage's own parameters in `acc` (the length of its range).
    pub(crate) fn run(
        &mut self,
        model: &mut M,
        batch: &Batch,
        acc: &mut <M::Backend as Backend>::Buffer,
    ) -> Result<PassOutput> {
        let start = Instant::now();
        let micro: Vec<Batch> = micro_batch_ranges(batch.examples(), self.micro_batches)
            .into_iter()
            .map(|r| batch.columns(r))
            .collect();
        self.slots.resize_with(micro.len(), Default::default);
        let own = self.info.own_params();
        let whole = Layout::contiguous(own.start, own.len());
        let summed = Layout::contiguous(0, own.len());
        model.backend().fill(view_mut(acc, summed), 0.0)?;
        let (stage, stages) = (self.info.stage, self.info.stages);
        let rank = self.comm.rank();
        let prev = (stage > 0).then(|| rank - 1);
        let next = (stage + 1 < stages).then(|| rank + 1);
        let units = self.info.units.clone();
        let mut out = PassOutput::default();
        let mut times = StageTimes {
            micro_batches: micro.len(),
            ..StageTimes::default()
        };
        let mut first_backward: Option<Instant> = None;
        let mut pending: Option<(usize, Vec<f32>)> = None;
        for pass in schedule(self.kind, stages, stage, micro.len()) {
            let from = match pass {
                Pass::Forward(_) => prev,
                Pass::Backward(_) => next,
            };
            let waited = Instant::now();
            let incoming = self.exchange(pending.take(), from)?;
            times.wait += waited.elapsed().as_secs_f64();
            let computed = Instant::now();
            match pass {
                Pass::Forward(i) => {
                    self.lend_workspace(i);
                    let mut boundary = Vec::new();
                    let stats = model.stage_forward_on(
                        &mut self.slots[i],
                        &micro[i],
                        units.clone(),
                        &incoming,
                        &mut boundary,
                    )?;
                    out.loss_sum += stats.loss_sum;
                    out.target_tokens += stats.tokens;
                    out.launches += stats.launches;
                    let (held, bytes) = self.workspaces_held(model);
                    if held > times.peak_activation_slots {
                        times.peak_activation_slots = held;
                        times.peak_activation_bytes = bytes;
                    }
                    pending = next.map(|to| (to, boundary));
                }
                Pass::Backward(i) => {
                    first_backward.get_or_insert(computed);
                    let mut boundary = Vec::new();
                    let stats = model.stage_backward(
                        &mut self.slots[i],
                        units.clone(),
                        &incoming,
                        &mut boundary,
                        &mut |_, _| {},
                    )?;
                    self.return_workspace(i);
                    out.launches += stats.launches + 1;
                    let (be, grads) = (model.backend(), model.grads());
                    be.in_place(InPlace::Add, view(grads, whole), view_mut(acc, summed))?;
                    pending = prev.map(|to| (to, boundary));
                }
            }
            times.compute += computed.elapsed().as_secs_f64();
        }
        let waited = Instant::now();
        self.exchange(pending.take(), None)?;
        times.wait += waited.elapsed().as_secs_f64();
        let end = Instant::now();
        let split = first_backward.unwrap_or(end);
        out.forward_seconds = split.duration_since(start).as_secs_f64();
        out.backward_seconds = end.duration_since(split).as_secs_f64();
        self.times = times;
        Ok(out)
    }
}

/// One pipeline stage of a host-memory model (see the [module docs](super)).
pub struct PipelineTrainable<M: PipelineModel> {
    model: M,
    runner: StageRunner<M>,
    acc: Vec<f32>,
    specs: Vec<ParamSpec>,
    description: String,
}

impl<M> PipelineTrainable<M>
where
    M: StagesOnBatch + Send,
    M::Backend: Backend<Buffer = Vec<f32>>,
{
    /// Stage `cfg.pipeline_stage(comm.rank())` of `model`, exchanging boundary tensors
    /// with its neighbours over `comm` (a communicator of its own: collective, so every
    /// rank makes it at the same point); the stages balanced by `unit_costs` (seconds
    /// per unit, the same on every rank) when given and no split is given by hand.
    ///
    /// # Errors
    /// `InvalidValue` when the stages do not fit the model's units.
    pub fn new(
        model: M,
        comm: Communicator,
        cfg: &ValidatedConfig,
        description: String,
        unit_costs: Option<&[f64]>,
    ) -> Result<Self> {
        let runner = StageRunner::new(&model, comm, cfg, unit_costs)?;
        let own = runner.info().own_params();
        Ok(PipelineTrainable {
            specs: param_specs(model.layout()),
            model,
            runner,
            acc: vec![0.0; own.len()],
            description,
        })
    }

    /// Where this stage sits.
    pub fn info(&self) -> &StageInfo {
        self.runner.info()
    }

    /// The time split of the last batch.
    pub fn times(&self) -> StageTimes {
        self.runner.times()
    }
}

impl<M> TrainableModel for PipelineTrainable<M>
where
    M: StagesOnBatch + Send,
    M::Backend: Backend<Buffer = Vec<f32>>,
{
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    fn params(&self) -> Result<&[f32]> {
        Ok(self.model.params())
    }
    fn params_mut(&mut self) -> Result<&mut [f32]> {
        Ok(self.model.params_mut())
    }
    fn params_and_grads_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        let (p, g) = self.model.params_and_grads_mut();
        Ok((p, g))
    }
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        let out = self.runner.run(&mut self.model, batch, &mut self.acc)?;
        let own = self.runner.info().own_params();
        let grads = self.model.grads_mut();
        grads.fill(0.0);
        grads[own].copy_from_slice(&self.acc);
        let n = grads.len();
        on_ready(0..n, grads)?;
        Ok(out)
    }
    fn evaluate(&mut self, _batches: &[Batch]) -> Result<PassOutput> {
        Err(held_out_not_pipelined())
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
    fn pipeline_stage(&self) -> Option<(StageInfo, StageTimes)> {
        Some((self.runner.info().clone(), self.runner.times()))
    }
}

/// Held-out evaluation of a pipeline stage (refused by validation first).
pub(crate) fn held_out_not_pipelined() -> Error {
    Error::invalid(
        "--eval-data",
        "given",
        "held-out evaluation does not run through a pipeline yet",
    )
}
