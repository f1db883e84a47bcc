//! Network policy against its specification, in the lab as a cluster: the
//! cases of Kubernetes' own e2e suite (`test/e2e/network/netpol`: default
//! deny, namespace and pod selectors and their AND/OR forms, ports and
//! protocols, port ranges, CIDRs with exceptions, egress, updates of
//! policies and labels, deletion) over namespaces x, y, z and pods a, b, c,
//! each probed over TCP and UDP on ports 80 and 81 from every other pod;
//! x/b and z/c are on branch ENIs of their own (security groups for pods).
//! Policies are applied with `kubectl` and reach the agent by either of its
//! sources: the lab's network policy controller turns them into
//! PolicyEndpoints as EKS's does, or (a cluster without that CRD) the agent
//! resolves them itself; the agent enforces them.
//! Then AWS's ClusterNetworkPolicy around them (Admin and Baseline tiers,
//! priorities, Accept, Deny and Pass), resolved by the lab's controller
//! into ClusterPolicyEndpoints as EKS's is.
//! What should pass is computed by `vpcnet_bpf_tests::netpol`, an
//! evaluator of the specifications written apart from all of them.
//!
//! Run: `cargo xtask test --skip-lint --test network_policy_matrix`.

use std::{
    collections::BTreeMap,
    net::SocketAddrV4,
    time::{Duration, Instant},
};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde_json::json;
use vpcnet_bpf_tests::{
    cri::{self, CriNode},
    ipam::lab_lock,
    netpol::{Cluster, Labels, Mode, Pod, cluster::ClusterPolicy},
};
use vpcnet_lab::{
    Lab, NamedPod, Proto, WhoamiServer, WhoamiTarget, addrs,
    cluster::{self, POD_SERVED_PORTS as PORTS, served_port_name},
    parse_label_changes, probe,
};

const NAMESPACES: [&str; 3] = ["x", "y", "z"];
const PODS: [&str; 3] = ["a", "b", "c"];
const PROTOCOLS: [&str; 2] = ["TCP", "UDP"];
/// The pods on branch ENIs of their own (security groups for pods): their
/// traffic takes the branch ENI's VLAN (a veth where the kernel has no
/// 802.1Q), and their policies are judged there.
const BRANCH_ENI_PODS: [&str; 2] = ["x/b", "z/c"];

/// Where the agent reads the policies from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// The lab's controller's PolicyEndpoints, as on EKS.
    PolicyEndpoints,
    /// NetworkPolicy resolved by the agent, the PolicyEndpoint CRD not
    /// installed.
    NetworkPolicies,
}

/// A pod of the model: the lab's pods serve every port by name.
fn model_pod(namespace: &str, name: &str, ip: std::net::Ipv4Addr) -> Pod {
    Pod {
        namespace: namespace.into(),
        name: name.into(),
        labels: Labels::from([("pod".into(), name.into())]),
        ip,
        ports: PORTS
            .iter()
            .flat_map(|port| {
                PROTOCOLS
                    .map(|protocol| (served_port_name(*port, protocol), protocol.into(), *port))
            })
            .collect(),
    }
}
/// How long the probes wait for their answers: the lab's paths answer in
/// microseconds, and the dropped probes wait it out, all together.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a probe that should have been answered waits when asked
/// again.
const RETRY_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a change may take to be enforced: controller, PolicyEndpoint,
/// agent, maps.
const ENFORCE_TIMEOUT: Duration = Duration::from_secs(20);

/// One probe: from a pod to another's address, protocol and port.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Probe {
    from: String,
    to: String,
    protocol: &'static str,
    port: u16,
}

struct Matrix {
    lab: Lab,
    /// Each pod's servers, stopped when the matrix is dropped.
    cluster: Cluster,
    servers: Vec<WhoamiServer>,
    mode: Mode,
    source: Source,
    /// In force beside every case's policies.
    baseline: Vec<NetworkPolicy>,
}

