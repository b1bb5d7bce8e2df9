//! What a model needs in memory before it is built: parameters and gradients (counted
//! exactly from the parameter layout) and the forward/backward workspaces at a batch
//! shape (from the same sizes the workspaces are allocated with), so that a
//! configuration too big for the machine fails with the estimate instead of an
//! allocation abort.
//!
//! ```
//! use ringtrain_model::NmtConfig;
//!
//! let est = NmtConfig::benchmark().memory_estimate(64, 30, 30)?;
//! assert!(est.total_bytes() > 4.0 * 2.0 * NmtConfig::benchmark().param_count()? as f64);
//! println!("{est}"); // "about 0.1 GiB: parameters ..., gradients ..., ..."
//! # Ok::<(), ringtrain_model::Error>(())
//! ```

use std::fmt;

use crate::embedding::{EmbeddingWork, ProjectionWork};
use crate::lstm::LstmWork;

/// Bytes of one f32.
const F32_BYTES: f64 = 4.0;

/// One part of an estimate.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryTerm {
    /// What it holds, e.g. `"parameters"`.
    pub what: String,
    /// Its size in bytes (f64: a size that would overflow `usize` is still reported).
    pub bytes: f64,
}

/// An estimate of the memory a run needs, by term.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MemoryEstimate {
    /// The terms, in the order they were added.
    pub terms: Vec<MemoryTerm>,
}

impl MemoryEstimate {
    /// Adds `elements` f32 values for `what`.
    pub fn add_f32(&mut self, what: impl Into<String>, elements: f64) {
        self.add_bytes(what, elements * F32_BYTES);
    }

    /// Adds `bytes` for `what`.
    pub fn add_bytes(&mut self, what: impl Into<String>, bytes: f64) {
        self.terms.push(MemoryTerm {
            what: what.into(),
            bytes,
        });
    }

    /// Adds what 16-bit matrix products hold on the GPU besides the f32 model
    /// (`--gemm-precision f16|bf16`): a 16-bit copy of the weights, counted as every one of
    /// the `params` parameters (a little more than the weights the products read), and
    /// two operand buffers (A and B), each holding the largest activation operand of
    /// `largest_operand` elements at the [`scratch_capacity`] the CUDA backend allocates.
    pub fn add_half_gemm_copies(&mut self, params: f64, largest_operand: f64) {
        const HALF_BYTES: f64 = 2.0;
        // (an f64 past usize saturates, and is then reported as that)
        let capacity = scratch_capacity(largest_operand as usize) as f64;
        self.add_bytes(
            "16-bit GEMM copies",
            HALF_BYTES * params + 2.0 * HALF_BYTES * capacity,
        );
    }

    /// The sum of the terms.
    pub fn total_bytes(&self) -> f64 {
        self.terms.iter().map(|t| t.bytes).sum()
    }

    /// The biggest term.
    pub fn biggest(&self) -> Option<&MemoryTerm> {
        self.terms.iter().max_by(|a, b| a.bytes.total_cmp(&b.bytes))
    }
}

/// `12.3 GiB` (or MiB below one GiB).
pub fn format_bytes(bytes: f64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if bytes >= 1024.0 * MIB {
        format!("{:.1} GiB", bytes / (1024.0 * MIB))
    } else {
        format!("{:.1} MiB", bytes / MIB)
    }
}

impl fmt::Display for MemoryEstimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "about {}:", format_bytes(self.total_bytes()))?;
        for (i, term) in self.terms.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            write!(f, "{sep}{} {}", term.what, format_bytes(term.bytes))?;
        }
        Ok(())
    }
}

/// The elements a reusable scratch buffer is allocated with to hold `len`: the next power
/// of two, so that a buffer grows a few times at most while lengths vary (`len` itself
/// past the largest power of two).
pub fn scratch_capacity(len: usize) -> usize {
    len.checked_next_power_of_two().unwrap_or(len)
}

/// f32 elements of one LSTM layer's workspace (as [`LstmWork::new`] allocates them).
pub(crate) fn lstm_work_elements(hidden: usize, steps: usize, batch: usize) -> f64 {
    LstmWork::<()>::lens(hidden, steps, batch).iter().sum()
}

