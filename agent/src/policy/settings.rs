//! Network policy's variables, as aws-node's chart sets them:
//! `ENABLE_NETWORK_POLICY` (the chart's `enableNetworkPolicy`, which it
//! passes to the node agent as `--enable-network-policy`) and
//! `NETWORK_POLICY_ENFORCING_MODE` (aws-node's container's).

use std::{fmt, time::Duration};

use vpcnet_common::config::{FLAG_NETWORK_POLICY, FLAG_POLICY_EVENTS};

use super::events::EventLog;
use crate::env::{ConfigError, Env};

pub const ENV_ENABLE_NETWORK_POLICY: &str = "ENABLE_NETWORK_POLICY";
pub const ENV_NETWORK_POLICY_ENFORCING_MODE: &str = "NETWORK_POLICY_ENFORCING_MODE";
/// Where the agent reads policy from (see [`Source`]).
pub const ENV_POLICY_SOURCE: &str = "VPCNET_NETWORK_POLICY_SOURCE";
/// How long a CNI ADD waits for the cluster's policies to be known before
/// the pod gets its mode's default.
pub const ENV_POLICY_ADD_WAIT: &str = "VPCNET_NETWORK_POLICY_ADD_WAIT_SECONDS";
/// aws-node's chart's `nodeAgent.enablePolicyEventLogs`.
pub const ENV_ENABLE_POLICY_EVENT_LOGS: &str = "ENABLE_POLICY_EVENT_LOGS";
/// The event log's file (the node agent's `--log-file`).
pub const ENV_POLICY_EVENT_LOG_FILE: &str = "VPCNET_POLICY_EVENT_LOG_FILE";
/// `debug` (the node agent's default: ACCEPT lines too) or `info` (DENY
/// only).
pub const ENV_POLICY_EVENT_LOG_LEVEL: &str = "VPCNET_POLICY_EVENT_LOG_LEVEL";
/// Where aws-node's node agent writes, and EKS's log collector looks.
pub const DEFAULT_POLICY_EVENT_LOG_FILE: &str = "/var/log/aws-routed-eni/network-policy-agent.log";

/// `NETWORK_POLICY_ENFORCING_MODE`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EnforcingMode {
    /// A pod no policy selects is allowed everything.
    #[default]
    Standard,
    /// A pod no policy selects is allowed nothing (but its node's
    /// addresses).
    Strict,
}

impl fmt::Display for EnforcingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Standard => "standard",
            Self::Strict => "strict",
        })
    }
}

/// Where policies come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Source {
    /// EKS's network policy controller's `PolicyEndpoint`s, as aws-node's
    /// node agent reads them.
    #[default]
    PolicyEndpoints,
    /// `networking.k8s.io/v1` NetworkPolicy resolved by the agent from
    /// Pods and Namespaces, where no controller runs.
    NetworkPolicies,
}

impl Source {
    /// As [`ENV_POLICY_SOURCE`] names it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::PolicyEndpoints => "policy-endpoints",
            Self::NetworkPolicies => "network-policies",
        }
    }
}

/// Network policy on this node: `None` when off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicySettings {
    pub mode: EnforcingMode,
    pub source: Source,
    /// How long an ADD waits for the policies to be known.
    pub add_wait: Duration,
    /// `ENABLE_POLICY_EVENT_LOGS`: where verdicts are logged.
    pub event_log: Option<EventLog>,
}

/// An ADD's wait when none is set: kubelet's own CNI timeout is minutes,
/// a pod's start should not be.
const DEFAULT_ADD_WAIT: Duration = Duration::from_secs(5);

impl PolicySettings {
    /// The datapath configuration's flags this enforcement sets.
    pub fn config_flags(&self) -> u32 {
        let events = if self.event_log.is_some() {
            FLAG_POLICY_EVENTS
        } else {
            0
        };
        FLAG_NETWORK_POLICY | events
    }

