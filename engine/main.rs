//! The `edgemoe` command line. Parses arguments, runs the command, prints an error once: exit
//! status 1 for an error, 2 for a usage error (clap's, or [`cli::Usage`] found after parsing).

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A closed standard output (`edgemoe inspect B | head -1`) ends the process quietly, the way
    // it ends `cat` or `grep`: killed by SIGPIPE at the first write, exit status 128+13 = 141 in
    // a shell. Rust sets SIGPIPE to "ignore" before `main`, which turns that write into an EPIPE
    // error that `println!` answers with a panic (exit 101). Restoring the default disposition
    // covers every write in one place — the commands' `println!`s, the library's printing,
    // streamed tokens, any thread — where routing each of them through a fallible write would
    // leave the next new `println!` to panic again. Nobody reads what would have been printed,
    // so nothing is lost; files being written are not pipes and are unaffected.
    // SAFETY: called first thing in `main`, before any thread exists; SIG_DFL is a valid handler.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // Before any other thread and any large allocation.
    edgemoe::memory::reuse_freed_memory();
    // Before any other thread: an interrupted run removes its temporary files.
    edgemoe::interrupt::install();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(()) => ExitCode::SUCCESS,
        // Flags that do not go together: exit status 2, as clap's usage errors.
        Err(error) if error.downcast_ref::<cli::Usage>().is_some() => {
            eprintln!("error: {error}\n\nFor more information, try '--help'.");
            ExitCode::from(2)
        }
        Err(error) => {
            eprintln!("error: {}", one_line(&error));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause once: the library's errors already show
/// their cause (`path: No such file or directory`), where anyhow's `{:#}` would repeat it.
fn one_line(error: &anyhow::Error) -> String {
    let mut line = error.to_string();
    for cause in error.chain().skip(1) {
        let cause = cause.to_string();
        if !line.contains(&cause) {
            line = format!("{line}: {cause}");
        }
    }
    line
}
