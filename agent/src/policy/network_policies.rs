//! NetworkPolicy (`networking.k8s.io/v1`) resolved by the agent itself,
//! for clusters where no controller writes PolicyEndpoints: each policy's
//! peers become the addresses of the pods its selectors take (in the
//! namespaces its namespace selector takes) and its `ipBlock`s, its named
//! ports the numbers the pods serve them on, and the rules of every policy
//! that selects a local pod add up, as the specification says.
//!
//! - A policy isolates the directions of its `policyTypes` (defaulted as
//!   the API server does: Ingress, and Egress when it has egress rules).
//! - A rule without peers takes every address; one without ports every
//!   port of every protocol.
//! - Named ports: on ingress, the number the selected pod serves the name
//!   on; on egress, the number each peer pod serves it on (an `ipBlock`
//!   takes the pods within it). A name nothing serves allows nothing.
//! - Pods that use the node's network, that have ended, or that have no
//!   address yet are nobody's peers.
//!
//! Bad input (the API server validates, but a policy may come from
//! elsewhere) is reported and never widens what is allowed: a selector that
//! cannot be read selects no peer, and a policy whose own selector cannot
//! be read takes every pod of its namespace.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use ipnet::Ipv4Net;
use k8s_openapi::{
    api::{
        core::v1::Pod,
        networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort},
    },
    apimachinery::pkg::{apis::meta::v1, util::intstr::IntOrString},
};
// A PolicyEndpoint's `podIsolation` holds the policy's `policyTypes`.
use vpcnet_api::policy_endpoint::{
    ISOLATION_EGRESS, ISOLATION_INGRESS, LabelSelector, LabelSelectorRequirement,
};

use super::{
    endpoints::LocalPod,
    fields::{self, Kind, Problem, Report},
    rules::{Direction, Origin, Peers, PodRules, Ports, Protocol, Rule},
};
use crate::k8s::pods::POD_IPS_ANNOTATION;

pub type Labels = BTreeMap<String, String>;

const KIND: Kind = Kind {
    name: "NetworkPolicy",
    api_version: "networking.k8s.io/v1",
};
/// The label the API server gives every namespace, its name.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// A port a container serves by name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NamedPort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// A pod as policy reads it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterPod {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    /// `None` while it has no address, and for pods on the node's network
    /// or that have ended: they are nobody's peers.
    pub addr: Option<Ipv4Addr>,
    pub ports: Vec<NamedPort>,
}

impl ClusterPod {
    #[must_use]
    pub fn of(pod: &Pod) -> Self {
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        let on_node_network = spec.and_then(|s| s.host_network).unwrap_or(false);
        let ended = status
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|phase| phase == "Succeeded" || phase == "Failed");
        let from_status = status
            .and_then(|s| s.pod_ips.as_ref())
            .into_iter()
            .flatten()
            .map(|ip| ip.ip.as_str())
            .chain(status.and_then(|s| s.pod_ip.as_deref()));
        // `ANNOTATE_POD_IP`'s annotation has it before kubelet reports it.
        let annotated = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(POD_IPS_ANNOTATION))
            .into_iter()
            .flat_map(|value| value.split(','));
        let addr = from_status
            .chain(annotated)
            .find_map(|ip| ip.trim().parse::<Ipv4Addr>().ok())
            .filter(|_| !on_node_network && !ended);
        let containers = spec.into_iter().flat_map(|s| {
            s.containers
                .iter()
                .chain(s.init_containers.iter().flatten())
        });
        let mut ports: Vec<NamedPort> = containers
            .flat_map(|c| c.ports.iter().flatten())
            .filter_map(|p| {
                Some(NamedPort {
                    name: p.name.clone()?,
                    protocol: Protocol::from_name(p.protocol.as_deref().unwrap_or("TCP"))?,
                    port: u16::try_from(p.container_port).ok()?,
                })
            })
            .collect();
        ports.sort();
        ports.dedup();
        Self {
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: pod.metadata.name.clone().unwrap_or_default(),
            labels: pod.metadata.labels.clone().unwrap_or_default(),
            addr,
            ports,
        }
    }

    fn serves(&self, name: &str, protocol: Protocol) -> Option<u16> {
        self.ports
            .iter()
            .find(|p| p.name == name && p.protocol == protocol)
            .map(|p| p.port)
    }
}

