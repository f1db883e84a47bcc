//! Network namespaces: making and removing them, running commands and
//! threads inside them.
//!
//! Only names that start with [`NS_PREFIX`] are ever made or removed, and
//! nothing here touches the caller's own namespace.

use std::{
    fs::File,
    io::{ErrorKind, Write},
    path::PathBuf,
    process::{Command, Output, Stdio},
    sync::mpsc,
    thread,
};

use nix::sched::{CloneFlags, setns};
use tracing::debug;

use crate::{
    addrs::NS_PREFIX,
    error::{Context, LabError, Result},
};

/// Where `ip netns` keeps its namespaces.
pub const NETNS_RUN_DIR: &str = "/var/run/netns";

/// The bind mount that names namespace `ns`: a lab namespace's name, or
/// the path of a pod namespace the lab's container runtime made.
pub fn netns_path(ns: &str) -> PathBuf {
    if ns.starts_with('/') {
        PathBuf::from(ns)
    } else {
        PathBuf::from(NETNS_RUN_DIR).join(ns)
    }
}

/// Every lab namespace that exists now, sorted.
pub fn lab_namespaces() -> Result<Vec<String>> {
    let entries = match std::fs::read_dir(NETNS_RUN_DIR) {
        Ok(entries) => entries,
        Err(err) if err.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
        Err(err) => return Err(err).context(|| format!("listing {NETNS_RUN_DIR}")),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.context(|| format!("listing {NETNS_RUN_DIR}"))?;
        if let Some(name) = entry.file_name().to_str()
            && name.starts_with(NS_PREFIX)
        {
            names.push(name.to_owned());
        }
    }
    names.sort();
    Ok(names)
}

/// A namespace commands and threads may enter: a lab namespace, or a pod
/// namespace of the lab's containerd (under its state directory).
fn check_usable(ns: &str) -> Result<()> {
    let path = std::path::Path::new(ns);
    if path.is_absolute()
        && path.starts_with(crate::cri::CONTAINERD_STATE_DIR)
        && !ns.contains("/../")
    {
        return Ok(());
    }
    check_lab_name(ns)
}

pub(crate) fn check_lab_name(ns: &str) -> Result<()> {
    if ns.starts_with(NS_PREFIX) && ns.len() > NS_PREFIX.len() && !ns.contains('/') {
        Ok(())
    } else {
        Err(LabError::InvalidOption(format!(
            "namespace {ns:?} is not a lab namespace (they start with {NS_PREFIX})"
        )))
    }
}

/// Makes the named namespaces (all of them in one `ip -batch`).
pub fn create_namespaces(names: &[String]) -> Result<()> {
    for name in names {
        check_lab_name(name)?;
    }
    let lines: Vec<String> = names
        .iter()
        .map(|name| format!("netns add {name}"))
        .collect();
    ip_batch(None, &lines)
}

/// Removes the named namespaces, carrying on past failures; returns what
/// could not be removed.
pub fn delete_namespaces(names: &[String]) -> Result<()> {
    for name in names {
        check_lab_name(name)?;
    }
    if names.is_empty() {
        return Ok(());
    }
    let lines: Vec<String> = names
        .iter()
        .map(|name| format!("netns del {name}"))
        .collect();
    // -force: one namespace that will not go must not keep the others.
    let result = run_with_stdin(
        Command::new("ip").args(["-force", "-batch", "-"]),
        &lines.join("\n"),
    );
    let left = lab_namespaces()?
        .into_iter()
        .filter(|n| names.contains(n))
        .collect::<Vec<_>>();
    if left.is_empty() {
        Ok(())
    } else {
        result?;
        Err(LabError::Teardown(format!(
            "namespaces still exist: {}",
            left.join(", ")
        )))
    }
}

