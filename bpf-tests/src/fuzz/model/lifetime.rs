//! How long flows live, written from netfilter's conntrack rather than
//! from the programs: a pair's phase from its halves' flags (and, for the
//! collector, its sequence numbers), the node's timeout for that phase,
//! the port holders a new flow may take over, the early drop of a full
//! table, and the collector's pass.
//!
//! Times are whole seconds on the model's clock. A program compares real
//! times a fraction of a second later than the seconds say (the clock
//! keeps them so, see `fuzz::clock`): "more than T seconds" holds from
//! T whole seconds on, and "within T seconds" up to T - 1.

use vpcnet_common::{
    maps::RECENT_FLOWS_LEN,
    nat::{
        DEFAULT_TIMEOUTS, FlowKey, FlowKind, PROTO_ICMP, PROTO_TCP, PROTO_UDP, RecentFlows,
        SEEN_ACK, SEEN_ANY, SEEN_FIN, SEEN_RST, TCP_ACK_KNOWN, TCP_END_KNOWN, TCP_OWES_FIN_ACK,
        TCP_ZERO_WINDOW,
    },
};

use super::{Half, Model, Stamp, Tables, headers::key};

/// Where a connection is, as conntrack names its TCP states; other
/// protocols are `Unanswered` or `Open`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Unanswered,
    /// The answer came, the opener has not acknowledged it.
    Answered,
    Open,
    /// One side's FIN not acknowledged yet, or acknowledged (the other
    /// side may still send).
    FinSent,
    HalfClosed,
    /// Both FINs, one not acknowledged yet, or both.
    LastAck,
    BothClosed,
    Reset,
}

/// A flow's two halves, the opener's first.
fn opener_first(fwd: Half, rev: Half) -> (Half, Half) {
    if fwd.kind == FlowKind::Inbound as u8 || fwd.kind == FlowKind::StackToPod as u8 {
        (rev, fwd)
    } else {
        (fwd, rev)
    }
}

/// The phases a pair's flags allow: one, or two the sequence numbers
/// would tell apart.
fn phases_by_flags(proto: u8, fwd: Half, rev: Half) -> (Phase, Phase) {
    let (opener, answer) = opener_first(fwd, rev);
    let tcp = proto == PROTO_TCP;
    let fin = |h: Half| tcp && h.seen & SEEN_FIN != 0;
    if tcp && (opener.seen | answer.seen) & SEEN_RST != 0 {
        (Phase::Reset, Phase::Reset)
    } else if fin(opener) && fin(answer) {
        (Phase::LastAck, Phase::BothClosed)
    } else if fin(opener) || fin(answer) {
        (Phase::FinSent, Phase::HalfClosed)
    } else if answer.seen & SEEN_ANY == 0 {
        (Phase::Unanswered, Phase::Unanswered)
    } else if tcp && opener.seen & SEEN_ACK == 0 {
        (Phase::Answered, Phase::Answered)
    } else {
        (Phase::Open, Phase::Open)
    }
}

/// `a` comes after `b` in sequence space.
fn after(a: u32, b: u32) -> bool {
    (1..1 << 31).contains(&a.wrapping_sub(b))
}

/// Whether `receiver` acknowledged everything `sender` sent; numbers not
/// both known count as acknowledged once the receiver sent an ACK it does
/// not owe again.
fn acknowledged(sender: Half, receiver: Half) -> bool {
    receiver.seen & SEEN_ACK != 0
        && receiver.tcp & TCP_OWES_FIN_ACK == 0
        && (sender.tcp & TCP_END_KNOWN == 0
            || receiver.tcp & TCP_ACK_KNOWN == 0
            || !after(sender.seq_end, receiver.ack))
}

/// Data `sender` sent that `receiver` has not acknowledged, both numbers
/// known.
fn outstanding(sender: Half, receiver: Half) -> bool {
    sender.tcp & TCP_END_KNOWN != 0
        && receiver.tcp & TCP_ACK_KNOWN != 0
        && after(sender.seq_end, receiver.ack)
}

