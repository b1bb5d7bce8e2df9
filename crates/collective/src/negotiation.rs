//! Agreement on which tensors are ready everywhere.
//!
//! Every cycle each rank all-gathers one [`CycleMessage`]: the tensors submitted on it since
//! the last cycle (name, dtype, length), whether it is shutting down, and (rank 0 only, as
//! coordinator) the tensors whose stall timeout ran out. Every rank feeds the same gathered
//! messages, in rank order, into its own [`ReadyTable`], so every rank takes the same
//! decisions in the same order without further messages.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// One submitted tensor, as announced to the other ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Announcement {
    pub name: String,
    pub dtype: DType,
    pub len: u64,
}

/// What one rank says in one cycle.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CycleMessage {
    pub shutting_down: bool,
    pub announcements: Vec<Announcement>,
    /// Tensors to fail as stalled (only rank 0's list is acted on).
    pub fail: Vec<String>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    rank: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let Some(end) = end else {
            return Err(Error::Transport {
                rank: self.rank,
                detail: format!(
                    "negotiation message of {} bytes is truncated at byte {}: ranks run different versions of ringtrain?",
                    self.bytes.len(),
                    self.at
                ),
            });
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        let rank = self.rank;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|e| Error::Transport {
            rank,
            detail: format!("negotiation message holds a tensor name that is not UTF-8: {e}"),
        })
    }
}

impl CycleMessage {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.announcements.len() * 32);
        out.push(u8::from(self.shutting_down));
        out.extend_from_slice(&(self.announcements.len() as u32).to_le_bytes());
        for a in &self.announcements {
            put_str(&mut out, &a.name);
            out.push(a.dtype.code());
            out.extend_from_slice(&a.len.to_le_bytes());
        }
        out.extend_from_slice(&(self.fail.len() as u32).to_le_bytes());
        for f in &self.fail {
            put_str(&mut out, f);
        }
        out
    }

    /// Decodes a message; `rank` is the receiving rank (for error messages).
    pub(crate) fn decode(bytes: &[u8], rank: usize) -> Result<CycleMessage> {
        let mut r = Reader { bytes, at: 0, rank };
        let shutting_down = r.u8()? != 0;
        let n = r.u32()? as usize;
        let mut announcements = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let name = r.string()?;
            let code = r.u8()?;
            let dtype = DType::from_code(code).ok_or_else(|| Error::Transport {
                rank,
                detail: format!("negotiation message names unknown dtype code {code}"),
            })?;
            let len = r.u64()?;
            announcements.push(Announcement { name, dtype, len });
        }
        let n = r.u32()? as usize;
        let mut fail = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            fail.push(r.string()?);
        }
        Ok(CycleMessage {
            shutting_down,
            announcements,
            fail,
        })
    }
}

/// Why a tensor cannot be reduced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Ranks announced different dtypes or lengths; the text lists them.
    Mismatch(String),
    /// Some ranks never announced it (timed out, or they shut down).
    Stalled {
        submitted: Vec<usize>,
        missing: Vec<usize>,
        waited: Duration,
    },
}

impl Failure {
    pub(crate) fn to_error(&self, name: &str) -> Error {
        match self {
            Failure::Mismatch(detail) => Error::TensorMismatch {
                name: name.to_owned(),
                detail: detail.clone(),
            },
            Failure::Stalled {
                submitted,
                missing,
                waited,
            } => Error::Stalled {
                name: name.to_owned(),
                submitted: submitted.clone(),
                missing: missing.clone(),
                waited: *waited,
            },
        }
    }
}

/// A decision every rank takes identically.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Reduce this tensor now (decisions come in agreed order).
    Reduce {
        name: String,
        dtype: DType,
        len: usize,
    },
    /// Fail this tensor on every rank.
    Fail { name: String, failure: Failure },
}

struct Entry {
    seq: u64,
    shapes: Vec<Option<(DType, u64)>>,
    first_seen: Instant,
    warned: bool,
}

impl Entry {
    fn submitted(&self) -> Vec<usize> {
        (0..self.shapes.len())
            .filter(|&r| self.shapes[r].is_some())
            .collect()
    }
    fn missing(&self) -> Vec<usize> {
        (0..self.shapes.len())
            .filter(|&r| self.shapes[r].is_none())
            .collect()
    }
}

/// A stall worth warning about.
pub(crate) struct StallWarning {
    pub name: String,
    pub submitted: Vec<usize>,
    pub missing: Vec<usize>,
    pub waited: Duration,
}

/// Which tensors which ranks have announced; identical on every rank.
pub(crate) struct ReadyTable {
    size: usize,
    next_seq: u64,
    entries: HashMap<String, Entry>,
    shut_down: Vec<bool>,
}

impl ReadyTable {
    pub(crate) fn new(size: usize) -> Self {
        ReadyTable {
            size,
            next_seq: 0,
            entries: HashMap::new(),
            shut_down: vec![false; size],
        }
    }

    /// True when nothing is waiting for other ranks.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True once every rank has asked to shut down.
    pub(crate) fn all_shut_down(&self) -> bool {
        self.shut_down.iter().all(|&s| s)
    }

