//! What NetworkPolicy's specification says reaches what: a small evaluator
//! written from the API's documentation (`networking.k8s.io/v1`), apart
//! from the agent's resolver and the lab's controller, so that a test
//! compares the datapath with the specification and not with itself.
//! Kubernetes' own e2e suite (`test/e2e/network/netpol`) computes its
//! expected reachability the same way: per pair of pods, port and protocol.
//! AWS's ClusterNetworkPolicy tiers around it are [`cluster`]'s.

pub mod cluster;

use std::{collections::BTreeMap, net::Ipv4Addr};

use ipnet::Ipv4Net;
use k8s_openapi::{
    api::networking::v1::{
        NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
        NetworkPolicyPort,
    },
    apimachinery::pkg::{apis::meta::v1::LabelSelector, util::intstr::IntOrString},
};

pub type Labels = BTreeMap<String, String>;

/// A pod as policy sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pod {
    pub namespace: String,
    pub name: String,
    pub labels: Labels,
    pub ip: Ipv4Addr,
    /// Named container ports: name, protocol (`TCP`...), number.
    pub ports: Vec<(String, String, u16)>,
}

/// The cluster: namespaces with their labels, pods.
#[derive(Clone, Debug, Default)]
pub struct Cluster {
    pub namespaces: BTreeMap<String, Labels>,
    pub pods: Vec<Pod>,
}

/// `NETWORK_POLICY_ENFORCING_MODE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Standard,
    Strict,
}

/// Whether `selector` selects `labels` (an empty selector selects all).
#[must_use]
pub fn selects(selector: &LabelSelector, labels: &Labels) -> bool {
    let labels_ok = selector
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let expressions_ok = selector.match_expressions.iter().flatten().all(|req| {
        let value = labels.get(&req.key);
        let values = req.values.as_deref().unwrap_or_default();
        match req.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => panic!("no such operator {other}"),
        }
    });
    labels_ok && expressions_ok
}

/// A policy's types as the API defaults them: Ingress always, Egress when
/// it has egress rules.
fn types(policy: &NetworkPolicy) -> (bool, bool) {
    let spec = policy.spec.as_ref().expect("a spec");
    match &spec.policy_types {
        Some(types) => (
            types.iter().any(|t| t == "Ingress"),
            types.iter().any(|t| t == "Egress"),
        ),
        None => (true, spec.egress.is_some()),
    }
}

fn namespace_of(policy: &NetworkPolicy) -> &str {
    policy.metadata.namespace.as_deref().unwrap_or("default")
}

fn selects_pod(policy: &NetworkPolicy, pod: &Pod) -> bool {
    namespace_of(policy) == pod.namespace
        && policy
            .spec
            .as_ref()
            .expect("a spec")
            .pod_selector
            .as_ref()
            .is_none_or(|selector| selects(selector, &pod.labels))
}

impl Cluster {
    pub(crate) fn namespace_labels(&self, namespace: &str) -> Labels {
        let mut labels = self.namespaces.get(namespace).cloned().unwrap_or_default();
        labels.insert("kubernetes.io/metadata.name".into(), namespace.into());
        labels
    }

    /// Whether a peer entry of `policy` takes `peer`.
    fn peer_matches(&self, policy: &NetworkPolicy, entry: &NetworkPolicyPeer, peer: &Pod) -> bool {
        if let Some(block) = &entry.ip_block {
            let cidr: Ipv4Net = block.cidr.parse().expect("an IPv4 CIDR");
            let excepted = block.except.iter().flatten().any(|e| {
                e.parse::<Ipv4Net>()
                    .expect("an IPv4 CIDR")
                    .contains(&peer.ip)
            });
            return cidr.contains(&peer.ip) && !excepted;
        }
        let namespace_ok = match &entry.namespace_selector {
            Some(selector) => selects(selector, &self.namespace_labels(&peer.namespace)),
            None => peer.namespace == namespace_of(policy),
        };
        let pod_ok = entry
            .pod_selector
            .as_ref()
            .is_none_or(|selector| selects(selector, &peer.labels));
        namespace_ok && pod_ok
    }

