//! Taking a node over from aws-node, and handing it back. The lab wires
//! its pods as the VPC CNI does (`--datapath iptables`: aws-node's chains,
//! connmark, rules 512/1024, its checkpoint and the addresses in EC2).
//! The agent then starts on that node: every pod keeps its address, and
//! connections through SNAT, to the VPC and pod to pod keep going, the
//! SNATed one on the same port, while aws-node's rules go. `vpcnet-agent
//! uninstall` then writes them back as they were, hands the translated
//! connections to conntrack and detaches the datapath, and the same
//! connections still keep going. aws-node's branch-ENI pods (security
//! groups for pods), read back from its VLAN tables and rules, are adopted
//! and handed back the same way, in both enforcing modes.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test take_over -- --test-threads=1 --nocapture`.

use std::{
    collections::BTreeSet,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_bpf_tests::{
    agent_binary,
    echo::{EchoStream, FarEnds},
    ipam::FAST_AGENT_ARGS,
};
use vpcnet_common::{
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT},
    maps::PIN_DIR,
    raw_to_port,
};
use vpcnet_lab::{
    EnforcingMode, IpamLabOptions, Lab, LabOptions, ScratchDir, addrs, ec2::EmulatorProcess,
    ipam_checkpoint_file, netns::netns_path, serial, tcp_whoami,
};

const PORT: u16 = 8080;
const ECHOES: u64 = 100;
const PODS: usize = 3;

/// aws-node's conflist as it installs it (the content does not matter
/// here, only that the runtime would pick it).
const AWS_CONFLIST: &str =
    r#"{"cniVersion":"1.0.0","name":"aws-cni","plugins":[{"type":"aws-cni"}]}"#;

/// What aws-node wired on the node: its iptables rules (nat and mangle,
/// as `iptables -S` lists them) and the ip rules.
fn node_wiring(lab: &Lab) -> BTreeSet<String> {
    let mut wiring = BTreeSet::new();
    for table in ["nat", "mangle"] {
        let listing = lab
            .exec_ok(addrs::NS_NODE, &["iptables", "-w", "-t", table, "-S"])
            .expect("iptables -S");
        wiring.extend(listing.lines().map(|line| format!("{table} {line}")));
    }
    wiring.extend(lab.ip_rules().expect("ip rule"));
    wiring
}

/// The parts of the node's wiring that are aws-node's.
fn aws_node_parts(wiring: &BTreeSet<String>) -> Vec<&String> {
    wiring
        .iter()
        .filter(|line| {
            line.contains("AWS")
                || line.starts_with("10:")
                || line.starts_with("512:")
                || line.starts_with("1024:")
                || line.starts_with("1536:")
        })
        .collect()
}

/// The SNAT flows of the datapath: pod port to translated port.
fn datapath_snat_ports() -> Vec<(u16, u16)> {
    DatapathMaps::open_pinned(Path::new(PIN_DIR))
        .and_then(|maps| maps.flows())
        .expect("reading the NAT table")
        .into_iter()
        .filter(|flow| flow.kind() == Some(vpcnet_common::nat::FlowKind::Snat))
        .map(|flow| (raw_to_port(flow.key.sport), raw_to_port(flow.fwd.port)))
        .collect()
}

/// A node aws-node ran, as `opts` (the iptables datapath) wires it, with
/// aws-node's conflist in a CNI configuration directory the agent writes
/// its own to.
fn aws_node_lab(opts: LabOptions) -> (Lab, ScratchDir) {
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let conf_dir = ScratchDir::new("vpcnet-take-over-cni").expect("a CNI conf dir");
    std::fs::write(conf_dir.path().join("10-aws.conflist"), AWS_CONFLIST).unwrap();
    let mut ipam = IpamLabOptions::new("m5.large");
    ipam.agent_args = FAST_AGENT_ARGS
        .iter()
        .map(|a| (*a).to_owned())
        .chain([
            "--cni-conf-dir".to_owned(),
            conf_dir.path().display().to_string(),
        ])
        .collect();
    let opts = LabOptions {
        ipam: Some(ipam),
        agent_bin: Some(agent_binary()),
        ..opts
    };
    let lab = Lab::up(&opts).expect("an aws-node node");
    (lab, conf_dir)
}

