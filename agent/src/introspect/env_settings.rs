//! What `/v1/ipamd-env-settings`, `/v1/networkutils-env-settings` and
//! `/v1/eni-configs` answer. aws-node's first two are a JSON object of the
//! variables its ipamd and its network set-up read, by name, each as it
//! reads it (defaults filled in, values it cannot read replaced by the
//! default): here the same names, the same JSON types, read by the
//! modules that own them.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::views::EniConfigView;
use crate::{
    env::{ConfigError, Env},
    ipam::settings::{
        ENV_CUSTOM_NETWORK_CFG, ENV_ENABLE_SUBNET_DISCOVERY, ENV_ENI_CONFIG_SECURITY_GROUPS,
        ENV_ENI_CONFIG_SUBNET, ENV_ENI_MTU, ENV_MANAGE_ENIS_NON_SCHEDULABLE, ENV_WARM_ENI_TARGET,
        ENV_WARM_IP_TARGET, EniConfig, IpamSettings,
    },
    pods::{ENV_VETH_PREFIX, veth_prefix},
    snat::{
        ENV_CONNMARK, ENV_EXCLUDE_SNAT_CIDRS, ENV_EXTERNAL_SERVICE_CIDRS, ENV_EXTERNAL_SNAT,
        ENV_NODE_PORT_SUPPORT, ENV_RANDOMIZE_SNAT, SnatSettings,
    },
};

