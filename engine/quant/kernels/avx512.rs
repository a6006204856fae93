//! AVX-512 VNNI: the integer GEMM of [`super::gemm`] on 512-bit `vpdpbusd` (64 byte products
//! per instruction, four times an f32 FMA's multiply-adds), for CPUs that report `avx512f`,
//! `avx512bw`, `avx512vl` and `avx512vnni` (Ice Lake and Sapphire Rapids Xeons, Zen 4 and later).
//!
//! The micro-kernel keeps a tile of up to [`MAX_ROWS`] weight rows × 2 groups of 16 activation
//! rows in registers: per step of four values it loads one 64-byte activation vector per group
//! and broadcasts four codes of each weight row, and per scale group (a block of 32 values for
//! INT8 weights, eight for INT4 and INT2) it turns the integer sums into f32 with the group's
//! activation scales (24 accumulators of 32 registers).
//!
//! Also the float GEMM of [`super::float_gemm`] on 512-bit FMAs (`avx512f` alone: Skylake-X
//! and later), whose micro-kernel keeps 6 weight rows × 32 activation rows of sums in 12
//! registers.

use std::arch::x86_64::*;

use super::float_gemm::{self, FloatActs, FloatGemm, GROUP, HALF};
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
    layout: |_| gemm::ActLayout::Unsigned,
    quantize_activations: |x, bits, codes, scales| unsafe {
        quantize_activations(x, bits, codes, scales)
    },
    prepare_rows,
    // SAFETY: this kernel is only chosen when `supported()` said yes.
    run: |w, x, out| unsafe { gemm_quant(w, x, out) },
};

/// Whether this CPU runs [`FLOAT_GEMM`].
pub(crate) fn float_gemm_supported() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// The float GEMM of [`super::float_gemm`] on 512-bit FMAs; activations laid out and sums
/// written back with gathers.
pub(crate) static FLOAT_GEMM: FloatGemm = FloatGemm {
    name: "avx512",
    // SAFETY: this kernel is only chosen when `float_gemm_supported()` said yes.
    prepare_acts: |x, n, cols, acts| unsafe { prepare_float_acts(x, n, cols, acts) },
    panel: |w, rows, stride, cols, acts, lanes, out, prefetch| {
        float_gemm::check_operands(w, rows, stride, cols, acts, lanes, out);
        // SAFETY (every arm): this kernel is only chosen when `float_gemm_supported()` said
        // yes; the operands hold what each reads and writes (checked above).
        unsafe {
            match (lanes <= HALF, rows) {
                (false, 1) => float_panel::<1, 2>(w, stride, cols, acts, out, prefetch),
                (false, 2) => float_panel::<2, 2>(w, stride, cols, acts, out, prefetch),
                (false, 3) => float_panel::<3, 2>(w, stride, cols, acts, out, prefetch),
                (false, 4) => float_panel::<4, 2>(w, stride, cols, acts, out, prefetch),
                (false, 5) => float_panel::<5, 2>(w, stride, cols, acts, out, prefetch),
                (false, _) => float_panel::<6, 2>(w, stride, cols, acts, out, prefetch),
                (true, 1) => float_panel::<1, 1>(w, stride, cols, acts, out, prefetch),
                (true, 2) => float_panel::<2, 1>(w, stride, cols, acts, out, prefetch),
                (true, 3) => float_panel::<3, 1>(w, stride, cols, acts, out, prefetch),
                (true, 4) => float_panel::<4, 1>(w, stride, cols, acts, out, prefetch),
                (true, 5) => float_panel::<5, 1>(w, stride, cols, acts, out, prefetch),
                (true, 6) => float_panel::<6, 1>(w, stride, cols, acts, out, prefetch),
                (true, 7) => float_panel::<7, 1>(w, stride, cols, acts, out, prefetch),
                (true, 8) => float_panel::<8, 1>(w, stride, cols, acts, out, prefetch),
                (true, 9) => float_panel::<9, 1>(w, stride, cols, acts, out, prefetch),
                (true, 10) => float_panel::<10, 1>(w, stride, cols, acts, out, prefetch),
                (true, 11) => float_panel::<11, 1>(w, stride, cols, acts, out, prefetch),
                (true, _) => float_panel::<12, 1>(w, stride, cols, acts, out, prefetch),
            }
        }
    },
    write_sums: |sums, rows, lanes, out, stride| {
        float_gemm::check_sums(sums, rows, lanes, out, stride);
        // SAFETY: this kernel is only chosen when `float_gemm_supported()` said yes; the
        // operands hold what it reads and writes (checked above).
        unsafe { write_float_sums(sums, rows, lanes, out, stride) }
    },
};

