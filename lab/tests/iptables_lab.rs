//! The lab with the VPC CNI's iptables datapath: topology, the paths a pod
//! takes, the VPC router's checks, refusing a second lab, and teardown.
//!
//! These tests change kernel state (namespaces named vpcnet-*, the state
//! directory), so each holds `vpcnet_lab::serial()` for as long as its lab
//! exists; they need root and are skipped, loudly, without it.

mod common;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
};

use common::{DROP_TIMEOUT, REPLY_TIMEOUT, assert_no_lab_left, at, lab_session};
use vpcnet_lab::{
    Lab, LabError, LabOptions, PodInfo, Proto, WhoamiServer, addrs, exec_ok, icmp_echo, netns,
    send_spoofed_udp, tcp_whoami, udp_whoami,
};

/// Every namespace and address of the contract exists.
fn check_topology(lab: &Lab) {
    let mut expected: Vec<String> = [
        addrs::NS_VPC,
        addrs::NS_NODE,
        addrs::NS_PEER,
        addrs::NS_INET,
        addrs::NS_ONPREM,
    ]
    .into_iter()
    .map(str::to_owned)
    .chain((0..lab.pods().len()).map(addrs::pod_ns))
    .collect();
    expected.sort();
    assert_eq!(netns::lab_namespaces().unwrap(), expected);

    let node = exec_ok(addrs::NS_NODE, &["ip", "-o", "-4", "addr", "show"]).unwrap();
    assert!(node.contains("eth0    inet 10.20.11.162/24"), "{node}");
    assert!(
        node.contains("nodelocaldns    inet 169.254.20.10/32"),
        "{node}"
    );
    let eth0 = exec_ok(addrs::NS_NODE, &["ip", "-o", "link", "show", "eth0"]).unwrap();
    assert!(
        eth0.contains(addrs::NODE_ETH0_MAC) && eth0.contains("mtu 9001"),
        "{eth0}"
    );
    let routes = exec_ok(addrs::NS_NODE, &["ip", "route"]).unwrap();
    assert!(
        routes.contains("default via 10.20.11.1 dev eth0"),
        "{routes}"
    );
    assert_eq!(
        netns::get_sysctl(addrs::NS_NODE, "net.ipv4.ip_forward").unwrap(),
        "1"
    );
    assert_eq!(
        netns::get_sysctl(addrs::NS_NODE, "net.ipv4.conf.eth0.rp_filter").unwrap(),
        "2"
    );

    for (ns, addr) in [
        (addrs::NS_PEER, "10.20.12.50/24"),
        (addrs::NS_INET, "203.0.113.10/24"),
        (addrs::NS_ONPREM, "192.0.2.10/24"),
    ] {
        let out = exec_ok(ns, &["ip", "-o", "-4", "addr", "show", "eth0"]).unwrap();
        assert!(out.contains(addr), "{ns}: {out}");
    }

    check_pods(lab);
}

