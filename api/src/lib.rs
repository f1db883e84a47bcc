//! What the agent is told, one definition for whoever writes it and the agent
//! that reads it: the node layout (the lab's static nodes) and the CNI
//! plugin's gRPC API (`proto/cni.proto`).

pub mod aws_network_policy;
pub mod cluster_policy;
pub mod conflist;
pub mod iptables;
pub mod iptables_marks;
pub mod kube_proxy;
pub mod layout;
pub mod log_files;
pub mod node;
pub mod pod;
pub mod policy_endpoint;
pub mod vpc_cni;

/// The CNI backend service (generated from `proto/cni.proto`).
pub mod cni {
    #![allow(clippy::pedantic, missing_docs)]
    tonic::include_proto!("vpcnet.cni.v1");
}

/// Why the plugin sends a DEL (`DelNetworkRequest.reason`): aws-node's
/// plugin's reasons, and one of vpcnet's own.
pub mod del_reason {
    /// A CNI DEL: the runtime deletes the pod's network.
    pub const POD_DELETED: &str = "PodDeleted";
    /// An ADD that failed part-way, undone.
    pub const SETUP_NS_FAILED: &str = "SetupNSFailed";
    /// A CNI GC: an attachment the runtime no longer has.
    pub const GARBAGE_COLLECTED: &str = "GarbageCollected";
}

/// Where the agent serves the CNI backend.
pub const DEFAULT_CNI_SOCKET: &str = "/run/vpcnet/cni.sock";

/// A client of the CNI backend on the agent's Unix socket.
pub async fn connect_cni(
    socket: impl AsRef<std::path::Path>,
) -> Result<
    cni::cni_backend_client::CniBackendClient<tonic::transport::Channel>,
    tonic::transport::Error,
> {
    let socket = socket.as_ref().to_owned();
    // The URI is required by the API and unused: the connector dials the socket.
    let channel = tonic::transport::Endpoint::from_static("http://vpcnet-agent")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                tokio::net::UnixStream::connect(socket)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await?;
    Ok(cni::cni_backend_client::CniBackendClient::new(channel))
}
