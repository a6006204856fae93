//! Opening and reading an expert store (format in [`super::format`]): validation against the
//! expected layout, `O_DIRECT` or page-cache reads, emulated device pacing, and the CRC-32 of
//! every blob checked on every read.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::ExpertId;

use super::aligned::AlignedBuf;
use super::format::{
    ExpertEntry, ExpertLayout, StoreIndex, BLOB_ALIGN, HEADER_BYTES, STORE_MAGIC, STORE_VERSION,
};

/// How expert blobs are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StorageMode {
    /// Through the page cache (repeated runs read from RAM, not from the device).
    #[default]
    Cached,
    /// `O_DIRECT`: every read goes to the device, as on a board whose page cache cannot hold
    /// the experts. Blobs are page-aligned and padded, so whole padded blobs are read into
    /// page-aligned slots.
    Direct,
    /// `O_DIRECT` reads paced to a device profile's bandwidth and latency ([`ReadPacer`]).
    Emulate,
}

/// Paces reads to a device's speed: every read costs `latency + bytes / bandwidth`, and reads
/// queue behind each other as on one SD card or disk (the prefetch thread's reads delay the
/// compute thread's). The real read runs meanwhile; a read returns when both are done.
#[derive(Debug, Clone)]
pub struct ReadPacer {
    bytes_per_s: f64,
    latency: std::time::Duration,
    /// Shared by clones: one device queue.
    busy_until: std::sync::Arc<std::sync::Mutex<std::time::Instant>>,
}

impl ReadPacer {
    pub fn new(bytes_per_s: f64, latency: std::time::Duration) -> Self {
        ReadPacer {
            bytes_per_s: bytes_per_s.max(1.0),
            latency,
            busy_until: std::sync::Arc::new(std::sync::Mutex::new(std::time::Instant::now())),
        }
    }

    /// Books a read of `bytes` on the emulated device; returns when it would be done.
    pub fn book(&self, bytes: u64) -> std::time::Instant {
        let cost =
            self.latency + std::time::Duration::from_secs_f64(bytes as f64 / self.bytes_per_s);
        let mut busy = self
            .busy_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let start = (*busy).max(std::time::Instant::now());
        *busy = start + cost;
        *busy
    }

    /// Sleeps until `done`.
    pub fn wait(done: std::time::Instant) {
        let now = std::time::Instant::now();
        if done > now {
            std::thread::sleep(done - now);
        }
    }
}

/// An open expert store: the validated index and the file to read blobs from.
pub struct ExpertStore {
    path: PathBuf,
    file: File,
    /// Set when reads bypass the page cache.
    direct: Option<File>,
    /// Set when reads are paced to an emulated device.
    pacer: Option<ReadPacer>,
    index: StoreIndex,
    /// Position of each expert in `index.experts`, by (stack, layer, expert).
    lookup: std::collections::HashMap<ExpertId, usize>,
}

impl ExpertStore {
    /// Opens and validates a store against the model it belongs to: magic, version, index
    /// checksum, every expert of every MoE block present with the model's shapes, and every blob
    /// inside the file (a truncated store is reported here, naming the first missing expert).
    pub fn open(path: &Path, layout: &ExpertLayout) -> Result<Self> {
        let file = crate::io::open_file(path)?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut header = [0u8; HEADER_BYTES];
        file.read_exact_at(&mut header, 0).map_err(|_| {
            Error::corrupt(
                path,
                None,
                format!("truncated expert store: {file_len} bytes, shorter than its {HEADER_BYTES}-byte header"),
            )
        })?;
        if &header[0..8] != STORE_MAGIC {
            return Err(Error::format(
                path,
                "not an edgemoe expert store (bad magic number)",
            ));
        }
        let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        if version != STORE_VERSION {
            return Err(Error::format(
                path,
                format!("expert store format version {version}, this engine reads version {STORE_VERSION}; convert the model again"),
            ));
        }
        let index_len = u64::from_le_bytes(header[16..24].try_into().expect("8 bytes"));
        let index_crc = u32::from_le_bytes(header[24..28].try_into().expect("4 bytes"));
        if HEADER_BYTES as u64 + index_len > file_len {
            return Err(Error::corrupt(
                path,
                None,
                format!(
                    "truncated expert store: index needs {index_len} bytes, file has {file_len}"
                ),
            ));
        }
        let mut index_bytes = vec![0u8; index_len as usize];
        file.read_exact_at(&mut index_bytes, HEADER_BYTES as u64)
            .map_err(|e| Error::io(path, e))?;
        if crc32fast::hash(&index_bytes) != index_crc {
            return Err(Error::corrupt(
                path,
                None,
                "expert store index is corrupted (checksum mismatch)",
            ));
        }
        let index: StoreIndex = bincode::deserialize(&index_bytes).map_err(|e| {
            Error::corrupt(path, None, format!("cannot decode expert store index: {e}"))
        })?;
        let mut lookup = std::collections::HashMap::new();
        for (i, entry) in index.experts.iter().enumerate() {
            if lookup.insert(entry.id, i).is_some() {
                return Err(Error::corrupt(
                    path,
                    Some(entry.id),
                    "appears twice in the index",
                ));
            }
            let (expected, length) = layout.blob(entry.encoding);
            if entry.matrices != expected || entry.length != length {
                return Err(Error::corrupt(
                    path,
                    Some(entry.id),
                    "stored layout does not match the model config",
                ));
            }
            if entry.offset % BLOB_ALIGN != 0 {
                return Err(Error::corrupt(
                    path,
                    Some(entry.id),
                    format!("blob offset {} is not page-aligned", entry.offset),
                ));
            }
            let end = entry.offset.saturating_add(entry.length);
            if end > file_len {
                return Err(Error::corrupt(
                    path,
                    Some(entry.id),
                    format!(
                        "truncated expert store: needs bytes {}..{}, the file has {file_len}",
                        entry.offset, end
                    ),
                ));
            }
        }
        for id in &layout.experts {
            if !lookup.contains_key(id) {
                return Err(Error::corrupt(path, Some(*id), "missing from the index"));
            }
        }
        if lookup.len() != layout.experts.len() {
            return Err(Error::corrupt(
                path,
                None,
                "the index lists experts the model config does not have",
            ));
        }
        Ok(ExpertStore {
            path: path.to_path_buf(),
            file,
            direct: None,
            pacer: None,
            index,
            lookup,
        })
    }

