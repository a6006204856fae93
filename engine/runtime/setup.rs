//! What every command that runs a model sets up around it, whatever the architecture: the
//! expert store opened in the requested storage mode, the budget split between resident
//! weights, working memory and expert slots, and the expert buffer with its policy, prefetch
//! thread, path dictionary (when the bundle is calibrated) and optional trace. Summarization
//! (Switch) and text generation (decoder-only) both open one.

use std::path::PathBuf;
use std::sync::Arc;

use crate::bundle::{Bundle, EXPERTS_FILE};
use crate::cache::Policy;
use crate::dictionary::PathDictionary;
use crate::error::{Error, Result};
use crate::ids::Stack;
use crate::quant::QuantBits;
use crate::runtime::budget::BudgetPlan;
use crate::runtime::buffer::{BufferOptions, ExpertBuffer};
use crate::runtime::modes::{DemandLoader, ExpertSource, MappedExperts, Mode};
use crate::runtime::predict::PredictorKind;
use crate::runtime::resident::ResidentExperts;
use crate::runtime::stand_in::{stand_in_bytes, stand_in_experts};
use crate::store::{ExpertStore, ReadPacer, StorageMode};

/// How the expert buffer behaves.
#[derive(Debug, Clone)]
pub struct CacheOptions {
    pub policy: Policy,
    pub prefetch: bool,
    /// Speculative bytes per forward call; `None` = two experts (or, with top-k routing, k
    /// experts if more) per decoder MoE layer.
    pub prefetch_cap_bytes: Option<u64>,
    /// Which predictions start speculative reads.
    pub predictor: PredictorKind,
    /// Slots instead of "as many as the budget allows" (still checked against the budget).
    pub buffer_experts: Option<usize>,
    /// Record every expert access into this file.
    pub trace: Option<PathBuf>,
    pub storage: StorageMode,
    /// The profile's storage device: bytes per second and per-read latency. `StorageMode::Emulate`
    /// paces reads to it; speculation weighs what a read costs by it.
    pub storage_device: Option<(f64, std::time::Duration)>,
    /// Reads the device serves at once (the profile's `storage_queue_depth`): the I/O
    /// scheduler's readers, and the emulated device's channels.
    pub queue_depth: usize,
    pub mode: Mode,
    /// Bundle whose (quantized) expert store the quantized modes use (`io-qexp`, `q`, `q+p`,
    /// `q+p+c`); same model, other widths.
    pub quantized_bundle: Option<PathBuf>,
    /// Stand-ins at this width for a decode step's misses (modes with an expert buffer; see
    /// `runtime::stand_in`). Their memory comes out of the budget.
    pub stand_in: Option<QuantBits>,
}

impl Default for CacheOptions {
    fn default() -> Self {
        CacheOptions {
            policy: Policy::Edgemoe,
            prefetch: true,
            prefetch_cap_bytes: None,
            predictor: PredictorKind::Dictionary,
            buffer_experts: None,
            trace: None,
            storage: StorageMode::Cached,
            storage_device: None,
            queue_depth: 1,
            mode: Mode::Edgemoe,
            quantized_bundle: None,
            stand_in: None,
        }
    }
}

/// The expert side of a run.
pub struct ExpertRuntime {
    /// Where experts come from (the expert buffer in `edgemoe` mode).
    pub buffer: ExpertSource,
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
        let mode = cache.mode;
        let quantized;
        let store_bundle = match (&cache.quantized_bundle, mode.uses_quantized_store()) {
            (Some(q), true) => {
                quantized = Bundle::open(q)?;
                if quantized.config.model != *spec {
                    return Err(Error::Input(format!(
                        "{}: the quantized bundle is not the same model as {}",
                        q.display(),
                        bundle.dir().display()
                    )));
                }
                &quantized
            }
            (None, true) => {
                return Err(Error::Input(format!(
                    "mode `{mode}` needs a quantized bundle of the same model (--quantized BUNDLE)"
                )))
            }
            _ => bundle,
        };
        // The page cache is what mmap is about.
        let storage = if mode == Mode::Mmap {
            StorageMode::Cached
        } else {
            cache.storage
        };
        let (mut store, warning) = ExpertStore::open_with(
            &store_bundle.path(EXPERTS_FILE),
            &spec.expert_layout(),
            storage,
        )?;
        let pacer = match (cache.storage, cache.storage_device) {
            (StorageMode::Emulate, Some((bw, latency))) => {
                Some(ReadPacer::with_queue_depth(bw, latency, cache.queue_depth))
            }
            (StorageMode::Emulate, None) => {
                return Err(Error::Input(
                    "--storage emulate needs a device profile (--profile NAME)".into(),
                ))
            }
            _ => None,
        };
        let slot_bytes = store.max_padded_expert_bytes();
        let stand_in_bytes = match cache.stand_in {
            Some(_) if !mode.has_buffer() => {
                return Err(Error::Input(format!(
                    "--stand-in computes with copies of experts missing from the expert buffer: mode `{mode}` has none (use edgemoe, q+p or q+p+c)"
                )))
            }
            Some(bits) => {
                stand_in_bytes(&spec.expert_layout(), bits, stand_in_experts(&store).len())
            }
            None => 0,
        };
        let mut plan = BudgetPlan::new(
            budget_bytes,
            resident_bytes.saturating_add(stand_in_bytes),
            working_bytes,
            slot_bytes,
            store.index().experts.len(),
            cache.buffer_experts,
        )?;
        let dictionary = bundle.path_dictionary()?.map(Arc::new);
        let decoder_moe_layers = spec.moe_blocks(Stack::Decoder).len() as u64;
        let per_layer = spec.top_k().max(2) as u64;
        let buffered = |slots: usize, prefetch: bool, store: ExpertStore| {
            ExpertBuffer::with_options(
                store,
                spec,
                &BufferOptions {
                    slots,
                    policy: cache.policy,
                    prefetch,
                    prefetch_cap_bytes: cache
                        .prefetch_cap_bytes
                        .unwrap_or(per_layer * decoder_moe_layers.max(1) * slot_bytes),
                    predictor: cache.predictor,
                    stand_in: cache.stand_in,
                },
                dictionary.clone(),
            )
            .map(|b| ExpertSource::Buffer(Box::new(b)))
        };
        store.set_queue_depth(cache.queue_depth);
        store.set_device(cache.storage_device);
        if mode != Mode::Mmap {
            store.set_pacer(pacer.clone());
        }
        let mut buffer = match mode {
            Mode::Edgemoe | Mode::QPC => buffered(plan.slots, cache.prefetch, store)?,
            Mode::QP => {
                plan.slots = 2;
                buffered(2, true, store)?
            }
            Mode::IoExp | Mode::IoQexp | Mode::Q => {
                plan.slots = 1;
                ExpertSource::Demand(DemandLoader::new(store))
            }
            Mode::Mmap => {
                plan.slots = 0;
                ExpertSource::Mapped(MappedExperts::new(store, pacer)?)
            }
            Mode::IoFree => {
                let resident = ResidentExperts::load(&store, &[])?;
                plan.slots = 0;
                plan.resident_bytes += resident.bytes();
                ExpertSource::Resident(resident)
            }
        };
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
