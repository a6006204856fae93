//! Identifiers every layer shares: which stack of a model ([`Stack`]) and which expert of
//! which MoE block ([`ExpertId`]). A leaf: it imports nothing from the crate.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The two stacks of an encoder-decoder model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Stack {
    Encoder,
    Decoder,
}

impl Stack {
    pub fn hf_prefix(self) -> &'static str {
        match self {
            Stack::Encoder => "encoder",
            Stack::Decoder => "decoder",
        }
    }

    /// Index of the FF sub-layer inside an HF block (`layer.1` in the encoder, `layer.2` in the
    /// decoder, after the cross-attention).
    pub fn ff_sublayer(self) -> usize {
        match self {
            Stack::Encoder => 1,
            Stack::Decoder => 2,
        }
    }
}

/// One expert of one MoE block: `layer` is the block index inside its stack (HF numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ExpertId {
    pub stack: Stack,
    pub layer: u16,
    pub expert: u16,
}

impl fmt::Display for ExpertId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "expert {} of {} block {}",
            self.expert,
            self.stack.hf_prefix(),
            self.layer
        )
    }
}
