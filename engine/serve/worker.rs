//! The engine thread: the one place the model runs. It opens the session (the model loaded
//! once), then takes jobs from the bounded queue one at a time and answers each on the job's
//! own channel. A job carries a [`Cancellation`] that the HTTP side fires when its client goes
//! away or the server stops; its deadline is in it too. The decoding loops check it before
//! every step, so a cancelled request stops at its next token.
//!
//! Summaries and completions are made by the same library calls as `edgemoe summarize` and
//! `edgemoe generate` (`Session::summarize`, `run_model` with a `TextStream`), so they are the
//! same tokens.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;
use tokio::sync::mpsc::UnboundedSender;

use crate::bundle::Bundle;
use crate::error::{Error, Result};
use crate::generation::causal::TextStream;
use crate::generation::decoding::{Cancellation, Generation};
use crate::generation::session::{run_model, Session, SessionOptions};

use super::api::{
    finish_reason, ApiError, CompletionTask, Prompt, Stopped, SummarizeTask, Summary,
};
use super::metrics::{Endpoint, Metrics};

/// One request waiting in the queue.
pub struct Job {
    pub id: u64,
    pub endpoint: Endpoint,
    pub task: Task,
    pub cancellation: Cancellation,
    /// Why the cancellation fired, when the HTTP side fired it.
    pub stopped: Arc<std::sync::Mutex<Option<Stopped>>>,
    pub received: Instant,
    pub reply: UnboundedSender<Reply>,
}

pub enum Task {
    Summarize(SummarizeTask),
    Complete(CompletionTask),
}

/// What the engine thread sends back for a job, in order: for a summarization one
/// `Summaries` or `Failed`; for a completion `Started`, then `Token`s, then `Finished` — or
/// `Failed` at any point.
#[derive(Debug)]
pub enum Reply {
    Summaries(Vec<Summary>),
    Started {
        prompt_tokens: usize,
    },
    Token {
        id: i64,
        /// The text this token completes (may be empty: an incomplete UTF-8 sequence waits
        /// for the next token).
        text: String,
    },
    Finished {
        /// Text held back until the end.
        text: String,
        completion_tokens: usize,
        finish_reason: &'static str,
    },
    Failed(ApiError),
}

/// Opens the session on this thread (the model is not `Sync`: it never leaves it), reports
/// the outcome through `loaded`, then runs jobs until the queue's senders are all gone.
pub fn run(
    bundle: Bundle,
    options: SessionOptions,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    loaded: std::sync::mpsc::Sender<Result<()>>,
) {
    let mut session = match Session::open(&bundle, options) {
        Ok(session) => session,
        Err(error) => {
            let _ = loaded.send(Err(error));
            return;
        }
    };
    for warning in &session.warnings {
        eprintln!("warning: {warning}");
    }
    metrics.engine_ready(&session);
    let _ = loaded.send(Ok(()));
    for job in jobs.iter() {
        metrics.job_started();
        let (status, tokens, last) = match run_job(&mut session, &job, &metrics) {
            Ok((tokens, last)) => (200, tokens, last),
            Err(error) => {
                let stopped = matches!(error, Error::Cancelled(_)).then(|| why_stopped(&job));
                if let Some(stopped) = stopped {
                    metrics.cancelled(stopped);
                }
                let reply = ApiError::from_engine(&error, stopped);
                (reply.status, 0, Reply::Failed(reply))
            }
        };
        // Counted before the client can see its answer, so that /metrics read after an
        // answer includes it.
        metrics.job_finished(&job, status, tokens, &session);
        // The client may be gone: nobody to tell.
        let _ = job.reply.send(last);
    }
}

/// Why a cancelled job stopped: as the HTTP side recorded it, else its deadline or its client.
fn why_stopped(job: &Job) -> Stopped {
    let recorded = *job.stopped.lock().unwrap_or_else(|p| p.into_inner());
    recorded.unwrap_or(if job.cancellation.deadline_passed() {
        Stopped::Deadline
    } else {
        Stopped::Disconnected
    })
}

/// Runs one job: the number of tokens generated and the last reply to send.
fn run_job(session: &mut Session, job: &Job, metrics: &Metrics) -> Result<(usize, Reply)> {
    job.cancellation.check()?;
    match &job.task {
        Task::Summarize(task) => summarize(session, job, task, metrics),
        Task::Complete(task) => complete(session, job, task, metrics),
    }
}

fn summarize(
    session: &mut Session,
    job: &Job,
    task: &SummarizeTask,
    metrics: &Metrics,
) -> Result<(usize, Reply)> {
    // The server's `--kv-cache` (its working memory was sized for it), whatever the request.
    let kv_cache = session.options.decode.kv_cache;
    session.options.decode = task.decode.clone();
    session.options.decode.kv_cache = kv_cache;
    session.options.decode.cancellation = job.cancellation.clone();
    session.options.max_input_tokens = task.max_source_tokens;
    let mut summaries = Vec::with_capacity(task.documents.len());
    for document in &task.documents {
        let started = Instant::now();
        let (text, generation, source_tokens) = session.summarize(document)?;
        metrics.generated(&generation, source_tokens, session);
        summaries.push(Summary {
            text,
            tokens: generation.tokens.len(),
            ms: started.elapsed().as_secs_f64() * 1e3,
            ids: generation.tokens,
            source_tokens,
        });
    }
    let tokens = summaries.iter().map(|s| s.tokens).sum();
    Ok((tokens, Reply::Summaries(summaries)))
}

fn complete(
    session: &mut Session,
    job: &Job,
    task: &CompletionTask,
    metrics: &Metrics,
) -> Result<(usize, Reply)> {
    let prompt_ids = match &task.prompt {
        Prompt::Text(text) => session.tokenizer.encode_all(text)?,
        Prompt::Ids(ids) => ids.clone(),
    };
    let vocab = session.model.spec().vocab_size() as i64;
    if let Some(bad) = prompt_ids.iter().find(|&&id| id < 0 || id >= vocab) {
        return Err(Error::Input(format!(
            "prompt token id {bad} is outside the model's vocabulary (0..{vocab})"
        )));
    }
    if prompt_ids.is_empty() {
        return Err(Error::Input("the prompt produced no tokens".into()));
    }
    let limit = session.options.max_input_tokens;
    if prompt_ids.len() > limit {
        return Err(Error::Input(format!(
            "the prompt has {} tokens: this server takes at most {limit} (--limit-input-tokens)",
            prompt_ids.len()
        )));
    }
    let mut decode = task.decode.clone();
    decode.kv_cache = session.options.decode.kv_cache;
    decode.cancellation = job.cancellation.clone();
    if job
        .reply
        .send(Reply::Started {
            prompt_tokens: prompt_ids.len(),
        })
        .is_err()
    {
        return Err(Error::Cancelled("the client disconnected".into()));
    }
    let mut stream = TextStream::default();
    let Session {
        model,
        tokenizer,
        buffer,
        ..
    } = session;
    let generation: Generation = run_model(model, buffer, &prompt_ids, &decode, &mut |token| {
        let text = stream.push(tokenizer, token)?;
        // A closed channel means the response (and its client) is gone: stop at this token.
        job.reply
            .send(Reply::Token { id: token, text })
            .map_err(|_| Error::Cancelled("the client disconnected".into()))
    })?;
    let text = stream.finish(tokenizer)?;
    metrics.generated(&generation, prompt_ids.len(), session);
    let tokens = generation.tokens.len();
    let finished = Reply::Finished {
        text,
        completion_tokens: tokens,
        finish_reason: finish_reason(&generation.tokens, &decode),
    };
    Ok((tokens, finished))
}
