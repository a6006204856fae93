//! Matrices computed on in their stored encoding: `x · wᵀ` for a weight matrix held as f32,
//! f16, bf16 or channel-wise INT8/INT4/INT2 (the layouts of [`super`]), without expanding it.
//!
//! Two paths, chosen by the number of activation rows `n`:
//! - **GEMV** (`n` < [`GEMM_MIN_ROWS`]: decode steps, beams): each weight row is read once and
//!   dotted with every activation row in registers (INT8, f16 and bf16 rows with several
//!   activation rows in one pass, where the kernel set has `Kernels::dot_int8_rows` /
//!   `dot_f16_rows` / `dot_bf16_rows`: the same bits as one by one). Float formats (f32 included)
//!   take f32 activations and accumulate with FMA. Integer formats quantize each activation
//!   row to INT8 in blocks of 32 (one f32 scale per block, as llama.cpp's Q8_0) and take
//!   integer dot products per block:
//!   `y[r] = w_scale[r] × Σ_b x_scale[b] × Σ_{i∈b} w[r, i] · x_q[i]`.
//! - **GEMM** (prefill, the encoder): integer formats take the integer GEMM of
//!   [`kernels::gemm`] where the CPU has one (AVX-512 VNNI or AVX2; `sdot` or `smmla` on aarch64):
//!   activations rounded to INT8 blocks as for the GEMV, the same integer block sums, no weight
//!   expanded. Otherwise (float formats, other CPUs), up to [`FLOAT_GEMM_MAX_ROWS`] activation
//!   rows (an expert's share of a pass) take the float GEMM of [`kernels::float_gemm`] where the
//!   CPU has one (AVX-512 or AVX2): one FMA chain per output, the weights widened a task of
//!   rows at a time. More rows, or other CPUs: tiles of [`TILE_ROWS`] weight rows dequantized
//!   into a small scratch and multiplied by libtorch's GEMM (f32 weights are used in place), which
//!   is faster there (BENCHMARKS.md §9.18): MKL's packed GEMM on activations packed once where
//!   libtorch links MKL ([`super::packed_gemm`], §9.25), libtorch's `mm` elsewhere.
//!
//! Both paths split their work over the compute threads of [`super::parallel`] (GEMV: tasks of
//! weight rows; GEMM: tiles), with libtorch itself on one thread. Tiles are the same at every
//! thread count, so no result depends on the number of threads.
//!
//! Kernels ([`super::kernels`]) are a scalar reference and AVX2+FMA (x86_64, detected at run
//! time) or NEON (aarch64, ARMv8.0; `dotprod` when the CPU reports it). Integer kernels agree
//! with the reference exactly on every block's integer sum; their float sums may be added in
//! another order (pinned tolerance in the tests).

use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

use super::kernels::float_gemm::{FloatActs, FloatGemm, GROUP, HALF, PANEL};
use super::kernels::gemm::{self as int_gemm, GemmActs, GemmRows, IntGemm, LANES};
use super::kernels::{self, Kernels, QuantRow, BLOCK};
use super::packed_gemm::{PackBuffer, PackedActs};
use super::parallel;
use super::{dequantize_into, QuantBits};
use crate::error::{Error, Result};
use crate::memory::PageBytes;

/// Activation rows from which the GEMM path (tile dequantization + libtorch GEMM) is taken.
/// Below it, the GEMV kernels (measured in BENCHMARKS.md §9).
pub const GEMM_MIN_ROWS: usize = 8;
/// Activation rows up to which the float GEMM ([`kernels::float_gemm`]) is taken where the CPU
/// has one; above it, libtorch's GEMM on tiles is faster (BENCHMARKS.md §9.18).
pub const FLOAT_GEMM_MAX_ROWS: usize = 128;
/// Weight rows dequantized per GEMM tile.
pub const TILE_ROWS: usize = 128;
/// Weight rows per parallel GEMV task.
const ROWS_PER_TASK: usize = 64;
/// Matrices smaller than this (weights) are not split across threads.
const PARALLEL_MIN_WEIGHTS: usize = 1 << 18;

/// How a weight matrix is stored (row-major `[rows, cols]`, one row per output channel).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatrixFormat {
    F32,
    F16,
    Bf16,
    /// Channel-wise integer codes with one f32 scale per row.
    Quant(QuantBits),
}

impl MatrixFormat {
    /// Bytes of one stored row of `cols` values.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            MatrixFormat::F32 => cols * 4,
            MatrixFormat::F16 | MatrixFormat::Bf16 => cols * 2,
            MatrixFormat::Quant(bits) => bits.row_bytes(cols),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MatrixFormat::F32 => "f32",
            MatrixFormat::F16 => "f16",
            MatrixFormat::Bf16 => "bf16",
            MatrixFormat::Quant(bits) => bits.name(),
        }
    }
}

/// A stored matrix borrowed from wherever it lives (an expert slot, resident memory).
#[derive(Clone, Copy, Debug)]
pub struct MatrixRef<'a> {
    format: MatrixFormat,
    rows: usize,
    cols: usize,
    data: &'a [u8],
    /// One per row for [`MatrixFormat::Quant`], empty otherwise.
    scales: &'a [f32],
}

impl<'a> MatrixRef<'a> {
    /// Checks that `data` and `scales` hold a `[rows, cols]` matrix of `format`.
    pub fn new(
        format: MatrixFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
        scales: &'a [f32],
    ) -> Result<Self> {
        let bytes = rows.checked_mul(format.row_bytes(cols));
        let want_scales = if matches!(format, MatrixFormat::Quant(_)) {
            rows
        } else {
            0
        };
        if bytes != Some(data.len()) || scales.len() != want_scales {
            return Err(Error::Internal(format!(
                "a [{rows}, {cols}] {} matrix given {} bytes and {} scales",
                format.name(),
                data.len(),
                scales.len()
            )));
        }
        Ok(MatrixRef {
            format,
            rows,
            cols,
            data,
            scales,
        })
    }

    pub fn format(&self) -> MatrixFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Stored bytes (codes and scales).
    pub fn stored_bytes(&self) -> usize {
        self.data.len() + self.scales.len() * 4
    }

    /// The packed rows as stored.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    /// One scale per row for integer formats, none for float ones.
    pub fn scales(&self) -> &'a [f32] {
        self.scales
    }

    fn row(&self, r: usize) -> &'a [u8] {
        let n = self.format.row_bytes(self.cols);
        &self.data[r * n..(r + 1) * n]
    }

    /// Rows `start..end` as f32 into `out` (`(end - start) × cols` values).
    pub fn dequantize_rows(&self, start: usize, end: usize, out: &mut [f32]) -> Result<()> {
        if start > end || end > self.rows || out.len() != (end - start) * self.cols {
            return Err(Error::Internal(format!(
                "rows {start}..{end} of a [{}, {}] matrix into {} values",
                self.rows,
                self.cols,
                out.len()
            )));
        }
        let n = self.format.row_bytes(self.cols);
        let data = &self.data[start * n..end * n];
        match self.format {
            MatrixFormat::Quant(bits) => dequantize_into(
                data,
                &self.scales[start..end],
                end - start,
                self.cols,
                bits,
                out,
            )?,
            MatrixFormat::F32 => {
                for (o, b) in out.iter_mut().zip(data.as_chunks::<4>().0) {
                    *o = f32::from_le_bytes(*b);
                }
            }
            MatrixFormat::F16 => (kernels::best().widen_f16)(data, out),
            MatrixFormat::Bf16 => (kernels::best().widen_bf16)(data, out),
        }
        Ok(())
    }

    /// An owned copy of the stored bytes, written into `data` (of exactly their length).
    pub fn to_owned_in(&self, mut data: PageBytes) -> Result<PackedMatrix> {
        if data.len() != self.data.len() {
            return Err(Error::Internal(format!(
                "a {}-byte matrix copied into {} bytes",
                self.data.len(),
                data.len()
            )));
        }
        data.as_mut_slice().copy_from_slice(self.data);
        PackedMatrix::new_in(
            self.format,
            self.rows,
            self.cols,
            data,
            self.scales.to_vec(),
        )
    }

    /// An owned copy of the stored bytes.
    pub fn to_owned(&self) -> Result<PackedMatrix> {
        PackedMatrix::new(
            self.format,
            self.rows,
            self.cols,
            self.data,
            self.scales.to_vec(),
        )
    }

    /// The whole matrix as an f32 tensor `[rows, cols]` (on the CPU).
    pub fn to_tensor(&self) -> Result<Tensor> {
        let mut out = vec![0f32; self.rows * self.cols];
        self.dequantize_rows(0, self.rows, &mut out)?;
        Ok(Tensor::f_from_slice(&out)?.f_view([self.rows as i64, self.cols as i64])?)
    }
}

/// A matrix that owns its stored bytes (resident weights, requantized experts), on huge pages
/// where it is large enough ([`crate::memory`]: the LM head streams faster from them).
#[derive(Debug)]
pub struct PackedMatrix {
    format: MatrixFormat,
    rows: usize,
    cols: usize,
    data: PageBytes,
    scales: Vec<f32>,
}

