//! The flow timeouts, as the node's conntrack has them: vpcnet's flows live
//! exactly as long as netfilter's would on the same node (kube-proxy raises
//! `nf_conntrack_tcp_timeout_established` to a day on every EKS node, and
//! an operator's own tuning applies alike). Re-read on every garbage
//! collection, so a `sysctl -w` takes effect without a restart.

use std::path::{Path, PathBuf};

use vpcnet_common::nat::Timeouts;

/// Where the network namespace's conntrack settings are.
pub const NETFILTER_SYSCTL_DIR: &str = "/proc/sys/net/netfilter";

/// The timeouts the sysctls under `dir` (`nf_conntrack_<name>`) set; a
/// missing or unreadable one (conntrack not loaded) keeps netfilter's
/// default (a zero field).
pub fn read_timeouts(dir: &Path) -> Timeouts {
    let mut timeouts = Timeouts::default();
    for (name, field) in Timeouts::SYSCTLS {
        if let Some(seconds) = read_seconds(&sysctl_path(dir, name)) {
            *field(&mut timeouts) = seconds;
        }
    }
    timeouts
}

fn sysctl_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("nf_conntrack_{name}"))
}

fn read_seconds(path: &Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use vpcnet_common::nat::{FlowState, NS_PER_SEC, PROTO_TCP, PROTO_UDP};

    use super::*;

    #[test]
    fn sysctls_set_their_timeouts_and_missing_ones_keep_the_defaults() {
        let dir = vpcnet_lab::ScratchDir::new("vpcnet-ct-timeouts").unwrap();
        std::fs::write(
            sysctl_path(dir.path(), "tcp_timeout_established"),
            "86400\n",
        )
        .unwrap();
        std::fs::write(sysctl_path(dir.path(), "udp_timeout"), "garbage\n").unwrap();
        let timeouts = read_timeouts(dir.path());
        assert_eq!(timeouts.tcp_established, 86_400);
        assert_eq!(
            timeouts.timeout_ns(PROTO_TCP, FlowState::Established, false),
            86_400 * NS_PER_SEC
        );
        assert_eq!(timeouts.udp, 0, "unreadable: netfilter's default");
        assert_eq!(
            timeouts.timeout_ns(PROTO_UDP, FlowState::New, false),
            30 * NS_PER_SEC
        );
    }
}
