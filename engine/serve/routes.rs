//! The HTTP side: routes, the bearer-token check, request parsing and the queue hand-off,
//! health, metrics and summaries. The completion endpoints' OpenAI shapes and event streams are
//! in [`super::completions`].
//!
//! A request that runs the model is checked (token, model kind, body size, JSON, limits) and
//! then offered to the bounded queue without waiting: a full queue answers 503 at once. While
//! it waits or runs, a [`CancelOnDrop`] guard lives in the handler (or in the event stream):
//! when the client goes away hyper drops it, and its cancellation stops the engine at the next
//! token.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use crossbeam_channel::{Sender, TrySendError};
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::config::GenerationDefaults;
use crate::generation::decoding::Cancellation;

use super::api::{ApiError, Limits, Stopped, SummarizeRequest, SummarizeResponse};
use super::completions;
use super::metrics::{Endpoint, Metrics};
use super::worker::{Job, Reply, Task};

/// The dashboard: one self-contained page (no CDN; a board may be offline).
const DASHBOARD: &str = include_str!("dashboard.html");

/// What every handler shares.
pub struct AppState {
    pub jobs: Sender<Job>,
    pub metrics: Arc<Metrics>,
    pub api_key: Option<String>,
    pub limits: Limits,
    pub defaults: GenerationDefaults,
    /// Whether the bundle is an encoder-decoder (summaries) or decoder-only (completions).
    pub encoder_decoder: bool,
    pub next_id: AtomicU64,
    /// Requests queued or running, to cancel when the shutdown's grace period ends.
    pub in_flight: Mutex<HashMap<u64, InFlight>>,
}

/// A request queued or running: how to stop it, and where to say why.
#[derive(Clone)]
pub struct InFlight {
    pub cancellation: Cancellation,
    pub stopped: Arc<Mutex<Option<Stopped>>>,
}

impl InFlight {
    /// Cancels the request, recording why (the first reason recorded wins).
    pub fn stop(&self, why: Stopped) {
        let mut stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        stopped.get_or_insert(why);
        self.cancellation.cancel();
    }
}

impl AppState {
    fn in_flight(&self) -> std::sync::MutexGuard<'_, HashMap<u64, InFlight>> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Cancels every request queued or running (the shutdown's grace period is over).
    pub fn cancel_all(&self, why: Stopped) {
        for request in self.in_flight().values() {
            request.stop(why);
        }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    let guarded = Router::new()
        .route("/v1/summarize", post(summarize))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/chat/completions", post(completions::chat_completions))
        .route("/metrics", get(metrics))
        .route("/stats", get(stats))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/", get(dashboard))
        .route("/health", get(health))
        .merge(guarded)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(state.limits.body_bytes))
        .with_state(state)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, Json(self.body())).into_response();
        if self.status == 401 {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// Requires `Authorization: Bearer KEY` when the server has an API key.
async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let message = match given {
            None => Some("missing bearer token: send `Authorization: Bearer KEY`"),
            Some(given) if !same_secret(given.trim().as_bytes(), key.as_bytes()) => {
                Some("incorrect bearer token")
            }
            Some(_) => None,
        };
        if let Some(message) = message {
            return ApiError::new(401, "unauthorized", message).into_response();
        }
    }
    next.run(request).await
}

/// Compares two secrets in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn dashboard() -> Html<&'static str> {
    Html(DASHBOARD)
}

async fn not_found() -> ApiError {
    ApiError::new(
        404,
        "not_found",
        "no such endpoint: see GET /, /health, /metrics, /stats, POST /v1/summarize, /v1/completions, /v1/chat/completions",
    )
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let m = &state.metrics;
    let status = if m.is_stopping() {
        "stopping"
    } else if m.is_ready() {
        "ok"
    } else {
        "loading"
    };
    let code = if status == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": status,
        "model": m.model.name,
        "architecture": m.model.architecture,
        "kind": m.model.kind,
        "queue_depth": m.queue_depth(),
        "queue_capacity": m.queue_capacity(),
    });
    (code, Json(body)).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.prometheus(),
    )
        .into_response()
}

async fn stats(State(state): State<Arc<AppState>>) -> Response {
    Json(state.metrics.snapshot()).into_response()
}

/// The body as `T`, or the error that names what was wrong with it.
pub(super) fn parse<T: DeserializeOwned>(
    state: &AppState,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                413,
                "body_too_large",
                format!(
                    "the request body is larger than this server's limit of {} bytes (--limit-body)",
                    state.limits.body_bytes
                ),
            )
        } else {
            ApiError::invalid(format!("cannot read the request body: {rejection}"))
        }
    })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::from_json(&e))
}

