//! `ringtrain launch`: runs mpirun with what a user would otherwise have to know.
//!
//! - as root, Open MPI refuses to start without `OMPI_ALLOW_RUN_AS_ROOT=1` and
//!   `OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`;
//! - more ranks than cores on one machine needs `--oversubscribe`;
//! - ranks that use several threads (or share cores) must not be bound to one core:
//!   `--bind-to none`;
//! - in containers where cross-memory attach fails, shared-memory transfers need
//!   `OMPI_MCA_btl_vader_single_copy_mechanism=none`;
//! - the gradient-reduction thread overlaps backward on the same cores, so MPI should
//!   yield while it waits: `OMPI_MCA_mpi_yield_when_idle=1`.
//!
//! mpirun runs in a process group of its own, with no standard input. SIGINT, SIGTERM
//! and SIGHUP sent to the launcher (Ctrl-C, `timeout`, a job scheduler) are passed on to
//! mpirun once, which stops every rank; the launcher waits for it and exits with its
//! status (128 + the signal when it was killed, or when it ended cleanly although asked
//! to stop). mpirun that has not ended 10 s after the signal is killed with its process
//! group (Open MPI puts each rank in a group of its own and stops them itself).

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use signal_hook::consts::{SIGHUP, SIGINT, SIGKILL, SIGTERM};

use clap::Args;

use crate::error::{LauncherError, Result};

/// `ringtrain launch --np N [--hostfile F] -- train ...`
#[derive(Debug, Clone, Args)]
pub struct LaunchArgs {
    /// Number of ranks (processes) to start.
    #[arg(long = "np", short = 'n', value_parser = crate::positive_count)]
    pub np: usize,

    /// Open MPI hostfile for multi-machine runs (no oversubscription is added then).
    #[arg(long)]
    pub hostfile: Option<PathBuf>,

    /// The mpirun program to run.
    #[arg(long, default_value = "mpirun", env = "RINGTRAIN_MPIRUN")]
    pub mpirun: String,

    /// Extra arguments passed to mpirun as they are (repeat the flag for several).
    #[arg(long = "mpi-arg", allow_hyphen_values = true)]
    pub mpi_args: Vec<String>,

    /// Print the command without running it.
    #[arg(long)]
    pub dry_run: bool,

    /// The ringtrain subcommand each rank runs, after `--`, e.g. `-- train --use-synthetic-data`.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        required = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<String>,
}

/// The mpirun invocation `launch` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchPlan {
    /// mpirun.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Variables set for it (and so for every local rank).
    pub env: Vec<(String, String)>,
    /// Why the less obvious arguments were chosen.
    pub notes: Vec<String>,
    /// Discard the ranks' standard output, for a caller that reads their reports
    /// instead (`predict --validate`); their standard error still shows.
    pub quiet: bool,
}

impl LaunchPlan {
    /// The command as a shell line (environment first).
    pub fn shell_line(&self) -> String {
        let quote = |s: &str| {
            if !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=,:+@%".contains(c))
            {
                s.to_string()
            } else {
                format!("'{}'", s.replace('\'', "'\\''"))
            }
        };
        let mut parts: Vec<String> = self
            .env
            .iter()
            .map(|(k, v)| format!("{k}={}", quote(v)))
            .collect();
        parts.push(quote(&self.program));
        parts.extend(self.args.iter().map(|a| quote(a)));
        parts.join(" ")
    }
}

/// Facts about the machine the plan depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Machine {
    /// Cores available to this process.
    pub cores: usize,
    /// Running as root.
    pub is_root: bool,
}

impl Machine {
    /// The machine this process runs on.
    pub fn current() -> Self {
        use std::os::unix::fs::MetadataExt;
        Machine {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            is_root: std::fs::metadata("/proc/self")
                .map(|m| m.uid() == 0)
                .unwrap_or(false),
        }
    }
}

/// The value of `--threads` in a ringtrain command line (0 when absent).
fn threads_in(command: &[String]) -> usize {
    let mut it = command.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix("--threads=") {
            return v.parse().unwrap_or(0);
        }
        if a == "--threads" {
            return it.next().and_then(|v| v.parse().ok()).unwrap_or(0);
        }
    }
    0
}

