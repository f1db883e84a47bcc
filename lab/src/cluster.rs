//! The cluster around the lab's node, in the lab's API server: what EKS,
//! kubelet and the VPC resource controller make before aws-node (or
//! vpcnet) starts, and what the operator applies.
//!
//! - the node's Node (named as EKS names it, its zone, instance type,
//!   provider ID, and kubelet's max pods in its capacity);
//! - its CNINode, as the resource controller makes one per node;
//! - the agent's own Pod in `kube-system` (Events are about it), and the
//!   lab's pods, bound to the node and running as kubelet reports them;
//! - `deploy/kubernetes/rbac.yaml`, applied with kubectl as an operator
//!   applies it;
//! - the agent's in-cluster environment: `KUBERNETES_SERVICE_HOST` is the
//!   `kubernetes` Service's cluster IP, which kube-proxy's rules in the node
//!   send to the API server, and the ServiceAccount's token and CA where
//!   every pod has them.

use std::{
    collections::BTreeMap,
    net::SocketAddrV4,
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::json;
use vpcnet_api::pod::{POD_ENI_ANNOTATION, POD_ENI_RESOURCE};

use crate::{
    addrs::{KUBE_API_ADDR, KUBE_API_PORT, KUBERNETES_SERVICE_IP, NODE_PRIMARY_ADDR, NS_NODE},
    ec2::{
        config::{LAB_AZ, LAB_REGION},
        instance_types,
        resource_controller::ControllerOptions,
    },
    error::{Context, LabError, Result},
    kube::{KubeAdmin, pki::ClusterFiles},
    kube_tools::KUBECTL,
    netns::netns_path,
    options::{ClusterIpService, NamedPod, ServiceBackend},
    state,
};

/// Where every pod finds its ServiceAccount's token, CA and namespace
/// (kube-rs and client-go read these paths, fixed).
pub const SERVICE_ACCOUNT_MOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// The agent's pod, as the DaemonSet would name it.
pub const AGENT_POD_NAME: &str = "vpcnet-lab0";
/// The namespace the agent runs in.
pub const AGENT_NAMESPACE: &str = "kube-system";

/// The node's name, as EKS names nodes: its private DNS name.
pub fn node_name() -> String {
    let dashed = NODE_PRIMARY_ADDR.to_string().replace('.', "-");
    format!("ip-{dashed}.{LAB_REGION}.compute.internal")
}

/// The EKS max-pods value of `instance_type` (its ENIs times their
/// secondary addresses, plus 2 host-network pods), as kubelet is started
/// with on EKS.
pub fn eks_max_pods(instance_type: &str) -> Result<u32> {
    let limits = instance_types::lookup(instance_type)
        .ok_or_else(|| LabError::InvalidOption(format!("unknown instance type {instance_type}")))?;
    Ok(limits.max_enis * (limits.ipv4_per_eni - 1) + 2)
}

/// The `kubernetes` Service as kube-proxy's rules see it: its cluster IP
/// in front of the API server.
pub fn kubernetes_service() -> ClusterIpService {
    ClusterIpService {
        name: "kubernetes".to_owned(),
        addr: SocketAddrV4::new(KUBERNETES_SERVICE_IP, 443),
        backend: ServiceBackend::Remote(SocketAddrV4::new(KUBE_API_ADDR, KUBE_API_PORT)),
    }
}

/// The agent's in-cluster environment (besides the mounted token).
pub fn agent_env() -> Vec<(String, String)> {
    [
        ("KUBERNETES_SERVICE_HOST", KUBERNETES_SERVICE_IP.to_string()),
        ("KUBERNETES_SERVICE_PORT", "443".to_owned()),
        ("MY_NODE_NAME", node_name()),
        ("MY_POD_NAME", AGENT_POD_NAME.to_owned()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

fn api(err: &crate::kube::KubeApiError) -> LabError {
    LabError::InvalidOption(format!("setting the lab's cluster up: {err}"))
}

/// How long a branch ENI outlives its pod in the lab: the resource
/// controller's `branch-eni-cooldown` is 60 s (30 s at least) on EKS; the
/// lab's tests wait for it, so it is short here.
pub const BRANCH_ENI_COOLDOWN: std::time::Duration = std::time::Duration::from_secs(2);

/// The lab's VPC resource controller, for the lab's node.
pub fn resource_controller(admin: &KubeAdmin) -> ControllerOptions {
    ControllerOptions {
        kube_admin_socket: admin.socket().to_path_buf(),
        node_name: node_name(),
        cooldown_ms: u64::try_from(BRANCH_ENI_COOLDOWN.as_millis()).expect("small"),
    }
}

/// Makes what the cluster has before the agent starts.
pub fn bootstrap(
    admin: &KubeAdmin,
    files: &ClusterFiles,
    instance_type: &str,
    instance_id: &str,
) -> Result<()> {
    let name = node_name();
    let max_pods = eks_max_pods(instance_type)?;
    admin
        .apply(
            &format!("/api/v1/nodes/{name}"),
            &json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "node.kubernetes.io/instance-type": instance_type,
                    "topology.kubernetes.io/region": LAB_REGION,
                    "topology.kubernetes.io/zone": LAB_AZ,
                }},
                "spec": {"providerID": format!("aws:///{LAB_AZ}/{instance_id}")},
                "status": {
                    "capacity": {"pods": max_pods.to_string()},
                    "allocatable": {"pods": max_pods.to_string()},
                    "addresses": [{"type": "InternalIP", "address": NODE_PRIMARY_ADDR.to_string()}],
                },
            }),
        )
        .map_err(|e| api(&e))?;
    admin
        .apply(
            &format!("/apis/vpcresources.k8s.aws/v1alpha1/cninodes/{name}"),
            &json!({
                "apiVersion": "vpcresources.k8s.aws/v1alpha1",
                "kind": "CNINode",
                "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux"}},
                "spec": {"tags": {"node.k8s.amazonaws.com/instance_id": instance_id}},
            }),
        )
        .map_err(|e| api(&e))?;
    admin
        .apply(
            &format!("/api/v1/namespaces/{AGENT_NAMESPACE}/pods/{AGENT_POD_NAME}"),
            &json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": AGENT_POD_NAME, "namespace": AGENT_NAMESPACE,
                    "labels": {"app.kubernetes.io/name": "vpcnet"}},
                "spec": {"nodeName": name, "hostNetwork": true, "serviceAccountName": "vpcnet",
                    "containers": [{"name": "vpcnet-agent", "image": "vpcnet:lab"}]},
            }),
        )
        .map_err(|e| api(&e))?;
    apply_with_kubectl(files, &deploy_rbac())
}

