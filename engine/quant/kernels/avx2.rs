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

// ---- dot products (AVX2 + FMA + F16C) ----

use super::float_gemm::{self, FloatActs, FloatGemm, GROUP, HALF};
use super::gemm::{self, ActLayout, GemmActs, GemmRows, IntGemm, LANES};
use super::{scalar as reference, Kernels, QuantRow, BLOCK};

/// Whether this CPU runs [`KERNELS`].
pub(crate) fn supported() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

pub(crate) static KERNELS: Kernels = Kernels {
    name: "avx2",
    // SAFETY (the float kernels, widenings and rounding): this set is only chosen when
    // `supported()` said yes.
    dot_quant,
    dot_f16: |row, x| unsafe { dot_f16(row, x) },
    dot_bf16: |row, x| unsafe { dot_bf16(row, x) },
    dot_f32: |row, x| unsafe { dot_f32(row, x) },
    widen_f16: |src, out| unsafe { widen_f16(src, out) },
    widen_bf16: |src, out| unsafe { widen_bf16(src, out) },
    quantize_activations: |x, bits, codes, scales| unsafe {
        quantize_activations(x, bits, codes, scales)
    },
    paired: false,
    dot_quant4: None,
    dot_quant_rows: Some(|rows, bits, cols, x, row_scales, out| unsafe {
        dot_quant_rows(rows, bits, cols, x, row_scales, out)
    }),
    dot_int8_rows: Some(|row, cols, xs, out| unsafe { dot_int8_rows(row, cols, xs, out) }),
    dot_f16_rows: Some(|row, x, cols, out| unsafe { dot_f16_rows(row, x, cols, out) }),
    dot_bf16_rows: None,
};

/// Whether this CPU runs [`KERNELS_VNNI`] (AVX-VNNI on 256-bit registers: Alder Lake, Sapphire
/// Rapids, Zen 5 and later).
pub(crate) fn vnni_supported() -> bool {
    supported() && is_x86_feature_detected!("avxvnni")
}

/// [`KERNELS`] with the integer rows on `vpdpbusd`.
pub(crate) static KERNELS_VNNI: Kernels = Kernels {
    name: "avx2+vnni",
    // SAFETY (the float kernels, widenings and rounding): this set is only chosen when
    // `vnni_supported()` said yes.
    dot_quant: dot_quant_vnni,
    dot_f16: |row, x| unsafe { dot_f16(row, x) },
    dot_bf16: |row, x| unsafe { dot_bf16(row, x) },
    dot_f32: |row, x| unsafe { dot_f32(row, x) },
    widen_f16: |src, out| unsafe { widen_f16(src, out) },
    widen_bf16: |src, out| unsafe { widen_bf16(src, out) },
    quantize_activations: |x, bits, codes, scales| unsafe {
        quantize_activations(x, bits, codes, scales)
    },
    paired: false,
    dot_quant4: None,
    dot_quant_rows: Some(|rows, bits, cols, x, row_scales, out| unsafe {
        dot_quant_rows_vnni(rows, bits, cols, x, row_scales, out)
    }),
    dot_int8_rows: Some(|row, cols, xs, out| unsafe { dot_int8_rows_vnni(row, cols, xs, out) }),
    dot_f16_rows: Some(|row, x, cols, out| unsafe { dot_f16_rows(row, x, cols, out) }),
    dot_bf16_rows: None,
};

#[target_feature(enable = "avx2,fma")]
fn load128(bytes: &[u8]) -> __m128i {
    assert!(bytes.len() >= 16);
    // SAFETY: 16 readable bytes (checked), unaligned load.
    unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) }
}

#[target_feature(enable = "avx2,fma")]
fn load_f32x8(x: &[f32]) -> __m256 {
    assert!(x.len() >= 8);
    // SAFETY: 8 readable floats (checked), unaligned load.
    unsafe { _mm256_loadu_ps(x.as_ptr()) }
}

#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// How far ahead of the block being computed a row's bytes are prefetched (rows are contiguous,
/// so this reaches into the next rows; measured: +70% on an INT4 LM head streamed from memory).
/// INT4/INT2 rows are always prefetched. Rows of one byte or more per value (INT8, f16, bf16,
/// f32) dotted with one activation row only where [`prefetch_wide_rows`] says so. 16-bit rows
/// dotted with several at once ([`dot_f16_rows_body`]) always are, as they came from memory
/// 1.2× faster with it (BENCHMARKS.md §9.14).
pub(crate) const PREFETCH_AHEAD: usize = 2048;

/// Whether rows of two bytes or more per value (f16, bf16, f32; and the attention caches' rows,
/// see [`super::prefetch_bytes`]), dotted with one activation row, are prefetched
/// [`PREFETCH_AHEAD`] bytes ahead: on Intel cores, not on others. Measured both ways:
/// - on a Zen 4 core the hardware prefetchers kept up with one such row stream, and the
///   prefetches cost time: dropping them made the engine's INT8 decode 15–18% faster on one
///   thread and f16 ~10% (`benches/llama_cpp_ab.sh`, BENCHMARKS.md §9.13), and f32 rows had
///   been 1.4× slower with them (§9.12); on a Zen 3 core f16 decode was even with them and f32
///   decode 12–28% slower (§9.26);
/// - on a Sapphire Rapids core the same rows came from memory at ~67% of the STREAM read rate
///   without them and 80–95% with them (a row of 2048 f16 values is one 4 KiB page, and Intel's
///   streamer does not cross pages; BENCHMARKS.md §9.16).
///
/// `EDGEMOE_PREFETCH_ROWS=on|off` overrides this and [`prefetch_int8_rows`], for A/B runs.
pub(crate) fn prefetch_wide_rows() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| prefetch_override().unwrap_or_else(|| cpu_vendor() == b"GenuineIntel"))
}

/// Whether INT8 rows dotted with one activation row are prefetched: where
/// [`prefetch_wide_rows`] says so, and on AMD cores without AVX-512 (Zen 3 and earlier), whose
/// prefetchers lag behind a stream of INT8 rows (a Zen 3 core decoded the switch-base-8 shape
/// 15–20% faster with them, BENCHMARKS.md §9.26) though not behind f16 or f32 rows. Zen 4 (which
/// has AVX-512) was faster without them (§9.13).
pub(crate) fn prefetch_int8_rows() -> bool {
    static INT8: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INT8.get_or_init(|| {
        prefetch_override().unwrap_or_else(|| {
            prefetch_wide_rows()
                || (cpu_vendor() == b"AuthenticAMD" && !is_x86_feature_detected!("avx512f"))
        })
    })
}

/// `EDGEMOE_PREFETCH_ROWS`: `on` or `off`, else `None`.
fn prefetch_override() -> Option<bool> {
    match std::env::var("EDGEMOE_PREFETCH_ROWS").as_deref() {
        Ok("on") => Some(true),
        Ok("off") => Some(false),
        _ => None,
    }
}

