//! What the lab built, recorded as JSON in the state directory so that
//! `lab down` and later commands (and other processes) know what exists.

use std::{
    fs,
    io::ErrorKind,
    net::Ipv4Addr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{
    addrs::{self, STATE_DIR},
    error::{Context, LabError, Result, STATE_FILE},
    options::LabOptions,
};

/// One pod, wired the way the VPC CNI wires a pod on the primary ENI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodInfo {
    /// Its index N (`vpcnet-pod-N`, Kubernetes name `pod-N`).
    pub index: usize,
    /// Its network namespace.
    pub netns: String,
    /// Its Kubernetes namespace and name (the veth name derives from them).
    pub k8s_namespace: String,
    pub k8s_name: String,
    /// Its address: a secondary IP of the node's `eth0` ENI.
    pub addr: Ipv4Addr,
    /// Its interface (`eth0`) and that interface's MAC.
    pub ifname: String,
    pub mac: String,
    /// The host side of its veth pair, in `vpcnet-node`, and its MAC (the
    /// pod's permanent neighbour for 169.254.1.1).
    pub host_veth: String,
    pub host_veth_mac: String,
}

impl PodInfo {
    /// Pod `index` as the lab wires it.
    pub fn new(index: usize) -> Result<Self> {
        let addr = addrs::pod_addr(index).ok_or(LabError::TooManyPods {
            requested: index + 1,
            max: addrs::MAX_PODS,
        })?;
        let k8s_name = addrs::pod_name(index);
        Ok(Self {
            index,
            netns: addrs::pod_ns(index),
            host_veth: addrs::host_veth_name(addrs::POD_K8S_NAMESPACE, &k8s_name),
            k8s_namespace: addrs::POD_K8S_NAMESPACE.to_owned(),
            k8s_name,
            addr,
            ifname: "eth0".to_owned(),
            mac: addrs::pod_mac(index),
            host_veth_mac: addrs::pod_host_veth_mac(index),
        })
    }
}

/// The agent process of an eBPF lab.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    pub pid: i32,
    /// The process's start time (clock ticks since boot, /proc/PID/stat
    /// field 22): with the pid it names the process even if the pid is reused.
    pub start_time: u64,
    pub bin: PathBuf,
    pub log: PathBuf,
}

/// Everything the lab built.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabState {
    pub options: LabOptions,
    pub pods: Vec<PodInfo>,
    /// Every namespace of this lab.
    pub namespaces: Vec<String>,
    pub agent: Option<AgentInfo>,
    /// False while `up` is still building.
    pub ready: bool,
}

impl LabState {
    /// Loads the running lab's state.
    pub fn load() -> Result<Self> {
        let path = state_file();
        let text = match fs::read_to_string(&path) {
            Ok(text) => text,
            Err(err) if err.kind() == ErrorKind::NotFound => return Err(LabError::NotRunning),
            Err(err) => return Err(err).context(|| format!("reading {}", path.display())),
        };
        serde_json::from_str(&text).map_err(|err| LabError::BadState {
            path,
            reason: err.to_string(),
        })
    }

    /// Writes the state (atomically: a reader never sees half of it).
    pub fn save(&self) -> Result<()> {
        let path = state_file();
        let tmp = path.with_extension("json.tmp");
        let json = serde_json::to_string_pretty(self).expect("the state always serializes");
        fs::write(&tmp, json).context(|| format!("writing {}", tmp.display()))?;
        fs::rename(&tmp, &path).context(|| format!("renaming {} into place", tmp.display()))
    }
}

/// The state directory.
pub fn state_dir() -> &'static Path {
    Path::new(STATE_DIR)
}

/// The state file.
pub fn state_file() -> PathBuf {
    state_dir().join(STATE_FILE)
}

/// The agent's pid file.
pub fn agent_pid_file() -> PathBuf {
    state_dir().join("agent.pid")
}

/// The agent's log (its standard error).
pub fn agent_log_file() -> PathBuf {
    state_dir().join("agent.log")
}
