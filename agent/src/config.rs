//! Configuration from the VPC CNI's environment variables, same names and
//! meanings, validated at start: a bad value stops the agent with a message
//! naming the variable and what it accepts.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use vpcnet_common::{
    addr_to_raw,
    config::{self, Config, FLAG_EXTERNAL_SNAT, RandomizeMode},
};

pub const ENV_EXTERNAL_SNAT: &str = "AWS_VPC_K8S_CNI_EXTERNALSNAT";
pub const ENV_EXCLUDE_SNAT_CIDRS: &str = "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS";
pub const ENV_RANDOMIZE_SNAT: &str = "AWS_VPC_K8S_CNI_RANDOMIZESNAT";
/// The connmark aws-node's rules use: what the take-over removes and
/// `uninstall` writes back (the datapath itself marks nothing).
pub const ENV_CONNMARK: &str = "AWS_VPC_K8S_CNI_CONNMARK";
/// vpcnet's own: the SNAT source port range, `MIN-MAX`.
pub const ENV_SNAT_PORT_RANGE: &str = "VPCNET_SNAT_PORT_RANGE";
/// vpcnet's own: the cluster's service CIDRs, whose packets go through the
/// node's stack (kube-proxy). Default: EKS's two possible service ranges.
pub const ENV_SERVICE_CIDRS: &str = "VPCNET_SERVICE_CIDRS";
pub const DEFAULT_SERVICE_CIDRS: &str = "10.100.0.0/16,172.20.0.0/16";

/// The service CIDRs from the environment.
pub fn service_cidrs_from_env() -> Result<Vec<Ipv4Net>, ConfigError> {
    service_cidrs_from_lookup(|name| std::env::var(name).ok())
}

/// The service CIDRs from `lookup` (set but empty: none).
pub fn service_cidrs_from_lookup(
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<Vec<Ipv4Net>, ConfigError> {
    let value = lookup(ENV_SERVICE_CIDRS).unwrap_or_else(|| DEFAULT_SERVICE_CIDRS.to_owned());
    parse_cidrs(ENV_SERVICE_CIDRS, &value)
}

/// Every variable the agent reads: the deployment's `ConfigMap` sets each,
/// and its documentation describes each.
pub const VARIABLES: &[&str] = &[
    ENV_EXTERNAL_SNAT,
    ENV_EXCLUDE_SNAT_CIDRS,
    ENV_RANDOMIZE_SNAT,
    ENV_CONNMARK,
    ENV_SNAT_PORT_RANGE,
    ENV_SERVICE_CIDRS,
    crate::ipam::settings::ENV_WARM_ENI_TARGET,
    crate::ipam::settings::ENV_WARM_IP_TARGET,
    crate::ipam::settings::ENV_MINIMUM_IP_TARGET,
    crate::ipam::settings::ENV_WARM_PREFIX_TARGET,
    crate::ipam::settings::ENV_ENABLE_PREFIX_DELEGATION,
    crate::ipam::settings::ENV_MAX_ENI,
    crate::ipam::settings::ENV_IP_COOLDOWN_PERIOD,
    crate::ipam::settings::ENV_CUSTOM_NETWORK_CFG,
    crate::ipam::settings::ENV_ENI_MTU,
    crate::ipam::settings::ENV_DISABLE_LEAKED_ENI_CLEANUP,
    crate::ipam::settings::ENV_BACKING_STORE,
    crate::ipam::settings::ENV_ENABLE_POD_ENI,
    crate::ipam::settings::ENV_SG_ENFORCING_MODE,
    crate::ipam::settings::ENV_CLUSTER_NAME,
    crate::ipam::settings::ENV_ENI_CONFIG_SUBNET,
    crate::ipam::settings::ENV_ENI_CONFIG_SECURITY_GROUPS,
    crate::ipam::settings::ENV_MAX_PODS,
    crate::pods::ENV_VETH_PREFIX,
    crate::introspect::ENV_DISABLE_INTROSPECTION,
    crate::introspect::ENV_INTROSPECTION_BIND_ADDRESS,
    crate::introspect::ENV_DISABLE_METRICS,
];

#[derive(Debug, thiserror::Error)]
#[error("{variable}={value:?} is invalid: {allowed}")]
pub struct ConfigError {
    pub variable: &'static str,
    pub value: String,
    pub allowed: &'static str,
}

/// The SNAT settings of the VPC CNI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnatSettings {
    pub external_snat: bool,
    pub exclude_snat_cidrs: Vec<Ipv4Net>,
    pub randomize: RandomizeMode,
    pub port_min: u16,
    pub port_max: u16,
    /// `AWS_VPC_K8S_CNI_CONNMARK`.
    pub connmark: u32,
}

impl Default for SnatSettings {
    fn default() -> Self {
        Self {
            external_snat: false,
            exclude_snat_cidrs: Vec::new(),
            randomize: RandomizeMode::Prng,
            port_min: config::DEFAULT_PORT_MIN,
            port_max: config::DEFAULT_PORT_MAX,
            connmark: vpcnet_api::vpc_cni::DEFAULT_CONNMARK,
        }
    }
}

