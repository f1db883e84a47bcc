//! The benchmark run: every figure in every datapath, round after round,
//! the datapaths interleaved within each round (and their order rotated
//! from round to round) so that a noisy machine hits them alike.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context, Result, bail};
use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use vpcnet_lab::{
    Datapath, LabOptions,
    addrs::{INET_ADDR, NS_INET, NS_PEER, PEER_ADDR},
    netns::set_sysctls,
};

use crate::{
    agent_scale, cni_latency,
    fillers::FillerEndpoints,
    labs::lab_up,
    loadgen::LoadResult,
    measure::{Client, ClientRun, Load, Server, iperf3_stream},
    measurement::Measurement,
    options::{BenchOptions, Part},
    policy_fill::PolicyFill,
    profile::{ProgramCost, ProgramStats, program_key},
};

/// Where every load generator server listens.
pub const PORT: u16 = 9000;

/// The machine the run was on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub cpus: usize,
    pub cpu_model: String,
    pub memory_gib: f64,
    pub kernel: String,
}

impl Machine {
    fn read() -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu_model = cpuinfo
            .lines()
            .find_map(|line| line.strip_prefix("model name"))
            .and_then(|rest| rest.split_once(':'))
            .map_or_else(
                || "unknown".to_owned(),
                |(_, model)| model.trim().to_owned(),
            );
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_kib = meminfo
            .lines()
            .find_map(|line| line.strip_prefix("MemTotal:"))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0);
        let kernel = nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_default();
        Self {
            cpus: std::thread::available_parallelism().map_or(1, usize::from),
            cpu_model,
            memory_gib: memory_kib / 1024.0 / 1024.0,
            kernel,
        }
    }
}

/// Everything a run produced: `target/bench/results.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub machine: Machine,
    pub options: BenchOptions,
    /// Unix seconds.
    pub started: u64,
    pub elapsed_s: f64,
    pub measurements: Vec<Measurement>,
}

impl Results {
    /// The median over rounds of value `key` of `name` in `datapath`.
    pub fn median(&self, datapath: Datapath, name: &str, key: &str) -> Option<f64> {
        let values: Vec<f64> = self
            .of(datapath, name)
            .filter_map(|m| m.value(key))
            .collect();
        crate::stats::median(&values)
    }

    /// The median over rounds of `a / b` for value `key` of two
    /// measurements (`(datapath, name)`), paired round by round: the
    /// datapaths ran back to back within a round, so a drift of the machine
    /// from one round to the next cancels out.
    pub fn paired_ratio(&self, a: (Datapath, &str), b: (Datapath, &str), key: &str) -> Option<f64> {
        let rounds: std::collections::BTreeSet<usize> =
            self.measurements.iter().map(|m| m.round).collect();
        let value = |round: usize, (datapath, name): (Datapath, &str)| {
            self.measurements
                .iter()
                .find(|m| m.round == round && m.datapath == datapath && m.name == name)?
                .value(key)
        };
        let ratios: Vec<f64> = rounds
            .into_iter()
            .filter_map(|round| {
                let (x, y) = (value(round, a)?, value(round, b)?);
                (y != 0.0).then(|| x / y)
            })
            .collect();
        crate::stats::median(&ratios)
    }

    /// The measurements of `name` in `datapath`.
    pub fn of<'a>(
        &'a self,
        datapath: Datapath,
        name: &'a str,
    ) -> impl Iterator<Item = &'a Measurement> + 'a {
        self.measurements
            .iter()
            .filter(move |m| m.datapath == datapath && m.name == name)
    }
}

/// The datapaths of the flows with a ceiling, in round `round`'s order.
fn rotated<const N: usize>(modes: [Datapath; N], round: usize) -> [Datapath; N] {
    let mut modes = modes;
    modes.rotate_left(round % N);
    modes
}

