//! The pod side: tc ingress of a pod's host veth (`pod_egress`: what the pod
//! sends) and tc egress of it (`pod_ingress`: what the stack hands the pod).
//!
//! What a pod sends, in order: its own address and MAC or it is dropped;
//! a strict security-group pod's packets all leave by its branch ENI; a
//! reply of a flow that reached the pod through the stack goes back through
//! it (kube-proxy must undo its DNAT); to a local pod, straight into it; to
//! a service CIDR or a node address, to the stack; from a pod on a secondary
//! ENI to one of `AWS_EXTERNAL_SERVICE_CIDRS`, to the stack too, whose route
//! it takes as aws-node's rule 1535 makes it; to the VPC or an excluded CIDR,
//! out of the pod's own ENI to its gateway; anything else gets the SNAT
//! decision here, as `eni_egress` would make it, and leaves by the primary
//! ENI translated (or by its own ENI un-NATed), past the stack.

use aya_ebpf::programs::TcContext;
use vpcnet_common::{
    cidr::CidrKind,
    config::{Config, MARK_VIA_SERVICE},
    counters::Counter,
    endpoint::Endpoint,
    nat::{FlowKey, FlowKind, FragHook},
};

use crate::{
    cidr, egress,
    forward::{self, Verdict, mark_decided, to_pod, via_eni},
    frag,
    maps::{config, count, endpoint, endpoint_ref},
    packet::{ETH_HLEN, Fragment, Ipv4, L4, is_ipv4, parse_ipv4, parse_l4, src_mac},
    policy, stack,
};

/// `pod_egress`: a packet from a pod. Inlined into the program, as
/// `egress::handle` is.
#[inline(always)]
pub fn egress(ctx: &TcContext) -> Result<Verdict, Counter> {
    if !is_ipv4(ctx) {
        return Ok(Counter::PodNotIpv4.into());
    }
    let Some(cfg) = config() else {
        return Ok(Counter::EgressUnconfigured.into());
    };
    if cfg.node_addr == 0 {
        return Ok(Counter::EgressUnconfigured.into());
    }
    let ip = parse_ipv4(ctx, ETH_HLEN)?;
    // Anti-spoofing: the source must be a pod behind this very veth, with
    // that pod's MAC.
    let ep = endpoint(ip.saddr).ok_or(Counter::DropSpoofedAddr)?;
    // SAFETY: the context's skb is valid for the program's run.
    if ep.ifindex != unsafe { (*ctx.skb.skb).ifindex } {
        return Err(Counter::DropSpoofedAddr);
    }
    if src_mac(ctx)? != ep.mac {
        return Err(Counter::DropSpoofedMac);
    }
    // The destination pod and the L4 header are each read once, for
    // policy and the path: the path of a strict pod's packet or a later
    // fragment needs neither.
    let (dst_pod, l4) = if ip.fragment == Fragment::Later {
        (None, None)
    } else if cfg.network_policy() {
        let dst_pod = endpoint_ref(ip.daddr);
        // Policy judges a service's backend, after kube-proxy's DNAT (in
        // `pod_ingress` or `eni_egress`), not the service's address. A
        // pod's address is no service's: its hash lookup spares the
        // prefix walk.
        if dst_pod.is_some() || cidr::lookup(ip.daddr) != Some(CidrKind::Service) {
            let l4 = parse_l4(ctx, &ip)?;
            policy::admit_parsed(ctx, cfg, &ip, l4)?;
            (dst_pod, l4)
        } else if ep.strict() {
            (dst_pod, None)
        } else {
            (dst_pod, parse_l4(ctx, &ip)?)
        }
    } else if ep.strict() {
        (None, None)
    } else {
        (endpoint_ref(ip.daddr), parse_l4(ctx, &ip)?)
    };
    if ep.strict() {
        // Services still need kube-proxy's DNAT; the stack's route then
        // meets `eni_egress`, which sends it out of the branch ENI.
        if cidr::lookup(ip.daddr) == Some(CidrKind::Service) {
            return Ok(to_stack_and_back(ctx, Counter::PodToService));
        }
        return route_via_eni(ctx, ep.eni_ifindex, Counter::PodStrict);
    }
    if ip.fragment == Fragment::Later {
        return frag::follow(ctx, &ip, FragHook::PodEgress, Counter::PodFragment)
            .unwrap_or_else(|| Ok(Counter::PodFragment.into()));
    }
    let verdict = whole_or_first(ctx, cfg, &ip, l4, &ep, dst_pod)?;
    if ip.fragment == Fragment::First {
        frag::remember(ctx, &ip, FragHook::PodEgress, &verdict);
    }
    Ok(verdict)
}

