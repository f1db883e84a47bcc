//! Idle connections through kube-proxy's services live as long as
//! conntrack keeps them (issue 16): a pod's connections through two
//! cluster IPs (one to a pod of the node, one to a host of the VPC) and a
//! VPC client's through a node port stay idle while twice as many newer
//! flows through the node's stack (kubelet-style probes) as the stack flows
//! map holds come and go, then exchange data correctly, the backend
//! speaking first. Its packets must go through the stack to be un-DNATed;
//! a map that forgot the flow would send them past it, and the client
//! would reset the connection. (A client speaking first would teach the
//! map the flow again on its way through the stack.)
//!
//! A SYN flood from outside the VPC at the node port never stops a pod's
//! service connections either, whatever its size: four times what the
//! stack flows map holds fills it, and the flood going on meanwhile (a
//! map's worth of new flows before each step, for as long as it takes)
//! neither stops the established connections nor keeps new ones out. The flood's flows, never answered, make room for new ones
//! (conntrack's early drop), as they do in the iptables reference's
//! conntrack.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test service_connections -- --test-threads=1 --nocapture`.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use vpcnet_bpf_tests::{
    agent_binary, differential,
    flood::{
        OngoingFlood, RawSender, drop_answers_on_prem, stack_flow_entries, syn_flood_watching,
        while_flooding,
    },
    idle::{IdleConnection, listen},
    lab_counter,
};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    ClusterIpService, Datapath, Lab, LabOptions, NodePortService, ServiceBackend, WhoamiServer,
    addrs, probe::tcp_whoami_closed, serial,
};

const PORT: u16 = 8080;
const PROBE_PORT: u16 = 8081;
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

/// The lab's services (two cluster IPs, a node port) on `base`'s node,
/// with a stack flows map of [`STACK_FLOW_ENTRIES`].
fn with_services(base: LabOptions) -> LabOptions {
    LabOptions {
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
        ..base
    }
}

#[test]
fn idle_service_connections_outlive_twice_the_stack_flows_capacity_of_newer_flows() {
    let _lab_slot = serial();
    let options = with_services(LabOptions::ebpf(3, agent_binary()));
    let lab = Lab::up(&options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let pod = |i: usize| lab.pod(i).clone();
    let backend = |ns: &str, addr| listen(ns, SocketAddrV4::new(addr, PORT));
    let (to_pod, to_peer, node_port) = (
        backend(&pod(SERVICE_POD).netns, pod(SERVICE_POD).addr),
        backend(addrs::NS_PEER, addrs::PEER_ADDR),
        backend(&pod(NODE_PORT_POD).netns, pod(NODE_PORT_POD).addr),
    );
    let client = pod(CLIENT_POD).netns;
    let mut idle = [
        IdleConnection::open("ClusterIP to a pod", &client, TO_POD, &to_pod),
        IdleConnection::open("ClusterIP to peer", &client, TO_PEER, &to_peer),
        IdleConnection::open(
            "NodePort from peer",
            addrs::NS_PEER,
            SocketAddrV4::new(addrs::NODE_PRIMARY_ADDR, addrs::NODE_PORT),
            &node_port,
        ),
    ];
    for connection in &mut idle {
        let name = connection.name;
        connection
            .exchange("before")
            .unwrap_or_else(|e| panic!("{name}, before the probes: {e}"));
    }
    // The probes' server.
    let probed = SocketAddrV4::new(pod(SERVICE_POD).addr, PROBE_PORT);
    let _prober = WhoamiServer::start(&pod(SERVICE_POD).netns, probed).expect("a whoami server");

    // Kubelet's probes: a connection from the node to a pod, answered and
    // closed, each a new flow through the stack.
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
        "packets of stack flows not remembered for want of room (the probes', which need none): {}",
        lab_counter(Counter::StackFlowUntracked)
    );
    for (name, outcome) in outcomes {
        assert_eq!(outcome, Ok(()), "{name}: the idle connection broke");
    }
    drop(idle);
    lab.down().expect("taking the lab down");
}

/// SYNs of the flood: four times the flows the stack flows map holds.
const FLOOD: u16 = 2 * STACK_FLOW_ENTRIES;
/// Source ports of the flood (none of them a socket of the flooding host).
const FLOOD_PORTS: u16 = 20000;
/// Source ports of the flood that goes on while the connections are
/// used: none of the first flood's, so each of its SYNs is a new flow.
const ONGOING_PORTS: u16 = FLOOD_PORTS + FLOOD;
/// SYNs a second of the ongoing flood: the map's flows five times over
/// each second.
const ONGOING_PER_SECOND: u32 = 5 * STACK_FLOW_ENTRIES as u32;
/// The longest the ongoing flood lasts if nothing stops it.
const ONGOING_LONGEST: Duration = Duration::from_secs(30);

#[test]
fn a_syn_flood_at_the_node_port_never_keeps_service_connections_out() {
    let _lab_slot = serial();
    let reference =
        differential::reference_half(|| flooded(&with_services(LabOptions::iptables(3))));
    let vpcnet = flooded(&with_services(LabOptions::ebpf(3, agent_binary())));
    let runs = reference.iter().map(|r| ("iptables", r));
    let runs: Vec<_> = runs.chain([("vpcnet", &vpcnet)]).collect();
    for (datapath, outcomes) in &runs {
        for (name, outcome) in *outcomes {
            println!("{datapath:<8} {name:<36} {outcome:?}");
        }
    }
    for (datapath, outcomes) in runs {
        for (name, outcome) in outcomes {
            assert_eq!(*outcome, Ok(()), "{datapath}: {name}");
        }
    }
}

