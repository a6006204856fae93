//! Every expert held in memory in its stored encoding — optionally in several widths at once,
//! with the width used chosen per expert. This is the `io-free` baseline (no reads at run time)
//! and the model the bit-width tuner evaluates plans on without rewriting stores.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::memory::PageBytes;
use crate::model::layers::Weight;
use crate::model::provider::{ExpertProvider, ExpertWeights};
use crate::quant::matrix::PackedMatrix;
use crate::runtime::codec::{matrix_format, stored_matrices};
use crate::runtime::stats::ExpertStats;
use crate::store::AlignedBuf;
use crate::store::{ExpertEncoding, ExpertStore};

pub struct ResidentExperts {
    /// (expert, width) → its matrices in blob order (`wi`, `wo` or `gate`, `up`, `down`), in
    /// that width's encoding.
    variants: HashMap<(ExpertId, ExpertEncoding), Vec<PackedMatrix>>,
    /// Names of the matrices in blob order (the same for every expert of a store).
    names: HashMap<ExpertId, Vec<String>>,
    /// Width in use for each expert (absent: its stored width).
    choice: HashMap<ExpertId, ExpertEncoding>,
    stored: HashMap<ExpertId, ExpertEncoding>,
    stats: ExpertStats,
}

impl ResidentExperts {
    /// Reads every expert of `store` once (kept in its stored encoding), plus its
    /// requantization at each of `extra_widths` (computed from the stored weights).
    pub fn load(store: &ExpertStore, extra_widths: &[ExpertEncoding]) -> Result<Self> {
        let mut variants = HashMap::new();
        let mut stored = HashMap::new();
        let mut slot = AlignedBuf::new(store.max_padded_expert_bytes() as usize);
        let mut names = HashMap::new();
        // Every expert's matrices, at its stored width, in one buffer (on huge pages: the
        // kernels stream them faster from there, see `crate::memory`).
        let lens: Vec<usize> = store
            .index()
            .experts
            .iter()
            .flat_map(|e| e.matrices.iter().map(|m| m.bytes as usize))
            .collect();
        let mut parts = PageBytes::split_zeroed(&lens, 64).into_iter();
        for entry in &store.index().experts {
            store.read_expert(entry.id, slot.as_mut_slice())?;
            let views = stored_matrices(entry, slot.as_slice())?;
            for &width in extra_widths {
                if width != entry.encoding {
                    let requantized = views
                        .iter()
                        .map(|m| {
                            let mut values = vec![0f32; m.rows() * m.cols()];
                            m.dequantize_rows(0, m.rows(), &mut values)?;
                            PackedMatrix::encode(&values, m.rows(), m.cols(), matrix_format(width))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    variants.insert((entry.id, width), requantized);
                }
            }
            let owned = views
                .iter()
                .map(|m| {
                    let part = parts.next().expect("one part per stored matrix");
                    m.to_owned_in(part)
                })
                .collect::<Result<Vec<_>>>()?;
            variants.insert((entry.id, entry.encoding), owned);
            stored.insert(entry.id, entry.encoding);
            names.insert(
                entry.id,
                entry.matrices.iter().map(|m| m.name.clone()).collect(),
            );
        }
        Ok(ResidentExperts {
            variants,
            names,
            choice: HashMap::new(),
            stored,
            stats: ExpertStats::default(),
        })
    }

    /// Uses `width` for `id` from now on (it must have been loaded).
    pub fn set_width(&mut self, id: ExpertId, width: ExpertEncoding) -> Result<()> {
        if !self.variants.contains_key(&(id, width)) {
            return Err(Error::Internal(format!(
                "{id} was not loaded at width {}",
                width.name()
            )));
        }
        self.choice.insert(id, width);
        Ok(())
    }

    /// Back to every expert's stored width.
    pub fn reset_widths(&mut self) {
        self.choice.clear();
    }

    pub fn experts(&self) -> Vec<ExpertId> {
        let mut ids: Vec<ExpertId> = self.stored.keys().copied().collect();
        ids.sort();
        ids
    }

    /// Stored width of `id`.
    pub fn stored_width(&self, id: ExpertId) -> Option<ExpertEncoding> {
        self.stored.get(&id).copied()
    }

    /// Bytes all experts take in memory (in their encodings, every loaded width).
    pub fn bytes(&self) -> u64 {
        self.variants
            .values()
            .flat_map(|m| m.iter().map(|p| p.view().stored_bytes() as u64))
            .sum()
    }
}

impl ExpertProvider for ResidentExperts {
    fn stall_ms(&self) -> f64 {
        self.stats.stall_ms
    }

    fn expert(&mut self, id: ExpertId, _next: Option<ExpertId>) -> Result<ExpertWeights<'_>> {
        let width = self
            .choice
            .get(&id)
            .or_else(|| self.stored.get(&id))
            .copied()
            .ok_or_else(|| Error::Internal(format!("{id} is not in the model")))?;
        let matrices = self.variants[&(id, width)]
            .iter()
            .map(|p| Weight::Stored(p.view()))
            .collect();
        let names: Vec<&str> = self.names[&id].iter().map(String::as_str).collect();
        self.stats.accesses += 1;
        self.stats.hits += 1;
        ExpertWeights::from_matrices(id, &names, matrices)
    }
}

impl ResidentExperts {
    pub fn stats(&self) -> &ExpertStats {
        &self.stats
    }
}
