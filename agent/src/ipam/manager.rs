//! The address manager at work: it rebuilds the node's ENIs from IMDS and
//! EC2 and replays the checkpoint at start, hands addresses to pods (on disk
//! before the answer), and keeps the warm pool between the VPC CNI's targets
//! by assigning and releasing addresses, /28 prefixes and whole ENIs.
//!
//! Every EC2 call happens without the state lock held, so pods get
//! addresses while the pool grows. One task (the reconcile loop) changes the
//! pool; calls that fail with throttling, server errors or an exhausted
//! subnet back off exponentially with jitter.

use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    future::Future,
    net::Ipv4Addr,
    pin::{Pin, pin},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use ipnet::Ipv4Net;
use tokio::sync::{Mutex, Notify, watch};
use tracing::{debug, info, warn};

use super::{
    checkpoint::{Checkpoint, CheckpointError, IpamKey, IpamMetadata},
    datastore::{AssignedAddr, Assignment, Datastore, DatastoreError, EniRecord},
    pool::{IPS_PER_PREFIX, PoolStats, PoolTargets},
    settings::{ENV_MANAGE_ENIS_NON_SCHEDULABLE, EniConfig, IpamSettings},
    subnets,
};
use crate::{
    cloud::{
        Cloud, CloudError, EniInfo, ImdsEni, InstanceMetadata, InstanceTypeLimits, NewEni,
        SubnetInfo, TAG_CREATED_AT, TAG_INSTANCE_ID, TAG_NO_MANAGE, managed_eni_tags,
        time_now_rfc3339,
    },
    k8s::node::UNSCHEDULABLE_TAINT,
};

/// How long a detached ENI made by an agent may live before leaked-ENI
/// cleanup deletes it (aws-node's grace: another node may be attaching it).
pub const LEAKED_ENI_GRACE: Duration = Duration::from_mins(5);
/// Events kept for `IpamStatus`.
const EVENTS_KEPT: usize = 64;
/// How often an ADD waiting on cooling addresses looks again.
const COOLDOWN_RECHECK: Duration = Duration::from_millis(100);
/// How long an attach or detach may take before it counts as failed.
const ATTACH_TIMEOUT: Duration = Duration::from_mins(1);
/// How long what the agent itself assigned or gave back is left out of the
/// node's reconcile: IMDS and EC2 may show it late (aws-node waits as long).
const RECENT_GRACE: Duration = Duration::from_mins(1);

/// The manager's knobs beyond the VPC CNI's variables (intervals mostly,
/// shortened by tests).
#[derive(Clone, Debug)]
pub struct ManagerOptions {
    pub settings: IpamSettings,
    /// Between two passes over the pool when nothing wakes the loop.
    pub reconcile_interval: Duration,
    /// Between two leaked-ENI sweeps.
    pub leaked_eni_interval: Duration,
    /// Between two reads of the VPC's CIDRs from IMDS.
    pub vpc_cidr_interval: Duration,
    /// Between two looks for ENIs and addresses attached or taken away by
    /// someone else (aws-node's node IP pool reconcile).
    pub node_reconcile_interval: Duration,
    /// How long an ADD waits for the pool to grow before failing.
    pub assign_wait: Duration,
    /// An ENI younger than this is not freed (aws-node: one minute), so a
    /// burst of pod churn does not attach and detach ENIs back to back.
    pub min_eni_lifetime: Duration,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// `true` while the node is cordoned (its Node's unschedulable taint);
    /// `None`: never (no API server).
    pub cordoned: Option<watch::Receiver<bool>>,
    /// Custom networking's config for new ENIs as the node's ENIConfig says
    /// (`None` in it: none valid yet); `None`: the settings' override.
    pub eni_configs: Option<watch::Receiver<Option<EniConfig>>>,
}

impl ManagerOptions {
    #[must_use]
    pub fn new(settings: IpamSettings) -> Self {
        Self {
            settings,
            reconcile_interval: Duration::from_secs(5),
            leaked_eni_interval: Duration::from_mins(10),
            vpc_cidr_interval: Duration::from_secs(30),
            node_reconcile_interval: Duration::from_mins(1),
            assign_wait: Duration::from_secs(10),
            min_eni_lifetime: Duration::from_mins(1),
            backoff_base: Duration::from_millis(200),
            backoff_max: Duration::from_secs(30),
            cordoned: None,
            eni_configs: None,
        }
    }
}

/// An ENI whose link the node must set up (and the datapath learn).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachedEni {
    pub id: String,
    pub mac: String,
    pub device_number: u32,
    /// The ENI's primary address, with its subnet's prefix length.
    pub addr: Ipv4Net,
    pub gateway: Ipv4Addr,
}

pub type NetworkResult<T = ()> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// A future a [`NodeNetwork`] method returns.
pub type NetworkFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the node does when the manager's view changes: set up an attached
/// ENI's link and datapath entry, put new VPC CIDRs into the datapath.
pub trait NodeNetwork: Send + Sync + 'static {
    fn eni_attached<'a>(
        &'a self,
        eni: &'a AttachedEni,
    ) -> Pin<Box<dyn Future<Output = NetworkResult> + Send + 'a>>;
    /// Puts an ENI's link back as `eni_attached` set it, if something else
    /// rewrote it; returns what had to change.
    fn eni_link_check<'a>(
        &'a self,
        _eni: &'a AttachedEni,
    ) -> NetworkFuture<'a, NetworkResult<Vec<&'static str>>> {
        Box::pin(async { Ok(Vec::new()) })
    }
    /// The interface of the ENI with `mac` and who manages it, for the log.
    fn interface_owner<'a>(&'a self, _mac: &'a str) -> NetworkFuture<'a, Option<(String, String)>> {
        Box::pin(async { None })
    }
    fn vpc_cidrs_changed(&self, cidrs: &[Ipv4Net]) -> NetworkResult;
}

#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error(transparent)]
    Cloud(#[from] CloudError),
    #[error(transparent)]
    Datastore(#[from] DatastoreError),
    #[error("writing the checkpoint")]
    Checkpoint(#[from] CheckpointError),
    /// The VPC CNI's words, which operators search for.
    #[error("failed to assign an IP address to container: {0}")]
    NoAddress(&'static str),
    #[error("setting up ENI {eni}: {reason}")]
    Network { eni: String, reason: String },
    #[error("no subnet for a new ENI: {0}")]
    NoSubnet(String),
    #[error("IMDS lists no primary ENI for MAC {0}")]
    NoPrimaryEni(String),
    #[error("ENI {eni} did not reach {state} within {timeout:?}")]
    Timeout {
        eni: String,
        state: &'static str,
        timeout: Duration,
    },
}

impl ManagerError {
    /// Throttling, server errors, an exhausted subnet, a slow attach: worth
    /// another try later.
    #[must_use]
    pub fn backs_off(&self) -> bool {
        match self {
            Self::Cloud(e) => e.is_retryable() || e.is_subnet_exhausted(),
            Self::Timeout { .. } | Self::Network { .. } => true,
            _ => false,
        }
    }
}

/// A pod's address and what the plugin needs to wire it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodAddress {
    pub addr: Ipv4Addr,
    pub eni_id: String,
    /// The ENI's MAC: how the node finds its link.
    pub eni_mac: String,
    /// A branch ENI's address (security groups for pods), not the pool's.
    pub branch: bool,
    pub device_number: u32,
    pub subnet: Ipv4Net,
    pub gateway: Ipv4Addr,
}

/// Something operators should hear about (a Kubernetes event on the
/// agent's pod, with an API server).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpamEvent {
    pub time: SystemTime,
    pub severity: Severity,
    pub reason: &'static str,
    /// What was being done: the EC2 call for an API error, else the
    /// manager's step.
    pub action: &'static str,
    pub message: String,
}

/// An event's Kubernetes type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    Normal,
    Warning,
}

/// Named and described with the metrics that report them.
pub use super::metrics::IpamCounters;

fn bump(counter: &AtomicU64, n: usize) {
    counter.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
}

/// How often the links of the agent's ENIs are checked (and put back if
/// something else rewrote them): each check dumps the node's routes, which
/// grow with its pods, so not on every pass of a fast pool loop.
const LINK_CHECK_INTERVAL: Duration = Duration::from_secs(5);

/// What the node is: found out once at start.
#[derive(Clone, Debug)]
struct Node {
    instance: InstanceMetadata,
    limits: InstanceTypeLimits,
    max_enis: usize,
    max_pods: usize,
    primary_eni: ImdsEni,
    /// The primary ENI's VPC: subnet discovery looks in it.
    vpc_id: String,
    /// The tags every ENI the manager manages carries.
    eni_tags: BTreeMap<String, String>,
}

/// Where a new ENI goes.
#[derive(Clone, Debug, PartialEq, Eq)]
enum EniPlacement {
    /// The primary ENI's subnet, or those subnet discovery finds, with the
    /// primary ENI's security groups.
    NodeSubnets,
    /// Custom networking's subnet and groups.
    Custom(EniConfig),
    /// Custom networking with no valid ENIConfig yet: no ENI.
    NoEniConfig,
}

impl Node {
    /// Where new ENIs go, for the start's log line.
    fn new_eni_subnets(&self, settings: &IpamSettings, placement: &EniPlacement) -> String {
        match placement {
            EniPlacement::Custom(config) => {
                format!(
                    "{} (custom networking, {})",
                    config.subnet_id,
                    config.source()
                )
            }
            EniPlacement::NoEniConfig => {
                "custom networking: the node's ENIConfig's, once there is one".to_owned()
            }
            EniPlacement::NodeSubnets if settings.subnet_discovery => format!(
                "discovered in {} {} ({}), or {}",
                self.vpc_id,
                self.instance.availability_zone,
                subnets::TAG_ROLE_CNI,
                self.primary_eni.subnet_id
            ),
            EniPlacement::NodeSubnets => self.primary_eni.subnet_id.clone(),
        }
    }
}

