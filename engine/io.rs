//! Small file helpers every layer uses: JSON in and out naming the file in every error (out
//! through [`crate::atomic`]), the one
//! check that a path to read is a regular file (not a directory, not a FIFO that would block)
//! or, for a file the user names as input, a file or a stream they chose (`<(cmd)`, /dev/stdin),
//! the check that an output path can be written before work starts, and the one place that asks
//! the kernel to drop a file's cached pages.

use std::path::Path;

use crate::error::{Error, Result};

/// Reads and parses a JSON file, naming the file in every error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = read_text(path)?;
    serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}

/// Writes `value` as pretty JSON (with a final newline) atomically ([`crate::atomic`]), naming
/// the file in errors.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let json = serde_json::to_string_pretty(value)
        .map_err(|e| Error::format(path, format!("cannot serialize: {e}")))?;
    crate::atomic::write_file(path, (json + "\n").as_bytes())
}

/// Asks the kernel to drop the cached pages of an open file (best effort), so the next read
/// comes from the device.
pub fn drop_page_cache(file: &std::fs::File) {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on a file descriptor the caller keeps open for the call.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// [`drop_page_cache`] for a path (best effort: a file that cannot be opened is skipped).
pub fn drop_cached_pages(path: &Path) {
    if let Ok(file) = std::fs::File::open(path) {
        drop_page_cache(&file);
    }
}

/// Fails unless `path` is a regular file (symbolic links followed), naming the path and what it
/// is instead. Every read of a bundle's file goes through here first: a directory would
/// otherwise read as a confusing error, and opening a FIFO where a bundle file should be blocks
/// until some other process writes to it, so the check reads metadata only and never opens the
/// path.
pub fn check_regular_file(path: &Path) -> Result<()> {
    check_file(path, false)
}

/// [`check_regular_file`] for a file the user names as input (`--input`, `--data`, `--pred`,
/// `--trace`, `--profile`): a FIFO or character device is allowed too, since a user who passes
/// `<(cmd)` or `/dev/stdin` means to stream into it; directories, sockets and block devices are
/// refused by name.
pub fn check_input_file(path: &Path) -> Result<()> {
    check_file(path, true)
}

fn check_file(path: &Path, streams_allowed: bool) -> Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let kind = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .file_type();
    let what = if kind.is_file() || (streams_allowed && (kind.is_fifo() || kind.is_char_device())) {
        return Ok(());
    } else if kind.is_dir() {
        "is a directory, not a file"
    } else if kind.is_fifo() {
        "is not a regular file (FIFO)"
    } else if kind.is_socket() {
        "is not a regular file (socket)"
    } else if kind.is_block_device() {
        "is not a regular file (block device)"
    } else if kind.is_char_device() {
        "is not a regular file (character device)"
    } else {
        "is not a regular file"
    };
    Err(Error::io(
        path,
        std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
    ))
}

/// Opens a regular file for reading ([`check_regular_file`] first), naming it in errors.
pub fn open_file(path: &Path) -> Result<std::fs::File> {
    check_regular_file(path)?;
    std::fs::File::open(path).map_err(|e| Error::io(path, e))
}

/// The text of a regular file ([`check_regular_file`] first), naming it in errors.
pub fn read_text(path: &Path) -> Result<String> {
    check_regular_file(path)?;
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// The text of a file the user names as input ([`check_input_file`] first), naming it in
/// errors.
pub fn read_input_text(path: &Path) -> Result<String> {
    check_input_file(path)?;
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// Opens a file the user names as input ([`check_input_file`] first), naming it in errors.
pub fn open_input_file(path: &Path) -> Result<std::fs::File> {
    check_input_file(path)?;
    std::fs::File::open(path).map_err(|e| Error::io(path, e))
}

/// The bytes of a regular file ([`check_regular_file`] first), naming it in errors.
pub fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    check_regular_file(path)?;
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

/// Checks, before any work starts, that `path` (the value of `flag`) can be written later: its
/// parent directory exists and is writable, and the path itself is not a directory. So a long
/// run does not end in "no such directory" when it saves its results.
pub fn check_output_path(flag: &str, path: &Path) -> Result<()> {
    let shown = path.display();
    if path.is_dir() {
        return Err(Error::Input(format!(
            "{flag} {shown}: is a directory; give a file path"
        )));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    check_writable_dir(flag, path, parent)
}

/// [`check_output_path`] for a flag whose value is a directory that a run creates (with its
/// missing parents) and fills: its nearest existing ancestor (itself included) must be a
/// writable directory.
pub fn check_output_dir(flag: &str, dir: &Path) -> Result<()> {
    let mut existing = dir;
    while std::fs::symlink_metadata(existing).is_err() {
        match existing.parent() {
            Some(p) if !p.as_os_str().is_empty() => existing = p,
            _ => {
                existing = Path::new(".");
                break;
            }
        }
    }
    check_writable_dir(flag, dir, existing)
}

fn check_writable_dir(flag: &str, path: &Path, dir: &Path) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let shown = path.display();
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(Error::Input(format!(
                "{flag} {shown}: {} is not a directory",
                dir.display()
            )))
        }
        Err(_) => {
            return Err(Error::Input(format!(
                "{flag} {shown}: directory {} does not exist",
                dir.display()
            )))
        }
    }
    let Ok(c_dir) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return Ok(());
    };
    // SAFETY: `access` reads a NUL-terminated path that lives for the call.
    if unsafe { libc::access(c_dir.as_ptr(), libc::W_OK) } != 0 {
        return Err(Error::Input(format!(
            "{flag} {shown}: directory {} is not writable",
            dir.display()
        )));
    }
    Ok(())
}
