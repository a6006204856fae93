//! The expert store: one file holding every expert of a model, each as one contiguous,
//! page-aligned blob, so that loading an expert is one large read.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! offset 0   magic  b"EMOEXPRT"                       8 bytes
//!        8   format version (u32)                      4 bytes
//!        12  reserved, zero (u32)                      4 bytes
//!        16  index length in bytes (u64)               8 bytes
//!        24  CRC-32 of the index bytes (u32)           4 bytes
//!        28  reserved, zero (u32)                      4 bytes
//!        32  index: bincode(StoreIndex)
//!        …   zero padding up to a multiple of 4096
//!            blobs: one per expert, each starting on a 4096-byte boundary and padded to one
//! ```
//!
//! A blob holds the expert's matrices back to back, row-major, each starting on a 64-byte
//! boundary inside the blob — Switch's ReLU experts `wi` [d_ff, d_model] then `wo`
//! [d_model, d_ff]; SwiGLU experts (decoder-only families) `gate` and `up` [d_ff, d_model] then
//! `down` [d_model, d_ff], so one read brings all three — in the expert's stored encoding:
//! f32/f16/bf16 as is, or INT8/INT4/INT2 packed as `quant` documents
//! (each row on a byte boundary) followed, on the next 64-byte boundary, by the matrix's
//! per-row scales as little-endian f32. Each index entry records the blob's offset, its length, its
//! encoding, its matrices and the CRC-32 of its `length` bytes, which is verified on every read.
//! Page alignment keeps reads aligned for `O_DIRECT` and lets a blob land in a page-aligned slot.

use std::fmt;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{ModelSpec, Stack};
use crate::error::{Error, Result};
use crate::quant::QuantBits;
use crate::weights::WeightDtype;

pub const STORE_MAGIC: &[u8; 8] = b"EMOEXPRT";
pub const STORE_VERSION: u32 = 2;
pub const HEADER_BYTES: usize = 32;
/// Blob alignment: the page size of every board we target (and the `O_DIRECT` granule).
pub const BLOB_ALIGN: u64 = 4096;
/// Alignment of a matrix inside a blob (cache line / SIMD friendly).
pub const MATRIX_ALIGN: u64 = 64;

/// One expert of one MoE block: `layer` is the block index inside its stack (HF numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExpertId {
    pub stack: Stack,
    pub layer: u16,
    pub expert: u16,
}

impl fmt::Display for ExpertId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "expert {} of {} block {}",
            self.expert,
            self.stack.hf_prefix(),
            self.layer
        )
    }
}

/// How an expert's matrices are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExpertEncoding {
    /// Unquantized, in the given float type.
    Float(WeightDtype),
    /// Channel-wise symmetric linear quantization (per-row f32 scales).
    Quant(QuantBits),
}

impl ExpertEncoding {
    pub const ALL: [ExpertEncoding; 6] = [
        ExpertEncoding::Float(WeightDtype::F32),
        ExpertEncoding::Float(WeightDtype::F16),
        ExpertEncoding::Float(WeightDtype::BF16),
        ExpertEncoding::Quant(QuantBits::Int8),
        ExpertEncoding::Quant(QuantBits::Int4),
        ExpertEncoding::Quant(QuantBits::Int2),
    ];

    pub fn bits(self) -> u32 {
        match self {
            ExpertEncoding::Float(d) => 8 * d.size_bytes() as u32,
            ExpertEncoding::Quant(q) => q.bits(),
        }
    }

    /// `f32`, `f16`, `bf16`, `int8`, `int4`, `int2`.
    pub fn name(self) -> &'static str {
        match self {
            ExpertEncoding::Float(d) => d.name(),
            ExpertEncoding::Quant(q) => q.name(),
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        let t = text.trim().to_ascii_lowercase();
        let t = match t.as_str() {
            "8" => "int8",
            "4" => "int4",
            "2" => "int2",
            "16" => "f16",
            "32" => "f32",
            other => other,
        };
        Self::ALL.into_iter().find(|e| e.name() == t)
    }

    /// Stored bytes of a `rows × cols` matrix (without its scales).
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> u64 {
        match self {
            ExpertEncoding::Float(d) => (rows * cols * d.size_bytes()) as u64,
            ExpertEncoding::Quant(q) => q.matrix_bytes(rows, cols) as u64,
        }
    }

    /// Bytes of the per-row scales of a `rows`-row matrix.
    pub fn scales_bytes(self, rows: usize) -> u64 {
        match self {
            ExpertEncoding::Float(_) => 0,
            ExpertEncoding::Quant(_) => 4 * rows as u64,
        }
    }
}

