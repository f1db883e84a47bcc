//! Everything the agent reads from its environment, composed from the
//! modules that own each variable: the list of every variable it reads
//! ([`VARIABLES`]), aws-node's table ([`aws_node`]) and the settings the
//! node starts with ([`Settings`]). It sits above every module it reads
//! from; only the binary imports it.

pub mod aws_node;

use ipnet::Ipv4Net;
use serde_json::{Value, json};
use tracing::warn;

use crate::{
    cloud::{self, CloudOptions},
    env::{ConfigError, Env},
    install::{self, InstallError, PluginEnv},
    introspect,
    ipam::settings::{self as ipam_settings, IpamSettings},
    k8s::{self, K8sSettings, service_cidrs},
    logging,
    node::{self, NodeSysctls},
    pods,
    policy::settings::{self as policy_settings, PolicySettings},
    snat,
    snat::SnatSettings,
};

/// Every variable the agent reads: the deployment's `ConfigMap` sets each,
/// and its documentation describes each.
pub const VARIABLES: &[&str] = &[
    snat::ENV_EXTERNAL_SNAT,
    snat::ENV_EXCLUDE_SNAT_CIDRS,
    snat::ENV_RANDOMIZE_SNAT,
    snat::ENV_CONNMARK,
    snat::ENV_EXTERNAL_SERVICE_CIDRS,
    snat::ENV_SNAT_PORT_RANGE,
    service_cidrs::ENV_SERVICE_CIDRS,
    ipam_settings::ENV_WARM_ENI_TARGET,
    ipam_settings::ENV_WARM_IP_TARGET,
    ipam_settings::ENV_MINIMUM_IP_TARGET,
    ipam_settings::ENV_WARM_PREFIX_TARGET,
    ipam_settings::ENV_ENABLE_PREFIX_DELEGATION,
    ipam_settings::ENV_MAX_ENI,
    ipam_settings::ENV_IP_COOLDOWN_PERIOD,
    ipam_settings::ENV_CUSTOM_NETWORK_CFG,
    ipam_settings::ENV_ENI_MTU,
    ipam_settings::ENV_DISABLE_LEAKED_ENI_CLEANUP,
    ipam_settings::ENV_BACKING_STORE,
    ipam_settings::ENV_ENABLE_POD_ENI,
    ipam_settings::ENV_SG_ENFORCING_MODE,
    k8s::pods::ENV_ANNOTATE_POD_IP,
    ipam_settings::ENV_CLUSTER_NAME,
    ipam_settings::ENV_ADDITIONAL_ENI_TAGS,
    ipam_settings::ENV_ENABLE_SUBNET_DISCOVERY,
    ipam_settings::ENV_MANAGE_UNTAGGED_ENI,
    ipam_settings::ENV_DISABLE_NETWORK_RESOURCE_PROVISIONING,
    ipam_settings::ENV_MANAGE_ENIS_NON_SCHEDULABLE,
    k8s::node::ENV_ENI_CONFIG_LABEL_DEF,
    k8s::node::ENV_ENI_CONFIG_ANNOTATION_DEF,
    ipam_settings::ENV_ENI_CONFIG_SUBNET,
    ipam_settings::ENV_ENI_CONFIG_SECURITY_GROUPS,
    ipam_settings::ENV_MAX_PODS,
    policy_settings::ENV_ENABLE_NETWORK_POLICY,
    policy_settings::ENV_NETWORK_POLICY_ENFORCING_MODE,
    policy_settings::ENV_POLICY_SOURCE,
    policy_settings::ENV_POLICY_ADD_WAIT,
    policy_settings::ENV_ENABLE_POLICY_EVENT_LOGS,
    policy_settings::ENV_POLICY_EVENT_LOG_FILE,
    policy_settings::ENV_POLICY_EVENT_LOG_LEVEL,
    pods::ENV_VETH_PREFIX,
    install::ENV_POD_MTU,
    install::ENV_PLUGIN_LOG_FILE,
    install::ENV_PLUGIN_LOG_LEVEL,
    install::ENV_ENABLE_BANDWIDTH_PLUGIN,
    install::ENV_DISABLE_POD_V6,
    cloud::ENV_EC2_ENDPOINT,
    cloud::ENV_HTTP_TIMEOUT,
    node::ENV_DISABLE_TCP_EARLY_DEMUX,
    logging::ENV_LOG_LEVEL,
    logging::ENV_LOG_FILE,
    logging::ENV_LOG_FORMAT,
    introspect::ENV_DISABLE_INTROSPECTION,
    introspect::ENV_INTROSPECTION_BIND_ADDRESS,
    introspect::ENV_DISABLE_METRICS,
];

