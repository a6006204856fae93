//! Switch Transformers (`SwitchTransformersForConditionalGeneration`): its tensor names
//! (declared once, in `SwitchModel::assemble`, which both loading and `convert` use), the
//! encoder and one incremental decoder step.
//!
//! Shapes: `b` = batch (beams), `n` = tokens in the call, `src` = source tokens, `d` = d_model,
//! `h` = heads, `dk` = d_kv, `V` = vocabulary.

use tch::{Device, Tensor};

use super::layers::{dense_act_dense, linear, Attention, Linear, RmsNorm, Weight};
use super::moe::{moe_ffn, route_ahead, LayerRoute, Router, Routing};
use crate::config::SwitchSpec;
use crate::error::{Error, Result};
use crate::ids::ExpertId;
use crate::ids::Stack;
use crate::model::provider::ExpertProvider;
use crate::weights::{Stored, WeightFiles};

use super::kv::{KvFormat, SourceKv};
use super::RunShape;
use crate::quant::matrix::{gemm_packed_acts_bytes, gemm_scratch_values};
use crate::quant::parallel::compute_threads;

/// HF name of a block's FF sub-layer prefix, e.g. `decoder.block.3.layer.2`.
fn ff_prefix(stack: Stack, block: usize) -> String {
    format!(
        "{}.block.{block}.layer.{}",
        stack.hf_prefix(),
        stack.ff_sublayer()
    )
}

/// HF name of one matrix (`wi` or `wo`) of one expert.
pub fn expert_tensor_name(id: ExpertId, matrix: &str) -> String {
    format!(
        "{}.mlp.experts.expert_{}.{matrix}.weight",
        ff_prefix(id.stack, id.layer as usize),
        id.expert
    )
}

/// Tensors a checkpoint may hold that the engine does not need: copies of `shared.weight`.
pub fn redundant_tensors(spec: &SwitchSpec) -> Vec<String> {
    let mut names = Vec::new();
    for stack in [Stack::Encoder, Stack::Decoder] {
        if !spec.separate_embeddings(stack) {
            names.push(embed_tokens_name(stack));
        }
    }
    if spec.tie_word_embeddings {
        names.push("lm_head.weight".into());
    }
    names
}

fn embed_tokens_name(stack: Stack) -> String {
    format!("{}.embed_tokens.weight", stack.hf_prefix())
}

/// Every non-expert tensor with its shape (the resident part of the model), in the order
/// [`SwitchModel::load`] takes them: `SwitchModel::assemble` run on placeholders.
pub fn resident_tensors(spec: &SwitchSpec) -> Vec<(String, Vec<usize>)> {
    let mut tensors = Vec::new();
    SwitchModel::assemble(spec, &mut |name, shape| {
        tensors.push((name.to_string(), shape.to_vec()));
        Ok(Weight::Tensor(Tensor::new()))
    })
    .expect("assembling placeholders cannot fail");
    tensors
}

enum FeedForward {
    Dense { wi: Linear, wo: Linear },
    Sparse(Router),
}

struct Block {
    self_attention: Attention,
    self_attention_norm: RmsNorm,
    /// Decoder blocks only.
    cross_attention: Option<(Attention, RmsNorm)>,
    ff_norm: RmsNorm,
    ff: FeedForward,
}

struct StackWeights {
    stack: Stack,
    /// `[V, d]` own token embeddings, when the checkpoint does not share `shared.weight`.
    embed_tokens: Option<Linear>,
    blocks: Vec<Block>,
    final_norm: RmsNorm,
}

/// The resident part of a Switch Transformers model; experts come from an [`ExpertProvider`].
pub struct SwitchModel {
    spec: SwitchSpec,
    /// `[V, d]` token embeddings (and the LM head when embeddings are tied).
    shared: Linear,
    /// `[V, d]` when embeddings are not tied.
    lm_head: Option<Linear>,
    encoder: StackWeights,
    decoder: StackWeights,
    resident_bytes: u64,
}