/// Runs the benchmark; `progress` hears about each step.
pub fn run(opts: &BenchOptions, progress: &dyn Fn(&str)) -> Result<Results> {
    opts.check()?;
    let _lock = vpcnet_lab::serial();
    if vpcnet_lab::exists()? {
        bail!("a lab exists already: remove it with `cargo xtask lab down` first");
    }
    let started = Instant::now();
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut measurements = Vec::new();
    let runs = |part| opts.parts.contains(&part);
    // Once, first: the longest set-up, and the likeliest to fail on a new
    // machine.
    if runs(Part::Agent) {
        progress(&format!("ebpf: the agent at {} pods", opts.agent_pods));
        measurements.push(agent_scale::run(opts)?);
    }
    for round in 0..opts.rounds {
        progress(&format!("round {} of {}", round + 1, opts.rounds));
        if runs(Part::Paths) {
            for datapath in rotated(
                [Datapath::Routed, Datapath::Iptables, Datapath::Ebpf],
                round,
            ) {
                progress(&format!("  {datapath}: SNAT, pod to pod, secondary ENI"));
                measurements.extend(base(opts, round, datapath)?);
            }
        }
        if runs(Part::Scale) {
            for &exclusions in &opts.scale_exclusions {
                for &fillers in &opts.scale_fillers {
                    for datapath in rotated([Datapath::Iptables, Datapath::Ebpf], round) {
                        progress(&format!(
                            "  {datapath}: RR at {fillers} pods' state, {exclusions} exclusions"
                        ));
                        measurements.push(scale(opts, round, datapath, fillers, exclusions)?);
                    }
                }
            }
        }
        if runs(Part::Churn) {
            for datapath in rotated([Datapath::Iptables, Datapath::Ebpf], round) {
                progress(&format!("  {datapath}: NAT under churn"));
                measurements.push(churn(opts, round, datapath)?);
            }
        }
        if runs(Part::Cni) {
            progress("  ebpf: CNI ADD and DEL through CRI");
            measurements.extend(cni_latency::run(opts, round)?);
        }
        if runs(Part::NatLoad) {
            progress("  ebpf: CNI ADD with the NAT table 10%, 50% and 90% full");
            measurements.extend(cni_latency::run_under_nat_load(opts, round)?);
        }
        if runs(Part::Policy) {
            progress(&format!(
                "  ebpf: flows with {POLICY_FILLERS} pods' network policy and none"
            ));
            measurements.extend(policy_cost(opts, round)?);
            progress(&format!(
                "  ebpf: NetworkPolicy applied to the maps, {} pods in the cluster; CNI ADD with policies",
                crate::policy_apply::CLUSTER_PODS
            ));
            measurements.extend(crate::policy_apply::run(opts, round)?);
        }
    }
    Ok(Results {
        machine: Machine::read(),
        options: opts.clone(),
        started: started_unix,
        elapsed_s: started.elapsed().as_secs_f64(),
        measurements,
    })
}

/// The lab's options for `datapath` with `pods` pods on `enis` ENIs.
fn lab_options(opts: &BenchOptions, datapath: Datapath, pods: usize, enis: usize) -> LabOptions {
    let base = match datapath {
        Datapath::Ebpf => LabOptions::ebpf(pods, opts.agent()),
        Datapath::Iptables => LabOptions::iptables(pods),
        Datapath::Routed => LabOptions {
            pods,
            datapath: Datapath::Routed,
            ..LabOptions::default()
        },
    };
    LabOptions { enis, ..base }
}

/// A connection per request on the options' CRR threads, closed as
/// `load` says.
fn crr(opts: &BenchOptions, load: Load) -> ClientRun {
    ClientRun {
        load,
        duration: opts.duration(),
        threads: opts.crr_threads,
        timeout: Duration::from_secs(1),
        pace: Duration::ZERO,
    }
}

/// One connection, back to back, for `duration`.
fn rr(duration: Duration) -> ClientRun {
    ClientRun {
        load: Load::Rr,
        duration,
        threads: 1,
        timeout: Duration::from_secs(1),
        pace: Duration::ZERO,
    }
}

