//! The agent in-cluster, against the lab's Kubernetes API server: its
//! ServiceAccount token mounted where every pod has it, the API server
//! behind the `kubernetes` Service (kube-proxy's rules in the node), RBAC
//! from `deploy/kubernetes/rbac.yaml`. The agent reads max pods from its
//! Node and keeps the datapath's service CIDRs the cluster's
//! ServiceCIDR objects, also when they change; with the API server answering 503
//! it starts from what it knows, says so, and catches up once it answers.

use std::time::{Duration, Instant};

use serde_json::json;
use vpcnet_bpf_tests::{agent_binary, cri::ipam_status, ipam::lab_lock};
use vpcnet_lab::{
    IpamLabOptions, Lab, LabOptions,
    addrs::NS_NODE,
    cluster::node_name,
    kube::{KubeAdmin, server::FaultRule},
};

/// How long the agent may take to follow a change in the cluster.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(30);
/// The agent's user in the API server.
const AGENT: &str = "system:serviceaccount:kube-system:vpcnet";

/// The datapath's service CIDRs, as `vpcnet-agent config` prints them.
fn service_cidrs() -> Vec<String> {
    let agent = agent_binary();
    let out = vpcnet_lab::exec_ok(NS_NODE, &[agent.to_str().unwrap(), "config"]).unwrap();
    out.lines()
        .filter(|l| l.starts_with("cidr") && l.contains("Service"))
        .map(|l| l.split_whitespace().nth(1).unwrap().to_owned())
        .collect()
}

/// Polls the datapath (bounded) until its service CIDRs are `want`.
fn wait_service_cidrs(want: &[&str], what: &str) {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    loop {
        let now = service_cidrs();
        if now == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the datapath's service CIDRs stayed {now:?}, not {want:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn set_node_max_pods(admin: &KubeAdmin, pods: u32) {
    admin
        .merge_patch(
            &format!("/api/v1/nodes/{}", node_name()),
            &json!({"status": {"capacity": {"pods": pods.to_string()}}}),
        )
        .unwrap();
}

#[test]
fn the_agent_reads_its_node_and_follows_the_clusters_service_cidrs() {
    let _lock = lab_lock();
    let mut ipam = IpamLabOptions::new("t3.medium");
    ipam.kube_api = true;
    let mut lab = Lab::up(&LabOptions {
        ipam: Some(ipam),
        ..LabOptions::ebpf(0, agent_binary())
    })
    .unwrap();
    let admin = lab.kube_api().unwrap().admin().clone();

    // The cluster's ServiceCIDR (10.100.0.0/16), not both EKS defaults.
    assert_eq!(service_cidrs(), ["10.100.0.0/16"]);
    // t3.medium's EKS max pods, from the Node kubelet registered.
    assert_eq!(ipam_status().max_pods, 17);
    admin
        .apply(
            "/apis/networking.k8s.io/v1/servicecidrs/extra",
            &json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                "metadata": {"name": "extra"}, "spec": {"cidrs": ["10.101.0.0/24"]}}),
        )
        .unwrap();
    wait_service_cidrs(&["10.100.0.0/16", "10.101.0.0/24"], "a ServiceCIDR added");
    admin
        .delete("/apis/networking.k8s.io/v1/servicecidrs/extra")
        .unwrap();
    wait_service_cidrs(&["10.100.0.0/16"], "a ServiceCIDR removed");

    // The API server answers 503 to everything the agent asks: it starts
    // on the defaults and the instance type's max pods, and says so.
    set_node_max_pods(&admin, 11);
    admin
        .set_faults(&[FaultRule {
            user: Some(AGENT.to_owned()),
            status: Some(503),
            ..FaultRule::default()
        }])
        .unwrap();
    lab.stop_agent().unwrap();
    lab.start_agent().unwrap();
    assert_eq!(service_cidrs(), ["10.100.0.0/16", "172.20.0.0/16"]);
    assert_eq!(ipam_status().max_pods, 17);
    let log = std::fs::read_to_string(lab.agent_log().unwrap()).unwrap();
    assert!(
        log.contains("the cluster's service CIDRs are unknown: the defaults until the API answers"),
        "{log}"
    );
    // Once it answers, the agent catches up without a restart.
    admin.set_faults(&[]).unwrap();
    wait_service_cidrs(&["10.100.0.0/16"], "the API server back");

    // Max pods is read at start: the Node's new capacity.
    lab.stop_agent().unwrap();
    lab.start_agent().unwrap();
    assert_eq!(ipam_status().max_pods, 11);

    let calls = admin.calls().unwrap();
    assert!(
        calls
            .answers(AGENT, "list", "servicecidrs")
            .contains_key(&503),
        "{calls:?}"
    );
    for verb in ["list", "watch"] {
        assert!(
            calls.answers(AGENT, verb, "nodes").contains_key(&200),
            "{verb} nodes: {calls:?}"
        );
    }
    assert!(
        calls
            .answers(AGENT, "watch", "servicecidrs")
            .contains_key(&200),
        "{calls:?}"
    );
    // deploy/'s RBAC is enough for all of it.
    let forbidden: Vec<_> = calls
        .calls
        .iter()
        .filter(|c| c.user == AGENT && c.status == 403)
        .collect();
    assert!(forbidden.is_empty(), "{forbidden:?}");
    lab.down().unwrap();
}

#[test]
fn with_pod_eni_the_agent_asks_for_a_trunk_on_its_cninode() {
    let _lock = lab_lock();
    let mut ipam = IpamLabOptions::new("m5.large");
    ipam.kube_api = true;
    ipam.env = vec![("ENABLE_POD_ENI".to_owned(), "true".to_owned())];
    let lab = Lab::up(&LabOptions {
        ipam: Some(ipam),
        ..LabOptions::ebpf(0, agent_binary())
    })
    .unwrap();
    let admin = lab.kube_api().unwrap().admin().clone();
    let path = format!(
        "/apis/vpcresources.k8s.aws/v1alpha1/cninodes/{}",
        node_name()
    );
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    let cninode = loop {
        let cninode = admin.get(&path).unwrap();
        if cninode["spec"]["features"].is_array() || Instant::now() > deadline {
            break cninode;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // As aws-node writes it: the feature without a value, the controller's
    // tags kept.
    assert_eq!(
        cninode["spec"]["features"],
        json!([{"name": "SecurityGroupsForPods"}]),
        "{cninode}"
    );
    assert!(
        cninode["spec"]["tags"]["node.k8s.amazonaws.com/instance_id"].is_string(),
        "{cninode}"
    );
    let calls = admin.calls().unwrap();
    assert_eq!(
        calls.answers(AGENT, "patch", "cninodes").get(&200),
        Some(&1),
        "{calls:?}"
    );
    lab.down().unwrap();
}