/// The CPU's vendor string (`GenuineIntel`, `AuthenticAMD`, ...).
fn cpu_vendor() -> Vec<u8> {
    let id = __cpuid(0);
    [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat()
}

/// Whole blocks: INT8 codes as they are (the sign trick of [`block_products`]); INT4 and INT2
/// codes made unsigned (`code + z`, one XOR) for `maddubs` directly, `z × Σx` subtracted once
/// per row (`x.offset`). One specialised loop per width, so no branch runs per block.
fn dot_quant(row: &[u8], bits: QuantBits, cols: usize, x: &QuantRow<'_>) -> f32 {
    // SAFETY (all three): `KERNELS` is only chosen when `supported()` said yes.
    unsafe {
        match bits {
            QuantBits::Int8 => dot_quant_bits::<8>(row, cols, x),
            QuantBits::Int4 => dot_quant_bits::<4>(row, cols, x),
            QuantBits::Int2 => dot_quant_bits::<2>(row, cols, x),
        }
    }
}

/// [`dot_quant`] with AVX-VNNI's `vpdpbusd` (one instruction for `maddubs` + `madd`, no i16
/// intermediate): INT2 and INT4 rows are bound by those instructions, not by memory.
fn dot_quant_vnni(row: &[u8], bits: QuantBits, cols: usize, x: &QuantRow<'_>) -> f32 {
    // SAFETY (all three): `KERNELS_VNNI` is only chosen when `vnni_supported()` said yes.
    unsafe {
        match bits {
            QuantBits::Int8 => dot_quant_bits_vnni::<8>(row, cols, x),
            QuantBits::Int4 => dot_quant_bits_vnni::<4>(row, cols, x),
            QuantBits::Int2 => dot_quant_bits_vnni::<2>(row, cols, x),
        }
    }
}

/// [`Kernels::dot_quant_rows`] of [`KERNELS`]: [`dot_quant`] of each row times its scale, the
/// width matched once.
#[target_feature(enable = "avx2,fma")]
fn dot_quant_rows(
    rows: &[u8],
    bits: QuantBits,
    cols: usize,
    x: &QuantRow<'_>,
    row_scales: &[f32],
    out: &mut [f32],
) {
    // SAFETY (all three): the caller's CPU has every feature this function enables.
    unsafe {
        match bits {
            QuantBits::Int8 => quant_rows::<8, MADD>(rows, cols, x, row_scales, out),
            QuantBits::Int4 => quant_rows::<4, MADD>(rows, cols, x, row_scales, out),
            QuantBits::Int2 => quant_rows::<2, MADD>(rows, cols, x, row_scales, out),
        }
    }
}

/// [`dot_quant_rows`] on `vpdpbusd` ([`dot_quant_vnni`] of each row).
#[target_feature(enable = "avx2,fma,avxvnni")]
fn dot_quant_rows_vnni(
    rows: &[u8],
    bits: QuantBits,
    cols: usize,
    x: &QuantRow<'_>,
    row_scales: &[f32],
    out: &mut [f32],
) {
    // SAFETY (all three): the caller's CPU has every feature this function enables.
    unsafe {
        match bits {
            QuantBits::Int8 => quant_rows::<8, AVX_VNNI>(rows, cols, x, row_scales, out),
            QuantBits::Int4 => quant_rows::<4, AVX_VNNI>(rows, cols, x, row_scales, out),
            QuantBits::Int2 => quant_rows::<2, AVX_VNNI>(rows, cols, x, row_scales, out),
        }
    }
}

/// `out[r] = row_scales[r] × ` [`dot_quant_body`] of row `r` of `rows`, for one width.
///
/// # Safety
/// Only inlined into functions that enable AVX2, FMA and the features `SUM` needs.
#[inline(always)]
unsafe fn quant_rows<const BITS: usize, const SUM: u8>(
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
        *y = scale * unsafe { dot_quant_body::<BITS, SUM>(row, cols, x) };
    }
}

/// INT8 rows of [`dot_quant_vnni`] with the 256-bit `vpdpbusd` of AVX-512 VNNI (EVEX-encoded,
/// with AVX-512 VL), for CPUs that have it without AVX-VNNI (Zen 4, Ice Lake).
///
/// # Safety
/// The CPU has AVX2, FMA, AVX-512 VNNI and AVX-512 VL.
#[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
pub(crate) unsafe fn dot_int8_evex_vnni(row: &[u8], cols: usize, x: &QuantRow<'_>) -> f32 {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { dot_quant_body::<8, EVEX_VNNI>(row, cols, x) }
}