/// The pair's phase, with its sequence numbers.
fn phase(proto: u8, fwd: Half, rev: Half) -> Phase {
    let (opener, answer) = opener_first(fwd, rev);
    match phases_by_flags(proto, fwd, rev) {
        (Phase::LastAck, _) if acknowledged(opener, answer) && acknowledged(answer, opener) => {
            Phase::BothClosed
        }
        (Phase::LastAck, _) => Phase::LastAck,
        (Phase::FinSent, _) => {
            let closer_acked = if opener.seen & SEEN_FIN != 0 {
                acknowledged(opener, answer)
            } else {
                acknowledged(answer, opener)
            };
            if closer_acked {
                Phase::HalfClosed
            } else {
                Phase::FinSent
            }
        }
        (one, _) => one,
    }
}

/// The later of the halves' last packets.
fn last_packet(fwd: Half, rev: Half) -> Stamp {
    fwd.last.max(rev.last)
}

/// The node's timeout, in seconds, for a flow of `proto` in `phase`; a
/// UDP flow answered and more than two seconds old is a stream.
fn timeout(model: &Model, proto: u8, phase: Phase, stream: bool) -> u64 {
    let (t, d) = (&model.world.timeouts, &DEFAULT_TIMEOUTS);
    let (set, default) = match (proto, phase) {
        (PROTO_TCP, Phase::Unanswered) => (t.tcp_syn_sent, d.tcp_syn_sent),
        (PROTO_TCP, Phase::Answered) => (t.tcp_syn_recv, d.tcp_syn_recv),
        (PROTO_TCP, Phase::Open) => (t.tcp_established, d.tcp_established),
        (PROTO_TCP, Phase::FinSent) => (t.tcp_fin_wait, d.tcp_fin_wait),
        (PROTO_TCP, Phase::HalfClosed) => (t.tcp_close_wait, d.tcp_close_wait),
        (PROTO_TCP, Phase::LastAck) => (t.tcp_last_ack, d.tcp_last_ack),
        (PROTO_TCP, Phase::BothClosed) => (t.tcp_time_wait, d.tcp_time_wait),
        (PROTO_TCP, Phase::Reset) => (t.tcp_close, d.tcp_close),
        (PROTO_UDP, Phase::Unanswered) => (t.udp, d.udp),
        (PROTO_UDP, _) if stream => (t.udp_stream, d.udp_stream),
        (PROTO_UDP, _) => (t.udp, d.udp),
        (PROTO_ICMP, _) => (t.icmp, d.icmp),
        _ => (t.generic, d.generic),
    };
    seconds(set, default)
}

/// A timeout field's value (a count, for the retransmission limit): `set`,
/// or netfilter's `default` where the node left it 0.
fn seconds(set: u32, default: u32) -> u64 {
    u64::from(if set == 0 { default } else { set })
}

fn is_stream(fwd: Half, rev: Half) -> bool {
    last_packet(fwd, rev).seconds_since(fwd.created) >= 2
}

/// Whether a flow last seen at `last` is idle past `timeout` seconds at
/// `now`: the programs allow a second more, for a last packet they did
/// not write down, so the whole seconds must exceed it.
fn idle_past(now: Stamp, last: Stamp, timeout: u64) -> bool {
    now.seconds_since(last) > timeout
}

/// Who holds a port a new flow tries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Holder {
    Free,
    /// A flow over by the longest timeout its flags allow: taken over.
    Over,
    /// Closed (both FINs or a RST), within its hold; its last packet.
    Closed(Stamp),
    Live,
}

impl Model {
    /// How long, in seconds, an established connection of `proto` lives
    /// idle (a replied UDP flow counted as a stream).
    pub(super) fn established_timeout(&self, proto: u8) -> u64 {
        timeout(self, proto, Phase::Open, true)
    }

    /// A flow of the NAT table: its claim `claim`, its forward half if
    /// there is one (a claim alone is judged as both).
    fn nat_pair(&self, claim: &FlowKey) -> Option<(FlowKey, Half, Half)> {
        let rev = *self.tables.nat_rev.get(claim)?;
        let fwd_key = key(rev.addr, claim.saddr, rev.port, claim.sport, claim.proto);
        let fwd = self.tables.nat_fwd.get(&fwd_key).copied().unwrap_or(rev);
        Some((fwd_key, fwd, rev))
    }

