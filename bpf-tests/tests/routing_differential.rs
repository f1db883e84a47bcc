//! The routing replacement's differential test: every path of the VPC CNI's
//! policy routing (ip rules 512/1536/1024/10, per-ENI and VLAN tables,
//! connmark 0x80) run through the iptables reference and through the eBPF
//! datapath, with what each end saw compared.
//!
//! Each lab has six pods over three ENIs and two branch ENIs: pod-0 on
//! `eth0`, pods 1 and 4 on `eth1`, pod-2 on `eth2`, pods 3 and 5 on branch
//! ENIs (`vlan.eth.1`, `vlan.eth.2`), a NodePort-style service
//! (10.20.11.162:30080) in front of pod-1, and two ClusterIP-style services
//! (kube-proxy's DNAT from 10.100.0.0/16) backed by `peer` and by pod-4. It
//! runs once per security-group enforcing mode (node-wide): strict, and
//! standard with the on-premises network excluded from SNAT. The flows:
//!
//! - into pod-2 on `eth2` from `onprem` and `peer`, and into the branch pod
//!   from `peer` (the first packet the node sends by `eth2` is a reply);
//! - pod to pod on the node (same ENI, across ENIs): TCP, UDP, ICMP echo;
//! - pods on `eth1` and `eth2` to `peer`, `onprem` and `inet`;
//! - `peer` to the node port, answered by pod-1 on `eth1`;
//! - pod-1 and the branch pod to the services;
//! - the branch pod to `peer`, `onprem`, `inet`, to pod-0 and back.
//!
//! For each: the source the far end saw, whether the answer came back, by
//! which of the node's ENIs the packets reached the VPC router (IPv4 packets
//! counted per router link, so a gateway's ARP refresh does not blur it),
//! and whether the router's source/destination check or internet gateway
//! dropped any. Both tables are printed side by side (`-- --nocapture`),
//! compared, and checked against what the VPC CNI does; after each eBPF run
//! the verdict counters of those paths must have moved and no drop counter.
//!
//! A second test counts `ip rule`s: the VPC CNI's per pod in the reference,
//! none at all (the kernel's three) with vpcnet.

use std::{
    fmt,
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use vpcnet_bpf_tests::{
    KERNEL_RULES, agent_binary, agent_cli,
    differential::{self, FarEnd, WhoamiServers, lab_drops},
    lab_counter,
};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    ClusterIpService, EnforcingMode, Lab, LabOptions, NodePortService, ServiceBackend, addrs,
    probe::{RouterLinkTap, WhoamiFlow},
    serial, test_sizes,
};

/// Where every whoami server listens, the node port's pod included.
const PORT: u16 = 8080;
/// How long a probe waits for an answer that is expected. Only spent when
/// something is broken.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a probe waits for an answer that is expected not to come (the
/// VPC CNI drops it too): a delivered one takes milliseconds.
const DROP_TIMEOUT: Duration = Duration::from_millis(700);
/// How long to wait for a far end to record a request it is expected to
/// get, once the client has its answer or gave up.
const SEEN_TIMEOUT: Duration = Duration::from_secs(1);
/// The same for a request the far end is expected never to get.
const UNSEEN_TIMEOUT: Duration = Duration::from_millis(200);

/// The lab: pod i on ENI i % 3, but pods 3 and 5 on branch ENIs.
const PODS: usize = 6;
const ENIS: usize = 3;
const BRANCH_PODS: [usize; 2] = [3, 5];
/// The branch pod whose paths are probed (`vlan.eth.1`).
const BRANCH_POD: usize = 3;
/// The pod behind the node port, on `eth1`.
const NODE_PORT_POD: usize = 1;

/// Cluster IP services in the default service CIDR (10.100.0.0/16), in
/// kube-proxy's rules: to `peer`, and to a pod of the node.
const SERVICE_TO_PEER: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 10), 80);
const SERVICE_TO_POD: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 100, 0, 11), 80);
const SERVICE_POD: usize = 4;