    /// Whether `ports` (none: all) take `protocol`'s `port` on `server`.
    fn ports_match(
        ports: Option<&Vec<NetworkPolicyPort>>,
        server: &Pod,
        protocol: &str,
        port: u16,
    ) -> bool {
        let Some(ports) = ports.filter(|p| !p.is_empty()) else {
            return true;
        };
        ports.iter().any(|p| {
            let wanted = p.protocol.as_deref().unwrap_or("TCP");
            if wanted != protocol {
                return false;
            }
            match &p.port {
                None => true,
                Some(IntOrString::Int(first)) => {
                    let last = p.end_port.unwrap_or(*first);
                    i32::from(port) >= *first && i32::from(port) <= last
                }
                Some(IntOrString::String(name)) => server
                    .ports
                    .iter()
                    .any(|(n, proto, number)| n == name && proto == protocol && *number == port),
            }
        })
    }

    /// Whether `from` may connect to `to` on `protocol`'s `port`, as the
    /// specification (and, for pods no policy selects, `mode`) says.
    #[must_use]
    pub fn allows(
        &self,
        policies: &[NetworkPolicy],
        mode: Mode,
        from: &Pod,
        to: &Pod,
        protocol: &str,
        port: u16,
    ) -> bool {
        self.allows_with(&[], policies, mode, from, to, protocol, port)
    }

    /// [`Cluster::allows`] under AWS's cluster policies too: for each side
    /// (`from`'s egress, `to`'s ingress), the Admin tier, then
    /// NetworkPolicy (final for a pod any NetworkPolicy selects, as EKS's
    /// agent has it), then the Baseline tier, then `mode`'s default.
    #[allow(clippy::too_many_arguments)]
    #[must_use]
    pub fn allows_with(
        &self,
        cluster_policies: &[cluster::ClusterPolicy],
        policies: &[NetworkPolicy],
        mode: Mode,
        from: &Pod,
        to: &Pod,
        protocol: &str,
        port: u16,
    ) -> bool {
        let side = |way: cluster::Way, subject: &Pod| {
            let peer = if way == cluster::Way::Egress {
                to
            } else {
                from
            };
            let tier = |tier| {
                cluster::verdict(
                    self,
                    cluster_policies,
                    tier,
                    way,
                    subject,
                    peer,
                    to,
                    protocol,
                    port,
                )
            };
            if let Some(verdict) = tier(cluster::Tier::Admin) {
                return verdict;
            }
            if policies.iter().any(|p| selects_pod(p, subject)) {
                return match way {
                    cluster::Way::Egress => self.egress_allowed(policies, from, to, protocol, port),
                    cluster::Way::Ingress => {
                        self.ingress_allowed(policies, from, to, protocol, port)
                    }
                };
            }
            tier(cluster::Tier::Baseline).unwrap_or(mode == Mode::Standard)
        };
        side(cluster::Way::Egress, from) && side(cluster::Way::Ingress, to)
    }

