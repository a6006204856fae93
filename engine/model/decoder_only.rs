//! Decoder-only MoE language models — `MixtralForCausalLM`, `Qwen2MoeForCausalLM`,
//! `OlmoeForCausalLM` (transformers 5.x) — as one model over shared blocks: the tensor names
//! (resident ones declared once, in `DecoderOnlyModel::assemble`, which both loading and
//! `convert` use), and a forward call over new tokens with a KV cache (the whole prompt at once
//! in prefill, then one token per step).
//!
//! Decisions:
//! - Resident weights are stored in the bundle under transformers 5.x's in-memory names
//!   (`model.layers.{i}.mlp.gate.weight` for every family's router; Mixtral checkpoints say
//!   `block_sparse_moe.gate.weight`). Routed experts go to the expert store; Qwen2-MoE's shared
//!   expert and its gate stay resident (every token uses them).
//! - Batch of one sequence: generation here is greedy or sampled, never beam search, so the
//!   KV cache is `[1, kv_heads, len, head_dim]` per layer and grows by concatenation.
//! - A forward call returns the logits of its last token only (the next-token distribution);
//!   the prompt's other positions never need the `[n, V]` projection.
//! - The MoE FFN is the engine's one `moe_ffn` with top-k routing; prefill groups the prompt's
//!   tokens by expert, so each chosen expert of a layer is read once per prompt.
//!
//! Shapes: `n` = tokens in the call, `past` = tokens already cached, `d` = hidden size,
//! `H`/`KV` = query/key-value heads, `hd` = head dim, `V` = vocabulary, `E` = experts.

use tch::{Kind, Tensor};

use super::layers::{
    attention_by_heads, gated_mlp, linear, linear_bias, repeat_kv, Linear, RmsNorm, Rotary, Weight,
};
use super::moe::{moe_ffn, route_ahead, LayerRoute, Router, Routing};
use crate::config::{DecoderFamily, DecoderSpec};
use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::ids::Stack;
use crate::model::provider::ExpertProvider;
use crate::weights::{Stored, WeightFiles};

use super::kv::{KvCacheRows, KvFormat};
use super::RunShape;
use crate::quant::matrix::{gemm_packed_acts_bytes, gemm_scratch_values};
use crate::quant::parallel::compute_threads;

fn layer_prefix(layer: usize) -> String {
    format!("model.layers.{layer}")
}

/// Every non-expert tensor with its shape, under the names the bundle stores them by, in the
/// order [`DecoderOnlyModel::load`] takes them: `DecoderOnlyModel::assemble` run on
/// placeholders.
pub fn resident_tensors(spec: &DecoderSpec) -> Vec<(String, Vec<usize>)> {
    let mut tensors = Vec::new();
    DecoderOnlyModel::assemble(spec, &mut |name, shape| {
        tensors.push((name, shape.to_vec()));
        Ok(Weight::Tensor(Tensor::new()))
    })
    .expect("placeholders and the rotary table do not fail");
    tensors
}