impl Matrix {
    fn up(mode: Mode, source: Source) -> Self {
        let pods: Vec<NamedPod> = NAMESPACES
            .iter()
            .flat_map(|ns| PODS.iter().map(move |p| (format!("{ns}/{p}"), p)))
            .map(|(key, p)| NamedPod {
                branch_eni: BRANCH_ENI_PODS.contains(&key.as_str()),
                ..format!("{key}:pod={p}").parse().unwrap()
            })
            .collect();
        let mode_value = match mode {
            Mode::Standard => "standard",
            Mode::Strict => "strict",
        };
        let mut env = vec![
            ("ENABLE_NETWORK_POLICY", "true"),
            ("NETWORK_POLICY_ENFORCING_MODE", mode_value),
        ];
        let mut uninstalled_crds: &[&str] = &[];
        if source == Source::NetworkPolicies {
            env.push(("VPCNET_NETWORK_POLICY_SOURCE", "network-policies"));
            uninstalled_crds = &["policyendpoints"];
        }
        let lab = cri::up_with(&CriNode {
            kube_api: true,
            named_pods: &pods,
            env: &env,
            uninstalled_crds,
            ..CriNode::new(0, "m5.2xlarge")
        });
        let mut cluster = Cluster::default();
        for ns in NAMESPACES {
            let labels = parse_label_changes(&format!("ns={ns}")).unwrap();
            lab.label_namespace(ns, &labels).unwrap();
            cluster
                .namespaces
                .insert(ns.to_owned(), Labels::from([("ns".into(), ns.into())]));
        }
        check_branch_eni_pods(&lab);
        let mut servers = Vec::new();
        for ns in NAMESPACES {
            for name in PODS {
                let info = lab.pod_named(&format!("{ns}/{name}")).unwrap();
                for port in PORTS {
                    servers.push(
                        WhoamiServer::start(&info.netns, SocketAddrV4::new(info.addr, port))
                            .unwrap(),
                    );
                }
                cluster.pods.push(model_pod(ns, name, info.addr));
            }
        }
        // In strict mode, a pod no policy selects is allowed nothing: every
        // case would be all denied. Namespace y allows everything, so the
        // cases judge selected pods (x's, y's) beside unselected ones (z's).
        let baseline = match mode {
            Mode::Standard => Vec::new(),
            Mode::Strict => vec![policy(json!({
                "metadata": {"name": "allow-all", "namespace": "y"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
                         "ingress": [{}], "egress": [{}]}
            }))],
        };
        let matrix = Self {
            lab,
            cluster,
            servers,
            mode,
            source,
            baseline,
        };
        for policy in &matrix.baseline {
            matrix.apply(policy);
        }
        matrix
    }

    fn probes(&self) -> Vec<Probe> {
        let mut out = Vec::new();
        for from in &self.cluster.pods {
            for to in &self.cluster.pods {
                if from == to {
                    continue;
                }
                for protocol in PROTOCOLS {
                    for port in PORTS {
                        out.push(Probe {
                            from: format!("{}/{}", from.namespace, from.name),
                            to: format!("{}/{}", to.namespace, to.name),
                            protocol,
                            port,
                        });
                    }
                }
            }
        }
        out
    }

    fn pod(&self, key: &str) -> &Pod {
        self.cluster
            .pods
            .iter()
            .find(|p| format!("{}/{}", p.namespace, p.name) == key)
            .unwrap()
    }

    /// What the specification says of every probe under `policies` and the
    /// baseline.
    fn expected(&self, policies: &[NetworkPolicy]) -> BTreeMap<Probe, bool> {
        self.expected_with(&[], policies)
    }

    /// [`Matrix::expected`] under cluster policies too.
    fn expected_with(
        &self,
        cluster_policies: &[ClusterPolicy],
        policies: &[NetworkPolicy],
    ) -> BTreeMap<Probe, bool> {
        let policies = [&self.baseline[..], policies].concat();
        let policies = &policies[..];
        self.probes()
            .into_iter()
            .map(|probe| {
                let allowed = self.cluster.allows_with(
                    cluster_policies,
                    policies,
                    self.mode,
                    self.pod(&probe.from),
                    self.pod(&probe.to),
                    probe.protocol,
                    probe.port,
                );
                (probe, allowed)
            })
            .collect()
    }

    /// Every probe, run in parallel: whether it got its answer.
    fn observed(&self) -> BTreeMap<Probe, bool> {
        self.observe(&self.probes(), PROBE_TIMEOUT)
    }