/// One matrix inside an expert blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatrixEntry {
    /// HF name of the matrix inside the expert (`wi`, `wo`).
    pub name: String,
    pub rows: u32,
    pub cols: u32,
    /// Byte offset inside the blob.
    pub offset: u64,
    pub bytes: u64,
    /// Offset and length of the per-row f32 scales (quantized encodings; 0 otherwise).
    pub scales_offset: u64,
    pub scales_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertEntry {
    pub id: ExpertId,
    /// Byte offset of the blob in the store file (a multiple of [`BLOB_ALIGN`]).
    pub offset: u64,
    /// Meaningful bytes of the blob (the blob is padded to [`BLOB_ALIGN`] after them).
    pub length: u64,
    pub encoding: ExpertEncoding,
    pub matrices: Vec<MatrixEntry>,
    /// CRC-32 (IEEE) of the blob's `length` bytes.
    pub checksum: u32,
}

impl ExpertEntry {
    /// Bytes the blob occupies on disk and in a slot (padded).
    pub fn padded_length(&self) -> u64 {
        align_up(self.length, BLOB_ALIGN)
    }

    pub fn matrix(&self, name: &str) -> Option<&MatrixEntry> {
        self.matrices.iter().find(|m| m.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreIndex {
    pub experts: Vec<ExpertEntry>,
}

pub fn align_up(value: u64, align: u64) -> u64 {
    value.div_ceil(align) * align
}

/// The matrices of one expert as the engine stores them, in blob order.
pub fn expert_matrix_shapes(spec: &ModelSpec) -> Vec<(&'static str, usize, usize)> {
    spec.expert_matrices()
}

/// Lays out one expert's blob: matrix entries with offsets, and the meaningful length.
pub fn layout_expert(spec: &ModelSpec, encoding: ExpertEncoding) -> (Vec<MatrixEntry>, u64) {
    let mut offset = 0u64;
    let mut matrices = Vec::new();
    for (name, rows, cols) in expert_matrix_shapes(spec) {
        offset = align_up(offset, MATRIX_ALIGN);
        let bytes = encoding.matrix_bytes(rows, cols);
        let matrix_offset = offset;
        offset += bytes;
        let scales_bytes = encoding.scales_bytes(rows);
        let scales_offset = if scales_bytes > 0 {
            offset = align_up(offset, MATRIX_ALIGN);
            let at = offset;
            offset += scales_bytes;
            at
        } else {
            0
        };
        matrices.push(MatrixEntry {
            name: name.into(),
            rows: rows as u32,
            cols: cols as u32,
            offset: matrix_offset,
            bytes,
            scales_offset,
            scales_bytes,
        });
    }
    (matrices, offset)
}

/// Writes an expert store: the layout of every expert is fixed up front, blobs are written in
/// order, and the index (whose size does not depend on the checksums) is written last.
pub struct ExpertStoreWriter {
    path: PathBuf,
    file: File,
    index: StoreIndex,
    next: usize,
}

impl ExpertStoreWriter {
    /// `experts` lists every expert in the order their blobs will be written.
    pub fn create(
        path: &Path,
        spec: &ModelSpec,
        experts: &[(ExpertId, ExpertEncoding)],
    ) -> Result<Self> {
        let mut entries = Vec::with_capacity(experts.len());
        for &(id, encoding) in experts {
            let (matrices, length) = layout_expert(spec, encoding);
            entries.push(ExpertEntry {
                id,
                offset: 0,
                length,
                encoding,
                matrices,
                checksum: 0,
            });
        }
        let mut index = StoreIndex { experts: entries };
        let index_len = bincode::serialized_size(&index)
            .map_err(|e| Error::format(path, format!("cannot encode index: {e}")))?;
        let mut offset = align_up(HEADER_BYTES as u64 + index_len, BLOB_ALIGN);
        for entry in &mut index.experts {
            entry.offset = offset;
            offset += entry.padded_length();
        }
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        file.set_len(offset).map_err(|e| Error::io(path, e))?;
        Ok(ExpertStoreWriter {
            path: path.to_path_buf(),
            file,
            index,
            next: 0,
        })
    }

    /// The entry the next [`write_next`](Self::write_next) call fills.
    pub fn next_entry(&self) -> Option<&ExpertEntry> {
        self.index.experts.get(self.next)
    }

    /// Writes the next expert's blob (exactly its `length` bytes).
    pub fn write_next(&mut self, blob: &[u8]) -> Result<()> {
        let entry = self
            .index
            .experts
            .get_mut(self.next)
            .ok_or_else(|| Error::format(&self.path, "more experts written than declared"))?;
        if blob.len() as u64 != entry.length {
            return Err(Error::format(
                &self.path,
                format!(
                    "{}: blob of {} bytes, layout says {}",
                    entry.id,
                    blob.len(),
                    entry.length
                ),
            ));
        }
        entry.checksum = crc32fast::hash(blob);
        self.file
            .write_all_at(blob, entry.offset)
            .map_err(|e| Error::io(&self.path, e))?;
        self.next += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<StoreIndex> {
        if self.next != self.index.experts.len() {
            return Err(Error::format(
                &self.path,
                format!(
                    "only {} of {} experts written",
                    self.next,
                    self.index.experts.len()
                ),
            ));
        }
        let index_bytes = bincode::serialize(&self.index)
            .map_err(|e| Error::format(&self.path, format!("cannot encode index: {e}")))?;
        let mut header = Vec::with_capacity(HEADER_BYTES);
        header.extend_from_slice(STORE_MAGIC);
        header.extend_from_slice(&STORE_VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        header.extend_from_slice(&(index_bytes.len() as u64).to_le_bytes());
        header.extend_from_slice(&crc32fast::hash(&index_bytes).to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        let io = |e| Error::io(&self.path, e);
        self.file.seek(SeekFrom::Start(0)).map_err(io)?;
        self.file.write_all(&header).map_err(io)?;
        self.file.write_all(&index_bytes).map_err(io)?;
        self.file.sync_all().map_err(io)?;
        Ok(self.index)
    }
}

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
    pub fn open(path: &Path, spec: &ModelSpec) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut header = [0u8; HEADER_BYTES];
        file.read_exact_at(&mut header, 0).map_err(|_| {
            Error::format(
                path,
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
            return Err(Error::format(
                path,
                format!(
                    "truncated expert store: index needs {index_len} bytes, file has {file_len}"
                ),
            ));
        }
        let mut index_bytes = vec![0u8; index_len as usize];
        file.read_exact_at(&mut index_bytes, HEADER_BYTES as u64)
            .map_err(|e| Error::io(path, e))?;
        if crc32fast::hash(&index_bytes) != index_crc {
            return Err(Error::format(
                path,
                "expert store index is corrupted (checksum mismatch)",
            ));
        }
        let index: StoreIndex = bincode::deserialize(&index_bytes)
            .map_err(|e| Error::format(path, format!("cannot decode expert store index: {e}")))?;
        let mut lookup = std::collections::HashMap::new();
        for (i, entry) in index.experts.iter().enumerate() {
            if lookup.insert(entry.id, i).is_some() {
                return Err(Error::format(
                    path,
                    format!("{} appears twice in the index", entry.id),
                ));
            }
            let (expected, length) = layout_expert(spec, entry.encoding);
            if entry.matrices != expected || entry.length != length {
                return Err(Error::format(
                    path,
                    format!(
                        "{}: stored layout does not match the model config",
                        entry.id
                    ),
                ));
            }
            if entry.offset % BLOB_ALIGN != 0 {
                return Err(Error::format(
                    path,
                    format!(
                        "{}: blob offset {} is not page-aligned",
                        entry.id, entry.offset
                    ),
                ));
            }
            let end = entry.offset.saturating_add(entry.length);
            if end > file_len {
                return Err(Error::format(
                    path,
                    format!(
                        "truncated expert store: {} needs bytes {}..{}, the file has {file_len}",
                        entry.id, entry.offset, end
                    ),
                ));
            }
        }
        for stack in [Stack::Encoder, Stack::Decoder] {
            for layer in spec.moe_blocks(stack) {
                for expert in 0..spec.num_experts() {
                    let id = ExpertId {
                        stack,
                        layer: layer as u16,
                        expert: expert as u16,
                    };
                    if !lookup.contains_key(&id) {
                        return Err(Error::format(
                            path,
                            format!("{id} is missing from the index"),
                        ));
                    }
                }
            }
        }
        if lookup.len()
            != spec.moe_blocks(Stack::Encoder).len() * spec.num_experts()
                + spec.moe_blocks(Stack::Decoder).len() * spec.num_experts()
        {
            return Err(Error::format(
                path,
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
        spec: &ModelSpec,
        mode: StorageMode,
    ) -> Result<(Self, Option<String>)> {
        let mut store = Self::open(path, spec)?;
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
                    let mut probe =
                        crate::provider::AlignedBuf::new(first.padded_length() as usize);
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
        use std::os::fd::AsRawFd;
        // SAFETY: plain syscall on a file descriptor this struct owns.
        unsafe {
            libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
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
            .ok_or_else(|| Error::format(&self.path, format!("{id} is not in this store")))?;
        let len = entry.length as usize;
        // Direct reads move whole padded blobs (aligned offset, length and buffer).
        let read_len = match self.direct {
            Some(_) => entry.padded_length() as usize,
            None => len,
        };
        let dest = dest.get_mut(..read_len).ok_or_else(|| {
            Error::format(
                &self.path,
                format!("{id}: blob of {read_len} bytes does not fit the slot"),
            )
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
