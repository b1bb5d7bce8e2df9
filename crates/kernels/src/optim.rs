//! Optimizer steps on f32 master weights, following PyTorch's definitions
//! (`torch.optim.SGD`, `Adam`, `AdamW`, `torch.nn.utils.clip_grad_norm_`).
//!
//! Per-step scalars (bias corrections, `1 - beta`, `1 - lr * weight_decay`) are computed in
//! f64, as PyTorch computes them from Python floats, and rounded once to f32; the
//! per-element arithmetic is f32. A weight decay of exactly 0.0 skips the decay term, as
//! PyTorch does.

use crate::error::{check_len, Error, Result, Value};
use crate::vector_math::sqrt;

/// `Err(InvalidValue)` naming `arg` unless `value` is finite and `>= 0` (PyTorch's
/// optimizers reject negative or NaN learning rates, momenta, epsilons and decays too).
#[inline]
fn check_non_negative(arg: &'static str, value: f32) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidValue {
            name: arg,
            value: Value::Real(value),
            reason: "must be a finite number >= 0",
        })
    }
}

/// How an update reads each gradient `g`: as `g * self.0 * self.1`, each product rounded
/// to f32 — the bits of scaling the gradients by `self.0` and then by `self.1` before the
/// update (averaging over the examples, then clipping to a global norm), without the
/// passes over memory that scaling them first takes. [`GradScale::ONE`] reads them as they
/// are.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScale(pub f32, pub f32);

impl GradScale {
    /// Gradients as they are.
    pub const ONE: GradScale = GradScale(1.0, 1.0);

    #[inline(always)]
    fn of(self, g: f32) -> f32 {
        g * self.0 * self.1
    }

    /// `Err(InvalidValue)` naming `grad_scale` unless both factors are finite and `>= 0`.
    pub(crate) fn check(self) -> Result<()> {
        check_non_negative("grad_scale", self.0)?;
        check_non_negative("grad_scale", self.1)
    }
}

/// `p -= lr * (g + weight_decay * p)` (plain SGD with L2 weight decay).
///
/// # Errors
/// `ShapeMismatch` naming `grads` when its length differs from `params`;
/// `InvalidValue` naming `lr` or `weight_decay` when it is negative or not finite.
pub fn sgd_step(params: &mut [f32], grads: &[f32], lr: f32, weight_decay: f32) -> Result<()> {
    sgd_step_scaled(params, grads, lr, weight_decay, GradScale::ONE)
}

/// [`sgd_step`] on the gradients read through `scale`.
///
/// # Errors
/// As [`sgd_step`], and `InvalidValue` naming `grad_scale` when a factor is negative or
/// not finite.
pub fn sgd_step_scaled(
    params: &mut [f32],
    grads: &[f32],
    lr: f32,
    weight_decay: f32,
    scale: GradScale,
) -> Result<()> {
    check_sgd(params, grads, lr, weight_decay, scale)?;
    sgd_block(params, grads, lr, weight_decay, scale);
    Ok(())
}

/// Argument checks of [`sgd_step_scaled`] and its parallel twin.
#[inline]
pub(crate) fn check_sgd(
    params: &[f32],
    grads: &[f32],
    lr: f32,
    weight_decay: f32,
    scale: GradScale,
) -> Result<()> {
    check_len("grads", grads.len(), params.len())?;
    check_non_negative("lr", lr)?;
    check_non_negative("weight_decay", weight_decay)?;
    scale.check()
}

#[inline]
pub(crate) fn sgd_block(
    params: &mut [f32],
    grads: &[f32],
    lr: f32,
    weight_decay: f32,
    scale: GradScale,
) {
    if weight_decay == 0.0 {
        sgd_block_inner::<false>(params, grads, lr, weight_decay, scale);
    } else {
        sgd_block_inner::<true>(params, grads, lr, weight_decay, scale);
    }
}

#[inline(always)]
fn sgd_block_inner<const DECAY: bool>(
    params: &mut [f32],
    grads: &[f32],
    lr: f32,
    wd: f32,
    scale: GradScale,
) {
    for (p, &g) in params.iter_mut().zip(grads) {
        let g = scale.of(g);
        let d = if DECAY { g + wd * *p } else { g };
        *p -= lr * d;
    }
}

/// Hyper-parameters of one momentum-SGD step.
#[derive(Clone, Copy)]
pub(crate) struct MomentumStep {
    lr: f32,
    momentum: f32,
    one_minus_dampening: f32,
    weight_decay: f32,
    nesterov: bool,
    first_step: bool,
}