    /// `probes`, all at once (each pod's from one thread), each waiting
    /// `timeout` for its answer.
    fn observe(&self, probes: &[Probe], timeout: Duration) -> BTreeMap<Probe, bool> {
        let mut by_source: BTreeMap<&str, Vec<&Probe>> = BTreeMap::new();
        for probe in probes {
            by_source.entry(&probe.from).or_default().push(probe);
        }
        let mut out = BTreeMap::new();
        std::thread::scope(|scope| {
            let handles: Vec<_> = by_source
                .iter()
                .map(|(from, probes)| {
                    let ns = self.lab.pod_named(from).unwrap().netns.clone();
                    let targets: Vec<WhoamiTarget> = probes
                        .iter()
                        .map(|probe| WhoamiTarget {
                            proto: if probe.protocol == "TCP" {
                                Proto::Tcp
                            } else {
                                Proto::Udp
                            },
                            server: SocketAddrV4::new(self.pod(&probe.to).ip, probe.port),
                        })
                        .collect();
                    scope.spawn(move || {
                        probe::whoami_each(&ns, &targets, timeout)
                            .unwrap_or_else(|e| panic!("probes from {ns}: {e}"))
                    })
                })
                .collect();
            for (probes, handle) in by_source.values().zip(handles) {
                for (probe, answer) in probes.iter().zip(handle.join().unwrap()) {
                    out.insert((*probe).clone(), answer.is_some());
                }
            }
        });
        out
    }

    /// Probes until what passes is what the specification says (the change
    /// takes a moment to be enforced), bounded; panics with the
    /// differences.
    fn assert_matches(&self, case: &str, policies: &[NetworkPolicy]) {
        self.assert_matches_with(case, &[], policies);
    }

