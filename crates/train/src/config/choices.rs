//! The values a flag chooses between, each parsed from the spellings its flag accepts
//! ([`std::str::FromStr`]; the error names the flag, the value and the accepted values).
//!
//! The encoder direction, the model's semantic options and the matrix-product precision
//! are the model crate's own [`EncoderKind`], [`SourceLengths`], [`BiLayerInput`] and
//! [`GemmPrecision`]; [`parse_encoder_kind`], [`parse_source_lengths`],
//! [`parse_bi_layer_input`] and [`parse_gemm_precision`] read them with their flags'
//! spellings. [`EncoderType`] is `--encoder-type`: an LSTM implementation ([`LstmImpl`])
//! or one of the seeds' names, which also select the seeds' model semantics.

use std::fmt;
use std::str::FromStr;

use ringtrain_model::{BiLayerInput, EncoderKind, GemmPrecision, LstmImpl, SourceLengths};
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

choice! {
    /// The order a pipeline stage runs its micro-batches' passes in (`--pipeline-schedule`).
    PipelineSchedule, flag = "--pipeline-schedule" {
        /// GPipe's fill-drain: every forward, then every backward.
        Gpipe => "gpipe",
        /// One forward, one backward: the same bubble, at most `stages` micro-batches'
        /// activations in flight.
        OneFOneB => "1f1b",
    }
}

choice! {
    /// How the default pipeline split balances the stages (`--pipeline-balance`).
    PipelineBalance, flag = "--pipeline-balance" {
        /// The split whose largest stage holds the fewest parameters.
        Params => "params",
        /// The split whose slowest stage takes the least time, from a forward and
        /// backward of each unit timed on a warm-up micro-batch on rank 0.
        Time => "time",
    }
}

choice! {
    /// `--encoder-type`: the LSTM implementation alone (`fused`, `stepwise`; the model's
    /// semantics come from `--source-lengths` and `--bi-layer-input`), or a seed's name,
    /// which selects the seed's whole model.
    EncoderType, flag = "--encoder-type" {
        /// The fused (cuDNN-style) implementation.
        Fused => "fused",
        /// The stepwise (per step, per gate) implementation.
        Stepwise => "stepwise",
        /// The seeds' `cudnn_lstm`: fused, padding processed (`--source-lengths off`), bi
        /// layers reading both directions (`--bi-layer-input concat`).
        CudnnLstm => "cudnn_lstm" | "cudnn",
        /// The seeds' `dynamic_rnn`: stepwise, `--source-lengths on`, `--bi-layer-input own`.
        DynamicRnn => "dynamic_rnn",
    }
}

impl EncoderType {
    /// The LSTM implementation it runs.
    pub fn lstm_impl(self) -> LstmImpl {
        match self {
            EncoderType::Fused | EncoderType::CudnnLstm => LstmImpl::Fused,
            EncoderType::Stepwise | EncoderType::DynamicRnn => LstmImpl::Stepwise,
        }
    }

    /// The model semantics a seed's name selects; `None` for `fused` and `stepwise`.
    pub fn seed_semantics(self) -> Option<(SourceLengths, BiLayerInput)> {
        match self {
            EncoderType::Fused | EncoderType::Stepwise => None,
            EncoderType::CudnnLstm => Some((SourceLengths::Off, BiLayerInput::Concat)),
            EncoderType::DynamicRnn => Some((SourceLengths::On, BiLayerInput::Own)),
        }
    }
}

impl From<LstmImpl> for EncoderType {
    fn from(imp: LstmImpl) -> Self {
        match imp {
            LstmImpl::Fused => EncoderType::Fused,
            LstmImpl::Stepwise => EncoderType::Stepwise,
        }
    }
}

/// Reads `--source-lengths`: `on` or `off`.
///
/// # Errors
/// `InvalidValue` naming the flag, the value and the accepted spellings.
pub fn parse_source_lengths(s: &str) -> Result<SourceLengths> {
    normalized(s)
        .parse()
        .map_err(|_| Error::invalid("--source-lengths", s, "expected one of: on, off"))
}

/// Reads `--bi-layer-input`: `concat` or `own`.
///
/// # Errors
/// `InvalidValue` naming the flag, the value and the accepted spellings.
pub fn parse_bi_layer_input(s: &str) -> Result<BiLayerInput> {
    normalized(s)
        .parse()
        .map_err(|_| Error::invalid("--bi-layer-input", s, "expected one of: concat, own"))
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
        assert_eq!(
            "cudnn".parse::<EncoderType>().ok(),
            Some(EncoderType::CudnnLstm)
        );
        assert_eq!(
            "dynamic-rnn".parse::<EncoderType>().ok(),
            Some(EncoderType::DynamicRnn)
        );
        assert_eq!(parse_source_lengths("ON").ok(), Some(SourceLengths::On));
        assert_eq!(
            parse_bi_layer_input("Concat").ok(),
            Some(BiLayerInput::Concat)
        );
        assert_eq!(parse_encoder_kind("BI").ok(), Some(EncoderKind::Bi));
        assert_eq!(
            "parameter-server".parse::<VariableUpdate>().ok(),
            Some(VariableUpdate::ParameterServer)
        );
        for err in [
            "lstm9".parse::<ModelKind>().err(),
            "gru".parse::<EncoderType>().err(),
            parse_source_lengths("yes").err(),
            parse_bi_layer_input("both").err(),
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
        for name in EncoderType::NAMES {
            assert_eq!(
                name.parse::<EncoderType>().ok().map(EncoderType::as_str),
                Some(*name)
            );
        }
        for imp in [LstmImpl::Fused, LstmImpl::Stepwise] {
            assert_eq!(EncoderType::from(imp).lstm_impl(), imp);
        }
        for sl in [SourceLengths::Off, SourceLengths::On] {
            assert_eq!(parse_source_lengths(sl.as_str()).ok(), Some(sl));
        }
        for bi in [BiLayerInput::Own, BiLayerInput::Concat] {
            assert_eq!(parse_bi_layer_input(bi.as_str()).ok(), Some(bi));
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
