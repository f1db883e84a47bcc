//! A flow's state and lifetime, derived from its two entries.

use super::{
    FlowKind, NatEntry, PROTO_TCP, SEEN_ACK, SEEN_ANY, SEEN_FIN, SEEN_RST, SEEN_SYN, TCP_ACK_KNOWN,
    TCP_END_KNOWN, TCP_OWES_FIN_ACK, TCP_ZERO_WINDOW, TOUCH_INTERVAL_NS, Timeouts,
    UDP_STREAM_AFTER_NS, seq_after,
};

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
/// surely over too (the time-wait timeout, [`TIME_WAIT_HOLD_NS`](super::TIME_WAIT_HOLD_NS) by default).
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
    FlagsView { states }
}

impl FlagsView {
    /// Both sides sent FIN, or one RST.
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[must_use]
    pub const fn closed(&self) -> bool {
        self.states.0.is_closed()
    }

    /// Nothing answered yet, or the answer not acknowledged (`SYN_RECV`).
    #[allow(clippy::inline_always)]
    #[inline(always)]
    #[must_use]
    pub const fn unanswered(&self) -> bool {
        matches!(self.states.0, FlowState::New | FlowState::SynRecv)
    }

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
