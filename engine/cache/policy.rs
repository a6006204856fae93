//! Eviction policies: which resident, evictable expert makes room for a new one.
//!
//! - `edgemoe` (default): evict the expert whose next use is expected farthest away, counted in
//!   MoE-layer passes. EdgeMoE's two terms — activation frequency and layer distance (§4.3) —
//!   with units: an expert of decoder MoE layer `i` comes back after `d(i) + S · (1 − a) / b`
//!   passes, where `d(i) = ((i − I − 1) mod S) + 1` is how many MoE layers run before layer `i`
//!   runs next (`I` the decoder MoE layer executing, `S` the number of decoder MoE layers), `a`
//!   the chance that the layer's next pass picks it and `b` the chance per pass after that (so
//!   `(1 − a) / b` rounds of `S` layers). `a` and `b` are counted per expert during the run, split
//!   by whether the layer's previous pass used it (`PolicyState::chances`): a decoder that
//!   repeats itself keeps its experts, one that moves on lets them go. Encoder experts come back
//!   with the next document's encoder pass: the passes left in this document (its decoder steps
//!   estimated from the documents so far), then whole documents for an expert that not every
//!   encoder pass uses. Chosen on held-out traces of two models (BENCHMARKS.md §12).
//! - `edgemoe-docs`: `edgemoe` for the fewest reads per document rather than per decoded
//!   token. Encoder experts start from the passes calibration counted (nearly every document
//!   uses them), and a decoder expert that the run's finished documents used is also expected
//!   at the step where they first used it on average, in this document or the next (the
//!   sooner of that and the per-pass reading): some experts are used once in every document,
//!   at its first step or the one that ends the summary, and the per-pass chances see them as
//!   rare. While a new document's encoder runs, a decoder expert that earlier documents used is
//!   expected by their reading alone: whether the last document's decoder repeated it says
//!   little of the next one's (BENCHMARKS.md §12.5). A predictor's chance for a speculative
//!   load is about the new document, and still counts. Closer to Belady where most accesses are
//!   the encoder's (short outputs), at the cost of more decoder misses per token (BENCHMARKS.md
//!   §12.4). Without an encoder it is `edgemoe`.
//! - `edgemoe-fd`: the score as EdgeMoE writes it, `L = −f / d(i)` with the same `d` (evict the
//!   highest), encoder experts at `f = 0` (evicted first). The default until issue 12: the raw
//!   count `f` grows without bound while `d ≤ S`, so at larger buffers it kept rarely used
//!   experts of the next layer over frequent ones and threw away encoder experts that the next
//!   document needs (BENCHMARKS.md §12).
//! - `edgemoe-paper`: `−f / d` with `d` as printed, `d = (S − i + I) mod S`, which keeps the
//!   layers just executed (`d = 0`, the current layer, is never evicted while anything else can
//!   be).
//! - `lru`, `lfu`, `fifo`: the classic baselines.
//! - `belady` (replay only): evict the expert whose next use is farthest; see `replay`.
//!
//! `f` counts demand accesses of the expert during the run (hits and misses, across evictions),
//! seeded with the expert's offline activation frequency from the path dictionary scaled to
//! [`SEED_WEIGHT`] passes of its layer (`n` starts at [`SEED_WEIGHT`] for every layer with
//! seeds). A pass is one forward call's demands of one MoE layer. The `edgemoe` chances of a
//! decoder expert start from what calibration counted of the passes themselves
//! ([`Seeds::passes`]: how many used the expert, how many used it right after a pass that did),
//! over the same [`SEED_WEIGHT`] passes; an encoder expert's, and any expert's without those
//! counts, from its token frequency as if passes were independent draws. Ties go to the least
//! recently used expert.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ids::ExpertId;
use crate::ids::Stack;

/// Offline frequencies weigh as much as this many observed passes of a layer.
pub const SEED_WEIGHT: f64 = 100.0;

/// What calibration measured of each expert, to seed a policy's counts ([`PolicyState::new`]).
/// A trace's header carries them (under these JSON names), so that replay starts where the
/// live run started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Seeds {
    /// Share of its layer's tokens that chose the expert (its activation frequency).
    #[serde(rename = "seeds")]
    pub frequency: Vec<(ExpertId, f64)>,
    /// `(expert, used, repeated)`: the shares of its layer's passes that used the expert, and
    /// that used it right after a pass that used it too. Empty for a dictionary without pass
    /// counts: passes are then taken as independent draws at the expert's frequency (as they
    /// are for encoder experts in any case, see [`PolicyState::new`]).
    #[serde(default, rename = "pass_seeds", skip_serializing_if = "Vec::is_empty")]
    pub passes: Vec<(ExpertId, f64, f64)>,
    /// Decoder steps per document in calibration (its decoder passes per encoder pass), so that
    /// the first document's encoder experts are not taken to be needed again after a step or two.
    /// `None` without pass counts, and for a model without an encoder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps_per_document: Option<f64>,
}

