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
//! Where the experts compute: one token on the CPU (a decode step) in plain loops around the
//! engine's kernels; many tokens on the CPU (an encoder pass, a prompt) through reused row
//! buffers, the layer's own loops spread over the compute threads; anything else (a GPU) in
//! libtorch's ops. All three add the experts' outputs in the same order and roundings.
//!
//! A [`LayerRoute`] records k experts per token (router order: highest weight first).

use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

use super::layers::{dense_act_dense, f32_values, gated_mlp, linear_bias, Linear};
use crate::error::Result;
use crate::ids::ExpertId;
use crate::ids::Stack;
use crate::model::provider::{ExpertProvider, ExpertWeights};
use crate::quant::matrix::{matmul, matvec_gated, MatrixRef};
use crate::quant::parallel;

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
    let Some(KernelMatrices { first, up, last }) = KernelMatrices::of(w)? else {
        return Ok(None);
    };
    let hidden = match up {
        None => {
            let mut hidden = product(first, x)?;
            hidden.iter_mut().for_each(|h| *h = h.max(0.0));
            hidden
        }
        // gate and up as one product of the compute threads, SiLU × up beside it.
        Some(up) => {
            let mut hidden = vec![0f32; first.rows()];
            matvec_gated(x, first, up, |g, u| g / (1.0 + (-g).exp()) * u, &mut hidden)?;
            hidden
        }
    };
    Ok(Some(product(last, &hidden)?))
}

/// An expert's matrices as the engine's kernels take them (on the CPU).
struct KernelMatrices<'w> {
    /// `wi` (ReLU) or `gate` (SwiGLU).
    first: MatrixRef<'w>,
    /// SwiGLU's `up`.
    up: Option<MatrixRef<'w>>,
    /// `wo` or `down`.
    last: MatrixRef<'w>,
}

impl<'w> KernelMatrices<'w> {
    /// `None` when a matrix is not on the CPU.
    fn of(w: &'w ExpertWeights) -> Result<Option<Self>> {
        Ok(match w {
            ExpertWeights::Relu { wi, wo } => match (wi.cpu_matrix()?, wo.cpu_matrix()?) {
                (Some(first), Some(last)) => Some(KernelMatrices {
                    first,
                    up: None,
                    last,
                }),
                _ => None,
            },
            ExpertWeights::SwiGlu { gate, up, down } => {
                match (gate.cpu_matrix()?, up.cpu_matrix()?, down.cpu_matrix()?) {
                    (Some(first), Some(up), Some(last)) => Some(KernelMatrices {
                        first,
                        up: Some(up),
                        last,
                    }),
                    _ => None,
                }
            }
        })
    }
}

/// Rows of the MoE layer's own loops per compute-thread task (gathering, SiLU × up, scaling and
/// adding): enough that a task is worth a handoff, few enough that 64-row experts split.
const ROWS_PER_TASK: usize = 16;

/// What the parts of [`silu_times`] start at a multiple of: libtorch's widest loop step (two
/// 512-bit vectors of f32 is 32 values), with room.
const SILU_ALIGN: usize = 64;

/// One layer call's working rows for [`RowsScratch::expert_forward`], reused from expert to
/// expert.
#[derive(Default)]
struct RowsScratch {
    /// The expert's tokens, gathered: `[t_e, d]`.
    selected: Vec<f32>,
    /// The first product (`wi`, or `gate` then SiLU × up): `[t_e, d_ff]`.
    hidden: Vec<f32>,
    /// `up`'s product: `[t_e, d_ff]`.
    up: Vec<f32>,
    /// The expert's output: `[t_e, d]`.
    output: Vec<f32>,
}

