//! AWS's `ClusterNetworkPolicy` and its resolution, `ClusterPolicyEndpoint`
//! (`networking.k8s.aws/v1alpha1`, both cluster-scoped), as EKS's network
//! policy controller defines them (github.com/aws/amazon-network-policy-controller-k8s,
//! `api/v1alpha1/clusternetworkpolicy_types.go`,
//! `clusterpolicyendpoint_types.go`) and aws-node's agent (v1.3 on)
//! enforces them. One definition for the agent that reads the endpoints
//! and the lab's controller that writes them; the JSON names are the
//! CRDs'.
//!
//! What they mean: a policy of tier `Admin` is judged before any
//! NetworkPolicy, one of tier `Baseline` after them, for the pods its
//! subject selects. Within a tier the lowest `priority` (0 to 1000) wins,
//! and at one priority `Deny` over `Accept` over `Pass`; `Accept` and
//! `Deny` are final, `Pass` (or no rule) leaves the packet to the next
//! tier.

use serde::{Deserialize, Serialize};

pub use crate::policy_endpoint::{API_VERSION, GROUP, LabelSelector, PodEndpoint, Port, VERSION};

pub const POLICY_KIND: &str = "ClusterNetworkPolicy";
pub const POLICY_PLURAL: &str = "clusternetworkpolicies";
pub const ENDPOINT_KIND: &str = "ClusterPolicyEndpoint";
pub const ENDPOINT_PLURAL: &str = "clusterpolicyendpoints";

/// `tier`'s values.
pub const TIER_ADMIN: &str = "Admin";
pub const TIER_BASELINE: &str = "Baseline";
/// The priorities a policy may have (lower wins).
pub const PRIORITIES: std::ops::RangeInclusive<i32> = 0..=1000;

/// `action`'s values.
pub const ACTION_ACCEPT: &str = "Accept";
pub const ACTION_DENY: &str = "Deny";
pub const ACTION_PASS: &str = "Pass";

/// `spec` of a ClusterNetworkPolicy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    pub tier: String,
    pub priority: i32,
    pub subject: Subject,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<IngressRule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<EgressRule>,
}

/// The pods a policy is for: every pod of the namespaces selected, or the
/// pods selected in the namespaces selected (exactly one of the two).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Subject {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPods>,
}

/// Pods by their namespace's labels and their own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPods {
    pub namespace_selector: LabelSelector,
    pub pod_selector: LabelSelector,
}

/// One ingress rule: `action` for what comes `from` its peers on its ports
/// (none: every port and protocol).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IngressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: String,
    pub from: Vec<Peer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<ClusterPort>>,
}

/// One egress rule: `action` for what goes `to` its peers on its ports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EgressRule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub action: String,
    pub to: Vec<Peer>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<ClusterPort>>,
}

/// A peer: exactly one of its fields (`networks` and `domainNames` in
/// egress only).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Peer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPods>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub domain_names: Vec<String>,
}

/// A port of a rule: one of a number, a range or a named port.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPort {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_number: Option<PortNumber>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_range: Option<PortRange>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub named_port: Option<String>,
}

/// A port of a protocol (TCP when none is given).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortNumber {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    pub port: i32,
}

/// An inclusive range of ports of a protocol (TCP when none is given).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortRange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    pub start: i32,
    pub end: i32,
}

/// `spec` of a ClusterPolicyEndpoint: one ClusterNetworkPolicy resolved,
/// its peers as addresses and CIDRs each with its rule's action.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterPolicyEndpointSpec {
    pub policy_ref: ClusterPolicyReference,
    pub tier: String,
    pub priority: i32,
    /// The policy's subject, copied (aws-node's agent does not read it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Subject>,
    /// The pods the subject selects, with the node each runs on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pod_selector_endpoints: Vec<PodEndpoint>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<ClusterEndpointInfo>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<ClusterEndpointInfo>,
}

/// The ClusterNetworkPolicy a ClusterPolicyEndpoint comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterPolicyReference {
    pub name: String,
}

/// A peer of one rule: an address or a CIDR (or, in egress, a domain
/// name), on ports (none: every port), with the rule's action.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterEndpointInfo {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cidr: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<Port>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain_name: String,
    pub action: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_reads_with_the_crds_names() {
        let spec: ClusterNetworkPolicySpec = serde_json::from_value(serde_json::json!({
            "tier": "Admin",
            "priority": 100,
            "subject": {"namespaces": {}},
            "egress": [
                {"name": "internal", "action": "Accept",
                 "to": [{"networks": ["10.0.0.0/8"]}, {"domainNames": ["example.com"]}],
                 "ports": [{"portNumber": {"protocol": "TCP", "port": 443}}]},
                {"action": "Pass",
                 "to": [{"pods": {"namespaceSelector": {"matchLabels": {"env": "prod"}},
                                  "podSelector": {}}}],
                 "ports": [{"portRange": {"start": 8000, "end": 9000}}, {"namedPort": "http"}]}
            ]
        }))
        .unwrap();
        assert_eq!(spec.subject.namespaces, Some(LabelSelector::default()));
        assert_eq!(spec.egress[0].to[1].domain_names, ["example.com"]);
        let ports = spec.egress[1].ports.as_ref().unwrap();
        assert_eq!(ports[0].port_range.as_ref().unwrap().end, 9000);
        assert_eq!(ports[1].named_port.as_deref(), Some("http"));
    }

    #[test]
    fn an_endpoint_reads_with_the_crds_names() {
        let spec: ClusterPolicyEndpointSpec = serde_json::from_value(serde_json::json!({
            "policyRef": {"name": "deny-external"},
            "tier": "Baseline",
            "priority": 5,
            "podSelectorEndpoints": [
                {"hostIP": "10.20.11.162", "podIP": "10.20.11.20", "name": "a", "namespace": "x"}
            ],
            "egress": [
                {"cidr": "0.0.0.0/0", "action": "Deny"},
                {"cidr": "10.20.11.21", "ports": [{"protocol": "UDP", "port": 53}], "action": "Accept"}
            ]
        }))
        .unwrap();
        assert_eq!(spec.egress[1].ports[0].port, Some(53));
        let back = serde_json::to_value(&spec).unwrap();
        assert_eq!(back["policyRef"]["name"], "deny-external");
        assert_eq!(back["egress"][0]["action"], "Deny");
    }
}
