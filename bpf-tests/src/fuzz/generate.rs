//! Packets nobody thought of, mostly about the node's own addresses and
//! flows so they reach the programs' deep paths: valid headers with random
//! fields, replies to flows the model holds, truncations, IP options,
//! fragment series sent in any order, ICMP errors quoting random or real
//! datagrams, VLAN tags, IPv6, byte flips and plain garbage.

use std::{collections::VecDeque, net::Ipv4Addr};

use fastrand::Rng;
use vpcnet_common::{
    addr_to_raw,
    config::{MARK_DECIDED, MARK_VIA_SERVICE},
    nat::{FlowKey, PROTO_ICMP, PROTO_TCP, PROTO_UDP},
    raw_to_addr, raw_to_port,
};

use super::{Program, model::Model};
use crate::packets::internet_checksum;

/// The kind of packet a generated one is, for reports and tallies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Category {
    Valid,
    Reply,
    Truncated,
    IpOptions,
    Fragment,
    IcmpError,
    Vlan,
    Ipv6,
    ByteFlips,
    Garbage,
}

/// One generated packet.
#[derive(Clone, Debug)]
pub struct Generated {
    pub category: Category,
    pub packet: Vec<u8>,
    pub mark: u32,
}

/// The addresses packets are made of (see [`super::world`]).
#[derive(Clone, Debug)]
pub struct Cast {
    pub node: Ipv4Addr,
    /// Pods whose packets `pod_egress` takes (on the test run's link), with
    /// their MACs.
    pub senders: Vec<(Ipv4Addr, [u8; 6])>,
    /// Every local pod.
    pub pods: Vec<Ipv4Addr>,
    /// Addresses outside the node: VPC, excluded, internet, services, local.
    pub others: Vec<Ipv4Addr>,
}

/// Ports most packets use: few, so flows meet again.
pub(super) const PORTS: [u16; 10] = [53, 80, 443, 1023, 1024, 8080, 33000, 40000, 40001, 65535];
const TCP_FLAGS: [u8; 9] = [0x02, 0x10, 0x12, 0x11, 0x04, 0x14, 0x18, 0x01, 0x00];
/// An internet endpoint many flows go to.
const BUSY_ENDPOINT: (Ipv4Addr, u16) = (Ipv4Addr::new(203, 0, 113, 77), 443);
/// How many of the last flows made a packet of a flow is picked from half
/// the time.
const RECENT_FLOWS_PICKED: usize = 8;
/// GRE, ESP, SCTP and one nobody uses.
const PORTLESS: [u8; 4] = [47, 50, 132, 253];

/// A packet's fields before it is made bytes.
#[derive(Clone)]
struct Fields {
    src_mac: [u8; 6],
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    ttl: u8,
    id: u16,
    /// The IP payload: an L4 header and its data.
    l4: Vec<u8>,
}

pub struct Generator {
    rng: Rng,
    cast: Cast,
    /// Fragments of a series still to send, per program.
    queued: [VecDeque<Vec<u8>>; 4],
}

impl Generator {
    pub fn new(seed: u64, cast: Cast) -> Self {
        Self {
            rng: Rng::with_seed(seed),
            cast,
            queued: Default::default(),
        }
    }

    /// The next packet for `program`; `model` gives flows to answer.
    pub fn next(&mut self, program: Program, model: &Model) -> Generated {
        let mark = self.mark(program);
        if let Some(packet) = self.queued[program as usize].pop_front() {
            return Generated {
                category: Category::Fragment,
                packet,
                mark,
            };
        }
        let roll = self.rng.u32(0..100);
        let (category, packet) = match roll {
            0..30 => (Category::Valid, frame(&self.fields(program))),
            30..50 => match self.reply(program, model) {
                Some(f) => (Category::Reply, frame(&f)),
                None => (Category::Valid, frame(&self.fields(program))),
            },
            50..58 => (Category::Truncated, self.truncated(program, model)),
            58..64 => (Category::IpOptions, self.with_options(program)),
            64..74 => (Category::Fragment, self.fragments(program, model)),
            74..84 => (Category::IcmpError, self.icmp_error(program, model)),
            84..87 => (Category::Vlan, self.vlan(program)),
            87..90 => (Category::Ipv6, self.ipv6()),
            90..96 => (Category::ByteFlips, self.flipped(program, model)),
            _ => (Category::Garbage, self.garbage()),
        };
        Generated {
            category,
            packet,
            mark,
        }
    }

