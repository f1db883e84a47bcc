//! tc egress of an ENI: the SNAT decision and the NAT, for pod traffic that
//! went through the node's stack and for the node's own flows.

use aya_ebpf::programs::TcContext;
use vpcnet_common::{
    cidr::CidrKind,
    config::{Config, MARK_DECIDED, MARK_VIA_SERVICE},
    counters::Counter,
    endpoint::ENI_BRANCH,
    nat::{
        FlowKey, FlowKind, FragHook, NatEntry, PROTO_ICMP, PROTO_TCP, REASSEMBLY_ADDR, SEEN_ANY,
        SEEN_SYN,
    },
};

use crate::{
    cidr,
    forward::{Verdict, via_eni},
    frag, icmp,
    maps::{ENIS, NAT_FWD, config, count, endpoint},
    nat::{create_flow, forget_forward, now_ns, reopen, touch, track_untranslated},
    packet::{
        ETH_HLEN, Fragment, IP_DADDR_OFF, IP_SADDR_OFF, Ipv4, L4, is_icmp_reply, is_icmp_request,
        is_ipv4, l4_csum_rel, load, parse_ipv4, parse_l4, set_addr, set_port,
    },
    policy, stack,
};

/// `Ok(verdict)`: what to do and how it counts. `Err(reason)`: drop.
/// Inlined into the program: a `Result` returned through memory would
/// carry the undefined payload of its other variant, which the verifier
/// refuses to see stored.
#[inline(always)]
pub fn handle(ctx: &TcContext) -> Result<Verdict, Counter> {
    // SAFETY: the context's skb is valid for the program's run.
    let mut mark = unsafe { (*ctx.skb.skb).mark };
    let cfg = config();
    let decided = cfg.map_or(MARK_DECIDED, Config::mark_decided);
    let ipv4 = is_ipv4(ctx);
    if mark & decided != 0 {
        mark &= !decided;
        ctx.set_mark(mark);
        if !ipv4 || decided_here(ctx, cfg)? {
            return Ok(Counter::EgressDecided.into());
        }
        // Leaving un-NATed for outside the VPC on a decided mark alone:
        // decided again, so that another component's mark bit never
        // sends a pod's packet to the internet untranslated.
        count(Counter::EgressDecidedRechecked);
    }
    let via_service = cfg.map_or(MARK_VIA_SERVICE, Config::mark_via_service);
    if mark & via_service != 0 {
        ctx.set_mark(mark & !via_service);
        // The mark is ours only on IPv4 (`pod_egress` sets it there); on
        // anything else it is another's bit, and says nothing.
        if ipv4 {
            // A pod's egress rules judge the backend kube-proxy chose.
            if let Some(cfg) = cfg {
                policy::admit_in(ctx, cfg)?;
            }
            remember_service_flow(ctx)?;
        }
    }
    if !ipv4 {
        return Ok(Counter::EgressNotIpv4.into());
    }
    let Some(cfg) = cfg else {
        return Ok(Counter::EgressUnconfigured.into());
    };
    if cfg.node_addr == 0 {
        return Ok(Counter::EgressUnconfigured.into());
    }
    let ip = parse_ipv4(ctx, ETH_HLEN)?;
    if ip.daddr == REASSEMBLY_ADDR
        && let Some(verdict) = frag::reassembled(ctx, &ip)
    {
        return verdict;
    }
    if ip.fragment == Fragment::Later {
        if let Some(verdict) = frag::follow(ctx, &ip, FragHook::EniEgress, Counter::EgressFragment)
        {
            return verdict;
        }
        // Its first fragment was not seen: the translation is unknown, and
        // a wrong one would be worse than none.
        return match cidr::lookup(ip.daddr) {
            Some(_) => steer(ctx, Counter::EgressNoSnatCidr),
            None => Err(Counter::DropFragmentNoFlow),
        };
    }
    let decision = decide_ipv4(ctx, cfg, &ip, parse_l4(ctx, &ip)?)?;
    let verdict = if leaves_untranslated(decision) {
        steer(ctx, decision)?
    } else {
        decision.into()
    };
    if ip.fragment == Fragment::First {
        frag::remember(ctx, &ip, FragHook::EniEgress, &verdict);
    }
    Ok(verdict)
}

