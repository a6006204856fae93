//! What the path dictionary says about the next MoE layer, during a run: after each layer has
//! routed, the experts worth prefetching for the next one (most probable first), and how the
//! dictionary's top-1 guesses did against the router. Also the offline activation frequencies
//! that seed the eviction policy.
//!
//! With top-k routing a layer's experts are a set: the dictionary gives, per expert, the
//! probability that it is among a token's k, and a guess counts as right when the token's
//! experts include it.

use std::sync::Arc;

use crate::cache::policy::{LayerMap, Seeds};
use crate::dictionary::PathDictionary;
use crate::ids::{ExpertId, Stack};

use super::stats::DictionaryStats;
pub use super::stats::{PredictionScores, PredictorKind, PredictorLayerStats};

/// Least probability that an expert is among a token's experts (or, over several tokens, the
/// mean of it) for the dictionary's prediction to be prefetched.
pub const PREFETCH_MIN_PROBABILITY: f64 = 0.1;

/// The dictionary's view of the forward call in progress.
pub struct Predictor {
    dictionary: Arc<PathDictionary>,
    layers: LayerMap,
    /// Experts chosen at the MoE layers already run in this forward call: per layer, `k` per
    /// token (as `routed` got them).
    history: Vec<Vec<u16>>,
    /// Experts per token of the layers in `history`.
    history_k: usize,
    history_stack: Option<Stack>,
    /// The top-1 guess per token for the layer routed next: (stack, block, guesses).
    guesses: Option<(Stack, usize, Vec<u16>)>,
    /// The last prediction: (stack, block, per expert the mean probability over the tokens).
    last: Option<(Stack, usize, Vec<f64>)>,
}

impl Predictor {
    pub fn new(dictionary: Arc<PathDictionary>, layers: LayerMap) -> Self {
        Predictor {
            dictionary,
            layers,
            history: Vec::new(),
            history_k: 1,
            history_stack: None,
            guesses: None,
            last: None,
        }
    }

    /// A new forward call of `stack` starts: the path so far is forgotten.
    pub fn begin_step(&mut self, stack: Stack) {
        self.history.clear();
        self.history_stack = Some(stack);
    }

    /// The router of block `block` of `stack` chose `experts` (`k` per token, tokens
    /// row-major). Scores the guesses made for this layer into `stats` and returns the experts
    /// of the next MoE block worth prefetching, most probable first.
    pub fn routed(
        &mut self,
        stack: Stack,
        block: usize,
        k: usize,
        experts: &[u16],
        stats: &mut DictionaryStats,
    ) -> Vec<ExpertId> {
        let k = k.max(1);
        let tokens = experts.len() / k;
        if let Some((s, b, guesses)) = self.guesses.take() {
            if s == stack && b == block && guesses.len() == tokens {
                stats.predictions += guesses.len() as u64;
                stats.top1_correct += guesses
                    .iter()
                    .zip(experts.chunks(k))
                    .filter(|(g, set)| set.contains(g))
                    .count() as u64;
                stats.top1_accuracy = stats.top1_correct as f64 / stats.predictions.max(1) as f64;
            }
        }
        if self.history_stack != Some(stack) || self.history_k != k {
            self.history.clear();
            self.history_stack = Some(stack);
            self.history_k = k;
        }
        self.history.push(experts.to_vec());

        let Some((next_stack, next_block)) = self.next_moe_block(stack, block) else {
            return Vec::new();
        };
        let Some(next_moe) = self.layers.moe_index(next_stack, next_block) else {
            return Vec::new();
        };
        let paths = self.dictionary.stack(next_stack);
        // Within a stack the path so far predicts the next layer; across the boundary (and to
        // the next token) only the layer's frequencies do.
        let same_call = next_stack == stack && next_moe > 0 && paths.top_k == k;
        let tokens = if same_call { tokens } else { 1 };
        // Summed over tokens: the probability that each expert is among a token's experts.
        let mut mass = vec![0.0f64; paths.num_experts];
        let mut guesses = Vec::with_capacity(tokens);
        let mut history = Vec::new();
        for t in 0..tokens {
            history.clear();
            if same_call {
                for layer in &self.history {
                    history.extend_from_slice(&layer[t * k..(t + 1) * k]);
                }
            }
            let p = paths.predict(next_moe, &history);
            let best = p
                .iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
                .map_or(0, |(e, _)| e as u16);
            guesses.push(best);
            for (m, q) in mass.iter_mut().zip(&p) {
                *m += q;
            }
        }
        if same_call {
            self.guesses = Some((next_stack, next_block, guesses));
        }
        self.last = Some((
            next_stack,
            next_block,
            mass.iter().map(|m| m / tokens as f64).collect(),
        ));
        let mut order: Vec<usize> = (0..mass.len()).collect();
        order.sort_by(|&a, &b| mass[b].total_cmp(&mass[a]));
        order
            .into_iter()
            .take_while(|&expert| mass[expert] >= PREFETCH_MIN_PROBABILITY * tokens as f64)
            .map(|expert| ExpertId {
                stack: next_stack,
                layer: next_block as u16,
                expert: expert as u16,
            })
            .collect()
    }

