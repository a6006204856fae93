//! The expert provider interface — the only way the model reaches expert weights — and the
//! fixed expert buffer behind it.
//!
//! [`ExpertBuffer`] owns a fixed number of page-aligned slots, allocated once and sized from the
//! memory budget. Slots hold experts in their stored form; an expert is decoded into reusable
//! f32 scratch tensors when the model asks for it. On a miss the least recently used slot is
//! refilled from the [`ExpertStore`] (checksum verified on every read).

use std::alloc::{self, Layout};
use std::collections::HashMap;
use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::expert_store::{ExpertEncoding, ExpertEntry, ExpertId, ExpertStore, BLOB_ALIGN};

/// One expert's weights, ready for the math. Valid until the provider is asked again.
pub struct ExpertWeights<'a> {
    /// `[d_ff, d_model]`
    pub wi: &'a Tensor,
    /// `[d_model, d_ff]`
    pub wo: &'a Tensor,
}

/// Counters every provider keeps.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ExpertStats {
    /// Requests for an expert (one per MoE layer per expert that has tokens routed to it).
    pub accesses: u64,
    /// Requests served from the buffer without a read.
    pub hits: u64,
    /// Requests that had to read the expert from the store.
    pub misses: u64,
    pub bytes_read: u64,
    /// Time spent reading and verifying blobs (the compute thread waits for it).
    pub read_ms: f64,
}

impl ExpertStats {
    pub fn hit_ratio(&self) -> f64 {
        if self.accesses == 0 {
            0.0
        } else {
            self.hits as f64 / self.accesses as f64
        }
    }
}

/// How the model gets expert weights. Implementations decide where experts live.
pub trait ExpertProvider {
    /// Makes expert `id` ready and returns its weights.
    fn expert(&mut self, id: ExpertId) -> Result<ExpertWeights<'_>>;

    fn stats(&self) -> &ExpertStats;
}

/// A zeroed, page-aligned byte buffer (the alignment `O_DIRECT` reads need).
pub struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(1), BLOB_ALIGN as usize)
            .expect("slot size fits the address space");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialised (zeroed) bytes while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this exact layout.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

/// Decodes one stored expert (slot bytes) into f32 scratch tensors `wi` and `wo`, without
/// allocating.
pub fn decode_expert(
    entry: &ExpertEntry,
    bytes: &[u8],
    wi: &mut Tensor,
    wo: &mut Tensor,
) -> Result<()> {
    for (name, out) in [("wi", wi), ("wo", wo)] {
        let m = entry
            .matrix(name)
            .ok_or_else(|| Error::Input(format!("{}: no `{name}` matrix", entry.id)))?;
        let start = m.offset as usize;
        let end = start + m.bytes as usize;
        let stored = bytes
            .get(start..end)
            .ok_or_else(|| Error::Input(format!("{}: `{name}` outside its blob", entry.id)))?;
        match entry.encoding {
            ExpertEncoding::Float(dtype) => {
                // SAFETY: `stored` holds rows × cols elements of `dtype` (checked by the store's
                // layout validation); the view is dropped before this function returns, while
                // `bytes` is still borrowed.
                let view = unsafe {
                    Tensor::f_from_blob(
                        stored.as_ptr(),
                        &[m.rows as i64, m.cols as i64],
                        &[],
                        dtype.kind(),
                        Device::Cpu,
                    )
                }?;
                out.f_copy_(&view)?;
            }
        }
    }
    Ok(())
}

struct Slot {
    bytes: AlignedBuf,
    holds: Option<ExpertId>,
    last_used: u64,
}

/// A fixed set of slots over an expert store, with least-recently-used eviction.
pub struct ExpertBuffer {
    store: ExpertStore,
    slots: Vec<Slot>,
    slot_of: HashMap<ExpertId, usize>,
    clock: u64,
    scratch_wi: Tensor,
    scratch_wo: Tensor,
    stats: ExpertStats,
}

impl ExpertBuffer {
    /// Allocates `slots` slots, each large enough for the store's largest expert.
    pub fn new(store: ExpertStore, spec: &ModelSpec, slots: usize) -> Self {
        let slot_bytes = store.max_padded_expert_bytes() as usize;
        let slots = (0..slots.max(1))
            .map(|_| Slot {
                bytes: AlignedBuf::new(slot_bytes),
                holds: None,
                last_used: 0,
            })
            .collect();
        let (d_ff, d_model) = (spec.d_ff as i64, spec.d_model as i64);
        ExpertBuffer {
            store,
            slots,
            slot_of: HashMap::new(),
            clock: 0,
            scratch_wi: Tensor::zeros([d_ff, d_model], (Kind::Float, Device::Cpu)),
            scratch_wo: Tensor::zeros([d_model, d_ff], (Kind::Float, Device::Cpu)),
            stats: ExpertStats::default(),
        }
    }

    pub fn slot_count(&self) -> usize {
        self.slots.len()
    }

    pub fn store(&self) -> &ExpertStore {
        &self.store
    }

    /// The slot that holds `id`, reading it from the store on a miss.
    fn slot_for(&mut self, id: ExpertId) -> Result<usize> {
        self.clock += 1;
        self.stats.accesses += 1;
        if let Some(&i) = self.slot_of.get(&id) {
            self.stats.hits += 1;
            self.slots[i].last_used = self.clock;
            return Ok(i);
        }
        self.stats.misses += 1;
        let victim = self
            .slots
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| (s.holds.is_some(), s.last_used))
            .map(|(i, _)| i)
            .expect("at least one slot");
        if let Some(old) = self.slots[victim].holds.take() {
            self.slot_of.remove(&old);
        }
        let started = Instant::now();
        let read = self
            .store
            .read_expert(id, self.slots[victim].bytes.as_mut_slice())?;
        self.stats.read_ms += started.elapsed().as_secs_f64() * 1e3;
        self.stats.bytes_read += read;
        let slot = &mut self.slots[victim];
        slot.holds = Some(id);
        slot.last_used = self.clock;
        self.slot_of.insert(id, victim);
        Ok(victim)
    }
}

impl ExpertProvider for ExpertBuffer {
    fn expert(&mut self, id: ExpertId) -> Result<ExpertWeights<'_>> {
        let slot = self.slot_for(id)?;
        let entry = self
            .store
            .entry(id)
            .expect("slot_for only succeeds for experts in the store");
        decode_expert(
            entry,
            self.slots[slot].bytes.as_slice(),
            &mut self.scratch_wi,
            &mut self.scratch_wo,
        )?;
        Ok(ExpertWeights {
            wi: &self.scratch_wi,
            wo: &self.scratch_wo,
        })
    }

    fn stats(&self) -> &ExpertStats {
        &self.stats
    }
}
