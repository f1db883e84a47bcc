//! ICMP errors (destination unreachable, fragmentation needed, time
//! exceeded, parameter problem) about NATed flows: the outer address and the embedded datagram's
//! address and port are translated together, every checksum kept right.
//!
//! All the embedded changes are compensated in the ICMP checksum, so the sum
//! over the ICMP message is unchanged and a `CHECKSUM_COMPLETE` skb stays
//! valid without recomputing it.

use aya_ebpf::programs::TcContext;
use vpcnet_common::{
    config::Config,
    counters::Counter,
    nat::{FlowKey, FlowKind, PROTO_TCP, PROTO_UDP},
};

use crate::{
    maps::{NAT_FWD, NAT_REV},
    packet::{
        Fragment, ICMP_HLEN, IP_DADDR_OFF, IP_SADDR_OFF, Ipv4, csum_update16, csum_update32,
        l4_csum_rel, load, parse_ipv4, parse_quoted_l4, set_addr,
    },
};

/// Whether an ICMP type is an error this module translates.
#[inline(always)]
pub const fn is_translated_error(icmp_type: u8) -> bool {
    matches!(
        icmp_type,
        crate::packet::ICMP_DEST_UNREACH
            | crate::packet::ICMP_TIME_EXCEEDED
            | crate::packet::ICMP_PARAMETERPROB
    )
}

/// The tuple of the datagram an ICMP error (outer header `outer`) quotes.
#[inline(always)]
pub fn quoted_flow(ctx: &TcContext, outer: &Ipv4) -> Option<FlowKey> {
    parse_embedded(ctx, outer).map(|(_, _, key)| key)
}

/// One translation of an ICMP error.
struct ErrorRewrite {
    /// Outer address: offset (source or destination) and new value.
    outer_off: usize,
    outer_old: u32,
    outer_new: u32,
    /// Embedded address: offset within the embedded IP header (12 source,
    /// 16 destination) and new value.
    inner_addr_rel: usize,
    inner_addr_old: u32,
    inner_addr_new: u32,
    /// Embedded port (or echo identifier): offset within the embedded L4
    /// header and new value.
    inner_port_rel: usize,
    inner_port_old: u16,
    inner_port_new: u16,
}

/// The embedded datagram of an ICMP error whose outer header is `outer`.
#[inline(always)]
fn parse_embedded(ctx: &TcContext, outer: &Ipv4) -> Option<(usize, Ipv4, FlowKey)> {
    let inner_off = outer.l4_off + ICMP_HLEN;
    let inner = parse_ipv4(ctx, inner_off).ok()?;
    if inner.fragment == Fragment::Later {
        return None;
    }
    let l4 = parse_quoted_l4(ctx, inner.proto, inner.l4_off).ok()??;
    let key = FlowKey::new(inner.saddr, inner.daddr, l4.sport, l4.dport, inner.proto);
    Some((inner_off, inner, key))
}

/// Offset of the port field the embedded L4 header carries for this side of
/// the flow: `source` for the embedded source port, else the destination.
#[inline(always)]
const fn port_rel(proto: u8, source: bool) -> usize {
    match proto {
        PROTO_TCP | PROTO_UDP => {
            if source {
                0
            } else {
                2
            }
        }
        // ICMP echo: the identifier whichever side.
        _ => 4,
    }
}

/// An ICMP error arriving for the node address about a datagram the node
/// address sent: back to the pod (or node socket) the flow belongs to.
#[inline(always)]
pub fn ingress(ctx: &TcContext, cfg: &Config, outer: &Ipv4) -> Result<Counter, Counter> {
    let Some((inner_off, inner, embedded)) = parse_embedded(ctx, outer) else {
        return Ok(Counter::IngressNoEntry);
    };
    if embedded.saddr != cfg.node_addr {
        return Ok(Counter::IngressNoEntry);
    }
    // The embedded datagram went out; its reply tuple keys the claim.
    let rev_key = embedded.reversed();
    // SAFETY: read-only copy of a map value.
    let Some(rev) = (unsafe { NAT_REV.get(rev_key) }).copied() else {
        return Ok(Counter::IngressNoEntry);
    };
    // The node's side of the embedded datagram is its source: the
    // translated port (or echo identifier).
    let translated_port = embedded.sport;
    let rewrite = ErrorRewrite {
        outer_off: IP_DADDR_OFF,
        outer_old: outer.daddr,
        outer_new: rev.addr,
        inner_addr_rel: 12,
        inner_addr_old: inner.saddr,
        inner_addr_new: rev.addr,
        inner_port_rel: port_rel(inner.proto, true),
        inner_port_old: translated_port,
        inner_port_new: rev.port,
    };
    if rev.kind == FlowKind::Host as u8 && rev.port == translated_port {
        return Ok(Counter::IngressHost);
    }
    apply(ctx, outer, inner_off, &inner, &rewrite)?;
    Ok(Counter::IngressIcmpErrorRevNat)
}

