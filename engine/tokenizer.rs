//! A bundle's tokenizer (T5's SentencePiece for Switch; the decoder-only families' BPE), through
//! the `tokenizers` crate (the same code Hugging Face's fast tokenizer runs, so ids match
//! `AutoTokenizer` exactly).
//!
//! A `tokenizer.json` is the user's file, and the `tokenizers` crate panics on some malformed
//! ones (a syntax error inside its `decoder`, a post-processor template naming a special token
//! it does not define). So the file is parsed as JSON first, every call into the crate runs
//! under [`guarded`], which turns a panic into an error naming the file, and loading tries the
//! file once on a short text, so a broken tokenizer is refused when it is loaded.

use std::cell::Cell;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Once};

use tokenizers::{TruncationDirection, TruncationParams, TruncationStrategy};

use crate::config::BundleConfig;
use crate::error::{Error, Result};

pub struct Tokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
    /// A copy of `inner` that truncates to the `usize` tokens it was last asked for. Making one
    /// copies the whole vocabulary (T5's: ~25 ms, a fifth of a short summary's wall time on the
    /// demo model), so [`Self::encode`] keeps it for the next text, which nearly always has the
    /// same limit.
    truncating: Mutex<Option<(usize, Arc<tokenizers::Tokenizer>)>>,
}

