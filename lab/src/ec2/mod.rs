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
pub mod branches;
pub mod config;
pub mod fabric;
pub mod faults;
pub mod imds;
pub mod instance_types;
pub mod model;
mod process;
pub mod query;
pub mod resource_controller;
pub mod server;
pub mod xml;

use std::path::PathBuf;

pub use admin::AdminClient;
pub use config::Config;
pub use process::{
    EC2_ENDPOINT_URL, EMULATOR_BIN, EmulatorOptions, EmulatorProcess, IMDS_ENDPOINT_URL,
    emulator_binary,
};
pub use server::Emulator;

use crate::LabError;

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
