//! The agent of an eBPF lab: started inside `vpcnet-node`, ready when it
//! prints `READY`, stopped by `down` through its pid file.
//!
//! Contract with the agent: it is run as
//! `<agent> run --primary-interface eth0 --node-addr 10.20.11.162
//! --vpc-cidrs 10.20.0.0/16,100.64.0.0/16 --notify-ready
//! --layout /run/vpcnet-lab/layout.json` with the VPC CNI's environment
//! variables (`POD_SECURITY_GROUP_ENFORCING_MODE` and `ENABLE_POD_ENI=true`
//! too when the lab has branch-ENI pods); the layout file (ENIs, pods) is
//! `vpcnet_api::layout::NodeLayout` as JSON; once its programs are attached it prints exactly
//! one line `READY` on standard output and closes it. It logs to standard
//! error, which goes to `agent.log` in the state directory. SIGTERM stops it.
//!
//! An address-manager lab runs `<agent> run --notify-ready --ipam
//! --cni-socket /run/vpcnet-lab/cni.sock` instead, with the EC2 emulator's
//! endpoints (`AWS_ENDPOINT_URL_EC2`, `AWS_EC2_METADATA_SERVICE_ENDPOINT`),
//! `AWS_VPC_K8S_CNI_BACKING_STORE=/run/vpcnet-lab/ipam.json` and the VPC
//! CNI's address-manager variables it was given; it learns the rest from
//! IMDS.

use std::{
    fs::{self, File},
    io::{BufRead, BufReader, Read, Seek, SeekFrom},
    os::{fd::OwnedFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::Duration,
};

use nix::{errno::Errno, sys::signal::Signal};
use tracing::{info, warn};

use crate::{
    addrs::{NODE_ETH0, NODE_PRIMARY_ADDR, NS_NODE, VPC_CIDRS},
    cluster,
    ec2::EmulatorProcess,
    error::{Context, LabError, Result},
    kube::KubeApiOptions,
    netns::{describe, netns_path, spawn_error},
    options::LabOptions,
    pidfd,
    state::{
        AgentInfo, agent_log_file, agent_pid_file, cni_socket_file, ipam_checkpoint_file,
        layout_file,
    },
};

/// How long `down` waits for the agent after SIGTERM, then after SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(10);
const KILL_GRACE: Duration = Duration::from_secs(5);
/// How much of the agent's log an error shows.
const LOG_TAIL_BYTES: u64 = 8 * 1024;

/// The command line that starts the agent inside the node.
pub fn agent_command(agent_bin: &Path, opts: &LabOptions) -> Command {
    let vpc_cidrs = VPC_CIDRS
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut command = Command::new("nsenter");
    command
        .arg(format!("--net={}", netns_path(NS_NODE).display()))
        .arg("--");
    if opts.kube_api() {
        // In-cluster, as in its pod: the ServiceAccount's files where
        // every pod has them, the API server behind the `kubernetes`
        // Service.
        let files = KubeApiOptions::default().files();
        command
            .args(cluster::service_account_prefix(&files))
            .envs(cluster::agent_env());
    }
    command.arg(agent_bin).arg("run");
    if lab_makes_branch_links(opts) {
        command.args(["--branch-links", "existing"]);
    }
    if let Some(ipam) = &opts.ipam {
        // Everything else from IMDS, as on EC2.
        command
            .arg("--notify-ready")
            .arg("--ipam")
            .arg("--cni-socket")
            .arg(cni_socket_file())
            .args(&ipam.agent_args)
            .envs(EmulatorProcess::agent_env())
            .env("AWS_VPC_K8S_CNI_BACKING_STORE", ipam_checkpoint_file());
    } else {
        command
            .args(["--primary-interface", NODE_ETH0])
            .args(["--node-addr", &NODE_PRIMARY_ADDR.to_string()])
            .args(["--vpc-cidrs", &vpc_cidrs])
            .arg("--notify-ready")
            .arg("--layout")
            .arg(layout_file());
    }
    command.envs(configured_env(opts));
    // RUST_LOG and the rest of the environment pass through.
    command
}

/// The agent's settings the lab makes, as an operator's ConfigMap would
/// (the DaemonSet's pod gets them there), in order: a later one wins.
pub fn configured_env(opts: &LabOptions) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if pod_eni(opts) {
        // The node-wide enforcing mode, as the lab's conflist has it (a
        // test's own variables may say otherwise, after this).
        env.push((
            "POD_SECURITY_GROUP_ENFORCING_MODE",
            opts.sg_enforcing_mode.env_value().to_owned(),
        ));
    }
    env.extend([
        (
            "AWS_VPC_K8S_CNI_EXTERNALSNAT",
            opts.external_snat.to_string(),
        ),
        (
            "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS",
            opts.exclude_snat_cidrs_env(),
        ),
        (
            "AWS_VPC_K8S_CNI_RANDOMIZESNAT",
            opts.randomize_snat.env_value().to_owned(),
        ),
    ]);
    if opts.has_branch_pods() {
        // Security groups for pods are on (the VPC CNI's `ENABLE_POD_ENI`).
        env.push(("ENABLE_POD_ENI", "true".to_owned()));
    }
    let mut env: Vec<(String, String)> = env
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value))
        .collect();
    if let Some(ipam) = &opts.ipam {
        env.extend(ipam.env.iter().cloned());
    }
    env.extend(opts.agent_env.iter().cloned());
    env
}