impl SnatSettings {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the settings through `lookup` (unset variables: `None`).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let mut settings = Self::default();
        if let Some(value) = lookup(ENV_EXTERNAL_SNAT) {
            settings.external_snat = parse_bool(ENV_EXTERNAL_SNAT, &value)?;
        }
        if let Some(value) = lookup(ENV_EXCLUDE_SNAT_CIDRS) {
            settings.exclude_snat_cidrs = parse_cidrs(ENV_EXCLUDE_SNAT_CIDRS, &value)?;
        }
        if let Some(value) = lookup(ENV_RANDOMIZE_SNAT) {
            let trimmed = value.trim();
            if !trimmed.is_empty() {
                settings.randomize =
                    RandomizeMode::from_env_value(trimmed).ok_or_else(|| ConfigError {
                        variable: ENV_RANDOMIZE_SNAT,
                        value: value.clone(),
                        allowed: "one of none, hashrandom, prng",
                    })?;
            }
        }
        if let Some(value) = lookup(ENV_CONNMARK) {
            settings.connmark = parse_mark(ENV_CONNMARK, &value)?;
        }
        if let Some(value) = lookup(ENV_SNAT_PORT_RANGE) {
            (settings.port_min, settings.port_max) = parse_port_range(ENV_SNAT_PORT_RANGE, &value)?;
        }
        Ok(settings)
    }

    /// The datapath's configuration for a node whose primary address is
    /// `node_addr`.
    pub fn datapath_config(&self, node_addr: Ipv4Addr, hash_seed: u32) -> Config {
        Config {
            node_addr: addr_to_raw(node_addr.octets()),
            flags: if self.external_snat {
                FLAG_EXTERNAL_SNAT
            } else {
                0
            },
            randomize: self.randomize as u32,
            port_min: self.port_min,
            port_max: self.port_max,
            hash_seed,
            // Set when the primary ENI's entry is written.
            primary_ifindex: 0,
        }
    }
}

/// Go's `strconv.ParseBool`, which the VPC CNI uses.
pub fn parse_bool(variable: &'static str, value: &str) -> Result<bool, ConfigError> {
    match value.trim() {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" | "" => Ok(false),
        _ => Err(ConfigError {
            variable,
            value: value.to_owned(),
            allowed: "a boolean (true or false)",
        }),
    }
}

/// A comma-separated list of IPv4 CIDRs (spaces allowed, empty items skipped).
pub fn parse_cidrs(variable: &'static str, value: &str) -> Result<Vec<Ipv4Net>, ConfigError> {
    value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            item.parse::<Ipv4Net>()
                .map(|net| net.trunc())
                .map_err(|_| ConfigError {
                    variable,
                    value: value.to_owned(),
                    allowed: "a comma-separated list of IPv4 CIDRs such as 10.0.0.0/8,192.168.0.0/16",
                })
        })
        .collect()
}

/// A mark, decimal or `0x` hex (as Go's `strconv.ParseInt(v, 0, 32)` reads
/// it in the VPC CNI); not zero.
fn parse_mark(variable: &'static str, value: &str) -> Result<u32, ConfigError> {
    let value_trimmed = value.trim();
    let parsed = match value_trimmed.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16).ok(),
        None => value_trimmed.parse().ok(),
    };
    parsed.filter(|mark| *mark != 0).ok_or_else(|| ConfigError {
        variable,
        value: value.to_owned(),
        allowed: "a non-zero mark, decimal or 0x hex, e.g. 0x80",
    })
}

fn parse_port_range(variable: &'static str, value: &str) -> Result<(u16, u16), ConfigError> {
    let err = || ConfigError {
        variable,
        value: value.to_owned(),
        allowed: "MIN-MAX with 1 <= MIN <= MAX <= 65535, e.g. 1024-65535",
    };
    let (min, max) = value.trim().split_once('-').ok_or_else(err)?;
    let min: u16 = min.trim().parse().map_err(|_| err())?;
    let max: u16 = max.trim().parse().map_err(|_| err())?;
    if min == 0 || min > max {
        return Err(err());
    }
    Ok((min, max))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<SnatSettings, ConfigError> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        SnatSettings::from_lookup(|name| vars.get(name).cloned())
    }

    #[test]
    fn defaults_match_the_vpc_cni() {
        let s = settings(&[]).unwrap();
        assert!(!s.external_snat);
        assert_eq!(s.randomize, RandomizeMode::Prng);
        assert!(s.exclude_snat_cidrs.is_empty());
        assert_eq!((s.port_min, s.port_max), (1024, 65535));
    }

    #[test]
    fn reads_every_variable() {
        let s = settings(&[
            (ENV_EXTERNAL_SNAT, "True"),
            (ENV_EXCLUDE_SNAT_CIDRS, " 192.0.2.0/24, 198.51.100.7/16 ,"),
            (ENV_RANDOMIZE_SNAT, "hashrandom"),
            (ENV_SNAT_PORT_RANGE, "20000-29999"),
        ])
        .unwrap();
        assert!(s.external_snat);
        assert_eq!(
            s.exclude_snat_cidrs,
            vec![
                "192.0.2.0/24".parse().unwrap(),
                "198.51.0.0/16".parse().unwrap()
            ]
        );
        assert_eq!(s.randomize, RandomizeMode::HashRandom);
        assert_eq!((s.port_min, s.port_max), (20000, 29999));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (var, value) in [
            (ENV_EXTERNAL_SNAT, "yes"),
            (ENV_EXCLUDE_SNAT_CIDRS, "10.0.0.0/33"),
            (ENV_RANDOMIZE_SNAT, "random-fully"),
            (ENV_SNAT_PORT_RANGE, "2000-1000"),
            (ENV_SNAT_PORT_RANGE, "0-10"),
        ] {
            let err = settings(&[(var, value)]).unwrap_err();
            assert_eq!(err.variable, var);
            assert!(err.to_string().contains(var), "{err}");
        }
    }
}
