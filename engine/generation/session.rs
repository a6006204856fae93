//! Summarizing documents with a bundle on a memory budget: reading the input (one document, or
//! JSON lines with a `dialogue`/`document` field), sizing the expert buffer from the budget, and
//! running generation.

use std::path::Path;
use std::sync::Arc;

use crate::bundle::Bundle;
use crate::dictionary::PathDictionary;
use crate::error::{Error, Result};
use crate::generation::seq2seq::{generate, DecodeOptions, Generation};
use crate::model::provider::ExpertProvider;
use crate::model::SwitchModel;
use crate::runtime::budget::{working_bytes, BudgetPlan, RunShape};
use crate::runtime::modes::ExpertSource;
pub use crate::runtime::setup::CacheOptions;
use crate::runtime::setup::ExpertRuntime;
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
        let ExpertRuntime {
            buffer,
            plan,
            dictionary,
            warnings,
        } = ExpertRuntime::open(
            &bundle,
            options.budget_bytes,
            model.resident_bytes(),
            working,
            &options.cache,
        )?;
        Ok(Summarizer {
            model,
            tokenizer,
            buffer,
            plan,
            options,
            dictionary,
            warnings,
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