/// Builds the mpirun command for `args` on `machine`, running `exe` on every rank.
pub fn plan(args: &LaunchArgs, machine: Machine, exe: &Path) -> LaunchPlan {
    let mut env = Vec::new();
    let mut notes = Vec::new();
    if machine.is_root {
        env.push(("OMPI_ALLOW_RUN_AS_ROOT".to_string(), "1".to_string()));
        env.push((
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM".to_string(),
            "1".to_string(),
        ));
        notes.push("running as root: Open MPI needs OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)".to_string());
    }
    env.push((
        "OMPI_MCA_btl_vader_single_copy_mechanism".to_string(),
        "none".to_string(),
    ));
    // The trainer's communication thread waits in MPI beside the compute threads of its
    // rank: yielding instead of spinning leaves their cores to backward.
    env.push(("OMPI_MCA_mpi_yield_when_idle".to_string(), "1".to_string()));
    let mut mpi = vec!["-np".to_string(), args.np.to_string()];
    if let Some(h) = &args.hostfile {
        mpi.push("--hostfile".to_string());
        mpi.push(h.display().to_string());
    }
    let oversubscribed = args.hostfile.is_none() && args.np > machine.cores;
    if oversubscribed {
        mpi.push("--oversubscribe".to_string());
        notes.push(format!(
            "{} ranks on {} cores: --oversubscribe",
            args.np, machine.cores
        ));
    }
    let threads = threads_in(&args.command);
    let threads_per_rank = if threads > 0 {
        threads
    } else {
        (machine.cores / args.np).max(1)
    };
    let binding_user_set = args.mpi_args.iter().any(|a| a.starts_with("--bind-to"));
    if !binding_user_set {
        if oversubscribed || threads_per_rank > 1 || args.np * threads_per_rank > machine.cores {
            mpi.push("--bind-to".to_string());
            mpi.push("none".to_string());
            notes.push(format!(
                "{threads_per_rank} thread(s) per rank x {} ranks on {} cores: --bind-to none so threads are not pinned to one core",
                args.np, machine.cores
            ));
        } else {
            mpi.push("--bind-to".to_string());
            mpi.push("core".to_string());
        }
    }
    for (k, _) in &env {
        mpi.push("-x".to_string());
        mpi.push(k.clone());
    }
    mpi.extend(args.mpi_args.iter().cloned());
    mpi.push(exe.display().to_string());
    mpi.extend(args.command.iter().cloned());
    LaunchPlan {
        program: args.mpirun.clone(),
        args: mpi,
        env,
        notes,
        quiet: false,
    }
}

