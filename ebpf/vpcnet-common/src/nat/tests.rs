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
