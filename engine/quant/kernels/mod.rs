//! Kernels, one file per instruction set: the [`scalar`] reference, AVX2 (+FMA, F16C) on x86_64
//! (plus AVX-VNNI where the CPU has it, and AVX-512 VNNI for the integer GEMM and INT2 rows) and
//! NEON on aarch64 (ARMv8.0, plus `dotprod` where the CPU has it).
//!
//! Four families:
//! - dequantization (packed rows → f32, `q × scale`, one multiplication, no fused multiply-add,
//!   so all kernels agree bit for bit);
//! - dot products of one stored row with one activation row, used by
//!   [`crate::quant::matrix`]: f16/bf16 rows with f32 activations, and integer rows with INT8
//!   activation blocks of [`BLOCK`] values;
//! - an integer GEMM for many activation rows against integer weights ([`gemm`]: layouts and
//!   the scalar reference; AVX-512 VNNI in [`avx512`], `vpmaddubsw` in [`avx2`], `sdot` and
//!   `smmla` in [`neon`]), where the CPU has one;
//! - a float GEMM for an expert's share of many activation rows against float weights
//!   ([`float_gemm`]: layout and the scalar reference; AVX-512 in [`avx512`], AVX2 in
//!   [`avx2`]), where the CPU has one.
//!
//! Activation blocks of the dot products are stored in the order the SIMD kernels unpack
//! weights, so no kernel shuffles in its inner loop: see [`block_order`], and [`pair_blocks`]
//! for the 512-bit set, which takes two blocks per vector.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod float_gemm;
pub(crate) mod gemm;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
pub(crate) mod scalar;

use std::sync::OnceLock;

use crate::quant::QuantBits;

