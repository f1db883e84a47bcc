//! The address manager: it rebuilds the node's ENIs from IMDS and EC2 and
//! replays the checkpoint at start, hands addresses to pods (on disk before
//! the answer), and keeps the warm pool between the VPC CNI's targets by
//! assigning and releasing addresses, /28 prefixes and whole ENIs.
//!
//! Every EC2 call happens without the state lock held, so pods get
//! addresses while the pool grows. One task (the reconcile loop) changes the
//! pool; calls that fail with throttling, server errors or an exhausted
//! subnet back off exponentially with jitter.
//!
//! This module holds the manager, its options, errors and public types; each
//! job is a child with its own `impl Manager`:
//! - [`start`]: finding out the node, adopting its ENIs, the checkpoint;
//! - [`assign`]: pods' addresses, the pool's figures, the trunk ENI;
//! - [`run`]: the loop that schedules the jobs below and backs off;
//! - [`grow`] and [`shrink`]: the pool toward its targets (decided in
//!   [`super::pool`]);
//! - [`leaks`]: the leaked-ENI sweep;
//! - [`node_sync`]: what IMDS and EC2 say is attached, the VPC's CIDRs;
//! - [`events`]: what operators hear about;
//! - [`network`]: what the node does with the manager's ENIs.

mod assign;
mod events;
mod grow;
mod leaks;
mod network;
mod node_sync;
mod run;
mod shrink;
mod start;

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use ipnet::Ipv4Net;
use tokio::sync::{Mutex, Notify, watch};

use self::events::Events;
pub use self::{
    leaks::LEAKED_ENI_GRACE,
    network::{AttachedEni, NetworkFuture, NetworkResult, NodeNetwork},
};
use super::{
    checkpoint::CheckpointError,
    datastore::{AssignedAddr, Datastore, DatastoreError},
    pool::{EniSnapshot, PoolStats},
    settings::{EniConfig, IpamSettings},
    subnets::{EniPlacement, SubnetChoice, SubnetError},
};
use crate::cloud::{Cloud, CloudError, ImdsEni, InstanceMetadata, InstanceTypeLimits};

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
    /// No address within the ADD's wait, but the pool can still grow (it
    /// is growing, backing off EC2's errors, its free addresses are
    /// cooling down, or an ENI it gave back awaits deletion): the runtime's
    /// next try may get one.
    #[error("failed to assign an IP address to container: {0}")]
    NoAddressYet(&'static str),
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

impl From<SubnetError> for ManagerError {
    fn from(e: SubnetError) -> Self {
        match e {
            SubnetError::Cloud(e) => Self::Cloud(e),
            SubnetError::NoSubnet(why) => Self::NoSubnet(why),
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
    /// Not the pool's ([`start`]'s `EniRole`): holds a device, gives no
    /// address, its link is not touched.
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
    events: Events,
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

impl Manager {
    /// The pool's ENIs as the planners in [`super::pool`] read them.
    fn eni_snapshot(&self, st: &State, now: Instant) -> Vec<EniSnapshot> {
        let opts = &self.inner.opts;
        let cooldown = opts.settings.ip_cooldown;
        st.datastore
            .enis()
            .map(|(id, e)| {
                let tracked = &st.enis[id];
                EniSnapshot {
                    id: id.clone(),
                    device_number: e.device_number,
                    primary: e.primary,
                    excluded_for_pods: e.excluded_for_pods,
                    kept: tracked.no_manage
                        || now.saturating_duration_since(tracked.attached_at)
                            < opts.min_eni_lifetime,
                    assigned: e.assigned(),
                    slots_used: e.slots_used(),
                    total_ips: e.total(),
                    prefixes: e.prefixes().len(),
                    idle_addrs: e.idle_secondary_addrs(now, cooldown),
                    idle_prefixes: e.idle_prefixes(now, cooldown),
                }
            })
            .collect()
    }

    /// Subnet choice for this node: its VPC and zone, its primary ENI's
    /// subnet, the settings' discovery and cluster.
    fn subnets(&self) -> SubnetChoice<'_> {
        let me = &self.inner;
        SubnetChoice {
            cloud: &me.cloud,
            vpc_id: &me.node.vpc_id,
            zone: &me.node.instance.availability_zone,
            primary_subnet_id: &me.node.primary_eni.subnet_id,
            cluster: me.opts.settings.cluster_name.as_deref(),
            discovery: me.opts.settings.subnet_discovery,
        }
    }
}

/// Now, in nanoseconds since the epoch (the checkpoint's clock).
pub fn unix_ns() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

pub use vpcnet_api::vpc_cni::gateway_of;

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
