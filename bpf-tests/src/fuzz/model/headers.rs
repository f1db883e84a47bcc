//! Parsing, the model's own: IPv4 and L4 headers, quoted datagrams, and
//! what a flow's state says.

use vpcnet_common::{
    counters::Counter,
    nat::{FlowKey, FlowKind, PROTO_ICMP, PROTO_TCP, PROTO_UDP, SEEN_ANY, SEEN_SYN},
};

use super::{Frag, Ip, Ports};
use crate::packets::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

pub(super) fn raw32(p: &[u8], off: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(p.get(off..off + 4)?.try_into().ok()?))
}

pub(super) fn raw16(p: &[u8], off: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(p.get(off..off + 2)?.try_into().ok()?))
}

pub(super) fn key(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> FlowKey {
    FlowKey::new(saddr, daddr, sport, dport, proto)
}

pub(super) fn progressed(seen: u8) -> bool {
    seen & !(SEEN_SYN | SEEN_ANY) != 0
}

pub(super) fn untranslated(kind: u8) -> bool {
    kind == FlowKind::NoSnat as u8 || kind == FlowKind::Inbound as u8
}

/// ICMP queries conntrack tracks: echo, timestamp, information, address
/// mask; requests, then replies.
pub(super) fn is_icmp_request(icmp_type: u8) -> bool {
    matches!(icmp_type, 8 | 13 | 15 | 17)
}

pub(super) fn is_icmp_reply(icmp_type: u8) -> bool {
    matches!(icmp_type, 0 | 14 | 16 | 18)
}

/// A query's ports: its identifier on the asking side.
fn icmp_ports(icmp_type: u8, id: u16) -> Option<(u16, u16)> {
    if is_icmp_request(icmp_type) {
        Some((id, 0))
    } else if is_icmp_reply(icmp_type) {
        Some((0, id))
    } else {
        None
    }
}

pub(super) fn is_icmp_error(icmp_type: u8) -> bool {
    matches!(icmp_type, 3 | 11 | 12)
}

pub(super) fn may_open(proto: u8, l4: Ports) -> bool {
    match proto {
        PROTO_TCP => {
            let f = l4.flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK);
            f == TCP_SYN || f == TCP_ACK
        }
        PROTO_ICMP => is_icmp_request(l4.icmp_type),
        _ => true,
    }
}

/// The IPv4 header at `off`.
pub(super) fn ip_at(p: &[u8], off: usize) -> Result<Ip, Counter> {
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
    let total = match u16::from_be_bytes([p[off + 2], p[off + 3]]) {
        0 => p.len() - off,
        total => usize::from(total),
    };
    Ok(Ip {
        off,
        l4_len: total.saturating_sub(ihl),
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
pub(super) fn l4_at(p: &[u8], ip: &Ip) -> Result<Option<Ports>, Counter> {
    let (proto, off) = (ip.proto, ip.l4);
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
        PROTO_TCP => {
            let flags = p[off + 13];
            let seq = u32::from_be_bytes(p[off + 4..off + 8].try_into().expect("4 bytes"));
            let header = usize::from(p[off + 12] >> 4) * 4;
            let payload = ip.l4_len.saturating_sub(header);
            let space = u32::try_from(payload).unwrap_or(u32::MAX)
                + u32::from(flags & TCP_SYN != 0)
                + u32::from(flags & TCP_FIN != 0);
            Ports {
                flags,
                is_tcp: true,
                carries_seq: space > 0,
                zero_window: p[off + 14] == 0 && p[off + 15] == 0,
                seq_end: seq.wrapping_add(space),
                ack: u32::from_be_bytes(p[off + 8..off + 12].try_into().expect("4 bytes")),
                ..Ports::of(a, b, 0)
            }
        }
        PROTO_UDP => Ports::of(a, b, 0),
        _ => {
            let icmp_type = p[off];
            let id = raw16(p, off + 4).unwrap_or_default();
            let (sport, dport) = icmp_ports(icmp_type, id).unwrap_or_default();
            Ports::of(sport, dport, icmp_type)
        }
    }))
}

/// The datagram an ICMP error quotes: its header, and its tuple from the
/// first 8 bytes of its L4 header. `None` when it is not one to act on.
pub(super) fn quoted(p: &[u8], outer: &Ip) -> Option<(Ip, FlowKey)> {
    let inner = ip_at(p, outer.l4 + 8).ok()?;
    if inner.frag == Frag::Later {
        return None;
    }
    let (sport, dport) = match inner.proto {
        PROTO_TCP | PROTO_UDP => (raw16(p, inner.l4)?, raw16(p, inner.l4 + 2)?),
        PROTO_ICMP => {
            let icmp_type = *p.get(inner.l4)?;
            let id = raw16(p, inner.l4 + 4)?;
            icmp_ports(icmp_type, id)?
        }
        _ => return None,
    };
    let flow = key(inner.saddr, inner.daddr, sport, dport, inner.proto);
    Some((inner, flow))
}
