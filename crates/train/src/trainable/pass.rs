//! One timed forward + backward pass: the part every adapter shares.
//!
//! [`run_pass`] runs the model, times forward (until backward has finished its first
//! gradient range) and backward (the rest, including handing the last ranges over), and
//! passes each finished range to a [`Delivery`], which decides how it reaches the
//! trainer: at once from host memory ([`AtOnce`]), or after a copy from the device (the
//! GPU adapter's). The first error stops the delivery and is returned after the pass.

use std::ops::Range;
use std::time::Instant;

use ringtrain_model::{GradsReady, StepStats};

use super::{PassOutput, ReadyCallback};
use crate::error::{Error, Result};

/// How the gradient ranges backward finishes reach the trainer's callback.
pub trait Delivery<Buf> {
    /// Backward finished `range` of the gradient buffer `grads`: hand it to `on_ready`
    /// now, or start moving it and hand it over later.
    ///
    /// # Errors
    /// `on_ready`'s, or the delivery's own.
    fn finished(
        &mut self,
        range: Range<usize>,
        grads: &Buf,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<()>;

    /// Backward is over: hand every range still held to `on_ready`, in order.
    ///
    /// # Errors
    /// As [`Delivery::finished`].
    fn drain(&mut self, on_ready: &mut ReadyCallback<'_>) -> Result<()>;
}

/// Delivery of host gradients: each range goes to the trainer as soon as it is final.
#[derive(Debug, Default, Clone, Copy)]
pub struct AtOnce;

impl Delivery<Vec<f32>> for AtOnce {
    fn finished(
        &mut self,
        range: Range<usize>,
        grads: &Vec<f32>,
        on_ready: &mut ReadyCallback<'_>,
    ) -> Result<()> {
        let values = grads.get(range.clone()).ok_or_else(|| {
            Error::Internal(format!(
                "the model reported gradient range {range:?} of a buffer of {}",
                grads.len()
            ))
        })?;
        on_ready(range, values)
    }

    fn drain(&mut self, _on_ready: &mut ReadyCallback<'_>) -> Result<()> {
        Ok(())
    }
}

/// Runs `pass` (a model's forward and backward, calling its argument with each
/// finished gradient range) with `delivery` between it and `on_ready`, and times it.
///
/// # Errors
/// The pass's error, else the first delivery error.
pub fn run_pass<Buf>(
    pass: impl FnOnce(&mut GradsReady<'_, Buf>) -> Result<StepStats>,
    delivery: &mut dyn Delivery<Buf>,
    on_ready: &mut ReadyCallback<'_>,
) -> Result<PassOutput> {
    let start = Instant::now();
    let mut first_ready: Option<Instant> = None;
    let mut failure: Option<Error> = None;
    let stats = pass(&mut |range: Range<usize>, grads: &Buf| {
        first_ready.get_or_insert_with(Instant::now);
        if failure.is_none() {
            failure = delivery.finished(range, grads, on_ready).err();
        }
    })?;
    if let Some(e) = failure {
        return Err(e);
    }
    delivery.drain(on_ready)?;
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

/// Runs `forward` (a model's forward-only loss) and times it.
///
/// # Errors
/// `forward`'s.
pub fn run_forward(forward: impl FnOnce() -> Result<StepStats>) -> Result<PassOutput> {
    let start = Instant::now();
    let stats = forward()?;
    Ok(PassOutput {
        loss_sum: stats.loss_sum,
        target_tokens: stats.tokens,
        forward_seconds: start.elapsed().as_secs_f64(),
        backward_seconds: 0.0,
        launches: stats.launches,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_reach_the_callback_in_order_and_the_first_error_wins() {
        let grads: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let mut seen = Vec::new();
        let out = run_pass(
            |ready| {
                ready(0..2, &grads);
                ready(2..6, &grads);
                Ok(StepStats {
                    loss_sum: 3.0,
                    tokens: 2.0,
                    launches: 5,
                })
            },
            &mut AtOnce,
            &mut |range, values| {
                seen.push((range, values.to_vec()));
                Ok(())
            },
        );
        let out = out.ok();
        assert_eq!(
            out.map(|o| (o.loss_sum, o.target_tokens, o.launches)),
            Some((3.0, 2.0, 5))
        );
        assert_eq!(
            seen,
            [(0..2, vec![0.0, 1.0]), (2..6, vec![2.0, 3.0, 4.0, 5.0])]
        );

        let mut calls = 0;
        let err = run_pass(
            |ready| {
                ready(0..2, &grads);
                ready(2..9, &grads);
                ready(2..6, &grads);
                Ok(StepStats::default())
            },
            &mut AtOnce,
            &mut |_, _| {
                calls += 1;
                Ok(())
            },
        );
        let err = err.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("2..9"), "{err}");
        assert_eq!(calls, 1, "delivery stops at the first error");
    }
}
