//! The whole node for tests: pods made by containerd's CRI, wired by the
//! real plugin, addressed and put into the datapath by the real agent,
//! whose ENIs come from the EC2 emulator.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_api::{
    cni::{IpamStatusReply, IpamStatusRequest},
    pod::BRANCH_LINK_PREFIX,
};
use vpcnet_common::{
    endpoint::ENI_BRANCH,
    maps::{LINKS_DIR, PIN_DIR},
};
use vpcnet_lab::{
    CriLabOptions, EnforcingMode, IpamLabOptions, Lab, LabOptions, NamedPod,
    addrs::{NS_NODE, STRICT_BRANCH_VETH_PREFIX},
    cni_socket_file, cri,
    cri::CriClient,
    exec_ok,
};

use crate::{agent_binary, cni_plugin_binary, ipam::FAST_AGENT_ARGS};

/// Released addresses rest two seconds; sweeps run every 200 ms.
pub const CRI_ENV: &[(&str, &str)] = &[("IP_COOLDOWN_PERIOD", "2")];
pub const CRI_AGENT_ARGS: &[&str] = &["--pod-sweep-interval", "0.2", "--orphan-grace", "5"];

/// Brings up a lab of `pods` pods made through CRI on an `instance_type`.
pub fn up(pods: usize, instance_type: &str) -> Lab {
    up_with_env(pods, instance_type, &[])
}

/// [`up`], the agent with more of the VPC CNI's variables.
pub fn up_with_env(pods: usize, instance_type: &str, env: &[(&str, &str)]) -> Lab {
    up_with(&CriNode {
        env,
        ..CriNode::new(pods, instance_type)
    })
}

/// What a CRI lab's node runs.
pub struct CriNode<'a> {
    pub pods: usize,
    pub instance_type: &'a str,
    /// More of the VPC CNI's variables.
    pub env: &'a [(&'a str, &'a str)],
    /// The agent's and the plugin's binaries.
    pub agent: PathBuf,
    pub cni_plugin: PathBuf,
    /// More arguments of `vpcnet-agent run`.
    pub agent_args: &'a [&'a str],
    /// The lab's Kubernetes API server (and its VPC resource controller):
    /// the agent runs in-cluster and its pods are Pod objects.
    pub kube_api: bool,
    /// With `kube_api`: the resource controller waits for the test.
    pub resource_controller_held: bool,
    /// `POD_SECURITY_GROUP_ENFORCING_MODE`, for the agent and the conflist.
    pub sg_enforcing_mode: EnforcingMode,
    /// Pods by namespace, name and labels, after the numbered ones (with
    /// `kube_api`).
    pub named_pods: &'a [NamedPod],
    /// With `kube_api`: custom resources (by plural) the cluster has not
    /// installed.
    pub uninstalled_crds: &'a [&'a str],
    /// With `kube_api`: the agent as the DaemonSet's pod from this image
    /// (its command is the DaemonSet's: `agent_args` do not apply).
    pub agent_image: Option<vpcnet_lab::AgentImage>,
}

impl CriNode<'_> {
    /// The workspace's binaries, the lab's defaults.
    pub fn new(pods: usize, instance_type: &str) -> CriNode<'_> {
        CriNode {
            pods,
            instance_type,
            env: &[],
            agent: agent_binary(),
            cni_plugin: cni_plugin_binary(),
            agent_args: &[],
            kube_api: false,
            resource_controller_held: false,
            sg_enforcing_mode: EnforcingMode::Strict,
            named_pods: &[],
            uninstalled_crds: &[],
            agent_image: None,
        }
    }
}

/// Brings up a CRI lab as `node` says.
pub fn up_with(node: &CriNode<'_>) -> Lab {
    let mut ipam = IpamLabOptions::new(node.instance_type);
    ipam.env = CRI_ENV
        .iter()
        .chain(node.env)
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    ipam.agent_args = FAST_AGENT_ARGS
        .iter()
        .chain(CRI_AGENT_ARGS)
        .chain(node.agent_args)
        .map(|a| (*a).to_owned())
        .collect();
    ipam.cri = Some(CriLabOptions {
        cni_plugin: node.cni_plugin.clone(),
    });
    ipam.kube_api = node.kube_api;
    ipam.resource_controller_held = node.resource_controller_held;
    ipam.uninstalled_crds = node
        .uninstalled_crds
        .iter()
        .map(|plural| (*plural).to_owned())
        .collect();
    let opts = LabOptions {
        ipam: Some(ipam),
        sg_enforcing_mode: node.sg_enforcing_mode,
        named_pods: node.named_pods.to_vec(),
        agent_image: node.agent_image.clone(),
        ..LabOptions::ebpf(node.pods, node.agent.clone())
    };
    Lab::up(&opts).unwrap_or_else(|e| panic!("bringing up the CRI lab: {e}"))
}

