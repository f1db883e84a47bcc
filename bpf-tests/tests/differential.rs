//! The differential test: the same flows through the VPC CNI's iptables
//! wiring and through the eBPF datapath, and what each far end saw must be
//! the same. For each destination (peer in the VPC, on-premises with and
//! without an SNAT exclusion, the internet, node-local addresses) and each
//! flow (TCP, UDP, ICMP echo, and an ICMP error provoked by UDP to a closed
//! port), the far end records the source it saw and the pod records what came
//! back. Both tables are printed side by side (`-- --nocapture` shows them),
//! compared, and checked against what the VPC CNI is documented to do.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use ipnet::Ipv4Net;
use vpcnet_bpf_tests::{
    agent_binary,
    differential::{self, FarEnd, WhoamiServers, lab_drops},
    lab_counter,
};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    Lab, LabOptions, Proto, addrs, icmp_echo,
    probe::{UdpTap, udp_to_closed_port},
    serial, tcp_whoami, udp_whoami,
};

/// Where the whoami servers listen (TCP and UDP).
const OPEN_PORT: u16 = 8080;
/// A port nothing listens on, anywhere in the lab: UDP to it provokes a
/// port unreachable.
const CLOSED_PORT: u16 = 8081;
/// How long a probe waits for its reply. Every flow of this test is
/// expected to get one, so this is only spent when something is broken.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long to wait for a far end to record a request, once the client has
/// its answer (the recording thread may lag the kernel's reply a little) or
/// has given up on it.
const SEEN_TIMEOUT: Duration = Duration::from_secs(1);

/// The exclusion the on-premises network gets in the second run of each
/// datapath (`AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`).
const ONPREM_EXCLUSION: Ipv4Net = addrs::ONPREM_NET;

/// A far end of the lab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Destination {
    /// Another instance in the VPC.
    Peer,
    /// Reached through Direct Connect.
    Onprem,
    /// Behind the internet gateway.
    Inet,
    /// The node-local DNS cache's address, on the node's `nodelocaldns`
    /// device.
    NodeLocalDns,
    /// The node's own primary address.
    Node,
}

impl Destination {
    const ALL: [Self; 5] = [
        Self::Peer,
        Self::Onprem,
        Self::Inet,
        Self::NodeLocalDns,
        Self::Node,
    ];
}

impl FarEnd for Destination {
    fn name(self) -> String {
        match self {
            Self::Peer => "peer",
            Self::Onprem => "onprem",
            Self::Inet => "inet",
            Self::NodeLocalDns => "nodelocaldns",
            Self::Node => "node",
        }
        .to_owned()
    }

    fn ns(self) -> String {
        match self {
            Self::Peer => addrs::NS_PEER,
            Self::Onprem => addrs::NS_ONPREM,
            Self::Inet => addrs::NS_INET,
            Self::NodeLocalDns | Self::Node => addrs::NS_NODE,
        }
        .to_owned()
    }

    fn addr(self) -> Ipv4Addr {
        match self {
            Self::Peer => addrs::PEER_ADDR,
            Self::Onprem => addrs::ONPREM_ADDR,
            Self::Inet => addrs::INET_ADDR,
            Self::NodeLocalDns => addrs::NODE_LOCAL_DNS_ADDR,
            Self::Node => addrs::NODE_PRIMARY_ADDR,
        }
    }
}

/// What the pod sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    Tcp,
    Udp,
    IcmpEcho,
    /// UDP to [`CLOSED_PORT`]: the far end answers port unreachable, which
    /// must find its way back to the pod's socket.
    PortUnreachable,
}

impl Flow {
    const ALL: [Self; 4] = [Self::Tcp, Self::Udp, Self::IcmpEcho, Self::PortUnreachable];

    fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
            Self::IcmpEcho => "icmp echo",
            Self::PortUnreachable => "icmp error",
        }
    }
}

/// What came back to the pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Back {
    Nothing,
    /// The answer (whoami line, echo reply), from this address.
    Reply(Ipv4Addr),
    /// ICMP port unreachable on the pod's connected socket, sent by this
    /// address.
    PortUnreachable(Ipv4Addr),
}

/// One cell of the table: what one flow did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outcome {
    /// The source address the far end saw; `None`: it never arrived.
    seen_from: Option<Ipv4Addr>,
    back: Back,
}