/// Whether the lab, not the agent, makes the branch ENIs' `vlan.eth.<id>`
/// links: its own branch pods' (`--branch-pods`), and all of them on a
/// kernel without 802.1Q (veths then, see [`crate::addrs::branch_link`]).
/// Asked only of a node with security groups for pods: an earlier
/// release's agent (the upgrade tests) has no such option.
fn lab_makes_branch_links(opts: &LabOptions) -> bool {
    pod_eni(opts) && (!opts.branch_pods.is_empty() || !crate::topology::kernel_has_vlans())
}

/// Whether the node serves security groups for pods (`ENABLE_POD_ENI`):
/// the lab's own branch pods need it; a test may ask for it.
pub(crate) fn pod_eni(opts: &LabOptions) -> bool {
    let asked = |env: &[(String, String)]| {
        env.iter()
            .any(|(name, value)| name == "ENABLE_POD_ENI" && value == "true")
    };
    opts.has_branch_pods()
        || asked(&opts.agent_env)
        || opts.ipam.as_ref().is_some_and(|ipam| asked(&ipam.env))
}

/// Starts the agent and waits for its `READY`. On any failure the agent is
/// stopped and the error carries the end of its log.
pub fn start(opts: &LabOptions) -> Result<(Child, AgentInfo)> {
    let bin = opts.agent_bin.clone().ok_or_else(|| {
        LabError::InvalidOption("the ebpf datapath needs the agent binary (agent_bin)".into())
    })?;
    let log_path = agent_log_file();
    let log = File::create(&log_path).context(|| format!("creating {}", log_path.display()))?;
    let mut command = agent_command(&bin, opts);
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        // Its own process group: a Ctrl-C meant for `cargo xtask lab up`
        // must not take down the agent the lab leaves running.
        .process_group(0);
    let described = describe(&command);
    info!(command = described, "starting the agent");
    let mut child = command
        .spawn()
        .map_err(|err| spawn_error(&described, &err))?;
    // nsenter execs the agent (no fork for a network namespace): the child's
    // pid is the agent's.
    let pid = i32::try_from(child.id()).expect("pids fit in i32");
    let start_time = process_start_time(pid).unwrap_or_default();
    let info = AgentInfo {
        pid,
        start_time,
        bin: bin.clone(),
        log: log_path.clone(),
    };
    fs::write(agent_pid_file(), format!("{pid}\n"))
        .context(|| format!("writing {}", agent_pid_file().display()))?;

    let stdout = child.stdout.take().expect("stdout is piped");
    match wait_ready(stdout, opts.agent_ready_timeout) {
        Ok(()) => {
            info!(pid, "the agent is ready");
            Ok((child, info))
        }
        Err(reason) => {
            // Where it is stuck, while it still is; then stop it before
            // reading its log, so the log is complete.
            let waiting_in = where_waiting(pid);
            let _ = stop(&info, Some(&mut child));
            Err(LabError::AgentNotReady {
                path: bin,
                reason,
                log_tail: log_tail(&log_path),
                waiting_in,
            })
        }
    }
}

