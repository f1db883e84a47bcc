//! `eni_egress`: the SNAT decision, new translated flows and their ports,
//! ICMP errors about translated flows, and what leaves untranslated.

use vpcnet_common::{
    cidr::CidrKind,
    config::{MARK_DECIDED, MARK_VIA_SERVICE, RandomizeMode},
    counters::Counter,
    endpoint::{ENI_BRANCH, Endpoint},
    nat::{FlowKey, FlowKind, FragHook, PROTO_ICMP, PROTO_TCP, PROTO_UDP, REASSEMBLY_ADDR},
};

use super::{
    Decided, Frag, Half, IP, Ip, Model, Out, Ports, Run,
    headers::{
        ip_at, is_icmp_error, is_icmp_reply, is_icmp_request, key, l4_at, may_open, progressed,
        quoted, raw16, raw32, untranslated,
    },
    rewrite::{moved, ones_sum_without},
};

impl Model {
    pub(super) fn eni_egress(&mut self, run: &mut Run) -> Decided {
        if run.mark & MARK_DECIDED != 0 {
            run.mark &= !MARK_DECIDED;
            if !Self::ipv4(&run.p) || self.decided_here(run)? {
                return Ok(Out::pass(Counter::EgressDecided));
            }
            run.count(Counter::EgressDecidedRechecked);
        }
        if run.mark & MARK_VIA_SERVICE != 0 {
            run.mark &= !MARK_VIA_SERVICE;
            if Self::ipv4(&run.p) {
                // The pod's egress rules judge the backend kube-proxy chose.
                self.admit(run)?;
                self.service_flow(run)?;
            }
        }
        if !Self::ipv4(&run.p) {
            return Ok(Out::pass(Counter::EgressNotIpv4));
        }
        if !self.configured() {
            return Ok(Out::pass(Counter::EgressUnconfigured));
        }
        let ip = ip_at(&run.p, IP)?;
        if ip.daddr == REASSEMBLY_ADDR
            && let Some(decided) = self.reassembled(run, &ip)
        {
            return decided;
        }
        if ip.frag == Frag::Later {
            if let Some(first) = self.first_fragment(&ip, FragHook::EniEgress) {
                return self.like_first(
                    run,
                    &ip,
                    FragHook::EniEgress,
                    first,
                    Counter::EgressFragment,
                );
            }
            return if self.world.prefix_kind(ip.daddr).is_some() {
                self.steer(run, Counter::EgressNoSnatCidr)
            } else {
                Err(Counter::DropFragmentNoFlow)
            };
        }
        let decision = self.snat_decision(run, &ip)?;
        let out = if leaves_untranslated(decision) {
            self.steer(run, decision)?
        } else {
            Out::pass(decision)
        };
        if ip.frag == Frag::First {
            self.remember_first(run, &ip, FragHook::EniEgress, out);
        }
        Ok(out)
    }

    /// A pod's packet kube-proxy DNATed: its flow goes through the stack.
    pub(super) fn service_flow(&mut self, run: &mut Run) -> Result<(), Counter> {
        let ip = ip_at(&run.p, IP)?;
        if ip.frag == Frag::Later {
            return Ok(());
        }
        if let Some(l4) = l4_at(&run.p, &ip)? {
            let pod_side = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
            if !self.stack_packet(&pod_side, l4) {
                self.stack_new(&pod_side, FlowKind::StackFromPod, l4);
            }
            run.count(Counter::EgressServiceFlow);
        }
        Ok(())
    }

    /// A packet leaving with a pod's own address leaves by that pod's ENI.
    pub(super) fn steer(&mut self, run: &mut Run, decision: Counter) -> Decided {
        let saddr = raw32(&run.p, IP + 12).ok_or(Counter::DropTruncated)?;
        let Some(ep) = self.world.endpoints.get(&saddr).copied() else {
            return Ok(Out::pass(decision));
        };
        if ep.eni_ifindex == self.world.ifindex {
            return Ok(Out::pass(decision));
        }
        run.count(decision);
        self.out_of_eni(run, ep.eni_ifindex, false, Counter::EgressSteered)
    }