/// The namespace the lab's numbered pods are in.
const POD_NAMESPACE: &str = crate::addrs::POD_K8S_NAMESPACE;

/// A pod of the lab as the scheduler leaves it: bound to the node, not
/// yet running.
pub fn bind_pod(admin: &KubeAdmin, name: &str) -> Result<()> {
    bind_named_pod(
        admin,
        &NamedPod {
            namespace: POD_NAMESPACE.to_owned(),
            name: name.to_owned(),
            labels: BTreeMap::new(),
            branch_eni: false,
        },
    )
}

/// The ports every pod the lab binds declares, by name, as the pods of
/// Kubernetes' network policy e2e suite do (`serve-80-tcp`...): policies
/// can name them.
pub const POD_SERVED_PORTS: [u16; 2] = [80, 81];

/// The name a pod's container gives `port` of `protocol` (`TCP`, `UDP`).
#[must_use]
pub fn served_port_name(port: u16, protocol: &str) -> String {
    format!("serve-{port}-{}", protocol.to_ascii_lowercase())
}

/// [`bind_pod`] for `pod`, with its labels (its Namespace made first if
/// the cluster has none), asking for a branch ENI as the resource
/// controller's webhook leaves such a pod if it is a branch-ENI pod.
pub fn bind_named_pod(admin: &KubeAdmin, pod: &NamedPod) -> Result<()> {
    ensure_namespace(admin, &pod.namespace)?;
    let ports: Vec<serde_json::Value> = POD_SERVED_PORTS
        .iter()
        .flat_map(|port| {
            ["TCP", "UDP"].map(|protocol| {
                json!({"name": served_port_name(*port, protocol), "containerPort": port,
                       "protocol": protocol})
            })
        })
        .collect();
    let mut container = json!({"name": "pause", "image": "registry.k8s.io/pause:3.9",
                               "ports": ports});
    if pod.branch_eni {
        container["resources"] = json!({"limits": {POD_ENI_RESOURCE: "1"},
                                        "requests": {POD_ENI_RESOURCE: "1"}});
    }
    admin
        .apply(
            &pod_path(&pod.namespace, &pod.name),
            &json!({
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": pod.namespace, "labels": pod.labels},
                "spec": {"nodeName": node_name(), "containers": [container]},
                "status": {"phase": "Pending"},
            }),
        )
        .map(drop)
        .map_err(|e| api(&e))
}

