//! Network policy's control plane, on EKS's path: the time from a `kubectl
//! apply` of a NetworkPolicy to its rules in the node's maps (the lab's
//! network policy controller writes PolicyEndpoints, the agent reads them
//! and writes the datapath) with [`CLUSTER_PODS`] pods in the cluster that
//! the policies select peers among; then CNI ADDs with policy on and
//! policies in force.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde_json::json;
use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_common::addr_to_raw;
use vpcnet_lab::{Datapath, Lab, NamedPod, addrs, cluster, kube::KubeAdmin};

use crate::{
    cni_latency::cycles,
    labs::{ipam_lab_options, lab_up},
    measurement::Measurement,
    options::BenchOptions,
};

/// Pods of the cluster on other nodes, peers of the applied policies.
pub const CLUSTER_PODS: usize = 1000;
/// Groups the cluster's pods are labelled into (`group=g<N>`): each
/// applied policy allows one group.
const GROUPS: usize = 10;
/// Their namespace.
const NAMESPACE: &str = "bench";
/// How long one policy may take to reach the maps.
const ENFORCE_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the maps are read meanwhile (they have no events).
const POLL: Duration = Duration::from_millis(1);

/// The pod the policies select.
const SELECTED: &str = "x/server";

/// Makes the cluster's pods: on another node, running, with an address of
/// the fillers' range (no traffic goes there).
fn cluster_pods(admin: &KubeAdmin) -> Result<()> {
    cluster::ensure_namespace(admin, NAMESPACE)?;
    for index in 0..CLUSTER_PODS {
        let addr = addrs::filler_pod_addr(index).context("a filler address")?;
        let name = format!("peer-{index}");
        admin
            .create(
                &format!("/api/v1/namespaces/{NAMESPACE}/pods"),
                &json!({
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": NAMESPACE,
                                 "labels": {"group": format!("g{}", index % GROUPS)}},
                    "spec": {"nodeName": "elsewhere",
                             "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]},
                    "status": {"phase": "Running", "hostIP": "10.20.11.99",
                               "podIP": addr.to_string(), "podIPs": [{"ip": addr.to_string()}]},
                }),
            )
            .with_context(|| format!("creating Pod {NAMESPACE}/{name}"))?;
    }
    Ok(())
}

/// Policy `index`: the selected pod takes TCP `9000 + index` from group
/// `index % GROUPS`.
fn policy(index: usize) -> String {
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": format!("p-{index}"), "namespace": "x"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "server"}},
            "ingress": [{
                "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                          "podSelector": {"matchLabels": {"group": format!("g{}", index % GROUPS)}}}],
                "ports": [{"port": 9000 + index}]
            }]
        }
    })
    .to_string()
}

/// The selected pod's policy entry: its identities.
fn identities(maps: &DatapathMaps, addr: Ipv4Addr) -> Option<(u32, u32)> {
    maps.policy_pods
        .get(&addr_to_raw(addr.octets()), 0)
        .ok()
        .map(|p| (p.ingress, p.egress))
}

/// Waits until the selected pod's entry is no longer `before`; how long
/// it took.
fn wait_changed(
    maps: &DatapathMaps,
    addr: Ipv4Addr,
    before: Option<(u32, u32)>,
    started: Instant,
) -> Result<Duration> {
    loop {
        if identities(maps, addr) != before {
            return Ok(started.elapsed());
        }
        if started.elapsed() > ENFORCE_TIMEOUT {
            bail!("a policy not in the maps after {ENFORCE_TIMEOUT:?}");
        }
        std::thread::sleep(POLL);
    }
}

/// `kubectl apply` to the maps, `applies` times (each policy deleted
/// after, and its removal awaited); then CNI ADDs with the policies in
/// force.
pub fn run(opts: &BenchOptions, round: usize) -> Result<Vec<Measurement>> {
    let warm = opts.cni_pods.to_string();
    let env = [("WARM_IP_TARGET", warm.as_str())];
    let mut options = ipam_lab_options(opts, "m5.2xlarge", &env, true);
    if let Some(ipam) = &mut options.ipam {
        ipam.kube_api = true;
        ipam.enforce_network_policy("standard", "policy-endpoints");
    }
    options.named_pods = vec![
        format!("{SELECTED}:app=server")
            .parse::<NamedPod>()
            .context("the selected pod")?,
    ];
    let lab: Lab = lab_up(&options)?;
    let admin = lab.kube_admin()?;
    let files = lab
        .kube_api()
        .context("the lab's API server")?
        .files()
        .clone();
    cluster_pods(&admin)?;
    let server = lab.pod_named(SELECTED)?.addr;
    let maps = DatapathMaps::open_pinned(std::path::Path::new(addrs::BPF_PIN_DIR))
        .context("opening the agent's maps")?;
    let mut applied = Vec::new();
    for index in 0..opts.policy_applies {
        let before = identities(&maps, server);
        let started = Instant::now();
        cluster::kubectl(&files, &["apply", "-f", "-"], Some(&policy(index)))?;
        applied.push(wait_changed(&maps, server, before, started)?);
        // Back to no policy before the next, so each apply is the first.
        let during = identities(&maps, server);
        let name = format!("p-{index}");
        cluster::kubectl(&files, &["delete", "networkpolicy", "-n", "x", &name], None)?;
        wait_changed(&maps, server, during, Instant::now())?;
    }
    // Policies in force while pods come and go.
    for index in 0..GROUPS {
        cluster::kubectl(&files, &["apply", "-f", "-"], Some(&policy(index)))?;
    }
    for index in 0..opts.cni_pods {
        cluster::bind_pod(&admin, &addrs::pod_name(index))?;
    }
    let adds = cycles(&lab, opts.cni_pods, opts.cni_cycles)?.adds;
    lab.down().context("taking the lab down")?;
    Ok(vec![
        Measurement::of_durations(round, Datapath::Ebpf, "policy/apply_to_maps", &applied)
            .with("cluster_pods", CLUSTER_PODS as f64),
        Measurement::of_durations(round, Datapath::Ebpf, "policy/cni_add", &adds),
    ])
}