/// Brings up `options`' node, opens a connection through each service,
/// floods the node port from on-prem with SYNs whose answers on-prem
/// drops (as a spoofed flood's are never acknowledged) until its map is
/// full, then, the flood going on, exchanges on the established
/// connections and opens new ones through each service.
fn flooded(options: &LabOptions) -> Vec<(String, Result<(), String>)> {
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let lab = Lab::up(options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let pod = |i: usize| lab.pod(i).clone();
    let backend = |ns: &str, addr| listen(ns, SocketAddrV4::new(addr, PORT));
    let backends = [
        backend(&pod(SERVICE_POD).netns, pod(SERVICE_POD).addr),
        backend(addrs::NS_PEER, addrs::PEER_ADDR),
        backend(&pod(NODE_PORT_POD).netns, pod(NODE_PORT_POD).addr),
    ];
    let client = pod(CLIENT_POD).netns;
    let node_port = SocketAddrV4::new(addrs::NODE_PRIMARY_ADDR, addrs::NODE_PORT);
    let services: [(&'static str, &str, SocketAddrV4); 3] = [
        ("ClusterIP to a pod", &client, TO_POD),
        ("ClusterIP to peer", &client, TO_PEER),
        ("NodePort from peer", addrs::NS_PEER, node_port),
    ];
    let mut established: Vec<IdleConnection> = services
        .iter()
        .zip(&backends)
        .map(|((name, ns, to), backend)| IdleConnection::open(name, ns, *to, backend))
        .collect();
    drop_answers_on_prem(addrs::NODE_PORT, FLOOD_PORTS..ONGOING_PORTS + FLOOD)
        .expect("on-prem drops the flood's answers");
    let sender = RawSender::open(addrs::NS_ONPREM).expect("a raw socket on-prem");
    let entries: fn() -> anyhow::Result<usize> = match options.datapath {
        Datapath::Ebpf => stack_flow_entries,
        _ => || Ok(0),
    };
    let report = syn_flood_watching(
        &sender,
        addrs::ONPREM_ADDR,
        FLOOD_PORTS..FLOOD_PORTS + FLOOD,
        node_port,
        None,
        entries,
    )
    .expect("the flood");
    let mut outcomes = Vec::new();
    if options.datapath == Datapath::Ebpf {
        println!(
            "{FLOOD} SYNs at the node port in {:.1} s: the stack flows map ({STACK_FLOW_ENTRIES} entries) held at most {}; early drops {}, flows not remembered {}",
            report.elapsed.as_secs_f64(),
            report.max_flows,
            lab_counter(Counter::StackFlowEarlyDrop),
            lab_counter(Counter::StackFlowUntracked),
        );
        outcomes.push((
            "the flood's flows made room".to_owned(),
            made_room(lab_counter(Counter::StackFlowEarlyDrop)),
        ));
    }
    let ebpf = options.datapath == Datapath::Ebpf;
    let early_drops_before = ebpf.then(|| lab_counter(Counter::StackFlowEarlyDrop));
    let ongoing_flood = OngoingFlood {
        source_addr: addrs::ONPREM_ADDR,
        ports: ONGOING_PORTS..ONGOING_PORTS + FLOOD,
        destination: node_port,
        per_second: ONGOING_PER_SECOND,
        longest: ONGOING_LONGEST,
    };
    // Each step waits for a map's worth of new flows: every entry there
    // was replaced since the step before.
    let maps_worth = usize::from(STACK_FLOW_ENTRIES);
    let ongoing = while_flooding(&sender, &ongoing_flood, maps_worth, |another_maps_worth| {
        another_maps_worth();
        for connection in &mut established {
            outcomes.push((
                format!("{}, established before", connection.name),
                connection.exchange("in the flood"),
            ));
        }
        another_maps_worth();
        for ((name, ns, to), backend) in services.iter().zip(&backends) {
            let mut fresh = IdleConnection::open(name, ns, *to, backend);
            outcomes.push((format!("{name}, new"), fresh.exchange("new")));
        }
        another_maps_worth();
    })
    .expect("the ongoing flood");
    println!(
        "{} more SYNs at the node port in {:.1} s while the connections were used",
        ongoing.sent,
        ongoing.elapsed.as_secs_f64()
    );
    outcomes.push((
        "the flood went on throughout".to_owned(),
        (ongoing.elapsed < ONGOING_LONGEST && ongoing.sent >= 3 * maps_worth)
            .then_some(())
            .ok_or_else(|| format!("{ongoing:?}")),
    ));
    if let Some(before) = early_drops_before {
        let early_drops = lab_counter(Counter::StackFlowEarlyDrop) - before;
        println!("early drops meanwhile {early_drops}");
        outcomes.push((
            "the ongoing flood's flows made room".to_owned(),
            made_room(early_drops),
        ));
    }
    drop(established);
    lab.down().expect("taking the lab down");
    outcomes
}

/// Whether `early_drops` flows of a flood gave way to newer ones.
fn made_room(early_drops: u64) -> Result<(), String> {
    (early_drops > 0)
        .then_some(())
        .ok_or_else(|| "no early drop".to_owned())
}
