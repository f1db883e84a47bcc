//! What a benchmark run does and how long: the parts, rounds, durations
//! and sizes every part reads.

use std::{path::PathBuf, time::Duration};

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use crate::measure::Tools;

/// What a run does and how long.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchOptions {
    /// Rounds: every figure is measured once per round and per datapath.
    pub rounds: usize,
    /// Seconds of each RR, CRR and stream measurement.
    pub duration_s: f64,
    /// CRR client threads.
    pub crr_threads: usize,
    /// Pods' worth of routing state for the scale sweep.
    pub scale_fillers: Vec<usize>,
    /// SNAT exclusions for the scale sweep.
    pub scale_exclusions: Vec<usize>,
    /// CNI latency: pods made (then removed) per cycle, and cycles per round.
    pub cni_pods: usize,
    pub cni_cycles: usize,
    /// CNI latency under NAT load: pods made (then removed) per cycle, and
    /// cycles per occupancy and round; enough ADDs for a p99 that is not
    /// the slowest call.
    #[serde(default = "BenchOptions::nat_load_pods_default")]
    pub nat_load_pods: usize,
    #[serde(default = "BenchOptions::nat_load_cycles_default")]
    pub nat_load_cycles: usize,
    /// The agent's footprint: pods given to it (once per run).
    pub agent_pods: usize,
    /// NAT under churn: seconds of opening connections, from this many pods.
    pub churn_s: f64,
    pub churn_pods: usize,
    /// The agent, the CNI plugin and the load generator.
    pub bin_dir: PathBuf,
    /// Network policies applied one after another (the time each takes
    /// to reach the node's maps).
    #[serde(default = "BenchOptions::policy_applies_default")]
    pub policy_applies: usize,
    /// The parts to run (all by default).
    #[serde(default = "Part::all")]
    pub parts: Vec<Part>,
}

/// A part of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Part {
    /// SNAT, pod to pod and secondary-ENI flows in all three datapaths.
    Paths,
    /// The scale sweep.
    Scale,
    /// NAT under churn.
    Churn,
    /// CNI ADD and DEL through CRI.
    Cni,
    /// CNI ADD with the NAT table 10%, 50% and 90% full, and the garbage
    /// collector's pass time there.
    NatLoad,
    /// The agent's memory and CPU with many pods.
    Agent,
    /// Flows with a node's worth of network policy against none.
    Policy,
}

impl Part {
    pub fn all() -> Vec<Self> {
        vec![
            Self::Agent,
            Self::Paths,
            Self::Scale,
            Self::Churn,
            Self::Cni,
            Self::NatLoad,
            Self::Policy,
        ]
    }
}

impl BenchOptions {
    /// The full run: three rounds.
    pub fn full(bin_dir: PathBuf) -> Self {
        Self {
            rounds: 3,
            duration_s: 5.0,
            crr_threads: 4,
            scale_fillers: vec![10, 1000, 4096],
            scale_exclusions: vec![0, 64],
            cni_pods: 8,
            cni_cycles: 5,
            nat_load_pods: Self::nat_load_pods_default(),
            nat_load_cycles: Self::nat_load_cycles_default(),
            agent_pods: 1000,
            churn_s: 30.0,
            // Each holds up to its local port range (28232) or open-file
            // limit (20000 here): together more than the 64512 SNAT ports.
            churn_pods: 4,
            policy_applies: Self::policy_applies_default(),
            bin_dir,
            parts: Part::all(),
        }
    }

    /// A run that only shows every part works: one short round, one scale
    /// point, a few pods.
    pub fn smoke(bin_dir: PathBuf) -> Self {
        Self {
            rounds: 1,
            duration_s: 0.5,
            crr_threads: 2,
            scale_fillers: vec![10],
            scale_exclusions: vec![64],
            cni_pods: 2,
            cni_cycles: 1,
            nat_load_pods: 2,
            nat_load_cycles: 1,
            agent_pods: 20,
            churn_s: 1.0,
            churn_pods: 1,
            policy_applies: 2,
            bin_dir,
            parts: Part::all(),
        }
    }

    /// 24 pods: an m5.large's pool (27 secondary addresses) holds them
    /// all without a call to EC2 between cycles.
    fn nat_load_pods_default() -> usize {
        24
    }

    /// 100 applies: the p99 the slowest but one.
    fn policy_applies_default() -> usize {
        100
    }

    /// 10 cycles of 24: 240 ADDs per occupancy, the p99 the third slowest.
    fn nat_load_cycles_default() -> usize {
        10
    }

    pub(crate) fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.duration_s)
    }

    pub(crate) fn agent(&self) -> PathBuf {
        self.bin_dir.join("vpcnet-agent")
    }

    pub(crate) fn cni_plugin(&self) -> PathBuf {
        self.bin_dir.join("vpcnet-cni")
    }

    pub(crate) fn tools(&self) -> Tools {
        Tools {
            loadgen: self.bin_dir.join("vpcnet-loadgen"),
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        for bin in [self.agent(), self.cni_plugin(), self.tools().loadgen] {
            if !bin.is_file() {
                bail!(
                    "{} is missing: build the workspace's binaries first",
                    bin.display()
                );
            }
        }
        if self.rounds == 0 || self.duration_s <= 0.0 || self.churn_s <= 0.0 {
            bail!("rounds and durations must be positive");
        }
        Ok(())
    }
}
