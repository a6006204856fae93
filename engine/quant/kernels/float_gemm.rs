//! The float GEMM's operands and its scalar reference.
//!
//! Many activation rows (an encoder pass, a prompt prefill) against weights computed in f32:
//! `out[t, r] = Σ_c x[t, c] · w[r, c]`, each output summed in the order of `c` by one fused
//! multiply-add per value, starting from zero. That order is the whole definition: a kernel
//! keeps one accumulator per output, so every kernel gives the reference's bits, and no
//! blocking of rows, columns or threads can change a result.
//!
//! The layout puts activation rows in vector lanes, as the integer GEMM does
//! ([`super::gemm`]):
//! - activations ([`FloatActs`]) are transposed once per product into groups of [`GROUP`] rows,
//!   `[group][col][GROUP]`: the values of one column for 32 rows are two 512-bit vectors;
//! - weights stay rows of f32 (f16/bf16/integer rows are widened by the caller), each value
//!   broadcast to every lane.
//!
//! A micro-kernel holds [`PANEL`] weight rows × [`GROUP`] activation rows of sums in registers
//! (12 of AVX-512's 32) over a block of columns: per column, two vector loads, six broadcasts
//! and twelve FMAs. A group of at most [`HALF`] rows takes one vector per column and twice the
//! weight rows instead, so that it still keeps twelve FMA chains in flight. (AVX2's sixteen
//! 256-bit registers take a panel as two halves of [`HALF`] lanes, six rows at a time.)

/// Activation rows per group (two 512-bit registers of f32).
pub(crate) const GROUP: usize = 32;
/// The rows of a group that one vector holds: a group with no more rows than this is computed
/// on its first half only.
pub(crate) const HALF: usize = GROUP / 2;
/// Weight rows per micro-kernel call.
pub(crate) const PANEL: usize = 6;

/// Activation rows transposed into groups of [`GROUP`] (see the module). Kept between
/// products (its buffer is reused).
#[derive(Default)]
pub(crate) struct FloatActs {
    /// `[groups][cols][GROUP]`; rows past the last are zeros.
    pub values: Vec<f32>,
    pub rows: usize,
    pub groups: usize,
    pub cols: usize,
}

impl FloatActs {
    /// Sizes the buffer for `n` rows of `cols` values, every value a zero.
    #[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
    pub fn reset(&mut self, n: usize, cols: usize) {
        self.rows = n;
        self.groups = n.div_ceil(GROUP);
        self.cols = cols;
        self.values.clear();
        self.values.resize(self.groups * cols * GROUP, 0.0);
    }

    /// Group `g`'s `cols × GROUP` values.
    pub fn group(&self, g: usize) -> &[f32] {
        let len = self.cols * GROUP;
        &self.values[g * len..(g + 1) * len]
    }

    /// Rows of group `g` that hold activations.
    pub fn lanes(&self, g: usize) -> usize {
        GROUP.min(self.rows - g * GROUP)
    }
}

/// Lays out `x` (`[n, cols]` row-major) in `acts` (sized by [`FloatActs::reset`] here).
pub(crate) type PrepareFloatActs = fn(x: &[f32], n: usize, cols: usize, acts: &mut FloatActs);

/// The reference [`PrepareFloatActs`].
#[cfg(test)]
pub(crate) fn prepare_acts(x: &[f32], n: usize, cols: usize, acts: &mut FloatActs) {
    acts.reset(n, cols);
    for (t, row) in x.chunks_exact(cols.max(1)).take(n).enumerate() {
        let (group, lane) = (t / GROUP, t % GROUP);
        for (c, &v) in row.iter().enumerate() {
            acts.values[(group * cols + c) * GROUP + lane] = v;
        }
    }
}

/// `out[j × GROUP + lane] += Σ_c w[j × stride + c] · acts[c × GROUP + lane]` over `c <
/// cols`, for the `rows` weight rows of `w` (row `j` at `j × stride`) and the first `lanes`
/// rows of one group: up to [`PANEL`] rows against all [`GROUP`] lanes, or, where `lanes` ≤
/// [`HALF`], up to `2 × PANEL` rows against the first half (lanes past it are then left as
/// they are): each sum continues, value after value, from what `out` holds (zeros for
/// a new product), so a row taken in column blocks gives the bits of the whole row. `out`
/// holds at least `rows × GROUP` values.
///
/// With `prefetch_next`, a kernel may also ask for the same columns of the rows after these
/// (the caller's next panel) while it computes: worth it where the weights are read from
/// memory where they lie. A hint, never a change to a result.
pub(crate) type FloatPanel = fn(
    w: &[f32],
    rows: usize,
    stride: usize,
    cols: usize,
    acts: &[f32],
    lanes: usize,
    out: &mut [f32],
    prefetch_next: bool,
);

/// `out[t × stride + r] = sums[r × GROUP + t]` for `r < rows`, `t < lanes`: a task's sums back
/// into the rows of the product.
pub(crate) type WriteSums =
    fn(sums: &[f32], rows: usize, lanes: usize, out: &mut [f32], stride: usize);

/// A float GEMM's kernels and its name.
pub(crate) struct FloatGemm {
    pub name: &'static str,
    pub prepare_acts: PrepareFloatActs,
    pub panel: FloatPanel,
    pub write_sums: WriteSums,
}

/// Asserts that everything a [`FloatPanel`] reads and writes lies inside its operands.
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
pub(crate) fn check_operands(
    w: &[f32],
    rows: usize,
    stride: usize,
    cols: usize,
    acts: &[f32],
    lanes: usize,
    out: &[f32],
) {
    let most = if lanes <= HALF { 2 * PANEL } else { PANEL };
    assert!((1..=most).contains(&rows) && lanes <= GROUP && cols <= stride);
    assert!(w.len() >= (rows - 1) * stride + cols);
    assert!(acts.len() >= cols * GROUP);
    assert!(out.len() >= rows * GROUP);
}

/// Asserts that everything a [`WriteSums`] reads and writes lies inside its operands.
#[cfg_attr(not(any(test, target_arch = "x86_64")), allow(dead_code))]
pub(crate) fn check_sums(sums: &[f32], rows: usize, lanes: usize, out: &[f32], stride: usize) {
    assert!(lanes <= GROUP && rows <= stride);
    assert!(sums.len() >= rows * GROUP);
    assert!(lanes == 0 || out.len() >= (lanes - 1) * stride + rows);
}

/// The reference [`FloatPanel`]: every SIMD kernel gives its results bit for bit.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn panel(
    w: &[f32],
    rows: usize,
    stride: usize,
    cols: usize,
    acts: &[f32],
    lanes: usize,
    out: &mut [f32],
    _prefetch_next: bool,
) {
    check_operands(w, rows, stride, cols, acts, lanes, out);
    let lanes = if lanes <= HALF { HALF } else { GROUP };
    for j in 0..rows {
        let row = &w[j * stride..j * stride + cols];
        for lane in 0..lanes {
            let sum = &mut out[j * GROUP + lane];
            *sum = row
                .iter()
                .enumerate()
                .fold(*sum, |sum, (c, &v)| acts[c * GROUP + lane].mul_add(v, sum));
        }
    }
}

/// The reference [`WriteSums`].
#[cfg(test)]
pub(crate) fn write_sums(sums: &[f32], rows: usize, lanes: usize, out: &mut [f32], stride: usize) {
    check_sums(sums, rows, lanes, out, stride);
    for t in 0..lanes {
        for r in 0..rows {
            out[t * stride + r] = sums[r * GROUP + t];
        }
    }
}
