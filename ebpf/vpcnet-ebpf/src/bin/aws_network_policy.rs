//! The lab's reproduction of aws-node's network policy agent's IPv4
//! programs, so that the take-over from it is tested against programs that
//! enforce as it does: one object per pod identifier, its rule tries and
//! pod states, and the node-wide tracker pinned by name. Its NetworkPolicy
//! tier only (no cluster policy rules, no event ring buffer): a cluster
//! policy state other than "default allow" is read but never written here.
//!
//! A packet of a tracked flow passes while the pod's states are those it
//! was let through with; its replies pass on the reverse key whatever the
//! states. Otherwise the peer's longest prefix in the direction's trie
//! decides: a deny rule drops, a matching protocol and port allows, no
//! match drops. With no prefix at all, the pod state decides unless rules
//! are written. Every allow is tracked.

#![no_std]
#![no_main]

use aya_ebpf::{
    bindings::{BPF_F_NO_PREALLOC, TC_ACT_OK, TC_ACT_SHOT},
    helpers::bpf_ktime_get_ns,
    macros::{classifier, map},
    maps::{HashMap, LpmTrie, LruHashMap, lpm_trie::Key},
    programs::TcContext,
};
use vpcnet_common::aws_network_policy::{
    CONNTRACK_ENTRIES, ConntrackKey, ConntrackValue, DEFAULT_ALLOW, POD_STATE_CLUSTER_POLICY,
    POD_STATE_NETWORK_POLICY, PORT_RULES, PROTOCOL_ANY, PROTOCOL_DENY, PodState, RULE_TRIE_ENTRIES,
    TrieValue, conntrack_states,
};

#[map(name = "ingress_map")]
static INGRESS_RULES: LpmTrie<u32, TrieValue> =
    LpmTrie::with_max_entries(RULE_TRIE_ENTRIES, BPF_F_NO_PREALLOC);
#[map(name = "egress_map")]
static EGRESS_RULES: LpmTrie<u32, TrieValue> =
    LpmTrie::with_max_entries(RULE_TRIE_ENTRIES, BPF_F_NO_PREALLOC);
#[map(name = "ingress_pod_state_map")]
static INGRESS_STATE: HashMap<u32, PodState> = HashMap::with_max_entries(2, BPF_F_NO_PREALLOC);
#[map(name = "egress_pod_state_map")]
static EGRESS_STATE: HashMap<u32, PodState> = HashMap::with_max_entries(2, BPF_F_NO_PREALLOC);
/// Shared by every identifier's object: the loader pins it by name.
#[map(name = "global_aws_conntrack_map")]
static CONNTRACK: LruHashMap<ConntrackKey, ConntrackValue> =
    LruHashMap::pinned(CONNTRACK_ENTRIES, 0);

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const PROTO_TCP: u8 = 6;
const PROTO_UDP: u8 = 17;
const PROTO_SCTP: u8 = 132;

/// What reaches the pod: on its host veth's egress hook.
#[classifier]
pub fn handle_ingress(ctx: TcContext) -> i32 {
    judge(&ctx, Direction::ToPod).unwrap_or(TC_ACT_SHOT)
}

/// What the pod sends: on its host veth's ingress hook.
#[classifier]
pub fn handle_egress(ctx: TcContext) -> i32 {
    judge(&ctx, Direction::FromPod).unwrap_or(TC_ACT_SHOT)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToPod,
    FromPod,
}

