//! The files a run writes: checked before the first step, written atomically.
//!
//! - [`check_output_file`] refuses, before any work is spent, a path that is a directory
//!   (`.`, `/`, `out/`), whose directory is missing, or where no file can be created (a
//!   probe file is created and removed beside it).
//! - [`check_run_outputs`] applies it to every file a training run writes
//!   (`--checkpoint`, `--json-report`) and refuses to replace an existing checkpoint
//!   unless `--resume` or `--overwrite-checkpoint` is given. A JSON report is output of
//!   one run, like a compiler's `-o`: an existing one is replaced. A `--timeline` can be
//!   large and is often kept to compare runs: an existing one is refused unless
//!   `--overwrite-timeline` is given.
//! - [`write_atomically`] is the one way files are written: a temporary file with a name
//!   of its own (`FILE.tmp.<pid>.<n>`, so concurrent writers never share one), fsync,
//!   rename over `FILE`, fsync of the directory. The temporary file is removed on every
//!   failure, including a SIGINT/SIGTERM seen while writing ([`crate::interrupt`]);
//!   readers see the old file or the new one, whole.
//!
//! ```
//! use ringtrain_train::outputs::{check_output_file, write_atomically};
//!
//! let dir = tempfile::tempdir()?;
//! let path = dir.path().join("notes.txt");
//! check_output_file("--notes", &path, "notes.txt")?;
//! write_atomically(&path, b"hello\n", "writing the notes")?;
//! assert_eq!(std::fs::read(&path)?, b"hello\n");
//! let err = check_output_file("--notes", dir.path(), "notes.txt").unwrap_err().to_string();
//! assert!(err.contains("is a directory"), "{err}");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::checkpoint::Checkpoint;
use crate::config::TrainConfig;
use crate::error::{Error, Result};
use crate::interrupt;

/// Bytes written between two checks for a stop.
const CHUNK: usize = 4 << 20;

/// The directory a file path lives in (`.` for a bare name).
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// Checks that `path` (the value of `flag`) can be written as a file: it is not a
/// directory, its directory exists, and a file can be created there (a probe file is
/// created and removed). `example` is a file name the error suggests instead.
///
/// # Errors
/// [`Error::InvalidValue`] naming `flag`, the path, what is wrong and what to do.
pub fn check_output_file(flag: &'static str, path: &Path, example: &str) -> Result<()> {
    let shown = path.display().to_string();
    let bad = |reason: String| Error::invalid(flag, &shown, reason);
    if path.as_os_str().is_empty() {
        return Err(bad(format!(
            "the path is empty; name a file such as `{example}`"
        )));
    }
    let names_a_directory = shown.ends_with('/') || path.file_name().is_none() || path.is_dir();
    if names_a_directory {
        return Err(bad(format!(
            "it is a directory, not a file; name a file in it, such as `{}`",
            path.join(example).display()
        )));
    }
    if let Ok(meta) = fs::metadata(path) {
        if !meta.is_file() {
            return Err(bad(
                "it exists and is not a regular file; choose another path".to_string(),
            ));
        }
    }
    let dir = directory_of(path);
    match fs::metadata(dir) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err(bad(format!(
                "`{}` is not a directory; choose a path in an existing directory",
                dir.display()
            )))
        }
        Err(e) => {
            return Err(bad(format!(
                "its directory `{}` cannot be used ({e}); create it first (mkdir -p {}) or choose another path",
                dir.display(),
                dir.display()
            )))
        }
    }
    let mut probe_name = std::ffi::OsString::from(".");
    probe_name.push(path.file_name().unwrap_or_default());
    probe_name.push(format!(".probe.{}", unique_suffix()));
    let probe = dir.join(probe_name);
    match fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(file) => {
            drop(file);
            let _ = fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(bad(format!(
            "no file can be created in `{}` ({e}); choose a writable directory",
            dir.display()
        ))),
    }
}

/// Checks every file a run with `config` writes (rank 0 writes them all): the checkpoint
/// and the JSON report are writable files, not the same one, and an existing checkpoint
/// is replaced only with `--resume` or `--overwrite-checkpoint`.
///
/// # Errors
/// [`Error::InvalidValue`] for a path that cannot be written; [`Error::CheckpointExists`]
/// for a checkpoint that would be silently replaced.
pub fn check_run_outputs(config: &TrainConfig) -> Result<()> {
    let output = &config.output;
    if let Some(path) = &output.checkpoint {
        check_output_file("--checkpoint", path, "run.ckpt")?;
        if !output.resume && !output.overwrite_checkpoint && fs::metadata(path).is_ok() {
            let holds = match Checkpoint::read_header(path) {
                Ok((then, step)) => format!("step {step} of a run with {}", describe(&then)),
                Err(e) => format!("it is not a readable ringtrain checkpoint: {}", e.reason()),
            };
            return Err(Error::CheckpointExists {
                path: path.clone(),
                holds,
            });
        }
    }
    if let Some(path) = &output.json_report {
        check_output_file("--json-report", path, "report.json")?;
        if output.checkpoint.as_deref() == Some(path.as_path()) {
            return Err(Error::invalid(
                "--json-report",
                path.display(),
                "it is also the --checkpoint file; give the report a path of its own",
            ));
        }
    }
    if let Some(path) = &output.timeline {
        check_output_file("--timeline", path, "timeline.json")?;
        for (flag, other) in [
            ("--checkpoint", &output.checkpoint),
            ("--json-report", &output.json_report),
        ] {
            if other.as_deref() == Some(path.as_path()) {
                return Err(Error::invalid(
                    "--timeline",
                    path.display(),
                    format!("it is also the {flag} file; give the timeline a path of its own"),
                ));
            }
        }
        if !output.overwrite_timeline && fs::metadata(path).is_ok() {
            return Err(Error::invalid(
                "--timeline",
                path.display(),
                "the file exists; pass --overwrite-timeline to replace it, or choose another path",
            ));
        }
    }
    Ok(())
}