/// The decoder's caches for a batch of `b` running sequences.
pub struct DecoderState {
    /// Per block: self-attention keys and values `[b, h, len, dk]`.
    self_kv: Vec<Option<(Tensor, Tensor)>>,
    /// Per block: cross-attention keys and values over the encoder output `[b, h, src, dk]`.
    cross_kv: Vec<(Tensor, Tensor)>,
    /// On the CPU: both attention caches as plain values instead, for
    /// [`SwitchModel::decode_step`]'s loops (`self_kv` and `cross_kv` stay empty).
    loops: Option<LoopCaches>,
    /// Tokens already decoded (the position of the next one).
    len: i64,
}

/// The running sequences' attention keys and values, token-major (`[len, h × dk]`), per block,
/// for [`super::layers::CachedKv::attend`]'s loops.
struct LoopCaches {
    /// Self-attention, per sequence (beam), per block: a decode step appends its token's.
    self_kv: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    /// Cross-attention over the encoder output, `[src, h × dk]` each, made once and read by
    /// every sequence: beams decode the same document. (HF repeats the encoder output per beam
    /// and reorders that copy with the beams; every copy holds the same values.) Held in the
    /// run's [`KvFormat`].
    cross_kv: Vec<SourceKv>,
}

impl SwitchModel {
    /// Loads the resident weights (owned copies, f32 or in their stored matrix form) from `files`
    /// (a bundle's resident file), on the CPU.
    pub fn load(spec: &SwitchSpec, files: &WeightFiles) -> Result<Self> {
        Self::load_on(spec, files, Device::Cpu)
    }

    /// Loads the resident weights onto `device` (`Device::Cuda(0)` on a Jetson: the dense math
    /// runs there; experts are decoded on the host and moved when used). A tensor of `files`
    /// that the model does not use is an error naming it.
    pub fn load_on(spec: &SwitchSpec, files: &WeightFiles, device: Device) -> Result<Self> {
        let _guard = tch::no_grad_guard();
        let mut resident_bytes = 0u64;
        let mut model = files.load_all(|loader| {
            Self::assemble(spec, &mut |name, shape| {
                let w = match loader.take_stored(name, shape)? {
                    Stored::F32(t) => Weight::Tensor(t),
                    Stored::Matrix(m) => Weight::Packed(m),
                }
                .to_device(device)?;
                resident_bytes += w.stored_bytes();
                Ok(w)
            })
        })?;
        model.resident_bytes = resident_bytes;
        Ok(model)
    }

