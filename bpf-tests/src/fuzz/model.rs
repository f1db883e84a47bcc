//! What the four programs should do with a packet, written again in plain
//! user-space Rust from the design, not from the programs' code: its own
//! header parsing, its own prefix match, checksums recomputed over whole
//! regions rather than patched field by field, the flow tables as plain
//! hash maps. The fuzz test runs both on every packet and compares.
//!
//! The model predicts everything but one choice: the port a new translated
//! flow gets, which is random by design. It reads that port from the
//! program's output and checks it instead (in the configured range, free
//! for the remote endpoint, the pod's or node socket's own when that one
//! was free and is to be tried first).

use std::collections::HashMap;

use vpcnet_common::{
    cidr::CidrKind,
    config::{Config, MARK_DECIDED, MARK_VIA_SERVICE, RandomizeMode},
    counters::Counter,
    endpoint::{ENI_BRANCH, Endpoint, Eni},
    nat::{
        FRAG_VIA_ENI_FORWARDED, FRAG_VIA_ENI_ROUTED, FRAG_VIA_PASS, FRAG_VIA_POD, FlowKey,
        FlowKind, FragHook, PROTO_ICMP, PROTO_TCP, PROTO_UDP, SEEN_ANY, SEEN_SYN,
    },
};

use super::Program;
use crate::{
    TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC,
    packets::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

const ETH_P_IP: u16 = 0x0800;
const IP: usize = 14;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO: u8 = 8;

/// One half of a flow, as far as behaviour goes (times left out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Half {
    pub addr: u32,
    pub port: u16,
    pub kind: u8,
    pub seen: u8,
}

/// A datagram as a program saw it arrive: addresses, IP id, protocol, and
/// which program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Datagram {
    pub saddr: u32,
    pub daddr: u32,
    pub id: u16,
    pub proto: u8,
    pub hook: u8,
}

/// Where a first fragment went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstWent {
    pub addr: u32,
    pub ifindex: u32,
    pub via: u8,
}

/// The node as the programs are configured for it.
#[derive(Clone, Debug)]
pub struct World {
    pub config: Config,
    /// Prefixes (network order address, length) and what they are.
    pub prefixes: Vec<(u32, u8, CidrKind)>,
    pub endpoints: HashMap<u32, Endpoint>,
    pub enis: HashMap<u32, Eni>,
    /// The link `BPF_PROG_TEST_RUN`'s packets arrive on.
    pub ifindex: u32,
}

impl World {
    fn prefix_kind(&self, addr: u32) -> Option<CidrKind> {
        let host = u32::from_be(addr);
        self.prefixes
            .iter()
            .filter(|(net, len, _)| {
                let mask = if *len == 0 { 0 } else { u32::MAX << (32 - len) };
                host & mask == u32::from_be(*net) & mask
            })
            .max_by_key(|(_, len, _)| *len)
            .map(|(_, _, kind)| *kind)
    }

    fn port_range(&self) -> (u16, u16) {
        let c = &self.config;
        if c.port_min != 0 && c.port_min <= c.port_max {
            (c.port_min, c.port_max)
        } else {
            (1024, 65535)
        }
    }
}

/// Every table the programs keep, as the model keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tables {
    pub nat_fwd: HashMap<FlowKey, Half>,
    pub nat_rev: HashMap<FlowKey, Half>,
    pub stack: HashMap<FlowKey, Half>,
    pub frags: HashMap<Datagram, FirstWent>,
}

/// What a program should have done with one packet.
#[derive(Debug)]
pub struct Expected {
    pub action: i32,
    pub packet: Vec<u8>,
    pub mark: u32,
    /// Offsets of the checksums the programs patch: ones' complement sums,
    /// where `0x0000` and `0xffff` are the same value (UDP's aside, whose
    /// zero means "none").
    pub checksums: Vec<usize>,
    /// The packet's verdict counter and any other counter it moves.
    pub counted: Vec<Counter>,
    /// A port the program chose that breaks a rule.
    pub bad_choice: Option<String>,
}

