//! The lab as a cluster with network policy: pods made through CRI in
//! namespaces `x` and `y`, with labels, exist as Pod objects (their
//! Namespaces labelled as real clusters label them); a NetworkPolicy
//! applied with kubectl is turned into PolicyEndpoints by the lab's network
//! policy controller, as EKS's control plane does, and they follow the
//! pods' labels, the namespaces' labels, pods coming and going, and the
//! policy's deletion. A cluster without the PolicyEndpoint CRD (no network
//! policy controller) delays no pod and isolates none. Fields the agent
//! cannot enforce as written are Events on its pod, from either source,
//! and the policies in force stay while the API server is away.
//!
//! Run: `cargo xtask test --skip-lint -p vpcnet-bpf-tests --test
//! policy_endpoints`.

use std::{
    net::SocketAddrV4,
    time::{Duration, Instant},
};

use serde_json::{Value, json};
use vpcnet_agent::{
    k8s::policy_endpoints,
    policy::{fields, node, settings::ENV_POLICY_ADD_WAIT},
};
use vpcnet_bpf_tests::{
    agent_cli,
    cri::{self, CriNode},
    ipam::lab_lock,
    scrape,
};
use vpcnet_lab::{
    Lab, NamedPod, WhoamiServer, addrs, cluster,
    kube::{KubeAdmin, server::FaultRule},
    parse_label_changes, tcp_whoami,
};

/// How long the controller may take to follow a change.
const FOLLOW_TIMEOUT: Duration = Duration::from_secs(30);
const PE_PATH: &str = "/apis/networking.k8s.aws/v1alpha1/namespaces/x/policyendpoints";

const POLICY: &str = r"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: web
  namespace: x
spec:
  podSelector:
    matchLabels: {app: web}
  ingress:
  - from:
    - namespaceSelector:
        matchLabels: {team: blue}
      podSelector:
        matchLabels: {app: client}
    - ipBlock: {cidr: 192.0.2.0/24, except: [192.0.2.128/25]}
    ports:
    - port: 8080
  egress:
  - to:
    - podSelector: {}
";

fn changes(text: &str) -> Vec<(String, Option<String>)> {
    parse_label_changes(text).unwrap()
}

