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
//! A flow that keeps its addresses (EXTERNALSNAT, or opened from outside
//! the VPC) is a pair too, keyed by the pod's tuple and its reverse
//! ([`FlowKind::untranslated`]), so that its state is known and it expires
//! like any other.
//!
//! Why two plain hash maps and no LRU: an LRU map evicts entries on its own,
//! one at a time, so it can drop one half of a pair and leave the other
//! pointing at a port somebody else then takes. Plain hash maps never evict:
//! a pair disappears only when the agent's garbage collector or the datapath
//! itself (taking over an expired flow's port, or making room in a full
//! table by dropping a recent flow nobody answered) removes both halves.
//! When the maps are full of answered flows, new flows are dropped with
//! `drop_nat_table_full`, and every flow that has its entries keeps working.
//!
//! Each direction writes only its own entry (flags seen, last seen), so the
//! two CPUs handling the two directions of a flow never write the same cache
//! line. The state of the flow is derived from both entries by [`flow_state`],
//! and its lifetime by [`flow_expired`] with the node's conntrack
//! [`Timeouts`]: the one definition the datapath and the garbage collector
//! share.

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
    /// tracked so it stays un-NATed if the flag flips.
    NoSnat = 3,
    /// A flow a non-VPC remote opened to a pod: tracked so the pod's replies
    /// leave un-NATed. Its first packet travels in the reverse entry's
    /// direction.
    Inbound = 4,
    /// In the stack flows map: a flow the stack delivered into a pod first
    /// (a node port's client after kube-proxy's DNAT, a kubelet probe).
    StackToPod = 5,
    /// In the stack flows map: a pod's flow to a service, which kube-proxy
    /// DNATed on its way out.
    StackFromPod = 6,
}

impl FlowKind {
    #[must_use]
    pub const fn from_raw(raw: u8) -> Option<Self> {
        match raw {
            1 => Some(Self::Snat),
            2 => Some(Self::Host),
            3 => Some(Self::NoSnat),
            4 => Some(Self::Inbound),
            5 => Some(Self::StackToPod),
            6 => Some(Self::StackFromPod),
            _ => None,
        }
    }

    /// Its name in listings and metrics.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Snat => "snat",
            Self::Host => "host",
            Self::NoSnat => "nosnat",
            Self::Inbound => "inbound",
            Self::StackToPod => "stack_to_pod",
            Self::StackFromPod => "stack_from_pod",
        }
    }

    /// Whether the first packet of a flow of the kind `raw` travelled in
    /// its reverse entry's direction (toward the pod).
    #[must_use]
    pub const fn opened_from_outside(raw: u8) -> bool {
        raw == Self::Inbound as u8 || raw == Self::StackToPod as u8
    }

    /// Whether flows of the kind `raw` keep their addresses: their pair is
    /// keyed by the pod's tuple and its reverse, and claims no port.
    #[must_use]
    pub const fn untranslated(raw: u8) -> bool {
        raw == Self::NoSnat as u8 || raw == Self::Inbound as u8
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

/// How long a flow lives after its last packet, per state, in seconds:
/// netfilter's conntrack timeouts, with their sysctl names
/// (`net.netfilter.nf_conntrack_<name>`). The agent writes the node's own
/// values into the `CT_TIMEOUTS` map, so flows live as long as conntrack's
/// on the same node (kube-proxy sets `tcp_timeout_established` to a day);
/// a zero field (a map nobody wrote yet) means netfilter's default.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeouts {
    pub tcp_syn_sent: u32,
    pub tcp_syn_recv: u32,
    pub tcp_established: u32,
    pub tcp_fin_wait: u32,
    pub tcp_time_wait: u32,
    pub tcp_close: u32,
    pub udp: u32,
    pub udp_stream: u32,
    pub icmp: u32,
    pub generic: u32,
}

crate::impl_pod!(Timeouts);

/// netfilter's defaults, in seconds.
pub const DEFAULT_TIMEOUTS: Timeouts = Timeouts {
    tcp_syn_sent: 120,
    tcp_syn_recv: 60,
    tcp_established: 432_000,
    tcp_fin_wait: 120,
    #[allow(clippy::cast_possible_truncation)]
    tcp_time_wait: (TIME_WAIT_HOLD_NS / NS_PER_SEC) as u32,
    tcp_close: 10,
    udp: 30,
    udp_stream: 120,
    icmp: 30,
    generic: 600,
};

