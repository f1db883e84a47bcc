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
//! Each direction writes only its own entry (flags and sequence numbers
//! seen, last seen), so the two CPUs handling the two directions of a flow
//! never write the same cache line. The state of the flow is derived from
//! both entries by [`pair_state`] as netfilter's TCP tracking names it, and
//! its lifetime by [`flow_expired`] with the node's conntrack [`Timeouts`];
//! the programs, judging a port's holder, take the longest lifetime its
//! flags allow ([`FlagsView`]), never ending a flow before the collector.

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
///
/// The TCP fields after `created_ns` are netfilter's window tracking, as
/// far as the timeouts need it (`nf_conntrack_proto_tcp.c`): the sequence
/// number after the last byte this direction sent, the highest
/// acknowledgement it sent, and its retransmissions. With the other
/// direction's entry they say whether a FIN was acknowledged (`FIN_WAIT` or
/// `CLOSE_WAIT`, `LAST_ACK` or `TIME_WAIT`) and whether data is unacknowledged.
/// Appended to layout 2's 24 bytes, which are a prefix of these.
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
    /// TCP: the sequence number after the last byte (SYN and FIN count
    /// one) this direction sent (netfilter's `td_end`), host order; valid
    /// with [`TCP_END_KNOWN`].
    pub seq_end: u32,
    /// TCP: the highest acknowledgement this direction sent, host order;
    /// valid with [`TCP_ACK_KNOWN`].
    pub ack: u32,
    /// `TCP_*` bits of this direction.
    pub tcp: u8,
    /// TCP: segments in a row this direction sent again (carrying sequence
    /// space, not past `seq_end`), saturating.
    pub retrans: u8,
    pub _pad1: u16,
    pub _pad2: u32,
}

/// [`NatEntry::seq_end`] holds this direction's own value (not set: an
/// entry made before sequence tracking, by a take-over, or by the other
/// direction and not yet sent on).
pub const TCP_END_KNOWN: u8 = 0x01;
/// [`NatEntry::ack`] holds this direction's own value.
pub const TCP_ACK_KNOWN: u8 = 0x02;
/// This direction's last segment advertised a zero window.
pub const TCP_ZERO_WINDOW: u8 = 0x04;
/// This direction owes the other an acknowledgement of its FIN: set by a
/// take-over of conntrack's `FIN_WAIT` or `LAST_ACK` (conntrack does not say
/// the sequence numbers), cleared by this direction's next ACK, as
/// conntrack's next ACK moves those states on.
pub const TCP_OWES_FIN_ACK: u8 = 0x08;

/// Size of a flow entry in layouts before sequence tracking (the first
/// fields of [`NatEntry`]).
pub const NAT_ENTRY_UNTRACKED_SIZE: usize = 24;

/// Whether sequence number `a` comes after `b` (RFC 1982 arithmetic).
#[must_use]
pub const fn seq_after(a: u32, b: u32) -> bool {
    a.wrapping_sub(b).cast_signed() > 0
}

/// What a TCP segment tells its direction's entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    /// Its sequence number plus its payload's length, plus one for SYN and
    /// one for FIN (host order).
    pub end: u32,
    /// Its acknowledgement number (host order).
    pub ack: u32,
    /// The TCP header's flags (the `SEEN_*` bits are the same).
    pub flags: u8,
    /// Whether it carries sequence space (data, SYN or FIN).
    pub carries_seq: bool,
    /// Whether it advertises a zero window.
    pub zero_window: bool,
}

impl NatEntry {
    /// A new half of a flow of `kind` made at `now_ns`, nothing seen yet.
    /// Every field is spelled out: the BPF backend zeroes a struct update's
    /// rest with a call to `memset`, a frame of its own that kernels
    /// before 6.9 count as 32 stack bytes.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[must_use]
    pub const fn new(addr: u32, port: u16, kind: FlowKind, now_ns: u64) -> Self {
        Self {
            addr,
            port,
            kind: kind as u8,
            seen: 0,
            last_seen_ns: now_ns,
            created_ns: now_ns,
            seq_end: 0,
            ack: 0,
            tcp: 0,
            retrans: 0,
            _pad1: 0,
            _pad2: 0,
        }
    }

