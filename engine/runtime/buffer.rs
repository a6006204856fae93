//! The expert buffer: the cache of experts between the expert store and the model.
//!
//! [`ExpertBuffer`] owns a fixed number of page-aligned slots, allocated once and sized from the
//! memory budget. Slots hold experts in their stored form, and the model computes on them there
//! (views of the slot, see `codec`). Which expert sits where, and what to evict,
//! is decided by a [`SlotTable`] and its [`Policy`] (the same code trace replay runs). With
//! prefetch on, every read goes through an [`IoScheduler`] that owns the device: demand misses
//! first (the compute thread waits for them), then the next expert of the layer being
//! computed, then experts the [`PathDictionary`] predicts for the next MoE layer. A slot being
//! computed on or being filled is never evicted.
//!
//! Speculation is held to what pays ([`Speculation`]): at most as many speculative reads in
//! flight as the device serves at once, only into a free slot or one whose expert is worth less
//! than the prediction (probability over layers until its next use, below the predicted
//! expert's probability of being used next), and none for a layer where it has recently cost
//! more than it saved.
//!
//! With stand-ins on ([`StandIns`], `--stand-in`), a decode step's expert that is not ready in
//! a slot is computed with its resident low-bit copy, and a miss starts the full expert's read
//! at demand priority without waiting for it: the slot table sees the same accesses either way.
//!
//! Top-k routing changes nothing for the slots: an expert is one blob whatever its matrices
//! (`wi`/`wo` for Switch, `gate`/`up`/`down` for SwiGLU), demanded once per layer per forward
//! call. The router reports `k` experts per token (`routed`); dictionary predictions then give,
//! per expert, the probability that it is among a token's k, and a guess counts as right when
//! the token's experts include it.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;
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
use super::predict::{
    combined_prediction, gate_prediction, next_moe_block, seeds, Predictor, PredictorKind,
};
use super::prefetch::{self, Completion, IoScheduler, Priority, Request};
use super::speculation::Speculation;
use super::stand_in::{stand_in_experts, StandIns, MAX_ROWS};
use super::stats::{ExpertStats, StandInStats};
use crate::quant::QuantBits;

/// Knobs of an [`ExpertBuffer`].
#[derive(Debug, Clone)]
pub struct BufferOptions {
    pub slots: usize,
    pub policy: Policy,
    /// Read through an I/O scheduler, ahead of need (dictionary predictions and the next expert
    /// of a layer). Its readers are the store's queue depth.
    pub prefetch: bool,
    /// Most speculative (predicted) bytes started per forward call.
    pub prefetch_cap_bytes: u64,
    /// Which predictions start speculative reads (each is scored whichever it is).
    pub predictor: PredictorKind,
    /// Keep a copy of every decoder expert at this width to compute a decode step's misses
    /// with while the full expert is read ([`StandIns`]). Needs no prefetch: its reads go
    /// through the I/O scheduler either way.
    pub stand_in: Option<QuantBits>,
}

/// Why a read in flight was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadKind {
    /// A demand miss: the compute thread waits for it.
    Miss,
    /// The next expert of the layer being computed.
    Next,
    /// A dictionary prediction.
    Speculative,
}

struct InFlight {
    kind: ReadKind,
    /// For a demand miss: the layers of the speculative reads in flight when it was submitted
    /// (a started one delays it: its wait in the queue is charged to them).
    behind: Vec<ExpertId>,
}

