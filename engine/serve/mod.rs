//! `edgemoe serve`: the long-running service. One model instance, loaded once on the engine
//! thread ([`worker`]); HTTP clients ([`routes`]) reach it through a bounded queue; the
//! service counts what it and the expert cache do ([`metrics`]) and shows it on a dashboard.
//! Request and response JSON, limits and errors are in [`api`]; the completion endpoints'
//! OpenAI shapes and event streams in [`completions`].
//!
//! Lifecycle: bind (the address is printed on standard error: `listening on http://ADDR`),
//! load the model while `/health` answers 503, serve; on SIGTERM (or SIGINT/SIGHUP) stop
//! taking requests, let queued and running ones finish for the grace period, cancel what is
//! left (each stops at its next token), close the connections and return — the process exits
//! 0. A second signal ends the process at once.

pub mod api;
pub mod completions;
pub mod metrics;
pub mod routes;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::bundle::Bundle;
use crate::error::{Error, Result};
use crate::generation::session::SessionOptions;
use crate::interrupt::StopOnSignal;

use api::{Limits, Stopped};
use metrics::{Metrics, ModelInfo};
use routes::AppState;

/// How the service runs (besides the session's own options).
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// Bearer token the `/v1/*`, `/metrics` and `/stats` endpoints require.
    pub api_key: Option<String>,
    /// Requests that may wait for the engine; one more is answered 503.
    pub queue: usize,
    pub limits: Limits,
    /// After a stop signal: how long queued and running requests may still take.
    pub grace: Duration,
    /// The device profile's name, shown on the dashboard and in `/metrics`.
    pub profile: Option<String>,
}

/// The session options a server opens its model with: `base`, with working memory sized for
/// the largest request the limits allow.
pub fn session_options(base: SessionOptions, limits: &Limits) -> SessionOptions {
    let mut options = base;
    options.max_input_tokens = limits.input_tokens;
    options.decode.max_new_tokens = limits.new_tokens;
    options.decode.num_beams = limits.beams;
    options
}

/// Serves `bundle` until a stop signal; fails if the address cannot be bound or the model
/// cannot be loaded.
pub fn serve(bundle: Bundle, session: SessionOptions, options: ServeOptions) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        // HTTP is light next to the model: two threads leave the cores to the engine.
        .worker_threads(2)
        .thread_name("edgemoe-http")
        .enable_all()
        .build()
        .map_err(|e| Error::Internal(format!("cannot start the HTTP runtime: {e}")))?;
    let result = runtime.block_on(run(bundle, session, options));
    // Connections still open past the grace period are dropped with the runtime.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