/// Fails unless the server's model is the kind `endpoint` needs.
pub(super) fn expect_kind(state: &AppState, endpoint: Endpoint) -> Result<(), ApiError> {
    let wants_encoder_decoder = endpoint == Endpoint::Summarize;
    if wants_encoder_decoder == state.encoder_decoder {
        return Ok(());
    }
    let m = &state.metrics.model;
    let (has, use_instead) = if state.encoder_decoder {
        (
            "an encoder-decoder (summarization) model",
            "POST /v1/summarize",
        )
    } else {
        (
            "a decoder-only model",
            "POST /v1/completions or /v1/chat/completions",
        )
    };
    Err(ApiError::new(
        400,
        "wrong_model",
        format!(
            "{} needs {}; this server runs {has} ({}, {}): use {use_instead}",
            endpoint.path(),
            if wants_encoder_decoder {
                "an encoder-decoder model"
            } else {
                "a decoder-only model"
            },
            m.name,
            m.architecture
        ),
    ))
}

/// Cancels its request when dropped before [`CancelOnDrop::finish`]: the handler or event
/// stream holding it was dropped because the client went away. Always unregisters it.
pub(super) struct CancelOnDrop {
    state: Arc<AppState>,
    id: u64,
    request: InFlight,
    finished: bool,
}

impl CancelOnDrop {
    pub(super) fn finish(&mut self) {
        self.finished = true;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.finished {
            self.request.stop(Stopped::Disconnected);
        }
        self.state.in_flight().remove(&self.id);
    }
}

/// Offers a task to the queue without waiting.
pub(super) fn enqueue(
    state: &Arc<AppState>,
    id: u64,
    endpoint: Endpoint,
    task: Task,
) -> Result<(UnboundedReceiver<Reply>, CancelOnDrop), ApiError> {
    let metrics = &state.metrics;
    if metrics.is_stopping() {
        return Err(ApiError::new(
            503,
            "shutting_down",
            "the server is shutting down and takes no new requests",
        ));
    }
    if !metrics.is_ready() {
        return Err(ApiError::new(
            503,
            "loading",
            "the model is still loading: retry when GET /health answers 200",
        ));
    }
    let request = InFlight {
        cancellation: Cancellation::with_deadline(Instant::now() + state.limits.deadline),
        stopped: Arc::default(),
    };
    let (reply, replies) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        id,
        endpoint,
        task,
        cancellation: request.cancellation.clone(),
        stopped: request.stopped.clone(),
        received: Instant::now(),
        reply,
    };
    // Registered before it can run, so that a shutdown always finds it.
    state.in_flight().insert(id, request.clone());
    let guard = CancelOnDrop {
        state: state.clone(),
        id,
        request,
        finished: false,
    };
    metrics.queued();
    match state.jobs.try_send(job) {
        Ok(()) => Ok((replies, guard)),
        Err(refused) => {
            metrics.unqueued();
            let mut guard = guard;
            guard.finish();
            Err(match refused {
                TrySendError::Full(_) => ApiError::new(
                    503,
                    "queue_full",
                    format!(
                        "the queue is full ({} requests waiting, --queue): retry later",
                        metrics.queue_capacity()
                    ),
                ),
                TrySendError::Disconnected(_) => ApiError::new(
                    503,
                    "shutting_down",
                    "the engine has stopped: the server is shutting down",
                ),
            })
        }
    }
}

/// Answers a refusal (counted here: it never reached the engine), with `Retry-After` on 503.
pub(super) fn refused(state: &AppState, id: u64, endpoint: Endpoint, error: ApiError) -> Response {
    state.metrics.refused(id, endpoint, error.status);
    let retry = error.status == 503;
    let mut response = error.into_response();
    if retry {
        let seconds = state.metrics.retry_after_s();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

pub(super) fn internal(what: &str) -> Response {
    ApiError::new(
        500,
        "engine_error",
        format!("internal error: the engine thread stopped answering ({what})"),
    )
    .into_response()
}

async fn summarize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let endpoint = Endpoint::Summarize;
    let queued = expect_kind(&state, endpoint)
        .and_then(|()| parse::<SummarizeRequest>(&state, body))
        .and_then(|request| request.check(&state.defaults, &state.limits))
        .and_then(|task| enqueue(&state, id, endpoint, Task::Summarize(task)));
    let (mut replies, mut guard) = match queued {
        Ok(queued) => queued,
        Err(error) => return refused(&state, id, endpoint, error),
    };
    let reply = replies.recv().await;
    guard.finish();
    match reply {
        Some(Reply::Summaries(summaries)) => Json(SummarizeResponse {
            model: state.metrics.model.name.clone(),
            summaries,
        })
        .into_response(),
        Some(Reply::Failed(error)) => error.into_response(),
        _ => internal("no summaries"),
    }
}
