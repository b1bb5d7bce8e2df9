//! Agreement on which tensors are ready everywhere.
//!
//! Every cycle each rank all-gathers one [`CycleMessage`]: the tensors submitted on it since
//! the last cycle, whether it is shutting down, and (rank 0 only, as coordinator) the
//! tensors whose stall timeout ran out. A tensor goes as one bit of a bit vector when its
//! name is registered and its shape is the one it was last reduced with (Horovod's
//! response cache: the same tensors every step); otherwise by name the first time any rank
//! announces it, later by a small id, with its dtype and length. Every rank feeds the same
//! gathered messages, in rank order, into its own [`ReadyTable`], so every rank assigns the
//! same ids and takes the same decisions in the same order without further messages.

use rustc_hash::FxHashMap as HashMap;
use std::time::{Duration, Instant};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// One submitted tensor, as announced to the other ranks when the cache cannot say it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Announcement {
    /// A name no rank has announced before (as far as this rank had seen).
    New {
        name: String,
        dtype: DType,
        len: u64,
    },
    /// A name already in every rank's registry, by id, with a shape other than the one it
    /// was last reduced with (or it has not been reduced yet).
    Known { id: u32, dtype: DType, len: u64 },
}

/// How a rank announces a submitted tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Announce {
    /// One bit: a registered name with the shape it was last reduced with (the response
    /// cache hit of Horovod: the same tensors come every step).
    Cached(u32),
    /// Spelled out: a new name, or a shape that differs from the cached one.
    Explicit(Announcement),
}

/// A set of registered ids as a bit vector: bit `i % 64` of word `i / 64` is id `i`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct IdBits {
    words: Vec<u64>,
}

impl IdBits {
    pub(crate) fn insert(&mut self, id: u32) {
        let w = id as usize / 64;
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << (id % 64);
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.words
            .get(id as usize / 64)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The ids in ascending order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(k, &w)| {
            let mut rest = w;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let bit = rest.trailing_zeros();
                rest &= rest - 1;
                Some(k as u32 * 64 + bit)
            })
        })
    }

    /// The ids in every set.
    fn intersection<'a>(sets: impl Iterator<Item = &'a IdBits>) -> IdBits {
        let mut out: Option<Vec<u64>> = None;
        for s in sets {
            out = Some(match out {
                None => s.words.clone(),
                Some(mut acc) => {
                    acc.truncate(s.words.len());
                    for (a, b) in acc.iter_mut().zip(&s.words) {
                        *a &= b;
                    }
                    acc
                }
            });
        }
        IdBits {
            words: out.unwrap_or_default(),
        }
    }

    /// Zero words at both ends are left out: `first word, count, words`.
    fn encode(&self, out: &mut Vec<u8>) {
        let first = self.words.iter().position(|&w| w != 0);
        let (first, words) = match first {
            Some(f) => {
                let last = self.words.iter().rposition(|&w| w != 0).unwrap_or(f);
                (f, &self.words[f..=last])
            }
            None => (0, &self.words[..0]),
        };
        out.extend_from_slice(&(first as u32).to_le_bytes());
        out.extend_from_slice(&(words.len() as u32).to_le_bytes());
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
    }
}

