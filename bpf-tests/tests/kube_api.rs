//! The agent in-cluster, against the lab's Kubernetes API server: its
//! ServiceAccount token mounted where every pod has it, the API server
//! behind the `kubernetes` Service (kube-proxy's rules in the node), RBAC
//! from `deploy/kubernetes/rbac.yaml`. The agent reads max pods from its
//! Node and keeps the datapath's service CIDRs the cluster's
//! ServiceCIDR objects, also when they change; with the API server answering 503
//! it starts from what it knows, says so, and catches up once it answers.
//! It looks at this node's pods as aws-node does: a pod asking for a
//! branch ENI gets none of the pool's addresses while the resource
//! controller has not annotated it, and `ANNOTATE_POD_IP` writes the pods'
//! addresses; its address manager's events go to its Pod. With the API
//! server failing (401, 403, 500, no answer, its watches cut) or slow, the
//! pods it knew still start, each failure is counted in `/metrics`, and it
//! catches up once the server answers. A CNINode feature it cannot read is
//! left as it is, said once.

use std::time::{Duration, Instant};

use serde_json::json;
use tonic::Code;
use vpcnet_bpf_tests::{
    agent_binary,
    cri::ipam_status,
    ipam::{IpamLab, lab_lock},
    scrape::{Samples, sample_if, scrape_until},
};
use vpcnet_lab::{
    IpamLabOptions, Lab, LabOptions,
    addrs::NS_NODE,
    cluster::{AGENT_NAMESPACE, AGENT_POD_NAME, node_name},
    ec2::config::FaultRule as Ec2FaultRule,
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
    let mut lab = Lab::up(&LabOptions {
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

    // A newer controller's feature, with a field vpcnet does not know: the
    // restarted agent does not rewrite the list (it would drop the field),
    // says so once, naming the object, and the CNINode stays as it is.
    let newer = json!([{"name": "CustomNetworking", "value": "pods-a", "weight": 2}]);
    admin
        .merge_patch(&path, &json!({"spec": {"features": newer}}))
        .unwrap();
    lab.stop_agent().unwrap();
    lab.start_agent().unwrap();
    let said = format!("CNINode {} has what vpcnet cannot read", node_name());
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    let log = loop {
        let log = std::fs::read_to_string(lab.agent_log().unwrap()).unwrap();
        if log.contains(&said) || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(
        log.lines()
            .filter(|l| l.contains(&said) && l.contains("unknown field `weight`"))
            .count(),
        1,
        "{log}"
    );
    assert_eq!(admin.get(&path).unwrap()["spec"]["features"], newer);
    let calls = admin.calls().unwrap();
    assert_eq!(
        calls.answers(AGENT, "patch", "cninodes").get(&200),
        Some(&1),
        "{calls:?}"
    );
    lab.down().unwrap();
}

/// Polls `path` (bounded) until `check` holds for the object.
fn wait_object(
    admin: &KubeAdmin,
    path: &str,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    loop {
        let object = admin.get(path).unwrap();
        if check(&object) {
            return object;
        }
        assert!(Instant::now() < deadline, "{what}: {object}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A pod of the `default` namespace bound to the node, as the ipam lab's
/// ADD `id` names it; `limits` on its first container.
fn bind_pod(admin: &KubeAdmin, id: usize, limits: &serde_json::Value) -> String {
    let path = format!("/api/v1/namespaces/default/pods/pod-{id}");
    admin
        .apply(
            &path,
            &json!({"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("pod-{id}"), "namespace": "default"},
                "spec": {"nodeName": node_name(), "containers": [{"name": "app",
                    "image": "registry.k8s.io/pause:3.9", "resources": {"limits": limits}}]}}),
        )
        .unwrap();
    path
}

#[test]
fn a_pod_waiting_for_its_branch_eni_gets_no_address_and_pod_ips_are_annotated() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up_in_cluster(
        "m5.large",
        &[
            ("ENABLE_POD_ENI", "true"),
            ("ANNOTATE_POD_IP", "true"),
            ("WARM_IP_TARGET", "1"),
        ],
    );
    let admin = lab.lab.kube_api().unwrap().admin().clone();
    let sgp_pod = bind_pod(&admin, 1, &json!({"vpc.amazonaws.com/pod-eni": "1"}));
    let plain_pod = bind_pod(&admin, 2, &json!({"cpu": "100m"}));
    restart_knowing_the_pods(&mut lab, &admin);
    let assigned = lab.status().assigned_addrs;

    // Asks for a branch ENI, has none yet: kubelet is told to try again,
    // and no pool address is taken.
    let waiting = lab.add(1).unwrap_err();
    assert_eq!(waiting.code(), Code::FailedPrecondition, "{waiting:?}");
    assert!(
        waiting.message().contains("default/pod-1")
            && waiting.message().contains("vpc.amazonaws.com/pod-eni"),
        "{waiting:?}"
    );
    assert_eq!(lab.status().assigned_addrs, assigned);

    // Once the controller annotated it, the branch ENI of the annotation
    // is what the ADD looks for (this node has no trunk: no such link),
    // also while the agent's copy of the pod is stale: its watch cut, and
    // the next one not answered yet.
    admin
        .set_faults(&[FaultRule {
            user: Some(AGENT.to_owned()),
            verb: Some("watch".to_owned()),
            resource: Some("pods".to_owned()),
            delay_ms: Some(60_000),
            ..FaultRule::default()
        }])
        .unwrap();
    admin.end_watches().unwrap();
    admin
        .merge_patch(
            &sgp_pod,
            &json!({"metadata": {"annotations": {"vpc.amazonaws.com/pod-eni":
                r#"[{"eniId":"eni-0b1a2c3d4e5f60718","ifAddress":"0a:1b:2c:3d:4e:5f","privateIp":"10.20.11.200","vlanId":7,"subnetCidr":"10.20.11.0/24"}]"#}}}),
        )
        .unwrap();
    let no_trunk = lab.add(1).unwrap_err();
    assert!(
        no_trunk.message().contains("eni-0b1a2c3d4e5f60718"),
        "{no_trunk:?}"
    );
    admin.set_faults(&[]).unwrap();
    assert_eq!(lab.status().assigned_addrs, assigned);

    // An ordinary pod gets a pool address, written into its annotation.
    let addr = lab.add(2).unwrap().ipv4_addr;
    let annotation = |pod: &serde_json::Value| {
        pod["metadata"]["annotations"]["vpc.amazonaws.com/pod-ips"]
            .as_str()
            .map(str::to_owned)
    };
    wait_object(&admin, &plain_pod, "the pod's address annotated", |pod| {
        annotation(pod).as_deref() == Some(addr.as_str())
    });
    assert_eq!(lab.del(2).unwrap().map(|a| a.to_string()), Some(addr));
    wait_object(&admin, &plain_pod, "the annotation blanked on DEL", |pod| {
        annotation(pod).as_deref() == Some("")
    });
    let calls = admin.calls().unwrap();
    assert!(
        calls.answers(AGENT, "patch", "pods").get(&200) >= Some(&2),
        "{calls:?}"
    );
    lab.lab.down().unwrap();
}

/// The pods' watch answered 200 this many times to the agent.
fn pod_watches(admin: &KubeAdmin) -> u64 {
    admin
        .calls()
        .unwrap()
        .answers(AGENT, "watch", "pods")
        .get(&200)
        .copied()
        .unwrap_or(0)
}

/// Restarts the agent and waits (bounded) until it watches this node's
/// pods again: it listed them first, so every pod bound so far is in what
/// it knows.
fn restart_knowing_the_pods(lab: &mut IpamLab, admin: &KubeAdmin) {
    lab.lab.stop_agent().unwrap();
    let watches = pod_watches(admin);
    lab.lab.start_agent().unwrap();
    lab.connect();
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    while pod_watches(admin) <= watches {
        assert!(
            Instant::now() < deadline,
            "the agent never watched the pods again"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `vpcnet_kubernetes_api_answers_total{code}` in a scrape, 0 if absent.
fn answers(samples: &Samples, code: &str) -> u64 {
    sample_if(
        samples,
        "vpcnet_kubernetes_api_answers_total",
        &[("code", code)],
    )
    .unwrap_or(0)
}

#[test]
fn with_the_api_server_failing_known_pods_start_and_every_failure_is_counted() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up_in_cluster(
        "m5.large",
        &[("ENABLE_POD_ENI", "true"), ("ANNOTATE_POD_IP", "true")],
    );
    let admin = lab.lab.kube_api().unwrap().admin().clone();
    let known = bind_pod(&admin, 1, &json!({"cpu": "100m"}));
    restart_knowing_the_pods(&mut lab, &admin);

    // The API server fails every way the agent can meet, and its open
    // watches end as in a restart.
    let agent_fault = |verb: &str, resource: Option<&str>, status: Option<u16>| FaultRule {
        user: Some(AGENT.to_owned()),
        verb: Some(verb.to_owned()),
        resource: resource.map(str::to_owned),
        status,
        drop_connection: status.is_none(),
        ..FaultRule::default()
    };
    admin
        .set_faults(&[
            agent_fault("get", Some("pods"), Some(401)),
            agent_fault("patch", Some("pods"), Some(403)),
            agent_fault("watch", Some("pods"), None),
            agent_fault("watch", None, Some(500)),
            agent_fault("list", None, Some(500)),
        ])
        .unwrap();
    admin.end_watches().unwrap();

    // A pod the agent knew starts from the warm pool.
    let addr = lab
        .add(1)
        .expect("a known pod's ADD with the API failing")
        .ipv4_addr;
    // One it could not learn of is told to come back (kubelet retries).
    let unseen = bind_pod(&admin, 2, &json!({"cpu": "100m"}));
    let refused = lab.add(2).unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("default/pod-2"), "{refused:?}");
    let failing = scrape_until("each failure counted", FOLLOW_TIMEOUT, |samples| {
        ["401", "403", "500", "none"]
            .iter()
            .all(|code| answers(samples, code) > 0)
    });
    let log = std::fs::read_to_string(lab.lab.agent_log().unwrap()).unwrap();
    assert!(
        log.contains("watching this node's pods: ADDs use what is known, retrying"),
        "{log}"
    );
    // Slow rather than failing: the ADD does not wait past its bound.
    admin
        .set_faults(&[FaultRule {
            delay_ms: Some(20_000),
            drop_connection: false,
            ..agent_fault("get", Some("pods"), None)
        }])
        .unwrap();
    let asked = Instant::now();
    let slow = lab.add(2).unwrap_err();
    assert_eq!(slow.code(), Code::FailedPrecondition, "{slow:?}");
    assert!(slow.message().contains("no answer within"), "{slow:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );

    // Back: the annotation the agent kept retrying lands, the watch
    // catches up and the other pod starts.
    admin.set_faults(&[]).unwrap();
    wait_object(&admin, &known, "pod-1's address annotated", |pod| {
        pod["metadata"]["annotations"]["vpc.amazonaws.com/pod-ips"].as_str() == Some(&addr)
    });
    let second = lab
        .add(2)
        .expect("the other pod, with the API back")
        .ipv4_addr;
    wait_object(&admin, &unseen, "pod-2's address annotated", |pod| {
        pod["metadata"]["annotations"]["vpc.amazonaws.com/pod-ips"].as_str() == Some(&second)
    });
    println!(
        "with the API failing: {} answered 401, {} 403, {} 500, {} not at all; pod-1 started",
        answers(&failing, "401"),
        answers(&failing, "403"),
        answers(&failing, "500"),
        answers(&failing, "none")
    );
    lab.lab.down().unwrap();
}

#[test]
fn the_address_managers_events_are_events_on_the_agents_pod() {
    let _lock = lab_lock();
    let mut lab = IpamLab::up_in_cluster("m5.large", &[("WARM_IP_TARGET", "1")]);
    let admin = lab.lab.kube_api().unwrap().admin().clone();
    // The node's IAM role lost AssignPrivateIpAddresses once the pool had
    // its spare address: it cannot grow back after the next ADD takes it.
    lab.wait_status("the warm address", FOLLOW_TIMEOUT, |status| {
        status.total_addrs > status.assigned_addrs
    });
    lab.emulator()
        .admin()
        .set_faults(&[Ec2FaultRule {
            action: "AssignPrivateIpAddresses".into(),
            unauthorized: 1.0,
            ..Ec2FaultRule::default()
        }])
        .unwrap();
    lab.add(1).unwrap();
    let events_path = format!("/apis/events.k8s.io/v1/namespaces/{AGENT_NAMESPACE}/events");
    let events = wait_object(
        &admin,
        &events_path,
        "a MissingIAMPermissions event",
        |list| {
            list["items"]
                .as_array()
                .is_some_and(|items| items.iter().any(|e| e["reason"] == "MissingIAMPermissions"))
        },
    );
    let event = events["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["reason"] == "MissingIAMPermissions")
        .unwrap();
    // As aws-node sends it: a warning on the agent's pod, the EC2 call as
    // the action.
    assert_eq!(event["type"], "Warning", "{event}");
    assert_eq!(event["action"], "AssignPrivateIpAddresses", "{event}");
    assert_eq!(event["regarding"]["kind"], "Pod", "{event}");
    assert_eq!(event["regarding"]["name"], AGENT_POD_NAME, "{event}");
    assert!(event["regarding"]["uid"].is_string(), "{event}");
    assert_eq!(event["reportingController"], "vpcnet-agent", "{event}");
    lab.emulator().admin().set_faults(&[]).unwrap();
    lab.lab.down().unwrap();
}
