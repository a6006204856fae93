//! The activation-path dictionary (ARCHITECTURE.md §7): for every token of a calibration corpus,
//! its path = the experts chosen at each MoE layer of a stack. With top-k routing a layer's
//! experts are a *set* of k (the order of the router's weights does not matter for the keys).
//! The dictionary maps (layer n, set at n−2, set at n−1) to, for each expert of layer n, the
//! probability that it is among the token's experts there, with fallbacks (n, set at n−1) →
//! layer n's marginal when a key was never seen. With top-1 routing sets are single experts and
//! probabilities sum to 1. Encoder and decoder are kept apart. Beside the tokens' paths it counts
//! the stack's forward calls ([`PassCounts`]): how often a call used each expert and how often
//! the call after it used it again, which seed the eviction policy. Stored in the bundle as
//! `paths.bin`: magic, version, bincode.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::Stack;

pub const PATHS_MAGIC: &[u8; 8] = b"EMOPATHS";
/// Version 3: version 2's body (keys over expert sets, top-k), then each stack's
/// [`PassCounts`].
pub const PATHS_VERSION: u32 = 3;
/// Still read: a dictionary without [`PassCounts`] (the policy then takes a layer's passes as
/// independent draws at the experts' token frequencies).
const PATHS_VERSION_WITHOUT_PASSES: u32 = 2;
pub const PATHS_FILE: &str = "paths.bin";

/// Counts of one stack's paths.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StackPaths {
    pub num_layers: usize,
    pub num_experts: usize,
    /// Experts per token at each layer.
    pub top_k: usize,
    /// `[layer][expert]` activations (tokens whose set holds the expert).
    pub marginal: Vec<Vec<u64>>,
    /// (layer, set at layer−1) → counts over the layer's experts.
    pub given_previous: HashMap<(u16, Vec<u16>), Vec<u64>>,
    /// (layer, set at layer−2, set at layer−1) → counts over the layer's experts.
    pub given_two: HashMap<(u16, Vec<u16>, Vec<u16>), Vec<u64>>,
    /// Whole paths (each layer's set sorted) and how many tokens took each.
    pub paths: HashMap<Vec<u16>, u64>,
    /// The stack's forward calls (written after both stacks' paths: see
    /// [`PathDictionary::to_bytes`]); empty in a version-2 dictionary.
    #[serde(skip)]
    pub passes: PassCounts,
}

/// How a stack's forward calls — its *passes*: the encoder's pass over a document, a prompt's
/// prefill, one decoder step (all its beams) — used each expert, over one run's consecutive
/// passes. An eviction policy counts the same things online (`cache::policy`); these seed it.
/// Token frequencies cannot: an encoder expert that 5% of tokens choose is used by nearly every
/// pass over a few hundred tokens, and whether a decoder step chooses again what the step before
/// chose (a model that repeats itself, or one that moves on) is no property of single tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PassCounts {
    /// Passes counted.
    pub passes: u64,
    /// `[layer][expert]`: passes in which some token chose the expert at the layer.
    pub uses: Vec<Vec<u64>>,
    /// `[layer][expert]`: of those, passes right after a pass that used it too.
    pub repeats: Vec<Vec<u64>>,
}

impl PassCounts {
    /// Share of the experts a pass used that the pass before it had used too, over all layers
    /// (0 without passes).
    pub fn repeat_share(&self) -> f64 {
        let sum = |rows: &[Vec<u64>]| rows.iter().flatten().map(|&c| c as f64).sum::<f64>();
        let uses = sum(&self.uses);
        if uses > 0.0 {
            sum(&self.repeats) / uses
        } else {
            0.0
        }
    }
}

/// What the passes of a layer did with one expert, as shares of all the layer's passes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PassShares {
    /// Passes that used the expert.
    pub used: f64,
    /// Passes that used it right after a pass that used it too (≤ `used`).
    pub repeated: f64,
}

