//! What the `DaemonSet` puts on the node besides the agent: the CNI plugin
//! binaries (the init container, `vpcnet-agent install-plugins`) and the
//! conflist (the agent, once it serves the plugin: the kubelet reports the
//! node's network ready only then).
//!
//! Both are written beside their final name and renamed over it: a runtime
//! executing the plugin, or reading the conflist, sees the old file or the
//! new one, never half of one (and replacing a binary being executed does
//! not fail with `ETXTBSY`).

use std::{
    fs,
    io::Write as _,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use serde_json::Value;
use vpcnet_api::{conflist, layout::EnforcingMode};

use crate::env::{ConfigError, Env};

/// The conflist's file name in the runtime's configuration directory.
pub const CONFLIST_NAME: &str = "10-vpcnet.conflist";

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{action} {path}: {source}")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no plugin binaries in {0}")]
    NothingToInstall(PathBuf),
    #[error("{0}")]
    Template(String),
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_owned();
    move |source| InstallError::Io {
        action,
        path,
        source,
    }
}

/// The pods' MTU (their veth's), aws-node's entrypoint's; unset: the
/// ENIs' (`AWS_VPC_ENI_MTU`).
pub const ENV_POD_MTU: &str = "POD_MTU";
/// The plugin's log file; "stderr" or blank: its standard error.
pub const ENV_PLUGIN_LOG_FILE: &str = "AWS_VPC_K8S_PLUGIN_LOG_FILE";
pub const ENV_PLUGIN_LOG_LEVEL: &str = "AWS_VPC_K8S_PLUGIN_LOG_LEVEL";
/// Chains the `bandwidth` plugin (pods' `kubernetes.io/*-bandwidth`).
pub const ENV_ENABLE_BANDWIDTH_PLUGIN: &str = "ENABLE_BANDWIDTH_PLUGIN";
/// Chains the `tuning` plugin turning IPv6 off in pods.
pub const ENV_DISABLE_POD_V6: &str = "DISABLE_POD_V6";

/// What aws-node's variables put into the conflist besides the MTU.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginEnv {
    /// `None`: the ENIs' MTU.
    pub pod_mtu: Option<u32>,
    /// `None`: the template's file; `Some("")`: standard error.
    pub log_file: Option<String>,
    /// `None`: the template's level.
    pub log_level: Option<&'static str>,
    pub bandwidth: bool,
    pub disable_pod_v6: bool,
}

impl PluginEnv {
    /// Reads the variables as aws-node's entrypoint does: it stops on an
    /// MTU out of range and on a log file of `stdout` (the CNI result's
    /// stream); an unknown level is debug there, said here.
    pub fn from_env(env: &Env) -> Result<Self, ConfigError> {
        let pod_mtu = env
            .get(ENV_POD_MTU)
            .map(|v| crate::ipam::settings::parse_mtu(ENV_POD_MTU, v))
            .transpose()?;
        let log_file = match env.get(ENV_PLUGIN_LOG_FILE).map(str::trim) {
            None => None,
            Some(file) if file.eq_ignore_ascii_case("stdout") => {
                return Err(ConfigError {
                    variable: ENV_PLUGIN_LOG_FILE,
                    value: file.to_owned(),
                    allowed: "a file, or stderr (stdout carries the plugin's result)",
                });
            }
            Some(file) if file.eq_ignore_ascii_case("stderr") => Some(String::new()),
            Some(file) => Some(file.to_owned()),
        };
        let log_level = crate::logging::aws_node_level(env, ENV_PLUGIN_LOG_LEVEL);
        Ok(Self {
            pod_mtu,
            log_file,
            log_level,
            bandwidth: env.bool_or(ENV_ENABLE_BANDWIDTH_PLUGIN, false),
            disable_pod_v6: env.bool_or(ENV_DISABLE_POD_V6, false),
        })
    }

    /// The plugin's log file and level in force: these, or the template's.
    pub fn logging_in_force(&self) -> Result<(String, String), InstallError> {
        let mut conflist = conflist::template().map_err(InstallError::Template)?;
        let template = conflist::plugin_mut(&mut conflist).map_err(InstallError::Template)?;
        let field = |name: &str| template[name].as_str().unwrap_or_default().to_owned();
        Ok((
            self.log_file.clone().unwrap_or_else(|| field("logFile")),
            self.log_level
                .map_or_else(|| field("logLevel"), str::to_owned),
        ))
    }
}

