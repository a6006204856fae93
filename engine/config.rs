//! Model facts. Hugging Face's `config.json` / `generation_config.json` are read into raw serde
//! structs with HF field names, validated once into a [`ModelSpec`] (the engine's own form), and
//! written into the bundle's `config.json` together with the bundle format version.
//!
//! [`ModelSpec`] is one enum over the architectures: [`SwitchSpec`] (encoder-decoder, top-1,
//! ReLU experts; this file) and [`DecoderSpec`] (decoder-only, top-k, SwiGLU experts; see
//! `decoder_config`). Everything outside the model files (expert store, buffer, policies,
//! dictionary, budget) asks the enum only what every MoE model has: its MoE blocks per stack,
//! experts per block, experts per token and the matrices of one expert. Decoder-only models put
//! their MoE layers in [`Stack::Decoder`] and have no encoder.

use std::path::Path;

use serde::{Deserialize, Serialize};

pub use crate::decoder_config::{DecoderFamily, DecoderSpec, HfDecoderConfig};
use crate::error::{Error, Result};
use crate::expert_store::ExpertId;

/// Version of the bundle layout (config, resident weights, expert store). Bumped whenever a
/// bundle written by an older engine can no longer be read.
pub const BUNDLE_FORMAT_VERSION: u32 = 1;

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

    pub fn tie_word_embeddings(&self) -> bool {
        match self {
            ModelSpec::Switch(s) => s.tie_word_embeddings,
            ModelSpec::DecoderOnly(d) => d.tie_word_embeddings,
        }
    }
}

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

/// How the engine decodes by default (from the checkpoint's generation config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationDefaults {
    pub decoder_start_token_id: i64,
    pub eos_token_id: i64,
    pub pad_token_id: i64,
    pub max_new_tokens: usize,
    pub num_beams: usize,
    pub length_penalty: f64,
    /// HF's `early_stopping`: `true`, `false` or `"never"`.
    pub early_stopping: EarlyStopping,
    pub no_repeat_ngram_size: usize,
    /// Longest source the engine feeds the encoder (longer inputs are truncated, keeping `</s>`).
    pub max_source_tokens: usize,
    /// Text put before every document, as the model was trained (`"summarize: "` for T5/Switch).
    pub input_prefix: String,
    /// Every token that ends a generation (decoder-only checkpoints often list several EOS ids);
    /// `eos_token_id` is the first.
    #[serde(default)]
    pub stop_token_ids: Vec<i64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EarlyStopping {
    True,
    False,
    Never,
}

/// The bundle's own `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BundleConfig {
    pub format_version: u32,
    pub architecture: String,
    pub model: ModelSpec,
    pub generation: GenerationDefaults,
    /// dtype of the source checkpoint's weights (`f32`, `f16`, `bf16`).
    pub source_dtype: String,
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

impl GenerationDefaults {
    /// Defaults from the generation config, falling back on the model config's `model` ids.
    /// Encoder-decoder specifics (`input_prefix`, `max_source_tokens`) get Switch's values; see
    /// [`GenerationDefaults::for_decoder_only`].
    pub fn from_hf(
        model: &HfSpecialTokens,
        generation: &HfGenerationConfig,
        path: &Path,
    ) -> Result<Self> {
        let ids = |value: &serde_json::Value| -> Result<Vec<i64>> {
            let bad = || {
                Error::format(
                    path,
                    format!("`eos_token_id` must be a number or a list of numbers, got {value}"),
                )
            };
            match value {
                serde_json::Value::Number(n) => Ok(vec![n.as_i64().ok_or_else(bad)?]),
                serde_json::Value::Array(items) => {
                    items.iter().map(|v| v.as_i64().ok_or_else(bad)).collect()
                }
                serde_json::Value::Null => Ok(Vec::new()),
                _ => Err(bad()),
            }
        };
        // A list of stop tokens: every one ends a generation; the first is "the" EOS.
        let stop_token_ids = match (&generation.eos_token_id, &model.eos_token_id) {
            (Some(v), _) if !v.is_null() => ids(v)?,
            (_, Some(v)) => ids(v)?,
            _ => Vec::new(),
        };
        let eos = stop_token_ids.first().copied();
        let early_stopping = match &generation.early_stopping {
            None | Some(serde_json::Value::Bool(false)) => EarlyStopping::False,
            Some(serde_json::Value::Bool(true)) => EarlyStopping::True,
            Some(serde_json::Value::String(s)) if s == "never" => EarlyStopping::Never,
            Some(other) => {
                return Err(Error::format(
                    path,
                    format!("`early_stopping` must be true, false or \"never\", got {other}"),
                ))
            }
        };
        Ok(GenerationDefaults {
            decoder_start_token_id: generation
                .decoder_start_token_id
                .or(model.decoder_start_token_id)
                .unwrap_or(0),
            eos_token_id: eos.unwrap_or(1),
            pad_token_id: generation.pad_token_id.or(model.pad_token_id).unwrap_or(0),
            // HF's default `max_length` is 20 tokens including the start token.
            max_new_tokens: generation.max_new_tokens.unwrap_or(19),
            num_beams: generation.num_beams.unwrap_or(1).max(1),
            length_penalty: generation.length_penalty.unwrap_or(1.0),
            early_stopping,
            no_repeat_ngram_size: generation.no_repeat_ngram_size.unwrap_or(0),
            max_source_tokens: 512,
            input_prefix: "summarize: ".into(),
            stop_token_ids,
        })
    }

