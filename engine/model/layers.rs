//! Building blocks ported from Hugging Face's `modeling_switch_transformers.py` (transformers
//! 5.x): RMS layer norm, attention without score scaling, relative position buckets, dense FF;
//! and from the decoder-only families (`modeling_mixtral.py`, `modeling_qwen2_moe.py`,
//! `modeling_olmoe.py`): the SwiGLU MLP, rotary position embeddings and `repeat_kv` for
//! grouped-query attention. Each op mirrors the PyTorch line it ports so that results match to
//! float rounding.

use std::ops::Range;
use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

use super::kv::{KvRows, SourceKv};
use crate::error::{Error, Result};
use crate::quant::matrix::{matmul, MatrixFormat, MatrixRef, PackedMatrix};
use crate::quant::parallel;

/// `SwitchTransformersLayerNorm`: RMS norm, no mean subtraction, no bias.
pub struct RmsNorm {
    weight: Tensor,
    /// The weight's values on the host, for one row normed in plain loops (taken at the first
    /// such row: a model is also assembled from placeholders that hold no values).
    values: std::sync::OnceLock<Vec<f32>>,
    eps: f64,
}

impl RmsNorm {
    /// Up to this many rows (a decode step, beams included) are normed in plain loops; more
    /// (an encoder pass, a prompt) by libtorch's vectorised ops.
    const LOOP_ROWS: usize = 8;

    pub fn new(weight: Tensor, eps: f64) -> Self {
        RmsNorm {
            weight,
            values: std::sync::OnceLock::new(),
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let width = self.weight.numel();
        if x.device() == Device::Cpu
            && self.weight.device() == Device::Cpu
            && x.kind() == Kind::Float
            && self.weight.kind() == Kind::Float
            && width > 0
            && x.size().last() == Some(&(width as i64))
            && x.numel() <= Self::LOOP_ROWS * width
        {
            // A decode step's rows: the same math without six tensor ops' overhead.
            let normed = match f32_values(x) {
                Some(rows) => self.forward_rows(rows)?,
                None => self.forward_rows(&Vec::<f32>::try_from(&x.f_reshape([-1])?)?)?,
            };
            return Ok(Tensor::f_from_slice(&normed)?.f_view(x.size().as_slice())?);
        }
        // variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        let variance = x
            .f_pow_tensor_scalar(2)?
            .f_mean_dim(-1, true, Kind::Float)?;
        // hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        let normed = x.f_mul(&variance.f_add_scalar(self.eps)?.f_rsqrt()?)?;
        // return self.weight * hidden_states
        Ok(self.weight.f_mul(&normed)?)
    }

    /// Rows of the weight's width normed: `weight · x / sqrt(mean(x²) + eps)` each, the mean
    /// of squares summed in f64 (libtorch sums in f32 over several lanes; both are within an
    /// f32 rounding of the exact mean), every other step in f32 as libtorch rounds it.
    fn forward_rows(&self, rows: &[f32]) -> Result<Vec<f32>> {
        let weight = match self.values.get() {
            Some(values) => values,
            None => {
                let values = Vec::<f32>::try_from(&self.weight.f_reshape([-1])?)?;
                self.values.get_or_init(|| values)
            }
        };
        let mut normed = Vec::with_capacity(rows.len());
        for row in rows.chunks_exact(weight.len()) {
            let squares: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
            let variance = (squares / row.len() as f64) as f32;
            let scale = 1.0 / (variance + self.eps as f32).sqrt();
            normed.extend(row.iter().zip(weight).map(|(&v, &w)| w * (v * scale)));
        }
        Ok(normed)
    }
}

/// A weight matrix `[rows, cols]` (one row per output channel) as the model holds it.
pub enum Weight<'a> {
    /// An f32 tensor (or any tensor on a GPU): libtorch's matmul, the parity reference.
    Tensor(Tensor),
    /// A stored matrix borrowed from where it lives (an expert slot), computed on in its
    /// encoding by [`crate::quant::matrix`].
    Stored(MatrixRef<'a>),
    /// A stored matrix the model owns (resident weights at f16, bf16 or INT8).
    Packed(PackedMatrix),
}

/// A resident weight matrix.
pub type Linear = Weight<'static>;

impl Weight<'_> {
    /// The stored matrix, when there is one.
    pub fn stored(&self) -> Option<MatrixRef<'_>> {
        match self {
            Weight::Tensor(_) => None,
            Weight::Stored(m) => Some(*m),
            Weight::Packed(p) => Some(p.view()),
        }
    }

    /// Bytes held in memory for this matrix.
    pub fn stored_bytes(&self) -> u64 {
        match (self, self.stored()) {
            (_, Some(m)) => m.stored_bytes() as u64,
            (Weight::Tensor(t), None) => (t.numel() * t.kind().elt_size_in_bytes()) as u64,
            _ => unreachable!("every non-tensor weight has a stored matrix"),
        }
    }

    /// The weights as an f32 tensor (a copy for stored matrices).
    pub fn to_tensor(&self) -> Result<Tensor> {
        match (self, self.stored()) {
            (Weight::Tensor(t), _) => Ok(t.shallow_clone()),
            (_, Some(m)) => m.to_tensor(),
            _ => unreachable!("every non-tensor weight has a stored matrix"),
        }
    }

    /// `[rows, cols]`.
    pub fn size(&self) -> Vec<i64> {
        match (self, self.stored()) {
            (Weight::Tensor(t), _) => t.size(),
            (_, Some(m)) => vec![m.rows() as i64, m.cols() as i64],
            _ => unreachable!("every non-tensor weight has a stored matrix"),
        }
    }

    /// The matrix as the engine's kernels take it, when they can compute on it where it lives
    /// (a stored matrix, or a contiguous f32 CPU tensor); `None` for a tensor elsewhere.
    pub fn cpu_matrix(&self) -> Result<Option<MatrixRef<'_>>> {
        match (self, self.stored()) {
            (_, Some(m)) => Ok(Some(m)),
            (Weight::Tensor(t), None) => f32_cpu_matrix(t),
            _ => unreachable!("every non-tensor weight has a stored matrix"),
        }
    }

    /// Rows `ids` (any shape) as f32: `[..ids, cols]` (`nn.Embedding`).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let Some(m) = self.stored() else {
            let Weight::Tensor(t) = self else {
                unreachable!("every non-tensor weight has a stored matrix")
            };
            return Ok(Tensor::f_embedding(t, ids, -1, false, false)?);
        };
        let rows: Vec<i64> = Vec::try_from(&ids.f_flatten(0, -1)?.f_to_device(Device::Cpu)?)?;
        let cols = m.cols();
        let mut out = vec![0f32; rows.len() * cols];
        for (&r, dst) in rows.iter().zip(out.chunks_exact_mut(cols.max(1))) {
            let r = usize::try_from(r)
                .ok()
                .filter(|&r| r < m.rows())
                .ok_or_else(|| {
                    Error::Input(format!("row {r} outside an embedding of {}", m.rows()))
                })?;
            m.dequantize_rows(r, r + 1, dst)?;
        }
        let mut shape = ids.size();
        shape.push(cols as i64);
        Ok(Tensor::f_from_slice(&out)?.f_view(shape.as_slice())?)
    }

    /// The same weights for `device`: stored matrices stay as they are on the CPU and are
    /// expanded to f32 tensors elsewhere.
    pub fn to_device(self, device: Device) -> Result<Self> {
        Ok(match self {
            Weight::Tensor(t) if t.device() == device => Weight::Tensor(t),
            Weight::Tensor(t) => Weight::Tensor(t.f_to_device(device)?),
            other if device == Device::Cpu => other,
            other => Weight::Tensor(other.to_tensor()?.f_to_device(device)?),
        })
    }
}

