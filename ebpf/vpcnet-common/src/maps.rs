//! Map names, the layout of each pinned map (its pin is named after both,
//! see [`PinnedMap`]) and default sizes.
//!
//! The programs crate names its maps with these same strings; the agent
//! refuses an object that lacks one of [`ALL`].

/// Where the agent pins maps and links by default.
pub const PIN_DIR: &str = "/sys/fs/bpf/vpcnet";
/// The subdirectory of the pin directory holding the programs' tc links:
/// `<ifindex>-<ifname>/<program>`. A pinned link keeps its program attached
/// while no agent runs, and the next agent swaps its own program in.
pub const LINKS_DIR: &str = "links";
/// The subdirectory of [`LINKS_DIR`] holding the loaded programs of each
/// object: `programs/<digest>/<program>`, which a restart with the same
/// object keeps rather than verifying them again. Not an
/// `<ifindex>-<ifname>`, so an earlier version removes it.
pub const PROGRAMS_DIR: &str = "programs";

/// `Array<Config>`, one entry: the flags read per packet.
pub const CONFIG: &str = "VPCNET_CONFIG";
/// `LpmTrie<[u8; 4], CidrKind>`: VPC, excluded and node-local prefixes.
pub const CIDRS: &str = "VPCNET_CIDRS";
/// `HashMap<FlowKey, NatEntry>`: flows as they leave, keyed by the original tuple.
pub const NAT_FWD: &str = "VPCNET_NAT_FWD";
/// `HashMap<FlowKey, NatEntry>`: the same flows as replies arrive; the port claim.
pub const NAT_REV: &str = "VPCNET_NAT_REV";
/// `Array<Timeouts>`, one entry: how long flows live in each state
/// (netfilter's conntrack timeouts, as the node sets them).
pub const CT_TIMEOUTS: &str = "VPCNET_CT_TIMEOUTS";
/// `LruHashMap<FragKey, FragPath>`: where the first fragment of each
/// fragmented datagram in flight went, for its later fragments.
pub const FRAG_PATHS: &str = "VPCNET_FRAG_PATHS";
/// `PerCpuArray<u64>` indexed by [`crate::counters::Counter`].
pub const COUNTERS: &str = "VPCNET_COUNTERS";
/// `HashMap<u32 (pod address), Endpoint>`: the pods on this node.
pub const ENDPOINTS: &str = "VPCNET_ENDPOINTS";
/// `HashMap<u32 (link ifindex), Eni>`: the node's ENIs and branch links.
pub const ENIS: &str = "VPCNET_ENIS";
/// `LpmTrie<[u8; 4], ExternalServiceCidr>`: `AWS_EXTERNAL_SERVICE_CIDRS`. A
/// packet from a pod on a secondary ENI to one of them takes the node's
/// route (the main table: the primary ENI), not its own ENI, as aws-node's
/// `to <cidr> lookup main` rule (priority 1535, before the pods' 1536) sends
/// it; a trie of its own, as it may overlap the VPC's or excluded CIDRs.
pub const EXTERNAL_SERVICE_CIDRS: &str = "VPCNET_EXT_SERVICE_CIDRS";
/// `HashMap<FlowKey, NatEntry>`: flows whose packets must go through the
/// node's stack (kube-proxy's DNAT and un-DNAT, the node's own sockets),
/// each a pair like a NAT flow's: keyed by the pod's tuple (the pod's
/// packets, which `pod_egress` hands to the stack) and by its reverse (the
/// packets toward the pod, which `eni_ingress` hands to the stack), with
/// the pod's address and port in both; a pair lives as long as conntrack
/// keeps the connection (see `nat::flow_expired`).
pub const STACK_FLOWS: &str = "VPCNET_STACK_PAIRS";
/// `HashMap<u32 (pod address), PodPolicy>`: each local pod's policy
/// identities (see [`crate::policy`]).
pub const POLICY_PODS: &str = "VPCNET_POLICY_PODS";
/// `PerCpuHashMap<u32 (pod address), PodVerdicts>`: what policy decided
/// for each local pod under it.
pub const POLICY_VERDICTS: &str = "VPCNET_POLICY_VERDICTS";
/// `LpmTrie<[u8; 8] (identity, peer address), PortSet>`: the peer prefixes
/// of each identity, and the port set that answers for each.
pub const POLICY_CIDRS: &str = "VPCNET_POLICY_CIDRS";
/// `LpmTrie<[u8; 8] (port set, protocol, port), PortVerdict>`.
pub const POLICY_PORTS: &str = "VPCNET_POLICY_PORTS";
/// `LruHashMap<FlowKey, PolicyFlow>`: connections policy let through.
pub const POLICY_FLOWS: &str = "VPCNET_POLICY_FLOWS";
/// `RingBuf` of `PolicyEvent`s, for `ENABLE_POLICY_EVENT_LOGS`. Not
/// pinned: each agent reads the one its programs write.
pub const POLICY_EVENTS: &str = "VPCNET_POLICY_EVENTS";
/// `Array<RecentFlows>` of one: the NAT flows created last, which a full
/// NAT map's early drop chooses from (see `nat::RecentFlows`). Not pinned:
/// a restarted agent's programs start a ring of their own.
pub const RECENT_FLOWS: &str = "VPCNET_RECENT_FLOWS";
/// `Array<RecentFlows>` of one: the stack flows created last, as
/// [`RECENT_FLOWS`] for the stack flows map.
pub const RECENT_STACK_FLOWS: &str = "VPCNET_RECENT_STACK";
/// A pinned map and the layout of its entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedMap {
    pub name: &'static str,
    /// Bumped whenever the map's key, its value or what an entry means
    /// changes, so that no agent reads a map another version wrote
    /// differently (a change of size alone, such as appended counters or
    /// another `--nat-entries`, is no new layout). Layout 1 is what the
    /// releases before versioned pins wrote, pinned by bare name.
    pub layout: u16,
}