    /// Adjusts Switch-shaped defaults to a decoder-only model: no input prefix, prompts up to
    /// the context length, the BOS as "start" token, and no EOS at all when neither config
    /// names one (generation then runs to `max_new_tokens`).
    pub fn for_decoder_only(mut self, model: &HfSpecialTokens, max_positions: usize) -> Self {
        self.input_prefix = String::new();
        self.max_source_tokens = max_positions;
        self.decoder_start_token_id = model.bos_token_id.unwrap_or(0);
        if self.stop_token_ids.is_empty() {
            self.eos_token_id = -1;
        }
        self
    }

    /// Whether `token` ends a generation.
    pub fn is_stop(&self, token: i64) -> bool {
        token == self.eos_token_id || self.stop_token_ids.contains(&token)
    }
}

/// The two stacks of an encoder-decoder model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Stack {
    Encoder,
    Decoder,
}

impl Stack {
    pub fn hf_prefix(self) -> &'static str {
        match self {
            Stack::Encoder => "encoder",
            Stack::Decoder => "decoder",
        }
    }

    /// Index of the FF sub-layer inside an HF block (`layer.1` in the encoder, `layer.2` in the
    /// decoder, after the cross-attention).
    pub fn ff_sublayer(self) -> usize {
        match self {
            Stack::Encoder => 1,
            Stack::Decoder => 2,
        }
    }
}

/// Reads and parses a JSON file, naming the file in every error.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::format(path, format!("invalid JSON: {e}")))
}

impl BundleConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let value: serde_json::Value = read_json(path)?;
        let version = value.get("format_version").and_then(|v| v.as_u64());
        match version {
            Some(v) if v == BUNDLE_FORMAT_VERSION as u64 => {}
            Some(v) => {
                return Err(Error::format(
                    path,
                    format!("bundle format version {v}, this engine reads version {BUNDLE_FORMAT_VERSION}; convert the model again"),
                ))
            }
            None => {
                return Err(Error::format(
                    path,
                    "no `format_version`: not an edgemoe bundle config (did you pass a Hugging Face directory? use `edgemoe convert`)",
                ))
            }
        }
        // Everything but `model`, whose form depends on `architecture`.
        #[derive(Deserialize)]
        struct Header {
            format_version: u32,
            architecture: String,
            generation: GenerationDefaults,
            source_dtype: String,
        }
        let invalid =
            |e: serde_json::Error| Error::format(path, format!("invalid bundle config: {e}"));
        let model = value.get("model").cloned().unwrap_or_default();
        let header: Header = serde_json::from_value(value).map_err(invalid)?;
        let model = if header.architecture == ARCHITECTURE_SWITCH {
            ModelSpec::Switch(serde_json::from_value(model).map_err(invalid)?)
        } else if DecoderFamily::from_model_type(&header.architecture).is_some() {
            let spec: DecoderSpec = serde_json::from_value(model).map_err(invalid)?;
            if spec.family.model_type() != header.architecture {
                return Err(Error::format(
                    path,
                    format!(
                        "architecture `{}` but the model is `{}`",
                        header.architecture,
                        spec.family.model_type()
                    ),
                ));
            }
            ModelSpec::DecoderOnly(spec)
        } else {
            return Err(Error::Unsupported {
                path: path.to_path_buf(),
                message: format!("architecture `{}`", header.architecture),
            });
        };
        Ok(BundleConfig {
            format_version: header.format_version,
            architecture: header.architecture,
            model,
            generation: header.generation,
            source_dtype: header.source_dtype,
        })
    }
}
