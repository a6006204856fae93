//! Raw Hugging Face configs, field for field as transformers writes them: a Switch
//! Transformers or decoder-only `config.json` and a `generation_config.json`. Nothing here is
//! validated; [`super::switch`] and [`super::decoder`] turn them into the engine's spec.

use serde::Deserialize;

/// `config.json` of a Hugging Face Switch Transformers checkpoint (the fields the engine reads).
#[derive(Debug, Clone, Deserialize)]
pub struct HfSwitchConfig {
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub d_model: usize,
    pub d_kv: usize,
    pub d_ff: usize,
    pub num_heads: usize,
    pub num_layers: usize,
    pub num_decoder_layers: Option<usize>,
    #[serde(default = "default_sparse_step")]
    pub encoder_sparse_step: usize,
    #[serde(default = "default_sparse_step")]
    pub decoder_sparse_step: usize,
    pub num_experts: usize,
    #[serde(default = "default_expert_capacity")]
    pub expert_capacity: usize,
    #[serde(default)]
    pub router_bias: bool,
    #[serde(default = "default_router_dtype")]
    pub router_dtype: String,
    #[serde(default = "default_num_buckets")]
    pub relative_attention_num_buckets: usize,
    #[serde(default = "default_max_distance")]
    pub relative_attention_max_distance: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    #[serde(default = "default_act")]
    pub dense_act_fn: String,
    #[serde(default = "default_true")]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub decoder_start_token_id: Option<i64>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub pad_token_id: Option<i64>,
}

impl HfSwitchConfig {
    pub fn special_tokens(&self) -> HfSpecialTokens {
        HfSpecialTokens {
            decoder_start_token_id: self.decoder_start_token_id,
            bos_token_id: None,
            eos_token_id: self.eos_token_id.clone(),
            pad_token_id: self.pad_token_id,
        }
    }
}

/// The special token ids a model's `config.json` may give (fallbacks for the generation config).
#[derive(Debug, Clone, Default)]
pub struct HfSpecialTokens {
    pub decoder_start_token_id: Option<i64>,
    pub bos_token_id: Option<i64>,
    pub eos_token_id: Option<serde_json::Value>,
    pub pad_token_id: Option<i64>,
}

fn default_sparse_step() -> usize {
    3
}
fn default_expert_capacity() -> usize {
    64
}
fn default_router_dtype() -> String {
    "float32".into()
}
fn default_num_buckets() -> usize {
    32
}
fn default_max_distance() -> usize {
    128
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "relu".into()
}
fn default_true() -> bool {
    true
}

/// `generation_config.json` (HF decoding defaults for the checkpoint).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HfGenerationConfig {
    pub max_new_tokens: Option<usize>,
    pub num_beams: Option<usize>,
    pub length_penalty: Option<f64>,
    pub early_stopping: Option<serde_json::Value>,
    pub no_repeat_ngram_size: Option<usize>,
    pub decoder_start_token_id: Option<i64>,
    pub eos_token_id: Option<serde_json::Value>,
    pub pad_token_id: Option<i64>,
}

/// `config.json` of a Mixtral, Qwen2-MoE or OLMoE checkpoint (the fields the engine reads; the
/// families' defaults where a field may be absent).
#[derive(Debug, Clone, Deserialize)]
pub struct HfDecoderConfig {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_decoder_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub rms_norm_eps: Option<f64>,
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
    /// transformers 4.x: RoPE base and scaling at the top level.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Mixtral: routed experts per layer.
    #[serde(default)]
    pub num_local_experts: Option<usize>,
    /// Qwen2-MoE, OLMoE: routed experts per layer.
    #[serde(default)]
    pub num_experts: Option<usize>,
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    #[serde(default)]
    pub router_jitter_noise: Option<f64>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    // Qwen2-MoE
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    #[serde(default)]
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    pub qkv_bias: Option<bool>,
    // OLMoE
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub clip_qkv: Option<f64>,
    #[serde(default)]
    pub bos_token_id: Option<i64>,
    #[serde(default)]
    pub eos_token_id: Option<serde_json::Value>,
    #[serde(default)]
    pub pad_token_id: Option<i64>,
}

fn default_decoder_act() -> String {
    "silu".into()
}
fn default_max_positions() -> usize {
    4096
}

impl HfDecoderConfig {
    pub fn special_tokens(&self) -> HfSpecialTokens {
        HfSpecialTokens {
            decoder_start_token_id: None,
            bos_token_id: self.bos_token_id,
            eos_token_id: self.eos_token_id.clone(),
            pad_token_id: self.pad_token_id,
        }
    }
}