/// Finds `program` on PATH (or checks it when it contains a slash).
pub fn find_program(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

/// Runs the plan, printing it first. Returns an error when mpirun is missing or a rank failed.
pub fn execute(plan: &LaunchPlan) -> Result<()> {
    let Some(program) = find_program(&plan.program) else {
        return Err(LauncherError::MpirunMissing {
            program: plan.program.clone(),
        });
    };
    eprintln!("ringtrain launch: {}", plan.shell_line());
    for n in &plan.notes {
        eprintln!("ringtrain launch:   ({n})");
    }
    // Handlers first: a signal that arrives while mpirun starts is passed on too.
    let received = Arc::new(AtomicUsize::new(0));
    let mut handlers = Vec::new();
    for signal in [SIGINT, SIGTERM, SIGHUP] {
        let id = signal_hook::flag::register_usize(signal, received.clone(), signal as usize)
            .map_err(LauncherError::Signals)?;
        handlers.push(id);
    }
    let result = run_and_forward(&program, plan, &received);
    for id in handlers {
        signal_hook::low_level::unregister(id);
    }
    let (status, forwarded) = result?;
    let code = exit_code(status);
    match forwarded {
        Some(signal) => Err(LauncherError::Interrupted {
            signal: ringtrain_train::interrupt::signal_name(signal),
            status: describe(status),
            code: if code == 0 { 128 + signal } else { code },
        }),
        None if status.success() => Ok(()),
        None => Err(LauncherError::RanksFailed {
            status: describe(status),
            code,
            command: plan.shell_line(),
        }),
    }
}

/// `kill(2)`; a process that is already gone is not an error here.
fn send(pid: i32, signal: i32) {
    // SAFETY: kill has no memory-safety preconditions; `pid` is mpirun's pid or, negated,
    // its process group, both created by this process.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// Runs mpirun in its own process group, passing on the first signal `received`
/// records; returns how it ended and the signal passed on, if any.
fn run_and_forward(
    program: &Path,
    plan: &LaunchPlan,
    received: &AtomicUsize,
) -> Result<(ExitStatus, Option<i32>)> {
    let mut child = Command::new(program)
        .args(&plan.args)
        .envs(plan.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null())
        .stdout(if plan.quiet {
            Stdio::null()
        } else {
            Stdio::inherit()
        })
        .process_group(0)
        .spawn()
        .map_err(|source| LauncherError::Spawn {
            program: program.display().to_string(),
            source,
        })?;
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    let mut forwarded: Option<(i32, Instant)> = None;
    let mut killed = false;
    let status = loop {
        let waited = child.try_wait().map_err(|source| LauncherError::Spawn {
            program: program.display().to_string(),
            source,
        })?;
        if let Some(status) = waited {
            break status;
        }
        let signal = i32::try_from(received.swap(0, Ordering::SeqCst)).unwrap_or(SIGTERM);
        match forwarded {
            None if signal != 0 => {
                eprintln!(
                    "ringtrain launch: {} received: passing it on to mpirun (pid {pid}) and waiting for the ranks to stop",
                    ringtrain_train::interrupt::signal_name(signal)
                );
                send(pid, signal);
                forwarded = Some((signal, Instant::now()));
            }
            Some((_, since)) if !killed && since.elapsed() > Duration::from_secs(10) => {
                eprintln!("ringtrain launch: mpirun did not stop within 10 s: killing it");
                send(-pid, SIGKILL);
                killed = true;
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Whatever mpirun left in its group (ranks it could not stop) goes with it.
    send(-pid, SIGKILL);
    Ok((status, forwarded.map(|(s, _)| s)))
}

/// mpirun's exit code, or 128 + the signal that killed it.
fn exit_code(status: ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// "exit code 3", "signal 15".
fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(s)) => format!(
            "signal {s} ({})",
            ringtrain_train::interrupt::signal_name(s)
        ),
        (None, None) => "an unknown status".to_string(),
    }
}

/// `ringtrain launch`.
pub fn run(args: &LaunchArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|source| LauncherError::Spawn {
        program: "ringtrain (own executable path)".to_string(),
        source,
    })?;
    let plan = plan(args, Machine::current(), &exe);
    if args.dry_run {
        println!("{}", plan.shell_line());
        return Ok(());
    }
    execute(&plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(np: usize, command: &[&str]) -> LaunchArgs {
        LaunchArgs {
            np,
            hostfile: None,
            mpirun: "mpirun".into(),
            mpi_args: vec![],
            dry_run: false,
            command: command.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn small_machine_as_root_gets_root_vars_oversubscription_and_no_binding() {
        let p = plan(
            &args(4, &["train", "--threads", "1"]),
            Machine {
                cores: 2,
                is_root: true,
            },
            Path::new("/x/ringtrain"),
        );
        let line = p.shell_line();
        assert!(line.contains("OMPI_ALLOW_RUN_AS_ROOT=1"), "{line}");
        assert!(line.contains("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"), "{line}");
        assert!(
            line.contains("OMPI_MCA_btl_vader_single_copy_mechanism=none"),
            "{line}"
        );
        assert!(line.contains("OMPI_MCA_mpi_yield_when_idle=1"), "{line}");
        assert!(line.contains("--oversubscribe"), "{line}");
        assert!(line.contains("--bind-to none"), "{line}");
        assert!(line.ends_with("/x/ringtrain train --threads 1"), "{line}");
    }

    #[test]
    fn fitting_single_threaded_ranks_bind_to_core_and_non_root_gets_no_root_vars() {
        let p = plan(
            &args(2, &["train", "--threads=1"]),
            Machine {
                cores: 8,
                is_root: false,
            },
            Path::new("rt"),
        );
        let line = p.shell_line();
        assert!(!line.contains("ALLOW_RUN_AS_ROOT"), "{line}");
        assert!(!line.contains("--oversubscribe"), "{line}");
        assert!(line.contains("--bind-to core"), "{line}");
        // default threads = cores / ranks = 4 > 1: no binding
        let p = plan(
            &args(2, &["train"]),
            Machine {
                cores: 8,
                is_root: false,
            },
            Path::new("rt"),
        );
        assert!(p.shell_line().contains("--bind-to none"));
    }

    #[test]
    fn missing_program_is_reported() {
        assert!(find_program("/nonexistent/mpirun-xyz").is_none());
        let p = plan(
            &args(2, &["train"]),
            Machine {
                cores: 2,
                is_root: false,
            },
            Path::new("rt"),
        );
        let p = LaunchPlan {
            program: "/nonexistent/mpirun-xyz".into(),
            ..p
        };
        let err = execute(&p).unwrap_err().to_string();
        assert!(
            err.contains("scripts/setup") && err.contains("mpirun-xyz"),
            "{err}"
        );
    }
}
