//! The address manager's metrics: aws-node's ipamd names where they mean
//! the same (`awscni_*`: the pool, its requests, its actions, the start),
//! and `vpcnet_ipam_*` for the manager's own counters, each counter named,
//! described and counted here once.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus::Registry;

use super::manager::{EniDetail, IpamStatus, Manager};
use crate::telemetry::{self, Families, Recorded};

macro_rules! counters {
    ($($name:ident: $help:literal,)*) => {
        /// The manager's counters (`vpcnet_ipam_<name>_total`).
        #[derive(Debug, Default)]
        pub struct IpamCounters { $(#[doc = $help] pub $name: AtomicU64,)* }
        impl IpamCounters {
            /// (name, value) of every counter.
            #[must_use]
            pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name.load(Ordering::Relaxed)),)*]
            }

            /// The help of the counter `name`.
            #[must_use]
            pub fn help(name: &str) -> Option<&'static str> {
                match name {
                    $(stringify!($name) => Some($help),)*
                    _ => None,
                }
            }
        }
    };
}

counters! {
    assigned: "Addresses handed to pods (ADDs served, retried ADDs included).",
    assign_failures: "ADDs that found no address.",
    released: "Addresses pods gave back (DELs that released one).",
    addrs_allocated: "Secondary addresses assigned by EC2.",
    addrs_freed: "Secondary addresses given back to EC2.",
    prefixes_allocated: "/28 prefixes assigned by EC2.",
    prefixes_freed: "/28 prefixes given back to EC2.",
    enis_created: "ENIs created and attached.",
    enis_deleted: "ENIs detached and deleted.",
    leaked_enis_deleted: "Detached agent ENIs deleted by the leaked-ENI sweep.",
    prefix_fallbacks: "Prefix delegation fell back to single addresses (InsufficientCidrBlocks).",
    ec2_errors: "Pool reconcile passes that ended on an error.",
    ec2_throttled: "Pool reconcile passes refused by EC2 with RequestLimitExceeded.",
    subnet_exhausted: "Pool reconcile passes refused for lack of addresses in the subnet.",
    links_restored: "Checks that found an ENI's link rewritten by someone else (MTU, address, routes in main, gateway neighbour) and put it back.",
    node_reconciles: "Looks at the ENIs and addresses IMDS lists for the instance, for what someone else attached or took away.",
    enis_found: "ENIs found attached by someone else and taken in (or left alone, as their tags say).",
    enis_lost: "ENIs found detached by someone else and taken out of the pool.",
    addrs_found: "Addresses (prefixes' included) found assigned by someone else and taken into the pool.",
    addrs_lost: "Addresses (prefixes' included) found unassigned by someone else and taken out of the pool.",
    cordon_held: "Passes that found the pool below its targets on a cordoned node and left it so (the variable to manage ENIs on such nodes is not true).",
    cidrs_found: "Addresses and prefixes (one each) the node's reconcile found assigned by someone else (the unit of `awscni_reconcile_count`).",
    cidrs_lost: "Addresses and prefixes (one each) the node's reconcile found unassigned by someone else (the unit of `awscni_reconcile_count`).",
}

/// aws-node's reconcile counters by its function names, from the address
/// manager's counters: ENIs and addresses or prefixes someone else
/// attached, assigned, detached or unassigned.
const RECONCILE_COUNTS: [(&str, &str); 4] = [
    ("eniReconcileAdd", "enis_found"),
    ("eniReconcileDel", "enis_lost"),
    ("eniDataStorePoolReconcileAdd", "cidrs_found"),
    ("eniIPPoolReconcileDel", "cidrs_lost"),
];

/// The pool as one scrape reports it.
#[derive(Clone, Debug)]
pub struct PoolSnapshot {
    pub status: IpamStatus,
    /// Addresses assigned to pods per ENI (id, count).
    pub per_eni: Vec<(String, usize)>,
    /// Addresses assigned to pods per pool CIDR (see [`assigned_per_cidr`]).
    pub per_cidr: Vec<(String, usize)>,
}

