//! Writing so that nobody ever sees half a file or half a bundle: every output is written under
//! a temporary name beside its target (the same directory, so the same filesystem), flushed and
//! fsynced, and only then renamed over the target, so the target holds the old content or the
//! new, never a mix, whatever fails or kills the writer in between.
//!
//! - [`write_file`] / [`AtomicFile`]: one file (results, reports, plans, caches, traces, charts,
//!   `paths.bin`). A failed or dropped writer leaves the target untouched and removes its
//!   temporary file. A target that is a symbolic link is resolved first, so the link keeps
//!   pointing at the new file; a target that is a FIFO or a character device (`/dev/stdout`)
//!   is not a file that can be replaced and is written in place.
//! - [`StagedDir`]: a whole directory (a model bundle), built under a temporary name beside the
//!   target and swapped in: on Linux with one `renameat2(RENAME_EXCHANGE)`, so the old directory
//!   stays whole at the target until the new one takes its place; elsewhere by renaming the old
//!   one aside first. The old content is deleted only once the new one is in place.
//!
//! A writer killed with SIGKILL cannot clean up: its temporary file or directory stays beside
//! the target, named `.NAME.` + random + `.partial`, and may be deleted by hand.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

/// Writes `bytes` to `path` atomically (see the module).
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = AtomicFile::create(path)?;
    file.write_all(bytes).map_err(|e| Error::io(path, e))?;
    file.commit()
}

/// A file being written under a temporary name beside its target; [`AtomicFile::commit`]
/// renames it into place. Dropped without a commit, it is removed and the target is untouched.
pub struct AtomicFile {
    /// The path the caller named (for errors).
    path: PathBuf,
    /// Where the content goes (symbolic links resolved).
    target: PathBuf,
    out: Output,
}

enum Output {
    Temp(BufWriter<tempfile::NamedTempFile>),
    /// A FIFO or device: written in place.
    Stream(BufWriter<File>),
}

impl AtomicFile {
    pub fn create(path: &Path) -> Result<Self> {
        let target = resolve_links(path);
        let stream = std::fs::metadata(&target)
            .map(|m| !m.is_file() && !m.is_dir())
            .unwrap_or(false);
        let out = if stream {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(&target)
                .map_err(|e| Error::io(path, e))?;
            Output::Stream(BufWriter::new(file))
        } else {
            let temp = tempfile::Builder::new()
                .prefix(&hidden_prefix(&target))
                .suffix(".partial")
                // Like `File::create`: read-write for everyone, less the umask.
                .permissions(std::fs::Permissions::from_mode(0o666))
                .tempfile_in(parent_of(&target))
                .map_err(|e| Error::io(path, e))?;
            Output::Temp(BufWriter::new(temp))
        };
        Ok(AtomicFile {
            path: path.to_path_buf(),
            target,
            out,
        })
    }

    /// Flushes, fsyncs and renames the file over its target (and fsyncs the directory).
    pub fn commit(self) -> Result<()> {
        let io = |e| Error::io(&self.path, e);
        match self.out {
            Output::Stream(mut out) => out.flush().map_err(io),
            Output::Temp(out) => {
                let temp = out.into_inner().map_err(|e| io(e.into_error()))?;
                temp.as_file().sync_all().map_err(io)?;
                temp.persist(&self.target).map_err(|e| io(e.error))?;
                sync_dir(parent_of(&self.target));
                Ok(())
            }
        }
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match &mut self.out {
            Output::Temp(out) => out.write(buf),
            Output::Stream(out) => out.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match &mut self.out {
            Output::Temp(out) => out.flush(),
            Output::Stream(out) => out.flush(),
        }
    }
}

/// A directory being built under a temporary name beside its target; [`StagedDir::commit`]
/// puts it in the target's place. Dropped without a commit, it is removed with its content and
/// the target is untouched.
pub struct StagedDir {
    /// The path the caller named (for errors).
    path: PathBuf,
    target: PathBuf,
    staged: Option<tempfile::TempDir>,
}

impl StagedDir {
    /// Creates the staging directory beside `path` (whose missing parents are created).
    pub fn beside(path: &Path) -> Result<Self> {
        let target = resolve_links(path);
        let parent = parent_of(&target);
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let staged = tempfile::Builder::new()
            .prefix(&hidden_prefix(&target))
            .suffix(".partial")
            .permissions(std::fs::Permissions::from_mode(0o777))
            .tempdir_in(parent)
            .map_err(|e| Error::io(path, e))?;
        Ok(StagedDir {
            path: path.to_path_buf(),
            target,
            staged: Some(staged),
        })
    }