    /// The model from `get(name, shape)` of each resident tensor: the one place the tensor names
    /// of Switch Transformers are spelled (besides experts and redundant copies, above).
    fn assemble(
        spec: &SwitchSpec,
        get: &mut dyn FnMut(&str, &[usize]) -> Result<Linear>,
    ) -> Result<Self> {
        let (d, inner, d_ff) = (spec.d_model, spec.inner_dim(), spec.d_ff);
        let shared = get("shared.weight", &[spec.vocab_size, d])?;
        let lm_head = if spec.tie_word_embeddings {
            None
        } else {
            Some(get("lm_head.weight", &[spec.vocab_size, d])?)
        };
        let norm = |w: Linear| -> Result<RmsNorm> {
            Ok(RmsNorm::new(w.to_tensor()?, spec.layer_norm_epsilon))
        };
        let mut stacks = Vec::new();
        for stack in [Stack::Encoder, Stack::Decoder] {
            let p = stack.hf_prefix();
            let embed_tokens = if spec.separate_embeddings(stack) {
                Some(get(&embed_tokens_name(stack), &[spec.vocab_size, d])?)
            } else {
                None
            };
            let mut blocks = Vec::new();
            for block in 0..spec.num_layers(stack) {
                let mut attention =
                    |sub: usize, module: &str, with_bias: bool| -> Result<(Attention, RmsNorm)> {
                        let a = format!("{p}.block.{block}.layer.{sub}");
                        let attention = Attention {
                            q: get(&format!("{a}.{module}.q.weight"), &[inner, d])?,
                            k: get(&format!("{a}.{module}.k.weight"), &[inner, d])?,
                            v: get(&format!("{a}.{module}.v.weight"), &[inner, d])?,
                            o: get(&format!("{a}.{module}.o.weight"), &[d, inner])?,
                            relative_attention_bias: if with_bias {
                                Some(
                                    get(
                                        &format!("{a}.{module}.relative_attention_bias.weight"),
                                        &[spec.relative_attention_num_buckets, spec.num_heads],
                                    )?
                                    .to_tensor()?,
                                )
                            } else {
                                None
                            },
                            num_heads: spec.num_heads as i64,
                            d_kv: spec.d_kv as i64,
                        };
                        Ok((
                            attention,
                            norm(get(&format!("{a}.layer_norm.weight"), &[d])?)?,
                        ))
                    };
                let (self_attention, self_attention_norm) =
                    attention(0, "SelfAttention", block == 0)?;
                let cross_attention = match stack {
                    Stack::Decoder => Some(attention(1, "EncDecAttention", false)?),
                    Stack::Encoder => None,
                };
                let ff = ff_prefix(stack, block);
                let ff_norm = norm(get(&format!("{ff}.layer_norm.weight"), &[d])?)?;
                let ff = if spec.is_sparse(stack, block) {
                    FeedForward::Sparse(Router {
                        weight: get(
                            &format!("{ff}.mlp.router.classifier.weight"),
                            &[spec.num_experts, d],
                        )?,
                        bias: if spec.router_bias {
                            Some(
                                get(
                                    &format!("{ff}.mlp.router.classifier.bias"),
                                    &[spec.num_experts],
                                )?
                                .to_tensor()?,
                            )
                        } else {
                            None
                        },
                    })
                } else {
                    FeedForward::Dense {
                        wi: get(&format!("{ff}.mlp.wi.weight"), &[d_ff, d])?,
                        wo: get(&format!("{ff}.mlp.wo.weight"), &[d, d_ff])?,
                    }
                };
                blocks.push(Block {
                    self_attention,
                    self_attention_norm,
                    cross_attention,
                    ff_norm,
                    ff,
                });
            }
            let final_norm = norm(get(&format!("{p}.final_layer_norm.weight"), &[d])?)?;
            stacks.push(StackWeights {
                stack,
                embed_tokens,
                blocks,
                final_norm,
            });
        }
        let decoder = stacks.pop().expect("two stacks");
        let encoder = stacks.pop().expect("two stacks");
        Ok(SwitchModel {
            spec: spec.clone(),
            shared,
            lm_head,
            encoder,
            decoder,
            resident_bytes: 0,
        })
    }

    pub fn spec(&self) -> &SwitchSpec {
        &self.spec
    }

    /// Where the resident weights and the dense math are.
    pub fn device(&self) -> Device {
        match &self.shared {
            Weight::Tensor(t) => t.device(),
            _ => Device::Cpu,
        }
    }