    /// [`Matrix::assert_matches`] under cluster policies too.
    fn assert_matches_with(
        &self,
        case: &str,
        cluster_policies: &[ClusterPolicy],
        policies: &[NetworkPolicy],
    ) {
        let expected = self.expected_with(cluster_policies, policies);
        let deadline = Instant::now() + ENFORCE_TIMEOUT;
        loop {
            let mut observed = self.observed();
            // An allowed probe that got no answer is asked again, waiting
            // longer: a slow machine (a VM under TCG) is no denial.
            let unanswered: Vec<Probe> = expected
                .iter()
                .filter(|(probe, allowed)| **allowed && !observed[*probe])
                .map(|(probe, _)| probe.clone())
                .collect();
            observed.extend(self.observe(&unanswered, RETRY_TIMEOUT));
            let wrong: Vec<String> = expected
                .iter()
                .filter(|(probe, allowed)| observed[probe] != **allowed)
                .map(|(p, allowed)| {
                    format!(
                        "{} -> {} {}/{}: expected {}, got {}",
                        p.from,
                        p.to,
                        p.protocol,
                        p.port,
                        if *allowed { "allowed" } else { "denied" },
                        if *allowed { "denied" } else { "allowed" }
                    )
                })
                .collect();
            if wrong.is_empty() {
                let allowed = expected.values().filter(|a| **a).count();
                eprintln!(
                    "{case} ({:?}, {:?}): {allowed} of {} probes allowed, as specified",
                    self.mode,
                    self.source,
                    expected.len()
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{case} ({:?}, {:?}): {} of {} probes differ from the specification:\n{}",
                self.mode,
                self.source,
                wrong.len(),
                expected.len(),
                wrong.join("\n")
            );
        }
    }

    /// A pod made after the policies are in force, with its servers.
    fn add_pod(&mut self, key: &str) {
        let (ns, name) = key.split_once('/').unwrap();
        let named: NamedPod = format!("{key}:pod={name}").parse().unwrap();
        let info = self.lab.add_pod(&named).unwrap();
        for port in PORTS {
            self.servers.push(
                WhoamiServer::start(&info.netns, SocketAddrV4::new(info.addr, port)).unwrap(),
            );
        }
        self.cluster.pods.push(model_pod(ns, name, info.addr));
    }

    fn kubectl(&self, args: &[&str], stdin: Option<&str>) {
        let files = self.lab.kube_api().unwrap().files().clone();
        cluster::kubectl(&files, args, stdin).unwrap();
    }

    fn apply(&self, policy: &NetworkPolicy) {
        let text = serde_json::to_string(policy).unwrap();
        self.kubectl(&["apply", "-f", "-"], Some(&text));
    }

    fn delete(&self, policy: &NetworkPolicy) {
        let name = policy.metadata.name.as_deref().unwrap();
        let ns = policy.metadata.namespace.as_deref().unwrap();
        self.kubectl(&["delete", "networkpolicy", "-n", ns, name], None);
    }

    fn apply_cluster(&self, policy: &ClusterPolicy) {
        self.kubectl(&["apply", "-f", "-"], Some(&policy.to_string()));
    }

    fn delete_cluster(&self, policy: &ClusterPolicy) {
        let name = policy["metadata"]["name"].as_str().unwrap();
        self.kubectl(&["delete", "clusternetworkpolicy", name], None);
    }

    /// Each case of [`cluster_cases`] in force, judged, then deleted.
    fn run_cluster_cases(&self) {
        for (name, cluster_policies, policies) in cluster_cases(self) {
            for policy in &cluster_policies {
                self.apply_cluster(policy);
            }
            for policy in &policies {
                self.apply(policy);
            }
            self.assert_matches_with(name, &cluster_policies, &policies);
            for policy in &cluster_policies {
                self.delete_cluster(policy);
            }
            for policy in &policies {
                self.delete(policy);
            }
        }
        self.assert_matches("every cluster policy deleted", &[]);
    }
}

/// Each of [`BRANCH_ENI_PODS`] has the address of a branch ENI of the
/// node's trunk, in EC2; the node has the branch's link, and the pod a
/// strict branch pod's host veth (the lab's CRI node is in strict mode).
fn check_branch_eni_pods(lab: &Lab) {
    let ec2 = lab.emulator().unwrap().admin().state().unwrap();
    for key in BRANCH_ENI_PODS {
        let pod = lab.pod_named(key).unwrap();
        let vlan_id = ec2
            .trunk_associations
            .iter()
            .find(|a| {
                ec2.eni(&a.branch_id)
                    .is_some_and(|b| b.primary_ip == pod.addr)
            })
            .unwrap_or_else(|| panic!("{key} at {}: on no branch ENI", pod.addr))
            .vlan_id;
        let link = addrs::branch_link(vlan_id);
        assert!(
            vpcnet_lab::netlink::link_exists(addrs::NS_NODE, &link).unwrap(),
            "{key}: no {link} on the node"
        );
        assert!(
            pod.host_veth.starts_with(addrs::STRICT_BRANCH_VETH_PREFIX),
            "{key}: host veth {}",
            pod.host_veth
        );
        eprintln!(
            "{key}: on a branch ENI at {} (VLAN {vlan_id}, {link}, host veth {})",
            pod.addr, pod.host_veth
        );
    }
}

fn cluster_policy(value: serde_json::Value) -> ClusterPolicy {
    let mut value = value;
    value["apiVersion"] = json!("networking.k8s.aws/v1alpha1");
    value["kind"] = json!("ClusterNetworkPolicy");
    value
}

/// AWS ClusterNetworkPolicy over the same pods, each case a set of
/// cluster policies and NetworkPolicies in force together: tiers,
/// priorities, Pass, Deny before Accept at one priority, namespaces, pods
/// and networks as peers, ranges and named ports, both directions.
fn cluster_cases(matrix: &Matrix) -> Vec<(&'static str, Vec<ClusterPolicy>, Vec<NetworkPolicy>)> {
    let ip = |key: &str| matrix.pod(key).ip.to_string();
    vec![
        (
            "Admin: x denies what comes from namespace y",
            vec![cluster_policy(json!({
                "metadata": {"name": "x-not-from-y"},
                "spec": {"tier": "Admin", "priority": 10,
                         "subject": {"namespaces": {"matchLabels": {"ns": "x"}}},
                         "ingress": [{"action": "Deny", "from": [{"namespaces": {"matchLabels": {"ns": "y"}}}]}]}
            }))],
            vec![],
        ),
        (
            "Admin passes pods a's TCP 80 into x past a Deny, Baseline denies x's ingress, a NetworkPolicy lets z into x/c",
            vec![
                cluster_policy(json!({
                    "metadata": {"name": "x-admin"},
                    "spec": {"tier": "Admin", "priority": 20,
                             "subject": {"namespaces": {"matchLabels": {"ns": "x"}}},
                             "ingress": [{"action": "Pass",
                                          "from": [{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"pod": "a"}}}}],
                                          "ports": [{"portNumber": {"protocol": "TCP", "port": 80}}]}]}
                })),
                cluster_policy(json!({
                    "metadata": {"name": "x-admin-deny-80"},
                    "spec": {"tier": "Admin", "priority": 30,
                             "subject": {"namespaces": {"matchLabels": {"ns": "x"}}},
                             "ingress": [{"action": "Deny", "from": [{"namespaces": {}}],
                                          "ports": [{"portNumber": {"port": 80}}]}]}
                })),
                cluster_policy(json!({
                    "metadata": {"name": "x-baseline"},
                    "spec": {"tier": "Baseline", "priority": 0,
                             "subject": {"namespaces": {"matchLabels": {"ns": "x"}}},
                             "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}
                })),
            ],
            vec![policy(json!({
                "metadata": {"name": "c-from-z", "namespace": "x"},
                "spec": {"podSelector": {"matchLabels": {"pod": "c"}},
                         "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}]}]}
            }))],
        ),
        (
            "x/a: Accept and Deny at one priority (Deny wins), z/b's address accepted on UDP 80-81 at a lower number",
            vec![
                cluster_policy(json!({
                    "metadata": {"name": "xa-tie"},
                    "spec": {"tier": "Admin", "priority": 50,
                             "subject": {"pods": {"namespaceSelector": {"matchLabels": {"ns": "x"}},
                                                  "podSelector": {"matchLabels": {"pod": "a"}}}},
                             "ingress": [
                                {"action": "Accept", "from": [{"namespaces": {}}]},
                                {"action": "Deny", "from": [{"namespaces": {"matchLabels": {"ns": "z"}}}]}
                             ]}
                })),
                cluster_policy(json!({
                    "metadata": {"name": "xa-from-zb"},
                    "spec": {"tier": "Admin", "priority": 40,
                             "subject": {"pods": {"namespaceSelector": {"matchLabels": {"ns": "x"}},
                                                  "podSelector": {"matchLabels": {"pod": "a"}}}},
                             "ingress": [{"action": "Accept", "from": [{"networks": [format!("{}/32", ip("z/b"))]}],
                                          "ports": [{"portRange": {"protocol": "UDP", "start": 80, "end": 81}}]}]}
                })),
            ],
            vec![],
        ),
        (
            "egress: Baseline denies z to x on UDP 80-81, Admin accepts z/a to x/b's serve-80-udp, a NetworkPolicy selects z/b",
            vec![
                cluster_policy(json!({
                    "metadata": {"name": "z-baseline-out"},
                    "spec": {"tier": "Baseline", "priority": 100,
                             "subject": {"namespaces": {"matchLabels": {"ns": "z"}}},
                             "egress": [{"action": "Deny", "to": [{"namespaces": {"matchLabels": {"ns": "x"}}}],
                                         "ports": [{"portRange": {"protocol": "UDP", "start": 80, "end": 81}}]}]}
                })),
                cluster_policy(json!({
                    "metadata": {"name": "za-to-xb"},
                    "spec": {"tier": "Admin", "priority": 1,
                             "subject": {"pods": {"namespaceSelector": {"matchLabels": {"ns": "z"}},
                                                  "podSelector": {"matchLabels": {"pod": "a"}}}},
                             "egress": [{"action": "Accept",
                                         "to": [{"pods": {"namespaceSelector": {"matchLabels": {"ns": "x"}},
                                                          "podSelector": {"matchLabels": {"pod": "b"}}}}],
                                         "ports": [{"namedPort": "serve-80-udp"}]}]}
                })),
            ],
            vec![policy(json!({
                "metadata": {"name": "zb-selected", "namespace": "z"},
                "spec": {"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Ingress"],
                         "ingress": [{}]}
            }))],
        ),
    ]
}

