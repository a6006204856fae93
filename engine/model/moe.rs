//! The MoE feed-forward, one function for every architecture: route on the host, then run each
//! chosen expert once over all the tokens routed to it (tokens grouped by expert, so an expert
//! is fetched once per layer per call — the encoder pass and a decoder-only prompt prefill get
//! this grouping for free).
//!
//! Routing (router logits in f32 → softmax in f32 → selection), per [`Routing`]:
//! - [`Routing::Top1`], `SwitchTransformersTop1Router` + `SwitchTransformersSparseMLP`: argmax; a
//!   token beyond its expert's capacity within its sequence gets no FF output (zeros, so the
//!   block keeps only the residual); the expert output is scaled by the chosen probability.
//! - [`Routing::TopK`], `MixtralTopKRouter` / `Qwen2MoeTopKRouter` / `OlmoeTopKRouter` +
//!   their `*Experts`: `torch.topk` of the probabilities (descending, libtorch's tie order),
//!   optionally renormalised to sum to 1; each expert's output is scaled by its weight and the
//!   k outputs are summed in ascending expert order, as HF's `index_add_` loop does.
//!
//! A [`LayerRoute`] records k experts per token (router order: highest weight first).

use tch::{Kind, Tensor};

use super::layers::{dense_act_dense, gated_mlp, linear_bias, Linear};
use crate::error::Result;
use crate::ids::ExpertId;
use crate::ids::Stack;
use crate::model::provider::{ExpertProvider, ExpertWeights};
use crate::quant::matrix::{matmul, MatrixRef};

/// A block's router: `[num_experts, d_model]` (+ optional bias).
pub struct Router {
    pub weight: Linear,
    pub bias: Option<Tensor>,
}

/// How router probabilities become expert choices and weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Switch Transformers: one expert per token, at most `capacity` tokens per expert per
    /// sequence.
    Top1 { capacity: usize },
    /// Decoder-only families: `k` experts per token, weights renormalised if `normalize`.
    TopK { k: usize, normalize: bool },
}

impl Routing {
    pub fn k(self) -> usize {
        match self {
            Routing::Top1 { .. } => 1,
            Routing::TopK { k, .. } => k,
        }
    }
}

/// The routing decisions of one MoE layer for one forward call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRoute {
    pub stack: Stack,
    /// Block index inside the stack.
    pub layer: usize,
    /// Experts per token.
    pub k: usize,
    /// Chosen experts, `k` per token (highest weight first), tokens in `[batch, seq]` row-major
    /// order: `[tokens × k]`.
    pub experts: Vec<u16>,
    /// Whether the token overflowed its expert's capacity and got no expert output (top-1).
    pub dropped: Vec<bool>,
}

impl LayerRoute {
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.k.max(1)
    }

    /// The experts of token `t`, highest weight first.
    pub fn token_experts(&self, t: usize) -> &[u16] {
        &self.experts[t * self.k..(t + 1) * self.k]
    }
}

/// One expert's FFN on one token `x` `[d]` on the CPU, by the engine's kernels and plain loops
/// (no tensor ops: a decode step runs 8 experts × 2 layers of these, and the dozen libtorch ops
/// per expert of [`expert_forward`] cost more than the arithmetic). The same math as
/// [`expert_forward`]: ReLU exactly, SiLU as `x / (1 + exp(−x))` (libtorch's formula; its
/// vectorised `exp` may round the last bit differently). `None` when a matrix is not on the CPU.
fn expert_forward_token(x: &[f32], w: &ExpertWeights) -> Result<Option<Vec<f32>>> {
    let product = |m: MatrixRef<'_>, x: &[f32]| -> Result<Vec<f32>> {
        let mut y = vec![0f32; m.rows()];
        matmul(x, 1, m, &mut y)?;
        Ok(y)
    };
    Ok(Some(match w {
        ExpertWeights::Relu { wi, wo } => {
            let (Some(wi), Some(wo)) = (wi.cpu_matrix()?, wo.cpu_matrix()?) else {
                return Ok(None);
            };
            let mut hidden = product(wi, x)?;
            hidden.iter_mut().for_each(|h| *h = h.max(0.0));
            product(wo, &hidden)?
        }
        ExpertWeights::SwiGlu { gate, up, down } => {
            let (Some(gate), Some(up), Some(down)) =
                (gate.cpu_matrix()?, up.cpu_matrix()?, down.cpu_matrix()?)
            else {
                return Ok(None);
            };
            let mut hidden = product(gate, x)?;
            let up = product(up, x)?;
            for (h, u) in hidden.iter_mut().zip(up) {
                *h = *h / (1.0 + (-*h).exp()) * u;
            }
            product(down, &hidden)?
        }
    }))
}

