//! The network config on stdin: one plugin's object of a conflist, as the
//! runtime derives it (`cniVersion` and `name` from the list,
//! `runtimeConfig`, `prevResult`, `cni.dev/valid-attachments` added).
//!
//! | field | default | meaning |
//! |---|---|---|
//! | `cniVersion` | (required) | 0.3.1, 0.4.0, 1.0.0 or 1.1.0 |
//! | `name` | (required) | the network's name: part of the agent's key for the pod |
//! | `type` | | "vpcnet-cni" (the runtime's business) |
//! | `vethPrefix` | "eni" | host veth names: the prefix and 11 hex digits of sha1("<namespace>.<pod>"); 1 to 4 characters |
//! | `mtu` | 9001 | MTU of both ends of the veth, a number or a string (576 to 9001); when absent, the agent's MTU wins if it gives one |
//! | `podSGEnforcingMode` | "strict" | "strict" or "standard": in strict mode a branch-ENI pod's host veth is named with the prefix "vlan" (the VPC CNI's rule) |
//! | `agentSocket` | /run/vpcnet/cni.sock | the agent's gRPC socket |
//! | `agentTimeoutSeconds` | 30 | bound on each call to the agent (an ADD may wait for the pool to grow) |
//! | `logFile` (or `pluginLogFile`) | /var/log/vpcnet/plugin.log | appended to, with its directory created; "" logs to stderr only |
//! | `logLevel` (or `pluginLogLevel`) | "info" | trace, debug, info, warn or error |
//! | `runtimeConfig` | | `io.kubernetes.cri.pod-annotations`: the pod's annotations, passed to the agent |
//! | `prevResult` | | the previous result (ADD in a chain, DEL, CHECK) |
//! | `cni.dev/valid-attachments` | | GC: the attachments to keep, `[{containerID, ifname}]` |

use std::{collections::HashMap, path::PathBuf, time::Duration};

use serde::Deserialize;
use serde_json::Value;
use tracing::level_filters::LevelFilter;

use crate::{
    env::valid_name,
    error::{CniError, code},
};

/// CNI spec versions this plugin accepts configs of.
pub const SUPPORTED_VERSIONS: [&str; 4] = ["0.3.1", "0.4.0", "1.0.0", "1.1.0"];
/// The spec version the plugin implements.
pub const OWN_VERSION: &str = "1.1.0";

pub const DEFAULT_MTU: u32 = 9001;
const MTU_RANGE: std::ops::RangeInclusive<u32> = 576..=9001;
pub const DEFAULT_AGENT_TIMEOUT: Duration = Duration::from_secs(30);
pub const DEFAULT_LOG_FILE: &str = "/var/log/vpcnet/plugin.log";
/// The host veth prefix of branch-ENI pods in strict mode.
pub const STRICT_BRANCH_VETH_PREFIX: &str = "vlan";

/// Security groups for pods: how a branch-ENI pod's traffic goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnforcingMode {
    Strict,
    Standard,
}

/// One attachment of `cni.dev/valid-attachments`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize)]
pub struct ValidAttachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// The config, checked, with defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    pub veth_prefix: String,
    /// `None` when the config has no `mtu`.
    pub mtu: Option<u32>,
    pub pod_sg_enforcing_mode: EnforcingMode,
    pub agent_socket: PathBuf,
    pub agent_timeout: Duration,
    pub logging: Logging,
    pub annotations: HashMap<String, String>,
    pub prev_result: Option<Value>,
    pub valid_attachments: Option<Vec<ValidAttachment>>,
}

/// Where and how much to log.
#[derive(Clone, Debug, PartialEq)]
pub struct Logging {
    /// `None`: stderr only.
    pub file: Option<PathBuf>,
    pub level: LevelFilter,
}

impl Default for Logging {
    fn default() -> Self {
        Self {
            file: Some(PathBuf::from(DEFAULT_LOG_FILE)),
            level: LevelFilter::INFO,
        }
    }
}

