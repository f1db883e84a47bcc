//! Pods in the datapath: what the CNI backend does on ADD and DEL beyond
//! the address (the pod's endpoint entry and the programs on its host
//! veth), what CHECK and GC ask about, and the sweep that gives back the
//! addresses of pods that went away without a DEL the agent saw (the agent
//! was down, the runtime lost track, the namespace was deleted).

use std::{
    collections::{HashMap, HashSet},
    net::Ipv4Addr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tracing::{debug, info, warn};
use vpcnet_api::{
    layout::EnforcingMode,
    pod::{BranchEni, branch_eni, branch_eni_of},
    vpc_cni::BranchPodWiring,
};
use vpcnet_common::{
    addr_to_raw,
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT, ENI_BRANCH, Endpoint, Eni},
};

use crate::{
    datapath::{Datapath, DatapathError},
    env::{ConfigError, Env},
    ipam::{
        checkpoint::{IpamKey, IpamMetadata},
        datastore::AssignedAddr,
        manager::{Manager, ManagerError, PodAddress, gateway_of},
    },
    k8s::pods::{BranchDecision, NodePods},
    netlink::{LinkInfo, MacAddr, NetlinkError, NetlinkHandle, vlan::VlanSpec},
    policy::node::{NodePolicy, PodName},
};

/// The VPC CNI's host veth prefix variable (the plugin's `vethPrefix`).
pub const ENV_VETH_PREFIX: &str = "AWS_VPC_K8S_CNI_VETHPREFIX";

/// `AWS_VPC_K8S_CNI_VETHPREFIX`, or the VPC CNI's default. aws-node's
/// entrypoint stops on a prefix longer than 4 characters or one naming
/// the node's own links (`eth`, `lo`, `vlan`); so does vpcnet.
pub fn veth_prefix(env: &Env) -> Result<String, ConfigError> {
    let Some(prefix) = env.raw(ENV_VETH_PREFIX) else {
        return Ok(vpcnet_api::pod::DEFAULT_VETH_PREFIX.to_owned());
    };
    if prefix.chars().count() > 4 || ["eth", "lo", "vlan"].contains(&prefix) {
        return Err(ConfigError {
            variable: ENV_VETH_PREFIX,
            value: prefix.to_owned(),
            allowed: "at most 4 characters, not eth, lo or vlan",
        });
    }
    Ok(prefix.to_owned())
}

#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error(transparent)]
    Manager(#[from] ManagerError),
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("the pod's host veth {0} does not exist")]
    NoHostVeth(String),
    #[error("the branch ENI's link {0} does not exist")]
    NoBranchLinkNamed(String),
    #[error("the pod's MAC {0:?} is not a MAC address")]
    BadMac(String),
    #[error("no link has the MAC {mac} of ENI {eni}")]
    NoEniLink { eni: String, mac: String },
    #[error("the pod's {annotation} annotation is not the resource controller's JSON")]
    BadAnnotation {
        annotation: &'static str,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "the pod has a branch ENI but security groups for pods are off on this node (ENABLE_POD_ENI)"
    )]
    PodEniDisabled,
    #[error(
        "pod {pod} asks for {resource} but has no {annotation} annotation yet: the VPC resource controller has not given it a branch ENI; kubelet will try again",
        resource = crate::k8s::pods::POD_ENI_RESOURCE,
        annotation = vpcnet_api::pod::POD_ENI_ANNOTATION
    )]
    BranchEniPending { pod: String },
    #[error("pod {pod} could not be looked up in the Kubernetes API (ENABLE_POD_ENI needs it)")]
    PodUnknown {
        pod: String,
        #[source]
        source: crate::k8s::K8sError,
    },
    #[error(
        "no link has the MAC {mac} of branch ENI {eni} (VLAN {vlan_id}): the trunk's vlan.eth.{vlan_id} is missing"
    )]
    NoBranchLink {
        eni: String,
        mac: String,
        vlan_id: u16,
    },
    #[error(
        "branch ENI {eni} (VLAN {vlan_id}) needs the node's trunk ENI, which the VPC resource controller has not attached yet; kubelet will try again"
    )]
    NoTrunk { eni: String, vlan_id: u16 },
    #[error("branch ENI {eni} names VLAN {vlan_id}: 802.1Q ids are 1 to 4094")]
    BadVlan { eni: String, vlan_id: u16 },
    #[error("no link has the MAC {mac} of the trunk ENI {eni}")]
    NoTrunkLink { eni: String, mac: String },
    #[error(
        "branch ENI {eni} names VLAN {vlan_id}, which {link} carries for the pod at {holder} already"
    )]
    VlanInUse {
        eni: String,
        vlan_id: u16,
        link: String,
        holder: Ipv4Addr,
    },
    #[error(transparent)]
    PodNet(#[from] vpcnet_netlink::pod::PodNetError),
    /// A branch-ENI pod's ADD failed: which pod, and why.
    #[error("pod {pod} (security groups for pods)")]
    BranchPod {
        pod: String,
        #[source]
        source: Box<PodError>,
    },
}

