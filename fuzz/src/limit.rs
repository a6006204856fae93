//! An allocator that turns an unbounded allocation into a crash, as libFuzzer's
//! `-malloc_limit_mb` does: the fuzz targets (and the engine's `tests/fuzz_corpus.rs`, which
//! replays the corpus) install it as their global allocator.

use std::alloc::{GlobalAlloc, Layout, System};

/// Largest single allocation a parser may make on fuzzed input: far above anything a valid
/// input of the corpus's size needs, far below what a crafted length field would ask for.
pub const MALLOC_LIMIT: usize = 256 << 20;

/// The system allocator, aborting (a crash for AFL++) on any allocation above [`MALLOC_LIMIT`].
pub struct LimitedAlloc;

unsafe impl GlobalAlloc for LimitedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout.size());
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(new_size);
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

fn check(size: usize) {
    if size > MALLOC_LIMIT {
        // No allocation from here: write(2) straight to standard error, then abort.
        let message = b"edgemoe-fuzz: allocation above the 256 MiB limit\n";
        // SAFETY: writes a static buffer to fd 2.
        unsafe {
            libc_write(2, message.as_ptr(), message.len());
        }
        std::process::abort();
    }
}

extern "C" {
    #[link_name = "write"]
    fn libc_write(fd: i32, buf: *const u8, count: usize) -> isize;
}
