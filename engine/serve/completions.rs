//! `POST /v1/completions` and `/v1/chat/completions` in OpenAI's shapes: the whole answer as
//! one JSON object, or with `"stream": true` server-sent events — one `data: {chunk}` per token,
//! a last chunk with `finish_reason` and `usage`, then `data: [DONE]`. The first reply of the
//! engine thread (the prompt taken, or an error) comes before any event, so a refused prompt is
//! a plain JSON error with its status.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::{ApiError, ChatRequest, CompletionRequest, CompletionTask};
use super::metrics::Endpoint;
use super::routes::{enqueue, expect_kind, internal, parse, refused, AppState, CancelOnDrop};
use super::worker::{Reply, Task};

pub(super) async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let endpoint = Endpoint::Completions;
    let task = expect_kind(&state, endpoint)
        .and_then(|()| parse::<CompletionRequest>(&state, body))
        .and_then(|request| request.check(&state.defaults, &state.limits));
    complete(state, id, endpoint, task).await
}

pub(super) async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let endpoint = Endpoint::ChatCompletions;
    let task = expect_kind(&state, endpoint)
        .and_then(|()| parse::<ChatRequest>(&state, body))
        .and_then(|request| request.check(&state.defaults, &state.limits));
    complete(state, id, endpoint, task).await
}

/// The OpenAI-shaped pieces of one completion's answer.
struct CompletionShape {
    id: String,
    created: u64,
    model: String,
    chat: bool,
}

impl CompletionShape {
    fn new(id: u64, model: &str, chat: bool) -> Self {
        CompletionShape {
            id: format!("{}-{id}", if chat { "chatcmpl" } else { "cmpl" }),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.to_string(),
            chat,
        }
    }

    /// One choice carrying `text` (a delta when streaming a chat).
    fn choice(
        &self,
        text: &str,
        ids: &[i64],
        finish_reason: Option<&str>,
        stream: bool,
        first: bool,
    ) -> serde_json::Value {
        let mut choice = json!({"index": 0, "token_ids": ids, "finish_reason": finish_reason});
        if !self.chat {
            choice["text"] = json!(text);
            choice["logprobs"] = serde_json::Value::Null;
        } else if stream {
            choice["delta"] = if first {
                json!({"role": "assistant", "content": text})
            } else {
                json!({"content": text})
            };
        } else {
            choice["message"] = json!({"role": "assistant", "content": text});
        }
        choice
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.chat, stream) {
            (false, _) => "text_completion",
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
        }
    }

    fn body(&self, choice: serde_json::Value, stream: bool) -> serde_json::Value {
        json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> serde_json::Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

async fn complete(
    state: Arc<AppState>,
    id: u64,
    endpoint: Endpoint,
    task: Result<CompletionTask, ApiError>,
) -> Response {
    let (stream, chat) = match &task {
        Ok(task) => (task.stream, task.chat),
        Err(_) => (false, false),
    };
    let queued = task.and_then(|task| enqueue(&state, id, endpoint, Task::Complete(task)));
    let (mut replies, mut guard) = match queued {
        Ok(queued) => queued,
        Err(error) => return refused(&state, id, endpoint, error),
    };
    // The first reply says whether the prompt was taken: an error is still a plain JSON
    // answer with its status, before any event is sent.
    let prompt_tokens = match replies.recv().await {
        Some(Reply::Started { prompt_tokens }) => prompt_tokens,
        Some(Reply::Failed(error)) => {
            guard.finish();
            return error.into_response();
        }
        _ => {
            guard.finish();
            return internal("no start");
        }
    };
    let shape = CompletionShape::new(id, &state.metrics.model.name, chat);
    if stream {
        return event_stream(replies, guard, shape, prompt_tokens);
    }
    let mut text = String::new();
    let mut ids = Vec::new();
    loop {
        match replies.recv().await {
            Some(Reply::Token { id, text: piece }) => {
                ids.push(id);
                text.push_str(&piece);
            }
            Some(Reply::Finished {
                text: rest,
                completion_tokens,
                finish_reason,
            }) => {
                guard.finish();
                text.push_str(&rest);
                let mut body = shape.body(
                    shape.choice(&text, &ids, Some(finish_reason), false, true),
                    false,
                );
                body["usage"] = usage(prompt_tokens, completion_tokens);
                return Json(body).into_response();
            }
            Some(Reply::Failed(error)) => {
                guard.finish();
                return error.into_response();
            }
            _ => {
                guard.finish();
                return internal("completion cut short");
            }
        }
    }
}

/// The completion as server-sent events, OpenAI's way: one `data: {chunk}` per token, a last
/// chunk with `finish_reason` and `usage`, then `data: [DONE]`. An error after the first
/// event is sent as `data: {"error": …}` and ends the stream.
fn event_stream(
    replies: UnboundedReceiver<Reply>,
    guard: CancelOnDrop,
    shape: CompletionShape,
    prompt_tokens: usize,
) -> Response {
    struct StreamState {
        replies: UnboundedReceiver<Reply>,
        guard: CancelOnDrop,
        shape: CompletionShape,
        prompt_tokens: usize,
        first: bool,
        /// The last chunk went out: `[DONE]` is next.
        finished: bool,
        done: bool,
    }
    let start = StreamState {
        replies,
        guard,
        shape,
        prompt_tokens,
        first: true,
        finished: false,
        done: false,
    };
    let events = futures_util::stream::unfold(start, |mut s| async move {
        if s.done {
            s.guard.finish();
            return None;
        }
        if s.finished {
            s.done = true;
            return Some((Ok(Event::default().data("[DONE]")), s));
        }
        let event = match s.replies.recv().await {
            Some(Reply::Token { id, text }) => {
                let choice = s.shape.choice(&text, &[id], None, true, s.first);
                s.first = false;
                Event::default().data(s.shape.body(choice, true).to_string())
            }
            Some(Reply::Finished {
                text,
                completion_tokens,
                finish_reason,
            }) => {
                let choice = s
                    .shape
                    .choice(&text, &[], Some(finish_reason), true, s.first);
                let mut body = s.shape.body(choice, true);
                body["usage"] = usage(s.prompt_tokens, completion_tokens);
                s.finished = true;
                Event::default().data(body.to_string())
            }
            Some(Reply::Failed(error)) => {
                s.done = true;
                Event::default().data(error.body().to_string())
            }
            other => {
                s.done = true;
                let what = if other.is_none() {
                    "the engine thread stopped answering"
                } else {
                    "unexpected reply"
                };
                Event::default().data(
                    ApiError::new(500, "engine_error", format!("internal error: {what}"))
                        .body()
                        .to_string(),
                )
            }
        };
        Some((Ok::<Event, Infallible>(event), s))
    });
    Sse::new(events).into_response()
}
