//! Network policy, on every way a packet reaches a local pod or leaves one:
//! the sender's egress rules and the receiver's ingress rules, for the
//! first packet of a connection; its later packets, either way, pass on the
//! connection's entry in `POLICY_FLOWS`.
//!
//! Why a tracker of its own: vpcnet's other flow tables hold only what is
//! translated or goes through the stack, while policy must also know the
//! pod-to-pod and in-VPC connections that are neither.

use aya_ebpf::{maps::lpm_trie::Key, programs::TcContext};
use vpcnet_common::{
    cidr::CidrKind,
    config::Config,
    counters::Counter,
    nat::{DEFAULT_TIMEOUTS, FlowKey, FlowState, PROTO_ICMP, PROTO_TCP},
    policy::{
        DIRECTION_EGRESS, DIRECTION_INGRESS, FLOW_REVOKED, OPENED_BY_KEY_DESTINATION,
        OPENED_BY_KEY_SOURCE, POLICY_FLOW_REFRESH_NS, POLICY_ID_BITS, POLICY_UNISOLATED,
        PORT_ALLOWED, PORTS_ONE, PodPolicy, PodVerdicts, PolicyEvent, PolicyFlow, PortVerdict,
        TIER_DEFAULT, TIER_NETWORK_POLICY, VERDICT_ACCEPT, VERDICT_DENY, cidr_key_data, flow_key,
        port_key_data,
    },
};

use crate::{
    cidr, icmp,
    maps::{
        POLICY_CIDRS, POLICY_EVENTS, POLICY_FLOWS, POLICY_PODS, POLICY_PORTS, POLICY_VERDICTS,
        count, timeouts,
    },
    nat::now_ns,
    packet::{ETH_HLEN, Fragment, Ipv4, L4, is_ipv4, load, parse_ipv4, parse_l4},
};

const PROTO_SCTP: u8 = 132;

/// A packet as policy sees it: its tuple (ports for TCP, UDP and SCTP),
/// whether it opens a connection whatever is known of it (a TCP SYN), and
/// its ICMP type.
struct Packet {
    key: FlowKey,
    syn: bool,
    icmp_type: u8,
}

/// The packet whose headers are `ip` and `l4` (what [`parse_l4`] read) as
/// policy sees it; `None` for what policy leaves alone: a later fragment
/// (it follows its first fragment, which was judged).
#[inline(always)]
fn packet_of(ctx: &TcContext, ip: &Ipv4, l4: Option<L4>) -> Result<Option<Packet>, Counter> {
    if ip.fragment == Fragment::Later {
        return Ok(None);
    }
    let (sport, dport, syn, icmp_type) = match l4 {
        Some(l4) => (
            l4.sport,
            l4.dport,
            ip.proto == PROTO_TCP && l4.is_syn(),
            l4.icmp_type,
        ),
        // SCTP's ports are where TCP's and UDP's are.
        None if ip.proto == PROTO_SCTP => {
            let ports: [u16; 2] = load(ctx, ip.l4_off)?;
            (ports[0], ports[1], false, 0)
        }
        None => (0, 0, false, 0),
    };
    Ok(Some(Packet {
        key: FlowKey::new(ip.saddr, ip.daddr, sport, dport, ip.proto),
        syn,
        icmp_type,
    }))
}

/// Judges the packet now in `ctx` (after any rewrite): the rules of
/// whichever of its ends is a local pod. `Err`: the drop reason.
#[inline(always)]
pub fn admit_in(ctx: &TcContext, cfg: &Config) -> Result<(), Counter> {
    if !cfg.network_policy() || !is_ipv4(ctx) {
        return Ok(());
    }
    let ip = parse_ipv4(ctx, ETH_HLEN)?;
    let l4 = if ip.fragment == Fragment::Later {
        None
    } else {
        parse_l4(ctx, &ip)?
    };
    admit_parsed(ctx, cfg, &ip, l4)
}

/// [`admit_in`] for a packet whose headers the caller has read, and not
/// rewritten since: `ip`, and `l4` as [`parse_l4`] read it (anything for a
/// later fragment). Each read is a helper call: none is made twice.
#[inline(always)]
pub fn admit_parsed(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: Option<L4>,
) -> Result<(), Counter> {
    if !cfg.network_policy() {
        return Ok(());
    }
    let Some(packet) = packet_of(ctx, ip, l4)? else {
        return Ok(());
    };
    if ip.proto == PROTO_ICMP && icmp::is_translated_error(packet.icmp_type) {
        // An error about a connection policy let through belongs to it (as
        // netfilter's RELATED); about anything else, it is judged as ICMP.
        if icmp::quoted_flow(ctx, ip).is_some_and(|quoted| known(&quoted)) {
            return Ok(());
        }
    }
    admit(cfg, &packet)
}

