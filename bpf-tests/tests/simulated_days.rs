//! Three simulated days of a node's life (issue 16): kubelet's probes,
//! idle connections through kube-proxy's services, from on-prem and to the
//! internet, SNAT churn, EXTERNALSNAT flipped on and off twice a day with a
//! pod retrying a black-holed endpoint meanwhile, port scans from on-prem,
//! and an agent restart a day (SIGKILL and SIGTERM in turn).
//!
//! The clock: a simulated day lasts a minute (`VPCNET_SIMULATED_DAY_SECS`),
//! and the node's conntrack timeouts are shortened alike with sysctl, as an
//! operator would set them: kube-proxy's established timeout (a day) becomes
//! a minute, every short one its floor of 2 s. The datapath follows the
//! node's settings, so its flows age as the node's conntrack ones do.
//!
//! What a user would check: every probe, exchange and churned connection
//! works and is translated as it should be; the idle connections, used
//! every 20 simulated hours, live (an idle one used never is collected
//! after its day); a UDP stream keeps its SNAT port throughout; the tables
//! stay far below their size and drain back to the long-lived flows once
//! the churn stops; no packet is dropped that the test cannot explain (the
//! datapath's drop counters, kube-proxy's INVALID drop, the VPC router's).
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test simulated_days -- --test-threads=1 --nocapture`
//! (`VPCNET_SIMULATED_DAYS=7` for a week).

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_bpf_tests::{
    agent_binary, agent_cli,
    echo::EchoStream,
    flood::{RawSender, nat_flows, stack_flow_entries, stack_flow_lines, wait_for_timeouts},
    idle::{IdleConnection, listen},
};
use vpcnet_common::{
    addr_to_raw,
    counters::Counter,
    maps,
    nat::{FlowKey, PROTO_TCP, Timeouts},
    port_to_raw,
};
use vpcnet_lab::{
    ClusterIpService, Lab, LabOptions, NodePortService, ServiceBackend, WhoamiServer, addrs,
    kube_proxy,
    netns::{get_sysctl, set_sysctls},
    probe::tcp_whoami_closed,
    serial, test_sizes, udp_whoami,
};

const SECONDS_PER_DAY: u32 = 86_400;
const HOURS_PER_DAY: u32 = 24;
/// A simulated day's length in real seconds, unless the environment says.
const DEFAULT_DAY_SECS: u32 = 60;
const DEFAULT_DAYS: u32 = 3;
/// The shortest timeout the scaled clock gives a state: twice the
/// collector's interval.
const MIN_TIMEOUT_SECS: u32 = 2;
/// The collector's interval, in seconds.
const GC_INTERVAL_SECS: u32 = 1;
/// Small enough that a leak of a few flows an hour would fill it in a day.
const NAT_ENTRIES: usize = 4096;

/// The whoami servers' port (probes, churn, the echo stream).
const PORT: u16 = 8080;
/// The idle connections' backends.
const IDLE_PORT: u16 = 8090;
const TO_POD: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 11), 80);

const CLIENT_POD: usize = 0;
const SERVICE_POD: usize = 1;
const NODE_PORT_POD: usize = 2;
const STREAM_POD: usize = 3;
const PODS: usize = 4;

/// Simulated hours between two uses of an idle connection: less than a
/// day, kube-proxy's established timeout.
const IDLE_HOURS: u32 = 20;
const RESTART_HOUR: u32 = 6;
const EXTERNAL_SNAT_ON_HOUR: u32 = 9;
const EXTERNAL_SNAT_OFF_HOUR: u32 = 15;
/// Each simulated hour: connections and datagrams per pod and
/// destination, probes per pod, scan and black-holed SYNs.
const CHURN_PER_POD: usize = 2;
const PROBES_PER_POD: usize = 2;
const SCAN_SYNS: u16 = 16;
const BLACK_HOLED_SYNS: u16 = 16;
/// Ports the on-prem scan walks through, around the pods' whoami port.
const SCANNED_PORTS: std::ops::Range<u16> = PORT - 8..PORT + 8;
const SCAN_SOURCE_PORTS: u16 = 30_000;
const BLACK_HOLED_SOURCE_PORTS: u16 = 20_000;
/// The UDP stream's pace: four datagrams within its shortest timeout.
const UDP_STREAM_PACE: Duration = Duration::from_millis(500);
const TIMEOUT: Duration = Duration::from_secs(3);
/// What the tables hold once the churn stops: the idle SNAT and on-prem
/// connections in the NAT table; the two through services as stack flows,
/// a pair each where the stack handed it over (the cluster IP's at both
/// ends, before kube-proxy's DNAT and after it; the node port's after).
const LONG_LIVED_NAT_FLOWS: usize = 2;
const LONG_LIVED_STACK_ENTRIES: usize = 6;
/// How long the tables may take to drain once the churn stops: the short
/// timeouts, a collection, and slack.
const DRAIN_WITHIN: Duration = Duration::from_secs(15);

/// The node's conntrack timeouts divided by `scale` (at least
/// [`MIN_TIMEOUT_SECS`]), set with sysctl; returns them as the datapath
/// must take them.
fn shorten_timeouts(scale: u32) -> Timeouts {
    let mut timeouts = Timeouts::default();
    let mut settings = Vec::new();
    for (name, field) in Timeouts::SYSCTLS {
        let key = format!("net.netfilter.nf_conntrack_{name}");
        let node: u32 = get_sysctl(addrs::NS_NODE, &key)
            .expect("reading the node's conntrack timeouts")
            .parse()
            .expect("a number of seconds");
        let scaled = (node / scale).max(MIN_TIMEOUT_SECS);
        *field(&mut timeouts) = scaled;
        settings.push((key, scaled.to_string()));
    }
    let settings: Vec<(&str, &str)> = settings
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    set_sysctls(addrs::NS_NODE, &settings).expect("setting the node's conntrack timeouts");
    timeouts
}

/// A pod's UDP flow to a whoami server that never idles long: a datagram
/// every [`UDP_STREAM_PACE`] from one socket, each answer's view of its
/// source recorded.
struct UdpStream {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<UdpStreamReport>,
}

#[derive(Debug, Default)]
struct UdpStreamReport {
    sent: u64,
    answered: u64,
    /// The sources the server saw (one, if the flow kept its port).
    seen_as: BTreeSet<SocketAddrV4>,
    first_loss: Option<String>,
}

impl UdpStream {
    fn start(ns: &str, from: Ipv4Addr, server: SocketAddrV4) -> Self {
        let socket = vpcnet_lab::run_in(ns, || UdpSocket::bind(SocketAddrV4::new(from, 0)))
            .expect("entering the pod")
            .expect("a UDP socket in the pod");
        socket.connect(server).expect("connecting the UDP socket");
        socket.set_read_timeout(Some(TIMEOUT)).expect("timeout");
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let stop = Arc::clone(&stop);
            move || {
                let mut report = UdpStreamReport::default();
                let mut buf = [0u8; 128];
                let started = Instant::now();
                while !stop.load(Ordering::Relaxed) {
                    report.sent += 1;
                    let at = started.elapsed();
                    let answer = socket.send(b"whoami\n").and_then(|_| socket.recv(&mut buf));
                    match answer.map(|len| String::from_utf8_lossy(&buf[..len]).trim().parse()) {
                        Ok(Ok(seen)) => {
                            report.answered += 1;
                            report.seen_as.insert(seen);
                        }
                        other => {
                            report
                                .first_loss
                                .get_or_insert_with(|| format!("at {at:?}: {other:?}"));
                        }
                    }
                    // Pacing, not synchronisation: the stream's own rate.
                    thread::sleep(UDP_STREAM_PACE);
                }
                report
            }
        });
        Self { stop, thread }
    }

    fn stop(self) -> UdpStreamReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the UDP stream's thread")
    }
}

/// Where the simulation is, for messages.
#[derive(Clone, Copy)]
struct When {
    hour: u32,
}

impl std::fmt::Display for When {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "day {} hour {:02}",
            self.hour / HOURS_PER_DAY + 1,
            self.hour % HOURS_PER_DAY
        )
    }
}

/// The datapath's counters now.
fn counters() -> Vec<(Counter, u64)> {
    DatapathMaps::open_pinned(Path::new(maps::PIN_DIR))
        .and_then(|maps| maps.counters())
        .expect("reading the datapath's counters")
}

/// Whether the NAT table holds the flow of TCP connection `client` ->
/// `server` (as the pod sent it).
fn nat_table_holds(client: SocketAddrV4, server: SocketAddrV4) -> bool {
    let key = FlowKey::new(
        addr_to_raw(client.ip().octets()),
        addr_to_raw(server.ip().octets()),
        port_to_raw(client.port()),
        port_to_raw(server.port()),
        PROTO_TCP,
    );
    DatapathMaps::open_pinned(Path::new(maps::PIN_DIR))
        .and_then(|maps| maps.flows())
        .expect("reading the NAT table")
        .iter()
        .any(|flow| flow.key == key)
}

/// The whoami servers of the pods and of the hosts outside the node.
struct Servers {
    _all: Vec<WhoamiServer>,
    inet: SocketAddrV4,
    onprem: SocketAddrV4,
    peer: SocketAddrV4,
    pods: Vec<SocketAddrV4>,
}

fn start_servers(lab: &Lab) -> Servers {
    let start = |ns: &str, addr| {
        WhoamiServer::start(ns, SocketAddrV4::new(addr, PORT))
            .unwrap_or_else(|e| panic!("whoami in {ns}: {e}"))
    };
    let mut all = vec![
        start(addrs::NS_INET, addrs::INET_ADDR),
        start(addrs::NS_ONPREM, addrs::ONPREM_ADDR),
        start(addrs::NS_PEER, addrs::PEER_ADDR),
    ];
    let mut pods = Vec::new();
    for i in 0..PODS {
        let pod = lab.pod(i);
        all.push(start(&pod.netns, pod.addr));
        pods.push(SocketAddrV4::new(pod.addr, PORT));
    }
    Servers {
        inet: all[0].addr(),
        onprem: all[1].addr(),
        peer: all[2].addr(),
        pods,
        _all: all,
    }
}

/// A connection from `ns` answered by `server`, seen from `expected_source`.
fn churn_tcp(ns: &str, server: SocketAddrV4, expected_source: Ipv4Addr, when: When) {
    let seen = tcp_whoami_closed(ns, server, TIMEOUT)
        .unwrap_or_else(|e| panic!("{when}: TCP from {ns} to {server}: {e}"))
        .unwrap_or_else(|| panic!("{when}: TCP from {ns} to {server}: no answer"));
    assert_eq!(*seen.ip(), expected_source, "{when}: TCP {ns} -> {server}");
}

fn churn_udp(ns: &str, server: SocketAddrV4, expected_source: Ipv4Addr, when: When) {
    let seen = udp_whoami(ns, server, TIMEOUT)
        .unwrap_or_else(|e| panic!("{when}: UDP from {ns} to {server}: {e}"))
        .unwrap_or_else(|| panic!("{when}: UDP from {ns} to {server}: no answer"));
    assert_eq!(*seen.ip(), expected_source, "{when}: UDP {ns} -> {server}");
}

#[test]
#[allow(clippy::too_many_lines)] // one simulation, hour by hour
fn three_simulated_days_keep_every_flow_until_its_timeout_and_the_tables_bounded() {
    let _lab_slot = serial();
    let day_secs = test_sizes::size_or(test_sizes::SIMULATED_DAY_SECS_VAR, DEFAULT_DAY_SECS);
    let days = test_sizes::size_or(test_sizes::SIMULATED_DAYS_VAR, DEFAULT_DAYS);
    let hour = Duration::from_secs(day_secs.into()) / HOURS_PER_DAY;
    let options = LabOptions {
        node_port: Some(NodePortService {
            pod: NODE_PORT_POD,
            target_port: IDLE_PORT,
        }),
        cluster_ips: vec![ClusterIpService {
            name: "to-pod".into(),
            addr: TO_POD,
            backend: ServiceBackend::Pod {
                pod: SERVICE_POD,
                port: IDLE_PORT,
            },
        }],
        agent_env: vec![
            ("VPCNET_NAT_ENTRIES".into(), NAT_ENTRIES.to_string()),
            ("VPCNET_GC_INTERVAL".into(), GC_INTERVAL_SECS.to_string()),
        ],
        ..LabOptions::ebpf(PODS, agent_binary())
    };
    let mut lab = Lab::up(&options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let pods = lab.pods().to_vec();
    let pod = |i: usize| pods[i].clone();
    let timeouts = shorten_timeouts(SECONDS_PER_DAY / day_secs);
    wait_for_timeouts(&timeouts, Duration::from_secs(10)).expect("the datapath's timeouts");
    println!("a simulated day: {day_secs} s; timeouts (s): {timeouts:?}");

    let servers = start_servers(&lab);
    let inet_idle = SocketAddrV4::new(addrs::INET_ADDR, IDLE_PORT);
    let (inet_backend, service_backend, node_port_backend) = (
        listen(addrs::NS_INET, inet_idle),
        listen(
            &pod(SERVICE_POD).netns,
            SocketAddrV4::new(pod(SERVICE_POD).addr, IDLE_PORT),
        ),
        listen(
            &pod(NODE_PORT_POD).netns,
            SocketAddrV4::new(pod(NODE_PORT_POD).addr, IDLE_PORT),
        ),
    );
    let client = pod(CLIENT_POD).netns;
    let mut idle = vec![
        IdleConnection::open("SNAT to inet", &client, inet_idle, &inet_backend),
        IdleConnection::open("ClusterIP to a pod", &client, TO_POD, &service_backend),
        IdleConnection::open(
            "NodePort from peer",
            addrs::NS_PEER,
            SocketAddrV4::new(addrs::NODE_PRIMARY_ADDR, addrs::NODE_PORT),
            &node_port_backend,
        ),
        IdleConnection::open(
            "on-prem to a pod",
            addrs::NS_ONPREM,
            SocketAddrV4::new(pod(NODE_PORT_POD).addr, IDLE_PORT),
            &node_port_backend,
        ),
    ];
    // Opened, never used again: collected once its day has passed.
    let forgotten = IdleConnection::open("forgotten", &client, inet_idle, &inet_backend);
    let echo = EchoStream::open(&pod(STREAM_POD).netns, servers.inet);
    let udp_stream = UdpStream::start(&pod(STREAM_POD).netns, pod(STREAM_POD).addr, servers.inet);
    let scanner = RawSender::open(addrs::NS_ONPREM).expect("a raw socket on-prem");
    let retrier = RawSender::open(&pod(STREAM_POD).netns).expect("a raw socket in a pod");
    let igw_before = lab.igw_drops().expect("the internet gateway's drops");
    let srcdst_before = lab.srcdst_check_drops().expect("the router's drops");

    let mut external_snat = false;
    let mut black_holed = 0_u64;
    let mut scans = 0_u16;
    // The most NAT flows and stack flow entries each day held.
    let mut peaks = vec![(0_usize, 0_usize); days as usize];
    let started = Instant::now();
    for h in 0..days * HOURS_PER_DAY {
        let when = When { hour: h };
        let hour_of_day = h % HOURS_PER_DAY;
        if hour_of_day == RESTART_HOUR {
            if (h / HOURS_PER_DAY).is_multiple_of(2) {
                lab.kill_agent().expect("SIGKILL to the agent");
            } else {
                lab.stop_agent().expect("SIGTERM to the agent");
            }
            lab.start_agent()
                .unwrap_or_else(|e| panic!("{when}: restarting the agent: {e}"));
        }
        if hour_of_day == EXTERNAL_SNAT_ON_HOUR || hour_of_day == EXTERNAL_SNAT_OFF_HOUR {
            external_snat = hour_of_day == EXTERNAL_SNAT_ON_HOUR;
            agent_cli(&[
                "set",
                "external-snat",
                if external_snat { "on" } else { "off" },
            ]);
        }
        for i in [CLIENT_POD, SERVICE_POD, NODE_PORT_POD] {
            let (ns, addr) = (pod(i).netns, pod(i).addr);
            for _ in 0..CHURN_PER_POD {
                if external_snat {
                    // Un-NATed: on-prem is reached by the pod's address.
                    churn_tcp(&ns, servers.onprem, addr, when);
                    churn_udp(&ns, servers.onprem, addr, when);
                } else {
                    churn_tcp(&ns, servers.inet, addrs::NODE_PRIMARY_ADDR, when);
                    churn_udp(&ns, servers.inet, addrs::NODE_PRIMARY_ADDR, when);
                }
                churn_tcp(&ns, servers.peer, addr, when);
            }
        }
        if external_snat {
            // A pod retrying an endpoint the internet gateway black-holes.
            for _ in 0..BLACK_HOLED_SYNS {
                let port = BLACK_HOLED_SOURCE_PORTS + u16::try_from(black_holed).expect("few");
                retrier
                    .syn(SocketAddrV4::new(pod(STREAM_POD).addr, port), servers.inet)
                    .expect("a black-holed SYN");
                black_holed += 1;
            }
        }
        for probed in &servers.pods {
            for _ in 0..PROBES_PER_POD {
                tcp_whoami_closed(addrs::NS_NODE, *probed, TIMEOUT)
                    .unwrap_or_else(|e| panic!("{when}: probe of {probed}: {e}"))
                    .unwrap_or_else(|| panic!("{when}: probe of {probed}: no answer"));
            }
        }
        for _ in 0..SCAN_SYNS {
            let offset = scans % (SCANNED_PORTS.end - SCANNED_PORTS.start);
            scanner
                .syn(
                    SocketAddrV4::new(addrs::ONPREM_ADDR, SCAN_SOURCE_PORTS + scans),
                    SocketAddrV4::new(pod(NODE_PORT_POD).addr, SCANNED_PORTS.start + offset),
                )
                .expect("a scan SYN");
            scans += 1;
        }
        if h % IDLE_HOURS == IDLE_HOURS - 1 {
            // The hours are real time only while the traffic keeps up: past
            // the timeout in real time, a flow is rightly gone.
            let established = Duration::from_secs(timeouts.tcp_established.into());
            for connection in &mut idle {
                let name = connection.name;
                let idle_for = connection.idle_for();
                assert!(
                    idle_for < established,
                    "{when}: {name} has been idle {idle_for:?}, past the {established:?} \
                     established timeout: the hours overran (this machine needs a longer \
                     day, {})",
                    test_sizes::SIMULATED_DAY_SECS_VAR,
                );
                connection
                    .exchange(&format!("{when}"))
                    .unwrap_or_else(|e| panic!("{when}: {name} after its idle hours: {e}"));
            }
        }
        echo.wait_for_more_echoes(10, &format!("at {when}"));
        let occupancy = (
            nat_flows().expect("the NAT table"),
            stack_flow_entries().expect("the stack flows map"),
        );
        let peak = &mut peaks[(h / HOURS_PER_DAY) as usize];
        *peak = (peak.0.max(occupancy.0), peak.1.max(occupancy.1));
        // Pacing, not synchronisation: the simulated clock's hours.
        let (next, now) = (hour * (h + 1), started.elapsed());
        match next.checked_sub(now) {
            Some(rest) => thread::sleep(rest),
            None => println!(
                "{when}: the hour's traffic overran by {:?}",
                now.saturating_sub(next)
            ),
        }
    }
    let elapsed = started.elapsed();

    let stream = udp_stream.stop();
    let echoed = echo.close();
    for connection in &mut idle {
        let name = connection.name;
        connection
            .exchange("the end")
            .unwrap_or_else(|e| panic!("{name} at the end: {e}"));
    }
    // Drained back to the long-lived flows.
    let deadline = Instant::now() + DRAIN_WITHIN;
    let drained = loop {
        let now = (
            nat_flows().expect("the NAT table"),
            stack_flow_entries().expect("the stack flows map"),
        );
        if now.0 <= LONG_LIVED_NAT_FLOWS && now.1 <= LONG_LIVED_STACK_ENTRIES
            || Instant::now() > deadline
        {
            break now;
        }
        thread::sleep(Duration::from_millis(200));
    };
    let forgotten_kept = nat_table_holds(forgotten.client_addr(), inet_idle);
    let idle_kept = nat_table_holds(idle[0].client_addr(), inet_idle);
    let drops: Vec<(Counter, u64)> = counters()
        .into_iter()
        .filter(|(c, n)| {
            *n > 0
                && (c.is_drop() || matches!(c, Counter::NatEarlyDrop | Counter::StackFlowUntracked))
        })
        .collect();
    let invalid = kube_proxy::invalid_drops(lab.options().iptables_backend)
        .expect("kube-proxy's INVALID drops");
    let igw = lab.igw_drops().expect("the internet gateway's drops") - igw_before;
    let srcdst = lab.srcdst_check_drops().expect("the router's drops") - srcdst_before;

    println!("{days} simulated days in {elapsed:.0?}");
    for (day, (nat, stack)) in peaks.iter().enumerate() {
        println!(
            "day {}: at most {nat} NAT flows (table of {NAT_ENTRIES}), {stack} stack flow entries",
            day + 1
        );
    }
    println!(
        "after the churn: {} NAT flows, {} stack flow entries; the forgotten connection's flow {}",
        drained.0,
        drained.1,
        if forgotten_kept { "kept" } else { "collected" }
    );
    println!(
        "UDP stream: {} of {} datagrams answered, seen as {:?}; echo stream: {echoed} echoes",
        stream.answered, stream.sent, stream.seen_as
    );
    println!(
        "drops: datapath {drops:?}, kube-proxy INVALID {invalid}, internet gateway {igw} \
         ({black_holed} black-holed SYNs sent), source/destination check {srcdst}"
    );

    assert!(
        peaks.iter().all(|(nat, _)| *nat < NAT_ENTRIES / 4),
        "the NAT table stays far below its size: {peaks:?}"
    );
    assert!(
        drained.0 <= LONG_LIVED_NAT_FLOWS && drained.1 <= LONG_LIVED_STACK_ENTRIES,
        "the tables drain back to the long-lived flows within {DRAIN_WITHIN:?}: {drained:?}; \
         stack flows:\n{}",
        stack_flow_lines().expect("the stack flows").join("\n")
    );
    assert!(idle_kept, "the idle SNAT connection's flow is kept");
    assert!(
        !forgotten_kept,
        "a connection idle past its timeout is collected"
    );
    assert_eq!(stream.first_loss, None, "every UDP datagram answered");
    assert_eq!(
        stream.seen_as.len(),
        1,
        "the UDP stream keeps its SNAT port: {:?}",
        stream.seen_as
    );
    assert!(
        stream
            .seen_as
            .iter()
            .all(|seen| *seen.ip() == addrs::NODE_PRIMARY_ADDR)
    );
    assert_eq!(drops, [], "no datapath drop");
    assert_eq!(invalid, 0, "nothing conntrack calls INVALID");
    assert_eq!(srcdst, 0, "nothing left with an address not its own");
    assert_eq!(
        igw, black_holed,
        "the internet gateway drops only the black-holed SYNs"
    );
    drop((idle, forgotten, servers));
    lab.down().expect("taking the lab down");
}
