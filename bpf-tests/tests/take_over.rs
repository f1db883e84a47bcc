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
//! and handed back the same way, in both enforcing modes. A node where
//! aws-node's network policy agent enforced a policy (the lab's
//! reproduction of its programs, `vpcnet_bpf_tests::aws_policy_agent`) is
//! taken over with no gap: a denied pod knocking all along is never
//! answered, the pods' connections go on, and a UDP conversation whose far
//! end speaks first after the take-over is heard, on TCX and on clsact.
//! A take-over killed at any of its steps (SIGKILL, the agent's test hook)
//! and started again, as the kubelet does, loses no connection either, and
//! leaves nothing of aws-node's wiring.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test take_over -- --test-threads=1 --nocapture`.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket},
    path::Path,
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use vpcnet_agent::{
    crash_points::ENV_CRASH_AT,
    datapath::{AttachMode, DatapathMaps, tc::ENV_TC_ATTACH},
};
use vpcnet_api::{
    aws_network_policy::pod_identifier, policy_endpoint::PolicyEndpointSpec, vpc_cni,
};
use vpcnet_bpf_tests::{
    agent_binary,
    aws_node_wiring::{self, AWS_CONFLIST, aws_node_parts, datapath_snat_ports, wiring_in},
    aws_policy_agent::AwsPolicyAgent,
    crashes::{killed_itself, one_program_per_hook},
    echo::{EchoStream, FarEnds, NodeConnections},
    half_closed::{HalfClosed, await_node_state},
    ipam::FAST_AGENT_ARGS,
};
use vpcnet_common::{
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT},
    maps::PIN_DIR,
};
use vpcnet_lab::{
    Datapath, EnforcingMode, IpamLabOptions, IptablesBackend, Lab, LabOptions, ScratchDir,
    WhoamiServer, addrs, cluster, ec2::EmulatorProcess, ipam_checkpoint_file, netns::netns_path,
    serial, tcp_whoami,
};

const PORT: u16 = 8080;
/// The port of the server that answers a half-closed connection late.
const HALF_CLOSED_PORT: u16 = 8081;
/// The node's `nf_conntrack_tcp_timeout_fin_wait`, and the agent's
/// collection interval, in the take-over: a connection taken for FIN_WAIT
/// would be gone after the wait.
const FIN_WAIT: Duration = Duration::from_secs(2);
const GC_INTERVAL: Duration = Duration::from_secs(1);
const ECHOES: u64 = 100;
const PODS: usize = 3;

/// What aws-node wired on the node (see [`wiring_in`]).
fn node_wiring(lab: &Lab) -> BTreeSet<String> {
    wiring_in(lab.options().iptables_backend)
}

/// The backend the node does not use holds nothing of aws-node's.
fn assert_other_backend_clean(lab: &Lab, when: &str) {
    aws_node_wiring::assert_other_backend_clean(lab.options().iptables_backend, when);
}

/// A node aws-node ran, as `opts` (the iptables datapath) wires it, with
/// aws-node's conflist in a CNI configuration directory the agent writes
/// its own to (the address manager as `opts.ipam` says, or the defaults).
fn aws_node_lab(opts: LabOptions) -> (Lab, ScratchDir) {
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let conf_dir = ScratchDir::new("vpcnet-take-over-cni").expect("a CNI conf dir");
    std::fs::write(conf_dir.path().join("10-aws.conflist"), AWS_CONFLIST).unwrap();
    let mut ipam = opts
        .ipam
        .clone()
        .unwrap_or_else(|| IpamLabOptions::new("m5.large"));
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
    uninstall_with(&["--cni-conf-dir".as_ref(), conf_dir.as_os_str()])
}

