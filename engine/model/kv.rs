//! Attention caches held in a chosen format ([`KvFormat`]): f32 (the parity reference, and the
//! default), f16, or INT8 in blocks of [`INT8_BLOCK`] values with one f32 scale each.
//!
//! A decode step reads its whole cache: for an encoder-decoder, the cross-attention keys and
//! values over the source, every layer, every step (26 MB of f32 for switch-base-8 over a
//! 353-token dialogue, more than a quarter of what an INT8 step reads besides); for a
//! decoder-only model, the self-attention keys and values of the prompt and every token since,
//! each row quantized on its own as it is appended. Held narrower, the step reads fewer bytes.
//! Attention itself stays f32: a row is widened (f16, exactly) or dequantized (INT8: code ×
//! scale) into a small scratch row as the walk reaches it, so the result is, bit for bit, the
//! f32 attention over the rounded cache.
//!
//! Two layouts: [`KvCacheRows`], token-major, for caches that grow a row per token (a
//! decoder-only model's self-attention); and [`SourceKv`] for a cache over a fixed source (an
//! encoder-decoder's cross-attention), whose keys are held by dimension so that a head's scores
//! over every source token are sums of whole vectors, `Σ_d q[d] × keys[d][..]`, instead of one
//! dot product and one sum across a vector's lanes per token and head.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use super::layers::{mix_values, CachedKv};
use crate::quant::kernels::{self, prefetch_bytes};

/// How an attention cache holds its keys and values (`--kv-cache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvFormat {
    /// As computed: the attention of the reference.
    #[default]
    F32,
    /// Rounded to half precision (llama.cpp's default cache type).
    F16,
    /// Blocks of [`INT8_BLOCK`] values within a row, each `code × scale` with `scale = max |x|
    /// / 127`: error at most half a step, `max |x| / 254`, per value.
    Int8,
}

/// Values per INT8 block (one f32 scale each), as in llama.cpp's `Q8_0`; a row's last block
/// may be shorter.
pub const INT8_BLOCK: usize = 32;

impl KvFormat {
    pub const ALL: [KvFormat; 3] = [KvFormat::F32, KvFormat::F16, KvFormat::Int8];

    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::F16 => "f16",
            KvFormat::Int8 => "int8",
        }
    }

    /// Bytes held for `rows` rows of `width` values.
    pub fn bytes(self, rows: u64, width: u64) -> u64 {
        let values = rows.saturating_mul(width);
        match self {
            KvFormat::F32 => values.saturating_mul(4),
            KvFormat::F16 => values.saturating_mul(2),
            KvFormat::Int8 => {
                let scales = rows.saturating_mul(width.div_ceil(INT8_BLOCK as u64));
                values.saturating_add(scales.saturating_mul(4))
            }
        }
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvFormat {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        KvFormat::ALL
            .into_iter()
            .find(|format| format.name() == text)
            .ok_or_else(|| format!("`{text}` is not a KV cache format: f32, f16 or int8"))
    }
}

/// Token-major rows of `width` values a cached attention walks ([`super::layers::CachedKv`]),
/// each row handed over as f32.
pub trait KvRows: Sync {
    /// Whether rows are widened into the caller's scratch row (f32 rows are lent as they are,
    /// and need none).
    const WIDENS: bool;

    /// Rows held.
    fn rows(&self, width: usize) -> usize;

    /// Row `t`'s values: the stored row itself where it is f32, else widened into `scratch`
    /// (`width` values).
    #[inline(always)]
    fn row<'s>(&'s self, t: usize, width: usize, scratch: &'s mut [f32]) -> &'s [f32] {
        self.part(t, width, 0..width, scratch)
    }

    /// Columns `span` of row `t`, the same values as those of [`Self::row`]: the stored values
    /// themselves where they are f32, else widened into `scratch` (at least `span.len()`
    /// values). A thread attending some of the heads widens only their columns.
    fn part<'s>(
        &'s self,
        t: usize,
        width: usize,
        span: Range<usize>,
        scratch: &'s mut [f32],
    ) -> &'s [f32];

    /// Asks for the bytes of columns `span` of row `t` ahead of their use (a hint; `t` may be
    /// past the end).
    fn prefetch(&self, t: usize, width: usize, span: Range<usize>);
}

impl KvRows for [f32] {
    const WIDENS: bool = false;

    fn rows(&self, width: usize) -> usize {
        self.len() / width.max(1)
    }

