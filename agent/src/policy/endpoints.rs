//! EKS's PolicyEndpoints (its controller's resolution of each
//! NetworkPolicy) as the rules of this node's pods, the way aws-node's node
//! agent reads them: every PolicyEndpoint that selects a pod adds its
//! entries; a direction is isolated when one of them names it in
//! `podIsolation` or has entries for it.
//!
//! Bad input never widens what is allowed: an entry whose prefix or an
//! exception cannot be read is left out whole, as is one whose ports are
//! all unreadable (no ports would mean every port); each is reported.

use std::{collections::BTreeMap, net::Ipv4Addr};

use vpcnet_api::policy_endpoint::{
    API_VERSION, EndpointInfo, ISOLATION_EGRESS, ISOLATION_INGRESS, KIND, PolicyEndpointSpec,
};

use super::{
    fields::{self, Kind, Problem, Report},
    rules::{Direction, Origin, PodRules, Rule},
};

/// A local pod as PolicyEndpoints select it.
#[derive(Clone, Copy, Debug)]
pub struct LocalPod<'a> {
    pub addr: Ipv4Addr,
    pub namespace: &'a str,
    /// Its labels, when the agent follows the API's pods: a pod is then
    /// selected from its first packet, before the controller lists it.
    pub labels: Option<&'a BTreeMap<String, String>>,
}

/// A PolicyEndpoint by its namespace and name.
#[derive(Clone, Copy, Debug)]
pub struct Named<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub spec: &'a PolicyEndpointSpec,
}

/// Whether the PolicyEndpoint selects `pod`: it lists the pod's address,
/// or (the pod's labels known) its policy's namespace and selector take it.
#[must_use]
pub fn selects(pe: &Named<'_>, pod: &LocalPod<'_>) -> bool {
    let listed = pe
        .spec
        .pod_selector_endpoints
        .iter()
        .any(|e| e.pod_ip.parse::<Ipv4Addr>() == Ok(pod.addr));
    let by_labels = || {
        let namespace = if pe.spec.policy_ref.namespace.is_empty() {
            pe.namespace
        } else {
            &pe.spec.policy_ref.namespace
        };
        match (pod.labels, &pe.spec.pod_selector) {
            (Some(labels), Some(selector)) if namespace == pod.namespace => {
                selector.matches(labels) == Some(true)
            }
            _ => false,
        }
    };
    listed || by_labels()
}

/// The rules of `pod` from every PolicyEndpoint in `all` that selects it;
/// `None` when none does.
pub fn pod_rules<'a>(
    all: impl IntoIterator<Item = Named<'a>>,
    pod: &LocalPod<'_>,
    problems: &mut Vec<Problem>,
) -> Option<PodRules> {
    let mut rules: Option<PodRules> = None;
    for pe in all {
        if !selects(&pe, pod) {
            continue;
        }
        let one = rules_of(&pe, problems);
        let merged = rules.get_or_insert_with(PodRules::default);
        merged.ingress.merge(one.ingress);
        merged.egress.merge(one.egress);
    }
    rules
}

/// What one PolicyEndpoint says of the pods it selects.
#[must_use]
pub fn rules_of(pe: &Named<'_>, problems: &mut Vec<Problem>) -> PodRules {
    let origin = Origin {
        namespace: pe.spec.policy_ref.namespace.clone(),
        name: pe.spec.policy_ref.name.clone(),
    };
    let mut report = Report {
        kind: Kind {
            name: KIND,
            api_version: API_VERSION,
        },
        object: format!("{}/{}", pe.namespace, pe.name),
        problems,
    };
    let mut direction = |isolation: &str, entries: &[EndpointInfo], field: &str| {
        if entries.is_empty() && !pe.spec.pod_isolation.iter().any(|i| i == isolation) {
            return Direction::Open;
        }
        let mut rules = Vec::new();
        for (i, entry) in entries.iter().enumerate() {
            let at = format!("spec.{field}[{i}]");
            rules.extend(rule(entry, &origin, &at, &mut report));
        }
        Direction::Isolated(rules)
    };
    PodRules {
        ingress: direction(ISOLATION_INGRESS, &pe.spec.ingress, "ingress"),
        egress: direction(ISOLATION_EGRESS, &pe.spec.egress, "egress"),
        ..PodRules::default()
    }
}

fn rule(
    entry: &EndpointInfo,
    origin: &Origin,
    field: &str,
    report: &mut Report<'_>,
) -> Option<Rule> {
    if entry.cidr.is_empty() {
        // A cluster policy's domain name, or nothing: no NetworkPolicy peer.
        return None;
    }
    let peers = fields::peers(&entry.cidr, &entry.except, field, report)?;
    let ports = fields::entry_ports(&entry.ports, field, report)?;
    Some(Rule {
        peers: vec![peers],
        ports,
        origin: origin.clone(),
    })
}