/// Whose an attached ENI is, as aws-node's `setUnmanagedENIs` decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EniRole {
    /// The instance's primary ENI: always the pool's.
    Primary,
    /// Made for this instance by vpcnet or the VPC CNI (its instance tag),
    /// or tagged `no_manage` with another value than `true`.
    Own,
    /// Someone else's, taken in: `MANAGE_UNTAGGED_ENI` is true.
    Untagged,
    /// Tagged `no_manage=true`: left alone.
    NoManage,
    /// Someone else's, left alone: `MANAGE_UNTAGGED_ENI` is false.
    Foreign,
    /// A trunk (the VPC resource controller's) or EFA-only interface: left
    /// alone.
    NotForAddresses,
}

impl EniRole {
    fn of(eni: &EniInfo, primary: bool, instance_id: &str, manage_untagged: bool) -> Self {
        if primary {
            return Self::Primary;
        }
        if !eni.holds_addresses() {
            return Self::NotForAddresses;
        }
        match eni.tags.get(TAG_NO_MANAGE) {
            Some(_) if eni.no_manage() => Self::NoManage,
            Some(_) => Self::Own,
            None if eni.tags.get(TAG_INSTANCE_ID).map(String::as_str) == Some(instance_id) => {
                Self::Own
            }
            None if manage_untagged => Self::Untagged,
            None => Self::Foreign,
        }
    }

    /// Whether its addresses are the pool's and its link the agent's.
    fn managed(self) -> bool {
        matches!(self, Self::Primary | Self::Own | Self::Untagged)
    }

    /// What the log says of it, when it is not plainly the agent's own.
    fn said(self) -> Option<&'static str> {
        match self {
            Self::Primary => {
                Some("the primary ENI: vpcnet attaches its programs, changes nothing else")
            }
            Self::Own => None,
            Self::Untagged => Some(
                "not made for this instance by vpcnet or the VPC CNI: managed (MANAGE_UNTAGGED_ENI is true)",
            ),
            Self::NoManage => Some("tagged no_manage: left alone"),
            Self::Foreign => Some(
                "not made by vpcnet or the VPC CNI for this instance: left alone (MANAGE_UNTAGGED_ENI is false)",
            ),
            Self::NotForAddresses => Some("a trunk or EFA-only interface: left alone"),
        }
    }
}

/// An attached ENI as the manager tracks it.
#[derive(Clone, Debug)]
struct TrackedEni {
    device_number: u32,
    mac: String,
    attachment_id: Option<String>,
    subnet_id: String,
    subnet: Ipv4Net,
    /// In a subnet subnet discovery excludes (tagged
    /// `kubernetes.io/role/cni=0`, or another cluster's): none of its
    /// addresses go to pods, its idle ones go back to EC2.
    subnet_excluded: bool,
    /// The ENI's own address: never a pod's.
    primary_addr: Option<Ipv4Addr>,
    /// Not the pool's ([`EniRole`]): holds a device, gives no address, its
    /// link is not touched.
    no_manage: bool,
    /// The VPC resource controller's trunk ENI (branch ENIs' VLANs).
    trunk: bool,
    attached_at: Instant,
}

#[derive(Debug)]
struct State {
    datastore: Datastore,
    enis: BTreeMap<String, TrackedEni>,
    /// ENIs to detach (if attached) and delete, retried until done so a
    /// failed call never leaks one.
    draining: BTreeMap<String, Option<String>>,
    /// Prefix delegation hit InsufficientCidrBlocks: grow with addresses.
    prefix_fallback: bool,
    /// Addresses (/32) and prefixes the agent assigned or gave back, and
    /// when: the node's reconcile leaves them alone for [`RECENT_GRACE`].
    recent: BTreeMap<Ipv4Net, Instant>,
    vpc_cidrs: Vec<Ipv4Net>,
}

impl State {
    /// Records addresses or prefixes the agent just assigned or gave back.
    fn recently_changed(&mut self, nets: impl IntoIterator<Item = Ipv4Net>) {
        let now = Instant::now();
        self.recent.extend(nets.into_iter().map(|n| (n, now)));
    }

    /// Whether the agent changed `net` within [`RECENT_GRACE`].
    fn changed_recently(&self, net: Ipv4Net, now: Instant) -> bool {
        self.recent
            .get(&net)
            .is_some_and(|at| now.saturating_duration_since(*at) < RECENT_GRACE)
    }
}

/// Exponential backoff with "equal jitter": half fixed, half random, so
/// agents throttled together do not retry together.
#[derive(Debug)]
struct Backoff {
    base: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    fn next_delay(&mut self) -> Duration {
        let exp = self
            .base
            .saturating_mul(1 << self.failures.min(16))
            .min(self.max);
        self.failures = self.failures.saturating_add(1);
        let half = exp / 2;
        half + half.mul_f64(fastrand::f64())
    }

    fn reset(&mut self) {
        self.failures = 0;
    }
}

/// What growing the pool takes next.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Growth {
    /// `n` more addresses or prefixes on an attached ENI.
    OnEni {
        eni: String,
        n: usize,
        prefixes: bool,
    },
    /// A new ENI at `device` with `n` addresses or prefixes.
    NewEni {
        device: u32,
        n: usize,
        prefixes: bool,
    },
}

/// The address manager. Cheap to clone.
#[derive(Clone)]
pub struct Manager {
    inner: Arc<Inner>,
}

struct Inner {
    cloud: Cloud,
    opts: ManagerOptions,
    node: Node,
    network: Arc<dyn NodeNetwork>,
    state: Mutex<State>,
    /// Wakes the reconcile loop (an ADD found the pool empty, a DEL).
    wake: Notify,
    /// The pool changed: ADDs waiting for an address look again.
    pool_changed: Notify,
    counters: IpamCounters,
    events: std::sync::Mutex<VecDeque<IpamEvent>>,
    /// The events as they happen, for whoever publishes them.
    published_events: tokio::sync::broadcast::Sender<IpamEvent>,
}

/// Whether the node is cordoned, as far as the manager is told.
fn cordoned(opts: &ManagerOptions) -> bool {
    opts.cordoned.as_ref().is_some_and(|c| *c.borrow())
}

/// Where new ENIs go now.
fn placement(opts: &ManagerOptions) -> EniPlacement {
    if !opts.settings.custom_network {
        return EniPlacement::NodeSubnets;
    }
    let config = match &opts.eni_configs {
        Some(configs) => configs.borrow().clone(),
        None => opts.settings.eni_config_override(),
    };
    config.map_or(EniPlacement::NoEniConfig, EniPlacement::Custom)
}

/// Returns when `input` changes; never once its sender is gone (or if
/// there is none).
async fn input_changed<T>(input: &mut Option<watch::Receiver<T>>) {
    if let Some(receiver) = input.as_mut() {
        if receiver.changed().await.is_ok() {
            return;
        }
        *input = None;
    }
    std::future::pending::<()>().await;
}

/// Now, in nanoseconds since the epoch (the checkpoint's clock).
pub fn unix_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

pub use vpcnet_api::vpc_cni::gateway_of;

/// Max pods as the EKS max-pods calculator computes it: every secondary
/// slot of every ENI (16 per slot with prefixes), plus the two host-network
/// pods; with prefixes capped at 110 (250 from 30 vCPUs).
fn default_max_pods(limits: InstanceTypeLimits, max_enis: usize, prefixes: bool) -> usize {
    let slots = max_enis * limits.ips_per_eni.saturating_sub(1);
    if prefixes {
        (slots * IPS_PER_PREFIX + 2).min(if limits.vcpus >= 30 { 250 } else { 110 })
    } else {
        slots + 2
    }
}

impl Manager {
    /// Finds out the node, rebuilds its ENIs, replays the checkpoint and
    /// writes it back: from then on no address a running pod holds is
    /// handed out again.
    pub async fn start(
        cloud: Cloud,
        opts: ManagerOptions,
        network: Arc<dyn NodeNetwork>,
    ) -> Result<Self, ManagerError> {
        let _action =
            crate::introspect::recorder::action(crate::introspect::recorder::ACTION_NODE_INIT);
        let began = Instant::now();
        let started = Self::start_inner(cloud, opts, network).await;
        crate::introspect::recorder::node_initialized(started.is_ok(), began.elapsed());
        started
    }

    async fn start_inner(
        cloud: Cloud,
        opts: ManagerOptions,
        network: Arc<dyn NodeNetwork>,
    ) -> Result<Self, ManagerError> {
        let settings = &opts.settings;
        let instance = cloud.instance_metadata().await?;
        let limits = cloud.instance_type_limits(&instance.instance_type).await?;
        let imds_enis = cloud.imds_enis().await?;
        let primary_eni = imds_enis
            .iter()
            .find(|e| e.mac == instance.primary_mac)
            .cloned()
            .ok_or_else(|| ManagerError::NoPrimaryEni(instance.primary_mac.clone()))?;
        let max_enis = settings
            .max_eni
            .map_or(limits.max_enis, |m| m.min(limits.max_enis));
        let max_pods = settings
            .max_pods
            .unwrap_or_else(|| default_max_pods(limits, max_enis, settings.prefix_delegation));
        let vpc_id = cloud.subnet(&primary_eni.subnet_id).await?.vpc_id;
        if opts.eni_configs.is_none()
            && let Some(custom) = settings.eni_config_override()
        {
            // Fails early on a custom-networking subnet that does not exist.
            cloud.subnet(&custom.subnet_id).await?;
        }
        let eni_tags = managed_eni_tags(
            &instance.instance_id,
            settings.cluster_name.as_deref(),
            &settings.additional_eni_tags,
        );
        let node = Node {
            instance,
            limits,
            max_enis,
            max_pods,
            primary_eni,
            vpc_id,
            eni_tags,
        };
        let placement = placement(&opts);
        info!(
            instance = %node.instance.instance_id,
            instance_type = %node.instance.instance_type,
            max_enis, max_pods,
            ips_per_eni = limits.ips_per_eni,
            eni_subnets = node.new_eni_subnets(settings, &placement),
            prefix_delegation = settings.prefix_delegation,
            "address manager starting"
        );
        let manager = Self {
            inner: Arc::new(Inner {
                cloud,
                node,
                network,
                state: Mutex::new(State {
                    datastore: Datastore::new(opts.settings.ip_cooldown),
                    enis: BTreeMap::new(),
                    draining: BTreeMap::new(),
                    prefix_fallback: false,
                    recent: BTreeMap::new(),
                    vpc_cidrs: Vec::new(),
                }),
                opts,
                wake: Notify::new(),
                pool_changed: Notify::new(),
                counters: IpamCounters::default(),
                events: std::sync::Mutex::new(VecDeque::new()),
                published_events: tokio::sync::broadcast::channel(EVENTS_KEPT).0,
            }),
        };
        manager.rebuild().await?;
        Ok(manager)
    }

