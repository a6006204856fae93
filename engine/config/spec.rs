//! [`ModelSpec`]: the validated model, one enum over the architectures — [`SwitchSpec`]
//! (encoder-decoder, top-1, ReLU experts) and [`DecoderSpec`] (decoder-only, top-k, SwiGLU
//! experts). Everything outside the model files (expert store layout, buffer, policies,
//! dictionary, budget) asks the enum only what every MoE model has: its MoE blocks per stack,
//! experts per block, experts per token and the matrices of one expert. Decoder-only models put
//! their MoE layers in [`Stack::Decoder`] and have no encoder.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

use crate::cache::policy::LayerMap;
use crate::ids::{ExpertId, Stack};
use crate::store::ExpertLayout;

use super::decoder::DecoderSpec;
use super::switch::{SwitchSpec, ARCHITECTURE_SWITCH};

/// The validated shape and semantics of a model, per architecture. Serialized untagged: the
/// bundle's `architecture` field says which one it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelSpec {
    Switch(SwitchSpec),
    DecoderOnly(DecoderSpec),
}

/// What one expert computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertFfn {
    /// Switch Transformers: `relu(x·wiᵀ)·woᵀ` (`wi` [d_ff, d], `wo` [d, d_ff]).
    Relu,
    /// SwiGLU (Mixtral, Qwen2-MoE, OLMoE): `(silu(x·gateᵀ) ⊙ x·upᵀ)·downᵀ` (`gate`, `up`
    /// [d_ff, d], `down` [d, d_ff]).
    SwiGlu,
}

impl ExpertFfn {
    /// The matrices of one expert in blob order, with their (rows, cols) for `d_model`/`d_ff`.
    pub fn matrices(self, d_model: usize, d_ff: usize) -> Vec<(&'static str, usize, usize)> {
        match self {
            ExpertFfn::Relu => vec![("wi", d_ff, d_model), ("wo", d_model, d_ff)],
            ExpertFfn::SwiGlu => vec![
                ("gate", d_ff, d_model),
                ("up", d_ff, d_model),
                ("down", d_model, d_ff),
            ],
        }
    }
}

