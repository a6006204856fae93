//! One session type for every architecture: a bundle opened on a memory budget — its model
//! loaded, its expert store behind the expert buffer (or a baseline mode), its tokenizer — ready
//! to turn text into token ids and run the decoding loop that fits the model's shape.
//!
//! `summarize`, `generate`, `eval`, `calibrate` and the service all hold a [`Session`]; which
//! loop runs (greedy/beam search for encoder-decoders, prefill and streamed generation for
//! decoder-only models) is decided once, by [`Model::run`].

use std::sync::Arc;

use tch::Device;

use crate::bundle::Bundle;
use crate::dictionary::PathDictionary;
use crate::error::{Error, Result};
use crate::model::provider::ExpertProvider;
use crate::model::{DecoderOnlyModel, KvFormat, Model, ModelRun, RunShape, SwitchModel};
use crate::runtime::budget::BudgetPlan;
use crate::runtime::modes::ExpertSource;
pub use crate::runtime::setup::CacheOptions;
use crate::runtime::setup::ExpertRuntime;
use crate::runtime::stats::ExpertStats;
use crate::tokenizer::Tokenizer;

use super::causal::complete;
use super::decoding::{DecodeOptions, Generation};
use super::input::model_input;
use super::seq2seq::generate;

/// Run options that do not come from the bundle.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub budget_bytes: u64,
    /// Longest input in tokens (working memory is sized for it). A longer document keeps its
    /// first tokens (and `</s>`); a longer prompt keeps its last.
    pub max_input_tokens: usize,
    pub decode: DecodeOptions,
    pub cache: CacheOptions,
    /// Where the dense math runs (CPU, or CUDA on a Jetson; decoder-only models run on the CPU).
    pub device: Device,
}

impl SessionOptions {
    /// The bundle's decoding defaults and input length, the default expert cache, on the CPU.
    pub fn defaults(bundle: &Bundle, budget_bytes: u64) -> Self {
        let generation = &bundle.config.generation;
        SessionOptions {
            budget_bytes,
            max_input_tokens: generation.max_source_tokens,
            decode: DecodeOptions::from_defaults(generation),
            cache: CacheOptions::default(),
            device: Device::Cpu,
        }
    }

    fn run_shape(&self) -> RunShape {
        RunShape {
            max_source_tokens: self.max_input_tokens,
            max_new_tokens: self.decode.max_new_tokens,
            beams: self.decode.num_beams,
            kv_cache: self.decode.kv_cache,
        }
    }
}

/// A loaded model with its expert buffer, ready to summarize or generate.
pub struct Session {
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// Where experts come from (the expert buffer in `edgemoe` mode).
    pub buffer: ExpertSource,
    pub plan: BudgetPlan,
    pub options: SessionOptions,
    /// The bundle's activation-path dictionary, if it has been calibrated.
    pub dictionary: Option<Arc<PathDictionary>>,
    /// Things the user should know (e.g. `O_DIRECT` refused by the filesystem).
    pub warnings: Vec<String>,
    prefix: String,
}

impl Session {
    /// Loads `bundle`'s model and sizes the expert buffer from the budget left after its
    /// resident weights and the working memory `options` need.
    pub fn open(bundle: &Bundle, options: SessionOptions) -> Result<Self> {
        let tokenizer = bundle.tokenizer()?;
        let model = bundle.load_model(options.device)?;
        let kv_cache = options.decode.kv_cache;
        if kv_cache != KvFormat::F32 && options.device != Device::Cpu {
            return Err(Error::Input(format!(
                "--kv-cache {kv_cache} holds the cache for the CPU's loops: on {:?} it is f32 (pass --kv-cache f32)",
                options.device
            )));
        }
        let working = model.working_bytes(options.run_shape());
        let ExpertRuntime {
            buffer,
            plan,
            dictionary,
            warnings,
        } = ExpertRuntime::open(
            bundle,
            options.budget_bytes,
            model.resident_bytes(),
            working,
            &options.cache,
        )?;
        Ok(Session {
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

    /// Token ids the model sees for `text`: a document behind the model's input prefix for an
    /// encoder-decoder, a prompt (with the tokenizer's special tokens, e.g. a BOS) for a
    /// decoder-only model, cut to `max_input_tokens`.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let (text, what) = if self.model.has_encoder() {
            (model_input(text, &self.prefix), "document")
        } else {
            (text.to_string(), "prompt")
        };
        let ids = input_ids(
            &self.model,
            &self.tokenizer,
            &text,
            self.options.max_input_tokens,
        )?;
        if ids.is_empty() {
            return Err(Error::Input(format!("the {what} produced no tokens")));
        }
        Ok(ids)
    }

    /// Runs the model on `input_ids`; `on_token` gets every new token (as soon as it is chosen
    /// for a decoder-only model, after the search for an encoder-decoder).
    pub fn run(
        &mut self,
        input_ids: &[i64],
        on_token: &mut dyn FnMut(i64) -> Result<()>,
    ) -> Result<Generation> {
        run_model(
            &self.model,
            &mut self.buffer,
            input_ids,
            &self.options.decode,
            on_token,
        )
    }

    /// Output text, generation record and input length of one document or prompt.
    pub fn summarize(&mut self, text: &str) -> Result<(String, Generation, usize)> {
        let ids = self.encode(text)?;
        let generation = self.run(&ids, &mut |_| Ok(()))?;
        let text = self.tokenizer.decode(&generation.tokens)?;
        Ok((text, generation, ids.len()))
    }

    /// The expert cache's counters so far.
    pub fn stats(&self) -> &ExpertStats {
        self.buffer.stats()
    }
}

/// Token ids for `text` (already in the model's input form), cut to `max` tokens: an
/// encoder's source keeps its first tokens and `</s>`, a decoder-only prompt its last tokens.
pub fn input_ids(model: &Model, tokenizer: &Tokenizer, text: &str, max: usize) -> Result<Vec<i64>> {
    if model.has_encoder() {
        tokenizer.encode(text, max)
    } else {
        tokenizer.encode_last(text, max)
    }
}

/// Runs the decoding loop that fits `model` with experts from `provider`.
pub fn run_model(
    model: &Model,
    provider: &mut dyn ExpertProvider,
    input_ids: &[i64],
    options: &DecodeOptions,
    on_token: &mut dyn FnMut(i64) -> Result<()>,
) -> Result<Generation> {
    struct Loop<'a> {
        provider: &'a mut dyn ExpertProvider,
        input_ids: &'a [i64],
        options: &'a DecodeOptions,
        on_token: &'a mut dyn FnMut(i64) -> Result<()>,
    }
    impl ModelRun for Loop<'_> {
        type Output = Result<Generation>;

        fn encoder_decoder(&mut self, model: &SwitchModel) -> Self::Output {
            let generation = generate(model, self.provider, self.input_ids, self.options)?;
            for &token in &generation.tokens {
                (self.on_token)(token)?;
            }
            Ok(generation)
        }

        fn decoder_only(&mut self, model: &DecoderOnlyModel) -> Self::Output {
            complete(
                model,
                self.provider,
                self.input_ids,
                self.options,
                self.on_token,
            )
        }
    }
    model.run(&mut Loop {
        provider,
        input_ids,
        options,
        on_token,
    })
}