/// Judges a whole packet or a first fragment. `Err`: the drop reason.
#[inline(always)]
fn admit(cfg: &Config, packet: &Packet) -> Result<(), Counter> {
    let key = &packet.key;
    let (flow, reversed) = flow_key(key);
    let now = now_ns();
    // A known connection first: most packets are its, and its entry spares
    // the pods' lookups (only connections of a pod with policy are
    // tracked). A SYN opens a connection: judged again even on a known
    // tuple, so a tuple reused after its connection closed gets today's
    // rules.
    let tracked = if packet.syn {
        Tracked::No
    } else {
        refresh(&flow, now)
    };
    if matches!(tracked, Tracked::Allowed) {
        return Ok(());
    }
    let sender = pod_policy(key.saddr);
    let receiver = pod_policy(key.daddr);
    if sender.is_none() && receiver.is_none() {
        return Ok(());
    }
    if matches!(tracked, Tracked::Revoked) {
        return Err(Counter::DropPolicyRevoked);
    }
    let verdict = judge(key, sender, receiver);
    let opener = match verdict {
        Ok(()) => {
            count(Counter::PolicyFlowNew);
            tally_allowed(key, sender, receiver);
            if cfg.policy_events() {
                if let Some(pod) = sender {
                    log(key, VERDICT_ACCEPT, DIRECTION_EGRESS, pod.egress);
                }
                if let Some(pod) = receiver {
                    log(key, VERDICT_ACCEPT, DIRECTION_INGRESS, pod.ingress);
                }
            }
            reversed
        }
        // A TCP connection that was running before it was tracked passes
        // when its other end may open it: what the rules allow is the
        // connection, whichever end's packet comes first.
        Err(reason) if key.proto == PROTO_TCP && !packet.syn => {
            if judge(&key.reversed(), receiver, sender).is_err() {
                tally_denied(key, reason);
                log_denied(cfg, key, reason, sender, receiver);
                return Err(reason);
            }
            count(Counter::PolicyFlowPickedUp);
            tally_allowed(&key.reversed(), receiver, sender);
            !reversed
        }
        Err(reason) => {
            tally_denied(key, reason);
            log_denied(cfg, key, reason, sender, receiver);
            return Err(reason);
        }
    };
    let entry = PolicyFlow {
        last_seen_ns: now,
        opener: if opener {
            OPENED_BY_KEY_DESTINATION
        } else {
            OPENED_BY_KEY_SOURCE
        },
        ..PolicyFlow::default()
    };
    match POLICY_FLOWS.get_ptr_mut(flow) {
        // A tuple opened again (or a stale entry): rewritten where it is.
        // An insert over it would take a fresh node off the LRU's free
        // list and hand the old one back: two list operations saved.
        // SAFETY: a live map value.
        Some(old) => unsafe { *old = entry },
        // An LRU map always makes room: the least recently used gives way.
        None => {
            let _ = POLICY_FLOWS.insert(flow, entry, 0);
        }
    }
    Ok(())
}

/// A connection `key`'s opener may open, on the pods' verdicts.
#[inline(always)]
fn tally_allowed(key: &FlowKey, sender: Option<PodPolicy>, receiver: Option<PodPolicy>) {
    if sender.is_some() {
        tally(key.saddr, |v| {
            v.egress_allowed = v.egress_allowed.wrapping_add(1)
        });
    }
    if receiver.is_some() {
        tally(key.daddr, |v| {
            v.ingress_allowed = v.ingress_allowed.wrapping_add(1);
        });
    }
}

/// A denied packet, on the verdicts of the pod whose rules denied it.
#[inline(always)]
fn tally_denied(key: &FlowKey, reason: Counter) {
    if reason == Counter::DropPolicyEgress {
        tally(key.saddr, |v| {
            v.egress_denied = v.egress_denied.wrapping_add(1)
        });
    } else {
        tally(key.daddr, |v| {
            v.ingress_denied = v.ingress_denied.wrapping_add(1)
        });
    }
}

/// Adds to this CPU's verdicts of the pod at `addr` (an entry only the
/// agent makes).
#[inline(always)]
fn tally(addr: u32, add: impl FnOnce(&mut PodVerdicts)) {
    if let Some(verdicts) = POLICY_VERDICTS.get_ptr_mut(addr) {
        // SAFETY: this CPU's live map value.
        add(unsafe { &mut *verdicts });
    }
}

/// A denied packet into the event log, as the side whose rules denied it.
#[inline(always)]
fn log_denied(
    cfg: &Config,
    key: &FlowKey,
    reason: Counter,
    sender: Option<PodPolicy>,
    receiver: Option<PodPolicy>,
) {
    if !cfg.policy_events() {
        return;
    }
    let (direction, identity) = if reason == Counter::DropPolicyEgress {
        (DIRECTION_EGRESS, sender.map_or(0, |p| p.egress))
    } else {
        (DIRECTION_INGRESS, receiver.map_or(0, |p| p.ingress))
    };
    log(key, VERDICT_DENY, direction, identity);
}

