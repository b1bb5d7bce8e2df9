//! Checkpoint files: parameters, optimizer state and the run's config, written atomically.
//!
//! Layout (little-endian):
//! ```text
//! magic   8 bytes  b"RTCKPT\r\n"
//! version u32      CHECKPOINT_VERSION
//! len     u64      length of the JSON header
//! header  len      JSON: config, step, parameter count, optimizer kind, loss scaler,
//!                  every rank's input position
//! params  4·n      f32 parameters
//! state   4·2n     Adam's m then v (absent for SGD)
//! crc32   u32      crc32 (IEEE) of every byte before it
//! ```
//! Writes go through [`crate::outputs::write_atomically`] (a temporary file of the
//! writer's own, fsync, rename over `FILE`), so a crash or a stop leaves the old
//! checkpoint or the new one, never half of one, and concurrent writers never mix.
//!
//! Version 3 added the input positions ([`InputPosition`], one per rank: the batch after
//! the last one each rank trained on), so that a resumed run reads on where the
//! checkpointed one stopped; older versions are refused with
//! [`Error::CheckpointVersion`].

use std::fs;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::input::InputPosition;
use crate::optimizer::{LossScaler, OptimizerState};

/// First bytes of every checkpoint.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"RTCKPT\r\n";
/// Format version this build writes and reads.
pub const CHECKPOINT_VERSION: u32 = 3;

/// Everything needed to continue a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The configuration of the run that wrote it.
    pub config: TrainConfig,
    /// Steps completed.
    pub step: u64,
    /// Flat parameters.
    pub params: Vec<f32>,
    /// Optimizer state.
    pub optimizer: OptimizerState,
    /// Loss scaler (fp16 gradients only).
    pub loss_scaler: Option<LossScaler>,
    /// Every rank's input position after the last batch it trained on, by rank (`None`
    /// for a rank that reads no data or an input that knows no position).
    pub input: Vec<Option<InputPosition>>,
}

#[derive(Serialize, Deserialize)]
struct Header {
    config: TrainConfig,
    step: u64,
    param_count: u64,
    adam_step: Option<u32>,
    loss_scaler: Option<LossScaler>,
    input: Vec<Option<InputPosition>>,
}

fn io_err<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        action,
        path: path.to_path_buf(),
        source,
    }
}