/// The flags that say what a checkpoint holds.
fn describe(c: &TrainConfig) -> String {
    format!(
        "--model {} --encoder-type {} --source-lengths {} --bi-layer-input {} --num-units {} \
         --num-encoder-layers {} --num-decoder-layers {} --direction {} --optimizer {} \
         --variable-update {} --batch-size {} --seed {}",
        c.model.model,
        c.model.encoder_type,
        c.model.source_lengths.unwrap_or_default(),
        c.model.bi_layer_input.unwrap_or_default(),
        c.model.num_units,
        c.model.num_encoder_layers,
        c.model.num_decoder_layers,
        c.model.direction,
        c.run.optimizer,
        c.exchange.variable_update,
        c.data.batch_size,
        c.run.seed
    )
}

/// `<pid>.<n>`: unique among the processes of a machine and the writers of a process.
fn unique_suffix() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}.{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The temporary file a write of `path` goes through: `FILE.tmp.<pid>.<n>` beside it.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut name = path
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_else(|| "ringtrain-output".into());
    name.push(format!(".tmp.{}", unique_suffix()));
    directory_of(path).join(name)
}

/// Removes the temporary file unless it was renamed into place.
struct TempFile {
    path: PathBuf,
    renamed: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.renamed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Writes `bytes` to `path` atomically (see the module docs); `action` names the write
/// in errors ("writing the checkpoint").
///
/// # Errors
/// [`Error::Io`] naming the file; [`Error::Interrupted`] when SIGINT/SIGTERM arrived
/// before the rename (the old file, if any, is left as it was).
pub fn write_atomically(path: &Path, bytes: &[u8], action: &'static str) -> Result<()> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io {
            action,
            path,
            source,
        }
    };
    let stop = || interrupt::requested().map(|s| interrupt::while_writing(s, path));
    if let Some(e) = stop() {
        return Err(e);
    }
    let mut tmp = TempFile {
        path: temp_path(path),
        renamed: false,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp.path)
        .map_err(io(&tmp.path))?;
    for chunk in bytes.chunks(CHUNK) {
        file.write_all(chunk).map_err(io(&tmp.path))?;
        if let Some(e) = stop() {
            return Err(e);
        }
    }
    file.sync_all().map_err(io(&tmp.path))?;
    drop(file);
    if let Some(e) = stop() {
        return Err(e);
    }
    fs::rename(&tmp.path, path).map_err(io(path))?;
    tmp.renamed = true;
    // Persist the rename itself; some filesystems do not allow opening a directory, and
    // the data is already synced, so a failure here is harmless.
    if let Ok(d) = fs::File::open(directory_of(path)) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(flag: &'static str, path: &Path) -> String {
        check_output_file(flag, path, "run.ckpt")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn directories_missing_and_unwritable_places_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for p in [".", "/", "..", "some/dir/"] {
            let err = reason("--checkpoint", Path::new(p));
            assert!(
                err.contains("--checkpoint") && err.contains("is a directory"),
                "{p}: {err}"
            );
        }
        let err = reason("--checkpoint", dir.path());
        assert!(
            err.contains("is a directory") && err.contains("run.ckpt"),
            "{err}"
        );
        let missing = dir.path().join("no-such-dir").join("run.ckpt");
        let err = reason("--json-report", &missing);
        assert!(
            err.contains("--json-report") && err.contains("no-such-dir") && err.contains("mkdir"),
            "{err}"
        );
        // sysfs refuses new files even to root, where permission bits do not.
        let err = reason("--checkpoint", Path::new("/sys/ringtrain-probe.ckpt"));
        assert!(err.contains("no file can be created in `/sys`"), "{err}");
        let fine = dir.path().join("run.ckpt");
        check_output_file("--checkpoint", &fine, "run.ckpt").unwrap();
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            0,
            "the probe is removed"
        );
    }

    #[test]
    fn temporary_names_are_unique_and_beside_the_file() {
        let a = temp_path(Path::new("out/run.ckpt"));
        let b = temp_path(Path::new("out/run.ckpt"));
        assert_ne!(a, b);
        assert_eq!(a.parent(), Some(Path::new("out")));
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with(&format!("run.ckpt.tmp.{}.", std::process::id())),
            "{name}"
        );
        // Never `/.tmp` for a path without a file name.
        let root = temp_path(Path::new("/"));
        assert!(!root.starts_with("/"), "{}", root.display());
    }

    #[test]
    fn a_failed_write_leaves_no_temporary_file_and_the_old_content() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        write_atomically(&path, b"old", "writing").unwrap();
        // The rename fails: a directory stands where the file should go.
        let blocked = dir.path().join("blocked");
        fs::create_dir(blocked.join("")).unwrap();
        fs::write(blocked.join("x"), b"keep").unwrap();
        let err = write_atomically(&blocked, b"new", "writing").unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert_eq!(fs::read(&path).unwrap(), b"old");
    }
}
