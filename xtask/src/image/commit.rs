//! The image of another commit (`cargo xtask image --commit REV`, the
//! rolling-update test's earlier image): that commit's binaries, built
//! from a git worktree of it. The worktree's build shares this
//! checkout's build directory (`build.build-dir`), so only the commit's
//! own crates compile (under a minute, where the dependencies are
//! compiled already); its binaries land in a target directory of their
//! own, never over this checkout's.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::{
    build::{profile_name, target_dir},
    setup::{run_checked, stdout_of},
    worktree,
};

/// A commit, resolved.
pub struct Commit {
    /// Its full id.
    pub id: String,
    /// Its time, seconds since 1970.
    pub epoch: u64,
}

impl Commit {
    /// `rev` (`HEAD~1`, a tag, an id) as git resolves it here.
    pub fn resolve(rev: &str) -> Result<Self> {
        let id = git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
            .with_context(|| format!("{rev}: no such commit in this clone"))?;
        let epoch = git(&["log", "-1", "--format=%ct", &id])?;
        let epoch = epoch
            .parse()
            .with_context(|| format!("the commit's time `{epoch}`"))?;
        Ok(Self { id, epoch })
    }

    /// The first eight characters of its id.
    pub fn short(&self) -> &str {
        &self.id[..8]
    }

    /// Builds its agent and plugin (`release`: the release profile);
    /// returns the directory that holds them.
    pub fn build_binaries(&self, release: bool) -> Result<PathBuf> {
        let target = target_dir()?;
        let own = target
            .join("image")
            .join(format!("commit-{}", self.short()));
        worktree::build_in(&self.id, &own.join("src"), |source| {
            let (mut build, dependencies) = worktree::cargo_build(source)?;
            println!("image: commit {}: {dependencies}", self.short());
            build
                // This checkout's build directory: the dependencies compiled
                // once serve both.
                .env("CARGO_BUILD_BUILD_DIR", &target)
                .env("CARGO_TARGET_DIR", own.join("target"))
                .env_remove("VPCNET_EBPF");
            if release {
                build.arg("--release");
            }
            run_checked(&mut build)
        })
        .with_context(|| format!("building commit {}", self.id))?;
        let binaries = own.join("target").join(profile_name(release));
        if !binaries.join("vpcnet-agent").is_file() {
            bail!(
                "commit {} built no vpcnet-agent in {}",
                self.id,
                binaries.display()
            );
        }
        Ok(binaries)
    }
}

fn git(args: &[&str]) -> Result<String> {
    Ok(stdout_of(&mut worktree::git(args))?.trim().to_owned())
}

/// Where `--commit` builds put their archive by default.
pub fn default_archive(target: &Path, commit: &Commit, release: bool) -> PathBuf {
    target.join("image").join(format!(
        "vpcnet-{}-{}.oci.tar",
        commit.short(),
        profile_name(release)
    ))
}