impl RowsScratch {
    /// One expert's FFN on the tokens `rows` of `values` `[t, d]` (f32 on the CPU): its output
    /// `[rows, d]`, the same values as [`expert_forward`] on those rows gathered (the same
    /// products; ReLU as a comparison; SiLU × up by libtorch's own ops, see [`silu_times`]).
    fn expert_forward(
        &mut self,
        values: &[f32],
        d: usize,
        rows: &[i64],
        w: &ExpertWeights,
    ) -> Result<&[f32]> {
        let n = rows.len();
        let selected = grown(&mut self.selected, n * d);
        gather_rows(values, d, rows, selected);
        let Some(KernelMatrices { first, up, last }) = KernelMatrices::of(w)? else {
            // A matrix the kernels cannot take where it is: libtorch computes this expert.
            let selected = Tensor::f_from_slice(selected)?.f_reshape([n as i64, -1])?;
            let y = Vec::<f32>::try_from(&expert_forward(&selected, w)?.f_reshape([-1])?)?;
            let output = grown(&mut self.output, y.len());
            output.copy_from_slice(&y);
            return Ok(output);
        };
        let hidden = grown(&mut self.hidden, n * first.rows());
        matmul(selected, n, first, hidden)?;
        match up {
            None => hidden.iter_mut().for_each(|h| {
                if *h < 0.0 {
                    *h = 0.0
                }
            }),
            Some(up) => {
                let up_values = grown(&mut self.up, n * up.rows());
                matmul(selected, n, up, up_values)?;
                silu_times(hidden, up_values, first.rows())?;
            }
        }
        let output = grown(&mut self.output, n * last.rows());
        matmul(hidden, n, last, output)?;
        Ok(output)
    }
}

/// The first `len` values of `buffer`, grown to hold them but never cleared: every caller
/// overwrites all `len` values, so what an earlier expert left needs no zeroing.
fn grown(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    &mut buffer[..len]
}

/// Rows `rows` of `values` `[t, d]` into `selected` `[rows, d]`, a task's rows per thread.
fn gather_rows(values: &[f32], d: usize, rows: &[i64], selected: &mut [f32]) {
    let chunks: Vec<Mutex<&mut [f32]>> = selected
        .chunks_mut(ROWS_PER_TASK * d)
        .map(Mutex::new)
        .collect();
    parallel::for_each_task(chunks.len(), &|t| {
        let mut chunk = chunks[t].lock().unwrap_or_else(|e| e.into_inner());
        let tokens = &rows[t * ROWS_PER_TASK..];
        for (row, &token) in chunk.chunks_exact_mut(d).zip(tokens) {
            let token = token as usize;
            row.copy_from_slice(&values[token * d..(token + 1) * d]);
        }
    });
}

/// `hidden = silu(hidden) * up` over rows of `width` values, by libtorch's in-place `silu_`
/// and `mul_` (so the roundings of its vectorised `exp` are kept), in one part per compute
/// thread.
///
/// libtorch computes the last values of a tensor that do not fill its loop's step (two vectors)
/// with the scalar formula instead, so the parts start at multiples of [`SILU_ALIGN`] values:
/// then only the last part has such a tail, the same values as the whole tensor's.
fn silu_times(hidden: &mut [f32], up: &[f32], width: usize) -> Result<()> {
    let parts = parallel::compute_threads()
        .min(hidden.len().div_ceil(ROWS_PER_TASK * width))
        .max(1);
    let part_len = hidden.len().div_ceil(parts).next_multiple_of(SILU_ALIGN);
    let chunks: Vec<Mutex<(&mut [f32], &[f32])>> = hidden
        .chunks_mut(part_len)
        .zip(up.chunks(part_len))
        .map(Mutex::new)
        .collect();
    parallel::try_for_each_task(chunks.len(), &|t| {
        let mut chunk = chunks[t].lock().unwrap_or_else(|e| e.into_inner());
        let (hidden, up) = &mut *chunk;
        let len = [hidden.len() as i64];
        // SAFETY: views of this task's own chunks, alive (and otherwise untouched) until the
        // ops below return; `hidden`'s view is the only one written.
        let (mut h, u) = unsafe {
            (
                Tensor::f_from_blob(
                    hidden.as_mut_ptr() as *const u8,
                    &len,
                    &[],
                    Kind::Float,
                    Device::Cpu,
                )?,
                Tensor::f_from_blob(
                    up.as_ptr() as *const u8,
                    &len,
                    &[],
                    Kind::Float,
                    Device::Cpu,
                )?,
            )
        };
        let _ = h.f_silu_()?.f_mul_(&u)?;
        Ok(())
    })
}