    /// Records a TCP segment this entry's direction sent, as netfilter's
    /// window tracking does for the timeouts. Writes a field only when it
    /// changes: most segments of a bulk transfer advance `seq_end` or
    /// `ack` and nothing else.
    // Inlined into the programs as when they were the eBPF crate's own.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn track_segment(&mut self, seg: &Segment) {
        let old = self.tcp;
        let mut tcp = old;
        if tcp & TCP_END_KNOWN == 0 || seq_after(seg.end, self.seq_end) {
            self.seq_end = seg.end;
            tcp |= TCP_END_KNOWN;
            if self.retrans != 0 {
                self.retrans = 0;
            }
        } else if seg.carries_seq && self.retrans != u8::MAX {
            // Sequence space sent again.
            self.retrans += 1;
        }
        if seg.flags & SEEN_ACK != 0 {
            if tcp & TCP_ACK_KNOWN == 0 || seq_after(seg.ack, self.ack) {
                self.ack = seg.ack;
            }
            tcp = (tcp | TCP_ACK_KNOWN) & !TCP_OWES_FIN_ACK;
        }
        // A reset's window means nothing.
        if seg.flags & SEEN_RST == 0 {
            tcp = if seg.zero_window {
                tcp | TCP_ZERO_WINDOW
            } else {
                tcp & !TCP_ZERO_WINDOW
            };
        }
        if tcp != old {
            self.tcp = tcp;
        }
    }

    /// Starts this direction's sequence tracking afresh (the tuple opens
    /// a new connection).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    pub fn forget_segments(&mut self) {
        // The numbers stay as they are, unknown without their bits.
        self.tcp = 0;
        self.retrans = 0;
    }
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
/// (`net.netfilter.nf_conntrack_<name>`, see [`Timeouts::SYSCTLS`]). The
/// agent writes the node's own values into the `CT_TIMEOUTS` map, so flows
/// live as long as conntrack's on the same node (kube-proxy sets
/// `tcp_timeout_established` to a day and `tcp_timeout_close_wait` to an
/// hour); a zero field (a map nobody wrote yet) means netfilter's default.
/// Fields are only ever appended: layout 1's ten are a prefix.
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
    pub tcp_close_wait: u32,
    pub tcp_last_ack: u32,
    /// A flow some of whose data is unacknowledged lives no longer than
    /// this.
    pub tcp_unacknowledged: u32,
    /// A flow retransmitting ([`Timeouts::tcp_retrans_limit`] times in a
    /// row, data still unacknowledged) or held by a zero window lives no
    /// longer than this.
    pub tcp_max_retrans: u32,
    /// Retransmissions in a row that make a flow retransmitting (not a
    /// timeout: `nf_conntrack_tcp_max_retrans`).
    pub tcp_retrans_limit: u32,
    pub _pad: u32,
}

crate::impl_pod!(Timeouts);

/// Size of [`Timeouts`] in layout 1 (its first ten fields).
pub const TIMEOUTS_LAYOUT1_SIZE: usize = 40;

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
    tcp_close_wait: 60,
    tcp_last_ack: 30,
    tcp_unacknowledged: 300,
    tcp_max_retrans: 300,
    tcp_retrans_limit: 3,
    _pad: 0,
};

/// A replied UDP flow older than this is a stream (netfilter's rule, since
/// Linux 6.0 and in every kernel EKS runs): it gets the stream timeout, a
/// single request and answer the short one.
pub const UDP_STREAM_AFTER_NS: u64 = 2 * NS_PER_SEC;

/// A field of [`Timeouts`], to set it by its sysctl's name.
pub type TimeoutField = fn(&mut Timeouts) -> &mut u32;