/// What policy reads of the cluster: namespaces' labels and pods.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    pub namespaces: BTreeMap<String, Labels>,
    pub pods: Vec<ClusterPod>,
}

impl Cluster {
    pub(super) fn namespace_labels(&self, namespace: &str) -> Labels {
        let mut labels = self.namespaces.get(namespace).cloned().unwrap_or_default();
        labels
            .entry(NAMESPACE_NAME_LABEL.to_owned())
            .or_insert_with(|| namespace.to_owned());
        labels
    }

    /// The pods that can be peers.
    pub(super) fn peers(&self) -> impl Iterator<Item = (&ClusterPod, Ipv4Addr)> {
        self.pods.iter().filter_map(|p| Some((p, p.addr?)))
    }
}

/// A named port of a rule, resolved later against the pods it applies to.
#[derive(Clone, Debug)]
struct PortName {
    name: String,
    protocol: Protocol,
    field: String,
}

/// A rule's ports as written: none (every port), or numbers and names.
#[derive(Clone, Debug, Default)]
struct RulePorts {
    every: bool,
    numbered: Vec<Ports>,
    named: Vec<PortName>,
}

/// An ingress rule, its named ports left to the selected pod.
#[derive(Clone, Debug)]
struct IngressRule {
    peers: Vec<Peers>,
    ports: RulePorts,
}

/// One policy, its peers resolved.
#[derive(Debug)]
struct ResolvedPolicy {
    namespace: String,
    origin: Origin,
    /// `None`: every pod of the namespace.
    selector: Option<LabelSelector>,
    /// `None`: the policy does not isolate the direction.
    ingress: Option<Vec<IngressRule>>,
    egress: Option<Vec<Rule>>,
}

/// The cluster's NetworkPolicy objects, their peers resolved against the
/// cluster as it is now.
#[derive(Debug, Default)]
pub struct Resolved {
    policies: Vec<ResolvedPolicy>,
}

impl Resolved {
    pub fn new<'a>(
        policies: impl IntoIterator<Item = &'a NetworkPolicy>,
        cluster: &Cluster,
        problems: &mut Vec<Problem>,
    ) -> Self {
        Self {
            policies: policies
                .into_iter()
                .map(|policy| resolve(policy, cluster, problems))
                .collect(),
        }
    }

    /// The rules of `pod` (serving `ports`) from every policy that selects
    /// it; `None` when none does.
    pub fn pod_rules(
        &self,
        pod: &LocalPod<'_>,
        ports: &[NamedPort],
        problems: &mut Vec<Problem>,
    ) -> Option<PodRules> {
        let labels = pod.labels?;
        let mut merged: Option<PodRules> = None;
        for policy in &self.policies {
            let selected = policy.namespace == pod.namespace
                && policy
                    .selector
                    .as_ref()
                    .is_none_or(|s| s.matches(labels) == Some(true));
            if !selected {
                continue;
            }
            let mut report = Report {
                kind: KIND,
                object: policy.origin.to_string(),
                problems,
            };
            let ingress = match &policy.ingress {
                None => Direction::Open,
                Some(rules) => Direction::Isolated(
                    rules
                        .iter()
                        .filter_map(|rule| ingress_rule(rule, ports, &policy.origin, &mut report))
                        .collect(),
                ),
            };
            let egress = match &policy.egress {
                None => Direction::Open,
                Some(rules) => Direction::Isolated(rules.clone()),
            };
            let rules = merged.get_or_insert_with(PodRules::default);
            rules.ingress.merge(ingress);
            rules.egress.merge(egress);
        }
        merged
    }
}

