//! NEON kernels (always present on aarch64): 16 packed bytes per step, the rest scalar; with
//! `dotprod` (ARMv8.2+), `sdot` dot products and the integer GEMM of [`super::gemm`]; with
//! `i8mm` (ARMv8.6+), that GEMM on `smmla`. INT8, f16 and bf16 rows also come with up to four
//! activation rows per pass (beams), each weight loaded and widened once for all of them.

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

// ---- dot products (ARMv8.0 NEON; `dotprod` where the CPU reports it) ----

use std::arch::asm;

use super::gemm::{self, ActLayout, GemmActs, GemmRows, IntGemm, LANES};
use super::{rows_per_pass, scalar as reference, Kernels, QuantRow, BLOCK};

/// Whether this CPU runs [`KERNELS_DOTPROD`] (`sdot`, ARMv8.2+; a Cortex-A72 has none).
pub(crate) fn dotprod_supported() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

pub(crate) static KERNELS: Kernels = Kernels {
    name: "neon",
    // SAFETY (all): NEON is part of the aarch64 baseline.
    dot_quant: |row, bits, cols, x| unsafe { dot_quant(row, bits, cols, x.codes, x.scales) },
    dot_f16: |row, x| unsafe { dot_f16(row, x) },
    dot_bf16: |row, x| unsafe { dot_bf16(row, x) },
    dot_f32: |row, x| unsafe { dot_f32(row, x) },
    widen_f16: |src, out| unsafe {
        widen_half(src, out, |h| f16x4_to_f32(h), reference::widen_f16)
    },
    widen_bf16: |src, out| unsafe {
        widen_half(src, out, |h| bf16x4_to_f32(h), reference::widen_bf16)
    },
    quantize_activations: super::scalar::quantize_activations,
    paired: false,
    dot_quant4: None,
    dot_quant_rows: Some(|rows, bits, cols, x, row_scales, out| unsafe {
        dot_quant_rows(rows, bits, cols, x, row_scales, out)
    }),
    dot_int8_rows: Some(|row, cols, xs, out| unsafe { dot_int8_rows(row, cols, xs, out) }),
    dot_f16_rows: Some(|row, x, cols, out| unsafe { half_rows::<false>(row, x, cols, out) }),
    dot_bf16_rows: Some(|row, x, cols, out| unsafe { half_rows::<true>(row, x, cols, out) }),
};

pub(crate) static KERNELS_DOTPROD: Kernels = Kernels {
    name: "neon-dotprod",
    // SAFETY: this set is only chosen when `dotprod_supported()` said yes.
    dot_quant: |row, bits, cols, x| unsafe { dot_quant_sdot(row, bits, cols, x.codes, x.scales) },
    dot_f16: |row, x| unsafe { dot_f16(row, x) },
    dot_bf16: |row, x| unsafe { dot_bf16(row, x) },
    dot_f32: |row, x| unsafe { dot_f32(row, x) },
    widen_f16: |src, out| unsafe {
        widen_half(src, out, |h| f16x4_to_f32(h), reference::widen_f16)
    },
    widen_bf16: |src, out| unsafe {
        widen_half(src, out, |h| bf16x4_to_f32(h), reference::widen_bf16)
    },
    quantize_activations: super::scalar::quantize_activations,
    paired: false,
    dot_quant4: None,
    dot_quant_rows: Some(|rows, bits, cols, x, row_scales, out| unsafe {
        dot_quant_rows_sdot(rows, bits, cols, x, row_scales, out)
    }),
    dot_int8_rows: Some(|row, cols, xs, out| unsafe { dot_int8_rows_sdot(row, cols, xs, out) }),
    dot_f16_rows: Some(|row, x, cols, out| unsafe { half_rows::<false>(row, x, cols, out) }),
    dot_bf16_rows: Some(|row, x, cols, out| unsafe { half_rows::<true>(row, x, cols, out) }),
};

/// A block's 32 weight codes as two vectors, in [`super::block_order`], from its packed bytes
/// at `w` (32, 16 or 8 of them for `BITS` 8, 4 or 2).
///
/// # Safety
/// Only inlined into functions that enable NEON; the block's bytes are readable at `w`.
#[inline(always)]
unsafe fn unpack_block<const BITS: usize>(w: *const u8) -> (int8x16_t, int8x16_t) {
    // SAFETY: see the function's contract.
    unsafe {
        match BITS {
            8 => (vld1q_s8(w.cast()), vld1q_s8(w.add(16).cast())),
            4 => {
                let v = vld1q_s8(w.cast());
                (vshrq_n_s8::<4>(vshlq_n_s8::<4>(v)), vshrq_n_s8::<4>(v))
            }
            _ => {
                let v = vld1_s8(w.cast());
                let f0 = vshr_n_s8::<6>(vshl_n_s8::<6>(v));
                let f1 = vshr_n_s8::<6>(vshl_n_s8::<4>(v));
                let f2 = vshr_n_s8::<6>(vshl_n_s8::<2>(v));
                let f3 = vshr_n_s8::<6>(v);
                (vcombine_s8(f0, f1), vcombine_s8(f2, f3))
            }
        }
    }
}

/// `acc +` the products `w · x` of a block (32 codes each, as two vectors) summed into four i32
/// lanes: by `sdot` where `SDOT`, else (ARMv8.0) by widening multiplies (`|w| ≤ 128`, `|x| ≤
/// 127`: an i16 holds a sum of two products) accumulated pairwise into i32. A scale group of
/// INT4/INT2 blocks accumulates them this way ([`group_sums`]); [`block_sums`] starts from zero.
///
/// # Safety
/// Only inlined into functions that enable NEON, and `dotprod` where `SDOT`; `w` (the weight
/// block's bytes) and the 32 codes at `x` are readable.
#[inline(always)]
unsafe fn add_block_sums<const SDOT: bool>(
    acc: int32x4_t,
    (w0, w1): (int8x16_t, int8x16_t),
    x: *const i8,
) -> int32x4_t {
    // SAFETY: see the function's contract.
    unsafe {
        let (x0, x1) = (vld1q_s8(x), vld1q_s8(x.add(16)));
        if SDOT {
            sdot(sdot(acc, w0, x0), w1, x1)
        } else {
            let p0 = vmlal_high_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), w0, x0);
            let p1 = vmlal_high_s8(vmull_s8(vget_low_s8(w1), vget_low_s8(x1)), w1, x1);
            vpadalq_s16(vpadalq_s16(acc, p0), p1)
        }
    }
}

