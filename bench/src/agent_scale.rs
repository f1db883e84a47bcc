//! The agent at scale: its memory and CPU with many pods, given to it the
//! way the plugin does (a host veth per pod, then `AddNetwork` over its
//! socket), without a container runtime, whose shims would cost more than
//! the machine has for a thousand pods.

use std::{
    fs,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use vpcnet_api::{
    cni::{AddNetworkRequest, DelNetworkRequest, PodKey},
    pod::{DEFAULT_VETH_PREFIX, host_veth_name},
};
use vpcnet_common::maps::{LINKS_DIR, PIN_DIR, PROGRAMS_DIR};
use vpcnet_lab::{
    Datapath, Lab,
    addrs::NS_NODE,
    cni_socket_file,
    ec2::config::LAB_CUSTOM_SUBNET_ID,
    netns::{create_namespaces, delete_namespaces, ip_batch},
};

use crate::{
    cni_latency::wait_warm_pool,
    labs::{ipam_lab_options, lab_up},
    measurement::Measurement,
    options::BenchOptions,
};

/// Where the pods' ends of the veths go.
const PODS_NS: &str = "vpcnet-bench-pods";
/// The Kubernetes namespace the pods are in (their veth names derive from it).
const K8S_NAMESPACE: &str = "bench";
/// How long the agent is watched with all its pods and nothing to do.
const IDLE_WINDOW: Duration = Duration::from_secs(10);
/// Restarts of each kind ([`restarts`]).
const RESTARTS: usize = 5;

/// Custom networking (the node subnet, a /24, holds too few addresses) with
/// /28 prefixes, and the pool filled for every pod beforehand.
fn env(pods: usize) -> Vec<(&'static str, String)> {
    vec![
        ("AWS_VPC_K8S_CNI_CUSTOM_NETWORK_CFG", "true".into()),
        ("VPCNET_ENI_CONFIG_SUBNET", LAB_CUSTOM_SUBNET_ID.into()),
        (
            "VPCNET_ENI_CONFIG_SECURITY_GROUPS",
            "sg-0a5e1ab0000000002".into(),
        ),
        ("ENABLE_PREFIX_DELEGATION", "true".into()),
        ("MINIMUM_IP_TARGET", pods.to_string()),
        // Kubelet's max-pods, which caps the pool (on EKS 110 with prefixes
        // on this type): raised as an operator raises it for dense nodes.
        ("VPCNET_MAX_PODS", pods.to_string()),
    ]
}

/// A process's resident memory (MiB) and CPU time used so far.
#[derive(Debug, Clone, Copy)]
struct Usage {
    rss_mib: f64,
    cpu: Duration,
}

impl Usage {
    fn of(pid: i32) -> Result<Self> {
        let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
        let rss_kib: f64 = status
            .lines()
            .find_map(|line| line.strip_prefix("VmRSS:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .context("VmRSS of the agent")?;
        let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
        // Fields after the command (which may hold spaces), from field 3.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .context("/proc/PID/stat")?
            .1
            .split_whitespace()
            .collect();
        let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
        // SAFETY: sysconf reads a constant.
        let per_second = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) })?;
        Ok(Self {
            rss_mib: rss_kib / 1024.0,
            cpu: Duration::from_secs_f64(ticks as f64 / per_second as f64),
        })
    }
}

/// The pods' namespace, deleted when dropped (with it go the veths).
struct PodsNamespace;

impl PodsNamespace {
    fn create() -> Result<Self> {
        create_namespaces(&[PODS_NS.to_owned()])?;
        Ok(Self)
    }
}

impl Drop for PodsNamespace {
    fn drop(&mut self) {
        let _ = delete_namespaces(&[PODS_NS.to_owned()]);
    }
}

fn pod_key(index: usize) -> PodKey {
    PodKey {
        network_name: "aws-cni".into(),
        container_id: format!("{index:064x}"),
        if_name: "eth0".into(),
        k8s_pod_namespace: K8S_NAMESPACE.into(),
        k8s_pod_name: format!("pod-{index}"),
    }
}

fn veth(index: usize) -> String {
    host_veth_name(DEFAULT_VETH_PREFIX, K8S_NAMESPACE, &format!("pod-{index}"))
}