/// f32 elements of an embedding lookup's workspace.
pub(crate) fn embedding_work_elements(rows: usize, width: usize) -> f64 {
    EmbeddingWork::<()>::lens(rows, width).iter().sum()
}

/// f32 elements of the projection and loss workspace for `rows` rows: one chunk of
/// logits, the per-row loss terms and the kernel's gradient.
pub(crate) fn projection_work_elements(rows: usize, hidden: usize, vocab: usize) -> f64 {
    ProjectionWork::<()>::lens(rows, hidden, vocab).iter().sum()
}

/// Elements of the largest chunk of logits (and of their gradient) for `rows` rows of
/// `vocab` columns.
pub(crate) fn logits_chunk_elements(rows: usize, vocab: usize) -> f64 {
    crate::embedding::logits_chunk_rows(rows, vocab) as f64 * vocab as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuBackend, EncoderKind, LmConfig, LstmImpl, Model, NmtConfig, NmtModel, RnnLm};

    #[test]
    fn half_gemm_copies_are_the_weights_and_two_power_of_two_operand_buffers() {
        let mut est = MemoryEstimate::default();
        est.add_half_gemm_copies(1000.0, 16384.0);
        est.add_half_gemm_copies(1000.0, 16385.0);
        est.add_half_gemm_copies(0.0, 0.0);
        let bytes: Vec<f64> = est.terms.iter().map(|t| t.bytes).collect();
        // (an empty operand still gets a one-element buffer, as the backend allocates)
        assert_eq!(bytes, [2000.0 + 4.0 * 16384.0, 2000.0 + 4.0 * 32768.0, 4.0]);
        assert!(est.terms.iter().all(|t| t.what == "16-bit GEMM copies"));
        // A chunk of the logits' gradient is the largest operand at a large vocabulary,
        // the gates' at a small one; the chunk no longer grows with the batch past
        // LOGITS_CHUNK_ELEMENTS.
        let nmt = NmtConfig {
            tgt_vocab: 50_000,
            hidden: 512,
            ..NmtConfig::benchmark()
        };
        assert_eq!(
            nmt.largest_gemm_operand(8, 100, 101),
            8.0 * 101.0 * 50_000.0
        );
        let chunk = (crate::embedding::LOGITS_CHUNK_ELEMENTS / 50_000) as f64 * 50_000.0;
        assert_eq!(nmt.largest_gemm_operand(384, 100, 101), chunk);
        assert_eq!(nmt.largest_gemm_operand(1024, 100, 101), chunk);
        // ...and past a large enough batch the gates are the largest.
        assert_eq!(
            nmt.largest_gemm_operand(4096, 100, 101),
            4096.0 * 101.0 * 2048.0
        );
        let small = NmtConfig {
            tgt_vocab: 32,
            emb: 16,
            hidden: 16,
            ..NmtConfig::benchmark()
        };
        assert_eq!(small.largest_gemm_operand(64, 4, 4), 64.0 * 4.0 * 64.0);
        let lm = LmConfig {
            vocab: 40,
            emb: 16,
            hidden: 20,
            ..LmConfig::ptb()
        };
        assert_eq!(lm.largest_gemm_operand(8, 10), 80.0 * 80.0);
    }

    #[test]
    fn workspace_lengths_are_what_is_allocated() {
        let Ok(be) = CpuBackend::new(1) else {
            panic!("no CPU backend");
        };
        let Ok(w) = LstmWork::new(&be, 5, 7, 3) else {
            panic!("no workspace");
        };
        let allocated = w.allocated();
        assert_eq!(lstm_work_elements(5, 7, 3), allocated as f64);
        let Ok(e) = EmbeddingWork::new(&be, 11, 4) else {
            panic!("no workspace");
        };
        assert_eq!(
            embedding_work_elements(11, 4),
            (e.out.len() + e.dx.len()) as f64
        );
        assert_eq!(
            projection_work_elements(11, 5, 9),
            (11 * 9 + 2 * 11 + 5 * 9) as f64
        );
        // A vocabulary of a million takes chunks of 268 rows.
        let rows = crate::embedding::LOGITS_CHUNK_ELEMENTS / 1_000_000;
        assert_eq!(rows, 268);
        assert_eq!(
            projection_work_elements(10_000, 5, 1_000_000),
            (rows * 1_000_000 + 2 * 10_000 + 5 * 1_000_000) as f64
        );
    }

    #[test]
    fn parameter_counts_are_the_models_and_sizes_never_overflow() {
        let nmt = NmtConfig {
            src_vocab: 31,
            tgt_vocab: 29,
            emb: 6,
            hidden: 5,
            layers: 2,
            encoder: EncoderKind::Bi,
            lstm: LstmImpl::Stepwise,
            ..NmtConfig::benchmark()
        };
        let Ok(be) = CpuBackend::new(1) else {
            panic!("no CPU backend");
        };
        let built = NmtModel::new(be, nmt.clone(), 1).map(|m| m.params().len());
        assert_eq!(nmt.param_count().ok(), built.ok());
        // Concatenated bi layers: the upper layers' W_ih is 2H rows tall.
        let concat = NmtConfig {
            layers: 4,
            bi_layer_input: crate::BiLayerInput::Concat,
            ..nmt.clone()
        };
        let own = NmtConfig {
            bi_layer_input: crate::BiLayerInput::Own,
            ..concat.clone()
        };
        let extra = concat.param_count().ok().zip(own.param_count().ok());
        assert_eq!(extra.map(|(c, o)| c - o), Some(2 * 5 * 4 * 5));
        let Ok(be) = CpuBackend::new(1) else {
            panic!("no CPU backend");
        };
        let built = NmtModel::new(be, concat.clone(), 1).map(|m| m.params().len());
        assert_eq!(concat.param_count().ok(), built.ok());
        // Source lengths add the step masks: keep and hold [rows, H], their columns, ones.
        let on = NmtConfig {
            source_lengths: crate::SourceLengths::On,
            ..nmt.clone()
        };
        let (batch, src_len) = (3.0, 7.0);
        let masks = 4.0 * (2.0 * batch * src_len * 5.0 + 2.0 * batch * src_len + 5.0);
        let total = |c: &NmtConfig| {
            c.memory_estimate(3, 7, 4)
                .map(|e| e.total_bytes())
                .unwrap_or_default()
        };
        assert_eq!(total(&on) - total(&nmt), masks);
        let lm = LmConfig {
            vocab: 40,
            emb: 6,
            hidden: 5,
            layers: 2,
            ..LmConfig::ptb()
        };
        let Ok(be) = CpuBackend::new(1) else {
            panic!("no CPU backend");
        };
        let built = RnnLm::new(be, lm.clone(), 1).map(|m| m.params().len());
        assert_eq!(lm.param_count().ok(), built.ok());

        let est = lm.memory_estimate(8, 10).unwrap_or_default();
        let params = lm.param_count().unwrap_or_default() as f64 * 4.0;
        assert_eq!(est.terms[0].bytes, params);
        let carried = est.terms.iter().find(|t| t.what == "carried LSTM state");
        assert_eq!(carried.map(|t| t.bytes), Some(4.0 * 2.0 * 2.0 * 8.0 * 5.0));
        assert!(est.to_string().starts_with("about "), "{est}");
        assert_eq!(
            est.biggest().map(|t| t.what.as_str()),
            Some("LSTM activations")
        );

        // Sizes far past any machine: an error or a finite estimate, never a panic.
        let huge = NmtConfig {
            emb: 1 << 31,
            hidden: 1 << 31,
            ..nmt
        };
        assert!(huge.param_count().is_err());
        let wide = LmConfig {
            vocab: 5_000_000,
            emb: 4096,
            hidden: 4096,
            ..lm
        };
        let est = wide.memory_estimate(1 << 40, 1 << 20).unwrap_or_default();
        assert!(est.total_bytes().is_finite() && est.total_bytes() > 1e20);
    }
}
