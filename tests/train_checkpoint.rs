//! Checkpoints: a run resumed from a checkpoint continues exactly as an uninterrupted
//! run (parameters and Adam state survive the round trip), and a damaged or mismatched
//! checkpoint is refused with a clear error on every rank.

use std::path::Path;

use ringtrain::collective::Communicator;
use ringtrain::data::{SyntheticNmt, SyntheticNmtConfig};
use ringtrain::train::{build_model, train, Batch, Checkpoint, OptimizerState, TrainConfig};

const VOCAB: usize = 30;

fn config(steps: usize, checkpoint: &Path, resume: bool) -> TrainConfig {
    let mut cfg = TrainConfig::default();
    cfg.model.num_units = 8;
    cfg.data.vocab_size = VOCAB;
    cfg.data.src_max_len = 5;
    cfg.data.batch_size = 3;
    cfg.run.warmup_batches = 0;
    cfg.run.timed_batches = steps;
    cfg.run.threads = 1;
    cfg.run.learning_rate = Some(0.01);
    cfg.output.display_every = 0;
    cfg.output.checkpoint = Some(checkpoint.to_path_buf());
    cfg.output.resume = resume;
    cfg
}

/// Batches `from..to` of one fixed synthetic stream, split over `ranks` ranks.
fn batches(
    from: usize,
    to: usize,
    rank: usize,
    ranks: usize,
) -> Vec<ringtrain::data::Result<Batch>> {
    let mut g = SyntheticNmt::new(
        SyntheticNmtConfig {
            src_vocab_size: VOCAB,
            tgt_vocab_size: VOCAB,
            seq_len: 5,
            batch_size: 3 * ranks,
            seed: 11,
        },
        0,
    )
    .unwrap();
    (0..to)
        .map(|_| g.next_batch())
        .skip(from)
        .map(|b| Ok(Batch::Nmt(b).columns(rank * 3..rank * 3 + 3)))
        .collect()
}

fn run(
    cfg: &TrainConfig,
    from: usize,
    to: usize,
    ranks: usize,
) -> Vec<ringtrain::train::Result<Vec<f32>>> {
    Communicator::run_local(ranks, |comm| {
        let rank = comm.rank();
        let cfg = cfg.validate(ranks)?;
        let mut model = build_model(&cfg, VOCAB, VOCAB, 0, 1)?;
        let mut data = batches(from, to, rank, ranks).into_iter();
        train(&cfg, comm, model.as_mut(), &mut data, &mut |_| {})?;
        Ok(model.params()?.to_vec())
    })
    .unwrap()
}

#[test]
fn resumed_run_matches_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let ck_path = dir.path().join("run.ckpt");
    let straight_path = dir.path().join("straight.ckpt");
    let straight = run(&config(5, &straight_path, false), 0, 5, 2)
        .remove(0)
        .unwrap();

    let first = run(&config(3, &ck_path, false), 0, 3, 2).remove(0).unwrap();
    let ck = Checkpoint::load(&ck_path).unwrap();
    assert_eq!(ck.step, 3);
    assert_eq!(
        ck.params, first,
        "the checkpoint holds the final parameters"
    );
    match &ck.optimizer {
        OptimizerState::Adam { step, m, .. } => {
            assert_eq!(*step, 3);
            assert!(m.iter().any(|x| *x != 0.0));
        }
        other => panic!("expected Adam state, found {other:?}"),
    }

    let resumed = run(&config(2, &ck_path, true), 3, 5, 2).remove(0).unwrap();
    let worst = resumed
        .iter()
        .zip(&straight)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst <= 1e-6,
        "resumed run differs from the uninterrupted one by {worst}"
    );
    assert_eq!(Checkpoint::load(&ck_path).unwrap().step, 5);
}

#[test]
fn corrupt_or_mismatched_checkpoint_is_a_clear_error_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.ckpt");
    run(&config(1, &path, false), 0, 1, 1).remove(0).unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    for result in run(&config(1, &path, true), 0, 1, 2) {
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains("corrupt") || err.contains("failed to load"),
            "{err}"
        );
    }
    let err = run(&config(1, &path, true), 0, 1, 1)
        .remove(0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("bad.ckpt") && err.contains("checksum"),
        "{err}"
    );

    // A good checkpoint of another model shape names the differing flag.
    let other = dir.path().join("other.ckpt");
    run(&config(1, &other, false), 0, 1, 1).remove(0).unwrap();
    let mut wider = config(1, &other, true);
    wider.model.num_units = 10;
    let err = run(&wider, 0, 1, 1).remove(0).unwrap_err().to_string();
    assert!(
        err.contains("--num-units") && err.contains("10") && err.contains('8'),
        "{err}"
    );
}
