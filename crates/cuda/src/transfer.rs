//! Bytes copied between host and device memory, counted where the copies are issued.
//!
//! Every host → device copy ([`GpuBuffer::copy_from_host`](crate::GpuBuffer::copy_from_host),
//! [`Gpu::upload`](crate::Gpu::upload), [`PinnedBuffer::upload_async`](crate::PinnedBuffer::upload_async), ...)
//! and every device → host copy (`copy_to_host`, `to_host`, `download_async`, ...) adds
//! its byte count here once the driver has accepted it; device → device copies are not
//! counted. The counts are totals since the process started, kept twice: for the whole
//! process ([`TransferBytes::process`], what a trainer reads around its timed steps: one
//! rank per process under mpirun) and for the calling thread
//! ([`TransferBytes::this_thread`], exact even while other threads copy too).
//!
//! ```
//! use ringtrain_cuda::TransferBytes;
//!
//! let before = TransferBytes::process();
//! // ... copies ...
//! let moved = TransferBytes::process().since(before);
//! assert_eq!(moved, TransferBytes::default()); // nothing was copied
//! ```

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

static TO_DEVICE: AtomicU64 = AtomicU64::new(0);
static TO_HOST: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static THREAD: Cell<TransferBytes> = const { Cell::new(TransferBytes { to_device: 0, to_host: 0 }) };
}

/// Bytes copied host → device and device → host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TransferBytes {
    /// Host → device.
    pub to_device: u64,
    /// Device → host.
    pub to_host: u64,
}

impl TransferBytes {
    /// Totals of this process so far.
    pub fn process() -> TransferBytes {
        TransferBytes {
            to_device: TO_DEVICE.load(Ordering::Relaxed),
            to_host: TO_HOST.load(Ordering::Relaxed),
        }
    }

    /// Totals of the copies the calling thread has issued so far.
    pub fn this_thread() -> TransferBytes {
        THREAD.with(Cell::get)
    }

    /// What was added between `earlier` and `self` (both totals of the same counter).
    pub fn since(self, earlier: TransferBytes) -> TransferBytes {
        TransferBytes {
            to_device: self.to_device.saturating_sub(earlier.to_device),
            to_host: self.to_host.saturating_sub(earlier.to_host),
        }
    }
}

/// Counts a host → device copy of `bytes` bytes (called by the copy functions).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn count_to_device(bytes: usize) {
    TO_DEVICE.fetch_add(bytes as u64, Ordering::Relaxed);
    THREAD.with(|t| {
        let mut v = t.get();
        v.to_device += bytes as u64;
        t.set(v);
    });
}

/// Counts a device → host copy of `bytes` bytes (called by the copy functions).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn count_to_host(bytes: usize) {
    TO_HOST.fetch_add(bytes as u64, Ordering::Relaxed);
    THREAD.with(|t| {
        let mut v = t.get();
        v.to_host += bytes as u64;
        t.set(v);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_per_direction_for_the_process_and_the_thread() {
        let (p0, t0) = (TransferBytes::process(), TransferBytes::this_thread());
        count_to_device(12);
        count_to_host(5);
        count_to_device(3);
        let mine = TransferBytes::this_thread().since(t0);
        assert_eq!(
            mine,
            TransferBytes {
                to_device: 15,
                to_host: 5
            }
        );
        let all = TransferBytes::process().since(p0);
        assert!(all.to_device >= 15 && all.to_host >= 5, "{all:?}");
        // Another thread's copies are the process's, not this thread's.
        std::thread::spawn(|| count_to_host(7)).join().unwrap();
        assert_eq!(TransferBytes::this_thread().since(t0), mine);
        assert!(TransferBytes::process().since(p0).to_host >= 12);
    }
}