    /// Where to write the directory's files.
    pub fn path(&self) -> &Path {
        self.staged.as_ref().expect("not committed").path()
    }

    /// Puts the staged directory in the target's place: fsyncs its files and itself, swaps it
    /// with an existing target (or renames it there), fsyncs the parent, then deletes the old
    /// content.
    pub fn commit(mut self) -> Result<()> {
        let staged = self.staged.take().expect("committed once").keep();
        let result = self.swap_in(&staged);
        // On success `staged` holds the old content; on failure the new one. Either goes.
        let _ = std::fs::remove_dir_all(&staged);
        result
    }

    fn swap_in(&self, staged: &Path) -> Result<()> {
        let io = |e| Error::io(&self.path, e);
        for entry in std::fs::read_dir(staged).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.is_file() {
                File::open(&path)
                    .and_then(|f| f.sync_all())
                    .map_err(|e| Error::io(&path, e))?;
            }
        }
        sync_dir(staged);
        let parent = parent_of(&self.target);
        if std::fs::symlink_metadata(&self.target).is_err() {
            std::fs::rename(staged, &self.target).map_err(io)?;
        } else if !exchange(staged, &self.target)? {
            // No atomic exchange here: the old directory goes aside first, and comes back if
            // the new one cannot take its place.
            let aside = tempfile::Builder::new()
                .prefix(&hidden_prefix(&self.target))
                .suffix(".old")
                .tempdir_in(parent)
                .map_err(io)?
                .keep();
            std::fs::remove_dir(&aside).map_err(io)?;
            std::fs::rename(&self.target, &aside).map_err(io)?;
            if let Err(e) = std::fs::rename(staged, &self.target) {
                let _ = std::fs::rename(&aside, &self.target);
                return Err(io(e));
            }
            let _ = std::fs::remove_dir_all(&aside);
        }
        sync_dir(parent);
        Ok(())
    }
}

/// Swaps two paths atomically (Linux `renameat2(RENAME_EXCHANGE)`); `false` where the system or
/// the filesystem cannot.
#[cfg(target_os = "linux")]
fn exchange(a: &Path, b: &Path) -> Result<bool> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| Error::Input(format!("{}: a path with a NUL byte", p.display())))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: plain syscall on two NUL-terminated paths that live for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(Error::io(b, e)),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange(_: &Path, _: &Path) -> Result<bool> {
    Ok(false)
}

/// fsyncs a directory so that a rename in it survives a power loss (best effort: some
/// filesystems refuse to sync a directory).
fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// `path` with its symbolic links followed (as many as the kernel would), dangling or not, so
/// that the file replaced is the one the link points at and the link stays.
fn resolve_links(path: &Path) -> PathBuf {
    let mut p = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::read_link(&p) {
            Ok(to) if to.is_absolute() => p = to,
            Ok(to) => p = parent_of(&p).join(to),
            Err(_) => break,
        }
    }
    p
}

fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// `.NAME.` for the temporary files of `NAME`, hidden from `ls` and globs like `*.json`.
fn hidden_prefix(target: &Path) -> String {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(".{name}.")
}

/// `path` made absolute with every symbolic link resolved, also where its last components do
/// not exist yet (the nearest existing ancestor is resolved and the rest appended, `..`
/// applied): two paths name the same place exactly when these are equal.
pub fn canonical(path: &Path) -> Result<PathBuf> {
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::io(path, e))?
            .join(path)
    };
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(c) = std::fs::canonicalize(existing) {
            let mut out = c;
            for part in rest.iter().rev() {
                match part {
                    Component::ParentDir => {
                        out.pop();
                    }
                    Component::Normal(name) => out.push(name),
                    _ => {}
                }
            }
            return Ok(out);
        }
        match (existing.parent(), existing.components().next_back()) {
            (Some(parent), Some(last)) => {
                rest.push(last);
                existing = parent;
            }
            _ => return Ok(absolute),
        }
    }
}