    /// The SNAT decision and the NAT, for a whole packet or a first
    /// fragment leaving the node.
    pub(super) fn snat_decision(&mut self, run: &mut Run, ip: &Ip) -> Result<Counter, Counter> {
        let l4 = l4_at(&run.p, ip)?.unwrap_or(Ports::NONE);
        if ip.proto == PROTO_ICMP && !is_icmp_request(l4.icmp_type) && !is_icmp_reply(l4.icmp_type)
        {
            if is_icmp_error(l4.icmp_type) {
                return Ok(self.icmp_error_out(run, ip));
            }
            return Ok(Counter::EgressIcmpOther);
        }
        let flow = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        if let Some(half) = self.tables.nat_fwd.get(&flow).copied() {
            if ip.proto == PROTO_TCP && l4.syn_only() && progressed(half.seen) {
                let claim = key(flow.daddr, half.addr, flow.dport, half.port, flow.proto);
                match self.tables.nat_rev.get_mut(&claim) {
                    Some(rev) if rev.addr == flow.saddr && rev.port == flow.sport => {
                        rev.restart(None);
                        if untranslated(half.kind) {
                            rev.kind = FlowKind::NoSnat as u8;
                        }
                        let fwd = self.tables.nat_fwd.get_mut(&flow).expect("looked up");
                        fwd.restart(Some(l4));
                        if untranslated(half.kind) {
                            fwd.kind = FlowKind::NoSnat as u8;
                        }
                        run.count(Counter::EgressReopen);
                        return Ok(self.translate(run, ip, &flow, false));
                    }
                    _ => {
                        self.tables.nat_fwd.remove(&flow);
                        return self.new_flow(run, ip, l4, &flow);
                    }
                }
            }
            self.tables
                .nat_fwd
                .get_mut(&flow)
                .expect("looked up")
                .record(l4);
            return Ok(self.translate(run, ip, &flow, false));
        }
        self.new_flow(run, ip, l4, &flow)
    }

    pub(super) fn new_flow(
        &mut self,
        run: &mut Run,
        ip: &Ip,
        l4: Ports,
        flow: &FlowKey,
    ) -> Result<Counter, Counter> {
        match self.world.prefix_kind(ip.daddr) {
            Some(CidrKind::Local) => return Ok(Counter::EgressLocal),
            Some(CidrKind::Vpc | CidrKind::Excluded) => return Ok(Counter::EgressNoSnatCidr),
            Some(CidrKind::Service) | None => {}
        }
        if !may_open(ip.proto, l4) {
            return Ok(Counter::EgressNotOpening);
        }
        let on_branch = self
            .world
            .enis
            .get(&self.world.ifindex)
            .is_some_and(|eni| eni.flags & ENI_BRANCH != 0);
        if on_branch
            || self
                .world
                .endpoints
                .get(&ip.saddr)
                .is_some_and(Endpoint::strict)
        {
            return Ok(Counter::EgressBranchNoSnat);
        }
        if ip.saddr == self.world.config.node_addr {
            return Ok(match self.claim(run, ip, flow, FlowKind::Host, l4) {
                Ok(()) => self.translate(run, ip, flow, true),
                Err(_) => Counter::EgressHostUntracked,
            });
        }
        if self.world.config.external_snat() {
            self.track_untranslated(flow, FlowKind::NoSnat, l4);
            return Ok(Counter::EgressExternalSnatNew);
        }
        self.claim(run, ip, flow, FlowKind::Snat, l4)?;
        Ok(self.translate(run, ip, flow, true))
    }

    /// Whether a packet marked decided passes as it is: translated, or
    /// needing no NAT; a pod's packet for outside the VPC is decided again.
    fn decided_here(&self, run: &Run) -> Result<bool, Counter> {
        let config = &self.world.config;
        if config.node_addr == 0 || config.external_snat() {
            return Ok(true);
        }
        let saddr = raw32(&run.p, IP + 12).ok_or(Counter::DropTruncated)?;
        if saddr == config.node_addr {
            return Ok(true);
        }
        let daddr = raw32(&run.p, IP + 16).ok_or(Counter::DropTruncated)?;
        Ok(self.world.prefix_kind(daddr).is_some())
    }

    /// A port for a new translated flow: the one the program chose, read
    /// from its output and checked against the rules.
    pub(super) fn claim(
        &mut self,
        run: &mut Run,
        ip: &Ip,
        flow: &FlowKey,
        kind: FlowKind,
        l4: Ports,
    ) -> Result<(), Counter> {
        let node = self.world.config.node_addr;
        let claim_of = |port: u16| key(flow.daddr, node, flow.dport, port, flow.proto);
        let portless = !matches!(ip.proto, PROTO_TCP | PROTO_UDP | PROTO_ICMP);
        let port = if portless {
            if self.tables.nat_rev.contains_key(&claim_of(0)) {
                return Err(Counter::DropNatNoPort);
            }
            0
        } else {
            let at = ip.l4 + if ip.proto == PROTO_ICMP { 4 } else { 0 };
            let chosen = raw16(run.actual, at).unwrap_or_default();
            let (min, max) = self.world.port_range();
            let own = u16::from_be(flow.sport);
            let first = match kind {
                FlowKind::Host => Some(own),
                _ if self.world.config.randomize_mode() == RandomizeMode::None
                    && (min..=max).contains(&own) =>
                {
                    Some(own)
                }
                _ => None,
            };
            let host_order = u16::from_be(chosen);
            if self.tables.nat_rev.contains_key(&claim_of(chosen)) {
                run.bad_choice = Some(format!(
                    "port {host_order} is held by another flow to the same endpoint"
                ));
            } else if let Some(first) =
                first.filter(|f| !self.tables.nat_rev.contains_key(&claim_of(f.to_be())))
            {
                if host_order != first {
                    run.bad_choice = Some(format!(
                        "port {host_order}, not {first}, which was free and is tried first"
                    ));
                }
            } else if !(min..=max).contains(&host_order) {
                run.bad_choice = Some(format!("port {host_order} outside {min}-{max}"));
            }
            chosen
        };
        self.tables
            .nat_rev
            .insert(claim_of(port), Half::new(flow.saddr, flow.sport, kind));
        let mut fwd = Half::new(node, port, kind);
        fwd.record(l4);
        self.tables.nat_fwd.insert(*flow, fwd);
        self.answerable.push(claim_of(port));
        self.ongoing.push(*flow);
        Ok(())
    }

