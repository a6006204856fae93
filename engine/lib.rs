//! EdgeMoE: mixture-of-experts inference for memory-constrained boards.
//!
//! Non-expert weights stay resident; experts live in an on-disk expert store and are brought
//! into a fixed expert buffer sized from a memory budget. The model reaches experts only through
//! the [`provider::ExpertProvider`] interface, so buffers, policies and baselines are
//! interchangeable behind it.
//!
//! Module map (mirrors `ARCHITECTURE.md`):
//! - [`config`]: Hugging Face config → validated [`config::ModelSpec`]; generation defaults.
//! - [`decoder_config`]: the decoder-only MoE families (Mixtral, Qwen2-MoE, OLMoE).
//! - [`budget`]: memory budget parsing and accounting.
//! - [`weights`]: the one memory-mapping site; safetensors checkpoints and resident weights.
//! - [`expert_store`]: the on-disk expert store format (header, index, page-aligned blobs).
//! - [`convert`]: Hugging Face checkpoint → model bundle.
//! - [`bundle`]: opening a model bundle.
//! - [`provider`]: the expert provider interface and the fixed LRU expert buffer behind it.
//! - [`model`]: Switch Transformers and decoder-only (Mixtral, Qwen2-MoE, OLMoE) forward passes
//!   over shared blocks and one MoE feed-forward.
//! - [`generate`]: greedy decoding and beam search (encoder-decoder).
//! - [`causal`]: prompt prefill and streamed greedy or top-p generation (decoder-only).
//! - [`runtime`]: the expert store, budget split and expert buffer every run sets up.
//! - [`tokenizer`], [`summarize`], [`stats`]: the user-facing run.

pub mod bench;
pub mod bit_plan;
pub mod budget;
pub mod bundle;
pub mod cache;
pub mod calibrate;
pub mod causal;
pub mod config;
pub mod convert;
pub mod decoder_config;
pub mod error;
pub mod eval;
pub mod expert_store;
pub mod generate;
pub mod model;
pub mod modes;
pub mod paths;
pub mod plot;
pub mod prefetch;
pub mod probe;
pub mod profile;
pub mod provider;
pub mod quant;
pub mod resident_experts;
pub mod rouge;
pub mod runtime;
pub mod stats;
pub mod summarize;
pub mod tokenizer;
pub mod tune;
pub mod weights;

pub use error::{Error, Result};
