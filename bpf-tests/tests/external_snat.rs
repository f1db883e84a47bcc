//! `AWS_VPC_K8S_CNI_EXTERNALSNAT` on the eBPF datapath. With it the node
//! never SNATs: pod traffic leaves with the pod's own address, so on AWS
//! without a NAT gateway the internet gateway drops it (only addresses with
//! a public IP pass), which the lab's router does too. Flipping the flag on
//! a running node changes only new flows: an established connection keeps
//! its translation whichever way the flag goes.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use vpcnet_bpf_tests::{agent_binary, agent_cli, echo::EchoStream, lab_counter};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    Lab, LabOptions, Proto, WhoamiServer, addrs, icmp_echo, serial, tcp_whoami, udp_whoami,
};

const PORT: u16 = 8080;
/// How long a probe that should get through waits for its answer.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a probe that should be dropped waits before calling it dropped.
/// TCP sends its SYN at once, so a second is plenty for the router to have
/// counted it.
const DROPPED_TIMEOUT: Duration = Duration::from_secs(1);
/// Echoes the long-lived connection must complete in each phase of the
/// toggle test before the next step.
const ECHOES_PER_PHASE: u64 = 50;

fn inet() -> SocketAddrV4 {
    SocketAddrV4::new(addrs::INET_ADDR, PORT)
}

fn pod_addr() -> Ipv4Addr {
    addrs::pod_addr(0).expect("pod 0 has an address")
}