    /// Bytes of the resident (non-expert) weights as held in memory.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    fn embed(&self, stack: &StackWeights, ids: &[i64], shape: [i64; 2]) -> Result<Tensor> {
        let vocab = self.spec.vocab_size as i64;
        if let Some(bad) = ids.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the model's vocabulary of {vocab}"
            )));
        }
        let ids = Tensor::f_from_slice(ids)?
            .f_view(shape)?
            .f_to_device(self.device())?;
        let table = stack.embed_tokens.as_ref().unwrap_or(&self.shared);
        table.embed(&ids)
    }

    /// The FF sub-layer of a block: `h + ff(norm(h))`.
    fn feed_forward(
        &self,
        stack: &StackWeights,
        index: usize,
        h: &Tensor,
        provider: &mut dyn ExpertProvider,
        routes: &mut Vec<LayerRoute>,
    ) -> Result<Tensor> {
        let block = &stack.blocks[index];
        if matches!(block.ff, FeedForward::Sparse(_)) && provider.wants_lookahead() {
            self.look_ahead(stack, index, h, provider)?;
        }
        let normed = block.ff_norm.forward(h)?;
        let out = match &block.ff {
            FeedForward::Dense { wi, wo } => dense_act_dense(&normed, wi, wo)?,
            FeedForward::Sparse(router) => moe_ffn(
                &normed,
                router,
                Routing::Top1 {
                    capacity: self.spec.expert_capacity,
                },
                stack.stack,
                index,
                provider,
                routes,
            )?,
        };
        Ok(h.f_add(&out)?)
    }

    /// The gate lookahead from MoE block `index`: the next MoE block of the stack routes `h`
    /// (the hidden state entering block `index`'s FFN, normed with the next block's FF norm).
    fn look_ahead(
        &self,
        stack: &StackWeights,
        index: usize,
        h: &Tensor,
        provider: &mut dyn ExpertProvider,
    ) -> Result<()> {
        let next = stack
            .blocks
            .iter()
            .enumerate()
            .skip(index + 1)
            .find_map(|(j, b)| match &b.ff {
                FeedForward::Sparse(router) => Some((j, b, router)),
                FeedForward::Dense { .. } => None,
            });
        let Some((j, block, router)) = next else {
            return Ok(());
        };
        let routing = Routing::Top1 {
            capacity: self.spec.expert_capacity,
        };
        let experts = route_ahead(&block.ff_norm.forward(h)?, router, routing)?;
        provider.predicted(stack.stack, j, 1, &experts)
    }

    /// Runs the encoder over one source sequence: `[n]` ids → `[1, n, d]` hidden states.
    pub fn encode(
        &self,
        input_ids: &[i64],
        provider: &mut dyn ExpertProvider,
        routes: &mut Vec<LayerRoute>,
    ) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        if input_ids.is_empty() {
            return Err(Error::Input("empty input: no tokens to encode".into()));
        }
        provider.begin_step(Stack::Encoder);
        let n = input_ids.len() as i64;
        let mut h = self.embed(&self.encoder, input_ids, [1, n])?; // [1, n, d]
        let bias = self.encoder.blocks[0].self_attention.position_bias(
            n,
            n,
            0,
            true,
            self.spec.relative_attention_num_buckets as i64,
            self.spec.relative_attention_max_distance as i64,
        )?; // [1, h, n, n]
        for (index, block) in self.encoder.blocks.iter().enumerate() {
            let attn = &block.self_attention;
            let normed = block.self_attention_norm.forward(&h)?;
            let keys = attn.project(&normed, &attn.k)?;
            let values = attn.project(&normed, &attn.v)?;
            h = h.f_add(&attn.attend(&normed, &keys, &values, Some(&bias))?)?;
            h = self.feed_forward(&self.encoder, index, &h, provider, routes)?;
        }
        self.encoder.final_norm.forward(&h)
    }

    /// Prepares the decoder for `beams` sequences over `encoder_out` `[1, src, d]`, its
    /// cross-attention cache held as `kv_format` (on the CPU: on another device, f32 only).
    pub fn start_decoder(
        &self,
        encoder_out: &Tensor,
        beams: usize,
        kv_format: KvFormat,
    ) -> Result<DecoderState> {
        let _guard = tch::no_grad_guard();
        let blocks = self.decoder.blocks.len();
        let cross_attention = self.decoder.blocks.iter().map(|block| {
            &block
                .cross_attention
                .as_ref()
                .expect("decoder blocks have cross-attention")
                .0
        });
        if encoder_out.device() != Device::Cpu && kv_format != KvFormat::F32 {
            return Err(Error::Input(format!(
                "a {kv_format} KV cache is held for the CPU's loops: on {:?} the cache is f32",
                encoder_out.device()
            )));
        }
        let mut cross_kv = Vec::new();
        // On the CPU: the attention caches as plain values, token-major (the projections' own
        // layout), instead of tensors; one cross-attention cache for every beam.
        let loops = if encoder_out.device() == Device::Cpu {
            let token_major = |w: &Linear| -> Result<Vec<f32>> {
                Ok(Vec::<f32>::try_from(
                    &linear(encoder_out, w)?.f_reshape([-1])?,
                )?)
            };
            let width = self.spec.inner_dim();
            let cross_kv = cross_attention
                .map(|attn| {
                    let (keys, values) = (token_major(&attn.k)?, token_major(&attn.v)?);
                    Ok(SourceKv::new(kv_format, &keys, values, width))
                })
                .collect::<Result<Vec<_>>>()?;
            Some(LoopCaches {
                self_kv: vec![vec![(Vec::new(), Vec::new()); blocks]; beams],
                cross_kv,
            })
        } else {
            // HF expands the encoder output to every beam (`repeat_interleave`) before decoding.
            let expanded = encoder_out.f_repeat([beams as i64, 1, 1])?;
            for attn in cross_attention {
                cross_kv.push((
                    attn.project(&expanded, &attn.k)?,
                    attn.project(&expanded, &attn.v)?,
                ));
            }
            None
        };
        Ok(DecoderState {
            self_kv: (0..blocks).map(|_| None).collect(),
            cross_kv,
            loops,
            len: 0,
        })
    }

    /// Feeds one token per sequence (`[b]` ids) and returns the next-token logits `[b, V]`.
    pub fn decode_step(
        &self,
        tokens: &[i64],
        state: &mut DecoderState,
        provider: &mut dyn ExpertProvider,
        routes: &mut Vec<LayerRoute>,
    ) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        provider.begin_step(Stack::Decoder);
        let b = tokens.len() as i64;
        let mut h = self.embed(&self.decoder, tokens, [b, 1])?; // [b, 1, d]
        let bias = self.decoder.blocks[0].self_attention.position_bias(
            1,
            state.len + 1,
            state.len,
            false,
            self.spec.relative_attention_num_buckets as i64,
            self.spec.relative_attention_max_distance as i64,
        )?; // [1, h, 1, len + 1]
            // The loops' bias: plain values `[h, len + 1]`, the same for every sequence.
        let bias_values = match &state.loops {
            Some(loops) if loops.self_kv.len() != tokens.len() => {
                return Err(Error::Internal(format!(
                    "a decoder started for {} sequences was fed {b}",
                    loops.self_kv.len()
                )))
            }
            Some(_) => Some(Vec::<f32>::try_from(&bias.f_reshape([-1])?)?),
            None => None,
        };
        for (index, block) in self.decoder.blocks.iter().enumerate() {
            let attn = &block.self_attention;
            let normed = block.self_attention_norm.forward(&h)?;
            let attended = match (&mut state.loops, &bias_values) {
                (Some(loops), Some(bias_values)) => {
                    // Every sequence's new key and value rows, `[b × h·dk]` each.
                    let rows = |w: &Linear| -> Result<Vec<f32>> {
                        Ok(Vec::<f32>::try_from(&linear(&normed, w)?.f_reshape([-1])?)?)
                    };
                    let (new_keys, new_values) = (rows(&attn.k)?, rows(&attn.v)?);
                    let width = new_keys.len() / loops.self_kv.len();
                    for ((sequence, key), value) in loops
                        .self_kv
                        .iter_mut()
                        .zip(new_keys.chunks_exact(width))
                        .zip(new_values.chunks_exact(width))
                    {
                        let (keys, values) = &mut sequence[index];
                        keys.extend_from_slice(key);
                        values.extend_from_slice(value);
                    }
                    let caches: Vec<(&[f32], &[f32])> = loops
                        .self_kv
                        .iter()
                        .map(|sequence| (&sequence[index].0[..], &sequence[index].1[..]))
                        .collect();
                    attn.attend_cached(&normed, &caches, Some(bias_values))?
                }
                _ => {
                    let new_k = attn.project(&normed, &attn.k)?; // [b, h, 1, dk]
                    let new_v = attn.project(&normed, &attn.v)?;
                    let (keys, values) = match state.self_kv[index].take() {
                        Some((k, v)) => (
                            Tensor::f_cat(&[k, new_k], 2)?,
                            Tensor::f_cat(&[v, new_v], 2)?,
                        ),
                        None => (new_k, new_v),
                    };
                    let attended = attn.attend(&normed, &keys, &values, Some(&bias))?;
                    state.self_kv[index] = Some((keys, values));
                    attended
                }
            };
            h = h.f_add(&attended)?;

            let (cross, cross_norm) = block
                .cross_attention
                .as_ref()
                .expect("decoder blocks have cross-attention");
            let normed = cross_norm.forward(&h)?;
            let crossed = match &state.loops {
                Some(loops) => cross.attend_cached_shared(&normed, &loops.cross_kv[index], None)?,
                None => {
                    let (keys, values) = &state.cross_kv[index];
                    cross.attend(&normed, keys, values, None)?
                }
            };
            h = h.f_add(&crossed)?;

            h = self.feed_forward(&self.decoder, index, &h, provider, routes)?;
        }
        state.len += 1;
        self.logits(&h, b)
    }

    /// The next-token logits `[b, V]` of the last block's output `h` `[b, 1, d]`.
    fn logits(&self, h: &Tensor, b: i64) -> Result<Tensor> {
        let mut h = self.decoder.final_norm.forward(h)?;
        let head = match &self.lm_head {
            Some(head) => head,
            None => {
                // Tied embeddings: rescale before projecting on the vocabulary (Mesh TF).
                h = h.f_mul_scalar((self.spec.d_model as f64).powf(-0.5))?;
                &self.shared
            }
        };
        let logits = linear(&h, head)?; // [b, 1, V]
        Ok(logits.f_reshape([b, self.spec.vocab_size as i64])?)
    }

    /// Keeps the caches of sequences `beam_idx` (`[b]`, indices into the current batch).
    pub fn reorder(&self, state: &mut DecoderState, beam_idx: &[i64]) -> Result<()> {
        if let Some(loops) = &mut state.loops {
            let count = loops.self_kv.len();
            if beam_idx.len() != count || beam_idx.iter().any(|&i| !(0..count as i64).contains(&i))
            {
                return Err(Error::Internal(format!(
                    "{count} sequences reordered as {beam_idx:?}"
                )));
            }
            // Each kept sequence's caches move to their new place (at its last use). A sequence
            // kept twice is copied into the buffers of one that was dropped: there are as many
            // of those as copies, and reusing them spares fresh pages every step.
            let mut uses = vec![0usize; count];
            beam_idx.iter().for_each(|&i| uses[i as usize] += 1);
            let mut old: Vec<Option<_>> = std::mem::take(&mut loops.self_kv)
                .into_iter()
                .map(Some)
                .collect();
            let mut spare: Vec<Vec<(Vec<f32>, Vec<f32>)>> = (0..count)
                .filter(|&i| uses[i] == 0)
                .filter_map(|i| old[i].take())
                .collect();
            for &i in beam_idx {
                let i = i as usize;
                uses[i] -= 1;
                let caches = if uses[i] == 0 {
                    old[i]
                        .take()
                        .expect("a sequence is taken at its last use only")
                } else {
                    let source = old[i].as_ref().expect("kept until its last use");
                    let mut copy = spare.pop().expect("one dropped sequence per copy");
                    for ((keys, values), (from_keys, from_values)) in copy.iter_mut().zip(source) {
                        keys.clear();
                        keys.extend_from_slice(from_keys);
                        values.clear();
                        values.extend_from_slice(from_values);
                    }
                    copy
                };
                loops.self_kv.push(caches);
            }
            return Ok(());
        }
        let idx = Tensor::f_from_slice(beam_idx)?.f_to_device(self.device())?;
        for kv in state.self_kv.iter_mut().flatten() {
            *kv = (kv.0.f_index_select(0, &idx)?, kv.1.f_index_select(0, &idx)?);
        }
        for kv in state.cross_kv.iter_mut() {
            *kv = (kv.0.f_index_select(0, &idx)?, kv.1.f_index_select(0, &idx)?);
        }
        Ok(())
    }
}