/// The lanes `0..n` of a 16-lane mask.
fn first_lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        (1u16 << n) - 1
    }
}

/// [`float_gemm::PrepareFloatActs`]: per group and column, the 32 rows' values gathered into
/// two vectors (rows past the last masked off, so never read, and left zero).
#[target_feature(enable = "avx512f")]
fn prepare_float_acts(x: &[f32], n: usize, cols: usize, acts: &mut FloatActs) {
    acts.reset(n, cols);
    assert!(x.len() >= n * cols && cols * GROUP < i32::MAX as usize);
    let step = _mm512_set1_epi32(cols as i32);
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let low = _mm512_mullo_epi32(lanes, step);
    let high = _mm512_mullo_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(16)), step);
    for g in 0..acts.groups {
        let rows = acts.lanes(g);
        let (mask_low, mask_high) = (first_lanes(rows), first_lanes(rows.saturating_sub(16)));
        let base = x[g * GROUP * cols..].as_ptr();
        let dst = acts.values[g * cols * GROUP..].as_mut_ptr();
        for c in 0..cols {
            // SAFETY: the unmasked lanes read rows `g × 32 + lane < n`, column `c < cols`, of
            // `x` (length asserted); the stores write column `c` of group `g`, which `reset`
            // sized.
            unsafe {
                let zero = _mm512_setzero_ps();
                let v0 = _mm512_mask_i32gather_ps::<4>(zero, mask_low, low, base.add(c));
                let v1 = _mm512_mask_i32gather_ps::<4>(zero, mask_high, high, base.add(c));
                _mm512_storeu_ps(dst.add(c * GROUP), v0);
                _mm512_storeu_ps(dst.add(c * GROUP + 16), v1);
            }
        }
    }
}

/// f32 values in a 64-byte cache line.
const LINE_VALUES: usize = 16;

/// `R` weight rows × `16 V` activation rows of a group (see [`float_gemm`]): per column, the
/// group's `V` vectors and one broadcast per row, `V × R` FMAs into sums held in registers from
/// `out` back to `out`; with `prefetch_next`, the `R` rows after these are asked for at the
/// same columns meanwhile (the caller's next panel). The caller checked the operands
/// ([`float_gemm::check_operands`]).
#[target_feature(enable = "avx512f")]
fn float_panel<const R: usize, const V: usize>(
    w: &[f32],
    stride: usize,
    cols: usize,
    acts: &[f32],
    out: &mut [f32],
    prefetch_next: bool,
) {
    const { assert!(GROUP == 32 && V <= 2) };
    let (w, acts, out) = (w.as_ptr(), acts.as_ptr(), out.as_mut_ptr());
    let mut sums = [[_mm512_setzero_ps(); V]; R];
    for (j, sums) in sums.iter_mut().enumerate() {
        for (v, sum) in sums.iter_mut().enumerate() {
            // SAFETY: `out` holds `R × GROUP` values (checked by the caller).
            *sum = unsafe { _mm512_loadu_ps(out.add(j * GROUP + v * 16)) };
        }
    }
    for c in 0..cols {
        if prefetch_next && c % LINE_VALUES == 0 {
            // The next `R` rows' values at these columns, a panel ahead: a panel reads each
            // row for a block of columns only, too short a run for the hardware prefetchers to
            // follow, and without this a group's loads wait on memory. A hint: past the matrix
            // it fetches nothing of use, and it never faults.
            for j in R..2 * R {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(j * stride + c).cast());
            }
        }
        // SAFETY: column `c` of `R` rows and of the group lies inside `w` and `acts` (checked
        // by the caller).
        unsafe {
            let mut a = [_mm512_setzero_ps(); V];
            for (v, a) in a.iter_mut().enumerate() {
                *a = _mm512_loadu_ps(acts.add(c * GROUP + v * 16));
            }
            for (j, sums) in sums.iter_mut().enumerate() {
                let b = _mm512_set1_ps(*w.add(j * stride + c));
                for (sum, &a) in sums.iter_mut().zip(a.iter()) {
                    *sum = _mm512_fmadd_ps(a, b, *sum);
                }
            }
        }
    }
    for (j, sums) in sums.iter().enumerate() {
        for (v, &sum) in sums.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm512_storeu_ps(out.add(j * GROUP + v * 16), sum) };
        }
    }
}

