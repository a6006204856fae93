//! The online expert side of a run: where experts are while the model computes.
//!
//! - [`buffer`]: the expert buffer — fixed slots over the expert store, a policy, prefetch.
//! - [`predict`]: the path dictionary's predictions for the next MoE layer, during a run.
//! - [`prefetch`]: the I/O scheduler: reader threads over one priority queue (demand first).
//! - [`speculation`]: whether speculative reads pay, per layer; stops and resumes them.
//! - [`codec`]: stored expert bytes → f32 weights.
//! - [`modes`]: the baselines behind the same provider interface (`io-free`, `io-exp`, `mmap`, …)
//!   and the [`modes::ExpertSource`] a run uses.
//! - [`resident`]: every expert in memory (`io-free`, tuning).
//! - [`stand_in`]: low-bit copies of decoder experts that compute a decode step's miss while
//!   the full expert is read (`--stand-in`).
//! - [`stats`]: the counters every provider keeps.
//! - [`budget`]: working-memory estimate and the budget split.
//! - [`setup`]: what every run opens around the model: store, budget, buffer, dictionary, trace.

pub mod budget;
pub mod buffer;
pub mod codec;
pub mod modes;
pub mod predict;
pub mod prefetch;
pub mod resident;
pub mod setup;
pub mod speculation;
pub mod stand_in;
pub mod stats;
