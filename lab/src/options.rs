//! What `lab up` is asked to build.

use std::{
    collections::BTreeMap, fmt, net::SocketAddrV4, path::PathBuf, str::FromStr, time::Duration,
};

use ipnet::Ipv4Net;
use serde::{Deserialize, Serialize};
use vpcnet_api::iptables::IptablesBackend;
pub use vpcnet_api::layout::EnforcingMode;

use crate::{
    addrs::{MAX_BRANCH_PODS, MAX_ENIS, MAX_FILLER_PODS, MAX_PODS},
    error::{LabError, Result},
};

/// Which datapath the node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Datapath {
    /// This project: the agent loads the eBPF programs.
    #[default]
    Ebpf,
    /// The VPC CNI's own iptables and policy-routing wiring: the reference.
    Iptables,
    /// The benchmarks' ceiling: pods routed with no NAT, no rules and no
    /// programs (a /32 route per pod, as in the eBPF datapath). The internet
    /// gateway passes the pods' own addresses, as if each had a public IP,
    /// so flows to `inet` work un-NATed. Pods on secondary ENIs reach only
    /// the node and its pods (nothing steers them to their ENI).
    Routed,
}

impl fmt::Display for Datapath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
            Self::Routed => "routed",
        })
    }
}

impl FromStr for Datapath {
    type Err = LabError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "ebpf" => Ok(Self::Ebpf),
            "iptables" => Ok(Self::Iptables),
            "routed" => Ok(Self::Routed),
            other => Err(LabError::InvalidOption(format!(
                "datapath {other:?}: expected ebpf, iptables or routed"
            ))),
        }
    }
}

/// How SNAT picks source ports (`AWS_VPC_K8S_CNI_RANDOMIZESNAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum RandomizeSnat {
    /// `prng`: `--random-fully`, the VPC CNI's default.
    #[default]
    #[serde(rename = "prng")]
    Prng,
    /// `hashrandom`: `--random`.
    #[serde(rename = "hashrandom")]
    HashRandom,
    /// `none`: no flag, sequential ports.
    #[serde(rename = "none")]
    Sequential,
}

impl RandomizeSnat {
    /// The value of `AWS_VPC_K8S_CNI_RANDOMIZESNAT`.
    pub fn env_value(self) -> &'static str {
        match self {
            Self::Prng => "prng",
            Self::HashRandom => "hashrandom",
            Self::Sequential => "none",
        }
    }
}

impl fmt::Display for RandomizeSnat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.env_value())
    }
}

impl FromStr for RandomizeSnat {
    type Err = LabError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prng" => Ok(Self::Prng),
            "hashrandom" => Ok(Self::HashRandom),
            "none" => Ok(Self::Sequential),
            other => Err(LabError::InvalidOption(format!(
                "randomize-snat {other:?}: expected prng, hashrandom or none"
            ))),
        }
    }
}

/// Parses a comma-separated CIDR list (`AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`
/// syntax; spaces around items are allowed, empty items are not).
pub fn parse_cidr_list(list: &str) -> Result<Vec<Ipv4Net>> {
    if list.trim().is_empty() {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(|item| {
            let item = item.trim();
            item.parse::<Ipv4Net>()
                .map(|net| net.trunc())
                .map_err(|err| LabError::InvalidOption(format!("CIDR {item:?} in {list:?}: {err}")))
        })
        .collect()
}

/// Parses a `POD_SECURITY_GROUP_ENFORCING_MODE` value.
pub fn parse_enforcing_mode(value: &str) -> Result<EnforcingMode> {
    match value {
        "strict" => Ok(EnforcingMode::Strict),
        "standard" => Ok(EnforcingMode::Standard),
        other => Err(LabError::InvalidOption(format!(
            "security group enforcing mode {other:?}: expected strict or standard"
        ))),
    }
}

/// Parses a comma-separated list of pod indices (`--branch-pods 1,3`).
pub fn parse_index_list(list: &str) -> Result<Vec<usize>> {
    if list.trim().is_empty() {
        return Ok(Vec::new());
    }
    list.split(',')
        .map(|item| {
            let item = item.trim();
            item.parse::<usize>().map_err(|err| {
                LabError::InvalidOption(format!("pod index {item:?} in {list:?}: {err}"))
            })
        })
        .collect()
}

/// A `NodePort` service in front of one pod: connections to the node's
/// addresses on [`crate::addrs::NODE_PORT`] (TCP and UDP) are DNATed by
/// kube-proxy's rules to the pod, with `externalTrafficPolicy: Local` (no
/// masquerade: the pod sees the client's address).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodePortService {
    /// The backend pod's index.
    pub pod: usize,
    /// The port the pod listens on.
    pub target_port: u16,
}

