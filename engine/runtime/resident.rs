//! Every expert held in memory, already decoded to f32 — optionally in several widths at once,
//! with the width used chosen per expert. This is the `io-free` baseline (no reads at run time)
//! and the model the bit-width tuner evaluates plans on without rewriting stores.

use std::collections::HashMap;

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::model::provider::{ExpertProvider, ExpertWeights};
use crate::quant::{dequantize_into, quantize};
use crate::runtime::codec::decode_expert;
use crate::runtime::stats::ExpertStats;
use crate::store::AlignedBuf;
use crate::store::{ExpertEncoding, ExpertStore};

pub struct ResidentExperts {
    /// (expert, width) → its matrices in blob order (`wi`, `wo` or `gate`, `up`, `down`), f32.
    variants: HashMap<(ExpertId, ExpertEncoding), Vec<Tensor>>,
    /// Names of the matrices in blob order (the same for every expert of a store).
    names: HashMap<ExpertId, Vec<String>>,
    /// Width in use for each expert (absent: its stored width).
    choice: HashMap<ExpertId, ExpertEncoding>,
    stored: HashMap<ExpertId, ExpertEncoding>,
    stats: ExpertStats,
}

/// `weights` through quantization at `encoding` and back (f32 → f32); floats are exact.
fn requantized(weights: &Tensor, encoding: ExpertEncoding) -> Result<Tensor> {
    let ExpertEncoding::Quant(bits) = encoding else {
        return Ok(weights
            .f_to_kind(encoding_kind(encoding))?
            .f_to_kind(tch::Kind::Float)?);
    };
    let size = weights.size();
    let (rows, cols) = (size[0] as usize, size[1] as usize);
    let values = Vec::<f32>::try_from(weights.f_flatten(0, -1)?)?;
    let (packed, scales) = quantize(&values, rows, cols, bits)?;
    let mut out = vec![0f32; rows * cols];
    dequantize_into(&packed, &scales, rows, cols, bits, &mut out)?;
    Ok(Tensor::f_from_slice(&out)?.f_view([rows as i64, cols as i64])?)
}

fn encoding_kind(encoding: ExpertEncoding) -> tch::Kind {
    match encoding {
        ExpertEncoding::Float(d) => d.kind(),
        ExpertEncoding::Quant(_) => tch::Kind::Float,
    }
}

impl ResidentExperts {
    /// Reads every expert of `store` once (decoded to f32), plus its requantization at each of
    /// `extra_widths` (computed from the stored weights).
    pub fn load(store: &ExpertStore, extra_widths: &[ExpertEncoding]) -> Result<Self> {
        let mut variants = HashMap::new();
        let mut stored = HashMap::new();
        let mut slot = AlignedBuf::new(store.max_padded_expert_bytes() as usize);
        let mut names = HashMap::new();
        for entry in &store.index().experts {
            store.read_expert(entry.id, slot.as_mut_slice())?;
            let mut matrices: Vec<Tensor> = entry
                .matrices
                .iter()
                .map(|m| {
                    Tensor::zeros(
                        [m.rows as i64, m.cols as i64],
                        (tch::Kind::Float, tch::Device::Cpu),
                    )
                })
                .collect();
            decode_expert(entry, slot.as_slice(), &mut matrices)?;
            for &width in extra_widths {
                if width != entry.encoding {
                    let requantized = matrices
                        .iter()
                        .map(|m| requantized(m, width))
                        .collect::<Result<Vec<_>>>()?;
                    variants.insert((entry.id, width), requantized);
                }
            }
            variants.insert((entry.id, entry.encoding), matrices);
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

    /// Bytes all experts take in memory (f32, every loaded width).
    pub fn bytes(&self) -> u64 {
        self.variants
            .values()
            .flat_map(|m| m.iter().map(|t| (t.numel() * 4) as u64))
            .sum()
    }
}

impl ExpertProvider for ResidentExperts {
    fn expert(&mut self, id: ExpertId) -> Result<ExpertWeights> {
        let width = self
            .choice
            .get(&id)
            .or_else(|| self.stored.get(&id))
            .copied()
            .ok_or_else(|| Error::Internal(format!("{id} is not in the model")))?;
        let matrices = &self.variants[&(id, width)];
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
