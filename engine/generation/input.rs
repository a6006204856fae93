//! The user's text as the model sees it: input split into documents (one plain document, or
//! JSON lines with a `dialogue`/`document` field), and a document flattened behind the model's
//! input prefix.

use crate::error::{Error, Result};

/// One JSON object of a JSON-lines file or a JSON array, with where it was (`line 3`,
/// `element 2`) for errors.
pub struct Record {
    pub place: String,
    pub value: serde_json::Value,
}

impl Record {
    /// The first of `keys` that is a string field of this record.
    pub fn field(&self, keys: &[&str], source: &str) -> Result<String> {
        keys.iter()
            .find_map(|key| self.value.get(key).and_then(|v| v.as_str()))
            .map(str::to_string)
            .ok_or_else(|| {
                let names: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
                Error::Input(format!(
                    "{source} {}: no string field {}",
                    self.place,
                    names.join(" or ")
                ))
            })
    }
}

/// Reads `text` as JSON if it looks like JSON, `None` if it is plain text. A leading UTF-8
/// byte-order mark is skipped. Text whose first non-empty line starts with `{` is JSON lines:
/// every non-empty line must be one JSON object (CRLF line ends are fine), an invalid line is an
/// error naming its number; it is never read as plain text instead. Text that starts with `[`
/// followed (after whitespace) by `{` or `]` is one JSON array of objects. Anything else,
/// including text starting with `[` and a word (`[10:32] Anna: hi`), is plain text.
pub fn json_records(text: &str, source: &str) -> Result<Option<Vec<Record>>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let trimmed = text.trim_start();
    if let Some(rest) = trimmed.strip_prefix('[') {
        if !rest.trim_start().starts_with(['{', ']']) {
            return Ok(None);
        }
        let values: Vec<serde_json::Value> = serde_json::from_str(text)
            .map_err(|e| Error::Input(format!("{source}: invalid JSON array of objects: {e}")))?;
        return values
            .into_iter()
            .enumerate()
            .map(|(i, value)| {
                let place = format!("element {}", i + 1);
                if !value.is_object() {
                    return Err(Error::Input(format!("{source} {place}: not a JSON object")));
                }
                Ok(Record { place, value })
            })
            .collect::<Result<Vec<_>>>()
            .map(Some);
    }
    if !trimmed.starts_with('{') {
        return Ok(None);
    }
    let mut records = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let place = format!("line {}", number + 1);
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            Error::Input(format!(
                "{source} {place}: invalid JSON: {e} (input whose first line starts with `{{` \
                 is read as JSON lines, one object per line)"
            ))
        })?;
        if !value.is_object() {
            return Err(Error::Input(format!("{source} {place}: not a JSON object")));
        }
        records.push(Record { place, value });
    }
    Ok(Some(records))
}

/// Splits user input into documents: JSON lines or a JSON array of objects (see
/// [`json_records`]), one document per object from its `dialogue` or `document` field; anything
/// else is one document (with a leading byte-order mark removed). `source` names the input in
/// errors. Only an input with no text at all is an error; an empty `dialogue` is summarized like
/// any other.
pub fn parse_documents(text: &str, source: &str) -> Result<Vec<String>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if text.trim().is_empty() {
        return Err(Error::Input(format!(
            "empty input: {source} has no text to summarize"
        )));
    }
    let Some(records) = json_records(text, source)? else {
        return Ok(vec![text.to_string()]);
    };
    if records.is_empty() {
        return Err(Error::Input(format!(
            "empty input: {source} is an empty JSON array"
        )));
    }
    // An empty document still gets its (one-line) summary, so outputs stay line-aligned.
    records
        .iter()
        .map(|r| r.field(&["dialogue", "document"], source))
        .collect()
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
    fn byte_order_mark_is_skipped() {
        let text = "\u{feff}{\"dialogue\": \"a\"}\n{\"dialogue\": \"b\"}\n";
        assert_eq!(parse_documents(text, "f").unwrap(), vec!["a", "b"]);
        let plain = parse_documents("\u{feff}Anna: hi", "f").unwrap();
        assert_eq!(plain, vec!["Anna: hi"]);
    }

    #[test]
    fn json_array_is_documents() {
        let text = "[\n  {\"dialogue\": \"a\"},\n  {\"document\": \"b\"}\n]\n";
        assert_eq!(parse_documents(text, "f").unwrap(), vec!["a", "b"]);
        let bom = format!("\u{feff}{text}");
        assert_eq!(parse_documents(&bom, "f").unwrap(), vec!["a", "b"]);
        let missing = parse_documents("[{\"dialogue\": \"a\"}, {\"x\": 1}]", "f")
            .unwrap_err()
            .to_string();
        assert!(missing.contains("element 2"), "{missing}");
        let broken = parse_documents("[{\"dialogue\": \"a\"},", "f");
        assert!(broken.unwrap_err().to_string().contains("invalid JSON"));
        assert!(parse_documents("[]", "f").is_err());
        // A bracket and a word is a plain-text dialogue.
        let plain = "[10:32] Anna: hi\n[10:33] Bob: hello";
        assert_eq!(parse_documents(plain, "f").unwrap(), vec![plain]);
    }

    #[test]
    fn invalid_json_line_is_named_never_plain_text() {
        let text = "\u{feff}{\"dialogue\": \"a\"}\n\nAnna: hi\n";
        let err = parse_documents(text, "in.jsonl").unwrap_err().to_string();
        assert!(
            err.contains("in.jsonl line 3") && err.contains("invalid JSON"),
            "{err}"
        );
        let text = "{\"dialogue\": \"a\"}\n[1, 2]\n";
        let err = parse_documents(text, "f").unwrap_err().to_string();
        assert!(
            err.contains("line 2") && err.contains("not a JSON object"),
            "{err}"
        );
    }

    #[test]
    fn crlf_json_lines() {
        let text = "\u{feff}{\"dialogue\": \"a\"}\r\n\r\n{\"dialogue\": \"b\\r\\nc\"}\r\n";
        assert_eq!(parse_documents(text, "f").unwrap(), vec!["a", "b\r\nc"]);
    }

    #[test]
    fn line_breaks_become_spaces() {
        assert_eq!(
            model_input("A: x\r\nB: y\nC", "summarize: "),
            "summarize: A: x B: y C"
        );
    }
}