/// The model: the node and its tables.
pub struct Model {
    pub world: World,
    pub tables: Tables,
    /// Flows made, in order, for the generator to continue (may name
    /// flows that are gone): each as its replies arrive (a claim's key, an
    /// inbound flow's remote side) and as its opener sends (the forward
    /// key).
    pub answerable: Vec<FlowKey>,
    pub ongoing: Vec<FlowKey>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Frag {
    Whole,
    First,
    Later,
}

#[derive(Clone, Copy)]
struct Ip {
    off: usize,
    saddr: u32,
    daddr: u32,
    proto: u8,
    id: u16,
    frag: Frag,
    l4: usize,
}

#[derive(Clone, Copy)]
struct Ports {
    sport: u16,
    dport: u16,
    flags: u8,
    icmp_type: u8,
}

impl Ports {
    const NONE: Self = Self {
        sport: 0,
        dport: 0,
        flags: 0,
        icmp_type: 0,
    };

    fn seen(self) -> u8 {
        (self.flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK)) | SEEN_ANY
    }

    fn syn_only(self) -> bool {
        self.flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK) == TCP_SYN
    }
}

/// What a program decided.
#[derive(Clone, Copy)]
struct Out {
    counter: Counter,
    action: i32,
    via: u8,
    ifindex: u32,
}

impl Out {
    fn pass(counter: Counter) -> Self {
        Self {
            counter,
            action: TC_ACT_UNSPEC,
            via: FRAG_VIA_PASS,
            ifindex: 0,
        }
    }
}

type Decided = Result<Out, Counter>;

fn raw32(p: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(p.get(off..off + 4)?.try_into().ok()?))
}

fn raw16(p: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(p.get(off..off + 2)?.try_into().ok()?))
}

fn key(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> FlowKey {
    FlowKey::new(saddr, daddr, sport, dport, proto)
}

fn progressed(seen: u8) -> bool {
    seen & !(SEEN_SYN | SEEN_ANY) != 0
}

fn untranslated(kind: u8) -> bool {
    kind == FlowKind::NoSnat as u8 || kind == FlowKind::Inbound as u8
}

fn is_icmp_error(icmp_type: u8) -> bool {
    matches!(icmp_type, 3 | 11 | 12)
}

fn may_open(proto: u8, l4: Ports) -> bool {
    match proto {
        PROTO_TCP => {
            let f = l4.flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK);
            f == TCP_SYN || f == TCP_ACK
        }
        PROTO_ICMP => l4.icmp_type == ICMP_ECHO,
        _ => true,
    }
}

/// The IPv4 header at `off`.
fn ip_at(p: &[u8], off: usize) -> Result<Ip, Counter> {
    let first = *p.get(off).ok_or(Counter::DropTruncated)?;
    let ihl = usize::from(first & 0x0f) * 4;
    if first >> 4 != 4 || ihl < 20 {
        return Err(Counter::DropMalformed);
    }
    if p.len() < off + 20 {
        return Err(Counter::DropTruncated);
    }
    let frag_field = u16::from_be_bytes([p[off + 6], p[off + 7]]);
    let frag = if frag_field & 0x1fff != 0 {
        Frag::Later
    } else if frag_field & 0x2000 != 0 {
        Frag::First
    } else {
        Frag::Whole
    };
    Ok(Ip {
        off,
        saddr: raw32(p, off + 12).unwrap_or_default(),
        daddr: raw32(p, off + 16).unwrap_or_default(),
        proto: p[off + 9],
        id: raw16(p, off + 4).unwrap_or_default(),
        frag,
        l4: off + ihl,
    })
}

/// The L4 header at `off`: all of its fixed part must be there. `None`: a
/// protocol without ports.
fn l4_at(p: &[u8], proto: u8, off: usize) -> Result<Option<Ports>, Counter> {
    let fixed = match proto {
        PROTO_TCP => 20,
        PROTO_UDP | PROTO_ICMP => 8,
        _ => return Ok(None),
    };
    if p.len() < off + fixed {
        return Err(Counter::DropTruncated);
    }
    let a = raw16(p, off).unwrap_or_default();
    let b = raw16(p, off + 2).unwrap_or_default();
    Ok(Some(match proto {
        PROTO_TCP => Ports {
            sport: a,
            dport: b,
            flags: p[off + 13],
            icmp_type: 0,
        },
        PROTO_UDP => Ports {
            sport: a,
            dport: b,
            flags: 0,
            icmp_type: 0,
        },
        _ => {
            let icmp_type = p[off];
            let id = raw16(p, off + 4).unwrap_or_default();
            let (sport, dport) = match icmp_type {
                ICMP_ECHO => (id, 0),
                ICMP_ECHO_REPLY => (0, id),
                _ => (0, 0),
            };
            Ports {
                sport,
                dport,
                flags: 0,
                icmp_type,
            }
        }
    }))
}