/// The node-wide security-group enforcing mode of a lab, and what goes with
/// it in this test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Strict,
    /// Standard, with the on-premises network excluded from SNAT.
    Standard,
}

impl Mode {
    const ALL: [Self; 2] = [Self::Strict, Self::Standard];

    /// The modes [`test_sizes::ROUTING_DIFFERENTIAL_MODES_VAR`] names, or
    /// all of them.
    fn chosen() -> Vec<Self> {
        let Ok(names) = std::env::var(test_sizes::ROUTING_DIFFERENTIAL_MODES_VAR) else {
            return Self::ALL.to_vec();
        };
        let modes: Vec<Self> = Self::ALL
            .into_iter()
            .filter(|mode| names.split(',').any(|name| name.trim() == mode.name()))
            .collect();
        assert!(
            !modes.is_empty(),
            "{}={names}: none of strict, standard",
            test_sizes::ROUTING_DIFFERENTIAL_MODES_VAR
        );
        modes
    }

    fn name(self) -> &'static str {
        match self {
            Self::Strict => "strict",
            Self::Standard => "standard",
        }
    }

    fn enforcing(self) -> EnforcingMode {
        match self {
            Self::Strict => EnforcingMode::Strict,
            Self::Standard => EnforcingMode::Standard,
        }
    }

    fn onprem_excluded(self) -> bool {
        self == Self::Standard
    }

    fn options(self, base: LabOptions) -> LabOptions {
        LabOptions {
            enis: ENIS,
            branch_pods: BRANCH_PODS.to_vec(),
            sg_enforcing_mode: self.enforcing(),
            node_port: Some(NodePortService {
                pod: NODE_PORT_POD,
                target_port: PORT,
            }),
            cluster_ips: vec![
                ClusterIpService {
                    name: "to-peer".into(),
                    addr: SERVICE_TO_PEER,
                    backend: ServiceBackend::Remote(SocketAddrV4::new(addrs::PEER_ADDR, PORT)),
                },
                ClusterIpService {
                    name: "to-pod".into(),
                    addr: SERVICE_TO_POD,
                    backend: ServiceBackend::Pod {
                        pod: SERVICE_POD,
                        port: PORT,
                    },
                },
            ],
            exclude_snat_cidrs: if self.onprem_excluded() {
                vec![addrs::ONPREM_NET]
            } else {
                Vec::new()
            },
            ..base
        }
    }
}

/// One end of a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Pod(usize),
    Peer,
    Onprem,
    Inet,
    /// 10.20.11.162:30080, DNATed by the node to [`NODE_PORT_POD`].
    NodePort,
    /// A ClusterIP-style service backed by `peer` ([`SERVICE_TO_PEER`]).
    ServiceToPeer,
    /// A ClusterIP-style service backed by [`SERVICE_POD`]
    /// ([`SERVICE_TO_POD`]).
    ServiceToPod,
}

impl FarEnd for End {
    fn addr(self) -> Ipv4Addr {
        match self {
            Self::Pod(index) => addrs::pod_addr(index).expect("a lab pod"),
            Self::Peer => addrs::PEER_ADDR,
            Self::Onprem => addrs::ONPREM_ADDR,
            Self::Inet => addrs::INET_ADDR,
            Self::NodePort => addrs::NODE_PRIMARY_ADDR,
            Self::ServiceToPeer => *SERVICE_TO_PEER.ip(),
            Self::ServiceToPod => *SERVICE_TO_POD.ip(),
        }
    }

    fn ns(self) -> String {
        match self {
            Self::Pod(index) => addrs::pod_ns(index),
            Self::Peer => addrs::NS_PEER.to_owned(),
            Self::Onprem => addrs::NS_ONPREM.to_owned(),
            Self::Inet => addrs::NS_INET.to_owned(),
            Self::NodePort | Self::ServiceToPeer | Self::ServiceToPod => {
                unreachable!("{self:?} is no namespace's")
            }
        }
    }

