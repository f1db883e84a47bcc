//! The CNI socket while the agent may not start yet (aws-node's ipamd
//! still runs on the node): it answers the DaemonSet's probes (alive, not
//! ready, and why) and refuses every call. The runtime does not call it
//! then: aws-node's conflist is still the node's.

use tokio::{net::UnixListener, sync::watch};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::{Request, Response, Status};
use vpcnet_api::cni::{
    AddNetworkReply, AddNetworkRequest, CheckNetworkReply, CheckNetworkRequest, DelNetworkReply,
    DelNetworkRequest, IpamStatusReply, IpamStatusRequest, ListAttachmentsReply,
    ListAttachmentsRequest, StatusReply, StatusRequest,
    cni_backend_server::{CniBackend, CniBackendServer},
};

use crate::cni_server::ServeError;

struct Waiting {
    why: watch::Receiver<String>,
}

impl Waiting {
    fn refused(&self) -> Status {
        Status::unavailable(self.why.borrow().clone())
    }
}

#[tonic::async_trait]
impl CniBackend for Waiting {
    async fn add_network(
        &self,
        _: Request<AddNetworkRequest>,
    ) -> Result<Response<AddNetworkReply>, Status> {
        Err(self.refused())
    }

    async fn del_network(
        &self,
        _: Request<DelNetworkRequest>,
    ) -> Result<Response<DelNetworkReply>, Status> {
        Err(self.refused())
    }

    async fn check_network(
        &self,
        _: Request<CheckNetworkRequest>,
    ) -> Result<Response<CheckNetworkReply>, Status> {
        Err(self.refused())
    }

    async fn list_attachments(
        &self,
        _: Request<ListAttachmentsRequest>,
    ) -> Result<Response<ListAttachmentsReply>, Status> {
        Err(self.refused())
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        Ok(Response::new(StatusReply {
            ready: false,
            reason: self.why.borrow().clone(),
            available_addrs: 0,
        }))
    }

    async fn ipam_status(
        &self,
        _: Request<IpamStatusRequest>,
    ) -> Result<Response<IpamStatusReply>, Status> {
        Err(self.refused())
    }
}

/// Serves the waiting socket on `listener` until the task is dropped; the
/// reason it gives is `why`'s latest.
pub async fn serve(listener: UnixListener, why: watch::Receiver<String>) -> Result<(), ServeError> {
    tonic::transport::Server::builder()
        .add_service(CniBackendServer::new(Waiting { why }))
        .serve_with_incoming(UnixListenerStream::new(listener))
        .await?;
    Ok(())
}
