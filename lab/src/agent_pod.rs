//! The agent as the DaemonSet's pod (`lab up --agent-image ARCHIVE`): the
//! image archive imported into the node's containerd; vpcnet's DaemonSet,
//! the rollback's and their ConfigMap rendered from `deploy/` as an
//! operator renders them (`kubectl kustomize` or `helm template`), the
//! image set to the archive's and the ConfigMap's data to the lab's
//! settings, and applied to the lab's API server with `kubectl apply`.
//! The lab's kubelet ([`crate::kubelet`], in the helper process
//! `vpcnet-lab-kubelet`) then runs on the node the pod of whichever
//! DaemonSet admits it by its label `vpcnet.dev/cni` (`kubectl label
//! node`), and rolls it when its template changes: its init container
//! installs the plugins, the agent writes the conflist containerd then
//! uses for every pod.
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
    time::{Duration, Instant},
};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::ConfigMap};
use serde::{Deserialize, Serialize};
use tracing::info;
use vpcnet_deploy::node_selection::NODE_LABEL;
/// The label values that move the node (`vpcnet.dev/cni`).
pub use vpcnet_deploy::node_selection::{ON_VPCNET, ROLLBACK};

use crate::{
    addrs::{NODE_PRIMARY_ADDR, NS_NODE},
    cluster,
    cri::{self, Containerd, ContainerdOptions, LABEL_NODE_AGENT, NodePath},
    cri_pods::{cni_bin_dir, cni_conf_dir},
    ec2::EmulatorProcess,
    error::{Context, LabError, Result},
    helper_process,
    kube::pki::ClusterFiles,
    kube_tools::{HELM, KUBECTL},
    kubelet::{NodeContext, NodeTemplate, PodStatus},
    options::{AgentImage, Manifests},
    state::{aws_node_run_dir, state_dir},
};

/// The helper binary that runs and keeps the node's DaemonSet pods.
pub const KUBELET_BIN: &str = "vpcnet-lab-kubelet";

/// The names `deploy/` gives vpcnet's DaemonSet and the rollback's (the
/// kustomization's, and the chart's with the release `vpcnet`).
pub const AGENT_DAEMON_SET: &str = "vpcnet";
pub const ROLLBACK_DAEMON_SET: &str = "vpcnet-rollback";
/// The Helm release the lab installs the chart as.
const HELM_RELEASE: &str = "vpcnet";

/// Where the node keeps the CNI configuration and plugins (containerd's
/// defaults, and the DaemonSet's host paths).
const NODE_CNI_CONF_DIR: &str = "/etc/cni/net.d";
const NODE_CNI_BIN_DIR: &str = "/opt/cni/bin";
/// aws-node's directory on the node (its checkpoint).
const NODE_AWS_NODE_DIR: &str = "/var/run/aws-node";

/// The node's BPF file system.
const BPFFS: &str = "/sys/fs/bpf";
/// The machine's xtables lock, which the node shares.
const XTABLES_LOCK: &str = "/run/xtables.lock";

/// How long a pod has to become ready (its readiness probe runs every
/// 10 s; an image's first start, or a rollback's init container).
pub const READY_TIMEOUT: Duration = Duration::from_mins(3);

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
fn node_template_file() -> PathBuf {
    state_dir().join("kubelet-node.json")
}
/// Where the lab's kubelet writes the node's pods' status.
pub fn status_file() -> PathBuf {
    state_dir().join("node-pods-status.json")
}

/// The node's DaemonSet pods as the lab's kubelet last wrote them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePods {
    pub pods: Vec<PodStatus>,
    /// The last reconcile's failure, if it failed.
    pub error: Option<String>,
}

impl NodePods {
    /// The pod of `daemon_set`, if the node runs one.
    #[must_use]
    pub fn of(&self, daemon_set: &str) -> Option<&PodStatus> {
        self.pods.iter().find(|pod| pod.daemon_set == daemon_set)
    }
}

/// The node's pods as the lab's kubelet last wrote them.
pub fn status() -> Result<NodePods> {
    let text = fs::read(status_file()).context(|| "reading the node's pods' status".into())?;
    serde_json::from_slice(&text)
        .map_err(|err| LabError::InvalidOption(format!("the node's pods' status: {err}")))
}

/// The agent's pod (vpcnet's DaemonSet's), as the lab's kubelet last
/// wrote it.
pub fn agent_status() -> Result<PodStatus> {
    status()?
        .of(AGENT_DAEMON_SET)
        .cloned()
        .ok_or_else(|| LabError::InvalidOption("the node runs no pod of vpcnet's DaemonSet".into()))
}

