//! `pod_egress` and `pod_ingress`: what a local pod sends, and what the
//! stack hands it.

use vpcnet_common::{
    cidr::CidrKind,
    config::{MARK_DECIDED, MARK_VIA_SERVICE},
    counters::Counter,
    endpoint::Endpoint,
    nat::{FlowKind, FragHook},
};

use super::{
    Decided, Frag, IP, Ip, Model, Out, Run,
    eni_egress::leaves_untranslated,
    headers::{ip_at, key, l4_at},
};

impl Model {
    pub(super) fn pod_egress(&mut self, run: &mut Run) -> Decided {
        if !Self::ipv4(&run.p) {
            return Ok(Out::pass(Counter::PodNotIpv4));
        }
        if !self.configured() {
            return Ok(Out::pass(Counter::EgressUnconfigured));
        }
        let ip = ip_at(&run.p, IP)?;
        let ep = self
            .world
            .endpoints
            .get(&ip.saddr)
            .copied()
            .filter(|ep| ep.ifindex == self.world.ifindex)
            .ok_or(Counter::DropSpoofedAddr)?;
        if run.p[6..12] != ep.mac {
            return Err(Counter::DropSpoofedMac);
        }
        // A service's backend is judged after kube-proxy's DNAT.
        if self.world.prefix_kind(ip.daddr) != Some(CidrKind::Service) {
            self.admit(run)?;
        }
        if ep.strict() {
            if self.world.prefix_kind(ip.daddr) == Some(CidrKind::Service) {
                return Ok(Self::to_service(run));
            }
            return self.out_of_eni(run, ep.eni_ifindex, true, Counter::PodStrict);
        }
        if ip.frag == Frag::Later {
            return match self.first_fragment(&ip, FragHook::PodEgress) {
                Some(first) => {
                    self.like_first(run, &ip, FragHook::PodEgress, first, Counter::PodFragment)
                }
                None => Ok(Out::pass(Counter::PodFragment)),
            };
        }
        let out = self.sent_by_pod(run, &ip, &ep)?;
        if ip.frag == Frag::First {
            self.remember_first(run, &ip, FragHook::PodEgress, out);
        }
        Ok(out)
    }

    pub(super) fn sent_by_pod(&mut self, run: &mut Run, ip: &Ip, ep: &Endpoint) -> Decided {
        if let Some(l4) = l4_at(&run.p, ip)? {
            let own = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
            if self.stack_packet(&own, l4) {
                return Ok(Out::pass(Counter::PodStackFlow));
            }
        }
        if let Some(dst) = self
            .world
            .endpoints
            .get(&ip.daddr)
            .copied()
            .filter(|d| !d.strict())
        {
            return Ok(Self::into_pod(run, &dst, Counter::PodToPod));
        }
        match self.world.prefix_kind(ip.daddr) {
            Some(CidrKind::Service) => Ok(Self::to_service(run)),
            Some(CidrKind::Local) => Ok(Out::pass(Counter::PodToLocal)),
            Some(CidrKind::Vpc | CidrKind::Excluded) => {
                self.out_of_eni(run, ep.eni_ifindex, true, Counter::PodSteered)
            }
            None => {
                if self.world.config.primary_ifindex == 0 || run.ttl() <= 1 {
                    return Ok(Out::pass(Counter::PodToSnat));
                }
                let decision = self.snat_decision(run, ip)?;
                run.count(decision);
                let leave_by = match decision {
                    Counter::EgressSnatNew | Counter::EgressSnat | Counter::EgressIcmpErrorNat => {
                        self.world.config.primary_ifindex
                    }
                    _ if leaves_untranslated(decision) => ep.eni_ifindex,
                    _ => {
                        run.mark |= MARK_DECIDED;
                        return Ok(Out::pass(Counter::PodToSnat));
                    }
                };
                self.out_of_eni(run, leave_by, true, Counter::PodOutsideVpc)
            }
        }
    }

    pub(super) fn to_service(run: &mut Run) -> Out {
        run.mark |= MARK_VIA_SERVICE;
        Out::pass(Counter::PodToService)
    }

    pub(super) fn pod_ingress(&mut self, run: &mut Run) -> Decided {
        if !Self::ipv4(&run.p) {
            return Ok(Out::pass(Counter::PodNotIpv4));
        }
        let ip = ip_at(&run.p, IP)?;
        if ip.frag == Frag::Later {
            return Ok(Out::pass(Counter::PodFragment));
        }
        // From a service's address: a reply kube-proxy un-DNATed, of a
        // connection judged on its way to the backend.
        if self.world.prefix_kind(ip.saddr) != Some(CidrKind::Service) {
            self.admit(run)?;
        }
        let Some(l4) = l4_at(&run.p, &ip)? else {
            return Ok(Out::pass(Counter::PodIngressStack));
        };
        let arriving = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        if !self.stack_packet(&arriving, l4) {
            self.stack_new(run, &arriving.reversed(), FlowKind::StackToPod, l4);
        }
        Ok(Out::pass(Counter::PodIngressStack))
    }
}