/// The VLAN ids of 802.1Q (0 and 4095 are reserved).
const VLAN_IDS: std::ops::RangeInclusive<u16> = 1..=4094;

/// Who makes a branch ENI's `vlan.eth.<vlan id>` link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BranchLinks {
    /// The agent, on ADD, as an 802.1Q link on the trunk ENI's link (the
    /// VPC CNI's plugin does it); DEL deletes it.
    Vlan,
    /// Someone else (the lab on a kernel without 802.1Q): the agent finds
    /// the link by the branch ENI's MAC and never deletes it.
    Existing,
}

/// What the pods of this node are set up with.
#[derive(Clone, Debug)]
pub struct PodsOptions {
    /// `AWS_VPC_K8S_CNI_VETHPREFIX`.
    pub veth_prefix: String,
    /// How long an address may be held by a pod with no datapath entry
    /// before the sweep takes it back: longer than any ADD takes.
    pub orphan_grace: Duration,
    /// `POD_SECURITY_GROUP_ENFORCING_MODE` when `ENABLE_POD_ENI` is on:
    /// pods with a branch ENI are served only then.
    pub branch_mode: Option<EnforcingMode>,
    /// Who makes branch ENIs' links.
    pub branch_links: BranchLinks,
    /// This node's pods in the Kubernetes API, when the agent has one.
    pub cluster_pods: Option<NodePods>,
}

/// A pod as `ListAttachments` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub key: IpamKey,
    pub metadata: IpamMetadata,
    pub addr: Ipv4Addr,
    /// Its host veth, if the datapath has an entry for it.
    pub host_veth: Option<String>,
}

/// What the sweep did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SweepStats {
    /// Pods whose host veth is gone: entry removed, address released.
    pub gone: usize,
    /// Addresses held past the grace period by a pod the datapath never saw.
    pub never_attached: usize,
}

/// The pods of this node: the address manager and the datapath together.
#[derive(Clone)]
pub struct Pods {
    inner: Arc<Inner>,
}

struct Inner {
    manager: Manager,
    datapath: Arc<Mutex<Datapath>>,
    netlink: NetlinkHandle,
    opts: PodsOptions,
    /// ADD's datapath step, DEL and the sweep one at a time, so the sweep
    /// never judges a pod that is being added or deleted. Address
    /// assignment (which may wait for the pool) happens outside it.
    ops: tokio::sync::Mutex<()>,
    /// Network policy, when enforced: set once before the plugin is served.
    policy: std::sync::OnceLock<NodePolicy>,
}

