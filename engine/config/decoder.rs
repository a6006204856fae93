//! Decoder-only MoE families (Mixtral, Qwen2-MoE, OLMoE): their Hugging Face `config.json`
//! (transformers 5.x field names, older `rope_theta` accepted too) validated into a
//! [`DecoderSpec`].
//!
//! What the families share and the engine implements once: pre-norm blocks with RMSNorm, RoPE
//! (`rope_type` `default` only), grouped-query attention scaled by `head_dim^-0.5`, a router
//! `softmax(x·Wᵀ)` in f32 then top-k, and SwiGLU experts. What differs is a flag here:
//! - routing weights: Mixtral always renormalises the top-k probabilities to sum to 1; Qwen2-MoE
//!   and OLMoE only with `norm_topk_prob`;
//! - Qwen2-MoE: q/k/v biases (`qkv_bias`), a shared expert gated by `sigmoid(x·gᵀ)` that every
//!   token uses (resident, never in the expert store), dense MLP layers (`mlp_only_layers`,
//!   `decoder_sparse_step`), sliding-window layers (`layer_types`);
//! - OLMoE: RMSNorm of the whole q and k projections (`q_norm`/`k_norm`, before splitting into
//!   heads), optional `clip_qkv`, optional biases on q/k/v/o (`attention_bias`);
//! - Mixtral: an optional `sliding_window` for every layer.
//!
//! Anything else (another activation, another RoPE type, jitter at inference) is refused with
//! the field that asks for it.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::hf::HfDecoderConfig;
use super::spec::MAX_LAYERS;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DecoderFamily {
    #[serde(rename = "mixtral")]
    Mixtral,
    #[serde(rename = "qwen2_moe")]
    Qwen2Moe,
    #[serde(rename = "olmoe")]
    Olmoe,
}

impl DecoderFamily {
    pub const ALL: [DecoderFamily; 3] = [
        DecoderFamily::Mixtral,
        DecoderFamily::Qwen2Moe,
        DecoderFamily::Olmoe,
    ];

    pub fn model_type(self) -> &'static str {
        match self {
            DecoderFamily::Mixtral => "mixtral",
            DecoderFamily::Qwen2Moe => "qwen2_moe",
            DecoderFamily::Olmoe => "olmoe",
        }
    }

    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.model_type() == model_type)
    }
}

/// The validated shape and semantics of a decoder-only MoE model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecoderSpec {
    pub family: DecoderFamily,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Width of the dense MLP of non-MoE layers (Qwen2-MoE).
    pub intermediate_size: usize,
    /// Width of one routed expert.
    pub expert_intermediate_size: usize,
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the top-k routing probabilities to sum to 1.
    pub norm_topk_prob: bool,
    /// Layers whose FFN is the MoE (the others have a dense SwiGLU MLP).
    pub moe_layers: Vec<usize>,
    /// Width of the shared expert every token goes through (Qwen2-MoE), with its sigmoid gate.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// RMSNorm over the whole q and k projections (OLMoE).
    pub qk_norm: bool,
    /// Clamp q, k and v to ±this (OLMoE).
    pub clip_qkv: Option<f64>,
    /// Per layer: the sliding attention window (keys with `query − key < window` are seen), or
    /// none for full causal attention.
    pub attention_windows: Vec<Option<usize>>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    /// The LM head is the token embedding (no rescaling, unlike Switch).
    pub tie_word_embeddings: bool,
}

