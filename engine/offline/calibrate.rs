//! `calibrate`: run the model over a corpus, record each token's activation path, build the
//! [`PathDictionary`] and measure how well it predicts held-out tokens. [`calibrate`] is the
//! whole run (documents, held-out split, session, dictionary saved into the bundle, report);
//! the pieces below it are its steps.

use std::path::{Path, PathBuf};

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::bundle::Bundle;
use crate::cache::Policy;
use crate::dictionary::{evaluate, LayerAccuracy, PathDictionary, StackPaths};
use crate::error::{Error, Result};
use crate::generation::decoding::Generation;
use crate::generation::input::parse_documents;
use crate::generation::session::{CacheOptions, Session, SessionOptions};
use crate::ids::Stack;
use crate::model::LayerRoute;
use crate::runtime::predict::{PredictorKind, PredictorLayerStats};

/// Longest prompt (its last tokens) when `calibrate` and `tune-bits` feed a document to a
/// decoder-only model.
pub const DOCUMENT_PROMPT_TOKENS: usize = 512;

/// How many tokens of a document `calibrate` and `tune-bits` feed the model: an encoder reads
/// the bundle's `max_source_tokens` (its first tokens), a decoder-only model a prompt of the
/// document's last [`DOCUMENT_PROMPT_TOKENS`] tokens.
pub fn document_input_tokens(bundle: &crate::bundle::Bundle) -> usize {
    if bundle.config.model.has_encoder() {
        bundle.config.generation.max_source_tokens
    } else {
        DOCUMENT_PROMPT_TOKENS
    }
}

/// Reads documents (JSON lines with a `dialogue` or `document` field, or one plain document),
/// keeping the first `limit`.
pub fn read_documents(path: &Path, limit: Option<usize>) -> Result<Vec<String>> {
    let text = crate::io::read_input_text(path)?;
    let mut documents = parse_documents(&text, &path.display().to_string())?;
    if let Some(n) = limit {
        documents.truncate(n);
    }
    Ok(documents)
}

/// What a calibration run reads.
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    /// The bundle; the dictionary is written into it.
    pub bundle: PathBuf,
    /// Calibration corpus (JSON lines with a `dialogue` or `document` field).
    pub data: PathBuf,
    /// Use the first N documents of `data`.
    pub limit: Option<usize>,
    /// Held-out corpus and how many of its documents to use; `None` holds out the last 10% of
    /// `data`'s documents instead.
    pub held_out: Option<(PathBuf, usize)>,
    pub show_progress: bool,
}

/// A finished calibration: the dictionary's accuracy and where it was written.
#[derive(Debug, Clone)]
pub struct CalibrationRun {
    pub report: CalibrationReport,
    /// The bundle's `paths.bin`.
    pub dictionary_path: PathBuf,
}