impl Pods {
    pub fn new(
        manager: Manager,
        datapath: Arc<Mutex<Datapath>>,
        netlink: NetlinkHandle,
        opts: PodsOptions,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                manager,
                datapath,
                netlink,
                opts,
                ops: tokio::sync::Mutex::new(()),
                policy: std::sync::OnceLock::new(),
            }),
        }
    }

    pub fn manager(&self) -> &Manager {
        &self.inner.manager
    }

    /// This node's pods in the Kubernetes API, when the agent has one.
    pub fn cluster_pods(&self) -> Option<&NodePods> {
        self.inner.opts.cluster_pods.as_ref()
    }

    /// Enforces network policy from now on: every ADD writes the pod's
    /// rules before its endpoint, every DEL and sweep forgets them. Set
    /// once, before the plugin is served.
    pub fn enforce_policy(&self, policy: NodePolicy) {
        if self.inner.policy.set(policy).is_err() {
            warn!("network policy was already enforced");
        }
    }

    /// Network policy, when enforced.
    pub fn policy(&self) -> Option<&NodePolicy> {
        self.inner.policy.get()
    }

    /// A pod's address is gone: its rules too.
    async fn forget_policy(&self, addr: Ipv4Addr) {
        if let Some(policy) = self.inner.policy.get()
            && let Err(error) = policy.pod_removed(addr).await
        {
            warn!(%addr, %error, "removing a pod's network policy");
        }
    }

    fn datapath(&self) -> std::sync::MutexGuard<'_, Datapath> {
        // A panic elsewhere leaves the maps as they were: usable.
        self.inner
            .datapath
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// ADD: an address for `key`, and, when the plugin names the pod's host
    /// veth, the pod's endpoint entry and the programs on that veth. If the
    /// datapath step fails the address goes back: nothing is left half-done.
    pub async fn add(
        &self,
        key: &IpamKey,
        metadata: &IpamMetadata,
        host_veth: &str,
        pod_mac: &str,
        annotations: &HashMap<String, String>,
    ) -> Result<PodAddress, PodError> {
        // With the API, its annotation is the one that counts (the
        // runtime's copy may predate the controller's).
        let for_pod = |source| PodError::BranchPod {
            pod: format!("{}/{}", metadata.k8s_pod_namespace, metadata.k8s_pod_name),
            source: Box::new(source),
        };
        let branch = match self.branch_from_api(metadata).await? {
            Some(value) => branch_eni_of(&value),
            None => branch_eni(annotations),
        }
        .map_err(|source| {
            for_pod(PodError::BadAnnotation {
                annotation: vpcnet_api::pod::POD_ENI_ANNOTATION,
                source,
            })
        })?;
        if let Some(branch) = branch {
            let mode = self
                .inner
                .opts
                .branch_mode
                .ok_or_else(|| for_pod(PodError::PodEniDisabled))?;
            let _op = self.inner.ops.lock().await;
            return self
                .attach_branch(&branch, mode, metadata, host_veth, pod_mac)
                .await
                .map_err(for_pod);
        }
        let pod = self.inner.manager.assign(key, metadata).await?;
        if host_veth.is_empty() {
            return Ok(pod);
        }
        let _op = self.inner.ops.lock().await;
        if let Err(e) = self
            .attach(&pod.eni_of(), metadata, host_veth, pod_mac, 0)
            .await
        {
            warn!(container = %key.container_id, addr = %pod.addr, error = %e, "datapath step of ADD failed: address released");
            if let Err(release) = self.inner.manager.release(key).await {
                warn!(container = %key.container_id, error = %release, "releasing after a failed ADD");
            }
            return Err(e);
        }
        Ok(pod)
    }

    /// With `ENABLE_POD_ENI` and an API server, what the API says of the
    /// pod's branch ENI, as aws-node asks it: the controller's annotation
    /// (`None`: an ordinary pod, or no API server: the runtime's
    /// annotations decide), or a retryable error while a pod that asks for
    /// one has none yet.
    async fn branch_from_api(&self, metadata: &IpamMetadata) -> Result<Option<String>, PodError> {
        let (Some(_), Some(cluster)) = (self.inner.opts.branch_mode, &self.inner.opts.cluster_pods)
        else {
            return Ok(None);
        };
        let pod = format!("{}/{}", metadata.k8s_pod_namespace, metadata.k8s_pod_name);
        let view = cluster
            .pod(&metadata.k8s_pod_namespace, &metadata.k8s_pod_name)
            .await
            .map_err(|source| PodError::PodUnknown {
                pod: pod.clone(),
                source,
            })?;
        match view.branch_decision() {
            BranchDecision::Pool => Ok(None),
            BranchDecision::Branch(annotation) => Ok(Some(annotation)),
            BranchDecision::Pending => Err(PodError::BranchEniPending { pod }),
        }
    }

    /// A pod with a branch ENI (security groups for pods): its address is
    /// the branch ENI's, from the resource controller, not the pool's; its
    /// packets leave by the branch ENI's link, every one of them in strict
    /// mode. If a later step fails, the link leaves the datapath again (and
    /// goes, if it was made here).
    async fn attach_branch(
        &self,
        branch: &BranchEni,
        mode: EnforcingMode,
        metadata: &IpamMetadata,
        host_veth: &str,
        pod_mac: &str,
    ) -> Result<PodAddress, PodError> {
        let link = match self.inner.opts.branch_links {
            BranchLinks::Existing => self.existing_branch_link(branch).await?,
            BranchLinks::Vlan => self.make_branch_link(branch, host_veth).await?,
        };
        let wired = self
            .wire_branch(&link, branch, mode, metadata, host_veth, pod_mac)
            .await;
        if wired.is_err()
            && let Err(e) = self.release_branch_link(link.index).await
        {
            warn!(link = %link.name, error = %e, "removing the branch link of a failed ADD");
        }
        wired
    }

    /// The branch ENI's link someone else made, by its MAC.
    async fn existing_branch_link(&self, branch: &BranchEni) -> Result<LinkInfo, PodError> {
        let no_link = || PodError::NoBranchLink {
            eni: branch.eni_id.clone(),
            mac: branch.mac.clone(),
            vlan_id: branch.vlan_id,
        };
        let branch_mac: MacAddr = branch.mac.parse().map_err(|_| no_link())?;
        self.inner
            .netlink
            .link_by_mac(branch_mac)
            .await?
            .ok_or_else(no_link)
    }

    /// The branch ENI's `vlan.eth.<vlan id>`, made as the VPC CNI's plugin
    /// makes it (`setupVlan`): on the trunk ENI's link, which gets the ENI
    /// MTU and goes up first as ipamd sets it, with the branch ENI's MAC.
    /// A link of that name that no pod uses (a pod gone without DEL, or a
    /// trunk since replaced) is replaced; one another pod uses is refused.
    async fn make_branch_link(
        &self,
        branch: &BranchEni,
        host_veth: &str,
    ) -> Result<LinkInfo, PodError> {
        let netlink = &self.inner.netlink;
        if !VLAN_IDS.contains(&branch.vlan_id) {
            return Err(PodError::BadVlan {
                eni: branch.eni_id.clone(),
                vlan_id: branch.vlan_id,
            });
        }
        let no_trunk = || PodError::NoTrunk {
            eni: branch.eni_id.clone(),
            vlan_id: branch.vlan_id,
        };
        // A trunk just attached may not be in IMDS yet: try again too.
        let trunk = self.inner.manager.trunk().await.map_err(|e| {
            warn!(error = %e, "looking up the trunk ENI");
            no_trunk()
        })?;
        let (trunk_id, trunk_mac) = trunk.ok_or_else(no_trunk)?;
        let no_trunk_link = || PodError::NoTrunkLink {
            eni: trunk_id.clone(),
            mac: trunk_mac.clone(),
        };
        let trunk = netlink
            .link_by_mac(trunk_mac.parse().map_err(|_| no_trunk_link())?)
            .await?
            .ok_or_else(no_trunk_link)?;
        let mtu = self.inner.manager.eni_mtu();
        if trunk.mtu != mtu {
            netlink.set_mtu(&trunk.link_ref(), mtu).await?;
        }
        if !trunk.up {
            netlink.set_up(&trunk.link_ref()).await?;
        }
        let name = vpcnet_api::pod::branch_link_name(branch.vlan_id);
        if let Some(stale) = netlink.vlan_details(&name).await? {
            let own_veth = nix::net::if_::if_nametoindex(host_veth).ok();
            let holder = self
                .datapath()
                .maps
                .endpoints()?
                .into_iter()
                .find(|(_, e)| e.eni_ifindex == stale.link.index && Some(e.ifindex) != own_veth);
            if let Some((holder, _)) = holder {
                return Err(PodError::VlanInUse {
                    eni: branch.eni_id.clone(),
                    vlan_id: branch.vlan_id,
                    link: name,
                    holder,
                });
            }
            info!(link = %name, "replacing a VLAN link no pod uses");
            self.release_branch_link(stale.link.index).await?;
        }
        let mac: MacAddr = branch
            .mac
            .parse()
            .map_err(|_| PodError::BadMac(branch.mac.clone()))?;
        Ok(netlink
            .create_vlan(&VlanSpec {
                name,
                parent_index: trunk.index,
                vlan_id: branch.vlan_id,
                mac,
            })
            .await?)
    }

    /// A branch link out of the datapath (its entry, its programs) and, if
    /// the agent makes them, deleted (its VLAN is free again).
    async fn release_branch_link(&self, ifindex: u32) -> Result<(), PodError> {
        self.branch_link_out(ifindex)?;
        if self.inner.opts.branch_links != BranchLinks::Vlan {
            return Ok(());
        }
        let netlink = &self.inner.netlink;
        if let Some(link) = netlink.vlan_details_by_index(ifindex).await?
            && link.vlan.is_some()
            && link
                .link
                .name
                .starts_with(vpcnet_api::pod::BRANCH_LINK_PREFIX)
        {
            netlink.delete_link(ifindex, &link.link.name).await?;
        }
        Ok(())
    }

    /// [`Pods::release_branch_link`] for each of `links` whose pod went:
    /// one that fails is said, and the others still go (its link is then
    /// replaced by the next ADD on its VLAN).
    async fn release_branch_links(&self, links: Vec<u32>) {
        for link in links {
            if let Err(e) = self.release_branch_link(link).await {
                warn!(ifindex = link, error = %e, "releasing a branch link");
            }
        }
    }

    /// The datapath of a branch pod: its link as an ENI of the datapath,
    /// then the pod's entry and programs.
    async fn wire_branch(
        &self,
        link: &LinkInfo,
        branch: &BranchEni,
        mode: EnforcingMode,
        metadata: &IpamMetadata,
        host_veth: &str,
        pod_mac: &str,
    ) -> Result<PodAddress, PodError> {
        let gateway = gateway_of(branch.subnet_cidr);
        self.inner
            .netlink
            .keep_gateway_resolved(&link.link_ref(), gateway)
            .await?;
        {
            let mut datapath = self.datapath();
            datapath.maps.set_eni(
                link.index,
                &Eni {
                    gateway: addr_to_raw(gateway.octets()),
                    flags: ENI_BRANCH,
                },
            )?;
            datapath.attach_eni(&link.name)?;
        }
        let pod = PodAddress {
            addr: branch.private_ip,
            eni_id: branch.eni_id.clone(),
            eni_mac: branch.mac.clone(),
            device_number: 0,
            subnet: branch.subnet_cidr,
            gateway,
            branch: true,
        };
        self.attach(
            &pod.eni_of(),
            metadata,
            host_veth,
            pod_mac,
            branch_flags(mode),
        )
        .await?;
        Ok(pod)
    }

    async fn attach(
        &self,
        pod: &PodOnEni,
        metadata: &IpamMetadata,
        host_veth: &str,
        pod_mac: &str,
        flags: u32,
    ) -> Result<(), PodError> {
        let entry = self.endpoint_of(pod, host_veth, pod_mac, flags).await?;
        // The pod's rules before its entry: its first packet is judged.
        if let Some(policy) = self.inner.policy.get() {
            let name = PodName {
                namespace: metadata.k8s_pod_namespace.clone(),
                name: metadata.k8s_pod_name.clone(),
            };
            policy.pod_added(pod.addr, name).await?;
        }
        let mut datapath = self.datapath();
        // The entry before the programs: the pod's first packet must not be
        // taken for a spoofed one.
        datapath.maps.set_endpoint(pod.addr, &entry)?;
        if let Err(e) = datapath.attach_pod(host_veth) {
            let _ = datapath.maps.remove_endpoint(pod.addr);
            return Err(e.into());
        }
        info!(addr = %pod.addr, veth = host_veth, ifindex = entry.ifindex, eni = %pod.eni_id, "pod in the datapath");
        Ok(())
    }

    /// The datapath entry of `pod` on `host_veth`.
    async fn endpoint_of(
        &self,
        pod: &PodOnEni,
        host_veth: &str,
        pod_mac: &str,
        flags: u32,
    ) -> Result<Endpoint, PodError> {
        let mac: MacAddr = pod_mac
            .parse()
            .map_err(|_| PodError::BadMac(pod_mac.to_owned()))?;
        let netlink = &self.inner.netlink;
        let veth = netlink
            .link_by_name(host_veth)
            .await?
            .ok_or_else(|| PodError::NoHostVeth(host_veth.to_owned()))?;
        let host_mac = veth
            .mac
            .ok_or_else(|| PodError::NoHostVeth(host_veth.to_owned()))?;
        let eni_mac: MacAddr = pod.eni_mac.parse().map_err(|_| PodError::NoEniLink {
            eni: pod.eni_id.clone(),
            mac: pod.eni_mac.clone(),
        })?;
        let eni = netlink
            .link_by_mac(eni_mac)
            .await?
            .ok_or_else(|| PodError::NoEniLink {
                eni: pod.eni_id.clone(),
                mac: pod.eni_mac.clone(),
            })?;
        Ok(Endpoint {
            ifindex: veth.index,
            eni_ifindex: eni.index,
            mac: mac.0,
            host_mac: host_mac.0,
            flags,
        })
    }

    /// Adopts the pods another CNI (aws-node) wired, first step: every
    /// address held with no datapath entry, or one whose veth lacks its
    /// programs (a start killed half-way), whose pod's veth (named by the
    /// VPC CNI's rule from the checkpoint's pod name) exists gets its
    /// entry, its MAC read from the veth's peer. Replies then go straight
    /// into the pod, while what the pod sends still goes through the stack
    /// until [`Pods::finish_adoption`] attaches the programs. Returns the
    /// pods with an entry, and how many with a veth failed.
    pub async fn adopt(
        &self,
        branch_pods: &[BranchPodWiring],
    ) -> Result<(Vec<Adoptee>, usize), PodError> {
        let _op = self.inner.ops.lock().await;
        let (mut adopted, mut failed) = self.adopt_branch_pods(branch_pods).await?;
        for (assigned, eni_mac) in self.inner.manager.assignments().await {
            // A pod with its entry but not its programs is one an earlier
            // start was adopting when it died: adopted again, whole.
            if self.datapath().holds_pod(assigned.addr)? {
                continue;
            }
            let veth = vpcnet_api::pod::host_veth_name(
                &self.inner.opts.veth_prefix,
                &assigned.metadata.k8s_pod_namespace,
                &assigned.metadata.k8s_pod_name,
            );
            let Some(pod_mac) = self.inner.netlink.peer_mac(&veth).await? else {
                debug!(addr = %assigned.addr, veth, "no veth to adopt");
                continue;
            };
            let pod = PodOnEni {
                addr: assigned.addr,
                eni_id: assigned.eni.clone(),
                eni_mac,
            };
            let entry = match self.endpoint_of(&pod, &veth, &pod_mac.to_string(), 0).await {
                Ok(entry) => entry,
                Err(e) => {
                    warn!(addr = %assigned.addr, veth, error = %e, "adopting a pod failed");
                    failed += 1;
                    continue;
                }
            };
            self.datapath().maps.set_endpoint(pod.addr, &entry)?;
            adopted.push(Adoptee {
                addr: pod.addr,
                host_veth: veth,
                branch_link: None,
            });
        }
        Ok((adopted, failed))
    }

    /// [`Pods::adopt`]'s first step for the branch-ENI pods aws-node wired
    /// (read back from its rules and VLAN tables): the branch link as an
    /// ENI of the datapath, with its programs, and the pod's entry, its
    /// flags those of this node's enforcing mode. Without `ENABLE_POD_ENI`
    /// they are left as they are.
    async fn adopt_branch_pods(
        &self,
        branch_pods: &[BranchPodWiring],
    ) -> Result<(Vec<Adoptee>, usize), PodError> {
        let (mut adopted, mut failed) = (Vec::new(), 0);
        if branch_pods.is_empty() {
            return Ok((adopted, failed));
        }
        let Some(mode) = self.inner.opts.branch_mode else {
            warn!(
                pods = branch_pods.len(),
                "aws-node's branch-ENI pods are left on its rules: ENABLE_POD_ENI is off"
            );
            return Ok((adopted, branch_pods.len()));
        };
        for pod in branch_pods {
            match self.adopt_branch_pod(pod, mode).await {
                Ok(link) => adopted.push(Adoptee {
                    addr: pod.addr,
                    host_veth: pod.host_veth.clone(),
                    branch_link: Some(link),
                }),
                Err(e) => {
                    warn!(addr = %pod.addr, veth = pod.host_veth, link = pod.vlan_link(), error = %e, "adopting a branch-ENI pod failed");
                    failed += 1;
                }
            }
        }
        Ok((adopted, failed))
    }

    /// One of [`Pods::adopt_branch_pods`]; returns its link's index.
    async fn adopt_branch_pod(
        &self,
        pod: &BranchPodWiring,
        mode: EnforcingMode,
    ) -> Result<u32, PodError> {
        let netlink = &self.inner.netlink;
        let vlan_link = pod.vlan_link();
        let link = netlink
            .link_by_name(&vlan_link)
            .await?
            .ok_or_else(|| PodError::NoBranchLinkNamed(vlan_link.clone()))?;
        let veth = netlink
            .link_by_name(&pod.host_veth)
            .await?
            .ok_or_else(|| PodError::NoHostVeth(pod.host_veth.clone()))?;
        let (Some(host_mac), Some(pod_mac)) = (veth.mac, netlink.peer_mac(&pod.host_veth).await?)
        else {
            return Err(PodError::NoHostVeth(pod.host_veth.clone()));
        };
        netlink
            .keep_gateway_resolved(&link.link_ref(), pod.gateway)
            .await?;
        let entered = {
            let mut datapath = self.datapath();
            datapath
                .maps
                .set_eni(
                    link.index,
                    &Eni {
                        gateway: addr_to_raw(pod.gateway.octets()),
                        flags: ENI_BRANCH,
                    },
                )
                .and_then(|()| datapath.attach_eni(&link.name))
                .and_then(|()| {
                    datapath.maps.set_endpoint(
                        pod.addr,
                        &Endpoint {
                            ifindex: veth.index,
                            eni_ifindex: link.index,
                            mac: pod_mac.0,
                            host_mac: host_mac.0,
                            flags: branch_flags(mode),
                        },
                    )
                })
        };
        if let Err(e) = entered {
            let _ = self.branch_link_out(link.index);
            return Err(e.into());
        }
        Ok(link.index)
    }

    /// A branch link out of the datapath: its programs and its entry (the
    /// link itself stays).
    fn branch_link_out(&self, ifindex: u32) -> Result<(), DatapathError> {
        let mut datapath = self.datapath();
        datapath.detach_ifindex(ifindex);
        datapath.maps.remove_eni(ifindex)
    }

    /// Undoes [`Pods::adopt`]: the entries go, the pods stay as the other
    /// CNI wired them.
    pub fn abandon_adoption(&self, adoptees: &[Adoptee]) {
        for pod in adoptees {
            let _ = self.datapath().maps.remove_endpoint(pod.addr);
            if let Some(link) = pod.branch_link {
                let _ = self.branch_link_out(link);
            }
        }
    }

    /// Adopts the pods another CNI wired, last step: their programs.
    /// Returns the addresses adopted, and how many failed (their entries
    /// go again).
    pub async fn finish_adoption(&self, adoptees: &[Adoptee]) -> (Vec<Ipv4Addr>, usize) {
        let _op = self.inner.ops.lock().await;
        let (mut adopted, mut failed) = (Vec::new(), 0);
        for pod in adoptees {
            let attached = self.datapath().attach_pod(&pod.host_veth);
            if let Err(e) = attached {
                warn!(addr = %pod.addr, veth = pod.host_veth, error = %e, "adopting a pod failed");
                let _ = self.datapath().maps.remove_endpoint(pod.addr);
                if let Some(link) = pod.branch_link {
                    let _ = self.branch_link_out(link);
                }
                failed += 1;
                continue;
            }
            info!(addr = %pod.addr, veth = pod.host_veth, "pod adopted into the datapath");
            adopted.push(pod.addr);
        }
        (adopted, failed)
    }

    /// DEL: the pod out of the datapath, then its address back to the pool.
    /// Returns the address released (none held: `None`).
    pub async fn del(&self, key: &IpamKey, host_veth: &str) -> Result<Option<Ipv4Addr>, PodError> {
        let _op = self.inner.ops.lock().await;
        let held = self
            .inner
            .manager
            .assignment(key)
            .await
            .map(|(a, _)| a.addr);
        let mut branch_links = Vec::new();
        let mut removed = Vec::new();
        {
            let mut datapath = self.datapath();
            if let Some(addr) = held
                && let Some(entry) = datapath.maps.endpoint(addr)?
            {
                datapath.detach_ifindex(entry.ifindex);
                datapath.maps.remove_endpoint(addr)?;
                removed.push(addr);
            }
            if let Ok(ifindex) = nix::net::if_::if_nametoindex(host_veth) {
                // A branch-ENI pod holds no pool address: its entry is
                // found by its veth.
                for (addr, entry) in datapath.maps.endpoints()? {
                    if entry.ifindex == ifindex && entry.flags & ENDPOINT_BRANCH != 0 {
                        datapath.maps.remove_endpoint(addr)?;
                        branch_links.push(entry.eni_ifindex);
                        removed.push(addr);
                    }
                }
                datapath.detach_ifindex(ifindex);
            }
        }
        for addr in removed {
            self.forget_policy(addr).await;
        }
        self.release_branch_links(branch_links).await;
        Ok(self.inner.manager.release(key).await?)
    }

    /// CHECK: the pod's address, its host veth, and the first thing wrong
    /// with its datapath state (`None`: all is well).
    pub async fn check(
        &self,
        key: &IpamKey,
    ) -> Result<Option<(Ipv4Addr, Option<String>, Option<String>)>, PodError> {
        let Some((assigned, eni_mac)) = self.inner.manager.assignment(key).await else {
            return Ok(None);
        };
        let addr = assigned.addr;
        let entry = self.datapath().maps.endpoint(addr)?;
        let Some(entry) = entry else {
            return Ok(Some((
                addr,
                None,
                Some(format!("no datapath entry for {addr}")),
            )));
        };
        let Some(veth) = interface_name(entry.ifindex) else {
            return Ok(Some((
                addr,
                None,
                Some(format!(
                    "the datapath entry of {addr} names interface {} , which is gone",
                    entry.ifindex
                )),
            )));
        };
        let problem = if self.datapath().is_attached(entry.ifindex) {
            let eni_link = match eni_mac.parse::<MacAddr>() {
                Ok(mac) => self.inner.netlink.link_by_mac(mac).await?,
                Err(_) => None,
            };
            match eni_link {
                Some(link) if link.index == entry.eni_ifindex => None,
                Some(link) => Some(format!(
                    "{addr} leaves by ifindex {} but its ENI {} is {} (ifindex {})",
                    entry.eni_ifindex, assigned.eni, link.name, link.index
                )),
                None => Some(format!(
                    "the link of ENI {} ({eni_mac}) is gone",
                    assigned.eni
                )),
            }
        } else {
            Some(format!("the datapath programs are not attached to {veth}"))
        };
        Ok(Some((addr, Some(veth), problem)))
    }

    /// Every pod the agent holds an address for.
    pub async fn attachments(&self) -> Result<Vec<Attachment>, PodError> {
        let assignments = self.inner.manager.assignments().await;
        let datapath = self.datapath();
        assignments
            .into_iter()
            .map(|(a, _)| {
                let host_veth = datapath
                    .maps
                    .endpoint(a.addr)?
                    .and_then(|entry| interface_name(entry.ifindex));
                Ok(Attachment {
                    key: a.key,
                    metadata: a.metadata,
                    addr: a.addr,
                    host_veth,
                })
            })
            .collect()
    }

    /// Gives back what pods that are gone still hold: entries whose host
    /// veth no longer exists (with its address), and addresses held past
    /// the grace period by a pod the datapath never got (unless a veth of
    /// that pod's name exists: a pod an earlier CNI wired).
    pub async fn sweep(&self) -> Result<SweepStats, PodError> {
        let _op = self.inner.ops.lock().await;
        let mut stats = SweepStats::default();
        let assignments = self.inner.manager.assignments().await;
        let by_addr: HashMap<Ipv4Addr, &AssignedAddr> =
            assignments.iter().map(|(a, _)| (a.addr, a)).collect();
        let mut release = Vec::new();
        let mut in_datapath = HashSet::new();
        let mut branch_links = Vec::new();
        let mut gone = Vec::new();
        {
            let mut datapath = self.datapath();
            datapath.prune_attachments();
            for (addr, entry) in datapath.maps.endpoints()? {
                if interface_name(entry.ifindex).is_some() {
                    in_datapath.insert(addr);
                    continue;
                }
                datapath.detach_ifindex(entry.ifindex);
                datapath.maps.remove_endpoint(addr)?;
                gone.push(addr);
                if entry.flags & ENDPOINT_BRANCH != 0 {
                    info!(addr = %addr, "branch pod's host veth is gone: its branch link goes");
                    branch_links.push(entry.eni_ifindex);
                }
                if let Some(assigned) = by_addr.get(&addr) {
                    info!(addr = %addr, container = %assigned.key.container_id, "pod's host veth is gone: address released");
                    release.push(assigned.key.clone());
                    stats.gone += 1;
                }
            }
        }
        for addr in gone {
            self.forget_policy(addr).await;
        }
        self.release_branch_links(branch_links).await;
        debug!(
            assignments = assignments.len(),
            in_datapath = in_datapath.len(),
            gone = stats.gone,
            "pod sweep"
        );
        let now = crate::ipam::manager::unix_ns();
        let grace = i64::try_from(self.inner.opts.orphan_grace.as_nanos()).unwrap_or(i64::MAX);
        for (assigned, _) in &assignments {
            if in_datapath.contains(&assigned.addr)
                || release.contains(&assigned.key)
                || now.saturating_sub(assigned.since_unix_ns) < grace
            {
                continue;
            }
            let veth = vpcnet_api::pod::host_veth_name(
                &self.inner.opts.veth_prefix,
                &assigned.metadata.k8s_pod_namespace,
                &assigned.metadata.k8s_pod_name,
            );
            if nix::net::if_::if_nametoindex(veth.as_str()).is_ok() {
                continue;
            }
            info!(addr = %assigned.addr, container = %assigned.key.container_id, "address held with no pod in the datapath past the grace period: released");
            release.push(assigned.key.clone());
            stats.never_attached += 1;
        }
        for key in release {
            self.inner.manager.release(&key).await?;
        }
        Ok(stats)
    }

    /// STATUS: whether an ADD can be served now, and if not why.
    pub async fn status(&self) -> (bool, String, usize) {
        let available = self.inner.manager.available().await;
        if available > 0 {
            (true, String::new(), available)
        } else {
            let status = self.inner.manager.status().await;
            (
                false,
                format!(
                    "no free address: {} of {} assigned",
                    status.stats.assigned_ips, status.stats.total_ips
                ),
                0,
            )
        }
    }
}