/// The datagram an ICMP error quotes: its header, and its tuple from the
/// first 8 bytes of its L4 header. `None` when it is not one to act on.
fn quoted(p: &[u8], outer: &Ip) -> Option<(Ip, FlowKey)> {
    let inner = ip_at(p, outer.l4 + 8).ok()?;
    if inner.frag == Frag::Later {
        return None;
    }
    let (sport, dport) = match inner.proto {
        PROTO_TCP | PROTO_UDP => (raw16(p, inner.l4)?, raw16(p, inner.l4 + 2)?),
        PROTO_ICMP => {
            let icmp_type = *p.get(inner.l4)?;
            let id = raw16(p, inner.l4 + 4)?;
            match icmp_type {
                ICMP_ECHO => (id, 0),
                ICMP_ECHO_REPLY => (0, id),
                _ => return None,
            }
        }
        _ => return None,
    };
    let flow = key(inner.saddr, inner.daddr, sport, dport, inner.proto);
    Some((inner, flow))
}

/// Sum of 16-bit big-endian words, folded, of `bytes` (an odd last byte
/// padded with zero, as the Internet checksum pads it).
fn ones_sum(bytes: &[u8]) -> u32 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// A checksum over a region whose words summed to `old` now summing to
/// `new`: what it becomes (RFC 1624: the checksum is the complement of the
/// sum, which moves by the difference).
fn moved(csum: u16, old: u32, new: u32) -> u16 {
    let mut sum = u32::from(!csum) + (0xffff - old) + new;
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap_or(u16::MAX)
}

/// One packet through the model: the frame as it is rewritten, the mark,
/// the counters moved.
struct Run<'a> {
    p: Vec<u8>,
    mark: u32,
    checksums: Vec<usize>,
    counted: Vec<Counter>,
    /// The program's output, to read the port it chose.
    actual: &'a [u8],
    bad_choice: Option<String>,
}

impl Run<'_> {
    fn count(&mut self, counter: Counter) {
        self.counted.push(counter);
    }

    fn csum_at(&self, off: usize) -> u16 {
        u16::from_be_bytes([self.p[off], self.p[off + 1]])
    }

    fn put_csum(&mut self, off: usize, value: u16) {
        self.p[off..off + 2].copy_from_slice(&value.to_be_bytes());
        if !self.checksums.contains(&off) {
            self.checksums.push(off);
        }
    }

    /// Writes `new` at `off`, moving the checksum of the IP header at
    /// `ip_off` when the field is in it, and the L4 checksum at `l4_csum`
    /// (`udp`: zero means none and is never produced).
    fn write(
        &mut self,
        off: usize,
        new: &[u8],
        ip_off: Option<usize>,
        l4_csum: Option<(usize, bool)>,
    ) {
        let old_bytes = self.p[off..off + new.len()].to_vec();
        if old_bytes == new {
            return;
        }
        let (old, now) = (ones_sum(&old_bytes), ones_sum(new));
        self.p[off..off + new.len()].copy_from_slice(new);
        if let Some(ip) = ip_off {
            let c = self.csum_at(ip + 10);
            self.put_csum(ip + 10, moved(c, old, now));
        }
        if let Some((at, udp)) = l4_csum {
            let c = self.csum_at(at);
            if !udp {
                self.put_csum(at, moved(c, old, now));
            } else if c != 0 {
                // UDP's zero means "none": never produced, and compared
                // exactly, so not among `checksums`.
                let value = match moved(c, old, now) {
                    0 => 0xffff,
                    v => v,
                };
                self.p[at..at + 2].copy_from_slice(&value.to_be_bytes());
            }
        }
    }

    /// The L4 checksum a rewrite of `ip`'s addresses or ports moves.
    fn l4_csum(ip: &Ip) -> Option<(usize, bool)> {
        match ip.proto {
            PROTO_TCP => Some((ip.l4 + 16, false)),
            PROTO_UDP => Some((ip.l4 + 6, true)),
            PROTO_ICMP => Some((ip.l4 + 2, false)),
            _ => None,
        }
    }

    /// Rewrites the source (`source`) or destination address of the outer
    /// header; `with_l4`: TCP and UDP checksums cover it.
    fn set_addr(&mut self, ip: &Ip, source: bool, new: u32, with_l4: bool) {
        let off = ip.off + if source { 12 } else { 16 };
        let l4 = match ip.proto {
            PROTO_TCP | PROTO_UDP if with_l4 => Self::l4_csum(ip),
            _ => None,
        };
        self.write(off, &new.to_ne_bytes(), Some(ip.off), l4);
    }

    fn set_port(&mut self, ip: &Ip, off: usize, new: u16) {
        self.write(off, &new.to_ne_bytes(), None, Self::l4_csum(ip));
    }

    fn ttl(&self) -> u8 {
        self.p[IP + 8]
    }
}