/// [`float_gemm::WriteSums`]: per activation row, its sums gathered 16 weight rows at a time
/// and stored with a mask. The caller checked the operands ([`float_gemm::check_sums`]).
#[target_feature(enable = "avx512f")]
fn write_float_sums(sums: &[f32], rows: usize, lanes: usize, out: &mut [f32], stride: usize) {
    let by_row = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(GROUP as i32),
    );
    for t in 0..lanes {
        for first in (0..rows).step_by(16) {
            let mask = first_lanes(rows - first);
            // SAFETY: the unmasked lanes read sums of rows `first + i < rows` (at most
            // `rows × GROUP` values) and write `out[t × stride + first + i]`, inside `out`
            // (both checked by the caller).
            unsafe {
                let at = sums.as_ptr().add(first * GROUP + t);
                let v = _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), mask, by_row, at);
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(t * stride + first), mask, v);
            }
        }
    }
}

/// Whether this CPU runs [`KERNELS`] (AVX-512 VNNI; AVX-VNNI is not needed: Zen 4 has the
/// one without the other).
pub(crate) fn gemv_supported() -> bool {
    supported() && avx2::supported()
}

/// The GEMV kernels with INT4 and INT2 rows on 512-bit registers, two blocks per vector (the
/// activations rearranged by [`super::pair_blocks`]), INT8 rows on the 256-bit EVEX `vpdpbusd`;
/// the float formats as [`avx2::KERNELS`].
pub(crate) static KERNELS: Kernels = Kernels {
    name: "avx512+vnni",
    dot_quant,
    dot_f16: avx2::KERNELS.dot_f16,
    dot_bf16: avx2::KERNELS.dot_bf16,
    dot_f32: avx2::KERNELS.dot_f32,
    widen_f16: avx2::KERNELS.widen_f16,
    widen_bf16: avx2::KERNELS.widen_bf16,
    // SAFETY: `KERNELS` is only chosen when `gemv_supported()` said yes.
    quantize_activations: |x, bits, codes, scales| unsafe {
        quantize_activations(x, bits, codes, scales)
    },
    paired: true,
    dot_quant4: Some(dot_quant4),
    dot_quant_rows: None,
    // SAFETY: `KERNELS` is only chosen when `gemv_supported()` said yes.
    dot_int8_rows: Some(|row, cols, xs, out| unsafe {
        avx2::dot_int8_rows_evex_vnni(row, cols, xs, out)
    }),
    // SAFETY: `KERNELS` is only chosen when `gemv_supported()` said yes.
    dot_f16_rows: Some(|row, x, cols, out| unsafe { avx2::dot_f16_rows_evex(row, x, cols, out) }),
    // SAFETY: `KERNELS` is only chosen when `gemv_supported()` said yes.
    dot_bf16_rows: Some(|row, x, cols, out| unsafe { avx2::dot_bf16_rows_evex(row, x, cols, out) }),
};

fn dot_quant(row: &[u8], bits: QuantBits, cols: usize, x: &QuantRow<'_>) -> f32 {
    match bits {
        // SAFETY (all three): `KERNELS` is only chosen when `gemv_supported()` said yes.
        QuantBits::Int4 => unsafe { dot_paired::<4>(row, cols, x) },
        QuantBits::Int2 => unsafe { dot_paired::<2>(row, cols, x) },
        QuantBits::Int8 => unsafe { avx2::dot_int8_evex_vnni(row, cols, x) },
    }
}

/// How many rows past the last of a group of rows [`dot_paired_rows`] starts prefetching (into
/// L2: `prefetcht1`). Since a group's four pairs take one conversion (BENCHMARKS.md §9.37), the
/// loop outruns `prefetcht0` from 2 rows on (`benches/matmul.rs` "from memory", Zen 4, expert /
/// LM head: 14–16 / 17–18 GiB/s against the old loop's 20 / 21–22); `prefetcht1` from 2 rows on
/// read 18–19 / 19–21, from 4 rows 21–23 / 23–24, from 6 rows 21 / 26, from 8 rows 21–22 /
/// 24–27.
const LEAD: usize = 6;