/// Where a cluster IP service sends its connections.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ServiceBackend {
    /// A pod of the lab's node (by index), on this port.
    Pod { pod: usize, port: u16 },
    /// An address off the node (`peer`, say).
    Remote(SocketAddrV4),
}

/// A `ClusterIP` service of one endpoint, TCP and UDP on the same port,
/// written by kube-proxy's rules in both datapaths.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterIpService {
    /// The Service's name (in namespace `default`).
    pub name: String,
    /// Its cluster IP (in the service CIDR) and port.
    pub addr: SocketAddrV4,
    pub backend: ServiceBackend,
}

/// A pod by Kubernetes namespace and name, with labels: `NS/NAME` or
/// `NS/NAME:KEY=VALUE,...` (`--pod`, `lab pod add`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NamedPod {
    pub namespace: String,
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// It asks for `vpc.amazonaws.com/pod-eni` (security groups for pods):
    /// the lab's resource controller gives it a branch ENI, and the node
    /// wires it there (`--branch-eni-pod`, `lab pod add --branch-eni`).
    #[serde(default)]
    pub branch_eni: bool,
}

impl NamedPod {
    /// `NS/NAME`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// Whether `name` is a DNS-1123 label (what namespaces and, here, pod
/// names must be).
fn is_dns_label(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Splits `NS/NAME` into its parts.
pub fn parse_pod_key(text: &str) -> Result<(String, String)> {
    let (namespace, name) = text
        .split_once('/')
        .ok_or_else(|| LabError::InvalidOption(format!("pod {text:?}: expected NAMESPACE/NAME")))?;
    for part in [namespace, name] {
        if !is_dns_label(part) {
            return Err(LabError::InvalidOption(format!(
                "pod {text:?}: {part:?} is not a lowercase DNS label"
            )));
        }
    }
    Ok((namespace.to_owned(), name.to_owned()))
}

/// Label changes as kubectl spells them: `K=V` sets, `K-` removes;
/// comma-separated.
pub fn parse_label_changes(text: &str) -> Result<Vec<(String, Option<String>)>> {
    text.split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .map(|item| {
            let change = match item.split_once('=') {
                Some((key, value)) => (key.to_owned(), Some(value.to_owned())),
                None => match item.strip_suffix('-') {
                    Some(key) => (key.to_owned(), None),
                    None => {
                        return Err(LabError::InvalidOption(format!(
                            "label {item:?}: expected KEY=VALUE or KEY-"
                        )));
                    }
                },
            };
            let valid_value = change.1.as_deref().is_none_or(|v| {
                v.len() <= 63
                    && v.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
            });
            if change.0.is_empty() || change.0.contains(char::is_whitespace) || !valid_value {
                return Err(LabError::InvalidOption(format!(
                    "label {item:?} is not valid"
                )));
            }
            Ok(change)
        })
        .collect()
}

impl FromStr for NamedPod {
    type Err = LabError;

    fn from_str(s: &str) -> Result<Self> {
        let (key, labels) = s.split_once(':').unwrap_or((s, ""));
        let (namespace, name) = parse_pod_key(key)?;
        let mut set = BTreeMap::new();
        for (label, value) in parse_label_changes(labels)? {
            let value = value.ok_or_else(|| {
                LabError::InvalidOption(format!("pod {s:?}: a new pod's labels are KEY=VALUE"))
            })?;
            set.insert(label, value);
        }
        Ok(Self {
            namespace,
            name,
            labels: set,
            branch_eni: false,
        })
    }
}

/// What the lab is built with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LabOptions {
    /// How many pods: `vpcnet-pod-0` ... `vpcnet-pod-<pods-1>`.
    pub pods: usize,
    /// The node's datapath.
    pub datapath: Datapath,
    /// `AWS_VPC_K8S_CNI_EXTERNALSNAT`: no SNAT on the node.
    pub external_snat: bool,
    /// `AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS`.
    pub exclude_snat_cidrs: Vec<Ipv4Net>,
    /// `AWS_VPC_K8S_CNI_RANDOMIZESNAT`.
    pub randomize_snat: RandomizeSnat,
    /// The agent binary (ebpf datapath only; required there).
    pub agent_bin: Option<PathBuf>,
    /// How long the agent may take to print `READY`.
    #[serde(with = "duration_secs")]
    pub agent_ready_timeout: Duration,
    /// How many ENIs the node has (1 to [`MAX_ENIS`]): `eth0`, then `eth1`,
    /// `eth2`. Pods are spread round-robin: pod i is on ENI i % enis (its
    /// address is a secondary IP of that ENI), branch-ENI pods excepted.
    #[serde(default = "one")]
    pub enis: usize,
    /// The pods (by index) that get a branch ENI of their own (security
    /// groups for pods; `vlan.eth.<id>` links).
    #[serde(default)]
    pub branch_pods: Vec<usize>,
    /// `POD_SECURITY_GROUP_ENFORCING_MODE`: node-wide, as in the VPC CNI
    /// (whose default is strict). Matters only with branch pods.
    #[serde(default = "strict")]
    pub sg_enforcing_mode: EnforcingMode,
    /// A NodePort-style service in front of one pod, installed in both
    /// datapaths (kube-proxy runs in both).
    #[serde(default)]
    pub node_port: Option<NodePortService>,
    /// Cluster IP services, installed in both datapaths.
    #[serde(default)]
    pub cluster_ips: Vec<ClusterIpService>,
    /// Scale: this many pods' worth of policy routing entries, installed
    /// before the lab's own pods so that theirs sit last. In the iptables
    /// datapath each filler pod has rules 512 and 1536 (as a pod on `eth1`
    /// has) for an address of [`crate::addrs::filler_pod_addr`] that carries
    /// no traffic. (The eBPF datapath's map entries are the agent's side.)
    #[serde(default)]
    pub filler_pods: usize,
    /// The address manager at work: the agent runs with `--ipam` against
    /// the lab's EC2 emulator and serves the CNI backend; no static layout
    /// (so no pods and one ENI: the agent attaches the others).
    #[serde(default)]
    pub ipam: Option<IpamLabOptions>,
    /// More environment for the agent (`VPCNET_TC_ATTACH=clsact`, ...),
    /// beyond what passes through from the lab's own.
    #[serde(default)]
    pub agent_env: Vec<(String, String)>,
    /// Pods by namespace, name and labels, after the [`Self::pods`]
    /// numbered ones (pods through CRI, with the API server).
    #[serde(default)]
    pub named_pods: Vec<NamedPod>,
    /// The backend the node's kubelet, kube-proxy and aws-node write
    /// their iptables rules with (kubelet's chains in it tell the agent).
    #[serde(default)]
    pub iptables_backend: IptablesBackend,
    /// The agent as the DaemonSet's pod, from an image archive (`cargo
    /// xtask image`), run through the node's containerd by the lab's
    /// kubelet ([`crate::agent_pod`]) instead of `agent_bin` on the node;
    /// pods through CRI and the API server only.
    #[serde(default)]
    pub agent_image: Option<AgentImage>,
}

/// An image of the agent and the manifests that run it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentImage {
    /// The OCI archive (`cargo xtask image`).
    pub archive: PathBuf,
    /// Which of `deploy/`'s renderings the DaemonSet objects come from.
    pub manifests: Manifests,
    /// The commit whose `deploy/` renders them (an earlier commit's image
    /// runs as that commit deployed it); `None`: the working tree's.
    pub deploy_commit: Option<String>,
}