/// An ingress rule for one selected pod: its named ports resolved against
/// what the pod serves.
fn ingress_rule(
    rule: &IngressRule,
    pod_ports: &[NamedPort],
    origin: &Origin,
    report: &mut Report<'_>,
) -> Option<Rule> {
    let mut ports = rule.ports.numbered.clone();
    for name in &rule.ports.named {
        match pod_ports
            .iter()
            .find(|p| p.name == name.name && p.protocol == name.protocol)
        {
            Some(served) => ports.push(Ports::one(served.protocol, served.port)),
            None => report.add(
                format!("{}.port", name.field),
                &name.name,
                "a pod it selects on this node serves no port by this name: it allows nothing there",
            ),
        }
    }
    if !rule.ports.every && ports.is_empty() {
        return None;
    }
    Some(Rule {
        peers: rule.peers.clone(),
        ports,
        origin: origin.clone(),
    })
}

fn selector(selector: &v1::LabelSelector) -> LabelSelector {
    LabelSelector {
        match_labels: selector.match_labels.clone().unwrap_or_default(),
        match_expressions: selector
            .match_expressions
            .iter()
            .flatten()
            .map(|r| LabelSelectorRequirement {
                key: r.key.clone(),
                operator: r.operator.clone(),
                values: r.values.clone().unwrap_or_default(),
            })
            .collect(),
    }
}

/// Whether `selector` takes `labels`; an unreadable one takes nothing
/// (reported at `field`).
pub(super) fn takes(
    selector: &LabelSelector,
    labels: &Labels,
    field: &str,
    report: &mut Report<'_>,
) -> bool {
    if !selector.readable() {
        report.add(
            format!("{field}.matchExpressions"),
            &operators(selector),
            "an operator the API does not define: this selector selects nothing",
        );
        return false;
    }
    selector.matches(labels) == Some(true)
}

/// A selector's operators, for a report.
fn operators(selector: &LabelSelector) -> String {
    let all: Vec<&str> = selector
        .match_expressions
        .iter()
        .map(|r| r.operator.as_str())
        .collect();
    all.join(",")
}

fn resolve(
    policy: &NetworkPolicy,
    cluster: &Cluster,
    problems: &mut Vec<Problem>,
) -> ResolvedPolicy {
    let namespace = policy.metadata.namespace.clone().unwrap_or_default();
    let origin = Origin {
        namespace: namespace.clone(),
        name: policy.metadata.name.clone().unwrap_or_default(),
    };
    let mut report = Report {
        kind: KIND,
        object: origin.to_string(),
        problems,
    };
    let Some(spec) = &policy.spec else {
        return ResolvedPolicy {
            namespace,
            origin,
            selector: None,
            ingress: Some(Vec::new()),
            egress: None,
        };
    };
    let own = selector(&spec.pod_selector.clone().unwrap_or_default());
    let own = if own.readable() {
        Some(own)
    } else {
        report.add(
            "spec.podSelector.matchExpressions".to_owned(),
            &operators(&own),
            "an operator the API does not define: the policy takes every pod of its namespace",
        );
        None
    };
    let (ingress_typed, egress_typed) = match &spec.policy_types {
        Some(types) if !types.is_empty() => (
            types.iter().any(|t| t == ISOLATION_INGRESS),
            types.iter().any(|t| t == ISOLATION_EGRESS),
        ),
        _ => (true, spec.egress.as_ref().is_some_and(|e| !e.is_empty())),
    };
    let mut resolver = Resolver {
        cluster,
        namespace: &namespace,
        report: &mut report,
    };
    let ingress = ingress_typed.then(|| {
        spec.ingress
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, rule)| {
                let at = format!("spec.ingress[{i}]");
                let sets = resolver.peer_sets(rule.from.as_deref(), &format!("{at}.from"));
                let peers = nets(sets.as_deref());
                let ports = resolver.rule_ports(rule.ports.as_deref(), &format!("{at}.ports"));
                IngressRule { peers, ports }
            })
            .collect()
    });
    let egress = egress_typed.then(|| {
        spec.egress
            .iter()
            .flatten()
            .enumerate()
            .flat_map(|(i, rule)| {
                let at = format!("spec.egress[{i}]");
                resolver.egress_rules(rule.to.as_deref(), rule.ports.as_deref(), &at, &origin)
            })
            .collect()
    });
    ResolvedPolicy {
        namespace,
        origin,
        selector: own,
        ingress,
        egress,
    }
}