    fn name(self) -> String {
        match self {
            Self::Pod(index) => match self.eni() {
                Some(link) => format!("pod-{index} ({})", link.node_side()),
                None => format!("pod-{index}"),
            },
            Self::Peer => "peer".to_owned(),
            Self::Onprem => "onprem".to_owned(),
            Self::Inet => "inet".to_owned(),
            Self::NodePort => "node port".to_owned(),
            Self::ServiceToPeer => "svc->peer".to_owned(),
            Self::ServiceToPod => format!("svc->pod-{SERVICE_POD}"),
        }
    }
}

impl End {
    fn port(self) -> u16 {
        match self {
            Self::NodePort => addrs::NODE_PORT,
            Self::ServiceToPeer => SERVICE_TO_PEER.port(),
            Self::ServiceToPod => SERVICE_TO_POD.port(),
            _ => PORT,
        }
    }

    /// The node interface that owns a pod's address.
    fn eni(self) -> Option<Link> {
        match self {
            Self::Pod(index) if index == BRANCH_POD => Some(Link::Vlan1),
            Self::Pod(index) if BRANCH_PODS.contains(&index) => None,
            Self::Pod(index) => Some(Link::ALL[index % ENIS]),
            _ => None,
        }
    }

    /// The name and where it is (the port too for the node port).
    fn target(self) -> String {
        match self {
            Self::NodePort | Self::ServiceToPeer | Self::ServiceToPod => {
                format!("{} {}:{}", self.name(), self.addr(), self.port())
            }
            _ => format!("{} {}", self.name(), self.addr()),
        }
    }
}

/// What is sent.
type Flow = WhoamiFlow;

/// For flows into a pod: UDP first (see [`cases`]).
const INBOUND_FLOWS: [Flow; 3] = [Flow::Udp, Flow::Tcp, Flow::IcmpEcho];

/// The node's ENIs as the VPC router sees them: its link for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Eth0,
    Eth1,
    Eth2,
    /// The probed branch pod's branch ENI.
    Vlan1,
    /// The other branch pod's.
    Vlan2,
}

impl Link {
    const ALL: [Self; 5] = [Self::Eth0, Self::Eth1, Self::Eth2, Self::Vlan1, Self::Vlan2];

    fn router_side(self) -> String {
        match self {
            Self::Eth0 => addrs::vpc_eni_link(0),
            Self::Eth1 => addrs::vpc_eni_link(1),
            Self::Eth2 => addrs::vpc_eni_link(2),
            Self::Vlan1 => addrs::vpc_branch_link(addrs::branch_vlan_id(0)),
            Self::Vlan2 => addrs::vpc_branch_link(addrs::branch_vlan_id(1)),
        }
    }

    fn node_side(self) -> String {
        match self {
            Self::Eth0 => addrs::eni_ifname(0),
            Self::Eth1 => addrs::eni_ifname(1),
            Self::Eth2 => addrs::eni_ifname(2),
            Self::Vlan1 => addrs::branch_link(addrs::branch_vlan_id(0)),
            Self::Vlan2 => addrs::branch_link(addrs::branch_vlan_id(1)),
        }
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

/// The set of ENIs by which a flow's packets left the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Links(u8);

impl Links {
    fn of(links: &[Link]) -> Self {
        Self(links.iter().fold(0, |bits, link| bits | link.bit()))
    }
}

impl fmt::Display for Links {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = Link::ALL
            .iter()
            .filter(|link| self.0 & link.bit() != 0)
            .map(|link| link.node_side())
            .collect();
        if names.is_empty() {
            // Pod to pod; or a frame the router did not take as IPv4 for
            // itself (another host's MAC).
            f.write_str("by no ENI")
        } else {
            write!(f, "out {}", names.join("+"))
        }
    }
}

/// A row's key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Case {
    mode: Mode,
    from: End,
    to: End,
    flow: Flow,
}

