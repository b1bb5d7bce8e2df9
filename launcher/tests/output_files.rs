//! Output files are checked before the first step, on every rank count, and an existing
//! checkpoint is never replaced unless asked; `sweep` keeps the counts that finished.

mod support;

use std::path::Path;
use std::time::Duration;

use ringtrain_train::Checkpoint;
use support::{output_within, ringtrain, texts, TINY};

const LIMIT: Duration = Duration::from_secs(120);

/// `ringtrain train TINY extra...` on one rank (no mpirun).
fn train(extra: &[&str]) -> (bool, String, String) {
    let mut cmd = ringtrain();
    cmd.arg("train").args(TINY).args(extra);
    let out = output_within(cmd, LIMIT, "ringtrain train");
    let (stdout, stderr) = texts(&out);
    (out.status.success(), stdout, stderr)
}

/// No step ran: the step header and the final table are absent.
fn trained(stdout: &str) -> bool {
    stdout.contains("words/sec") || stdout.contains("total words/s")
}

#[test]
fn unusable_output_paths_fail_before_the_first_step_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing").join("run.ckpt");
    let missing = missing.to_str().unwrap();
    let a_dir = format!("{}/", dir.path().display());
    let report_missing = dir.path().join("nope").join("r.json");
    let report_missing = report_missing.to_str().unwrap();
    let cases: [(&str, &str, &str); 7] = [
        ("--checkpoint", "/", "is a directory"),
        ("--checkpoint", ".", "is a directory"),
        ("--checkpoint", &a_dir, "is a directory"),
        ("--checkpoint", missing, "mkdir -p"),
        // sysfs refuses new files even to root, where permission bits do not.
        (
            "--checkpoint",
            "/sys/ringtrain-test.ckpt",
            "no file can be created",
        ),
        ("--json-report", report_missing, "mkdir -p"),
        (
            "--json-report",
            "/sys/ringtrain-test.json",
            "no file can be created",
        ),
    ];
    for (flag, path, says) in cases {
        let (ok, stdout, stderr) = train(&[flag, path]);
        assert!(!ok, "{flag} {path} was accepted:\n{stdout}");
        assert!(
            stderr.contains(flag) && stderr.contains(&format!("`{path}`")) && stderr.contains(says),
            "{flag} {path}: {stderr}"
        );
        assert!(!trained(&stdout), "{flag} {path}: trained first:\n{stdout}");
    }
    assert!(!Path::new("/.tmp").exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing (no probe, no temporary file) is left behind"
    );
}

#[test]
fn one_rank_that_cannot_write_ends_every_rank_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing").join("run.ckpt");
    let mut cmd = ringtrain();
    cmd.args(["launch", "--np", "2", "--", "train"])
        .args(TINY)
        .arg("--checkpoint")
        .arg(&missing);
    let out = output_within(cmd, LIMIT, "ringtrain launch --np 2");
    let (stdout, stderr) = texts(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("--checkpoint") && stderr.contains(missing.to_str().unwrap()),
        "{stderr}"
    );
    assert!(
        stderr.contains("1 rank(s) failed to check the output files"),
        "rank 1 learns of rank 0's failure: {stderr}"
    );
    assert!(!trained(&stdout), "{stdout}");
}

#[test]
fn an_existing_checkpoint_is_replaced_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.ckpt");
    let ck = path.to_str().unwrap();
    let (ok, _, stderr) = train(&["--checkpoint", ck]);
    assert!(ok, "{stderr}");
    let first = std::fs::read(&path).unwrap();

    // Another configuration, no --resume: refused before training, naming what is there.
    let (ok, stdout, stderr) = train(&["--checkpoint", ck, "--optimizer", "sgd"]);
    assert!(!ok && !trained(&stdout), "{stdout}");
    for says in [
        ck,
        "already exists",
        "step 3",
        "--num-units 8",
        "--optimizer adam",
        "--resume",
        "--overwrite-checkpoint",
    ] {
        assert!(stderr.contains(says), "lacks {says:?}: {stderr}");
    }
    assert_eq!(
        std::fs::read(&path).unwrap(),
        first,
        "the file is untouched"
    );

    // Asked explicitly: replaced.
    let (ok, _, stderr) = train(&[
        "--checkpoint",
        ck,
        "--optimizer",
        "sgd",
        "--overwrite-checkpoint",
    ]);
    assert!(ok, "{stderr}");
    let (config, step) = Checkpoint::read_header(&path).unwrap();
    assert_eq!(
        (config.run.optimizer.to_string(), step),
        ("sgd".to_string(), 3)
    );

    // A file that is not a checkpoint is not replaced either.
    let other = dir.path().join("notes.txt");
    std::fs::write(&other, "my notes").unwrap();
    let (ok, _, stderr) = train(&["--checkpoint", other.to_str().unwrap()]);
    assert!(!ok, "a file that is not a checkpoint was replaced");
    assert!(
        stderr.contains("not a readable ringtrain checkpoint"),
        "{stderr}"
    );
    assert_eq!(std::fs::read_to_string(&other).unwrap(), "my notes");
}

