//! The agent's CNI backend (`api/proto/cni.proto`) on its Unix socket, each
//! call (and the connection) bounded by `agentTimeoutSeconds`.

use std::{fmt, future::Future, path::PathBuf, time::Duration};

use tonic::{Code, transport::Channel};
use vpcnet_api::cni::{
    AddNetworkReply, AddNetworkRequest, Attachment, CheckNetworkReply, CheckNetworkRequest,
    DelNetworkReply, DelNetworkRequest, ListAttachmentsRequest, PodKey, StatusReply, StatusRequest,
    cni_backend_client::CniBackendClient,
};

use crate::error::{CniError, chain, code};

/// Why the agent gave no answer, or what it answered instead.
#[derive(Debug)]
pub enum AgentError {
    /// Nothing listens on the socket (or it is not there).
    Unreachable { socket: PathBuf, reason: String },
    /// No answer within the timeout.
    Timeout { call: &'static str, after: Duration },
    /// The agent answered with an error.
    Status {
        call: &'static str,
        status: tonic::Status,
    },
}

impl fmt::Display for AgentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreachable { socket, reason } => write!(
                f,
                "the vpcnet agent is unreachable on {}: {reason}",
                socket.display()
            ),
            Self::Timeout { call, after } => {
                write!(f, "the vpcnet agent did not answer {call} within {after:?}")
            }
            Self::Status { call, status } => write!(
                f,
                "the vpcnet agent refused {call}: {:?}: {}",
                status.code(),
                status.message()
            ),
        }
    }
}

impl AgentError {
    /// Whether the agent was not there to answer (down, restarting, stuck,
    /// or gone in the middle of the call: tonic says `Unknown` for a broken
    /// transport and `Cancelled` for a stream cut short), as opposed to
    /// having answered with an error.
    pub fn unavailable(&self) -> bool {
        match self {
            Self::Unreachable { .. } | Self::Timeout { .. } => true,
            Self::Status { status, .. } => matches!(
                status.code(),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
            ),
        }
    }

    /// Whether the request may have taken effect although no answer says
    /// so: it was sent, and the answer was lost or never came.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            Self::Unreachable { .. } => false,
            Self::Timeout { .. } => true,
            Self::Status { status, .. } => matches!(
                status.code(),
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
            ),
        }
    }

    /// The error a runtime gets for it (on anything but STATUS).
    pub fn to_cni(&self) -> CniError {
        let details = self.to_string();
        if self.unavailable() {
            return CniError::new(
                code::TRY_AGAIN_LATER,
                "the vpcnet agent is not available",
                details,
            );
        }
        match self {
            // A pod not ready for its network yet (its branch ENI is
            // still coming): nothing was done, kubelet tries again.
            Self::Status { status, .. } if status.code() == Code::FailedPrecondition => {
                CniError::new(
                    code::TRY_AGAIN_LATER,
                    "the pod is not ready for its network yet",
                    details,
                )
            }
            // The node's pool did not grow within the agent's wait (EC2
            // slow or failing): nothing is held, kubelet tries again.
            Self::Status { status, .. } if status.code() == Code::Aborted => CniError::new(
                code::TRY_AGAIN_LATER,
                "no address for the pod yet: the node's address pool is still growing",
                details,
            ),
            Self::Status { status, .. } if status.code() == Code::ResourceExhausted => {
                CniError::new(
                    code::NO_ADDRESS,
                    "no address available for the pod",
                    details,
                )
            }
            _ => CniError::new(code::AGENT_REFUSED, "the vpcnet agent refused", details),
        }
    }
}

/// A connection to the agent.
#[derive(Clone, Debug)]
pub struct Agent {
    client: CniBackendClient<Channel>,
    timeout: Duration,
}

impl Agent {
    /// Connects to the agent on `socket`, within `timeout`.
    pub async fn connect(socket: PathBuf, timeout: Duration) -> Result<Self, AgentError> {
        // A missing socket is the common case of a stopped agent: say so
        // plainly rather than with the transport's words.
        if !socket.exists() {
            return Err(AgentError::Unreachable {
                socket,
                reason: "no such socket".into(),
            });
        }
        match tokio::time::timeout(timeout, vpcnet_api::connect_cni(&socket)).await {
            Ok(Ok(client)) => Ok(Self { client, timeout }),
            Ok(Err(err)) => Err(AgentError::Unreachable {
                socket,
                reason: chain(&err),
            }),
            Err(_) => Err(AgentError::Timeout {
                call: "the connection",
                after: timeout,
            }),
        }
    }