fn policy(value: serde_json::Value) -> NetworkPolicy {
    let mut value = value;
    value["apiVersion"] = json!("networking.k8s.io/v1");
    value["kind"] = json!("NetworkPolicy");
    serde_json::from_value(value).unwrap()
}

/// The e2e suite's cases, each a set of policies in force together.
fn cases(matrix: &Matrix) -> Vec<(&'static str, Vec<NetworkPolicy>)> {
    let ip = |key: &str| matrix.pod(key).ip.to_string();
    vec![
        ("no policy", vec![]),
        (
            "default deny ingress in x",
            vec![policy(json!({
                "metadata": {"name": "deny-ingress", "namespace": "x"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
            }))],
        ),
        (
            "ingress from its own namespace only",
            vec![policy(json!({
                "metadata": {"name": "same-ns", "namespace": "x"},
                "spec": {"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}]}]}
            }))],
        ),
        (
            "x/a from namespace y (namespace selector)",
            vec![policy(json!({
                "metadata": {"name": "from-y", "namespace": "x"},
                "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                         "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}]}]}
            }))],
        ),
        (
            "x/a from pods b of namespaces y and z (AND), or from x/c (OR)",
            vec![policy(json!({
                "metadata": {"name": "and-or", "namespace": "x"},
                "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                         "ingress": [{"from": [
                            {"namespaceSelector": {"matchExpressions": [{"key": "ns", "operator": "In", "values": ["y", "z"]}]},
                             "podSelector": {"matchLabels": {"pod": "b"}}},
                            {"podSelector": {"matchLabels": {"pod": "c"}}}
                         ]}]}
            }))],
        ),
        (
            "x/a on TCP 80 only, and UDP 81 from namespace z",
            vec![policy(json!({
                "metadata": {"name": "ports", "namespace": "x"},
                "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                         "ingress": [
                            {"ports": [{"protocol": "TCP", "port": 80}]},
                            {"from": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}],
                             "ports": [{"protocol": "UDP", "port": 81}]}
                         ]}
            }))],
        ),
        (
            "x/b on its named ports serve-81-udp from anywhere and serve-80-tcp from y",
            vec![policy(json!({
                "metadata": {"name": "named-in", "namespace": "x"},
                "spec": {"podSelector": {"matchLabels": {"pod": "b"}},
                         "ingress": [
                            {"ports": [{"protocol": "UDP", "port": "serve-81-udp"}]},
                            {"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}],
                             "ports": [{"port": "serve-80-tcp"}]}
                         ]}
            }))],
        ),
        (
            "egress of y/c to the named port serve-80-udp of x, and TCP 81 anywhere",
            vec![policy(json!({
                "metadata": {"name": "named-out", "namespace": "y"},
                "spec": {"podSelector": {"matchLabels": {"pod": "c"}}, "policyTypes": ["Egress"],
                         "egress": [
                            {"to": [{"namespaceSelector": {"matchLabels": {"ns": "x"}}}],
                             "ports": [{"protocol": "UDP", "port": "serve-80-udp"}]},
                            {"ports": [{"port": 81}]}
                         ]}
            }))],
        ),
        (
            "egress of x to namespace z on ports 80-81 (endPort), UDP",
            vec![policy(json!({
                "metadata": {"name": "egress-z", "namespace": "x"},
                "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                         "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}],
                                     "ports": [{"protocol": "UDP", "port": 80, "endPort": 81}]}]}
            }))],
        ),
        (
            "x/a from a CIDR less one pod (ipBlock except), with egress of y/b denied",
            vec![
                policy(json!({
                    "metadata": {"name": "cidr", "namespace": "x"},
                    "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                             "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8",
                                                                "except": [format!("{}/32", ip("y/c"))]}}]}]}
                })),
                policy(json!({
                    "metadata": {"name": "deny-egress", "namespace": "y"},
                    "spec": {"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Egress"]}
                })),
            ],
        ),
    ]
}

