//! Pipeline stages: a model cut into consecutive units, each stage running a range of
//! them on micro-batches and exchanging boundary tensors with its neighbours.
//!
//! A [`PipelineModel`] lists its units in forward order ([`PipelineModel::pipeline_units`]),
//! each with the contiguous range of the flat parameter buffer its tensors occupy (the
//! buffer is in backward order, so a run of consecutive units is one contiguous range).
//! [`PipelineModel::stage_forward`] runs a range of units on one micro-batch: it reads
//! the boundary tensor the stage before sent (nothing for the first stage) and writes the
//! one the stage after needs (nothing for the last, which returns the loss).
//! [`PipelineModel::stage_backward`] then takes the gradient w.r.t. that output and
//! writes the gradient w.r.t. the input, overwriting the gradients of the stage's own
//! tensors only. Boundary tensors are host `f32` vectors: on a GPU they are staged
//! device → host → device, as gradients are for the ring.
//!
//! Each micro-batch in flight keeps its activations in a [`PipelineModel::Slot`] of its
//! own (the model swaps it in for the pass), as does an RNNLM's carried LSTM state, so a
//! stage can hold several micro-batches between their forward and backward passes.
//! [`PipelineModel::move_activations`] hands a workspace from a micro-batch whose
//! backward is done to the next one, so a schedule that keeps few micro-batches in
//! flight (1F1B) keeps few workspaces.
//! The model keeps its flat buffers whole on every stage; a stage reads and writes only
//! its units' part of them.
//!
//! Units: RNNLM `embedding`, `layer 0` .. `layer L-1`, `projection + loss`; NMT `source
//! embedding + encoder`, `decoder layer 0` (with the target embedding) .. `decoder layer
//! L-1`, `projection + loss`. The NMT decoder's layer `l` starts from the encoder's final
//! state of its layer `l` (uni), or of the `l`-th in the order fw0, bw0, fw1, ... (bi): a
//! boundary at or after the encoder carries, beside the activations of the decoder layer
//! below (when there is one), the final `(h, c)` of every encoder layer whose decoder
//! layer lies past the boundary; the stage that holds that decoder layer reads them, and
//! its backward sends their gradients (`dh0`, `dc0`) back the same way to the encoder's
//! stage.

use std::ops::Range;

use crate::backend::Backend;
use crate::error::{batch_error, Result};
use crate::model::{GradsReady, Model, StepStats};
use crate::params::ParamLayout;

/// One unit a pipeline can place on a stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelineUnit {
    /// What the unit holds (`decoder layer 1`).
    pub name: String,
    /// Its tensors' range of the flat parameter buffer.
    pub params: Range<usize>,
}

/// A model that can run as consecutive pipeline stages (see the module docs).
pub trait PipelineModel: Model {
    /// The activations (and carried state) of one micro-batch between its forward and
    /// backward passes on a stage. `Default` is an empty slot.
    type Slot: Default + Send;

    /// The units in forward order.
    fn pipeline_units(&self) -> Vec<PipelineUnit>;

    /// Moves the activation workspace of `from` into `to` (replacing any `to` held),
    /// leaving `from` without one; state a micro-batch carries to the next batch (an
    /// RNNLM's rows) stays in its slot. A stage reuses the workspace of a micro-batch
    /// whose backward is done for the next forward this way, so it holds only as many
    /// workspaces as it has micro-batches in flight.
    fn move_activations(from: &mut Self::Slot, to: &mut Self::Slot);

    /// Whether `slot` holds an activation workspace.
    fn holds_activations(slot: &Self::Slot) -> bool;

    /// Bytes of the activation workspace `slot` holds (0 without one), as the model's
    /// memory estimate counts them for the workspace's shape (the whole model's
    /// workspace: a stage allocates it whole and uses its units' part).
    fn activation_bytes(&self, slot: &Self::Slot) -> f64;

    /// Forward over `units` of micro-batch `batch` in `slot`: reads `input` (the boundary
    /// tensor of the stage before; empty for a stage that starts at unit 0) and appends
    /// the boundary tensor for the stage after to `output` (nothing for a stage that ends
    /// with the loss). The loss and tokens of the returned stats are those of the last
    /// stage (0 elsewhere).
    ///
    /// # Errors
    /// `InvalidBatch` for a malformed batch or an `input` of the wrong length; backend
    /// errors.
    fn stage_forward(
        &mut self,
        slot: &mut Self::Slot,
        batch: &Self::Batch<'_>,
        units: Range<usize>,
        input: &[f32],
        output: &mut Vec<f32>,
    ) -> Result<StepStats>;