/// Runs `vpcnet-agent uninstall` in the node as an operator would, with
/// the agent's environment; its standard output.
fn uninstall(conf_dir: &Path) -> String {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns_path(addrs::NS_NODE).display()))
        .arg("--")
        .arg(agent_binary())
        .args(["uninstall", "--cni-conf-dir"])
        .arg(conf_dir)
        .args(["--cni-socket"])
        .arg(vpcnet_lab::cni_socket_file())
        .envs(EmulatorProcess::agent_env())
        .env("AWS_VPC_K8S_CNI_BACKING_STORE", ipam_checkpoint_file())
        .output()
        .expect("running vpcnet-agent uninstall");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "uninstall failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[allow(clippy::too_many_lines, reason = "one story, told in order")]
#[test]
fn aws_node_pods_keep_addresses_and_connections_through_take_over_and_uninstall() {
    let _lock = serial();
    let (mut lab, conf_dir) = aws_node_lab(LabOptions::iptables(PODS));
    let pods = lab.pods().to_vec();
    let aws_node = node_wiring(&lab);
    let aws_parts = aws_node_parts(&aws_node);
    assert!(
        aws_parts.iter().any(|l| l.contains("-N AWS-SNAT-CHAIN-0"))
            && aws_parts.iter().filter(|l| l.starts_with("512:")).count() == PODS,
        "aws-node's wiring: {aws_parts:#?}"
    );

    let FarEnds {
        inet,
        peer,
        pod: pod_server,
    } = FarEnds::start(&pods[2], PORT);
    let snat = EchoStream::open(&pods[0].netns, inet.addr());
    assert_eq!(
        *snat.seen_as.ip(),
        addrs::NODE_PRIMARY_ADDR,
        "SNATed by iptables"
    );
    let to_vpc = EchoStream::open(&pods[1].netns, peer.addr());
    assert_eq!(*to_vpc.seen_as.ip(), pods[1].addr, "to the VPC, unNATed");
    let pod_to_pod = EchoStream::open(&pods[0].netns, pod_server.addr());
    let streams = [
        ("SNAT", &snat),
        ("VPC", &to_vpc),
        ("pod to pod", &pod_to_pod),
    ];
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} under aws-node's wiring"));
    }

    // The take-over.
    let started = Instant::now();
    lab.start_agent()
        .expect("starting the agent on aws-node's node");
    println!(
        "agent ready on aws-node's node in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} after the take-over"));
    }
    let maps = DatapathMaps::open_pinned(Path::new(PIN_DIR)).expect("the agent's maps");
    for pod in &pods {
        let entry = maps
            .endpoint(pod.addr)
            .expect("reading the endpoints")
            .unwrap_or_else(|| panic!("{} ({}) was not adopted", pod.k8s_name, pod.addr));
        let veth = vpcnet_lab::run_in(addrs::NS_NODE, || {
            nix::net::if_::if_nametoindex(pod.host_veth.as_str())
        })
        .expect("entering the node")
        .expect("the pod's veth");
        assert_eq!(
            entry.ifindex, veth,
            "{} adopted on its own veth",
            pod.k8s_name
        );
    }
    drop(maps);
    let snat_ports = datapath_snat_ports();
    assert!(
        snat_ports
            .iter()
            .any(|(_, nat)| *nat == snat.seen_as.port()),
        "the SNAT connection kept its port {} in the datapath: {snat_ports:?}",
        snat.seen_as.port()
    );
    let taken_over = node_wiring(&lab);
    let left = aws_node_parts(&taken_over);
    assert!(
        left.is_empty(),
        "aws-node's wiring left after the take-over: {left:#?}"
    );
    assert!(conf_dir.path().join("10-vpcnet.conflist").is_file());
    assert!(
        !conf_dir.path().join("10-aws.conflist").exists(),
        "aws-node's conflist set aside"
    );
    let fresh = tcp_whoami(&pods[0].netns, inet.addr(), Duration::from_secs(3))
        .expect("a new connection to the internet")
        .expect("an answer from the internet");
    assert_eq!(
        *fresh.ip(),
        addrs::NODE_PRIMARY_ADDR,
        "SNATed by the datapath"
    );
    println!(
        "taken over: {PODS} pods adopted, SNAT port {} kept, aws-node's rules removed ({} lines)",
        snat.seen_as.port(),
        aws_parts.len()
    );

    // The hand-back.
    lab.stop_agent().expect("stopping the agent");
    let said = uninstall(conf_dir.path());
    println!("uninstall: {}", said.trim());
    assert!(!Path::new(PIN_DIR).exists(), "the datapath's pins are gone");
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} after uninstall"));
    }
    let handed_back = node_wiring(&lab);
    assert_eq!(
        aws_node_parts(&handed_back),
        aws_parts,
        "aws-node's wiring is back as it was"
    );
    assert!(conf_dir.path().join("10-aws.conflist").is_file());
    assert!(!conf_dir.path().join("10-vpcnet.conflist").exists());
    let fresh = tcp_whoami(&pods[0].netns, inet.addr(), Duration::from_secs(3))
        .expect("a new connection after uninstall")
        .expect("an answer after uninstall");
    assert_eq!(
        *fresh.ip(),
        addrs::NODE_PRIMARY_ADDR,
        "SNATed by iptables again"
    );
    let conntrack = lab
        .exec_ok(
            addrs::NS_NODE,
            &["conntrack", "-L", "-p", "tcp", "--dport", &PORT.to_string()],
        )
        .expect("conntrack -L");
    let entry = conntrack
        .lines()
        .find(|line| line.contains(&format!("dport={} ", snat.seen_as.port())))
        .unwrap_or_else(|| panic!("the SNAT connection is conntrack's again: {conntrack}"));
    assert!(
        entry.contains("mark=128"),
        "with aws-node's connmark: {entry}"
    );
    // A second run (an init container restarted) changes nothing.
    let again = uninstall(conf_dir.path());
    assert!(again.contains("no rules to write back"), "{again}");
    assert_eq!(
        node_wiring(&lab),
        handed_back,
        "a second uninstall changed the node"
    );
    let echoed: Vec<u64> = [snat, to_vpc, pod_to_pod].map(EchoStream::close).to_vec();
    println!(
        "connections closed cleanly after take-over and uninstall: {echoed:?} echoes, 0 broken"
    );
    lab.down().expect("lab down");
}