/// `out[rows[i]] += y[i] · scales[slots[i]]` for every row `i` of `y` `[rows, d]`: each product
/// rounded, then added, as `index_add_` of the scaled rows does (an expert's rows are distinct
/// tokens, so tasks never share an output row).
fn add_scaled_rows(
    out_rows: &[Mutex<&mut [f32]>],
    rows: &[i64],
    slots: &[i64],
    scales: &[f32],
    y: &[f32],
    d: usize,
) {
    let tasks = rows.len().div_ceil(ROWS_PER_TASK);
    parallel::for_each_task(tasks, &|t| {
        let first = t * ROWS_PER_TASK;
        let last = (first + ROWS_PER_TASK).min(rows.len());
        for i in first..last {
            let mut out = out_rows[rows[i] as usize]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let scale = scales[slots[i] as usize];
            for (o, &v) in out.iter_mut().zip(&y[i * d..(i + 1) * d]) {
                *o += v * scale;
            }
        }
    });
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
    } else if let (tch::Device::Cpu, Some(values)) = (x.device(), f32_values(&tokens)) {
        // Many tokens on the CPU: the same products, with the layer's own work (gathering each
        // expert's rows, SiLU × up, scaling and adding) spread over the compute threads.
        let scales = Vec::<f32>::try_from(&weights.f_to_kind(Kind::Float)?)?;
        let d = d as usize;
        let mut out = vec![0f32; values.len()];
        let out_rows: Vec<Mutex<&mut [f32]>> = out.chunks_mut(d).map(Mutex::new).collect();
        let mut scratch = RowsScratch::default();
        for (i, &expert) in used.iter().enumerate() {
            let next = used.get(i + 1).map(|&e| expert_id(e));
            let w = provider.expert(expert_id(expert), next)?;
            let rows = &tokens_of[expert];
            let y = scratch.expert_forward(values, d, rows, &w)?;
            add_scaled_rows(&out_rows, rows, &slots_of[expert], &scales, y, d);
        }
        drop(out_rows);
        Tensor::f_from_slice(&out)?
    } else {
        let mut out = tokens.f_zeros_like()?;
        for (i, &expert) in used.iter().enumerate() {
            let idx = Tensor::f_from_slice(&tokens_of[expert])?.f_to_device(x.device())?;
            let selected = tokens.f_index_select(0, &idx)?; // [t_e, d]

            // A GPU (or activations that are not f32): libtorch's ops, the experts expanded for
            // its matmuls. The next expert's read overlaps this one's compute.
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layers::Weight;
    use crate::quant::matrix::{MatrixFormat, PackedMatrix};
    use crate::quant::QuantBits;

    /// Experts held in memory: `wi`, `wo` each (ReLU) or `gate`, `up`, `down` (SwiGLU).
    struct HeldExperts {
        matrices: Vec<Vec<PackedMatrix>>,
        relu: bool,
    }

    impl HeldExperts {
        fn random(experts: usize, d: usize, d_ff: usize, relu: bool, format: MatrixFormat) -> Self {
            let shapes: &[(usize, usize)] = if relu {
                &[(d_ff, d), (d, d_ff)]
            } else {
                &[(d_ff, d), (d_ff, d), (d, d_ff)]
            };
            let matrices = (0..experts)
                .map(|_| {
                    shapes
                        .iter()
                        .map(|&(rows, cols)| {
                            let w =
                                Tensor::randn([(rows * cols) as i64], (Kind::Float, Device::Cpu))
                                    .f_mul_scalar(0.2)
                                    .unwrap();
                            let w = Vec::<f32>::try_from(&w).unwrap();
                            PackedMatrix::encode(&w, rows, cols, format).unwrap()
                        })
                        .collect()
                })
                .collect();
            HeldExperts { matrices, relu }
        }
    }

    impl ExpertProvider for HeldExperts {
        fn expert(&mut self, id: ExpertId, _next: Option<ExpertId>) -> Result<ExpertWeights<'_>> {
            let m = &self.matrices[id.expert as usize];
            let w = |i: usize| Weight::Stored(m[i].view());
            Ok(if self.relu {
                ExpertWeights::Relu { wi: w(0), wo: w(1) }
            } else {
                ExpertWeights::SwiGlu {
                    gate: w(0),
                    up: w(1),
                    down: w(2),
                }
            })
        }
    }

    /// HF's loop, in libtorch's ops: for each expert in ascending order, its tokens gathered,
    /// its FFN, scaled by the routing weights and `index_add_`ed into zeros.
    fn index_add_reference(
        x: &Tensor,
        router: &Router,
        routing: Routing,
        dropped: &[bool],
        provider: &mut HeldExperts,
    ) -> Tensor {
        let d = x.size()[2];
        let tokens = x.reshape([-1, d]);
        let (chosen, weights) = route(&tokens, router, routing).unwrap();
        let chosen = Vec::<i64>::try_from(&chosen).unwrap();
        let k = routing.k();
        let mut out = tokens.zeros_like();
        for expert in 0..provider.matrices.len() as i64 {
            let slots: Vec<i64> = (0..chosen.len() as i64)
                .filter(|&s| chosen[s as usize] == expert && !dropped[s as usize / k])
                .collect();
            if slots.is_empty() {
                continue;
            }
            let token_ids: Vec<i64> = slots.iter().map(|&s| s / k as i64).collect();
            let idx = Tensor::from_slice(&token_ids);
            let id = ExpertId {
                stack: Stack::Decoder,
                layer: 0,
                expert: expert as u16,
            };
            let w = provider.expert(id, None).unwrap();
            let y = expert_forward(&tokens.index_select(0, &idx), &w).unwrap();
            let scale = weights.index_select(0, &Tensor::from_slice(&slots));
            let _ = out.index_add_(0, &idx, &(y * scale.unsqueeze(-1)));
        }
        out.reshape(x.size())
    }

    /// Many tokens on the CPU (the rows path, its loops over two compute threads) give the bits
    /// of HF's `index_add_` loop in libtorch: SwiGLU top-2/top-3 and ReLU top-1 with tokens over
    /// capacity, f32, f16, INT4 and INT8 experts, an odd `d_ff`, experts of more rows than one
    /// task.
    #[test]
    fn many_tokens_give_the_index_add_loops_values() {
        crate::quant::parallel::set_compute_threads(2);
        tch::manual_seed(11);
        let (experts, d) = (6, 64);
        let top = |k, normalize| Routing::TopK { k, normalize };
        let int = |bits| MatrixFormat::Quant(bits);
        // (ReLU, routing, format, d_ff): an odd d_ff leaves libtorch's SiLU a scalar tail.
        let cases = [
            (false, top(2, true), MatrixFormat::F32, 128),
            (false, top(2, true), MatrixFormat::F32, 99),
            (false, top(2, false), MatrixFormat::F16, 128),
            (false, top(3, true), int(QuantBits::Int4), 128),
            (true, Routing::Top1 { capacity: 10 }, MatrixFormat::F32, 128),
            (
                true,
                Routing::Top1 { capacity: 40 },
                int(QuantBits::Int8),
                128,
            ),
        ];
        for (relu, routing, format, d_ff) in cases {
            let mut provider = HeldExperts::random(experts, d, d_ff, relu, format);
            let router = Router {
                weight: Weight::Tensor(Tensor::randn(
                    [experts as i64, d as i64],
                    (Kind::Float, Device::Cpu),
                )),
                bias: None,
            };
            let x = Tensor::randn([2, 45, d as i64], (Kind::Float, Device::Cpu));
            let mut routes = Vec::new();
            let out = moe_ffn(
                &x,
                &router,
                routing,
                Stack::Decoder,
                0,
                &mut provider,
                &mut routes,
            )
            .unwrap();
            let route = &routes[0];
            let busiest = (0..experts as u16)
                .map(|e| {
                    let kept =
                        |t: &usize| !route.dropped[*t] && route.token_experts(*t).contains(&e);
                    (0..route.tokens()).filter(kept).count()
                })
                .max()
                .unwrap();
            assert!(
                busiest > ROWS_PER_TASK,
                "{routing:?}: {busiest} rows at most"
            );
            if let Routing::Top1 { capacity: 10 } = routing {
                assert!(route.dropped.iter().any(|&d| d), "no token over capacity");
            }
            let reference =
                index_add_reference(&x, &router, routing, &route.dropped, &mut provider);
            assert!(
                out.equal(&reference),
                "{routing:?} {format:?}: largest difference {}",
                (out - reference).abs().max().double_value(&[])
            );
        }
    }
}
