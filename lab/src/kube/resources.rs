//! The kinds the lab's API server serves: one table, from which discovery,
//! the OpenAPI documents, routing and RBAC all read.

use std::sync::OnceLock;

use vpcnet_api::{cluster_policy, policy_endpoint};

/// One served resource (a kind at one group version).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resource {
    /// The API group; `""` is the core group (`/api/v1`).
    pub group: &'static str,
    pub version: &'static str,
    /// The plural, as it appears in paths and RBAC rules.
    pub plural: &'static str,
    pub singular: &'static str,
    pub kind: &'static str,
    pub namespaced: bool,
    pub short_names: &'static [&'static str],
}

impl Resource {
    /// `v1` or `apps/v1`.
    pub fn group_version(&self) -> String {
        if self.group.is_empty() {
            self.version.to_owned()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `/api/v1` or `/apis/apps/v1`.
    pub fn base_path(&self) -> String {
        if self.group.is_empty() {
            format!("/api/{}", self.version)
        } else {
            format!("/apis/{}/{}", self.group, self.version)
        }
    }

    /// The list kind, e.g. `NodeList`.
    pub fn list_kind(&self) -> String {
        format!("{}List", self.kind)
    }
}

/// The verbs every served resource answers.
pub const VERBS: [&str; 8] = [
    "create",
    "delete",
    "get",
    "list",
    "patch",
    "update",
    "watch",
    "deletecollection",
];

const fn core(
    plural: &'static str,
    singular: &'static str,
    kind: &'static str,
    namespaced: bool,
    short_names: &'static [&'static str],
) -> Resource {
    Resource {
        group: "",
        version: "v1",
        plural,
        singular,
        kind,
        namespaced,
        short_names,
    }
}

const fn grouped(
    group: &'static str,
    version: &'static str,
    plural: &'static str,
    singular: &'static str,
    kind: &'static str,
    namespaced: bool,
    short_names: &'static [&'static str],
) -> Resource {
    Resource {
        group,
        version,
        plural,
        singular,
        kind,
        namespaced,
        short_names,
    }
}

/// The ENIConfig CRD's group (the VPC CNI's custom networking).
pub const ENICONFIG_GROUP: &str = "crd.k8s.amazonaws.com";
/// The CNINode CRD's group (the VPC resource controller's).
pub const CNINODE_GROUP: &str = "vpcresources.k8s.aws";

