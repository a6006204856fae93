//! Memory for the bytes a decode step streams: weight matrices and expert slots.
//!
//! A decode step reads every weight it uses once, front to back, and its speed is the speed of
//! that stream. With 4 KiB pages the stream crosses a page every 4 KiB, and the CPU's hardware
//! prefetchers stop at page boundaries and every page costs a TLB entry; backed by transparent
//! huge pages (2 MiB on x86_64 and on 4 KiB-page ARM kernels) the same stream ran an INT4 LM head
//! GEMV at 39 GiB/s instead of 29–33 on two Zen 4 cores (`cargo bench --bench matmul -- "from
//! memory"`, BENCHMARKS.md §9.8). Most kernels (and Raspberry Pi OS's) only give huge pages to
//! memory that asks for them (`transparent_hugepage=madvise`), so [`PageBytes`] asks: it
//! aligns a large buffer to the huge-page size and advises the kernel (`MADV_HUGEPAGE`) before
//! the first write. Elsewhere, or where the kernel says no, it is an ordinary aligned buffer.
//!
//! The working memory of a forward pass (libtorch's tensors, the kernels' scratch) is allocated
//! and freed many times over with the same sizes; [`reuse_freed_memory`] keeps the C allocator
//! from handing it back to the kernel between uses, so that it is not faulted in and zeroed again.

use std::alloc::{self, Layout};
use std::sync::{Arc, OnceLock};

/// Alignment of every buffer (a cache line, and more than any kernel's loads need).
const MIN_ALIGN: usize = 64;

/// The kernel's transparent huge page size (`/sys/kernel/mm/transparent_hugepage/hpage_pmd_size`;
/// 2 MiB where it cannot be read).
pub fn huge_page_size() -> usize {
    static SIZE: OnceLock<usize> = OnceLock::new();
    *SIZE.get_or_init(|| {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .filter(|s| s.is_power_of_two() && *s >= 4096)
            .unwrap_or(2 << 20)
    })
}

/// Allocations below this size come from the allocator's heap, which keeps them for reuse once
/// freed, rather than from a fresh `mmap` each (glibc's largest allowed value on 64-bit targets).
const MMAP_THRESHOLD: usize = 32 << 20;

/// Free memory the heap may keep at its top before handing it back (glibc's own rule when it
/// adjusts the thresholds itself: twice the `mmap` threshold).
const TRIM_THRESHOLD: usize = 2 * MMAP_THRESHOLD;

/// Sets glibc's allocator to keep freed memory for reuse: called once at the start of the
/// process, before any other thread exists.
///
/// glibc serves an allocation of at least its `mmap` threshold with a fresh `mmap` and unmaps it
/// on free. The threshold adapts (it rises to the size of the last such block freed), but an
/// allocation of exactly that size still takes `mmap`, and an encoder allocates the same sizes
/// over and over: switch-base-8's attention scores are 12 heads × 353 × 353 floats (6 MiB), three
/// such tensors per layer. Each fresh mapping is faulted in 4 KiB at a time and zeroed by the
/// kernel: 42,000 page faults in one 353-token encode, about a tenth of its time
/// (BENCHMARKS.md §9.28). With a fixed threshold of 32 MiB and the heap trimmed only above
/// 64 MiB of free space, freed blocks are reused instead. The cost is at most 64 MiB of freed
/// memory kept at the top of the heap; blocks of 32 MiB and more (the resident weights, the
/// expert buffer) still come from `mmap` and go back when freed. Measured in the memory soak
/// (`benches/soak.py`), the peak of anonymous memory rose by 10–18 MiB, inside the runtime
/// overhead the README states.
///
/// Other C libraries (musl) keep their own rules; there this does nothing.
pub fn reuse_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets the allocator's parameters; both values are within the ranges
    // glibc accepts (it returns 0 and changes nothing otherwise).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int);
    }
}

/// Owned bytes in a buffer on huge pages where it spans one: a whole buffer, or one of the
/// disjoint parts of a buffer split between many owners (the experts of `io-free`, the slots of
/// an expert buffer), so that even parts smaller than a huge page sit on huge pages. A buffer
/// of at least a huge page starts on one, and its whole huge pages are advised before they are
/// first touched; the rest of it (and any smaller buffer) is on ordinary pages.
pub struct PageBytes {
    whole: Arc<Buffer>,
    start: usize,
    len: usize,
}

/// One allocation, freed when its last [`PageBytes`] goes.
struct Buffer {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer owns its allocation; its bytes are reached only through the `PageBytes`
// that share it, whose ranges are disjoint.
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// `len` zero bytes aligned to at least `align` (a power of two).
    fn zeroed(len: usize, align: usize) -> Buffer {
        let buffer = Self::uninit(len, align);
        // SAFETY: the allocation holds layout.size() bytes.
        unsafe { std::ptr::write_bytes(buffer.ptr, 0, buffer.layout.size()) };
        buffer
    }

