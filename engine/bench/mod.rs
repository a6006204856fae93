//! Measurement: the modes × budgets matrix run in child processes ([`matrix`]) and what it found
//! ([`report`]), charts ([`charts`]), and the storage probe that writes a board's profile
//! ([`probe`]).

pub mod charts;
pub mod matrix;
pub mod probe;
pub mod report;