impl SwitchModel {
    /// Estimated bytes of activations and scratch for one run (f32 everywhere).
    pub fn working_bytes(&self, run: RunShape) -> u64 {
        // Saturating: a huge `--max-new-tokens` gives a huge estimate (and a clean budget
        // error), never a wrapped small one.
        use std::num::Saturating as S;
        let n = |v: usize| S(v as u64);
        let spec = &self.spec;
        let f = S(4u64);
        let src = n(run.max_source_tokens);
        let beams = n(run.beams.max(1));
        let d = n(spec.d_model);
        let inner = n(spec.inner_dim());
        let heads = n(spec.num_heads);
        let d_ff = n(spec.d_ff);
        // Encoder: hidden states, q/k/v/out, scores (+ softmax copy), FF intermediate, bias.
        let encoder = src * (S(4) * d + S(4) * inner + d_ff) + S(3) * heads * src * src;
        // Logits and log-probabilities of every beam, plus the top-k workspace.
        let logits = S(3) * beams * n(spec.vocab_size);
        // The GEMM paths' tiles of dequantized weight rows per compute thread and their
        // activations (experts are never expanded whole).
        let expert_scratch = n(gemm_scratch_values(
            spec.d_model.max(spec.d_ff),
            compute_threads(),
        ));
        // The encoder's activations packed for MKL's GEMM (x86_64 builds).
        let packed = S(gemm_packed_acts_bytes(
            run.max_source_tokens,
            spec.d_model.max(spec.d_ff),
        ));
        (f * (encoder + logits + expert_scratch) + packed + S(self.decoder_cache_bytes(run))).0
    }