fn up_ebpf(external_snat: bool) -> Lab {
    let options = LabOptions {
        external_snat,
        ..LabOptions::ebpf(1, agent_binary())
    };
    Lab::up(&options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"))
}

/// Runs `probe` and returns its result and how many packets the internet
/// gateway dropped meanwhile.
fn igw_drops_during<T>(lab: &Lab, probe: impl FnOnce() -> T) -> (T, u64) {
    let before = lab.igw_drops().expect("reading the IGW counter");
    let result = probe();
    let after = lab.igw_drops().expect("reading the IGW counter");
    (result, after - before)
}

#[test]
fn with_external_snat_pod_traffic_to_the_internet_dies_at_the_internet_gateway() {
    let _lab_slot = serial();
    let lab = up_ebpf(true);
    let pod_ns = lab.pod(0).netns.clone();
    let inet_server = WhoamiServer::start(addrs::NS_INET, inet()).expect("whoami in inet");
    let peer_server =
        WhoamiServer::start(addrs::NS_PEER, SocketAddrV4::new(addrs::PEER_ADDR, PORT))
            .expect("whoami in peer");
    let onprem_server = WhoamiServer::start(
        addrs::NS_ONPREM,
        SocketAddrV4::new(addrs::ONPREM_ADDR, PORT),
    )
    .expect("whoami in onprem");
    let srcdst_before = lab
        .srcdst_check_drops()
        .expect("reading the router's counter");

    // Each protocol on its own, so each is seen to die at the gateway.
    let (tcp, tcp_drops) = igw_drops_during(&lab, || tcp_whoami(&pod_ns, inet(), DROPPED_TIMEOUT));
    let (udp, udp_drops) = igw_drops_during(&lab, || udp_whoami(&pod_ns, inet(), DROPPED_TIMEOUT));
    let (icmp, icmp_drops) = igw_drops_during(&lab, || {
        icmp_echo(&pod_ns, addrs::INET_ADDR, DROPPED_TIMEOUT)
    });
    assert_eq!(tcp.expect("TCP probe"), None, "TCP to inet got through");
    assert_eq!(udp.expect("UDP probe"), None, "UDP to inet got through");
    assert_eq!(icmp.expect("ICMP probe"), None, "ICMP to inet got through");
    assert!(tcp_drops >= 1, "the IGW dropped no TCP packet");
    assert!(udp_drops >= 1, "the IGW dropped no UDP packet");
    assert!(icmp_drops >= 1, "the IGW dropped no ICMP packet");
    assert!(
        inet_server.observations().is_empty(),
        "inet saw {:?}",
        inet_server.observations()
    );
    // Dropped at the gateway and nowhere before it: the pod's address is
    // the ENI's own, so the source/destination check lets it through.
    assert_eq!(
        lab.srcdst_check_drops()
            .expect("reading the router's counter"),
        srcdst_before,
        "the source/destination check dropped pod traffic"
    );

    // Inside the VPC and over Direct Connect the pod's address works, and
    // with no SNAT on the node it is what the far end sees.
    for (name, ns_server, addr) in [
        ("peer", &peer_server, addrs::PEER_ADDR),
        ("onprem", &onprem_server, addrs::ONPREM_ADDR),
    ] {
        let target = SocketAddrV4::new(addr, PORT);
        let tcp = tcp_whoami(&pod_ns, target, REPLY_TIMEOUT).expect("TCP probe");
        let udp = udp_whoami(&pod_ns, target, REPLY_TIMEOUT).expect("UDP probe");
        let icmp = icmp_echo(&pod_ns, addr, REPLY_TIMEOUT).expect("ICMP probe");
        assert_eq!(tcp.map(|s| *s.ip()), Some(pod_addr()), "TCP to {name}");
        assert_eq!(udp.map(|s| *s.ip()), Some(pod_addr()), "UDP to {name}");
        assert_eq!(icmp, Some(addr), "ICMP echo to {name}");
        let icmp_seen = ns_server.wait_for(REPLY_TIMEOUT, |o| o.proto == Proto::Icmp);
        assert_eq!(
            icmp_seen.map(|o| *o.source.ip()),
            Some(pod_addr()),
            "ICMP source at {name}"
        );
    }

    let untranslated = lab_counter(Counter::EgressExternalSnatNew);
    let snated = lab_counter(Counter::EgressSnatNew);
    assert!(untranslated > 0, "no flow counted as left un-NATed");
    assert_eq!(snated, 0, "flows were SNATed with EXTERNALSNAT on");

    drop((inet_server, peer_server, onprem_server));
    drop(lab);
}

#[test]
fn flipping_external_snat_changes_new_connections_and_keeps_the_established_one() {
    let _lab_slot = serial();
    let lab = up_ebpf(false);
    let pod_ns = lab.pod(0).netns.clone();
    let server = WhoamiServer::start(addrs::NS_INET, inet()).expect("whoami in inet");

    let stream = EchoStream::open(&pod_ns, inet());
    let stream_source = stream.seen_as;
    assert_eq!(
        *stream_source.ip(),
        addrs::NODE_PRIMARY_ADDR,
        "the long-lived connection is SNATed"
    );
    stream.wait_for_more_echoes(ECHOES_PER_PHASE, "before the flag flips");

    set_external_snat(true);
    stream.wait_for_more_echoes(ECHOES_PER_PHASE, "after external SNAT went on");

    // A new connection now leaves with the pod's address and dies at the
    // internet gateway, while the old one carries on.
    let (new_conn, drops) = igw_drops_during(&lab, || tcp_whoami(&pod_ns, inet(), DROPPED_TIMEOUT));
    assert_eq!(
        new_conn.expect("TCP probe"),
        None,
        "a new connection to inet got through with external SNAT on"
    );
    assert!(drops >= 1, "the IGW dropped nothing of the new connection");
    stream.wait_for_more_echoes(ECHOES_PER_PHASE, "after the refused new connection");

    set_external_snat(false);
    stream.wait_for_more_echoes(ECHOES_PER_PHASE, "after external SNAT went off");

    let again = tcp_whoami(&pod_ns, inet(), REPLY_TIMEOUT).expect("TCP probe");
    assert_eq!(
        again.map(|s| *s.ip()),
        Some(addrs::NODE_PRIMARY_ADDR),
        "a new connection after external SNAT went off"
    );
    stream.wait_for_more_echoes(ECHOES_PER_PHASE, "after the new connection");

    let echoed = stream.close();
    assert!(echoed >= 5 * ECHOES_PER_PHASE, "only {echoed} echoes");
    println!(
        "long-lived connection {stream_source} -> {}: {echoed} messages echoed in order \
         across external SNAT on and off, closed cleanly",
        inet()
    );
    // inet accepted exactly two connections: the long-lived one (never
    // re-established) and the one after the flag went off.
    let accepted: Vec<SocketAddrV4> = server
        .observations()
        .iter()
        .filter(|o| o.proto == Proto::Tcp)
        .map(|o| o.source)
        .collect();
    assert_eq!(accepted.len(), 2, "inet accepted {accepted:?}");
    assert_eq!(accepted[0], stream_source, "inet accepted {accepted:?}");

    drop(server);
    drop(lab);
}

/// Flips EXTERNALSNAT on the running agent the way an operator does, and
/// checks the datapath's configuration says so.
fn set_external_snat(on: bool) {
    let value = if on { "on" } else { "off" };
    agent_cli(&["set", "external-snat", value]);
    let config = agent_cli(&["config"]);
    let shown = config
        .lines()
        .find_map(|line| line.strip_prefix("external_snat"))
        .map(str::trim);
    assert_eq!(
        shown,
        Some(on.to_string().as_str()),
        "agent config:\n{config}"
    );
}
