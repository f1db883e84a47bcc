//! Formatting and lints: rustfmt and the eBPF crate's clippy as steps of
//! their own, the workspace's clippy inside its one build.

use std::{collections::BTreeSet, process::Stdio, time::Instant};

use anyhow::{Context, Result, bail};

use super::steps::{Step, cargo, format_duration, plain_cargo, stopped_at};
use crate::{
    build::workspace_root,
    setup::{ebpf_toolchain, shell_line},
};

/// The programs crate: its own workspace, built for the BPF target.
const EBPF_CRATE_DIR: &str = "ebpf/vpcnet-ebpf";

pub(super) fn lint_steps() -> Result<Vec<Step>> {
    let root = workspace_root();
    let ebpf_dir = root.join(EBPF_CRATE_DIR);
    // rustfmt.toml's options are nightly's: the programs' pinned nightly
    // formats both workspaces.
    let nightly = ebpf_toolchain::pinned()?.plus();
    let nightly = nightly.as_str();

    // The whole workspace, whatever `-p` selects for the tests.
    let fmt = plain_cargo(&root, &[nightly, "fmt", "--all", "--", "--check"]);
    let fmt_ebpf = plain_cargo(&ebpf_dir, &[nightly, "fmt", "--check"]);
    // The workspace's clippy runs in its build: `build_and_lint`.
    let clippy_ebpf = plain_cargo(
        &ebpf_dir,
        &[
            nightly,
            "clippy",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--release",
            "--",
            "-D",
            "warnings",
        ],
    );
    Ok(vec![
        Step {
            name: "fmt",
            command: fmt,
        },
        Step {
            name: "fmt (eBPF crate)",
            command: fmt_ebpf,
        },
        Step {
            name: "clippy (eBPF crate)",
            command: clippy_ebpf,
        },
    ])
}

/// Builds every target of the workspace (the tests' too, so that the test
/// runs build nothing more) through clippy's driver, and fails on any
/// warning, as `cargo clippy --all-targets -- -D warnings` does.
pub(super) fn build_and_lint(passed: &mut Vec<&'static str>) -> Result<()> {
    const NAME: &str = "build and clippy";
    let mut build = cargo(
        &workspace_root(),
        &[
            "build",
            "--workspace",
            "--all-targets",
            "--message-format=json",
        ],
    );
    build.stdout(Stdio::piped()).stderr(Stdio::inherit());
    println!("==> {NAME}: {}", shell_line(&build));
    let started = Instant::now();
    let output = build
        .output()
        .with_context(|| format!("cannot start cargo build; {}", stopped_at(NAME, passed)))?;
    let messages = String::from_utf8_lossy(&output.stdout);
    for rendered in rendered_diagnostics(&messages) {
        eprint!("{rendered}");
    }
    let warnings = warnings_of(&messages);
    if !output.status.success() {
        bail!(
            "the build failed ({}); {}",
            output.status,
            stopped_at(NAME, passed)
        );
    }
    if !warnings.is_empty() {
        bail!(
            "{} warnings (above; lints deny them): {}; {}",
            warnings.len(),
            warnings.into_iter().collect::<Vec<_>>().join("; "),
            stopped_at(NAME, passed)
        );
    }
    println!(
        "<== {NAME} passed in {}",
        format_duration(started.elapsed())
    );
    passed.push(NAME);
    Ok(())
}

/// The compilers' diagnostics among cargo's JSON messages.
fn diagnostics(messages: &str) -> impl Iterator<Item = serde_json::Value> + '_ {
    messages
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-message")
}

/// The diagnostics as rustc renders them.
fn rendered_diagnostics(messages: &str) -> Vec<String> {
    diagnostics(messages)
        .filter_map(|m| m["message"]["rendered"].as_str().map(str::to_owned))
        .collect()
}

/// The warnings among them, as `file:line: message`, each once (a crate's
/// library and its tests repeat them). Cargo replays those of crates it did
/// not rebuild, so a second run finds the same.
fn warnings_of(messages: &str) -> BTreeSet<String> {
    diagnostics(messages)
        .filter(|m| m["message"]["level"] == "warning")
        .filter_map(|m| {
            let message = &m["message"];
            // The summary ("N warnings emitted") has no span.
            let span = message["spans"].as_array()?.first()?;
            Some(format!(
                "{}:{}: {}",
                span["file_name"].as_str()?,
                span["line_start"],
                message["message"].as_str()?
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lint_steps_run_in_order_on_both_workspaces() {
        let mut steps = lint_steps().unwrap();
        let names: Vec<&str> = steps.iter().map(|step| step.name).collect();
        assert_eq!(names, ["fmt", "fmt (eBPF crate)", "clippy (eBPF crate)"]);
        let clippy = shell_line(&steps.remove(2).command);
        assert!(clippy.ends_with("-- -D warnings"), "{clippy}");
        // The pinned nightly, not whatever `nightly` is today.
        assert!(clippy.contains(" cargo +nightly-20"), "{clippy}");
    }

    #[test]
    fn the_builds_warnings_are_found_among_cargos_messages() {
        let messages = [
            r#"{"reason":"compiler-artifact","target":{"name":"x"}}"#,
            r#"{"reason":"compiler-message","message":{"level":"warning","message":"length comparison to zero","spans":[{"file_name":"agent/src/a.rs","line_start":3}]}}"#,
            r#"{"reason":"compiler-message","message":{"level":"warning","message":"1 warning emitted","spans":[]}}"#,
            r#"{"reason":"compiler-message","message":{"level":"error","message":"mismatched types","spans":[{"file_name":"b.rs","line_start":1}]}}"#,
            "not JSON: a build script's line",
        ]
        .join("\n");
        assert_eq!(
            warnings_of(&messages),
            BTreeSet::from(["agent/src/a.rs:3: length comparison to zero".to_owned()])
        );
    }
}
