//! The emulator's configuration file (JSON): the account, region and VPC it
//! pretends to be, the seed of its randomness, the attachment delay and the
//! faults to inject from the start. [`Config::lab`] is the lab's.

use std::{collections::BTreeMap, path::Path};

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::addrs::{CUSTOM_POD_SUBNET, NODE_SUBNET, PEER_SUBNET, VPC_CIDR, VPC_SECONDARY_CIDR};

/// The lab VPC's id (stable: tests and the agent's config may name it).
pub const LAB_VPC_ID: &str = "vpc-0a5e1ab0000000001";
/// The node subnet's id (10.20.11.0/24).
pub const LAB_NODE_SUBNET_ID: &str = "subnet-0a5e1ab000000b011";
/// The peer subnet's id (10.20.12.0/24).
pub const LAB_PEER_SUBNET_ID: &str = "subnet-0a5e1ab000000c012";
/// The custom-networking pod subnet's id (100.64.0.0/18).
pub const LAB_CUSTOM_SUBNET_ID: &str = "subnet-0a5e1ab000000d064";
/// The VPC's default security group.
pub const LAB_DEFAULT_SG_ID: &str = "sg-0a5e1ab0000000001";
/// A second security group (for `ModifyNetworkInterfaceAttribute` tests).
pub const LAB_NODE_SG_ID: &str = "sg-0a5e1ab0000000002";
/// The lab's region and availability zone.
pub const LAB_REGION: &str = "us-west-2";
pub const LAB_AZ: &str = "us-west-2a";
/// The account (AWS's documentation example account).
pub const LAB_ACCOUNT_ID: &str = "111122223333";
/// The instance role whose credentials IMDS hands out.
pub const LAB_IAM_ROLE: &str = "vpcnet-lab-node";
/// AWS's default attachment time is a few hundred milliseconds to seconds.
pub const DEFAULT_ATTACH_DELAY_MS: u64 = 500;

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub region: String,
    pub availability_zone: String,
    pub account_id: String,
    pub vpc: VpcConfig,
    pub subnets: Vec<SubnetConfig>,
    pub security_groups: Vec<SecurityGroupConfig>,
    /// Seeds the address and prefix picks (and the faults): the same calls
    /// get the same answers run after run.
    #[serde(default)]
    pub seed: u64,
    /// How long an attachment stays `attaching` (and a detachment
    /// `detaching`).
    #[serde(default = "default_attach_delay_ms")]
    pub attach_delay_ms: u64,
    /// Faults injected from the start.
    #[serde(default)]
    pub faults: Vec<FaultRule>,
    /// The role name under `iam/security-credentials/`.
    #[serde(default = "default_role")]
    pub iam_role: String,
}

fn default_attach_delay_ms() -> u64 {
    DEFAULT_ATTACH_DELAY_MS
}

fn default_role() -> String {
    LAB_IAM_ROLE.to_owned()
}

/// The VPC: its id and CIDRs, the first one primary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VpcConfig {
    pub id: String,
    pub cidrs: Vec<Ipv4Net>,
}

/// A subnet of the VPC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubnetConfig {
    pub id: String,
    pub cidr: Ipv4Net,
    /// Defaults to the configuration's zone.
    #[serde(default)]
    pub availability_zone: Option<String>,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
}

/// A security group (only its existence matters to the emulator).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecurityGroupConfig {
    pub id: String,
    pub name: String,
}

/// Faults for one action (or `*`, every action): each call draws one
/// number and fails with the first kind whose rate it falls under, so the
/// rates add up (they must not exceed 1 together).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct FaultRule {
    pub action: String,
    /// HTTP 503 `RequestLimitExceeded`.
    #[serde(default)]
    pub throttle: f64,
    /// HTTP 503 `Unavailable`.
    #[serde(default)]
    pub unavailable: f64,
    /// HTTP 500 `InternalError`.
    #[serde(default)]
    pub internal: f64,
    /// HTTP 403 `UnauthorizedOperation`: the node's IAM role lacks the
    /// action.
    #[serde(default)]
    pub unauthorized: f64,
}