/// What one flow did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outcome {
    /// The source address the far end saw; `None`: it never arrived.
    seen_from: Option<Ipv4Addr>,
    /// Who answered (for TCP and UDP, the address the client's connected
    /// socket accepted the answer from); `None`: nothing came back.
    reply_from: Option<Ipv4Addr>,
    /// The ENIs by which packets of the flow reached the VPC router.
    links: Links,
    /// The VPC router's source/destination check dropped some of them.
    srcdst_dropped: bool,
    /// The internet gateway refused some of them.
    igw_dropped: bool,
}

impl Outcome {
    fn describe(&self, case: &Case) -> String {
        let seen = self
            .seen_from
            .map_or_else(|| "not reached".to_owned(), |addr| format!("saw {addr}"));
        let back = match self.reply_from {
            None => "nothing back".to_owned(),
            Some(from) if from == case.to.addr() => "reply".to_owned(),
            Some(from) => format!("reply from {from}"),
        };
        let mut text = format!("{seen}, {back}, {}", self.links);
        if self.srcdst_dropped {
            text.push_str(", SRC/DST CHECK DROP");
        }
        if self.igw_dropped {
            text.push_str(", igw drop");
        }
        text
    }
}

impl differential::Row for Case {
    type Outcome = Outcome;

    const COLUMNS: &'static [(&'static str, usize)] =
        &[("mode", 9), ("from", 18), ("to", 31), ("flow", 10)];
    const OUTCOME_WIDTH: usize = 54;

    fn cells(&self) -> Vec<String> {
        vec![
            self.mode.name().to_owned(),
            self.from.name(),
            self.to.target(),
            self.flow.name().to_owned(),
        ]
    }

    fn describe(&self, outcome: &Outcome) -> String {
        outcome.describe(self)
    }

    fn expected(&self) -> Outcome {
        expected(self)
    }
}

/// Every case of a lab, in the order they run.
fn cases(mode: Mode) -> Vec<Case> {
    let mut pairs: Vec<(End, End, &[Flow])> = vec![
        // Inbound to a pod on eth2 first, UDP first: the very first packet
        // the node sends by eth2 is then a reply no retransmission can make
        // up for. From outside the VPC (not excluded: the reply goes
        // through the stack), then from the VPC.
        (End::Onprem, End::Pod(2), &INBOUND_FLOWS),
        (End::Peer, End::Pod(2), &INBOUND_FLOWS),
        (End::Peer, End::Pod(BRANCH_POD), &INBOUND_FLOWS),
        // Pod to pod: on the same ENI, and across ENIs.
        (End::Pod(1), End::Pod(4), &Flow::ALL),
        (End::Pod(0), End::Pod(2), &Flow::ALL),
    ];
    for pod in [End::Pod(1), End::Pod(2)] {
        for far in [End::Peer, End::Onprem, End::Inet] {
            pairs.push((pod, far, &Flow::ALL));
        }
    }
    // kube-proxy DNATs TCP and UDP only.
    let dnat: &[Flow] = &[Flow::Tcp, Flow::Udp];
    pairs.push((End::Peer, End::NodePort, dnat));
    pairs.push((End::Pod(1), End::ServiceToPeer, dnat));
    pairs.push((End::Pod(1), End::ServiceToPod, dnat));
    let branch = End::Pod(BRANCH_POD);
    pairs.push((branch, End::ServiceToPeer, dnat));
    for far in [End::Peer, End::Onprem, End::Inet, End::Pod(0)] {
        pairs.push((branch, far, &Flow::ALL));
    }
    pairs.push((End::Pod(0), branch, &Flow::ALL));
    pairs
        .into_iter()
        .flat_map(|(from, to, flows)| {
            flows.iter().map(move |&flow| Case {
                mode,
                from,
                to,
                flow,
            })
        })
        .collect()
}

