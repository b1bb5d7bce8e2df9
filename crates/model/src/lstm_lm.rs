//! An LSTM language-model network: token embedding, stacked unidirectional LSTM layers
//! and the output projection with the summed masked softmax cross-entropy. The RNNLM is
//! one; the NMT decoder is one whose layers start from the encoder's final states.

use std::ops::Range;

use crate::backend::{view, view_mut, Backend, Layout};
use crate::embedding::{Embedding, EmbeddingWork, Projection, ProjectionWork};
use crate::error::Result;
use crate::lstm::{GradTarget, InitState, LayerInput, LstmImpl, LstmLayer, LstmWork};
use crate::params::ParamLayout;

/// Where the network's tensors live in the flat buffers.
pub(crate) struct LstmLm {
    pub(crate) proj: Projection,
    /// Bottom layer first.
    pub(crate) layers: Vec<LstmLayer>,
    pub(crate) emb: Embedding,
}

/// Workspaces of an [`LstmLm`] for a (steps, batch) capacity.
pub(crate) struct LstmLmWork<Buf> {
    pub(crate) emb: EmbeddingWork<Buf>,
    /// Bottom layer first.
    pub(crate) layers: Vec<LstmWork<Buf>>,
    pub(crate) head: ProjectionWork<Buf>,
}

/// Sizes of an [`LstmLm`].
pub(crate) struct LstmLmShape {
    /// Embedding rows and projection width.
    pub(crate) vocab: usize,
    /// Embedding width.
    pub(crate) emb: usize,
    /// LSTM hidden units.
    pub(crate) hidden: usize,
    /// LSTM layers.
    pub(crate) layers: usize,
    /// Half-width of the uniform initialisation.
    pub(crate) init_scale: f32,
    /// Initial value of the LSTM forget-gate bias.
    pub(crate) forget_bias: f32,
}

impl LstmLm {
    /// Registers the tensors in backward order: `proj/kernel`, `{prefix}/layer_{L-1}/...`
    /// down to `{prefix}/layer_0/...`, then the embedding `embedding`.
    pub(crate) fn register(
        layout: &mut ParamLayout,
        prefix: &str,
        embedding: &str,
        s: &LstmLmShape,
    ) -> Result<Self> {
        let proj = Projection::register(layout, "proj/kernel", s.hidden, s.vocab, s.init_scale)?;
        let mut layers = Vec::with_capacity(s.layers);
        for l in (0..s.layers).rev() {
            let input = if l == 0 { s.emb } else { s.hidden };
            layers.push(LstmLayer::register(
                layout,
                &format!("{prefix}/layer_{l}"),
                input,
                s.hidden,
                false,
                s.init_scale,
                s.forget_bias,
            )?);
        }
        layers.reverse();
        let emb = Embedding::register(layout, embedding, s.vocab, s.emb, s.init_scale)?;
        Ok(LstmLm { proj, layers, emb })
    }

    /// The top layer's output in its `hiddens`, `[steps * batch, hidden]`.
    fn top_output(&self, steps: usize, batch: usize) -> Layout {
        let top = &self.layers[self.layers.len() - 1];
        Layout::matrix(top.output_offset(batch), steps * batch, top.hidden)
    }

    /// Workspaces for `steps` x `batch`.
    pub(crate) fn work<B: Backend>(
        &self,
        be: &B,
        steps: usize,
        batch: usize,
    ) -> Result<LstmLmWork<B::Buffer>> {
        Ok(LstmLmWork {
            emb: EmbeddingWork::new(be, steps * batch, self.emb.width)?,
            layers: self
                .layers
                .iter()
                .map(|layer| LstmWork::new(be, layer.hidden, steps, batch))
                .collect::<Result<_>>()?,
            head: ProjectionWork::new(be, steps * batch, self.proj.hidden, self.proj.vocab)?,
        })
    }