/// The config's fields as JSON has them.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Raw {
    cni_version: Option<String>,
    name: Option<String>,
    veth_prefix: Option<String>,
    mtu: Option<NumberOrString>,
    #[serde(rename = "podSGEnforcingMode")]
    pod_sg_enforcing_mode: Option<String>,
    agent_socket: Option<PathBuf>,
    agent_timeout_seconds: Option<NumberOrString>,
    #[serde(alias = "pluginLogFile")]
    log_file: Option<PathBuf>,
    #[serde(alias = "pluginLogLevel")]
    log_level: Option<String>,
    #[serde(default)]
    runtime_config: RuntimeConfig,
    prev_result: Option<Value>,
    #[serde(rename = "cni.dev/valid-attachments")]
    valid_attachments: Option<Vec<ValidAttachment>>,
    ipam: Option<Value>,
}

#[derive(Default, Deserialize)]
struct RuntimeConfig {
    #[serde(rename = "io.kubernetes.cri.pod-annotations", default)]
    pod_annotations: Option<HashMap<String, String>>,
}

/// A number that may come as a string (the VPC CNI's conflist has
/// `"mtu": "9001"`).
#[derive(Deserialize)]
#[serde(untagged)]
enum NumberOrString {
    Number(serde_json::Number),
    String(String),
}

impl NumberOrString {
    fn as_f64(&self) -> Option<f64> {
        match self {
            Self::Number(n) => n.as_f64(),
            Self::String(s) => s.trim().parse().ok(),
        }
    }

    /// A whole number that fits a `u32`.
    fn as_u32(&self) -> Option<u32> {
        match self {
            Self::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
            Self::String(s) => s.trim().parse().ok(),
        }
    }

    fn text(&self) -> String {
        match self {
            Self::Number(n) => n.to_string(),
            Self::String(s) => format!("{s:?}"),
        }
    }
}

fn invalid(msg: impl Into<String>, details: impl Into<String>) -> CniError {
    CniError::new(code::INVALID_CONFIG, msg, details)
}

/// Parses a level name (case-insensitive).
fn parse_level(text: &str) -> Option<LevelFilter> {
    match text.to_ascii_lowercase().as_str() {
        "trace" => Some(LevelFilter::TRACE),
        "debug" => Some(LevelFilter::DEBUG),
        "info" => Some(LevelFilter::INFO),
        "warn" | "warning" => Some(LevelFilter::WARN),
        "error" => Some(LevelFilter::ERROR),
        "off" => Some(LevelFilter::OFF),
        _ => None,
    }
}

/// The config's `cniVersion`, if the plugin speaks it (1 otherwise).
fn check_version(version: Option<String>) -> Result<String, CniError> {
    match version {
        Some(version) if SUPPORTED_VERSIONS.contains(&version.as_str()) => Ok(version),
        other => Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            "incompatible CNI versions",
            format!(
                "config is {}, plugin supports [{}]",
                other.map_or_else(|| "missing cniVersion".to_owned(), |v| format!("{v:?}")),
                SUPPORTED_VERSIONS.join(", ")
            ),
        )),
    }
}

fn check_mtu(mtu: &NumberOrString) -> Result<u32, CniError> {
    mtu.as_u32()
        .filter(|m| MTU_RANGE.contains(m))
        .ok_or_else(|| {
            invalid(
                "invalid mtu",
                format!(
                    "{}: a whole number from {} to {}",
                    mtu.text(),
                    MTU_RANGE.start(),
                    MTU_RANGE.end()
                ),
            )
        })
}

fn check_timeout(seconds: &NumberOrString) -> Result<Duration, CniError> {
    seconds
        .as_f64()
        .filter(|s| *s > 0.0 && *s <= 3600.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            invalid(
                "invalid agentTimeoutSeconds",
                format!("{}: more than 0, at most 3600", seconds.text()),
            )
        })
}