    /// The skb mark: `eni_egress` sees the marks `pod_egress` sets, and
    /// marks of others.
    fn mark(&mut self, program: Program) -> u32 {
        match (program, self.rng.u32(0..10)) {
            (Program::EniEgress, 0) => MARK_DECIDED,
            (Program::EniEgress, 1) => MARK_VIA_SERVICE,
            (Program::EniEgress, 2) => MARK_VIA_SERVICE | MARK_DECIDED,
            (_, 3) => 0x4000 | (self.rng.u32(..) & 0xff),
            _ => 0,
        }
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.rng.usize(..items.len())]
    }

    fn any_addr(&mut self) -> Ipv4Addr {
        match self.rng.u32(0..10) {
            0 => Ipv4Addr::from(self.rng.u32(..)),
            1 => self.cast.node,
            2..5 => {
                let pods = self.cast.pods.clone();
                self.pick(&pods)
            }
            _ => {
                let others = self.cast.others.clone();
                self.pick(&others)
            }
        }
    }

    fn port(&mut self) -> u16 {
        if self.rng.u32(0..4) == 0 {
            self.rng.u16(..)
        } else {
            self.pick(&PORTS)
        }
    }

    fn payload(&mut self) -> Vec<u8> {
        let len = self.rng.usize(0..48);
        (0..len).map(|_| self.rng.u8(..)).collect()
    }

    /// Source and destination as `program` mostly sees them.
    fn ends(&mut self, program: Program) -> ([u8; 6], Ipv4Addr, Ipv4Addr) {
        let mac = [0x02, 0, 0, 0, 0, self.rng.u8(..)];
        match program {
            Program::PodEgress => {
                let senders = self.cast.senders.clone();
                let (src, sender_mac) = self.pick(&senders);
                let roll = self.rng.u32(0..20);
                let src = if roll == 0 { self.any_addr() } else { src };
                let mac = if roll == 1 { mac } else { sender_mac };
                (mac, src, self.any_addr())
            }
            Program::EniEgress => {
                let src = match self.rng.u32(0..4) {
                    0 => self.cast.node,
                    1 => self.any_addr(),
                    _ => {
                        let pods = self.cast.pods.clone();
                        self.pick(&pods)
                    }
                };
                (mac, src, self.any_addr())
            }
            Program::EniIngress | Program::PodIngress => {
                let dst = match self.rng.u32(0..3) {
                    0 => self.cast.node,
                    1 => self.any_addr(),
                    _ => {
                        let pods = self.cast.pods.clone();
                        self.pick(&pods)
                    }
                };
                (mac, self.any_addr(), dst)
            }
        }
    }

    fn fields(&mut self, program: Program) -> Fields {
        let (src_mac, src, dst) = self.ends(program);
        let proto = match self.rng.u32(0..20) {
            0..8 => PROTO_TCP,
            8..13 => PROTO_UDP,
            13..17 => PROTO_ICMP,
            _ => self.pick(&PORTLESS),
        };
        let (sport, dport) = (self.port(), self.port());
        // Now and then a pod's or the node's connection to one busy
        // internet endpoint, so that its flows hold every port of a small
        // range and close while they do.
        let leaving = matches!(program, Program::EniEgress | Program::PodEgress);
        let (dst, dport, proto) = if leaving && self.rng.u32(0..6) == 0 {
            (BUSY_ENDPOINT.0, BUSY_ENDPOINT.1, PROTO_TCP)
        } else {
            (dst, dport, proto)
        };
        let l4 = self.l4(proto, src, dst, sport, dport);
        Fields {
            src_mac,
            src,
            dst,
            proto,
            ttl: self.ttl(),
            id: self.rng.u16(0..64),
            l4,
        }
    }

    fn ttl(&mut self) -> u8 {
        match self.rng.u32(0..20) {
            0 => 0,
            1 => 1,
            2 => 2,
            _ => 64,
        }
    }

    /// An L4 header and data with a right checksum; ICMP: an echo request
    /// or reply, or another type.
    fn l4(&mut self, proto: u8, src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16) -> Vec<u8> {
        let data = self.payload();
        match proto {
            PROTO_TCP => {
                let flags = if self.rng.u32(0..8) == 0 {
                    self.rng.u8(..)
                } else {
                    self.pick(&TCP_FLAGS)
                };
                let mut h = vec![0u8; 20];
                h[0..2].copy_from_slice(&sport.to_be_bytes());
                h[2..4].copy_from_slice(&dport.to_be_bytes());
                // Numbers near each other's, so that segments advance,
                // repeat and acknowledge one another as well as jump.
                let number = |rng: &mut Rng| match rng.u32(0..4) {
                    0 => rng.u32(..),
                    n => (u32::MAX - 64).wrapping_add(n * 40 + rng.u32(0..8)),
                };
                h[4..8].copy_from_slice(&number(&mut self.rng).to_be_bytes());
                h[8..12].copy_from_slice(&number(&mut self.rng).to_be_bytes());
                h[12] = 5 << 4;
                h[13] = flags;
                let window: u16 = if self.rng.u32(0..6) == 0 { 0 } else { 64240 };
                h[14..16].copy_from_slice(&window.to_be_bytes());
                h.extend_from_slice(&data);
                let csum = pseudo_checksum(src, dst, proto, &h);
                h[16..18].copy_from_slice(&csum.to_be_bytes());
                h
            }
            PROTO_UDP => {
                let mut h = vec![0u8; 8];
                h[0..2].copy_from_slice(&sport.to_be_bytes());
                h[2..4].copy_from_slice(&dport.to_be_bytes());
                let len = u16::try_from(8 + data.len()).unwrap_or(u16::MAX);
                h[4..6].copy_from_slice(&len.to_be_bytes());
                h.extend_from_slice(&data);
                if self.rng.u32(0..8) != 0 {
                    let csum = match pseudo_checksum(src, dst, proto, &h) {
                        0 => 0xffff,
                        c => c,
                    };
                    h[6..8].copy_from_slice(&csum.to_be_bytes());
                }
                h
            }
            PROTO_ICMP => {
                let icmp_type = match self.rng.u32(0..6) {
                    0..3 => 8,
                    3 | 4 => 0,
                    _ => self.pick(&[3, 5, 11, 12, 13, 14, 15, 16, 17, 18]),
                };
                let mut h = vec![icmp_type, self.rng.u8(0..4), 0, 0];
                h.extend_from_slice(&sport.to_be_bytes());
                h.extend_from_slice(&self.rng.u16(..).to_be_bytes());
                h.extend_from_slice(&data);
                let csum = internet_checksum(&[&h]);
                h[2..4].copy_from_slice(&csum.to_be_bytes());
                h
            }
            _ => data,
        }
    }

    /// A packet of a flow the model holds, in a direction `program` sees.
    fn reply(&mut self, program: Program, model: &Model) -> Option<Fields> {
        self.of_flow(program, model, false)
    }

    /// A packet of a flow the model holds: as [`Generator::reply`] picks
    /// it, or (`reversed`) going the other way, as an ICMP error about it
    /// quotes it.
    fn of_flow(&mut self, program: Program, model: &Model, reversed: bool) -> Option<Fields> {
        // Toward the node: as the flow's replies arrive. Leaving: as its
        // opener sent it, or the reverse (the pod answering a remote).
        let flows = match program {
            Program::EniIngress | Program::PodIngress => &model.answerable,
            // Now and then a node socket on a port a NAT flow holds.
            Program::EniEgress if !reversed && self.rng.u32(0..8) == 0 => &model.answerable,
            Program::EniEgress | Program::PodEgress => &model.ongoing,
        };
        if flows.is_empty() {
            return None;
        }
        // Half the time one of the last flows made, so that flows go on
        // through their states (and close) rather than each getting a
        // packet or two among hundreds.
        let recent = flows.len().min(RECENT_FLOWS_PICKED);
        let at = if self.rng.bool() {
            flows.len() - 1 - self.rng.usize(..recent)
        } else {
            self.rng.usize(..flows.len())
        };
        let picked: FlowKey = flows[at];
        let flow = match program {
            _ if reversed => picked.reversed(),
            Program::EniEgress if picked.daddr == addr_to_raw(self.cast.node.octets()) => {
                picked.reversed()
            }
            Program::EniEgress | Program::PodEgress if self.rng.u32(0..4) == 0 => picked.reversed(),
            _ => picked,
        };
        let src = Ipv4Addr::from(raw_to_addr(flow.saddr));
        let dst = Ipv4Addr::from(raw_to_addr(flow.daddr));
        let (sport, dport) = (raw_to_port(flow.sport), raw_to_port(flow.dport));
        let l4 = match flow.proto {
            PROTO_ICMP => {
                // A query's identifier is the port of the side that asked:
                // echo, timestamp, information or address mask.
                let query = self.pick(&[0_u8, 13, 15, 17]);
                let (icmp_type, id) = match query {
                    0 if sport != 0 => (8, sport),
                    0 => (0, dport),
                    request if sport != 0 => (request, sport),
                    request => (request + 1, dport),
                };
                let mut h = vec![icmp_type, 0, 0, 0];
                h.extend_from_slice(&id.to_be_bytes());
                h.extend_from_slice(&[0, 1]);
                h.extend_from_slice(&self.payload());
                let csum = internet_checksum(&[&h]);
                h[2..4].copy_from_slice(&csum.to_be_bytes());
                h
            }
            proto => self.l4(proto, src, dst, sport, dport),
        };
        let src_mac = match program {
            Program::PodEgress => self
                .cast
                .senders
                .iter()
                .find(|(a, _)| *a == src)
                .map_or([2, 0, 0, 0, 0, 9], |(_, mac)| *mac),
            _ => [2, 0, 0, 0, 0, 9],
        };
        Some(Fields {
            src_mac,
            src,
            dst,
            proto: flow.proto,
            ttl: self.ttl(),
            id: self.rng.u16(0..64),
            l4,
        })
    }

    fn some_fields(&mut self, program: Program, model: &Model) -> Fields {
        if self.rng.bool()
            && let Some(f) = self.reply(program, model)
        {
            return f;
        }
        self.fields(program)
    }

    fn truncated(&mut self, program: Program, model: &Model) -> Vec<u8> {
        let f = self.some_fields(program, model);
        let mut packet = frame(&f);
        // Every length from a bare Ethernet header up.
        let len = self.rng.usize(14..packet.len());
        packet.truncate(len);
        packet
    }

    fn with_options(&mut self, program: Program) -> Vec<u8> {
        let f = self.fields(program);
        let words = self.rng.usize(1..=10);
        let options: Vec<u8> = match self.rng.u32(0..3) {
            // No-operations and an end.
            0 => {
                let mut o = vec![1u8; words * 4];
                *o.last_mut().unwrap_or(&mut 0) = 0;
                o
            }
            // Record route, sized right.
            1 => {
                let mut o = vec![0u8; words * 4];
                o[0] = 7;
                o[1] = u8::try_from(words * 4 - 1).unwrap_or(3).max(3);
                o[2] = 4;
                o
            }
            _ => (0..words * 4).map(|_| self.rng.u8(..)).collect(),
        };
        ip_frame(&f, &options, 0, &f.l4)
    }

    /// A datagram cut into two or three fragments, sent in a random order;
    /// sometimes a lone later fragment, or a first one whose L4 header is cut.
    fn fragments(&mut self, program: Program, model: &Model) -> Vec<u8> {
        let mut f = self.some_fields(program, model);
        f.l4.extend((0..self.rng.usize(0..64)).map(|_| self.rng.u8(..)));
        let blocks = f.l4.len() / 8;
        let mut pieces = Vec::new();
        if blocks < 2 || self.rng.u32(0..8) == 0 {
            // A later fragment on its own, at some offset.
            let offset = self.rng.u16(1..0x1fff);
            return ip_frame(
                &f,
                &[],
                offset | if self.rng.bool() { 0x2000 } else { 0 },
                &f.l4,
            );
        }
        let first_cut = self.rng.usize(1..blocks) * 8;
        let cuts = if blocks > 2 && self.rng.bool() {
            vec![
                0,
                first_cut,
                first_cut + self.rng.usize(0..(f.l4.len() - first_cut) / 8) * 8,
                f.l4.len(),
            ]
        } else {
            vec![0, first_cut, f.l4.len()]
        };
        for (i, window) in cuts.windows(2).enumerate() {
            let (from, to) = (window[0], window[1]);
            if from == to {
                continue;
            }
            let last = i == cuts.len() - 2;
            let offset = u16::try_from(from / 8).unwrap_or(0) | if last { 0 } else { 0x2000 };
            pieces.push(ip_frame(&f, &[], offset, &f.l4[from..to]));
        }
        self.rng.shuffle(&mut pieces);
        let first = pieces.remove(0);
        self.queued[program as usize].extend(pieces);
        first
    }

    /// An ICMP error (unreachable, fragmentation needed, time exceeded,
    /// parameter problem) quoting a datagram of a known flow or a random
    /// one, whole or cut anywhere.
    fn icmp_error(&mut self, program: Program, model: &Model) -> Vec<u8> {
        // The quoted datagram went the other way.
        let quoted_program = match program {
            Program::EniIngress | Program::PodIngress => Program::EniEgress,
            Program::EniEgress | Program::PodEgress => Program::EniIngress,
        };
        let about_a_flow = if self.rng.bool() {
            self.of_flow(program, model, true)
        } else {
            None
        };
        let mut quoted_fields = match about_a_flow {
            Some(f) => f,
            None => self.fields(quoted_program),
        };
        if self.rng.u32(0..8) == 0 {
            quoted_fields
                .l4
                .truncate(self.rng.usize(0..=quoted_fields.l4.len()));
        }
        let quoted = frame(&quoted_fields);
        let datagram = &quoted[14..];
        let quote_len = match self.rng.u32(0..4) {
            0 => datagram.len(),
            1 => datagram.len().min(28),
            _ => self.rng.usize(0..=datagram.len()),
        };
        // The error comes from the quoted datagram's destination, to its
        // source; sometimes from anyone.
        let (src_mac, mut src, mut dst) = self.ends(program);
        if self.rng.u32(0..4) != 0 {
            src = quoted_fields.dst;
            dst = quoted_fields.src;
        }
        if program == Program::PodEgress && self.rng.u32(0..4) != 0 {
            let senders = self.cast.senders.clone();
            let (addr, _) = self.pick(&senders);
            src = addr;
            dst = quoted_fields.src;
        }
        let (icmp_type, code) = self.pick(&[(3u8, 3u8), (3, 4), (3, 1), (11, 0), (12, 0), (3, 13)]);
        let mut icmp = vec![icmp_type, code, 0, 0, 0, 0, 0, 0];
        if (icmp_type, code) == (3, 4) {
            icmp[6..8].copy_from_slice(&1400u16.to_be_bytes());
        }
        icmp.extend_from_slice(&datagram[..quote_len]);
        let csum = internet_checksum(&[&icmp]);
        icmp[2..4].copy_from_slice(&csum.to_be_bytes());
        let src_mac = if program == Program::PodEgress {
            self.cast
                .senders
                .iter()
                .find(|(a, _)| *a == src)
                .map_or(src_mac, |(_, m)| *m)
        } else {
            src_mac
        };
        let f = Fields {
            src_mac,
            src,
            dst,
            proto: PROTO_ICMP,
            ttl: self.ttl(),
            id: self.rng.u16(0..64),
            l4: icmp,
        };
        frame(&f)
    }

    fn vlan(&mut self, program: Program) -> Vec<u8> {
        let inner = frame(&self.fields(program));
        let mut tagged = inner[..12].to_vec();
        tagged.extend_from_slice(&0x8100u16.to_be_bytes());
        tagged.extend_from_slice(&(self.rng.u16(1..4095)).to_be_bytes());
        tagged.extend_from_slice(&inner[12..]);
        tagged
    }

    fn ipv6(&mut self) -> Vec<u8> {
        let mut frame = vec![0x02, 0, 0, 0, 0, 2, 0x02, 0, 0, 0, 0, 1, 0x86, 0xdd];
        let payload = self.payload();
        let mut header = vec![0x60, 0, 0, 0];
        header.extend_from_slice(&u16::try_from(payload.len()).unwrap_or(0).to_be_bytes());
        header.push(self.pick(&[6u8, 17, 58, 44]));
        header.push(64);
        header.extend((0..32).map(|_| self.rng.u8(..)));
        frame.extend_from_slice(&header);
        frame.extend_from_slice(&payload);
        frame
    }

    fn flipped(&mut self, program: Program, model: &Model) -> Vec<u8> {
        let f = self.some_fields(program, model);
        let mut packet = frame(&f);
        for _ in 0..self.rng.usize(1..=3) {
            let at = self.rng.usize(12..packet.len());
            packet[at] ^= 1 << self.rng.u32(0..8);
        }
        packet
    }

    fn garbage(&mut self) -> Vec<u8> {
        let len = self.rng.usize(14..128);
        let mut packet: Vec<u8> = (0..len).map(|_| self.rng.u8(..)).collect();
        if self.rng.bool() {
            packet[12..14].copy_from_slice(&0x0800u16.to_be_bytes());
        }
        packet
    }
}

