//! The memory budget: parsing sizes such as `1.5GiB`, and dividing a budget between resident
//! weights, working memory and the expert buffer's slots.
//!
//! `budget = resident weights + working memory + slots × slot bytes`. Working memory is an
//! estimate of the engine's own activations for the longest run the options allow (KV caches,
//! attention scores, expert scratch, logits); libtorch's allocator and the process image are
//! not counted, and `peak_rss_bytes` in the statistics shows what the whole process used.

use crate::config::{DecoderSpec, ModelSpec, SwitchSpec};
use crate::error::{Error, Result};

/// Parses `1.5GiB`, `512MiB`, `2GB`, `800M`, `1048576` (bytes). Binary units (KiB, MiB, GiB)
/// are powers of 1024; decimal ones (KB, MB, GB) powers of 1000; a bare `K`/`M`/`G` is binary.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().map_err(|_| {
        Error::Input(format!(
            "invalid size `{text}`: expected e.g. 1.5GiB, 512MiB or a number of bytes"
        ))
    })?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => {
            return Err(Error::Input(format!(
                "invalid size `{text}`: unknown unit `{other}` (use B, KiB, MiB, GiB, KB, MB or GB)"
            )))
        }
    };
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(Error::Input(format!("invalid size `{text}`")));
    }
    Ok(bytes.round() as u64)
}

/// `1.50 GiB`, `12.0 MiB`, `512 B`.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    let digits = if value < 10.0 { 2 } else { 1 };
    format!("{value:.digits$} {}", UNITS[unit])
}

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
    fn parses_units() {
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 1_610_612_736);
        assert_eq!(parse_bytes("512MiB").unwrap(), 536_870_912);
        assert_eq!(parse_bytes("2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes(" 64 k ").unwrap(), 65536);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("1.5 parsecs").is_err());
        assert!(parse_bytes("").is_err());
    }

    #[test]
    fn formats_units() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1_610_612_736), "1.50 GiB");
        assert_eq!(format_bytes(12 * 1024 * 1024), "12.0 MiB");
    }

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
