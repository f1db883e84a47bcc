//! Logs to the config's log file (appended to, its directory created) and
//! to stderr, which runtimes keep for a failed command. A log file past
//! [`ROTATE_AT`] is moved to `<file>.1` (replacing the previous one) before
//! the command's lines go to a new one: two generations at most.

use std::{
    fs::{File, OpenOptions},
    io,
    path::Path,
    sync::Mutex,
};

use tracing_subscriber::{Layer, fmt, layer::SubscriberExt, util::SubscriberInitExt};

use crate::config::Logging;

/// The size past which the log file is rotated.
pub const ROTATE_AT: u64 = 16 << 20;

/// Opens the log file for appending, rotating it first if it is too large.
/// Two plugins rotating at once lose at most the other's first lines.
fn open_log(path: &Path) -> io::Result<File> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if std::fs::metadata(path).is_ok_and(|meta| meta.len() > ROTATE_AT) {
        let mut rotated = path.as_os_str().to_owned();
        rotated.push(".1");
        std::fs::rename(path, rotated)?;
    }
    OpenOptions::new().create(true).append(true).open(path)
}

/// Installs the subscriber. A log file that cannot be opened is reported
/// on stderr and left out: logging never fails a command.
pub fn init(logging: &Logging) {
    let file = logging.file.as_ref().and_then(|path| match open_log(path) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_logs_are_rotated() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("plugin.log");
        drop(open_log(&path).unwrap());
        assert!(path.exists(), "created with its directory");
        let file = open_log(&path).unwrap();
        file.set_len(ROTATE_AT + 1).unwrap();
        drop(file);
        let file = open_log(&path).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 0);
        let rotated = dir.path().join("sub").join("plugin.log.1");
        assert_eq!(std::fs::metadata(rotated).unwrap().len(), ROTATE_AT + 1);
    }
}