/// `nn.Linear(..., bias=False)`: `x · wᵀ`.
pub fn linear(x: &Tensor, weight: &Weight<'_>) -> Result<Tensor> {
    linear_bias(x, weight, None)
}

/// `nn.Linear` with an optional bias.
pub fn linear_bias(x: &Tensor, weight: &Weight<'_>, bias: Option<&Tensor>) -> Result<Tensor> {
    match (weight, weight.stored()) {
        (Weight::Tensor(w), _) => match f32_cpu_matrix(w)? {
            // On the CPU through the engine's compute threads (libtorch runs single-threaded).
            Some(m) => {
                let y = stored_linear(x, m)?;
                Ok(match bias {
                    Some(b) => y.f_add(b)?,
                    None => y,
                })
            }
            None => Ok(x.f_linear(w, bias)?),
        },
        (_, Some(m)) => {
            let y = stored_linear(x, m)?;
            Ok(match bias {
                Some(b) => y.f_add(b)?,
                None => y,
            })
        }
        _ => unreachable!("every non-tensor weight has a stored matrix"),
    }
}

/// The values of a contiguous f32 CPU tensor, borrowed (`None` for any other tensor).
pub fn f32_values(t: &Tensor) -> Option<&[f32]> {
    if t.device() != Device::Cpu || t.kind() != Kind::Float || !t.is_contiguous() {
        return None;
    }
    // SAFETY: a contiguous f32 CPU tensor of `numel` values, borrowed for as long as `t`; the
    // engine does not write a tensor while it is borrowed.
    Some(unsafe { std::slice::from_raw_parts(t.data_ptr() as *const f32, t.numel()) })
}

/// A contiguous 2-D f32 CPU tensor seen as an f32 [`MatrixRef`] (borrowing its memory).
fn f32_cpu_matrix(w: &Tensor) -> Result<Option<MatrixRef<'_>>> {
    if w.device() != Device::Cpu
        || w.kind() != Kind::Float
        || w.dim() != 2
        || !w.is_contiguous()
        || w.numel() == 0
    {
        return Ok(None);
    }
    let (rows, cols) = (w.size()[0] as usize, w.size()[1] as usize);
    // SAFETY: a contiguous f32 CPU tensor of rows × cols values, borrowed for as long as `w`
    // (weights are never written while the model runs).
    let data = unsafe { std::slice::from_raw_parts(w.data_ptr() as *const u8, rows * cols * 4) };
    Ok(Some(MatrixRef::new(
        MatrixFormat::F32,
        rows,
        cols,
        data,
        &[],
    )?))
}

/// `x` `[.., cols]` · `mᵀ` → `[.., rows]` by the quantized kernels (x as f32 on the CPU).
fn stored_linear(x: &Tensor, m: MatrixRef<'_>) -> Result<Tensor> {
    let mut shape = x.size();
    let cols = m.cols() as i64;
    if shape.last() != Some(&cols) {
        return Err(Error::Internal(format!(
            "linear: input {shape:?} for a [{}, {cols}] matrix",
            m.rows()
        )));
    }
    let x = x.f_to_kind(Kind::Float)?.f_contiguous()?;
    let n = (x.numel() as i64 / cols.max(1)) as usize;
    *shape.last_mut().expect("checked above") = m.rows() as i64;
    let out = Tensor::f_empty(shape.as_slice(), (Kind::Float, Device::Cpu))?;
    // SAFETY: both tensors are contiguous f32 CPU tensors of the lengths given, alive for the
    // whole call; `out` is fresh, so nothing else reads it while it is written.
    let (xs, ys) = unsafe {
        (
            std::slice::from_raw_parts(x.data_ptr() as *const f32, n * m.cols()),
            std::slice::from_raw_parts_mut(out.data_ptr() as *mut f32, n * m.rows()),
        )
    };
    matmul(xs, n, m, ys)?;
    Ok(out)
}

/// `SwitchTransformersDenseActDense` with ReLU: `relu(x · wiᵀ) · woᵀ`.
pub fn dense_act_dense(x: &Tensor, wi: &Weight<'_>, wo: &Weight<'_>) -> Result<Tensor> {
    linear(&linear(x, wi)?.f_relu()?, wo)
}

