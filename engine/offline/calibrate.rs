//! `calibrate`: run the model over a corpus, record each token's activation path, build the
//! [`PathDictionary`] and measure how well it predicts held-out tokens.

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::dictionary::{evaluate, LayerAccuracy, PathDictionary, StackPaths};
use crate::error::Result;
use crate::generation::decoding::Generation;
use crate::generation::session::Session;
use crate::ids::Stack;
use crate::model::LayerRoute;

/// Activation paths of one document: per stack, one path (the `k` experts of each MoE layer,
/// layer after layer) per token.
#[derive(Debug, Clone, Default)]
pub struct DocumentPaths {
    pub encoder: Vec<Vec<u16>>,
    pub decoder: Vec<Vec<u16>>,
}

impl DocumentPaths {
    pub fn stack(&self, stack: Stack) -> &Vec<Vec<u16>> {
        match stack {
            Stack::Encoder => &self.encoder,
            Stack::Decoder => &self.decoder,
        }
    }
}

/// Paths of the tokens of one sequence (batch of one): every forward call of a stack runs its
/// `layers` MoE layers in order over the call's tokens — the encoder's source tokens, a
/// decoder-only prompt's prefill, then one token per decoder step.
pub fn paths_of(
    routes: &[LayerRoute],
    encoder_layers: usize,
    decoder_layers: usize,
) -> DocumentPaths {
    let stack_paths = |stack: Stack, layers: usize| -> Vec<Vec<u16>> {
        if layers == 0 {
            return Vec::new();
        }
        let calls: Vec<&LayerRoute> = routes.iter().filter(|r| r.stack == stack).collect();
        let mut out = Vec::new();
        for call in calls.chunks(layers) {
            let tokens = call[0].tokens();
            if call.len() != layers || call.iter().any(|r| r.tokens() != tokens) {
                continue;
            }
            for t in 0..tokens {
                out.push(
                    call.iter()
                        .flat_map(|r| r.token_experts(t).iter().copied())
                        .collect(),
                );
            }
        }
        out
    };
    DocumentPaths {
        encoder: stack_paths(Stack::Encoder, encoder_layers),
        decoder: stack_paths(Stack::Decoder, decoder_layers),
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

/// Builds the dictionary from calibration documents' paths (`top_k` experts per layer).
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
    pub layers: Vec<LayerAccuracy>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CalibrationReport {
    pub calibration_documents: usize,
    pub held_out_documents: usize,
    pub encoder: StackReport,
    pub decoder: StackReport,
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
            layers,
        }
    };
    CalibrationReport {
        calibration_documents,
        held_out_documents: held_out.len(),
        encoder: stack_report(Stack::Encoder, &dict.encoder),
        decoder: stack_report(Stack::Decoder, &dict.decoder),
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
        out
    }
}