/// One verdict into the event ring buffer; full, it is counted and lost:
/// the datapath never waits for the agent.
#[inline(always)]
fn log(key: &FlowKey, verdict: u8, direction: u8, identity: u32) {
    // The tier, from the entry that gave the verdict (looked up again:
    // only with event logs on).
    let peer = if direction == DIRECTION_EGRESS {
        key.daddr
    } else {
        key.saddr
    };
    let tier = if identity == POLICY_UNISOLATED {
        TIER_DEFAULT
    } else {
        rule(identity, peer, key.proto, key.dport).map_or(TIER_NETWORK_POLICY, |v| v.tier)
    };
    let event = PolicyEvent {
        saddr: key.saddr,
        daddr: key.daddr,
        sport: key.sport,
        dport: key.dport,
        proto: key.proto,
        verdict,
        direction,
        tier,
    };
    if POLICY_EVENTS.output::<PolicyEvent>(&event, 0).is_err() {
        count(Counter::PolicyEventLost);
    }
}

/// Whether the connection `key` (either direction) is tracked and fresh.
#[inline(always)]
fn known(key: &FlowKey) -> bool {
    let (flow, _) = flow_key(key);
    // SAFETY: read-only copy of a map value.
    unsafe { POLICY_FLOWS.get(flow) }.is_some_and(|entry| {
        entry.revoked != FLOW_REVOKED && fresh(entry.last_seen_ns, flow.proto, now_ns())
    })
}

/// What `POLICY_FLOWS` says of a connection.
enum Tracked {
    /// Nothing fresh: the rules judge.
    No,
    Allowed,
    /// A policy change denies it.
    Revoked,
}

/// What is known of the connection keyed `flow`; a fresh entry records the
/// packet.
#[inline(always)]
fn refresh(flow: &FlowKey, now: u64) -> Tracked {
    let Some(entry) = POLICY_FLOWS.get_ptr_mut(flow) else {
        return Tracked::No;
    };
    // SAFETY: a live map value.
    let (last, revoked) = unsafe { ((*entry).last_seen_ns, (*entry).revoked) };
    if !fresh(last, flow.proto, now) {
        return Tracked::No;
    }
    if now.wrapping_sub(last) > POLICY_FLOW_REFRESH_NS {
        // SAFETY: a live map value.
        unsafe { (*entry).last_seen_ns = now };
    }
    if revoked == FLOW_REVOKED {
        Tracked::Revoked
    } else {
        Tracked::Allowed
    }
}

/// Whether a connection last seen at `last` still lives: as long as
/// netfilter keeps an established one of its protocol (the node's
/// sysctls).
#[inline(always)]
fn fresh(last: u64, proto: u8, now: u64) -> bool {
    let lives = match timeouts() {
        Some(t) => t.timeout_ns(proto, FlowState::Established, true),
        None => DEFAULT_TIMEOUTS.timeout_ns(proto, FlowState::Established, true),
    };
    now.wrapping_sub(last) <= lives
}

/// The packet as a new connection from `sender`'s pod to `receiver`'s.
#[inline(always)]
fn judge(
    key: &FlowKey,
    sender: Option<PodPolicy>,
    receiver: Option<PodPolicy>,
) -> Result<(), Counter> {
    if let Some(pod) = sender
        && !allows(pod.egress, key.daddr, key.proto, key.dport)
    {
        return Err(Counter::DropPolicyEgress);
    }
    if let Some(pod) = receiver
        && !allows(pod.ingress, key.saddr, key.proto, key.dport)
        // The node's own addresses always reach its pods: kubelet's probes.
        && cidr::lookup(key.saddr) != Some(CidrKind::Local)
    {
        return Err(Counter::DropPolicyIngress);
    }
    Ok(())
}

/// Whether identity `identity` lets `peer` (network order) be the other end
/// on `proto`'s `port` (network order).
#[inline(always)]
fn allows(identity: u32, peer: u32, proto: u8, port: u16) -> bool {
    identity == POLICY_UNISOLATED
        || rule(identity, peer, proto, port).is_some_and(|v| v.verdict == PORT_ALLOWED)
}

/// What identity `identity`'s tries say of `peer` on `proto`'s `port`;
/// `None`: nothing (denied).
#[inline(always)]
fn rule(identity: u32, peer: u32, proto: u8, port: u16) -> Option<&'static PortVerdict> {
    let cidr = Key::new(POLICY_ID_BITS + 32, cidr_key_data(identity, peer));
    let set = POLICY_CIDRS.get(&cidr)?;
    let port = Key::new(PORTS_ONE, port_key_data(set.id, proto, port));
    POLICY_PORTS.get(&port)
}

/// A local pod's policy identities, `None` for any other address.
#[inline(always)]
fn pod_policy(addr: u32) -> Option<PodPolicy> {
    // SAFETY: read-only copy of a map value.
    unsafe { POLICY_PODS.get(addr) }.copied()
}
