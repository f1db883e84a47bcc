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
    options::{EnforcingMode, LabOptions},
};

/// A pod's branch ENI (security groups for pods).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BranchEni {
    /// Its VLAN id on the trunk.
    pub vlan_id: u16,
    /// The node's link for it (`vlan.eth.<id>`) and the branch ENI's MAC.
    pub link: String,
    pub mac: String,
    /// The VPC router's side of it.
    pub vpc_link: String,
    /// The VPC CNI's route table for it (VLAN id + 100).
    pub route_table: u32,
    /// The node's `POD_SECURITY_GROUP_ENFORCING_MODE`.
    pub mode: EnforcingMode,
}

/// One pod, wired the way the VPC CNI wires it: on one of the node's ENIs
/// (a secondary IP of it), or on a branch ENI of its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodInfo {
    /// Its index N (`vpcnet-pod-N`, Kubernetes name `pod-N`).
    pub index: usize,
    /// Its network namespace.
    pub netns: String,
    /// Its Kubernetes namespace and name (the veth name derives from them).
    pub k8s_namespace: String,
    pub k8s_name: String,
    /// Its address: a secondary IP of the ENI [`Self::eni`], or its branch
    /// ENI's address.
    pub addr: Ipv4Addr,
    /// The node's interface for the ENI that owns [`Self::addr`]: `eth0`,
    /// `eth1`, `eth2`, or the branch ENI's `vlan.eth.<id>`.
    #[serde(default = "eth0")]
    pub eni: String,
    /// The device number of that ENI (`ethN`: N); `None` for a branch pod.
    #[serde(default)]
    pub eni_device: Option<usize>,
    /// Set for a pod with a branch ENI (security groups for pods).
    #[serde(default)]
    pub branch: Option<BranchEni>,
    /// Its interface (`eth0`) and that interface's MAC.
    pub ifname: String,
    pub mac: String,
    /// The host side of its veth pair, in `vpcnet-node`, and its MAC (the
    /// pod's permanent neighbour for 169.254.1.1).
    pub host_veth: String,
    pub host_veth_mac: String,
    /// Its pod sandbox, for a pod made through the container runtime.
    #[serde(default)]
    pub sandbox: Option<String>,
    /// Its Kubernetes labels (a pod made through the runtime, with the API
    /// server), as they are now.
    #[serde(default)]
    pub labels: std::collections::BTreeMap<String, String>,
}

fn eth0() -> String {
    addrs::NODE_ETH0.to_owned()
}

impl PodInfo {
    /// Pod `index` on the primary ENI.
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
            eni: eth0(),
            eni_device: Some(0),
            branch: None,
            ifname: "eth0".to_owned(),
            mac: addrs::pod_mac(index),
            host_veth_mac: addrs::pod_host_veth_mac(index),
            sandbox: None,
            labels: std::collections::BTreeMap::new(),
        })
    }

    /// Pod `index` of a lab built with `opts`: on ENI `index % opts.enis`,
    /// or on its branch ENI if it is one of `opts.branch_pods`.
    pub fn in_lab(index: usize, opts: &LabOptions) -> Result<Self> {
        let mut pod = Self::new(index)?;
        if let Some(vlan_id) = opts.branch_vlan_id(index) {
            let mode = opts.sg_enforcing_mode;
            let prefix = match mode {
                EnforcingMode::Strict => addrs::STRICT_BRANCH_VETH_PREFIX,
                EnforcingMode::Standard => addrs::VETH_PREFIX,
            };
            pod.host_veth =
                addrs::host_veth_name_with_prefix(prefix, &pod.k8s_namespace, &pod.k8s_name);
            pod.eni = addrs::branch_link(vlan_id);
            pod.eni_device = None;
            pod.branch = Some(BranchEni {
                vlan_id,
                link: addrs::branch_link(vlan_id),
                mac: addrs::branch_eni_mac(vlan_id),
                vpc_link: addrs::vpc_branch_link(vlan_id),
                route_table: addrs::branch_route_table(vlan_id),
                mode,
            });
        } else {
            let device = index % opts.enis.max(1);
            pod.eni = addrs::eni_ifname(device);
            pod.eni_device = Some(device);
        }
        Ok(pod)
    }

    /// The VPC router's link to the ENI that owns the pod's address.
    pub fn vpc_link(&self) -> String {
        match (&self.branch, self.eni_device) {
            (Some(branch), _) => branch.vpc_link.clone(),
            (None, device) => addrs::vpc_eni_link(device.unwrap_or(0)),
        }
    }

    /// The MAC of the ENI that owns the pod's address.
    pub fn eni_mac(&self) -> String {
        match (&self.branch, self.eni_device) {
            (Some(branch), _) => branch.mac.clone(),
            (None, device) => addrs::eni_mac(device.unwrap_or(0)),
        }
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
    /// The pod `NS/NAME` (a numbered pod is `default/pod-N`).
    pub fn pod_named(&self, key: &str) -> Option<&PodInfo> {
        self.pods
            .iter()
            .find(|pod| format!("{}/{}", pod.k8s_namespace, pod.k8s_name) == key)
    }

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

/// The EC2 emulator's pid (an address-manager lab).
pub fn emulator_pid_file() -> PathBuf {
    state_dir().join("ec2.pid")
}

/// The Kubernetes API server's pid (a lab left running).
pub fn kube_api_pid_file() -> PathBuf {
    state_dir().join("kube-api.pid")
}

/// Written when the lab made the ServiceAccount mount point (no pod runs on
/// this machine): `down` removes what it made.
pub fn service_account_mount_marker() -> PathBuf {
    state_dir().join("service-account-mount-made")
}

/// The agent's CNI backend socket (an address-manager lab).
pub fn cni_socket_file() -> PathBuf {
    state_dir().join("cni.sock")
}

/// The node's `/var/run/aws-node`: where aws-node keeps its checkpoint,
/// and the agent after it (the DaemonSet's host path in an image lab).
pub fn aws_node_run_dir() -> PathBuf {
    state_dir().join("aws-node")
}

/// The agent's IPAM checkpoint (`AWS_VPC_K8S_CNI_BACKING_STORE`) in an
/// address-manager lab: aws-node's path on the node.
pub fn ipam_checkpoint_file() -> PathBuf {
    aws_node_run_dir().join("ipam.json")
}

/// The node layout the lab writes for the agent (`--layout`).
pub fn layout_file() -> PathBuf {
    state_dir().join("layout.json")
}

/// The agent's log (its standard error).
pub fn agent_log_file() -> PathBuf {
    state_dir().join("agent.log")
}