/// [`Kernels::dot_int8_rows`] of [`KERNELS`] (two activation rows at a time: their eight
/// accumulators fit AVX2's sixteen registers with the block's operands).
#[target_feature(enable = "avx2,fma")]
fn dot_int8_rows(row: &[u8], cols: usize, xs: &[QuantRow<'_>], out: &mut [f32]) {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { int8_rows_in_groups::<MADD, 2>(row, cols, xs, out) }
}

/// [`Kernels::dot_int8_rows`] of [`KERNELS_VNNI`].
#[target_feature(enable = "avx2,fma,avxvnni")]
fn dot_int8_rows_vnni(row: &[u8], cols: usize, xs: &[QuantRow<'_>], out: &mut [f32]) {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { int8_rows_in_groups::<AVX_VNNI, 2>(row, cols, xs, out) }
}

/// [`Kernels::dot_int8_rows`] with AVX-512 VNNI's 256-bit `vpdpbusd`, four activation rows at a
/// time (sixteen accumulators: AVX-512 VL gives 32 registers).
///
/// # Safety
/// The CPU has AVX2, FMA, AVX-512 VNNI and AVX-512 VL.
#[target_feature(enable = "avx2,fma,avx512vnni,avx512vl")]
pub(crate) unsafe fn dot_int8_rows_evex_vnni(
    row: &[u8],
    cols: usize,
    xs: &[QuantRow<'_>],
    out: &mut [f32],
) {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { int8_rows_in_groups::<EVEX_VNNI, 4>(row, cols, xs, out) }
}

/// `out[i]` = the INT8 dot of `row` with `xs[i]`, `GROUP` activation rows per pass over the
/// row (then one at a time).
///
/// # Safety
/// Only inlined into functions that enable AVX2, FMA and the features `SUM` needs.
#[inline(always)]
unsafe fn int8_rows_in_groups<const SUM: u8, const GROUP: usize>(
    row: &[u8],
    cols: usize,
    xs: &[QuantRow<'_>],
    out: &mut [f32],
) {
    assert_eq!(xs.len(), out.len());
    let mut groups = xs.chunks_exact(GROUP);
    let mut outs = out.chunks_exact_mut(GROUP);
    // SAFETY (both calls): see the function's contract.
    for (xs, out) in groups.by_ref().zip(outs.by_ref()) {
        let xs: [&QuantRow<'_>; GROUP] = std::array::from_fn(|i| &xs[i]);
        out.copy_from_slice(&unsafe { int8_rows_body::<SUM, GROUP>(row, cols, xs) });
    }
    for (x, out) in groups.remainder().iter().zip(outs.into_remainder()) {
        [*out] = unsafe { int8_rows_body::<SUM, 1>(row, cols, [x]) };
    }
}

/// [`dot_quant_body`] of one INT8 row with `N` activation rows: each weight block is loaded and
/// its magnitude taken once, then each activation row takes the very steps [`dot_quant_body`]
/// takes (the same blocks into the same four accumulators, the same sums), so each result is
/// the same bits as that row's own [`dot_quant_body`].
///
/// # Safety
/// Only inlined into functions that enable AVX2, FMA and the features `SUM` needs.
#[inline(always)]
unsafe fn int8_rows_body<const SUM: u8, const N: usize>(
    row: &[u8],
    cols: usize,
    xs: [&QuantRow<'_>; N],
) -> [f32; N] {
    // SAFETY: the intrinsics need AVX2/FMA (and VNNI), which the callers enable (see above).
    unsafe {
        let full = cols / BLOCK;
        assert!(row.len() >= full * BLOCK);
        for x in xs {
            assert!(x.codes.len() >= full * BLOCK && x.scales.len() >= full);
        }
        let w = row.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        let quads = full / 4 * 4;
        // SAFETY (every block): `b < full`, inside the lengths asserted above.
        for b in (0..quads).step_by(4) {
            for lane in 0..4 {
                int8_block_rows::<SUM, N>(w, &xs, b + lane, &mut acc, lane);
            }
        }
        for b in quads..full {
            int8_block_rows::<SUM, N>(w, &xs, b, &mut acc, 0);
        }
        let mut out = [0f32; N];
        for ((out, acc), x) in out.iter_mut().zip(acc).zip(xs) {
            let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut sum = hsum(total) - x.offset;
            if full * BLOCK < cols {
                sum += x.scales[full]
                    * reference::block_sum(row, QuantBits::Int8, cols, full, x.codes) as f32;
            }
            *out = sum;
        }
        out
    }
}

/// Block `b` of an INT8 row into accumulator `lane` of each activation row's four, as
/// [`quant_block`] and [`dot_quant_body`] compute it. (A function, not a closure: closures do not
/// take on the target features of the function they are written in.)
///
/// # Safety
/// Only inlined into functions that enable AVX2, FMA and the features `SUM` needs; block `b`
/// lies inside `w` and inside every `xs[i].codes` and `xs[i].scales`.
#[inline(always)]
unsafe fn int8_block_rows<const SUM: u8, const N: usize>(
    w: *const u8,
    xs: &[&QuantRow<'_>; N],
    b: usize,
    acc: &mut [[__m256; 4]; N],
    lane: usize,
) {
    // SAFETY: see the function's contract.
    unsafe {
        let wv = _mm256_loadu_si256(w.add(b * 32).cast());
        let magnitude = _mm256_sign_epi8(wv, wv);
        for (acc, x) in acc.iter_mut().zip(xs) {
            let xv = _mm256_loadu_si256(x.codes.as_ptr().add(b * BLOCK).cast());
            let sums = unsigned_products::<SUM>(magnitude, _mm256_sign_epi8(xv, wv));
            let scale = _mm256_broadcast_ss(&*x.scales.as_ptr().add(b));
            acc[lane] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[lane]);
        }
    }
}

#[target_feature(enable = "avx2,fma")]
fn dot_quant_bits<const BITS: usize>(row: &[u8], cols: usize, x: &QuantRow<'_>) -> f32 {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { dot_quant_body::<BITS, MADD>(row, cols, x) }
}

#[target_feature(enable = "avx2,fma,avxvnni")]
fn dot_quant_bits_vnni<const BITS: usize>(row: &[u8], cols: usize, x: &QuantRow<'_>) -> f32 {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { dot_quant_body::<BITS, AVX_VNNI>(row, cols, x) }
}

/// How [`unsigned_products`] sums a block's byte products: `maddubs` + `madd` (AVX2), or one
/// `vpdpbusd` in its VEX (AVX-VNNI) or EVEX (AVX-512 VNNI + VL) encoding.
const MADD: u8 = 0;
const AVX_VNNI: u8 = 1;
const EVEX_VNNI: u8 = 2;

/// `unsigned · signed` byte products of a block summed in fours into 8 i32 lanes, as `SUM`
/// says ([`MADD`], [`AVX_VNNI`], [`EVEX_VNNI`]).
///
/// # Safety
/// Only inlined into functions that enable AVX2 and the features `SUM` needs.
#[inline(always)]
unsafe fn unsigned_products<const SUM: u8>(u: __m256i, x: __m256i) -> __m256i {
    // SAFETY: see the function's contract.
    unsafe {
        match SUM {
            AVX_VNNI => _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x),
            EVEX_VNNI => _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x),
            _ => _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)),
        }
    }
}

/// Block `b` of a packed row against block `b` of the activations: its 8 partial sums as f32,
/// and the activation scale broadcast.
///
/// # Safety
/// Only inlined into functions that enable AVX2 and the features `SUM` needs; block `b` lies
/// inside `w` (bytes `b × 32 × BITS / 8 ..`), `x.codes` and `x.scales`.
#[inline(always)]
unsafe fn quant_block<const BITS: usize, const SUM: u8>(
    w: *const u8,
    x: &QuantRow<'_>,
    b: usize,
) -> (__m256, __m256) {
    // SAFETY: see the function's contract.
    unsafe {
        let xv = _mm256_loadu_si256(x.codes.as_ptr().add(b * BLOCK).cast());
        let sums = if BITS == 8 {
            let wv = _mm256_loadu_si256(w.add(b * 32).cast());
            // |w| · (x signed by w): the same products with an unsigned left operand;
            // |w| ≤ 128 and |x| ≤ 127, so `maddubs`'s i16 pairs cannot saturate.
            let magnitude = _mm256_sign_epi8(wv, wv);
            unsigned_products::<SUM>(magnitude, _mm256_sign_epi8(xv, wv))
        } else {
            unsigned_products::<SUM>(unsigned_codes::<BITS>(w, b), xv)
        };
        let scale = _mm256_broadcast_ss(&*x.scales.as_ptr().add(b));
        (_mm256_cvtepi32_ps(sums), scale)
    }
}

/// The 32 codes of INT4 or INT2 block `b` plus their zero point (unsigned, for `maddubs` and
/// `vpdpbusd`), in the order of the activation codes ([`super::block_order`]).
///
/// # Safety
/// Only inlined into functions that enable AVX2; block `b` lies inside `w`.
#[inline(always)]
unsafe fn unsigned_codes<const BITS: usize>(w: *const u8, b: usize) -> __m256i {
    // SAFETY: see the function's contract.
    unsafe {
        if BITS == 4 {
            let v = _mm_loadu_si128(w.add(b * 16).cast());
            let both = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
            _mm256_xor_si256(
                _mm256_and_si256(both, _mm256_set1_epi8(0x0f)),
                _mm256_set1_epi8(0x08),
            )
        } else {
            // The block's 8 bytes in each 64-bit lane, lane k shifted to field k.
            let v = _mm256_set1_epi64x(w.add(b * 8).cast::<i64>().read_unaligned());
            let fields = _mm256_and_si256(
                _mm256_srlv_epi64(v, _mm256_set_epi64x(6, 4, 2, 0)),
                _mm256_set1_epi8(0x03),
            );
            _mm256_xor_si256(fields, _mm256_set1_epi8(0x02))
        }
    }
}

/// INT4 or INT2 blocks `first .. first + GROUP` (one activation scale group,
/// [`super::scale_group`]) against the activations: the group's 8 partial sums as f32, summed
/// in integers, and its scale broadcast. With `maddubs` the blocks' i16 pair sums are added
/// before one `madd`: a pair is at most 2 × 15 × 127 (INT4), so eight of them stay below 2^15;
/// with `vpdpbusd` the blocks accumulate in i32. Either way the sum is exact, so the result is
/// [`quant_block`]'s for each block in turn up to the float rounding of their sum.
///
/// # Safety
/// Only inlined into functions that enable AVX2 and the features `SUM` needs; the group lies
/// inside `w`, `x.codes` and `x.scales`.
#[inline(always)]
unsafe fn quant_group<const BITS: usize, const SUM: u8>(
    w: *const u8,
    x: &QuantRow<'_>,
    first: usize,
) -> (__m256, __m256) {
    // At most 8 blocks, so that `maddubs`'s i16 pair sums stay below 2^15 (see above).
    let group = const {
        let group = super::scale_group(super::bits_of(BITS));
        assert!(group <= 8);
        group
    };
    // SAFETY: see the function's contract.
    unsafe {
        let codes = |b: usize| _mm256_loadu_si256(x.codes.as_ptr().add(b * BLOCK).cast());
        let sums = match SUM {
            AVX_VNNI | EVEX_VNNI => {
                // Two chains, so that each `vpdpbusd` waits on the one before last.
                let (mut even, mut odd) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for b in (first..first + group).step_by(2) {
                    let (u0, u1) = (
                        unsigned_codes::<BITS>(w, b),
                        unsigned_codes::<BITS>(w, b + 1),
                    );
                    if SUM == AVX_VNNI {
                        even = _mm256_dpbusd_avx_epi32(even, u0, codes(b));
                        odd = _mm256_dpbusd_avx_epi32(odd, u1, codes(b + 1));
                    } else {
                        even = _mm256_dpbusd_epi32(even, u0, codes(b));
                        odd = _mm256_dpbusd_epi32(odd, u1, codes(b + 1));
                    }
                }
                _mm256_add_epi32(even, odd)
            }
            _ => {
                let mut pairs = _mm256_setzero_si256();
                for b in first..first + group {
                    let products = _mm256_maddubs_epi16(unsigned_codes::<BITS>(w, b), codes(b));
                    pairs = _mm256_add_epi16(pairs, products);
                }
                _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
            }
        };
        let scale = _mm256_broadcast_ss(&*x.scales.as_ptr().add(first));
        (_mm256_cvtepi32_ps(sums), scale)
    }
}

/// The loop of [`dot_quant`] for one width, its products summed as `SUM` says.
///
/// # Safety
/// Only inlined into functions that enable AVX2, FMA and the features `SUM` needs.
#[inline(always)]
unsafe fn dot_quant_body<const BITS: usize, const SUM: u8>(
    row: &[u8],
    cols: usize,
    x: &QuantRow<'_>,
) -> f32 {
    // SAFETY: the intrinsics need AVX2/FMA (and VNNI), which the callers enable (see above).
    unsafe {
        let bits = super::bits_of(BITS);
        let full = cols / BLOCK;
        let block_bytes = BLOCK * BITS / 8;
        assert!(row.len() >= full * block_bytes && x.codes.len() >= full * BLOCK);
        assert!(x.scales.len() >= full);
        let w = row.as_ptr();
        // SAFETY (every block below): `b < full`, inside the lengths asserted above.
        // Four independent accumulators (named, so they stay in registers): the FMA chains of
        // consecutive blocks do not wait on each other.
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
            _mm256_setzero_ps(),
        );
        let prefetch = BITS < 8 || prefetch_int8_rows();
        // INT4 and INT2: whole scale groups first, one conversion and one FMA each.
        let grouped = if BITS < 8 {
            const GROUP: usize = 8;
            const { assert!(BITS == 8 || super::scale_group(super::bits_of(BITS)) == GROUP) };
            let grouped = full / GROUP * GROUP;
            for first in (0..grouped).step_by(2 * GROUP) {
                let ahead = (first + 2 * GROUP) * block_bytes + PREFETCH_AHEAD;
                for line in (0..2 * GROUP * block_bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(ahead + line).cast());
                }
                let (p, s) = quant_group::<BITS, SUM>(w, x, first);
                a0 = _mm256_fmadd_ps(p, s, a0);
                if first + GROUP < grouped {
                    let (p, s) = quant_group::<BITS, SUM>(w, x, first + GROUP);
                    a1 = _mm256_fmadd_ps(p, s, a1);
                }
            }
            grouped
        } else {
            0
        };
        let quads = grouped + (full - grouped) / 4 * 4;
        for b in (grouped..quads).step_by(4) {
            // The next rows of a large matrix are far from the caches: ask for them early
            // (INT8 rows only where that pays, see `prefetch_int8_rows`), every cache line of
            // the step ahead: four INT8 blocks are two lines, INT4 and INT2 ones part of one.
            // (One prefetch per step left every other INT8 line to come on demand, and INT8
            // rows read 15–20% slower than f16 rows from memory on a Cascade Lake core:
            // BENCHMARKS.md §9.23.)
            if prefetch {
                let ahead = (b + 4) * block_bytes + PREFETCH_AHEAD;
                for line in (0..4 * block_bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(ahead + line).cast());
                }
            }
            let (p, s) = quant_block::<BITS, SUM>(w, x, b);
            a0 = _mm256_fmadd_ps(p, s, a0);
            let (p, s) = quant_block::<BITS, SUM>(w, x, b + 1);
            a1 = _mm256_fmadd_ps(p, s, a1);
            let (p, s) = quant_block::<BITS, SUM>(w, x, b + 2);
            a2 = _mm256_fmadd_ps(p, s, a2);
            let (p, s) = quant_block::<BITS, SUM>(w, x, b + 3);
            a3 = _mm256_fmadd_ps(p, s, a3);
        }
        for b in quads..full {
            let (p, s) = quant_block::<BITS, SUM>(w, x, b);
            a0 = _mm256_fmadd_ps(p, s, a0);
        }
        let total = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        let mut sum = hsum(total) - x.offset;
        if full * BLOCK < cols {
            sum += x.scales[full] * reference::block_sum(row, bits, cols, full, x.codes) as f32;
        }
        sum
    }
}

