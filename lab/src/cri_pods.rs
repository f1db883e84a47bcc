//! Pods the way a cluster makes them: containerd's CRI in `vpcnet-node`
//! runs the real CNI plugin (`vpcnet-cni`, then Debian's `portmap`, the
//! conflist of `deploy/`) for each pod sandbox, the plugin asks the agent,
//! the agent hands out an address from the EC2 emulator's ENIs.

use std::{
    collections::BTreeMap,
    fs,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    time::Duration,
};

use serde_json::Value;
use tracing::info;
use vpcnet_api::conflist;

use crate::{
    addrs::{self, NS_NODE},
    cri::{self, Containerd, ContainerdOptions, CriClient, PodSpec, PortMapping},
    error::{Context, LabError, Result},
    netns,
    options::{EnforcingMode, NamedPod},
    state::{PodInfo, cni_socket_file, state_dir},
};

/// Debian's plugins the conflist chains (and `loopback`, which containerd
/// runs for every sandbox's `lo`).
const DEBIAN_PLUGINS: [&str; 2] = ["portmap", "loopback"];

/// The plugins containerd may run (one directory: containerd 1.6 takes one).
pub fn cni_bin_dir() -> PathBuf {
    state_dir().join("cni").join("bin")
}

/// The network configuration containerd reads.
pub fn cni_conf_dir() -> PathBuf {
    state_dir().join("cni").join("net.d")
}

/// The plugin's log file in the lab.
pub fn cni_plugin_log() -> PathBuf {
    state_dir().join("cni-plugin.log")
}

/// One call of the plugin, as its log tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginCall {
    /// `ADD`, `DEL`, `CHECK`...
    pub command: String,
    /// How long a call that succeeded took (its `elapsed_ms`).
    pub elapsed: Option<Duration>,
    /// The CNI error code of a call that failed (`code 11`).
    pub error_code: Option<String>,
}

/// Every call in the plugin's log (and its rotated predecessor), oldest
/// first.
pub fn plugin_calls() -> Vec<PluginCall> {
    let log = cni_plugin_log();
    let mut rotated = log.as_os_str().to_owned();
    rotated.push(".1");
    let text = [PathBuf::from(rotated), log]
        .iter()
        .map(|p| std::fs::read_to_string(p).unwrap_or_default())
        .collect::<String>();
    text.lines().filter_map(parse_plugin_line).collect()
}

/// A `key=value` field of a log line (values with spaces are quoted).
fn log_field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let rest = &line[line.find(&format!(" {name}="))? + name.len() + 2..];
    if let Some(quoted) = rest.strip_prefix('"') {
        Some(&quoted[..quoted.find('"')?])
    } else {
        rest.split(' ').next()
    }
}

fn parse_plugin_line(line: &str) -> Option<PluginCall> {
    let command = log_field(line, "command")?.to_owned();
    let elapsed = line
        .contains(" INFO ")
        .then(|| log_field(line, "elapsed_ms")?.parse::<f64>().ok())
        .flatten()
        .map(|ms| Duration::from_secs_f64(ms / 1e3));
    // `error=code 11: the vpcnet agent is not available (...)`
    let error_code = line.find(" error=code ").map(|at| {
        line[at + " error=".len()..]
            .split(':')
            .next()
            .unwrap_or_default()
            .to_owned()
    });
    (elapsed.is_some() || error_code.is_some()).then_some(PluginCall {
        command,
        elapsed,
        error_code,
    })
}

/// The conflist of `deploy/` pointed at the lab's agent socket and log,
/// with the node's security-group enforcing mode (the agent writes it so
/// from `POD_SECURITY_GROUP_ENFORCING_MODE` on a node).
pub fn lab_conflist(mode: EnforcingMode) -> Result<Value> {
    let mut conflist = conflist::template().map_err(LabError::InvalidOption)?;
    let plugin = conflist::plugin_mut(&mut conflist).map_err(LabError::InvalidOption)?;
    plugin["agentSocket"] = Value::from(cni_socket_file().display().to_string());
    plugin["logFile"] = Value::from(cni_plugin_log().display().to_string());
    plugin["podSGEnforcingMode"] = Value::from(mode.env_value());
    Ok(conflist)
}

/// Writes the CNI configuration and plugin directory, then starts
/// containerd in the node.
pub fn start_containerd(cni_plugin: &Path, mode: EnforcingMode) -> Result<Containerd> {
    let debian: Vec<PathBuf> = DEBIAN_PLUGINS
        .iter()
        .map(|name| Path::new(cri::DEBIAN_CNI_BIN_DIR).join(name))
        .collect();
    let plugins: Vec<&Path> = std::iter::once(cni_plugin)
        .chain(debian.iter().map(PathBuf::as_path))
        .collect();
    cri::link_cni_plugins(&cni_bin_dir(), &plugins)?;
    let conf_dir = cni_conf_dir();
    fs::create_dir_all(&conf_dir).context(|| format!("creating {}", conf_dir.display()))?;
    let conflist = lab_conflist(mode)?;
    let path = conf_dir.join("10-vpcnet.conflist");
    fs::write(
        &path,
        serde_json::to_vec_pretty(&conflist).expect("JSON values serialize"),
    )
    .context(|| format!("writing {}", path.display()))?;
    let containerd = Containerd::start(&ContainerdOptions::new(
        NS_NODE,
        cni_bin_dir(),
        cni_conf_dir(),
    ))?;
    info!(pid = containerd.pid(), "containerd is up in the node");
    Ok(containerd)
}

