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
//!
//! And fragments out of order, cut and sent by hand (a raw socket): a SNAT
//! answer from `inet` and a datagram from `onprem` to a pod, last fragment
//! first, and the same with overlapping fragments. Each must arrive, or
//! not, as it does through the iptables reference.

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket},
    time::Duration,
};

use vpcnet_bpf_tests::{
    agent_binary,
    bulk::{UdpEcho, UdpOutcome, udp_exchange},
    differential::{self, Row, lab_drops},
    lab_counter,
};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    Lab, LabOptions, NetnsThread, addrs,
    probe::{FragmentOrder, send_udp_fragments},
    run_in, serial, spawn_in,
};

/// The datagram, and its answer.
const SIZE: usize = 8192;
/// The MTU of the hops the datagrams cross.
const MTU: u32 = 1500;
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
        vpcnet_lab::set_mtu(ns, link, MTU).unwrap_or_else(|e| panic!("MTU of {link} in {ns}: {e}"));
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
    let reference = differential::reference_half(|| run(&LabOptions::iptables(2)));
    let ebpf = run(&LabOptions::ebpf(2, agent_binary()));
    differential::show_and_assert(
        &format!(
            "{SIZE}-byte UDP datagram and answer over {MTU}-byte hops, node conntrack active:"
        ),
        reference.as_deref(),
        &ebpf,
    );
}

impl Row for Case {
    type Outcome = UdpOutcome;
    const COLUMNS: &'static [(&'static str, usize)] = &[("case", 24)];
    const OUTCOME_WIDTH: usize = 20;

    fn cells(&self) -> Vec<String> {
        vec![self.name().to_owned()]
    }

    fn describe(&self, outcome: &UdpOutcome) -> String {
        format!("{outcome:?}")
    }

    /// Every datagram and its answer arrive whole.
    fn expected(&self) -> UdpOutcome {
        UdpOutcome::Whole
    }
}

/// A datagram whose fragments come in another order than they were cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reordered {
    /// `inet` answers a pod's query (a SNAT reply, to the node's address).
    InetAnswer(FragmentOrder),
    /// `onprem` sends to a pod's address, which echoes it back.
    OnpremToPod(FragmentOrder),
}

impl Reordered {
    const ALL: [Self; 4] = [
        Self::InetAnswer(FragmentOrder::Reversed),
        Self::InetAnswer(FragmentOrder::ReversedOverlapping),
        Self::OnpremToPod(FragmentOrder::Reversed),
        Self::OnpremToPod(FragmentOrder::ReversedOverlapping),
    ];

    fn name(self) -> String {
        match self {
            Self::InetAnswer(order) => format!("inet -> pod-0 (SNAT) {order:?}"),
            Self::OnpremToPod(order) => format!("onprem -> pod-1 {order:?}"),
        }
    }
}

impl Row for Reordered {
    type Outcome = UdpOutcome;
    const COLUMNS: &'static [(&'static str, usize)] = &[("case", 44)];
    const OUTCOME_WIDTH: usize = 20;

    fn cells(&self) -> Vec<String> {
        vec![self.name()]
    }

    fn describe(&self, outcome: &UdpOutcome) -> String {
        format!("{outcome:?}")
    }

    /// What the node's stack makes of it, reassembling: whole fragments
    /// give the datagram, overlapping ones make the kernel discard it.
    fn expected(&self) -> UdpOutcome {
        let (Self::InetAnswer(order) | Self::OnpremToPod(order)) = self;
        match order {
            FragmentOrder::InOrder | FragmentOrder::Reversed => UdpOutcome::Whole,
            FragmentOrder::ReversedOverlapping => UdpOutcome::Lost,
        }
    }
}

/// The datagrams sent out of order, and the fragments' size (a multiple
/// of 8 that fits 1500-byte hops).
const REORDERED_SIZE: usize = 4000;
const REORDERED_FRAGMENT: usize = 1480;
const REORDERED_PORT: u16 = 7008;

/// `inet` waits for one query on `addr` and answers its sender with
/// `payload`, cut into fragments sent in `order`.
fn answer_in_fragments(
    addr: SocketAddrV4,
    payload: Vec<u8>,
    order: FragmentOrder,
) -> NetnsThread<Result<(), String>> {
    let socket = run_in(addrs::NS_INET, || UdpSocket::bind(addr))
        .expect("entering inet")
        .unwrap_or_else(|e| panic!("UDP bind to {addr} in inet: {e}"));
    socket
        .set_read_timeout(Some(TIMEOUT))
        .expect("read timeout");
    spawn_in(addrs::NS_INET, move || {
        let mut query = [0u8; 64];
        let (_, from) = socket
            .recv_from(&mut query)
            .map_err(|e| format!("no query on {addr}: {e}"))?;
        let SocketAddr::V4(from) = from else {
            return Err(format!("a query from {from}"));
        };
        send_udp_fragments(
            addrs::NS_INET,
            addr,
            from,
            &payload,
            REORDERED_FRAGMENT,
            order,
            fastrand::u16(1..),
        )
        .map_err(|e| format!("fragments to {from}: {e}"))
    })
    .expect("a thread in inet")
}

