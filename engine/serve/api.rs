//! The service's JSON: request bodies (strict: an unknown field is refused by name), their
//! checks against the server's [`Limits`], the responses, and [`ApiError`], the JSON error body
//! every failure answers with (`{"error": {"message", "type"}}`, OpenAI's shape).
//!
//! `POST /v1/summarize` takes the options of `edgemoe summarize`; `POST /v1/completions` and
//! `/v1/chat/completions` take OpenAI's names for the options of `edgemoe generate`
//! (`max_tokens` for `--max-new-tokens`, `temperature`, `top_p`, `seed`). Nothing in a request
//! names a file.

use serde::{Deserialize, Serialize};

use crate::config::GenerationDefaults;
use crate::error::Error;
use crate::generation::decoding::DecodeOptions;
use crate::generation::sampling::Sampling;

/// What one request may ask of the server (`edgemoe serve --limit-…`).
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest request body.
    pub body_bytes: usize,
    /// Most documents in one `/v1/summarize` request.
    pub documents: usize,
    /// Longest document (summaries: longer ones are truncated, as `summarize` does) or prompt
    /// (completions: a longer one is refused), in tokens. The working memory is sized for it.
    pub input_tokens: usize,
    /// Most new tokens a request may ask for.
    pub new_tokens: usize,
    /// Widest beam search a request may ask for.
    pub beams: usize,
    /// Time from a request's arrival to its answer (queue wait included).
    pub deadline: std::time::Duration,
}

/// An HTTP error with the JSON body that names what was wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    /// A stable machine-readable name: `invalid_json`, `unknown_field`, `body_too_large`,
    /// `unauthorized`, `wrong_model`, `limit_exceeded`, `invalid_request`, `queue_full`,
    /// `loading`, `shutting_down`, `deadline_exceeded`, `cancelled`, `not_found`, `engine_error`.
    pub kind: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError::new(400, "invalid_request", message)
    }

    pub fn limit(message: impl Into<String>) -> Self {
        ApiError::new(400, "limit_exceeded", message)
    }

    /// A body that is not the JSON of `T`: an unknown field is named as one, anything else
    /// (bad syntax, a missing or mistyped field) is `invalid_json` with serde's message, which
    /// says where.
    pub fn from_json(error: &serde_json::Error) -> Self {
        let message = error.to_string();
        if message.starts_with("unknown field") {
            ApiError::new(400, "unknown_field", message)
        } else {
            ApiError::new(400, "invalid_json", format!("invalid JSON body: {message}"))
        }
    }

    /// A library error met while running a request: the user's input is a 400, a run stopped
    /// on purpose a 503/504, anything else the engine's own failure (500).
    pub fn from_engine(error: &Error, cancelled_because: Option<Stopped>) -> Self {
        match (error, cancelled_because) {
            (Error::Cancelled(_), Some(Stopped::Deadline)) => ApiError::new(
                504,
                "deadline_exceeded",
                "the request's deadline passed before it finished (--request-timeout)",
            ),
            (Error::Cancelled(_), Some(Stopped::Shutdown)) => ApiError::new(
                503,
                "shutting_down",
                "the server is shutting down: the request was cancelled",
            ),
            (Error::Cancelled(_), _) => ApiError::new(499, "cancelled", error.to_string()),
            (Error::Input(message), _) => ApiError::invalid(message.clone()),
            _ => ApiError::new(500, "engine_error", error.to_string()),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind}})
    }
}

/// Why a request was stopped before it finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Its client went away.
    Disconnected,
    /// Its deadline passed.
    Deadline,
    /// The server is shutting down and its grace period is over.
    Shutdown,
}

impl Stopped {
    pub fn name(self) -> &'static str {
        match self {
            Stopped::Disconnected => "disconnect",
            Stopped::Deadline => "deadline",
            Stopped::Shutdown => "shutdown",
        }
    }
}

/// `POST /v1/summarize`: the options of `edgemoe summarize`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SummarizeRequest {
    pub documents: Vec<String>,
    pub max_new_tokens: Option<usize>,
    pub beams: Option<usize>,
    pub max_source_tokens: Option<usize>,
    pub no_repeat_ngram_size: Option<usize>,
}

