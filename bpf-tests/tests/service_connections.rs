//! Idle connections through kube-proxy's services live as long as
//! conntrack keeps them (issue 16): a pod's connections through two
//! cluster IPs (one to a pod of the node, one to a host of the VPC) and a
//! VPC client's through a node port stay idle while twice as many newer
//! flows through the node's stack (kubelet-style probes) as the stack flows
//! map holds come and go, then exchange data correctly. Those idle flows'
//! packets must go through the stack to be un-DNATed; a map that forgot
//! them would send them past it, and the pod would reset the connection.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test service_connections -- --test-threads=1 --nocapture`.

use std::{
    io::{BufRead, BufReader, Write},
    net::{Ipv4Addr, SocketAddrV4, TcpStream},
    time::Duration,
};

use vpcnet_bpf_tests::{agent_binary, lab_counter};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    ClusterIpService, Lab, LabOptions, NodePortService, ServiceBackend, WhoamiServer, addrs,
    probe::tcp_whoami_closed, run_in, serial,
};

const PORT: u16 = 8080;
/// Entries of the stack flows map: two per flow, so 256 flows.
const STACK_FLOW_ENTRIES: u16 = 512;
/// Newer flows through the stack: twice the map's capacity in flows.
const PROBES: u16 = STACK_FLOW_ENTRIES;
const TIMEOUT: Duration = Duration::from_secs(3);

const CLIENT_POD: usize = 0;
const SERVICE_POD: usize = 1;
const NODE_PORT_POD: usize = 2;
const TO_POD: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 11), 80);
const TO_PEER: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 10), 80);

/// A connection that says hello, then idles.
struct IdleConnection {
    name: &'static str,
    reader: BufReader<TcpStream>,
}

impl IdleConnection {
    fn open(name: &'static str, ns: &str, server: SocketAddrV4) -> Self {
        let stream = run_in(ns, || TcpStream::connect_timeout(&server.into(), TIMEOUT))
            .expect("entering the namespace")
            .unwrap_or_else(|e| panic!("{name}: connecting from {ns} to {server}: {e}"));
        stream
            .set_read_timeout(Some(TIMEOUT))
            .expect("read timeout");
        let mut reader = BufReader::new(stream);
        let mut whoami = String::new();
        reader
            .read_line(&mut whoami)
            .unwrap_or_else(|e| panic!("{name}: the server's first line: {e}"));
        Self { name, reader }
    }

    /// Sends a line and reads its echo.
    fn exchange(&mut self, line: &str) -> Result<(), String> {
        self.reader
            .get_mut()
            .write_all(format!("{line}\n").as_bytes())
            .map_err(|e| format!("sending: {e}"))?;
        let mut echo = String::new();
        self.reader
            .read_line(&mut echo)
            .map_err(|e| format!("reading the echo: {e} ({:?})", e.kind()))?;
        if echo.trim_end() == line {
            Ok(())
        } else {
            Err(format!("sent {line:?}, got back {echo:?}"))
        }
    }
}

#[test]
fn idle_service_connections_outlive_twice_the_stack_flows_capacity_of_newer_flows() {
    let _lab_slot = serial();
    let options = LabOptions {
        node_port: Some(NodePortService {
            pod: NODE_PORT_POD,
            target_port: PORT,
        }),
        cluster_ips: vec![
            ClusterIpService {
                name: "to-peer".into(),
                addr: TO_PEER,
                backend: ServiceBackend::Remote(SocketAddrV4::new(addrs::PEER_ADDR, PORT)),
            },
            ClusterIpService {
                name: "to-pod".into(),
                addr: TO_POD,
                backend: ServiceBackend::Pod {
                    pod: SERVICE_POD,
                    port: PORT,
                },
            },
        ],
        agent_env: vec![(
            "VPCNET_STACK_FLOW_ENTRIES".into(),
            STACK_FLOW_ENTRIES.to_string(),
        )],
        ..LabOptions::ebpf(3, agent_binary())
    };
    let lab = Lab::up(&options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let pod = |i: usize| lab.pod(i).clone();
    let servers = [
        WhoamiServer::start(addrs::NS_PEER, SocketAddrV4::new(addrs::PEER_ADDR, PORT)),
        WhoamiServer::start(
            &pod(SERVICE_POD).netns,
            SocketAddrV4::new(pod(SERVICE_POD).addr, PORT),
        ),
        WhoamiServer::start(
            &pod(NODE_PORT_POD).netns,
            SocketAddrV4::new(pod(NODE_PORT_POD).addr, PORT),
        ),
    ]
    .map(|server| server.expect("a whoami server"));

    let client = pod(CLIENT_POD).netns;
    let mut idle = [
        IdleConnection::open("ClusterIP to a pod", &client, TO_POD),
        IdleConnection::open("ClusterIP to peer", &client, TO_PEER),
        IdleConnection::open(
            "NodePort from peer",
            addrs::NS_PEER,
            SocketAddrV4::new(addrs::NODE_PRIMARY_ADDR, addrs::NODE_PORT),
        ),
    ];
    for connection in &mut idle {
        let name = connection.name;
        connection
            .exchange("before")
            .unwrap_or_else(|e| panic!("{name}, before the probes: {e}"));
    }

    // Kubelet's probes: a connection from the node to a pod, answered and
    // closed, each a new flow through the stack.
    let probed = SocketAddrV4::new(pod(SERVICE_POD).addr, PORT);
    for i in 0..PROBES {
        tcp_whoami_closed(addrs::NS_NODE, probed, TIMEOUT)
            .unwrap_or_else(|e| panic!("probe {i}: {e}"))
            .unwrap_or_else(|| panic!("probe {i}: no answer"));
    }

    let outcomes: Vec<(&str, Result<(), String>)> = idle
        .iter_mut()
        .map(|connection| (connection.name, connection.exchange("after")))
        .collect();
    for (name, outcome) in &outcomes {
        println!("{name:<20} after {PROBES} probes: {outcome:?}");
    }
    println!(
        "stack flows not remembered for want of room (probes, which need none): {}",
        lab_counter(Counter::StackFlowUntracked)
    );
    for (name, outcome) in outcomes {
        assert_eq!(outcome, Ok(()), "{name}: the idle connection broke");
    }
    drop(servers);
    lab.down().expect("taking the lab down");
}
