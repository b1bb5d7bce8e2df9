//! Binds the model crate's NMT and RNNLM models on the CUDA backend to [`TrainableModel`].
//!
//! The trainer works on host slices, the model on device buffers, so the adapter keeps host
//! mirrors of the flat parameter and gradient buffers: during backward, every gradient range
//! the model reports final is copied device → host at once (the copy waits for the work
//! queued so far on the GPU's stream) and handed to the trainer's callback, so the reduction
//! of that range can run while the host queues the rest of backward (when the strategy hands
//! it to its communication thread); after the optimizer has updated the host parameters, the
//! next pass copies them host → device once.

use std::ops::Range;
use std::time::Instant;

use ringtrain_model::{Backend, CudaBackend, Model, NmtModel, RnnLm};

use crate::error::{Error, Result};
use crate::trainable::{Batch, ParamSpec, PassOutput, ReadyCallback, TrainableModel};

/// A model on the CUDA backend with host mirrors of its parameters and gradients.
pub struct GpuModelAdapter<M> {
    model: M,
    specs: Vec<ParamSpec>,
    description: String,
    src: Vec<u32>,
    tgt_in: Vec<u32>,
    tgt_out: Vec<u32>,
    mask: Vec<f32>,
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
        let specs = model
            .layout()
            .entries()
            .iter()
            .map(|e| ParamSpec {
                name: e.name.clone(),
                range: e.offset..e.offset + e.len,
            })
            .collect();
        let total = model.layout().total_len();
        let mut params_host = vec![0.0; total];
        model
            .backend()
            .download(model.params(), 0, &mut params_host)?;
        Ok(GpuModelAdapter {
            model,
            specs,
            description,
            src: Vec::new(),
            tgt_in: Vec::new(),
            tgt_out: Vec::new(),
            mask: Vec::new(),
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

/// One pass: each final gradient range goes device → host, then to `on_ready`.
fn pass_with_host_grads(
    run: impl FnOnce(
        &mut dyn FnMut(Range<usize>, &GpuBuffer),
    ) -> ringtrain_model::Result<ringtrain_model::StepStats>,
    grads_host: &mut [f32],
    on_ready: &mut ReadyCallback<'_>,
) -> Result<PassOutput> {
    let start = Instant::now();
    let mut first_ready: Option<Instant> = None;
    let mut failure: Option<Error> = None;
    let stats = run(&mut |range: Range<usize>, grads: &GpuBuffer| {
        first_ready.get_or_insert_with(Instant::now);
        if failure.is_some() {
            return;
        }
        let copied = grads
            .slice(range.clone())
            .and_then(|view| {
                grads
                    .gpu()
                    .copy_to_host(&view, &mut grads_host[range.clone()])
            })
            .map_err(gpu_error("copying gradients to the host"));
        if let Err(e) = copied.and_then(|()| on_ready(range.clone(), &grads_host[range])) {
            failure = Some(e);
        }
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    let end = Instant::now();
    let split = first_ready.unwrap_or(end);
    Ok(PassOutput {
        loss_sum: stats.loss_sum,
        target_tokens: stats.tokens,
        forward_seconds: split.duration_since(start).as_secs_f64(),
        backward_seconds: end.duration_since(split).as_secs_f64(),
        launches: stats.launches,
    })
}

fn wrong_batch(model: &str) -> Error {
    Error::invalid(
        "--model",
        model,
        "the input pipeline produced batches for the other model; build the pipeline from the same config",
    )
}

impl TrainableModel for GpuModelAdapter<NmtModel<CudaBackend>> {
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
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        let Batch::Nmt(b) = batch else {
            return Err(wrong_batch("nmt"));
        };
        self.sync_params()?;
        crate::model_adapter::transpose_into(&b.source, b.batch_size, b.src_len, &mut self.src);
        crate::model_adapter::transpose_into(
            &b.target_input,
            b.batch_size,
            b.tgt_len,
            &mut self.tgt_in,
        );
        crate::model_adapter::transpose_into(
            &b.target_output,
            b.batch_size,
            b.tgt_len,
            &mut self.tgt_out,
        );
        crate::model_adapter::transpose_into(
            &b.target_mask,
            b.batch_size,
            b.tgt_len,
            &mut self.mask,
        );
        let view = ringtrain_model::NmtBatch {
            batch: b.batch_size,
            src_len: b.src_len,
            tgt_len: b.tgt_len,
            src: &self.src,
            tgt_in: &self.tgt_in,
            tgt_out: &self.tgt_out,
            tgt_mask: &self.mask,
        };
        let model = &mut self.model;
        pass_with_host_grads(
            |cb| model.forward_backward(&view, cb),
            &mut self.grads_host,
            on_ready,
        )
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}

impl TrainableModel for GpuModelAdapter<RnnLm<CudaBackend>> {
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
    fn forward_backward(
        &mut self,
        batch: &Batch,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<PassOutput> {
        let Batch::Lm(b) = batch else {
            return Err(wrong_batch("rnnlm"));
        };
        self.sync_params()?;
        crate::model_adapter::transpose_into(&b.inputs, b.batch_size, b.steps, &mut self.src);
        crate::model_adapter::transpose_into(&b.targets, b.batch_size, b.steps, &mut self.tgt_out);
        crate::model_adapter::transpose_into(&b.mask, b.batch_size, b.steps, &mut self.mask);
        let view = ringtrain_model::LmBatch {
            batch: b.batch_size,
            len: b.steps,
            inputs: &self.src,
            targets: &self.tgt_out,
            mask: &self.mask,
        };
        let model = &mut self.model;
        pass_with_host_grads(
            |cb| model.forward_backward(&view, cb),
            &mut self.grads_host,
            on_ready,
        )
    }
    fn describe(&self) -> String {
        self.description.clone()
    }
}