impl DecoderSpec {
    /// Validates a Hugging Face config; `path` names the file in errors.
    pub fn from_hf(hf: &HfDecoderConfig, path: &Path) -> Result<Self> {
        let unsupported = |message: String| Error::Unsupported {
            path: path.to_path_buf(),
            message,
        };
        let family = DecoderFamily::from_model_type(&hf.model_type)
            .ok_or_else(|| unsupported(format!("model_type `{}`", hf.model_type)))?;
        if hf.hidden_act != "silu" {
            return Err(unsupported(format!(
                "hidden_act `{}` (only `silu` is implemented)",
                hf.hidden_act
            )));
        }
        let (rope_theta, rope_type) = rope(hf, family, path)?;
        if rope_type != "default" {
            return Err(unsupported(format!(
                "RoPE type `{rope_type}` (only `default` is implemented)"
            )));
        }
        if hf.partial_rotary_factor.is_some_and(|f| f != 1.0) {
            return Err(unsupported(
                "partial_rotary_factor (RoPE on part of each head)".into(),
            ));
        }
        let num_experts = match family {
            DecoderFamily::Mixtral => hf.num_local_experts.unwrap_or(8),
            DecoderFamily::Qwen2Moe => hf.num_experts.unwrap_or(60),
            DecoderFamily::Olmoe => hf.num_experts.unwrap_or(64),
        };
        let top_k = hf.num_experts_per_tok.unwrap_or(match family {
            DecoderFamily::Mixtral => 2,
            DecoderFamily::Qwen2Moe => 4,
            DecoderFamily::Olmoe => 8,
        });
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(match family {
            DecoderFamily::Mixtral => 8,
            _ => hf.num_attention_heads,
        });
        let positive = [
            ("vocab_size", hf.vocab_size),
            ("hidden_size", hf.hidden_size),
            ("intermediate_size", hf.intermediate_size),
            ("num_hidden_layers", hf.num_hidden_layers),
            ("num_attention_heads", hf.num_attention_heads),
            ("num_key_value_heads", num_kv_heads),
            ("num_experts_per_tok", top_k),
            ("max_position_embeddings", hf.max_position_embeddings),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(Error::format(path, format!("`{name}` must be positive")));
            }
        }
        if num_experts == 0 {
            return Err(unsupported("no routed experts (a dense model)".into()));
        }
        if num_experts > u16::MAX as usize {
            return Err(unsupported(format!(
                "{num_experts} experts per layer (at most {})",
                u16::MAX
            )));
        }
        if top_k > num_experts {
            return Err(Error::format(
                path,
                format!("`num_experts_per_tok` {top_k} exceeds the {num_experts} experts"),
            ));
        }
        if !hf.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(Error::format(
                path,
                format!(
                    "`num_attention_heads` {} is not a multiple of `num_key_value_heads` {num_kv_heads}",
                    hf.num_attention_heads
                ),
            ));
        }
        // Mixtral: `head_dim or hidden // heads`; the others: `head_dim` if given.
        let head_dim = hf
            .head_dim
            .filter(|&h| h > 0)
            .unwrap_or(hf.hidden_size / hf.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(Error::format(
                path,
                format!("head dimension {head_dim} must be positive and even (RoPE rotates pairs)"),
            ));
        }
        let layers = hf.num_hidden_layers;
        // Checked before the per-layer lists below are allocated; every other size is checked
        // by `ModelSpec::validate` once the spec is built.
        if layers > MAX_LAYERS {
            return Err(Error::format(
                path,
                format!("`num_hidden_layers` = {layers} (at most {MAX_LAYERS})"),
            ));
        }
        let (moe_layers, expert_intermediate_size, shared) = match family {
            DecoderFamily::Qwen2Moe => {
                let step = hf.decoder_sparse_step.unwrap_or(1);
                let dense = hf.mlp_only_layers.clone().unwrap_or_default();
                let moe: Vec<usize> = (0..layers)
                    .filter(|i| !dense.contains(i) && step > 0 && (i + 1) % step == 0)
                    .collect();
                (
                    moe,
                    hf.moe_intermediate_size.unwrap_or(1408),
                    Some(hf.shared_expert_intermediate_size.unwrap_or(5632)).filter(|&s| s > 0),
                )
            }
            _ => ((0..layers).collect(), hf.intermediate_size, None),
        };
        if expert_intermediate_size == 0 {
            return Err(Error::format(
                path,
                "`moe_intermediate_size` must be positive",
            ));
        }
        if moe_layers.is_empty() {
            return Err(unsupported(
                "no MoE layer (`mlp_only_layers`/`decoder_sparse_step` make every layer dense)"
                    .into(),
            ));
        }
        let attention_windows = windows(hf, family, layers, path)?;
        if family == DecoderFamily::Olmoe
            && hf.num_attention_heads.saturating_mul(head_dim) != hf.hidden_size
        {
            return Err(unsupported(format!(
                "OLMoE with num_attention_heads × head_dim = {} ≠ hidden_size {} (q_norm spans hidden_size)",
                hf.num_attention_heads.saturating_mul(head_dim),
                hf.hidden_size
            )));
        }
        let (qkv_bias, o_bias) = match family {
            DecoderFamily::Mixtral => (false, false),
            DecoderFamily::Qwen2Moe => (hf.qkv_bias.unwrap_or(true), false),
            DecoderFamily::Olmoe => {
                let b = hf.attention_bias.unwrap_or(false);
                (b, b)
            }
        };
        Ok(DecoderSpec {
            family,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            num_layers: layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: hf.intermediate_size,
            expert_intermediate_size,
            num_experts,
            top_k,
            norm_topk_prob: match family {
                DecoderFamily::Mixtral => true,
                _ => hf.norm_topk_prob.unwrap_or(false),
            },
            moe_layers,
            shared_expert_intermediate_size: shared,
            qkv_bias,
            o_bias,
            qk_norm: family == DecoderFamily::Olmoe,
            clip_qkv: if family == DecoderFamily::Olmoe {
                hf.clip_qkv
            } else {
                None
            },
            attention_windows,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(match family {
                DecoderFamily::Qwen2Moe => 1e-6,
                _ => 1e-5,
            }),
            rope_theta,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
        })
    }

    /// Width of the attention's q projection (`num_heads × head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the k and v projections (`num_kv_heads × head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    pub fn is_moe(&self, layer: usize) -> bool {
        self.moe_layers.contains(&layer)
    }
}

