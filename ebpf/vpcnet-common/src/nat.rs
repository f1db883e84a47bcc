//! Connection tracking and NAT state.
//!
//! A flow is two entries, one per map, created together and removed
//! together:
//!
//! - `NAT_FWD[original tuple]` as the flow leaves (pod or node address and
//!   port, remote address and port) holds the translated address and port;
//! - `NAT_REV[reply tuple]` as replies arrive (remote, node address, remote
//!   port, translated port) holds the original address and port. Inserting
//!   it with `BPF_NOEXIST` is what claims a port: exactly one flow wins.
//!
//! Why two plain hash maps and no LRU: an LRU map evicts entries on its own,
//! one at a time, so it can drop one half of a pair and leave the other
//! pointing at a port somebody else then takes. Plain hash maps never evict:
//! a pair disappears only when the agent's garbage collector or the datapath
//! itself (taking over an expired flow's port) removes both halves. When the
//! maps are full, new flows are dropped with `drop_nat_table_full`, and every
//! flow that has its entries keeps working.
//!
//! Each direction writes only its own entry (flags seen, last seen), so the
//! two CPUs handling the two directions of a flow never write the same cache
//! line. The state of the flow is derived from both entries by [`flow_state`],
//! the one definition the datapath and the garbage collector share.

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// Whether a protocol's flows have no ports (GRE, ESP, SCTP, ...): the NAT
/// translates their address only, as the SNAT chain does, so one flow per
/// remote address and protocol holds the node address (its ports are 0).
#[must_use]
pub const fn is_portless(proto: u8) -> bool {
    !matches!(proto, PROTO_ICMP | PROTO_TCP | PROTO_UDP)
}

/// A flow's tuple as one direction's packets carry it. ICMP echo uses the
/// identifier as the port of the side that sent the request (`sport` on the
/// way out, `dport` on the way back) and 0 for the other.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FlowKey {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    // Padding as a byte and an aligned half-word, not `[u8; 3]`: the BPF
    // backend zeroes an unaligned 3-byte array with a call to `memset`, a
    // frame of its own that kernels before 6.9 count as 32 stack bytes.
    pub _pad1: u8,
    pub _pad2: u16,
}

impl FlowKey {
    #[must_use]
    pub const fn new(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> Self {
        Self {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            _pad1: 0,
            _pad2: 0,
        }
    }

    /// The tuple of the other direction.
    #[must_use]
    pub const fn reversed(&self) -> Self {
        Self::new(self.daddr, self.saddr, self.dport, self.sport, self.proto)
    }
}

/// The reply tuple of a flow whose forward tuple is `fwd` once translated to
/// `addr:port`: the key of its claim in the reverse table.
// Inlined into the programs as when they were the eBPF crate's own.
#[allow(clippy::inline_always)]
#[inline(always)]
#[must_use]
pub const fn reply_key(fwd: &FlowKey, addr: u32, port: u16) -> FlowKey {
    FlowKey::new(fwd.daddr, addr, fwd.dport, port, fwd.proto)
}

/// The forward tuple of the flow a claim (`rev`, keyed `rev_key`) belongs
/// to.
#[allow(clippy::inline_always)]
#[inline(always)]
#[must_use]
pub const fn forward_key(rev_key: &FlowKey, rev: &NatEntry) -> FlowKey {
    FlowKey::new(
        rev.addr,
        rev_key.saddr,
        rev.port,
        rev_key.sport,
        rev_key.proto,
    )
}

/// What a flow is.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowKind {
    /// A pod flow translated to the node address.
    Snat = 1,
    /// A flow of the node's own sockets: its port is reserved so no NAT flow
    /// takes it, and moved only when a NAT flow already held it.
    Host = 2,
    /// A pod flow to a non-VPC destination started while EXTERNALSNAT was on:
    /// tracked (forward entry only) so it stays un-NATed if the flag flips.
    NoSnat = 3,
}

impl FlowKind {
    #[must_use]
    pub const fn from_raw(raw: u8) -> Option<Self> {
        match raw {
            1 => Some(Self::Snat),
            2 => Some(Self::Host),
            3 => Some(Self::NoSnat),
            _ => None,
        }
    }
}

/// TCP flags an entry has seen in its direction (a subset of the header's).
pub const SEEN_FIN: u8 = 0x01;
pub const SEEN_SYN: u8 = 0x02;
pub const SEEN_RST: u8 = 0x04;
pub const SEEN_ACK: u8 = 0x10;
/// Any packet seen in this direction (set for every protocol).
pub const SEEN_ANY: u8 = 0x80;

/// One half of a flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatEntry {
    /// Forward entry: the translated address. Reverse entry: the original.
    pub addr: u32,
    /// Forward entry: the translated port. Reverse entry: the original.
    pub port: u16,
    /// A [`FlowKind`] as `u8`.
    pub kind: u8,
    /// `SEEN_*` bits of this direction.
    pub seen: u8,
    /// `bpf_ktime_get_ns` of the last packet in this direction; refreshed at
    /// most every [`TOUCH_INTERVAL_NS`] unless the flags change.
    pub last_seen_ns: u64,
    /// When the flow was created (same clock).
    pub created_ns: u64,
}