/// 16-bit float rows: 32 values per step in four accumulators, the rest scalar. Prefetched
/// where [`prefetch_wide_rows`] says so.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_half(row: &[u8], x: &[f32], widen: impl Fn(__m128i) -> __m256) -> f32 {
    let steps = x.len() / 32;
    let prefetch = prefetch_wide_rows();
    let mut acc = [_mm256_setzero_ps(); 4];
    for s in 0..steps {
        if prefetch {
            let ahead = row.as_ptr().wrapping_add(s * 64 + 64 + PREFETCH_AHEAD);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
        }
        let w = &row[s * 64..s * 64 + 64];
        let xs = &x[s * 32..s * 32 + 32];
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(widen(load128(&w[j * 16..])), load_f32x8(&xs[j * 8..]), *a);
        }
    }
    let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(total)
}

/// [`dot_half`] of one f16 (or, where `BF16`, bf16) row with `N` activation rows: each 8
/// weights widened once, then each activation row takes [`dot_half`]'s steps (the same four
/// accumulators, the same sums), so each result is the same bits as its own [`dot_half`].
///
/// # Safety
/// Only inlined into functions that enable AVX2, FMA and F16C (and AVX-512 VL for `N` = 4:
/// sixteen accumulators need its 32 registers).
#[inline(always)]
unsafe fn dot_f16_rows_body<const N: usize, const BF16: bool>(
    row: &[u8],
    xs: [&[f32]; N],
) -> [f32; N] {
    // SAFETY: the intrinsics need AVX2, FMA and F16C, which the callers enable (see above).
    unsafe {
        let steps = xs[0].len() / 32;
        let mut acc = [[_mm256_setzero_ps(); 4]; N];
        for s in 0..steps {
            // Unlike one row's (see `PREFETCH_AHEAD`), these loops do several rows' arithmetic
            // per weight: without asking for the bytes ahead, the weights came slower than row
            // by row.
            let ahead = row.as_ptr().wrapping_add(s * 64 + 64 + PREFETCH_AHEAD);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            let w = &row[s * 64..s * 64 + 64];
            for j in 0..4 {
                let wv = if BF16 {
                    widen_bf16x8(load128(&w[j * 16..]))
                } else {
                    _mm256_cvtph_ps(load128(&w[j * 16..]))
                };
                for (acc, x) in acc.iter_mut().zip(xs) {
                    acc[j] = _mm256_fmadd_ps(wv, load_f32x8(&x[s * 32 + j * 8..]), acc[j]);
                }
            }
        }
        let mut out = [0f32; N];
        for (out, acc) in out.iter_mut().zip(acc) {
            let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            *out = hsum(total);
        }
        out
    }
}

/// [`Kernels::dot_f16_rows`]: `out[i]` = [`dot_f16`] of `row` with activation row `i` of `x`
/// (`cols` values each), two activation rows per pass (eight accumulators and four widened
/// weights fit AVX2's sixteen registers), then one.
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16_rows(row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    // SAFETY: this function enables what the groups need for two rows.
    unsafe { f16_rows_in_groups::<2, false>(row, x, cols, out) }
}

/// [`Kernels::dot_f16_rows`] with AVX-512 VL's 32 registers: four activation rows per pass,
/// then two, then one.
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX-512 F and AVX-512 VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(crate) unsafe fn dot_f16_rows_evex(row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { f16_rows_in_groups::<4, false>(row, x, cols, out) }
}

/// [`Kernels::dot_bf16_rows`] with AVX-512 VL's 32 registers: [`dot_f16_rows_evex`] on bf16
/// rows, `out[i]` the same bits as [`dot_bf16`] of `row` with activation row `i`. (Not on AVX2
/// alone: two rows per pass measured slower than row by row, BENCHMARKS.md §9.14.)
///
/// # Safety
/// The CPU has AVX2, FMA, F16C, AVX-512 F and AVX-512 VL.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(crate) unsafe fn dot_bf16_rows_evex(row: &[u8], x: &[f32], cols: usize, out: &mut [f32]) {
    // SAFETY: the caller's CPU has every feature this function enables.
    unsafe { f16_rows_in_groups::<4, true>(row, x, cols, out) }
}

