//! Running a model on text: one session type for every architecture ([`session`]) over the
//! user's input ([`input`]); what a decoding call is asked and returns ([`decoding`]); the loops —
//! greedy and beam search for encoder-decoders ([`seq2seq`]), prefill and streamed generation
//! for decoder-only models ([`causal`]) with seeded sampling ([`sampling`]); and the run
//! statistics ([`report`]).

pub mod causal;
pub mod decoding;
pub mod input;
pub mod report;
pub mod sampling;
pub mod seq2seq;
pub mod session;
