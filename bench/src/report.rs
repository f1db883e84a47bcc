//! The report: medians over rounds per figure and datapath, the
//! eBPF/iptables and eBPF/routed ratios, and the targets, as
//! Markdown (`target/bench/report.md`).

use std::fmt::Write;

use vpcnet_lab::Datapath;

use crate::{
    profile::{PROGRAMS, program_key},
    run::{Results, policy_name, scale_name},
};

/// Which way is better.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Better {
    Higher,
    Lower,
}

/// One row of the report: a value of a measurement.
#[derive(Debug, Clone)]
pub struct Figure {
    pub title: String,
    pub measurement: String,
    pub key: String,
    pub unit: &'static str,
    pub better: Better,
}

impl Figure {
    fn new(
        title: impl Into<String>,
        measurement: impl Into<String>,
        key: impl Into<String>,
        unit: &'static str,
        better: Better,
    ) -> Self {
        Self {
            title: title.into(),
            measurement: measurement.into(),
            key: key.into(),
            unit,
            better,
        }
    }

    /// Whether an eBPF/other ratio of this figure is in eBPF's favour.
    pub fn ebpf_better(&self, ratio: f64) -> bool {
        match self.better {
            Better::Higher => ratio > 1.0,
            Better::Lower => ratio < 1.0,
        }
    }

    /// The median over rounds in `datapath`.
    pub fn median(&self, results: &Results, datapath: Datapath) -> Option<f64> {
        results.median(datapath, &self.measurement, &self.key)
    }
}

/// A group of rows with the datapaths they were measured in.
pub struct Section {
    pub title: &'static str,
    pub datapaths: &'static [Datapath],
    pub figures: Vec<Figure>,
}

const ALL: &[Datapath] = &[Datapath::Routed, Datapath::Iptables, Datapath::Ebpf];
const NAT: &[Datapath] = &[Datapath::Iptables, Datapath::Ebpf];
const EBPF: &[Datapath] = &[Datapath::Ebpf];

fn rr_figures(prefix: &str, measurement: &str) -> [Figure; 3] {
    [
        Figure::new(
            format!("{prefix} RR p50"),
            measurement,
            "p50_us",
            "µs",
            Better::Lower,
        ),
        Figure::new(
            format!("{prefix} RR p99"),
            measurement,
            "p99_us",
            "µs",
            Better::Lower,
        ),
        Figure::new(
            format!("{prefix} RR rate"),
            measurement,
            "rate",
            "req/s",
            Better::Higher,
        ),
    ]
}

