//! The agent restarts under running pods: killed with SIGKILL (a crash)
//! and stopped with SIGTERM (an upgrade), while long TCP connections run
//! through SNAT and pod to pod. The datapath lives on in the pinned links
//! and maps, so no connection notices and no NAT entry is lost; a pod
//! added while the agent is down fails cleanly and leaves nothing, a pod
//! deleted while it is down has its address back after the restart.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test cri_restart -- --test-threads=1 --nocapture`.

use std::{
    collections::BTreeSet,
    net::SocketAddrV4,
    time::{Duration, Instant},
};

use vpcnet_bpf_tests::{
    cri::{self, node_traces, remove_all_pods, wait_ipam},
    echo::EchoStream,
    pinned_nat_flows_to,
};
use vpcnet_lab::{Lab, WhoamiServer, addrs, cri_pods, serial};

const PORT: u16 = 8080;
/// Echoes each connection must complete while the agent is down, and
/// after it is back.
const ECHOES: u64 = 100;

/// The host veths of the node.
fn host_veths() -> BTreeSet<String> {
    node_traces().host_veths
}

#[allow(clippy::too_many_lines, reason = "one story, told in order")]
#[test]
fn agent_restarts_break_no_flow_and_lose_no_nat_entry() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let mut lab: Lab = cri::up(4, "m5.large");
    let client = lab.cri().expect("a CRI client");
    let pods = lab.pods().to_vec();

    let inet = WhoamiServer::start(addrs::NS_INET, SocketAddrV4::new(addrs::INET_ADDR, PORT))
        .expect("whoami in inet");
    let pod_server = WhoamiServer::start(&pods[2].netns, SocketAddrV4::new(pods[2].addr, PORT))
        .expect("whoami in pod-2");
    let snat = EchoStream::open(&pods[0].netns, inet.addr());
    assert_eq!(*snat.seen_as.ip(), addrs::NODE_PRIMARY_ADDR, "SNATed");
    let pod_to_pod = EchoStream::open(&pods[1].netns, pod_server.addr());
    assert_eq!(
        *pod_to_pod.seen_as.ip(),
        pods[1].addr,
        "pod to pod, unNATed"
    );
    snat.wait_for_more_echoes(ECHOES, "before the restarts");
    pod_to_pod.wait_for_more_echoes(ECHOES, "before the restarts");
    let nat_before = pinned_nat_flows_to(inet.addr());
    assert_eq!(nat_before.len(), 1, "the SNAT flow is in the NAT table");

    for (how, crash) in [("SIGKILL", true), ("SIGTERM", false)] {
        let down_at = Instant::now();
        if crash {
            lab.kill_agent().expect("killing the agent");
        } else {
            lab.stop_agent().expect("stopping the agent");
        }
        snat.wait_for_more_echoes(ECHOES, &format!("with the agent down ({how})"));
        pod_to_pod.wait_for_more_echoes(ECHOES, &format!("with the agent down ({how})"));

        // A pod added now: the plugin cannot reach the agent, says so, and
        // leaves nothing; kubelet then stops and removes the sandbox.
        let veths = host_veths();
        let spec = cri_pods::pod_spec(10);
        let err = client
            .run_pod_sandbox(&spec)
            .expect_err("RunPodSandbox with the agent down");
        let message = err.to_string();
        assert!(message.contains("agent"), "{message}");
        assert_eq!(host_veths(), veths, "a failed ADD left a veth");
        for sandbox in client.list_pod_sandboxes().expect("ListPodSandbox") {
            if sandbox.name == spec.name {
                cri_pods::remove_pod(&client, &sandbox.id).expect("removing the failed sandbox");
            }
        }
        // A pod deleted now: its network goes at once.
        if crash {
            let gone = pods[3].sandbox.as_deref().expect("a sandbox");
            cri_pods::remove_pod(&client, gone).expect("removing pod-3 with the agent down");
            assert!(!host_veths().contains(&pods[3].host_veth));
        }

        lab.start_agent().expect("restarting the agent");
        let downtime = down_at.elapsed();
        snat.wait_for_more_echoes(ECHOES, &format!("after the restart ({how})"));
        pod_to_pod.wait_for_more_echoes(ECHOES, &format!("after the restart ({how})"));
        let nat_after = pinned_nat_flows_to(inet.addr());
        let lost: Vec<_> = nat_before.difference(&nat_after).collect();
        assert!(
            lost.is_empty(),
            "NAT entries lost or changed across {how}: {lost:?}"
        );
        println!(
            "{how}: agent down {:.2} s; both connections kept echoing; the SNAT flow's NAT entries before {}, lost 0",
            downtime.as_secs_f64(),
            nat_before.len()
        );
    }

    // The pod deleted while the agent was down: its address came back.
    let status = wait_ipam("pod-3's address released", Duration::from_secs(10), |s| {
        s.assigned_addrs == 3
    });
    println!(
        "pod deleted with the agent down: address {} released after the restart ({} of {} assigned)",
        pods[3].addr, status.assigned_addrs, status.total_addrs
    );

    let echoed = (snat.close(), pod_to_pod.close());
    println!(
        "connections closed cleanly: SNAT {} echoes, pod to pod {} echoes, 0 broken",
        echoed.0, echoed.1
    );
    drop((inet, pod_server));
    remove_all_pods(&client);
    let traces = node_traces();
    assert!(traces.is_empty(), "left behind: {traces:?}");
    lab.down().expect("taking the lab down");
}