const LOW4: i64 = 0x0f0f_0f0f_0f0f_0f0f;
const HIGH4: i64 = 0xf0f0_f0f0_f0f0_f0f0_u64 as i64;
const ZP4: i64 = 0x0808_0808_0808_0808;
const ZP_HIGH4: i64 = 0x8080_8080_8080_8080_u64 as i64;

/// INT4 or INT2 rows, two blocks (64 codes: 32 or 16 bytes) per step, on activations
/// rearranged by [`super::pair_blocks`]. The pair's bytes are broadcast from memory into every
/// 128-bit (INT2: 64-bit) lane; one `vpternlogq` keeps in each lane the field its activation
/// unit holds and makes it unsigned where it lies (`(code + z) << shift`), one `vpdpbusd` takes
/// the 64 products, and one FMA applies the pair's 16 activation scales, which
/// [`super::pair_blocks`] divided by each field's place value (exact: powers of two; the i32
/// sums stay below 2^24, so converting them to f32 is exact too). Four vector instructions per
/// 64 codes besides the loads; nothing moves across lanes. INT4 and INT2 activations share
/// one scale per 8 blocks ([`super::scale_group`]), so a row adds four pairs' sums in integers
/// and converts once: 2.5 instructions per 64 codes (only a row's last pairs short of a whole
/// group take the four).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn dot_paired<const BITS: usize>(row: &[u8], cols: usize, x: &QuantRow<'_>) -> f32 {
    dot_paired_rows::<BITS, 1>([row], cols, x)[0]
}

/// [`Kernels::dot_quant4`]: INT4/INT2 rows four at a time, each as [`dot_paired`] computes it;
/// INT8 rows one by one.
fn dot_quant4(rows: [&[u8]; 4], bits: QuantBits, cols: usize, x: &QuantRow<'_>) -> [f32; 4] {
    match bits {
        // SAFETY (all three): `KERNELS` is only chosen when `gemv_supported()` said yes.
        QuantBits::Int4 => unsafe { dot_paired_rows::<4, 4>(rows, cols, x) },
        QuantBits::Int2 => unsafe { dot_paired_rows::<2, 4>(rows, cols, x) },
        QuantBits::Int8 => rows.map(|row| unsafe { avx2::dot_int8_evex_vnni(row, cols, x) }),
    }
}

