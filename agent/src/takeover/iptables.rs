//! The node's iptables, through the backend its kubelet uses: the take-over
//! must see aws-node's rules where aws-node wrote them, and the hand-back
//! write them where the node's netfilter reads them.

use std::{process::Command, sync::OnceLock};

use tracing::info;
use vpcnet_api::iptables::{self, IptablesBackend};

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

/// The `iptables` program of the node's backend.
pub fn program() -> &'static str {
    backend().iptables()
}
