//! Anti-spoofing in the lab: a pod's packet whose source address or MAC is
//! not its own never leaves the node, and is counted.
//!
//! Order is the synchronisation: packets from one pod cross its veth and the
//! program in order, so once a marker sent after the spoofed packet reached
//! `peer`, the spoofed packet has met its verdict.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use vpcnet_bpf_tests::{agent_binary, lab_counter};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{Lab, LabOptions, Observation, WhoamiServer, addrs, send_spoofed_udp};

const PORT: u16 = 8080;
const WAIT: Duration = Duration::from_secs(3);

fn peer() -> SocketAddrV4 {
    SocketAddrV4::new(addrs::PEER_ADDR, PORT)
}

/// Sends a marker from `pod`'s own address and waits until `peer` saw it.
fn marker_seen(server: &WhoamiServer, ns: &str, pod: Ipv4Addr, sport: u16) -> bool {
    send_spoofed_udp(ns, SocketAddrV4::new(pod, sport), peer(), b"marker").unwrap();
    server
        .wait_for(WAIT, |o: &Observation| {
            o.source == SocketAddrV4::new(pod, sport)
        })
        .is_some()
}

#[test]
fn a_pod_cannot_send_as_another_address_or_mac() {
    let _serial = vpcnet_lab::serial();
    let lab = Lab::up(&LabOptions {
        enis: 2,
        ..LabOptions::ebpf(2, agent_binary())
    })
    .unwrap();
    let server = WhoamiServer::start(addrs::NS_PEER, peer()).unwrap();
    let pod = lab.pod(0).clone();
    assert!(
        marker_seen(&server, &pod.netns, pod.addr, 4000),
        "its own address gets through"
    );

    // Another pod's address (on another ENI), and an address no pod has.
    for (i, fake) in [lab.pod(1).addr, Ipv4Addr::new(10, 20, 11, 99)]
        .into_iter()
        .enumerate()
    {
        let before = lab_counter(Counter::DropSpoofedAddr);
        send_spoofed_udp(
            &pod.netns,
            SocketAddrV4::new(fake, 5000),
            peer(),
            b"spoofed",
        )
        .unwrap();
        let sport = 4001 + u16::try_from(i).unwrap();
        assert!(marker_seen(&server, &pod.netns, pod.addr, sport));
        assert_eq!(
            lab_counter(Counter::DropSpoofedAddr),
            before + 1,
            "{fake} counted"
        );
        assert!(
            !server.observations().iter().any(|o| *o.source.ip() == fake),
            "peer never saw {fake}"
        );
    }

    // Its own address from another MAC. A new MAC flushes the link's
    // neighbours, the pod's permanent entry for its gateway too: put it
    // back each time, as the CNI set it up.
    let own_mac = pod.mac.clone();
    let gateway = addrs::POD_GATEWAY.to_string();
    let set_mac = |mac: &str| {
        let link = ["ip", "link", "set", "dev", "eth0", "address", mac];
        lab.exec_ok(&pod.netns, &link).unwrap();
        let neigh = [
            "ip",
            "neigh",
            "replace",
            &gateway,
            "dev",
            "eth0",
            "lladdr",
            &pod.host_veth_mac,
            "nud",
            "permanent",
        ];
        lab.exec_ok(&pod.netns, &neigh).unwrap();
    };
    let before = lab_counter(Counter::DropSpoofedMac);
    set_mac("02:de:ad:be:ef:01");
    let spoofed = SocketAddrV4::new(pod.addr, 5001);
    send_spoofed_udp(&pod.netns, spoofed, peer(), b"spoofed").unwrap();
    set_mac(&own_mac);
    assert!(marker_seen(&server, &pod.netns, pod.addr, 4010));
    assert_eq!(lab_counter(Counter::DropSpoofedMac), before + 1);
    assert!(
        !server.observations().iter().any(|o| o.source == spoofed),
        "peer never saw the packet from the wrong MAC"
    );
    drop(server);
}
