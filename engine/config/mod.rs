//! Model facts. Hugging Face's `config.json` / `generation_config.json` are read into raw serde
//! structs with HF field names ([`hf`]), validated once into a [`ModelSpec`] (the engine's own
//! form: [`spec`], per architecture [`switch`] and [`decoder`]), and written into the bundle's
//! `config.json` ([`bundle`]) together with the generation defaults ([`generation`]) and the
//! bundle format version. Device profiles ([`profile`]) are the other facts a run starts from.
//!
//! This folder holds one of the crate's three architecture `match`es (with `model/mod.rs` and
//! `offline/convert.rs`): a new architecture adds a file here.

pub mod bundle;
pub mod decoder;
pub mod generation;
pub mod hf;
pub mod profile;
pub mod spec;
pub mod switch;

pub use bundle::{BundleConfig, BUNDLE_FORMAT_VERSION};
pub use decoder::{DecoderFamily, DecoderSpec};
pub use generation::{EarlyStopping, GenerationDefaults, TokenIdSources};
pub use hf::{HfDecoderConfig, HfGenerationConfig, HfSpecialTokens, HfSwitchConfig};
pub use spec::{ExpertFfn, ModelSpec};
pub use switch::{SwitchSpec, ARCHITECTURE_SWITCH};
