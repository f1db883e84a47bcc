//! What AWS's ClusterNetworkPolicy (`networking.k8s.aws/v1alpha1`) says,
//! read from the objects as applied, written from the CRD's documentation
//! and apart from the agent and the lab's controller: a policy's subject
//! (every pod of the namespaces selected, or the pods selected in them)
//! gets, per direction, the rule of the lowest priority whose peers and
//! ports match, Deny before Accept before Pass at one priority; Accept and
//! Deny decide, Pass (or no match) leaves it to the next tier.

use ipnet::Ipv4Net;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde_json::Value;

use super::{Cluster, Pod, selects};

/// A ClusterNetworkPolicy object as applied.
pub type ClusterPolicy = Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    Admin,
    Baseline,
}

/// Which side of a connection a rule judges: what reaches the subject, or
/// what it sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Way {
    Ingress,
    Egress,
}

fn selector(value: &Value) -> LabelSelector {
    serde_json::from_value(value.clone()).expect("a label selector")
}

impl Cluster {
    /// Whether `pod` is one of the pods `peer` (a subject, or a rule's
    /// peer: `namespaces` or `pods`) names.
    fn names(&self, peer: &Value, pod: &Pod) -> bool {
        if let Some(namespaces) = peer.get("namespaces") {
            return selects(
                &selector(namespaces),
                &self.namespace_labels(&pod.namespace),
            );
        }
        if let Some(pods) = peer.get("pods") {
            return selects(
                &selector(&pods["namespaceSelector"]),
                &self.namespace_labels(&pod.namespace),
            ) && selects(&selector(&pods["podSelector"]), &pod.labels);
        }
        false
    }
}

/// A port's protocol, TCP when it names none.
fn protocol_of(v: &Value) -> &str {
    v.get("protocol").and_then(Value::as_str).unwrap_or("TCP")
}

/// Whether a rule's `ports` (none: all) take `protocol`'s `port` on
/// `server` (a named port is the server's).
fn ports_match(ports: Option<&Value>, server: &Pod, protocol: &str, port: u16) -> bool {
    let Some(ports) = ports.and_then(Value::as_array).filter(|p| !p.is_empty()) else {
        return true;
    };
    let number = |v: &Value, key: &str| v[key].as_u64().expect("a port");
    ports.iter().any(|p| {
        if let Some(one) = p.get("portNumber") {
            return protocol_of(one) == protocol && number(one, "port") == u64::from(port);
        }
        if let Some(range) = p.get("portRange") {
            return protocol_of(range) == protocol
                && (number(range, "start")..=number(range, "end")).contains(&u64::from(port));
        }
        let name = p["namedPort"].as_str().expect("one of the three");
        server
            .ports
            .iter()
            .any(|(n, proto, number)| n == name && proto == protocol && *number == port)
    })
}