/// What the VPC CNI does (its iptables and policy routing, as the lab's
/// reference wires them):
///
/// - a pod to a pod of the node: straight through the node, unless one of
///   them is a strict branch pod: then by the VPC (the branch pod by its
///   branch ENI, the other by its own ENI);
/// - a pod to the VPC or an excluded CIDR: its own address, out of its own
///   ENI (rule 1536 and the ENI's table; a branch ENI's VLAN table);
/// - a pod to anywhere else: SNATed to 10.20.11.162, out of eth0 (connmark
///   0x80, rule 1024), except a strict branch pod: out of its branch ENI
///   un-NATed (the SNAT rule's `! -o vlan+`), which the internet gateway
///   drops;
/// - the node port: the pod sees the client, the reply leaves by eth0
///   (connmark 0x80 and rule 1024) from 10.20.11.162:30080;
/// - into a pod from `peer` or `onprem`: the pod sees the client, its reply
///   leaves by its own ENI un-NATed (conntrack: not a new flow);
/// - a pod to a service: kube-proxy's DNAT (first in nat PREROUTING) ends
///   the chain before the connmark rules, so the backend sees the pod's
///   address by the pod's own ENI (a local backend: within the node), and
///   the reply comes back from the service's address.
fn expected(case: &Case) -> Outcome {
    let strict = case.mode == Mode::Strict;
    let is_strict = |end: End| strict && end == End::Pod(BRANCH_POD);
    let own_eni = |end: End| end.eni().expect("a pod on an ENI");
    let (seen_from, links) = match (case.from, case.to) {
        (End::Peer, End::NodePort) => (Some(addrs::PEER_ADDR), Links::of(&[Link::Eth0])),
        // Into a pod from outside the node: replies by the pod's own ENI,
        // un-NATed (conntrack knows the flow came in).
        (End::Peer | End::Onprem, End::Pod(_)) => {
            (Some(case.from.addr()), Links::of(&[own_eni(case.to)]))
        }
        (End::Pod(_), End::ServiceToPeer) => {
            (Some(case.from.addr()), Links::of(&[own_eni(case.from)]))
        }
        (End::Pod(_), End::ServiceToPod) => (Some(case.from.addr()), Links::default()),
        (End::Pod(_), End::Pod(_)) => {
            let links = if is_strict(case.from) || is_strict(case.to) {
                Links::of(&[own_eni(case.from), own_eni(case.to)])
            } else {
                Links::default()
            };
            (Some(case.from.addr()), links)
        }
        (End::Pod(_), End::Peer) => (Some(case.from.addr()), Links::of(&[own_eni(case.from)])),
        (End::Pod(_), End::Onprem | End::Inet) if is_strict(case.from) => {
            let seen = (case.to == End::Onprem).then(|| case.from.addr());
            (seen, Links::of(&[own_eni(case.from)]))
        }
        (End::Pod(_), End::Onprem) if case.mode.onprem_excluded() => {
            (Some(case.from.addr()), Links::of(&[own_eni(case.from)]))
        }
        (End::Pod(_), End::Onprem | End::Inet) => {
            (Some(addrs::NODE_PRIMARY_ADDR), Links::of(&[Link::Eth0]))
        }
        (from, to) => unreachable!("no case from {from:?} to {to:?}"),
    };
    Outcome {
        seen_from,
        reply_from: seen_from.map(|_| case.to.addr()),
        links,
        srcdst_dropped: false,
        igw_dropped: is_strict(case.from) && case.to == End::Inet,
    }
}

/// The router's counters at one moment.
#[derive(Debug, Clone, Copy)]
struct RouterCounts {
    links: [u64; Link::ALL.len()],
    srcdst_drops: u64,
    igw_drops: u64,
}

impl RouterCounts {
    fn read(lab: &Lab, tap: &RouterLinkTap) -> Self {
        let links = tap.read().expect("the router's link counters");
        Self {
            links: links.try_into().expect("a count per link"),
            srcdst_drops: lab.srcdst_check_drops().expect("src/dst check counter"),
            igw_drops: lab.igw_drops().expect("internet gateway counter"),
        }
    }

