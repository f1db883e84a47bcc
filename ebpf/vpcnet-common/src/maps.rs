//! Map names (also their pin names under the pin directory) and default sizes.
//!
//! The programs crate names its maps with these same strings; the agent's
//! tests check that every name here exists in the built object.

/// Where the agent pins maps (and later links) by default.
pub const PIN_DIR: &str = "/sys/fs/bpf/vpcnet";

/// `Array<Config>`, one entry: the flags read per packet.
pub const CONFIG: &str = "VPCNET_CONFIG";
/// `LpmTrie<[u8; 4], CidrKind>`: VPC, excluded and node-local prefixes.
pub const CIDRS: &str = "VPCNET_CIDRS";
/// `HashMap<FlowKey, NatEntry>`: flows as they leave, keyed by the original tuple.
pub const NAT_FWD: &str = "VPCNET_NAT_FWD";
/// `HashMap<FlowKey, NatEntry>`: the same flows as replies arrive; the port claim.
pub const NAT_REV: &str = "VPCNET_NAT_REV";
/// `LruHashMap<FragKey, FragPorts>`: ports of fragmented datagrams.
pub const FRAGS: &str = "VPCNET_FRAGS";
/// `PerCpuArray<u64>` indexed by [`crate::counters::Counter`].
pub const COUNTERS: &str = "VPCNET_COUNTERS";

/// Every pinned map, for clean-up and for the object check.
pub const ALL: [&str; 6] = [CONFIG, CIDRS, NAT_FWD, NAT_REV, FRAGS, COUNTERS];

/// Default number of flows each NAT map holds (both maps have the same size:
/// a pair is one entry in each).
pub const NAT_DEFAULT_ENTRIES: u32 = 262_144;
/// Prefixes the CIDR trie holds (VPC CIDRs, exclusions, node addresses).
pub const CIDRS_MAX_ENTRIES: u32 = 16_384;
/// Fragmented datagrams in flight whose ports are remembered.
pub const FRAGS_MAX_ENTRIES: u32 = 8_192;

/// The tc programs, by function name in the object.
pub const PROG_ENI_EGRESS: &str = "eni_egress";
pub const PROG_ENI_INGRESS: &str = "eni_ingress";