impl MomentumStep {
    /// Argument checks of [`sgd_momentum_step`] and its parallel twin; `hyper` is
    /// `[lr, momentum, dampening, weight_decay]`.
    pub(crate) fn checked(
        params: &[f32],
        grads: &[f32],
        momentum_buf: &[f32],
        hyper: [f32; 4],
        nesterov: bool,
        first_step: bool,
    ) -> Result<Self> {
        check_len("grads", grads.len(), params.len())?;
        check_len("momentum_buf", momentum_buf.len(), params.len())?;
        let [lr, momentum, dampening, weight_decay] = hyper;
        Self::new(lr, momentum, dampening, weight_decay, nesterov, first_step)
    }

    fn new(
        lr: f32,
        momentum: f32,
        dampening: f32,
        weight_decay: f32,
        nesterov: bool,
        first_step: bool,
    ) -> Result<Self> {
        check_non_negative("lr", lr)?;
        check_non_negative("momentum", momentum)?;
        check_non_negative("dampening", dampening)?;
        check_non_negative("weight_decay", weight_decay)?;
        if nesterov && (momentum <= 0.0 || dampening != 0.0) {
            return Err(Error::InvalidValue {
                name: "nesterov",
                value: Value::Flag(true),
                reason: "Nesterov momentum needs momentum > 0 and dampening 0 (as in PyTorch)",
            });
        }
        Ok(Self {
            lr,
            momentum,
            one_minus_dampening: (1.0 - f64::from(dampening)) as f32,
            weight_decay,
            nesterov,
            first_step,
        })
    }

    #[inline]
    pub(crate) fn apply(&self, params: &mut [f32], grads: &[f32], buf: &mut [f32]) {
        match (self.weight_decay != 0.0, self.first_step, self.nesterov) {
            (false, false, false) => self.apply_inner::<false, false, false>(params, grads, buf),
            (false, false, true) => self.apply_inner::<false, false, true>(params, grads, buf),
            (false, true, false) => self.apply_inner::<false, true, false>(params, grads, buf),
            (false, true, true) => self.apply_inner::<false, true, true>(params, grads, buf),
            (true, false, false) => self.apply_inner::<true, false, false>(params, grads, buf),
            (true, false, true) => self.apply_inner::<true, false, true>(params, grads, buf),
            (true, true, false) => self.apply_inner::<true, true, false>(params, grads, buf),
            (true, true, true) => self.apply_inner::<true, true, true>(params, grads, buf),
        }
    }

    #[inline(always)]
    fn apply_inner<const DECAY: bool, const FIRST: bool, const NESTEROV: bool>(
        &self,
        params: &mut [f32],
        grads: &[f32],
        buf: &mut [f32],
    ) {
        let s = *self;
        for ((p, &g), b) in params.iter_mut().zip(grads).zip(buf.iter_mut()) {
            let d = if DECAY { g + s.weight_decay * *p } else { g };
            *b = if FIRST {
                d
            } else {
                s.momentum * *b + s.one_minus_dampening * d
            };
            let d = if NESTEROV { d + s.momentum * *b } else { *b };
            *p -= s.lr * d;
        }
    }
}

/// PyTorch SGD with momentum:
/// `d = g + wd*p; buf = first_step ? d : momentum*buf + (1-dampening)*d;
/// d = nesterov ? d + momentum*buf : buf; p -= lr*d`.
///
/// `first_step` must be true on the first call for a buffer (PyTorch initialises the
/// buffer with `d` then); `momentum_buf` is ignored on input in that case.
///
/// # Errors
/// `ShapeMismatch` naming `grads` or `momentum_buf` when its length differs from `params`;
/// `InvalidValue` naming `nesterov` when Nesterov is asked for with `momentum <= 0` or
/// non-zero `dampening` (PyTorch rejects that too), or naming a hyper-parameter that is
/// negative or not finite.
#[allow(clippy::too_many_arguments)]
pub fn sgd_momentum_step(
    params: &mut [f32],
    grads: &[f32],
    momentum_buf: &mut [f32],
    lr: f32,
    momentum: f32,
    dampening: f32,
    weight_decay: f32,
    nesterov: bool,
    first_step: bool,
) -> Result<()> {
    let hyper = [lr, momentum, dampening, weight_decay];
    let step = MomentumStep::checked(params, grads, momentum_buf, hyper, nesterov, first_step)?;
    step.apply(params, grads, momentum_buf);
    Ok(())
}