/// Runs `argv` inside namespace `ns` (through `nsenter`) and returns its
/// output whatever its exit status.
pub fn exec(ns: &str, argv: &[&str]) -> Result<Output> {
    check_usable(ns)?;
    let (program, program_args) = argv
        .split_first()
        .ok_or_else(|| LabError::InvalidOption("exec needs a command".into()))?;
    let mut command = Command::new("nsenter");
    command
        .arg(format!("--net={}", netns_path(ns).display()))
        .arg("--")
        .arg(program)
        .args(program_args)
        .stdin(Stdio::null());
    debug!(ns, command = argv.join(" "), "exec");
    command
        .output()
        .map_err(|err| spawn_error(&describe(&command), &err))
}

/// Runs `argv` inside namespace `ns` and returns its standard output; a
/// non-zero exit is an error that carries its standard error.
pub fn exec_ok(ns: &str, argv: &[&str]) -> Result<String> {
    let output = exec(ns, argv)?;
    check_output(&format!("[{ns}] {}", argv.join(" ")), &output)?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Sets the MTU of link `link` in namespace `ns`.
pub fn set_mtu(ns: &str, link: &str, mtu: u32) -> Result<()> {
    exec_ok(ns, &["ip", "link", "set", link, "mtu", &mtu.to_string()]).map(drop)
}

/// Runs a list of `ip` commands in one process (`ip [-n NS] -batch -`): the
/// first failure stops it and names the failing line.
pub fn ip_batch(ns: Option<&str>, lines: &[String]) -> Result<()> {
    if lines.is_empty() {
        return Ok(());
    }
    let mut command = Command::new("ip");
    if let Some(ns) = ns {
        check_lab_name(ns)?;
        command.args(["-n", ns]);
    }
    command.args(["-batch", "-"]);
    debug!(?ns, lines = lines.len(), "ip batch");
    run_with_stdin(&mut command, &lines.join("\n")).map_err(|err| match err {
        LabError::CommandFailed {
            command,
            status,
            stderr,
        } => LabError::CommandFailed {
            command,
            status,
            // `ip` says "Command failed -:N": name the line.
            stderr: annotate_batch_failure(&stderr, lines),
        },
        other => other,
    })?;
    Ok(())
}

fn annotate_batch_failure(stderr: &str, lines: &[String]) -> String {
    let line_no = stderr
        .rsplit_once("Command failed -:")
        .and_then(|(_, rest)| rest.trim().parse::<usize>().ok());
    match line_no.and_then(|n| lines.get(n.checked_sub(1)?)) {
        Some(line) => format!("{} (while running `ip {line}`)", stderr.trim()),
        None => stderr.trim().to_owned(),
    }
}

/// Runs `command` with `input` on its standard input; fails on non-zero exit.
pub(crate) fn run_with_stdin(command: &mut Command, input: &str) -> Result<Output> {
    let described = describe(command);
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|err| spawn_error(&described, &err))?;
    // The child's output is read only after its input is written: fine for
    // commands whose output is small next to a pipe buffer (ip, nft).
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let write_result = stdin
        .write_all(input.as_bytes())
        .and_then(|()| stdin.write_all(b"\n"));
    drop(stdin);
    let output = child
        .wait_with_output()
        .context(|| format!("waiting for `{described}`"))?;
    write_result.context(|| format!("writing the input of `{described}`"))?;
    check_output(&described, &output)?;
    Ok(output)
}

pub(crate) fn check_output(described: &str, output: &Output) -> Result<()> {
    if output.status.success() {
        return Ok(());
    }
    Err(LabError::CommandFailed {
        command: described.to_owned(),
        status: output.status.to_string(),
        stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
    })
}

