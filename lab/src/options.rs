//! What `lab up` is asked to build.

use std::{fmt, path::PathBuf, str::FromStr, time::Duration};

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};

use crate::{
    addrs::MAX_PODS,
    error::{LabError, Result},
};

/// Which datapath the node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Datapath {
    /// This project: the agent loads the eBPF programs.
    #[default]
    Ebpf,
    /// The VPC CNI's own iptables and policy-routing wiring: the reference.
    Iptables,
}

impl fmt::Display for Datapath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
        })
    }
}

impl FromStr for Datapath {
    type Err = LabError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ebpf" => Ok(Self::Ebpf),
            "iptables" => Ok(Self::Iptables),
            other => Err(LabError::InvalidOption(format!(
                "datapath {other:?}: expected ebpf or iptables"
            ))),
        }
    }
}

/// How SNAT picks source ports (`AWS_VPC_K8S_CNI_RANDOMIZESNAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum RandomizeSnat {
    /// `prng`: `--random-fully`, the VPC CNI's default.
    #[default]
    #[serde(rename = "prng")]
    Prng,
    /// `hashrandom`: `--random`.
    #[serde(rename = "hashrandom")]
    HashRandom,
    /// `none`: no flag, sequential ports.
    #[serde(rename = "none")]
    Sequential,
}

impl RandomizeSnat {
    /// The value of `AWS_VPC_K8S_CNI_RANDOMIZESNAT`.
    pub fn env_value(self) -> &'static str {
        match self {
            Self::Prng => "prng",
            Self::HashRandom => "hashrandom",
            Self::Sequential => "none",
        }
    }

    /// The flag the VPC CNI appends to its SNAT rule.
    pub fn iptables_flag(self) -> Option<&'static str> {
        match self {
            Self::Prng => Some("--random-fully"),
            Self::HashRandom => Some("--random"),
            Self::Sequential => None,
        }
    }
}

impl fmt::Display for RandomizeSnat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.env_value())
    }
}

impl FromStr for RandomizeSnat {
    type Err = LabError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prng" => Ok(Self::Prng),
            "hashrandom" => Ok(Self::HashRandom),
            "none" => Ok(Self::Sequential),
            other => Err(LabError::InvalidOption(format!(
                "randomize-snat {other:?}: expected prng, hashrandom or none"
            ))),
        }
    }
}

/// Parses a comma-separated CIDR list (`AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`
/// syntax; spaces around items are allowed, empty items are not).
pub fn parse_cidr_list(list: &str) -> Result<Vec<Ipv4Net>> {
    if list.trim().is_empty() {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(|item| {
            let item = item.trim();
            item.parse::<Ipv4Net>()
                .map(|net| net.trunc())
                .map_err(|err| LabError::InvalidOption(format!("CIDR {item:?} in {list:?}: {err}")))
        })
        .collect()
}

/// What the lab is built with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabOptions {
    /// How many pods: `vpcnet-pod-0` ... `vpcnet-pod-<pods-1>`.
    pub pods: usize,
    /// The node's datapath.
    pub datapath: Datapath,
    /// `AWS_VPC_K8S_CNI_EXTERNALSNAT`: no SNAT on the node.
    pub external_snat: bool,
    /// `AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`.
    pub exclude_snat_cidrs: Vec<Ipv4Net>,
    /// `AWS_VPC_K8S_CNI_RANDOMIZESNAT`.
    pub randomize_snat: RandomizeSnat,
    /// The agent binary (ebpf datapath only; required there).
    pub agent_bin: Option<PathBuf>,
    /// How long the agent may take to print `READY`.
    #[serde(with = "duration_secs")]
    pub agent_ready_timeout: Duration,
}

impl Default for LabOptions {
    fn default() -> Self {
        Self {
            pods: 2,
            datapath: Datapath::default(),
            external_snat: false,
            exclude_snat_cidrs: Vec::new(),
            randomize_snat: RandomizeSnat::default(),
            agent_bin: None,
            agent_ready_timeout: Duration::from_secs(30),
        }
    }
}

