//! ICMP errors about a pod's SNATed flows reach the pod on a node as EKS
//! runs it: with kube-proxy's `KUBE-FORWARD` dropping what conntrack calls
//! INVALID. conntrack never saw a flow vpcnet translated past the stack, so
//! an error about it that goes through the stack is INVALID there: path MTU
//! discovery and port-unreachable feedback would break for every SNATed pod.
//!
//! In both datapaths:
//! - a TCP upload from a pod (MTU 9001) to `inet` (MTU 9001 too, so each
//!   side offers a 9001-byte MSS) behind a router hop of MTU 1500, which
//!   answers the pod's big segments with "fragmentation needed": the upload
//!   completes only if the pod learns the path MTU;
//! - UDP to a closed port on `inet`: port unreachable reaches the socket;
//! - UDP that runs out of time to live at the VPC router: time exceeded
//!   reaches the socket.

use std::{net::SocketAddrV4, time::Duration};

use vpcnet_bpf_tests::{
    agent_binary,
    bulk::{TcpSink, tcp_upload},
    differential::{self, lab_drops},
};
use vpcnet_lab::{
    Datapath, Lab, LabOptions, addrs, exec_ok,
    probe::{IcmpErrorReport, udp_icmp_error},
    serial,
};

/// The upload: enough segments that a black-holed path cannot hide.
const UPLOAD_BYTES: usize = 4 << 20;
/// How long one write may block before the upload counts as stalled.
const STALL: Duration = Duration::from_secs(5);
const SINK_PORT: u16 = 7070;
const CLOSED_PORT: u16 = 7071;
const ERROR_TIMEOUT: Duration = Duration::from_secs(2);
/// A datagram with this time to live leaves the node with 1 and dies at
/// the VPC router.
const DYING_TTL: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcomes {
    upload: Result<u64, String>,
    port_unreachable: Option<IcmpErrorReport>,
    time_exceeded: Option<IcmpErrorReport>,
}

/// `inet` behind a 1500-byte hop: its own link at 9001, the router's route
/// to it locked at 1500.
fn put_inet_behind_a_small_hop() {
    for (ns, link) in [
        (addrs::NS_INET, "eth0"),
        (addrs::NS_VPC, addrs::VPC_IGW_LINK),
    ] {
        vpcnet_lab::set_mtu(ns, link, 9001)
            .unwrap_or_else(|e| panic!("MTU of {link} in {ns}: {e}"));
    }
    let inet = format!("{}/32", addrs::INET_ADDR);
    exec_ok(
        addrs::NS_VPC,
        &[
            "ip",
            "route",
            "replace",
            &inet,
            "dev",
            addrs::VPC_IGW_LINK,
            "mtu",
            "lock",
            "1500",
        ],
    )
    .unwrap_or_else(|e| panic!("the 1500-byte hop: {e}"));
}

fn run(options: &LabOptions) -> Outcomes {
    let lab = Lab::up(options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    put_inet_behind_a_small_hop();
    let pod = lab.pod(0).netns.clone();
    let sink = TcpSink::start(
        addrs::NS_INET,
        SocketAddrV4::new(addrs::INET_ADDR, SINK_PORT),
    );
    let upload = tcp_upload(&pod, sink.addr, UPLOAD_BYTES, STALL);
    let closed = SocketAddrV4::new(addrs::INET_ADDR, CLOSED_PORT);
    let port_unreachable = udp_icmp_error(&pod, closed, None, ERROR_TIMEOUT)
        .unwrap_or_else(|e| panic!("UDP to a closed port: {e}"));
    let time_exceeded = udp_icmp_error(&pod, closed, Some(DYING_TTL), ERROR_TIMEOUT)
        .unwrap_or_else(|e| panic!("UDP with TTL {DYING_TTL}: {e}"));
    if options.datapath == Datapath::Ebpf {
        println!("vpcnet drop counters: {:?}", lab_drops());
    }
    drop(sink);
    drop(lab);
    Outcomes {
        upload,
        port_unreachable,
        time_exceeded,
    }
}

#[test]
fn icmp_errors_about_snated_flows_reach_the_pod_past_kube_proxys_invalid_drop() {
    let _lab_slot = serial();
    let reference = differential::reference_half(|| run(&LabOptions::iptables(1)));
    let ebpf = run(&LabOptions::ebpf(1, agent_binary()));
    println!("ICMP errors for a SNATed pod, node conntrack and KUBE-FORWARD's INVALID drop on:");
    if let Some(reference) = &reference {
        println!("iptables: {reference:?}");
    }
    println!("vpcnet:   {ebpf:?}");
    let runs = reference.iter().map(|r| ("iptables", r));
    for (datapath, outcomes) in runs.chain([("vpcnet", &ebpf)]) {
        assert_eq!(
            outcomes.upload,
            Ok(UPLOAD_BYTES as u64),
            "{datapath}: the upload over the 1500-byte hop"
        );
        let unreachable = outcomes
            .port_unreachable
            .unwrap_or_else(|| panic!("{datapath}: no port unreachable reached the pod"));
        assert!(
            unreachable.is_port_unreachable(),
            "{datapath}: {unreachable:?}"
        );
        assert_eq!(unreachable.from, addrs::INET_ADDR, "{datapath}");
        let exceeded = outcomes
            .time_exceeded
            .unwrap_or_else(|| panic!("{datapath}: no time exceeded reached the pod"));
        assert!(exceeded.is_time_exceeded(), "{datapath}: {exceeded:?}");
        // The VPC router, on the node's side, is where the time ran out.
        assert_eq!(
            exceeded.from,
            addrs::NODE_SUBNET_GW,
            "{datapath}: the router that said time exceeded"
        );
    }
}
