//! `cargo xtask bench`: builds the release binaries, then runs
//! `vpcnet-bench` (the `bench/` crate), which brings the lab up in each
//! datapath in turn, measures, and writes `target/bench/`.

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{build, setup::run_checked};

#[derive(clap::Args)]
pub struct Args {
    /// Passed to `vpcnet-bench`: `--rounds N` (3), `--duration SECONDS`
    /// (5, per RR, CRR and stream measurement), `--parts LIST` (of
    /// paths,scale,churn,cni,nat-load,agent), `--from results.json` (redraw only),
    /// `--smoke` (one tiny round, with debug binaries).
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    bench_args: Vec<String>,
}

pub fn run(args: &Args) -> Result<()> {
    if vpcnet_lab::exists()? {
        bail!(
            "a lab exists; the benchmark brings up its own: remove it with `cargo xtask lab down`"
        );
    }
    let release = !args.bench_args.iter().any(|arg| arg == "--smoke");
    let bin_dir = build::run(&build::Args { release })?;
    let out = build::target_dir()?.join("bench");
    let mut bench = Command::new(bin_dir.join("vpcnet-bench"));
    bench
        .arg("--bin-dir")
        .arg(&bin_dir)
        .arg("--out")
        .arg(&out)
        .args(&args.bench_args);
    run_checked(&mut bench).context("the benchmark failed")?;
    println!("bench: report in {}", out.join("report.md").display());
    Ok(())
}
