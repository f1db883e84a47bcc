//! The agent as the DaemonSet's pod (`lab up --agent-image ARCHIVE`): the
//! image archive imported into the node's containerd, the DaemonSet and
//! its ConfigMap rendered from `deploy/kubernetes` with `kubectl
//! kustomize` (the image set to the archive's, the ConfigMap's data set to
//! the lab's settings, as an operator edits them), and the pod run through
//! CRI by the lab's kubelet ([`crate::kubelet`], in the helper process
//! `vpcnet-lab-kubelet`): its init container installs the plugins, the
//! agent writes the conflist containerd then uses for every pod.
//!
//! The node's own directories (each `DirectoryOrCreate` host path, the
//! CNI configuration and plugin directories) are lab directories behind
//! the node paths in containerd's mount namespace
//! ([`crate::cri::NodePath`]); the machine's bpffs and xtables lock are
//! the node's.

use std::{
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};
use tracing::info;

use crate::{
    addrs::{NODE_PRIMARY_ADDR, NS_NODE},
    cluster,
    cri::{self, Containerd, ContainerdOptions, LABEL_NODE_AGENT, NodePath},
    cri_pods::{cni_bin_dir, cni_conf_dir},
    ec2::EmulatorProcess,
    error::{Context, LabError, Result},
    helper_process,
    kube::pki::ClusterFiles,
    kube_tools::KUBECTL,
    kubelet::{self, NodeContext, PodStatus},
    state::state_dir,
};

/// The helper binary that runs and keeps the pod.
pub const KUBELET_BIN: &str = "vpcnet-lab-kubelet";

/// Where the node keeps the CNI configuration and plugins (containerd's
/// defaults, and the DaemonSet's host paths).
const NODE_CNI_CONF_DIR: &str = "/etc/cni/net.d";
const NODE_CNI_BIN_DIR: &str = "/opt/cni/bin";

/// The node's BPF file system.
const BPFFS: &str = "/sys/fs/bpf";

/// How long the pod has to become ready (its readiness probe runs every
/// 10 s).
const READY_TIMEOUT: Duration = Duration::from_mins(3);

/// The node's directories below the lab's state directory.
fn node_root() -> PathBuf {
    state_dir().join("node")
}

/// The kubelet's files.
pub fn kubelet_pid_file() -> PathBuf {
    state_dir().join("kubelet.pid")
}
pub fn kubelet_log_file() -> PathBuf {
    state_dir().join("kubelet.log")
}
fn plan_file() -> PathBuf {
    state_dir().join("agent-pod.json")
}
/// Where the lab's kubelet writes the pod's status.
pub fn status_file() -> PathBuf {
    state_dir().join("agent-pod-status.json")
}

/// The pod's status as the lab's kubelet last wrote it.
pub fn status() -> Result<PodStatus> {
    let text = fs::read(status_file()).context(|| "reading the agent pod's status".into())?;
    serde_json::from_slice(&text)
        .map_err(|err| LabError::InvalidOption(format!("the agent pod's status: {err}")))
}

/// The DaemonSet and ConfigMap of `deploy/kubernetes`, as `kubectl
/// kustomize` renders them.
pub fn render() -> Result<(DaemonSet, ConfigMap)> {
    let dir = Path::new(vpcnet_deploy::DEPLOY_DIR).join("kubernetes");
    let text = vpcnet_deploy::output_of(Command::new(KUBECTL).arg("kustomize").arg(&dir))
        .map_err(|err| LabError::InvalidOption(format!("rendering deploy/kubernetes: {err}")))?;
    let objects = vpcnet_deploy::objects(&text, "kubectl kustomize deploy/kubernetes")
        .map_err(|err| LabError::InvalidOption(err.to_string()))?;
    Ok((objects.daemon_set().clone(), objects.config_map().clone()))
}

/// The DaemonSet's host paths the node makes (`DirectoryOrCreate`), each
/// a lab directory: the CNI ones where the lab's helpers read them.
fn node_paths(daemon_set: &DaemonSet) -> Vec<NodePath> {
    let volumes = daemon_set
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref())
        .and_then(|spec| spec.volumes.clone())
        .unwrap_or_default();
    let mut paths = vec![
        NodePath {
            node: NODE_CNI_CONF_DIR.into(),
            source: cni_conf_dir(),
        },
        NodePath {
            node: NODE_CNI_BIN_DIR.into(),
            source: cni_bin_dir(),
        },
    ];
    for host_path in volumes
        .iter()
        .filter_map(|volume| volume.host_path.as_ref())
    {
        let node = PathBuf::from(&host_path.path);
        if host_path.type_.as_deref() != Some("DirectoryOrCreate")
            || paths.iter().any(|path| path.node == node)
        {
            continue;
        }
        let source = node_root().join(node.strip_prefix("/").unwrap_or(&node));
        paths.push(NodePath { node, source });
    }
    paths
}

/// Starts the node's containerd with the node's directories, for the
/// DaemonSet's pod and every pod after it.
pub fn start_containerd(daemon_set: &DaemonSet) -> Result<Containerd> {
    let mut opts = ContainerdOptions::new(NS_NODE, NODE_CNI_BIN_DIR, NODE_CNI_CONF_DIR);
    opts.node_paths = node_paths(daemon_set);
    // The agent's bpffs volume is `Bidirectional`.
    opts.shared_mounts = vec![PathBuf::from(BPFFS)];
    let containerd = Containerd::start(&opts)?;
    info!(
        pid = containerd.pid(),
        "containerd is up in the node, with the node's directories"
    );
    Ok(containerd)
}

