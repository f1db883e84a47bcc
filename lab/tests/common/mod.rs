//! What the lab's integration tests share.

#![allow(dead_code)] // Each test crate uses its own part of it.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use vpcnet_lab::netns;

/// The probes' port on every whoami server.
pub const PORT: u16 = 8080;
/// Long enough for a delivered reply on a loaded 2-core machine; a dropped
/// packet costs this much per probe.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(3);
pub const DROP_TIMEOUT: Duration = Duration::from_millis(700);

/// The start of every lab test: root is required (a test that skipped
/// itself would pass without testing anything, so it fails instead), logs
/// go to the test's output, the lab lock is held for the test's whole life,
/// and a lab left by an earlier, aborted run is removed.
pub fn lab_session() -> vpcnet_lab::LabLock {
    assert!(
        nix::unistd::geteuid().is_root(),
        "the lab tests need root (network namespaces): run them with `cargo xtask test` as root"
    );
    init_logs();
    let lock = vpcnet_lab::serial();
    vpcnet_lab::down_all().expect("removing a lab left by an earlier run");
    lock
}

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "vpcnet_lab=info".into()),
        )
        .with_test_writer()
        .try_init();
}

pub fn at(addr: Ipv4Addr) -> SocketAddrV4 {
    SocketAddrV4::new(addr, PORT)
}

pub fn assert_no_lab_left() {
    assert_eq!(netns::lab_namespaces().unwrap(), Vec::<String>::new());
    assert!(
        !vpcnet_lab::state_dir().exists(),
        "the state directory is left"
    );
}
