//! Temporary files and folders that an interrupted run removes. A run killed by SIGINT (Ctrl-C),
//! SIGTERM or SIGHUP never unwinds, so `Drop` guards do not run; what a guard here registers is
//! removed by a signal thread before the process dies of the signal as it would have (exit
//! status 128 + signal number in a shell).
//!
//! [`install`] (called by the binary first thing, before any other thread exists) blocks those
//! signals in the calling thread — every thread spawned afterwards inherits the mask — and
//! starts one thread that waits for them with `sigwait`. Cleanup therefore runs as ordinary code
//! on that thread, not in a signal handler, and may remove a whole folder. Child processes do
//! not inherit the mask (the standard library resets it before `exec`). In a library user's
//! process where [`install`] was never called, guards only unregister themselves.
//!
//! A guard does not remove anything when dropped: its owner removes the path in the ordinary
//! way (a `Drop`, a `TempDir`); the guard only covers the interrupted case.
//!
//! A long-running command (`edgemoe serve`) stops on a signal in its own way instead: while its
//! [`StopOnSignal`] guard lives, the first signal calls its handler (stop taking requests,
//! finish or cancel what runs, exit 0) and the process keeps running; a second signal ends it
//! as above, so a stuck shutdown can still be interrupted.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The signals that interrupt a run.
const SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// What to remove on an interrupt, by guard id.
static REGISTERED: Mutex<Vec<(u64, PathBuf)>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// What the first signal does instead of ending the process (see [`StopOnSignal`]).
type StopHandler = Box<dyn FnOnce(libc::c_int) + Send>;
static STOP_HANDLER: Mutex<Option<(u64, StopHandler)>> = Mutex::new(None);

/// While this guard lives, the first SIGINT, SIGTERM or SIGHUP calls `handler` (on the signal
/// thread) instead of ending the process; a later one ends it as usual. Only one handler is
/// kept: a new guard replaces the previous one.
#[must_use = "the handler is kept only while the guard lives"]
pub struct StopOnSignal {
    id: u64,
}

impl StopOnSignal {
    pub fn new(handler: impl FnOnce(libc::c_int) + Send + 'static) -> Self {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        *stop_handler() = Some((id, Box::new(handler)));
        StopOnSignal { id }
    }
}

impl Drop for StopOnSignal {
    fn drop(&mut self) {
        let mut handler = stop_handler();
        if handler.as_ref().is_some_and(|(id, _)| *id == self.id) {
            *handler = None;
        }
    }
}

fn stop_handler() -> std::sync::MutexGuard<'static, Option<(u64, StopHandler)>> {
    STOP_HANDLER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Removes `path` (a file, or a folder with everything in it) if the process is interrupted
/// while the guard lives.
#[must_use = "the path is covered only while the guard lives"]
pub struct RemoveOnInterrupt {
    id: u64,
}

impl RemoveOnInterrupt {
    pub fn new(path: &Path) -> Self {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        registered().push((id, path.to_path_buf()));
        RemoveOnInterrupt { id }
    }
}

impl Drop for RemoveOnInterrupt {
    fn drop(&mut self) {
        registered().retain(|(id, _)| *id != self.id);
    }
}

fn registered() -> std::sync::MutexGuard<'static, Vec<(u64, PathBuf)>> {
    REGISTERED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn signal_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset initialise and fill a set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in SIGNALS {
            libc::sigaddset(&mut set, signal);
        }
        set
    }
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and so in every thread spawned after) and
/// starts the thread that, on one of them, removes every registered path and then dies of that
/// signal. Call once, before spawning any thread.
pub fn install() {
    let set = signal_set();
    // SAFETY: changes this thread's signal mask with a valid, initialised set.
    unsafe {
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    let spawned = std::thread::Builder::new()
        .name("edgemoe-signals".into())
        .spawn(move || loop {
            let mut signal: libc::c_int = 0;
            // SAFETY: waits on a valid set for one of its (blocked) signals.
            if unsafe { libc::sigwait(&set, &mut signal) } != 0 {
                continue;
            }
            // Taken out, so that a second signal finds none and ends the process.
            let stop = stop_handler().take();
            if let Some((_, handler)) = stop {
                handler(signal);
                continue;
            }
            for (_, path) in registered().iter() {
                let _ = match std::fs::symlink_metadata(path) {
                    Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
                    _ => std::fs::remove_file(path),
                };
            }
            die_of(signal);
        });
    if spawned.is_err() {
        // No cleanup thread: let the signals act as before rather than be ignored.
        // SAFETY: restores this thread's mask with a valid set.
        unsafe {
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        }
    }
}

/// Ends the process by `signal`'s default action (what the user's shell expects to see).
fn die_of(signal: libc::c_int) -> ! {
    // SAFETY: plain syscalls: default disposition, unblock in this thread, send to this thread.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        let mut only: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut only);
        libc::sigaddset(&mut only, signal);
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &only, std::ptr::null_mut());
        libc::raise(signal);
    }
    // Not reached for SIGINT/SIGTERM/SIGHUP, whose default action ends the process.
    std::process::exit(128 + signal)
}
