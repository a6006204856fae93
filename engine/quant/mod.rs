//! Expert-weight quantization (`ARCHITECTURE.md` §9): channel-wise symmetric linear quantization
//! of row-major f32 matrices to INT8, INT4 and INT2, and dequantization through the kernels of
//! [`kernels`] (a scalar reference, AVX2 on x86_64, NEON on aarch64).
//!
//! A matrix `[rows, cols]` is quantized row by row (a row is one output channel of an
//! `nn.Linear` weight): `scale = max|w| / qmax` with `qmax` = 127, 7, 1 for INT8, INT4, INT2;
//! `q = round(w / scale)` (halves away from zero) clamped to `[-qmax, qmax]`; the dequantized
//! value is the f32 product `q × scale`. A row of zeros gets scale 0 and zero codes.
//!
//! Packed layout: each row starts on a byte boundary and takes `row_bytes = ceil(cols × bits / 8)`
//! bytes, so row `r` is bytes `[r × row_bytes, (r + 1) × row_bytes)`. Inside a row, codes are
//! two's complement, little-endian within a byte:
//!
//! ```text
//! INT8  byte j       = element j (i8)
//! INT4  byte k  bits 0–3 = element 2k       bits 4–7 = element 2k + 1
//! INT2  byte k  bits 0–1 = element 4k       bits 2–3 = element 4k + 1
//!               bits 4–5 = element 4k + 2   bits 6–7 = element 4k + 3
//! ```
//!
//! Fields past the end of a row (when `cols` is not a multiple of 2 or 4) are written as zero
//! and ignored on read. Reads decode the full two's-complement range, so the codes quantization
//! never writes (-8 for INT4, -2 for INT2) dequantize to `-8 × scale` and `-2 × scale`.
//! Scales, one f32 per row, are kept apart from the codes.
//!
//! Every kernel computes a value as one f32 multiplication of the exact code by the row's scale
//! (never a fused multiply-add), so all kernels agree bit for bit.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub(crate) mod kernels;
pub mod matrix;
mod packed_gemm;
pub mod parallel;

#[cfg(target_arch = "x86_64")]
use kernels::avx2;
#[cfg(target_arch = "aarch64")]
use kernels::neon;
use kernels::scalar::{for_each_row, scalar_row};

/// Bit width of a quantized matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum QuantBits {
    Int8,
    Int4,
    Int2,
}

impl QuantBits {
    pub const ALL: [QuantBits; 3] = [QuantBits::Int8, QuantBits::Int4, QuantBits::Int2];

    pub fn bits(self) -> u32 {
        match self {
            QuantBits::Int8 => 8,
            QuantBits::Int4 => 4,
            QuantBits::Int2 => 2,
        }
    }

    /// Largest code magnitude quantization writes.
    pub fn qmax(self) -> i32 {
        match self {
            QuantBits::Int8 => 127,
            QuantBits::Int4 => 7,
            QuantBits::Int2 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantBits::Int8 => "int8",
            QuantBits::Int4 => "int4",
            QuantBits::Int2 => "int2",
        }
    }

    /// Codes per byte.
    fn per_byte(self) -> usize {
        8 / self.bits() as usize
    }

    /// Packed bytes of one row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols.div_ceil(self.per_byte())
    }

    /// Packed bytes of a `rows × cols` matrix (scales not included).
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> usize {
        rows * self.row_bytes(cols)
    }
}

/// `(rows × cols, packed bytes)`, refusing shapes whose sizes overflow.
fn sizes(rows: usize, cols: usize, bits: QuantBits) -> Result<(usize, usize)> {
    let elements = rows.checked_mul(cols);
    let packed = rows.checked_mul(bits.row_bytes(cols));
    match (elements, packed) {
        (Some(e), Some(p)) => Ok((e, p)),
        _ => Err(Error::Input(format!(
            "quantized matrix [{rows}, {cols}] is too large"
        ))),
    }
}