/// Runs the model over the corpus (routing only: every expert fits, no prefetch), builds the
/// dictionary from the calibration documents, saves it into the bundle and measures it on the
/// held-out documents.
pub fn calibrate(options: &CalibrateOptions) -> Result<CalibrationRun> {
    let mut documents = read_documents(&options.data, options.limit)?;
    let held_out_documents = match &options.held_out {
        Some((path, limit)) => read_documents(path, Some(*limit))?,
        None => {
            if documents.len() < 2 {
                return Err(Error::Input(format!(
                    "{}: need at least 2 documents to hold one out (or pass --eval-data)",
                    options.data.display()
                )));
            }
            let keep = documents.len() - (documents.len() / 10).max(1);
            documents.split_off(keep)
        }
    };
    let bundle = Bundle::open(&options.bundle)?.without_path_dictionary();
    let spec = bundle.config.model.clone();
    let cache = CacheOptions {
        policy: Policy::Lru,
        prefetch: false,
        ..CacheOptions::default()
    };
    // Decoder-only models take each document as a prompt (its last DOCUMENT_PROMPT_TOKENS
    // tokens), followed by the model's greedy continuation.
    let mut session = Session::open(
        &bundle,
        SessionOptions {
            max_input_tokens: document_input_tokens(&bundle),
            cache: cache.clone(),
            ..SessionOptions::defaults(&bundle, u64::MAX / 4)
        },
    )?;
    let show = options.show_progress;
    let calibration = collect_paths(&mut session, &documents, "calibration", show)?;
    drop(session);
    let dict = build_dictionary(
        &calibration,
        spec.moe_blocks(Stack::Encoder).len(),
        spec.moe_blocks(Stack::Decoder).len(),
        spec.num_experts(),
        spec.top_k(),
    );
    let dictionary_path = bundle.save_path_dictionary(&dict)?;
    // The held-out pass runs with the new dictionary and the gate lookahead, so that both
    // predictors are scored live, as a run scores them (prefetch off: predictions only).
    let bundle = Bundle::open(&options.bundle)?;
    let mut session = Session::open(
        &bundle,
        SessionOptions {
            max_input_tokens: document_input_tokens(&bundle),
            cache: CacheOptions {
                predictor: PredictorKind::Both,
                ..cache
            },
            ..SessionOptions::defaults(&bundle, u64::MAX / 4)
        },
    )?;
    let held_out = collect_paths(&mut session, &held_out_documents, "held out", show)?;
    let mut report = report(&dict, calibration.len(), &held_out);
    report.predictors = session.stats().predictions.report();
    Ok(CalibrationRun {
        report,
        dictionary_path,
    })
}

/// Activation paths of one document: per stack, one path (the `k` experts of each MoE layer,
/// layer after layer) per token, and per forward call of the stack (a *pass*, in order) the
/// experts its tokens chose at each MoE layer.
#[derive(Debug, Clone, Default)]
pub struct DocumentPaths {
    pub encoder: Vec<Vec<u16>>,
    pub decoder: Vec<Vec<u16>>,
    /// `[pass][layer]`: the distinct experts the encoder's forward calls chose.
    pub encoder_passes: Vec<Vec<Vec<u16>>>,
    /// `[pass][layer]`: the same for the decoder's (a prompt's prefill, then one per step).
    pub decoder_passes: Vec<Vec<Vec<u16>>>,
}

impl DocumentPaths {
    pub fn stack(&self, stack: Stack) -> &Vec<Vec<u16>> {
        match stack {
            Stack::Encoder => &self.encoder,
            Stack::Decoder => &self.decoder,
        }
    }

    pub fn passes(&self, stack: Stack) -> &Vec<Vec<Vec<u16>>> {
        match stack {
            Stack::Encoder => &self.encoder_passes,
            Stack::Decoder => &self.decoder_passes,
        }
    }
}

/// Paths of the tokens of one sequence (batch of one): every forward call of a stack runs its
/// `layers` MoE layers in order over the call's tokens — the encoder's source tokens, a
/// decoder-only prompt's prefill, then one token per decoder step (one per beam).
pub fn paths_of(
    routes: &[LayerRoute],
    encoder_layers: usize,
    decoder_layers: usize,
) -> DocumentPaths {
    type StackRun = (Vec<Vec<u16>>, Vec<Vec<Vec<u16>>>);
    let stack_paths = |stack: Stack, layers: usize| -> StackRun {
        if layers == 0 {
            return Default::default();
        }
        let calls: Vec<&LayerRoute> = routes.iter().filter(|r| r.stack == stack).collect();
        let (mut tokens_out, mut passes) = (Vec::new(), Vec::new());
        for call in calls.chunks(layers) {
            let tokens = call[0].tokens();
            if call.len() != layers || call.iter().any(|r| r.tokens() != tokens) {
                continue;
            }
            for t in 0..tokens {
                tokens_out.push(
                    call.iter()
                        .flat_map(|r| r.token_experts(t).iter().copied())
                        .collect(),
                );
            }
            passes.push(
                call.iter()
                    .map(|r| {
                        let mut chosen = r.experts.clone();
                        chosen.sort_unstable();
                        chosen.dedup();
                        chosen
                    })
                    .collect(),
            );
        }
        (tokens_out, passes)
    };
    let (encoder, encoder_passes) = stack_paths(Stack::Encoder, encoder_layers);
    let (decoder, decoder_passes) = stack_paths(Stack::Decoder, decoder_layers);
    DocumentPaths {
        encoder,
        decoder,
        encoder_passes,
        decoder_passes,
    }
}

