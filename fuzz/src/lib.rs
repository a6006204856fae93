//! The fuzz targets' shared code: the harness (one function per parser, also replayed by the
//! engine's `tests/fuzz_corpus.rs`) and an allocator that turns an unbounded allocation into a
//! crash AFL++ records ([`limit`]).

pub mod harness;
pub mod limit;

#[global_allocator]
static ALLOCATOR: limit::LimitedAlloc = limit::LimitedAlloc;
