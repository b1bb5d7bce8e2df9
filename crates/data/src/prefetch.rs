//! A background thread that makes batches ahead of the training loop.
//!
//! [`Prefetcher`] runs a batch source on its own thread and hands the items over a bounded
//! [`crossbeam_channel`] of `capacity` items, so at most `capacity` batches wait in memory
//! (plus the one being made). Items arrive in the source's order. The first `Err` from the
//! source is forwarded and then the thread stops; a panic in the source becomes
//! [`Error::PrefetchPanicked`]. Dropping the prefetcher closes the channel, which stops the
//! thread at its next hand-over, and joins it.

use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver};

use crate::error::{Error, Result};

/// Batches made ahead on a background thread (see the module docs).
///
/// ```
/// use ringtrain_data::{Prefetcher, SyntheticNmt, SyntheticNmtConfig};
/// let cfg = SyntheticNmtConfig { src_vocab_size: 10, tgt_vocab_size: 10, seq_len: 3, batch_size: 2, seed: 0 };
/// let mut batches = Prefetcher::spawn_infallible(SyntheticNmt::new(cfg, 0)?, 4)?;
/// let batch = batches.next().expect("endless source")?;
/// assert_eq!(batch.words(), 12);
/// drop(batches); // stops and joins the thread
/// # Ok::<(), ringtrain_data::Error>(())
/// ```
#[derive(Debug)]
pub struct Prefetcher<T> {
    receiver: Option<Receiver<Result<T>>>,
    handle: Option<JoinHandle<()>>,
}

impl<T: Send + 'static> Prefetcher<T> {
    /// Starts a thread that pulls `source` and keeps up to `capacity` items ready.
    ///
    /// # Errors
    /// `capacity == 0`, or the thread cannot be started.
    pub fn spawn<I>(source: I, capacity: usize) -> Result<Self>
    where
        I: Iterator<Item = Result<T>> + Send + 'static,
    {
        if capacity == 0 {
            return Err(Error::invalid(
                "prefetch capacity",
                capacity,
                "keep at least 1 batch in the queue",
            ));
        }
        let (sender, receiver) = bounded(capacity);
        let handle = std::thread::Builder::new()
            .name("ringtrain-prefetch".into())
            .spawn(move || {
                for item in source {
                    let failed = item.is_err();
                    // A send error means the consumer is gone: stop quietly.
                    if sender.send(item).is_err() || failed {
                        break;
                    }
                }
            })
            .map_err(|source| Error::PrefetchSpawn { source })?;
        Ok(Prefetcher {
            receiver: Some(receiver),
            handle: Some(handle),
        })
    }

    /// [`Prefetcher::spawn`] for a source that cannot fail.
    pub fn spawn_infallible<I>(source: I, capacity: usize) -> Result<Self>
    where
        I: Iterator<Item = T> + Send + 'static,
    {
        Self::spawn(source.map(Ok), capacity)
    }
}

impl<T> Prefetcher<T> {
    fn join_thread(&mut self) -> Option<Error> {
        let handle = self.handle.take()?;
        match handle.join() {
            Ok(()) => None,
            Err(payload) => {
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".to_string());
                Some(Error::PrefetchPanicked { message })
            }
        }
    }
}

impl<T> Iterator for Prefetcher<T> {
    type Item = Result<T>;

    fn next(&mut self) -> Option<Result<T>> {
        let receiver = self.receiver.as_ref()?;
        match receiver.recv() {
            Ok(item) => Some(item),
            Err(_) => {
                // The thread has finished: the source ended, failed, or panicked.
                self.receiver = None;
                self.join_thread().map(Err)
            }
        }
    }
}

impl<T> Drop for Prefetcher<T> {
    fn drop(&mut self) {
        // Closing the channel first makes a blocked `send` fail, so the join cannot hang
        // on a full queue.
        self.receiver = None;
        let _ = self.join_thread();
    }
}
