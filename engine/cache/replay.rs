//! Trace replay: run a recorded access sequence through any policy and buffer size, in
//! milliseconds, with the same [`SlotTable`] code the live buffer uses (so a run's own policy and
//! size reproduce its hit counts exactly), plus Belady's offline optimum.
//!
//! Hits and misses count demand accesses only. Prefetch and cancel events are applied as they
//! happened (unless `demand_only`); Belady always sees the demand sequence alone, which makes it
//! the upper bound of demand paging, not of prefetching.

use std::collections::HashMap;

use serde::Serialize;

use super::policy::{Policy, PolicyState};
use super::table::{AccessContext, Outcome, SlotTable};
use super::trace::{AccessKind, TraceEvent, TraceHeader};
use crate::ids::{ExpertId, Stack};

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReplayResult {
    pub policy: Policy,
    pub slots: usize,
    pub hits: u64,
    pub misses: u64,
    pub hit_ratio: f64,
    /// The demand accesses of each stack: a policy can trade one stack's hits for the other's
    /// (the decoder's misses stall decoding, the encoder's the prompt).
    pub encoder: StackTally,
    pub decoder: StackTally,
}

/// Hits and misses of one stack's demand accesses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StackTally {
    pub hits: u64,
    pub misses: u64,
}

impl StackTally {
    /// Hits over accesses; `None` without accesses.
    pub fn hit_ratio(&self) -> Option<f64> {
        let total = self.hits + self.misses;
        (total > 0).then(|| self.hits as f64 / total as f64)
    }
}

/// Counts demand outcomes by stack.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    encoder: StackTally,
    decoder: StackTally,
}

impl Tally {
    fn count(&mut self, id: ExpertId, hit: bool) {
        let stack = match id.stack {
            Stack::Encoder => &mut self.encoder,
            Stack::Decoder => &mut self.decoder,
        };
        if hit {
            stack.hits += 1;
        } else {
            stack.misses += 1;
        }
    }

    fn result(self, policy: Policy, slots: usize) -> ReplayResult {
        let hits = self.encoder.hits + self.decoder.hits;
        let total = hits + self.encoder.misses + self.decoder.misses;
        ReplayResult {
            policy,
            slots,
            hits,
            misses: total - hits,
            hit_ratio: if total == 0 {
                0.0
            } else {
                hits as f64 / total as f64
            },
            encoder: self.encoder,
            decoder: self.decoder,
        }
    }
}

/// Distinct experts the trace touches (any event kind). A buffer with more slots than this
/// behaves exactly like one with this many: nothing is ever evicted.
pub fn distinct_experts(events: &[TraceEvent]) -> usize {
    events
        .iter()
        .map(TraceEvent::id)
        .collect::<std::collections::HashSet<_>>()
        .len()
}

/// Documents of an encoder-decoder trace: its encoder passes that do not follow another
/// encoder demand (each document's encoder runs once, then its decoder). 0 for a trace without
/// encoder demands, whose prompts cannot be told apart from their decoding.
pub fn documents(events: &[TraceEvent]) -> u64 {
    let mut last = None;
    let mut documents = 0;
    for event in events.iter().filter(|e| e.kind == AccessKind::Demand) {
        if event.stack == Stack::Encoder && last != Some(Stack::Encoder) {
            documents += 1;
        }
        last = Some(event.stack);
    }
    documents
}

/// Replays `events` through `policy` with `slots` slots (a table of at most
/// [`distinct_experts`] slots is built: more would behave the same).
pub fn replay(
    header: &TraceHeader,
    events: &[TraceEvent],
    policy: Policy,
    slots: usize,
    demand_only: bool,
) -> ReplayResult {
    if policy == Policy::Belady {
        return belady(events, slots);
    }
    let state = PolicyState::new(policy, header.layers.clone(), &header.seeds);
    let mut table = SlotTable::new(slots.min(distinct_experts(events).max(1)), state);
    let mut tally = Tally::default();
    for event in events {
        let ctx = AccessContext {
            current: event.current.map(usize::from),
            step: event.token,
            pinned: &event.pinned,
        };
        match event.kind {
            AccessKind::Demand => {
                let hit = match table.demand(event.id(), &ctx) {
                    Some(Outcome::Hit { .. }) => true,
                    // Every slot pinned: the expert streams through without being cached.
                    Some(Outcome::Miss { .. }) | None => false,
                };
                tally.count(event.id(), hit);
            }
            AccessKind::Prefetch if !demand_only => {
                table.prefetch(event.id(), &ctx);
            }
            AccessKind::Cancel if !demand_only => {
                table.remove(event.id());
            }
            _ => {}
        }
    }
    tally.result(policy, slots)
}

