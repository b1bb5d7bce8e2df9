//! The prefetch thread: order, bounded queue, early drop, error and panic propagation.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ringtrain_data::{Error, Prefetcher};

/// An endless counting source that records how far it got and whether it was dropped.
struct Counting {
    next: usize,
    produced: Arc<AtomicUsize>,
    dropped: Arc<AtomicBool>,
}

impl Iterator for Counting {
    type Item = ringtrain_data::Result<usize>;

    fn next(&mut self) -> Option<Self::Item> {
        let value = self.next;
        self.next += 1;
        self.produced.store(self.next, Ordering::SeqCst);
        Some(Ok(value))
    }
}

impl Drop for Counting {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
    }
}

fn counting() -> (Counting, Arc<AtomicUsize>, Arc<AtomicBool>) {
    let produced = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicBool::new(false));
    let source = Counting {
        next: 0,
        produced: Arc::clone(&produced),
        dropped: Arc::clone(&dropped),
    };
    (source, produced, dropped)
}

#[test]
fn items_arrive_in_order_and_the_stream_ends() {
    let prefetcher = Prefetcher::spawn_infallible(0..1000u32, 3).expect("spawn");
    let items: Vec<u32> = prefetcher.map(|item| item.expect("no error")).collect();
    assert_eq!(items, (0..1000).collect::<Vec<_>>());
}

#[test]
fn queue_is_bounded() {
    let (source, produced, _) = counting();
    let mut prefetcher = Prefetcher::spawn(source, 2).expect("spawn");
    // Let the thread fill the queue; it can hold 2 and block holding a third.
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(produced.load(Ordering::SeqCst) <= 3);
    assert_eq!(prefetcher.next().and_then(Result::ok), Some(0));
    assert_eq!(prefetcher.next().and_then(Result::ok), Some(1));
}

#[test]
fn dropping_early_stops_and_joins_the_thread() {
    let (source, produced, dropped) = counting();
    let mut prefetcher = Prefetcher::spawn(source, 4).expect("spawn");
    assert_eq!(prefetcher.next().and_then(Result::ok), Some(0));
    drop(prefetcher);
    // Drop joined the thread, so the source (owned by the thread) is gone already.
    assert!(dropped.load(Ordering::SeqCst));
    let after = produced.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(produced.load(Ordering::SeqCst), after);
}

#[test]
fn dropping_before_reading_does_not_hang() {
    let (source, _, dropped) = counting();
    let prefetcher = Prefetcher::spawn(source, 1).expect("spawn");
    drop(prefetcher);
    assert!(dropped.load(Ordering::SeqCst));
}

#[test]
fn first_error_is_forwarded_then_the_stream_ends() {
    let source = (0..10u32).map(|i| {
        if i == 3 {
            Err(Error::NoExamples {
                path: "corpus.en".into(),
                detail: "test failure".into(),
            })
        } else {
            Ok(i)
        }
    });
    let mut prefetcher = Prefetcher::spawn(source, 2).expect("spawn");
    for expected in 0..3 {
        assert_eq!(prefetcher.next().and_then(Result::ok), Some(expected));
    }
    match prefetcher.next() {
        Some(Err(err)) => assert!(err.to_string().contains("corpus.en"), "{err}"),
        other => panic!("expected the source's error, got {other:?}"),
    }
    assert!(prefetcher.next().is_none());
}

#[test]
fn a_panicking_source_becomes_an_error() {
    let source = (0..5u32).map(|i| {
        if i == 2 {
            panic!("source broke at {i}");
        }
        Ok(i)
    });
    let mut prefetcher = Prefetcher::spawn(source, 1).expect("spawn");
    assert_eq!(prefetcher.next().and_then(Result::ok), Some(0));
    assert_eq!(prefetcher.next().and_then(Result::ok), Some(1));
    match prefetcher.next() {
        Some(Err(Error::PrefetchPanicked { message })) => {
            assert!(message.contains("source broke at 2"), "{message}")
        }
        other => panic!("expected PrefetchPanicked, got {other:?}"),
    }
    assert!(prefetcher.next().is_none());
}

#[test]
fn zero_capacity_is_rejected() {
    let err = Prefetcher::spawn_infallible(0..3u8, 0).expect_err("capacity 0");
    assert!(
        err.to_string()
            .contains("invalid value `0` for prefetch capacity"),
        "{err}"
    );
}
