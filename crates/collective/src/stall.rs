//! Stall detection: every wait on other ranks is bounded by a stall timeout.
//!
//! A rank that stops responding (stopped with SIGSTOP, stuck in a device call, on a dead
//! node that keeps its socket open) would leave every rank that waits for it blocked
//! forever. Instead, every transport waits in short polls, and a wait that makes no
//! progress for half the timeout prints a warning naming the ranks it waits for and what
//! it was doing; at the timeout:
//!
//! - the MPI transport prints an error with the same names and aborts the job
//!   (`MPI_Abort`, exit status [`STALL_EXIT_CODE`]): one stalled rank would otherwise stall
//!   the next collective of every other rank too, and a blocked rank cannot be woken;
//! - the local transport (threads of one process) returns [`Error::StallTimeout`] from the
//!   waiting call, so that the caller (a test) can see it.
//!
//! The ranks named are the peers of the point-to-point messages still pending (ring,
//! recursive-doubling, halving-doubling and direct steps, broadcast, all-gather, barrier,
//! the fusion engine's negotiation). Inside `MPI_Allreduce` ([`crate::Algorithm::Mpi`]) MPI does not say whom
//! it waits for: the message says so, and the job is still aborted. Horovod's stall check
//! is the model, with one difference: Horovod only warns, which leaves the job hanging.
//!
//! The timeout is set per communicator and shared with its duplicates
//! ([`crate::Communicator::set_stall_timeout`]); `None` disables the check (waits block
//! for ever). [`crate::Communicator::set_stall_context`] adds what the program was doing
//! (for example the training step) to the messages.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::dtype::DType;
use crate::error::{Error, Result};

/// Default stall timeout: a wait on other ranks that lasts this long aborts the job.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Exit status of a job the MPI transport aborts because a rank stalled.
pub const STALL_EXIT_CODE: i32 = 3;

/// `u64::MAX` milliseconds: the check is off.
const OFF: u64 = u64::MAX;

/// What a communicator is doing, for stall messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Operation {
    /// The collective, e.g. `ring all-reduce`.
    pub name: &'static str,
    /// Element type, where there is one.
    pub dtype: Option<DType>,
    /// Bytes of this rank's buffer.
    pub bytes: usize,
}

impl Operation {
    pub(crate) const IDLE: Operation = Operation {
        name: "point-to-point message",
        dtype: None,
        bytes: 0,
    };
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.dtype {
            Some(d) => write!(
                f,
                "{} of {} bytes ({} {d} elements)",
                self.name,
                self.bytes,
                self.bytes / d.size_bytes().max(1)
            ),
            None if self.bytes > 0 => write!(f, "{} of {} bytes", self.name, self.bytes),
            None => f.write_str(self.name),
        }
    }
}

/// Settings shared by a communicator and its duplicates.
#[derive(Debug)]
struct Shared {
    /// Timeout in milliseconds, or [`OFF`].
    timeout_ms: AtomicU64,
    /// What the program is doing (e.g. `training step 12`), empty when unknown.
    context: Mutex<String>,
}

/// The stall settings of one transport and what it is doing now.
#[derive(Debug)]
pub struct StallWatch {
    shared: Arc<Shared>,
    operation: Mutex<Operation>,
}

impl Default for StallWatch {
    fn default() -> Self {
        StallWatch {
            shared: Arc::new(Shared {
                timeout_ms: AtomicU64::new(DEFAULT_STALL_TIMEOUT.as_millis() as u64),
                context: Mutex::new(String::new()),
            }),
            operation: Mutex::new(Operation::IDLE),
        }
    }
}

impl StallWatch {
    /// A watch for a duplicate: same timeout and context (shared), its own operation.
    pub(crate) fn duplicate(&self) -> StallWatch {
        StallWatch {
            shared: Arc::clone(&self.shared),
            operation: Mutex::new(Operation::IDLE),
        }
    }

