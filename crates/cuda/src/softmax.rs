//! Softmax cross-entropy (`ptx/softmax.ptx`), GPU twins of `ringtrain_kernels::softmax`.
//!
//! The forward pass is always the single-pass online log-sum-exp, so
//! [`softmax_xent_forward`] and [`softmax_xent_forward_online`] launch the same
//! kernel. Rows of at most [`WARP_ROW_MAX_VOCAB`] logits get one warp each; longer
//! rows get one block each, with 16-byte vector loads.
//!
//! Differences from the CPU kernels, which can return errors: a row with a
//! non-zero mask and `labels[r] >= vocab` gets `loss[r] = NaN` (a device kernel
//! cannot return an error, and the NaN surfaces in the summed loss); its
//! gradient has no one-hot term. Accuracy: see the PTX header (about 2e-6
//! relative on lse and loss, `ex2.approx`).

use crate::signature::{KernelSignature, Param::*, PtxModule};

/// The PTX text of `ptx/softmax.ptx`.
pub const PTX: &str = include_str!("../../../ptx/softmax.ptx");

/// Rows this long or shorter use the warp-per-row kernels.
pub const WARP_ROW_MAX_VOCAB: usize = 1024;

const FORWARD: &[crate::signature::Param] = &[Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32];
const BACKWARD: &[crate::signature::Param] = &[Ptr, Ptr, Ptr, Ptr, F32, U32, U32];

/// Every entry of `ptx/softmax.ptx`.
pub const KERNELS: &[KernelSignature] = &[
    KernelSignature {
        name: "softmax_xent_forward_online_warp",
        params: FORWARD,
    },
    KernelSignature {
        name: "softmax_xent_forward_online_block",
        params: FORWARD,
    },
    KernelSignature {
        name: "softmax_xent_backward_warp",
        params: BACKWARD,
    },
    KernelSignature {
        name: "softmax_xent_backward_block",
        params: BACKWARD,
    },
];

/// `ptx/softmax.ptx` with its declarations.
pub const MODULE: PtxModule = PtxModule {
    name: "softmax",
    file: "ptx/softmax.ptx",
    text: PTX,
    kernels: KERNELS,
};

#[cfg(feature = "cuda")]
pub use launchers::*;

#[cfg(feature = "cuda")]
mod launchers {
    use super::{MODULE, WARP_ROW_MAX_VOCAB};
    use crate::error::{check_len, kernel_count, Error, Result};
    use crate::memory::{AsDevSlice, AsDevSliceMut};
    use crate::runtime::{Gpu, KernelArg, LaunchConfig};

    const WARP_BLOCK: u32 = 256;
    const MAX_GRID: usize = 1 << 20;

    fn dims(rows: usize, vocab: usize) -> Result<(u32, u32, usize)> {
        if vocab == 0 {
            return Err(Error::InvalidValue {
                name: "vocab",
                value: "0".into(),
                reason: "a softmax needs at least one class",
            });
        }
        let rows32 = kernel_count("rows", rows)?;
        let vocab32 = kernel_count("vocab", vocab)?;
        let total = rows.checked_mul(vocab).ok_or(Error::TooLarge {
            arg: "rows * vocab",
            value: usize::MAX,
            limit: usize::MAX,
        })?;
        Ok((rows32, vocab32, total))
    }

    /// Picks the kernel variant and its launch shape.
    fn variant(gpu: &Gpu, rows: usize, vocab: usize) -> (&'static str, LaunchConfig) {
        if vocab <= WARP_ROW_MAX_VOCAB {
            let rows_per_block = (WARP_BLOCK / 32) as usize;
            let blocks = rows
                .div_ceil(rows_per_block)
                .min(gpu.multiprocessors() as usize * 32);
            ("warp", LaunchConfig::linear(blocks as u32, WARP_BLOCK))
        } else {
            let block = if vocab < 8192 { 256 } else { 512 };
            (
                "block",
                LaunchConfig::linear(rows.min(MAX_GRID) as u32, block),
            )
        }
    }