impl LabOptions {
    /// The iptables reference datapath with `pods` pods and the VPC CNI's
    /// defaults otherwise.
    pub fn iptables(pods: usize) -> Self {
        Self {
            pods,
            datapath: Datapath::Iptables,
            ..Self::default()
        }
    }

    /// The eBPF datapath with `pods` pods, running `agent_bin`.
    pub fn ebpf(pods: usize, agent_bin: impl Into<PathBuf>) -> Self {
        Self {
            pods,
            datapath: Datapath::Ebpf,
            agent_bin: Some(agent_bin.into()),
            ..Self::default()
        }
    }

    /// Checks everything that can be checked before anything is built.
    pub fn validate(&self) -> Result<()> {
        self.validate_settings()?;
        if self.datapath == Datapath::Ebpf {
            let Some(agent) = &self.agent_bin else {
                return Err(LabError::InvalidOption(
                    "the ebpf datapath needs the agent binary (agent_bin)".into(),
                ));
            };
            if !agent.is_file() {
                return Err(LabError::InvalidOption(format!(
                    "the agent binary {} does not exist (build it with `cargo build -p vpcnet-agent`)",
                    agent.display()
                )));
            }
        }
        Ok(())
    }

    /// Checks everything but the agent binary (which may not be built yet).
    pub fn validate_settings(&self) -> Result<()> {
        if self.pods > MAX_PODS {
            return Err(LabError::TooManyPods {
                requested: self.pods,
                max: MAX_PODS,
            });
        }
        if self.agent_ready_timeout.is_zero() {
            return Err(LabError::InvalidOption(
                "agent_ready_timeout must not be zero".into(),
            ));
        }
        Ok(())
    }

    /// The exclusion CIDRs as the VPC CNI's environment variable spells them.
    pub fn exclude_snat_cidrs_env(&self) -> String {
        self.exclude_snat_cidrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

mod duration_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(value.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(deserializer)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_lists_parse_like_the_vpc_cni_env() {
        let cidrs = parse_cidr_list("192.0.2.0/24, 198.51.100.7/24").unwrap();
        assert_eq!(
            cidrs,
            vec![
                "192.0.2.0/24".parse().unwrap(),
                "198.51.100.0/24".parse().unwrap()
            ]
        );
        assert!(parse_cidr_list("").unwrap().is_empty());
        assert!(parse_cidr_list("192.0.2.0/24,,").is_err());
        assert!(parse_cidr_list("not-a-cidr").is_err());
    }

    #[test]
    fn options_round_trip_through_json() {
        let opts = LabOptions {
            exclude_snat_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
            randomize_snat: RandomizeSnat::HashRandom,
            ..LabOptions::iptables(3)
        };
        let json = serde_json::to_string(&opts).unwrap();
        assert!(json.contains("\"hashrandom\""), "{json}");
        assert_eq!(serde_json::from_str::<LabOptions>(&json).unwrap(), opts);
    }

    #[test]
    fn too_many_pods_and_missing_agent_are_refused() {
        assert!(matches!(
            LabOptions::iptables(MAX_PODS + 1).validate(),
            Err(LabError::TooManyPods { .. })
        ));
        assert!(LabOptions::iptables(MAX_PODS).validate().is_ok());
        let ebpf = LabOptions {
            datapath: Datapath::Ebpf,
            ..LabOptions::iptables(1)
        };
        assert!(matches!(ebpf.validate(), Err(LabError::InvalidOption(_))));
    }

    #[test]
    fn names_parse() {
        assert_eq!("iptables".parse::<Datapath>().unwrap(), Datapath::Iptables);
        assert!("nft".parse::<Datapath>().is_err());
        assert_eq!(
            "none".parse::<RandomizeSnat>().unwrap(),
            RandomizeSnat::Sequential
        );
        assert_eq!(RandomizeSnat::Prng.iptables_flag(), Some("--random-fully"));
    }
}