impl Tokenizer {
    pub fn load(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer file not found"),
            ));
        }
        Self::from_bytes(path, &crate::io::read_bytes(path)?)
    }

    /// The tokenizer in `bytes` (a `tokenizer.json`), read from `path` (named in errors).
    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<Self> {
        let error = |message: String| Error::Tokenizer {
            path: path.to_path_buf(),
            message,
        };
        serde_json::from_slice::<serde::de::IgnoredAny>(bytes)
            .map_err(|e| error(format!("not valid JSON: {e}")))?;
        let inner = guarded(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(error)?
            .map_err(|e| error(e.to_string()))?;
        let tokenizer = Tokenizer {
            path: path.to_path_buf(),
            inner,
            truncating: Mutex::new(None),
        };
        // What every run asks of it, on a text with words, digits, punctuation and non-ASCII.
        let probe = tokenizer.encode_all("Anna: 2 cafés, ok?")?;
        tokenizer.decode(&probe)?;
        Ok(tokenizer)
    }

    /// Fails unless this tokenizer can belong to the model of `config`: every id it produces
    /// is a row of the model's embedding (`vocab_size`; models often pad their vocabulary, so
    /// fewer tokens are fine), and the special tokens the engine feeds or stops on (decoder
    /// start, EOS and every stop token, pad) are tokens of it. A tokenizer from another model
    /// fails here instead of indexing past the embedding or never producing an EOS.
    pub fn check_against(&self, config: &BundleConfig) -> Result<()> {
        let tokens = self
            .guard(|| self.inner.get_vocab(true))?
            .values()
            .map(|&id| id as u64 + 1)
            .max()
            .unwrap_or(0);
        let rows = config.model.vocab_size() as u64;
        if tokens > rows {
            return Err(self.error(format!(
                "its ids go up to {} but the model's vocabulary has {rows} tokens (`vocab_size`): a tokenizer from another model?",
                tokens - 1
            )));
        }
        let g = &config.generation;
        let start = if config.model.has_encoder() {
            "decoder_start_token_id"
        } else {
            "bos_token_id"
        };
        let specials = [
            (start, g.decoder_start_token_id),
            ("eos_token_id", g.eos_token_id),
            ("pad_token_id", g.pad_token_id),
        ]
        .into_iter()
        .chain(g.stop_token_ids.iter().map(|&id| ("eos_token_id", id)));
        for (field, id) in specials {
            // -1: a decoder-only model without an EOS.
            if id >= tokens as i64 {
                return Err(self.error(format!(
                    "the model's `{field}` {id} is not one of its {tokens} tokens: a tokenizer from another model?"
                )));
            }
        }
        Ok(())
    }

    /// Ids of `text` with `</s>` appended, truncated to `max_tokens` (keeping `</s>`), as
    /// `tokenizer(text, truncation=True, max_length=max_tokens)` does.
    ///
    /// Only a prefix of a long `text` is tokenized: one ending at a word's end (before
    /// whitespace), grown geometrically until its encoding is truncated. Pre-tokenization splits
    /// at whitespace, so every token of a prefix of whole words is the full text's token, and the
    /// result is the full text's. Text without whitespace is tokenized whole.
    pub fn encode(&self, text: &str, max_tokens: usize) -> Result<Vec<i64>> {
        let tokenizer = self.truncating(max_tokens)?;
        bounded(text, max_tokens, Direction::First, |piece, whole| {
            let encoding = self
                .guard(|| tokenizer.encode(piece, true))?
                .map_err(|e| self.error(e))?;
            if !whole && encoding.get_overflowing().is_empty() {
                return Ok(None);
            }
            Ok(Some(ids(encoding.get_ids())))
        })
    }

    /// The tokenizer truncating to `max_tokens`: the one kept from the last call with this
    /// limit, or a new one (kept in its place).
    fn truncating(&self, max_tokens: usize) -> Result<Arc<tokenizers::Tokenizer>> {
        let mut kept = self.truncating.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((max, tokenizer)) = kept.as_ref() {
            if *max == max_tokens {
                return Ok(Arc::clone(tokenizer));
            }
        }
        let mut tokenizer = self.inner.clone();
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| self.error(e))?;
        let tokenizer = Arc::new(tokenizer);
        *kept = Some((max_tokens, Arc::clone(&tokenizer)));
        Ok(tokenizer)
    }

    /// Ids of `text` with the tokenizer's special tokens (a BOS, an EOS: whatever its
    /// post-processor adds, as `tokenizer(text)` does), without truncation.
    pub fn encode_all(&self, text: &str) -> Result<Vec<i64>> {
        let encoding = self
            .guard(|| self.inner.encode(text, true))?
            .map_err(|e| self.error(e))?;
        Ok(ids(encoding.get_ids()))
    }

    /// The last `max_tokens` ids of [`Self::encode_all`]`(text)`, tokenizing only a suffix of a
    /// long `text`: one starting at a word (after whitespace), grown geometrically until it holds
    /// enough tokens. The suffix's first word may be tokenized differently than in the full text
    /// (a byte-level BPE attaches the space before it), so its tokens are dropped; every token
    /// after the suffix's first whitespace is the full text's, as pre-tokenization never joins
    /// text across a word's start. Text without whitespace is tokenized whole.
    pub fn encode_last(&self, text: &str, max_tokens: usize) -> Result<Vec<i64>> {
        let max = max_tokens.max(1);
        bounded(text, max, Direction::Last, |piece, whole| {
            let encoding = self
                .guard(|| self.inner.encode(piece, true))?
                .map_err(|e| self.error(e))?;
            let all = encoding.get_ids();
            if whole {
                return Ok(Some(ids(&all[all.len().saturating_sub(max)..])));
            }
            let Some(first_space) = piece.find(char::is_whitespace) else {
                return Ok(None);
            };
            let special = encoding.get_special_tokens_mask();
            let offsets = encoding.get_offsets();
            // Trailing special tokens (an EOS) come after the text's tokens in any case.
            let trailing = special.iter().rev().take_while(|&&s| s == 1).count();
            let body = all.len() - trailing;
            let trusted = (0..body)
                .find(|&i| special[i] == 0 && offsets[i].0 >= first_space)
                .map_or(0, |i| body - i);
            if trusted + trailing < max {
                return Ok(None);
            }
            Ok(Some(ids(&all[all.len() - max..])))
        })
    }

    /// Text of `ids` without special tokens.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids
            .iter()
            .filter(|&&id| id >= 0 && id <= u32::MAX as i64)
            .map(|&id| id as u32)
            .collect();
        self.guard(|| self.inner.decode(&ids, true))?
            .map_err(|e| self.error(e))
    }

    fn guard<T>(&self, call: impl FnOnce() -> T) -> Result<T> {
        guarded(call).map_err(|message| self.error(message))
    }

    fn error(&self, e: impl std::fmt::Display) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }
}

thread_local! {
    /// Whether this thread is inside [`guarded`], whose panics are reported as errors.
    static GUARDED: Cell<bool> = const { Cell::new(false) };
    /// The message of the last panic caught by [`guarded`] on this thread.
    static CAUGHT: Cell<Option<String>> = const { Cell::new(None) };
}

