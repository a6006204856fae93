//! Small file helpers every layer uses: JSON in and out naming the file in every error, and
//! the one place that asks the kernel to drop a file's cached pages.

use std::path::Path;

use crate::error::{Error, Result};

/// Reads and parses a JSON file, naming the file in every error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}

/// Writes `value` as pretty JSON (with a final newline), naming the file in errors.
pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let json = serde_json::to_string_pretty(value)
        .map_err(|e| Error::format(path, format!("cannot serialize: {e}")))?;
    std::fs::write(path, json + "\n").map_err(|e| Error::io(path, e))
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
