//! The CNI backend on a Unix socket: the plugin's ADD and DEL become the
//! address manager's assign and release plus the pod's datapath entry
//! ([`crate::pods`]); CHECK, GC and STATUS ask about them. The socket is
//! root's alone (mode 0600): whoever can talk to it can take addresses.

use std::{
    os::unix::fs::PermissionsExt,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
};

use tokio::{net::UnixListener, sync::Notify};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use vpcnet_api::cni::{
    AddNetworkReply, AddNetworkRequest, Attachment, CheckNetworkReply, CheckNetworkRequest,
    DelNetworkReply, DelNetworkRequest, IpamEvent, IpamStatusReply, IpamStatusRequest,
    ListAttachmentsReply, ListAttachmentsRequest, PodKey, StatusReply, StatusRequest,
    cni_backend_server::{CniBackend, CniBackendServer},
};

use crate::{
    ipam::{
        checkpoint::{DEFAULT_NETWORK_NAME, IpamKey, IpamMetadata},
        manager::ManagerError,
    },
    pods::{PodError, Pods},
};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("listening on {path}")]
    Listen {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("serving the CNI backend")]
    Serve(#[from] tonic::transport::Error),
}

struct Backend {
    pods: Pods,
    in_flight: Arc<InFlight>,
}

/// Requests being served: at SIGTERM the agent lets them finish (an ADD
/// cut short would leave the plugin to undo it) but does not wait for idle
/// connections.
#[derive(Debug, Default)]
pub struct InFlight {
    count: AtomicUsize,
    idle: Notify,
}

/// One request being served; dropping it ends it.
struct Serving(Arc<InFlight>);

impl InFlight {
    fn enter(self: &Arc<Self>) -> Serving {
        self.count.fetch_add(1, Ordering::SeqCst);
        Serving(Arc::clone(self))
    }

