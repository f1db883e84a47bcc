//! EKS's `PolicyEndpoint` (`networking.k8s.aws/v1alpha1`, namespaced): a
//! NetworkPolicy as the network policy controller resolves it for the
//! nodes' agents (github.com/aws/amazon-network-policy-controller-k8s,
//! `api/v1alpha1/policyendpoint_types.go`). One definition, for the agent
//! that reads it and the lab's controller that writes it; the JSON names
//! are the CRD's.

use serde::{Deserialize, Serialize};

pub const GROUP: &str = "networking.k8s.aws";
pub const VERSION: &str = "v1alpha1";
/// `GROUP/VERSION`, as objects name it.
pub const API_VERSION: &str = "networking.k8s.aws/v1alpha1";
pub const KIND: &str = "PolicyEndpoint";
pub const PLURAL: &str = "policyendpoints";
/// How many entries the controller puts in one list of one object before
/// it starts another object for the same policy.
pub const CHUNK: usize = 200;

/// `spec` of a PolicyEndpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyEndpointSpec {
    /// The policy's pod selector, as a `metav1.LabelSelector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    pub policy_ref: PolicyReference,
    /// `Ingress` and/or `Egress`: the policy's `policyTypes`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pod_isolation: Vec<String>,
    /// The pods the policy selects, with the node each runs on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pod_selector_endpoints: Vec<PodEndpoint>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ingress: Vec<EndpointInfo>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<EndpointInfo>,
}

/// `podIsolation`'s values.
pub const ISOLATION_INGRESS: &str = "Ingress";
pub const ISOLATION_EGRESS: &str = "Egress";

/// The NetworkPolicy a PolicyEndpoint comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyReference {
    pub name: String,
    pub namespace: String,
}

/// A selected pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodEndpoint {
    #[serde(rename = "hostIP")]
    pub host_ip: String,
    #[serde(rename = "podIP")]
    pub pod_ip: String,
    pub name: String,
    pub namespace: String,
}

/// Peers allowed by one rule: an address or a CIDR (a pod's address comes
/// without a mask), less exceptions, on ports (none: every port).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointInfo {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cidr: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub except: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<Port>,
    /// Cluster network policies' FQDN peers (egress only); not a
    /// NetworkPolicy's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub domain_name: String,
}

/// A port (range) of a protocol; a missing protocol is TCP, a missing port
/// every port.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_port: Option<i32>,
}

/// A `metav1.LabelSelector`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub match_labels: std::collections::BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelSelectorRequirement>,
}

/// One requirement of a [`LabelSelector`]: `In`, `NotIn`, `Exists`,
/// `DoesNotExist`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabelSelectorRequirement {
    pub key: String,
    pub operator: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

/// The operators a [`LabelSelectorRequirement`] may have.
pub const SELECTOR_OPERATORS: [&str; 4] = ["In", "NotIn", "Exists", "DoesNotExist"];

impl LabelSelector {
    /// Whether every requirement has an operator the API defines.
    #[must_use]
    pub fn readable(&self) -> bool {
        self.match_expressions
            .iter()
            .all(|r| SELECTOR_OPERATORS.contains(&r.operator.as_str()))
    }

    /// Whether `labels` satisfy the selector (an empty one selects all);
    /// `None` for an operator the API does not define.
    #[must_use]
    pub fn matches(&self, labels: &std::collections::BTreeMap<String, String>) -> Option<bool> {
        if self
            .match_labels
            .iter()
            .any(|(k, v)| labels.get(k) != Some(v))
        {
            return Some(false);
        }
        for req in &self.match_expressions {
            let value = labels.get(&req.key);
            let ok = match req.operator.as_str() {
                "In" => value.is_some_and(|v| req.values.contains(v)),
                "NotIn" => value.is_none_or(|v| !req.values.contains(v)),
                "Exists" => value.is_some(),
                "DoesNotExist" => value.is_none(),
                _ => return None,
            };
            if !ok {
                return Some(false);
            }
        }
        Some(true)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn the_api_version_is_the_group_and_version() {
        assert_eq!(API_VERSION, format!("{GROUP}/{VERSION}"));
    }

    #[test]
    fn the_controllers_json_reads_with_its_names() {
        let spec: PolicyEndpointSpec = serde_json::from_value(serde_json::json!({
            "podSelector": {"matchLabels": {"app": "web"}},
            "policyRef": {"name": "allow-web", "namespace": "x"},
            "podIsolation": ["Ingress"],
            "podSelectorEndpoints": [
                {"hostIP": "10.20.11.162", "podIP": "10.20.11.20", "name": "a", "namespace": "x"}
            ],
            "ingress": [
                {"cidr": "10.20.11.21", "ports": [{"protocol": "TCP", "port": 80, "endPort": 90}]},
                {"cidr": "0.0.0.0/0", "except": ["203.0.113.0/24"]}
            ]
        }))
        .unwrap();
        assert_eq!(spec.pod_selector_endpoints[0].host_ip, "10.20.11.162");
        assert_eq!(spec.ingress[0].ports[0].end_port, Some(90));
        assert_eq!(spec.ingress[1].except, ["203.0.113.0/24"]);
        let back = serde_json::to_value(&spec).unwrap();
        assert_eq!(back["podSelectorEndpoints"][0]["podIP"], "10.20.11.20");
    }

    #[test]
    fn selectors_read_as_the_api_defines_them() {
        let labels = BTreeMap::from([("app".to_owned(), "web".to_owned())]);
        let selector = |json| serde_json::from_value::<LabelSelector>(json).unwrap();
        assert_eq!(selector(serde_json::json!({})).matches(&labels), Some(true));
        assert_eq!(
            selector(serde_json::json!({"matchExpressions": [
                {"key": "app", "operator": "In", "values": ["web", "api"]},
                {"key": "tier", "operator": "DoesNotExist"}
            ]}))
            .matches(&labels),
            Some(true)
        );
        assert_eq!(
            selector(serde_json::json!({"matchLabels": {"app": "api"}})).matches(&labels),
            Some(false)
        );
        assert_eq!(
            selector(serde_json::json!({"matchExpressions": [
                {"key": "app", "operator": "Like"}
            ]}))
            .matches(&labels),
            None
        );
    }
}
