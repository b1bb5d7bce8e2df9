//! Token embeddings and the output projection with its softmax cross-entropy loss: the
//! parts the NMT model and the RNNLM share.

use std::ops::Range;

use crate::backend::{view, view_mut, Backend, Layout, Staged, View};
use crate::error::Result;
use crate::lstm::GradTarget;
use crate::params::{ParamInit, ParamLayout};

/// Registers a `[rows, cols]` tensor drawn uniformly from `[-init_scale, init_scale)`;
/// returns its elements in the flat buffers.
fn register_uniform(
    layout: &mut ParamLayout,
    name: &str,
    rows: usize,
    cols: usize,
    init_scale: f32,
) -> Result<Range<usize>> {
    let start = layout.push(
        name,
        &[rows, cols],
        ParamInit::Uniform { scale: init_scale },
    )?;
    Ok(start..start + rows * cols)
}

/// An embedding table `[vocab, width]` in the flat buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Embedding {
    pub(crate) table: Range<usize>,
    pub(crate) vocab: usize,
    pub(crate) width: usize,
}

/// Looked-up rows and their gradient, `[rows, width]` each.
pub(crate) struct EmbeddingWork<Buf> {
    pub(crate) out: Buf,
    pub(crate) dx: Buf,
}

impl<Buf> EmbeddingWork<Buf> {
    /// The f32 lengths of `out` and `dx` (f64, for memory estimates of any size).
    pub(crate) fn lens(rows: usize, width: usize) -> [f64; 2] {
        let n = rows as f64 * width as f64;
        [n, n]
    }

    pub(crate) fn new<B: Backend<Buffer = Buf>>(be: &B, rows: usize, width: usize) -> Result<Self> {
        let [out, dx] = Self::lens(rows, width).map(|n| n as usize);
        Ok(EmbeddingWork {
            out: be.zeros(out)?,
            dx: be.zeros(dx)?,
        })
    }
}

impl Embedding {
    pub(crate) fn register(
        layout: &mut ParamLayout,
        name: &str,
        vocab: usize,
        width: usize,
        init_scale: f32,
    ) -> Result<Self> {
        Ok(Embedding {
            table: register_uniform(layout, name, vocab, width, init_scale)?,
            vocab,
            width,
        })
    }

    /// The table in the parameter buffer, `[vocab, width]`.
    fn matrix(&self) -> Layout {
        Layout::matrix(self.table.start, self.vocab, self.width)
    }

    /// `work.out[r] = table[ids[r]]`: 1 launch.
    pub(crate) fn forward<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        ids: &B::Ids,
        work: &mut EmbeddingWork<B::Buffer>,
    ) -> Result<()> {
        let out = Layout::matrix(0, ids.rows(), self.width);
        be.gather_rows(
            view(params, self.matrix()),
            ids,
            view_mut(&mut work.out, out),
        )
    }

    /// Table gradient from `work.dx`: zero it, add row `r` into row `ids[r]`; 2 launches.
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        grads: &mut B::Buffer,
        ids: &B::Ids,
        work: &EmbeddingWork<B::Buffer>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        let table = self.matrix();
        let dx = Layout::matrix(0, ids.rows(), self.width);
        be.fill(view_mut(grads, table), 0.0)?;
        be.scatter_add_rows(view(&work.dx, dx), ids, view_mut(grads, table))?;
        on_ready(self.table.clone(), grads);
        Ok(())
    }
}

/// Output projection `hidden -> vocab` without bias (`kernel: [hidden, vocab]`), followed
/// by the summed masked softmax cross-entropy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Projection {
    pub(crate) kernel: Range<usize>,
    pub(crate) hidden: usize,
    pub(crate) vocab: usize,
}

/// Logits (gradient in place after backward), per-row loss and log-sum-exp.
pub(crate) struct ProjectionWork<Buf> {
    logits: Buf,
    loss: Buf,
    lse: Buf,
    /// The logits hold their gradient already (a forward that differentiated).
    holds_gradient: bool,
}

