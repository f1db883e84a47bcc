//! Floods of flows nobody answers never keep the node's flows out (issue
//! 16): a SYN flood from outside the VPC to a pod, and a pod retrying an
//! endpoint that black-holes its SYNs under EXTERNALSNAT, each at twice the
//! NAT table's size. Unanswered flows expire at conntrack's timeouts (the
//! node's `nf_conntrack_*` settings, shortened here the way an operator
//! would, with sysctl), so a paced flood never fills the table; a flood
//! faster than the timeouts fills it, and then early drop makes room for
//! every new flow while established flows keep working. A table full of
//! established flows (nothing to make room with) never stops the node's
//! own traffic, and drops what it cannot track.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test floods -- --test-threads=1 --nocapture`.

use std::{net::SocketAddrV4, time::Duration};

use vpcnet_bpf_tests::{
    agent_binary, agent_cli,
    echo::EchoStream,
    flood::{
        FloodReport, RawSender, drop_answers_on_prem, nat_flows, syn_flood, wait_for_timeouts,
    },
    idle::{IdleConnection, listen},
    lab_counter,
};
use vpcnet_common::{counters::Counter, nat::Timeouts};
use vpcnet_lab::{
    Lab, LabOptions, WhoamiServer, addrs, netns::set_sysctls, probe::tcp_whoami_closed, serial,
    tcp_whoami,
};

/// A table small enough to flood in seconds.
const NAT_ENTRIES: u16 = 1024;
/// Each flood: twice the table.
const FLOOD: u16 = 2 * NAT_ENTRIES;
const PORT: u16 = 8080;
/// Source ports of the flood (none of them a socket of the flooding host).
const FLOOD_PORTS: u16 = 20000;
const ECHOES: u64 = 50;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// New connections that must get through after each flood.
const NEW_FLOWS: usize = 20;
/// A table the test fills with established connections it holds.
const FULL_TABLE: u16 = 32;
const HELD_PORT: u16 = 8090;
/// How long a connection that should be dropped is given.
const DROPPED_TIMEOUT: Duration = Duration::from_secs(1);
/// A paced flood's rate: with the shortened timeouts below, about 500
/// unanswered flows live at once, half the table.
const PACED_PER_SECOND: u32 = 100;