/// `/v1/ipamd-env-settings`: the five variables aws-node's ipamd shows.
/// `WARM_IP_TARGET` unset reads 0, as there.
#[must_use]
pub fn ipamd_env_settings(ipam: &IpamSettings) -> BTreeMap<String, Value> {
    [
        (ENV_WARM_IP_TARGET, json!(ipam.warm_ip_target)),
        (ENV_WARM_ENI_TARGET, json!(ipam.warm_eni_target)),
        (ENV_CUSTOM_NETWORK_CFG, json!(ipam.custom_network)),
        (
            ENV_MANAGE_ENIS_NON_SCHEDULABLE,
            json!(ipam.manage_enis_non_schedulable),
        ),
        (ENV_ENABLE_SUBNET_DISCOVERY, json!(ipam.subnet_discovery)),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect()
}

/// `/v1/networkutils-env-settings`: the eight variables aws-node's network
/// set-up shows. CIDR lists are `null` when empty (Go's nil slice), the
/// SNAT randomization is aws-node's number (0 `none`, 1 `hashrandom`, 2
/// `prng`: the datapath's own numbering is the same).
pub fn networkutils_env_settings(
    ipam: &IpamSettings,
    env: &Env,
) -> Result<BTreeMap<String, Value>, ConfigError> {
    let snat = SnatSettings::from_env(env)?;
    let cidrs = |list: &[ipnet::Ipv4Net]| {
        if list.is_empty() {
            Value::Null
        } else {
            json!(list.iter().map(ToString::to_string).collect::<Vec<_>>())
        }
    };
    Ok([
        (ENV_CONNMARK, json!(snat.connmark)),
        (ENV_EXCLUDE_SNAT_CIDRS, cidrs(&snat.exclude_snat_cidrs)),
        (ENV_EXTERNAL_SNAT, json!(snat.external_snat)),
        (
            ENV_EXTERNAL_SERVICE_CIDRS,
            cidrs(&snat.external_service_cidrs),
        ),
        (ENV_ENI_MTU, json!(ipam.eni_mtu)),
        (ENV_VETH_PREFIX, json!(veth_prefix(env)?)),
        (
            ENV_NODE_PORT_SUPPORT,
            json!(env.bool_or(ENV_NODE_PORT_SUPPORT, true)),
        ),
        (ENV_RANDOMIZE_SNAT, json!(snat.randomize as u32)),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect())
}

/// Where custom networking's subnet and security groups come from.
#[derive(Clone, Copy, Debug)]
pub enum EniConfigSource<'a> {
    /// The agent's variables (also when custom networking is off).
    Variables,
    /// The ENIConfig objects of the Kubernetes API: the one in force, if
    /// one was ever valid.
    Objects(Option<&'a EniConfig>),
}

/// `/v1/eni-configs`'s data: the ENIConfig custom networking uses on this
/// node.
#[must_use]
pub fn eni_config_in_force(ipam: &IpamSettings, source: EniConfigSource<'_>) -> EniConfigView {
    let (name, subnet, security_groups, source) = match source {
        EniConfigSource::Variables => (
            None,
            ipam.eni_config_subnet.clone(),
            ipam.eni_config_security_groups.clone(),
            format!("{ENV_ENI_CONFIG_SUBNET}, {ENV_ENI_CONFIG_SECURITY_GROUPS}"),
        ),
        EniConfigSource::Objects(Some(config)) => (
            config.name.clone(),
            Some(config.subnet_id.clone()),
            config.security_groups.clone(),
            config.source(),
        ),
        EniConfigSource::Objects(None) => (
            None,
            None,
            Vec::new(),
            "no valid ENIConfig yet: no ENI for pods is attached".to_owned(),
        ),
    };
    EniConfigView {
        custom_networking: ipam.custom_network,
        name,
        subnet,
        security_groups,
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(pairs: &[(&str, &str)]) -> (IpamSettings, Env) {
        let env = Env::from_pairs(pairs.iter().copied());
        (IpamSettings::from_env(&env).expect("settings"), env)
    }

    #[test]
    fn ipamd_settings_as_aws_node_shows_them() {
        let (ipam, _) = read(&[]);
        assert_eq!(
            json!(ipamd_env_settings(&ipam)),
            json!({
                "WARM_IP_TARGET": 0,
                "WARM_ENI_TARGET": 1,
                "AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG": false,
                "AWS_MANAGE_ENIS_NON_SCHEDULABLE": false,
                "ENABLE_SUBNET_DISCOVERY": true,
            })
        );
        let (ipam, _) = read(&[
            (ENV_WARM_IP_TARGET, "5"),
            (ENV_WARM_ENI_TARGET, "-1"),
            (ENV_MANAGE_ENIS_NON_SCHEDULABLE, "true"),
            (ENV_ENABLE_SUBNET_DISCOVERY, "no"),
        ]);
        let view = ipamd_env_settings(&ipam);
        assert_eq!(view[ENV_WARM_IP_TARGET], 5);
        assert_eq!(view[ENV_WARM_ENI_TARGET], 1, "negative: the default");
        assert_eq!(view[ENV_MANAGE_ENIS_NON_SCHEDULABLE], true);
        assert_eq!(
            view[ENV_ENABLE_SUBNET_DISCOVERY], true,
            "unreadable: default"
        );
    }

    #[test]
    fn network_settings_as_aws_node_shows_them() {
        let (ipam, env) = read(&[]);
        assert_eq!(
            json!(networkutils_env_settings(&ipam, &env).unwrap()),
            json!({
                "AWS_VPC_K8S_CNI_CONNMARK": 128,
                "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": null,
                "AWS_VPC_K8S_CNI_EXTERNALSNAT": false,
                "AWS_EXTERNAL_SERVICE_CIDRS": null,
                "AWS_VPC_ENI_MTU": 9001,
                "AWS_VPC_K8S_CNI_VETHPREFIX": "eni",
                "AWS_VPC_CNI_NODE_PORT_SUPPORT": true,
                "AWS_VPC_K8S_CNI_RANDOMIZESNAT": 2,
            })
        );
        let (ipam, env) = read(&[
            (ENV_CONNMARK, "0x40"),
            (ENV_EXCLUDE_SNAT_CIDRS, "10.9.0.0/16, fd00::/8,bad"),
            (ENV_EXTERNAL_SNAT, "true"),
            (ENV_RANDOMIZE_SNAT, "hashrandom"),
            (ENV_ENI_MTU, "1500"),
            (ENV_VETH_PREFIX, "vpc"),
            (ENV_NODE_PORT_SUPPORT, "false"),
        ]);
        let view = networkutils_env_settings(&ipam, &env).unwrap();
        assert_eq!(view[ENV_CONNMARK], 64);
        assert_eq!(view[ENV_EXCLUDE_SNAT_CIDRS], json!(["10.9.0.0/16"]));
        assert_eq!(view[ENV_EXTERNAL_SNAT], true);
        assert_eq!(view[ENV_RANDOMIZE_SNAT], 1);
        assert_eq!(view[ENV_ENI_MTU], 1500);
        assert_eq!(view[ENV_VETH_PREFIX], "vpc");
        assert_eq!(view[ENV_NODE_PORT_SUPPORT], false);
    }

    #[test]
    fn the_eni_config_comes_from_the_settings() {
        let (ipam, _) = read(&[
            (ENV_CUSTOM_NETWORK_CFG, "true"),
            (ENV_ENI_CONFIG_SUBNET, "subnet-0pods"),
            (ENV_ENI_CONFIG_SECURITY_GROUPS, "sg-1,sg-2"),
        ]);
        let view = eni_config_in_force(&ipam, EniConfigSource::Variables);
        assert!(view.custom_networking);
        assert_eq!(view.name, None);
        assert_eq!(view.subnet.as_deref(), Some("subnet-0pods"));
        assert_eq!(view.security_groups, ["sg-1", "sg-2"]);
    }

    #[test]
    fn the_eni_config_object_in_force_is_shown_by_name() {
        // In a pod: the ENIConfig objects are read.
        let (ipam, _) = read(&[
            (ENV_CUSTOM_NETWORK_CFG, "true"),
            (crate::k8s::ENV_SERVICE_HOST, "10.100.0.1"),
        ]);
        let config = EniConfig {
            name: Some("us-west-2a".to_owned()),
            subnet_id: "subnet-0a".to_owned(),
            security_groups: Vec::new(),
        };
        let view = eni_config_in_force(&ipam, EniConfigSource::Objects(Some(&config)));
        assert_eq!(view.name.as_deref(), Some("us-west-2a"));
        assert_eq!(view.subnet.as_deref(), Some("subnet-0a"));
        let none = eni_config_in_force(&ipam, EniConfigSource::Objects(None));
        assert_eq!((none.name, none.subnet), (None, None));
        assert!(
            none.source.contains("no valid ENIConfig"),
            "{}",
            none.source
        );
    }
}
