//! Forwarding without the stack: into a local pod (`bpf_redirect_peer`) or
//! out of an ENI to its subnet gateway (`bpf_redirect_neigh`).
//!
//! Why `bpf_redirect_neigh` with the gateway as next hop, not a FIB lookup:
//! the VPC CNI's per-ENI route table is exactly `default via <gateway> dev
//! ethN`, and the main table would send everything out of `eth0`. Naming
//! the ENI and its gateway from the ENI map is that table without any table,
//! and the kernel still resolves and caches the gateway's MAC.

use aya_ebpf::{
    bindings::{
        TC_ACT_UNSPEC, bpf_check_mtu_flags::BPF_MTU_CHK_SEGS, bpf_check_mtu_ret, bpf_redir_neigh,
        bpf_redir_neigh__bindgen_ty_1,
    },
    helpers::{bpf_check_mtu, bpf_redirect_neigh, bpf_redirect_peer},
    programs::TcContext,
};
use vpcnet_common::{
    config::{Config, MARK_DECIDED},
    counters::Counter,
    endpoint::Endpoint,
    nat::{FRAG_VIA_ENI_FORWARDED, FRAG_VIA_ENI_ROUTED, FRAG_VIA_PASS, FRAG_VIA_POD},
};

use crate::{
    maps::{ENIS, config},
    packet::{IP_CSUM_OFF, IP_TTL_OFF, load},
};

const AF_INET: u32 = 2;

/// What a program does with a packet: the counter of its verdict, the tc
/// action, and where a redirect sends it (a `FRAG_VIA_*` and the ENI's
/// link), which a datagram's later fragments repeat.
pub struct Verdict {
    pub counter: Counter,
    pub action: i32,
    pub via: u8,
    pub ifindex: u32,
}

impl Verdict {
    /// Passed on (`TC_ACT_UNSPEC`: programs after ours still see it).
    pub const fn pass(counter: Counter) -> Self {
        Self {
            counter,
            action: TC_ACT_UNSPEC,
            via: FRAG_VIA_PASS,
            ifindex: 0,
        }
    }
}

impl From<Counter> for Verdict {
    fn from(counter: Counter) -> Self {
        Self::pass(counter)
    }
}

/// Whether routing the packet would expire its TTL.
#[inline(always)]
pub fn ttl_expires(ctx: &TcContext) -> Result<bool, Counter> {
    let ttl: u8 = load(ctx, IP_TTL_OFF)?;
    Ok(ttl <= 1)
}

/// Whether the packet fits the MTU of link `ifindex`, each of its segments
/// for a GSO packet, as the stack checks before it forwards. One that does
/// not goes to the stack, which answers "fragmentation needed" if it may
/// not be fragmented and fragments it if it may: the link would drop it
/// without a word (a veth lets a GSO packet by whole, a NIC does not).
#[inline(always)]
pub fn fits(ctx: &TcContext, ifindex: u32) -> bool {
    // In: 0, the skb's own length. Out: the link's MTU, unused.
    let mut mtu_len: u32 = 0;
    // SAFETY: the context's skb and a local the helper writes.
    let ret = unsafe {
        bpf_check_mtu(
            ctx.skb.skb.cast(),
            ifindex,
            &raw mut mtu_len,
            0,
            u64::from(BPF_MTU_CHK_SEGS),
        )
    };
    // An error (no such link) is not a size: the redirect tells.
    !matches!(
        u32::try_from(ret),
        Ok(bpf_check_mtu_ret::BPF_MTU_CHK_RET_FRAG_NEEDED
            | bpf_check_mtu_ret::BPF_MTU_CHK_RET_SEGS_TOOBIG)
    )
}

/// Marks the packet as decided: `eni_egress` passes it as it is.
#[inline(always)]
pub fn mark_decided(ctx: &TcContext) {
    // SAFETY: the context's skb is valid for the program's run.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(mark | config().map_or(MARK_DECIDED, Config::mark_decided));
}

