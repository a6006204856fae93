//! `tune-bits`: choose each expert's width offline so the model loses at most `P` of its
//! accuracy (EdgeMoE §3.2 / ARCHITECTURE.md §9).
//!
//! 1. Bounds: the model with every expert at each width (source, INT8, INT4, INT2). The upper
//!    width is the narrowest whose loss stays within `P`; the lower width the next narrower one.
//! 2. Importance: one expert alone at the lower width (the others at the upper) — its loss.
//! 3. K: the K least important experts go to the lower width; the largest K whose loss stays
//!    within `P` is found by bisection (the loss grows with K).
//!
//! The inner loop uses a cheap proxy for accuracy: agreement of the generated tokens with the
//! full-precision model's (bigram F1 of the token ids, 1 when identical); loss = 1 − agreement.
//! The final plan is confirmed with ROUGE-2 against the references.
//!
//! Either architecture: a Switch model summarizes each example's document; a decoder-only model
//! continues it as a prompt (greedily, `max_new_tokens`), and ROUGE-2 compares that
//! continuation with the reference (meaningful for instruction-tuned models prompted to
//! summarize). Experts are tuned whole: a SwiGLU expert's `gate`, `up` and `down` share one
//! width, as they share one blob. Every measurement is kept in
//! a cache file next to the plan, so an interrupted or repeated run (another `P`) resumes.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::generation::decoding::DecodeOptions;
use crate::generation::input::model_input;
use crate::generation::session::{input_ids, run_model};
use crate::ids::ExpertId;
use crate::model::Model;
use crate::offline::bit_plan::BitPlan;
use crate::offline::eval::Example;
use crate::offline::rouge;
use crate::quant::QuantBits;
use crate::runtime::resident::ResidentExperts;
use crate::store::ExpertEncoding;
use crate::tokenizer::Tokenizer;

/// Bigram F1 between two id sequences (1 when identical).
pub fn agreement(a: &[i64], b: &[i64]) -> f64 {
    if a == b {
        return 1.0;
    }
    let bigrams = |s: &[i64]| {
        let mut m: HashMap<(i64, i64), usize> = HashMap::new();
        for w in s.windows(2) {
            *m.entry((w[0], w[1])).or_default() += 1;
        }
        m
    };
    let (x, y) = (bigrams(a), bigrams(b));
    let (nx, ny): (usize, usize) = (x.values().sum(), y.values().sum());
    if nx == 0 || ny == 0 {
        return 0.0;
    }
    let overlap: usize = x
        .iter()
        .map(|(k, &c)| c.min(y.get(k).copied().unwrap_or(0)))
        .sum();
    let (p, r) = (overlap as f64 / nx as f64, overlap as f64 / ny as f64);
    if p + r == 0.0 {
        0.0
    } else {
        2.0 * p * r / (p + r)
    }
}

/// Measurements by configuration key, saved after each new one.
#[derive(Debug, Default, Serialize, Deserialize)]
struct MeasurementCache {
    /// Identifies the evaluation set; measurements of another set are discarded.
    evaluation: String,
    losses: BTreeMap<String, f64>,
}

/// The model a tuner evaluates, and how it decodes (greedy).
pub struct TuneModel<'a> {
    pub model: &'a Model,
    pub decode: DecodeOptions,
}

pub struct Tuner<'a> {
    model: TuneModel<'a>,
    experts: ResidentExperts,
    inputs: Vec<Vec<i64>>,
    full_precision: Vec<Vec<i64>>,
    cache: MeasurementCache,
    cache_path: PathBuf,
    pub progress: ProgressBar,
}

/// How examples are fed.
#[derive(Debug, Clone)]
pub struct EvalSettings {
    pub prefix: String,
    /// Longest source (Switch: truncated keeping `</s>`; decoder-only: its last tokens).
    pub max_source_tokens: usize,
}

/// What the tuner decided and measured.
#[derive(Debug, Clone, Serialize)]
pub struct TuneReport {
    pub max_loss: f64,
    /// Proxy loss with every expert at each width.
    pub uniform_loss: BTreeMap<String, f64>,
    pub upper: String,
    pub lower: Option<String>,
    /// Importance (proxy loss) of each expert at the lower width, as `stack.block.expert`.
    pub importance: BTreeMap<String, f64>,
    /// Experts at the lower width.
    pub k: usize,
    pub plan_loss: f64,
    pub expert_bytes: u64,
}