    /// A pair for an untranslated flow whose pod side is `flow`, opened by
    /// `l4` (the pod's for `NoSnat`, toward the pod for `Inbound`); an
    /// entry already there stays as it is.
    pub(super) fn track_untranslated(&mut self, flow: &FlowKey, kind: FlowKind, l4: Ports) {
        let (mut fwd, mut rev) = (
            Half::new(flow.saddr, flow.sport, kind),
            Half::new(flow.saddr, flow.sport, kind),
        );
        if kind == FlowKind::Inbound {
            rev.record(l4);
        } else {
            fwd.record(l4);
        }
        self.tables.nat_rev.entry(flow.reversed()).or_insert(rev);
        self.tables.nat_fwd.entry(*flow).or_insert(fwd);
        self.answerable.push(flow.reversed());
    }

    /// Rewrites a packet of a translated flow; the counter says what it was.
    pub(super) fn translate(
        &mut self,
        run: &mut Run,
        ip: &Ip,
        flow: &FlowKey,
        new: bool,
    ) -> Counter {
        let half = self.tables.nat_fwd[flow];
        if untranslated(half.kind) {
            return Counter::EgressUntranslated;
        }
        if half.addr != flow.saddr {
            run.set_addr(ip, true, half.addr, true);
        }
        let at = ip.l4 + if ip.proto == PROTO_ICMP { 4 } else { 0 };
        if half.port != flow.sport {
            run.set_port(ip, at, half.port);
        }
        let host = half.kind == FlowKind::Host as u8;
        match (host, new) {
            (true, true) if half.port != flow.sport => Counter::EgressHostRemapped,
            (true, true) => Counter::EgressHostNew,
            (true, false) => Counter::EgressHost,
            (false, true) => Counter::EgressSnatNew,
            (false, false) => Counter::EgressSnat,
        }
    }

    /// An ICMP error leaving about a datagram that came in through the NAT:
    /// it leaves as the remote knows the flow.
    pub(super) fn icmp_error_out(&mut self, run: &mut Run, outer: &Ip) -> Counter {
        let Some((inner, about)) = quoted(&run.p, outer) else {
            return Counter::EgressIcmpErrorPass;
        };
        let flow = about.reversed();
        let Some(half) = self.tables.nat_fwd.get(&flow).copied() else {
            return Counter::EgressIcmpErrorPass;
        };
        if untranslated(half.kind) || (half.addr == flow.saddr && half.port == flow.sport) {
            return Counter::EgressIcmpErrorPass;
        }
        Self::rewrite_quoted(run, outer, &inner, false, half.addr, half.port);
        Counter::EgressIcmpErrorNat
    }

    /// Rewrites an ICMP error: the quoted datagram's address and port on the
    /// pod's side (`source`: its source), its checksums where quoted, the
    /// ICMP checksum over the whole message, and the outer address.
    pub(super) fn rewrite_quoted(
        run: &mut Run,
        outer: &Ip,
        inner: &Ip,
        source: bool,
        addr: u32,
        port: u16,
    ) {
        let message_before = ones_sum_without(&run.p[outer.l4..], 2);
        let addr_at = inner.off + if source { 12 } else { 16 };
        let port_at = inner.l4
            + match (inner.proto, source) {
                (PROTO_ICMP, _) => 4,
                (_, true) => 0,
                (_, false) => 2,
            };
        let quoted_l4_csum = Run::l4_csum(inner).filter(|(at, _)| at + 2 <= run.p.len());
        let addr_l4 = if inner.proto == PROTO_ICMP {
            None
        } else {
            quoted_l4_csum
        };
        run.write(addr_at, &addr.to_ne_bytes(), Some(inner.off), addr_l4);
        run.write(port_at, &port.to_ne_bytes(), None, quoted_l4_csum);
        let message_after = ones_sum_without(&run.p[outer.l4..], 2);
        let icmp_csum = run.csum_at(outer.l4 + 2);
        run.put_csum(
            outer.l4 + 2,
            moved(icmp_csum, message_before, message_after),
        );
        run.set_addr(outer, !source, addr, false);
    }
}

/// Decisions that leave a packet with its pod's own address (the list the
/// programs keep, written here again: the model shares no logic with them).
pub(super) fn leaves_untranslated(decision: Counter) -> bool {
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
