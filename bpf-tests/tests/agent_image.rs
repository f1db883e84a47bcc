//! The agent as an EKS node runs it: the image `cargo xtask image` builds,
//! run through the node's containerd as the DaemonSet's pod (`deploy/`
//! rendered by `kubectl kustomize`), by the lab's kubelet: its init
//! container installs the plugins, the agent writes the conflist from its
//! settings, containerd uses it for every pod. The demo's paths go
//! through that agent, and a container that dies is restarted by the
//! kubelet with every flow kept.
//!
//! Needs the image of the workspace's binaries:
//! `cargo xtask image --bin-dir target/debug` (`cargo xtask test` builds
//! it).

use std::{
    net::SocketAddrV4,
    time::{Duration, Instant},
};

use vpcnet_bpf_tests::{
    agent_image,
    cri::{CriNode, up_with},
    echo::EchoStream,
};
use vpcnet_lab::{
    WhoamiServer, addrs, agent_pod, cri_pods, exec_ok, kubelet::PodStatus, serial, tcp_whoami,
};

const PORT: u16 = 8080;
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// kubelet's first back-off (10 s) and a readiness period (10 s), with room.
const RESTART_TIMEOUT: Duration = Duration::from_mins(1);
/// An MTU other than the agent's default (9001): it reaches a pod only
/// through the conflist the agent writes from its ConfigMap.
const POD_MTU: &str = "1500";

/// The agent's pod status once `done` holds (the lab's kubelet writes it
/// at each change; bounded).
fn wait_status(what: &str, done: impl Fn(&PodStatus) -> bool) -> PodStatus {
    let deadline = Instant::now() + RESTART_TIMEOUT;
    loop {
        let status = agent_pod::status().expect("the agent pod's status");
        if done(&status) {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {RESTART_TIMEOUT:?}; last {status:?}\nkubelet log:\n{}",
            vpcnet_lab::helper_process::log_tail(&agent_pod::kubelet_log_file())
        );
        std::thread::sleep(Duration::from_millis(200));
    }
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

#[test]
fn the_images_agent_runs_as_the_daemon_sets_pod_and_keeps_flows_through_a_container_restart() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let lab = up_with(&CriNode {
        kube_api: true,
        env: &[("POD_MTU", POD_MTU)],
        agent_image: Some(agent_image()),
        ..CriNode::new(2, "m5.large")
    });

    // The agent runs from the image, through CRI, ready by its probe.
    let status = agent_pod::status().expect("the agent pod's status");
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
    let in_pod = WhoamiServer::start(&pods[1].netns, SocketAddrV4::new(pods[1].addr, PORT))
        .expect("whoami in pod-1");
    let inet = WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
        .expect("whoami in inet");
    let peer = WhoamiServer::start(addrs::NS_PEER, SocketAddrV4::new(addrs::PEER_ADDR, PORT))
        .expect("whoami on peer");
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
    let restarted = wait_status("the agent restarted and ready", |status| {
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
    assert_eq!(to_inet.seen_as.ip(), &addrs::NODE_PRIMARY_ADDR);
    assert!(to_inet.close() > 100);
    assert!(to_peer.close() > 50);
    // A new connection after it, too.
    let got = tcp_whoami(&pods[0].netns, inet.addr(), REPLY_TIMEOUT).expect("tcp probe");
    assert_eq!(got.map(|s| *s.ip()), Some(addrs::NODE_PRIMARY_ADDR));
    drop((in_pod, inet, peer));
    lab.down().expect("lab down");
}
