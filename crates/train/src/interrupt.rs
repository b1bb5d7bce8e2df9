//! SIGINT and SIGTERM: a rank that is asked to stop finishes what it cannot cut short,
//! removes its temporary files and says what was interrupted.
//!
//! [`install`] registers handlers (with `signal-hook`) that only record the signal; the
//! trainer checks [`requested`] at every step boundary and the atomic writes of
//! [`crate::outputs`] check it between chunks and before the rename, so a stop never
//! leaves half a file or a stray temporary one. A second signal of either kind ends the
//! process at once (exit status 128 + signal), for a rank that is stuck where no check
//! runs. Without [`install`] nothing changes: the signals keep their default action.
//!
//! ```
//! // A program that embeds the trainer and stops it on its own asks for the same stop.
//! assert_eq!(ringtrain_train::interrupt::signal_name(15), "SIGTERM");
//! ```

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::error::{Error, Result};

/// The signal received (0: none yet).
fn pending() -> &'static Arc<AtomicUsize> {
    static PENDING: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    PENDING.get_or_init(|| Arc::new(AtomicUsize::new(0)))
}

/// Registers the SIGINT and SIGTERM handlers of a training process (once; later calls
/// do nothing).
///
/// # Errors
/// [`Error::SignalHandler`] when the operating system refuses a handler.
pub fn install() -> Result<()> {
    static INSTALLED: Mutex<bool> = Mutex::new(false);
    let mut installed = INSTALLED.lock().unwrap_or_else(|e| e.into_inner());
    if *installed {
        return Ok(());
    }
    let armed = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        let register = || -> std::io::Result<()> {
            // Registered first, so it sees the flag before this signal sets it: only a
            // second signal ends the process.
            signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, armed.clone())?;
            signal_hook::flag::register(signal, armed.clone())?;
            signal_hook::flag::register_usize(signal, pending().clone(), signal as usize)?;
            Ok(())
        };
        register().map_err(|source| Error::SignalHandler {
            signal: signal_name(signal),
            source,
        })?;
    }
    *installed = true;
    Ok(())
}

/// The signal that asked this process to stop, if one did.
pub fn requested() -> Option<i32> {
    match pending().load(Ordering::SeqCst) {
        0 => None,
        s => i32::try_from(s).ok(),
    }
}

/// Asks for a stop as `signal` would (what the handlers do): for programs that embed the
/// trainer and stop it on their own.
pub fn request(signal: i32) {
    pending().store(usize::try_from(signal).unwrap_or(0), Ordering::SeqCst);
}

/// `SIGINT`, `SIGTERM`, or `signal N`.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        9 => "SIGKILL",
        15 => "SIGTERM",
        _ => "a signal",
    }
}

/// The error for a stop seen while writing `path`: the caller knows more and usually
/// replaces it with its own [`Error::Interrupted`].
pub(crate) fn while_writing(signal: i32, path: &std::path::Path) -> Error {
    Error::Interrupted {
        signal,
        during: format!("while writing `{}`", path.display()),
        checkpoint: "the file was left as it was".to_string(),
    }
}
