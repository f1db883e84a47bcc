//! Reading the headers the programs act on, and rewriting addresses and
//! ports with their checksums. Offsets are from the start of the Ethernet
//! frame (tc on ENIs and veths sees Ethernet).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::TcContext,
};
use vpcnet_common::{
    counters::Counter,
    nat::{PROTO_ICMP, PROTO_TCP, PROTO_UDP, SEEN_ANY, Segment},
};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const IP_OFF: usize = ETH_HLEN;
pub const IP_TTL_OFF: usize = IP_OFF + 8;
pub const IP_CSUM_OFF: usize = IP_OFF + 10;
pub const IP_SADDR_OFF: usize = IP_OFF + 12;
pub const IP_DADDR_OFF: usize = IP_OFF + 16;
const IP_MF: u16 = 0x2000;
const IP_OFFSET_MASK: u16 = 0x1fff;

pub const ICMP_ECHO_REPLY: u8 = 0;
pub const ICMP_DEST_UNREACH: u8 = 3;
pub const ICMP_ECHO: u8 = 8;
pub const ICMP_TIME_EXCEEDED: u8 = 11;
pub const ICMP_PARAMETERPROB: u8 = 12;
pub const ICMP_TIMESTAMP: u8 = 13;
pub const ICMP_TIMESTAMP_REPLY: u8 = 14;
pub const ICMP_INFO_REQUEST: u8 = 15;
pub const ICMP_INFO_REPLY: u8 = 16;
pub const ICMP_ADDRESS: u8 = 17;
pub const ICMP_ADDRESS_REPLY: u8 = 18;

/// The ICMP queries conntrack tracks as flows, each with its reply (echo,
/// timestamp, information, address mask): the requests. Their identifier
/// is the flow's port, the requesting side's: `sport` as the request
/// leaves, `dport` as the reply comes back.
#[inline(always)]
pub const fn is_icmp_request(icmp_type: u8) -> bool {
    matches!(
        icmp_type,
        ICMP_ECHO | ICMP_TIMESTAMP | ICMP_INFO_REQUEST | ICMP_ADDRESS
    )
}

/// The replies of [`is_icmp_request`]'s queries.
#[inline(always)]
pub const fn is_icmp_reply(icmp_type: u8) -> bool {
    matches!(
        icmp_type,
        ICMP_ECHO_REPLY | ICMP_TIMESTAMP_REPLY | ICMP_INFO_REPLY | ICMP_ADDRESS_REPLY
    )
}

/// The ports of an ICMP message whose identifier is `id`: a query's, or
/// none.
#[inline(always)]
const fn icmp_ports(icmp_type: u8, id: u16) -> Option<(u16, u16)> {
    if is_icmp_request(icmp_type) {
        Some((id, 0))
    } else if is_icmp_reply(icmp_type) {
        Some((0, id))
    } else {
        None
    }
}
/// ICMP header length before an error's embedded datagram.
pub const ICMP_HLEN: usize = 8;

const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;

/// Where a datagram sits in a fragmented series.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Fragment {
    /// Not fragmented.
    Whole,
    /// First fragment: carries the L4 header.
    First,
    /// A later fragment: no L4 header.
    Later,
}

/// The IPv4 header fields the programs use (addresses in network order).
#[derive(Clone, Copy)]
pub struct Ipv4 {
    pub saddr: u32,
    pub daddr: u32,
    pub proto: u8,
    /// IP identification, network order.
    pub id: u16,
    pub fragment: Fragment,
    /// Offset of the L4 header (after IP options).
    pub l4_off: usize,
    /// Bytes from the L4 header to the datagram's end (the IP total length
    /// less the IP header's; the frame's own length for a BIG TCP packet,
    /// whose total length field is 0), Ethernet padding left out.
    pub l4_len: u32,
}

/// The L4 fields of a packet, in network order.
#[derive(Clone, Copy)]
pub struct L4 {
    /// TCP/UDP source port; ICMP echo: the identifier for a request, 0 for a reply.
    pub sport: u16,
    /// TCP/UDP destination port; ICMP echo: 0 for a request, the identifier for a reply.
    pub dport: u16,
    /// TCP flags (0 for other protocols).
    pub tcp_flags: u8,
    /// ICMP type (0 for other protocols).
    pub icmp_type: u8,
    /// Whether this is a TCP segment: the fields below are its own.
    pub is_tcp: bool,
    /// TCP: whether the segment carries sequence space (data, SYN, FIN).
    pub carries_seq: bool,
    /// TCP: whether it advertises a zero window.
    pub zero_window: bool,
    /// TCP: the sequence number after the segment, and its
    /// acknowledgement, host order.
    pub seq_end: u32,
    pub ack: u32,
}

impl L4 {
    /// What a portless protocol (GRE, ESP, SCTP, ...) gives the NAT: no
    /// ports, no flags.
    pub const fn portless() -> Self {
        Self::ports(0, 0, 0)
    }

    /// A UDP or ICMP header's ports (or echo identifier).
    pub const fn ports(sport: u16, dport: u16, icmp_type: u8) -> Self {
        Self {
            sport,
            dport,
            tcp_flags: 0,
            icmp_type,
            is_tcp: false,
            carries_seq: false,
            zero_window: false,
            seq_end: 0,
            ack: 0,
        }
    }