/// What tier `tier`'s policies say of `subject`'s side of a connection
/// with `peer` to `server`'s `port`: `Some(allowed)` for an Accept or a
/// Deny, `None` to go on.
#[allow(clippy::too_many_arguments)]
#[must_use]
pub fn verdict(
    cluster: &Cluster,
    policies: &[ClusterPolicy],
    tier: Tier,
    way: Way,
    subject: &Pod,
    peer: &Pod,
    server: &Pod,
    protocol: &str,
    port: u16,
) -> Option<bool> {
    let tier_name = match tier {
        Tier::Admin => "Admin",
        Tier::Baseline => "Baseline",
    };
    let (rules_key, peers_key) = match way {
        Way::Ingress => ("ingress", "from"),
        Way::Egress => ("egress", "to"),
    };
    // (priority, action rank, allowed?): the lowest wins.
    let mut best: Option<(u64, u8, Option<bool>)> = None;
    for policy in policies {
        let spec = &policy["spec"];
        if spec["tier"] != tier_name || !cluster.names(&spec["subject"], subject) {
            continue;
        }
        let priority = spec["priority"].as_u64().expect("a priority");
        for rule in spec[rules_key].as_array().into_iter().flatten() {
            let peers_match = rule[peers_key].as_array().into_iter().flatten().any(|p| {
                cluster.names(p, peer)
                    || p["networks"].as_array().into_iter().flatten().any(|n| {
                        n.as_str()
                            .and_then(|n| n.parse::<Ipv4Net>().ok())
                            .is_some_and(|n| n.contains(&peer.ip))
                    })
            });
            if !peers_match || !ports_match(rule.get("ports"), server, protocol, port) {
                continue;
            }
            let (rank, allowed) = match rule["action"].as_str() {
                Some("Deny") => (0, Some(false)),
                Some("Accept") => (1, Some(true)),
                Some("Pass") => (2, None),
                other => panic!("no such action {other:?}"),
            };
            if best.is_none_or(|(p, r, _)| (priority, rank) < (p, r)) {
                best = Some((priority, rank, allowed));
            }
        }
    }
    best.and_then(|(.., allowed)| allowed)
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, net::Ipv4Addr};

    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use serde_json::json;

    use super::{
        super::{Labels, Mode},
        *,
    };

    fn pod(ns: &str, name: &str, last: u8) -> Pod {
        Pod {
            namespace: ns.into(),
            name: name.into(),
            labels: Labels::from([("pod".into(), name.into())]),
            ip: Ipv4Addr::new(10, 20, 11, last),
            ports: vec![("serve-80-tcp".into(), "TCP".into(), 80)],
        }
    }

    #[test]
    fn tiers_priorities_and_actions_read_case_by_case() {
        let cluster = Cluster {
            namespaces: BTreeMap::from([
                ("x".into(), Labels::from([("ns".into(), "x".into())])),
                ("y".into(), Labels::from([("ns".into(), "y".into())])),
            ]),
            pods: vec![],
        };
        let (xa, xb, ya) = (pod("x", "a", 1), pod("x", "b", 2), pod("y", "a", 3));
        let std = Mode::Standard;
        let admin = json!({"metadata": {"name": "admin"}, "spec": {
        "tier": "Admin", "priority": 10, "subject": {"namespaces": {"matchLabels": {"ns": "x"}}},
        "ingress": [
            {"action": "Deny", "from": [{"namespaces": {"matchLabels": {"ns": "y"}}}]},
            {"action": "Pass", "from": [{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"pod": "a"}}}}],
             "ports": [{"portNumber": {"port": 80}}]}
        ]}});
        let baseline = json!({"metadata": {"name": "baseline"}, "spec": {
            "tier": "Baseline", "priority": 0, "subject": {"namespaces": {}},
            "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]}});
        let policies = [admin.clone(), baseline.clone()];
        let allows = |nps: &[NetworkPolicy], from: &Pod, to: &Pod, proto: &str, port: u16| {
            cluster.allows_with(&policies, nps, std, from, to, proto, port)
        };
        assert!(
            !allows(&[], &ya, &xa, "TCP", 80),
            "Admin's Deny, priority 10"
        );
        assert!(
            !allows(&[], &xb, &xa, "TCP", 80),
            "Pass, then Baseline's Deny"
        );
        assert!(!allows(&[], &xa, &ya, "TCP", 80), "Baseline covers y too");
        let allow_all: NetworkPolicy = serde_json::from_value(json!({
            "metadata": {"name": "all", "namespace": "x"},
            "spec": {"podSelector": {}, "ingress": [{}]}}))
        .unwrap();
        let nps = std::slice::from_ref(&allow_all);
        assert!(
            allows(nps, &xb, &xa, "TCP", 80),
            "Pass, then the NetworkPolicy's allow"
        );
        assert!(
            !allows(nps, &ya, &xa, "TCP", 80),
            "Admin before the NetworkPolicy"
        );
        assert!(
            allows(nps, &xa, &xb, "UDP", 53),
            "no Pass: the NetworkPolicy, Baseline never read"
        );
        let accept_first = json!({"metadata": {"name": "first"}, "spec": {
            "tier": "Admin", "priority": 5, "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"pod": "a"}}}},
            "ingress": [{"action": "Accept", "from": [{"networks": ["10.20.11.3/32"]}],
                         "ports": [{"namedPort": "serve-80-tcp"}]}]}});
        let policies = [admin, baseline, accept_first];
        assert!(
            cluster.allows_with(&policies, &[], std, &ya, &xa, "TCP", 80),
            "priority 5 before 10"
        );
        assert!(!cluster.allows_with(&policies, &[], std, &ya, &xa, "TCP", 81));
        assert!(
            cluster.allows_with(&policies[..1], &[], Mode::Strict, &xa, &ya, "TCP", 81)
                == cluster.allows(&[], Mode::Strict, &xa, &ya, "TCP", 81),
            "what no cluster rule names is as without them"
        );
    }
}
