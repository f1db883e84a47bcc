//! A real container runtime for the lab: containerd 1.6 (Debian's package)
//! with its CRI plugin, run inside a lab namespace, driven by the calls
//! kubelet makes, so a CNI plugin sees what it sees on EKS.
//!
//! - [`Containerd`]: the daemon, its generated configuration and its
//!   project-owned directories ([`CONTAINERD_ROOT_DIR`],
//!   [`CONTAINERD_STATE_DIR`], [`CONTAINERD_SOCKET`]); stopping or dropping
//!   it leaves nothing behind, and [`teardown_leftovers`] does the same for
//!   one a crashed process left.
//! - [`image`]: the sandbox ("pause") image, built here from the static
//!   busybox (there is no registry to pull one from).
//! - [`CriClient`]: a blocking CRI `runtime.v1` client (a subset of the API,
//!   `lab/proto/cri.proto`).
//!
//! Everything needs root.

mod client;
mod containerd;
mod containers;
pub mod image;
mod node_paths;
mod sweep;

use std::{path::PathBuf, time::Duration};

pub use client::{
    CriClient, DnsConfig, PodSpec, PortMapping, Protocol, RuntimeVersion, SandboxState,
    SandboxStatus, SandboxSummary,
};
pub use containerd::{
    CNI_CACHE_DIR, CONTAINERD_ROOT_DIR, CONTAINERD_SOCKET, CONTAINERD_STATE_DIR, Containerd,
    ContainerdDirs, ContainerdOptions, DEBIAN_CNI_BIN_DIR, LABEL_NODE_AGENT, POD_CGROUP_PARENT,
    Snapshotter, link_cni_plugins, teardown_leftovers, teardown_leftovers_in,
};
pub use containers::{
    ContainerSpec, ContainerState, ContainerStatus, ExecResult, LABEL_CONTAINER_NAME, Mount,
    Propagation,
};
pub use node_paths::NodePath;

use crate::LabError;

/// The generated CRI types and client (`lab/proto/cri.proto`).
pub mod proto {
    #![allow(clippy::pedantic, missing_docs)]
    tonic::include_proto!("runtime.v1");
}

/// What can go wrong running containerd or talking CRI to it.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{context}: {source}")]
    Sys {
        context: String,
        #[source]
        source: nix::Error,
    },

    #[error("`{program}` was not found; install it (`cargo xtask setup` does)")]
    ToolMissing { program: String },

    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        command: String,
        status: String,
        stderr: String,
    },

    #[error("invalid containerd option: {0}")]
    InvalidOption(String),

    #[error(
        "a containerd of the lab is already there ({what}); remove it with \
         `vpcnet_lab::cri::teardown_leftovers()` (`cargo xtask lab down` does)"
    )]
    AlreadyExists { what: String },

    #[error(
        "containerd did not become ready on {socket}: {reason}\n--- containerd log (tail) ---\n{log_tail}"
    )]
    NotReady {
        socket: PathBuf,
        reason: String,
        log_tail: String,
    },

    #[error("connecting to the CRI socket {socket}: {source}")]
    Connect {
        socket: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },

    /// A CRI call answered with an error. `message` is the runtime's own
    /// text: a CNI plugin's error on `RunPodSandbox` or `StopPodSandbox` shows
    /// up there.
    #[error("CRI {call} failed ({code:?}): {message}")]
    Rpc {
        call: &'static str,
        code: tonic::Code,
        message: String,
    },

    #[error("CRI {call} did not answer within {waited:?}")]
    RpcTimeout {
        call: &'static str,
        waited: Duration,
    },

    #[error("unexpected answer to CRI {call}: {reason}")]
    BadResponse { call: &'static str, reason: String },

    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout { what: String, waited: Duration },

    #[error("tearing containerd down left something behind: {0}")]
    Teardown(String),

    /// Teardown left nothing, but some sandboxes could not be stopped or
    /// removed through CRI (say their CNI DEL failed) and were removed by
    /// force.
    #[error("containerd is gone and left nothing, but sandboxes had to be removed by force: {0}")]
    SandboxesForced(String),

    #[error(transparent)]
    Lab(#[from] LabError),
}

impl CriError {
    /// The runtime's message of a failed CRI call (what callers assert on),
    /// `None` for other errors.
    pub fn rpc_message(&self) -> Option<&str> {
        match self {
            Self::Rpc { message, .. } => Some(message),
            _ => None,
        }
    }
}

/// The result type of this module.
pub type Result<T, E = CriError> = std::result::Result<T, E>;

/// Adds "what was being done" to `io::Error`s and `nix::Error`s.
trait Context<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for Result<T, std::io::Error> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| CriError::Io {
            context: context(),
            source,
        })
    }
}

impl<T> Context<T> for Result<T, nix::Error> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| CriError::Sys {
            context: context(),
            source,
        })
    }
}