impl PackedMatrix {
    /// A matrix holding a copy of `data`.
    pub fn new(
        format: MatrixFormat,
        rows: usize,
        cols: usize,
        data: &[u8],
        scales: Vec<f32>,
    ) -> Result<Self> {
        Self::new_in(format, rows, cols, PageBytes::copy_of(data), scales)
    }

    /// A matrix whose stored bytes are `data` (already written).
    pub fn new_in(
        format: MatrixFormat,
        rows: usize,
        cols: usize,
        data: PageBytes,
        scales: Vec<f32>,
    ) -> Result<Self> {
        MatrixRef::new(format, rows, cols, &data, &scales)?;
        Ok(PackedMatrix {
            format,
            rows,
            cols,
            data,
            scales,
        })
    }

    /// Encodes row-major f32 `weights` `[rows, cols]` in `format` (round to nearest even for
    /// f16/bf16, channel-wise quantization for integers).
    pub fn encode(weights: &[f32], rows: usize, cols: usize, format: MatrixFormat) -> Result<Self> {
        let (data, scales) = match format {
            MatrixFormat::Quant(bits) => super::quantize(weights, rows, cols, bits)?,
            MatrixFormat::F32 => (
                weights.iter().flat_map(|w| w.to_le_bytes()).collect(),
                vec![],
            ),
            MatrixFormat::F16 => (
                weights
                    .iter()
                    .flat_map(|&w| half::f16::from_f32(w).to_le_bytes())
                    .collect(),
                vec![],
            ),
            MatrixFormat::Bf16 => (
                weights
                    .iter()
                    .flat_map(|&w| half::bf16::from_f32(w).to_le_bytes())
                    .collect(),
                vec![],
            ),
        };
        Self::new(format, rows, cols, &data, scales)
    }

    pub fn view(&self) -> MatrixRef<'_> {
        MatrixRef {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
            scales: &self.scales,
        }
    }
}

/// Activation rows prepared for one weight format: f32 as given, or INT8 blocks for integer
/// weights (codes in the order the kernels decode weights, see [`kernels::block_order`]).
pub(crate) enum Activations<'x> {
    Float(&'x [f32]),
    Int8 {
        codes: Vec<i8>,
        scales: Vec<f32>,
        /// Per row, see [`kernels::QuantRow::offset`].
        offsets: Vec<f32>,
        /// Per row, see [`kernels::QuantRow::pair_scales`] (empty for an unpaired set).
        pair_scales: Vec<f32>,
    },
}

impl<'x> Activations<'x> {
    /// `n` rows of `x` as the kernels `k` take them for weights of `format`.
    fn prepare(
        x: &'x [f32],
        n: usize,
        cols: usize,
        format: MatrixFormat,
        k: &Kernels,
    ) -> Activations<'x> {
        match format {
            MatrixFormat::Quant(bits) => {
                let blocks = cols.div_ceil(BLOCK);
                let full = cols / BLOCK;
                let per_row_pair_scales = Activations::pair_scales_per_row(k, bits, cols);
                let mut codes = vec![0i8; n * blocks * BLOCK];
                let mut scales = vec![0f32; n * blocks];
                let mut offsets = vec![0f32; n];
                let mut pair_scales = vec![0f32; n * per_row_pair_scales];
                let z = kernels::zero_point(bits) as f32;
                for (i, (((row, c), s), offset)) in x
                    .chunks_exact(cols)
                    .zip(codes.chunks_exact_mut(blocks * BLOCK))
                    .zip(scales.chunks_exact_mut(blocks))
                    .zip(offsets.iter_mut())
                    .enumerate()
                {
                    (k.quantize_activations)(row, bits, c, s);
                    let block_sum = |b: &[i8]| b.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
                    *offset = z * c[..full * BLOCK]
                        .chunks_exact(BLOCK)
                        .zip(s.iter())
                        .map(|(block, d)| d * block_sum(block))
                        .sum::<f32>();
                    if per_row_pair_scales > 0 {
                        let pairs =
                            &mut pair_scales[i * per_row_pair_scales..][..per_row_pair_scales];
                        kernels::pair_blocks(bits, c, s, full, pairs);
                    }
                }
                Activations::Int8 {
                    codes,
                    scales,
                    offsets,
                    pair_scales,
                }
            }
            _ => Activations::Float(x),
        }
    }

    /// Activation row `i` rounded for `bits` weights (`None` for float activations).
    fn quant_row(
        &self,
        k: &Kernels,
        bits: QuantBits,
        cols: usize,
        i: usize,
    ) -> Option<QuantRow<'_>> {
        let Activations::Int8 {
            codes,
            scales,
            offsets,
            pair_scales,
        } = self
        else {
            return None;
        };
        let blocks = cols.div_ceil(BLOCK);
        let pairs = Activations::pair_scales_per_row(k, bits, cols);
        Some(QuantRow {
            codes: &codes[i * blocks * BLOCK..(i + 1) * blocks * BLOCK],
            scales: &scales[i * blocks..(i + 1) * blocks],
            offset: offsets[i],
            pair_scales: &pair_scales[i * pairs..(i + 1) * pairs],
        })
    }

    /// Length of one row's [`kernels::QuantRow::pair_scales`].
    fn pair_scales_per_row(k: &Kernels, bits: QuantBits, cols: usize) -> usize {
        if k.paired && kernels::pair_unit(bits).is_some() {
            cols / BLOCK / 2 * 16
        } else {
            0
        }
    }
}

/// `out[i, r] = Σ_c x[i, c] · w[r, c]`: `x` is `[n, cols]` row-major, `out` `[n, rows]`.
pub fn matmul(x: &[f32], n: usize, w: MatrixRef<'_>, out: &mut [f32]) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    if x.len() != n * cols || out.len() != n * rows {
        return Err(Error::Internal(format!(
            "matmul: x of {} values for [{n}, {cols}], out of {} for [{n}, {rows}]",
            x.len(),
            out.len()
        )));
    }
    if n == 0 || rows == 0 {
        return Ok(());
    }
    if cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    if n >= GEMM_MIN_ROWS {
        if let (MatrixFormat::Quant(bits), Some(int)) = (w.format, kernels::int_gemm()) {
            gemm_int(x, n, w, bits, int, out);
            return Ok(());
        }
        if let (true, Some(float)) = (n <= FLOAT_GEMM_MAX_ROWS, kernels::float_gemm()) {
            return gemm_float(x, n, w, float, out);
        }
        return gemm(x, n, w, out);
    }
    gemv(x, n, w, out, kernels::best())
}

/// The integer GEMM path: activations rounded and laid out once (groups of [`LANES`] rows
/// spread over the compute threads, each row rounded by the kernel set's SIMD rounding), then
/// tiles of [`TILE_ROWS`] weight rows spread over the compute threads, each tile's rows
/// unpacked to bytes (INT8 rows with whole blocks are used where they lie) and multiplied into
/// a per-thread `[rows, n]` product, which the task writes into its own columns of `out`.
/// Every output is one kernel's sum over the whole row, so tiles and threads change nothing.
pub(crate) fn gemm_int(
    x: &[f32],
    n: usize,
    w: MatrixRef<'_>,
    bits: QuantBits,
    kernel: &IntGemm,
    out: &mut [f32],
) {
    ACTS.with_borrow_mut(|acts| {
        prepare_acts(x, n, w.cols, bits, kernel, acts);
        products_by_tile(n, w, bits, kernel, acts, out)
    })
}

/// Rounds `x` into `acts` in the kernel's layout, the groups of [`LANES`] rows spread over the
/// compute threads (each group's codes and scales are its own).
fn prepare_acts(
    x: &[f32],
    n: usize,
    cols: usize,
    bits: QuantBits,
    kernel: &IntGemm,
    acts: &mut GemmActs,
) {
    let layout = (kernel.layout)(bits);
    acts.reset(n, cols, layout);
    let (group_codes, group_scales) = (acts.blocks * BLOCK * LANES, acts.blocks * LANES);
    // Addresses, not references: each task writes its own group.
    let (codes_at, scales_at) = (
        acts.codes.as_mut_ptr() as usize,
        acts.scales.as_mut_ptr() as usize,
    );
    parallel::for_each_task(acts.groups, &|g| {
        // SAFETY: `reset` sized the buffers for `groups` groups, which outlive every task
        // (for_each_task returns after all of them); group `g` belongs to this task alone.
        let (codes, scales) = unsafe {
            (
                std::slice::from_raw_parts_mut(
                    (codes_at as *mut u8).add(g * group_codes),
                    group_codes,
                ),
                std::slice::from_raw_parts_mut(
                    (scales_at as *mut f32).add(g * group_scales),
                    group_scales,
                ),
            )
        };
        let rows = &x[g * LANES * cols..((g + 1) * LANES).min(n) * cols];
        int_gemm::prepare_group(
            rows,
            cols,
            bits,
            layout,
            kernel.quantize_activations,
            codes,
            scales,
        );
    });
}

