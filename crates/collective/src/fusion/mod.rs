//! Tensor fusion with asynchronous submission, as Horovod does it.
//!
//! [`FusionEngine::submit`] queues a named tensor and returns a [`Handle`];
//! [`FusionEngine::submit_group`] queues a whole group (names made once as
//! [`TensorNames`]) in one message and returns a [`GroupHandle`]. Every cycle the ranks
//! agree on which tensors every rank has submitted: each sends every other rank what was
//! submitted on it since the last cycle, and every rank feeds the same gathered lists, in
//! rank order, into its own copy of one table, so all ranks take the same decisions in the
//! same order. What a rank sends is Horovod's response cache: a tensor whose name every
//! rank has registered and whose shape is the one it was last reduced with is one bit of a
//! bit vector; a tensor whose bit is set on every rank in the same cycle is ready at once.
//! A new name goes by name (the first time), a changed shape by id with its dtype and
//! length; a tensor that only some ranks have announced waits in the table, which checks
//! shapes and times out stalls. Rank 0 acts as coordinator for time-outs only: its list
//! also names the tensors whose stall timeout ran out.
//!
//! Cycles run on a background thread while nobody waits (so reductions overlap the
//! computation that submits them) and on the caller's thread while it waits for its
//! results: a step that submits and then waits needs no hand-off between threads.
//!
//! Tensors ready everywhere are copied into a fusion buffer (per dtype, up to
//! [`FusionConfig::threshold_bytes`]), all-reduced, copied back, and their handles
//! complete. A shape disagreement fails the tensor on every rank, naming each rank's dtype
//! and length (and clears its cache entry); a tensor missing on some ranks is reported on
//! stderr after [`FusionConfig::stall_warning`], naming the missing ranks, and fails on
//! every rank [`FusionConfig::stall_error`] later (ranks that never submitted it see the
//! error from [`FusionEngine::synchronize`] or [`FusionEngine::take_foreign_failure`]).
//!
//! [`FusionEngine::submit_external`] reduces memory the caller keeps (a GPU model's
//! page-locked exchange buffer) in place: the values are read from there and the sums
//! written back there, with no copy other than the fusion buffer's. A handle of such a
//! tensor dropped unwaited first gives the queued tensor a copy of its values, so the
//! caller's memory is free again once the drop returns.
//!
//! # Overhead
//!
//! What a fused step of N small tensors costs beyond one all-reduce of the same bytes:
//! one negotiation round (a bit vector once every name is cached), the copy of every
//! element into the fusion buffer and back where the tensors are not reduced where they
//! lie ([`Communicator::all_reduce_pieces`]: tensors of at least
//! [`crate::min_in_place_piece_bytes`] on average, with an algorithm that carves them),
//! and a few operations per tensor (its slot, its bit, its result). A group submitted
//! again with the same [`TensorNames`] goes by the ids its names had, without a look-up of
//! each name; [`FusionEngine::all_reduce_group`] of such a group on an otherwise idle
//! engine skips the queue altogether (the cached-group step: one round whose messages are
//! compared as bytes, then the fused reduction of the caller's tensors). When every rank
//! took that step with the same group, every rank is armed: the group's next step has no
//! round, only its votes, which every other cycle (another group, a changed shape, single
//! submissions, shutdown, an idle engine) turns against it, which ends it on every rank at
//! once and hands the step to the general path. A group the shared-memory all-reduce
//! reduces where its tensors lie (without scaling or wire compression) votes with that
//! reduction's own flags, which write nothing unless every rank voted for it; another
//! small group (at most 64 KiB) votes in one slot per ring chunk of its fused reduction; a
//! larger one in an all-reduce of one element before its reduction in place.
//!
//! Single submissions get the same steps when they repeat: a step of
//! [`FusionEngine::submit`] calls ended by a [`FusionEngine::synchronize`] of exactly
//! their handles teaches the engine its names in order, and a later step that submits
//! the same names in the same order is held on the submitting side (no queue entry, no
//! look-up or allocation of a name) and synchronized as one cached group under those
//! names. A submission out of that order, another kind of wait, or the background
//! thread's next cycle (which the step's first submission wakes when the last step
//! outlasted the cycle time, so that reductions still overlap a long computation)
//! queues what was held, and the step goes on as the general path. `ringtrain bench
//! allreduce` prints the ratio as its `fusion_overhead` rows, with `each` for single
//! submissions and `group` for one `all_reduce_group`; see the measured rows in the docs
//! of [`crate::algorithm_choice`].

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender, TryRecvError};

use crate::communicator::{ring_chunk_range, Communicator};
use crate::dtype::{DType, Element, Tensor};
use crate::error::{Error, Result};
use crate::negotiation::{
    Announce, Announcement, CycleMessage, Decision, Failure, IdBits, ReadyTable,
};
use crate::options::AllReduceOptions;
use crate::timeline::{EventSink, Timeline};

mod cached;
use cached::{Armed, MAX_ARMED_IDLE};
mod repeated;
use repeated::{Repeated, StepEnd};

/// Default [`FusionConfig::threshold_bytes`]: the largest fusion buffer.
pub const DEFAULT_THRESHOLD_BYTES: usize = 64 * 1024 * 1024;

/// Default [`FusionConfig::cycle_time`].
pub const DEFAULT_CYCLE_TIME: Duration = Duration::from_millis(1);

/// Settings of a [`FusionEngine`].
#[derive(Clone, Debug)]
pub struct FusionConfig {
    /// Largest fusion buffer in bytes; a larger tensor is reduced on its own.
    pub threshold_bytes: usize,
    /// How long the background thread collects submissions before each negotiation.
    pub cycle_time: Duration,
    /// A tensor submitted on some ranks but not all is reported after this long.
    pub stall_warning: Duration,
    /// ...and fails on every rank this much later.
    pub stall_error: Duration,
    /// Operation, algorithm, scaling and wire compression of every reduction.
    pub options: AllReduceOptions,
    /// Write a Chrome-trace timeline per rank (`name.json` becomes `name.rank<R>.json`).
    pub timeline: Option<PathBuf>,
    /// Record the phases into this sink instead (a trainer's timeline shares it); with
    /// [`FusionConfig::timeline`] too, the per-rank file holds a copy of the sink's events.
    /// Without either nothing is recorded and no clock is read for it.
    pub events: Option<EventSink>,
}

impl FusionConfig {
    /// The settings that every rank's engine must share, as `(name, value)` pairs for
    /// [`Communicator::check_same_values`]: each rank fuses and reduces on its own, so a
    /// different threshold or algorithm on one rank sends messages the others do not
    /// expect, and a different operation, scale or wire type gives it different sums.
    /// (The stall timeouts are rank 0's alone, and the cycle time and timeline each
    /// rank's own.)
    pub fn shared_settings(&self) -> Vec<(String, String)> {
        let mut settings =
            crate::agreement::named([("threshold_bytes", self.threshold_bytes.to_string())]);
        settings.extend(self.options.shared_settings());
        settings
    }
}

impl Default for FusionConfig {
    fn default() -> Self {
        FusionConfig {
            threshold_bytes: DEFAULT_THRESHOLD_BYTES,
            cycle_time: DEFAULT_CYCLE_TIME,
            stall_warning: Duration::from_secs(60),
            stall_error: Duration::from_secs(60),
            options: AllReduceOptions::default(),
            timeline: None,
            events: None,
        }
    }
}

/// How long an idle rank sleeps between negotiation rounds at most (it joins rounds so
/// that the others can detect stalls); a submission wakes it at once.
const IDLE_POLL: Duration = Duration::from_millis(50);

/// How many groups' ids ([`TensorNames`]) the engine remembers at most.
const MAX_REMEMBERED_GROUPS: usize = 64;

/// Wakes the background thread at most twice per cycle (first submission, flush), not
/// once per submission: under load every wake-up of a thread can cost a scheduler slice.
#[derive(Debug, Default)]
struct Wakeup {
    state: Mutex<WakeState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct WakeState {
    /// Something was queued since the engine last looked.
    queued: bool,
    /// A caller waits on its handles (or shutdown): end the collection window now.
    flush: bool,
}

impl Wakeup {
    fn lock(&self) -> std::sync::MutexGuard<'_, WakeState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn queued(&self) {
        let mut s = self.lock();
        if !s.queued {
            s.queued = true;
            self.cv.notify_one();
        }
    }

    fn flush(&self) {
        let mut s = self.lock();
        s.flush = true;
        self.cv.notify_one();
    }