/// Other names a checkpoint may give a resident tensor: Mixtral's pre-5.x router name, as
/// `save_pretrained` still writes it (`block_sparse_moe.gate.weight`).
pub fn checkpoint_aliases(spec: &DecoderSpec, name: &str) -> Vec<String> {
    match spec.family {
        DecoderFamily::Mixtral if name.ends_with(".mlp.gate.weight") => {
            vec![name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")]
        }
        _ => Vec::new(),
    }
}

/// Tensors a checkpoint may hold that the engine does not need: the LM head of tied
/// checkpoints (a copy of the embedding) and RoPE's recomputable inverse frequencies.
pub fn redundant_tensors(spec: &DecoderSpec) -> Vec<String> {
    let mut names: Vec<String> = (0..spec.num_layers)
        .map(|l| format!("{}.self_attn.rotary_emb.inv_freq", layer_prefix(l)))
        .collect();
    names.push("model.rotary_emb.inv_freq".into());
    if spec.tie_word_embeddings {
        names.push("lm_head.weight".into());
    }
    names
}

/// The engine's names of an expert's three matrices, in blob order.
pub const EXPERT_MATRICES: [&str; 3] = ["gate", "up", "down"];

/// Checkpoint name of one matrix (`gate`, `up` or `down`) of one expert in the per-expert
/// layout that `save_pretrained` writes (transformers 5.x included).
pub fn expert_tensor_name(family: DecoderFamily, id: ExpertId, matrix: &str) -> String {
    let p = layer_prefix(id.layer as usize);
    let e = id.expert;
    match family {
        DecoderFamily::Mixtral => {
            let w = match matrix {
                "gate" => "w1",
                "down" => "w2",
                _ => "w3",
            };
            format!("{p}.block_sparse_moe.experts.{e}.{w}.weight")
        }
        DecoderFamily::Qwen2Moe | DecoderFamily::Olmoe => {
            format!("{p}.mlp.experts.{e}.{matrix}_proj.weight")
        }
    }
}

/// Checkpoint names of a layer's fused experts (transformers 5.x in memory, and
/// `save_pretrained(save_original_format=False)`): `gate_up_proj` `[E, 2·d_ff, d]` (each
/// expert's gate rows, then its up rows) and `down_proj` `[E, d, d_ff]`.
pub fn fused_expert_names(layer: usize) -> (String, String) {
    let p = layer_prefix(layer);
    (
        format!("{p}.mlp.experts.gate_up_proj"),
        format!("{p}.mlp.experts.down_proj"),
    )
}

/// `*Attention` with RoPE, grouped-query heads and the families' options.
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    o_bias: Option<Tensor>,
    /// OLMoE: RMSNorm of the whole q and k projections.
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    window: Option<usize>,
}

/// Qwen2-MoE's shared expert and its gate `[1, d]`.
struct SharedExpert {
    gate: Linear,
    up: Linear,
    down: Linear,
    expert_gate: Linear,
}

enum FeedForward {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    Sparse {
        router: Router,
        shared: Option<SharedExpert>,
    },
}

struct Layer {
    input_norm: RmsNorm,
    attention: Attention,
    post_attention_norm: RmsNorm,
    ff: FeedForward,
}

/// The resident part of a decoder-only MoE model; experts come from an [`ExpertProvider`].
pub struct DecoderOnlyModel {
    spec: DecoderSpec,
    /// `[V, d]` token embeddings (and the LM head when tied).
    embed_tokens: Linear,
    /// `[V, d]` when embeddings are not tied.
    lm_head: Option<Linear>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rotary: Rotary,
    resident_bytes: u64,
}

/// The KV cache of one running sequence.
pub struct KvCache {
    layers: Vec<LayerKv>,
    /// Tokens cached (the position of the next one).
    len: i64,
}

/// One layer's cached keys (after RoPE) and values, token-major `[len, KV × hd]`, in the run's
/// [`KvFormat`]: a decode step appends its token's in place instead of copying the whole cache
/// into a new tensor.
struct LayerKv {
    rows: KvCacheRows,
    /// `KV × hd`: one token's values.
    width: usize,
}

impl LayerKv {
    /// The cache as the tensors `[1, KV, len, hd]` the prompt path attends over (a copy, the
    /// values as held: rounded where the format rounds).
    fn tensors(&self, kv_heads: i64, hd: i64) -> Result<(Tensor, Tensor)> {
        let heads = |values: &[f32]| -> Result<Tensor> {
            Ok(Tensor::f_from_slice(values)?
                .f_view([1, -1, kv_heads, hd])?
                .f_transpose(1, 2)?)
        };
        let (keys, values) = self.rows.to_f32(self.width);
        Ok((heads(&keys)?, heads(&values)?))
    }

    /// Appends `keys` and `values` `[1, KV, n, hd]`.
    fn append(&mut self, keys: &Tensor, values: &Tensor) -> Result<()> {
        let token_major = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(Vec::<f32>::try_from(
                &t.f_transpose(1, 2)?.f_contiguous()?.f_reshape([-1])?,
            )?)
        };
        self.rows
            .extend(&token_major(keys)?, &token_major(values)?, self.width);
        Ok(())
    }
}