/// The agent's pool, through its CNI backend.
pub fn ipam_status() -> IpamStatusReply {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let mut client = vpcnet_api::connect_cni(cni_socket_file())
            .await
            .expect("connecting to the agent");
        client
            .ipam_status(IpamStatusRequest {})
            .await
            .expect("IpamStatus")
            .into_inner()
    })
}

/// Polls `done` on the agent's pool (bounded): the pool has no events.
pub fn wait_ipam(
    what: &str,
    timeout: Duration,
    done: impl Fn(&IpamStatusReply) -> bool,
) -> IpamStatusReply {
    let deadline = Instant::now() + timeout;
    loop {
        let status = ipam_status();
        if done(&status) {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}; last {status:?}\nagent log (tail):\n{}",
            crate::ipam::agent_log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What a node holds for its pods, as an operator would look: host veths,
/// endpoint entries, pinned pod links, pod namespaces, CNI result caches.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct NodeTraces {
    pub host_veths: BTreeSet<String>,
    pub endpoints: BTreeSet<Ipv4Addr>,
    /// Branch ENIs' links (`vlan.eth.<id>`) and their datapath entries.
    pub branch_links: BTreeSet<String>,
    pub branch_entries: BTreeSet<u32>,
    pub pod_link_pins: BTreeSet<String>,
    pub pod_netns: BTreeSet<String>,
    pub cni_results: BTreeSet<String>,
}

impl NodeTraces {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// Reads [`NodeTraces`] now.
pub fn node_traces() -> NodeTraces {
    let links = exec_ok(NS_NODE, &["ip", "-o", "link", "show", "type", "veth"])
        .expect("listing the node's veths");
    let host_veths = link_names(&links)
        .into_iter()
        .filter(|name| is_pod_veth(name))
        .collect();
    let all_links =
        exec_ok(NS_NODE, &["ip", "-o", "link", "show"]).expect("listing the node's links");
    let branch_links = link_names(&all_links)
        .into_iter()
        .filter(|name| name.starts_with(BRANCH_LINK_PREFIX))
        .collect();
    let maps = DatapathMaps::open_pinned(Path::new(PIN_DIR)).expect("opening the pinned maps");
    let endpoints = maps
        .endpoints()
        .expect("reading the endpoint map")
        .into_iter()
        .map(|(addr, _)| addr)
        .collect();
    let branch_entries = maps
        .enis()
        .expect("reading the ENI map")
        .into_iter()
        .filter(|(_, eni)| eni.flags & ENI_BRANCH != 0)
        .map(|(ifindex, _)| ifindex)
        .collect();
    let list = |dir: &Path, keep: &dyn Fn(&str) -> bool| -> BTreeSet<String> {
        std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| keep(name))
            .collect()
    };
    NodeTraces {
        host_veths,
        endpoints,
        branch_links,
        branch_entries,
        // ENIs keep theirs; pod veths' (eni<hash>, vlan<hash>) and branch
        // links' must go.
        pod_link_pins: list(&Path::new(PIN_DIR).join(LINKS_DIR), &|name| {
            name.split_once('-').is_some_and(|(_, iface)| {
                is_pod_veth(iface) || iface.starts_with(BRANCH_LINK_PREFIX)
            })
        }),
        pod_netns: list(
            &Path::new(cri::CONTAINERD_STATE_DIR).join("io.containerd.grpc.v1.cri/netns"),
            &|_| true,
        ),
        cni_results: list(Path::new("/var/lib/cni/results"), &|name| {
            name.starts_with("aws-cni-")
        }),
    }
}

/// The link names of `ip -o link show` output (`@peer` cut).
fn link_names(output: &str) -> Vec<String> {
    output
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .collect()
}

/// A pod's host veth: `eni<hash>`, or `vlan<hash>` (a strict branch pod),
/// not a branch link.
fn is_pod_veth(name: &str) -> bool {
    name.starts_with(vpcnet_api::pod::DEFAULT_VETH_PREFIX)
        || (name.starts_with(STRICT_BRANCH_VETH_PREFIX) && !name.starts_with(BRANCH_LINK_PREFIX))
}

/// Every sandbox of the runtime, stopped and removed (kubelet's way).
pub fn remove_all_pods(client: &CriClient) {
    for sandbox in client.list_pod_sandboxes().expect("ListPodSandbox") {
        vpcnet_lab::cri_pods::remove_pod(client, &sandbox.id)
            .unwrap_or_else(|e| panic!("removing sandbox {}: {e}", sandbox.id));
    }
}
