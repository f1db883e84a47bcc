//! The lab's EC2: an emulator of the EC2 Query API and IMDSv2, from one
//! in-memory state, with what EC2 really does (per-instance-type ENI and
//! address limits, /28 prefixes, subnet exhaustion and fragmentation,
//! random address picks, attachment delays, throttling and 5xx) and, in the
//! lab, an attach that creates the ENI's links.
//!
//! The agent has one cloud code path, `aws-sdk-ec2` and `aws-config`'s IMDS
//! client, with endpoints overridden: in the lab they point here
//! ([`EC2_ENDPOINT_URL`], [`IMDS_ENDPOINT_URL`]). Whatever the SDK's
//! deserializer accepts is the contract; the wire tests use the SDK.
//!
//! - [`model`]: the state and EC2's rules (pure);
//!   [`instance_types`]: the limits table; [`config`]: the configuration.
//! - [`query`] and [`xml`]: the Query API; [`imds`]: the metadata service.
//! - [`faults`]: injected errors and counters; [`fabric`]: the lab's
//!   network; [`server`]: the HTTP servers; [`admin`]: the admin socket and
//!   its client; [`EmulatorProcess`]: the binary `vpcnet-lab-ec2` run for
//!   the lab.

pub mod admin;
pub mod config;
pub mod fabric;
pub mod faults;
pub mod imds;
pub mod instance_types;
pub mod model;
mod process;
pub mod query;
pub mod server;
pub mod xml;

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

pub use admin::AdminClient;
pub use config::Config;
pub use process::{
    EC2_ENDPOINT_URL, EMULATOR_BIN, EmulatorOptions, EmulatorProcess, IMDS_ENDPOINT_URL,
    emulator_binary,
};
pub use server::Emulator;

use crate::{LabError, netns};

/// What can go wrong starting, reaching or using the emulator.
#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error("admin call {request} failed with HTTP {status}: {code} {message}")]
    Admin {
        request: String,
        status: u16,
        code: String,
        message: String,
    },

    #[error("unexpected answer to {request}: {reason}")]
    BadResponse { request: String, reason: String },

    #[error("encoding an admin request: {0}")]
    Json(#[from] serde_json::Error),

    #[error(
        "the EC2 emulator {binary} did not become ready: {reason}\n--- its log (tail) ---\n{log_tail}"
    )]
    NotReady {
        binary: PathBuf,
        reason: String,
        log_tail: String,
    },

    #[error(
        "the EC2 emulator's binary {0} is missing: build it (`cargo build -p vpcnet-lab --bins`, or `cargo xtask build`)"
    )]
    BinaryMissing(PathBuf),

    #[error(transparent)]
    Lab(#[from] LabError),
}

/// Binds TCP listeners on `addrs`, inside namespace `ns` if given (a thread
/// enters it while the sockets are made: a socket stays in the namespace it
/// was made in, the rest of the process stays where it is). A listen
/// address that is neither unspecified nor loopback is put on the
/// namespace's `lo` first if it is not there (as `/32`), which is how the
/// lab's EC2 endpoint and IMDS addresses come to exist on the VPC router.
pub fn bind_listeners(
    ns: Option<&str>,
    addrs: &[SocketAddr],
) -> Result<Vec<std::net::TcpListener>, EmulatorError> {
    if let Some(ns) = ns {
        let mut lines = vec!["link set lo up".to_owned()];
        for addr in addrs {
            if let IpAddr::V4(ip) = addr.ip()
                && !ip.is_unspecified()
                && !ip.is_loopback()
            {
                // `replace` adds it if missing and changes nothing otherwise.
                lines.push(format!("addr replace {ip}/32 dev lo"));
            }
        }
        netns::ip_batch(Some(ns), &lines)?;
    }
    let bind = || {
        addrs
            .iter()
            .map(|addr| {
                let listener =
                    std::net::TcpListener::bind(addr).map_err(|source| EmulatorError::Io {
                        context: format!(
                            "listening on {addr}{}",
                            ns.map(|ns| format!(" in {ns}")).unwrap_or_default()
                        ),
                        source,
                    })?;
                listener
                    .set_nonblocking(true)
                    .map_err(|source| EmulatorError::Io {
                        context: format!("making the listener on {addr} non-blocking"),
                        source,
                    })?;
                Ok(listener)
            })
            .collect::<Result<Vec<_>, EmulatorError>>()
    };
    match ns {
        Some(ns) => netns::run_in(ns, bind)?,
        None => bind(),
    }
}
