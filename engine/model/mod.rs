//! Model code: shared building blocks ([`layers`]), the one MoE feed-forward ([`moe`]), and the
//! architectures assembled from them: Switch Transformers ([`switch`], encoder-decoder) and the
//! decoder-only families Mixtral, Qwen2-MoE and OLMoE ([`decoder_only`]). The model reaches
//! experts only through [`provider::ExpertProvider`].
//!
//! [`Model`] is the one type the rest of the engine holds, and this file holds the crate's
//! architecture `match` for a loaded model (with `config/` and `offline/convert.rs`): loading,
//! resident and working bytes, and [`Model::run`], which hands the concrete model to the
//! decoding loop made for its shape (see [`ModelRun`]).

pub mod decoder_only;
pub mod kv;
pub mod layers;
pub mod moe;
pub mod provider;
pub mod switch;

use tch::Device;

use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::weights::WeightFiles;

pub use decoder_only::{DecoderOnlyModel, KvCache};
pub use kv::KvFormat;
pub use moe::{LayerRoute, Routing};
pub use provider::{ExpertProvider, ExpertWeights};
pub use switch::{DecoderState, SwitchModel};

/// A loaded model of any supported architecture.
pub enum Model {
    /// Encoder-decoder (Switch Transformers): rewrites its input (summaries).
    Switch(SwitchModel),
    /// Decoder-only (Mixtral, Qwen2-MoE, OLMoE): continues its input.
    DecoderOnly(DecoderOnlyModel),
}

/// The sizes of a run that working memory depends on.
#[derive(Debug, Clone, Copy)]
pub struct RunShape {
    /// Longest input: the encoder's source, or a decoder-only prompt (prefilled at once).
    pub max_source_tokens: usize,
    pub max_new_tokens: usize,
    /// Sequences decoded side by side (beam search); decoder-only runs decode one.
    pub beams: usize,
    /// How the attention cache holds its keys and values (an encoder-decoder's cross-attention,
    /// a decoder-only model's self-attention).
    pub kv_cache: KvFormat,
}

/// A decoding loop per model shape: [`Model::run`] calls the one that fits the model. The
/// loops themselves live in `generation/` (greedy and beam search for encoder-decoders,
/// prefill and streamed generation for decoder-only models).
pub trait ModelRun {
    type Output;
    fn encoder_decoder(&mut self, model: &SwitchModel) -> Self::Output;
    fn decoder_only(&mut self, model: &DecoderOnlyModel) -> Self::Output;
}

impl Model {
    /// The resident (non-expert) weights of `spec` from `files`, on `device`. Decoder-only
    /// models run on the CPU (another device is refused).
    pub fn load(spec: &ModelSpec, files: &WeightFiles, device: Device) -> Result<Self> {
        Ok(match spec {
            ModelSpec::Switch(s) => Model::Switch(SwitchModel::load_on(s, files, device)?),
            ModelSpec::DecoderOnly(_) if device != Device::Cpu => {
                return Err(Error::Input(
                    "decoder-only models run on the CPU in this build: pass --device cpu".into(),
                ))
            }
            ModelSpec::DecoderOnly(d) => Model::DecoderOnly(DecoderOnlyModel::load(d, files)?),
        })
    }

    pub fn spec(&self) -> ModelSpec {
        match self {
            Model::Switch(m) => ModelSpec::Switch(m.spec().clone()),
            Model::DecoderOnly(m) => ModelSpec::DecoderOnly(m.spec().clone()),
        }
    }

    /// Whether the model has an encoder (its input is a source to rewrite, not a prompt to
    /// continue).
    pub fn has_encoder(&self) -> bool {
        matches!(self, Model::Switch(_))
    }

    /// Bytes of the resident weights in memory (f32).
    pub fn resident_bytes(&self) -> u64 {
        match self {
            Model::Switch(m) => m.resident_bytes(),
            Model::DecoderOnly(m) => m.resident_bytes(),
        }
    }

    /// Estimated bytes of activations and scratch for a run of `shape` (f32 everywhere).
    pub fn working_bytes(&self, shape: RunShape) -> u64 {
        match self {
            Model::Switch(m) => m.working_bytes(shape),
            Model::DecoderOnly(m) => m.working_bytes(shape),
        }
    }

    /// Runs `run`'s loop for this model's shape.
    pub fn run<R: ModelRun + ?Sized>(&self, run: &mut R) -> R::Output {
        match self {
            Model::Switch(m) => run.encoder_decoder(m),
            Model::DecoderOnly(m) => run.decoder_only(m),
        }
    }
}