/// One expert's FFN on `x` `[t, d]`.
pub fn expert_forward(x: &Tensor, w: &ExpertWeights) -> Result<Tensor> {
    match w {
        ExpertWeights::Relu { wi, wo } => dense_act_dense(x, wi, wo),
        ExpertWeights::SwiGlu { gate, up, down } => gated_mlp(x, gate, up, down),
    }
}

/// Routes tokens `[t, d]`: the chosen experts `[t × k]` (highest weight first per token) and
/// their weights `[t × k]`, before any capacity limit.
fn route(tokens: &Tensor, router: &Router, routing: Routing) -> Result<(Tensor, Tensor)> {
    // router_logits = linear(hidden_states, weight); softmax in float32
    let logits = linear_bias(tokens, &router.weight, router.bias.as_ref())?; // [t, E]
    let probs = logits.f_softmax(-1, Kind::Float)?;
    Ok(match routing {
        Routing::Top1 { .. } => (
            probs.f_argmax(-1, false)?,               // [t]
            probs.f_amax([-1i64].as_slice(), false)?, // [t], probability of the choice
        ),
        Routing::TopK { k, normalize } => {
            // router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
            let (mut top, idx) = probs.f_topk(k as i64, -1, true, true)?; // [t, k] each
            if normalize {
                // router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
                top =
                    top.f_div(&top.f_sum_dim_intlist([-1i64].as_slice(), true, Kind::Float)?)?;
            }
            (idx.f_reshape([-1])?, top.f_reshape([-1])?) // [t × k]
        }
    })
}

/// The gate lookahead: a later MoE block's `router` applied ahead of time to hidden states
/// `x` `[b, n, d_model]` (normed with that block's FF norm) — the experts that block would
/// choose if the hidden states did not change on the way, `routing.k()` per token, tokens
/// row-major. A prediction only: it decides which reads start early, never the output.
pub fn route_ahead(x: &Tensor, router: &Router, routing: Routing) -> Result<Vec<u16>> {
    let size = x.size();
    let tokens = x.f_reshape([size[0] * size[1], size[2]])?;
    let (chosen, _) = route(&tokens, router, routing)?;
    let chosen = Vec::<i64>::try_from(&chosen.f_to_device(tch::Device::Cpu)?)?;
    Ok(chosen.into_iter().map(|e| e as u16).collect())
}

