//! End to end, the way a cluster runs vpcnet: containerd's CRI (kubelet's
//! calls) runs the `vpcnet-cni` plugin of `deploy/10-vpcnet.conflist`,
//! which asks the agent; the agent hands out addresses from the ENIs the
//! EC2 emulator attaches and puts the pods into the eBPF datapath. Pods
//! then reach each other and `peer` with their own address, `onprem` and
//! `inet` SNATed to the node's; `portmap`, chained after the plugin, makes
//! a hostPort work; and deleting the pods leaves nothing behind.
//!
//! Run: `cargo build --workspace --bins && cargo test -p vpcnet-bpf-tests
//! --test cri_e2e -- --test-threads=1 --nocapture`.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use vpcnet_bpf_tests::cri::{self, node_traces, remove_all_pods, wait_ipam};
use vpcnet_lab::{
    WhoamiServer, addrs,
    cri::{PortMapping, Protocol},
    cri_pods, exec_ok, serial, tcp_whoami, udp_whoami,
};

const PORT: u16 = 8080;
const HOST_PORT: u16 = 30090;
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

#[test]
fn pods_through_cri_reach_every_far_end_and_leave_nothing_behind() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    let lab = cri::up(3, "m5.large");
    let client = lab.cri().expect("a CRI client");

    // Each pod: a VPC address of the node's subnet, its own, wired as the
    // VPC CNI wires it.
    let pods = lab.pods().to_vec();
    let addrs: std::collections::BTreeSet<Ipv4Addr> = pods.iter().map(|p| p.addr).collect();
    assert_eq!(
        addrs.len(),
        pods.len(),
        "addresses handed out twice: {pods:?}"
    );
    for pod in &pods {
        assert!(addrs::NODE_SUBNET.contains(&pod.addr), "{pod:?}");
        assert_eq!(
            pod.host_veth,
            vpcnet_api::pod::host_veth_name("eni", &pod.k8s_namespace, &pod.k8s_name)
        );
        let routes = exec_ok(&pod.netns, &["ip", "route", "show"]).expect("pod routes");
        assert!(
            routes.contains("default via 169.254.1.1 dev eth0"),
            "{routes}"
        );
        let neigh = exec_ok(&pod.netns, &["ip", "neigh", "show", "169.254.1.1"]).expect("neigh");
        assert!(
            neigh.contains(&pod.host_veth_mac) && neigh.contains("PERMANENT"),
            "{neigh}"
        );
        println!(
            "{} {} on {} (veth {})",
            pod.k8s_name, pod.addr, pod.eni, pod.host_veth
        );
    }
    assert_eq!(cri::ipam_status().assigned_addrs, 3);

    // Pod to pod, and to each far end.
    let server = WhoamiServer::start(&pods[1].netns, SocketAddrV4::new(pods[1].addr, PORT))
        .expect("whoami in pod-1");
    let seen = tcp_whoami(&pods[0].netns, server.addr(), REPLY_TIMEOUT).expect("tcp probe");
    assert_eq!(
        seen.map(|s| *s.ip()),
        Some(pods[0].addr),
        "pod-1 saw pod-0 as"
    );
    drop(server);
    for (ns, far, expected) in [
        (addrs::NS_PEER, addrs::PEER_ADDR, pods[0].addr),
        // Outside the VPC CIDRs and not excluded: SNATed, as the VPC CNI does.
        (
            addrs::NS_ONPREM,
            addrs::ONPREM_ADDR,
            addrs::NODE_PRIMARY_ADDR,
        ),
        (addrs::NS_INET, addrs::INET_ADDR, addrs::NODE_PRIMARY_ADDR),
    ] {
        let server = WhoamiServer::start(ns, SocketAddrV4::new(far, PORT)).expect("whoami");
        let tcp = tcp_whoami(&pods[0].netns, server.addr(), REPLY_TIMEOUT).expect("tcp probe");
        let udp = udp_whoami(&pods[0].netns, server.addr(), REPLY_TIMEOUT).expect("udp probe");
        assert_eq!(tcp.map(|s| *s.ip()), Some(expected), "{ns} saw TCP from");
        assert_eq!(udp.map(|s| *s.ip()), Some(expected), "{ns} saw UDP from");
        println!("pod-0 -> {ns} {far}: seen as {expected} (tcp, udp)");
    }

    // portmap after the plugin: the node's hostPort reaches the pod.
    let spec = cri_pods::pod_spec_with_ports(
        3,
        &[PortMapping {
            protocol: Protocol::Tcp,
            container_port: PORT,
            host_port: HOST_PORT,
        }],
    );
    let mapped = cri_pods::run_pod(&client, 3, &spec).expect("a pod with a hostPort");
    let server = WhoamiServer::start(&mapped.netns, SocketAddrV4::new(mapped.addr, PORT))
        .expect("whoami in the hostPort pod");
    let via_node = SocketAddrV4::new(addrs::NODE_PRIMARY_ADDR, HOST_PORT);
    let seen = tcp_whoami(addrs::NS_PEER, via_node, REPLY_TIMEOUT).expect("hostPort probe");
    assert_eq!(
        seen.map(|s| *s.ip()),
        Some(addrs::PEER_ADDR),
        "the hostPort pod saw peer as"
    );
    println!(
        "peer -> {via_node} (hostPort) -> {}:{PORT}: answered",
        mapped.addr
    );
    drop(server);

    // Down the way kubelet takes pods down: nothing of them stays.
    remove_all_pods(&client);
    let after = node_traces();
    assert!(after.is_empty(), "left behind: {after:?}");
    let status = wait_ipam(
        "every address back in the pool",
        Duration::from_secs(10),
        |s| s.assigned_addrs == 0,
    );
    println!(
        "after the DELs: {} of {} addresses assigned",
        status.assigned_addrs, status.total_addrs
    );
    // After the cooldown, a new pod may get one of the freed addresses.
    let again = cri_pods::run_pod(&client, 4, &cri_pods::pod_spec(4)).expect("a new pod");
    assert!(addrs::NODE_SUBNET.contains(&again.addr));
    remove_all_pods(&client);
    lab.down().expect("taking the lab down");
}