/// The tiles of [`gemm_int`], on prepared activations.
fn products_by_tile(
    n: usize,
    w: MatrixRef<'_>,
    bits: QuantBits,
    kernel: &IntGemm,
    acts: &GemmActs,
    out: &mut [f32],
) {
    let (rows, cols) = (w.rows, w.cols);
    let stride = acts.groups * LANES;
    let blocks = acts.blocks;
    let row_bytes = bits.row_bytes(cols);
    let tile_rows = TILE_ROWS.min(rows);
    let tasks = rows.div_ceil(tile_rows);
    // An address, not a reference: each task writes its own columns.
    let out_at = out.as_mut_ptr() as usize;
    parallel::for_each_task(tasks, &|t| {
        let (start, end) = (t * tile_rows, ((t + 1) * tile_rows).min(rows));
        let packed = &w.data[start * row_bytes..end * row_bytes];
        INT_SCRATCH.with_borrow_mut(|scratch| {
            let IntScratch {
                codes,
                bias,
                products,
            } = scratch;
            let codes = (kernel.prepare_rows)(packed, bits, cols, end - start, codes, bias);
            let tile = GemmRows::new(
                codes,
                bias,
                &w.scales[start..end],
                end - start,
                blocks,
                bits,
            );
            products.resize((end - start) * stride, 0.0);
            (kernel.run)(&tile, acts, products);
            // SAFETY: `out` is `[n, rows]` (checked by `matmul`) and outlives every task
            // (for_each_task returns after all of them); columns `start..end` belong to this
            // task alone.
            unsafe {
                int_gemm::transpose_products(
                    products,
                    stride,
                    end - start,
                    n,
                    (out_at as *mut f32).add(start),
                    rows,
                )
            };
        })
    });
}

/// Weight rows per task of the float GEMM (whole panels): a task's rows, widened where they
/// are not f32 (576 KiB at 3,072 columns), stay in a core's L2 cache while every group of
/// activations passes over them.
const FLOAT_TASK_ROWS: usize = 8 * PANEL;
/// Columns per block of the float GEMM: one group's activations for a block (24 KiB) stay in
/// the L1 data cache while every panel of the task uses them.
const FLOAT_BLOCK_COLS: usize = 192;

/// The float GEMM path ([`kernels::float_gemm`]): activations transposed into groups once,
/// then tasks of [`FLOAT_TASK_ROWS`] weight rows spread over the compute threads. A task widens
/// its rows where they are not f32 (f32 rows are used where they lie), then, a block of
/// [`FLOAT_BLOCK_COLS`] columns at a time, runs the micro-kernel for every group of activation
/// rows over every panel (the sums carried from block to block), and at the end writes its own
/// columns of `out`. On f32 rows where they lie, the first group's calls ask for the next
/// panel's rows meanwhile, so that the reads from memory overlap the FMAs. Every output is one
/// chain of FMAs over its whole row, so blocks, tasks and threads change nothing.
pub(crate) fn gemm_float(
    x: &[f32],
    n: usize,
    w: MatrixRef<'_>,
    kernel: &FloatGemm,
    out: &mut [f32],
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    FLOAT_ACTS.with_borrow_mut(|acts| {
        (kernel.prepare_acts)(x, n, cols, acts);
        let acts = &*acts;
        let tasks = rows.div_ceil(FLOAT_TASK_ROWS);
        // An address, not a reference: each task writes its own columns.
        let out_at = out.as_mut_ptr() as usize;
        parallel::try_for_each_task(tasks, &|t| {
            let (start, end) = (t * FLOAT_TASK_ROWS, ((t + 1) * FLOAT_TASK_ROWS).min(rows));
            let height = end - start;
            let run = |scratch: &mut FloatScratch| -> Result<()> {
                let FloatScratch {
                    tile,
                    sums,
                    rows_out,
                } = scratch;
                let (weights, in_place): (&[f32], bool) = match f32_rows_in_place(&w, start, end) {
                    Some(rows) => (rows, true),
                    None => {
                        tile.resize(height * cols, 0.0);
                        w.dequantize_rows(start, end, tile)?;
                        (tile, false)
                    }
                };
                rows_out.resize(GROUP * height, 0.0);
                let padded = height.div_ceil(PANEL) * PANEL;
                sums.clear();
                sums.resize(acts.groups * padded * GROUP, 0.0);
                // Column blocks outermost: a block of the task's rows stays in cache while
                // every group of activations passes over it.
                for first in (0..cols).step_by(FLOAT_BLOCK_COLS) {
                    let len = FLOAT_BLOCK_COLS.min(cols - first);
                    for (g, sums) in sums.chunks_exact_mut(padded * GROUP).enumerate() {
                        let (group, lanes) = (&acts.group(g)[first * GROUP..], acts.lanes(g));
                        // A group of at most half a vector's rows takes two panels per call.
                        let rows_per_call = if lanes <= HALF { 2 * PANEL } else { PANEL };
                        for (p, sums) in sums.chunks_mut(rows_per_call * GROUP).enumerate() {
                            let panel = &weights[p * rows_per_call * cols + first..];
                            let panel_rows = rows_per_call.min(height - p * rows_per_call);
                            // The first group reads f32 rows from memory where they lie: the
                            // kernel asks for the next panel meanwhile. Later groups, and rows
                            // widened into the tile, find them in cache (asking for the tile's
                            // rows too measured slower, BENCHMARKS §9.20).
                            let prefetch = in_place && g == 0;
                            (kernel.panel)(
                                panel, panel_rows, cols, len, group, lanes, sums, prefetch,
                            );
                        }
                    }
                }
                for (g, sums) in sums.chunks_exact(padded * GROUP).enumerate() {
                    let lanes = acts.lanes(g);
                    (kernel.write_sums)(sums, height, lanes, rows_out, height);
                    for (lane, src) in rows_out.chunks_exact(height).take(lanes).enumerate() {
                        let i = g * GROUP + lane;
                        // SAFETY: `out` is `[n, rows]` (checked by `matmul`) and outlives every
                        // task (for_each_task returns after all of them); columns `start..end`
                        // belong to this task alone.
                        let dst = unsafe {
                            std::slice::from_raw_parts_mut(
                                (out_at as *mut f32).add(i * rows + start),
                                height,
                            )
                        };
                        dst.copy_from_slice(src);
                    }
                }
                Ok(())
            };
            FLOAT_SCRATCH.with_borrow_mut(run)
        })
    })
}

/// Rows `start..end` of an f32 matrix where they lie, when its bytes are 4-byte aligned;
/// `None` otherwise, and for other formats (their rows are dequantized into a scratch).
fn f32_rows_in_place<'a>(w: &MatrixRef<'a>, start: usize, end: usize) -> Option<&'a [f32]> {
    if w.format != MatrixFormat::F32 || !(w.data.as_ptr() as usize).is_multiple_of(4) {
        return None;
    }
    let bytes = &w.data[start * w.cols * 4..end * w.cols * 4];
    // SAFETY: 4-byte aligned (checked above), whole f32 values.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast(), bytes.len() / 4) })
}

/// A compute thread's float GEMM task: its rows widened, the sums of every group of activation
/// rows, and one group's sums as rows of the product.
#[derive(Default)]
struct FloatScratch {
    tile: Vec<f32>,
    sums: Vec<f32>,
    rows_out: Vec<f32>,
}

/// A compute thread's integer GEMM tile: unpacked codes, their block biases and the products.
#[derive(Default)]
struct IntScratch {
    codes: Vec<u8>,
    bias: Vec<i32>,
    products: Vec<f32>,
}

/// The GEMV path with the given kernels (tests compare kernel sets).
pub(crate) fn gemv(
    x: &[f32],
    n: usize,
    w: MatrixRef<'_>,
    out: &mut [f32],
    k: &'static Kernels,
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    let acts = Activations::prepare(x, n, cols, w.format, k);
    // Rows are computed into `[rows, n]` (contiguous per task), then transposed when n > 1.
    let mut by_row = if n == 1 {
        Vec::new()
    } else {
        vec![0f32; rows * n]
    };
    let target: &mut [f32] = if n == 1 { out } else { &mut by_row };
    // Several activation rows on INT8 weights: all of them in one pass over each weight row,
    // where the kernel set can (the same results as one by one); their rows looked up once.
    let int8_rows = match (n > 1, k.dot_int8_rows, w.format) {
        (true, Some(dots), MatrixFormat::Quant(QuantBits::Int8)) => {
            let xs: Vec<QuantRow<'_>> = (0..n)
                .map(|i| acts.quant_row(k, QuantBits::Int8, cols, i))
                .collect::<Option<_>>()
                .expect("integer activations");
            Some((dots, xs))
        }
        _ => None,
    };
    let task = |first_row: usize, dst: &mut [f32]| {
        if let Some((dots, xs)) = &int8_rows {
            for (i, y) in dst.chunks_exact_mut(n).enumerate() {
                let r = first_row + i;
                dots(w.row(r), cols, xs, y);
                y.iter_mut().for_each(|y| *y *= w.scales[r]);
            }
            return;
        }
        // Several activation rows on 16-bit float weights: the same, with each weight widened
        // once.
        let float_rows = match w.format {
            MatrixFormat::F16 => k.dot_f16_rows,
            MatrixFormat::Bf16 => k.dot_bf16_rows,
            _ => None,
        };
        if let (true, Some(dots), Activations::Float(x)) = (n > 1, float_rows, &acts) {
            for (i, y) in dst.chunks_exact_mut(n).enumerate() {
                dots(w.row(first_row + i), x, cols, y);
            }
            return;
        }
        if n == 1 {
            one_row_dots(k, &w, first_row, &acts, cols, dst);
            return;
        }
        for (i, y) in dst.chunks_exact_mut(n).enumerate() {
            let r = first_row + i;
            row_dots(k, &w, r, &acts, cols, y);
        }
    };
    for_each_row_run(target, n, rows * cols, &task);
    if n > 1 {
        for (r, ys) in by_row.chunks_exact(n).enumerate() {
            for (i, &y) in ys.iter().enumerate() {
                out[i * rows + r] = y;
            }
        }
    }
    Ok(())
}