impl KvCache {
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl DecoderOnlyModel {
    /// Loads the resident weights (owned copies, f32 or in their stored matrix form) from `files` (a bundle's resident file). A
    /// tensor of `files` that the model does not use is an error naming it.
    pub fn load(spec: &DecoderSpec, files: &WeightFiles) -> Result<Self> {
        let _guard = tch::no_grad_guard();
        let mut resident_bytes = 0u64;
        let mut model = files.load_all(|loader| {
            Self::assemble(spec, &mut |name, shape| {
                let w = match loader.take_stored(&name, shape)? {
                    Stored::F32(t) => Weight::Tensor(t),
                    Stored::Matrix(m) => Weight::Packed(m),
                };
                resident_bytes += w.stored_bytes();
                Ok(w)
            })
        })?;
        model.resident_bytes = resident_bytes;
        Ok(model)
    }

    /// The model from `get(name, shape)` of each resident tensor: the one place the resident
    /// tensor names of the three families are spelled.
    fn assemble(
        spec: &DecoderSpec,
        get: &mut dyn FnMut(String, &[usize]) -> Result<Linear>,
    ) -> Result<Self> {
        let d = spec.hidden_size;
        let (q, kv) = (spec.q_dim(), spec.kv_dim());
        let norm = |weight: Linear| -> Result<RmsNorm> {
            Ok(RmsNorm::new(weight.to_tensor()?, spec.rms_norm_eps))
        };
        let embed_tokens = get("model.embed_tokens.weight".into(), &[spec.vocab_size, d])?;
        let lm_head = if spec.tie_word_embeddings {
            None
        } else {
            Some(get("lm_head.weight".into(), &[spec.vocab_size, d])?)
        };
        let mut layers = Vec::with_capacity(spec.num_layers);
        for layer in 0..spec.num_layers {
            let p = layer_prefix(layer);
            let a = format!("{p}.self_attn");
            let bias = |get: &mut dyn FnMut(String, &[usize]) -> Result<Linear>,
                        proj: &str,
                        rows: usize,
                        on: bool|
             -> Result<Option<Tensor>> {
                Ok(if on {
                    Some(get(format!("{a}.{proj}.bias"), &[rows])?.to_tensor()?)
                } else {
                    None
                })
            };
            let attention = Attention {
                q: get(format!("{a}.q_proj.weight"), &[q, d])?,
                k: get(format!("{a}.k_proj.weight"), &[kv, d])?,
                v: get(format!("{a}.v_proj.weight"), &[kv, d])?,
                o: get(format!("{a}.o_proj.weight"), &[d, q])?,
                q_bias: bias(get, "q_proj", q, spec.qkv_bias)?,
                k_bias: bias(get, "k_proj", kv, spec.qkv_bias)?,
                v_bias: bias(get, "v_proj", kv, spec.qkv_bias)?,
                o_bias: bias(get, "o_proj", d, spec.o_bias)?,
                q_norm: if spec.qk_norm {
                    Some(norm(get(format!("{a}.q_norm.weight"), &[q])?)?)
                } else {
                    None
                },
                k_norm: if spec.qk_norm {
                    Some(norm(get(format!("{a}.k_norm.weight"), &[kv])?)?)
                } else {
                    None
                },
                window: spec.attention_windows.get(layer).copied().flatten(),
            };
            let m = format!("{p}.mlp");
            let ff = if spec.is_moe(layer) {
                let shared = match spec.shared_expert_intermediate_size {
                    Some(s) => Some(SharedExpert {
                        gate: get(format!("{m}.shared_expert.gate_proj.weight"), &[s, d])?,
                        up: get(format!("{m}.shared_expert.up_proj.weight"), &[s, d])?,
                        down: get(format!("{m}.shared_expert.down_proj.weight"), &[d, s])?,
                        expert_gate: get(format!("{m}.shared_expert_gate.weight"), &[1, d])?,
                    }),
                    None => None,
                };
                FeedForward::Sparse {
                    router: Router {
                        weight: get(format!("{m}.gate.weight"), &[spec.num_experts, d])?,
                        bias: None,
                    },
                    shared,
                }
            } else {
                let f = spec.intermediate_size;
                FeedForward::Dense {
                    gate: get(format!("{m}.gate_proj.weight"), &[f, d])?,
                    up: get(format!("{m}.up_proj.weight"), &[f, d])?,
                    down: get(format!("{m}.down_proj.weight"), &[d, f])?,
                }
            };
            layers.push(Layer {
                input_norm: norm(get(format!("{p}.input_layernorm.weight"), &[d])?)?,
                attention,
                post_attention_norm: norm(get(
                    format!("{p}.post_attention_layernorm.weight"),
                    &[d],
                )?)?,
                ff,
            });
        }
        let final_norm = norm(get("model.norm.weight".into(), &[d])?)?;
        Ok(DecoderOnlyModel {
            spec: spec.clone(),
            embed_tokens,
            lm_head,
            layers,
            norm: final_norm,
            rotary: Rotary::new(spec.head_dim, spec.rope_theta)?,
            resident_bytes: 0,
        })
    }

    pub fn spec(&self) -> &DecoderSpec {
        &self.spec
    }

    /// Bytes of the resident (non-expert) weights as held in memory.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// An empty cache for one sequence, holding keys and values as `format`.
    pub fn new_cache(&self, format: KvFormat) -> KvCache {
        let width = self.spec.kv_dim();
        KvCache {
            layers: (0..self.layers.len())
                .map(|_| LayerKv {
                    rows: KvCacheRows::empty(format, width),
                    width,
                })
                .collect(),
            len: 0,
        }
    }

    /// Feeds `ids` (the prompt, or the one token sampled last) after what `cache` holds and
    /// returns the next-token logits `[V]` (f32).
    pub fn forward(
        &self,
        ids: &[i64],
        cache: &mut KvCache,
        provider: &mut dyn ExpertProvider,
        routes: &mut Vec<LayerRoute>,
    ) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        if ids.is_empty() {
            return Err(Error::Input("no tokens to feed the model".into()));
        }
        let vocab = self.spec.vocab_size as i64;
        if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the model's vocabulary of {vocab}"
            )));
        }
        provider.begin_step(Stack::Decoder);
        let n = ids.len() as i64;
        let past = cache.len;
        let input = Tensor::f_from_slice(ids)?.f_view([1, n])?;
        let mut h = self.embed_tokens.embed(&input)?; // [1, n, d]
        let (cos, sin) = self.rotary.cos_sin(past, n)?; // [1, 1, n, hd]

        // One new token: its rotation as plain values for the attention of `attend_one`.
        let rope_one = if n == 1 {
            let values = |t: &Tensor| Vec::<f32>::try_from(&t.f_reshape([-1])?);
            Some((values(&cos)?, values(&sin)?))
        } else {
            None
        };
        let routing = Routing::TopK {
            k: self.spec.top_k,
            normalize: self.spec.norm_topk_prob,
        };
        for (index, layer) in self.layers.iter().enumerate() {
            // hidden_states = residual + self_attn(input_layernorm(hidden_states))
            let normed = layer.input_norm.forward(&h)?;
            let kv = &mut cache.layers[index];
            let attended = match &rope_one {
                Some((cos, sin)) => self.attend_one(layer, &normed, cos, sin, past, kv)?,
                None => self.attend(layer, &normed, &cos, &sin, past, kv)?,
            };
            h = h.f_add(&attended)?;
            if matches!(layer.ff, FeedForward::Sparse { .. }) && provider.wants_lookahead() {
                self.look_ahead(index, &h, routing, provider)?;
            }
            // hidden_states = residual + mlp(post_attention_layernorm(hidden_states))
            let normed = layer.post_attention_norm.forward(&h)?;
            let ff = match &layer.ff {
                FeedForward::Dense { gate, up, down } => gated_mlp(&normed, gate, up, down)?,
                FeedForward::Sparse { router, shared } => {
                    let routed = moe_ffn(
                        &normed,
                        router,
                        routing,
                        Stack::Decoder,
                        index,
                        provider,
                        routes,
                    )?;
                    match shared {
                        // expert_output + sigmoid(shared_expert_gate(x)) * shared_expert(x)
                        Some(s) => {
                            let gate = linear(&normed, &s.expert_gate)?.f_sigmoid()?; // [1, n, 1]
                            let out = gated_mlp(&normed, &s.gate, &s.up, &s.down)?;
                            routed.f_add(&gate.f_mul(&out)?)?
                        }
                        None => routed,
                    }
                }
            };
            h = h.f_add(&ff)?;
        }
        cache.len += n;
        let last = self.norm.forward(&h.f_select(1, n - 1)?)?; // [1, d]
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        Ok(linear(&last, head)?.f_reshape([vocab])?)
    }

    /// The gate lookahead from MoE layer `index`: the next MoE layer routes `h` (the hidden
    /// state entering layer `index`'s FFN, normed with the next layer's post-attention norm).
    fn look_ahead(
        &self,
        index: usize,
        h: &Tensor,
        routing: Routing,
        provider: &mut dyn ExpertProvider,
    ) -> Result<()> {
        let next =
            self.layers
                .iter()
                .enumerate()
                .skip(index + 1)
                .find_map(|(j, layer)| match &layer.ff {
                    FeedForward::Sparse { router, .. } => Some((j, layer, router)),
                    FeedForward::Dense { .. } => None,
                });
        let Some((j, layer, router)) = next else {
            return Ok(());
        };
        let experts = route_ahead(&layer.post_attention_norm.forward(h)?, router, routing)?;
        provider.predicted(Stack::Decoder, j, routing.k(), &experts)
    }

    /// The query, key and value projections of `x` `[1, n, d]` (`[1, n, H·hd]`, `[1, n, KV·hd]`
    /// twice), normed and clipped where the family does, before RoPE.
    fn project_qkv(&self, a: &Attention, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let mut q = linear_bias(x, &a.q, a.q_bias.as_ref())?; // [1, n, H·hd]
        let mut k = linear_bias(x, &a.k, a.k_bias.as_ref())?; // [1, n, KV·hd]
        let mut v = linear_bias(x, &a.v, a.v_bias.as_ref())?;
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            // query_states = self.q_norm(self.q_proj(hidden_states)) (before splitting heads)
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        if let Some(c) = self.spec.clip_qkv {
            q = q.f_clamp(-c, c)?;
            k = k.f_clamp(-c, c)?;
            v = v.f_clamp(-c, c)?;
        }
        Ok((q, k, v))
    }

    /// Self-attention of one new token `x` `[1, 1, d]` at position `past`, appending to `kv`:
    /// the math of [`Self::attend`] in plain loops over the cache (RoPE in libtorch's order of
    /// roundings; the dot products and the softmax sum in their own order), without the two
    /// dozen tensor ops per layer that cost more than the arithmetic of a short context.
    fn attend_one(
        &self,
        layer: &Layer,
        x: &Tensor,
        cos: &[f32],
        sin: &[f32],
        past: i64,
        kv: &mut LayerKv,
    ) -> Result<Tensor> {
        let a = &layer.attention;
        let (heads, kv_heads, hd) = (
            self.spec.num_heads,
            self.spec.num_kv_heads,
            self.spec.head_dim,
        );
        let (q, k, v) = self.project_qkv(a, x)?;
        let values = |t: &Tensor| Vec::<f32>::try_from(&t.f_reshape([-1])?);
        let (mut q, mut k, v) = (values(&q)?, values(&k)?, values(&v)?);
        // apply_rotary_pos_emb: x·cos + rotate_half(x)·sin, rotate_half(x) = cat(−x2, x1)
        // Pairwise in place: (x1, x2) → (x1·cos − x2·sin, x2·cos + x1·sin), each product rounded
        // on its own as libtorch's mul, mul, add do.
        let half = hd / 2;
        for head in q.chunks_exact_mut(hd).chain(k.chunks_exact_mut(hd)) {
            let (first, second) = head.split_at_mut(half);
            for (i, (x1, x2)) in first.iter_mut().zip(second).enumerate() {
                let (a, b) = (*x1, *x2);
                *x1 = a * cos[i] + -b * sin[i];
                *x2 = b * cos[i + half] + a * sin[i + half];
            }
        }
        kv.rows.extend(&k, &v, kv.width);
        let total = past as usize + 1;
        // Keys a sliding window hides: query − key ≥ window.
        let first = a.window.map_or(0, |w| total.saturating_sub(w));
        let scaling = (hd as f64).powf(-0.5) as f32;
        let out = kv
            .rows
            .attend_each(kv_heads, hd, &q, 1, first, scaling, None);
        let out = Tensor::f_from_slice(&out)?.f_view([1, 1, (heads * hd) as i64])?;
        linear_bias(&out, &a.o, a.o_bias.as_ref())
    }

    /// Self-attention of `x` `[1, n, d]` at positions `past ..`, appending to `kv`.
    fn attend(
        &self,
        layer: &Layer,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        past: i64,
        kv: &mut LayerKv,
    ) -> Result<Tensor> {
        let a = &layer.attention;
        let spec = &self.spec;
        let n = x.size()[1];
        let (heads, kv_heads, hd) = (
            spec.num_heads as i64,
            spec.num_kv_heads as i64,
            spec.head_dim as i64,
        );
        let (q, k, v) = self.project_qkv(a, x)?;
        let heads_of = |t: Tensor, h: i64| t.f_view([1, n, h, hd])?.f_transpose(1, 2);
        let q = Rotary::apply(&heads_of(q, heads)?, cos, sin)?; // [1, H, n, hd]
        let k = Rotary::apply(&heads_of(k, kv_heads)?, cos, sin)?; // [1, KV, n, hd]
        let v = heads_of(v, kv_heads)?;
        let (keys, values) = if kv.rows.format() != KvFormat::F32 {
            // A narrower cache: the chunk attends over its own keys as held too, as a decode
            // step does.
            kv.append(&k, &v)?;
            kv.tensors(kv_heads, hd)?
        } else {
            let (keys, values) = if past > 0 {
                let (pk, pv) = kv.tensors(kv_heads, hd)?;
                (Tensor::f_cat(&[&pk, &k], 2)?, Tensor::f_cat(&[&pv, &v], 2)?)
            } else {
                (k.shallow_clone(), v.shallow_clone())
            };
            kv.append(&k, &v)?;
            (keys, values)
        }; // [1, KV, past + n, hd]
        let rep = heads / kv_heads;
        let keys_h = repeat_kv(&keys, rep)?; // [1, H, total, hd]
        let values_h = repeat_kv(&values, rep)?;
        // attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling, + mask
        let mask = attention_mask(n, past, a.window)?; // [1, 1, n, total]
        let scaling = (hd as f64).powf(-0.5);
        let out = attention_by_heads(&q, &keys_h, &values_h, Some(scaling), mask.as_ref())?;
        linear_bias(&out, &a.o, a.o_bias.as_ref())
    }
}

