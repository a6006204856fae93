//! The expert provider interface — the only way the model reaches expert weights — and the
//! expert buffer behind it.
//!
//! [`ExpertBuffer`] owns a fixed number of page-aligned slots, allocated once and sized from the
//! memory budget. Slots hold experts in their stored form; an expert is decoded into reusable
//! f32 scratch tensors when the model asks for it. Which expert sits where, and what to evict,
//! is decided by a [`SlotTable`] and its [`Policy`] (the same code trace replay runs). With
//! prefetch on, a [`Prefetcher`] thread reads experts ahead of need into free or evictable slots:
//! experts the [`PathDictionary`] predicts for the next MoE layer, and the next expert of the
//! layer being computed. A slot being computed on or being filled is never evicted.
//!
//! Top-k routing changes nothing for the slots: an expert is one blob whatever its matrices
//! (`wi`/`wo` for Switch, `gate`/`up`/`down` for SwiGLU), demanded once per layer per forward
//! call. The router reports `k` experts per token (`routed`); dictionary predictions then give,
//! per expert, the probability that it is among a token's k, and a guess counts as right when
//! the token's experts include it.

use std::alloc::{self, Layout};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tch::{Device, Kind, Tensor};

use crate::cache::policy::{LayerMap, Policy, PolicyState};
use crate::cache::table::{AccessContext, Evicted, Outcome, SlotTable};
use crate::cache::trace::{AccessKind, TraceEvent, TraceHeader, TraceWriter, TRACE_VERSION};
use crate::config::{ModelSpec, Stack};
use crate::error::{Error, Result};
use crate::expert_store::{ExpertEncoding, ExpertEntry, ExpertId, ExpertStore, BLOB_ALIGN};
use crate::paths::PathDictionary;
use crate::prefetch::{self, Completion, Prefetcher, Request};

/// One expert's weights, ready for the math (f32). They share memory with the provider's
/// scratch: use them before asking the provider for the next expert.
pub enum ExpertWeights {
    /// Switch Transformers: `wi` `[d_ff, d_model]`, `wo` `[d_model, d_ff]`.
    Relu { wi: Tensor, wo: Tensor },
    /// Decoder-only families: `gate`, `up` `[d_ff, d_model]`, `down` `[d_model, d_ff]`.
    SwiGlu {
        gate: Tensor,
        up: Tensor,
        down: Tensor,
    },
}

impl ExpertWeights {
    /// Views of `matrices` (shallow clones), named as the store names them, in blob order.
    pub fn from_matrices(id: ExpertId, names: &[&str], matrices: &[Tensor]) -> Result<Self> {
        let m = |i: usize| matrices[i].shallow_clone();
        match names {
            ["wi", "wo"] if matrices.len() == 2 => Ok(ExpertWeights::Relu { wi: m(0), wo: m(1) }),
            ["gate", "up", "down"] if matrices.len() == 3 => Ok(ExpertWeights::SwiGlu {
                gate: m(0),
                up: m(1),
                down: m(2),
            }),
            other => Err(Error::Input(format!(
                "{id}: unknown expert matrices {other:?}"
            ))),
        }
    }

    /// The same weights on `device` (no copy when they are there already).
    pub fn to_device(self, device: tch::Device) -> Result<Self> {
        let moved = |t: Tensor| -> Result<Tensor> {
            if t.device() == device {
                Ok(t)
            } else {
                Ok(t.f_to_device(device)?)
            }
        };
        Ok(match self {
            ExpertWeights::Relu { wi, wo } => ExpertWeights::Relu {
                wi: moved(wi)?,
                wo: moved(wo)?,
            },
            ExpertWeights::SwiGlu { gate, up, down } => ExpertWeights::SwiGlu {
                gate: moved(gate)?,
                up: moved(up)?,
                down: moved(down)?,
            },
        })
    }

