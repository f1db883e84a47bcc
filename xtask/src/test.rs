//! `cargo xtask test`: formatting, lints and every test, in that order,
//! stopping at the first step that fails. The tests share kernel state
//! (network namespaces, pinned maps), so they run as root, one at a time.

use std::{
    io::{BufRead, BufReader},
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

use crate::{
    build::workspace_root,
    setup::{self, run_checked, shell_line},
};

/// The programs crate: its own workspace, built for the BPF target.
const EBPF_CRATE_DIR: &str = "ebpf/vpcnet-ebpf";

#[derive(clap::Args)]
pub struct Args {
    /// Only run the tests: no formatting or lint checks.
    #[arg(long)]
    skip_lint: bool,
    /// Test (and lint) only these packages instead of the whole workspace.
    #[arg(long = "package", short = 'p', value_name = "PACKAGE")]
    packages: Vec<String>,
    /// Run only the tests whose name contains this (passed to cargo test).
    filter: Option<String>,
}

/// One step of the run: a name for the summary and the command it runs.
struct Step {
    name: &'static str,
    command: Command,
}

pub fn run(args: &Args) -> Result<()> {
    require_root()?;
    setup::ensure()?;
    let started = Instant::now();
    let mut passed: Vec<&str> = Vec::new();
    if !args.skip_lint {
        for step in lint_steps(&args.packages) {
            run_step(step, &mut passed)?;
        }
    }
    // The lab tests start the agent binary; `cargo test` builds a package's
    // binaries only for that package's own integration tests.
    run_step(
        Step {
            name: "build binaries",
            command: cargo(&workspace_root(), &["build", "--workspace", "--bins"]),
        },
        &mut passed,
    )?;
    let tally = run_tests(test_command(args))?;
    passed.push("tests");
    println!(
        "xtask test: OK: {} passed in {}",
        passed.join(", "),
        format_duration(started.elapsed())
    );
    println!("{}", tally.summary_line());
    Ok(())
}

fn require_root() -> Result<()> {
    let uid = setup::effective_uid()?;
    if uid != 0 {
        bail!(
            "cargo xtask test must run as root (effective uid is {uid}): the tests create \
             network namespaces, load BPF programs and pin maps under /sys/fs/bpf. \
             Run it as root, e.g. `sudo -E env PATH=\"$PATH\" cargo xtask test`"
        );
    }
    Ok(())
}

fn lint_steps(packages: &[String]) -> Vec<Step> {
    let root = workspace_root();
    let ebpf_dir = root.join(EBPF_CRATE_DIR);

    // Formatting is always checked for the whole workspace: it is fast, and
    // the package selection is for the slow steps.
    let fmt = cargo(&root, &["+nightly", "fmt", "--all", "--", "--check"]);
    let fmt_ebpf = cargo(&ebpf_dir, &["+nightly", "fmt", "--check"]);
    let mut clippy = cargo(&root, &["clippy"]);
    select_packages(&mut clippy, packages);
    clippy.args(["--all-targets", "--", "-D", "warnings"]);
    let clippy_ebpf = cargo(
        &ebpf_dir,
        &[
            "+nightly",
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
    vec![
        Step {
            name: "fmt",
            command: fmt,
        },
        Step {
            name: "fmt (eBPF crate)",
            command: fmt_ebpf,
        },
        Step {
            name: "clippy",
            command: clippy,
        },
        Step {
            name: "clippy (eBPF crate)",
            command: clippy_ebpf,
        },
    ]
}

fn test_command(args: &Args) -> Command {
    let mut test = cargo(&workspace_root(), &["test"]);
    select_packages(&mut test, &args.packages);
    test.args(["--no-fail-fast", "--", "--test-threads=1"]);
    if let Some(filter) = &args.filter {
        test.arg(filter);
    }
    test
}

fn cargo(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new("cargo");
    command.args(args).current_dir(dir).stdin(Stdio::null());
    command
}

fn select_packages(command: &mut Command, packages: &[String]) {
    if packages.is_empty() {
        command.arg("--workspace");
    } else {
        for package in packages {
            command.args(["--package", package]);
        }
    }
}

fn run_step(mut step: Step, passed: &mut Vec<&'static str>) -> Result<()> {
    println!("==> {}: {}", step.name, shell_line(&step.command));
    let started = Instant::now();
    run_checked(&mut step.command).with_context(|| stopped_at(step.name, passed))?;
    println!(
        "<== {} passed in {}",
        step.name,
        format_duration(started.elapsed())
    );
    passed.push(step.name);
    Ok(())
}

fn stopped_at(step: &str, passed: &[&str]) -> String {
    let before = if passed.is_empty() {
        String::new()
    } else {
        format!(" (passed before it: {})", passed.join(", "))
    };
    format!("xtask test: FAILED at step `{step}`{before}; fix it and run `cargo xtask test` again")
}

/// Runs cargo test, echoing its output and adding up libtest's
/// `test result:` lines.
fn run_tests(mut cargo_test: Command) -> Result<TestTally> {
    let line = shell_line(&cargo_test);
    println!("==> tests: {line}");
    let mut child = cargo_test
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start `{line}`"))?;
    let stdout = child.stdout.take().context("cargo test's stdout")?;
    let mut tally = TestTally::default();
    let mut reader = BufReader::new(stdout);
    let mut buffer = Vec::new();
    while reader
        .read_until(b'\n', &mut buffer)
        .context("read cargo test's output")?
        > 0
    {
        let text = String::from_utf8_lossy(&buffer);
        print!("{text}");
        tally.add_line(&text);
        buffer.clear();
    }
    let status = child.wait().context("wait for cargo test")?;
    if !status.success() {
        bail!(
            "xtask test: FAILED at step `tests`: `{line}` failed ({status}); {}",
            tally.summary_line()
        );
    }
    Ok(tally)
}

/// The sum of the `test result:` lines of every test binary.
#[derive(Debug, Default, PartialEq, Eq)]
struct TestTally {
    passed: u64,
    failed: u64,
    ignored: u64,
}

impl TestTally {
    /// Adds a libtest line such as
    /// `test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s`.
    fn add_line(&mut self, line: &str) {
        let Some(counts) = line.trim().strip_prefix("test result:") else {
            return;
        };
        for part in counts.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            let [.., count, kind] = words.as_slice() else {
                continue;
            };
            let Ok(count) = count.parse::<u64>() else {
                continue;
            };
            match *kind {
                "passed" => self.passed += count,
                "failed" => self.failed += count,
                "ignored" => self.ignored += count,
                _ => {}
            }
        }
    }

    fn summary_line(&self) -> String {
        format!(
            "tests: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.ignored
        )
    }
}

fn format_duration(elapsed: Duration) -> String {
    let seconds = elapsed.as_secs();
    if seconds >= 60 {
        format!("{}m{:02}s", seconds / 60, seconds % 60)
    } else {
        format!("{:.1}s", elapsed.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_adds_up_every_test_result_line() {
        let mut tally = TestTally::default();
        for line in [
            "running 3 tests",
            "test a ... ok",
            "test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s",
            "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 4 filtered out; finished in 1.20s\n",
            "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s",
        ] {
            tally.add_line(line);
        }
        assert_eq!(
            tally,
            TestTally {
                passed: 5,
                failed: 1,
                ignored: 1
            }
        );
        assert_eq!(tally.summary_line(), "tests: 5 passed, 1 failed, 1 skipped");
    }

    #[test]
    fn tally_ignores_other_lines() {
        let mut tally = TestTally::default();
        tally.add_line("test result_parsing ... ok");
        tally.add_line("3 passed; 1 failed");
        assert_eq!(tally, TestTally::default());
    }

    #[test]
    fn test_command_passes_the_filter_after_the_libtest_options() {
        let args = Args {
            skip_lint: true,
            packages: vec!["vpcnet-common".into()],
            filter: Some("nat".into()),
        };
        let line = shell_line(&test_command(&args));
        assert!(
            line.ends_with(
                "cargo test --package vpcnet-common --no-fail-fast -- --test-threads=1 nat"
            ),
            "{line}"
        );
    }

    #[test]
    fn lint_steps_run_in_order_on_both_workspaces() {
        let names: Vec<&str> = lint_steps(&[]).iter().map(|step| step.name).collect();
        assert_eq!(
            names,
            ["fmt", "fmt (eBPF crate)", "clippy", "clippy (eBPF crate)"]
        );
        let clippy = shell_line(&lint_steps(&[]).remove(2).command);
        assert!(
            clippy.ends_with("cargo clippy --workspace --all-targets -- -D warnings"),
            "{clippy}"
        );
    }

    #[test]
    fn durations_read_as_seconds_or_minutes() {
        assert_eq!(format_duration(Duration::from_millis(2500)), "2.5s");
        assert_eq!(format_duration(Duration::from_secs(125)), "2m05s");
    }
}
