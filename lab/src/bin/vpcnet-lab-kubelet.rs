//! `vpcnet-lab-kubelet`: the lab node's kubelet for one DaemonSet pod. See
//! `vpcnet_lab::kubelet`.
//!
//! Runs the pod a plan file describes through the containerd on
//! `--containerd-socket`, prints `READY` on standard output once every
//! container is ready, and keeps it running (restarts, probes) until
//! SIGTERM, writing the pod's status (JSON) to `--status` whenever it
//! changes. On SIGTERM it leaves the pod running, as a kubelet that stops
//! does: the lab removes the pod with the runtime's teardown.

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
    cri::CriClient,
    kubelet::{PodPlan, PodRunner, RELIST},
};

#[derive(Debug, Parser)]
#[command(
    name = "vpcnet-lab-kubelet",
    about = "The lab node's kubelet for a DaemonSet pod"
)]
struct Args {
    /// The pod (JSON; see `vpcnet_lab::kubelet::PodPlan`).
    #[arg(long)]
    plan: PathBuf,
    /// containerd's CRI socket.
    #[arg(long)]
    containerd_socket: PathBuf,
    /// Where the pod's status goes (JSON; `vpcnet_lab::kubelet::PodStatus`).
    #[arg(long)]
    status: PathBuf,
    /// How long the init containers may take, in seconds.
    #[arg(long, default_value_t = 120)]
    init_timeout: u64,
}

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
    let plan: PodPlan = serde_json::from_slice(&std::fs::read(&args.plan)?)?;
    let client = CriClient::connect(&args.containerd_socket)?;
    let mut pod = PodRunner::start(client, plan, Duration::from_secs(args.init_timeout))?;
    let mut said_ready = false;
    let mut last = None;
    while !STOP.load(Ordering::SeqCst) {
        pod.relist()?;
        let status = pod.status();
        if last.as_ref() != Some(&status) {
            // Whole or not at all, for a reader at any moment.
            let partial = args.status.with_extension("partial");
            std::fs::write(&partial, serde_json::to_vec_pretty(&status)?)?;
            std::fs::rename(&partial, &args.status)?;
            last = Some(status);
        }
        if pod.ready() && !said_ready {
            let mut stdout = std::io::stdout();
            writeln!(stdout, "READY")?;
            stdout.flush()?;
            said_ready = true;
            info!("the pod is ready");
        }
        // kubelet's relist period: a clock, not a wait for an event.
        std::thread::sleep(RELIST);
    }
    info!("SIGTERM: leaving the pod to the runtime");
    Ok(())
}