/// The Kubernetes identity of lab pod `index`.
pub fn pod_spec(index: usize) -> PodSpec {
    PodSpec::new(
        addrs::POD_K8S_NAMESPACE,
        addrs::pod_name(index),
        format!("00000000-0000-4000-8000-{index:012}"),
    )
}

/// The Kubernetes identity of a named pod with index `index` (its uid):
/// kubelet gives the sandbox the pod's labels.
pub fn named_pod_spec(index: usize, pod: &NamedPod) -> PodSpec {
    PodSpec {
        labels: pod.labels.clone(),
        ..PodSpec::new(
            pod.namespace.clone(),
            pod.name.clone(),
            format!("00000000-0000-4000-8000-{index:012}"),
        )
    }
}

/// A pod with `hostPort`s (portmap's work).
pub fn pod_spec_with_ports(index: usize, ports: &[PortMapping]) -> PodSpec {
    PodSpec {
        port_mappings: ports.to_vec(),
        ..pod_spec(index)
    }
}

/// Runs `spec`'s sandbox (kubelet's `RunPodSandbox`) and describes the pod
/// it made: its address, namespace, veth and the ENI its address is on.
pub fn run_pod(client: &CriClient, index: usize, spec: &PodSpec) -> Result<PodInfo> {
    let sandbox = client.run_pod_sandbox(spec)?;
    describe_pod(client, index, &sandbox)
}

/// What the runtime and the node say about sandbox `sandbox`.
pub fn describe_pod(client: &CriClient, index: usize, sandbox: &str) -> Result<PodInfo> {
    let status = client.pod_sandbox_status(sandbox)?;
    let addr = match status.ip {
        Some(IpAddr::V4(addr)) => addr,
        other => {
            return Err(LabError::BadOutput {
                command: format!("PodSandboxStatus {sandbox}"),
                reason: format!("the pod has no IPv4 address ({other:?})"),
            });
        }
    };
    let netns_path = status.netns.ok_or_else(|| LabError::BadOutput {
        command: format!("PodSandboxStatus {sandbox}"),
        reason: "no network namespace".into(),
    })?;
    let netns = netns_path.display().to_string();
    // `eni<hash>`, or `vlan<hash>` for a strict branch-ENI pod.
    let host_veths = [addrs::VETH_PREFIX, addrs::STRICT_BRANCH_VETH_PREFIX]
        .map(|prefix| addrs::host_veth_name_with_prefix(prefix, &status.namespace, &status.name));
    let (host_veth, host_link) = host_veths
        .iter()
        .find_map(|veth| link_of(NS_NODE, veth).ok().map(|link| (veth.clone(), link)))
        .ok_or_else(|| LabError::BadOutput {
            command: "ip -j link show".into(),
            reason: format!("no host veth {host_veths:?} for sandbox {sandbox}"),
        })?;
    let pod_link = link_of(&netns, "eth0")?;
    let eni = eni_link_of(addr)?;
    Ok(PodInfo {
        index,
        netns,
        k8s_namespace: status.namespace,
        k8s_name: status.name,
        addr,
        eni_device: eni
            .strip_prefix("eth")
            .and_then(|device| device.parse().ok()),
        eni,
        branch: None,
        ifname: "eth0".to_owned(),
        mac: pod_link.mac,
        host_veth,
        host_veth_mac: host_link.mac,
        sandbox: Some(sandbox.to_owned()),
        labels: BTreeMap::new(),
    })
}

/// Stops and removes a pod's sandbox, as kubelet does when a pod goes.
pub fn remove_pod(client: &CriClient, sandbox: &str) -> Result<()> {
    client.stop_pod_sandbox(sandbox)?;
    client.remove_pod_sandbox(sandbox)?;
    Ok(())
}

struct Link {
    mac: String,
}

/// `ip -j link show` of `name` in namespace (or namespace path) `ns`.
fn link_of(ns: &str, name: &str) -> Result<Link> {
    let out = netns::exec_ok(ns, &["ip", "-j", "link", "show", name])?;
    let links: Value = serde_json::from_str(&out).map_err(|err| LabError::BadOutput {
        command: format!("ip -j link show {name}"),
        reason: err.to_string(),
    })?;
    let mac = links[0]["address"]
        .as_str()
        .ok_or_else(|| LabError::BadOutput {
            command: format!("ip -j link show {name}"),
            reason: "no address".into(),
        })?;
    Ok(Link {
        mac: mac.to_owned(),
    })
}

/// The node's link of the ENI that owns `addr`: the link with the MAC of
/// the ENI the VPC router delivers `addr` to.
fn eni_link_of(addr: Ipv4Addr) -> Result<String> {
    let out = netns::exec_ok(NS_NODE, &["ip", "-j", "link", "show"])?;
    let links: Vec<Value> = serde_json::from_str(&out).map_err(|err| LabError::BadOutput {
        command: "ip -j link show".into(),
        reason: err.to_string(),
    })?;
    let by_mac: BTreeMap<String, String> = links
        .iter()
        .filter_map(|link| {
            Some((
                link["address"].as_str()?.to_owned(),
                link["ifname"].as_str()?.to_owned(),
            ))
        })
        .collect();
    let owner = crate::router::owner_mac(addr)?;
    Ok(owner
        .and_then(|mac| by_mac.get(&mac).cloned())
        .unwrap_or_default())
}
