//! Model code: shared building blocks ([`layers`]), the one MoE feed-forward ([`moe`]), and the
//! architectures assembled from them: Switch Transformers ([`switch`], encoder-decoder) and the
//! decoder-only families Mixtral, Qwen2-MoE and OLMoE ([`decoder_only`]). The model reaches
//! experts only through [`provider::ExpertProvider`].

pub mod decoder_only;
pub mod layers;
pub mod moe;
pub mod provider;
pub mod switch;

pub use decoder_only::{DecoderOnlyModel, KvCache};
pub use moe::{LayerRoute, Routing};
pub use provider::{ExpertProvider, ExpertWeights};
pub use switch::{DecoderState, SwitchModel};
