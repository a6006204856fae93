//! A zeroed, page-aligned byte buffer: the memory of an expert slot, and what `O_DIRECT` reads
//! need. Slots are on huge pages where they can be ([`crate::memory`]): the kernels stream a
//! slot's expert once per use.

use super::format::BLOB_ALIGN;
use crate::memory::PageBytes;

/// A zeroed, page-aligned byte buffer (the alignment `O_DIRECT` reads need).
pub struct AlignedBuf {
    bytes: PageBytes,
}

impl AlignedBuf {
    pub fn new(len: usize) -> Self {
        AlignedBuf {
            bytes: PageBytes::zeroed(len.max(1), BLOB_ALIGN as usize),
        }
    }

    /// `count` buffers of `len` bytes carved from one allocation (an expert buffer's slots), so
    /// that they sit on huge pages even when one slot is smaller than a huge page.
    pub fn many(count: usize, len: usize) -> Vec<Self> {
        PageBytes::split_zeroed(&vec![len.max(1); count], BLOB_ALIGN as usize)
            .into_iter()
            .map(|bytes| AlignedBuf { bytes })
            .collect()
    }

    pub fn as_slice(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.bytes.as_mut_slice()
    }
}
