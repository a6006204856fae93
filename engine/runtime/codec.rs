//! Stored expert bytes → f32 weights: the blob decoder every provider uses, and the scratch
//! tensors it decodes into (allocated once, reused for every expert).

use tch::{Device, Kind, Tensor};

use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::store::{ExpertEncoding, ExpertEntry};

/// Decodes one stored expert (slot bytes) into f32 scratch tensors, one per matrix of the
/// entry in blob order (`wi`, `wo` or `gate`, `up`, `down`), without allocating.
pub fn decode_expert(entry: &ExpertEntry, bytes: &[u8], out: &mut [Tensor]) -> Result<()> {
    if out.len() != entry.matrices.len() {
        return Err(Error::Internal(format!(
            "{}: {} matrices stored, {} scratch tensors",
            entry.id,
            entry.matrices.len(),
            out.len()
        )));
    }
    for (m, out) in entry.matrices.iter().zip(out.iter_mut()) {
        let name = &m.name;
        let start = m.offset as usize;
        let end = start + m.bytes as usize;
        let stored = bytes
            .get(start..end)
            .ok_or_else(|| Error::Internal(format!("{}: `{name}` outside its blob", entry.id)))?;
        let (rows, cols) = (m.rows as usize, m.cols as usize);
        if out.numel() != rows * cols || out.kind() != Kind::Float || !out.is_contiguous() {
            return Err(Error::Internal(format!(
                "{}: scratch shape mismatch for `{name}`",
                entry.id
            )));
        }
        match entry.encoding {
            ExpertEncoding::Quant(bits) => {
                let scales = bytes
                    .get(m.scales_offset as usize..(m.scales_offset + m.scales_bytes) as usize)
                    .ok_or_else(|| {
                        Error::Internal(format!("{}: `{name}` scales outside its blob", entry.id))
                    })?;
                // Scales sit on a 64-byte boundary of a page-aligned slot.
                // SAFETY: any 4 initialised bytes are a valid f32.
                let (head, scales, tail) = unsafe { scales.align_to::<f32>() };
                if !head.is_empty() || !tail.is_empty() {
                    return Err(Error::Internal(format!("{}: misaligned scales", entry.id)));
                }
                // SAFETY: `out` is a contiguous f32 CPU tensor of rows × cols elements that
                // nothing else reads while this slice lives.
                let dest = unsafe {
                    std::slice::from_raw_parts_mut(out.data_ptr() as *mut f32, rows * cols)
                };
                crate::quant::dequantize_into(stored, scales, rows, cols, bits, dest)?;
            }
            ExpertEncoding::Float(dtype) => {
                // SAFETY: `stored` holds rows × cols elements of `dtype` (checked by the store's
                // layout validation); the view is dropped before this function returns, while
                // `bytes` is still borrowed.
                let view = unsafe {
                    Tensor::f_from_blob(
                        stored.as_ptr(),
                        &[m.rows as i64, m.cols as i64],
                        &[],
                        dtype.kind(),
                        Device::Cpu,
                    )
                }?;
                out.f_copy_(&view)?;
            }
        }
    }
    Ok(())
}

/// Zeroed f32 scratch for one expert of `spec`, one tensor per matrix in blob order.
pub fn expert_scratch(spec: &ModelSpec) -> Vec<Tensor> {
    spec.expert_matrices()
        .iter()
        .map(|&(_, rows, cols)| {
            Tensor::zeros([rows as i64, cols as i64], (Kind::Float, Device::Cpu))
        })
        .collect()
}