/// [`uninstall`] with `args`.
fn uninstall_with(args: &[&std::ffi::OsStr]) -> String {
    let output = Command::new("nsenter")
        .arg(format!("--net={}", netns_path(addrs::NS_NODE).display()))
        .arg("--")
        .arg(agent_binary())
        .arg("uninstall")
        .args(args)
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

#[test]
fn aws_node_pods_keep_addresses_and_connections_through_take_over_and_uninstall_legacy() {
    take_over_and_uninstall(IptablesBackend::Legacy);
}

#[test]
fn aws_node_pods_keep_addresses_and_connections_through_take_over_and_uninstall_nft() {
    take_over_and_uninstall(IptablesBackend::Nft);
}

/// aws-node's pod on the node, as its DaemonSet makes it.
const AWS_NODE_POD: &str = "aws-node-x7k2p";

/// The agent never runs beside aws-node's ipamd: while ipamd's socket
/// answers or aws-node's pod is on the node, it changes nothing and says
/// why it is not ready; once both are gone it takes the node over.
#[test]
fn the_agent_waits_while_aws_nodes_ipamd_runs_on_the_node() {
    let _lock = serial();
    let mut ipam = IpamLabOptions::new("m5.large");
    ipam.kube_api = true;
    let (mut lab, _conf_dir) = aws_node_lab(LabOptions {
        ipam: Some(ipam),
        ..LabOptions::iptables(PODS)
    });
    let files = lab.kube_api().unwrap().files().clone();
    let aws_node_pod = format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {AWS_NODE_POD}\n  namespace: kube-system\n  \
         labels: {{k8s-app: aws-node}}\nspec:\n  nodeName: {}\n  hostNetwork: true\n  \
         containers: [{{name: aws-node, image: amazon-k8s-cni}}]\n",
        cluster::node_name()
    );
    cluster::kubectl(&files, &["apply", "-f", "-"], Some(&aws_node_pod)).expect("aws-node's pod");
    // ipamd's gRPC socket, as it listens in the node's namespace.
    let ipamd = vpcnet_lab::run_in(addrs::NS_NODE, || {
        std::net::TcpListener::bind(vpc_cni::IPAMD_GRPC_ADDRESS)
    })
    .expect("entering the node")
    .expect("ipamd's socket");
    let backend = lab.options().iptables_backend;
    let aws_node = wiring_in(backend);

    std::thread::scope(|scope| {
        let starting = scope.spawn(|| lab.start_agent());
        let waiting = agent_probe_until(|said| said.contains("ipamd runs on this node"));
        assert!(
            waiting.contains(&format!("its socket {}", vpc_cni::IPAMD_GRPC_ADDRESS))
                && waiting.contains(&format!("kube-system/{AWS_NODE_POD}")),
            "the agent says why it waits: {waiting}"
        );
        println!("while ipamd runs, the readiness probe: {}", waiting.trim());
        assert_eq!(
            wiring_in(backend),
            aws_node,
            "nothing changed while ipamd runs"
        );
        assert!(!Path::new(PIN_DIR).exists(), "no datapath while ipamd runs");
        // ipamd stops; its pod is still on the node (terminating).
        drop(ipamd);
        let pod_only = agent_probe_until(|said| !said.contains("its socket"));
        assert!(
            pod_only.contains(AWS_NODE_POD) && pod_only.contains("not ready"),
            "{pod_only}"
        );
        assert_eq!(
            wiring_in(backend),
            aws_node,
            "nothing changed while its pod is there"
        );
        cluster::kubectl(
            &files,
            &["delete", "pod", "-n", "kube-system", AWS_NODE_POD],
            None,
        )
        .expect("aws-node's pod goes");
        starting
            .join()
            .expect("the starting thread")
            .expect("the agent ready once ipamd is gone");
    });
    let left = node_wiring(&lab);
    assert!(
        aws_node_parts(&left).is_empty(),
        "taken over once ipamd was gone: {:#?}",
        aws_node_parts(&left)
    );
    lab.down().expect("lab down");
}