/// One activation row through two matrices of one shape at once, combined row by row:
/// `out[r] = combine(gate_r · x, up_r · x)` (SwiGLU's `silu(gate) × up` in a decode step). The
/// rows are one spread of tasks over the compute threads, each task a run of rows of both
/// matrices and their combination: one product handed to the pool where two were, the
/// activations rounded once where both matrices take the same ones, and the combination done
/// beside the products. Each dot product is [`matmul`]'s for that row, bit for bit.
pub fn matvec_gated(
    x: &[f32],
    gate: MatrixRef<'_>,
    up: MatrixRef<'_>,
    combine: impl Fn(f32, f32) -> f32 + Sync,
    out: &mut [f32],
) -> Result<()> {
    let (rows, cols) = (gate.rows, gate.cols);
    if (up.rows, up.cols) != (rows, cols) || x.len() != cols || out.len() != rows {
        return Err(Error::Internal(format!(
            "matvec_gated: gate [{rows}, {cols}], up [{}, {}], x of {} values, out of {}",
            up.rows,
            up.cols,
            x.len(),
            out.len()
        )));
    }
    if cols == 0 {
        out.fill(combine(0.0, 0.0));
        return Ok(());
    }
    let k = kernels::best();
    let gate_acts = Activations::prepare(x, 1, cols, gate.format, k);
    let up_own = (up.format != gate.format).then(|| Activations::prepare(x, 1, cols, up.format, k));
    let up_acts = up_own.as_ref().unwrap_or(&gate_acts);
    let task = |first_row: usize, dst: &mut [f32]| {
        let (mut g, mut u) = ([0f32; ROWS_PER_TASK], [0f32; ROWS_PER_TASK]);
        let (g, u) = (&mut g[..dst.len()], &mut u[..dst.len()]);
        one_row_dots(k, &gate, first_row, &gate_acts, cols, g);
        one_row_dots(k, &up, first_row, up_acts, cols, u);
        for ((o, &g), &u) in dst.iter_mut().zip(g.iter()).zip(u.iter()) {
            *o = combine(g, u);
        }
    };
    for_each_row_run(out, 1, 2 * rows * cols, &task);
    Ok(())
}

/// Runs `task(first_row, outputs)` over `target` (`n` outputs per weight row) in runs of
/// [`ROWS_PER_TASK`] rows, each run writing its own outputs: one task per run on the compute
/// threads when the product reads at least [`PARALLEL_MIN_WEIGHTS`] weights, one run after
/// another on this thread otherwise.
fn for_each_row_run(
    target: &mut [f32],
    n: usize,
    weights: usize,
    task: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    let run_len = ROWS_PER_TASK * n;
    if weights < PARALLEL_MIN_WEIGHTS {
        for (t, dst) in target.chunks_mut(run_len).enumerate() {
            task(t * ROWS_PER_TASK, dst);
        }
        return;
    }
    let runs: Vec<Mutex<&mut [f32]>> = target.chunks_mut(run_len).map(Mutex::new).collect();
    parallel::for_each_task(runs.len(), &|t| {
        let mut dst = runs[t].lock().unwrap_or_else(|e| e.into_inner());
        task(t * ROWS_PER_TASK, &mut dst)
    });
}

/// Rows `first_row..` of `w` dotted with one activation row into `dst` (one output per row):
/// integer rows by the set's several-row kernels where it has them ([`quant_row_dots`], the
/// same results as one by one), the rest one by one.
fn one_row_dots(
    k: &Kernels,
    w: &MatrixRef<'_>,
    first_row: usize,
    acts: &Activations<'_>,
    cols: usize,
    dst: &mut [f32],
) {
    let done = quant_row_dots(k, w, first_row, acts, cols, dst);
    for (i, y) in dst.chunks_exact_mut(1).enumerate().skip(done) {
        row_dots(k, w, first_row + i, acts, cols, y);
    }
}

/// Rows `first_row..` of `w` dotted with one activation row into `dst` (one output per row):
/// four at a time by the set's [`Kernels::dot_quant4`], then the rest in one call by its
/// [`Kernels::dot_quant_rows`], as far as the set has them; returns how many rows it computed
/// (from the first; none for a float format).
fn quant_row_dots(
    k: &Kernels,
    w: &MatrixRef<'_>,
    first_row: usize,
    acts: &Activations<'_>,
    cols: usize,
    dst: &mut [f32],
) -> usize {
    let MatrixFormat::Quant(bits) = w.format else {
        return 0;
    };
    let Some(x) = acts.quant_row(k, bits, cols, 0) else {
        return 0;
    };
    let mut done = 0;
    if let Some(dot4) = k.dot_quant4 {
        for (i, ys) in dst.chunks_exact_mut(4).enumerate() {
            let r = first_row + 4 * i;
            let dots = dot4(
                [w.row(r), w.row(r + 1), w.row(r + 2), w.row(r + 3)],
                bits,
                cols,
                &x,
            );
            for (j, (y, dot)) in ys.iter_mut().zip(dots).enumerate() {
                *y = w.scales[r + j] * dot;
            }
        }
        done = dst.len() / 4 * 4;
    }
    if let Some(dots) = k.dot_quant_rows {
        let (row_bytes, start, end) = (
            bits.row_bytes(cols),
            first_row + done,
            first_row + dst.len(),
        );
        let rows = &w.data[start * row_bytes..end * row_bytes];
        dots(
            rows,
            bits,
            cols,
            &x,
            &w.scales[start..end],
            &mut dst[done..],
        );
        done = dst.len();
    }
    done
}

/// Row `r` of `w` dotted with each of the `y.len()` activation rows.
#[inline]
fn row_dots(
    k: &Kernels,
    w: &MatrixRef<'_>,
    r: usize,
    acts: &Activations<'_>,
    cols: usize,
    y: &mut [f32],
) {
    let row = w.row(r);
    match (w.format, acts) {
        (MatrixFormat::Quant(bits), Activations::Int8 { .. }) => {
            let scale = w.scales[r];
            for (i, y) in y.iter_mut().enumerate() {
                let x = acts
                    .quant_row(k, bits, cols, i)
                    .expect("integer activations");
                *y = scale * (k.dot_quant)(row, bits, cols, &x);
            }
        }
        (MatrixFormat::F16, Activations::Float(x)) => {
            for (i, y) in y.iter_mut().enumerate() {
                *y = (k.dot_f16)(row, &x[i * cols..(i + 1) * cols]);
            }
        }
        (MatrixFormat::Bf16, Activations::Float(x)) => {
            for (i, y) in y.iter_mut().enumerate() {
                *y = (k.dot_bf16)(row, &x[i * cols..(i + 1) * cols]);
            }
        }
        (MatrixFormat::F32, Activations::Float(x)) => {
            for (i, y) in y.iter_mut().enumerate() {
                *y = (k.dot_f32)(row, &x[i * cols..(i + 1) * cols]);
            }
        }
        _ => unreachable!("activations are prepared for the weight format"),
    }
}

/// The GEMM path: one single-threaded GEMM (see [`super::parallel`]) per tile of
/// [`TILE_ROWS`] weight rows, spread over the compute threads: f32 tiles are used in place,
/// others are dequantized into a per-thread scratch first. Each task writes its own columns of
/// `out`. Where libtorch links MKL (x86_64), `x` is packed once into MKL's layout on the
/// calling thread and every tile takes MKL's packed GEMM ([`super::packed_gemm`]); elsewhere,
/// libtorch's `mm`.
fn gemm(x: &[f32], n: usize, w: MatrixRef<'_>, out: &mut [f32]) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    // The same tiles at every thread count: libtorch's GEMM rounds differently for different
    // shapes, and a run's output must not depend on `--threads`.
    let tile_rows = TILE_ROWS.min(rows);
    let tasks = rows.div_ceil(tile_rows);
    PACK_SCRATCH.with_borrow_mut(|pack_scratch| {
        // Activations packed once for all tiles where MKL is linked (one tile gains nothing).
        let packed = (tasks > 1)
            .then(|| PackedActs::pack(pack_scratch, x, n, cols, tile_rows, rows))
            .flatten();
        gemm_tiles(x, n, w, tile_rows, packed.as_ref(), out)
    })
}

