//! Token embeddings and the output projection with its softmax cross-entropy loss: the
//! parts the NMT model and the RNNLM share.

use std::ops::Range;

use crate::backend::{view, view_mut, Backend, Layout, Staged, View};
use crate::error::{Error, Result};
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

/// The most logits the output projection holds at once. Its rows are computed, scored
/// and differentiated in chunks of at most this many elements (and at least one row), so
/// the logits of a large batch never exist whole: 2^28 f32 values are 1 GiB, 5,368 rows
/// at the seeds' vocabulary of 50,000, and a chunk stays far inside the GPU kernels'
/// 32-bit indexing at any batch.
pub const LOGITS_CHUNK_ELEMENTS: usize = 1 << 28;

/// Rows of one chunk of logits (see [`LOGITS_CHUNK_ELEMENTS`]) for `rows` rows of `vocab`
/// columns: at least one.
pub(crate) fn logits_chunk_rows(rows: usize, vocab: usize) -> usize {
    (LOGITS_CHUNK_ELEMENTS / vocab.max(1)).clamp(1, rows.max(1))
}

/// One chunk of logits (each chunk's gradient in a forward that differentiates), per-row
/// loss and log-sum-exp, and the projection kernel's gradient.
pub(crate) struct ProjectionWork<Buf> {
    /// `[chunk_rows, vocab]`.
    logits: Buf,
    chunk_rows: usize,
    loss: Buf,
    lse: Buf,
    /// `[hidden, vocab]`: summed over the chunks by a forward that differentiates, handed
    /// to the gradients by backward.
    kernel_grad: Buf,
    /// `kernel_grad` holds the last forward's gradient.
    holds_gradient: bool,
}

impl<Buf> ProjectionWork<Buf> {
    /// The f32 lengths of `logits`, `loss`, `lse` and `kernel_grad` for `rows` rows (f64,
    /// for memory estimates of any size).
    pub(crate) fn lens(rows: usize, hidden: usize, vocab: usize) -> [f64; 4] {
        Self::lens_in_chunks(rows, hidden, vocab, logits_chunk_rows(rows, vocab))
    }

    fn lens_in_chunks(rows: usize, hidden: usize, vocab: usize, chunk_rows: usize) -> [f64; 4] {
        let (r, v) = (rows as f64, vocab as f64);
        [chunk_rows as f64 * v, r, r, hidden as f64 * v]
    }

    pub(crate) fn new<B: Backend<Buffer = Buf>>(
        be: &B,
        rows: usize,
        hidden: usize,
        vocab: usize,
    ) -> Result<Self> {
        Self::in_chunks(be, rows, hidden, vocab, logits_chunk_rows(rows, vocab))
    }