/// What `vpcnet-agent probe --ready` says (its error when not ready),
/// asked every half second until `until` holds of it (30 s at most): what
/// kubelet's readiness probe sees.
fn agent_probe_until(until: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let output = Command::new("nsenter")
            .arg(format!("--net={}", netns_path(addrs::NS_NODE).display()))
            .arg("--")
            .arg(agent_binary())
            .args(["probe", "--ready", "--cni-socket"])
            .arg(vpcnet_lab::cni_socket_file())
            .output()
            .expect("running vpcnet-agent probe");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if until(&said) {
            return said;
        }
        assert!(Instant::now() < deadline, "the probe never said so: {said}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A node whose kubelet, kube-proxy and aws-node use `backend`: the agent
/// takes it over and `vpcnet-agent uninstall` hands it back, in that
/// backend, every pod keeping its address and connections.
#[allow(clippy::too_many_lines, reason = "one story, told in order")]
fn take_over_and_uninstall(backend: IptablesBackend) {
    let _lock = serial();
    let (mut lab, conf_dir) = aws_node_lab(LabOptions {
        iptables_backend: backend,
        agent_env: vec![(
            "VPCNET_GC_INTERVAL".to_owned(),
            GC_INTERVAL.as_secs().to_string(),
        )],
        ..LabOptions::iptables(PODS)
    });
    let pods = lab.pods().to_vec();
    let aws_node = node_wiring(&lab);
    let aws_parts = aws_node_parts(&aws_node);
    assert!(
        aws_parts.iter().any(|l| l.contains("-N AWS-SNAT-CHAIN-0"))
            && aws_parts.iter().filter(|l| l.starts_with("512:")).count() == PODS,
        "aws-node's wiring in {backend}: {aws_parts:#?}"
    );
    assert_other_backend_clean(&lab, "under aws-node");

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
    // A connection the pod half-closed, answered only after the hand-back:
    // in CLOSE_WAIT all along, however short FIN_WAIT is.
    lab.exec_ok(
        addrs::NS_NODE,
        &[
            "sysctl",
            "-w",
            &format!(
                "net.netfilter.nf_conntrack_tcp_timeout_fin_wait={}",
                FIN_WAIT.as_secs()
            ),
        ],
    )
    .expect("the node's FIN_WAIT timeout");
    let half_closed = HalfClosed::open(
        &pods[1].netns,
        SocketAddrV4::new(addrs::INET_ADDR, HALF_CLOSED_PORT),
    );
    await_node_state(Datapath::Iptables, &half_closed.pod_end(), "CLOSE_WAIT");

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
        "aws-node's wiring left in {backend} after the take-over: {left:#?}"
    );
    assert_other_backend_clean(&lab, "after the take-over");
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
    // Past FIN_WAIT and collections, still CLOSE_WAIT in the datapath.
    let imported = await_node_state(Datapath::Ebpf, &half_closed.pod_end(), "CLOSE_WAIT");
    std::thread::sleep(FIN_WAIT + 3 * GC_INTERVAL);
    await_node_state(Datapath::Ebpf, &half_closed.pod_end(), "CLOSE_WAIT");
    println!("the half-closed connection, taken over: {imported}");

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
        "aws-node's wiring is back as it was, in {backend}"
    );
    assert_other_backend_clean(&lab, "after uninstall");
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
    let handed = await_node_state(Datapath::Iptables, &half_closed.pod_end(), "CLOSE_WAIT");
    let answered = half_closed.answer();
    assert!(
        answered.whole(),
        "the half-closed connection's late answer: {answered:?}"
    );
    println!("the half-closed connection, handed back: {handed}; answered");
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

/// More rounds than a take-over has steps: the rounds are bounded.
const MAX_TAKE_OVER_ROUNDS: u32 = 80;

/// Round N takes the node over with the agent killing itself at its Nth
/// step, starts it again, checks the node as a finished take-over leaves
/// it, then hands the node back for the next round; the rounds end with
/// the one whose take-over passes every step.
#[test]
fn a_take_over_killed_at_any_step_and_started_again_keeps_every_connection() {
    let _lock = serial();
    let (mut lab, conf_dir) = aws_node_lab(LabOptions::iptables(PODS));
    let aws_node = node_wiring(&lab);
    let aws_parts = aws_node_parts(&aws_node);
    let connections = NodeConnections::open(lab.pods(), PORT);
    connections.wait_for_more_echoes(ECHOES, "under aws-node's wiring");
    let snat_port = connections.snat.seen_as.port();
    let mut killed_at = Vec::new();
    for round in 1.. {
        assert!(
            round <= MAX_TAKE_OVER_ROUNDS,
            "more than {MAX_TAKE_OVER_ROUNDS} steps: a step is passed again and again"
        );
        lab.set_agent_env(ENV_CRASH_AT, &round.to_string()).unwrap();
        let started = lab.start_agent();
        let killed = killed_itself();
        match (started, killed) {
            (Ok(()), false) => break,
            (Err(e), false) => panic!("round {round}: the agent failed to start: {e}"),
            // Killed before READY, or after it.
            (_, true) => killed_at.push(round),
        }
        lab.stop_agent().expect("reaping the killed agent");
        lab.set_agent_env(ENV_CRASH_AT, "0").unwrap();
        lab.start_agent()
            .unwrap_or_else(|e| panic!("round {round}: starting again: {e}"));
        connections.wait_for_more_echoes(ECHOES, &format!("after a kill at step {round}"));
        one_program_per_hook(&lab, &["eth0"], round);
        assert!(
            datapath_snat_ports()
                .iter()
                .any(|(_, nat)| *nat == snat_port),
            "round {round}: the SNAT connection kept its port {snat_port}"
        );
        let taken_over = node_wiring(&lab);
        let left = aws_node_parts(&taken_over);
        assert!(
            left.is_empty(),
            "round {round}: aws-node's wiring left: {left:#?}"
        );
        assert!(
            !conf_dir.path().join("10-aws.conflist").exists(),
            "round {round}: aws-node's conflist set aside"
        );
        lab.stop_agent().expect("stopping the agent");
        uninstall(conf_dir.path());
        connections.wait_for_more_echoes(ECHOES, &format!("handed back after round {round}"));
        assert_eq!(
            aws_node_parts(&node_wiring(&lab)),
            aws_parts,
            "round {round}: aws-node's wiring back for the next round"
        );
    }
    assert!(
        killed_at.len() > 1,
        "killed at steps {killed_at:?}: the hook tests nothing"
    );
    lab.stop_agent().expect("stopping the agent");
    let echoes = connections.close();
    println!(
        "a take-over killed at each of its {} steps and started again: {echoes:?} echoes, \
         0 broken, one program per hook, SNAT port {snat_port} kept, aws-node's wiring gone",
        killed_at.len()
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

/// A policy as aws-node's agent enforced it: `web` (pod-2) reached only
/// by `client` pods (pod-0) on TCP 8080, and sending anywhere.
const WEB_POLICY: &str = r"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web, namespace: default}
spec:
  podSelector:
    matchLabels: {app: web}
  policyTypes: [Ingress, Egress]
  ingress:
  - from:
    - podSelector:
        matchLabels: {app: client}
    ports:
    - port: 8080
  egress:
  - {}
";

const POLICY_ENDPOINTS: &str =
    "/apis/networking.k8s.aws/v1alpha1/namespaces/default/policyendpoints";

/// Where the reproduction of aws-node's network policy agent pins (a
/// bpffs directory of the test's own, for `/sys/fs/bpf/globals/aws`).
const AWS_POLICY_PINS: &str = "/sys/fs/bpf/vpcnet-test-aws-network-policy";

/// The PolicyEndpoints of the web policy once the lab's controller has
/// resolved `client` into them (bounded).
fn web_policy_endpoints(lab: &Lab, client: Ipv4Addr) -> Vec<PolicyEndpointSpec> {
    let admin = lab.kube_api().expect("an API server").admin().clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let list = admin
            .get(POLICY_ENDPOINTS)
            .expect("listing PolicyEndpoints");
        let specs: Vec<PolicyEndpointSpec> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|item| serde_json::from_value(item["spec"].clone()).expect("a PolicyEndpoint"))
            .collect();
        let resolved = specs.iter().any(|pe| {
            pe.ingress
                .iter()
                .any(|rule| rule.cidr.trim_end_matches("/32") == client.to_string())
        });
        if resolved {
            return specs;
        }
        assert!(
            Instant::now() < deadline,
            "the web policy's PolicyEndpoints never name the client: {list:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Tries to open connections to `to` from `ns` until `stop`, each waiting
/// `PROBE_WAIT` for an answer; how many were tried and answered.
fn probe_until(ns: &str, to: SocketAddrV4, stop: &AtomicBool) -> (u32, u32) {
    const PROBE_WAIT: Duration = Duration::from_millis(100);
    const MAX_PROBES: u32 = 3000;
    let (mut tried, mut answered) = (0, 0);
    while !stop.load(Ordering::Relaxed) && tried < MAX_PROBES {
        tried += 1;
        if tcp_whoami(ns, to, PROBE_WAIT)
            .expect("probing from a pod")
            .is_some()
        {
            answered += 1;
        }
    }
    (tried, answered)
}

/// A pod's UDP socket sending a datagram every millisecond (bounded), so
/// that a gap in enforcement as short as that shows.
struct UdpKnocker {
    stop: Arc<AtomicBool>,
    sender: std::thread::JoinHandle<u32>,
}

impl UdpKnocker {
    const EVERY: Duration = Duration::from_millis(1);
    const MAX_KNOCKS: u32 = 120_000;

    fn start(socket: &UdpSocket) -> Self {
        let socket = socket.try_clone().expect("a second handle on the socket");
        let stop = Arc::new(AtomicBool::new(false));
        let sender = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut sent = 0;
                while !stop.load(Ordering::Relaxed) && sent < Self::MAX_KNOCKS {
                    socket.send(b"knock").expect("sending a knock");
                    sent += 1;
                    std::thread::sleep(Self::EVERY);
                }
                sent
            })
        };
        Self { stop, sender }
    }

    /// Stops knocking: the knocks sent, and how many `receiver` heard (it
    /// waits its read timeout for the last).
    fn stop(self, receiver: &UdpSocket) -> (u32, u32) {
        self.stop.store(true, Ordering::Relaxed);
        let sent = self.sender.join().expect("the knocker");
        let mut heard = 0;
        while receiver.recv(&mut [0; 16]).is_ok() {
            heard += 1;
        }
        (sent, heard)
    }
}

/// A UDP conversation the test holds both ends of: a pod's socket, and a
/// far end's that answered it (UDP is never picked up mid-stream: its
/// packets pass on what tracked it).
struct UdpConversation {
    pod: UdpSocket,
    far: UdpSocket,
    /// The pod as the far end sees it (after any SNAT).
    seen_as: SocketAddr,
}

impl UdpConversation {
    const WAIT: Duration = Duration::from_secs(1);

    /// The pod (`pod_ns`, `pod_addr`) speaks first to `far` in `far_ns`,
    /// which answers.
    fn open(pod_ns: &str, pod_addr: Ipv4Addr, far_ns: &str, far: SocketAddrV4) -> Self {
        let far_socket = vpcnet_lab::run_in(far_ns, move || UdpSocket::bind(far))
            .expect("entering the far end")
            .expect("binding the far end");
        let pod = vpcnet_lab::run_in(pod_ns, move || {
            let socket = UdpSocket::bind((pod_addr, 0))?;
            socket.connect(far)?;
            Ok::<_, std::io::Error>(socket)
        })
        .expect("entering the pod")
        .expect("the pod's socket");
        for socket in [&pod, &far_socket] {
            socket.set_read_timeout(Some(Self::WAIT)).unwrap();
        }
        pod.send(b"hello").expect("the pod speaks");
        let mut buf = [0; 16];
        let (_, seen_as) = far_socket.recv_from(&mut buf).expect("the far end hears");
        let conversation = Self {
            pod,
            far: far_socket,
            seen_as,
        };
        assert!(conversation.far_speaks(), "the pod hears no answer");
        conversation
    }

    /// The far end speaks (up to three times); whether the pod hears it.
    fn far_speaks(&self) -> bool {
        let mut buf = [0; 16];
        (0..3).any(|_| {
            self.far.send_to(b"news", self.seen_as).expect("sending");
            self.pod.recv(&mut buf).is_ok()
        })
    }
}

/// An aws-node node with the API server, vpcnet's agent not started yet
/// (`ENABLE_NETWORK_POLICY=true`, more of its variables in `env`): pods
/// `client`, `other` and `web` (labelled `app`), the web policy applied
/// and resolved by the lab's controller, and the reproduction of
/// aws-node's agent enforcing it on every pod's veth.
fn aws_node_policy_node(env: &[(&str, &str)]) -> (AwsPolicyAgent, Lab) {
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let _ = std::fs::remove_dir_all(AWS_POLICY_PINS);
    let mut aws_policy = AwsPolicyAgent::new(Path::new(AWS_POLICY_PINS), false);
    let mut ipam = IpamLabOptions::new("m5.large");
    ipam.kube_api = true;
    ipam.env = [("ENABLE_NETWORK_POLICY", "true")]
        .iter()
        .chain(env)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    ipam.agent_args = FAST_AGENT_ARGS
        .iter()
        .map(|a| (*a).to_owned())
        .chain([
            "--network-policy-pins".to_owned(),
            aws_policy.root().display().to_string(),
        ])
        .collect();
    let opts = LabOptions {
        ipam: Some(ipam),
        agent_bin: Some(agent_binary()),
        ..LabOptions::iptables(PODS)
    };
    let mut lab = Lab::up(&opts).expect("an aws-node node");
    let pods = lab.pods().to_vec();
    for (pod, app) in pods.iter().zip(["client", "other", "web"]) {
        let key = format!("{}/{}", pod.k8s_namespace, pod.k8s_name);
        lab.label_pod(&key, &[("app".to_owned(), Some(app.to_owned()))])
            .expect("labelling a pod");
    }
    let files = lab.kube_api().unwrap().files().clone();
    cluster::kubectl(&files, &["apply", "-f", "-"], Some(WEB_POLICY)).expect("kubectl apply");
    aws_policy.enforce(&web_policy_endpoints(&lab, pods[0].addr), &pods);
    (aws_policy, lab)
}

/// An AWS ClusterNetworkPolicy in force on an aws-node node: Admin tier,
/// it denies `client` what the web policy allows it.
const CLIENT_DENIED: &str = r"
apiVersion: networking.k8s.aws/v1alpha1
kind: ClusterNetworkPolicy
metadata: {name: client-denied}
spec:
  tier: Admin
  priority: 10
  subject:
    pods:
      namespaceSelector: {}
      podSelector: {matchLabels: {app: web}}
  ingress:
  - action: Deny
    from:
    - pods:
        namespaceSelector: {}
        podSelector: {matchLabels: {app: client}}
    ports:
    - portNumber: {protocol: TCP, port: 8080}
";

/// A node where aws-node's agent judged a pod by ClusterNetworkPolicy
/// too (its pinned cluster-policy state) is taken over: vpcnet enforces
/// the policy from its ClusterPolicyEndpoints, beside the NetworkPolicy.
/// (The reproduction of aws-node's agent keeps the state, not the tier's
/// rules: before the take-over `client` still reaches `web`.)
#[test]
fn a_node_with_cluster_network_policy_in_force_is_taken_over_with_it_enforced() {
    let _lock = serial();
    let (mut aws_policy, mut lab) = aws_node_policy_node(&[]);
    let pods = lab.pods().to_vec();
    let (client, denied, web) = (&pods[0], &pods[1], &pods[2]);
    let files = lab.kube_api().unwrap().files().clone();
    cluster::kubectl(&files, &["apply", "-f", "-"], Some(CLIENT_DENIED)).expect("kubectl apply");
    aws_policy.select_by_cluster_policy(web);
    let to_web = SocketAddrV4::new(web.addr, 8080);
    let _server = WhoamiServer::start(&web.netns, to_web).expect("web's server");
    let reaches = |from: &vpcnet_lab::PodInfo, wait| {
        tcp_whoami(&from.netns, to_web, wait)
            .expect("probing from a pod")
            .is_some()
    };
    assert!(
        reaches(client, Duration::from_secs(3)),
        "before: the client reaches web"
    );

    lab.start_agent().expect("the agent takes the node over");
    assert!(
        !reaches(client, Duration::from_millis(300)),
        "the client reaches web: the cluster policy's Deny is not enforced"
    );
    assert!(
        !reaches(denied, Duration::from_millis(300)),
        "the denied pod reaches web: the NetworkPolicy is not enforced"
    );
    let shown = vpcnet_bpf_tests::agent_cli(&[
        "policy",
        &format!("{}/{}", web.k8s_namespace, web.k8s_name),
    ]);
    assert!(
        shown.contains("Admin 10 Deny") && shown.contains("client-denied"),
        "the rules in force do not show the cluster policy:\n{shown}"
    );
    eprintln!("taken over with the cluster policy in force:\n{shown}");
}

/// The names of the tc filters on `veth`'s two hooks in the node.
fn filters(lab: &Lab, veth: &str) -> String {
    ["ingress", "egress"]
        .map(|hook| {
            lab.exec_ok(addrs::NS_NODE, &["tc", "filter", "show", "dev", veth, hook])
                .expect("tc filter show")
        })
        .join("")
}

/// On TCX vpcnet's programs run before aws-node's clsact filters; on
/// clsact after them, until they are deleted. Both, where the kernel has
/// TCX.
#[test]
fn aws_node_network_policy_is_taken_over_with_no_gap() {
    let _lock = serial();
    let modes: &[&str] = match AttachMode::of_kernel() {
        AttachMode::Tcx => &["tcx", "clsact"],
        AttachMode::Clsact => &["clsact"],
    };
    for mode in modes {
        take_over_aws_node_network_policy(mode);
    }
}

#[allow(clippy::too_many_lines, reason = "one story, told in order")]
fn take_over_aws_node_network_policy(attach: &str) {
    let (aws_policy, mut lab) = aws_node_policy_node(&[(ENV_TC_ATTACH, attach)]);
    let pods = lab.pods().to_vec();
    let (client, denied, web) = (&pods[0], &pods[1], &pods[2]);

    let FarEnds {
        peer, pod: to_web, ..
    } = FarEnds::start(web, PORT);
    let denied_probe = |phase: &str| {
        let reached = tcp_whoami(&denied.netns, to_web.addr(), Duration::from_millis(300))
            .expect("probing from a pod");
        assert!(reached.is_none(), "{phase}: the denied pod reached web");
    };
    denied_probe("aws-node's agent enforcing");
    // Out to the VPC: the SNAT path has its own test above.
    let web_out = EchoStream::open(&web.netns, peer.addr());
    let client_in = EchoStream::open(&client.netns, to_web.addr());
    let streams = [
        (
            "web's own connection out (its replies denied as new)",
            &web_out,
        ),
        ("the client's connection to web", &client_in),
    ];
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} under aws-node's agent"));
    }
    let udp = UdpConversation::open(
        &web.netns,
        web.addr,
        addrs::NS_PEER,
        // The whoami server has `PORT` for UDP too.
        SocketAddrV4::new(addrs::PEER_ADDR, PORT + 1),
    );

    // A denied pod's UDP to web: its own rules let it out (aws-node's
    // tracker holds that), web's drop it; it must stay dropped.
    let knock_to = SocketAddrV4::new(web.addr, PORT + 3);
    let web_socket = vpcnet_lab::run_in(&web.netns, move || UdpSocket::bind(knock_to))
        .expect("entering web")
        .expect("web's UDP socket");
    web_socket
        .set_read_timeout(Some(UdpConversation::WAIT))
        .unwrap();
    let denied_socket = vpcnet_lab::run_in(&denied.netns, move || {
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        socket.connect(knock_to)?;
        Ok::<_, std::io::Error>(socket)
    })
    .expect("entering the denied pod")
    .expect("the denied pod's UDP socket");
    let udp_knock_heard = || {
        denied_socket.send(b"knock").expect("sending");
        web_socket.recv(&mut [0; 16]).is_ok()
    };
    assert!(
        !udp_knock_heard(),
        "aws-node's agent let the denied pod's UDP through"
    );

    // The take-over, with the denied pod knocking all along.
    let stop = Arc::new(AtomicBool::new(false));
    let prober = {
        let (ns, to, stop) = (denied.netns.clone(), to_web.addr(), Arc::clone(&stop));
        std::thread::spawn(move || probe_until(&ns, to, &stop))
    };
    let started = lab.start_agent();
    stop.store(true, Ordering::Relaxed);
    let (tried, answered) = prober.join().expect("the prober");
    started.expect("taking over aws-node's node with its network policy");
    assert!(tried > 0, "no probe ran during the take-over");
    assert_eq!(
        answered, 0,
        "the denied pod reached web {answered} times in {tried} tries during the take-over"
    );
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} after the take-over"));
    }
    let log = std::fs::read_to_string(lab.agent_log().unwrap()).unwrap();
    let report = log
        .lines()
        .find(|line| line.contains("node taken over from aws-node"))
        .unwrap_or_else(|| panic!("no take-over report: {log}"));
    assert!(
        udp.far_speaks(),
        "web's UDP conversation out: the far end, speaking first after the take-over, is not heard ({report})"
    );
    denied_probe("vpcnet enforcing");
    assert!(
        !udp_knock_heard(),
        "the denied pod's UDP reached web after the take-over"
    );
    assert!(
        tcp_whoami(&client.netns, to_web.addr(), Duration::from_secs(3))
            .expect("probing from a pod")
            .is_some(),
        "the client no longer reaches web"
    );
    for pod in &pods {
        let left = filters(&lab, &pod.host_veth);
        assert!(
            !left.contains("handle_ingress") && !left.contains("handle_egress"),
            "aws-node's filters left on {}: {left}",
            pod.host_veth
        );
    }
    let pinned = std::fs::read_dir(aws_policy.programs_dir())
        .expect("aws-node's program pins")
        .count();
    // Pods of one identifier (pod-N: `pod@default`) share one pair.
    let identifiers: BTreeSet<String> = pods
        .iter()
        .map(|pod| pod_identifier(&pod.k8s_name, &pod.k8s_namespace))
        .collect();
    assert_eq!(
        pinned,
        2 * identifiers.len(),
        "aws-node's pins are kept for the hand-back"
    );
    assert!(
        report.contains(&format!("policy_filters_removed={}", 2 * PODS)),
        "{report}"
    );
    let udp_under_vpcnet = UdpConversation::open(
        &web.netns,
        web.addr,
        addrs::NS_PEER,
        SocketAddrV4::new(addrs::PEER_ADDR, PORT + 2),
    );
    println!(
        "{attach}: aws-node's network policy taken over: {tried} probes of the denied pod during the take-over, 0 answered; {report}"
    );

    // An agent restart, the denied pod's UDP knocking every millisecond
    // all along: none is heard, no connection breaks.
    let knocker = UdpKnocker::start(&denied_socket);
    lab.stop_agent().expect("stopping the agent");
    lab.start_agent().expect("starting the agent again");
    let (knocks, heard) = knocker.stop(&web_socket);
    assert!(knocks > 0, "no knock sent during the restart");
    assert_eq!(
        heard, 0,
        "{heard} of the denied pod's {knocks} knocks during an agent restart reached web"
    );
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} after an agent restart"));
    }
    println!("{attach}: an agent restart: {knocks} knocks of the denied pod, 0 heard");

    // The hand-back: aws-node's programs back on the veths before vpcnet's
    // go, with the connections vpcnet let through in their tracker.
    lab.stop_agent().expect("stopping the agent");
    let said = uninstall_with(&[
        "--network-policy-pins".as_ref(),
        aws_policy.root().as_os_str(),
    ]);
    println!("{attach}: uninstall: {}", said.trim());
    assert!(
        said.contains(&format!(
            "aws-node's network policy programs put back on {} hooks",
            2 * PODS
        )),
        "{said}"
    );
    for pod in &pods {
        let back = filters(&lab, &pod.host_veth);
        assert!(
            back.contains("handle_ingress") && back.contains("handle_egress"),
            "aws-node's filters not back on {}: {back}",
            pod.host_veth
        );
    }
    for (name, stream) in streams {
        stream.wait_for_more_echoes(ECHOES, &format!("{name} after the hand-back"));
    }
    assert!(
        udp_under_vpcnet.far_speaks(),
        "a UDP conversation web opened under vpcnet: its far end, speaking first after the hand-back, is not heard"
    );
    denied_probe("aws-node's agent enforcing again");
    let echoed: Vec<u64> = [web_out, client_in].map(EchoStream::close).to_vec();
    println!(
        "{attach}: connections kept through the take-over and the hand-back: {echoed:?} echoes, 0 broken; UDP conversations heard first from their far ends after each"
    );
    lab.down().expect("lab down");
    drop(aws_policy);
}