pub fn expert_key(id: ExpertId) -> String {
    format!("{}.{}.{}", id.stack.hf_prefix(), id.layer, id.expert)
}

impl<'a> Tuner<'a> {
    /// Prepares the evaluation set (`examples` tokenized) and the full-precision outputs.
    pub fn new(
        model: TuneModel<'a>,
        experts: ResidentExperts,
        tokenizer: &Tokenizer,
        examples: &[Example],
        settings: EvalSettings,
        cache_path: &Path,
        show_progress: bool,
    ) -> Result<Self> {
        let inputs = examples
            .iter()
            .map(|e| {
                let text = model_input(&e.document, &settings.prefix);
                input_ids(model.model, tokenizer, &text, settings.max_source_tokens)
            })
            .collect::<Result<Vec<_>>>()?;
        let evaluation = format!(
            "{} documents, input checksum {:08x}, {} new tokens",
            inputs.len(),
            crc32fast::hash(format!("{inputs:?}").as_bytes()),
            model.decode.max_new_tokens
        );
        let cache = match std::fs::read_to_string(cache_path) {
            Ok(text) => serde_json::from_str::<MeasurementCache>(&text)
                .ok()
                .filter(|c| c.evaluation == evaluation)
                .unwrap_or_default(),
            Err(_) => MeasurementCache::default(),
        };
        let progress = if show_progress {
            ProgressBar::new_spinner()
        } else {
            ProgressBar::hidden()
        };
        progress.set_style(
            ProgressStyle::with_template("{spinner} {msg} [{elapsed}]").expect("valid template"),
        );
        let mut tuner = Tuner {
            model,
            experts,
            inputs,
            full_precision: Vec::new(),
            cache: MeasurementCache {
                evaluation,
                ..cache
            },
            cache_path: cache_path.to_path_buf(),
            progress,
        };
        tuner.experts.reset_widths();
        tuner.full_precision = tuner.outputs()?;
        Ok(tuner)
    }

    fn outputs(&mut self) -> Result<Vec<Vec<i64>>> {
        let mut out = Vec::with_capacity(self.inputs.len());
        for ids in &self.inputs {
            let tokens = run_model(
                self.model.model,
                &mut self.experts,
                ids,
                &self.model.decode,
                &mut |_| Ok(()),
            )?
            .tokens;
            out.push(tokens);
        }
        Ok(out)
    }

    /// Proxy loss of a configuration (every expert at `base`, those in `lower` at `low`).
    fn loss(
        &mut self,
        key: String,
        base: ExpertEncoding,
        low: Option<(ExpertEncoding, &[ExpertId])>,
    ) -> Result<f64> {
        if let Some(&l) = self.cache.losses.get(&key) {
            return Ok(l);
        }
        self.progress.set_message(format!(
            "measuring {key} ({} measured so far)",
            self.cache.losses.len()
        ));
        self.progress.tick();
        for id in self.experts.experts() {
            self.experts.set_width(id, base)?;
        }
        if let Some((width, ids)) = low {
            for &id in ids {
                self.experts.set_width(id, width)?;
            }
        }
        let outputs = self.outputs()?;
        let mean = outputs
            .iter()
            .zip(&self.full_precision)
            .map(|(a, b)| agreement(a, b))
            .sum::<f64>()
            / outputs.len().max(1) as f64;
        let loss = 1.0 - mean;
        self.cache.losses.insert(key, loss);
        let json = serde_json::to_string_pretty(&self.cache).expect("cache serializes");
        std::fs::write(&self.cache_path, json).map_err(|e| Error::io(&self.cache_path, e))?;
        Ok(loss)
    }