    /// The probability (mean over the call's tokens) the last prediction gave `id`; 0 for an
    /// expert of another layer.
    pub fn probability(&self, id: ExpertId) -> f64 {
        match &self.last {
            Some((stack, block, p)) if *stack == id.stack && *block == id.layer as usize => {
                p.get(id.expert as usize).copied().unwrap_or(0.0)
            }
            _ => 0.0,
        }
    }

    fn next_moe_block(&self, stack: Stack, block: usize) -> Option<(Stack, usize)> {
        next_moe_block(&self.layers, stack, block)
    }
}

/// The MoE block that runs after `block` of `stack`, across the encoder/decoder boundary and
/// from the decoder's last MoE layer to its first (the next token).
pub fn next_moe_block(layers: &LayerMap, stack: Stack, block: usize) -> Option<(Stack, usize)> {
    if let Some(next) = layers.next_block(stack, block) {
        return Some((stack, next));
    }
    layers
        .blocks(Stack::Decoder)
        .first()
        .map(|&b| (Stack::Decoder, b))
}

/// The gate lookahead's choices (`k` per token) as a prefetch list for block `block` of
/// `stack`: experts chosen for at least [`PREFETCH_MIN_PROBABILITY`] of the tokens, most chosen
/// first (the rule the dictionary's expected counts follow).
pub fn gate_prediction(stack: Stack, block: usize, k: usize, experts: &[u16]) -> Vec<ExpertId> {
    let tokens = (experts.len() / k.max(1)).max(1);
    let mut counts: Vec<(u16, usize)> = Vec::new();
    for &e in experts {
        match counts.iter_mut().find(|(x, _)| *x == e) {
            Some((_, n)) => *n += 1,
            None => counts.push((e, 1)),
        }
    }
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    counts
        .into_iter()
        .take_while(|&(_, n)| n as f64 >= PREFETCH_MIN_PROBABILITY * tokens as f64)
        .map(|(expert, _)| ExpertId {
            stack,
            layer: block as u16,
            expert,
        })
        .collect()
}

/// Both predictions as one list: experts in both first (in the gate's order), then the gate's
/// others, then the dictionary's others.
pub fn combined_prediction(dictionary: &[ExpertId], gate: &[ExpertId]) -> Vec<ExpertId> {
    let mut out: Vec<ExpertId> = gate
        .iter()
        .filter(|id| dictionary.contains(id))
        .copied()
        .collect();
    for id in gate.iter().chain(dictionary) {
        if !out.contains(id) {
            out.push(*id);
        }
    }
    out
}

/// What the dictionary measured of every expert, to seed the eviction policy: activation
/// frequencies, and pass shares where the dictionary counted passes (empty without one).
pub fn seeds(layers: &LayerMap, num_experts: usize, dictionary: Option<&PathDictionary>) -> Seeds {
    let mut out = Seeds::default();
    let Some(dict) = dictionary else {
        return out;
    };
    let (encoder_passes, decoder_passes) = (dict.encoder.passes.passes, dict.decoder.passes.passes);
    if encoder_passes > 0 && decoder_passes > 0 && !layers.blocks(Stack::Encoder).is_empty() {
        out.steps_per_document = Some(decoder_passes as f64 / encoder_passes as f64);
    }
    for stack in [Stack::Encoder, Stack::Decoder] {
        let paths = dict.stack(stack);
        for (moe, &block) in layers.blocks(stack).iter().enumerate() {
            let id = |expert: usize| ExpertId {
                stack,
                layer: block as u16,
                expert: expert as u16,
            };
            for (expert, p) in paths.frequencies(moe).into_iter().enumerate() {
                if expert < num_experts {
                    out.frequency.push((id(expert), p));
                }
            }
            for (expert, shares) in paths.pass_shares(moe).into_iter().flatten().enumerate() {
                if expert < num_experts {
                    out.passes.push((id(expert), shares.used, shares.repeated));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn experts(list: &[ExpertId]) -> Vec<u16> {
        list.iter().map(|id| id.expert).collect()
    }

    #[test]
    fn the_gates_choices_become_a_list_most_chosen_first() {
        // Two tokens, top-2: 5 is chosen by both, 1 and 3 by one each.
        let list = gate_prediction(Stack::Decoder, 4, 2, &[5, 1, 3, 5]);
        assert_eq!(experts(&list), [5, 1, 3]);
        assert!(list
            .iter()
            .all(|id| id.layer == 4 && id.stack == Stack::Decoder));
        // Eleven tokens, top-1: an expert chosen once (< 10% of them) is left out.
        let mut chosen = vec![2u16; 10];
        chosen.push(6);
        assert_eq!(
            experts(&gate_prediction(Stack::Encoder, 1, 1, &chosen)),
            [2]
        );
    }

    #[test]
    fn both_puts_agreement_first() {
        let id = |expert| ExpertId {
            stack: Stack::Decoder,
            layer: 1,
            expert,
        };
        let dictionary = [id(4), id(2), id(9)];
        let gate = [id(7), id(2)];
        assert_eq!(
            experts(&combined_prediction(&dictionary, &gate)),
            [2, 7, 4, 9]
        );
        assert_eq!(experts(&combined_prediction(&[], &gate)), [7, 2]);
    }
}