impl ModelSpec {
    /// The bundle's `architecture` (HF `model_type`).
    pub fn architecture(&self) -> &'static str {
        match self {
            ModelSpec::Switch(_) => ARCHITECTURE_SWITCH,
            ModelSpec::DecoderOnly(d) => d.family.model_type(),
        }
    }

    pub fn as_switch(&self) -> Option<&SwitchSpec> {
        match self {
            ModelSpec::Switch(s) => Some(s),
            ModelSpec::DecoderOnly(_) => None,
        }
    }

    pub fn as_decoder(&self) -> Option<&DecoderSpec> {
        match self {
            ModelSpec::DecoderOnly(d) => Some(d),
            ModelSpec::Switch(_) => None,
        }
    }

    /// Block indices of a stack's MoE layers, in execution order (none in the encoder of a
    /// decoder-only model).
    pub fn moe_blocks(&self, stack: Stack) -> Vec<usize> {
        match (self, stack) {
            (ModelSpec::Switch(s), _) => s.moe_blocks(stack),
            (ModelSpec::DecoderOnly(d), Stack::Decoder) => d.moe_layers.clone(),
            (ModelSpec::DecoderOnly(_), Stack::Encoder) => Vec::new(),
        }
    }

    /// Routed experts per MoE block.
    pub fn num_experts(&self) -> usize {
        match self {
            ModelSpec::Switch(s) => s.num_experts,
            ModelSpec::DecoderOnly(d) => d.num_experts,
        }
    }

    /// Experts each token is routed to.
    pub fn top_k(&self) -> usize {
        match self {
            ModelSpec::Switch(_) => 1,
            ModelSpec::DecoderOnly(d) => d.top_k,
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            ModelSpec::Switch(s) => s.vocab_size,
            ModelSpec::DecoderOnly(d) => d.vocab_size,
        }
    }

    pub fn d_model(&self) -> usize {
        match self {
            ModelSpec::Switch(s) => s.d_model,
            ModelSpec::DecoderOnly(d) => d.hidden_size,
        }
    }

    /// Intermediate width of one routed expert.
    pub fn expert_d_ff(&self) -> usize {
        match self {
            ModelSpec::Switch(s) => s.d_ff,
            ModelSpec::DecoderOnly(d) => d.expert_intermediate_size,
        }
    }

    pub fn expert_ffn(&self) -> ExpertFfn {
        match self {
            ModelSpec::Switch(_) => ExpertFfn::Relu,
            ModelSpec::DecoderOnly(_) => ExpertFfn::SwiGlu,
        }
    }

    /// The matrices of one expert as the engine stores them, in blob order.
    pub fn expert_matrices(&self) -> Vec<(&'static str, usize, usize)> {
        self.expert_ffn()
            .matrices(self.d_model(), self.expert_d_ff())
    }

    /// Weights in one expert.
    pub fn expert_params(&self) -> usize {
        self.expert_matrices().iter().map(|(_, r, c)| r * c).sum()
    }

    /// Every expert of the model, encoder first, in execution order.
    pub fn all_experts(&self) -> Vec<ExpertId> {
        let mut ids = Vec::new();
        for stack in [Stack::Encoder, Stack::Decoder] {
            for layer in self.moe_blocks(stack) {
                for expert in 0..self.num_experts() {
                    ids.push(ExpertId {
                        stack,
                        layer: layer as u16,
                        expert: expert as u16,
                    });
                }
            }
        }
        ids
    }

    /// Where each MoE block sits in execution order (the cache's view of the model).
    pub fn layer_map(&self) -> LayerMap {
        LayerMap {
            encoder_moe_blocks: self.moe_blocks(Stack::Encoder),
            decoder_moe_blocks: self.moe_blocks(Stack::Decoder),
        }
    }

    /// Whether the model has an encoder (its input is a source to rewrite, not a prompt).
    pub fn has_encoder(&self) -> bool {
        matches!(self, ModelSpec::Switch(_))
    }

    /// The shape as `edgemoe inspect` prints it, one line each.
    pub fn describe(&self) -> Vec<String> {
        match self {
            ModelSpec::Switch(s) => s.describe(),
            ModelSpec::DecoderOnly(d) => d.describe(),
        }
    }

    /// What the model's expert store must hold: one expert's matrices and every expert.
    pub fn expert_layout(&self) -> ExpertLayout {
        ExpertLayout {
            matrices: self.expert_matrices(),
            experts: self.all_experts(),
        }
    }

    pub fn tie_word_embeddings(&self) -> bool {
        match self {
            ModelSpec::Switch(s) => s.tie_word_embeddings,
            ModelSpec::DecoderOnly(d) => d.tie_word_embeddings,
        }
    }

    /// Fails, saying which, unless every size is one the engine can address and allocate, and
    /// the sizes agree with each other: layers and experts fit their `u16` ids, at most
    /// [`MAX_EXPERTS`] experts in all, every width at most [`MAX_WIDTH`], a decoder's heads,
    /// top-k, MoE layers and attention windows consistent. A bundle's `config.json` is checked
    /// with this when it is read: it is written by `convert` from a validated checkpoint config,
    /// but a damaged or crafted one must not make the engine allocate what it claims (the
    /// fuzzer's finding: 222,222,222 encoder layers asked for gigabytes of expert ids).
    pub fn check_sizes(&self) -> std::result::Result<(), String> {
        let ids = usize::from(u16::MAX) + 1;
        let mut widths: Vec<(&str, usize)> = Vec::new();
        let mut layers: Vec<(&str, usize)> = Vec::new();
        match self {
            ModelSpec::Switch(s) => {
                widths.extend([
                    ("vocab_size", s.vocab_size),
                    ("d_model", s.d_model),
                    ("d_kv", s.d_kv),
                    ("d_ff", s.d_ff),
                    ("num_heads", s.num_heads),
                    ("num_heads × d_kv", s.num_heads.saturating_mul(s.d_kv)),
                    (
                        "relative_attention_num_buckets",
                        s.relative_attention_num_buckets,
                    ),
                    (
                        "relative_attention_max_distance",
                        s.relative_attention_max_distance,
                    ),
                ]);
                layers.extend([
                    ("num_encoder_layers", s.num_encoder_layers),
                    ("num_decoder_layers", s.num_decoder_layers),
                ]);
                if s.relative_attention_num_buckets < 4 {
                    return Err("`relative_attention_num_buckets` must be at least 4".into());
                }
                // T5's bucket formula divides by log(max_distance / max_exact), max_exact being
                // half the decoder's buckets: at or below it, long distances get negative (or
                // NaN) buckets, and transformers fails the same way ("index out of range").
                let max_exact = s.relative_attention_num_buckets / 2;
                if s.relative_attention_max_distance <= max_exact {
                    return Err(format!(
                        "`relative_attention_max_distance` = {} must exceed half of `relative_attention_num_buckets` ({}): T5's position buckets need it above {max_exact}",
                        s.relative_attention_max_distance, s.relative_attention_num_buckets
                    ));
                }
            }
            ModelSpec::DecoderOnly(d) => {
                widths.extend([
                    ("vocab_size", d.vocab_size),
                    ("hidden_size", d.hidden_size),
                    ("num_heads", d.num_heads),
                    ("num_kv_heads", d.num_kv_heads),
                    ("head_dim", d.head_dim),
                    (
                        "num_heads × head_dim",
                        d.num_heads.saturating_mul(d.head_dim),
                    ),
                    ("intermediate_size", d.intermediate_size),
                    ("expert_intermediate_size", d.expert_intermediate_size),
                    (
                        "shared_expert_intermediate_size",
                        d.shared_expert_intermediate_size.unwrap_or(1),
                    ),
                ]);
                layers.push(("num_layers", d.num_layers));
                if d.num_kv_heads == 0 || !d.num_heads.is_multiple_of(d.num_kv_heads) {
                    return Err(format!(
                        "`num_heads` {} is not a multiple of `num_kv_heads` {}",
                        d.num_heads, d.num_kv_heads
                    ));
                }
                if !d.head_dim.is_multiple_of(2) {
                    return Err(format!("`head_dim` {} must be even", d.head_dim));
                }
                if !(1..=d.num_experts).contains(&d.top_k) {
                    return Err(format!(
                        "`top_k` {} must be between 1 and the {} experts",
                        d.top_k, d.num_experts
                    ));
                }
                if d.moe_layers.iter().any(|&l| l >= d.num_layers)
                    || d.moe_layers.windows(2).any(|w| w[0] >= w[1])
                {
                    return Err(format!(
                        "`moe_layers` must be increasing layer numbers below {}",
                        d.num_layers
                    ));
                }
                if d.attention_windows.contains(&Some(0)) {
                    return Err("`attention_windows`: a window of 0 sees no key".into());
                }
                if d.attention_windows.len() != d.num_layers {
                    return Err(format!(
                        "{} attention windows for {} layers",
                        d.attention_windows.len(),
                        d.num_layers
                    ));
                }
            }
        }
        for (name, value) in widths {
            if !(1..=MAX_WIDTH).contains(&value) {
                return Err(format!("`{name}` = {value} (expected 1 to {MAX_WIDTH})"));
            }
        }
        for (name, value) in layers {
            if value > MAX_LAYERS {
                return Err(format!("`{name}` = {value} (at most {MAX_LAYERS})"));
            }
        }
        let experts = self.num_experts();
        if !(1..ids).contains(&experts) {
            return Err(format!(
                "{experts} experts per layer (expected 1 to {})",
                ids - 1
            ));
        }
        let blocks = self.moe_blocks(Stack::Encoder).len() + self.moe_blocks(Stack::Decoder).len();
        if blocks.saturating_mul(experts) > MAX_EXPERTS {
            return Err(format!(
                "{blocks} MoE blocks × {experts} experts (at most {MAX_EXPERTS} experts in all)"
            ));
        }
        Ok(())
    }
}

