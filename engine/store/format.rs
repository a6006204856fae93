//! The expert store's format: one file holding every expert of a model, each as one contiguous,
//! page-aligned blob, so that loading an expert is one large read.
//!
//! Layout (all integers little-endian):
//!
//! ```text
//! offset 0   magic  b"EMOEXPRT"                       8 bytes
//!        8   format version (u32)                      4 bytes
//!        12  reserved, zero (u32)                      4 bytes
//!        16  index length in bytes (u64)               8 bytes
//!        24  CRC-32 of the index bytes (u32)           4 bytes
//!        28  reserved, zero (u32)                      4 bytes
//!        32  index: bincode(StoreIndex)
//!        …   zero padding up to a multiple of 4096
//!            blobs: one per expert, each starting on a 4096-byte boundary and padded to one
//! ```
//!
//! A blob holds the expert's matrices back to back, row-major, each starting on a 64-byte
//! boundary inside the blob — Switch's ReLU experts `wi` [d_ff, d_model] then `wo`
//! [d_model, d_ff]; SwiGLU experts (decoder-only families) `gate` and `up` [d_ff, d_model] then
//! `down` [d_model, d_ff], so one read brings all three — in the expert's stored encoding:
//! f32/f16/bf16 as is, or INT8/INT4/INT2 packed as `quant` documents
//! (each row on a byte boundary) followed, on the next 64-byte boundary, by the matrix's
//! per-row scales as little-endian f32. Each index entry records the blob's offset, its length, its
//! encoding, its matrices and the CRC-32 of its `length` bytes, which is verified on every read.
//! Page alignment keeps reads aligned for `O_DIRECT` and lets a blob land in a page-aligned slot.
//!
//! This file holds the format and its writer; [`super::reader`] opens and reads a store. The
//! store knows bytes, offsets, encodings and checksums, not the model: the bundle hands it the
//! expected [`ExpertLayout`].

use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::quant::QuantBits;
use crate::weights::WeightDtype;

pub const STORE_MAGIC: &[u8; 8] = b"EMOEXPRT";
pub const STORE_VERSION: u32 = 2;
pub const HEADER_BYTES: usize = 32;
/// Blob alignment: the page size of every board we target (and the `O_DIRECT` granule).
pub const BLOB_ALIGN: u64 = 4096;
/// Alignment of a matrix inside a blob (cache line / SIMD friendly).
pub const MATRIX_ALIGN: u64 = 64;

/// How an expert's matrices are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExpertEncoding {
    /// Unquantized, in the given float type.
    Float(WeightDtype),
    /// Channel-wise symmetric linear quantization (per-row f32 scales).
    Quant(QuantBits),
}

impl ExpertEncoding {
    pub const ALL: [ExpertEncoding; 6] = [
        ExpertEncoding::Float(WeightDtype::F32),
        ExpertEncoding::Float(WeightDtype::F16),
        ExpertEncoding::Float(WeightDtype::BF16),
        ExpertEncoding::Quant(QuantBits::Int8),
        ExpertEncoding::Quant(QuantBits::Int4),
        ExpertEncoding::Quant(QuantBits::Int2),
    ];

    pub fn bits(self) -> u32 {
        match self {
            ExpertEncoding::Float(d) => 8 * d.size_bytes() as u32,
            ExpertEncoding::Quant(q) => q.bits(),
        }
    }

    /// `f32`, `f16`, `bf16`, `int8`, `int4`, `int2`.
    pub fn name(self) -> &'static str {
        match self {
            ExpertEncoding::Float(d) => d.name(),
            ExpertEncoding::Quant(q) => q.name(),
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        let t = text.trim().to_ascii_lowercase();
        let t = match t.as_str() {
            "8" => "int8",
            "4" => "int4",
            "2" => "int2",
            "16" => "f16",
            "32" => "f32",
            other => other,
        };
        Self::ALL.into_iter().find(|e| e.name() == t)
    }

    /// Stored bytes of a `rows × cols` matrix (without its scales).
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> u64 {
        match self {
            ExpertEncoding::Float(d) => (rows * cols * d.size_bytes()) as u64,
            ExpertEncoding::Quant(q) => q.matrix_bytes(rows, cols) as u64,
        }
    }

    /// Bytes of the per-row scales of a `rows`-row matrix.
    pub fn scales_bytes(self, rows: usize) -> u64 {
        match self {
            ExpertEncoding::Float(_) => 0,
            ExpertEncoding::Quant(_) => 4 * rows as u64,
        }
    }
}

/// One matrix inside an expert blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatrixEntry {
    /// HF name of the matrix inside the expert (`wi`, `wo`).
    pub name: String,
    pub rows: u32,
    pub cols: u32,
    /// Byte offset inside the blob.
    pub offset: u64,
    pub bytes: u64,
    /// Offset and length of the per-row f32 scales (quantized encodings; 0 otherwise).
    pub scales_offset: u64,
    pub scales_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertEntry {
    pub id: ExpertId,
    /// Byte offset of the blob in the store file (a multiple of [`BLOB_ALIGN`]).
    pub offset: u64,
    /// Meaningful bytes of the blob (the blob is padded to [`BLOB_ALIGN`] after them).
    pub length: u64,
    pub encoding: ExpertEncoding,
    pub matrices: Vec<MatrixEntry>,
    /// CRC-32 (IEEE) of the blob's `length` bytes.
    pub checksum: u32,
}

impl ExpertEntry {
    /// Bytes the blob occupies on disk and in a slot (padded).
    pub fn padded_length(&self) -> u64 {
        align_up(self.length, BLOB_ALIGN)
    }