impl AgentImage {
    /// `archive`, deployed as the working tree's kustomization says.
    #[must_use]
    pub fn new(archive: PathBuf) -> Self {
        Self {
            archive,
            manifests: Manifests::Kustomize,
            deploy_commit: None,
        }
    }
}

/// How an operator renders `deploy/`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Manifests {
    /// `kubectl kustomize deploy/kubernetes` (and `.../rollback`).
    #[default]
    Kustomize,
    /// `helm template vpcnet deploy/helm/vpcnet --set rollback.enabled=true`.
    Helm,
}

impl fmt::Display for Manifests {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Kustomize => "kustomize",
            Self::Helm => "helm",
        })
    }
}

impl FromStr for Manifests {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s {
            "kustomize" => Ok(Self::Kustomize),
            "helm" => Ok(Self::Helm),
            other => Err(format!("{other}: kustomize or helm")),
        }
    }
}

/// The agent's address manager in the lab.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpamLabOptions {
    /// The node's instance type in the emulator (its ENI and address limits).
    pub instance_type: String,
    /// The VPC CNI's variables for the agent (`WARM_ENI_TARGET`, ...).
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// More `vpcnet-agent run` arguments (shorter intervals in tests).
    #[serde(default)]
    pub agent_args: Vec<String>,
    /// Pods through a container runtime: containerd's CRI in the node runs
    /// the plugin binary for every pod ([`LabOptions::pods`] of them),
    /// as kubelet makes it do on EKS.
    #[serde(default)]
    pub cri: Option<CriLabOptions>,
    /// A Kubernetes API server for the cluster ([`crate::kube`], with the
    /// objects [`crate::cluster`] makes): the agent runs in-cluster.
    #[serde(default)]
    pub kube_api: bool,
    /// With [`Self::kube_api`]: the VPC resource controller is not started
    /// with the lab (a cluster whose controller is late); a test starts it
    /// with [`crate::Lab::start_resource_controller`].
    #[serde(default)]
    pub resource_controller_held: bool,
    /// With [`Self::kube_api`]: custom resources (by plural) the cluster
    /// has not installed, e.g. `policyendpoints` for one without EKS's
    /// network policy controller.
    #[serde(default)]
    pub uninstalled_crds: Vec<String>,
}