/// A replied UDP flow older than this is a stream (netfilter's rule, since
/// Linux 6.0 and in every kernel EKS runs): it gets the stream timeout, a
/// single request and answer the short one.
pub const UDP_STREAM_AFTER_NS: u64 = 2 * NS_PER_SEC;

/// A field of [`Timeouts`], to set it by its sysctl's name.
pub type TimeoutField = fn(&mut Timeouts) -> &mut u32;

impl Timeouts {
    /// The sysctl name of each field, in field order, and a way to set it.
    pub const SYSCTLS: [(&'static str, TimeoutField); 10] = [
        ("tcp_timeout_syn_sent", |t| &mut t.tcp_syn_sent),
        ("tcp_timeout_syn_recv", |t| &mut t.tcp_syn_recv),
        ("tcp_timeout_established", |t| &mut t.tcp_established),
        ("tcp_timeout_fin_wait", |t| &mut t.tcp_fin_wait),
        ("tcp_timeout_time_wait", |t| &mut t.tcp_time_wait),
        ("tcp_timeout_close", |t| &mut t.tcp_close),
        ("udp_timeout", |t| &mut t.udp),
        ("udp_timeout_stream", |t| &mut t.udp_stream),
        ("icmp_timeout", |t| &mut t.icmp),
        ("generic_timeout", |t| &mut t.generic),
    ];

    /// How long a flow of `proto` in `state` lives after its last packet;
    /// `stream`: a replied UDP flow past [`UDP_STREAM_AFTER_NS`].
    #[must_use]
    pub const fn timeout_ns(&self, proto: u8, state: FlowState, stream: bool) -> u64 {
        let (set, default) = match (proto, state) {
            (PROTO_TCP, FlowState::New) => (self.tcp_syn_sent, DEFAULT_TIMEOUTS.tcp_syn_sent),
            (PROTO_TCP, FlowState::SynRecv) => (self.tcp_syn_recv, DEFAULT_TIMEOUTS.tcp_syn_recv),
            (PROTO_TCP, FlowState::Established) => {
                (self.tcp_established, DEFAULT_TIMEOUTS.tcp_established)
            }
            (PROTO_TCP, FlowState::Closing) => (self.tcp_fin_wait, DEFAULT_TIMEOUTS.tcp_fin_wait),
            (PROTO_TCP, FlowState::Closed) => (self.tcp_time_wait, DEFAULT_TIMEOUTS.tcp_time_wait),
            (PROTO_TCP, FlowState::Reset) => (self.tcp_close, DEFAULT_TIMEOUTS.tcp_close),
            (PROTO_UDP, FlowState::New) => (self.udp, DEFAULT_TIMEOUTS.udp),
            (PROTO_UDP, _) if stream => (self.udp_stream, DEFAULT_TIMEOUTS.udp_stream),
            (PROTO_UDP, _) => (self.udp, DEFAULT_TIMEOUTS.udp),
            (PROTO_ICMP, _) => (self.icmp, DEFAULT_TIMEOUTS.icmp),
            _ => (self.generic, DEFAULT_TIMEOUTS.generic),
        };
        (if set == 0 { default } else { set }) as u64 * NS_PER_SEC
    }
}

/// A flow's state, derived from its two entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowState {
    /// Nothing came back yet.
    New,
    /// TCP: the answer (SYN-ACK) came back, the opener has not acknowledged
    /// it yet (a SYN flood's flows stay here).
    SynRecv,
    /// Both directions seen (TCP: both acknowledged), no FIN or RST.
    Established,
    /// One side sent FIN.
    Closing,
    /// Both sides sent FIN.
    Closed,
    /// One side sent RST.
    Reset,
}

impl FlowState {
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::SynRecv => "syn_recv",
            Self::Established => "established",
            Self::Closing => "closing",
            Self::Closed => "closed",
            Self::Reset => "reset",
        }
    }

    /// Whether the connection is over (its port is held only for the
    /// remote's TIME_WAIT).
    #[must_use]
    pub const fn is_closed(self) -> bool {
        matches!(self, Self::Closed | Self::Reset)
    }
}