/// The routes of a VLAN table (`table <n>: <route>` lines).
fn table_routes(lab: &Lab, table: u32) -> BTreeSet<String> {
    lab.exec_ok(
        addrs::NS_NODE,
        &["ip", "-4", "route", "show", "table", &table.to_string()],
    )
    .expect("ip route")
    .lines()
    .map(|line| format!("table {table}: {line}"))
    .collect()
}

/// aws-node's branch-ENI pod (security groups for pods) in `mode`: adopted
/// with its VLAN link, its connections kept, its rules 10 (strict) or 512
/// and 1536 (standard) removed; handed back with its VLAN table and rules
/// as the plugin wrote them.
fn branch_pod_take_over_and_hand_back(mode: EnforcingMode) {
    let (mut lab, conf_dir) = aws_node_lab(LabOptions {
        branch_pods: vec![1],
        sg_enforcing_mode: mode,
        ..LabOptions::iptables(2)
    });
    let pods = lab.pods().to_vec();
    let (plain, branch) = (&pods[0], &pods[1]);
    let vlan = branch.branch.as_ref().expect("pod-1 has a branch ENI");
    let wiring = |lab: &Lab| {
        let mut wiring = node_wiring(lab);
        wiring.extend(table_routes(lab, vlan.route_table));
        wiring
    };
    let aws_node = wiring(&lab);
    let aws_parts: Vec<String> = aws_node_parts(&aws_node).into_iter().cloned().collect();
    let vlan_rules = aws_parts.iter().filter(|l| l.starts_with("10:")).count();
    let strict = mode == EnforcingMode::Strict;
    assert_eq!(vlan_rules, if strict { 2 } else { 0 }, "{aws_parts:#?}");

    let FarEnds {
        peer,
        pod: branch_server,
        ..
    } = FarEnds::start(branch, PORT);
    let to_peer = EchoStream::open(&branch.netns, peer.addr());
    assert_eq!(*to_peer.seen_as.ip(), branch.addr, "by its branch ENI");
    let into_branch = EchoStream::open(&plain.netns, branch_server.addr());
    let streams = [
        ("branch pod to peer", &to_peer),
        ("pod-0 to branch pod", &into_branch),
    ];
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} under aws-node's wiring"));
    }

    lab.start_agent()
        .expect("starting the agent on aws-node's node");
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} after the take-over"));
    }
    let maps = DatapathMaps::open_pinned(Path::new(PIN_DIR)).expect("the agent's maps");
    let entry = maps
        .endpoint(branch.addr)
        .expect("reading the endpoints")
        .expect("the branch pod adopted");
    let index = |name: &str| {
        vpcnet_lab::run_in(addrs::NS_NODE, || nix::net::if_::if_nametoindex(name))
            .expect("entering the node")
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    assert_eq!(entry.ifindex, index(&branch.host_veth), "on its own veth");
    assert_eq!(
        entry.eni_ifindex,
        index(&vlan.link),
        "leaving by its VLAN link"
    );
    let want = if strict {
        ENDPOINT_BRANCH | ENDPOINT_STRICT
    } else {
        ENDPOINT_BRANCH
    };
    assert_eq!(entry.flags, want, "{mode:?}");
    drop(maps);
    let taken_over = wiring(&lab);
    let left: Vec<&String> = aws_node_parts(&taken_over)
        .into_iter()
        .filter(|line| {
            line.starts_with("10:")
                || line
                    .split_whitespace()
                    .any(|word| word == branch.addr.to_string())
        })
        .collect();
    assert!(
        left.is_empty(),
        "{mode:?}: the branch pod's rules left: {left:#?}"
    );

    lab.stop_agent().expect("stopping the agent");
    let said = uninstall(conf_dir.path());
    println!("{mode:?}: uninstall: {}", said.trim());
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} after uninstall"));
    }
    let back = wiring(&lab);
    assert_eq!(
        aws_node_parts(&back),
        aws_parts.iter().collect::<Vec<_>>(),
        "{mode:?}: aws-node's wiring is back as it was"
    );
    assert_eq!(
        table_routes(&lab, vlan.route_table),
        table_routes_of(&aws_node, vlan.route_table),
        "{mode:?}: the VLAN table as the plugin wrote it"
    );
    let echoed: Vec<u64> = [to_peer, into_branch].map(EchoStream::close).to_vec();
    println!("{mode:?}: branch pod taken over and handed back: {echoed:?} echoes, 0 broken");
    lab.down().expect("lab down");
}