    /// Who holds the claim `claim`.
    pub(super) fn holder(&self, claim: &FlowKey) -> Holder {
        let Some((_, fwd, rev)) = self.nat_pair(claim) else {
            return Holder::Free;
        };
        let (a, b) = phases_by_flags(claim.proto, fwd, rev);
        let stream = is_stream(fwd, rev);
        let longest =
            timeout(self, claim.proto, a, stream).max(timeout(self, claim.proto, b, stream));
        let last = last_packet(fwd, rev);
        if idle_past(self.now, last, longest) {
            Holder::Over
        } else if matches!(a, Phase::LastAck | Phase::Reset) {
            Holder::Closed(last)
        } else {
            Holder::Live
        }
    }

    /// Removes the flow whose claim is `claim`: the claim, and its forward
    /// half while that still points at it.
    pub(super) fn remove_nat_pair(&mut self, claim: &FlowKey) {
        let Some(rev) = self.tables.nat_rev.remove(claim) else {
            return;
        };
        let fwd_key = key(rev.addr, claim.saddr, rev.port, claim.sport, claim.proto);
        if self
            .tables
            .nat_fwd
            .get(&fwd_key)
            .is_some_and(|fwd| fwd.port == claim.dport && fwd.addr == claim.daddr)
        {
            self.tables.nat_fwd.remove(&fwd_key);
        }
    }

    /// The slot of `ring` naming the oldest recent flow that nothing
    /// answered (or whose answer the opener has not acknowledged): a full
    /// map's early-drop victim. `pair` gives a flow's halves by its key,
    /// the opener's side first.
    fn early_drop_victim(
        ring: &RecentFlows,
        pair: impl Fn(&FlowKey) -> Option<(Half, Half)>,
    ) -> Option<usize> {
        (0..RECENT_FLOWS_LEN)
            .map(|i| RecentFlows::slot(ring.next.wrapping_add(i)))
            .find(|&slot| {
                let key = ring.keys[slot];
                pair(&key).is_some_and(|(fwd, rev)| {
                    matches!(
                        phases_by_flags(key.proto, fwd, rev).0,
                        Phase::Unanswered | Phase::Answered
                    )
                })
            })
    }

    /// The NAT map's early-drop victim (see [`Model::early_drop_victim`]).
    pub(super) fn nat_victim(&self) -> Option<usize> {
        Self::early_drop_victim(&self.tables.recent, |claim| {
            self.nat_pair(claim).map(|(_, fwd, rev)| (fwd, rev))
        })
    }

    /// A full NAT map's early drop: its victim removed. Whether there was
    /// one.
    pub(super) fn early_drop_nat(&mut self) -> bool {
        let Some(slot) = self.nat_victim() else {
            return false;
        };
        let claim = self.tables.recent.keys[slot];
        self.remove_nat_pair(&claim);
        self.tables.recent.keys[slot].proto = 0;
        true
    }

    /// As [`Model::early_drop_nat`], for the stack flows map, whose ring
    /// names the pod-side tuples.
    pub(super) fn early_drop_stack(&mut self) -> bool {
        let stack = &self.tables.stack;
        let victim = Self::early_drop_victim(&self.tables.recent_stack, |pod_side| {
            let from_pod = *stack.get(pod_side)?;
            let toward_pod = stack.get(&pod_side.reversed()).copied().unwrap_or(from_pod);
            Some((from_pod, toward_pod))
        });
        let Some(slot) = victim else {
            return false;
        };
        let pod_side = self.tables.recent_stack.keys[slot];
        self.tables.stack.remove(&pod_side);
        self.tables.stack.remove(&pod_side.reversed());
        self.tables.recent_stack.keys[slot].proto = 0;
        true
    }

