//! The integer GEMM's operands and its scalar reference.
//!
//! Many activation rows (an encoder pass, a prompt prefill) against channel-wise integer
//! weights: `out[t, r] = w_scale[r] × Σ_g x_scale[t, g] × Σ_{i∈g} w[r, i] · x_q[t, i]`, the
//! GEMV's formula (activations rounded to INT8 blocks of [`BLOCK`] values exactly as there, a
//! scale per block that is equal over each [`super::scale_group`] of blocks), with `g` over
//! those scale groups: one conversion and one multiply-add per group (256 values for INT4 and
//! INT2 weights, 32 for INT8), its blocks' integer sums added first.
//!
//! The layout is made for instructions that sum products of bytes in fours into i32 lanes
//! (x86's `vpdpbusd`, aarch64's `sdot`), with one lane per *activation row*:
//! - activations ([`GemmActs`]) are transposed once per product into groups of [`LANES`] rows:
//!   `[group][cols / 4][lane][4]`, so one 64-byte load holds four consecutive values of 16 rows.
//!   For `vpdpbusd` (unsigned bytes × signed bytes) they are unsigned `x_q + 128`; for `sdot`
//!   (signed × signed) they are the signed codes themselves. `smmla` (a 2 × 8 by 8 × 2 matrix
//!   product) takes eight values of two rows per 16 bytes instead ([`ActLayout`]);
//! - weights ([`GemmRows`]) stay rows of signed codes, four of which a kernel broadcasts to every
//!   lane: INT8 rows are used where they are stored, INT4/INT2 rows are unpacked to bytes first,
//!   each block's values in [`block_order`] (the order a few shifts give; the activations are
//!   placed in the same order, as for the GEMV);
//! - the `+ 128` of unsigned activations is taken back exactly, per weight row and scale group:
//!   a group's integer sum starts at `−128 × Σ_{i∈g} w[r, i]` ([`GemmRows::bias`]). Both forms
//!   give every group the same integer sum, so the same bits.
//!
//! Transposing the activations (n × cols bytes) rather than the weights (rows × cols) keeps the
//! preparation off the weights, which are read once per product and are the larger operand
//! whenever n < rows.
//!
//! Kernels: AVX-512 VNNI on x86_64, or AVX2 alone (`vpmaddubsw` + `vpmaddwd`: INT8 weights on
//! signed activations, INT4/INT2 ones on unsigned); on aarch64, `smmla` where the CPU has
//! `i8mm` (ARMv8.6+) and otherwise `sdot` where it has `dotprod` (ARMv8.2+: a Raspberry Pi 5's
//! Cortex-A76, Jetson Orin's A78AE). Elsewhere many-row products take dequantized tiles. Every
//! kernel's activations are rounded by its kernel set's rounding and placed by
//! [`prepare_group`], a group of [`LANES`] rows per task.

use super::{block_order, scalar, scale_group, QuantizeActivations, BLOCK};
use crate::quant::QuantBits;

/// Activation rows per group (one 512-bit register of i32 lanes).
pub(crate) const LANES: usize = 16;
/// What the activations' unsigned codes add to the signed ones.
const ACT_ZERO: i32 = 128;

/// How [`GemmActs::codes`] holds a group of [`LANES`] activation rows, for the instruction that
/// reads them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum ActLayout {
    /// `[cols / 4][lane][4]`, unsigned `x_q + 128`: `vpdpbusd` (unsigned × signed bytes).
    #[default]
    Unsigned,
    /// `[cols / 4][lane][4]`, signed `x_q`: `sdot`.
    #[cfg_attr(not(any(test, target_arch = "aarch64")), allow(dead_code))]
    Signed,
    /// `[cols / 8][lane / 2][2][8]`, signed `x_q`: each 16 bytes hold eight values of two rows,
    /// the 2 × 8 operand of `smmla`.
    #[cfg_attr(not(any(test, target_arch = "aarch64")), allow(dead_code))]
    SignedPairs,
}

impl ActLayout {
    /// Codes are signed (no [`GemmRows::bias`]).
    pub fn signed(self) -> bool {
        self != ActLayout::Unsigned
    }

    /// The code of a zero.
    fn zero(self) -> i32 {
        if self.signed() {
            0
        } else {
            ACT_ZERO
        }
    }

