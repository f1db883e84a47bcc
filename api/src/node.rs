//! What the agent and the lab agree on about the Node: the taint that says
//! it is cordoned, which the Node's follower reads and the address manager
//! names in what it tells operators.

/// The taint of a cordoned node (`kubectl cordon`'s, with `NoSchedule`).
pub const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";