fn run_matrix(mode: Mode, source: Source) {
    let _lock = lab_lock();
    let mut matrix = Matrix::up(mode, source);
    let cases = cases(&matrix);
    for (name, policies) in &cases {
        for policy in policies {
            matrix.apply(policy);
        }
        matrix.assert_matches(name, policies);
        for policy in policies {
            matrix.delete(policy);
        }
    }
    matrix.assert_matches("every policy deleted", &[]);
    matrix.run_cluster_cases();

    // Updates: a namespace's label and a pod's label change what a policy
    // selects, and the datapath follows.
    let (_, from_y) = cases
        .iter()
        .find(|(name, _)| name.starts_with("x/a from namespace y"))
        .unwrap()
        .clone();
    for policy in &from_y {
        matrix.apply(policy);
    }
    matrix.assert_matches("x/a from namespace y, again", &from_y);
    matrix
        .lab
        .label_namespace("y", &parse_label_changes("ns=elsewhere").unwrap())
        .unwrap();
    matrix.cluster.namespaces.insert(
        "y".into(),
        Labels::from([("ns".into(), "elsewhere".into())]),
    );
    matrix
        .lab
        .label_namespace("z", &parse_label_changes("ns=y").unwrap())
        .unwrap();
    matrix
        .cluster
        .namespaces
        .insert("z".into(), Labels::from([("ns".into(), "y".into())]));
    matrix.assert_matches("namespaces relabelled: z is now ns=y", &from_y);
    matrix
        .lab
        .label_pod("x/a", &parse_label_changes("pod=other").unwrap())
        .unwrap();
    let a = matrix
        .cluster
        .pods
        .iter_mut()
        .find(|p| p.namespace == "x" && p.name == "a")
        .unwrap();
    a.labels.insert("pod".into(), "other".into());
    matrix.assert_matches("x/a relabelled: no longer selected", &from_y);
    for policy in &from_y {
        matrix.delete(policy);
    }

    // A new pod is judged by its policies from its first packet: the first
    // probe of each pair, not a later one, is what the specification says.
    let deny = &cases
        .iter()
        .find(|(name, _)| name.starts_with("default deny ingress"))
        .unwrap()
        .1;
    for policy in deny {
        matrix.apply(policy);
    }
    matrix.assert_matches("default deny ingress in x, before a new pod", deny);
    matrix.add_pod("x/d");
    // Each probe's first packet, waited for as long as a slow machine
    // needs: a UDP probe is one datagram, and a SYN the policy should have
    // dropped is answered at once if it is not.
    let expected: BTreeMap<Probe, bool> = matrix
        .expected(deny)
        .into_iter()
        .filter(|(probe, _)| probe.from == "x/d" || probe.to == "x/d")
        .collect();
    let probes: Vec<Probe> = expected.keys().cloned().collect();
    let first = matrix.observe(&probes, RETRY_TIMEOUT);
    let wrong: Vec<&Probe> = expected
        .iter()
        .filter(|(probe, allowed)| first[*probe] != **allowed)
        .map(|(probe, _)| probe)
        .collect();
    assert!(
        wrong.is_empty(),
        "a new pod's first packets are not judged by its policies: {wrong:#?}"
    );
    eprintln!(
        "a new pod x/d ({:?}, {:?}): the first packet of each of its {} probes judged by its policies, as specified",
        matrix.mode,
        matrix.source,
        expected.len()
    );

    check_node_reaches(&matrix);
}