/// Each thread of process `pid`, and of every process it started, with the
/// kernel function it sleeps in and its kernel stack (from `/proc`): what a
/// process that stopped answering was waiting for.
fn where_waiting(agent: i32) -> String {
    use std::fmt::Write as _;
    let read = |path: PathBuf| fs::read_to_string(path).unwrap_or_default();
    let mut pids = vec![agent];
    if let Ok(entries) = fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<i32>().ok())
            else {
                continue;
            };
            // `stat`: pid (comm) state ppid ...; comm may hold spaces.
            let stat = read(entry.path().join("stat"));
            let parent = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<i32>().ok());
            if parent == Some(agent) {
                pids.push(child);
            }
        }
    }
    let mut out = String::new();
    for process in pids {
        let dir = PathBuf::from(format!("/proc/{process}"));
        let cmdline = read(dir.join("cmdline")).replace('\0', " ");
        let _ = writeln!(out, "process {process}: {}", cmdline.trim_end());
        let Ok(tasks) = fs::read_dir(dir.join("task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let path = task.path();
            let _ = writeln!(
                out,
                "  thread {} {} in {}",
                task.file_name().to_string_lossy(),
                read(path.join("comm")).trim(),
                read(path.join("wchan")).trim()
            );
            for frame in read(path.join("stack")).lines() {
                let _ = writeln!(out, "    {frame}");
            }
        }
    }
    out
}

/// Reads the agent's first line on a helper thread, so the wait has a
/// deadline; the pipe reaching end of file means the agent closed it or
/// exited.
fn wait_ready(stdout: impl Read + Send + 'static, timeout: Duration) -> Result<(), String> {
    let (line_tx, line_rx) = mpsc::sync_channel(1);
    thread::Builder::new()
        .name("agent-ready".into())
        .spawn(move || {
            let mut line = String::new();
            let read = BufReader::new(stdout).read_line(&mut line).map(|_| line);
            let _ = line_tx.send(read);
        })
        .map_err(|err| format!("could not start a thread to read its output: {err}"))?;
    match line_rx.recv_timeout(timeout) {
        Ok(Ok(line)) if line.trim_end() == "READY" => Ok(()),
        Ok(Ok(line)) if line.is_empty() => {
            Err("it closed its standard output (or exited) without printing READY".into())
        }
        Ok(Ok(line)) => Err(format!(
            "its first line was {:?}, not READY",
            line.trim_end()
        )),
        Ok(Err(err)) => Err(format!("reading its standard output failed: {err}")),
        Err(_) => Err(format!("it printed nothing within {timeout:?}")),
    }
}

/// Stops the agent: SIGTERM, a bounded wait for it to exit, then SIGKILL.
/// `child` is the agent's handle when this process started it (it gets
/// reaped); otherwise the pid is checked against the recorded start time so a
/// reused pid is never signalled.
pub fn stop(info: &AgentInfo, child: Option<&mut Child>) -> Result<()> {
    let pidfd = match pidfd::open(info.pid) {
        Ok(fd) => fd,
        Err(Errno::ESRCH) => return Ok(()),
        Err(err) => return Err(err).context(|| format!("opening the agent process {}", info.pid)),
    };
    // The pidfd pins the process: if its start time matches now, the signals
    // below reach the agent and nothing else.
    if process_start_time(info.pid) != Some(info.start_time) {
        warn!(
            pid = info.pid,
            "the agent's pid now names another process; not signalling it"
        );
        return Ok(());
    }
    let exited = signal_and_wait(&pidfd, Signal::SIGTERM, TERM_GRACE)?
        || signal_and_wait(&pidfd, Signal::SIGKILL, KILL_GRACE)?;
    if let Some(child) = child {
        let _ = child.wait();
    }
    if exited {
        info!(pid = info.pid, "the agent stopped");
        Ok(())
    } else {
        Err(LabError::Timeout {
            what: format!("the agent (pid {}) to exit after SIGKILL", info.pid),
            waited: TERM_GRACE + KILL_GRACE,
        })
    }
}

/// Sends `signal` through the pidfd and waits for the process to exit.
fn signal_and_wait(pidfd: &OwnedFd, signal: Signal, grace: Duration) -> Result<bool> {
    if let Err(err) = pidfd::send_signal(pidfd, signal) {
        if err == Errno::ESRCH {
            return Ok(true);
        }
        return Err(err).context(|| format!("sending {signal} to the agent"));
    }
    // A pidfd becomes readable when its process exits.
    pidfd::wait_exit(pidfd, grace).context(|| "waiting for the agent to exit".into())
}

/// Field 22 of /proc/PID/stat: when the process started.
pub fn process_start_time(pid: i32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // fields after its closing parenthesis. Field 3 is the first there.
    let after_name = &stat[stat.rfind(')')? + 1..];
    after_name.split_whitespace().nth(22 - 3)?.parse().ok()
}