impl Outcome {
    /// Printed without the answer's sender when it is the destination, as
    /// it should be.
    fn describe(&self, destination: Ipv4Addr) -> String {
        let seen = self
            .seen_from
            .map_or_else(|| "not reached".to_owned(), |addr| format!("saw {addr}"));
        let back = match self.back {
            Back::Nothing => "nothing back".to_owned(),
            Back::Reply(from) if from == destination => "reply".to_owned(),
            Back::Reply(from) => format!("reply from {from}"),
            Back::PortUnreachable(from) if from == destination => "port unreachable".to_owned(),
            Back::PortUnreachable(from) => format!("port unreachable from {from}"),
        };
        format!("{seen}, {back}")
    }
}

/// A row's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Case {
    destination: Destination,
    /// Whether the lab ran with [`ONPREM_EXCLUSION`].
    onprem_excluded: bool,
    flow: Flow,
}

impl differential::Row for Case {
    type Outcome = Outcome;

    const COLUMNS: &'static [(&'static str, usize)] =
        &[("destination", 27), ("onprem SNAT", 14), ("flow", 11)];
    const OUTCOME_WIDTH: usize = 36;

    fn cells(&self) -> Vec<String> {
        let destination = format!("{} {}", self.destination.name(), self.destination.addr());
        let exclusion = if self.onprem_excluded {
            "excluded"
        } else {
            "not excluded"
        };
        vec![
            destination,
            exclusion.to_owned(),
            self.flow.name().to_owned(),
        ]
    }

    fn describe(&self, outcome: &Outcome) -> String {
        outcome.describe(self.destination.addr())
    }

    fn expected(&self) -> Outcome {
        expected(*self, pod_addr())
    }
}

/// Every case in a fixed order, with what it did.
type Table = Vec<(Case, Outcome)>;

/// The far ends' probes: a whoami server per destination and a UDP tap per
/// namespace (two destinations share the node's).
struct FarEnds {
    servers: WhoamiServers<Destination>,
    taps: Vec<(String, UdpTap)>,
}

impl FarEnds {
    fn start() -> Self {
        let servers = WhoamiServers::start(Destination::ALL, OPEN_PORT);
        let mut taps: Vec<(String, UdpTap)> = Vec::new();
        for destination in Destination::ALL {
            let ns = destination.ns();
            if !taps.iter().any(|(tapped, _)| *tapped == ns) {
                let tap = UdpTap::open(&ns).unwrap_or_else(|e| panic!("UDP tap in {ns}: {e}"));
                taps.push((ns, tap));
            }
        }
        Self { servers, taps }
    }

    fn tap(&self, ns: &str) -> &UdpTap {
        self.taps
            .iter()
            .find_map(|(tapped, tap)| (*tapped == ns).then_some(tap))
            .expect("a tap per namespace")
    }
}

/// Runs one flow from `pod_ns` and records both ends' view.
fn probe(pod_ns: &str, far_ends: &FarEnds, destination: Destination, flow: Flow) -> Outcome {
    let addr = destination.addr();
    let open = SocketAddrV4::new(addr, OPEN_PORT);
    let server = far_ends.servers.at(destination);
    // Probes run one after the other: whatever the server records from now
    // on is this flow's.
    server.clear();
    let seen_by_server = |proto: Proto| {
        server
            .wait_for(SEEN_TIMEOUT, |o| o.proto == proto)
            .map(|o| *o.source.ip())
    };
    let context = format!("{} to {} ({addr})", flow.name(), destination.name());
    match flow {
        Flow::Tcp => {
            let reply = tcp_whoami(pod_ns, open, REPLY_TIMEOUT)
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            Outcome {
                seen_from: seen_by_server(Proto::Tcp),
                back: reply.map_or(Back::Nothing, |_| Back::Reply(addr)),
            }
        }
        Flow::Udp => {
            let reply = udp_whoami(pod_ns, open, REPLY_TIMEOUT)
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            Outcome {
                seen_from: seen_by_server(Proto::Udp),
                back: reply.map_or(Back::Nothing, |_| Back::Reply(addr)),
            }
        }
        Flow::IcmpEcho => {
            let reply =
                icmp_echo(pod_ns, addr, REPLY_TIMEOUT).unwrap_or_else(|e| panic!("{context}: {e}"));
            Outcome {
                seen_from: seen_by_server(Proto::Icmp),
                back: reply.map_or(Back::Nothing, Back::Reply),
            }
        }
        Flow::PortUnreachable => {
            let closed = SocketAddrV4::new(addr, CLOSED_PORT);
            let error = udp_to_closed_port(pod_ns, closed, REPLY_TIMEOUT)
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            let back = match error {
                None => Back::Nothing,
                Some(report) => {
                    assert!(
                        report.is_port_unreachable(),
                        "{context}: the pod got ICMP type {} code {}, not port unreachable",
                        report.icmp_type,
                        report.icmp_code
                    );
                    Back::PortUnreachable(report.from)
                }
            };
            let seen = far_ends
                .tap(&destination.ns())
                .wait_for(closed, SEEN_TIMEOUT)
                .unwrap_or_else(|e| panic!("{context}: {e}"));
            Outcome {
                seen_from: seen.map(|source| *source.ip()),
                back,
            }
        }
    }
}

