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
    lifetime::Holder,
    rewrite::{moved, ones_sum_without},
    tables::Map,
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
                self.stack_new(run, &pod_side, FlowKind::StackFromPod, l4);
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
        let now = self.now;
        if let Some(half) = self.tables.nat_fwd.get(&flow).copied() {
            if ip.proto == PROTO_TCP && l4.syn_only() && progressed(half.seen) {
                let claim = key(flow.daddr, half.addr, flow.dport, half.port, flow.proto);
                match self.tables.nat_rev.get_mut(&claim) {
                    Some(rev) if rev.addr == flow.saddr && rev.port == flow.sport => {
                        rev.restart(None, now);
                        if untranslated(half.kind) {
                            rev.kind = FlowKind::NoSnat as u8;
                        }
                        let fwd = self.tables.nat_fwd.get_mut(&flow).expect("looked up");
                        fwd.restart(Some(l4), now);
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
                .record(l4, now);
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
            if !self.track_untranslated(run, flow, FlowKind::NoSnat, l4) {
                return Err(Counter::DropNatTableFull);
            }
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
    /// from its output and checked against the rules ([`Model::chosen_port`]).
    /// A full table makes room by early drop; a port whose flow is over, or
    /// closed longest ago when every port of a small range is held, is
    /// taken over.
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
        let (chosen, held) = self.chosen_port(run, ip, flow, kind)?;
        let table_full = self.tables.nat_rev.len() >= self.world.nat_capacity;
        match held {
            Holder::Free => {
                if table_full {
                    if self.early_drop_nat() {
                        run.count(Counter::NatEarlyDrop);
                    } else {
                        run.bad_choice = Some(format!("port {chosen} in a full table"));
                    }
                }
            }
            Holder::Over => {
                self.remove_nat_pair(&claim_of(chosen.to_be()));
                run.count(Counter::EgressTakeover);
            }
            Holder::Closed(_) | Holder::Live => {
                self.remove_nat_pair(&claim_of(chosen.to_be()));
                run.count(Counter::AllocOldestClosed);
                run.count(Counter::EgressTakeover);
            }
        }
        let claim = claim_of(chosen.to_be());
        let now = self.now;
        self.tables
            .nat_rev
            .insert(claim, Half::new(flow.saddr, flow.sport, kind, now));
        let mut fwd = Half::new(node, chosen.to_be(), kind, now);
        fwd.record(l4, now);
        if !self.insert_making_room(run, Map::NatFwd, *flow, fwd) {
            self.tables.nat_rev.remove(&claim);
            return Err(Counter::DropNatTableFull);
        }
        Self::remember_recent(&mut self.tables.recent, claim);
        self.answerable.push(claim);
        self.ongoing.push(*flow);
        Ok(())
    }

    /// The port the program chose for a new flow (host order) and who held
    /// it, checked against the rules: a port nobody holds or whose flow is
    /// over, the pod's or node socket's own first when it is one of those;
    /// when every port of a small range is held, the one whose flow closed
    /// longest ago, or none. `Err`: the flow gets none, and why.
    fn chosen_port(
        &self,
        run: &mut Run,
        ip: &Ip,
        flow: &FlowKey,
        kind: FlowKind,
    ) -> Result<(u16, Holder), Counter> {
        let node = self.world.config.node_addr;
        let claim_of = |port: u16| key(flow.daddr, node, flow.dport, port, flow.proto);
        let portless = !matches!(ip.proto, PROTO_TCP | PROTO_UDP | PROTO_ICMP);
        let (min, max) = self.world.port_range();
        let own = u16::from_be(flow.sport);
        let first = match kind {
            _ if portless => Some(0),
            FlowKind::Host => Some(own),
            _ if self.world.config.randomize_mode() == RandomizeMode::None
                && (min..=max).contains(&own) =>
            {
                Some(own)
            }
            _ => None,
        };
        // Ports in host order, with who holds each.
        let class = |port: u16| self.holder(&claim_of(port.to_be()));
        let takeable = |h: Holder| matches!(h, Holder::Free | Holder::Over);
        // Small enough that the search surely tries every port.
        let every_port_tried = portless || max - min < SMALL_RANGE;
        let candidates: Vec<u16> = if portless {
            vec![0]
        } else if every_port_tried {
            first.into_iter().chain(min..=max).collect()
        } else {
            first.into_iter().collect()
        };
        let oldest_closed = candidates
            .iter()
            .filter_map(|&p| match class(p) {
                Holder::Closed(last) => Some((last, p)),
                _ => None,
            })
            .min()
            .map(|(_, p)| p);
        let any_takeable = candidates.iter().any(|&p| takeable(class(p)));
        let any_free = candidates.iter().any(|&p| class(p) == Holder::Free);
        // What the program did: the port it left in the packet, or none.
        let at = ip.l4 + if ip.proto == PROTO_ICMP { 4 } else { 0 };
        let chosen = if portless {
            0
        } else {
            u16::from_be(raw16(run.actual, at).unwrap_or_default())
        };
        let table_full = self.tables.nat_rev.len() >= self.world.nat_capacity;
        let claimed = match kind {
            // A node socket's packet leaves with its own port either way:
            // claimed if the port moved, or if its own was to be had.
            FlowKind::Host if chosen == own => match class(own) {
                Holder::Free => !table_full || self.nat_victim().is_some(),
                Holder::Over => true,
                Holder::Closed(_) | Holder::Live => {
                    every_port_tried && !any_takeable && oldest_closed == Some(own)
                }
            },
            FlowKind::Host => true,
            _ => raw32(run.actual, IP + 12) == Some(node),
        };
        if !claimed {
            // Only a full table with nothing to drop, met at a free port
            // (a take-over frees its own room), or a small range held
            // through and through with nothing closed, leaves a flow
            // without a port.
            if table_full && (any_free || !every_port_tried) && self.nat_victim().is_none() {
                return Err(Counter::DropNatTableFull);
            }
            if every_port_tried && !any_takeable && oldest_closed.is_none() {
                return Err(Counter::DropNatNoPort);
            }
            run.bad_choice = Some("no port, where one was to be had".to_owned());
            return Err(Counter::DropNatNoPort);
        }
        let held = class(chosen);
        let must = match first {
            Some(f) if takeable(class(f)) => Some(f),
            _ if any_takeable => None,
            _ if every_port_tried => oldest_closed,
            _ => None,
        };
        if let Some(must) = must.filter(|&m| m != chosen) {
            run.bad_choice = Some(format!("port {chosen}, not {must}, which the rules give"));
        } else if must.is_none() && !takeable(held) {
            run.bad_choice = Some(format!("port {chosen}, held by a flow not over ({held:?})"));
        } else if !portless && first != Some(chosen) && !(min..=max).contains(&chosen) {
            run.bad_choice = Some(format!("port {chosen} outside {min}-{max}"));
        }
        Ok((chosen, held))
    }

    /// A pair for an untranslated flow whose pod side is `flow`, opened by
    /// `l4` (the pod's for `NoSnat`, toward the pod for `Inbound`); an
    /// entry already there stays as it is. A full map makes room by early
    /// drop; `false` when it could not.
    pub(super) fn track_untranslated(
        &mut self,
        run: &mut Run,
        flow: &FlowKey,
        kind: FlowKind,
        l4: Ports,
    ) -> bool {
        let now = self.now;
        let (mut fwd, mut rev) = (
            Half::new(flow.saddr, flow.sport, kind, now),
            Half::new(flow.saddr, flow.sport, kind, now),
        );
        if kind == FlowKind::Inbound {
            rev.record(l4, now);
        } else {
            fwd.record(l4, now);
        }
        let reverse = flow.reversed();
        if !self.insert_making_room(run, Map::NatRev, reverse, rev) {
            return false;
        }
        if !self.insert_making_room(run, Map::NatFwd, *flow, fwd) {
            self.tables.nat_rev.remove(&reverse);
            return false;
        }
        Self::remember_recent(&mut self.tables.recent, reverse);
        self.answerable.push(reverse);
        true
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

/// Port ranges narrower than this are searched through: the programs try
/// 64 candidates, random or in a row, and a range of three ports is
/// missed by 64 random ones once in 10^11 searches.
const SMALL_RANGE: u16 = 3;

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
