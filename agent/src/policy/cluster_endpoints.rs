//! EKS's ClusterPolicyEndpoints (its controller's resolution of each AWS
//! ClusterNetworkPolicy) as the cluster rules of this node's pods, the way
//! aws-node's node agent (v1.3 on) reads them: every ClusterPolicyEndpoint
//! that selects a pod adds its entries, each with its policy's tier and
//! priority and its own action.
//!
//! A pod is selected when the endpoint lists its address, or lists a pod
//! of the same workload (aws-node's agent's pod identifier: the name less
//! its last `-` part, and the namespace): a new replica is judged by its
//! workload's cluster policies from its first packet, before the
//! controller lists it.
//!
//! Bad input is left out and reported: an entry whose CIDR, action or
//! every port cannot be read, an endpoint whose tier or priority cannot be
//! (its place among the others is unknown). What remains is enforced as
//! the valid rules say.

use std::net::Ipv4Addr;

use vpcnet_api::{
    aws_network_policy::pod_identifier,
    cluster_policy::{
        ACTION_ACCEPT, ACTION_DENY, ACTION_PASS, API_VERSION, ClusterEndpointInfo,
        ClusterPolicyEndpointSpec, ENDPOINT_KIND, PRIORITIES, TIER_ADMIN, TIER_BASELINE,
    },
};

use super::{
    fields::{self, Kind, Problem, Report},
    rules::{Action, ClusterRule, Origin, Tier},
};

/// A local pod as ClusterPolicyEndpoints select it.
#[derive(Clone, Copy, Debug)]
pub struct LocalPod<'a> {
    pub addr: Ipv4Addr,
    pub namespace: &'a str,
    pub name: &'a str,
}

/// A ClusterPolicyEndpoint by its name.
#[derive(Clone, Copy, Debug)]
pub struct Named<'a> {
    pub name: &'a str,
    pub spec: &'a ClusterPolicyEndpointSpec,
}

/// Whether the endpoint selects `pod`: it lists the pod's address, or a
/// pod of its workload.
#[must_use]
pub fn selects(cpe: &Named<'_>, pod: &LocalPod<'_>) -> bool {
    let identifier = pod_identifier(pod.name, pod.namespace);
    cpe.spec.pod_selector_endpoints.iter().any(|e| {
        e.pod_ip.parse::<Ipv4Addr>() == Ok(pod.addr)
            || pod_identifier(&e.name, &e.namespace) == identifier
    })
}

/// The cluster rules, ingress and egress, of `pod` from every endpoint in
/// `all` that selects it.
pub fn pod_rules<'a>(
    all: impl IntoIterator<Item = Named<'a>>,
    pod: &LocalPod<'_>,
    problems: &mut Vec<Problem>,
) -> (Vec<ClusterRule>, Vec<ClusterRule>) {
    let (mut ingress, mut egress) = (Vec::new(), Vec::new());
    for cpe in all {
        if selects(&cpe, pod) {
            let (i, e) = rules_of(&cpe, problems);
            ingress.extend(i);
            egress.extend(e);
        }
    }
    (ingress, egress)
}

/// What one endpoint says of the pods it selects: its ingress rules and
/// its egress rules.
#[must_use]
pub fn rules_of(
    cpe: &Named<'_>,
    problems: &mut Vec<Problem>,
) -> (Vec<ClusterRule>, Vec<ClusterRule>) {
    let mut report = Report {
        kind: Kind {
            name: ENDPOINT_KIND,
            api_version: API_VERSION,
        },
        object: cpe.name.to_owned(),
        problems,
    };
    let tier = match cpe.spec.tier.as_str() {
        TIER_ADMIN => Tier::Admin,
        TIER_BASELINE => Tier::Baseline,
        other => {
            report.add(
                "spec.tier".into(),
                other,
                "not Admin or Baseline: this cluster policy is not enforced",
            );
            return (Vec::new(), Vec::new());
        }
    };
    let Some(priority) = Some(cpe.spec.priority)
        .filter(|p| PRIORITIES.contains(p))
        .and_then(|p| u16::try_from(p).ok())
    else {
        report.add(
            "spec.priority".into(),
            &cpe.spec.priority.to_string(),
            "not from 0 to 1000: this cluster policy is not enforced",
        );
        return (Vec::new(), Vec::new());
    };
    let origin = Origin {
        namespace: String::new(),
        name: cpe.spec.policy_ref.name.clone(),
    };
    let mut direction = |entries: &[ClusterEndpointInfo], field: &str| -> Vec<ClusterRule> {
        entries
            .iter()
            .enumerate()
            .filter_map(|(i, entry)| {
                let at = format!("spec.{field}[{i}]");
                let (action, peers, ports) = entry_parts(entry, &at, &mut report)?;
                Some(ClusterRule {
                    tier,
                    priority,
                    action,
                    peers,
                    ports,
                    origin: origin.clone(),
                })
            })
            .collect()
    };
    let ingress = direction(&cpe.spec.ingress, "ingress");
    let egress = direction(&cpe.spec.egress, "egress");
    (ingress, egress)
}

type EntryParts = (Action, Vec<ipnet::Ipv4Net>, Vec<super::rules::Ports>);