    /// A workspace whose chunks have `chunk_rows` rows (at least one).
    fn in_chunks<B: Backend<Buffer = Buf>>(
        be: &B,
        rows: usize,
        hidden: usize,
        vocab: usize,
        chunk_rows: usize,
    ) -> Result<Self> {
        let chunk_rows = chunk_rows.max(1);
        let [logits, loss, lse, kernel_grad] =
            Self::lens_in_chunks(rows, hidden, vocab, chunk_rows).map(|n| n as usize);
        Ok(ProjectionWork {
            logits: be.zeros(logits)?,
            chunk_rows,
            loss: be.zeros(loss)?,
            lse: be.zeros(lse)?,
            kernel_grad: be.zeros(kernel_grad)?,
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

    /// The loss of `h` (`[rows, hidden]`, one row per target) against `targets`: the
    /// summed loss rows. The logits are computed and scored a chunk of rows at a time
    /// (see [`LOGITS_CHUNK_ELEMENTS`]): 3 launches per chunk. With `dh` (a backward
    /// follows), each chunk is also differentiated while it is held: its logits become
    /// their gradient in the same pass, `dW += Hᵀ·dLogits` into the workspace and
    /// `dH = dLogits·Wᵀ` into `dh`'s rows of the chunk (2 more launches), so that
    /// backward only hands `dW` on.
    pub(crate) fn forward<B: Backend>(
        &self,
        be: &B,
        params: &B::Buffer,
        h: View<'_, B::Buffer>,
        targets: &B::Targets,
        work: &mut ProjectionWork<B::Buffer>,
        mut dh: Option<GradTarget<'_, B::Buffer>>,
    ) -> Result<f64> {
        let rows = targets.rows();
        let kernel = view(params, self.matrix());
        work.holds_gradient = false;
        // One chunk even without rows, so that a gradient of no rows is zeros.
        for chunk in 0..rows.div_ceil(work.chunk_rows).max(1) {
            let start = chunk * work.chunk_rows;
            let n = work.chunk_rows.min(rows - start);
            let h = View {
                buf: h.buf,
                layout: h.layout.narrow_rows(start, n),
            };
            let logits = Layout::matrix(0, n, self.vocab);
            let per_row = Layout::contiguous(start, n);
            let (loss, lse) = (
                view_mut(&mut work.loss, per_row),
                view_mut(&mut work.lse, per_row),
            );
            be.gemm(h, kernel, view_mut(&mut work.logits, logits), false)?;
            let Some(dh) = dh.as_mut() else {
                be.softmax_xent_forward(view(&work.logits, logits), targets, start, loss, lse)?;
                continue;
            };
            let dlogits = view_mut(&mut work.logits, logits);
            be.softmax_xent_forward_backward(dlogits, targets, start, loss, lse, Self::LOSS_SCALE)?;
            be.gemm(
                h.t(),
                view(&work.logits, logits),
                view_mut(&mut work.kernel_grad, self.grad_matrix()),
                chunk > 0,
            )?;
            be.gemm(
                view(&work.logits, logits),
                kernel.t(),
                view_mut(
                    dh.buf,
                    Layout::matrix(dh.offset + start * self.hidden, n, self.hidden),
                ),
                dh.accumulate,
            )?;
        }
        work.holds_gradient = dh.is_some();
        be.sum(view(&work.loss, Layout::contiguous(0, rows)))
    }

    /// The scale of the softmax gradient: that of the summed loss.
    const LOSS_SCALE: f32 = 1.0;

    /// The kernel's gradient in the workspace, `[hidden, vocab]`.
    fn grad_matrix(&self) -> Layout {
        Layout::matrix(0, self.hidden, self.vocab)
    }

    /// Hands on the gradient of the summed loss w.r.t. the kernel that the last
    /// [`Self::forward`] (which got a `dh`, and so also left the gradient w.r.t. `h`)
    /// computed: copies it into `grads`, then calls `on_ready`: 1 launch.
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        grads: &mut B::Buffer,
        work: &mut ProjectionWork<B::Buffer>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        if !std::mem::take(&mut work.holds_gradient) {
            return Err(Error::InvalidView {
                name: "projection gradient",
                value: "not computed".into(),
                reason: "the forward pass before a backward pass must differentiate".into(),
            });
        }
        let len = self.kernel.len();
        be.copy(
            view(&work.kernel_grad, Layout::contiguous(0, len)),
            view_mut(grads, Layout::contiguous(self.kernel.start, len)),
        )?;
        on_ready(self.kernel.clone(), grads);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CheckedTargets;
    use crate::{CpuBackend, GemmPrecision};

    /// Loss, kernel gradient and `dh` of the last of `batches` (rows per batch, trained in
    /// turn on one workspace sized for the largest) in chunks of `chunk_rows`, with the
    /// matrix products in `precision`.
    fn projection_in_chunks(
        batches: &[usize],
        chunk_rows: usize,
        precision: GemmPrecision,
    ) -> (f64, Vec<f32>, Vec<f32>) {
        let (hidden, vocab) = (5, 7);
        let Ok(be) = CpuBackend::with_precision(1, precision) else {
            panic!("no CPU backend");
        };
        let mut layout = ParamLayout::new();
        let Ok(proj) = Projection::register(&mut layout, "proj", hidden, vocab, 0.5) else {
            panic!("no projection");
        };
        // Deterministic values of both signs and several magnitudes.
        let value =
            |i: usize, salt: usize| ((i * 7919 + salt * 104_729) % 2001) as f32 / 1000.0 - 1.0;
        let params: Vec<f32> = (0..layout.total_len()).map(|i| value(i, 1)).collect();
        let capacity = batches.iter().copied().max().unwrap_or(0);
        let Ok(mut work) = ProjectionWork::in_chunks(&be, capacity, hidden, vocab, chunk_rows)
        else {
            panic!("no workspace");
        };
        let mut last = (0.0, Vec::new(), Vec::new());
        for &rows in batches {
            let h: Vec<f32> = (0..rows * hidden).map(|i| 2.0 * value(i, 2)).collect();
            let labels: Vec<u32> = (0..rows).map(|r| ((r * 3) % vocab) as u32).collect();
            let mask: Vec<f32> = (0..rows)
                .map(|r| if r % 4 == 2 { 0.0 } else { 1.0 })
                .collect();
            let Ok(checked) = CheckedTargets::new("labels", &labels, &mask, vocab) else {
                panic!("bad targets");
            };
            let Ok(targets) = be.stage_targets(checked) else {
                panic!("targets not staged");
            };
            // `dh` starts with garbage that a gradient must overwrite.
            let mut dh = vec![9.0f32; rows * hidden];
            let mut grads = vec![0.0f32; layout.total_len()];
            let loss = proj.forward(
                &be,
                &params,
                view(&h, Layout::matrix(0, rows, hidden)),
                &targets,
                &mut work,
                Some(GradTarget {
                    buf: &mut dh,
                    offset: 0,
                    accumulate: false,
                }),
            );
            let Ok(loss) = loss else {
                panic!("forward failed: {loss:?}");
            };
            let mut ready = Vec::new();
            let backward = proj.backward(&be, &mut grads, &mut work, &mut |r, _| ready.push(r));
            assert!(backward.is_ok(), "{backward:?}");
            assert_eq!(
                ready,
                std::slice::from_ref(&proj.kernel),
                "the kernel's gradient is handed on once"
            );
            last = (loss, grads, dh);
        }
        last
    }

    fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(1e-3))
            .fold(0.0, f32::max)
    }

    #[test]
    fn chunks_of_rows_give_what_one_chunk_gives() {
        let rows = 11;
        for precision in [GemmPrecision::F32, GemmPrecision::Bf16] {
            let (loss, grads, dh) = projection_in_chunks(&[rows], rows, precision);
            assert!(loss > 0.0 && grads.iter().any(|&g| g != 0.0));
            assert!(dh.iter().all(|&d| d != 9.0), "every row of dh written");
            // 1-row chunks, chunks that divide the rows and chunks that do not.
            for chunk_rows in [1, 2, 3, 4, 10, 64] {
                let (l, g, d) = projection_in_chunks(&[rows], chunk_rows, precision);
                let what = format!("{precision:?} in chunks of {chunk_rows}");
                assert!(
                    ((l - loss) / loss).abs() < 1e-6,
                    "{what}: loss {l} vs {loss}"
                );
                assert!(max_rel_diff(&g, &grads) < 1e-5, "{what}: dW");
                assert!(max_rel_diff(&d, &dh) < 1e-6, "{what}: dh");
            }
        }
    }

    #[test]
    fn no_rows_give_a_zero_gradient_and_backward_needs_a_differentiating_forward() {
        // After a batch of 11 rows, on the same workspace: nothing of its gradient stays.
        let (loss, grads, dh) = projection_in_chunks(&[11, 0], 3, GemmPrecision::F32);
        assert_eq!(loss, 0.0);
        assert!(grads.iter().all(|&g| g == 0.0) && dh.is_empty());

        let Ok(be) = CpuBackend::new(1) else {
            panic!("no CPU backend");
        };
        let mut layout = ParamLayout::new();
        let Ok(proj) = Projection::register(&mut layout, "proj", 2, 3, 0.5) else {
            panic!("no projection");
        };
        let Ok(mut work) = ProjectionWork::new(&be, 4, 2, 3) else {
            panic!("no workspace");
        };
        let mut grads = vec![0.0f32; layout.total_len()];
        let err = proj.backward(&be, &mut grads, &mut work, &mut |_, _| {});
        assert!(
            matches!(
                err,
                Err(Error::InvalidView {
                    name: "projection gradient",
                    ..
                })
            ),
            "{err:?}"
        );
    }

    #[test]
    fn chunks_hold_at_most_the_chunk_budget_and_at_least_one_row() {
        assert_eq!(logits_chunk_rows(10, 7), 10);
        assert_eq!(logits_chunk_rows(0, 7), 1);
        assert_eq!(
            logits_chunk_rows(1 << 30, 50_000),
            LOGITS_CHUNK_ELEMENTS / 50_000
        );
        assert_eq!(logits_chunk_rows(5, LOGITS_CHUNK_ELEMENTS * 2), 1);
        assert!(logits_chunk_rows(1 << 30, 50_000) * 50_000 <= LOGITS_CHUNK_ELEMENTS);
    }
}
