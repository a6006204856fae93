//! Decoding defaults of a checkpoint (from its `generation_config.json`, with the model
//! config's special tokens as fallbacks), as the bundle stores them.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

use super::hf::{HfGenerationConfig, HfSpecialTokens};

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

    /// Fails naming the field and the file it came from unless every special token id is a
    /// row of the model's `vocab_size`-row embedding: the decoder start (`decoder_start_token_id`,
    /// or `bos_token_id` for a decoder-only model), every EOS and the pad id. A decoder-only
    /// model may have no EOS (`-1`).
    pub fn check_token_ids(
        &self,
        vocab_size: usize,
        decoder_only: bool,
        sources: &TokenIdSources<'_>,
    ) -> Result<()> {
        let start = if decoder_only {
            "bos_token_id"
        } else {
            "decoder_start_token_id"
        };
        let mut ids = vec![
            (start, self.decoder_start_token_id),
            ("pad_token_id", self.pad_token_id),
        ];
        ids.extend(self.stop_token_ids.iter().map(|&id| ("eos_token_id", id)));
        if !(decoder_only && self.stop_token_ids.is_empty()) {
            ids.push(("eos_token_id", self.eos_token_id));
        }
        for (field, id) in ids {
            if id < 0 || id as u64 >= vocab_size as u64 {
                let path = if sources.generation_sets(field) {
                    sources.generation_path
                } else {
                    sources.config_path
                };
                return Err(Error::format(
                    path,
                    format!(
                        "`{field}` {id} is not a token of the model's vocabulary (`vocab_size` {vocab_size})"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Whether `token` ends a generation.
    pub fn is_stop(&self, token: i64) -> bool {
        token == self.eos_token_id || self.stop_token_ids.contains(&token)
    }
}

/// Where a checkpoint's special token ids came from, to name the right file in errors.
pub struct TokenIdSources<'a> {
    pub config_path: &'a Path,
    pub generation_path: &'a Path,
    pub generation: &'a HfGenerationConfig,
}

impl TokenIdSources<'_> {
    /// Whether `generation_config.json` sets `field` (it wins over `config.json`).
    fn generation_sets(&self, field: &str) -> bool {
        let g = self.generation;
        match field {
            "decoder_start_token_id" => g.decoder_start_token_id.is_some(),
            "pad_token_id" => g.pad_token_id.is_some(),
            "eos_token_id" => g.eos_token_id.as_ref().is_some_and(|v| !v.is_null()),
            _ => false,
        }
    }
}
