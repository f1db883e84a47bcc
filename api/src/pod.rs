//! What the plugin, the agent and the lab must agree on about a pod: the
//! name of its host veth and the branch ENI its annotations may give it.

use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// The VPC CNI's default host veth prefix (`AWS_VPC_K8S_CNI_VETHPREFIX`).
pub const DEFAULT_VETH_PREFIX: &str = "eni";

/// The annotation the VPC resource controller puts on a pod that has
/// security groups: the branch ENI it got on the node's trunk.
pub const POD_ENI_ANNOTATION: &str = "vpc.amazonaws.com/pod-eni";

/// The host-side veth name the VPC CNI gives a pod: `prefix` followed by
/// the first 11 hex digits of sha1("<namespace>.<pod name>")
/// (`GeneratePodHostVethName` in its `pkg/networkutils/names.go`).
pub fn host_veth_name(prefix: &str, k8s_namespace: &str, pod_name: &str) -> String {
    use std::fmt::Write;

    use sha1::{Digest, Sha1};
    let digest = Sha1::digest(format!("{k8s_namespace}.{pod_name}").as_bytes());
    let hex = digest.iter().fold(String::new(), |mut hex, byte| {
        let _ = write!(hex, "{byte:02x}");
        hex
    });
    format!("{prefix}{}", &hex[..11])
}

/// The extended resource a pod asks a branch ENI with (the VPC resource
/// controller's webhook puts it in the first container's limits).
pub const POD_ENI_RESOURCE: &str = "vpc.amazonaws.com/pod-eni";
/// The CNINode feature by which a node asks the controller for a trunk ENI.
pub const SECURITY_GROUPS_FOR_PODS: &str = "SecurityGroupsForPods";
/// The tag naming the instance an ENI was made for (the VPC CNI's, and the
/// controller's on trunk and branch ENIs).
pub const TAG_INSTANCE_ID: &str = "node.k8s.amazonaws.com/instance_id";

/// What every branch ENI's link is named before its VLAN id.
pub const BRANCH_LINK_PREFIX: &str = "vlan.eth.";

/// A branch ENI's link in the node: the VPC CNI's `buildVlanLinkName`
/// (`cmd/routed-eni-cni-plugin/driver/driver.go`), `vlan.eth.<vlan id>`.
pub fn branch_link_name(vlan_id: u16) -> String {
    format!("{BRANCH_LINK_PREFIX}{vlan_id}")
}

/// One branch ENI of the `vpc.amazonaws.com/pod-eni` annotation: the
/// resource controller's JSON (`ENIDetails`), its names and its order, so
/// that serializing a list of these writes what the controller writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BranchEni {
    #[serde(rename = "eniId")]
    pub eni_id: String,
    /// The branch ENI's MAC.
    #[serde(rename = "ifAddress")]
    pub mac: String,
    #[serde(rename = "privateIp")]
    pub private_ip: Ipv4Addr,
    /// Empty in an IPv4 cluster, as the controller writes it.
    #[serde(rename = "ipv6Addr", default)]
    pub ipv6_addr: String,
    #[serde(rename = "vlanId")]
    pub vlan_id: u16,
    #[serde(rename = "subnetCidr")]
    pub subnet_cidr: ipnet::Ipv4Net,
    #[serde(rename = "subnetV6Cidr", default)]
    pub subnet_v6_cidr: String,
    /// The trunk association (`AssociateTrunkInterface`'s id).
    #[serde(rename = "associationID", default)]
    pub association_id: String,
}

/// The branch ENI of a pod's annotations: `Ok(None)` for an ordinary pod.
pub fn branch_eni<S: std::hash::BuildHasher>(
    annotations: &std::collections::HashMap<String, String, S>,
) -> Result<Option<BranchEni>, serde_json::Error> {
    annotations
        .get(POD_ENI_ANNOTATION)
        .map_or(Ok(None), |value| branch_eni_of(value))
}

/// The branch ENI of a `vpc.amazonaws.com/pod-eni` annotation's value.
pub fn branch_eni_of(value: &str) -> Result<Option<BranchEni>, serde_json::Error> {
    let enis: Vec<BranchEni> = serde_json::from_str(value)?;
    // A pod has one branch ENI; the annotation is a list for IPv6 and
    // future use.
    Ok(enis.into_iter().next())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_veth_name_matches_the_vpc_cni() {
        // `printf default.pod-0 | sha1sum` = c220f2ba28177a355f83...
        assert_eq!(
            host_veth_name(DEFAULT_VETH_PREFIX, "default", "pod-0"),
            "enic220f2ba281"
        );
        assert_eq!(
            host_veth_name("vlan", "default", "pod-1"),
            "vlan83dbd022cd5"
        );
    }

    #[test]
    fn branch_eni_annotation_parses() {
        let mut annotations = std::collections::HashMap::new();
        assert_eq!(branch_eni(&annotations).unwrap(), None);
        annotations.insert(
            POD_ENI_ANNOTATION.to_owned(),
            r#"[{"eniId":"eni-0123","ifAddress":"02:ee:0a:14:0c:05","privateIp":"10.20.12.5","ipv6Addr":"","vlanId":5,"subnetCidr":"10.20.12.0/24","subnetV6Cidr":"","associationID":"trunk-assoc-1"}]"#.to_owned(),
        );
        let eni = branch_eni(&annotations).unwrap().unwrap();
        assert_eq!(eni.vlan_id, 5);
        assert_eq!(eni.private_ip, Ipv4Addr::new(10, 20, 12, 5));
        // Written back, it is the controller's JSON, key for key.
        assert_eq!(
            serde_json::to_string(&[&eni]).unwrap(),
            annotations[POD_ENI_ANNOTATION]
        );
        annotations.insert(POD_ENI_ANNOTATION.to_owned(), "[{]".to_owned());
        assert!(branch_eni(&annotations).is_err());
    }
}
