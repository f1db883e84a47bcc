//! `cargo xtask build`: the workspace binaries, with the eBPF programs that
//! agent/build.rs compiles and embeds. [`agent_binary`] and [`binary`] build
//! one binary for the lab and the tests and say where it is.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::setup::{self, run_checked, stdout_of};

/// The agent's package and binary name.
const AGENT_PACKAGE: &str = "vpcnet-agent";
/// The CNI plugin's package and binary name.
const CNI_PLUGIN_PACKAGE: &str = "vpcnet-cni";

#[derive(clap::Args)]
pub struct Args {
    /// Build with the release profile.
    #[arg(long)]
    pub release: bool,
}

/// Builds every binary of the workspace and returns the directory they are
/// in: `target/debug` or `target/release`.
pub fn run(args: &Args) -> Result<PathBuf> {
    setup::ensure(setup::Scope::Lab)?;
    let mut build = cargo_build(args.release);
    build.args(["--workspace", "--bins"]);
    run_checked(&mut build).context("building the workspace failed")?;
    let binaries = profile_dir(args.release)?;
    println!("build: binaries are in {}", binaries.display());
    Ok(binaries)
}

/// Builds the agent and returns the path of `target/{debug,release}/vpcnet-agent`.
pub fn agent_binary(release: bool) -> Result<PathBuf> {
    binary(AGENT_PACKAGE, AGENT_PACKAGE, release)
}

/// Builds the CNI plugin and returns the path of `target/{debug,release}/vpcnet-cni`.
pub fn cni_plugin_binary(release: bool) -> Result<PathBuf> {
    binary(CNI_PLUGIN_PACKAGE, CNI_PLUGIN_PACKAGE, release)
}

/// Builds binary `bin` of `package` (after [`setup::ensure`]) and returns its path.
pub fn binary(package: &str, bin: &str, release: bool) -> Result<PathBuf> {
    setup::ensure(setup::Scope::Lab)?;
    let mut build = cargo_build(release);
    build.args(["--package", package, "--bin", bin]);
    run_checked(&mut build).with_context(|| format!("building {bin} failed"))?;
    let path = profile_dir(release)?.join(bin);
    anyhow::ensure!(
        path.is_file(),
        "cargo built {bin} but {} is not there",
        path.display()
    );
    Ok(path)
}

/// The directory the workspace's `Cargo.toml` is in.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is a directory of the workspace")
        .to_path_buf()
}

/// The workspace's target directory, as cargo resolves it (`CARGO_TARGET_DIR`,
/// `build.target-dir` or `target/`).
pub fn target_dir() -> Result<PathBuf> {
    let metadata = stdout_of(
        Command::new("cargo")
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .current_dir(workspace_root()),
    )?;
    target_dir_of(&metadata)
}

/// Where cargo puts the binaries of a profile: `<target>/debug` or `<target>/release`.
pub fn profile_dir(release: bool) -> Result<PathBuf> {
    Ok(target_dir()?.join(profile_name(release)))
}

pub(crate) fn profile_name(release: bool) -> &'static str {
    if release { "release" } else { "debug" }
}

/// Clippy's driver in place of rustc for the workspace's own crates, as
/// `cargo clippy` runs it: a build then lints what it compiles, and its
/// dependencies are compiled once (`cargo clippy` checks them a second time,
/// minutes of a cold build for the EC2 SDK alone).
const LINTING_WRAPPER: (&str, &str) = ("RUSTC_WORKSPACE_WRAPPER", "clippy-driver");

/// `cargo` for `cargo xtask test`'s builds and test runs: every one lints
/// the workspace as it compiles it, so none rebuilds what another built (the
/// wrapper is part of each crate's fingerprint).
pub fn linting_cargo() -> Command {
    let mut cargo = vpcnet_lab::cargo_env::cargo();
    cargo.env(LINTING_WRAPPER.0, LINTING_WRAPPER.1);
    cargo
}

pub(crate) fn cargo_build(release: bool) -> Command {
    let mut build = vpcnet_lab::cargo_env::cargo();
    build.arg("build").current_dir(workspace_root());
    if release {
        build.arg("--release");
    }
    build
}

fn target_dir_of(metadata: &str) -> Result<PathBuf> {
    let metadata: serde_json::Value =
        serde_json::from_str(metadata).context("parse `cargo metadata` output")?;
    let dir = metadata["target_directory"]
        .as_str()
        .context("`cargo metadata` gave no target_directory")?;
    Ok(PathBuf::from(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_directory_is_read_from_cargo_metadata() {
        let metadata = r#"{"packages":[],"target_directory":"/w/target","version":1}"#;
        assert_eq!(target_dir_of(metadata).unwrap(), Path::new("/w/target"));
        assert!(target_dir_of(r#"{"packages":[]}"#).is_err());
    }

    #[test]
    fn cargo_metadata_gives_an_absolute_target_directory() {
        let dir = target_dir().unwrap();
        assert!(dir.is_absolute(), "{}", dir.display());
        assert_eq!(profile_dir(true).unwrap(), dir.join("release"));
    }

    #[test]
    fn profiles_map_to_their_directories() {
        assert_eq!(profile_name(false), "debug");
        assert_eq!(profile_name(true), "release");
    }

    #[test]
    fn workspace_root_holds_the_workspace_manifest() {
        assert!(workspace_root().join("Cargo.toml").is_file());
        assert!(workspace_root().join("xtask").is_dir());
    }
}
