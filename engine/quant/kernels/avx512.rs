//! AVX-512 VNNI: the integer GEMM of [`super::gemm`] on 512-bit `vpdpbusd` (64 byte products
//! per instruction, four times an f32 FMA's multiply-adds), for CPUs that report `avx512f`,
//! `avx512bw`, `avx512vl` and `avx512vnni` (Ice Lake and Sapphire Rapids Xeons, Zen 4 and later).
//!
//! The micro-kernel keeps a tile of up to [`MAX_ROWS`] weight rows × 2 groups of 16 activation
//! rows in registers: per step of four values it loads one 64-byte activation vector per group
//! and broadcasts four codes of each weight row, and per block of 32 values it turns the integer
//! sums into f32 with the block's activation scales (24 accumulators of 32 registers).

use std::arch::x86_64::*;

use super::gemm::{self, GemmActs, GemmRows, IntGemm, LANES};
use super::{avx2, scalar, Kernels, QuantRow, BLOCK};
use crate::quant::QuantBits;

/// Weight rows per micro-kernel call.
const MAX_ROWS: usize = 6;

/// Whether this CPU runs [`INT_GEMM`].
pub(crate) fn supported() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("avx512vl")
}

pub(crate) static INT_GEMM: IntGemm = IntGemm {
    name: "avx512-vnni",
    // SAFETY: this kernel is only chosen when `supported()` said yes.
    prepare_acts: |x, n, cols, bits, acts| unsafe { prepare_acts(x, n, cols, bits, acts) },
    prepare_rows,
    // SAFETY: this kernel is only chosen when `supported()` said yes.
    run: |w, x, out| unsafe { gemm_quant(w, x, out) },
};

/// Whether this CPU runs [`KERNELS`] (the AVX-VNNI set's other kernels come with it).
pub(crate) fn gemv_supported() -> bool {
    supported() && avx2::vnni_supported()
}

/// The GEMV kernels with INT2 rows on 512-bit registers; the other formats as
/// [`avx2::KERNELS_VNNI`].
pub(crate) static KERNELS: Kernels = Kernels {
    name: "avx512+vnni",
    dot_quant,
    dot_f16: avx2::KERNELS_VNNI.dot_f16,
    dot_bf16: avx2::KERNELS_VNNI.dot_bf16,
    dot_f32: avx2::KERNELS_VNNI.dot_f32,
};

fn dot_quant(row: &[u8], bits: QuantBits, cols: usize, x: &QuantRow<'_>) -> f32 {
    match bits {
        // SAFETY: `KERNELS` is only chosen when `gemv_supported()` said yes.
        QuantBits::Int2 => unsafe { dot_int2(row, cols, x) },
        _ => (avx2::KERNELS_VNNI.dot_quant)(row, bits, cols, x),
    }
}