/// One policy's peers and ports against the cluster.
struct Resolver<'r, 'p> {
    cluster: &'r Cluster,
    namespace: &'r str,
    report: &'r mut Report<'p>,
}

/// What one peer entry takes.
enum PeerSet<'c> {
    Block(Peers),
    Pods(Vec<(&'c ClusterPod, Ipv4Addr)>),
    Nothing,
}

impl<'r> Resolver<'r, '_> {
    fn peer(&mut self, entry: &NetworkPolicyPeer, field: &str) -> PeerSet<'r> {
        if let Some(block) = &entry.ip_block {
            let except = block.except.clone().unwrap_or_default();
            return fields::peers(
                &block.cidr,
                &except,
                &format!("{field}.ipBlock"),
                self.report,
            )
            .map_or(PeerSet::Nothing, PeerSet::Block);
        }
        let namespaces = entry.namespace_selector.as_ref().map(selector);
        let pods = entry.pod_selector.as_ref().map(selector);
        let cluster = self.cluster;
        let (namespace_field, pod_field) = (
            format!("{field}.namespaceSelector"),
            format!("{field}.podSelector"),
        );
        let mut namespace_taken: BTreeMap<&str, bool> = BTreeMap::new();
        let mut taken = Vec::new();
        for (pod, addr) in cluster.peers() {
            let in_namespace = match &namespaces {
                None => pod.namespace == self.namespace,
                Some(selector) => *namespace_taken.entry(&pod.namespace).or_insert_with(|| {
                    takes(
                        selector,
                        &cluster.namespace_labels(&pod.namespace),
                        &namespace_field,
                        self.report,
                    )
                }),
            };
            let pod_taken = in_namespace
                && pods
                    .as_ref()
                    .is_none_or(|selector| takes(selector, &pod.labels, &pod_field, self.report));
            if pod_taken {
                taken.push((pod, addr));
            }
        }
        PeerSet::Pods(taken)
    }

    /// What each of a rule's peers takes; `None` when none is listed
    /// (every address).
    fn peer_sets(
        &mut self,
        entries: Option<&[NetworkPolicyPeer]>,
        field: &str,
    ) -> Option<Vec<PeerSet<'r>>> {
        let entries = entries.filter(|e| !e.is_empty())?;
        Some(
            entries
                .iter()
                .enumerate()
                .map(|(j, entry)| self.peer(entry, &format!("{field}[{j}]")))
                .collect(),
        )
    }

    /// The pods among the cluster's peers that `sets` take, each once.
    fn pods_of(&self, sets: Option<&[PeerSet<'r>]>) -> BTreeMap<Ipv4Addr, &'r ClusterPod> {
        let cluster = self.cluster;
        let Some(sets) = sets else {
            return cluster.peers().map(|(p, addr)| (addr, p)).collect();
        };
        let mut pods = BTreeMap::new();
        for set in sets {
            match set {
                PeerSet::Block(block) => pods.extend(
                    cluster
                        .peers()
                        .filter(|(_, addr)| block.contains(*addr))
                        .map(|(p, addr)| (addr, p)),
                ),
                PeerSet::Pods(taken) => pods.extend(taken.iter().map(|(p, addr)| (*addr, *p))),
                PeerSet::Nothing => {}
            }
        }
        pods
    }

    fn rule_ports(&mut self, ports: Option<&[NetworkPolicyPort]>, field: &str) -> RulePorts {
        let Some(ports) = ports.filter(|p| !p.is_empty()) else {
            return RulePorts {
                every: true,
                ..RulePorts::default()
            };
        };
        let mut out = RulePorts::default();
        for (j, port) in ports.iter().enumerate() {
            let at = format!("{field}[{j}]");
            let Some(protocol) = fields::protocol(port.protocol.as_deref(), &at, self.report)
            else {
                continue;
            };
            match &port.port {
                Some(IntOrString::String(_)) if port.end_port.is_some() => self.report.add(
                    format!("{at}.endPort"),
                    &port.end_port.unwrap_or_default().to_string(),
                    "endPort with a named port: this port is not enforced",
                ),
                Some(IntOrString::String(name)) => out.named.push(PortName {
                    name: name.clone(),
                    protocol,
                    field: at,
                }),
                Some(IntOrString::Int(number)) => out.numbered.extend(fields::ports(
                    protocol,
                    Some(*number),
                    port.end_port,
                    &at,
                    self.report,
                )),
                None => out.numbered.push(Ports::all(protocol)),
            }
        }
        out
    }

    /// An egress rule's rules: its numbered ports to all its peers, each
    /// named port to the peer pods that serve it, on their numbers.
    fn egress_rules(
        &mut self,
        to: Option<&[NetworkPolicyPeer]>,
        ports: Option<&[NetworkPolicyPort]>,
        field: &str,
        origin: &Origin,
    ) -> Vec<Rule> {
        let ports = self.rule_ports(ports, &format!("{field}.ports"));
        let sets = self.peer_sets(to, &format!("{field}.to"));
        let mut rules = Vec::new();
        if ports.every || !ports.numbered.is_empty() {
            let peers = nets(sets.as_deref());
            if !peers.is_empty() {
                rules.push(Rule {
                    peers,
                    ports: ports.numbered.clone(),
                    origin: origin.clone(),
                });
            }
        }
        if ports.named.is_empty() {
            return rules;
        }
        let pods = self.pods_of(sets.as_deref());
        for name in &ports.named {
            let mut by_number: BTreeMap<u16, Vec<Peers>> = BTreeMap::new();
            for (addr, pod) in &pods {
                if let Some(number) = pod.serves(&name.name, name.protocol) {
                    by_number.entry(number).or_default().push(host(*addr));
                }
            }
            if by_number.is_empty() {
                self.report.add(
                    format!("{}.port", name.field),
                    &name.name,
                    "no peer pod serves a port by this name: it allows nothing",
                );
            }
            rules.extend(by_number.into_iter().map(|(number, peers)| Rule {
                peers,
                ports: vec![Ports::one(name.protocol, number)],
                origin: origin.clone(),
            }));
        }
        rules
    }
}

/// The prefixes `sets` take (`None`: every address).
fn nets(sets: Option<&[PeerSet<'_>]>) -> Vec<Peers> {
    let Some(sets) = sets else {
        return vec![every_address()];
    };
    let mut nets = Vec::new();
    for set in sets {
        match set {
            PeerSet::Block(peers) => nets.push(peers.clone()),
            PeerSet::Pods(pods) => nets.extend(pods.iter().map(|(_, addr)| host(*addr))),
            PeerSet::Nothing => {}
        }
    }
    dedup(nets)
}

fn every_address() -> Peers {
    Peers {
        cidr: Ipv4Net::default(),
        except: Vec::new(),
    }
}

fn host(addr: Ipv4Addr) -> Peers {
    Peers {
        cidr: Ipv4Net::from(addr),
        except: Vec::new(),
    }
}

fn dedup(nets: Vec<Peers>) -> Vec<Peers> {
    let set: BTreeSet<Peers> = nets.into_iter().collect();
    set.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn policy(value: serde_json::Value) -> NetworkPolicy {
        serde_json::from_value(value).unwrap()
    }

    fn pod(ns: &str, name: &str, last: u8) -> ClusterPod {
        ClusterPod {
            namespace: ns.into(),
            name: name.into(),
            labels: Labels::from([("pod".into(), name.into())]),
            addr: Some(Ipv4Addr::new(10, 20, 11, last)),
            ports: vec![NamedPort {
                name: "web".into(),
                protocol: Protocol::Tcp,
                port: 8000 + u16::from(last),
            }],
        }
    }

    /// x/a .1, x/b .2, y/a .3, y/b .4, z/a .5; namespaces labelled ns=NAME.
    fn cluster() -> Cluster {
        Cluster {
            namespaces: ["x", "y", "z"]
                .into_iter()
                .map(|ns| (ns.to_owned(), Labels::from([("ns".into(), ns.into())])))
                .collect(),
            pods: vec![
                pod("x", "a", 1),
                pod("x", "b", 2),
                pod("y", "a", 3),
                pod("y", "b", 4),
                pod("z", "a", 5),
            ],
        }
    }

    /// The rules of the cluster's pod `ns/name` under `policies`.
    fn rules_of(
        policies: &[NetworkPolicy],
        ns: &str,
        name: &str,
        problems: &mut Vec<Problem>,
    ) -> Option<PodRules> {
        let cluster = cluster();
        let resolved = Resolved::new(policies, &cluster, problems);
        let pod = cluster
            .pods
            .iter()
            .find(|p| p.namespace == ns && p.name == name)
            .unwrap();
        let local = LocalPod {
            addr: pod.addr.unwrap(),
            namespace: ns,
            labels: Some(&pod.labels),
        };
        resolved.pod_rules(&local, &pod.ports, problems)
    }

    fn addr(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 20, 11, last)
    }

    #[test]
    fn selectors_their_and_and_or_and_the_namespace_name_label() {
        let policies = [policy(json!({
            "metadata": {"name": "p", "namespace": "x"},
            "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                     "ingress": [{"from": [
                        {"namespaceSelector": {"matchExpressions": [
                            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["y"]}]},
                         "podSelector": {"matchLabels": {"pod": "b"}}},
                        {"podSelector": {"matchLabels": {"pod": "b"}}}
                     ]}]}
        }))];
        let mut problems = Vec::new();
        let rules = rules_of(&policies, "x", "a", &mut problems).unwrap();
        assert_eq!(rules.egress, Direction::Open, "Ingress only by default");
        let from = |last| rules.ingress.allows(addr(last), 6, 80);
        assert!(from(4), "y/b: namespace AND pod");
        assert!(from(2), "x/b: the policy's own namespace");
        assert!(!from(3), "y/a");
        assert!(!from(5), "z/a");
        assert!(rules_of(&policies, "x", "b", &mut problems).is_none());
        assert!(rules_of(&policies, "y", "a", &mut problems).is_none());
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn policy_types_default_and_rules_add_up() {
        let policies = [
            policy(json!({
                "metadata": {"name": "out", "namespace": "x"},
                "spec": {"podSelector": {},
                         "egress": [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16", "except": ["10.20.11.4/32"]}}],
                                     "ports": [{"protocol": "UDP", "port": 53, "endPort": 54}]}]}
            })),
            policy(json!({
                "metadata": {"name": "out-z", "namespace": "x"},
                "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                         "egress": [{"to": [{"namespaceSelector": {"matchLabels": {"ns": "z"}}}]}]}
            })),
        ];
        let mut problems = Vec::new();
        let rules = rules_of(&policies, "x", "b", &mut problems).unwrap();
        assert_eq!(
            rules.ingress,
            Direction::Isolated(vec![]),
            "egress rules and no types: Ingress and Egress"
        );
        let to = |last, proto, port| rules.egress.allows(addr(last), proto, port);
        assert!(to(3, 17, 54));
        assert!(!to(3, 17, 55));
        assert!(!to(3, 6, 53));
        assert!(!to(4, 17, 53), "excepted");
        assert!(to(5, 6, 9999), "z/a on every port, from the other policy");
        assert!(!rules.egress.allows(Ipv4Addr::new(192, 0, 2, 1), 17, 53));
        assert!(problems.is_empty(), "{problems:?}");
    }

    #[test]
    fn named_ports_on_the_selected_pod_in_and_on_each_peer_out() {
        let policies = [policy(json!({
            "metadata": {"name": "named", "namespace": "x"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"ports": [{"port": "web"}, {"port": "dns", "protocol": "UDP"}]}],
                     "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "web"}]},
                                {"to": [{"ipBlock": {"cidr": "10.20.11.4/30"}}], "ports": [{"port": "web"}]}]}
        }))];
        let mut problems = Vec::new();
        let rules = rules_of(&policies, "x", "a", &mut problems).unwrap();
        // x/a serves `web` on 8001.
        assert!(rules.ingress.allows(addr(9), 6, 8001));
        assert!(!rules.ingress.allows(addr(9), 6, 8002));
        // y/b serves it on 8004, z/a on 8005.
        assert!(rules.egress.allows(addr(4), 6, 8004));
        assert!(rules.egress.allows(addr(5), 6, 8005));
        assert!(!rules.egress.allows(addr(4), 6, 8005));
        assert!(!rules.egress.allows(Ipv4Addr::new(192, 0, 2, 1), 6, 8004));
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, ["spec.ingress[0].ports[1].port"], "{problems:?}");
        assert!(
            problems[0]
                .to_string()
                .starts_with("NetworkPolicy x/named ")
        );
    }

    #[test]
    fn peers_are_pods_with_an_address_of_their_own_that_have_not_ended() {
        let mut on_node = pod("y", "node", 0);
        on_node.addr = None;
        let mut object: Pod = serde_json::from_value(json!({
            "metadata": {"name": "n", "namespace": "y",
                         "annotations": {POD_IPS_ANNOTATION: "10.20.11.7"}},
            "spec": {"containers": [{"name": "c", "ports": [
                {"name": "web", "containerPort": 80}, {"name": "dns", "containerPort": 53, "protocol": "UDP"}]}]},
        }))
        .unwrap();
        let annotated = ClusterPod::of(&object);
        assert_eq!(annotated.addr, Some(addr(7)));
        assert_eq!(annotated.serves("dns", Protocol::Udp), Some(53));
        assert_eq!(annotated.serves("dns", Protocol::Tcp), None);
        object.spec.as_mut().unwrap().host_network = Some(true);
        assert_eq!(ClusterPod::of(&object).addr, None);
        object.spec.as_mut().unwrap().host_network = None;
        object.status = Some(
            serde_json::from_value(json!({"phase": "Succeeded", "podIP": "10.20.11.8"})).unwrap(),
        );
        assert_eq!(ClusterPod::of(&object).addr, None);
    }

    #[test]
    fn bad_fields_are_reported_and_never_widen_the_allow() {
        let policies = [policy(json!({
            "metadata": {"name": "bad", "namespace": "x"},
            "spec": {"podSelector": {"matchLabels": {"pod": "a"},
                                     "matchExpressions": [{"key": "pod", "operator": "Near"}]},
                     "ingress": [
                        {"from": [{"ipBlock": {"cidr": "10.0.0.300/8"}}]},
                        {"from": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["nonsense"]}}]},
                        {"ports": [{"port": 70000}]},
                        {"ports": [{"port": 90, "endPort": 80}, {"port": 443}]},
                        {"ports": [{"protocol": "ICMP", "port": 1}]},
                        {"ports": [{"port": "web", "endPort": 90}]},
                        {"from": [{"podSelector": {"matchExpressions": [{"key": "pod", "operator": "Near"}]}}]}
                     ]}
        }))];
        let mut problems = Vec::new();
        // The policy's own selector unreadable: it takes every pod of x.
        let rules = rules_of(&policies, "x", "b", &mut problems).unwrap();
        problems.sort();
        problems.dedup();
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.ingress[0].from[0].ipBlock.cidr",
                "spec.ingress[1].from[0].ipBlock.except[0]",
                "spec.ingress[2].ports[0].port",
                "spec.ingress[3].ports[0].endPort",
                "spec.ingress[4].ports[0].protocol",
                "spec.ingress[5].ports[0].endPort",
                "spec.ingress[6].from[0].podSelector.matchExpressions",
                "spec.podSelector.matchExpressions",
            ],
            "{problems:?}"
        );
        // What remains: every peer on TCP 443 only.
        for last in 1..=5 {
            assert!(!rules.ingress.allows(addr(last), 6, 80));
            assert!(rules.ingress.allows(addr(last), 6, 443));
        }
        assert!(!rules.ingress.allows(Ipv4Addr::new(192, 0, 2, 1), 1, 0));
    }
}
