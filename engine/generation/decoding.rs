//! What one decoding call is asked ([`DecodeOptions`], defaults from the bundle's generation
//! config), how it is stopped early ([`Cancellation`]) and what it gives back ([`Generation`]),
//! whatever the model's shape.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::config::{EarlyStopping, GenerationDefaults};
use crate::error::{Error, Result};
use crate::model::{KvFormat, LayerRoute};

use super::sampling::Sampling;

/// Knobs of one generation call (defaults come from the bundle's generation config).
#[derive(Debug, Clone)]
pub struct DecodeOptions {
    pub max_new_tokens: usize,
    pub num_beams: usize,
    pub length_penalty: f64,
    pub early_stopping: EarlyStopping,
    pub no_repeat_ngram_size: usize,
    pub decoder_start_token_id: i64,
    pub eos_token_id: i64,
    /// How a decoder-only model picks the next token (encoder-decoders search greedily or
    /// with beams, as `num_beams` says).
    pub sampling: Sampling,
    /// Tokens that end a decoder-only generation (kept in the output).
    pub stop_token_ids: Vec<i64>,
    /// How the attention cache holds its keys and values (`--kv-cache`; f32 unless asked): an
    /// encoder-decoder's cross-attention, a decoder-only model's self-attention.
    pub kv_cache: KvFormat,
    /// Checked before the encoder pass or prefill and before every step: the call ends with
    /// [`Error::Cancelled`] once it fires (never, by default).
    pub cancellation: Cancellation,
}

impl DecodeOptions {
    pub fn from_defaults(g: &GenerationDefaults) -> Self {
        DecodeOptions {
            max_new_tokens: g.max_new_tokens,
            num_beams: g.num_beams,
            length_penalty: g.length_penalty,
            early_stopping: g.early_stopping,
            no_repeat_ngram_size: g.no_repeat_ngram_size,
            decoder_start_token_id: g.decoder_start_token_id,
            eos_token_id: g.eos_token_id,
            sampling: Sampling::Greedy,
            stop_token_ids: g.stop_token_ids.clone(),
            kv_cache: KvFormat::F32,
            cancellation: Cancellation::default(),
        }
    }
}

/// Ends a decoding call between two steps: the service cancels a request whose client went
/// away, whose deadline passed, or that is still running when the service shuts down. Clones
/// share one flag; the default has no deadline and fires only when [`Cancellation::cancel`] is
/// called.
#[derive(Debug, Clone, Default)]
pub struct Cancellation {
    cancelled: Arc<AtomicBool>,
    deadline: Option<Instant>,
}

impl Cancellation {
    /// A cancellation that also fires at `deadline`.
    pub fn with_deadline(deadline: Instant) -> Self {
        Cancellation {
            cancelled: Arc::default(),
            deadline: Some(deadline),
        }
    }

    /// Fires the cancellation: every clone's next check fails.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::Relaxed);
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Relaxed)
    }

    /// Whether the deadline (if any) has passed.
    pub fn deadline_passed(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// Fails with [`Error::Cancelled`] once cancelled or past the deadline.
    pub fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            Err(Error::Cancelled("the run was cancelled".into()))
        } else if self.deadline_passed() {
            Err(Error::Cancelled("the deadline passed".into()))
        } else {
            Ok(())
        }
    }
}

/// What one generation produced and how long it took.
#[derive(Debug, Clone, Default)]
pub struct Generation {
    /// Generated ids, without the decoder start token; ends with EOS if the model emitted it.
    pub tokens: Vec<i64>,
    /// The encoder pass (Switch) or the prompt's prefill (decoder-only).
    pub encode_ms: f64,
    /// Of `encode_ms`, the time the compute thread waited for expert bytes.
    pub encode_stall_ms: f64,
    /// Wall time of each decoder step (one step = one new token for every beam).
    pub step_ms: Vec<f64>,
    /// Router decisions of every MoE layer, in execution order (encoder call, then each step).
    pub routes: Vec<LayerRoute>,
}