/// Brings a lab up with `options` (plus the exclusion when asked), runs
/// every flow from pod 0 to every destination, and returns the table. For
/// the eBPF datapath, `check_counters` runs while the lab is still up.
fn run_flows(options: LabOptions, onprem_excluded: bool, check_counters: impl FnOnce()) -> Table {
    let options = LabOptions {
        exclude_snat_cidrs: if onprem_excluded {
            vec![ONPREM_EXCLUSION]
        } else {
            Vec::new()
        },
        ..options
    };
    let lab = Lab::up(&options).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    let pod_ns = lab.pod(0).netns.clone();
    let far_ends = FarEnds::start();
    let mut table = Table::new();
    for destination in Destination::ALL {
        for flow in Flow::ALL {
            let outcome = probe(&pod_ns, &far_ends, destination, flow);
            let case = Case {
                destination,
                onprem_excluded,
                flow,
            };
            table.push((case, outcome));
        }
    }
    check_counters();
    // The probes go before the lab they live in.
    drop(far_ends);
    drop(lab);
    table
}

/// What the VPC CNI does: traffic to the VPC and to excluded CIDRs keeps
/// the pod's address, traffic to anywhere else outside the VPC leaves with
/// the node's primary address, and traffic to the node itself is local
/// (`--dst-type LOCAL`), never translated. Every flow gets its answer back.
fn expected(case: Case, pod: Ipv4Addr) -> Outcome {
    let source = match case.destination {
        Destination::Peer | Destination::NodeLocalDns | Destination::Node => pod,
        Destination::Onprem if case.onprem_excluded => pod,
        Destination::Onprem | Destination::Inet => addrs::NODE_PRIMARY_ADDR,
    };
    let addr = case.destination.addr();
    Outcome {
        seen_from: Some(source),
        back: match case.flow {
            Flow::PortUnreachable => Back::PortUnreachable(addr),
            Flow::Tcp | Flow::Udp | Flow::IcmpEcho => Back::Reply(addr),
        },
    }
}

/// After a run of the eBPF datapath: pod flows to the internet were
/// translated to the node's address and their replies (and the port
/// unreachable) translated back, and not a packet was dropped.
fn assert_ebpf_counters() {
    for (counter, what) in [
        (Counter::EgressSnatNew, "new SNATed flows"),
        (Counter::IngressRevSnat, "replies translated back"),
        (
            Counter::IngressIcmpErrorRevNat,
            "ICMP errors translated back",
        ),
    ] {
        let value = lab_counter(counter);
        assert!(value > 0, "{} ({what}) is {value}", counter.name());
    }
    let dropped = lab_drops();
    assert!(
        dropped.is_empty(),
        "the eBPF datapath dropped packets: {}",
        dropped.join(", ")
    );
}

#[test]
fn iptables_and_ebpf_datapaths_look_the_same_from_every_far_end() {
    let _lab_slot = serial();
    let agent = agent_binary();

    let iptables = differential::reference_half(|| {
        [false, true]
            .into_iter()
            .flat_map(|onprem_excluded| run_flows(LabOptions::iptables(1), onprem_excluded, || {}))
            .collect::<Table>()
    });
    let mut ebpf = Table::new();
    for onprem_excluded in [false, true] {
        ebpf.extend(run_flows(
            LabOptions::ebpf(1, &agent),
            onprem_excluded,
            assert_ebpf_counters,
        ));
    }

    differential::show_and_assert(
        &format!(
            "\nfrom pod-0 ({}): what each far end saw as the source, and what came back",
            pod_addr()
        ),
        iptables.as_deref(),
        &ebpf,
    );
}

fn pod_addr() -> Ipv4Addr {
    addrs::pod_addr(0).expect("pod 0 has an address")
}
