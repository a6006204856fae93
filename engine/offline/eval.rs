//! `eval`: summarize a reference corpus and score it with ROUGE, with speed and cache figures.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::generation::report::RunStats;
use crate::generation::session::Session;
use crate::offline::rouge::{self, RougeScores};

/// A document with its reference summary.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub document: String,
    pub reference: String,
}

/// Reads JSON lines with a `dialogue`/`document` field and a `summary`/`reference` field.
pub fn read_examples(path: &Path, limit: Option<usize>) -> Result<Vec<Example>> {
    let text = crate::io::read_text(path)?;
    let mut out = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            Error::Input(format!(
                "{} line {}: invalid JSON: {e}",
                path.display(),
                number + 1
            ))
        })?;
        let field = |keys: [&str; 2]| {
            keys.iter()
                .find_map(|k| value.get(k).and_then(|v| v.as_str()))
                .map(str::to_string)
                .ok_or_else(|| {
                    Error::Input(format!(
                        "{} line {}: no string field `{}` or `{}`",
                        path.display(),
                        number + 1,
                        keys[0],
                        keys[1]
                    ))
                })
        };
        out.push(Example {
            document: field(["dialogue", "document"])?,
            reference: field(["summary", "reference"])?,
        });
    }
    if out.is_empty() {
        return Err(Error::Input(format!("{}: no examples", path.display())));
    }
    Ok(out)
}

#[derive(Debug, Clone, Serialize)]
pub struct EvalReport {
    pub documents: usize,
    pub stemmed: bool,
    /// Mean over documents of ROUGE-1/2/L precision, recall and F-measure.
    pub rouge: RougeScores,
    pub run: RunStats,
}

/// Summarizes every example; returns the report, the predictions and their token ids.
pub fn evaluate(
    session: &mut Session,
    examples: &[Example],
    stem: bool,
    show_progress: bool,
) -> Result<(EvalReport, Vec<String>)> {
    let progress = if show_progress {
        ProgressBar::new(examples.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len} documents ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    progress.set_message("eval");
    let mut predictions = Vec::with_capacity(examples.len());
    let mut scores = Vec::with_capacity(examples.len());
    let mut generations = Vec::with_capacity(examples.len());
    for example in examples {
        let (text, generation, source_tokens) = session.summarize(&example.document)?;
        scores.push(rouge::score(&text, &example.reference, stem));
        predictions.push(text);
        generations.push((source_tokens, generation));
        progress.inc(1);
    }
    progress.finish_and_clear();
    let run = RunStats::new(
        &generations,
        session.stats(),
        &session.plan,
        &session.options.cache,
    );
    Ok((
        EvalReport {
            documents: examples.len(),
            stemmed: stem,
            rouge: rouge::mean(&scores),
            run,
        },
        predictions,
    ))
}