/// Runs `call` (a call into the `tokenizers` crate), turning a panic in it into `Err` with
/// the panic's message. Such a panic is not printed: a panic hook, installed once and
/// deferring to the previous hook everywhere else, records it for the error instead.
fn guarded<T>(call: impl FnOnce() -> T) -> std::result::Result<T, String> {
    static QUIET_HOOK: Once = Once::new();
    QUIET_HOOK.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) {
                let location = info
                    .location()
                    .map(|l| format!(" (at {}:{})", l.file(), l.line()))
                    .unwrap_or_default();
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".to_string());
                CAUGHT.with(|c| c.set(Some(format!("{message}{location}"))));
            } else {
                previous(info);
            }
        }));
    });
    let outer = GUARDED.with(|g| g.replace(true));
    let result = panic::catch_unwind(AssertUnwindSafe(call));
    GUARDED.with(|g| g.set(outer));
    result.map_err(|_| {
        let message = CAUGHT
            .with(Cell::take)
            .unwrap_or_else(|| "a panic".to_string());
        format!("the tokenizers library cannot use this file: {message}")
    })
}

fn ids(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&id| id as i64).collect()
}

/// Which end of a text a truncated encoding keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    First,
    Last,
}

/// Bytes of text the first attempt tokenizes per wanted token; a token of ordinary text is a
/// few bytes, so most documents need one attempt.
const BYTES_PER_TOKEN: usize = 8;

/// Runs `attempt` on ever longer (doubling) pieces of `text` from the `direction` end, cut at a
/// word boundary ([`cut`]), until it returns `Some`; `attempt(piece, whole)` must return `Some`
/// when `whole` (the piece is all of `text`). The longest piece tried is about twice the one
/// that sufficed, so the work is bounded by `max_tokens`, not by the text's length.
pub(crate) fn bounded<T>(
    text: &str,
    max_tokens: usize,
    direction: Direction,
    mut attempt: impl FnMut(&str, bool) -> Result<Option<T>>,
) -> Result<T> {
    let mut bytes = max_tokens.max(1).saturating_mul(BYTES_PER_TOKEN).max(256);
    loop {
        if bytes >= text.len() || max_tokens < 2 {
            return attempt(text, true)?.ok_or_else(|| Error::Input("no encoding".into()));
        }
        if let Some(piece) = cut(text, bytes, direction) {
            if let Some(done) = attempt(piece, false)? {
                return Ok(done);
            }
        }
        bytes = bytes.saturating_mul(2);
    }
}

