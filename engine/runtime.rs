//! What every command that runs a model sets up around it, whatever the architecture: the
//! expert store opened in the requested storage mode, the budget split between resident
//! weights, working memory and expert slots, and the expert buffer with its policy, prefetch
//! thread, path dictionary (when the bundle is calibrated) and optional trace. Summarization
//! (Switch) and text generation (decoder-only) both open one.

use std::path::PathBuf;
use std::sync::Arc;

use crate::budget::BudgetPlan;
use crate::bundle::{Bundle, EXPERTS_FILE};
use crate::cache::Policy;
use crate::config::Stack;
use crate::error::Result;
use crate::expert_store::{ExpertStore, StorageMode};
use crate::paths::{PathDictionary, PATHS_FILE};
use crate::provider::{BufferOptions, ExpertBuffer};

/// How the expert buffer behaves.
#[derive(Debug, Clone)]
pub struct CacheOptions {
    pub policy: Policy,
    pub prefetch: bool,
    /// Speculative bytes per forward call; `None` = two experts (or, with top-k routing, k
    /// experts if more) per decoder MoE layer.
    pub prefetch_cap_bytes: Option<u64>,
    /// Slots instead of "as many as the budget allows" (still checked against the budget).
    pub buffer_experts: Option<usize>,
    /// Record every expert access into this file.
    pub trace: Option<PathBuf>,
    pub storage: StorageMode,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            policy: Policy::Edgemoe,
            prefetch: true,
            prefetch_cap_bytes: None,
            buffer_experts: None,
            trace: None,
            storage: StorageMode::Cached,
        }
    }
}

/// The expert side of a run.
pub struct ExpertRuntime {
    pub buffer: ExpertBuffer,
    pub plan: BudgetPlan,
    /// The bundle's activation-path dictionary, if it has been calibrated.
    pub dictionary: Option<Arc<PathDictionary>>,
    /// Things the user should know (e.g. `O_DIRECT` refused by the filesystem).
    pub warnings: Vec<String>,
}

impl ExpertRuntime {
    /// Opens `bundle`'s expert store and sizes the buffer from `budget_bytes` after
    /// `resident_bytes` (the loaded model's) and `working_bytes` (the run's activations).
    pub fn open(
        bundle: &Bundle,
        budget_bytes: u64,
        resident_bytes: u64,
        working_bytes: u64,
        cache: &CacheOptions,
    ) -> Result<Self> {
        let spec = &bundle.config.model;
        let (store, warning) =
            ExpertStore::open_with(&bundle.path(EXPERTS_FILE), spec, cache.storage)?;
        let slot_bytes = store.max_padded_expert_bytes();
        let plan = BudgetPlan::new(
            budget_bytes,
            resident_bytes,
            working_bytes,
            slot_bytes,
            store.index().experts.len(),
            cache.buffer_experts,
        )?;
        let paths = bundle.path(PATHS_FILE);
        let dictionary = if paths.exists() {
            Some(Arc::new(PathDictionary::load(&paths)?))
        } else {
            None
        };
        let decoder_moe_layers = spec.moe_blocks(Stack::Decoder).len() as u64;
        let per_layer = spec.top_k().max(2) as u64;
        let mut buffer = ExpertBuffer::with_options(
            store,
            spec,
            &BufferOptions {
                slots: plan.slots,
                policy: cache.policy,
                prefetch: cache.prefetch,
                prefetch_cap_bytes: cache
                    .prefetch_cap_bytes
                    .unwrap_or(per_layer * decoder_moe_layers.max(1) * slot_bytes),
            },
            dictionary.clone(),
        )?;
        if let Some(trace) = &cache.trace {
            buffer.record_trace(trace)?;
        }
        Ok(ExpertRuntime {
            buffer,
            plan,
            dictionary,
            warnings: warning.into_iter().collect(),
        })
    }
}
