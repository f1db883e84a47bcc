//! A blocking CRI `runtime.v1` client on containerd's Unix socket, making
//! the pod-sandbox calls kubelet makes, with the fields kubelet fills.
//!
//! The lab's library is not async: the client owns a current-thread tokio
//! runtime and blocks on each call.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use tonic::transport::{Channel, Endpoint, Uri};
use tracing::debug;

use super::{
    Context, CriError, Result,
    containerd::POD_CGROUP_PARENT,
    proto::{self, runtime_service_client::RuntimeServiceClient},
};

/// Kubelet's default `--runtime-request-timeout`; `RunPodSandbox` includes
/// the CNI ADD, which may wait for the agent to find an address.
const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_mins(2);
/// How long connecting to the socket may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The CRI API version kubelet asks for.
const CRI_API_VERSION: &str = "v1";

/// The labels kubelet puts on every sandbox (containerd passes them on, and
/// `crictl` shows them).
pub const LABEL_POD_NAME: &str = "io.kubernetes.pod.name";
pub const LABEL_POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
pub const LABEL_POD_UID: &str = "io.kubernetes.pod.uid";

/// A pod as kubelet describes it to the runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    pub uid: String,
    /// Pod annotations: containerd hands them to CNI plugins in
    /// `runtimeConfig` (`io.kubernetes.cri.pod-annotations`).
    pub annotations: BTreeMap<String, String>,
    /// Pod labels, besides the `io.kubernetes.pod.*` ones added here.
    pub labels: BTreeMap<String, String>,
    /// `hostPort`s: containerd hands them to CNI plugins in `runtimeConfig`
    /// (`portMappings`).
    pub port_mappings: Vec<PortMapping>,
    /// Written into the sandbox's `resolv.conf`; `None` gives none.
    pub dns: Option<DnsConfig>,
    /// Kubelet's sandbox attempt counter (0 for the first sandbox of a pod).
    pub attempt: u32,
    /// `hostNetwork`: the sandbox is in the runtime's own network
    /// namespace (the node's), and no CNI plugin runs for it.
    pub host_network: bool,
    /// Some container of the pod is privileged (kubelet then asks for a
    /// privileged sandbox).
    pub privileged: bool,
    /// Where the runtime writes the containers' output (kubelet's
    /// `/var/log/pods/<namespace>_<name>_<uid>`); `None` for a pod that
    /// runs no containers.
    pub log_directory: Option<PathBuf>,
}

impl PodSpec {
    /// A pod with nothing but its identity.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            namespace: namespace.into(),
            uid: uid.into(),
            ..Self::default()
        }
    }
}

/// A `hostPort` mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PortMapping {
    pub protocol: Protocol,
    pub container_port: u16,
    pub host_port: u16,
}

/// A port mapping's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Protocol {
    Tcp,
    Udp,
}

/// A pod's DNS settings (`dnsConfig`, merged with the cluster's by kubelet).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DnsConfig {
    pub servers: Vec<String>,
    pub searches: Vec<String>,
    pub options: Vec<String>,
}

/// What the runtime says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeVersion {
    pub runtime_name: String,
    pub runtime_version: String,
    pub runtime_api_version: String,
}

/// A sandbox's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxState {
    Ready,
    NotReady,
}

impl SandboxState {
    fn from_proto(state: i32) -> Self {
        if state == proto::PodSandboxState::SandboxReady as i32 {
            Self::Ready
        } else {
            Self::NotReady
        }
    }
}

/// One sandbox of `ListPodSandbox`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxSummary {
    pub id: String,
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub state: SandboxState,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
}

/// `PodSandboxStatus`, verbose.
#[derive(Debug, Clone, PartialEq)]
pub struct SandboxStatus {
    pub id: String,
    pub name: String,
    pub namespace: String,
    pub uid: String,
    pub state: SandboxState,
    /// The pod's address (`status.network.ip`): the first IP of the CNI
    /// result. `None` when it has none (stopped, or host network).
    pub ip: Option<IpAddr>,
    pub additional_ips: Vec<IpAddr>,
    /// The bind mount of the sandbox's network namespace, from the
    /// runtime spec in the verbose info (`None` once the sandbox stopped).
    pub netns: Option<PathBuf>,
    /// containerd's verbose info (`info` key) as JSON: the runtime spec, the
    /// CNI result, the pid of the pause process, ...
    pub info: serde_json::Value,
}

