//! The prefetch thread: it owns speculative reads from the expert store. The compute thread
//! lends it a slot's memory with each request (ownership moves through the channel, so a slot
//! cannot be read while it is being overwritten) and gets the memory back with the completion.
//! A request whose cancel flag is set before its read starts is returned unread.
//!
//! Shutdown: dropping the [`Prefetcher`] drops the request sender; the thread drains what is
//! queued and exits; `drop` joins it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{bounded, Receiver, Sender};

use crate::error::Error;
use crate::ids::ExpertId;
use crate::store::AlignedBuf;
use crate::store::ExpertStore;

pub struct Request {
    pub id: ExpertId,
    pub slot: usize,
    pub memory: AlignedBuf,
    pub cancel: Arc<AtomicBool>,
}

pub enum Outcome {
    Loaded { bytes: u64, read_ms: f64 },
    Cancelled,
    Failed(Error),
}

pub struct Completion {
    pub id: ExpertId,
    pub slot: usize,
    pub memory: AlignedBuf,
    pub outcome: Outcome,
}

pub struct Prefetcher {
    requests: Option<Sender<Request>>,
    completions: Receiver<Completion>,
    thread: Option<JoinHandle<()>>,
    exited: Arc<AtomicBool>,
}

impl Prefetcher {
    /// `capacity`: the most requests in flight (the number of slots, so sends never block).
    pub fn spawn(store: Arc<ExpertStore>, capacity: usize) -> std::io::Result<Self> {
        let (request_tx, request_rx) = bounded::<Request>(capacity.max(1));
        let (done_tx, done_rx) = bounded::<Completion>(capacity.max(1));
        let exited = Arc::new(AtomicBool::new(false));
        let exit_flag = exited.clone();
        let thread = std::thread::Builder::new()
            .name("edgemoe-prefetch".into())
            .spawn(move || {
                for mut request in request_rx {
                    let outcome = if request.cancel.load(Ordering::Acquire) {
                        Outcome::Cancelled
                    } else {
                        let started = Instant::now();
                        match store.read_expert(request.id, request.memory.as_mut_slice()) {
                            Ok(bytes) => Outcome::Loaded {
                                bytes,
                                read_ms: started.elapsed().as_secs_f64() * 1e3,
                            },
                            Err(e) => Outcome::Failed(e),
                        }
                    };
                    let done = Completion {
                        id: request.id,
                        slot: request.slot,
                        memory: request.memory,
                        outcome,
                    };
                    if done_tx.send(done).is_err() {
                        break;
                    }
                }
                exit_flag.store(true, Ordering::Release);
            })?;
        Ok(Prefetcher {
            requests: Some(request_tx),
            completions: done_rx,
            thread: Some(thread),
            exited,
        })
    }

    /// Queues a read. Never blocks while fewer than `capacity` requests are outstanding.
    pub fn send(&self, request: Request) -> std::result::Result<(), Request> {
        match &self.requests {
            Some(tx) => tx.send(request).map_err(|e| e.into_inner()),
            None => Err(request),
        }
    }

    pub fn try_recv(&self) -> Option<Completion> {
        self.completions.try_recv().ok()
    }

    /// Waits for the next completion (`None` if the thread is gone).
    pub fn recv(&self) -> Option<Completion> {
        self.completions.recv().ok()
    }

    /// Set by the thread when it exits (for tests of clean shutdown).
    pub fn exited_flag(&self) -> Arc<AtomicBool> {
        self.exited.clone()
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        drop(self.requests.take());
        // Unblock a thread waiting to hand back a completion.
        while self.completions.try_recv().is_ok() {}
        if let Some(thread) = self.thread.take() {
            // Drain completions while joining so a full channel cannot block the thread.
            while !thread.is_finished() {
                if self
                    .completions
                    .recv_timeout(std::time::Duration::from_millis(1))
                    .is_err()
                {
                    std::thread::yield_now();
                }
            }
            let _ = thread.join();
        }
    }
}
