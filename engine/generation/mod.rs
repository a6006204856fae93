//! Running a model on text: one session type for every architecture ([`session`]), encoder-
//! decoder decoding — greedy and beam search ([`seq2seq`]), decoder-only prefill and streamed
//! generation ([`causal`]) with sampling ([`sampling`]), and the run statistics ([`report`]).

pub mod causal;
pub mod report;
pub mod sampling;
pub mod seq2seq;
pub mod session;