/// SwiGLU MLP (`MixtralExperts`, `Qwen2MoeMLP`, `OlmoeExperts` for one expert):
/// `down(silu(gate(x)) * up(x))`, with `gate`/`up` `[d_ff, d]` and `down` `[d, d_ff]`.
pub fn gated_mlp(
    x: &Tensor,
    gate: &Weight<'_>,
    up: &Weight<'_>,
    down: &Weight<'_>,
) -> Result<Tensor> {
    // current_hidden_states = self.act_fn(gate) * up
    let hidden = linear(x, gate)?.f_silu()?.f_mul(&linear(x, up)?)?;
    linear(&hidden, down)
}

/// Default rotary position embedding (`*RotaryEmbedding` with `rope_type` `default`): the
/// inverse frequencies of one head's dimension pairs.
pub struct Rotary {
    /// `[head_dim / 2]`: `1 / base^(2i / head_dim)`
    inv_freq: Tensor,
}

impl Rotary {
    pub fn new(head_dim: usize, base: f64) -> Result<Self> {
        let dim = head_dim as i64;
        // inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        let exponents = Tensor::f_arange_start_step(0, dim, 2, (Kind::Float, tch::Device::Cpu))?
            .f_div_scalar(dim as f64)?;
        let inv_freq = Tensor::f_pow_scalar(base, &exponents)?.f_reciprocal()?;
        Ok(Rotary { inv_freq })
    }

    /// `(cos, sin)`, each `[1, 1, n, head_dim]`, for positions `start .. start + n`.
    pub fn cos_sin(&self, start: i64, n: i64) -> Result<(Tensor, Tensor)> {
        let positions = Tensor::f_arange_start(start, start + n, (Kind::Float, tch::Device::Cpu))?;
        // freqs = position_ids[..., None].float() * inv_freq; emb = torch.cat((freqs, freqs), -1)
        let freqs = positions
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq.f_unsqueeze(0)?)?; // [n, hd/2]
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?; // [n, hd]
        let shape = |t: Tensor| t.f_unsqueeze(0)?.f_unsqueeze(0);
        Ok((shape(emb.f_cos()?)?, shape(emb.f_sin()?)?))
    }

    /// `apply_rotary_pos_emb` on `x` `[b, heads, n, head_dim]`: `x·cos + rotate_half(x)·sin`.
    pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let half = x.size()[3] / 2;
        // rotate_half: torch.cat((-x2, x1), dim=-1)
        let x1 = x.f_narrow(-1, 0, half)?;
        let x2 = x.f_narrow(-1, half, half)?;
        let rotated = Tensor::f_cat(&[&x2.f_neg()?, &x1], -1)?;
        Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
    }
}

/// `repeat_kv`: `[b, kv_heads, n, hd]` → `[b, kv_heads × n_rep, n, hd]`, each kv head serving
/// `n_rep` consecutive query heads.
pub fn repeat_kv(x: &Tensor, n_rep: i64) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.shallow_clone());
    }
    let s = x.size();
    let (b, kv, n, hd) = (s[0], s[1], s[2], s[3]);
    Ok(x.f_unsqueeze(2)?
        .f_expand([b, kv, n_rep, n, hd], false)?
        .f_reshape([b, kv * n_rep, n, hd])?)
}

/// `softmax(query · keysᵀ · scale + bias) · values` for `query` `[b, H, n, hd]` over `keys` and
/// `values` `[b, H, k, hd]`, `bias` broadcastable to `[b, H, n, k]` (a per-head position bias,
/// or a mask shared by the heads); the heads back to rows, `[b, n, H·hd]`.
///
/// On the CPU with several compute threads, and enough scores to be worth it, the heads are
/// split into one group per compute thread, each attended by the same libtorch ops on its own
/// thread (`quant::parallel`). Outside the products, this is the largest serial part of a
/// prompt's prefill (a 512-token OLMoE-shaped prompt: ~120 ms a layer, a fifth of the
/// prefill at two threads). Every op here treats each head on its own, so the groups give the
/// values the whole batch gives (`attention_by_heads_gives_the_whole_batchs_values`).
pub fn attention_by_heads(
    query: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    scale: Option<f64>,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let s = query.size();
    let (b, heads, n, hd) = (s[0], s[1], s[2], s[3]);
    let scores = heads * n * keys.size()[2];
    let groups = if query.device() == Device::Cpu && scores >= MIN_SPLIT_SCORES {
        (parallel::compute_threads() as i64).min(heads)
    } else {
        1
    };
    let out = attend_head_groups(query, keys, values, scale, bias, groups)?;
    Ok(out
        .f_transpose(1, 2)?
        .f_contiguous()?
        .f_reshape([b, n, heads * hd])?)
}

/// Fewest scores (heads × queries × keys) for which [`attention_by_heads`] splits the heads
/// over the compute threads: a 64-token prompt with 16 heads. Below it the split costs more
/// than it saves.
const MIN_SPLIT_SCORES: i64 = 16 * 64 * 64;