/// Per-step coefficients of Adam / AdamW.
#[derive(Clone, Copy)]
pub(crate) struct AdamStep {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    /// `lr / (1 - beta1^step)`.
    step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    bias_correction2_sqrt: f32,
    eps: f32,
    /// L2 term added to the gradient (Adam); 0 for AdamW.
    l2: f32,
    /// `1 - lr * weight_decay` applied to the weights first (AdamW); 1 for Adam.
    decoupled_decay: f32,
    /// How each gradient is read.
    scale: GradScale,
}

impl AdamStep {
    #[allow(clippy::too_many_arguments)]
    fn new(
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        step: u32,
        decoupled: bool,
    ) -> Result<Self> {
        check_non_negative("lr", lr)?;
        check_non_negative("eps", eps)?;
        check_non_negative("weight_decay", weight_decay)?;
        if step == 0 {
            return Err(Error::InvalidValue {
                name: "step",
                value: Value::Count(0),
                reason: "Adam steps count from 1: pass 1 on the first update",
            });
        }
        if !(0.0..1.0).contains(&beta1) {
            return Err(Error::InvalidValue {
                name: "beta1",
                value: Value::Real(beta1),
                reason: "must be in [0, 1), e.g. 0.9",
            });
        }
        if !(0.0..1.0).contains(&beta2) {
            return Err(Error::InvalidValue {
                name: "beta2",
                value: Value::Real(beta2),
                reason: "must be in [0, 1), e.g. 0.999",
            });
        }
        let (b1, b2, lr64) = (f64::from(beta1), f64::from(beta2), f64::from(lr));
        let exponent = i32::try_from(step).unwrap_or(i32::MAX);
        let bias_correction1 = 1.0 - libm::pow(b1, f64::from(exponent));
        let bias_correction2 = 1.0 - libm::pow(b2, f64::from(exponent));
        let (l2, decoupled_decay) = if decoupled {
            (0.0, (1.0 - lr64 * f64::from(weight_decay)) as f32)
        } else {
            (weight_decay, 1.0)
        };
        Ok(Self {
            beta1,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2,
            one_minus_beta2: (1.0 - b2) as f32,
            step_size: (lr64 / bias_correction1) as f32,
            bias_correction2_sqrt: libm::sqrt(bias_correction2) as f32,
            eps,
            l2,
            decoupled_decay,
            scale: GradScale::ONE,
        })
    }

    #[inline]
    pub(crate) fn apply(&self, params: &mut [f32], grads: &[f32], m: &mut [f32], v: &mut [f32]) {
        match (self.l2 != 0.0, self.decoupled_decay != 1.0) {
            (false, false) => self.apply_inner::<false, false>(params, grads, m, v),
            (false, true) => self.apply_inner::<false, true>(params, grads, m, v),
            (true, false) => self.apply_inner::<true, false>(params, grads, m, v),
            (true, true) => self.apply_inner::<true, true>(params, grads, m, v),
        }
    }

    #[inline(always)]
    fn apply_inner<const L2: bool, const DECOUPLED: bool>(
        &self,
        params: &mut [f32],
        grads: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        let s = *self;
        let it = params
            .iter_mut()
            .zip(grads)
            .zip(m.iter_mut().zip(v.iter_mut()));
        for ((p, &g), (m, v)) in it {
            if DECOUPLED {
                *p *= s.decoupled_decay;
            }
            let g = s.scale.of(g);
            let g = if L2 { g + s.l2 * *p } else { g };
            *m = s.beta1 * *m + s.one_minus_beta1 * g;
            *v = s.beta2 * *v + s.one_minus_beta2 * g * g;
            let denom = sqrt(*v) / s.bias_correction2_sqrt + s.eps;
            *p -= s.step_size * (*m / denom);
        }
    }
}

/// Argument checks shared by Adam and AdamW and their parallel twins; `hyper` is
/// `[lr, beta1, beta2, eps, weight_decay]`. Returns the step's coefficients.
#[inline]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_adam(
    params: &[f32],
    grads: &[f32],
    m: &[f32],
    v: &[f32],
    hyper: [f32; 5],
    step: u32,
    decoupled: bool,
    scale: GradScale,
) -> Result<AdamStep> {
    check_len("grads", grads.len(), params.len())?;
    check_len("m", m.len(), params.len())?;
    check_len("v", v.len(), params.len())?;
    scale.check()?;
    let [lr, beta1, beta2, eps, weight_decay] = hyper;
    let s = AdamStep::new(lr, beta1, beta2, eps, weight_decay, step, decoupled)?;
    Ok(AdamStep { scale, ..s })
}