impl PoolSnapshot {
    pub async fn read(manager: &Manager) -> Self {
        let status = manager.status().await;
        let enis = manager.enis().await;
        let per_cidr = assigned_per_cidr(&enis);
        let per_eni = enis
            .into_iter()
            .map(|eni| (eni.id, eni.assigned.len()))
            .collect();
        Self {
            status,
            per_eni,
            per_cidr,
        }
    }

    fn counter(&self, name: &str) -> u64 {
        self.status
            .counters
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, v)| *v)
    }
}

/// Addresses assigned per pool CIDR, as aws-node's datastore keeps them:
/// a secondary address is a `/32`, a prefix a `/28`.
#[must_use]
pub fn assigned_per_cidr(enis: &[EniDetail]) -> Vec<(String, usize)> {
    enis.iter()
        .filter(|eni| !eni.no_manage)
        .flat_map(|eni| {
            let singles = eni.secondary_addrs.iter().map(|addr| {
                let held = eni.assigned.iter().filter(|a| a.addr == *addr).count();
                (format!("{addr}/32"), held)
            });
            let prefixes = eni.prefixes.iter().map(|prefix| {
                let prefix = prefix.trunc();
                let held = eni
                    .assigned
                    .iter()
                    .filter(|a| prefix.contains(&a.addr))
                    .count();
                (prefix.to_string(), held)
            });
            singles.chain(prefixes)
        })
        .collect()
}

fn n(value: usize) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

/// The pool (aws-node's names where they mean the same), the manager's
/// counters, its actions under way (`recorded`) and where the pods'
/// addresses are.
///
/// # Errors
/// A name the registry refuses (a bug) or has already.
pub fn register_pool(
    registry: &Registry,
    pool: &PoolSnapshot,
    recorded: &Recorded,
) -> prometheus::Result<()> {
    let mut f = Families::new();
    let status = &pool.status;
    let addrs = &status.stats;
    f.gauge(
        "awscni_eni_allocated",
        "The number of ENIs allocated",
        n(status.enis),
    )
    .gauge(
        "awscni_eni_max",
        "The maximum number of ENIs that can be attached to the instance",
        n(status.max_enis),
    )
    .gauge(
        "awscni_ip_max",
        "The maximum number of IP addresses that can be allocated to the instance",
        n(status.max_ips),
    )
    .gauge(
        "awscni_assigned_ip_addresses",
        "The number of IP addresses assigned to pods",
        n(addrs.assigned_ips),
    )
    .gauge(
        "awscni_total_ip_addresses",
        "The total number of IP addresses",
        n(addrs.total_ips),
    )
    .gauge(
        "awscni_total_ipv4_prefixes",
        "The total number of IPv4 prefixes",
        n(addrs.total_prefixes),
    )
    .gauges(
        "awscni_assigned_ip_per_eni",
        "The number of allocated ips partitioned by eni",
        &["eni"],
        pool.per_eni
            .iter()
            .map(|(eni, assigned)| (vec![eni.clone()], n(*assigned))),
    )
    .counter(
        "awscni_add_ip_req_count",
        "The number of add IP address requests (ADDs served plus ADDs that found no address)",
        pool.counter("assigned") + pool.counter("assign_failures"),
    )
    .counter(
        "awscni_no_available_ip_addresses",
        "The number of pod IP assignments that fail due to no available IP addresses",
        pool.counter("assign_failures"),
    )
    .counters(
        "awscni_ipamd_error_count",
        "The number of errors encountered in ipamd (fn=reconcile: pool passes that failed)",
        &["fn"],
        [(vec!["reconcile".to_owned()], pool.counter("ec2_errors"))],
    )
    .counter(
        "awscni_force_removed_enis",
        "The number of ENIs force removed while they had assigned pods (always 0: vpcnet \
         never removes an ENI a pod uses)",
        0,
    )
    .counter(
        "awscni_force_removed_ips",
        "The number of IPs force removed while they had assigned pods (always 0: vpcnet \
         never removes an address a pod holds)",
        0,
    )
    .gauge(
        "vpcnet_ipam_cooling_ip_addresses",
        "Free addresses still in their cooldown (IP_COOLDOWN_PERIOD).",
        n(addrs.cooling_ips),
    )
    .gauge(
        "vpcnet_ipam_free_ipv4_prefixes",
        "Prefixes with no address assigned.",
        n(addrs.free_prefixes),
    )
    .gauge(
        "vpcnet_ipam_max_pods",
        "The node's max pods: the pool never grows past it.",
        n(status.max_pods),
    )
    .gauge(
        "vpcnet_ipam_prefix_fallback",
        "1 once prefix delegation fell back to single addresses.",
        u64::from(status.prefix_fallback),
    );
    for (name, value) in &status.counters {
        let help = IpamCounters::help(name);
        debug_assert!(help.is_some(), "counter {name} without help");
        f.counter(
            &format!("vpcnet_ipam_{name}_total"),
            help.unwrap_or(name),
            *value,
        );
    }
    actions(&mut f, pool, recorded);
    f.register(registry)
}