fn up(nat_entries: u16) -> Lab {
    let options = LabOptions {
        agent_env: vec![
            ("VPCNET_NAT_ENTRIES".into(), nat_entries.to_string()),
            ("VPCNET_GC_INTERVAL".into(), "1".into()),
        ],
        ..LabOptions::ebpf(2, agent_binary())
    };
    Lab::up(&options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"))
}

/// Sets the node's conntrack timeouts for unanswered TCP flows and waits
/// until the datapath uses them (0: back to netfilter's defaults).
fn set_unanswered_timeouts(seconds: u32) {
    let value = if seconds == 0 { 120 } else { seconds };
    let syn_recv = if seconds == 0 { 60 } else { seconds };
    set_sysctls(
        addrs::NS_NODE,
        &[
            (
                "net.netfilter.nf_conntrack_tcp_timeout_syn_sent",
                &value.to_string(),
            ),
            (
                "net.netfilter.nf_conntrack_tcp_timeout_syn_recv",
                &syn_recv.to_string(),
            ),
        ],
    )
    .expect("setting the node's conntrack timeouts");
    let node = vpcnet_lab::netns::get_sysctl(
        addrs::NS_NODE,
        "net.netfilter.nf_conntrack_tcp_timeout_established",
    )
    .expect("reading the node's conntrack timeouts");
    let mut expected = Timeouts {
        tcp_syn_sent: value,
        tcp_syn_recv: syn_recv,
        ..Timeouts::default()
    };
    // The rest as the node has them: the agent copies every one.
    expected.tcp_established = node.parse().expect("a number");
    for (name, field) in Timeouts::SYSCTLS {
        if name.starts_with("tcp_timeout_syn") || name == "tcp_timeout_established" {
            continue;
        }
        let value = vpcnet_lab::netns::get_sysctl(
            addrs::NS_NODE,
            &format!("net.netfilter.nf_conntrack_{name}"),
        )
        .expect("reading the node's conntrack timeouts");
        *field(&mut expected) = value.parse().expect("a number");
    }
    wait_for_timeouts(&expected, Duration::from_secs(10)).expect("the datapath's timeouts");
}

/// New connections from pod `ns` to `server` all get through, translated
/// to the node's address.
fn new_flows_get_through(ns: &str, server: SocketAddrV4, phase: &str) {
    for i in 0..NEW_FLOWS {
        let seen = tcp_whoami(ns, server, CONNECT_TIMEOUT)
            .unwrap_or_else(|e| panic!("{phase}: connection {i}: {e}"))
            .unwrap_or_else(|| panic!("{phase}: connection {i} got no answer"));
        assert_eq!(*seen.ip(), addrs::NODE_PRIMARY_ADDR, "{phase}: SNATed");
    }
}

fn print_report(phase: &str, report: &FloodReport) {
    println!(
        "{phase}: {} SYNs in {:.1} s, table of {NAT_ENTRIES} held at most {} flows; \
         early drops {}, table-full drops {}, inbound untracked {}",
        report.sent,
        report.elapsed.as_secs_f64(),
        report.max_flows,
        lab_counter(Counter::NatEarlyDrop),
        lab_counter(Counter::DropNatTableFull),
        lab_counter(Counter::DropInboundUntracked),
    );
}

#[test]
fn a_syn_flood_from_outside_the_vpc_never_keeps_flows_out() {
    let _lab_slot = serial();
    let lab = up(NAT_ENTRIES);
    let pod = lab.pod(0).clone();
    let client = lab.pod(1).clone();
    let inet = WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
        .expect("whoami in inet");
    let target = SocketAddrV4::new(pod.addr, PORT);
    let pod_server = WhoamiServer::start(&pod.netns, target).expect("whoami in pod-0");
    // Flows that must live through the floods: a pod's SNATed connection
    // and one on-prem opened to the pod.
    let snat = EchoStream::open(&client.netns, inet.addr());
    let inbound = EchoStream::open(addrs::NS_ONPREM, target);
    // On-prem drops what the pod answers to the flood's ports.
    drop_answers_on_prem(PORT, FLOOD_PORTS..FLOOD_PORTS + 2 * FLOOD)
        .expect("on-prem drops the flood's answers");
    let sender = RawSender::open(addrs::NS_ONPREM).expect("a raw socket on-prem");

    // Paced, with unanswered flows timing out after 2 s: they expire as
    // fast as they come, and the table never fills.
    set_unanswered_timeouts(2);
    let paced = syn_flood(
        &sender,
        addrs::ONPREM_ADDR,
        FLOOD_PORTS..FLOOD_PORTS + FLOOD,
        target,
        Some(PACED_PER_SECOND),
    )
    .expect("the paced flood");
    print_report("paced flood, 2 s timeouts", &paced);
    assert!(
        paced.max_flows < usize::from(NAT_ENTRIES),
        "the table filled: {paced:?}"
    );
    assert_eq!(
        lab_counter(Counter::NatEarlyDrop),
        0,
        "nothing had to give way"
    );
    assert_eq!(lab_counter(Counter::DropInboundUntracked), 0);
    new_flows_get_through(&client.netns, inet.addr(), "after the paced flood");

    // As fast as it goes, with netfilter's timeouts (SYN_RECV 60 s): the
    // table fills, and the flood's own flows make way for new ones.
    set_unanswered_timeouts(0);
    let fast = syn_flood(
        &sender,
        addrs::ONPREM_ADDR,
        FLOOD_PORTS + FLOOD..FLOOD_PORTS + 2 * FLOOD,
        target,
        None,
    )
    .expect("the fast flood");
    new_flows_get_through(&client.netns, inet.addr(), "after the fast flood");
    print_report("fast flood, default timeouts", &fast);
    assert!(
        lab_counter(Counter::NatEarlyDrop) > 0,
        "a flood of twice the table made room"
    );
    assert_eq!(
        lab_counter(Counter::DropNatTableFull),
        0,
        "no new flow was refused"
    );
    assert_eq!(lab_counter(Counter::DropInboundUntracked), 0);
    snat.wait_for_more_echoes(ECHOES, "after the floods");
    inbound.wait_for_more_echoes(ECHOES, "after the floods");
    println!(
        "established: SNAT {} echoes, on-prem to pod {} echoes, 0 broken",
        snat.close(),
        inbound.close()
    );
    drop((inet, pod_server));
    lab.down().expect("taking the lab down");
}

#[test]
fn a_pod_retrying_a_black_holed_endpoint_under_external_snat_never_keeps_flows_out() {
    let _lab_slot = serial();
    let lab = up(NAT_ENTRIES);
    let pod = lab.pod(0).clone();
    let retrying = lab.pod(1).clone();
    let inet = WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
        .expect("whoami in inet");
    // A connection SNATed before the flag flips, which must live on.
    let snat = EchoStream::open(&pod.netns, inet.addr());
    agent_cli(&["set", "external-snat", "on"]);
    // Under EXTERNALSNAT the pod's SYNs leave with its own address, which
    // the internet gateway drops: nothing ever answers them. The pod
    // retries from a new port each time, twice as often as the table holds.
    let sender = RawSender::open(&retrying.netns).expect("a raw socket in pod-1");
    let report = syn_flood(
        &sender,
        retrying.addr,
        FLOOD_PORTS..FLOOD_PORTS + FLOOD,
        inet.addr(),
        None,
    )
    .expect("the retries");
    print_report("retries under EXTERNALSNAT", &report);
    assert!(
        lab_counter(Counter::NatEarlyDrop) > 0,
        "the retries made room"
    );
    assert_eq!(lab_counter(Counter::DropNatTableFull), 0);
    // The flag goes off again: new flows are SNATed, each gets its port.
    agent_cli(&["set", "external-snat", "off"]);
    new_flows_get_through(&retrying.netns, inet.addr(), "after the retries");
    assert_eq!(lab_counter(Counter::DropNatTableFull), 0);
    snat.wait_for_more_echoes(ECHOES, "after the retries");
    println!("established: SNAT {} echoes, 0 broken", snat.close());
    drop(inet);
    lab.down().expect("taking the lab down");
}

/// Bad input: a table full of established flows (nothing to make room
/// with) never stops the node's own traffic: its connections to the
/// internet and kubelet's probes of a pod get through. A pod's new flow and
/// a connection from outside the VPC, which cannot be tracked, are dropped
/// under their own counters (as conntrack drops what its full table cannot
/// hold), never passed half-translated; the held flows keep working.
#[test]
fn a_table_full_of_established_flows_never_stops_the_node_s_own_traffic() {
    let _lab_slot = serial();
    let lab = up(FULL_TABLE);
    let pod = lab.pod(0).clone();
    let inet = WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
        .expect("whoami in inet");
    let pod_server = WhoamiServer::start(&pod.netns, SocketAddrV4::new(pod.addr, PORT))
        .expect("whoami in pod-0");
    let held_at = SocketAddrV4::new(addrs::INET_ADDR, HELD_PORT);
    let backend = listen(addrs::NS_INET, held_at);
    let mut held: Vec<IdleConnection> = (0..FULL_TABLE)
        .map(|_| IdleConnection::open("held", &pod.netns, held_at, &backend))
        .collect();
    assert_eq!(
        nat_flows().expect("the NAT table"),
        usize::from(FULL_TABLE),
        "the table is full"
    );

    for i in 0..NEW_FLOWS {
        let seen = tcp_whoami_closed(addrs::NS_NODE, inet.addr(), CONNECT_TIMEOUT)
            .unwrap_or_else(|e| panic!("the node's connection {i}: {e}"))
            .unwrap_or_else(|| panic!("the node's connection {i} got no answer"));
        assert_eq!(*seen.ip(), addrs::NODE_PRIMARY_ADDR);
        tcp_whoami_closed(addrs::NS_NODE, pod_server.addr(), CONNECT_TIMEOUT)
            .unwrap_or_else(|e| panic!("probe {i}: {e}"))
            .unwrap_or_else(|| panic!("probe {i} got no answer"));
    }
    let pod_new = tcp_whoami(&pod.netns, inet.addr(), DROPPED_TIMEOUT).expect("a pod's new flow");
    let inbound = tcp_whoami(addrs::NS_ONPREM, pod_server.addr(), DROPPED_TIMEOUT)
        .expect("on-prem's connection");
    println!(
        "table of {FULL_TABLE} full: the node's connections and probes {NEW_FLOWS} of {NEW_FLOWS} \
         (untracked packets {}); a pod's new flow {pod_new:?} (dropped {}); \
         on-prem's connection {inbound:?} (dropped {})",
        lab_counter(Counter::EgressHostUntracked),
        lab_counter(Counter::DropNatTableFull),
        lab_counter(Counter::DropInboundUntracked),
    );
    assert!(lab_counter(Counter::EgressHostUntracked) > 0);
    assert_eq!(pod_new, None, "a pod's new flow finds no room");
    assert!(lab_counter(Counter::DropNatTableFull) > 0);
    assert_eq!(inbound, None, "on-prem's connection cannot be tracked");
    assert!(lab_counter(Counter::DropInboundUntracked) > 0);
    for (i, connection) in held.iter_mut().enumerate() {
        connection
            .exchange("still here")
            .unwrap_or_else(|e| panic!("held connection {i}: {e}"));
    }
    drop((held, inet, pod_server));
    lab.down().expect("taking the lab down");
}