    /// NetworkPolicy's say on `from`'s egress, for a pod a policy selects.
    fn egress_allowed(
        &self,
        policies: &[NetworkPolicy],
        from: &Pod,
        to: &Pod,
        protocol: &str,
        port: u16,
    ) -> bool {
        let egress_policies: Vec<&NetworkPolicy> = policies
            .iter()
            .filter(|p| types(p).1 && selects_pod(p, from))
            .collect();
        egress_policies.is_empty()
            || egress_policies.iter().any(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.egress.as_ref())
                    .into_iter()
                    .flatten()
                    .any(|rule: &NetworkPolicyEgressRule| {
                        let peers_ok =
                            rule.to
                                .as_ref()
                                .filter(|t| !t.is_empty())
                                .is_none_or(|to_peers| {
                                    to_peers.iter().any(|e| self.peer_matches(p, e, to))
                                });
                        peers_ok && Self::ports_match(rule.ports.as_ref(), to, protocol, port)
                    })
            })
    }

    /// NetworkPolicy's say on `to`'s ingress, for a pod a policy selects.
    fn ingress_allowed(
        &self,
        policies: &[NetworkPolicy],
        from: &Pod,
        to: &Pod,
        protocol: &str,
        port: u16,
    ) -> bool {
        let ingress_policies: Vec<&NetworkPolicy> = policies
            .iter()
            .filter(|p| types(p).0 && selects_pod(p, to))
            .collect();
        ingress_policies.is_empty()
            || ingress_policies.iter().any(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.ingress.as_ref())
                    .into_iter()
                    .flatten()
                    .any(|rule: &NetworkPolicyIngressRule| {
                        let peers_ok =
                            rule.from
                                .as_ref()
                                .filter(|f| !f.is_empty())
                                .is_none_or(|from_peers| {
                                    from_peers.iter().any(|e| self.peer_matches(p, e, from))
                                });
                        peers_ok && Self::ports_match(rule.ports.as_ref(), to, protocol, port)
                    })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, last: u8) -> Pod {
        Pod {
            namespace: ns.into(),
            name: name.into(),
            labels: Labels::from([("pod".into(), name.into())]),
            ip: Ipv4Addr::new(10, 20, 11, last),
            ports: vec![("serve-80-tcp".into(), "TCP".into(), 80)],
        }
    }

    fn policy(json: serde_json::Value) -> NetworkPolicy {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_specification_read_case_by_case() {
        let cluster = Cluster {
            namespaces: BTreeMap::from([
                ("x".into(), Labels::from([("ns".into(), "x".into())])),
                ("y".into(), Labels::from([("ns".into(), "y".into())])),
            ]),
            pods: vec![],
        };
        let (xa, xb, ya) = (pod("x", "a", 1), pod("x", "b", 2), pod("y", "a", 3));
        let std = Mode::Standard;
        assert!(cluster.allows(&[], std, &xa, &xb, "TCP", 80));
        assert!(!cluster.allows(&[], Mode::Strict, &xa, &xb, "TCP", 80));
        let deny_all = policy(serde_json::json!({
            "metadata": {"name": "deny", "namespace": "x"},
            "spec": {"podSelector": {}}
        }));
        assert!(!cluster.allows(std::slice::from_ref(&deny_all), std, &ya, &xa, "TCP", 80));
        assert!(
            cluster.allows(std::slice::from_ref(&deny_all), std, &xa, &ya, "TCP", 80),
            "egress not isolated"
        );
        assert!(
            !cluster.allows(&[deny_all], Mode::Strict, &xa, &ya, "TCP", 80),
            "y/a unselected in strict"
        );
        // From namespace y AND pod a, on the named port only.
        let and = policy(serde_json::json!({
            "metadata": {"name": "and", "namespace": "x"},
            "spec": {"podSelector": {"matchLabels": {"pod": "a"}},
                     "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}},
                                             "podSelector": {"matchLabels": {"pod": "a"}}}],
                                  "ports": [{"port": "serve-80-tcp"}]}]}
        }));
        assert!(cluster.allows(std::slice::from_ref(&and), std, &ya, &xa, "TCP", 80));
        assert!(!cluster.allows(std::slice::from_ref(&and), std, &ya, &xa, "TCP", 81));
        assert!(!cluster.allows(std::slice::from_ref(&and), std, &xb, &xa, "TCP", 80));
        assert!(!cluster.allows(&[and], std, &ya, &xa, "UDP", 80));
        // An ipBlock with except, egress.
        let egress = policy(serde_json::json!({
            "metadata": {"name": "out", "namespace": "x"},
            "spec": {"podSelector": {}, "policyTypes": ["Egress"],
                     "egress": [{"to": [{"ipBlock": {"cidr": "10.20.11.0/24", "except": ["10.20.11.2/32"]}}],
                                 "ports": [{"protocol": "UDP", "port": 80, "endPort": 81}]}]}
        }));
        assert!(cluster.allows(std::slice::from_ref(&egress), std, &xa, &ya, "UDP", 81));
        assert!(!cluster.allows(std::slice::from_ref(&egress), std, &xa, &xb, "UDP", 81));
        assert!(!cluster.allows(&[egress], std, &xa, &ya, "TCP", 80));
    }
}
