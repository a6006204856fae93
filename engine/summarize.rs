//! Summarizing documents with a bundle on a memory budget: reading the input (one document, or
//! JSON lines with a `dialogue`/`document` field), sizing the expert buffer from the budget, and
//! running generation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::budget::{working_bytes, BudgetPlan, RunShape};
use crate::bundle::Bundle;
use crate::cache::Policy;
use crate::error::{Error, Result};
use crate::expert_store::{ExpertStore, ReadPacer, StorageMode};
use crate::generate::{generate, DecodeOptions, Generation};
use crate::model::SwitchModel;
use crate::modes::{DemandLoader, ExpertSource, MappedExperts, Mode};
use crate::paths::{PathDictionary, PATHS_FILE};
use crate::provider::{BufferOptions, ExpertBuffer, ExpertProvider};
use crate::resident_experts::ResidentExperts;
use crate::tokenizer::Tokenizer;

/// Splits user input into documents. Input whose first non-empty line starts with `{` is read as
/// JSON lines, one document per line from its `dialogue` or `document` field; anything else is
/// one document. `source` names the input in errors. Only an input with no text at all is an
/// error; an empty `dialogue` inside JSON lines is summarized like any other.
pub fn parse_documents(text: &str, source: &str) -> Result<Vec<String>> {
    let first = text.lines().find(|l| !l.trim().is_empty());
    let Some(first) = first else {
        return Err(Error::Input(format!(
            "empty input: {source} has no text to summarize"
        )));
    };
    if !first.trim_start().starts_with('{') {
        return Ok(vec![text.to_string()]);
    }
    let mut documents = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            Error::Input(format!("{source} line {}: invalid JSON: {e}", number + 1))
        })?;
        let doc = ["dialogue", "document"]
            .iter()
            .find_map(|key| value.get(key).and_then(|v| v.as_str()))
            .ok_or_else(|| {
                Error::Input(format!(
                    "{source} line {}: no string field `dialogue` or `document`",
                    number + 1
                ))
            })?;
        // An empty document still gets its (one-line) summary, so outputs stay line-aligned.
        documents.push(doc.to_string());
    }
    Ok(documents)
}

/// The model's input text: `prefix` + the document with its line breaks turned into spaces (as
/// the demo model was trained on SAMSum dialogues).
pub fn model_input(document: &str, prefix: &str) -> String {
    let flat = document.replace("\r\n", " ").replace(['\n', '\r'], " ");
    format!("{prefix}{flat}")
}

/// Run options that do not come from the bundle.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub budget_bytes: u64,
    pub decode: DecodeOptions,
    pub max_source_tokens: usize,
    pub cache: CacheOptions,
    /// Where the dense math runs (CPU, or CUDA on a Jetson).
    pub device: tch::Device,
}

/// How the expert buffer behaves.
#[derive(Debug, Clone)]
pub struct CacheOptions {
    pub policy: Policy,
    pub prefetch: bool,
    /// Speculative bytes per forward call; `None` = two experts per decoder MoE layer.
    pub prefetch_cap_bytes: Option<u64>,
    /// Slots instead of "as many as the budget allows" (still checked against the budget).
    pub buffer_experts: Option<usize>,
    /// Record every expert access into this file.
    pub trace: Option<PathBuf>,
    pub storage: StorageMode,
    /// Emulated device for `StorageMode::Emulate`: bytes per second and per-read latency.
    pub emulated_device: Option<(f64, std::time::Duration)>,
    pub mode: Mode,
    /// Bundle whose (quantized) expert store the quantized modes use (`io-qexp`, `q`, `q+p`,
    /// `q+p+c`); same model, other widths.
    pub quantized_bundle: Option<PathBuf>,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            policy: Policy::Edgemoe,
            prefetch: true,
            prefetch_cap_bytes: None,
            buffer_experts: None,
            trace: None,
            storage: StorageMode::Cached,
            emulated_device: None,
            mode: Mode::Edgemoe,
            quantized_bundle: None,
        }
    }
}

/// A loaded model with its expert buffer, ready to summarize.
pub struct Summarizer {
    pub model: SwitchModel,
    pub tokenizer: Tokenizer,
    /// Where experts come from (the expert buffer in `edgemoe` mode).
    pub buffer: ExpertSource,
    pub plan: BudgetPlan,
    pub options: RunOptions,
    /// The bundle's activation-path dictionary, if it has been calibrated.
    pub dictionary: Option<Arc<PathDictionary>>,
    /// Things the user should know (e.g. `O_DIRECT` refused by the filesystem).
    pub warnings: Vec<String>,
    prefix: String,
}