/// The `table <n>` lines of a wiring.
fn table_routes_of(wiring: &BTreeSet<String>, table: u32) -> BTreeSet<String> {
    let prefix = format!("table {table}: ");
    wiring
        .iter()
        .filter(|line| line.starts_with(&prefix))
        .cloned()
        .collect()
}

#[test]
fn aws_node_branch_pods_are_taken_over_and_handed_back_in_both_modes() {
    let _lock = serial();
    for mode in [EnforcingMode::Strict, EnforcingMode::Standard] {
        branch_pod_take_over_and_hand_back(mode);
    }
}

/// The network policy agent's pins, as it names them: one program per
/// direction of each pod it enforces policies on.
const NETWORK_POLICY_PINS: [&str; 2] = [
    "web-7d4b9-default_handle_ingress",
    "web-7d4b9-default_handle_egress",
];

#[test]
fn a_node_where_aws_node_enforced_network_policy_is_taken_over_only_knowingly() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    // The pins' directory as the agent reads it (names only: a directory
    // the test owns stands in for the machine's bpffs).
    let pins = ScratchDir::new("vpcnet-np-pins").expect("a pin directory");
    for name in NETWORK_POLICY_PINS {
        std::fs::write(pins.path().join(name), "").unwrap();
    }
    let mut ipam = IpamLabOptions::new("m5.large");
    ipam.agent_args = FAST_AGENT_ARGS
        .iter()
        .map(|a| (*a).to_owned())
        .chain([
            "--network-policy-pins".to_owned(),
            pins.path().display().to_string(),
        ])
        .collect();
    let opts = LabOptions {
        ipam: Some(ipam),
        agent_bin: Some(agent_binary()),
        ..LabOptions::iptables(2)
    };
    let mut lab = Lab::up(&opts).expect("an aws-node node");
    let aws_node = node_wiring(&lab);

    let refused = lab
        .start_agent()
        .expect_err("the agent refuses the node")
        .to_string();
    assert!(
        refused.contains(
            "aws-node's network policy agent enforced NetworkPolicy on this node (2 programs pinned"
        ) && refused
            .contains("set VPCNET_TAKE_OVER_NETWORK_POLICY_NODE=true to take it over knowingly"),
        "{refused}"
    );
    assert_eq!(node_wiring(&lab), aws_node, "the refusal changed the node");

    lab.set_agent_env("VPCNET_TAKE_OVER_NETWORK_POLICY_NODE", "true")
        .unwrap();
    lab.start_agent().expect("taken over knowingly");
    let log = std::fs::read_to_string(lab.agent_log().unwrap()).unwrap();
    assert!(
        log.contains(
            "taking over a node where aws-node's network policy agent enforced NetworkPolicy"
        ),
        "{log}"
    );
    assert!(
        aws_node_parts(&node_wiring(&lab)).is_empty(),
        "aws-node's wiring left after the take-over"
    );
    lab.down().unwrap();
}
