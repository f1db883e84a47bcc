//! The image's base: a Debian bookworm root filesystem made by `mmdebstrap`
//! from the machine's Debian mirror, with the tools the agent calls and the
//! CNI plugins its conflist chains, as a reproducible tar.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use super::{Arch, binfmt};
use crate::setup::{run_checked, stdout_of};

/// The Debian release the image is made of.
pub const SUITE: &str = "bookworm";

/// Where the packages come from unless `VPCNET_DEBIAN_MIRROR` says: the
/// mirror this machine's own apt sources name.
const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
const DEFAULT_SECURITY_MIRROR: &str = "http://deb.debian.org/debian-security";

/// The packages the agent and the DaemonSet's pod use: iptables with both
/// backends (`iptables-legacy`, `iptables-nft`) for the take-over and the
/// rollback, conntrack for the flows they hand over, iproute2 for an
/// operator's `kubectl exec`, CA certificates for EC2's and the API
/// server's TLS, and the reference CNI plugins the conflist chains.
pub const PACKAGES: &[&str] = &[
    "ca-certificates",
    "conntrack",
    "containernetworking-plugins",
    "iproute2",
    "iptables",
];

/// The chained plugins `vpcnet-agent install-plugins` copies onto the node
/// beside vpcnet's own: the conflist's `portmap`, `bandwidth` and `tuning`,
/// and `loopback`, which every pod's runtime needs.
pub const CHAINED_PLUGINS: &[&str] = &["loopback", "portmap", "bandwidth", "tuning"];

/// Where the image keeps the plugins it installs on the node (the
/// DaemonSet's init container copies them from there).
pub const PLUGIN_DIR: &str = "opt/vpcnet/cni";

/// Where the image records its Debian packages and their versions.
pub const PACKAGE_LIST: &str = "usr/share/vpcnet/packages.txt";

/// Makes `arch`'s root filesystem into `out` (a tar), its files dated
/// `epoch` at the latest; returns the package list it recorded.
pub fn make(arch: Arch, epoch: u64, out: &Path) -> Result<String> {
    let mirror = std::env::var("VPCNET_DEBIAN_MIRROR").unwrap_or_else(|_| DEFAULT_MIRROR.into());
    let security = std::env::var("VPCNET_DEBIAN_SECURITY_MIRROR")
        .unwrap_or_else(|_| DEFAULT_SECURITY_MIRROR.into());
    let copy_plugins = CHAINED_PLUGINS
        .iter()
        .map(|plugin| format!("cp -p \"$1/usr/lib/cni/{plugin}\" \"$1/{PLUGIN_DIR}/\""))
        .collect::<Vec<_>>()
        .join(" && ");
    let list = PACKAGE_LIST;
    let mut command = Command::new("mmdebstrap");
    command
        .env("SOURCE_DATE_EPOCH", epoch.to_string())
        .arg("--quiet")
        // Essential packages and the ones named: no apt, no shell tools
        // beyond what Debian calls essential.
        .arg("--variant=essential")
        .arg(format!("--architectures={}", arch.debian()))
        .arg(format!("--include={}", PACKAGES.join(",")))
        // Documentation goes, licences stay.
        .arg("--dpkgopt=path-exclude=/usr/share/doc/*")
        .arg("--dpkgopt=path-include=/usr/share/doc/*/copyright")
        .arg("--dpkgopt=path-exclude=/usr/share/man/*")
        .arg("--dpkgopt=path-exclude=/usr/share/locale/*")
        .arg(format!(
            "--customize-hook=mkdir -p \"$1/{PLUGIN_DIR}\" && {copy_plugins}"
        ))
        // Read with the host's dpkg: the same whatever the architecture.
        .arg(format!(
            "--customize-hook=mkdir -p \"$(dirname \"$1/{list}\")\" && dpkg-query --admindir=\"$1/var/lib/dpkg\" -W -f='${{Package}} ${{Version}} ${{Architecture}}\\n' | LC_ALL=C sort > \"$1/{list}\""
        ))
        .arg(SUITE)
        .arg(out)
        .arg(format!("deb {mirror} {SUITE} main"))
        .arg(format!("deb {mirror} {SUITE}-updates main"))
        .arg(format!("deb {security} {SUITE}-security main"));
    // Installing arm64 packages runs their maintainer scripts: arm64
    // executables, which only qemu runs here.
    match arch {
        Arch::Amd64 => run_checked(&mut command),
        Arch::Arm64 => binfmt::run_checked_with_arm64(&command),
    }
    .with_context(|| format!("making the {} root filesystem", arch.debian()))?;
    package_list(out)
}

/// The package list recorded in the root filesystem tar at `rootfs`.
fn package_list(rootfs: &Path) -> Result<String> {
    stdout_of(
        Command::new("tar")
            .arg("-xOf")
            .arg(rootfs)
            .arg(format!("./{PACKAGE_LIST}")),
    )
    .context("reading the image's package list")
}

/// The work directory for `arch`'s pieces under `work`.
pub fn work_dir(work: &Path, arch: Arch) -> Result<PathBuf> {
    let dir = work.join(arch.debian());
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
