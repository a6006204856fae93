//! Eviction policies: which resident, evictable expert makes room for a new one.
//!
//! - `edgemoe`: evict the highest score `L(i, j) = −f(i, j) / d(i)` (EdgeMoE §4.3), with `d(i)`
//!   read as "MoE layers until layer i runs next": `d = ((i − I − 1) mod S) + 1 ∈ [1, S]`, where
//!   `I` is the decoder MoE layer now executing and `S` the number of decoder MoE layers. Experts
//!   of the layers about to run are kept; encoder experts get `f = 0` and go first.
//! - `edgemoe-paper`: the formula as printed, `d = (S − i + I) mod S`, which keeps the layers just
//!   executed (`d = 0`, the current layer, is never evicted while anything else can be).
//! - `lru`, `lfu`, `fifo`: the classic baselines.
//! - `belady` (replay only): evict the expert whose next use is farthest; see `replay`.
//!
//! `f` counts demand accesses of the expert during the run (hits and misses, across evictions),
//! seeded with the expert's offline activation frequency from the path dictionary scaled to
//! [`SEED_WEIGHT`] accesses. Ties go to the least recently used expert.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ids::ExpertId;
use crate::ids::Stack;

/// Offline frequencies weigh as much as this many observed demand accesses of a layer.
pub const SEED_WEIGHT: f64 = 100.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Policy {
    #[serde(rename = "edgemoe")]
    Edgemoe,
    #[serde(rename = "edgemoe-paper")]
    EdgemoePaper,
    #[serde(rename = "lru")]
    Lru,
    #[serde(rename = "lfu")]
    Lfu,
    #[serde(rename = "fifo")]
    Fifo,
    #[serde(rename = "belady")]
    Belady,
}

impl Policy {
    /// Policies a live run can use.
    pub const ONLINE: [Policy; 5] = [
        Policy::Edgemoe,
        Policy::EdgemoePaper,
        Policy::Lru,
        Policy::Lfu,
        Policy::Fifo,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Edgemoe => "edgemoe",
            Policy::EdgemoePaper => "edgemoe-paper",
            Policy::Lru => "lru",
            Policy::Lfu => "lfu",
            Policy::Fifo => "fifo",
            Policy::Belady => "belady",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "edgemoe" => Ok(Policy::Edgemoe),
            "edgemoe-paper" => Ok(Policy::EdgemoePaper),
            "lru" => Ok(Policy::Lru),
            "lfu" => Ok(Policy::Lfu),
            "fifo" => Ok(Policy::Fifo),
            "belady" => Ok(Policy::Belady),
            other => Err(format!(
                "unknown policy `{other}` (expected edgemoe, edgemoe-paper, lru, lfu, fifo or belady)"
            )),
        }
    }
}

/// Where each MoE block sits in execution order: its index among its stack's MoE layers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerMap {
    pub encoder_moe_blocks: Vec<usize>,
    pub decoder_moe_blocks: Vec<usize>,
}

impl LayerMap {
    pub fn blocks(&self, stack: Stack) -> &[usize] {
        match stack {
            Stack::Encoder => &self.encoder_moe_blocks,
            Stack::Decoder => &self.decoder_moe_blocks,
        }
    }

    /// Index of `block` among its stack's MoE layers.
    pub fn moe_index(&self, stack: Stack, block: usize) -> Option<usize> {
        self.blocks(stack).iter().position(|&b| b == block)
    }

    /// The MoE block after `block` in the same stack, if any.
    pub fn next_block(&self, stack: Stack, block: usize) -> Option<usize> {
        let i = self.moe_index(stack, block)?;
        self.blocks(stack).get(i + 1).copied()
    }

    pub fn decoder_layers(&self) -> usize {
        self.decoder_moe_blocks.len()
    }
}

/// What a policy knows about one resident expert.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub slot: usize,
    pub expert: ExpertId,
    pub inserted_at: u64,
    pub last_used: u64,
}

/// Online state of a policy: access counts (for `lfu` and the `edgemoe` scores).
#[derive(Debug, Clone)]
pub struct PolicyState {
    pub policy: Policy,
    layers: LayerMap,
    frequency: HashMap<ExpertId, f64>,
}

impl PolicyState {
    /// `seeds`: offline activation probability of each expert within its layer (may be empty).
    pub fn new(policy: Policy, layers: LayerMap, seeds: &[(ExpertId, f64)]) -> Self {
        let frequency = seeds.iter().map(|&(id, p)| (id, p * SEED_WEIGHT)).collect();
        PolicyState {
            policy,
            layers,
            frequency,
        }
    }

    pub fn record_demand(&mut self, id: ExpertId) {
        *self.frequency.entry(id).or_insert(0.0) += 1.0;
    }

    fn frequency(&self, id: ExpertId) -> f64 {
        self.frequency.get(&id).copied().unwrap_or(0.0)
    }