/// The attention of [`attention_by_heads`], `[b, H, n, hd]`, its heads in `groups` consecutive
/// groups spread over the compute threads (one group: on this thread).
fn attend_head_groups(
    query: &Tensor,
    keys: &Tensor,
    values: &Tensor,
    scale: Option<f64>,
    bias: Option<&Tensor>,
    groups: i64,
) -> Result<Tensor> {
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor, bias: Option<&Tensor>| -> Result<Tensor> {
        let mut scores = q.f_matmul(&k.f_transpose(2, 3)?)?; // [b, h, n, k]
        if let Some(scale) = scale {
            scores = scores.f_mul_scalar(scale)?;
        }
        if let Some(bias) = bias {
            scores = scores.f_add(bias)?;
        }
        Ok(scores.f_softmax(-1, Kind::Float)?.f_matmul(v)?) // [b, h, n, hd]
    };
    let heads = query.size()[1];
    if groups <= 1 {
        return attend(query, keys, values, bias);
    }
    // Tensors are `Send` but not `Sync`: each group's views are handed to its task through a
    // mutex, and its output comes back the same way.
    let inputs = (0..groups)
        .map(|g| {
            let (first, end) = (heads * g / groups, heads * (g + 1) / groups);
            // Heads `first..end` of a tensor, its head dimension aligned from the right as
            // broadcasting does (`[b, H, n, ·]`, or a bias of 3 dimensions); one of size 1, or
            // none, is the same for every head.
            let part = |t: &Tensor| -> Result<Tensor> {
                Ok(match t.dim().checked_sub(3) {
                    Some(d) if t.size()[d] != 1 => t.f_narrow(d as i64, first, end - first)?,
                    _ => t.shallow_clone(),
                })
            };
            let bias = bias.map(part).transpose()?;
            Ok(Mutex::new(Some((
                part(query)?,
                part(keys)?,
                part(values)?,
                bias,
            ))))
        })
        .collect::<Result<Vec<_>>>()?;
    let outputs: Vec<Mutex<Option<Result<Tensor>>>> =
        (0..groups).map(|_| Mutex::new(None)).collect();
    parallel::for_each_task(groups as usize, &|g| {
        let _guard = tch::no_grad_guard();
        let taken = inputs[g].lock().map(|mut input| input.take());
        let out = match taken {
            Ok(Some((q, k, v, bias))) => attend(&q, &k, &v, bias.as_ref()),
            _ => Err(Error::Internal(format!(
                "attention: head group {g} taken twice"
            ))),
        };
        if let Ok(mut slot) = outputs[g].lock() {
            *slot = Some(out);
        }
    });
    let parts = outputs
        .into_iter()
        .enumerate()
        .map(|(g, slot)| match slot.into_inner() {
            Ok(Some(out)) => out,
            _ => Err(Error::Internal(format!(
                "attention: head group {g} gave nothing"
            ))),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::f_cat(&parts, 1)?)
}

/// Port of `SwitchTransformersAttention._relative_position_bucket`, with the same tensor ops so
/// that bucket boundaries (a float log) round exactly as in PyTorch.
pub fn relative_position_bucket(
    relative_position: &Tensor,
    bidirectional: bool,
    num_buckets: i64,
    max_distance: i64,
) -> Result<Tensor> {
    let mut num_buckets = num_buckets;
    let mut relative_buckets = relative_position.f_zeros_like()?;
    let relative_position = if bidirectional {
        num_buckets /= 2;
        // relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_buckets = relative_buckets.f_add(
            &relative_position
                .f_gt(0)?
                .f_to_kind(Kind::Int64)?
                .f_mul_scalar(num_buckets)?,
        )?;
        relative_position.f_abs()?
    } else {
        // -torch.min(relative_position, torch.zeros_like(relative_position))
        relative_position
            .f_minimum(&relative_position.f_zeros_like()?)?
            .f_neg()?
    };
    let max_exact = num_buckets / 2;
    let is_small = relative_position.f_lt(max_exact)?;
    // max_exact + (log(rp.float() / max_exact) / log(max_distance / max_exact) * (nb - max_exact)).long()
    let log_ratio = (max_distance as f64 / max_exact as f64).ln();
    let if_large = relative_position
        .f_to_kind(Kind::Float)?
        .f_div_scalar(max_exact as f64)?
        .f_log()?
        .f_div_scalar(log_ratio)?
        .f_mul_scalar((num_buckets - max_exact) as f64)?
        .f_to_kind(Kind::Int64)?
        .f_add_scalar(max_exact)?;
    let if_large = if_large.f_clamp_max(num_buckets - 1)?;
    Ok(relative_buckets.f_add(&relative_position.f_where_self(&is_small, &if_large)?)?)
}

/// Multi-head attention of T5/Switch: no 1/√d scaling, an additive position bias.
pub struct Attention {
    /// `[inner, d_model]` each
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    /// `[d_model, inner]`
    pub o: Linear,
    /// `[num_buckets, num_heads]` on the first block of a stack only.
    pub relative_attention_bias: Option<Tensor>,
    pub num_heads: i64,
    pub d_kv: i64,
}

impl Attention {
    /// `[b, n, d_model]` → `[b, heads, n, d_kv]`
    pub fn project(&self, x: &Tensor, weight: &Linear) -> Result<Tensor> {
        let (b, n) = (x.size()[0], x.size()[1]);
        Ok(linear(x, weight)?
            .f_view([b, n, self.num_heads, self.d_kv])?
            .f_transpose(1, 2)?)
    }

    /// Attention of `x` (`[b, n, d_model]`) over keys/values `[b, heads, k, d_kv]`, with an
    /// optional additive bias broadcastable to `[b, heads, n, k]`.
    pub fn attend(
        &self,
        x: &Tensor,
        keys: &Tensor,
        values: &Tensor,
        position_bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let query = self.project(x, &self.q)?;
        // attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling   (scaling = 1.0)
        let out = attention_by_heads(&query, keys, values, None, position_bias)?;
        linear(&out, &self.o)
    }

    /// [`Self::attend`] for one query per sequence, `x` `[b, 1, d_model]`, over each sequence's
    /// keys and values cached token-major (`caches[i]`: `[k, heads × d_kv]` each, for row `i`),
    /// with `bias` `[heads, k]` where given: the decode step, in plain loops
    /// ([`CachedKv::attend`]). The projections take all `b` rows at once, so each weight is read
    /// once.
    pub fn attend_cached(
        &self,
        x: &Tensor,
        caches: &[(&[f32], &[f32])],
        bias: Option<&[f32]>,
    ) -> Result<Tensor> {
        self.attend_queries(x, caches.len(), |queries, inner| {
            let mut out = Vec::with_capacity(queries.len());
            for (query, &(keys, values)) in queries.chunks_exact(inner).zip(caches) {
                // attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling   (scaling = 1.0)
                out.extend(self.cached(keys, values).attend(query, 0, 1.0, bias));
            }
            out
        })
    }