/// The Ethernet frame of `f`, unfragmented, no options.
fn frame(f: &Fields) -> Vec<u8> {
    ip_frame(f, &[], 0, &f.l4)
}

/// TCP's or UDP's checksum over the pseudo-header and `segment`.
fn pseudo_checksum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, segment: &[u8]) -> u16 {
    let len = u16::try_from(segment.len())
        .unwrap_or(u16::MAX)
        .to_be_bytes();
    internet_checksum(&[&src.octets(), &dst.octets(), &[0, proto], &len, segment])
}

/// An Ethernet frame: `f`'s IPv4 header with `options` and the fragment
/// field `frag` (flags and offset), carrying `payload`.
fn ip_frame(f: &Fields, options: &[u8], frag: u16, payload: &[u8]) -> Vec<u8> {
    let ihl = 20 + options.len();
    let total = u16::try_from(ihl + payload.len()).unwrap_or(u16::MAX);
    let mut ip = vec![0u8; ihl];
    ip[0] = 0x40 | u8::try_from(ihl / 4).unwrap_or(5);
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[4..6].copy_from_slice(&f.id.to_be_bytes());
    ip[6..8].copy_from_slice(&frag.to_be_bytes());
    ip[8] = f.ttl;
    ip[9] = f.proto;
    ip[12..16].copy_from_slice(&f.src.octets());
    ip[16..20].copy_from_slice(&f.dst.octets());
    ip[20..].copy_from_slice(options);
    let csum = internet_checksum(&[&ip]);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    let mut frame = vec![0x02, 0, 0, 0, 0, 2];
    frame.extend_from_slice(&f.src_mac);
    frame.extend_from_slice(&0x0800u16.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(payload);
    frame
}