/// Where a pod's packet goes, for a whole packet or a first fragment
/// (`l4`: what [`parse_l4`] read of it).
#[inline(always)]
fn whole_or_first(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: Option<L4>,
    ep: &Endpoint,
    dst_pod: Option<&Endpoint>,
) -> Result<Verdict, Counter> {
    if let Some(l4) = l4 {
        let key = FlowKey::new(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        if stack::record(&key, &l4) {
            return Ok(Counter::PodStackFlow.into());
        }
    }
    if let Some(dst) = dst_pod {
        // A strict pod takes packets only from its branch ENI: reach it
        // through the VPC like any other VPC address.
        if !dst.strict() {
            return to_pod(ctx, dst, Counter::PodToPod);
        }
    }
    match cidr::lookup(ip.daddr) {
        Some(CidrKind::Service) => Ok(to_stack_and_back(ctx, Counter::PodToService)),
        Some(CidrKind::Local) => Ok(Counter::PodToLocal.into()),
        // A pod on the primary ENI leaves by it either way.
        _ if ep.eni_ifindex != cfg.primary_ifindex && cidr::external_service(ip.daddr) => {
            Ok(to_stack_and_back(ctx, Counter::PodExternalService))
        }
        Some(CidrKind::Vpc | CidrKind::Excluded) => {
            route_via_eni(ctx, ep.eni_ifindex, Counter::PodSteered)
        }
        None => outside_vpc(ctx, cfg, ip, l4, ep),
    }
}

/// A packet to outside the VPC: the SNAT decision and the NAT, then out of
/// the ENI the packet must leave by, as the stack's route and `eni_egress`
/// would have sent it, without the stack's cost.
#[inline(always)]
fn outside_vpc(
    ctx: &TcContext,
    cfg: &Config,
    ip: &Ipv4,
    l4: Option<L4>,
    ep: &Endpoint,
) -> Result<Verdict, Counter> {
    // The stack answers an expiring TTL with time exceeded to the pod; after
    // the NAT it would answer the node.
    if cfg.primary_ifindex == 0 || forward::ttl_expires(ctx)? {
        return Ok(Counter::PodToSnat.into());
    }
    // Sizes too are checked before the NAT, against either ENI it may
    // leave by: the stack answers the pod, or fragments the packet and
    // `eni_egress` translates each fragment.
    if !forward::fits(ctx, cfg.primary_ifindex)
        || (ep.eni_ifindex != cfg.primary_ifindex && !forward::fits(ctx, ep.eni_ifindex))
    {
        return Ok(Counter::ForwardTooBig.into());
    }
    let decision = egress::decide_ipv4(ctx, cfg, ip, l4)?;
    count(decision);
    let leave_by = match decision {
        // Now from the node's address: the stack would drop it as a martian.
        Counter::EgressSnatNew | Counter::EgressSnat | Counter::EgressIcmpErrorNat => {
            cfg.primary_ifindex
        }
        _ if egress::leaves_untranslated(decision) => ep.eni_ifindex,
        _ => {
            // No decision comes here today: each one translated the
            // packet or keeps the pod's address. Should one, the stack
            // routes the packet, and `eni_egress` must not decide it again.
            mark_decided(ctx);
            return Ok(Counter::PodToSnat.into());
        }
    };
    via_eni(ctx, leave_by, true, Counter::PodOutsideVpc)
}

/// Out of the ENI on link `eni_ifindex`, routed here: one too big for it
/// goes to the stack, see [`forward::fits`].
#[inline(always)]
fn route_via_eni(ctx: &TcContext, eni_ifindex: u32, counter: Counter) -> Result<Verdict, Counter> {
    if !forward::fits(ctx, eni_ifindex) {
        return Ok(Counter::ForwardTooBig.into());
    }
    via_eni(ctx, eni_ifindex, true, counter)
}

/// A packet the stack must route (a service, for kube-proxy's DNAT; an
/// external service CIDR, for the node's route) goes to it marked so that
/// `eni_egress` remembers the flow: its replies must come back through the
/// stack too (to be un-DNATed; for conntrack to see both ways).
#[inline(always)]
fn to_stack_and_back(ctx: &TcContext, counter: Counter) -> Verdict {
    // SAFETY: the context's skb is valid for the program's run.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(mark | config().map_or(MARK_VIA_SERVICE, Config::mark_via_service));
    counter.into()
}

/// `pod_ingress`: a packet the node's stack hands a pod. The stack only
/// gets to do that for flows our fast paths did not take (kube-proxy's
/// DNAT, the node's own sockets): policy judges it, and the flow is
/// remembered so the pod's replies go back through the stack too.
pub fn ingress(ctx: &TcContext) -> Result<Verdict, Counter> {
    if !is_ipv4(ctx) {
        return Ok(Counter::PodNotIpv4.into());
    }
    let ip = parse_ipv4(ctx, ETH_HLEN)?;
    if ip.fragment == Fragment::Later {
        return Ok(Counter::PodFragment.into());
    }
    // From a service's address: a reply kube-proxy un-DNATed, of a
    // connection policy judged on its way to the backend.
    if let Some(cfg) = config()
        && cfg.network_policy()
        && cidr::lookup(ip.saddr) != Some(CidrKind::Service)
    {
        policy::admit_in(ctx, cfg)?;
    }
    let Some(l4) = parse_l4(ctx, &ip)? else {
        return Ok(Counter::PodIngressStack.into());
    };
    let arriving = FlowKey::new(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
    if !stack::record(&arriving, &l4) {
        stack::remember(&arriving.reversed(), FlowKind::StackToPod, &l4);
    }
    Ok(Counter::PodIngressStack.into())
}
