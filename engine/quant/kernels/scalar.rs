//! The scalar reference kernels: dequantization (every other kernel matches it bit for bit) and
//! dot products (others match its integer block sums exactly, its float sums within rounding).
//! They are also the SIMD kernels' tails, for the part of a row that does not fill a step.

use super::{block_order, QuantRow, BLOCK};
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

/// Code of element `e` of a packed integer row.
#[inline(always)]
pub(crate) fn element(row: &[u8], bits: QuantBits, e: usize) -> i8 {
    match bits {
        QuantBits::Int8 => row[e] as i8,
        QuantBits::Int4 => code::<4>(row[e / 2], e % 2),
        QuantBits::Int2 => code::<2>(row[e / 4], e % 4),
    }
}

/// Rounds an activation row to INT8 blocks of [`BLOCK`] values: `scales[b] = max|x| / 127` over
/// the block's [`super::scale_group`], codes `round(x / scale)` placed in [`block_order`] for
/// `bits` (padding codes stay zero).
pub(crate) fn quantize_activations(
    x: &[f32],
    bits: QuantBits,
    codes: &mut [i8],
    scales: &mut [f32],
) {
    let group = super::scale_group(bits);
    for ((values, codes), scales) in x
        .chunks(group * BLOCK)
        .zip(codes.chunks_mut(group * BLOCK))
        .zip(scales.chunks_mut(group))
    {
        let d = values.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
        let inverse = if d > 0.0 { 1.0 / d } else { 0.0 };
        for ((values, block), scale) in values
            .chunks(BLOCK)
            .zip(codes.chunks_exact_mut(BLOCK))
            .zip(scales.iter_mut())
        {
            *scale = d;
            for (i, &v) in values.iter().enumerate() {
                block[block_order(bits, i)] = round_code(v * inverse);
            }
        }
    }
}

/// `v.round() as i8` for `|v| ≤ 2²³` (halves away from zero, saturating) without a call to `roundf`
/// (x86_64's baseline has no rounding instruction): `v − trunc(v)` is exact at this size.
#[inline(always)]
fn round_code(v: f32) -> i8 {
    let t = v as i32;
    let fraction = v - t as f32;
    // Branch-free: the comparisons' outcomes are as random as the activations.
    let q = t + i32::from(fraction >= 0.5) - i32::from(fraction <= -0.5);
    q.clamp(i8::MIN.into(), i8::MAX.into()) as i8
}

/// The integer sum of block `b` of a packed row of `cols` values with its activation codes.
#[inline]
pub(crate) fn block_sum(row: &[u8], bits: QuantBits, cols: usize, b: usize, codes: &[i8]) -> i32 {
    let first = b * BLOCK;
    (0..BLOCK.min(cols - first))
        .map(|i| {
            i32::from(element(row, bits, first + i))
                * i32::from(codes[first + block_order(bits, i)])
        })
        .sum()
}

/// The reference [`super::DotQuant`] (signed codes: the row's offset is not used).
pub(crate) fn dot_quant(row: &[u8], bits: QuantBits, cols: usize, x: &QuantRow<'_>) -> f32 {
    (0..cols.div_ceil(BLOCK)).fold(0f32, |sum, b| {
        sum + x.scales[b] * block_sum(row, bits, cols, b, x.codes) as f32
    })
}

/// `src`'s f16 values as f32 (`src` holds `2 × out.len()` bytes): the reference
/// [`super::Widen`].
pub(crate) fn widen_f16(src: &[u8], out: &mut [f32]) {
    widen(src, out, |b| half::f16::from_le_bytes(b).to_f32());
}

/// `src`'s bf16 values as f32 (`src` holds `2 × out.len()` bytes).
pub(crate) fn widen_bf16(src: &[u8], out: &mut [f32]) {
    widen(src, out, |b| half::bf16::from_le_bytes(b).to_f32());
}

fn widen(src: &[u8], out: &mut [f32], value: impl Fn([u8; 2]) -> f32) {
    assert_eq!(
        src.len(),
        out.len() * 2,
        "16-bit floats for {} values",
        out.len()
    );
    for (o, b) in out.iter_mut().zip(src.as_chunks::<2>().0) {
        *o = value(*b);
    }
}

/// The reference [`super::DotFloat`] for f16 rows.
pub(crate) fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    row.as_chunks::<2>()
        .0
        .iter()
        .zip(x)
        .fold(0f32, |s, (b, &x)| {
            s + half::f16::from_le_bytes(*b).to_f32() * x
        })
}

/// The reference [`super::DotFloat`] for bf16 rows.
pub(crate) fn dot_bf16(row: &[u8], x: &[f32]) -> f32 {
    row.as_chunks::<2>()
        .0
        .iter()
        .zip(x)
        .fold(0f32, |s, (b, &x)| {
            s + half::bf16::from_le_bytes(*b).to_f32() * x
        })
}

/// The several-row 16-bit kernels' scalar part: adds to `dots[i]` the dot of `row`'s values
/// `head..cols` with those of activation row `first + i` of `x` (rows of `cols` values), as
/// [`dot_f16`] (or, where `bf16`, [`dot_bf16`]) computes a one-row kernel's tail.
pub(crate) fn add_half_tails(
    row: &[u8],
    x: &[f32],
    cols: usize,
    head: usize,
    first: usize,
    bf16: bool,
    dots: &mut [f32],
) {
    for (i, dot) in dots.iter_mut().enumerate() {
        let x = &x[(first + i) * cols..][head..cols];
        let row = &row[head * 2..];
        *dot += if bf16 {
            dot_bf16(row, x)
        } else {
            dot_f16(row, x)
        };
    }
}

/// `Σ w[i] · x[i]` over a little-endian f32 row (rarely used: f32 weights take libtorch's GEMM).
pub(crate) fn dot_f32(row: &[u8], x: &[f32]) -> f32 {
    row.as_chunks::<4>()
        .0
        .iter()
        .zip(x)
        .fold(0f32, |s, (b, &x)| s + f32::from_le_bytes(*b) * x)
}

#[cfg(test)]
mod tests {
    use super::round_code;

    /// The same codes as `round()`: on every half and its neighbours, and on a sweep of values.
    #[test]
    fn round_code_rounds_like_round() {
        let mut values: Vec<f32> = (-255..=255)
            .flat_map(|h| {
                let half = h as f32 * 0.5;
                [half, half.next_up(), half.next_down()]
            })
            .filter(|v| v.abs() <= 127.5)
            .collect();
        values.extend((0..200_000).map(|i| -127.5 + i as f32 * (255.0 / 200_000.0)));
        for v in values {
            assert_eq!(round_code(v), v.round() as i8, "{v:e}");
        }
    }
}