/// A share read from a seed: within [0, 1], and 0 for what is not a number.
fn share(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, 1.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Policy {
    #[serde(rename = "edgemoe")]
    Edgemoe,
    #[serde(rename = "edgemoe-docs")]
    EdgemoeDocs,
    #[serde(rename = "edgemoe-fd")]
    EdgemoeFd,
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
    pub const ONLINE: [Policy; 7] = [
        Policy::Edgemoe,
        Policy::EdgemoeDocs,
        Policy::EdgemoeFd,
        Policy::EdgemoePaper,
        Policy::Lru,
        Policy::Lfu,
        Policy::Fifo,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Policy::Edgemoe => "edgemoe",
            Policy::EdgemoeDocs => "edgemoe-docs",
            Policy::EdgemoeFd => "edgemoe-fd",
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
            "edgemoe-docs" => Ok(Policy::EdgemoeDocs),
            "edgemoe-fd" => Ok(Policy::EdgemoeFd),
            "edgemoe-paper" => Ok(Policy::EdgemoePaper),
            "lru" => Ok(Policy::Lru),
            "lfu" => Ok(Policy::Lfu),
            "fifo" => Ok(Policy::Fifo),
            "belady" => Ok(Policy::Belady),
            other => Err(format!(
                "unknown policy `{other}` (expected edgemoe, edgemoe-docs, edgemoe-fd, edgemoe-paper, lru, lfu, fifo or belady)"
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

    pub fn encoder_layers(&self) -> usize {
        self.encoder_moe_blocks.len()
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

/// The last demanded layer: `(step, stack, block)`, where `step` is the number of decoder
/// forward calls before it.
type Pass = (u64, Stack, u16);

/// Decoder steps per document, for the distance to the next encoder pass.
#[derive(Debug, Clone, Copy, Default)]
struct Documents {
    /// Documents whose decoding has ended (the next one's encoder has started).
    finished: u64,
    /// Decoder steps of the finished documents.
    finished_steps: u64,
    /// Decoder steps of the document being decoded.
    steps: u64,
    /// Decoder steps of calibration's documents on average ([`Seeds::steps_per_document`]),
    /// counted as one more finished document.
    prior: Option<f64>,
}

impl Documents {
    /// Expected decoder steps of the document being decoded: the mean of the finished ones
    /// (and of calibration's, as one document), and at least one more than it has taken so far.
    fn expected_steps(&self) -> f64 {
        let so_far = (self.steps + 1) as f64;
        let (documents, steps) = match self.prior {
            Some(prior) => (self.finished + 1, self.finished_steps as f64 + prior),
            None => (self.finished, self.finished_steps as f64),
        };
        if documents == 0 {
            return so_far;
        }
        (steps / documents as f64).max(so_far)
    }
}

/// How an expert's layer passes used it.
#[derive(Debug, Clone, Copy, Default)]
struct Uses {
    /// Passes of its layer that demanded it.
    passes: f64,
    /// Of those, passes right after a pass of the layer that demanded it too.
    repeats: f64,
    /// Index (count of its layer's passes) of the last pass that demanded it.
    last: Option<f64>,
}

/// How the run's documents used a decoder expert. Some are used once in nearly every
/// document at the same step — the first, or the one that ends the summary (BENCHMARKS.md
/// §12.4) — and come back with the next document as encoder experts do, while their share of
/// passes (one step in a document) reads to the per-pass chances as a rarely picked expert.
#[derive(Debug, Clone, Copy, Default)]
struct DocumentUses {
    /// Documents that used it, the one being decoded included.
    documents: f64,
    /// Over those documents, the sum of the step (from 0) of its first use.
    first_steps: f64,
    /// The last document that used it (counted by the documents finished before it).
    last: Option<u64>,
}

/// Online state of a policy: access counts and passes (for `lfu` and the `edgemoe` scores), and
/// where the run is.
#[derive(Debug, Clone)]
pub struct PolicyState {
    pub policy: Policy,
    layers: LayerMap,
    /// Demand accesses of each expert (seeded).
    frequency: HashMap<ExpertId, f64>,
    /// Passes of each MoE layer that used each expert (seeded).
    uses: HashMap<ExpertId, Uses>,
    /// Passes of each MoE layer, by `(stack, block)` (seeded).
    passes: HashMap<(Stack, u16), f64>,
    /// Documents of this run that used each decoder expert (`edgemoe-docs` only).
    document_uses: HashMap<ExpertId, DocumentUses>,
    last: Option<Pass>,
    /// Step of the last decoder demand.
    last_decoder_step: Option<u64>,
    documents: Documents,
}

impl PolicyState {
    /// `seeds`: what calibration measured of each expert (may be empty).
    pub fn new(policy: Policy, layers: LayerMap, seeds: &Seeds) -> Self {
        let frequency = seeds
            .frequency
            .iter()
            .map(|&(id, p)| (id, share(p) * SEED_WEIGHT))
            .collect();
        // A decoder expert's passes as calibration counted them, with no fewer repeats than
        // independent draws would give: a rarely chosen expert that calibration never saw twice
        // in a row is a small sample, and trusting its zero evicted the demo model's rare
        // experts too eagerly (BENCHMARKS.md §12.2). Encoder experts, and experts without
        // counts, are seeded as if the layer's passes were independent draws at the expert's
        // token frequency: seeded from their pass share (nearly every document uses every
        // encoder expert) the policy keeps them over the decoder's own experts, which on the
        // demo model moved the stalls from the encoder into decoding for the same bytes read.
        let measured: HashMap<ExpertId, (f64, f64)> = seeds
            .passes
            .iter()
            .filter(|(id, _, _)| id.stack == Stack::Decoder || policy == Policy::EdgemoeDocs)
            .map(|&(id, used, repeated)| {
                let used = share(used);
                (id, (used, share(repeated).max(used * used).min(used)))
            })
            .collect();
        let uses = seeds
            .frequency
            .iter()
            .map(|&(id, p)| {
                let p = share(p);
                let (used, repeated) = measured.get(&id).copied().unwrap_or((p, p * p));
                let uses = Uses {
                    passes: used * SEED_WEIGHT,
                    repeats: repeated * SEED_WEIGHT,
                    last: None,
                };
                (id, uses)
            })
            .collect();
        let passes = seeds
            .frequency
            .iter()
            .map(|&(id, _)| ((id.stack, id.layer), SEED_WEIGHT))
            .collect();
        PolicyState {
            policy,
            layers,
            frequency,
            uses,
            passes,
            document_uses: HashMap::new(),
            last: None,
            last_decoder_step: None,
            documents: Documents {
                // A positive number of steps that a count can reach.
                prior: seeds
                    .steps_per_document
                    .filter(|&n| n.is_finite() && n > 0.0)
                    .map(|n| n.min(1e12)),
                ..Documents::default()
            },
        }
    }

    /// Counts a demand of `id` during decoder step `step` (forward calls of the decoder so far).
    pub fn record_demand(&mut self, id: ExpertId, step: u64) {
        let pass = (step, id.stack, id.layer);
        if self.last != Some(pass) {
            *self.passes.entry((id.stack, id.layer)).or_insert(0.0) += 1.0;
            // An encoder pass after decoding starts the next document.
            if id.stack == Stack::Encoder && self.last.is_some_and(|l| l.1 == Stack::Decoder) {
                let docs = &mut self.documents;
                docs.finished += 1;
                docs.finished_steps += docs.steps;
                docs.steps = 0;
            }
        }
        if id.stack == Stack::Decoder && self.last_decoder_step != Some(step) {
            self.documents.steps += 1;
            self.last_decoder_step = Some(step);
        }
        self.last = Some(pass);
        // Only `edgemoe-docs` reads them: the other policies skip the map on every demand.
        if self.policy == Policy::EdgemoeDocs && id.stack == Stack::Decoder {
            let document = self.documents.finished;
            let step = self.documents.steps.saturating_sub(1) as f64;
            let uses = self.document_uses.entry(id).or_default();
            if uses.last != Some(document) {
                uses.documents += 1.0;
                uses.first_steps += step;
                uses.last = Some(document);
            }
        }
        *self.frequency.entry(id).or_insert(0.0) += 1.0;
        let n = self.layer_passes(id);
        let uses = self.uses.entry(id).or_default();
        if uses.last != Some(n) {
            if uses.last == Some(n - 1.0) {
                uses.repeats += 1.0;
            }
            uses.passes += 1.0;
            uses.last = Some(n);
        }
    }

    fn layer_passes(&self, id: ExpertId) -> f64 {
        self.passes
            .get(&(id.stack, id.layer))
            .copied()
            .unwrap_or(0.0)
    }

    fn frequency(&self, id: ExpertId) -> f64 {
        self.frequency.get(&id).copied().unwrap_or(0.0)
    }

    /// `(first, later)`: the chance that the next pass of its layer demands `id`, and the chance
    /// per pass after that. A first-order Markov estimate: whether a pass demands the expert
    /// depends on whether the layer's previous pass did (a decoder repeating itself keeps its
    /// experts; one moving on leaves them), each estimated from the run with one pseudo-pass at
    /// the expert's overall share. The later rate leans on the "not demanded last time" rate
    /// (weights ¾ and ¼, in the logarithm): after the first miss, the expert is one the layer
    /// has moved away from.
    fn chances(&self, id: ExpertId) -> (f64, f64) {
        let n = self.layer_passes(id);
        let Some(uses) = self.uses.get(&id).filter(|u| u.passes > 0.0 && n > 0.0) else {
            return (0.0, 0.0);
        };
        let share = (uses.passes / n).min(1.0);
        let recent = uses.last == Some(n);
        // Passes with a successor pass that followed a use, and that followed none.
        let after_use = uses.passes - if recent { 1.0 } else { 0.0 };
        let after_none = (n - 1.0 - after_use).max(0.0);
        let again = ((uses.repeats + share) / (after_use + 1.0)).min(1.0);
        let anew = ((uses.passes - uses.repeats + share) / (after_none + 1.0)).min(1.0);
        let first = if recent { again } else { anew };
        (first, first.powf(0.25) * anew.powf(0.75))
    }

    /// `edgemoe`: MoE-layer passes until `id` is expected to be demanded again (higher = evict
    /// first). `current` is the decoder MoE layer executing (`None` while the encoder runs).
    fn expected_reuse(&self, id: ExpertId, current: Option<usize>) -> f64 {
        let (first, later) = self.chances(id);
        self.expected_reuse_with(id, current, first, later, false)
    }

    /// `edgemoe` only (`None` for the other policies, which have no such measure): whether a
    /// speculative load of `predicted`, which a predictor gives `probability` of being demanded
    /// by its layer's next pass, is expected to be used before `victim`, the expert it would
    /// evict. The prediction's next use is counted as [`Self::expected_reuse`] counts any
    /// expert's, with the predictor's probability in place of the policy's own chance for the
    /// next pass; a speculative load therefore never evicts an expert the policy expects back
    /// sooner.
    pub fn speculation_outranks(
        &self,
        predicted: ExpertId,
        probability: f64,
        victim: ExpertId,
        current: Option<usize>,
    ) -> Option<bool> {
        if !matches!(self.policy, Policy::Edgemoe | Policy::EdgemoeDocs) {
            return None;
        }
        let first = probability.clamp(0.0, 1.0);
        // An expert the run has not seen yet: the prediction is all there is to go on.
        let later = match self.chances(predicted) {
            (_, later) if later > 0.0 => later,
            _ => first,
        };
        let prediction = self.expected_reuse_with(predicted, current, first, later, true);
        Some(prediction < self.expected_reuse(victim, current))
    }

    /// [`Self::expected_reuse`] with the chances `first` (next pass of the layer) and `later`
    /// (each pass after it) given. `predicted`: `first` is a predictor's for this very pass,
    /// not the policy's own reading of earlier passes, so it counts in a new document too.
    fn expected_reuse_with(
        &self,
        id: ExpertId,
        current: Option<usize>,
        first: f64,
        later: f64,
        predicted: bool,
    ) -> f64 {
        let Some(i) = self.layers.moe_index(id.stack, id.layer as usize) else {
            return f64::INFINITY;
        };
        if later <= 0.0 {
            return f64::INFINITY;
        }
        let (e, s) = (
            self.layers.encoder_layers() as f64,
            self.layers.decoder_layers() as f64,
        );
        // The encoder MoE layer executing, if the encoder runs.
        let encoding = match (current, self.last) {
            (None, Some((_, Stack::Encoder, block))) => {
                self.layers.moe_index(Stack::Encoder, block as usize)
            }
            _ => None,
        };
        let steps = self.documents.expected_steps();
        let i = i as f64;
        match id.stack {
            Stack::Decoder => {
                let until = match (current, encoding) {
                    (Some(cur), _) => ((i as i64 - cur as i64 - 1).rem_euclid(s as i64) + 1) as f64,
                    // The encoder's remaining layers, then the decoder's first ones.
                    (None, Some(now)) => (e - 1.0 - now as f64) + i + 1.0,
                    (None, None) => i + 1.0,
                };
                let by_passes = until + s * (1.0 - first) / later;
                match self.policy {
                    Policy::EdgemoeDocs => match self.reuse_by_documents(id, until, encoding) {
                        // A new document's encoder runs: its decoder has not started, and the
                        // per-pass chances, whose repeats are steps of one document, say
                        // nothing of whether it will use the expert. The documents do.
                        Some(by_documents) if encoding.is_some() && !predicted => by_documents,
                        Some(by_documents) => by_passes.min(by_documents),
                        None => by_passes,
                    },
                    _ => by_passes,
                }
            }
            Stack::Encoder => {
                let document = e + steps * s;
                let until = match encoding {
                    Some(now) if i > now as f64 => i - now as f64,
                    Some(now) => (e - now as f64) + steps * s + i,
                    None => {
                        let left = (steps - self.documents.steps as f64).max(0.0);
                        left * s + i + 1.0
                    }
                };
                until + document * (1.0 - first) / later
            }
        }
    }

    /// `edgemoe-docs`, a decoder expert that finished documents have used: MoE-layer passes
    /// until the step at which documents first used it on average — in this document if that
    /// step is still to come and it has not been used here yet, else in the next — plus whole
    /// documents for one that not every document uses. `until` is the passes until its layer's
    /// next pass. `None` before a document has finished, or for an expert no document has used.
    fn reuse_by_documents(&self, id: ExpertId, until: f64, encoding: Option<usize>) -> Option<f64> {
        let docs = &self.documents;
        let uses = self.document_uses.get(&id).filter(|_| docs.finished > 0)?;
        let (e, s) = (
            self.layers.encoder_layers() as f64,
            self.layers.decoder_layers() as f64,
        );
        let decoding = docs.steps > 0 && encoding.is_none();
        let seen = docs.finished as f64 + if decoding { 1.0 } else { 0.0 };
        let share = (uses.documents / seen).min(1.0);
        let usual_step = uses.first_steps / uses.documents;
        let steps = docs.expected_steps();
        let document = e + steps * s;
        // The step of this document being decoded (from 0); the first while the encoder runs.
        let step_now = if decoding {
            (docs.steps - 1) as f64
        } else {
            0.0
        };
        let used_here = uses.last == Some(docs.finished) && decoding;
        let to_its_step = if !used_here && usual_step >= step_now {
            (usual_step - step_now) * s
        } else {
            // The rest of this document, its next one's encoder, then its step there.
            (steps - step_now).max(1.0) * s - s + e + usual_step * s
        };
        Some(until + to_its_step + document * (1.0 - share) / share)
    }

    /// `edgemoe-fd` and `edgemoe-paper`: `−f / d` (higher = evict first). `current` is the
    /// decoder MoE layer executing (`None` while the encoder runs: the decoder's first MoE layer
    /// is then the next to run).
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
            // Evict the farthest expected reuse: minimise its negation.
            Policy::Edgemoe | Policy::EdgemoeDocs => {
                by(&|c| (-self.expected_reuse(c.expert, current), c.last_used))
            }
            // Evict the highest score: minimise its negation.
            Policy::EdgemoeFd => {
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

    /// Candidates in the given slots, inserted and last used at the same time (no tie-break).
    fn untouched(experts: &[(usize, ExpertId)]) -> Vec<Candidate> {
        experts
            .iter()
            .map(|&(slot, expert)| Candidate {
                slot,
                expert,
                inserted_at: 0,
                last_used: 0,
            })
            .collect()
    }

    fn layers() -> LayerMap {
        LayerMap {
            encoder_moe_blocks: vec![0, 1, 2, 3],
            decoder_moe_blocks: vec![0, 1, 2, 3],
        }
    }

    #[test]
    fn distances_follow_the_two_readings() {
        let state = PolicyState::new(
            Policy::Edgemoe,
            layers(),
            &Seeds {
                frequency: vec![(dec(0, 0), 0.01)],
                ..Seeds::default()
            },
        );
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
        let mut state = PolicyState::new(Policy::Lru, layers(), &Seeds::default());
        assert_eq!(state.choose_victim(&cands, Some(1)), 1);
        state.policy = Policy::Fifo;
        assert_eq!(state.choose_victim(&cands, Some(1)), 0);
        state.policy = Policy::Lfu;
        state.record_demand(dec(1, 1), 1);
        state.record_demand(dec(2, 0), 1);
        // dec(3,2) has the lowest count.
        assert_eq!(state.choose_victim(&cands, Some(1)), 2);
        // edgemoe-fd at layer 1 with equal counts: layer 2 (d=1) is kept, layer 1 (d=4) goes.
        state.policy = Policy::EdgemoeFd;
        state.record_demand(dec(3, 2), 1);
        assert_eq!(state.choose_victim(&cands, Some(1)), 1);
    }

    #[test]
    fn speculation_evicts_only_experts_expected_back_later_than_the_prediction() {
        let mut state = PolicyState::new(Policy::Edgemoe, layers(), &Seeds::default());
        // Layer 0 picks expert 0 at every step; layer 3 picks expert 5 at step 1, then 6.
        for step in 1..=8 {
            state.record_demand(dec(0, 0), step);
            state.record_demand(dec(3, if step == 1 { 5 } else { 6 }), step);
        }
        // Executing layer 0; a prediction for layer 1 (next to run).
        let predicted = dec(1, 7);
        let at = Some(0);
        // (0,0) is back in 4 passes for sure: a prediction due in 1 pass outranks it only when
        // its expected wait, 1 + 4·(1 − p)/p, is shorter.
        assert_eq!(
            state.speculation_outranks(predicted, 0.9, dec(0, 0), at),
            Some(true)
        );
        assert_eq!(
            state.speculation_outranks(predicted, 0.3, dec(0, 0), at),
            Some(false)
        );
        // (3,5) is rarely used: even a weak prediction outranks it.
        assert!(state.expected_reuse(dec(3, 5), at) > 20.0);
        assert_eq!(
            state.speculation_outranks(predicted, 0.3, dec(3, 5), at),
            Some(true)
        );
        // Other policies have no such measure.
        state.policy = Policy::Lru;
        assert_eq!(
            state.speculation_outranks(predicted, 0.9, dec(0, 0), at),
            None
        );
    }

    #[test]
    fn edgemoe_expects_reuse_from_repeats_shares_and_distance() {
        let mut state = PolicyState::new(Policy::Edgemoe, layers(), &Seeds::default());
        // Four decoder steps: layer 0 always picks expert 0; layer 1 picks expert 1 once, then
        // expert 2.
        for step in 1..=4 {
            state.record_demand(dec(0, 0), step);
            state.record_demand(dec(1, if step == 1 { 1 } else { 2 }), step);
        }
        // Layer 1 executing. Expert (0,0) was demanded by every pass: it is back when layer 0
        // comes round, d = 3.
        assert_eq!(state.expected_reuse(dec(0, 0), Some(1)), 3.0);
        // (1,1): one use, not in the last pass. After-use passes 1, after-none passes 2, share ¼:
        // anew = (1 − 0 + ¼) / 3 = 5/12, first = later = anew.
        let anew: f64 = 1.25 / 3.0;
        let want = 4.0 + 4.0 * (1.0 - anew) / anew;
        assert!((state.expected_reuse(dec(1, 1), Some(1)) - want).abs() < 1e-9);
        // (1,2): used in passes 2–4, recent. after_use = 2, repeats 2, share ¾:
        // again = (2 + ¾) / 3, anew = (3 − 2 + ¾) / (max(4 − 1 − 2, 0) + 1) = 1.75 / 2.
        let again: f64 = 2.75 / 3.0;
        let anew: f64 = 1.75 / 2.0;
        let later = again.powf(0.25) * anew.powf(0.75);
        let want = 4.0 + 4.0 * (1.0 - again) / later;
        assert!((state.expected_reuse(dec(1, 2), Some(1)) - want).abs() < 1e-9);
        // Never demanded: evicted first.
        assert_eq!(state.expected_reuse(dec(2, 0), Some(1)), f64::INFINITY);
        let cands = untouched(&[(0, dec(0, 0)), (1, dec(1, 1)), (2, dec(1, 2))]);
        assert_eq!(state.choose_victim(&cands, Some(1)), 1);
    }

    /// The case of a document that routes unlike calibration (BENCHMARKS.md §12): layer 1's
    /// expert 7 took 5% of calibration's passes, and the first step of a document picks it.
    /// Whether it is kept depends on what calibration says of its passes: if a pass that used it
    /// was almost always followed by one that used it too (measured), it is likely back at the
    /// layer's next pass and kept over layer 0's expert 1 (10% of passes, independent, not used
    /// now); taken as independent draws at 5%, it is expected back later than that one and
    /// evicted.
    #[test]
    fn edgemoe_seeds_its_chances_from_the_passes_calibration_counted() {
        let (unusual, other) = (dec(1, 7), dec(0, 1));
        let frequency = vec![
            (dec(0, 0), 0.9),
            (other, 0.1),
            (dec(1, 3), 0.9),
            (unusual, 0.05),
        ];
        let independent = Seeds {
            frequency: frequency.clone(),
            ..Seeds::default()
        };
        let measured = Seeds {
            frequency,
            passes: vec![(other, 0.1, 0.01), (unusual, 0.05, 0.049)],
            ..Seeds::default()
        };
        let cands = untouched(&[(0, other), (1, unusual)]);
        let mut seen = Vec::new();
        for seeds in [&independent, &measured] {
            let mut state = PolicyState::new(Policy::Edgemoe, layers(), seeds);
            state.record_demand(dec(0, 0), 1);
            state.record_demand(unusual, 1);
            // Layer 2 executing.
            let (first, _) = state.chances(unusual);
            seen.push((state.choose_victim(&cands, Some(2)), first));
        }
        let (independent, measured) = (seen[0], seen[1]);
        assert_eq!(
            independent.0, 1,
            "independent draws evict expert 7: {independent:?}"
        );
        assert!(independent.1 < 0.1, "{independent:?}");
        assert_eq!(measured.0, 0, "measured passes keep expert 7: {measured:?}");
        assert!(measured.1 > 0.8, "{measured:?}");
        // Zero repeats in calibration count as independent draws (used²); an encoder expert's
        // pass counts are not used (its token frequency seeds it).
        let enc = ExpertId {
            stack: Stack::Encoder,
            layer: 0,
            expert: 0,
        };
        let state = PolicyState::new(
            Policy::Edgemoe,
            layers(),
            &Seeds {
                frequency: vec![(other, 0.1), (enc, 0.1)],
                passes: vec![(other, 0.1, 0.0), (enc, 1.0, 1.0)],
                ..Seeds::default()
            },
        );
        assert!((state.uses[&other].repeats - 0.01 * SEED_WEIGHT).abs() < 1e-9);
        assert!((state.uses[&enc].passes - 0.1 * SEED_WEIGHT).abs() < 1e-9);
        assert!((state.uses[&enc].repeats - 0.01 * SEED_WEIGHT).abs() < 1e-9);
        // Shares that are not numbers, or out of range, are read as shares within [0, 1].
        let odd = Seeds {
            frequency: vec![(other, f64::NAN), (unusual, 2.0)],
            passes: vec![(other, f64::NAN, 0.5), (unusual, 3.0, f64::INFINITY)],
            steps_per_document: Some(f64::NAN),
        };
        let state = PolicyState::new(Policy::Edgemoe, layers(), &odd);
        for id in [other, unusual] {
            let (first, later) = state.chances(id);
            assert!((0.0..=1.0).contains(&first) && (0.0..=1.0).contains(&later));
        }
    }

    #[test]
    fn edgemoe_keeps_encoder_experts_the_next_document_needs() {
        let enc = |layer, expert| ExpertId {
            stack: Stack::Encoder,
            layer,
            expert,
        };
        let mut state = PolicyState::new(Policy::Edgemoe, layers(), &Seeds::default());
        // Three documents of 5 decoder steps; every encoder pass picks expert 0 of each layer,
        // the decoder's layer 3 picks a different expert at every step.
        let mut step = 0;
        for _ in 0..3 {
            for layer in 0..4 {
                state.record_demand(enc(layer, 0), step);
            }
            for t in 0..5u16 {
                step += 1;
                for layer in 0..3 {
                    state.record_demand(dec(layer, 0), step);
                }
                state.record_demand(dec(3, t), step);
            }
        }
        // Near the end of the third document (step 5 of 5 expected), the encoder's experts
        // come back within a few passes; a decoder expert used once in 15 passes does not.
        let encoder = state.expected_reuse(enc(0, 0), Some(3));
        let rare = state.expected_reuse(dec(3, 1), Some(3));
        assert!(encoder < rare, "encoder {encoder} vs rare decoder {rare}");
        // 5 steps done, as many as the documents so far took: one more step is expected (its 4
        // decoder MoE layers), then the encoder's first MoE layer.
        assert_eq!(encoder, 5.0);
    }

    /// In the first document there are no finished ones to average: without a prior the next
    /// encoder pass is expected one step away, so encoder experts outrank the decoder's own
    /// (the first document's decoder then thrashes); calibration's 41 steps per document say
    /// otherwise, and count as one finished document once documents finish.
    #[test]
    fn edgemoe_expects_documents_as_long_as_calibrations() {
        let enc = |layer, expert| ExpertId {
            stack: Stack::Encoder,
            layer,
            expert,
        };
        let run = |prior: Option<f64>, documents: u64| {
            let mut state = PolicyState::new(
                Policy::Edgemoe,
                layers(),
                &Seeds {
                    // Decoder layer 1's expert 0 is rare in calibration, and persistent.
                    frequency: vec![(dec(1, 0), 0.05)],
                    passes: vec![(dec(1, 0), 0.05, 0.049)],
                    steps_per_document: prior,
                },
            );
            let mut step = 0;
            for _ in 0..documents {
                for layer in 0..4 {
                    state.record_demand(enc(layer, 0), step);
                }
                for _ in 0..1 + u16::from(step > 0) * 8 {
                    step += 1;
                    for layer in 0..4 {
                        state.record_demand(dec(layer, 0), step);
                    }
                }
            }
            state
        };
        // First document, one step done, layer 3 executing.
        let (without, with) = (run(None, 1), run(Some(41.0), 1));
        // Without: one more step (4 layers), then the encoder's first MoE layer.
        assert_eq!(without.expected_reuse(enc(0, 0), Some(3)), 4.0 + 1.0);
        // With: 41 − 1 steps of 4 layers, then the encoder's first MoE layer.
        assert_eq!(with.expected_reuse(enc(0, 0), Some(3)), 40.0 * 4.0 + 1.0);
        // Back in a few rounds: later than the encoder without the prior, sooner with it.
        let decoder = with.expected_reuse(dec(1, 0), Some(3));
        assert!(5.0 < decoder && decoder < 40.0 * 4.0, "{decoder}");
        let cands = untouched(&[(0, enc(0, 0)), (1, dec(1, 0))]);
        assert_eq!(without.choose_victim(&cands, Some(3)), 1);
        assert_eq!(with.choose_victim(&cands, Some(3)), 0);
        // In the second document (9 steps so far) after a first of 1 step: (1 + 41) / 2 = 21.
        let second = run(Some(41.0), 2);
        assert_eq!(second.documents.expected_steps(), 21.0);
    }

    /// A decoder expert that every document uses once, at its first step: `edgemoe-docs` expects
    /// it at the next document's first step; `edgemoe`'s per-pass chances see it as rare.
    #[test]
    fn edgemoe_docs_expects_a_once_per_document_expert_at_its_step() {
        let enc = |layer, expert| ExpertId {
            stack: Stack::Encoder,
            layer,
            expert,
        };
        let mut step = 0;
        let mut run = |state: &mut PolicyState, documents: usize, steps_of_last: usize| {
            for document in 0..documents {
                for layer in 0..4 {
                    state.record_demand(enc(layer, 0), step);
                }
                let steps = if document + 1 == documents {
                    steps_of_last
                } else {
                    10
                };
                for at in 0..steps {
                    step += 1;
                    for layer in 0..4 {
                        state.record_demand(dec(layer, 0), step);
                    }
                    if at == 0 {
                        state.record_demand(dec(3, 1), step);
                    }
                    if at % 2 == 1 {
                        state.record_demand(dec(1, 2), step);
                    }
                }
            }
        };
        let states = [Policy::Edgemoe, Policy::EdgemoeDocs].map(|policy| {
            let mut state = PolicyState::new(policy, layers(), &Seeds::default());
            run(&mut state, 4, 6);
            state
        });
        let [edgemoe, docs] = &states;
        // Step 6 of the fourth document (from 0: 5), layer 3 executing: expert 1 was used at
        // this document's first step. Next: the rest of this document (10 − 5 steps, this
        // one's included, less this step's layer 3), the encoder (4 layers), then its layer 3
        // at the first step: 16 + 4 + 4 passes.
        assert_eq!(docs.expected_reuse(dec(3, 1), Some(3)), 24.0);
        let by_passes = edgemoe.expected_reuse(dec(3, 1), Some(3));
        assert!(by_passes > 30.0, "{by_passes}");
        // The minimum of the two readings: never later than the per-pass one.
        assert!(docs.expected_reuse(dec(3, 0), Some(3)) <= 4.0);
        // The encoder's experts come back before it, in both.
        for state in &states {
            assert!(state.expected_reuse(enc(3, 0), Some(3)) < 24.0);
        }
        // While the next document's encoder runs (its last layer), it is 4 passes away, and
        // edgemoe-docs keeps it over an expert that every other step uses (due at the second
        // step, 6 passes away), which edgemoe keeps instead.
        let [mut edgemoe, mut docs] = states;
        for state in [&mut edgemoe, &mut docs] {
            for layer in 0..4 {
                state.record_demand(enc(layer, 0), 1_000);
            }
        }
        assert_eq!(docs.expected_reuse(dec(3, 1), None), 4.0);
        let candidates = untouched(&[(0, dec(3, 1)), (1, dec(1, 2))]);
        assert_eq!(edgemoe.choose_victim(&candidates, None), 0);
        assert_eq!(docs.choose_victim(&candidates, None), 1);
    }

    #[test]
    fn edgemoe_docs_reads_a_new_documents_decoder_by_the_documents() {
        let enc = |layer, expert| ExpertId {
            stack: Stack::Encoder,
            layer,
            expert,
        };
        // Four documents of 10 steps; the last one's decoder also picks expert 3 of layer 2 at
        // every step, the others never do. Then the fifth document's encoder runs.
        let mut states = [Policy::Edgemoe, Policy::EdgemoeDocs]
            .map(|policy| PolicyState::new(policy, layers(), &Seeds::default()));
        for state in &mut states {
            let mut step = 0;
            for document in 0..5 {
                for layer in 0..4 {
                    state.record_demand(enc(layer, 0), step);
                }
                if document == 4 {
                    break;
                }
                for _ in 0..10 {
                    step += 1;
                    for layer in 0..4 {
                        state.record_demand(dec(layer, 0), step);
                        if layer == 2 && document == 3 {
                            state.record_demand(dec(2, 3), step);
                        }
                    }
                }
            }
        }
        let [edgemoe, docs] = &states;
        // Its layer's next pass is 3 away (the decoder's layers 0, 1, 2). The per-pass reading
        // expects it then or soon after: the last 9 passes after a use used it again.
        let by_passes = edgemoe.expected_reuse(dec(2, 3), None);
        assert!(by_passes < 10.0, "{by_passes}");
        // By the documents, one in four uses it: 3 passes, then three documents of 4 + 10 × 4
        // passes on average before one does.
        assert_eq!(docs.expected_reuse(dec(2, 3), None), 135.0);
        // Against the encoder's expert of its last layer, just used and due in the next
        // document (1 + 40 + 3 passes), edgemoe keeps the decoder's expert, edgemoe-docs the
        // encoder's.
        let candidates = untouched(&[(0, dec(2, 3)), (1, enc(3, 0))]);
        assert_eq!(edgemoe.choose_victim(&candidates, None), 1);
        assert_eq!(docs.choose_victim(&candidates, None), 0);
        // A predictor's chance for its layer's next pass still counts: a prediction of it at
        // 0.9 is worth the encoder expert's slot (the policy's own chain is not used for it).
        assert_eq!(
            docs.speculation_outranks(dec(2, 3), 0.9, enc(3, 0), None),
            Some(true)
        );
        assert_eq!(
            docs.speculation_outranks(dec(2, 3), 0.01, enc(3, 0), None),
            Some(false)
        );
        // Once that document decodes, the per-pass reading counts again (the sooner of the two).
        let [_, mut docs] = states;
        docs.record_demand(dec(0, 0), 100);
        assert!(docs.expected_reuse(dec(2, 3), Some(0)) < 10.0);
    }
}