    /// The timeout, `None` when the check is off.
    pub fn timeout(&self) -> Option<Duration> {
        match self.shared.timeout_ms.load(Ordering::Relaxed) {
            OFF => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Sets the timeout (`None`: off). Shared with every duplicate.
    pub(crate) fn set_timeout(&self, timeout: Option<Duration>) {
        let ms = timeout.map_or(OFF, |t| (t.as_millis() as u64).clamp(1, OFF - 1));
        self.shared.timeout_ms.store(ms, Ordering::Relaxed);
    }

    /// Sets what the program is doing, for the messages. Shared with every duplicate.
    pub(crate) fn set_context(&self, context: String) {
        *self
            .shared
            .context
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = context;
    }

    fn context(&self) -> String {
        self.shared
            .context
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Records the collective this transport runs now.
    pub(crate) fn begin(&self, operation: Operation) {
        *self.operation.lock().unwrap_or_else(|p| p.into_inner()) = operation;
    }

    fn operation(&self) -> Operation {
        *self.operation.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One wait on other ranks: call [`Wait::pause`] between polls.
pub(crate) struct Wait<'a> {
    watch: &'a StallWatch,
    rank: usize,
    start: Instant,
    timeout: Option<Duration>,
    warned: bool,
}

/// Names ranks for a message: `rank 1`, `ranks [1, 2]`, or the opaque case.
fn describe_ranks(ranks: &[usize]) -> String {
    match ranks {
        [] => "the ranks that have not entered it (MPI does not say which)".to_string(),
        [one] => format!("rank {one}"),
        many => format!("ranks {many:?}"),
    }
}

impl<'a> Wait<'a> {
    pub(crate) fn new(watch: &'a StallWatch, rank: usize) -> Wait<'a> {
        Wait {
            watch,
            rank,
            start: Instant::now(),
            timeout: watch.timeout(),
            warned: false,
        }
    }

    /// The longest a blocking poll may sleep before calling [`Wait::check`] again.
    pub(crate) fn slice(&self) -> Duration {
        Duration::from_millis(50)
    }

    /// Between two polls of a wait that has not finished: a spin hint, then
    /// [`Wait::check`]. It neither sleeps nor yields, as Open MPI's own blocking waits do
    /// not: MPI's non-blocking requests progress only while they are tested, so a sleep
    /// stretches every message of more than one chunk, and `sched_yield` on a loaded
    /// machine hands the core to other processes for a whole time slice per poll
    /// (measured on 2 cores with 2 busy processes beside 2 ranks: 10-100x slower
    /// all-reduces from 64 KiB up with yields, none without).
    #[cfg(feature = "mpi")]
    pub(crate) fn pause(&mut self, pending: impl FnOnce() -> Vec<usize>) -> Result<()> {
        std::hint::spin_loop();
        // Reading the clock costs little next to a poll of the transport.
        self.check(pending)
    }

    /// Warns once at half the timeout; at the timeout returns [`Error::StallTimeout`].
    pub(crate) fn check(&mut self, pending: impl FnOnce() -> Vec<usize>) -> Result<()> {
        let Some(timeout) = self.timeout else {
            return Ok(());
        };
        let waited = self.start.elapsed();
        if waited < timeout / 2 || (self.warned && waited < timeout) {
            return Ok(());
        }
        let mut waiting_for = pending();
        waiting_for.sort_unstable();
        waiting_for.dedup();
        if waited < timeout {
            self.warned = true;
            eprintln!(
                "ringtrain-collective: rank {}: WARNING: no progress for {:.1?} in {}{}: waiting for {}; the job is aborted if this lasts {:.1?}",
                self.rank,
                waited,
                self.watch.operation(),
                context_suffix(&self.watch.context()),
                describe_ranks(&waiting_for),
                timeout
            );
            return Ok(());
        }
        Err(Error::StallTimeout {
            rank: self.rank,
            waiting_for: describe_ranks(&waiting_for),
            operation: self.watch.operation().to_string(),
            context: context_suffix(&self.watch.context()),
            waited,
        })
    }
}

fn context_suffix(context: &str) -> String {
    if context.is_empty() {
        String::new()
    } else {
        format!(" ({context})")
    }
}