impl IpamLabOptions {
    /// Network policy on the node, as an operator sets aws-node's
    /// variables: `mode` `standard` or `strict`, read from `source`
    /// (`policy-endpoints`, or `network-policies`: the agent resolves
    /// NetworkPolicy, and the cluster serves no PolicyEndpoint CRD, as one
    /// without EKS's controller).
    pub fn enforce_network_policy(&mut self, mode: &str, source: &str) {
        self.env.extend(
            [
                ("ENABLE_NETWORK_POLICY", "true"),
                ("NETWORK_POLICY_ENFORCING_MODE", mode),
                ("VPCNET_NETWORK_POLICY_SOURCE", source),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned())),
        );
        if source == "network-policies" {
            self.uninstalled_crds = vec![vpcnet_api::policy_endpoint::PLURAL.to_owned()];
        }
    }
}

/// The container runtime of a lab whose pods are made through CRI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CriLabOptions {
    /// The `vpcnet-cni` binary.
    pub cni_plugin: PathBuf,
}

impl LabOptions {
    /// Whether the lab has a Kubernetes API server.
    pub fn kube_api(&self) -> bool {
        self.ipam.as_ref().is_some_and(|ipam| ipam.kube_api)
    }
}

impl IpamLabOptions {
    /// `instance_type` with the VPC CNI's defaults.
    pub fn new(instance_type: &str) -> Self {
        Self {
            instance_type: instance_type.to_owned(),
            env: Vec::new(),
            agent_args: Vec::new(),
            cri: None,
            kube_api: false,
            resource_controller_held: false,
            uninstalled_crds: Vec::new(),
        }
    }
}

fn one() -> usize {
    1
}

fn strict() -> EnforcingMode {
    EnforcingMode::Strict
}

impl Default for LabOptions {
    fn default() -> Self {
        Self {
            pods: 2,
            datapath: Datapath::default(),
            external_snat: false,
            exclude_snat_cidrs: Vec::new(),
            randomize_snat: RandomizeSnat::default(),
            agent_bin: None,
            // An agent is ready within a second or two here; the VMs set
            // more (see the variable).
            agent_ready_timeout: Duration::from_secs(crate::test_sizes::size_or(
                crate::test_sizes::AGENT_READY_SECS_VAR,
                90,
            )),
            enis: 1,
            branch_pods: Vec::new(),
            sg_enforcing_mode: EnforcingMode::Strict,
            node_port: None,
            cluster_ips: Vec::new(),
            filler_pods: 0,
            ipam: None,
            agent_env: Vec::new(),
            named_pods: Vec::new(),
            iptables_backend: IptablesBackend::default(),
            agent_image: None,
        }
    }
}

impl LabOptions {
    /// The iptables reference datapath with `pods` pods and the VPC CNI's
    /// defaults otherwise.
    pub fn iptables(pods: usize) -> Self {
        Self {
            pods,
            datapath: Datapath::Iptables,
            ..Self::default()
        }
    }