fn check_logging(file: Option<PathBuf>, level: Option<String>) -> Result<Logging, CniError> {
    let mut logging = Logging::default();
    if let Some(file) = file {
        logging.file = (!file.as_os_str().is_empty()).then_some(file);
    }
    if let Some(level) = level {
        logging.level = parse_level(&level).ok_or_else(|| {
            invalid(
                "invalid logLevel",
                format!("{level:?}: trace, debug, info, warn or error"),
            )
        })?;
    }
    Ok(logging)
}

/// Decodes stdin as a JSON object (6 when it is not one).
pub fn decode(stdin: &[u8]) -> Result<Value, CniError> {
    let value: Value = serde_json::from_slice(stdin).map_err(|err| {
        CniError::new(
            code::DECODING_FAILURE,
            "failed to decode the network config",
            err.to_string(),
        )
    })?;
    if !value.is_object() {
        return Err(CniError::new(
            code::DECODING_FAILURE,
            "failed to decode the network config",
            format!("expected a JSON object, got {value}"),
        ));
    }
    Ok(value)
}

/// The version to answer errors in: the config's if it is one the plugin
/// speaks, else its own.
pub fn answer_version(config: Option<&Value>) -> String {
    config
        .and_then(|config| config.get("cniVersion"))
        .and_then(Value::as_str)
        .filter(|version| SUPPORTED_VERSIONS.contains(version))
        .unwrap_or(OWN_VERSION)
        .to_owned()
}

/// Where to log, from as much of the config as makes sense (a config
/// that fails validation still says where its log goes).
pub fn logging_of(config: Option<&Value>) -> Logging {
    let Some(config) = config else {
        return Logging {
            file: None,
            ..Logging::default()
        };
    };
    let text = |keys: [&str; 2]| {
        keys.iter()
            .find_map(|key| config.get(*key).and_then(Value::as_str))
    };
    let mut logging = Logging::default();
    if let Some(file) = text(["logFile", "pluginLogFile"]) {
        logging.file = (!file.is_empty()).then(|| PathBuf::from(file));
    }
    if let Some(level) = text(["logLevel", "pluginLogLevel"]).and_then(parse_level) {
        logging.level = level;
    }
    logging
}

impl NetConf {
    /// Checks and completes a decoded config.
    pub fn from_value(value: &Value) -> Result<Self, CniError> {
        let raw = Raw::deserialize(value).map_err(|err| {
            CniError::new(
                code::DECODING_FAILURE,
                "failed to decode the network config",
                err.to_string(),
            )
        })?;
        let cni_version = check_version(raw.cni_version)?;
        let name = match raw.name {
            None => return Err(invalid("missing network name", "")),
            Some(name) if !valid_name(&name) => {
                return Err(invalid("invalid characters found in network name", name));
            }
            Some(name) => name,
        };
        if let Some(ipam) = raw.ipam {
            return Err(CniError::new(
                code::UNSUPPORTED_FIELD,
                "unsupported field in network config: ipam",
                format!("ipam: {ipam} (vpcnet-cni gets addresses from the vpcnet agent)"),
            ));
        }
        let veth_prefix = raw
            .veth_prefix
            .unwrap_or_else(|| vpcnet_api::pod::DEFAULT_VETH_PREFIX.to_owned());
        if veth_prefix.is_empty()
            || veth_prefix.len() > 4
            || !veth_prefix.chars().all(|c| c.is_ascii_alphanumeric())
        {
            return Err(invalid(
                "invalid vethPrefix",
                format!(
                    "{veth_prefix:?}: 1 to 4 letters or digits (with 11 hex digits, a name of at most 15)"
                ),
            ));
        }
        let mtu = raw.mtu.as_ref().map(check_mtu).transpose()?;
        let pod_sg_enforcing_mode = match raw.pod_sg_enforcing_mode.as_deref() {
            None | Some("strict") => EnforcingMode::Strict,
            Some("standard") => EnforcingMode::Standard,
            Some(other) => {
                return Err(invalid(
                    "invalid podSGEnforcingMode",
                    format!("{other:?}: strict or standard"),
                ));
            }
        };
        let agent_socket = raw
            .agent_socket
            .unwrap_or_else(|| PathBuf::from(vpcnet_api::DEFAULT_CNI_SOCKET));
        if agent_socket.as_os_str().is_empty() {
            return Err(invalid("invalid agentSocket", "empty path"));
        }
        let agent_timeout = raw
            .agent_timeout_seconds
            .as_ref()
            .map_or(Ok(DEFAULT_AGENT_TIMEOUT), check_timeout)?;
        let logging = check_logging(raw.log_file, raw.log_level)?;
        Ok(Self {
            cni_version,
            name,
            veth_prefix,
            mtu,
            pod_sg_enforcing_mode,
            agent_socket,
            agent_timeout,
            logging,
            annotations: raw.runtime_config.pod_annotations.unwrap_or_default(),
            prev_result: raw.prev_result.filter(|prev| !prev.is_null()),
            valid_attachments: raw.valid_attachments,
        })
    }

