//! The expert store: every expert of a model in one file, one page-aligned, checksummed blob
//! each. [`format`] is the layout and its writer, [`reader`] opens, validates and reads a store
//! (direct, cached or paced), [`aligned`] is the page-aligned memory reads land in.

pub mod aligned;
pub mod format;
pub mod reader;

pub use aligned::AlignedBuf;
pub use format::{
    align_up, layout_blob, ExpertEncoding, ExpertEntry, ExpertLayout, ExpertStoreWriter,
    MatrixEntry, StoreIndex, BLOB_ALIGN, MATRIX_ALIGN,
};
pub use reader::{ExpertStore, ReadPacer, StorageMode};
