//! Writers of the same checkpoint never break each other, and readers always find one
//! whole checkpoint: each write goes through a temporary file of its own.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use ringtrain_train::{Checkpoint, OptimizerState, TrainConfig};

fn checkpoint(seed: u64, n: usize) -> Checkpoint {
    let mut config = TrainConfig::default();
    config.run.seed = seed;
    Checkpoint {
        config,
        step: seed,
        params: (0..n).map(|i| (i as f32) * seed as f32).collect(),
        optimizer: OptimizerState::Sgd,
        loss_scaler: None,
        input: Vec::new(),
    }
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "run.ckpt")
        .collect()
}

#[test]
fn concurrent_writers_leave_one_whole_checkpoint_at_every_moment() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.ckpt");
    // Big enough that writes overlap; different contents so a mix would be caught.
    let (a, b) = (checkpoint(3, 200_000), checkpoint(5, 200_000));
    a.save(&path).unwrap();
    let writing = AtomicBool::new(true);
    std::thread::scope(|s| {
        let writers: Vec<_> = [&a, &b]
            .into_iter()
            .map(|ck| {
                let path = &path;
                s.spawn(move || (0..15).try_for_each(|_| ck.save(path)))
            })
            .collect();
        let reader = s.spawn(|| {
            let mut reads = 0;
            while writing.load(Ordering::SeqCst) {
                let found = Checkpoint::load(&path).map_err(|e| e.to_string())?;
                if found != a && found != b {
                    return Err("a mixed checkpoint was read".to_string());
                }
                reads += 1;
            }
            Ok(reads)
        });
        // Every writer is joined and the reader stopped before anything is asserted, so
        // a failure cannot leave the reader running.
        let written: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        writing.store(false, Ordering::SeqCst);
        let read = reader.join().expect("the reader does not panic");
        for w in written {
            w.expect("a writer does not panic")
                .expect("every concurrent write succeeds");
        }
        assert!(read.expect("every read finds a whole checkpoint") > 0);
    });
    let last = Checkpoint::load(&path).unwrap();
    assert!(last == a || last == b);
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );
}
