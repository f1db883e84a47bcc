//! One measurement: what every part returns and the report reads.

use std::{collections::BTreeMap, time::Duration};

use serde::{Deserialize, Serialize};
use vpcnet_lab::Datapath;

use crate::{
    loadgen::LoadResult,
    stats::{Latency, nanos},
};

/// One measurement: a figure's values in one datapath in one round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Measurement {
    pub round: usize,
    pub datapath: Datapath,
    /// What was measured (`snat_rr`, `scale_rr/4096/64`, ...).
    pub name: String,
    /// Its values by key (`p50_us`, `rate`, `gbps`, ...).
    pub values: BTreeMap<String, f64>,
    /// The load generator's whole result: latency distribution, timeline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadResult>,
}

impl Measurement {
    pub fn new(round: usize, datapath: Datapath, name: impl Into<String>) -> Self {
        Self {
            round,
            datapath,
            name: name.into(),
            values: BTreeMap::new(),
            load: None,
        }
    }

    #[must_use]
    pub fn with(mut self, key: &str, value: f64) -> Self {
        self.values.insert(key.to_owned(), value);
        self
    }

    /// A load generator result: rate, latency percentiles and failures.
    pub fn of_load(round: usize, datapath: Datapath, name: &str, load: LoadResult) -> Self {
        let mut m = Self::new(round, datapath, name)
            .with("rate", load.rate)
            .with("transactions", load.transactions as f64)
            .with("failures", load.failures() as f64)
            .with("p50_us", load.latency.p50_us)
            .with("p90_us", load.latency.p90_us)
            .with("p99_us", load.latency.p99_us)
            .with("p999_us", load.latency.p999_us)
            .with("max_us", load.latency.max_us);
        m.load = Some(load);
        m
    }

    /// Durations of calls (CNI, CRI): percentiles in milliseconds.
    pub fn of_durations(round: usize, datapath: Datapath, name: &str, calls: &[Duration]) -> Self {
        let mut ns: Vec<u64> = calls.iter().map(|d| nanos(*d)).collect();
        let latency = Latency::of(&mut ns);
        let mut m = Self::new(round, datapath, name)
            .with("calls", calls.len() as f64)
            .with("p50_ms", latency.p50_us / 1e3)
            .with("p99_ms", latency.p99_us / 1e3)
            .with("max_ms", latency.max_us / 1e3);
        m.load = Some(LoadResult {
            transactions: latency.samples,
            latency,
            ..LoadResult::default()
        });
        m
    }

    pub fn value(&self, key: &str) -> Option<f64> {
        self.values.get(key).copied()
    }
}
