//! The agent as an EKS node runs it: the image `cargo xtask image`
//! builds, run through the node's containerd as the DaemonSet's pod
//! (`deploy/` rendered by `kubectl kustomize` or `helm template` and
//! applied to the lab's API server), by the lab's kubelet: its init
//! container installs the plugins, the agent writes the conflist from its
//! settings, containerd uses it for every pod.
//!
//! - The agent runs not privileged, with the DaemonSet's four
//!   capabilities, the demo's paths go through it, and a container that
//!   dies is restarted by the kubelet with every flow kept and the same
//!   programs on every hook, not verified again (in every VM too).
//! - A rolling update from the previous commit's image (as that commit
//!   deployed it) to this one keeps every flow.
//! - The guide's take-over, command by command, in both iptables
//!   backends: an aws-node node is labelled `vpcnet.dev/cni=vpcnet`, the
//!   image's agent takes it over; labelled `rollback`, the rollback
//!   DaemonSet's pod hands it back (`vpcnet-agent uninstall`); the label
//!   removed, no vpcnet pod is left. Every connection goes on throughout.
//!
//! Needs the images of the workspace's binaries and of the previous
//! commit: `cargo xtask image --bin-dir target/debug` and `cargo xtask
//! image --commit HEAD~1` (`cargo xtask test` builds both).

use std::{collections::BTreeSet, net::SocketAddrV4, path::Path, time::Duration};

use vpcnet_bpf_tests::{
    agent_image,
    aws_node_wiring::{
        AWS_CONFLIST, assert_other_backend_clean, aws_node_parts, datapath_snat_ports, wiring_in,
    },
    cri::{CriNode, up_with},
    echo::{EchoStream, FarEnds},
    hooks::hook_programs,
    previous_agent_image,
};
use vpcnet_common::maps::PIN_DIR;
use vpcnet_lab::{
    AgentImage, IpamLabOptions, IptablesBackend, Lab, LabOptions, Manifests, WhoamiServer, addrs,
    agent_pod::{self, ON_VPCNET, ROLLBACK},
    cri_pods, exec_ok,
    kubelet::PodStatus,
    serial, tcp_whoami,
};

const PORT: u16 = 8080;
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// kubelet's first back-off (10 s) and a readiness period (10 s), with
/// room for a container's creation under TCG: on 6.12 it once took over
/// 40 s of a one-minute bound. A bound, not a wait: a restart that is
/// ready sooner passes sooner.
const RESTART_TIMEOUT: Duration = agent_pod::READY_TIMEOUT;
/// An MTU other than the agent's default (9001): it reaches a pod only
/// through the conflist the agent writes from its ConfigMap.
const POD_MTU: &str = "1500";

/// The agent's pod status once `done` holds (bounded).
fn wait_agent(what: &str, done: impl Fn(&PodStatus) -> bool) -> PodStatus {
    agent_pod::wait_for(what, RESTART_TIMEOUT, |pods| {
        pods.of(agent_pod::AGENT_DAEMON_SET).is_some_and(&done)
    })
    .unwrap_or_else(|err| panic!("{err}"))
    .of(agent_pod::AGENT_DAEMON_SET)
    .cloned()
    .expect("waited for")
}