/// Additive mask `[1, 1, n, past + n]` (0 = seen, -inf = hidden) for queries at positions
/// `past ..` over keys `0 .. past + n`: causal, and within `window` when given (a key is seen
/// while `query − key < window`). `None` when nothing is hidden (one new token, no window).
fn attention_mask(n: i64, past: i64, window: Option<usize>) -> Result<Option<Tensor>> {
    let total = past + n;
    let hides_old = window.is_some_and(|w| total > w as i64);
    if n == 1 && !hides_old {
        return Ok(None);
    }
    let opts = (Kind::Int64, tch::Device::Cpu);
    let query = Tensor::f_arange_start(past, total, opts)?.f_unsqueeze(1)?; // [n, 1]
    let key = Tensor::f_arange(total, opts)?.f_unsqueeze(0)?; // [1, total]
    let distance = query.f_sub(&key)?; // [n, total]
    let mut hidden = distance.f_lt(0)?;
    if let Some(w) = window {
        hidden = hidden.f_logical_or(&distance.f_ge(w as i64)?)?;
    }
    let mask = Tensor::f_zeros([n, total], (Kind::Float, tch::Device::Cpu))?
        .f_masked_fill(&hidden, f64::NEG_INFINITY)?;
    Ok(Some(mask.f_unsqueeze(0)?.f_unsqueeze(0)?))
}