/// Every pod is wired as the VPC CNI wires it, and the router knows it.
fn check_pods(lab: &Lab) {
    let rules = exec_ok(addrs::NS_NODE, &["ip", "rule"]).unwrap();
    assert!(
        rules.contains("1024:\tfrom all fwmark 0x80/0x80 lookup main"),
        "{rules}"
    );
    for pod in lab.pods() {
        assert_eq!(pod.addr, addrs::pod_addr(pod.index).unwrap());
        assert_eq!(
            pod.host_veth,
            addrs::host_veth_name("default", &format!("pod-{}", pod.index))
        );
        let inside = exec_ok(&pod.netns, &["ip", "-o", "-4", "addr", "show", "eth0"]).unwrap();
        assert!(
            inside.contains(&format!("inet {}/32", pod.addr)),
            "{inside}"
        );
        let pod_routes = exec_ok(&pod.netns, &["ip", "route"]).unwrap();
        assert!(
            pod_routes.contains("default via 169.254.1.1 dev eth0"),
            "{pod_routes}"
        );
        assert!(
            pod_routes.contains("169.254.1.1 dev eth0 scope link"),
            "{pod_routes}"
        );
        let neigh = exec_ok(&pod.netns, &["ip", "neigh", "show", "169.254.1.1"]).unwrap();
        assert!(
            neigh.contains(&pod.host_veth_mac) && neigh.contains("PERMANENT"),
            "{neigh}"
        );
        let host = exec_ok(
            addrs::NS_NODE,
            &["ip", "route", "show", &format!("{}/32", pod.addr)],
        )
        .unwrap();
        assert!(
            host.contains(&format!("dev {} scope link", pod.host_veth)),
            "{host}"
        );
        assert!(
            rules.contains(&format!("512:\tfrom all to {} lookup main", pod.addr)),
            "{rules}"
        );
        // The router delivers the pod's address to the node's ENI, no ARP.
        let delivery = exec_ok(
            addrs::NS_VPC,
            &["ip", "neigh", "show", &pod.addr.to_string()],
        )
        .unwrap();
        assert!(
            delivery.contains(addrs::NODE_ETH0_MAC) && delivery.contains("PERMANENT"),
            "{delivery}"
        );
    }

    let snat = exec_ok(
        addrs::NS_NODE,
        &["iptables", "-t", "nat", "-S", "AWS-SNAT-CHAIN-0"],
    )
    .unwrap();
    assert!(
        snat.contains("-j SNAT --to-source 10.20.11.162 --random-fully"),
        "SNAT rule missing:\n{snat}"
    );
}

#[test]
fn iptables_lab_paths_checks_and_lifecycle() {
    let _lab_lock = lab_session();

    let lab = Lab::up(&LabOptions::iptables(2)).expect("lab up");
    check_topology(&lab);
    let pod0 = lab.pod(0).clone();
    let pod1 = lab.pod(1).clone();

    let peer = WhoamiServer::start(addrs::NS_PEER, at(addrs::PEER_ADDR)).unwrap();
    let inet = WhoamiServer::start(addrs::NS_INET, at(addrs::INET_ADDR)).unwrap();
    let onprem = WhoamiServer::start(addrs::NS_ONPREM, at(addrs::ONPREM_ADDR)).unwrap();
    let pod1_server = WhoamiServer::start(&pod1.netns, at(pod1.addr)).unwrap();

    // Inside the VPC a pod keeps its own address.
    let seen = tcp_whoami(&pod0.netns, at(addrs::PEER_ADDR), REPLY_TIMEOUT).unwrap();
    assert_eq!(seen.map(|s| *s.ip()), Some(pod0.addr), "tcp pod-0 -> peer");
    let seen = udp_whoami(&pod0.netns, at(addrs::PEER_ADDR), REPLY_TIMEOUT).unwrap();
    assert_eq!(seen.map(|s| *s.ip()), Some(pod0.addr), "udp pod-0 -> peer");
    peer.clear();
    let replier = icmp_echo(&pod0.netns, addrs::PEER_ADDR, REPLY_TIMEOUT).unwrap();
    assert_eq!(replier, Some(addrs::PEER_ADDR), "icmp pod-0 -> peer");
    let request = peer
        .wait_for(REPLY_TIMEOUT, |o| o.proto == Proto::Icmp)
        .expect("echo seen");
    assert_eq!(*request.source.ip(), pod0.addr);

    // Pod to pod on the same node.
    let seen = tcp_whoami(&pod0.netns, at(pod1.addr), REPLY_TIMEOUT).unwrap();
    assert_eq!(seen.map(|s| *s.ip()), Some(pod0.addr), "tcp pod-0 -> pod-1");
    drop(pod1_server);

    // Leaving the VPC: SNAT to the node's primary address.
    for (name, server, addr) in [
        ("inet", &inet, addrs::INET_ADDR),
        ("onprem", &onprem, addrs::ONPREM_ADDR),
    ] {
        let seen = tcp_whoami(&pod0.netns, at(addr), REPLY_TIMEOUT).unwrap();
        assert_eq!(
            seen.map(|s| *s.ip()),
            Some(addrs::NODE_PRIMARY_ADDR),
            "tcp pod-0 -> {name}"
        );
        let seen = udp_whoami(&pod0.netns, at(addr), REPLY_TIMEOUT).unwrap();
        assert_eq!(
            seen.map(|s| *s.ip()),
            Some(addrs::NODE_PRIMARY_ADDR),
            "udp pod-0 -> {name}"
        );
        server.clear();
        assert_eq!(
            icmp_echo(&pod0.netns, addr, REPLY_TIMEOUT).unwrap(),
            Some(addr),
            "{name}"
        );
        let request = server
            .wait_for(REPLY_TIMEOUT, |o| o.proto == Proto::Icmp)
            .unwrap();
        assert_eq!(
            *request.source.ip(),
            addrs::NODE_PRIMARY_ADDR,
            "icmp pod-0 -> {name}"
        );
    }
    assert_eq!(
        lab.igw_drops().unwrap(),
        0,
        "nothing legitimate was dropped"
    );
    assert_eq!(
        lab.srcdst_check_drops().unwrap(),
        0,
        "nothing legitimate was dropped"
    );

    // The node sends from an address its ENI does not own: the router drops it.
    peer.clear();
    let before = lab.srcdst_check_drops().unwrap();
    let spoofed = SocketAddrV4::new(Ipv4Addr::new(10, 20, 11, 99), 4000);
    send_spoofed_udp(addrs::NS_NODE, spoofed, at(addrs::PEER_ADDR), b"spoofed").unwrap();
    assert_eq!(
        peer.wait_for(DROP_TIMEOUT, |o| o.source == spoofed),
        None,
        "spoofed delivered"
    );
    assert_eq!(lab.srcdst_check_drops().unwrap(), before + 1);

    // A VPC address without a public IP cannot use the internet gateway.
    inet.clear();
    let before = lab.igw_drops().unwrap();
    assert_eq!(
        udp_whoami(addrs::NS_PEER, at(addrs::INET_ADDR), DROP_TIMEOUT).unwrap(),
        None
    );
    assert!(inet.observations().is_empty(), "{:?}", inet.observations());
    assert_eq!(lab.igw_drops().unwrap(), before + 1);

    check_a_second_lab_is_refused(&pod0);

    drop((peer, inet, onprem));
    lab.down().unwrap();
    assert_no_lab_left();
}

