//! Building blocks ported from Hugging Face's `modeling_switch_transformers.py` (transformers
//! 5.x): RMS layer norm, attention without score scaling, relative position buckets, dense FF;
//! and from the decoder-only families (`modeling_mixtral.py`, `modeling_qwen2_moe.py`,
//! `modeling_olmoe.py`): the SwiGLU MLP, rotary position embeddings and `repeat_kv` for
//! grouped-query attention. Each op mirrors the PyTorch line it ports so that results match to
//! float rounding.

use tch::{Kind, Tensor};

use crate::error::Result;

/// `SwitchTransformersLayerNorm`: RMS norm, no mean subtraction, no bias.
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        let variance = x
            .f_pow_tensor_scalar(2)?
            .f_mean_dim(-1, true, Kind::Float)?;
        // hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        let normed = x.f_mul(&variance.f_add_scalar(self.eps)?.f_rsqrt()?)?;
        // return self.weight * hidden_states
        Ok(self.weight.f_mul(&normed)?)
    }
}

/// `nn.Linear(..., bias=False)`: `x · wᵀ`.
pub fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    Ok(x.f_linear::<&Tensor>(weight, None)?)
}

/// `SwitchTransformersDenseActDense` with ReLU: `relu(x · wiᵀ) · woᵀ`.
pub fn dense_act_dense(x: &Tensor, wi: &Tensor, wo: &Tensor) -> Result<Tensor> {
    linear(&linear(x, wi)?.f_relu()?, wo)
}

/// SwiGLU MLP (`MixtralExperts`, `Qwen2MoeMLP`, `OlmoeExperts` for one expert):
/// `down(silu(gate(x)) * up(x))`, with `gate`/`up` `[d_ff, d]` and `down` `[d, d_ff]`.
pub fn gated_mlp(x: &Tensor, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<Tensor> {
    // current_hidden_states = self.act_fn(gate) * up
    let hidden = linear(x, gate)?.f_silu()?.f_mul(&linear(x, up)?)?;
    linear(&hidden, down)
}

/// `nn.Linear` with an optional bias.
pub fn linear_bias(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    Ok(x.f_linear(weight, bias)?)
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
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// `[d_model, inner]`
    pub o: Tensor,
    /// `[num_buckets, num_heads]` on the first block of a stack only.
    pub relative_attention_bias: Option<Tensor>,
    pub num_heads: i64,
    pub d_kv: i64,
}

impl Attention {
    /// `[b, n, d_model]` → `[b, heads, n, d_kv]`
    pub fn project(&self, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
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
        let (b, n) = (x.size()[0], x.size()[1]);
        let query = self.project(x, &self.q)?;
        // attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling   (scaling = 1.0)
        let mut scores = query.f_matmul(&keys.f_transpose(2, 3)?)?; // [b, h, n, k]
        if let Some(bias) = position_bias {
            scores = scores.f_add(bias)?;
        }
        let weights = scores.f_softmax(-1, Kind::Float)?;
        let out = weights
            .f_matmul(values)? // [b, h, n, d_kv]
            .f_transpose(1, 2)?
            .f_contiguous()?
            .f_reshape([b, n, self.num_heads * self.d_kv])?;
        linear(&out, &self.o)
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
        Ok(values.f_permute([2, 0, 1])?.f_unsqueeze(0)?)
    }
}