/// Waits until the node's pods are as `done` says (the lab's kubelet
/// writes their status at each change), at most `timeout`.
pub fn wait_for(
    what: &str,
    timeout: Duration,
    done: impl Fn(&NodePods) -> bool,
) -> Result<NodePods> {
    let deadline = Instant::now() + timeout;
    loop {
        let pods = status().unwrap_or_default();
        if done(&pods) {
            return Ok(pods);
        }
        if Instant::now() >= deadline {
            return Err(LabError::InvalidOption(format!(
                "{what}: not within {timeout:?}; last {pods:?}\nthe lab's kubelet said:\n{}",
                helper_process::log_tail(&kubelet_log_file())
            )));
        }
        // The kubelet's relist period is a second; its file is the event.
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What `deploy/` renders for the node: vpcnet's DaemonSet, the
/// rollback's, and their ConfigMap.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub agent: DaemonSet,
    pub rollback: DaemonSet,
    pub config_map: ConfigMap,
}

/// `deploy/` rendered as `image` says: by `kubectl kustomize` (vpcnet's
/// kustomization and the rollback's) or `helm template` (the rollback
/// enabled), from the working tree or from the commit `image` names.
pub fn render(image: &AgentImage) -> Result<Rendered> {
    let deploy = deploy_dir(image.deploy_commit.as_deref())?;
    let invalid = |err: vpcnet_deploy::ManifestError| LabError::InvalidOption(err.to_string());
    let rendered = |command: &mut Command, what: &str| -> Result<vpcnet_deploy::Objects> {
        let text = vpcnet_deploy::output_of(command).map_err(invalid)?;
        vpcnet_deploy::objects(&text, what).map_err(invalid)
    };
    let (agent, rollback) = match image.manifests {
        Manifests::Kustomize => {
            let kustomize = |sub: &str| {
                let dir = deploy.join(sub);
                rendered(
                    Command::new(KUBECTL).arg("kustomize").arg(&dir),
                    &format!("kubectl kustomize {}", dir.display()),
                )
            };
            (kustomize("kubernetes")?, kustomize("kubernetes/rollback")?)
        }
        Manifests::Helm => {
            let chart = deploy.join("helm/vpcnet");
            let all = rendered(
                Command::new(HELM)
                    .args(["template", HELM_RELEASE])
                    .arg(&chart)
                    .args([
                        "--namespace",
                        "kube-system",
                        "--set",
                        "rollback.enabled=true",
                    ]),
                &format!("helm template {}", chart.display()),
            )?;
            (all.clone(), all)
        }
    };
    Ok(Rendered {
        agent: agent.daemon_set_named(AGENT_DAEMON_SET).clone(),
        rollback: rollback.daemon_set_named(ROLLBACK_DAEMON_SET).clone(),
        config_map: agent.config_map().clone(),
    })
}

/// The `deploy/` directory of the working tree, or of `commit` (written
/// out with `git archive` into the lab's state directory).
fn deploy_dir(commit: Option<&str>) -> Result<PathBuf> {
    let working_tree = Path::new(vpcnet_deploy::DEPLOY_DIR);
    let Some(commit) = commit else {
        return Ok(working_tree.to_owned());
    };
    let into = state_dir().join(format!("deploy-{commit}"));
    if !into.join("deploy").is_dir() {
        fs::create_dir_all(&into).context(|| format!("creating {}", into.display()))?;
        let repo = working_tree.parent().unwrap_or(working_tree);
        let archive = Command::new("git")
            .arg("-C")
            .arg(repo)
            .args(["archive", "--format=tar", commit, "deploy"])
            .output()
            .context(|| format!("git archive {commit} deploy"))?;
        if !archive.status.success() {
            return Err(LabError::InvalidOption(format!(
                "git archive {commit} deploy: {}",
                String::from_utf8_lossy(&archive.stderr).trim()
            )));
        }
        let mut tar = Command::new("tar")
            .arg("-xf")
            .arg("-")
            .arg("-C")
            .arg(&into)
            .stdin(Stdio::piped())
            .spawn()
            .context(|| "running tar".into())?;
        std::io::Write::write_all(tar.stdin.as_mut().expect("piped"), &archive.stdout)
            .context(|| "writing to tar".into())?;
        drop(tar.stdin.take());
        let extracted = tar.wait().context(|| "running tar".into())?;
        if !extracted.success() {
            return Err(LabError::InvalidOption(format!(
                "extracting deploy/ of {commit}: tar {extracted}"
            )));
        }
    }
    Ok(into.join("deploy"))
}

/// The DaemonSet's host paths the node makes (`DirectoryOrCreate`), each
/// a lab directory: the CNI ones and aws-node's where the lab's helpers
/// read them.
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
        NodePath {
            node: NODE_AWS_NODE_DIR.into(),
            source: aws_node_run_dir(),
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
/// DaemonSet pods and every pod after them.
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

/// Applies `rendered` to the cluster with `kubectl apply --server-side`,
/// as an operator does: every container's image set to `image` (what
/// `kustomize edit set image` or the chart's `image` values do), the
/// ConfigMap's data added to (the lab's settings, as an operator edits
/// it).
pub fn apply(
    files: &ClusterFiles,
    rendered: &Rendered,
    image: &str,
    config: &[(String, String)],
) -> Result<()> {
    let mut agent = rendered.agent.clone();
    let mut rollback = rendered.rollback.clone();
    set_image(&mut agent, image);
    set_image(&mut rollback, image);
    let mut config_map = rendered.config_map.clone();
    let data = config_map.data.get_or_insert_with(Default::default);
    for (key, value) in config {
        data.insert(key.clone(), value.clone());
    }
    let list = serde_json::json!({
        "apiVersion": "v1",
        "kind": "List",
        "items": [config_map, agent, rollback],
    });
    let said = cluster::kubectl(
        files,
        &[
            "apply",
            "--server-side",
            "--force-conflicts",
            // The lab's API server publishes no OpenAPI schema to validate by.
            "--validate=false",
            "-f",
            "-",
        ],
        Some(&list.to_string()),
    )?;
    info!(image, said = %said.trim(), "vpcnet's DaemonSets applied");
    Ok(())
}

/// `kubectl label node <the node> vpcnet.dev/cni=<value> --overwrite`, or
/// `vpcnet.dev/cni-` for `None`: moves the node between aws-node,
/// vpcnet and the rollback.
pub fn label_node(files: &ClusterFiles, value: Option<&str>) -> Result<()> {
    let label = value.map_or_else(|| format!("{NODE_LABEL}-"), |v| format!("{NODE_LABEL}={v}"));
    let said = cluster::kubectl(
        files,
        &[
            "label",
            "node",
            &cluster::node_name(),
            &label,
            "--overwrite",
        ],
        None,
    )?;
    info!(said = %said.trim(), "node labelled");
    Ok(())
}

/// Starts the lab's kubelet for the node's DaemonSet pods (the node's
/// paths those of `rendered`'s vpcnet DaemonSet) and waits until the pods
/// the node's labels call for are ready; it keeps them running.
pub fn start_kubelet(
    containerd: &Containerd,
    rendered: &Rendered,
    files: &ClusterFiles,
    admin_socket: &Path,
) -> Result<Child> {
    let node_name = cluster::node_name();
    let mut creatable_host_paths: Vec<PathBuf> = node_paths(&rendered.agent)
        .iter()
        .map(|path| path.node.clone())
        .collect();
    creatable_host_paths.push(PathBuf::from(XTABLES_LOCK));
    let template = NodeTemplate {
        context: NodeContext {
            node_name,
            host_ip: NODE_PRIMARY_ADDR.to_string(),
            pod_name: String::new(),
            pod_uid: String::new(),
            service_account_dir: files.service_account_dir(),
            cluster_env: cluster::agent_env()
                .into_iter()
                .filter(|(name, _)| name.starts_with("KUBERNETES_SERVICE_"))
                .collect(),
            node_env: EmulatorProcess::agent_env()
                .into_iter()
                .map(|(name, value)| (name.to_owned(), value.to_owned()))
                .collect(),
            log_directory: PathBuf::new(),
        },
        log_root: state_dir().join("pods"),
        creatable_host_paths,
        sandbox_labels: [(LABEL_NODE_AGENT.to_owned(), "true".to_owned())].into(),
    };
    fs::write(
        node_template_file(),
        serde_json::to_vec_pretty(&template).expect("templates serialize"),
    )
    .context(|| "writing the kubelet's node template".into())?;
    let bin = helper_process::sibling_binary(KUBELET_BIN)
        .map_err(|err| LabError::InvalidOption(format!("{KUBELET_BIN}: {err:?}")))?;
    let log = fs::File::create(kubelet_log_file())
        .context(|| format!("creating {}", kubelet_log_file().display()))?;
    let mut child = Command::new(&bin)
        .arg("--node")
        .arg(node_template_file())
        .arg("--containerd-socket")
        .arg(containerd.socket())
        .arg("--kube-admin-socket")
        .arg(admin_socket)
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
            "the node's DaemonSet pods did not become ready: {reason}\nthe lab's kubelet said:\n{}",
            helper_process::log_tail(&kubelet_log_file())
        )));
    }
    info!("the node's DaemonSet pods are ready");
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

/// Stops the lab's kubelet (the pods stay, for the runtime's teardown).
pub fn stop_kubelet(child: Option<&mut Child>) {
    if let Some(child) = child {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pids fit in i32")),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = child.wait();
    }
}