impl Timeouts {
    /// The sysctl name of each field, in field order, and a way to set it.
    pub const SYSCTLS: [(&'static str, TimeoutField); 15] = [
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
        ("tcp_timeout_close_wait", |t| &mut t.tcp_close_wait),
        ("tcp_timeout_last_ack", |t| &mut t.tcp_last_ack),
        ("tcp_timeout_unacknowledged", |t| &mut t.tcp_unacknowledged),
        ("tcp_timeout_max_retrans", |t| &mut t.tcp_max_retrans),
        ("tcp_max_retrans", |t| &mut t.tcp_retrans_limit),
    ];

    /// How long a flow of `proto` in `state` lives after its last packet;
    /// `stream`: a replied UDP flow past [`UDP_STREAM_AFTER_NS`].
    #[must_use]
    pub const fn timeout_ns(&self, proto: u8, state: FlowState, stream: bool) -> u64 {
        let d = &DEFAULT_TIMEOUTS;
        let (set, default) = match (proto, state) {
            (PROTO_TCP, FlowState::New) => (self.tcp_syn_sent, d.tcp_syn_sent),
            (PROTO_TCP, FlowState::SynRecv) => (self.tcp_syn_recv, d.tcp_syn_recv),
            (PROTO_TCP, FlowState::Established) => (self.tcp_established, d.tcp_established),
            (PROTO_TCP, FlowState::FinWait) => (self.tcp_fin_wait, d.tcp_fin_wait),
            (PROTO_TCP, FlowState::CloseWait) => (self.tcp_close_wait, d.tcp_close_wait),
            (PROTO_TCP, FlowState::LastAck) => (self.tcp_last_ack, d.tcp_last_ack),
            (PROTO_TCP, FlowState::TimeWait) => (self.tcp_time_wait, d.tcp_time_wait),
            (PROTO_TCP, FlowState::Close) => (self.tcp_close, d.tcp_close),
            (PROTO_UDP, FlowState::New) => (self.udp, d.udp),
            (PROTO_UDP, _) if stream => (self.udp_stream, d.udp_stream),
            (PROTO_UDP, _) => (self.udp, d.udp),
            (PROTO_ICMP, _) => (self.icmp, d.icmp),
            _ => (self.generic, d.generic),
        };
        seconds_ns(set, default)
    }

    /// The unacknowledged-data cap.
    #[must_use]
    pub const fn unacknowledged_ns(&self) -> u64 {
        seconds_ns(self.tcp_unacknowledged, DEFAULT_TIMEOUTS.tcp_unacknowledged)
    }

    /// The retransmission and zero-window cap.
    #[must_use]
    pub const fn max_retrans_ns(&self) -> u64 {
        seconds_ns(self.tcp_max_retrans, DEFAULT_TIMEOUTS.tcp_max_retrans)
    }

    /// Retransmissions in a row that make a flow retransmitting.
    #[must_use]
    pub const fn retrans_limit(&self) -> u32 {
        if self.tcp_retrans_limit == 0 {
            DEFAULT_TIMEOUTS.tcp_retrans_limit
        } else {
            self.tcp_retrans_limit
        }
    }
}

/// `set` seconds (`default` when 0) in nanoseconds.
const fn seconds_ns(set: u32, default: u32) -> u64 {
    (if set == 0 { default } else { set }) as u64 * NS_PER_SEC
}

/// A flow's state, derived from its two entries: netfilter's TCP states
/// (`tcp_conntracks`), and for other protocols whether it was answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlowState {
    /// Nothing came back yet (TCP: SYN_SENT).
    New,
    /// TCP: the answer (SYN-ACK) came back, the opener has not acknowledged
    /// it yet (a SYN flood's flows stay here).
    SynRecv,
    /// Both directions seen (TCP: both acknowledged), no FIN or RST.
    Established,
    /// One side sent FIN, the other has not acknowledged it.
    FinWait,
    /// One side's FIN is acknowledged, the other side has not sent its
    /// own: a half-closed connection, which may go on for long.
    CloseWait,
    /// Both sides sent FIN, one is not acknowledged yet.
    LastAck,
    /// Both FINs sent and acknowledged.
    TimeWait,
    /// One side sent RST.
    Close,
}

impl FlowState {
    /// Every state, in the order a connection goes through them.
    pub const ALL: [Self; 8] = [
        Self::New,
        Self::SynRecv,
        Self::Established,
        Self::FinWait,
        Self::CloseWait,
        Self::LastAck,
        Self::TimeWait,
        Self::Close,
    ];

    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::SynRecv => "syn_recv",
            Self::Established => "established",
            Self::FinWait => "fin_wait",
            Self::CloseWait => "close_wait",
            Self::LastAck => "last_ack",
            Self::TimeWait => "time_wait",
            Self::Close => "close",
        }
    }

    /// conntrack's name of the TCP state (`conntrack -L`, `--state`).
    #[must_use]
    pub const fn conntrack_name(self) -> &'static str {
        match self {
            Self::New => "SYN_SENT",
            Self::SynRecv => "SYN_RECV",
            Self::Established => "ESTABLISHED",
            Self::FinWait => "FIN_WAIT",
            Self::CloseWait => "CLOSE_WAIT",
            Self::LastAck => "LAST_ACK",
            Self::TimeWait => "TIME_WAIT",
            Self::Close => "CLOSE",
        }
    }

    /// The state conntrack names `name`; its `SYN_SENT2` (a simultaneous
    /// open) is a SYN answered by a SYN.
    #[must_use]
    pub fn from_conntrack_name(name: &str) -> Option<Self> {
        if name == "SYN_SENT2" {
            return Some(Self::SynRecv);
        }
        Self::ALL
            .into_iter()
            .find(|state| state.conntrack_name() == name)
    }

    /// Whether both sides closed or one reset (its port is held only for
    /// the remote's TIME_WAIT).
    #[must_use]
    pub const fn is_closed(self) -> bool {
        matches!(self, Self::LastAck | Self::TimeWait | Self::Close)
    }

    /// The bits of the opener's and the answer's entries of a flow of
    /// `proto` in this state, with no sequence numbers (a take-over's:
    /// conntrack does not say them), the opener the side that closed
    /// first: [`pair_state`] of entries so made is this state.
    #[must_use]
    pub const fn halves(self, proto: u8) -> (HalfBits, HalfBits) {
        const fn half(seen: u8, tcp: u8) -> HalfBits {
            HalfBits { seen, tcp }
        }
        const HANDSHAKE: u8 = SEEN_ANY | SEEN_SYN | SEEN_ACK;
        const FIN: u8 = HANDSHAKE | SEEN_FIN;
        if proto != PROTO_TCP {
            return match self {
                Self::New => (half(SEEN_ANY, 0), half(0, 0)),
                _ => (half(SEEN_ANY, 0), half(SEEN_ANY, 0)),
            };
        }
        match self {
            Self::New => (half(SEEN_ANY | SEEN_SYN, 0), half(0, 0)),
            Self::SynRecv => (half(SEEN_ANY | SEEN_SYN, 0), half(HANDSHAKE, 0)),
            Self::Established => (half(HANDSHAKE, 0), half(HANDSHAKE, 0)),
            Self::FinWait => (half(FIN, 0), half(HANDSHAKE, TCP_OWES_FIN_ACK)),
            Self::CloseWait => (half(FIN, 0), half(HANDSHAKE, 0)),
            Self::LastAck => (half(FIN, TCP_OWES_FIN_ACK), half(FIN, 0)),
            Self::TimeWait => (half(FIN, 0), half(FIN, 0)),
            Self::Close => (half(HANDSHAKE | SEEN_RST, 0), half(HANDSHAKE, 0)),
        }
    }
}