/// Everything served: the kinds vpcnet reads or writes, the kinds its
/// manifests hold, NetworkPolicy, and the CRDs of the VPC CNI's world
/// (ENIConfig, CNINode, PolicyEndpoint, ClusterNetworkPolicy,
/// ClusterPolicyEndpoint).
pub const RESOURCES: &[Resource] = &[
    core("namespaces", "namespace", "Namespace", false, &["ns"]),
    core("nodes", "node", "Node", false, &["no"]),
    core("pods", "pod", "Pod", true, &["po"]),
    core("services", "service", "Service", true, &["svc"]),
    core("endpoints", "endpoints", "Endpoints", true, &["ep"]),
    core("events", "event", "Event", true, &["ev"]),
    core("configmaps", "configmap", "ConfigMap", true, &["cm"]),
    core(
        "serviceaccounts",
        "serviceaccount",
        "ServiceAccount",
        true,
        &["sa"],
    ),
    grouped(
        "apps",
        "v1",
        "daemonsets",
        "daemonset",
        "DaemonSet",
        true,
        &["ds"],
    ),
    grouped(
        "events.k8s.io",
        "v1",
        "events",
        "event",
        "Event",
        true,
        &["ev"],
    ),
    grouped(
        "networking.k8s.io",
        "v1",
        "servicecidrs",
        "servicecidr",
        "ServiceCIDR",
        false,
        &[],
    ),
    grouped(
        "networking.k8s.io",
        "v1",
        "networkpolicies",
        "networkpolicy",
        "NetworkPolicy",
        true,
        &["netpol"],
    ),
    grouped(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterroles",
        "clusterrole",
        "ClusterRole",
        false,
        &[],
    ),
    grouped(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "clusterrolebinding",
        "ClusterRoleBinding",
        false,
        &[],
    ),
    grouped(
        "rbac.authorization.k8s.io",
        "v1",
        "roles",
        "role",
        "Role",
        true,
        &[],
    ),
    grouped(
        "rbac.authorization.k8s.io",
        "v1",
        "rolebindings",
        "rolebinding",
        "RoleBinding",
        true,
        &[],
    ),
    grouped(
        ENICONFIG_GROUP,
        "v1alpha1",
        "eniconfigs",
        "eniconfig",
        "ENIConfig",
        false,
        &[],
    ),
    grouped(
        CNINODE_GROUP,
        "v1alpha1",
        "cninodes",
        "cninode",
        "CNINode",
        false,
        &["cnd"],
    ),
    // EKS's network policy controller's CRD (no short name there either).
    grouped(
        policy_endpoint::GROUP,
        policy_endpoint::VERSION,
        policy_endpoint::PLURAL,
        "policyendpoint",
        policy_endpoint::KIND,
        true,
        &[],
    ),
    grouped(
        cluster_policy::GROUP,
        cluster_policy::VERSION,
        cluster_policy::POLICY_PLURAL,
        "clusternetworkpolicy",
        cluster_policy::POLICY_KIND,
        false,
        &["cnp"],
    ),
    grouped(
        cluster_policy::GROUP,
        cluster_policy::VERSION,
        cluster_policy::ENDPOINT_PLURAL,
        "clusterpolicyendpoint",
        cluster_policy::ENDPOINT_KIND,
        false,
        &["cpe"],
    ),
];

/// Custom resources this cluster has not installed, by plural: their API
/// answers 404, as a cluster's without that controller's CRD. Set once, as
/// the server starts.
static UNINSTALLED: OnceLock<Vec<String>> = OnceLock::new();

/// Leaves the resources named `plurals` out of this process's cluster.
/// Only the first call counts (the server makes it once).
pub fn uninstall(plurals: Vec<String>) {
    let _ = UNINSTALLED.set(plurals);
}

/// The resources this cluster serves, in table order.
pub fn served() -> impl Iterator<Item = &'static Resource> {
    let uninstalled = UNINSTALLED.get();
    RESOURCES
        .iter()
        .filter(move |r| uninstalled.is_none_or(|gone| !gone.iter().any(|p| p == r.plural)))
}

/// The resource at `group`/`version` named `plural`.
pub fn find(group: &str, version: &str, plural: &str) -> Option<&'static Resource> {
    served().find(|r| r.group == group && r.version == version && r.plural == plural)
}

/// The resource of an object's `apiVersion` and `kind`.
pub fn by_kind(api_version: &str, kind: &str) -> Option<&'static Resource> {
    served().find(|r| r.group_version() == api_version && r.kind == kind)
}

/// Every group version served, core first, in table order.
pub fn group_versions() -> Vec<(&'static str, &'static str)> {
    let mut seen: Vec<(&str, &str)> = Vec::new();
    for resource in served() {
        let gv = (resource.group, resource.version);
        if !seen.contains(&gv) {
            seen.push(gv);
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_resource_is_found_by_path_and_by_kind_once() {
        for resource in RESOURCES {
            assert_eq!(
                find(resource.group, resource.version, resource.plural),
                Some(resource)
            );
            assert_eq!(
                by_kind(&resource.group_version(), resource.kind),
                Some(resource)
            );
        }
        assert_eq!(group_versions()[0], ("", "v1"));
        assert_eq!(find("", "v1", "nodes").unwrap().base_path(), "/api/v1");
        assert_eq!(
            find(CNINODE_GROUP, "v1alpha1", "cninodes")
                .unwrap()
                .base_path(),
            "/apis/vpcresources.k8s.aws/v1alpha1"
        );
    }
}
