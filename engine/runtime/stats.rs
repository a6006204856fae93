//! The counters every expert provider keeps: accesses, hits, bytes read, stalls, prefetch and
//! dictionary accuracy, overall and per MoE layer.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{ExpertId, Stack};

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LayerStats {
    pub stack: String,
    pub block: u16,
    pub accesses: u64,
    pub hits: u64,
    pub hit_ratio: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PrefetchStats {
    /// Reads started ahead of need (next expert and speculative).
    pub issued: u64,
    /// Prefetched experts that a later demand used.
    pub useful: u64,
    /// Requests dropped before their read started.
    pub cancelled: u64,
    /// Reads that failed (a checksum mismatch, an I/O error): each ends the run with its error,
    /// as a failed demand read does.
    #[serde(default)]
    pub failed: u64,
    /// Bytes those reads moved.
    pub bytes_read: u64,
    /// Bytes of prefetched experts evicted or dropped without being used.
    pub wasted_bytes: u64,
    /// Speculation per MoE layer (what it saved and cost, whether it is on).
    #[serde(default)]
    pub per_layer: Vec<LayerSpeculation>,
}

/// Per-layer figures in `--stats-json` (`prefetch.per_layer`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LayerSpeculation {
    pub stack: String,
    pub block: u16,
    /// Speculative reads started for this layer.
    pub issued: u64,
    /// Of those, experts the router chose.
    pub useful: u64,
    /// Of those, experts it did not choose.
    pub wasted: u64,
    /// Predictions not read: the layer was stopped, the device had no headroom, or no slot
    /// held an expert worth less than the prediction.
    pub skipped: u64,
    /// Stall avoided, estimated (see the module header).
    pub saved_ms: f64,
    /// Device time of unused reads over the queue depth, plus reads of experts they evicted.
    pub cost_ms: f64,
    /// Evicted experts missed soon after (counted in `cost_ms`).
    pub costly_evictions: u64,
    /// Times speculation on this layer was stopped or resumed.
    pub switches: u64,
    /// Whether the layer speculates at the end of the run.
    pub enabled: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
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
    /// Time demand-miss reads took (on the compute thread, or on the I/O scheduler while the
    /// compute thread waited).
    pub read_ms: f64,
    /// Time the compute thread waited for expert bytes: its own reads plus waits for reads in
    /// flight on the I/O scheduler (demand misses included).
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

    pub(crate) fn record(&mut self, id: ExpertId, hit: bool) {
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
