//! A bundle's `manifest.json`: the length and CRC-32 of every file of the bundle, recorded when
//! the file is written (`convert` lists all of them, written last; `calibrate` adds `paths.bin`),
//! so that a damaged file is found by name when it is read instead of silently changing what
//! the model computes.
//!
//! ```json
//! { "manifest_version": 1,
//!   "files": { "config.json": { "bytes": 1003, "crc32": "9a0c3e21" }, … },
//!   "checksum": "5d41c0aa" }
//! ```
//!
//! `checksum` is the CRC-32 of `files` as compact JSON, so that a damaged manifest is told apart
//! from a damaged file. What each file's check costs and when it runs is the bundle's business
//! (`bundle.rs`); this module knows files, lengths and checksums.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const MANIFEST_FILE: &str = "manifest.json";
pub const MANIFEST_VERSION: u32 = 1;

/// One file's length and CRC-32 (IEEE, as 8 hex digits).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileSum {
    pub bytes: u64,
    pub crc32: String,
}

impl FileSum {
    fn of_bytes(bytes: &[u8]) -> Self {
        FileSum {
            bytes: bytes.len() as u64,
            crc32: hex(crc32fast::hash(bytes)),
        }
    }

    /// The sum of a file, read in 1 MiB pieces (never whole into memory).
    pub fn of_file(path: &Path) -> Result<Self> {
        let mut file = crate::io::open_file(path)?;
        let mut hasher = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut bytes = 0u64;
        loop {
            let n = file.read(&mut buf).map_err(|e| Error::io(path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok(FileSum {
            bytes,
            crc32: hex(hasher.finalize()),
        })
    }
}

/// One plain file name: no directory part, not `.` or `..`, not empty, no NUL.
fn is_bundle_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

fn hex(crc: u32) -> String {
    format!("{crc:08x}")
}

/// The recorded sums of a bundle's files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub manifest_version: u32,
    pub files: BTreeMap<String, FileSum>,
    /// CRC-32 of `files` as compact JSON.
    pub checksum: String,
}

impl Default for Manifest {
    fn default() -> Self {
        Manifest {
            manifest_version: MANIFEST_VERSION,
            files: BTreeMap::new(),
            checksum: String::new(),
        }
    }
}

impl Manifest {
    /// Records file `name` of `dir` as it is on disk now.
    pub fn record(&mut self, dir: &Path, name: &str) -> Result<()> {
        let sum = FileSum::of_file(&dir.join(name))?;
        self.files.insert(name.to_string(), sum);
        Ok(())
    }

    /// Records file `name` with content `bytes` (about to be written).
    pub fn record_bytes(&mut self, name: &str, bytes: &[u8]) {
        self.files
            .insert(name.to_string(), FileSum::of_bytes(bytes));
    }

    fn files_checksum(&self) -> String {
        let json = serde_json::to_string(&self.files).expect("sums serialize");
        hex(crc32fast::hash(json.as_bytes()))
    }

    /// Writes `dir/manifest.json` atomically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut manifest = self.clone();
        manifest.checksum = self.files_checksum();
        crate::io::write_json(&dir.join(MANIFEST_FILE), &manifest)
    }

    /// `dir`'s manifest, or `None` for a bundle written before manifests existed.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(MANIFEST_FILE);
        if std::fs::symlink_metadata(&path).is_err() {
            return Ok(None);
        }
        let text = crate::io::read_text(&path)?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| Error::corrupt(&path, None, format!("invalid manifest: {e}")))?;
        if manifest.manifest_version != MANIFEST_VERSION {
            return Err(Error::format(
                &path,
                format!(
                    "manifest version {}, this engine reads version {MANIFEST_VERSION}; convert the model again",
                    manifest.manifest_version
                ),
            ));
        }
        let actual = manifest.files_checksum();
        if actual != manifest.checksum {
            return Err(Error::corrupt(
                &path,
                None,
                format!(
                    "checksum mismatch (it records {}, its list of files gives {actual})",
                    manifest.checksum
                ),
            ));
        }
        // A file name inside the bundle, nothing else: a listed `/dev/…`, `../…` or absolute
        // path would make `inspect --verify` and every open look outside the bundle.
        if let Some(name) = manifest.files.keys().find(|n| !is_bundle_file_name(n)) {
            return Err(Error::corrupt(
                &path,
                None,
                format!("lists {name:?}, which is not the name of a file inside the bundle"),
            ));
        }
        Ok(Some(manifest))
    }

    /// The recorded sum of `name`; a file the manifest does not list is not part of the bundle
    /// it describes.
    fn sum(&self, dir: &Path, name: &str) -> Result<&FileSum> {
        self.files.get(name).ok_or_else(|| {
            Error::corrupt(
                dir.join(name),
                None,
                format!("not listed in {MANIFEST_FILE} (a file from another bundle?)"),
            )
        })
    }

    /// Fails unless `bytes`, read from `dir/name`, are what the manifest records.
    pub fn check_bytes(&self, dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
        compare(dir, name, self.sum(dir, name)?, &FileSum::of_bytes(bytes))
    }

    /// Fails unless file `dir/name` (read in pieces) is what the manifest records.
    pub fn check_file(&self, dir: &Path, name: &str) -> Result<()> {
        let want = self.sum(dir, name)?;
        let path = dir.join(name);
        if std::fs::symlink_metadata(&path).is_err() {
            return Err(missing(dir, name));
        }
        compare(dir, name, want, &FileSum::of_file(&path)?)
    }

    /// Fails unless every listed file but those in `skip` exists with its recorded length
    /// (metadata only: cheap enough for every open).
    pub fn check_lengths(&self, dir: &Path, skip: &[&str]) -> Result<()> {
        for (name, want) in &self.files {
            if skip.contains(&name.as_str()) {
                continue;
            }
            let path = dir.join(name);
            let Ok(meta) = std::fs::metadata(&path) else {
                return Err(missing(dir, name));
            };
            if meta.is_file() && meta.len() != want.bytes {
                return Err(Error::corrupt(
                    path,
                    None,
                    format!(
                        "{} bytes, {MANIFEST_FILE} records {} (truncated or replaced)",
                        meta.len(),
                        want.bytes
                    ),
                ));
            }
        }
        Ok(())
    }
}