/// Gives the agent `agent_pods` pods, watches it idle, takes them away.
pub fn run(opts: &BenchOptions) -> Result<Measurement> {
    let pods = opts.agent_pods;
    let env = env(pods);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut lab = lab_up(&ipam_lab_options(opts, "m5.4xlarge", &env, false))?;
    let pid = lab.state().agent.as_ref().context("the agent's pid")?.pid;
    wait_warm_pool(pods)?;
    let _pods_ns = PodsNamespace::create()?;
    let lines: Vec<String> = (0..pods)
        .flat_map(|index| {
            let host = veth(index);
            [
                format!("link add {host} type veth peer name p{index} netns {PODS_NS}"),
                format!("link set {host} up"),
            ]
        })
        .collect();
    ip_batch(Some(NS_NODE), &lines)?;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut client = runtime
        .block_on(vpcnet_api::connect_cni(cni_socket_file()))
        .context("connecting to the agent")?;
    let before = Usage::of(pid)?;
    let adds = timed(pods, |index| {
        runtime
            .block_on(client.add_network(AddNetworkRequest {
                pod: Some(pod_key(index)),
                netns: format!("/var/run/netns/{PODS_NS}"),
                host_veth: veth(index),
                pod_mac: format!("02:be:00:00:{:02x}:{:02x}", index >> 8, index & 0xff),
                ..AddNetworkRequest::default()
            }))
            .with_context(|| format!("AddNetwork of pod {index}"))
    })?;
    let loaded = Usage::of(pid)?;
    std::thread::sleep(IDLE_WINDOW);
    let idle = Usage::of(pid)?;
    drop(client);
    let (kept, verified) = restarts(&mut lab)?;
    let pid = lab.state().agent.as_ref().context("the agent's pid")?.pid;
    let mut client = runtime
        .block_on(vpcnet_api::connect_cni(cni_socket_file()))
        .context("connecting to the restarted agent")?;
    let before_dels = Usage::of(pid)?;
    let dels = timed(pods, |index| {
        runtime
            .block_on(client.del_network(DelNetworkRequest {
                pod: Some(pod_key(index)),
                host_veth: veth(index),
                reason: vpcnet_api::del_reason::POD_DELETED.to_owned(),
            }))
            .with_context(|| format!("DelNetwork of pod {index}"))
    })?;
    // The same process since `before_dels`: a restarted agent has another
    // pid, and reading this one's usage would have failed.
    let after = Usage::of(pid)?;
    drop(client);
    lab.down().context("taking the lab down")?;

    let add = Measurement::of_durations(0, Datapath::Ebpf, "agent_add", &adds);
    let del = Measurement::of_durations(0, Datapath::Ebpf, "agent_del", &dels);
    let kept = Measurement::of_durations(0, Datapath::Ebpf, "agent_restart_kept", &kept);
    let verified =
        Measurement::of_durations(0, Datapath::Ebpf, "agent_restart_verified", &verified);
    let per_pod =
        |a: Usage, b: Usage| b.cpu.saturating_sub(a.cpu).as_secs_f64() * 1e3 / pods as f64;
    Ok(Measurement::new(0, Datapath::Ebpf, "agent_footprint")
        .with("pods", pods as f64)
        .with("rss_mib_before", before.rss_mib)
        .with("rss_mib", loaded.rss_mib)
        .with("rss_mib_after", after.rss_mib)
        .with("add_cpu_ms_per_pod", per_pod(before, loaded))
        .with("del_cpu_ms_per_pod", per_pod(before_dels, after))
        .with(
            "idle_cpu_percent",
            idle.cpu.saturating_sub(loaded.cpu).as_secs_f64() / IDLE_WINDOW.as_secs_f64() * 100.0,
        )
        .with("add_p50_ms", add.value("p50_ms").unwrap_or_default())
        .with("add_p99_ms", add.value("p99_ms").unwrap_or_default())
        .with("del_p50_ms", del.value("p50_ms").unwrap_or_default())
        .with("del_p99_ms", del.value("p99_ms").unwrap_or_default())
        .with(
            "restart_kept_p50_ms",
            kept.value("p50_ms").unwrap_or_default(),
        )
        .with(
            "restart_kept_p99_ms",
            kept.value("p99_ms").unwrap_or_default(),
        )
        .with(
            "restart_verified_p50_ms",
            verified.value("p50_ms").unwrap_or_default(),
        )
        .with(
            "restart_verified_p99_ms",
            verified.value("p99_ms").unwrap_or_default(),
        ))
}

/// How long each of `count` calls of `call` (given its index) took.
fn timed<T>(count: usize, mut call: impl FnMut(usize) -> Result<T>) -> Result<Vec<Duration>> {
    (0..count)
        .map(|index| {
            let started = Instant::now();
            call(index)?;
            Ok(started.elapsed())
        })
        .collect()
}

/// Restarts of the agent with all its pods, start to READY: as a rolling
/// update with the same eBPF object does (the programs running are kept),
/// and with the pinned programs removed first, as an upgrade whose
/// programs changed must load its own (through the verifier).
fn restarts(lab: &mut Lab) -> Result<(Vec<Duration>, Vec<Duration>)> {
    let mut kept = Vec::with_capacity(RESTARTS);
    let mut verified = Vec::with_capacity(RESTARTS);
    let programs = Path::new(PIN_DIR).join(LINKS_DIR).join(PROGRAMS_DIR);
    for _ in 0..RESTARTS {
        for (times, verify) in [(&mut kept, false), (&mut verified, true)] {
            lab.stop_agent().context("stopping the agent")?;
            if verify {
                fs::remove_dir_all(&programs)
                    .with_context(|| format!("removing {}", programs.display()))?;
            }
            let started = Instant::now();
            lab.start_agent().context("restarting the agent")?;
            times.push(started.elapsed());
        }
    }
    Ok((kept, verified))
}
