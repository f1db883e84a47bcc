//! Which nodes each DaemonSet runs on: the label that moves a node from
//! aws-node to vpcnet and back, the affinity that keeps aws-node off
//! labelled nodes (`deploy/aws-node/`), and the scheduler's rule for a
//! pod's required node affinity and node selector, to check them with.

use std::{collections::BTreeMap, path::Path};

use k8s_openapi::api::core::v1::{Affinity, NodeSelectorRequirement, PodSpec};
use serde_json::Value;

use crate::{DEPLOY_DIR, ManifestError, documents};

/// The node label an operator sets to move a node.
pub const NODE_LABEL: &str = "vpcnet.dev/cni";
/// [`NODE_LABEL`]'s value for a node vpcnet's DaemonSet runs on.
pub const ON_VPCNET: &str = "vpcnet";
/// [`NODE_LABEL`]'s value for a node the rollback DaemonSet hands back.
pub const ROLLBACK: &str = "rollback";

/// The EKS add-on's `configurationValues` (`aws eks update-addon
/// --configuration-values file://...`).
pub const ADDON_CONFIGURATION: &str = "aws-node/addon-configuration.json";
/// Values for a self-managed `aws-vpc-cni` Helm release, or for Argo CD or
/// Flux.
pub const HELM_VALUES: &str = "aws-node/values.yaml";

/// The affinity a file of `deploy/` (one of [`ADDON_CONFIGURATION`],
/// [`HELM_VALUES`]) gives aws-node.
pub fn aws_node_affinity(file: &str) -> Result<Affinity, ManifestError> {
    let path = Path::new(DEPLOY_DIR).join(file);
    let text = std::fs::read_to_string(&path).map_err(|e| ManifestError::Tool {
        command: format!("reading {}", path.display()),
        message: e.to_string(),
    })?;
    let doc = documents(&text, file)?
        .into_iter()
        .next()
        .unwrap_or(Value::Null);
    serde_json::from_value(doc.get("affinity").cloned().unwrap_or(Value::Null)).map_err(|e| {
        ManifestError::Yaml {
            source_name: file.to_owned(),
            message: e.to_string(),
        }
    })
}

/// Whether a pod of `spec` may run on a node labelled `labels`, as the
/// scheduler and the DaemonSet controller judge it: its node selector,
/// and its required node affinity (any term, each of whose expressions
/// holds).
#[must_use]
pub fn admits(spec: &PodSpec, labels: &BTreeMap<String, String>) -> bool {
    let selector = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(key, value)| labels.get(key) == Some(value));
    selector && affinity_admits(spec.affinity.as_ref(), labels)
}

/// [`admits`] for the required node affinity alone.
#[must_use]
pub fn affinity_admits(affinity: Option<&Affinity>, labels: &BTreeMap<String, String>) -> bool {
    let Some(required) = affinity
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
    else {
        return true;
    };
    required.node_selector_terms.iter().any(|term| {
        term.match_expressions
            .iter()
            .flatten()
            .all(|requirement| holds(requirement, labels))
    })
}

fn holds(requirement: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&requirement.key);
    let values = requirement.values.as_deref().unwrap_or_default();
    let number = |v: &str| v.parse::<i64>().ok();
    match requirement.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), Some(bound)) = (
                value.and_then(|v| number(v)),
                values.first().and_then(|v| number(v)),
            ) else {
                return false;
            };
            if requirement.operator == "Gt" {
                have > bound
            } else {
                have < bound
            }
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_add_on_configuration_and_the_helm_values_agree_and_keep_aws_node_off_labelled_nodes() {
        let addon = aws_node_affinity(ADDON_CONFIGURATION).unwrap();
        assert_eq!(addon, aws_node_affinity(HELM_VALUES).unwrap());
        let node = [
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "arm64"),
        ];
        assert!(affinity_admits(Some(&addon), &labels(&node)));
        for moved in [ON_VPCNET, ROLLBACK] {
            let mut labelled = labels(&node);
            labelled.insert(NODE_LABEL.to_owned(), moved.to_owned());
            assert!(!affinity_admits(Some(&addon), &labelled), "{moved}");
        }
        // The add-on's own terms are kept.
        let fargate = [
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", "amd64"),
            ("eks.amazonaws.com/compute-type", "fargate"),
        ];
        assert!(!affinity_admits(Some(&addon), &labels(&fargate)));
    }
}