    /// Which links carried something since `before`.
    fn links_since(&self, before: &Self) -> Links {
        Links::of(
            &Link::ALL
                .iter()
                .zip(self.links.iter().zip(before.links))
                .filter(|(_, (now, then))| *now > then)
                .map(|(link, _)| *link)
                .collect::<Vec<_>>(),
        )
    }
}

/// The whoami servers: one per far end and one per pod.
fn start_servers() -> WhoamiServers<End> {
    let ends = [End::Peer, End::Onprem, End::Inet]
        .into_iter()
        .chain((0..PODS).map(End::Pod));
    WhoamiServers::start(ends, PORT)
}

/// The end whose server answers flows to `to`.
fn server_end(to: End) -> End {
    match to {
        End::NodePort => End::Pod(NODE_PORT_POD),
        End::ServiceToPeer => End::Peer,
        End::ServiceToPod => End::Pod(SERVICE_POD),
        other => other,
    }
}

/// Runs one case and records what happened.
fn probe(lab: &Lab, tap: &RouterLinkTap, servers: &WhoamiServers<End>, case: &Case) -> Outcome {
    let want = expected(case);
    let timeout = if want.reply_from.is_some() {
        REPLY_TIMEOUT
    } else {
        DROP_TIMEOUT
    };
    let seen_timeout = if want.seen_from.is_some() {
        SEEN_TIMEOUT
    } else {
        UNSEEN_TIMEOUT
    };
    let ns = case.from.ns();
    let target = SocketAddrV4::new(case.to.addr(), case.to.port());
    let context = format!(
        "{} {} from {} to {}",
        case.mode.name(),
        case.flow.name(),
        case.from.name(),
        case.to.name()
    );
    let server = servers.at(server_end(case.to));
    // Cases run one after the other: what the server records from now on is
    // this case's.
    server.clear();
    let before = RouterCounts::read(lab, tap);
    let reply_from = case
        .flow
        .run(&ns, target, timeout)
        .unwrap_or_else(|e| panic!("{context}: {e}"));
    let proto = case.flow.proto();
    let seen_from = server
        .wait_for(seen_timeout, |o| o.proto == proto)
        .map(|o| *o.source.ip());
    // Every packet of the flow has been sent by now: the answer came back
    // after the request (TCP: after both FINs), or the client gave up.
    let after = RouterCounts::read(lab, tap);
    Outcome {
        seen_from,
        reply_from,
        links: after.links_since(&before),
        srcdst_dropped: after.srcdst_drops > before.srcdst_drops,
        igw_dropped: after.igw_drops > before.igw_drops,
    }
}

/// Brings the lab up for `mode` on `base`'s datapath and runs every case;
/// `check` runs while the lab is still up.
fn run(mode: Mode, base: LabOptions, check: impl FnOnce(&Lab)) -> Vec<(Case, Outcome)> {
    let lab = Lab::up(&mode.options(base)).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
    for index in 0..PODS {
        let pod = lab.pod(index);
        let eni = End::Pod(index).eni().map(Link::node_side);
        if let Some(eni) = eni {
            assert_eq!(pod.eni, eni, "pod-{index} sits where this test expects");
        }
        assert_eq!(pod.branch.is_some(), BRANCH_PODS.contains(&index));
    }
    let tap = RouterLinkTap::install(&Link::ALL.map(Link::router_side))
        .unwrap_or_else(|e| panic!("counting the node's packets per ENI link: {e}"));
    let servers = start_servers();
    let table = cases(mode)
        .into_iter()
        .map(|case| (case, probe(&lab, &tap, &servers, &case)))
        .collect();
    check(&lab);
    // The probes go before the lab they live in.
    drop(servers);
    drop(tap);
    drop(lab);
    table
}