/// Every section of the report, for the scale points of `results`.
#[allow(clippy::too_many_lines)] // a table of rows, one per line
pub fn sections(results: &Results) -> Vec<Section> {
    use Better::{Higher, Lower};
    let mut paths = vec![
        Figure::new(
            "SNAT (pod → inet) CRR, server closes",
            "snat_crr",
            "rate",
            "conn/s",
            Higher,
        ),
        Figure::new(
            "SNAT (pod → inet) CRR, client closes",
            "snat_crr_client_closes",
            "rate",
            "conn/s",
            Higher,
        ),
    ];
    paths.extend(rr_figures("SNAT (pod → inet)", "snat_rr"));
    paths.push(Figure::new(
        "SNAT (pod → inet) stream",
        "snat_stream",
        "gbps",
        "Gbit/s",
        Higher,
    ));
    paths.extend(rr_figures("pod → pod", "pod_rr"));
    paths.push(Figure::new(
        "pod → pod stream",
        "pod_stream",
        "gbps",
        "Gbit/s",
        Higher,
    ));
    paths.extend(
        rr_figures("secondary-ENI pod → peer", "eni_rr")
            .into_iter()
            .take(2),
    );

    let opts = &results.options;
    let mut scale = Vec::new();
    for &exclusions in &opts.scale_exclusions {
        for &fillers in &opts.scale_fillers {
            let name = scale_name(fillers, exclusions);
            let title = format!("SNAT RR p50, {fillers} pods' state, {exclusions} exclusions");
            scale.push(Figure::new(title, name.clone(), "p50_us", "µs", Lower));
            let title = format!("SNAT RR rate, {fillers} pods' state, {exclusions} exclusions");
            scale.push(Figure::new(title, name, "rate", "req/s", Higher));
        }
    }

    let churn = vec![
        Figure::new(
            "connections opened before the first failure",
            "nat_churn",
            "opened_before_first_failure",
            "conn",
            Higher,
        ),
        Figure::new(
            "peak new connections",
            "nat_churn",
            "peak_rate",
            "conn/s",
            Higher,
        ),
        Figure::new(
            "connections opened in all",
            "nat_churn",
            "opened",
            "conn",
            Higher,
        ),
        Figure::new(
            "connection attempts that timed out",
            "nat_churn",
            "failures",
            "attempts",
            Lower,
        ),
        Figure::new(
            "established flow: failed exchanges",
            "nat_churn",
            "kept_flow_failures",
            "",
            Lower,
        ),
        Figure::new(
            "established flow: slowest exchange",
            "nat_churn",
            "kept_flow_max_ms",
            "ms",
            Lower,
        ),
    ];

    let control = vec![
        Figure::new(
            "plugin ADD (its own time)",
            "cni_add",
            "p50_ms",
            "ms p50",
            Lower,
        ),
        Figure::new(
            "plugin ADD (its own time)",
            "cni_add",
            "p99_ms",
            "ms p99",
            Lower,
        ),
        Figure::new(
            "plugin DEL (its own time)",
            "cni_del",
            "p50_ms",
            "ms p50",
            Lower,
        ),
        Figure::new(
            "plugin DEL (its own time)",
            "cni_del",
            "p99_ms",
            "ms p99",
            Lower,
        ),
        Figure::new(
            "RunPodSandbox",
            "cri_run_pod_sandbox",
            "p50_ms",
            "ms p50",
            Lower,
        ),
        Figure::new(
            "RunPodSandbox",
            "cri_run_pod_sandbox",
            "p99_ms",
            "ms p99",
            Lower,
        ),
        Figure::new(
            "StopPodSandbox + RemovePodSandbox",
            "cri_stop_remove_pod_sandbox",
            "p50_ms",
            "ms p50",
            Lower,
        ),
        Figure::new(
            "StopPodSandbox + RemovePodSandbox",
            "cri_stop_remove_pod_sandbox",
            "p99_ms",
            "ms p99",
            Lower,
        ),
        Figure::new(
            "agent RSS with no pod",
            "agent_footprint",
            "rss_mib_before",
            "MiB",
            Lower,
        ),
        Figure::new(
            format!("agent RSS at {} pods", opts.agent_pods),
            "agent_footprint",
            "rss_mib",
            "MiB",
            Lower,
        ),
        Figure::new(
            format!("agent CPU idle at {} pods", opts.agent_pods),
            "agent_footprint",
            "idle_cpu_percent",
            "% of a core",
            Lower,
        ),
        Figure::new(
            "agent CPU per ADD (veth, programs, map entry)",
            "agent_footprint",
            "add_cpu_ms_per_pod",
            "ms",
            Lower,
        ),
        Figure::new(
            "agent AddNetwork",
            "agent_footprint",
            "add_p50_ms",
            "ms p50",
            Lower,
        ),
        Figure::new(
            "agent AddNetwork",
            "agent_footprint",
            "add_p99_ms",
            "ms p99",
            Lower,
        ),
        Figure::new(
            "agent DelNetwork",
            "agent_footprint",
            "del_p50_ms",
            "ms p50",
            Lower,
        ),
        Figure::new(
            format!(
                "agent restart to READY at {} pods, programs kept",
                opts.agent_pods
            ),
            "agent_footprint",
            "restart_kept_p50_ms",
            "ms p50",
            Lower,
        ),
        Figure::new(
            format!(
                "agent restart to READY at {} pods, programs verified",
                opts.agent_pods
            ),
            "agent_footprint",
            "restart_verified_p50_ms",
            "ms p50",
            Lower,
        ),
    ];

    let mut profile = Vec::new();
    for (flow, title) in [("snat_rr", "SNAT RR"), ("pod_rr", "pod → pod RR")] {
        let name = format!("profile/{flow}");
        profile.push(Figure::new(
            format!("{title}: eBPF time per exchange"),
            name.clone(),
            "ns_per_exchange",
            "ns",
            Lower,
        ));
        profile.push(Figure::new(
            format!("{title}: the exchange's p50 (statistics on)"),
            name.clone(),
            "p50_us",
            "µs",
            Lower,
        ));
        // The programs that ran on the flow's path.
        let ran = |program: &str| {
            results
                .of(Datapath::Ebpf, &name)
                .any(|m| m.value(&program_key(program, "ns_per_run")).is_some())
        };
        for program in PROGRAMS.into_iter().filter(|p| ran(p)) {
            profile.push(Figure::new(
                format!("{title}: {program}, per run"),
                name.clone(),
                program_key(program, "ns_per_run"),
                "ns",
                Lower,
            ));
            profile.push(Figure::new(
                format!("{title}: {program}, runs per exchange"),
                name.clone(),
                program_key(program, "runs_per_exchange"),
                "",
                Lower,
            ));
        }
    }

    let mut nat_load = Vec::new();
    for percent in crate::cni_latency::NAT_OCCUPANCY_PERCENT {
        let add = crate::cni_latency::nat_load_name("cni_add", percent);
        for (key, unit) in [("p50_ms", "ms p50"), ("p99_ms", "ms p99")] {
            nat_load.push(Figure::new(
                format!("plugin ADD, NAT table {percent}% full"),
                add.clone(),
                key,
                unit,
                Lower,
            ));
        }
        nat_load.push(Figure::new(
            format!("collector pass, NAT table {percent}% full"),
            crate::cni_latency::nat_load_name("gc_pass", percent),
            "ms",
            "ms",
            Lower,
        ));
    }

    let mut policy = Vec::new();
    for (flow, title, key, unit, better) in POLICY_FIGURES {
        for (with_policy, state) in [(false, "no policy"), (true, "policy on")] {
            policy.push(Figure::new(
                format!("{title}, {state}"),
                policy_name(flow, with_policy),
                key,
                unit,
                better,
            ));
        }
    }
    for (flow, title) in POLICY_PROFILES {
        for (with_policy, state) in [(false, "no policy"), (true, "policy on")] {
            policy.push(Figure::new(
                format!("{title}, {state}"),
                policy_name(flow, with_policy),
                "ns_per_exchange",
                "ns",
                Lower,
            ));
        }
    }
    for (key, unit) in [("p50_ms", "ms p50"), ("p99_ms", "ms p99")] {
        policy.push(Figure::new(
            "kubectl apply to the node's maps (1000 pods in the cluster)",
            "policy/apply_to_maps",
            key,
            unit,
            Lower,
        ));
        policy.push(Figure::new(
            "plugin ADD with policies in force",
            "policy/cni_add",
            key,
            unit,
            Lower,
        ));
    }
    policy.push(Figure::new(
        "rules written",
        "policy/maps",
        "rules",
        "",
        Lower,
    ));
    policy.push(Figure::new(
        "policy maps' memory",
        "policy/maps",
        "bytes",
        "bytes",
        Lower,
    ));

    vec![
        Section {
            title: "Per-packet paths (routed = no NAT, no rules: the ceiling)",
            datapaths: ALL,
            figures: paths,
        },
        Section {
            title: "Scale: SNAT RR from the pod whose entries come last",
            datapaths: NAT,
            figures: scale,
        },
        Section {
            title: "NAT under churn: connections held from pods to one inet address and port",
            datapaths: NAT,
            figures: churn,
        },
        Section {
            title: "Where the time goes: vpcnet's programs (kernel run-time statistics, in separate runs)",
            datapaths: EBPF,
            figures: profile,
        },
        Section {
            title: "Control plane (vpcnet only: the VPC CNI's Go plugin and ipamd cannot be built here)",
            datapaths: EBPF,
            figures: control,
        },
        Section {
            title: "CNI ADD while the garbage collector walks a full NAT table (vpcnet only)",
            datapaths: EBPF,
            figures: nat_load,
        },
        Section {
            title: "Network policy: 1000 pods' state and 500 rules (100 CIDRs with exceptions per set, port ranges) against none (vpcnet only)",
            datapaths: EBPF,
            figures: policy,
        },
    ]
}

