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
//! a cache file next to the plan, so an interrupted or repeated run (another `P`) resumes. The
//! cache is keyed on everything a measurement depends on ([`CacheKey`]): the engine version, the
//! model bundle's files, the validation examples, `--limit`, the tokenized inputs and the
//! decoding length; measurements made under any other key are discarded, never reused.
//!
//! [`tune_bits`] is the whole run: the reference bundle (converting a checkpoint first if
//! asked), the tuner, ROUGE-2 of the plan, and the plan, report and heat map written.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::bundle::Bundle;
use crate::error::{Error, Result};
use crate::generation::decoding::DecodeOptions;
use crate::generation::input::model_input;
use crate::generation::session::{input_ids, run_model};
use crate::ids::ExpertId;
use crate::interrupt::RemoveOnInterrupt;
use crate::io::write_json;
use crate::model::{Model, RunShape};
use crate::offline::bit_plan::BitPlan;
use crate::offline::calibrate::document_input_tokens;
use crate::offline::convert::{convert, ConvertOptions};
use crate::offline::eval::{read_examples, Example};
use crate::offline::rouge;
use crate::quant::QuantBits;
use crate::runtime::resident::ResidentExperts;
use crate::store::{ExpertEncoding, ExpertStore};
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

/// What a cached measurement depends on. A cache whose key differs in any field is discarded:
/// the same `--out` used with another model (even one with the same tokenizer and data), other
/// examples, another `--limit` or `--max-new-tokens`, or another engine version starts afresh.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CacheKey {
    /// The engine's version: its quantizers and kernels decide what a width costs.
    pub engine: String,
    /// The model: `file → "crc32:length"` of the bundle's `config.json`, `resident.safetensors`
    /// and `tokenizer.json`, and of the expert store's header and index (which record every
    /// blob's CRC-32), so any change to any weight changes the key.
    pub model: BTreeMap<String, String>,
    /// The validation examples used: their count and the CRC-32 of their texts, and `--limit`.
    pub examples: usize,
    pub examples_checksum: String,
    pub limit: usize,
    /// The CRC-32 of the tokenized inputs (prefix and truncation applied).
    pub inputs_checksum: String,
    pub max_new_tokens: usize,
    /// The stored (reference) width of the experts.
    pub source_width: String,
}

/// `file → "crc32:length"` of a bundle's files (see [`CacheKey::model`]); the expert store's
/// blobs are covered through the index's own checksums, so the store is not read whole.
pub fn bundle_identity(bundle: &Bundle, store: &ExpertStore) -> Result<BTreeMap<String, String>> {
    use crate::bundle::{CONFIG_FILE, EXPERTS_FILE, RESIDENT_FILE, TOKENIZER_FILE};
    use crate::store::format::HEADER_BYTES;
    let mut identity = BTreeMap::new();
    for file in [CONFIG_FILE, RESIDENT_FILE, TOKENIZER_FILE] {
        let path = bundle.path(file);
        let (crc, len) = file_checksum(&path, u64::MAX)?;
        identity.insert(file.to_string(), format!("{crc:08x}:{len}"));
    }
    // The header (32 bytes) and the index it announces; the store was validated when opened.
    let path = bundle.path(EXPERTS_FILE);
    let index_bytes = bincode::serialized_size(store.index())
        .map_err(|e| Error::Internal(format!("cannot size the expert index: {e}")))?;
    let (crc, len) = file_checksum(&path, HEADER_BYTES as u64 + index_bytes)?;
    identity.insert(
        format!("{EXPERTS_FILE} (header and index)"),
        format!("{crc:08x}:{len}"),
    );
    Ok(identity)
}

/// CRC-32 and length of the first `limit` bytes of a file, read in 1 MiB pieces.
fn file_checksum(path: &Path, limit: u64) -> Result<(u32, u64)> {
    use std::io::Read;
    let file = crate::io::open_file(path)?;
    let mut reader = file.take(limit);
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = reader.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        total += n as u64;
    }
    Ok((hasher.finalize(), total))
}