    /// Backward over `units` of the micro-batch whose forward `slot` holds: reads
    /// `output_grad` (the gradient w.r.t. what forward sent on; empty for the last
    /// stage), overwrites the gradients of the units' tensors (calling `on_grads_ready`
    /// for each, in buffer order) and appends the gradient w.r.t. `input` to
    /// `input_grad` (nothing for the first stage).
    ///
    /// # Errors
    /// `InvalidBatch` when `slot` holds no forward pass or `output_grad` has the wrong
    /// length; backend errors.
    fn stage_backward(
        &mut self,
        slot: &mut Self::Slot,
        units: Range<usize>,
        output_grad: &[f32],
        input_grad: &mut Vec<f32>,
        on_grads_ready: &mut GradsReady<'_, <Self::Backend as Backend>::Buffer>,
    ) -> Result<StepStats>;
}

/// The units of `layout`: `unit_of(name)` gives the unit of each tensor (`None` is a
/// bug of the caller's naming), `names` the units' names in forward order.
pub(crate) fn units_from_layout(
    layout: &ParamLayout,
    names: Vec<String>,
    unit_of: impl Fn(&str) -> Option<usize>,
) -> Vec<PipelineUnit> {
    let mut ranges: Vec<Option<Range<usize>>> = vec![None; names.len()];
    for e in layout.entries() {
        if let Some(r) = unit_of(&e.name).and_then(|u| ranges.get_mut(u)) {
            let range = e.range();
            *r = Some(match r.take() {
                Some(old) => old.start.min(range.start)..old.end.max(range.end),
                None => range,
            });
        }
    }
    names
        .into_iter()
        .zip(ranges)
        .map(|(name, params)| PipelineUnit {
            name,
            params: params.unwrap_or(0..0),
        })
        .collect()
}

/// The bytes of an estimate's workspace terms (all but the parameters, their gradients
/// and carried state); 0 for a shape too big to estimate.
pub(crate) fn workspace_bytes(estimate: Result<crate::memory::MemoryEstimate>) -> f64 {
    estimate.map_or(0.0, |e| {
        e.terms
            .iter()
            .filter(|t| {
                !matches!(
                    t.what.as_str(),
                    "parameters" | "gradients" | "carried LSTM state"
                )
            })
            .map(|t| t.bytes)
            .sum()
    })
}

/// Checks that `units` is a non-empty range of `0..count`.
pub(crate) fn check_units(units: &Range<usize>, count: usize) -> Result<()> {
    if units.start < units.end && units.end <= count {
        Ok(())
    } else {
        Err(batch_error(
            "pipeline units",
            format!("{units:?}"),
            format!("a stage runs a non-empty range of the model's {count} units"),
        ))
    }
}

/// Checks that a boundary tensor has `expected` values.
pub(crate) fn check_boundary(name: &'static str, got: usize, expected: usize) -> Result<()> {
    if got == expected {
        Ok(())
    } else {
        Err(batch_error(
            name,
            format!("{got} values"),
            format!(
                "the neighbouring stage must send {expected} values for this micro-batch: \
                 both stages need the same model, split and micro-batch"
            ),
        ))
    }
}

/// Reads boundary values into device buffers: `parts` are `(buffer, offset, len)` in the
/// boundary tensor's order.
pub(crate) struct BoundaryReader<'a> {
    data: &'a [f32],
    at: usize,
}

impl<'a> BoundaryReader<'a> {
    pub(crate) fn new(data: &'a [f32]) -> Self {
        BoundaryReader { data, at: 0 }
    }

    /// Uploads the next `len` values into `buf` at `offset`.
    pub(crate) fn read_into<B: Backend>(
        &mut self,
        be: &B,
        buf: &mut B::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<()> {
        let end = self.at + len;
        let Some(part) = self.data.get(self.at..end) else {
            return Err(batch_error(
                "pipeline boundary",
                format!("{} values", self.data.len()),
                format!("at least {end} are needed"),
            ));
        };
        be.upload(part, buf, offset)?;
        self.at = end;
        Ok(())
    }
}

/// Appends `len` values of `buf` from `offset` to `out`.
pub(crate) fn write_from<B: Backend>(
    be: &B,
    buf: &B::Buffer,
    offset: usize,
    len: usize,
    out: &mut Vec<f32>,
) -> Result<()> {
    let start = out.len();
    out.resize(start + len, 0.0);
    be.download(buf, offset, &mut out[start..])
}
