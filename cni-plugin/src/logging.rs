//! Logs to the config's log file (appended to, its directory created,
//! rotated as aws-node rotates its own: [`vpcnet_api::log_files`]) and to
//! stderr, which runtimes keep for a failed command.

use std::{io, sync::Mutex};

use tracing_subscriber::{Layer, fmt, layer::SubscriberExt, util::SubscriberInitExt};
use vpcnet_api::log_files;

use crate::config::Logging;

/// Installs the subscriber. A log file that cannot be opened is reported
/// on stderr and left out: logging never fails a command.
pub fn init(logging: &Logging) {
    let file = logging
        .file
        .as_ref()
        .and_then(|path| match log_files::open(path) {
            Ok(file) => Some(file),
            Err(err) => {
                eprintln!("vpcnet-cni: not logging to {}: {err}", path.display());
                None
            }
        });
    // No colours: both end up in files.
    let stderr = fmt::layer()
        .with_writer(io::stderr)
        .with_ansi(false)
        .with_target(false)
        .with_filter(logging.level);
    let file = file.map(|file| {
        fmt::layer()
            .with_writer(Mutex::new(file))
            .with_ansi(false)
            .with_target(false)
            .with_filter(logging.level)
    });
    // Only fails if a subscriber is installed already, which main never does.
    let _ = tracing_subscriber::registry()
        .with(stderr)
        .with(file)
        .try_init();
}
