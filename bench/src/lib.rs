//! `cargo xtask bench`: vpcnet's datapath against the VPC CNI's own
//! (iptables and policy routing, built verbatim by the lab) and against the
//! no-NAT routed path, in the lab, with the load generator of this crate,
//! iperf3 and containerd's CRI. Writes `results.json` (every measurement),
//! `report.md` (medians, ratios, targets) and SVG plots.

// Statistics: counts, durations and rates turn into f64 (and histogram
// edges back into integers) far below 2^52, where the casts are exact enough.
#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]

pub mod agent_scale;
pub mod cni_latency;
pub mod fillers;
pub mod labs;
pub mod loadgen;
pub mod measure;
pub mod measurement;
pub mod nat_fill;
pub mod options;
pub mod plot;
pub mod policy_apply;
pub mod policy_fill;
pub mod profile;
pub mod report;
pub mod run;
pub mod stats;

use std::{fs, path::Path};

use anyhow::{Context, Result};
pub use options::BenchOptions;
pub use run::Results;

/// Writes `results.json`, `report.md` and the plots into `dir`.
pub fn write_outputs(results: &Results, dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = dir.join("results.json");
    fs::write(&json, serde_json::to_vec_pretty(results)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let report = dir.join("report.md");
    fs::write(&report, report::markdown(results))
        .with_context(|| format!("writing {}", report.display()))?;
    let mut written = vec![json, report];
    written.extend(plot::write_all(results, dir)?);
    Ok(written)
}