/// Block `b` of a weight row (as [`unpack_block`] reads it) against block `b` of activation
/// codes at `x`: its four i32 partial sums ([`add_block_sums`] from zero). [`dot_quant_body`]
/// and the several-row kernels share it.
///
/// # Safety
/// As [`add_block_sums`].
#[inline(always)]
unsafe fn block_sums<const SDOT: bool>(block: (int8x16_t, int8x16_t), x: *const i8) -> int32x4_t {
    // SAFETY: see the function's contract.
    unsafe { add_block_sums::<SDOT>(vdupq_n_s32(0), block, x) }
}

/// ARMv8.0: [`dot_quant_bits`] for the row's width.
#[target_feature(enable = "neon")]
fn dot_quant(row: &[u8], bits: QuantBits, cols: usize, codes: &[i8], scales: &[f32]) -> f32 {
    match bits {
        QuantBits::Int8 => dot_quant_bits::<8>(row, cols, codes, scales),
        QuantBits::Int4 => dot_quant_bits::<4>(row, cols, codes, scales),
        QuantBits::Int2 => dot_quant_bits::<2>(row, cols, codes, scales),
    }
}

/// ARMv8.0: [`dot_quant_body`] on widening multiplies ([`add_block_sums`]), one function per
/// width (kept out of line: one symbol per width in a profile, and for `benches/neon_loops.py`).
#[target_feature(enable = "neon")]
#[inline(never)]
fn dot_quant_bits<const BITS: usize>(row: &[u8], cols: usize, codes: &[i8], scales: &[f32]) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { dot_quant_body::<BITS, false>(row, cols, codes, scales) }
}

/// [`Kernels::dot_quant_rows`] of [`KERNELS`]: [`dot_quant_rows_bits`] for the rows' width.
#[target_feature(enable = "neon")]
fn dot_quant_rows(
    rows: &[u8],
    bits: QuantBits,
    cols: usize,
    x: &QuantRow<'_>,
    row_scales: &[f32],
    out: &mut [f32],
) {
    match bits {
        QuantBits::Int8 => dot_quant_rows_bits::<8>(rows, cols, x, row_scales, out),
        QuantBits::Int4 => dot_quant_rows_bits::<4>(rows, cols, x, row_scales, out),
        QuantBits::Int2 => dot_quant_rows_bits::<2>(rows, cols, x, row_scales, out),
    }
}

/// ARMv8.0: `out[r] = row_scales[r] × ` [`dot_quant_bits`] of row `r` of `rows`, one function
/// per width (out of line, as [`dot_quant_bits`]).
#[target_feature(enable = "neon")]
#[inline(never)]
fn dot_quant_rows_bits<const BITS: usize>(
    rows: &[u8],
    cols: usize,
    x: &QuantRow<'_>,
    row_scales: &[f32],
    out: &mut [f32],
) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { quant_rows::<BITS, false>(rows, cols, x, row_scales, out) }
}

/// The loop over rows of [`dot_quant_rows_bits`] (and, where `SDOT`,
/// [`dot_quant_rows_bits_sdot`]).
///
/// # Safety
/// Only inlined into functions that enable NEON, and `dotprod` where `SDOT`.
#[inline(always)]
unsafe fn quant_rows<const BITS: usize, const SDOT: bool>(
    rows: &[u8],
    cols: usize,
    x: &QuantRow<'_>,
    row_scales: &[f32],
    out: &mut [f32],
) {
    let row_bytes = super::bits_of(BITS).row_bytes(cols);
    assert_eq!(rows.len(), out.len() * row_bytes, "{} rows", out.len());
    assert!(row_scales.len() >= out.len());
    for ((row, &scale), y) in rows.chunks_exact(row_bytes).zip(row_scales).zip(out) {
        // SAFETY: see the function's contract.
        *y = scale * unsafe { dot_quant_body::<BITS, SDOT>(row, cols, x.codes, x.scales) };
    }
}

