//! The compute threads: one pool that every matrix product of the engine splits its work over.
//!
//! libtorch is kept to one thread (`tch::set_num_threads(1)`, see the CLI): its OpenMP threads
//! spin for a while after each op, and a second pool beside them competes with those spinning
//! threads for the same cores (measured on 2 cores: a 2-thread decode step was no faster than a
//! 1-thread one; handing the kernels to libtorch's own OpenMP team instead was far slower on a
//! loaded machine, as every region waits for every team thread at its closing barrier). So the
//! engine owns the threads: the calling thread and [`set_compute_threads`] − 1 helpers run the
//! GEMV rows and the GEMM tiles of [`super::matrix`], and libtorch's remaining ops (norms,
//! attention scores, softmax) run on the calling thread. Without a call, work runs on the
//! calling thread.
//!
//! The helpers are this module's own threads rather than a general-purpose pool, for two
//! reasons measured on a decode step, which makes ~30 products of 50–500 µs per layer:
//! - a helper that finished a product spins for [`SPIN`] before it sleeps, so the next product
//!   of the step finds it awake (waking a sleeping thread costs a futex call on each side and
//!   the scheduler's latency, tens of µs on a VM);
//! - the caller waits only for helpers that are inside the product (running a task), never for
//!   one that has not woken yet: a late helper finds the tasks taken and the product gone.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper polls for the next product before it sleeps: longer than the
/// libtorch ops between two products of a decode step, short enough that a waiting engine (a
/// stall on an expert read, a server between requests) does not hold a core.
pub(crate) const SPIN: Duration = Duration::from_micros(500);

static POOL: OnceLock<Option<Pool>> = OnceLock::new();

thread_local! {
    /// Whether this thread is one of the pool's helpers.
    static ON_HELPER: Cell<bool> = const { Cell::new(false) };
}

/// Sets the number of compute threads (once per process; later calls are ignored).
pub fn set_compute_threads(threads: usize) {
    POOL.get_or_init(|| Pool::start(threads));
}

/// The number of compute threads (1 when no pool was set up). Asking does not set the pool
/// up, so a later [`set_compute_threads`] still can.
pub fn compute_threads() -> usize {
    POOL.get()
        .and_then(Option::as_ref)
        .map_or(1, |p| p.helpers + 1)
}

/// Runs `task(0) .. task(tasks - 1)`, spread over the compute threads (each task on one thread;
/// which thread is not fixed). A panic in a task reaches the caller.
///
/// The calling thread takes tasks too: it starts at once on the first run of consecutive tasks
/// (one run per compute thread, see `Job`), and a helper that wakes late finds fewer (or no)
/// tasks left instead of holding the product up. One product runs on the pool at a time: a
/// call made while another thread's product holds it, or from inside a task, runs its tasks on
/// its own thread. (The caller waits for every helper inside the pool, so a long stream of
/// products from a second thread can hold a first one back; the engine makes its products from
/// one thread.)
pub fn for_each_task(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    match POOL.get_or_init(|| None) {
        Some(pool) if tasks > 1 => pool.run(tasks, task),
        _ => (0..tasks).for_each(task),
    }
}

/// [`for_each_task`] for tasks that can fail: runs every task, then returns an error one of
/// them gave.
pub fn try_for_each_task(
    tasks: usize,
    task: &(dyn Fn(usize) -> crate::error::Result<()> + Sync),
) -> crate::error::Result<()> {
    let failure = Mutex::new(None);
    for_each_task(tasks, &|t| {
        if let Err(e) = task(t) {
            *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    });
    match failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// One product: its tasks, split into one run of consecutive tasks per compute thread, and the
/// first panic.
///
/// Each thread starts on its own run and takes its tasks in order from the run's counter, so it
/// streams through one contiguous range of the product (a matrix's rows): the hardware
/// prefetcher keeps one stream going instead of restarting at every task, which is what two
/// threads taking tasks alternately from one counter did (an expert-sized GEMV was no faster on
/// two threads than on one). A thread whose run is done takes what is left of the others', so a
/// helper that wakes late only means the caller does more.
struct Job<'a> {
    task: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    /// Per run: the next task to take (runs are `tasks × r / runs ..`).
    next: Box<[AtomicUsize]>,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    fn new(task: &(dyn Fn(usize) + Sync), tasks: usize, runs: usize) -> Job<'_> {
        let runs = runs.clamp(1, tasks.max(1));
        Job {
            task,
            tasks,
            next: (0..runs)
                .map(|r| AtomicUsize::new(tasks * r / runs))
                .collect(),
            panic: Mutex::new(None),
        }
    }

    /// The tasks of run `r` end before this one.
    fn end_of(&self, r: usize) -> usize {
        self.tasks * (r + 1) / self.next.len()
    }

    /// Takes and runs tasks until none is left, run `first` first and then the others in turn;
    /// a panic is kept for the caller and ends the product (the remaining tasks are skipped).
    fn drain(&self, first: usize) {
        let runs = self.next.len();
        let run = || {
            for r in (0..runs).map(|i| (first + i) % runs) {
                let end = self.end_of(r);
                loop {
                    let t = self.next[r].fetch_add(1, SeqCst);
                    if t >= end {
                        break;
                    }
                    (self.task)(t);
                }
            }
        };
        if let Err(panic) = catch_unwind(AssertUnwindSafe(run)) {
            for (r, next) in self.next.iter().enumerate() {
                next.store(self.end_of(r), SeqCst);
            }
            self.panic
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get_or_insert(panic);
        }
    }
}

