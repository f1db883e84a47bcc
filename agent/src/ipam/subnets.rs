//! Subnet discovery as aws-node reads its subnets' tags
//! (`ENABLE_SUBNET_DISCOVERY`): which subnets of the node's VPC and zone
//! new ENIs may go to, in which order, and which subnets' ENIs serve no
//! pod.

use crate::cloud::SubnetInfo;

/// The tag that opts a subnet in for pods (any value but `0`) or, `0`,
/// out (the primary ENI's subnet included).
pub const TAG_ROLE_CNI: &str = "kubernetes.io/role/cni";
/// The value of [`TAG_ROLE_CNI`] that keeps pods out of a subnet.
pub const ROLE_CNI_EXCLUDED: &str = "0";
/// A tagged subnet with any tag under this prefix is for the clusters it
/// names (`<prefix><cluster name>`) only.
pub const TAG_CLUSTER_PREFIX: &str = "cni.networking.k8s.aws/cluster/";

/// `kubernetes.io/role/cni`'s value; blank counts as absent, as in aws-node.
fn role(subnet: &SubnetInfo) -> Option<&str> {
    subnet
        .tags
        .get(TAG_ROLE_CNI)
        .map(String::as_str)
        .filter(|v| !v.is_empty())
}

/// Whether a subnet's cluster tags let `cluster` use it: no cluster tag at
/// all, or one naming `cluster`. Without a cluster name, cluster tags are
/// not read.
fn for_cluster(subnet: &SubnetInfo, cluster: Option<&str>) -> bool {
    let Some(cluster) = cluster else {
        return true;
    };
    let mut cluster_tags = subnet
        .tags
        .keys()
        .filter_map(|k| k.strip_prefix(TAG_CLUSTER_PREFIX))
        .peekable();
    cluster_tags.peek().is_none() || cluster_tags.any(|c| c == cluster)
}

/// Whether a new ENI may go to `subnet`: tagged for pods (and for this
/// cluster), or the primary ENI's subnet left untagged.
fn takes_new_enis(subnet: &SubnetInfo, primary_subnet_id: &str, cluster: Option<&str>) -> bool {
    match role(subnet) {
        Some(ROLE_CNI_EXCLUDED) => false,
        None => subnet.id == primary_subnet_id,
        Some(_) => for_cluster(subnet, cluster),
    }
}

/// The subnets a new ENI may go to, the one with most free addresses
/// first (EC2's order among equals).
#[must_use]
pub fn for_new_enis(
    mut subnets: Vec<SubnetInfo>,
    primary_subnet_id: &str,
    cluster: Option<&str>,
) -> Vec<SubnetInfo> {
    subnets.retain(|s| takes_new_enis(s, primary_subnet_id, cluster));
    subnets.sort_by_key(|s| std::cmp::Reverse(s.available_addresses));
    subnets
}

/// Whether the ENIs of subnet `subnet_id` serve no pod: tagged `0`, or
/// tagged for pods of other clusters only. A subnet not among `subnets`
/// (another zone, another account's) is not excluded.
#[must_use]
pub fn excluded(subnets: &[SubnetInfo], subnet_id: &str, cluster: Option<&str>) -> bool {
    subnets
        .iter()
        .find(|s| s.id == subnet_id)
        .is_some_and(|s| match role(s) {
            None => false,
            Some(ROLE_CNI_EXCLUDED) => true,
            Some(_) => !for_cluster(s, cluster),
        })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    const PRIMARY: &str = "subnet-0primary";

    fn subnet(id: &str, free: u32, tags: &[(&str, &str)]) -> SubnetInfo {
        SubnetInfo {
            id: id.to_owned(),
            cidr: "10.0.0.0/24".parse().unwrap(),
            available_addresses: free,
            vpc_id: "vpc-1".to_owned(),
            availability_zone: "us-west-2a".to_owned(),
            tags: tags
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    fn ids(subnets: &[SubnetInfo]) -> Vec<&str> {
        subnets.iter().map(|s| s.id.as_str()).collect()
    }

    #[test]
    fn tagged_subnets_and_the_untagged_primary_most_free_first() {
        let subnets = vec![
            subnet(PRIMARY, 100, &[]),
            subnet("subnet-untagged", 5000, &[]),
            subnet("subnet-small", 50, &[(TAG_ROLE_CNI, "1")]),
            subnet("subnet-big", 4000, &[(TAG_ROLE_CNI, "yes")]),
            subnet("subnet-blank", 9000, &[(TAG_ROLE_CNI, "")]),
            subnet("subnet-out", 9000, &[(TAG_ROLE_CNI, "0")]),
        ];
        assert_eq!(
            ids(&for_new_enis(subnets, PRIMARY, None)),
            ["subnet-big", PRIMARY, "subnet-small"]
        );
    }

    #[test]
    fn a_primary_subnet_tagged_0_takes_no_eni_and_serves_no_pod() {
        let subnets = vec![
            subnet(PRIMARY, 100, &[(TAG_ROLE_CNI, "0")]),
            subnet("subnet-pods", 50, &[(TAG_ROLE_CNI, "1")]),
        ];
        assert_eq!(
            ids(&for_new_enis(subnets.clone(), PRIMARY, None)),
            ["subnet-pods"]
        );
        assert!(excluded(&subnets, PRIMARY, None));
        assert!(!excluded(&subnets, "subnet-pods", None));
        assert!(!excluded(&subnets, "subnet-elsewhere", None), "not listed");
    }

    #[test]
    fn cluster_tags_keep_a_subnet_to_the_clusters_they_name() {
        let shared = subnet(
            "subnet-shared",
            300,
            &[
                (TAG_ROLE_CNI, "1"),
                ("cni.networking.k8s.aws/cluster/prod", "shared"),
                ("cni.networking.k8s.aws/cluster/dev", "shared"),
            ],
        );
        let theirs = subnet(
            "subnet-theirs",
            200,
            &[
                (TAG_ROLE_CNI, "1"),
                ("cni.networking.k8s.aws/cluster/other", "owned"),
            ],
        );
        let anyones = subnet("subnet-any", 100, &[(TAG_ROLE_CNI, "1")]);
        let subnets = vec![shared, theirs, anyones];
        assert_eq!(
            ids(&for_new_enis(subnets.clone(), PRIMARY, Some("prod"))),
            ["subnet-shared", "subnet-any"]
        );
        assert_eq!(
            ids(&for_new_enis(subnets.clone(), PRIMARY, None)),
            ["subnet-shared", "subnet-theirs", "subnet-any"],
            "without CLUSTER_NAME the cluster tags are not read"
        );
        assert!(excluded(&subnets, "subnet-theirs", Some("prod")));
        assert!(!excluded(&subnets, "subnet-theirs", None));
        assert!(!excluded(&subnets, "subnet-shared", Some("dev")));
    }
}