impl ModelSpec {
    /// Fails naming the config file `path` and the field unless the model is one the engine
    /// can run: [`ModelSpec::check_sizes`], and every epsilon, RoPE base and clamp a positive
    /// finite number. `convert` checks a Hugging Face config with this, and opening a bundle
    /// checks the bundle's `config.json` with it: both refuse the same values.
    pub fn validate(&self, path: &Path) -> Result<()> {
        self.check_sizes()
            .map_err(|message| Error::format(path, format!("invalid model config: {message}")))?;
        match self {
            ModelSpec::Switch(s) => {
                check_positive_finite(path, "layer_norm_epsilon", s.layer_norm_epsilon)?;
            }
            ModelSpec::DecoderOnly(d) => {
                check_positive_finite(path, "rms_norm_eps", d.rms_norm_eps)?;
                check_positive_finite(path, "rope_theta", d.rope_theta)?;
                if let Some(clip) = d.clip_qkv {
                    check_positive_finite(path, "clip_qkv", clip)?;
                }
            }
        }
        Ok(())
    }
}

/// Fails naming `field` of the config at `path` unless `value` is a positive finite number (an
/// epsilon, a RoPE base, a clamp): zero, negative or infinite values give NaNs or empty outputs
/// far from their cause.
fn check_positive_finite(path: &Path, field: &str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        return Ok(());
    }
    Err(Error::format(
        path,
        format!("`{field}` must be a positive finite number, got {value}"),
    ))
}

/// Widest dimension (vocabulary, model width, FFN width, heads) a model may have: 2^20, four
/// times the largest vocabulary of a released model, so `rows × cols` of any matrix stays far
/// inside `u64`.
pub const MAX_WIDTH: usize = 1 << 20;

/// Most layers a stack may have: layers are numbered by `u16` ids (`0..=65535`).
pub const MAX_LAYERS: usize = 1 << 16;

/// Most experts a model may have in all (MoE blocks × experts per block): 2^20, thirty times
/// the largest released MoE.
pub const MAX_EXPERTS: usize = 1 << 20;
