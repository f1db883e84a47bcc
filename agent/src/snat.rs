//! SNAT as the VPC CNI configures it: whether pods' traffic leaving the VPC
//! takes the node's address, which destinations are spared, how ports are
//! chosen, and the routing exception and connmark that go with them. The
//! variables' names and their reading; the datapath's configuration they
//! make.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use vpcnet_common::{
    addr_to_raw,
    config::{self, Config, FLAG_EXTERNAL_SNAT, RandomizeMode},
};

use crate::env::{ConfigError, Env, go_int};

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
/// aws-node's `NodePort` rules, which vpcnet needs not (a `NodePort`
/// connection's replies always leave by the primary ENI here): read only to
/// show it as aws-node does (`/v1/networkutils-env-settings`).
pub const ENV_NODE_PORT_SUPPORT: &str = "AWS_VPC_CNI_NODE_PORT_SUPPORT";

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
            exclude_snat_cidrs: env.lenient_cidrs(ENV_EXCLUDE_SNAT_CIDRS),
            external_service_cidrs: env.lenient_cidrs(ENV_EXTERNAL_SERVICE_CIDRS),
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
    }
}
