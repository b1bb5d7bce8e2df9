//! The [`Backend`] trait: buffers, matrix products and the kernels' operations, as the
//! LSTM layers and models issue them.
//!
//! Every operation (everything but [`Backend::zeros`], [`Backend::upload`],
//! [`Backend::download`] and the staging calls) counts as one launch in
//! [`Backend::launches`]: on a GPU each is one kernel launch (a few are two, see the CUDA
//! backend), on the CPU one call into a kernel or GEMM routine.
//! [`Backend::softmax_xent_forward_backward`] is one on the CPU and two (its forward and
//! its backward) on a backend that takes the trait's default, the CUDA backend. The models
//! report the launches a batch issued in [`crate::StepStats::launches`].
//!
//! # Operands are views
//!
//! A model keeps a few large buffers (one flat parameter buffer, one flat gradient buffer,
//! a workspace per layer) and addresses tensors inside them. An operand is a [`View`]
//! (read) or [`ViewMut`] (written): a buffer and a [`Layout`], the `[rows, cols]` matrix at
//! an offset with a row and a column stride. A transposed operand is the transposed layout
//! ([`Layout::t`]); one gate block of a `[rows, 4H]` matrix is a narrower layout with the
//! wide row stride ([`Layout::narrow_cols`]).
//!
//! Before it touches memory, every operation checks its operands, in code both backends
//! share, so that they accept and reject the same calls with the same errors:
//! - each operand's layout against its buffer ([`Layout::check`]):
//!   [`Error::OutOfBounds`] naming the operand;
//! - the shapes the operation needs its operands to agree on, and the strides it can take
//!   (element-wise operations, reductions and the fused kernels need contiguous operands,
//!   [`Backend::gemm`] one unit stride per operand): [`Error::InvalidView`] naming the
//!   operand.
//!
//! # Token ids and softmax targets are staged once per pass
//!
//! Embedding lookups and the loss take ids and labels that come from the host. A model
//! checks them once per batch ([`CheckedIds::new`], [`CheckedTargets::new`]: the first bad
//! id is an [`Error::InvalidBatch`] naming the batch field and position), hands them to
//! the backend once ([`Backend::stage_ids`], [`Backend::stage_targets`]; the CUDA backend
//! uploads them into pooled device buffers) and passes the staged values to the forward
//! and the backward operations, which then only compare the bound the ids were checked
//! against with the table's row count.

mod layout;
mod operands;

pub mod cpu;
pub mod cuda;

pub use cpu::{Bf16Casts, CpuBackend, CpuIds, CpuTargets};
pub use cuda::CudaBackend;
#[cfg(feature = "cuda")]
pub use cuda::{CudaIds, CudaTargets};
pub use layout::{view, view_mut, Layout, View, ViewMut};

use std::ops::Range;
use std::sync::mpsc;

use crate::error::{batch_error, Error, Result};

/// Where a stretch of a backend's operations runs ([`Backend::executor`]): on the CPU
/// backend's thread pool, so that each operation starts its parallel work on the thread it
/// is already on instead of handing it to the pool and sleeping until it is done (two
/// context switches per operation, hundreds per pass); elsewhere on the calling thread.
#[derive(Debug, Clone, Default)]
pub struct Executor(Option<std::sync::Arc<rayon::ThreadPool>>);

impl Executor {
    /// An executor that runs on `pool`.
    pub(crate) fn on(pool: std::sync::Arc<rayon::ThreadPool>) -> Self {
        Executor(Some(pool))
    }