/// INT2 rows, two blocks (16 bytes, 64 codes) per step: each block's 8 bytes copied into four
/// 64-bit lanes, shifted to fields 0–3 (the activations' [`super::block_order`]), masked and
/// made unsigned (`code + 2`) in one `vpternlogq`, one `vpdpbusd` against the two blocks'
/// activation codes, and one FMA with their two scales (lanes 0–7 and 8–15). The AVX2 kernel
/// spends about nine vector instructions per block on the same work, which bounds it below the
/// memory bandwidth; this one spends about three and a half.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn dot_int2(row: &[u8], cols: usize, x: &QuantRow<'_>) -> f32 {
    let full = cols / BLOCK;
    assert!(row.len() >= full * 8 && x.codes.len() >= full * BLOCK && x.scales.len() >= full);
    let lanes = _mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0);
    let shifts = _mm512_set_epi64(6, 4, 2, 0, 6, 4, 2, 0);
    let (mask, two) = (_mm512_set1_epi8(3), _mm512_set1_epi8(2));
    let w = row.as_ptr();
    // Blocks `b` and (when `both`) `b + 1`, as f32 partial sums times their scales.
    let step = |b: usize, both: bool, acc: __m512| {
        // SAFETY: block `b` (and `b + 1` when `both`) lies inside `row`, `x.codes` and
        // `x.scales` (lengths asserted above); the loads of a lone block read only its bytes.
        unsafe {
            let (v, xv, upper) = if both {
                (
                    _mm512_castsi128_si512(_mm_loadu_si128(w.add(b * 8).cast())),
                    _mm512_loadu_si512(x.codes.as_ptr().add(b * BLOCK).cast()),
                    *x.scales.get_unchecked(b + 1),
                )
            } else {
                (
                    _mm512_castsi128_si512(_mm_loadl_epi64(w.add(b * 8).cast())),
                    _mm512_zextsi256_si512(_mm256_loadu_si256(
                        x.codes.as_ptr().add(b * BLOCK).cast(),
                    )),
                    0.0,
                )
            };
            let fields = _mm512_srlv_epi64(_mm512_permutexvar_epi64(lanes, v), shifts);
            // (fields & 3) ^ 2: the two's-complement field plus 2.
            let unsigned = _mm512_ternarylogic_epi64::<0x6a>(fields, mask, two);
            let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), unsigned, xv);
            let scales = _mm512_mask_blend_ps(
                0xff00,
                _mm512_set1_ps(*x.scales.get_unchecked(b)),
                _mm512_set1_ps(upper),
            );
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scales, acc)
        }
    };
    let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let quads = full / 4;
    for q in 0..quads {
        let b = q * 4;
        // The next rows of a large matrix are far from the caches: ask for them early.
        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(b * 8 + avx2::PREFETCH_AHEAD).cast());
        a0 = step(b, true, a0);
        a1 = step(b + 2, true, a1);
    }
    let mut b = quads * 4;
    while b < full {
        a0 = step(b, b + 1 < full, a0);
        b += 2;
    }
    let mut sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) - x.offset;
    if full * BLOCK < cols {
        sum += x.scales[full] * scalar::block_sum(row, QuantBits::Int2, cols, full, x.codes) as f32;
    }
    sum
}

/// The reference activation preparation of [`super::gemm`], 32 values at a time: the block's absolute maximum in registers, the
/// same divisions for its scale, rounding half away from zero by truncating and comparing the
/// remainder (as [`super::scalar`] does), a saturating narrowing to bytes, and one scatter of
/// the block's eight 4-byte steps into its row's lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn prepare_acts(x: &[f32], n: usize, cols: usize, bits: QuantBits, acts: &mut GemmActs) {
    acts.reset(n, cols);
    let blocks = acts.blocks;
    let width = blocks * BLOCK;
    assert!(x.len() >= n * cols && acts.codes.len() >= n.div_ceil(LANES) * width * LANES);
    // Output position p of a block takes element `source[p]`.
    let mut source = [0i32; BLOCK];
    for i in 0..BLOCK {
        source[super::block_order(bits, i)] = i as i32;
    }
    // SAFETY: 16 + 16 values of a 32-value array.
    let (first_half, second_half) = unsafe {
        (
            _mm512_loadu_si512(source.as_ptr().cast()),
            _mm512_loadu_si512(source.as_ptr().add(16).cast()),
        )
    };
    let reorder = bits != QuantBits::Int8;
    let steps = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
    let (one, half) = (_mm512_set1_epi32(1), _mm512_set1_ps(0.5));
    let round = |v: __m512| {
        let t = _mm512_cvttps_epi32(v);
        let fraction = _mm512_sub_ps(v, _mm512_cvtepi32_ps(t));
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(fraction, half);
        let down =
            _mm512_cmp_ps_mask::<_CMP_LE_OQ>(fraction, _mm512_sub_ps(_mm512_setzero_ps(), half));
        let t = _mm512_mask_add_epi32(t, up, t, one);
        _mm512_mask_sub_epi32(t, down, t, one)
    };
    for (t, row) in x.chunks_exact(cols).take(n).enumerate() {
        let (group, lane) = (t / LANES, t % LANES);
        let lane_codes = acts.codes[group * width * LANES + lane * 4..].as_mut_ptr();
        for b in 0..blocks {
            let first = b * BLOCK;
            let len = BLOCK.min(cols - first);
            // SAFETY: the masks cover values `first .. first + len` of the row only.
            let (a, c) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask_of(len), row.as_ptr().add(first)),
                    _mm512_maskz_loadu_ps(
                        mask_of(len.saturating_sub(16)),
                        row.as_ptr().wrapping_add(first + 16),
                    ),
                )
            };
            let max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
            let d = max / 127.0;
            let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
            acts.scales[(group * blocks + b) * LANES + lane] = d;
            let (a, c) = if reorder {
                (
                    _mm512_permutex2var_ps(a, first_half, c),
                    _mm512_permutex2var_ps(a, second_half, c),
                )
            } else {
                (a, c)
            };
            let inverse = _mm512_set1_ps(inverse);
            let low = _mm512_cvtsepi32_epi8(round(_mm512_mul_ps(a, inverse)));
            let high = _mm512_cvtsepi32_epi8(round(_mm512_mul_ps(c, inverse)));
            let codes = _mm256_xor_si256(_mm256_set_m128i(high, low), _mm256_set1_epi8(-128));
            // SAFETY: the block's eight steps of this row's lane: bytes `(b × 8 + s) × 64` past
            // `lane_codes`, inside the group (length asserted above).
            unsafe {
                _mm256_i32scatter_epi32::<4>(lane_codes.add(b * 8 * 64).cast(), steps, codes)
            };
        }
    }
}