/// Runs the session's model over `documents` and returns their paths, with a progress bar:
/// an encoder-decoder summarizes each document, a decoder-only model takes it as a prompt (its
/// last `max_input_tokens` tokens) followed by its own continuation; prompt tokens count.
pub fn collect_paths(
    session: &mut Session,
    documents: &[String],
    label: &str,
    show_progress: bool,
) -> Result<Vec<DocumentPaths>> {
    let spec = session.model.spec();
    collect_paths_with(
        &spec,
        &mut |document| {
            let ids = session.encode(document)?;
            session.run(&ids, &mut |_| Ok(()))
        },
        documents,
        label,
        show_progress,
    )
}

/// Runs `run` over every document and returns their paths, with a progress bar.
pub fn collect_paths_with(
    spec: &crate::config::ModelSpec,
    run: &mut dyn FnMut(&str) -> Result<Generation>,
    documents: &[String],
    label: &str,
    show_progress: bool,
) -> Result<Vec<DocumentPaths>> {
    let encoder_layers = spec.moe_blocks(Stack::Encoder).len();
    let decoder_layers = spec.moe_blocks(Stack::Decoder).len();
    let progress = if show_progress {
        ProgressBar::new(documents.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len} documents ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    progress.set_message(label.to_string());
    let mut out = Vec::with_capacity(documents.len());
    for document in documents {
        let generation = run(document)?;
        out.push(paths_of(&generation.routes, encoder_layers, decoder_layers));
        progress.inc(1);
    }
    progress.finish_and_clear();
    Ok(out)
}

/// Builds the dictionary from calibration documents' paths (`top_k` experts per layer), the
/// documents in the order they ran: their passes count as one run's, as a policy sees them.
pub fn build_dictionary(
    documents: &[DocumentPaths],
    encoder_layers: usize,
    decoder_layers: usize,
    num_experts: usize,
    top_k: usize,
) -> PathDictionary {
    let mut dict = PathDictionary::new(encoder_layers, decoder_layers, num_experts, top_k);
    for doc in documents {
        for path in &doc.encoder {
            dict.encoder.add_path(path);
        }
        for path in &doc.decoder {
            dict.decoder.add_path(path);
        }
    }
    for stack in [Stack::Encoder, Stack::Decoder] {
        let passes: Vec<Vec<Vec<u16>>> = documents
            .iter()
            .flat_map(|doc| doc.passes(stack).iter().cloned())
            .collect();
        dict.stack_mut(stack).add_passes(&passes);
    }
    dict
}

/// How one stack's dictionary did.
#[derive(Debug, Clone, Serialize)]
pub struct StackReport {
    pub stack: String,
    pub calibration_tokens: u64,
    pub distinct_paths: usize,
    /// Share of calibration tokens whose path is among the 20% most frequent paths.
    pub top20_path_coverage: f64,
    pub held_out_tokens: u64,
    /// Forward calls of the stack in calibration (an encoder pass per document; a decoder step).
    pub calibration_passes: u64,
    /// Share of the experts a pass used that the pass before it had used too (what the
    /// eviction policy's seeds start from; 0 without passes).
    pub pass_repeat_share: f64,
    pub layers: Vec<LayerAccuracy>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CalibrationReport {
    pub calibration_documents: usize,
    pub held_out_documents: usize,
    pub encoder: StackReport,
    pub decoder: StackReport,
    /// Precision and recall of each next-layer predictor on the held-out documents, per MoE
    /// layer: each forward call's predicted experts against those its router chose.
    pub predictors: Vec<PredictorLayerStats>,
}

pub fn report(
    dict: &PathDictionary,
    calibration_documents: usize,
    held_out: &[DocumentPaths],
) -> CalibrationReport {
    let stack_report = |stack: Stack, paths: &StackPaths| {
        let sequences: Vec<Vec<Vec<u16>>> =
            held_out.iter().map(|d| d.stack(stack).clone()).collect();
        let layers = evaluate(paths, &sequences);
        StackReport {
            stack: stack.hf_prefix().into(),
            calibration_tokens: paths.tokens(),
            distinct_paths: paths.paths.len(),
            top20_path_coverage: paths.top_path_coverage(0.2),
            held_out_tokens: layers.first().map_or(0, |l| l.tokens),
            calibration_passes: paths.passes.passes,
            pass_repeat_share: paths.passes.repeat_share(),
            layers,
        }
    };
    CalibrationReport {
        calibration_documents,
        held_out_documents: held_out.len(),
        encoder: stack_report(Stack::Encoder, &dict.encoder),
        decoder: stack_report(Stack::Decoder, &dict.decoder),
        predictors: Vec::new(),
    }
}

impl CalibrationReport {
    /// A table per stack: per layer top-1/top-2 next to the two baselines.
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "calibrated on {} documents, measured on {} held-out documents\n",
            self.calibration_documents, self.held_out_documents
        );
        for s in [&self.encoder, &self.decoder] {
            out += &format!(
                "\n{}: {} calibration tokens, {} distinct paths, top 20% of paths cover {:.1}% of tokens; {} held-out tokens\n",
                s.stack,
                s.calibration_tokens,
                s.distinct_paths,
                100.0 * s.top20_path_coverage,
                s.held_out_tokens
            );
            if s.calibration_passes > 0 {
                out += &format!(
                    "  {} passes (forward calls); {:.1}% of the experts a pass used, the pass before had used too\n",
                    s.calibration_passes,
                    100.0 * s.pass_repeat_share
                );
            }
            out +=
                "  MoE layer   top-1   top-2   recall@k   same as previous token   most frequent\n";
            for l in &s.layers {
                out += &format!(
                    "  {:>9}   {:.3}   {:.3}   {:>8.3}   {:>22.3}   {:>13.3}\n",
                    l.layer,
                    l.top1,
                    l.top2,
                    l.recall_at_k,
                    l.same_as_previous_token,
                    l.most_frequent
                );
            }
        }
        if !self.predictors.is_empty() {
            out += &predictor_table(&self.predictors);
        }
        out
    }
}

/// Per MoE layer, precision / recall of each predictor side by side ("-" where one made no
/// prediction for the layer: the gate at a forward call's first MoE layer).
pub fn predictor_table(stats: &[PredictorLayerStats]) -> String {
    let mut layers: Vec<(&str, u16)> = stats.iter().map(|s| (s.stack.as_str(), s.block)).collect();
    layers.sort_by_key(|&(stack, block)| (stack != "encoder", block));
    layers.dedup();
    let mut out = String::from(
        "\nnext-layer predictions on held-out documents (a forward call's predicted experts vs the chosen):\n  stack     block   dictionary P / R   gate P / R      both P / R\n",
    );
    for (stack, block) in layers {
        out += &format!("  {stack:<8} {block:>6}");
        for kind in PredictorKind::ALL {
            match stats
                .iter()
                .find(|s| s.predictor == kind && s.stack == stack && s.block == block)
            {
                Some(s) => out += &format!("   {:.3} / {:.3}", s.precision, s.recall),
                None => out += "     -   /   -  ",
            }
        }
        out.push('\n');
    }
    out
}
