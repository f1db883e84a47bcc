//! The address manager's configuration: the VPC CNI's variable names,
//! defaults and readings. Where aws-node falls back to the default on a
//! value it cannot read, so does vpcnet, saying so at start ([`Env`]);
//! where aws-node's entrypoint stops (an MTU out of range, a bad cooldown,
//! a bad enforcing mode with `ENABLE_POD_ENI`), vpcnet stops too.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use vpcnet_api::layout::EnforcingMode;

use super::pool::PoolTargets;
use crate::env::{ConfigError, Env};

pub const ENV_WARM_ENI_TARGET: &str = "WARM_ENI_TARGET";
pub const ENV_WARM_IP_TARGET: &str = "WARM_IP_TARGET";
pub const ENV_MINIMUM_IP_TARGET: &str = "MINIMUM_IP_TARGET";
pub const ENV_WARM_PREFIX_TARGET: &str = "WARM_PREFIX_TARGET";
pub const ENV_ENABLE_PREFIX_DELEGATION: &str = "ENABLE_PREFIX_DELEGATION";
pub const ENV_MAX_ENI: &str = "MAX_ENI";
pub const ENV_IP_COOLDOWN_PERIOD: &str = "IP_COOLDOWN_PERIOD";
pub const ENV_CUSTOM_NETWORK_CFG: &str = "AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG";
pub const ENV_ENI_MTU: &str = "AWS_VPC_ENI_MTU";
pub const ENV_DISABLE_LEAKED_ENI_CLEANUP: &str = "DISABLE_LEAKED_ENI_CLEANUP";
pub const ENV_BACKING_STORE: &str = "AWS_VPC_K8S_CNI_BACKING_STORE";
pub const ENV_ENABLE_POD_ENI: &str = "ENABLE_POD_ENI";
pub const ENV_SG_ENFORCING_MODE: &str = "POD_SECURITY_GROUP_ENFORCING_MODE";
pub const ENV_CLUSTER_NAME: &str = "CLUSTER_NAME";
/// The operator's tags for every ENI the agent manages: a JSON object of
/// strings.
pub const ENV_ADDITIONAL_ENI_TAGS: &str = "ADDITIONAL_ENI_TAGS";
/// New ENIs go to the subnets of the node's VPC and zone tagged for
/// pods (`kubernetes.io/role/cni`), the one with most free addresses first
/// (without custom networking); an ENI in a subnet tagged `0` serves no pod.
pub const ENV_ENABLE_SUBNET_DISCOVERY: &str = "ENABLE_SUBNET_DISCOVERY";
/// Whether an attached ENI that carries neither this instance's
/// `node.k8s.amazonaws.com/instance_id` tag nor `no_manage` is the pool's.
pub const ENV_MANAGE_UNTAGGED_ENI: &str = "MANAGE_UNTAGGED_ENI";
/// `true`: the agent makes no ENI, assigns and releases no address or
/// prefix, tags nothing; it serves pods from what others attach and assign.
pub const ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING: &str = "DISABLE_NETWORK_RESOURCE_PROVISIONING";
/// `true`: the pool is managed on a cordoned node too; unset or false: while
/// the Node is tainted `node.kubernetes.io/unschedulable:NoSchedule`, no ENI
/// is attached or freed and no address or prefix assigned.
pub const ENV_MANAGE_ENIS_NON_SCHEDULABLE: &str = "AWS_MANAGE_ENIS_NON_SCHEDULABLE";
/// What no additional tag key may contain: aws-node's own keys.
const RESERVED_TAG_PART: &str = "k8s.amazonaws.com";
/// Custom networking's subnet for new ENIs instead of the node's
/// ENIConfig's `spec.subnet` (`crate::k8s::eni_config`); without an API
/// server, the subnet custom networking needs.
pub const ENV_ENI_CONFIG_SUBNET: &str = "VPCNET_ENI_CONFIG_SUBNET";
/// Custom networking's security groups for new ENIs with
/// [`ENV_ENI_CONFIG_SUBNET`], comma-separated (an ENIConfig's
/// `spec.securityGroups`); unset: the primary ENI's.
pub const ENV_ENI_CONFIG_SECURITY_GROUPS: &str = "VPCNET_ENI_CONFIG_SECURITY_GROUPS";
/// The kubelet's max pods for this node; unset: computed from the instance
/// type as the EKS max-pods calculator does.
pub const ENV_MAX_PODS: &str = "VPCNET_MAX_PODS";