    /// Whether a pair is over at `now`: its phase's timeout, capped as
    /// conntrack caps it while data is unacknowledged, a side retransmits
    /// or a window is zero.
    fn expired(&self, proto: u8, fwd: Half, rev: Half) -> bool {
        let phase = phase(proto, fwd, rev);
        let mut lives = timeout(self, proto, phase, is_stream(fwd, rev));
        if proto == PROTO_TCP && phase != Phase::Reset {
            let t = &self.world.timeouts;
            let d = &DEFAULT_TIMEOUTS;
            let limit = u32::try_from(seconds(t.tcp_retrans_limit, d.tcp_retrans_limit))
                .unwrap_or(u32::MAX);
            let (fwd_out, rev_out) = (outstanding(fwd, rev), outstanding(rev, fwd));
            let stuck = (fwd_out && u32::from(fwd.retrans) >= limit)
                || (rev_out && u32::from(rev.retrans) >= limit)
                || (fwd.tcp | rev.tcp) & TCP_ZERO_WINDOW != 0;
            if stuck {
                lives = lives.min(seconds(t.tcp_max_retrans, d.tcp_max_retrans));
            } else if fwd_out || rev_out {
                lives = lives.min(seconds(t.tcp_unacknowledged, d.tcp_unacknowledged));
            }
        }
        idle_past(self.now, last_packet(fwd, rev), lives)
    }

    /// The collector's pass at `now`: flows over by their timeouts go
    /// whole, forward halves without their claim go, claims without their
    /// forward half go once older than the grace `orphan_grace` (seconds:
    /// "more than" it, so from its whole seconds on);
    /// an untranslated flow's lone forward half gets its reverse back.
    /// Then the stack flows: pairs over, and halves alone past the grace.
    pub fn collect(&mut self, orphan_grace: u64) -> Collected {
        let mut collected = Collected::default();
        let Tables {
            nat_fwd, nat_rev, ..
        } = &self.tables;
        let mut gone_fwd = Vec::new();
        let mut gone_rev = Vec::new();
        let mut paired = Vec::new();
        let mut claimed = std::collections::HashSet::new();
        for (fwd_key, fwd) in nat_fwd {
            let claim = key(
                fwd_key.daddr,
                fwd.addr,
                fwd_key.dport,
                fwd.port,
                fwd_key.proto,
            );
            let untranslated =
                fwd.kind == FlowKind::NoSnat as u8 || fwd.kind == FlowKind::Inbound as u8;
            match nat_rev.get(&claim) {
                Some(rev) => {
                    claimed.insert(claim);
                    if self.expired(fwd_key.proto, *fwd, *rev) {
                        gone_fwd.push(*fwd_key);
                        gone_rev.push(claim);
                        collected.expired += 1;
                    }
                }
                None if untranslated => paired.push((claim, *fwd)),
                None => {
                    gone_fwd.push(*fwd_key);
                    collected.orphans += 1;
                }
            }
        }
        for (claim, rev) in nat_rev {
            if !claimed.contains(claim) && self.now.seconds_since(rev.created) >= orphan_grace {
                gone_rev.push(*claim);
                collected.orphans += 1;
            }
        }
        let mut gone_stack = Vec::new();
        for (k, half) in &self.tables.stack {
            let other = self.tables.stack.get(&k.reversed());
            let pod_side = k.saddr == half.addr && k.sport == half.port;
            match other {
                None if self.now.seconds_since(half.created) >= orphan_grace => {
                    gone_stack.push(*k);
                    collected.stack_orphans += 1;
                }
                Some(other) if pod_side && self.expired(k.proto, *half, *other) => {
                    gone_stack.extend([*k, k.reversed()]);
                    collected.stack_expired += 1;
                }
                _ => {}
            }
        }
        for k in gone_fwd {
            self.tables.nat_fwd.remove(&k);
        }
        for k in gone_rev {
            self.tables.nat_rev.remove(&k);
        }
        for (claim, fwd) in paired {
            self.tables.nat_rev.entry(claim).or_insert(fwd);
            collected.paired += 1;
        }
        for k in gone_stack {
            self.tables.stack.remove(&k);
        }
        collected
    }
}

/// What a collector's pass removed (and paired), as the agent counts it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    pub expired: usize,
    pub orphans: usize,
    pub paired: usize,
    pub stack_expired: usize,
    pub stack_orphans: usize,
}