/// The state of a flow of `kind` (raw) from the `seen` bits of its forward
/// (`fwd_seen`) and reverse (`rev_seen`) entries.
#[must_use]
pub const fn flow_state(proto: u8, kind: u8, fwd_seen: u8, rev_seen: u8) -> FlowState {
    // The side that opened the flow, and the side that answers.
    let (opener, answer) = if FlowKind::opened_from_outside(kind) {
        (rev_seen, fwd_seen)
    } else {
        (fwd_seen, rev_seen)
    };
    let replied = answer & SEEN_ANY != 0;
    if proto != PROTO_TCP {
        return if replied {
            FlowState::Established
        } else {
            FlowState::New
        };
    }
    let both = opener | answer;
    if both & SEEN_RST != 0 {
        FlowState::Reset
    } else if opener & SEEN_FIN != 0 && answer & SEEN_FIN != 0 {
        FlowState::Closed
    } else if both & SEEN_FIN != 0 {
        FlowState::Closing
    } else if !replied {
        FlowState::New
    } else if opener & SEEN_ACK == 0 {
        FlowState::SynRecv
    } else {
        FlowState::Established
    }
}

/// The state of the flow whose entries are `fwd` and `rev`.
#[must_use]
pub const fn pair_state(proto: u8, fwd: &NatEntry, rev: &NatEntry) -> FlowState {
    flow_state(proto, fwd.kind, fwd.seen, rev.seen)
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

/// How long the flow whose entries are `fwd` and `rev` lives after its
/// last packet.
#[must_use]
pub const fn flow_timeout_ns(
    proto: u8,
    fwd: &NatEntry,
    rev: &NatEntry,
    timeouts: &Timeouts,
) -> u64 {
    let state = pair_state(proto, fwd, rev);
    let stream = flow_last_seen_ns(fwd, rev).saturating_sub(fwd.created_ns) > UDP_STREAM_AFTER_NS;
    timeouts.timeout_ns(proto, state, stream)
}

/// Whether a flow is over: its entries may be removed and its port reused
/// by anyone; for a closed TCP flow, that is once the remote's TIME_WAIT is
/// surely over too (the time-wait timeout, [`TIME_WAIT_HOLD_NS`] by default).
#[must_use]
pub const fn flow_expired(
    proto: u8,
    fwd: &NatEntry,
    rev: &NatEntry,
    timeouts: &Timeouts,
    now_ns: u64,
) -> bool {
    now_ns.saturating_sub(flow_last_seen_ns(fwd, rev)) > flow_timeout_ns(proto, fwd, rev, timeouts)
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

    const TIMEOUTS: Timeouts = DEFAULT_TIMEOUTS;

    fn entry(kind: FlowKind, seen: u8, last: u64) -> NatEntry {
        NatEntry {
            kind: kind as u8,
            seen,
            last_seen_ns: last,
            ..NatEntry::default()
        }
    }

    const HANDSHAKE: u8 = SEEN_ANY | SEEN_SYN | SEEN_ACK;

    #[test]
    fn closed_tcp_port_is_held_for_time_wait_whoever_asks() {
        let closed_at = 100 * NS_PER_SEC;
        let fwd = entry(FlowKind::Snat, HANDSHAKE | SEEN_FIN, closed_at);
        let rev = entry(FlowKind::Snat, HANDSHAKE | SEEN_FIN, closed_at);
        assert_eq!(pair_state(PROTO_TCP, &fwd, &rev), FlowState::Closed);
        for (after, reusable) in [(1, false), (119, false), (121, true)] {
            assert_eq!(
                flow_expired(
                    PROTO_TCP,
                    &fwd,
                    &rev,
                    &TIMEOUTS,
                    closed_at + after * NS_PER_SEC
                ),
                reusable,
                "{after} s after the close"
            );
        }
    }

    #[test]
    fn established_flow_is_never_reusable_before_its_timeout() {
        let fwd = entry(FlowKind::Snat, HANDSHAKE, 0);
        let rev = entry(FlowKind::Snat, HANDSHAKE, 0);
        assert_eq!(pair_state(PROTO_TCP, &fwd, &rev), FlowState::Established);
        assert!(!flow_expired(
            PROTO_TCP,
            &fwd,
            &rev,
            &TIMEOUTS,
            3600 * NS_PER_SEC
        ));
    }

    #[test]
    fn udp_state_follows_replies_and_streams_after_two_seconds() {
        let fwd = entry(FlowKind::Snat, SEEN_ANY, 0);
        let unreplied = entry(FlowKind::Snat, 0, 0);
        assert_eq!(pair_state(PROTO_UDP, &fwd, &unreplied), FlowState::New);
        assert!(!flow_expired(
            PROTO_UDP,
            &fwd,
            &unreplied,
            &TIMEOUTS,
            30 * NS_PER_SEC
        ));
        assert!(flow_expired(
            PROTO_UDP,
            &fwd,
            &unreplied,
            &TIMEOUTS,
            30 * NS_PER_SEC + 1
        ));
        // One question, one answer: the short timeout.
        let answered = entry(FlowKind::Snat, SEEN_ANY, NS_PER_SEC);
        assert_eq!(
            pair_state(PROTO_UDP, &fwd, &answered),
            FlowState::Established
        );
        assert!(flow_expired(
            PROTO_UDP,
            &fwd,
            &answered,
            &TIMEOUTS,
            32 * NS_PER_SEC
        ));
        // Packets past two seconds: a stream.
        let streaming = entry(FlowKind::Snat, SEEN_ANY, 3 * NS_PER_SEC);
        assert!(!flow_expired(
            PROTO_UDP,
            &fwd,
            &streaming,
            &TIMEOUTS,
            100 * NS_PER_SEC
        ));
        assert!(flow_expired(
            PROTO_UDP,
            &fwd,
            &streaming,
            &TIMEOUTS,
            124 * NS_PER_SEC
        ));
    }

    #[test]
    fn rst_resets_from_either_side_and_fin_closes() {
        for (fwd, rev) in [
            (SEEN_ANY | SEEN_RST, SEEN_ANY),
            (SEEN_ANY, SEEN_ANY | SEEN_RST),
        ] {
            assert_eq!(
                flow_state(PROTO_TCP, FlowKind::Snat as u8, fwd, rev),
                FlowState::Reset
            );
        }
        assert_eq!(
            flow_state(
                PROTO_TCP,
                FlowKind::Snat as u8,
                HANDSHAKE | SEEN_FIN,
                HANDSHAKE
            ),
            FlowState::Closing
        );
        assert_eq!(
            TIMEOUTS.timeout_ns(PROTO_TCP, FlowState::Reset, false),
            10 * NS_PER_SEC
        );
    }

    #[test]
    fn an_answered_syn_the_opener_never_acknowledges_is_syn_recv() {
        // A pod's SYN answered by SYN-ACK only.
        let syn = SEEN_ANY | SEEN_SYN;
        let syn_ack = SEEN_ANY | SEEN_SYN | SEEN_ACK;
        assert_eq!(
            flow_state(PROTO_TCP, FlowKind::Snat as u8, syn, syn_ack),
            FlowState::SynRecv
        );
        // The same from outside: the remote's SYN is in the reverse entry.
        assert_eq!(
            flow_state(PROTO_TCP, FlowKind::Inbound as u8, syn_ack, syn),
            FlowState::SynRecv
        );
        assert_eq!(
            flow_state(PROTO_TCP, FlowKind::Inbound as u8, 0, syn),
            FlowState::New
        );
        assert_eq!(
            flow_state(PROTO_TCP, FlowKind::Inbound as u8, syn_ack, HANDSHAKE),
            FlowState::Established
        );
    }

    #[test]
    fn an_unanswered_inbound_syn_expires_as_syn_sent() {
        let fwd = entry(FlowKind::Inbound, 0, 0);
        let rev = entry(FlowKind::Inbound, SEEN_ANY | SEEN_SYN, 0);
        assert!(!flow_expired(
            PROTO_TCP,
            &fwd,
            &rev,
            &TIMEOUTS,
            120 * NS_PER_SEC
        ));
        assert!(flow_expired(
            PROTO_TCP,
            &fwd,
            &rev,
            &TIMEOUTS,
            121 * NS_PER_SEC
        ));
    }

    #[test]
    fn set_timeouts_replace_the_defaults_and_zero_keeps_them() {
        let mut timeouts = Timeouts::default();
        for (name, field) in Timeouts::SYSCTLS {
            if name == "tcp_timeout_syn_sent" {
                *field(&mut timeouts) = 5;
            }
        }
        assert_eq!(
            timeouts.timeout_ns(PROTO_TCP, FlowState::New, false),
            5 * NS_PER_SEC
        );
        assert_eq!(
            timeouts.timeout_ns(PROTO_TCP, FlowState::Established, false),
            432_000 * NS_PER_SEC
        );
        assert_eq!(
            timeouts.timeout_ns(47, FlowState::Established, false),
            600 * NS_PER_SEC
        );
    }

    #[test]
    fn an_untranslated_pair_is_keyed_by_the_pods_tuple_and_its_reverse() {
        let fwd = FlowKey::new(1, 2, 3, 4, PROTO_TCP);
        let rev = NatEntry {
            addr: fwd.saddr,
            port: fwd.sport,
            ..NatEntry::default()
        };
        assert_eq!(reply_key(&fwd, fwd.saddr, fwd.sport), fwd.reversed());
        assert_eq!(forward_key(&fwd.reversed(), &rev), fwd);
    }
}