    /// TCP: a SYN without ACK (a connection attempt).
    pub const fn is_syn(&self) -> bool {
        self.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN) == TCP_SYN
    }

    /// TCP: a packet that may open tracking when nothing is known of the flow:
    /// a SYN, or a bare ACK picked up mid-stream (netfilter's loose mode).
    /// SYN-ACK, FIN and RST never open a flow.
    pub const fn may_open_tcp(&self) -> bool {
        let f = self.tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST | TCP_FIN);
        f == TCP_SYN || f == TCP_ACK
    }

    /// The `SEEN_*` bits this packet contributes to its direction's entry.
    pub const fn seen_bits(&self) -> u8 {
        (self.tcp_flags & (TCP_FIN | TCP_SYN | TCP_RST | TCP_ACK)) | SEEN_ANY
    }

    /// TCP: what the segment tells its direction's sequence tracking.
    pub const fn segment(&self) -> Segment {
        Segment {
            end: self.seq_end,
            ack: self.ack,
            flags: self.tcp_flags,
            carries_seq: self.carries_seq,
            zero_window: self.zero_window,
        }
    }
}

#[inline(always)]
pub fn load<T>(ctx: &TcContext, off: usize) -> Result<T, Counter> {
    ctx.load::<T>(off).map_err(|_| Counter::DropTruncated)
}

/// The frame's source MAC.
#[inline(always)]
pub fn src_mac(ctx: &TcContext) -> Result<[u8; 6], Counter> {
    load(ctx, 6)
}

/// Whether the frame carries IPv4.
#[inline(always)]
pub fn is_ipv4(ctx: &TcContext) -> bool {
    matches!(ctx.load::<u16>(12), Ok(proto) if u16::from_be(proto) == ETH_P_IP)
}

/// Parses the IPv4 header at `off` (the outer one at [`ETH_HLEN`], or one
/// embedded in an ICMP error).
#[inline(always)]
pub fn parse_ipv4(ctx: &TcContext, off: usize) -> Result<Ipv4, Counter> {
    let ver_ihl: u8 = load(ctx, off)?;
    if ver_ihl >> 4 != 4 {
        return Err(Counter::DropMalformed);
    }
    let ihl = usize::from(ver_ihl & 0x0f) * 4;
    if ihl < IP_HLEN {
        return Err(Counter::DropMalformed);
    }
    let total = u16::from_be(load::<u16>(ctx, off + 2)?);
    let id: u16 = load(ctx, off + 4)?;
    let frag = u16::from_be(load::<u16>(ctx, off + 6)?);
    let proto: u8 = load(ctx, off + 9)?;
    let saddr: u32 = load(ctx, off + 12)?;
    let daddr: u32 = load(ctx, off + 16)?;
    let fragment = if frag & IP_OFFSET_MASK != 0 {
        Fragment::Later
    } else if frag & IP_MF != 0 {
        Fragment::First
    } else {
        Fragment::Whole
    };
    // A BIG TCP packet's total length field is 0: its length is the frame's.
    let total = match total {
        0 => ctx.len().saturating_sub(off as u32),
        total => u32::from(total),
    };
    Ok(Ipv4 {
        saddr,
        daddr,
        proto,
        id,
        fragment,
        l4_off: off + ihl,
        l4_len: total.saturating_sub(ihl as u32),
    })
}

/// Length of the fixed part of an IPv4 header, of a TCP header, and of a
/// UDP or ICMP one.
const IP_HLEN: usize = 20;
const TCP_HLEN: usize = 20;
const UDP_ICMP_HLEN: usize = 8;

/// Parses the L4 header at `off`, whose fixed part must all be there: a
/// packet cut inside it is dropped before it makes any state (a flow for a
/// packet that is then dropped for want of its checksum field) and before
/// any rewrite. `Ok(None)`: a protocol the NAT does not translate.
#[inline(always)]
pub fn parse_l4(ctx: &TcContext, ip: &Ipv4) -> Result<Option<L4>, Counter> {
    let (proto, off) = (ip.proto, ip.l4_off);
    if !matches!(proto, PROTO_TCP | PROTO_UDP | PROTO_ICMP) {
        return Ok(None);
    }
    // One read of the whole fixed part: each read is a helper call.
    let l4 = match proto {
        PROTO_TCP => {
            let tcp: [u8; TCP_HLEN] = load(ctx, off)?;
            let flags = tcp[13];
            let seq = u32::from_be_bytes([tcp[4], tcp[5], tcp[6], tcp[7]]);
            let header = u32::from(tcp[12] >> 4) * 4;
            // SYN and FIN each take a sequence number.
            let len = ip.l4_len.saturating_sub(header)
                + u32::from(flags & TCP_SYN != 0)
                + u32::from(flags & TCP_FIN != 0);
            L4 {
                sport: u16::from_ne_bytes([tcp[0], tcp[1]]),
                dport: u16::from_ne_bytes([tcp[2], tcp[3]]),
                tcp_flags: flags,
                icmp_type: 0,
                is_tcp: true,
                carries_seq: len != 0,
                zero_window: tcp[14] == 0 && tcp[15] == 0,
                seq_end: seq.wrapping_add(len),
                ack: u32::from_be_bytes([tcp[8], tcp[9], tcp[10], tcp[11]]),
            }
        }
        _ => {
            let header: [u8; UDP_ICMP_HLEN] = load(ctx, off)?;
            let (first, second) = (
                u16::from_ne_bytes([header[0], header[1]]),
                u16::from_ne_bytes([header[2], header[3]]),
            );
            if proto == PROTO_UDP {
                L4::ports(first, second, 0)
            } else {
                let icmp_type = header[0];
                let id = u16::from_ne_bytes([header[4], header[5]]);
                let (sport, dport) = icmp_ports(icmp_type, id).unwrap_or_default();
                L4::ports(sport, dport, icmp_type)
            }
        }
    };
    Ok(Some(l4))
}