    /// The ENIs attached to this instance, from EC2 (tags, prefixes) once
    /// every attachment has settled; this instance's own detached ENIs (a
    /// crash between create and attach, or detach and delete) are deleted.
    async fn rebuild(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let instance_id = &me.node.instance.instance_id;
        let mut enis = Vec::new();
        for eni in me.cloud.instance_enis(instance_id).await? {
            match eni.attachment_status.as_deref() {
                Some("attached") => enis.push(eni),
                // An earlier run was detaching it when it stopped: it will
                // never be attached again. Once detached, the sweep below
                // finds it among this node's detached ENIs and deletes it.
                Some("detaching") => {
                    info!(eni = %eni.id, "waiting for the detach an earlier run started");
                    self.wait_attachment(&eni.id, "detached").await?;
                }
                _ => enis.push(self.wait_attachment(&eni.id, "attached").await?),
            }
        }
        let provisioning = me.opts.settings.provisioning;
        for eni in me.cloud.detached_agent_enis(None).await? {
            if provisioning
                && eni.tags.get(TAG_INSTANCE_ID) == Some(instance_id)
                && !eni.no_manage()
            {
                info!(eni = %eni.id, "deleting this node's detached ENI left by an earlier run");
                me.state.lock().await.draining.insert(eni.id.clone(), None);
            }
        }
        let excluded = self.excluded_subnets().await?;
        for eni in &enis {
            self.track(eni, excluded.contains(&eni.subnet_id)).await?;
        }
        let mut st = me.state.lock().await;
        let path = &me.opts.settings.backing_store;
        if let Some(checkpoint) = Checkpoint::read(path)? {
            let orphans = st.datastore.restore(&checkpoint);
            for orphan in &orphans {
                warn!(
                    container = %orphan.key.container_id,
                    addr = ?orphan.ipv4,
                    "checkpointed address is on no ENI of this node any more"
                );
            }
            info!(
                restored = checkpoint.allocations.len() - orphans.len(),
                orphans = orphans.len(),
                "checkpoint replayed"
            );
        }
        st.datastore.checkpoint().write(path)?;
        Ok(())
    }

    /// Gives a managed ENI, the primary one included, the tags it lacks
    /// (aws-node's, the operator's), as aws-node does when it takes one.
    async fn tag_managed(&self, eni: &EniInfo) -> Result<(), ManagerError> {
        let me = &self.inner;
        if !me.opts.settings.provisioning {
            return Ok(());
        }
        let missing: Vec<(&str, &str)> = me
            .node
            .eni_tags
            .iter()
            .filter(|(key, value)| eni.tags.get(*key) != Some(*value))
            .map(|(key, value)| (key.as_str(), value.as_str()))
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        me.cloud.tag(&eni.id, &missing).await?;
        info!(eni = %eni.id, tags = ?missing, "ENI tagged");
        Ok(())
    }

    /// With subnet discovery, the subnets of the node's VPC and zone whose
    /// ENIs serve no pod.
    async fn excluded_subnets(&self) -> Result<BTreeSet<String>, ManagerError> {
        let me = &self.inner;
        if !me.opts.settings.subnet_discovery {
            return Ok(BTreeSet::new());
        }
        let cluster = me.opts.settings.cluster_name.as_deref();
        let zone = self.zone_subnets().await?;
        Ok(zone
            .iter()
            .filter(|s| subnets::excluded(&zone, &s.id, cluster))
            .map(|s| s.id.clone())
            .collect())
    }

    async fn zone_subnets(&self) -> Result<Vec<SubnetInfo>, CloudError> {
        let node = &self.inner.node;
        self.inner
            .cloud
            .zone_subnets(&node.vpc_id, &node.instance.availability_zone)
            .await
    }

    /// The subnets to try a new ENI in, in order: custom networking's;
    /// with subnet discovery, those tagged for pods (or the primary ENI's,
    /// untagged), most free addresses first; else the primary ENI's, unless
    /// it is tagged `0`. As aws-node, when EC2 cannot list the subnets, the
    /// primary ENI's, if a second look says it is not excluded.
    async fn subnets_for_new_eni(
        &self,
        placement: &EniPlacement,
    ) -> Result<Vec<String>, ManagerError> {
        let me = &self.inner;
        let settings = &me.opts.settings;
        let cluster = settings.cluster_name.as_deref();
        match placement {
            EniPlacement::Custom(config) => return Ok(vec![config.subnet_id.clone()]),
            EniPlacement::NoEniConfig => {
                return Err(ManagerError::NoSubnet(
                    "custom networking has no valid ENIConfig for this node".to_owned(),
                ));
            }
            EniPlacement::NodeSubnets => {}
        }
        let primary = &me.node.primary_eni.subnet_id;
        let primary_unless_excluded = |zone: &[SubnetInfo]| {
            if subnets::excluded(zone, primary, cluster) {
                Err(ManagerError::NoSubnet(format!(
                    "the primary ENI's subnet {primary} is tagged {}=0 (or for other clusters only) and subnet discovery is {}",
                    subnets::TAG_ROLE_CNI,
                    if settings.subnet_discovery {
                        "on"
                    } else {
                        "off"
                    }
                )))
            } else {
                Ok(vec![primary.clone()])
            }
        };
        if !settings.subnet_discovery {
            return match self.zone_subnets().await {
                Ok(zone) => primary_unless_excluded(&zone),
                Err(e) => {
                    warn!(error = %e, subnet = %primary, "cannot tell whether the primary ENI's subnet is excluded: creating the ENI there");
                    Ok(vec![primary.clone()])
                }
            };
        }
        match self.zone_subnets().await {
            Ok(zone) => {
                let found: Vec<String> = subnets::for_new_enis(zone, primary, cluster)
                    .into_iter()
                    .map(|s| s.id)
                    .collect();
                if found.is_empty() {
                    return Err(ManagerError::NoSubnet(format!(
                        "no subnet of {} in {} is tagged {} for this cluster, and the primary ENI's subnet {primary} is tagged 0 (or for other clusters only)",
                        me.node.vpc_id,
                        me.node.instance.availability_zone,
                        subnets::TAG_ROLE_CNI
                    )));
                }
                Ok(found)
            }
            Err(e) => {
                warn!(error = %e, "listing the zone's subnets failed: trying the primary ENI's subnet");
                primary_unless_excluded(&self.zone_subnets().await?)
            }
        }
    }

    /// Takes an attached ENI into the pool (and the node's links);
    /// `subnet_excluded`: its subnet serves no pod.
    async fn track(&self, eni: &EniInfo, subnet_excluded: bool) -> Result<(), ManagerError> {
        let me = &self.inner;
        let device_number = eni.device_index.unwrap_or_default();
        let primary = eni.mac == me.node.instance.primary_mac;
        let subnet = if primary {
            me.node.primary_eni.subnet_cidr
        } else {
            me.cloud.imds_eni(&eni.mac).await?.subnet_cidr
        };
        let role = EniRole::of(
            eni,
            primary,
            &me.node.instance.instance_id,
            me.opts.settings.manage_untagged_eni,
        );
        let left_alone = !role.managed();
        if let Some(said) = role.said() {
            let (interface, manager) = me
                .network
                .interface_owner(&eni.mac)
                .await
                .unwrap_or_else(|| ("(no link)".to_owned(), "unknown".to_owned()));
            info!(eni = %eni.id, %interface, %manager, role = said, "ENI link owner");
        }
        if subnet_excluded && !left_alone {
            info!(
                eni = %eni.id,
                subnet = %eni.subnet_id,
                "ENI in a subnet tagged {}=0 (or for other clusters only): no pod gets its addresses, its idle ones go back to EC2",
                subnets::TAG_ROLE_CNI
            );
        }
        if !left_alone {
            self.tag_managed(eni).await?;
        }
        if !primary && !left_alone {
            let addr = eni.primary_addr.ok_or(CloudError::Incomplete {
                action: "DescribeNetworkInterfaces",
                field: "PrivateIpAddress",
            })?;
            let attached = AttachedEni {
                id: eni.id.clone(),
                mac: eni.mac.clone(),
                device_number,
                addr: Ipv4Net::new(addr, subnet.prefix_len()).unwrap_or(subnet),
                gateway: gateway_of(subnet),
            };
            me.network
                .eni_attached(&attached)
                .await
                .map_err(|e| ManagerError::Network {
                    eni: eni.id.clone(),
                    reason: e.to_string(),
                })?;
        }
        let mut st = me.state.lock().await;
        st.enis.insert(
            eni.id.clone(),
            TrackedEni {
                device_number,
                mac: eni.mac.clone(),
                attachment_id: eni.attachment_id.clone(),
                subnet_id: eni.subnet_id.clone(),
                subnet,
                subnet_excluded,
                primary_addr: eni.primary_addr,
                no_manage: left_alone,
                trunk: eni.is_trunk(),
                attached_at: Instant::now(),
            },
        );
        if left_alone {
            return Ok(());
        }
        let excluded = (primary && me.opts.settings.custom_network) || subnet_excluded;
        st.datastore
            .add_eni(&eni.id, device_number, primary, excluded);
        st.datastore.add_addrs(&eni.id, &eni.secondary_addrs)?;
        for prefix in &eni.prefixes {
            st.datastore.add_prefix(&eni.id, *prefix)?;
        }
        drop(st);
        me.pool_changed.notify_waiters();
        Ok(())
    }