    /// Where value `i` of lane `lane` lies in its group's codes.
    pub fn at(self, lane: usize, i: usize) -> usize {
        match self {
            ActLayout::Unsigned | ActLayout::Signed => (i / 4 * LANES + lane) * 4 + i % 4,
            ActLayout::SignedPairs => ((i / 8 * (LANES / 2) + lane / 2) * 2 + lane % 2) * 8 + i % 8,
        }
    }
}

/// Activation rows rounded to INT8 blocks and laid out for the kernels (see the module). Kept
/// between products (its buffers are reused).
#[derive(Default)]
pub(crate) struct GemmActs {
    /// `[groups][blocks × BLOCK × LANES]` codes in [`Self::layout`]; padding (values past a
    /// row's end, rows past the last) is a zero in that form.
    pub codes: Vec<u8>,
    /// `[groups][blocks][LANES]` block scales; 0 in padding rows.
    pub scales: Vec<f32>,
    /// Groups of [`LANES`] rows (the last one padded).
    pub groups: usize,
    pub blocks: usize,
    pub layout: ActLayout,
}

impl GemmActs {
    /// Sizes the buffers for `n` rows of `cols` values in `layout`, every code a zero and every
    /// scale 0.
    pub fn reset(&mut self, n: usize, cols: usize, layout: ActLayout) {
        self.blocks = cols.div_ceil(BLOCK);
        self.groups = n.div_ceil(LANES);
        self.layout = layout;
        self.codes.clear();
        self.codes.resize(
            self.groups * self.blocks * BLOCK * LANES,
            layout.zero() as u8,
        );
        self.scales.clear();
        self.scales.resize(self.groups * self.blocks * LANES, 0.0);
    }
}

/// Rounds `x` (`[n, cols]`) into `acts` for weights of `bits` in `layout`, one group of
/// [`LANES`] rows after another ([`prepare_group`]): the serial form of what the integer GEMM
/// spreads over the compute threads.
#[cfg(test)]
pub(crate) fn prepare_acts(
    x: &[f32],
    n: usize,
    cols: usize,
    bits: QuantBits,
    acts: &mut GemmActs,
    layout: ActLayout,
    quantize: QuantizeActivations,
) {
    acts.reset(n, cols, layout);
    let (group_codes, group_scales) = (acts.blocks * BLOCK * LANES, acts.blocks * LANES);
    for (g, (codes, scales)) in acts
        .codes
        .chunks_exact_mut(group_codes)
        .zip(acts.scales.chunks_exact_mut(group_scales))
        .enumerate()
    {
        let rows = &x[g * LANES * cols..((g + 1) * LANES).min(n) * cols];
        prepare_group(rows, cols, bits, layout, quantize, codes, scales);
    }
}

/// Rounds the rows of one group (`rows`: at most [`LANES`] rows of `cols` values) by
/// `quantize` (a kernel set's rounding: [`scalar::quantize_activations`]'s codes) and writes
/// each into its lane of the group's `codes` and `scales` (as [`GemmActs::reset`] sized them,
/// padding already a zero).
pub(crate) fn prepare_group(
    rows: &[f32],
    cols: usize,
    bits: QuantBits,
    layout: ActLayout,
    quantize: QuantizeActivations,
    codes: &mut [u8],
    scales: &mut [f32],
) {
    let blocks = cols.div_ceil(BLOCK);
    let width = blocks * BLOCK;
    assert!(rows.len() <= LANES * cols && codes.len() >= width * LANES);
    assert!(scales.len() >= blocks * LANES);
    // Unsigned codes are the signed ones plus 128: their top bit flipped.
    let flip: u32 = if layout.signed() { 0 } else { 0x8080_8080 };
    ROW.with_borrow_mut(|(row_codes, row_scales)| {
        row_codes.resize(width, 0);
        row_scales.resize(blocks, 0.0);
        for (lane, row) in rows.chunks_exact(cols).enumerate() {
            // Codes past the row's end stay zero (the scalar rounding leaves them unwritten).
            row_codes[(blocks - 1) * BLOCK..].fill(0);
            quantize(row, bits, row_codes, row_scales);
            for (b, &s) in row_scales.iter().enumerate() {
                scales[b * LANES + lane] = s;
            }
            match layout {
                ActLayout::Unsigned | ActLayout::Signed => {
                    for (step, four) in row_codes.chunks_exact(4).enumerate() {
                        let word = u32::from_ne_bytes([
                            four[0] as u8,
                            four[1] as u8,
                            four[2] as u8,
                            four[3] as u8,
                        ]) ^ flip;
                        let at = (step * LANES + lane) * 4;
                        codes[at..at + 4].copy_from_slice(&word.to_ne_bytes());
                    }
                }
                ActLayout::SignedPairs => {
                    for (step, eight) in row_codes.chunks_exact(8).enumerate() {
                        let at = layout.at(lane, step * 8);
                        for (c, &q) in codes[at..at + 8].iter_mut().zip(eight) {
                            *c = q as u8;
                        }
                    }
                }
            }
        }
    });
}