    #[inline(always)]
    fn part<'s>(
        &'s self,
        t: usize,
        width: usize,
        span: Range<usize>,
        _scratch: &'s mut [f32],
    ) -> &'s [f32] {
        &self[t * width..(t + 1) * width][span]
    }

    #[inline(always)]
    fn prefetch(&self, t: usize, width: usize, span: Range<usize>) {
        let at = self.as_ptr().wrapping_add(t * width + span.start);
        prefetch_bytes(at.cast(), span.len() * 4);
    }
}

/// f16 rows, two little-endian bytes per value (what the widening kernels read).
pub struct F16Rows(Vec<u8>);

impl F16Rows {
    pub fn new(values: &[f32]) -> Self {
        let mut rows = F16Rows(Vec::with_capacity(2 * values.len()));
        rows.extend(values);
        rows
    }

    /// Appends `values` (whole rows).
    pub fn extend(&mut self, values: &[f32]) {
        self.0.extend(
            values
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes()),
        );
    }
}

impl KvRows for F16Rows {
    const WIDENS: bool = true;

    fn rows(&self, width: usize) -> usize {
        self.0.len() / 2 / width.max(1)
    }

    #[inline(always)]
    fn part<'s>(
        &'s self,
        t: usize,
        width: usize,
        span: Range<usize>,
        scratch: &'s mut [f32],
    ) -> &'s [f32] {
        let out = &mut scratch[..span.len()];
        let row = &self.0[2 * t * width..2 * (t + 1) * width];
        (kernels::best().widen_f16)(&row[2 * span.start..2 * span.end], out);
        out
    }

    #[inline(always)]
    fn prefetch(&self, t: usize, width: usize, span: Range<usize>) {
        let at = self.0.as_ptr().wrapping_add(2 * (t * width + span.start));
        prefetch_bytes(at, span.len() * 2);
    }
}

/// INT8 rows: per row, blocks of [`INT8_BLOCK`] codes with one f32 scale each.
pub struct Int8Rows {
    codes: Vec<i8>,
    /// `blocks_per_row` per row.
    scales: Vec<f32>,
    blocks_per_row: usize,
}

impl Int8Rows {
    /// `values` (`rows × width`) quantized block by block within each row.
    pub fn new(values: &[f32], width: usize) -> Self {
        let width = width.max(1);
        let blocks_per_row = width.div_ceil(INT8_BLOCK);
        let mut rows = Int8Rows {
            codes: Vec::with_capacity(values.len()),
            scales: Vec::with_capacity(values.len() / width * blocks_per_row),
            blocks_per_row,
        };
        rows.extend(values, width);
        rows
    }

    /// Appends `values` (whole rows of `width`), each row's blocks quantized on their own.
    pub fn extend(&mut self, values: &[f32], width: usize) {
        for row in values.chunks(width.max(1)) {
            for block in row.chunks(INT8_BLOCK) {
                let max = block.iter().fold(0f32, |m, x| m.max(x.abs()));
                let scale = max / 127.0;
                self.scales.push(scale);
                self.codes.extend(block.iter().map(|&x| {
                    if scale > 0.0 {
                        // `as` saturates (and maps NaN to 0); the clamp keeps -128 unused.
                        ((x / scale).round() as i8).max(-127)
                    } else {
                        0
                    }
                }));
            }
        }
    }
}

impl KvRows for Int8Rows {
    const WIDENS: bool = true;

    fn rows(&self, width: usize) -> usize {
        self.codes.len() / width.max(1)
    }

    #[inline(always)]
    fn part<'s>(
        &'s self,
        t: usize,
        width: usize,
        span: Range<usize>,
        scratch: &'s mut [f32],
    ) -> &'s [f32] {
        let out = &mut scratch[..span.len()];
        let codes = &self.codes[t * width..(t + 1) * width][span.clone()];
        let scales = &self.scales[t * self.blocks_per_row..(t + 1) * self.blocks_per_row];
        // The span in pieces that each lie in one block (the first and last may be partial).
        let mut done = 0;
        while done < span.len() {
            let column = span.start + done;
            let scale = scales[column / INT8_BLOCK];
            let piece = (INT8_BLOCK - column % INT8_BLOCK).min(span.len() - done);
            for (o, &c) in out[done..done + piece]
                .iter_mut()
                .zip(&codes[done..done + piece])
            {
                *o = c as f32 * scale;
            }
            done += piece;
        }
        out
    }

    #[inline(always)]
    fn prefetch(&self, t: usize, width: usize, span: Range<usize>) {
        let at = self.codes.as_ptr().wrapping_add(t * width + span.start);
        prefetch_bytes(at.cast(), span.len());
    }
}