fn reordered_exchange(lab: &Lab, case: Reordered, payload: &[u8]) -> UdpOutcome {
    match case {
        Reordered::InetAnswer(order) => {
            let server = SocketAddrV4::new(addrs::INET_ADDR, REORDERED_PORT);
            let answering = answer_in_fragments(server, payload.to_vec(), order);
            let pod = lab.pod(0).netns.clone();
            let outcome = run_in(&pod, || -> std::io::Result<UdpOutcome> {
                let socket = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
                socket.connect(server)?;
                socket.set_read_timeout(Some(TIMEOUT))?;
                socket.send(b"fragments, please")?;
                Ok(received(&socket, payload))
            })
            .expect("entering the pod")
            .unwrap_or_else(|e| panic!("UDP from the pod to {server}: {e}"));
            answering
                .join()
                .expect("the answering thread")
                .unwrap_or_else(|e| panic!("inet's answer: {e}"));
            outcome
        }
        Reordered::OnpremToPod(order) => {
            let pod = lab.pod(1);
            let echo = UdpEcho::start(&pod.netns, SocketAddrV4::new(pod.addr, REORDERED_PORT));
            let client = SocketAddrV4::new(addrs::ONPREM_ADDR, REORDERED_PORT);
            let socket = run_in(addrs::NS_ONPREM, || UdpSocket::bind(client))
                .expect("entering onprem")
                .unwrap_or_else(|e| panic!("UDP bind to {client} in onprem: {e}"));
            socket.connect(echo.addr).expect("connect to the echo");
            socket
                .set_read_timeout(Some(TIMEOUT))
                .expect("read timeout");
            send_udp_fragments(
                addrs::NS_ONPREM,
                client,
                echo.addr,
                payload,
                REORDERED_FRAGMENT,
                order,
                fastrand::u16(1..),
            )
            .unwrap_or_else(|e| panic!("fragments from onprem: {e}"));
            received(&socket, payload)
        }
    }
}

/// What the connected `socket` receives next, against `payload`.
fn received(socket: &UdpSocket, payload: &[u8]) -> UdpOutcome {
    let mut buf = vec![0u8; payload.len() + 1];
    match socket.recv(&mut buf) {
        Ok(len) if buf[..len] == *payload => UdpOutcome::Whole,
        Ok(len) => UdpOutcome::Damaged(len),
        Err(_) => UdpOutcome::Lost,
    }
}

fn run_reordered(options: &LabOptions) -> Vec<(Reordered, UdpOutcome)> {
    let lab = Lab::up(options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    #[allow(clippy::cast_possible_truncation)] // a pattern, wrapping on purpose
    let payload: Vec<u8> = (0..REORDERED_SIZE).map(|i| (i * 11 + 5) as u8).collect();
    let outcomes = Reordered::ALL
        .into_iter()
        .map(|case| (case, reordered_exchange(&lab, case, &payload)))
        .collect();
    if options.datapath == vpcnet_lab::Datapath::Ebpf {
        // Each datagram went round through the stack's reassembly.
        let reordered = lab_counter(Counter::IngressFragmentReordered);
        let returned = lab_counter(Counter::EgressReassembled);
        println!("vpcnet: fragments before their first {reordered}, returned in order {returned}");
        assert!(
            reordered > 0 && returned > 0,
            "no datagram went through reassembly: the test tests nothing"
        );
        assert_eq!(lab_drops(), Vec::<String>::new(), "vpcnet dropped packets");
    }
    drop(lab);
    outcomes
}

/// A datagram whose first fragment comes last is the stack's to reassemble
/// (it holds every later fragment until the first comes): through vpcnet
/// it must arrive, or not, as through the iptables reference. Overlapping
/// fragments make the kernel discard a datagram; whole ones arrive.
#[test]
fn fragments_in_any_order_arrive_as_through_the_iptables_reference() {
    let _lab_slot = serial();
    let reference = differential::reference_half(|| run_reordered(&LabOptions::iptables(2)));
    let ebpf = run_reordered(&LabOptions::ebpf(2, agent_binary()));
    differential::show_and_assert(
        &format!(
            "{REORDERED_SIZE}-byte UDP datagram in {REORDERED_FRAGMENT}-byte fragments, node conntrack active:"
        ),
        reference.as_deref(),
        &ebpf,
    );
}
