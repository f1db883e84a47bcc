//! The agent's NAT garbage collector on flows the real program created:
//! each flow is removed whole (both halves) once its timeout passed, live
//! flows stay, and halves left alone are cleaned up.

use vpcnet_agent::datapath::monotonic_now_ns;
use vpcnet_bpf_tests::{
    Harness, INET, NODE, POD,
    packets::{self, TCP_ACK, TCP_FIN, TCP_SYN},
};
use vpcnet_common::nat::{
    FlowKey, NS_PER_SEC, TCP_ESTABLISHED_TIMEOUT_NS, TIME_WAIT_HOLD_NS, UDP_TIMEOUT_NS,
};

const SEC: u64 = NS_PER_SEC;

fn nat_port(h: &Harness, packet: &[u8]) -> u16 {
    packets::parse(&h.egress(packet).packet).sport
}

#[test]
fn expired_flows_go_whole_and_live_ones_stay() {
    let mut h = Harness::lab_default();
    // An unanswered UDP flow: 30 s.
    nat_port(&h, &packets::udp(POD, 5000, INET, 53, b"q"));
    // An established TCP flow: days.
    let est = nat_port(&h, &packets::tcp(POD, 40000, INET, 443, TCP_SYN, b""));
    h.ingress(&packets::tcp(INET, 443, NODE, est, TCP_SYN | TCP_ACK, b""));
    h.egress(&packets::tcp(POD, 40000, INET, 443, TCP_ACK, b""));
    // A TCP flow closed by both sides: held 60 s for the remote's TIME_WAIT.
    let closed = nat_port(&h, &packets::tcp(POD, 40001, INET, 443, TCP_SYN, b""));
    h.ingress(&packets::tcp(
        INET,
        443,
        NODE,
        closed,
        TCP_SYN | TCP_ACK,
        b"",
    ));
    h.ingress(&packets::tcp(
        INET,
        443,
        NODE,
        closed,
        TCP_FIN | TCP_ACK,
        b"",
    ));
    h.egress(&packets::tcp(POD, 40001, INET, 443, TCP_FIN | TCP_ACK, b""));
    assert_eq!(h.table_sizes(), (3, 3));

    let now = monotonic_now_ns();
    let stats = h.datapath.maps.collect_garbage(now).unwrap();
    assert_eq!(
        (stats.flows, stats.expired, stats.orphans),
        (3, 0, 0),
        "nothing is over yet"
    );

    let stats = h
        .datapath
        .maps
        .collect_garbage(now + UDP_TIMEOUT_NS + SEC)
        .unwrap();
    assert_eq!(stats.expired, 1, "the UDP flow timed out");
    assert_eq!(h.table_sizes(), (2, 2), "its pair went whole");

    let stats = h
        .datapath
        .maps
        .collect_garbage(now + TIME_WAIT_HOLD_NS + SEC)
        .unwrap();
    assert_eq!(stats.expired, 1, "the closed flow's TIME_WAIT hold is over");
    assert_eq!(h.table_sizes(), (1, 1));

    let stats = h.datapath.maps.collect_garbage(now + 3600 * SEC).unwrap();
    assert_eq!(stats.expired, 0, "an established flow lives on");
    let stats = h
        .datapath
        .maps
        .collect_garbage(now + TCP_ESTABLISHED_TIMEOUT_NS + SEC)
        .unwrap();
    assert_eq!(stats.expired, 1);
    assert_eq!(h.table_sizes(), (0, 0));
}

#[test]
fn halves_left_alone_are_removed() {
    let mut h = Harness::lab_default();
    let port = nat_port(&h, &packets::tcp(POD, 40000, INET, 443, TCP_SYN, b""));
    let fwd_key = h.datapath.maps.nat_fwd.keys().next().unwrap().unwrap();
    let rev_key: FlowKey = h.datapath.maps.nat_rev.keys().next().unwrap().unwrap();
    assert_eq!(vpcnet_common::raw_to_port(rev_key.dport), port);

    // A forward half without its claim is useless: removed at once.
    h.datapath.maps.nat_rev.remove(&rev_key).unwrap();
    let stats = h.datapath.maps.collect_garbage(monotonic_now_ns()).unwrap();
    assert_eq!(stats.orphans, 1);
    assert_eq!(h.table_sizes(), (0, 0));

    // A claim without its forward half may be a flow being created on
    // another CPU: kept for a grace period, then removed.
    let _ = nat_port(&h, &packets::tcp(POD, 40001, INET, 443, TCP_SYN, b""));
    let fwd_key2 = h.datapath.maps.nat_fwd.keys().next().unwrap().unwrap();
    assert_ne!(fwd_key, fwd_key2);
    h.datapath.maps.nat_fwd.remove(&fwd_key2).unwrap();
    let now = monotonic_now_ns();
    assert_eq!(h.datapath.maps.collect_garbage(now).unwrap().orphans, 0);
    assert_eq!(h.table_sizes(), (0, 1));
    assert_eq!(
        h.datapath
            .maps
            .collect_garbage(now + 11 * SEC)
            .unwrap()
            .orphans,
        1
    );
    assert_eq!(h.table_sizes(), (0, 0));
}