/// Quantizes a row-major `[rows, cols]` matrix; returns the packed codes
/// (`bits.matrix_bytes(rows, cols)` bytes) and one scale per row.
///
/// Refuses a `weights` slice of the wrong length and non-finite weights.
pub fn quantize(
    weights: &[f32],
    rows: usize,
    cols: usize,
    bits: QuantBits,
) -> Result<(Vec<u8>, Vec<f32>)> {
    let (elements, packed_len) = sizes(rows, cols, bits)?;
    if weights.len() != elements {
        return Err(Error::Internal(format!(
            "quantize: {} weights for a [{rows}, {cols}] matrix ({elements} expected)",
            weights.len()
        )));
    }
    let mut packed = vec![0u8; packed_len];
    if cols == 0 {
        return Ok((packed, vec![0.0; rows]));
    }
    let mut scales = Vec::with_capacity(rows);
    let qmax = bits.qmax() as f32;
    let width = bits.bits();
    let mask = ((1u16 << width) - 1) as u8;
    let rows_in = weights.chunks_exact(cols);
    let rows_out = packed.chunks_exact_mut(bits.row_bytes(cols));
    for (r, (row, dst)) in rows_in.zip(rows_out).enumerate() {
        if let Some(c) = row.iter().position(|w| !w.is_finite()) {
            return Err(Error::Input(format!(
                "quantize: weight [{r}, {c}] is {}",
                row[c]
            )));
        }
        let scale = row.iter().fold(0f32, |m, w| m.max(w.abs())) / qmax;
        scales.push(scale);
        // Also covers a row so small that max|w| / qmax underflows: it dequantizes to zeros.
        if scale == 0.0 {
            continue;
        }
        for (byte, values) in dst.iter_mut().zip(row.chunks(bits.per_byte())) {
            *byte = values.iter().enumerate().fold(0u8, |acc, (i, &w)| {
                let q = (w / scale).round().clamp(-qmax, qmax) as i8;
                acc | (q as u8 & mask) << (i as u32 * width)
            });
        }
    }
    Ok((packed, scales))
}

/// Checks the slices a dequantization is given against the matrix shape.
fn check_dequantize(
    packed: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    bits: QuantBits,
    out: &[f32],
) -> Result<()> {
    let (elements, packed_len) = sizes(rows, cols, bits)?;
    let what = format!("dequantize: [{rows}, {cols}] {} matrix", bits.name());
    if packed.len() != packed_len {
        return Err(Error::Internal(format!(
            "{what}: {} packed bytes, {packed_len} expected",
            packed.len()
        )));
    }
    if scales.len() != rows {
        return Err(Error::Internal(format!(
            "{what}: {} scales, {rows} expected",
            scales.len()
        )));
    }
    if out.len() != elements {
        return Err(Error::Internal(format!(
            "{what}: output holds {} values, {elements} expected",
            out.len()
        )));
    }
    Ok(())
}

/// The reference dequantization: writes the row-major `[rows, cols]` f32 matrix into `out`.
pub fn dequantize_scalar(
    packed: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    bits: QuantBits,
    out: &mut [f32],
) -> Result<()> {
    check_dequantize(packed, scales, rows, cols, bits, out)?;
    for_each_row(packed, scales, cols, bits, out, scalar_row);
    Ok(())
}

/// Dequantizes into `out` (row-major `[rows, cols]`) with the fastest kernel this CPU has
/// (see [`dequantize_kernel`]); bit-identical to [`dequantize_scalar`]. Does not allocate.
pub fn dequantize_into(
    packed: &[u8],
    scales: &[f32],
    rows: usize,
    cols: usize,
    bits: QuantBits,
    out: &mut [f32],
) -> Result<()> {
    check_dequantize(packed, scales, rows, cols, bits, out)?;
    // SAFETY: NEON is part of the aarch64 baseline, every aarch64 CPU has it.
    #[cfg(target_arch = "aarch64")]
    unsafe {
        neon::dequantize_rows(packed, scales, cols, bits, out)
    };
    #[cfg(not(target_arch = "aarch64"))]
    {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2.
            unsafe { avx2::dequantize_rows(packed, scales, cols, bits, out) };
            return Ok(());
        }
        for_each_row(packed, scales, cols, bits, out, scalar_row);
    }
    Ok(())
}