    /// A copy of `bytes` (written once, not zeroed first: resident weights are copied at load).
    fn copy_of(bytes: &[u8]) -> Buffer {
        let buffer = Self::uninit(bytes.len(), MIN_ALIGN);
        // SAFETY: the allocation holds at least bytes.len() bytes and is not `bytes`'s; a
        // zero-length copy leaves the one byte of an empty layout unread (no part reaches it).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buffer.ptr, bytes.len()) };
        buffer
    }

    /// The allocation, advised but not yet written: the advice must come before the first
    /// write (the allocator's `alloc_zeroed` writes its zeros itself for large alignments,
    /// which would fault the pages in small). The caller writes every byte a part can reach.
    fn uninit(len: usize, align: usize) -> Buffer {
        let huge = huge_page_size();
        let align = if len >= huge {
            align.max(huge)
        } else {
            align.max(MIN_ALIGN)
        };
        let layout =
            Layout::from_size_align(len.max(1), align).expect("buffer size fits the address space");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        // Only whole huge pages inside the buffer: a huge page for its tail would hold memory
        // past its end (the budget counts a slot's bytes, not huge pages).
        if align >= huge {
            advise_huge_pages(ptr, len / huge * huge);
        }
        Buffer { ptr, layout }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this exact layout.
        unsafe { alloc::dealloc(self.ptr, self.layout) }
    }
}

impl PageBytes {
    /// `len` zero bytes aligned to at least `align` (a power of two).
    pub fn zeroed(len: usize, align: usize) -> Self {
        PageBytes {
            whole: Arc::new(Buffer::zeroed(len, align)),
            start: 0,
            len,
        }
    }

    /// A copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> Self {
        PageBytes {
            whole: Arc::new(Buffer::copy_of(bytes)),
            start: 0,
            len: bytes.len(),
        }
    }

    /// One zeroed buffer split into parts of `lens` bytes, each starting on a multiple of
    /// `align` (a power of two) and owned on its own.
    pub fn split_zeroed(lens: &[usize], align: usize) -> Vec<Self> {
        let align = align.max(MIN_ALIGN);
        let starts: Vec<usize> = lens
            .iter()
            .scan(0usize, |end, &len| {
                let start = *end;
                *end = (start + len).next_multiple_of(align);
                Some(start)
            })
            .collect();
        let total = starts.last().map_or(0, |s| s + lens[lens.len() - 1]);
        let whole = Arc::new(Buffer::zeroed(total, align));
        starts
            .into_iter()
            .zip(lens)
            .map(|(start, &len)| PageBytes {
                whole: Arc::clone(&whole),
                start,
                len,
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: start + len lies inside the buffer (`zeroed` and `split_zeroed` make parts
        // only there), whose bytes are initialised; only this part reaches this range.
        unsafe { std::slice::from_raw_parts(self.whole.ptr.add(self.start), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above; &mut self is the only access to this part's range, which no other
        // part overlaps.
        unsafe { std::slice::from_raw_parts_mut(self.whole.ptr.add(self.start), self.len) }
    }
}

impl std::ops::Deref for PageBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::fmt::Debug for PageBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageBytes({} bytes)", self.len)
    }
}

/// Asks the kernel to back `[ptr, ptr + len)` with transparent huge pages (best effort: an
/// error, or another OS, leaves ordinary pages). A large allocation is a fresh anonymous
/// mapping whose pages the advice then covers at their first fault.
#[allow(unused_variables)]
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: an advisory call on memory this process owns; it changes no contents.
    unsafe {
        libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_hold_what_is_copied() {
        let huge = huge_page_size();
        for len in [0, 1, 4095, huge / 2, huge + 3] {
            let buf = PageBytes::zeroed(len, 4096);
            assert_eq!(buf.len(), len);
            assert!(buf.iter().all(|&b| b == 0));
            let align = if len >= huge { huge } else { 4096 };
            assert_eq!(buf.as_ptr() as usize % align, 0, "{len} bytes");
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            assert_eq!(PageBytes::copy_of(&bytes).as_slice(), &bytes[..]);
        }
    }

    /// Parts are aligned, disjoint and keep what each owner writes; the buffer lives while any
    /// part does.
    #[test]
    fn parts_of_one_buffer_are_aligned_and_disjoint() {
        let lens = [5, 0, 4096, 100, 3];
        let mut parts = PageBytes::split_zeroed(&lens, 4096);
        assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), lens);
        for (i, part) in parts.iter_mut().enumerate() {
            assert_eq!(part.as_ptr() as usize % 4096, 0);
            assert!(part.iter().all(|&b| b == 0));
            part.as_mut_slice().fill(i as u8 + 1);
        }
        let kept = parts.split_off(3);
        drop(parts);
        assert!(kept[0].iter().all(|&b| b == 4));
        assert!(kept[1].iter().all(|&b| b == 5));
        let (a, b) = (kept[0].as_ptr() as usize, kept[1].as_ptr() as usize);
        assert!(a + 100 <= b);
    }
}