    /// The bytes [`working_bytes`](Self::working_bytes) sets aside for the decoder's attention
    /// caches over a run of `run`'s shape: what a [`DecoderState`] may hold at its largest
    /// ([`DecoderState::held_bytes`]).
    pub fn decoder_cache_bytes(&self, run: RunShape) -> u64 {
        use std::num::Saturating as S;
        let n = |v: usize| S(v as u64);
        let src = n(run.max_source_tokens);
        let tgt = n(run.max_new_tokens) + S(1);
        let beams = n(run.beams.max(1));
        let inner = n(self.spec.inner_dim());
        let dec_layers = n(self.spec.num_decoder_layers);
        // The CPU's loops (`LoopCaches`): self-attention K/V per beam grow to `tgt` (vectors
        // that grow may hold twice what they use), cross-attention K/V span `src` once for
        // every beam, in the run's format. A reorder copies into dropped beams' caches, never
        // beside them.
        let self_kv = S(4) * dec_layers * S(2) * inner * S(2) * beams * tgt;
        let cross_kv = dec_layers * S(2) * S(run.kv_cache.bytes(src.0, inner.0));
        (self_kv + cross_kv).0
    }
}

impl DecoderState {
    /// Bytes the attention caches hold now (what their vectors have allocated, not only what
    /// they use), for checking [`SwitchModel::decoder_cache_bytes`].
    pub fn held_bytes(&self) -> u64 {
        let tensors = self.self_kv.iter().flatten().chain(&self.cross_kv);
        let tensor_bytes: u64 = tensors
            .map(|(k, v)| 4 * (k.numel() + v.numel()) as u64)
            .sum();
        let loop_bytes: u64 = self.loops.as_ref().map_or(0, |loops| {
            let self_kv: u64 = (loops.self_kv.iter().flatten())
                .map(|(k, v)| 4 * (k.capacity() + v.capacity()) as u64)
                .sum();
            self_kv + loops.cross_kv.iter().map(SourceKv::held_bytes).sum::<u64>()
        });
        tensor_bytes + loop_bytes
    }

    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