/// Decrements the TTL as a router does. `false`: it would expire, and the
/// packet is better left to the stack, which answers time exceeded.
#[inline(always)]
fn decrement_ttl(ctx: &TcContext) -> Result<bool, Counter> {
    let word: u16 = load(ctx, IP_TTL_OFF)?;
    let ttl = word.to_ne_bytes()[0];
    if ttl <= 1 {
        return Ok(false);
    }
    store_ttl(ctx, word, ttl - 1)?;
    Ok(true)
}

/// Gives back the hop the stack's forwarding took off (TTL up by one).
#[inline(always)]
pub fn restore_ttl(ctx: &TcContext) -> Result<(), Counter> {
    let word: u16 = load(ctx, IP_TTL_OFF)?;
    store_ttl(ctx, word, word.to_ne_bytes()[0].saturating_add(1))
}

/// Sets the TTL to `ttl`; `word` is the TTL and protocol as they are,
/// one 16-bit word of the header checksum.
#[inline(always)]
fn store_ttl(ctx: &TcContext, word: u16, ttl: u8) -> Result<(), Counter> {
    let new = u16::from_ne_bytes([ttl, word.to_ne_bytes()[1]]);
    ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(word), u64::from(new), 2)
        .map_err(|_| Counter::DropRewrite)?;
    ctx.store(IP_TTL_OFF, &new, 0)
        .map_err(|_| Counter::DropRewrite)
}

/// Delivers the packet into a local pod, straight into its namespace: the
/// frame is addressed from the pod's gateway (the host veth) to the pod.
/// Unlike a link's transmit, the pod's receive path takes any size, so
/// nothing is checked against the pod's MTU (a smaller `POD_MTU` bounds
/// what the pod sends): a bigger packet is delivered where the stack would
/// have fragmented it or answered "fragmentation needed".
#[inline(always)]
pub fn to_pod(ctx: &TcContext, ep: &Endpoint, counter: Counter) -> Result<Verdict, Counter> {
    if !decrement_ttl(ctx)? {
        return Ok(Verdict::pass(Counter::TtlToStack));
    }
    let mut macs = [0u8; 12];
    macs[..6].copy_from_slice(&ep.mac);
    macs[6..].copy_from_slice(&ep.host_mac);
    ctx.store(0, &macs, 0).map_err(|_| Counter::DropRewrite)?;
    // SAFETY: a helper taking plain values.
    let action = unsafe { bpf_redirect_peer(ep.ifindex, 0) };
    Ok(Verdict {
        counter,
        action: i32::try_from(action).unwrap_or(TC_ACT_UNSPEC),
        via: FRAG_VIA_POD,
        ifindex: 0,
    })
}

/// Sends the packet out of the ENI on link `eni_ifindex`, to that ENI's
/// gateway. `forwarded`: the packet is being routed here (not already by
/// the stack), so its TTL goes down by one.
#[inline(always)]
pub fn via_eni(
    ctx: &TcContext,
    eni_ifindex: u32,
    forwarded: bool,
    counter: Counter,
) -> Result<Verdict, Counter> {
    // SAFETY: read-only copy of a map value.
    let Some(eni) = (unsafe { ENIS.get(eni_ifindex) }).copied() else {
        return Err(Counter::DropNoEni);
    };
    if forwarded && !decrement_ttl(ctx)? {
        return Ok(Verdict::pass(Counter::TtlToStack));
    }
    mark_decided(ctx);
    let mut next_hop = bpf_redir_neigh {
        nh_family: AF_INET,
        __bindgen_anon_1: bpf_redir_neigh__bindgen_ty_1 {
            ipv4_nh: eni.gateway,
        },
    };
    // SAFETY: `next_hop` lives across the call, its size is passed along.
    let action = unsafe {
        bpf_redirect_neigh(
            eni_ifindex,
            &raw mut next_hop,
            core::mem::size_of::<bpf_redir_neigh>() as i32,
            0,
        )
    };
    Ok(Verdict {
        counter,
        action: i32::try_from(action).unwrap_or(TC_ACT_UNSPEC),
        via: if forwarded {
            FRAG_VIA_ENI_FORWARDED
        } else {
            FRAG_VIA_ENI_ROUTED
        },
        ifindex: eni_ifindex,
    })
}
