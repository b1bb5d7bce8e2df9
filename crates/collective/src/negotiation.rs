//! Agreement on which tensors are ready everywhere.
//!
//! Every cycle each rank all-gathers one [`CycleMessage`]: the tensors submitted on it since
//! the last cycle (dtype, length, and the name the first time any rank announces it; later
//! a small id, as Horovod's response cache does), whether it is shutting down, and (rank 0
//! only, as coordinator) the tensors whose stall timeout ran out. Every rank feeds the same
//! gathered messages, in rank order, into its own [`ReadyTable`], so every rank assigns the
//! same ids and takes the same decisions in the same order without further messages.

use rustc_hash::FxHashMap as HashMap;
use std::time::{Duration, Instant};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// One submitted tensor, as announced to the other ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Announcement {
    /// A name no rank has announced before (as far as this rank had seen).
    New {
        name: String,
        dtype: DType,
        len: u64,
    },
    /// A name already in every rank's registry, by id.
    Known { id: u32, dtype: DType, len: u64 },
}

/// What one rank says in one cycle.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CycleMessage {
    pub shutting_down: bool,
    pub announcements: Vec<Announcement>,
    /// Ids of tensors to fail as stalled (only rank 0's list is acted on).
    pub fail: Vec<u32>,
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
        let mut out = Vec::with_capacity(16 + self.announcements.len() * 14);
        out.push(u8::from(self.shutting_down));
        out.extend_from_slice(&(self.announcements.len() as u32).to_le_bytes());
        for a in &self.announcements {
            match a {
                Announcement::New { name, dtype, len } => {
                    out.push(0);
                    put_str(&mut out, name);
                    out.push(dtype.code());
                    out.extend_from_slice(&len.to_le_bytes());
                }
                Announcement::Known { id, dtype, len } => {
                    out.push(1);
                    out.extend_from_slice(&id.to_le_bytes());
                    out.push(dtype.code());
                    out.extend_from_slice(&len.to_le_bytes());
                }
            }
        }
        out.extend_from_slice(&(self.fail.len() as u32).to_le_bytes());
        for f in &self.fail {
            out.extend_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// Decodes a message; `rank` is the receiving rank (for error messages).
    pub(crate) fn decode(bytes: &[u8], rank: usize) -> Result<CycleMessage> {
        let mut r = Reader { bytes, at: 0, rank };
        let bad = |what: String| Error::Transport { rank, detail: what };
        let shutting_down = r.u8()? != 0;
        let n = r.u32()? as usize;
        let mut announcements = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            let kind = r.u8()?;
            let (name, id) = match kind {
                0 => (Some(r.string()?), 0),
                1 => (None, r.u32()?),
                other => {
                    return Err(bad(format!(
                        "negotiation message has unknown announcement kind {other}"
                    )))
                }
            };
            let code = r.u8()?;
            let dtype = DType::from_code(code).ok_or_else(|| {
                bad(format!(
                    "negotiation message names unknown dtype code {code}"
                ))
            })?;
            let len = r.u64()?;
            announcements.push(match name {
                Some(name) => Announcement::New { name, dtype, len },
                None => Announcement::Known { id, dtype, len },
            });
        }
        let n = r.u32()? as usize;
        let mut fail = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            fail.push(r.u32()?);
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
    announced: usize,
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

/// The tensor names every rank has seen announced, with ids assigned in the agreed
/// processing order, and which ranks have announced which pending tensor. Identical on
/// every rank.
pub(crate) struct ReadyTable {
    size: usize,
    next_seq: u64,
    names: Vec<String>,
    ids: HashMap<String, u32>,
    /// Pending entries by id.
    entries: Vec<Option<Entry>>,
    pending: usize,
    shut_down: Vec<bool>,
}

impl ReadyTable {
    pub(crate) fn new(size: usize) -> Self {
        ReadyTable {
            size,
            next_seq: 0,
            names: Vec::new(),
            ids: HashMap::default(),
            entries: Vec::new(),
            pending: 0,
            shut_down: vec![false; size],
        }
    }

    /// How this rank announces a tensor: by id when the name is registered.
    pub(crate) fn announcement(&self, name: &str, dtype: DType, len: u64) -> Announcement {
        match self.ids.get(name) {
            Some(&id) => Announcement::Known { id, dtype, len },
            None => Announcement::New {
                name: name.to_owned(),
                dtype,
                len,
            },
        }
    }

    /// True when nothing is waiting for other ranks.
    pub(crate) fn is_empty(&self) -> bool {
        self.pending == 0
    }

    /// True once every rank has asked to shut down.
    pub(crate) fn all_shut_down(&self) -> bool {
        self.shut_down.iter().all(|&s| s)
    }

    fn register(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.names.len() as u32;
        self.names.push(name.to_owned());
        self.ids.insert(name.to_owned(), id);
        self.entries.push(None);
        id
    }

    fn failure_of(&self, e: &Entry, now: Instant) -> Failure {
        Failure::Stalled {
            submitted: e.submitted(),
            missing: e.missing(),
            waited: now.saturating_duration_since(e.first_seen),
        }
    }

    /// Feeds one cycle's messages (index = rank) and returns the decisions: failures
    /// first, then the tensors to reduce in the order they were first announced.
    pub(crate) fn apply(&mut self, messages: &[CycleMessage], now: Instant) -> Vec<Decision> {
        let mut complete: Vec<(u64, u32)> = Vec::new();
        for (rank, msg) in messages.iter().enumerate() {
            for a in &msg.announcements {
                let (id, dtype, len) = match a {
                    Announcement::New { name, dtype, len } => (self.register(name), *dtype, *len),
                    Announcement::Known { id, dtype, len } => {
                        if (*id as usize) >= self.names.len() {
                            // Cannot happen with identical registries; ignore rather than
                            // index out of range.
                            continue;
                        }
                        (*id, *dtype, *len)
                    }
                };
                let size = self.size;
                let slot = &mut self.entries[id as usize];
                if slot.is_none() {
                    *slot = Some(Entry {
                        seq: self.next_seq,
                        shapes: vec![None; size],
                        announced: 0,
                        first_seen: now,
                        warned: false,
                    });
                    self.next_seq += 1;
                    self.pending += 1;
                }
                if let Some(e) = slot.as_mut() {
                    if e.shapes[rank].is_none() {
                        e.announced += 1;
                    }
                    e.shapes[rank] = Some((dtype, len));
                    if e.announced == size {
                        complete.push((e.seq, id));
                    }
                }
            }
            if msg.shutting_down {
                self.shut_down[rank] = true;
            }
        }
        let mut failures = Vec::new();
        if let Some(coordinator) = messages.first() {
            for &id in &coordinator.fail {
                if let Some(e) = self.entries.get_mut(id as usize).and_then(Option::take) {
                    self.pending -= 1;
                    failures.push(Decision::Fail {
                        name: self.names[id as usize].clone(),
                        failure: self.failure_of(&e, now),
                    });
                }
            }
        }
        if self.shut_down.iter().any(|&d| d) && self.pending > 0 {
            // Entries waiting for a rank that has shut down will never complete.
            for id in 0..self.entries.len() {
                let abandoned = self.entries[id].as_ref().is_some_and(|e| {
                    e.shapes
                        .iter()
                        .zip(&self.shut_down)
                        .any(|(s, &down)| s.is_none() && down)
                });
                if abandoned {
                    if let Some(e) = self.entries[id].take() {
                        self.pending -= 1;
                        failures.push(Decision::Fail {
                            name: self.names[id].clone(),
                            failure: self.failure_of(&e, now),
                        });
                    }
                }
            }
        }
        complete.sort_unstable();
        let mut reduce = Vec::with_capacity(complete.len());
        for (_, id) in complete {
            let Some(e) = self.entries[id as usize].take() else {
                continue;
            };
            self.pending -= 1;
            let name = self.names[id as usize].clone();
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
        if self.pending == 0 {
            return out;
        }
        for (id, slot) in self.entries.iter_mut().enumerate() {
            if let Some(e) = slot {
                let waited = now.saturating_duration_since(e.first_seen);
                if !e.warned && waited >= after {
                    e.warned = true;
                    out.push(StallWarning {
                        name: self.names[id].clone(),
                        submitted: e.submitted(),
                        missing: e.missing(),
                        waited,
                    });
                }
            }
        }
        out
    }

    /// Ids of entries first seen at least `after` ago (the coordinator's fail list).
    pub(crate) fn expired(&self, now: Instant, after: Duration) -> Vec<u32> {
        if self.pending == 0 {
            return Vec::new();
        }
        (0..self.entries.len() as u32)
            .filter(|&id| {
                self.entries[id as usize]
                    .as_ref()
                    .is_some_and(|e| now.saturating_duration_since(e.first_seen) >= after)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new(name: &str, dtype: DType, len: u64) -> Announcement {
        Announcement::New {
            name: name.into(),
            dtype,
            len,
        }
    }

    #[test]
    fn messages_round_trip() {
        let m = CycleMessage {
            shutting_down: true,
            announcements: vec![
                new("a/b", DType::BF16, 7),
                Announcement::Known {
                    id: 3,
                    dtype: DType::F64,
                    len: 0,
                },
            ],
            fail: vec![9],
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
                    announcements: vec![new("w", DType::F32, 4), new("v", DType::F32, 3)],
                    ..Default::default()
                },
                CycleMessage::default(),
            ],
            now,
        );
        assert!(d.is_empty());
        // Rank 1 had not seen the names yet when it announced them.
        let d = t.apply(
            &[
                CycleMessage::default(),
                CycleMessage {
                    announcements: vec![new("v", DType::F32, 3), new("w", DType::F32, 5)],
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
        // The next step announces by id.
        let a = t.announcement("v", DType::F32, 3);
        assert_eq!(
            a,
            Announcement::Known {
                id: 1,
                dtype: DType::F32,
                len: 3
            }
        );
        let d = t.apply(
            &[
                CycleMessage {
                    announcements: vec![a.clone()],
                    ..Default::default()
                },
                CycleMessage {
                    announcements: vec![a],
                    ..Default::default()
                },
            ],
            now,
        );
        assert_eq!(
            d,
            vec![Decision::Reduce {
                name: "v".into(),
                dtype: DType::F32,
                len: 3
            }]
        );
    }
}
