//! The activation-path dictionary (ARCHITECTURE.md §7): for every token of a calibration corpus,
//! its path = the expert chosen at each MoE layer of a stack. The dictionary maps
//! (layer n, expert at n−2, expert at n−1) to the distribution of the expert at layer n, with
//! fallbacks (n, expert at n−1) → layer n's marginal when a key was never seen. Encoder and
//! decoder are kept apart. Stored in the bundle as `paths.bin`: magic, version, bincode.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::Stack;
use crate::error::{Error, Result};

pub const PATHS_MAGIC: &[u8; 8] = b"EMOPATHS";
pub const PATHS_VERSION: u32 = 1;
pub const PATHS_FILE: &str = "paths.bin";

/// Counts of one stack's paths.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StackPaths {
    pub num_layers: usize,
    pub num_experts: usize,
    /// `[layer][expert]` activations.
    pub marginal: Vec<Vec<u64>>,
    /// (layer, expert at layer−1) → counts over the layer's experts.
    pub given_previous: HashMap<(u16, u16), Vec<u64>>,
    /// (layer, expert at layer−2, expert at layer−1) → counts over the layer's experts.
    pub given_two: HashMap<(u16, u16, u16), Vec<u64>>,
    /// Whole paths and how many tokens took each.
    pub paths: HashMap<Vec<u16>, u64>,
}

fn normalise(counts: &[u64]) -> Vec<f64> {
    let total: u64 = counts.iter().sum();
    counts
        .iter()
        .map(|&c| {
            if total == 0 {
                0.0
            } else {
                c as f64 / total as f64
            }
        })
        .collect()
}

impl StackPaths {
    pub fn new(num_layers: usize, num_experts: usize) -> Self {
        StackPaths {
            num_layers,
            num_experts,
            marginal: vec![vec![0; num_experts]; num_layers],
            given_previous: HashMap::new(),
            given_two: HashMap::new(),
            paths: HashMap::new(),
        }
    }

    /// Adds one token's path (one expert per MoE layer).
    pub fn add_path(&mut self, path: &[u16]) {
        if path.len() != self.num_layers || path.iter().any(|&e| e as usize >= self.num_experts) {
            return;
        }
        let e = self.num_experts;
        for (n, &expert) in path.iter().enumerate() {
            self.marginal[n][expert as usize] += 1;
            if n >= 1 {
                self.given_previous
                    .entry((n as u16, path[n - 1]))
                    .or_insert_with(|| vec![0; e])[expert as usize] += 1;
            }
            if n >= 2 {
                self.given_two
                    .entry((n as u16, path[n - 2], path[n - 1]))
                    .or_insert_with(|| vec![0; e])[expert as usize] += 1;
            }
        }
        *self.paths.entry(path.to_vec()).or_insert(0) += 1;
    }

    pub fn tokens(&self) -> u64 {
        self.paths.values().sum()
    }

    /// Distribution of layer `layer`'s expert given the token's experts at earlier layers
    /// (`history[k]` = expert at layer k; only the last two are used).
    pub fn predict(&self, layer: usize, history: &[u16]) -> Vec<f64> {
        let n = layer as u16;
        if layer >= 2 && history.len() >= layer {
            if let Some(c) = self
                .given_two
                .get(&(n, history[layer - 2], history[layer - 1]))
            {
                return normalise(c);
            }
        }
        if layer >= 1 && history.len() >= layer {
            if let Some(c) = self.given_previous.get(&(n, history[layer - 1])) {
                return normalise(c);
            }
        }
        self.frequencies(layer)
    }

    /// Activation frequency of each expert of `layer`.
    pub fn frequencies(&self, layer: usize) -> Vec<f64> {
        self.marginal
            .get(layer)
            .map(|c| normalise(c))
            .unwrap_or_else(|| vec![0.0; self.num_experts])
    }