/// How long the lab's resource controller may take to give a pod its
/// branch ENI (a trunk ENI attached first for the node's first one).
const BRANCH_ENI_TIMEOUT: std::time::Duration = std::time::Duration::from_mins(1);

/// The `vpc.amazonaws.com/pod-eni` annotation the resource controller
/// writes on pod `namespace/name`, awaited (bounded): what kubelet hands
/// the runtime with the pod.
pub fn wait_pod_eni_annotation(admin: &KubeAdmin, namespace: &str, name: &str) -> Result<String> {
    let deadline = std::time::Instant::now() + BRANCH_ENI_TIMEOUT;
    loop {
        let pod = admin.get(&pod_path(namespace, name)).map_err(|e| api(&e))?;
        if let Some(annotation) = pod["metadata"]["annotations"][POD_ENI_ANNOTATION].as_str() {
            return Ok(annotation.to_owned());
        }
        if std::time::Instant::now() >= deadline {
            return Err(LabError::InvalidOption(format!(
                "pod {namespace}/{name}: no {POD_ENI_ANNOTATION} annotation from the resource controller after {BRANCH_ENI_TIMEOUT:?} (is ENABLE_POD_ENI on?)"
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn pod_path(namespace: &str, name: &str) -> String {
    format!("/api/v1/namespaces/{namespace}/pods/{name}")
}

/// Makes Namespace `name` unless it exists (the server gives it its
/// `kubernetes.io/metadata.name` label).
pub fn ensure_namespace(admin: &KubeAdmin, name: &str) -> Result<()> {
    match admin.get(&format!("/api/v1/namespaces/{name}")) {
        Ok(_) => return Ok(()),
        Err(err) if err.code() == Some(404) => {}
        Err(err) => return Err(api(&err)),
    }
    match admin.create(
        "/api/v1/namespaces",
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name},
            "status": {"phase": "Active"}}),
    ) {
        // Made meanwhile by someone else: as good.
        Err(err) if err.code() != Some(409) => Err(api(&err)),
        _ => Ok(()),
    }
}

/// A merge patch of `metadata.labels` (`None` removes a label), as
/// `kubectl label` sends: watchers see the object modified.
fn patch_labels(admin: &KubeAdmin, path: &str, changes: &[(String, Option<String>)]) -> Result<()> {
    let labels: serde_json::Map<String, serde_json::Value> = changes
        .iter()
        .map(|(key, value)| (key.clone(), json!(value)))
        .collect();
    admin
        .merge_patch(path, &json!({"metadata": {"labels": labels}}))
        .map(drop)
        .map_err(|e| api(&e))
}

/// Changes a pod's labels.
pub fn label_pod(
    admin: &KubeAdmin,
    namespace: &str,
    name: &str,
    changes: &[(String, Option<String>)],
) -> Result<()> {
    patch_labels(admin, &pod_path(namespace, name), changes)
}

/// Changes a namespace's labels.
pub fn label_namespace(
    admin: &KubeAdmin,
    namespace: &str,
    changes: &[(String, Option<String>)],
) -> Result<()> {
    patch_labels(admin, &format!("/api/v1/namespaces/{namespace}"), changes)
}

/// The pod's object goes, as once kubelet has stopped it.
pub fn delete_pod(admin: &KubeAdmin, namespace: &str, name: &str) -> Result<()> {
    match admin.delete(&pod_path(namespace, name)) {
        Err(err) if err.code() != Some(404) => Err(api(&err)),
        _ => Ok(()),
    }
}

/// What kubelet reports once the pod's sandbox runs: its address.
pub fn pod_running(admin: &KubeAdmin, name: &str, addr: std::net::Ipv4Addr) -> Result<()> {
    named_pod_running(admin, POD_NAMESPACE, name, addr)
}

/// [`pod_running`] for a pod in `namespace`.
pub fn named_pod_running(
    admin: &KubeAdmin,
    namespace: &str,
    name: &str,
    addr: std::net::Ipv4Addr,
) -> Result<()> {
    admin
        .merge_patch(
            &pod_path(namespace, name),
            &json!({"status": {"phase": "Running", "podIP": addr.to_string(),
                "podIPs": [{"ip": addr.to_string()}], "hostIP": NODE_PRIMARY_ADDR.to_string()}}),
        )
        .map(drop)
        .map_err(|e| api(&e))
}

/// Makes [`SERVICE_ACCOUNT_MOUNT`] if this machine has none (no pod runs on
/// it), so the agent's mount namespace can bind the lab's token there;
/// records what it made for [`remove_service_account_mount`].
pub fn make_service_account_mount() -> Result<()> {
    let mount = Path::new(SERVICE_ACCOUNT_MOUNT);
    if mount.exists() {
        return Ok(());
    }
    let mut top = mount;
    while let Some(parent) = top.parent()
        && !parent.exists()
    {
        top = parent;
    }
    std::fs::create_dir_all(mount).context(|| format!("creating {SERVICE_ACCOUNT_MOUNT}"))?;
    std::fs::write(
        state::service_account_mount_marker(),
        top.as_os_str().as_encoded_bytes(),
    )
    .context(|| "recording the mount point made".to_owned())
}

/// Removes what [`make_service_account_mount`] made (empty directories
/// only: nothing is mounted there outside the agent's own namespace).
pub fn remove_service_account_mount() -> Result<()> {
    let marker = state::service_account_mount_marker();
    let Ok(top) = std::fs::read_to_string(&marker) else {
        return Ok(());
    };
    let top = Path::new(&top);
    let mut dir = Path::new(SERVICE_ACCOUNT_MOUNT);
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => {}
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(LabError::Io {
                    context: format!("removing {}", dir.display()),
                    source,
                });
            }
        }
        if dir == top {
            break;
        }
        match dir.parent() {
            Some(parent) => dir = parent,
            None => break,
        }
    }
    std::fs::remove_file(&marker).context(|| format!("removing {}", marker.display()))
}