    /// Runs `f` there, and returns what it returns.
    pub fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.0 {
            Some(pool) => pool.install(f),
            None => f(),
        }
    }

    /// Runs `work` there, handing it a callback that runs `on_call` on this thread (the
    /// caller's, which may hold what must not move, a communicator) and returns when
    /// `on_call` has: two thread switches per call, where running `work` here would cost
    /// two per operation. Returns what `work` returns; a panic in `work` reaches the
    /// caller.
    pub fn run_calling_back<R: Send, Buf: Sync>(
        &self,
        work: impl FnOnce(&mut dyn FnMut(Range<usize>, &Buf)) -> R + Send,
        on_call: &mut dyn FnMut(Range<usize>, &Buf),
    ) -> R {
        let Some(pool) = &self.0 else {
            return work(on_call);
        };
        /// A buffer lent to the caller's thread for one call.
        struct Lent<Buf>(*const Buf);
        // SAFETY: the pointer is read on the caller's thread only while the pool thread
        // that lent it waits for the call to end, keeping the borrow alive and the buffer
        // unchanged; `Buf: Sync` lets another thread read it.
        unsafe impl<Buf: Sync> Send for Lent<Buf> {}

        let (to_caller, calls) = mpsc::channel::<(Range<usize>, Lent<Buf>)>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let mut result = None;
        let out = &mut result;
        pool.in_place_scope(|scope| {
            scope.spawn(move |_| {
                let mut call = |range: Range<usize>, buf: &Buf| {
                    // The caller gone (it panicked) answers nothing: carry on.
                    if to_caller.send((range, Lent(buf))).is_ok() {
                        let _ = done_rx.recv();
                    }
                };
                *out = Some(work(&mut call));
            });
            // Until the work ends and drops its sender.
            for (range, lent) in calls {
                // SAFETY: see `Lent`: the sender waits on `done_rx` until this call ends.
                on_call(range, unsafe { &*lent.0 });
                let _ = done_tx.send(());
            }
        });
        // The scope re-raises a panic of the work, so a result is here.
        result.expect("the work ran to its end")
    }
}

/// Element type of the matrix-product operands of a backend (the CUDA backend's
/// `with_precision`; the CPU backend multiplies in f32).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum GemmPrecision {
    /// f32 operands, f32 GEMM.
    #[default]
    F32,
    /// Operands rounded to f16, tensor-core GEMM with f32 accumulation (mixed precision).
    F16,
    /// Operands rounded to bf16, tensor-core GEMM with f32 accumulation (mixed precision).
    Bf16,
}

impl GemmPrecision {
    /// The name (`f32`, `f16`, `bf16`).
    pub fn as_str(self) -> &'static str {
        match self {
            GemmPrecision::F32 => "f32",
            GemmPrecision::F16 => "f16",
            GemmPrecision::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for GemmPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for GemmPrecision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(GemmPrecision::F32),
            "f16" => Ok(GemmPrecision::F16),
            "bf16" => Ok(GemmPrecision::Bf16),
            other => Err(crate::error::invalid_value(
                "gemm precision",
                other,
                "use `f32`, `f16` or `bf16`",
            )),
        }
    }
}

/// Element-wise function of one operand: `dst = f(x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unary {
    /// Logistic sigmoid `1 / (1 + e^-x)`.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
}

/// Element-wise function of two operands: `dst = f(a, b)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binary {
    /// `a + b`.
    Add,
    /// `a * b`.
    Mul,
}

/// Element-wise update of `dst` by `x`: `dst = f(dst, x)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InPlace {
    /// `dst += x`.
    Add,
    /// `dst *= x * (1 - x)`: gradient through a sigmoid whose output is `x`.
    MulSigmoidGrad,
    /// `dst *= 1 - x²`: gradient through a tanh whose output is `x`.
    MulTanhGrad,
}

/// Operands of [`Backend::lstm_forward_step`], one time step of a fused LSTM layer with
/// `batch` rows and `H` hidden units. Every operand is contiguous; `c` gives the shape.
#[derive(Debug)]
pub struct LstmForwardStep<'a, Buf> {
    /// `x_t·W_ih` of this step, `[batch, 4H]`.
    pub input_proj: View<'a, Buf>,
    /// `h_prev·W_hh` of this step, `[batch, 4H]`.
    pub recurrent: View<'a, Buf>,
    /// `[4H]` (any shape of `4H` elements).
    pub bias: View<'a, Buf>,
    /// The buffer of the cell states: `c_prev` is read from it, `c` written into it.
    pub cells: &'a mut Buf,
    /// Where `c_prev` (`[batch, H]`) lies in `cells`.
    pub c_prev: Layout,
    /// Where the new `c` (`[batch, H]`) goes in `cells`; must not overlap `c_prev`.
    pub c: Layout,
    /// The new `h`, `[batch, H]`.
    pub h: ViewMut<'a, Buf>,
    /// The gate activations `i | f | g | o`, `[batch, 4H]`.
    pub act: ViewMut<'a, Buf>,
}