/// A 16-lane mask of the first `len` lanes (all of them from 16 on).
fn mask_of(len: usize) -> u16 {
    if len >= 16 {
        0xffff
    } else {
        (1u16 << len) - 1
    }
}

/// [`gemm::prepare_rows`] with the unpacking and the block sums in 512-bit registers, for rows
/// of whole blocks (other shapes take the reference).
fn prepare_rows<'a>(
    packed: &'a [u8],
    bits: QuantBits,
    cols: usize,
    rows: usize,
    codes: &'a mut Vec<u8>,
    bias: &mut Vec<i32>,
) -> &'a [u8] {
    if !cols.is_multiple_of(BLOCK) {
        return gemm::prepare_rows(packed, bits, cols, rows, codes, bias);
    }
    let blocks = rows * cols / BLOCK;
    let packed = &packed[..rows * bits.row_bytes(cols)];
    let unpacked: &[u8] = match bits {
        QuantBits::Int8 => packed,
        _ => {
            codes.clear();
            codes.resize(blocks * BLOCK, 0);
            // SAFETY: `INT_GEMM` is only chosen when `supported()` said yes.
            unsafe { unpack_blocks(packed, bits, codes) };
            codes
        }
    };
    bias.clear();
    bias.resize(blocks, 0);
    // SAFETY: as above.
    unsafe { block_bias(unpacked, bias) };
    unpacked
}

