//! Model code: shared building blocks ([`layers`]), the one MoE feed-forward ([`moe`]) and the
//! Switch Transformers architecture ([`switch`]) assembled from them.

pub mod layers;
pub mod moe;
pub mod switch;

pub use moe::LayerRoute;
pub use switch::{DecoderState, SwitchModel};