impl Summarizer {
    pub fn open(bundle_dir: &Path, options: RunOptions) -> Result<Self> {
        let bundle = Bundle::open(bundle_dir)?;
        let spec = bundle.config.model.clone();
        let mode = options.cache.mode;
        let store_bundle = match (&options.cache.quantized_bundle, mode.uses_quantized_store()) {
            (Some(q), true) => {
                let other = Bundle::open(q)?;
                if other.config.model != spec {
                    return Err(Error::Input(format!(
                        "{}: the quantized bundle is not the same model as {}",
                        q.display(),
                        bundle_dir.display()
                    )));
                }
                other
            }
            (None, true) => {
                return Err(Error::Input(format!(
                    "mode `{mode}` needs a quantized bundle of the same model (--quantized BUNDLE)"
                )))
            }
            _ => Bundle::open(bundle_dir)?,
        };
        let storage = match (mode, options.cache.storage) {
            // The page cache is what mmap is about.
            (Mode::Mmap, _) => StorageMode::Cached,
            (_, s) => s,
        };
        let (mut store, warning) = ExpertStore::open_with(
            &store_bundle.path(crate::bundle::EXPERTS_FILE),
            &spec,
            storage,
        )?;
        let pacer = match (options.cache.storage, options.cache.emulated_device) {
            (StorageMode::Emulate, Some((bw, latency))) => Some(ReadPacer::new(bw, latency)),
            (StorageMode::Emulate, None) => {
                return Err(Error::Input(
                    "--storage emulate needs a device profile (--profile NAME)".into(),
                ))
            }
            _ => None,
        };
        let tokenizer = bundle.tokenizer()?;
        let model = bundle.load_model_on(options.device)?;
        let working = working_bytes(
            &spec,
            RunShape {
                max_source_tokens: options.max_source_tokens,
                max_new_tokens: options.decode.max_new_tokens,
                beams: options.decode.num_beams,
            },
        );
        let slot_bytes = store.max_padded_expert_bytes();
        let mut plan = BudgetPlan::new(
            options.budget_bytes,
            model.resident_bytes(),
            working,
            slot_bytes,
            store.index().experts.len(),
            options.cache.buffer_experts,
        )?;
        let paths = bundle.path(PATHS_FILE);
        let dictionary = if paths.exists() {
            Some(Arc::new(PathDictionary::load(&paths)?))
        } else {
            None
        };
        let decoder_moe_layers = spec.moe_blocks(crate::config::Stack::Decoder).len() as u64;
        let buffered = |slots: usize, prefetch: bool, store: ExpertStore| {
            ExpertBuffer::with_options(
                store,
                &spec,
                &BufferOptions {
                    slots,
                    policy: options.cache.policy,
                    prefetch,
                    prefetch_cap_bytes: options
                        .cache
                        .prefetch_cap_bytes
                        .unwrap_or(2 * decoder_moe_layers.max(1) * slot_bytes),
                },
                dictionary.clone(),
            )
            .map(|b| ExpertSource::Buffer(Box::new(b)))
        };
        if mode != Mode::Mmap {
            store.set_pacer(pacer.clone());
        }
        let mut buffer = match mode {
            Mode::Edgemoe | Mode::QPC => buffered(plan.slots, options.cache.prefetch, store)?,
            Mode::QP => {
                plan.slots = 2;
                buffered(2, true, store)?
            }
            Mode::IoExp | Mode::IoQexp | Mode::Q => {
                plan.slots = 1;
                ExpertSource::Demand(DemandLoader::new(store, &spec))
            }
            Mode::Mmap => {
                plan.slots = 0;
                ExpertSource::Mapped(MappedExperts::new(store, &spec, pacer)?)
            }
            Mode::IoFree => {
                let resident = ResidentExperts::load(&store, &[])?;
                plan.slots = 0;
                plan.resident_bytes += resident.bytes();
                ExpertSource::Resident(resident)
            }
        };
        if let Some(trace) = &options.cache.trace {
            buffer.record_trace(trace)?;
        }
        Ok(Summarizer {
            model,
            tokenizer,
            buffer,
            plan,
            options,
            dictionary,
            warnings: warning.into_iter().collect(),
            prefix: bundle.config.generation.input_prefix.clone(),
        })
    }

    /// Token ids the encoder sees for `document`.
    pub fn encode_document(&self, document: &str) -> Result<Vec<i64>> {
        let ids = self.tokenizer.encode(
            &model_input(document, &self.prefix),
            self.options.max_source_tokens,
        )?;
        if ids.is_empty() {
            return Err(Error::Input("the document produced no tokens".into()));
        }
        Ok(ids)
    }

    pub fn generate_ids(&mut self, input_ids: &[i64]) -> Result<Generation> {
        generate(
            &self.model,
            &mut self.buffer as &mut dyn ExpertProvider,
            input_ids,
            &self.options.decode,
        )
    }

    /// Summary text, generation record and source length of one document.
    pub fn summarize(&mut self, document: &str) -> Result<(String, Generation, usize)> {
        let ids = self.encode_document(document)?;
        let generation = self.generate_ids(&ids)?;
        let text = self.tokenizer.decode(&generation.tokens)?;
        Ok((text, generation, ids.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_text_is_one_document() {
        let docs = parse_documents("Anna: hi\nBob: hello\n", "stdin").unwrap();
        assert_eq!(docs, vec!["Anna: hi\nBob: hello\n".to_string()]);
    }

    #[test]
    fn json_lines_take_dialogue_or_document() {
        let text = "{\"dialogue\": \"a\"}\n\n{\"document\": \"b\", \"id\": 3}\n";
        assert_eq!(parse_documents(text, "f").unwrap(), vec!["a", "b"]);
    }

    #[test]
    fn bad_inputs_are_named() {
        let empty = parse_documents("  \n", "in.txt").unwrap_err().to_string();
        assert!(
            empty.contains("empty input") && empty.contains("in.txt"),
            "{empty}"
        );
        let missing = parse_documents("{\"text\": \"a\"}", "f")
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("line 1") && missing.contains("dialogue"),
            "{missing}"
        );
        let broken = parse_documents("{\"dialogue\": ", "f")
            .unwrap_err()
            .to_string();
        assert!(broken.contains("invalid JSON"), "{broken}");
    }

    #[test]
    fn line_breaks_become_spaces() {
        assert_eq!(
            model_input("A: x\r\nB: y\nC", "summarize: "),
            "summarize: A: x B: y C"
        );
    }
}