/// Imports `archive` into `containerd`; returns the image's name there.
pub fn import_image(containerd: &Containerd, archive: &Path) -> Result<String> {
    let index = Command::new("tar")
        .arg("-xOf")
        .arg(archive)
        .arg("index.json")
        .output()
        .context(|| format!("reading {}", archive.display()))?;
    let index: serde_json::Value = serde_json::from_slice(&index.stdout).map_err(|err| {
        LabError::InvalidOption(format!(
            "{}: no OCI index.json ({err}); build one with `cargo xtask image`",
            archive.display()
        ))
    })?;
    let name = index["manifests"][0]["annotations"]["io.containerd.image.name"]
        .as_str()
        .ok_or_else(|| {
            LabError::InvalidOption(format!(
                "{}: its index names no image (io.containerd.image.name)",
                archive.display()
            ))
        })?
        .to_owned();
    cri::image::import_archive(
        &containerd.socket(),
        containerd.snapshotter().as_str(),
        archive,
        None,
    )?;
    info!(image = %name, archive = %archive.display(), "agent image imported");
    Ok(name)
}

/// What the lab sets, in the pod's terms.
pub struct AgentPodSettings<'a> {
    /// The image's name in containerd.
    pub image: &'a str,
    /// The ConfigMap's data the lab sets (its agent settings).
    pub config: Vec<(String, String)>,
    pub cluster_files: &'a ClusterFiles,
}

/// Runs the DaemonSet's pod through the lab's kubelet and waits until it
/// is ready; the kubelet keeps running it.
pub fn start(
    containerd: &Containerd,
    daemon_set: &DaemonSet,
    config_map: &ConfigMap,
    settings: &AgentPodSettings<'_>,
) -> Result<Child> {
    let mut daemon_set = daemon_set.clone();
    set_image(&mut daemon_set, settings.image);
    let mut config_map = config_map.clone();
    let data = config_map.data.get_or_insert_with(Default::default);
    for (key, value) in &settings.config {
        data.insert(key.clone(), value.clone());
    }
    let pod_name = cluster::AGENT_POD_NAME.to_owned();
    let node = NodeContext {
        node_name: cluster::node_name(),
        host_ip: NODE_PRIMARY_ADDR.to_string(),
        pod_name: pod_name.clone(),
        pod_uid: "00000000-0000-4000-8000-0000000a9e47".to_owned(),
        service_account_dir: settings.cluster_files.service_account_dir(),
        cluster_env: cluster::agent_env()
            .into_iter()
            .filter(|(name, _)| name.starts_with("KUBERNETES_SERVICE_"))
            .collect(),
        node_env: EmulatorProcess::agent_env()
            .into_iter()
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect(),
        log_directory: state_dir()
            .join("pods")
            .join(format!("kube-system_{pod_name}")),
    };
    let mut plan = kubelet::plan(&daemon_set, &[config_map], &node)
        .map_err(|err| LabError::InvalidOption(format!("the DaemonSet's pod: {err}")))?;
    plan.sandbox
        .labels
        .insert(LABEL_NODE_AGENT.to_owned(), "true".to_owned());
    fs::create_dir_all(&node.log_directory)
        .context(|| format!("creating {}", node.log_directory.display()))?;
    fs::write(
        plan_file(),
        serde_json::to_vec_pretty(&plan).expect("plans serialize"),
    )
    .context(|| "writing the agent pod's plan".into())?;
    let bin = helper_process::sibling_binary(KUBELET_BIN)
        .map_err(|err| LabError::InvalidOption(format!("{KUBELET_BIN}: {err:?}")))?;
    let log = fs::File::create(kubelet_log_file())
        .context(|| format!("creating {}", kubelet_log_file().display()))?;
    let mut child = Command::new(&bin)
        .arg("--plan")
        .arg(plan_file())
        .arg("--containerd-socket")
        .arg(containerd.socket())
        .arg("--status")
        .arg(status_file())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group: a Ctrl-C meant for `lab up` must not take
        // down the kubelet the lab leaves running.
        .process_group(0)
        .spawn()
        .context(|| format!("starting {}", bin.display()))?;
    fs::write(kubelet_pid_file(), format!("{}\n", child.id()))
        .context(|| "writing the kubelet's pid file".into())?;
    let stdout = child.stdout.take().expect("piped");
    if let Err(reason) = helper_process::wait_ready(stdout, READY_TIMEOUT) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(LabError::InvalidOption(format!(
            "the agent's pod did not become ready: {reason}\nthe lab's kubelet said:\n{}",
            helper_process::log_tail(&kubelet_log_file())
        )));
    }
    info!(pod = %pod_name, "the agent's pod is ready");
    Ok(child)
}

/// Points every container of `daemon_set` at `image` (what `kustomize
/// edit set image vpcnet=...` does).
fn set_image(daemon_set: &mut DaemonSet, image: &str) {
    if let Some(spec) = daemon_set
        .spec
        .as_mut()
        .and_then(|spec| spec.template.spec.as_mut())
    {
        for container in spec
            .init_containers
            .iter_mut()
            .flatten()
            .chain(spec.containers.iter_mut())
        {
            container.image = Some(image.to_owned());
        }
    }
}

/// Stops the lab's kubelet (the pod stays, for the runtime's teardown).
pub fn stop_kubelet(child: Option<&mut Child>) {
    if let Some(child) = child {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pids fit in i32")),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = child.wait();
    }
}
