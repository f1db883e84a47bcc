//! Taking a lab down, whoever built it: the pods through CRI, the runtime,
//! the helper processes, the agent and its pins, the namespaces, the
//! state directory.

use std::{fs, io::ErrorKind, os::unix::fs::MetadataExt, path::Path, process::Child};

use tracing::{info, warn};

use crate::{
    addrs::{BPF_PIN_DIR, NS_NODE},
    agent, agent_pod, cluster,
    cri::{self, Containerd},
    ec2::EmulatorProcess,
    error::{LabError, Result},
    kube::KubeApiProcess,
    netns::{self, lab_namespaces},
    state::{self, LabState, state_dir},
};

/// Removes every trace of any lab, whoever built it: the agent (through its
/// pid file), its BPF pins, every `vpcnet-` namespace and the state
/// directory. Nothing there is not an error.
pub fn down_all() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Err(LabError::NotRoot);
    }
    teardown(Processes::default())
}

/// The lab's processes this process started (others are found through
/// their pid files).
#[derive(Default)]
pub(super) struct Processes {
    pub(super) kubelet: Option<Child>,
    pub(super) agent: Option<Child>,
    pub(super) emulator: Option<EmulatorProcess>,
    pub(super) containerd: Option<Containerd>,
    pub(super) kube_api: Option<KubeApiProcess>,
}

pub(super) fn teardown(processes: Processes) -> Result<()> {
    let Processes {
        mut kubelet,
        agent: mut agent_child,
        emulator,
        containerd,
        kube_api,
    } = processes;
    let mut problems = Vec::new();

    // The kubelet first, so nothing restarts what goes down below.
    agent_pod::stop_kubelet(kubelet.as_mut());
    kill_recorded(
        &agent_pod::kubelet_pid_file(),
        agent_pod::KUBELET_BIN,
        "the lab's kubelet",
    );

    // The pods first, as kubelet takes them down: their CNI DELs need the
    // agent and the node. Then the runtime, whoever started it.
    let runtime_down = match containerd {
        Some(containerd) => containerd.stop(),
        None => cri::teardown_leftovers(),
    };
    if let Err(err) = runtime_down {
        problems.push(err.to_string());
    }

    drop(emulator);
    drop(kube_api);
    // Those some earlier process left (their owner was killed).
    kill_recorded(
        &state::emulator_pid_file(),
        crate::ec2::EMULATOR_BIN,
        "the EC2 emulator",
    );
    kill_recorded(
        &state::kube_api_pid_file(),
        crate::kube::KUBE_API_BIN,
        "the Kubernetes API server",
    );
    if let Err(err) = cluster::remove_service_account_mount() {
        problems.push(err.to_string());
    }

    // The agent first: it holds the node's namespace and its programs.
    let recorded_agent = LabState::load().ok().and_then(|state| state.agent);
    let agent_info = recorded_agent.or_else(agent_from_pid_file);
    if let Some(info) = agent_info {
        if let Err(err) = agent::stop(&info, agent_child.as_mut()) {
            problems.push(err.to_string());
        }
    } else if let Some(child) = agent_child.as_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }

    match fs::remove_dir_all(BPF_PIN_DIR) {
        Ok(()) => info!(dir = BPF_PIN_DIR, "removed the agent's pins"),
        Err(err) if err.kind() == ErrorKind::NotFound => {}
        Err(err) => problems.push(format!("removing {BPF_PIN_DIR}: {err}")),
    }

    let namespaces = lab_namespaces().unwrap_or_else(|err| {
        problems.push(err.to_string());
        Vec::new()
    });
    report_processes_left_in(&namespaces);
    if let Err(err) = netns::delete_namespaces(&namespaces) {
        problems.push(err.to_string());
    } else if !namespaces.is_empty() {
        info!(count = namespaces.len(), "removed the lab's namespaces");
    }

    match fs::remove_dir_all(state_dir()) {
        Ok(()) => {}
        Err(err) if err.kind() == ErrorKind::NotFound => {}
        Err(err) => problems.push(format!("removing {}: {err}", state_dir().display())),
    }

    if problems.is_empty() {
        Ok(())
    } else {
        Err(LabError::Teardown(problems.join("; ")))
    }
}

/// Kills the helper process (`binary`) its pid file names, if that pid is
/// still it (a pid can be reused).
fn kill_recorded(pid_file: &Path, binary: &str, what: &str) {
    let Some(pid) = fs::read_to_string(pid_file)
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
    else {
        return;
    };
    let is_it = fs::read(format!("/proc/{pid}/cmdline"))
        .is_ok_and(|cmdline| String::from_utf8_lossy(&cmdline).contains(binary));
    if is_it {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        info!(pid, "killed {what}, left running");
    }
}

/// The agent as its pid file names it, when the state file is gone.
fn agent_from_pid_file() -> Option<state::AgentInfo> {
    let pid: i32 = fs::read_to_string(state::agent_pid_file())
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let start_time = agent::process_start_time(pid)?;
    // Without the recorded start time, make sure it runs in the lab's node.
    let node_ns = fs::metadata(netns::netns_path(NS_NODE)).ok()?;
    let its_ns = fs::metadata(format!("/proc/{pid}/ns/net")).ok()?;
    (node_ns.ino() == its_ns.ino() && node_ns.dev() == its_ns.dev()).then(|| state::AgentInfo {
        pid,
        start_time,
        bin: fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default(),
        log: state::agent_log_file(),
    })
}

/// Processes still inside lab namespaces keep them alive after their names
/// are gone. The lab only ends processes it started (the agent), so it
/// reports the others.
fn report_processes_left_in(namespaces: &[String]) {
    let inodes: Vec<(u64, &str)> = namespaces
        .iter()
        .filter_map(|ns| Some((fs::metadata(netns::netns_path(ns)).ok()?.ino(), ns.as_str())))
        .collect();
    if inodes.is_empty() {
        return;
    }
    let Ok(procs) = fs::read_dir("/proc") else {
        return;
    };
    let me = std::process::id().to_string();
    for entry in procs.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|p| p.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(meta) = fs::metadata(format!("/proc/{pid}/ns/net")) else {
            continue;
        };
        if let Some((_, ns)) = inodes.iter().find(|(ino, _)| *ino == meta.ino()) {
            let cmdline = fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            warn!(
                pid,
                ns,
                cmdline = cmdline.trim(),
                "a process is still running in a lab namespace"
            );
        }
    }
}
