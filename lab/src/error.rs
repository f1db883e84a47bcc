//! The lab's errors: each says what was being done and what to do about it.

use std::{io, path::PathBuf, time::Duration};

/// Anything that can go wrong building, using or removing the lab.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error(
        "the lab needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN to make namespaces); run it as root"
    )]
    NotRoot,

    #[error(
        "a lab already exists ({what}); use it, or remove it first with `cargo xtask lab down`"
    )]
    AlreadyExists { what: String },

    #[error("no lab is running (no {STATE_FILE} under {dir}); start one with `cargo xtask lab up`", dir = crate::addrs::STATE_DIR)]
    NotRunning,

    #[error("--pods {requested} is too many: the node subnet has room for at most {max} pods")]
    TooManyPods { requested: usize, max: usize },

    #[error("invalid option: {0}")]
    InvalidOption(String),

    #[error("`{program}` was not found; install it (`cargo xtask setup` does)")]
    ToolMissing { program: String },

    #[error("`{command}` failed ({status}): {stderr}")]
    CommandFailed {
        command: String,
        status: String,
        stderr: String,
    },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },

    #[error("{context}: {source}")]
    Sys {
        context: String,
        #[source]
        source: nix::Error,
    },

    #[error("timed out after {waited:?} waiting for {what}")]
    Timeout { what: String, waited: Duration },

    #[error(
        "the agent {path} did not become ready: {reason}\n--- agent log (tail) ---\n{log_tail}\n--- where it waited ---\n{waiting_in}"
    )]
    AgentNotReady {
        path: PathBuf,
        reason: String,
        log_tail: String,
        /// Each thread of the agent and each process it started, with the
        /// kernel function and stack it waited in when it was given up on.
        waiting_in: String,
    },

    #[error("the lab's state file {path} is unreadable: {reason}")]
    BadState { path: PathBuf, reason: String },

    #[error("unexpected output from `{command}`: {reason}")]
    BadOutput { command: String, reason: String },

    #[error("a thread in namespace {ns} panicked")]
    ThreadPanicked { ns: String },

    #[error("the container runtime: {0}")]
    Cri(#[source] Box<crate::cri::CriError>),
    #[error("tearing the lab down left something behind: {0}")]
    Teardown(String),
}

pub(crate) const STATE_FILE: &str = "state.json";

/// The lab's result type.
pub type Result<T, E = LabError> = std::result::Result<T, E>;

/// Adds "what was being done" to `io::Error`s and `nix::Error`s.
pub(crate) trait Context<T> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for Result<T, io::Error> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| LabError::Io {
            context: context(),
            source,
        })
    }
}

impl<T> Context<T> for Result<T, nix::Error> {
    fn context(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| LabError::Sys {
            context: context(),
            source,
        })
    }
}

impl From<crate::cri::CriError> for LabError {
    fn from(err: crate::cri::CriError) -> Self {
        Self::Cri(Box::new(err))
    }
}