    /// The eBPF datapath with `pods` pods, running `agent_bin`.
    pub fn ebpf(pods: usize, agent_bin: impl Into<PathBuf>) -> Self {
        Self {
            pods,
            datapath: Datapath::Ebpf,
            agent_bin: Some(agent_bin.into()),
            ..Self::default()
        }
    }

    /// The container runtime's options, when pods come through CRI.
    pub fn cri(&self) -> Option<&CriLabOptions> {
        self.ipam.as_ref().and_then(|ipam| ipam.cri.as_ref())
    }

    /// Checks everything that can be checked before anything is built.
    pub fn validate(&self) -> Result<()> {
        self.validate_settings()?;
        if let Some(ipam) = &self.ipam {
            let static_pods = if ipam.cri.is_some() { 0 } else { self.pods };
            // With the iptables datapath: a node aws-node ran, its static
            // pods' addresses on the primary ENI, for the agent to take over.
            let aws_node = self.datapath == Datapath::Iptables && ipam.cri.is_none();
            if (!aws_node && (self.datapath != Datapath::Ebpf || static_pods != 0))
                || self.enis != 1
                || (!aws_node && !self.branch_pods.is_empty())
                || self.node_port.is_some()
            {
                return Err(LabError::InvalidOption(
                    "the address manager runs with one ENI, and the ebpf datapath with pods through CRI, or the iptables datapath (aws-node's node) with static pods (branch pods among them)"
                        .into(),
                ));
            }
            if let Some(cri) = &ipam.cri
                && !cri.cni_plugin.is_file()
            {
                return Err(LabError::InvalidOption(format!(
                    "the CNI plugin {} does not exist (build it with `cargo build -p vpcnet-cni`)",
                    cri.cni_plugin.display()
                )));
            }
        }
        self.validate_named_pods()?;
        if let Some(image) = &self.agent_image {
            if !self.kube_api() || (self.datapath == Datapath::Ebpf && self.cri().is_none()) {
                return Err(LabError::InvalidOption(
                    "the agent's image runs as the DaemonSet's pod: with the API server, and pods through CRI (or aws-node's pods, for the iptables datapath)".into(),
                ));
            }
            if !image.archive.is_file() {
                return Err(LabError::InvalidOption(format!(
                    "the agent's image {} does not exist (build it with `cargo xtask image`)",
                    image.archive.display()
                )));
            }
        } else if self.datapath == Datapath::Ebpf {
            let Some(agent) = &self.agent_bin else {
                return Err(LabError::InvalidOption(
                    "the ebpf datapath needs the agent binary (agent_bin)".into(),
                ));
            };
            if !agent.is_file() {
                return Err(LabError::InvalidOption(format!(
                    "the agent binary {} does not exist (build it with `cargo build -p vpcnet-agent`)",
                    agent.display()
                )));
            }
        }
        Ok(())
    }

    /// Checks everything but the agent binary (which may not be built yet).
    pub fn validate_settings(&self) -> Result<()> {
        if self.pods > MAX_PODS {
            return Err(LabError::TooManyPods {
                requested: self.pods,
                max: MAX_PODS,
            });
        }
        if self.agent_ready_timeout.is_zero() {
            return Err(LabError::InvalidOption(
                "agent_ready_timeout must not be zero".into(),
            ));
        }
        if !(1..=MAX_ENIS).contains(&self.enis) {
            return Err(LabError::InvalidOption(format!(
                "--enis {}: the node has 1 to {MAX_ENIS} ENIs (eth0 to eth{})",
                self.enis,
                MAX_ENIS - 1
            )));
        }
        self.validate_branch_pods()?;
        if self.datapath == Datapath::Routed
            && (!self.branch_pods.is_empty() || self.filler_pods != 0 || self.external_snat)
        {
            return Err(LabError::InvalidOption(
                "the routed datapath has no policy routing and no NAT: no --branch-pods, --filler-pods or --external-snat"
                    .into(),
            ));
        }
        if self.filler_pods > MAX_FILLER_PODS {
            return Err(LabError::InvalidOption(format!(
                "--filler-pods {}: at most {MAX_FILLER_PODS}",
                self.filler_pods
            )));
        }
        if let Some(service) = &self.node_port
            && service.pod >= self.pods
        {
            return Err(LabError::InvalidOption(format!(
                "--node-port {}: there is no pod {} (pods are 0 to {})",
                service.pod,
                service.pod,
                self.pods.saturating_sub(1)
            )));
        }
        Ok(())
    }

