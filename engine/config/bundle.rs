//! The bundle's own `config.json`: format version, architecture, [`ModelSpec`], generation
//! defaults and source dtype.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::io::read_text;

use super::decoder::{DecoderFamily, DecoderSpec};
use super::generation::GenerationDefaults;
use super::spec::ModelSpec;
use super::switch::ARCHITECTURE_SWITCH;

/// Version of the bundle layout (config, resident weights, expert store). Bumped whenever a
/// bundle written by an older engine can no longer be read.
pub const BUNDLE_FORMAT_VERSION: u32 = 1;

/// The bundle's own `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BundleConfig {
    pub format_version: u32,
    pub architecture: String,
    pub model: ModelSpec,
    pub generation: GenerationDefaults,
    /// dtype of the source checkpoint's weights (`f32`, `f16`, `bf16`).
    pub source_dtype: String,
    /// Width of the resident (non-expert) matrices: `f32`, `f16`, `bf16` or `int8`
    /// (`convert --resident`); vectors (norms, biases) are always f32.
    #[serde(default = "f32_name")]
    pub resident_width: String,
}

fn f32_name() -> String {
    "f32".into()
}

impl BundleConfig {
    pub fn load(path: &Path) -> Result<Self> {
        Self::parse(path, &read_text(path)?)
    }

    /// The config in `text`, read from `path` (named in errors).
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::format(path, format!("invalid JSON: {e}")))?;
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
            #[serde(default = "f32_name")]
            resident_width: String,
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
        model.validate(path)?;
        Ok(BundleConfig {
            format_version: header.format_version,
            architecture: header.architecture,
            model,
            generation: header.generation,
            source_dtype: header.source_dtype,
            resident_width: header.resident_width,
        })
    }
}

impl BundleConfig {
    /// The decoding defaults as `edgemoe inspect` prints them.
    pub fn describe_generation(&self) -> String {
        let g = &self.generation;
        match self.model {
            ModelSpec::Switch(_) => format!(
                "generation    {} beams, max {} new tokens, length penalty {}, no-repeat n-gram {}, prefix {:?}",
                g.num_beams, g.max_new_tokens, g.length_penalty, g.no_repeat_ngram_size, g.input_prefix
            ),
            ModelSpec::DecoderOnly(_) => format!(
                "generation    greedy (or --temperature/--top-p), max {} new tokens, stops at {:?}",
                g.max_new_tokens, g.stop_token_ids
            ),
        }
    }
}
