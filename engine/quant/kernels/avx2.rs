//! AVX2 kernels: 16 packed bytes per step (16, 32 or 64 values), the rest of the row scalar.

use std::arch::x86_64::*;

use super::scalar::{for_each_row, out_blocks, scalar_row};
use crate::quant::QuantBits;

#[target_feature(enable = "avx2")]
pub(crate) fn dequantize_rows(
    packed: &[u8],
    scales: &[f32],
    cols: usize,
    bits: QuantBits,
    out: &mut [f32],
) {
    for_each_row(packed, scales, cols, bits, out, |src, scale, bits, dst| {
        row(src, scale, bits, dst)
    });
}

#[target_feature(enable = "avx2")]
fn row(src: &[u8], scale: f32, bits: QuantBits, dst: &mut [f32]) {
    let s = _mm256_set1_ps(scale);
    // Whole 16-byte steps; a row's last partial byte, if any, is always in the tail.
    let steps = dst.len() / (16 * bits.per_byte());
    let (blocks, _) = src.as_chunks::<16>();
    let (head, tail) = dst.split_at_mut(steps * 16 * bits.per_byte());
    match bits {
        QuantBits::Int8 => {
            for (block, o) in blocks.iter().zip(head.as_chunks_mut::<16>().0) {
                store16(load(block), s, o);
            }
        }
        QuantBits::Int4 => {
            let mask = _mm_set1_epi8(0x0f);
            let sign = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
            for (block, [o0, o1]) in blocks.iter().zip(out_blocks::<2>(head)) {
                let v = load(block);
                let lo = _mm_shuffle_epi8(sign, _mm_and_si128(v, mask));
                let hi = _mm_shuffle_epi8(sign, _mm_and_si128(_mm_srli_epi16(v, 4), mask));
                store16(_mm_unpacklo_epi8(lo, hi), s, o0);
                store16(_mm_unpackhi_epi8(lo, hi), s, o1);
            }
        }
        QuantBits::Int2 => {
            let mask = _mm_set1_epi8(0x03);
            let sign = _mm_setr_epi8(0, 1, -2, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
            for (block, [o0, o1, o2, o3]) in blocks.iter().zip(out_blocks::<4>(head)) {
                let v = load(block);
                let f0 = _mm_shuffle_epi8(sign, _mm_and_si128(v, mask));
                let f1 = _mm_shuffle_epi8(sign, _mm_and_si128(_mm_srli_epi16(v, 2), mask));
                let f2 = _mm_shuffle_epi8(sign, _mm_and_si128(_mm_srli_epi16(v, 4), mask));
                let f3 = _mm_shuffle_epi8(sign, _mm_and_si128(_mm_srli_epi16(v, 6), mask));
                // Byte k's fields in element order: (f0 f1) and (f2 f3) pairs, then quads.
                let (a_lo, b_lo) = (_mm_unpacklo_epi8(f0, f1), _mm_unpacklo_epi8(f2, f3));
                let (a_hi, b_hi) = (_mm_unpackhi_epi8(f0, f1), _mm_unpackhi_epi8(f2, f3));
                store16(_mm_unpacklo_epi16(a_lo, b_lo), s, o0);
                store16(_mm_unpackhi_epi16(a_lo, b_lo), s, o1);
                store16(_mm_unpacklo_epi16(a_hi, b_hi), s, o2);
                store16(_mm_unpackhi_epi16(a_hi, b_hi), s, o3);
            }
        }
    }
    scalar_row(&src[steps * 16..], scale, bits, tail);
}

#[target_feature(enable = "avx2")]
fn load(block: &[u8; 16]) -> __m128i {
    // SAFETY: reads 16 bytes from a 16-byte array (unaligned load).
    unsafe { _mm_loadu_si128(block.as_ptr().cast()) }
}

/// Converts 16 i8 codes to f32, multiplies by the scale and stores them.
#[target_feature(enable = "avx2")]
fn store16(codes: __m128i, s: __m256, o: &mut [f32; 16]) {
    let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes));
    let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(codes, codes)));
    // SAFETY: writes 8 + 8 floats into a 16-float array (unaligned stores).
    unsafe {
        _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(lo, s));
        _mm256_storeu_ps(o.as_mut_ptr().add(8), _mm256_mul_ps(hi, s));
    }
}