/// The command prefix that runs the agent in its own mount namespace with
/// the lab's ServiceAccount files bound at [`SERVICE_ACCOUNT_MOUNT`], as a
/// pod's are: `unshare` and `sh` exec in turn, so the agent keeps the pid
/// the lab started.
pub fn service_account_prefix(files: &ClusterFiles) -> Vec<String> {
    [
        "unshare",
        "--mount",
        "--propagation",
        "slave",
        "--",
        "sh",
        "-c",
        r#"mount --bind "$1" "$2" && shift 2 && exec "$@""#,
        "sh",
    ]
    .into_iter()
    .map(str::to_owned)
    .chain([
        files.service_account_dir().display().to_string(),
        SERVICE_ACCOUNT_MOUNT.to_owned(),
    ])
    .collect()
}

/// The deployment's RBAC manifest.
pub fn deploy_rbac() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/rbac.yaml")
}

/// `kubectl apply -f <manifest>` as the cluster's administrator, from the
/// node (the API server's address is reached through the VPC router).
pub fn apply_with_kubectl(files: &ClusterFiles, manifest: &Path) -> Result<()> {
    let manifest = manifest.display().to_string();
    kubectl(files, &["apply", "-f", &manifest], None).map(drop)
}

/// `kubectl <args>` as the cluster's administrator, from the node, with
/// `stdin` on its standard input (`-f -`); what it printed.
pub fn kubectl(files: &ClusterFiles, args: &[&str], stdin: Option<&str>) -> Result<String> {
    use std::io::Write as _;
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", netns_path(NS_NODE).display()))
        .arg(KUBECTL)
        .arg("--kubeconfig")
        .arg(files.admin_kubeconfig())
        .arg("--cache-dir")
        .arg(files.dir().join("kubectl-cache"))
        .arg("--request-timeout=20s")
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|source| LabError::Io {
            context: format!("running {KUBECTL}"),
            source,
        })?;
    let mut input = child.stdin.take().expect("piped");
    if let Some(text) = stdin {
        input
            .write_all(text.as_bytes())
            .context(|| "writing kubectl's input".to_owned())?;
    }
    drop(input);
    let output = child.wait_with_output().map_err(|source| LabError::Io {
        context: format!("running {KUBECTL}"),
        source,
    })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(LabError::CommandFailed {
            command: format!("kubectl {}", args.join(" ")),
            status: output.status.to_string(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_node_is_named_and_sized_as_on_eks() {
        assert_eq!(node_name(), "ip-10-20-11-162.us-west-2.compute.internal");
        // The EKS max-pods table: m5.large 29, t3.medium 17.
        assert_eq!(eks_max_pods("m5.large").unwrap(), 29);
        assert_eq!(eks_max_pods("t3.medium").unwrap(), 17);
    }
}
