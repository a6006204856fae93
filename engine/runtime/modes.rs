//! Engine modes: the paper's baselines and ablations as interchangeable expert providers behind
//! the same model (ARCHITECTURE.md §10).
//!
//! | mode      | experts come from                                                        |
//! |-----------|--------------------------------------------------------------------------|
//! | `io-free` | all resident in memory (the speed limit; ignores the budget)             |
//! | `io-exp`  | read on demand at every use, freed after use (full-precision store)      |
//! | `io-qexp` | the same from an all-INT4 store                                          |
//! | `mmap`    | the whole store memory-mapped; the OS page cache decides (llama.cpp)     |
//! | `edgemoe` | the bundle's store (its bit widths), expert buffer + policy + prefetch   |
//! | `q`       | quantized store, read on demand (ablation: quantization only)            |
//! | `q+p`     | quantized store, prefetch/pipeline into a two-slot buffer                |
//! | `q+p+c`   | quantized store, prefetch + the budget's expert buffer                   |
//!
//! With `--storage emulate`, `mmap` pays for page-ins too: before touching an expert it asks the
//! kernel which pages of the expert and the 64 MiB after it are resident (`mincore`), paces the
//! expert's missing bytes, and books as device time every page the touch brought in beyond them
//! and every page that appeared after the last touch: the kernel's read-ahead past an expert's
//! end pulls in the next ones (up to the disk's `read_ahead_kb`), which the emulated card must
//! pay for too, or mmap would read part of every expert free.

use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::time::Instant;

use serde::Serialize;

use crate::cache::Policy;
use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::ids::Stack;
use crate::model::provider::{ExpertProvider, ExpertWeights};
use crate::runtime::buffer::ExpertBuffer;
use crate::runtime::codec::expert_weights;
use crate::runtime::resident::ResidentExperts;
use crate::runtime::stats::ExpertStats;
use crate::store::AlignedBuf;
use crate::store::{ExpertStore, ReadPacer};
use crate::weights::{MappedBytes, PageMap};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Mode {
    #[serde(rename = "io-free")]
    IoFree,
    #[serde(rename = "io-exp")]
    IoExp,
    #[serde(rename = "io-qexp")]
    IoQexp,
    #[serde(rename = "mmap")]
    Mmap,
    #[serde(rename = "edgemoe")]
    Edgemoe,
    #[serde(rename = "q")]
    Q,
    #[serde(rename = "q+p")]
    QP,
    #[serde(rename = "q+p+c")]
    QPC,
}

impl Mode {
    pub const ALL: [Mode; 8] = [
        Mode::IoFree,
        Mode::IoExp,
        Mode::IoQexp,
        Mode::Mmap,
        Mode::Edgemoe,
        Mode::Q,
        Mode::QP,
        Mode::QPC,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::IoFree => "io-free",
            Mode::IoExp => "io-exp",
            Mode::IoQexp => "io-qexp",
            Mode::Mmap => "mmap",
            Mode::Edgemoe => "edgemoe",
            Mode::Q => "q",
            Mode::QP => "q+p",
            Mode::QPC => "q+p+c",
        }
    }

    /// Modes that keep experts in an expert buffer (the only ones a trace can record).
    pub fn has_buffer(self) -> bool {
        matches!(self, Mode::Edgemoe | Mode::QP | Mode::QPC)
    }

    /// Modes that run on the quantized store rather than the bundle's own.
    pub fn uses_quantized_store(self) -> bool {
        matches!(self, Mode::IoQexp | Mode::Q | Mode::QP | Mode::QPC)
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mode {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Mode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Mode::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mode `{s}` (expected one of {})", names.join(", "))
            })
    }
}

/// Reads every requested expert from the store, every time, into one scratch slot.
pub struct DemandLoader {
    store: ExpertStore,
    slot: AlignedBuf,
    stats: ExpertStats,
}