    /// Waits up to `timeout` for a submission or flush; true when one came.
    fn wait_queued(&self, timeout: Duration) -> bool {
        let s = self.lock();
        let (s, _) = self
            .cv
            .wait_timeout_while(s, timeout, |s| !s.queued && !s.flush)
            .unwrap_or_else(|p| p.into_inner());
        s.queued || s.flush
    }

    /// Waits until `deadline` or a flush, then starts a new window.
    fn wait_flush_until(&self, deadline: Instant) {
        let s = self.lock();
        let timeout = deadline.saturating_duration_since(Instant::now());
        let (mut s, _) = self
            .cv
            .wait_timeout_while(s, timeout, |s| !s.flush)
            .unwrap_or_else(|p| p.into_inner());
        s.flush = false;
        s.queued = false;
    }
}

enum Command {
    Submit {
        name: Arc<str>,
        tensor: Payload,
        ticket: u64,
        at: Option<Instant>,
    },
    SubmitGroup {
        names: TensorNames,
        tensors: Vec<Tensor>,
        batch: u64,
        at: Option<Instant>,
    },
    Shutdown,
}

/// Where a result goes: a [`Handle`], or one place of a [`GroupHandle`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ticket {
    One(u64),
    Member { batch: u64, index: u32 },
}

/// The results of one submitted group, filled as its tensors complete.
#[derive(Debug)]
struct Batch {
    results: Vec<Option<Result<Tensor>>>,
    remaining: usize,
    /// The handle was dropped unwaited: the batch is discarded once complete.
    abandoned: bool,
}

