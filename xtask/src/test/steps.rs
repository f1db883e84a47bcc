//! The steps of `cargo xtask test`: each a command, said before it runs
//! and timed, and the cargo they run.

use std::{
    path::Path,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};

use crate::setup::{run_checked, shell_line};

/// One step of the run: a name for the summary and the command it runs.
pub(super) struct Step {
    pub(super) name: &'static str,
    pub(super) command: Command,
}

pub(super) fn run_step(mut step: Step, passed: &mut Vec<&'static str>) -> Result<()> {
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

pub(super) fn stopped_at(step: &str, passed: &[&str]) -> String {
    let before = if passed.is_empty() {
        String::new()
    } else {
        format!(" (passed before it: {})", passed.join(", "))
    };
    format!("xtask test: FAILED at step `{step}`{before}; fix it and run `cargo xtask test` again")
}

pub(super) fn format_duration(elapsed: Duration) -> String {
    let seconds = elapsed.as_secs();
    if seconds >= 60 {
        format!("{}m{:02}s", seconds / 60, seconds % 60)
    } else {
        format!("{:.1}s", elapsed.as_secs_f64())
    }
}

pub(super) fn cargo(dir: &Path, args: &[&str]) -> Command {
    let mut command = crate::build::linting_cargo();
    command.args(args).current_dir(dir).stdin(Stdio::null());
    command
}

/// `cargo` without the linting wrapper, for the steps that build nothing
/// of the workspace.
pub(super) fn plain_cargo(dir: &Path, args: &[&str]) -> Command {
    let mut command = vpcnet_lab::cargo_env::cargo();
    command.args(args).current_dir(dir).stdin(Stdio::null());
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_seconds_or_minutes() {
        assert_eq!(format_duration(Duration::from_millis(2500)), "2.5s");
        assert_eq!(format_duration(Duration::from_secs(125)), "2m05s");
    }
}