/// Counts over a layer's experts → probability that each is among a token's `k` experts. Summed
/// in `u128`: a loaded dictionary's counts may come near `u64::MAX` (the fuzzer's finding: the
/// `u64` sum overflowed, wrapping to nonsense probabilities in release builds).
fn normalise(counts: &[u64], k: usize) -> Vec<f64> {
    let tokens = counts.iter().map(|&c| u128::from(c)).sum::<u128>() as f64 / k.max(1) as f64;
    counts
        .iter()
        .map(|&c| {
            if tokens == 0.0 {
                0.0
            } else {
                c as f64 / tokens
            }
        })
        .collect()
}

/// A layer's experts as a dictionary key: sorted.
fn set(experts: &[u16]) -> Vec<u16> {
    let mut s = experts.to_vec();
    s.sort_unstable();
    s
}

impl StackPaths {
    pub fn new(num_layers: usize, num_experts: usize, top_k: usize) -> Self {
        StackPaths {
            num_layers,
            num_experts,
            top_k: top_k.max(1),
            marginal: vec![vec![0; num_experts]; num_layers],
            given_previous: HashMap::new(),
            given_two: HashMap::new(),
            paths: HashMap::new(),
            passes: PassCounts::default(),
        }
    }

    /// The set of layer `n` in a flat path (`top_k` experts per layer).
    fn layer_set(&self, path: &[u16], n: usize) -> Vec<u16> {
        set(&path[n * self.top_k..(n + 1) * self.top_k])
    }

    /// Adds one token's path: `top_k` experts per MoE layer, layer after layer.
    pub fn add_path(&mut self, path: &[u16]) {
        let k = self.top_k;
        if path.len() != self.num_layers * k || path.iter().any(|&e| e as usize >= self.num_experts)
        {
            return;
        }
        let e = self.num_experts;
        for n in 0..self.num_layers {
            let here = &path[n * k..(n + 1) * k];
            for &expert in here {
                self.marginal[n][expert as usize] += 1;
            }
            if n >= 1 {
                let counts = self
                    .given_previous
                    .entry((n as u16, self.layer_set(path, n - 1)))
                    .or_insert_with(|| vec![0; e]);
                for &expert in here {
                    counts[expert as usize] += 1;
                }
            }
            if n >= 2 {
                let key = (
                    n as u16,
                    self.layer_set(path, n - 2),
                    self.layer_set(path, n - 1),
                );
                let counts = self.given_two.entry(key).or_insert_with(|| vec![0; e]);
                for &expert in here {
                    counts[expert as usize] += 1;
                }
            }
        }
        let whole: Vec<u16> = (0..self.num_layers)
            .flat_map(|n| self.layer_set(path, n))
            .collect();
        *self.paths.entry(whole).or_insert(0) += 1;
    }

    /// Counts consecutive passes of a run: `passes[i][layer]` holds the experts that pass `i`'s
    /// tokens chose at the layer. A pass of the wrong shape, or naming an expert the stack does
    /// not have, is skipped and breaks the sequence (the next pass counts no repeats).
    pub fn add_passes(&mut self, passes: &[Vec<Vec<u16>>]) {
        let (layers, experts) = (self.num_layers, self.num_experts);
        let counts = &mut self.passes;
        if counts.uses.is_empty() {
            counts.uses = vec![vec![0; experts]; layers];
            counts.repeats = vec![vec![0; experts]; layers];
        }
        let mut previous: Option<&Vec<Vec<u16>>> = None;
        for pass in passes {
            let fits =
                pass.len() == layers && pass.iter().flatten().all(|&e| (e as usize) < experts);
            if !fits {
                previous = None;
                continue;
            }
            counts.passes += 1;
            for (layer, chosen) in pass.iter().enumerate() {
                let mut chosen = chosen.clone();
                chosen.sort_unstable();
                chosen.dedup();
                for expert in chosen {
                    counts.uses[layer][expert as usize] += 1;
                    if previous.is_some_and(|p| p[layer].contains(&expert)) {
                        counts.repeats[layer][expert as usize] += 1;
                    }
                }
            }
            previous = Some(pass);
        }
    }