impl Config {
    /// The lab's cloud: us-west-2a, VPC 10.20.0.0/16 + 100.64.0.0/16 with
    /// the node, peer and custom-networking subnets.
    pub fn lab() -> Self {
        let subnet = |id: &str, cidr: Ipv4Net, name: &str| SubnetConfig {
            id: id.to_owned(),
            cidr,
            availability_zone: None,
            tags: BTreeMap::from([("Name".to_owned(), name.to_owned())]),
        };
        Self {
            region: LAB_REGION.to_owned(),
            availability_zone: LAB_AZ.to_owned(),
            account_id: LAB_ACCOUNT_ID.to_owned(),
            vpc: VpcConfig {
                id: LAB_VPC_ID.to_owned(),
                cidrs: vec![VPC_CIDR, VPC_SECONDARY_CIDR],
            },
            subnets: vec![
                subnet(LAB_NODE_SUBNET_ID, NODE_SUBNET, "vpcnet-lab-node"),
                subnet(LAB_PEER_SUBNET_ID, PEER_SUBNET, "vpcnet-lab-peer"),
                subnet(LAB_CUSTOM_SUBNET_ID, CUSTOM_POD_SUBNET, "vpcnet-lab-pods"),
            ],
            security_groups: vec![
                SecurityGroupConfig {
                    id: LAB_DEFAULT_SG_ID.to_owned(),
                    name: "default".to_owned(),
                },
                SecurityGroupConfig {
                    id: LAB_NODE_SG_ID.to_owned(),
                    name: "vpcnet-lab-node".to_owned(),
                },
            ],
            seed: 1,
            attach_delay_ms: DEFAULT_ATTACH_DELAY_MS,
            faults: Vec::new(),
            iam_role: LAB_IAM_ROLE.to_owned(),
        }
    }

    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let config: Self = serde_json::from_str(&text).map_err(|err| ConfigError::Invalid {
            path: path.display().to_string(),
            reason: err.to_string(),
        })?;
        config.validate().map_err(|reason| ConfigError::Invalid {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(config)
    }

    /// Subnets inside the VPC, not overlapping, ids unique, sane faults.
    pub fn validate(&self) -> Result<(), String> {
        if self.vpc.cidrs.is_empty() {
            return Err("the VPC needs at least one CIDR".into());
        }
        for (i, subnet) in self.subnets.iter().enumerate() {
            if !self
                .vpc
                .cidrs
                .iter()
                .any(|cidr| cidr.contains(&subnet.cidr))
            {
                return Err(format!(
                    "subnet {} ({}) is outside the VPC",
                    subnet.id, subnet.cidr
                ));
            }
            if subnet.cidr.prefix_len() > 28 || subnet.cidr.prefix_len() < 16 {
                return Err(format!(
                    "subnet {} ({}): EC2 subnets are /16 to /28",
                    subnet.id, subnet.cidr
                ));
            }
            for other in &self.subnets[i + 1..] {
                if other.id == subnet.id {
                    return Err(format!("subnet id {} twice", subnet.id));
                }
                if other.cidr.contains(&subnet.cidr) || subnet.cidr.contains(&other.cidr) {
                    return Err(format!("subnets {} and {} overlap", subnet.id, other.id));
                }
            }
        }
        if self.security_groups.is_empty() {
            return Err("at least one security group (the VPC's default) is needed".into());
        }
        for rule in &self.faults {
            rule.validate()?;
        }
        Ok(())
    }
}

impl FaultRule {
    /// Rates in 0..=1 that add up to at most 1.
    pub fn validate(&self) -> Result<(), String> {
        let rates = [
            self.throttle,
            self.unavailable,
            self.internal,
            self.unauthorized,
        ];
        if rates.iter().any(|rate| !(0.0..=1.0).contains(rate)) || rates.iter().sum::<f64>() > 1.0 {
            return Err(format!(
                "fault rates for {} must be within 0..1 and add up to at most 1",
                self.action
            ));
        }
        if self.action.is_empty() {
            return Err("a fault rule needs an action (or *)".into());
        }
        Ok(())
    }
}

/// A configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading the EC2 emulator's configuration {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the EC2 emulator's configuration {path} is invalid: {reason}")]
    Invalid { path: String, reason: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lab_config_is_valid_and_round_trips() {
        let config = Config::lab();
        config.validate().unwrap();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(serde_json::from_str::<Config>(&json).unwrap(), config);
    }

    #[test]
    fn rejects_overlaps_and_bad_rates() {
        let mut config = Config::lab();
        config.subnets[1].cidr = "10.20.11.128/25".parse().unwrap();
        assert!(config.validate().unwrap_err().contains("overlap"));
        let mut config = Config::lab();
        config.faults.push(FaultRule {
            action: "*".into(),
            throttle: 0.7,
            internal: 0.7,
            ..FaultRule::default()
        });
        assert!(config.validate().is_err());
    }
}
