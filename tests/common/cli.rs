//! Running the `edgemoe` binary and judging its output.

use std::io::Write;
use std::process::{Output, Stdio};

/// Starts `edgemoe args…` with `stdin` and its standard output and error piped.
fn spawn(args: &[&str], stdin: Stdio) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_edgemoe"))
        .args(args)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Starts `edgemoe args…` with no standard input and its outputs piped, for a test that
/// signals or watches it while it runs.
pub fn start(args: &[&str]) -> std::process::Child {
    spawn(args, Stdio::null())
}

/// Sends `signal` to a running child.
pub fn send_signal(child: &std::process::Child, signal: i32) {
    // SAFETY: plain kill(2) on the id of a child this test started and has not reaped.
    let status = unsafe { libc::kill(child.id() as libc::pid_t, signal) };
    assert_eq!(status, 0, "kill({}, {signal})", child.id());
}

/// Runs `edgemoe args…` with `stdin` (nothing if `None`) on its standard input.
pub fn run(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = spawn(args, Stdio::piped());
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.unwrap_or("").as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The standard output of a run that must have succeeded.
pub fn stdout(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", stderr(out));
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Asserts a clean failure: exit code 1, one `error:` line mentioning every `needle`, no panic.
pub fn assert_fails(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    // One error line (warnings, e.g. O_DIRECT refused by the filesystem, may come before it).
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error: ")).count(),
        1,
        "stderr: {err}"
    );
    for needle in needles {
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
    }
}

/// Asserts a usage error: exit code 2, an `error:` line mentioning every `needle`, no panic.
pub fn assert_usage(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error: ")).count(),
        1,
        "stderr: {err}"
    );
    for needle in needles {
        assert!(err.contains(needle), "expected `{needle}` in: {err}");
    }
}

/// Runs `edgemoe args…` with its standard output a pipe whose reading end is closed before the
/// program writes anything (as `edgemoe … | head -0` would), and no standard input.
pub fn run_with_closed_stdout(args: &[&str]) -> Output {
    let mut child = spawn(args, Stdio::null());
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

/// [`run`] with no standard input that must end within `secs` seconds (it is killed and the
/// test fails otherwise: a run blocked on opening a FIFO, say).
pub fn run_within(args: &[&str], secs: u64) -> Output {
    run_within_env(args, &[], secs)
}

/// [`run_within`] with `env` added to the environment.
pub fn run_within_env(args: &[&str], env: &[(&str, &str)], secs: u64) -> Output {
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_edgemoe"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() >= secs {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "`edgemoe {}` still running after {secs} s; stderr: {}",
                args.join(" "),
                stderr(&out)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// Makes a FIFO (named pipe) at `path`.
pub fn mkfifo(path: &std::path::Path) {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "mkfifo {}", path.display());
}