/// Operands of [`Backend::lstm_backward_step`], one time step with `batch` rows and `H`
/// hidden units. Every operand is contiguous; `c` gives the shape.
#[derive(Debug)]
pub struct LstmBackwardStep<'a, Buf> {
    /// The step's gate activations from the forward, `[batch, 4H]`.
    pub act: View<'a, Buf>,
    /// The step's previous cell state, `[batch, H]`.
    pub c_prev: View<'a, Buf>,
    /// The step's cell state, `[batch, H]`.
    pub c: View<'a, Buf>,
    /// Gradient w.r.t. the step's `h`, `[batch, H]`.
    pub dh: View<'a, Buf>,
    /// Gradient reaching `c` from the next step, `[batch, H]`.
    pub dc: View<'a, Buf>,
    /// Gradient w.r.t. the pre-activations (written), `[batch, 4H]`.
    pub dgates: ViewMut<'a, Buf>,
    /// Gradient w.r.t. `c_prev` (written), `[batch, H]`.
    pub dc_prev: ViewMut<'a, Buf>,
}

/// Token ids, each checked below a bound: what [`Backend::stage_ids`] takes.
#[derive(Debug, Clone, Copy)]
pub struct CheckedIds<'a> {
    ids: &'a [u32],
    bound: usize,
}

impl<'a> CheckedIds<'a> {
    /// Checks that every id of `ids` is below `bound` (a vocabulary size: the rows of the
    /// tables the ids will index).
    ///
    /// # Errors
    /// [`Error::InvalidBatch`] naming `field` and the position of the first id `>= bound`.
    pub fn new(field: &'static str, ids: &'a [u32], bound: usize) -> Result<Self> {
        match ids.iter().position(|&id| id as usize >= bound) {
            Some(pos) => Err(batch_error(
                field,
                format!("{} at position {pos}", ids[pos]),
                format!(
                    "token ids must be below the vocab size {bound}: check the vocab files or the model config"
                ),
            )),
            None => Ok(CheckedIds { ids, bound }),
        }
    }

    /// The ids.
    pub fn ids(&self) -> &'a [u32] {
        self.ids
    }

    /// Every id is below this.
    pub fn bound(&self) -> usize {
        self.bound
    }
}

/// Softmax targets checked against a vocabulary: a label and a mask weight per row, what
/// [`Backend::stage_targets`] takes.
///
/// Every weight is finite and every row with a non-zero weight has a label below the
/// vocabulary size. Rows with weight 0 are padding: their labels are not looked at and may
/// be anything.
#[derive(Debug, Clone, Copy)]
pub struct CheckedTargets<'a> {
    labels: &'a [u32],
    mask: &'a [f32],
    vocab: usize,
}

impl<'a> CheckedTargets<'a> {
    /// Checks `labels` (batch field `field`) and `mask` against `vocab`.
    ///
    /// # Errors
    /// [`Error::InvalidBatch`]: `mask` when its length differs from the labels' or a weight
    /// is not finite; `field` for the first label of an unmasked row that is `>= vocab`.
    pub fn new(
        field: &'static str,
        labels: &'a [u32],
        mask: &'a [f32],
        vocab: usize,
    ) -> Result<Self> {
        if labels.len() != mask.len() {
            return Err(batch_error(
                "mask",
                format!("{} elements", mask.len()),
                format!(
                    "expected one weight per label of `{field}` ({})",
                    labels.len()
                ),
            ));
        }
        for (pos, (&label, &m)) in labels.iter().zip(mask).enumerate() {
            if !m.is_finite() {
                return Err(batch_error(
                    "mask",
                    format!("{m} at position {pos}"),
                    "mask weights must be finite (1.0 real token, 0.0 padding)",
                ));
            }
            if m != 0.0 && label as usize >= vocab {
                return Err(batch_error(
                    field,
                    format!("{label} at position {pos}"),
                    format!("target ids of unmasked tokens must be below the vocab size {vocab}"),
                ));
            }
        }
        Ok(CheckedTargets {
            labels,
            mask,
            vocab,
        })
    }

