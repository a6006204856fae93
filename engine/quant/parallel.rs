//! The compute threads: one pool that every matrix product of the engine splits its work over.
//!
//! libtorch is kept to one thread (`tch::set_num_threads(1)`, see the CLI): its OpenMP threads
//! spin for a while after each op, and a second pool beside them competes with those spinning
//! threads for the same cores (measured on 2 cores: a 2-thread decode step was no faster than a
//! 1-thread one; handing the kernels to libtorch's own OpenMP team instead was far slower on a
//! loaded machine, as every region waits for every team thread at its closing barrier). So the
//! engine owns the threads: the calling thread and a rayon pool of [`set_compute_threads`] − 1
//! helpers run the GEMV rows and the GEMM tiles of [`super::matrix`], and libtorch's remaining
//! ops (norms, attention scores, softmax) run on the calling thread. Without a call, work runs on
//! the calling thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();

/// Sets the number of compute threads (once per process; later calls are ignored).
pub fn set_compute_threads(threads: usize) {
    POOL.get_or_init(|| build_pool(threads));
}

/// `threads − 1` helpers: the calling thread is the last compute thread (see [`for_each_task`]).
fn build_pool(threads: usize) -> Option<rayon::ThreadPool> {
    (threads > 1)
        .then(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads - 1)
                .thread_name(|i| format!("edgemoe-compute-{i}"))
                // libtorch's thread count (OpenMP's, which its BLAS follows: the aarch64
                // package's OpenBLAS, x86_64's MKL) is per thread: set on the main thread only,
                // a GEMM tile run here would start a BLAS team of one thread per core, on top of
                // this pool's threads.
                .start_handler(|_| tch::set_num_threads(1))
                .build()
                .ok()
        })
        .flatten()
}

/// The number of compute threads (1 when no pool was set up).
pub fn compute_threads() -> usize {
    POOL.get_or_init(|| None)
        .as_ref()
        .map_or(1, |p| p.current_num_threads() + 1)
}

/// Runs `task(0) .. task(tasks - 1)`, spread over the compute threads (each task on one thread;
/// which thread is not fixed). A panic in a task reaches the caller.
///
/// The calling thread takes tasks too, from one shared counter with the helpers: it starts at
/// once, and a helper that wakes late finds fewer (or no) tasks left instead of holding the
/// product up. (A decode step makes ~30 short products per layer; with the caller idle while
/// the pool woke for each, an OLMoE-shaped 4-bit step at 2 threads took 11.4 ms, now 10–11.)
pub fn for_each_task(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    match POOL.get_or_init(|| None) {
        Some(pool) if tasks > 1 => {
            let next = AtomicUsize::new(0);
            let drain = || loop {
                let t = next.fetch_add(1, Ordering::Relaxed);
                if t >= tasks {
                    break;
                }
                task(t);
            };
            let helpers = pool.current_num_threads().min(tasks - 1);
            pool.in_place_scope(|scope| {
                for _ in 0..helpers {
                    scope.spawn(|_| drain());
                }
                drain();
            });
        }
        _ => (0..tasks).for_each(task),
    }
}

#[cfg(test)]
mod tests {
    use std::panic::catch_unwind;

    use super::*;

    #[test]
    fn every_task_runs_once() {
        set_compute_threads(2);
        let counts: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
        for_each_task(counts.len(), &|t| {
            counts[t].fetch_add(1, Ordering::Relaxed);
        });
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_panicking_task_panics_the_caller() {
        let result = catch_unwind(|| {
            for_each_task(64, &|t| {
                if t == 17 {
                    panic!("task 17");
                }
            })
        });
        assert!(result.is_err());
    }
}