/// A CRI client on a runtime's Unix socket. Calls block.
#[derive(Debug)]
pub struct CriClient {
    runtime: tokio::runtime::Runtime,
    service: RuntimeServiceClient<Channel>,
    socket: PathBuf,
    call_timeout: Duration,
}

impl CriClient {
    /// Connects to the runtime's socket (it must accept now).
    pub fn connect(socket: impl AsRef<Path>) -> Result<Self> {
        let socket = socket.as_ref().to_owned();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context(|| "building the CRI client's runtime".into())?;
        let connector_socket = socket.clone();
        // The URI is required by the API and unused: the connector dials the socket.
        let endpoint = Endpoint::from_static("http://containerd").connect_timeout(CONNECT_TIMEOUT);
        let channel = runtime
            .block_on(
                endpoint.connect_with_connector(tower::service_fn(move |_: Uri| {
                    let socket = connector_socket.clone();
                    async move {
                        tokio::net::UnixStream::connect(socket)
                            .await
                            .map(hyper_util::rt::TokioIo::new)
                    }
                })),
            )
            .map_err(|source| CriError::Connect {
                socket: socket.clone(),
                source,
            })?;
        Ok(Self {
            runtime,
            service: RuntimeServiceClient::new(channel),
            socket,
            call_timeout: DEFAULT_CALL_TIMEOUT,
        })
    }

    /// The same client with another limit on each call (kubelet's
    /// `--runtime-request-timeout`; 2 minutes by default).
    #[must_use]
    pub fn with_call_timeout(mut self, timeout: Duration) -> Self {
        self.call_timeout = timeout;
        self
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Version: the runtime's name and versions.
    pub fn version(&self) -> Result<RuntimeVersion> {
        let reply = self.call(
            "Version",
            |mut service, request| async move { service.version(request).await },
            proto::VersionRequest {
                version: CRI_API_VERSION.to_owned(),
            },
        )?;
        Ok(RuntimeVersion {
            runtime_name: reply.runtime_name,
            runtime_version: reply.runtime_version,
            runtime_api_version: reply.runtime_api_version,
        })
    }

    /// `RunPodSandbox`: creates the pod's sandbox (the CNI ADD happens here)
    /// and returns its id.
    pub fn run_pod_sandbox(&self, pod: &PodSpec) -> Result<String> {
        let request = proto::RunPodSandboxRequest {
            config: Some(sandbox_config(pod)),
            // The runtime's default handler (runc), as for a pod without
            // a RuntimeClass.
            runtime_handler: String::new(),
        };
        let reply = self.call(
            "RunPodSandbox",
            |mut service, request| async move { service.run_pod_sandbox(request).await },
            request,
        )?;
        if reply.pod_sandbox_id.is_empty() {
            return Err(CriError::BadResponse {
                call: "RunPodSandbox",
                reason: "no sandbox id".into(),
            });
        }
        debug!(pod = %pod.name, namespace = %pod.namespace, id = %reply.pod_sandbox_id, "sandbox running");
        Ok(reply.pod_sandbox_id)
    }

    /// `StopPodSandbox`: kills the sandbox's processes and tears its network
    /// down (the CNI DEL). Stopping a stopped sandbox succeeds, as kubelet
    /// expects.
    pub fn stop_pod_sandbox(&self, id: &str) -> Result<()> {
        self.call(
            "StopPodSandbox",
            |mut service, request| async move { service.stop_pod_sandbox(request).await },
            proto::StopPodSandboxRequest {
                pod_sandbox_id: id.to_owned(),
            },
        )?;
        Ok(())
    }

    /// `RemovePodSandbox`: forgets a stopped sandbox. Removing one that is
    /// gone succeeds.
    pub fn remove_pod_sandbox(&self, id: &str) -> Result<()> {
        self.call(
            "RemovePodSandbox",
            |mut service, request| async move { service.remove_pod_sandbox(request).await },
            proto::RemovePodSandboxRequest {
                pod_sandbox_id: id.to_owned(),
            },
        )?;
        Ok(())
    }

    /// `PodSandboxStatus` with `verbose`, so the network namespace can be
    /// read from the runtime spec.
    pub fn pod_sandbox_status(&self, id: &str) -> Result<SandboxStatus> {
        const CALL: &str = "PodSandboxStatus";
        let reply = self.call(
            CALL,
            |mut service, request| async move { service.pod_sandbox_status(request).await },
            proto::PodSandboxStatusRequest {
                pod_sandbox_id: id.to_owned(),
                verbose: true,
            },
        )?;
        let status = reply.status.ok_or_else(|| CriError::BadResponse {
            call: CALL,
            reason: "no status".into(),
        })?;
        let info = verbose_info(CALL, &reply.info)?;
        let network = status.network.unwrap_or_default();
        let ip = parse_ip(CALL, &network.ip)?;
        let additional_ips = network
            .additional_ips
            .iter()
            .filter_map(|pod_ip| parse_ip(CALL, &pod_ip.ip).transpose())
            .collect::<Result<_>>()?;
        let metadata = status.metadata.unwrap_or_default();
        Ok(SandboxStatus {
            id: status.id,
            name: metadata.name,
            namespace: metadata.namespace,
            uid: metadata.uid,
            state: SandboxState::from_proto(status.state),
            ip,
            additional_ips,
            netns: network_namespace_path(&info),
            info,
        })
    }

    /// `ListPodSandbox`, unfiltered.
    pub fn list_pod_sandboxes(&self) -> Result<Vec<SandboxSummary>> {
        let reply = self.call(
            "ListPodSandbox",
            |mut service, request| async move { service.list_pod_sandbox(request).await },
            proto::ListPodSandboxRequest { filter: None },
        )?;
        Ok(reply
            .items
            .into_iter()
            .map(|sandbox| {
                let metadata = sandbox.metadata.unwrap_or_default();
                SandboxSummary {
                    id: sandbox.id,
                    name: metadata.name,
                    namespace: metadata.namespace,
                    uid: metadata.uid,
                    state: SandboxState::from_proto(sandbox.state),
                    labels: sandbox.labels.into_iter().collect(),
                    annotations: sandbox.annotations.into_iter().collect(),
                }
            })
            .collect())
    }

    /// Runs one unary call with the call limit, both as the gRPC deadline
    /// (the runtime gives up too) and locally (a runtime that hangs).
    pub(super) fn call<Req, Resp, F, Fut>(
        &self,
        call: &'static str,
        f: F,
        message: Req,
    ) -> Result<Resp>
    where
        F: FnOnce(RuntimeServiceClient<Channel>, tonic::Request<Req>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.call_timeout);
        let reply = self.runtime.block_on(async {
            tokio::time::timeout(self.call_timeout, f(self.service.clone(), request)).await
        });
        match reply {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(CriError::Rpc {
                call,
                code: status.code(),
                message: status.message().to_owned(),
            }),
            Err(_) => Err(CriError::RpcTimeout {
                call,
                waited: self.call_timeout,
            }),
        }
    }
}