impl Checkpoint {
    /// Serialises to bytes (the file's exact content).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let adam_step = match &self.optimizer {
            OptimizerState::Sgd => None,
            OptimizerState::Adam { m, v, step } => {
                if m.len() != self.params.len() || v.len() != self.params.len() {
                    return Err(Error::Internal(format!(
                        "Adam state ({} / {}) does not match {} parameters",
                        m.len(),
                        v.len(),
                        self.params.len()
                    )));
                }
                Some(*step)
            }
        };
        let header = Header {
            config: self.config.clone(),
            step: self.step,
            param_count: self.params.len() as u64,
            adam_step,
            loss_scaler: self.loss_scaler,
            input: self.input.clone(),
        };
        let json = serde_json::to_vec(&header).map_err(|source| Error::Json {
            action: "serialising the checkpoint header",
            source,
        })?;
        let floats = self.params.len() * if adam_step.is_some() { 3 } else { 1 };
        let mut out = Vec::with_capacity(24 + json.len() + 4 * floats);
        out.extend_from_slice(&CHECKPOINT_MAGIC);
        out.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        let mut push = |xs: &[f32]| {
            for x in xs {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
        push(&self.params);
        if let OptimizerState::Adam { m, v, .. } = &self.optimizer {
            push(m);
            push(v);
        }
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        Ok(out)
    }

    /// Parses bytes; `path` only names the source in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self> {
        let corrupt = |reason: String| Error::CheckpointCorrupt {
            path: path.to_path_buf(),
            reason,
        };
        if bytes.len() < 8 || bytes[..8] != CHECKPOINT_MAGIC {
            return Err(corrupt(
                "it does not start with the ringtrain checkpoint magic number".into(),
            ));
        }
        if bytes.len() < 24 {
            return Err(corrupt(format!("it is truncated ({} bytes)", bytes.len())));
        }
        let (body, crc_bytes) = bytes.split_at(bytes.len() - 4);
        let stored = u32::from_le_bytes([crc_bytes[0], crc_bytes[1], crc_bytes[2], crc_bytes[3]]);
        let version = u32::from_le_bytes([body[8], body[9], body[10], body[11]]);
        let computed = crc32fast::hash(body);
        if computed != stored {
            return Err(corrupt(format!(
                "checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the file was damaged or truncated"
            )));
        }
        // After the checksum: a damaged version field is damage, not an old file.
        if version != CHECKPOINT_VERSION {
            return Err(Error::CheckpointVersion {
                path: path.to_path_buf(),
                found: version,
                expected: CHECKPOINT_VERSION,
            });
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&body[12..20]);
        let json_len = u64::from_le_bytes(len_bytes) as usize;
        let rest = &body[20..];
        if json_len > rest.len() {
            return Err(corrupt(format!(
                "header length {json_len} exceeds the file"
            )));
        }
        let header: Header = serde_json::from_slice(&rest[..json_len])
            .map_err(|e| corrupt(format!("header is not valid: {e}")))?;
        let data = &rest[json_len..];
        let n = header.param_count as usize;
        let sections = if header.adam_step.is_some() { 3 } else { 1 };
        if data.len() != 4 * n * sections {
            return Err(corrupt(format!(
                "expected {} bytes of tensors for {n} parameters, found {}",
                4 * n * sections,
                data.len()
            )));
        }
        let read = |k: usize| -> Vec<f32> {
            data[4 * n * k..4 * n * (k + 1)]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let params = read(0);
        let optimizer = match header.adam_step {
            None => OptimizerState::Sgd,
            Some(step) => OptimizerState::Adam {
                m: read(1),
                v: read(2),
                step,
            },
        };
        Ok(Checkpoint {
            config: header.config,
            step: header.step,
            params,
            optimizer,
            loss_scaler: header.loss_scaler,
            input: header.input,
        })
    }

    /// Writes atomically (see [`crate::outputs::write_atomically`]).
    ///
    /// # Errors
    /// [`Error::Io`] naming the file; [`Error::Interrupted`] on SIGINT/SIGTERM.
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = self.to_bytes()?;
        crate::outputs::write_atomically(path, &bytes, "writing checkpoint")
    }

    /// Reads only the header of a checkpoint file: the config of the run that wrote it and
    /// its step (the tensors and the checksum are not read).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read, [`Error::CheckpointCorrupt`] when it
    /// does not start like a checkpoint of this version.
    pub fn read_header(path: &Path) -> Result<(TrainConfig, u64)> {
        let corrupt = |reason: String| Error::CheckpointCorrupt {
            path: path.to_path_buf(),
            reason,
        };
        let mut file = fs::File::open(path).map_err(io_err("reading checkpoint", path))?;
        let mut start = [0u8; 20];
        file.read_exact(&mut start)
            .map_err(|_| corrupt("it is shorter than a checkpoint header".into()))?;
        if start[..8] != CHECKPOINT_MAGIC {
            return Err(corrupt(
                "it does not start with the ringtrain checkpoint magic number".into(),
            ));
        }
        let version = u32::from_le_bytes([start[8], start[9], start[10], start[11]]);
        if version != CHECKPOINT_VERSION {
            return Err(corrupt(format!(
                "format version {version} is not the version {CHECKPOINT_VERSION} this build reads"
            )));
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&start[12..20]);
        let json_len = u64::from_le_bytes(len_bytes);
        let file_len = file
            .metadata()
            .map_err(io_err("reading checkpoint", path))?
            .len();
        if json_len > file_len {
            return Err(corrupt(format!(
                "header length {json_len} exceeds the file"
            )));
        }
        let mut json = Vec::new();
        file.take(json_len)
            .read_to_end(&mut json)
            .map_err(io_err("reading checkpoint", path))?;
        let header: Header = serde_json::from_slice(&json)
            .map_err(|e| corrupt(format!("header is not valid: {e}")))?;
        Ok((header.config, header.step))
    }

    /// Reads and verifies a checkpoint file.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = fs::read(path).map_err(io_err("reading checkpoint", path))?;
        Self::from_bytes(&bytes, path)
    }

    /// Checks that this checkpoint can continue a run with `config` and `param_count`
    /// parameters; the error names the first field that differs.
    pub fn check_compatible(
        &self,
        config: &TrainConfig,
        param_count: usize,
        path: &Path,
    ) -> Result<()> {
        let (now, then) = (&config.model, &self.config.model);
        let fields: [(&str, String, String); 10] = [
            ("--model", now.model.to_string(), then.model.to_string()),
            (
                "--encoder-type",
                now.encoder_type.to_string(),
                then.encoder_type.to_string(),
            ),
            (
                "--direction",
                now.direction.to_string(),
                then.direction.to_string(),
            ),
            // A checkpoint written before these options existed holds the defaults' model.
            (
                "--source-lengths",
                now.source_lengths.unwrap_or_default().to_string(),
                then.source_lengths.unwrap_or_default().to_string(),
            ),
            (
                "--bi-layer-input",
                now.bi_layer_input.unwrap_or_default().to_string(),
                then.bi_layer_input.unwrap_or_default().to_string(),
            ),
            (
                "--num-encoder-layers",
                now.num_encoder_layers.to_string(),
                then.num_encoder_layers.to_string(),
            ),
            (
                "--num-decoder-layers",
                now.num_decoder_layers.to_string(),
                then.num_decoder_layers.to_string(),
            ),
            (
                "--num-units",
                now.num_units.to_string(),
                then.num_units.to_string(),
            ),
            (
                "--optimizer",
                config.run.optimizer.to_string(),
                self.config.run.optimizer.to_string(),
            ),
            (
                "parameter count",
                param_count.to_string(),
                self.params.len().to_string(),
            ),
        ];
        for (field, expected, found) in fields {
            if expected != found {
                return Err(Error::CheckpointMismatch {
                    path: path.to_path_buf(),
                    field: field.to_string(),
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        let mut config = TrainConfig::default();
        config.run.seed = 9;
        Checkpoint {
            config,
            step: 12,
            params: vec![1.5, -2.0, 3.25],
            optimizer: OptimizerState::Adam {
                m: vec![0.1, 0.2, 0.3],
                v: vec![0.01, 0.02, 0.03],
                step: 12,
            },
            loss_scaler: Some(LossScaler::default()),
            input: vec![
                Some(InputPosition {
                    kind: crate::input::InputKind::Translation,
                    seed: 5,
                    workers: 2,
                    rank: 0,
                    batch_size: 4,
                    stream: crate::input::StreamPosition::Epoch(ringtrain_data::EpochPosition {
                        epoch: 1,
                        batch: 7,
                    }),
                }),
                None,
                Some(InputPosition {
                    kind: crate::input::InputKind::SyntheticNmt,
                    seed: u64::MAX,
                    workers: 3,
                    rank: 2,
                    batch_size: 1,
                    stream: crate::input::StreamPosition::Synthetic(
                        ringtrain_data::SyntheticPosition {
                            batches: 9,
                            word_pos: (1u128 << 66) + 5,
                        },
                    ),
                }),
            ],
        }
    }

    #[test]
    fn round_trip_and_every_flipped_byte_is_detected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.ckpt");
        let ck = sample();
        ck.save(&path).unwrap();
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
        assert_eq!(Checkpoint::load(&path).unwrap(), ck);
        assert_eq!(
            Checkpoint::read_header(&path).unwrap(),
            (ck.config.clone(), ck.step)
        );
        let bytes = fs::read(&path).unwrap();
        for i in (0..bytes.len()).step_by(7) {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            let err = Checkpoint::from_bytes(&bad, &path).unwrap_err();
            assert!(
                matches!(err, Error::CheckpointCorrupt { .. }),
                "byte {i}: {err}"
            );
        }
        let err = Checkpoint::from_bytes(&bytes[..bytes.len() / 2], &path).unwrap_err();
        assert!(err.to_string().contains("corrupt"), "{err}");
    }

    #[test]
    fn an_older_version_is_refused_naming_both_versions() {
        let ck = sample();
        let mut bytes = ck.to_bytes().unwrap();
        bytes[8..12].copy_from_slice(&2u32.to_le_bytes());
        let body = bytes.len() - 4;
        let crc = crc32fast::hash(&bytes[..body]);
        bytes[body..].copy_from_slice(&crc.to_le_bytes());
        let err = Checkpoint::from_bytes(&bytes, Path::new("old.ckpt")).unwrap_err();
        assert!(
            matches!(err, Error::CheckpointVersion { found: 2, .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("old.ckpt") && msg.contains("version 2") && msg.contains("version 3"),
            "{msg}"
        );
    }

    #[test]
    fn mismatch_names_the_field() {
        let ck = sample();
        let mut cfg = ck.config.clone();
        cfg.model.num_units = 99;
        let err = ck
            .check_compatible(&cfg, 3, Path::new("x.ckpt"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--num-units") && err.contains("99"), "{err}");
        let err = ck
            .check_compatible(&ck.config, 4, Path::new("x.ckpt"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("parameter count"), "{err}");
        ck.check_compatible(&ck.config, 3, Path::new("x.ckpt"))
            .unwrap();
    }
}
