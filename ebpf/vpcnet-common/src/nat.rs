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

mod frag;
mod recent;
mod state;
mod tcp;
#[cfg(test)]
mod tests;
mod timeouts;

pub use self::{frag::*, recent::*, state::*, tcp::*, timeouts::*};

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

/// Size of a flow entry in layouts before sequence tracking (the first
/// fields of [`NatEntry`]).
pub const NAT_ENTRY_UNTRACKED_SIZE: usize = 24;

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