const fn pinned(name: &'static str, layout: u16) -> PinnedMap {
    PinnedMap { name, layout }
}

/// Every pinned map with its layout, for loading, clean-up and the object
/// check.
pub const ALL: [PinnedMap; 16] = [
    // 2: the mark bits appended.
    pinned(CONFIG, 2),
    // 2: netfilter's other TCP timeouts appended.
    pinned(CT_TIMEOUTS, 2),
    pinned(CIDRS, 1),
    // 2: flows kept untranslated are pairs (layout 1: a forward entry alone).
    // 3: TCP sequence tracking appended to each entry.
    pinned(NAT_FWD, 3),
    pinned(NAT_REV, 3),
    pinned(FRAG_PATHS, 1),
    // 2: `drop_inbound_untracked`'s index counted passes in layout 1
    // (`ingress_inbound_untracked`).
    pinned(COUNTERS, 2),
    pinned(ENDPOINTS, 1),
    pinned(ENIS, 1),
    // 2: TCP sequence tracking appended to each entry.
    pinned(STACK_FLOWS, 2),
    pinned(EXTERNAL_SERVICE_CIDRS, 1),
    pinned(POLICY_PODS, 1),
    pinned(POLICY_CIDRS, 1),
    pinned(POLICY_PORTS, 1),
    pinned(POLICY_FLOWS, 1),
    pinned(POLICY_VERDICTS, 1),
];

/// Maps whose values grew by appended fields: the size of their values in
/// the layouts before, a prefix of today's, which the agent carries with
/// the new fields zero (TCP numbers unknown, netfilter's default timeouts).
pub const WIDENED: [(&str, usize); 5] = [
    (CONFIG, crate::config::CONFIG_LAYOUT1_SIZE),
    (NAT_FWD, crate::nat::NAT_ENTRY_UNTRACKED_SIZE),
    (NAT_REV, crate::nat::NAT_ENTRY_UNTRACKED_SIZE),
    (STACK_FLOWS, crate::nat::NAT_ENTRY_UNTRACKED_SIZE),
    (CT_TIMEOUTS, crate::nat::TIMEOUTS_LAYOUT1_SIZE),
];

/// The value size `name`'s layouts before its own had, when smaller.
#[must_use]
pub fn widened_from(name: &str) -> Option<usize> {
    WIDENED
        .iter()
        .find(|(widened, _)| *widened == name)
        .map(|(_, size)| *size)
}

/// Maps earlier versions pinned that this one no longer uses: removed at
/// load and by clean-up. (`VPCNET_FRAGS` held only the ports of
/// fragmented datagrams in flight; [`STACK_FLOWS_LRU`]'s flows are carried
/// into [`STACK_FLOWS`] first.)
pub const RETIRED: [&str; 2] = ["VPCNET_FRAGS", STACK_FLOWS_LRU];

/// `LruHashMap<FlowKey, u64>`, before [`STACK_FLOWS`]: stack flows as
/// single tuples, either way round, evicted when newer ones came.
pub const STACK_FLOWS_LRU: &str = "VPCNET_STACK_FLOWS";

/// Default number of flows each NAT map holds (both maps have the same size:
/// a pair is one entry in each).
pub const NAT_DEFAULT_ENTRIES: u32 = 262_144;
/// Prefixes the CIDR trie holds (VPC CIDRs, exclusions, node addresses).
pub const CIDRS_MAX_ENTRIES: u32 = 16_384;
/// Prefixes the external service trie holds.
pub const EXTERNAL_SERVICE_CIDRS_MAX_ENTRIES: u32 = 1_024;
/// Fragmented datagrams in flight whose first fragment's path is remembered.
pub const FRAG_PATHS_MAX_ENTRIES: u32 = 8_192;
/// Pods on one node (an EKS node's max pods is far below).
pub const ENDPOINTS_MAX_ENTRIES: u32 = 16_384;
/// ENIs and branch links on one node.
pub const ENIS_MAX_ENTRIES: u32 = 1_024;
/// Flows created last, across CPUs: when a NAT map is full, the oldest
/// unanswered one among them is dropped to make room, as conntrack's early
/// drop does, so a flood of unanswered flows never keeps new flows out.
pub const RECENT_FLOWS_LEN: u32 = 64;
/// Default number of entries of the stack flows map: two per flow, so
/// 131072 flows through the stack at once.
pub const STACK_FLOWS_DEFAULT_ENTRIES: u32 = 262_144;

/// Pods with a policy entry on one node.
pub const POLICY_PODS_MAX_ENTRIES: u32 = ENDPOINTS_MAX_ENTRIES;
/// Peer prefixes across every policy identity of a node.
pub const POLICY_CIDRS_MAX_ENTRIES: u32 = 65_536;
/// Port prefixes across every port set of a node.
pub const POLICY_PORTS_MAX_ENTRIES: u32 = 65_536;
/// Connections policy let through, tracked at once (as conntrack's
/// default maximum); the least recently used gives way.
pub const POLICY_FLOWS_DEFAULT_ENTRIES: u32 = 262_144;

/// The tc programs, by function name in the object.
pub const PROG_ENI_EGRESS: &str = "eni_egress";
pub const PROG_ENI_INGRESS: &str = "eni_ingress";
/// tc ingress of a pod's host veth: what the pod sends.
pub const PROG_POD_EGRESS: &str = "pod_egress";
/// tc egress of a pod's host veth: what the stack sends the pod.
pub const PROG_POD_INGRESS: &str = "pod_ingress";