/// [`gemm`]'s tiles of `tile_rows` weight rows, with the activations packed for MKL where it
/// is linked.
fn gemm_tiles(
    x: &[f32],
    n: usize,
    w: MatrixRef<'_>,
    tile_rows: usize,
    packed: Option<&PackedActs<'_>>,
    out: &mut [f32],
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    let tasks = rows.div_ceil(tile_rows);
    // Addresses, not references: the tasks build their own tensor views from them.
    let (x_at, out_at) = (x.as_ptr() as usize, out.as_mut_ptr() as usize);
    parallel::try_for_each_task(tasks, &|t| {
        let (start, end) = (t * tile_rows, ((t + 1) * tile_rows).min(rows));
        // SAFETY: `x` and `out` outlive every task (for_each_task returns after all of them),
        // their lengths were checked against the shapes, and task `t` writes only columns
        // `start..end` of `out`, which no other task touches.
        let view = |at: usize, shape: &[i64]| unsafe {
            Tensor::f_from_blob(at as *const u8, shape, &[], Kind::Float, Device::Cpu)
        };
        let product = |weights: &[f32]| -> Result<()> {
            if let Some(packed) = packed {
                // SAFETY: as above: rows `0..n` of columns `start..end` of `out`, this task's.
                unsafe { packed.multiply(weights, (out_at as *mut f32).add(start), rows) };
                return Ok(());
            }
            let xt = view(x_at, &[n as i64, cols as i64])?;
            let ot = view(out_at, &[n as i64, rows as i64])?;
            let wt = view(
                weights.as_ptr() as usize,
                &[(end - start) as i64, cols as i64],
            )?;
            let columns = ot.f_narrow(1, start as i64, (end - start) as i64)?;
            let _ = xt.f_mm_out(&columns, &wt.f_tr()?)?;
            Ok(())
        };
        if let Some(weights) = f32_rows_in_place(&w, start, end) {
            return product(weights);
        }
        SCRATCH.with_borrow_mut(|scratch| {
            scratch.resize(TILE_ROWS * cols, 0.0);
            let tile = &mut scratch[..(end - start) * cols];
            w.dequantize_rows(start, end, tile)?;
            product(tile)
        })
    })
}

thread_local! {
    /// A compute thread's dequantized GEMM tile (at most [`TILE_ROWS`] × the widest matrix).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The calling thread's activations packed for MKL (see [`super::packed_gemm`]).
    static PACK_SCRATCH: std::cell::RefCell<PackBuffer> = const { std::cell::RefCell::new(PackBuffer::new()) };
    static INT_SCRATCH: std::cell::RefCell<IntScratch> = std::cell::RefCell::default();
    static FLOAT_SCRATCH: std::cell::RefCell<FloatScratch> = std::cell::RefCell::default();
    /// The calling thread's transposed activations of a float GEMM (the helpers read them).
    static FLOAT_ACTS: std::cell::RefCell<FloatActs> = std::cell::RefCell::default();
    /// The calling thread's prepared activations of an integer GEMM (the helpers read them).
    static ACTS: std::cell::RefCell<GemmActs> = std::cell::RefCell::default();
}

/// The kernel set this CPU uses: `"avx2"`, `"avx2+vnni"`, `"avx512+vnni"`, `"neon-dotprod"`,
/// `"neon"` or `"scalar"`.
pub fn matmul_kernel() -> &'static str {
    kernels::best().name
}

/// The integer GEMM this CPU uses (`"avx512-vnni"`, `"avx2"`, `"neon-dotprod"`,
/// `"neon-i8mm"`), or `None` (dequantized tiles and libtorch's f32 GEMM).
pub fn int_gemm_kernel() -> Option<&'static str> {
    kernels::int_gemm().map(|k| k.name)
}

/// f32 values the GEMM paths keep for products with rows of up to `widest` values on
/// `threads` compute threads: each thread's tile of dequantized rows for libtorch's GEMM and
/// its task of widened rows for the float GEMM, and the float GEMM's transposed activations
/// (on the calling thread).
pub fn gemm_scratch_values(widest: usize, threads: usize) -> usize {
    (TILE_ROWS + FLOAT_TASK_ROWS)
        .saturating_mul(threads)
        .saturating_add(FLOAT_GEMM_MAX_ROWS.next_multiple_of(GROUP))
        .saturating_mul(widest)
}

/// Bytes the GEMM path keeps for activations packed for MKL, for products of up to `n`
/// activation rows of up to `widest` values (0 where MKL's packed GEMM is not linked).
pub fn gemm_packed_acts_bytes(n: usize, widest: usize) -> u64 {
    if n <= FLOAT_GEMM_MAX_ROWS && kernels::float_gemm().is_some() || n < GEMM_MIN_ROWS {
        return 0;
    }
    super::packed_gemm::packed_acts_bytes(n, widest, TILE_ROWS)
}