#[test]
fn an_existing_report_is_replaced_as_each_runs_output() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("report.json");
    std::fs::write(&path, "an old report").unwrap();
    let (ok, _, stderr) = train(&["--json-report", path.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(json["timed_batches"], 2);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn sweep_prints_the_counts_that_finished_before_one_failed() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("sweep.json");
    // 2 ranks: one worker and a dedicated server; 1 rank cannot have a dedicated server.
    let mut cmd = ringtrain();
    cmd.args(["sweep", "--np", "2,1", "--json"])
        .arg(&json)
        .args(["--", "train"])
        .args(TINY)
        .args(["--variable-update", "parameter_server", "--ps-ranks", "1"]);
    let out = output_within(cmd, LIMIT, "ringtrain sweep");
    let (stdout, stderr) = texts(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("| ranks | batch size |") && stdout.contains("\n| 2 | 4 |"),
        "the finished count is printed: {stdout}"
    );
    assert!(
        stderr.contains("--ps-ranks") && stderr.contains("stopped at 1 ranks"),
        "{stderr}"
    );
    let rows: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(rows.as_array().map(Vec::len), Some(1));
    assert_eq!(rows[0]["ranks"], 2);
}

#[test]
fn sweep_checks_its_outputs_before_the_first_count() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("missing").join("sweep.json");
    let mut cmd = ringtrain();
    cmd.args(["sweep", "--np", "1", "--json"])
        .arg(&json)
        .args(["--", "train"])
        .args(TINY);
    let out = output_within(cmd, LIMIT, "ringtrain sweep");
    let (stdout, stderr) = texts(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("--json") && stderr.contains("missing") && !stderr.contains("mpirun -np"),
        "refused before launching: {stderr}"
    );
    let mut cmd = ringtrain();
    cmd.args(["sweep", "--np", "1", "--report-dir"])
        .arg(dir.path().join("absent"))
        .args(["--", "train"])
        .args(TINY);
    let out = output_within(cmd, LIMIT, "ringtrain sweep");
    let (_, stderr) = texts(&out);
    assert!(
        !out.status.success() && stderr.contains("--report-dir") && !stderr.contains("mpirun -np"),
        "{stderr}"
    );
    let mut cmd = ringtrain();
    cmd.args(["sweep", "--np", "1", "--plot"])
        .arg(dir.path())
        .args(["--", "train"])
        .args(TINY);
    let out = output_within(cmd, LIMIT, "ringtrain sweep");
    let (_, stderr) = texts(&out);
    assert!(
        !out.status.success()
            && stderr.contains("--plot")
            && stderr.contains("is a directory")
            && !stderr.contains("mpirun -np"),
        "{stderr}"
    );
}

#[test]
fn bench_checks_its_output_files_before_measuring() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    for (flag, file) in [
        ("--json", "rows.json"),
        ("--timeline", "trace.json"),
        ("--plot", "busbw.svg"),
    ] {
        let mut cmd = ringtrain();
        cmd.args(["launch", "--np", "2", "--", "bench", "allreduce"])
            .args([
                "--min-bytes",
                "4K",
                "--max-bytes",
                "8K",
                "--small-tensors",
                "4",
            ])
            .arg(flag)
            .arg(missing.join(file));
        let out = output_within(cmd, LIMIT, "ringtrain bench allreduce");
        let (stdout, stderr) = texts(&out);
        assert!(!out.status.success(), "{stdout}");
        assert!(
            stderr.contains(flag) && stderr.contains("missing") && stderr.contains("mkdir -p"),
            "{flag}: {stderr}"
        );
        assert!(
            !stdout.contains(" ring ") && !stdout.contains(" mpi "),
            "{flag}: measured first:\n{stdout}"
        );
    }
}