/// The end of the agent's log.
pub fn log_tail(path: &Path) -> String {
    let Ok(mut file) = File::open(path) else {
        return format!("(no log at {})", path.display());
    };
    let len = file.metadata().map_or(0, |m| m.len());
    let mut text = String::new();
    let start = len.saturating_sub(LOG_TAIL_BYTES);
    if file.seek(SeekFrom::Start(start)).is_ok() {
        let mut bytes = Vec::new();
        let _ = file.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    if text.trim().is_empty() {
        "(the agent logged nothing)".into()
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_of_this_process() {
        let pid = i32::try_from(std::process::id()).unwrap();
        assert!(process_start_time(pid).is_some());
    }

    #[test]
    fn ready_line() {
        assert!(wait_ready(&b"READY\n"[..], Duration::from_secs(1)).is_ok());
        assert!(
            wait_ready(&b""[..], Duration::from_secs(1))
                .unwrap_err()
                .contains("without")
        );
        assert!(
            wait_ready(&b"panic\n"[..], Duration::from_secs(1))
                .unwrap_err()
                .contains("panic")
        );
    }

    #[test]
    fn command_line_follows_the_contract() {
        let opts = LabOptions {
            exclude_snat_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
            ..LabOptions::ebpf(1, "/bin/agent")
        };
        let command = agent_command(Path::new("/bin/agent"), &opts);
        assert_eq!(
            describe(&command),
            "nsenter --net=/var/run/netns/vpcnet-node -- /bin/agent run --primary-interface eth0 \
             --node-addr 10.20.11.162 --vpc-cidrs 10.20.0.0/16,100.64.0.0/16 --notify-ready \
             --layout /run/vpcnet-lab/layout.json"
        );
        let envs: Vec<_> = command
            .get_envs()
            .map(|(k, v)| format!("{}={}", k.to_string_lossy(), v.unwrap().to_string_lossy()))
            .collect();
        assert!(envs.contains(&"AWS_VPC_K8S_CNI_EXTERNALSNAT=false".into()));
        assert!(envs.contains(&"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS=192.0.2.0/24".into()));
        assert!(envs.contains(&"AWS_VPC_K8S_CNI_RANDOMIZESNAT=prng".into()));
        assert!(!envs.iter().any(|e| e.starts_with("POD_SECURITY_GROUP")));

        let branch = LabOptions {
            branch_pods: vec![0],
            sg_enforcing_mode: crate::options::EnforcingMode::Standard,
            ..LabOptions::ebpf(1, "/bin/agent")
        };
        let command = agent_command(Path::new("/bin/agent"), &branch);
        let envs: Vec<_> = command
            .get_envs()
            .map(|(k, v)| format!("{}={}", k.to_string_lossy(), v.unwrap().to_string_lossy()))
            .collect();
        assert!(envs.contains(&"POD_SECURITY_GROUP_ENFORCING_MODE=standard".into()));
        assert!(envs.contains(&"ENABLE_POD_ENI=true".into()));

        let mut ipam = crate::IpamLabOptions::new("m5.large");
        ipam.env = vec![("WARM_IP_TARGET".into(), "5".into())];
        let opts = LabOptions {
            ipam: Some(ipam),
            ..LabOptions::ebpf(0, "/bin/agent")
        };
        let command = agent_command(Path::new("/bin/agent"), &opts);
        assert_eq!(
            describe(&command),
            "nsenter --net=/var/run/netns/vpcnet-node -- /bin/agent run --notify-ready --ipam \
             --cni-socket /run/vpcnet-lab/cni.sock"
        );
        let envs: Vec<_> = command
            .get_envs()
            .map(|(k, v)| format!("{}={}", k.to_string_lossy(), v.unwrap().to_string_lossy()))
            .collect();
        for expected in [
            "AWS_ENDPOINT_URL_EC2=http://10.20.0.10",
            "AWS_EC2_METADATA_SERVICE_ENDPOINT=http://169.254.169.254",
            "AWS_VPC_K8S_CNI_BACKING_STORE=/run/vpcnet-lab/aws-node/ipam.json",
            "WARM_IP_TARGET=5",
        ] {
            assert!(
                envs.contains(&expected.to_owned()),
                "{expected} in {envs:?}"
            );
        }
    }
}
