//! The node's CNINode (`vpcresources.k8s.aws/v1alpha1`, made by the VPC
//! resource controller, named after the node): with `ENABLE_POD_ENI`
//! aws-node adds the `SecurityGroupsForPods` feature to it, which is what
//! asks the controller for a trunk ENI. vpcnet does the same, the same way:
//! a merge patch of the whole feature list, guarded by the object's
//! resourceVersion (a concurrent writer makes it read and try again).
//! Because the patch rewrites the list, a CNINode whose features carry a
//! field vpcnet does not know (a newer controller's) is not written: one
//! error names it. The spec's other fields (`tags`, `managedBy`) are not
//! in the patch and stay as they are.

use std::time::Duration;

use kube::{
    Api, CustomResource,
    api::{Patch, PatchParams},
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tracing::{debug, error, info, warn};
pub use vpcnet_api::pod::SECURITY_GROUPS_FOR_PODS;

use super::{K8sError, K8sSettings};
use crate::retry;

/// The CNINode's spec, as the resource controller defines it (the fields
/// vpcnet reads).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[kube(
    group = "vpcresources.k8s.aws",
    version = "v1alpha1",
    kind = "CNINode",
    schema = "disabled"
)]
pub struct CNINodeSpec {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<Feature>,
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub tags: std::collections::BTreeMap<String, String>,
}

/// One feature of a CNINode. Unknown fields are refused, not dropped: the
/// patch of the feature list would lose them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Feature {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
}

/// The feature list with `name` set to `value` (a feature of that name with
/// another value is replaced); `None` when it is already there.
pub fn with_feature(features: &[Feature], name: &str, value: &str) -> Option<Vec<Feature>> {
    if features.iter().any(|f| f.name == name && f.value == value) {
        return None;
    }
    let mut features: Vec<Feature> = features
        .iter()
        .filter(|f| f.name != name)
        .cloned()
        .collect();
    features.push(Feature {
        name: name.to_owned(),
        value: value.to_owned(),
    });
    Some(features)
}

/// Adds feature `name` to the node's CNINode once; `Ok(false)` if it was
/// already there.
pub async fn add_feature(
    client: &kube::Client,
    settings: &K8sSettings,
    name: &str,
    value: &str,
) -> Result<bool, K8sError> {
    let node = settings.node_name()?;
    let api = Api::<CNINode>::all(client.clone());
    loop {
        let current = match api.get(node).await {
            Ok(current) => current,
            Err(kube::Error::SerdeError(e)) => {
                return Err(K8sError::Unreadable {
                    object: format!("CNINode {node}"),
                    why: e.to_string(),
                });
            }
            Err(source) => return Err(K8sError::api(format!("reading CNINode {node}"))(source)),
        };
        let Some(features) = with_feature(&current.spec.features, name, value) else {
            return Ok(false);
        };
        let patch = json!({
            "metadata": {"resourceVersion": current.metadata.resource_version},
            "spec": {"features": features},
        });
        match api
            .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => return Ok(true),
            // Someone wrote in between: read again.
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(source) => {
                return Err(K8sError::api(format!("patching CNINode {node}"))(source));
            }
        }
    }
}

/// Asks for a trunk ENI as aws-node does with `ENABLE_POD_ENI`, retrying
/// with backoff while the API server does not answer or the CNINode cannot
/// be read (said once).
pub async fn enable_security_groups_for_pods(client: kube::Client, settings: K8sSettings) {
    let mut unreadable_said = None;
    for delay in retry::delays(Duration::from_secs(1), Duration::from_mins(1)) {
        match add_feature(&client, &settings, SECURITY_GROUPS_FOR_PODS, "").await {
            Ok(true) => {
                info!(
                    feature = SECURITY_GROUPS_FOR_PODS,
                    "feature added to the node's CNINode: the VPC resource controller attaches a trunk ENI"
                );
                return;
            }
            Ok(false) => {
                info!(
                    feature = SECURITY_GROUPS_FOR_PODS,
                    "the node's CNINode has the feature"
                );
                return;
            }
            Err(error @ K8sError::Unreadable { .. }) => {
                crate::telemetry::pod_eni_error(crate::telemetry::POD_ENI_ENABLE_SECURITY_GROUPS);
                let said = error.to_string();
                if unreadable_said.as_ref() == Some(&said) {
                    debug!(%error, retry_in = ?delay, "the node's CNINode");
                } else {
                    error!(%error, "{SECURITY_GROUPS_FOR_PODS} is not added: no trunk ENI is asked for");
                    unreadable_said = Some(said);
                }
            }
            Err(error) => {
                crate::telemetry::pod_eni_error(crate::telemetry::POD_ENI_ENABLE_SECURITY_GROUPS);
                warn!(%error, retry_in = ?delay, "adding {SECURITY_GROUPS_FOR_PODS} to the node's CNINode");
            }
        }
        tokio::time::sleep(delay).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feature(name: &str, value: &str) -> Feature {
        Feature {
            name: name.into(),
            value: value.into(),
        }
    }

    #[test]
    fn a_feature_is_added_once_and_a_changed_value_replaces_it() {
        let none: Vec<Feature> = Vec::new();
        let added = with_feature(&none, SECURITY_GROUPS_FOR_PODS, "").unwrap();
        assert_eq!(added, [feature(SECURITY_GROUPS_FOR_PODS, "")]);
        assert_eq!(with_feature(&added, SECURITY_GROUPS_FOR_PODS, ""), None);
        let custom = [
            feature("CustomNetworking", "us-west-2a"),
            feature(SECURITY_GROUPS_FOR_PODS, ""),
        ];
        let changed = with_feature(&custom, "CustomNetworking", "us-west-2b").unwrap();
        assert_eq!(
            changed,
            [
                feature(SECURITY_GROUPS_FOR_PODS, ""),
                feature("CustomNetworking", "us-west-2b")
            ]
        );
        // A feature's field vpcnet does not know is refused by name, not
        // dropped; the spec's own new fields are no concern of the patch.
        let newer =
            serde_json::json!({"features": [{"name": "SecurityGroupsForPods", "weight": 2}]});
        let refused = serde_json::from_value::<CNINodeSpec>(newer).unwrap_err();
        assert!(
            refused.to_string().contains("unknown field `weight`"),
            "{refused}"
        );
        let managed = serde_json::json!({"managedBy": "vpc-resource-controller", "features": []});
        assert!(serde_json::from_value::<CNINodeSpec>(managed).is_ok());
        // On the wire, an empty value is left out, as aws-node sends it.
        let json = serde_json::to_value(feature(SECURITY_GROUPS_FOR_PODS, "")).unwrap();
        assert_eq!(json, serde_json::json!({"name": "SecurityGroupsForPods"}));
    }
}