/// A packed row of `BITS`-bit codes dotted with one activation row: each block's integer sums
/// (`sdot` where `SDOT`) times its activation scale, added into four accumulators in turn (block
/// `b` into accumulator `b mod 4`; the blocks past the last whole four into the first), so that
/// consecutive blocks do not wait on each other's additions; then the four summed, and the
/// partial block at the end, if any, by the scalar reference. INT4 and INT2 rows take whole
/// scale groups ([`super::scale_group`]) first, a group's blocks summed in integers before one
/// conversion and one FMA. [`int8_rows_body`] takes the very same steps for INT8.
///
/// # Safety
/// Only inlined into functions that enable NEON, and `dotprod` where `SDOT`.
#[inline(always)]
unsafe fn dot_quant_body<const BITS: usize, const SDOT: bool>(
    row: &[u8],
    cols: usize,
    codes: &[i8],
    scales: &[f32],
) -> f32 {
    let bits = super::bits_of(BITS);
    let full = cols / BLOCK;
    let block_bytes = BLOCK * BITS / 8;
    assert!(row.len() >= full * block_bytes && codes.len() >= full * BLOCK);
    assert!(scales.len() >= full);
    let (w, x, s) = (row.as_ptr(), codes.as_ptr(), scales.as_ptr());
    // SAFETY (every block below): `b < full`, inside the lengths asserted above; the caller
    // enables the features (see the function's contract).
    let step = |acc: float32x4_t, b: usize| unsafe {
        let sums = block_sums::<SDOT>(
            unpack_block::<BITS>(w.add(b * block_bytes)),
            x.add(b * BLOCK),
        );
        vfmaq_n_f32(acc, vcvtq_f32_s32(sums), *s.add(b))
    };
    let mut acc = [vdupq_n_f32(0.0); 4];
    // INT4 and INT2: whole scale groups first, their blocks' sums added in integers (exact:
    // at most 8 blocks × 8 products of 8 × 127 a lane), then one conversion and one FMA each,
    // two groups at a time into accumulators 0 and 1.
    let grouped = if BITS < 8 {
        const GROUP: usize = 8;
        const { assert!(BITS == 8 || super::scale_group(super::bits_of(BITS)) == GROUP) };
        let groups = full / GROUP;
        // SAFETY (all three): groups `g < groups` are whole blocks, inside the lengths asserted
        // above; the caller enables the features.
        for g in (0..groups / 2 * 2).step_by(2) {
            acc[0] = unsafe { group_sums::<BITS, SDOT>(acc[0], w, x, s, g * GROUP) };
            acc[1] = unsafe { group_sums::<BITS, SDOT>(acc[1], w, x, s, (g + 1) * GROUP) };
        }
        if groups % 2 == 1 {
            acc[0] = unsafe { group_sums::<BITS, SDOT>(acc[0], w, x, s, (groups - 1) * GROUP) };
        }
        groups * GROUP
    } else {
        0
    };
    let quads = grouped + (full - grouped) / 4 * 4;
    for b in (grouped..quads).step_by(4) {
        acc[0] = step(acc[0], b);
        acc[1] = step(acc[1], b + 1);
        acc[2] = step(acc[2], b + 2);
        acc[3] = step(acc[3], b + 3);
    }
    for b in quads..full {
        acc[0] = step(acc[0], b);
    }
    let mut sum = sum_accumulators(acc);
    if full * BLOCK < cols {
        sum += scales[full] * reference::block_sum(row, bits, cols, full, codes) as f32;
    }
    sum
}

/// `acc +` the scale group of INT4 or INT2 blocks `first .. first + 8` of a row at `w` against
/// the activation codes at `x` (scales at `s`): the blocks' sums added in integers, then one
/// conversion and one FMA. A function, not a closure: LLVM left a closure of this size out of
/// line (a call per group, the accumulators through the stack).
///
/// # Safety
/// Only inlined into functions that enable NEON, and `dotprod` where `SDOT`; the group lies
/// inside the row, the codes and the scales.
#[inline(always)]
unsafe fn group_sums<const BITS: usize, const SDOT: bool>(
    acc: float32x4_t,
    w: *const u8,
    x: *const i8,
    s: *const f32,
    first: usize,
) -> float32x4_t {
    let block_bytes = BLOCK * BITS / 8;
    // SAFETY: see the function's contract.
    unsafe {
        let mut sums = vdupq_n_s32(0);
        for b in first..first + 8 {
            let block = unpack_block::<BITS>(w.add(b * block_bytes));
            sums = add_block_sums::<SDOT>(sums, block, x.add(b * BLOCK));
        }
        vfmaq_n_f32(acc, vcvtq_f32_s32(sums), *s.add(first))
    }
}

/// The four accumulators of [`dot_quant_body`] summed: pairwise, then across lanes.
#[inline(always)]
fn sum_accumulators(acc: [float32x4_t; 4]) -> f32 {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ))
    }
}