crate::impl_pod!(FlowKey, NatEntry);

pub const NS_PER_SEC: u64 = 1_000_000_000;

/// `last_seen_ns` is rewritten at most this often (a write per packet would
/// bounce the cache line between CPUs).
pub const TOUCH_INTERVAL_NS: u64 = NS_PER_SEC;

/// A closed TCP flow's port goes to another flow for the same remote
/// endpoint only after this long: the remote may hold the old connection in
/// TIME_WAIT (Linux: 60 s, on a timer wheel that may fire it seconds late;
/// the lab saw refusals when ports came back at exactly 60 s; 120 s is also
/// netfilter's own TIME_WAIT timeout), and a SYN from another connection would be
/// refused there (PAWS) or answered with a stale ACK, costing the client a
/// SYN retransmit. "Another flow" includes the same pod from another source
/// port: Linux derives both the ISN and the timestamp offset from a keyed
/// hash of the whole 4-tuple, so a new source port means an unrelated
/// timestamp clock (measured in the lab: same-pod reuse after 1 s made the
/// server refuse about half of such SYNs). Only the very same tuple opening
/// again keeps its port (see the datapath's reopen), and that one is safe:
/// same 4-tuple, same clock, later timestamps.
pub const TIME_WAIT_HOLD_NS: u64 = 120 * NS_PER_SEC;

/// Timeouts, as netfilter's defaults where a flow kind has one.
pub const TCP_SYN_SENT_TIMEOUT_NS: u64 = 120 * NS_PER_SEC;
pub const TCP_ESTABLISHED_TIMEOUT_NS: u64 = 432_000 * NS_PER_SEC;
pub const TCP_FIN_WAIT_TIMEOUT_NS: u64 = 120 * NS_PER_SEC;
pub const UDP_TIMEOUT_NS: u64 = 30 * NS_PER_SEC;
pub const UDP_STREAM_TIMEOUT_NS: u64 = 120 * NS_PER_SEC;
pub const ICMP_TIMEOUT_NS: u64 = 30 * NS_PER_SEC;
/// netfilter's generic timeout, for the portless protocols.
pub const GENERIC_TIMEOUT_NS: u64 = 600 * NS_PER_SEC;

/// A flow's state, derived from its two entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowState {
    /// Nothing came back yet.
    New,
    /// Both directions seen, no FIN or RST.
    Established,
    /// One side sent FIN.
    Closing,
    /// Both sides sent FIN, or one sent RST.
    Closed,
}

impl FlowState {
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Established => "established",
            Self::Closing => "closing",
            Self::Closed => "closed",
        }
    }
}

#[must_use]
pub const fn flow_state(proto: u8, fwd_seen: u8, rev_seen: u8) -> FlowState {
    let replied = rev_seen & SEEN_ANY != 0;
    if proto != PROTO_TCP {
        return if replied {
            FlowState::Established
        } else {
            FlowState::New
        };
    }
    let both = fwd_seen | rev_seen;
    if both & SEEN_RST != 0 || (fwd_seen & SEEN_FIN != 0 && rev_seen & SEEN_FIN != 0) {
        FlowState::Closed
    } else if both & SEEN_FIN != 0 {
        FlowState::Closing
    } else if replied {
        FlowState::Established
    } else {
        FlowState::New
    }
}

/// How long a flow in `state` lives after its last packet.
#[must_use]
pub const fn flow_timeout_ns(proto: u8, state: FlowState) -> u64 {
    match (proto, state) {
        (PROTO_TCP, FlowState::New) => TCP_SYN_SENT_TIMEOUT_NS,
        (PROTO_TCP, FlowState::Established) => TCP_ESTABLISHED_TIMEOUT_NS,
        (PROTO_TCP, FlowState::Closing) => TCP_FIN_WAIT_TIMEOUT_NS,
        (PROTO_TCP, FlowState::Closed) => TIME_WAIT_HOLD_NS,
        (PROTO_UDP, FlowState::New) => UDP_TIMEOUT_NS,
        (PROTO_UDP, _) => UDP_STREAM_TIMEOUT_NS,
        (PROTO_ICMP, _) => ICMP_TIMEOUT_NS,
        _ => GENERIC_TIMEOUT_NS,
    }
}

/// The later of the two entries' last packets.
#[must_use]
pub const fn flow_last_seen_ns(fwd: &NatEntry, rev: &NatEntry) -> u64 {
    if fwd.last_seen_ns > rev.last_seen_ns {
        fwd.last_seen_ns
    } else {
        rev.last_seen_ns
    }
}

/// Whether a flow is over: its entries may be removed and its port reused
/// by anyone.
#[must_use]
pub const fn flow_expired(proto: u8, fwd: &NatEntry, rev: &NatEntry, now_ns: u64) -> bool {
    let state = flow_state(proto, fwd.seen, rev.seen);
    now_ns.saturating_sub(flow_last_seen_ns(fwd, rev)) > flow_timeout_ns(proto, state)
}