/// The node's own addresses reach every pod, whatever the policies
/// (kubelet's probes).
fn check_node_reaches(matrix: &Matrix) {
    let node = addrs::NS_NODE;
    for key in ["x/a", "x/d", "y/b", "x/b"] {
        let to = SocketAddrV4::new(matrix.pod(key).ip, 80);
        assert!(
            probe::tcp_whoami(node, to, ENFORCE_TIMEOUT)
                .unwrap()
                .is_some(),
            "the node cannot reach {key}"
        );
    }
    eprintln!(
        "the node reaches x/a and x/d, isolated with no rule for it, y/b, and x/b on its branch ENI, isolated ({:?}, {:?})",
        matrix.mode, matrix.source
    );
}

#[test]
fn standard_mode_enforces_the_specification_through_policy_endpoints() {
    run_matrix(Mode::Standard, Source::PolicyEndpoints);
}

#[test]
fn strict_mode_enforces_the_specification_through_policy_endpoints() {
    run_matrix(Mode::Strict, Source::PolicyEndpoints);
}

#[test]
fn standard_mode_enforces_the_specification_resolved_by_the_agent() {
    run_matrix(Mode::Standard, Source::NetworkPolicies);
}

#[test]
fn strict_mode_enforces_the_specification_resolved_by_the_agent() {
    run_matrix(Mode::Strict, Source::NetworkPolicies);
}