/// Why the agent does not start with this environment.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A value aws-node's table refuses.
    #[error(transparent)]
    Refused(#[from] aws_node::Refusal),
    /// A bad value of one of vpcnet's own variables.
    #[error(transparent)]
    Invalid(#[from] ConfigError),
    #[error(transparent)]
    Plugin(#[from] InstallError),
}

/// Everything the agent reads from its environment, read before anything
/// changes on the node.
pub struct Settings {
    pub snat: SnatSettings,
    pub service_cidrs: Vec<Ipv4Net>,
    /// `VPCNET_SERVICE_CIDRS` is set: the cluster's are not looked up.
    pub service_cidrs_overridden: bool,
    pub k8s: K8sSettings,
    pub ipam: Option<IpamSettings>,
    pub endpoints: introspect::Endpoints,
    pub plugin: PluginEnv,
    pub veth_prefix: String,
    pub cloud: CloudOptions,
    pub sysctls: NodeSysctls,
    /// Network policy, when enforced.
    pub policy: Option<PolicySettings>,
}

impl Settings {
    /// Reads the settings and says, once, what has no effect and what was
    /// tolerated; a value aws-node's table refuses stops here, before the
    /// rest is read.
    pub fn read(
        env: &Env,
        ipam: bool,
        introspection: Option<&str>,
        metrics: Option<&str>,
    ) -> Result<Self, SettingsError> {
        let no_effect = aws_node::check(env)?;
        let snat = SnatSettings::from_env(env)?;
        let service_cidrs = service_cidrs::from_env(env)?;
        let k8s = K8sSettings::from_env(env);
        let ipam = ipam.then(|| IpamSettings::from_env(env)).transpose()?;
        if let Some(ipam) = &ipam {
            ipam.check_eni_config_source(k8s.enabled)?;
        }
        let policy = PolicySettings::from_env(env)?;
        if policy.is_some() && !(k8s.enabled && ipam.is_some()) {
            return Err(ConfigError {
                variable: policy_settings::ENV_ENABLE_NETWORK_POLICY,
                value: "true".to_owned(),
                allowed: "false without an API server or without --ipam (policies come from the API and name the pods the agent serves)",
            }
            .into());
        }
        let settings = Self {
            snat,
            service_cidrs,
            service_cidrs_overridden: env.get(service_cidrs::ENV_SERVICE_CIDRS).is_some(),
            k8s,
            ipam,
            endpoints: introspect::Endpoints::from_env(env, introspection, metrics)?,
            plugin: PluginEnv::from_env(env)?,
            veth_prefix: pods::veth_prefix(env)?,
            cloud: CloudOptions::from_env(env),
            sysctls: NodeSysctls::from_env(env),
            policy,
        };
        for warning in no_effect {
            warn!("{warning}");
        }
        for tolerated in env.tolerated() {
            warn!("{tolerated}");
        }
        Ok(settings)
    }

    /// The settings in force by the variable each comes from (what aws-node
    /// would use for the same environment, where it reads the variable).
    pub fn view(&self, env: &Env) -> Result<Value, SettingsError> {
        let s = &self.snat;
        let mut view = serde_json::Map::new();
        let mut put = |name: &str, value: Value| {
            view.insert(name.to_owned(), value);
        };
        put(snat::ENV_EXTERNAL_SNAT, json!(s.external_snat));
        put(
            snat::ENV_EXCLUDE_SNAT_CIDRS,
            json!(cidr_texts(&s.exclude_snat_cidrs)),
        );
        put(
            snat::ENV_EXTERNAL_SERVICE_CIDRS,
            json!(cidr_texts(&s.external_service_cidrs)),
        );
        put(snat::ENV_RANDOMIZE_SNAT, json!(s.randomize.env_value()));
        put(snat::ENV_CONNMARK, json!(s.connmark));
        put(
            snat::ENV_SNAT_PORT_RANGE,
            json!(format!("{}-{}", s.port_min, s.port_max)),
        );
        put(
            snat::ENV_MARK_DECIDED,
            json!(format!("{:#x}", s.mark_decided)),
        );
        put(
            snat::ENV_MARK_VIA_SERVICE,
            json!(format!("{:#x}", s.mark_via_service)),
        );
        put(
            service_cidrs::ENV_SERVICE_CIDRS,
            json!(cidr_texts(&self.service_cidrs)),
        );
        for (name, value) in self.k8s.view() {
            put(name, value);
        }
        if let Some(ipam) = &self.ipam {
            for (name, value) in ipam.env_view() {
                put(&name, value);
            }
            let pod_mtu = self.plugin.pod_mtu.unwrap_or(ipam.eni_mtu);
            put(install::ENV_POD_MTU, json!(pod_mtu));
        }
        let (plugin_log_file, plugin_log_level) = self.plugin.logging_in_force()?;
        put(install::ENV_PLUGIN_LOG_FILE, json!(plugin_log_file));
        put(install::ENV_PLUGIN_LOG_LEVEL, json!(plugin_log_level));
        put(
            install::ENV_ENABLE_BANDWIDTH_PLUGIN,
            json!(self.plugin.bandwidth),
        );
        put(
            install::ENV_DISABLE_POD_V6,
            json!(self.plugin.disable_pod_v6),
        );
        put(pods::ENV_VETH_PREFIX, json!(self.veth_prefix));
        put(cloud::ENV_EC2_ENDPOINT, json!(self.cloud.ec2_endpoint));
        put(
            cloud::ENV_HTTP_TIMEOUT,
            json!(self.cloud.http_timeout.as_secs()),
        );
        put(
            node::ENV_DISABLE_TCP_EARLY_DEMUX,
            json!(self.sysctls.disable_tcp_early_demux),
        );
        put(
            introspect::ENV_INTROSPECTION_BIND_ADDRESS,
            json!(
                self.endpoints
                    .introspection
                    .as_ref()
                    .map(ToString::to_string)
            ),
        );
        put(
            introspect::ENV_DISABLE_METRICS,
            json!(self.endpoints.metrics.is_none()),
        );
        put(
            logging::ENV_LOG_LEVEL,
            json!(logging::level(env).unwrap_or(logging::DEFAULT_LEVEL)),
        );
        put(
            logging::ENV_LOG_FILE,
            json!(match logging::target(env) {
                logging::LogTarget::Stderr => "stderr".to_owned(),
                logging::LogTarget::Stdout => "stdout".to_owned(),
                logging::LogTarget::File(path) => path.display().to_string(),
            }),
        );
        put(
            logging::ENV_LOG_FORMAT,
            json!(match logging::format(env) {
                logging::LogFormat::Text => "text",
                logging::LogFormat::Json => "json",
            }),
        );
        Ok(Value::Object(view))
    }
}

fn cidr_texts(cidrs: &[Ipv4Net]) -> Vec<String> {
    cidrs.iter().map(ToString::to_string).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        ipam::settings::{ENV_CUSTOM_NETWORK_CFG, ENV_ENI_CONFIG_SUBNET},
        k8s::ENV_SERVICE_HOST,
    };

    fn read_ipam(vars: &[(&str, &str)]) -> Result<Settings, SettingsError> {
        Settings::read(&Env::from_pairs(vars.iter().copied()), true, None, None)
    }

    #[test]
    fn custom_networking_without_the_kubernetes_api_needs_the_pods_subnet() {
        let err = read_ipam(&[(ENV_CUSTOM_NETWORK_CFG, "true")])
            .err()
            .expect("refused");
        assert!(
            matches!(&err, SettingsError::Invalid(e) if e.variable == ENV_ENI_CONFIG_SUBNET),
            "{err}"
        );
        let in_cluster = read_ipam(&[
            (ENV_CUSTOM_NETWORK_CFG, "true"),
            (ENV_SERVICE_HOST, "10.100.0.1"),
        ])
        .expect("the ENIConfig's subnet");
        assert!(in_cluster.ipam.is_some_and(|s| s.custom_network));
    }
}
