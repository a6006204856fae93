//! Switch Transformers: its Hugging Face `config.json` validated into a [`SwitchSpec`].

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::Stack;

use super::hf::HfSwitchConfig;
use super::spec::MAX_LAYERS;

/// The validated shape and semantics of a Switch Transformers model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwitchSpec {
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_heads: usize,
    pub num_encoder_layers: usize,
    pub num_decoder_layers: usize,
    pub encoder_sparse_step: usize,
    pub decoder_sparse_step: usize,
    pub num_experts: usize,
    /// Tokens one expert takes per sequence in one forward call; later ones get no FF output.
    pub expert_capacity: usize,
    pub router_bias: bool,
    pub relative_attention_num_buckets: usize,
    pub relative_attention_max_distance: usize,
    pub layer_norm_epsilon: f64,
    pub tie_word_embeddings: bool,
    /// The encoder has its own `encoder.embed_tokens.weight` (untied checkpoints of
    /// transformers 5.x); otherwise it embeds with `shared.weight`.
    #[serde(default)]
    pub separate_encoder_embeddings: bool,
    /// Same for the decoder (`decoder.embed_tokens.weight`).
    #[serde(default)]
    pub separate_decoder_embeddings: bool,
}

pub const ARCHITECTURE_SWITCH: &str = "switch_transformers";

impl SwitchSpec {
    /// Validates a Hugging Face config; `path` names the file in errors.
    pub fn from_hf(hf: &HfSwitchConfig, path: &Path) -> Result<Self> {
        let unsupported = |message: String| Error::Unsupported {
            path: path.to_path_buf(),
            message,
        };
        match hf.model_type.as_deref() {
            Some(ARCHITECTURE_SWITCH) => {}
            Some(other) => {
                return Err(unsupported(format!(
                    "model_type `{other}` (this engine converts `{ARCHITECTURE_SWITCH}`)"
                )))
            }
            None => return Err(unsupported("config has no `model_type`".into())),
        }
        if hf.dense_act_fn != "relu" {
            return Err(unsupported(format!(
                "dense_act_fn `{}` (only `relu` is implemented)",
                hf.dense_act_fn
            )));
        }
        if hf.router_dtype != "float32" {
            return Err(unsupported(format!(
                "router_dtype `{}` (only `float32` is implemented)",
                hf.router_dtype
            )));
        }
        let positive = [
            ("vocab_size", hf.vocab_size),
            ("d_model", hf.d_model),
            ("d_kv", hf.d_kv),
            ("d_ff", hf.d_ff),
            ("num_heads", hf.num_heads),
            ("num_layers", hf.num_layers),
            ("num_experts", hf.num_experts),
            ("expert_capacity", hf.expert_capacity),
            (
                "relative_attention_num_buckets",
                hf.relative_attention_num_buckets,
            ),
            (
                "relative_attention_max_distance",
                hf.relative_attention_max_distance,
            ),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(Error::format(path, format!("`{name}` must be positive")));
            }
        }
        // Bounded here under the checkpoint's field names; `ModelSpec::validate` checks them
        // again with every other size.
        let stacks = [
            ("num_layers", hf.num_layers),
            ("num_decoder_layers", hf.num_decoder_layers.unwrap_or(0)),
        ];
        for (name, value) in stacks {
            if value > MAX_LAYERS {
                return Err(Error::format(
                    path,
                    format!("`{name}` = {value} (at most {MAX_LAYERS})"),
                ));
            }
        }
        if hf.num_decoder_layers == Some(0) {
            return Err(Error::format(path, "`num_decoder_layers` must be positive"));
        }
        if hf.encoder_sparse_step == 0 && hf.decoder_sparse_step == 0 {
            return Err(unsupported(
                "`encoder_sparse_step` and `decoder_sparse_step` are both 0: no MoE block (a dense model)".into(),
            ));
        }
        if hf.num_experts > u16::MAX as usize {
            return Err(unsupported(format!(
                "{} experts per layer (at most {})",
                hf.num_experts,
                u16::MAX
            )));
        }
        if hf.relative_attention_num_buckets < 4 {
            return Err(Error::format(
                path,
                "`relative_attention_num_buckets` must be at least 4",
            ));
        }
        Ok(SwitchSpec {
            vocab_size: hf.vocab_size,
            d_model: hf.d_model,
            d_kv: hf.d_kv,
            d_ff: hf.d_ff,
            num_heads: hf.num_heads,
            num_encoder_layers: hf.num_layers,
            num_decoder_layers: hf.num_decoder_layers.unwrap_or(hf.num_layers),
            encoder_sparse_step: hf.encoder_sparse_step,
            decoder_sparse_step: hf.decoder_sparse_step,
            num_experts: hf.num_experts,
            expert_capacity: hf.expert_capacity,
            router_bias: hf.router_bias,
            relative_attention_num_buckets: hf.relative_attention_num_buckets,
            relative_attention_max_distance: hf.relative_attention_max_distance,
            layer_norm_epsilon: hf.layer_norm_epsilon,
            tie_word_embeddings: hf.tie_word_embeddings,
            separate_encoder_embeddings: false,
            separate_decoder_embeddings: false,
        })
    }

    /// Whether block `block` of a stack is an MoE block, as `SwitchTransformersStack` decides:
    /// `i % sparse_step == 1 or sparse_step == 1` (and no MoE block when `sparse_step` is 0).
    pub fn is_sparse(&self, stack: Stack, block: usize) -> bool {
        let step = match stack {
            Stack::Encoder => self.encoder_sparse_step,
            Stack::Decoder => self.decoder_sparse_step,
        };
        step > 0 && (step == 1 || block % step == 1)
    }

    pub fn num_layers(&self, stack: Stack) -> usize {
        match stack {
            Stack::Encoder => self.num_encoder_layers,
            Stack::Decoder => self.num_decoder_layers,
        }
    }

    /// Block indices of a stack's MoE layers, in execution order.
    pub fn moe_blocks(&self, stack: Stack) -> Vec<usize> {
        (0..self.num_layers(stack))
            .filter(|&b| self.is_sparse(stack, b))
            .collect()
    }

    /// Width of the attention projections (`num_heads × d_kv`).
    pub fn inner_dim(&self) -> usize {
        self.num_heads * self.d_kv
    }

    pub fn separate_embeddings(&self, stack: Stack) -> bool {
        match stack {
            Stack::Encoder => self.separate_encoder_embeddings,
            Stack::Decoder => self.separate_decoder_embeddings,
        }
    }
}

impl SwitchSpec {
    /// The shape as `edgemoe inspect` prints it, one line each.
    pub fn describe(&self) -> Vec<String> {
        let mut lines = vec![format!(
            "shape         d_model {}, d_ff {}, {} heads × d_kv {}, vocab {}",
            self.d_model, self.d_ff, self.num_heads, self.d_kv, self.vocab_size
        )];
        for stack in [Stack::Encoder, Stack::Decoder] {
            lines.push(format!(
                "{:<13} {} blocks, MoE at blocks {:?} ({} experts each, capacity {})",
                stack.hf_prefix(),
                self.num_layers(stack),
                self.moe_blocks(stack),
                self.num_experts,
                self.expert_capacity
            ));
        }
        lines
    }
}
