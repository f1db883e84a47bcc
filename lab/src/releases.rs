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

/// The last release before pinned maps carried their layout: nodes run it
/// now, and its pins carry no version.
pub const UNVERSIONED_PINS: Release = Release {
    commit: "1421fe51503c556b8b317b1cd37e2ab8450f835d",
    why: "the release nodes run, whose pins carry no layout version",
};

/// The first release that runs on 6.1 (clsact filters, the programs'
/// stack within the pre-6.9 rounding); its pins carry no version either.
pub const FIRST_ON_6_1: Release = Release {
    commit: "06a5ae5c3c0fde7dc497a7c00817e2394e4ddc37",
    why: "the first release that runs on 6.1, whose pins carry no layout version",
};

/// Every release the upgrade tests start from.
pub const RELEASES: [Release; 2] = [UNVERSIONED_PINS, FIRST_ON_6_1];

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
