//! tc ingress of an ENI: replies of NATed flows back to their pod (or node
//! socket), ICMP errors about them, and tracking of flows opened from
//! outside the VPC so their replies leave un-NATed.

use aya_ebpf::programs::TcContext;
use vpcnet_common::{
    config::Config,
    counters::Counter,
    nat::{FlowKey, FlowKind, FragHook, NatEntry, PROTO_ICMP, PROTO_TCP, SEEN_ANY, SEEN_SYN},
};

use crate::{
    cidr, egress,
    forward::{Verdict, to_pod},
    frag, icmp,
    maps::{NAT_REV, config, count, endpoint},
    nat::{now_ns, reopen_inbound, touch, track_untranslated},
    packet::{
        ETH_HLEN, Fragment, IP_DADDR_OFF, Ipv4, L4, is_icmp_reply, is_ipv4, l4_csum_rel, load,
        parse_ipv4, parse_l4, set_addr, set_port,
    },
    policy, stack,
};

/// `Ok(verdict)`: what to do and how it counts. `Err(reason)`: drop.
pub fn handle(ctx: &TcContext) -> Result<Verdict, Counter> {
    if !is_ipv4(ctx) {
        return Ok(Counter::IngressNotIpv4.into());
    }
    let Some(cfg) = config() else {
        return Ok(Counter::IngressNotNode.into());
    };
    if cfg.node_addr == 0 {
        return Ok(Counter::IngressNotNode.into());
    }
    let ip = parse_ipv4(ctx, ETH_HLEN)?;
    if ip.fragment == Fragment::Later {
        if let Some(verdict) =
            frag::follow(ctx, &ip, FragHook::EniIngress, Counter::IngressFragment)
        {
            return verdict;
        }
        // No first fragment seen here: the datagram goes through the
        // stack's reassembly and comes back in order.
        return frag::reorder(ctx, &ip);
    }
    if ip.fragment == Fragment::First
        && let Some(verdict) = frag::follow_reordered(ctx, &ip)
    {
        return verdict;
    }
    let decision = decide(ctx, cfg, &ip)?;
    let verdict = match decision {
        // An ICMP error about a flow conntrack never saw would be INVALID
        // in the stack (kube-proxy drops those): it goes where the flow's
        // packets go.
        Counter::IngressRevSnat
        | Counter::IngressIcmpErrorRevNat
        | Counter::IngressNotNode
        | Counter::IngressInboundTracked => deliver(ctx, cfg, &ip, decision)?,
        _ => decision.into(),
    };
    if ip.fragment == Fragment::First {
        frag::remember(ctx, &ip, FragHook::EniIngress, &verdict);
    }
    Ok(verdict)
}

/// A packet now addressed to a local pod goes straight into it, past the
/// stack and `pod_ingress`, once policy let it, unless the pod is a strict
/// security-group pod and this is not its branch ENI.
#[inline(always)]
fn deliver(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    decision: Counter,
) -> Result<Verdict, Counter> {
    // The reverse NAT rewrote only the destination (and its port).
    let daddr: u32 = load(ctx, IP_DADDR_OFF)?;
    let Some(ep) = endpoint(daddr) else {
        return Ok(decision.into());
    };
    // SAFETY: the context's skb is valid for the program's run.
    if ep.strict() && ep.eni_ifindex != unsafe { (*ctx.skb.skb).ifindex } {
        return Ok(decision.into());
    }
    let ip = Ipv4 { daddr, ..*ip };
    let l4 = parse_l4(ctx, &ip)?;
    if is_stack_flow(ctx, &ip, l4) {
        count(decision);
        return Ok(Counter::IngressStackFlow.into());
    }
    count(decision);
    policy::admit_parsed(ctx, cfg, &ip, l4)?;
    to_pod(ctx, &ep, Counter::IngressToPod)
}