/// The policy part's figures: flow, title, value, unit, which way is
/// better.
const POLICY_FIGURES: [(&str, &str, &str, &str, Better); 3] = [
    ("snat_rr", "SNAT RR p50", "p50_us", "µs", Better::Lower),
    ("pod_rr", "pod → pod RR p50", "p50_us", "µs", Better::Lower),
    ("snat_crr", "SNAT CRR", "rate", "conn/s", Better::Higher),
];

/// The policy part's program-time figures (the kernel's run-time
/// statistics over an RR run): flow, title.
const POLICY_PROFILES: [(&str, &str); 3] = [
    ("profile/snat_rr", "SNAT RR, eBPF time per exchange"),
    ("profile/pod_rr", "pod → pod RR, eBPF time per exchange"),
    ("profile/snat_crr", "SNAT CRR, eBPF time per connection"),
];

fn cell(value: Option<f64>) -> String {
    match value {
        None => "–".to_owned(),
        Some(v) if v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
    }
}

fn ratio_cell(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_owned(), |v| format!("{v:.2}x"))
}

/// One of the targets, met or not.
#[derive(Debug, Clone)]
pub struct Target {
    pub what: String,
    /// What was measured, in words.
    pub measured: String,
    /// `None` when a figure is missing.
    pub met: Option<bool>,
}