/// A summarization checked against the limits: what the engine thread runs.
#[derive(Debug, Clone)]
pub struct SummarizeTask {
    pub documents: Vec<String>,
    pub decode: DecodeOptions,
    pub max_source_tokens: usize,
}

impl SummarizeRequest {
    /// The task, with the bundle's defaults where the request says nothing (as `summarize`).
    pub fn check(
        self,
        defaults: &GenerationDefaults,
        limits: &Limits,
    ) -> Result<SummarizeTask, ApiError> {
        if self.documents.is_empty() {
            return Err(ApiError::invalid("`documents` is empty: give at least one"));
        }
        if self.documents.len() > limits.documents {
            return Err(ApiError::limit(format!(
                "{} documents: this server takes at most {} per request (--limit-documents)",
                self.documents.len(),
                limits.documents
            )));
        }
        if let Some(i) = self.documents.iter().position(|d| d.trim().is_empty()) {
            return Err(ApiError::invalid(format!("`documents[{i}]` is empty")));
        }
        let mut decode = DecodeOptions::from_defaults(defaults);
        if let Some(n) = self.max_new_tokens {
            decode.max_new_tokens = n;
        }
        check_new_tokens("max_new_tokens", decode.max_new_tokens, limits)?;
        if let Some(beams) = self.beams {
            if beams == 0 {
                return Err(ApiError::invalid("`beams` must be at least 1"));
            }
            decode.num_beams = beams;
        }
        if decode.num_beams > limits.beams {
            return Err(ApiError::limit(format!(
                "`beams` {}: this server searches at most {} beams (--limit-beams)",
                decode.num_beams, limits.beams
            )));
        }
        if let Some(n) = self.no_repeat_ngram_size {
            decode.no_repeat_ngram_size = n;
        }
        let max_source_tokens = self
            .max_source_tokens
            .unwrap_or(defaults.max_source_tokens.min(limits.input_tokens));
        if max_source_tokens == 0 {
            return Err(ApiError::invalid("`max_source_tokens` must be at least 1"));
        }
        if max_source_tokens > limits.input_tokens {
            return Err(ApiError::limit(format!(
                "`max_source_tokens` {max_source_tokens}: this server reads at most {} tokens per document (--limit-input-tokens)",
                limits.input_tokens
            )));
        }
        Ok(SummarizeTask {
            documents: self.documents,
            decode,
            max_source_tokens,
        })
    }
}

fn check_new_tokens(name: &str, n: usize, limits: &Limits) -> Result<(), ApiError> {
    if n > limits.new_tokens {
        return Err(ApiError::limit(format!(
            "`{name}` {n}: this server generates at most {} tokens per request (--limit-new-tokens)",
            limits.new_tokens
        )));
    }
    Ok(())
}

/// One document's summary: `text` is what `edgemoe summarize` prints for it, `ids` what
/// `summarize --ids` prints.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub text: String,
    /// Tokens generated.
    pub tokens: usize,
    /// Wall time of this document on the engine thread.
    pub ms: f64,
    pub ids: Vec<i64>,
    /// The document's length in tokens as the encoder saw it (after truncation).
    pub source_tokens: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SummarizeResponse {
    pub model: String,
    pub summaries: Vec<Summary>,
}

/// A prompt as text or as token ids (OpenAI allows both).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Ids(Vec<i64>),
}

/// `POST /v1/completions` (OpenAI's names; `max_new_tokens` is taken for `max_tokens`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    /// Accepted and echoed (OpenAI clients always send it); the server runs its one model.
    pub model: Option<String>,
    pub prompt: Prompt,
    #[serde(alias = "max_new_tokens")]
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    /// Completions per prompt: only 1.
    pub n: Option<usize>,
}

/// One message of a chat.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// `POST /v1/chat/completions`: the messages become one prompt ([`chat_prompt`]).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(alias = "max_new_tokens")]
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    pub n: Option<usize>,
}