/// What the conflist says of the node, from the agent's settings.
#[derive(Clone, Debug)]
pub struct ConflistSettings {
    /// `AWS_VPC_ENI_MTU`.
    pub eni_mtu: u32,
    /// `AWS_VPC_K8S_CNI_VETHPREFIX`.
    pub veth_prefix: String,
    /// `POD_SECURITY_GROUP_ENFORCING_MODE`.
    pub enforcing_mode: EnforcingMode,
    /// The agent's CNI socket.
    pub agent_socket: PathBuf,
    pub plugin: PluginEnv,
}

/// The conflist for `settings`: the shipped template with the plugin's
/// fields set, and the plugins aws-node would chain after it.
pub fn render_conflist(settings: &ConflistSettings) -> Result<Value, InstallError> {
    let mut conflist = conflist::template().map_err(InstallError::Template)?;
    let plugin = conflist::plugin_mut(&mut conflist).map_err(InstallError::Template)?;
    plugin["mtu"] = settings.plugin.pod_mtu.unwrap_or(settings.eni_mtu).into();
    plugin["vethPrefix"] = settings.veth_prefix.clone().into();
    plugin["podSGEnforcingMode"] = settings.enforcing_mode.env_value().into();
    plugin["agentSocket"] = settings.agent_socket.display().to_string().into();
    if let Some(file) = &settings.plugin.log_file {
        plugin["logFile"] = file.clone().into();
    }
    if let Some(level) = settings.plugin.log_level {
        plugin["logLevel"] = level.into();
    }
    let chained = conflist["plugins"]
        .as_array_mut()
        .ok_or_else(|| InstallError::Template("its plugins are not a list".into()))?;
    if settings.plugin.bandwidth {
        chained.push(serde_json::json!({
            "type": "bandwidth",
            "capabilities": {"bandwidth": true}
        }));
    }
    if settings.plugin.disable_pod_v6 {
        chained.push(serde_json::json!({
            "type": "tuning",
            "sysctl": {
                "net.ipv6.conf.all.disable_ipv6": "1",
                "net.ipv6.conf.default.disable_ipv6": "1",
                "net.ipv6.conf.lo.disable_ipv6": "1"
            }
        }));
    }
    Ok(conflist)
}

/// Writes `conflist` as `dir/10-vpcnet.conflist`; returns its path.
pub fn write_conflist(dir: &Path, conflist: &Value) -> Result<PathBuf, InstallError> {
    fs::create_dir_all(dir).map_err(io_error("creating", dir))?;
    let path = dir.join(CONFLIST_NAME);
    let mut text = serde_json::to_vec_pretty(conflist)
        .map_err(|e| InstallError::Template(format!("not serializable: {e}")))?;
    text.push(b'\n');
    replace_file(&path, &text, 0o644)?;
    Ok(path)
}

/// Copies every regular file of `from` into `to` (executable); returns the
/// installed paths.
pub fn install_plugins(from: &Path, to: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let mut sources: Vec<PathBuf> = fs::read_dir(from)
        .map_err(io_error("reading", from))?
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_file()))
        .map(|entry| entry.path())
        .collect();
    if sources.is_empty() {
        return Err(InstallError::NothingToInstall(from.to_owned()));
    }
    sources.sort();
    fs::create_dir_all(to).map_err(io_error("creating", to))?;
    let mut installed = Vec::with_capacity(sources.len());
    for source in sources {
        let bytes = fs::read(&source).map_err(io_error("reading", &source))?;
        let target = to.join(source.file_name().unwrap_or_default());
        replace_file(&target, &bytes, 0o755)?;
        installed.push(target);
    }
    Ok(installed)
}

