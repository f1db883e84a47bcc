//! `vpcnet-bench`: runs the benchmark in the lab and writes its outputs
//! (`cargo xtask bench` builds the release binaries and runs this).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use vpcnet_bench::{BenchOptions, options::Part, report, write_outputs};

#[derive(Parser)]
#[command(about = "vpcnet against the VPC CNI's iptables datapath and the routed ceiling")]
struct Cli {
    /// Where the agent, the CNI plugin and the load generator are.
    #[arg(long)]
    bin_dir: PathBuf,
    /// Where results.json, report.md and the plots go.
    #[arg(long)]
    out: PathBuf,
    /// Rounds (each measures every figure in every datapath).
    #[arg(long)]
    rounds: Option<usize>,
    /// Seconds per RR, CRR and stream measurement.
    #[arg(long)]
    duration: Option<f64>,
    /// A tiny run that shows every part works.
    #[arg(long)]
    smoke: bool,
    /// Only these parts (comma-separated).
    #[arg(long, value_delimiter = ',')]
    parts: Option<Vec<Part>>,
    /// Pods given to the agent for its footprint.
    #[arg(long)]
    agent_pods: Option<usize>,
    /// Measure nothing: write the report and plots of this results.json.
    #[arg(long)]
    from: Option<PathBuf>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let mut opts = if cli.smoke {
        BenchOptions::smoke(cli.bin_dir)
    } else {
        BenchOptions::full(cli.bin_dir)
    };
    if let Some(rounds) = cli.rounds {
        opts.rounds = rounds;
    }
    if let Some(duration) = cli.duration {
        opts.duration_s = duration;
    }
    if let Some(parts) = cli.parts {
        opts.parts = parts;
    }
    if let Some(pods) = cli.agent_pods {
        opts.agent_pods = pods;
    }
    let results = match &cli.from {
        Some(path) => serde_json::from_slice(
            &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("parsing {}", path.display()))?,
        None => vpcnet_bench::run::run(&opts, &|step| println!("bench: {step}"))?,
    };
    let written = write_outputs(&results, &cli.out)?;
    for target in report::targets(&results) {
        let mark = match target.met {
            Some(true) => "met",
            Some(false) => "MISSED",
            None => "not measured",
        };
        println!("target: {}: {} ({mark})", target.what, target.measured);
    }
    for path in written {
        println!("bench: wrote {}", path.display());
    }
    Ok(())
}