/// At most `bytes` bytes from the `direction` end of `text`, cut at a word boundary: a prefix
/// ends where whitespace follows a non-whitespace char, a suffix starts where a non-whitespace
/// char follows whitespace. `None` if there is no such boundary in range.
pub(crate) fn cut(text: &str, bytes: usize, direction: Direction) -> Option<&str> {
    match direction {
        Direction::First => {
            let mut end = bytes.min(text.len());
            while !text.is_char_boundary(end) {
                end -= 1;
            }
            let head = &text[..end];
            let mut previous_word = false;
            let mut found = None;
            for (i, c) in head.char_indices() {
                let space = c.is_whitespace();
                if space && previous_word {
                    found = Some(i);
                }
                previous_word = !space;
            }
            // The char right after the head may be the whitespace that ends its last word.
            if previous_word && text[end..].starts_with(char::is_whitespace) {
                found = Some(end);
            }
            found.filter(|&i| i > 0).map(|i| &text[..i])
        }
        Direction::Last => {
            let mut start = text.len().saturating_sub(bytes);
            while !text.is_char_boundary(start) {
                start += 1;
            }
            let before = text[..start].chars().next_back();
            let mut previous_space = before.is_some_and(char::is_whitespace);
            for (i, c) in text[start..].char_indices() {
                let space = c.is_whitespace();
                if !space && previous_space {
                    return Some(&text[start + i..]);
                }
                previous_space = space;
            }
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer(path: &str) -> Tokenizer {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        Tokenizer::load(&root.join(path)).unwrap()
    }

    fn texts() -> Vec<String> {
        let dialogue = "Anna: Hi Bob!  Are we still on for lunch at 12:30?\nBob: Yes, see you \
                        at Café Zoë's.\r\n\tAnna: great... don't be late!!! \u{1F600}  ";
        let mut texts = vec![
            String::new(),
            "short text".to_string(),
            dialogue.to_string(),
            "x".repeat(5000),
            format!("{}{}", "y".repeat(3000), " tail words here"),
        ];
        for n in [3usize, 40, 200, 2000] {
            texts.push(dialogue.repeat(n));
            texts.push(format!("   {}", dialogue.repeat(n)));
            texts.push(format!("{}   ", dialogue.repeat(n)));
        }
        let words: String = (0..20000)
            .map(|i| {
                format!(
                    "w{}{} ",
                    i * 7919 % 1000,
                    ["", ",", ".\n", "  ", "é"][i % 5]
                )
            })
            .collect();
        texts.push(words);
        texts
    }

    #[test]
    fn bounded_encodings_equal_full_ones() {
        let t5 = tokenizer("models/switch-samsum-tiny/tokenizer.json");
        // Limit by limit, and back to one already used: `encode` keeps a truncating tokenizer
        // from one call to the next, which must follow the limit.
        for max in [2, 5, 64, 512, 5] {
            for text in texts() {
                let mut full = t5.inner.clone();
                full.with_truncation(Some(TruncationParams {
                    max_length: max,
                    strategy: TruncationStrategy::LongestFirst,
                    stride: 0,
                    direction: TruncationDirection::Right,
                }))
                .unwrap();
                let expected = ids(full.encode(text.as_str(), true).unwrap().get_ids());
                assert_eq!(t5.encode(&text, max).unwrap(), expected, "{max} {text:.80}");
            }
        }
        for path in [
            "tests/fixtures/tiny-qwen2-moe/tokenizer.json",
            "tests/fixtures/tiny-mixtral/tokenizer.json",
            "models/switch-samsum-tiny/tokenizer.json",
        ] {
            let tok = tokenizer(path);
            for text in texts() {
                let all = tok.encode_all(&text).unwrap();
                for max in [1, 5, 64, 512] {
                    let expected = all[all.len().saturating_sub(max)..].to_vec();
                    assert_eq!(
                        tok.encode_last(&text, max).unwrap(),
                        expected,
                        "{path} {max} {text:.80}"
                    );
                }
            }
        }
    }

    #[test]
    fn long_text_is_tokenized_in_bounded_pieces() {
        let text = "Anna: shall we meet tomorrow at noon? ".repeat(100_000); // ~3.8 MB
        for direction in [Direction::First, Direction::Last] {
            let mut seen = 0;
            let mut tries = 0;
            let got = bounded(&text, 512, direction, |piece, whole| {
                assert!(!whole);
                seen += piece.len();
                tries += 1;
                // Pretend a token is 4 bytes.
                Ok((piece.len() / 4 > 512).then_some(piece.len()))
            })
            .unwrap();
            assert!(got <= 512 * BYTES_PER_TOKEN, "{got}");
            assert!(
                seen <= 4 * 512 * BYTES_PER_TOKEN,
                "{seen} bytes in {tries} tries"
            );
        }
        let t5 = tokenizer("models/switch-samsum-tiny/tokenizer.json");
        assert_eq!(t5.encode(&text, 512).unwrap().len(), 512);
        assert_eq!(t5.encode_last(&text, 512).unwrap().len(), 512);
    }

    /// Files the `tokenizers` crate panicked on (found by fuzzing, `fuzz/regressions/tokenizer/`):
    /// each is refused when loaded, with an error naming the file and saying why.
    #[test]
    fn tokenizer_files_the_library_panics_on_are_refused_by_name() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions/tokenizer");
        for (file, why) in [
            ("decoder-syntax-error.json", "not valid JSON"),
            ("template-second-sequence.json", "cannot use this file"),
            (
                "template-undefined-special-token.json",
                "cannot use this file",
            ),
        ] {
            let path = dir.join(file);
            match Tokenizer::load(&path) {
                Ok(_) => panic!("{file} was accepted"),
                Err(e) => {
                    let message = e.to_string();
                    assert!(message.contains(file), "{message}");
                    assert!(message.contains(why), "{message}");
                }
            }
        }
        // The same calls on a sound file still work, and a panic outside a guard is a panic.
        tokenizer("models/switch-samsum-tiny/tokenizer.json");
        assert!(std::panic::catch_unwind(|| panic!("not guarded")).is_err());
        assert_eq!(guarded(|| 7), Ok(7));
    }

    #[test]
    fn cuts_fall_at_word_boundaries() {
        assert_eq!(cut("ab cd ef", 4, Direction::First), Some("ab"));
        assert_eq!(cut("ab cd ef", 5, Direction::First), Some("ab cd"));
        assert_eq!(cut("abcdef gh", 4, Direction::First), None);
        assert_eq!(cut("ab cd ef", 4, Direction::Last), Some("ef"));
        assert_eq!(cut("ab cd ef", 5, Direction::Last), Some("cd ef"));
        assert_eq!(cut("ab cdefgh", 4, Direction::Last), None);
        assert_eq!(cut("é é é", 4, Direction::Last), Some("é"));
        assert_eq!(cut("é é é", 4, Direction::First), Some("é"));
    }
}