    /// Opens the store and switches to `mode`. Returns a warning when `O_DIRECT` is refused
    /// (tmpfs, some network filesystems) and reads fall back to the page cache after dropping
    /// the file's cached pages.
    pub fn open_with(
        path: &Path,
        layout: &ExpertLayout,
        mode: StorageMode,
    ) -> Result<(Self, Option<String>)> {
        let mut store = Self::open(path, layout)?;
        if mode == StorageMode::Cached {
            return Ok((store, None));
        }
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(file) => {
                store.direct = Some(file);
                // Probe one aligned read: some filesystems accept the flag but fail reads.
                if let Some(first) = store.index.experts.first().cloned() {
                    let mut probe = AlignedBuf::new(first.padded_length() as usize);
                    // Only an I/O failure says O_DIRECT does not work; a checksum mismatch is a
                    // corrupted expert, reported when that expert is needed.
                    if let Err(e @ Error::Io { .. }) =
                        store.read_expert(first.id, probe.as_mut_slice())
                    {
                        store.direct = None;
                        store.drop_page_cache();
                        return Ok((store, Some(format!(
                            "{}: O_DIRECT reads fail here ({e}); reading through the page cache instead",
                            path.display()
                        ))));
                    }
                }
                Ok((store, None))
            }
            Err(e) => {
                store.drop_page_cache();
                Ok((store, Some(format!(
                    "{}: the filesystem refuses O_DIRECT ({e}); reading through the page cache instead",
                    path.display()
                ))))
            }
        }
    }

    /// Paces every read from now on (`--storage emulate`).
    pub fn set_pacer(&mut self, pacer: Option<ReadPacer>) {
        self.pacer = pacer;
    }

    /// Asks the kernel to forget the store's cached pages (best effort).
    pub fn drop_page_cache(&self) {
        crate::io::drop_page_cache(&self.file);
    }

    pub fn storage_mode(&self) -> StorageMode {
        if self.direct.is_some() {
            StorageMode::Direct
        } else {
            StorageMode::Cached
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn index(&self) -> &StoreIndex {
        &self.index
    }

    pub fn entry(&self, id: ExpertId) -> Option<&ExpertEntry> {
        self.lookup.get(&id).map(|&i| &self.index.experts[i])
    }

    /// Bytes a slot needs to hold any expert of this store.
    pub fn max_padded_expert_bytes(&self) -> u64 {
        self.index
            .experts
            .iter()
            .map(ExpertEntry::padded_length)
            .max()
            .unwrap_or(0)
    }

    pub fn total_expert_bytes(&self) -> u64 {
        self.index.experts.iter().map(|e| e.length).sum()
    }

    /// Reads expert `id`'s blob into the front of `dest` and verifies its checksum. Returns the
    /// number of bytes read.
    pub fn read_expert(&self, id: ExpertId, dest: &mut [u8]) -> Result<u64> {
        let entry = self
            .entry(id)
            .ok_or_else(|| Error::corrupt(&self.path, Some(id), "not in this store"))?;
        let len = entry.length as usize;
        // Direct reads move whole padded blobs (aligned offset, length and buffer).
        let read_len = match self.direct {
            Some(_) => entry.padded_length() as usize,
            None => len,
        };
        let dest = dest.get_mut(..read_len).ok_or_else(|| {
            Error::Internal(format!(
                "{}: {id}: blob of {read_len} bytes does not fit the slot",
                self.path.display()
            ))
        })?;
        let done = self.pacer.as_ref().map(|p| p.book(read_len as u64));
        let file = self.direct.as_ref().unwrap_or(&self.file);
        file.read_exact_at(dest, entry.offset)
            .map_err(|e| Error::io(&self.path, e))?;
        if let Some(done) = done {
            ReadPacer::wait(done);
        }
        let dest = &dest[..len];
        let actual = crc32fast::hash(dest);
        if actual != entry.checksum {
            return Err(Error::Checksum {
                path: self.path.clone(),
                expert: id,
                expected: entry.checksum,
                actual,
            });
        }
        Ok(entry.length)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn pacing_delivers_the_configured_bandwidth() {
        // 8 MiB at 40 MiB/s + 1 ms = 201 ms, in four reads queued on one device.
        let pacer = ReadPacer::new(40.0 * 1024.0 * 1024.0, Duration::from_micros(250));
        let started = Instant::now();
        let mut last = started;
        for _ in 0..4 {
            last = pacer.book(2 << 20);
        }
        ReadPacer::wait(last);
        let elapsed = started.elapsed().as_secs_f64();
        let expected = 8.0 / 40.0 + 0.001;
        assert!(
            (elapsed - expected).abs() / expected < 0.1,
            "{elapsed:.3} s for {expected:.3} s"
        );
        // A second reader queues behind the first.
        let a = pacer.book(1 << 20);
        let b = pacer.book(1 << 20);
        assert!(b > a);
    }
}
