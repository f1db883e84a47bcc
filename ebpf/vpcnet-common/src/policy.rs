//! Network policy as the programs read it: each pod's policy identity per
//! direction, the rules of each identity as two tries (peer prefixes to a
//! port set, port sets to protocols and ports), and the connections policy
//! let through, so that their packets either way pass without the rules.
//!
//! A rule check costs two trie lookups whatever the number of policies,
//! rules, pods or ports: the agent flattens every rule of an identity into
//! disjoint answers (see `vpcnet_agent::policy::compile`).

use crate::nat::FlowKey;

/// `POLICY_PODS[pod address]`: which rules judge the pod's traffic. A pod
/// without an entry (or any address that is not a local pod) is judged by
/// no rule of its own. With policy on, the agent writes an entry for every
/// local pod before its CNI ADD returns.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodPolicy {
    /// The identity judging what reaches the pod, or [`POLICY_UNISOLATED`].
    pub ingress: u32,
    /// The identity judging what the pod sends, or [`POLICY_UNISOLATED`].
    pub egress: u32,
}

/// `POLICY_VERDICTS[pod address]`, per CPU: what policy decided for the
/// pod. A connection counts once, at its first packet; a denied packet
/// counts each time. The agent makes the entry with the pod's
/// [`PodPolicy`] and removes it with it; the programs only add.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodVerdicts {
    /// Connections to the pod its ingress rules allowed.
    pub ingress_allowed: u64,
    /// Packets to the pod its ingress rules denied.
    pub ingress_denied: u64,
    /// Connections from the pod its egress rules allowed.
    pub egress_allowed: u64,
    /// Packets from the pod its egress rules denied.
    pub egress_denied: u64,
}

impl PodVerdicts {
    /// `self` plus `other` (the sum over CPUs).
    #[must_use]
    pub const fn plus(self, other: Self) -> Self {
        Self {
            ingress_allowed: self.ingress_allowed.wrapping_add(other.ingress_allowed),
            ingress_denied: self.ingress_denied.wrapping_add(other.ingress_denied),
            egress_allowed: self.egress_allowed.wrapping_add(other.egress_allowed),
            egress_denied: self.egress_denied.wrapping_add(other.egress_denied),
        }
    }
}

/// The identity of a direction no policy isolates: everything passes.
pub const POLICY_UNISOLATED: u32 = 0;

/// Bits of a [`POLICY_CIDRS`](crate::maps::POLICY_CIDRS) key before the
/// peer's address: the identity. A peer prefix `/n` is a key of `32 + n`.
pub const POLICY_ID_BITS: u32 = 32;

/// Key data of `POLICY_CIDRS`: the identity (big-endian, so a prefix
/// length covers it first), then the peer's address as the packet carries
/// it (`addr`: network order read as a native integer).
#[must_use]
pub const fn cidr_key_data(identity: u32, addr: u32) -> [u8; 8] {
    let id = identity.to_be_bytes();
    let a = addr.to_ne_bytes();
    [id[0], id[1], id[2], id[3], a[0], a[1], a[2], a[3]]
}

/// Value of `POLICY_CIDRS`: the ports the peer prefix may use, as an index
/// into `POLICY_PORTS`. Port sets are shared by every prefix and identity
/// that allows the same ports.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortSet {
    pub id: u32,
}

/// Prefix lengths of a `POLICY_PORTS` key: every protocol and port, every
/// port of one protocol, one port. A port range is covered by prefixes in
/// between (at most 30 of them).
pub const PORTS_ANY_PROTOCOL: u32 = 32;
pub const PORTS_ALL_OF_PROTOCOL: u32 = 40;
pub const PORTS_ONE: u32 = 56;

/// Key data of `POLICY_PORTS`: the port set (big-endian), the IP protocol,
/// the port (`port`: network order, as the packet carries it), and a byte
/// no prefix reaches.
#[must_use]
pub const fn port_key_data(set: u32, proto: u8, port: u16) -> [u8; 8] {
    let s = set.to_be_bytes();
    let p = port.to_ne_bytes();
    [s[0], s[1], s[2], s[3], proto, p[0], p[1], 0]
}

/// Value of `POLICY_PORTS`: the verdict for the ports the entry covers,
/// and the tier that gave it (for the event log). No entry: denied, by
/// the NetworkPolicy tier. An entry that denies is one a cluster policy
/// (or the NetworkPolicy tier under it) carves out of a shorter one that
/// allows.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortVerdict {
    /// [`PORT_ALLOWED`] or [`PORT_DENIED`].
    pub verdict: u8,
    /// `TIER_*`.
    pub tier: u8,
    pub _pad: u16,
}

