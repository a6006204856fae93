//! The expert cache's bookkeeping, shared by the live expert buffer and by trace replay so that
//! both take exactly the same decisions: which expert sits in which slot ([`table`]), which one
//! to evict ([`policy`]), the record of every access ([`trace`]) and its offline replay through
//! any policy and buffer size, with Belady's optimum as the upper bound ([`replay`]).

pub mod policy;
pub mod replay;
pub mod table;
pub mod trace;

pub use policy::{LayerMap, Policy, Seeds};
pub use table::{AccessContext, SlotTable};
pub use trace::{AccessKind, TraceEvent, TraceHeader};
