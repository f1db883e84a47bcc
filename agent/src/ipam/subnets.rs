//! Subnet choice for new ENIs: custom networking's subnet, or subnet
//! discovery as aws-node reads its subnets' tags (`ENABLE_SUBNET_DISCOVERY`):
//! which subnets of the node's VPC and zone new ENIs may go to, in which
//! order, and which subnets' ENIs serve no pod.

use std::collections::BTreeSet;

use tracing::warn;

use super::settings::EniConfig;
use crate::cloud::{Cloud, CloudError, SubnetInfo};

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

/// Where a new ENI goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EniPlacement {
    /// The primary ENI's subnet, or those subnet discovery finds, with the
    /// primary ENI's security groups.
    NodeSubnets,
    /// Custom networking's subnet and groups.
    Custom(EniConfig),
    /// Custom networking with no valid ENIConfig yet: no ENI.
    NoEniConfig,
}

/// Why no subnet could be chosen.
#[derive(Debug, thiserror::Error)]
pub enum SubnetError {
    #[error(transparent)]
    Cloud(#[from] CloudError),
    #[error("{0}")]
    NoSubnet(String),
}

/// The node's place in its VPC and what subnet discovery reads, with the
/// cloud to ask.
pub struct SubnetChoice<'a> {
    pub cloud: &'a Cloud,
    pub vpc_id: &'a str,
    /// The node's availability zone.
    pub zone: &'a str,
    pub primary_subnet_id: &'a str,
    pub cluster: Option<&'a str>,
    /// `ENABLE_SUBNET_DISCOVERY`.
    pub discovery: bool,
}

impl SubnetChoice<'_> {
    /// Where new ENIs go, for the start's log line.
    #[must_use]
    pub fn describe(&self, placement: &EniPlacement) -> String {
        match placement {
            EniPlacement::Custom(config) => {
                format!(
                    "{} (custom networking, {})",
                    config.subnet_id,
                    config.source()
                )
            }
            EniPlacement::NoEniConfig => {
                "custom networking: the node's ENIConfig's, once there is one".to_owned()
            }
            EniPlacement::NodeSubnets if self.discovery => format!(
                "discovered in {} {} ({TAG_ROLE_CNI}), or {}",
                self.vpc_id, self.zone, self.primary_subnet_id
            ),
            EniPlacement::NodeSubnets => self.primary_subnet_id.to_owned(),
        }
    }

    async fn zone_subnets(&self) -> Result<Vec<SubnetInfo>, CloudError> {
        self.cloud.zone_subnets(self.vpc_id, self.zone).await
    }

    /// With subnet discovery, the subnets of the node's VPC and zone whose
    /// ENIs serve no pod.
    pub async fn excluded(&self) -> Result<BTreeSet<String>, CloudError> {
        if !self.discovery {
            return Ok(BTreeSet::new());
        }
        let zone = self.zone_subnets().await?;
        Ok(zone
            .iter()
            .filter(|s| excluded(&zone, &s.id, self.cluster))
            .map(|s| s.id.clone())
            .collect())
    }

    /// The subnets to try a new ENI in, in order: custom networking's;
    /// with subnet discovery, those tagged for pods (or the primary ENI's,
    /// untagged), most free addresses first; else the primary ENI's, unless
    /// it is tagged `0`. As aws-node, when EC2 cannot list the subnets, the
    /// primary ENI's, if a second look says it is not excluded.
    pub async fn for_new_eni(&self, placement: &EniPlacement) -> Result<Vec<String>, SubnetError> {
        match placement {
            EniPlacement::Custom(config) => return Ok(vec![config.subnet_id.clone()]),
            EniPlacement::NoEniConfig => {
                return Err(SubnetError::NoSubnet(
                    "custom networking has no valid ENIConfig for this node".to_owned(),
                ));
            }
            EniPlacement::NodeSubnets => {}
        }
        let primary = self.primary_subnet_id;
        let primary_unless_excluded = |zone: &[SubnetInfo]| {
            if excluded(zone, primary, self.cluster) {
                Err(SubnetError::NoSubnet(format!(
                    "the primary ENI's subnet {primary} is tagged {TAG_ROLE_CNI}=0 (or for other clusters only) and subnet discovery is {}",
                    if self.discovery { "on" } else { "off" }
                )))
            } else {
                Ok(vec![primary.to_owned()])
            }
        };
        if !self.discovery {
            return match self.zone_subnets().await {
                Ok(zone) => primary_unless_excluded(&zone),
                Err(e) => {
                    warn!(error = %e, subnet = %primary, "cannot tell whether the primary ENI's subnet is excluded: creating the ENI there");
                    Ok(vec![primary.to_owned()])
                }
            };
        }
        match self.zone_subnets().await {
            Ok(zone) => {
                let found: Vec<String> = for_new_enis(zone, primary, self.cluster)
                    .into_iter()
                    .map(|s| s.id)
                    .collect();
                if found.is_empty() {
                    return Err(SubnetError::NoSubnet(format!(
                        "no subnet of {} in {} is tagged {TAG_ROLE_CNI} for this cluster, and the primary ENI's subnet {primary} is tagged 0 (or for other clusters only)",
                        self.vpc_id, self.zone
                    )));
                }
                Ok(found)
            }
            Err(e) => {
                warn!(error = %e, "listing the zone's subnets failed: trying the primary ENI's subnet");
                primary_unless_excluded(&self.zone_subnets().await?)
            }
        }
    }
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