/// `out[i]` = [`dot_f16`] (or, where `BF16`, [`dot_bf16`]) of `row` with activation row `i` of
/// `x`: `GROUP` rows per pass, then two, then one (a loop, not a helper taking a closure:
/// closures do not take on the target features of the function they are written in).
///
/// # Safety
/// Only inlined into functions that enable what [`dot_f16_rows_body`] needs for `GROUP` rows.
#[inline(always)]
unsafe fn f16_rows_in_groups<const GROUP: usize, const BF16: bool>(
    row: &[u8],
    x: &[f32],
    cols: usize,
    out: &mut [f32],
) {
    assert_eq!(x.len(), cols * out.len());
    let head = cols / 32 * 32;
    let xs = |i: usize| &x[i * cols..][..head];
    let mut first = 0;
    while first < out.len() {
        let size = super::rows_per_pass(out.len() - first, GROUP);
        let dots = &mut out[first..first + size];
        // SAFETY (each): see the function's contract.
        unsafe {
            if size == 4 {
                let r = |i| xs(first + i);
                dots.copy_from_slice(&dot_f16_rows_body::<4, BF16>(row, [r(0), r(1), r(2), r(3)]));
            } else if size == 2 {
                dots.copy_from_slice(&dot_f16_rows_body::<2, BF16>(
                    row,
                    [xs(first), xs(first + 1)],
                ));
            } else {
                dots.copy_from_slice(&dot_f16_rows_body::<1, BF16>(row, [xs(first)]));
            }
        }
        reference::add_half_tails(row, x, cols, head, first, BF16, dots);
        first += size;
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    let head = x.len() / 32 * 32;
    dot_half(row, x, |h| _mm256_cvtph_ps(h)) + reference::dot_f16(&row[head * 2..], &x[head..])
}

#[target_feature(enable = "avx2,fma,f16c")]
fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    let head = x.len() / 32 * 32;
    dot_half(row, x, |h| widen_bf16x8(h)) + reference::dot_bf16(&row[head * 2..], &x[head..])
}

/// f16 values widened to f32 (`vcvtph2ps`, exact), 32 per step; the rest as the reference.
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_f16(src: &[u8], out: &mut [f32]) {
    widen_half(src, out, |h| _mm256_cvtph_ps(h), reference::widen_f16)
}

#[target_feature(enable = "avx2,fma,f16c")]
fn widen_bf16(src: &[u8], out: &mut [f32]) {
    widen_half(src, out, |h| widen_bf16x8(h), reference::widen_bf16)
}

/// 16-bit floats to f32, 32 values (64 bytes) per step, widened 8 at a time by `widen`; the
/// tail by `rest`.
#[target_feature(enable = "avx2,fma,f16c")]
fn widen_half(
    src: &[u8],
    out: &mut [f32],
    widen: impl Fn(__m128i) -> __m256,
    rest: fn(&[u8], &mut [f32]),
) {
    assert_eq!(
        src.len(),
        out.len() * 2,
        "16-bit floats for {} values",
        out.len()
    );
    let (steps, _) = src.as_chunks::<64>();
    let (head, tail) = out.split_at_mut(steps.len() * 32);
    for (step, o) in steps.iter().zip(head.as_chunks_mut::<32>().0) {
        for j in 0..4 {
            let v = widen(load128(&step[j * 16..]));
            // SAFETY: writes 8 floats at `8 j` of a 32-float array (unaligned store).
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(j * 8), v) };
        }
    }
    rest(&src[head.len() * 2..], tail);
}

/// Eight bf16 values widened to f32 (exact: a bf16 is an f32's upper half).
#[target_feature(enable = "avx2")]
fn widen_bf16x8(h: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
}

/// f32 rows: 32 values per step in four accumulators, the rest scalar. Prefetched where
/// [`prefetch_wide_rows`] says so: a step reads two cache lines, so two prefetches.
#[target_feature(enable = "avx2,fma")]
fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    let steps = x.len() / 32;
    assert!(row.len() >= steps * 128);
    let w = row.as_ptr();
    let prefetch = prefetch_wide_rows();
    let mut acc = [_mm256_setzero_ps(); 4];
    for s in 0..steps {
        if prefetch {
            let ahead = w.wrapping_add(s * 128 + 128 + PREFETCH_AHEAD);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
        }
        let xs = &x[s * 32..s * 32 + 32];
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: 32 bytes from `(s × 32 + j × 8) × 4`, inside the length asserted above.
            let wv = unsafe { _mm256_loadu_ps(w.add((s * 32 + j * 8) * 4).cast()) };
            *a = _mm256_fmadd_ps(wv, load_f32x8(&xs[j * 8..]), *a);
        }
    }
    let head = steps * 32;
    let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(total) + reference::dot_f32(&row[head * 4..], &x[head..])
}

/// The float GEMM of [`super::float_gemm`] on 256-bit FMAs, for CPUs without AVX-512 (Zen 2
/// and 3, Intel cores before Ice Lake). Its sixteen registers hold six weight rows × sixteen
/// activation rows of sums (two vectors each) with the column's two activation vectors and a
/// broadcast, so a panel of [`PANEL`](super::float_gemm::PANEL) rows × [`GROUP`] lanes is
/// taken as two halves of sixteen lanes, and one of up to twelve rows on a half group as two
/// runs of six rows: each sum is still one chain of FMAs in column order, the reference's bits.
pub(crate) static FLOAT_GEMM: FloatGemm = FloatGemm {
    name: "avx2",
    prepare_acts: float_gemm_acts,
    panel: |w, rows, stride, cols, acts, lanes, out, prefetch| {
        float_gemm::check_operands(w, rows, stride, cols, acts, lanes, out);
        if cols == 0 {
            return; // No column: every sum stays what it is (and `acts` may be empty).
        }
        let halves = if lanes <= HALF { 1 } else { 2 };
        for half in 0..halves {
            for first in (0..rows).step_by(6) {
                let take = 6.min(rows - first);
                let (w, out) = (
                    &w[first * stride..],
                    &mut out[first * GROUP + half * HALF..],
                );
                let acts = &acts[half * HALF..];
                // SAFETY (every arm): this kernel is only chosen when `supported()` said yes;
                // rows `first..first + take` of `w` and `out` and lanes `half × 16..+16` of
                // `acts` and `out` lie inside the operands (checked above).
                unsafe {
                    match take {
                        1 => float_half_panel::<1>(w, stride, cols, acts, out, prefetch),
                        2 => float_half_panel::<2>(w, stride, cols, acts, out, prefetch),
                        3 => float_half_panel::<3>(w, stride, cols, acts, out, prefetch),
                        4 => float_half_panel::<4>(w, stride, cols, acts, out, prefetch),
                        5 => float_half_panel::<5>(w, stride, cols, acts, out, prefetch),
                        _ => float_half_panel::<6>(w, stride, cols, acts, out, prefetch),
                    }
                }
            }
        }
    },
    write_sums: float_gemm_sums,
};

/// [`float_gemm::PrepareFloatActs`]: a plain transposition (AVX2's gathers are slower than
/// scalar loads on the cores that lack AVX-512; this is `n × cols` values against the
/// product's `n × rows × cols` FMAs).
fn float_gemm_acts(x: &[f32], n: usize, cols: usize, acts: &mut FloatActs) {
    acts.reset(n, cols);
    for (t, row) in x.chunks_exact(cols.max(1)).take(n).enumerate() {
        let group = &mut acts.values[t / GROUP * cols * GROUP..][..cols * GROUP];
        for (c, &v) in row.iter().enumerate() {
            group[c * GROUP + t % GROUP] = v;
        }
    }
}

/// [`float_gemm::WriteSums`]: the sums transposed back into the product's rows.
fn float_gemm_sums(sums: &[f32], rows: usize, lanes: usize, out: &mut [f32], stride: usize) {
    float_gemm::check_sums(sums, rows, lanes, out, stride);
    // SAFETY: `out` holds `lanes` rows of `stride ≥ rows` floats (checked above) and is
    // borrowed mutably here.
    unsafe { gemm::transpose_products(sums, GROUP, rows, lanes, out.as_mut_ptr(), stride) };
}

