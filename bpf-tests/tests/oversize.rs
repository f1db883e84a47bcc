//! Packets bigger than the link they would leave by. The primary ENI's link
//! runs 1500 bytes here (both ends of the node's `eth0`), the pod 9001, and
//! `inet` 9001 behind a router that carries 9001: the node is the one hop
//! too small, so the node must say so, as its stack does through the
//! iptables reference.
//!
//! In both datapaths, from the pod to `inet`:
//! - a 4000-byte UDP datagram with "don't fragment": the pod's socket fails
//!   with `EMSGSIZE`, told "fragmentation needed" with an MTU of 1500, and
//!   knows a path MTU of 1500;
//! - the same datagram without it: the node fragments it, and the echo
//!   comes back whole;
//! - a TCP upload: `inet` offers a 9001-byte MSS, so the upload completes
//!   only if the pod learns the path MTU. The node's `eth0` has its
//!   segmentation offloads off, as a real ENI's wire takes frames of the
//!   segment size it is given: a veth with them on carries a GSO packet
//!   past its MTU whole, which is how bulk TCP crossed before vpcnet
//!   checked sizes.
//!
//! And into a pod whose MTU is 1500 (`pod-1`, as `POD_MTU` makes it), a
//! 4000-byte datagram with "don't fragment" from `pod-0` and from `peer` (a
//! VPC host at 9001) is never lost: the stack tells each sender
//! "fragmentation needed", vpcnet delivers it whole (a pod's receive path
//! takes any size).

use std::{net::SocketAddrV4, time::Duration};

use vpcnet_bpf_tests::{
    agent_binary,
    bulk::{TcpSink, UdpEcho, UdpOutcome, tcp_upload, udp_exchange},
    differential::{self, lab_drops},
    lab_counter,
};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    Datapath, Lab, LabOptions, addrs, exec_ok,
    probe::{DontFragmentOutcome, udp_dont_fragment},
    serial,
};

/// The primary ENI's MTU here.
const ENI_MTU: u32 = 1500;
/// Bigger than the ENI takes, smaller than the pod's MTU.
const DATAGRAM: usize = 4000;
const ECHO_PORT: u16 = 7090;
const SINK_PORT: u16 = 7091;
/// The upload: enough segments that a black-holed path cannot hide.
const UPLOAD_BYTES: usize = 4 << 20;
/// How long one write may block before the upload counts as stalled.
const STALL: Duration = Duration::from_secs(5);
/// An answer or an ICMP error that comes takes milliseconds.
const TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcomes {
    dont_fragment: DontFragmentOutcome,
    fragmentable: UdpOutcome,
    upload: Result<u64, String>,
    pod_to_small_pod: DontFragmentOutcome,
    peer_to_small_pod: DontFragmentOutcome,
}

fn set_mtu(ns: &str, link: &str, mtu: u32) {
    vpcnet_lab::set_mtu(ns, link, mtu).unwrap_or_else(|e| panic!("MTU of {link} in {ns}: {e}"));
}

/// The node's primary ENI at [`ENI_MTU`], without segmentation offloads;
/// `inet` and the router's link to it at 9001. The lab's namespaces go
/// with the lab: nothing to put back.
fn shape_links() {
    set_mtu(addrs::NS_NODE, "eth0", ENI_MTU);
    set_mtu(addrs::NS_VPC, addrs::VPC_NODE_ETH0_LINK, ENI_MTU);
    exec_ok(
        addrs::NS_NODE,
        &["ethtool", "-K", "eth0", "tso", "off", "gso", "off"],
    )
    .unwrap_or_else(|e| panic!("offloads of the node's eth0: {e}"));
    set_mtu(addrs::NS_INET, "eth0", addrs::VPC_MTU);
    set_mtu(addrs::NS_VPC, addrs::VPC_IGW_LINK, addrs::VPC_MTU);
}

/// Flushes the path MTUs namespace `ns` learned.
fn forget_path_mtus(ns: &str) {
    exec_ok(ns, &["ip", "route", "flush", "cache"])
        .unwrap_or_else(|e| panic!("flushing the route cache in {ns}: {e}"));
}