/// `acc + Σ a[4i..4i+4] · b[4i..4i+4]` per lane (`sdot`).
#[target_feature(enable = "neon,dotprod")]
fn sdot(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` only reads and writes these registers; the CPU has `dotprod` (the caller's
    // target feature).
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack)
        )
    };
    acc
}

/// `dotprod`: [`dot_quant_bits_sdot`] for the row's width.
#[target_feature(enable = "neon,dotprod")]
fn dot_quant_sdot(row: &[u8], bits: QuantBits, cols: usize, codes: &[i8], scales: &[f32]) -> f32 {
    match bits {
        QuantBits::Int8 => dot_quant_bits_sdot::<8>(row, cols, codes, scales),
        QuantBits::Int4 => dot_quant_bits_sdot::<4>(row, cols, codes, scales),
        QuantBits::Int2 => dot_quant_bits_sdot::<2>(row, cols, codes, scales),
    }
}

/// `dotprod`: [`dot_quant_body`] on `sdot` ([`add_block_sums`]), one function per width (as
/// [`dot_quant_bits`]).
#[target_feature(enable = "neon,dotprod")]
#[inline(never)]
fn dot_quant_bits_sdot<const BITS: usize>(
    row: &[u8],
    cols: usize,
    codes: &[i8],
    scales: &[f32],
) -> f32 {
    // SAFETY: the caller's CPU has `dotprod` (this function's target feature).
    unsafe { dot_quant_body::<BITS, true>(row, cols, codes, scales) }
}

/// [`Kernels::dot_quant_rows`] of [`KERNELS_DOTPROD`]: [`dot_quant_rows_bits_sdot`] for the
/// rows' width.
#[target_feature(enable = "neon,dotprod")]
fn dot_quant_rows_sdot(
    rows: &[u8],
    bits: QuantBits,
    cols: usize,
    x: &QuantRow<'_>,
    row_scales: &[f32],
    out: &mut [f32],
) {
    match bits {
        QuantBits::Int8 => dot_quant_rows_bits_sdot::<8>(rows, cols, x, row_scales, out),
        QuantBits::Int4 => dot_quant_rows_bits_sdot::<4>(rows, cols, x, row_scales, out),
        QuantBits::Int2 => dot_quant_rows_bits_sdot::<2>(rows, cols, x, row_scales, out),
    }
}

/// `dotprod`: [`dot_quant_rows_bits`] on `sdot` ([`add_block_sums`]).
#[target_feature(enable = "neon,dotprod")]
#[inline(never)]
fn dot_quant_rows_bits_sdot<const BITS: usize>(
    rows: &[u8],
    cols: usize,
    x: &QuantRow<'_>,
    row_scales: &[f32],
    out: &mut [f32],
) {
    // SAFETY: the caller's CPU has `dotprod` (this function's target feature).
    unsafe { quant_rows::<BITS, true>(rows, cols, x, row_scales, out) }
}

/// Four f16 values widened to f32 (`fcvtl`, ARMv8.0; the intrinsic needs the unstable `f16`).
#[target_feature(enable = "neon")]
fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    // SAFETY: a register-to-register conversion.
    unsafe {
        asm!(
            "fcvtl {out:v}.4s, {h:v}.4h",
            out = lateout(vreg) out,
            h = in(vreg) h,
            options(pure, nomem, nostack)
        )
    };
    out
}

#[target_feature(enable = "neon")]
fn bf16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    vreinterpretq_f32_u32(vshll_n_u16::<16>(h))
}

/// 16-bit floats to f32, 16 values (32 bytes) per step, widened 4 at a time by `widen`; the
/// tail by `rest`.
#[target_feature(enable = "neon")]
fn widen_half(
    src: &[u8],
    out: &mut [f32],
    widen: impl Fn(uint16x4_t) -> float32x4_t,
    rest: fn(&[u8], &mut [f32]),
) {
    assert_eq!(
        src.len(),
        out.len() * 2,
        "16-bit floats for {} values",
        out.len()
    );
    let (steps, _) = src.as_chunks::<32>();
    let (head, tail) = out.split_at_mut(steps.len() * 16);
    for (step, o) in steps.iter().zip(head.as_chunks_mut::<16>().0) {
        for j in 0..4 {
            // SAFETY: 8 bytes read at `8 j` of a 32-byte array, 4 floats written at `4 j` of a
            // 16-float array; no alignment requirement.
            unsafe {
                let h = vld1_u16(step[j * 8..j * 8 + 8].as_ptr().cast());
                vst1q_f32(o.as_mut_ptr().add(j * 4), widen(h));
            }
        }
    }
    rest(&src[head.len() * 2..], tail);
}

#[target_feature(enable = "neon")]
fn dot_half(row: &[u8], x: &[f32], widen: impl Fn(uint16x4_t) -> float32x4_t) -> f32 {
    let steps = x.len() / 16;
    let mut acc = [vdupq_n_f32(0.0); 4];
    for s in 0..steps {
        let w = &row[s * 32..s * 32 + 32];
        let xs = &x[s * 16..s * 16 + 16];
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: 8 bytes and 4 floats readable (slices of 32 bytes and 16 floats).
            let (h, v) = unsafe {
                (
                    vld1_u16(w[j * 8..j * 8 + 8].as_ptr().cast()),
                    vld1q_f32(xs[j * 4..j * 4 + 4].as_ptr()),
                )
            };
            *a = vfmaq_f32(*a, widen(h), v);
        }
    }
    vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    ))
}

#[target_feature(enable = "neon")]
fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let head = x.len() / 16 * 16;
    dot_half(row, x, |h| f16x4_to_f32(h)) + reference::dot_f16(&row[head * 2..], &x[head..])
}

#[target_feature(enable = "neon")]
fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let head = x.len() / 16 * 16;
    dot_half(row, x, |h| bf16x4_to_f32(h)) + reference::dot_bf16(&row[head * 2..], &x[head..])
}

/// f32 rows: 16 values per step in four accumulators, the rest scalar.
#[target_feature(enable = "neon")]
fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let steps = x.len() / 16;
    assert!(row.len() >= steps * 64);
    let mut acc = [vdupq_n_f32(0.0); 4];
    for s in 0..steps {
        for (j, a) in acc.iter_mut().enumerate() {
            let at = s * 16 + j * 4;
            // SAFETY: 16 bytes of `row` and 4 floats of `x` from `at` (inside the lengths);
            // vld1q_u8 has no alignment requirement.
            let (w, v) = unsafe {
                (
                    vreinterpretq_f32_u8(vld1q_u8(row.as_ptr().add(at * 4))),
                    vld1q_f32(x.as_ptr().add(at)),
                )
            };
            *a = vfmaq_f32(*a, w, v);
        }
    }
    let head = steps * 16;
    vaddvq_f32(vaddq_f32(
        vaddq_f32(acc[0], acc[1]),
        vaddq_f32(acc[2], acc[3]),
    )) + reference::dot_f32(&row[head * 4..], &x[head..])
}

// ---- one stored row with several activation rows (beams) ----

/// [`Kernels::dot_int8_rows`] of [`KERNELS`]: [`dot_quant`] of one INT8 row with each of `xs`.
#[target_feature(enable = "neon")]
fn dot_int8_rows(row: &[u8], cols: usize, xs: &[QuantRow<'_>], out: &mut [f32]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe { int8_rows_in_groups::<false>(row, cols, xs, out) }
}

/// [`Kernels::dot_int8_rows`] of [`KERNELS_DOTPROD`]: [`dot_quant_sdot`] of one INT8 row with
/// each of `xs`.
#[target_feature(enable = "neon,dotprod")]
fn dot_int8_rows_sdot(row: &[u8], cols: usize, xs: &[QuantRow<'_>], out: &mut [f32]) {
    // SAFETY: the caller's CPU has `dotprod` (this function's target feature).
    unsafe { int8_rows_in_groups::<true>(row, cols, xs, out) }
}

/// `out[i]` = the INT8 dot of `row` with `xs[i]`, up to four activation rows per pass.
///
/// # Safety
/// Only inlined into functions that enable NEON, and `dotprod` where `SDOT`.
#[inline(always)]
unsafe fn int8_rows_in_groups<const SDOT: bool>(
    row: &[u8],
    cols: usize,
    xs: &[QuantRow<'_>],
    out: &mut [f32],
) {
    assert_eq!(xs.len(), out.len());
    let mut first = 0;
    while first < xs.len() {
        let (x, out) = (&xs[first..], &mut out[first..]);
        let size = rows_per_pass(x.len(), 4);
        // SAFETY (each): see the function's contract.
        unsafe {
            match size {
                4 => out[..4].copy_from_slice(&int8_rows_body::<SDOT, 4>(
                    row,
                    cols,
                    [&x[0], &x[1], &x[2], &x[3]],
                )),
                2 => {
                    out[..2].copy_from_slice(&int8_rows_body::<SDOT, 2>(row, cols, [&x[0], &x[1]]))
                }
                _ => out[..1].copy_from_slice(&int8_rows_body::<SDOT, 1>(row, cols, [&x[0]])),
            }
        }
        first += size;
    }
}

/// [`dot_quant`] (or, where `SDOT`, [`dot_quant_sdot`]) of one INT8 row with `N` activation rows:
/// each weight block is loaded once, then each activation row takes [`dot_quant_body`]'s very
/// steps (the same block sums into the same one of its four accumulators), so each result is
/// the same bits as its own.
///
/// # Safety
/// Only inlined into functions that enable NEON, and `dotprod` where `SDOT`.
#[inline(always)]
unsafe fn int8_rows_body<const SDOT: bool, const N: usize>(
    row: &[u8],
    cols: usize,
    xs: [&QuantRow<'_>; N],
) -> [f32; N] {
    let full = cols / BLOCK;
    assert!(row.len() >= full * BLOCK);
    for x in xs {
        assert!(x.codes.len() >= full * BLOCK && x.scales.len() >= full);
    }
    let w = row.as_ptr();
    // SAFETY (every block below): `b < full`, inside the lengths asserted above; the caller
    // enables the features (see the function's contract).
    let step = |acc: &mut [[float32x4_t; 4]; N], a: usize, b: usize| unsafe {
        let block = unpack_block::<8>(w.add(b * BLOCK));
        for (acc, x) in acc.iter_mut().zip(xs) {
            let sums = block_sums::<SDOT>(block, x.codes.as_ptr().add(b * BLOCK));
            acc[a] = vfmaq_n_f32(acc[a], vcvtq_f32_s32(sums), *x.scales.as_ptr().add(b));
        }
    };
    // SAFETY: NEON is part of the aarch64 baseline.
    let mut acc = [[unsafe { vdupq_n_f32(0.0) }; 4]; N];
    let quads = full / 4 * 4;
    for b in (0..quads).step_by(4) {
        for a in 0..4 {
            step(&mut acc, a, b + a);
        }
    }
    for b in quads..full {
        step(&mut acc, 0, b);
    }
    std::array::from_fn(|i| {
        let mut sum = sum_accumulators(acc[i]);
        if full * BLOCK < cols {
            let tail = reference::block_sum(row, QuantBits::Int8, cols, full, xs[i].codes);
            sum += xs[i].scales[full] * tail as f32;
        }
        sum
    })
}

/// [`Kernels::dot_f16_rows`] (and, where `BF16`, [`Kernels::dot_bf16_rows`]): `out[i]` =
/// [`dot_f16`] (or [`dot_bf16`]) of `row` with activation row `i` of `x` (`cols` values each),
/// up to four activation rows per pass (sixteen accumulators).
#[target_feature(enable = "neon")]
fn half_rows<const BF16: bool>(row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    assert_eq!(x.len(), cols * out.len());
    let head = cols / 16 * 16;
    let mut first = 0;
    while first < out.len() {
        let size = rows_per_pass(out.len() - first, 4);
        let xs: [&[f32]; 4] =
            std::array::from_fn(|i| &x[(first + i.min(size - 1)) * cols..][..head]);
        let dots = &mut out[first..first + size];
        match size {
            4 => dots.copy_from_slice(&half_rows_body::<4, BF16>(row, xs)),
            2 => dots.copy_from_slice(&half_rows_body::<2, BF16>(row, [xs[0], xs[1]])),
            _ => dots.copy_from_slice(&half_rows_body::<1, BF16>(row, [xs[0]])),
        }
        reference::add_half_tails(row, x, cols, head, first, BF16, dots);
        first += size;
    }
}

/// [`dot_half`] of one f16 (or, where `BF16`, bf16) row with `N` activation rows: each four
/// weights widened once, then each activation row takes [`dot_half`]'s steps (the same four
/// accumulators, the same sums), so each result is the same bits as its own [`dot_half`].
#[target_feature(enable = "neon")]
fn half_rows_body<const N: usize, const BF16: bool>(row: &[u8], xs: [&[f32]; N]) -> [f32; N] {
    let steps = xs[0].len() / 16;
    assert!(row.len() >= steps * 32 && xs.iter().all(|x| x.len() >= steps * 16));
    let mut acc = [[vdupq_n_f32(0.0); 4]; N];
    for s in 0..steps {
        for j in 0..4 {
            // SAFETY: 8 bytes of `row` and 4 floats of each `x` from `s × 16 + j × 4` (inside
            // the lengths asserted above).
            let h = unsafe { vld1_u16(row.as_ptr().add(s * 32 + j * 8).cast()) };
            let wv = if BF16 {
                bf16x4_to_f32(h)
            } else {
                f16x4_to_f32(h)
            };
            for (acc, x) in acc.iter_mut().zip(xs) {
                let v = unsafe { vld1q_f32(x.as_ptr().add(s * 16 + j * 4)) };
                acc[j] = vfmaq_f32(acc[j], wv, v);
            }
        }
    }
    acc.map(|acc| {
        vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ))
    })
}

// ---- the integer GEMM (`dotprod`) ----

/// Weight rows per micro-kernel call: with 16 activation rows (four registers of i32 lanes),
/// each weight row holds 4 integer and 4 float accumulators.
const GEMM_MAX_ROWS: usize = 3;

/// The integer GEMM of [`super::gemm`] on `sdot` by element: signed activation codes (no bias),
/// so one 16-byte load of a weight row serves four steps of four values.
pub(crate) static INT_GEMM_DOTPROD: IntGemm = IntGemm {
    name: "neon-dotprod",
    layout: |_| ActLayout::Signed,
    quantize_activations: super::scalar::quantize_activations,
    prepare_rows,
    // SAFETY: this kernel is only chosen when `dotprod_supported()` said yes.
    run: |w, x, out| unsafe { gemm_quant_sdot(w, x, out) },
};

/// Whether this CPU runs [`INT_GEMM_I8MM`] (`smmla`, ARMv8.6+: Cortex-A710/X2 and later,
/// Neoverse V1/N2).
pub(crate) fn i8mm_supported() -> bool {
    std::arch::is_aarch64_feature_detected!("i8mm")
}

/// The integer GEMM of [`super::gemm`] on `smmla`: each instruction multiplies eight values of
/// two weight rows by eight values of two activation rows (32 products, twice `sdot`'s), on
/// activations in [`ActLayout::SignedPairs`].
pub(crate) static INT_GEMM_I8MM: IntGemm = IntGemm {
    name: "neon-i8mm",
    layout: |_| ActLayout::SignedPairs,
    quantize_activations: super::scalar::quantize_activations,
    prepare_rows,
    // SAFETY: this kernel is only chosen when `i8mm_supported()` said yes.
    run: |w, x, out| unsafe { gemm_quant_mmla(w, x, out) },
};

/// [`gemm::prepare_rows`] without the bias (the activations are signed), whole blocks unpacked
/// by [`unpack_block`].
fn prepare_rows<'a>(
    packed: &'a [u8],
    bits: QuantBits,
    cols: usize,
    rows: usize,
    codes: &'a mut Vec<u8>,
    bias: &mut Vec<i32>,
) -> &'a [u8] {
    bias.clear();
    gemm::prepare_rows_by(packed, bits, cols, rows, codes, None, |src, dst| {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe { unpack_row(src, bits, cols, dst) }
    })
}

/// One packed row of `cols` values into `dst` (`blocks × BLOCK` bytes), as
/// [`gemm::unpack_values`] does.
#[target_feature(enable = "neon")]
fn unpack_row(src: &[u8], bits: QuantBits, cols: usize, dst: &mut [u8]) {
    // SAFETY: NEON is part of the aarch64 baseline.
    unsafe {
        match bits {
            QuantBits::Int8 => unpack_row_bits::<8>(src, cols, dst),
            QuantBits::Int4 => unpack_row_bits::<4>(src, cols, dst),
            QuantBits::Int2 => unpack_row_bits::<2>(src, cols, dst),
        }
    }
}

/// [`unpack_row`] for one width.
///
/// # Safety
/// Only inlined into functions that enable NEON.
#[inline(always)]
unsafe fn unpack_row_bits<const BITS: usize>(src: &[u8], cols: usize, dst: &mut [u8]) {
    let bits = super::bits_of(BITS);
    let (full, block_bytes) = (cols / BLOCK, BLOCK * BITS / 8);
    for (w, out) in src
        .chunks_exact(block_bytes)
        .zip(dst.as_chunks_mut::<BLOCK>().0)
        .take(full)
    {
        // SAFETY: a whole block of packed bytes is readable at `w`, and 32 bytes (a block of
        // `dst`) writable at `out`.
        unsafe {
            let (w0, w1) = unpack_block::<BITS>(w.as_ptr());
            vst1q_s8(out.as_mut_ptr().cast(), w0);
            vst1q_s8(out.as_mut_ptr().add(16).cast(), w1);
        }
    }
    if full * BLOCK < cols {
        let tail = &src[full * block_bytes..];
        gemm::unpack_values(tail, bits, cols - full * BLOCK, &mut dst[full * BLOCK..]);
    }
}

/// `acc + Σ a[4i..4i+4] · b[4L..4L+4]` per lane `i` (`sdot` by element: four bytes of `b`
/// against every lane of `a`).
#[target_feature(enable = "neon,dotprod")]
fn sdot_lane<const L: i32>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `sdot` only reads and writes these registers; the CPU has `dotprod` (the caller's
    // target feature).
    unsafe {
        asm!(
            "sdot {acc:v}.4s, {a:v}.16b, {b:v}.4b[{l}]",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            l = const L,
            options(pure, nomem, nostack)
        )
    };
    acc
}

/// One step of four values of a [`tile`]: `ints[j][v] += sdot(a[v], four codes L of row j)`.
// Index loops: `[j][v]` names a register of the tile.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "neon,dotprod")]
fn dot_step<const L: i32, const R: usize>(
    ints: &mut [[int32x4_t; 4]; R],
    a: [int8x16_t; 4],
    wv: &[int8x16_t; R],
) {
    for j in 0..R {
        for v in 0..4 {
            ints[j][v] = sdot_lane::<L>(ints[j][v], a[v], wv[j]);
        }
    }
}

#[target_feature(enable = "neon,dotprod")]
fn gemm_quant_sdot(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    gemm::check_operands(w, x, out, ActLayout::Signed);
    // SAFETY: the operands passed `check_operands`.
    unsafe { gemm::by_scale_group!(w.group, sdot_tiles(w, x, out)) }
}

/// [`gemm_quant_sdot`] for scale groups of `GROUP` blocks ([`gemm::by_scale_group`]).
///
/// # Safety
/// The operands passed [`gemm::check_operands`].
#[target_feature(enable = "neon,dotprod")]
unsafe fn sdot_tiles<const GROUP: usize>(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    let mut r = 0;
    while r < w.rows {
        let rows = (w.rows - r).min(GEMM_MAX_ROWS);
        for g in 0..x.groups {
            // SAFETY: rows r..r + rows and group g lie inside the operands and `out`, whose
            // lengths `check_operands` asserted.
            unsafe {
                match rows {
                    3 => tile::<3, GROUP>(w, x, r, g, out),
                    2 => tile::<2, GROUP>(w, x, r, g, out),
                    _ => tile::<1, GROUP>(w, x, r, g, out),
                }
            }
        }
        r += rows;
    }
}

/// Weight rows `r0..r0 + R` against the 16 activation rows of group `g`: per step of four
/// values, one 64-byte load of the group's codes (four lanes per register) and `sdot`s by
/// element against each weight row's four codes; per scale group ([`GemmRows::group`] blocks),
/// the integer sums turned into f32 with the group's activation scales, as the reference adds
/// them.
///
/// # Safety
/// Rows `r0..r0 + R` and group `g` lie inside the operands and `out` (lengths as
/// [`gemm_quant_sdot`] asserts).
// Index loops: `[j][v]` names a register of the tile.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "neon,dotprod")]
unsafe fn tile<const R: usize, const GROUP: usize>(
    w: &GemmRows<'_>,
    x: &GemmActs,
    r0: usize,
    g: usize,
    out: &mut [f32],
) {
    // SAFETY: see the function's contract; every offset below stays inside rows r0..r0 + R of
    // `w` and group g of `x`.
    unsafe {
        let blocks = w.blocks;
        let width = blocks * BLOCK;
        let stride = x.groups * LANES;
        let weights = w.codes.as_ptr().add(r0 * width).cast::<i8>();
        let acts = x.codes.as_ptr().add(g * width * LANES).cast::<i8>();
        let act_scales = x.scales.as_ptr().add(g * blocks * LANES);
        let per_scale = if GROUP == 0 { w.group } else { GROUP };
        let mut sums = [[vdupq_n_f32(0.0); 4]; R];
        for sg in 0..blocks.div_ceil(per_scale) {
            let (start, end) = (sg * per_scale, ((sg + 1) * per_scale).min(blocks));
            let mut ints = [[vdupq_n_s32(0); 4]; R];
            // Block by block, each block's two halves unrolled.
            for b in start..end {
                for half in 0..2 {
                    let k = b * BLOCK + half * 16;
                    let mut wv = [vdupq_n_s8(0); R];
                    for j in 0..R {
                        wv[j] = vld1q_s8(weights.add(j * width + k));
                    }
                    let step = |s: usize| {
                        let at = acts.add((k + 4 * s) * LANES);
                        [
                            vld1q_s8(at),
                            vld1q_s8(at.add(16)),
                            vld1q_s8(at.add(32)),
                            vld1q_s8(at.add(48)),
                        ]
                    };
                    dot_step::<0, R>(&mut ints, step(0), &wv);
                    dot_step::<1, R>(&mut ints, step(1), &wv);
                    dot_step::<2, R>(&mut ints, step(2), &wv);
                    dot_step::<3, R>(&mut ints, step(3), &wv);
                }
            }
            for v in 0..4 {
                let scale = vld1q_f32(act_scales.add(start * LANES + 4 * v));
                for j in 0..R {
                    sums[j][v] = vfmaq_f32(sums[j][v], vcvtq_f32_s32(ints[j][v]), scale);
                }
            }
        }
        let o = out.as_mut_ptr();
        for j in 0..R {
            let scale = vdupq_n_f32(*w.scales.as_ptr().add(r0 + j));
            for v in 0..4 {
                let at = (r0 + j) * stride + g * LANES + 4 * v;
                vst1q_f32(o.add(at), vmulq_f32(sums[j][v], scale));
            }
        }
    }
}

/// `acc + a · bᵀ`, with `a` and `b` each two rows of eight bytes and `acc` the 2 × 2 sums
/// `[a0·b0, a0·b1, a1·b0, a1·b1]` (`smmla`).
#[target_feature(enable = "neon,i8mm")]
fn smmla(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let mut acc = acc;
    // SAFETY: `smmla` only reads and writes these registers; the CPU has `i8mm` (the caller's
    // target feature).
    unsafe {
        asm!(
            "smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b",
            acc = inout(vreg) acc,
            a = in(vreg) a,
            b = in(vreg) b,
            options(pure, nomem, nostack)
        )
    };
    acc
}

/// Pairs of weight rows per `smmla` micro-kernel call.
const MMLA_MAX_PAIRS: usize = 2;
/// Pairs of activation rows per `smmla` micro-kernel call (half a group).
const MMLA_LANE_PAIRS: usize = LANES / 4;

#[target_feature(enable = "neon,i8mm")]
fn gemm_quant_mmla(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    gemm::check_operands(w, x, out, ActLayout::SignedPairs);
    // SAFETY: the operands passed `check_operands`.
    unsafe { gemm::by_scale_group!(w.group, mmla_tiles(w, x, out)) }
}

/// [`gemm_quant_mmla`] for scale groups of `GROUP` blocks ([`gemm::by_scale_group`]).
///
/// # Safety
/// The operands passed [`gemm::check_operands`].
#[target_feature(enable = "neon,i8mm")]
unsafe fn mmla_tiles<const GROUP: usize>(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    let mut r = 0;
    while r < w.rows {
        let rows = (w.rows - r).min(2 * MMLA_MAX_PAIRS);
        for g in 0..x.groups {
            for half in 0..2 {
                // SAFETY: rows r..r + rows and group g lie inside the operands and `out`, whose
                // lengths `check_operands` asserted.
                unsafe {
                    if rows > 2 {
                        mmla_tile::<2, GROUP>(w, x, r, rows, g, half, out)
                    } else {
                        mmla_tile::<1, GROUP>(w, x, r, rows, g, half, out)
                    }
                }
            }
        }
        r += rows;
    }
}

/// Weight rows `r0..r0 + rows` (in `P` pairs; an odd last row is paired with itself and its
/// copy's sums dropped) against half `half` of group `g`'s activation rows: per step of eight
/// values, one `smmla` per pair of weight rows and pair of activation rows; per scale group,
/// the integer sums turned into f32 with the group's activation scales, as the reference adds
/// them.
///
/// # Safety
/// Rows `r0..r0 + rows` (`rows ≤ 2P`) and group `g` lie inside the operands and `out` (lengths as
/// [`gemm_quant_mmla`] asserts).
// Index loops: `[p][h]` names a register of the tile.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "neon,i8mm")]
unsafe fn mmla_tile<const P: usize, const GROUP: usize>(
    w: &GemmRows<'_>,
    x: &GemmActs,
    r0: usize,
    rows: usize,
    g: usize,
    half: usize,
    out: &mut [f32],
) {
    // SAFETY: see the function's contract; every offset below stays inside rows r0..r0 + rows of
    // `w` and group g of `x`.
    unsafe {
        let blocks = w.blocks;
        let width = blocks * BLOCK;
        let stride = x.groups * LANES;
        // Row `2p + i` of the tile, the last real row standing in for a missing one.
        let row = |p: usize, i: usize| {
            w.codes
                .as_ptr()
                .add((r0 + (2 * p + i).min(rows - 1)) * width)
        };
        let rows_of: [[*const u8; 2]; P] = std::array::from_fn(|p| [row(p, 0), row(p, 1)]);
        let first_pair = half * MMLA_LANE_PAIRS;
        let acts = x.codes.as_ptr().add(g * width * LANES).cast::<i8>();
        let act_scales = x.scales.as_ptr().add(g * blocks * LANES + 2 * first_pair);
        let per_scale = if GROUP == 0 { w.group } else { GROUP };
        let mut sums = [[vdupq_n_f32(0.0); MMLA_LANE_PAIRS]; P];
        for sg in 0..blocks.div_ceil(per_scale) {
            let (start, end) = (sg * per_scale, ((sg + 1) * per_scale).min(blocks));
            let mut ints = [[vdupq_n_s32(0); MMLA_LANE_PAIRS]; P];
            // Block by block, each block's four steps unrolled.
            for b in start..end {
                for step in 0..BLOCK / 8 {
                    let k = b * BLOCK + step * 8;
                    let at = acts.add((k / 8 * (LANES / 2) + first_pair) * 16);
                    let a: [int8x16_t; MMLA_LANE_PAIRS] =
                        std::array::from_fn(|h| vld1q_s8(at.add(16 * h)));
                    for p in 0..P {
                        let [r_a, r_b] = rows_of[p];
                        let wv =
                            vcombine_s8(vld1_s8(r_a.add(k).cast()), vld1_s8(r_b.add(k).cast()));
                        for h in 0..MMLA_LANE_PAIRS {
                            ints[p][h] = smmla(ints[p][h], wv, a[h]);
                        }
                    }
                }
            }
            for h in 0..MMLA_LANE_PAIRS {
                let two = vld1_f32(act_scales.add(start * LANES + 2 * h));
                let scale = vcombine_f32(two, two);
                for p in 0..P {
                    sums[p][h] = vfmaq_f32(sums[p][h], vcvtq_f32_s32(ints[p][h]), scale);
                }
            }
        }
        let o = out.as_mut_ptr();
        for p in 0..P {
            let (ra, rb) = (r0 + 2 * p, r0 + 2 * p + 1);
            if ra >= r0 + rows {
                break;
            }
            let wa = *w.scales.as_ptr().add(ra);
            let wb = *w.scales.as_ptr().add(rb.min(r0 + rows - 1));
            let scale = vcombine_f32(vdup_n_f32(wa), vdup_n_f32(wb));
            for h in 0..MMLA_LANE_PAIRS {
                let v = vmulq_f32(sums[p][h], scale);
                let col = g * LANES + 2 * (first_pair + h);
                vst1_f32(o.add(ra * stride + col), vget_low_f32(v));
                if rb < r0 + rows {
                    vst1_f32(o.add(rb * stride + col), vget_high_f32(v));
                }
            }
        }
    }
}

/// [`gemm::transpose_products`] in 4 × 4 blocks: four rows of products loaded, transposed in
/// registers (`trn1`/`trn2` on 32-bit, then on 64-bit elements) and stored as four rows of the
/// output, the blocks of one group of four activation rows after another. Returns the weight
/// rows and activation rows it took (whole blocks).
///
/// # Safety
/// As [`gemm::transpose_products`], whose assert holds.
#[target_feature(enable = "neon")]
pub(crate) unsafe fn transpose_blocks(
    products: &[f32],
    stride: usize,
    rows: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) -> (usize, usize) {
    let (whole_rows, whole_lanes) = (rows / 4 * 4, n / 4 * 4);
    // SAFETY (every access): rows below `rows` of `stride ≥ n` floats lie in `products`, and
    // `out` takes every `t × out_stride + r` for `t < n`, `r < rows` (the caller's promise).
    unsafe {
        for t in (0..whole_lanes).step_by(4) {
            for r in (0..whole_rows).step_by(4) {
                let v: [float32x4_t; 4] =
                    std::array::from_fn(|k| vld1q_f32(products.as_ptr().add((r + k) * stride + t)));
                // Lanes 0 and 2 (even), 1 and 3 (odd) of rows r, r + 1; then of r + 2, r + 3.
                let even01 = vreinterpretq_f64_f32(vtrn1q_f32(v[0], v[1]));
                let odd01 = vreinterpretq_f64_f32(vtrn2q_f32(v[0], v[1]));
                let even23 = vreinterpretq_f64_f32(vtrn1q_f32(v[2], v[3]));
                let odd23 = vreinterpretq_f64_f32(vtrn2q_f32(v[2], v[3]));
                let lanes = [
                    vtrn1q_f64(even01, even23),
                    vtrn1q_f64(odd01, odd23),
                    vtrn2q_f64(even01, even23),
                    vtrn2q_f64(odd01, odd23),
                ];
                for (j, lane) in lanes.into_iter().enumerate() {
                    vst1q_f32(
                        out.add((t + j) * out_stride + r),
                        vreinterpretq_f32_f64(lane),
                    );
                }
            }
        }
    }
    (whole_rows, whole_lanes)
}
