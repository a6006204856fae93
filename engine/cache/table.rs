//! Which expert sits in which slot, and the policy's view of them. Pure bookkeeping (no bytes):
//! the live [`ExpertBuffer`](crate::runtime::buffer::ExpertBuffer) applies every access to a table and
//! moves the bytes; trace replay applies the recorded accesses to a table of any size and policy.

use std::collections::HashMap;

use super::policy::{Candidate, PolicyState};
use crate::ids::{ExpertId, Stack};

/// The circumstances of one access.
#[derive(Debug, Clone, Copy)]
pub struct AccessContext<'a> {
    /// Decoder MoE layer executing (`None` while the encoder runs).
    pub current: Option<usize>,
    /// Decoder forward calls so far (the trace's `token`): with the layer, it tells one pass of
    /// a layer from the next.
    pub step: u64,
    /// Experts that must not be evicted now: the one being computed on, those being read.
    pub pinned: &'a [ExpertId],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evicted {
    pub expert: ExpertId,
    /// It was brought in by a prefetch and never used.
    pub prefetched_unused: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Hit {
        slot: usize,
        /// First use of an expert that a prefetch brought in.
        prefetched: bool,
    },
    Miss {
        slot: usize,
        evicted: Option<Evicted>,
    },
}

#[derive(Debug, Clone, Copy, Default)]
struct SlotMeta {
    holds: Option<ExpertId>,
    inserted_at: u64,
    last_used: u64,
    prefetched_unused: bool,
}

#[derive(Debug, Clone)]
pub struct SlotTable {
    slots: Vec<SlotMeta>,
    slot_of: HashMap<ExpertId, usize>,
    clock: u64,
    pub policy: PolicyState,
}

impl SlotTable {
    pub fn new(slots: usize, policy: PolicyState) -> Self {
        SlotTable {
            slots: vec![SlotMeta::default(); slots.max(1)],
            slot_of: HashMap::new(),
            clock: 0,
            policy,
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slot_of.is_empty()
    }

    pub fn slot_of(&self, id: ExpertId) -> Option<usize> {
        self.slot_of.get(&id).copied()
    }

    pub fn holds(&self, slot: usize) -> Option<ExpertId> {
        self.slots.get(slot).and_then(|s| s.holds)
    }

    /// Whether a slot is free or can be freed.
    fn has_room(&self, ctx: &AccessContext<'_>) -> bool {
        self.slots
            .iter()
            .any(|s| s.holds.is_none_or(|e| !ctx.pinned.contains(&e)))
    }

    /// The slot a load would take now, without taking it: a free slot (`None` beside it) or
    /// the policy's victim among the unpinned ones (with the expert it holds); `None` if every
    /// slot is pinned.
    pub fn peek_room(&self, ctx: &AccessContext<'_>) -> Option<(usize, Option<ExpertId>)> {
        if let Some(free) = self.slots.iter().position(|s| s.holds.is_none()) {
            return Some((free, None));
        }
        let candidates: Vec<Candidate> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(slot, s)| {
                let expert = s.holds?;
                (!ctx.pinned.contains(&expert)).then_some(Candidate {
                    slot,
                    expert,
                    inserted_at: s.inserted_at,
                    last_used: s.last_used,
                })
            })
            .collect();
        if candidates.is_empty() {
            return None;
        }
        let victim = self.policy.choose_victim(&candidates, ctx.current);
        Some((victim, self.slots[victim].holds))
    }

    /// A free slot, or the policy's victim among the unpinned ones (`None` if every slot is
    /// pinned).
    fn make_room(&mut self, ctx: &AccessContext<'_>) -> Option<(usize, Option<Evicted>)> {
        let (slot, victim) = self.peek_room(ctx)?;
        if victim.is_none() {
            return Some((slot, None));
        }
        let old = std::mem::take(&mut self.slots[slot]);
        let expert = old.holds.expect("the victim holds an expert");
        self.slot_of.remove(&expert);
        Some((
            slot,
            Some(Evicted {
                expert,
                prefetched_unused: old.prefetched_unused,
            }),
        ))
    }

    fn place(&mut self, slot: usize, id: ExpertId, prefetched: bool) {
        self.slots[slot] = SlotMeta {
            holds: Some(id),
            inserted_at: self.clock,
            last_used: self.clock,
            prefetched_unused: prefetched,
        };
        self.slot_of.insert(id, slot);
    }

    /// The model needs `id` now. `None` if it is not resident and every slot is pinned.
    pub fn demand(&mut self, id: ExpertId, ctx: &AccessContext<'_>) -> Option<Outcome> {
        self.clock += 1;
        if let Some(slot) = self.slot_of(id) {
            self.policy.record_demand(id, ctx.step);
            let meta = &mut self.slots[slot];
            meta.last_used = self.clock;
            let prefetched = std::mem::take(&mut meta.prefetched_unused);
            return Some(Outcome::Hit { slot, prefetched });
        }
        if !self.has_room(ctx) {
            return None;
        }
        // Counted before the victim is chosen: the policy then knows where the run is (the
        // demanded expert is not resident, so its own count changes no candidate's score).
        self.policy.record_demand(id, ctx.step);
        let (slot, evicted) = self.make_room(ctx)?;
        self.place(slot, id, false);
        Some(Outcome::Miss { slot, evicted })
    }