    /// GPU twin of `ringtrain_kernels::softmax_xent_forward` (computed with the
    /// online single pass, like [`softmax_xent_forward_online`]).
    pub fn softmax_xent_forward(
        gpu: &Gpu,
        logits: &impl AsDevSlice<f32>,
        labels: &impl AsDevSlice<u32>,
        mask: &impl AsDevSlice<f32>,
        loss: &mut impl AsDevSliceMut<f32>,
        lse: &mut impl AsDevSliceMut<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<()> {
        softmax_xent_forward_online(gpu, logits, labels, mask, loss, lse, rows, vocab)
    }

    /// GPU twin of `ringtrain_kernels::softmax_xent_forward_online`:
    /// `lse[r] = log sum exp(logits[r, :])`, `loss[r] = mask[r] * (lse[r] - logits[r, labels[r]])`
    /// (0 for masked rows).
    pub fn softmax_xent_forward_online(
        gpu: &Gpu,
        logits: &impl AsDevSlice<f32>,
        labels: &impl AsDevSlice<u32>,
        mask: &impl AsDevSlice<f32>,
        loss: &mut impl AsDevSliceMut<f32>,
        lse: &mut impl AsDevSliceMut<f32>,
        rows: usize,
        vocab: usize,
    ) -> Result<()> {
        let (rows32, vocab32, total) = dims(rows, vocab)?;
        let (logits, labels, mask) = (logits.dev_slice(), labels.dev_slice(), mask.dev_slice());
        let (loss, lse) = (loss.dev_slice_mut(), lse.dev_slice_mut());
        check_len("logits", total, logits.len())?;
        check_len("labels", rows, labels.len())?;
        check_len("mask", rows, mask.len())?;
        check_len("loss", rows, loss.len())?;
        check_len("lse", rows, lse.len())?;
        if rows == 0 {
            return Ok(());
        }
        let (kind, config) = variant(gpu, rows, vocab);
        let kernel = if kind == "warp" {
            "softmax_xent_forward_online_warp"
        } else {
            "softmax_xent_forward_online_block"
        };
        let args = [
            gpu.arg("logits", &logits)?,
            gpu.arg("labels", &labels)?,
            gpu.arg("mask", &mask)?,
            gpu.arg_mut("loss", &loss)?,
            gpu.arg_mut("lse", &lse)?,
            KernelArg::U32(rows32),
            KernelArg::U32(vocab32),
        ];
        // SAFETY: pointers from live, length-checked views on this GPU; the
        // label index is bounds-checked in the kernel; outputs are distinct
        // mutable borrows.
        unsafe { gpu.launch(&MODULE, kernel, config, &args) }
    }

    /// GPU twin of `ringtrain_kernels::softmax_xent_backward`, in place:
    /// `logits[r, v] = (exp(logits[r, v] - lse[r]) - [v == labels[r]]) * scale * mask[r]`
    /// (exactly 0 for masked rows).
    pub fn softmax_xent_backward(
        gpu: &Gpu,
        logits: &mut impl AsDevSliceMut<f32>,
        lse: &impl AsDevSlice<f32>,
        labels: &impl AsDevSlice<u32>,
        mask: &impl AsDevSlice<f32>,
        scale: f32,
        rows: usize,
        vocab: usize,
    ) -> Result<()> {
        let (rows32, vocab32, total) = dims(rows, vocab)?;
        let logits = logits.dev_slice_mut();
        let (lse, labels, mask) = (lse.dev_slice(), labels.dev_slice(), mask.dev_slice());
        check_len("logits", total, logits.len())?;
        check_len("lse", rows, lse.len())?;
        check_len("labels", rows, labels.len())?;
        check_len("mask", rows, mask.len())?;
        if rows == 0 {
            return Ok(());
        }
        let (kind, config) = variant(gpu, rows, vocab);
        let kernel = if kind == "warp" {
            "softmax_xent_backward_warp"
        } else {
            "softmax_xent_backward_block"
        };
        let args = [
            gpu.arg_mut("logits", &logits)?,
            gpu.arg("lse", &lse)?,
            gpu.arg("labels", &labels)?,
            gpu.arg("mask", &mask)?,
            KernelArg::F32(scale),
            KernelArg::U32(rows32),
            KernelArg::U32(vocab32),
        ];
        // SAFETY: pointers from live, length-checked views on this GPU; logits
        // is the only written buffer and is borrowed mutably.
        unsafe { gpu.launch(&MODULE, kernel, config, &args) }
    }
}
