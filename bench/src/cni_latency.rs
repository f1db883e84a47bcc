//! CNI ADD and DEL as kubelet drives them: containerd's CRI runs the plugin
//! for every sandbox, with a warm pool (`WARM_IP_TARGET`: the addresses are
//! on the node before the pods come). Only vpcnet's: the VPC CNI's plugin and ipamd are
//! Go programs this lab cannot build.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use vpcnet_api::cni::StatusRequest;
use vpcnet_lab::{
    Datapath, Lab, cni_socket_file,
    cri_pods::{self, plugin_calls},
};

use crate::{
    labs::{ipam_lab_options, lab_up},
    measurement::Measurement,
    options::BenchOptions,
};

/// How long the pool may take to fill.
const POOL_TIMEOUT: Duration = Duration::from_mins(2);
/// How often the pool is read meanwhile (it has no events).
const POOL_POLL: Duration = Duration::from_millis(100);

/// Addresses the agent can hand out now (unassigned and out of their
/// cooldown), through its CNI backend.
pub fn available_addrs() -> Result<u32> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut client = vpcnet_api::connect_cni(cni_socket_file())
            .await
            .context("connecting to the agent")?;
        let status = client
            .status(StatusRequest {})
            .await
            .context("Status")?
            .into_inner();
        Ok(status.available_addrs)
    })
}

/// Waits until the agent holds `wanted` unassigned addresses.
pub fn wait_warm_pool(wanted: usize) -> Result<()> {
    let deadline = Instant::now() + POOL_TIMEOUT;
    loop {
        let available = available_addrs()?;
        if available as usize >= wanted {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "the agent's pool has {available} free addresses after {POOL_TIMEOUT:?}, {wanted} wanted"
            );
        }
        std::thread::sleep(POOL_POLL);
    }
}

/// The calls' wall times, and the plugin's own.
pub(crate) struct Cycles {
    pub adds: Vec<Duration>,
    pub dels: Vec<Duration>,
    pub runs: Vec<Duration>,
    pub removes: Vec<Duration>,
}

/// `cycles` times: `pods` `RunPodSandbox` calls, then `StopPodSandbox` and
/// `RemovePodSandbox` of each; the wall times of the calls and the plugin's
/// own (its log's `elapsed_ms`).
pub(crate) fn cycles(lab: &Lab, pods: usize, cycles: usize) -> Result<Cycles> {
    let client = lab.cri()?;
    let calls_before = plugin_calls().len();
    let (mut runs, mut removes) = (Vec::new(), Vec::new());
    for _ in 0..cycles {
        wait_warm_pool(pods)?;
        let mut sandboxes = Vec::new();
        for index in 0..pods {
            let spec = cri_pods::pod_spec(index);
            let started = Instant::now();
            let sandbox = client.run_pod_sandbox(&spec)?;
            runs.push(started.elapsed());
            sandboxes.push(sandbox);
        }
        for sandbox in sandboxes {
            let started = Instant::now();
            cri_pods::remove_pod(&client, &sandbox)?;
            removes.push(started.elapsed());
        }
    }
    let calls = plugin_calls();
    let plugin = |command: &str| -> Vec<Duration> {
        calls[calls_before.min(calls.len())..]
            .iter()
            .filter(|call| call.command == command)
            .filter_map(|call| call.elapsed)
            .collect()
    };
    let (adds, dels) = (plugin("ADD"), plugin("DEL"));
    if adds.len() != runs.len() {
        bail!(
            "{} sandboxes ran but the plugin logged {} ADDs",
            runs.len(),
            adds.len()
        );
    }
    Ok(Cycles {
        adds,
        dels,
        runs,
        removes,
    })
}

/// CNI ADD and DEL with a warm pool.
pub fn run(opts: &BenchOptions, round: usize) -> Result<Vec<Measurement>> {
    // The VPC CNI's way to keep addresses ready for pods to come.
    let warm = opts.cni_pods.to_string();
    let env = [("WARM_IP_TARGET", warm.as_str())];
    let lab = lab_up(&ipam_lab_options(opts, "m5.large", &env, true))?;
    let Cycles {
        adds,
        dels,
        runs,
        removes,
    } = cycles(&lab, opts.cni_pods, opts.cni_cycles)?;
    lab.down().context("taking the lab down")?;
    Ok(vec![
        Measurement::of_durations(round, Datapath::Ebpf, "cni_add", &adds),
        Measurement::of_durations(round, Datapath::Ebpf, "cni_del", &dels),
        Measurement::of_durations(round, Datapath::Ebpf, "cri_run_pod_sandbox", &runs),
        Measurement::of_durations(
            round,
            Datapath::Ebpf,
            "cri_stop_remove_pod_sandbox",
            &removes,
        ),
    ])
}

/// How full the NAT table is while [`run_under_nat_load`] measures.
pub const NAT_OCCUPANCY_PERCENT: [u32; 3] = [10, 50, 90];
/// The collector's interval there: a pass over the table every second.
const NAT_LOAD_GC_INTERVAL: &str = "1";
/// How long a removed pod's address rests there: long enough to be
/// honoured, short enough that no cycle waits for it.
const NAT_LOAD_IP_COOLDOWN: &str = "1";
/// Collector passes over the filled table to wait for before measuring.
const PASSES_BEFORE: u64 = 2;

/// The name of the measurements at `percent` occupancy.
#[must_use]
pub fn nat_load_name(what: &str, percent: u32) -> String {
    format!("{what}_nat/{percent}")
}

/// CNI ADD with the NAT table 10%, 50% and 90% full of established flows,
/// and the garbage collector's pass time there: every pass reads the whole
/// table, and no ADD may wait for it. The pool is fixed
/// (`MINIMUM_IP_TARGET` alone, as large as a cycle's pods), so no call to
/// EC2 runs beside the ADDs and the table's fill is the only difference.
pub fn run_under_nat_load(opts: &BenchOptions, round: usize) -> Result<Vec<Measurement>> {
    let mut measurements = Vec::new();
    let pool = opts.nat_load_pods.to_string();
    let env = [
        ("MINIMUM_IP_TARGET", pool.as_str()),
        ("IP_COOLDOWN_PERIOD", NAT_LOAD_IP_COOLDOWN),
        ("VPCNET_GC_INTERVAL", NAT_LOAD_GC_INTERVAL),
    ];
    for percent in NAT_OCCUPANCY_PERCENT {
        let lab = lab_up(&ipam_lab_options(opts, "m5.large", &env, true))?;
        let flows = vpcnet_common::maps::NAT_DEFAULT_ENTRIES / 100 * percent;
        crate::nat_fill::fill(flows)?;
        let before = crate::nat_fill::collector()?.passes;
        crate::nat_fill::wait_passes(before + PASSES_BEFORE)?;
        let Cycles { adds, .. } = cycles(&lab, opts.nat_load_pods, opts.nat_load_cycles)?;
        let collector = crate::nat_fill::collector()?;
        lab.down().context("taking the lab down")?;
        measurements.push(Measurement::of_durations(
            round,
            Datapath::Ebpf,
            &nat_load_name("cni_add", percent),
            &adds,
        ));
        measurements.push(
            Measurement::new(round, Datapath::Ebpf, nat_load_name("gc_pass", percent))
                .with("flows", f64::from(flows))
                .with(
                    "ms",
                    Duration::from_micros(collector.last_pass_microseconds).as_secs_f64() * 1e3,
                ),
        );
    }
    Ok(measurements)
}