/// Unpacks whole INT4/INT2 blocks (rows of whole blocks lie back to back) into signed bytes in
/// [`super::block_order`], two blocks per step: each block's bytes are copied into the 64-bit
/// lanes that a variable shift and a mask turn into its fields.
#[target_feature(enable = "avx512f,avx512bw")]
fn unpack_blocks(packed: &[u8], bits: QuantBits, out: &mut [u8]) {
    let block_bytes = BLOCK * bits.bits() as usize / 8;
    let blocks = out.len() / BLOCK;
    assert!(packed.len() >= blocks * block_bytes);
    let (lanes, shifts, mask, zero) = match bits {
        // Block = 16 bytes: low nibbles, then high nibbles.
        QuantBits::Int4 => (
            _mm512_set_epi64(3, 2, 3, 2, 1, 0, 1, 0),
            _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0),
            0x0f,
            8,
        ),
        // Block = 8 bytes: field 0 of each byte, then fields 1, 2 and 3.
        _ => (
            _mm512_set_epi64(1, 1, 1, 1, 0, 0, 0, 0),
            _mm512_set_epi64(6, 4, 2, 0, 6, 4, 2, 0),
            0x03,
            2,
        ),
    };
    let (mask, zero) = (_mm512_set1_epi8(mask), _mm512_set1_epi8(zero));
    let pairs = blocks / 2;
    for p in 0..pairs {
        // SAFETY: pair `p` is bytes `2p × block_bytes ..` of `packed` (≤ 32 read, inside the
        // length asserted above) and `2p × 32 .. + 64` of `out`.
        unsafe {
            let src = packed.as_ptr().add(2 * p * block_bytes);
            let v = if block_bytes == 16 {
                _mm512_castsi256_si512(_mm256_loadu_si256(src.cast()))
            } else {
                _mm512_castsi128_si512(_mm_loadu_si128(src.cast()))
            };
            let fields = _mm512_and_si512(
                _mm512_srlv_epi64(_mm512_permutexvar_epi64(lanes, v), shifts),
                mask,
            );
            // Two's complement of the field's width: (f ^ z) − z.
            let codes = _mm512_sub_epi8(_mm512_xor_si512(fields, zero), zero);
            _mm512_storeu_si512(out.as_mut_ptr().add(2 * p * BLOCK).cast(), codes);
        }
    }
    if blocks % 2 == 1 {
        let b = blocks - 1;
        let src = &packed[b * block_bytes..(b + 1) * block_bytes];
        gemm::unpack_values(src, bits, BLOCK, &mut out[b * BLOCK..(b + 1) * BLOCK]);
    }
}