    /// The MTU the veth is created with.
    pub fn veth_mtu(&self) -> u32 {
        self.mtu.unwrap_or(DEFAULT_MTU)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    const POD_ANNOTATIONS: &str = "io.kubernetes.cri.pod-annotations";

    fn parse(value: &Value) -> Result<NetConf, CniError> {
        NetConf::from_value(value)
    }

    #[test]
    fn minimal_configs_of_every_version_get_the_defaults() {
        for version in SUPPORTED_VERSIONS {
            let conf =
                parse(&json!({"cniVersion": version, "name": "aws-cni", "type": "vpcnet-cni"}))
                    .unwrap();
            assert_eq!(conf.cni_version, version);
            assert_eq!(conf.name, "aws-cni");
            assert_eq!(conf.veth_prefix, "eni");
            assert_eq!(conf.mtu, None);
            assert_eq!(conf.veth_mtu(), 9001);
            assert_eq!(conf.agent_socket, PathBuf::from("/run/vpcnet/cni.sock"));
            assert_eq!(conf.agent_timeout, Duration::from_secs(30));
            assert_eq!(conf.logging, Logging::default());
            assert_eq!(conf.pod_sg_enforcing_mode, EnforcingMode::Strict);
            assert!(conf.annotations.is_empty());
            assert_eq!(conf.prev_result, None);
            assert_eq!(conf.valid_attachments, None);
        }
    }

    #[test]
    fn every_field_is_read() {
        let conf = parse(&json!({
            "cniVersion": "1.1.0",
            "name": "aws-cni",
            "type": "vpcnet-cni",
            "vethPrefix": "veth",
            "mtu": "1500",
            "podSGEnforcingMode": "standard",
            "agentSocket": "/tmp/agent.sock",
            "agentTimeoutSeconds": 0.5,
            "pluginLogFile": "",
            "logLevel": "DEBUG",
            "runtimeConfig": {POD_ANNOTATIONS: {"a": "b"}, "portMappings": []},
            "prevResult": {"cniVersion": "1.1.0"},
            "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}],
            "somethingElse": true
        }))
        .unwrap();
        assert_eq!(conf.veth_prefix, "veth");
        assert_eq!(conf.mtu, Some(1500));
        assert_eq!(conf.pod_sg_enforcing_mode, EnforcingMode::Standard);
        assert_eq!(conf.agent_socket, PathBuf::from("/tmp/agent.sock"));
        assert_eq!(conf.agent_timeout, Duration::from_millis(500));
        assert_eq!(conf.logging.file, None);
        assert_eq!(conf.logging.level, LevelFilter::DEBUG);
        assert_eq!(conf.annotations["a"], "b");
        assert!(conf.prev_result.is_some());
        assert_eq!(
            conf.valid_attachments.unwrap(),
            vec![ValidAttachment {
                container_id: "c1".into(),
                ifname: "eth0".into()
            }]
        );
        let conf = parse(&json!({"cniVersion": "0.3.1", "name": "n", "mtu": 9001})).unwrap();
        assert_eq!(conf.mtu, Some(9001));
    }

    #[test]
    fn versions_outside_the_list_are_incompatible() {
        for config in [
            json!({"cniVersion": "0.2.0", "name": "n"}),
            json!({"cniVersion": "2.0.0", "name": "n"}),
            json!({"name": "n"}),
        ] {
            let err = parse(&config).unwrap_err();
            assert_eq!(err.code, code::INCOMPATIBLE_VERSION, "{config}");
            assert!(
                err.details.contains("0.3.1, 0.4.0, 1.0.0, 1.1.0"),
                "{err:?}"
            );
        }
    }

    #[test]
    fn bad_values_are_invalid_config() {
        for (config, msg) in [
            (json!({"cniVersion": "1.0.0"}), "missing network name"),
            (
                json!({"cniVersion": "1.0.0", "name": "a b"}),
                "invalid characters found in network name",
            ),
            (
                json!({"cniVersion": "1.0.0", "name": "n", "vethPrefix": "toolong"}),
                "invalid vethPrefix",
            ),
            (
                json!({"cniVersion": "1.0.0", "name": "n", "mtu": 100}),
                "invalid mtu",
            ),
            (
                json!({"cniVersion": "1.0.0", "name": "n", "mtu": "big"}),
                "invalid mtu",
            ),
            (
                json!({"cniVersion": "1.0.0", "name": "n", "mtu": 1500.5}),
                "invalid mtu",
            ),
            (
                json!({"cniVersion": "1.0.0", "name": "n", "agentTimeoutSeconds": 0}),
                "invalid agentTimeoutSeconds",
            ),
            (
                json!({"cniVersion": "1.0.0", "name": "n", "logLevel": "loud"}),
                "invalid logLevel",
            ),
            (
                json!({"cniVersion": "1.0.0", "name": "n", "podSGEnforcingMode": "lax"}),
                "invalid podSGEnforcingMode",
            ),
        ] {
            let err = parse(&config).unwrap_err();
            assert_eq!(err.code, code::INVALID_CONFIG, "{config}");
            assert_eq!(err.msg, msg, "{config}");
        }
    }

    #[test]
    fn ipam_is_an_unsupported_field() {
        let err =
            parse(&json!({"cniVersion": "1.0.0", "name": "n", "ipam": {"type": "host-local"}}))
                .unwrap_err();
        assert_eq!(err.code, code::UNSUPPORTED_FIELD);
        assert!(err.msg.contains("ipam"), "{err:?}");
        assert!(err.details.contains("host-local"), "{err:?}");
    }

    #[test]
    fn wrong_types_are_decode_failures() {
        for config in [
            json!({"cniVersion": "1.0.0", "name": "n", "runtimeConfig": {POD_ANNOTATIONS: [1]}}),
            json!({"cniVersion": 1, "name": "n"}),
            json!({"cniVersion": "1.1.0", "name": "n", "cni.dev/valid-attachments": {}}),
        ] {
            let err = parse(&config).unwrap_err();
            assert_eq!(err.code, code::DECODING_FAILURE, "{config}");
        }
        assert_eq!(decode(b"{").unwrap_err().code, code::DECODING_FAILURE);
        assert_eq!(decode(b"[]").unwrap_err().code, code::DECODING_FAILURE);
        assert!(decode(br#"{"a": 1}"#).is_ok());
    }

    #[test]
    fn errors_answer_in_the_config_version_when_it_is_known() {
        assert_eq!(
            answer_version(Some(&json!({"cniVersion": "0.3.1"}))),
            "0.3.1"
        );
        assert_eq!(
            answer_version(Some(&json!({"cniVersion": "9.9.9"}))),
            "1.1.0"
        );
        assert_eq!(answer_version(None), "1.1.0");
    }

    #[test]
    fn logging_comes_from_whatever_config_there_is() {
        assert_eq!(logging_of(None).file, None);
        let logging = logging_of(Some(
            &json!({"pluginLogFile": "/tmp/x.log", "logLevel": "warn"}),
        ));
        assert_eq!(logging.file, Some(PathBuf::from("/tmp/x.log")));
        assert_eq!(logging.level, LevelFilter::WARN);
        assert_eq!(logging_of(Some(&json!({}))), Logging::default());
    }
}