    /// Share of tokens whose path is among the `fraction` most frequent distinct paths.
    pub fn top_path_coverage(&self, fraction: f64) -> f64 {
        let mut counts: Vec<u64> = self.paths.values().copied().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let keep = ((counts.len() as f64 * fraction).ceil() as usize).min(counts.len());
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return 0.0;
        }
        counts[..keep].iter().sum::<u64>() as f64 / total as f64
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathDictionary {
    pub encoder: StackPaths,
    pub decoder: StackPaths,
}

impl PathDictionary {
    pub fn new(encoder_layers: usize, decoder_layers: usize, num_experts: usize) -> Self {
        PathDictionary {
            encoder: StackPaths::new(encoder_layers, num_experts),
            decoder: StackPaths::new(decoder_layers, num_experts),
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

    pub fn save(&self, path: &Path) -> Result<()> {
        let body = bincode::serialize(self)
            .map_err(|e| Error::format(path, format!("cannot encode: {e}")))?;
        let mut bytes = Vec::with_capacity(body.len() + 12);
        bytes.extend_from_slice(PATHS_MAGIC);
        bytes.extend_from_slice(&PATHS_VERSION.to_le_bytes());
        bytes.extend_from_slice(&body);
        std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
    }

    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        if bytes.len() < 12 || &bytes[..8] != PATHS_MAGIC {
            return Err(Error::format(
                path,
                "not an edgemoe path dictionary (bad magic number)",
            ));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if version != PATHS_VERSION {
            return Err(Error::format(
                path,
                format!("path dictionary version {version}, this engine reads version {PATHS_VERSION}; run `edgemoe calibrate` again"),
            ));
        }
        bincode::deserialize(&bytes[12..])
            .map_err(|e| Error::format(path, format!("corrupted path dictionary: {e}")))
    }
}

/// How well one layer's expert is predicted on held-out tokens.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LayerAccuracy {
    pub layer: usize,
    pub tokens: u64,
    /// The dictionary's most probable expert is the chosen one.
    pub top1: f64,
    /// The chosen expert is among the dictionary's two most probable.
    pub top2: f64,
    /// Baseline: the expert this layer chose for the previous token of the sequence (the most
    /// frequent expert for a sequence's first token).
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

/// Accuracy of `dict` on held-out `sequences` (each a list of token paths, in token order).
pub fn evaluate(dict: &StackPaths, sequences: &[Vec<Vec<u16>>]) -> Vec<LayerAccuracy> {
    let mut out: Vec<LayerAccuracy> = (0..dict.num_layers)
        .map(|layer| LayerAccuracy {
            layer,
            ..Default::default()
        })
        .collect();
    let most_frequent: Vec<u16> = (0..dict.num_layers)
        .map(|l| ranked(&dict.frequencies(l))[0] as u16)
        .collect();
    let mut hits = vec![[0u64; 4]; dict.num_layers];
    for sequence in sequences {
        for (t, path) in sequence.iter().enumerate() {
            if path.len() != dict.num_layers {
                continue;
            }
            for layer in 0..dict.num_layers {
                let actual = path[layer];
                let order = ranked(&dict.predict(layer, &path[..layer]));
                let previous = if t == 0 {
                    most_frequent[layer]
                } else {
                    sequence[t - 1]
                        .get(layer)
                        .copied()
                        .unwrap_or(most_frequent[layer])
                };
                let h = &mut hits[layer];
                h[0] += (order[0] as u16 == actual) as u64;
                h[1] += order.iter().take(2).any(|&e| e as u16 == actual) as u64;
                h[2] += (previous == actual) as u64;
                h[3] += (most_frequent[layer] == actual) as u64;
                out[layer].tokens += 1;
            }
        }
    }
    for (acc, h) in out.iter_mut().zip(&hits) {
        let n = acc.tokens.max(1) as f64;
        acc.top1 = h[0] as f64 / n;
        acc.top2 = h[1] as f64 / n;
        acc.same_as_previous_token = h[2] as f64 / n;
        acc.most_frequent = h[3] as f64 / n;
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
        let mut dict = StackPaths::new(3, 4);
        for seq in &data[..40] {
            for path in seq {
                dict.add_path(path);
            }
        }
        // Layer 2 is determined by the two layers before it.
        let p = dict.predict(2, &[1, 1]);
        assert_eq!(p[3], 1.0);
        // An unseen (layer 2, 3, 0) falls back to (layer 2, 0), then to the marginal.
        dict.given_two.remove(&(2, 3, 0));
        assert_eq!(
            dict.predict(2, &[3, 0]),
            normalise(&dict.given_previous[&(2, 0)])
        );
        dict.given_previous.remove(&(2, 0));
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
    fn round_trips_through_a_file() {
        let mut dict = PathDictionary::new(2, 3, 4);
        dict.encoder.add_path(&[1, 2]);
        dict.decoder.add_path(&[0, 3, 3]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(PATHS_FILE);
        dict.save(&path).unwrap();
        assert_eq!(PathDictionary::load(&path).unwrap(), dict);
        std::fs::write(&path, b"EMOPATHS\x09\x00\x00\x00").unwrap();
        assert!(PathDictionary::load(&path)
            .unwrap_err()
            .to_string()
            .contains("version 9"));
    }
}
