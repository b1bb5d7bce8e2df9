//! A stop (SIGINT/SIGTERM) seen while a checkpoint is written leaves the old file as it
//! was and no temporary file. (Its own test binary: the stop request is process-wide.)

use ringtrain_train::{interrupt, Checkpoint, Error, OptimizerState, TrainConfig};

#[test]
fn a_stop_while_writing_keeps_the_old_checkpoint_and_removes_the_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.ckpt");
    let mut ck = Checkpoint {
        config: TrainConfig::default(),
        step: 4,
        params: vec![0.5; 1000],
        optimizer: OptimizerState::Sgd,
        loss_scaler: None,
        input: Vec::new(),
    };
    ck.save(&path).unwrap();
    let before = std::fs::read(&path).unwrap();

    interrupt::request(15);
    ck.step = 8;
    let err = ck.save(&path).unwrap_err();
    assert!(
        matches!(err, Error::Interrupted { signal: 15, .. }),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("SIGTERM") && text.contains("run.ckpt"),
        "{text}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["run.ckpt"]);
}