/// Polls the policy's PolicyEndpoints (bounded) until `done` holds of
/// them; the last ones it saw.
fn wait_endpoints(admin: &KubeAdmin, what: &str, done: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    loop {
        let list = admin.get(PE_PATH).unwrap();
        let items = list["items"].as_array().cloned().unwrap_or_default();
        if done(&items) {
            return items;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {FOLLOW_TIMEOUT:?}; the PolicyEndpoints are {items:#?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pod addresses (and CIDRs) of a direction of the one object.
fn cidrs(items: &[Value], direction: &str) -> Vec<String> {
    items
        .iter()
        .flat_map(|pe| {
            pe["spec"][direction]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|e| e["cidr"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The selected pods' names.
fn selected(items: &[Value]) -> Vec<String> {
    let mut names: Vec<String> = items
        .iter()
        .flat_map(|pe| {
            pe["spec"]["podSelectorEndpoints"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|e| e["name"].as_str().unwrap_or_default().to_owned())
        .collect();
    names.sort();
    names
}

fn addr(lab: &Lab, key: &str) -> String {
    lab.pod_named(key).unwrap().addr.to_string()
}

#[test]
fn policies_become_policy_endpoints_that_follow_pods_namespaces_and_labels() {
    let _lock = lab_lock();
    let pods: Vec<NamedPod> = ["x/a:app=web", "x/b:app=db", "y/c:app=client"]
        .iter()
        .map(|p| p.parse().unwrap())
        .collect();
    // Dropped at the end, on failure too: the lab goes with it.
    let mut lab = cri::up_with(&CriNode {
        kube_api: true,
        named_pods: &pods,
        ..CriNode::new(1, "m5.large")
    });
    let admin = lab.kube_admin().unwrap();
    let files = lab.kube_api().unwrap().files().clone();

    // Each pod as kubelet makes it: the plugin named its veth from
    // K8S_POD_NAMESPACE and K8S_POD_NAME; the numbered pod is unchanged.
    let a = lab.pod_named("x/a").unwrap().clone();
    assert_eq!(a.host_veth, addrs::host_veth_name("x", "a"));
    assert_eq!(a.labels["app"], "web");
    assert_eq!(lab.pod_named("default/pod-0").unwrap().k8s_name, "pod-0");
    let object = admin.get("/api/v1/namespaces/y/pods/c").unwrap();
    assert_eq!(object["metadata"]["labels"]["app"], "client");
    assert_eq!(object["status"]["podIP"], addr(&lab, "y/c").as_str());
    let namespace = admin.get("/api/v1/namespaces/y").unwrap();
    assert_eq!(
        namespace["metadata"]["labels"]["kubernetes.io/metadata.name"],
        "y"
    );
    // The state file names each pod for other processes.
    let state = vpcnet_lab::LabState::load().unwrap();
    assert_eq!(state.pod_named("x/a").unwrap().netns, a.netns);

    lab.label_namespace("y", &changes("team=blue")).unwrap();
    cluster::kubectl(&files, &["apply", "-f", "-"], Some(POLICY)).unwrap();
    let policy = admin
        .get("/apis/networking.k8s.io/v1/namespaces/x/networkpolicies/web")
        .unwrap();
    let (a_ip, b_ip, c_ip) = (addr(&lab, "x/a"), addr(&lab, "x/b"), addr(&lab, "y/c"));
    let items = wait_endpoints(&admin, "the policy resolved", |items| {
        cidrs(items, "ingress").contains(&c_ip)
    });
    assert_eq!(items.len(), 1, "{items:#?}");
    let pe = &items[0];
    let name = pe["metadata"]["name"].as_str().unwrap().to_owned();
    assert!(name.starts_with("web-"), "{name}");
    assert_eq!(
        pe["metadata"]["ownerReferences"],
        json!([{"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "name": "web",
            "uid": policy["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true}])
    );
    let port = json!([{"protocol": "TCP", "port": 8080}]);
    assert_eq!(
        pe["spec"],
        json!({
            "podSelector": {"matchLabels": {"app": "web"}},
            "policyRef": {"name": "web", "namespace": "x"},
            "podIsolation": ["Ingress", "Egress"],
            "podSelectorEndpoints": [{"hostIP": addrs::NODE_PRIMARY_ADDR.to_string(),
                "podIP": a_ip, "name": "a", "namespace": "x"}],
            "ingress": [
                {"cidr": c_ip, "ports": port},
                {"cidr": "192.0.2.0/24", "except": ["192.0.2.128/25"], "ports": port},
            ],
            "egress": [{"cidr": a_ip}, {"cidr": b_ip}],
        })
    );
    let listed = cluster::kubectl(&files, &["get", "netpol,policyendpoints", "-A"], None).unwrap();
    assert!(
        listed.contains("networkpolicy.networking.k8s.io/web")
            && listed.contains(&format!("policyendpoint.networking.k8s.aws/{name}")),
        "{listed}"
    );

    // The namespace's label goes: its client is no longer a peer; back.
    lab.label_namespace("y", &changes("team-")).unwrap();
    wait_endpoints(&admin, "namespace y unlabelled", |items| {
        cidrs(items, "ingress") == ["192.0.2.0/24"]
    });
    lab.label_namespace("y", &changes("team=blue")).unwrap();
    wait_endpoints(&admin, "namespace y labelled again", |items| {
        cidrs(items, "ingress").contains(&c_ip)
    });
    // A pod's labels change: it stops being a peer; another is selected.
    lab.label_pod("y/c", &changes("app=other")).unwrap();
    lab.label_pod("x/b", &changes("app=web")).unwrap();
    let items = wait_endpoints(&admin, "pods relabelled", |items| {
        cidrs(items, "ingress") == ["192.0.2.0/24"] && selected(items) == ["a", "b"]
    });
    assert_eq!(
        items[0]["metadata"]["name"],
        name.as_str(),
        "updated in place"
    );
    assert_eq!(lab.pod_named("x/b").unwrap().labels["app"], "web");

    // Pods come and go on the running lab.
    let d = lab.add_pod(&"x/d:app=web".parse().unwrap()).unwrap();
    let items = wait_endpoints(&admin, "pod x/d added", |items| {
        selected(items) == ["a", "b", "d"]
    });
    assert!(cidrs(&items, "egress").contains(&d.addr.to_string()));
    lab.remove_pod("x/d").unwrap();
    wait_endpoints(&admin, "pod x/d removed", |items| {
        selected(items) == ["a", "b"]
    });
    assert!(lab.pod_named("x/d").is_err());

    // The policy goes: its PolicyEndpoints with it.
    cluster::kubectl(&files, &["delete", "netpol", "web", "-n", "x"], None).unwrap();
    wait_endpoints(&admin, "the policy deleted", <[Value]>::is_empty);
    lab.down().unwrap();
}

/// With network policy on, an ADD waits (a bounded while) for the cluster's
/// PolicyEndpoints to be listed. A cluster without their CRD answers the
/// list with 404: that is an empty list, said once, not a list to wait for.
#[test]
fn a_cluster_without_the_policy_endpoint_crd_delays_no_pod_and_isolates_none() {
    const ADD_WAIT: Duration = Duration::from_secs(20);
    let _lock = lab_lock();
    let add_wait = ADD_WAIT.as_secs().to_string();
    let mut lab = cri::up_with(&CriNode {
        kube_api: true,
        env: &[
            ("ENABLE_NETWORK_POLICY", "true"),
            (ENV_POLICY_ADD_WAIT, &add_wait),
        ],
        uninstalled_crds: &["policyendpoints"],
        ..CriNode::new(1, "m5.large")
    });
    let files = lab.kube_api().unwrap().files().clone();
    let err = cluster::kubectl(&files, &["get", "policyendpoints", "-A"], None)
        .expect_err("no PolicyEndpoint CRD in this cluster");
    assert!(
        err.to_string()
            .contains("the server doesn't have a resource type"),
        "{err}"
    );

    let started = Instant::now();
    let web = lab.add_pod(&"x/web:app=web".parse().unwrap()).unwrap();
    let took = started.elapsed();
    assert!(
        took < ADD_WAIT / 2,
        "the ADD took {took:?}: it waited for PolicyEndpoints the cluster does not serve"
    );
    let server = WhoamiServer::start(&web.netns, SocketAddrV4::new(web.addr, 8080)).unwrap();
    let client = lab.pod(0).clone();
    let seen = tcp_whoami(&client.netns, server.addr(), Duration::from_secs(3)).unwrap();
    assert_eq!(seen.map(|s| *s.ip()), Some(client.addr), "nothing isolated");

    let log = std::fs::read_to_string(lab.agent_log().unwrap()).unwrap();
    let said = log.matches(policy_endpoints::NOT_SERVED).count();
    assert_eq!(said, 1, "said once: {log}");
    println!("ADD of x/web in {took:?} (the ADD wait is {ADD_WAIT:?}); x/web reached from pod-0");
}

/// Whether `from` gets an answer from `to` within a probe's wait.
fn reaches(from: &str, to: SocketAddrV4) -> bool {
    tcp_whoami(from, to, PROBE_TIMEOUT).unwrap().is_some()
}

/// How long a probe waits for an answer the lab gives in microseconds.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

#[test]
fn with_the_api_server_away_the_policies_in_force_stay_through_an_agent_restart() {
    let _lock = lab_lock();
    let mut lab = cri::up_with(&CriNode {
        kube_api: true,
        env: &[("ENABLE_NETWORK_POLICY", "true")],
        ..CriNode::new(1, "m5.large")
    });
    let admin = lab.kube_api().unwrap().admin().clone();
    let files = lab.kube_api().unwrap().files().clone();
    let web = lab.add_pod(&"x/web:app=web".parse().unwrap()).unwrap();
    let open = lab.add_pod(&"x/open:app=open".parse().unwrap()).unwrap();
    let _servers = [
        WhoamiServer::start(&web.netns, SocketAddrV4::new(web.addr, 8080)).unwrap(),
        WhoamiServer::start(&open.netns, SocketAddrV4::new(open.addr, 8080)).unwrap(),
    ];
    let (to_web, to_open) = (
        SocketAddrV4::new(web.addr, 8080),
        SocketAddrV4::new(open.addr, 8080),
    );
    let client = lab.pod(0).netns.clone();
    assert!(reaches(&client, to_web), "before any policy");
    let deny = r"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-web, namespace: x}
spec:
  podSelector:
    matchLabels: {app: web}
  policyTypes: [Ingress]
";
    cluster::kubectl(&files, &["apply", "-f", "-"], Some(deny)).unwrap();
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    while reaches(&client, to_web) {
        assert!(Instant::now() < deadline, "the policy is never enforced");
    }

    // What policy decided for x/web, as operators see it: the CLI and the
    // metrics.
    let (_, samples) = scrape::scrape();
    let denied = scrape::sample(
        &samples,
        "vpcnet_policy_pod_verdicts_total",
        &[
            ("namespace", "x"),
            ("pod", "web"),
            ("direction", "ingress"),
            ("verdict", "denied"),
        ],
    );
    assert!(denied > 0, "x/web's denied packets are not counted");
    let table = agent_cli(&["policy", "x/web"]);
    let row = table
        .lines()
        .skip_while(|l| !l.starts_with("verdicts"))
        .find(|l| l.starts_with("x/web"))
        .unwrap_or_else(|| panic!("no verdicts for x/web: {table}"));
    let in_denied: u64 = row.split_whitespace().nth(3).unwrap().parse().unwrap();
    assert!(in_denied >= denied, "{table}");
    println!("{table}");

    // Away: every request dropped, the open watches ended.
    admin
        .set_faults(&[FaultRule {
            drop_connection: true,
            ..FaultRule::default()
        }])
        .unwrap();
    admin.end_watches().unwrap();
    let check = |when: &str| {
        assert!(!reaches(&client, to_web), "{when}: x/web reached");
        assert!(reaches(&client, to_open), "{when}: x/open not reached");
    };
    check("the API server away");
    lab.stop_agent().unwrap();
    lab.start_agent().unwrap();
    check("the agent restarted, the API server away");
    let log = std::fs::read_to_string(lab.agent_log().unwrap()).unwrap();
    assert!(log.contains(node::HELD), "the agent does not say so: {log}");

    // Back: the policy is read again and still in force.
    admin.set_faults(&[]).unwrap();
    check("the API server back");
    cluster::kubectl(
        &files,
        &["delete", "networkpolicy", "-n", "x", "deny-web"],
        None,
    )
    .unwrap();
    let deadline = Instant::now() + FOLLOW_TIMEOUT;
    while !reaches(&client, to_web) {
        assert!(Instant::now() < deadline, "the deletion is never followed");
    }
    println!(
        "x/web denied through the API server's absence and an agent restart without it; reached once the policy was deleted"
    );
}

/// A policy for x/web with one valid rule (TCP 8081 from anywhere) among
/// rules the agent cannot enforce as written.
const BAD_FIELDS: &str = r"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: bad-fields, namespace: x}
spec:
  podSelector:
    matchLabels: {app: web}
  policyTypes: [Ingress]
  ingress:
  - from: [{ipBlock: {cidr: 10.0.0.300/8}}]
  - from: [{ipBlock: {cidr: 0.0.0.0/0, except: [nonsense]}}]
  - ports: [{port: 8080, endPort: 8000}]
  - ports: [{protocol: ICMP, port: 8080}]
  - ports: [{port: serve-99-tcp}]
  - ports: [{port: 8081}]
";

/// The notes of the agent's policy Events.
fn problem_notes(admin: &KubeAdmin) -> Vec<String> {
    let path = format!(
        "/apis/events.k8s.io/v1/namespaces/{}/events",
        cluster::AGENT_NAMESPACE
    );
    admin.get(&path).unwrap()["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["reason"] == fields::PROBLEM_REASON)
        .map(|e| {
            assert_eq!(e["type"], "Warning", "{e}");
            assert_eq!(e["regarding"]["name"], cluster::AGENT_POD_NAME, "{e}");
            e["note"].as_str().unwrap().to_owned()
        })
        .collect()
}

#[test]
fn fields_that_cannot_be_enforced_are_events_and_the_rest_is_enforced_from_either_source() {
    let _lock = lab_lock();
    // Through PolicyEndpoints the controller resolves named ports (one
    // nothing serves never reaches the agent) and merges the entries of
    // one CIDR: the fields' places differ.
    let sources: [(&str, &[&str], &str, &[&str]); 2] = [
        (
            "policy-endpoints",
            &[],
            "PolicyEndpoint x/bad-fields-",
            &[".cidr=", ".except[0]=", ".endPort=", ".protocol="],
        ),
        (
            "network-policies",
            &["policyendpoints"],
            "NetworkPolicy x/bad-fields ",
            &[
                "spec.ingress[0].from[0].ipBlock.cidr=",
                "spec.ingress[1].from[0].ipBlock.except[0]=",
                "spec.ingress[2].ports[0].endPort=",
                "spec.ingress[3].ports[0].protocol=",
                "spec.ingress[4].ports[0].port=",
            ],
        ),
    ];
    for (source, uninstalled_crds, object, named) in sources {
        let mut lab = cri::up_with(&CriNode {
            kube_api: true,
            env: &[
                ("ENABLE_NETWORK_POLICY", "true"),
                ("VPCNET_NETWORK_POLICY_SOURCE", source),
            ],
            uninstalled_crds,
            ..CriNode::new(1, "m5.large")
        });
        let admin = lab.kube_api().unwrap().admin().clone();
        let files = lab.kube_api().unwrap().files().clone();
        let web = lab.add_pod(&"x/web:app=web".parse().unwrap()).unwrap();
        let _servers = [8080, 8081].map(|port| {
            WhoamiServer::start(&web.netns, SocketAddrV4::new(web.addr, port)).unwrap()
        });
        let client = lab.pod(0).netns.clone();
        cluster::kubectl(&files, &["apply", "-f", "-"], Some(BAD_FIELDS)).unwrap();
        let deadline = Instant::now() + FOLLOW_TIMEOUT;
        while reaches(&client, SocketAddrV4::new(web.addr, 8080)) {
            assert!(
                Instant::now() < deadline,
                "{source}: the policy is never enforced"
            );
        }
        assert!(
            reaches(&client, SocketAddrV4::new(web.addr, 8081)),
            "{source}: the valid rule is not enforced"
        );
        let notes = loop {
            let notes = problem_notes(&admin);
            if named
                .iter()
                .all(|field| notes.iter().any(|n| n.contains(field)))
            {
                break notes;
            }
            assert!(
                Instant::now() < deadline,
                "{source}: events {notes:#?}, wanted {named:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(
            notes.len(),
            named.len(),
            "{source}: each said once: {notes:#?}"
        );
        assert!(
            notes.iter().all(|n| n.starts_with(object)),
            "{source}: {notes:#?}"
        );
        println!(
            "{source}: 8080 denied, 8081 allowed; events:\n  {}",
            notes.join("\n  ")
        );
        lab.down().unwrap();
    }
}