/// [`dot_paired`] for `R` rows against one activation row: each pair's activation codes and
/// scales are loaded once for all `R` rows (per row and pair, one load of weights instead of
/// three loads), and each row is summed in exactly [`dot_paired`]'s order, so a row's result
/// does not depend on how many rows were computed with it.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
fn dot_paired_rows<const BITS: usize, const R: usize>(
    rows: [&[u8]; R],
    cols: usize,
    x: &QuantRow<'_>,
) -> [f32; R] {
    let full = cols / BLOCK;
    let pairs = full / 2;
    let block_bytes = BLOCK * BITS / 8;
    assert!(rows.iter().all(|row| row.len() >= full * block_bytes));
    assert!(x.codes.len() >= full * BLOCK);
    assert!(x.scales.len() >= full && x.pair_scales.len() >= pairs * 16);
    let w = rows.map(|row| row.as_ptr());
    // Per 64-bit lane, the field it keeps and that field's zero point, in place: INT4 128-bit
    // lanes hold (low a, low b, high a, high b) nibbles; INT2 64-bit lanes (field 0 of a, of b,
    // field 1 of a, …).
    let (field_mask, zero_point) = if BITS == 4 {
        (
            _mm512_set_epi64(HIGH4, HIGH4, HIGH4, HIGH4, LOW4, LOW4, LOW4, LOW4),
            _mm512_set_epi64(ZP_HIGH4, ZP_HIGH4, ZP_HIGH4, ZP_HIGH4, ZP4, ZP4, ZP4, ZP4),
        )
    } else {
        // Lanes 2k and 2k + 1 (blocks a and b) keep field k.
        let per_field = |of: fn(i64) -> i64| {
            _mm512_set_epi64(of(3), of(3), of(2), of(2), of(1), of(1), of(0), of(0))
        };
        (
            per_field(|k| 0x0303_0303_0303_0303 << (2 * k)),
            per_field(|k| 0x0202_0202_0202_0202 << (2 * k)),
        )
    };
    // Pair `p` of every row (past the last whole group): its 16 partial sums times their
    // scales, added to `acc[r]`.
    let step = |p: usize, acc: &mut [__m512; R]| {
        // SAFETY: pair `p` (blocks 2p, 2p + 1) lies inside every row, `x.codes` and
        // `x.pair_scales` (lengths asserted above).
        unsafe {
            let xv = _mm512_loadu_si512(x.codes.as_ptr().add(p * 2 * BLOCK).cast());
            let scales = _mm512_loadu_ps(x.pair_scales.as_ptr().add(p * 16));
            for (w, acc) in w.iter().zip(acc.iter_mut()) {
                let v = if BITS == 4 {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(w.add(p * 32).cast()))
                } else {
                    _mm512_broadcast_i32x4(_mm_loadu_si128(w.add(p * 16).cast()))
                };
                // (v & mask) ^ z: each lane's two's-complement field plus z, in place.
                let unsigned = _mm512_ternarylogic_epi64::<0x6a>(v, field_mask, zero_point);
                let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), unsigned, xv);
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scales, *acc);
            }
        }
    };
    // A quad of pairs (8 blocks) is one scale group (`scale_group`), so the integer sums of its
    // four pairs are added in one register per row before one conversion and one FMA, into
    // `acc[r]` (the i32 sums stay below 2^24: 16 products of at most 3 × 64 × 128 for INT2,
    // 15 × 16 × 128 for INT4). One accumulator per row: with several picked by the quad's
    // number they were kept on the stack, a store and a load around every FMA (the INT2 expert
    // in cache read 16.5 GiB/s that way, 19.9 this way).
    let group_step = |p: usize, acc: &mut [__m512; R]| {
        // SAFETY: pairs `p .. p + 4` lie inside every row, `x.codes` and `x.pair_scales`
        // (lengths asserted above).
        unsafe {
            let mut sums = [_mm512_setzero_si512(); R];
            for i in 0..4 {
                let xv = _mm512_loadu_si512(x.codes.as_ptr().add((p + i) * 2 * BLOCK).cast());
                for (w, sums) in w.iter().zip(sums.iter_mut()) {
                    let v = if BITS == 4 {
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(w.add((p + i) * 32).cast()))
                    } else {
                        _mm512_broadcast_i32x4(_mm_loadu_si128(w.add((p + i) * 16).cast()))
                    };
                    let unsigned = _mm512_ternarylogic_epi64::<0x6a>(v, field_mask, zero_point);
                    *sums = _mm512_dpbusd_epi32(*sums, unsigned, xv);
                }
            }
            // Every pair of the group has the same 16 scales.
            let scales = _mm512_loadu_ps(x.pair_scales.as_ptr().add(p * 16));
            for (sums, acc) in sums.iter().zip(acc.iter_mut()) {
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(*sums), scales, *acc);
            }
        }
    };
    const { assert!(super::scale_group(QuantBits::Int2) == 8) };
    const { assert!(super::scale_group(QuantBits::Int4) == 8) };
    let mut acc = [_mm512_setzero_ps(); R];
    let quads = pairs / 4;
    for q in 0..quads {
        let p = q * 4;
        // The next rows of a large matrix are far from the caches: ask for them early. One
        // row: 2 KiB ahead of where it is read. Several (consecutive in the matrix): the bytes
        // from `LEAD` rows after the last of them on, in address order, as fast as the rows
        // are read together (four streams a row apart, each 2 KiB ahead of itself, kept the
        // memory less busy than one row did: the repeated INT4 LM head read 8.7 GiB/s that way
        // against 13.2 with one row and 21.6 this way).
        if R == 1 {
            let ahead = w[0].wrapping_add(p * 2 * block_bytes + avx2::PREFETCH_AHEAD);
            _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
            if BITS == 4 {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
            }
        } else {
            let quad_bytes = 4 * 2 * block_bytes;
            let next = w[R - 1].wrapping_add(LEAD * rows[R - 1].len() + q * R * quad_bytes);
            for line in (0..R * quad_bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(line).cast());
            }
        }
        group_step(p, &mut acc);
    }
    for p in quads * 4..pairs {
        step(p, &mut acc);
    }
    let bits = if BITS == 4 {
        QuantBits::Int4
    } else {
        QuantBits::Int2
    };
    std::array::from_fn(|r| {
        let mut sum = _mm512_reduce_add_ps(acc[r]) - x.offset;
        // A last odd whole block, unpaired: its offset share is in `x.offset`, so it is summed
        // signed plus the zero point, as the pairs are.
        if full % 2 == 1 {
            let b = full - 1;
            let block = &x.codes[b * BLOCK..(b + 1) * BLOCK];
            let z = super::zero_point(bits);
            let plus_zero: i32 = block.iter().map(|&c| z * i32::from(c)).sum();
            let signed = scalar::block_sum(rows[r], bits, cols, b, x.codes);
            sum += x.scales[b] * (signed + plus_zero) as f32;
        }
        if full * BLOCK < cols {
            sum += x.scales[full] * scalar::block_sum(rows[r], bits, cols, full, x.codes) as f32;
        }
        sum
    })
}

