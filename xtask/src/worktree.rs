//! A build in a git worktree of another commit (the upgrade tests'
//! releases, `cargo xtask image --commit`): the worktree made afresh (one
//! an interrupted build left goes first) and removed after the build,
//! whatever it did.

use std::{fs, path::Path, process::Command};

use anyhow::{Context, Result};

use crate::{build::workspace_root, setup::run_checked};

mod dependencies;

pub use dependencies::Dependencies;

/// `git -C <this checkout> ARGS`.
pub fn git(args: &[&str]) -> Command {
    let mut command = Command::new("git");
    command.arg("-C").arg(workspace_root()).args(args);
    command
}

/// Runs `build` in a worktree of `commit` at `at`.
pub fn build_in(commit: &str, at: &Path, build: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let at_arg = at.to_string_lossy().into_owned();
    let remove = || {
        let _ = git(&["worktree", "remove", "--force", &at_arg]).output();
    };
    remove();
    let _ = fs::remove_dir_all(at);
    let _ = git(&["worktree", "prune"]).output();
    if let Some(parent) = at.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    run_checked(&mut git(&["worktree", "add", "--detach", &at_arg, commit]))?;
    let outcome = build(at);
    remove();
    outcome
}

/// `cargo build --workspace --bins` in `source`, a worktree made by
/// [`build_in`], with this checkout's compiled dependencies where the
/// commit's lockfile allows ([`Dependencies`]). Every binary of the
/// workspace, not the two a caller needs: cargo unifies the features of
/// the commit's own crates over what it builds, and only the workspace's
/// set is this checkout's (`-p` alone made other variants of them).
pub fn cargo_build(source: &Path) -> Result<(Command, Dependencies)> {
    let dependencies = dependencies::share_with(source)
        .with_context(|| format!("giving {} this checkout's dependencies", source.display()))?;
    let mut build = vpcnet_lab::cargo_env::cargo();
    build
        .current_dir(source)
        .args(["build", "--workspace", "--bins"]);
    if matches!(dependencies, Dependencies::Own(_)) {
        build.arg("--locked");
    }
    Ok((build, dependencies))
}