/// `R` (≤ 6) weight rows × the sixteen activation rows from `acts[0]` of a group: per column,
/// two vectors of the group and one broadcast per row, `2R` FMAs into sums held in registers
/// from `out` (`out[j × GROUP..+16]` for row `j`) back to `out`. With `prefetch_next`, the `R`
/// rows after these are asked for at the same columns meanwhile, as the AVX-512 panel does.
///
/// # Safety
/// The CPU has AVX2 and FMA; `w` holds rows `0..R` at stride `stride` for `cols` columns,
/// `acts` holds `(cols − 1) × GROUP + 16` values and `out` `(R − 1) × GROUP + 16`.
#[target_feature(enable = "avx2,fma")]
unsafe fn float_half_panel<const R: usize>(
    w: &[f32],
    stride: usize,
    cols: usize,
    acts: &[f32],
    out: &mut [f32],
    prefetch_next: bool,
) {
    const { assert!(GROUP == 32 && HALF == 16 && R <= 6) };
    let (w, acts, out) = (w.as_ptr(), acts.as_ptr(), out.as_mut_ptr());
    // SAFETY (every access): inside the operands, as the caller promises.
    unsafe {
        let mut sums = [[_mm256_setzero_ps(); 2]; R];
        for (j, sums) in sums.iter_mut().enumerate() {
            for (v, sum) in sums.iter_mut().enumerate() {
                *sum = _mm256_loadu_ps(out.add(j * GROUP + v * 8));
            }
        }
        for c in 0..cols {
            if prefetch_next && c % 16 == 0 {
                // A hint: past the matrix it fetches nothing of use, and it never faults.
                for j in R..2 * R {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(j * stride + c).cast());
                }
            }
            let a0 = _mm256_loadu_ps(acts.add(c * GROUP));
            let a1 = _mm256_loadu_ps(acts.add(c * GROUP + 8));
            for (j, sums) in sums.iter_mut().enumerate() {
                let b = _mm256_set1_ps(*w.add(j * stride + c));
                sums[0] = _mm256_fmadd_ps(a0, b, sums[0]);
                sums[1] = _mm256_fmadd_ps(a1, b, sums[1]);
            }
        }
        for (j, sums) in sums.iter().enumerate() {
            for (v, &sum) in sums.iter().enumerate() {
                _mm256_storeu_ps(out.add(j * GROUP + v * 8), sum);
            }
        }
    }
}

/// The integer GEMM of [`super::gemm`] on AVX2 without VNNI (Zen 2 and 3, Intel cores before
/// Ice Lake), with `vpmaddubsw` (unsigned × signed bytes, pairs summed into i16) and
/// `vpmaddwd` (i16 pairs into i32) in place of `vpdpbusd`:
/// - INT4 and INT2 weights take unsigned activations (`x_q + 128 ≤ 255`) directly: a pair of
///   products is at most `2 × 255 × 8 = 4080` in magnitude, so a block's eight `vpmaddubsw`
///   results add up in i16 without saturating (≤ 32640) and one `vpmaddwd` per block widens
///   them;
/// - INT8 weights take signed activations and the sign trick of the GEMV (`|w|` against
///   `x × sign(w)`, a pair at most `2 × 128 × 127`), widened after every step.
///
/// Every block's integer sum is exact either way, and so is a scale group's (eight blocks add
/// in i32: at most `256 × 255 × 8` in magnitude, plus the bias); the float sums are the
/// reference's, so the results are its bits.
pub(crate) static INT_GEMM: IntGemm = IntGemm {
    name: "avx2",
    layout: |bits| {
        if bits == QuantBits::Int8 {
            ActLayout::Signed
        } else {
            ActLayout::Unsigned
        }
    },
    // SAFETY: this kernel is only chosen when `supported()` said yes.
    quantize_activations: |x, bits, codes, scales| unsafe {
        quantize_activations(x, bits, codes, scales)
    },
    prepare_rows: int_gemm_rows,
    run: |w, x, out| {
        gemm::check_operands(w, x, out, x.layout);
        // SAFETY: this kernel is only chosen when `supported()` said yes; the operands hold
        // what it reads and writes (checked above).
        unsafe { int_gemm(w, x, out) }
    },
};

/// [`INT_GEMM`]'s products: each group of [`LANES`] activation rows against the weight rows
/// two at a time.
///
/// # Safety
/// The CPU has AVX2 and FMA; the operands passed [`gemm::check_operands`].
#[target_feature(enable = "avx2,fma")]
unsafe fn int_gemm(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    // SAFETY: the caller's promise.
    unsafe { gemm::by_scale_group!(w.group, int_gemm_grouped(w, x, out)) }
}

/// [`int_gemm`] for scale groups of `GROUP` blocks ([`gemm::by_scale_group`]).
///
/// # Safety
/// As [`int_gemm`].
#[target_feature(enable = "avx2,fma")]
unsafe fn int_gemm_grouped<const GROUP: usize>(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    let signed = x.layout.signed();
    for group in 0..x.groups {
        let mut first = 0;
        while first < w.rows {
            let take = 2.min(w.rows - first);
            // SAFETY: rows `first..first + take` and group `group` lie inside the operands.
            unsafe {
                match (signed, take) {
                    (false, 1) => int_panel::<1, false, GROUP>(w, x, group, first, out),
                    (false, _) => int_panel::<2, false, GROUP>(w, x, group, first, out),
                    (true, 1) => int_panel::<1, true, GROUP>(w, x, group, first, out),
                    (true, _) => int_panel::<2, true, GROUP>(w, x, group, first, out),
                }
            }
            first += take;
        }
    }
}

/// `R` weight rows from `first` × the [`LANES`] activation rows of `group` (two vectors of
/// eight i32 lanes), scale group by scale group: the group's integer sums (its blocks' sums, see
/// [`INT_GEMM`], plus the bias for unsigned activations), converted and added to each lane's
/// float sum by one FMA with the group's scale; the sums times the row's scale at the end.
///
/// # Safety
/// The CPU has AVX2 and FMA; the operands passed [`gemm::check_operands`], `first + R ≤ rows`
/// and `group < x.groups`.
#[target_feature(enable = "avx2,fma")]
unsafe fn int_panel<const R: usize, const SIGNED: bool, const GROUP: usize>(
    w: &GemmRows<'_>,
    x: &GemmActs,
    group: usize,
    first: usize,
    out: &mut [f32],
) {
    const STEPS: usize = BLOCK / 4;
    const { assert!(LANES == 16) };
    let (blocks, stride) = (w.blocks, x.groups * LANES);
    let width = blocks * BLOCK;
    // SAFETY (every access): inside the operands, as the caller promises: a group's codes are
    // `width × LANES` bytes, `[width / 4][lane][4]`; its scales `[blocks][LANES]`; a row's
    // codes `width` bytes.
    unsafe {
        let acts = x.codes.as_ptr().add(group * width * LANES);
        let scales = x.scales.as_ptr().add(group * blocks * LANES);
        let rows: [*const u8; R] =
            std::array::from_fn(|j| w.codes.as_ptr().add((first + j) * width));
        let ones = _mm256_set1_epi16(1);
        // (`group` names the activation rows' group here.)
        let per_scale = if GROUP == 0 { w.group } else { GROUP };
        let scale_groups = blocks.div_ceil(per_scale);
        let mut sums = [[_mm256_setzero_ps(); 2]; R];
        for sg in 0..scale_groups {
            let (start, end) = (sg * per_scale, ((sg + 1) * per_scale).min(blocks));
            // The group's i32 sums, from the bias where the activations are unsigned.
            let mut ints = [[_mm256_setzero_si256(); 2]; R];
            if !SIGNED {
                for (j, ints) in ints.iter_mut().enumerate() {
                    *ints = [_mm256_set1_epi32(w.bias[(first + j) * scale_groups + sg]); 2];
                }
            }
            for b in start..end {
                // Unsigned activations: the block's pair sums in i16, widened once.
                let mut pairs = [[_mm256_setzero_si256(); 2]; R];
                for s in b * STEPS..(b + 1) * STEPS {
                    let a = [
                        _mm256_loadu_si256(acts.add(s * 4 * LANES).cast()),
                        _mm256_loadu_si256(acts.add(s * 4 * LANES + 32).cast()),
                    ];
                    for j in 0..R {
                        let four = rows[j].add(s * 4).cast::<i32>().read_unaligned();
                        let wv = _mm256_set1_epi32(four);
                        if SIGNED {
                            let magnitude = _mm256_sign_epi8(wv, wv);
                            for (int, &a) in ints[j].iter_mut().zip(&a) {
                                let pair = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(a, wv));
                                *int = _mm256_add_epi32(*int, _mm256_madd_epi16(pair, ones));
                            }
                        } else {
                            for (pair, &a) in pairs[j].iter_mut().zip(&a) {
                                *pair = _mm256_add_epi16(*pair, _mm256_maddubs_epi16(a, wv));
                            }
                        }
                    }
                }
                if !SIGNED {
                    for (ints, pairs) in ints.iter_mut().zip(&pairs) {
                        for (int, &pair) in ints.iter_mut().zip(pairs) {
                            *int = _mm256_add_epi32(*int, _mm256_madd_epi16(pair, ones));
                        }
                    }
                }
            }
            for (ints, sums) in ints.iter().zip(sums.iter_mut()) {
                for (v, (&int, sum)) in ints.iter().zip(sums.iter_mut()).enumerate() {
                    let scale = _mm256_loadu_ps(scales.add(start * LANES + v * 8));
                    *sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int), scale, *sum);
                }
            }
        }
        for (j, sums) in sums.iter().enumerate() {
            let row_scale = _mm256_set1_ps(w.scales[first + j]);
            for (v, &sum) in sums.iter().enumerate() {
                let at = out
                    .as_mut_ptr()
                    .add((first + j) * stride + group * LANES + v * 8);
                _mm256_storeu_ps(at, _mm256_mul_ps(sum, row_scale));
            }
        }
    }
}

