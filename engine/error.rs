//! The library's one error type. Every variant carries the context a user needs to fix the
//! problem: which file, which tensor, which expert, what was expected and what was found. The
//! variants say whose the problem is: the user's input or flags ([`Error::Input`]), a file that
//! is not what it claims ([`Error::Format`], [`Error::Unsupported`], [`Error::Tensor`]), a
//! damaged bundle ([`Error::Corrupt`], [`Error::Checksum`]), a run stopped on purpose
//! ([`Error::Cancelled`]), or the engine itself ([`Error::Internal`]: a broken invariant or a
//! thread that died, never the user's doing).

use std::path::PathBuf;

use crate::ids::ExpertId;
use crate::units::{format_bytes, InvalidSize};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A file exists but its content is not what the format requires (bad magic, unsupported
    /// version, truncated, malformed JSON/bincode).
    #[error("{}: {message}", path.display())]
    Format { path: PathBuf, message: String },

    /// A well-formed model config that this engine does not implement.
    #[error("{}: unsupported model: {message}", path.display())]
    Unsupported { path: PathBuf, message: String },

    /// A tensor that is missing, has the wrong shape or an unsupported dtype.
    #[error("{}: tensor `{name}`: {message}", path.display())]
    Tensor {
        path: PathBuf,
        name: String,
        message: String,
    },

    #[error("{}: {expert}: checksum mismatch (index says {expected:08x}, data gives {actual:08x}); the expert store is corrupted, convert the model again", path.display())]
    Checksum {
        path: PathBuf,
        expert: ExpertId,
        expected: u32,
        actual: u32,
    },

    #[error("memory budget {budget} is too small: resident weights take {resident}, working memory {working}, {slots} expert slot(s) {slot} each; the minimum budget is {minimum} ({minimum_bytes} bytes)",
        budget = format_bytes(*budget_bytes),
        resident = format_bytes(*resident_bytes),
        working = format_bytes(*working_bytes),
        slot = format_bytes(*slot_bytes),
        minimum = format_bytes(*minimum_bytes))]
    BudgetTooSmall {
        budget_bytes: u64,
        resident_bytes: u64,
        working_bytes: u64,
        slot_bytes: u64,
        slots: usize,
        minimum_bytes: u64,
    },

    /// A bundle file damaged after it was written: a truncated expert store, an index that
    /// fails its checksum or disagrees with the model, an expert whose blob is missing.
    #[error("{}: {message}{}; the model bundle is damaged, convert the model again",
        path.display(),
        expert.map(|e| format!(" ({e})")).unwrap_or_default())]
    Corrupt {
        path: PathBuf,
        expert: Option<ExpertId>,
        message: String,
    },

    /// Bad user input: an empty document, an unparsable budget, a JSON line without text,
    /// options that do not go together.
    #[error("{0}")]
    Input(String),

    /// A decoding call ended early on purpose: its client went away, its deadline passed, or
    /// the service is shutting down (see `generation::decoding::Cancellation`).
    #[error("cancelled: {0}")]
    Cancelled(String),

    /// A failure of the engine itself (a broken invariant, a worker thread that stopped); not
    /// caused by the user's input.
    #[error("internal error: {0} (this is a bug in edgemoe; please report it)")]
    Internal(String),

    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },

    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

pub type Result<T> = std::result::Result<T, Error>;

impl From<InvalidSize> for Error {
    fn from(e: InvalidSize) -> Self {
        Error::Input(e.0)
    }
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            message: message.into(),
        }
    }

    pub fn corrupt(
        path: impl Into<PathBuf>,
        expert: Option<ExpertId>,
        message: impl Into<String>,
    ) -> Self {
        Error::Corrupt {
            path: path.into(),
            expert,
            message: message.into(),
        }
    }

    pub fn tensor(
        path: impl Into<PathBuf>,
        name: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            path: path.into(),
            name: name.into(),
            message: message.into(),
        }
    }
}
