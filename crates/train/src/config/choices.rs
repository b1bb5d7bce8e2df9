//! The values a flag chooses between, each parsed from the spellings its flag accepts
//! ([`std::str::FromStr`]; the error names the flag, the value and the accepted values).
//!
//! The LSTM implementation, the encoder direction and the matrix-product precision are
//! the model crate's own [`LstmImpl`], [`EncoderKind`] and [`GemmPrecision`];
//! [`parse_lstm_impl`], [`parse_encoder_kind`] and [`parse_gemm_precision`] read them with
//! their flags' spellings (the seeds' `cudnn_lstm`, `dynamic_rnn` among them).

use std::fmt;
use std::str::FromStr;

use ringtrain_model::{EncoderKind, GemmPrecision, LstmImpl};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Lower case, `-` read as `_`: the form every choice is matched in.
fn normalized(s: &str) -> String {
    s.trim().to_ascii_lowercase().replace('-', "_")
}

macro_rules! choice {
    (
        $(#[$meta:meta])*
        $name:ident, flag = $flag:literal {
            $( $(#[$vmeta:meta])* $variant:ident => $canon:literal $(| $alias:literal)* ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $( $(#[$vmeta])* $variant ),+
        }

        impl $name {
            /// Every accepted canonical spelling, for help texts and errors.
            pub const NAMES: &'static [&'static str] = &[$($canon),+];

            /// The canonical spelling of this value.
            pub fn as_str(self) -> &'static str {
                match self { $( $name::$variant => $canon ),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self> {
                match normalized(s).as_str() {
                    $( $canon $(| $alias)* => Ok($name::$variant), )+
                    _ => Err(Error::invalid(
                        $flag,
                        s,
                        format!("expected one of: {}", Self::NAMES.join(", ")),
                    )),
                }
            }
        }
    };
}

choice! {
    /// Which model to train.
    ModelKind, flag = "--model" {
        /// LSTM encoder-decoder without attention (the seeds' NMT benchmark).
        Nmt => "nmt",
        /// LSTM language model (PTB style).
        Rnnlm => "rnnlm",
    }
}

choice! {
    /// How gradients and parameters are shared between ranks (`--variable-update`).
    VariableUpdate, flag = "--variable-update" {
        /// Every rank keeps a copy; gradients are all-reduced; every rank applies the update.
        Replicated => "replicated" | "horovod",
        /// Parameters are sharded over server ranks that average, update and send back.
        ParameterServer => "parameter_server" | "ps",
        /// No communication at all: the ideal-scaling baseline.
        Independent => "independent",
    }
}

choice! {
    /// Which optimizer updates the parameters.
    OptimizerKind, flag = "--optimizer" {
        /// Adam (PyTorch's definition), the default with learning rate 1e-3.
        Adam => "adam",
        /// Plain stochastic gradient descent.
        Sgd => "sgd",
    }
}

choice! {
    /// Where the model runs.
    DeviceKind, flag = "--device" {
        /// CPU backend (threads from `--threads`).
        Cpu => "cpu",
        /// CUDA backend (needs the `cuda` build feature); device = local rank.
        Cuda => "cuda" | "gpu",
    }
}

choice! {
    /// When the gradient reduction overlaps backward (`--overlap-backward`).
    OverlapMode, flag = "--overlap-backward" {
        /// On for `--device cuda`, off for `--device cpu`, where the rank's compute threads
        /// already use its cores and a reduction thread only takes cycles from backward.
        Auto => "auto",
        /// Always overlap.
        On => "on",
        /// Reduce after backward.
        Off => "off",
    }
}

/// Reads `--encoder-type`: the model crate's names `fused` and `stepwise`, and the
/// seeds' `cudnn_lstm` (or `cudnn`) and `dynamic_rnn`.
///
/// # Errors
/// `InvalidValue` naming the flag, the value and the accepted spellings.
pub fn parse_lstm_impl(s: &str) -> Result<LstmImpl> {
    match normalized(s).as_str() {
        "cudnn_lstm" | "cudnn" => Ok(LstmImpl::Fused),
        "dynamic_rnn" => Ok(LstmImpl::Stepwise),
        name => name.parse().map_err(|_| {
            Error::invalid(
                "--encoder-type",
                s,
                "expected one of: fused (aliases cudnn_lstm, cudnn), stepwise (alias dynamic_rnn)",
            )
        }),
    }
}

/// Reads `--direction`: `uni` or `bi`.
///
/// # Errors
/// `InvalidValue` naming the flag, the value and the accepted spellings.
pub fn parse_encoder_kind(s: &str) -> Result<EncoderKind> {
    normalized(s)
        .parse()
        .map_err(|_| Error::invalid("--direction", s, "expected one of: uni, bi"))
}

/// Reads `--gemm-precision`: `f32`, `f16` or `bf16` (also `fp32`, `fp16`).
///
/// # Errors
/// `InvalidValue` naming the flag, the value and the accepted spellings.
pub fn parse_gemm_precision(s: &str) -> Result<GemmPrecision> {
    let name = normalized(s);
    let name = name
        .strip_prefix("fp")
        .map_or(name.clone(), |bits| format!("f{bits}"));
    name.parse()
        .map_err(|_| Error::invalid("--gemm-precision", s, "expected one of: f32, f16, bf16"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_aliases_and_reject_unknown_with_the_flag_name() {
        assert_eq!(parse_lstm_impl("cudnn_lstm").ok(), Some(LstmImpl::Fused));
        assert_eq!(
            parse_lstm_impl("dynamic-rnn").ok(),
            Some(LstmImpl::Stepwise)
        );
        assert_eq!(parse_encoder_kind("BI").ok(), Some(EncoderKind::Bi));
        assert_eq!(
            "parameter-server".parse::<VariableUpdate>().ok(),
            Some(VariableUpdate::ParameterServer)
        );
        for err in [
            "lstm9".parse::<ModelKind>().err(),
            parse_lstm_impl("gru").err(),
            parse_encoder_kind("sideways").err(),
        ] {
            let err = err.map(|e| e.to_string()).unwrap_or_default();
            assert!(
                err.contains("--") && err.contains("expected one of"),
                "{err}"
            );
        }
        let err = "lstm9".parse::<ModelKind>().err().map(|e| e.to_string());
        let err = err.unwrap_or_default();
        assert!(err.contains("--model") && err.contains("lstm9") && err.contains("rnnlm"));
    }

    #[test]
    fn every_choice_reads_back_its_own_name() {
        for name in ModelKind::NAMES {
            assert_eq!(
                name.parse::<ModelKind>().ok().map(ModelKind::as_str),
                Some(*name)
            );
        }
        for name in OverlapMode::NAMES {
            assert_eq!(
                name.parse::<OverlapMode>().ok().map(OverlapMode::as_str),
                Some(*name)
            );
        }
        for imp in [LstmImpl::Fused, LstmImpl::Stepwise] {
            assert_eq!(parse_lstm_impl(imp.as_str()).ok(), Some(imp));
        }
        for kind in [EncoderKind::Uni, EncoderKind::Bi] {
            assert_eq!(parse_encoder_kind(kind.as_str()).ok(), Some(kind));
        }
        for p in [GemmPrecision::F32, GemmPrecision::F16, GemmPrecision::Bf16] {
            assert_eq!(parse_gemm_precision(p.as_str()).ok(), Some(p));
        }
        assert_eq!(parse_gemm_precision("FP16").ok(), Some(GemmPrecision::F16));
    }
}