impl DemandLoader {
    pub fn new(store: ExpertStore) -> Self {
        let slot = AlignedBuf::new(store.max_padded_expert_bytes() as usize);
        DemandLoader {
            store,
            slot,
            stats: ExpertStats::default(),
        }
    }
}

impl ExpertProvider for DemandLoader {
    fn stall_ms(&self) -> f64 {
        self.stats.stall_ms
    }

    fn expert(&mut self, id: ExpertId, _next: Option<ExpertId>) -> Result<ExpertWeights<'_>> {
        let started = Instant::now();
        let read = self.store.read_expert(id, self.slot.as_mut_slice())?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.stats.accesses += 1;
        self.stats.misses += 1;
        self.stats.bytes_read += read;
        self.stats.read_ms += ms;
        self.stats.stall_ms += ms;
        let entry = self.store.entry(id).expect("read succeeded");
        expert_weights(entry, self.slot.as_slice())
    }
}

impl DemandLoader {
    pub fn stats(&self) -> &ExpertStats {
        &self.stats
    }
}

/// The whole expert store memory-mapped; experts are computed on straight from the map.
pub struct MappedExperts {
    store: ExpertStore,
    map: MappedBytes,
    pacer: Option<ReadPacer>,
    stats: ExpertStats,
    /// With a pacer: the resident pages of the last touch's window right after it (its
    /// read-ahead as far as it had got).
    after_last_touch: Option<PageMap>,
    /// The last touch's window of the store, `(offset, length)`.
    last_window: Option<(usize, usize)>,
}

/// Bytes past an expert's end whose page-ins count as its read-ahead: more than any
/// `read_ahead_kb` a Linux block device is given by default (128 KiB to a few MiB), so the
/// window sees all of it, and bounded, so a large store is not scanned at every touch.
const READ_AHEAD_WINDOW: usize = 64 << 20;

impl MappedExperts {
    pub fn new(store: ExpertStore, pacer: Option<ReadPacer>) -> Result<Self> {
        let map = MappedBytes::open(store.path())?;
        Ok(MappedExperts {
            store,
            map,
            pacer,
            stats: ExpertStats::default(),
            after_last_touch: None,
            last_window: None,
        })
    }

    /// The resident pages of `window` now, where page-ins are paced.
    fn snapshot(&self, (start, len): (usize, usize)) -> Option<PageMap> {
        self.pacer
            .as_ref()
            .and_then(|_| self.map.resident_pages(start, len))
    }
}

impl ExpertProvider for MappedExperts {
    fn stall_ms(&self) -> f64 {
        self.stats.stall_ms
    }

    fn expert(&mut self, id: ExpertId, _next: Option<ExpertId>) -> Result<ExpertWeights<'_>> {
        let entry = self
            .store
            .entry(id)
            .ok_or_else(|| Error::Internal(format!("{id} is not in the store")))?
            .clone();
        let (start, len) = (entry.offset as usize, entry.length as usize);
        let started = Instant::now();
        // Paced: this expert's missing pages, plus anything the kernel brought in since the
        // last touch, are read before the touch; what the touch makes the kernel read beyond
        // them (its read-ahead into the next expert) keeps the device busy after it.
        let window = (start, len + READ_AHEAD_WINDOW);
        let earlier = match (self.last_window, &self.after_last_touch) {
            (Some(last), Some(then)) => self
                .snapshot(last)
                .map_or(0, |now| now.paged_in_since(then)),
            _ => 0,
        };
        let before = self.snapshot(window);
        let missing = match &before {
            Some(now) => now.missing_bytes(start, len),
            None => self.map.missing_bytes(start, len),
        };
        let done = match (&self.pacer, missing + earlier) {
            (Some(p), m) if m > 0 => Some(p.book(m)),
            _ => None,
        };
        let bytes = &self.map.as_slice()[start..start + len];
        let actual = crc32fast::hash(bytes);
        if actual != entry.checksum {
            return Err(Error::Checksum {
                path: self.store.path().to_path_buf(),
                expert: id,
                expected: entry.checksum,
                actual,
            });
        }
        if let Some(done) = done {
            ReadPacer::wait(done);
        }
        let after = self.snapshot(window);
        let read_ahead = match (&after, &before) {
            (Some(after), Some(before)) => after.paged_in_since(before).saturating_sub(missing),
            _ => 0,
        };
        if let (Some(p), true) = (&self.pacer, read_ahead > 0) {
            p.book(read_ahead);
        }
        self.after_last_touch = after;
        self.last_window = Some(window);
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.stats.accesses += 1;
        if missing == 0 {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        let paged_in = missing + earlier + read_ahead;
        self.stats.bytes_read += paged_in;
        if paged_in > 0 {
            self.stats.stall_ms += ms;
            self.stats.read_ms += ms;
        }
        let bytes = &self.map.as_slice()[start..start + len];
        expert_weights(&entry, bytes)
    }
}

