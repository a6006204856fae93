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
}

/// Fails naming `field` of the config at `path` unless `value` is a positive finite number (an
/// epsilon, a RoPE base, a clamp): zero, negative or infinite values give NaNs or empty outputs
/// far from their cause.
pub(crate) fn check_positive_finite(path: &Path, field: &str, value: f64) -> Result<()> {
    if value.is_finite() && value > 0.0 {
        return Ok(());
    }
    Err(Error::format(
        path,
        format!("`{field}` must be a positive finite number, got {value}"),
    ))
}