fn missing(dir: &Path, name: &str) -> Error {
    Error::corrupt(
        dir.join(name),
        None,
        format!("missing ({MANIFEST_FILE} lists it)"),
    )
}

fn compare(dir: &Path, name: &str, want: &FileSum, got: &FileSum) -> Result<()> {
    if want == got {
        return Ok(());
    }
    Err(Error::corrupt(
        dir.join(name),
        None,
        format!(
            "checksum mismatch ({MANIFEST_FILE} records {} bytes with CRC-32 {}, the file has {} bytes with CRC-32 {})",
            want.bytes, want.crc32, got.bytes, got.crc32
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_listing_a_path_outside_the_bundle_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["/etc/passwd", "../x", "..", ".", "", "a/b", "/dev/zero"] {
            // A hostile manifest with a correct checksum of its own (the CRC is no signature).
            let mut m = Manifest::default();
            m.record_bytes(name, b"x");
            m.save(dir.path()).unwrap();
            let err = Manifest::load(dir.path()).unwrap_err().to_string();
            assert!(
                err.contains("manifest.json") && err.contains("not the name of a file inside"),
                "{name:?}: {err}"
            );
        }
        let mut m = Manifest::default();
        m.record_bytes("config.json", b"{}");
        m.save(dir.path()).unwrap();
        assert!(Manifest::load(dir.path()).unwrap().is_some());
    }

    #[test]
    fn a_changed_file_or_manifest_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.bin"), b"hello").unwrap();
        let mut m = Manifest::default();
        m.record(dir.path(), "a.bin").unwrap();
        m.save(dir.path()).unwrap();
        let m = Manifest::load(dir.path()).unwrap().unwrap();
        m.check_file(dir.path(), "a.bin").unwrap();
        m.check_bytes(dir.path(), "a.bin", b"hello").unwrap();
        let err = m.check_bytes(dir.path(), "a.bin", b"hellp").unwrap_err();
        assert!(
            err.to_string().contains("a.bin: checksum mismatch"),
            "{err}"
        );
        let err = m.check_bytes(dir.path(), "b.bin", b"").unwrap_err();
        assert!(err.to_string().contains("not listed"), "{err}");
        // One changed digit of a recorded CRC: the manifest is the damaged file.
        let path = dir.path().join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).unwrap();
        let crc = &m.files["a.bin"].crc32;
        let flipped = format!(
            "{}{}",
            if crc.starts_with('0') { "1" } else { "0" },
            &crc[1..]
        );
        std::fs::write(&path, text.replace(crc.as_str(), &flipped)).unwrap();
        let err = Manifest::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("manifest.json: checksum mismatch"), "{err}");
    }
}
