//! Crafting packets (etherparse) and reading them back with every checksum
//! verified by code independent of the programs'.

use std::net::Ipv4Addr;

use etherparse::{IcmpEchoHeader, Icmpv4Type, PacketBuilder};

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const TTL: u8 = 64;

/// A TCP segment with `flags` and `payload`, numbered as the first of
/// each side (sequence 1000, acknowledging 1).
pub fn tcp(
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    tcp_seq(src, sport, dst, dport, flags, (1000, 1), payload)
}

/// A TCP segment with `flags` and `payload`, its sequence and
/// acknowledgement numbers `(seq, ack)`.
pub fn tcp_seq(
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    flags: u8,
    (seq, ack): (u32, u32),
    payload: &[u8],
) -> Vec<u8> {
    let mut builder = PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv4(src.octets(), dst.octets(), TTL)
        .tcp(sport, dport, seq, 64240);
    if flags & TCP_SYN != 0 {
        builder = builder.syn();
    }
    if flags & TCP_ACK != 0 {
        builder = builder.ack(ack);
    }
    if flags & TCP_FIN != 0 {
        builder = builder.fin();
    }
    if flags & TCP_RST != 0 {
        builder = builder.rst();
    }
    let mut out = Vec::with_capacity(builder.size(payload.len()));
    builder.write(&mut out, payload).unwrap();
    out
}

pub fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, payload: &[u8]) -> Vec<u8> {
    let builder = PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv4(src.octets(), dst.octets(), TTL)
        .udp(sport, dport);
    let mut out = Vec::with_capacity(builder.size(payload.len()));
    builder.write(&mut out, payload).unwrap();
    out
}

pub fn icmp_echo(src: Ipv4Addr, dst: Ipv4Addr, request: bool, id: u16, seq: u16) -> Vec<u8> {
    let echo = IcmpEchoHeader { id, seq };
    let ty = if request {
        Icmpv4Type::EchoRequest(echo)
    } else {
        Icmpv4Type::EchoReply(echo)
    };
    let builder = PacketBuilder::ethernet2(SRC_MAC, DST_MAC)
        .ipv4(src.octets(), dst.octets(), TTL)
        .icmpv4(ty);
    let payload = b"vpcnet-ping";
    let mut out = Vec::with_capacity(builder.size(payload.len()));
    builder.write(&mut out, payload).unwrap();
    out
}

/// An ICMP query or reply of `icmp_type` (timestamp, information, address
/// mask, ...) with identifier `id`, its body `body` (zeros where the type
/// has fields).
pub fn icmp_query(src: Ipv4Addr, dst: Ipv4Addr, icmp_type: u8, id: u16, body: usize) -> Vec<u8> {
    let mut icmp = vec![icmp_type, 0, 0, 0];
    icmp.extend_from_slice(&id.to_be_bytes());
    icmp.extend_from_slice(&1u16.to_be_bytes());
    icmp.resize(8 + body, 0);
    let csum = internet_checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    ipv4_frame(src, dst, 1, &icmp, &[])
}

/// An ICMP error (`icmp_type`, `code`) from `src` to `dst` quoting the first
/// `quote_len` bytes of `quoted`'s IP datagram (an Ethernet frame).
pub fn icmp_error(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    icmp_type: u8,
    code: u8,
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    let datagram = &quoted[14..];
    let quote = &datagram[..quote_len.min(datagram.len())];
    let mut icmp = vec![icmp_type, code, 0, 0, 0, 0, 0, 0];
    if icmp_type == 3 && code == 4 {
        // Fragmentation needed: next-hop MTU.
        icmp[6..8].copy_from_slice(&1400u16.to_be_bytes());
    }
    icmp.extend_from_slice(quote);
    let csum = internet_checksum(&[&icmp]);
    icmp[2..4].copy_from_slice(&csum.to_be_bytes());
    ipv4_frame(src, dst, 1, &icmp, &[])
}

