//! Every variable aws-node v1.23 reads (its init container, its entrypoint,
//! ipamd, and what its entrypoint hands the plugin in the conflist), and
//! vpcnet's answer to each: honoured with aws-node's meaning by the module
//! that owns the name, refused for a value vpcnet cannot serve, or accepted
//! with one warning saying why it has no effect here. `deploy/README.md`
//! prints this table; a test keeps the two the same.

use std::fmt::Write as _;

use crate::{
    cloud, env::Env, install, introspect, ipam::settings as ipam_settings, k8s, logging, node,
    pods, policy::settings as policy_settings, snat,
};

/// vpcnet's answer to one of aws-node's variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Read with aws-node's meaning, by the module that owns the name.
    Honoured,
    /// A boolean whose value `when` vpcnet cannot serve: the agent stops
    /// at start, saying why. Unset or blank reads as `default`.
    Refused {
        when: bool,
        default: bool,
        reason: &'static str,
    },
    /// Accepted; set, it has no effect here, for `reason` (one warning at
    /// start).
    NoEffect { reason: &'static str },
}

/// One of aws-node's variables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variable {
    pub name: &'static str,
    pub answer: Answer,
}

pub const ENV_ENABLE_IPV4: &str = "ENABLE_IPv4";
pub const ENV_ENABLE_IPV6: &str = "ENABLE_IPv6";
pub const ENV_ENABLE_V4_EGRESS: &str = "ENABLE_V4_EGRESS";
pub const ENV_ENABLE_V6_EGRESS: &str = "ENABLE_V6_EGRESS";
pub const ENV_ENABLE_MULTI_NIC: &str = "ENABLE_MULTI_NIC";
pub const ENV_ENABLE_IMDS_ONLY_MODE: &str = "ENABLE_IMDS_ONLY_MODE";
pub const ENV_EGRESS_V4_PLUGIN_LOG_FILE: &str = "AWS_VPC_K8S_EGRESS_V4_PLUGIN_LOG_FILE";
pub const ENV_EGRESS_V6_PLUGIN_LOG_FILE: &str = "AWS_VPC_K8S_EGRESS_V6_PLUGIN_LOG_FILE";
pub const ENV_HOST_CNI_BIN_PATH: &str = "HOST_CNI_BIN_PATH";
pub const ENV_HOST_CNI_CONFDIR_PATH: &str = "HOST_CNI_CONFDIR_PATH";
pub const ENV_VPC_CNI_VERSION: &str = "VPC_CNI_VERSION";
pub const ENV_ENABLE_NFTABLES: &str = "ENABLE_NFTABLES";
pub const ENV_CONFIGURE_RPFILTER: &str = "AWS_VPC_K8S_CNI_CONFIGURE_RPFILTER";

const fn honoured(name: &'static str) -> Variable {
    Variable {
        name,
        answer: Answer::Honoured,
    }
}

const fn refused(name: &'static str, when: bool, default: bool, reason: &'static str) -> Variable {
    Variable {
        name,
        answer: Answer::Refused {
            when,
            default,
            reason,
        },
    }
}

const fn no_effect(name: &'static str, reason: &'static str) -> Variable {
    Variable {
        name,
        answer: Answer::NoEffect { reason },
    }
}

