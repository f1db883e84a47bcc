//! Custom networking with ENIConfig objects, as aws-node reads them: the
//! agent in-cluster takes the subnet and security groups of new ENIs from
//! the ENIConfig its Node names (label `k8s.amazonaws.com/eniConfig`, put
//! there with kubectl), and follows it: relabelled, or the ENIConfig
//! edited, the next new ENI follows; the ENIs attached stay. A missing or
//! malformed ENIConfig is logged once, naming it and what is wrong, and the
//! node keeps the config in force (none yet: no ENI for pods), which
//! introspection's `/v1/eni-configs` shows.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use vpcnet_bpf_tests::{
    ipam::{IpamLab, agent_log_tail, lab_lock},
    scrape::{INTROSPECTION, get},
};
use vpcnet_lab::{
    addrs::PEER_ADDR,
    cluster::{kubectl, node_name},
    ec2::{
        config::{LAB_CUSTOM_SUBNET_ID, LAB_DEFAULT_SG_ID, LAB_NODE_SG_ID, LAB_PEER_SUBNET_ID},
        model::{Eni, StateSnapshot},
    },
};

/// How long the agent may take to follow a change in the cluster.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(30);
const LABEL: &str = "k8s.amazonaws.com/eniConfig";

fn kubectl_ok(lab: &IpamLab, args: &[&str], stdin: Option<&str>) {
    let files = lab.lab.kube_api().expect("in-cluster").files();
    kubectl(files, args, stdin).unwrap_or_else(|e| panic!("kubectl {args:?}: {e}"));
}

/// `kubectl apply` of an ENIConfig whose spec is `spec` (YAML flow).
fn apply_eni_config(lab: &IpamLab, name: &str, spec: &str) {
    let manifest = format!(
        "apiVersion: crd.k8s.amazonaws.com/v1alpha1\nkind: ENIConfig\nmetadata:\n  name: {name}\nspec: {spec}\n"
    );
    kubectl_ok(lab, &["apply", "-f", "-"], Some(&manifest));
}

fn label_node(lab: &IpamLab, eni_config: &str) {
    kubectl_ok(
        lab,
        &[
            "label",
            "nodes",
            &node_name(),
            &format!("{LABEL}={eni_config}"),
            "--overwrite",
        ],
        None,
    );
}

/// What `/v1/eni-configs` says is in force: name, subnet, security groups.
fn in_force() -> Value {
    let answer = get(INTROSPECTION, "/v1/eni-configs");
    assert_eq!(answer.status, 200, "{}", answer.body);
    let view: Value = serde_json::from_str(&answer.body).unwrap();
    json!([view["name"], view["subnet"], view["security_groups"]])
}

fn agent_log() -> String {
    std::fs::read_to_string(vpcnet_lab::agent_log_file()).unwrap_or_default()
}