/// The targets (eBPF against iptables and the ceiling, same run).
pub fn targets(results: &Results) -> Vec<Target> {
    let (e, i, r) = (Datapath::Ebpf, Datapath::Iptables, Datapath::Routed);
    let vs = |name: &str, key: &str, other: Datapath| {
        results.paired_ratio((e, name), (other, name), key)
    };
    let mut out = Vec::new();
    let mut push = |what: String, measured: String, met: Option<bool>| {
        out.push(Target {
            what,
            measured,
            met,
        });
    };

    let (vs_ipt, vs_ceiling) = (vs("snat_crr", "rate", i), vs("snat_crr", "rate", r));
    push(
        "SNAT CRR at least 4x iptables and within 20% of routed".into(),
        format!(
            "{} of iptables, {} of routed",
            ratio_cell(vs_ipt),
            ratio_cell(vs_ceiling)
        ),
        vs_ipt.zip(vs_ceiling).map(|(a, b)| a >= 4.0 && b >= 0.8),
    );
    let p50 = vs("snat_rr", "p50_us", r);
    push(
        "SNAT RR p50 at most routed's".into(),
        format!("{} of routed's", ratio_cell(p50)),
        p50.map(|v| v <= 1.0),
    );
    let (vs_ipt, vs_ceiling) = (vs("snat_stream", "gbps", i), vs("snat_stream", "gbps", r));
    push(
        "SNAT stream at least 1.0x iptables and within 10% of routed".into(),
        format!(
            "{} of iptables, {} of routed",
            ratio_cell(vs_ipt),
            ratio_cell(vs_ceiling)
        ),
        vs_ipt.zip(vs_ceiling).map(|(a, b)| a >= 1.0 && b >= 0.9),
    );
    let pod_rr = vs("pod_rr", "rate", i);
    push(
        "pod-to-pod RR at least 1.3x iptables".into(),
        format!("{} of iptables (request rate)", ratio_cell(pod_rr)),
        pod_rr.map(|v| v >= 1.3),
    );
    let opts = &results.options;
    if let (Some(&fewest), Some(&most)) = (opts.scale_fillers.first(), opts.scale_fillers.last()) {
        for &exclusions in &opts.scale_exclusions {
            let (most_name, fewest_name) =
                (scale_name(most, exclusions), scale_name(fewest, exclusions));
            let kept_in = |d| results.paired_ratio((d, &most_name), (d, &fewest_name), "rate");
            let (kept, iptables_kept) = (kept_in(e), kept_in(i));
            push(
                format!("RR at {most} pods within 5% of RR at {fewest} ({exclusions} exclusions)"),
                format!(
                    "ebpf keeps {}, iptables keeps {}",
                    ratio_cell(kept),
                    ratio_cell(iptables_kept)
                ),
                kept.map(|v| v >= 0.95),
            );
        }
    }
    for (flow, title, key, _, better) in POLICY_FIGURES {
        let ratio = results.paired_ratio(
            (e, &policy_name(flow, true)),
            (e, &policy_name(flow, false)),
            key,
        );
        push(
            format!("{title} with a node's network policy within 3% of none"),
            format!("{} of no policy's", ratio_cell(ratio)),
            ratio.map(|v| match better {
                Better::Lower => v <= 1.03,
                Better::Higher => v >= 0.97,
            }),
        );
    }
    let apply_p99 = results.median(e, "policy/apply_to_maps", "p99_ms");
    push(
        "a NetworkPolicy from kubectl apply to the node's maps within 1 s at p99 (1000 pods)"
            .into(),
        format!("{} ms", cell(apply_p99)),
        apply_p99.map(|v| v < 1000.0),
    );
    let (fullest, emptiest) = (
        crate::cni_latency::NAT_OCCUPANCY_PERCENT.last(),
        crate::cni_latency::NAT_OCCUPANCY_PERCENT.first(),
    );
    if let (Some(&fullest), Some(&emptiest)) = (fullest, emptiest) {
        let add = |percent| crate::cni_latency::nat_load_name("cni_add", percent);
        let kept = results.paired_ratio((e, &add(fullest)), (e, &add(emptiest)), "p99_ms");
        push(
            format!(
                "plugin ADD p99 with the NAT table {fullest}% full within 10% of its p99 at {emptiest}%"
            ),
            format!("{} of the p99 at {emptiest}%", ratio_cell(kept)),
            kept.map(|v| v <= 1.1),
        );
    }
    out.into_iter().chain(restart_targets(results)).collect()
}