/// One attention cache's keys and values (`[len, width]` each, token-major) in one format.
pub enum KvCacheRows {
    F32 { keys: Vec<f32>, values: Vec<f32> },
    F16 { keys: F16Rows, values: F16Rows },
    Int8 { keys: Int8Rows, values: Int8Rows },
}

impl KvCacheRows {
    /// `keys` and `values` (rows of `width` values) held as `format`.
    pub fn new(format: KvFormat, keys: Vec<f32>, values: Vec<f32>, width: usize) -> Self {
        match format {
            KvFormat::F32 => KvCacheRows::F32 { keys, values },
            KvFormat::F16 => KvCacheRows::F16 {
                keys: F16Rows::new(&keys),
                values: F16Rows::new(&values),
            },
            KvFormat::Int8 => KvCacheRows::Int8 {
                keys: Int8Rows::new(&keys, width),
                values: Int8Rows::new(&values, width),
            },
        }
    }

    /// An empty cache that rows are appended to ([`Self::extend`]).
    pub fn empty(format: KvFormat, width: usize) -> Self {
        Self::new(format, Vec::new(), Vec::new(), width)
    }

    /// Appends the rows of `keys` and `values` (`n × width` each).
    pub fn extend(&mut self, keys: &[f32], values: &[f32], width: usize) {
        match self {
            KvCacheRows::F32 {
                keys: held_keys,
                values: held_values,
            } => {
                held_keys.extend_from_slice(keys);
                held_values.extend_from_slice(values);
            }
            KvCacheRows::F16 {
                keys: held_keys,
                values: held_values,
            } => {
                held_keys.extend(keys);
                held_values.extend(values);
            }
            KvCacheRows::Int8 {
                keys: held_keys,
                values: held_values,
            } => {
                held_keys.extend(keys, width);
                held_values.extend(values, width);
            }
        }
    }

    /// The keys and values as the attention reads them (rounded where the format rounds), as
    /// f32 rows (f32 caches lent, not copied): for attention in tensors over the whole cache.
    pub fn to_f32(&self, width: usize) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        fn widen<R: KvRows + ?Sized>(rows: &R, width: usize) -> Vec<f32> {
            let mut out = vec![0f32; rows.rows(width) * width];
            let mut scratch = vec![0f32; width];
            for (t, out) in out.chunks_exact_mut(width.max(1)).enumerate() {
                out.copy_from_slice(rows.row(t, width, &mut scratch));
            }
            out
        }
        match self {
            KvCacheRows::F32 { keys, values } => (Cow::Borrowed(keys), Cow::Borrowed(values)),
            KvCacheRows::F16 { keys, values } => {
                (widen(keys, width).into(), widen(values, width).into())
            }
            KvCacheRows::Int8 { keys, values } => {
                (widen(keys, width).into(), widen(values, width).into())
            }
        }
    }

    /// [`CachedKv::attend_each`] over this cache, whatever its format.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_each(
        &self,
        kv_heads: usize,
        head_dim: usize,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        macro_rules! attend {
            ($keys:expr, $values:expr) => {
                CachedKv {
                    keys: $keys,
                    values: $values,
                    kv_heads,
                    head_dim,
                }
                .attend_each(queries, count, first, scaling, bias)
            };
        }
        match self {
            KvCacheRows::F32 { keys, values } => attend!(&keys[..], &values[..]),
            KvCacheRows::F16 { keys, values } => attend!(keys, values),
            KvCacheRows::Int8 { keys, values } => attend!(keys, values),
        }
    }

    pub fn format(&self) -> KvFormat {
        match self {
            KvCacheRows::F32 { .. } => KvFormat::F32,
            KvCacheRows::F16 { .. } => KvFormat::F16,
            KvCacheRows::Int8 { .. } => KvFormat::Int8,
        }
    }

    /// Bytes the keys and values hold (allocated, not only used).
    pub fn held_bytes(&self) -> u64 {
        let bytes = match self {
            KvCacheRows::F32 { keys, values } => 4 * (keys.capacity() + values.capacity()),
            KvCacheRows::F16 { keys, values } => keys.0.capacity() + values.0.capacity(),
            KvCacheRows::Int8 { keys, values } => [keys, values]
                .iter()
                .map(|rows| rows.codes.capacity() + 4 * rows.scales.capacity())
                .sum(),
        };
        bytes as u64
    }
}

