//! EdgeMoE: mixture-of-experts inference for memory-constrained boards.
//!
//! Non-expert weights stay resident; experts live in an on-disk expert store and are brought
//! into a fixed expert buffer sized from a memory budget. The model reaches experts only through
//! the [`model::provider::ExpertProvider`] interface, so buffers, policies and baselines are
//! interchangeable behind it.
//!
//! Crate map, in layers (`ARCHITECTURE.md` for the design, `LAYOUT.md` for the rules). An import
//! only points down a layer or sideways to a sibling without closing a cycle; `tests/layers.rs`
//! checks it.
//!
//! - L0, leaves: [`error`] (the one error type), [`ids`] (`Stack`, `ExpertId`), [`units`]
//!   (`1.5GiB` ↔ bytes), [`io`] (JSON files, page-cache dropping), [`atomic`] (writes that
//!   replace a file or a directory whole, or not at all), [`interrupt`] (temporary files removed
//!   when a run is interrupted), [`memory`] (buffers on huge pages for the weights a step streams).
//! - L1, facts and formats: [`config`] (HF configs → validated `ModelSpec`, generation defaults,
//!   bundle config, device profiles), [`weights`] (safetensors, the one memory-mapping site),
//!   [`quant`] (INT8/4/2 and their kernels), [`store`] (the expert store's bytes), [`cache`]
//!   (slot bookkeeping, eviction policies, traces and replay), [`dictionary`] (the activation-path
//!   dictionary), [`manifest`] (a bundle's file checksums).
//! - L2, [`model`]: the architectures (Switch Transformers; Mixtral, Qwen2-MoE, OLMoE) over shared
//!   layers and one MoE feed-forward, the `Model` enum, and the expert-provider interface.
//! - L3, the online expert side and opening a bundle: [`runtime`] (expert buffer, prediction,
//!   I/O scheduler and speculation, codec, modes, resident experts, stats, budget, run setup),
//!   [`bundle`], [`tokenizer`].
//! - L4, [`generation`]: one session type for every architecture — open, summarize or generate,
//!   report.
//! - L5, once-per-model work, measurement and the service: [`offline`] (convert, calibrate, tune
//!   bit widths, eval, ROUGE with its Porter stemmer), [`bench`] (the modes × budgets matrix, its
//!   results table and charts, the storage probe), [`serve`] (`edgemoe serve`: the HTTP service,
//!   its queue, engine thread, metrics and dashboard).
//! - L6, the binary: `engine/cli/` (one file per command), compiled into `edgemoe` only.

pub mod atomic;
pub mod error;
pub mod ids;
pub mod interrupt;
pub mod io;
pub mod memory;
pub mod units;

pub mod cache;
pub mod config;
pub mod dictionary;
pub mod manifest;
pub mod quant;
pub mod store;
pub mod weights;

pub mod model;

pub mod bundle;
pub mod runtime;
pub mod tokenizer;

pub mod generation;

pub mod bench;
pub mod offline;
pub mod serve;

pub use error::{Error, Result};