/// The sandbox configuration kubelet sends for `pod` (its
/// `generatePodSandboxConfig`), minus what the lab has no use for.
pub(super) fn sandbox_config(pod: &PodSpec) -> proto::PodSandboxConfig {
    let mut labels: HashMap<String, String> = pod.labels.clone().into_iter().collect();
    labels.insert(LABEL_POD_NAME.into(), pod.name.clone());
    labels.insert(LABEL_POD_NAMESPACE.into(), pod.namespace.clone());
    labels.insert(LABEL_POD_UID.into(), pod.uid.clone());
    proto::PodSandboxConfig {
        metadata: Some(proto::PodSandboxMetadata {
            name: pod.name.clone(),
            uid: pod.uid.clone(),
            namespace: pod.namespace.clone(),
            attempt: pod.attempt,
        }),
        // kubelet names the host of a pod with a network of its own; a
        // host-network pod has the node's.
        hostname: if pod.host_network {
            String::new()
        } else {
            pod.name.clone()
        },
        log_directory: pod
            .log_directory
            .as_ref()
            .map(|dir| dir.display().to_string())
            .unwrap_or_default(),
        dns_config: pod.dns.as_ref().map(|dns| proto::DnsConfig {
            servers: dns.servers.clone(),
            searches: dns.searches.clone(),
            options: dns.options.clone(),
        }),
        port_mappings: pod
            .port_mappings
            .iter()
            .map(|mapping| proto::PortMapping {
                protocol: match mapping.protocol {
                    Protocol::Tcp => proto::Protocol::Tcp,
                    Protocol::Udp => proto::Protocol::Udp,
                } as i32,
                container_port: i32::from(mapping.container_port),
                host_port: i32::from(mapping.host_port),
                host_ip: String::new(),
            })
            .collect(),
        labels,
        annotations: pod.annotations.clone().into_iter().collect(),
        linux: Some(proto::LinuxPodSandboxConfig {
            // Kubelet's is the pod's QoS cgroup; the lab's is its own, so
            // a teardown finds every pause process under it.
            cgroup_parent: POD_CGROUP_PARENT.to_owned(),
            security_context: Some(proto::LinuxSandboxSecurityContext {
                namespace_options: Some(namespace_options(pod)),
                readonly_rootfs: false,
                supplemental_groups: Vec::new(),
                privileged: pod.privileged,
            }),
            sysctls: HashMap::new(),
        }),
    }
}