fn run(options: &LabOptions) -> Outcomes {
    let lab = Lab::up(options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    shape_links();
    let pod = lab.pod(0).netns.clone();
    let echo = UdpEcho::start(
        addrs::NS_INET,
        SocketAddrV4::new(addrs::INET_ADDR, ECHO_PORT),
    );
    // Each case starts from a pod that knows no path MTU: a learned one
    // would make it fragment or segment small itself.
    let dont_fragment = udp_dont_fragment(&pod, echo.addr, DATAGRAM, TIMEOUT)
        .unwrap_or_else(|e| panic!("a datagram with don't fragment: {e}"));
    forget_path_mtus(&pod);
    let fragmentable = udp_exchange(&pod, echo.addr, DATAGRAM, TIMEOUT);
    forget_path_mtus(&pod);
    let sink = TcpSink::start(
        addrs::NS_INET,
        SocketAddrV4::new(addrs::INET_ADDR, SINK_PORT),
    );
    let upload = tcp_upload(&pod, sink.addr, UPLOAD_BYTES, STALL);
    // The primary ENI back at 9001: the node's hop into the pod is the
    // small one now.
    set_mtu(addrs::NS_NODE, "eth0", addrs::VPC_MTU);
    set_mtu(addrs::NS_VPC, addrs::VPC_NODE_ETH0_LINK, addrs::VPC_MTU);
    let small_pod = lab.pod(1);
    set_mtu(&small_pod.netns, "eth0", ENI_MTU);
    set_mtu(addrs::NS_NODE, &small_pod.host_veth, ENI_MTU);
    let small_echo = UdpEcho::start(
        &small_pod.netns,
        SocketAddrV4::new(small_pod.addr, ECHO_PORT),
    );
    let pod_to_small_pod = udp_dont_fragment(&pod, small_echo.addr, DATAGRAM, TIMEOUT)
        .unwrap_or_else(|e| panic!("pod-0 to pod-1 with don't fragment: {e}"));
    let peer_to_small_pod = udp_dont_fragment(addrs::NS_PEER, small_echo.addr, DATAGRAM, TIMEOUT)
        .unwrap_or_else(|e| panic!("peer to pod-1 with don't fragment: {e}"));
    let outcomes = Outcomes {
        dont_fragment,
        fragmentable,
        upload,
        pod_to_small_pod,
        peer_to_small_pod,
    };
    println!("{:?}: {outcomes:?}", options.datapath);
    if options.datapath == Datapath::Ebpf {
        let passed = lab_counter(Counter::ForwardTooBig);
        println!("vpcnet: too big for the ENI, passed to the stack: {passed}");
        assert!(
            passed > 0,
            "no packet was found too big: the test tests nothing"
        );
        assert_eq!(lab_drops(), Vec::<String>::new(), "vpcnet dropped packets");
    }
    drop((echo, sink, small_echo));
    drop(lab);
    outcomes
}

#[test]
fn a_pod_learns_the_path_mtu_of_a_smaller_eni_and_big_packets_still_cross() {
    let _lab_slot = serial();
    let reference = differential::reference_half(|| run(&LabOptions::iptables(2)));
    let ebpf = run(&LabOptions::ebpf(2, agent_binary()));
    println!("pod at 9001 -> inet, the primary ENI at {ENI_MTU}, {DATAGRAM}-byte datagrams:");
    let runs = reference.iter().map(|r| ("iptables", r));
    for (datapath, outcomes) in runs.chain([("vpcnet", &ebpf)]) {
        assert_told_too_big(
            &format!("{datapath}: pod-0 -> inet"),
            outcomes.dont_fragment,
        );
        for (case, outcome) in [
            ("pod-0 -> pod-1", outcomes.pod_to_small_pod),
            ("peer -> pod-1", outcomes.peer_to_small_pod),
        ] {
            match outcome {
                DontFragmentOutcome::Answered => {}
                told => assert_told_too_big(&format!("{datapath}: {case}"), told),
            }
        }
        assert_eq!(
            outcomes.fragmentable,
            UdpOutcome::Whole,
            "{datapath}: the datagram the node may fragment"
        );
        assert_eq!(
            outcomes.upload,
            Ok(UPLOAD_BYTES as u64),
            "{datapath}: the upload over the smaller ENI"
        );
    }
}

/// The sender's socket failed with `EMSGSIZE`, told "fragmentation needed"
/// by a hop of [`ENI_MTU`], and knows that path MTU.
fn assert_told_too_big(what: &str, outcome: DontFragmentOutcome) {
    match outcome {
        DontFragmentOutcome::TooBig { error, path_mtu } => {
            assert!(
                error.is_fragmentation_needed() && error.info == ENI_MTU,
                "{what}: {error:?}"
            );
            assert_eq!(path_mtu, ENI_MTU, "{what}: the sender's path MTU");
        }
        other => panic!("{what}: don't fragment: {other:?}, not EMSGSIZE"),
    }
}