/// A second `up` fails clearly and leaves the running lab as it was.
fn check_a_second_lab_is_refused(pod0: &PodInfo) {
    let namespaces = netns::lab_namespaces().unwrap();
    let err = Lab::up(&LabOptions::iptables(1)).expect_err("a second lab must be refused");
    assert!(
        matches!(&err, LabError::AlreadyExists { what } if what.contains("vpcnet-")),
        "{err}"
    );
    assert!(err.to_string().contains("`cargo xtask lab down`"), "{err}");
    assert_eq!(netns::lab_namespaces().unwrap(), namespaces);
    assert!(vpcnet_lab::state_file().exists());
    let seen = tcp_whoami(&pod0.netns, at(addrs::PEER_ADDR), REPLY_TIMEOUT).unwrap();
    assert_eq!(
        seen.map(|s| *s.ip()),
        Some(pod0.addr),
        "the first lab still works"
    );
}

#[test]
fn external_snat_leaves_pod_addresses_to_the_internet_gateway() {
    let _lab_lock = lab_session();

    let lab = Lab::up(&LabOptions {
        external_snat: true,
        ..LabOptions::iptables(1)
    })
    .unwrap();
    let snat = exec_ok(addrs::NS_NODE, &["iptables", "-t", "nat", "-S"]).unwrap();
    assert!(
        !snat.contains("-j SNAT") && !snat.contains("AWS-CONNMARK-CHAIN-0"),
        "{snat}"
    );
    let pod0 = lab.pod(0).clone();
    let inet = WhoamiServer::start(addrs::NS_INET, at(addrs::INET_ADDR)).unwrap();
    let onprem = WhoamiServer::start(addrs::NS_ONPREM, at(addrs::ONPREM_ADDR)).unwrap();

    // Direct Connect takes any VPC source: the pod's own address arrives.
    let seen = tcp_whoami(&pod0.netns, at(addrs::ONPREM_ADDR), REPLY_TIMEOUT).unwrap();
    assert_eq!(seen.map(|s| *s.ip()), Some(pod0.addr));
    // The internet gateway does not (a NAT gateway would be needed).
    let before = lab.igw_drops().unwrap();
    assert_eq!(
        udp_whoami(&pod0.netns, at(addrs::INET_ADDR), DROP_TIMEOUT).unwrap(),
        None
    );
    assert!(inet.observations().is_empty());
    assert!(lab.igw_drops().unwrap() > before);

    drop((inet, onprem));
    lab.down().unwrap();
    assert_no_lab_left();
}