fn entry_parts(
    entry: &ClusterEndpointInfo,
    field: &str,
    report: &mut Report<'_>,
) -> Option<EntryParts> {
    if entry.cidr.is_empty() {
        // A domain name: aws-node's agent leaves those to another
        // component (EKS Auto Mode's), and so does vpcnet.
        return None;
    }
    let action = match entry.action.as_str() {
        ACTION_ACCEPT => Action::Accept,
        ACTION_DENY => Action::Deny,
        ACTION_PASS => Action::Pass,
        other => {
            report.add(
                format!("{field}.action"),
                other,
                "not Accept, Deny or Pass: this peer is not enforced",
            );
            return None;
        }
    };
    let peers = fields::peers(&entry.cidr, &[], field, report)?;
    let ports = fields::entry_ports(&entry.ports, field, report)?;
    Some((action, vec![peers.cidr], ports))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rules::{Ports, Protocol};

    fn spec(json: serde_json::Value) -> ClusterPolicyEndpointSpec {
        serde_json::from_value(json).unwrap()
    }

    fn pod(addr: [u8; 4], name: &str) -> LocalPod<'_> {
        LocalPod {
            addr: Ipv4Addr::from(addr),
            namespace: "x",
            name,
        }
    }

    #[test]
    fn selected_by_address_or_by_a_pod_of_its_workload() {
        let cpe = spec(serde_json::json!({
            "policyRef": {"name": "deny-db"}, "tier": "Admin", "priority": 10,
            "podSelectorEndpoints": [
                {"hostIP": "10.20.11.9", "podIP": "10.20.11.20", "name": "web-7d9f8-abcde", "namespace": "x"}
            ]
        }));
        let named = Named {
            name: "deny-db-x1",
            spec: &cpe,
        };
        assert!(selects(&named, &pod([10, 20, 11, 20], "other")));
        assert!(
            selects(&named, &pod([10, 20, 11, 21], "web-7d9f8-zzzzz")),
            "a new replica"
        );
        assert!(!selects(&named, &pod([10, 20, 11, 21], "db-0")));
    }

    #[test]
    fn entries_carry_the_tier_priority_and_their_action() {
        let cpe = spec(serde_json::json!({
            "policyRef": {"name": "p"}, "tier": "Baseline", "priority": 7,
            "egress": [
                {"cidr": "10.0.0.0/8", "ports": [{"protocol": "UDP", "port": 53}], "action": "Accept"},
                {"cidr": "0.0.0.0/0", "action": "Deny"},
                {"domainName": "example.com", "action": "Accept"}
            ]
        }));
        let mut problems = Vec::new();
        let (ingress, egress) = rules_of(
            &Named {
                name: "p-1",
                spec: &cpe,
            },
            &mut problems,
        );
        assert!(ingress.is_empty() && problems.is_empty(), "{problems:?}");
        assert_eq!(egress.len(), 2, "the domain name is not this agent's");
        assert_eq!(egress[0].tier, Tier::Baseline);
        assert_eq!(egress[0].priority, 7);
        assert_eq!(egress[0].action, Action::Accept);
        assert_eq!(egress[0].ports, vec![Ports::one(Protocol::Udp, 53)]);
        assert_eq!(egress[1].action, Action::Deny);
        assert_eq!(egress[1].origin.name, "p");
    }

    #[test]
    fn bad_fields_are_reported_and_left_out() {
        let mut problems = Vec::new();
        let bad_tier = spec(
            serde_json::json!({"policyRef": {"name": "p"}, "tier": "Top", "priority": 1,
            "ingress": [{"cidr": "10.0.0.0/8", "action": "Deny"}]}),
        );
        let (ingress, _) = rules_of(
            &Named {
                name: "p-1",
                spec: &bad_tier,
            },
            &mut problems,
        );
        assert!(ingress.is_empty());
        let bad_priority = spec(
            serde_json::json!({"policyRef": {"name": "p"}, "tier": "Admin", "priority": 1001}),
        );
        let _ = rules_of(
            &Named {
                name: "p-2",
                spec: &bad_priority,
            },
            &mut problems,
        );
        let entries = spec(
            serde_json::json!({"policyRef": {"name": "p"}, "tier": "Admin", "priority": 1,
            "ingress": [
                {"cidr": "10.0.0.0/8", "action": "Allow"},
                {"cidr": "10.0.0.300", "action": "Deny"},
                {"cidr": "10.1.0.0/16", "ports": [{"port": 0}], "action": "Deny"},
                {"cidr": "10.2.0.0/16", "ports": [{"port": 0}, {"port": 22}], "action": "Deny"}
            ]}),
        );
        let (ingress, _) = rules_of(
            &Named {
                name: "p-3",
                spec: &entries,
            },
            &mut problems,
        );
        let fields: Vec<String> = problems
            .iter()
            .map(|p| format!("{} {}", p.object, p.field))
            .collect();
        assert_eq!(
            fields,
            [
                "p-1 spec.tier",
                "p-2 spec.priority",
                "p-3 spec.ingress[0].action",
                "p-3 spec.ingress[1].cidr",
                "p-3 spec.ingress[2].ports[0].port",
                "p-3 spec.ingress[3].ports[0].port",
            ]
        );
        assert_eq!(ingress.len(), 1, "{ingress:?}");
        assert_eq!(ingress[0].ports, vec![Ports::one(Protocol::Tcp, 22)]);
    }
}
