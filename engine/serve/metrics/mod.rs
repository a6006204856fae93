//! What the service counts, and its two views: Prometheus text (`GET /metrics`, written by
//! [`prometheus`]) and a JSON snapshot (`GET /stats`, polled by the dashboard).
//!
//! Request counts, queue depth, tokens and the ms/token histogram are the service's own; the
//! expert cache's figures (hit ratio overall and per layer, bytes read, stall time, prefetch,
//! resident/buffer/working memory) are a [`RunStats`] — what `--stats-json` writes — built
//! from the session's cumulative counters after every document or completion, so the two
//! agree by construction.

mod prometheus;

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use serde::Serialize;

use crate::generation::decoding::Generation;
use crate::generation::report::{peak_rss_bytes, rss_bytes, RunStats};
use crate::generation::session::Session;
use crate::ids::ExpertId;

use super::api::Stopped;
use super::worker::Job;

/// The endpoints that run the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    Summarize,
    Completions,
    ChatCompletions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Summarize => "/v1/summarize",
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// Upper bounds of the ms/token histogram's buckets.
const STEP_MS_BUCKETS: [f64; 12] = [
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0,
];
/// Upper bounds of the request-duration histogram's buckets, in seconds.
const REQUEST_S_BUCKETS: [f64; 12] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];
/// Requests the dashboard lists.
const RECENT_REQUESTS: usize = 20;
/// Points of the dashboard's history: one per second at most, the last ten minutes' worth.
const HISTORY_POINTS: usize = 600;

/// A cumulative histogram in Prometheus' form.
#[derive(Debug, Clone, Serialize)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations at most each bound (not cumulative here; summed when written).
    counts: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum: 0.0,
        }
    }

    fn observe(&mut self, value: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| value <= b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += value;
    }
}

/// The model the server runs, for `/health`, `/stats` and the dashboard.
#[derive(Debug, Clone, Serialize)]
pub struct ModelInfo {
    /// The bundle's folder name.
    pub name: String,
    pub architecture: String,
    /// `encoder-decoder` (summaries) or `decoder-only` (completions).
    pub kind: &'static str,
    pub profile: Option<String>,
}

/// One finished request, as the dashboard lists it.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub id: u64,
    pub endpoint: Endpoint,
    pub status: u16,
    pub tokens: usize,
    /// From arrival to answer (queue wait included).
    pub ms: f64,
    /// Seconds since the server started, when it finished.
    pub at_s: f64,
}

/// The cumulative counters at one moment, for the dashboard's charts over time (kept by the
/// server, so that a page opened late still shows what happened).
#[derive(Debug, Clone, Serialize)]
pub struct HistoryPoint {
    /// Seconds since the server started.
    pub t_s: f64,
    pub hit_ratio: f64,
    pub expert_accesses: u64,
    pub hits: u64,
    pub bytes_read: u64,
    pub decode_steps: u64,
    pub decode_ms: f64,
    pub tokens_generated: u64,
}

/// Expert-buffer slots holding an expert of one MoE layer.
#[derive(Debug, Clone, Serialize)]
pub struct LayerSlots {
    pub stack: String,
    pub block: u16,
    pub slots: usize,
}

#[derive(Debug)]
struct Counters {
    requests: BTreeMap<(Endpoint, u16), u64>,
    cancelled: BTreeMap<&'static str, u64>,
    tokens_generated: u64,
    input_tokens: u64,
    /// Decoder steps observed, and their summed time (the dashboard's ms/token over time).
    decode_steps: u64,
    decode_ms: f64,
    step_ms: Histogram,
    request_s: Histogram,
    /// The expert cache so far, as `--stats-json` would write it.
    engine: Option<RunStats>,
    slots: Vec<Option<ExpertId>>,
    recent: VecDeque<RequestRecord>,
    history: VecDeque<HistoryPoint>,
}

/// The service's counters, shared by the HTTP handlers and the engine thread.
#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    pub model: ModelInfo,
    ready: AtomicBool,
    stopping: AtomicBool,
    queue_capacity: usize,
    queued: AtomicUsize,
    running: AtomicUsize,
    counters: Mutex<Counters>,
}