/// A restart over the same object and maps keeps the programs running;
/// one that must load them goes through the verifier.
fn restart_targets(results: &Results) -> Vec<Target> {
    [
        ("kept", "restart_kept_p50_ms", 300.0),
        ("verified", "restart_verified_p50_ms", 1000.0),
    ]
    .into_iter()
    .map(|(programs, value, bound_ms)| {
        let p50 = results.median(Datapath::Ebpf, "agent_footprint", value);
        Target {
            what: format!(
                "agent restart to READY, programs {programs}, under {bound_ms} ms at p50"
            ),
            measured: format!("{} ms", cell(p50)),
            met: p50.map(|v| v < bound_ms),
        }
    })
    .collect()
}

/// The report in Markdown.
pub fn markdown(results: &Results) -> String {
    let mut md = String::new();
    let m = &results.machine;
    let o = &results.options;
    let _ = writeln!(md, "# vpcnet benchmarks\n");
    let _ = writeln!(
        md,
        "Medians of {} round(s); every datapath measured in every round, interleaved, on one machine: {} CPU(s) ({}), {:.0} GiB, kernel {}. Each RR, CRR and stream measurement ran {} s; the run took {:.0} s. Every sample is in `results.json`.\n",
        o.rounds, m.cpus, m.cpu_model, m.memory_gib, m.kernel, o.duration_s, results.elapsed_s
    );
    let _ = writeln!(
        md,
        "Datapaths: **routed**, pods routed with no NAT and no rules (the ceiling); **iptables**, the VPC CNI's own wiring built verbatim (AWS-SNAT-CHAIN-0, connmark 0x80, ip rules 512/1024/1536, per-ENI tables); **ebpf**, vpcnet's agent and programs. Ratios are eBPF's value over the other's in the same round, the median over rounds (the datapaths of a round ran back to back: a drift of the machine between rounds cancels out): above 1 is better for rates, below 1 for latencies; in bold where eBPF is better.\n"
    );
    let _ = writeln!(md, "## Targets\n");
    for target in targets(results) {
        let mark = match target.met {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "not measured",
        };
        let _ = writeln!(md, "- {}: {} — {mark}", target.what, target.measured);
    }
    for section in sections(results) {
        let _ = writeln!(md, "\n## {}\n", section.title);
        let mut header = "| figure | unit |".to_owned();
        let mut rule = "| --- | --- |".to_owned();
        for datapath in section.datapaths {
            let _ = write!(header, " {datapath} |");
            rule.push_str(" ---: |");
        }
        let nat = section.datapaths.contains(&Datapath::Iptables);
        let ceiling = section.datapaths.contains(&Datapath::Routed);
        if nat {
            header.push_str(" ebpf / iptables |");
            rule.push_str(" ---: |");
        }
        if ceiling {
            header.push_str(" ebpf / routed |");
            rule.push_str(" ---: |");
        }
        let _ = writeln!(md, "{header}\n{rule}");
        for figure in &section.figures {
            let mut row = format!("| {} | {} |", figure.title, figure.unit);
            for &datapath in section.datapaths {
                let _ = write!(row, " {} |", cell(figure.median(results, datapath)));
            }
            let vs = |other| {
                let name = figure.measurement.as_str();
                let ratio =
                    results.paired_ratio((Datapath::Ebpf, name), (other, name), &figure.key);
                match ratio {
                    Some(v) if figure.ebpf_better(v) => format!("**{}**", ratio_cell(ratio)),
                    _ => ratio_cell(ratio),
                }
            };
            if nat {
                let _ = write!(row, " {} |", vs(Datapath::Iptables));
            }
            if ceiling {
                let _ = write!(row, " {} |", vs(Datapath::Routed));
            }
            let _ = writeln!(md, "{row}");
        }
    }
    let _ = writeln!(
        md,
        "\n## How\n\n- RR and CRR: `vpcnet-loadgen` (this workspace), {} B requests and {} B responses over TCP; RR is one connection, one request in flight; CRR opens a connection per request on {} threads, either the server closing first (as an HTTP server answering `Connection: close`: the server keeps the TIME_WAIT, which the SNAT's port choice must not land on) or the client (its namespace then reuses TIME_WAIT ports: `tcp_tw_reuse=1`, ports 1024-65535). The client runs on CPU 0, the server on CPU 1. Latencies are every exchange's, percentiles by nearest rank.\n- Stream: iperf3, one TCP stream, the receiver's rate.\n- The secondary-ENI flow leaves by `eth1` (policy routing or the agent's steering); the routed ceiling has no steering, so its figure is the same flow from a pod on `eth0`.\n- Scale: iptables gets each filler pod's rules 512 and 1536 before the measured pod's; eBPF gets the fillers' endpoint entries in the agent's map and the measured pod's written last. Exclusions are /24s of 198.18.0.0/15, checked before SNAT in both.\n- NAT under churn: {} pod(s) open and keep connections to one inet address and port ({} s, 4 threads each, 500 ms connect timeout), past the 64512 ports of the SNAT range; a paced RR connection from another pod runs meanwhile.\n- Plots: `latency_*.svg` (distributions), `scale.svg`, `nat_churn.svg`, `cni.svg`.",
        crate::loadgen::Exchange::default().request,
        crate::loadgen::Exchange::default().response,
        o.crr_threads,
        o.churn_pods,
        o.churn_s
    );
    md
}