    /// Per expert of `layer`, the shares of its passes that used it and that used it again
    /// right after a use; `None` when no passes were counted (a version-2 dictionary).
    pub fn pass_shares(&self, layer: usize) -> Option<Vec<PassShares>> {
        let counts = &self.passes;
        let (uses, repeats) = (counts.uses.get(layer)?, counts.repeats.get(layer)?);
        if counts.passes == 0 {
            return None;
        }
        let n = counts.passes as f64;
        Some(
            uses.iter()
                .zip(repeats)
                .map(|(&u, &r)| {
                    let used = (u as f64 / n).min(1.0);
                    PassShares {
                        used,
                        repeated: (r as f64 / n).min(used),
                    }
                })
                .collect(),
        )
    }

    /// The sizes a loaded dictionary claims agree with each other and with what layer and
    /// expert numbers (`u16`) can address, so no later use indexes out of bounds or allocates
    /// a crafted size.
    fn check(&self, path: &Path, stack: &str) -> Result<()> {
        let addressable = usize::from(u16::MAX) + 1;
        let e = self.num_experts;
        let consistent = self.num_layers <= addressable
            && e <= addressable
            && (1..=addressable).contains(&self.top_k)
            && self.marginal.len() == self.num_layers
            && self.marginal.iter().all(|c| c.len() == e)
            && self.given_previous.values().all(|c| c.len() == e)
            && self.given_two.values().all(|c| c.len() == e)
            && [&self.passes.uses, &self.passes.repeats]
                .iter()
                .all(|rows| {
                    rows.is_empty()
                        || (rows.len() == self.num_layers && rows.iter().all(|c| c.len() == e))
                });
        if consistent {
            Ok(())
        } else {
            Err(Error::format(
                path,
                format!("corrupted path dictionary: the {stack} counts do not match its {} layers × {e} experts, top-{}", self.num_layers, self.top_k),
            ))
        }
    }

    /// Tokens counted (saturating: counts read from a file may be anything).
    pub fn tokens(&self) -> u64 {
        self.paths
            .values()
            .fold(0u64, |total, &c| total.saturating_add(c))
    }

    /// For each expert of layer `layer`, the probability that it is among the token's experts,
    /// given the token's experts at earlier layers (`history`: `top_k` per layer, layer after
    /// layer; only the last two layers are used).
    pub fn predict(&self, layer: usize, history: &[u16]) -> Vec<f64> {
        let n = layer as u16;
        let known = history.len() >= layer * self.top_k;
        if layer >= 2 && known {
            let key = (
                n,
                self.layer_set(history, layer - 2),
                self.layer_set(history, layer - 1),
            );
            if let Some(c) = self.given_two.get(&key) {
                return normalise(c, self.top_k);
            }
        }
        if layer >= 1 && known {
            if let Some(c) = self
                .given_previous
                .get(&(n, self.layer_set(history, layer - 1)))
            {
                return normalise(c, self.top_k);
            }
        }
        self.frequencies(layer)
    }

    /// Activation frequency of each expert of `layer` (probability of being among a token's
    /// experts).
    pub fn frequencies(&self, layer: usize) -> Vec<f64> {
        self.marginal
            .get(layer)
            .map(|c| normalise(c, self.top_k))
            .unwrap_or_else(|| vec![0.0; self.num_experts])
    }

