//! A helper binary the lab runs (the EC2 emulator, the Kubernetes API
//! server): found next to the running executable, ready once it prints
//! `READY`, its log's tail quoted when it is not.

use std::{
    fs::File,
    io::{self, BufRead, BufReader, Read, Seek, SeekFrom},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    sync::mpsc,
    thread,
    time::Duration,
};

use crate::{LabError, netns};

/// Logs to standard error, filtered by `RUST_LOG` or else `default_filter`:
/// a helper binary's standard output is its `READY` line alone.
pub fn log_to_stderr(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// How much of a log an error quotes.
const LOG_TAIL_BYTES: u64 = 8 * 1024;

/// Why a helper binary was not found.
#[derive(Debug)]
pub enum SiblingError {
    /// Where it was expected.
    Missing(PathBuf),
    Io(io::Error),
}

/// The binary `name` next to the running executable: a test's
/// `target/<profile>/deps/<test>` gives `target/<profile>/<name>`, a
/// binary in `target/<profile>` its neighbour.
pub fn sibling_binary(name: &str) -> Result<PathBuf, SiblingError> {
    let exe = std::env::current_exe().map_err(SiblingError::Io)?;
    let dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let candidates = [
        dir.join(name),
        dir.parent().map(|p| p.join(name)).unwrap_or_default(),
    ];
    candidates
        .iter()
        .find(|path| path.is_file())
        .cloned()
        .ok_or_else(|| SiblingError::Missing(candidates[1].clone()))
}

/// Waits for the `READY` line (read on a thread so the wait has a limit).
pub fn wait_ready(stdout: impl Read + Send + 'static, timeout: Duration) -> Result<(), String> {
    let (tx, rx) = mpsc::sync_channel(1);
    thread::Builder::new()
        .name("helper-ready".into())
        .spawn(move || {
            let mut line = String::new();
            let result = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(match result {
                Ok(_) if line.trim() == "READY" => Ok(()),
                Ok(0) => Err("it exited before saying READY".to_owned()),
                Ok(_) => Err(format!("it said {:?} instead of READY", line.trim())),
                Err(err) => Err(format!("reading its output: {err}")),
            });
        })
        .map_err(|err| format!("starting a thread: {err}"))?;
    rx.recv_timeout(timeout)
        .unwrap_or_else(|_| Err(format!("no READY within {timeout:?}")))
}

pub fn log_tail(path: &Path) -> String {
    let Ok(mut file) = File::open(path) else {
        return String::new();
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(LOG_TAIL_BYTES)));
    let mut tail = String::new();
    let _ = file.read_to_string(&mut tail);
    tail
}

/// Binds TCP listeners on `addrs`, inside namespace `ns` if given (a thread
/// enters it while the sockets are made: a socket stays in the namespace it
/// was made in, the rest of the process stays where it is). A listen
/// address that is neither unspecified nor loopback is put on the
/// namespace's `lo` first if it is not there (as `/32`), which is how the
/// lab's EC2 endpoint, IMDS and API server addresses come to exist on the
/// VPC router.
pub fn bind_listeners(
    ns: Option<&str>,
    addrs: &[SocketAddr],
) -> Result<Vec<std::net::TcpListener>, LabError> {
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
                    std::net::TcpListener::bind(addr).map_err(|source| LabError::Io {
                        context: format!(
                            "listening on {addr}{}",
                            ns.map(|ns| format!(" in {ns}")).unwrap_or_default()
                        ),
                        source,
                    })?;
                listener
                    .set_nonblocking(true)
                    .map_err(|source| LabError::Io {
                        context: format!("making the listener on {addr} non-blocking"),
                        source,
                    })?;
                Ok(listener)
            })
            .collect::<Result<Vec<_>, LabError>>()
    };
    match ns {
        Some(ns) => netns::run_in(ns, bind)?,
        None => bind(),
    }
}
