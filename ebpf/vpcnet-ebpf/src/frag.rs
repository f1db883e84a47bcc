//! Fragmented datagrams: only the first fragment carries the L4 header the
//! NAT and the forwarding decide on. Each program remembers where a first
//! fragment went and what it was rewritten to, and sends every later
//! fragment of the datagram the same way: rewritten alike, into the same
//! pod or out of the same ENI, or passed on as it was. Never half one way
//! and half another: the node's stack, where conntrack reassembles, would
//! wait for fragments that went elsewhere. A datagram whose later fragment
//! reaches an ENI first goes round the stack's reassembly whole
//! ([`FRAG_VIA_REASSEMBLY`]) and comes back in order.

use aya_ebpf::{
    bindings::{BPF_F_INGRESS, TC_ACT_UNSPEC},
    helpers::bpf_redirect,
    programs::TcContext,
};
use vpcnet_common::{
    counters::Counter,
    nat::{
        FRAG_VIA_ENI_FORWARDED, FRAG_VIA_ENI_ROUTED, FRAG_VIA_POD, FRAG_VIA_REASSEMBLY, FragHook,
        FragKey, FragPath, REASSEMBLY_ADDR,
    },
};

use crate::{
    forward::{Verdict, restore_ttl, to_pod, via_eni},
    maps::{FRAG_PATHS, endpoint},
    packet::{Fragment, IP_DADDR_OFF, IP_SADDR_OFF, Ipv4, load, set_addr},
};

#[inline(always)]
const fn key(ip: &Ipv4, hook: FragHook) -> FragKey {
    key_to(ip, ip.daddr, hook)
}

/// The key of `ip`'s datagram as if addressed to `daddr`.
#[inline(always)]
const fn key_to(ip: &Ipv4, daddr: u32, hook: FragHook) -> FragKey {
    FragKey {
        saddr: ip.saddr,
        daddr,
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

/// A first fragment at an ENI's ingress whose later fragments came before
/// it and went to the stack's reassembly: it goes there too. `None`: it
/// came first, the caller decides.
#[inline(always)]
pub fn follow_reordered(ctx: &TcContext, ip: &Ipv4) -> Option<Result<Verdict, Counter>> {
    // SAFETY: read-only copy of a map value.
    let path = unsafe { FRAG_PATHS.get(key(ip, FragHook::EniIngress)) }.copied()?;
    (path.via == FRAG_VIA_REASSEMBLY).then(|| {
        send_like_first(
            ctx,
            ip,
            FragHook::EniIngress,
            &path,
            Counter::IngressFragmentReordered,
        )
    })
}

/// A later fragment at an ENI's ingress before its first
/// ([`FRAG_VIA_REASSEMBLY`]): the datagram, readdressed, goes through the
/// stack's reassembly; the fragments that follow, the first included, go
/// the same way.
#[inline(always)]
pub fn reorder(ctx: &TcContext, ip: &Ipv4) -> Result<Verdict, Counter> {
    if ip.daddr == REASSEMBLY_ADDR {
        // Sent to that address from outside: given back as it came, it
        // would go round again.
        return Ok(Counter::IngressNotNode.into());
    }
    // SAFETY: the context's skb is valid for the program's run.
    let arrived_on = unsafe { (*ctx.skb.skb).ifindex };
    let way = |addr| FragPath {
        addr,
        ifindex: arrived_on,
        via: FRAG_VIA_REASSEMBLY,
        _pad1: 0,
        _pad2: 0,
    };
    let back = key_to(ip, REASSEMBLY_ADDR, FragHook::Reassembly);
    if FRAG_PATHS.insert(back, way(ip.daddr), 0).is_err() {
        // Unrecorded, it could not come back: the stack has it as before.
        return Ok(Counter::IngressNoEntry.into());
    }
    // An LRU map: a datagram whose first fragment never comes ages out.
    let _ = FRAG_PATHS.insert(key(ip, FragHook::EniIngress), way(REASSEMBLY_ADDR), 0);
    set_addr(ctx, ip, IP_DADDR_OFF, ip.daddr, REASSEMBLY_ADDR, false)?;
    Ok(Counter::IngressFragmentReordered.into())
}

/// At an ENI's egress, a packet for [`REASSEMBLY_ADDR`]: a datagram the
/// stack reassembled, cut again in order. Each fragment gets the address
/// it arrived with back and returns to the ingress it arrived at, where
/// the first fragment now comes first. `None`: no datagram of ours.
#[inline(always)]
pub fn reassembled(ctx: &TcContext, ip: &Ipv4) -> Option<Result<Verdict, Counter>> {
    // SAFETY: read-only copy of a map value.
    let back = unsafe { FRAG_PATHS.get(key(ip, FragHook::Reassembly)) }.copied()?;
    Some(return_to_ingress(ctx, ip, &back))
}

#[inline(always)]
fn return_to_ingress(ctx: &TcContext, ip: &Ipv4, back: &FragPath) -> Result<Verdict, Counter> {
    let arrived = key_to(ip, back.addr, FragHook::EniIngress);
    if ip.fragment == Fragment::Later {
        // The stack sends a datagram's fragments first to last, and the
        // first cleared the way: a later one that finds it still set was
        // never reassembled (and would only go round again).
        // SAFETY: read-only copy of a map value.
        if unsafe { FRAG_PATHS.get(arrived) }.is_some_and(|way| way.via == FRAG_VIA_REASSEMBLY) {
            return Err(Counter::DropFragmentNotReassembled);
        }
    } else {
        // Back at the ingress, the first fragment is decided afresh.
        let _ = FRAG_PATHS.remove(arrived);
    }
    set_addr(
        ctx,
        ip,
        IP_DADDR_OFF,
        REASSEMBLY_ADDR,
        back.addr,
        ip.fragment != Fragment::Later,
    )?;
    // The stack's forwarding took one off; the ingress counts the hop.
    restore_ttl(ctx)?;
    // Addressed to the ENI itself (the stack framed it for the gateway),
    // so that the ingress takes it as the host's.
    let own_mac: [u8; 6] = load(ctx, 6)?;
    ctx.store(0, &own_mac, 0)
        .map_err(|_| Counter::DropRewrite)?;
    // SAFETY: a helper taking plain values.
    let action = unsafe { bpf_redirect(back.ifindex, u64::from(BPF_F_INGRESS)) };
    Ok(Verdict {
        counter: Counter::EgressReassembled,
        action: i32::try_from(action).unwrap_or(TC_ACT_UNSPEC),
        via: FRAG_VIA_REASSEMBLY,
        ifindex: back.ifindex,
    })
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
        // Only a first fragment on its way to reassembly carries an L4
        // header here.
        set_addr(
            ctx,
            ip,
            off,
            arrived,
            path.addr,
            ip.fragment == Fragment::First,
        )?;
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
