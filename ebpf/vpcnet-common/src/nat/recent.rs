//! The ring of the flows created last, which a full table's early drop
//! chooses its victim from.

use super::FlowKey;
use crate::maps::RECENT_FLOWS_LEN;

/// The flows created last, whichever CPU created them: a ring of their
/// keys (a NAT flow's claim, a stack flow's pod-side tuple), `next` the
/// slot the next one takes, which holds the oldest. When a table is full,
/// the programs drop the oldest of them still unanswered, as conntrack's
/// early drop does: a flood of flows nobody answers (a SYN flood through an
/// NLB, a pod retrying a black-holed endpoint) fills the ring, so its own
/// flows make way and established flows are never touched. A slot whose
/// flow was dropped has its protocol zeroed.
///
/// Two CPUs may write the same slot at once: a torn key matches no flow
/// and is skipped, a lost increment overwrites one slot twice.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecentFlows {
    pub next: u32,
    pub _pad: u32,
    pub keys: [FlowKey; RECENT_FLOWS_LEN as usize],
}

impl RecentFlows {
    /// The ring as a new map holds it: every slot empty.
    pub const EMPTY: Self = Self {
        next: 0,
        _pad: 0,
        keys: [FlowKey {
            saddr: 0,
            daddr: 0,
            sport: 0,
            dport: 0,
            proto: 0,
            _pad1: 0,
            _pad2: 0,
        }; RECENT_FLOWS_LEN as usize],
    };

    /// The slot the key numbered `n` (counting from any point) takes.
    #[must_use]
    pub const fn slot(n: u32) -> usize {
        (n & (RECENT_FLOWS_LEN - 1)) as usize
    }
}

const _: () = assert!(RECENT_FLOWS_LEN.is_power_of_two());

crate::impl_pod!(RecentFlows);