/// Waits (bounded) until the agent's log has a line with every one of
/// `parts`; the number of such lines.
fn wait_log(parts: &[&str]) -> usize {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    loop {
        let log = agent_log();
        let n = log
            .lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .count();
        if n > 0 {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "no log line with {parts:?}:\n{}",
            agent_log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The instance's attached ENIs, by device index.
fn attached(state: &StateSnapshot, instance: &str) -> Vec<Eni> {
    let mut enis: Vec<Eni> = state
        .enis
        .iter()
        .filter(|e| {
            e.attachment
                .as_ref()
                .is_some_and(|a| a.instance_id == instance)
        })
        .cloned()
        .collect();
    enis.sort_by_key(|e| e.attachment.as_ref().map(|a| a.device_index));
    enis
}

/// ADDs pods from `next` until the instance has `enis` ENIs attached; the
/// newest one.
fn grow_to(lab: &mut IpamLab, instance: &str, next: &mut usize, enis: usize) -> Eni {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    loop {
        let now = attached(&lab.ec2_state(), instance);
        if now.len() >= enis {
            assert_eq!(now.len(), enis, "{now:?}");
            return now[enis - 1].clone();
        }
        assert!(
            Instant::now() < deadline,
            "no ENI #{enis}: {now:?}\n{}",
            agent_log_tail()
        );
        lab.add(*next)
            .unwrap_or_else(|e| panic!("ADD of pod {next}: {e}"));
        *next += 1;
    }
}

#[test]
#[allow(clippy::too_many_lines)] // one node's story, step by step
fn new_enis_follow_the_eniconfig_the_node_names() {
    let _lock = lab_lock();
    // One address ahead of the pods: a new ENI only once the last is full,
    // so none is under way when the test changes the config.
    let mut lab = IpamLab::up_in_cluster(
        "m5.4xlarge",
        &[
            ("AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG", "true"),
            ("WARM_IP_TARGET", "1"),
        ],
    );
    let instance = lab.emulator().instance_id().to_owned();
    // The peer host's address is no pod's.
    lab.emulator()
        .admin()
        .occupy(LAB_PEER_SUBNET_ID, &[PEER_ADDR], &[])
        .expect("occupying the peer's address");

    // No ENIConfig yet: the node's ("default", unlabelled) is missing, said
    // once; no ENI for pods.
    wait_log(&["ENIConfig \"default\" does not exist"]);
    let primary = attached(&lab.ec2_state(), &instance);
    assert_eq!(primary.len(), 1, "no custom-networking ENI: {primary:?}");
    let primary_groups = primary[0].groups.clone();
    assert_eq!(in_force(), json!([null, null, []]));

    // Two ENIConfigs; the Node labelled to the first.
    apply_eni_config(
        &lab,
        "pods-a",
        &format!("{{subnet: {LAB_CUSTOM_SUBNET_ID}, securityGroups: [{LAB_NODE_SG_ID}]}}"),
    );
    apply_eni_config(&lab, "pods-b", &format!("{{subnet: {LAB_PEER_SUBNET_ID}}}"));
    label_node(&lab, "pods-a");
    let mut next = 0;
    let first = grow_to(&mut lab, &instance, &mut next, 2);
    assert_eq!(first.subnet_id, LAB_CUSTOM_SUBNET_ID);
    assert_eq!(first.groups, [LAB_NODE_SG_ID]);
    assert_eq!(
        in_force(),
        json!(["pods-a", LAB_CUSTOM_SUBNET_ID, [LAB_NODE_SG_ID]])
    );

    // Relabelled: the next ENI in the other ENIConfig's subnet, with the
    // primary ENI's groups (its securityGroups are empty).
    label_node(&lab, "pods-b");
    wait_log(&["new ENIs from this ENIConfig", "pods-b"]);
    let second = grow_to(&mut lab, &instance, &mut next, 3);
    assert_eq!(second.subnet_id, LAB_PEER_SUBNET_ID);
    assert_eq!(second.groups, primary_groups);

    // Malformed: said once, naming it and what is wrong; the next ENI
    // still from the config in force.
    apply_eni_config(&lab, "pods-b", "{subnet: pods, securityGroups: [sg-x]}");
    wait_log(&["pods-b", "spec.subnet \"pods\" is not a subnet id"]);
    let third = grow_to(&mut lab, &instance, &mut next, 4);
    assert_eq!(third.subnet_id, LAB_PEER_SUBNET_ID);
    assert_eq!(in_force(), json!(["pods-b", LAB_PEER_SUBNET_ID, []]));
    // Edited into shape: the next ENI follows the edit.
    apply_eni_config(
        &lab,
        "pods-b",
        &format!(
            "{{subnet: {LAB_CUSTOM_SUBNET_ID}, securityGroups: [{LAB_DEFAULT_SG_ID}, {LAB_NODE_SG_ID}]}}"
        ),
    );
    wait_log(&[
        "new ENIs from this ENIConfig",
        "pods-b",
        LAB_CUSTOM_SUBNET_ID,
    ]);
    let fourth = grow_to(&mut lab, &instance, &mut next, 5);
    assert_eq!(fourth.subnet_id, LAB_CUSTOM_SUBNET_ID);
    let mut groups = fourth.groups.clone();
    groups.sort();
    assert_eq!(groups, [LAB_DEFAULT_SG_ID, LAB_NODE_SG_ID]);

    // The ENIs attached before each change stay, as they were.
    let enis = attached(&lab.ec2_state(), &instance);
    let subnets: Vec<&str> = enis.iter().map(|e| e.subnet_id.as_str()).collect();
    assert_eq!(
        subnets[1..],
        [
            LAB_CUSTOM_SUBNET_ID,
            LAB_PEER_SUBNET_ID,
            LAB_PEER_SUBNET_ID,
            LAB_CUSTOM_SUBNET_ID
        ]
    );
    // Each problem said once.
    let log = agent_log();
    let said = |text: &str| log.lines().filter(|l| l.contains(text)).count();
    assert_eq!(said("ENIConfig \"default\" does not exist"), 1, "{log}");
    assert_eq!(said("is not a subnet id"), 1, "{log}");
    let calls = lab
        .lab
        .kube_api()
        .unwrap()
        .admin()
        .calls()
        .expect("the API server's calls");
    let forbidden: Vec<_> = calls.calls.iter().filter(|c| c.status == 403).collect();
    assert!(forbidden.is_empty(), "{forbidden:?}");
    println!(
        "ENIs: {:?}; {} pods",
        enis.iter()
            .map(|e| (e.id.as_str(), e.subnet_id.as_str(), e.groups.clone()))
            .collect::<Vec<_>>(),
        next
    );
    drop(lab);
}