/// A verbose status's runtime details: containerd's JSON under `info`.
pub(super) fn verbose_info(
    call: &'static str,
    info: &HashMap<String, String>,
) -> Result<serde_json::Value> {
    match info.get("info") {
        Some(json) => serde_json::from_str(json).map_err(|err| CriError::BadResponse {
            call,
            reason: format!("the verbose info is not JSON: {err}"),
        }),
        None => Ok(serde_json::Value::Null),
    }
}

/// The pod's namespaces: the node's network for `hostNetwork`, the pod's
/// own otherwise; a PID namespace per container, an IPC one per pod.
pub(super) fn namespace_options(pod: &PodSpec) -> proto::NamespaceOption {
    proto::NamespaceOption {
        network: if pod.host_network {
            proto::NamespaceMode::Node
        } else {
            proto::NamespaceMode::Pod
        } as i32,
        pid: proto::NamespaceMode::Container as i32,
        ipc: proto::NamespaceMode::Pod as i32,
        target_id: String::new(),
    }
}

fn parse_ip(call: &'static str, text: &str) -> Result<Option<IpAddr>> {
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| CriError::BadResponse {
        call,
        reason: format!("{text:?} is not an IP address"),
    })
}

/// The path of the `network` namespace in containerd's verbose info:
/// `runtimeSpec.linux.namespaces[type == "network"].path`.
fn network_namespace_path(info: &serde_json::Value) -> Option<PathBuf> {
    info.pointer("/runtimeSpec/linux/namespaces")?
        .as_array()?
        .iter()
        .find(|ns| ns.get("type").and_then(serde_json::Value::as_str) == Some("network"))?
        .get("path")?
        .as_str()
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netns_path_is_read_from_the_runtime_spec() {
        let info = serde_json::json!({
            "pid": 42,
            "runtimeSpec": {"linux": {"namespaces": [
                {"type": "pid"},
                {"type": "network", "path": "/run/vpcnet-lab/containerd/netns/cni-1"},
                {"type": "ipc"},
            ]}},
        });
        assert_eq!(
            network_namespace_path(&info),
            Some(PathBuf::from("/run/vpcnet-lab/containerd/netns/cni-1"))
        );
        assert_eq!(network_namespace_path(&serde_json::Value::Null), None);
        let host_network =
            serde_json::json!({"runtimeSpec": {"linux": {"namespaces": [{"type": "pid"}]}}});
        assert_eq!(network_namespace_path(&host_network), None);
    }

    #[test]
    fn sandbox_config_carries_what_kubelet_sends() {
        let mut pod = PodSpec::new("kube-system", "web-0", "0b3c-uid");
        pod.annotations.insert("k".into(), "v".into());
        pod.port_mappings.push(PortMapping {
            protocol: Protocol::Udp,
            container_port: 53,
            host_port: 1053,
        });
        let config = sandbox_config(&pod);
        let metadata = config.metadata.as_ref().unwrap();
        assert_eq!(
            (
                metadata.name.as_str(),
                metadata.namespace.as_str(),
                metadata.uid.as_str()
            ),
            ("web-0", "kube-system", "0b3c-uid")
        );
        assert_eq!(config.hostname, "web-0");
        assert_eq!(config.labels[LABEL_POD_NAMESPACE], "kube-system");
        assert_eq!(config.annotations["k"], "v");
        assert_eq!(
            config.port_mappings[0].protocol,
            proto::Protocol::Udp as i32
        );
        assert_eq!(config.port_mappings[0].host_port, 1053);
        assert_eq!(config.linux.unwrap().cgroup_parent, POD_CGROUP_PARENT);
    }
}
