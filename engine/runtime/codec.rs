//! Stored expert bytes → the weights the model computes on: views of each matrix of a blob in
//! its stored encoding (f32, f16, bf16, INT8/4/2 with per-row scales), without copying or
//! expanding anything. Every provider hands experts out through [`expert_weights`].

use crate::error::{Error, Result};
use crate::model::layers::Weight;
use crate::model::provider::ExpertWeights;
use crate::quant::matrix::{MatrixFormat, MatrixRef, PackedMatrix};
use crate::store::{ExpertEncoding, ExpertEntry, MatrixEntry};
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

/// Re-encodes one stored expert (`entry`, its blob in `bytes`) into `blob`, laid out by
/// `matrices` (from [`crate::store::format::layout_blob`] for `encoding`): each matrix decoded
/// to f32 and encoded again, its per-row scales written little-endian as the store keeps them.
pub fn reencode_expert(
    entry: &ExpertEntry,
    bytes: &[u8],
    matrices: &[MatrixEntry],
    encoding: ExpertEncoding,
    blob: &mut [u8],
) -> Result<()> {
    let id = entry.id;
    let sources = stored_matrices(entry, bytes)?;
    if sources.len() != matrices.len() {
        return Err(Error::Internal(format!(
            "{id}: {} matrices stored, {} in the layout",
            sources.len(),
            matrices.len()
        )));
    }
    for (m, source) in matrices.iter().zip(sources) {
        let (rows, cols) = (m.rows as usize, m.cols as usize);
        if (source.rows(), source.cols()) != (rows, cols) {
            return Err(Error::Internal(format!(
                "{id}: `{}` is [{}, {}] in the store, [{rows}, {cols}] in the layout",
                m.name,
                source.rows(),
                source.cols()
            )));
        }
        let mut values = vec![0f32; rows * cols];
        source.dequantize_rows(0, rows, &mut values)?;
        let encoded = PackedMatrix::encode(&values, rows, cols, matrix_format(encoding))?;
        let view = encoded.view();
        let outside = || Error::Internal(format!("{id}: `{}` outside its new blob", m.name));
        blob.get_mut(m.offset as usize..(m.offset + m.bytes) as usize)
            .filter(|d| d.len() == view.data().len())
            .ok_or_else(outside)?
            .copy_from_slice(view.data());
        let scales_at = m.scales_offset as usize;
        let scales = blob
            .get_mut(scales_at..scales_at + 4 * view.scales().len())
            .ok_or_else(outside)?;
        for (dst, s) in scales.chunks_exact_mut(4).zip(view.scales()) {
            dst.copy_from_slice(&s.to_le_bytes());
        }
    }
    Ok(())
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