/// RoPE base and type: `rope_parameters` (transformers 5.x) or `rope_theta`/`rope_scaling`
/// (4.x), else the family's default base.
fn rope(hf: &HfDecoderConfig, family: DecoderFamily, path: &Path) -> Result<(f64, String)> {
    let default_theta = match family {
        DecoderFamily::Mixtral => 1e6,
        _ => 1e4,
    };
    let bad = |what: &str| Error::format(path, format!("`rope_parameters`: {what}"));
    if let Some(p) = hf.rope_parameters.as_ref().filter(|p| !p.is_null()) {
        let theta = match p.get("rope_theta") {
            None => hf.rope_theta.unwrap_or(default_theta),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| bad("`rope_theta` must be a number"))?,
        };
        let kind = match p.get("rope_type").or_else(|| p.get("type")) {
            None => "default".to_string(),
            Some(v) => v
                .as_str()
                .ok_or_else(|| bad("`rope_type` must be a string"))?
                .to_string(),
        };
        return Ok((theta, kind));
    }
    let kind = match hf.rope_scaling.as_ref().filter(|s| !s.is_null()) {
        None => "default".to_string(),
        Some(s) => s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("scaled")
            .to_string(),
    };
    Ok((hf.rope_theta.unwrap_or(default_theta), kind))
}

/// Each layer's attention window (see [`DecoderSpec::attention_windows`]).
fn windows(
    hf: &HfDecoderConfig,
    family: DecoderFamily,
    layers: usize,
    path: &Path,
) -> Result<Vec<Option<usize>>> {
    match family {
        DecoderFamily::Olmoe => Ok(vec![None; layers]),
        DecoderFamily::Mixtral => Ok(vec![hf.sliding_window.filter(|&w| w > 0); layers]),
        DecoderFamily::Qwen2Moe => {
            let window = if hf.use_sliding_window.unwrap_or(false) {
                hf.sliding_window.filter(|&w| w > 0)
            } else {
                None
            };
            let Some(types) = &hf.layer_types else {
                return Ok(vec![None; layers]);
            };
            if types.len() != layers {
                return Err(Error::format(
                    path,
                    format!(
                        "`layer_types` lists {} layers, `num_hidden_layers` is {layers}",
                        types.len()
                    ),
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(None),
                    "sliding_attention" => Ok(window),
                    other => Err(Error::Unsupported {
                        path: path.to_path_buf(),
                        message: format!("layer type `{other}`"),
                    }),
                })
                .collect()
        }
    }
}

impl DecoderSpec {
    /// The shape as `edgemoe inspect` prints it, one line each.
    pub fn describe(&self) -> Vec<String> {
        vec![
            format!(
                "shape         hidden {}, {} heads ({} key/value) × head_dim {}, vocab {}, RoPE base {}",
                self.hidden_size,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                self.vocab_size,
                self.rope_theta
            ),
            format!(
                "layers        {} layers, MoE at {:?}: {} experts of width {} each, top-{}{}{}",
                self.num_layers,
                self.moe_layers,
                self.num_experts,
                self.expert_intermediate_size,
                self.top_k,
                if self.norm_topk_prob {
                    " (weights renormalised)"
                } else {
                    ""
                },
                match self.shared_expert_intermediate_size {
                    Some(s) => format!(", shared expert of width {s} (resident)"),
                    None => String::new(),
                }
            ),
        ]
    }
}