impl DecoderOnlyModel {
    /// A decoder-only run: `max_source_tokens` is the prompt length (prefilled at once).
    pub fn working_bytes(&self, run: RunShape) -> u64 {
        // Saturating: a huge `--max-new-tokens` gives a huge estimate (and a clean budget
        // error), never a wrapped small one.
        use std::num::Saturating as S;
        let n = |v: usize| S(v as u64);
        let spec = &self.spec;
        let f = S(4u64);
        let prompt = n(run.max_source_tokens);
        let total = prompt + n(run.max_new_tokens);
        let d = n(spec.hidden_size);
        let (q, kv) = (n(spec.q_dim()), n(spec.kv_dim()));
        let heads = n(spec.num_heads);
        let widest_ff = spec
            .intermediate_size
            .max(spec.expert_intermediate_size)
            .max(spec.shared_expert_intermediate_size.unwrap_or(0));
        // Prefill: hidden states and residuals, q/k/v/out (k and v repeated to every head), scores
        // (+ softmax copy), the mask, the FF intermediates (gate, up, product) and the MoE output.
        let prefill = prompt * (S(5) * d + S(2) * q + S(2) * kv + S(2) * heads * n(spec.head_dim))
            + S(3) * heads * prompt * total
            + prompt * total
            + S(3) * prompt * n(widest_ff)
            + prompt * (n(spec.top_k) + S(1)) * d;
        // The KV cache of every layer up to the last token, keys and values, in the run's
        // format, and the f32 copy a prompt chunk attends over.
        let layers = n(spec.num_layers);
        let caches: S<u64> =
            S(2) * layers * S(run.kv_cache.bytes(total.0, kv.0)) + S(8u64) * layers * kv * total;
        // Logits, their softmax and sort for sampling.
        let logits = S(4) * n(spec.vocab_size);
        // The GEMM paths' tiles of dequantized weight rows per compute thread and their
        // activations (experts are never expanded whole).
        let expert_scratch = n(gemm_scratch_values(
            spec.hidden_size.max(widest_ff),
            compute_threads(),
        ));
        // The prompt's activations packed for MKL's GEMM (x86_64 builds).
        let packed = S(gemm_packed_acts_bytes(
            run.max_source_tokens,
            spec.hidden_size.max(widest_ff),
        ));
        (f * (prefill + logits + expert_scratch) + packed + caches).0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_are_causal_and_windowed() {
        assert!(attention_mask(1, 5, None).unwrap().is_none());
        assert!(attention_mask(1, 2, Some(4)).unwrap().is_none());
        let m = attention_mask(3, 1, Some(2)).unwrap().unwrap();
        let v = Vec::<f32>::try_from(m.flatten(0, -1)).unwrap();
        let inf = f32::NEG_INFINITY;
        // queries at 1, 2, 3 over keys 0..4; window 2: query − key ∈ {0, 1}
        assert_eq!(
            v,
            vec![0., 0., inf, inf, inf, 0., 0., inf, inf, inf, 0., 0.]
        );
    }

    #[test]
    fn expert_names_follow_each_family() {
        let id = ExpertId {
            stack: Stack::Decoder,
            layer: 3,
            expert: 5,
        };
        assert_eq!(
            expert_tensor_name(DecoderFamily::Mixtral, id, "up"),
            "model.layers.3.block_sparse_moe.experts.5.w3.weight"
        );
        assert_eq!(
            expert_tensor_name(DecoderFamily::Olmoe, id, "down"),
            "model.layers.3.mlp.experts.5.down_proj.weight"
        );
    }
}
