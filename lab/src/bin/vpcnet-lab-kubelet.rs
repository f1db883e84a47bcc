//! `vpcnet-lab-kubelet`: the lab node's kubelet for the DaemonSet pods.
//! See `vpcnet_lab::kubelet`.
//!
//! Every relist it runs on the node the pod of each DaemonSet the API
//! server (`--kube-admin-socket`) says admits the node, as its template
//! says, through the containerd on `--containerd-socket`; prints `READY`
//! on standard output once the first reconcile made every such pod ready,
//! and keeps them running (restarts, probes, rolling updates) until
//! SIGTERM, writing the pods' status (JSON) to `--status` whenever it
//! changes. On SIGTERM it leaves the pods running, as a kubelet that
//! stops does: the lab removes them with the runtime's teardown.

use std::{
    io::Write,
    path::PathBuf,
    process::ExitCode,
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use clap::Parser;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
use tracing::{error, info};
use vpcnet_lab::{
    agent_pod::NodePods,
    kube::KubeAdmin,
    kubelet::{NodeDaemonSets, NodeTemplate, RELIST},
};

#[derive(Debug, Parser)]
#[command(
    name = "vpcnet-lab-kubelet",
    about = "The lab node's kubelet for the DaemonSets' pods"
)]
struct Args {
    /// The node (JSON; see `vpcnet_lab::kubelet::NodeTemplate`).
    #[arg(long)]
    node: PathBuf,
    /// containerd's CRI socket.
    #[arg(long)]
    containerd_socket: PathBuf,
    /// The lab API server's administrator socket.
    #[arg(long)]
    kube_admin_socket: PathBuf,
    /// Where the pods' status goes (JSON; `vpcnet_lab::agent_pod::NodePods`).
    #[arg(long)]
    status: PathBuf,
    /// How long the init containers may take, in seconds.
    #[arg(long, default_value_t = 120)]
    init_timeout: u64,
}

/// How long a reconcile that failed waits before the next.
const SYNC_BACKOFF: Duration = Duration::from_secs(10);

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigterm(_: i32) {
    STOP.store(true, Ordering::SeqCst);
}

fn main() -> ExitCode {
    vpcnet_lab::helper_process::log_to_stderr("vpcnet_lab=info,vpcnet_lab_kubelet=info");
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            error!(err = format!("{err:#}"), "the lab's kubelet failed");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> anyhow::Result<()> {
    let handler = SigAction::new(
        SigHandler::Handler(on_sigterm),
        SaFlags::empty(),
        SigSet::empty(),
    );
    // SAFETY: the handler only stores to an atomic.
    unsafe { sigaction(Signal::SIGTERM, &handler) }?;
    let node: NodeTemplate = serde_json::from_slice(&std::fs::read(&args.node)?)?;
    let mut pods = NodeDaemonSets::new(
        node,
        KubeAdmin::new(&args.kube_admin_socket),
        args.containerd_socket.clone(),
        Duration::from_secs(args.init_timeout),
    );
    let mut said_ready = false;
    let mut last = None;
    while !STOP.load(Ordering::SeqCst) {
        let synced = pods.sync();
        let status = NodePods {
            pods: pods.status(),
            error: synced.as_ref().err().map(|err| format!("{err:#}")),
        };
        if last.as_ref() != Some(&status) {
            // Whole or not at all, for a reader at any moment.
            let partial = args.status.with_extension("partial");
            std::fs::write(&partial, serde_json::to_vec_pretty(&status)?)?;
            std::fs::rename(&partial, &args.status)?;
            last = Some(status);
        }
        if let Err(err) = synced {
            // kubelet's first back-off before it tries the pod again.
            error!(err = format!("{err:#}"), "reconciling the node's pods");
            std::thread::sleep(SYNC_BACKOFF);
            continue;
        }
        if pods.ready() && !said_ready {
            let mut stdout = std::io::stdout();
            writeln!(stdout, "READY")?;
            stdout.flush()?;
            said_ready = true;
            info!("the node's pods are ready");
        }
        // kubelet's relist period: a clock, not a wait for an event.
        std::thread::sleep(RELIST);
    }
    info!("SIGTERM: leaving the pods to the runtime");
    Ok(())
}