    /// [`Self::attend_cached`] for `b` sequences that share one cache over a fixed source (beams
    /// over one document's encoder output): [`SourceKv::attend_each`], each key column read
    /// once for every query, in whichever format the cache holds.
    pub fn attend_cached_shared(
        &self,
        x: &Tensor,
        cache: &SourceKv,
        bias: Option<&[f32]>,
    ) -> Result<Tensor> {
        let count = x.size()[0] as usize;
        self.attend_queries(x, count, |queries, _| {
            let (kv_heads, head_dim) = (self.num_heads as usize, self.d_kv as usize);
            cache.attend_each(kv_heads, head_dim, queries, count, 0, 1.0, bias)
        })
    }

    fn cached<'a>(&self, keys: &'a [f32], values: &'a [f32]) -> CachedKv<'a> {
        CachedKv {
            keys,
            values,
            kv_heads: self.num_heads as usize,
            head_dim: self.d_kv as usize,
        }
    }

    /// `o(attend(q(x)))` for `count` query rows `x` `[count, 1, d_model]`, `attend` taking the
    /// projected queries (`count × inner` values) and the inner width.
    fn attend_queries(
        &self,
        x: &Tensor,
        count: usize,
        attend: impl FnOnce(&[f32], usize) -> Vec<f32>,
    ) -> Result<Tensor> {
        let inner = (self.num_heads * self.d_kv) as usize;
        let queries = Vec::<f32>::try_from(&linear(x, &self.q)?.f_reshape([-1])?)?;
        if queries.len() != count * inner {
            return Err(Error::Internal(format!(
                "{} query values for {count} cached sequences of width {inner}",
                queries.len()
            )));
        }
        let out = attend(&queries, inner);
        linear(
            &Tensor::f_from_slice(&out)?.f_view([count as i64, 1, inner as i64])?,
            &self.o,
        )
    }

    /// `compute_bias`: `[1, heads, query_len, key_len]` for queries at positions
    /// `past .. past + query_len` over keys `0 .. key_len`.
    pub fn position_bias(
        &self,
        query_len: i64,
        key_len: i64,
        past: i64,
        bidirectional: bool,
        num_buckets: i64,
        max_distance: i64,
    ) -> Result<Tensor> {
        let table = self
            .relative_attention_bias
            .as_ref()
            .expect("position_bias is only called on a stack's first block");
        let opts = (Kind::Int64, table.device());
        let context = Tensor::f_arange(query_len, opts)?
            .f_add_scalar(past)?
            .f_unsqueeze(1)?;
        let memory = Tensor::f_arange(key_len, opts)?.f_unsqueeze(0)?;
        let relative = memory.f_sub(&context)?; // [q, k]
        let buckets =
            relative_position_bucket(&relative, bidirectional, num_buckets, max_distance)?;
        let values = table
            .f_index_select(0, &buckets.f_flatten(0, -1)?)?
            .f_view([query_len, key_len, self.num_heads])?; // [q, k, h]

        // Laid out once in the order every layer adds it in: a permuted view made each
        // layer's add a strided walk (3.6 ms of an encoder layer's ~50 at 353 tokens).
        Ok(values
            .f_permute([2, 0, 1])?
            .f_contiguous()?
            .f_unsqueeze(0)?)
    }
}