/// Not privileged: the capabilities the DaemonSet names, no others, as
/// the runtime ran the container.
fn assert_only_the_daemon_sets_capabilities(client: &vpcnet_lab::cri::CriClient, id: &str) {
    let info = client
        .container_status(id)
        .expect("the agent container's status")
        .info;
    let process = &info["runtimeSpec"]["process"];
    let mut effective: Vec<&str> = process["capabilities"]["effective"]
        .as_array()
        .expect("the container's effective capabilities")
        .iter()
        .filter_map(serde_json::Value::as_str)
        .collect();
    effective.sort_unstable();
    assert_eq!(
        effective,
        ["CAP_BPF", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_PERFMON"],
        "{process}"
    );
    println!("the agent's container ran with {effective:?}");
}

/// The conflist containerd uses is the agent's, from its ConfigMap: its
/// MTU is the pods'.
fn assert_the_agents_conflist_reaches_the_pods(pods: &[vpcnet_lab::PodInfo]) {
    let conflist = std::fs::read_to_string(cri_pods::cni_conf_dir().join("10-vpcnet.conflist"))
        .expect("the conflist the agent wrote");
    let conflist: serde_json::Value = serde_json::from_str(&conflist).expect("JSON");
    assert_eq!(
        conflist["plugins"][0]["mtu"].to_string().trim_matches('"'),
        POD_MTU,
        "{conflist}"
    );
    for pod in pods {
        let link = exec_ok(&pod.netns, &["ip", "link", "show", "eth0"]).expect("eth0");
        assert!(
            link.contains(&format!("mtu {POD_MTU} ")),
            "{}: {link}",
            pod.k8s_name
        );
    }
}

/// The demo's servers: in pod-1, on the internet, on a VPC peer.
fn servers(pods: &[vpcnet_lab::PodInfo]) -> [WhoamiServer; 3] {
    [
        WhoamiServer::start(&pods[1].netns, SocketAddrV4::new(pods[1].addr, PORT))
            .expect("whoami in pod-1"),
        WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
            .expect("whoami in inet"),
        WhoamiServer::start(addrs::NS_PEER, SocketAddrV4::new(addrs::PEER_ADDR, PORT))
            .expect("whoami on peer"),
    ]
}

#[test]
fn the_images_agent_runs_not_privileged_as_the_daemon_sets_pod_and_a_restart_keeps_flows() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let lab = up_with(&CriNode {
        kube_api: true,
        env: &[("POD_MTU", POD_MTU)],
        agent_image: Some(agent_image()),
        ..CriNode::new(2, "m5.large")
    });

    // The agent runs from the image, through CRI, ready by its probe.
    let status = agent_pod::agent_status().expect("the agent pod's status");
    assert!(status.ready, "{status:?}");
    let [agent] = status.containers.as_slice() else {
        panic!("one container: {status:?}");
    };
    assert_eq!(agent.name, "vpcnet-agent");
    assert_eq!(
        agent.image,
        format!("docker.io/library/vpcnet:{}", env!("CARGO_PKG_VERSION"))
    );
    assert!(agent.running && agent.restarts == 0, "{agent:?}");
    let client = lab.cri().expect("a CRI client");
    assert_only_the_daemon_sets_capabilities(&client, &agent.id);
    let pods = lab.pods().to_vec();
    assert_the_agents_conflist_reaches_the_pods(&pods);

    // The demo's paths: pod to pod and to the VPC with the pod's own
    // address, to the internet SNATed to the node's.
    let [in_pod, inet, peer] = servers(&pods);
    for (server, seen) in [
        (&in_pod, pods[0].addr),
        (&peer, pods[0].addr),
        (&inet, addrs::NODE_PRIMARY_ADDR),
    ] {
        let got = tcp_whoami(&pods[0].netns, server.addr(), REPLY_TIMEOUT).expect("tcp probe");
        assert_eq!(got.map(|s| *s.ip()), Some(seen), "to {}", server.addr());
    }

    // The agent's container dies: the kubelet restarts it; the flows
    // through SNAT and to the VPC go on throughout.
    let to_inet = EchoStream::open(&pods[0].netns, inet.addr());
    let to_peer = EchoStream::open(&pods[0].netns, peer.addr());
    to_inet.wait_for_more_echoes(50, "before the restart");
    let programs = hook_programs(addrs::NS_NODE);
    let info = client
        .container_status(&agent.id)
        .expect("the agent container's status")
        .info;
    let pid = info["pid"].as_i64().expect("the container's pid");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(pid).expect("a pid")),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("killing the agent's container");
    let restarted = wait_agent("the agent restarted and ready", |status| {
        status.ready && status.containers[0].restarts == 1
    });
    assert!(
        restarted.containers[0]
            .last_restart
            .as_deref()
            .is_some_and(|why| why.starts_with("exited with 137")),
        "{restarted:?}"
    );
    for stream in [&to_inet, &to_peer] {
        stream.wait_for_more_echoes(50, "after the restart");
    }
    // The same image over the same maps: its programs stay on every hook,
    // not verified again, though the agent may not open a map by its id
    // (no CAP_SYS_ADMIN). An ENI the pool attached meanwhile has them too.
    let after = hook_programs(addrs::NS_NODE);
    for (hook, before) in &programs {
        assert_eq!(
            after.get(hook),
            Some(before),
            "{hook:?}: the restarted agent kept the program running"
        );
    }
    let kept: BTreeSet<u32> = programs.values().flatten().map(|p| p.id).collect();
    assert!(
        after.values().flatten().all(|p| kept.contains(&p.id)),
        "only the programs from before the restart: {after:?}"
    );
    assert_eq!(to_inet.seen_as.ip(), &addrs::NODE_PRIMARY_ADDR);
    assert!(to_inet.close() > 100);
    assert!(to_peer.close() > 50);
    // A new connection after it, too.
    let got = tcp_whoami(&pods[0].netns, inet.addr(), REPLY_TIMEOUT).expect("tcp probe");
    assert_eq!(got.map(|s| *s.ip()), Some(addrs::NODE_PRIMARY_ADDR));
    drop((in_pod, inet, peer));
    lab.down().expect("lab down");
}

