//! What one decoding call is asked ([`DecodeOptions`], defaults from the bundle's generation
//! config) and what it gives back ([`Generation`]), whatever the model's shape.

use crate::config::{EarlyStopping, GenerationDefaults};
use crate::model::LayerRoute;

use super::sampling::Sampling;

/// Knobs of one generation call (defaults come from the bundle's generation config).
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    pub max_new_tokens: usize,
    pub num_beams: usize,
    pub length_penalty: f64,
    pub early_stopping: EarlyStopping,
    pub no_repeat_ngram_size: usize,
    pub decoder_start_token_id: i64,
    pub eos_token_id: i64,
    /// How a decoder-only model picks the next token (encoder-decoders search greedily or
    /// with beams, as `num_beams` says).
    pub sampling: Sampling,
    /// Tokens that end a decoder-only generation (kept in the output).
    pub stop_token_ids: Vec<i64>,
}

impl DecodeOptions {
    pub fn from_defaults(g: &GenerationDefaults) -> Self {
        DecodeOptions {
            max_new_tokens: g.max_new_tokens,
            num_beams: g.num_beams,
            length_penalty: g.length_penalty,
            early_stopping: g.early_stopping,
            no_repeat_ngram_size: g.no_repeat_ngram_size,
            decoder_start_token_id: g.decoder_start_token_id,
            eos_token_id: g.eos_token_id,
            sampling: Sampling::Greedy,
            stop_token_ids: g.stop_token_ids.clone(),
        }
    }
}

/// What one generation produced and how long it took.
#[derive(Debug, Clone, Default)]
pub struct Generation {
    /// Generated ids, without the decoder start token; ends with EOS if the model emitted it.
    pub tokens: Vec<i64>,
    /// The encoder pass (Switch) or the prompt's prefill (decoder-only).
    pub encode_ms: f64,
    /// Wall time of each decoder step (one step = one new token for every beam).
    pub step_ms: Vec<f64>,
    /// Router decisions of every MoE layer, in execution order (encoder call, then each step).
    pub routes: Vec<LayerRoute>,
}