    /// Makes room for a speculative load of `id`. `None` if it is already resident or every
    /// slot is pinned.
    pub fn prefetch(
        &mut self,
        id: ExpertId,
        ctx: &AccessContext<'_>,
    ) -> Option<(usize, Option<Evicted>)> {
        if self.slot_of(id).is_some() {
            return None;
        }
        self.clock += 1;
        let (slot, evicted) = self.make_room(ctx)?;
        self.place(slot, id, true);
        Some((slot, evicted))
    }

    /// The experts of MoE block `layer` of `stack` that a prefetch brought in and no access has
    /// used, now that the block's router chose `chosen` without them, other than those `pinned`
    /// (still being read): loads whose prediction the router has just refuted.
    pub fn refuted_prefetches(
        &self,
        stack: Stack,
        layer: u16,
        chosen: &[u16],
        pinned: &[ExpertId],
    ) -> Vec<ExpertId> {
        // In slot order: deterministic, as the trace and replay need.
        self.slots
            .iter()
            .filter(|s| s.prefetched_unused)
            .filter_map(|s| s.holds)
            .filter(|id| id.stack == stack && id.layer == layer)
            .filter(|id| !chosen.contains(&id.expert) && !pinned.contains(id))
            .collect()
    }

    /// Forgets `id` (a prefetch that was cancelled, failed or refuted). Returns its slot.
    pub fn remove(&mut self, id: ExpertId) -> Option<usize> {
        let slot = self.slot_of.remove(&id)?;
        self.slots[slot] = SlotMeta::default();
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::policy::{LayerMap, Policy, Seeds};
    use crate::ids::Stack;

    fn dec(layer: u16, expert: u16) -> ExpertId {
        ExpertId {
            stack: Stack::Decoder,
            layer,
            expert,
        }
    }

    fn table(slots: usize, policy: Policy) -> SlotTable {
        let layers = LayerMap {
            encoder_moe_blocks: vec![],
            decoder_moe_blocks: vec![0, 1],
        };
        SlotTable::new(slots, PolicyState::new(policy, layers, &Seeds::default()))
    }

    const FREE: AccessContext<'static> = AccessContext {
        current: None,
        step: 0,
        pinned: &[],
    };

    #[test]
    fn hits_misses_and_pins() {
        let mut t = table(2, Policy::Lru);
        assert!(matches!(
            t.demand(dec(0, 0), &FREE),
            Some(Outcome::Miss { evicted: None, .. })
        ));
        assert!(matches!(
            t.demand(dec(0, 1), &FREE),
            Some(Outcome::Miss { evicted: None, .. })
        ));
        assert!(matches!(
            t.demand(dec(0, 0), &FREE),
            Some(Outcome::Hit {
                prefetched: false,
                ..
            })
        ));
        // LRU victim is expert 1, unless it is pinned.
        let pinned = [dec(0, 1)];
        let ctx = AccessContext {
            current: None,
            step: 0,
            pinned: &pinned,
        };
        match t.demand(dec(1, 0), &ctx) {
            Some(Outcome::Miss {
                evicted: Some(e), ..
            }) => assert_eq!(e.expert, dec(0, 0)),
            other => panic!("{other:?}"),
        }
        let pinned = [dec(0, 1), dec(1, 0)];
        let ctx = AccessContext {
            current: None,
            step: 0,
            pinned: &pinned,
        };
        assert_eq!(t.demand(dec(1, 1), &ctx), None);
    }

    #[test]
    fn prefetched_experts_are_reported_once() {
        let mut t = table(1, Policy::Lru);
        assert_eq!(t.prefetch(dec(0, 0), &FREE), Some((0, None)));
        assert_eq!(t.prefetch(dec(0, 0), &FREE), None);
        assert_eq!(
            t.demand(dec(0, 0), &FREE),
            Some(Outcome::Hit {
                slot: 0,
                prefetched: true
            })
        );
        assert_eq!(
            t.demand(dec(0, 0), &FREE),
            Some(Outcome::Hit {
                slot: 0,
                prefetched: false
            })
        );
        // Evicting an expert that was used is not a wasted prefetch.
        assert!(
            !t.prefetch(dec(1, 0), &FREE)
                .unwrap()
                .1
                .unwrap()
                .prefetched_unused
        );
        match t.prefetch(dec(1, 1), &FREE) {
            Some((0, Some(e))) => assert!(e.prefetched_unused),
            other => panic!("{other:?}"),
        }
        assert_eq!(t.remove(dec(1, 1)), Some(0));
        assert!(t.is_empty());
    }
}