/// [`gemm::transpose_products`] in 8 × 8 blocks: eight rows of products loaded, transposed in
/// registers (unpack, shuffle, swap of 128-bit halves) and stored as eight rows of the output,
/// the blocks of one group of eight activation rows after another, so that each output row is
/// written in order. Returns the weight rows and activation rows it took (whole blocks).
///
/// # Safety
/// The CPU has AVX2; as [`gemm::transpose_products`], whose assert holds.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transpose_blocks(
    products: &[f32],
    stride: usize,
    rows: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) -> (usize, usize) {
    let (whole_rows, whole_lanes) = (rows / 8 * 8, n / 8 * 8);
    // SAFETY (every access): rows below `rows` of `stride ≥ n` floats lie in `products`, and
    // `out` takes every `t × out_stride + r` for `t < n`, `r < rows` (the caller's promise).
    unsafe {
        for t in (0..whole_lanes).step_by(8) {
            for r in (0..whole_rows).step_by(8) {
                let v: [__m256; 8] = std::array::from_fn(|k| {
                    _mm256_loadu_ps(products.as_ptr().add((r + k) * stride + t))
                });
                let pairs = [
                    _mm256_unpacklo_ps(v[0], v[1]),
                    _mm256_unpackhi_ps(v[0], v[1]),
                    _mm256_unpacklo_ps(v[2], v[3]),
                    _mm256_unpackhi_ps(v[2], v[3]),
                    _mm256_unpacklo_ps(v[4], v[5]),
                    _mm256_unpackhi_ps(v[4], v[5]),
                    _mm256_unpacklo_ps(v[6], v[7]),
                    _mm256_unpackhi_ps(v[6], v[7]),
                ];
                // Lane j (and j + 4) of rows r..r + 4, then of rows r + 4..r + 8.
                let quads = [
                    _mm256_shuffle_ps::<0x44>(pairs[0], pairs[2]),
                    _mm256_shuffle_ps::<0xEE>(pairs[0], pairs[2]),
                    _mm256_shuffle_ps::<0x44>(pairs[1], pairs[3]),
                    _mm256_shuffle_ps::<0xEE>(pairs[1], pairs[3]),
                    _mm256_shuffle_ps::<0x44>(pairs[4], pairs[6]),
                    _mm256_shuffle_ps::<0xEE>(pairs[4], pairs[6]),
                    _mm256_shuffle_ps::<0x44>(pairs[5], pairs[7]),
                    _mm256_shuffle_ps::<0xEE>(pairs[5], pairs[7]),
                ];
                for j in 0..4 {
                    let low = _mm256_permute2f128_ps::<0x20>(quads[j], quads[j + 4]);
                    let high = _mm256_permute2f128_ps::<0x31>(quads[j], quads[j + 4]);
                    _mm256_storeu_ps(out.add((t + j) * out_stride + r), low);
                    _mm256_storeu_ps(out.add((t + j + 4) * out_stride + r), high);
                }
            }
        }
    }
    (whole_rows, whole_lanes)
}

/// [`INT_GEMM`]'s [`gemm::PrepareRows`] for rows of whole blocks (other shapes take the
/// reference): INT8 rows where they lie and no bias (they meet signed activations); INT4 and
/// INT2 rows unpacked by [`unpack_blocks`] (INT4 two blocks at a time in AVX2, the bias from
/// `vpsadbw`; INT2 with SSE shifts and masks).
fn int_gemm_rows<'a>(
    packed: &'a [u8],
    bits: QuantBits,
    cols: usize,
    rows: usize,
    codes: &'a mut Vec<u8>,
    bias: &mut Vec<i32>,
) -> &'a [u8] {
    if !cols.is_multiple_of(BLOCK) {
        // The reference, with the bias only where the activations are unsigned.
        bias.clear();
        let bias = (bits != QuantBits::Int8).then_some(bias);
        return gemm::prepare_rows_by(packed, bits, cols, rows, codes, bias, |src, dst| {
            gemm::unpack_values(src, bits, cols, dst)
        });
    }
    let blocks = rows * cols / BLOCK;
    let packed = &packed[..rows * bits.row_bytes(cols)];
    bias.clear();
    if bits == QuantBits::Int8 {
        return packed;
    }
    codes.clear();
    codes.resize(blocks * BLOCK, 0);
    // SAFETY: `INT_GEMM` is only chosen when `supported()` said yes.
    unsafe { unpack_blocks(packed, bits, codes, bias) };
    codes
}