/// SNAT (pod to `inet`), pod to pod on the node, and a pod on a secondary
/// ENI to `peer`, in a lab of three pods on two ENIs: pod-0 and pod-2 on
/// `eth0`, pod-1 on `eth1`.
fn base(opts: &BenchOptions, round: usize, datapath: Datapath) -> Result<Vec<Measurement>> {
    let lab = lab_up(&lab_options(opts, datapath, 3, 2))?;
    let tools = opts.tools();
    let (client, on_eth1, target) = (lab.pod(0), lab.pod(1), lab.pod(2));
    let _servers = [
        Server::start(&tools, NS_INET, SocketAddrV4::new(INET_ADDR, PORT))?,
        Server::start(&tools, NS_PEER, SocketAddrV4::new(PEER_ADDR, PORT))?,
        Server::start(&tools, &target.netns, SocketAddrV4::new(target.addr, PORT))?,
    ];
    let duration = opts.duration();
    let inet = SocketAddrV4::new(INET_ADDR, PORT);
    let mut out = Vec::new();
    let rr_to = |ns: &str, to: SocketAddrV4| Client::run(&tools, ns, to, rr(duration));

    out.push(Measurement::of_load(
        round,
        datapath,
        "snat_rr",
        rr_to(&client.netns, inet)?,
    ));
    out.push(Measurement::new(round, datapath, "snat_stream").with(
        "gbps",
        iperf3_stream(&client.netns, NS_INET, INET_ADDR, duration)?,
    ));
    let pod = SocketAddrV4::new(target.addr, PORT);
    out.push(Measurement::of_load(
        round,
        datapath,
        "pod_rr",
        rr_to(&client.netns, pod)?,
    ));
    out.push(Measurement::new(round, datapath, "pod_stream").with(
        "gbps",
        iperf3_stream(&client.netns, &target.netns, target.addr, duration)?,
    ));
    // The routed node has no policy routing to send pod-1 out of eth1: its
    // ceiling is the same flow from eth0.
    let eni_client = if datapath == Datapath::Routed {
        client
    } else {
        on_eth1
    };
    let peer = SocketAddrV4::new(PEER_ADDR, PORT);
    out.push(Measurement::of_load(
        round,
        datapath,
        "eni_rr",
        rr_to(&eni_client.netns, peer)?,
    ));

    if datapath == Datapath::Ebpf {
        // Apart from the figures above: the statistics cost every run a
        // little.
        for (name, to) in [("snat_rr", inet), ("pod_rr", pod)] {
            let stats = ProgramStats::start()?;
            let load = rr_to(&client.netns, to)?;
            out.push(profile_measurement(
                round,
                &format!("profile/{name}"),
                &load,
                &stats.finish()?,
            ));
        }
    }

    // A connection per request, the server closing first (an HTTP server
    // answering `Connection: close`): the server keeps the TIME_WAIT.
    let crr = |load| crr(opts, load);
    out.push(Measurement::of_load(
        round,
        datapath,
        "snat_crr",
        Client::run(&tools, &client.netns, inet, crr(Load::CrrServerCloses))?,
    ));
    // The client closing first: it may reuse its ports in TIME_WAIT (as
    // such a client must, or it runs out of ports in seconds) from the
    // whole port range.
    set_sysctls(
        &client.netns,
        &[
            ("net.ipv4.tcp_tw_reuse", "1"),
            ("net.ipv4.ip_local_port_range", "1024 65535"),
        ],
    )?;
    out.push(Measurement::of_load(
        round,
        datapath,
        "snat_crr_client_closes",
        Client::run(&tools, &client.netns, inet, crr(Load::Crr))?,
    ));
    lab.down().context("taking the lab down")?;
    Ok(out)
}

/// What the programs cost per exchange of an RR run (measurement `name`):
/// per program, nanoseconds per run and runs per exchange; in all, eBPF
/// nanoseconds per exchange, against the exchange's p50.
fn profile_measurement(
    round: usize,
    name: &str,
    load: &LoadResult,
    costs: &BTreeMap<&'static str, ProgramCost>,
) -> Measurement {
    let exchanges = load.transactions.max(1) as f64;
    let mut m = Measurement::new(round, Datapath::Ebpf, name).with("p50_us", load.latency.p50_us);
    let mut total_ns = 0.0;
    for (program, cost) in costs {
        let per_exchange = cost.runs as f64 / exchanges;
        total_ns += per_exchange * cost.ns_per_run;
        m = m
            .with(&program_key(program, "ns_per_run"), cost.ns_per_run)
            .with(&program_key(program, "runs_per_exchange"), per_exchange);
    }
    m.with("ns_per_exchange", total_ns)
}

/// SNAT exclusions: /24s of the benchmarking range 198.18.0.0/15, none of
/// them a lab address, so every flow to `inet` is checked against all.
pub fn exclusions(count: usize) -> Vec<Ipv4Net> {
    (0..count)
        .map(|i| {
            let [_, _, hi, lo] = u32::try_from(i).unwrap_or(0).to_be_bytes();
            Ipv4Net::new(Ipv4Addr::new(198, 18 + (hi & 1), lo, 0), 24).expect("a /24")
        })
        .collect()
}