/// The state bits of one entry ([`FlowState::halves`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HalfBits {
    /// `SEEN_*` bits.
    pub seen: u8,
    /// `TCP_*` bits.
    pub tcp: u8,
}

/// The opener's and the answer's entries of the pair `fwd`, `rev`.
// Inlined into the programs' callers: a frame of its own costs 32 stack
// bytes on kernels before 6.9.
#[allow(clippy::inline_always)]
#[inline(always)]
const fn opener_first<'a>(fwd: &'a NatEntry, rev: &'a NatEntry) -> (&'a NatEntry, &'a NatEntry) {
    if FlowKind::opened_from_outside(fwd.kind) {
        (rev, fwd)
    } else {
        (fwd, rev)
    }
}

/// Whether `receiver` acknowledged all that `sender` sent (its FIN
/// included). Entries whose numbers are not both known (made before
/// sequence tracking, or by a take-over) count as acknowledged once the
/// receiver sent an ACK, unless it owes one ([`TCP_OWES_FIN_ACK`]).
// Inlined into the programs' callers: a frame of its own costs 32 stack
// bytes on kernels before 6.9.
#[allow(clippy::inline_always)]
#[inline(always)]
const fn all_acked(sender: &NatEntry, receiver: &NatEntry) -> bool {
    if receiver.seen & SEEN_ACK == 0 || receiver.tcp & TCP_OWES_FIN_ACK != 0 {
        return false;
    }
    sender.tcp & TCP_END_KNOWN == 0
        || receiver.tcp & TCP_ACK_KNOWN == 0
        || !seq_after(sender.seq_end, receiver.ack)
}

/// Whether `sender` sent data `receiver` has not acknowledged, both
/// numbers known (netfilter's `IP_CT_TCP_FLAG_DATA_UNACKNOWLEDGED`).
// Inlined into the programs' callers: a frame of its own costs 32 stack
// bytes on kernels before 6.9.
#[allow(clippy::inline_always)]
#[inline(always)]
const fn unacknowledged(sender: &NatEntry, receiver: &NatEntry) -> bool {
    sender.tcp & TCP_END_KNOWN != 0
        && receiver.tcp & TCP_ACK_KNOWN != 0
        && seq_after(sender.seq_end, receiver.ack)
}