#[cfg(test)]
mod tests {
    use ipnet::Ipv4Net;

    use super::*;
    use crate::policy::rules::{Ports, Protocol};

    fn spec(json: serde_json::Value) -> PolicyEndpointSpec {
        serde_json::from_value(json).unwrap()
    }

    fn named<'a>(spec: &'a PolicyEndpointSpec, name: &'a str) -> Named<'a> {
        Named {
            namespace: "x",
            name,
            spec,
        }
    }

    fn pod(addr: [u8; 4]) -> LocalPod<'static> {
        LocalPod {
            addr: Ipv4Addr::from(addr),
            namespace: "x",
            labels: None,
        }
    }

    #[test]
    fn selected_by_address_or_by_labels_in_the_policys_namespace() {
        let pe = spec(serde_json::json!({
            "policyRef": {"name": "p", "namespace": "x"},
            "podSelector": {"matchLabels": {"app": "web"}},
            "podSelectorEndpoints": [
                {"hostIP": "10.20.11.162", "podIP": "10.20.11.20", "name": "a", "namespace": "x"}
            ]
        }));
        let named = named(&pe, "p-abcde");
        assert!(selects(&named, &pod([10, 20, 11, 20])));
        assert!(!selects(&named, &pod([10, 20, 11, 21])));
        let web = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
        let new_pod = LocalPod {
            labels: Some(&web),
            ..pod([10, 20, 11, 21])
        };
        assert!(selects(&named, &new_pod), "before the controller lists it");
        let elsewhere = LocalPod {
            namespace: "y",
            ..new_pod
        };
        assert!(!selects(&named, &elsewhere));
    }

    #[test]
    fn isolation_follows_pod_isolation_and_entries() {
        let mut problems = Vec::new();
        let pe = spec(serde_json::json!({
            "policyRef": {"name": "p", "namespace": "x"},
            "podIsolation": ["Ingress"],
        }));
        let rules = rules_of(&named(&pe, "p-1"), &mut problems);
        assert_eq!(rules.ingress, Direction::Isolated(vec![]));
        assert_eq!(rules.egress, Direction::Open);
        let pe = spec(serde_json::json!({
            "policyRef": {"name": "p", "namespace": "x"},
            "egress": [{"cidr": "10.0.0.0/8", "ports": [{"port": 53, "protocol": "UDP"}]}, {"cidr": "::/0"}],
        }));
        let rules = rules_of(&named(&pe, "p-2"), &mut problems);
        let Direction::Isolated(egress) = rules.egress else {
            panic!("egress isolated by its entries");
        };
        assert_eq!(egress.len(), 1, "IPv6 says nothing on an IPv4 node");
        assert_eq!(egress[0].ports, vec![Ports::one(Protocol::Udp, 53)]);
        assert_eq!(egress[0].origin.to_string(), "x/p");
        assert!(problems.is_empty());
    }

    #[test]
    fn bad_fields_are_reported_and_never_widen_the_allow() {
        let pe = spec(serde_json::json!({
            "policyRef": {"name": "p", "namespace": "x"},
            "ingress": [
                {"cidr": "10.0.0.300/8"},
                {"cidr": "0.0.0.0/0", "except": ["nonsense"]},
                {"cidr": "10.1.0.0/16", "ports": [{"port": 70000}]},
                {"cidr": "10.2.0.0/16", "ports": [{"port": 90, "endPort": 80}, {"port": 443}]},
                {"cidr": "10.3.0.0/16", "ports": [{"protocol": "ICMP", "port": 1}]},
                {"cidr": "10.4.0.1"}
            ]
        }));
        let mut problems = Vec::new();
        let rules = rules_of(&named(&pe, "p-1"), &mut problems);
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.ingress[0].cidr",
                "spec.ingress[1].except[0]",
                "spec.ingress[2].ports[0].port",
                "spec.ingress[3].ports[0].endPort",
                "spec.ingress[4].ports[0].protocol",
            ]
        );
        assert!(
            problems[0]
                .to_string()
                .starts_with("PolicyEndpoint x/p-1 spec.ingress[0].cidr=")
        );
        let Direction::Isolated(ingress) = rules.ingress else {
            panic!("isolated");
        };
        // What remains: 10.2/16 on 443 only, and the host 10.4.0.1.
        assert_eq!(ingress.len(), 2, "{ingress:?}");
        assert_eq!(ingress[0].ports, vec![Ports::one(Protocol::Tcp, 443)]);
        assert_eq!(
            ingress[1].peers[0].cidr,
            "10.4.0.1/32".parse::<Ipv4Net>().unwrap()
        );
        let direction = Direction::Isolated(ingress);
        assert!(!direction.allows(Ipv4Addr::new(10, 1, 0, 1), 6, 80));
        assert!(!direction.allows(Ipv4Addr::new(192, 0, 2, 1), 6, 80));
    }
}