/// aws-node's checkpoint, which vpcnet reads and writes in its format.
pub const DEFAULT_BACKING_STORE: &str = "/var/run/aws-node/ipam.json";
pub const DEFAULT_ENI_MTU: u32 = 9001;
/// The MTUs the VPC CNI accepts for ENIs.
pub const ENI_MTU_RANGE: std::ops::RangeInclusive<u32> = 576..=9001;

/// Custom networking's subnet and security groups for new ENIs: an
/// ENIConfig's, or those [`ENV_ENI_CONFIG_SUBNET`] names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EniConfig {
    /// The ENIConfig object's name; `None` when from the variables.
    pub name: Option<String>,
    pub subnet_id: String,
    /// Empty: the primary ENI's.
    pub security_groups: Vec<String>,
}

impl EniConfig {
    /// Where it comes from, for the log (`ENIConfig us-west-2a`).
    #[must_use]
    pub fn source(&self) -> String {
        self.name.as_ref().map_or_else(
            || ENV_ENI_CONFIG_SUBNET.to_owned(),
            |name| format!("ENIConfig {name}"),
        )
    }
}

/// One field per VPC CNI variable (hence the booleans).
#[allow(clippy::struct_excessive_bools)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpamSettings {
    pub warm_eni_target: usize,
    /// 0: not set.
    pub warm_ip_target: usize,
    /// 0: not set.
    pub minimum_ip_target: usize,
    pub warm_prefix_target: usize,
    pub prefix_delegation: bool,
    /// `None`: the instance type's limit.
    pub max_eni: Option<usize>,
    /// How long a released address rests before another pod gets it.
    pub ip_cooldown: Duration,
    pub custom_network: bool,
    pub eni_mtu: u32,
    pub leaked_eni_cleanup: bool,
    pub backing_store: PathBuf,
    pub pod_eni: bool,
    pub sg_enforcing_mode: EnforcingMode,
    pub cluster_name: Option<String>,
    /// `ADDITIONAL_ENI_TAGS`.
    pub additional_eni_tags: BTreeMap<String, String>,
    /// `ENABLE_SUBNET_DISCOVERY`.
    pub subnet_discovery: bool,
    /// `MANAGE_UNTAGGED_ENI`.
    pub manage_untagged_eni: bool,
    /// Not `DISABLE_NETWORK_RESOURCE_PROVISIONING`: the agent creates,
    /// frees and tags ENIs and assigns and releases addresses.
    pub provisioning: bool,
    /// `AWS_MANAGE_ENIS_NON_SCHEDULABLE`.
    pub manage_enis_non_schedulable: bool,
    /// Custom networking: the subnet and security groups of new ENIs.
    pub eni_config_subnet: Option<String>,
    pub eni_config_security_groups: Vec<String>,
    /// `None`: from the instance type.
    pub max_pods: Option<usize>,
}

impl Default for IpamSettings {
    fn default() -> Self {
        Self {
            warm_eni_target: 1,
            warm_ip_target: 0,
            minimum_ip_target: 0,
            warm_prefix_target: 0,
            prefix_delegation: false,
            max_eni: None,
            ip_cooldown: Duration::from_secs(30),
            custom_network: false,
            eni_mtu: DEFAULT_ENI_MTU,
            leaked_eni_cleanup: true,
            backing_store: PathBuf::from(DEFAULT_BACKING_STORE),
            pod_eni: false,
            sg_enforcing_mode: EnforcingMode::Strict,
            cluster_name: None,
            additional_eni_tags: BTreeMap::new(),
            subnet_discovery: true,
            manage_untagged_eni: true,
            provisioning: true,
            manage_enis_non_schedulable: false,
            eni_config_subnet: None,
            eni_config_security_groups: Vec::new(),
            max_pods: None,
        }
    }
}

fn count(variable: &'static str, value: &str) -> Result<usize, ConfigError> {
    value.trim().parse().map_err(|_| ConfigError {
        variable,
        value: value.to_owned(),
        allowed: "a whole number, 0 or more",
    })
}