    /// Waits until no request is being served, at most `timeout`; whether
    /// that happened.
    pub async fn wait_idle(&self, timeout: std::time::Duration) -> bool {
        tokio::time::timeout(timeout, async {
            loop {
                let idle = self.idle.notified();
                if self.count.load(Ordering::SeqCst) == 0 {
                    return;
                }
                idle.await;
            }
        })
        .await
        .is_ok()
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

fn key_of(pod: Option<PodKey>) -> Result<(IpamKey, IpamMetadata), Status> {
    let pod = pod.ok_or_else(|| Status::invalid_argument("no pod key"))?;
    if pod.container_id.is_empty() {
        return Err(Status::invalid_argument("empty container id"));
    }
    let key = IpamKey {
        network_name: if pod.network_name.is_empty() {
            DEFAULT_NETWORK_NAME.to_owned()
        } else {
            pod.network_name
        },
        container_id: pod.container_id,
        if_name: if pod.if_name.is_empty() {
            "eth0".to_owned()
        } else {
            pod.if_name
        },
    };
    let metadata = IpamMetadata {
        k8s_pod_namespace: pod.k8s_pod_namespace,
        k8s_pod_name: pod.k8s_pod_name,
        interfaces_count: 1,
    };
    Ok((key, metadata))
}

fn status_of(e: &PodError) -> Status {
    let chain = anyhow_chain(e);
    let message = if chain.is_empty() {
        e.to_string()
    } else {
        format!("{e}: {chain}")
    };
    // A branch pod's error says which pod; its cause says how kubelet
    // should take it.
    let cause = match e {
        PodError::BranchPod { source, .. } => source,
        other => other,
    };
    match cause {
        PodError::Manager(ManagerError::NoAddress(_)) => Status::resource_exhausted(message),
        // The pool is still growing: kubelet's next try may get one.
        PodError::Manager(ManagerError::NoAddressYet(_)) => Status::aborted(message),
        // Nothing was done: kubelet's next try may succeed.
        PodError::BranchEniPending { .. }
        | PodError::PodUnknown { .. }
        | PodError::NoTrunk { .. }
        | PodError::NoTrunkLink { .. }
        // The pod that had the VLAN may not be deleted yet.
        | PodError::VlanInUse { .. } => Status::failed_precondition(message),
        PodError::NoHostVeth(_)
        | PodError::BadMac(_)
        | PodError::BadAnnotation { .. }
        | PodError::PodEniDisabled
        | PodError::NoBranchLink { .. }
        | PodError::BadVlan { .. } => Status::invalid_argument(message),
        _ => Status::internal(message),
    }
}

fn pod_key_of(key: IpamKey, metadata: IpamMetadata) -> PodKey {
    PodKey {
        network_name: key.network_name,
        container_id: key.container_id,
        if_name: key.if_name,
        k8s_pod_namespace: metadata.k8s_pod_namespace,
        k8s_pod_name: metadata.k8s_pod_name,
    }
}

/// The error's causes, for the plugin's message.
fn anyhow_chain(e: &dyn std::error::Error) -> String {
    let mut causes = Vec::new();
    let mut source = e.source();
    while let Some(s) = source {
        causes.push(s.to_string());
        source = s.source();
    }
    causes.join(": ")
}

#[tonic::async_trait]
impl CniBackend for Backend {
    async fn add_network(
        &self,
        request: Request<AddNetworkRequest>,
    ) -> Result<Response<AddNetworkReply>, Status> {
        let _serving = self.in_flight.enter();
        let request = request.into_inner();
        let (key, metadata) = key_of(request.pod)?;
        let pod = self
            .pods
            .add(
                &key,
                &metadata,
                &request.host_veth,
                &request.pod_mac,
                &request.annotations,
            )
            .await
            .map_err(|e| status_of(&e))?;
        if let Some(cluster) = self.pods.cluster_pods() {
            cluster.annotate_added(
                &metadata.k8s_pod_namespace,
                &metadata.k8s_pod_name,
                pod.addr,
            );
        }
        Ok(Response::new(AddNetworkReply {
            ipv4_addr: pod.addr.to_string(),
            eni_id: pod.eni_id,
            device_number: pod.device_number,
            subnet_prefix_len: u32::from(pod.subnet.prefix_len()),
            subnet_gateway: pod.gateway.to_string(),
            mtu: self.pods.manager().eni_mtu(),
            branch_eni: pod.branch,
        }))
    }

    async fn del_network(
        &self,
        request: Request<DelNetworkRequest>,
    ) -> Result<Response<DelNetworkReply>, Status> {
        let _serving = self.in_flight.enter();
        let request = request.into_inner();
        crate::telemetry::del_request(&request.reason);
        let (key, metadata) = key_of(request.pod)?;
        let released = self
            .pods
            .del(&key, &request.host_veth)
            .await
            .map_err(|e| status_of(&e))?;
        if let (Some(cluster), Some(addr)) = (self.pods.cluster_pods(), released) {
            cluster.annotate_deleted(&metadata.k8s_pod_namespace, &metadata.k8s_pod_name, addr);
        }
        Ok(Response::new(DelNetworkReply {
            ipv4_addr: released.map(|a| a.to_string()).unwrap_or_default(),
        }))
    }

    async fn check_network(
        &self,
        request: Request<CheckNetworkRequest>,
    ) -> Result<Response<CheckNetworkReply>, Status> {
        let _serving = self.in_flight.enter();
        let (key, _) = key_of(request.into_inner().pod)?;
        let reply = match self.pods.check(&key).await.map_err(|e| status_of(&e))? {
            None => CheckNetworkReply::default(),
            Some((addr, host_veth, problem)) => CheckNetworkReply {
                ipv4_addr: addr.to_string(),
                host_veth: host_veth.unwrap_or_default(),
                problem: problem.unwrap_or_default(),
            },
        };
        Ok(Response::new(reply))
    }

    async fn list_attachments(
        &self,
        _: Request<ListAttachmentsRequest>,
    ) -> Result<Response<ListAttachmentsReply>, Status> {
        let _serving = self.in_flight.enter();
        let attachments = self
            .pods
            .attachments()
            .await
            .map_err(|e| status_of(&e))?
            .into_iter()
            .map(|a| Attachment {
                pod: Some(pod_key_of(a.key, a.metadata)),
                ipv4_addr: a.addr.to_string(),
                host_veth: a.host_veth.unwrap_or_default(),
            })
            .collect();
        Ok(Response::new(ListAttachmentsReply { attachments }))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let _serving = self.in_flight.enter();
        let (ready, reason, available) = self.pods.status().await;
        Ok(Response::new(StatusReply {
            ready,
            reason,
            available_addrs: u32::try_from(available).unwrap_or(u32::MAX),
        }))
    }

    async fn ipam_status(
        &self,
        _: Request<IpamStatusRequest>,
    ) -> Result<Response<IpamStatusReply>, Status> {
        let _serving = self.in_flight.enter();
        let status = self.pods.manager().status().await;
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        Ok(Response::new(IpamStatusReply {
            total_addrs: n(status.stats.total_ips),
            assigned_addrs: n(status.stats.assigned_ips),
            total_prefixes: n(status.stats.total_prefixes),
            enis: n(status.enis),
            max_enis: n(status.max_enis),
            max_pods: n(status.max_pods),
            prefix_fallback: status.prefix_fallback,
            counters: status
                .counters
                .into_iter()
                .map(|(name, v)| (format!("vpcnet_ipam_{name}_total"), v))
                .collect(),
            events: status
                .events
                .into_iter()
                .map(|e| IpamEvent {
                    time: e
                        .time
                        .duration_since(std::time::SystemTime::UNIX_EPOCH)
                        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX)),
                    reason: e.reason.to_owned(),
                    message: e.message,
                })
                .collect(),
        }))
    }
}

/// Binds the backend's socket (replacing a stale socket file): once this
/// returns, the plugin can connect, so the agent says it is ready after it.
pub fn bind(socket: &Path) -> Result<UnixListener, ServeError> {
    let listen_err = |source| ServeError::Listen {
        path: socket.display().to_string(),
        source,
    };
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(listen_err)?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(listen_err(e)),
    }
    let listener = UnixListener::bind(socket).map_err(listen_err)?;
    // connect(2) on a Unix socket needs write permission on its file.
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(listen_err)?;
    Ok(listener)
}

/// Serves the backend on `listener`, counting the requests under way in
/// `in_flight`, until the task is dropped.
pub async fn serve(
    pods: Pods,
    listener: UnixListener,
    in_flight: Arc<InFlight>,
) -> Result<(), ServeError> {
    tonic::transport::Server::builder()
        .add_service(CniBackendServer::new(Backend { pods, in_flight }))
        .serve_with_incoming(UnixListenerStream::new(listener))
        .await?;
    Ok(())
}