    async fn call<T, F>(&self, call: &'static str, request: F) -> Result<T, AgentError>
    where
        F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        match tokio::time::timeout(self.timeout, request).await {
            Ok(Ok(reply)) => Ok(reply.into_inner()),
            Ok(Err(status)) => Err(AgentError::Status { call, status }),
            Err(_) => Err(AgentError::Timeout {
                call,
                after: self.timeout,
            }),
        }
    }

    pub async fn add_network(
        &self,
        request: AddNetworkRequest,
    ) -> Result<AddNetworkReply, AgentError> {
        let mut client = self.client.clone();
        self.call("AddNetwork", client.add_network(request)).await
    }

    pub async fn del_network(
        &self,
        pod: PodKey,
        host_veth: String,
        reason: &str,
    ) -> Result<DelNetworkReply, AgentError> {
        let mut client = self.client.clone();
        let request = DelNetworkRequest {
            pod: Some(pod),
            host_veth,
            reason: reason.to_owned(),
        };
        self.call("DelNetwork", client.del_network(request)).await
    }

    pub async fn check_network(&self, pod: PodKey) -> Result<CheckNetworkReply, AgentError> {
        let mut client = self.client.clone();
        let request = CheckNetworkRequest { pod: Some(pod) };
        self.call("CheckNetwork", client.check_network(request))
            .await
    }

    pub async fn list_attachments(&self) -> Result<Vec<Attachment>, AgentError> {
        let mut client = self.client.clone();
        let reply = self
            .call(
                "ListAttachments",
                client.list_attachments(ListAttachmentsRequest {}),
            )
            .await?;
        Ok(reply.attachments)
    }

    pub async fn status(&self) -> Result<StatusReply, AgentError> {
        let mut client = self.client.clone();
        self.call("Status", client.status(StatusRequest {})).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(code: Code) -> AgentError {
        AgentError::Status {
            call: "AddNetwork",
            status: tonic::Status::new(code, "the pool is empty"),
        }
    }

    #[test]
    fn agent_errors_map_to_cni_codes() {
        let down = AgentError::Unreachable {
            socket: "/run/vpcnet/cni.sock".into(),
            reason: "no such socket".into(),
        };
        assert_eq!(down.to_cni().code, code::TRY_AGAIN_LATER);
        assert!(down.to_cni().details.contains("/run/vpcnet/cni.sock"));
        let slow = AgentError::Timeout {
            call: "AddNetwork",
            after: Duration::from_secs(1),
        };
        assert_eq!(slow.to_cni().code, code::TRY_AGAIN_LATER);
        assert!(slow.outcome_unknown());
        assert!(!down.outcome_unknown());
        // Down before the call, or killed during it (a broken transport).
        for gone in [Code::Unavailable, Code::Unknown, Code::Cancelled] {
            assert_eq!(
                status(gone).to_cni().code,
                code::TRY_AGAIN_LATER,
                "{gone:?}"
            );
            assert!(status(gone).unavailable(), "{gone:?}");
        }
        assert_eq!(
            status(Code::ResourceExhausted).to_cni().code,
            code::NO_ADDRESS
        );
        let growing = status(Code::Aborted);
        assert_eq!(growing.to_cni().code, code::TRY_AGAIN_LATER);
        assert!(!growing.outcome_unknown() && !growing.unavailable());
        let not_yet = status(Code::FailedPrecondition);
        assert_eq!(not_yet.to_cni().code, code::TRY_AGAIN_LATER);
        assert!(!not_yet.outcome_unknown() && !not_yet.unavailable());
        let refused = status(Code::InvalidArgument).to_cni();
        assert_eq!(refused.code, code::AGENT_REFUSED);
        assert!(refused.details.contains("the pool is empty"), "{refused:?}");
        assert!(!status(Code::InvalidArgument).outcome_unknown());
    }
}