/// An SCTP packet with one INIT chunk (its checksum left zero: nothing on
/// the node checks it).
pub fn sctp_init(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Vec<u8> {
    let mut sctp = vec![0u8; 12 + 20];
    sctp[0..2].copy_from_slice(&sport.to_be_bytes());
    sctp[2..4].copy_from_slice(&dport.to_be_bytes());
    // The INIT chunk: type 1, its length, an initiate tag, a window,
    // streams and an initial TSN.
    sctp[12] = 1;
    sctp[14..16].copy_from_slice(&20u16.to_be_bytes());
    sctp[16..20].copy_from_slice(&0x5eed_0001u32.to_be_bytes());
    sctp[20..24].copy_from_slice(&65_535u32.to_be_bytes());
    sctp[24..28].copy_from_slice(&0x0001_0001u32.to_be_bytes());
    sctp[28..32].copy_from_slice(&1u32.to_be_bytes());
    ipv4_frame(src, dst, 132, &sctp, &[])
}

/// An Ethernet frame around an IPv4 header (with `options`) and `payload`
/// given as bytes, checksum computed here.
pub fn ipv4_frame(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    payload: &[u8],
    options: &[u8],
) -> Vec<u8> {
    assert!(options.len().is_multiple_of(4) && options.len() <= 40);
    let ihl = 20 + options.len();
    let total = ihl + payload.len();
    let mut ip = vec![0u8; ihl];
    ip[0] = 0x40 | u8::try_from(ihl / 4).unwrap();
    ip[2..4].copy_from_slice(&u16::try_from(total).unwrap().to_be_bytes());
    ip[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
    ip[8] = TTL;
    ip[9] = proto;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    ip[20..].copy_from_slice(options);
    let csum = internet_checksum(&[&ip]);
    ip[10..12].copy_from_slice(&csum.to_be_bytes());
    let mut frame = Vec::with_capacity(14 + total);
    frame.extend_from_slice(&DST_MAC);
    frame.extend_from_slice(&SRC_MAC);
    frame.extend_from_slice(&0x0800u16.to_be_bytes());
    frame.extend_from_slice(&ip);
    frame.extend_from_slice(payload);
    frame
}

/// The one's-complement checksum over `parts` concatenated.
pub fn internet_checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    let mut odd: Option<u8> = None;
    for part in parts {
        for &byte in *part {
            match odd.take() {
                Some(hi) => sum += u32::from(u16::from_be_bytes([hi, byte])),
                None => odd = Some(byte),
            }
        }
    }
    if let Some(hi) = odd {
        sum += u32::from(u16::from_be_bytes([hi, 0]));
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap()
}

/// A frame read back: addresses, ports and whether every checksum holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    /// TCP/UDP ports; ICMP echo: (id, id).
    pub sport: u16,
    pub dport: u16,
    pub ip_csum_ok: bool,
    /// L4 checksum (TCP/UDP with pseudo-header, ICMP over the message).
    pub l4_csum_ok: bool,
}

pub fn parse(frame: &[u8]) -> Parsed {
    let ip = &frame[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    let proto = ip[9];
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let l4 = &ip[ihl..total];
    let ip_csum_ok = internet_checksum(&[&ip[..ihl]]) == 0;
    let (sport, dport, l4_csum_ok) = match proto {
        6 | 17 => {
            let len = u16::try_from(l4.len()).unwrap().to_be_bytes();
            let pseudo = [&ip[12..20], &[0, proto], &len[..]].concat();
            let udp_no_csum = proto == 17 && l4[6] == 0 && l4[7] == 0;
            let ok = udp_no_csum || internet_checksum(&[&pseudo, l4]) == 0;
            (
                u16::from_be_bytes([l4[0], l4[1]]),
                u16::from_be_bytes([l4[2], l4[3]]),
                ok,
            )
        }
        1 => {
            let id = u16::from_be_bytes([l4[4], l4[5]]);
            (id, id, internet_checksum(&[l4]) == 0)
        }
        _ => (0, 0, true),
    };
    Parsed {
        src,
        dst,
        proto,
        sport,
        dport,
        ip_csum_ok,
        l4_csum_ok,
    }
}

/// The datagram an ICMP error quotes, read back (checksums of the quoted
/// IP header checked; the quoted L4 checksum only when fully quoted).
pub fn parse_quoted(frame: &[u8]) -> Parsed {
    let ip = &frame[14..];
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let inner = &ip[ihl + 8..];
    let mut fake = vec![0u8; 14];
    fake.extend_from_slice(inner);
    let inner_total = usize::from(u16::from_be_bytes([inner[2], inner[3]]));
    if inner.len() >= inner_total {
        parse(&fake)
    } else {
        let inner_ihl = usize::from(inner[0] & 0x0f) * 4;
        let l4 = &inner[inner_ihl..];
        Parsed {
            src: Ipv4Addr::new(inner[12], inner[13], inner[14], inner[15]),
            dst: Ipv4Addr::new(inner[16], inner[17], inner[18], inner[19]),
            proto: inner[9],
            sport: u16::from_be_bytes([l4[0], l4[1]]),
            dport: u16::from_be_bytes([l4[2], l4[3]]),
            ip_csum_ok: internet_checksum(&[&inner[..inner_ihl]]) == 0,
            l4_csum_ok: true,
        }
    }
}