#[test]
fn excluded_cidrs_are_not_snatted() {
    let _lab_lock = lab_session();

    let opts = LabOptions {
        exclude_snat_cidrs: vec![addrs::ONPREM_NET],
        randomize_snat: vpcnet_lab::RandomizeSnat::HashRandom,
        ..LabOptions::iptables(1)
    };
    let lab = Lab::up(&opts).unwrap();
    let snat = exec_ok(
        addrs::NS_NODE,
        &["iptables", "-t", "nat", "-S", "AWS-SNAT-CHAIN-0"],
    )
    .unwrap();
    assert!(
        snat.contains(
            "-d 192.0.2.0/24 -m comment --comment \"AWS SNAT CHAIN EXCLUSION\" -j RETURN"
        ),
        "{snat}"
    );
    assert!(
        snat.contains("--to-source 10.20.11.162 --random\n"),
        "{snat}"
    );
    let pod0 = lab.pod(0).clone();
    let inet = WhoamiServer::start(addrs::NS_INET, at(addrs::INET_ADDR)).unwrap();
    let onprem = WhoamiServer::start(addrs::NS_ONPREM, at(addrs::ONPREM_ADDR)).unwrap();

    let seen = udp_whoami(&pod0.netns, at(addrs::ONPREM_ADDR), REPLY_TIMEOUT).unwrap();
    assert_eq!(
        seen.map(|s| *s.ip()),
        Some(pod0.addr),
        "excluded: not SNATed"
    );
    let seen = udp_whoami(&pod0.netns, at(addrs::INET_ADDR), REPLY_TIMEOUT).unwrap();
    assert_eq!(
        seen.map(|s| *s.ip()),
        Some(addrs::NODE_PRIMARY_ADDR),
        "still SNATed"
    );

    drop((inet, onprem));
    lab.down().unwrap();
    assert_no_lab_left();
}

#[test]
fn bad_options_are_refused_before_anything_is_built() {
    let _lab_lock = lab_session();

    let err = Lab::up(&LabOptions::iptables(addrs::MAX_PODS + 1)).unwrap_err();
    assert!(matches!(err, LabError::TooManyPods { .. }), "{err}");
    assert!(err.to_string().contains("too many"), "{err}");
    assert_no_lab_left();

    let missing_agent = LabOptions::ebpf(1, "/nonexistent/vpcnet-agent");
    let err = Lab::up(&missing_agent).unwrap_err();
    assert!(err.to_string().contains("does not exist"), "{err}");
    assert_no_lab_left();
}

#[test]
fn a_dropped_lab_tears_itself_down_and_down_all_is_idempotent() {
    let _lab_lock = lab_session();
    {
        let lab = Lab::up(&LabOptions::iptables(0)).unwrap();
        assert!(Path::new(&netns::netns_path(addrs::NS_NODE)).exists());
        assert_eq!(Lab::open().unwrap().state(), lab.state());
    }
    assert_no_lab_left();
    vpcnet_lab::down_all().unwrap();
    vpcnet_lab::down_all().unwrap();
    assert!(matches!(Lab::open(), Err(LabError::NotRunning)));
}
