//! Kernel launches, counted where they are issued.
//!
//! Every launch through [`Gpu::launch`](crate::Gpu::launch) (every typed launcher of
//! this crate goes through it) adds one here once the driver has accepted it. The counts
//! are totals since the process started, kept for the whole process
//! ([`KernelLaunches::process`]) and for the calling thread
//! ([`KernelLaunches::this_thread`], exact while other threads launch too: ranks run as
//! threads in tests). A trainer reads them around its steps, as it reads
//! [`TransferBytes`](crate::TransferBytes), so its launches per batch count every kernel
//! of the step: the model's and the optimizer's.
//!
//! ```
//! use ringtrain_cuda::KernelLaunches;
//!
//! let before = KernelLaunches::this_thread();
//! // ... launches ...
//! assert_eq!(KernelLaunches::this_thread() - before, 0); // nothing was launched
//! ```

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

static PROCESS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD: Cell<u64> = const { Cell::new(0) };
}

/// Kernel launch counts (see the `launches` module docs).
#[derive(Debug, Clone, Copy)]
pub struct KernelLaunches;

impl KernelLaunches {
    /// Launches of this process so far.
    pub fn process() -> u64 {
        PROCESS.load(Ordering::Relaxed)
    }

    /// Launches the calling thread has issued so far.
    pub fn this_thread() -> u64 {
        THREAD.with(Cell::get)
    }
}

/// Counts one launch (called by [`Gpu::launch`](crate::Gpu::launch)).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn count_launch() {
    PROCESS.fetch_add(1, Ordering::Relaxed);
    THREAD.with(|t| t.set(t.get() + 1));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_count_for_the_process_and_the_thread() {
        let (p0, t0) = (KernelLaunches::process(), KernelLaunches::this_thread());
        count_launch();
        count_launch();
        assert_eq!(KernelLaunches::this_thread() - t0, 2);
        std::thread::spawn(count_launch).join().unwrap();
        assert_eq!(KernelLaunches::this_thread() - t0, 2);
        assert!(KernelLaunches::process() - p0 >= 3);
    }
}