/// The MoE sub-layer of block `layer` of `stack` on `x` `[b, n, d_model]` (already normed).
pub fn moe_ffn(
    x: &Tensor,
    router: &Router,
    routing: Routing,
    stack: Stack,
    layer: usize,
    provider: &mut dyn ExpertProvider,
    routes: &mut Vec<LayerRoute>,
) -> Result<Tensor> {
    let size = x.size();
    let (b, n, d) = (size[0], size[1], size[2]);
    let tokens = x.f_reshape([b * n, d])?; // [t, d]
    let t_count = (b * n) as usize;
    let k = routing.k();
    let (chosen, weights) = route(&tokens, router, routing)?;
    let chosen: Vec<i64> = Vec::<i64>::try_from(&chosen.f_to_device(tch::Device::Cpu)?)?;
    let chosen_experts: Vec<u16> = chosen.iter().map(|&e| e as u16).collect();
    // Before any expert computes: drop stale prefetches, prefetch the next layer's experts.
    provider.routed(stack, layer, k, &chosen_experts)?;

    // Per expert: the tokens routed to it and the positions of their weights in `weights`.
    let num_experts = router.weight.size()[0] as usize;
    let mut dropped = vec![false; t_count];
    let mut tokens_of: Vec<Vec<i64>> = vec![Vec::new(); num_experts];
    let mut slots_of: Vec<Vec<i64>> = vec![Vec::new(); num_experts];
    match routing {
        Routing::Top1 { capacity } => {
            // token_priority = cumsum(one_hot(expert_index), dim=seq); keep while <= capacity
            for row in 0..b as usize {
                let mut seen = vec![0usize; num_experts];
                for pos in 0..n as usize {
                    let t = row * n as usize + pos;
                    let e = chosen[t] as usize;
                    seen[e] += 1;
                    if seen[e] <= capacity {
                        tokens_of[e].push(t as i64);
                        slots_of[e].push(t as i64);
                    } else {
                        dropped[t] = true;
                    }
                }
            }
        }
        Routing::TopK { .. } => {
            for (slot, &e) in chosen.iter().enumerate() {
                tokens_of[e as usize].push((slot / k) as i64);
                slots_of[e as usize].push(slot as i64);
            }
        }
    }

    let expert_id = |expert: usize| ExpertId {
        stack,
        layer: layer as u16,
        expert: expert as u16,
    };
    let used: Vec<usize> = (0..num_experts)
        .filter(|&e| !tokens_of[e].is_empty())
        .collect();
    // One token on the CPU (a decode step): the experts' outputs summed in plain loops, in the
    // order and roundings of the `index_add_` below (each output scaled, then added to zeros).
    let out = if t_count == 1 && x.device() == tch::Device::Cpu {
        let token = Vec::<f32>::try_from(&tokens.f_to_kind(Kind::Float)?.f_reshape([-1])?)?;
        let scales = Vec::<f32>::try_from(&weights.f_to_kind(Kind::Float)?)?;
        let mut out = vec![0f32; token.len()];
        for (i, &expert) in used.iter().enumerate() {
            let next = used.get(i + 1).map(|&e| expert_id(e));
            let w = provider.expert(expert_id(expert), next)?;
            let y = match expert_forward_token(&token, &w)? {
                Some(y) => y,
                // A matrix the kernels cannot take where it is: libtorch computes this one.
                None => Vec::<f32>::try_from(&expert_forward(&tokens, &w)?.f_reshape([-1])?)?,
            };
            let scale = scales[slots_of[expert][0] as usize];
            for (o, y) in out.iter_mut().zip(y) {
                *o += y * scale;
            }
        }
        Tensor::f_from_slice(&out)?
    } else {
        let mut out = tokens.f_zeros_like()?;
        for (i, &expert) in used.iter().enumerate() {
            let idx = Tensor::f_from_slice(&tokens_of[expert])?.f_to_device(x.device())?;
            let selected = tokens.f_index_select(0, &idx)?; // [t_e, d]

            // The next expert's read overlaps this one's compute. Experts are computed on in
            // their stored encoding on the CPU; on a GPU they are expanded for the matmuls.
            let next = used.get(i + 1).map(|&e| expert_id(e));
            let w = provider
                .expert(expert_id(expert), next)?
                .to_device(x.device())?;
            let slots = Tensor::f_from_slice(&slots_of[expert])?.f_to_device(x.device())?;
            let scale = weights.f_index_select(0, &slots)?; // [t_e]
            let y = expert_forward(&selected, &w)?.f_mul(&scale.f_unsqueeze(-1)?)?; // [t_e, d]
            let _ = out.f_index_add_(0, &idx, &y)?;
        }
        out
    };
    routes.push(LayerRoute {
        stack,
        layer,
        k,
        experts: chosen_experts,
        dropped,
    });
    Ok(out.f_reshape([b, n, d])?)
}
