//! The memory budget: parsing sizes such as `1.5GiB`, and dividing a budget between resident
//! weights, working memory and the expert buffer's slots.
//!
//! `budget = resident weights + working memory + slots × slot bytes`. Working memory is an
//! estimate of the engine's own activations for the longest run the options allow (KV caches,
//! attention scores, expert scratch, logits); libtorch's allocator and the process image are
//! not counted, and `peak_rss_bytes` in the statistics shows what the whole process used.

use crate::config::{DecoderSpec, ModelSpec, SwitchSpec};
use crate::error::{Error, Result};

/// The sizes of a run that working memory depends on.
#[derive(Debug, Clone, Copy)]
pub struct RunShape {
    pub max_source_tokens: usize,
    pub max_new_tokens: usize,
    pub beams: usize,
}

/// Estimated bytes of activations and scratch for one run (f32 everywhere).
pub fn working_bytes(spec: &ModelSpec, run: RunShape) -> u64 {
    match spec {
        ModelSpec::Switch(s) => switch_working_bytes(s, run),
        ModelSpec::DecoderOnly(d) => decoder_working_bytes(d, run),
    }
}

fn switch_working_bytes(spec: &SwitchSpec, run: RunShape) -> u64 {
    let f = 4u64;
    let src = run.max_source_tokens as u64;
    let tgt = run.max_new_tokens as u64 + 1;
    let beams = run.beams.max(1) as u64;
    let d = spec.d_model as u64;
    let inner = spec.inner_dim() as u64;
    let heads = spec.num_heads as u64;
    let d_ff = spec.d_ff as u64;
    let dec_layers = spec.num_decoder_layers as u64;
    // Encoder: hidden states, q/k/v/out, scores (+ softmax copy), FF intermediate, bias.
    let encoder = src * (4 * d + 4 * inner + d_ff) + 3 * heads * src * src;
    // Decoder caches per beam: self-attention K/V grow to `tgt`, cross-attention K/V span `src`
    // (twice during a beam reorder, when old and new caches coexist).
    let caches = 2 * dec_layers * beams * 2 * inner * (tgt + src);
    // Logits and log-probabilities of every beam, plus the top-k workspace.
    let logits = 3 * beams * spec.vocab_size as u64;
    // Dequantized weights of the expert being computed (`wi` and `wo`).
    let expert_scratch = 2 * spec.d_model as u64 * spec.d_ff as u64;
    f * (encoder + caches + logits + expert_scratch)
}

/// A decoder-only run: `max_source_tokens` is the prompt length (prefilled at once).
fn decoder_working_bytes(spec: &DecoderSpec, run: RunShape) -> u64 {
    let f = 4u64;
    let prompt = run.max_source_tokens as u64;
    let total = prompt + run.max_new_tokens as u64;
    let d = spec.hidden_size as u64;
    let (q, kv) = (spec.q_dim() as u64, spec.kv_dim() as u64);
    let heads = spec.num_heads as u64;
    let widest_ff = spec
        .intermediate_size
        .max(spec.expert_intermediate_size)
        .max(spec.shared_expert_intermediate_size.unwrap_or(0)) as u64;
    // Prefill: hidden states and residuals, q/k/v/out (k and v repeated to every head), scores
    // (+ softmax copy), the mask, the FF intermediates (gate, up, product) and the MoE output.
    let prefill = prompt * (5 * d + 2 * q + 2 * kv + 2 * heads * spec.head_dim as u64)
        + 3 * heads * prompt * total
        + prompt * total
        + 3 * prompt * widest_ff
        + prompt * (spec.top_k as u64 + 1) * d;
    // The KV cache of every layer, up to the last token (and the copy a concatenation makes).
    let caches = 2 * spec.num_layers as u64 * 2 * kv * total;
    // Logits, their softmax and sort for sampling.
    let logits = 4 * spec.vocab_size as u64;
    // Dequantized weights of the expert being computed (`gate`, `up`, `down`).
    let expert_scratch = 3 * d * spec.expert_intermediate_size as u64;
    f * (prefill + caches + logits + expert_scratch)
}

/// How a budget is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetPlan {
    pub budget_bytes: u64,
    pub resident_bytes: u64,
    pub working_bytes: u64,
    pub slot_bytes: u64,
    pub slots: usize,
}

impl BudgetPlan {
    /// Fits as many slots as the budget allows, but no more than there are experts; or exactly
    /// `requested_slots` if given (an error if the budget cannot hold them).
    pub fn new(
        budget_bytes: u64,
        resident_bytes: u64,
        working_bytes: u64,
        slot_bytes: u64,
        total_experts: usize,
        requested_slots: Option<usize>,
    ) -> Result<Self> {
        let need = requested_slots.unwrap_or(1).max(1);
        let minimum_bytes = resident_bytes + working_bytes + need as u64 * slot_bytes;
        if budget_bytes < minimum_bytes || slot_bytes == 0 {
            return Err(Error::BudgetTooSmall {
                budget_bytes,
                resident_bytes,
                working_bytes,
                slot_bytes,
                slots: need,
                minimum_bytes,
            });
        }
        let free = budget_bytes - resident_bytes - working_bytes;
        let slots = match requested_slots {
            Some(n) => n.max(1),
            None => ((free / slot_bytes) as usize).clamp(1, total_experts.max(1)),
        };
        Ok(BudgetPlan {
            budget_bytes,
            resident_bytes,
            working_bytes,
            slot_bytes,
            slots,
        })
    }

    pub fn buffer_bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_fits_slots_and_reports_minimum() {
        let plan = BudgetPlan::new(10_000, 4_000, 1_000, 1_000, 64, None).unwrap();
        assert_eq!(plan.slots, 5);
        assert_eq!(plan.buffer_bytes(), 5_000);
        let capped = BudgetPlan::new(1_000_000, 4_000, 1_000, 1_000, 3, None).unwrap();
        assert_eq!(capped.slots, 3);
        match BudgetPlan::new(5_999, 4_000, 1_000, 1_000, 64, None) {
            Err(Error::BudgetTooSmall { minimum_bytes, .. }) => assert_eq!(minimum_bytes, 6_000),
            other => panic!("expected BudgetTooSmall, got {other:?}"),
        }
        let exact = BudgetPlan::new(10_000, 4_000, 1_000, 1_000, 64, Some(3)).unwrap();
        assert_eq!(exact.slots, 3);
        match BudgetPlan::new(10_000, 4_000, 1_000, 1_000, 64, Some(6)) {
            Err(Error::BudgetTooSmall {
                minimum_bytes,
                slots,
                ..
            }) => {
                assert_eq!((minimum_bytes, slots), (11_000, 6))
            }
            other => panic!("expected BudgetTooSmall, got {other:?}"),
        }
    }
}