/// Belady's MIN on the demand accesses: on a miss with a full buffer, evict the expert whose
/// next use is farthest away (or never comes).
pub fn belady(events: &[TraceEvent], slots: usize) -> ReplayResult {
    let demands: Vec<ExpertId> = events
        .iter()
        .filter(|e| e.kind == AccessKind::Demand)
        .map(TraceEvent::id)
        .collect();
    // next_use[t] = position of the next demand of demands[t] after t.
    let mut next_use = vec![usize::MAX; demands.len()];
    let mut seen: HashMap<ExpertId, usize> = HashMap::new();
    for (t, id) in demands.iter().enumerate().rev() {
        if let Some(&later) = seen.get(id) {
            next_use[t] = later;
        }
        seen.insert(*id, t);
    }
    let slots = slots.max(1);
    // Resident experts with the position of their next use.
    let mut resident: HashMap<ExpertId, usize> = HashMap::new();
    let mut tally = Tally::default();
    for (t, id) in demands.iter().enumerate() {
        let hit = resident.contains_key(id);
        tally.count(*id, hit);
        if !hit && resident.len() == slots {
            let victim = *resident
                .iter()
                .max_by_key(|(_, &next)| next)
                .map(|(id, _)| id)
                .expect("full buffer");
            resident.remove(&victim);
        }
        resident.insert(*id, next_use[t]);
    }
    tally.result(Policy::Belady, slots)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::policy::{LayerMap, Seeds};
    use crate::ids::Stack;

    fn header() -> TraceHeader {
        TraceHeader {
            edgemoe_trace: 1,
            slots: 2,
            policy: Policy::Lru,
            prefetch: false,
            layers: LayerMap {
                encoder_moe_blocks: vec![0],
                decoder_moe_blocks: vec![0, 1, 2],
            },
            seeds: Seeds::default(),
        }
    }

    fn demand(layer: u16, expert: u16) -> TraceEvent {
        TraceEvent {
            token: 0,
            kind: AccessKind::Demand,
            stack: Stack::Decoder,
            layer,
            expert,
            current: Some(layer),
            pinned: vec![],
            waited_ms: None,
        }
    }

    fn trace(spec: &[(u16, u16)]) -> Vec<TraceEvent> {
        spec.iter().map(|&(l, e)| demand(l, e)).collect()
    }

    #[test]
    fn hand_made_traces_have_known_counts() {
        // A, B, C, A, B, C with 2 slots: LRU and FIFO always miss; Belady keeps A then B.
        let abc = trace(&[(0, 0), (0, 1), (0, 2), (0, 0), (0, 1), (0, 2)]);
        let h = header();
        let r = |p| replay(&h, &abc, p, 2, false);
        assert_eq!((r(Policy::Lru).hits, r(Policy::Lru).misses), (0, 6));
        assert_eq!((r(Policy::Fifo).hits, r(Policy::Fifo).misses), (0, 6));
        assert_eq!((r(Policy::Belady).hits, r(Policy::Belady).misses), (2, 4));
        // With 3 slots everything after the first round hits.
        assert_eq!(replay(&h, &abc, Policy::Lru, 3, false).hits, 3);

        // A A A B C A: LFU keeps the frequent A where LRU loses it to C's arrival order.
        let skew = trace(&[(0, 0), (0, 0), (0, 0), (0, 1), (0, 2), (0, 0)]);
        assert_eq!(replay(&h, &skew, Policy::Lfu, 2, false).hits, 3);
        assert_eq!(replay(&h, &skew, Policy::Lru, 2, false).hits, 2);
        // FIFO evicts A (inserted first) when C arrives.
        assert_eq!(replay(&h, &skew, Policy::Fifo, 2, false).hits, 2);
    }

    #[test]
    fn hits_and_misses_are_told_apart_by_stack() {
        // Encoder expert E, decoder experts A and B, then E and B again, with 2 slots. LRU: E,
        // A, B miss (B evicts E), E misses (evicting A), B hits. Belady evicts A (never used
        // again) for B: E's second access hits, and B's.
        let encoder = |expert| TraceEvent {
            stack: Stack::Encoder,
            current: None,
            ..demand(0, expert)
        };
        let events = vec![
            encoder(0),
            demand(0, 1),
            demand(0, 2),
            encoder(0),
            demand(0, 2),
        ];
        let h = header();
        let tally = |hits, misses| StackTally { hits, misses };
        let lru = replay(&h, &events, Policy::Lru, 2, false);
        assert_eq!((lru.encoder, lru.decoder), (tally(0, 2), tally(1, 2)));
        assert_eq!((lru.hits, lru.misses), (1, 4));
        let best = belady(&events, 2);
        assert_eq!((best.encoder, best.decoder), (tally(1, 1), tally(1, 2)));
        assert_eq!(best.encoder.hit_ratio(), Some(0.5));
        assert_eq!(StackTally::default().hit_ratio(), None);
    }

    #[test]
    fn documents_are_the_encoder_passes_that_follow_decoding() {
        let encoder = |layer, expert| TraceEvent {
            stack: Stack::Encoder,
            current: None,
            ..demand(layer, expert)
        };
        let prefetch = |layer, expert| TraceEvent {
            kind: AccessKind::Prefetch,
            ..encoder(layer, expert)
        };
        // Two encoder layers then decoding, three times; a prefetch of an encoder expert
        // during decoding starts no document.
        let mut events = Vec::new();
        for _ in 0..3 {
            events.extend([encoder(0, 0), encoder(0, 1), encoder(1, 0)]);
            events.extend([demand(0, 0), prefetch(0, 0), demand(1, 1), demand(0, 0)]);
        }
        assert_eq!(documents(&events), 3);
        // Without an encoder, prompts cannot be told apart from decoding.
        assert_eq!(documents(&[demand(0, 0), demand(1, 0)]), 0);
        assert_eq!(documents(&[]), 0);
    }

    #[test]
    fn edgemoe_keeps_the_next_layers_experts_where_lru_evicts_them() {
        // Three decoder MoE layers, two slots. Per token: layer 0 uses expert 0, layer 1 uses
        // expert 1 in every token, layer 2 alternates between experts 2 and 3. Before layer 1
        // runs again, LRU has evicted its expert; edgemoe keeps the layer that runs next.
        let mut events = Vec::new();
        for token in 0..20u16 {
            events.push(demand(0, 0));
            events.push(demand(1, 1));
            events.push(demand(2, 2 + token % 2));
        }
        let h = header();
        let lru = replay(&h, &events, Policy::Lru, 2, false);
        let edgemoe = replay(&h, &events, Policy::Edgemoe, 2, false);
        assert!(
            edgemoe.hits > lru.hits,
            "edgemoe {} hits vs lru {}",
            edgemoe.hits,
            lru.hits
        );
        assert_eq!(lru.hits, 0);
    }

    #[test]
    fn more_slots_than_experts_behave_as_all_experts_without_allocating_them() {
        let events = trace(&[(0, 0), (0, 1), (1, 2), (0, 0), (1, 2), (0, 1)]);
        assert_eq!(distinct_experts(&events), 3);
        let h = header();
        for policy in Policy::ONLINE.iter().copied().chain([Policy::Belady]) {
            let all = replay(&h, &events, policy, 3, false);
            for slots in [4, 1000, usize::MAX] {
                let r = replay(&h, &events, policy, slots, false);
                assert_eq!(
                    (r.hits, r.misses),
                    (all.hits, all.misses),
                    "{policy} {slots}"
                );
            }
        }
        assert_eq!(replay(&h, &[], Policy::Lru, usize::MAX, false).hits, 0);
    }

    #[test]
    fn belady_is_never_beaten_on_random_traces() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let h = header();
        for _ in 0..200 {
            let len = 20 + (next() % 200) as usize;
            let experts = 2 + next() % 10;
            let events: Vec<TraceEvent> = (0..len)
                .map(|_| {
                    // Skewed choice: low ids more often.
                    let e = (next() % experts).min(next() % experts) as u16;
                    demand((next() % 3) as u16, e)
                })
                .collect();
            for slots in [1, 2, 3, 5, 8] {
                let best = belady(&events, slots).hits;
                for policy in Policy::ONLINE {
                    let got = replay(&h, &events, policy, slots, true).hits;
                    assert!(
                        got <= best,
                        "{policy} {got} > belady {best} at {slots} slots"
                    );
                }
            }
        }
    }
}