/// The table, in aws-node's groups: SNAT and routing, addresses and ENIs,
/// the plugin's conflist, the node's set-up, logs and endpoints, the
/// cluster.
pub const VARIABLES: &[Variable] = &[
    honoured(snat::ENV_EXTERNAL_SNAT),
    honoured(snat::ENV_EXCLUDE_SNAT_CIDRS),
    honoured(snat::ENV_RANDOMIZE_SNAT),
    honoured(snat::ENV_CONNMARK),
    honoured(snat::ENV_EXTERNAL_SERVICE_CIDRS),
    no_effect(
        snat::ENV_NODE_PORT_SUPPORT,
        "a NodePort connection's replies always go back through the node's stack and leave by the primary ENI, as this variable's rules make them in aws-node",
    ),
    refused(
        ENV_ENABLE_IPV4,
        false,
        true,
        "vpcnet serves IPv4 clusters only, for now",
    ),
    refused(
        ENV_ENABLE_IPV6,
        true,
        false,
        "vpcnet serves IPv4 clusters only, for now",
    ),
    refused(
        ENV_ENABLE_V6_EGRESS,
        true,
        false,
        "vpcnet gives IPv4 pods no IPv6 egress (aws-node's egress-cni plugin)",
    ),
    no_effect(
        ENV_ENABLE_V4_EGRESS,
        "IPv4 egress for IPv6 pods: vpcnet serves no IPv6 cluster",
    ),
    honoured(ipam_settings::ENV_WARM_ENI_TARGET),
    honoured(ipam_settings::ENV_WARM_IP_TARGET),
    honoured(ipam_settings::ENV_MINIMUM_IP_TARGET),
    honoured(ipam_settings::ENV_WARM_PREFIX_TARGET),
    honoured(ipam_settings::ENV_ENABLE_PREFIX_DELEGATION),
    honoured(ipam_settings::ENV_MAX_ENI),
    honoured(ipam_settings::ENV_IP_COOLDOWN_PERIOD),
    honoured(ipam_settings::ENV_CUSTOM_NETWORK_CFG),
    honoured(ipam_settings::ENV_ENI_MTU),
    honoured(ipam_settings::ENV_DISABLE_LEAKED_ENI_CLEANUP),
    honoured(ipam_settings::ENV_BACKING_STORE),
    honoured(ipam_settings::ENV_ENABLE_POD_ENI),
    honoured(ipam_settings::ENV_SG_ENFORCING_MODE),
    honoured(ipam_settings::ENV_CLUSTER_NAME),
    honoured(cloud::ENV_EC2_ENDPOINT),
    honoured(cloud::ENV_HTTP_TIMEOUT),
    honoured(ipam_settings::ENV_ENABLE_SUBNET_DISCOVERY),
    honoured(ipam_settings::ENV_MANAGE_UNTAGGED_ENI),
    honoured(ipam_settings::ENV_ADDITIONAL_ENI_TAGS),
    honoured(ipam_settings::ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING),
    honoured(ipam_settings::ENV_MANAGE_ENIS_NON_SCHEDULABLE),
    refused(
        ENV_ENABLE_MULTI_NIC,
        true,
        false,
        "vpcnet manages the ENIs of network card 0 only",
    ),
    refused(
        ENV_ENABLE_IMDS_ONLY_MODE,
        true,
        false,
        "vpcnet reads its ENIs from EC2; IMDS-only mode is not served",
    ),
    honoured(pods::ENV_VETH_PREFIX),
    honoured(install::ENV_POD_MTU),
    honoured(install::ENV_PLUGIN_LOG_FILE),
    honoured(install::ENV_PLUGIN_LOG_LEVEL),
    honoured(install::ENV_ENABLE_BANDWIDTH_PLUGIN),
    honoured(install::ENV_DISABLE_POD_V6),
    no_effect(
        ENV_EGRESS_V4_PLUGIN_LOG_FILE,
        "the log of aws-node's egress-cni plugin, which vpcnet does not chain",
    ),
    no_effect(
        ENV_EGRESS_V6_PLUGIN_LOG_FILE,
        "the log of aws-node's egress-cni plugin, which vpcnet does not chain",
    ),
    no_effect(
        ENV_HOST_CNI_BIN_PATH,
        "vpcnet's init container installs the plugin where its DaemonSet mounts it (install-plugins --to)",
    ),
    no_effect(
        ENV_HOST_CNI_CONFDIR_PATH,
        "vpcnet writes its conflist where its DaemonSet says (run --cni-conf-dir)",
    ),
    honoured(node::ENV_DISABLE_TCP_EARLY_DEMUX),
    no_effect(
        ENV_CONFIGURE_RPFILTER,
        "aws-node v1.23 reads it no more: the primary interface's rp_filter is always set to 2",
    ),
    no_effect(
        ENV_ENABLE_NFTABLES,
        "aws-node v1.23 reads it no more; vpcnet's datapath needs neither iptables nor nftables",
    ),
    honoured(logging::ENV_LOG_LEVEL),
    honoured(logging::ENV_LOG_FILE),
    honoured(introspect::ENV_DISABLE_INTROSPECTION),
    honoured(introspect::ENV_INTROSPECTION_BIND_ADDRESS),
    honoured(introspect::ENV_DISABLE_METRICS),
    no_effect(
        ENV_VPC_CNI_VERSION,
        "aws-node's own version, for its user agent; vpcnet sends its own",
    ),
    honoured(policy_settings::ENV_NETWORK_POLICY_ENFORCING_MODE),
    honoured(k8s::pods::ENV_ANNOTATE_POD_IP),
    honoured(k8s::node::ENV_ENI_CONFIG_LABEL_DEF),
    honoured(k8s::node::ENV_ENI_CONFIG_ANNOTATION_DEF),
    honoured(k8s::ENV_MY_NODE_NAME),
    honoured(k8s::ENV_MY_POD_NAME),
    honoured(k8s::ENV_CLUSTER_ENDPOINT),
];