/// [`scalar::quantize_activations`] (the GEMV's activation rounding, and the integer GEMM's),
/// 32 values at a time: the same codes and scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn quantize_activations(x: &[f32], bits: QuantBits, codes: &mut [i8], scales: &mut [f32]) {
    let blocks = x.len().div_ceil(BLOCK);
    assert!(codes.len() >= blocks * BLOCK && scales.len() >= blocks);
    let order = BlockOrder::new(bits);
    block_scales(x, bits, &mut scales[..blocks]);
    for (b, &d) in scales.iter().enumerate().take(blocks) {
        let block = round_block(x, b, d, &order);
        // SAFETY: block `b`'s 32 codes (length asserted above).
        unsafe { _mm256_storeu_si256(codes.as_mut_ptr().add(b * BLOCK).cast(), block) };
    }
}

/// Where each position of a block in [`super::block_order`] takes its value from, as two
/// permutation vectors over the block's two halves (unused for INT8, which keeps its order).
struct BlockOrder {
    first_half: __m512i,
    second_half: __m512i,
    reorder: bool,
}

impl BlockOrder {
    #[target_feature(enable = "avx512f")]
    fn new(bits: QuantBits) -> BlockOrder {
        // Output position p of a block takes element `source[p]`.
        let mut source = [0i32; BLOCK];
        for i in 0..BLOCK {
            source[super::block_order(bits, i)] = i as i32;
        }
        // SAFETY: 16 + 16 values of a 32-value array.
        unsafe {
            BlockOrder {
                first_half: _mm512_loadu_si512(source.as_ptr().cast()),
                second_half: _mm512_loadu_si512(source.as_ptr().add(16).cast()),
                reorder: bits != QuantBits::Int8,
            }
        }
    }
}

/// The values of block `b` of an activation row, as two 16-lane vectors (zero past the row's
/// end).
#[target_feature(enable = "avx512f")]
fn block_values(row: &[f32], b: usize) -> (__m512, __m512) {
    let first = b * BLOCK;
    let len = BLOCK.min(row.len() - first);
    // SAFETY: the masks cover values `first .. first + len` of the row only.
    unsafe {
        (
            _mm512_maskz_loadu_ps(mask_of(len), row.as_ptr().add(first)),
            _mm512_maskz_loadu_ps(
                mask_of(len.saturating_sub(16)),
                row.as_ptr().wrapping_add(first + 16),
            ),
        )
    }
}

/// The scale of each block of an activation row (`scales.len()` blocks): `max|x| / 127` over
/// its [`super::scale_group`], the same division as the scalar reference (a maximum is exact
/// in any order).
#[target_feature(enable = "avx512f")]
fn block_scales(row: &[f32], bits: QuantBits, scales: &mut [f32]) {
    let group = super::scale_group(bits);
    for (g, scales) in scales.chunks_mut(group).enumerate() {
        let first = g * group;
        let max = (first..first + scales.len()).fold(0f32, |m, b| {
            let (a, c) = block_values(row, b);
            m.max(_mm512_reduce_max_ps(_mm512_max_ps(
                _mm512_abs_ps(a),
                _mm512_abs_ps(c),
            )))
        });
        scales.fill(max / 127.0);
    }
}

