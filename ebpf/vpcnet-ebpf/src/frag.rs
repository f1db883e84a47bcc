//! Fragmented datagrams: only the first fragment carries the L4 header the
//! NAT and the forwarding decide on. Each program remembers where a first
//! fragment went and what it was rewritten to, and sends every later
//! fragment of the datagram the same way: rewritten alike, into the same
//! pod or out of the same ENI, or passed on as it was. Never half one way
//! and half another: the node's stack, where conntrack reassembles, would
//! wait for fragments that went elsewhere.

use aya_ebpf::programs::TcContext;
use vpcnet_common::{
    counters::Counter,
    nat::{FRAG_VIA_ENI_FORWARDED, FRAG_VIA_ENI_ROUTED, FRAG_VIA_POD, FragHook, FragKey, FragPath},
};

use crate::{
    forward::{Verdict, to_pod, via_eni},
    maps::{FRAG_PATHS, endpoint},
    packet::{IP_DADDR_OFF, IP_SADDR_OFF, Ipv4, load, set_addr},
};

#[inline(always)]
const fn key(ip: &Ipv4, hook: FragHook) -> FragKey {
    FragKey {
        saddr: ip.saddr,
        daddr: ip.daddr,
        id: ip.id,
        proto: ip.proto,
        hook: hook as u8,
    }
}

/// The address the NAT may rewrite at `hook`: its offset and its value in
/// the header as it arrived.
#[inline(always)]
fn nat_side(ip: &Ipv4, hook: FragHook) -> (usize, u32) {
    if matches!(hook, FragHook::EniIngress) {
        (IP_DADDR_OFF, ip.daddr)
    } else {
        (IP_SADDR_OFF, ip.saddr)
    }
}

/// Called once a first fragment's `verdict` is reached; `ip` is its header
/// as it arrived, which the later fragments carry too.
#[inline(always)]
pub fn remember(ctx: &TcContext, ip: &Ipv4, hook: FragHook, verdict: &Verdict) {
    let (off, arrived) = nat_side(ip, hook);
    let now: u32 = load(ctx, off).unwrap_or(arrived);
    let path = FragPath {
        addr: if now == arrived { 0 } else { now },
        ifindex: verdict.ifindex,
        via: verdict.via,
        _pad1: 0,
        _pad2: 0,
    };
    // An LRU map: a datagram whose later fragments never come ages out.
    let _ = FRAG_PATHS.insert(key(ip, hook), path, 0);
}

/// A later fragment: sent where its first fragment went, counted as
/// `counter`. `None` when no first fragment was seen here: the caller
/// decides.
#[inline(always)]
pub fn follow(
    ctx: &TcContext,
    ip: &Ipv4,
    hook: FragHook,
    counter: Counter,
) -> Option<Result<Verdict, Counter>> {
    // SAFETY: read-only copy of a map value.
    let path = unsafe { FRAG_PATHS.get(key(ip, hook)) }.copied()?;
    Some(send_like_first(ctx, ip, hook, &path, counter))
}

#[inline(always)]
fn send_like_first(
    ctx: &TcContext,
    ip: &Ipv4,
    hook: FragHook,
    path: &FragPath,
    counter: Counter,
) -> Result<Verdict, Counter> {
    let (off, arrived) = nat_side(ip, hook);
    if path.addr != 0 {
        set_addr(ctx, ip, off, arrived, path.addr, false)?;
    }
    match path.via {
        FRAG_VIA_POD => {
            let daddr = if off == IP_DADDR_OFF && path.addr != 0 {
                path.addr
            } else {
                ip.daddr
            };
            match endpoint(daddr) {
                Some(ep) => to_pod(ctx, &ep, counter),
                None => Ok(counter.into()),
            }
        }
        FRAG_VIA_ENI_FORWARDED => via_eni(ctx, path.ifindex, true, counter),
        FRAG_VIA_ENI_ROUTED => via_eni(ctx, path.ifindex, false, counter),
        _ => Ok(counter.into()),
    }
}
