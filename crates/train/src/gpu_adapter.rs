//! Binds the model crate's NMT and RNNLM models on the CUDA backend to [`TrainableModel`].
//!
//! The trainer works on host slices, the model on device buffers, so the adapter keeps host
//! mirrors of the flat parameter and gradient buffers: during backward, every gradient range
//! the model reports final is copied device → host at once (the copy waits for the work
//! queued so far on the GPU's stream) and handed to the trainer's callback, so the reduction
//! of that range can run while the host queues the rest of backward (when the strategy hands
//! it to its communication thread); after the optimizer has updated the host parameters, the
//! next pass copies them host → device once.

use ringtrain_model::{Backend, CudaBackend, Model};

use crate::error::{Error, Result};
use crate::model_adapter::{param_specs, timed_pass, TimeMajorBatch, TrainsOnBatch};
use crate::trainable::{Batch, ParamSpec, PassOutput, ReadyCallback, TrainableModel};

/// A model on the CUDA backend with host mirrors of its parameters and gradients.
pub struct GpuModelAdapter<M> {
    model: M,
    specs: Vec<ParamSpec>,
    description: String,
    staged: TimeMajorBatch,
    params_host: Vec<f32>,
    grads_host: Vec<f32>,
    /// The host parameters changed since they were last copied to the device.
    params_dirty: bool,
}

/// The CUDA backend's buffer type.
type GpuBuffer = <CudaBackend as Backend>::Buffer;

fn gpu_error<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::invalid("--device", "cuda", format!("{what}: {e}"))
}

impl<M: Model<Backend = CudaBackend>> GpuModelAdapter<M> {
    /// Wraps `model`, reading its initial parameters into the host mirror.
    ///
    /// # Errors
    /// GPU errors of the copy.
    pub fn wrap(model: M, description: String) -> Result<Self> {
        let specs = param_specs(model.layout());
        let total = model.layout().total_len();
        let mut params_host = vec![0.0; total];
        model
            .backend()
            .download(model.params(), 0, &mut params_host)?;
        Ok(GpuModelAdapter {
            model,
            specs,
            description,
            staged: TimeMajorBatch::default(),
            params_host,
            grads_host: vec![0.0; total],
            params_dirty: false,
        })
    }

    /// The wrapped model.
    pub fn inner(&self) -> &M {
        &self.model
    }

    /// Copies the host parameters to the device if the optimizer (or a broadcast) changed them.
    fn sync_params(&mut self) -> Result<()> {
        if self.params_dirty {
            let gpu = self.model.backend().gpu().clone();
            gpu.copy_from_host(&self.params_host, self.model.params_mut())
                .map_err(gpu_error("copying the parameters to the GPU"))?;
            self.params_dirty = false;
        }
        Ok(())
    }
}

impl<M: TrainsOnBatch<Backend = CudaBackend> + Send> TrainableModel for GpuModelAdapter<M> {
    fn param_specs(&self) -> Vec<ParamSpec> {
        self.specs.clone()
    }
    fn params(&self) -> &[f32] {
        &self.params_host
    }
    fn params_mut(&mut self) -> &mut [f32] {
        self.params_dirty = true;
        &mut self.params_host
    }
    fn params_and_grads_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        self.params_dirty = true;
        (&mut self.params_host, &mut self.grads_host)
    }
    /// One pass: each final gradient range goes device → host, then to `on_ready`.
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        M::stage(batch, &mut self.staged)?;
        self.sync_params()?;
        let (model, staged, grads_host) = (&mut self.model, &self.staged, &mut self.grads_host);
        timed_pass(
            |cb| model.forward_backward_staged(staged, cb),
            |range, grads: &GpuBuffer| {
                grads
                    .slice(range.clone())
                    .and_then(|view| {
                        grads
                            .gpu()
                            .copy_to_host(&view, &mut grads_host[range.clone()])
                    })
                    .map_err(gpu_error("copying gradients to the host"))?;
                on_ready(range.clone(), &grads_host[range])
            },
        )
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}
