//! The counters every expert provider keeps: accesses, hits, bytes read, stalls, prefetch and
//! dictionary accuracy, overall and per MoE layer; precision and recall of each predictor.

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
    /// Loads that arrived and that their layer's router then did not choose: dropped, their
    /// slots freed.
    #[serde(default)]
    pub refuted: u64,
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
    /// Device time of unused reads times their share of the device, demand reads' waits behind
    /// this layer's reads, and a read for each expert they evicted that was missed soon after.
    pub cost_ms: f64,
    /// Evicted experts missed soon after (counted in `cost_ms`).
    pub costly_evictions: u64,
    /// Times speculation on this layer was stopped or resumed.
    pub switches: u64,
    /// Whether the layer speculates at the end of the run.
    pub enabled: bool,
}

/// What the stand-ins did (`--stand-in`; `stand_in` in `--stats-json`, null when off).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct StandInStats {
    /// Their width: `int2` or `int4`.
    pub bits: String,
    /// Experts that have one (every decoder expert).
    pub experts: usize,
    /// Memory they hold (counted in the budget as resident).
    pub bytes: u64,
    /// Bytes read from the store to make them when the buffer opened, and the time it took.
    pub load_bytes: u64,
    pub load_ms: f64,
    /// Demand accesses computed by a stand-in because the full expert was not ready in the
    /// buffer (each is also counted as the hit or miss the slot table saw).
    pub used: u64,
    /// Of those, the misses whose full expert was then read for later steps.
    pub reads_started: u64,
    /// Of those, accesses for which no slot could take the full expert (every slot was being
    /// read or computed on): neither read nor counted as an access.
    pub unbuffered: u64,
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
    /// With stand-ins on.
    pub stand_in: Option<StandInStats>,
    /// Every predictor's predictions, scored against the routing that followed.
    #[serde(skip)]
    pub predictions: PredictionScores,
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

/// Which predictions start speculative reads (`--predictor`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum PredictorKind {
    /// The activation-path dictionary (`paths.bin`): the path so far, or a layer's
    /// frequencies across a forward call's boundary.
    #[default]
    Dictionary,
    /// The gate lookahead: the next MoE block's router applied to the hidden state entering
    /// the current block's FFN. Predicts within a forward call only.
    Gate,
    /// Both: experts both name first, then the gate's, then the dictionary's.
    Both,
}

impl PredictorKind {
    pub const ALL: [PredictorKind; 3] = [
        PredictorKind::Dictionary,
        PredictorKind::Gate,
        PredictorKind::Both,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PredictorKind::Dictionary => "dictionary",
            PredictorKind::Gate => "gate",
            PredictorKind::Both => "both",
        }
    }
}

impl std::str::FromStr for PredictorKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        PredictorKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown predictor `{s}` (expected dictionary, gate or both)"))
    }
}

/// Precision and recall of one predictor at one MoE layer, over the forward calls that reached
/// it: each call's predicted set against the set of experts the router chose (all tokens).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct PredictorLayerStats {
    pub predictor: PredictorKind,
    pub stack: String,
    pub block: u16,
    /// Forward calls whose experts for this layer were predicted.
    pub calls: u64,
    /// Experts predicted, summed over the calls.
    pub predicted: u64,
    /// Distinct experts the router chose, summed over the calls.
    pub chosen: u64,
    /// Predicted experts the router chose.
    pub correct: u64,
    /// `correct / predicted` (0 when nothing was predicted).
    pub precision: f64,
    /// `correct / chosen`.
    pub recall: f64,
}

/// Scores every predictor's predictions against the routing that follows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PredictionScores {
    /// Predictions waiting for their layer to route: (predictor, stack, block) → experts.
    pending: BTreeMap<(PredictorKind, Stack, u16), Vec<u16>>,
    /// (predictor, stack, block) → (calls, predicted, chosen, correct).
    totals: BTreeMap<(PredictorKind, Stack, u16), [u64; 4]>,
}