    fn validate_branch_pods(&self) -> Result<()> {
        if self.branch_pods.len() > MAX_BRANCH_PODS {
            return Err(LabError::InvalidOption(format!(
                "--branch-pods: {} branch pods, at most {MAX_BRANCH_PODS}",
                self.branch_pods.len()
            )));
        }
        let mut seen = std::collections::BTreeSet::new();
        for &pod in &self.branch_pods {
            if pod >= self.pods {
                return Err(LabError::InvalidOption(format!(
                    "--branch-pods: there is no pod {pod} (with --pods {} they are 0 to {})",
                    self.pods,
                    self.pods.saturating_sub(1)
                )));
            }
            if !seen.insert(pod) {
                return Err(LabError::InvalidOption(format!(
                    "--branch-pods: pod {pod} is listed twice"
                )));
            }
        }
        Ok(())
    }

    /// Named pods need the runtime and the API server, and unique names
    /// (the numbered pods' `default/pod-N` included).
    fn validate_named_pods(&self) -> Result<()> {
        if self.named_pods.is_empty() {
            return Ok(());
        }
        if self.cri().is_none() || !self.kube_api() {
            return Err(LabError::InvalidOption(
                "--pod: named pods are made through CRI, in a lab with the Kubernetes API server"
                    .into(),
            ));
        }
        let mut seen: std::collections::BTreeSet<String> = (0..self.pods)
            .map(|i| {
                format!(
                    "{}/{}",
                    crate::addrs::POD_K8S_NAMESPACE,
                    crate::addrs::pod_name(i)
                )
            })
            .collect();
        for pod in &self.named_pods {
            if !seen.insert(pod.key()) {
                return Err(LabError::InvalidOption(format!(
                    "--pod {}: that pod exists already",
                    pod.key()
                )));
            }
        }
        if self.pods + self.named_pods.len() > MAX_PODS {
            return Err(LabError::TooManyPods {
                requested: self.pods + self.named_pods.len(),
                max: MAX_PODS,
            });
        }
        Ok(())
    }

    /// Whether the lab's own pods need security groups for pods
    /// (`ENABLE_POD_ENI`): its static branch pods, or named pods asking
    /// for a branch ENI.
    pub fn has_branch_pods(&self) -> bool {
        !self.branch_pods.is_empty() || self.named_pods.iter().any(|pod| pod.branch_eni)
    }

    /// Whether pod `index` has a branch ENI.
    pub fn is_branch_pod(&self, index: usize) -> bool {
        self.branch_pods.contains(&index)
    }

    /// The VLAN id of pod `index`'s branch ENI: branch pods take ids 1, 2...
    /// in pod order.
    pub fn branch_vlan_id(&self, index: usize) -> Option<u16> {
        if !self.is_branch_pod(index) {
            return None;
        }
        let rank = self.branch_pods.iter().filter(|&&p| p < index).count();
        Some(crate::addrs::branch_vlan_id(rank))
    }