/// What one rank says in one cycle.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CycleMessage {
    pub shutting_down: bool,
    /// Sent by a cached-group step that will reduce its group again without a round of
    /// its own if every rank sends the same message (the table ignores it).
    pub arming: bool,
    pub announcements: Vec<Announcement>,
    /// Registered tensors submitted with their cached shape.
    pub cached: IdBits,
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
        out.push(u8::from(self.shutting_down) | (u8::from(self.arming) << 1));
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
        self.cached.encode(&mut out);
        out.extend_from_slice(&(self.fail.len() as u32).to_le_bytes());
        for f in &self.fail {
            out.extend_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// Decodes a message; `rank` is the receiving rank (for error messages), `known_ids`
    /// the names registered before this cycle (the most a bit vector can refer to).
    pub(crate) fn decode(bytes: &[u8], rank: usize, known_ids: usize) -> Result<CycleMessage> {
        let mut r = Reader { bytes, at: 0, rank };
        let bad = |what: String| Error::Transport { rank, detail: what };
        let flags = r.u8()?;
        let (shutting_down, arming) = (flags & 1 != 0, flags & 2 != 0);
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
        let first = r.u32()? as usize;
        let count = r.u32()? as usize;
        if first.saturating_add(count) > known_ids.div_ceil(64) {
            return Err(bad(format!(
                "negotiation message has a bit vector of {count} words from word {first}, beyond the {known_ids} registered tensor names: ranks run different versions of ringtrain?"
            )));
        }
        // Bounded by the message's own length: `take` fails past its end.
        let words = r.take(count * 8)?;
        let mut cached = IdBits {
            words: vec![0; first + count],
        };
        for (k, w) in words.chunks_exact(8).enumerate() {
            let mut a = [0u8; 8];
            a.copy_from_slice(w);
            cached.words[first + k] = u64::from_le_bytes(a);
        }
        let n = r.u32()? as usize;
        let mut fail = Vec::with_capacity(n.min(1 << 16));
        for _ in 0..n {
            fail.push(r.u32()?);
        }
        Ok(CycleMessage {
            shutting_down,
            arming,
            announcements,
            cached,
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
    /// Reduce this registered tensor now (decisions come in agreed order).
    Reduce { id: u32, dtype: DType, len: usize },
    /// Fail this registered tensor on every rank.
    Fail {
        id: u32,
        name: String,
        failure: Failure,
    },
}

/// Which ranks have announced a registered tensor that is not ready everywhere yet.
/// Kept per id across steps (only reset), so a step allocates nothing here.
struct Entry {
    active: bool,
    seq: u64,
    shapes: Vec<Option<(DType, u64)>>,
    announced: usize,
    first_seen: Instant,
    warned: bool,
}

impl Entry {
    fn idle(now: Instant) -> Entry {
        Entry {
            active: false,
            seq: 0,
            shapes: Vec::new(),
            announced: 0,
            first_seen: now,
            warned: false,
        }
    }
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
/// processing order; the shape each was last reduced with (the response cache); and
/// which ranks have announced which pending tensor. Identical on every rank.
///
/// A tensor announced by its cache bit on every rank in the same cycle is ready at once,
/// without touching its entry (the steady state: the same tensors every step). Anything
/// else (a new name, a changed shape, a tensor some ranks announced in an earlier cycle
/// or not at all) goes through its entry, which checks shapes and times out stalls.
pub(crate) struct ReadyTable {
    size: usize,
    next_seq: u64,
    names: Vec<String>,
    ids: HashMap<String, u32>,
    /// By id.
    entries: Vec<Entry>,
    /// By id: the shape the tensor was last reduced with; `None` before its first
    /// reduction and after a mismatch.
    cached: Vec<Option<(DType, u64)>>,
    pending: usize,
    shut_down: Vec<bool>,
    /// Ids registered by the last [`ReadyTable::apply`].
    registered: Vec<u32>,
}

impl ReadyTable {
    pub(crate) fn new(size: usize) -> Self {
        ReadyTable {
            size,
            next_seq: 0,
            names: Vec::new(),
            ids: HashMap::default(),
            entries: Vec::new(),
            cached: Vec::new(),
            pending: 0,
            shut_down: vec![false; size],
            registered: Vec::new(),
        }
    }

    /// The name of a registered id.
    pub(crate) fn name(&self, id: u32) -> &str {
        &self.names[id as usize]
    }

    /// Names registered so far (ids are `0..count`).
    pub(crate) fn registered_count(&self) -> usize {
        self.names.len()
    }

    /// Ids registered by the last [`ReadyTable::apply`].
    pub(crate) fn newly_registered(&self) -> &[u32] {
        &self.registered
    }

    /// How this rank announces a tensor: by its cache bit when the name is registered
    /// and was last reduced with this shape, by id when registered, else by name.
    /// The id of a registered name.
    pub(crate) fn id_of(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// Whether `id` is cached with this shape ([`Announce::Cached`] without the look-up
    /// of its name).
    pub(crate) fn is_cached(&self, id: u32, dtype: DType, len: u64) -> bool {
        self.cached.get(id as usize) == Some(&Some((dtype, len)))
    }

    pub(crate) fn announcement(&self, name: &str, dtype: DType, len: u64) -> Announce {
        match self.ids.get(name) {
            Some(&id) if self.cached[id as usize] == Some((dtype, len)) => Announce::Cached(id),
            Some(&id) => Announce::Explicit(Announcement::Known { id, dtype, len }),
            None => Announce::Explicit(Announcement::New {
                name: name.to_owned(),
                dtype,
                len,
            }),
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

    fn register(&mut self, name: &str, now: Instant) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = self.names.len() as u32;
        self.names.push(name.to_owned());
        self.ids.insert(name.to_owned(), id);
        self.entries.push(Entry::idle(now));
        self.cached.push(None);
        self.registered.push(id);
        id
    }

    fn failure_of(e: &Entry, now: Instant) -> Failure {
        Failure::Stalled {
            submitted: e.submitted(),
            missing: e.missing(),
            waited: now.saturating_duration_since(e.first_seen),
        }
    }

    /// Records that `rank` announced `id` with `shape`; pushes `(seq, id)` to `complete`
    /// once every rank has.
    fn note(
        &mut self,
        rank: usize,
        id: u32,
        shape: (DType, u64),
        now: Instant,
        complete: &mut Vec<(u64, u32)>,
    ) {
        let size = self.size;
        let e = &mut self.entries[id as usize];
        if !e.active {
            e.active = true;
            e.seq = self.next_seq;
            self.next_seq += 1;
            e.shapes.clear();
            e.shapes.resize(size, None);
            e.announced = 0;
            e.first_seen = now;
            e.warned = false;
            self.pending += 1;
        }
        if e.shapes[rank].is_none() {
            e.announced += 1;
        }
        e.shapes[rank] = Some(shape);
        if e.announced == size {
            complete.push((e.seq, id));
        }
    }

    /// Ends an active entry; returns it for its failure description.
    fn retire(&mut self, id: u32) -> Option<&Entry> {
        let e = self.entries.get_mut(id as usize)?;
        if !e.active {
            return None;
        }
        e.active = false;
        self.pending -= 1;
        Some(&self.entries[id as usize])
    }

    /// Feeds one cycle's messages (index = rank) and returns the decisions: failures
    /// first, then the tensors to reduce (those that waited for an entry in the order
    /// they were first announced, then the cache hits in id order).
    pub(crate) fn apply(&mut self, messages: &[CycleMessage], now: Instant) -> Vec<Decision> {
        self.registered.clear();
        let known = self.names.len() as u32;
        let mut complete: Vec<(u64, u32)> = Vec::new();
        for (rank, msg) in messages.iter().enumerate() {
            for a in &msg.announcements {
                let (id, dtype, len) = match a {
                    Announcement::New { name, dtype, len } => {
                        (self.register(name, now), *dtype, *len)
                    }
                    Announcement::Known { id, dtype, len } => {
                        if *id >= known {
                            // Cannot happen with identical registries; ignore rather than
                            // index out of range.
                            continue;
                        }
                        (*id, *dtype, *len)
                    }
                };
                self.note(rank, id, (dtype, len), now, &mut complete);
            }
        }
        // Cache hits on every rank in this cycle are ready without an entry.
        let everywhere = if messages.len() == self.size {
            IdBits::intersection(messages.iter().map(|m| &m.cached))
        } else {
            IdBits::default()
        };
        let mut hits = Vec::new();
        for (rank, msg) in messages.iter().enumerate() {
            for id in msg.cached.iter() {
                if id >= known {
                    continue;
                }
                let Some(shape) = self.cached[id as usize] else {
                    // Cannot happen with identical tables: the sender saw this shape.
                    continue;
                };
                if everywhere.contains(id) && !self.entries[id as usize].active {
                    if rank == 0 {
                        hits.push(id);
                    }
                    continue;
                }
                self.note(rank, id, shape, now, &mut complete);
            }
        }
        for (rank, msg) in messages.iter().enumerate() {
            if msg.shutting_down {
                self.shut_down[rank] = true;
            }
        }
        let mut failures = Vec::new();
        if let Some(coordinator) = messages.first() {
            for &id in &coordinator.fail {
                if let Some(e) = self.retire(id) {
                    let failure = Self::failure_of(e, now);
                    failures.push(Decision::Fail {
                        id,
                        name: self.names[id as usize].clone(),
                        failure,
                    });
                }
            }
        }
        if self.shut_down.iter().any(|&d| d) && self.pending > 0 {
            // Entries waiting for a rank that has shut down will never complete.
            for id in 0..self.entries.len() as u32 {
                let e = &self.entries[id as usize];
                let abandoned = e.active
                    && e.shapes
                        .iter()
                        .zip(&self.shut_down)
                        .any(|(s, &down)| s.is_none() && down);
                if abandoned {
                    if let Some(e) = self.retire(id) {
                        let failure = Self::failure_of(e, now);
                        failures.push(Decision::Fail {
                            id,
                            name: self.names[id as usize].clone(),
                            failure,
                        });
                    }
                }
            }
        }
        complete.sort_unstable();
        let mut reduce = Vec::with_capacity(complete.len() + hits.len());
        for (_, id) in complete {
            let Some(e) = self.retire(id) else {
                continue;
            };
            let mut shapes = e.shapes.iter().flatten().copied();
            let first = shapes.next();
            let agreed = first.filter(|f| shapes.all(|s| s == *f));
            match agreed {
                Some((dtype, len)) => {
                    self.cached[id as usize] = Some((dtype, len));
                    reduce.push(Decision::Reduce {
                        id,
                        dtype,
                        len: len as usize,
                    });
                }
                None => {
                    let detail = e
                        .shapes
                        .iter()
                        .enumerate()
                        .filter_map(|(r, s)| s.map(|(d, l)| format!("rank {r}: {d}[{l}]")))
                        .collect::<Vec<_>>()
                        .join(", ");
                    // The cache no longer speaks for this name.
                    self.cached[id as usize] = None;
                    failures.push(Decision::Fail {
                        id,
                        name: self.names[id as usize].clone(),
                        failure: Failure::Mismatch(detail),
                    });
                }
            }
        }
        for id in hits {
            if let Some((dtype, len)) = self.cached[id as usize] {
                reduce.push(Decision::Reduce {
                    id,
                    dtype,
                    len: len as usize,
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
        for (id, e) in self.entries.iter_mut().enumerate() {
            if !e.active {
                continue;
            }
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
        out
    }

    /// Ids of entries first seen at least `after` ago (the coordinator's fail list).
    pub(crate) fn expired(&self, now: Instant, after: Duration) -> Vec<u32> {
        if self.pending == 0 {
            return Vec::new();
        }
        (0..self.entries.len() as u32)
            .filter(|&id| {
                let e = &self.entries[id as usize];
                e.active && now.saturating_duration_since(e.first_seen) >= after
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

    fn explicit(a: Announce) -> Announcement {
        match a {
            Announce::Explicit(a) => a,
            Announce::Cached(id) => panic!("expected an explicit announcement, got bit {id}"),
        }
    }

    /// What `rank` would send for `names` (all f32 of length `len`), as the engine builds it.
    fn message(t: &ReadyTable, names: &[&str], len: u64) -> CycleMessage {
        let mut m = CycleMessage::default();
        for name in names {
            match t.announcement(name, DType::F32, len) {
                Announce::Cached(id) => m.cached.insert(id),
                Announce::Explicit(a) => m.announcements.push(a),
            }
        }
        m
    }

    /// Round-trips every message through the wire format, as the engine does.
    fn cycle(messages: &[CycleMessage], t: &mut ReadyTable) -> Vec<Decision> {
        let known = t.registered_count();
        let decoded: Vec<_> = messages
            .iter()
            .map(|m| CycleMessage::decode(&m.encode(), 0, known).unwrap())
            .collect();
        assert_eq!(decoded, messages);
        t.apply(&decoded, Instant::now())
    }

    fn reduced(d: &[Decision]) -> Vec<u32> {
        d.iter()
            .filter_map(|d| match d {
                Decision::Reduce { id, .. } => Some(*id),
                Decision::Fail { .. } => None,
            })
            .collect()
    }

    #[test]
    fn messages_round_trip() {
        let mut cached = IdBits::default();
        cached.insert(70);
        cached.insert(200);
        let m = CycleMessage {
            shutting_down: true,
            arming: true,
            announcements: vec![
                new("a/b", DType::BF16, 7),
                Announcement::Known {
                    id: 3,
                    dtype: DType::F64,
                    len: 0,
                },
            ],
            cached,
            fail: vec![9],
        };
        let bytes = m.encode();
        assert_eq!(CycleMessage::decode(&bytes, 0, 201).unwrap(), m);
        assert_eq!(m.cached.iter().collect::<Vec<_>>(), vec![70, 200]);
        assert!(CycleMessage::decode(&bytes[..5], 0, 201).is_err());
        // A bit vector beyond the registered names is refused, not allocated.
        let err = CycleMessage::decode(&bytes, 0, 100)
            .unwrap_err()
            .to_string();
        assert!(err.contains("registered tensor names"), "{err}");
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
                    id: 0,
                    name: "w".into(),
                    failure: Failure::Mismatch("rank 0: f32[4], rank 1: f32[5]".into())
                },
                Decision::Reduce {
                    id: 1,
                    dtype: DType::F32,
                    len: 3
                },
            ]
        );
        assert!(t.is_empty());
        // The next step announces "v" by its cache bit, "w" (which failed) by id.
        assert_eq!(t.announcement("v", DType::F32, 3), Announce::Cached(1));
        assert_eq!(
            t.announcement("w", DType::F32, 4),
            Announce::Explicit(Announcement::Known {
                id: 0,
                dtype: DType::F32,
                len: 4
            })
        );
    }

    #[test]
    fn cache_hit_on_every_rank_is_ready_in_one_cycle_in_any_submission_order() {
        let mut t = ReadyTable::new(3);
        let names = ["a", "b", "c", "d"];
        // Step 1: by name, in different orders.
        let m0 = message(&t, &names, 8);
        let m1 = message(&t, &["d", "c", "b", "a"], 8);
        let m2 = message(&t, &["b", "d", "a", "c"], 8);
        assert!(m0.cached.is_empty() && m0.announcements.len() == 4);
        assert_eq!(reduced(&cycle(&[m0, m1, m2], &mut t)), vec![0, 1, 2, 3]);
        // Step 2: the same tensors in other orders are four bits, and no entry.
        let m0 = message(&t, &["c", "a", "d", "b"], 8);
        let m1 = message(&t, &names, 8);
        let m2 = message(&t, &["d", "b", "c", "a"], 8);
        for m in [&m0, &m1, &m2] {
            assert!(m.announcements.is_empty());
            assert_eq!(m.cached.iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        }
        let d = cycle(&[m0, m1, m2], &mut t);
        assert_eq!(reduced(&d), vec![0, 1, 2, 3]);
        assert!(t.is_empty());
        assert!(d.iter().all(|d| matches!(
            d,
            Decision::Reduce {
                dtype: DType::F32,
                len: 8,
                ..
            }
        )));
    }

    #[test]
    fn cache_hits_spread_over_cycles_wait_for_every_rank() {
        let mut t = ReadyTable::new(2);
        cycle(
            &[message(&t, &["a", "b"], 2), message(&t, &["a", "b"], 2)],
            &mut t,
        );
        // Rank 0 submits both now, rank 1 only "a": "b" waits for it (a cache miss).
        let d = cycle(
            &[message(&t, &["a", "b"], 2), message(&t, &["a"], 2)],
            &mut t,
        );
        assert_eq!(reduced(&d), vec![0]);
        assert!(!t.is_empty());
        // Rank 1's "b" arrives by bit a cycle later and completes the entry.
        let d = cycle(&[CycleMessage::default(), message(&t, &["b"], 2)], &mut t);
        assert_eq!(reduced(&d), vec![1]);
        assert!(t.is_empty());
    }

    #[test]
    fn a_changed_shape_misses_the_cache_and_is_checked_again() {
        let mut t = ReadyTable::new(2);
        cycle(&[message(&t, &["w"], 4), message(&t, &["w"], 4)], &mut t);
        assert_eq!(t.announcement("w", DType::F32, 4), Announce::Cached(0));
        // Both ranks change the shape alike: announced by id, reduced, cached anew.
        let m = message(&t, &["w"], 6);
        assert!(m.cached.is_empty());
        let d = cycle(&[m.clone(), m], &mut t);
        assert_eq!(
            d,
            vec![Decision::Reduce {
                id: 0,
                dtype: DType::F32,
                len: 6
            }]
        );
        assert_eq!(t.announcement("w", DType::F32, 6), Announce::Cached(0));
        // One rank changes it: rank 0's bit and rank 1's explicit shape disagree.
        let d = cycle(&[message(&t, &["w"], 6), message(&t, &["w"], 7)], &mut t);
        assert_eq!(
            d,
            vec![Decision::Fail {
                id: 0,
                name: "w".into(),
                failure: Failure::Mismatch("rank 0: f32[6], rank 1: f32[7]".into())
            }]
        );
        // The failure invalidates the cache entry: the next step spells it out again.
        assert!(matches!(
            explicit(t.announcement("w", DType::F32, 6)),
            Announcement::Known { id: 0, .. }
        ));
        // A new name next to cached ones is announced by name and gets the next id.
        let m = message(&t, &["w", "fresh"], 6);
        assert_eq!(m.announcements.len(), 2);
        let d = cycle(&[m.clone(), m], &mut t);
        assert_eq!(reduced(&d), vec![0, 1]);
        assert_eq!(t.name(1), "fresh");
    }

    #[test]
    fn a_cached_tensor_only_one_rank_submits_times_out_naming_the_others() {
        let start = Instant::now();
        let mut t = ReadyTable::new(3);
        let all = message(&t, &["x", "y"], 1);
        cycle(&[all.clone(), all.clone(), all], &mut t);
        // Only rank 1 submits "y" again, by its bit: an entry waits for ranks 0 and 2.
        let d = cycle(
            &[
                CycleMessage::default(),
                message(&t, &["y"], 1),
                CycleMessage::default(),
            ],
            &mut t,
        );
        assert!(d.is_empty());
        assert!(!t.is_empty());
        let later = start + Duration::from_secs(5);
        let warnings = t.take_warnings(later, Duration::from_secs(1));
        assert_eq!(warnings.len(), 1);
        assert_eq!(warnings[0].name, "y");
        assert_eq!(warnings[0].submitted, vec![1]);
        assert_eq!(warnings[0].missing, vec![0, 2]);
        let expired = t.expired(later, Duration::from_secs(1));
        assert_eq!(expired, vec![1]);
        let d = t.apply(
            &[
                CycleMessage {
                    fail: expired,
                    ..Default::default()
                },
                CycleMessage::default(),
                CycleMessage::default(),
            ],
            later,
        );
        match &d[..] {
            [Decision::Fail {
                id: 1,
                name,
                failure:
                    Failure::Stalled {
                        submitted, missing, ..
                    },
            }] => {
                assert_eq!(name, "y");
                assert_eq!((submitted.clone(), missing.clone()), (vec![1], vec![0, 2]));
            }
            other => panic!("expected the stall of y, got {other:?}"),
        }
        assert!(t.is_empty());
        // A stall is no mismatch: the cache still holds "y"'s shape.
        assert_eq!(t.announcement("y", DType::F32, 1), Announce::Cached(1));
    }
}
