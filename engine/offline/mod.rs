//! Once-per-model work: [`convert`] a Hugging Face checkpoint into a bundle, [`calibrate`] the
//! path dictionary, choose per-expert bit widths ([`tune`], [`bit_plan`]), and measure quality
//! ([`eval`], [`rouge`] with its Porter stemmer in [`porter`]).

pub mod bit_plan;
pub mod calibrate;
pub mod convert;
pub mod eval;
pub mod porter;
pub mod rouge;
pub mod tune;