/// After an eBPF run: the verdicts of every path moved, nothing was
/// dropped, and the VPC router's check saw no packet leave by a wrong ENI.
fn assert_ebpf_counters(lab: &Lab, mode: Mode) {
    let mut moved = vec![
        (Counter::PodToPod, "pod to pod, straight into the pod"),
        (Counter::PodSteered, "out of the pod's own ENI"),
        (Counter::IngressToPod, "from an ENI straight into a pod"),
        (Counter::PodStackFlow, "node port replies back to the stack"),
        (
            Counter::PodOutsideVpc,
            "SNATed and sent out of the primary ENI",
        ),
        (Counter::EgressSnatNew, "SNATed flows"),
        (Counter::IngressRevSnat, "replies translated back"),
        (Counter::PodToService, "to a service, to the stack"),
        (
            Counter::EgressSteered,
            "from the stack out of the pod's own ENI",
        ),
        (
            Counter::EgressDecided,
            "decided by the pod's program, passed by the ENI's",
        ),
    ];
    if mode == Mode::Strict {
        // onprem is excluded from SNAT in the standard lab.
        moved.push((Counter::IngressInboundTracked, "inbound from onprem"));
        moved.push((Counter::PodStrict, "strict pod out of its branch ENI"));
    }
    let stuck: Vec<String> = moved
        .iter()
        .map(|&(counter, what)| (counter, what, lab_counter(counter)))
        .filter(|(_, _, value)| *value == 0)
        .map(|(counter, what, _)| format!("{} ({what})", counter.name()))
        .collect();
    let dropped = lab_drops();
    let strict_in_standard = match mode {
        Mode::Standard => lab_counter(Counter::PodStrict),
        Mode::Strict => 0,
    };
    let srcdst = lab.srcdst_check_drops().expect("src/dst check counter");
    let ok = stuck.is_empty() && dropped.is_empty() && strict_in_standard == 0 && srcdst == 0;
    assert!(
        ok,
        "{} mode, eBPF datapath: counters that should have moved: [{}]; drops: [{}]; \
         pod_strict_branch in standard mode: {strict_in_standard}; VPC src/dst check drops: \
         {srcdst}\n{}",
        mode.name(),
        stuck.join(", "),
        dropped.join(", "),
        agent_cli(&["counters"])
    );
}

#[test]
fn every_routing_path_looks_the_same_in_both_datapaths() {
    let _lab_slot = serial();
    let agent = agent_binary();

    let iptables = differential::reference_half(|| {
        let mut table = Vec::new();
        for mode in Mode::chosen() {
            table.extend(run(mode, LabOptions::iptables(PODS), |lab| {
                let srcdst = lab.srcdst_check_drops().unwrap();
                assert_eq!(srcdst, 0, "the reference dropped by the src/dst check");
            }));
        }
        table
    });
    let mut ebpf = Vec::new();
    for mode in Mode::chosen() {
        ebpf.extend(run(mode, LabOptions::ebpf(PODS, &agent), |lab| {
            assert_ebpf_counters(lab, mode);
        }));
    }

    differential::show_and_assert(
        &format!(
            "\n{PODS} pods: pod-0 on eth0, pods 1 and 4 on eth1, pod-2 on eth2, pods 3 and 5 on \
             branch ENIs; node port in front of pod-1. Strict lab: no SNAT exclusion; standard \
             lab: onprem ({}) excluded. What the far end saw as the source, what came back, and by \
             which of the node's ENIs the packets reached the VPC router (IPv4 packets per router \
             link)",
            addrs::ONPREM_NET
        ),
        iptables.as_deref(),
        &ebpf,
    );
}

/// The rule test's node: 12 pods over 3 ENIs, 3 of them on branch ENIs.
const RULE_PODS: usize = 12;
const RULE_BRANCH_PODS: [usize; 3] = [9, 10, 11];