/// `bias[b] = −128 × Σ` of block `b`'s signed codes, two blocks per step (`vpdpbusd` with ones
/// sums fours, two shuffles sum a 16-byte lane, one more the block's two lanes).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn block_bias(codes: &[u8], bias: &mut [i32]) {
    assert!(codes.len() >= bias.len() * BLOCK);
    let ones = _mm512_set1_epi8(1);
    let pairs = bias.len() / 2;
    for p in 0..pairs {
        // SAFETY: 64 bytes from `2p × 32`, inside the length asserted above.
        let v = unsafe { _mm512_loadu_si512(codes.as_ptr().add(2 * p * BLOCK).cast()) };
        let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, v);
        let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<_MM_PERM_CDAB>(s));
        let s = _mm512_add_epi32(s, _mm512_shuffle_epi32::<_MM_PERM_BADC>(s));
        let s = _mm512_add_epi32(s, _mm512_shuffle_i32x4::<0b10_11_00_01>(s, s));
        bias[2 * p] = -128 * _mm512_cvtsi512_si32(s);
        bias[2 * p + 1] = -128 * _mm_cvtsi128_si32(_mm512_extracti32x4_epi32::<2>(s));
    }
    if bias.len() % 2 == 1 {
        let b = bias.len() - 1;
        bias[b] = gemm::bias_of(&codes[b * BLOCK..(b + 1) * BLOCK]);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn gemm_quant(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    let width = w.blocks * BLOCK;
    let stride = x.groups * LANES;
    assert_eq!(x.blocks, w.blocks);
    assert!(w.codes.len() >= w.rows * width && w.bias.len() >= w.rows * w.blocks);
    assert!(w.scales.len() >= w.rows && x.codes.len() >= x.groups * width * LANES);
    assert!(x.scales.len() >= x.groups * w.blocks * LANES && out.len() >= w.rows * stride);
    let mut r = 0;
    while r < w.rows {
        let rows = (w.rows - r).min(MAX_ROWS);
        let mut g = 0;
        while g < x.groups {
            let groups = (x.groups - g).min(2);
            // SAFETY: rows r..r + rows and groups g..g + groups lie inside the operands and
            // `out`, whose lengths are asserted above.
            unsafe {
                match (groups, rows) {
                    (2, 6) => tile::<2, 6>(w, x, r, g, out),
                    (2, 5) => tile::<2, 5>(w, x, r, g, out),
                    (2, 4) => tile::<2, 4>(w, x, r, g, out),
                    (2, 3) => tile::<2, 3>(w, x, r, g, out),
                    (2, 2) => tile::<2, 2>(w, x, r, g, out),
                    (2, _) => tile::<2, 1>(w, x, r, g, out),
                    (_, 6) => tile::<1, 6>(w, x, r, g, out),
                    (_, 5) => tile::<1, 5>(w, x, r, g, out),
                    (_, 4) => tile::<1, 4>(w, x, r, g, out),
                    (_, 3) => tile::<1, 3>(w, x, r, g, out),
                    (_, 2) => tile::<1, 2>(w, x, r, g, out),
                    _ => tile::<1, 1>(w, x, r, g, out),
                }
            }
            g += groups;
        }
        r += rows;
    }
}

/// Weight rows `r0..r0 + R` against activation groups `g0..g0 + G`.
///
/// # Safety
/// Only inlined into functions that enable AVX-512 F/BW/VNNI; those rows and groups lie inside
/// the operands and `out` (lengths as [`gemm_quant`] asserts).
// Index loops: `[h][j]` names a register of the tile, as in the text above.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile<const G: usize, const R: usize>(
    w: &GemmRows<'_>,
    x: &GemmActs,
    r0: usize,
    g0: usize,
    out: &mut [f32],
) {
    // SAFETY: see the function's contract; every offset below stays inside rows r0..r0 + R of
    // `w` and groups g0..g0 + G of `x`.
    unsafe {
        let blocks = w.blocks;
        let width = blocks * BLOCK;
        let stride = x.groups * LANES;
        let weights = w.codes.as_ptr().add(r0 * width);
        let acts = x.codes.as_ptr().add(g0 * width * LANES);
        let bias = w.bias.as_ptr().add(r0 * blocks);
        let act_scales = x.scales.as_ptr().add(g0 * blocks * LANES);
        let mut sums = [[_mm512_setzero_ps(); R]; G];
        for b in 0..blocks {
            let mut ints = [[_mm512_setzero_si512(); R]; G];
            for j in 0..R {
                let start = _mm512_set1_epi32(*bias.add(j * blocks + b));
                for int in ints.iter_mut() {
                    int[j] = start;
                }
            }
            for step in 0..BLOCK / 4 {
                let k = b * BLOCK + step * 4;
                let mut a = [_mm512_setzero_si512(); G];
                for (h, a) in a.iter_mut().enumerate() {
                    *a = _mm512_loadu_si512(acts.add(h * width * LANES + k * LANES).cast());
                }
                for j in 0..R {
                    let four = weights.add(j * width + k).cast::<i32>().read_unaligned();
                    let wv = _mm512_set1_epi32(four);
                    for h in 0..G {
                        ints[h][j] = _mm512_dpbusd_epi32(ints[h][j], a[h], wv);
                    }
                }
            }
            for h in 0..G {
                let scale = _mm512_loadu_ps(act_scales.add((h * blocks + b) * LANES));
                for j in 0..R {
                    sums[h][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints[h][j]), scale, sums[h][j]);
                }
            }
        }
        let o = out.as_mut_ptr();
        for j in 0..R {
            let scale = _mm512_set1_ps(*w.scales.as_ptr().add(r0 + j));
            for (h, row_sums) in sums.iter().enumerate() {
                let at = (r0 + j) * stride + (g0 + h) * LANES;
                _mm512_storeu_ps(o.add(at), _mm512_mul_ps(row_sums[j], scale));
            }
        }
    }
}
