//! The plugin's errors as the CNI spec has them (its "Error" result:
//! `cniVersion`, `code`, `msg`, `details` on stdout, non-zero exit), and the
//! one table of the codes it answers with.
//!
//! | code | meaning |
//! |---|---|
//! | 1 | incompatible CNI version: the config's `cniVersion` is not one the plugin supports, or the command needs a newer one (CHECK: 0.4.0, STATUS and GC: 1.1.0) |
//! | 2 | unsupported field in the network config (`ipam`: the agent assigns addresses) |
//! | 3 | the container's network namespace (`CNI_NETNS`) does not exist (ADD, CHECK) |
//! | 4 | invalid or missing environment variables (named in `msg`), `CNI_ARGS` included |
//! | 5 | I/O failure: reading the config from stdin |
//! | 6 | failed to decode: malformed JSON, a field of the wrong type, a malformed `prevResult` |
//! | 7 | invalid network config: a value out of range, a missing `name` or `prevResult` |
//! | 11 | try again later: the agent is unreachable or did not answer within `agentTimeoutSeconds`, or the pod is not ready for its network yet (gRPC `FAILED_PRECONDITION`: its branch ENI is still coming) |
//! | 50 | plugin not available (STATUS): the agent is unreachable or not ready |
//! | 100 | the interface `CNI_IFNAME` exists already in the pod's namespace, or the kernel refused the veth names as taken |
//! | 101 | the host veth name is held by another attachment the agent knows (another sandbox of the same pod) |
//! | 102 | the agent refused the request (its gRPC status and message are in `details`) |
//! | 103 | the agent has no address for the pod (gRPC `RESOURCE_EXHAUSTED`: the node is full) |
//! | 104 | a kernel (netlink) operation failed: creating or configuring the veth, its addresses, routes or neighbour |
//! | 105 | CHECK: the pod's network differs from `prevResult` or from the agent's record (`msg` says how) |

use std::fmt;

use serde_json::{Value, json};

/// The spec's well-known codes, and the plugin's own (100 and up).
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const UNSUPPORTED_FIELD: u32 = 2;
    pub const UNKNOWN_CONTAINER: u32 = 3;
    pub const INVALID_ENV: u32 = 4;
    pub const IO_FAILURE: u32 = 5;
    pub const DECODING_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    pub const NOT_AVAILABLE: u32 = 50;
    pub const INTERFACE_EXISTS: u32 = 100;
    pub const HOST_VETH_IN_USE: u32 = 101;
    pub const AGENT_REFUSED: u32 = 102;
    pub const NO_ADDRESS: u32 = 103;
    pub const NETLINK: u32 = 104;
    pub const CHECK_FAILED: u32 = 105;
}

/// A failed command: what the runtime is told.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        Self {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    /// The spec's error object, for a config of `cni_version`.
    pub fn to_json(&self, cni_version: &str) -> Value {
        json!({
            "cniVersion": cni_version,
            "code": self.code,
            "msg": self.msg,
            "details": self.details,
        })
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "code {}: {}", self.code, self.msg)?;
        if !self.details.is_empty() {
            write!(f, " ({})", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}

/// An error with its chain of causes on one line, for `details`.
pub fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        // Wrappers often repeat their source's message.
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// A netlink failure as the runtime sees it.
pub fn netlink(what: &str, err: &vpcnet_netlink::pod::PodNetError) -> CniError {
    CniError::new(code::NETLINK, what, chain(err))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_has_the_spec_fields() {
        let err = CniError::new(
            code::INVALID_ENV,
            "required env variables [CNI_NETNS] missing",
            "",
        );
        assert_eq!(
            err.to_json("0.4.0"),
            json!({
                "cniVersion": "0.4.0",
                "code": 4,
                "msg": "required env variables [CNI_NETNS] missing",
                "details": ""
            })
        );
        assert_eq!(
            err.to_string(),
            "code 4: required env variables [CNI_NETNS] missing"
        );
    }

    #[test]
    fn chains_skip_repeated_messages() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("opening the socket")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let err = Outer(std::io::Error::other("no such file"));
        assert_eq!(chain(&err), "opening the socket: no such file");
    }
}
