//! The memory budget: dividing it between resident weights, working memory and the expert
//! buffer's slots.
//!
//! `budget = resident weights + working memory + slots × slot bytes`. Working memory is the
//! model's estimate of its own activations for the longest run the options allow
//! (`Model::working_bytes`: KV caches, attention scores, expert scratch, logits); libtorch's
//! allocator and the process image are not counted, and `peak_rss_bytes` in the statistics
//! shows what the whole process used.

use crate::error::{Error, Result};

/// How a budget is split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetPlan {
    pub budget_bytes: u64,
    pub resident_bytes: u64,
    pub working_bytes: u64,
    pub slot_bytes: u64,
    pub slots: usize,
}

impl BudgetPlan {
    /// Fits as many slots as the budget allows, but no more than there are experts; or exactly
    /// `requested_slots` if given (an error if the budget cannot hold them).
    pub fn new(
        budget_bytes: u64,
        resident_bytes: u64,
        working_bytes: u64,
        slot_bytes: u64,
        total_experts: usize,
        requested_slots: Option<usize>,
    ) -> Result<Self> {
        // More slots than experts hold nothing more: a requested size is capped at the expert
        // count (so a huge `--buffer-experts` sizes no huge buffer).
        let requested_slots = requested_slots.map(|n| n.clamp(1, total_experts.max(1)));
        let need = requested_slots.unwrap_or(1);
        // Saturating: huge estimates (a huge `--max-new-tokens`) report a budget too small.
        let minimum_bytes = resident_bytes
            .saturating_add(working_bytes)
            .saturating_add((need as u64).saturating_mul(slot_bytes));
        // A saturated minimum is no real number of bytes: no budget holds it.
        if budget_bytes < minimum_bytes || minimum_bytes == u64::MAX || slot_bytes == 0 {
            return Err(Error::BudgetTooSmall {
                budget_bytes,
                resident_bytes,
                working_bytes,
                slot_bytes,
                slots: need,
                minimum_bytes,
            });
        }
        let free = budget_bytes - resident_bytes - working_bytes;
        let slots = match requested_slots {
            Some(n) => n,
            None => ((free / slot_bytes) as usize).clamp(1, total_experts.max(1)),
        };
        Ok(BudgetPlan {
            budget_bytes,
            resident_bytes,
            working_bytes,
            slot_bytes,
            slots,
        })
    }

    pub fn buffer_bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_fits_slots_and_reports_minimum() {
        let plan = BudgetPlan::new(10_000, 4_000, 1_000, 1_000, 64, None).unwrap();
        assert_eq!(plan.slots, 5);
        assert_eq!(plan.buffer_bytes(), 5_000);
        let capped = BudgetPlan::new(1_000_000, 4_000, 1_000, 1_000, 3, None).unwrap();
        assert_eq!(capped.slots, 3);
        match BudgetPlan::new(5_999, 4_000, 1_000, 1_000, 64, None) {
            Err(Error::BudgetTooSmall { minimum_bytes, .. }) => assert_eq!(minimum_bytes, 6_000),
            other => panic!("expected BudgetTooSmall, got {other:?}"),
        }
        let exact = BudgetPlan::new(10_000, 4_000, 1_000, 1_000, 64, Some(3)).unwrap();
        assert_eq!(exact.slots, 3);
        match BudgetPlan::new(10_000, 4_000, 1_000, 1_000, 64, Some(6)) {
            Err(Error::BudgetTooSmall {
                minimum_bytes,
                slots,
                ..
            }) => {
                assert_eq!((minimum_bytes, slots), (11_000, 6))
            }
            other => panic!("expected BudgetTooSmall, got {other:?}"),
        }
    }

    #[test]
    fn huge_numbers_are_capped_or_refused_without_overflow() {
        // A requested size above the expert count is the expert count.
        let plan = BudgetPlan::new(u64::MAX, 0, 0, 1_000, 64, Some(usize::MAX)).unwrap();
        assert_eq!(plan.slots, 64);
        // A huge working-memory estimate is a budget error, not a wrapped sum.
        match BudgetPlan::new(10_000, 4_000, u64::MAX, 1_000, 64, None) {
            Err(Error::BudgetTooSmall { minimum_bytes, .. }) => {
                assert_eq!(minimum_bytes, u64::MAX)
            }
            other => panic!("expected BudgetTooSmall, got {other:?}"),
        }
        assert!(
            BudgetPlan::new(u64::MAX - 1, u64::MAX / 2, u64::MAX / 2, u64::MAX, 4, None).is_err()
        );
        assert!(BudgetPlan::new(u64::MAX, 1, u64::MAX, 1, 4, None).is_err());
    }
}
