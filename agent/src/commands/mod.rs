//! The operator's commands on the node, a file each; `run` is the app.

pub mod introspect;
pub mod ipam;
pub mod maps;
pub mod settings;
pub mod uninstall;
pub mod verifier;

use std::time::Duration;

use anyhow::{Context, Result};

/// A runtime for a command's calls (to the running agent, to IMDS).
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")
}

/// A flag's seconds as a duration.
pub fn seconds(flag: &str, value: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(value)
        .with_context(|| format!("{flag}: {value} is not a duration in seconds"))
}
