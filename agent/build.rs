//! Builds the eBPF programs (`ebpf/vpcnet-ebpf`) for `bpfel-unknown-none` with
//! the nightly its `rust-toolchain.toml` pins and `bpf-linker`, and puts the object in `OUT_DIR` for
//! the agent to embed.
//!
//! `VPCNET_EBPF=stub` (or no `bpf-linker` on PATH) writes an empty object
//! instead, so `cargo check` and clippy of the user-space crates need no
//! `bpf-linker`; an agent built that way refuses to load and says why.

use std::{
    env,
    path::{Path, PathBuf},
    process::Command,
};

const OBJECT: &str = "vpcnet.bpf.o";
/// The lab's reproduction of aws-node's network policy programs, built by
/// the same run (the agent does not embed it).
const AWS_NETWORK_POLICY_OBJECT: &str = "aws-network-policy.bpf.o";

fn main() {
    println!("cargo:rerun-if-env-changed=VPCNET_EBPF");
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let ebpf_dir = manifest_dir.join("../ebpf/vpcnet-ebpf");
    let common_dir = manifest_dir.join("../ebpf/vpcnet-common");
    for dir in [ebpf_dir.join("src"), common_dir.join("src")] {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
    for file in ["Cargo.toml", ".cargo/config.toml", "rust-toolchain.toml"] {
        println!("cargo:rerun-if-changed={}", ebpf_dir.join(file).display());
    }
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let object = out_dir.join(OBJECT);

    let stub_requested = env::var("VPCNET_EBPF").is_ok_and(|v| v == "stub");
    let linker = which("bpf-linker");
    if stub_requested || linker.is_none() {
        if !stub_requested {
            println!(
                "cargo:warning=bpf-linker not found: embedding an empty eBPF object \
                 (run `cargo xtask setup` to build the real programs)"
            );
        }
        std::fs::write(&object, []).expect("write stub object");
        std::fs::write(out_dir.join(AWS_NETWORK_POLICY_OBJECT), []).expect("write stub object");
        return;
    }

    let target_dir = out_dir.join("ebpf-target");
    let mut cmd = Command::new("cargo");
    cmd.current_dir(&ebpf_dir)
        .args([
            "build",
            "--release",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
        ])
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer cargo's settings are for the host build; none of them apply,
    // and without `RUSTUP_TOOLCHAIN` rustup takes the programs' own pin.
    for (key, _) in env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO_")
            || key.starts_with("RUSTC")
            || key == "RUSTUP_TOOLCHAIN"
            || key.starts_with("RUSTFLAGS")
            || key == "RUSTDOCFLAGS"
        {
            cmd.env_remove(key.as_ref());
        }
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("cannot run cargo for the eBPF programs: {e}"));
    assert!(
        status.success(),
        "building the eBPF programs failed ({status}); `cargo xtask setup` installs what it needs"
    );
    for (bin, object) in [
        ("vpcnet", object),
        (
            "aws-network-policy",
            out_dir.join(AWS_NETWORK_POLICY_OBJECT),
        ),
    ] {
        let built = target_dir.join("bpfel-unknown-none/release").join(bin);
        std::fs::copy(&built, &object)
            .unwrap_or_else(|e| panic!("copy {} to {}: {e}", built.display(), object.display()));
    }
}

fn which(program: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