/// Where the background thread leaves results for handles: one lock and one wake-up per
/// fused group rather than a channel per tensor.
#[derive(Debug, Default)]
struct Board {
    next_ticket: AtomicU64,
    state: Mutex<BoardState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct BoardState {
    done: HashMap<u64, Result<Tensor>>,
    batches: HashMap<u64, Batch>,
    /// Tickets whose handle was dropped unwaited: their results are discarded.
    abandoned: HashSet<u64>,
    /// Set when the background thread has ended.
    closed: Option<String>,
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ticket(&self) -> u64 {
        self.tickets(1).start
    }

    /// `n` consecutive tickets.
    fn tickets(&self, n: u64) -> std::ops::Range<u64> {
        let first = self.next_ticket.fetch_add(n, Ordering::Relaxed);
        first..first + n
    }

    fn post(&self, results: impl IntoIterator<Item = (Ticket, Result<Tensor>)>) {
        let mut s = self.lock();
        for (ticket, r) in results {
            match ticket {
                Ticket::One(ticket) => {
                    if !s.abandoned.remove(&ticket) {
                        s.done.insert(ticket, r);
                    }
                }
                Ticket::Member { batch, index } => {
                    let Some(b) = s.batches.get_mut(&batch) else {
                        continue;
                    };
                    let Some(slot) = b.results.get_mut(index as usize) else {
                        continue;
                    };
                    if slot.is_none() {
                        b.remaining -= 1;
                    }
                    *slot = Some(r);
                    if b.abandoned && b.remaining == 0 {
                        s.batches.remove(&batch);
                    }
                }
            }
        }
        drop(s);
        self.cv.notify_all();
    }

    /// A ticket for a group of `n` tensors, with room for their results.
    fn open_batch(&self, n: usize) -> u64 {
        let batch = self.ticket();
        let results = (0..n).map(|_| None).collect();
        self.lock().batches.insert(
            batch,
            Batch {
                results,
                remaining: n,
                abandoned: false,
            },
        );
        batch
    }

    fn batch_done(&self, batch: u64) -> bool {
        self.lock()
            .batches
            .get(&batch)
            .is_none_or(|b| b.remaining == 0)
    }

    /// Waits until every tensor of the group has a result (or the engine has ended).
    fn take_batch(&self, batch: u64, names: &TensorNames) -> Vec<Result<Tensor>> {
        let mut s = self.lock();
        loop {
            let complete = s.batches.get(&batch).is_none_or(|b| b.remaining == 0);
            if complete || s.closed.is_some() {
                let reason = s.closed.clone().unwrap_or_default();
                let results = s.batches.remove(&batch).map(|b| b.results);
                let results = results.unwrap_or_default();
                return results
                    .into_iter()
                    .enumerate()
                    .map(|(i, r)| {
                        r.unwrap_or_else(|| {
                            Err(Error::EngineStopped {
                                reason: format!(
                                    "tensor `{}` was not reduced before the background thread ended ({reason})",
                                    names.get(i).unwrap_or("?")
                                ),
                            })
                        })
                    })
                    .collect();
            }
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn abandon_batch(&self, batch: u64) {
        let mut s = self.lock();
        let complete = match s.batches.get_mut(&batch) {
            Some(b) => {
                b.abandoned = true;
                b.remaining == 0
            }
            None => false,
        };
        if complete {
            s.batches.remove(&batch);
        }
    }

    fn close(&self, reason: String) {
        self.lock().closed = Some(reason);
        self.cv.notify_all();
    }

    fn is_done(&self, ticket: u64) -> bool {
        self.lock().done.contains_key(&ticket)
    }

    fn all_done(&self, mut tickets: impl Iterator<Item = u64>) -> bool {
        let s = self.lock();
        tickets.all(|t| s.done.contains_key(&t))
    }

    fn take(&self, ticket: u64, name: &str) -> Result<Tensor> {
        let mut s = self.lock();
        loop {
            if let Some(r) = s.done.remove(&ticket) {
                return r;
            }
            if let Some(reason) = &s.closed {
                return Err(Error::EngineStopped {
                    reason: format!(
                        "tensor `{name}` was not reduced before the background thread ended ({reason})"
                    ),
                });
            }
            s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn abandon(&self, ticket: u64) {
        let mut s = self.lock();
        if s.done.remove(&ticket).is_none() {
            s.abandoned.insert(ticket);
        }
    }
}

/// A submitted tensor's future result.
pub struct Handle {
    ticket: u64,
    owner: Owner,
    waited: bool,
    /// The tensor is the caller's memory ([`FusionEngine::submit_external`]).
    external: bool,
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("name", &self.name())
            .field("ticket", &self.ticket)
            .field("waited", &self.waited)
            .field("external", &self.external)
            .finish()
    }
}

/// Where a [`Handle`]'s name and engine are.
enum Owner {
    /// A tensor submitted to the queue under its name.
    Queued { name: Arc<str>, core: Arc<Core> },
    /// A tensor held by a step that repeats the learned one: tensor `index` of the learned
    /// names, which also lead to the engine. The reference comes from the step's spares
    /// and goes back to them when `synchronize` takes the result ([`Owner::Returned`]), so
    /// that a held step takes no reference count per handle once it has repeated.
    Held {
        learned: Arc<repeated::Learned>,
        index: usize,
    },
    /// A held handle whose result `synchronize` took, its reference given back to the
    /// engine: nothing is left to do with it but to drop it.
    Returned,
}

impl Handle {
    /// The name it was submitted under.
    pub fn name(&self) -> &str {
        match &self.owner {
            Owner::Queued { name, .. } => name,
            Owner::Held { learned, index } => learned.name(*index),
            Owner::Returned => "",
        }
    }

    /// Blocks until the tensor is reduced (or failed) and returns it.
    ///
    /// Waiting ends the engine's current collection window at once (the caller runs
    /// the engine's cycles itself until its tensor is done): nothing this rank submits
    /// later can join a fusion this caller is already waiting for.
    pub fn wait(mut self) -> Result<Tensor> {
        let ticket = self.ticket;
        self.with_core(|core| core.help(|| core.board.is_done(ticket)));
        self.take()
    }

    fn take(&mut self) -> Result<Tensor> {
        self.waited = true;
        let ticket = self.ticket;
        self.with_core(|core| core.board.take(ticket, self.name()))
            .unwrap_or_else(|| {
                Err(Error::EngineStopped {
                    reason: format!(
                        "internal: tensor `{}` was held without an engine",
                        self.name()
                    ),
                })
            })
    }

    /// `f` of the engine's core (which a handle keeps, through its learned names where it
    /// was held); `None` only for names learned without an engine, in unit tests.
    fn with_core<R>(&self, f: impl FnOnce(&Core) -> R) -> Option<R> {
        match &self.owner {
            Owner::Queued { core, .. } => Some(f(core)),
            Owner::Held { learned, .. } => learned.core().map(f),
            Owner::Returned => None,
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        if !self.waited {
            let (ticket, external) = (self.ticket, self.external);
            self.with_core(|core| {
                if external {
                    // The caller may reuse or free its memory once this returns: under the
                    // engine's lock (no reduction runs now) a tensor still queued gets a
                    // copy of its own values, so the engine never touches that memory
                    // again.
                    core.detach(ticket);
                }
                core.board.abandon(ticket);
            });
        }
    }
}

/// The names of tensors submitted together (every step, typically), made once and reused:
/// [`FusionEngine::submit_group`] hands a whole group to the background thread in one
/// message, where [`FusionEngine::submit`] takes one per tensor.
#[derive(Clone, Debug)]
pub struct TensorNames {
    names: Arc<[Arc<str>]>,
}

impl TensorNames {
    /// The names, in the order their tensors will be passed.
    pub fn new<I, S>(names: I) -> TensorNames
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        TensorNames {
            names: names.into_iter().map(|n| Arc::from(n.as_ref())).collect(),
        }
    }

    /// Number of names.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// The name at `index`.
    pub fn get(&self, index: usize) -> Option<&str> {
        self.names.get(index).map(|n| &**n)
    }
}

/// A submitted group's future results ([`FusionEngine::submit_group`]).
#[derive(Debug)]
pub struct GroupHandle {
    batch: u64,
    names: TensorNames,
    core: Arc<Core>,
    foreign: ForeignFailures,
    waited: bool,
}

impl GroupHandle {
    /// Blocks until every tensor of the group is reduced (or failed) and returns them in
    /// the order they were passed; the first error instead, after waiting for all (also
    /// a failure of a tensor this rank never submitted, as
    /// [`FusionEngine::synchronize`] reports it).
    pub fn wait(mut self) -> Result<Vec<Tensor>> {
        self.waited = true;
        let (board, batch) = (&self.core.board, self.batch);
        self.core.help(|| board.batch_done(batch));
        let mut out = Vec::with_capacity(self.names.len());
        let mut first_err = None;
        for r in self.core.board.take_batch(self.batch, &self.names) {
            match r {
                Ok(t) => out.push(t),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let mut foreign = self.foreign.lock().unwrap_or_else(|p| p.into_inner());
        if !foreign.is_empty() {
            let (name, f) = foreign.remove(0);
            return Err(f.to_error(&name));
        }
        Ok(out)
    }
}

impl Drop for GroupHandle {
    fn drop(&mut self) {
        if !self.waited {
            self.core.board.abandon_batch(self.batch);
        }
    }
}

/// Failures of tensors this rank never submitted (so no handle can carry them).
type ForeignFailures = Arc<Mutex<Vec<(String, Failure)>>>;

/// The background reducer. Create one per rank with [`FusionEngine::start`]; every rank
/// must eventually call [`FusionEngine::shutdown`].
pub struct FusionEngine {
    tx: Option<Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    core: Arc<Core>,
    foreign: ForeignFailures,
    wake: Arc<Wakeup>,
    /// Submissions are time-stamped only for a timeline.
    timed: bool,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for FusionEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FusionEngine")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl FusionEngine {
    /// Moves `comm` into a new background thread. The communicator comes back from
    /// [`FusionEngine::shutdown`]. Collective: every rank calls it, and first compares
    /// [`FusionConfig::shared_settings`] and [`Communicator::shared_settings`] with every
    /// other rank's.
    ///
    /// # Errors
    /// [`Error::SettingsDiffer`] on every rank when the ranks' settings differ;
    /// [`Error::InvalidValue`] for a threshold of 0 or a scale that is not finite;
    /// [`Error::Timeline`] when the timeline file cannot be made; a transport error.
    pub fn start(mut comm: Communicator, config: FusionConfig) -> Result<FusionEngine> {
        let mut shared = config.shared_settings();
        shared.extend(comm.shared_settings());
        comm.check_same_values("fusion engine settings", &shared)?;
        config.options.validate()?;
        if let Some(path) = &config.timeline {
            let file = crate::timeline::timeline_path_for_rank(path, comm.rank());
            std::fs::File::create(&file).map_err(|source| Error::Timeline {
                path: file.display().to_string(),
                source,
            })?;
        }
        if config.threshold_bytes == 0 {
            return Err(Error::invalid(
                "fusion threshold_bytes",
                0,
                "use a positive size (Horovod's default is 64 MiB)",
            ));
        }
        let timed = config.timeline.is_some() || config.events.is_some();
        let (tx, rx) = unbounded();
        let foreign: ForeignFailures = Arc::default();
        let rank = comm.rank();
        let size = comm.size();
        let wake = Arc::new(Wakeup::default());
        let board = Arc::new(Board::default());
        let cycle_time = config.cycle_time;
        let engine = Engine {
            rank,
            slots: Vec::new(),
            queued: 0,
            unregistered: HashMap::default(),
            fresh: Vec::new(),
            fresh_bits: IdBits::default(),
            failed: HashMap::default(),
            group_ids: HashMap::default(),
            #[cfg(test)]
            by_group_id: 0,
            #[cfg(test)]
            rounds: 0,
            #[cfg(test)]
            cached_steps: 0,
            #[cfg(test)]
            armed_rounds: 0,
            shutting_down: false,
            table: ReadyTable::new(size),
            foreign: Arc::clone(&foreign),
            board: Arc::clone(&board),
            buffer: Vec::new(),
            armed: None,
            timeline: Timeline::new(
                config.timeline.as_deref(),
                config.events.as_ref(),
                rank,
                Instant::now(),
            ),
            config,
        };
        let core = Arc::new_cyclic(|weak| Core {
            state: Mutex::new(CoreState::Running(Box::new(Running { engine, comm, rx }))),
            repeated: RepeatedLock::new(Repeated::new(cycle_time, Weak::clone(weak))),
            board,
        });
        let worker_core = Arc::clone(&core);
        let worker_wake = Arc::clone(&wake);
        let thread = std::thread::Builder::new()
            .name(format!("ringtrain-fusion-{rank}"))
            .spawn(move || background(worker_core, worker_wake, cycle_time))
            .map_err(|e| Error::EngineStopped {
                reason: format!("cannot start the background thread: {e}"),
            })?;
        Ok(FusionEngine {
            tx: Some(tx),
            thread: Some(thread),
            core,
            foreign,
            wake,
            timed,
            rank,
            size,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Queues `tensor` for all-reduce under `name`; every rank must submit the same name
    /// with the same dtype and length (in any order).
    pub fn submit(&self, name: &str, tensor: impl Into<Tensor>) -> Result<Handle> {
        self.submit_payload(name, Payload::Owned(tensor.into()))
    }

    /// Queues the caller's own memory for all-reduce in place under `name`, as
    /// [`FusionEngine::submit`] does with a tensor it takes: the engine reads the values
    /// from `tensor`'s memory and writes the sums back there, making no copy of its own
    /// other than the fusion buffer that every fused tensor passes through. The handle's
    /// [`Handle::wait`] returns an empty tensor of the same dtype once the sums are in
    /// place.
    ///
    /// # Safety
    /// The memory behind `tensor` must stay valid, and must be neither read nor written by
    /// anyone else, until the returned handle has been waited for or dropped (a handle
    /// dropped unwaited first takes the values out of the caller's memory, so that the
    /// engine never touches it again), or until [`FusionEngine::shutdown`] has returned.
    pub unsafe fn submit_external(&self, name: &str, tensor: ExternalTensor) -> Result<Handle> {
        let mut handle = self.submit_payload(name, Payload::External(tensor))?;
        handle.external = true;
        Ok(handle)
    }

    fn submit_payload(&self, name: &str, tensor: Payload) -> Result<Handle> {
        let tx = self.tx.as_ref().ok_or_else(stopped)?;
        let mut repeated = self.core.repeated();
        let ticket = repeated.ticket(&self.core.board);
        let tensor = match tensor {
            Payload::Owned(t) if !self.timed => match repeated.follow(name, t, ticket) {
                Ok((learned, index, wake)) => {
                    drop(repeated);
                    if wake {
                        self.wake.queued();
                    }
                    return Ok(Handle {
                        ticket,
                        owner: Owner::Held { learned, index },
                        waited: false,
                        external: false,
                    });
                }
                Err(t) => Payload::Owned(t),
            },
            other => other,
        };
        // Whatever the step held goes first, in its order.
        send_held(tx, repeated.release())?;
        // One allocation for the name, shared by the handle and the engine.
        let name: Arc<str> = Arc::from(name);
        match tensor {
            Payload::Owned(_) => repeated.record(&name, ticket),
            // The caller's memory is never held: a step with it teaches nothing.
            Payload::External(_) => repeated.forget_step(),
        }
        tx.send(Command::Submit {
            name: Arc::clone(&name),
            tensor,
            ticket,
            at: self.timed.then(Instant::now),
        })
        .map_err(|_| stopped())?;
        drop(repeated);
        self.wake.queued();
        Ok(self.handle(name, ticket))
    }

    fn handle(&self, name: Arc<str>, ticket: u64) -> Handle {
        Handle {
            ticket,
            owner: Owner::Queued {
                name,
                core: Arc::clone(&self.core),
            },
            waited: false,
            external: false,
        }
    }

    /// Queues a group of tensors for all-reduce, `tensors[i]` under `names.get(i)`, in one
    /// message to the background thread. The same rules as [`FusionEngine::submit`]
    /// apply to each (every rank submits every name, with the same dtype and length, in
    /// any order and grouped in any way); each tensor is fused and negotiated on its own.
    pub fn submit_group<T: Into<Tensor>>(
        &self,
        names: &TensorNames,
        tensors: Vec<T>,
    ) -> Result<GroupHandle> {
        self.queue_group(names, tensors, true)
    }

    /// All-reduces a group of tensors and returns them in the order of `names`:
    /// [`FusionEngine::submit_group`] and [`GroupHandle::wait`] at once, without waking
    /// the background thread (this thread runs the cycles).
    ///
    /// A cached group (the same [`TensorNames`] as in an earlier step, every shape as last
    /// reduced, one dtype, within the fusion threshold), submitted while nothing else is
    /// queued on this rank, is reduced at once on this thread: its negotiation round sends
    /// the message it would send anyway (the group's bits), and when every rank sends the
    /// same message its tensors are copied from where they lie into the fusion buffer, in
    /// the order the general path fuses them, without a queue entry, handle or look-up per
    /// tensor. Any other answer (a rank that submitted something else, a failure)
    /// continues as a submitted group would, so decisions and results are the general
    /// path's. Once every rank has taken that step with the same group, the next steps of
    /// it take no round at all (the armed step in the module docs' "Overhead").
    pub fn all_reduce_group<T: Into<Tensor>>(
        &self,
        names: &TensorNames,
        tensors: Vec<T>,
    ) -> Result<Vec<Tensor>> {
        if tensors.len() != names.len() || self.tx.is_none() || self.timed {
            return self.queue_group(names, tensors, false)?.wait();
        }
        self.reduce_group(names, tensors.into_iter().map(Into::into).collect())
    }

    /// [`FusionEngine::all_reduce_group`] of a group with a tensor per name.
    fn reduce_group(&self, names: &TensorNames, tensors: Vec<Tensor>) -> Result<Vec<Tensor>> {
        match self.core.cached_group(names, tensors)? {
            CachedGroup::Reduced(out) => {
                if let Some(e) = self.take_foreign_failure() {
                    return Err(e);
                }
                Ok(out)
            }
            CachedGroup::Queued(batch) => self.group_handle(batch, names).wait(),
            CachedGroup::NotCached(tensors) => self.queue_group(names, tensors, false)?.wait(),
        }
    }

    /// The handle of the group of `names` whose results `batch` collects.
    fn group_handle(&self, batch: u64, names: &TensorNames) -> GroupHandle {
        GroupHandle {
            batch,
            names: names.clone(),
            core: Arc::clone(&self.core),
            foreign: Arc::clone(&self.foreign),
            waited: false,
        }
    }

    fn queue_group<T: Into<Tensor>>(
        &self,
        names: &TensorNames,
        tensors: Vec<T>,
        wake: bool,
    ) -> Result<GroupHandle> {
        if tensors.len() != names.len() {
            return Err(Error::invalid(
                "number of tensors in the group",
                format!("{} (for {} names)", tensors.len(), names.len()),
                "pass one tensor per name, in the order of the names",
            ));
        }
        let tx = self.tx.as_ref().ok_or_else(stopped)?;
        let batch = self.core.board.open_batch(names.len());
        let handle = self.group_handle(batch, names);
        tx.send(Command::SubmitGroup {
            names: names.clone(),
            tensors: tensors.into_iter().map(Into::into).collect(),
            batch,
            at: self.timed.then(Instant::now),
        })
        .map_err(|_| stopped())?;
        if wake {
            self.wake.queued();
        }
        Ok(handle)
    }

    /// Waits for every handle and returns the tensors in the same order. Returns the first
    /// error instead, after waiting for all; also reports tensors that failed elsewhere
    /// which this rank never submitted.
    ///
    /// The handles of a step that submitted the same names, in the same order, as the
    /// last step synchronized whole (and nothing else since) are reduced as one cached
    /// group: its tensors, held since they were submitted, are fused, negotiated (by the
    /// group's bits, or not at all once every rank has done so) and returned as
    /// [`FusionEngine::all_reduce_group`] would (see `repeated.rs`).
    pub fn synchronize(&self, mut handles: Vec<Handle>) -> Result<Vec<Tensor>> {
        let tickets: Vec<u64> = handles.iter().map(|h| h.ticket).collect();
        let end = {
            let mut repeated = self.core.repeated();
            let end = repeated.end_step(&tickets);
            if let StepEnd::Repeat { .. } = end {
                // Their results come back here: their references go back to the spares.
                for h in &mut handles {
                    h.waited = true;
                    if let Owner::Held { learned, .. } =
                        std::mem::replace(&mut h.owner, Owner::Returned)
                    {
                        repeated.give_back(learned);
                    }
                }
            }
            end
        };
        match end {
            StepEnd::Repeat {
                names,
                tensors,
                first,
            } => {
                let reduced = self.reduce_group(&names, tensors)?;
                // Handles in the order they were submitted (the usual case) take the
                // results as they come.
                if tickets
                    .iter()
                    .copied()
                    .eq(first..first + reduced.len() as u64)
                {
                    return Ok(reduced);
                }
                let mut reduced: Vec<Option<Tensor>> = reduced.into_iter().map(Some).collect();
                let lost = || Error::EngineStopped {
                    reason: "internal: a repeated step returned fewer tensors than it held".into(),
                };
                return tickets
                    .iter()
                    .map(|t| {
                        let slot = reduced.get_mut((t - first) as usize);
                        slot.and_then(Option::take).ok_or_else(lost)
                    })
                    .collect();
            }
            StepEnd::General(held) => {
                let tx = self.tx.as_ref().ok_or_else(stopped)?;
                send_held(tx, held)?;
            }
        }
        let mut out = Vec::with_capacity(handles.len());
        let mut first_err = None;
        self.core
            .help(|| self.core.board.all_done(handles.iter().map(|h| h.ticket)));
        for mut h in handles {
            match h.take() {
                Ok(t) => out.push(t),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        if let Some(e) = self.take_foreign_failure() {
            return Err(e);
        }
        Ok(out)
    }

    /// Takes the oldest recorded failure of a tensor that this rank never submitted.
    pub fn take_foreign_failure(&self) -> Option<Error> {
        let mut list = self.foreign.lock().unwrap_or_else(|p| p.into_inner());
        if list.is_empty() {
            None
        } else {
            let (name, f) = list.remove(0);
            Some(f.to_error(&name))
        }
    }

    /// Stops the engine on this rank once every rank has called it, and returns the
    /// communicator. Tensors still missing elsewhere fail.
    pub fn shutdown(mut self) -> Result<Communicator> {
        self.stop()
    }

    fn stop(&mut self) -> Result<Communicator> {
        if let Some(tx) = self.tx.take() {
            // Held tensors are queued like every other: shutdown fails what is left.
            let _ = send_held(&tx, self.core.repeated().release());
            // The thread may be gone already; its join result says why.
            let _ = tx.send(Command::Shutdown);
            self.wake.flush();
        }
        // The learned names lead back to the engine: from here on only the handles that
        // hold them keep it.
        self.core.repeated().forget_learned();
        let thread = self.thread.take().ok_or_else(|| Error::EngineStopped {
            reason: "shutdown was already called".into(),
        })?;
        if thread.join().is_err() {
            return Err(Error::EngineStopped {
                reason: "the background thread panicked".into(),
            });
        }
        match std::mem::replace(&mut *self.core.lock(), CoreState::Ended(None)) {
            CoreState::Ended(Some(result)) => result.map(|comm| *comm),
            CoreState::Ended(None) => Err(Error::EngineStopped {
                reason: "shutdown was already called".into(),
            }),
            CoreState::Running(_) => Err(Error::EngineStopped {
                reason: "internal: the background thread ended before the engine".into(),
            }),
        }
    }
}

/// The error of a submission to an engine whose background thread has ended.
fn stopped() -> Error {
    Error::EngineStopped {
        reason: "the background thread has exited; shutdown() returns the cause".into(),
    }
}

/// Queues tensors a repeated step held, in their order.
fn send_held(tx: &Sender<Command>, held: Vec<repeated::Held>) -> Result<()> {
    for (name, tensor, ticket) in held {
        let tensor = Payload::Owned(tensor);
        tx.send(Command::Submit {
            name,
            tensor,
            ticket,
            at: None,
        })
        .map_err(|_| stopped())?;
    }
    Ok(())
}

impl Drop for FusionEngine {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.stop();
        }
    }
}

/// A tensor the caller hands over ([`FusionEngine::submit_external`]): its memory is
/// reduced in place.
#[derive(Debug)]
pub struct ExternalTensor {
    ptr: NonNull<u8>,
    len: usize,
    dtype: DType,
}

// SAFETY: the memory is handed to the engine exclusively until the handle is waited or
// dropped (the contract of `FusionEngine::submit_external`), like a `&mut [T]` of a
// `Send` element type moved to the engine's thread.
unsafe impl Send for ExternalTensor {}

impl ExternalTensor {
    /// Points at `data`; nothing is read or written until it is submitted with
    /// [`FusionEngine::submit_external`], whose contract says how long the memory must
    /// stay valid.
    pub fn new<T: Element>(data: &mut [T]) -> ExternalTensor {
        ExternalTensor {
            // A slice's pointer is never null (dangling but aligned when empty).
            ptr: NonNull::from(&mut *data).cast::<u8>(),
            len: data.len(),
            dtype: T::DTYPE,
        }
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of its first element.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
}

/// What a queued tensor holds: its own values, or the caller's memory.
#[derive(Debug)]
enum Payload {
    Owned(Tensor),
    External(ExternalTensor),
}

impl Payload {
    fn dtype(&self) -> DType {
        match self {
            Payload::Owned(t) => t.dtype(),
            Payload::External(e) => e.dtype,
        }
    }

    fn len(&self) -> usize {
        match self {
            Payload::Owned(t) => t.len(),
            Payload::External(e) => e.len,
        }
    }

    fn size_bytes(&self) -> usize {
        self.len() * self.dtype().size_bytes()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Payload::Owned(t) => t.as_bytes_mut(),
            Payload::External(e) => {
                let bytes = e.len * e.dtype.size_bytes();
                // SAFETY: `ExternalTensor::new` took these bytes from a live `&mut [T]`,
                // and `submit_external`'s contract keeps them valid and ours alone until
                // the handle is waited or dropped; a dropped handle replaces this payload
                // with an owned copy (`Core::detach`) under the lock every access holds.
                unsafe { std::slice::from_raw_parts_mut(e.ptr.as_ptr(), bytes) }
            }
        }
    }

    /// The result a handle gets: the tensor, or for the caller's memory (whose sums are
    /// in place) an empty tensor of its dtype.
    fn into_result(self) -> Tensor {
        match self {
            Payload::Owned(t) => t,
            Payload::External(e) => Tensor::zeros(e.dtype, 0),
        }
    }

    /// Replaces the caller's memory by a copy of its current values.
    fn detach(&mut self) {
        if let Payload::External(e) = self {
            let mut owned = Tensor::zeros(e.dtype, e.len);
            owned.as_bytes_mut().copy_from_slice(self.bytes_mut());
            *self = Payload::Owned(owned);
        }
    }
}

struct Pending {
    tensor: Payload,
    ticket: Ticket,
    /// When it was submitted (only with a timeline).
    submitted: Option<Instant>,
}

struct Engine {
    config: FusionConfig,
    rank: usize,
    /// Tensors queued here, by registered id.
    slots: Vec<Option<Pending>>,
    /// How many of `slots` are occupied.
    queued: usize,
    /// Tensors queued here whose name is not registered yet (announced by name).
    unregistered: HashMap<Arc<str>, Pending>,
    /// This cycle's announcements by name or id, and by cache bit.
    fresh: Vec<Announcement>,
    fresh_bits: IdBits,
    failed: HashMap<String, Failure>,
    /// The ids of a group's names, by the address of its [`TensorNames`].
    group_ids: HashMap<usize, (TensorNames, Vec<u32>)>,
    /// Tensors accepted by their group's ids, without a look-up of their name.
    #[cfg(test)]
    by_group_id: usize,
    /// Negotiation rounds run.
    #[cfg(test)]
    rounds: usize,
    /// Groups reduced by the cached-group step (with a round or armed).
    #[cfg(test)]
    cached_steps: usize,
    /// Armed reductions run (votes for and against).
    #[cfg(test)]
    armed_rounds: usize,
    shutting_down: bool,
    table: ReadyTable,
    foreign: ForeignFailures,
    board: Arc<Board>,
    buffer: Vec<u64>,
    timeline: Timeline,
    /// The cached group every rank agreed to reduce next without a round.
    armed: Option<Armed>,
}

/// The engine with its communicator, run one cycle at a time under a lock: by the
/// background thread while nobody waits, and by a caller that waits for its results
/// (so a step whose caller waits at once needs no hand-off between threads, which on a
/// loaded machine costs a scheduler slice each way).
struct Core {
    state: Mutex<CoreState>,
    /// The single submissions of a step that repeats the last one, held until its end.
    /// Locked on its own or after `state`, never the other way round. Every submission
    /// takes it, for a few nanoseconds: a spin lock, whose release is a plain store where
    /// a `Mutex`'s is an atomic swap, yielding the thread while another holds it.
    repeated: RepeatedLock,
    /// Where results wait for their handles (the engine posts to it too).
    board: Arc<Board>,
}

/// [`Core::repeated`]'s lock.
type RepeatedLock = spin::mutex::SpinMutex<Repeated, spin::relax::Yield>;

enum CoreState {
    Running(Box<Running>),
    /// The engine has ended: the communicator, or why it ended (taken by shutdown).
    Ended(Option<Result<Box<Communicator>>>),
}

struct Running {
    engine: Engine,
    comm: Communicator,
    rx: Receiver<Command>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Core")
    }
}

impl Core {
    fn lock(&self) -> std::sync::MutexGuard<'_, CoreState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn repeated(&self) -> spin::mutex::SpinMutexGuard<'_, Repeated> {
        self.repeated.lock()
    }

    /// Takes every submission: the queue's, then the tensors a repeated step holds.
    fn drain(&self, r: &mut Running) {
        r.engine.drain(&r.rx);
        for (name, tensor, ticket) in self.repeated().release() {
            r.engine
                .accept_one(name, Payload::Owned(tensor), Ticket::One(ticket), None);
        }
    }

    /// Takes the submissions and runs one cycle; ends the engine after the last cycle or
    /// an error.
    fn step(&self, state: &mut CoreState) {
        let CoreState::Running(r) = state else {
            return;
        };
        self.drain(r);
        if let Some(armed) = r.engine.armed.take() {
            // Anything but the armed group itself: a vote against it ends it on every rank,
            // and this cycle goes on as a round.
            if let Err(e) = r.engine.armed_round(&mut r.comm, &armed, None) {
                Self::finish(state, Err(e));
                return;
            }
        }
        let outcome = r.engine.cycle(&mut r.comm);
        match outcome {
            Ok(false) => {}
            Ok(true) => Self::finish(state, Ok(())),
            Err(e) => Self::finish(state, Err(e)),
        }
    }

    /// Fails what is still queued, closes the board, writes the timeline.
    fn finish(state: &mut CoreState, result: Result<()>) {
        let CoreState::Running(r) = std::mem::replace(state, CoreState::Ended(None)) else {
            return;
        };
        let Running {
            mut engine, comm, ..
        } = *r;
        let reason = match &result {
            Ok(()) => "the engine was shut down".to_string(),
            Err(e) => e.to_string(),
        };
        let left = engine.take_all_queued();
        engine.board.post(left.into_iter().map(|p| {
            (
                p.ticket,
                Err(Error::EngineStopped {
                    reason: reason.clone(),
                }),
            )
        }));
        engine.board.close(reason);
        if let Err(e) = engine.timeline.write() {
            // The path was writable at start; report a late failure without losing the
            // communicator.
            eprintln!("ringtrain-collective: rank {}: WARNING: {e}", engine.rank);
        }
        *state = CoreState::Ended(Some(result.map(|()| Box::new(comm))));
    }

    /// Gives the tensor of `ticket`, if still queued, a copy of the caller's memory it
    /// points at ([`FusionEngine::submit_external`]'s handle was dropped unwaited).
    fn detach(&self, ticket: u64) {
        let mut state = self.lock();
        let CoreState::Running(r) = &mut *state else {
            return;
        };
        self.drain(r);
        let ticket = Ticket::One(ticket);
        let engine = &mut r.engine;
        let queued = engine.slots.iter_mut().flatten();
        for p in queued.chain(engine.unregistered.values_mut()) {
            if p.ticket == ticket {
                p.tensor.detach();
                return;
            }
        }
    }

    /// The cached-group step of [`FusionEngine::all_reduce_group`] on the calling thread.
    fn cached_group(&self, names: &TensorNames, mut tensors: Vec<Tensor>) -> Result<CachedGroup> {
        let mut state = self.lock();
        let CoreState::Running(r) = &mut *state else {
            return Ok(CachedGroup::NotCached(tensors));
        };
        self.drain(r);
        if let Some(armed) = r.engine.armed.take() {
            // Every rank's next cycle is this group's reduction: with this rank's tensors
            // when it submitted the same group, else with a vote against it.
            let same = r.engine.is_armed_group(&armed, names, &tensors);
            let voted = same.then_some(&mut tensors[..]);
            match r.engine.armed_round(&mut r.comm, &armed, voted) {
                Ok(true) => {
                    r.engine.armed = Some(Armed {
                        since: Instant::now(),
                        ..armed
                    });
                    return Ok(CachedGroup::Reduced(tensors));
                }
                // Every rank has seen a vote against it: the group goes the long way.
                Ok(false) => {}
                Err(e) => {
                    let reason = e.to_string();
                    Self::finish(&mut state, Err(e));
                    return Err(Error::EngineStopped { reason });
                }
            }
        }
        let Some(order) = r.engine.cached_order(names, &tensors) else {
            return Ok(CachedGroup::NotCached(tensors));
        };
        let mut cached = IdBits::default();
        for &(id, _) in &order {
            cached.insert(id);
        }
        let arming = Engine::can_arm(&r.comm, &tensors);
        let msg = CycleMessage {
            cached,
            arming,
            ..CycleMessage::default()
        }
        .encode();
        let round = r.engine.exchange(&mut r.comm, &msg).and_then(|gathered| {
            if gathered.iter().all(|m| *m == msg) {
                // Every rank sent this group's bits and nothing else: with no entry open
                // (this rank's table is empty, and every rank's table is the same), the
                // table would only answer "reduce the group"; it stays as it is.
                Ok(None)
            } else {
                r.engine.absorb(&gathered).map(Some)
            }
        });
        let (decisions, negotiated, agreed) = match round {
            Ok(None) => (Vec::new(), Instant::now(), true),
            Ok(Some((decisions, negotiated))) => (decisions, negotiated, false),
            Err(e) => {
                let reason = e.to_string();
                Self::finish(&mut state, Err(e));
                return Err(Error::EngineStopped { reason });
            }
        };
        // Every rank answered with the same bits (and nothing of this group failed):
        // the decisions reduce exactly the group, in id order.
        let mut reduced = decisions.iter().filter_map(|d| match d {
            Decision::Reduce { id, .. } => Some(*id),
            Decision::Fail { .. } => None,
        });
        let whole = agreed
            || (order.iter().all(|&(id, _)| reduced.next() == Some(id))
                && reduced.next().is_none());
        if !whole {
            // Continues exactly as a submitted group: its tensors queued, the decisions
            // carried out, the caller then waiting on its batch.
            let batch = self.board.open_batch(tensors.len());
            r.engine.queue_cached(batch, tensors, &order);
            let outcome = r.engine.carry_out(&mut r.comm, decisions, negotiated);
            match outcome {
                Ok(false) => {}
                Ok(true) => Self::finish(&mut state, Ok(())),
                Err(e) => Self::finish(&mut state, Err(e)),
            }
            return Ok(CachedGroup::Queued(batch));
        }
        for d in decisions {
            if let Decision::Fail { id, name, failure } = d {
                r.engine.fail(id, name, failure);
            }
        }
        if let Err(e) = r.engine.reduce_cached(&mut r.comm, &mut tensors, &order) {
            let reason = e.to_string();
            Self::finish(&mut state, Err(e));
            return Err(Error::EngineStopped { reason });
        }
        if agreed && arming {
            // Every rank sent this message, so every rank asked to arm, or none did; and
            // every rank's reduction settled the same way whether the ranks share memory.
            r.engine.armed = Some(r.engine.armed(&r.comm, names, &tensors, order));
        }
        Ok(CachedGroup::Reduced(tensors))
    }

    /// Runs cycles on the calling thread until `done()` or the engine has ended.
    fn help(&self, done: impl Fn() -> bool) {
        while !done() {
            let mut state = self.lock();
            if done() || matches!(*state, CoreState::Ended(_)) {
                return;
            }
            self.step(&mut state);
        }
    }
}

/// What became of a group offered to the cached-group step.
enum CachedGroup {
    /// Reduced: the tensors in the order of their names.
    Reduced(Vec<Tensor>),
    /// The other ranks did not answer with the same group: queued as this batch.
    Queued(u64),
    /// Not a cached group (or not now): the tensors, untouched.
    NotCached(Vec<Tensor>),
}

/// The background thread: waits for submissions (an idle engine joins a round every
/// [`IDLE_POLL`] so that the other ranks can detect stalls), gathers for the cycle
/// time or until a caller waits, and runs a cycle, until the engine ends.
fn background(core: Arc<Core>, wake: Arc<Wakeup>, cycle_time: Duration) {
    loop {
        let (busy, shutting_down) = match &*core.lock() {
            CoreState::Running(r) => (r.engine.busy(), r.engine.shutting_down),
            CoreState::Ended(_) => return,
        };
        let idle_round = if shutting_down {
            std::thread::sleep(cycle_time.max(Duration::from_micros(100)));
            false
        } else if busy || wake.wait_queued(IDLE_POLL) {
            wake.wait_flush_until(Instant::now() + cycle_time);
            false
        } else {
            true
        };
        let mut state = core.lock();
        if let CoreState::Running(r) = &*state {
            // A caller that waited may have done the work of this window already: no
            // round for nothing (the other ranks would have to join it).
            if !idle_round && !r.engine.busy() && r.rx.is_empty() && !core.repeated().holds() {
                continue;
            }
            // An armed engine's next cycle is its group's reduction on every rank: its
            // idle round is a vote against, once it has been idle for a while.
            if idle_round && r.rx.is_empty() {
                let patience = r
                    .comm
                    .stall_timeout()
                    .map_or(MAX_ARMED_IDLE, |t| MAX_ARMED_IDLE.min(t / 4));
                if r.engine
                    .armed
                    .as_ref()
                    .is_some_and(|a| a.since.elapsed() < patience)
                {
                    continue;
                }
            }
        }
        core.step(&mut state);
    }
}

impl Engine {
    fn accept(&mut self, cmd: Command) {
        match cmd {
            Command::Shutdown => self.shutting_down = true,
            Command::Submit {
                name,
                tensor,
                ticket,
                at,
            } => self.accept_one(name, tensor, Ticket::One(ticket), at),
            Command::SubmitGroup {
                names,
                tensors,
                batch,
                at,
            } => self.accept_group(names, tensors, batch, at),
        }
    }

    fn accept_one(&mut self, name: Arc<str>, tensor: Payload, ticket: Ticket, at: Option<Instant>) {
        {
            {
                let failed = if self.failed.is_empty() {
                    None
                } else {
                    self.failed.remove(&*name)
                };
                if let Some(f) = failed {
                    self.board.post([(ticket, Err(f.to_error(&name)))]);
                    return;
                }
                let pending = Pending {
                    tensor,
                    ticket,
                    submitted: at,
                };
                let (dtype, len) = (pending.tensor.dtype(), pending.tensor.len() as u64);
                let id = match self.table.announcement(&name, dtype, len) {
                    Announce::Cached(id) => Some((id, None)),
                    Announce::Explicit(a @ Announcement::Known { id, .. }) => Some((id, Some(a))),
                    Announce::Explicit(a @ Announcement::New { .. }) => {
                        if self.unregistered.contains_key(&name) {
                            self.duplicate(&name, ticket);
                            return;
                        }
                        self.unregistered.insert(name, pending);
                        self.fresh.push(a);
                        return;
                    }
                };
                if let Some((id, explicit)) = id {
                    let slot = &mut self.slots[id as usize];
                    if slot.is_some() {
                        self.duplicate(&name, ticket);
                        return;
                    }
                    *slot = Some(pending);
                    self.queued += 1;
                    match explicit {
                        Some(a) => self.fresh.push(a),
                        None => self.fresh_bits.insert(id),
                    }
                }
            }
        }
    }

    /// A group's tensors; a group whose names all have ids (the same [`TensorNames`] as
    /// in an earlier step) skips the look-up of each name while its shapes stay cached.
    fn accept_group(
        &mut self,
        names: TensorNames,
        tensors: Vec<Tensor>,
        batch: u64,
        at: Option<Instant>,
    ) {
        let key = Arc::as_ptr(&names.names).cast::<Arc<str>>() as usize;
        let ids = self.group_ids.remove(&key).map(|(_, ids)| ids);
        for (index, (name, tensor)) in names.names.iter().zip(tensors).enumerate() {
            let ticket = Ticket::Member {
                batch,
                index: index as u32,
            };
            if let Some(&id) = ids.as_ref().and_then(|ids| ids.get(index)) {
                let (dtype, len) = (tensor.dtype(), tensor.len() as u64);
                let slot = self.slots.get_mut(id as usize);
                if let Some(slot @ None) = slot {
                    if self.failed.is_empty() && self.table.is_cached(id, dtype, len) {
                        *slot = Some(Pending {
                            tensor: Payload::Owned(tensor),
                            ticket,
                            submitted: at,
                        });
                        self.queued += 1;
                        self.fresh_bits.insert(id);
                        #[cfg(test)]
                        {
                            self.by_group_id += 1;
                        }
                        continue;
                    }
                }
            }
            self.accept_one(Arc::clone(name), Payload::Owned(tensor), ticket, at);
        }
        let ids = ids.or_else(|| {
            let ids: Option<Vec<u32>> = names.names.iter().map(|n| self.table.id_of(n)).collect();
            ids
        });
        if let Some(ids) = ids {
            // Groups made anew every step would pile up: only so many are remembered.
            if self.group_ids.len() >= MAX_REMEMBERED_GROUPS {
                self.group_ids.clear();
            }
            // The names are kept with their ids, so that the key's address stays theirs.
            self.group_ids.insert(key, (names, ids));
        }
    }

    fn duplicate(&self, name: &str, ticket: Ticket) {
        let err = Error::DuplicateName {
            name: name.to_owned(),
            rank: self.rank,
        };
        self.board.post([(ticket, Err(err))]);
    }

    /// Every tensor still queued here.
    fn take_all_queued(&mut self) -> Vec<Pending> {
        self.queued = 0;
        let mut out: Vec<Pending> = self.slots.iter_mut().filter_map(Option::take).collect();
        out.extend(self.unregistered.drain().map(|(_, p)| p));
        out
    }

    /// True when something waits for a cycle (or shutdown is under way).
    fn busy(&self) -> bool {
        self.shutting_down
            || self.queued > 0
            || !self.unregistered.is_empty()
            || !self.fresh.is_empty()
            || !self.fresh_bits.is_empty()
            || !self.table.is_empty()
    }

    /// Takes every submission queued so far.
    fn drain(&mut self, rx: &Receiver<Command>) {
        loop {
            match rx.try_recv() {
                Ok(cmd) => self.accept(cmd),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.shutting_down = true;
                    break;
                }
            }
        }
    }

    /// One negotiation round and the reductions it agrees on; true once every rank has
    /// shut down.
    fn cycle(&mut self, comm: &mut Communicator) -> Result<bool> {
        let msg = CycleMessage {
            shutting_down: self.shutting_down,
            arming: false,
            announcements: std::mem::take(&mut self.fresh),
            cached: std::mem::take(&mut self.fresh_bits),
            fail: self.expired_ids(),
        };
        let (decisions, negotiated) = self.negotiate(comm, msg)?;
        self.carry_out(comm, decisions, negotiated)
    }

    /// The coordinator's list of tensors whose stall timeout ran out (empty elsewhere).
    fn expired_ids(&self) -> Vec<u32> {
        if self.rank != 0 {
            return Vec::new();
        }
        self.table.expired(
            Instant::now(),
            self.config
                .stall_warning
                .saturating_add(self.config.stall_error),
        )
    }

    /// Exchanges `msg` with every rank and feeds the gathered messages into the table:
    /// the decisions every rank takes alike, and when the round ended.
    fn negotiate(
        &mut self,
        comm: &mut Communicator,
        msg: CycleMessage,
    ) -> Result<(Vec<Decision>, Instant)> {
        // A round is drawn only when this rank had something in it: idle rounds (the
        // stall checks between steps) would fill a timeline with nothing.
        let drawn = self.timeline.enabled()
            && (!msg.announcements.is_empty() || !msg.cached.is_empty() || self.queued > 0);
        let round_start = drawn.then(Instant::now);
        let gathered = self.exchange(comm, &msg.encode())?;
        if let Some(start) = round_start {
            let args = serde_json::json!({
                "announced": msg.announcements.len(),
                "queued": self.queued + self.unregistered.len(),
            });
            self.timeline.negotiation(start, Instant::now(), args);
        }
        self.absorb(&gathered)
    }

    /// Sends this rank's encoded message to every rank and returns every rank's.
    fn exchange(&mut self, comm: &mut Communicator, encoded: &[u8]) -> Result<Vec<Vec<u8>>> {
        #[cfg(test)]
        {
            self.rounds += 1;
        }
        comm.negotiate(encoded)
    }

    /// Feeds every rank's message of a round into the table: the decisions, and when.
    fn absorb(&mut self, gathered: &[Vec<u8>]) -> Result<(Vec<Decision>, Instant)> {
        let size = gathered.len();
        let known = self.table.registered_count();
        let mut messages = Vec::with_capacity(size);
        for bytes in gathered {
            messages.push(CycleMessage::decode(bytes, self.rank, known)?);
        }
        let negotiated = Instant::now();
        let decisions = self.table.apply(&messages, negotiated);
        // Names registered now: their tensors move to their id's slot.
        self.slots
            .resize_with(self.table.registered_count(), || None);
        for &id in self.table.newly_registered() {
            if let Some(p) = self.unregistered.remove(self.table.name(id)) {
                self.slots[id as usize] = Some(p);
                self.queued += 1;
            }
        }
        for w in self
            .table
            .take_warnings(negotiated, self.config.stall_warning)
        {
            if w.submitted.contains(&self.rank) {
                eprintln!(
                        "ringtrain-collective: rank {}: WARNING: tensor `{}` was submitted on ranks {:?} but ranks {:?} have not submitted it after {:.1?}; it fails in {:.1?} unless they do",
                        self.rank, w.name, w.submitted, w.missing, w.waited, self.config.stall_error
                    );
            }
        }
        Ok((decisions, negotiated))
    }

    /// Fails and reduces what a round decided; true once every rank has shut down.
    fn carry_out(
        &mut self,
        comm: &mut Communicator,
        decisions: Vec<Decision>,
        negotiated: Instant,
    ) -> Result<bool> {
        let mut ready = Vec::new();
        for d in decisions {
            match d {
                Decision::Fail { id, name, failure } => self.fail(id, name, failure),
                Decision::Reduce { id, dtype, len } => ready.push((id, dtype, len)),
            }
        }
        self.reduce_ready(comm, ready, negotiated)?;
        if self.table.all_shut_down() {
            let mut failed = Vec::new();
            for (id, slot) in self.slots.iter_mut().enumerate() {
                if let Some(p) = slot.take() {
                    let name = self.table.name(id as u32);
                    let reason = format!("every rank shut down before tensor `{name}` was reduced");
                    failed.push((p.ticket, Err(Error::EngineStopped { reason })));
                }
            }
            for (name, p) in self.unregistered.drain() {
                let reason = format!("every rank shut down before tensor `{name}` was reduced");
                failed.push((p.ticket, Err(Error::EngineStopped { reason })));
            }
            self.queued = 0;
            self.board.post(failed);
            return Ok(true);
        }
        Ok(false)
    }

    fn fail(&mut self, id: u32, name: String, failure: Failure) {
        let queued = self.slots.get_mut(id as usize).and_then(Option::take);
        if let Some(p) = queued {
            self.queued -= 1;
            self.board.post([(p.ticket, Err(failure.to_error(&name)))]);
        } else {
            // Not submitted here (yet): report it on the next synchronize, and to a late
            // submitter of the same name.
            self.failed.insert(name.clone(), failure.clone());
            self.foreign
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((name, failure));
        }
    }

    /// Reduces the agreed tensors in agreed order, fused by dtype up to the threshold.
    fn reduce_ready(
        &mut self,
        comm: &mut Communicator,
        ready: Vec<(u32, DType, usize)>,
        negotiated: Instant,
    ) -> Result<()> {
        let mut i = 0;
        while i < ready.len() {
            let dtype = ready[i].1;
            let mut bytes = ready[i].2 * dtype.size_bytes();
            let mut j = i + 1;
            while j < ready.len()
                && ready[j].1 == dtype
                && bytes + ready[j].2 * dtype.size_bytes() <= self.config.threshold_bytes
            {
                bytes += ready[j].2 * dtype.size_bytes();
                j += 1;
            }
            let mut group = Vec::with_capacity(j - i);
            for &(id, _, len) in &ready[i..j] {
                let Some(p) = self.slots.get_mut(id as usize).and_then(Option::take) else {
                    return Err(Error::EngineStopped {
                        reason: format!(
                            "internal: tensor `{}` was agreed on but is not queued on rank {}",
                            self.table.name(id),
                            self.rank
                        ),
                    });
                };
                self.queued -= 1;
                debug_assert_eq!(p.tensor.len(), len);
                if self.timeline.enabled() {
                    self.timeline.phase(
                        self.table.name(id),
                        "queued",
                        p.submitted.unwrap_or(negotiated),
                        negotiated,
                        serde_json::json!({ "bytes": p.tensor.size_bytes() }),
                    );
                }
                group.push((id, p));
            }
            let result = match dtype {
                DType::F32 => self.reduce_group::<f32>(comm, &mut group),
                DType::F64 => self.reduce_group::<f64>(comm, &mut group),
                DType::F16 => self.reduce_group::<half::f16>(comm, &mut group),
                DType::BF16 => self.reduce_group::<half::bf16>(comm, &mut group),
            };
            match result {
                Ok(()) => {
                    self.board.post(
                        group
                            .into_iter()
                            .map(|(_, p)| (p.ticket, Ok(p.tensor.into_result()))),
                    );
                }
                Err(e) => {
                    let reason = e.to_string();
                    self.board.post(group.into_iter().map(|(_, p)| {
                        let err = Error::EngineStopped {
                            reason: reason.clone(),
                        };
                        (p.ticket, Err(err))
                    }));
                    return Err(e);
                }
            }
            i = j;
        }
        Ok(())
    }

    fn reduce_group<T: Element>(
        &mut self,
        comm: &mut Communicator,
        group: &mut [(u32, Pending)],
    ) -> Result<()> {
        let opts = self.config.options;
        if let [(id, p)] = group {
            let start = Instant::now();
            comm.all_reduce(typed_mut::<T>(&mut p.tensor)?, &opts)?;
            let end = Instant::now();
            if self.timeline.enabled() {
                self.timeline.phase(
                    self.table.name(*id),
                    "all_reduce",
                    start,
                    end,
                    serde_json::json!({ "fused_tensors": 1, "fused_bytes": p.tensor.size_bytes() }),
                );
            }
            return Ok(());
        }
        let total: usize = group.iter().map(|(_, p)| p.tensor.len()).sum();
        if comm.reduces_in_place(T::DTYPE, &opts, group.len(), total * T::BYTES) {
            return self.reduce_group_in_place::<T>(comm, group, total);
        }
        let fused = fusion_buffer::<T>(&mut self.buffer, total);
        // Per-tensor timestamps only when a timeline is written: they cost more than
        // copying a small tensor.
        let timed = self.timeline.enabled();
        let stamp = || timed.then(Instant::now);
        let mut copy_in = Vec::with_capacity(if timed { group.len() } else { 0 });
        let mut at = 0;
        for (_, p) in group.iter_mut() {
            let start = stamp();
            let src = typed_mut::<T>(&mut p.tensor)?;
            fused[at..at + src.len()].copy_from_slice(src);
            at += src.len();
            if let (Some(s), Some(e)) = (start, stamp()) {
                copy_in.push((s, e));
            }
        }
        let start = Instant::now();
        comm.all_reduce(fused, &opts)?;
        let reduced = (start, Instant::now());
        let mut copy_out = Vec::with_capacity(copy_in.len());
        let mut at = 0;
        for (_, p) in group.iter_mut() {
            let start = stamp();
            let dst = typed_mut::<T>(&mut p.tensor)?;
            let n = dst.len();
            dst.copy_from_slice(&fused[at..at + n]);
            at += n;
            if let (Some(s), Some(e)) = (start, stamp()) {
                copy_out.push((s, e));
            }
        }
        if timed {
            let args = serde_json::json!({ "fused_tensors": group.len(), "fused_bytes": total * T::BYTES });
            for (k, (id, _)) in group.iter().enumerate() {
                let name = self.table.name(*id);
                self.timeline.phase(
                    name,
                    "copy_in",
                    copy_in[k].0,
                    copy_in[k].1,
                    serde_json::json!({}),
                );
                self.timeline
                    .phase(name, "all_reduce", reduced.0, reduced.1, args.clone());
                self.timeline.phase(
                    name,
                    "copy_out",
                    copy_out[k].0,
                    copy_out[k].1,
                    serde_json::json!({}),
                );
            }
        }
        Ok(())
    }

    /// [`Engine::reduce_group`] of a group the communicator reduces where its tensors
    /// lie ([`Communicator::reduces_in_place`]): the same order and the same bits as
    /// through the fusion buffer, without the copies in and out.
    fn reduce_group_in_place<T: Element>(
        &mut self,
        comm: &mut Communicator,
        group: &mut [(u32, Pending)],
        total: usize,
    ) -> Result<()> {
        let mut pieces = group
            .iter_mut()
            .map(|(_, p)| typed_mut::<T>(&mut p.tensor))
            .collect::<Result<Vec<_>>>()?;
        let start = Instant::now();
        comm.all_reduce_pieces(&mut pieces, &self.config.options)?;
        let end = Instant::now();
        if self.timeline.enabled() {
            let args = serde_json::json!({
                "fused_tensors": group.len(),
                "fused_bytes": total * T::BYTES,
                "in_place": true,
            });
            for (id, _) in group.iter() {
                let name = self.table.name(*id);
                self.timeline
                    .phase(name, "all_reduce", start, end, args.clone());
            }
        }
        Ok(())
    }
}

/// The first `len` elements of the fusion buffer (grown as needed) as `T`s.
fn fusion_buffer<T: Element>(buffer: &mut Vec<u64>, len: usize) -> &mut [T] {
    let words = (len * T::BYTES).div_ceil(8);
    if buffer.len() < words {
        buffer.resize(words, 0);
    }
    let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut buffer[..words])[..len * T::BYTES];
    bytemuck::cast_slice_mut(bytes)
}

/// Typed view of an owned tensor whose dtype was checked to be `T`.
fn typed<T: Element>(t: &mut Tensor) -> Result<&mut [T]> {
    let dtype = t.dtype();
    T::elements_mut(t).ok_or_else(|| other_dtype(dtype))
}

/// Typed view of a tensor whose dtype was agreed to be `T`.
fn typed_mut<T: Element>(t: &mut Payload) -> Result<&mut [T]> {
    let dtype = t.dtype();
    typed_bytes(dtype, t.bytes_mut())
}

fn typed_bytes<T: Element>(dtype: DType, bytes: &mut [u8]) -> Result<&mut [T]> {
    if dtype != T::DTYPE {
        return Err(other_dtype(dtype));
    }
    bytemuck::try_cast_slice_mut(bytes).map_err(|_| {
        Error::invalid(
            "tensor buffer",
            dtype,
            "internal: tensor bytes are not aligned for its dtype",
        )
    })
}

/// The error of a tensor whose dtype is not the one agreed for it (kept out of line, so
/// that the typed views of a fused step's many tensors stay small).
#[cold]
fn other_dtype(dtype: DType) -> Error {
    Error::invalid(
        "tensor dtype",
        dtype,
        "internal: the agreed dtype differs from the queued tensor",
    )
}

#[cfg(test)]
mod tests;
