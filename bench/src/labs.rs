//! The labs the parts bring up.

use anyhow::{Context, Result};
use vpcnet_lab::{CriLabOptions, IpamLabOptions, Lab, LabOptions};

use crate::options::BenchOptions;

/// Brings up a lab, saying which datapath failed.
pub fn lab_up(options: &LabOptions) -> Result<Lab> {
    Lab::up(options).with_context(|| format!("bringing the {} lab up", options.datapath))
}

/// The CRI lab of the CNI figures and the agent's footprint: the agent's
/// address manager against the EC2 emulator.
pub fn ipam_lab_options(
    opts: &BenchOptions,
    instance_type: &str,
    env: &[(&str, &str)],
    cri: bool,
) -> LabOptions {
    let mut ipam = IpamLabOptions::new(instance_type);
    ipam.env = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    ipam.cri = cri.then(|| CriLabOptions {
        cni_plugin: opts.cni_plugin(),
    });
    LabOptions {
        ipam: Some(ipam),
        ..LabOptions::ebpf(0, opts.agent())
    }
}