/// Keys and values cached for one sequence, token-major (`[len, kv_heads × head_dim]` each): a
/// decode step appends its token's in place. Query head `h` reads kv head `h / (heads /
/// kv_heads)` (grouped-query attention; `repeat_kv`).
pub struct CachedKv<'a, R: KvRows + ?Sized = [f32]> {
    pub keys: &'a R,
    pub values: &'a R,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl<R: KvRows + ?Sized> CachedKv<'_, R> {
    /// The attention of one query `q` `[heads × head_dim]` over the cached tokens `first ..`
    /// (earlier ones hidden, as a sliding window does): per head, `softmax(q·kᵀ × scaling +
    /// bias)·v`, with `bias` `[heads, len]` added where given (T5's position bias). Plain loops,
    /// for a decode step: a dozen tensor ops per layer cost more than this arithmetic. The
    /// roundings follow the tensor version except the order of the dot products' and the
    /// softmax's sums.
    ///
    /// The cache is walked token by token (each token's keys, then values, one contiguous row
    /// for every head), not head by head: a head's slice of a row is a few cache lines a row
    /// apart, and walking them head by head ran at ~40% of the memory bandwidth over a long
    /// context. Each head still sums its tokens in ascending order, so the results are the same
    /// bits either way. Each token's row asks for the next one's bytes ahead
    /// ([`KvRows::prefetch`]: on Intel cores, whose prefetchers lag behind this stream of rows).
    /// Rows held narrower than f32 ([`super::kv`]) are widened one at a time into a scratch row
    /// (only the columns of the heads this thread attends).
    /// On x86_64 the loops are compiled for AVX2 where the CPU has it (plain multiplies and adds,
    /// no FMA: the same roundings as the baseline SSE2 build).
    pub fn attend(&self, q: &[f32], first: usize, scaling: f32, bias: Option<&[f32]>) -> Vec<f32> {
        self.attend_each(q, 1, first, scaling, bias)
    }

    /// [`Self::attend`] for `count` queries over the same cache (`queries`: `count × heads ×
    /// head_dim`, one after another; beams reading one document): one walk of the cache for
    /// all of them, each query's result the same bits as its own [`Self::attend`]. With
    /// several compute threads and at least [`MIN_SPLIT_CACHED_SCORES`] scores, the heads are
    /// split over the threads: over a long context the walk is a large share of a decode
    /// step's bytes, and one thread alone left the others waiting.
    pub fn attend_each(
        &self,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        let heads = queries.len() / count.max(1) / self.head_dim.max(1);
        let total = self.keys.rows(self.kv_heads * self.head_dim);
        let scores = count * heads * total.saturating_sub(first);
        // `attend_in_groups` caps the groups at the heads.
        let groups = if scores >= MIN_SPLIT_CACHED_SCORES {
            parallel::compute_threads()
        } else {
            1
        };
        self.attend_in_groups(queries, count, first, scaling, bias, groups)
    }

    /// [`Self::attend_each`] with the heads split into `groups` consecutive groups spread over
    /// the compute threads (one group: on this thread). Each head is attended as it is
    /// alone, so every grouping gives the same bits. Each thread reads (and, for rows held
    /// narrower than f32, widens) only its heads' part of every row ([`KvRows::part`]).
    fn attend_in_groups(
        &self,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
        groups: usize,
    ) -> Vec<f32> {
        let hd = self.head_dim;
        let heads = queries.len() / count.max(1) / hd.max(1);
        let groups = groups.clamp(1, heads.max(1));
        if groups == 1 {
            return self.attend_heads(queries, count, first, scaling, bias, 0..heads);
        }
        let group = |g: usize| heads * g / groups..heads * (g + 1) / groups;
        let parts: Vec<Mutex<Vec<f32>>> = (0..groups).map(|_| Mutex::new(Vec::new())).collect();
        parallel::for_each_task(groups, &|g| {
            let part = self.attend_heads(queries, count, first, scaling, bias, group(g));
            *parts[g].lock().unwrap_or_else(|e| e.into_inner()) = part;
        });
        // Each group's `[count × its heads, hd]` back into `[count × heads, hd]`.
        let mut out = vec![0f32; count * heads * hd];
        for (g, part) in parts.into_iter().enumerate() {
            let part = part.into_inner().unwrap_or_else(|e| e.into_inner());
            let heads_of = group(g);
            let width = heads_of.len() * hd;
            for (i, rows) in part.chunks_exact(width.max(1)).enumerate() {
                out[(i * heads + heads_of.start) * hd..][..width].copy_from_slice(rows);
            }
        }
        out
    }

    /// The heads `group` of every query, `[count × group.len(), hd]`, on this thread.
    fn attend_heads(
        &self,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
        group: Range<usize>,
    ) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above).
            return unsafe { self.attend_avx2(queries, count, first, scaling, bias, group) };
        }
        self.attend_loops(queries, count, first, scaling, bias, group)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn attend_avx2(
        &self,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
        group: Range<usize>,
    ) -> Vec<f32> {
        self.attend_loops(queries, count, first, scaling, bias, group)
    }

    #[inline(always)]
    fn attend_loops(
        &self,
        queries: &[f32],
        count: usize,
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
        group: Range<usize>,
    ) -> Vec<f32> {
        let hd = self.head_dim;
        let width = self.kv_heads * hd;
        let total = self.keys.rows(width);
        let heads = queries.len() / count.max(1) / hd.max(1);
        let rep = (heads / self.kv_heads.max(1)).max(1);
        // Each head's offset in a cache row, worked out once: a division per head and token
        // cost more than the head's dot product on cores with slow 64-bit division.
        let kv_offsets: Vec<usize> = group.clone().map(|h| h / rep * hd).collect();
        // weights[(query × group heads + j) × total + t]: the scaled scores, then the softmax's
        // probabilities. Query `i`'s head `h` is row `i × heads + h` of `queries`; head `j` of
        // the group is row `i × group heads + j` of the output, `[count × group heads, hd]`.
        let group_heads = kv_offsets.len();
        let mut weights = vec![0f32; count * group_heads * total];
        // The columns of a row the group's heads read (a group's heads are consecutive).
        let span = heads_span(&kv_offsets, hd);
        // Those columns widened from a narrower format (none for f32 rows: no allocation).
        let mut scratch = vec![0f32; if R::WIDENS { span.len() } else { 0 }];
        for t in first..total {
            let keys = self.keys.part(t, width, span.clone(), &mut scratch);
            self.keys.prefetch(t + 1, width, span.clone());
            for (query, query_weights) in queries
                .chunks_exact(heads * hd)
                .zip(weights.chunks_exact_mut(group_heads * total))
            {
                for (j, h) in group.clone().enumerate() {
                    let at = kv_offsets[j] - span.start;
                    let key = &keys[at..at + hd];
                    let mut w = dot(&query[h * hd..(h + 1) * hd], key) * scaling;
                    if let Some(bias) = bias {
                        w += bias[h * total + t];
                    }
                    query_weights[j * total + t] = w;
                }
            }
        }
        mix_values(
            &mut weights,
            self.values,
            &kv_offsets,
            hd,
            width,
            first,
            &mut scratch,
        )
    }
}

/// Fewest scores (queries × heads × cached tokens) for which [`CachedKv::attend_each`] splits
/// the heads over the compute threads: a 64-token context with 16 heads, as
/// [`MIN_SPLIT_SCORES`] is a 64-token prompt's. Each score is a `head_dim`-long dot product and
/// as long a sum of values.
const MIN_SPLIT_CACHED_SCORES: usize = 16 * 64;

/// The softmax of each row of `weights` (`[count × heads, total]` scores, tokens `first..`
/// only), then each row's probabilities times the value rows: the second half of every cached
/// attention, `[count × heads, hd]` out. Head `h` of a query reads its values at
/// `kv_offsets[h]` of each row of `width`; `scratch` holds a row where the rows widen.
#[inline(always)]
pub(super) fn mix_values<R: KvRows + ?Sized>(
    weights: &mut [f32],
    values: &R,
    kv_offsets: &[usize],
    hd: usize,
    width: usize,
    first: usize,
    scratch: &mut [f32],
) -> Vec<f32> {
    let heads = kv_offsets.len();
    let total = values.rows(width);
    let rows = weights.len() / total.max(1);
    let span = heads_span(kv_offsets, hd);
    for head in weights.chunks_exact_mut(total.max(1)) {
        let head = &mut head[first..];
        let max = head.iter().fold(f32::NEG_INFINITY, |m, &w| m.max(w));
        let mut sum = 0f32;
        for w in head.iter_mut() {
            *w = (*w - max).exp();
            sum += *w;
        }
        head.iter_mut().for_each(|w| *w /= sum);
    }
    let mut out = vec![0f32; rows * hd];
    for t in first..total {
        let values_part = values.part(t, width, span.clone(), scratch);
        values.prefetch(t + 1, width, span.clone());
        for (query_out, query_weights) in out
            .chunks_exact_mut(heads * hd)
            .zip(weights.chunks_exact((heads * total).max(1)))
        {
            for (h, out) in query_out.chunks_exact_mut(hd).enumerate() {
                let p = query_weights[h * total + t];
                let at = kv_offsets[h] - span.start;
                let value = &values_part[at..at + hd];
                for (o, v) in out.iter_mut().zip(value) {
                    *o += p * v;
                }
            }
        }
    }
    out
}

