//! The MoE feed-forward: route on the host, then run each chosen expert once over all the tokens
//! routed to it (tokens grouped by expert, so an expert is fetched once per layer per call).
//!
//! Port of `SwitchTransformersTop1Router` + `SwitchTransformersSparseMLP` (transformers 5.x):
//! router logits in f32 → softmax in f32 → top-1; a token beyond its expert's capacity within its
//! sequence gets no FF output (zeros, so the block keeps only the residual); the expert output is
//! scaled by the router probability of the chosen expert.

use tch::{Device, Kind, Tensor};

use super::layers::dense_act_dense;
use crate::config::Stack;
use crate::error::Result;
use crate::expert_store::ExpertId;
use crate::provider::ExpertProvider;

/// A block's router: `classifier` `[num_experts, d_model]` (+ optional bias).
pub struct Router {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

/// The routing decisions of one MoE layer for one forward call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerRoute {
    pub stack: Stack,
    /// Block index inside the stack.
    pub layer: usize,
    /// Chosen expert per token, in `[batch, seq]` row-major order.
    pub experts: Vec<u16>,
    /// Whether the token overflowed its expert's capacity and got no expert output.
    pub dropped: Vec<bool>,
}

/// The MoE sub-layer of block `layer` of `stack` on `x` `[b, n, d_model]` (already normed).
pub fn moe_ffn(
    x: &Tensor,
    router: &Router,
    stack: Stack,
    layer: usize,
    expert_capacity: usize,
    provider: &mut dyn ExpertProvider,
    routes: &mut Vec<LayerRoute>,
) -> Result<Tensor> {
    let size = x.size();
    let (b, n, d) = (size[0], size[1], size[2]);
    let tokens = x.f_reshape([b * n, d])?; // [t, d]
                                           // router_logits = self.classifier(hidden_states.to(float32)); softmax in float32
    let logits = tokens.f_linear(&router.weight, router.bias.as_ref())?; // [t, E]
    let probs = logits.f_softmax(-1, Kind::Float)?;
    let chosen = probs.f_argmax(-1, false)?; // [t]
    let weights = probs.f_amax([-1i64].as_slice(), false)?; // [t], probability of the choice
    let chosen: Vec<i64> = Vec::<i64>::try_from(&chosen.f_to_device(Device::Cpu)?)?;
    let chosen_experts: Vec<u16> = chosen.iter().map(|&e| e as u16).collect();
    // Before any expert computes: drop stale prefetches, prefetch the next layer's experts.
    provider.routed(stack, layer, &chosen_experts)?;

    // token_priority = cumsum(one_hot(expert_index), dim=seq); keep while <= expert_capacity
    let num_experts = router.weight.size()[0] as usize;
    let mut dropped = vec![false; chosen.len()];
    let mut tokens_of: Vec<Vec<i64>> = vec![Vec::new(); num_experts];
    for row in 0..b as usize {
        let mut seen = vec![0usize; num_experts];
        for pos in 0..n as usize {
            let t = row * n as usize + pos;
            let e = chosen[t] as usize;
            seen[e] += 1;
            if seen[e] <= expert_capacity {
                tokens_of[e].push(t as i64);
            } else {
                dropped[t] = true;
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
    let mut out = tokens.f_zeros_like()?;
    for (i, &expert) in used.iter().enumerate() {
        let idx = Tensor::f_from_slice(&tokens_of[expert])?.f_to_device(x.device())?;
        let selected = tokens.f_index_select(0, &idx)?; // [t_e, d]
        let w = provider.expert(expert_id(expert))?;
        // Experts are decoded on the host; on a GPU they are moved for the matmuls.
        let (wi, wo) = if w.wi.device() == x.device() {
            (w.wi, w.wo)
        } else {
            (w.wi.f_to_device(x.device())?, w.wo.f_to_device(x.device())?)
        };
        // The next expert's read overlaps this one's compute.
        if let Some(&next) = used.get(i + 1) {
            provider.will_use(expert_id(next))?;
        }
        let y = dense_act_dense(&selected, &wi, &wo)?
            .f_mul(&weights.f_index_select(0, &idx)?.f_unsqueeze(-1)?)?;
        let _ = out.f_index_add_(0, &idx, &y)?;
    }
    routes.push(LayerRoute {
        stack,
        layer,
        experts: chosen_experts,
        dropped,
    });
    Ok(out.f_reshape([b, n, d])?)
}