/// A fixed set of slots over an expert store.
pub struct ExpertBuffer {
    store: Arc<ExpertStore>,
    layers: LayerMap,
    table: SlotTable,
    /// Slot memory; `None` while lent to the I/O scheduler.
    memory: Vec<Option<AlignedBuf>>,
    in_flight: HashMap<ExpertId, InFlight>,
    /// Reads ahead of need (the next expert of a layer, predictions).
    prefetch: bool,
    /// Owns the device: with prefetch or stand-ins on.
    io: Option<IoScheduler>,
    stand_ins: Option<StandIns>,
    /// Tokens routed to the MoE layer being computed (stand-ins serve small calls only).
    call_rows: usize,
    prefetch_cap_bytes: u64,
    dictionary: Option<Arc<PathDictionary>>,
    /// The dictionary's predictions for the next MoE layer (with a dictionary only).
    predictor: Option<Predictor>,
    /// Which predictions start speculative reads.
    predictor_kind: PredictorKind,
    /// The gate lookahead's last prediction, waiting for the layer before it to route.
    gate_prediction: Option<(Stack, usize, Vec<ExpertId>)>,
    /// Share of the call's tokens the gate lookahead routed to each expert it predicted.
    gate_share: HashMap<ExpertId, f64>,
    /// The expert whose weights were handed out last (still being computed on).
    in_use: Option<ExpertId>,
    stats: ExpertStats,
    trace: Option<TraceWriter>,
    /// Forward calls so far (trace `token`).
    step: u64,
    /// Decoder MoE layer executing.
    current: Option<usize>,
    speculative_bytes: u64,
    speculation: Speculation,
    /// The predictions for the layer after the one being computed, started once
    /// that layer's own experts have been demanded (a speculative read started first would
    /// hold the device while the layer's demand reads wait behind it).
    deferred: Vec<ExpertId>,
    /// The MoE layer routed last: (stack, MoE index).
    routed_at: Option<(Stack, usize)>,
    /// Offline activation probability of each expert within its layer (the dictionary's).
    frequency: HashMap<ExpertId, f64>,
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
                predictor: PredictorKind::Dictionary,
                stand_in: None,
            },
            None,
        )
        .expect("a buffer without prefetch thread cannot fail")
    }

    /// Allocates the slots (each large enough for the store's largest expert) and, with
    /// prefetch on, starts the I/O scheduler. `dictionary` seeds the policy's frequencies and
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
        let memory = AlignedBuf::many(slots, slot_bytes)
            .into_iter()
            .map(Some)
            .collect();
        let layers = spec.layer_map();
        let seeds = seeds(&layers, spec.num_experts(), dictionary.as_deref());
        let table = SlotTable::new(
            slots,
            PolicyState::new(options.policy, layers.clone(), &seeds),
        );
        let frequency = seeds.frequency.iter().copied().collect();
        let read_ms = store.pacer().map_or(0.0, |p| {
            p.read_cost(store.max_padded_expert_bytes()).as_secs_f64() * 1e3
        });
        let speculation =
            Speculation::new(store.device_share(store.max_padded_expert_bytes()), read_ms);
        let mut stats = ExpertStats::default();
        let stand_ins = match options.stand_in {
            Some(bits) => {
                let ids = stand_in_experts(&store);
                let copies = StandIns::build(&store, &spec.expert_layout(), &ids, bits)?;
                stats.stand_in = Some(StandInStats {
                    bits: bits.name().into(),
                    experts: copies.len(),
                    bytes: copies.bytes(),
                    load_bytes: copies.load_bytes,
                    load_ms: copies.load_ms,
                    ..StandInStats::default()
                });
                Some(copies)
            }
            None => None,
        };
        let store = Arc::new(store);
        let io = if options.prefetch || stand_ins.is_some() {
            let readers = store.queue_depth().min(slots);
            let io = IoScheduler::spawn(store.clone(), readers)
                .map_err(|e| Error::Internal(format!("cannot start the I/O threads: {e}")))?;
            Some(io)
        } else {
            None
        };
        Ok(ExpertBuffer {
            store,
            table,
            memory,
            in_flight: HashMap::new(),
            prefetch: options.prefetch,
            io,
            stand_ins,
            call_rows: usize::MAX,
            prefetch_cap_bytes: options.prefetch_cap_bytes,
            predictor: dictionary
                .clone()
                .map(|d| Predictor::new(d, layers.clone())),
            predictor_kind: options.predictor,
            gate_prediction: None,
            gate_share: HashMap::new(),
            layers,
            dictionary,
            in_use: None,
            stats,
            trace: None,
            step: 0,
            current: None,
            speculative_bytes: 0,
            speculation,
            deferred: Vec::new(),
            routed_at: None,
            frequency,
        })
    }

    /// Records every access from now on into `path` (JSON lines, see `cache::trace`).
    pub fn record_trace(&mut self, path: &Path) -> Result<()> {
        let header = TraceHeader {
            edgemoe_trace: TRACE_VERSION,
            slots: self.table.len(),
            policy: self.table.policy.policy,
            prefetch: self.prefetch,
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

    /// The expert each slot holds (or is being read into), slot by slot; `None` for an empty
    /// slot (the service's dashboard draws the buffer from it).
    pub fn slot_contents(&self) -> Vec<Option<ExpertId>> {
        (0..self.table.len()).map(|s| self.table.holds(s)).collect()
    }

    pub fn store(&self) -> &ExpertStore {
        &self.store
    }

    /// Whether the I/O threads have exited (for shutdown tests).
    pub fn prefetch_exit_flag(&self) -> Option<Arc<AtomicBool>> {
        self.io.as_ref().map(IoScheduler::exited_flag)
    }

    /// The I/O scheduler (with prefetch on).
    pub fn io(&self) -> Option<&IoScheduler> {
        self.io.as_ref()
    }

    fn pinned(&self) -> Vec<ExpertId> {
        self.in_flight.keys().copied().chain(self.in_use).collect()
    }

    fn log(&mut self, kind: AccessKind, id: ExpertId, pinned: &[ExpertId]) -> Result<()> {
        self.log_waited(kind, id, pinned, None)
    }

    /// [`Self::log`] with the milliseconds a demand access waited, if it did.
    fn log_waited(
        &mut self,
        kind: AccessKind,
        id: ExpertId,
        pinned: &[ExpertId],
        waited_ms: Option<f64>,
    ) -> Result<()> {
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
            waited_ms,
        })
    }

    fn note_eviction(&mut self, evicted: Option<Evicted>) {
        if let Some(e) = evicted.filter(|e| e.prefetched_unused) {
            self.stats.prefetch.wasted_bytes += self.store.entry(e.expert).map_or(0, |x| x.length);
        }
    }

    /// Takes back a slot from the I/O scheduler and updates the books.
    fn complete(&mut self, done: Completion) -> Result<()> {
        self.memory[done.slot] = Some(done.memory);
        let (kind, behind) = self
            .in_flight
            .remove(&done.id)
            .map_or((ReadKind::Speculative, Vec::new()), |f| (f.kind, f.behind));
        match done.outcome {
            prefetch::Outcome::Loaded { bytes, read_ms } => {
                self.stats.bytes_read += bytes;
                if kind == ReadKind::Miss {
                    self.stats.read_ms += read_ms;
                    if self.speculation.delayed(&behind, done.queued_ms) {
                        self.refresh_speculation_stats();
                    }
                } else {
                    self.stats.prefetch.bytes_read += bytes;
                }
                self.speculation
                    .read(done.id, read_ms, kind == ReadKind::Speculative);
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
                let read = self.failed_read_bytes(&error);
                self.stats.bytes_read += read;
                self.table.remove(done.id);
                if kind != ReadKind::Miss {
                    self.stats.prefetch.failed += 1;
                    self.stats.prefetch.bytes_read += read;
                    let pinned = self.pinned();
                    self.log(AccessKind::Cancel, done.id, &pinned)?;
                }
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
        while let Some(done) = self.io.as_ref().and_then(IoScheduler::try_recv) {
            self.complete(done)?;
        }
        Ok(())
    }

    /// Blocks until the read of `id` (or, with `None`, any read) comes back; returns the
    /// milliseconds waited (counted as stall).
    fn wait_for(&mut self, id: Option<ExpertId>) -> Result<f64> {
        let started = Instant::now();
        let result = loop {
            let Some(done) = self.io.as_ref().and_then(IoScheduler::recv) else {
                break Err(Error::Internal(
                    "the I/O threads stopped unexpectedly".into(),
                ));
            };
            let this = done.id;
            if let Err(e) = self.complete(done) {
                break Err(e);
            }
            if id.is_none() || id == Some(this) {
                break Ok(());
            }
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        self.stats.stall_ms += ms;
        result.map(|()| ms)
    }

    /// Copies the speculation books into the statistics.
    fn refresh_speculation_stats(&mut self) {
        self.stats.prefetch.per_layer = self.speculation.per_layer();
    }

    /// The slot that holds `id`, ready to decode. Its trace event is written once the bytes
    /// are there, with what it waited: no other event can come between (only a failed read
    /// or a shutdown logs while reads complete).
    fn demand(&mut self, id: ExpertId) -> Result<usize> {
        self.in_use = None;
        self.drain_completions()?;
        // Waits for a slot to free, before the access itself.
        let mut waited_for_slot = 0.0;
        loop {
            let pinned = self.pinned();
            let ctx = AccessContext {
                current: self.current,
                step: self.step,
                pinned: &pinned,
            };
            match self.table.demand(id, &ctx) {
                Some(Outcome::Hit { slot, prefetched }) => {
                    self.stats.record(id, true);
                    if prefetched {
                        self.stats.prefetch.useful += 1;
                    }
                    let mut waited = 0.0;
                    if self.in_flight.contains_key(&id) {
                        // Still queued: it goes ahead of every speculative read. A failed read
                        // comes back as its error.
                        if let Some(io) = &self.io {
                            io.upgrade(id, Priority::Demand);
                        }
                        waited = self.wait_for(Some(id))?;
                    }
                    let total = waited_for_slot + waited;
                    self.log_waited(
                        AccessKind::Demand,
                        id,
                        &pinned,
                        (total > 0.0).then_some(total),
                    )?;
                    if self.speculation.demanded(id, waited) {
                        self.refresh_speculation_stats();
                    }
                    return Ok(slot);
                }
                Some(Outcome::Miss { slot, evicted }) => {
                    self.stats.record(id, false);
                    self.note_eviction(evicted);
                    if self.speculation.missed(id, self.step) {
                        self.refresh_speculation_stats();
                    }
                    // With reads in flight, the I/O scheduler puts this one ahead of every
                    // queued speculative read. On an idle device it is read here: handing it
                    // to a reader thread and back costs two thread wake-ups, ~0.1 ms a read on
                    // a 2-core VM (7% of a 512 KiB read on the `rpi5-nvme` profile).
                    if !self.in_flight.is_empty() {
                        self.submit(id, slot, ReadKind::Miss);
                        let waited = self.wait_for(Some(id))?;
                        let total = waited_for_slot + waited;
                        self.log_waited(AccessKind::Demand, id, &pinned, Some(total))?;
                        return Ok(slot);
                    }
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
                    self.speculation.read(id, ms, false);
                    let total = waited_for_slot + ms;
                    self.log_waited(AccessKind::Demand, id, &pinned, Some(total))?;
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
                    waited_for_slot += self.wait_for(None)?;
                }
            }
        }
    }

    /// Hands slot `slot`'s memory to the I/O scheduler to read `id` into.
    fn submit(&mut self, id: ExpertId, slot: usize, kind: ReadKind) {
        let memory = self.memory[slot]
            .take()
            .expect("a slot that is not being filled has its memory");
        let priority = match kind {
            ReadKind::Miss => Priority::Demand,
            ReadKind::Next => Priority::Next,
            ReadKind::Speculative => Priority::Speculative,
        };
        let behind = match kind {
            ReadKind::Miss => self
                .in_flight
                .iter()
                .filter(|(_, f)| f.kind == ReadKind::Speculative)
                .map(|(id, _)| *id)
                .collect(),
            _ => Vec::new(),
        };
        self.io
            .as_ref()
            .expect("reads are submitted with prefetch on")
            .submit(Request {
                id,
                slot,
                memory,
                priority,
            });
        self.in_flight.insert(id, InFlight { kind, behind });
    }

    /// Speculative reads in flight (queued or started).
    fn speculative_in_flight(&self) -> usize {
        self.in_flight
            .values()
            .filter(|f| f.kind == ReadKind::Speculative)
            .count()
    }

    /// MoE layers from the one routed last until `id`'s layer runs next (0: not again in
    /// this forward call's future, as an encoder layer already run).
    fn distance(&self, id: ExpertId) -> usize {
        let encoder = self.layers.blocks(Stack::Encoder).len();
        let decoder = self.layers.decoder_layers().max(1);
        let Some(index) = self.layers.moe_index(id.stack, id.layer as usize) else {
            return 0;
        };
        let position = |stack: Stack, index: usize| match stack {
            Stack::Encoder => index,
            Stack::Decoder => encoder + index,
        };
        let target = position(id.stack, index);
        let Some((stack, at)) = self.routed_at else {
            return target + 1;
        };
        let now = position(stack, at);
        match id.stack {
            Stack::Encoder => target.saturating_sub(now),
            Stack::Decoder if now < encoder => target - now,
            Stack::Decoder => (index + decoder - (now - encoder) - 1) % decoder + 1,
        }
    }

    /// Whether the policy's victim for a speculative load of `id` (predicted with
    /// `probability` for the next layer) is worth less than the prediction: a free slot; under
    /// `edgemoe`, an expert the policy expects back later than the prediction
    /// ([`PolicyState::speculation_outranks`]); under the other policies, an expert whose
    /// offline chance of use per layer until its next turn is below the prediction's.
    fn room_for_speculation(
        &self,
        id: ExpertId,
        probability: f64,
        ctx: &AccessContext<'_>,
    ) -> bool {
        match self.table.peek_room(ctx) {
            None => false,
            Some((_, None)) => true,
            Some((_, Some(victim))) => {
                let policy = &self.table.policy;
                if let Some(outranks) =
                    policy.speculation_outranks(id, probability, victim, ctx.current)
                {
                    return outranks;
                }
                let d = self.distance(victim);
                let value = if d == 0 {
                    0.0
                } else {
                    self.frequency.get(&victim).copied().unwrap_or(0.0) / d as f64
                };
                value < probability
            }
        }
    }

    /// Whether the next expert of the layer being computed may be read now: into a free slot,
    /// or over the expert its demand read would evict once the one being computed is done (the
    /// policy's victim with the expert in use unpinned), and only if that expert is needed no
    /// sooner than the one being computed. Reading it ahead pins the expert in use, which is
    /// often the best victim (an encoder layer that has run is not needed again until the next
    /// document); evicting another instead costs a whole read later to save at most the
    /// current expert's compute time now. With the policy's own ranking too, not the layer
    /// distance alone: an encoder pass's later layers read ahead over experts of its earlier
    /// ones (both "not needed again in this forward call"), which the next document's encoder
    /// then missed (BENCHMARKS §11.3).
    fn room_for_next(&self, ctx: &AccessContext<'_>) -> bool {
        let Some(computing) = self.in_use else {
            return true;
        };
        let unpinned: Vec<ExpertId> = ctx
            .pinned
            .iter()
            .copied()
            .filter(|&id| id != computing)
            .collect();
        let demand_paging = AccessContext {
            pinned: &unpinned,
            ..*ctx
        };
        // One look serves both checks: when the demand read's victim is not the expert in use,
        // it is also the victim with that expert pinned (the same least of a smaller set).
        match self.table.peek_room(&demand_paging) {
            None => false,
            Some((_, None)) => true,
            Some((_, Some(victim))) if victim == computing => false,
            Some((_, Some(victim))) => {
                // Distance 0: not needed again in this forward call, the latest of all.
                let due = |id: ExpertId| match self.distance(id) {
                    0 => usize::MAX,
                    d => d,
                };
                due(victim) >= due(computing)
            }
        }
    }

    /// How likely the predictor that started speculation thinks `id` is needed: the
    /// dictionary's probability, the share of tokens the gate lookahead routed to it, or the
    /// larger of the two.
    fn prediction_probability(&self, id: ExpertId) -> f64 {
        let dictionary = || self.predictor.as_ref().map_or(1.0, |p| p.probability(id));
        let gate = || self.gate_share.get(&id).copied().unwrap_or(0.0);
        match self.predictor_kind {
            PredictorKind::Dictionary => dictionary(),
            PredictorKind::Gate => gate(),
            PredictorKind::Both => dictionary().max(gate()),
        }
    }

    /// Once a layer's expert is at hand: starts reading the layer's `next` expert, or after the
    /// layer's last one the predictions for the next layer.
    fn after_demand(&mut self, next: Option<ExpertId>) -> Result<()> {
        match next {
            Some(next) => self.start_prefetch(next, ReadKind::Next),
            // The layer's last expert is here: its reads no longer compete with speculation.
            None => {
                for id in std::mem::take(&mut self.deferred) {
                    self.start_prefetch(id, ReadKind::Speculative)?;
                }
                Ok(())
            }
        }
    }

    /// Whether one expert's read leaves at least half of the device to other reads
    /// ([`ExpertStore::device_share`]): several channels whose transfers do not share one
    /// bus's bytes, or a store with no device model and several channels.
    fn spare_transfer(&self) -> bool {
        self.store
            .device_share(self.store.max_padded_expert_bytes())
            <= 0.5
    }

    /// Whether the forward call being computed is a decode step: at most [`MAX_ROWS`] tokens
    /// routed to the layer (one per sequence or beam), not an encoder pass or a prompt prefill.
    fn decode_step(&self) -> bool {
        self.call_rows <= MAX_ROWS
    }

    /// Whether `id` is computed by its stand-in: stand-ins are on, `id` has one, the layer's
    /// forward call is small (a decode step), and the full expert is not ready in a slot
    /// (absent, or its read not finished).
    fn stand_in_serves(&mut self, id: ExpertId) -> Result<bool> {
        let has = self.stand_ins.as_ref().is_some_and(|s| s.has(id));
        if !has || !self.decode_step() {
            return Ok(false);
        }
        self.drain_completions()?;
        Ok(self.table.slot_of(id).is_none() || self.in_flight.contains_key(&id))
    }

    /// The books of a demand access that a stand-in computes: the slot table sees the access
    /// as any demand (so replay and the policy see the same run), and a miss starts reading
    /// the full expert for later steps, ahead of speculation, without waiting for it.
    fn demand_for_later(&mut self, id: ExpertId) -> Result<()> {
        self.in_use = None;
        let pinned = self.pinned();
        let ctx = AccessContext {
            current: self.current,
            step: self.step,
            pinned: &pinned,
        };
        let outcome = self.table.demand(id, &ctx);
        let stand_in = self
            .stats
            .stand_in
            .as_mut()
            .expect("stand-in statistics exist with stand-ins");
        stand_in.used += 1;
        match outcome {
            Some(Outcome::Hit { prefetched, .. }) => {
                // Being read: it goes ahead of every speculative read.
                self.log(AccessKind::Demand, id, &pinned)?;
                self.stats.record(id, true);
                if prefetched {
                    self.stats.prefetch.useful += 1;
                }
                if let Some(io) = &self.io {
                    io.upgrade(id, Priority::Demand);
                }
                if self.speculation.demanded(id, 0.0) {
                    self.refresh_speculation_stats();
                }
            }
            Some(Outcome::Miss { slot, evicted }) => {
                stand_in.reads_started += 1;
                self.log(AccessKind::Demand, id, &pinned)?;
                self.stats.record(id, false);
                self.note_eviction(evicted);
                if self.speculation.missed(id, self.step) {
                    self.refresh_speculation_stats();
                }
                self.submit(id, slot, ReadKind::Miss);
            }
            None => stand_in.unbuffered += 1,
        }
        Ok(())
    }

    /// Starts reading `id` through the I/O scheduler if it is not resident or being read.
    fn start_prefetch(&mut self, id: ExpertId, kind: ReadKind) -> Result<()> {
        if !self.prefetch || self.io.is_none() || self.table.slot_of(id).is_some() {
            return Ok(());
        }
        let Some(bytes) = self.store.entry(id).map(|e| e.length) else {
            return Ok(());
        };
        let speculative = kind == ReadKind::Speculative;
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
        if speculative {
            let probability = self.prediction_probability(id);
            let pays = self.speculation.enabled(id)
                && self.speculation.worth_reading(id, probability)
                && self.speculative_in_flight() < self.store.queue_depth()
                && self.room_for_speculation(id, probability, &ctx);
            if !pays {
                self.speculation.candidate(id, false);
                return Ok(());
            }
        }
        if kind == ReadKind::Next && !self.room_for_next(&ctx) {
            return Ok(());
        }
        let Some((slot, evicted)) = self.table.prefetch(id, &ctx) else {
            return Ok(());
        };
        self.log(AccessKind::Prefetch, id, &pinned)?;
        if speculative {
            self.speculation.candidate(id, true);
            if let Some(e) = evicted.filter(|e| !e.prefetched_unused) {
                self.speculation.evicted(id, e.expert, self.step);
            }
            self.speculative_bytes += bytes;
        }
        self.note_eviction(evicted);
        self.submit(id, slot, kind);
        self.stats.prefetch.issued += 1;
        Ok(())
    }
}

impl ExpertProvider for ExpertBuffer {
    fn stall_ms(&self) -> f64 {
        self.stats.stall_ms
    }

    fn expert(&mut self, id: ExpertId, next: Option<ExpertId>) -> Result<ExpertWeights<'_>> {
        if self.stand_in_serves(id)? {
            self.demand_for_later(id)?;
            self.after_demand(next)?;
            let copies = self.stand_ins.as_ref().expect("checked by stand_in_serves");
            return copies.weights(id);
        }
        let slot = self.demand(id)?;
        self.in_use = Some(id);
        // The slot in use is pinned: the next expert's read cannot take it.
        self.after_demand(next)?;
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
            Stack::Encoder => {
                self.current = None;
                self.routed_at = None;
            }
        }
        self.speculative_bytes = 0;
        self.gate_prediction = None;
        if let Some(predictor) = self.predictor.as_mut() {
            predictor.begin_step(stack);
        }
    }

    fn routed(&mut self, stack: Stack, block: usize, k: usize, experts: &[u16]) -> Result<()> {
        self.in_use = None;
        self.call_rows = experts.len() / k.max(1);
        // Predictions for this layer not started yet are moot now.
        self.deferred.clear();
        // Speculative reads for this layer that the router did not choose are taken back if
        // they have not started (a started read completes).
        let mut unchosen: Vec<ExpertId> = self
            .in_flight
            .iter()
            .filter(|(id, f)| {
                f.kind == ReadKind::Speculative
                    && id.stack == stack
                    && id.layer as usize == block
                    && !experts.contains(&id.expert)
            })
            .map(|(id, _)| *id)
            .collect();
        unchosen.sort();
        for id in unchosen {
            let Some(request) = self.io.as_ref().and_then(|io| io.cancel(id)) else {
                continue;
            };
            self.memory[request.slot] = Some(request.memory);
            self.in_flight.remove(&id);
            self.table.remove(id);
            self.stats.prefetch.cancelled += 1;
            self.speculation.cancelled(id);
            let pinned = self.pinned();
            self.log(AccessKind::Cancel, id, &pinned)?;
        }
        // Loads of this layer that a prefetch brought in and its router did not choose now:
        // their prediction is refuted, so their slots are free again, as if they had never
        // been read (what demand paging alone would hold). Kept, the policy would value them
        // by the offline frequencies the prediction drew on, and where a document routes
        // otherwise they stayed for tens of tokens and made the experts in use miss
        // (BENCHMARKS.md §11.2). Without prefetch there are none, and every MoE layer of every
        // decoder step routes: no scan then.
        if self.prefetch {
            let pinned = self.pinned();
            for id in self
                .table
                .refuted_prefetches(stack, block as u16, experts, &pinned)
            {
                self.table.remove(id);
                self.stats.prefetch.wasted_bytes += self.store.entry(id).map_or(0, |x| x.length);
                self.stats.prefetch.refuted += 1;
                self.log(AccessKind::Cancel, id, &pinned)?;
            }
        }
        self.speculation.routed(stack, block as u16, experts);
        self.refresh_speculation_stats();
        if stack == Stack::Decoder {
            self.current = self.layers.moe_index(stack, block);
        }
        self.routed_at = self.layers.moe_index(stack, block).map(|i| (stack, i));
        self.stats.predictions.score(stack, block, experts);
        let dictionary = match self.predictor.as_mut() {
            Some(p) => Some(p.routed(stack, block, k, experts, &mut self.stats.dictionary)),
            None => None,
        };
        let next = next_moe_block(&self.layers, stack, block);
        // The gate's prediction arrived before this block routed, for the block after it in
        // the same forward call.
        let gate = self
            .gate_prediction
            .take()
            .filter(|(s, b, _)| Some((*s, *b)) == next && *s == stack)
            .map(|(_, _, experts)| experts);
        if gate.is_none() {
            self.gate_share.clear();
        }
        if let Some((next_stack, next_block)) = next {
            if let Some(d) = &dictionary {
                self.stats
                    .predictions
                    .expect(PredictorKind::Dictionary, next_stack, next_block, d);
            }
            if let Some(g) = &gate {
                self.stats
                    .predictions
                    .expect(PredictorKind::Gate, next_stack, next_block, g);
            }
            if dictionary.is_some() || gate.is_some() {
                let both = combined_prediction(
                    dictionary.as_deref().unwrap_or(&[]),
                    gate.as_deref().unwrap_or(&[]),
                );
                self.stats
                    .predictions
                    .expect(PredictorKind::Both, next_stack, next_block, &both);
            }
        }
        // Started once this layer's own experts have been demanded (see `deferred`). Where one
        // read holds most of the device (a one-channel SD card; an NVMe drive behind a narrow
        // link, whose channels overlap only their latencies), in decode steps only: an encoder
        // pass or a prompt prefill demands most of each layer's experts anyway, one after the
        // other, with the next one read ahead while the current one computes, so the device is
        // never idle and a speculative read only delays those reads and takes slots the
        // decoder needs next (BENCHMARKS §11: decoding with prefetch on went from 1.11× off to
        // 0.90× at rpi4-sd 10 experts, and §11's last paragraph for `rpi5-nvme`). A device
        // with transfer to spare keeps it there.
        let speculate = self.decode_step() || self.spare_transfer();
        self.deferred = if !speculate {
            Vec::new()
        } else {
            match self.predictor_kind {
                PredictorKind::Dictionary => dictionary.unwrap_or_default(),
                PredictorKind::Gate => gate.unwrap_or_default(),
                PredictorKind::Both => combined_prediction(
                    dictionary.as_deref().unwrap_or(&[]),
                    gate.as_deref().unwrap_or(&[]),
                ),
            }
        };
        Ok(())
    }

    fn wants_lookahead(&self) -> bool {
        true
    }

    fn predicted(&mut self, stack: Stack, block: usize, k: usize, experts: &[u16]) -> Result<()> {
        let tokens = (experts.len() / k.max(1)).max(1) as f64;
        self.gate_share.clear();
        for &expert in experts {
            let id = ExpertId {
                stack,
                layer: block as u16,
                expert,
            };
            *self.gate_share.entry(id).or_default() += 1.0 / tokens;
        }
        self.gate_prediction = Some((stack, block, gate_prediction(stack, block, k, experts)));
        Ok(())
    }
}
