//! What the tests that start `ringtrain` processes share: the binary with Open MPI's
//! variables for root and small machines, a tiny model, and a wait with a deadline so a
//! hang fails the test instead of blocking it.

#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A model and run small enough for a few steps per second on one core.
pub const TINY: &[&str] = &[
    "--num-units",
    "8",
    "--vocab-size",
    "60",
    "--src-max-len",
    "5",
    "--warmup-batches",
    "1",
    "--timed-batches",
    "2",
    "--threads",
    "1",
    "--batch-size",
    "4",
];

/// `TINY` with `--timed-batches` replaced by `steps`.
pub fn tiny_with_steps(steps: &str) -> Vec<String> {
    let mut args: Vec<String> = TINY.iter().map(|s| s.to_string()).collect();
    let at = args.iter().position(|a| a == "--timed-batches").unwrap() + 1;
    args[at] = steps.to_string();
    args
}

/// `program` with Open MPI's variables for running as root, more ranks than cores, and
/// containers without cross-memory attach.
pub fn with_mpi_env(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    cmd
}

/// The `ringtrain` binary, ready to run mpirun as root on a small machine.
pub fn ringtrain() -> Command {
    let mut cmd = with_mpi_env(env!("CARGO_BIN_EXE_ringtrain"));
    cmd.env("RUST_LOG", "off").stdin(Stdio::null());
    cmd
}

/// Sends `signal` (a name such as `TERM`) to `pid` with kill(1).
pub fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status();
}

/// Waits for `child` at most `limit`; past it, kills it and fails the test.
pub fn wait_within(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            signal(child.id(), "TERM");
            std::thread::sleep(Duration::from_secs(3));
            let _ = child.kill();
            panic!("{what} did not end within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `cmd` to the end (at most `limit`), collecting its output.
pub fn output_within(mut cmd: Command, limit: Duration, what: &str) -> Output {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let out = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = out.read_to_end(&mut v);
        v
    });
    let err = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = err.read_to_end(&mut v);
        v
    });
    let status = wait_within(&mut child, limit, what);
    Output {
        status,
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
    }
}

/// Standard output and error of `out`, as text.
pub fn texts(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits (at most a minute) until `path` exists: the run got past its first steps.
pub fn wait_for_file(path: &std::path::Path, child: &mut Child) {
    let start = Instant::now();
    while !path.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before writing {}", path.display());
        }
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("{} was not written within a minute", path.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