/// A pod being adopted: its entry is in, its programs are to come.
#[derive(Clone, Debug)]
pub struct Adoptee {
    pub addr: Ipv4Addr,
    pub host_veth: String,
    /// A branch pod's VLAN link, already in the datapath.
    pub branch_link: Option<u32>,
}

/// What a pod's datapath entry is made from: its address and its ENI.
struct PodOnEni {
    addr: Ipv4Addr,
    eni_id: String,
    eni_mac: String,
}

impl PodAddress {
    fn eni_of(&self) -> PodOnEni {
        PodOnEni {
            addr: self.addr,
            eni_id: self.eni_id.clone(),
            eni_mac: self.eni_mac.clone(),
        }
    }
}

/// A branch pod's endpoint flags in enforcing mode `mode`.
fn branch_flags(mode: EnforcingMode) -> u32 {
    match mode {
        EnforcingMode::Strict => ENDPOINT_BRANCH | ENDPOINT_STRICT,
        EnforcingMode::Standard => ENDPOINT_BRANCH,
    }
}

/// The name of interface `ifindex`, if it exists (nix answers an empty
/// name rather than an error for one that does not).
fn interface_name(ifindex: u32) -> Option<String> {
    nix::net::if_::if_indextoname(ifindex)
        .ok()
        .map(|name| name.to_string_lossy().into_owned())
        .filter(|name| !name.is_empty())
}