/// Unpacks whole INT4/INT2 blocks (rows of whole blocks lie back to back) into signed bytes in
/// [`super::block_order`] (INT4: the low nibbles, then the high ones; INT2: each 2-bit field
/// of the block's eight bytes in turn), and pushes each block's bias ([`gemm::PrepareRows`]). INT4 blocks
/// go two at a time by [`unpack_int4_pairs`]; this loop takes an odd last one.
///
/// # Safety
/// The CPU has AVX2; `codes` holds `BLOCK` bytes for every block of `packed`.
#[target_feature(enable = "avx2")]
unsafe fn unpack_blocks(packed: &[u8], bits: QuantBits, codes: &mut [u8], bias: &mut Vec<i32>) {
    let block_bytes = BLOCK * bits.bits() as usize / 8;
    assert!(codes.len() >= packed.len() / block_bytes * BLOCK);
    let (ones, ones16) = (_mm256_set1_epi8(1), _mm256_set1_epi16(1));
    // SAFETY (every access): block `b`'s packed bytes and its `BLOCK` codes lie inside the
    // slices (asserted above).
    unsafe {
        bias.reserve(packed.len() / block_bytes);
        // INT4 blocks two at a time, as 256-bit vectors.
        let pairs = if bits == QuantBits::Int4 {
            unpack_int4_pairs(packed, codes, bias)
        } else {
            0
        };
        for (b, src) in packed.chunks_exact(block_bytes).enumerate().skip(2 * pairs) {
            let dst = codes.as_mut_ptr().add(b * BLOCK);
            match bits {
                QuantBits::Int4 => {
                    let v = _mm_loadu_si128(src.as_ptr().cast());
                    let mask = _mm_set1_epi8(0x0f);
                    let sign =
                        _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
                    let lo = _mm_shuffle_epi8(sign, _mm_and_si128(v, mask));
                    let hi = _mm_shuffle_epi8(sign, _mm_and_si128(_mm_srli_epi16(v, 4), mask));
                    _mm_storeu_si128(dst.cast(), lo);
                    _mm_storeu_si128(dst.add(16).cast(), hi);
                }
                _ => {
                    let v = _mm_loadl_epi64(src.as_ptr().cast());
                    let (mask, two) = (_mm_set1_epi8(3), _mm_set1_epi8(2));
                    let fields = [
                        v,
                        _mm_srli_epi16(v, 2),
                        _mm_srli_epi16(v, 4),
                        _mm_srli_epi16(v, 6),
                    ];
                    for (j, field) in fields.into_iter().enumerate() {
                        // A 2-bit field `f` is the code `(f ^ 2) − 2`.
                        let f = _mm_xor_si128(_mm_and_si128(field, mask), two);
                        _mm_storel_epi64(dst.add(8 * j).cast(), _mm_sub_epi8(f, two));
                    }
                }
            }
            // The block's sum: |sum| ≤ 32 × 8, so `maddubs` of ones by the codes is exact.
            let block = _mm256_loadu_si256(dst.cast());
            let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(ones, block), ones16);
            let s = _mm_add_epi32(
                _mm256_castsi256_si128(sums),
                _mm256_extracti128_si256(sums, 1),
            );
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
            bias.push(-128 * _mm_cvtsi128_si32(s));
        }
    }
}

/// [`unpack_blocks`] for the first pairs of whole INT4 blocks (16 packed bytes each): their codes
/// and their bias; returns how many pairs.
///
/// # Safety
/// The CPU has AVX2; `codes` holds `BLOCK` bytes for every block of `packed`.
#[target_feature(enable = "avx2")]
unsafe fn unpack_int4_pairs(packed: &[u8], codes: &mut [u8], bias: &mut Vec<i32>) -> usize {
    let pairs = packed.len() / 32;
    assert!(codes.len() >= pairs * 2 * BLOCK);
    let mask = _mm256_set1_epi8(0x0f);
    let sign = _mm256_setr_epi8(
        0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6,
        -5, -4, -3, -2, -1,
    );
    let (top, zero) = (_mm256_set1_epi8(-128), _mm256_setzero_si256());
    for p in 0..pairs {
        // SAFETY: pair `p`'s 32 packed bytes and 64 codes lie inside the slices (asserted above).
        unsafe {
            let v = _mm256_loadu_si256(packed.as_ptr().add(p * 32).cast());
            let lo = _mm256_shuffle_epi8(sign, _mm256_and_si256(v, mask));
            let hi = _mm256_shuffle_epi8(sign, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
            let dst = codes.as_mut_ptr().add(p * 2 * BLOCK);
            _mm256_storeu_si256(dst.cast(), _mm256_permute2x128_si256::<0x20>(lo, hi));
            _mm256_storeu_si256(
                dst.add(BLOCK).cast(),
                _mm256_permute2x128_si256::<0x31>(lo, hi),
            );
            // Each block's sum: `sad` adds eight unsigned `code + 128` at a time.
            let sums = _mm256_add_epi64(
                _mm256_sad_epu8(_mm256_xor_si256(lo, top), zero),
                _mm256_sad_epu8(_mm256_xor_si256(hi, top), zero),
            );
            let sums = _mm256_add_epi64(sums, _mm256_shuffle_epi32::<0b01_00_11_10>(sums));
            let offset = (BLOCK as i32) * 128;
            bias.push(-128 * (_mm256_extract_epi32::<0>(sums) - offset));
            bias.push(-128 * (_mm256_extract_epi32::<4>(sums) - offset));
        }
    }
    pairs
}

// ---- activation rounding ----

/// [`reference::quantize_activations`] (the GEMV's activation rounding, and the integer
/// GEMM's) 32 values at a time: each block's scale from the largest magnitude of its
/// [`super::scale_group`], its values rounded half away from zero by truncating and comparing
/// the remainder, narrowed with saturation and put in [`super::block_order`]. The same codes and
/// scales for finite values.
///
/// # Safety
/// The CPU has AVX2.
#[target_feature(enable = "avx2")]
unsafe fn quantize_activations(x: &[f32], bits: QuantBits, codes: &mut [i8], scales: &mut [f32]) {
    let blocks = x.len().div_ceil(BLOCK);
    assert!(codes.len() >= blocks * BLOCK && scales.len() >= blocks);
    let group = super::scale_group(bits);
    // Natural order from the packs' lane interleaving, then the block order: a byte shuffle
    // within each 128-bit lane and a permutation of 4-byte words across them.
    let unpack = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let (shuffle, words) = match bits {
        QuantBits::Int8 => (None, unpack),
        QuantBits::Int4 => (
            Some(_mm256_setr_epi8(
                0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1,
                3, 5, 7, 9, 11, 13, 15,
            )),
            _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7),
        ),
        QuantBits::Int2 => (
            Some(_mm256_setr_epi8(
                0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9, 13, 2,
                6, 10, 14, 3, 7, 11, 15,
            )),
            unpack,
        ),
    };
    let magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MAX));
    let (half, minus_half) = (_mm256_set1_ps(0.5), _mm256_set1_ps(-0.5));
    for first in (0..blocks).step_by(group) {
        let last = (first + group).min(blocks);
        // `max(|v|, m)` keeps `m` where `v` is NaN, as the scalar `f32::max` does.
        let mut max = _mm256_setzero_ps();
        for b in first..last {
            for v in block_values(x, b) {
                max = _mm256_max_ps(_mm256_and_ps(v, magnitude), max);
            }
        }
        let max = _mm_max_ps(_mm256_castps256_ps128(max), _mm256_extractf128_ps(max, 1));
        let max = _mm_max_ps(max, _mm_movehl_ps(max, max));
        let max = _mm_cvtss_f32(_mm_max_ss(max, _mm_movehdup_ps(max)));
        let d = max / 127.0;
        let inverse = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        scales[first..last].fill(d);
        for b in first..last {
            let q = block_values(x, b).map(|v| {
                let v = _mm256_mul_ps(v, inverse);
                let t = _mm256_cvttps_epi32(v);
                let fraction = _mm256_sub_ps(v, _mm256_cvtepi32_ps(t));
                // Comparisons are all ones (−1) where true.
                let up = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(fraction, half));
                let down = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(fraction, minus_half));
                _mm256_add_epi32(_mm256_sub_epi32(t, up), down)
            });
            let packed = _mm256_packs_epi16(
                _mm256_packs_epi32(q[0], q[1]),
                _mm256_packs_epi32(q[2], q[3]),
            );
            let ordered = match shuffle {
                Some(shuffle) => _mm256_permutevar8x32_epi32(
                    _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(packed, unpack), shuffle),
                    words,
                ),
                None => _mm256_permutevar8x32_epi32(packed, words),
            };
            // SAFETY: block `b`'s 32 codes (length asserted above).
            unsafe { _mm256_storeu_si256(codes.as_mut_ptr().add(b * BLOCK).cast(), ordered) };
        }
    }
}

/// The 32 values of block `b` of an activation row (zero past the row's end).
#[target_feature(enable = "avx2")]
fn block_values(row: &[f32], b: usize) -> [__m256; 4] {
    let first = b * BLOCK;
    let mut padded = [0f32; BLOCK];
    let values = match row.get(first..first + BLOCK) {
        Some(values) => values,
        None => {
            padded[..row.len() - first].copy_from_slice(&row[first..]);
            &padded
        }
    };
    // SAFETY: four times eight of the block's 32 values.
    unsafe { [0, 8, 16, 24].map(|i| _mm256_loadu_ps(values.as_ptr().add(i))) }
}
