//! The earlier releases the upgrade tests start from
//! (`vpcnet_lab::releases`): each built once from a git worktree of its
//! commit, with the eBPF toolchain setup installed, and its binaries kept
//! under [`RELEASES_DIR`].

use std::{fs, path::Path};

use anyhow::{Context, Result, bail};
use vpcnet_lab::releases::{RELEASES, RELEASES_DIR, Release};

use crate::{
    setup::{run_checked, stdout_of},
    worktree,
};

/// Builds the releases whose binaries are missing; says which are there
/// through `present`, and what it builds through `say`.
pub fn build_missing(present: impl Fn(&str), say: impl Fn(&str, &str)) -> Result<()> {
    for release in &RELEASES {
        let what = format!("release {} ({})", release.short(), release.why);
        if release.agent().is_file() && release.cni_plugin().is_file() {
            present(&what);
            continue;
        }
        say(
            &what,
            "building it from a git worktree of its commit (a few minutes, once)",
        );
        build(release, |dependencies| {
            say(&what, &dependencies.to_string());
        })
        .with_context(|| {
            format!(
                "could not build {what}; by hand: git worktree add --detach <dir> {} && cd <dir> \
                 && cargo build --locked --workspace --bins, then copy \
                 target/debug/vpcnet-agent and target/debug/vpcnet-cni to {}",
                release.commit,
                release.dir().display()
            )
        })?;
        say(&what, &format!("built into {}", release.dir().display()));
    }
    Ok(())
}

fn build(release: &Release, say: impl FnOnce(worktree::Dependencies)) -> Result<()> {
    let kind =
        stdout_of(&mut worktree::git(&["cat-file", "-t", release.commit])).unwrap_or_default();
    if kind.trim() != "commit" {
        bail!(
            "commit {} is not in this clone (a shallow clone?); `git fetch --unshallow` brings it",
            release.commit
        );
    }
    let releases = Path::new(RELEASES_DIR);
    // The releases' binaries in a target directory of their own, their
    // dependencies compiled in the workspace's build directory, the same
    // compilations as the tree's (`worktree::cargo_build`).
    let target = releases.join("target");
    let build_dir = crate::build::target_dir()?;
    worktree::build_in(
        release.commit,
        &releases.join(format!("src-{}", release.short())),
        |source| {
            let (mut build, dependencies) = worktree::cargo_build(source)?;
            say(dependencies);
            run_checked(
                build
                    .env("CARGO_TARGET_DIR", &target)
                    .env("CARGO_BUILD_BUILD_DIR", &build_dir)
                    // Binaries to run, not to debug: no debug info builds
                    // faster (the dependencies have none in the tree either).
                    .env("CARGO_PROFILE_DEV_DEBUG", "0")
                    .env("CARGO_INCREMENTAL", "0")
                    .env_remove("VPCNET_EBPF"),
            )
        },
    )?;
    let dir = release.dir();
    fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for binary in ["vpcnet-agent", "vpcnet-cni"] {
        let from = target.join("debug").join(binary);
        fs::copy(&from, dir.join(binary))
            .with_context(|| format!("copying {} to {}", from.display(), dir.display()))?;
    }
    Ok(())
}
