//! Tiny configurations and random batches shared by the integration tests.
#![allow(dead_code)]

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use ringtrain_model::{
    BiLayerInput, CpuBackend, EncoderKind, LmBatchView, LmConfig, LstmImpl, NmtBatchView,
    NmtConfig, SourceLengths,
};

/// Owned data behind an [`NmtBatchView`].
pub struct NmtData {
    pub batch: usize,
    pub src_len: usize,
    pub tgt_len: usize,
    pub src: Vec<u32>,
    pub tgt_in: Vec<u32>,
    pub tgt_out: Vec<u32>,
    pub mask: Vec<f32>,
    /// Real source tokens per sentence: sentence `b` has `src_len - b % src_len`, the
    /// rest of its column is padding (random ids, like the real tokens).
    pub src_lengths: Vec<usize>,
}

impl NmtData {
    /// Random ids; the last target step of sentence 0 is padding (mask 0).
    pub fn random(c: &NmtConfig, batch: usize, src_len: usize, tgt_len: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let src = (0..src_len * batch)
            .map(|_| rng.gen_range(0..c.src_vocab as u32))
            .collect();
        let tgt_in = (0..tgt_len * batch)
            .map(|_| rng.gen_range(0..c.tgt_vocab as u32))
            .collect();
        let tgt_out = (0..tgt_len * batch)
            .map(|_| rng.gen_range(0..c.tgt_vocab as u32))
            .collect();
        let mut mask = vec![1.0f32; tgt_len * batch];
        mask[(tgt_len - 1) * batch] = 0.0;
        NmtData {
            batch,
            src_len,
            tgt_len,
            src,
            tgt_in,
            tgt_out,
            mask,
            src_lengths: (0..batch).map(|b| src_len - b % src_len).collect(),
        }
    }

    pub fn view(&self) -> NmtBatchView<'_> {
        NmtBatchView {
            batch: self.batch,
            src_len: self.src_len,
            tgt_len: self.tgt_len,
            src: &self.src,
            tgt_in: &self.tgt_in,
            tgt_out: &self.tgt_out,
            tgt_mask: &self.mask,
            src_lengths: Some(&self.src_lengths),
        }
    }
}

/// Owned data behind an [`LmBatchView`].
pub struct LmData {
    pub batch: usize,
    pub len: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub mask: Vec<f32>,
}

impl LmData {
    pub fn random(c: &LmConfig, batch: usize, len: usize, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let inputs = (0..len * batch)
            .map(|_| rng.gen_range(0..c.vocab as u32))
            .collect();
        let targets = (0..len * batch)
            .map(|_| rng.gen_range(0..c.vocab as u32))
            .collect();
        let mut mask = vec![1.0f32; len * batch];
        mask[len * batch - 1] = 0.0;
        LmData {
            batch,
            len,
            inputs,
            targets,
            mask,
        }
    }

    pub fn view(&self) -> LmBatchView<'_> {
        LmBatchView {
            batch: self.batch,
            len: self.len,
            inputs: &self.inputs,
            targets: &self.targets,
            mask: &self.mask,
            first_in_epoch: true,
        }
    }
}

/// A tiny NMT config. `init_scale` 0.5 makes gradients large enough to check well.
pub fn tiny_nmt(encoder: EncoderKind, layers: usize, lstm: LstmImpl) -> NmtConfig {
    NmtConfig {
        src_vocab: 7,
        tgt_vocab: 6,
        emb: 5,
        hidden: 4,
        layers,
        encoder,
        lstm,
        source_lengths: SourceLengths::Off,
        bi_layer_input: BiLayerInput::Own,
        init_scale: 0.5,
        forget_bias: 1.0,
    }
}

/// A tiny RNNLM config.
pub fn tiny_lm(layers: usize, lstm: LstmImpl) -> LmConfig {
    LmConfig {
        vocab: 7,
        emb: 5,
        hidden: 4,
        layers,
        lstm,
        init_scale: 0.5,
        forget_bias: 1.0,
    }
}

pub fn cpu(threads: usize) -> CpuBackend {
    match CpuBackend::new(threads) {
        Ok(b) => b,
        Err(e) => panic!("cpu backend: {e}"),
    }
}
