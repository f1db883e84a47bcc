//! Where the eBPF datapath's time goes: the kernel's run-time statistics
//! of vpcnet's programs (`BPF_ENABLE_STATS`, on only while a [`ProgramStats`]
//! lives, and off again when it is dropped), as nanoseconds per run.

use std::{collections::BTreeMap, os::fd::OwnedFd, time::Duration};

use anyhow::{Context, Result};
use aya::{
    programs::loaded_programs,
    sys::{Stats, enable_stats},
};
use vpcnet_common::maps::{PROG_ENI_EGRESS, PROG_ENI_INGRESS, PROG_POD_EGRESS, PROG_POD_INGRESS};

/// vpcnet's tc programs.
pub const PROGRAMS: [&str; 4] = [
    PROG_POD_INGRESS,
    PROG_POD_EGRESS,
    PROG_ENI_INGRESS,
    PROG_ENI_EGRESS,
];

/// The key of a program's value in a profile measurement.
pub fn program_key(program: &str, value: &str) -> String {
    format!("{program}_{value}")
}

/// Run time and runs per program name, summed over its loaded instances.
fn snapshot() -> Result<BTreeMap<&'static str, (Duration, u64)>> {
    let mut totals = BTreeMap::new();
    for info in loaded_programs() {
        let info = info.context("reading a loaded program's info")?;
        let Some(name) = info
            .name_as_str()
            .and_then(|name| PROGRAMS.iter().find(|p| **p == name))
        else {
            continue;
        };
        let total: &mut (Duration, u64) = totals.entry(*name).or_default();
        total.0 += info.run_time();
        total.1 += info.run_count();
    }
    Ok(totals)
}

/// Statistics switched on, and what they were when they were.
pub struct ProgramStats {
    _enabled: OwnedFd,
    before: BTreeMap<&'static str, (Duration, u64)>,
}

/// What one program cost over a measurement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProgramCost {
    pub runs: u64,
    pub ns_per_run: f64,
}

impl ProgramStats {
    pub fn start() -> Result<Self> {
        let enabled = enable_stats(Stats::RunTime).context("enabling BPF run-time statistics")?;
        Ok(Self {
            _enabled: enabled,
            before: snapshot()?,
        })
    }

    /// The cost of each program that ran since [`ProgramStats::start`].
    pub fn finish(self) -> Result<BTreeMap<&'static str, ProgramCost>> {
        let after = snapshot()?;
        Ok(after
            .into_iter()
            .filter_map(|(name, (time, runs))| {
                let (time_before, runs_before) = self.before.get(name).copied().unwrap_or_default();
                let runs = runs.checked_sub(runs_before)?;
                let time = time.checked_sub(time_before)?;
                (runs > 0).then(|| {
                    (
                        name,
                        ProgramCost {
                            runs,
                            ns_per_run: time.as_nanos() as f64 / runs as f64,
                        },
                    )
                })
            })
            .collect())
    }
}