/// A completion checked against the limits: what the engine thread runs.
#[derive(Debug, Clone)]
pub struct CompletionTask {
    pub prompt: Prompt,
    pub decode: DecodeOptions,
    pub stream: bool,
    pub chat: bool,
}

/// The sampling options both completion endpoints share.
struct SamplingRequest {
    max_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    n: Option<usize>,
}

impl SamplingRequest {
    /// Decoding options as `edgemoe generate` makes them from its flags: greedy unless a
    /// temperature or top-p is given (temperature 1.0 when only top-p is, top-p 1.0 when only
    /// a temperature is, seed 0 unless given). A temperature of 0 means greedy, as in OpenAI's
    /// API.
    fn decode(
        self,
        defaults: &GenerationDefaults,
        limits: &Limits,
    ) -> Result<DecodeOptions, ApiError> {
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "`n`: this server makes one completion per request",
            ));
        }
        if let Some(t) = self.temperature {
            if !(t.is_finite() && t >= 0.0) {
                return Err(ApiError::invalid(format!(
                    "`temperature` {t} must be a number ≥ 0"
                )));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(format!("`top_p` {p} must be in (0, 1]")));
            }
        }
        let mut decode = DecodeOptions::from_defaults(defaults);
        decode.sampling = match (self.temperature, self.top_p) {
            (None, None) => Sampling::Greedy,
            (Some(0.0), _) => Sampling::Greedy,
            (t, p) => Sampling::TopP {
                temperature: t.unwrap_or(1.0),
                top_p: p.unwrap_or(1.0),
                seed: self.seed.unwrap_or(0),
            },
        };
        if let Some(n) = self.max_tokens {
            decode.max_new_tokens = n;
        }
        check_new_tokens("max_tokens", decode.max_new_tokens, limits)?;
        Ok(decode)
    }
}

impl CompletionRequest {
    pub fn check(
        self,
        defaults: &GenerationDefaults,
        limits: &Limits,
    ) -> Result<CompletionTask, ApiError> {
        match &self.prompt {
            Prompt::Text(text) if text.is_empty() => {
                return Err(ApiError::invalid("`prompt` is empty"))
            }
            Prompt::Ids(ids) if ids.is_empty() => {
                return Err(ApiError::invalid("`prompt` has no token ids"))
            }
            _ => {}
        }
        let decode = SamplingRequest {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            n: self.n,
        }
        .decode(defaults, limits)?;
        Ok(CompletionTask {
            prompt: self.prompt,
            decode,
            stream: self.stream,
            chat: false,
        })
    }
}

impl ChatRequest {
    pub fn check(
        self,
        defaults: &GenerationDefaults,
        limits: &Limits,
    ) -> Result<CompletionTask, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("`messages` is empty"));
        }
        let decode = SamplingRequest {
            max_tokens: self.max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            n: self.n,
        }
        .decode(defaults, limits)?;
        Ok(CompletionTask {
            prompt: Prompt::Text(chat_prompt(&self.messages)),
            decode,
            stream: self.stream,
            chat: true,
        })
    }
}

/// The prompt a chat becomes. Bundles carry no chat template, so one plain form is used for
/// every model: a `role: content` line per message, then `assistant:` for the reply
/// (`edgemoe generate --prompt` on this text gives the same tokens).
pub fn chat_prompt(messages: &[ChatMessage]) -> String {
    let mut prompt = String::new();
    for message in messages {
        prompt.push_str(&message.role);
        prompt.push_str(": ");
        prompt.push_str(&message.content);
        prompt.push('\n');
    }
    prompt.push_str("assistant:");
    prompt
}

