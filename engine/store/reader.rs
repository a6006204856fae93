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

/// Paces reads to a device's speed. The device has `queue_depth` channels sharing one bus: a
/// read takes a free channel, spends `latency` there (overlapping other channels' latencies),
/// then moves its bytes at `bandwidth`, one transfer at a time. With one channel (an SD card)
/// every read costs `latency + bytes / bandwidth` and reads queue behind each other; with more
/// (NVMe) only the latencies overlap, so the bandwidth is never exceeded. A read is booked when
/// it starts (the I/O scheduler starts at most `queue_depth` at once, so queued reads can still
/// be reordered or cancelled), the real read runs meanwhile, and it returns when both are done.
#[derive(Debug, Clone)]
pub struct ReadPacer {
    bytes_per_s: f64,
    latency: std::time::Duration,
    /// Shared by clones: one device.
    device: std::sync::Arc<std::sync::Mutex<PacedDevice>>,
}

#[derive(Debug)]
struct PacedDevice {
    /// When each channel is free again.
    channels: Vec<std::time::Instant>,
    /// When the bus has moved every booked byte.
    bus_free: std::time::Instant,
}

impl ReadPacer {
    /// A device with one channel.
    pub fn new(bytes_per_s: f64, latency: std::time::Duration) -> Self {
        Self::with_queue_depth(bytes_per_s, latency, 1)
    }

    /// A device with `queue_depth` channels (at least one).
    pub fn with_queue_depth(
        bytes_per_s: f64,
        latency: std::time::Duration,
        queue_depth: usize,
    ) -> Self {
        let now = std::time::Instant::now();
        ReadPacer {
            bytes_per_s: bytes_per_s.max(1.0),
            latency,
            device: std::sync::Arc::new(std::sync::Mutex::new(PacedDevice {
                channels: vec![now; queue_depth.max(1)],
                bus_free: now,
            })),
        }
    }

    pub fn queue_depth(&self) -> usize {
        self.lock().channels.len()
    }

