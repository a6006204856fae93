//! The expert provider interface — the only way the model reaches expert weights. The model
//! asks for an expert's weights and reports its routing; where experts live (a buffer over the
//! expert store, all resident, mapped) is the provider's business, in `runtime/`.

use tch::Device;

use super::layers::Weight;
use crate::error::{Error, Result};
use crate::ids::{ExpertId, Stack};

/// One expert's weights, ready for the math: stored matrices borrowed from where the provider
/// keeps them (computed on in their encoding), or tensors. They borrow the provider: use them
/// before asking it for the next expert.
pub enum ExpertWeights<'a> {
    /// Switch Transformers: `wi` `[d_ff, d_model]`, `wo` `[d_model, d_ff]`.
    Relu { wi: Weight<'a>, wo: Weight<'a> },
    /// Decoder-only families: `gate`, `up` `[d_ff, d_model]`, `down` `[d_model, d_ff]`.
    SwiGlu {
        gate: Weight<'a>,
        up: Weight<'a>,
        down: Weight<'a>,
    },
}

impl<'a> ExpertWeights<'a> {
    /// The expert from its matrices, named as the store names them, in blob order.
    pub fn from_matrices(id: ExpertId, names: &[&str], matrices: Vec<Weight<'a>>) -> Result<Self> {
        let names_seen = format!("{names:?}");
        let mut m = matrices.into_iter();
        match (names, m.len()) {
            (["wi", "wo"], 2) => Ok(ExpertWeights::Relu {
                wi: m.next().expect("two"),
                wo: m.next().expect("two"),
            }),
            (["gate", "up", "down"], 3) => Ok(ExpertWeights::SwiGlu {
                gate: m.next().expect("three"),
                up: m.next().expect("three"),
                down: m.next().expect("three"),
            }),
            _ => Err(Error::Internal(format!(
                "{id}: unknown expert matrices {names_seen}"
            ))),
        }
    }

    /// The same weights on `device`: stored matrices stay in their encoding on the CPU and are
    /// expanded to f32 on a GPU.
    pub fn to_device(self, device: Device) -> Result<Self> {
        Ok(match self {
            ExpertWeights::Relu { wi, wo } => ExpertWeights::Relu {
                wi: wi.to_device(device)?,
                wo: wo.to_device(device)?,
            },
            ExpertWeights::SwiGlu { gate, up, down } => ExpertWeights::SwiGlu {
                gate: gate.to_device(device)?,
                up: up.to_device(device)?,
                down: down.to_device(device)?,
            },
        })
    }

    /// The matrices in blob order.
    pub fn matrices(&self) -> Vec<&Weight<'a>> {
        match self {
            ExpertWeights::Relu { wi, wo } => vec![wi, wo],
            ExpertWeights::SwiGlu { gate, up, down } => vec![gate, up, down],
        }
    }
}

/// How the model gets expert weights. Implementations decide where experts live.
pub trait ExpertProvider {
    /// Makes expert `id` ready and returns its weights. `next` is the expert this layer needs
    /// after `id`, if any: its read may start once `id` is ready, while `id` computes.
    fn expert(&mut self, id: ExpertId, next: Option<ExpertId>) -> Result<ExpertWeights<'_>>;

    /// A new forward call starts: the encoder pass, or one decoder step (one new token per
    /// sequence).
    fn begin_step(&mut self, _stack: Stack) {}

    /// Milliseconds the compute thread has waited for expert bytes so far (the run's
    /// `stall_ms`), so that a caller can tell an encoder pass's waits from decoding's; 0 for a
    /// provider that never waits.
    fn stall_ms(&self) -> f64 {
        0.0
    }

    /// The router of block `block` of `stack` chose `experts`: `k` per token (highest weight
    /// first), tokens row-major, so `experts.len()` = tokens × `k`. Stale prefetches for this
    /// layer can go, and the next layer's experts can be prefetched.
    fn routed(&mut self, _stack: Stack, _block: usize, _k: usize, _experts: &[u16]) -> Result<()> {
        Ok(())
    }

    /// Whether the model should run the gate lookahead for this provider: at each MoE block,
    /// the next MoE block's router applied to the current hidden state (see
    /// [`predicted`](Self::predicted)). Off unless a provider uses it: it costs a norm and a
    /// router product per MoE block.
    fn wants_lookahead(&self) -> bool {
        false
    }

    /// The gate lookahead's prediction for MoE block `block` of `stack`: its router, applied to
    /// the hidden state entering the previous MoE block's FFN, chose `experts` (`k` per token,
    /// as in [`routed`](Self::routed)). Arrives before the previous block routes.
    fn predicted(
        &mut self,
        _stack: Stack,
        _block: usize,
        _k: usize,
        _experts: &[u16],
    ) -> Result<()> {
        Ok(())
    }
}
