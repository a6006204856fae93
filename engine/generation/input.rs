//! The user's text as the model sees it: input split into documents (one plain document, or
//! JSON lines with a `dialogue`/`document` field), and a document flattened behind the model's
//! input prefix.

use crate::error::{Error, Result};

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