    /// The device's time for one read of `bytes` on an idle device.
    pub fn read_cost(&self, bytes: u64) -> std::time::Duration {
        self.latency + std::time::Duration::from_secs_f64(bytes as f64 / self.bytes_per_s)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PacedDevice> {
        self.device
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Books a read of `bytes` on the emulated device; returns when it would be done.
    pub fn book(&self, bytes: u64) -> std::time::Instant {
        let transfer = std::time::Duration::from_secs_f64(bytes as f64 / self.bytes_per_s);
        let mut device = self.lock();
        let (channel, free) = device
            .channels
            .iter()
            .copied()
            .enumerate()
            .min_by_key(|&(_, t)| t)
            .expect("at least one channel");
        let start = free.max(std::time::Instant::now());
        let done = (start + self.latency).max(device.bus_free) + transfer;
        device.bus_free = done;
        device.channels[channel] = done;
        done
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
    /// Reads worth keeping in flight on the device (the profile's queue depth).
    queue_depth: usize,
    /// The profile's model of the device, emulated or not: bytes per second and per-read
    /// latency.
    device: Option<(f64, std::time::Duration)>,
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
        // Checked against the file's real length before anything is allocated: the header's
        // number is only a claim.
        let index_end = (HEADER_BYTES as u64).checked_add(index_len);
        if index_end.is_none_or(|end| end > file_len) {
            return Err(Error::corrupt(
                path,
                None,
                format!(
                    "truncated or corrupted expert store: the header claims a {index_len}-byte index, the file has {file_len} bytes"
                ),
            ));
        }
        let index_size = usize::try_from(index_len).map_err(|_| {
            Error::corrupt(
                path,
                None,
                format!("index of {index_len} bytes is too large"),
            )
        })?;
        let mut index_bytes = vec![0u8; index_size];
        file.read_exact_at(&mut index_bytes, HEADER_BYTES as u64)
            .map_err(|e| Error::io(path, e))?;
        if crc32fast::hash(&index_bytes) != index_crc {
            return Err(Error::corrupt(
                path,
                None,
                "expert store index is corrupted (checksum mismatch)",
            ));
        }
        let index: StoreIndex = decode_index(&index_bytes).map_err(|e| {
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
            let end = entry.offset.checked_add(entry.length);
            if end.is_none_or(|end| end > file_len) {
                return Err(Error::corrupt(
                    path,
                    Some(entry.id),
                    format!(
                        "truncated or corrupted expert store: blob at offset {} of {} bytes, the file has {file_len}",
                        entry.offset, entry.length
                    ),
                ));
            }
            // Direct reads move the padded blob: its end must be representable too.
            if entry.offset.checked_add(entry.padded_length()).is_none() {
                return Err(Error::corrupt(
                    path,
                    Some(entry.id),
                    format!("blob at offset {} overflows when padded", entry.offset),
                ));
            }
            // The matrices lie inside the blob (the layout check above makes this hold for
            // every store this engine accepts; kept so no later change can read past a blob).
            for m in &entry.matrices {
                let inside = |offset: u64, bytes: u64| {
                    offset
                        .checked_add(bytes)
                        .is_some_and(|end| end <= entry.length)
                };
                if !inside(m.offset, m.bytes) || !inside(m.scales_offset, m.scales_bytes) {
                    return Err(Error::corrupt(
                        path,
                        Some(entry.id),
                        format!("matrix `{}` lies outside its blob", m.name),
                    ));
                }
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
            queue_depth: 1,
            device: None,
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

    /// How many reads the device serves at once (at least one).
    pub fn set_queue_depth(&mut self, depth: usize) {
        self.queue_depth = depth.max(1);
    }

    pub fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    /// The device's bandwidth (bytes per second) and per-read latency, from its profile.
    pub fn set_device(&mut self, device: Option<(f64, std::time::Duration)>) {
        self.device = device;
    }

    /// The share of the device a read of `bytes` holds while it runs: see [`device_share`].
    /// Without a device model, one channel's worth (1 / queue depth).
    pub fn device_share(&self, bytes: u64) -> f64 {
        match self.device {
            Some((bytes_per_s, latency)) => {
                device_share(bytes, bytes_per_s, latency, self.queue_depth)
            }
            None => 1.0 / self.queue_depth as f64,
        }
    }

    /// The emulated device reads are paced to, if any.
    pub fn pacer(&self) -> Option<&ReadPacer> {
        self.pacer.as_ref()
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

/// Decodes the index with the wire format of `bincode::serialize` (fixed-width little-endian
/// integers, trailing bytes allowed), bounded by the index's own length: a crafted length
/// prefix inside it fails to decode instead of allocating what it claims.
pub(crate) fn decode_index(bytes: &[u8]) -> bincode::Result<StoreIndex> {
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .allow_trailing_bytes()
        .with_limit(bytes.len() as u64)
        .deserialize(bytes)
}

/// The device time a read of `bytes` adds to a busy device, as a share of the read's own time
/// (`latency + bytes / bandwidth`): what a read nobody needed takes from the others. Each of
/// the `queue_depth` channels holds a read for its whole time, and one bus moves one read's
/// bytes at a time (the model [`ReadPacer`] emulates), so the share is the larger of one
/// channel's (1 / queue depth) and the transfer's share of a read. It is 1 on a one-channel
/// card. For 512 KiB on the `rpi5-nvme` profile (4 channels, 60 µs, 442 MB/s) it is 0.95, not
/// a quarter: reads that size keep the bus busy.
pub fn device_share(
    bytes: u64,
    bytes_per_s: f64,
    latency: std::time::Duration,
    queue_depth: usize,
) -> f64 {
    let channel = 1.0 / queue_depth.max(1) as f64;
    let transfer = if bytes_per_s > 0.0 {
        bytes as f64 / bytes_per_s
    } else {
        0.0
    };
    let read = transfer + latency.as_secs_f64();
    if read > 0.0 {
        (transfer / read).max(channel).min(1.0)
    } else {
        channel
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// What a read adds to a saturated emulated device, measured on the pacer's bookings,
    /// is `device_share` of the read's own time: bus-bound, latency-bound and one-channel.
    #[test]
    fn a_reads_device_share_is_what_it_adds_to_a_busy_device() {
        for (bytes, latency_us, depth) in [
            (512u64 << 10, 60u64, 4usize), // rpi5-nvme: the bus
            (4 << 10, 60, 4),              // small reads: the channels
            (512 << 10, 800, 1),           // an SD card: the whole read
            (64 << 10, 200, 2),
        ] {
            let (bytes_per_s, latency) = (442e6, Duration::from_micros(latency_us));
            let pacer = ReadPacer::with_queue_depth(bytes_per_s, latency, depth);
            let done: Vec<Instant> = (0..200).map(|_| pacer.book(bytes)).collect();
            let added = (done[199] - done[99]).as_secs_f64() / 100.0;
            let read = pacer.read_cost(bytes).as_secs_f64();
            let share = device_share(bytes, bytes_per_s, latency, depth);
            assert!(
                (added / read - share).abs() < 0.01,
                "{bytes} B, {latency_us} µs, depth {depth}: adds {:.3} of a read, share {share:.3}",
                added / read
            );
        }
        let nvme = device_share(512 << 10, 442e6, Duration::from_micros(60), 4);
        assert!(nvme > 0.9, "{nvme}");
    }

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

    #[test]
    fn channels_overlap_latencies_and_share_the_bandwidth() {
        // 1 MiB at 100 MiB/s = 10 ms of transfer, 10 ms of latency per read.
        let finish = |depth: usize| {
            let pacer = ReadPacer::with_queue_depth(
                100.0 * 1024.0 * 1024.0,
                Duration::from_millis(10),
                depth,
            );
            assert_eq!(pacer.queue_depth(), depth);
            let started = Instant::now();
            let last = (0..4).map(|_| pacer.book(1 << 20)).max().unwrap();
            (last - started).as_secs_f64() * 1e3
        };
        // One channel: 4 × (10 + 10) ms. Four: the latencies overlap, the transfers do not.
        let (one, four) = (finish(1), finish(4));
        assert!((one - 80.0).abs() < 2.0, "{one:.1} ms");
        assert!((four - 50.0).abs() < 2.0, "{four:.1} ms");
    }

    use super::super::format::{ExpertEncoding, ExpertStoreWriter};
    use crate::ids::Stack;
    use crate::weights::WeightDtype;

    fn layout() -> ExpertLayout {
        ExpertLayout {
            matrices: vec![("wi", 4, 8), ("wo", 8, 4)],
            experts: (0..2)
                .map(|expert| ExpertId {
                    stack: Stack::Decoder,
                    layer: 1,
                    expert,
                })
                .collect(),
        }
    }

    /// A valid two-expert store in `dir`.
    fn store(dir: &Path) -> PathBuf {
        let path = dir.join("experts.bin");
        let layout = layout();
        let encoding = ExpertEncoding::Float(WeightDtype::F32);
        let experts: Vec<_> = layout.experts.iter().map(|&id| (id, encoding)).collect();
        let mut writer = ExpertStoreWriter::create(&path, &layout, &experts).unwrap();
        while let Some(entry) = writer.next_entry() {
            let blob = vec![7u8; entry.length as usize];
            writer.write_next(&blob).unwrap();
        }
        writer.finish().unwrap();
        path
    }

    fn patch(path: &Path, at: u64, bytes: &[u8]) {
        let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        file.write_all_at(bytes, at).unwrap();
    }

    /// Rewrites the index (same encoded length) and its checksum.
    fn rewrite_index(path: &Path, edit: impl FnOnce(&mut Vec<u8>)) {
        let data = std::fs::read(path).unwrap();
        let len = u64::from_le_bytes(data[16..24].try_into().unwrap()) as usize;
        let mut index = data[HEADER_BYTES..HEADER_BYTES + len].to_vec();
        edit(&mut index);
        patch(path, HEADER_BYTES as u64, &index);
        patch(path, 24, &crc32fast::hash(&index).to_le_bytes());
    }

    fn corrupt_message(path: &Path) -> String {
        match ExpertStore::open(path, &layout()) {
            Err(e @ Error::Corrupt { .. }) => {
                let text = e.to_string();
                assert!(text.contains("experts.bin"), "{text}");
                text
            }
            Err(other) => panic!("expected Error::Corrupt, got {other:?}"),
            Ok(_) => panic!("a damaged store opened"),
        }
    }

    #[test]
    fn a_valid_store_opens_and_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = store(dir.path());
        let store = ExpertStore::open(&path, &layout()).unwrap();
        let id = layout().experts[1];
        let mut buf = vec![0u8; store.max_padded_expert_bytes() as usize];
        let n = store.read_expert(id, &mut buf).unwrap();
        assert!(buf[..n as usize].iter().all(|&b| b == 7));
    }

    #[test]
    fn crafted_index_lengths_are_refused_before_allocating() {
        let dir = tempfile::tempdir().unwrap();
        let path = store(dir.path());
        let file_len = std::fs::metadata(&path).unwrap().len();
        // Overflows `32 + len`; one past the file; huge but representable (1 TiB).
        for claim in [u64::MAX, u64::MAX - 31, file_len + 1, 1 << 40] {
            patch(&path, 16, &claim.to_le_bytes());
            let text = corrupt_message(&path);
            assert!(text.contains(&claim.to_string()), "{text}");
        }
    }

    #[test]
    fn a_crafted_length_inside_the_index_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = store(dir.path());
        // The index starts with the expert count (u64): claim 2^60 entries.
        rewrite_index(&path, |index| {
            index[..8].copy_from_slice(&(1u64 << 60).to_le_bytes())
        });
        let text = corrupt_message(&path);
        assert!(text.contains("cannot decode"), "{text}");
    }

    #[test]
    fn blob_offsets_near_the_end_of_the_address_space_are_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = store(dir.path());
        for offset in [u64::MAX - (BLOB_ALIGN - 1), 1 << 63] {
            rewrite_index(&path, |bytes| {
                let mut index: StoreIndex = decode_index(bytes).unwrap();
                index.experts[1].offset = offset;
                let encoded = bincode::serialize(&index).unwrap();
                assert_eq!(encoded.len(), bytes.len());
                *bytes = encoded;
            });
            let text = corrupt_message(&path);
            assert!(text.contains(&offset.to_string()), "{text}");
        }
    }
}
