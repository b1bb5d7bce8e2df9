//! SIGTERM to `ringtrain launch` stops mpirun and every rank; SIGTERM to a rank stops it
//! between steps with one line naming the last good checkpoint.

mod support;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use ringtrain_train::Checkpoint;
use support::{ringtrain, signal, tiny_with_steps, wait_for_file, wait_within};

/// Every process's parent, from /proc.
fn parents() -> HashMap<u32, u32> {
    let mut map = HashMap::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
        let fields: Vec<&str> = stat[stat.rfind(')').unwrap_or(0) + 1..]
            .split_whitespace()
            .collect();
        if let Some(ppid) = fields.get(1).and_then(|p| p.parse().ok()) {
            map.insert(pid, ppid);
        }
    }
    map
}

/// `root`'s descendants.
fn descendants(root: u32) -> Vec<u32> {
    let parents = parents();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let p = found[i];
        found.extend(parents.iter().filter(|(_, &pp)| pp == p).map(|(&c, _)| c));
        i += 1;
    }
    found.remove(0);
    found
}

/// Running (not gone, not a zombie waiting for its parent to reap it).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat[stat.rfind(')').unwrap_or(0) + 1..]
            .split_whitespace()
            .next()
            .unwrap_or("");
        state != "Z" && state != "X"
    })
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

#[test]
fn sigterm_to_launch_stops_mpirun_and_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("run.ckpt");
    let mut cmd = ringtrain();
    cmd.args(["launch", "--np", "2", "--", "train"])
        .args(tiny_with_steps("1000000000"))
        .args([
            "--display-every",
            "0",
            "--checkpoint-every",
            "1",
            "--checkpoint",
        ])
        .arg(&ck)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut launcher = cmd.spawn().unwrap();
    wait_for_file(&ck, &mut launcher);
    let started = descendants(launcher.id());
    let ranks = started
        .iter()
        .filter(|&&p| cmdline(p).contains(" train "))
        .count();
    assert!(ranks >= 2, "expected mpirun and 2 ranks, found {started:?}");

    signal(launcher.id(), "TERM");
    let status = wait_within(
        &mut launcher,
        Duration::from_secs(30),
        "the signalled launcher",
    );

    // Survivors are looked for (and killed) before anything is asserted.
    let start = Instant::now();
    let mut left: Vec<u32> = started.clone();
    while !left.is_empty() && start.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(100));
        left.retain(|&p| alive(p));
    }
    for &p in &left {
        signal(p, "KILL");
    }
    assert!(
        left.is_empty(),
        "processes outlived the launcher: {:?}",
        left.iter().map(|&p| (p, cmdline(p))).collect::<Vec<_>>()
    );
    assert!(!status.success(), "{status}");
    assert!(
        status.code().is_some(),
        "the launcher exits with mpirun's status, it is not killed: {status}"
    );
}

#[test]
fn sigterm_to_a_rank_names_the_last_good_checkpoint_and_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("run.ckpt");
    let mut cmd = ringtrain();
    cmd.arg("train")
        .args(tiny_with_steps("1000000000"))
        .args([
            "--display-every",
            "0",
            "--checkpoint-every",
            "2",
            "--checkpoint",
        ])
        .arg(&ck)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut rank = cmd.spawn().unwrap();
    wait_for_file(&ck, &mut rank);
    std::thread::sleep(Duration::from_millis(300));
    signal(rank.id(), "TERM");
    let status = wait_within(&mut rank, Duration::from_secs(30), "the signalled rank");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut rank.stderr.take().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{status}: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    let line = lines[0];
    assert!(
        line.contains("interrupted by SIGTERM")
            && line.contains(" of 1000000001")
            && line.contains(&format!("the last good checkpoint is `{}`", ck.display())),
        "{line}"
    );
    // The step it names is the step the file holds, and the file is whole.
    let step: u64 = line
        .rsplit_once("(step ")
        .and_then(|(_, rest)| rest.trim_end_matches(')').parse().ok())
        .unwrap_or_else(|| panic!("no step in {line}"));
    assert_eq!(Checkpoint::load(&ck).unwrap().step, step);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["run.ckpt"], "no temporary file is left");
}

#[test]
fn sigterm_to_one_rank_of_two_ends_the_job_instead_of_hanging_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("run.ckpt");
    let mut cmd = ringtrain();
    cmd.args(["launch", "--np", "2", "--", "train"])
        .args(tiny_with_steps("1000000000"))
        .args([
            "--display-every",
            "0",
            "--checkpoint-every",
            "1",
            "--checkpoint",
        ])
        .arg(&ck)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut launcher = cmd.spawn().unwrap();
    let mut stderr = launcher.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut text);
        text
    });
    wait_for_file(&ck, &mut launcher);
    let started = descendants(launcher.id());
    let rank = started
        .iter()
        .copied()
        .filter(|&p| cmdline(p).contains(" train "))
        .max()
        .expect("a rank is running");
    signal(rank, "TERM");
    // A stopped rank that finalized MPI would wait for the other rank forever.
    let status = wait_within(&mut launcher, Duration::from_secs(60), "the launcher");
    let start = Instant::now();
    let mut left = started.clone();
    while !left.is_empty() && start.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(100));
        left.retain(|&p| alive(p));
    }
    for &p in &left {
        signal(p, "KILL");
    }
    let stderr = reader.join().unwrap();
    assert!(left.is_empty(), "processes outlived the job: {left:?}");
    assert!(!status.success(), "{status}");
    assert!(
        stderr.contains("interrupted by SIGTERM after step")
            && stderr.contains("the last good checkpoint is"),
        "{stderr}"
    );
}
