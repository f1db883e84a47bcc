//! The routing replacement at scale: 4096 pods' worth of routing state and
//! 64 SNAT exclusions on the node, then the lab's own pods still forward
//! right, in both datapaths.
//!
//! - iptables (the VPC CNI): 4096 filler pods' rules 512 and 1536 (8192 ip
//!   rules) installed before the lab's own, so theirs sit last in the list
//!   every packet walks, and 64 exclusions in the SNAT and connmark chains
//!   (the on-premises one evaluated last).
//! - eBPF (vpcnet): 4096 endpoints put in the agent's pinned
//!   `VPCNET_ENDPOINTS` map from this process (addresses of the
//!   custom-networking subnet's top half, which nothing in the lab uses, on
//!   interfaces that exist nowhere, so nothing is ever routed to them), one
//!   lab pod's entry written again after them, and the same 64 exclusions
//!   in the CIDR trie (through the agent's environment). The node still has
//!   no ip rule but the kernel's three.
//!
//! Then, from the pod on `eth2`: `peer` sees its own address, `onprem`
//! (excluded) too, `inet` sees the node's, each by the right ENI; pod to
//! pod on the node works both ways; the VPC router's source/destination
//! check drops nothing. Both datapaths' observations are printed side by
//! side (`-- --nocapture`) with the rule counts, compared and checked.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    time::{Duration, Instant},
};

use ipnet::Ipv4Net;
use vpcnet_bench::fillers::FillerEndpoints;
use vpcnet_bpf_tests::{
    KERNEL_RULES, agent_binary, agent_cli,
    differential::{self, FarEnd, SideBySide, WhoamiServers, lab_drops},
    lab_counter,
};
use vpcnet_common::counters::Counter;
use vpcnet_lab::{
    Datapath, Lab, LabOptions, addrs, exec_ok,
    probe::{RouterLinkTap, WhoamiFlow},
    serial,
};

/// Pods' worth of routing state before (iptables) or besides (eBPF) the
/// lab's own.
const FILLER_PODS: usize = 4096;
/// SNAT exclusions, the on-premises network's among them.
const EXCLUSIONS: usize = 64;
/// The lab's pods: pod-0 on eth0, pod-1 on eth1, pod-2 on eth2.
const PODS: usize = 3;
const ENIS: usize = 3;
/// The pod whose paths are checked, on `eth2`.
const POD: usize = 2;
/// Where every whoami server listens.
const PORT: u16 = 8080;
/// Every flow of this test is expected to be answered: only spent when
/// something is broken.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
const SEEN_TIMEOUT: Duration = Duration::from_secs(1);

/// 63 /24s of the benchmarking range 198.18.0.0/15 (no lab address), after
/// the on-premises network: the VPC CNI inserts each exclusion at the top
/// of its chains, so the first listed is the last evaluated.
fn exclusions() -> Vec<Ipv4Net> {
    let filler = (0..EXCLUSIONS - 1).map(|i| {
        let third = u8::try_from(i).expect("fewer than 256");
        Ipv4Net::new(Ipv4Addr::new(198, 18, third, 0), 24).expect("a /24")
    });
    std::iter::once(addrs::ONPREM_NET).chain(filler).collect()
}

/// Where a flow goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Pod(usize),
    Peer,
    Onprem,
    Inet,
}

impl FarEnd for End {
    fn addr(self) -> Ipv4Addr {
        match self {
            Self::Pod(index) => addrs::pod_addr(index).expect("a lab pod"),
            Self::Peer => addrs::PEER_ADDR,
            Self::Onprem => addrs::ONPREM_ADDR,
            Self::Inet => addrs::INET_ADDR,
        }
    }

    fn ns(self) -> String {
        match self {
            Self::Pod(index) => addrs::pod_ns(index),
            Self::Peer => addrs::NS_PEER.to_owned(),
            Self::Onprem => addrs::NS_ONPREM.to_owned(),
            Self::Inet => addrs::NS_INET.to_owned(),
        }
    }

    fn name(self) -> String {
        match self {
            Self::Pod(index) => format!("pod-{index} (eth{})", index % ENIS),
            Self::Peer => "peer".to_owned(),
            Self::Onprem => "onprem (excluded)".to_owned(),
            Self::Inet => "inet".to_owned(),
        }
    }
}

type Flow = WhoamiFlow;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Case {
    from: End,
    to: End,
    flow: Flow,
}

fn cases() -> Vec<Case> {
    let pod = End::Pod(POD);
    [
        (pod, End::Peer),
        (pod, End::Onprem),
        (pod, End::Inet),
        (pod, End::Pod(1)),
        (End::Pod(0), pod),
    ]
    .into_iter()
    .flat_map(|(from, to)| Flow::ALL.map(|flow| Case { from, to, flow }))
    .collect()
}

impl differential::Row for Case {
    type Outcome = Outcome;

