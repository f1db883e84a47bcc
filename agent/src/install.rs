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

/// What the conflist says of the node, from the agent's settings.
#[derive(Clone, Debug)]
pub struct ConflistSettings {
    /// `AWS_VPC_ENI_MTU`.
    pub mtu: u32,
    /// `AWS_VPC_K8S_CNI_VETHPREFIX`.
    pub veth_prefix: String,
    /// `POD_SECURITY_GROUP_ENFORCING_MODE`.
    pub enforcing_mode: EnforcingMode,
    /// The agent's CNI socket.
    pub agent_socket: PathBuf,
}

/// The conflist for `settings`: the shipped template with the plugin's
/// fields set.
pub fn render_conflist(settings: &ConflistSettings) -> Result<Value, InstallError> {
    let mut conflist = conflist::template().map_err(InstallError::Template)?;
    let plugin = conflist::plugin_mut(&mut conflist).map_err(InstallError::Template)?;
    plugin["mtu"] = settings.mtu.into();
    plugin["vethPrefix"] = settings.veth_prefix.clone().into();
    plugin["podSGEnforcingMode"] = settings.enforcing_mode.env_value().into();
    plugin["agentSocket"] = settings.agent_socket.display().to_string().into();
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
            mtu: 1500,
            veth_prefix: "vpc".into(),
            enforcing_mode: EnforcingMode::Standard,
            agent_socket: "/run/vpcnet/cni.sock".into(),
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
        assert_eq!(conflist["name"], "aws-cni");
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