/// The columns of a cache row that heads reading at `kv_offsets` (`hd` values each) cover:
/// from the first offset to the end of the last head's values (none without a head).
fn heads_span(kv_offsets: &[usize], hd: usize) -> Range<usize> {
    match (kv_offsets.iter().min(), kv_offsets.iter().max()) {
        (Some(&first), Some(&last)) => first..last + hd,
        _ => 0..0,
    }
}

/// `Σ a[i]·b[i]` over 16 running sums (lane `i % 16`), added together at the end: a fixed
/// order the compiler can keep in vector registers (a single running sum it may not reorder).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut sums = [0f32; LANES];
    let (a_blocks, b_blocks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_blocks
        .remainder()
        .iter()
        .zip(b_blocks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_blocks.zip(b_blocks) {
        for lane in 0..LANES {
            sums[lane] += x[lane] * y[lane];
        }
    }
    sums.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The attention of one query in the order a reader would write it (head by head, each
    /// head's tokens in turn), for [`CachedKv::attend`]'s token-major walk to equal bit for bit.
    fn attend_head_by_head(
        kv: &CachedKv<'_>,
        q: &[f32],
        first: usize,
        scaling: f32,
        bias: Option<&[f32]>,
    ) -> Vec<f32> {
        let hd = kv.head_dim;
        let width = kv.kv_heads * hd;
        let total = kv.keys.len() / width;
        let rep = q.len() / hd / kv.kv_heads;
        let mut out = vec![0f32; q.len()];
        for (h, out) in out.chunks_exact_mut(hd).enumerate() {
            let offset = h / rep * hd;
            let row = |cache: &[f32], t: usize| cache[t * width + offset..][..hd].to_vec();
            let scores: Vec<f32> = (first..total)
                .map(|t| {
                    let s = dot(&q[h * hd..(h + 1) * hd], &row(kv.keys, t)) * scaling;
                    s + bias.map_or(0.0, |b| b[h * total + t])
                })
                .collect();
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum = exps.iter().fold(0f32, |a, e| a + e);
            for (t, e) in (first..total).zip(exps) {
                let p = e / sum;
                for (o, v) in out.iter_mut().zip(row(kv.values, t)) {
                    *o += p * v;
                }
            }
        }
        out
    }

    /// Heads attended in groups, on this thread or over two compute threads, give the bits of
    /// the whole batch attended at once: with a per-head bias (4-D, and 3-D as broadcasting
    /// aligns it) and with a mask the heads share, scaled and not, for uneven groups, two
    /// sequences, and more keys than queries.
    #[test]
    fn attention_by_heads_gives_the_whole_batchs_values() {
        crate::quant::parallel::set_compute_threads(2);
        tch::manual_seed(7);
        let (b, heads, n, k, hd) = (2, 7, 80, 120, 16);
        let query = Tensor::randn([b, heads, n, hd], (Kind::Float, Device::Cpu));
        let keys = Tensor::randn([b, heads, k, hd], (Kind::Float, Device::Cpu));
        let values = Tensor::randn([b, heads, k, hd], (Kind::Float, Device::Cpu));
        let per_head = Tensor::randn([1, heads, n, k], (Kind::Float, Device::Cpu));
        // Causal over the last `n` keys: -inf above the diagonal, as a prompt's mask.
        let mask = Tensor::ones([n, k], (Kind::Float, Device::Cpu))
            .triu(k - n + 1)
            .f_mul_scalar(f64::NEG_INFINITY)
            .unwrap()
            .nan_to_num(0.0, None, None)
            .view([1, 1, n, k]);
        assert!(
            n * k * heads >= MIN_SPLIT_SCORES,
            "the split path is the one tested"
        );
        let per_head_3d = per_head.view([heads, n, k]);
        for (scale, bias) in [
            (None, Some(&per_head)),
            (None, Some(&per_head_3d)),
            (Some(0.25), Some(&mask)),
            (Some(0.25), None),
        ] {
            let whole = attend_head_groups(&query, &keys, &values, scale, bias, 1).unwrap();
            assert_eq!(whole.size(), [b, heads, n, hd]);
            for groups in [2, 3, heads] {
                let split =
                    attend_head_groups(&query, &keys, &values, scale, bias, groups).unwrap();
                assert!(
                    split.equal(&whole),
                    "{groups} groups: not the whole batch's values"
                );
            }
            let rows = attention_by_heads(&query, &keys, &values, scale, bias).unwrap();
            let expected = whole.transpose(1, 2).contiguous().view([b, n, heads * hd]);
            assert!(rows.equal(&expected), "the heads back to rows");
        }
    }

    /// The token-major walk gives the head-by-head attention's bits, with and without grouped
    /// heads, a hidden prefix (a sliding window) and a bias, in every compiled variant and with
    /// the heads split over two compute threads in groups; and both are the attention computed
    /// in f64 to within f32 rounding.
    #[test]
    fn cached_attention_gives_each_heads_sums_bit_for_bit() {
        crate::quant::parallel::set_compute_threads(2);
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut uniform = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        };
        for (heads, kv_heads, hd, total, first, biased) in [
            (4, 4, 64, 37, 0, false),
            (8, 2, 64, 300, 0, false),
            (4, 2, 24, 19, 5, true),
            (6, 6, 16, 1, 0, true),
            (2, 1, 8, 40, 3, true),
            (3, 3, 48, 33, 0, false),
        ] {
            let keys: Vec<f32> = (0..total * kv_heads * hd).map(|_| uniform()).collect();
            let values: Vec<f32> = (0..total * kv_heads * hd).map(|_| uniform()).collect();
            let q: Vec<f32> = (0..heads * hd).map(|_| uniform()).collect();
            let bias: Vec<f32> = (0..heads * total).map(|_| uniform()).collect();
            let bias = biased.then_some(bias.as_slice());
            let kv = CachedKv {
                keys: &keys[..],
                values: &values[..],
                kv_heads,
                head_dim: hd,
            };
            let scaling = (hd as f32).powf(-0.5);
            let want = attend_head_by_head(&kv, &q, first, scaling, bias);
            let case = format!("{heads} heads, {kv_heads} kv heads, {total} tokens from {first}");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&kv.attend(&q, first, scaling, bias)),
                bits(&want),
                "{case}"
            );
            assert_eq!(
                bits(&kv.attend_loops(&q, 1, first, scaling, bias, 0..heads)),
                bits(&want),
                "{case}"
            );
            // Three queries in one walk (beams over a shared cache): each query's own bits.
            let others: Vec<f32> = (0..2 * heads * hd).map(|_| uniform()).collect();
            let queries = [&others[..heads * hd], &q, &others[heads * hd..]].concat();
            let each: Vec<f32> = queries
                .chunks_exact(heads * hd)
                .flat_map(|query| attend_head_by_head(&kv, query, first, scaling, bias))
                .collect();
            if total - first > 1 {
                // (Over one token every query's attention is that token's values.)
                assert_ne!(
                    bits(&each[..heads * hd]),
                    bits(&want),
                    "{case}: queries differ"
                );
            }
            for attended in [
                kv.attend_each(&queries, 3, first, scaling, bias),
                kv.attend_loops(&queries, 3, first, scaling, bias, 0..heads),
            ] {
                assert_eq!(bits(&attended), bits(&each), "{case}, three queries");
            }
            // The heads split into groups (on the compute threads, or on this one when the
            // pool is busy): every grouping gives each query's own bits.
            for groups in [2, 3, heads] {
                for (n, queries, want) in [(1, &q[..], &want), (3, &queries[..], &each)] {
                    let split = kv.attend_in_groups(queries, n, first, scaling, bias, groups);
                    assert_eq!(
                        bits(&split),
                        bits(want),
                        "{case}, {n} queries, {groups} groups"
                    );
                }
            }
            // The same attention in f64.
            let rep = heads / kv_heads;
            for h in 0..heads {
                let offset = h / rep * hd;
                let at = |cache: &[f32], t: usize, i: usize| cache[t * kv_heads * hd + offset + i];
                let scores: Vec<f64> = (first..total)
                    .map(|t| {
                        let s: f64 = (0..hd)
                            .map(|i| q[h * hd + i] as f64 * at(&keys, t, i) as f64)
                            .sum();
                        s * scaling as f64 + bias.map_or(0.0, |b| b[h * total + t] as f64)
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for i in 0..hd {
                    let exact: f64 = (first..total)
                        .zip(&scores)
                        .map(|(t, s)| (s - max).exp() / sum * at(&values, t, i) as f64)
                        .sum();
                    let got = want[h * hd + i] as f64;
                    assert!(
                        (got - exact).abs() < 1e-4,
                        "{case}, head {h}: {got} vs {exact}"
                    );
                }
            }
        }
    }

    /// The position bias is `[1, heads, queries, keys]` with `bias[h, i, j] = table[bucket(j −
    /// past − i), h]`, and laid out in that order: every layer adds it to its scores, and a
    /// strided view made each add several times slower (BENCHMARKS §9.19).
    #[test]
    fn position_bias_is_the_tables_values_laid_out_by_head() {
        let (heads, buckets) = (3i64, 32i64);
        let zeros = || Weight::Tensor(Tensor::zeros([heads * 4, 8], (Kind::Float, Device::Cpu)));
        let table: Vec<f32> = (0..buckets * heads).map(|v| v as f32 * 0.5 - 7.0).collect();
        let attention = Attention {
            q: zeros(),
            k: zeros(),
            v: zeros(),
            o: zeros(),
            relative_attention_bias: Some(Tensor::from_slice(&table).view([buckets, heads])),
            num_heads: heads,
            d_kv: 4,
        };
        for (queries, keys, past, bidirectional) in [(7i64, 7i64, 0i64, true), (1, 12, 11, false)] {
            let bias = attention
                .position_bias(queries, keys, past, bidirectional, buckets, 128)
                .unwrap();
            assert_eq!(bias.size(), [1, heads, queries, keys]);
            assert!(bias.is_contiguous(), "the bias is a strided view");
            let positions = |n: i64| Tensor::arange(n, (Kind::Int64, Device::Cpu));
            let relative = positions(keys).unsqueeze(0) - (positions(queries) + past).unsqueeze(1);
            let bucket = relative_position_bucket(&relative, bidirectional, buckets, 128).unwrap();
            let bucket = Vec::<i64>::try_from(&bucket.reshape([-1])).unwrap();
            let values = f32_values(&bias).expect("a contiguous f32 CPU tensor");
            for h in 0..heads as usize {
                for (ij, &b) in bucket.iter().enumerate() {
                    let at = h * bucket.len() + ij;
                    assert_eq!(
                        values[at],
                        table[b as usize * heads as usize + h],
                        "head {h}, {ij}"
                    );
                }
            }
        }
    }

    /// The attention's dot product against a sum in f64, on lengths with and without whole
    /// blocks of lanes and a tail (the golden fixtures' heads are shorter than a block).
    #[test]
    fn dot_products_sum_every_pair_once() {
        for len in [0, 1, 15, 16, 17, 64, 128, 131] {
            let a: Vec<f32> = (0..len)
                .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..len)
                .map(|i| ((i * 53 % 19) as f32 - 9.0) / 5.0)
                .collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = dot(&a, &b) as f64;
            assert!(
                (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{len}: {got} vs {want}"
            );
        }
    }
}