    const COLUMNS: &'static [(&'static str, usize)] = &[("from", 13), ("to", 32), ("flow", 10)];
    const OUTCOME_WIDTH: usize = 40;

    fn cells(&self) -> Vec<String> {
        vec![
            self.from.name(),
            format!("{} {}", self.to.name(), self.to.addr()),
            self.flow.name().to_owned(),
        ]
    }

    fn describe(&self, outcome: &Outcome) -> String {
        outcome.describe()
    }

    fn expected(&self) -> Outcome {
        expected(self)
    }
}

/// What one flow did.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Outcome {
    /// The source the far end saw.
    seen_from: Option<Ipv4Addr>,
    /// Whether the answer came back.
    answered: bool,
    /// The ENIs by which the flow's packets reached the VPC router.
    left_by: Vec<String>,
    /// Packets the router's source/destination check dropped meanwhile.
    srcdst_drops: u64,
}

impl Outcome {
    fn describe(&self) -> String {
        let seen = self
            .seen_from
            .map_or_else(|| "not reached".to_owned(), |addr| format!("saw {addr}"));
        let back = if self.answered {
            "reply"
        } else {
            "nothing back"
        };
        let by = if self.left_by.is_empty() {
            "within the node".to_owned()
        } else {
            format!("out {}", self.left_by.join("+"))
        };
        let drops = match self.srcdst_drops {
            0 => String::new(),
            n => format!(", {n} SRC/DST CHECK DROPS"),
        };
        format!("{seen}, {back}, {by}{drops}")
    }
}

/// The VPC CNI with 64 exclusions: to the VPC and excluded CIDRs the pod's
/// own address by its own ENI, elsewhere the node's by eth0; pod to pod
/// within the node.
fn expected(case: &Case) -> Outcome {
    let own_eni = |end: End| match end {
        End::Pod(index) => addrs::eni_ifname(index % ENIS),
        _ => unreachable!("flows start at pods"),
    };
    let (seen_from, left_by) = match case.to {
        End::Pod(_) => (case.from.addr(), Vec::new()),
        End::Peer | End::Onprem => (case.from.addr(), vec![own_eni(case.from)]),
        End::Inet => (addrs::NODE_PRIMARY_ADDR, vec![addrs::eni_ifname(0)]),
    };
    Outcome {
        seen_from: Some(seen_from),
        answered: true,
        left_by,
        srcdst_drops: 0,
    }
}

/// A whoami server at every end a flow goes to.
fn start_servers() -> WhoamiServers<End> {
    let ends = [End::Peer, End::Onprem, End::Inet]
        .into_iter()
        .chain((0..PODS).map(End::Pod));
    WhoamiServers::start(ends, PORT)
}

/// The router's links to the node's ENIs, eth0 first.
fn eni_links() -> Vec<String> {
    (0..ENIS).map(addrs::vpc_eni_link).collect()
}

fn probe(lab: &Lab, tap: &RouterLinkTap, servers: &WhoamiServers<End>, case: &Case) -> Outcome {
    let ns = case.from.ns();
    let target = SocketAddrV4::new(case.to.addr(), PORT);
    let context = format!(
        "{} from {} to {}",
        case.flow.name(),
        case.from.name(),
        case.to.name()
    );
    let server = servers.at(case.to);
    server.clear();
    let read = || {
        (
            tap.read().expect("the router's link counters"),
            lab.srcdst_check_drops().expect("src/dst check counter"),
        )
    };
    let (links_before, drops_before) = read();
    let answered = case
        .flow
        .run(&ns, target, REPLY_TIMEOUT)
        .unwrap_or_else(|e| panic!("{context}: {e}"))
        .is_some();
    let proto = case.flow.proto();
    let seen_from = server
        .wait_for(SEEN_TIMEOUT, |o| o.proto == proto)
        .map(|o| *o.source.ip());
    // Every packet of the flow was sent before its answer came (TCP: both
    // FINs).
    let (links_after, drops_after) = read();
    let left_by = (0..ENIS)
        .filter(|&device| links_after[device] > links_before[device])
        .map(addrs::eni_ifname)
        .collect();
    Outcome {
        seen_from,
        answered,
        left_by,
        srcdst_drops: drops_after - drops_before,
    }
}

/// What one datapath's run gave.
struct Run {
    table: Vec<(Case, Outcome)>,
    /// Rules in the node's `ip rule` list.
    rules: usize,
    /// Entries in the node's routing state besides rules: the endpoint map's
    /// (eBPF).
    endpoints: Option<usize>,
    up: Duration,
}