    /// Feeds one cycle's messages (index = rank) and returns the decisions: failures
    /// first, then the tensors to reduce in the order they were first announced.
    pub(crate) fn apply(&mut self, messages: &[CycleMessage], now: Instant) -> Vec<Decision> {
        for (rank, msg) in messages.iter().enumerate() {
            for a in &msg.announcements {
                if let Some(e) = self.entries.get_mut(&a.name) {
                    e.shapes[rank] = Some((a.dtype, a.len));
                    continue;
                }
                let size = self.size;
                let next_seq = &mut self.next_seq;
                let entry = self.entries.entry(a.name.clone()).or_insert_with(|| {
                    let seq = *next_seq;
                    *next_seq += 1;
                    Entry {
                        seq,
                        shapes: vec![None; size],
                        first_seen: now,
                        warned: false,
                    }
                });
                entry.shapes[rank] = Some((a.dtype, a.len));
            }
            if msg.shutting_down {
                self.shut_down[rank] = true;
            }
        }
        let mut failures = Vec::new();
        if let Some(coordinator) = messages.first() {
            for name in &coordinator.fail {
                if let Some(e) = self.entries.remove(name) {
                    failures.push(Decision::Fail {
                        name: name.clone(),
                        failure: Failure::Stalled {
                            submitted: e.submitted(),
                            missing: e.missing(),
                            waited: now.saturating_duration_since(e.first_seen),
                        },
                    });
                }
            }
        }
        let mut done: Vec<(u64, String)> = Vec::new();
        for (name, e) in &self.entries {
            let complete = e.shapes.iter().all(Option::is_some);
            let abandoned = e
                .shapes
                .iter()
                .zip(&self.shut_down)
                .any(|(s, &down)| s.is_none() && down);
            if complete || abandoned {
                done.push((e.seq, name.clone()));
            }
        }
        done.sort();
        let mut reduce = Vec::new();
        for (_, name) in done {
            let Some(e) = self.entries.remove(&name) else {
                continue;
            };
            if e.shapes.iter().any(Option::is_none) {
                failures.push(Decision::Fail {
                    name,
                    failure: Failure::Stalled {
                        submitted: e.submitted(),
                        missing: e.missing(),
                        waited: now.saturating_duration_since(e.first_seen),
                    },
                });
                continue;
            }
            let shapes: Vec<(DType, u64)> = e.shapes.iter().flatten().copied().collect();
            if shapes.iter().all(|s| *s == shapes[0]) {
                reduce.push(Decision::Reduce {
                    name,
                    dtype: shapes[0].0,
                    len: shapes[0].1 as usize,
                });
            } else {
                let detail = shapes
                    .iter()
                    .enumerate()
                    .map(|(r, (d, l))| format!("rank {r}: {d}[{l}]"))
                    .collect::<Vec<_>>()
                    .join(", ");
                failures.push(Decision::Fail {
                    name,
                    failure: Failure::Mismatch(detail),
                });
            }
        }
        failures.extend(reduce);
        failures
    }

    /// Entries first seen at least `after` ago that have not been warned about yet.
    pub(crate) fn take_warnings(&mut self, now: Instant, after: Duration) -> Vec<StallWarning> {
        let mut out = Vec::new();
        for (name, e) in self.entries.iter_mut() {
            let waited = now.saturating_duration_since(e.first_seen);
            if !e.warned && waited >= after {
                e.warned = true;
                out.push(StallWarning {
                    name: name.clone(),
                    submitted: e.submitted(),
                    missing: e.missing(),
                    waited,
                });
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Entries first seen at least `after` ago (the coordinator's fail list).
    pub(crate) fn expired(&self, now: Instant, after: Duration) -> Vec<String> {
        let mut out: Vec<String> = self
            .entries
            .iter()
            .filter(|(_, e)| now.saturating_duration_since(e.first_seen) >= after)
            .map(|(n, _)| n.clone())
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(name: &str, dtype: DType, len: u64) -> Announcement {
        Announcement {
            name: name.into(),
            dtype,
            len,
        }
    }

    #[test]
    fn messages_round_trip() {
        let m = CycleMessage {
            shutting_down: true,
            announcements: vec![ann("a/b", DType::BF16, 7), ann("", DType::F64, 0)],
            fail: vec!["x".into()],
        };
        assert_eq!(CycleMessage::decode(&m.encode(), 0).unwrap(), m);
        assert!(CycleMessage::decode(&m.encode()[..5], 0).is_err());
    }

    #[test]
    fn ready_only_when_every_rank_announced_and_mismatch_names_ranks() {
        let now = Instant::now();
        let mut t = ReadyTable::new(2);
        let d = t.apply(
            &[
                CycleMessage {
                    announcements: vec![ann("w", DType::F32, 4), ann("v", DType::F32, 3)],
                    ..Default::default()
                },
                CycleMessage::default(),
            ],
            now,
        );
        assert!(d.is_empty());
        let d = t.apply(
            &[
                CycleMessage::default(),
                CycleMessage {
                    announcements: vec![ann("v", DType::F32, 3), ann("w", DType::F32, 5)],
                    ..Default::default()
                },
            ],
            now,
        );
        assert_eq!(
            d,
            vec![
                Decision::Fail {
                    name: "w".into(),
                    failure: Failure::Mismatch("rank 0: f32[4], rank 1: f32[5]".into())
                },
                Decision::Reduce {
                    name: "v".into(),
                    dtype: DType::F32,
                    len: 3
                },
            ]
        );
        assert!(t.is_empty());
    }
}
