//! Configuration from the VPC CNI's environment variables, same names and
//! meanings. aws-node's own variables read as aws-node reads them (a value
//! it falls back from, vpcnet falls back from too, saying so: [`Env`]);
//! vpcnet's own stop the agent on a bad value, naming the variable and what
//! it accepts.

use std::net::Ipv4Addr;

use ipnet::{IpNet, Ipv4Net};
use vpcnet_common::{
    addr_to_raw,
    config::{self, Config, FLAG_EXTERNAL_SNAT, RandomizeMode},
};

use crate::env::Env;

pub const ENV_EXTERNAL_SNAT: &str = "AWS_VPC_K8S_CNI_EXTERNALSNAT";
pub const ENV_EXCLUDE_SNAT_CIDRS: &str = "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS";
pub const ENV_RANDOMIZE_SNAT: &str = "AWS_VPC_K8S_CNI_RANDOMIZESNAT";
/// Destinations a pod on a secondary ENI reaches by the node's route (the
/// primary ENI) instead of its own ENI, as aws-node's rule 1535
/// (`to <cidr> lookup main`) sends them: comma-separated IPv4 CIDRs.
pub const ENV_EXTERNAL_SERVICE_CIDRS: &str = "AWS_EXTERNAL_SERVICE_CIDRS";
/// The connmark aws-node's rules use: what the take-over removes and
/// `uninstall` writes back (the datapath itself marks nothing).
pub const ENV_CONNMARK: &str = "AWS_VPC_K8S_CNI_CONNMARK";
/// vpcnet's own: the SNAT source port range, `MIN-MAX`.
pub const ENV_SNAT_PORT_RANGE: &str = "VPCNET_SNAT_PORT_RANGE";
/// vpcnet's own: the cluster's service CIDRs, whose packets go through the
/// node's stack (kube-proxy). Unset or blank: the cluster's, from the
/// Kubernetes API (`crate::k8s::service_cidrs`); without an API server,
/// EKS's two possible service ranges. Set: an override of both.
pub const ENV_SERVICE_CIDRS: &str = "VPCNET_SERVICE_CIDRS";
pub const DEFAULT_SERVICE_CIDRS: &str = "10.100.0.0/16,172.20.0.0/16";

/// The service CIDRs the override names, else the defaults.
pub fn service_cidrs(env: &Env) -> Result<Vec<Ipv4Net>, ConfigError> {
    let value = env.get(ENV_SERVICE_CIDRS).unwrap_or(DEFAULT_SERVICE_CIDRS);
    parse_cidrs(ENV_SERVICE_CIDRS, value)
}

/// Every variable the agent reads: the deployment's `ConfigMap` sets each,
/// and its documentation describes each.
pub const VARIABLES: &[&str] = &[
    ENV_EXTERNAL_SNAT,
    ENV_EXCLUDE_SNAT_CIDRS,
    ENV_RANDOMIZE_SNAT,
    ENV_CONNMARK,
    ENV_EXTERNAL_SERVICE_CIDRS,
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
    crate::k8s::pods::ENV_ANNOTATE_POD_IP,
    crate::ipam::settings::ENV_CLUSTER_NAME,
    crate::ipam::settings::ENV_ADDITIONAL_ENI_TAGS,
    crate::ipam::settings::ENV_ENABLE_SUBNET_DISCOVERY,
    crate::ipam::settings::ENV_MANAGE_UNTAGGED_ENI,
    crate::ipam::settings::ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING,
    crate::ipam::settings::ENV_MANAGE_ENIS_NON_SCHEDULABLE,
    crate::k8s::node::ENV_ENI_CONFIG_LABEL_DEF,
    crate::k8s::node::ENV_ENI_CONFIG_ANNOTATION_DEF,
    crate::ipam::settings::ENV_ENI_CONFIG_SUBNET,
    crate::ipam::settings::ENV_ENI_CONFIG_SECURITY_GROUPS,
    crate::ipam::settings::ENV_MAX_PODS,
    crate::takeover::network_policy::ENV_TAKE_OVER_POLICY_NODE,
    crate::pods::ENV_VETH_PREFIX,
    crate::install::ENV_POD_MTU,
    crate::install::ENV_PLUGIN_LOG_FILE,
    crate::install::ENV_PLUGIN_LOG_LEVEL,
    crate::install::ENV_ENABLE_BANDWIDTH_PLUGIN,
    crate::install::ENV_DISABLE_POD_V6,
    crate::cloud::ENV_EC2_ENDPOINT,
    crate::cloud::ENV_HTTP_TIMEOUT,
    crate::node::ENV_DISABLE_TCP_EARLY_DEMUX,
    crate::logging::ENV_LOG_LEVEL,
    crate::logging::ENV_LOG_FILE,
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

/// The SNAT settings of the VPC CNI, and the routing exception that goes
/// with them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnatSettings {
    pub external_snat: bool,
    pub exclude_snat_cidrs: Vec<Ipv4Net>,
    /// `AWS_EXTERNAL_SERVICE_CIDRS`.
    pub external_service_cidrs: Vec<Ipv4Net>,
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
            external_service_cidrs: Vec::new(),
            randomize: RandomizeMode::Prng,
            port_min: config::DEFAULT_PORT_MIN,
            port_max: config::DEFAULT_PORT_MAX,
            connmark: vpcnet_api::vpc_cni::DEFAULT_CONNMARK,
        }
    }
}