/// What the manager does (its actions, its reconcile's finds) and where
/// the pods' addresses are.
fn actions(f: &mut Families, pool: &PoolSnapshot, recorded: &Recorded) {
    f.gauges(
        "awscni_ipamd_action_inprogress",
        "The number of ipamd actions in progress",
        &["fn"],
        telemetry::ACTIONS.iter().map(|action| {
            let under_way = recorded.actions.get(action).copied();
            (vec![(*action).to_owned()], under_way.unwrap_or(0))
        }),
    )
    .counters(
        "awscni_reconcile_count",
        "The number of times ipamd reconciles on ENIs and IP/Prefix addresses (what the node's \
         reconcile found attached, assigned, detached or unassigned by someone else)",
        &["fn"],
        RECONCILE_COUNTS
            .iter()
            .map(|(function, name)| (vec![(*function).to_owned()], pool.counter(name))),
    )
    .gauges(
        "awscni_assigned_ip_per_cidr",
        "The total number of IP addresses assigned per cidr",
        &["cidr"],
        pool.per_cidr
            .iter()
            .map(|(cidr, held)| (vec![cidr.clone()], n(*held))),
    );
}

/// What aws-node's ipamd reports of itself, with or without the pool: its
/// build, the DEL requests the CNI backend served, how long the start took.
///
/// # Errors
/// A name the registry refuses (a bug) or has already.
pub fn register_agent(registry: &Registry, recorded: &Recorded) -> prometheus::Result<()> {
    let mut f = Families::new();
    f.gauges(
        "awscni_build_info",
        "A metric with a constant '1' value labeled by the version vpcnet-agent was built from.",
        &["version"],
        [(vec![env!("CARGO_PKG_VERSION").to_owned()], 1)],
    )
    .counters(
        "awscni_del_ip_req_count",
        "The number of delete IP address requests",
        &["reason"],
        recorded
            .del_requests
            .iter()
            .map(|(reason, n)| (vec![reason.clone()], *n)),
    )
    .histograms(
        "awscni_ipamd_startup_duration_seconds",
        "The duration of IPAMD startup from process start to ready to serve CNI requests",
        &["success", "with_api_server", "failure_reason"],
        recorded.startup.iter().map(|(key, h)| {
            (
                vec![
                    key.success.to_string(),
                    key.with_api_server.to_string(),
                    key.failure_reason.to_owned(),
                ],
                h,
            )
        }),
    )
    .histograms(
        "awscni_ipamd_node_initialization_duration_seconds",
        "The duration of node initialization during IPAMD startup",
        &["success"],
        recorded
            .node_init
            .iter()
            .map(|(success, h)| (vec![success.to_string()], h)),
    );
    f.register(registry)
}
