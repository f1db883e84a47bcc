//! aws-node's network policy agent (`aws-eks-nodeagent`,
//! aws-network-policy-agent) as it leaves a node, IPv4: where it pins its
//! programs and maps, how it attaches them, and its maps' layouts. vpcnet
//! reads them to take the enforcement over without a gap and to hand it
//! back; the lab reproduces the agent's programs with them.
//!
//! The agent loads one program pair and one set of maps per pod
//! identifier (the pods of one ReplicaSet share them) and attaches them to
//! each pod's host veth: the pod's ingress rules on the veth's clsact
//! egress hook, its egress rules on the ingress hook.

/// Where the agent pins: programs in [`PROGRAMS`], maps in [`MAPS`].
pub const PINS_ROOT: &str = "/sys/fs/bpf/globals/aws";
/// The programs' directory in the root: `<pod identifier>_<program>`.
pub const PROGRAMS: &str = "programs";
/// The maps' directory in the root: `<pod identifier>_<map>`, and the
/// node-wide ones as `global_<map>`.
pub const MAPS: &str = "maps";

/// The program judging what reaches the pod (on the veth's egress hook).
pub const INGRESS_PROGRAM: &str = "handle_ingress";
/// The program judging what the pod sends (on the veth's ingress hook).
pub const EGRESS_PROGRAM: &str = "handle_egress";
/// The `cls_bpf` filter both programs sit in: named as the program,
/// direct-action, every protocol.
pub const FILTER_PRIORITY: u16 = 1;
pub const FILTER_HANDLE: u16 = 1;

/// The per-identifier maps, by the program that reads them.
pub const INGRESS_MAP: &str = "ingress_map";
pub const EGRESS_MAP: &str = "egress_map";
pub const INGRESS_POD_STATE_MAP: &str = "ingress_pod_state_map";
pub const EGRESS_POD_STATE_MAP: &str = "egress_pod_state_map";
/// The node-wide connection tracker every program shares.
pub const CONNTRACK_MAP: &str = "global_aws_conntrack_map";
/// Entries of the tracker (`--conntrack-cache-table-size`'s default).
pub const CONNTRACK_ENTRIES: u32 = 512 * 1024;
/// Entries of a rule trie. Its key is a peer prefix: the prefix length
/// (`u32`), then the address in network order, as aya's `lpm_trie::Key`.
pub const RULE_TRIE_ENTRIES: u32 = 65_536;

/// One protocol and port range a peer prefix may use (ports in host
/// order; `start_port` 0 is every port, `end_port` 0 is `start_port`
/// alone).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortRule {
    pub protocol: u32,
    pub start_port: u32,
    pub end_port: u32,
}

/// How many [`PortRule`]s a prefix holds (the agent's 24-port limit).
pub const PORT_RULES: usize = 24;

/// A rule trie's value. Unused rules are all zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrieValue {
    pub rules: [PortRule; PORT_RULES],
}

/// [`PortRule::protocol`]: every protocol.
pub const PROTOCOL_ANY: u32 = 254;
/// [`PortRule::protocol`]: the prefix is denied (an `except`).
pub const PROTOCOL_DENY: u32 = 255;

/// A pod state map's value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PodState {
    pub state: u8,
}

/// Pod state keys: the NetworkPolicy tier's, the cluster policy tier's.
pub const POD_STATE_NETWORK_POLICY: u32 = 0;
pub const POD_STATE_CLUSTER_POLICY: u32 = 1;
/// Pod states: rules are written (a miss denies); no rule yet, allow; no
/// rule yet, deny (strict mode).
pub const POLICIES_APPLIED: u8 = 0;
pub const DEFAULT_ALLOW: u8 = 1;
pub const DEFAULT_DENY: u8 = 2;

/// The tracker's key: a packet's tuple (addresses in network order, ports
/// in host order), the pod whose rules let it through and its host veth.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConntrackKey {
    pub src_ip: u32,
    pub src_port: u16,
    pub _pad1: u16,
    pub dest_ip: u32,
    pub dest_port: u16,
    pub protocol: u8,
    pub _pad2: u8,
    pub owner_ip: u32,
    pub ifindex: u32,
}

impl ConntrackKey {
    /// The key of the packets the other way (same owner and veth).
    #[must_use]
    pub const fn reversed(&self) -> Self {
        Self {
            src_ip: self.dest_ip,
            src_port: self.dest_port,
            dest_ip: self.src_ip,
            dest_port: self.src_port,
            ..*self
        }
    }
}

/// The tracker's value: the pod's states when the flow was let through
/// ([`conntrack_states`]) and when a packet of it was last seen
/// (monotonic ns).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConntrackValue {
    pub states: u64,
    pub last_seen_ns: u64,
}

/// [`ConntrackValue::states`] of a pod's NetworkPolicy and cluster policy
/// states. A flow whose states changed since is judged again.
#[must_use]
pub const fn conntrack_states(network_policy: u8, cluster_policy: u8) -> u64 {
    match (network_policy, cluster_policy) {
        (DEFAULT_ALLOW, DEFAULT_ALLOW) => 2,
        (DEFAULT_ALLOW, DEFAULT_DENY) => 3,
        (DEFAULT_ALLOW, POLICIES_APPLIED) => 4,
        (POLICIES_APPLIED, DEFAULT_ALLOW) => 5,
        (POLICIES_APPLIED, DEFAULT_DENY) => 6,
        _ => 7,
    }
}

crate::impl_pod!(PortRule, TrieValue, PodState, ConntrackKey, ConntrackValue);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_the_agents_sizes() {
        assert_eq!(size_of::<TrieValue>(), 288);
        assert_eq!(size_of::<ConntrackKey>(), 24);
        assert_eq!(size_of::<ConntrackValue>(), 16);
    }
}