impl SnatSettings {
    /// Reads the settings as aws-node does: an unreadable boolean, an
    /// invalid or IPv6 item of the exclusions, an unknown randomization or
    /// an unreadable mark fall back as there; the port range (vpcnet's own)
    /// must be valid.
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        let mut settings = Self {
            external_snat: env.bool_or(ENV_EXTERNAL_SNAT, false),
            exclude_snat_cidrs: lenient_cidrs(env, ENV_EXCLUDE_SNAT_CIDRS),
            external_service_cidrs: lenient_cidrs(env, ENV_EXTERNAL_SERVICE_CIDRS),
            ..Self::default()
        };
        if let Some(value) = env.get(ENV_RANDOMIZE_SNAT) {
            settings.randomize = RandomizeMode::from_env_value(value.trim()).unwrap_or_else(|| {
                env.tolerate(
                    ENV_RANDOMIZE_SNAT,
                    value,
                    "not one of none, hashrandom, prng",
                    "prng",
                );
                RandomizeMode::Prng
            });
        }
        if let Some(value) = env.get(ENV_CONNMARK) {
            settings.connmark = go_int(value.trim())
                .and_then(|mark| u32::try_from(mark).ok())
                .filter(|mark| *mark != 0)
                .unwrap_or_else(|| {
                    env.tolerate(
                        ENV_CONNMARK,
                        value,
                        "not a mark from 1 to 2^32-1",
                        format_args!("{:#x}", vpcnet_api::vpc_cni::DEFAULT_CONNMARK),
                    );
                    vpcnet_api::vpc_cni::DEFAULT_CONNMARK
                });
        }
        if let Some(value) = env.get(ENV_SNAT_PORT_RANGE) {
            (settings.port_min, settings.port_max) = parse_port_range(ENV_SNAT_PORT_RANGE, value)?;
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

/// aws-node's CIDR lists: each item an IPv4 CIDR; an invalid or IPv6 item
/// is left out, tolerated.
fn lenient_cidrs(env: &Env, variable: &'static str) -> Vec<Ipv4Net> {
    let Some(value) = env.get(variable) else {
        return Vec::new();
    };
    let mut cidrs = Vec::new();
    for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item.parse::<IpNet>() {
            Ok(IpNet::V4(net)) => cidrs.push(net.trunc()),
            Ok(IpNet::V6(_)) => env.tolerate(variable, item, "an IPv6 CIDR", "the list without it"),
            Err(_) => env.tolerate(variable, item, "not a CIDR", "the list without it"),
        }
    }
    cidrs
}

/// Go's `strconv.ParseInt(v, 0, 64)`: decimal, `0x` hex, `0o` or leading-0
/// octal, `0b` binary, `_` between digits, an optional sign.
fn go_int(value: &str) -> Option<i64> {
    let (negative, digits) = match value.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, value.strip_prefix('+').unwrap_or(value)),
    };
    let lower = digits.to_ascii_lowercase();
    let (radix, body) = if let Some(hex) = lower.strip_prefix("0x") {
        (16, hex)
    } else if let Some(octal) = lower.strip_prefix("0o") {
        (8, octal)
    } else if let Some(binary) = lower.strip_prefix("0b") {
        (2, binary)
    } else if lower.len() > 1 && lower.starts_with('0') {
        (8, &lower[1..])
    } else {
        (10, lower.as_str())
    };
    // Underscores only between digits (and after a base prefix).
    if body.is_empty() || body.ends_with('_') || body.contains("__") {
        return None;
    }
    if body.starts_with('_') && radix == 10 {
        return None;
    }
    let magnitude = i64::from_str_radix(&body.replace('_', ""), radix).ok()?;
    Some(if negative { -magnitude } else { magnitude })
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
    use super::*;

    fn settings(vars: &[(&str, &str)]) -> (Result<SnatSettings, ConfigError>, Env) {
        let env = Env::from_pairs(vars.iter().copied());
        (SnatSettings::from_env(&env), env)
    }

    #[test]
    fn defaults_match_the_vpc_cni() {
        let s = settings(&[]).0.unwrap();
        assert!(!s.external_snat);
        assert_eq!(s.randomize, RandomizeMode::Prng);
        assert!(s.exclude_snat_cidrs.is_empty());
        assert!(s.external_service_cidrs.is_empty());
        assert_eq!((s.port_min, s.port_max), (1024, 65535));
        assert_eq!(s.connmark, 0x80);
    }

    #[test]
    fn reads_every_variable() {
        let s = settings(&[
            (ENV_EXTERNAL_SNAT, "True"),
            (ENV_EXCLUDE_SNAT_CIDRS, " 192.0.2.0/24, 198.51.100.7/16 ,"),
            (ENV_RANDOMIZE_SNAT, "hashrandom"),
            (ENV_SNAT_PORT_RANGE, "20000-29999"),
            (ENV_CONNMARK, "0x100"),
            (ENV_EXTERNAL_SERVICE_CIDRS, "203.0.113.0/24, 192.0.2.7/24"),
        ])
        .0
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
        assert_eq!(s.connmark, 0x100);
        assert_eq!(
            s.external_service_cidrs,
            vec![
                "203.0.113.0/24".parse().unwrap(),
                "192.0.2.0/24".parse().unwrap()
            ]
        );
    }

    #[test]
    fn marks_read_as_go_reads_integers() {
        for (value, mark) in [
            ("0x80", 0x80),
            ("0200", 0x80),
            ("0o200", 0x80),
            ("0b1000_0000", 0x80),
            ("128", 0x80),
            ("0X4000", 0x4000),
            ("16_384", 0x4000),
        ] {
            let (s, env) = settings(&[(ENV_CONNMARK, value)]);
            assert_eq!(s.unwrap().connmark, mark, "{value}");
            assert!(env.tolerated().is_empty(), "{value}");
        }
    }

    #[test]
    fn values_aws_node_tolerates_fall_back_as_there() {
        let (s, env) = settings(&[
            (ENV_EXTERNAL_SNAT, "yes"),
            (ENV_EXCLUDE_SNAT_CIDRS, "10.0.0.0/33,fd00::/8,192.0.2.0/24"),
            (ENV_RANDOMIZE_SNAT, "random-fully"),
            (ENV_CONNMARK, "-1"),
            (ENV_EXTERNAL_SERVICE_CIDRS, "fd00::/8,203.0.113.0/24,bogus"),
        ]);
        let s = s.unwrap();
        assert!(!s.external_snat);
        assert_eq!(s.exclude_snat_cidrs, ["192.0.2.0/24".parse().unwrap()]);
        assert_eq!(s.randomize, RandomizeMode::Prng);
        assert_eq!(s.connmark, 0x80);
        assert_eq!(
            s.external_service_cidrs,
            ["203.0.113.0/24".parse().unwrap()]
        );
        let said: Vec<String> = env.tolerated().iter().map(ToString::to_string).collect();
        assert_eq!(
            said,
            [
                r#"AWS_VPC_K8S_CNI_EXTERNALSNAT="yes": not a boolean; using false, as aws-node does"#,
                r#"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS="10.0.0.0/33": not a CIDR; using the list without it, as aws-node does"#,
                r#"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS="fd00::/8": an IPv6 CIDR; using the list without it, as aws-node does"#,
                r#"AWS_EXTERNAL_SERVICE_CIDRS="fd00::/8": an IPv6 CIDR; using the list without it, as aws-node does"#,
                r#"AWS_EXTERNAL_SERVICE_CIDRS="bogus": not a CIDR; using the list without it, as aws-node does"#,
                r#"AWS_VPC_K8S_CNI_RANDOMIZESNAT="random-fully": not one of none, hashrandom, prng; using prng, as aws-node does"#,
                r#"AWS_VPC_K8S_CNI_CONNMARK="-1": not a mark from 1 to 2^32-1; using 0x80, as aws-node does"#,
            ]
        );
    }

    #[test]
    fn vpcnets_own_variables_stop_on_a_bad_value() {
        for value in ["2000-1000", "0-10", "many"] {
            let err = settings(&[(ENV_SNAT_PORT_RANGE, value)]).0.unwrap_err();
            assert_eq!(err.variable, ENV_SNAT_PORT_RANGE);
            assert!(err.to_string().contains(value), "{err}");
        }
        let env = Env::from_pairs([(ENV_SERVICE_CIDRS, "10.100.0.0/16,nowhere")]);
        assert_eq!(service_cidrs(&env).unwrap_err().variable, ENV_SERVICE_CIDRS);
    }
}