    /// Runs the three steps for a tolerable loss `max_loss` (0.05 = 5%).
    pub fn tune(&mut self, source: ExpertEncoding, max_loss: f64) -> Result<(BitPlan, TuneReport)> {
        let ladder: Vec<ExpertEncoding> = [
            source,
            ExpertEncoding::Quant(QuantBits::Int8),
            ExpertEncoding::Quant(QuantBits::Int4),
            ExpertEncoding::Quant(QuantBits::Int2),
        ]
        .into_iter()
        .collect();
        let mut uniform = BTreeMap::new();
        for &w in &ladder {
            let l = if w == source {
                0.0
            } else {
                self.loss(format!("all:{}", w.name()), w, None)?
            };
            uniform.insert(w.name().to_string(), l);
        }
        let upper_index = (0..ladder.len())
            .rev()
            .find(|&i| uniform[ladder[i].name()] <= max_loss)
            .unwrap_or(0);
        let upper = ladder[upper_index];
        let lower = ladder.get(upper_index + 1).copied();
        let ids = self.experts.experts();
        let mut importance = BTreeMap::new();
        let mut k = 0;
        let mut plan = BitPlan::uniform(upper);
        let mut plan_loss = uniform[upper.name()];
        if let Some(low) = lower {
            for &id in &ids {
                let key = format!("one:{}:{}|{}", expert_key(id), low.name(), upper.name());
                let l = self.loss(key, upper, Some((low, &[id])))?;
                importance.insert(id, l);
            }
            let mut order = ids.clone();
            order.sort_by(|a, b| importance[a].total_cmp(&importance[b]).then(a.cmp(b)));
            // Bisection for the largest K within the budget (K = 0 is the upper bound itself).
            let (mut lo, mut hi) = (0usize, order.len());
            let mut best_loss = plan_loss;
            while lo < hi {
                let mid = (lo + hi).div_ceil(2);
                let key = format!(
                    "k:{mid}:{}|{}:{}",
                    low.name(),
                    upper.name(),
                    order_key(&order[..mid])
                );
                let l = self.loss(key, upper, Some((low, &order[..mid])))?;
                if l <= max_loss {
                    lo = mid;
                    best_loss = l;
                } else {
                    hi = mid - 1;
                }
            }
            k = lo;
            plan_loss = if k == 0 { plan_loss } else { best_loss };
            for &id in &order[..k] {
                plan.experts.insert(id, low);
            }
        }
        self.progress.finish_and_clear();
        let report = TuneReport {
            max_loss,
            uniform_loss: uniform,
            upper: upper.name().into(),
            lower: lower.map(|l| l.name().to_string()),
            importance: importance
                .iter()
                .map(|(id, l)| (expert_key(*id), *l))
                .collect(),
            k,
            plan_loss,
            expert_bytes: 0,
        };
        Ok((plan, report))
    }

    /// Importance by expert (for the heat map).
    pub fn experts(&self) -> &ResidentExperts {
        &self.experts
    }

    /// Mean ROUGE-2 F of `plan` (None = full precision) against the references.
    pub fn rouge2(
        &mut self,
        plan: Option<&BitPlan>,
        tokenizer: &Tokenizer,
        references: &[String],
    ) -> Result<f64> {
        self.experts.reset_widths();
        if let Some(plan) = plan {
            for id in self.experts.experts() {
                if let Some(w) = plan.encoding(id) {
                    self.experts.set_width(id, w)?;
                }
            }
        }
        let outputs = self.outputs()?;
        let mut total = 0.0;
        for (ids, reference) in outputs.iter().zip(references) {
            let text = tokenizer.decode(ids)?;
            total += rouge::score(&text, reference, false).rouge2.fmeasure;
        }
        self.experts.reset_widths();
        Ok(total / references.len().max(1) as f64)
    }
}

/// A short stable key for a set of experts.
fn order_key(ids: &[ExpertId]) -> String {
    format!("{:08x}", crc32fast::hash(format!("{ids:?}").as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_is_bigram_f1() {
        assert_eq!(agreement(&[1, 2, 3], &[1, 2, 3]), 1.0);
        assert_eq!(agreement(&[1, 2, 3], &[4, 5, 6]), 0.0);
        // [1,2,3] vs [1,2,4]: bigrams {12, 23} vs {12, 24}: one shared of two each.
        assert_eq!(agreement(&[1, 2, 3], &[1, 2, 4]), 0.5);
        assert_eq!(agreement(&[7], &[8]), 0.0);
    }
}