    /// The labels, one per row.
    pub fn labels(&self) -> &'a [u32] {
        self.labels
    }

    /// The mask weights, one per row.
    pub fn mask(&self) -> &'a [f32] {
        self.mask
    }

    /// Labels of unmasked rows are below this.
    pub fn vocab(&self) -> usize {
        self.vocab
    }
}

/// Values a backend staged for a pass ([`Backend::stage_ids`], [`Backend::stage_targets`]).
pub trait Staged {
    /// Number of rows (ids, or labels with their weights).
    fn rows(&self) -> usize;
    /// The bound the values were checked against: every id, and every label of an
    /// unmasked row, is below it.
    fn bound(&self) -> usize;
}

/// Compute backend of the models: owns memory of type [`Backend::Buffer`] and runs the
/// operations a training step needs on it (see the module docs for views and staging).
pub trait Backend: Send {
    /// A buffer of f32 elements in the backend's memory.
    type Buffer: Send + Sync;
    /// Token ids staged for a pass: what the embedding operations read.
    type Ids: Staged + Send;
    /// Softmax labels and mask weights staged for a pass.
    type Targets: Staged + Send;

    /// Short name for reports (`"cpu"`).
    fn name(&self) -> &'static str;
    /// A new buffer of `len` zeros.
    fn zeros(&self, len: usize) -> Result<Self::Buffer>;
    /// Number of elements of `buf`.
    fn len(&self, buf: &Self::Buffer) -> usize;
    /// Copies host `src` into `dst[offset..offset + src.len()]`.
    fn upload(&self, src: &[f32], dst: &mut Self::Buffer, offset: usize) -> Result<()>;
    /// Copies `src[offset..offset + dst.len()]` to host `dst`.
    fn download(&self, src: &Self::Buffer, offset: usize, dst: &mut [f32]) -> Result<()>;
    /// Operations issued since the backend was created.
    fn launches(&self) -> u64;
    /// Called by the models when a pass (forward, or forward and backward) starts, with
    /// their parameter buffer, which then stays unchanged until [`Backend::end_pass`]: a
    /// backend may keep values derived from the parameters for that long (the CUDA backend
    /// casts each weight tensor to 16 bits once per pass in mixed precision). Default:
    /// nothing.
    fn begin_pass(&self, _params: &Self::Buffer) {}
    /// Ends the pass [`Backend::begin_pass`] started; derived values are stale from now on.
    fn end_pass(&self) {}
    /// Where this backend's operations run fastest, for a stretch of them that calls back
    /// into nothing else (a forward pass). Default: the calling thread.
    fn executor(&self) -> Executor {
        Executor::default()
    }