thread_local! {
    /// One activation row's codes and block scales, between rounding and placing.
    static ROW: std::cell::RefCell<(Vec<i8>, Vec<f32>)> = std::cell::RefCell::default();
}

/// Weight rows as the kernels read them.
pub(crate) struct GemmRows<'a> {
    /// `rows × blocks × BLOCK` signed codes (two's complement bytes), zero past `cols`.
    pub codes: &'a [u8],
    /// `[rows][blocks.div_ceil(group)]`: `−128 × Σ_{i∈g} w[r, i]` over scale group `g`, where
    /// each group's integer sum starts against unsigned activations; empty for kernels that
    /// take signed ones.
    pub bias: &'a [i32],
    /// One per row.
    pub scales: &'a [f32],
    pub rows: usize,
    pub blocks: usize,
    /// Consecutive blocks whose activations share one scale ([`scale_group`] of the weights'
    /// bits; the last group of a row may be shorter): a kernel adds their integer sums before
    /// it converts them.
    pub group: usize,
}

impl<'a> GemmRows<'a> {
    /// Rows of `bits` as a [`PrepareRows`] left them, its per-block `bias` (if any) summed here
    /// into one per scale group.
    pub fn new(
        codes: &'a [u8],
        bias: &'a mut Vec<i32>,
        scales: &'a [f32],
        rows: usize,
        blocks: usize,
        bits: QuantBits,
    ) -> GemmRows<'a> {
        let group = scale_group(bits);
        if group > 1 && !bias.is_empty() {
            bias_by_scale_group(bias, rows, blocks, group);
        }
        GemmRows {
            codes,
            bias,
            scales,
            rows,
            blocks,
            group,
        }
    }

    /// Scale groups per row.
    pub fn scale_groups(&self) -> usize {
        self.blocks.div_ceil(self.group)
    }
}

/// Sums a `[rows][blocks]` bias into `[rows][blocks.div_ceil(group)]`, in place.
fn bias_by_scale_group(bias: &mut Vec<i32>, rows: usize, blocks: usize, group: usize) {
    assert!(bias.len() >= rows * blocks && group > 0);
    let groups = blocks.div_ceil(group);
    if blocks.is_multiple_of(group) {
        // Whole groups lie back to back across the rows.
        for g in 0..rows * groups {
            bias[g] = bias[g * group..(g + 1) * group].iter().sum();
        }
        bias.truncate(rows * groups);
        return;
    }
    for r in 0..rows {
        for g in 0..groups {
            let first = r * blocks + g * group;
            let sum = bias[first..r * blocks + ((g + 1) * group).min(blocks)]
                .iter()
                .sum();
            // `r × groups + g ≤ first`: nothing is overwritten before it is read.
            bias[r * groups + g] = sum;
        }
    }
    bias.truncate(rows * groups);
}

/// Calls `$tiles::<GROUP>(args)` with the scale group's length as a constant where it is one
/// of [`scale_group`]'s (1 block for INT8 weights, 8 for INT4 and INT2), so that a kernel's
/// blocks of a group are a loop of known length (read at run time, a group of one took INT8
/// GEMMs 10% longer); any other length passes 0, for the kernel to read [`GemmRows::group`].
macro_rules! by_scale_group {
    ($group:expr, $tiles:ident($($arg:expr),* $(,)?)) => {
        match $group {
            1 => $tiles::<1>($($arg),*),
            8 => $tiles::<8>($($arg),*),
            _ => $tiles::<0>($($arg),*),
        }
    };
}
pub(crate) use by_scale_group;