    /// The matrices in blob order.
    pub fn matrices(&self) -> Vec<&Tensor> {
        match self {
            ExpertWeights::Relu { wi, wo } => vec![wi, wo],
            ExpertWeights::SwiGlu { gate, up, down } => vec![gate, up, down],
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct LayerStats {
    pub stack: String,
    pub block: u16,
    pub accesses: u64,
    pub hits: u64,
    pub hit_ratio: f64,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct PrefetchStats {
    /// Reads handed to the prefetch thread.
    pub issued: u64,
    /// Prefetched experts that a later demand used.
    pub useful: u64,
    /// Requests dropped before their read started.
    pub cancelled: u64,
    /// Bytes the prefetch thread read.
    pub bytes_read: u64,
    /// Bytes of prefetched experts evicted or dropped without being used.
    pub wasted_bytes: u64,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct DictionaryStats {
    /// Tokens × MoE layers for which the dictionary predicted the expert ahead of routing.
    pub predictions: u64,
    /// Predictions whose most probable expert was the one chosen.
    pub top1_correct: u64,
    pub top1_accuracy: f64,
}

/// Counters every provider keeps.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ExpertStats {
    /// Demand requests for an expert (one per MoE layer per expert that has tokens routed to
    /// it in a forward call).
    pub accesses: u64,
    /// Demand requests served without a read of their own (resident or already being read).
    pub hits: u64,
    /// Demand requests that read the expert on the compute thread (demand misses).
    pub misses: u64,
    /// All bytes read from the expert store (demand and prefetch).
    pub bytes_read: u64,
    /// Time the compute thread spent reading (demand misses).
    pub read_ms: f64,
    /// Time the compute thread waited for expert bytes: its own reads plus waits for reads in
    /// flight on the prefetch thread.
    pub stall_ms: f64,
    pub prefetch: PrefetchStats,
    pub dictionary: DictionaryStats,
    #[serde(skip)]
    per_layer: BTreeMap<(Stack, u16), (u64, u64)>,
}

impl ExpertStats {
    pub fn hit_ratio(&self) -> f64 {
        if self.accesses == 0 {
            0.0
        } else {
            self.hits as f64 / self.accesses as f64
        }
    }

    fn record(&mut self, id: ExpertId, hit: bool) {
        self.accesses += 1;
        let layer = self.per_layer.entry((id.stack, id.layer)).or_default();
        layer.0 += 1;
        if hit {
            self.hits += 1;
            layer.1 += 1;
        } else {
            self.misses += 1;
        }
    }

    /// Hit ratio of every MoE layer, encoder first.
    pub fn per_layer(&self) -> Vec<LayerStats> {
        self.per_layer
            .iter()
            .map(|(&(stack, block), &(accesses, hits))| LayerStats {
                stack: stack.hf_prefix().into(),
                block,
                accesses,
                hits,
                hit_ratio: if accesses == 0 {
                    0.0
                } else {
                    hits as f64 / accesses as f64
                },
            })
            .collect()
    }
}

/// How the model gets expert weights. Implementations decide where experts live.
pub trait ExpertProvider {
    /// Makes expert `id` ready and returns its weights.
    fn expert(&mut self, id: ExpertId) -> Result<ExpertWeights>;

    /// A new forward call starts: the encoder pass, or one decoder step (one new token per
    /// sequence).
    fn begin_step(&mut self, _stack: Stack) {}

    /// The router of block `block` of `stack` chose `experts`: `k` per token (highest weight
    /// first), tokens row-major, so `experts.len()` = tokens × `k`. Stale prefetches for this
    /// layer can go, and the next layer's experts can be prefetched.
    fn routed(&mut self, _stack: Stack, _block: usize, _k: usize, _experts: &[u16]) -> Result<()> {
        Ok(())
    }

    /// `id` is needed next in this layer: its read may start while the current expert computes.
    fn will_use(&mut self, _id: ExpertId) -> Result<()> {
        Ok(())
    }

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

/// Decodes one stored expert (slot bytes) into f32 scratch tensors, one per matrix of the
/// entry in blob order (`wi`, `wo` or `gate`, `up`, `down`), without allocating.
pub fn decode_expert(entry: &ExpertEntry, bytes: &[u8], out: &mut [Tensor]) -> Result<()> {
    if out.len() != entry.matrices.len() {
        return Err(Error::Input(format!(
            "{}: {} matrices stored, {} scratch tensors",
            entry.id,
            entry.matrices.len(),
            out.len()
        )));
    }
    for (m, out) in entry.matrices.iter().zip(out.iter_mut()) {
        let name = &m.name;
        let start = m.offset as usize;
        let end = start + m.bytes as usize;
        let stored = bytes
            .get(start..end)
            .ok_or_else(|| Error::Input(format!("{}: `{name}` outside its blob", entry.id)))?;
        let (rows, cols) = (m.rows as usize, m.cols as usize);
        if out.numel() != rows * cols || out.kind() != Kind::Float || !out.is_contiguous() {
            return Err(Error::Input(format!(
                "{}: scratch shape mismatch for `{name}`",
                entry.id
            )));
        }
        match entry.encoding {
            ExpertEncoding::Quant(bits) => {
                let scales = bytes
                    .get(m.scales_offset as usize..(m.scales_offset + m.scales_bytes) as usize)
                    .ok_or_else(|| {
                        Error::Input(format!("{}: `{name}` scales outside its blob", entry.id))
                    })?;
                // Scales sit on a 64-byte boundary of a page-aligned slot.
                // SAFETY: any 4 initialised bytes are a valid f32.
                let (head, scales, tail) = unsafe { scales.align_to::<f32>() };
                if !head.is_empty() || !tail.is_empty() {
                    return Err(Error::Input(format!("{}: misaligned scales", entry.id)));
                }
                // SAFETY: `out` is a contiguous f32 CPU tensor of rows × cols elements that
                // nothing else reads while this slice lives.
                let dest = unsafe {
                    std::slice::from_raw_parts_mut(out.data_ptr() as *mut f32, rows * cols)
                };
                crate::quant::dequantize_into(stored, scales, rows, cols, bits, dest)?;
            }
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

/// Zeroed f32 scratch for one expert of `spec`, one tensor per matrix in blob order.
pub fn expert_scratch(spec: &ModelSpec) -> Vec<Tensor> {
    spec.expert_matrices()
        .iter()
        .map(|&(_, rows, cols)| {
            Tensor::zeros([rows as i64, cols as i64], (Kind::Float, Device::Cpu))
        })
        .collect()
}

/// Knobs of an [`ExpertBuffer`].
#[derive(Debug, Clone)]
pub struct BufferOptions {
    pub slots: usize,
    pub policy: Policy,
    /// Start a prefetch thread (dictionary predictions and the next expert of a layer).
    pub prefetch: bool,
    /// Most speculative (dictionary-predicted) bytes started per forward call.
    pub prefetch_cap_bytes: u64,
}

/// Least probability that an expert is among a token's experts (or, over several tokens, the
/// mean of it) for the dictionary's prediction to be prefetched.
pub const PREFETCH_MIN_PROBABILITY: f64 = 0.1;

struct InFlight {
    cancel: Arc<AtomicBool>,
    speculative: bool,
}

/// A fixed set of slots over an expert store.
pub struct ExpertBuffer {
    store: Arc<ExpertStore>,
    layers: LayerMap,
    table: SlotTable,
    /// Slot memory; `None` while lent to the prefetch thread.
    memory: Vec<Option<AlignedBuf>>,
    in_flight: HashMap<ExpertId, InFlight>,
    prefetcher: Option<Prefetcher>,
    prefetch_cap_bytes: u64,
    dictionary: Option<Arc<PathDictionary>>,
    /// The expert whose weights were handed out last (still being computed on).
    in_use: Option<ExpertId>,
    /// Decoded weights of the expert in use, one tensor per matrix.
    scratch: Vec<Tensor>,
    stats: ExpertStats,
    trace: Option<TraceWriter>,
    /// Forward calls so far (trace `token`).
    step: u64,
    /// Decoder MoE layer executing.
    current: Option<usize>,
    /// Experts chosen at the MoE layers already run in this forward call: per layer, `k` per
    /// token (as `routed` got them).
    history: Vec<Vec<u16>>,
    /// Experts per token of the layers in `history`.
    history_k: usize,
    history_stack: Option<Stack>,
    speculative_bytes: u64,
    /// The dictionary's top-1 guess per token for the layer routed next: (stack, block, guesses).
    guesses: Option<(Stack, usize, Vec<u16>)>,
}

impl ExpertBuffer {
    /// An LRU buffer of `slots` slots without prefetch.
    pub fn new(store: ExpertStore, spec: &ModelSpec, slots: usize) -> Self {
        Self::with_options(
            store,
            spec,
            &BufferOptions {
                slots,
                policy: Policy::Lru,
                prefetch: false,
                prefetch_cap_bytes: 0,
            },
            None,
        )
        .expect("a buffer without prefetch thread cannot fail")
    }

    /// Allocates the slots (each large enough for the store's largest expert) and, with
    /// prefetch on, starts the prefetch thread. `dictionary` seeds the policy's frequencies and
    /// drives speculative prefetch.
    pub fn with_options(
        store: ExpertStore,
        spec: &ModelSpec,
        options: &BufferOptions,
        dictionary: Option<Arc<PathDictionary>>,
    ) -> Result<Self> {
        if options.policy == Policy::Belady {
            return Err(Error::Input(
                "policy `belady` needs the future: it is available in `edgemoe replay` only".into(),
            ));
        }
        let slots = options.slots.max(1);
        let slot_bytes = store.max_padded_expert_bytes() as usize;
        let memory = (0..slots)
            .map(|_| Some(AlignedBuf::new(slot_bytes)))
            .collect();
        let layers = LayerMap::new(spec);
        let seeds = seeds(&layers, spec.num_experts(), dictionary.as_deref());
        let table = SlotTable::new(
            slots,
            PolicyState::new(options.policy, layers.clone(), &seeds),
        );
        let store = Arc::new(store);
        let prefetcher = if options.prefetch {
            let p = Prefetcher::spawn(store.clone(), slots)
                .map_err(|e| Error::Input(format!("cannot start the prefetch thread: {e}")))?;
            Some(p)
        } else {
            None
        };
        Ok(ExpertBuffer {
            store,
            layers,
            table,
            memory,
            in_flight: HashMap::new(),
            prefetcher,
            prefetch_cap_bytes: options.prefetch_cap_bytes,
            dictionary,
            in_use: None,
            scratch: expert_scratch(spec),
            stats: ExpertStats::default(),
            trace: None,
            step: 0,
            current: None,
            history: Vec::new(),
            history_k: 1,
            history_stack: None,
            speculative_bytes: 0,
            guesses: None,
        })
    }

    /// Records every access from now on into `path` (JSON lines, see `cache::trace`).
    pub fn record_trace(&mut self, path: &Path) -> Result<()> {
        let header = TraceHeader {
            edgemoe_trace: TRACE_VERSION,
            slots: self.table.len(),
            policy: self.table.policy.policy,
            prefetch: self.prefetcher.is_some(),
            layers: self.layers.clone(),
            seeds: seeds(
                &self.layers,
                self.store_experts_per_layer(),
                self.dictionary.as_deref(),
            ),
        };
        self.trace = Some(TraceWriter::create(path, &header)?);
        Ok(())
    }

    /// Flushes the trace, if one is being recorded.
    pub fn finish_trace(&mut self) -> Result<()> {
        match self.trace.take() {
            Some(t) => t.finish(),
            None => Ok(()),
        }
    }

    fn store_experts_per_layer(&self) -> usize {
        self.store
            .index()
            .experts
            .iter()
            .map(|e| e.id.expert as usize + 1)
            .max()
            .unwrap_or(0)
    }

    pub fn slot_count(&self) -> usize {
        self.table.len()
    }

    pub fn store(&self) -> &ExpertStore {
        &self.store
    }

    /// Whether the prefetch thread has exited (for shutdown tests).
    pub fn prefetch_exit_flag(&self) -> Option<Arc<AtomicBool>> {
        self.prefetcher.as_ref().map(Prefetcher::exited_flag)
    }

    fn pinned(&self) -> Vec<ExpertId> {
        self.in_flight.keys().copied().chain(self.in_use).collect()
    }

    fn log(&mut self, kind: AccessKind, id: ExpertId, pinned: &[ExpertId]) -> Result<()> {
        let Some(trace) = self.trace.as_mut() else {
            return Ok(());
        };
        let mut pinned = pinned.to_vec();
        pinned.sort();
        trace.event(&TraceEvent {
            token: self.step,
            kind,
            stack: id.stack,
            layer: id.layer,
            expert: id.expert,
            current: self.current.map(|c| c as u16),
            pinned,
        })
    }

    fn note_eviction(&mut self, evicted: Option<Evicted>) {
        if let Some(e) = evicted.filter(|e| e.prefetched_unused) {
            self.stats.prefetch.wasted_bytes += self.store.entry(e.expert).map_or(0, |x| x.length);
        }
    }

    /// Takes back a slot from the prefetch thread and updates the books.
    fn complete(&mut self, done: Completion) -> Result<()> {
        self.memory[done.slot] = Some(done.memory);
        self.in_flight.remove(&done.id);
        match done.outcome {
            prefetch::Outcome::Loaded { bytes, .. } => {
                self.stats.prefetch.bytes_read += bytes;
                self.stats.bytes_read += bytes;
            }
            prefetch::Outcome::Cancelled | prefetch::Outcome::Failed(_) => {
                // A failed read is retried (and reported) by the demand that needs the expert.
                self.stats.prefetch.cancelled += 1;
                self.table.remove(done.id);
                let pinned = self.pinned();
                self.log(AccessKind::Cancel, done.id, &pinned)?;
            }
        }
        Ok(())
    }

    fn drain_completions(&mut self) -> Result<()> {
        while let Some(done) = self.prefetcher.as_ref().and_then(Prefetcher::try_recv) {
            self.complete(done)?;
        }
        Ok(())
    }

    /// Blocks until the read of `id` (or, with `None`, any read) comes back.
    fn wait_for(&mut self, id: Option<ExpertId>) -> Result<()> {
        let started = Instant::now();
        loop {
            let done = self
                .prefetcher
                .as_ref()
                .and_then(Prefetcher::recv)
                .ok_or_else(|| Error::Input("the prefetch thread stopped unexpectedly".into()))?;
            let this = done.id;
            self.complete(done)?;
            if id.is_none() || id == Some(this) {
                break;
            }
        }
        self.stats.stall_ms += started.elapsed().as_secs_f64() * 1e3;
        Ok(())
    }

    /// The slot that holds `id`, ready to decode.
    fn demand(&mut self, id: ExpertId) -> Result<usize> {
        self.in_use = None;
        self.drain_completions()?;
        // A prefetch we gave up on may still be in flight: let it land (or not) first.
        if self
            .in_flight
            .get(&id)
            .is_some_and(|f| f.cancel.load(Ordering::Acquire))
        {
            self.wait_for(Some(id))?;
        }
        loop {
            let pinned = self.pinned();
            let ctx = AccessContext {
                current: self.current,
                pinned: &pinned,
            };
            match self.table.demand(id, &ctx) {
                Some(Outcome::Hit { slot, prefetched }) => {
                    self.log(AccessKind::Demand, id, &pinned)?;
                    self.stats.record(id, true);
                    if prefetched {
                        self.stats.prefetch.useful += 1;
                    }
                    if self.in_flight.contains_key(&id) {
                        self.wait_for(Some(id))?;
                        if self.table.slot_of(id).is_none() {
                            // Its read failed: read it here (and report the error).
                            continue;
                        }
                    }
                    return Ok(slot);
                }
                Some(Outcome::Miss { slot, evicted }) => {
                    self.log(AccessKind::Demand, id, &pinned)?;
                    self.stats.record(id, false);
                    self.note_eviction(evicted);
                    let started = Instant::now();
                    let memory = self.memory[slot]
                        .as_mut()
                        .expect("a slot that is not being filled has its memory");
                    let read = match self.store.read_expert(id, memory.as_mut_slice()) {
                        Ok(read) => read,
                        Err(e) => {
                            self.table.remove(id);
                            return Err(e);
                        }
                    };
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    self.stats.read_ms += ms;
                    self.stats.stall_ms += ms;
                    self.stats.bytes_read += read;
                    return Ok(slot);
                }
                None => {
                    // Every slot is being read or computed on: wait for a read to land.
                    if self.in_flight.is_empty() {
                        return Err(Error::Input(format!(
                            "no expert slot can be freed for {id} (buffer of {} slots)",
                            self.table.len()
                        )));
                    }
                    self.wait_for(None)?;
                }
            }
        }
    }

    /// Starts reading `id` on the prefetch thread if it is not resident or being read.
    fn start_prefetch(&mut self, id: ExpertId, speculative: bool) -> Result<()> {
        if self.prefetcher.is_none() || self.table.slot_of(id).is_some() {
            return Ok(());
        }
        let Some(bytes) = self.store.entry(id).map(|e| e.length) else {
            return Ok(());
        };
        if speculative && self.speculative_bytes + bytes > self.prefetch_cap_bytes {
            return Ok(());
        }
        self.drain_completions()?;
        let pinned = self.pinned();
        let ctx = AccessContext {
            current: self.current,
            pinned: &pinned,
        };
        let Some((slot, evicted)) = self.table.prefetch(id, &ctx) else {
            return Ok(());
        };
        self.log(AccessKind::Prefetch, id, &pinned)?;
        self.note_eviction(evicted);
        let memory = self.memory[slot]
            .take()
            .expect("a slot that is not being filled has its memory");
        let cancel = Arc::new(AtomicBool::new(false));
        let request = Request {
            id,
            slot,
            memory,
            cancel: cancel.clone(),
        };
        if let Err(request) = self
            .prefetcher
            .as_ref()
            .expect("checked above")
            .send(request)
        {
            self.memory[slot] = Some(request.memory);
            self.table.remove(id);
            return Err(Error::Input(
                "the prefetch thread stopped unexpectedly".into(),
            ));
        }
        self.in_flight.insert(
            id,
            InFlight {
                cancel,
                speculative,
            },
        );
        self.stats.prefetch.issued += 1;
        if speculative {
            self.speculative_bytes += bytes;
        }
        Ok(())
    }

    /// The MoE block that runs after `block` of `stack`, across the encoder/decoder boundary
    /// and from the decoder's last MoE layer to its first (the next token).
    fn next_moe_block(&self, stack: Stack, block: usize) -> Option<(Stack, usize)> {
        if let Some(next) = self.layers.next_block(stack, block) {
            return Some((stack, next));
        }
        self.layers
            .blocks(Stack::Decoder)
            .first()
            .map(|&b| (Stack::Decoder, b))
    }
}

/// Offline activation frequency of every expert, from the dictionary (empty without one).
fn seeds(
    layers: &LayerMap,
    num_experts: usize,
    dictionary: Option<&PathDictionary>,
) -> Vec<(ExpertId, f64)> {
    let Some(dict) = dictionary else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for stack in [Stack::Encoder, Stack::Decoder] {
        for (moe, &block) in layers.blocks(stack).iter().enumerate() {
            for (expert, p) in dict.stack(stack).frequencies(moe).into_iter().enumerate() {
                if expert < num_experts {
                    out.push((
                        ExpertId {
                            stack,
                            layer: block as u16,
                            expert: expert as u16,
                        },
                        p,
                    ));
                }
            }
        }
    }
    out
}

impl ExpertProvider for ExpertBuffer {
    fn expert(&mut self, id: ExpertId) -> Result<ExpertWeights> {
        let slot = self.demand(id)?;
        let entry = self
            .store
            .entry(id)
            .expect("demand only succeeds for experts in the store");
        let memory = self.memory[slot]
            .as_ref()
            .expect("a demanded slot is not being filled");
        decode_expert(entry, memory.as_slice(), &mut self.scratch)?;
        self.in_use = Some(id);
        let names: Vec<&str> = entry.matrices.iter().map(|m| m.name.as_str()).collect();
        ExpertWeights::from_matrices(id, &names, &self.scratch)
    }

    fn begin_step(&mut self, stack: Stack) {
        match stack {
            Stack::Decoder => self.step += 1,
            Stack::Encoder => self.current = None,
        }
        self.speculative_bytes = 0;
        self.history.clear();
        self.history_stack = Some(stack);
    }

    fn routed(&mut self, stack: Stack, block: usize, k: usize, experts: &[u16]) -> Result<()> {
        self.in_use = None;
        let k = k.max(1);
        let tokens = experts.len() / k;
        // Speculative reads for this layer that the router did not choose are dropped.
        for (id, flight) in &self.in_flight {
            if flight.speculative
                && id.stack == stack
                && id.layer as usize == block
                && !experts.contains(&id.expert)
            {
                flight.cancel.store(true, Ordering::Release);
            }
        }
        // How the dictionary's guesses for this layer did: a guess is right when the token's
        // experts include it.
        if let Some((s, b, guesses)) = self.guesses.take() {
            if s == stack && b == block && guesses.len() == tokens {
                let dict = &mut self.stats.dictionary;
                dict.predictions += guesses.len() as u64;
                dict.top1_correct += guesses
                    .iter()
                    .zip(experts.chunks(k))
                    .filter(|(g, set)| set.contains(g))
                    .count() as u64;
                dict.top1_accuracy = dict.top1_correct as f64 / dict.predictions.max(1) as f64;
            }
        }
        if stack == Stack::Decoder {
            self.current = self.layers.moe_index(stack, block);
        }
        if self.history_stack != Some(stack) || self.history_k != k {
            self.history.clear();
            self.history_stack = Some(stack);
            self.history_k = k;
        }
        self.history.push(experts.to_vec());

        let (Some(dict), Some((next_stack, next_block))) =
            (self.dictionary.clone(), self.next_moe_block(stack, block))
        else {
            return Ok(());
        };
        let Some(next_moe) = self.layers.moe_index(next_stack, next_block) else {
            return Ok(());
        };
        let paths = dict.stack(next_stack);
        // Within a stack the path so far predicts the next layer; across the boundary (and to
        // the next token) only the layer's frequencies do.
        let same_call = next_stack == stack && next_moe > 0 && paths.top_k == k;
        let tokens = if same_call { tokens } else { 1 };
        // Summed over tokens: the probability that each expert is among a token's experts.
        let mut mass = vec![0.0f64; paths.num_experts];
        let mut guesses = Vec::with_capacity(tokens);
        let mut history = Vec::new();
        for t in 0..tokens {
            history.clear();
            if same_call {
                for layer in &self.history {
                    history.extend_from_slice(&layer[t * k..(t + 1) * k]);
                }
            }
            let p = paths.predict(next_moe, &history);
            let best = p
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map_or(0, |(e, _)| e as u16);
            guesses.push(best);
            for (m, q) in mass.iter_mut().zip(&p) {
                *m += q;
            }
        }
        if same_call {
            self.guesses = Some((next_stack, next_block, guesses));
        }
        let mut order: Vec<usize> = (0..mass.len()).collect();
        order.sort_by(|&a, &b| mass[b].total_cmp(&mass[a]));
        for expert in order {
            if mass[expert] < PREFETCH_MIN_PROBABILITY * tokens as f64 {
                break;
            }
            let id = ExpertId {
                stack: next_stack,
                layer: next_block as u16,
                expert: expert as u16,
            };
            self.start_prefetch(id, true)?;
        }
        Ok(())
    }

    fn will_use(&mut self, id: ExpertId) -> Result<()> {
        self.start_prefetch(id, false)
    }

    fn stats(&self) -> &ExpertStats {
        &self.stats
    }
}