/// Whether the packet (`ip` and `l4` as they are now, after any reverse
/// NAT) belongs to a flow the stack must see: a pod's flow to a service,
/// which kube-proxy DNATed and now un-DNATs. An ICMP error belongs to the
/// flow it quotes.
#[inline(always)]
fn is_stack_flow(ctx: &TcContext, ip: &Ipv4, l4: Option<L4>) -> bool {
    let Some(l4) = l4 else {
        return false;
    };
    if ip.proto == PROTO_ICMP && icmp::is_translated_error(l4.icmp_type) {
        // The quoted datagram went out: its reverse is how the flow's
        // packets arrive.
        return icmp::quoted_flow(ctx, ip).is_some_and(|quoted| stack::known(&quoted.reversed()));
    }
    let arriving = FlowKey::new(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
    stack::record(&arriving, &l4)
}

/// Reverse NAT and inbound tracking for a whole packet or a first
/// fragment; `Ok(verdict)` passes.
#[inline(always)]
fn decide(ctx: &TcContext, cfg: &Config, ip: &Ipv4) -> Result<Counter, Counter> {
    if ip.daddr != cfg.node_addr {
        return inbound(ctx, ip);
    }
    // Protocols without ports are translated by address only.
    let l4 = parse_l4(ctx, ip)?.unwrap_or(L4::portless());
    if ip.proto == PROTO_ICMP && !is_icmp_reply(l4.icmp_type) {
        if icmp::is_translated_error(l4.icmp_type) {
            return icmp::ingress(ctx, cfg, ip);
        }
        return Ok(Counter::IngressNoEntry);
    }
    let key = FlowKey::new(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
    let Some(entry) = NAT_REV.get_ptr_mut(key) else {
        return Ok(Counter::IngressNoEntry);
    };
    touch(entry, &l4, now_ns());
    reverse(ctx, cfg, ip, &key, entry)
}

/// Rewrites a reply to the original address and port.
#[inline(always)]
fn reverse(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    key: &FlowKey,
    entry: *mut NatEntry,
) -> Result<Counter, Counter> {
    // SAFETY: a live map value, copied before the packet is touched.
    let (kind, addr, port) = unsafe { ((*entry).kind, (*entry).addr, (*entry).port) };
    if addr != cfg.node_addr {
        set_addr(ctx, ip, IP_DADDR_OFF, key.daddr, addr, true)?;
    }
    let port_off = ip.l4_off + if ip.proto == PROTO_ICMP { 4 } else { 2 };
    set_port(
        ctx,
        ip.proto,
        port_off,
        ip.l4_off + l4_csum_rel(ip.proto),
        key.dport,
        port,
    )?;
    Ok(if kind == FlowKind::Host as u8 {
        Counter::IngressHost
    } else {
        Counter::IngressRevSnat
    })
}

/// A packet for an address other than the node's (a pod's). When it comes
/// from outside the VPC and opens a flow, the flow is tracked so the pod's
/// replies leave un-NATed, as netfilter's conntrack keeps them; this
/// direction writes the pair's reverse entry, keyed by the tuple as it
/// arrives.
#[inline(always)]
fn inbound(ctx: &TcContext, ip: &Ipv4) -> Result<Counter, Counter> {
    if cidr::lookup(ip.saddr).is_some() {
        return Ok(Counter::IngressNotNode);
    }
    let l4 = parse_l4(ctx, ip)?.unwrap_or(L4::portless());
    let key = FlowKey::new(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
    let now = now_ns();
    if let Some(entry) = NAT_REV.get_ptr_mut(key) {
        // SAFETY: a live map value.
        let old_seen = unsafe { (*entry).seen };
        if ip.proto == PROTO_TCP && l4.is_syn() && old_seen & !(SEEN_SYN | SEEN_ANY) != 0 {
            // The remote connects again on the tuple of a flow that got
            // past its handshake: a new connection.
            reopen_inbound(&key, entry, &l4, now);
        } else {
            touch(entry, &l4, now);
        }
        return Ok(Counter::IngressNotNode);
    }
    if !egress::may_open(ip.proto, &l4) {
        return Ok(Counter::IngressNotNode);
    }
    // The pod's side is the pair's forward tuple. Untracked, the pod's
    // packets after its SYN-ACK (or its first UDP reply) would open SNAT
    // flows of their own once the table had room: conntrack, full, drops.
    match track_untranslated(&key.reversed(), FlowKind::Inbound, &l4, now) {
        Ok(_) => Ok(Counter::IngressInboundTracked),
        Err(_) => Err(Counter::DropInboundUntracked),
    }
}
