//! A bundle's tokenizer (T5's SentencePiece for Switch; the decoder-only families' BPE), through
//! the `tokenizers` crate (the same code Hugging Face's fast tokenizer runs, so ids match
//! `AutoTokenizer` exactly).

use std::path::{Path, PathBuf};

use tokenizers::{TruncationDirection, TruncationParams, TruncationStrategy};

use crate::error::{Error, Result};

pub struct Tokenizer {
    path: PathBuf,
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn load(path: &Path) -> Result<Self> {
        if !path.exists() {
            return Err(Error::io(
                path,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer file not found"),
            ));
        }
        crate::io::check_regular_file(path)?;
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error::Tokenizer {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(Tokenizer {
            path: path.to_path_buf(),
            inner,
        })
    }

    /// Ids of `text` with `</s>` appended, truncated to `max_tokens` (keeping `</s>`), as
    /// `tokenizer(text, truncation=True, max_length=max_tokens)` does.
    pub fn encode(&self, text: &str, max_tokens: usize) -> Result<Vec<i64>> {
        let mut tokenizer = self.inner.clone();
        tokenizer
            .with_truncation(Some(TruncationParams {
                max_length: max_tokens,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
                direction: TruncationDirection::Right,
            }))
            .map_err(|e| self.error(e))?;
        let encoding = tokenizer.encode(text, true).map_err(|e| self.error(e))?;
        Ok(encoding.get_ids().iter().map(|&id| id as i64).collect())
    }

    /// Ids of `text` with the tokenizer's special tokens (a BOS, an EOS: whatever its
    /// post-processor adds, as `tokenizer(text)` does), without truncation.
    pub fn encode_all(&self, text: &str) -> Result<Vec<i64>> {
        let encoding = self.inner.encode(text, true).map_err(|e| self.error(e))?;
        Ok(encoding.get_ids().iter().map(|&id| id as i64).collect())
    }

    /// Text of `ids` without special tokens.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids
            .iter()
            .filter(|&&id| id >= 0 && id <= u32::MAX as i64)
            .map(|&id| id as u32)
            .collect();
        self.inner.decode(&ids, true).map_err(|e| self.error(e))
    }

    fn error(&self, e: impl std::fmt::Display) -> Error {
        Error::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }
}