    /// Share of tokens whose path is among the `fraction` most frequent distinct paths.
    pub fn top_path_coverage(&self, fraction: f64) -> f64 {
        let mut counts: Vec<u64> = self.paths.values().copied().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let keep = ((counts.len() as f64 * fraction).ceil() as usize).min(counts.len());
        let sum = |counts: &[u64]| counts.iter().map(|&c| u128::from(c)).sum::<u128>();
        let total = sum(&counts);
        if total == 0 {
            return 0.0;
        }
        sum(&counts[..keep]) as f64 / total as f64
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathDictionary {
    pub encoder: StackPaths,
    pub decoder: StackPaths,
}

impl PathDictionary {
    pub fn new(
        encoder_layers: usize,
        decoder_layers: usize,
        num_experts: usize,
        top_k: usize,
    ) -> Self {
        PathDictionary {
            encoder: StackPaths::new(encoder_layers, num_experts, top_k),
            decoder: StackPaths::new(decoder_layers, num_experts, top_k),
        }
    }

    pub fn stack(&self, stack: Stack) -> &StackPaths {
        match stack {
            Stack::Encoder => &self.encoder,
            Stack::Decoder => &self.decoder,
        }
    }

    pub fn stack_mut(&mut self, stack: Stack) -> &mut StackPaths {
        match stack {
            Stack::Encoder => &mut self.encoder,
            Stack::Decoder => &mut self.decoder,
        }
    }

    /// The dictionary as `paths.bin` holds it: magic, version, the two stacks' paths as
    /// version 2 wrote them, then their pass counts.
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = bincode::serialize(self).expect("the dictionary encodes");
        let passes = bincode::serialize(&(&self.encoder.passes, &self.decoder.passes))
            .expect("pass counts encode");
        let mut bytes = Vec::with_capacity(body.len() + passes.len() + 12);
        bytes.extend_from_slice(PATHS_MAGIC);
        bytes.extend_from_slice(&PATHS_VERSION.to_le_bytes());
        bytes.extend_from_slice(&body);
        bytes.extend_from_slice(&passes);
        bytes
    }

    /// Writes `path` atomically. A bundle's `paths.bin` goes through
    /// `Bundle::save_path_dictionary`, which records it in the bundle's manifest.
    pub fn save(&self, path: &Path) -> Result<()> {
        crate::atomic::write_file(path, &self.to_bytes())
    }

    pub fn load(path: &Path) -> Result<Self> {
        Self::from_bytes(path, &crate::io::read_bytes(path)?)
    }

    /// The dictionary in `bytes`, read from `path` (named in errors).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
        if bytes.len() < 12 || &bytes[..8] != PATHS_MAGIC {
            return Err(Error::format(
                path,
                "not an edgemoe path dictionary (bad magic number)",
            ));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != PATHS_VERSION && version != PATHS_VERSION_WITHOUT_PASSES {
            return Err(Error::format(
                path,
                format!("path dictionary version {version}, this engine reads versions {PATHS_VERSION_WITHOUT_PASSES} and {PATHS_VERSION}; run `edgemoe calibrate` again"),
            ));
        }
        // Same wire format as `bincode::serialize`, bounded by the file's real length: a
        // crafted length prefix fails to decode instead of allocating what it claims.
        use bincode::Options;
        let mut body = &bytes[12..];
        let options = bincode::DefaultOptions::new()
            .with_fixint_encoding()
            .allow_trailing_bytes()
            .with_limit(body.len() as u64);
        let corrupted =
            |e: bincode::Error| Error::format(path, format!("corrupted path dictionary: {e}"));
        let mut dict: Self = options.deserialize_from(&mut body).map_err(corrupted)?;
        if version == PATHS_VERSION {
            let (encoder, decoder) = options.deserialize_from(&mut body).map_err(corrupted)?;
            dict.encoder.passes = encoder;
            dict.decoder.passes = decoder;
        }
        dict.encoder.check(path, "encoder")?;
        dict.decoder.check(path, "decoder")?;
        Ok(dict)
    }
}

/// How well one layer's experts are predicted on held-out tokens. A prediction is right when
/// the token's experts include it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LayerAccuracy {
    pub layer: usize,
    pub tokens: u64,
    /// The dictionary's most probable expert is among the chosen ones.
    pub top1: f64,
    /// One of the dictionary's two most probable experts is among the chosen ones.
    pub top2: f64,
    /// Share of the chosen experts among the dictionary's `k` most probable (= `top1` for
    /// top-1 routing).
    pub recall_at_k: f64,
    /// Baseline: the expert this layer weighted highest for the previous token of the sequence
    /// (the most frequent expert for a sequence's first token).
    pub same_as_previous_token: f64,
    /// Baseline: the layer's most frequent expert.
    pub most_frequent: f64,
}

