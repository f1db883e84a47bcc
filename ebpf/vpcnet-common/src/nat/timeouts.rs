//! How long flows live: netfilter's conntrack timeouts, as the node sets
//! them.

use super::{FlowState, NS_PER_SEC, PROTO_ICMP, PROTO_TCP, PROTO_UDP, TIME_WAIT_HOLD_NS};

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