    /// The exclusion CIDRs as the VPC CNI's environment variable spells them.
    pub fn exclude_snat_cidrs_env(&self) -> String {
        self.exclude_snat_cidrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

mod duration_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_f64(value.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(deserializer)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_lists_parse_like_the_vpc_cni_env() {
        let cidrs = parse_cidr_list("192.0.2.0/24, 198.51.100.7/24").unwrap();
        assert_eq!(
            cidrs,
            vec![
                "192.0.2.0/24".parse().unwrap(),
                "198.51.100.0/24".parse().unwrap()
            ]
        );
        assert!(parse_cidr_list("").unwrap().is_empty());
        assert!(parse_cidr_list("192.0.2.0/24,,").is_err());
        assert!(parse_cidr_list("not-a-cidr").is_err());
    }

    #[test]
    fn options_round_trip_through_json() {
        let opts = LabOptions {
            exclude_snat_cidrs: vec!["192.0.2.0/24".parse().unwrap()],
            randomize_snat: RandomizeSnat::HashRandom,
            ..LabOptions::iptables(3)
        };
        let json = serde_json::to_string(&opts).unwrap();
        assert!(json.contains("\"hashrandom\""), "{json}");
        assert_eq!(serde_json::from_str::<LabOptions>(&json).unwrap(), opts);
    }

    #[test]
    fn too_many_pods_and_missing_agent_are_refused() {
        assert!(matches!(
            LabOptions::iptables(MAX_PODS + 1).validate(),
            Err(LabError::TooManyPods { .. })
        ));
        assert!(LabOptions::iptables(MAX_PODS).validate().is_ok());
        let ebpf = LabOptions {
            datapath: Datapath::Ebpf,
            ..LabOptions::iptables(1)
        };
        assert!(matches!(ebpf.validate(), Err(LabError::InvalidOption(_))));
    }

    #[test]
    fn enis_branch_pods_and_node_port_are_checked() {
        let ok = LabOptions {
            enis: 3,
            branch_pods: vec![3, 1],
            sg_enforcing_mode: EnforcingMode::Standard,
            node_port: Some(NodePortService {
                pod: 1,
                target_port: 8080,
            }),
            ..LabOptions::iptables(4)
        };
        ok.validate().unwrap();
        assert_eq!(ok.branch_vlan_id(1), Some(1));
        assert_eq!(ok.branch_vlan_id(3), Some(2));
        assert_eq!(ok.branch_vlan_id(2), None);
        let json = serde_json::to_string(&ok).unwrap();
        assert!(json.contains("\"standard\""), "{json}");
        assert_eq!(serde_json::from_str::<LabOptions>(&json).unwrap(), ok);

        for (bad, says) in [
            (
                LabOptions {
                    enis: 0,
                    ..ok.clone()
                },
                "1 to 3 ENIs",
            ),
            (
                LabOptions {
                    enis: 4,
                    ..ok.clone()
                },
                "--enis 4",
            ),
            (
                LabOptions {
                    branch_pods: vec![4],
                    ..ok.clone()
                },
                "no pod 4",
            ),
            (
                LabOptions {
                    branch_pods: vec![1, 1],
                    ..ok.clone()
                },
                "twice",
            ),
            (
                LabOptions {
                    node_port: Some(NodePortService {
                        pod: 9,
                        target_port: 80,
                    }),
                    ..ok.clone()
                },
                "--node-port 9",
            ),
            (
                LabOptions {
                    datapath: Datapath::Routed,
                    filler_pods: 10,
                    ..ok.clone()
                },
                "routed datapath",
            ),
        ] {
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
        assert_eq!(parse_index_list(" 1, 3").unwrap(), vec![1, 3]);
        assert!(parse_index_list("1,x").is_err());
        assert_eq!(
            parse_enforcing_mode("standard").unwrap(),
            EnforcingMode::Standard
        );
        assert!(parse_enforcing_mode("loose").is_err());
    }

    #[test]
    fn named_pods_and_label_changes_parse() {
        let pod: NamedPod = "x/a:app=web,tier=front".parse().unwrap();
        assert_eq!(pod.key(), "x/a");
        assert_eq!(pod.labels["app"], "web");
        assert_eq!(pod.labels["tier"], "front");
        assert!("y/b".parse::<NamedPod>().unwrap().labels.is_empty());
        for bad in ["a", "X/a", "x/a:app", "x/a:app-", "x/", "x/a:k=v v"] {
            assert!(bad.parse::<NamedPod>().is_err(), "{bad}");
        }
        assert_eq!(
            parse_label_changes("app=db, tier-").unwrap(),
            [("app".into(), Some("db".into())), ("tier".into(), None)]
        );
        let opts = LabOptions {
            named_pods: vec![pod.clone()],
            ..LabOptions::iptables(1)
        };
        let err = opts.validate_named_pods().unwrap_err().to_string();
        assert!(err.contains("through CRI"), "{err}");
    }

    #[test]
    fn names_parse() {
        assert_eq!("iptables".parse::<Datapath>().unwrap(), Datapath::Iptables);
        assert_eq!("routed".parse::<Datapath>().unwrap(), Datapath::Routed);
        assert!("nft".parse::<Datapath>().is_err());
        assert_eq!(
            "none".parse::<RandomizeSnat>().unwrap(),
            RandomizeSnat::Sequential
        );
        assert_eq!(
            vpcnet_api::vpc_cni::randomize_flag(RandomizeSnat::Prng.env_value()),
            Some("--random-fully")
        );
    }
}