/// Whether a packet marked decided may pass as it is: translated (the
/// node's address), or untranslated where no NAT applies (a destination
/// in the VPC, excluded, node-local or a service's; EXTERNALSNAT); only a
/// pod's packet leaving un-NATed for outside the VPC is decided again (a
/// flow tracked untranslated passes as it was), whoever marked it.
#[inline(always)]
fn decided_here(ctx: &TcContext, cfg: Option<&Config>) -> Result<bool, Counter> {
    let Some(cfg) = cfg.filter(|cfg| cfg.node_addr != 0 && !cfg.external_snat()) else {
        return Ok(true);
    };
    let saddr: u32 = load(ctx, IP_SADDR_OFF)?;
    if saddr == cfg.node_addr {
        return Ok(true);
    }
    let daddr: u32 = load(ctx, IP_DADDR_OFF)?;
    Ok(cidr::lookup(daddr).is_some())
}

/// Whether a decision leaves the packet with its pod's address, which
/// must then leave by the pod's own ENI (ICMP messages the NAT leaves alone
/// included: the VPC would drop them from another ENI).
#[inline(always)]
pub fn leaves_untranslated(decision: Counter) -> bool {
    matches!(
        decision,
        Counter::EgressNoSnatCidr
            | Counter::EgressExternalSnatNew
            | Counter::EgressUntranslated
            | Counter::EgressNotOpening
            | Counter::EgressBranchNoSnat
            | Counter::EgressIcmpErrorPass
            | Counter::EgressIcmpOther
    )
}