/// `out[r × stride + t] = w_scale[r] × Σ_g x_scale[t, g] × (bias[r, g] + Σ_{i∈g} w[r, i] ·
/// (x_q[t, i] + 128))` (unsigned activations; for signed ones `Σ_{i∈g} w[r, i] · x_q[t, i]`,
/// the same integer) for every weight row `r` and activation row `t < groups × LANES`
/// (`stride` = that), `g` over the rows' scale groups ([`GemmRows::group`] blocks each,
/// `x_scale[t, g]` the scale of its first block), with the float sum taken group after group
/// by fused multiply-adds.
pub(crate) type GemmQuant = fn(&GemmRows<'_>, &GemmActs, &mut [f32]);

/// Asserts that everything a [`GemmQuant`] kernel reads and writes lies inside its operands
/// and `out`, with activations in `layout` (the bias is read only for unsigned ones).
pub(crate) fn check_operands(w: &GemmRows<'_>, x: &GemmActs, out: &[f32], layout: ActLayout) {
    let width = w.blocks * BLOCK;
    assert_eq!(x.layout, layout);
    assert_eq!(x.blocks, w.blocks);
    assert!(w.codes.len() >= w.rows * width && w.scales.len() >= w.rows);
    assert!(w.group > 0);
    assert!(layout.signed() || w.bias.len() >= w.rows * w.scale_groups());
    assert!(x.codes.len() >= x.groups * width * LANES);
    assert!(x.scales.len() >= x.groups * w.blocks * LANES);
    assert!(out.len() >= w.rows * x.groups * LANES);
}

/// An integer GEMM kernel, the preparation of its operands, and its name.
pub(crate) struct IntGemm {
    pub name: &'static str,
    /// The layout the kernel reads activations of weights of these bits in.
    pub layout: fn(QuantBits) -> ActLayout,
    /// Rounds one activation row ([`prepare_group`] places it).
    pub quantize_activations: QuantizeActivations,
    pub prepare_rows: PrepareRows,
    pub run: GemmQuant,
}

/// The reference [`GemmQuant`]: every SIMD kernel gives its results bit for bit (integer sums
/// are exact; the float operations and their order are the same).
#[cfg(test)]
pub(crate) fn gemm_quant(w: &GemmRows<'_>, x: &GemmActs, out: &mut [f32]) {
    check_operands(w, x, out, x.layout);
    let (blocks, stride) = (w.blocks, x.groups * LANES);
    let (width, scale_groups) = (blocks * BLOCK, w.scale_groups());
    for r in 0..w.rows {
        let row = &w.codes[r * width..(r + 1) * width];
        for t in 0..stride {
            let (group, lane) = (t / LANES, t % LANES);
            let acts = &x.codes[group * width * LANES..(group + 1) * width * LANES];
            let mut sum = 0f32;
            for g in 0..scale_groups {
                let signed = x.layout.signed();
                let mut int = if signed {
                    0
                } else {
                    w.bias[r * scale_groups + g]
                };
                let b = g * w.group;
                for i in b * BLOCK..((b + w.group).min(blocks)) * BLOCK {
                    let a = acts[x.layout.at(lane, i)];
                    let a = if signed {
                        i32::from(a as i8)
                    } else {
                        i32::from(a)
                    };
                    int += i32::from(row[i] as i8) * a;
                }
                let scale = x.scales[(group * blocks + b) * LANES + lane];
                sum = (int as f32).mul_add(scale, sum);
            }
            out[r * stride + t] = sum * w.scales[r];
        }
    }
}

/// Writes a tile's products (`rows` rows of `stride` floats: [`GemmQuant`]'s `out`, one row per
/// weight row) into the output's layout, one row per activation row: `out[t × out_stride + r] =
/// products[r × stride + t]` for `r < rows` and `t < n`. In 8 × 8 blocks transposed in registers
/// on AVX2, 4 × 4 on NEON; element by element elsewhere and at the edges.
///
/// # Safety
/// `out` is valid for those writes, and nothing else reads or writes them meanwhile.
pub(crate) unsafe fn transpose_products(
    products: &[f32],
    stride: usize,
    rows: usize,
    n: usize,
    out: *mut f32,
    out_stride: usize,
) {
    assert!(n <= stride && products.len() >= rows * stride);
    // The rows and lanes the SIMD form took, in whole blocks from 0.
    #[cfg(target_arch = "x86_64")]
    let done = if super::avx2::supported() {
        // SAFETY: the CPU has AVX2; the rest is the caller's promise and the assert above.
        unsafe { super::avx2::transpose_blocks(products, stride, rows, n, out, out_stride) }
    } else {
        (0, 0)
    };
    // SAFETY: as above (NEON is always there on aarch64).
    #[cfg(target_arch = "aarch64")]
    let done = unsafe { super::neon::transpose_blocks(products, stride, rows, n, out, out_stride) };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let done = (0, 0);
    let (whole_rows, whole_lanes) = done;
    // SAFETY: as above, for the rows and lanes the blocks left.
    unsafe {
        transpose_part(
            products,
            stride,
            0..whole_rows,
            whole_lanes..n,
            out,
            out_stride,
        );
        transpose_part(products, stride, whole_rows..rows, 0..n, out, out_stride);
    }
}

/// [`transpose_products`] element by element for rows `rows` and activation rows `lanes`: the
/// whole of it where there is no SIMD form, the edges of the SIMD forms' blocks otherwise.
///
/// # Safety
/// As [`transpose_products`], for these rows and lanes.
unsafe fn transpose_part(
    products: &[f32],
    stride: usize,
    rows: std::ops::Range<usize>,
    lanes: std::ops::Range<usize>,
    out: *mut f32,
    out_stride: usize,
) {
    for t in lanes {
        for r in rows.clone() {
            // SAFETY: the caller's promise.
            unsafe { *out.add(t * out_stride + r) = products[r * stride + t] };
        }
    }
}

/// Unpacks `rows` packed integer rows of `cols` values into signed bytes, `blocks × BLOCK` per
/// row (zero-padded; each block in [`block_order`]), and each block's bias `−128 × Σ` of its
/// codes, `[rows][blocks]` ([`GemmRows::new`] sums it per scale group; left empty by kernels
/// that take signed activations). Returns the codes: INT8 rows of whole blocks are used where
/// they lie.
pub(crate) type PrepareRows =
    for<'a> fn(&'a [u8], QuantBits, usize, usize, &'a mut Vec<u8>, &mut Vec<i32>) -> &'a [u8];

/// The reference [`PrepareRows`].
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
pub(crate) fn prepare_rows<'a>(
    packed: &'a [u8],
    bits: QuantBits,
    cols: usize,
    rows: usize,
    codes: &'a mut Vec<u8>,
    bias: &mut Vec<i32>,
) -> &'a [u8] {
    prepare_rows_by(packed, bits, cols, rows, codes, Some(bias), |src, dst| {
        unpack_values(src, bits, cols, dst)
    })
}