/// The node's `ip rule` list and each pod's own rules (those naming its
/// address, host veth or branch link).
struct Rules {
    all: Vec<String>,
    per_pod: Vec<(usize, Vec<String>)>,
}

impl Rules {
    fn of(mode: Mode, base: LabOptions) -> Self {
        let opts = LabOptions {
            enis: ENIS,
            branch_pods: RULE_BRANCH_PODS.to_vec(),
            sg_enforcing_mode: mode.enforcing(),
            node_port: Some(NodePortService {
                pod: NODE_PORT_POD,
                target_port: PORT,
            }),
            ..base
        };
        let lab = Lab::up(&opts).unwrap_or_else(|e| panic!("bringing the lab up: {e}"));
        let all = lab.ip_rules().expect("ip rule show");
        let per_pod = lab
            .pods()
            .iter()
            .map(|pod| (pod.index, lab.pod_ip_rules(pod).expect("the pod's rules")))
            .collect();
        drop(lab);
        Self { all, per_pod }
    }

    fn per_pod_counts(&self) -> String {
        self.per_pod
            .iter()
            .map(|(_, rules)| rules.len().to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }
}

/// No `ip rule` per pod with vpcnet: the node keeps the kernel's three
/// rules whatever its pods, ENIs and branch ENIs, in both enforcing modes;
/// the VPC CNI's reference has its rules per pod (512 `to pod`, 1536 `from
/// pod` off the primary ENI, strict mode's two `iif` rules of priority 10).
#[test]
fn no_ip_rule_per_pod_in_ebpf_mode() {
    let _lab_slot = serial();
    let agent = agent_binary();

    println!(
        "\nip rules in the node: {RULE_PODS} pods, pod i on eth(i % 3) but pods {RULE_BRANCH_PODS:?} \
         on branch ENIs (rules per pod, pod-0 first)"
    );
    for mode in Mode::ALL {
        let reference = Rules::of(mode, LabOptions::iptables(RULE_PODS));
        let ours = Rules::of(mode, LabOptions::ebpf(RULE_PODS, &agent));
        for (datapath, rules) in [("iptables (VPC CNI)", &reference), ("ebpf (vpcnet)", &ours)] {
            println!(
                "{:<9} {datapath:<19} {:>3} rules, per pod [{}]",
                mode.name(),
                rules.all.len(),
                rules.per_pod_counts()
            );
        }
        if mode == Mode::Strict {
            println!("iptables `ip rule show`:\n  {}", reference.all.join("\n  "));
            println!("ebpf `ip rule show`:\n  {}", ours.all.join("\n  "));
        }

        assert_eq!(
            ours.all,
            KERNEL_RULES,
            "{} mode, eBPF: the node's ip rules are the kernel's own",
            mode.name()
        );
        for (index, rules) in &ours.per_pod {
            assert!(rules.is_empty(), "eBPF: pod-{index} has ip rules {rules:?}");
        }
        assert_reference_rules(mode, &reference);
    }
}

/// The VPC CNI's rules per pod in the reference.
fn assert_reference_rules(mode: Mode, rules: &Rules) {
    for (index, own) in &rules.per_pod {
        let addr = addrs::pod_addr(*index).expect("a lab pod");
        let branch = RULE_BRANCH_PODS.contains(index);
        let to_pod = format!("512:\tfrom all to {addr} ");
        let want: Vec<String> = if branch && mode == Mode::Strict {
            vec!["10:\tfrom all iif ".to_owned(); 2]
        } else if !branch && index % ENIS == 0 {
            vec![to_pod]
        } else {
            vec![to_pod, format!("1536:\tfrom {addr} ")]
        };
        let matches = own.len() == want.len()
            && own
                .iter()
                .zip(&want)
                .all(|(rule, prefix)| format!("{rule} ").starts_with(prefix.as_str()));
        assert!(
            matches,
            "{} mode, iptables: pod-{index}'s rules {own:?}, expected ones starting {want:?}",
            mode.name()
        );
    }
}
