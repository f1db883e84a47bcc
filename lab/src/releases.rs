//! Earlier releases of vpcnet, for the upgrade tests: which commits, and
//! where their binaries are. `cargo xtask setup` builds each once, from a
//! git worktree of the commit, and keeps the binaries here; the tests run
//! them from here. Both read these constants, so each is written once.

use std::path::PathBuf;

/// Where the releases' binaries are kept: `<commit>/vpcnet-agent`,
/// `<commit>/vpcnet-cni`.
pub const RELEASES_DIR: &str = "/var/lib/vpcnet-lab/releases";

/// An earlier release a node may run.
#[derive(Clone, Copy, Debug)]
pub struct Release {
    /// The full commit id.
    pub commit: &'static str,
    /// Why nodes run it.
    pub why: &'static str,
}

/// The release the upgrade tests start from on every kernel: the first
/// that runs on 6.1 (clsact filters there, TCX links where the kernel has
/// them; the programs' stack within the pre-6.9 rounding), and its pins
/// carry no layout version. The release before it, 1421fe5, is no longer
/// one a node can run: 6.18.44's verifier gives up on its `pod_egress`
/// ("BPF program is too large", a million instructions processed), where
/// this one's takes 42k.
pub const FIRST_ON_6_1: Release = Release {
    commit: "06a5ae5c3c0fde7dc497a7c00817e2394e4ddc37",
    why: "the first release that runs on 6.1, whose pins carry no layout version",
};

/// Every release the upgrade tests start from.
pub const RELEASES: [Release; 1] = [FIRST_ON_6_1];

impl Release {
    /// The directory of its binaries.
    #[must_use]
    pub fn dir(&self) -> PathBuf {
        PathBuf::from(RELEASES_DIR).join(self.commit)
    }

    #[must_use]
    pub fn agent(&self) -> PathBuf {
        self.dir().join("vpcnet-agent")
    }

    #[must_use]
    pub fn cni_plugin(&self) -> PathBuf {
        self.dir().join("vpcnet-cni")
    }

    /// The first eight characters of its commit.
    #[must_use]
    pub fn short(&self) -> &'static str {
        &self.commit[..8]
    }
}
