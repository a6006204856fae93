//! Text generation with decoder-only models (`edgemoe generate`): the prompt is prefilled in one
//! forward call (its tokens grouped by expert at every MoE layer, so each chosen expert is read
//! once per layer), then one token per step; every new token goes to a callback as soon as it
//! exists, so the CLI streams text while the model runs.
//!
//! Decisions:
//! - Greedy by default, as HF `generate(do_sample=False)`: libtorch's argmax of the f32 logits
//!   (ties break as in PyTorch). `generation_config.json`'s sampling flags are not applied:
//!   sampling is asked for on the command line.
//! - Sampling: HF's `TemperatureLogitsWarper` then `TopPLogitsWarper` (drop the least probable
//!   tokens whose cumulative mass is at most `1 − top_p`, keep at least one), then a draw from
//!   the renormalised distribution with the engine's own SplitMix64 generator seeded by
//!   `--seed`: a seed reproduces a run on any machine, not PyTorch's sampled tokens.
//! - Stops after `max_new_tokens` or at any of the checkpoint's EOS ids (kept in the output).
//! - The record is a [`Generation`] like summarization's (`encode_ms` = the prefill), so run
//!   statistics, traces and calibration treat both architectures alike.

use std::time::Instant;

use crate::error::{Error, Result};
use crate::model::provider::ExpertProvider;
use crate::model::DecoderOnlyModel;
use crate::tokenizer::Tokenizer;

use super::decoding::{DecodeOptions, Generation};
use super::sampling::{greedy_token, sample_top_p, Sampling, SplitMix64};

/// Generates up to `max_new_tokens` after `prompt`, calling `on_token` with each new token as
/// soon as it is chosen.
pub fn complete(
    model: &DecoderOnlyModel,
    provider: &mut dyn ExpertProvider,
    prompt: &[i64],
    options: &DecodeOptions,
    on_token: &mut dyn FnMut(i64) -> Result<()>,
) -> Result<Generation> {
    let _guard = tch::no_grad_guard();
    if prompt.is_empty() {
        return Err(Error::Input("empty prompt: no tokens to start from".into()));
    }
    let mut out = Generation::default();
    let mut rng = match options.sampling {
        Sampling::TopP { seed, .. } => Some(SplitMix64::new(seed)),
        Sampling::Greedy => None,
    };
    let mut cache = model.new_cache(options.kv_cache);
    options.cancellation.check()?;
    let started = Instant::now();
    let stalled = provider.stall_ms();
    let mut logits = model.forward(prompt, &mut cache, provider, &mut out.routes)?; // [V]
    out.encode_ms = started.elapsed().as_secs_f64() * 1e3;
    out.encode_stall_ms = provider.stall_ms() - stalled;
    for produced in 0..options.max_new_tokens {
        options.cancellation.check()?;
        let step = Instant::now();
        if produced > 0 {
            let last = *out.tokens.last().expect("a token was produced");
            logits = model.forward(&[last], &mut cache, provider, &mut out.routes)?;
        }
        let next = match (options.sampling, rng.as_mut()) {
            (
                Sampling::TopP {
                    temperature, top_p, ..
                },
                Some(rng),
            ) => {
                let values = Vec::<f32>::try_from(&logits)?;
                sample_top_p(&values, temperature, top_p, rng)
            }
            _ => greedy_token(&logits)?,
        };
        if produced > 0 {
            out.step_ms.push(step.elapsed().as_secs_f64() * 1e3);
        }
        out.tokens.push(next);
        on_token(next)?;
        if options.stop_token_ids.contains(&next) {
            break;
        }
    }
    Ok(out)
}

/// Turns a growing list of token ids into text pieces to print: decodes everything so far and
/// hands out what was not printed yet, holding back an incomplete UTF-8 sequence (`�`).
#[derive(Default)]
pub struct TextStream {
    ids: Vec<i64>,
    printed: String,
}

impl TextStream {
    pub fn push(&mut self, tokenizer: &Tokenizer, id: i64) -> Result<String> {
        self.ids.push(id);
        let text = tokenizer.decode(&self.ids)?;
        if text.ends_with('\u{FFFD}') || !text.starts_with(&self.printed) {
            return Ok(String::new());
        }
        let piece = text[self.printed.len()..].to_string();
        self.printed = text;
        Ok(piece)
    }

    /// What is left to print at the end.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let text = tokenizer.decode(&self.ids)?;
        let piece = text
            .strip_prefix(&self.printed)
            .unwrap_or_default()
            .to_string();
        self.printed = text;
        Ok(piece)
    }
}
