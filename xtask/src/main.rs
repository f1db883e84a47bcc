//! `cargo xtask`: the project's commands. Nothing here needs bpf-linker to
//! compile: `setup` is what installs it.

mod bench;
mod build;
mod image;
mod kernels;
mod lab;
mod releases;
mod setup;
mod test;
mod vm;
mod worktree;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "vpcnet project commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install everything the build, the lab and the tests need (idempotent).
    Setup(setup::Args),
    /// Build the eBPF programs and the binaries.
    Build(build::Args),
    /// Run every test: formatting, lints, unit, `BPF_PROG_TEST_RUN` and lab tests.
    Test(test::Args),
    /// The lab, a node in a box: `up`, `down`, or the demo when given nothing.
    Lab(lab::Args),
    /// Benchmarks: vpcnet against the VPC CNI's iptables datapath and the
    /// routed ceiling, in the lab; report and plots in `target/bench/`.
    Bench(bench::Args),
    /// vpcnet's container image as an OCI archive, from the repository and
    /// the machine's Debian mirror alone (its path on the last line).
    Image(image::Args),
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Setup(args) => setup::run(&args),
        Command::Build(args) => build::run(&args).map(|_| ()),
        Command::Test(args) => test::run(&args),
        Command::Lab(args) => lab::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Image(args) => image::run(&args),
    }
}