/// SNAT RR from a pod whose entries come last, with `fillers` pods' worth
/// of routing state and `exclusion_count` SNAT exclusions.
fn scale(
    opts: &BenchOptions,
    round: usize,
    datapath: Datapath,
    fillers: usize,
    exclusion_count: usize,
) -> Result<Measurement> {
    let mut options = lab_options(opts, datapath, 1, 1);
    options.exclude_snat_cidrs = exclusions(exclusion_count);
    if datapath == Datapath::Iptables {
        options.filler_pods = fillers;
    }
    let lab = lab_up(&options)?;
    let pod = lab.pod(0);
    let endpoints = if datapath == Datapath::Ebpf {
        let mut entries = FillerEndpoints::insert(fillers)?;
        entries.rewrite_last(pod.addr)?;
        Some(entries)
    } else {
        None
    };
    let tools = opts.tools();
    let _server = Server::start(&tools, NS_INET, SocketAddrV4::new(INET_ADDR, PORT))?;
    let load = Client::run(
        &tools,
        &pod.netns,
        SocketAddrV4::new(INET_ADDR, PORT),
        rr(opts.duration()),
    )?;
    let rules = lab.ip_rules()?.len();
    let entries = endpoints.as_ref().map(FillerEndpoints::count).transpose()?;
    drop(endpoints);
    lab.down().context("taking the lab down")?;
    let mut m = Measurement::of_load(round, datapath, &scale_name(fillers, exclusion_count), load)
        .with("ip_rules", rules as f64);
    if let Some(entries) = entries {
        m = m.with("endpoints", entries as f64);
    }
    Ok(m)
}

/// The name of a scale sweep point.
pub fn scale_name(fillers: usize, exclusions: usize) -> String {
    format!("scale_rr/{fillers}/{exclusions}")
}

/// Pods' worth of endpoint and policy state in the policy part.
pub const POLICY_FILLERS: usize = 1000;

/// The name of the policy part's measurement of `flow`, `with_policy` or
/// not.
pub fn policy_name(flow: &str, with_policy: bool) -> String {
    let state = if with_policy { "on" } else { "none" };
    format!("policy/{state}/{flow}")
}

/// SNAT RR and CRR and pod-to-pod RR on a node with [`POLICY_FILLERS`]
/// pods' endpoint state and a node's worth of network policy (see
/// [`PolicyFill`]), enforced and not, in the same lab, the order
/// alternating from round to round; and what the programs cost per
/// exchange either way (`profile/` measurements, apart: the statistics
/// cost every run a little).
fn policy_cost(opts: &BenchOptions, round: usize) -> Result<Vec<Measurement>> {
    let lab = lab_up(&lab_options(opts, Datapath::Ebpf, 3, 1))?;
    let tools = opts.tools();
    let (client, target) = (lab.pod(0), lab.pod(2));
    let _servers = [
        Server::start(&tools, NS_INET, SocketAddrV4::new(INET_ADDR, PORT))?,
        Server::start(&tools, &target.netns, SocketAddrV4::new(target.addr, PORT))?,
    ];
    let _fillers = FillerEndpoints::insert(POLICY_FILLERS)?;
    let (inet, pod) = (
        SocketAddrV4::new(INET_ADDR, PORT),
        SocketAddrV4::new(target.addr, PORT),
    );
    // Written once: between the measurements only the flag flips, so both
    // states see the same maps.
    let mut fill = PolicyFill::insert(
        POLICY_FILLERS,
        client.addr,
        &[INET_ADDR, target.addr],
        target.addr,
        PORT,
    )?;
    let duration = opts.duration();
    let order = if round.is_multiple_of(2) {
        [false, true]
    } else {
        [true, false]
    };
    let mut out = Vec::new();
    for with_policy in order {
        fill.enforce(with_policy)?;
        let name = |flow: &str| policy_name(flow, with_policy);
        let rr_to = |to| Client::run(&tools, &client.netns, to, rr(duration));
        for (flow, to) in [("snat_rr", inet), ("pod_rr", pod)] {
            out.push(Measurement::of_load(
                round,
                Datapath::Ebpf,
                &name(flow),
                rr_to(to)?,
            ));
        }
        out.push(Measurement::of_load(
            round,
            Datapath::Ebpf,
            &name("snat_crr"),
            Client::run(
                &tools,
                &client.netns,
                inet,
                crr(opts, Load::CrrServerCloses),
            )?,
        ));
        for (flow, to, run) in [
            ("snat_rr", inet, rr(duration)),
            ("pod_rr", pod, rr(duration)),
            ("snat_crr", inet, crr(opts, Load::CrrServerCloses)),
        ] {
            let stats = ProgramStats::start()?;
            let load = Client::run(&tools, &client.netns, to, run)?;
            out.push(profile_measurement(
                round,
                &name(&format!("profile/{flow}")),
                &load,
                &stats.finish()?,
            ));
        }
    }
    let mut memory =
        Measurement::new(round, Datapath::Ebpf, "policy/maps").with("rules", fill.rules() as f64);
    let mut total = 0;
    for (map, bytes) in PolicyFill::memory()? {
        memory = memory.with(&format!("bytes/{map}"), bytes as f64);
        total += bytes;
    }
    out.push(memory.with("bytes", total as f64));
    drop(fill);
    lab.down().context("taking the lab down")?;
    Ok(out)
}