    /// `−f / d` (higher = evict first). `current` is the decoder MoE layer executing (`None`
    /// while the encoder runs: the decoder's first MoE layer is then the next to run).
    fn edgemoe_score(&self, id: ExpertId, current: Option<usize>, literal: bool) -> f64 {
        if id.stack == Stack::Encoder {
            return 0.0;
        }
        let s = self.layers.decoder_layers() as i64;
        let Some(i) = self.layers.moe_index(Stack::Decoder, id.layer as usize) else {
            return 0.0;
        };
        let i = i as i64;
        let cur = current.map(|c| c as i64).unwrap_or(s - 1);
        let f = self.frequency(id);
        let d = if literal {
            (s - i + cur).rem_euclid(s)
        } else {
            (i - cur - 1).rem_euclid(s) + 1
        };
        if d == 0 {
            return f64::NEG_INFINITY;
        }
        -f / d as f64
    }

    /// The slot to evict among `candidates` (non-empty, all evictable).
    pub fn choose_victim(&self, candidates: &[Candidate], current: Option<usize>) -> usize {
        let by = |key: &dyn Fn(&Candidate) -> (f64, u64)| {
            candidates
                .iter()
                .min_by(|a, b| {
                    let (ka, la) = key(a);
                    let (kb, lb) = key(b);
                    ka.total_cmp(&kb).then(la.cmp(&lb))
                })
                .map(|c| c.slot)
                .expect("at least one candidate")
        };
        match self.policy {
            Policy::Lru | Policy::Belady => by(&|c| (0.0, c.last_used)),
            Policy::Fifo => by(&|c| (c.inserted_at as f64, c.last_used)),
            Policy::Lfu => by(&|c| (self.frequency(c.expert), c.last_used)),
            // Evict the highest score: minimise its negation.
            Policy::Edgemoe => {
                by(&|c| (-self.edgemoe_score(c.expert, current, false), c.last_used))
            }
            Policy::EdgemoePaper => {
                by(&|c| (-self.edgemoe_score(c.expert, current, true), c.last_used))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dec(layer: u16, expert: u16) -> ExpertId {
        ExpertId {
            stack: Stack::Decoder,
            layer,
            expert,
        }
    }

    fn layers() -> LayerMap {
        LayerMap {
            encoder_moe_blocks: vec![0, 1, 2, 3],
            decoder_moe_blocks: vec![0, 1, 2, 3],
        }
    }

    #[test]
    fn distances_follow_the_two_readings() {
        let state = PolicyState::new(Policy::Edgemoe, layers(), &[(dec(0, 0), 0.01)]);
        // Executing layer 1: layer 2 runs next (d = 1), layer 1 runs again last (d = 4).
        let seeded = |layer| {
            let mut s = state.clone();
            s.frequency.insert(dec(layer, 0), 4.0);
            s
        };
        assert_eq!(seeded(2).edgemoe_score(dec(2, 0), Some(1), false), -4.0);
        assert_eq!(seeded(1).edgemoe_score(dec(1, 0), Some(1), false), -1.0);
        assert_eq!(
            seeded(0).edgemoe_score(dec(0, 0), Some(1), false),
            -4.0 / 3.0
        );
        // Literal: d = (S − i + I) mod S: the current layer is never evicted, the one just run
        // has d = 1.
        assert_eq!(
            seeded(1).edgemoe_score(dec(1, 0), Some(1), true),
            f64::NEG_INFINITY
        );
        assert_eq!(seeded(0).edgemoe_score(dec(0, 0), Some(1), true), -4.0);
        assert_eq!(
            seeded(2).edgemoe_score(dec(2, 0), Some(1), true),
            -4.0 / 3.0
        );
        let enc = ExpertId {
            stack: Stack::Encoder,
            layer: 0,
            expert: 0,
        };
        assert_eq!(state.edgemoe_score(enc, Some(1), false), 0.0);
    }

    #[test]
    fn policies_pick_their_victims() {
        let cands = [
            Candidate {
                slot: 0,
                expert: dec(2, 0),
                inserted_at: 1,
                last_used: 9,
            },
            Candidate {
                slot: 1,
                expert: dec(1, 1),
                inserted_at: 2,
                last_used: 3,
            },
            Candidate {
                slot: 2,
                expert: dec(3, 2),
                inserted_at: 3,
                last_used: 5,
            },
        ];
        let mut state = PolicyState::new(Policy::Lru, layers(), &[]);
        assert_eq!(state.choose_victim(&cands, Some(1)), 1);
        state.policy = Policy::Fifo;
        assert_eq!(state.choose_victim(&cands, Some(1)), 0);
        state.policy = Policy::Lfu;
        state.record_demand(dec(1, 1));
        state.record_demand(dec(2, 0));
        // dec(3,2) has the lowest count.
        assert_eq!(state.choose_victim(&cands, Some(1)), 2);
        // edgemoe at layer 1 with equal counts: layer 2 (d=1) is kept, layer 1 (d=4) goes.
        state.policy = Policy::Edgemoe;
        state.record_demand(dec(3, 2));
        assert_eq!(state.choose_victim(&cands, Some(1)), 1);
    }
}