/// Why a completion ended, in OpenAI's words: `stop` at a stop token, `length` at the limit.
pub fn finish_reason(tokens: &[i64], decode: &DecodeOptions) -> &'static str {
    match tokens.last() {
        Some(last) if decode.stop_token_ids.contains(last) => "stop",
        _ => "length",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EarlyStopping;

    fn defaults() -> GenerationDefaults {
        GenerationDefaults {
            decoder_start_token_id: 0,
            eos_token_id: 1,
            pad_token_id: 0,
            max_new_tokens: 64,
            num_beams: 1,
            length_penalty: 1.0,
            early_stopping: EarlyStopping::False,
            no_repeat_ngram_size: 0,
            max_source_tokens: 512,
            input_prefix: "summarize: ".into(),
            stop_token_ids: vec![1],
        }
    }

    fn limits() -> Limits {
        Limits {
            body_bytes: 1 << 20,
            documents: 4,
            input_tokens: 256,
            new_tokens: 100,
            beams: 4,
            deadline: std::time::Duration::from_secs(60),
        }
    }

    fn summarize(json: &str) -> Result<SummarizeTask, ApiError> {
        serde_json::from_str::<SummarizeRequest>(json)
            .map_err(|e| ApiError::from_json(&e))?
            .check(&defaults(), &limits())
    }

    fn complete(json: &str) -> Result<CompletionTask, ApiError> {
        serde_json::from_str::<CompletionRequest>(json)
            .map_err(|e| ApiError::from_json(&e))?
            .check(&defaults(), &limits())
    }

    #[test]
    fn summaries_take_the_bundle_defaults_and_the_server_limits() {
        let task = summarize(r#"{"documents": ["a"]}"#).unwrap();
        assert_eq!(task.decode.max_new_tokens, 64);
        assert_eq!(task.decode.num_beams, 1);
        // The model's 512 source tokens, cut to what the server's working memory allows.
        assert_eq!(task.max_source_tokens, 256);
        let task = summarize(r#"{"documents": ["a"], "beams": 3, "max_new_tokens": 7}"#).unwrap();
        assert_eq!((task.decode.num_beams, task.decode.max_new_tokens), (3, 7));
        let error = summarize(r#"{"documents": ["a"], "max_source_tokens": 300}"#).unwrap_err();
        assert_eq!(error.kind, "limit_exceeded");
        assert!(error.message.contains("--limit-input-tokens"), "{error:?}");
        let error = summarize(r#"{"documents": ["a"], "beams": 0}"#).unwrap_err();
        assert_eq!(error.kind, "invalid_request");
        let error = summarize(r#"{"documents": ["a"], "top_k": 5}"#).unwrap_err();
        assert_eq!(error.kind, "unknown_field");
        assert!(error.message.contains("`top_k`"), "{error:?}");
    }

    #[test]
    fn completions_sample_as_generate_does() {
        let greedy = complete(r#"{"prompt": "x"}"#).unwrap();
        assert_eq!(greedy.decode.sampling, Sampling::Greedy);
        assert!(!greedy.stream);
        let zero = complete(r#"{"prompt": "x", "temperature": 0, "top_p": 0.5}"#).unwrap();
        assert_eq!(zero.decode.sampling, Sampling::Greedy);
        let top_p = complete(r#"{"prompt": [1, 2], "top_p": 0.9, "max_new_tokens": 5}"#).unwrap();
        assert_eq!(
            top_p.decode.sampling,
            Sampling::TopP {
                temperature: 1.0,
                top_p: 0.9,
                seed: 0
            }
        );
        assert_eq!(top_p.decode.max_new_tokens, 5);
        let warm = complete(r#"{"prompt": "x", "temperature": 0.7, "seed": 9}"#).unwrap();
        assert_eq!(
            warm.decode.sampling,
            Sampling::TopP {
                temperature: 0.7,
                top_p: 1.0,
                seed: 9
            }
        );
        for (json, needle) in [
            (r#"{"prompt": "x", "temperature": -1}"#, "`temperature`"),
            (r#"{"prompt": "x", "top_p": 1.5}"#, "`top_p`"),
            (r#"{"prompt": "x", "n": 2}"#, "`n`"),
            (r#"{"prompt": ""}"#, "`prompt` is empty"),
            (
                r#"{"prompt": "x", "max_tokens": 101}"#,
                "--limit-new-tokens",
            ),
        ] {
            let error = complete(json).unwrap_err();
            assert!(error.message.contains(needle), "{json}: {error:?}");
        }
    }

    #[test]
    fn a_chat_is_one_plain_prompt() {
        let messages = [
            ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        assert_eq!(
            chat_prompt(&messages),
            "system: Be brief.\nuser: Hi\nassistant:"
        );
    }
}