/// PyTorch Adam (L2 weight decay added to the gradient); `step` is 1-based:
/// `g += wd*p; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; bc1 = 1-b1^step;
/// bc2 = 1-b2^step; p -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)`.
///
/// # Errors
/// `ShapeMismatch` naming `grads`, `m` or `v` when its length differs from `params`;
/// `InvalidValue` for `step == 0`, a beta outside `[0, 1)`, or a negative or non-finite
/// `lr`, `eps` or `weight_decay`.
#[allow(clippy::too_many_arguments)]
pub fn adam_step(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step: u32,
) -> Result<()> {
    adam_step_scaled(
        params,
        grads,
        m,
        v,
        [lr, beta1, beta2, eps, weight_decay],
        step,
        GradScale::ONE,
    )
}

/// [`adam_step`] on the gradients read through `scale`; `hyper` is `[lr, beta1, beta2,
/// eps, weight_decay]`.
///
/// # Errors
/// As [`adam_step`], and `InvalidValue` naming `grad_scale` when a factor is negative or
/// not finite.
pub fn adam_step_scaled(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hyper: [f32; 5],
    step: u32,
    scale: GradScale,
) -> Result<()> {
    let s = check_adam(params, grads, m, v, hyper, step, false, scale)?;
    s.apply(params, grads, m, v);
    Ok(())
}

/// PyTorch AdamW: `p *= 1 - lr*weight_decay` first, then the Adam update without the L2
/// term.
///
/// # Errors
/// As [`adam_step`].
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    lr: f32,
    beta1: f32,
    beta2: f32,
    eps: f32,
    weight_decay: f32,
    step: u32,
) -> Result<()> {
    let hyper = [lr, beta1, beta2, eps, weight_decay];
    let s = check_adam(params, grads, m, v, hyper, step, true, GradScale::ONE)?;
    s.apply(params, grads, m, v);
    Ok(())
}

/// Elements per block of [`sum_of_squares_scaled`]: the serial and the parallel sums
/// both add the blocks' sums in order, so they give the same bits.
pub const SQUARES_BLOCK: usize = 1 << 14;

/// Sum of squares in f64 (see [`sum_of_squares_scaled`]).
pub fn sum_of_squares(x: &[f32]) -> f64 {
    sum_of_squares_scaled(x, 1.0)
}

/// `Σ (x[i] * scale)²`: each product rounded to f32 (the bits of scaling `x` first), then
/// squared and summed in f64, in eight interleaved lanes per block of [`SQUARES_BLOCK`]
/// elements and the blocks' sums in order — a fixed order, so the result depends on
/// nothing but the input. It is finite exactly when every `x[i] * scale` is (no f32
/// squared overflows f64), so one pass gives the norm and the overflow test.
pub fn sum_of_squares_scaled(x: &[f32], scale: f32) -> f64 {
    x.chunks(SQUARES_BLOCK)
        .map(|block| squares_block(block, scale))
        .sum()
}

crate::wide::wide_twin! {
    /// One block of [`sum_of_squares_scaled`].
    pub(crate) fn squares_block(x: &[f32], scale: f32) -> f64 {
        let mut lanes = [0.0f64; 8];
        let chunks = x.chunks_exact(8);
        let tail = chunks.remainder();
        for chunk in chunks {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                let v = f64::from(v * scale);
                *lane += v * v;
            }
        }
        for (lane, &v) in lanes.iter_mut().zip(tail) {
            let v = f64::from(v * scale);
            *lane += v * v;
        }
        ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
            + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
    }
}

/// PyTorch `clip_grad_norm_`'s factor: `min(1, max_norm / (total_norm + 1e-6))`, computed
/// in f64 and rounded to f32. A NaN norm gives NaN (the gradients are poisoned anyway); an
/// infinite norm gives 0.
pub fn clip_factor(total_norm: f64, max_norm: f32) -> f32 {
    let factor = f64::from(max_norm) / (total_norm + 1e-6);
    if factor.is_nan() {
        f32::NAN
    } else {
        factor.min(1.0) as f32
    }
}

/// Global-norm clipping over several gradient slices: computes
/// `total = sqrt(sum of sum_of_squares)`, scales every slice by
/// `clip_factor(total, max_norm)` when that is below 1, and returns `total`.
pub fn clip_by_global_norm(grads: &mut [&mut [f32]], max_norm: f32) -> f64 {
    let total = libm::sqrt(grads.iter().map(|g| sum_of_squares(g)).sum::<f64>());
    let factor = clip_factor(total, max_norm);
    if factor.is_nan() || factor < 1.0 {
        for g in grads.iter_mut() {
            crate::reduce::scale_f32(g, factor);
        }
    }
    total
}