/// What the caller and the helpers share.
///
/// A helper announces itself in `inside` *before* it loads `current`, and the caller clears
/// `current` before it waits for `inside` to reach 0: so a helper either saw the job while the
/// caller still waits for it, or sees no job at all. That is what lets `current` point at a
/// job on the caller's stack.
struct Shared {
    current: AtomicPtr<Job<'static>>,
    /// Bumped for every product; helpers wait for it to move.
    generation: AtomicU64,
    inside: AtomicUsize,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

struct Pool {
    shared: Arc<Shared>,
    helpers: usize,
}

impl Pool {
    /// `threads − 1` helpers: the calling thread is the last compute thread. `None` for one
    /// thread, or when the OS refuses a thread (work then runs on the caller).
    fn start(threads: usize) -> Option<Pool> {
        if threads <= 1 {
            return None;
        }
        let shared = Arc::new(Shared {
            current: AtomicPtr::new(std::ptr::null_mut()),
            generation: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut helpers = 0;
        for i in 0..threads - 1 {
            let shared = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("edgemoe-compute-{i}"))
                .spawn(move || helper(&shared, i + 1));
            if spawned.is_err() {
                break;
            }
            helpers += 1;
        }
        (helpers > 0).then_some(Pool { shared, helpers })
    }

    fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        // A product started by a task on a helper runs there: the helper is counted in
        // `inside`, which the product would wait to see at 0.
        if ON_HELPER.get() {
            (0..tasks).for_each(task);
            return;
        }
        let job = Job::new(task, tasks, self.helpers + 1);
        let shared = &*self.shared;
        // SAFETY (of erasing the lifetime): `current` is cleared, and every helper that could
        // have loaded it has left (`inside` == 0), before this function returns or unwinds.
        let ptr = &job as *const Job<'_> as *mut Job<'static>;
        if shared
            .current
            .compare_exchange(std::ptr::null_mut(), ptr, SeqCst, SeqCst)
            .is_err()
        {
            (0..tasks).for_each(task);
            return;
        }
        shared.generation.fetch_add(1, SeqCst);
        if shared.sleepers.load(SeqCst) > 0 {
            let _guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }
        job.drain(0);
        shared.current.store(std::ptr::null_mut(), SeqCst);
        let mut polls = 0u32;
        while shared.inside.load(SeqCst) != 0 {
            polls += 1;
            if polls < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Some(panic) = job.panic.into_inner().unwrap_or_else(|e| e.into_inner()) {
            resume_unwind(panic);
        }
    }
}

/// A helper's life: wait for a product (spinning, then sleeping), take tasks (its own run of
/// each product first: run `index`; the caller's is run 0), repeat.
fn helper(shared: &Shared, index: usize) {
    // libtorch's thread count (OpenMP's, which its BLAS follows: the aarch64 package's
    // OpenBLAS, x86_64's MKL) is per thread: set on the main thread only, a GEMM tile run here
    // would start a BLAS team of one thread per core, on top of these threads.
    tch::set_num_threads(1);
    ON_HELPER.set(true);
    let mut seen = shared.generation.load(SeqCst);
    loop {
        seen = wait_for_product(shared, seen);
        shared.inside.fetch_add(1, SeqCst);
        let job = shared.current.load(SeqCst);
        if !job.is_null() {
            // SAFETY: see `Shared`: the caller keeps the job alive while `inside` > 0.
            unsafe { &*job }.drain(index);
        }
        shared.inside.fetch_sub(1, SeqCst);
    }
}

/// Returns the first generation after `seen`: polled for [`SPIN`], then slept for.
fn wait_for_product(shared: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    let mut polls = 0u32;
    loop {
        let now = shared.generation.load(SeqCst);
        if now != seen {
            return now;
        }
        polls = polls.wrapping_add(1);
        if polls.is_multiple_of(64) && start.elapsed() >= SPIN {
            break;
        }
        std::hint::spin_loop();
    }
    let mut guard = shared.lock.lock().unwrap_or_else(|e| e.into_inner());
    shared.sleepers.fetch_add(1, SeqCst);
    let now = loop {
        let now = shared.generation.load(SeqCst);
        if now != seen {
            break now;
        }
        guard = shared.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
    };
    shared.sleepers.fetch_sub(1, SeqCst);
    now
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::panic::catch_unwind;
    use std::sync::atomic::Ordering::Relaxed;

    use super::*;

    /// Every task runs once and has finished when the call returns, the helpers' included
    /// (each task sleeps before it counts, so a caller that returned early would see zeros).
    #[test]
    fn every_task_runs_once_and_is_done_on_return() {
        set_compute_threads(2);
        for _ in 0..50 {
            let counts: Vec<AtomicUsize> = (0..40).map(|_| AtomicUsize::new(0)).collect();
            for_each_task(counts.len(), &|t| {
                std::thread::sleep(Duration::from_micros(50));
                counts[t].fetch_add(1, Relaxed);
            });
            assert!(counts.iter().all(|c| c.load(Relaxed) == 1));
        }
    }

    #[test]
    fn a_helper_takes_tasks() {
        set_compute_threads(2);
        // Tests run side by side, and a product started while another holds the pool runs on
        // its caller's thread: a few tries.
        let spread = (0..50).any(|_| {
            let threads = Mutex::new(HashSet::new());
            // Long enough for a sleeping helper to wake.
            for_each_task(20, &|_| {
                std::thread::sleep(Duration::from_millis(1));
                threads.lock().unwrap().insert(std::thread::current().id());
            });
            threads.into_inner().unwrap().len() > 1
        });
        assert!(spread);
    }

    /// Products from several threads at once, and from inside a task, each get all their tasks
    /// run (one holds the pool, the others run on their own thread).
    #[test]
    fn concurrent_and_nested_products_run_every_task() {
        set_compute_threads(2);
        std::thread::scope(|scope| {
            for _ in 0..3 {
                scope.spawn(|| {
                    for _ in 0..200 {
                        let sum = AtomicUsize::new(0);
                        for_each_task(8, &|t| {
                            let inner = AtomicUsize::new(0);
                            for_each_task(4, &|u| {
                                inner.fetch_add(u + 1, Relaxed);
                            });
                            sum.fetch_add(t + inner.load(Relaxed), Relaxed);
                        });
                        assert_eq!(sum.load(Relaxed), 28 + 8 * 10);
                    }
                });
            }
        });
    }

    /// A helper that starts a product after the caller has drained its own (and waits for the
    /// helper) runs it on its own thread: publishing it would wait for itself. (Without that
    /// rule this test deadlocks.)
    #[test]
    fn a_product_started_on_a_helper_after_the_caller_drained_completes() {
        set_compute_threads(2);
        let mut helper_ran = false;
        for _ in 0..100 {
            let inner = AtomicUsize::new(0);
            let on_helper = AtomicUsize::new(0);
            for_each_task(2, &|_| {
                if ON_HELPER.get() {
                    on_helper.fetch_add(1, Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                    for_each_task(4, &|_| {
                        inner.fetch_add(1, Relaxed);
                    });
                } else {
                    // Until the helper has taken the other task (it may not: another test's
                    // product can hold the pool, and then both run here).
                    let start = Instant::now();
                    while on_helper.load(Relaxed) == 0 && start.elapsed() < SPIN * 100 {
                        std::thread::yield_now();
                    }
                }
            });
            assert_eq!(inner.load(Relaxed), 4 * on_helper.load(Relaxed));
            helper_ran |= on_helper.load(Relaxed) > 0;
            if helper_ran {
                break;
            }
        }
        assert!(helper_ran);
    }

    /// A thread takes its own run of consecutive tasks first, in order, then what is left of
    /// the other runs, each from where it stands: so each thread streams through one contiguous
    /// range of a matrix's rows.
    #[test]
    fn a_thread_takes_its_own_run_in_order_and_then_what_is_left() {
        let order = Mutex::new(Vec::new());
        let task = |t: usize| order.lock().unwrap().push(t);
        let job = Job::new(&task, 10, 2);
        job.drain(1);
        assert_eq!(*order.lock().unwrap(), [5, 6, 7, 8, 9, 0, 1, 2, 3, 4]);

        // Three runs of 11 tasks (3, 4 and 4); run 0 has been half taken by another thread.
        order.lock().unwrap().clear();
        let job = Job::new(&task, 11, 3);
        job.next[0].store(2, SeqCst);
        job.drain(2);
        assert_eq!(
            *order.lock().unwrap(),
            [7, 8, 9, 10, 2, 3, 4, 5, 6],
            "run 2, then run 0 from task 2, then run 1"
        );
        // More runs than tasks: one task per run.
        order.lock().unwrap().clear();
        Job::new(&task, 2, 4).drain(1);
        assert_eq!(*order.lock().unwrap(), [1, 0]);
    }

    #[test]
    fn a_panicking_task_panics_the_caller_and_the_pool_goes_on() {
        set_compute_threads(2);
        for _ in 0..20 {
            let result = catch_unwind(|| {
                for_each_task(64, &|t| {
                    if t == 17 {
                        panic!("task 17");
                    }
                })
            });
            assert!(result.is_err());
        }
        let count = AtomicUsize::new(0);
        for_each_task(64, &|_| {
            count.fetch_add(1, Relaxed);
        });
        assert_eq!(count.load(Relaxed), 64);
    }
}
