//! A rank stopped with SIGSTOP under mpirun: with `--stall-timeout`, the other ranks name
//! it and the job ends with a failure instead of hanging, for training and for
//! `bench allreduce`.

mod support;

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The stall timeout these tests pass: short, so that they are quick.
const STALL_SECS: u64 = 4;

/// A process whose environment holds `tag=value` and `OMPI_COMM_WORLD_RANK=rank`.
fn find_rank(tag: &str, value: &str, rank: usize) -> Option<u32> {
    let want_tag = format!("{tag}={value}");
    let want_rank = format!("OMPI_COMM_WORLD_RANK={rank}");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let has = |s: &str| vars.contains(&s.as_bytes());
        if has(&want_tag) && has(&want_rank) {
            return Some(pid);
        }
    }
    None
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill").args([sig, &pid.to_string()]).status();
}

/// Runs `mpirun -np 2 ringtrain ARGS`, waits for a stdout line containing `started`,
/// stops rank 1 with SIGSTOP, and returns (mpirun's success, seconds from the stop to
/// mpirun's exit, output). The stopped rank is killed afterwards whatever happened.
fn stop_rank_one(args: &[&str], started: &str) -> (bool, Duration, String) {
    let tag = format!("{}-{}", std::process::id(), started.len());
    let mut child: Child = support::with_mpi_env("mpirun")
        .args(["-np", "2", env!("CARGO_BIN_EXE_ringtrain")])
        .args(args)
        .env("RINGTRAIN_STALL_TEST", &tag)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun must be installed (Open MPI); see scripts/setup");
    let stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel::<String>();
    let out_thread = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let err_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    // Wait until the job is under way, then stop rank 1.
    let begin = Instant::now();
    let mut stopped = None;
    while begin.elapsed() < Duration::from_secs(120) {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(line) if line.contains(started) => {
                std::thread::sleep(Duration::from_millis(300));
                stopped = find_rank("RINGTRAIN_STALL_TEST", &tag, 1);
                break;
            }
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    if let Some(pid) = stopped {
        signal(pid, "-STOP");
    }
    let stop_time = Instant::now();
    let limit = Duration::from_secs(STALL_SECS + 60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for mpirun") {
            break Some(status);
        }
        if stop_time.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = stop_time.elapsed();
    if let Some(pid) = stopped {
        signal(pid, "-KILL");
    }
    let output = format!(
        "{}\n--- stderr ---\n{}",
        out_thread.join().unwrap_or_default(),
        err_thread.join().unwrap_or_default()
    );
    assert!(stopped.is_some(), "rank 1 was not found to stop:\n{output}");
    (status.is_some_and(|s| s.success()), took, output)
}

fn check(ok: bool, took: Duration, output: &str, doing: &str) {
    assert!(!ok, "mpirun succeeded with a stopped rank:\n{output}");
    assert!(
        took < Duration::from_secs(STALL_SECS + 30),
        "the job took {took:?} to end after the stop:\n{output}"
    );
    assert!(
        output.contains("rank 0: stalled for") && output.contains("waiting for rank 1"),
        "rank 0 does not name the stopped rank 1:\n{output}"
    );
    assert!(
        output.contains(doing),
        "the error does not say `{doing}`:\n{output}"
    );
    assert!(
        output.contains("WARNING: no progress for"),
        "no warning at half the timeout:\n{output}"
    );
}

#[test]
fn a_stopped_rank_ends_training_with_an_error_naming_it() {
    let stall = STALL_SECS.to_string();
    let (ok, took, output) = stop_rank_one(
        &[
            "train",
            "--num-units",
            "8",
            "--vocab-size",
            "60",
            "--src-max-len",
            "5",
            "--batch-size",
            "4",
            "--warmup-batches",
            "1",
            "--timed-batches",
            "100000000",
            "--threads",
            "1",
            "--stall-timeout",
            &stall,
        ],
        "step",
    );
    check(ok, took, &output, "training step");
}

#[test]
fn a_stopped_rank_ends_the_allreduce_bench_with_an_error_naming_it() {
    let stall = STALL_SECS.to_string();
    let (ok, took, output) = stop_rank_one(
        &[
            "bench",
            "allreduce",
            "--min-bytes",
            "64K",
            "--max-bytes",
            "64K",
            "--algorithms",
            "ring",
            "--warmup",
            "100000000",
            "--small-tensors",
            "0",
            "--stall-timeout",
            &stall,
        ],
        "ringtrain all-reduce benchmark",
    );
    check(ok, took, &output, "ring all-reduce");
}
