//! Stand-ins: a low-bit copy of every decoder expert, resident beside the expert buffer, so that
//! a decode step whose expert is not ready in the buffer computes with the copy instead of
//! waiting for the read, while the full expert is read for the steps after it (HOBBIT's idea).
//! Lossy, so off by default (`--stand-in int2|int4`).
//!
//! The copies are made when the buffer opens: each decoder expert is read once from the store
//! (paced like any read), decoded to f32 and quantized again at the stand-in width, channel-wise
//! as `convert` does. Their bytes come out of the budget like resident weights.
//!
//! Only decoder experts get one, and they are used only in forward calls of at most
//! [`MAX_ROWS`] routed tokens (decode steps, beams included): the encoder and a prompt prefill
//! compute every source token on their experts, which are not needed again soon, so a stand-in
//! there would cost accuracy on every token and leave nothing to read "for later".

use std::collections::HashMap;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::ids::{ExpertId, Stack};
use crate::model::provider::ExpertWeights;
use crate::quant::QuantBits;
use crate::store::{
    align_up, layout_blob, AlignedBuf, ExpertEncoding, ExpertEntry, ExpertLayout, ExpertStore,
    MATRIX_ALIGN,
};

use super::codec::{expert_weights, reencode_expert};

/// Most tokens a forward call may route to a layer for its missing experts to be computed by
/// their stand-ins (a decode step of up to 16 sequences or beams).
pub const MAX_ROWS: usize = 16;

/// The experts that get a stand-in: every decoder expert of the store.
pub fn stand_in_experts(store: &ExpertStore) -> Vec<ExpertId> {
    let mut ids: Vec<ExpertId> = store
        .index()
        .experts
        .iter()
        .map(|e| e.id)
        .filter(|id| id.stack == Stack::Decoder)
        .collect();
    ids.sort();
    ids
}

/// Bytes of one stand-in blob (its place in the stand-ins' memory).
fn blob_stride(layout: &ExpertLayout, bits: QuantBits) -> u64 {
    let (_, length) = layout_blob(&layout.matrices, ExpertEncoding::Quant(bits));
    align_up(length, MATRIX_ALIGN)
}

/// Memory the stand-ins of `experts` experts take, for the budget.
pub fn stand_in_bytes(layout: &ExpertLayout, bits: QuantBits, experts: usize) -> u64 {
    blob_stride(layout, bits).saturating_mul(experts as u64)
}

/// The resident low-bit copies.
pub struct StandIns {
    bits: QuantBits,
    /// Each expert's entry at the stand-in encoding, and where its blob starts in `memory`.
    entries: HashMap<ExpertId, (ExpertEntry, usize)>,
    memory: AlignedBuf,
    /// Bytes read from the store to make them, and how long making them took.
    pub load_bytes: u64,
    pub load_ms: f64,
}

impl StandIns {
    /// Reads each of `ids` from `store` and keeps it quantized to `bits`.
    pub fn build(
        store: &ExpertStore,
        layout: &ExpertLayout,
        ids: &[ExpertId],
        bits: QuantBits,
    ) -> Result<Self> {
        let started = Instant::now();
        let encoding = ExpertEncoding::Quant(bits);
        let (matrices, length) = layout_blob(&layout.matrices, encoding);
        let stride = blob_stride(layout, bits) as usize;
        let mut memory = AlignedBuf::new(stride * ids.len());
        let mut scratch = AlignedBuf::new(store.max_padded_expert_bytes() as usize);
        let mut entries = HashMap::new();
        let mut load_bytes = 0;
        for (i, &id) in ids.iter().enumerate() {
            let stored = store
                .entry(id)
                .ok_or_else(|| Error::Internal(format!("stand-in for {id}: not in the store")))?
                .clone();
            load_bytes += store.read_expert(id, scratch.as_mut_slice())?;
            let at = i * stride;
            let blob = &mut memory.as_mut_slice()[at..at + stride];
            reencode_expert(&stored, scratch.as_slice(), &matrices, encoding, blob)?;
            let entry = ExpertEntry {
                id,
                offset: at as u64,
                length,
                encoding,
                matrices: matrices.clone(),
                checksum: 0,
            };
            entries.insert(id, (entry, at));
        }
        Ok(StandIns {
            bits,
            entries,
            memory,
            load_bytes,
            load_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    pub fn bits(&self) -> QuantBits {
        self.bits
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Memory the copies hold.
    pub fn bytes(&self) -> u64 {
        self.memory.as_slice().len() as u64
    }

    pub fn has(&self, id: ExpertId) -> bool {
        self.entries.contains_key(&id)
    }

    /// The stand-in of `id`, as views of its copy.
    pub fn weights(&self, id: ExpertId) -> Result<ExpertWeights<'_>> {
        let (entry, at) = self
            .entries
            .get(&id)
            .ok_or_else(|| Error::Internal(format!("no stand-in for {id}")))?;
        let end = at + entry.length as usize;
        expert_weights(entry, &self.memory.as_slice()[*at..end])
    }
}
