//! A cargo started from a crate's own process (xtask under `cargo run`, a
//! test under `cargo test`) inherits the variables cargo set for that crate
//! (`CARGO_MANIFEST_DIR`, `CARGO_PKG_NAME`, ...). ring's build script asks
//! to rerun when they change, so such a nested build rebuilt ring and all
//! above it (the EC2 SDK, kube, the agent: minutes of every CI run). A
//! nested cargo runs without them, as from a shell.

use std::process::Command;

/// Variables cargo sets for a crate's build script, binary or test.
const CRATE_VARS: [&str; 7] = [
    "CARGO_MANIFEST_DIR",
    "CARGO_MANIFEST_PATH",
    "CARGO_CRATE_NAME",
    "CARGO_BIN_NAME",
    "CARGO_PRIMARY_PACKAGE",
    "CARGO_TARGET_TMPDIR",
    "CARGO_RUSTC_CURRENT_DIR",
];
/// Families of them (`CARGO_PKG_VERSION`, `CARGO_BIN_EXE_vpcnet-agent`).
const CRATE_VAR_PREFIXES: [&str; 2] = ["CARGO_PKG_", "CARGO_BIN_EXE_"];

fn is_crate_var(name: &str) -> bool {
    CRATE_VARS.contains(&name) || CRATE_VAR_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Removes from `command`'s environment the variables cargo set for the
/// crate this process runs.
pub fn without_crate_vars(command: &mut Command) -> &mut Command {
    for (name, _) in std::env::vars_os() {
        if let Some(name) = name.to_str().filter(|n| is_crate_var(n)) {
            command.env_remove(name);
        }
    }
    command
}

/// `cargo`, as a shell would start it.
#[must_use]
pub fn cargo() -> Command {
    let mut command = Command::new("cargo");
    without_crate_vars(&mut command);
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crates_variables_go_and_cargos_settings_stay() {
        for name in [
            "CARGO_MANIFEST_DIR",
            "CARGO_PKG_NAME",
            "CARGO_BIN_EXE_vpcnet-agent",
        ] {
            assert!(is_crate_var(name), "{name}");
        }
        for name in [
            "CARGO_HOME",
            "CARGO_TARGET_DIR",
            "CARGO_TERM_COLOR",
            "CARGO",
        ] {
            assert!(!is_crate_var(name), "{name}");
        }
    }
}