/// [`PrepareRows`] with `unpack_row(src, dst)` unpacking one packed row into `blocks × BLOCK`
/// zeroed bytes; the bias is computed where one is given (and cleared otherwise by the caller).
pub(crate) fn prepare_rows_by<'a>(
    packed: &'a [u8],
    bits: QuantBits,
    cols: usize,
    rows: usize,
    codes: &'a mut Vec<u8>,
    bias: Option<&mut Vec<i32>>,
    unpack_row: impl Fn(&[u8], &mut [u8]),
) -> &'a [u8] {
    let blocks = cols.div_ceil(BLOCK);
    let width = blocks * BLOCK;
    let codes: &'a [u8] = if bits == QuantBits::Int8 && cols == width {
        &packed[..rows * width]
    } else {
        codes.clear();
        codes.resize(rows * width, 0);
        for (src, dst) in packed
            .chunks_exact(bits.row_bytes(cols))
            .zip(codes.chunks_exact_mut(width))
            .take(rows)
        {
            unpack_row(src, dst);
        }
        codes
    };
    if let Some(bias) = bias {
        block_bias(codes, rows, blocks, bias);
    }
    codes
}

/// The first `len` values of a packed row as signed bytes, each block in [`block_order`] (the
/// reference's unpacking, and the SIMD unpacking's last odd block).
pub(crate) fn unpack_values(src: &[u8], bits: QuantBits, len: usize, dst: &mut [u8]) {
    for e in 0..len {
        dst[e / BLOCK * BLOCK + block_order(bits, e % BLOCK)] = scalar::element(src, bits, e) as u8;
    }
}

/// One block's bias ([`PrepareRows`]): `−128 × Σ` of its signed codes.
pub(crate) fn bias_of(block: &[u8]) -> i32 {
    -ACT_ZERO * block.iter().map(|&c| i32::from(c as i8)).sum::<i32>()
}

/// The per-block bias ([`PrepareRows`]) of `rows` rows of signed codes, `blocks × BLOCK` each.
pub(crate) fn block_bias(codes: &[u8], rows: usize, blocks: usize, bias: &mut Vec<i32>) {
    bias.clear();
    bias.extend(
        codes[..rows * blocks * BLOCK]
            .chunks_exact(BLOCK)
            .map(bias_of),
    );
}