pub(crate) fn describe(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|part| part.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

pub(crate) fn spawn_error(described: &str, err: &std::io::Error) -> LabError {
    let program = described.split(' ').next().unwrap_or(described).to_owned();
    if err.kind() == ErrorKind::NotFound {
        LabError::ToolMissing { program }
    } else {
        LabError::Io {
            context: format!("starting `{described}`"),
            source: std::io::Error::new(err.kind(), err.to_string()),
        }
    }
}

/// A thread that runs inside a network namespace; see [`spawn_in`].
#[derive(Debug)]
pub struct NetnsThread<T> {
    ns: String,
    /// `None` only if the thread could not enter the namespace, which
    /// [`spawn_in`] has already reported.
    handle: thread::JoinHandle<Option<T>>,
}

impl<T> NetnsThread<T> {
    /// Waits for the thread and returns what its closure returned.
    pub fn join(self) -> Result<T> {
        match self.handle.join() {
            Ok(Some(value)) => Ok(value),
            Ok(None) | Err(_) => Err(LabError::ThreadPanicked { ns: self.ns }),
        }
    }

    /// Whether the closure has returned.
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }
}

/// Starts a thread that enters namespace `ns` (setns is per thread, the rest
/// of the process stays where it is) and runs `f` there. Returns once the
/// thread is inside the namespace, so a socket `f` opens belongs to `ns`.
pub fn spawn_in<F, T>(ns: &str, f: F) -> Result<NetnsThread<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    check_usable(ns)?;
    let path = netns_path(ns);
    let netns = File::open(&path).context(|| format!("opening namespace {}", path.display()))?;
    let (entered_tx, entered_rx) = mpsc::sync_channel::<nix::Result<()>>(1);
    let handle = thread::Builder::new()
        .name(format!("in-{ns}"))
        .spawn(move || {
            let entered = setns(&netns, CloneFlags::CLONE_NEWNET);
            drop(netns);
            let failed = entered.is_err();
            // The spawner waits for this message; if it is gone nobody needs it.
            let _ = entered_tx.send(entered);
            // Never run `f` outside the namespace it was meant for.
            (!failed).then(f)
        })
        .context(|| format!("starting a thread for namespace {ns}"))?;
    // A thread that died before sending counts as not having entered.
    let entered = entered_rx.recv().unwrap_or(Err(nix::Error::ECHILD));
    if let Err(source) = entered {
        let _ = handle.join();
        return Err(LabError::Sys {
            context: format!("entering namespace {ns}"),
            source,
        });
    }
    Ok(NetnsThread {
        ns: ns.to_owned(),
        handle,
    })
}

/// Runs `f` on a thread inside namespace `ns` and returns its result.
pub fn run_in<F, T>(ns: &str, f: F) -> Result<T>
where
    F: FnOnce() -> T + Send,
    T: Send,
{
    check_usable(ns)?;
    let path = netns_path(ns);
    let netns = File::open(&path).context(|| format!("opening namespace {}", path.display()))?;
    // A scoped thread lets `f` borrow from the caller.
    thread::scope(|scope| {
        let handle = thread::Builder::new()
            .name(format!("in-{ns}"))
            .spawn_scoped(scope, move || {
                setns(&netns, CloneFlags::CLONE_NEWNET)
                    .context(|| format!("entering namespace {ns}"))?;
                Ok(f())
            })
            .context(|| format!("starting a thread for namespace {ns}"))?;
        handle
            .join()
            .map_err(|_| LabError::ThreadPanicked { ns: ns.to_owned() })?
    })
}

/// Writes sysctls of namespace `ns` (keys as `net.ipv4.ip_forward`).
pub fn set_sysctls(ns: &str, settings: &[(&str, &str)]) -> Result<()> {
    run_in(ns, || {
        for (key, value) in settings {
            // /proc/sys/net shows the namespace of the thread that opens it.
            let path = format!("/proc/sys/{}", key.replace('.', "/"));
            std::fs::write(&path, value).context(|| format!("setting {key}={value} in {ns}"))?;
        }
        Ok(())
    })?
}

/// Reads one sysctl of namespace `ns`.
pub fn get_sysctl(ns: &str, key: &str) -> Result<String> {
    run_in(ns, || {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        std::fs::read_to_string(&path)
            .map(|value| value.trim().to_owned())
            .context(|| format!("reading {key} in {ns}"))
    })?
}
