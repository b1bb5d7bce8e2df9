//! What every model offers the trainer: the [`Model`] trait and [`StepStats`].

use std::ops::Range;

use crate::backend::Backend;
use crate::error::Result;
use crate::params::ParamLayout;

/// Result of one forward (and backward) pass over a batch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepStats {
    /// Sum of the masked per-token cross-entropy (natural log).
    pub loss_sum: f64,
    /// Number of target tokens: the sum of the mask.
    pub tokens: f64,
    /// Backend operations (kernel launches on a GPU) this call issued.
    pub launches: u64,
}

impl StepStats {
    /// `loss_sum / tokens` (the reported loss), 0 for a batch without tokens.
    pub fn mean_loss(&self) -> f64 {
        if self.tokens > 0.0 {
            self.loss_sum / self.tokens
        } else {
            0.0
        }
    }
}

/// Callback told, during backward, that the gradient in `range` of the flat gradient
/// buffer (the second argument) is final.
pub type GradsReady<'a, Buf> = dyn FnMut(Range<usize>, &Buf) + 'a;

/// A trainable model with one flat parameter buffer and one flat gradient buffer.
pub trait Model {
    /// The backend the model computes on.
    type Backend: Backend;
    /// The model's input batch.
    type Batch<'a>;

    /// The named parameter tensors and their place in the flat buffers.
    fn layout(&self) -> &ParamLayout;
    /// The backend.
    fn backend(&self) -> &Self::Backend;
    /// The flat parameter buffer.
    fn params(&self) -> &<Self::Backend as Backend>::Buffer;
    /// The flat parameter buffer, for the optimizer or a broadcast.
    fn params_mut(&mut self) -> &mut <Self::Backend as Backend>::Buffer;
    /// The flat gradient buffer (gradient of the summed loss of the last batch).
    fn grads(&self) -> &<Self::Backend as Backend>::Buffer;
    /// The flat gradient buffer, for an in-place all-reduce.
    fn grads_mut(&mut self) -> &mut <Self::Backend as Backend>::Buffer;
    /// Both buffers at once, for an optimizer step.
    fn params_and_grads_mut(
        &mut self,
    ) -> (
        &mut <Self::Backend as Backend>::Buffer,
        &mut <Self::Backend as Backend>::Buffer,
    );
    /// Re-initialises every parameter from `seed`.
    ///
    /// # Errors
    /// Backend errors.
    fn init_params(&mut self, seed: u64) -> Result<()>;
    /// Loss of `batch` without gradients.
    ///
    /// # Errors
    /// `InvalidBatch` for a malformed batch; backend errors.
    fn forward_loss(&mut self, batch: &Self::Batch<'_>) -> Result<StepStats>;
    /// Loss and gradients of `batch`. `on_grads_ready(range, grads)` is called once per
    /// parameter tensor as soon as its gradient is final; the ranges are consecutive,
    /// ascending, and cover the gradient buffer exactly once. The gradient buffer is
    /// overwritten (not accumulated into).
    ///
    /// # Errors
    /// `InvalidBatch` for a malformed batch; backend errors.
    fn forward_backward(
        &mut self,
        batch: &Self::Batch<'_>,
        on_grads_ready: &mut GradsReady<'_, <Self::Backend as Backend>::Buffer>,
    ) -> Result<StepStats>;
}

/// Checks `values.len() == expected`.
pub(crate) fn check_len<T>(
    field: &'static str,
    values: &[T],
    expected: usize,
    shape: &str,
) -> Result<()> {
    if values.len() == expected {
        Ok(())
    } else {
        Err(crate::error::batch_error(
            field,
            format!("{} elements", values.len()),
            format!("expected {expected} = {shape} (time-major)"),
        ))
    }
}

/// Checks that a size is at least 1.
pub(crate) fn check_positive(field: &'static str, value: usize) -> Result<()> {
    if value == 0 {
        Err(crate::error::batch_error(
            field,
            value,
            "must be at least 1",
        ))
    } else {
        Ok(())
    }
}

/// Checks that every `(field, value)` size of a model config is at least 1.
pub(crate) fn check_sizes(sizes: &[(&'static str, usize)]) -> Result<()> {
    match sizes.iter().find(|(_, value)| *value == 0) {
        Some(&(field, value)) => Err(crate::error::invalid_value(
            field,
            value,
            "must be at least 1",
        )),
        None => Ok(()),
    }
}

/// Checks the initialisation fields of a model config: `init_scale` finite and >= 0
/// (else an error with `init_scale_reason`), `forget_bias` finite.
pub(crate) fn check_init(init_scale: f32, forget_bias: f32, init_scale_reason: &str) -> Result<()> {
    if !(init_scale.is_finite() && init_scale >= 0.0) {
        return Err(crate::error::invalid_value(
            "init_scale",
            init_scale,
            init_scale_reason,
        ));
    }
    if !forget_bias.is_finite() {
        return Err(crate::error::invalid_value(
            "forget_bias",
            forget_bias,
            "must be finite (usually 1.0)",
        ));
    }
    Ok(())
}

/// Implements `Debug` and [`Model`] for a model struct `$model<B>` with the fields
/// `backend`, `config`, `layout`, `params` and `grads`, and the methods
/// `stage(&self, &$batch) -> Result<Staged>` (checks the batch and stages its ids and
/// targets on the backend, once per pass), `forward(&mut self, &Staged) -> Result<(f64,
/// f64)>` (loss sum, tokens) and `backward(&mut self, &Staged, on_ready) -> Result<()>`
/// (after `forward`, with the same staged batch).
macro_rules! impl_model {
    ($model:ident, $batch:ident) => {
        impl<B: Backend> std::fmt::Debug for $model<B> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($model))
                    .field("backend", &self.backend.name())
                    .field("config", &self.config)
                    .field("params", &self.layout.total_len())
                    .finish()
            }
        }

        impl<B: Backend> $crate::model::Model for $model<B> {
            type Backend = B;
            type Batch<'a> = $batch<'a>;

            fn layout(&self) -> &ParamLayout {
                &self.layout
            }
            fn backend(&self) -> &B {
                &self.backend
            }
            fn params(&self) -> &B::Buffer {
                &self.params
            }
            fn params_mut(&mut self) -> &mut B::Buffer {
                &mut self.params
            }
            fn grads(&self) -> &B::Buffer {
                &self.grads
            }
            fn grads_mut(&mut self) -> &mut B::Buffer {
                &mut self.grads
            }
            fn params_and_grads_mut(&mut self) -> (&mut B::Buffer, &mut B::Buffer) {
                (&mut self.params, &mut self.grads)
            }
            fn init_params(&mut self, seed: u64) -> Result<()> {
                let values = self.layout.initial_values(seed)?;
                self.backend.upload(&values, &mut self.params, 0)
            }
            fn forward_loss(&mut self, batch: &$batch<'_>) -> Result<StepStats> {
                let start = self.backend.launches();
                let staged = self.stage(batch)?;
                self.backend.begin_pass(&self.params);
                let executor = self.backend.executor();
                let this = &mut *self;
                let result = executor.run(move || this.forward(&staged, false));
                self.backend.end_pass();
                let (loss_sum, tokens) = result?;
                Ok(StepStats {
                    loss_sum,
                    tokens,
                    launches: self.backend.launches() - start,
                })
            }
            fn forward_backward(
                &mut self,
                batch: &$batch<'_>,
                on_grads_ready: &mut GradsReady<'_, B::Buffer>,
            ) -> Result<StepStats> {
                let start = self.backend.launches();
                let staged = self.stage(batch)?;
                // The parameters stay unchanged until end_pass (backward writes gradients).
                self.backend.begin_pass(&self.params);
                // The pass runs where the backend's operations run fastest; backward hands
                // gradient ranges to the caller as they finish, on the caller's thread.
                let executor = self.backend.executor();
                let this = &mut *self;
                let result = executor.run_calling_back(
                    move |on_ready| {
                        let loss = this.forward(&staged, true)?;
                        this.backward(&staged, on_ready).map(|()| loss)
                    },
                    on_grads_ready,
                );
                self.backend.end_pass();
                let (loss_sum, tokens) = result?;
                Ok(StepStats {
                    loss_sum,
                    tokens,
                    launches: self.backend.launches() - start,
                })
            }
        }
    };
}
pub(crate) use impl_model;