    /// Stages checked ids for the embedding operations of a pass (the CUDA backend uploads
    /// them, with the grouping its scatter needs, into a pooled device buffer that goes back
    /// to the pool when the returned value drops). Not a launch.
    fn stage_ids(&self, ids: CheckedIds<'_>) -> Result<Self::Ids>;
    /// Stages checked softmax targets for a pass (the CUDA backend uploads them into pooled
    /// device buffers). Not a launch.
    fn stage_targets(&self, targets: CheckedTargets<'_>) -> Result<Self::Targets>;

    /// `dst = value` for a contiguous `dst`.
    fn fill(&self, dst: ViewMut<'_, Self::Buffer>, value: f32) -> Result<()>;
    /// `dst = src`, both contiguous and of equal length.
    fn copy(&self, src: View<'_, Self::Buffer>, dst: ViewMut<'_, Self::Buffer>) -> Result<()>;
    /// The matrix product `C = A·B` (or `C += A·B` when `accumulate`) of `A: [m, k]`,
    /// `B: [k, n]` and `C: [m, n]`.
    ///
    /// Each of the three must have a unit stride in one dimension and, in the other, a
    /// stride at least the extent of the first (for a row-major `[r, c]` matrix: row stride
    /// `>= c`): a row-major matrix, a block of columns of one, or the transpose of either.
    /// So `A·Bᵀ` is `gemm(a, b.t(), c, ..)` for a `B` stored `[n, k]`, and any combination
    /// of transposes is accepted, including both operands and the result.
    fn gemm(
        &self,
        a: View<'_, Self::Buffer>,
        b: View<'_, Self::Buffer>,
        c: ViewMut<'_, Self::Buffer>,
        accumulate: bool,
    ) -> Result<()>;
    /// Embedding lookup: row `r` of `dst` (`[ids.rows(), width]`) = row `ids[r]` of
    /// `table` (`[table_rows, width]`, `table_rows >= ids.bound()`). Both contiguous.
    fn gather_rows(
        &self,
        table: View<'_, Self::Buffer>,
        ids: &Self::Ids,
        dst: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
    /// Embedding gradient: row `ids[r]` of `table` (`[table_rows, width]`,
    /// `table_rows >= ids.bound()`) += row `r` of `src` (`[ids.rows(), width]`). Rows are
    /// added in order `r = 0, 1, ...` (deterministic). Both contiguous.
    fn scatter_add_rows(
        &self,
        src: View<'_, Self::Buffer>,
        ids: &Self::Ids,
        table: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
    /// `dst[c] (+)= sum over r of src[r, c]` for a contiguous `[rows, cols]` `src` and a
    /// contiguous `dst` of `cols` elements (bias gradient).
    fn column_sums(
        &self,
        src: View<'_, Self::Buffer>,
        dst: ViewMut<'_, Self::Buffer>,
        accumulate: bool,
    ) -> Result<()>;
    /// `dst[r, c] += bias[c]` for a contiguous `[rows, cols]` `dst` and a contiguous `bias`
    /// of `cols` elements.
    fn add_row_bias(
        &self,
        bias: View<'_, Self::Buffer>,
        dst: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
    /// `dst = op(x)`, both contiguous and of equal length.
    fn unary(
        &self,
        op: Unary,
        x: View<'_, Self::Buffer>,
        dst: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
    /// `dst = op(a, b)`, all contiguous and of equal length.
    fn binary(
        &self,
        op: Binary,
        a: View<'_, Self::Buffer>,
        b: View<'_, Self::Buffer>,
        dst: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
    /// `dst = op(dst, x)`, both contiguous and of equal length.
    fn in_place(
        &self,
        op: InPlace,
        x: View<'_, Self::Buffer>,
        dst: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
    /// Fused LSTM pointwise forward of one step (kernel `lstm_pointwise_forward_step`):
    /// pre-activations `input_proj + recurrent + bias`; writes `c`, `h` and the activations
    /// (see [`LstmForwardStep`]).
    fn lstm_forward_step(&self, step: LstmForwardStep<'_, Self::Buffer>) -> Result<()>;
    /// Fused LSTM pointwise backward of one step (kernel `lstm_pointwise_backward`): writes
    /// `dgates` and `dc_prev` (see [`LstmBackwardStep`]).
    fn lstm_backward_step(&self, step: LstmBackwardStep<'_, Self::Buffer>) -> Result<()>;
    /// Masked softmax cross-entropy forward over contiguous `[rows, vocab]` logits, row
    /// `r` scored against target row `first_row + r` (`first_row + rows <= targets.rows()`,
    /// `targets.bound() <= vocab`; a chunk of a longer batch starts past row 0): per-row
    /// `loss` and log-sum-exp `lse` (contiguous, `rows` elements each).
    fn softmax_xent_forward(
        &self,
        logits: View<'_, Self::Buffer>,
        targets: &Self::Targets,
        first_row: usize,
        loss: ViewMut<'_, Self::Buffer>,
        lse: ViewMut<'_, Self::Buffer>,
    ) -> Result<()>;
    /// Softmax cross-entropy backward, in place over the logits (shapes as in the forward):
    /// `logits = (softmax - onehot) * scale * mask`.
    fn softmax_xent_backward(
        &self,
        logits: ViewMut<'_, Self::Buffer>,
        lse: View<'_, Self::Buffer>,
        targets: &Self::Targets,
        first_row: usize,
        scale: f32,
    ) -> Result<()>;
    /// [`Backend::softmax_xent_forward`], then [`Backend::softmax_xent_backward`] with
    /// `scale` (the logits become their gradient), in one pass over the logits where the
    /// backend has one (the CPU's); the gradient may differ from the two operations' by a
    /// few ulp.
    fn softmax_xent_forward_backward(
        &self,
        logits: ViewMut<'_, Self::Buffer>,
        targets: &Self::Targets,
        first_row: usize,
        loss: ViewMut<'_, Self::Buffer>,
        mut lse: ViewMut<'_, Self::Buffer>,
        scale: f32,
    ) -> Result<()> {
        self.softmax_xent_forward(logits.as_view(), targets, first_row, loss, lse.reborrow())?;
        self.softmax_xent_backward(logits, lse.as_view(), targets, first_row, scale)
    }
    /// Sum of a contiguous `src`, accumulated in f64.
    fn sum(&self, src: View<'_, Self::Buffer>) -> Result<f64>;
}

/// `InvalidView` for operand `name`.
fn invalid_view(name: &'static str, value: impl ToString, reason: impl Into<String>) -> Error {
    Error::InvalidView {
        name,
        value: value.to_string(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread::ThreadId;

    /// One call back: the range, the buffer's values then, and the thread it ran on.
    type Call = (Range<usize>, Vec<f32>, ThreadId);

    /// Runs a work that fills a buffer in three parts and calls back after each, on
    /// `executor`; returns the calls seen, the work's thread and its result.
    fn three_calls(executor: &Executor) -> (Vec<Call>, ThreadId, u32) {
        let mut seen = Vec::new();
        let mut worker = None;
        let worker_id = &mut worker;
        let result = executor.run_calling_back(
            move |call| {
                *worker_id = Some(std::thread::current().id());
                let mut buf = vec![0.0f32; 6];
                for part in 0..3 {
                    buf[2 * part] = part as f32 + 1.0;
                    buf[2 * part + 1] = -(part as f32) - 1.0;
                    call(2 * part..2 * part + 2, &buf);
                }
                7u32
            },
            &mut |range: Range<usize>, buf: &Vec<f32>| {
                seen.push((range, buf.clone(), std::thread::current().id()));
            },
        );
        (seen, worker.expect("the work ran"), result)
    }

    #[test]
    fn a_work_on_the_pool_calls_back_on_the_callers_thread_in_order() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let here = std::thread::current().id();
        for (executor, on_pool) in [
            (Executor::on(Arc::new(pool)), true),
            (Executor::default(), false),
        ] {
            let (seen, worker, result) = three_calls(&executor);
            assert_eq!(result, 7);
            assert_eq!(worker != here, on_pool, "where the work ran");
            let ranges: Vec<_> = seen.iter().map(|(r, _, _)| r.clone()).collect();
            assert_eq!(ranges, [0..2, 2..4, 4..6]);
            // Each call sees the buffer as it was when the work called: no later part.
            assert_eq!(seen[0].1, [1.0, -1.0, 0.0, 0.0, 0.0, 0.0]);
            assert_eq!(seen[2].1, [1.0, -1.0, 2.0, -2.0, 3.0, -3.0]);
            assert!(seen.iter().all(|(_, _, thread)| *thread == here));
        }
    }

    #[test]
    fn a_panic_in_a_work_on_the_pool_reaches_the_caller() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        let executor = Executor::on(Arc::new(pool));
        let mut calls = 0;
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            executor.run_calling_back(
                |call| {
                    call(0..1, &vec![1.0f32]);
                    panic!("the work failed");
                },
                &mut |_: Range<usize>, _: &Vec<f32>| calls += 1,
            )
        }));
        let message = caught.expect_err("the panic reaches the caller");
        assert_eq!(message.downcast_ref::<&str>(), Some(&"the work failed"));
        assert_eq!(calls, 1);
    }
}