#[test]
fn a_branch_eni_pod_through_cri_leaves_by_its_branch_eni() {
    let _lock = serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    // Security groups for pods on, strict (the VPC CNI's default).
    let lab = cri::up_with_env(0, "m5.large", &[("ENABLE_POD_ENI", "true")]);
    let client = lab.cri().expect("a CRI client");
    let branch_addr = Ipv4Addr::new(10, 20, 11, 250);
    let annotation = lab
        .add_branch_eni(branch_addr)
        .expect("a branch ENI on the trunk");
    let vlan_id = vpcnet_api::pod::branch_eni_of(&annotation)
        .expect("the controller's JSON")
        .expect("one branch ENI")
        .vlan_id;
    assert_eq!(vlan_id, 1, "the lowest free VLAN id");
    let mut spec = cri_pods::pod_spec(0);
    spec.annotations
        .insert(vpcnet_api::pod::POD_ENI_ANNOTATION.to_owned(), annotation);
    let pod = cri_pods::run_pod(&client, 0, &spec).expect("a pod with a branch ENI");
    assert_eq!(pod.addr, branch_addr, "the branch ENI's address");
    assert_eq!(pod.eni, addrs::branch_link(vlan_id));
    assert_eq!(
        pod.host_veth,
        vpcnet_api::pod::host_veth_name("vlan", &pod.k8s_namespace, &pod.k8s_name),
        "strict mode names the host veth vlan<hash>"
    );
    assert_eq!(
        cri::ipam_status().assigned_addrs,
        0,
        "no pool address taken"
    );

    let peer = WhoamiServer::start(addrs::NS_PEER, SocketAddrV4::new(addrs::PEER_ADDR, PORT))
        .expect("whoami in peer");
    let branch_link = addrs::vpc_branch_link(vlan_id);
    let before = lab.packets_from(&branch_link).expect("router counter");
    let seen = tcp_whoami(&pod.netns, peer.addr(), REPLY_TIMEOUT).expect("tcp probe");
    assert_eq!(
        seen.map(|s| *s.ip()),
        Some(branch_addr),
        "peer saw the branch pod as"
    );
    let after = lab.packets_from(&branch_link).expect("router counter");
    assert!(
        after > before,
        "nothing came in by the branch ENI ({before} -> {after})"
    );
    println!(
        "branch pod {branch_addr} (VLAN {vlan_id}, strict) -> peer: seen as {branch_addr}, {} packets by {branch_link}",
        after - before
    );
    drop(peer);

    remove_all_pods(&client);
    let traces = node_traces();
    assert!(
        traces.endpoints.is_empty() && traces.pod_link_pins.is_empty(),
        "left behind: {traces:?}"
    );
    assert!(
        !exec_ok(addrs::NS_NODE, &["ip", "-o", "link"])
            .expect("links")
            .contains(&pod.host_veth),
        "the branch pod's veth is left"
    );
    lab.down().expect("taking the lab down");
}