/// Server processes of the churn, each holding up to its open-file limit
/// (20000 here) of connections.
const CHURN_SERVERS: usize = 5;

/// NAT under churn: `churn_pods` pods open connections to one `inet`
/// address and port and keep them, until the NAT's port range for that
/// destination is full and beyond; meanwhile one established connection
/// from another pod keeps exchanging.
fn churn(opts: &BenchOptions, round: usize, datapath: Datapath) -> Result<Measurement> {
    let lab = lab_up(&lab_options(opts, datapath, opts.churn_pods + 1, 1))?;
    let tools = opts.tools();
    let inet = SocketAddrV4::new(INET_ADDR, PORT);
    // Servers enough for the whole port range and more, sharing the port.
    let _servers = (0..CHURN_SERVERS)
        .map(|_| Server::start(&tools, NS_INET, inet))
        .collect::<Result<Vec<_>>>()?;
    let churn = Duration::from_secs_f64(opts.churn_s);
    let kept_pod = lab.pod(opts.churn_pods);
    let kept = Client::start(
        &tools,
        &kept_pod.netns,
        inet,
        ClientRun {
            load: Load::Rr,
            duration: churn + Duration::from_secs(1),
            threads: 1,
            timeout: Duration::from_secs(1),
            // Every millisecond: it shows a stall, without taking a core.
            pace: Duration::from_millis(1),
        },
    )?;
    let holds = (0..opts.churn_pods)
        .map(|index| {
            Client::start(
                &tools,
                &lab.pod(index).netns,
                inet,
                ClientRun {
                    load: Load::Hold,
                    duration: churn,
                    threads: 4,
                    timeout: Duration::from_millis(500),
                    pace: Duration::ZERO,
                },
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let held: Vec<LoadResult> = holds
        .into_iter()
        .map(Client::finish)
        .collect::<Result<_>>()?;
    let kept = kept.finish()?;
    lab.down().context("taking the lab down")?;
    Ok(churn_measurement(round, datapath, &held, &kept))
}

/// The churn's figures from the holding clients' timelines and the kept
/// connection's run.
pub fn churn_measurement(
    round: usize,
    datapath: Datapath,
    held: &[LoadResult],
    kept: &LoadResult,
) -> Measurement {
    let ticks = held.iter().map(|r| r.timeline.len()).max().unwrap_or(0);
    let mut timeline = vec![(0, 0); ticks];
    let mut merged = LoadResult::default();
    for result in held {
        for (total, tick) in timeline.iter_mut().zip(&result.timeline) {
            total.0 += tick.0;
            total.1 += tick.1;
        }
        merged.transactions += result.transactions;
        merged.elapsed_s = merged.elapsed_s.max(result.elapsed_s);
        for (kind, n) in &result.errors {
            *merged.errors.entry(kind.clone()).or_default() += n;
        }
    }
    let per_second = 1.0 / crate::loadgen::TICK.as_secs_f64();
    let first_failure = timeline.iter().position(|tick| tick.1 > 0);
    let before_failure: u64 = timeline[..first_failure.unwrap_or(ticks)]
        .iter()
        .map(|tick| tick.0)
        .sum();
    let peak = timeline.iter().map(|tick| tick.0).max().unwrap_or(0);
    merged.rate = merged.transactions as f64 / merged.elapsed_s.max(f64::MIN_POSITIVE);
    merged.timeline = timeline;
    let mut m = Measurement::new(round, datapath, "nat_churn")
        .with("opened", merged.transactions as f64)
        .with("opened_before_first_failure", before_failure as f64)
        .with("peak_rate", peak as f64 * per_second)
        .with("failures", merged.failures() as f64)
        .with("kept_flow_failures", kept.failures() as f64)
        .with("kept_flow_max_ms", kept.latency.max_us / 1000.0)
        .with("kept_flow_exchanges", kept.transactions as f64);
    if let Some(tick) = first_failure {
        m = m.with("first_failure_s", tick as f64 / per_second);
    }
    m.load = Some(merged);
    m
}