fn ranked(probabilities: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..probabilities.len()).collect();
    // Stable: ties keep the lower expert id first.
    order.sort_by(|&a, &b| probabilities[b].total_cmp(&probabilities[a]));
    order
}

/// Accuracy of `dict` on held-out `sequences` (each a list of token paths, in token order; a
/// path holds `top_k` experts per layer, highest weight first).
pub fn evaluate(dict: &StackPaths, sequences: &[Vec<Vec<u16>>]) -> Vec<LayerAccuracy> {
    let k = dict.top_k;
    let mut out: Vec<LayerAccuracy> = (0..dict.num_layers)
        .map(|layer| LayerAccuracy {
            layer,
            ..Default::default()
        })
        .collect();
    let most_frequent: Vec<u16> = (0..dict.num_layers)
        .map(|l| ranked(&dict.frequencies(l))[0] as u16)
        .collect();
    let mut hits = vec![[0f64; 5]; dict.num_layers];
    for sequence in sequences {
        for (t, path) in sequence.iter().enumerate() {
            if path.len() != dict.num_layers * k {
                continue;
            }
            for layer in 0..dict.num_layers {
                let actual = &path[layer * k..(layer + 1) * k];
                let order = ranked(&dict.predict(layer, &path[..layer * k]));
                let previous = if t == 0 {
                    most_frequent[layer]
                } else {
                    sequence[t - 1]
                        .get(layer * k)
                        .copied()
                        .unwrap_or(most_frequent[layer])
                };
                let has = |e: usize| actual.contains(&(e as u16));
                let h = &mut hits[layer];
                h[0] += has(order[0]) as u64 as f64;
                h[1] += order.iter().take(2).any(|&e| has(e)) as u64 as f64;
                h[2] += order.iter().take(k).filter(|&&e| has(e)).count() as f64 / k as f64;
                h[3] += has(previous as usize) as u64 as f64;
                h[4] += has(most_frequent[layer] as usize) as u64 as f64;
                out[layer].tokens += 1;
            }
        }
    }
    for (acc, h) in out.iter_mut().zip(&hits) {
        let n = acc.tokens.max(1) as f64;
        acc.top1 = h[0] / n;
        acc.top2 = h[1] / n;
        acc.recall_at_k = h[2] / n;
        acc.same_as_previous_token = h[3] / n;
        acc.most_frequent = h[4] / n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A skewed synthetic corpus: layer 1 copies layer 0, layer 2 is a fixed function of the
    /// two before it, with 10% noise.
    fn synthetic() -> Vec<Vec<Vec<u16>>> {
        let mut state = 7u64;
        let mut next = move || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as u32
        };
        (0..50)
            .map(|_| {
                (0..20)
                    .map(|_| {
                        let a = if next() % 10 < 7 {
                            0
                        } else {
                            (next() % 4) as u16
                        };
                        let b = if next() % 10 == 0 {
                            (next() % 4) as u16
                        } else {
                            a
                        };
                        let c = (a + b + 1) % 4;
                        vec![a, b, c]
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn predicts_a_skewed_synthetic_trace() {
        let data = synthetic();
        let mut dict = StackPaths::new(3, 4, 1);
        for seq in &data[..40] {
            for path in seq {
                dict.add_path(path);
            }
        }
        // Layer 2 is determined by the two layers before it.
        let p = dict.predict(2, &[1, 1]);
        assert_eq!(p[3], 1.0);
        // An unseen (layer 2, 3, 0) falls back to (layer 2, 0), then to the marginal.
        dict.given_two.remove(&(2, vec![3], vec![0]));
        assert_eq!(
            dict.predict(2, &[3, 0]),
            normalise(&dict.given_previous[&(2, vec![0])], 1)
        );
        dict.given_previous.remove(&(2, vec![0]));
        assert_eq!(dict.predict(2, &[3, 0]), dict.frequencies(2));
        assert_eq!(dict.predict(0, &[]), dict.frequencies(0));
        let acc = evaluate(&dict, &data[40..]);
        assert!(acc[2].top1 > 0.99, "{acc:?}");
        assert!(
            acc[1].top1 > 0.85 && acc[1].top1 > acc[1].most_frequent,
            "{acc:?}"
        );
        // Layer 0 has no history: the dictionary is the most-frequent baseline.
        assert_eq!(acc[0].top1, acc[0].most_frequent);
        assert!(acc[0].top2 >= acc[0].top1);
        assert!(dict.top_path_coverage(0.2) > 0.5);
    }

    #[test]
    fn predicts_sets_for_top_k() {
        // Two experts per token over 6 experts; layer 1's set is {e+1, e+2} for layer 0's
        // {e, e'} with e the smaller; layer 2 repeats layer 1.
        let mut dict = StackPaths::new(3, 6, 2);
        for a in 0..4u16 {
            for _ in 0..5 {
                // Router order (highest weight first) must not matter for the keys.
                dict.add_path(&[a + 1, a, a + 2, a + 1, a + 1, a + 2]);
            }
        }
        let p = dict.predict(1, &[2, 3]);
        assert_eq!(p[3], 1.0);
        assert_eq!(p[4], 1.0);
        assert!((p.iter().sum::<f64>() - 2.0).abs() < 1e-12, "{p:?}");
        assert_eq!(dict.predict(2, &[3, 2, 4, 3])[4], 1.0);
        // Marginals are inclusion probabilities: 4 equally likely sets over experts 0..=4.
        let f = dict.frequencies(0);
        assert_eq!(f[1], 0.5);
        assert_eq!(f[0], 0.25);
        let seqs = vec![vec![vec![1, 0, 2, 1, 1, 2], vec![3, 2, 4, 3, 4, 3]]];
        let acc = evaluate(&dict, &seqs);
        assert_eq!(acc[1].recall_at_k, 1.0);
        assert_eq!(acc[2].top1, 1.0);
        // Same as previous token: token 1's layer-2 top expert is 4, token 0's was 1.
        assert_eq!(acc[2].same_as_previous_token, 0.5);
        assert_eq!(dict.paths.len(), 4);
        assert_eq!(dict.paths[&vec![0, 1, 1, 2, 1, 2]], 5);
    }

    /// Three passes of a two-layer stack: layer 0 uses expert 1 in every pass (twice right
    /// after a use), expert 0 in the first only; layer 1 moves 2 → 3 → 2.
    #[test]
    fn counts_passes_and_repeats_per_expert() {
        let mut dict = StackPaths::new(2, 4, 2);
        assert_eq!(dict.pass_shares(0), None, "nothing counted yet");
        dict.add_passes(&[
            vec![vec![1, 0, 1], vec![2]],
            vec![vec![1], vec![3]],
            vec![vec![1], vec![2]],
        ]);
        assert_eq!(dict.passes.passes, 3);
        assert_eq!(dict.passes.uses, vec![vec![1, 3, 0, 0], vec![0, 0, 2, 1]]);
        assert_eq!(dict.passes.repeats, vec![vec![0, 2, 0, 0], vec![0; 4]]);
        assert!((dict.passes.repeat_share() - 2.0 / 7.0).abs() < 1e-12);
        let layer0 = dict.pass_shares(0).unwrap();
        assert_eq!(layer0[1].used, 1.0);
        assert!((layer0[1].repeated - 2.0 / 3.0).abs() < 1e-12);
        assert!((layer0[0].used - 1.0 / 3.0).abs() < 1e-12 && layer0[0].repeated == 0.0);
        // A pass of the wrong shape is skipped and breaks the sequence.
        dict.add_passes(&[
            vec![vec![1]],
            vec![vec![1], vec![9]],
            vec![vec![1], vec![2]],
        ]);
        assert_eq!(dict.passes.passes, 4);
        assert_eq!(
            dict.passes.repeats[0][1], 2,
            "no repeat across a skipped pass"
        );
    }

    #[test]
    fn round_trips_through_a_file() {
        let mut dict = PathDictionary::new(2, 3, 4, 1);
        dict.encoder.add_path(&[1, 2]);
        dict.decoder.add_path(&[0, 3, 3]);
        dict.decoder.add_passes(&[
            vec![vec![0], vec![3], vec![3]],
            vec![vec![0], vec![2], vec![3]],
        ]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(PATHS_FILE);
        dict.save(&path).unwrap();
        let loaded = PathDictionary::load(&path).unwrap();
        assert_eq!(loaded, dict);
        assert_eq!(loaded.decoder.passes.repeats[2][3], 1);
        // Version 2 (no pass counts after the paths) still loads, without them.
        let bytes = std::fs::read(&path).unwrap();
        let body = bincode::serialized_size(&dict).unwrap() as usize;
        let mut v2 = bytes[..12 + body].to_vec();
        v2[8..12].copy_from_slice(&2u32.to_le_bytes());
        std::fs::write(&path, &v2).unwrap();
        let old = PathDictionary::load(&path).unwrap();
        assert_eq!(old.decoder.passes, PassCounts::default());
        assert_eq!(old.decoder.given_previous, dict.decoder.given_previous);
        assert_eq!(old.decoder.pass_shares(0), None);
        // Version 3 cut after the paths: its pass counts are missing.
        v2[8..12].copy_from_slice(&3u32.to_le_bytes());
        std::fs::write(&path, &v2).unwrap();
        let err = PathDictionary::load(&path).unwrap_err().to_string();
        assert!(err.contains("corrupted"), "{err}");
        std::fs::write(&path, b"EMOPATHS\x09\x00\x00\x00").unwrap();
        assert!(PathDictionary::load(&path)
            .unwrap_err()
            .to_string()
            .contains("version 9"));
    }

    #[test]
    fn crafted_lengths_and_sizes_are_errors() {
        let mut dict = PathDictionary::new(2, 3, 4, 1);
        dict.decoder.add_path(&[0, 3, 3]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(PATHS_FILE);
        dict.save(&path).unwrap();
        let good = std::fs::read(&path).unwrap();
        // The body begins with the encoder's num_layers (u64); 3 × u64 later, `marginal`'s
        // length prefix: claim 2^60 rows.
        let mut bytes = good.clone();
        bytes[12 + 24..12 + 32].copy_from_slice(&(1u64 << 60).to_le_bytes());
        std::fs::write(&path, &bytes).unwrap();
        let err = PathDictionary::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("paths.bin") && err.contains("corrupted"),
            "{err}"
        );
        // A consistent encoding of inconsistent sizes: num_experts huge, top_k zero.
        for edit in [
            (|d: &mut PathDictionary| d.encoder.num_experts = 1 << 60) as fn(&mut PathDictionary),
            |d| d.decoder.top_k = 0,
            |d| d.decoder.num_layers = 9,
            |d| d.decoder.passes.uses = vec![vec![1; 4]; 2],
            |d| d.encoder.passes.repeats = vec![vec![1; 5]; 2],
        ] {
            let mut bad = dict.clone();
            edit(&mut bad);
            bad.save(&path).unwrap();
            let err = PathDictionary::load(&path).unwrap_err().to_string();
            assert!(
                err.contains("paths.bin") && err.contains("corrupted"),
                "{err}"
            );
        }
    }
}