/// `ADDITIONAL_ENI_TAGS` as aws-node reads it: a JSON object of strings,
/// all of it ignored when it is not one; a key naming aws-node's own
/// (containing `k8s.amazonaws.com`) left out.
fn additional_eni_tags(env: &Env) -> BTreeMap<String, String> {
    let Some(value) = env.get(ENV_ADDITIONAL_ENI_TAGS) else {
        return BTreeMap::new();
    };
    let Ok(tags) = serde_json::from_str::<BTreeMap<String, String>>(value) else {
        env.tolerate(
            ENV_ADDITIONAL_ENI_TAGS,
            value,
            "not a JSON object of strings",
            "no additional tag",
        );
        return BTreeMap::new();
    };
    tags.into_iter()
        .filter(|(key, _)| {
            let reserved = key.contains(RESERVED_TAG_PART);
            if reserved {
                env.tolerate(
                    ENV_ADDITIONAL_ENI_TAGS,
                    key,
                    "a key of aws-node's own",
                    "the tags without it",
                );
            }
            !reserved
        })
        .collect()
}

/// An MTU in [`ENI_MTU_RANGE`]: aws-node's entrypoint stops on any other.
pub fn parse_mtu(variable: &'static str, value: &str) -> Result<u32, ConfigError> {
    value
        .trim()
        .parse()
        .ok()
        .filter(|mtu| ENI_MTU_RANGE.contains(mtu))
        .ok_or_else(|| ConfigError {
            variable,
            value: value.to_owned(),
            allowed: "an MTU from 576 to 9001",
        })
}

