//! Stored expert bytes → the weights the model computes on: views of each matrix of a blob in
//! its stored encoding (f32, f16, bf16, INT8/4/2 with per-row scales), without copying or
//! expanding anything. Every provider hands experts out through [`expert_weights`].

use crate::error::{Error, Result};
use crate::model::layers::Weight;
use crate::model::provider::ExpertWeights;
use crate::quant::matrix::{MatrixFormat, MatrixRef};
use crate::store::{ExpertEncoding, ExpertEntry};
use crate::weights::WeightDtype;

/// How matrices of `encoding` are laid out for the kernels.
pub fn matrix_format(encoding: ExpertEncoding) -> MatrixFormat {
    match encoding {
        ExpertEncoding::Quant(bits) => MatrixFormat::Quant(bits),
        ExpertEncoding::Float(WeightDtype::F32) => MatrixFormat::F32,
        ExpertEncoding::Float(WeightDtype::F16) => MatrixFormat::F16,
        ExpertEncoding::Float(WeightDtype::BF16) => MatrixFormat::Bf16,
    }
}

/// The matrices of one stored expert (slot bytes), in blob order (`wi`, `wo` or `gate`, `up`,
/// `down`), as views of `bytes`.
pub fn stored_matrices<'a>(entry: &ExpertEntry, bytes: &'a [u8]) -> Result<Vec<MatrixRef<'a>>> {
    let format = matrix_format(entry.encoding);
    entry
        .matrices
        .iter()
        .map(|m| {
            let name = &m.name;
            let outside = || Error::Internal(format!("{}: `{name}` outside its blob", entry.id));
            let data = bytes
                .get(m.offset as usize..(m.offset + m.bytes) as usize)
                .ok_or_else(outside)?;
            let scales: &[f32] = match entry.encoding {
                ExpertEncoding::Quant(_) => {
                    let raw = bytes
                        .get(m.scales_offset as usize..(m.scales_offset + m.scales_bytes) as usize)
                        .ok_or_else(outside)?;
                    // Scales sit on a 64-byte boundary of a page-aligned slot.
                    // SAFETY: any 4 initialised bytes are a valid f32.
                    let (head, scales, tail) = unsafe { raw.align_to::<f32>() };
                    if !head.is_empty() || !tail.is_empty() {
                        return Err(Error::Internal(format!("{}: misaligned scales", entry.id)));
                    }
                    scales
                }
                ExpertEncoding::Float(_) => &[],
            };
            MatrixRef::new(format, m.rows as usize, m.cols as usize, data, scales)
        })
        .collect()
}

/// One stored expert's weights as views of `bytes` (its slot), ready for the model.
pub fn expert_weights<'a>(entry: &ExpertEntry, bytes: &'a [u8]) -> Result<ExpertWeights<'a>> {
    let matrices = stored_matrices(entry, bytes)?
        .into_iter()
        .map(Weight::Stored)
        .collect();
    let names: Vec<&str> = entry.matrices.iter().map(|m| m.name.as_str()).collect();
    ExpertWeights::from_matrices(entry.id, &names, matrices)
}