impl Model {
    pub fn new(world: World) -> Self {
        Self {
            world,
            tables: Tables::default(),
            answerable: Vec::new(),
            ongoing: Vec::new(),
        }
    }

    /// Runs `program` on `packet` arriving with skb mark `mark`; `actual`
    /// is what the real program left, read only for a port it chose.
    pub fn run(&mut self, program: Program, packet: &[u8], mark: u32, actual: &[u8]) -> Expected {
        let mut run = Run {
            p: packet.to_vec(),
            mark,
            checksums: Vec::new(),
            counted: Vec::new(),
            actual,
            bad_choice: None,
        };
        let decided = match program {
            Program::EniEgress => self.eni_egress(&mut run),
            Program::EniIngress => self.eni_ingress(&mut run),
            Program::PodEgress => self.pod_egress(&mut run),
            Program::PodIngress => self.pod_ingress(&mut run),
        };
        let action = match decided {
            Ok(out) => {
                run.count(out.counter);
                out.action
            }
            Err(reason) => {
                run.count(reason);
                TC_ACT_SHOT
            }
        };
        Expected {
            action,
            packet: run.p,
            mark: run.mark,
            checksums: run.checksums,
            counted: run.counted,
            bad_choice: run.bad_choice,
        }
    }

    fn configured(&self) -> bool {
        self.world.config.node_addr != 0
    }

    fn ipv4(p: &[u8]) -> bool {
        p.len() >= 14 && u16::from_be_bytes([p[12], p[13]]) == ETH_P_IP
    }

    // ---- eni_egress ------------------------------------------------------