impl PredictionScores {
    /// `predictor` predicts `experts` for block `block` of `stack` (replacing an earlier
    /// prediction for that layer not scored yet).
    pub fn expect(
        &mut self,
        predictor: PredictorKind,
        stack: Stack,
        block: usize,
        experts: &[ExpertId],
    ) {
        self.pending.insert(
            (predictor, stack, block as u16),
            experts.iter().map(|id| id.expert).collect(),
        );
    }

    /// Block `block` of `stack` routed to `chosen` (`k` per token): scores what was predicted
    /// for it.
    pub fn score(&mut self, stack: Stack, block: usize, chosen: &[u16]) {
        let mut actual: Vec<u16> = chosen.to_vec();
        actual.sort_unstable();
        actual.dedup();
        for predictor in PredictorKind::ALL {
            let key = (predictor, stack, block as u16);
            let Some(predicted) = self.pending.remove(&key) else {
                continue;
            };
            let correct = predicted.iter().filter(|e| actual.contains(e)).count() as u64;
            let total = self.totals.entry(key).or_default();
            total[0] += 1;
            total[1] += predicted.len() as u64;
            total[2] += actual.len() as u64;
            total[3] += correct;
        }
    }

    /// Per predictor, per MoE layer (encoder first), in [`PredictorKind::ALL`] order.
    pub fn report(&self) -> Vec<PredictorLayerStats> {
        self.totals
            .iter()
            .map(
                |(&(predictor, stack, block), &[calls, predicted, chosen, correct])| {
                    PredictorLayerStats {
                        predictor,
                        stack: stack.hf_prefix().into(),
                        block,
                        calls,
                        predicted,
                        chosen,
                        correct,
                        precision: ratio(correct, predicted),
                        recall: ratio(correct, chosen),
                    }
                },
            )
            .collect()
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(experts: &[u16]) -> Vec<ExpertId> {
        experts
            .iter()
            .map(|&expert| ExpertId {
                stack: Stack::Decoder,
                layer: 2,
                expert,
            })
            .collect()
    }

    #[test]
    fn predictions_are_scored_by_hand() {
        let mut scores = PredictionScores::default();
        // Call 1: {1, 2} predicted; tokens chose 2, 2, 3 → {2, 3}: 1 of 2 right, 1 of 2 found.
        scores.expect(PredictorKind::Gate, Stack::Decoder, 2, &ids(&[1, 2]));
        scores.expect(
            PredictorKind::Dictionary,
            Stack::Decoder,
            2,
            &ids(&[2, 3, 4, 5]),
        );
        scores.score(Stack::Decoder, 2, &[2, 2, 3]);
        // A layer nobody predicted scores nothing; a prediction is used once.
        scores.score(Stack::Decoder, 3, &[0]);
        scores.score(Stack::Decoder, 2, &[7]);
        // Call 2: the gate alone, {7} predicted, 7 chosen.
        scores.expect(PredictorKind::Gate, Stack::Decoder, 2, &ids(&[7]));
        scores.score(Stack::Decoder, 2, &[7]);
        let report = scores.report();
        assert_eq!(report.len(), 2, "{report:?}");
        let dictionary = &report[0];
        assert_eq!(dictionary.predictor, PredictorKind::Dictionary);
        assert_eq!(
            (
                dictionary.calls,
                dictionary.predicted,
                dictionary.chosen,
                dictionary.correct
            ),
            (1, 4, 2, 2)
        );
        assert_eq!((dictionary.precision, dictionary.recall), (0.5, 1.0));
        let gate = &report[1];
        assert_eq!((gate.stack.as_str(), gate.block), ("decoder", 2));
        assert_eq!(
            (gate.calls, gate.predicted, gate.chosen, gate.correct),
            (2, 3, 3, 2)
        );
        assert!((gate.precision - 2.0 / 3.0).abs() < 1e-12);
        assert!((gate.recall - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn predictor_names_parse_back() {
        for kind in PredictorKind::ALL {
            assert_eq!(kind.name().parse::<PredictorKind>(), Ok(kind));
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
        }
        assert!("oracle".parse::<PredictorKind>().is_err());
    }
}