/// Values of [`PortVerdict::verdict`]. (Entries written before there were
/// denying ones read as allowed, by the NetworkPolicy tier.)
pub const PORT_ALLOWED: u8 = 1;
pub const PORT_DENIED: u8 = 2;

/// `POLICY_FLOWS[flow]`: a connection policy let through, keyed by its
/// [`flow_key`]. Its packets either way pass without the rules until it
/// stays idle longer than its protocol's timeout; the agent removes the
/// ones a policy change newly denies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyFlow {
    /// When a packet of the flow was last seen (`bpf_ktime_get_ns`),
    /// refreshed at most every [`POLICY_FLOW_REFRESH_NS`].
    pub last_seen_ns: u64,
    /// [`OPENED_BY_KEY_SOURCE`] or [`OPENED_BY_KEY_DESTINATION`]: which end
    /// of the key opened the connection (whose egress and whose ingress
    /// judged it).
    pub opener: u8,
    /// [`FLOW_REVOKED`]: a policy change denies the connection; its packets
    /// are dropped until it is opened again (a SYN, judged afresh) or stays
    /// idle past its timeout. Without this mark a TCP connection would be
    /// picked up again as opened by its other end.
    pub revoked: u8,
    pub _pad2: u16,
    pub _pad3: u32,
}

pub const OPENED_BY_KEY_SOURCE: u8 = 0;
pub const OPENED_BY_KEY_DESTINATION: u8 = 1;
pub const FLOW_REVOKED: u8 = 1;

/// How often a flow's `last_seen_ns` is written: not every packet, so that
/// CPUs sending one flow's packets do not fight over its cache line.
pub const POLICY_FLOW_REFRESH_NS: u64 = 1_000_000_000;

/// The key of a connection in `POLICY_FLOWS`, the same for its packets
/// either way: the tuple as sent by the end with the lower (address, port),
/// and whether `key` is the other way round.
#[must_use]
pub const fn flow_key(key: &FlowKey) -> (FlowKey, bool) {
    let reversed = key.saddr > key.daddr || (key.saddr == key.daddr && key.sport > key.dport);
    if reversed {
        (key.reversed(), true)
    } else {
        (*key, false)
    }
}

/// A verdict of policy, as `ENABLE_POLICY_EVENT_LOGS` logs it: one record
/// of the `POLICY_EVENTS` ring buffer per judged side of a new connection
/// and per dropped packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PolicyEvent {
    /// The packet's tuple (network order).
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// [`VERDICT_ACCEPT`] or [`VERDICT_DENY`].
    pub verdict: u8,
    /// [`DIRECTION_INGRESS`] or [`DIRECTION_EGRESS`]: whose rules judged.
    pub direction: u8,
    /// The tier that decided: `TIER_*`.
    pub tier: u8,
}

pub const VERDICT_ACCEPT: u8 = 0;
pub const VERDICT_DENY: u8 = 1;
pub const DIRECTION_INGRESS: u8 = 0;
pub const DIRECTION_EGRESS: u8 = 1;
/// Tiers of a verdict: NetworkPolicy; no rule (no policy isolates the
/// direction, or the enforcing mode's default); a cluster policy's Admin
/// or Baseline tier.
pub const TIER_NETWORK_POLICY: u8 = 0;
pub const TIER_DEFAULT: u8 = 1;
pub const TIER_ADMIN: u8 = 2;
pub const TIER_BASELINE: u8 = 3;

/// Bytes of the `POLICY_EVENTS` ring buffer: 16 Ki events. When the agent
/// falls behind, events are lost (counted), never waited for.
pub const POLICY_EVENTS_BYTES: u32 = 1 << 20;

crate::impl_pod!(
    PodPolicy,
    PodVerdicts,
    PortSet,
    PortVerdict,
    PolicyFlow,
    PolicyEvent
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_directions_of_a_flow_share_one_key() {
        let out = FlowKey::new(5, 9, 40000, 80, 6);
        let (a, a_reversed) = flow_key(&out);
        let (b, b_reversed) = flow_key(&out.reversed());
        assert_eq!(a, b);
        assert_ne!(a_reversed, b_reversed);
    }

    #[test]
    fn a_prefix_length_covers_the_identity_before_the_peer() {
        let data = cidr_key_data(0x0102_0304, u32::from_ne_bytes([10, 20, 0, 1]));
        assert_eq!(data, [1, 2, 3, 4, 10, 20, 0, 1]);
        let data = port_key_data(7, 6, 80u16.to_be());
        assert_eq!(data, [0, 0, 0, 7, 6, 0, 80, 0]);
    }
}