/// Block `b` of an activation row rounded to INT8 at scale `d`: its 32 signed codes in block
/// order, rounded half away from zero by truncating and comparing the remainder (as
/// [`super::scalar`] does), narrowed with saturation; values past the row's end are zero.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn round_block(row: &[f32], b: usize, d: f32, order: &BlockOrder) -> __m256i {
    let (a, c) = block_values(row, b);
    let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
    let (a, c) = if order.reorder {
        (
            _mm512_permutex2var_ps(a, order.first_half, c),
            _mm512_permutex2var_ps(a, order.second_half, c),
        )
    } else {
        (a, c)
    };
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
    let inverse = _mm512_set1_ps(inverse);
    let low = _mm512_cvtsepi32_epi8(round(_mm512_mul_ps(a, inverse)));
    let high = _mm512_cvtsepi32_epi8(round(_mm512_mul_ps(c, inverse)));
    _mm256_set_m128i(high, low)
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
    gemm::check_operands(w, x, out, gemm::ActLayout::Unsigned);
    // SAFETY: the operands passed `check_operands`.
    unsafe { gemm::by_scale_group!(w.group, tiles(w, x, out)) }
}

/// [`gemm_quant`] for scale groups of `GROUP` blocks ([`gemm::by_scale_group`]).
///
/// # Safety
/// The operands passed [`gemm::check_operands`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn tiles<const GROUP: usize>(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    let mut r = 0;
    while r < w.rows {
        let rows = (w.rows - r).min(MAX_ROWS);
        let mut g = 0;
        while g < x.groups {
            let groups = (x.groups - g).min(2);
            // SAFETY: rows r..r + rows and groups g..g + groups lie inside the operands and
            // `out`, whose lengths `check_operands` asserted.
            unsafe {
                match (groups, rows) {
                    (2, 6) => tile::<2, 6, GROUP>(w, x, r, g, out),
                    (2, 5) => tile::<2, 5, GROUP>(w, x, r, g, out),
                    (2, 4) => tile::<2, 4, GROUP>(w, x, r, g, out),
                    (2, 3) => tile::<2, 3, GROUP>(w, x, r, g, out),
                    (2, 2) => tile::<2, 2, GROUP>(w, x, r, g, out),
                    (2, _) => tile::<2, 1, GROUP>(w, x, r, g, out),
                    (_, 6) => tile::<1, 6, GROUP>(w, x, r, g, out),
                    (_, 5) => tile::<1, 5, GROUP>(w, x, r, g, out),
                    (_, 4) => tile::<1, 4, GROUP>(w, x, r, g, out),
                    (_, 3) => tile::<1, 3, GROUP>(w, x, r, g, out),
                    (_, 2) => tile::<1, 2, GROUP>(w, x, r, g, out),
                    _ => tile::<1, 1, GROUP>(w, x, r, g, out),
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
unsafe fn tile<const G: usize, const R: usize, const GROUP: usize>(
    w: &GemmRows<'_>,
    x: &GemmActs,
    r0: usize,
    g0: usize,
    out: &mut [f32],
) {
    // SAFETY: see the function's contract; every offset below stays inside rows r0..r0 + R of
    // `w` and groups g0..g0 + G of `x`.
    unsafe {
        let group = if GROUP == 0 { w.group } else { GROUP };
        let (blocks, scale_groups) = (w.blocks, w.blocks.div_ceil(group));
        let width = blocks * BLOCK;
        let stride = x.groups * LANES;
        let weights = w.codes.as_ptr().add(r0 * width);
        let acts = x.codes.as_ptr().add(g0 * width * LANES);
        let bias = w.bias.as_ptr().add(r0 * scale_groups);
        let act_scales = x.scales.as_ptr().add(g0 * blocks * LANES);
        let mut sums = [[_mm512_setzero_ps(); R]; G];
        for sg in 0..scale_groups {
            let (first, end) = (sg * group, ((sg + 1) * group).min(blocks));
            let mut ints = [[_mm512_setzero_si512(); R]; G];
            for j in 0..R {
                let start = _mm512_set1_epi32(*bias.add(j * scale_groups + sg));
                for int in ints.iter_mut() {
                    int[j] = start;
                }
            }
            // Block by block, each block's eight steps unrolled.
            for b in first..end {
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
            }
            for h in 0..G {
                let scale = _mm512_loadu_ps(act_scales.add((h * blocks + first) * LANES));
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
