//! Resuming under mpirun (the MPI transport and control plane): 3 steps, then 3 more with
//! `--resume`, write the checkpoint of 6 uninterrupted steps bit for bit, on the bundled
//! corpus (shuffled, bucketed, sharded over 2 ranks) and on synthetic data; rank 0 says
//! it resumed.

mod support;

use std::path::Path;
use std::process::Output;

use ringtrain_train::Checkpoint;

fn ringtrain(args: &[String]) -> Output {
    support::with_mpi_env(env!("CARGO_BIN_EXE_ringtrain"))
        .args(args)
        .output()
        .expect("the ringtrain binary runs")
}

/// `ringtrain launch --np 2 -- train` for `steps` steps (one warm-up) with `data` flags,
/// writing `checkpoint`; rank 0's output.
fn train(data: &[String], steps: usize, checkpoint: &Path, resume: bool) -> String {
    let mut args: Vec<String> = [
        "launch",
        "--np",
        "2",
        "--",
        "train",
        "--num-units",
        "8",
        "--src-max-len",
        "6",
        "--threads",
        "1",
        "--display-every",
        "1",
        "--warmup-batches",
        "1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(data.iter().cloned());
    args.push("--timed-batches".into());
    args.push((steps - 1).to_string());
    args.push("--checkpoint".into());
    args.push(checkpoint.display().to_string());
    if resume {
        args.push("--resume".into());
    }
    let out = ringtrain(&args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?} failed:\n{stdout}\n{stderr}");
    stdout
}

fn check(data: &[String]) {
    let dir = tempfile::tempdir().unwrap();
    let straight = dir.path().join("straight.ckpt");
    let split = dir.path().join("split.ckpt");
    train(data, 6, &straight, false);
    train(data, 3, &split, false);
    let out = train(data, 3, &split, true);
    let said = format!("resumed from step 3 of {}", split.display());
    assert!(out.contains(&said), "{data:?}: no {said:?} in\n{out}");
    let (a, b) = (
        Checkpoint::load(&straight).unwrap(),
        Checkpoint::load(&split).unwrap(),
    );
    assert_eq!((a.step, b.step), (6, 6));
    let bits = |ck: &Checkpoint| ck.params.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&a) == bits(&b), "{data:?}: parameters differ");
    assert_eq!(
        a.optimizer, b.optimizer,
        "{data:?}: optimizer state differs"
    );
    assert_eq!(a.input, b.input, "{data:?}: input positions differ");
    assert_eq!(a.input.len(), 2);
}

#[test]
fn resumed_runs_under_mpirun_end_with_the_bits_of_an_uninterrupted_one() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let nmt = repo.join("data").join("nmt");
    let files = ["train.en", "train.xx", "vocab.en", "vocab.xx"]
        .map(|f| nmt.join(f).display().to_string())
        .join(",");
    check(&[
        "--data".into(),
        files,
        "--batch-size".into(),
        "128".into(),
        "--variable-update".into(),
        "parameter_server".into(),
    ]);
    check(&[
        "--use-synthetic-data".into(),
        "--vocab-size".into(),
        "30".into(),
        "--batch-size".into(),
        "4".into(),
    ]);
}
