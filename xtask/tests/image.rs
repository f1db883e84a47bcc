//! `cargo xtask image` as a user runs it, from the suite's binaries: an OCI
//! archive that skopeo reads, with the agent as its entrypoint and the
//! commit in its labels, and the same bytes from two builds of one commit.
//!
//! Needs the workspace's binaries (`cargo build --workspace --bins`) and
//! the machine's Debian mirror.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use sha2::{Digest, Sha256};
use vpcnet_lab::test_sizes::SUITE_IMAGE_VAR;

/// A scratch directory, removed when dropped (also when the test fails).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn xtask() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_xtask"))
}

/// Runs `cargo xtask image` into `out`; returns the path it printed last.
fn build_image(bin_dir: &Path, out: &Path) -> PathBuf {
    let output = Command::new(xtask())
        .args(["image", "--bin-dir"])
        .arg(bin_dir)
        .arg("--out")
        .arg(out)
        .output()
        .expect("running xtask image");
    assert!(
        output.status.success(),
        "xtask image failed: {}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout).expect("UTF-8");
    PathBuf::from(stdout.lines().last().expect("a last line").trim())
}

fn sha256(path: &Path) -> String {
    hex::encode(Sha256::digest(fs::read(path).expect("reading the archive")))
}

fn skopeo(args: &[&str]) -> serde_json::Value {
    let output = Command::new("skopeo")
        .args(args)
        .output()
        .expect("running skopeo");
    assert!(
        output.status.success(),
        "skopeo {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("skopeo's JSON")
}

#[test]
fn two_builds_of_one_commit_give_one_archive_that_skopeo_reads() {
    let bin_dir = xtask().parent().expect("the binaries' directory");
    let scratch =
        Scratch(std::env::temp_dir().join(format!("vpcnet-image-{}", std::process::id())));
    fs::create_dir_all(&scratch.0).expect("a scratch directory");

    // The suite's image of these binaries, if `cargo xtask test` says it
    // built one, is the first build.
    let first = std::env::var_os(SUITE_IMAGE_VAR).map_or_else(
        || build_image(bin_dir, &scratch.0.join("first.oci.tar")),
        PathBuf::from,
    );
    let second = build_image(bin_dir, &scratch.0.join("second.oci.tar"));
    assert_eq!(second, scratch.0.join("second.oci.tar"), "the path printed");
    assert_eq!(
        sha256(&first),
        sha256(&second),
        "two builds of one commit differ"
    );

    let archive = format!("oci-archive:{}", first.display());
    let inspect = skopeo(&["inspect", &archive]);
    assert_eq!(inspect["Architecture"], "amd64");
    assert_eq!(inspect["Os"], "linux");
    assert_eq!(
        inspect["Layers"].as_array().map(Vec::len),
        Some(2),
        "the root filesystem and vpcnet's own layer: {inspect}"
    );
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("git rev-parse");
    let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
    let labels = &inspect["Labels"];
    assert_eq!(labels["org.opencontainers.image.revision"], head.as_str());
    assert_eq!(
        labels["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION")
    );
    let packages = labels["dev.vpcnet.image.debian-packages"]
        .as_str()
        .unwrap_or_default();
    for package in ["iptables ", "conntrack ", "containernetworking-plugins "] {
        assert!(
            packages.contains(package),
            "{package}is not among the image's packages: {packages}"
        );
    }

    let config = skopeo(&["inspect", "--config", &archive]);
    assert_eq!(
        config["config"]["Entrypoint"],
        serde_json::json!(["/usr/local/bin/vpcnet-agent"]),
        "{config}"
    );
    // The blobs are what the manifest says they are.
    let copy = scratch.0.join("copy");
    let copied = Command::new("skopeo")
        .args(["copy", "--quiet", &archive])
        .arg(format!("dir:{}", copy.display()))
        .status()
        .expect("running skopeo copy");
    assert!(copied.success(), "skopeo copy of the archive failed");
}

#[test]
fn an_arm64_image_is_cross_built_and_its_agent_runs_under_qemu() {
    let scratch =
        Scratch(std::env::temp_dir().join(format!("vpcnet-image-arm64-{}", std::process::id())));
    fs::create_dir_all(&scratch.0).expect("a scratch directory");
    let out = scratch.0.join("both.oci.tar");
    let output = Command::new(xtask())
        .args(["image", "--arch", "amd64,arm64", "--out"])
        .arg(&out)
        .output()
        .expect("running xtask image");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "xtask image --arch amd64,arm64 failed: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // The arm64 agent ran under qemu and read its embedded programs.
    assert!(
        stdout.contains("image: arm64: vpcnet-agent verifier --dry-run: embedded eBPF object"),
        "{stdout}"
    );
    let archive = format!("oci-archive:{}", out.display());
    let index = skopeo(&["inspect", "--raw", &archive]);
    let platforms: Vec<&str> = index["manifests"]
        .as_array()
        .expect("an image index")
        .iter()
        .filter_map(|manifest| manifest["platform"]["architecture"].as_str())
        .collect();
    assert_eq!(platforms, ["amd64", "arm64"], "{index}");
    let arm64 = skopeo(&["inspect", "--override-arch", "arm64", &archive]);
    assert_eq!(arm64["Architecture"], "arm64");
    let packages = arm64["Labels"]["dev.vpcnet.image.debian-packages"]
        .as_str()
        .unwrap_or_default();
    assert!(
        packages
            .split(", ")
            .any(|package| package.starts_with("iptables ") && package.ends_with(" arm64")),
        "{packages}"
    );
}