fn run(datapath: Datapath, agent: &Path) -> Run {
    let base = match datapath {
        Datapath::Iptables => LabOptions {
            filler_pods: FILLER_PODS,
            ..LabOptions::iptables(PODS)
        },
        Datapath::Ebpf => LabOptions::ebpf(PODS, agent),
        Datapath::Routed => unreachable!("this test compares the two NAT datapaths"),
    };
    let options = LabOptions {
        enis: ENIS,
        exclude_snat_cidrs: exclusions(),
        ..base
    };
    let started = Instant::now();
    let lab = Lab::up(&options).unwrap_or_else(|e| panic!("bringing the {datapath} lab up: {e}"));
    let up = started.elapsed();
    assert_eq!(lab.pod(POD).eni, "eth2");
    let fillers = (datapath == Datapath::Ebpf).then(|| {
        let mut fillers = FillerEndpoints::insert(FILLER_PODS).expect("the filler endpoints");
        fillers
            .rewrite_last(lab.pod(POD).addr)
            .expect("the pod's entry written again");
        fillers
    });
    let endpoints = fillers
        .as_ref()
        .map(|fillers| fillers.count().expect("counting the endpoints"));
    let rules = lab.ip_rules().expect("ip rule show");
    match &fillers {
        None => assert_reference_state(&lab, &rules),
        Some(fillers) => assert_ebpf_state(&rules, fillers),
    }

    let tap = RouterLinkTap::install(&eni_links())
        .unwrap_or_else(|e| panic!("counting the node's packets per ENI link: {e}"));
    let servers = start_servers();
    let table = cases()
        .into_iter()
        .map(|case| (case, probe(&lab, &tap, &servers, &case)))
        .collect();
    if datapath == Datapath::Ebpf {
        assert_ebpf_counters();
    }
    drop(servers);
    drop(tap);
    if let Some(fillers) = fillers {
        assert_eq!(
            fillers.remove().expect("removing the fillers"),
            PODS,
            "the lab's own endpoints are left"
        );
    }
    drop(lab);
    Run {
        table,
        rules: rules.len(),
        endpoints,
        up,
    }
}

/// The reference as the scale asks: the filler rules first, the pod's own
/// last, and the 64 exclusions in the SNAT chain.
fn assert_reference_state(lab: &Lab, rules: &[String]) {
    let pod = lab.pod(POD);
    let own = lab.pod_ip_rules(pod).expect("the pod's rules");
    let last_512 = rules.iter().rposition(|r| r.starts_with("512:"));
    let last_1536 = rules.iter().rposition(|r| r.starts_with("1536:"));
    let last = [last_512, last_1536].map(|at| rules[at.expect("rules 512 and 1536")].clone());
    assert_eq!(own, last, "pod-{POD}'s rules sit last");
    // 2 per filler pod; 512 for each lab pod and 1536 for pods 1 and 2;
    // 1024; 32765 for eth1 and eth2; the kernel's 0, 32766 and 32767.
    assert_eq!(rules.len(), 2 * FILLER_PODS + PODS + 2 + 1 + 2 + 3);
    let snat = exec_ok(
        addrs::NS_NODE,
        &[
            lab.options().iptables_backend.iptables(),
            "-t",
            "nat",
            "-S",
            "AWS-SNAT-CHAIN-0",
        ],
    )
    .expect("the SNAT chain");
    let returns = snat.lines().filter(|l| l.ends_with("-j RETURN")).count();
    assert_eq!(returns, EXCLUSIONS + addrs::VPC_CIDRS.len(), "{snat}");
}

/// The eBPF node: no rule but the kernel's, every filler in the endpoint
/// map, every exclusion in the CIDR trie.
fn assert_ebpf_state(rules: &[String], fillers: &FillerEndpoints) {
    assert_eq!(rules, KERNEL_RULES, "the eBPF node's ip rules");
    assert_eq!(
        fillers.count().expect("counting the endpoints"),
        FILLER_PODS + PODS,
        "endpoint map entries"
    );
    assert_eq!(
        fillers.exclusions().expect("counting the exclusions"),
        EXCLUSIONS,
        "excluded CIDRs in the trie"
    );
}

/// The fast paths took the flows and nothing was dropped.
fn assert_ebpf_counters() {
    for counter in [
        Counter::PodToPod,
        Counter::PodSteered,
        Counter::PodOutsideVpc,
        Counter::EgressSnatNew,
        Counter::IngressToPod,
    ] {
        let value = lab_counter(counter);
        assert!(value > 0, "{} is {value}", counter.name());
    }
    let dropped = lab_drops();
    assert!(
        dropped.is_empty(),
        "the eBPF datapath dropped packets: {}\n{}",
        dropped.join(", "),
        agent_cli(&["counters"])
    );
}

#[test]
fn pods_forward_right_behind_4096_pods_and_64_exclusions() {
    let _lab_slot = serial();
    let agent = agent_binary();

    let iptables = run(Datapath::Iptables, &agent);
    let ebpf = run(Datapath::Ebpf, &agent);

    println!(
        "\n{FILLER_PODS} pods' worth of routing state and {EXCLUSIONS} SNAT exclusions; pod-{POD} \
         ({}) on eth2\n{}",
        addrs::pod_addr(POD).expect("a lab pod"),
        SideBySide {
            iptables: Some(&iptables.table),
            ebpf: &ebpf.table,
        }
    );
    println!(
        "iptables (VPC CNI): {} ip rules in the node (lab up in {:.1?})\n\
         ebpf (vpcnet):      {} ip rules in the node, {} endpoints in VPCNET_ENDPOINTS (lab up \
         in {:.1?})",
        iptables.rules,
        iptables.up,
        ebpf.rules,
        ebpf.endpoints.unwrap_or_default(),
        ebpf.up,
    );

    let problems = differential::wrong_rows(Some(&iptables.table), &ebpf.table);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
