//! Where the agent's log goes and how much of it: aws-node's variables
//! (`AWS_VPC_K8S_CNI_LOGLEVEL`, `AWS_VPC_K8S_CNI_LOG_FILE`) for the running
//! agent; `RUST_LOG`, when set, over the level. The operator's commands
//! (`nat`, `config`, ...) log to standard error whatever the file says:
//! they must not write into the running agent's log.

use std::{fs, io, path::Path, sync::Mutex};

use tracing_subscriber::EnvFilter;

use crate::env::Env;

pub const ENV_LOG_LEVEL: &str = "AWS_VPC_K8S_CNI_LOGLEVEL";
/// A file, `stdout` or `stderr`; unset: standard error (`kubectl logs`).
pub const ENV_LOG_FILE: &str = "AWS_VPC_K8S_CNI_LOG_FILE";

/// The level when neither variable says.
pub const DEFAULT_LEVEL: &str = "info";

/// Where the log goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogTarget {
    Stderr,
    Stdout,
    File(std::path::PathBuf),
}

/// The agent's level, as a tracing directive ([`aws_node_level`]).
pub fn level(env: &Env) -> Option<&'static str> {
    aws_node_level(env, ENV_LOG_LEVEL)
}

/// A level as aws-node reads one (the agent's, the plugin's): debug, info,
/// warn, error or fatal in any case, fatal being error here (nothing is
/// above it); unset: `None`; unknown: debug, as aws-node, tolerated.
pub fn aws_node_level(env: &Env, variable: &'static str) -> Option<&'static str> {
    let value = env.get(variable)?;
    Some(match value.trim().to_ascii_lowercase().as_str() {
        "debug" => "debug",
        "info" => "info",
        "warn" => "warn",
        "error" | "fatal" => "error",
        _ => {
            env.tolerate(
                variable,
                value,
                "not debug, info, warn, error or fatal",
                "debug",
            );
            "debug"
        }
    })
}

/// Where the running agent logs.
pub fn target(env: &Env) -> LogTarget {
    match env.get(ENV_LOG_FILE).map(str::trim) {
        None => LogTarget::Stderr,
        Some(stream) if stream.eq_ignore_ascii_case("stderr") => LogTarget::Stderr,
        Some(stream) if stream.eq_ignore_ascii_case("stdout") => LogTarget::Stdout,
        Some(file) => LogTarget::File(file.into()),
    }
}

/// Opens `path` for appending, its directory made.
fn open_append(path: &Path) -> io::Result<fs::File> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    fs::OpenOptions::new().create(true).append(true).open(path)
}

/// Starts logging: the running agent (`agent`) where `env` says, any other
/// command to standard error. A log file that cannot be opened leaves the
/// log on standard error, tolerated (said once logging runs).
pub fn init(env: &Env, agent: bool) {
    let filter = || {
        EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new(level(env).unwrap_or(DEFAULT_LEVEL)))
    };
    let target = if agent {
        target(env)
    } else {
        LogTarget::Stderr
    };
    let stderr = || {
        tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            // Colours only for a person at a terminal, not in log files.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init();
    };
    match target {
        LogTarget::File(path) => match open_append(&path) {
            Ok(file) => tracing_subscriber::fmt()
                .with_env_filter(filter())
                .with_ansi(false)
                .with_writer(Mutex::new(file))
                .init(),
            Err(e) => {
                env.tolerate(
                    ENV_LOG_FILE,
                    &path.display().to_string(),
                    "cannot be opened",
                    format_args!("standard error ({e})"),
                );
                stderr();
            }
        },
        LogTarget::Stdout => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
            .with_writer(std::io::stdout)
            .init(),
        LogTarget::Stderr => stderr(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_targets_as_aws_node_reads_them() {
        let env = Env::from_pairs([(ENV_LOG_LEVEL, "DEBUG"), (ENV_LOG_FILE, "STDOUT")]);
        assert_eq!(level(&env), Some("debug"));
        assert_eq!(target(&env), LogTarget::Stdout);
        let env = Env::from_pairs([
            (ENV_LOG_LEVEL, "verbose"),
            (ENV_LOG_FILE, "/host/var/log/aws-routed-eni/ipamd.log"),
        ]);
        assert_eq!(level(&env), Some("debug"));
        assert_eq!(
            target(&env),
            LogTarget::File("/host/var/log/aws-routed-eni/ipamd.log".into())
        );
        assert_eq!(env.tolerated()[0].variable, ENV_LOG_LEVEL);
        let unset = Env::from_pairs(std::iter::empty::<(&str, &str)>());
        assert_eq!((level(&unset), target(&unset)), (None, LogTarget::Stderr));
    }
}