/// A pod's packet to a service, as kube-proxy DNATed it: the flow goes in
/// `STACK_FLOWS`, so `eni_ingress` hands its replies to the stack, which
/// un-DNATs them, instead of straight to the pod.
#[inline(always)]
fn remember_service_flow(ctx: &TcContext) -> Result<(), Counter> {
    let ip = parse_ipv4(ctx, ETH_HLEN)?;
    if ip.fragment == Fragment::Later {
        return Ok(());
    }
    if let Some(l4) = parse_l4(ctx, &ip)? {
        let pod_tuple = FlowKey::new(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        if !stack::record(&pod_tuple, &l4) {
            stack::remember(&pod_tuple, FlowKind::StackFromPod, &l4);
        }
        count(Counter::EgressServiceFlow);
    }
    Ok(())
}

/// Traffic that went through the stack left by the main table's route, the
/// primary ENI; a pod address owned by another ENI (or a branch ENI) goes
/// out of that one instead, or the VPC would drop it (source/destination
/// check). The stack routed it already: the TTL stays. Except to
/// `AWS_EXTERNAL_SERVICE_CIDRS`, which keep the stack's route, as aws-node's
/// rule 1535 comes before the pod's own (a strict pod's come before both).
#[inline(always)]
fn steer(ctx: &TcContext, decision: Counter) -> Result<Verdict, Counter> {
    let saddr: u32 = load(ctx, IP_SADDR_OFF)?;
    let Some(ep) = endpoint(saddr) else {
        return Ok(decision.into());
    };
    // SAFETY: the context's skb is valid for the program's run.
    if ep.eni_ifindex == unsafe { (*ctx.skb.skb).ifindex } {
        return Ok(decision.into());
    }
    count(decision);
    let daddr: u32 = load(ctx, IP_DADDR_OFF)?;
    if !ep.strict() && cidr::external_service(daddr) {
        return Ok(Counter::EgressExternalService.into());
    }
    via_eni(ctx, ep.eni_ifindex, false, Counter::EgressSteered)
}

/// The SNAT decision and the NAT for an IPv4 packet (whole, or a first
/// fragment; `l4`: what [`parse_l4`] read of it), configured; the part
/// `pod_egress` shares.
#[inline(always)]
pub fn decide_ipv4(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: Option<L4>,
) -> Result<Counter, Counter> {
    // Protocols without ports are translated by address only.
    let l4 = l4.unwrap_or(L4::portless());
    if ip.proto == PROTO_ICMP && !is_icmp_request(l4.icmp_type) && !is_icmp_reply(l4.icmp_type) {
        if icmp::is_translated_error(l4.icmp_type) {
            return icmp::egress(ctx, ip);
        }
        return Ok(Counter::EgressIcmpOther);
    }

    let key = FlowKey::new(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
    let now = now_ns();
    match NAT_FWD.get_ptr_mut(key) {
        Some(entry) => known_flow(&key, entry, &l4, now).map_or_else(
            || new_flow(ctx, cfg, ip, &l4, &key, now),
            |entry| translate(ctx, ip, &key, entry, false),
        ),
        None => new_flow(ctx, cfg, ip, &l4, &key, now),
    }
}

/// A packet of a flow the map knows. A SYN on a flow that got past its own
/// SYN is the same tuple connecting again (after a close, or a reset from
/// the remote): the mapping is kept and the state starts afresh. `None`
/// when the entry is stale (its port went to another flow): the caller
/// starts anew.
#[inline(always)]
fn known_flow(key: &FlowKey, entry: *mut NatEntry, l4: &L4, now: u64) -> Option<*mut NatEntry> {
    // SAFETY: a live map value.
    let old_seen = unsafe { (*entry).seen };
    let progressed = old_seen & !(SEEN_SYN | SEEN_ANY) != 0;
    if key.proto == PROTO_TCP && l4.is_syn() && progressed {
        if reopen(key, entry, l4, now) {
            count(Counter::EgressReopen);
            return Some(entry);
        }
        forget_forward(key);
        return None;
    }
    touch(entry, l4, now);
    Some(entry)
}

/// Whether `ifindex` is a branch ENI's link.
#[inline(always)]
fn on_branch_link(ifindex: u32) -> bool {
    // SAFETY: read-only copy of a map value.
    unsafe { ENIS.get(ifindex) }.is_some_and(|eni| eni.flags & ENI_BRANCH != 0)
}

/// Whether a packet with no flow may open one (netfilter would see it as
/// NEW): SYN or a mid-stream ACK for TCP, an echo request for ICMP, any
/// packet of another protocol.
#[inline(always)]
pub fn may_open(proto: u8, l4: &L4) -> bool {
    match proto {
        PROTO_TCP => l4.may_open_tcp(),
        PROTO_ICMP => is_icmp_request(l4.icmp_type),
        _ => true,
    }
}

/// The SNAT decision, for a packet of a flow the map does not know.
#[inline(always)]
fn new_flow(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: &L4,
    key: &FlowKey,
    now: u64,
) -> Result<Counter, Counter> {
    match cidr::lookup(ip.daddr) {
        Some(CidrKind::Local) => return Ok(Counter::EgressLocal),
        Some(CidrKind::Vpc | CidrKind::Excluded) => return Ok(Counter::EgressNoSnatCidr),
        // A service address still untranslated here is SNATed like any
        // other non-VPC one, as the chain does.
        Some(CidrKind::Service) | None => {}
    }
    if !may_open(ip.proto, l4) {
        return Ok(Counter::EgressNotOpening);
    }
    // The chain's `! -o vlan+`: nothing leaving by a branch ENI is SNATed
    // (a strict security-group pod's traffic keeps its own address).
    // SAFETY: the context's skb is valid for the program's run.
    if on_branch_link(unsafe { (*ctx.skb.skb).ifindex })
        || endpoint(ip.saddr).is_some_and(|ep| ep.strict())
    {
        return Ok(Counter::EgressBranchNoSnat);
    }
    if ip.saddr == cfg.node_addr {
        // A node socket: reserve its port so no NAT flow takes it.
        return match create_flow(cfg, key, FlowKind::Host, l4, now) {
            Ok(entry) => translate(ctx, ip, key, entry, true),
            // Never cut the node off: unreserved, its port may collide
            // with a NAT flow only for the same remote endpoint.
            Err(_) => Ok(Counter::EgressHostUntracked),
        };
    }
    if cfg.external_snat() {
        track_untranslated(key, FlowKind::NoSnat, l4, now)?;
        return Ok(Counter::EgressExternalSnatNew);
    }
    let entry = create_flow(cfg, key, FlowKind::Snat, l4, now)?;
    translate(ctx, ip, key, entry, true)
}

/// Rewrites a packet of a known or just created flow.
#[inline(always)]
fn translate(
    ctx: &TcContext,
    ip: &Ipv4,
    key: &FlowKey,
    entry: *mut NatEntry,
    new: bool,
) -> Result<Counter, Counter> {
    // SAFETY: a live map value; copied out before the packet is touched.
    let (kind, addr, port) = unsafe { ((*entry).kind, (*entry).addr, (*entry).port) };
    if FlowKind::untranslated(kind) {
        return Ok(Counter::EgressUntranslated);
    }
    if addr != key.saddr {
        set_addr(ctx, ip, IP_SADDR_OFF, key.saddr, addr, true)?;
    }
    let port_off = ip.l4_off + if ip.proto == PROTO_ICMP { 4 } else { 0 };
    set_port(
        ctx,
        ip.proto,
        port_off,
        ip.l4_off + l4_csum_rel(ip.proto),
        key.sport,
        port,
    )?;
    Ok(match (kind == FlowKind::Host as u8, new) {
        (true, true) if port != key.sport => Counter::EgressHostRemapped,
        (true, true) => Counter::EgressHostNew,
        (true, false) => Counter::EgressHost,
        (false, true) => Counter::EgressSnatNew,
        (false, false) => Counter::EgressSnat,
    })
}