/// Whether a new flow may take this flow's port for the same remote
/// endpoint now: only once the flow is over, which for a closed TCP flow
/// means the remote's TIME_WAIT is surely over too ([`TIME_WAIT_HOLD_NS`]).
#[must_use]
pub const fn port_reusable(proto: u8, fwd: &NatEntry, rev: &NatEntry, now_ns: u64) -> bool {
    flow_expired(proto, fwd, rev, now_ns)
}

/// The program that saw a fragmented datagram: each keeps its own record,
/// as the same datagram may cross two of them (a pod's program, then an
/// ENI's after the stack).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FragHook {
    PodEgress = 1,
    EniEgress = 2,
    EniIngress = 3,
}

/// Key of the fragment map: a datagram is its addresses, IP id and
/// protocol as it arrived, per program.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragKey {
    pub saddr: u32,
    pub daddr: u32,
    pub id: u16,
    pub proto: u8,
    /// A [`FragHook`] as `u8`.
    pub hook: u8,
}

/// The first fragment was handed on (to the stack, or on out of the ENI
/// it was leaving by).
pub const FRAG_VIA_PASS: u8 = 0;
/// The first fragment went straight into the local pod it is addressed to.
pub const FRAG_VIA_POD: u8 = 1;
/// The first fragment was routed out of an ENI (the TTL went down by one).
pub const FRAG_VIA_ENI_FORWARDED: u8 = 2;
/// The first fragment, already routed by the stack, was steered out of
/// another ENI (the TTL stays).
pub const FRAG_VIA_ENI_ROUTED: u8 = 3;

/// Where a datagram's first fragment went and what it became: every later
/// fragment, which carries no L4 header, is rewritten and sent the same
/// way, so none takes another path (the node's stack, with conntrack
/// reassembling, would wait for a first fragment that never comes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragPath {
    /// The address the NAT rewrote (the source leaving, the destination
    /// arriving) to; 0 when it was not rewritten.
    pub addr: u32,
    /// The ENI's link for the `FRAG_VIA_ENI_*` ways.
    pub ifindex: u32,
    /// A `FRAG_VIA_*`.
    pub via: u8,
    pub _pad1: u8,
    pub _pad2: u16,
}

crate::impl_pod!(FragKey, FragPath);

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(addr: u32, seen: u8, last: u64) -> NatEntry {
        NatEntry {
            addr,
            seen,
            last_seen_ns: last,
            ..NatEntry::default()
        }
    }

    #[test]
    fn closed_tcp_port_is_held_for_time_wait_whoever_asks() {
        let closed_at = 100 * NS_PER_SEC;
        let fwd = entry(1, SEEN_ANY | SEEN_SYN | SEEN_FIN, closed_at);
        let rev = entry(7, SEEN_ANY | SEEN_SYN | SEEN_ACK | SEEN_FIN, closed_at);
        assert_eq!(flow_state(PROTO_TCP, fwd.seen, rev.seen), FlowState::Closed);
        assert!(!port_reusable(
            PROTO_TCP,
            &fwd,
            &rev,
            closed_at + NS_PER_SEC
        ));
        assert!(!port_reusable(
            PROTO_TCP,
            &fwd,
            &rev,
            closed_at + 119 * NS_PER_SEC
        ));
        assert!(port_reusable(
            PROTO_TCP,
            &fwd,
            &rev,
            closed_at + 121 * NS_PER_SEC
        ));
    }

    #[test]
    fn established_flow_is_never_reusable_before_its_timeout() {
        let fwd = entry(1, SEEN_ANY | SEEN_SYN | SEEN_ACK, 0);
        let rev = entry(7, SEEN_ANY | SEEN_SYN | SEEN_ACK, 0);
        assert_eq!(
            flow_state(PROTO_TCP, fwd.seen, rev.seen),
            FlowState::Established
        );
        assert!(!port_reusable(PROTO_TCP, &fwd, &rev, 3600 * NS_PER_SEC));
    }

    #[test]
    fn udp_state_follows_replies() {
        assert_eq!(flow_state(PROTO_UDP, SEEN_ANY, 0), FlowState::New);
        assert_eq!(
            flow_state(PROTO_UDP, SEEN_ANY, SEEN_ANY),
            FlowState::Established
        );
        let fwd = entry(1, SEEN_ANY, 0);
        let rev = entry(7, 0, 0);
        assert!(!flow_expired(PROTO_UDP, &fwd, &rev, UDP_TIMEOUT_NS));
        assert!(flow_expired(PROTO_UDP, &fwd, &rev, UDP_TIMEOUT_NS + 1));
    }

    #[test]
    fn rst_closes_from_either_side() {
        assert_eq!(
            flow_state(PROTO_TCP, SEEN_ANY | SEEN_RST, SEEN_ANY),
            FlowState::Closed
        );
        assert_eq!(
            flow_state(PROTO_TCP, SEEN_ANY, SEEN_ANY | SEEN_RST),
            FlowState::Closed
        );
        assert_eq!(
            flow_state(PROTO_TCP, SEEN_ANY | SEEN_FIN, SEEN_ANY),
            FlowState::Closing
        );
    }
}
