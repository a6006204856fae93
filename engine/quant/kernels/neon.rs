//! NEON kernels (always present on aarch64): 16 packed bytes per step, the rest scalar.

use std::arch::aarch64::*;

use super::scalar::{for_each_row, out_blocks, scalar_row};
use crate::quant::QuantBits;

#[target_feature(enable = "neon")]
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

#[target_feature(enable = "neon")]
fn row(src: &[u8], scale: f32, bits: QuantBits, dst: &mut [f32]) {
    let s = vdupq_n_f32(scale);
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
            for (block, [o0, o1]) in blocks.iter().zip(out_blocks::<2>(head)) {
                let v = load(block);
                let lo = vshrq_n_s8::<4>(vshlq_n_s8::<4>(v));
                let hi = vshrq_n_s8::<4>(v);
                store16(vzip1q_s8(lo, hi), s, o0);
                store16(vzip2q_s8(lo, hi), s, o1);
            }
        }
        QuantBits::Int2 => {
            for (block, [o0, o1, o2, o3]) in blocks.iter().zip(out_blocks::<4>(head)) {
                let v = load(block);
                let f0 = vshrq_n_s8::<6>(vshlq_n_s8::<6>(v));
                let f1 = vshrq_n_s8::<6>(vshlq_n_s8::<4>(v));
                let f2 = vshrq_n_s8::<6>(vshlq_n_s8::<2>(v));
                let f3 = vshrq_n_s8::<6>(v);
                // Byte k's fields in element order: (f0 f1) and (f2 f3) pairs, then quads.
                let (a_lo, b_lo) = (vzip1q_s8(f0, f1), vzip1q_s8(f2, f3));
                let (a_hi, b_hi) = (vzip2q_s8(f0, f1), vzip2q_s8(f2, f3));
                let quads = |a: int8x16_t, b: int8x16_t| {
                    let (a, b) = (vreinterpretq_s16_s8(a), vreinterpretq_s16_s8(b));
                    (
                        vreinterpretq_s8_s16(vzip1q_s16(a, b)),
                        vreinterpretq_s8_s16(vzip2q_s16(a, b)),
                    )
                };
                let (e0, e1) = quads(a_lo, b_lo);
                let (e2, e3) = quads(a_hi, b_hi);
                store16(e0, s, o0);
                store16(e1, s, o1);
                store16(e2, s, o2);
                store16(e3, s, o3);
            }
        }
    }
    scalar_row(&src[steps * 16..], scale, bits, tail);
}

#[target_feature(enable = "neon")]
fn load(block: &[u8; 16]) -> int8x16_t {
    // SAFETY: reads 16 bytes from a 16-byte array.
    unsafe { vld1q_s8(block.as_ptr().cast()) }
}

/// Converts 16 i8 codes to f32, multiplies by the scale and stores them.
#[target_feature(enable = "neon")]
fn store16(codes: int8x16_t, s: float32x4_t, o: &mut [f32; 16]) {
    let lo = vmovl_s8(vget_low_s8(codes));
    let hi = vmovl_high_s8(codes);
    let quarters = [
        vmovl_s16(vget_low_s16(lo)),
        vmovl_high_s16(lo),
        vmovl_s16(vget_low_s16(hi)),
        vmovl_high_s16(hi),
    ];
    for (q, o) in quarters.into_iter().zip(o.as_chunks_mut::<4>().0) {
        // SAFETY: writes 4 floats into a 4-float array.
        unsafe { vst1q_f32(o.as_mut_ptr(), vmulq_f32(vcvtq_f32_s32(q), s)) };
    }
}
