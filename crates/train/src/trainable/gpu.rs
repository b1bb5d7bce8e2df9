//! Binds the model crate's NMT and RNNLM models on the CUDA backend to [`TrainableModel`].
//!
//! The trainer works on host slices, the model on device buffers, so the adapter keeps
//! host mirrors of the flat parameter and gradient buffers in page-locked memory
//! ([`PinnedBuffer`]):
//!
//! * **Gradients, device → host, overlapping backward.** When the model reports a
//!   gradient range final, the adapter queues its copy into the pinned gradient mirror on
//!   the GPU's copy stream (ordered after the backward kernels queued so far by an event)
//!   and returns at once, so the host goes on queueing the rest of backward. Ranges whose
//!   copies have landed are handed to the trainer's callback in the order backward
//!   finished them, checked after each new range and then, after the last one, waited for
//!   one by one: the trainer's communication thread reduces the first ranges while the GPU
//!   still computes and copies the later ones.
//! * **Parameters, host → device.** After the optimizer (or a broadcast, or a checkpoint
//!   restore) has changed the host parameters, the next pass queues one copy from the
//!   pinned parameter mirror on the compute stream, ahead of the forward kernels.
//!
//! Every copy has finished when [`TrainableModel::forward_backward`] returns, also after
//! an error, so the trainer always sees settled mirrors.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Instant;

use ringtrain_cuda::PinnedBuffer;
use ringtrain_model::{Backend, CudaBackend, Model};

use crate::error::{Error, Result};
use crate::model_adapter::{param_specs, pass_output, TimeMajorBatch, TrainsOnBatch};
use crate::trainable::{Batch, ParamSpec, PassOutput, ReadyCallback, TrainableModel};

/// A model on the CUDA backend with pinned host mirrors of its parameters and gradients.
pub struct GpuModelAdapter<M> {
    model: M,
    specs: Vec<ParamSpec>,
    description: String,
    staged: TimeMajorBatch,
    params_host: PinnedBuffer<f32>,
    grads_host: PinnedBuffer<f32>,
    /// The host parameters changed since they were last copied to the device.
    params_dirty: bool,
}

/// The CUDA backend's buffer type.
type GpuBuffer = <CudaBackend as Backend>::Buffer;

/// A GPU runtime error as the trainer's error.
fn gpu_err(e: ringtrain_cuda::Error) -> Error {
    ringtrain_model::Error::from(e).into()
}

impl<M: Model<Backend = CudaBackend>> GpuModelAdapter<M> {
    /// Wraps `model`, reading its initial parameters into the host mirror.
    ///
    /// # Errors
    /// GPU errors of the allocation or the copy.
    pub fn wrap(model: M, description: String) -> Result<Self> {
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
        Ok(GpuModelAdapter {
            model,
            specs,
            description,
            staged: TimeMajorBatch::default(),
            params_host,
            grads_host,
            params_dirty: false,
        })
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.model
    }
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> GpuModelAdapter<M> {
    /// One pass; copies may still be in flight when it returns early with an error.
    fn pass(&mut self, on_ready: &mut ReadyCallback<'_>) -> Result<PassOutput> {
        if self.params_dirty {
            let n = self.params_host.len();
            self.params_host
                .upload_async(0..n, self.model.params_mut())
                .map_err(gpu_err)?;
            self.params_dirty = false;
        }
        let start = Instant::now();
        let mut first_ready: Option<Instant> = None;
        let mut failure: Option<Error> = None;
        let mut pending = VecDeque::new();
        let (model, staged, grads_host) = (&mut self.model, &self.staged, &mut self.grads_host);
        let stats = model.forward_backward_staged(staged, &mut |range, grads: &GpuBuffer| {
            first_ready.get_or_insert_with(Instant::now);
            if failure.is_none() {
                let queued = grads
                    .slice(range.clone())
                    .and_then(|view| grads_host.download_async(range.clone(), &view))
                    .map_err(gpu_err);
                let step = queued.and_then(|()| {
                    pending.push_back(range);
                    deliver(grads_host, &mut pending, on_ready, false)
                });
                if let Err(e) = step {
                    failure = Some(e);
                }
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        deliver(grads_host, &mut pending, on_ready, true)?;
        Ok(pass_output(&stats, start, first_ready))
    }
}

/// Hands the landed ranges at the front of `pending` to `on_ready`, in order; with
/// `block`, waits for each in turn until none is left.
fn deliver(
    grads_host: &mut PinnedBuffer<f32>,
    pending: &mut VecDeque<Range<usize>>,
    on_ready: &mut ReadyCallback<'_>,
    block: bool,
) -> Result<()> {
    while let Some(front) = pending.front().cloned() {
        if !block && !grads_host.is_ready(front.clone()).map_err(gpu_err)? {
            break;
        }
        pending.pop_front();
        let grads = grads_host.wait(front.clone()).map_err(gpu_err)?;
        on_ready(front, grads)?;
    }
    Ok(())
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> TrainableModel for GpuModelAdapter<M> {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    // The mirrors are settled outside `forward_backward` (it waits for every copy before
    // returning), so the empty fallbacks below are never taken.
    fn params(&self) -> &[f32] {
        self.params_host.settled().unwrap_or_default()
    }
    fn params_mut(&mut self) -> &mut [f32] {
        self.params_dirty = true;
        self.params_host.settled_mut().unwrap_or_default()
    }
    fn params_and_grads_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        self.params_dirty = true;
        (
            self.params_host.settled_mut().unwrap_or_default(),
            self.grads_host.settled_mut().unwrap_or_default(),
        )
    }
    /// One pass: each final gradient range goes device → pinned host on the copy stream,
    /// then to `on_ready` (see the module docs).
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        M::stage(batch, &mut self.staged)?;
        let result = self.pass(on_ready);
        // No copy may outlive the pass: the trainer reads and writes both mirrors next.
        let settled = self
            .grads_host
            .wait_all()
            .and_then(|()| self.params_host.wait_all())
            .map_err(gpu_err);
        let output = result?;
        settled?;
        Ok(output)
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}