    /// Polls EC2 until the ENI's attachment reaches `state` (EC2 has no
    /// notification for it; aws-node polls too).
    async fn wait_attachment(
        &self,
        eni_id: &str,
        state: &'static str,
    ) -> Result<EniInfo, ManagerError> {
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        let mut delay = Duration::from_millis(100);
        loop {
            match self.inner.cloud.eni(eni_id).await {
                Ok(eni) if eni.attachment_status.as_deref() == Some(state) => return Ok(eni),
                Ok(eni) if state == "detached" && eni.status == "available" => return Ok(eni),
                Ok(_) => {}
                Err(e) if e.is_retryable() => {
                    debug!(eni = eni_id, error = %e, "polling attachment");
                }
                Err(e) => return Err(e.into()),
            }
            if Instant::now() >= deadline {
                return Err(ManagerError::Timeout {
                    eni: eni_id.to_owned(),
                    state,
                    timeout: ATTACH_TIMEOUT,
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    /// Hands the pod an address (the one it holds if the ADD is retried),
    /// written to the checkpoint before it is returned. With the pool empty
    /// it waits up to `assign_wait` for the pool to grow.
    pub async fn assign(
        &self,
        key: &IpamKey,
        metadata: &IpamMetadata,
    ) -> Result<PodAddress, ManagerError> {
        let me = &self.inner;
        let deadline = tokio::time::Instant::now() + me.opts.assign_wait;
        loop {
            let mut changed = pin!(me.pool_changed.notified());
            changed.as_mut().enable();
            // Free addresses ADD could not take are cooling down.
            let cooling;
            {
                let mut st = me.state.lock().await;
                match st
                    .datastore
                    .assign(key, metadata, Instant::now(), unix_ns())
                {
                    Ok(assignment) => {
                        if let Err(e) = st
                            .datastore
                            .checkpoint()
                            .write(&me.opts.settings.backing_store)
                        {
                            // Not on disk: not handed out.
                            // Released as if long ago: it never left, so no cooldown.
                            let long_ago = Instant::now()
                                .checked_sub(me.opts.settings.ip_cooldown)
                                .unwrap_or_else(Instant::now);
                            st.datastore.release(key, long_ago);
                            return Err(e.into());
                        }
                        let eni = &st.enis[&assignment.eni];
                        let reply = PodAddress {
                            addr: assignment.addr,
                            device_number: eni.device_number,
                            eni_mac: eni.mac.clone(),
                            branch: false,
                            subnet: eni.subnet,
                            gateway: gateway_of(eni.subnet),
                            eni_id: assignment.eni,
                        };
                        drop(st);
                        bump(&me.counters.assigned, 1);
                        me.wake.notify_one();
                        return Ok(reply);
                    }
                    Err(DatastoreError::NoFreeAddress) => {
                        cooling = st.datastore.stats(Instant::now()).available() > 0;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if !cooling && !me.opts.settings.provisioning {
                bump(&me.counters.assign_failures, 1);
                return Err(ManagerError::NoAddress(
                    "no free address, and DISABLE_NETWORK_RESOURCE_PROVISIONING leaves adding any to others",
                ));
            }
            if !cooling && self.plan_growth().await.is_none() {
                // Full: every ENI slot and address in use, or max pods.
                bump(&me.counters.assign_failures, 1);
                return Err(ManagerError::NoAddress(
                    "the node is at its ENI, address or max-pods limit",
                ));
            }
            me.wake.notify_one();
            // A cooldown ends without an event: look again shortly.
            let wake_at = if cooling {
                deadline.min(tokio::time::Instant::now() + COOLDOWN_RECHECK)
            } else {
                deadline
            };
            if tokio::time::timeout_at(wake_at, changed).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                bump(&me.counters.assign_failures, 1);
                return Err(ManagerError::NoAddress(
                    "no free address on the node and the pool could not grow in time",
                ));
            }
        }
    }

    /// Releases the pod's address (none held: `None`, not an error), on
    /// disk before the answer.
    pub async fn release(&self, key: &IpamKey) -> Result<Option<Ipv4Addr>, ManagerError> {
        let me = &self.inner;
        let mut st = me.state.lock().await;
        let Some(released) = st.datastore.release(key, Instant::now()) else {
            return Ok(None);
        };
        st.datastore
            .checkpoint()
            .write(&me.opts.settings.backing_store)?;
        drop(st);
        bump(&me.counters.released, 1);
        me.wake.notify_one();
        Ok(Some(released.addr))
    }

    /// The address `key` holds, with the MAC of the ENI that owns it.
    pub async fn assignment(&self, key: &IpamKey) -> Option<(Assignment, String)> {
        let st = self.inner.state.lock().await;
        let assignment = st.datastore.assignment_of(key)?;
        let mac = st
            .enis
            .get(&assignment.eni)
            .map(|e| e.mac.clone())
            .unwrap_or_default();
        Some((assignment, mac))
    }

    /// Every pod's address, with the MAC of the ENI that owns it.
    pub async fn assignments(&self) -> Vec<(AssignedAddr, String)> {
        let st = self.inner.state.lock().await;
        st.datastore
            .assignments()
            .into_iter()
            .map(|a| {
                let mac = st
                    .enis
                    .get(&a.eni)
                    .map(|e| e.mac.clone())
                    .unwrap_or_default();
                (a, mac)
            })
            .collect()
    }

    /// Addresses an ADD could take now (out of their cooldown).
    pub async fn available(&self) -> usize {
        let st = self.inner.state.lock().await;
        let stats = st.datastore.stats(Instant::now());
        stats.available().saturating_sub(stats.cooling_ips)
    }

    /// The MTU pods get (`AWS_VPC_ENI_MTU`).
    #[must_use]
    pub fn eni_mtu(&self) -> u32 {
        self.inner.opts.settings.eni_mtu
    }

    /// The pool's figures, counters and recent events.
    pub async fn status(&self) -> IpamStatus {
        let me = &self.inner;
        let st = me.state.lock().await;
        IpamStatus {
            stats: st.datastore.stats(Instant::now()),
            enis: st.enis.len(),
            max_enis: me.node.max_enis,
            max_pods: me.node.max_pods,
            max_ips: self.max_ips(),
            prefix_fallback: st.prefix_fallback,
            counters: me.counters.snapshot(),
            events: me
                .events
                .lock()
                .map(|e| e.iter().cloned().collect())
                .unwrap_or_default(),
        }
    }

    /// Addresses the node could hold for pods at most: every secondary
    /// slot of every ENI it may attach, 16 per slot with prefixes (ipamd's
    /// `maxIPsPerENI * maxENI`, its `awscni_ip_max`).
    fn max_ips(&self) -> usize {
        let node = &self.inner.node;
        let per_eni = node.limits.ips_per_eni.saturating_sub(1);
        let per_slot = if self.inner.opts.settings.prefix_delegation {
            IPS_PER_PREFIX
        } else {
            1
        };
        node.max_enis * per_eni * per_slot
    }

    /// The node's trunk ENI (security groups for pods): its id and MAC.
    /// One the manager does not know yet (the resource controller attached
    /// it since the node's last reconcile) is looked up in EC2 now, so a
    /// branch pod does not wait for that reconcile. `None`: no trunk.
    pub async fn trunk(&self) -> Result<Option<(String, String)>, ManagerError> {
        let known = |st: &State| {
            st.enis
                .iter()
                .find(|(_, tracked)| tracked.trunk)
                .map(|(id, tracked)| (id.clone(), tracked.mac.clone()))
        };
        if let Some(trunk) = known(&*self.inner.state.lock().await) {
            return Ok(Some(trunk));
        }
        let me = &self.inner;
        let Some(trunk) = me
            .cloud
            .instance_enis(&me.node.instance.instance_id)
            .await?
            .into_iter()
            .find(|e| e.is_trunk() && e.attachment_status.as_deref() == Some("attached"))
        else {
            return Ok(None);
        };
        if !me.state.lock().await.enis.contains_key(&trunk.id) {
            info!(eni = %trunk.id, device = ?trunk.device_index, "trunk ENI found for a branch pod");
            self.track(&trunk, false).await?;
        }
        Ok(Some((trunk.id, trunk.mac)))
    }

    /// The node's ENIs as introspection shows them, in device order: what
    /// each holds and which pod holds which of its addresses.
    pub async fn enis(&self) -> Vec<EniDetail> {
        let me = &self.inner;
        let st = me.state.lock().await;
        let mut assigned: BTreeMap<&str, Vec<AssignedAddr>> = BTreeMap::new();
        let assignments = st.datastore.assignments();
        for a in &assignments {
            assigned.entry(a.eni.as_str()).or_default().push(a.clone());
        }
        let mut enis: Vec<EniDetail> = st
            .enis
            .iter()
            .map(|(id, tracked)| {
                let record = st.datastore.eni(id);
                EniDetail {
                    id: id.clone(),
                    device_number: tracked.device_number,
                    mac: tracked.mac.clone(),
                    attachment_id: tracked.attachment_id.clone(),
                    subnet: tracked.subnet,
                    primary_addr: tracked.primary_addr,
                    primary: tracked.mac == me.node.instance.primary_mac,
                    no_manage: tracked.no_manage,
                    excluded_for_pods: record.is_some_and(|r| r.excluded_for_pods),
                    secondary_addrs: record.map(EniRecord::secondary_addrs).unwrap_or_default(),
                    prefixes: record.map(EniRecord::prefixes).unwrap_or_default(),
                    assigned: assigned.remove(id.as_str()).unwrap_or_default(),
                }
            })
            .collect();
        enis.sort_by_key(|e| e.device_number);
        enis
    }

    fn event(
        &self,
        severity: Severity,
        reason: &'static str,
        action: &'static str,
        message: String,
    ) {
        match severity {
            Severity::Normal => info!(reason, action, "{message}"),
            Severity::Warning => warn!(reason, action, "{message}"),
        }
        let event = IpamEvent {
            time: SystemTime::now(),
            severity,
            reason,
            action,
            message,
        };
        // Nobody listening (no API server) is fine.
        let _ = self.inner.published_events.send(event.clone());
        if let Ok(mut events) = self.inner.events.lock() {
            if events.len() == EVENTS_KEPT {
                events.pop_front();
            }
            events.push_back(event);
        }
    }

    /// The events from now on (a lagging receiver loses the oldest).
    pub fn subscribe_events(&self) -> tokio::sync::broadcast::Receiver<IpamEvent> {
        self.inner.published_events.subscribe()
    }

    /// The events an EC2 error is worth: the ones aws-node raises, and the
    /// ones an operator acts on. Raised when the error's code changes, not
    /// on every retry.
    fn cloud_error_event(&self, error: &CloudError) {
        let Some(action) = error.action() else {
            return;
        };
        if error.code() == Some("UnauthorizedOperation") {
            self.event(
                Severity::Warning,
                "MissingIAMPermissions",
                action,
                format!(
                    "Unauthorized operation: ec2:{action} was refused for missing permissions; \
                     the node's IAM role needs the VPC CNI's policy (AmazonEKS_CNI_Policy)"
                ),
            );
        } else if error.is_subnet_exhausted() {
            self.event(
                Severity::Warning,
                "SubnetExhausted",
                action,
                format!("the subnet has no free address for the pool: {error}"),
            );
        }
    }

    /// Keeps the pool at its targets until the task is dropped.
    pub async fn run(self) {
        let me = &self.inner;
        let mut backoff = Backoff {
            base: me.opts.backoff_base,
            max: me.opts.backoff_max,
            failures: 0,
        };
        let mut next_leak_sweep = Instant::now();
        let mut next_cidr_read = Instant::now();
        let mut next_link_check = Instant::now();
        let mut next_node_reconcile = Instant::now() + me.opts.node_reconcile_interval;
        let provisioning = me.opts.settings.provisioning;
        // The EC2 call and code of the last failed pass: an event is
        // raised when they change, not on every retry.
        let mut last_failure: Option<(Option<&'static str>, Option<String>)> = None;
        // Their changes wake the loop.
        let (mut cordon_changes, mut eni_config_changes) =
            (me.opts.cordoned.clone(), me.opts.eni_configs.clone());
        let mut was_cordoned = false;
        loop {
            self.say_cordon(&mut was_cordoned);
            let mut result = if provisioning {
                self.reconcile().await
            } else {
                Ok(())
            };
            if Instant::now() >= next_node_reconcile {
                let found = self.reconcile_attached().await;
                next_node_reconcile = Instant::now() + me.opts.node_reconcile_interval;
                result = result.and(found);
            }
            if result.is_ok() && Instant::now() >= next_cidr_read {
                result = self.refresh_vpc_cidrs().await;
                next_cidr_read = Instant::now() + me.opts.vpc_cidr_interval;
            }
            if Instant::now() >= next_link_check {
                self.check_links().await;
                next_link_check = Instant::now() + LINK_CHECK_INTERVAL;
            }
            if result.is_ok()
                && provisioning
                && me.opts.settings.leaked_eni_cleanup
                && Instant::now() >= next_leak_sweep
            {
                result = self.sweep_leaked_enis().await;
                // Jittered so the nodes of a cluster do not sweep together.
                next_leak_sweep =
                    Instant::now() + me.opts.leaked_eni_interval.mul_f64(0.5 + fastrand::f64());
            }
            me.pool_changed.notify_waiters();
            let pause = match result {
                Ok(()) => {
                    backoff.reset();
                    last_failure = None;
                    me.opts.reconcile_interval
                }
                Err(e) => {
                    if let ManagerError::Cloud(c) = &e {
                        if c.is_throttling() {
                            bump(&me.counters.ec2_throttled, 1);
                        }
                        if c.is_subnet_exhausted() {
                            bump(&me.counters.subnet_exhausted, 1);
                        }
                        let failure = (c.action(), c.code().map(str::to_owned));
                        if last_failure.as_ref() != Some(&failure) {
                            self.cloud_error_event(c);
                            last_failure = Some(failure);
                        }
                    }
                    bump(&me.counters.ec2_errors, 1);
                    let delay = backoff.next_delay();
                    if e.backs_off() {
                        info!(error = %e, retry_in = ?delay, "pool reconcile backing off");
                    } else {
                        warn!(error = %e, retry_in = ?delay, "pool reconcile failed");
                    }
                    // Backing off: a pod waiting does not cut it short.
                    tokio::time::sleep(delay).await;
                    continue;
                }
            };
            tokio::select! {
                _ = tokio::time::timeout(pause, me.wake.notified()) => {}
                () = input_changed(&mut cordon_changes) => {}
                () = input_changed(&mut eni_config_changes) => {}
            }
        }
    }

    /// One pass: finish draining, give back what excluded subnets' ENIs
    /// hold idle, grow if too low, shrink if too high.
    async fn reconcile(&self) -> Result<(), ManagerError> {
        self.drain().await?;
        self.release_excluded().await?;
        let held = self.cordon_holds();
        if held {
            if self.plan_growth().await.is_some() {
                bump(&self.inner.counters.cordon_held, 1);
            }
        } else {
            // Bounded: each step adds at least one address or an ENI.
            for _ in 0..self.inner.node.max_enis * 2 + 2 {
                let plan = self.plan_growth().await;
                let Some(plan) = plan else { break };
                self.grow(plan).await?;
            }
        }
        self.shrink(held).await
    }

    /// Whether the node is cordoned and `AWS_MANAGE_ENIS_NON_SCHEDULABLE`
    /// is not true: no ENI attached or freed, no address or prefix
    /// assigned (aws-node's `isENIAttachmentAllowed`, `tryFreeENI`).
    fn cordon_holds(&self) -> bool {
        let opts = &self.inner.opts;
        !opts.settings.manage_enis_non_schedulable && cordoned(opts)
    }

    /// Logs (and records) the node's cordon when it changes from `was`.
    fn say_cordon(&self, was: &mut bool) {
        let now = cordoned(&self.inner.opts);
        if now == *was {
            return;
        }
        *was = now;
        let message = match (now, self.inner.opts.settings.manage_enis_non_schedulable) {
            (true, false) => format!(
                "the node is cordoned (its Node is tainted {UNSCHEDULABLE_TAINT}:NoSchedule): \
                 no ENI attached or freed and no address or prefix assigned until it is not \
                 ({ENV_MANAGE_ENIS_NON_SCHEDULABLE} is false); pods get the warm pool's addresses"
            ),
            (true, true) => format!(
                "the node is cordoned (its Node is tainted {UNSCHEDULABLE_TAINT}:NoSchedule): \
                 the pool is managed anyway ({ENV_MANAGE_ENIS_NON_SCHEDULABLE} is true)"
            ),
            (false, _) => "the node is schedulable again: the pool follows its targets".to_owned(),
        };
        self.event(
            Severity::Normal,
            if now {
                "NodeCordoned"
            } else {
                "NodeSchedulable"
            },
            "NodeWatch",
            message,
        );
    }

    /// The links of the pool's secondary ENIs as `track` set them up, every
    /// [`LINK_CHECK_INTERVAL`]. A failure is logged: the next check tries
    /// again.
    async fn check_links(&self) {
        let me = &self.inner;
        let owned: Vec<AttachedEni> = {
            let st = me.state.lock().await;
            st.enis
                .iter()
                .filter(|(_, e)| !e.no_manage && e.mac != me.node.instance.primary_mac)
                .filter(|(id, _)| !st.draining.contains_key(*id))
                .filter_map(|(id, e)| {
                    Some(AttachedEni {
                        id: id.clone(),
                        mac: e.mac.clone(),
                        device_number: e.device_number,
                        addr: Ipv4Net::new(e.primary_addr?, e.subnet.prefix_len()).ok()?,
                        gateway: gateway_of(e.subnet),
                    })
                })
                .collect()
        };
        for eni in &owned {
            match me.network.eni_link_check(eni).await {
                Ok(changed) if !changed.is_empty() => {
                    bump(&me.counters.links_restored, 1);
                }
                Ok(_) => {}
                Err(e) => warn!(eni = %eni.id, error = %e, "checking the ENI's link"),
            }
        }
    }

    /// The targets in force: prefixes unless they fell back.
    fn targets(&self, prefixes: bool) -> PoolTargets {
        let node = &self.inner.node;
        let mut settings = self.inner.opts.settings.clone();
        settings.prefix_delegation = prefixes;
        settings.pool_targets(node.limits.ips_per_eni.saturating_sub(1), node.max_pods)
    }

    async fn plan_growth(&self) -> Option<Growth> {
        let me = &self.inner;
        let st = me.state.lock().await;
        let prefixes = me.opts.settings.prefix_delegation && !st.prefix_fallback;
        let stats = st.datastore.stats(Instant::now());
        // Judged by the configured mode: after a fallback, addresses fill
        // the same targets prefixes would have.
        let configured = self.targets(me.opts.settings.prefix_delegation);
        if !configured.pool_too_low(&stats) {
            return None;
        }
        let unit = if prefixes { IPS_PER_PREFIX } else { 1 };
        let room = me
            .node
            .max_pods
            .saturating_sub(stats.total_ips)
            .div_ceil(unit);
        let wanted = match self.targets(prefixes).target_state(&stats) {
            Some(target) => target.short,
            None if me.opts.settings.prefix_delegation => {
                let warm = configured.warm_prefix_target.max(1);
                if prefixes {
                    warm.saturating_sub(stats.free_prefixes).max(1)
                } else {
                    (warm * IPS_PER_PREFIX)
                        .saturating_sub(stats.available())
                        .max(1)
                }
            }
            // WARM_ENI_TARGET: fill the ENI, as aws-node does.
            None => usize::MAX,
        };
        let wanted = wanted.min(room).max(1);
        let slots = me.node.limits.ips_per_eni;
        let mut pod_enis: Vec<(&String, &EniRecord)> = st
            .datastore
            .enis()
            .filter(|(_, e)| !e.excluded_for_pods && e.slots_used() < slots)
            .collect();
        pod_enis.sort_by_key(|(_, e)| e.device_number);
        if let Some((id, eni)) = pod_enis.first() {
            return Some(Growth::OnEni {
                eni: (*id).clone(),
                n: wanted.min(slots - eni.slots_used()),
                prefixes,
            });
        }
        let used: BTreeSet<u32> = st.enis.values().map(|e| e.device_number).collect();
        let attached = st.enis.len() + st.draining.len();
        if attached >= me.node.max_enis {
            debug!("pool too low but every ENI slot and address is in use");
            return None;
        }
        if placement(&me.opts) == EniPlacement::NoEniConfig {
            // Said by the ENIConfig's follower.
            debug!("pool too low but custom networking has no ENIConfig to make an ENI from");
            return None;
        }
        let device = (1..=u32::MAX).find(|d| !used.contains(d)).unwrap_or(1);
        Some(Growth::NewEni {
            device,
            n: wanted.min(slots.saturating_sub(1)),
            prefixes,
        })
    }

    async fn grow(&self, plan: Growth) -> Result<(), ManagerError> {
        let _action =
            crate::introspect::recorder::action(crate::introspect::recorder::ACTION_INCREASE_POOL);
        let me = &self.inner;
        let (result, prefixes) = match &plan {
            Growth::OnEni { eni, n, prefixes } => {
                (self.add_to_eni(eni, *n, *prefixes).await, *prefixes)
            }
            Growth::NewEni {
                device,
                n,
                prefixes,
            } => (self.new_eni(*device, *n, *prefixes).await, *prefixes),
        };
        match result {
            Err(ManagerError::Cloud(e)) if prefixes && e.is_insufficient_cidr_blocks() => {
                let subnet = {
                    let mut st = me.state.lock().await;
                    st.prefix_fallback = true;
                    match &plan {
                        Growth::OnEni { eni, .. } => st
                            .enis
                            .get(eni)
                            .map_or_else(String::new, |e| format!("subnet {}", e.subnet_id)),
                        Growth::NewEni { .. } => "every subnet tried for a new ENI".to_owned(),
                    }
                };
                bump(&me.counters.prefix_fallbacks, 1);
                self.event(
                    Severity::Warning,
                    "PrefixDelegationFallback",
                    if matches!(plan, Growth::NewEni { .. }) {
                        "CreateNetworkInterface"
                    } else {
                        "AssignPrivateIpAddresses"
                    },
                    format!(
                        "{subnet} has no free /28 block (InsufficientCidrBlocks): \
                         assigning single secondary addresses instead"
                    ),
                );
                Ok(())
            }
            Err(ManagerError::Cloud(e)) if e.code() == Some("PrivateIpAddressLimitExceeded") => {
                // Our count of the ENI's slots is behind EC2's: re-read it.
                if let Growth::OnEni { eni, .. } = &plan {
                    let info = me.cloud.eni(eni).await?;
                    let mut st = me.state.lock().await;
                    st.datastore.add_addrs(eni, &info.secondary_addrs)?;
                    for p in &info.prefixes {
                        st.datastore.add_prefix(eni, *p)?;
                    }
                }
                Err(ManagerError::Cloud(e))
            }
            other => other,
        }
    }

    async fn add_to_eni(&self, eni: &str, n: usize, prefixes: bool) -> Result<(), ManagerError> {
        let me = &self.inner;
        if prefixes {
            let got = me.cloud.assign_prefixes(eni, n).await?;
            let mut st = me.state.lock().await;
            for p in &got {
                st.datastore.add_prefix(eni, *p)?;
            }
            st.recently_changed(got.iter().copied());
            bump(&me.counters.prefixes_allocated, got.len());
            info!(eni, prefixes = ?got, "prefixes assigned");
        } else {
            let mut got = me.cloud.assign_addrs(eni, n).await?;
            let mut st = me.state.lock().await;
            // EC2 answers with the new addresses; an EC2-alike (moto)
            // answers with all of them, the ENI's own among them.
            let primary = st.enis.get(eni).and_then(|e| e.primary_addr);
            got.retain(|a| Some(*a) != primary);
            st.datastore.add_addrs(eni, &got)?;
            st.recently_changed(got.iter().map(|a| Ipv4Net::from(*a)));
            drop(st);
            bump(&me.counters.addrs_allocated, got.len());
            info!(eni, addrs = got.len(), "secondary addresses assigned");
        }
        me.pool_changed.notify_waiters();
        Ok(())
    }

    /// Creates, attaches and sets up an ENI. If anything fails after the
    /// create, the ENI is drained (detached, deleted) on later passes.
    async fn new_eni(&self, device: u32, n: usize, prefixes: bool) -> Result<(), ManagerError> {
        let me = &self.inner;
        let node = &me.node;
        // The config in force now, for the whole of this ENI.
        let placement = placement(&me.opts);
        // Custom networking's subnet may be tagged 0 too; a discovered one
        // is not.
        let (excluded, security_groups) = match &placement {
            EniPlacement::Custom(config) => (
                self.excluded_subnets().await?.contains(&config.subnet_id),
                if config.security_groups.is_empty() {
                    node.primary_eni.security_groups.clone()
                } else {
                    config.security_groups.clone()
                },
            ),
            // Discovered subnets' ENIs get the primary ENI's groups, as
            // aws-node gives them.
            _ => (false, node.primary_eni.security_groups.clone()),
        };
        // Tried in order until EC2 makes one, as aws-node does.
        let mut created = Err(ManagerError::NoSubnet("none to try".to_owned()));
        for subnet_id in self.subnets_for_new_eni(&placement).await? {
            created = me
                .cloud
                .create_eni(&NewEni {
                    subnet_id: &subnet_id,
                    security_groups: &security_groups,
                    instance_id: &node.instance.instance_id,
                    tags: &node.eni_tags,
                    secondary_addrs: if prefixes { 0 } else { n },
                    prefixes: if prefixes { n } else { 0 },
                })
                .await
                .map_err(ManagerError::from);
            match &created {
                Ok(_) => break,
                Err(e) => info!(subnet = %subnet_id, error = %e, "no ENI in this subnet"),
            }
        }
        let created = created?;
        info!(eni = %created.id, device, subnet = %created.subnet_id, "ENI created");
        let attachment = match me
            .cloud
            .attach_eni(&created.id, &node.instance.instance_id, device)
            .await
        {
            Ok(id) => id,
            Err(e) => {
                // Maybe attached anyway (the answer was lost): drain looks.
                me.state
                    .lock()
                    .await
                    .draining
                    .insert(created.id.clone(), None);
                return Err(e.into());
            }
        };
        let attached = match self.wait_attachment(&created.id, "attached").await {
            Ok(eni) => eni,
            Err(e) => {
                me.state
                    .lock()
                    .await
                    .draining
                    .insert(created.id.clone(), Some(attachment));
                return Err(e);
            }
        };
        if let Err(e) = self.track(&attached, excluded).await {
            let mut st = me.state.lock().await;
            st.enis.remove(&created.id);
            let _ = st.datastore.remove_eni(&created.id);
            st.draining.insert(created.id.clone(), Some(attachment));
            return Err(e);
        }
        me.state.lock().await.recently_changed(
            attached
                .secondary_addrs
                .iter()
                .map(|a| Ipv4Net::from(*a))
                .chain(attached.prefixes.iter().copied()),
        );
        bump(&me.counters.enis_created, 1);
        let (addrs, pfx) = (attached.secondary_addrs.len(), attached.prefixes.len());
        bump(&me.counters.addrs_allocated, addrs);
        bump(&me.counters.prefixes_allocated, pfx);
        info!(eni = %created.id, device, addrs, prefixes = pfx, "ENI attached and set up");
        Ok(())
    }

    /// Gives back what the targets do not need: idle addresses or prefixes
    /// (highest ENIs first), then a whole ENI when that is safe.
    /// `held`: the node is cordoned, no ENI is freed.
    async fn shrink(&self, held: bool) -> Result<(), ManagerError> {
        let _action =
            crate::introspect::recorder::action(crate::introspect::recorder::ACTION_DECREASE_POOL);
        let me = &self.inner;
        let now = Instant::now();
        let cooldown = me.opts.settings.ip_cooldown;
        let (release, eni_to_free) = {
            let mut st = me.state.lock().await;
            let prefixes = me.opts.settings.prefix_delegation;
            let targets = self.targets(prefixes);
            let stats = st.datastore.stats(now);
            let mut release: Option<(String, Vec<Ipv4Addr>, Vec<Ipv4Net>)> = None;
            if targets.pool_too_high(&stats) {
                let over = targets.target_state(&stats).map_or_else(
                    || {
                        stats
                            .free_prefixes
                            .saturating_sub(targets.warm_prefix_target)
                    },
                    |s| s.over,
                );
                let mut enis: Vec<(&String, &EniRecord)> = st
                    .datastore
                    .enis()
                    .filter(|(_, e)| !e.excluded_for_pods)
                    .collect();
                enis.sort_by_key(|(_, e)| std::cmp::Reverse(e.device_number));
                for (id, eni) in enis {
                    let (addrs, pfx) = if prefixes {
                        (Vec::new(), eni.idle_prefixes(now, cooldown))
                    } else {
                        (eni.idle_secondary_addrs(now, cooldown), Vec::new())
                    };
                    if !addrs.is_empty() || !pfx.is_empty() {
                        let addrs: Vec<_> = addrs.into_iter().take(over).collect();
                        let pfx: Vec<_> = pfx.into_iter().take(over).collect();
                        release = Some((id.clone(), addrs, pfx));
                        break;
                    }
                }
            }
            if let Some((eni, addrs, pfx)) = &release {
                // Out of the datastore first: no pod may get them meanwhile.
                for a in addrs {
                    st.datastore.remove_addr(eni, *a)?;
                }
                for p in pfx {
                    st.datastore.remove_prefix(eni, *p)?;
                }
            }
            let eni_to_free = if release.is_none() && !held {
                self.freeable_eni(&mut st, now)
            } else {
                None
            };
            (release, eni_to_free)
        };
        if let Some((eni, addrs, pfx)) = release {
            self.return_to_ec2(&eni, &addrs, &pfx).await?;
        }
        if eni_to_free.is_some() {
            self.drain().await?;
        }
        Ok(())
    }

    /// Gives EC2 back addresses or prefixes already out of the datastore;
    /// if EC2 refuses, they go back into the pool.
    async fn return_to_ec2(
        &self,
        eni: &str,
        addrs: &[Ipv4Addr],
        pfx: &[Ipv4Net],
    ) -> Result<(), ManagerError> {
        let me = &self.inner;
        let result = if addrs.is_empty() {
            me.cloud.unassign_prefixes(eni, pfx).await
        } else {
            me.cloud.unassign_addrs(eni, addrs).await
        };
        if let Err(e) = result {
            // Still the ENI's: back into the pool.
            let mut st = me.state.lock().await;
            st.datastore.add_addrs(eni, addrs)?;
            for p in pfx {
                st.datastore.add_prefix(eni, *p)?;
            }
            return Err(e.into());
        }
        me.state.lock().await.recently_changed(
            addrs
                .iter()
                .map(|a| Ipv4Net::from(*a))
                .chain(pfx.iter().copied()),
        );
        bump(&me.counters.addrs_freed, addrs.len());
        bump(&me.counters.prefixes_freed, pfx.len());
        info!(
            eni,
            addrs = addrs.len(),
            prefixes = pfx.len(),
            "returned to EC2"
        );
        Ok(())
    }

    /// Gives back the idle addresses and prefixes of ENIs in excluded
    /// subnets, which no pod may get (aws-node does so at start; here
    /// also for those pods release later).
    async fn release_excluded(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let now = Instant::now();
        let cooldown = me.opts.settings.ip_cooldown;
        // One ENI a pass, as `shrink` does.
        let release = {
            let mut st = me.state.lock().await;
            let found = st
                .enis
                .iter()
                .filter(|(_, e)| e.subnet_excluded && !e.no_manage)
                .find_map(|(id, _)| {
                    let record = st.datastore.eni(id)?;
                    let addrs = record.idle_secondary_addrs(now, cooldown);
                    let pfx = record.idle_prefixes(now, cooldown);
                    (!addrs.is_empty() || !pfx.is_empty()).then(|| (id.clone(), addrs, pfx))
                });
            if let Some((eni, addrs, pfx)) = &found {
                for a in addrs {
                    st.datastore.remove_addr(eni, *a)?;
                }
                for p in pfx {
                    st.datastore.remove_prefix(eni, *p)?;
                }
            }
            found
        };
        let Some((eni, addrs, pfx)) = release else {
            return Ok(());
        };
        // EC2 takes addresses or prefixes in one call, not both.
        if !pfx.is_empty()
            && let Err(e) = self.return_to_ec2(&eni, &[], &pfx).await
        {
            me.state.lock().await.datastore.add_addrs(&eni, &addrs)?;
            return Err(e);
        }
        if !addrs.is_empty() {
            self.return_to_ec2(&eni, &addrs, &[]).await?;
        }
        Ok(())
    }

    /// Picks an ENI to free, if one can go without the pool falling below
    /// its targets, and moves it to `draining`.
    fn freeable_eni(&self, st: &mut State, now: Instant) -> Option<String> {
        let me = &self.inner;
        let targets = self.targets(me.opts.settings.prefix_delegation);
        let stats = st.datastore.stats(now);
        let cooldown = me.opts.settings.ip_cooldown;
        let mut candidates: Vec<(&String, &EniRecord)> = st
            .datastore
            .enis()
            .filter(|(id, e)| {
                let tracked = &st.enis[*id];
                !e.primary
                    && !tracked.no_manage
                    && e.assigned() == 0
                    && e.idle_secondary_addrs(now, cooldown).len()
                        + e.idle_prefixes(now, cooldown).len() * IPS_PER_PREFIX
                        == e.total()
                    && now.saturating_duration_since(tracked.attached_at)
                        >= me.opts.min_eni_lifetime
            })
            .collect();
        candidates.sort_by_key(|(_, e)| std::cmp::Reverse(e.device_number));
        let freeable_exists = !candidates.is_empty();
        if !targets.should_remove_extra_enis(&stats, freeable_exists) {
            return None;
        }
        let (id, eni) = candidates.first()?;
        let after = PoolStats {
            total_ips: stats.total_ips - eni.total(),
            total_prefixes: stats.total_prefixes - eni.prefixes().len(),
            free_prefixes: stats.free_prefixes - eni.prefixes().len(),
            ..stats
        };
        if targets.pool_too_low(&after) {
            return None;
        }
        let id = (*id).clone();
        st.datastore.remove_eni(&id).ok()?;
        let tracked = st.enis.remove(&id)?;
        st.draining.insert(id.clone(), tracked.attachment_id);
        info!(eni = %id, "freeing an ENI the pool does not need");
        Some(id)
    }

    /// Detaches and deletes every ENI in `draining`; what fails stays for
    /// the next pass.
    async fn drain(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let draining: Vec<(String, Option<String>)> = me
            .state
            .lock()
            .await
            .draining
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (eni, attachment) in draining {
            let current = match me.cloud.eni(&eni).await {
                Ok(info) => info,
                Err(CloudError::Incomplete { .. }) => {
                    // Gone already.
                    me.state.lock().await.draining.remove(&eni);
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(attachment) = current.attachment_id.clone().or(attachment)
                && current.status != "available"
            {
                me.cloud.detach_eni(&attachment).await?;
                self.wait_attachment(&eni, "detached").await?;
            }
            match me.cloud.delete_eni(&eni).await {
                Ok(()) => {}
                Err(e) if e.code() == Some("InvalidNetworkInterfaceID.NotFound") => {}
                Err(e) => return Err(e.into()),
            }
            me.state.lock().await.draining.remove(&eni);
            bump(&me.counters.enis_deleted, 1);
            info!(eni, "ENI detached and deleted");
        }
        Ok(())
    }

    /// Deletes detached ENIs made by an agent (tagged with an instance id)
    /// once they are older than the grace period; tags untagged ones with
    /// `createdAt` first, as aws-node does.
    async fn sweep_leaked_enis(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let cluster = me.opts.settings.cluster_name.as_deref();
        for eni in me.cloud.detached_agent_enis(cluster).await? {
            if eni.no_manage() || me.state.lock().await.draining.contains_key(&eni.id) {
                continue;
            }
            let Some(created) = eni.tags.get(TAG_CREATED_AT) else {
                me.cloud
                    .tag(&eni.id, &[(TAG_CREATED_AT, &time_now_rfc3339())])
                    .await?;
                continue;
            };
            let age = aws_sdk_ec2::primitives::DateTime::from_str(
                created,
                aws_sdk_ec2::primitives::DateTimeFormat::DateTime,
            )
            .ok()
            .and_then(|t| SystemTime::try_from(t).ok())
            .and_then(|t| SystemTime::now().duration_since(t).ok());
            if age.is_some_and(|age| age >= LEAKED_ENI_GRACE) {
                match me.cloud.delete_eni(&eni.id).await {
                    Ok(()) => {
                        bump(&me.counters.leaked_enis_deleted, 1);
                        self.event(
                            Severity::Normal,
                            "LeakedENIDeleted",
                            "DeleteNetworkInterface",
                            format!("deleted leaked ENI {}", eni.id),
                        );
                    }
                    // Another node's sweep got it first.
                    Err(e) if e.code() == Some("InvalidNetworkInterfaceID.NotFound") => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }

    /// Brings the pool in line with what is attached to the instance,
    /// whoever attached or assigned it (aws-node's node IP pool
    /// reconcile): ENIs attached or detached, addresses and prefixes
    /// assigned or unassigned by someone else. IMDS says whether anything
    /// differs; EC2, the authority, then says what. The only way to the
    /// pool with `DISABLE_NETWORK_RESOURCE_PROVISIONING`.
    async fn reconcile_attached(&self) -> Result<(), ManagerError> {
        let _action =
            crate::introspect::recorder::action(crate::introspect::recorder::ACTION_NODE_RECONCILE);
        let me = &self.inner;
        bump(&me.counters.node_reconciles, 1);
        let imds = me.cloud.imds_enis().await?;
        if !self.differs_from(&imds).await {
            return Ok(());
        }
        let attached: Vec<EniInfo> = me
            .cloud
            .instance_enis(&me.node.instance.instance_id)
            .await?
            .into_iter()
            .filter(|e| e.attachment_status.as_deref() == Some("attached"))
            .collect();
        let (new, gone): (Vec<EniInfo>, Vec<String>) = {
            let st = me.state.lock().await;
            (
                attached
                    .iter()
                    .filter(|e| !st.enis.contains_key(&e.id) && !st.draining.contains_key(&e.id))
                    .cloned()
                    .collect(),
                st.enis
                    .keys()
                    .filter(|id| !attached.iter().any(|e| &e.id == *id))
                    .cloned()
                    .collect(),
            )
        };
        for id in gone {
            self.forget_eni(&id).await?;
        }
        if !new.is_empty() {
            let excluded = self.excluded_subnets().await?;
            for eni in &new {
                info!(eni = %eni.id, device = ?eni.device_index, "ENI attached by someone else");
                self.track(eni, excluded.contains(&eni.subnet_id)).await?;
                bump(&me.counters.enis_found, 1);
            }
        }
        for eni in &attached {
            self.reconcile_addrs(eni).await?;
        }
        me.pool_changed.notify_waiters();
        Ok(())
    }

    /// Whether IMDS shows other ENIs, addresses or prefixes than the pool
    /// holds.
    async fn differs_from(&self, imds: &[ImdsEni]) -> bool {
        let st = self.inner.state.lock().await;
        if imds.len() != st.enis.len() {
            return true;
        }
        imds.iter().any(|listed| {
            let Some((id, tracked)) = st.enis.iter().find(|(_, t)| t.mac == listed.mac) else {
                return true;
            };
            let Some(record) = st.datastore.eni(id) else {
                // Left alone: only its being there matters.
                return false;
            };
            let addrs: BTreeSet<Ipv4Addr> = listed
                .local_ipv4s
                .iter()
                .copied()
                .filter(|a| Some(*a) != tracked.primary_addr)
                .collect();
            let prefixes: BTreeSet<Ipv4Net> = listed.prefixes.iter().copied().collect();
            addrs != record.secondary_addrs().into_iter().collect()
                || prefixes != record.prefixes().into_iter().collect()
        })
    }

    /// Takes an ENI detached by someone else out of the pool; the pods that
    /// held its addresses lost them.
    async fn forget_eni(&self, id: &str) -> Result<(), ManagerError> {
        let me = &self.inner;
        let mut st = me.state.lock().await;
        if st.enis.remove(id).is_none() {
            return Ok(());
        }
        let lost = st.datastore.forget_eni(id);
        st.datastore
            .checkpoint()
            .write(&me.opts.settings.backing_store)?;
        drop(st);
        for (key, addr) in &lost {
            warn!(eni = id, %addr, pod = %key.container_id, "the pod's address left with its ENI");
        }
        bump(&me.counters.enis_lost, 1);
        self.event(
            Severity::Warning,
            "ENIDetached",
            "NodeReconcile",
            format!(
                "ENI {id} was detached by someone else: out of the pool ({} pods held its addresses)",
                lost.len()
            ),
        );
        Ok(())
    }

    /// Takes into the pool the addresses and prefixes EC2 lists on a
    /// managed ENI that the pool lacks, and out of it those EC2 no longer
    /// lists; what the agent itself changed lately is left as it is.
    async fn reconcile_addrs(&self, eni: &EniInfo) -> Result<(), ManagerError> {
        let me = &self.inner;
        let now = Instant::now();
        let mut st = me.state.lock().await;
        st.recent
            .retain(|_, at| now.saturating_duration_since(*at) < RECENT_GRACE);
        let Some(record) = st.datastore.eni(&eni.id) else {
            return Ok(());
        };
        let pooled_addrs: BTreeSet<Ipv4Addr> = record.secondary_addrs().into_iter().collect();
        let pooled_prefixes: BTreeSet<Ipv4Net> = record.prefixes().into_iter().collect();
        let listed_addrs: BTreeSet<Ipv4Addr> = eni
            .secondary_addrs
            .iter()
            .copied()
            .filter(|a| Some(*a) != eni.primary_addr)
            .collect();
        let listed_prefixes: BTreeSet<Ipv4Net> = eni.prefixes.iter().copied().collect();
        let settled_addr = |a: &&Ipv4Addr| !st.changed_recently(Ipv4Net::from(**a), now);
        let settled_prefix = |p: &&Ipv4Net| !st.changed_recently(**p, now);
        let found_addrs: Vec<Ipv4Addr> = listed_addrs
            .difference(&pooled_addrs)
            .filter(settled_addr)
            .copied()
            .collect();
        let found_prefixes: Vec<Ipv4Net> = listed_prefixes
            .difference(&pooled_prefixes)
            .filter(settled_prefix)
            .copied()
            .collect();
        let lost_addrs: Vec<Ipv4Addr> = pooled_addrs
            .difference(&listed_addrs)
            .filter(settled_addr)
            .copied()
            .collect();
        let lost_prefixes: Vec<Ipv4Net> = pooled_prefixes
            .difference(&listed_prefixes)
            .filter(settled_prefix)
            .copied()
            .collect();
        if found_addrs.is_empty()
            && found_prefixes.is_empty()
            && lost_addrs.is_empty()
            && lost_prefixes.is_empty()
        {
            return Ok(());
        }
        st.datastore.add_addrs(&eni.id, &found_addrs)?;
        for p in &found_prefixes {
            st.datastore.add_prefix(&eni.id, *p)?;
        }
        let held = st
            .datastore
            .forget_addrs(&eni.id, &lost_addrs, &lost_prefixes)?;
        if !held.is_empty() {
            st.datastore
                .checkpoint()
                .write(&me.opts.settings.backing_store)?;
        }
        drop(st);
        for (key, addr) in &held {
            warn!(eni = %eni.id, %addr, pod = %key.container_id, "the pod's address was unassigned by someone else");
        }
        let per_prefix = IPS_PER_PREFIX;
        bump(
            &me.counters.cidrs_found,
            found_addrs.len() + found_prefixes.len(),
        );
        bump(
            &me.counters.cidrs_lost,
            lost_addrs.len() + lost_prefixes.len(),
        );
        bump(
            &me.counters.addrs_found,
            found_addrs.len() + found_prefixes.len() * per_prefix,
        );
        bump(
            &me.counters.addrs_lost,
            lost_addrs.len() + lost_prefixes.len() * per_prefix,
        );
        info!(
            eni = %eni.id,
            found = ?found_addrs,
            found_prefixes = ?found_prefixes,
            lost = ?lost_addrs,
            lost_prefixes = ?lost_prefixes,
            "addresses assigned or unassigned by someone else"
        );
        Ok(())
    }

    /// Re-reads the VPC's CIDRs from IMDS; a change reaches the datapath.
    async fn refresh_vpc_cidrs(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let mut cidrs = me.cloud.vpc_cidrs(&me.node.instance.primary_mac).await?;
        cidrs.sort();
        let mut st = me.state.lock().await;
        if st.vpc_cidrs == cidrs {
            return Ok(());
        }
        me.network
            .vpc_cidrs_changed(&cidrs)
            .map_err(|e| ManagerError::Network {
                eni: me.node.primary_eni.interface_id.clone(),
                reason: e.to_string(),
            })?;
        if !st.vpc_cidrs.is_empty() {
            info!(?cidrs, "the VPC's CIDRs changed");
        }
        st.vpc_cidrs = cidrs;
        Ok(())
    }
}

/// The pool as `IpamStatus` shows it.
#[derive(Clone, Debug)]
pub struct IpamStatus {
    pub stats: PoolStats,
    pub enis: usize,
    pub max_enis: usize,
    pub max_pods: usize,
    /// Addresses the node could hold for pods at most (`awscni_ip_max`).
    pub max_ips: usize,
    pub prefix_fallback: bool,
    pub counters: Vec<(&'static str, u64)>,
    pub events: Vec<IpamEvent>,
}

/// One attached ENI as introspection shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EniDetail {
    pub id: String,
    pub device_number: u32,
    pub mac: String,
    pub attachment_id: Option<String>,
    pub subnet: Ipv4Net,
    /// The ENI's own address: never a pod's.
    pub primary_addr: Option<Ipv4Addr>,
    /// The instance's primary ENI.
    pub primary: bool,
    /// Tagged `no_manage`: none of its addresses go to pods.
    pub no_manage: bool,
    /// Custom networking's primary ENI: in the pool, serving no pod.
    pub excluded_for_pods: bool,
    pub secondary_addrs: Vec<Ipv4Addr>,
    pub prefixes: Vec<Ipv4Net>,
    /// Its addresses held by pods.
    pub assigned: Vec<AssignedAddr>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_to_its_cap_with_jitter() {
        let mut b = Backoff {
            base: Duration::from_millis(100),
            max: Duration::from_secs(5),
            failures: 0,
        };
        let delays: Vec<Duration> = (0..12).map(|_| b.next_delay()).collect();
        for (i, d) in delays.iter().enumerate() {
            let full = Duration::from_millis(100)
                .saturating_mul(1 << i)
                .min(Duration::from_secs(5));
            assert!(
                *d >= full / 2 && *d <= full,
                "attempt {i}: {d:?} not in [{:?}, {full:?}]",
                full / 2
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn max_pods_as_the_eks_calculator() {
        let m5_large = InstanceTypeLimits {
            max_enis: 3,
            ips_per_eni: 10,
            vcpus: 2,
        };
        assert_eq!(default_max_pods(m5_large, 3, false), 29);
        assert_eq!(default_max_pods(m5_large, 3, true), 110);
        let t3_medium = InstanceTypeLimits {
            max_enis: 3,
            ips_per_eni: 6,
            vcpus: 2,
        };
        assert_eq!(default_max_pods(t3_medium, 3, false), 17);
        let c5_18xl = InstanceTypeLimits {
            max_enis: 15,
            ips_per_eni: 50,
            vcpus: 72,
        };
        assert_eq!(default_max_pods(c5_18xl, 15, false), 737);
        assert_eq!(default_max_pods(c5_18xl, 15, true), 250);
    }
}
