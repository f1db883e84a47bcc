//! Fragmented datagrams on a node as EKS runs it: kube-proxy's rules make
//! the node's conntrack active, and conntrack reassembles whatever
//! fragments the node's stack receives. A datagram whose first fragment
//! takes a fast path while the later ones go to the stack never arrives:
//! the stack waits for a first fragment that went elsewhere.
//!
//! An 8 KB UDP datagram and its 8 KB answer, over 1500-byte hops (the pods
//! and `peer` run an MTU of 1500 here, `inet` and `onprem` always do), sent
//! without "don't fragment" so the path fragments them: pod to `inet`
//! (SNAT), pod to `peer` (the VPC), pod to pod, and `onprem` to a pod. Each
//! must come back whole, through the iptables reference and through vpcnet.

use std::{net::SocketAddrV4, time::Duration};

use vpcnet_bpf_tests::{
    agent_binary,
    bulk::{UdpEcho, UdpOutcome, udp_exchange},
    differential::lab_drops,
    lab_counter,
};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{Lab, LabOptions, addrs, exec_ok, serial};

/// The datagram, and its answer.
const SIZE: usize = 8192;
/// The MTU of the hops the datagrams cross.
const MTU: &str = "1500";
const PORT: u16 = 7007;
/// An answer that comes takes milliseconds.
const TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Case {
    PodToInet,
    PodToPeer,
    PodToPod,
    OnpremToPod,
}

impl Case {
    const ALL: [Self; 4] = [
        Self::PodToInet,
        Self::PodToPeer,
        Self::PodToPod,
        Self::OnpremToPod,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::PodToInet => "pod-0 -> inet (SNAT)",
            Self::PodToPeer => "pod-0 -> peer (VPC)",
            Self::PodToPod => "pod-0 -> pod-1",
            Self::OnpremToPod => "onprem -> pod-0",
        }
    }

    /// The client's namespace and the server's namespace and address.
    fn ends(self, lab: &Lab) -> (String, String, SocketAddrV4) {
        let pod = |i: usize| (lab.pod(i).netns.clone(), lab.pod(i).addr);
        let (client, (server_ns, server_addr)) = match self {
            Self::PodToInet => (pod(0).0, (addrs::NS_INET.to_owned(), addrs::INET_ADDR)),
            Self::PodToPeer => (pod(0).0, (addrs::NS_PEER.to_owned(), addrs::PEER_ADDR)),
            Self::PodToPod => (pod(0).0, pod(1)),
            Self::OnpremToPod => (addrs::NS_ONPREM.to_owned(), pod(0)),
        };
        (client, server_ns, SocketAddrV4::new(server_addr, PORT))
    }
}

/// Sets the MTU of both ends of a veth.
fn set_mtu(ns: &str, link: &str, peer_ns: &str, peer_link: &str) {
    for (ns, link) in [(ns, link), (peer_ns, peer_link)] {
        exec_ok(ns, &["ip", "link", "set", link, "mtu", MTU])
            .unwrap_or_else(|e| panic!("MTU of {link} in {ns}: {e}"));
    }
}

fn run(options: &LabOptions) -> Vec<(Case, UdpOutcome)> {
    let lab = Lab::up(options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    for index in 0..2 {
        let pod = lab.pod(index);
        set_mtu(&pod.netns, "eth0", addrs::NS_NODE, &pod.host_veth);
    }
    set_mtu(addrs::NS_PEER, "eth0", addrs::NS_VPC, addrs::VPC_PEER_LINK);
    let outcomes = Case::ALL
        .into_iter()
        .map(|case| {
            let (client, server_ns, server) = case.ends(&lab);
            let _echo = UdpEcho::start(&server_ns, server);
            (case, udp_exchange(&client, server, SIZE, TIMEOUT))
        })
        .collect();
    if options.datapath == vpcnet_lab::Datapath::Ebpf {
        // The datagrams were fragments where vpcnet saw them, both ways.
        let pod = lab_counter(Counter::PodFragment);
        let eni = lab_counter(Counter::IngressFragment);
        println!("vpcnet: later fragments from pods {pod}, from ENIs {eni}");
        assert!(
            pod > 0 && eni > 0,
            "no fragments seen: the test tests nothing"
        );
        assert_eq!(lab_drops(), Vec::<String>::new(), "vpcnet dropped packets");
    }
    drop(lab);
    outcomes
}

#[test]
fn every_fragment_follows_its_first_in_both_datapaths() {
    let _lab_slot = serial();
    let reference = run(&LabOptions::iptables(2));
    let ebpf = run(&LabOptions::ebpf(2, agent_binary()));
    println!("{SIZE}-byte UDP datagram and answer over {MTU}-byte hops, node conntrack active:");
    println!("{:<24} {:<12} {:<12}", "case", "iptables", "vpcnet");
    for ((case, iptables), (_, vpcnet)) in reference.iter().zip(&ebpf) {
        println!(
            "{:<24} {:<12} {:<12}",
            case.name(),
            format!("{iptables:?}"),
            format!("{vpcnet:?}")
        );
    }
    let not_whole: Vec<String> = reference
        .iter()
        .map(|(case, outcome)| ("iptables", case, outcome))
        .chain(ebpf.iter().map(|(case, outcome)| ("vpcnet", case, outcome)))
        .filter(|(_, _, outcome)| **outcome != UdpOutcome::Whole)
        .map(|(datapath, case, outcome)| format!("{datapath}: {}: {outcome:?}", case.name()))
        .collect();
    assert!(
        not_whole.is_empty(),
        "datagrams not delivered whole:\n{}",
        not_whole.join("\n")
    );
}