impl<Buf> ProjectionWork<Buf> {
    /// The f32 lengths of `logits`, `loss` and `lse` (f64, for memory estimates of any
    /// size).
    pub(crate) fn lens(rows: usize, vocab: usize) -> [f64; 3] {
        let r = rows as f64;
        [r * vocab as f64, r, r]
    }

    pub(crate) fn new<B: Backend<Buffer = Buf>>(be: &B, rows: usize, vocab: usize) -> Result<Self> {
        let [logits, loss, lse] = Self::lens(rows, vocab).map(|n| n as usize);
        Ok(ProjectionWork {
            logits: be.zeros(logits)?,
            loss: be.zeros(loss)?,
            lse: be.zeros(lse)?,
            holds_gradient: false,
        })
    }
}

impl Projection {
    pub(crate) fn register(
        layout: &mut ParamLayout,
        name: &str,
        hidden: usize,
        vocab: usize,
        init_scale: f32,
    ) -> Result<Self> {
        Ok(Projection {
            kernel: register_uniform(layout, name, hidden, vocab, init_scale)?,
            hidden,
            vocab,
        })
    }

    /// The projection kernel in the parameter buffer, `[hidden, vocab]`.
    fn matrix(&self) -> Layout {
        Layout::matrix(self.kernel.start, self.hidden, self.vocab)
    }

    /// Logits of `h` (`[rows, hidden]`, one row per target), the loss rows and their sum:
    /// 3 launches. With `differentiate` (a backward follows), the loss's gradient
    /// replaces the logits in the same pass over them, and backward starts from it.
    pub(crate) fn forward<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        h: View<'_, B::Buffer>,
        targets: &B::Targets,
        work: &mut ProjectionWork<B::Buffer>,
        differentiate: bool,
    ) -> Result<f64> {
        let rows = targets.rows();
        let (logits, per_row) = (
            Layout::matrix(0, rows, self.vocab),
            Layout::contiguous(0, rows),
        );
        work.holds_gradient = false;
        be.gemm(
            h,
            view(params, self.matrix()),
            view_mut(&mut work.logits, logits),
            false,
        )?;
        let (loss, lse) = (
            view_mut(&mut work.loss, per_row),
            view_mut(&mut work.lse, per_row),
        );
        if differentiate {
            let logits = view_mut(&mut work.logits, logits);
            be.softmax_xent_forward_backward(logits, targets, loss, lse, Self::LOSS_SCALE)?;
            work.holds_gradient = true;
        } else {
            be.softmax_xent_forward(view(&work.logits, logits), targets, loss, lse)?;
        }
        be.sum(view(&work.loss, per_row))
    }

    /// The scale of the softmax gradient: that of the summed loss.
    const LOSS_SCALE: f32 = 1.0;

    /// Gradient of the summed loss: softmax backward in place, `dW = Hᵀ·dLogits` (then
    /// `on_ready`), `dH = dLogits·Wᵀ` into `dh`: 3 launches.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        h: View<'_, B::Buffer>,
        targets: &B::Targets,
        work: &mut ProjectionWork<B::Buffer>,
        dh: GradTarget<'_, B::Buffer>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        let rows = targets.rows();
        let logits = Layout::matrix(0, rows, self.vocab);
        if !std::mem::take(&mut work.holds_gradient) {
            be.softmax_xent_backward(
                view_mut(&mut work.logits, logits),
                view(&work.lse, Layout::contiguous(0, rows)),
                targets,
                Self::LOSS_SCALE,
            )?;
        }
        be.gemm(
            h.t(),
            view(&work.logits, logits),
            view_mut(grads, self.matrix()),
            false,
        )?;
        on_ready(self.kernel.clone(), grads);
        be.gemm(
            view(&work.logits, logits),
            view(params, self.matrix()).t(),
            view_mut(dh.buf, Layout::matrix(dh.offset, rows, self.hidden)),
            dh.accumulate,
        )
    }
}
