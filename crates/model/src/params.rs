//! The named, ordered parameter list and its flat buffer layout.

use std::ops::Range;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{invalid_value, Result};

/// How a tensor is initialised.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamInit {
    /// Uniform in `[-scale, scale)`.
    Uniform {
        /// Half-width of the interval.
        scale: f32,
    },
    /// LSTM bias `[4H]`: zeros, except the forget block `[H, 2H)` = `forget_bias`.
    LstmBias {
        /// Hidden units H.
        hidden: usize,
        /// Value of the forget block.
        forget_bias: f32,
    },
}

/// One parameter tensor inside the flat buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamEntry {
    /// Unique name, `/`-separated (`decoder/layer_1/w_hh`).
    pub name: String,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// First element in the flat parameter (and gradient) buffer.
    pub offset: usize,
    /// Number of elements (product of `shape`).
    pub len: usize,
    /// Initialisation.
    pub init: ParamInit,
}

impl ParamEntry {
    /// `offset..offset + len`.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// The ordered parameter list of a model: tensors lie back to back in one flat buffer,
/// in the order the backward pass finishes their gradients.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParamLayout {
    entries: Vec<ParamEntry>,
    total_len: usize,
}

impl ParamLayout {
    /// An empty layout.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a tensor; returns its offset.
    ///
    /// # Errors
    /// `InvalidValue` when `name` is already used or the shape has a zero dimension.
    pub fn push(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        init: ParamInit,
    ) -> Result<usize> {
        let name = name.into();
        if self.get(&name).is_some() {
            return Err(invalid_value(
                "parameter name",
                &name,
                "names must be unique",
            ));
        }
        let len = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|&len| self.total_len.checked_add(len).is_some())
            .ok_or_else(|| {
                invalid_value(
                    "parameter shape",
                    format!("{name} {shape:?}"),
                    "the parameter count does not fit in memory addresses: use smaller sizes",
                )
            })?;
        if len == 0 {
            return Err(invalid_value(
                "parameter shape",
                format!("{name} {shape:?}"),
                "every dimension must be at least 1",
            ));
        }
        let offset = self.total_len;
        self.entries.push(ParamEntry {
            name,
            shape: shape.to_vec(),
            offset,
            len,
            init,
        });
        self.total_len += len;
        Ok(offset)
    }

    /// The tensors, in buffer order.
    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    /// Elements in the flat buffer.
    pub fn total_len(&self) -> usize {
        self.total_len
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// Host values of every parameter, drawn from a ChaCha8 stream seeded with `seed`
    /// (tensor by tensor in buffer order).
    ///
    /// # Errors
    /// A kernel error if an LSTM bias entry's length is not `4 * hidden`.
    pub fn initial_values(&self, seed: u64) -> Result<Vec<f32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut values = vec![0.0f32; self.total_len];
        for e in &self.entries {
            let dst = &mut values[e.range()];
            match e.init {
                ParamInit::Uniform { scale } => {
                    if scale > 0.0 {
                        dst.iter_mut()
                            .for_each(|x| *x = rng.gen_range(-scale..scale));
                    }
                }
                ParamInit::LstmBias {
                    hidden,
                    forget_bias,
                } => {
                    ringtrain_kernels::init_lstm_bias(dst, hidden, forget_bias)?;
                }
            }
        }
        Ok(values)
    }
}