/// The ports (or query identifier) of a datagram quoted in an ICMP error:
/// only its first 8 L4 bytes are sure to be there (RFC 792), which is
/// enough for ports and the identifier but not for TCP's flags.
#[inline(always)]
pub fn parse_quoted_l4(ctx: &TcContext, proto: u8, off: usize) -> Result<Option<L4>, Counter> {
    let (sport, dport, icmp_type) = match proto {
        PROTO_TCP | PROTO_UDP => (load(ctx, off)?, load(ctx, off + 2)?, 0),
        PROTO_ICMP => {
            let icmp_type: u8 = load(ctx, off)?;
            let id: u16 = load(ctx, off + 4)?;
            match icmp_ports(icmp_type, id) {
                Some((sport, dport)) => (sport, dport, icmp_type),
                None => return Ok(None),
            }
        }
        _ => return Ok(None),
    };
    Ok(Some(L4::ports(sport, dport, icmp_type)))
}

/// Offset of the L4 checksum, relative to the L4 header; `None` for a
/// protocol without one that covers the addresses.
#[inline(always)]
pub const fn l4_csum_rel(proto: u8) -> usize {
    match proto {
        PROTO_TCP => 16,
        PROTO_UDP => 6,
        _ => 2, // ICMP
    }
}

/// Flags for an L4 checksum update: UDP's 0 means "no checksum" and must
/// stay 0.
#[inline(always)]
const fn l4_csum_flags(proto: u8) -> u64 {
    if proto == PROTO_UDP {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

/// Rewrites the outer source or destination address at `addr_off`
/// (`IP_SADDR_OFF` or `IP_DADDR_OFF`), fixing the IP checksum and, for TCP and
/// UDP whose checksums cover the addresses, the L4 checksum. `fix_l4` is
/// false for non-first fragments, which carry no L4 header.
#[inline(always)]
pub fn set_addr(
    ctx: &TcContext,
    ip: &Ipv4,
    addr_off: usize,
    old: u32,
    new: u32,
    fix_l4: bool,
) -> Result<(), Counter> {
    if fix_l4 && (ip.proto == PROTO_TCP || ip.proto == PROTO_UDP) {
        ctx.l4_csum_replace(
            ip.l4_off + l4_csum_rel(ip.proto),
            u64::from(old),
            u64::from(new),
            BPF_F_PSEUDO_HDR as u64 | 4 | l4_csum_flags(ip.proto),
        )
        .map_err(|_| Counter::DropRewrite)?;
    }
    ctx.l3_csum_replace(IP_CSUM_OFF, u64::from(old), u64::from(new), 4)
        .map_err(|_| Counter::DropRewrite)?;
    ctx.store(addr_off, &new, 0)
        .map_err(|_| Counter::DropRewrite)
}

/// Rewrites the 16-bit port (or ICMP echo identifier) at `port_off`, fixing
/// the L4 checksum at `csum_off`.
#[inline(always)]
pub fn set_port(
    ctx: &TcContext,
    proto: u8,
    port_off: usize,
    csum_off: usize,
    old: u16,
    new: u16,
) -> Result<(), Counter> {
    if old == new {
        return Ok(());
    }
    ctx.l4_csum_replace(
        csum_off,
        u64::from(old),
        u64::from(new),
        2 | l4_csum_flags(proto),
    )
    .map_err(|_| Counter::DropRewrite)?;
    ctx.store(port_off, &new, 0)
        .map_err(|_| Counter::DropRewrite)
}

/// One's-complement checksum `check` updated for a 16-bit word changing from
/// `old` to `new` (RFC 1624, eqn. 3). Works on words in any byte order as
/// long as all three are in the same one.
#[inline(always)]
pub const fn csum_update16(check: u16, old: u16, new: u16) -> u16 {
    let mut sum = (!check as u32) + (!old as u32) + new as u32;
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// [`csum_update16`] for a 32-bit field (two words).
#[inline(always)]
pub const fn csum_update32(check: u16, old: u32, new: u32) -> u16 {
    let check = csum_update16(check, old as u16, new as u16);
    csum_update16(check, (old >> 16) as u16, (new >> 16) as u16)
}
