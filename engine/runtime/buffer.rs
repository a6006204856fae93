//! The expert buffer: the cache of experts between the expert store and the model.
//!
//! [`ExpertBuffer`] owns a fixed number of page-aligned slots, allocated once and sized from the
//! memory budget. Slots hold experts in their stored form, and the model computes on them there
//! (views of the slot, see `codec`). Which expert sits where, and what to evict,
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

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::cache::policy::{LayerMap, Policy, PolicyState};
use crate::cache::table::{AccessContext, Evicted, Outcome, SlotTable};
use crate::cache::trace::{AccessKind, TraceEvent, TraceHeader, TraceWriter, TRACE_VERSION};
use crate::config::ModelSpec;
use crate::dictionary::PathDictionary;
use crate::error::{Error, Result};
use crate::ids::{ExpertId, Stack};
use crate::model::provider::{ExpertProvider, ExpertWeights};
use crate::store::{AlignedBuf, ExpertStore};

use super::codec::expert_weights;
use super::predict::{seeds, Predictor};
use super::prefetch::{self, Completion, Prefetcher, Request};
use super::stats::ExpertStats;

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
    /// The dictionary's predictions for the next MoE layer (with a dictionary only).
    predictor: Option<Predictor>,
    /// The expert whose weights were handed out last (still being computed on).
    in_use: Option<ExpertId>,
    stats: ExpertStats,
    trace: Option<TraceWriter>,
    /// Forward calls so far (trace `token`).
    step: u64,
    /// Decoder MoE layer executing.
    current: Option<usize>,
    speculative_bytes: u64,
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
        let layers = spec.layer_map();
        let seeds = seeds(&layers, spec.num_experts(), dictionary.as_deref());
        let table = SlotTable::new(
            slots,
            PolicyState::new(options.policy, layers.clone(), &seeds),
        );
        let store = Arc::new(store);
        let prefetcher = if options.prefetch {
            let p = Prefetcher::spawn(store.clone(), slots)
                .map_err(|e| Error::Internal(format!("cannot start the prefetch thread: {e}")))?;
            Some(p)
        } else {
            None
        };
        Ok(ExpertBuffer {
            store,
            table,
            memory,
            in_flight: HashMap::new(),
            prefetcher,
            prefetch_cap_bytes: options.prefetch_cap_bytes,
            predictor: dictionary
                .clone()
                .map(|d| Predictor::new(d, layers.clone())),
            layers,
            dictionary,
            in_use: None,
            stats: ExpertStats::default(),
            trace: None,
            step: 0,
            current: None,
            speculative_bytes: 0,
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

    pub fn stats(&self) -> &ExpertStats {
        &self.stats
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
            prefetch::Outcome::Cancelled => {
                self.stats.prefetch.cancelled += 1;
                self.table.remove(done.id);
                let pinned = self.pinned();
                self.log(AccessKind::Cancel, done.id, &pinned)?;
            }
            prefetch::Outcome::Failed(error) => {
                // Reported as a demand read's failure is, whether or not the expert is ever
                // demanded: a prefetch that failed its checksum and were dropped quietly would
                // be read again at every prediction, and the run would go on over a damaged
                // store. The bytes it read are counted like any read's.
                self.stats.prefetch.failed += 1;
                let read = self.failed_read_bytes(&error);
                self.stats.prefetch.bytes_read += read;
                self.stats.bytes_read += read;
                self.table.remove(done.id);
                let pinned = self.pinned();
                self.log(AccessKind::Cancel, done.id, &pinned)?;
                return Err(error);
            }
        }
        Ok(())
    }

    /// Bytes a failed read moved: the whole blob when it failed its checksum (it was read to
    /// be checked), none when the read itself failed.
    fn failed_read_bytes(&self, error: &Error) -> u64 {
        match error {
            Error::Checksum { expert, .. } => self.store.entry(*expert).map_or(0, |e| e.length),
            _ => 0,
        }
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
                .ok_or_else(|| {
                    Error::Internal("the prefetch thread stopped unexpectedly".into())
                })?;
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
                step: self.step,
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
                        // A failed read comes back as its error.
                        self.wait_for(Some(id))?;
                        if self.table.slot_of(id).is_none() {
                            // Cancelled before its read started: read it here.
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
                            self.stats.bytes_read += self.failed_read_bytes(&e);
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
                        return Err(Error::Internal(format!(
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
            step: self.step,
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
            return Err(Error::Internal(
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
}

impl ExpertProvider for ExpertBuffer {
    fn expert(&mut self, id: ExpertId, next: Option<ExpertId>) -> Result<ExpertWeights<'_>> {
        let slot = self.demand(id)?;
        self.in_use = Some(id);
        // The slot in use is pinned: the next expert's read cannot take it.
        if let Some(next) = next {
            self.start_prefetch(next, false)?;
        }
        let entry = self
            .store
            .entry(id)
            .expect("demand only succeeds for experts in the store");
        let memory = self.memory[slot]
            .as_ref()
            .expect("a demanded slot is not being filled");
        expert_weights(entry, memory.as_slice())
    }

    fn begin_step(&mut self, stack: Stack) {
        match stack {
            Stack::Decoder => self.step += 1,
            Stack::Encoder => self.current = None,
        }
        self.speculative_bytes = 0;
        if let Some(predictor) = self.predictor.as_mut() {
            predictor.begin_step(stack);
        }
    }

    fn routed(&mut self, stack: Stack, block: usize, k: usize, experts: &[u16]) -> Result<()> {
        self.in_use = None;
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
        if stack == Stack::Decoder {
            self.current = self.layers.moe_index(stack, block);
        }
        let Some(predictor) = self.predictor.as_mut() else {
            return Ok(());
        };
        for id in predictor.routed(stack, block, k, experts, &mut self.stats.dictionary) {
            self.start_prefetch(id, true)?;
        }
        Ok(())
    }
}