    /// The network's pipeline units in forward order: 0 the embedding, `1..=L` the
    /// layers, `L + 1` the projection with the loss.
    pub(crate) fn unit_count(&self) -> usize {
        self.layers.len() + 2
    }

    /// Where the output of unit `u` (not the projection) lies: buffer, offset, length.
    pub(crate) fn unit_output<'w, Buf>(
        &self,
        w: &'w LstmLmWork<Buf>,
        u: usize,
        steps: usize,
        batch: usize,
    ) -> (&'w Buf, usize, usize) {
        let (offset, len) = self.unit_output_span(u, steps, batch);
        let buf = if u == 0 {
            &w.emb.out
        } else {
            &w.layers[u - 1].hiddens
        };
        (buf, offset, len)
    }

    /// Offset and length of unit `u`'s output in its buffer (see [`Self::unit_output`]).
    fn unit_output_span(&self, u: usize, steps: usize, batch: usize) -> (usize, usize) {
        if u == 0 {
            (0, steps * batch * self.emb.width)
        } else {
            let layer = &self.layers[u - 1];
            (layer.output_offset(batch), steps * batch * layer.hidden)
        }
    }

    /// [`Self::unit_output`], to write into.
    pub(crate) fn unit_output_mut<'w, Buf>(
        &self,
        w: &'w mut LstmLmWork<Buf>,
        u: usize,
        steps: usize,
        batch: usize,
    ) -> (&'w mut Buf, usize, usize) {
        let (offset, len) = self.unit_output_span(u, steps, batch);
        let buf = if u == 0 {
            &mut w.emb.out
        } else {
            &mut w.layers[u - 1].hiddens
        };
        (buf, offset, len)
    }

    /// Where the gradient w.r.t. the output of unit `u` (not the projection) lies.
    pub(crate) fn unit_output_grad<'w, Buf>(
        &self,
        w: &'w mut LstmLmWork<Buf>,
        u: usize,
        steps: usize,
        batch: usize,
    ) -> (&'w mut Buf, usize, usize) {
        if u == 0 {
            (&mut w.emb.dx, 0, steps * batch * self.emb.width)
        } else {
            let hidden = self.layers[u - 1].hidden;
            (&mut w.layers[u - 1].dh, 0, steps * batch * hidden)
        }
    }

    /// Forward over `steps` x `batch` tokens (time-major) through the units `units`
    /// (see [`Self::unit_count`]): embeds `inputs`, runs the layers bottom up (layer `l`
    /// starting from `init(l)`, zeros when `None`) and, with the projection, returns the
    /// summed loss of its logits against `targets`. The first unit reads the output of
    /// the unit before it where that unit left it in `w` (a pipeline stage puts its
    /// neighbour's activations there). With `differentiate` (a backward follows), the
    /// projection also finds its gradients, chunk by chunk while it holds the logits
    /// (see [`Projection::forward`]): w.r.t. its kernel in its workspace, and w.r.t. the
    /// top layer's output in that layer's `dh`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward_units<'a, B: Backend>(
        &self,
        be: &B,
        imp: LstmImpl,
        params: &B::Buffer,
        inputs: &B::Ids,
        targets: &B::Targets,
        steps: usize,
        batch: usize,
        w: &mut LstmLmWork<B::Buffer>,
        init: impl Fn(usize) -> Option<InitState<'a, B::Buffer>>,
        units: Range<usize>,
        differentiate: bool,
    ) -> Result<Option<f64>>
    where
        B::Buffer: 'a,
    {
        if units.contains(&0) {
            self.emb.forward(be, params, inputs, &mut w.emb)?;
        }
        for (l, layer) in self.layers.iter().enumerate() {
            if !units.contains(&(l + 1)) {
                continue;
            }
            let (below, rest) = w.layers.split_at_mut(l);
            let x = if l == 0 {
                LayerInput {
                    buf: &w.emb.out,
                    offset: 0,
                    width: self.emb.width,
                }
            } else {
                LayerInput {
                    buf: &below[l - 1].hiddens,
                    offset: self.layers[l - 1].output_offset(batch),
                    width: self.layers[l - 1].hidden,
                }
            };
            layer.forward(
                be,
                imp,
                params,
                &[x],
                init(l),
                None,
                &mut rest[0],
                steps,
                batch,
            )?;
        }
        if !units.contains(&(self.layers.len() + 1)) {
            return Ok(None);
        }
        let h = self.top_output(steps, batch);
        let LstmWork { hiddens, dh, .. } = &mut w.layers[self.layers.len() - 1];
        let dh = differentiate.then_some(GradTarget {
            buf: dh,
            offset: 0,
            accumulate: false,
        });
        self.proj
            .forward(be, params, view(hiddens, h), targets, &mut w.head, dh)
            .map(Some)
    }

    /// Gradients of the summed loss of the last [`Self::forward_units`] over all units of the same
    /// batch: the projection, the layers top down (none gets a gradient w.r.t. its final
    /// cell state; each keeps its `dh0` in its work when `need_dh0`, and leaves the
    /// gradient w.r.t. its initial cell state in `dc`), then the embedding. `on_ready` is
    /// called once per tensor, in buffer order.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward<B: Backend>(
        &self,
        be: &B,
        imp: LstmImpl,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        inputs: &B::Ids,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        w: &mut LstmLmWork<B::Buffer>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
    ) -> Result<()> {
        let all = 0..self.unit_count();
        self.backward_units(
            be, imp, params, grads, inputs, steps, batch, need_dh0, w, on_ready, all,
        )
    }

    /// [`Self::backward`] over the units `units` only: when they end below the
    /// projection, the gradient w.r.t. the last unit's output must already be in `w`
    /// where [`Self::unit_output_grad`] says (a pipeline stage puts its neighbour's
    /// there); the gradient w.r.t. the first unit's input is left where
    /// `unit_output_grad` of the unit before says. Writes only the units' gradients.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_units<B: Backend>(
        &self,
        be: &B,
        imp: LstmImpl,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        inputs: &B::Ids,
        steps: usize,
        batch: usize,
        need_dh0: bool,
        w: &mut LstmLmWork<B::Buffer>,
        on_ready: &mut dyn FnMut(Range<usize>, &B::Buffer),
        units: Range<usize>,
    ) -> Result<()> {
        if units.contains(&(self.layers.len() + 1)) {
            // The forward that differentiated left the gradient w.r.t. the top layer's
            // output in its `dh`.
            self.proj.backward(be, grads, &mut w.head, on_ready)?;
        }
        for (l, layer) in self.layers.iter().enumerate().rev() {
            if !units.contains(&(l + 1)) {
                continue;
            }
            let (below, rest) = w.layers.split_at_mut(l);
            let lw = &mut rest[0];
            let dc = Layout::contiguous(0, batch * layer.hidden);
            be.fill(view_mut(&mut lw.dc, dc), 0.0)?;
            let (x, x_offset, width, dx) = if l == 0 {
                (&w.emb.out, 0, self.emb.width, &mut w.emb.dx)
            } else {
                let LstmWork { hiddens, dh, .. } = &mut below[l - 1];
                let lower = &self.layers[l - 1];
                (&*hiddens, lower.output_offset(batch), lower.hidden, dh)
            };
            let x = LayerInput {
                buf: x,
                offset: x_offset,
                width,
            };
            let dx = GradTarget {
                buf: dx,
                offset: 0,
                accumulate: false,
            };
            layer.backward(
                be,
                imp,
                params,
                grads,
                &[x],
                None,
                lw,
                steps,
                batch,
                need_dh0,
                &mut [dx],
                on_ready,
            )?;
        }
        if units.contains(&0) {
            self.emb.backward(be, grads, inputs, &w.emb, on_ready)?;
        }
        Ok(())
    }
}