/// Keys over a fixed source held by dimension (`[width, tokens]`: row `i` is dimension `i` of
/// every token's key), for [`SourceKv`]'s scores: a head's scores are then sums of whole
/// vectors of tokens, `Σ_d q[d] × keys[d][..]`, with no sum across a vector's lanes per token.
enum KeyColumns {
    F32(Vec<f32>),
    /// f16, two little-endian bytes per value.
    F16(Vec<u8>),
    /// Codes by dimension; `scales[b × tokens + t]` is block `b`'s scale in token `t`'s row
    /// (the row's blocks of [`INT8_BLOCK`], as [`Int8Rows`] has them).
    Int8 {
        codes: Vec<i8>,
        scales: Vec<f32>,
    },
}

impl KeyColumns {
    /// `keys` (`tokens × width`, token-major) held by dimension in `format`.
    fn new(format: KvFormat, keys: &[f32], width: usize) -> Self {
        let width = width.max(1);
        let tokens = keys.len() / width;
        let transpose = |values: &[f32]| -> Vec<f32> {
            let mut out = vec![0f32; values.len()];
            for (t, row) in values.chunks_exact(width).enumerate() {
                for (i, &x) in row.iter().enumerate() {
                    out[i * tokens + t] = x;
                }
            }
            out
        };
        match format {
            KvFormat::F32 => KeyColumns::F32(transpose(keys)),
            KvFormat::F16 => KeyColumns::F16(F16Rows::new(&transpose(keys)).0),
            KvFormat::Int8 => {
                // Quantized as rows (each token's blocks on their own), then laid out by
                // dimension: the values held are those of `Int8Rows`.
                let rows = Int8Rows::new(keys, width);
                let mut codes = vec![0i8; rows.codes.len()];
                let mut scales = vec![0f32; rows.scales.len()];
                for t in 0..tokens {
                    for i in 0..width {
                        codes[i * tokens + t] = rows.codes[t * width + i];
                    }
                    for b in 0..rows.blocks_per_row {
                        scales[b * tokens + t] = rows.scales[t * rows.blocks_per_row + b];
                    }
                }
                KeyColumns::Int8 { codes, scales }
            }
        }
    }

    /// Dimension `i` of tokens `first..tokens` as f32: lent where held as f32, else widened
    /// (f16, exactly) or dequantized (`code × scale`, as [`Int8Rows::row`]) into `scratch`.
    #[inline(always)]
    fn column<'s>(
        &'s self,
        i: usize,
        tokens: usize,
        first: usize,
        scratch: &'s mut [f32],
    ) -> &'s [f32] {
        let span = i * tokens + first..(i + 1) * tokens;
        match self {
            KeyColumns::F32(keys) => &keys[span],
            KeyColumns::F16(keys) => {
                let out = &mut scratch[..span.len()];
                (kernels::best().widen_f16)(&keys[2 * span.start..2 * span.end], out);
                out
            }
            KeyColumns::Int8 { codes, scales } => {
                let out = &mut scratch[..span.len()];
                let block = i / INT8_BLOCK * tokens;
                let scales = &scales[block + first..block + tokens];
                for ((o, &c), &scale) in out.iter_mut().zip(&codes[span]).zip(scales) {
                    *o = c as f32 * scale;
                }
                out
            }
        }
    }

    fn held_bytes(&self) -> usize {
        match self {
            KeyColumns::F32(keys) => 4 * keys.capacity(),
            KeyColumns::F16(keys) => keys.capacity(),
            KeyColumns::Int8 { codes, scales } => codes.capacity() + 4 * scales.capacity(),
        }
    }
}

/// An attention cache over a fixed source (an encoder-decoder's cross-attention: the encoder
/// output's keys and values, made once per document and read by every decode step), in one
/// [`KvFormat`]: keys by dimension ([`KeyColumns`]), values token-major as [`KvCacheRows`]
/// holds them. Its attention is the f32 attention over the rounded values with each score
/// summed over the head's dimensions in ascending order.
pub struct SourceKv {
    keys: KeyColumns,
    values: KvCacheRows,
    tokens: usize,
    width: usize,
}

impl SourceKv {
    /// `keys` and `values` (`tokens × width` each, token-major) held as `format`.
    pub fn new(format: KvFormat, keys: &[f32], values: Vec<f32>, width: usize) -> Self {
        let width = width.max(1);
        SourceKv {
            keys: KeyColumns::new(format, keys, width),
            tokens: keys.len() / width,
            values: KvCacheRows::new(format, Vec::new(), values, width),
            width,
        }
    }