/// Asks for the `len` bytes from `start` on ahead of their use, one prefetch per cache line, on
/// CPUs whose hardware prefetchers lag behind a stream of rows (see
/// [`avx2::prefetch_wide_rows`]); nothing elsewhere. A hint only: `start` need not point into
/// anything readable.
#[inline(always)]
pub(crate) fn prefetch_bytes(start: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if avx2::prefetch_wide_rows() {
        for line in (0..len).step_by(64) {
            // SAFETY: a prefetch is a hint that never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    start.wrapping_add(line).cast(),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (start, len);
}

/// Values per activation block (one f32 scale each).
pub(crate) const BLOCK: usize = 32;

/// How many consecutive activation blocks share one scale for weights of `bits`: 8 for INT2
/// and INT4 (256 values, as llama.cpp's `Q8_K` rounds the activations of its 2- to 6-bit
/// formats), 1 for INT8. Blocks still carry one scale each (equal within a group), so every
/// kernel reads them as before; the AVX-512 INT2/INT4 kernel adds a group's integer sums before
/// it converts them, which is what lets it keep up with memory (one conversion and one FMA per
/// 256 values instead of per 64). An INT2 or INT4 weight's error is far above that of a coarser
/// activation scale (BENCHMARKS §9.10, §9.37).
pub(crate) const fn scale_group(bits: QuantBits) -> usize {
    match bits {
        QuantBits::Int2 | QuantBits::Int4 => 8,
        QuantBits::Int8 => 1,
    }
}

/// Where element `i` (0..32) of a block sits in the activation codes for weights of `bits`:
/// INT8 in order; INT4 even elements (low nibbles) first, then odd ones (high nibbles); INT2
/// elements by their field in the byte (`4k + j` at `8j + k`).
#[inline(always)]
pub(crate) fn block_order(bits: QuantBits, i: usize) -> usize {
    match bits {
        QuantBits::Int8 => i,
        QuantBits::Int4 => (i % 2) * 16 + i / 2,
        QuantBits::Int2 => (i % 4) * 8 + i / 4,
    }
}

/// One activation row rounded to INT8 blocks, for a weight format.
pub(crate) struct QuantRow<'a> {
    /// Codes in [`block_order`] for the weights' bits, zero past the row's end.
    pub codes: &'a [i8],
    /// One per block (equal within a [`scale_group`]).
    pub scales: &'a [f32],
    /// `z × Σ_b scales[b] × Σ_{i∈b} codes[i]` over the whole blocks, with `z` the zero point of
    /// unsigned weight codes (8 for INT4, 2 for INT2, 0 for INT8): kernels that multiply
    /// `code + z` (unsigned, for `maddubs`) subtract it once per row. (The NEON kernels take
    /// signed codes and do not need it.)
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub offset: f32,
    /// For a [`Kernels::paired`] set and INT4/INT2 weights: 16 scales per pair of whole blocks,
    /// laid out as the pair's 16 i32 sums come out of one `vpdpbusd` (see [`pair_blocks`]);
    /// empty otherwise.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub pair_scales: &'a [f32],
}

/// For a [`Kernels::paired`] set: how many bytes of one block's codes stay together when two
/// blocks share a 64-byte vector. INT4 16 (the low nibbles' values, then the high ones'), INT2
/// 8 (one 2-bit field's values); INT8 rows are not paired.
pub(crate) fn pair_unit(bits: QuantBits) -> Option<usize> {
    match bits {
        QuantBits::Int8 => None,
        QuantBits::Int4 => Some(16),
        QuantBits::Int2 => Some(8),
    }
}

/// Rearranges one activation row (codes in [`block_order`], one scale per block) for a
/// [`Kernels::paired`] set: the codes of whole blocks `2p` and `2p + 1` are interleaved in
/// units of [`pair_unit`] bytes (`a0 b0 a1 b1 …`), which is where a 64-byte vector of the two
/// blocks' weights, broadcast from memory, holds the fields they multiply. `pair_scales` gets,
/// per pair, for each of the 16 i32 sums of that vector, the scale of its block divided by the
/// place value of its field in the weight bytes (1, 16 for INT4's high nibbles; 1, 4, 16, 64
/// for INT2's fields): the kernel multiplies each field where it lies, unshifted. A last odd
/// block and the partial block stay as they were.
pub(crate) fn pair_blocks(
    bits: QuantBits,
    codes: &mut [i8],
    scales: &[f32],
    full: usize,
    pair_scales: &mut [f32],
) {
    let Some(unit) = pair_unit(bits) else {
        return;
    };
    let pairs = full / 2;
    assert!(codes.len() >= pairs * 2 * BLOCK && pair_scales.len() >= pairs * 16);
    for (p, (pair, lanes)) in codes
        .chunks_exact_mut(2 * BLOCK)
        .zip(pair_scales.chunks_exact_mut(16))
        .take(pairs)
        .enumerate()
    {
        let plain: [i8; 2 * BLOCK] = pair.try_into().expect("a pair is 64 codes");
        for (u, dst) in pair.chunks_exact_mut(unit).enumerate() {
            let (block, k) = (u % 2, u / 2);
            dst.copy_from_slice(&plain[block * BLOCK + k * unit..][..unit]);
        }
        let field_bits = bits.bits() as usize;
        for (i, lane) in lanes.iter_mut().enumerate() {
            let u = 4 * i / unit;
            let place = (1u32 << (field_bits * (u / 2))) as f32;
            *lane = scales[2 * p + u % 2] / place;
        }
    }
}

/// The width of a kernel specialised by its bits (`BITS` 8, 4 or 2).
pub(crate) const fn bits_of(bits: usize) -> QuantBits {
    match bits {
        8 => QuantBits::Int8,
        4 => QuantBits::Int4,
        _ => QuantBits::Int2,
    }
}

/// Zero point the AVX2 kernels add to INT4/INT2 codes to make them unsigned.
pub(crate) fn zero_point(bits: QuantBits) -> i32 {
    match bits {
        QuantBits::Int8 => 0,
        QuantBits::Int4 => 8,
        QuantBits::Int2 => 2,
    }
}

/// `Σ_b x_scale[b] × Σ_{i∈b} w[i] · x_q[i]` over a packed integer row of `cols` values.
pub(crate) type DotQuant = fn(&[u8], QuantBits, usize, &QuantRow<'_>) -> f32;
/// [`DotQuant`] for four rows of one matrix at once (sharing the activations' loads), each
/// result bit for bit the one [`DotQuant`] of the same set gives that row.
pub(crate) type DotQuant4 = fn([&[u8]; 4], QuantBits, usize, &QuantRow<'_>) -> [f32; 4];
/// [`DotQuant`] of consecutive rows of one matrix (`rows`: `out.len()` packed rows) with one
/// activation row, each times its row's scale: `out[r] = row_scales[r] × dot(row r)`, bit for
/// bit [`DotQuant`] of the same set row by row, with the width matched once instead of per row
/// (on short rows, the dispatch and checks around each row cost as much as a few blocks).
pub(crate) type DotQuantRows = fn(&[u8], QuantBits, usize, &QuantRow<'_>, &[f32], &mut [f32]);
/// [`DotQuant`] of one INT8 row with several activation rows (`out[i]` for `xs[i]`), each
/// weight block loaded once for all of them; each result bit for bit the one [`DotQuant`] of
/// the same set gives (beams, where the products are bound by arithmetic, not memory).
pub(crate) type DotInt8Rows = fn(&[u8], usize, &[QuantRow<'_>], &mut [f32]);
/// `Σ_i w[i] · x[i]` over a stored float row (16-bit, or f32 for [`Kernels::dot_f32`]).
pub(crate) type DotFloat = fn(&[u8], &[f32]) -> f32;
/// [`DotFloat`] of one f16 row with several activation rows of `cols` values (`x`, one
/// after another; `out[i]` for row `i`), each weight value widened once for all of them; each
/// result bit for bit the one [`DotFloat`] of the same set gives.
pub(crate) type DotFloatRows = fn(&[u8], &[f32], usize, &mut [f32]);

/// How many of `left` activation rows a several-row kernel takes in its next pass: `most`
/// (the rows whose accumulators fit its registers), else 2, else 1. The kernels loop over the
/// passes themselves rather than hand a closure to a helper: closures do not take on the target
/// features of the function they are written in.
pub(crate) fn rows_per_pass(left: usize, most: usize) -> usize {
    if left >= most {
        most
    } else if left >= 2 {
        2
    } else {
        1
    }
}

/// 16-bit floats (little-endian bytes, two per value) widened to f32, exactly: a GEMM tile of
/// f16 or bf16 weights.
pub(crate) type Widen = fn(&[u8], &mut [f32]);

/// Codes in [`block_order`] and one scale per block of an f32 activation row.
pub(crate) type QuantizeActivations = fn(&[f32], QuantBits, &mut [i8], &mut [f32]);

/// One instruction set's dot-product kernels.
pub(crate) struct Kernels {
    pub name: &'static str,
    pub dot_quant: DotQuant,
    pub dot_f16: DotFloat,
    pub dot_bf16: DotFloat,
    pub dot_f32: DotFloat,
    pub widen_f16: Widen,
    pub widen_bf16: Widen,
    /// Rounds an activation row to INT8 blocks: [`scalar::quantize_activations`]'s codes and
    /// scales, however computed.
    pub quantize_activations: QuantizeActivations,
    /// Whether `dot_quant` takes INT4/INT2 activations rearranged by [`pair_blocks`].
    pub paired: bool,
    /// Four rows at once, where the set has such a kernel.
    pub dot_quant4: Option<DotQuant4>,
    /// Rows one after another with one dispatch, where the set has such a kernel.
    pub dot_quant_rows: Option<DotQuantRows>,
    /// One INT8 row with several activation rows at once, where the set has such a kernel.
    pub dot_int8_rows: Option<DotInt8Rows>,
    /// One f16 row with several activation rows at once, where the set has such a kernel.
    pub dot_f16_rows: Option<DotFloatRows>,
    /// The same for bf16 rows: NEON, and AVX-512 VL's four rows per pass (on AVX2 alone,
    /// whose sixteen registers allow two, widening bf16 takes two instructions and the loop
    /// measured slower than row by row, BENCHMARKS.md §9.14).
    pub dot_bf16_rows: Option<DotFloatRows>,
}

pub(crate) static SCALAR: Kernels = Kernels {
    name: "scalar",
    dot_quant: scalar::dot_quant,
    dot_f16: scalar::dot_f16,
    dot_bf16: scalar::dot_bf16,
    dot_f32: scalar::dot_f32,
    widen_f16: scalar::widen_f16,
    widen_bf16: scalar::widen_bf16,
    quantize_activations: scalar::quantize_activations,
    paired: false,
    dot_quant4: None,
    dot_quant_rows: None,
    dot_int8_rows: None,
    dot_f16_rows: None,
    dot_bf16_rows: None,
};

/// Every kernel set this CPU can run, the scalar reference first.
pub(crate) fn available() -> Vec<&'static Kernels> {
    let mut sets = vec![&SCALAR];
    #[cfg(target_arch = "x86_64")]
    if avx2::supported() {
        sets.push(&avx2::KERNELS);
        if avx2::vnni_supported() {
            sets.push(&avx2::KERNELS_VNNI);
        }
        if avx512::gemv_supported() {
            sets.push(&avx512::KERNELS);
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        sets.push(&neon::KERNELS);
        if neon::dotprod_supported() {
            sets.push(&neon::KERNELS_DOTPROD);
        }
    }
    sets
}

/// The fastest kernel set this CPU can run (detected once), or the one that
/// `EDGEMOE_KERNELS=NAME` names among those it can run (to measure one set against another on
/// one machine: `avx2` on an AVX-512 CPU, say); a name it cannot run is ignored with a warning.
pub(crate) fn best() -> &'static Kernels {
    static BEST: OnceLock<&'static Kernels> = OnceLock::new();
    BEST.get_or_init(|| {
        let sets = available();
        let fastest = *sets.last().expect("the scalar set is always there");
        let Some(wanted) = std::env::var_os("EDGEMOE_KERNELS") else {
            return fastest;
        };
        match sets.iter().find(|k| wanted == k.name) {
            Some(k) => k,
            None => {
                let names: Vec<&str> = sets.iter().map(|k| k.name).collect();
                eprintln!(
                    "warning: EDGEMOE_KERNELS={} is not a kernel set this CPU runs ({}); using {}",
                    wanted.to_string_lossy(),
                    names.join(", "),
                    fastest.name
                );
                fastest
            }
        }
    })
}

/// Every float GEMM kernel this CPU can run, the fastest last.
pub(crate) fn float_gemms() -> Vec<&'static float_gemm::FloatGemm> {
    #[allow(unused_mut)]
    let mut kernels = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::supported() {
            kernels.push(&avx2::FLOAT_GEMM);
        }
        if avx512::float_gemm_supported() {
            kernels.push(&avx512::FLOAT_GEMM);
        }
    }
    kernels
}

/// The float GEMM kernel this CPU runs, if any (detected once). Without one, many-row products
/// on float weights (and on integer weights without [`int_gemm`]) take tiles and libtorch's f32
/// GEMM; `EDGEMOE_FLOAT_GEMM=off` asks for that path on any CPU (to compare the two).
pub(crate) fn float_gemm() -> Option<&'static float_gemm::FloatGemm> {
    static FLOAT_GEMM: OnceLock<Option<&'static float_gemm::FloatGemm>> = OnceLock::new();
    *FLOAT_GEMM.get_or_init(|| {
        if std::env::var_os("EDGEMOE_FLOAT_GEMM").is_some_and(|v| v == "off") {
            return None;
        }
        float_gemms().last().copied()
    })
}

/// Every integer GEMM kernel this CPU can run, the fastest last.
pub(crate) fn int_gemms() -> Vec<&'static gemm::IntGemm> {
    #[allow(unused_mut)]
    let mut kernels = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        if avx2::supported() {
            kernels.push(&avx2::INT_GEMM);
        }
        if avx512::supported() {
            kernels.push(&avx512::INT_GEMM);
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if neon::dotprod_supported() {
            kernels.push(&neon::INT_GEMM_DOTPROD);
        }
        if neon::i8mm_supported() {
            kernels.push(&neon::INT_GEMM_I8MM);
        }
    }
    kernels
}

/// The integer GEMM kernel this CPU runs, if any (detected once). Without one, many-row products
/// on integer weights take dequantized tiles and libtorch's f32 GEMM; `EDGEMOE_INT_GEMM=off`
/// asks for that path on any CPU (to compare the two on one machine), and `EDGEMOE_INT_GEMM=NAME`
/// for a named kernel the CPU has instead of its fastest (`avx2` on an AVX-512 CPU, say); a name
/// it cannot run is ignored with a warning.
pub(crate) fn int_gemm() -> Option<&'static gemm::IntGemm> {
    static INT_GEMM: OnceLock<Option<&'static gemm::IntGemm>> = OnceLock::new();
    *INT_GEMM.get_or_init(|| {
        let kernels = int_gemms();
        let fastest = kernels.last().copied();
        let Some(wanted) = std::env::var_os("EDGEMOE_INT_GEMM") else {
            return fastest;
        };
        if wanted == "off" {
            return None;
        }
        let named = kernels.iter().find(|k| wanted == k.name).copied();
        if named.is_none() {
            let names: Vec<&str> = kernels.iter().map(|k| k.name).collect();
            eprintln!(
                "warning: EDGEMOE_INT_GEMM={} is neither off nor an integer GEMM this CPU runs \
                 ({}); using {}",
                wanted.to_string_lossy(),
                names.join(", "),
                fastest.map_or("none", |k| k.name)
            );
        }
        named.or(fastest)
    })
}