    fn eni_egress(&mut self, run: &mut Run) -> Decided {
        if run.mark & MARK_DECIDED != 0 {
            run.mark &= !MARK_DECIDED;
            return Ok(Out::pass(Counter::EgressDecided));
        }
        if run.mark & MARK_VIA_SERVICE != 0 {
            run.mark &= !MARK_VIA_SERVICE;
            if Self::ipv4(&run.p) {
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
    fn service_flow(&mut self, run: &mut Run) -> Result<(), Counter> {
        let ip = ip_at(&run.p, IP)?;
        if ip.frag == Frag::Later {
            return Ok(());
        }
        if let Some(l4) = l4_at(&run.p, ip.proto, ip.l4)? {
            let pod_side = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
            if !self.stack_packet(&pod_side, l4) {
                self.stack_new(&pod_side, FlowKind::StackFromPod, l4.seen());
            }
            run.count(Counter::EgressServiceFlow);
        }
        Ok(())
    }

    /// A packet leaving with a pod's own address leaves by that pod's ENI.
    fn steer(&mut self, run: &mut Run, decision: Counter) -> Decided {
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
    fn snat_decision(&mut self, run: &mut Run, ip: &Ip) -> Result<Counter, Counter> {
        let l4 = l4_at(&run.p, ip.proto, ip.l4)?.unwrap_or(Ports::NONE);
        if ip.proto == PROTO_ICMP && l4.icmp_type != ICMP_ECHO && l4.icmp_type != ICMP_ECHO_REPLY {
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
                        rev.seen = 0;
                        if untranslated(half.kind) {
                            rev.kind = FlowKind::NoSnat as u8;
                        }
                        let fwd = self.tables.nat_fwd.get_mut(&flow).expect("looked up");
                        fwd.seen = l4.seen();
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
            self.tables.nat_fwd.get_mut(&flow).expect("looked up").seen |= l4.seen();
            return Ok(self.translate(run, ip, &flow, false));
        }
        self.new_flow(run, ip, l4, &flow)
    }

    fn new_flow(
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
            return Ok(match self.claim(run, ip, flow, FlowKind::Host, l4.seen()) {
                Ok(()) => self.translate(run, ip, flow, true),
                Err(_) => Counter::EgressHostUntracked,
            });
        }
        if self.world.config.external_snat() {
            self.track_untranslated(flow, FlowKind::NoSnat, l4.seen(), 0);
            return Ok(Counter::EgressExternalSnatNew);
        }
        self.claim(run, ip, flow, FlowKind::Snat, l4.seen())?;
        Ok(self.translate(run, ip, flow, true))
    }

    /// A port for a new translated flow: the one the program chose, read
    /// from its output and checked against the rules.
    fn claim(
        &mut self,
        run: &mut Run,
        ip: &Ip,
        flow: &FlowKey,
        kind: FlowKind,
        seen: u8,
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
        self.tables.nat_rev.insert(
            claim_of(port),
            Half {
                addr: flow.saddr,
                port: flow.sport,
                kind: kind as u8,
                seen: 0,
            },
        );
        self.tables.nat_fwd.insert(
            *flow,
            Half {
                addr: node,
                port,
                kind: kind as u8,
                seen,
            },
        );
        self.answerable.push(claim_of(port));
        self.ongoing.push(*flow);
        Ok(())
    }

    /// A pair for an untranslated flow whose pod side is `flow`; an entry
    /// already there stays as it is.
    fn track_untranslated(&mut self, flow: &FlowKey, kind: FlowKind, fwd_seen: u8, rev_seen: u8) {
        let half = Half {
            addr: flow.saddr,
            port: flow.sport,
            kind: kind as u8,
            seen: 0,
        };
        self.tables.nat_rev.entry(flow.reversed()).or_insert(Half {
            seen: rev_seen,
            ..half
        });
        self.tables.nat_fwd.entry(*flow).or_insert(Half {
            seen: fwd_seen,
            ..half
        });
        self.answerable.push(flow.reversed());
    }

    /// Rewrites a packet of a translated flow; the counter says what it was.
    fn translate(&mut self, run: &mut Run, ip: &Ip, flow: &FlowKey, new: bool) -> Counter {
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
    fn icmp_error_out(&mut self, run: &mut Run, outer: &Ip) -> Counter {
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
    fn rewrite_quoted(run: &mut Run, outer: &Ip, inner: &Ip, source: bool, addr: u32, port: u16) {
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

    // ---- eni_ingress -----------------------------------------------------

    fn eni_ingress(&mut self, run: &mut Run) -> Decided {
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
            return Ok(Out::pass(if ip.daddr == node {
                Counter::IngressNoEntry
            } else {
                Counter::IngressNotNode
            }));
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
    fn for_node(&mut self, run: &mut Run, ip: &Ip) -> Result<Counter, Counter> {
        let l4 = l4_at(&run.p, ip.proto, ip.l4)?.unwrap_or(Ports::NONE);
        if ip.proto == PROTO_ICMP && l4.icmp_type != ICMP_ECHO_REPLY {
            if is_icmp_error(l4.icmp_type) {
                return Ok(self.icmp_error_in(run, ip));
            }
            return Ok(Counter::IngressNoEntry);
        }
        let claim = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        let Some(rev) = self.tables.nat_rev.get_mut(&claim) else {
            return Ok(Counter::IngressNoEntry);
        };
        rev.seen |= l4.seen();
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

    fn icmp_error_in(&mut self, run: &mut Run, outer: &Ip) -> Counter {
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
    fn for_other_address(&mut self, run: &mut Run, ip: &Ip) -> Result<Counter, Counter> {
        if self.world.prefix_kind(ip.saddr).is_some() {
            return Ok(Counter::IngressNotNode);
        }
        let l4 = l4_at(&run.p, ip.proto, ip.l4)?.unwrap_or(Ports::NONE);
        let arriving = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
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
                    fwd.seen = 0;
                    let rev = self.tables.nat_rev.get_mut(&arriving).expect("looked up");
                    rev.kind = FlowKind::Inbound as u8;
                    rev.seen = l4.seen();
                }
            } else {
                self.tables
                    .nat_rev
                    .get_mut(&arriving)
                    .expect("looked up")
                    .seen |= l4.seen();
            }
            return Ok(Counter::IngressNotNode);
        }
        if !may_open(ip.proto, l4) {
            return Ok(Counter::IngressNotNode);
        }
        self.track_untranslated(&arriving.reversed(), FlowKind::Inbound, 0, l4.seen());
        Ok(Counter::IngressInboundTracked)
    }

    /// Into a local pod, unless a strict pod's packet came by another ENI
    /// than its branch, or the flow is one the stack must see.
    fn deliver(&mut self, run: &mut Run, decision: Counter) -> Decided {
        let daddr = raw32(&run.p, IP + 16).ok_or(Counter::DropTruncated)?;
        let Some(ep) = self.world.endpoints.get(&daddr).copied() else {
            return Ok(Out::pass(decision));
        };
        if ep.strict() && ep.eni_ifindex != self.world.ifindex {
            return Ok(Out::pass(decision));
        }
        let ip = ip_at(&run.p, IP)?;
        let stack_flow = match l4_at(&run.p, ip.proto, ip.l4)? {
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
        Ok(Self::into_pod(run, &ep, Counter::IngressToPod))
    }

    // ---- forwarding --------------------------------------------------------

    /// Straight into a local pod: one hop, addressed from its gateway.
    fn into_pod(run: &mut Run, ep: &Endpoint, counter: Counter) -> Out {
        let ttl = run.ttl();
        if ttl <= 1 {
            return Out::pass(Counter::TtlToStack);
        }
        let word = [ttl - 1, run.p[IP + 9]];
        run.write(IP + 8, &word, Some(IP), None);
        run.p[..6].copy_from_slice(&ep.mac);
        run.p[6..12].copy_from_slice(&ep.host_mac);
        Out {
            counter,
            action: TC_ACT_REDIRECT,
            via: FRAG_VIA_POD,
            ifindex: 0,
        }
    }

    /// Out of the ENI on `ifindex` to its gateway; `forwarded`: routed here,
    /// one hop.
    fn out_of_eni(
        &self,
        run: &mut Run,
        ifindex: u32,
        forwarded: bool,
        counter: Counter,
    ) -> Decided {
        if !self.world.enis.contains_key(&ifindex) {
            return Err(Counter::DropNoEni);
        }
        if forwarded {
            let ttl = run.ttl();
            if ttl <= 1 {
                return Ok(Out::pass(Counter::TtlToStack));
            }
            let word = [ttl - 1, run.p[IP + 9]];
            run.write(IP + 8, &word, Some(IP), None);
        }
        run.mark |= MARK_DECIDED;
        Ok(Out {
            counter,
            action: TC_ACT_REDIRECT,
            via: if forwarded {
                FRAG_VIA_ENI_FORWARDED
            } else {
                FRAG_VIA_ENI_ROUTED
            },
            ifindex,
        })
    }

    // ---- fragments ---------------------------------------------------------

    fn datagram(ip: &Ip, hook: FragHook) -> Datagram {
        Datagram {
            saddr: ip.saddr,
            daddr: ip.daddr,
            id: ip.id,
            proto: ip.proto,
            hook: hook as u8,
        }
    }

    fn first_fragment(&self, ip: &Ip, hook: FragHook) -> Option<FirstWent> {
        self.tables.frags.get(&Self::datagram(ip, hook)).copied()
    }

    fn remember_first(&mut self, run: &Run, ip: &Ip, hook: FragHook, out: Out) {
        let (at, arrived) = if hook == FragHook::EniIngress {
            (IP + 16, ip.daddr)
        } else {
            (IP + 12, ip.saddr)
        };
        let now = raw32(&run.p, at).unwrap_or(arrived);
        self.tables.frags.insert(
            Self::datagram(ip, hook),
            FirstWent {
                addr: if now == arrived { 0 } else { now },
                ifindex: out.ifindex,
                via: out.via,
            },
        );
    }

    /// A later fragment goes where its first went, rewritten alike.
    fn like_first(
        &mut self,
        run: &mut Run,
        ip: &Ip,
        hook: FragHook,
        first: FirstWent,
        counter: Counter,
    ) -> Decided {
        let ingress = hook == FragHook::EniIngress;
        if first.addr != 0 {
            run.set_addr(ip, !ingress, first.addr, false);
        }
        match first.via {
            FRAG_VIA_POD => {
                let daddr = if ingress && first.addr != 0 {
                    first.addr
                } else {
                    ip.daddr
                };
                Ok(match self.world.endpoints.get(&daddr).copied() {
                    Some(ep) => Self::into_pod(run, &ep, counter),
                    None => Out::pass(counter),
                })
            }
            FRAG_VIA_ENI_FORWARDED => self.out_of_eni(run, first.ifindex, true, counter),
            FRAG_VIA_ENI_ROUTED => self.out_of_eni(run, first.ifindex, false, counter),
            _ => Ok(Out::pass(counter)),
        }
    }

    // ---- stack flows -------------------------------------------------------

    /// Whether `flow` (one direction's tuple) is a stack flow; records the
    /// packet in its half if so.
    fn stack_packet(&mut self, flow: &FlowKey, l4: Ports) -> bool {
        let Some(half) = self.tables.stack.get(flow).copied() else {
            return false;
        };
        if flow.proto == PROTO_TCP && l4.syn_only() && progressed(half.seen) {
            let from_pod = flow.saddr == half.addr && flow.sport == half.port;
            let kind = if from_pod {
                FlowKind::StackFromPod
            } else {
                FlowKind::StackToPod
            } as u8;
            let this = self.tables.stack.get_mut(flow).expect("looked up");
            this.kind = kind;
            this.seen = l4.seen();
            if let Some(other) = self.tables.stack.get_mut(&flow.reversed()) {
                other.kind = kind;
                other.seen = 0;
            }
        } else {
            self.tables.stack.get_mut(flow).expect("looked up").seen |= l4.seen();
        }
        true
    }

    fn stack_new(&mut self, pod_side: &FlowKey, kind: FlowKind, seen: u8) {
        let toward_pod = matches!(kind, FlowKind::StackToPod);
        let half = Half {
            addr: pod_side.saddr,
            port: pod_side.sport,
            kind: kind as u8,
            seen: 0,
        };
        self.tables.stack.insert(
            pod_side.reversed(),
            Half {
                seen: if toward_pod { seen } else { 0 },
                ..half
            },
        );
        self.tables.stack.insert(
            *pod_side,
            Half {
                seen: if toward_pod { 0 } else { seen },
                ..half
            },
        );
    }

    // ---- pod_egress and pod_ingress -----------------------------------------

    fn pod_egress(&mut self, run: &mut Run) -> Decided {
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

    fn sent_by_pod(&mut self, run: &mut Run, ip: &Ip, ep: &Endpoint) -> Decided {
        if let Some(l4) = l4_at(&run.p, ip.proto, ip.l4)? {
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

    fn to_service(run: &mut Run) -> Out {
        run.mark |= MARK_VIA_SERVICE;
        Out::pass(Counter::PodToService)
    }

    fn pod_ingress(&mut self, run: &mut Run) -> Decided {
        if !Self::ipv4(&run.p) {
            return Ok(Out::pass(Counter::PodNotIpv4));
        }
        let ip = ip_at(&run.p, IP)?;
        if ip.frag == Frag::Later {
            return Ok(Out::pass(Counter::PodFragment));
        }
        let Some(l4) = l4_at(&run.p, ip.proto, ip.l4)? else {
            return Ok(Out::pass(Counter::PodIngressStack));
        };
        let arriving = key(ip.saddr, ip.daddr, l4.sport, l4.dport, ip.proto);
        if !self.stack_packet(&arriving, l4) {
            self.stack_new(&arriving.reversed(), FlowKind::StackToPod, l4.seen());
        }
        Ok(Out::pass(Counter::PodIngressStack))
    }
}

/// Decisions that leave a packet with its pod's own address (the list the
/// programs keep, written here again: the model shares no logic with them).
fn leaves_untranslated(decision: Counter) -> bool {
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

/// [`ones_sum`] of `bytes` with the 16-bit word at `skip` counted as zero.
fn ones_sum_without(bytes: &[u8], skip: usize) -> u32 {
    let mut copy = bytes.to_vec();
    if let Some(word) = copy.get_mut(skip..skip + 2) {
        word.fill(0);
    }
    ones_sum(&copy)
}