/// The kernel [`dequantize_into`] uses on this CPU: `"avx2"`, `"neon"` or `"scalar"`.
pub fn dequantize_kernel() -> &'static str {
    #[cfg(target_arch = "aarch64")]
    return "neon";
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        return "avx2";
    }
    #[allow(unreachable_code)]
    "scalar"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: a tiny deterministic generator for test data.
    struct Rng(u64);

    impl Rng {
        fn next_u64(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        /// Uniform in (0, 1].
        fn unit(&mut self) -> f64 {
            ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
        }

        /// Standard normal (Box–Muller).
        fn normal(&mut self) -> f32 {
            let (u, v) = (self.unit(), self.unit());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        }

        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next_u64() as u8).collect()
        }
    }

    fn dequantized(
        packed: &[u8],
        scales: &[f32],
        rows: usize,
        cols: usize,
        b: QuantBits,
    ) -> Vec<f32> {
        let mut out = vec![f32::NAN; rows * cols];
        dequantize_scalar(packed, scales, rows, cols, b, &mut out).unwrap();
        out
    }

    /// Relative RMS error ‖w − dq(q(w))‖ / ‖w‖ of N(0, 1) weights, [256, 512] with seed 1.
    fn relative_rms(bits: QuantBits) -> f64 {
        let (rows, cols) = (256, 512);
        let mut rng = Rng(1);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
        let (packed, scales) = quantize(&w, rows, cols, bits).unwrap();
        let dq = dequantized(&packed, &scales, rows, cols, bits);
        let err: f64 = w
            .iter()
            .zip(&dq)
            .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
            .sum();
        let norm: f64 = w.iter().map(|&a| (a as f64).powi(2)).sum();
        (err / norm).sqrt()
    }

    #[test]
    fn relative_rms_error_is_pinned_per_width() {
        // Measured 0.00743, 0.1340, 0.8404: the per-row max (about 3σ) sets the step, so INT2
        // zeroes every weight below half the row's max and keeps only the sign of the others.
        for (bits, bound) in [
            (QuantBits::Int8, 0.0080),
            (QuantBits::Int4, 0.145),
            (QuantBits::Int2, 0.86),
        ] {
            let e = relative_rms(bits);
            assert!(
                e <= bound,
                "{}: relative RMS error {e} > {bound}",
                bits.name()
            );
        }
    }

    /// `|w − q × scale| ≤ scale / 2` for every weight, checked exactly (differences in f64).
    #[test]
    fn round_trip_error_is_at_most_half_a_step() {
        let mut rng = Rng(7);
        for bits in QuantBits::ALL {
            for (rows, cols) in [(64, 256), (17, 33), (5, 1), (9, 99)] {
                let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * 0.05).collect();
                let (packed, scales) = quantize(&w, rows, cols, bits).unwrap();
                assert_eq!(packed.len(), bits.matrix_bytes(rows, cols));
                let dq = dequantized(&packed, &scales, rows, cols, bits);
                for r in 0..rows {
                    let row = &w[r * cols..(r + 1) * cols];
                    let max = row.iter().fold(0f32, |m, w| m.max(w.abs()));
                    assert_eq!(scales[r], max / bits.qmax() as f32);
                    let half = scales[r] as f64 / 2.0;
                    for c in 0..cols {
                        let e = (row[c] as f64 - dq[r * cols + c] as f64).abs();
                        assert!(e <= half, "{} [{r}, {c}]: error {e} > {half}", bits.name());
                    }
                    // The largest weight maps to ±qmax.
                    let c = row.iter().position(|w| w.abs() == max).unwrap();
                    let top = bits.qmax() as f32 * scales[r];
                    assert_eq!(dq[r * cols + c], top.copysign(row[c]));
                }
            }
        }
    }

    #[test]
    fn int8_packs_a_hand_example() {
        // Row 1 has scale 2: 3 / 2 = 1.5 rounds away from zero to 2.
        let w = [127.0, -64.0, 1.0, -254.0, 3.0, 100.0];
        let (packed, scales) = quantize(&w, 2, 3, QuantBits::Int8).unwrap();
        assert_eq!(packed, [0x7f, 0xc0, 0x01, 0x81, 0x02, 0x32]);
        assert_eq!(scales, [1.0, 2.0]);
        let dq = dequantized(&packed, &scales, 2, 3, QuantBits::Int8);
        assert_eq!(dq, [127.0, -64.0, 1.0, -254.0, 4.0, 100.0]);
    }

    #[test]
    fn int4_packs_a_hand_example() {
        // 5 columns: 3 bytes per row, the last high nibble is padding.
        #[rustfmt::skip]
        let w = [
            7.0, -7.0, 3.0, -2.5, 0.4,   // scale 1: codes 7 -7 3 -3 0
            0.0, 0.0, 0.0, 0.0, 0.0,     // scale 0
            14.0, 1.0, -1.0, 0.0, -14.0, // scale 2: codes 7 1 -1 0 -7
        ];
        let (packed, scales) = quantize(&w, 3, 5, QuantBits::Int4).unwrap();
        assert_eq!(packed, [0x97, 0xd3, 0x00, 0, 0, 0, 0x17, 0x0f, 0x09]);
        assert_eq!(scales, [1.0, 0.0, 2.0]);
        let dq = dequantized(&packed, &scales, 3, 5, QuantBits::Int4);
        #[rustfmt::skip]
        assert_eq!(dq, [
            7.0, -7.0, 3.0, -3.0, 0.0,
            0.0, 0.0, 0.0, 0.0, 0.0,
            14.0, 2.0, -2.0, 0.0, -14.0,
        ]);
    }

    #[test]
    fn int2_packs_a_hand_example() {
        // 6 columns: 2 bytes per row, the last 4 bits of each row are padding.
        #[rustfmt::skip]
        let w = [
            1.0, -1.0, 0.49, -0.5, 0.5, 0.0, // scale 1: codes 1 -1 0 -1 1 0
            0.0, 0.0, 0.0, 0.0, 0.0, -3.0,   // scale 3: codes 0 0 0 0 0 -1
        ];
        let (packed, scales) = quantize(&w, 2, 6, QuantBits::Int2).unwrap();
        assert_eq!(packed, [0b11_00_11_01, 0b01, 0, 0b11_00]);
        assert_eq!(scales, [1.0, 3.0]);
        let dq = dequantized(&packed, &scales, 2, 6, QuantBits::Int2);
        assert_eq!(
            dq,
            [1.0, -1.0, 0.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -3.0]
        );
    }

    #[test]
    fn every_code_decodes_as_twos_complement() {
        let all: Vec<u8> = (0..=255).collect();
        for bits in QuantBits::ALL {
            let per = bits.per_byte();
            let width = bits.bits();
            let mut out = vec![0f32; 256 * per];
            dequantize_into(&all, &[1.0], 1, 256 * per, bits, &mut out).unwrap();
            for (byte, values) in all.iter().zip(out.chunks(per)) {
                for (i, &v) in values.iter().enumerate() {
                    let field = (*byte as i32 >> (i as u32 * width)) & ((1 << width) - 1);
                    let expected = if field >= 1 << (width - 1) {
                        field - (1 << width)
                    } else {
                        field
                    };
                    assert_eq!(
                        v,
                        expected as f32,
                        "{} byte {byte:#04x} field {i}",
                        bits.name()
                    );
                }
            }
        }
    }

    #[test]
    fn zero_rows_get_scale_zero_and_dequantize_to_zeros() {
        for bits in QuantBits::ALL {
            let (rows, cols) = (4, 37);
            let mut w = vec![0f32; rows * cols];
            w[cols..2 * cols].fill(0.25); // row 1 is not zero
            w[3 * cols] = -0.0;
            let (packed, scales) = quantize(&w, rows, cols, bits).unwrap();
            assert_eq!(scales, [0.0, 0.25 / bits.qmax() as f32, 0.0, 0.0]);
            let dq = dequantized(&packed, &scales, rows, cols, bits);
            for r in [0, 2, 3] {
                assert!(dq[r * cols..(r + 1) * cols].iter().all(|&v| v == 0.0));
            }
            assert!(dq[cols..2 * cols].iter().all(|&v| v == 0.25));
        }
    }

    #[test]
    fn dispatched_kernel_matches_scalar_bit_for_bit() {
        eprintln!("dequantize kernel: {}", dequantize_kernel());
        let mut rng = Rng(42);
        let widths = [
            1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 255, 256, 257,
        ];
        for bits in QuantBits::ALL {
            for cols in widths {
                let rows = 3;
                // Random bytes cover every code, including those quantization never writes.
                let packed = rng.bytes(bits.matrix_bytes(rows, cols));
                let scales = [rng.normal() * 0.01, -rng.normal().abs() * 3e4, 1e-40];
                let mut fast = vec![f32::NAN; rows * cols];
                let mut reference = vec![f32::NAN; rows * cols];
                dequantize_into(&packed, &scales, rows, cols, bits, &mut fast).unwrap();
                dequantize_scalar(&packed, &scales, rows, cols, bits, &mut reference).unwrap();
                let fast: Vec<u32> = fast.iter().map(|v| v.to_bits()).collect();
                let reference: Vec<u32> = reference.iter().map(|v| v.to_bits()).collect();
                assert_eq!(fast, reference, "{} cols {cols}", bits.name());
            }
            // Quantized normal weights at the demo and switch-base expert shapes.
            for (rows, cols) in [(512, 256), (64, 768)] {
                let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
                let (packed, scales) = quantize(&w, rows, cols, bits).unwrap();
                let mut fast = vec![f32::NAN; rows * cols];
                dequantize_into(&packed, &scales, rows, cols, bits, &mut fast).unwrap();
                let reference = dequantized(&packed, &scales, rows, cols, bits);
                assert!(fast
                    .iter()
                    .zip(&reference)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_kernel_matches_scalar_when_available() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 on this CPU: kernel not tested");
            return;
        }
        let mut rng = Rng(3);
        for bits in QuantBits::ALL {
            let (rows, cols) = (5, 203);
            let packed = rng.bytes(bits.matrix_bytes(rows, cols));
            let scales: Vec<f32> = (0..rows).map(|_| rng.normal()).collect();
            let mut fast = vec![f32::NAN; rows * cols];
            // SAFETY: AVX2 was detected above.
            unsafe { avx2::dequantize_rows(&packed, &scales, cols, bits, &mut fast) };
            let reference = dequantized(&packed, &scales, rows, cols, bits);
            assert!(fast
                .iter()
                .zip(&reference)
                .all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn empty_shapes_are_fine() {
        for bits in QuantBits::ALL {
            for (rows, cols) in [(0, 0), (0, 5), (3, 0)] {
                let (packed, scales) = quantize(&[], rows, cols, bits).unwrap();
                assert!(packed.is_empty());
                assert_eq!(scales.len(), rows);
                dequantize_into(&packed, &scales, rows, cols, bits, &mut []).unwrap();
            }
        }
    }

    #[test]
    fn wrong_sizes_and_bad_weights_are_errors() {
        let bits = QuantBits::Int4;
        assert!(quantize(&[1.0; 5], 2, 3, bits).is_err());
        assert!(quantize(&[1.0, f32::NAN], 1, 2, bits).is_err());
        assert!(quantize(&[f32::INFINITY, 0.0], 2, 1, bits).is_err());
        assert!(quantize(&[], usize::MAX, 2, bits).is_err());
        let (packed, scales) = quantize(&[1.0; 6], 2, 3, bits).unwrap();
        let mut out = [0f32; 6];
        for f in [dequantize_into, dequantize_scalar] {
            assert!(f(&packed, &scales, 2, 3, bits, &mut out).is_ok());
            assert!(f(&packed[1..], &scales, 2, 3, bits, &mut out).is_err());
            assert!(f(&packed, &scales[1..], 2, 3, bits, &mut out).is_err());
            assert!(f(&packed, &scales, 2, 3, bits, &mut out[1..]).is_err());
            assert!(f(&packed, &scales, 3, 2, QuantBits::Int8, &mut out).is_err());
            assert!(f(&packed, &scales, usize::MAX, 3, bits, &mut out).is_err());
        }
    }

    #[test]
    fn sizes_per_width() {
        assert_eq!(QuantBits::Int8.matrix_bytes(512, 256), 131_072);
        assert_eq!(QuantBits::Int4.matrix_bytes(512, 256), 65_536);
        assert_eq!(QuantBits::Int2.matrix_bytes(512, 256), 32_768);
        assert_eq!(QuantBits::Int4.row_bytes(5), 3);
        assert_eq!(QuantBits::Int2.row_bytes(5), 2);
        assert_eq!(QuantBits::Int2.row_bytes(4), 1);
        assert_eq!(QuantBits::Int8.row_bytes(5), 5);
    }
}