#[test]
fn a_rolling_update_from_the_previous_commits_image_keeps_flows() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let lab = up_with(&CriNode {
        kube_api: true,
        env: &[("POD_MTU", POD_MTU)],
        agent_image: Some(previous_agent_image()),
        ..CriNode::new(2, "m5.large")
    });
    let first = agent_pod::agent_status().expect("the agent pod's status");
    assert!(first.ready, "{first:?}");
    println!(
        "the node runs {} from {}",
        first.name, first.containers[0].image
    );
    let pods = lab.pods().to_vec();
    let [in_pod, inet, peer] = servers(&pods);
    let to_inet = EchoStream::open(&pods[0].netns, inet.addr());
    let to_peer = EchoStream::open(&pods[0].netns, peer.addr());
    let to_pod = EchoStream::open(&pods[0].netns, in_pod.addr());
    let streams = [("SNAT", to_inet), ("VPC", to_peer), ("pod to pod", to_pod)];
    for (name, stream) in &streams {
        stream.wait_for_more_echoes(50, &format!("{name} under the previous image"));
    }

    // This commit's image, as the working tree deploys it: the kubelet
    // deletes the old pod, then makes the new.
    lab.roll_agent_image(&agent_image())
        .expect("the rolling update to this commit's image");
    let status = agent_pod::agent_status().expect("the agent pod's status");
    assert_ne!(status.name, first.name, "a new pod");
    let [agent] = status.containers.as_slice() else {
        panic!("one container: {status:?}");
    };
    assert_eq!(
        agent.image,
        format!("docker.io/library/vpcnet:{}", env!("CARGO_PKG_VERSION"))
    );
    assert!(agent.running && agent.restarts == 0, "{agent:?}");
    for (name, stream) in &streams {
        stream.wait_for_more_echoes(50, &format!("{name} after the rolling update"));
    }
    assert_eq!(streams[0].1.seen_as.ip(), &addrs::NODE_PRIMARY_ADDR);
    assert_the_agents_conflist_reaches_the_pods(&pods);
    let mut echoed = Vec::new();
    for (name, stream) in streams {
        echoed.push((name, stream.close()));
    }
    println!(
        "rolled from {} ({}) to {} ({}): every flow kept, {echoed:?} echoes",
        first.name, first.containers[0].image, status.name, agent.image
    );
    drop((in_pod, inet, peer));
    lab.down().expect("lab down");
}

/// Pods aws-node wired on the node.
const AWS_NODE_PODS: usize = 2;

#[test]
fn the_guides_take_over_and_rollback_through_the_image_with_legacy_iptables_and_kustomize() {
    take_over_and_rollback(IptablesBackend::Legacy, Manifests::Kustomize);
}

#[test]
fn the_guides_take_over_and_rollback_through_the_image_with_nft_iptables_and_helm() {
    take_over_and_rollback(IptablesBackend::Nft, Manifests::Helm);
}

