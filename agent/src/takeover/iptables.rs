//! The node's iptables, through the backend its kubelet uses: the take-over
//! must see aws-node's rules where aws-node wrote them, and the hand-back
//! write them where the node's netfilter reads them.

use std::{process::Command, sync::OnceLock};

use tracing::info;
use vpcnet_api::{
    iptables::{self, IptablesBackend},
    iptables_marks::{MarkUse, mark_uses},
};

/// The node's backend, told once: it does not change under a running
/// agent.
pub fn backend() -> IptablesBackend {
    static BACKEND: OnceLock<IptablesBackend> = OnceLock::new();
    *BACKEND.get_or_init(|| {
        let backend = iptables::detect(|program, args| {
            let output = Command::new(program).args(args).output().ok()?;
            output
                .status
                .success()
                .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
        });
        info!(%backend, iptables = backend.iptables(), "the node's iptables backend");
        backend
    })
}

/// Tells the node's backend on a thread of its own, for [`backend`] to
/// have it by the time the take-over asks: its listings are then not on
/// the way to READY.
pub fn tell_backend_meanwhile() {
    std::thread::spawn(backend);
}

/// The rules of the node's iptables, in both backends (a backend whose
/// `iptables-save` is missing or fails has none), that use mark bits.
pub fn node_mark_uses() -> Vec<MarkUse> {
    IptablesBackend::ALL
        .into_iter()
        .filter_map(|backend| {
            let output = Command::new(backend.save()).output().ok()?;
            output
                .status
                .success()
                .then(|| mark_uses(&String::from_utf8_lossy(&output.stdout)))
        })
        .flatten()
        .collect()
}

/// The `iptables` program of the node's backend.
pub fn program() -> &'static str {
    backend().iptables()
}
