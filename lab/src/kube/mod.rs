//! The lab's Kubernetes API server: the part of the API vpcnet uses, served
//! the way the real server serves it, as the EC2 emulator serves EC2. One
//! state behind HTTPS with a lab CA and ServiceAccount tokens, at a fixed
//! VPC address ([`crate::addrs::KUBE_API_ADDR`]); kubectl is the
//! independent client that proves the protocol.
//!
//! - [`resources`]: the served kinds; [`store`]: objects, revisions and
//!   the change history; [`patch`], [`selector`]: what requests carry;
//!   [`rbac`]: authorisation from the stored roles; [`discovery`]:
//!   discovery and OpenAPI documents; [`policy_controller`]: EKS's
//!   network policy controller, turning each NetworkPolicy into
//!   PolicyEndpoints, and [`cluster_policy_controller`] each AWS
//!   ClusterNetworkPolicy into ClusterPolicyEndpoints.
//! - [`server`]: HTTPS and the admin socket; [`pki`]: the CA, the server
//!   certificate, tokens and kubeconfigs; [`KubeApiProcess`]: the binary
//!   `vpcnet-lab-kube` run for the lab, and [`KubeAdmin`], the lab's own
//!   client (it plays kubelet and the VPC resource controller).

pub mod cluster_policy_controller;
pub mod discovery;
pub mod patch;
pub mod pki;
pub mod policy_controller;
mod process;
pub mod rbac;
pub mod resources;
pub mod selector;
pub mod server;
pub mod store;

use std::path::PathBuf;

pub use process::{KUBE_API_BIN, KubeAdmin, KubeApiOptions, KubeApiProcess, kube_api_url};
pub use server::KubeApi;

use crate::LabError;

/// What can go wrong starting, reaching or using the API server.
#[derive(Debug, thiserror::Error)]
pub enum KubeApiError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error("making the lab's certificates: {0}")]
    Tls(String),

    #[error("{request}: HTTP {code} {reason}: {message}")]
    Api {
        request: String,
        code: u16,
        reason: String,
        message: String,
    },

    #[error("unexpected answer to {request}: {reason}")]
    BadResponse { request: String, reason: String },

    #[error(
        "the Kubernetes API server {binary} did not become ready: {reason}\n--- its log (tail) ---\n{log_tail}"
    )]
    NotReady {
        binary: PathBuf,
        reason: String,
        log_tail: String,
    },

    #[error(
        "the Kubernetes API server's binary {0} is missing: build it (`cargo build -p vpcnet-lab --bins`, or `cargo xtask build`)"
    )]
    BinaryMissing(PathBuf),

    #[error(transparent)]
    Lab(#[from] LabError),
}

impl KubeApiError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// The HTTP status of an API error.
    pub fn code(&self) -> Option<u16> {
        match self {
            Self::Api { code, .. } => Some(*code),
            _ => None,
        }
    }
}