/// The guide's "Take-over from aws-node, and rollback" on a node whose
/// iptables rules are in `backend`, vpcnet installed from `manifests`:
/// each step the `kubectl` command the guide gives, the node's pods as
/// the DaemonSet objects then say, and the connections aws-node's pods had going
/// on throughout.
#[allow(clippy::too_many_lines, reason = "one story, told in order")]
fn take_over_and_rollback(backend: IptablesBackend, manifests: Manifests) {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let mut ipam = IpamLabOptions::new("m5.large");
    ipam.kube_api = true;
    let lab = Lab::up(&LabOptions {
        ipam: Some(ipam),
        iptables_backend: backend,
        agent_image: Some(AgentImage {
            manifests,
            ..agent_image()
        }),
        ..LabOptions::iptables(AWS_NODE_PODS)
    })
    .expect("an aws-node node, vpcnet's DaemonSets applied");
    let conf_dir = cri_pods::cni_conf_dir();
    std::fs::create_dir_all(&conf_dir).expect("the node's CNI directory");
    std::fs::write(conf_dir.join("10-aws.conflist"), AWS_CONFLIST).expect("aws-node's conflist");
    let aws_node = wiring_in(backend);
    let aws_parts = aws_node_parts(&aws_node);
    assert!(
        aws_parts.iter().any(|l| l.contains("-N AWS-SNAT-CHAIN-0")),
        "aws-node's wiring in {backend}: {aws_parts:#?}"
    );
    assert_other_backend_clean(backend, "under aws-node");
    let nothing = agent_pod::status().expect("the node's pods");
    assert!(
        nothing.pods.is_empty(),
        "no label, no vpcnet pod: {nothing:?}"
    );

    let pods = lab.pods().to_vec();
    let FarEnds {
        inet,
        peer,
        pod: pod_server,
    } = FarEnds::start(&pods[1], PORT);
    let snat = EchoStream::open(&pods[0].netns, inet.addr());
    assert_eq!(
        *snat.seen_as.ip(),
        addrs::NODE_PRIMARY_ADDR,
        "SNATed by iptables"
    );
    let to_vpc = EchoStream::open(&pods[1].netns, peer.addr());
    let pod_to_pod = EchoStream::open(&pods[0].netns, pod_server.addr());
    let streams = [
        ("SNAT", &snat),
        ("VPC", &to_vpc),
        ("pod to pod", &pod_to_pod),
    ];
    for (name, stream) in streams {
        stream.wait_for_more_echoes(50, &format!("{name} under aws-node"));
    }

    // Take-over, step 3: move the node.
    let node = vpcnet_lab::cluster::node_name();
    println!("$ kubectl label node {node} vpcnet.dev/cni=vpcnet");
    lab.label_node(Some(ON_VPCNET)).expect("labelling the node");
    let agent = wait_agent("vpcnet's pod ready on the labelled node", |pod| pod.ready);
    println!(
        "  vpcnet's pod {} ready ({})",
        agent.name, agent.containers[0].image
    );
    for (name, stream) in streams {
        stream.wait_for_more_echoes(50, &format!("{name} after the take-over"));
    }
    let left = wiring_in(backend);
    let left = aws_node_parts(&left);
    assert!(
        left.is_empty(),
        "aws-node's wiring left in {backend}: {left:#?}"
    );
    assert_other_backend_clean(backend, "after the take-over");
    assert!(conf_dir.join("10-vpcnet.conflist").is_file());
    assert!(
        !conf_dir.join("10-aws.conflist").exists(),
        "aws-node's conflist set aside"
    );
    assert!(
        datapath_snat_ports()
            .iter()
            .any(|(_, nat)| *nat == snat.seen_as.port()),
        "the SNAT connection kept its port {}",
        snat.seen_as.port()
    );
    println!(
        "  taken over: aws-node's {} rules gone from {backend}, SNAT port {} kept",
        aws_parts.len(),
        snat.seen_as.port()
    );

    // Rollback, step 2: hand the node back.
    println!("$ kubectl label node {node} vpcnet.dev/cni=rollback --overwrite");
    lab.label_node(Some(ROLLBACK)).expect("labelling the node");
    let handed_back = agent_pod::wait_for(
        "the rollback's pod ready, vpcnet's gone",
        agent_pod::READY_TIMEOUT,
        |pods| {
            pods.of(agent_pod::AGENT_DAEMON_SET).is_none()
                && pods
                    .of(agent_pod::ROLLBACK_DAEMON_SET)
                    .is_some_and(|pod| pod.ready)
        },
    )
    .unwrap_or_else(|err| panic!("{err}"));
    let rollback = handed_back
        .of(agent_pod::ROLLBACK_DAEMON_SET)
        .expect("waited for");
    println!(
        "  the rollback's pod {} ready: its uninstall is done",
        rollback.name
    );
    for (name, stream) in streams {
        stream.wait_for_more_echoes(50, &format!("{name} after the rollback"));
    }
    assert_eq!(
        aws_node_parts(&wiring_in(backend)),
        aws_parts,
        "aws-node's wiring is back as it was, in {backend}"
    );
    assert_other_backend_clean(backend, "after the rollback");
    assert!(!Path::new(PIN_DIR).exists(), "the datapath's pins are gone");
    assert!(
        conf_dir.join("10-aws.conflist").is_file(),
        "aws-node's conflist back"
    );
    assert!(!conf_dir.join("10-vpcnet.conflist").exists());

    // Rollback, step 3: aws-node's node again.
    println!("$ kubectl label node {node} vpcnet.dev/cni-");
    lab.label_node(None).expect("unlabelling the node");
    agent_pod::wait_for(
        "no vpcnet pod on the node",
        agent_pod::READY_TIMEOUT,
        |pods| pods.pods.is_empty(),
    )
    .unwrap_or_else(|err| panic!("{err}"));
    let mut echoed = Vec::new();
    for (name, stream) in [("SNAT", snat), ("VPC", to_vpc), ("pod to pod", pod_to_pod)] {
        stream.wait_for_more_echoes(50, &format!("{name} on aws-node's node again"));
        echoed.push((name, stream.close()));
    }
    println!("  aws-node's again; every connection went on: {echoed:?} echoes");
    drop((inet, peer, pod_server));
    lab.down().expect("lab down");
}