/// Measurements by configuration key, saved after each new one.
#[derive(Debug, Default, Serialize, Deserialize)]
struct MeasurementCache {
    /// What the measurements depend on; a cache with another key is discarded.
    key: CacheKey,
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
    /// Measurements found in the cache (made earlier under the same key).
    reused: usize,
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
    /// `key` is the cache key with the model's identity, the examples' and the options' fields
    /// filled; the inputs' checksum and the decoding length are filled here. Cached
    /// measurements in `cache_path` are reused only under an equal key.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: TuneModel<'a>,
        experts: ResidentExperts,
        tokenizer: &Tokenizer,
        examples: &[Example],
        settings: EvalSettings,
        key: CacheKey,
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
        let key = CacheKey {
            inputs_checksum: format!("{:08x}", crc32fast::hash(format!("{inputs:?}").as_bytes())),
            max_new_tokens: model.decode.max_new_tokens,
            ..key
        };
        // A cache that cannot be read or parsed, or was made under another key, is discarded.
        let losses = std::fs::read_to_string(cache_path)
            .ok()
            .and_then(|text| serde_json::from_str::<MeasurementCache>(&text).ok())
            .filter(|c| c.key == key)
            .map(|c| c.losses)
            .unwrap_or_default();
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
            reused: losses.len(),
            cache: MeasurementCache { key, losses },
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
        crate::atomic::write_file(&self.cache_path, json.as_bytes())?;
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

    /// How many measurements came from the cache file (made under the same key).
    pub fn reused_measurements(&self) -> usize {
        self.reused
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
            total += rouge::score(&text, reference, false)?.rouge2.fmeasure;
        }
        self.experts.reset_widths();
        Ok(total / references.len().max(1) as f64)
    }
}

/// Where the full-precision reference model comes from.
#[derive(Debug, Clone)]
pub enum TuneSource {
    /// A bundle whose experts are all stored at one (full) precision.
    Bundle(PathBuf),
    /// A Hugging Face checkpoint, converted at its own precision into a temporary bundle first.
    Checkpoint(PathBuf),
}

/// Draws the importance heat map: the experts' importance, a title, the SVG path. The CLI passes
/// `bench::charts::importance_heatmap`; it is handed in because `bench` imports `offline` (for
/// its quantized copy), so `offline` does not import `bench`.
pub type DrawHeatMap = fn(&BTreeMap<ExpertId, f64>, &str, &Path) -> Result<()>;

/// What a tuning run reads and writes.
#[derive(Debug, Clone)]
pub struct TuneBitsOptions {
    pub source: TuneSource,
    /// Validation data: JSON lines with `dialogue`/`document` and `summary` fields.
    pub data: PathBuf,
    /// Use the first N validation examples.
    pub limit: usize,
    /// Tolerable loss (0.05 = 5%).
    pub max_loss: f64,
    /// Most tokens generated per example (default: the model's generation config).
    pub max_new_tokens: Option<usize>,
    /// The plan to write; `PLAN.report.json`, `PLAN.importance.svg` and the measurement cache
    /// `PLAN.measurements.json` go beside it.
    pub plan_path: PathBuf,
    /// Draws `PLAN.importance.svg`; `None` draws none.
    pub heat_map: Option<DrawHeatMap>,
    pub show_progress: bool,
}

/// A finished tuning run: the plan, what the tuner measured, and the plan confirmed with ROUGE-2.
#[derive(Debug, Clone)]
pub struct TuneBitsRun {
    pub plan: BitPlan,
    pub report: TuneReport,
    /// Mean ROUGE-2 F of the full-precision model and of the plan on the validation examples.
    pub rouge2_full_precision: f64,
    pub rouge2_plan: f64,
    pub examples: usize,
    /// Measurements reused from `PLAN.measurements.json` (same model, data and options).
    pub reused_measurements: usize,
    pub plan_path: PathBuf,
    pub report_path: PathBuf,
}

/// `PLAN.suffix` beside the plan `PLAN.json`.
pub fn beside_plan(plan: &Path, suffix: &str) -> PathBuf {
    let stem = plan.file_stem().and_then(|s| s.to_str()).unwrap_or("plan");
    plan.with_file_name(format!("{stem}.{suffix}"))
}