/// Writes `bytes` to a temporary file beside `path`, syncs it and renames
/// it over `path`.
fn replace_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), InstallError> {
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let temporary = path.with_file_name(format!(".{name}.vpcnet-new"));
    let write = || -> std::io::Result<()> {
        let mut file = fs::File::create(&temporary)?;
        file.write_all(bytes)?;
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.sync_all()
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&temporary);
        return Err(io_error("writing", &temporary)(e));
    }
    fs::rename(&temporary, path).map_err(io_error("renaming into", path))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> ConflistSettings {
        ConflistSettings {
            eni_mtu: 1500,
            veth_prefix: "vpc".into(),
            enforcing_mode: EnforcingMode::Standard,
            agent_socket: "/run/vpcnet/cni.sock".into(),
            plugin: PluginEnv::default(),
        }
    }

    #[test]
    fn the_conflist_carries_the_settings_and_keeps_the_chain() {
        let conflist = render_conflist(&settings()).unwrap();
        let plugins = conflist["plugins"].as_array().unwrap();
        assert_eq!(plugins[0]["type"], conflist::PLUGIN_TYPE);
        assert_eq!(plugins[0]["mtu"], 1500);
        assert_eq!(plugins[0]["vethPrefix"], "vpc");
        assert_eq!(plugins[0]["podSGEnforcingMode"], "standard");
        assert_eq!(plugins[0]["agentSocket"], "/run/vpcnet/cni.sock");
        assert_eq!(plugins[1]["type"], "portmap", "hostPorts stay chained");
        assert_eq!(plugins.len(), 2);
        assert_eq!(conflist["name"], "aws-cni");
    }

    #[test]
    fn aws_nodes_plugin_variables_reach_the_conflist() {
        let env = Env::from_pairs([
            (ENV_POD_MTU, "1400"),
            (ENV_PLUGIN_LOG_FILE, "stderr"),
            (ENV_PLUGIN_LOG_LEVEL, "DEBUG"),
            (ENV_ENABLE_BANDWIDTH_PLUGIN, "true"),
            (ENV_DISABLE_POD_V6, "true"),
        ]);
        let conflist = render_conflist(&ConflistSettings {
            plugin: PluginEnv::from_env(&env).unwrap(),
            ..settings()
        })
        .unwrap();
        let plugins = conflist["plugins"].as_array().unwrap();
        assert_eq!(plugins[0]["mtu"], 1400, "POD_MTU over the ENIs' 1500");
        assert_eq!(plugins[0]["logFile"], "", "stderr");
        assert_eq!(plugins[0]["logLevel"], "debug");
        let types: Vec<&str> = plugins
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(
            types,
            [conflist::PLUGIN_TYPE, "portmap", "bandwidth", "tuning"]
        );
        assert_eq!(plugins[3]["sysctl"]["net.ipv6.conf.all.disable_ipv6"], "1");
        assert!(env.tolerated().is_empty());
    }

    #[test]
    fn plugin_variables_aws_node_stops_on_stop_the_agent() {
        for (variable, value) in [
            (ENV_POD_MTU, "9002"),
            (ENV_PLUGIN_LOG_FILE, "stdout"),
            (ENV_PLUGIN_LOG_FILE, "STDOUT"),
        ] {
            let err = PluginEnv::from_env(&Env::from_pairs([(variable, value)])).unwrap_err();
            assert_eq!(err.variable, variable);
        }
        let env = Env::from_pairs([(ENV_PLUGIN_LOG_LEVEL, "chatty")]);
        assert_eq!(PluginEnv::from_env(&env).unwrap().log_level, Some("debug"));
        assert_eq!(env.tolerated()[0].variable, ENV_PLUGIN_LOG_LEVEL);
    }

    #[test]
    fn files_are_replaced_whole_and_executable() {
        let scratch = vpcnet_lab::ScratchDir::new("vpcnet-install").unwrap();
        let dir = scratch.path();
        let (from, to) = (dir.join("from"), dir.join("to"));
        fs::create_dir_all(&from).unwrap();
        fs::create_dir_all(&to).unwrap();
        fs::write(from.join("vpcnet-cni"), b"new").unwrap();
        fs::write(to.join("vpcnet-cni"), b"old").unwrap();
        let installed = install_plugins(&from, &to).unwrap();
        assert_eq!(installed, vec![to.join("vpcnet-cni")]);
        assert_eq!(fs::read(to.join("vpcnet-cni")).unwrap(), b"new");
        let mode = fs::metadata(to.join("vpcnet-cni"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        let leftovers: Vec<_> = fs::read_dir(&to).unwrap().flatten().collect();
        assert_eq!(leftovers.len(), 1, "no temporary file left");

        let path = write_conflist(&to, &render_conflist(&settings()).unwrap()).unwrap();
        let back: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(back["plugins"][0]["vethPrefix"], "vpc");

        let empty = dir.join("empty");
        fs::create_dir_all(&empty).unwrap();
        assert!(matches!(
            install_plugins(&empty, &to),
            Err(InstallError::NothingToInstall(_))
        ));
    }
}
