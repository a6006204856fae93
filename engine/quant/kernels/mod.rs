//! Kernels, one file per instruction set: the [`scalar`] reference, AVX2 (+FMA, F16C) on x86_64
//! (plus AVX-VNNI where the CPU has it, and AVX-512 VNNI for the integer GEMM and INT2 rows) and
//! NEON on aarch64 (ARMv8.0, plus `dotprod` where the CPU has it).
//!
//! Three families:
//! - dequantization (packed rows → f32, `q × scale`, one multiplication, no fused multiply-add,
//!   so all kernels agree bit for bit);
//! - dot products of one stored row with one activation row, used by
//!   [`crate::quant::matrix`]: f16/bf16 rows with f32 activations, and integer rows with INT8
//!   activation blocks of [`BLOCK`] values;
//! - an integer GEMM for many activation rows against integer weights ([`gemm`]: layouts and
//!   the scalar reference; AVX-512 VNNI in [`avx512`]), where the CPU has one.
//!
//! Activation blocks of the dot products are stored in the order the SIMD kernels unpack weights, so no kernel
//! shuffles in its inner loop: see [`block_order`].

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod gemm;
#[cfg(target_arch = "aarch64")]
pub(crate) mod neon;
pub(crate) mod scalar;

use std::sync::OnceLock;

use crate::quant::QuantBits;

/// Values per activation block (one f32 scale each).
pub(crate) const BLOCK: usize = 32;

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
    /// One per block.
    pub scales: &'a [f32],
    /// `z × Σ_b scales[b] × Σ_{i∈b} codes[i]` over the whole blocks, with `z` the zero point of
    /// unsigned weight codes (8 for INT4, 2 for INT2, 0 for INT8): kernels that multiply
    /// `code + z` (unsigned, for `maddubs`) subtract it once per row. (The NEON kernels take
    /// signed codes and do not need it.)
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub offset: f32,
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
/// `Σ_i w[i] · x[i]` over a stored float row (16-bit, or f32 for [`Kernels::dot_f32`]).
pub(crate) type DotFloat = fn(&[u8], &[f32]) -> f32;

/// One instruction set's dot-product kernels.
pub(crate) struct Kernels {
    pub name: &'static str,
    pub dot_quant: DotQuant,
    pub dot_f16: DotFloat,
    pub dot_bf16: DotFloat,
    pub dot_f32: DotFloat,
}

pub(crate) static SCALAR: Kernels = Kernels {
    name: "scalar",
    dot_quant: scalar::dot_quant,
    dot_f16: scalar::dot_f16,
    dot_bf16: scalar::dot_bf16,
    dot_f32: scalar::dot_f32,
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

/// The fastest kernel set this CPU can run (detected once).
pub(crate) fn best() -> &'static Kernels {
    static BEST: OnceLock<&'static Kernels> = OnceLock::new();
    BEST.get_or_init(|| *available().last().expect("the scalar set is always there"))
}

/// The integer GEMM kernel this CPU runs, if any (detected once). Without one, many-row products
/// on integer weights take dequantized tiles and libtorch's f32 GEMM; `EDGEMOE_INT_GEMM=off`
/// asks for that path on any CPU (to compare the two on one machine).
pub(crate) fn int_gemm() -> Option<&'static gemm::IntGemm> {
    static INT_GEMM: OnceLock<Option<&'static gemm::IntGemm>> = OnceLock::new();
    *INT_GEMM.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if avx512::supported() && std::env::var_os("EDGEMOE_INT_GEMM").is_none_or(|v| v != "off") {
            return Some(&avx512::INT_GEMM);
        }
        None
    })
}