async fn run(bundle: Bundle, session: SessionOptions, options: ServeOptions) -> Result<()> {
    let address = format!("{}:{}", options.host, options.port);
    let listener = tokio::net::TcpListener::bind(&address)
        .await
        .map_err(|e| Error::io(&address, e))?;
    let bound: SocketAddr = listener.local_addr().map_err(|e| Error::io(&address, e))?;

    let model = &bundle.config.model;
    let encoder_decoder = model.as_switch().is_some();
    let info = ModelInfo {
        name: bundle
            .dir()
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned()),
        architecture: model.architecture().to_string(),
        kind: if encoder_decoder {
            "encoder-decoder"
        } else {
            "decoder-only"
        },
        profile: options.profile.clone(),
    };
    let metrics = Arc::new(Metrics::new(info, options.queue));
    // A zero-capacity channel would be a rendezvous (no waiting at all); `--queue` is ≥ 1.
    let (jobs, queue) = crossbeam_channel::bounded(options.queue.max(1));
    let state = Arc::new(AppState {
        jobs,
        metrics: metrics.clone(),
        api_key: options.api_key.clone(),
        limits: options.limits.clone(),
        defaults: bundle.config.generation.clone(),
        encoder_decoder,
        next_id: AtomicU64::new(1),
        in_flight: Mutex::default(),
    });

    // The stop signal, a model that failed to load, or an engine thread that died ends the
    // serving.
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(None::<String>);
    let stop_tx = Arc::new(stop_tx);

    let (loaded_tx, loaded_rx) = std::sync::mpsc::channel();
    let worker_metrics = metrics.clone();
    let on_panic = StopIfPanicking(stop_tx.clone());
    let engine = std::thread::Builder::new()
        .name("edgemoe-engine".into())
        .spawn(move || {
            let _on_panic = on_panic;
            worker::run(bundle, session, queue, worker_metrics, loaded_tx)
        })
        .map_err(|e| Error::Internal(format!("cannot start the engine thread: {e}")))?;

    eprintln!(
        "edgemoe serve: listening on http://{bound} (model {} loading)",
        metrics.model.name
    );

    let on_signal = stop_tx.clone();
    let _stop_on_signal = StopOnSignal::new(move |signal| {
        let _ = on_signal.send(Some(format!("signal {signal}")));
    });
    let load_failure: Arc<Mutex<Option<Error>>> = Arc::default();
    {
        let load_failure = load_failure.clone();
        let stop_tx = stop_tx.clone();
        let name = metrics.model.name.clone();
        tokio::task::spawn_blocking(move || match loaded_rx.recv() {
            Ok(Ok(())) => eprintln!("edgemoe serve: model {name} loaded, ready"),
            Ok(Err(error)) => {
                *load_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
                let _ = stop_tx.send(Some("the model failed to load".into()));
            }
            Err(_) => {
                *load_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(Error::Internal(
                    "the engine thread ended before loading the model".into(),
                ));
                let _ = stop_tx.send(Some("the engine thread ended".into()));
            }
        });
    }

    let stopping = {
        let mut stop_rx = stop_rx.clone();
        // Weak: the router's copies alone keep the queue open, so that it closes with them.
        let state = Arc::downgrade(&state);
        let grace = options.grace;
        async move {
            let _ = stop_rx.wait_for(Option::is_some).await;
            let why = stop_rx.borrow().clone().unwrap_or_default();
            let Some(live) = state.upgrade() else {
                return;
            };
            live.metrics.set_stopping();
            eprintln!(
                "edgemoe serve: stopping ({why}): no new requests; {} queued or running get {} s",
                live.in_flight.lock().map_or(0, |m| m.len()),
                grace.as_secs_f64()
            );
            drop(live);
            // After the grace period whatever is left is cancelled; the connections close
            // once their answers are written.
            tokio::spawn(async move {
                tokio::time::sleep(grace).await;
                if let Some(state) = state.upgrade() {
                    state.cancel_all(Stopped::Shutdown);
                }
            });
        }
    };
    let app = routes::router(state);
    let server = axum::serve(listener, app).with_graceful_shutdown(stopping);
    // A client that keeps its connection open past the grace period (and a few seconds for
    // the cancelled answers to be written) does not hold the process.
    let give_up = async {
        let _ = stop_rx.wait_for(Option::is_some).await;
        tokio::time::sleep(options.grace + Duration::from_secs(5)).await;
    };
    tokio::select! {
        served = server => served.map_err(|e| Error::io(&address, e))?,
        () = give_up => {
            eprintln!("warning: connections still open after the grace period were closed");
            return Ok(());
        }
    }
    // Every sender of the queue is gone with the router: the engine thread ends its last job
    // (cancelled by now) and returns.
    tokio::task::spawn_blocking(move || engine.join())
        .await
        .map_err(|e| Error::Internal(format!("waiting for the engine thread: {e}")))?
        .map_err(|_| Error::Internal("the engine thread panicked".into()))?;
    if let Some(error) = load_failure
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        return Err(error);
    }
    let snapshot = metrics.snapshot();
    eprintln!(
        "edgemoe serve: stopped after {} requests ({} tokens generated)",
        snapshot.requests, snapshot.tokens_generated
    );
    Ok(())
}

/// Held by the engine thread: if it dies of a panic (a bug), the server stops and `serve`
/// returns the error (exit status 1, so that systemd's `Restart=on-failure` starts it again)
/// instead of answering 503 forever.
struct StopIfPanicking(Arc<tokio::sync::watch::Sender<Option<String>>>);

impl Drop for StopIfPanicking {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.0.send(Some("the engine thread panicked".into()));
        }
    }
}
