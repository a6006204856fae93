//! `eval`: summarize a reference corpus and score it with ROUGE, with speed and cache figures.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::generation::input::json_records;
use crate::generation::report::RunStats;
use crate::generation::session::Session;
use crate::offline::rouge::{self, RougeScores};

/// A document with its reference summary.
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub document: String,
    pub reference: String,
}

/// Reads JSON lines (or a JSON array of objects) with a `dialogue`/`document` field and a
/// `summary`/`reference` field.
pub fn read_examples(path: &Path, limit: Option<usize>) -> Result<Vec<Example>> {
    let text = crate::io::read_input_text(path)?;
    parse_examples(&text, &path.display().to_string(), limit)
}

/// Examples of JSON lines or a JSON array of objects (read by
/// [`crate::generation::input::json_records`]: a byte-order mark is skipped, an invalid line
/// is an error naming it), at most `limit` of them.
pub fn parse_examples(text: &str, source: &str, limit: Option<usize>) -> Result<Vec<Example>> {
    let records = json_records(text, source)?.ok_or_else(|| {
        Error::Input(format!(
            "{source}: not JSON lines or a JSON array of objects with `dialogue` and `summary`"
        ))
    })?;
    let out = records
        .iter()
        .take(limit.unwrap_or(usize::MAX))
        .map(|r| {
            Ok(Example {
                document: r.field(&["dialogue", "document"], source)?,
                reference: r.field(&["summary", "reference"], source)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if out.is_empty() {
        return Err(Error::Input(format!("{source}: no examples")));
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
        scores.push(rouge::score(&text, &example.reference, stem)?);
        predictions.push(text);
        generations.push((source_tokens, generation));
        progress.inc(1);
    }
    progress.finish_and_clear();
    let mut run = RunStats::new(
        &generations,
        session.stats(),
        &session.plan,
        &session.options.cache,
    );
    run.kv_cache = session.options.decode.kv_cache;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn example(d: &str, r: &str) -> Example {
        Example {
            document: d.into(),
            reference: r.into(),
        }
    }

    #[test]
    fn examples_from_bom_crlf_lines_and_arrays() {
        let lines = "\u{feff}{\"dialogue\": \"a\", \"summary\": \"x\"}\r\n\r\n\
                     {\"document\": \"b\", \"reference\": \"y\"}\r\n";
        let want = vec![example("a", "x"), example("b", "y")];
        assert_eq!(parse_examples(lines, "f", None).unwrap(), want);
        assert_eq!(parse_examples(lines, "f", Some(1)).unwrap(), want[..1]);
        let array = "[{\"dialogue\": \"a\", \"summary\": \"x\"},\n \
                     {\"document\": \"b\", \"reference\": \"y\"}]";
        assert_eq!(parse_examples(array, "f", None).unwrap(), want);
    }

    #[test]
    fn bad_example_lines_are_named() {
        let text = "\u{feff}{\"dialogue\": \"a\", \"summary\": \"x\"}\nnot json\n";
        let err = parse_examples(text, "ref.jsonl", None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("ref.jsonl line 2"), "{err}");
        let text = "{\"dialogue\": \"a\"}";
        let err = parse_examples(text, "f", None).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("summary"), "{err}");
        assert!(parse_examples("plain text", "f", None).is_err());
    }
}
