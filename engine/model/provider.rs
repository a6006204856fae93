//! The expert provider interface — the only way the model reaches expert weights. The model
//! asks for an expert's weights and reports its routing; where experts live (a buffer over the
//! expert store, all resident, mapped) is the provider's business, in `runtime/`.

use tch::Tensor;

use crate::error::{Error, Result};
use crate::ids::{ExpertId, Stack};

/// One expert's weights, ready for the math (f32). They share memory with the provider's
/// scratch: use them before asking the provider for the next expert.
pub enum ExpertWeights {
    /// Switch Transformers: `wi` `[d_ff, d_model]`, `wo` `[d_model, d_ff]`.
    Relu { wi: Tensor, wo: Tensor },
    /// Decoder-only families: `gate`, `up` `[d_ff, d_model]`, `down` `[d_model, d_ff]`.
    SwiGlu {
        gate: Tensor,
        up: Tensor,
        down: Tensor,
    },
}

impl ExpertWeights {
    /// Views of `matrices` (shallow clones), named as the store names them, in blob order.
    pub fn from_matrices(id: ExpertId, names: &[&str], matrices: &[Tensor]) -> Result<Self> {
        let m = |i: usize| matrices[i].shallow_clone();
        match names {
            ["wi", "wo"] if matrices.len() == 2 => Ok(ExpertWeights::Relu { wi: m(0), wo: m(1) }),
            ["gate", "up", "down"] if matrices.len() == 3 => Ok(ExpertWeights::SwiGlu {
                gate: m(0),
                up: m(1),
                down: m(2),
            }),
            other => Err(Error::Internal(format!(
                "{id}: unknown expert matrices {other:?}"
            ))),
        }
    }

    /// The same weights on `device` (no copy when they are there already).
    pub fn to_device(self, device: tch::Device) -> Result<Self> {
        let moved = |t: Tensor| -> Result<Tensor> {
            if t.device() == device {
                Ok(t)
            } else {
                Ok(t.f_to_device(device)?)
            }
        };
        Ok(match self {
            ExpertWeights::Relu { wi, wo } => ExpertWeights::Relu {
                wi: moved(wi)?,
                wo: moved(wo)?,
            },
            ExpertWeights::SwiGlu { gate, up, down } => ExpertWeights::SwiGlu {
                gate: moved(gate)?,
                up: moved(up)?,
                down: moved(down)?,
            },
        })
    }

    /// The matrices in blob order.
    pub fn matrices(&self) -> Vec<&Tensor> {
        match self {
            ExpertWeights::Relu { wi, wo } => vec![wi, wo],
            ExpertWeights::SwiGlu { gate, up, down } => vec![gate, up, down],
        }
    }
}

/// How the model gets expert weights. Implementations decide where experts live.
pub trait ExpertProvider {
    /// Makes expert `id` ready and returns its weights.
    fn expert(&mut self, id: ExpertId) -> Result<ExpertWeights>;

    /// A new forward call starts: the encoder pass, or one decoder step (one new token per
    /// sequence).
    fn begin_step(&mut self, _stack: Stack) {}

    /// The router of block `block` of `stack` chose `experts`: `k` per token (highest weight
    /// first), tokens row-major, so `experts.len()` = tokens × `k`. Stale prefetches for this
    /// layer can go, and the next layer's experts can be prefetched.
    fn routed(&mut self, _stack: Stack, _block: usize, _k: usize, _experts: &[u16]) -> Result<()> {
        Ok(())
    }

    /// `id` is needed next in this layer: its read may start while the current expert computes.
    fn will_use(&mut self, _id: ExpertId) -> Result<()> {
        Ok(())
    }
}
