//! Token embeddings and the output projection with its softmax cross-entropy loss: the
//! parts the NMT model and the RNNLM share.

use std::ops::Range;

use crate::backend::{Backend, Gemm};
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
    pub(crate) fn new<B: Backend<Buffer = Buf>>(be: &B, rows: usize, width: usize) -> Result<Self> {
        Ok(EmbeddingWork {
            out: be.zeros(rows * width)?,
            dx: be.zeros(rows * width)?,
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

    /// `work.out[r] = table[ids[r]]`: 1 launch.
    pub(crate) fn forward<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        ids: &[u32],
        work: &mut EmbeddingWork<B::Buffer>,
    ) -> Result<()> {
        be.gather_rows(
            params,
            self.table.start,
            self.vocab,
            self.width,
            ids,
            &mut work.out,
            0,
        )
    }

    /// Table gradient from `work.dx`: zero it, add row `r` into row `ids[r]`; 2 launches.
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        grads: &mut B::Buffer,
        ids: &[u32],
        work: &EmbeddingWork<B::Buffer>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        be.fill(grads, self.table.start, self.table.len(), 0.0)?;
        be.scatter_add_rows(
            &work.dx,
            0,
            ids,
            self.width,
            grads,
            self.table.start,
            self.vocab,
        )?;
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
}

impl<Buf> ProjectionWork<Buf> {
    pub(crate) fn new<B: Backend<Buffer = Buf>>(be: &B, rows: usize, vocab: usize) -> Result<Self> {
        Ok(ProjectionWork {
            logits: be.zeros(rows * vocab)?,
            loss: be.zeros(rows)?,
            lse: be.zeros(rows)?,
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

    /// Logits for all `rows` at once, the loss rows and their sum: 3 launches.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        h: &B::Buffer,
        h_offset: usize,
        rows: usize,
        labels: &[u32],
        mask: &[f32],
        work: &mut ProjectionWork<B::Buffer>,
    ) -> Result<f64> {
        let spec = Gemm::nn(rows, self.vocab, self.hidden).at(h_offset, self.kernel.start, 0);
        be.gemm(h, params, &mut work.logits, &spec)?;
        be.softmax_xent_forward(
            &work.logits,
            labels,
            mask,
            &mut work.loss,
            &mut work.lse,
            rows,
            self.vocab,
        )?;
        be.sum(&work.loss, 0, rows)
    }

    /// Gradient of the summed loss: softmax backward in place, `dW = Hᵀ·dLogits` (then
    /// `on_ready`), `dH = dLogits·Wᵀ` into `dh`: 3 launches.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        h: &B::Buffer,
        h_offset: usize,
        rows: usize,
        labels: &[u32],
        mask: &[f32],
        work: &mut ProjectionWork<B::Buffer>,
        dh: GradTarget<'_, B::Buffer>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        be.softmax_xent_backward(
            &mut work.logits,
            &work.lse,
            labels,
            mask,
            1.0,
            rows,
            self.vocab,
        )?;
        let dw = Gemm::tn(self.hidden, self.vocab, rows).at(h_offset, 0, self.kernel.start);
        be.gemm(h, &work.logits, grads, &dw)?;
        on_ready(self.kernel.clone(), grads);
        let dx = Gemm::nt(rows, self.hidden, self.vocab)
            .at(0, self.kernel.start, dh.offset)
            .accumulate(dh.accumulate);
        be.gemm(&work.logits, params, dh.buf, &dx)
    }
}
