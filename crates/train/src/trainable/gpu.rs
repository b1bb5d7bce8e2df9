//! [`GpuTrainable`]: a model of the model crate on the CUDA backend.
//!
//! The trainer works on host slices, the model on device buffers, so the adapter keeps
//! host mirrors of the flat parameter and gradient buffers in page-locked memory
//! ([`PinnedBuffer`]):
//!
//! * **Gradients, device → host, overlapping backward.** When the model reports a
//!   gradient range final, [`PinnedCopies`] queues its copy into the pinned gradient
//!   mirror on the GPU's copy stream (ordered after the backward kernels queued so far by
//!   an event) and returns at once, so the host goes on queueing the rest of backward.
//!   Ranges whose copies have landed are handed to the trainer in the order backward
//!   finished them, checked after each new range and then, after the last one, waited
//!   for one by one: the trainer's communication thread reduces the first ranges while
//!   the GPU still computes and copies the later ones.
//! * **Parameters, host → device.** After the optimizer (or a broadcast, or a checkpoint
//!   restore) has changed the host parameters, the next pass queues one copy from the
//!   pinned parameter mirror on the compute stream, ahead of the forward kernels.
//!
//! Every copy has finished when [`TrainableModel::forward_backward`] returns, also after
//! an error, so the trainer always sees settled mirrors; were one ever not settled, the
//! mirrors' accessors return [`Error::Internal`].

use std::collections::VecDeque;
use std::ops::Range;

use ringtrain_cuda::PinnedBuffer;
use ringtrain_model::{Backend, CudaBackend, Model};

use super::pass::{run_forward, run_pass, Delivery};
use super::staging::TrainsOnBatch;
use super::{param_specs, Batch, ParamSpec, PassOutput, ReadyCallback, TrainableModel};
use crate::error::{Error, Result};

/// A model on the CUDA backend with pinned host mirrors of its parameters and gradients.
pub struct GpuTrainable<M> {
    model: M,
    specs: Vec<ParamSpec>,
    description: String,
    params_host: PinnedBuffer<f32>,
    grads: PinnedCopies,
    /// The host parameters changed since they were last copied to the device.
    params_dirty: bool,
}

/// The CUDA backend's buffer type.
type GpuBuffer = <CudaBackend as Backend>::Buffer;

/// A GPU runtime error as the trainer's error.
fn gpu_err(e: ringtrain_cuda::Error) -> Error {
    ringtrain_model::Error::from(e).into()
}

/// A pinned mirror that an in-flight copy makes unreadable: a bug of this adapter.
fn unsettled(mirror: &str) -> Error {
    Error::Internal(format!(
        "the pinned {mirror} mirror was read while a copy into it was in flight"
    ))
}

/// The pinned gradient mirror, and the ranges queued into it not yet handed over.
struct PinnedCopies {
    host: PinnedBuffer<f32>,
    pending: VecDeque<Range<usize>>,
}

impl PinnedCopies {
    /// Hands the landed ranges at the front of `pending` to `on_ready`, in order; with
    /// `block`, waits for each in turn until none is left.
    fn hand_over(&mut self, on_ready: &mut ReadyCallback<'_>, block: bool) -> Result<()> {
        while let Some(front) = self.pending.front().cloned() {
            if !block && !self.host.is_ready(front.clone()).map_err(gpu_err)? {
                break;
            }
            self.pending.pop_front();
            let grads = self.host.wait(front.clone()).map_err(gpu_err)?;
            on_ready(front, grads)?;
        }
        Ok(())
    }
}

impl Delivery<GpuBuffer> for PinnedCopies {
    fn finished(
        &mut self,
        range: Range<usize>,
        grads: &GpuBuffer,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<()> {
        let view = grads.slice(range.clone()).map_err(gpu_err)?;
        self.host
            .download_async(range.clone(), &view)
            .map_err(gpu_err)?;
        self.pending.push_back(range);
        self.hand_over(on_ready, false)
    }

    fn drain(&mut self, on_ready: &mut ReadyCallback<'_>) -> Result<()> {
        self.hand_over(on_ready, true)
    }
}

impl<M: Model<Backend = CudaBackend>> GpuTrainable<M> {
    /// Wraps `model`, reading its initial parameters into the host mirror.
    ///
    /// # Errors
    /// GPU errors of the allocation or the copy.
    pub fn new(model: M, description: String) -> Result<Self> {
        let specs = param_specs(model.layout());
        let total = model.layout().total_len();
        let gpu = model.backend().gpu().clone();
        let mut params_host = gpu.pinned::<f32>(total).map_err(gpu_err)?;
        let grads_host = gpu.pinned::<f32>(total).map_err(gpu_err)?;
        model.backend().download(
            model.params(),
            0,
            params_host.as_mut_slice().map_err(gpu_err)?,
        )?;
        Ok(GpuTrainable {
            model,
            specs,
            description,
            params_host,
            grads: PinnedCopies {
                host: grads_host,
                pending: VecDeque::new(),
            },
            params_dirty: false,
        })
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.model
    }
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> GpuTrainable<M> {
    /// Queues the copy of the host parameters to the device when they changed since
    /// the last one (ahead of the next kernels on the compute stream).
    fn upload_params(&mut self) -> Result<()> {
        if self.params_dirty {
            let n = self.params_host.len();
            self.params_host
                .upload_async(0..n, self.model.params_mut())
                .map_err(gpu_err)?;
            self.params_dirty = false;
        }
        Ok(())
    }

    /// One pass; copies may still be in flight when it returns early with an error.
    fn pass(&mut self, batch: &Batch, on_ready: &mut ReadyCallback<'_>) -> Result<PassOutput> {
        self.upload_params()?;
        self.grads.pending.clear();
        let model = &mut self.model;
        run_pass(
            |ready| model.train_on(batch, ready),
            &mut self.grads,
            on_ready,
        )
    }
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> TrainableModel for GpuTrainable<M> {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    fn params(&self) -> Result<&[f32]> {
        self.params_host
            .settled()
            .ok_or_else(|| unsettled("parameter"))
    }
    fn params_mut(&mut self) -> Result<&mut [f32]> {
        self.params_dirty = true;
        self.params_host
            .settled_mut()
            .ok_or_else(|| unsettled("parameter"))
    }
    fn params_and_grads_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        self.params_dirty = true;
        Ok((
            self.params_host
                .settled_mut()
                .ok_or_else(|| unsettled("parameter"))?,
            self.grads
                .host
                .settled_mut()
                .ok_or_else(|| unsettled("gradient"))?,
        ))
    }
    /// One pass: each final gradient range goes device → pinned host on the copy stream,
    /// then to `on_ready` (see the module docs).
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        let result = self.pass(batch, on_ready);
        // No copy may outlive the pass: the trainer reads and writes both mirrors next.
        let settled = self
            .grads
            .host
            .wait_all()
            .and_then(|()| self.params_host.wait_all())
            .map_err(gpu_err);
        let output = result?;
        settled?;
        Ok(output)
    }
    /// Forward only, after the parameter copy a change of the host parameters needs;
    /// the loss comes back to the host with the forward kernels.
    fn evaluate(&mut self, batches: &[Batch]) -> Result<PassOutput> {
        let uploaded = self.upload_params();
        let result = uploaded.and_then(|()| {
            let model = &mut self.model;
            run_forward(|| model.held_out_loss(batches))
        });
        // The parameter copy must have landed before the trainer writes the mirror again.
        let settled = self.params_host.wait_all().map_err(gpu_err);
        let output = result?;
        settled?;
        Ok(output)
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}