/// Tunes every expert's width for `max_loss` and writes the plan, its report, the importance
/// heat map and the measurement cache.
pub fn tune_bits(options: &TuneBitsOptions) -> Result<TuneBitsRun> {
    // The converted bundle lives until the run ends, and is removed if it is interrupted.
    let _temp;
    let bundle_dir = match &options.source {
        TuneSource::Bundle(dir) => dir.clone(),
        TuneSource::Checkpoint(hf) => {
            let temp = tempfile::tempdir().map_err(|e| Error::io(std::env::temp_dir(), e))?;
            let out = temp.path().join("bundle");
            let guard = RemoveOnInterrupt::new(temp.path());
            _temp = (temp, guard);
            convert(&ConvertOptions {
                resident: Default::default(),
                hf_dir: hf.clone(),
                out_dir: out.clone(),
                tokenizer: None,
                bits: BitPlan::default(),
                force: false,
                show_progress: options.show_progress,
            })?;
            out
        }
    };
    let examples = read_examples(&options.data, Some(options.limit))?;
    let out = &options.plan_path;
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    let bundle = Bundle::open(&bundle_dir)?;
    let store = bundle.open_store()?;
    let source = store
        .index()
        .experts
        .first()
        .map(|e| e.encoding)
        .ok_or_else(|| Error::Input("the bundle has no experts".into()))?;
    if store.index().experts.iter().any(|e| e.encoding != source) {
        return Err(Error::Input(format!(
            "{}: experts are stored at mixed widths; tune from a full-precision bundle",
            bundle_dir.display()
        )));
    }
    let widths = [
        ExpertEncoding::Quant(QuantBits::Int8),
        ExpertEncoding::Quant(QuantBits::Int4),
        ExpertEncoding::Quant(QuantBits::Int2),
    ];
    let experts = ResidentExperts::load(&store, &widths)?;
    let tokenizer = bundle.tokenizer()?;
    let key = CacheKey {
        engine: env!("CARGO_PKG_VERSION").to_string(),
        model: bundle_identity(&bundle, &store)?,
        examples: examples.len(),
        examples_checksum: format!(
            "{:08x}",
            crc32fast::hash(
                format!(
                    "{:?}",
                    examples
                        .iter()
                        .map(|e| (&e.document, &e.reference))
                        .collect::<Vec<_>>()
                )
                .as_bytes()
            )
        ),
        limit: options.limit,
        source_width: source.name().to_string(),
        ..CacheKey::default()
    };
    let generation = &bundle.config.generation;
    let model = bundle.load_model(tch::Device::Cpu)?;
    let mut decode = DecodeOptions::from_defaults(generation);
    decode.num_beams = 1;
    decode.max_new_tokens = options.max_new_tokens.unwrap_or(generation.max_new_tokens);
    // Tuning runs without a budget, so a decoding length whose working memory this machine
    // cannot hold is refused here (a huge --max-new-tokens ran on, growing, for hours).
    let working = model.working_bytes(RunShape {
        max_source_tokens: document_input_tokens(&bundle),
        max_new_tokens: decode.max_new_tokens,
        beams: 1,
        kv_cache: decode.kv_cache,
    });
    let memory = physical_memory_bytes();
    if working > memory {
        return Err(Error::Input(format!(
            "--max-new-tokens {}: decoding that far needs {} of working memory, more than this machine's {}",
            decode.max_new_tokens,
            crate::units::format_bytes(working),
            crate::units::format_bytes(memory)
        )));
    }
    let mut tuner = Tuner::new(
        TuneModel {
            model: &model,
            decode,
        },
        experts,
        &tokenizer,
        &examples,
        EvalSettings {
            prefix: generation.input_prefix.clone(),
            max_source_tokens: document_input_tokens(&bundle),
        },
        key,
        &beside_plan(out, "measurements.json"),
        options.show_progress,
    )?;
    let (plan, mut report) = tuner.tune(source, options.max_loss)?;
    let references: Vec<String> = examples.iter().map(|e| e.reference.clone()).collect();
    let rouge2_full_precision = tuner.rouge2(None, &tokenizer, &references)?;
    let rouge2_plan = tuner.rouge2(Some(&plan), &tokenizer, &references)?;
    let spec = &bundle.config.model;
    let ids = spec.all_experts();
    report.expert_bytes = ids
        .iter()
        .filter_map(|&id| plan.encoding(id))
        .map(|e| spec.expert_layout().blob(e).1)
        .sum();
    plan.save(out)?;
    let importance: BTreeMap<ExpertId, f64> = ids
        .iter()
        .filter_map(|&id| report.importance.get(&expert_key(id)).map(|&v| (id, v)))
        .collect();
    if let (Some(draw), false) = (options.heat_map, importance.is_empty()) {
        let title = format!(
            "expert importance: proxy loss at {} (others at {})",
            report.lower.as_deref().unwrap_or("-"),
            report.upper
        );
        draw(&importance, &title, &beside_plan(out, "importance.svg"))?;
    }
    // Through a JSON value, so the file's keys stay sorted as they always were.
    let summary = serde_json::json!({
        "tune": report,
        "rouge2_full_precision": rouge2_full_precision,
        "rouge2_plan": rouge2_plan,
        "examples": examples.len(),
    });
    let report_path = beside_plan(out, "report.json");
    write_json(&report_path, &summary)?;
    Ok(TuneBitsRun {
        plan,
        report,
        rouge2_full_precision,
        rouge2_plan,
        examples: examples.len(),
        reused_measurements: tuner.reused_measurements(),
        plan_path: out.clone(),
        report_path,
    })
}

/// The machine's physical memory (`u64::MAX` when it cannot be told).
fn physical_memory_bytes() -> u64 {
    // SAFETY: sysconf only reads system constants.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || page <= 0 {
        return u64::MAX;
    }
    (pages as u64).saturating_mul(page as u64)
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
