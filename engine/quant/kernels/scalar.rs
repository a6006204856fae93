//! The scalar reference kernel: every other kernel must match it bit for bit, and it is their
//! tail for the part of a row that does not fill a SIMD step.

use crate::quant::QuantBits;

/// Runs `row_kernel(codes, scale, bits, out_row)` on every row of a checked matrix.
#[inline(always)]
pub(crate) fn for_each_row(
    packed: &[u8],
    scales: &[f32],
    cols: usize,
    bits: QuantBits,
    out: &mut [f32],
    mut row_kernel: impl FnMut(&[u8], f32, QuantBits, &mut [f32]),
) {
    if cols == 0 {
        return;
    }
    let rows_in = packed.chunks_exact(bits.row_bytes(cols));
    for ((src, &scale), dst) in rows_in.zip(scales).zip(out.chunks_exact_mut(cols)) {
        row_kernel(src, scale, bits, dst);
    }
}

/// The field `i` (counting from bit 0) of `BITS`-bit two's-complement codes in `byte`.
#[inline(always)]
pub(crate) fn code<const BITS: u32>(byte: u8, i: usize) -> i8 {
    ((byte << (8 - BITS * (i as u32 + 1))) as i8) >> (8 - BITS)
}

#[inline(always)]
pub(crate) fn scalar_row_bits<const BITS: u32, const PER: usize>(
    src: &[u8],
    scale: f32,
    dst: &mut [f32],
) {
    let decode = |byte: u8, values: &mut [f32]| {
        for (i, v) in values.iter_mut().enumerate() {
            *v = f32::from(code::<BITS>(byte, i)) * scale;
        }
    };
    // Whole bytes with a fixed trip count (unrolled, vectorizable), then a partial last byte.
    let (whole, partial) = dst.as_chunks_mut::<PER>();
    for (values, &byte) in whole.iter_mut().zip(src) {
        decode(byte, values);
    }
    if let Some(&byte) = src.get(whole.len()) {
        decode(byte, partial);
    }
}

/// Dequantizes one row; `src` starts at the row's first byte, `dst` at its first value. Also
/// the SIMD kernels' tail.
pub(crate) fn scalar_row(src: &[u8], scale: f32, bits: QuantBits, dst: &mut [f32]) {
    match bits {
        QuantBits::Int8 => scalar_row_bits::<8, 1>(src, scale, dst),
        QuantBits::Int4 => scalar_row_bits::<4, 2>(src, scale, dst),
        QuantBits::Int2 => scalar_row_bits::<2, 4>(src, scale, dst),
    }
}

/// `out` as consecutive groups of `N` 16-value blocks (the SIMD kernels' output steps).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
pub(crate) fn out_blocks<const N: usize>(out: &mut [f32]) -> &mut [[[f32; 16]; N]] {
    out.as_chunks_mut::<16>().0.as_chunks_mut::<N>().0
}