/// Fails, before anything is written, when output `output` (a file or a directory, named by
/// its flag) and any of `inputs` are the same place or one lies inside the other, symbolic links
/// resolved: writing it would overwrite what is being read. Streams (FIFOs, devices such as
/// `/dev/stdin` and `/dev/stdout`, which may well be the same terminal) are not files to
/// overwrite and are left out.
pub fn refuse_overlap(output: (&str, &Path), inputs: &[(&str, &Path)]) -> Result<()> {
    refuse_overlaps(&[output], inputs)
}

/// [`refuse_overlap`] for every output of one run, which must also be pairwise apart: two
/// outputs on one path (or one inside the other) would lose one of them. An output's name is
/// its flag, optionally followed by what the file is (`--out (its report)`, for a file written
/// beside the flag's path); the error asks for another value of that flag.
pub fn refuse_overlaps(outputs: &[(&str, &Path)], inputs: &[(&str, &Path)]) -> Result<()> {
    let resolved = |named: &[(&str, &Path)]| -> Result<Vec<(String, PathBuf, String)>> {
        let mut files = Vec::new();
        for &(name, path) in named {
            if !is_stream(path) {
                files.push((
                    name.to_string(),
                    canonical(path)?,
                    path.display().to_string(),
                ));
            }
        }
        Ok(files)
    };
    let outputs = resolved(outputs)?;
    let inputs = resolved(inputs)?;
    for (i, (out_name, out, out_shown)) in outputs.iter().enumerate() {
        let flag = out_name.split_whitespace().next().unwrap_or(out_name);
        for (name, input, shown) in &inputs {
            if let Some(how) = overlap(out, input) {
                return Err(Error::Input(format!(
                    "{out_name} {out_shown} {how} {name} {shown}: writing it would overwrite the input; choose another {flag}"
                )));
            }
        }
        for (name, other, shown) in &outputs[..i] {
            if let Some(how) = overlap(out, other) {
                return Err(Error::Input(format!(
                    "{out_name} {out_shown} {how} {name} {shown}: one run cannot write both; choose another {flag}"
                )));
            }
        }
    }
    Ok(())
}

/// A FIFO or a device: nothing a write could replace.
fn is_stream(path: &Path) -> bool {
    std::fs::metadata(path)
        .map(|m| !m.is_file() && !m.is_dir())
        .unwrap_or(false)
}

/// How canonical path `a` overlaps canonical path `b`, if it does.
fn overlap(a: &Path, b: &Path) -> Option<&'static str> {
    if a == b {
        Some("is the same path as")
    } else if b.starts_with(a) {
        Some("contains")
    } else if a.starts_with(b) {
        Some("lies inside")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_write_leaves_the_target_and_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        std::fs::write(&path, "old").unwrap();
        let mut file = AtomicFile::create(&path).unwrap();
        file.write_all(b"new, half written").unwrap();
        drop(file);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        write_file(&path, b"new").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_link_is_followed_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.txt");
        let link = dir.path().join("link.txt");
        std::fs::write(&real, "old").unwrap();
        std::os::unix::fs::symlink("real.txt", &link).unwrap();
        write_file(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(std::fs::read_to_string(&real).unwrap(), "new");
    }

    #[test]
    fn a_staged_directory_replaces_the_old_one_whole() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("bundle");
        std::fs::create_dir(&target).unwrap();
        std::fs::write(target.join("a"), "old").unwrap();
        std::fs::write(target.join("stale"), "old").unwrap();
        // Dropped: nothing changes.
        let staged = StagedDir::beside(&target).unwrap();
        std::fs::write(staged.path().join("a"), "new").unwrap();
        drop(staged);
        assert_eq!(std::fs::read_to_string(target.join("a")).unwrap(), "old");
        let staged = StagedDir::beside(&target).unwrap();
        std::fs::write(staged.path().join("a"), "new").unwrap();
        staged.commit().unwrap();
        assert_eq!(std::fs::read_to_string(target.join("a")).unwrap(), "new");
        assert!(!target.join("stale").exists());
        // Nothing left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn canonical_paths_resolve_links_and_missing_tails() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("link")).unwrap();
        let real = std::fs::canonicalize(&real).unwrap();
        assert_eq!(canonical(&dir.path().join("link")).unwrap(), real);
        assert_eq!(
            canonical(&dir.path().join("link/new/../x")).unwrap(),
            real.join("x")
        );
    }
}
