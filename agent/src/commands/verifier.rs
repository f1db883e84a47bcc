//! `vpcnet-agent verifier`: what each program costs this kernel's verifier
//! against vpcnet's budgets.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use vpcnet_agent::datapath::{self, Datapath, LoadOptions, verifier};

/// `vpcnet-agent verifier`.
pub fn print_budgets() -> Result<()> {
    let pin_dir = PathBuf::from(format!(
        "/sys/fs/bpf/vpcnet-verifier-{}",
        std::process::id()
    ));
    let loaded = Datapath::load(&LoadOptions {
        pin_dir: pin_dir.clone(),
        ..LoadOptions::default()
    });
    let removed = datapath::remove_pins(&pin_dir);
    let datapath = loaded.context("loading the datapath")?;
    removed.with_context(|| format!("removing {}", pin_dir.display()))?;
    let release = verifier::kernel_release();
    let budgets = verifier::budgets(datapath.program_stats(), datapath::PROGRAMS, &release)?;
    println!("{}", verifier::table(&release, &budgets));
    let overruns: Vec<String> = budgets
        .iter()
        .flat_map(verifier::Budget::overruns)
        .collect();
    if !overruns.is_empty() {
        bail!("over budget:\n  {}", overruns.join("\n  "));
    }
    Ok(())
}