    /// `None` with `ENABLE_NETWORK_POLICY` off (aws-node's default). On,
    /// the mode must be `standard` or `strict` (any case), as aws-node's
    /// node agent refuses to start otherwise.
    pub fn from_env(env: &Env) -> Result<Option<Self>, ConfigError> {
        if !env.bool_or(ENV_ENABLE_NETWORK_POLICY, false) {
            return Ok(None);
        }
        let raw = env
            .get(ENV_NETWORK_POLICY_ENFORCING_MODE)
            .unwrap_or("standard");
        let mode = match raw.to_ascii_lowercase().as_str() {
            "standard" => EnforcingMode::Standard,
            "strict" => EnforcingMode::Strict,
            _ => {
                return Err(ConfigError {
                    variable: ENV_NETWORK_POLICY_ENFORCING_MODE,
                    value: raw.to_owned(),
                    allowed: "standard or strict when ENABLE_NETWORK_POLICY=true",
                });
            }
        };
        let source = match env.get(ENV_POLICY_SOURCE) {
            None => Source::default(),
            Some(value) => [Source::PolicyEndpoints, Source::NetworkPolicies]
                .into_iter()
                .find(|s| s.name() == value)
                .ok_or_else(|| ConfigError {
                    variable: ENV_POLICY_SOURCE,
                    value: value.to_owned(),
                    allowed: "policy-endpoints or network-policies",
                })?,
        };
        let add_wait = match env.get(ENV_POLICY_ADD_WAIT) {
            None => DEFAULT_ADD_WAIT,
            Some(value) => value
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|s| *s <= 60)
                .map(Duration::from_secs)
                .ok_or_else(|| ConfigError {
                    variable: ENV_POLICY_ADD_WAIT,
                    value: value.to_owned(),
                    allowed: "whole seconds from 0 to 60",
                })?,
        };
        let event_log = if env.bool_or(ENV_ENABLE_POLICY_EVENT_LOGS, false) {
            let accepts = match env.get(ENV_POLICY_EVENT_LOG_LEVEL) {
                None => true,
                Some(level) => match level.to_ascii_lowercase().as_str() {
                    "debug" => true,
                    "info" => false,
                    _ => {
                        return Err(ConfigError {
                            variable: ENV_POLICY_EVENT_LOG_LEVEL,
                            value: level.to_owned(),
                            allowed: "debug (DENY and ACCEPT) or info (DENY)",
                        });
                    }
                },
            };
            Some(EventLog {
                path: env
                    .get(ENV_POLICY_EVENT_LOG_FILE)
                    .unwrap_or(DEFAULT_POLICY_EVENT_LOG_FILE)
                    .into(),
                accepts,
            })
        } else {
            None
        };
        Ok(Some(Self {
            mode,
            source,
            add_wait,
            event_log,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_unless_enabled_and_the_mode_as_aws_node_reads_it() {
        let read =
            |pairs: &[(&str, &str)]| PolicySettings::from_env(&Env::from_pairs(pairs.to_vec()));
        assert_eq!(
            read(&[(ENV_NETWORK_POLICY_ENFORCING_MODE, "strict")]).unwrap(),
            None
        );
        let on = read(&[(ENV_ENABLE_NETWORK_POLICY, "true")])
            .unwrap()
            .unwrap();
        assert_eq!(on.mode, EnforcingMode::Standard);
        assert_eq!(on.add_wait, DEFAULT_ADD_WAIT);
        assert_eq!(on.event_log, None);
        let logged = read(&[
            (ENV_ENABLE_NETWORK_POLICY, "true"),
            (ENV_ENABLE_POLICY_EVENT_LOGS, "true"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            logged.event_log,
            Some(EventLog {
                path: DEFAULT_POLICY_EVENT_LOG_FILE.into(),
                accepts: true
            })
        );
        let strict = read(&[
            (ENV_ENABLE_NETWORK_POLICY, "true"),
            (ENV_NETWORK_POLICY_ENFORCING_MODE, "Strict"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(strict.mode, EnforcingMode::Strict);
        assert_eq!(strict.source, Source::PolicyEndpoints);
        let resolved = read(&[
            (ENV_ENABLE_NETWORK_POLICY, "true"),
            (ENV_POLICY_SOURCE, "network-policies"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(resolved.source, Source::NetworkPolicies);
        let none = read(&[
            (ENV_ENABLE_NETWORK_POLICY, "true"),
            (ENV_NETWORK_POLICY_ENFORCING_MODE, "none"),
        ]);
        assert!(none.unwrap_err().to_string().contains("standard or strict"));
    }
}
