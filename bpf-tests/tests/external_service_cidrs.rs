//! `AWS_EXTERNAL_SERVICE_CIDRS` in the lab: a pod on a secondary ENI
//! reaches such a CIDR by the node's route, out of the primary ENI, as
//! aws-node's rule `to <cidr> lookup main` (priority 1535, before the pod's
//! own 1536) sends it; other destinations still leave by the pod's ENI.
//! Which ENI a packet left by is what the VPC router counts on its side of
//! each ENI.
//!
//! The CIDR here is the on-premises network, excluded from SNAT, so the
//! pod's packet leaves with the pod's address: by the primary ENI, whose
//! addresses it is not one of, the VPC's source/destination check drops it,
//! as AWS does with aws-node's rule.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test external_service_cidrs -- --nocapture`.

use std::{net::SocketAddrV4, time::Duration};

use vpcnet_bpf_tests::{agent_binary, agent_cli, lab_counter};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    Lab, LabOptions, addrs,
    probe::{RouterLinkTap, WhoamiServer, udp_whoami},
    serial,
};

const PORT: u16 = 8080;
/// An answer that comes takes milliseconds.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long to wait for an answer that must not come.
const DROP_TIMEOUT: Duration = Duration::from_millis(700);

/// IPv4 packets the VPC router got on `n0-eth0` and `n0-eth1` during `f`.
fn left_by<T>(tap: &RouterLinkTap, f: impl FnOnce() -> T) -> (T, [u64; 2]) {
    let before = tap.read().expect("the router's link counts");
    let out = f();
    let after = tap.read().expect("the router's link counts");
    (out, [after[0] - before[0], after[1] - before[1]])
}

#[test]
fn a_secondary_eni_pods_traffic_to_an_external_service_cidr_leaves_by_the_primary_eni() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let opts = LabOptions {
        enis: 2,
        exclude_snat_cidrs: vec![addrs::ONPREM_NET],
        agent_env: vec![(
            "AWS_EXTERNAL_SERVICE_CIDRS".to_owned(),
            format!("{},fd00::/8", addrs::ONPREM_NET),
        )],
        ..LabOptions::ebpf(2, agent_binary())
    };
    let lab = Lab::up(&opts).expect("bringing up the lab");
    let on_eth1 = lab.pod(1).clone();
    assert_eq!(on_eth1.eni, addrs::eni_ifname(1));
    assert!(
        agent_cli(&["config"])
            .lines()
            .any(|l| l.contains(&addrs::ONPREM_NET.to_string()) && l.ends_with("ExternalService")),
        "the agent put the CIDR in the datapath, the IPv6 item left out"
    );
    let peer = WhoamiServer::start(addrs::NS_PEER, SocketAddrV4::new(addrs::PEER_ADDR, PORT))
        .expect("a server at peer");
    let onprem = WhoamiServer::start(
        addrs::NS_ONPREM,
        SocketAddrV4::new(addrs::ONPREM_ADDR, PORT),
    )
    .expect("a server at onprem");
    let tap = RouterLinkTap::install(&[addrs::vpc_eni_link(0), addrs::vpc_eni_link(1)])
        .expect("counting the router's links");

    // To the VPC: by the pod's own ENI, answered.
    let (seen, links) = left_by(&tap, || {
        udp_whoami(&on_eth1.netns, peer.addr(), REPLY_TIMEOUT).expect("UDP to peer")
    });
    assert_eq!(seen.map(|s| *s.ip()), Some(on_eth1.addr), "peer answered");
    assert_eq!(links, [0, 1], "by eth1: [eth0, eth1] = {links:?}");

    // To the external service CIDR: by the primary ENI, where the VPC drops
    // the pod's address.
    let drops = lab.srcdst_check_drops().expect("the router's drops");
    let (seen, links) = left_by(&tap, || {
        udp_whoami(&on_eth1.netns, onprem.addr(), DROP_TIMEOUT).expect("UDP to onprem")
    });
    assert_eq!(seen, None, "the VPC drops it on the primary ENI");
    assert_eq!(links, [1, 0], "by eth0: [eth0, eth1] = {links:?}");
    assert_eq!(
        lab.srcdst_check_drops().expect("the router's drops"),
        drops + 1,
        "the source/destination check dropped it"
    );
    assert!(onprem.observations().is_empty(), "onprem saw nothing");
    assert_eq!(lab_counter(Counter::PodExternalService), 1);
    assert_eq!(lab_counter(Counter::EgressExternalService), 1);

    // A pod on the primary ENI reaches it un-NATed, as before.
    let on_eth0 = lab.pod(0).clone();
    let (seen, links) = left_by(&tap, || {
        udp_whoami(&on_eth0.netns, onprem.addr(), REPLY_TIMEOUT).expect("UDP to onprem")
    });
    assert_eq!(seen.map(|s| *s.ip()), Some(on_eth0.addr), "onprem answered");
    assert_eq!(links, [1, 0]);
    println!(
        "AWS_EXTERNAL_SERVICE_CIDRS={}: pod-1 ({}, eth1) to peer by eth1, to onprem by eth0 (dropped there by the source/destination check); pod-0 (eth0) to onprem answered",
        addrs::ONPREM_NET,
        on_eth1.addr
    );
    drop(tap);
    lab.down().expect("taking the lab down");
}
