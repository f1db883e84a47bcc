//! The maps, named as `vpcnet_common::maps` says (the agent checks the names
//! against the object) and pinned by name so a restarted agent reuses them;
//! and a scratch map of the programs' own, which nobody else reads.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, PerCpuHashMap, RingBuf},
};
use vpcnet_common::{
    cidr::{CidrValue, ExternalServiceCidr},
    config::Config,
    counters::{COUNTER_SLOTS, Counter},
    endpoint::{Endpoint, Eni},
    maps::{
        CIDRS_MAX_ENTRIES, ENDPOINTS_MAX_ENTRIES, ENIS_MAX_ENTRIES,
        EXTERNAL_SERVICE_CIDRS_MAX_ENTRIES, FRAG_PATHS_MAX_ENTRIES, NAT_DEFAULT_ENTRIES,
        POLICY_CIDRS_MAX_ENTRIES, POLICY_FLOWS_DEFAULT_ENTRIES, POLICY_PODS_MAX_ENTRIES,
        POLICY_PORTS_MAX_ENTRIES, STACK_FLOWS_DEFAULT_ENTRIES,
    },
    nat::{FlowKey, FragKey, FragPath, NatEntry, RecentFlows, Timeouts},
    policy::{POLICY_EVENTS_BYTES, PodPolicy, PodVerdicts, PolicyFlow, PortSet, PortVerdict},
};

use crate::nat::ClaimSearch;

#[map(name = "VPCNET_CONFIG")]
pub static CONFIG: Array<Config> = Array::pinned(1, 0);

#[map(name = "VPCNET_CT_TIMEOUTS")]
pub static CT_TIMEOUTS: Array<Timeouts> = Array::pinned(1, 0);

#[map(name = "VPCNET_CIDRS")]
pub static CIDRS: LpmTrie<[u8; 4], CidrValue> = LpmTrie::pinned(CIDRS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_EXT_SERVICE_CIDRS")]
pub static EXTERNAL_SERVICE_CIDRS: LpmTrie<[u8; 4], ExternalServiceCidr> =
    LpmTrie::pinned(EXTERNAL_SERVICE_CIDRS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_NAT_FWD")]
pub static NAT_FWD: HashMap<FlowKey, NatEntry> = HashMap::pinned(NAT_DEFAULT_ENTRIES, 0);

#[map(name = "VPCNET_NAT_REV")]
pub static NAT_REV: HashMap<FlowKey, NatEntry> = HashMap::pinned(NAT_DEFAULT_ENTRIES, 0);

#[map(name = "VPCNET_FRAG_PATHS")]
pub static FRAG_PATHS: LruHashMap<FragKey, FragPath> =
    LruHashMap::pinned(FRAG_PATHS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_ENDPOINTS")]
pub static ENDPOINTS: HashMap<u32, Endpoint> = HashMap::pinned(ENDPOINTS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_ENIS")]
pub static ENIS: HashMap<u32, Eni> = HashMap::pinned(ENIS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_STACK_PAIRS")]
pub static STACK_FLOWS: HashMap<FlowKey, NatEntry> =
    HashMap::pinned(STACK_FLOWS_DEFAULT_ENTRIES, 0);

#[map(name = "VPCNET_POLICY_PODS")]
pub static POLICY_PODS: HashMap<u32, PodPolicy> = HashMap::pinned(POLICY_PODS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_POLICY_VERDICTS")]
pub static POLICY_VERDICTS: PerCpuHashMap<u32, PodVerdicts> =
    PerCpuHashMap::pinned(POLICY_PODS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_POLICY_CIDRS")]
pub static POLICY_CIDRS: LpmTrie<[u8; 8], PortSet> = LpmTrie::pinned(POLICY_CIDRS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_POLICY_PORTS")]
pub static POLICY_PORTS: LpmTrie<[u8; 8], PortVerdict> =
    LpmTrie::pinned(POLICY_PORTS_MAX_ENTRIES, 0);

#[map(name = "VPCNET_POLICY_FLOWS")]
pub static POLICY_FLOWS: LruHashMap<FlowKey, PolicyFlow> =
    LruHashMap::pinned(POLICY_FLOWS_DEFAULT_ENTRIES, 0);

#[map(name = "VPCNET_POLICY_EVENTS")]
pub static POLICY_EVENTS: RingBuf = RingBuf::with_byte_size(POLICY_EVENTS_BYTES, 0);

/// The NAT's port search, one slot per CPU (see `nat::ClaimSearch`). Not
/// pinned: it holds nothing between two packets.
#[map(name = "VPCNET_PORT_SEARCH")]
pub static PORT_SEARCH: PerCpuArray<ClaimSearch> = PerCpuArray::with_max_entries(1, 0);

/// The flows created last, for early drop (see `vpcnet_common::nat::RecentFlows`). Not
/// pinned: a hint, nothing is lost with it.
#[map(name = "VPCNET_RECENT_FLOWS")]
pub static RECENT_FLOWS: Array<RecentFlows> = Array::with_max_entries(1, 0);

/// The stack flows created last, for their early drop: their pod-side
/// tuples (see `stack::remember`). Not pinned, as [`RECENT_FLOWS`].
#[map(name = "VPCNET_RECENT_STACK")]
pub static RECENT_STACK_FLOWS: Array<RecentFlows> = Array::with_max_entries(1, 0);

#[map(name = "VPCNET_COUNTERS")]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::pinned(COUNTER_SLOTS, 0);

#[inline(always)]
pub fn count(counter: Counter) {
    count_n(counter, 1);
}

#[inline(always)]
pub fn count_n(counter: Counter, n: u64) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: a per-CPU slot; only this CPU writes it while the program runs.
        unsafe { *slot += n };
    }
}

#[inline(always)]
pub fn config() -> Option<&'static Config> {
    CONFIG.get(0)
}

/// The flow timeouts the agent set (zero fields: netfilter's defaults).
/// Always there: an array's one entry.
#[inline(always)]
pub fn timeouts() -> Option<&'static Timeouts> {
    CT_TIMEOUTS.get(0)
}

/// A local pod, copied out of the map.
#[inline(always)]
pub fn endpoint(addr: u32) -> Option<Endpoint> {
    endpoint_ref(addr).copied()
}

/// A local pod, in the map: no copy on the stack.
#[inline(always)]
pub fn endpoint_ref(addr: u32) -> Option<&'static Endpoint> {
    // SAFETY: read-only use of a map value.
    unsafe { ENDPOINTS.get(addr) }
}