impl MappedExperts {
    pub fn stats(&self) -> &ExpertStats {
        &self.stats
    }
}

/// Where a run's experts come from.
pub enum ExpertSource {
    Buffer(Box<ExpertBuffer>),
    Resident(ResidentExperts),
    Demand(DemandLoader),
    Mapped(MappedExperts),
}

impl ExpertSource {
    pub fn as_buffer(&self) -> Option<&ExpertBuffer> {
        match self {
            ExpertSource::Buffer(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_buffer_mut(&mut self) -> Option<&mut ExpertBuffer> {
        match self {
            ExpertSource::Buffer(b) => Some(b),
            _ => None,
        }
    }

    /// Flushes a trace being recorded (buffer modes only).
    pub fn finish_trace(&mut self) -> Result<()> {
        match self {
            ExpertSource::Buffer(b) => b.finish_trace(),
            _ => Ok(()),
        }
    }

    pub fn record_trace(&mut self, path: &Path) -> Result<()> {
        match self {
            ExpertSource::Buffer(b) => b.record_trace(path),
            _ => Err(Error::Input(
                "--trace needs an expert buffer (modes edgemoe, q+p, q+p+c)".into(),
            )),
        }
    }

    fn inner(&mut self) -> &mut dyn ExpertProvider {
        match self {
            ExpertSource::Buffer(b) => b.as_mut(),
            ExpertSource::Resident(r) => r,
            ExpertSource::Demand(d) => d,
            ExpertSource::Mapped(m) => m,
        }
    }
}

impl ExpertProvider for ExpertSource {
    fn expert(&mut self, id: ExpertId, next: Option<ExpertId>) -> Result<ExpertWeights<'_>> {
        self.inner().expert(id, next)
    }

    fn begin_step(&mut self, stack: Stack) {
        self.inner().begin_step(stack)
    }

    fn stall_ms(&self) -> f64 {
        self.stats().stall_ms
    }

    fn routed(&mut self, stack: Stack, block: usize, k: usize, experts: &[u16]) -> Result<()> {
        self.inner().routed(stack, block, k, experts)
    }

    fn wants_lookahead(&self) -> bool {
        match self {
            ExpertSource::Buffer(b) => b.wants_lookahead(),
            _ => false,
        }
    }

    fn predicted(&mut self, stack: Stack, block: usize, k: usize, experts: &[u16]) -> Result<()> {
        self.inner().predicted(stack, block, k, experts)
    }
}

impl ExpertSource {
    pub fn stats(&self) -> &ExpertStats {
        match self {
            ExpertSource::Buffer(b) => b.stats(),
            ExpertSource::Resident(r) => r.stats(),
            ExpertSource::Demand(d) => d.stats(),
            ExpertSource::Mapped(m) => m.stats(),
        }
    }
}

/// The policy a mode's buffer uses when the user does not choose one.
pub fn default_policy(mode: Mode) -> Policy {
    match mode {
        Mode::QP => Policy::Lru,
        _ => Policy::Edgemoe,
    }
}
