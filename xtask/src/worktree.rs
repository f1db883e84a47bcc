//! A build in a git worktree of another commit (the upgrade tests'
//! releases, `cargo xtask image --commit`): the worktree made afresh (one
//! an interrupted build left goes first) and removed after the build,
//! whatever it did.

use std::{fs, path::Path, process::Command};

use anyhow::{Context, Result};

use crate::{build::workspace_root, setup::run_checked};

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