/// A value of one of aws-node's variables vpcnet cannot serve.
#[derive(Debug, thiserror::Error)]
#[error("{variable}={value:?} is not served: {reason}")]
pub struct Refusal {
    pub variable: &'static str,
    pub value: String,
    pub reason: &'static str,
}

/// What the table says of `env`: the first refusal, or one warning per
/// variable set that has no effect here.
pub fn check(env: &Env) -> Result<Vec<String>, Refusal> {
    let mut warnings = Vec::new();
    for variable in VARIABLES {
        match variable.answer {
            Answer::Honoured => {}
            Answer::Refused {
                when,
                default,
                reason,
            } => {
                if env.bool_or(variable.name, default) == when {
                    return Err(Refusal {
                        variable: variable.name,
                        value: env.raw(variable.name).unwrap_or_default().to_owned(),
                        reason,
                    });
                }
            }
            Answer::NoEffect { reason } => {
                if let Some(value) = env.raw(variable.name) {
                    warnings.push(format!(
                        "{}={value:?} has no effect in vpcnet: {reason}",
                        variable.name
                    ));
                }
            }
        }
    }
    Ok(warnings)
}

/// The table as `deploy/README.md` prints it (Markdown).
#[must_use]
pub fn markdown_table() -> String {
    let mut table = String::from("| variable | in vpcnet |\n| --- | --- |\n");
    for variable in VARIABLES {
        let answer = match variable.answer {
            Answer::Honoured => "honoured, as aws-node reads it".to_owned(),
            Answer::Refused { when, reason, .. } => {
                format!("`{when}` is refused: {reason}")
            }
            Answer::NoEffect { reason } => format!("accepted, no effect: {reason}"),
        };
        let _ = writeln!(table, "| `{}` | {answer} |", variable.name);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variable_is_answered_once() {
        let mut names: Vec<&str> = VARIABLES.iter().map(|v| v.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(names.len(), before, "a variable answered twice");
    }

    #[test]
    fn every_honoured_variable_is_one_the_agent_reads() {
        for variable in VARIABLES {
            if variable.answer == Answer::Honoured {
                assert!(
                    crate::settings::VARIABLES.contains(&variable.name)
                        || k8s::VARIABLES.contains(&variable.name),
                    "{} is honoured but not in settings::VARIABLES or k8s::VARIABLES",
                    variable.name
                );
            }
        }
    }

    #[test]
    fn an_ipv6_cluster_is_refused_by_name() {
        let env = Env::from_pairs([(ENV_ENABLE_IPV6, "true"), (ENV_ENABLE_IPV4, "false")]);
        let refusal = check(&env).unwrap_err();
        assert_eq!(refusal.variable, ENV_ENABLE_IPV4);
        let env = Env::from_pairs([(ENV_ENABLE_IPV6, "true")]);
        let refusal = check(&env).unwrap_err();
        assert_eq!(refusal.variable, ENV_ENABLE_IPV6);
        assert!(
            refusal.to_string().contains("IPv4 clusters only"),
            "{refusal}"
        );
    }

    #[test]
    fn the_charts_defaults_start_with_a_warning_per_variable_without_effect() {
        let env = Env::from_pairs([
            (ENV_ENABLE_IPV4, "true"),
            (ENV_ENABLE_IPV6, "false"),
            (ENV_VPC_CNI_VERSION, "v1.23.1"),
            (
                policy_settings::ENV_NETWORK_POLICY_ENFORCING_MODE,
                "standard",
            ),
        ]);
        let warnings = check(&env).unwrap();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("VPC_CNI_VERSION=\"v1.23.1\" has no effect"));
    }
}