    pub fn format(&self) -> KvFormat {
        self.values.format()
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens
    }

    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Bytes the keys and values hold (allocated, not only used).
    pub fn held_bytes(&self) -> u64 {
        self.keys.held_bytes() as u64 + self.values.held_bytes()
    }

    /// The attention of `count` queries (`count × heads × head_dim`, one after another; beams
    /// reading one document) over tokens `first..`, with `kv_heads` key/value heads of
    /// `head_dim` and `bias` `[heads, tokens]` added to the scaled scores where given:
    /// `[count × heads × head_dim]`, as [`CachedKv::attend_each`] gives it.
    #[allow(clippy::too_many_arguments)]
    pub fn attend_each(
        &self,
        kv_heads: usize,
        head_dim: usize,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (checked just above).
                return unsafe {
                    self.attend_avx512(kv_heads, head_dim, queries, count, first, scaling, bias)
                };
            }
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                return unsafe {
                    self.attend_avx2(kv_heads, head_dim, queries, count, first, scaling, bias)
                };
            }
        }
        self.attend_loops(kv_heads, head_dim, queries, count, first, scaling, bias)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    fn attend_avx512(
        &self,
        kv_heads: usize,
        head_dim: usize,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        self.attend_loops(kv_heads, head_dim, queries, count, first, scaling, bias)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    #[allow(clippy::too_many_arguments)]
    fn attend_avx2(
        &self,
        kv_heads: usize,
        head_dim: usize,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        self.attend_loops(kv_heads, head_dim, queries, count, first, scaling, bias)
    }

    /// Plain multiplies and adds (no fused multiply-add), so every compiled variant gives the
    /// same bits.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn attend_loops(
        &self,
        kv_heads: usize,
        hd: usize,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        let (total, width) = (self.tokens, self.width);
        let first = first.min(total);
        let heads = queries.len() / count.max(1) / hd.max(1);
        let rep = (heads / kv_heads.max(1)).max(1);
        let kv_offsets: Vec<usize> = (0..heads).map(|h| h / rep * hd).collect();
        // weights[(query × heads + h) × total + t], as `CachedKv`'s walk lays them out.
        let mut weights = vec![0f32; count * heads * total];
        // A column widened from a narrower format (f32 columns are lent: no allocation).
        let widens = !matches!(self.keys, KeyColumns::F32(_));
        let mut column_scratch = vec![0f32; if widens { total - first } else { 0 }];
        for (h, &offset) in kv_offsets.iter().enumerate() {
            for d in 0..hd {
                let keys = self
                    .keys
                    .column(offset + d, total, first, &mut column_scratch);
                for (query, query_weights) in queries
                    .chunks_exact(heads * hd)
                    .zip(weights.chunks_exact_mut((heads * total).max(1)))
                {
                    let q = query[h * hd + d];
                    let scores = &mut query_weights[h * total + first..(h + 1) * total];
                    for (s, k) in scores.iter_mut().zip(keys) {
                        *s += q * k;
                    }
                }
            }
            for query_weights in weights.chunks_exact_mut((heads * total).max(1)) {
                let scores = &mut query_weights[h * total + first..(h + 1) * total];
                match bias {
                    Some(bias) => {
                        let bias = &bias[h * total + first..(h + 1) * total];
                        for (s, b) in scores.iter_mut().zip(bias) {
                            *s = *s * scaling + b;
                        }
                    }
                    None => scores.iter_mut().for_each(|s| *s *= scaling),
                }
            }
        }
        // (A match, not a closure: a closure's body is compiled without the caller's target
        // features. A row scratch only where the rows widen, as `CachedKv` has it.)
        match &self.values {
            KvCacheRows::F32 { values, .. } => mix_values(
                &mut weights,
                &values[..],
                &kv_offsets,
                hd,
                width,
                first,
                &mut [],
            ),
            KvCacheRows::F16 { values, .. } => mix_values(
                &mut weights,
                values,
                &kv_offsets,
                hd,
                width,
                first,
                &mut vec![0f32; width],
            ),
            KvCacheRows::Int8 { values, .. } => mix_values(
                &mut weights,
                values,
                &kv_offsets,
                hd,
                width,
                first,
                &mut vec![0f32; width],
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::layers::CachedKv;
    use super::*;

    fn bits(values: &[f32]) -> Vec<u32> {
        values.iter().map(|x| x.to_bits()).collect()
    }

    /// Keys or values of `rows × width`, with blocks of very different sizes (a key's scale is
    /// its block's) and an all-zero block.
    fn cache_values(rows: usize, width: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..rows * width)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                let block = i % width / INT8_BLOCK;
                match block % 3 {
                    0 => unit * 8.0,
                    1 => unit * 0.01,
                    _ if i / width == 1 => 0.0,
                    _ => unit,
                }
            })
            .collect()
    }

    /// Columns `span` of row `t` of `rows`: those of the whole row, bit for bit.
    fn assert_parts_are_the_rows<R: KvRows + ?Sized>(rows: &R, width: usize, format: KvFormat) {
        let mut whole = vec![0f32; width];
        let mut part = vec![0f32; width];
        for t in 0..rows.rows(width) {
            let row = rows.row(t, width, &mut whole).to_vec();
            for start in [0, 1, 31, 32, 33, 40, 80, width - 1, width] {
                for end in [start, start + 1, 63, 64, 65, 96, 119, width] {
                    if end < start || end > width {
                        continue;
                    }
                    let got = rows.part(t, width, start..end, &mut part);
                    assert_eq!(
                        bits(got),
                        bits(&row[start..end]),
                        "{format}: row {t}, columns {start}..{end}"
                    );
                }
            }
        }
    }

    /// Every format hands out any part of a row as the same values as the whole row: f16
    /// widened, INT8 scaled by the block each column lies in (parts that start and end inside
    /// blocks, span several, or hold nothing).
    #[test]
    fn a_rows_part_is_that_part_of_the_row() {
        let width = 3 * 40;
        let values = cache_values(4, width, 0x5851_f42d_4c95_7f2d);
        for format in KvFormat::ALL {
            match KvCacheRows::new(format, values.clone(), values.clone(), width) {
                KvCacheRows::F32 { keys, .. } => {
                    assert_parts_are_the_rows(&keys[..], width, format)
                }
                KvCacheRows::F16 { keys, .. } => assert_parts_are_the_rows(&keys, width, format),
                KvCacheRows::Int8 { keys, .. } => assert_parts_are_the_rows(&keys, width, format),
            }
        }
    }

    /// `values` as the INT8 format should hold them, written from its definition: per row,
    /// per block of 32, `round(x / s) × s` with `s = max |x| / 127`.
    fn int8_reference(values: &[f32], width: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for row in values.chunks(width) {
            for block in row.chunks(INT8_BLOCK) {
                let scale = block.iter().map(|x| x.abs()).fold(0f32, f32::max) / 127.0;
                out.extend(block.iter().map(|&x| {
                    if scale == 0.0 {
                        0.0
                    } else {
                        // (+ 0.0: a code of 0 is +0, whatever the sign rounded to it)
                        (x / scale).round() * scale + 0.0
                    }
                }));
            }
        }
        out
    }

    /// Each format's attention is the f32 attention over its rounded values, bit for bit (rows
    /// widened or dequantized as the walk reaches them), for one query and for three sharing a
    /// walk; INT8 stays within half a step of the values, and both narrower formats do change
    /// the result.
    ///
    /// With two compute threads, the second and the last shapes have enough scores for the
    /// heads to be split over them: each thread then widens only its heads' columns
    /// ([`KvRows::part`]), which for heads of 40 values start and end inside INT8 blocks.
    #[test]
    fn narrow_caches_attend_as_f32_over_their_rounded_values() {
        crate::quant::parallel::set_compute_threads(2);
        for (heads, hd, rows) in [(4, 16, 7), (12, 64, 40), (3, 40, 5), (3, 40, 120)] {
            let width = heads * hd;
            let keys = cache_values(rows, width, 0x9e37_79b9_7f4a_7c15);
            let values = cache_values(rows, width, 0x2545_f491_4f6c_dd1d);
            let queries: Vec<f32> = cache_values(3, width, 7).iter().map(|x| x / 4.0).collect();
            let attend = |keys: &dyn Fn() -> Vec<f32>, values: &dyn Fn() -> Vec<f32>| {
                let (k, v) = (keys(), values());
                let cache = CachedKv {
                    keys: &k[..],
                    values: &v[..],
                    kv_heads: heads,
                    head_dim: hd,
                };
                cache.attend_each(&queries, 3, 0, 1.0, None)
            };
            let exact = attend(&|| keys.clone(), &|| values.clone());
            let f16_values = |v: &[f32]| -> Vec<f32> {
                v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
            };
            let want = [
                (
                    KvFormat::F16,
                    attend(&|| f16_values(&keys), &|| f16_values(&values)),
                ),
                (
                    KvFormat::Int8,
                    attend(&|| int8_reference(&keys, width), &|| {
                        int8_reference(&values, width)
                    }),
                ),
            ];
            for (format, want) in want {
                let case = format!("{format}: {heads} heads × {hd}, {rows} rows");
                let cache = KvCacheRows::new(format, keys.clone(), values.clone(), width);
                assert_eq!(cache.format(), format);
                let got = cache.attend_each(heads, hd, &queries, 3, 0, 1.0, None);
                assert_eq!(bits(&got), bits(&want), "{case}");
                assert_ne!(bits(&got), bits(&exact), "{case}: the rounding is applied");
                // Every row handed out is the rounded row, and `rows` counts them.
                let (reference, rows_held): (Vec<f32>, usize) = match &cache {
                    KvCacheRows::F16 { keys: k, .. } => (f16_values(&keys), k.rows(width)),
                    KvCacheRows::Int8 { keys: k, .. } => {
                        (int8_reference(&keys, width), k.rows(width))
                    }
                    KvCacheRows::F32 { .. } => unreachable!(),
                };
                assert_eq!(rows_held, rows, "{case}");
                let mut scratch = vec![f32::NAN; width];
                for t in 0..rows {
                    let row = match &cache {
                        KvCacheRows::F16 { keys, .. } => keys.row(t, width, &mut scratch).to_vec(),
                        KvCacheRows::Int8 { keys, .. } => keys.row(t, width, &mut scratch).to_vec(),
                        KvCacheRows::F32 { .. } => unreachable!(),
                    };
                    assert_eq!(
                        bits(&row),
                        bits(&reference[t * width..][..width]),
                        "{case}, row {t}"
                    );
                }
            }
            // INT8's error: at most half a step of each value's block.
            let held = int8_reference(&keys, width);
            for (row, held) in keys.chunks(width).zip(held.chunks(width)) {
                for (block, held) in row.chunks(INT8_BLOCK).zip(held.chunks(INT8_BLOCK)) {
                    let step = block.iter().map(|x| x.abs()).fold(0f32, f32::max) / 127.0;
                    for (x, q) in block.iter().zip(held) {
                        assert!((x - q).abs() <= step * 0.5001, "{x} held as {q}");
                    }
                }
            }
        }
    }

    /// Attention over a fixed source written from its definition, head by head: each score
    /// `Σ_d q[d] × k[d]` summed in ascending `d` from 0, times `scaling`, plus the bias; the
    /// softmax; the probabilities times the values in ascending token order. `keys` and
    /// `values` are the rounded values the cache holds.
    fn source_reference(
        keys: &[f32],
        values: &[f32],
        (heads, kv_heads, hd): (usize, usize, usize),
        queries: &[f32],
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        let width = kv_heads * hd;
        let total = keys.len() / width;
        let mut out = Vec::new();
        for query in queries.chunks_exact(heads * hd) {
            for h in 0..heads {
                let offset = h / (heads / kv_heads) * hd;
                let scores: Vec<f32> = (first..total)
                    .map(|t| {
                        let mut s = 0f32;
                        for d in 0..hd {
                            s += query[h * hd + d] * keys[t * width + offset + d];
                        }
                        s * scaling + bias.map_or(0.0, |b| b[h * total + t])
                    })
                    .collect();
                let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum = exps.iter().fold(0f32, |a, e| a + e);
                let mut head = vec![0f32; hd];
                for (t, e) in (first..total).zip(exps) {
                    let p = e / sum;
                    for (o, v) in head.iter_mut().zip(&values[t * width + offset..][..hd]) {
                        *o += p * v;
                    }
                }
                out.extend(head);
            }
        }
        out
    }

    /// A source cache's attention (keys by dimension) is the reference over its rounded values
    /// bit for bit, in every format, for one query and for three sharing the cache, with
    /// grouped heads, a hidden prefix and a bias; and it agrees with the token-major walk of
    /// [`CachedKv`] (whose sums run in another order) to within rounding.
    #[test]
    fn source_caches_attend_as_the_reference_over_their_rounded_values() {
        for (heads, kv_heads, hd, rows, first, biased) in [
            (4, 4, 16, 7, 0, false),
            (12, 12, 64, 40, 0, false),
            (8, 2, 40, 33, 5, true),
            (3, 3, 40, 1, 0, true),
        ] {
            let width = kv_heads * hd;
            let keys = cache_values(rows, width, 0x9e37_79b9_7f4a_7c15);
            let values = cache_values(rows, width, 0x2545_f491_4f6c_dd1d);
            let queries: Vec<f32> = cache_values(3, heads * hd, 7)
                .iter()
                .map(|x| x / 4.0)
                .collect();
            let bias: Vec<f32> = cache_values(1, heads * rows, 9);
            let bias = biased.then_some(&bias[..]);
            let scaling = (hd as f32).powf(-0.5);
            for format in KvFormat::ALL {
                let case = format!("{format}: {heads} heads over {kv_heads} × {hd}, {rows} rows");
                let rounded = |v: &[f32]| -> Vec<f32> {
                    match format {
                        KvFormat::F32 => v.to_vec(),
                        KvFormat::F16 => {
                            v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
                        }
                        KvFormat::Int8 => int8_reference(v, width),
                    }
                };
                let (held_keys, held_values) = (rounded(&keys), rounded(&values));
                let cache = SourceKv::new(format, &keys, values.clone(), width);
                assert_eq!((cache.format(), cache.len()), (format, rows), "{case}");
                for count in [1, 3] {
                    let queries = &queries[..count * heads * hd];
                    let got = cache.attend_each(kv_heads, hd, queries, count, first, scaling, bias);
                    let want = source_reference(
                        &held_keys,
                        &held_values,
                        (heads, kv_heads, hd),
                        queries,
                        first,
                        scaling,
                        bias,
                    );
                    assert_eq!(bits(&got), bits(&want), "{case}, {count} queries");
                    let walked = CachedKv {
                        keys: &held_keys[..],
                        values: &held_values[..],
                        kv_heads,
                        head_dim: hd,
                    }
                    .attend_each(queries, count, first, scaling, bias);
                    for (g, w) in got.iter().zip(&walked) {
                        assert!(
                            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                            "{case}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    /// A cache grown a row or a few at a time (a decoder-only model's) holds what one made at
    /// once holds, and reads back as the rows its attention sees.
    #[test]
    fn caches_grown_row_by_row_hold_what_one_made_at_once_holds() {
        let (rows, width) = (9, 80);
        let keys = cache_values(rows, width, 11);
        let values = cache_values(rows, width, 12);
        for format in KvFormat::ALL {
            let whole = KvCacheRows::new(format, keys.clone(), values.clone(), width);
            let mut grown = KvCacheRows::empty(format, width);
            for (start, end) in [(0, 1), (1, 5), (5, 6), (6, 9)] {
                let span = start * width..end * width;
                grown.extend(&keys[span.clone()], &values[span], width);
            }
            assert_eq!(grown.format(), format);
            let (whole_keys, whole_values) = whole.to_f32(width);
            let (grown_keys, grown_values) = grown.to_f32(width);
            assert_eq!(bits(&grown_keys), bits(&whole_keys), "{format} keys");
            assert_eq!(bits(&grown_values), bits(&whole_values), "{format} values");
            let want = match format {
                KvFormat::F32 => keys.clone(),
                KvFormat::F16 => keys
                    .iter()
                    .map(|&x| half::f16::from_f32(x).to_f32())
                    .collect(),
                KvFormat::Int8 => int8_reference(&keys, width),
            };
            assert_eq!(bits(&whole_keys), bits(&want), "{format}: rows as held");
            let q = cache_values(1, width, 13);
            assert_eq!(
                bits(&grown.attend_each(4, 20, &q, 1, 2, 0.25, None)),
                bits(&whole.attend_each(4, 20, &q, 1, 2, 0.25, None)),
                "{format}: attention"
            );
        }
    }

    /// The formats' names round-trip, an unknown one is refused by name, and
    /// [`KvFormat::bytes`] (what the budget sets aside) is what a cache of that size holds.
    #[test]
    fn kv_formats_parse_and_count_the_bytes_they_hold() {
        for format in KvFormat::ALL {
            assert_eq!(format.name().parse::<KvFormat>(), Ok(format));
            assert_eq!(format.to_string(), format.name());
        }
        let err = "q4".parse::<KvFormat>().unwrap_err();
        assert!(
            err.contains("`q4`") && err.contains("f32, f16 or int8"),
            "{err}"
        );
        for (rows, width) in [(353, 768), (5, 40), (1, 33)] {
            for format in KvFormat::ALL {
                let values = cache_values(rows, width, 3);
                let cache = KvCacheRows::new(format, values.clone(), values, width);
                assert_eq!(
                    cache.held_bytes(),
                    2 * format.bytes(rows as u64, width as u64),
                    "{format}: {rows} rows of {width}"
                );
            }
        }
        assert_eq!(KvFormat::Int8.bytes(2, 33), 2 * 33 + 2 * 2 * 4);
    }
}