/// The state of the flow whose entries are `fwd` and `rev`, of protocol
/// `proto`.
// Inlined into the programs' callers: a frame of its own costs 32 stack
// bytes on kernels before 6.9.
#[allow(clippy::inline_always)]
#[inline(always)]
#[must_use]
pub const fn pair_state(proto: u8, fwd: &NatEntry, rev: &NatEntry) -> FlowState {
    let (opener, answer) = opener_first(fwd, rev);
    let replied = answer.seen & SEEN_ANY != 0;
    if proto != PROTO_TCP {
        return if replied {
            FlowState::Established
        } else {
            FlowState::New
        };
    }
    let both = opener.seen | answer.seen;
    let (opener_fin, answer_fin) = (opener.seen & SEEN_FIN != 0, answer.seen & SEEN_FIN != 0);
    if both & SEEN_RST != 0 {
        FlowState::Close
    } else if opener_fin && answer_fin {
        if all_acked(opener, answer) && all_acked(answer, opener) {
            FlowState::TimeWait
        } else {
            FlowState::LastAck
        }
    } else if opener_fin || answer_fin {
        let acked = if opener_fin {
            all_acked(opener, answer)
        } else {
            all_acked(answer, opener)
        };
        if acked {
            FlowState::CloseWait
        } else {
            FlowState::FinWait
        }
    } else if !replied {
        FlowState::New
    } else if opener.seen & SEEN_ACK == 0 {
        FlowState::SynRecv
    } else {
        FlowState::Established
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

/// How long the flow whose entries are `fwd` and `rev` lives after its
/// last packet: its state's timeout, capped as netfilter caps it when data
/// is unacknowledged, when a side retransmits or a window is zero.
// Inlined into the programs' callers: a frame of its own costs 32 stack
// bytes on kernels before 6.9.
#[allow(clippy::inline_always)]
#[inline(always)]
#[must_use]
pub const fn flow_timeout_ns(
    proto: u8,
    fwd: &NatEntry,
    rev: &NatEntry,
    timeouts: &Timeouts,
) -> u64 {
    let state = pair_state(proto, fwd, rev);
    let stream = flow_last_seen_ns(fwd, rev).saturating_sub(fwd.created_ns) > UDP_STREAM_AFTER_NS;
    let timeout = timeouts.timeout_ns(proto, state, stream);
    if proto != PROTO_TCP || matches!(state, FlowState::Close) {
        return timeout;
    }
    let (fwd_unacked, rev_unacked) = (unacknowledged(fwd, rev), unacknowledged(rev, fwd));
    let limit = timeouts.retrans_limit();
    let retransmitting = (fwd_unacked && fwd.retrans as u32 >= limit)
        || (rev_unacked && rev.retrans as u32 >= limit);
    let cap = if retransmitting || (fwd.tcp | rev.tcp) & TCP_ZERO_WINDOW != 0 {
        timeouts.max_retrans_ns()
    } else if fwd_unacked || rev_unacked {
        timeouts.unacknowledged_ns()
    } else {
        u64::MAX
    };
    if cap < timeout { cap } else { timeout }
}

/// Whether a flow is over: its entries may be removed and its port reused
/// by anyone; for a closed TCP flow, that is once the remote's TIME_WAIT is
/// surely over too (the time-wait timeout, [`TIME_WAIT_HOLD_NS`] by default).
#[allow(clippy::inline_always)]
#[inline(always)]
#[must_use]
pub const fn flow_expired(
    proto: u8,
    fwd: &NatEntry,
    rev: &NatEntry,
    timeouts: &Timeouts,
    now_ns: u64,
) -> bool {
    idle_past(fwd, rev, now_ns, flow_timeout_ns(proto, fwd, rev, timeouts))
}

/// Whether the flow whose entries are `fwd` and `rev` saw no packet for
/// longer than `timeout_ns` by `now_ns`. Its last packet may be up to
/// [`TOUCH_INTERVAL_NS`] later than its entries say (see
/// [`NatEntry::last_seen_ns`]): only an idle time past both counts, so a
/// flow whose packets come within its timeout is never judged over, the
/// collector's passes and the port take-overs racing them whatever the
/// timeout (an operator may set a second).
#[allow(clippy::inline_always)]
#[inline(always)]
#[must_use]
pub const fn idle_past(fwd: &NatEntry, rev: &NatEntry, now_ns: u64, timeout_ns: u64) -> bool {
    now_ns.saturating_sub(flow_last_seen_ns(fwd, rev))
        > timeout_ns.saturating_add(TOUCH_INTERVAL_NS)
}

/// A flow as its flags alone tell it, without its sequence numbers: what
/// the programs judge a port's holder and an early drop's victim by, in
/// fewer instructions and stack than [`pair_state`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlagsView {
    /// The states its flags allow, which only the sequence numbers tell
    /// apart (`FIN_WAIT` or `CLOSE_WAIT`, `LAST_ACK` or `TIME_WAIT`); the
    /// same one twice when the flags say it.
    pub states: (FlowState, FlowState),
    /// Both sides sent FIN, or one RST.
    pub closed: bool,
    /// Nothing answered yet, or the answer not acknowledged (`SYN_RECV`).
    pub unanswered: bool,
}

/// [`FlagsView`] of the flow of `proto` whose entries are `fwd` and `rev`.
#[allow(clippy::inline_always)]
#[inline(always)]
#[must_use]
pub const fn flags_view(proto: u8, fwd: &NatEntry, rev: &NatEntry) -> FlagsView {
    let (opener, answer) = opener_first(fwd, rev);
    let replied = answer.seen & SEEN_ANY != 0;
    let both = opener.seen | answer.seen;
    let tcp = proto == PROTO_TCP;
    let (opener_fin, answer_fin) = (
        tcp && opener.seen & SEEN_FIN != 0,
        tcp && answer.seen & SEEN_FIN != 0,
    );
    let reset = tcp && both & SEEN_RST != 0;
    let states = if reset {
        (FlowState::Close, FlowState::Close)
    } else if opener_fin && answer_fin {
        (FlowState::LastAck, FlowState::TimeWait)
    } else if opener_fin || answer_fin {
        (FlowState::FinWait, FlowState::CloseWait)
    } else if !replied {
        (FlowState::New, FlowState::New)
    } else if tcp && opener.seen & SEEN_ACK == 0 {
        (FlowState::SynRecv, FlowState::SynRecv)
    } else {
        (FlowState::Established, FlowState::Established)
    };
    FlagsView {
        states,
        closed: reset || (opener_fin && answer_fin),
        unanswered: matches!(states.0, FlowState::New | FlowState::SynRecv),
    }
}

impl FlagsView {
    /// The longest timeout of its states for the flow whose entries are
    /// `fwd` and `rev`: the programs never end a flow before
    /// [`flow_expired`] does; the collector ends it at its own time.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[must_use]
    pub const fn longest_timeout_ns(
        &self,
        proto: u8,
        fwd: &NatEntry,
        rev: &NatEntry,
        timeouts: &Timeouts,
    ) -> u64 {
        let stream =
            flow_last_seen_ns(fwd, rev).saturating_sub(fwd.created_ns) > UDP_STREAM_AFTER_NS;
        let (a, b) = (
            timeouts.timeout_ns(proto, self.states.0, stream),
            timeouts.timeout_ns(proto, self.states.1, stream),
        );
        if a > b { a } else { b }
    }
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

    /// The state of a pair of `kind` whose entries saw `fwd` and `rev`
    /// (no sequence numbers known).
    fn flow_state(proto: u8, kind: u8, fwd: u8, rev: u8) -> FlowState {
        let half = |seen| NatEntry {
            kind,
            seen,
            ..NatEntry::default()
        };
        pair_state(proto, &half(fwd), &half(rev))
    }

    #[test]
    fn closed_tcp_port_is_held_for_time_wait_whoever_asks() {
        let closed_at = 100 * NS_PER_SEC;
        let fwd = entry(FlowKind::Snat, HANDSHAKE | SEEN_FIN, closed_at);
        let rev = entry(FlowKind::Snat, HANDSHAKE | SEEN_FIN, closed_at);
        assert_eq!(pair_state(PROTO_TCP, &fwd, &rev), FlowState::TimeWait);
        for (after, reusable) in [(1, false), (120, false), (122, true)] {
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
            31 * NS_PER_SEC
        ));
        // Its last packet may be a touch interval later than recorded.
        assert!(flow_expired(
            PROTO_UDP,
            &fwd,
            &unreplied,
            &TIMEOUTS,
            31 * NS_PER_SEC + 1
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
            33 * NS_PER_SEC
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
            125 * NS_PER_SEC
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
                FlowState::Close
            );
        }
        assert_eq!(
            flow_state(
                PROTO_TCP,
                FlowKind::Snat as u8,
                HANDSHAKE | SEEN_FIN,
                HANDSHAKE
            ),
            FlowState::CloseWait
        );
        assert_eq!(
            TIMEOUTS.timeout_ns(PROTO_TCP, FlowState::Close, false),
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
            121 * NS_PER_SEC
        ));
        assert!(flow_expired(
            PROTO_TCP,
            &fwd,
            &rev,
            &TIMEOUTS,
            122 * NS_PER_SEC
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

    /// Two ends of a TCP connection as the datapath's entries see them:
    /// the opener's (forward) and the answer's (reverse), each with the
    /// next sequence number it sends.
    struct Connection {
        fwd: NatEntry,
        rev: NatEntry,
        next: [u32; 2],
    }

    const OPENER: usize = 0;
    const ANSWER: usize = 1;

    impl Connection {
        /// Handshake done: SYN, SYN-ACK, ACK, from initial sequence
        /// numbers near the wrap.
        fn established() -> Self {
            let mut c = Self {
                fwd: entry(FlowKind::Snat, 0, 0),
                rev: entry(FlowKind::Snat, 0, 0),
                next: [u32::MAX - 10, 7],
            };
            c.send(OPENER, SEEN_SYN, 0);
            c.send(ANSWER, SEEN_SYN | SEEN_ACK, 0);
            c.send(OPENER, SEEN_ACK, 0);
            c
        }

        /// `side` sends `len` bytes with `flags` (ACK: of all the other
        /// side sent).
        fn send(&mut self, side: usize, flags: u8, len: u32) {
            let seq = self.next[side];
            let end = seq
                .wrapping_add(len)
                .wrapping_add(u32::from(flags & (SEEN_SYN | SEEN_FIN) != 0));
            let seg = Segment {
                end,
                ack: self.next[1 - side],
                flags,
                carries_seq: end != seq,
                zero_window: false,
            };
            self.next[side] = end;
            let entry = if side == OPENER {
                &mut self.fwd
            } else {
                &mut self.rev
            };
            entry.seen |= flags | SEEN_ANY;
            entry.track_segment(&seg);
        }

        /// `side` sends the same segment it sent last, again.
        fn resend(&mut self, side: usize, len: u32) {
            self.next[side] = self.next[side].wrapping_sub(len);
            self.send(side, SEEN_ACK, len);
        }

        fn state(&self) -> FlowState {
            pair_state(PROTO_TCP, &self.fwd, &self.rev)
        }

        fn timeout_s(&self, timeouts: &Timeouts) -> u64 {
            flow_timeout_ns(PROTO_TCP, &self.fwd, &self.rev, timeouts) / NS_PER_SEC
        }
    }

    /// kube-proxy's conntrack settings.
    fn kube_proxy() -> Timeouts {
        Timeouts {
            tcp_established: 86_400,
            tcp_close_wait: 3_600,
            ..Timeouts::default()
        }
    }

    #[test]
    fn a_half_close_is_fin_wait_until_acknowledged_then_close_wait_for_its_timeout() {
        let mut c = Connection::established();
        c.send(OPENER, SEEN_ACK, 100);
        c.send(ANSWER, SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::Established);
        assert_eq!(c.timeout_s(&kube_proxy()), 86_400);
        c.send(OPENER, SEEN_FIN | SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::FinWait, "the FIN not acknowledged");
        assert_eq!(c.timeout_s(&kube_proxy()), 120);
        c.send(ANSWER, SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::CloseWait);
        assert_eq!(c.timeout_s(&kube_proxy()), 3_600, "kube-proxy's hour");
        assert_eq!(c.timeout_s(&DEFAULT_TIMEOUTS), 60);
        // The server answers late, the pod acknowledges; then it closes too.
        c.send(ANSWER, SEEN_ACK, 500);
        c.send(OPENER, SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::CloseWait);
        c.send(ANSWER, SEEN_FIN | SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::LastAck);
        assert_eq!(c.timeout_s(&kube_proxy()), 30);
        c.send(OPENER, SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::TimeWait);
        assert_eq!(c.timeout_s(&kube_proxy()), 120);
    }

    #[test]
    fn the_answer_closing_first_is_tracked_the_same() {
        let mut c = Connection::established();
        c.send(ANSWER, SEEN_FIN | SEEN_ACK, 10);
        assert_eq!(c.state(), FlowState::FinWait);
        c.send(OPENER, SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::CloseWait);
        // Both FINs at once (a simultaneous close): LAST_ACK until each
        // is acknowledged.
        c.send(OPENER, SEEN_FIN | SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::LastAck);
        c.send(ANSWER, SEEN_ACK, 0);
        assert_eq!(c.state(), FlowState::TimeWait);
    }

    #[test]
    fn unacknowledged_data_caps_a_flow_at_the_unacknowledged_timeout() {
        let mut c = Connection::established();
        c.send(OPENER, SEEN_ACK, 1000);
        assert_eq!(c.timeout_s(&kube_proxy()), 300, "1000 bytes in flight");
        c.send(ANSWER, SEEN_ACK, 0);
        assert_eq!(c.timeout_s(&kube_proxy()), 86_400, "all acknowledged");
        // Capped in CLOSE_WAIT too, as netfilter does.
        c.send(OPENER, SEEN_FIN | SEEN_ACK, 0);
        c.send(ANSWER, SEEN_ACK, 0);
        c.send(ANSWER, SEEN_ACK, 20);
        assert_eq!(c.state(), FlowState::CloseWait);
        assert_eq!(c.timeout_s(&kube_proxy()), 300);
        let set = Timeouts {
            tcp_unacknowledged: 50,
            ..kube_proxy()
        };
        assert_eq!(c.timeout_s(&set), 50, "from its sysctl");
    }

    #[test]
    fn retransmissions_past_the_limit_cap_a_flow_at_max_retrans() {
        let timeouts = Timeouts {
            tcp_unacknowledged: 1_000,
            tcp_max_retrans: 200,
            ..kube_proxy()
        };
        let mut c = Connection::established();
        c.send(OPENER, SEEN_ACK, 100);
        for sent in 1..=3 {
            assert_eq!(c.timeout_s(&timeouts), 1_000, "{sent} sent");
            c.resend(OPENER, 100);
        }
        assert_eq!(c.fwd.retrans, 3);
        assert_eq!(c.timeout_s(&timeouts), 200, "three retransmissions");
        // Acknowledged at last: nothing is outstanding.
        c.send(ANSWER, SEEN_ACK, 0);
        assert_eq!(c.timeout_s(&timeouts), 86_400);
        // New data starts the count afresh.
        c.send(OPENER, SEEN_ACK, 100);
        assert_eq!(c.fwd.retrans, 0);
        // Keep-alive probes carry no new sequence space: never counted.
        for _ in 0..5 {
            c.send(ANSWER, SEEN_ACK, 0);
            c.next[OPENER] = c.next[OPENER].wrapping_sub(1);
            c.send(OPENER, SEEN_ACK, 0);
            c.next[OPENER] = c.next[OPENER].wrapping_add(1);
        }
        assert_eq!(c.timeout_s(&kube_proxy()), 86_400);
    }

    #[test]
    fn a_zero_window_caps_a_flow_at_max_retrans_until_it_opens() {
        let mut c = Connection::established();
        let mut zero = Segment {
            end: c.next[ANSWER],
            ack: c.next[OPENER],
            flags: SEEN_ACK,
            carries_seq: false,
            zero_window: true,
        };
        c.rev.track_segment(&zero);
        assert_eq!(c.timeout_s(&kube_proxy()), 300);
        zero.zero_window = false;
        c.rev.track_segment(&zero);
        assert_eq!(c.timeout_s(&kube_proxy()), 86_400);
    }

    #[test]
    fn a_reopened_tuple_tracks_its_new_numbers() {
        let mut c = Connection::established();
        c.send(OPENER, SEEN_ACK, 100);
        c.fwd.forget_segments();
        c.rev.forget_segments();
        c.next = [12_345, 999];
        c.send(OPENER, SEEN_SYN, 0);
        assert_eq!(c.fwd.seq_end, 12_346);
        assert_eq!(c.fwd.retrans, 0);
    }

    #[test]
    fn every_state_a_take_over_writes_reads_back_as_itself() {
        for state in FlowState::ALL {
            let (opener, answer) = state.halves(PROTO_TCP);
            let half = |bits: HalfBits| NatEntry {
                seen: bits.seen,
                tcp: bits.tcp,
                ..NatEntry::default()
            };
            assert_eq!(
                pair_state(PROTO_TCP, &half(opener), &half(answer)),
                state,
                "{state:?}"
            );
            assert_eq!(
                FlowState::from_conntrack_name(state.conntrack_name()),
                Some(state)
            );
        }
        // conntrack's next ACK of the FIN moves a taken-over FIN_WAIT on.
        let (opener, answer) = FlowState::FinWait.halves(PROTO_TCP);
        let fwd = NatEntry {
            seen: opener.seen,
            tcp: opener.tcp,
            ..NatEntry::default()
        };
        let mut rev = NatEntry {
            seen: answer.seen,
            tcp: answer.tcp,
            ..NatEntry::default()
        };
        rev.track_segment(&Segment {
            end: 5,
            ack: 77,
            flags: SEEN_ACK,
            ..Segment::default()
        });
        assert_eq!(pair_state(PROTO_TCP, &fwd, &rev), FlowState::CloseWait);
    }

    #[test]
    fn every_conntrack_timeout_sysctl_sets_its_field() {
        let mut timeouts = Timeouts::default();
        for (value, (_, field)) in (1..).zip(Timeouts::SYSCTLS) {
            *field(&mut timeouts) = value;
        }
        for (value, (name, field)) in (1..).zip(Timeouts::SYSCTLS) {
            assert_eq!(*field(&mut timeouts), value, "{name}: a field of its own");
        }
        let names = Timeouts::SYSCTLS.map(|(name, _)| name);
        for name in [
            "tcp_timeout_close_wait",
            "tcp_timeout_last_ack",
            "tcp_timeout_unacknowledged",
            "tcp_timeout_max_retrans",
            "tcp_max_retrans",
        ] {
            assert!(names.contains(&name), "{name}");
        }
    }

    #[test]
    fn entries_and_timeouts_extend_their_earlier_layouts() {
        assert_eq!(core::mem::size_of::<NatEntry>(), 40);
        assert_eq!(
            core::mem::offset_of!(NatEntry, seq_end),
            NAT_ENTRY_UNTRACKED_SIZE
        );
        assert_eq!(core::mem::size_of::<Timeouts>(), 64);
        assert_eq!(
            core::mem::offset_of!(Timeouts, tcp_close_wait),
            TIMEOUTS_LAYOUT1_SIZE
        );
    }
}