    pub fn matrix(&self, name: &str) -> Option<&MatrixEntry> {
        self.matrices.iter().find(|m| m.name == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreIndex {
    pub experts: Vec<ExpertEntry>,
}

/// `value` rounded up to a multiple of `align`; saturates at `u64::MAX` rather than wrapping,
/// so a crafted length cannot wrap to a small one.
pub fn align_up(value: u64, align: u64) -> u64 {
    value.div_ceil(align).saturating_mul(align)
}

/// What a store must hold, as the bundle knows it from the model: the matrices of one expert
/// (name, rows, cols) in blob order, and every expert of every MoE block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLayout {
    pub matrices: Vec<(&'static str, usize, usize)>,
    pub experts: Vec<ExpertId>,
}

impl ExpertLayout {
    /// Lays out one expert's blob: matrix entries with offsets, and the meaningful length.
    pub fn blob(&self, encoding: ExpertEncoding) -> (Vec<MatrixEntry>, u64) {
        layout_blob(&self.matrices, encoding)
    }
}

/// Lays out one expert's blob from its matrix shapes (blob order): matrix entries with
/// offsets, and the meaningful length.
pub fn layout_blob(
    shapes: &[(&'static str, usize, usize)],
    encoding: ExpertEncoding,
) -> (Vec<MatrixEntry>, u64) {
    let mut offset = 0u64;
    let mut matrices = Vec::new();
    for &(name, rows, cols) in shapes {
        offset = align_up(offset, MATRIX_ALIGN);
        let bytes = encoding.matrix_bytes(rows, cols);
        let matrix_offset = offset;
        offset += bytes;
        let scales_bytes = encoding.scales_bytes(rows);
        let scales_offset = if scales_bytes > 0 {
            offset = align_up(offset, MATRIX_ALIGN);
            let at = offset;
            offset += scales_bytes;
            at
        } else {
            0
        };
        matrices.push(MatrixEntry {
            name: name.into(),
            rows: rows as u32,
            cols: cols as u32,
            offset: matrix_offset,
            bytes,
            scales_offset,
            scales_bytes,
        });
    }
    (matrices, offset)
}

/// Writes an expert store: the layout of every expert is fixed up front, blobs are written in
/// order, and the index (whose size does not depend on the checksums) is written last.
pub struct ExpertStoreWriter {
    path: PathBuf,
    file: File,
    index: StoreIndex,
    next: usize,
}

impl ExpertStoreWriter {
    /// `experts` lists every expert in the order their blobs will be written.
    pub fn create(
        path: &Path,
        layout: &ExpertLayout,
        experts: &[(ExpertId, ExpertEncoding)],
    ) -> Result<Self> {
        let mut entries = Vec::with_capacity(experts.len());
        for &(id, encoding) in experts {
            let (matrices, length) = layout.blob(encoding);
            entries.push(ExpertEntry {
                id,
                offset: 0,
                length,
                encoding,
                matrices,
                checksum: 0,
            });
        }
        let mut index = StoreIndex { experts: entries };
        let index_len = bincode::serialized_size(&index)
            .map_err(|e| Error::format(path, format!("cannot encode index: {e}")))?;
        let mut offset = align_up(HEADER_BYTES as u64 + index_len, BLOB_ALIGN);
        for entry in &mut index.experts {
            entry.offset = offset;
            offset += entry.padded_length();
        }
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        file.set_len(offset).map_err(|e| Error::io(path, e))?;
        Ok(ExpertStoreWriter {
            path: path.to_path_buf(),
            file,
            index,
            next: 0,
        })
    }

    /// The entry the next [`write_next`](Self::write_next) call fills.
    pub fn next_entry(&self) -> Option<&ExpertEntry> {
        self.index.experts.get(self.next)
    }

    /// Writes the next expert's blob (exactly its `length` bytes).
    pub fn write_next(&mut self, blob: &[u8]) -> Result<()> {
        let entry = self
            .index
            .experts
            .get_mut(self.next)
            .ok_or_else(|| Error::format(&self.path, "more experts written than declared"))?;
        if blob.len() as u64 != entry.length {
            return Err(Error::format(
                &self.path,
                format!(
                    "{}: blob of {} bytes, layout says {}",
                    entry.id,
                    blob.len(),
                    entry.length
                ),
            ));
        }
        entry.checksum = crc32fast::hash(blob);
        self.file
            .write_all_at(blob, entry.offset)
            .map_err(|e| Error::io(&self.path, e))?;
        self.next += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<StoreIndex> {
        if self.next != self.index.experts.len() {
            return Err(Error::format(
                &self.path,
                format!(
                    "only {} of {} experts written",
                    self.next,
                    self.index.experts.len()
                ),
            ));
        }
        let index_bytes = bincode::serialize(&self.index)
            .map_err(|e| Error::format(&self.path, format!("cannot encode index: {e}")))?;
        let mut header = Vec::with_capacity(HEADER_BYTES);
        header.extend_from_slice(STORE_MAGIC);
        header.extend_from_slice(&STORE_VERSION.to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        header.extend_from_slice(&(index_bytes.len() as u64).to_le_bytes());
        header.extend_from_slice(&crc32fast::hash(&index_bytes).to_le_bytes());
        header.extend_from_slice(&0u32.to_le_bytes());
        let io = |e| Error::io(&self.path, e);
        self.file.seek(SeekFrom::Start(0)).map_err(io)?;
        self.file.write_all(&header).map_err(io)?;
        self.file.write_all(&index_bytes).map_err(io)?;
        self.file.sync_all().map_err(io)?;
        Ok(self.index)
    }
}