impl IpamSettings {
    /// Reads the settings from `env` (blank values count as unset, as
    /// aws-node's manifests often leave them).
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        let defaults = Self::default();
        let mut s = Self {
            warm_eni_target: env.count_or(ENV_WARM_ENI_TARGET, defaults.warm_eni_target),
            warm_ip_target: env.count_or(ENV_WARM_IP_TARGET, 0),
            minimum_ip_target: env.count_or(ENV_MINIMUM_IP_TARGET, 0),
            warm_prefix_target: env.count_or(ENV_WARM_PREFIX_TARGET, 0),
            prefix_delegation: env.bool_or(ENV_ENABLE_PREFIX_DELEGATION, false),
            custom_network: env.bool_or(ENV_CUSTOM_NETWORK_CFG, false),
            leaked_eni_cleanup: !env.bool_or(ENV_DISABLE_LEAKED_ENI_CLEANUP, false),
            pod_eni: env.bool_or(ENV_ENABLE_POD_ENI, false),
            subnet_discovery: env.bool_or(ENV_ENABLE_SUBNET_DISCOVERY, defaults.subnet_discovery),
            manage_untagged_eni: env.bool_or(ENV_MANAGE_UNTAGGED_ENI, defaults.manage_untagged_eni),
            provisioning: !env.bool_or(ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING, false),
            manage_enis_non_schedulable: env.bool_or(ENV_MANAGE_ENIS_NON_SCHEDULABLE, false),
            cluster_name: env.get(ENV_CLUSTER_NAME).map(|v| v.trim().to_owned()),
            ..defaults
        };
        if let Some(v) = env.get(ENV_MAX_ENI) {
            // Below 1 means "the instance type's limit", as in aws-node.
            match v.trim().parse::<i64>() {
                Ok(n) => s.max_eni = usize::try_from(n).ok().filter(|&n| n >= 1),
                Err(_) => env.tolerate(
                    ENV_MAX_ENI,
                    v,
                    "not a whole number",
                    "the instance type's limit",
                ),
            }
        }
        if let Some(v) = env.get(ENV_IP_COOLDOWN_PERIOD) {
            s.ip_cooldown = Duration::from_secs(
                u64::try_from(count(ENV_IP_COOLDOWN_PERIOD, v)?).unwrap_or(u64::MAX),
            );
        }
        if let Some(v) = env.get(ENV_ENI_MTU) {
            s.eni_mtu = parse_mtu(ENV_ENI_MTU, v)?;
        }
        if let Some(v) = env.get(ENV_BACKING_STORE) {
            s.backing_store = PathBuf::from(v.trim());
        }
        if let Some(v) = env.get(ENV_SG_ENFORCING_MODE) {
            s.sg_enforcing_mode = match v.trim() {
                "strict" => EnforcingMode::Strict,
                "standard" => EnforcingMode::Standard,
                // aws-node's entrypoint stops only when the mode matters.
                _ if s.pod_eni => {
                    return Err(ConfigError {
                        variable: ENV_SG_ENFORCING_MODE,
                        value: v.to_owned(),
                        allowed: "strict or standard (ENABLE_POD_ENI is true)",
                    });
                }
                _ => {
                    env.tolerate(ENV_SG_ENFORCING_MODE, v, "not strict or standard", "strict");
                    EnforcingMode::Strict
                }
            };
        }
        s.additional_eni_tags = additional_eni_tags(env);
        s.read_eni_config(env)?;
        if let Some(v) = env.get(ENV_MAX_PODS) {
            s.max_pods = Some(count(ENV_MAX_PODS, v)?).filter(|&n| n > 0);
        }
        Ok(s)
    }

    /// Custom networking's subnet and security groups.
    fn read_eni_config(&mut self, env: &Env) -> Result<(), ConfigError> {
        self.eni_config_subnet = env.get(ENV_ENI_CONFIG_SUBNET).map(|v| v.trim().to_owned());
        if let Some(subnet) = &self.eni_config_subnet
            && !subnet.starts_with("subnet-")
        {
            return Err(ConfigError {
                variable: ENV_ENI_CONFIG_SUBNET,
                value: subnet.clone(),
                allowed: "a subnet id (subnet-...)",
            });
        }
        if let Some(v) = env.get(ENV_ENI_CONFIG_SECURITY_GROUPS) {
            self.eni_config_security_groups = v
                .split(',')
                .map(str::trim)
                .filter(|g| !g.is_empty())
                .map(str::to_owned)
                .collect();
            if self
                .eni_config_security_groups
                .iter()
                .any(|g| !g.starts_with("sg-"))
            {
                return Err(ConfigError {
                    variable: ENV_ENI_CONFIG_SECURITY_GROUPS,
                    value: v.to_owned(),
                    allowed: "security group ids (sg-...), comma-separated",
                });
            }
        }
        Ok(())
    }

    /// Custom networking takes the pods' subnet from the node's ENIConfig,
    /// which only an API server (`api_server`) has; without one,
    /// [`ENV_ENI_CONFIG_SUBNET`] must name it. The caller knows whether
    /// there is one: the Kubernetes settings' variables are not ipam's.
    pub fn check_eni_config_source(&self, api_server: bool) -> Result<(), ConfigError> {
        if self.custom_network && self.eni_config_subnet.is_none() && !api_server {
            return Err(ConfigError {
                variable: ENV_ENI_CONFIG_SUBNET,
                value: String::new(),
                allowed: "a subnet id: AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG=true without the Kubernetes API needs the pods' subnet",
            });
        }
        Ok(())
    }

    /// Custom networking's config from [`ENV_ENI_CONFIG_SUBNET`], if set
    /// and custom networking is on.
    #[must_use]
    pub fn eni_config_override(&self) -> Option<EniConfig> {
        let subnet_id = self
            .eni_config_subnet
            .clone()
            .filter(|_| self.custom_network)?;
        Some(EniConfig {
            name: None,
            subnet_id,
            security_groups: self.eni_config_security_groups.clone(),
        })
    }

    /// The settings in force, keyed by the variable each comes from (what
    /// introspection's `/v1/config` shows, as ipamd's
    /// `/v1/ipamd-env-settings` does): unset ones are `null`.
    #[must_use]
    pub fn env_view(&self) -> serde_json::Map<String, serde_json::Value> {
        use serde_json::{Value, json};
        let unset_if_zero = |n: usize| if n == 0 { Value::Null } else { json!(n) };
        [
            (ENV_WARM_ENI_TARGET, json!(self.warm_eni_target)),
            (ENV_WARM_IP_TARGET, unset_if_zero(self.warm_ip_target)),
            (ENV_MINIMUM_IP_TARGET, unset_if_zero(self.minimum_ip_target)),
            (ENV_WARM_PREFIX_TARGET, json!(self.warm_prefix_target)),
            (ENV_ENABLE_PREFIX_DELEGATION, json!(self.prefix_delegation)),
            (ENV_MAX_ENI, json!(self.max_eni)),
            (ENV_IP_COOLDOWN_PERIOD, json!(self.ip_cooldown.as_secs())),
            (ENV_CUSTOM_NETWORK_CFG, json!(self.custom_network)),
            (ENV_ENI_MTU, json!(self.eni_mtu)),
            (
                ENV_DISABLE_LEAKED_ENI_CLEANUP,
                json!(!self.leaked_eni_cleanup),
            ),
            (ENV_BACKING_STORE, json!(self.backing_store)),
            (ENV_ENABLE_POD_ENI, json!(self.pod_eni)),
            (
                ENV_SG_ENFORCING_MODE,
                json!(self.sg_enforcing_mode.env_value()),
            ),
            (ENV_CLUSTER_NAME, json!(self.cluster_name)),
            (ENV_ADDITIONAL_ENI_TAGS, json!(self.additional_eni_tags)),
            (ENV_ENABLE_SUBNET_DISCOVERY, json!(self.subnet_discovery)),
            (ENV_MANAGE_UNTAGGED_ENI, json!(self.manage_untagged_eni)),
            (
                ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING,
                json!(!self.provisioning),
            ),
            (
                ENV_MANAGE_ENIS_NON_SCHEDULABLE,
                json!(self.manage_enis_non_schedulable),
            ),
            (ENV_ENI_CONFIG_SUBNET, json!(self.eni_config_subnet)),
            (
                ENV_ENI_CONFIG_SECURITY_GROUPS,
                json!(self.eni_config_security_groups),
            ),
            (ENV_MAX_PODS, json!(self.max_pods)),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect()
    }

    /// The pool targets for an instance type whose ENIs hold
    /// `max_ips_per_eni` secondary addresses, on a node with `max_pods`.
    #[must_use]
    pub fn pool_targets(&self, max_ips_per_eni: usize, max_pods: usize) -> PoolTargets {
        PoolTargets {
            warm_eni_target: self.warm_eni_target,
            warm_ip_target: self.warm_ip_target,
            minimum_ip_target: self.minimum_ip_target,
            warm_prefix_target: self.warm_prefix_target,
            prefix_delegation: self.prefix_delegation,
            max_ips_per_eni,
            max_pods,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn settings(vars: &[(&str, &str)]) -> Result<IpamSettings, ConfigError> {
        IpamSettings::from_env(&Env::from_pairs(vars.iter().copied()))
    }

    #[test]
    fn defaults_are_aws_nodes() {
        let s = settings(&[]).unwrap();
        assert_eq!(s, IpamSettings::default());
        assert_eq!(s.warm_eni_target, 1);
        assert_eq!(s.ip_cooldown, Duration::from_secs(30));
        assert_eq!(
            s.backing_store,
            PathBuf::from("/var/run/aws-node/ipam.json")
        );
        assert_eq!(s.sg_enforcing_mode, EnforcingMode::Strict);
        assert!(s.leaked_eni_cleanup);
        assert!(s.subnet_discovery);
        assert!(s.manage_untagged_eni);
        assert!(s.provisioning);
    }

    #[test]
    fn reads_every_variable() {
        let s = settings(&[
            (ENV_WARM_ENI_TARGET, "0"),
            (ENV_WARM_IP_TARGET, "5"),
            (ENV_MINIMUM_IP_TARGET, "10"),
            (ENV_WARM_PREFIX_TARGET, "2"),
            (ENV_ENABLE_PREFIX_DELEGATION, "true"),
            (ENV_MAX_ENI, "3"),
            (ENV_IP_COOLDOWN_PERIOD, "60"),
            (ENV_CUSTOM_NETWORK_CFG, "true"),
            (ENV_ENI_MTU, "1500"),
            (ENV_DISABLE_LEAKED_ENI_CLEANUP, "true"),
            (ENV_BACKING_STORE, "/tmp/ipam.json"),
            (ENV_ENABLE_POD_ENI, "true"),
            (ENV_SG_ENFORCING_MODE, "standard"),
            (ENV_CLUSTER_NAME, "prod"),
            (ENV_ENI_CONFIG_SUBNET, "subnet-0pods"),
            (ENV_ENI_CONFIG_SECURITY_GROUPS, "sg-1, sg-2"),
            (ENV_MAX_PODS, "58"),
            (ENV_ENABLE_SUBNET_DISCOVERY, "false"),
            (ENV_MANAGE_UNTAGGED_ENI, "false"),
            (ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING, "true"),
            (ENV_MANAGE_ENIS_NON_SCHEDULABLE, "true"),
        ])
        .unwrap();
        assert_eq!(
            (
                s.warm_eni_target,
                s.warm_ip_target,
                s.minimum_ip_target,
                s.warm_prefix_target
            ),
            (0, 5, 10, 2)
        );
        assert!(s.prefix_delegation && s.custom_network && s.pod_eni && !s.leaked_eni_cleanup);
        assert_eq!(s.max_eni, Some(3));
        assert_eq!(s.ip_cooldown, Duration::from_mins(1));
        assert_eq!(s.eni_mtu, 1500);
        assert_eq!(s.sg_enforcing_mode, EnforcingMode::Standard);
        assert_eq!(s.cluster_name.as_deref(), Some("prod"));
        assert_eq!(s.eni_config_subnet.as_deref(), Some("subnet-0pods"));
        assert_eq!(s.eni_config_security_groups, ["sg-1", "sg-2"]);
        assert_eq!(s.max_pods, Some(58));
        assert!(!s.subnet_discovery);
        assert!(!s.manage_untagged_eni);
        assert!(!s.provisioning);
        assert!(s.manage_enis_non_schedulable);
        let t = s.pool_targets(30, 110);
        assert!(t.ip_targets_defined());
    }

    #[test]
    fn custom_networking_needs_the_pods_subnet_without_the_kubernetes_api() {
        let custom = settings(&[(ENV_CUSTOM_NETWORK_CFG, "true")]).unwrap();
        let err = custom.check_eni_config_source(false).unwrap_err();
        assert_eq!(err.variable, ENV_ENI_CONFIG_SUBNET);
        custom.check_eni_config_source(true).unwrap();
        assert_eq!(custom.eni_config_override(), None, "the ENIConfig's");
        let overridden = settings(&[
            (ENV_CUSTOM_NETWORK_CFG, "true"),
            (ENV_ENI_CONFIG_SUBNET, "subnet-1"),
        ])
        .unwrap();
        overridden.check_eni_config_source(false).unwrap();
        let overridden = overridden.eni_config_override().unwrap();
        assert_eq!(
            (
                overridden.subnet_id.as_str(),
                overridden.security_groups.len()
            ),
            ("subnet-1", 0)
        );
    }

    #[test]
    fn max_eni_below_one_means_the_instance_limit() {
        assert_eq!(settings(&[(ENV_MAX_ENI, "-1")]).unwrap().max_eni, None);
        assert_eq!(settings(&[(ENV_MAX_ENI, "0")]).unwrap().max_eni, None);
    }

    #[test]
    fn values_aws_node_tolerates_take_its_defaults_and_are_said() {
        let env = Env::from_pairs([
            (ENV_WARM_ENI_TARGET, "-1"),
            (ENV_WARM_IP_TARGET, "five"),
            (ENV_MINIMUM_IP_TARGET, "-3"),
            (ENV_WARM_PREFIX_TARGET, "1.5"),
            (ENV_ENABLE_PREFIX_DELEGATION, "yes"),
            (ENV_MAX_ENI, "many"),
            (ENV_SG_ENFORCING_MODE, "lenient"),
        ]);
        let s = IpamSettings::from_env(&env).unwrap();
        assert_eq!(
            (
                s.warm_eni_target,
                s.warm_ip_target,
                s.minimum_ip_target,
                s.warm_prefix_target
            ),
            (1, 0, 0, 0)
        );
        assert!(!s.prefix_delegation);
        assert_eq!(s.max_eni, None);
        assert_eq!(s.sg_enforcing_mode, EnforcingMode::Strict);
        let said: Vec<&str> = env.tolerated().iter().map(|t| t.variable).collect();
        assert_eq!(
            said,
            [
                ENV_WARM_ENI_TARGET,
                ENV_WARM_IP_TARGET,
                ENV_MINIMUM_IP_TARGET,
                ENV_WARM_PREFIX_TARGET,
                ENV_ENABLE_PREFIX_DELEGATION,
                ENV_MAX_ENI,
                ENV_SG_ENFORCING_MODE,
            ]
        );
        assert_eq!(
            env.tolerated()[0].to_string(),
            r#"WARM_ENI_TARGET="-1": negative; using 1, as aws-node does"#
        );
    }

    #[test]
    fn additional_eni_tags_as_aws_node_reads_them() {
        let env = Env::from_pairs([(
            ENV_ADDITIONAL_ENI_TAGS,
            r#"{"team":"payments","cluster.k8s.amazonaws.com/name":"other","eks:eni:owner":"me"}"#,
        )]);
        let s = IpamSettings::from_env(&env).unwrap();
        assert_eq!(
            s.additional_eni_tags,
            BTreeMap::from([
                ("eks:eni:owner".to_owned(), "me".to_owned()),
                ("team".to_owned(), "payments".to_owned()),
            ])
        );
        assert_eq!(env.tolerated().len(), 1, "the reserved key is said");
        for bad in [r#"{"team":1}"#, "team=payments", "[]"] {
            let env = Env::from_pairs([(ENV_ADDITIONAL_ENI_TAGS, bad)]);
            let s = IpamSettings::from_env(&env).unwrap();
            assert!(s.additional_eni_tags.is_empty(), "{bad}");
            assert_eq!(env.tolerated()[0].used, "no additional tag");
        }
    }

    #[test]
    fn values_aws_nodes_entrypoint_stops_on_stop_the_agent() {
        for vars in [
            &[(ENV_ENI_MTU, "9002")][..],
            &[(ENV_ENI_MTU, "jumbo")],
            &[(ENV_IP_COOLDOWN_PERIOD, "-1")],
            &[
                (ENV_ENABLE_POD_ENI, "true"),
                (ENV_SG_ENFORCING_MODE, "lenient"),
            ],
            &[(ENV_ENI_CONFIG_SUBNET, "pods")],
            &[(ENV_ENI_CONFIG_SECURITY_GROUPS, "sg-1,default")],
            &[(ENV_MAX_PODS, "lots")],
        ] {
            let (var, value) = vars[vars.len() - 1];
            let err = settings(vars).unwrap_err();
            assert_eq!(err.variable, var);
            assert!(
                err.to_string().contains(var) && err.to_string().contains(value),
                "{err}"
            );
        }
    }

    #[test]
    fn env_view_read_back_gives_the_same_settings() {
        let original = settings(&[
            (ENV_WARM_IP_TARGET, "5"),
            (ENV_MAX_ENI, "2"),
            (ENV_ENABLE_PREFIX_DELEGATION, "true"),
            (ENV_IP_COOLDOWN_PERIOD, "7"),
            (ENV_CUSTOM_NETWORK_CFG, "true"),
            (ENV_ENI_CONFIG_SUBNET, "subnet-1"),
            (ENV_ENI_CONFIG_SECURITY_GROUPS, "sg-1,sg-2"),
            (ENV_DISABLE_LEAKED_ENI_CLEANUP, "true"),
            (ENV_CLUSTER_NAME, "prod"),
            (ENV_ENABLE_SUBNET_DISCOVERY, "false"),
            (ENV_MANAGE_UNTAGGED_ENI, "false"),
            (ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING, "true"),
            (ENV_MANAGE_ENIS_NON_SCHEDULABLE, "true"),
        ])
        .unwrap();
        let view = original.env_view();
        assert_eq!(view[ENV_WARM_IP_TARGET], 5);
        assert!(view[ENV_MINIMUM_IP_TARGET].is_null(), "unset is null");
        assert_eq!(view[ENV_SG_ENFORCING_MODE], "strict");
        // Every value, written back as the variable, reads as it was.
        let vars: HashMap<String, String> = view
            .iter()
            .filter_map(|(name, value)| {
                let text = match value {
                    serde_json::Value::Null => return None,
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Array(items) => items
                        .iter()
                        .map(|i| i.as_str().unwrap().to_owned())
                        .collect::<Vec<_>>()
                        .join(","),
                    other => other.to_string(),
                };
                Some((name.clone(), text))
            })
            .collect();
        let read_back = IpamSettings::from_env(&Env::from_pairs(vars)).unwrap();
        assert_eq!(read_back, original);
    }
}