/// The float GEMM this CPU uses (`"avx512"`, `"avx2"`), or `None` (tiles and libtorch's f32 GEMM).
pub fn float_gemm_kernel() -> Option<&'static str> {
    kernels::float_gemm().map(|k| k.name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kernels::gemm::ActLayout;
    use crate::quant::parallel::set_compute_threads;

    /// The integer GEMM's scalar reference as a kernel.
    static SCALAR_GEMM: IntGemm = IntGemm {
        name: "scalar",
        layout: |_| ActLayout::Unsigned,
        quantize_activations: kernels::scalar::quantize_activations,
        prepare_rows: int_gemm::prepare_rows,
        run: int_gemm::gemm_quant,
    };

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    const FORMATS: [MatrixFormat; 6] = [
        MatrixFormat::F32,
        MatrixFormat::F16,
        MatrixFormat::Bf16,
        MatrixFormat::Quant(QuantBits::Int8),
        MatrixFormat::Quant(QuantBits::Int4),
        MatrixFormat::Quant(QuantBits::Int2),
    ];

    /// Every kernel set widens f16 and bf16 to f32 exactly as the scalar reference does (the
    /// GEMM's tiles of 16-bit weights), on arbitrary bits — subnormals, infinities and NaNs
    /// included — at lengths around each set's steps.
    #[test]
    fn every_kernel_set_widens_16_bit_floats_as_the_reference() {
        let mut rng = Rng(29);
        for len in [
            0, 1, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 1000,
        ] {
            let src = rng.bytes(len * 2);
            for k in kernels::available() {
                let widened: [(&str, kernels::Widen, kernels::Widen); 2] = [
                    ("f16", k.widen_f16, kernels::scalar::widen_f16),
                    ("bf16", k.widen_bf16, kernels::scalar::widen_bf16),
                ];
                for (format, widen, reference) in widened {
                    let mut want = vec![0f32; len];
                    reference(&src, &mut want);
                    let mut got = vec![0.5f32; len];
                    widen(&src, &mut got);
                    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                            "{} {format}, {len} values, value {i}: {g:e} against {w:e}",
                            k.name
                        );
                    }
                }
            }
        }
    }

    /// Whether [`matmul`] rounds `n` activation rows to INT8 blocks for weights of `format` (the
    /// integer GEMV and GEMM do).
    fn rounds_activations(format: MatrixFormat, n: usize) -> bool {
        matches!(format, MatrixFormat::Quant(_))
            && (n < GEMM_MIN_ROWS || kernels::int_gemm().is_some())
    }

    /// f64 reference of `x · dq(w)ᵀ`; with `rounded`, the activations are rounded to INT8
    /// blocks exactly as the integer kernels do (so only summation order differs).
    fn reference(x: &[f32], n: usize, w: &MatrixRef<'_>, rounded: bool) -> Vec<f64> {
        let (rows, cols) = (w.rows(), w.cols());
        let mut dq = vec![0f32; rows * cols];
        w.dequantize_rows(0, rows, &mut dq).unwrap();
        // Values sharing one activation scale: a block, or INT2's and INT4's groups of 8
        // blocks (256 values, llama.cpp's `Q8_K`).
        let group = match w.format() {
            MatrixFormat::Quant(QuantBits::Int2 | QuantBits::Int4) => 8 * BLOCK,
            _ => BLOCK,
        };
        let xs: Vec<f64> = match w.format() {
            _ if rounded => x
                .chunks_exact(cols)
                .flat_map(|row| {
                    row.chunks(group)
                        .flat_map(|b| {
                            let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
                            b.iter()
                                .map(move |v| (v * id).round() as f64 * d as f64)
                                .collect::<Vec<_>>()
                        })
                        .collect::<Vec<_>>()
                })
                .collect(),
            _ => x.iter().map(|&v| v as f64).collect(),
        };
        let mut out = vec![0f64; n * rows];
        for i in 0..n {
            for r in 0..rows {
                out[i * rows + r] = (0..cols)
                    .map(|c| xs[i * cols + c] * dq[r * cols + c] as f64)
                    .sum();
            }
        }
        out
    }

    /// Every kernel set this CPU has, on shapes with partial blocks, gives the reference
    /// within a pinned error (relative to Σ|terms|): float sums in another order, nothing else.
    /// One shape (260 × 1056) is large enough for the GEMV to split its rows into tasks, so
    /// that tasks start past row 0.
    #[test]
    fn kernels_match_the_reference_on_every_format_and_shape() {
        const {
            assert!(
                260 * 1056 >= PARALLEL_MIN_WEIGHTS,
                "a shape split into tasks"
            )
        };
        let mut rng = Rng(3);
        for format in FORMATS {
            for (rows, cols) in [
                (7, 33),
                (64, 256),
                (3, 31),
                (130, 1000),
                (260, 1056),
                (1, 1),
            ] {
                let weights: Vec<f32> = (0..rows * cols).map(|_| rng.uniform() * 0.1).collect();
                let w = PackedMatrix::encode(&weights, rows, cols, format).unwrap();
                for n in [1, 3, GEMM_MIN_ROWS + 1] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform()).collect();
                    let bound: Vec<f64> = {
                        let abs_x: Vec<f32> = x.iter().map(|v| v.abs()).collect();
                        let abs_w: Vec<f32> = weights.iter().map(|v| v.abs()).collect();
                        let aw =
                            PackedMatrix::encode(&abs_w, rows, cols, MatrixFormat::F32).unwrap();
                        reference(&abs_x, n, &aw.view(), false)
                    };
                    // (name, result, whether its activations were rounded)
                    let mut runs: Vec<(&str, Vec<f32>, bool)> = Vec::new();
                    let mut got = vec![f32::NAN; n * rows];
                    matmul(&x, n, w.view(), &mut got).unwrap();
                    runs.push(("dispatched", got, rounds_activations(format, n)));
                    if n < GEMM_MIN_ROWS {
                        for k in kernels::available() {
                            let mut got = vec![f32::NAN; n * rows];
                            gemv(&x, n, w.view(), &mut got, k).unwrap();
                            runs.push((k.name, got, rounds_activations(format, n)));
                        }
                    } else if let MatrixFormat::Quant(bits) = format {
                        // The integer GEMM's scalar reference, on every CPU.
                        let mut got = vec![f32::NAN; n * rows];
                        gemm_int(&x, n, w.view(), bits, &SCALAR_GEMM, &mut got);
                        runs.push(("integer GEMM (scalar)", got, true));
                    }
                    // The f64 references, plain and with rounded activations, once each.
                    let mut wants: [Option<Vec<f64>>; 2] = [None, None];
                    for (name, got, rounded) in runs {
                        let want = wants[usize::from(rounded)]
                            .get_or_insert_with(|| reference(&x, n, &w.view(), rounded));
                        for j in 0..n * rows {
                            let tol = 3e-5 * bound[j] + 1e-30;
                            let err = (got[j] as f64 - want[j]).abs();
                            assert!(
                                err <= tol,
                                "{} {name} [{rows}, {cols}] n={n} #{j}: {} vs {} (err {err:e} > {tol:e})",
                                format.name(),
                                got[j],
                                want[j]
                            );
                        }
                    }
                }
            }
        }
    }

    /// `x · wᵀ` by the scalar integer GEMM over the whole matrix at once (no tiles, no threads),
    /// on activation codes in `layout` (unsigned ones with the bias).
    fn int_gemm_whole(
        x: &[f32],
        n: usize,
        w: &MatrixRef<'_>,
        bits: QuantBits,
        layout: ActLayout,
    ) -> Vec<f32> {
        let (rows, cols) = (w.rows(), w.cols());
        let mut acts = GemmActs::default();
        int_gemm::prepare_acts(
            x,
            n,
            cols,
            bits,
            &mut acts,
            layout,
            kernels::scalar::quantize_activations,
        );
        let (mut codes, mut bias) = (Vec::new(), Vec::new());
        let codes = int_gemm::prepare_rows(w.data(), bits, cols, rows, &mut codes, &mut bias);
        if layout.signed() {
            bias.clear();
        }
        let tile = GemmRows::new(codes, &mut bias, w.scales(), rows, acts.blocks, bits);
        let stride = acts.groups * LANES;
        let mut products = vec![0f32; rows * stride];
        int_gemm::gemm_quant(&tile, &acts, &mut products);
        let mut out = vec![0f32; n * rows];
        for r in 0..rows {
            for i in 0..n {
                out[i * rows + r] = products[r * stride + i];
            }
        }
        out
    }

    /// Every integer GEMM kernel this CPU has gives the scalar reference's results bit for bit,
    /// over the codes' full two's-complement range, on shapes that leave partial blocks, partial
    /// groups of activation rows and partial micro-tiles.
    #[test]
    fn integer_gemm_kernels_give_the_reference_bit_for_bit() {
        let kernels = kernels::int_gemms();
        if kernels.is_empty() {
            eprintln!("no integer GEMM kernel on this CPU: nothing to compare");
        }
        set_compute_threads(2);
        for int in kernels {
            let mut rng = Rng(17);
            for bits in QuantBits::ALL {
                for (rows, cols, n) in [
                    (13, 64, 37),
                    (7, 100, 8),
                    (TILE_ROWS + 5, 96, 16),
                    (6, 32, 33),
                    // Scale groups of eight blocks (INT4, INT2): two whole ones, and a whole
                    // one with a partial one ending in a partial block.
                    (5, 512, 17),
                    (9, 300, 20),
                ] {
                    let data = rng.bytes(rows * bits.row_bytes(cols));
                    let scales: Vec<f32> = (0..rows).map(|_| rng.uniform()).collect();
                    let w = MatrixRef::new(MatrixFormat::Quant(bits), rows, cols, &data, &scales)
                        .unwrap();
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform() * 3.0).collect();
                    let want = int_gemm_whole(&x, n, &w, bits, ActLayout::Unsigned);
                    let mut got = vec![f32::NAN; n * rows];
                    gemm_int(&x, n, w, bits, int, &mut got);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(g, e)| g.to_bits() == e.to_bits());
                    assert!(same, "{} {} [{rows}, {cols}] n={n}", int.name, bits.name());
                }
            }
        }
    }

    /// The tile's products land in the output's layout, every value in its place and nothing
    /// outside the tile's columns written: shapes with whole SIMD blocks, partial ones on
    /// either edge, and none.
    #[test]
    fn products_are_transposed_into_their_columns() {
        for (rows, n, stride) in [
            (16, 16, 16),
            (13, 37, 48),
            (8, 5, 16),
            (3, 9, 9),
            (21, 8, 8),
        ] {
            let products: Vec<f32> = (0..rows * stride).map(|i| i as f32).collect();
            let (start, out_stride) = (3, rows + 5);
            let mut out = vec![-1f32; n * out_stride];
            // SAFETY: `out` holds `n` rows of `out_stride ≥ start + rows` floats.
            unsafe {
                int_gemm::transpose_products(
                    &products,
                    stride,
                    rows,
                    n,
                    out.as_mut_ptr().add(start),
                    out_stride,
                )
            };
            for t in 0..n {
                for c in 0..out_stride {
                    let want = if (start..start + rows).contains(&c) {
                        products[(c - start) * stride + t]
                    } else {
                        -1.0
                    };
                    assert_eq!(out[t * out_stride + c], want, "[{rows}, {n}] at ({t}, {c})");
                }
            }
        }
    }

    /// The reference GEMM gives the same bits on signed activation codes (no bias), in either
    /// signed layout, as on unsigned ones with the bias: the forms the kernels take are one
    /// integer sum.
    #[test]
    fn every_activation_layout_gives_the_same_bits() {
        let mut rng = Rng(29);
        for bits in QuantBits::ALL {
            for (rows, cols, n) in [(5, 64, 17), (9, 100, 8), (3, 32, 40), (4, 300, 9)] {
                let data = rng.bytes(rows * bits.row_bytes(cols));
                let scales: Vec<f32> = (0..rows).map(|_| rng.uniform()).collect();
                let w =
                    MatrixRef::new(MatrixFormat::Quant(bits), rows, cols, &data, &scales).unwrap();
                let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform() * 5.0).collect();
                let unsigned = int_gemm_whole(&x, n, &w, bits, ActLayout::Unsigned);
                assert!(
                    unsigned.iter().any(|v| *v != 0.0),
                    "{} all zero",
                    bits.name()
                );
                for layout in [ActLayout::Signed, ActLayout::SignedPairs] {
                    let signed = int_gemm_whole(&x, n, &w, bits, layout);
                    let same = unsigned
                        .iter()
                        .zip(&signed)
                        .all(|(u, s)| u.to_bits() == s.to_bits());
                    assert!(same, "{layout:?} {} [{rows}, {cols}] n={n}", bits.name());
                }
            }
        }
    }

    /// Every kernel set rounds activations to the scalar reference's codes and scales bit for
    /// bit: random rows, rows of exact halves (a block whose maximum is 127 has scale 1, so
    /// `k + 0.5` and its neighbours one ulp away are rounded as they are), zero blocks, and
    /// rows ending in a partial block.
    #[test]
    fn activation_rounding_is_the_references_in_every_kernel_set() {
        let mut rng = Rng(5);
        for bits in QuantBits::ALL {
            for cols in [32, 64, 100, 2048] {
                let random: Vec<f32> = (0..cols).map(|_| rng.uniform() * 7.0).collect();
                let halves: Vec<f32> = (0..cols)
                    .map(|i| match i % 32 {
                        0 => 127.0,
                        j => {
                            let v = (j as f32 - 16.0) * 3.0 + 0.5;
                            match i / 32 % 3 {
                                0 => v,
                                1 => f32::from_bits(v.to_bits() + 1),
                                _ => f32::from_bits(v.to_bits() - 1),
                            }
                        }
                    })
                    .collect();
                let zeros = vec![0f32; cols];
                for x in [random, halves, zeros] {
                    let blocks = cols.div_ceil(BLOCK);
                    let (mut want_codes, mut want_scales) =
                        (vec![0i8; blocks * BLOCK], vec![0f32; blocks]);
                    kernels::scalar::quantize_activations(
                        &x,
                        bits,
                        &mut want_codes,
                        &mut want_scales,
                    );
                    for k in kernels::available() {
                        let (mut codes, mut scales) =
                            (vec![0i8; blocks * BLOCK], vec![0f32; blocks]);
                        (k.quantize_activations)(&x, bits, &mut codes, &mut scales);
                        assert_eq!(codes, want_codes, "{} {} cols={cols}", k.name, bits.name());
                        let same = scales
                            .iter()
                            .zip(&want_scales)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{} {} cols={cols}", k.name, bits.name());
                    }
                }
            }
        }
    }

    /// Integer kernels decode the full two's-complement range (codes quantization never
    /// writes, as a hostile file could hold): every SIMD set gives the scalar's integer sums.
    #[test]
    fn integer_kernels_agree_on_random_codes() {
        let mut rng = Rng(11);
        for bits in QuantBits::ALL {
            for cols in [32, 96, 100, 4096] {
                let rows = 5;
                let data = rng.bytes(rows * bits.row_bytes(cols));
                let scales: Vec<f32> = (0..rows).map(|_| rng.uniform()).collect();
                let w =
                    MatrixRef::new(MatrixFormat::Quant(bits), rows, cols, &data, &scales).unwrap();
                let x: Vec<f32> = (0..cols).map(|_| rng.uniform() * 3.0).collect();
                let mut want = vec![0f32; rows];
                gemv(&x, 1, w, &mut want, &kernels::SCALAR).unwrap();
                for k in kernels::available() {
                    let mut got = vec![0f32; rows];
                    gemv(&x, 1, w, &mut got, k).unwrap();
                    for (g, e) in got.iter().zip(&want) {
                        assert!(
                            (g - e).abs() <= 1e-5 * e.abs().max(1.0),
                            "{} {} cols={cols}: {g} vs {e}",
                            k.name,
                            bits.name()
                        );
                    }
                }
            }
        }
    }

    /// A row's product does not depend on how many activation rows come with it (a beam of
    /// one or several): one activation row takes the four-row kernels where the set has them,
    /// several take the several-row INT8 and f16 kernels (in groups, then one by one) or go
    /// row by row, and all give the same bits in every format and kernel set.
    #[test]
    fn one_activation_row_gives_each_beams_bits() {
        let mut rng = Rng(12);
        for format in FORMATS {
            for cols in [32, 64, 96, 100, 2080, 4096] {
                let rows = 9;
                // Integer rows: random bytes (every code); float rows: encoded random weights.
                let scales: Vec<f32> = (0..rows).map(|_| rng.uniform()).collect();
                let (data, packed);
                let w = match format {
                    MatrixFormat::Quant(bits) => {
                        data = rng.bytes(rows * bits.row_bytes(cols));
                        MatrixRef::new(format, rows, cols, &data, &scales).unwrap()
                    }
                    _ => {
                        let weights: Vec<f32> = (0..rows * cols).map(|_| rng.uniform()).collect();
                        packed = PackedMatrix::encode(&weights, rows, cols, format).unwrap();
                        packed.view()
                    }
                };
                let beams: Vec<Vec<f32>> = (0..7)
                    .map(|_| (0..cols).map(|_| rng.uniform() * 3.0).collect())
                    .collect();
                for k in kernels::available() {
                    let alone: Vec<Vec<f32>> = beams
                        .iter()
                        .map(|x| {
                            let mut one = vec![0f32; rows];
                            gemv(x, 1, w, &mut one, k).unwrap();
                            one
                        })
                        .collect();
                    assert_ne!(alone[0], alone[1], "the beams' products differ");
                    for n in 2..=beams.len() {
                        let x: Vec<f32> = beams[..n].concat();
                        let mut together = vec![0f32; n * rows];
                        gemv(&x, n, w, &mut together, k).unwrap();
                        for (beam, (got, one)) in
                            together.chunks_exact(rows).zip(&alone).enumerate()
                        {
                            let same = got.iter().zip(one).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(
                                same,
                                "{} {} cols={cols} n={n} beam {beam}",
                                k.name,
                                format.name()
                            );
                        }
                    }
                }
            }
        }
    }

    /// `matmul(x, n, w)` equals `want` bit for bit.
    fn assert_matmul_gives(x: &[f32], n: usize, w: &PackedMatrix, want: &[f32], path: &str) {
        let mut got = vec![f32::NAN; want.len()];
        matmul(x, n, w.view(), &mut got).unwrap();
        let same = got
            .iter()
            .zip(want)
            .all(|(g, e)| g.to_bits() == e.to_bits());
        assert!(same, "{} n={n} ({path})", w.view().format().name());
    }

    /// Every float GEMM kernel this CPU has gives the scalar reference's results bit for bit:
    /// the activations' layout (groups full, partial and of a single row), the micro-kernel
    /// (every panel height on whole and half groups, sums continued from what `out` holds,
    /// rows wider than the columns taken, blocks of no column, of one and of a few) and the
    /// sums written back (partial vectors of rows, one lane to a whole group, and nothing
    /// written outside its rows).
    #[test]
    fn float_gemm_kernels_give_the_reference_bit_for_bit() {
        use crate::quant::kernels::float_gemm::{self as fgemm, FloatActs};
        let kernels = kernels::float_gemms();
        if kernels.is_empty() {
            eprintln!("no float GEMM kernel on this CPU: nothing to compare");
        }
        let same = |a: &[f32], b: &[f32]| {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
        };
        for kernel in kernels {
            let mut rng = Rng(41);
            for (n, cols) in [
                (1, 5),
                (8, 200),
                (20, 33),
                (37, 64),
                (50, 16),
                (64, 3),
                (5, 0),
            ] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform() * 4.0).collect();
                let (mut want, mut got) = (FloatActs::default(), FloatActs::default());
                fgemm::prepare_acts(&x, n, cols, &mut want);
                got.values = vec![f32::NAN; 7];
                (kernel.prepare_acts)(&x, n, cols, &mut got);
                assert!(
                    same(&got.values, &want.values),
                    "{} acts n={n}",
                    kernel.name
                );
                assert_eq!(
                    (got.rows, got.groups, got.cols),
                    (n, n.div_ceil(GROUP), cols)
                );
            }
            for (lanes, most) in [
                (GROUP, PANEL),
                (20, PANEL),
                (HALF, 2 * PANEL),
                (3, 2 * PANEL),
            ] {
                for rows in 1..=most {
                    for (stride, cols) in [(40, 37), (9, 1), (300, 257), (8, 0)] {
                        let w: Vec<f32> = (0..rows * stride).map(|_| rng.uniform()).collect();
                        let acts: Vec<f32> = (0..cols * GROUP).map(|_| rng.uniform()).collect();
                        let start: Vec<f32> = (0..rows * GROUP).map(|_| rng.uniform()).collect();
                        let mut want = start.clone();
                        fgemm::panel(&w, rows, stride, cols, &acts, lanes, &mut want, false);
                        // Asking for the next panel's rows (past `w` here) changes nothing.
                        for prefetch in [false, true] {
                            let mut got = start.clone();
                            (kernel.panel)(
                                &w, rows, stride, cols, &acts, lanes, &mut got, prefetch,
                            );
                            assert!(
                                same(&got, &want),
                                "{} panel: {rows} rows, {lanes} lanes, {cols} columns, \
                                 prefetch {prefetch}",
                                kernel.name
                            );
                        }
                    }
                }
            }
            for (rows, lanes, stride) in [
                (1, 1, 1),
                (15, 32, 20),
                (16, 9, 16),
                (17, 32, 50),
                (48, 16, 48),
            ] {
                let sums: Vec<f32> = (0..rows * GROUP).map(|_| rng.uniform()).collect();
                let len = lanes * stride + 3;
                let (mut want, mut got) = (vec![-7.0f32; len], vec![-7.0f32; len]);
                fgemm::write_sums(&sums, rows, lanes, &mut want, stride);
                (kernel.write_sums)(&sums, rows, lanes, &mut got, stride);
                assert!(
                    same(&got, &want),
                    "{} sums: {rows} rows, {lanes} lanes",
                    kernel.name
                );
            }
        }
    }

    /// `x · wᵀ` as the float GEMM defines it: each output one chain of FMAs over its whole row,
    /// in column order, from zero (no tiles, no threads).
    fn fma_chains_whole(x: &[f32], n: usize, w: &MatrixRef<'_>) -> Vec<f32> {
        let (rows, cols) = (w.rows(), w.cols());
        let mut whole = vec![0f32; rows * cols];
        w.dequantize_rows(0, rows, &mut whole).unwrap();
        let mut out = vec![0f32; n * rows];
        for (xs, out) in x.chunks_exact(cols).zip(out.chunks_exact_mut(rows)) {
            for (o, ws) in out.iter_mut().zip(whole.chunks_exact(cols)) {
                *o = xs
                    .iter()
                    .zip(ws)
                    .fold(0f32, |sum, (&a, &b)| a.mul_add(b, sum));
            }
        }
        out
    }

    /// The GEMM paths spread their work over the compute threads and give exactly what one
    /// thread computing the whole product gives, so no output depends on `--threads`:
    /// - the float GEMM (up to [`FLOAT_GEMM_MAX_ROWS`] activation rows, where the CPU has one):
    ///   one FMA chain per output over its whole row, whatever the tasks, panels and column
    ///   blocks (uneven last task, panel and block; a group of a few rows, of more than half a
    ///   group, and one full group with a partial one);
    /// - libtorch's GEMM in tiles of [`TILE_ROWS`] weight rows: one GEMM per tile on one
    ///   thread, each tile in its own columns (uneven last tile): MKL's packed GEMM on
    ///   activations packed once where libtorch links MKL, libtorch's `mm` elsewhere;
    /// - integer formats on a CPU with an integer GEMM: the scalar integer GEMM over the whole
    ///   matrix.
    #[test]
    fn gemm_tiles_give_one_threads_tile_products_bit_for_bit() {
        // libtorch on one thread here too, as the CLI sets it and every compute thread does:
        // MKL's or OpenBLAS's products on several threads may round differently.
        tch::set_num_threads(1);
        set_compute_threads(2);
        let mut rng = Rng(5);
        let (rows, cols) = (3 * TILE_ROWS + 17, 200);
        let weights: Vec<f32> = (0..rows * cols).map(|_| rng.uniform()).collect();
        for format in FORMATS {
            let w = PackedMatrix::encode(&weights, rows, cols, format).unwrap();
            if let (MatrixFormat::Quant(bits), Some(_)) = (format, kernels::int_gemm()) {
                // The integer GEMM: each output is one kernel's sum over its whole row.
                for n in [GEMM_MIN_ROWS, 37] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform()).collect();
                    let want = int_gemm_whole(&x, n, &w.view(), bits, ActLayout::Unsigned);
                    assert_matmul_gives(&x, n, &w, &want, "integer GEMM");
                }
                continue;
            }
            if kernels::float_gemm().is_some() {
                for n in [GEMM_MIN_ROWS, 17, 37, FLOAT_GEMM_MAX_ROWS] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform()).collect();
                    let want = fma_chains_whole(&x, n, &w.view());
                    assert_matmul_gives(&x, n, &w, &want, "float GEMM");
                }
            }
            let mut whole = vec![0f32; rows * cols];
            w.view().dequantize_rows(0, rows, &mut whole).unwrap();
            let whole = Tensor::from_slice(&whole).view([rows as i64, cols as i64]);
            let tiled: &[usize] = if kernels::float_gemm().is_some() {
                &[FLOAT_GEMM_MAX_ROWS + 1, 150]
            } else {
                &[GEMM_MIN_ROWS, 37]
            };
            for &n in tiled {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform()).collect();
                let want = tile_products(&x, n, &whole);
                assert_matmul_gives(&x, n, &w, &want, "GEMM tiles");
            }
        }
    }

    /// `x · wholeᵀ` tile by tile on this thread, as [`gemm`] computes it: one product per
    /// [`TILE_ROWS`] weight rows, on activations packed once where MKL's packed GEMM exists.
    fn tile_products(x: &[f32], n: usize, whole: &Tensor) -> Vec<f32> {
        let (rows, cols) = (whole.size()[0] as usize, whole.size()[1] as usize);
        let mut buffer = PackBuffer::new();
        if let Some(packed) = PackedActs::pack(&mut buffer, x, n, cols, TILE_ROWS, rows) {
            let weights = Vec::<f32>::try_from(whole.flatten(0, -1)).unwrap();
            let mut out = vec![0f32; n * rows];
            for start in (0..rows).step_by(TILE_ROWS) {
                let end = (start + TILE_ROWS).min(rows);
                // SAFETY: `out` is `[n, rows]`; columns `start..end` of every row.
                unsafe {
                    packed.multiply(
                        &weights[start * cols..end * cols],
                        out[start..].as_mut_ptr(),
                        rows,
                    )
                };
            }
            return out;
        }
        let xt = Tensor::from_slice(x).view([n as i64, cols as i64]);
        let tiles: Vec<Tensor> = (0..rows)
            .step_by(TILE_ROWS)
            .map(|start| {
                let len = TILE_ROWS.min(rows - start) as i64;
                xt.mm(&whole.narrow(0, start as i64, len).tr())
            })
            .collect();
        Vec::<f32>::try_from(Tensor::cat(&tiles, 1).flatten(0, -1)).unwrap()
    }

    /// `matvec_gated` gives, row by row, `combine` of the two products `matmul` gives, bit for
    /// bit: every format for gate and up alike and two of them mixed, on the compute threads
    /// (a shape large enough to split into tasks, its last task short) and on the calling
    /// thread alone (a small shape whose rows are no multiple of four). A combination that
    /// tells its operands apart (`g − 2u`), so that swapped operands fail too.
    #[test]
    fn gated_products_equal_two_products_combined() {
        set_compute_threads(2);
        let mut rng = Rng(41);
        let mut pairs: Vec<(MatrixFormat, MatrixFormat)> =
            FORMATS.iter().map(|&f| (f, f)).collect();
        pairs.push((
            MatrixFormat::Quant(QuantBits::Int4),
            MatrixFormat::Quant(QuantBits::Int8),
        ));
        pairs.push((MatrixFormat::F16, MatrixFormat::Quant(QuantBits::Int2)));
        for (gate_format, up_format) in pairs {
            for (rows, cols) in [(4 * ROWS_PER_TASK + 9, 600), (13, 70)] {
                let encode = |rng: &mut Rng, format| {
                    let w: Vec<f32> = (0..rows * cols).map(|_| rng.uniform()).collect();
                    PackedMatrix::encode(&w, rows, cols, format).unwrap()
                };
                let (gate, up) = (encode(&mut rng, gate_format), encode(&mut rng, up_format));
                let x: Vec<f32> = (0..cols).map(|_| rng.uniform()).collect();
                let (mut g, mut u) = (vec![0f32; rows], vec![0f32; rows]);
                matmul(&x, 1, gate.view(), &mut g).unwrap();
                matmul(&x, 1, up.view(), &mut u).unwrap();
                let mut got = vec![f32::NAN; rows];
                matvec_gated(&x, gate.view(), up.view(), |g, u| g - 2.0 * u, &mut got).unwrap();
                for r in 0..rows {
                    let want = g[r] - 2.0 * u[r];
                    assert_eq!(
                        got[r].to_bits(),
                        want.to_bits(),
                        "{} × {} [{rows}, {cols}] row {r}: {} vs {want}",
                        gate_format.name(),
                        up_format.name(),
                        got[r]
                    );
                }
            }
        }
        let (a, b) = (
            PackedMatrix::encode(&[0.0; 6], 2, 3, MatrixFormat::F32).unwrap(),
            PackedMatrix::encode(&[0.0; 6], 3, 2, MatrixFormat::F32).unwrap(),
        );
        let mut out = [0f32; 2];
        assert!(matvec_gated(&[0.0; 3], a.view(), b.view(), |g, _| g, &mut out).is_err());
        // No columns: every product is 0.
        let empty = PackedMatrix::encode(&[], 2, 0, MatrixFormat::Quant(QuantBits::Int4)).unwrap();
        matvec_gated(
            &[],
            empty.view(),
            empty.view(),
            |g, u| g + u + 1.0,
            &mut out,
        )
        .unwrap();
        assert_eq!(out, [1.0, 1.0]);
    }

    /// The tiles' products are `x · wᵀ`: within f32 rounding of libtorch's whole-matrix
    /// product, on every tile (the uneven last one too), at the encoder's widths and at one
    /// that is not a multiple of any vector. (Where MKL's packed GEMM exists, this is what
    /// checks its operands' layouts, transposes and output stride.)
    #[test]
    fn gemm_tiles_equal_the_whole_product() {
        tch::set_num_threads(1);
        set_compute_threads(2);
        let mut rng = Rng(11);
        for (n, rows, cols) in [
            (150, 3 * TILE_ROWS + 17, 200),
            (200, 2 * TILE_ROWS, 3072),
            (129, 768, 77),
        ] {
            let weights: Vec<f32> = (0..rows * cols).map(|_| rng.uniform()).collect();
            let x: Vec<f32> = (0..n * cols).map(|_| rng.uniform()).collect();
            let w = PackedMatrix::encode(&weights, rows, cols, MatrixFormat::F32).unwrap();
            let mut got = vec![f32::NAN; n * rows];
            gemm(&x, n, w.view(), &mut got).unwrap();
            let want =
                Tensor::from_slice(&x)
                    .view([n as i64, cols as i64])
                    .mm(&Tensor::from_slice(&weights)
                        .view([rows as i64, cols as i64])
                        .tr());
            let want = Vec::<f32>::try_from(want.flatten(0, -1)).unwrap();
            for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                let tolerance = 1e-5 * (cols as f32).sqrt() * (1.0 + e.abs());
                assert!(
                    (g - e).abs() <= tolerance,
                    "[{n}, {rows}, {cols}] output {} of row {}: {g} against {e}",
                    i % rows,
                    i / rows
                );
            }
        }
    }

    #[test]
    fn shapes_are_checked() {
        assert!(MatrixRef::new(MatrixFormat::F16, 2, 3, &[0; 11], &[]).is_err());
        assert!(
            MatrixRef::new(MatrixFormat::Quant(QuantBits::Int4), 2, 3, &[0; 4], &[1.0]).is_err()
        );
        let w = PackedMatrix::encode(&[1.0; 6], 2, 3, MatrixFormat::F16).unwrap();
        let mut out = [0f32; 3];
        assert!(matmul(&[1.0; 3], 1, w.view(), &mut out).is_err());
    }
}
