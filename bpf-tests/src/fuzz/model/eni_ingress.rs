//! `eni_ingress`: replies of translated flows, inbound flows, and what is
//! delivered straight into a local pod.

use vpcnet_common::{
    counters::Counter,
    nat::{FRAG_VIA_REASSEMBLY, FlowKind, FragHook, PROTO_ICMP, PROTO_TCP},
};

use super::{
    Decided, Frag, IP, Ip, Model, Out, Ports, Run,
    headers::{
        ip_at, is_icmp_error, is_icmp_reply, key, l4_at, may_open, progressed, quoted, raw32,
    },
};

impl Model {
    pub(super) fn eni_ingress(&mut self, run: &mut Run) -> Decided {
        if !Self::ipv4(&run.p) {
            return Ok(Out::pass(Counter::IngressNotIpv4));
        }
        if !self.configured() {
            return Ok(Out::pass(Counter::IngressNotNode));
        }
        let node = self.world.config.node_addr;
        let ip = ip_at(&run.p, IP)?;
        if ip.frag == Frag::Later {
            if let Some(first) = self.first_fragment(&ip, FragHook::EniIngress) {
                return self.like_first(
                    run,
                    &ip,
                    FragHook::EniIngress,
                    first,
                    Counter::IngressFragment,
                );
            }
            return Ok(self.reorder(run, &ip));
        }
        if ip.frag == Frag::First
            && let Some(first) = self.first_fragment(&ip, FragHook::EniIngress)
            && first.via == FRAG_VIA_REASSEMBLY
        {
            return self.like_first(
                run,
                &ip,
                FragHook::EniIngress,
                first,
                Counter::IngressFragmentReordered,
            );
        }
        let decision = if ip.daddr == node {
            self.for_node(run, &ip)?
        } else {
            self.for_other_address(run, &ip)?
        };
        let out = match decision {
            Counter::IngressRevSnat
            | Counter::IngressIcmpErrorRevNat
            | Counter::IngressNotNode
            | Counter::IngressInboundTracked => self.deliver(run, decision)?,
            _ => Out::pass(decision),
        };
        if ip.frag == Frag::First {
            self.remember_first(run, &ip, FragHook::EniIngress, out);
        }
        Ok(out)
    }

    /// A packet for the node's address: a reply of a translated flow, or
    /// an ICMP error about one, goes back to whoever sent the flow.
    pub(super) fn for_node(&mut self, run: &mut Run, ip: &Ip) -> Result<Counter, Counter> {
        let l4 = l4_at(&run.p, ip)?.unwrap_or(Ports::NONE);
        if ip.proto == PROTO_ICMP && !is_icmp_reply(l4.icmp_type) {
            if is_icmp_error(l4.icmp_type) {
                return Ok(self.icmp_error_in(run, ip));
            }
            return Ok(Counter::IngressNoEntry);
        }
        let claim = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        let now = self.now;
        let Some(rev) = self.tables.nat_rev.get_mut(&claim) else {
            return Ok(Counter::IngressNoEntry);
        };
        rev.record(l4, now);
        let rev = *rev;
        if rev.addr != self.world.config.node_addr {
            run.set_addr(ip, false, rev.addr, true);
        }
        let at = ip.l4 + if ip.proto == PROTO_ICMP { 4 } else { 2 };
        if rev.port != claim.dport {
            run.set_port(ip, at, rev.port);
        }
        Ok(if rev.kind == FlowKind::Host as u8 {
            Counter::IngressHost
        } else {
            Counter::IngressRevSnat
        })
    }

    pub(super) fn icmp_error_in(&mut self, run: &mut Run, outer: &Ip) -> Counter {
        let Some((inner, about)) = quoted(&run.p, outer) else {
            return Counter::IngressNoEntry;
        };
        if about.saddr != self.world.config.node_addr {
            return Counter::IngressNoEntry;
        }
        let Some(rev) = self.tables.nat_rev.get(&about.reversed()).copied() else {
            return Counter::IngressNoEntry;
        };
        if rev.kind == FlowKind::Host as u8 && rev.port == about.sport {
            return Counter::IngressHost;
        }
        Self::rewrite_quoted(run, outer, &inner, true, rev.addr, rev.port);
        Counter::IngressIcmpErrorRevNat
    }

    /// A packet for another address than the node's: flows opened from
    /// outside the VPC are tracked.
    pub(super) fn for_other_address(&mut self, run: &mut Run, ip: &Ip) -> Result<Counter, Counter> {
        if self.world.prefix_kind(ip.saddr).is_some() {
            return Ok(Counter::IngressNotNode);
        }
        let l4 = l4_at(&run.p, ip)?.unwrap_or(Ports::NONE);
        let arriving = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        let now = self.now;
        if let Some(rev) = self.tables.nat_rev.get(&arriving).copied() {
            if ip.proto == PROTO_TCP && l4.syn_only() && progressed(rev.seen) {
                let pod_side = key(
                    rev.addr,
                    arriving.saddr,
                    rev.port,
                    arriving.sport,
                    arriving.proto,
                );
                if let Some(fwd) = self.tables.nat_fwd.get_mut(&pod_side) {
                    fwd.kind = FlowKind::Inbound as u8;
                    fwd.restart(None, now);
                    let rev = self.tables.nat_rev.get_mut(&arriving).expect("looked up");
                    rev.kind = FlowKind::Inbound as u8;
                    rev.restart(Some(l4), now);
                }
            } else {
                self.tables
                    .nat_rev
                    .get_mut(&arriving)
                    .expect("looked up")
                    .record(l4, now);
            }
            return Ok(Counter::IngressNotNode);
        }
        if !may_open(ip.proto, l4) {
            return Ok(Counter::IngressNotNode);
        }
        if !self.track_untranslated(run, &arriving.reversed(), FlowKind::Inbound, l4) {
            return Err(Counter::DropInboundUntracked);
        }
        Ok(Counter::IngressInboundTracked)
    }

    /// Into a local pod, unless a strict pod's packet came by another ENI
    /// than its branch, or the flow is one the stack must see.
    pub(super) fn deliver(&mut self, run: &mut Run, decision: Counter) -> Decided {
        let daddr = raw32(&run.p, IP + 16).ok_or(Counter::DropTruncated)?;
        let Some(ep) = self.world.endpoints.get(&daddr).copied() else {
            return Ok(Out::pass(decision));
        };
        if ep.strict() && ep.eni_ifindex != self.world.ifindex {
            return Ok(Out::pass(decision));
        }
        let ip = ip_at(&run.p, IP)?;
        let stack_flow = match l4_at(&run.p, &ip)? {
            None => false,
            Some(l4) if ip.proto == PROTO_ICMP && is_icmp_error(l4.icmp_type) => {
                quoted(&run.p, &ip)
                    .is_some_and(|(_, about)| self.tables.stack.contains_key(&about.reversed()))
            }
            Some(l4) => {
                self.stack_packet(&key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto), l4)
            }
        };
        run.count(decision);
        if stack_flow {
            return Ok(Out::pass(Counter::IngressStackFlow));
        }
        self.admit(run)?;
        Ok(Self::into_pod(run, &ep, Counter::IngressToPod))
    }
}
