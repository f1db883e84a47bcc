//! SNAT as the VPC CNI configures it: whether pods' traffic leaving the VPC
//! takes the node's address, which destinations are spared, how ports are
//! chosen, and the routing exception and connmark that go with them. The
//! variables' names and their reading; the datapath's configuration they
//! make.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use vpcnet_api::iptables_marks::{MarkUse, overlapping};
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
/// vpcnet's own: the skb mark bit of a packet its programs decided, and
/// the one of a pod's packet to a service (see `vpcnet_common::config`),
/// each one bit; set them where the node's other rules use the defaults.
pub const ENV_MARK_DECIDED: &str = "VPCNET_MARK_DECIDED";
pub const ENV_MARK_VIA_SERVICE: &str = "VPCNET_MARK_VIA_SERVICE";
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
    /// `VPCNET_MARK_DECIDED`, `VPCNET_MARK_VIA_SERVICE`.
    pub mark_decided: u32,
    pub mark_via_service: u32,
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
            mark_decided: config::MARK_DECIDED,
            mark_via_service: config::MARK_VIA_SERVICE,
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
        if let Some(value) = env.get(ENV_MARK_DECIDED) {
            settings.mark_decided = parse_mark_bit(ENV_MARK_DECIDED, value)?;
        }
        if let Some(value) = env.get(ENV_MARK_VIA_SERVICE) {
            settings.mark_via_service = parse_mark_bit(ENV_MARK_VIA_SERVICE, value)?;
        }
        if settings.mark_decided == settings.mark_via_service {
            return Err(ConfigError {
                variable: ENV_MARK_VIA_SERVICE,
                value: format!("{:#x}", settings.mark_via_service),
                allowed: "a bit other than VPCNET_MARK_DECIDED's",
            });
        }
        Ok(settings)
    }

    /// vpcnet's mark bits.
    #[must_use]
    pub const fn mark_bits(&self) -> u32 {
        self.mark_decided | self.mark_via_service
    }

    /// Refuses mark bits another component's rules use (`uses`: the
    /// node's iptables rules that touch marks), naming whose each rule is.
    ///
    /// # Errors
    /// A rule sets, clears or tests one of vpcnet's bits.
    pub fn check_node_marks(&self, uses: &[MarkUse]) -> Result<(), MarkOverlap> {
        let mut overlaps = Vec::new();
        for (variable, bit) in [
            (ENV_MARK_DECIDED, self.mark_decided),
            (ENV_MARK_VIA_SERVICE, self.mark_via_service),
        ] {
            for rule in overlapping(uses, bit) {
                overlaps.push(format!(
                    "{variable}={bit:#x} is a bit {}'s rule uses: {}",
                    rule.owner, rule.rule
                ));
            }
        }
        if overlaps.is_empty() {
            Ok(())
        } else {
            Err(MarkOverlap(overlaps))
        }
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
            mark_decided_bit: self.mark_decided,
            mark_via_service_bit: self.mark_via_service,
        }
    }
}

/// vpcnet's mark bits meet the node's other rules.
#[derive(Debug, thiserror::Error)]
#[error(
    "vpcnet's mark bits are used by the node's other rules; set VPCNET_MARK_DECIDED and VPCNET_MARK_VIA_SERVICE to bits no rule uses:\n{}",
    .0.join("\n")
)]
pub struct MarkOverlap(pub Vec<String>);

/// One mark bit, as `go_int` reads numbers (`0x200000`, `2097152`).
fn parse_mark_bit(variable: &'static str, value: &str) -> Result<u32, ConfigError> {
    go_int(value.trim())
        .and_then(|mark| u32::try_from(mark).ok())
        .filter(|mark| mark.is_power_of_two())
        .ok_or_else(|| ConfigError {
            variable,
            value: value.to_owned(),
            allowed: "one mark bit, e.g. 0x200000",
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

    #[test]
    fn vpcnet_mark_bits_are_single_distinct_bits() {
        let s = settings(&[]).0.unwrap();
        assert_eq!(
            (s.mark_decided, s.mark_via_service),
            (config::MARK_DECIDED, config::MARK_VIA_SERVICE)
        );
        let s = settings(&[(ENV_MARK_DECIDED, "0x1000"), (ENV_MARK_VIA_SERVICE, "8192")])
            .0
            .unwrap();
        assert_eq!((s.mark_decided, s.mark_via_service), (0x1000, 0x2000));
        let config = s.datapath_config(Ipv4Addr::new(10, 0, 0, 1), 7);
        assert_eq!(
            (config.mark_decided(), config.mark_via_service()),
            (0x1000, 0x2000)
        );
        for (variable, value) in [
            (ENV_MARK_DECIDED, "0x3000"),
            (ENV_MARK_DECIDED, "0"),
            (ENV_MARK_VIA_SERVICE, "lots"),
            (ENV_MARK_VIA_SERVICE, "0x200000"),
        ] {
            let err = settings(&[(variable, value)]).0.unwrap_err();
            assert_eq!(err.variable, variable, "{value}: {err}");
        }
    }

    #[test]
    fn mark_bits_another_components_rules_use_are_refused_by_name() {
        let calico = vpcnet_api::iptables_marks::mark_uses(
            "-A cali-fw-eni1 -m comment --comment \"cali:x\" -j MARK --set-xmark 0x0/0xffff0000\n\
             -A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000\n",
        );
        let defaults = settings(&[]).0.unwrap();
        let err = defaults.check_node_marks(&calico).unwrap_err();
        let said = err.to_string();
        assert!(
            said.contains("VPCNET_MARK_DECIDED=0x200000 is a bit Calico's rule uses"),
            "{said}"
        );
        assert!(said.contains("VPCNET_MARK_VIA_SERVICE=0x400000"), "{said}");
        let moved = settings(&[
            (ENV_MARK_DECIDED, "0x1000"),
            (ENV_MARK_VIA_SERVICE, "0x2000"),
        ])
        .0
        .unwrap();
        moved.check_node_marks(&calico).unwrap();
        let on_kube_proxy = settings(&[(ENV_MARK_DECIDED, "0x4000")]).0.unwrap();
        let said = on_kube_proxy
            .check_node_marks(&calico)
            .unwrap_err()
            .to_string();
        assert!(said.contains("kube-proxy"), "{said}");
    }
}
