//! The I/O scheduler: it owns the device. Every read of an expert buffer with prefetch on goes
//! through it: demand misses (the compute thread waits for them), the next expert of a layer,
//! and speculative reads the path dictionary predicts. Requests wait in one priority queue —
//! demand first, then next-expert reads, then speculation, first come first served within a
//! class — and `readers` threads (the profile's queue depth: one for an SD card, several for
//! NVMe) take the most urgent one whenever they are free. A read once started completes; a
//! queued one can be moved up ([`IoScheduler::upgrade`], when the model needs an expert whose
//! speculative read is still waiting) or taken back unread ([`IoScheduler::cancel`]).
//!
//! The compute thread lends a slot's memory with each request (ownership moves through the
//! queue, so a slot cannot be computed on while it is being overwritten) and gets it back with
//! the completion, or from `cancel`.
//!
//! Shutdown: dropping the [`IoScheduler`] closes the queue; the readers finish the read they
//! are doing, hand back what is still queued unread and exit; `drop` joins them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{unbounded, Receiver, Sender};

use crate::error::Error;
use crate::ids::ExpertId;
use crate::store::AlignedBuf;
use crate::store::ExpertStore;

/// How urgent a read is; lower goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// The model is waiting for it.
    Demand = 0,
    /// The next expert of the layer being computed: certain to be needed, soon.
    Next = 1,
    /// A prediction for the next layer.
    Speculative = 2,
}

const CLASSES: usize = 3;

pub struct Request {
    pub id: ExpertId,
    pub slot: usize,
    pub memory: AlignedBuf,
    pub priority: Priority,
}

pub enum Outcome {
    Loaded {
        bytes: u64,
        /// From the start of the read to its end (device time, pacing included).
        read_ms: f64,
    },
    /// Handed back unread at shutdown.
    Cancelled,
    Failed(Error),
}

pub struct Completion {
    pub id: ExpertId,
    pub slot: usize,
    pub memory: AlignedBuf,
    /// The class the read had when a reader took it.
    pub priority: Priority,
    /// From submission to the start of the read.
    pub queued_ms: f64,
    pub outcome: Outcome,
}

struct Queued {
    request: Request,
    submitted: Instant,
}

#[derive(Default)]
struct Queue {
    classes: [VecDeque<Queued>; CLASSES],
    closed: bool,
}

impl Queue {
    fn pop(&mut self) -> Option<Queued> {
        self.classes.iter_mut().find_map(VecDeque::pop_front)
    }

    fn take(&mut self, id: ExpertId) -> Option<Queued> {
        self.classes.iter_mut().find_map(|class| {
            let at = class.iter().position(|q| q.request.id == id)?;
            class.remove(at)
        })
    }
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

pub struct IoScheduler {
    shared: Arc<Shared>,
    completions: Receiver<Completion>,
    threads: Vec<JoinHandle<()>>,
    readers: usize,
    /// Set once every reader has been joined.
    exited: Arc<AtomicBool>,
}

impl IoScheduler {
    /// Starts `readers` reader threads (at least one) over `store`.
    pub fn spawn(store: Arc<ExpertStore>, readers: usize) -> std::io::Result<Self> {
        let readers = readers.max(1);
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue::default()),
            ready: Condvar::new(),
        });
        // Unbounded: completions are at most the requests, which are at most the slots.
        let (done_tx, done_rx) = unbounded::<Completion>();
        let exited = Arc::new(AtomicBool::new(false));
        let mut scheduler = IoScheduler {
            shared: shared.clone(),
            completions: done_rx,
            threads: Vec::with_capacity(readers),
            readers,
            exited: exited.clone(),
        };
        for n in 0..readers {
            let (shared, store, done_tx) = (shared.clone(), store.clone(), done_tx.clone());
            let thread = std::thread::Builder::new()
                .name(format!("edgemoe-io-{n}"))
                .spawn(move || reader(&shared, &store, &done_tx));
            match thread {
                Ok(t) => scheduler.threads.push(t),
                // Dropping `scheduler` stops and joins the readers already started.
                Err(e) => return Err(e),
            }
        }
        Ok(scheduler)
    }

    /// Reader threads: the most reads this scheduler keeps in flight.
    pub fn readers(&self) -> usize {
        self.readers
    }

    /// Queues a read behind those of its class.
    pub fn submit(&self, request: Request) {
        let mut queue = self.shared.lock();
        let class = request.priority as usize;
        queue.classes[class].push_back(Queued {
            request,
            submitted: Instant::now(),
        });
        drop(queue);
        self.shared.ready.notify_one();
    }

    /// Moves `id`'s read, if still queued in a lower class, to the back of `priority`'s.
    /// Returns whether it was still queued (a started read cannot be hurried).
    pub fn upgrade(&self, id: ExpertId, priority: Priority) -> bool {
        let mut queue = self.shared.lock();
        let Some(mut queued) = queue.take(id) else {
            return false;
        };
        queued.request.priority = queued.request.priority.min(priority);
        let class = queued.request.priority as usize;
        queue.classes[class].push_back(queued);
        true
    }

    /// Takes `id`'s read back if no reader has started it; a started read completes.
    pub fn cancel(&self, id: ExpertId) -> Option<Request> {
        self.shared.lock().take(id).map(|q| q.request)
    }

    /// Reads queued and not started, per class (for tests and statistics).
    pub fn queued(&self) -> [usize; CLASSES] {
        let queue = self.shared.lock();
        std::array::from_fn(|c| queue.classes[c].len())
    }

    pub fn try_recv(&self) -> Option<Completion> {
        self.completions.try_recv().ok()
    }

    /// Waits for the next completion (`None` if every reader is gone).
    pub fn recv(&self) -> Option<Completion> {
        self.completions.recv().ok()
    }

    /// Set when the readers have exited (for tests of clean shutdown).
    pub fn exited_flag(&self) -> Arc<AtomicBool> {
        self.exited.clone()
    }
}

/// One reader thread: the most urgent queued read, until the queue is closed and empty.
fn reader(shared: &Shared, store: &ExpertStore, done: &Sender<Completion>) {
    loop {
        let (queued, closed) = {
            let mut queue = shared.lock();
            loop {
                if let Some(q) = queue.pop() {
                    break (q, queue.closed);
                }
                if queue.closed {
                    return;
                }
                queue = shared
                    .ready
                    .wait(queue)
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
            }
        };
        let Queued {
            mut request,
            submitted,
        } = queued;
        let started = Instant::now();
        let outcome = if closed {
            Outcome::Cancelled
        } else {
            match store.read_expert(request.id, request.memory.as_mut_slice()) {
                Ok(bytes) => Outcome::Loaded {
                    bytes,
                    read_ms: started.elapsed().as_secs_f64() * 1e3,
                },
                Err(e) => Outcome::Failed(e),
            }
        };
        let completion = Completion {
            id: request.id,
            slot: request.slot,
            memory: request.memory,
            priority: request.priority,
            queued_ms: (started - submitted).as_secs_f64() * 1e3,
            outcome,
        };
        if done.send(completion).is_err() {
            return;
        }
    }
}

impl Drop for IoScheduler {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.ready.notify_all();
        for thread in self.threads.drain(..) {
            // Completions go to an unbounded channel: a reader never blocks handing one back.
            let _ = thread.join();
        }
        self.exited.store(true, Ordering::Release);
    }
}