impl Metrics {
    pub fn new(model: ModelInfo, queue_capacity: usize) -> Self {
        Metrics {
            started: Instant::now(),
            model,
            ready: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            queue_capacity,
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            counters: Mutex::new(Counters {
                requests: BTreeMap::new(),
                cancelled: BTreeMap::new(),
                tokens_generated: 0,
                input_tokens: 0,
                decode_steps: 0,
                decode_ms: 0.0,
                step_ms: Histogram::new(&STEP_MS_BUCKETS),
                request_s: Histogram::new(&REQUEST_S_BUCKETS),
                engine: None,
                slots: Vec::new(),
                recent: VecDeque::new(),
                history: VecDeque::new(),
            }),
        }
    }

    fn counters(&self) -> MutexGuard<'_, Counters> {
        // A panic elsewhere while counting leaves numbers, not broken invariants.
        self.counters.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    pub fn set_stopping(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// The model is loaded: record its memory plan and mark the server ready.
    pub fn engine_ready(&self, session: &Session) {
        self.snapshot_engine(session);
        self.ready.store(true, Ordering::Release);
    }

    /// A job entered the queue (called before it is sent; [`Metrics::unqueued`] undoes it
    /// when the queue refused it).
    pub fn queued(&self) {
        self.queued.fetch_add(1, Ordering::AcqRel);
    }

    pub fn unqueued(&self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
    }

    pub fn queue_depth(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    pub fn queue_capacity(&self) -> usize {
        self.queue_capacity
    }

    /// What `Retry-After` says on a 503: the mean request time so far times the requests
    /// ahead, from 1 to 60 seconds.
    pub fn retry_after_s(&self) -> u64 {
        let counters = self.counters();
        let mean_s = if counters.request_s.count == 0 {
            1.0
        } else {
            counters.request_s.sum / counters.request_s.count as f64
        };
        let ahead = (self.queue_depth() + 1) as f64;
        (mean_s * ahead).ceil().clamp(1.0, 60.0) as u64
    }

    /// The engine thread took a job from the queue.
    pub fn job_started(&self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
        self.running.fetch_add(1, Ordering::AcqRel);
    }

    /// The engine thread answered a job with `status`.
    pub fn job_finished(&self, job: &Job, status: u16, tokens: usize, session: &Session) {
        self.running.fetch_sub(1, Ordering::AcqRel);
        self.snapshot_engine(session);
        let elapsed = job.received.elapsed().as_secs_f64();
        let mut counters = self.counters();
        counters.request_s.observe(elapsed);
        drop(counters);
        self.record(job.id, job.endpoint, status, tokens, elapsed * 1e3);
    }

    /// A request answered without reaching the engine (refused, or the queue was full).
    pub fn refused(&self, id: u64, endpoint: Endpoint, status: u16) {
        self.record(id, endpoint, status, 0, 0.0);
    }

    fn record(&self, id: u64, endpoint: Endpoint, status: u16, tokens: usize, ms: f64) {
        let at_s = self.started.elapsed().as_secs_f64();
        let mut counters = self.counters();
        *counters.requests.entry((endpoint, status)).or_default() += 1;
        counters.recent.push_front(RequestRecord {
            id,
            endpoint,
            status,
            tokens,
            ms,
            at_s,
        });
        counters.recent.truncate(RECENT_REQUESTS);
    }

    pub fn cancelled(&self, why: Stopped) {
        *self.counters().cancelled.entry(why.name()).or_default() += 1;
    }

    /// One document summarized or one completion made.
    pub fn generated(&self, generation: &Generation, input_tokens: usize, session: &Session) {
        {
            let mut counters = self.counters();
            counters.tokens_generated += generation.tokens.len() as u64;
            counters.input_tokens += input_tokens as u64;
            for &ms in &generation.step_ms {
                counters.step_ms.observe(ms);
                counters.decode_steps += 1;
                counters.decode_ms += ms;
            }
        }
        self.snapshot_engine(session);
    }

    /// Copies the session's cumulative expert-cache counters and the buffer's slots.
    fn snapshot_engine(&self, session: &Session) {
        let mut stats = RunStats::new(&[], session.stats(), &session.plan, &session.options.cache);
        stats.profile = self.model.profile.clone();
        stats.kv_cache = session.options.decode.kv_cache;
        let slots = session
            .buffer
            .as_buffer()
            .map(|b| b.slot_contents())
            .unwrap_or_default();
        let t_s = self.started.elapsed().as_secs_f64();
        let mut counters = self.counters();
        let point = HistoryPoint {
            t_s,
            hit_ratio: stats.hit_ratio,
            expert_accesses: stats.expert_accesses,
            hits: stats.hits,
            bytes_read: stats.bytes_read,
            decode_steps: counters.decode_steps,
            decode_ms: counters.decode_ms,
            tokens_generated: counters.tokens_generated,
        };
        // One point per second at most: the last one of each second stands for it.
        if counters
            .history
            .back()
            .is_some_and(|last| last.t_s.floor() == t_s.floor())
        {
            counters.history.pop_back();
        }
        counters.history.push_back(point);
        if counters.history.len() > HISTORY_POINTS {
            counters.history.pop_front();
        }
        counters.engine = Some(stats);
        counters.slots = slots;
    }

    /// The dashboard's view.
    pub fn snapshot(&self) -> Snapshot {
        let counters = self.counters();
        let engine = counters.engine.clone();
        let mut by_layer: BTreeMap<(String, u16), usize> = BTreeMap::new();
        for id in counters.slots.iter().flatten() {
            *by_layer
                .entry((id.stack.hf_prefix().to_string(), id.layer))
                .or_default() += 1;
        }
        let requests: u64 = counters.requests.values().sum();
        let failed = counters
            .requests
            .iter()
            .filter(|((_, status), _)| *status >= 400)
            .map(|(_, n)| n)
            .sum();
        Snapshot {
            model: self.model.clone(),
            ready: self.is_ready(),
            stopping: self.is_stopping(),
            uptime_s: self.started.elapsed().as_secs_f64(),
            queue_depth: self.queue_depth(),
            queue_capacity: self.queue_capacity,
            running: self.running.load(Ordering::Acquire),
            requests,
            failed_requests: failed,
            cancelled_requests: counters.cancelled.values().sum(),
            tokens_generated: counters.tokens_generated,
            decode_steps: counters.decode_steps,
            decode_ms: counters.decode_ms,
            free_slots: counters.slots.iter().filter(|s| s.is_none()).count(),
            slots_by_layer: by_layer
                .into_iter()
                .map(|((stack, block), slots)| LayerSlots {
                    stack,
                    block,
                    slots,
                })
                .collect(),
            rss_bytes: rss_bytes(),
            peak_rss_bytes: peak_rss_bytes(),
            engine,
            recent: counters.recent.iter().cloned().collect(),
            history: counters.history.iter().cloned().collect(),
        }
    }
}

/// `GET /stats`: what the dashboard draws.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub model: ModelInfo,
    pub ready: bool,
    pub stopping: bool,
    pub uptime_s: f64,
    pub queue_depth: usize,
    pub queue_capacity: usize,
    pub running: usize,
    pub requests: u64,
    pub failed_requests: u64,
    pub cancelled_requests: u64,
    pub tokens_generated: u64,
    pub decode_steps: u64,
    pub decode_ms: f64,
    pub free_slots: usize,
    pub slots_by_layer: Vec<LayerSlots>,
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
    /// The expert cache so far, as `--stats-json` writes it (`null` until the model is loaded).
    pub engine: Option<RunStats>,
    pub recent: Vec<RequestRecord>,
    /// The counters over time, oldest first (see [`HistoryPoint`]).
    pub history: Vec<HistoryPoint>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_at_least_a_second_and_at_most_a_minute() {
        let metrics = Metrics::new(
            ModelInfo {
                name: "m".into(),
                architecture: "a".into(),
                kind: "decoder-only",
                profile: None,
            },
            2,
        );
        assert_eq!(metrics.retry_after_s(), 1);
        metrics.counters().request_s.observe(500.0);
        assert_eq!(metrics.retry_after_s(), 60);
    }
}