#[inline(always)]
fn judge(ctx: &TcContext, direction: Direction) -> Result<i32, ()> {
    let ether_type = u16::from_be(ctx.load::<u16>(12).map_err(drop)?);
    if ether_type != ETH_P_IP {
        return Ok(TC_ACT_OK);
    }
    let version_ihl = ctx.load::<u8>(ETH_HLEN).map_err(drop)?;
    let protocol = ctx.load::<u8>(ETH_HLEN + 9).map_err(drop)?;
    let saddr = ctx.load::<u32>(ETH_HLEN + 12).map_err(drop)?;
    let daddr = ctx.load::<u32>(ETH_HLEN + 16).map_err(drop)?;
    let (mut src_port, mut dest_port) = (0, 0);
    if matches!(protocol, PROTO_TCP | PROTO_UDP | PROTO_SCTP) {
        let l4 = ETH_HLEN + usize::from(version_ihl & 0x0f) * 4;
        src_port = u16::from_be(ctx.load::<u16>(l4).map_err(drop)?);
        dest_port = u16::from_be(ctx.load::<u16>(l4 + 2).map_err(drop)?);
    }
    let (rules, states, owner, peer) = match direction {
        Direction::ToPod => (&INGRESS_RULES, &INGRESS_STATE, daddr, saddr),
        Direction::FromPod => (&EGRESS_RULES, &EGRESS_STATE, saddr, daddr),
    };
    // Either state missing: the agent has not set the pod up; it drops.
    let network_policy = state(states, POD_STATE_NETWORK_POLICY).ok_or(())?;
    let cluster_policy = state(states, POD_STATE_CLUSTER_POLICY).ok_or(())?;
    let key = ConntrackKey {
        src_ip: saddr,
        src_port,
        dest_ip: daddr,
        dest_port,
        protocol,
        owner_ip: owner,
        // SAFETY: the context's skb is valid for the program's run.
        ifindex: unsafe { (*ctx.skb.skb).ifindex },
        ..ConntrackKey::default()
    };
    let pair = conntrack_states(network_policy, cluster_policy);
    // SAFETY: the tracker's values are plain data; a racing update only
    // loses a refresh.
    let now = unsafe { bpf_ktime_get_ns() };
    if let Some(flow) = CONNTRACK.get_ptr_mut(key) {
        // SAFETY: as above.
        let flow = unsafe { &mut *flow };
        if flow.states == pair {
            flow.last_seen_ns = now;
            return Ok(TC_ACT_OK);
        }
        if !allows(rules, network_policy, peer, protocol, dest_port) {
            let _ = CONNTRACK.remove(key);
            return Ok(TC_ACT_SHOT);
        }
    } else if let Some(reply) = CONNTRACK.get_ptr_mut(key.reversed()) {
        // SAFETY: as above.
        unsafe { (*reply).last_seen_ns = now };
        return Ok(TC_ACT_OK);
    } else if !allows(rules, network_policy, peer, protocol, dest_port) {
        return Ok(TC_ACT_SHOT);
    }
    let flow = ConntrackValue {
        states: pair,
        last_seen_ns: now,
    };
    let _ = CONNTRACK.insert(key, flow, 0);
    Ok(TC_ACT_OK)
}

#[inline(always)]
fn state(states: &HashMap<u32, PodState>, key: u32) -> Option<u8> {
    // SAFETY: the value is plain data.
    unsafe { states.get(key) }.map(|s| s.state)
}

#[inline(always)]
fn allows(
    rules: &LpmTrie<u32, TrieValue>,
    network_policy: u8,
    peer: u32,
    protocol: u8,
    port: u16,
) -> bool {
    let Some(value) = rules.get(Key::new(32, peer)) else {
        // No prefix: the pod's default, unless its rules are written.
        return network_policy == DEFAULT_ALLOW;
    };
    let (protocol, port) = (u32::from(protocol), u32::from(port));
    for index in 0..PORT_RULES {
        let Some(rule) = value.rules.get(index) else {
            break;
        };
        if rule.protocol == PROTOCOL_DENY {
            return false;
        }
        let protocol_matches = rule.protocol == PROTOCOL_ANY || rule.protocol == protocol;
        let port_matches = rule.start_port == 0
            || port == rule.start_port
            || (rule.start_port < port && port <= rule.end_port);
        if protocol_matches && port_matches {
            return true;
        }
    }
    false
}

#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