/// An ICMP error a pod (or node socket) sends about a datagram it received
/// through the NAT: out with the node address, as the remote knows the flow.
#[inline(always)]
pub fn egress(ctx: &TcContext, outer: &Ipv4) -> Result<Counter, Counter> {
    let Some((inner_off, inner, embedded)) = parse_embedded(ctx, outer) else {
        return Ok(Counter::EgressIcmpErrorPass);
    };
    // The embedded datagram came in; its reverse is the flow's forward tuple.
    let fwd_key = embedded.reversed();
    // SAFETY: read-only copy of a map value.
    let Some(fwd) = (unsafe { NAT_FWD.get(fwd_key) }).copied() else {
        return Ok(Counter::EgressIcmpErrorPass);
    };
    if FlowKind::untranslated(fwd.kind) || (fwd.addr == fwd_key.saddr && fwd.port == fwd_key.sport)
    {
        return Ok(Counter::EgressIcmpErrorPass);
    }
    // The pod's side of the embedded datagram is its destination.
    let own_port = embedded.dport;
    let rewrite = ErrorRewrite {
        outer_off: IP_SADDR_OFF,
        outer_old: outer.saddr,
        outer_new: fwd.addr,
        inner_addr_rel: 16,
        inner_addr_old: inner.daddr,
        inner_addr_new: fwd.addr,
        inner_port_rel: port_rel(inner.proto, false),
        inner_port_old: own_port,
        inner_port_new: fwd.port,
    };
    apply(ctx, outer, inner_off, &inner, &rewrite)?;
    Ok(Counter::EgressIcmpErrorNat)
}

#[inline(always)]
fn store<T>(ctx: &TcContext, off: usize, v: &T) -> Result<(), Counter> {
    ctx.store(off, v, 0).map_err(|_| Counter::DropRewrite)
}

#[inline(always)]
fn apply(
    ctx: &TcContext,
    outer: &Ipv4,
    inner_off: usize,
    inner: &Ipv4,
    rw: &ErrorRewrite,
) -> Result<(), Counter> {
    let icmp_csum_off = outer.l4_off + 2;
    let mut icmp_csum: u16 = load(ctx, icmp_csum_off)?;

    // Embedded IP header: address and its header checksum.
    if rw.inner_addr_old != rw.inner_addr_new {
        let ip_csum_off = inner_off + 10;
        let old_ip_csum: u16 = load(ctx, ip_csum_off)?;
        let new_ip_csum = csum_update32(old_ip_csum, rw.inner_addr_old, rw.inner_addr_new);
        store(ctx, inner_off + rw.inner_addr_rel, &rw.inner_addr_new)?;
        store(ctx, ip_csum_off, &new_ip_csum)?;
        icmp_csum = csum_update32(icmp_csum, rw.inner_addr_old, rw.inner_addr_new);
        icmp_csum = csum_update16(icmp_csum, old_ip_csum, new_ip_csum);
    }

    // Embedded L4 header: port, and its checksum when the error carries it
    // (an error may quote only 8 bytes, which hold no TCP checksum).
    if rw.inner_port_old != rw.inner_port_new {
        store(ctx, inner.l4_off + rw.inner_port_rel, &rw.inner_port_new)?;
        icmp_csum = csum_update16(icmp_csum, rw.inner_port_old, rw.inner_port_new);
    }
    let l4_csum_off = inner.l4_off + l4_csum_rel(inner.proto);
    if let Ok(old_l4_csum) = ctx.load::<u16>(l4_csum_off) {
        let udp_without_csum = inner.proto == PROTO_UDP && old_l4_csum == 0;
        if !udp_without_csum {
            let mut new_l4_csum = old_l4_csum;
            if inner.proto == PROTO_TCP || inner.proto == PROTO_UDP {
                new_l4_csum = csum_update32(new_l4_csum, rw.inner_addr_old, rw.inner_addr_new);
            }
            new_l4_csum = csum_update16(new_l4_csum, rw.inner_port_old, rw.inner_port_new);
            if inner.proto == PROTO_UDP && new_l4_csum == 0 {
                new_l4_csum = 0xffff;
            }
            if new_l4_csum != old_l4_csum {
                store(ctx, l4_csum_off, &new_l4_csum)?;
                icmp_csum = csum_update16(icmp_csum, old_l4_csum, new_l4_csum);
            }
        }
    }
    store(ctx, icmp_csum_off, &icmp_csum)?;

    // Outer address: the IP checksum only (ICMP has no pseudo-header).
    set_addr(ctx, outer, rw.outer_off, rw.outer_old, rw.outer_new, false)
}
