//! The handlers: each turns a request into calls on the owners (the
//! address manager, the datapath's maps, the links, the recorder) and
//! their answers into a view or a scrape.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

use axum::{
    extract::{RawQuery, State},
    http::StatusCode,
    response::Response,
};
use aya::maps::IterableMap;
use tracing::warn;
use vpcnet_common::{
    cidr::CidrKind,
    endpoint::{ENDPOINT_BRANCH, ENI_BRANCH, ENI_PRIMARY, Endpoint, Eni},
    maps as names,
    nat::FlowKind,
    raw_to_addr,
};

use super::{
    DEFAULT_NAT_LIMIT, Endpoints, IntrospectError, PATHS, Sources, env_settings,
    routes::{answer, error, json, reply},
    scrape,
    views::{
        self, AddressView, CollectorView, ConfigView, DatapathConfigView, DatapathEniEntryView,
        DatapathEniView, EndpointEntryView, EndpointView, EniView, EnisView, FlowView, IndexView,
        LinkView, MapFillView, NatSummaryView, NatView, PodRef, PodView, PodsView,
        RemoteEndpointView,
    },
};
use crate::{
    datapath::{
        CollectorReport, Datapath, DatapathError, DatapathMaps, Flow, NatPressure,
        metrics::{endpoint, proto_name},
        monotonic_now_ns,
    },
    env::Env,
    ipam::{
        manager::EniDetail,
        settings::{EniConfig, IpamSettings},
    },
    netlink::{LinkInfo, MacAddr, NetlinkHandle},
    pods::Pods,
};

/// What the handlers read, shared by the two endpoints.
pub(super) struct Shared {
    /// Handles of our own on the pinned maps.
    pub(super) maps: DatapathMaps,
    datapath: Arc<Mutex<Datapath>>,
    pub(super) pods: Option<Pods>,
    ipam_settings: Option<IpamSettings>,
    primary_interface: String,
    endpoints: Endpoints,
    netlink: NetlinkHandle,
    collector: Arc<Mutex<CollectorReport>>,
    /// aws-node's three settings paths, read once at start (the process's
    /// variables do not change); an error is the answer.
    env_answers: EnvAnswers,
    eni_config_objects: Option<tokio::sync::watch::Receiver<Option<EniConfig>>>,
}

/// The answers of aws-node's settings paths.
struct EnvAnswers {
    eni_configs: Result<views::EniConfigView, String>,
    ipamd: Result<BTreeMap<String, serde_json::Value>, String>,
    networkutils: Result<BTreeMap<String, serde_json::Value>, String>,
}

impl EnvAnswers {
    /// From the process's variables; the address manager's settings if it
    /// runs, else read from them too.
    fn read(ipam: Option<&IpamSettings>) -> Self {
        let env = Env::from_process();
        let ipam = match ipam {
            Some(settings) => Ok(settings.clone()),
            None => IpamSettings::from_env(&env).map_err(|e| e.to_string()),
        };
        Self {
            eni_configs: ipam
                .as_ref()
                .map(|ipam| {
                    env_settings::eni_config_in_force(
                        ipam,
                        env_settings::EniConfigSource::Variables,
                    )
                })
                .map_err(Clone::clone),
            ipamd: ipam
                .as_ref()
                .map(env_settings::ipamd_env_settings)
                .map_err(Clone::clone),
            networkutils: ipam.as_ref().map_err(Clone::clone).and_then(|s| {
                env_settings::networkutils_env_settings(s, &env).map_err(|e| e.to_string())
            }),
        }
    }
}

impl Shared {
    /// Opens handles of its own on the datapath's pinned maps and reads
    /// aws-node's settings answers.
    pub(super) fn new(endpoints: &Endpoints, sources: Sources) -> Result<Self, IntrospectError> {
        let pin_dir = sources.datapath.lock().map_or_else(
            |poisoned| poisoned.into_inner().pin_dir().to_owned(),
            |d| d.pin_dir().to_owned(),
        );
        let env_answers = EnvAnswers::read(sources.ipam_settings.as_ref());
        Ok(Self {
            maps: DatapathMaps::open_pinned(&pin_dir)?,
            datapath: sources.datapath,
            pods: sources.pods,
            ipam_settings: sources.ipam_settings,
            primary_interface: sources.primary_interface,
            endpoints: endpoints.clone(),
            netlink: NetlinkHandle::new()?,
            collector: sources.collector,
            env_answers,
            eni_config_objects: sources.eni_config_objects,
        })
    }

    pub(super) fn datapath(&self) -> std::sync::MutexGuard<'_, Datapath> {
        self.datapath
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn collector(&self) -> CollectorReport {
        *self
            .collector
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Runs `f` on the maps on the blocking pool.
pub(super) async fn read_maps<T: Send + 'static>(
    state: &Arc<Shared>,
    f: impl FnOnce(&Shared) -> Result<T, DatapathError> + Send + 'static,
) -> Result<T, IntrospectError> {
    let state = Arc::clone(state);
    Ok(tokio::task::spawn_blocking(move || f(&state)).await??)
}

/// `GET /` and `/v1`: the endpoints there are.
pub(super) async fn index() -> Response {
    json(
        StatusCode::OK,
        &IndexView {
            paths: PATHS.iter().map(|p| (*p).to_owned()).collect(),
        },
    )
}

pub(super) async fn pods(State(shared): State<Arc<Shared>>) -> Response {
    answer("/v1/pods", pods_view(&shared).await)
}

pub(super) async fn enis(State(shared): State<Arc<Shared>>) -> Response {
    answer("/v1/enis", enis_view(&shared).await)
}

/// `GET /v1/nat?limit=N`.
pub(super) async fn nat(State(shared): State<Arc<Shared>>, RawQuery(query): RawQuery) -> Response {
    match nat_limit(query.as_deref().unwrap_or("")) {
        Ok(limit) => answer("/v1/nat", nat_view(&shared, limit).await),
        Err(message) => error(StatusCode::BAD_REQUEST, &message),
    }
}

pub(super) async fn nat_summary(State(shared): State<Arc<Shared>>) -> Response {
    answer("/v1/nat/summary", nat_summary_of(&shared).await)
}

pub(super) async fn config(State(shared): State<Arc<Shared>>) -> Response {
    answer("/v1/config", config_view(&shared).await)
}

/// aws-node's ENIConfig in force: the followed object when there is one.
pub(super) async fn eni_configs(State(shared): State<Arc<Shared>>) -> Response {
    match (&shared.eni_config_objects, &shared.ipam_settings) {
        (Some(followed), Some(ipam)) => json(
            StatusCode::OK,
            &env_settings::eni_config_in_force(
                ipam,
                env_settings::EniConfigSource::Objects(followed.borrow().as_ref()),
            ),
        ),
        _ => env_answer(&shared.env_answers.eni_configs),
    }
}

pub(super) async fn ipamd_env_settings(State(shared): State<Arc<Shared>>) -> Response {
    env_answer(&shared.env_answers.ipamd)
}

pub(super) async fn networkutils_env_settings(State(shared): State<Arc<Shared>>) -> Response {
    env_answer(&shared.env_answers.networkutils)
}

fn env_answer(answer: &Result<impl serde::Serialize, String>) -> Response {
    match answer {
        Ok(view) => json(StatusCode::OK, view),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
    }
}

/// `limit=N` in the query; none: the default.
fn nat_limit(query: &str) -> Result<usize, String> {
    for pair in query.split('&') {
        if let Some(value) = pair.strip_prefix("limit=") {
            return value
                .parse()
                .map_err(|_| format!("limit={value:?} is not a whole number"));
        }
    }
    Ok(DEFAULT_NAT_LIMIT)
}

fn mac_string(mac: [u8; 6]) -> String {
    MacAddr(mac).to_string()
}

fn link_names(links: &[LinkInfo]) -> HashMap<u32, String> {
    links.iter().map(|l| (l.index, l.name.clone())).collect()
}

fn endpoint_entry(
    entry: &Endpoint,
    names: &HashMap<u32, String>,
    attached: bool,
) -> EndpointEntryView {
    EndpointEntryView {
        ifindex: entry.ifindex,
        interface: names.get(&entry.ifindex).cloned(),
        eni_ifindex: entry.eni_ifindex,
        eni_interface: names.get(&entry.eni_ifindex).cloned(),
        mac: mac_string(entry.mac),
        host_mac: mac_string(entry.host_mac),
        branch: entry.flags & ENDPOINT_BRANCH != 0,
        strict: entry.strict(),
        programs_attached: attached,
    }
}

fn eni_entry(entry: Eni, attached: bool) -> DatapathEniEntryView {
    DatapathEniEntryView {
        gateway: Ipv4Addr::from(raw_to_addr(entry.gateway)),
        primary: entry.flags & ENI_PRIMARY != 0,
        branch: entry.flags & ENI_BRANCH != 0,
        programs_attached: attached,
    }
}

async fn pods_view(state: &Arc<Shared>) -> Result<PodsView, IntrospectError> {
    let (attachments, enis) = match &state.pods {
        Some(pods) => (pods.attachments().await?, pods.manager().enis().await),
        None => (Vec::new(), Vec::new()),
    };
    let names = link_names(&state.netlink.links().await?);
    // Every endpoint entry, and whether its veth has the programs.
    let endpoints = read_maps(state, |s| {
        let endpoints = s.maps.endpoints()?;
        let datapath = s.datapath();
        Ok(endpoints
            .into_iter()
            .map(|(addr, entry)| (addr, (entry, datapath.is_attached(entry.ifindex))))
            .collect::<BTreeMap<_, _>>())
    })
    .await?;
    let owner: HashMap<Ipv4Addr, (&str, u32)> = enis
        .iter()
        .flat_map(|eni| {
            eni.assigned
                .iter()
                .map(|a| (a.addr, (eni.id.as_str(), eni.device_number)))
        })
        .collect();
    let mut pods: Vec<PodView> = attachments
        .into_iter()
        .map(|a| PodView {
            eni: owner.get(&a.addr).map(|(id, _)| (*id).to_owned()),
            device_number: owner.get(&a.addr).map(|(_, device)| *device),
            endpoint: endpoints
                .get(&a.addr)
                .map(|(entry, attached)| endpoint_entry(entry, &names, *attached)),
            namespace: a.metadata.k8s_pod_namespace,
            name: a.metadata.k8s_pod_name,
            container_id: a.key.container_id,
            network: a.key.network_name,
            ifname: a.key.if_name,
            address: a.addr,
            host_veth: a.host_veth,
        })
        .collect();
    pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let held: BTreeSet<Ipv4Addr> = pods.iter().map(|p| p.address).collect();
    let datapath_only = endpoints
        .iter()
        .filter(|(addr, _)| !held.contains(addr))
        .map(|(addr, (entry, attached))| EndpointView {
            address: *addr,
            entry: endpoint_entry(entry, &names, *attached),
        })
        .collect();
    Ok(PodsView {
        ipam: state.pods.is_some(),
        count: pods.len(),
        pods,
        datapath_only,
    })
}

/// An ENI's addresses for pods, secondary ones first, with their pods.
fn eni_addresses(eni: &EniDetail) -> Vec<AddressView> {
    let pod_of = |addr: Ipv4Addr| {
        eni.assigned
            .iter()
            .find(|a| a.addr == addr)
            .map(|a| PodRef {
                namespace: a.metadata.k8s_pod_namespace.clone(),
                name: a.metadata.k8s_pod_name.clone(),
                container_id: a.key.container_id.clone(),
            })
    };
    let secondary = eni.secondary_addrs.iter().map(|addr| AddressView {
        address: *addr,
        prefix: None,
        pod: pod_of(*addr),
    });
    let from_prefixes = eni.prefixes.iter().flat_map(|prefix| {
        let prefix = prefix.trunc();
        ipnet::Ipv4AddrRange::new(prefix.network(), prefix.broadcast()).map(move |addr| {
            AddressView {
                address: addr,
                prefix: Some(prefix.to_string()),
                pod: pod_of(addr),
            }
        })
    });
    secondary.chain(from_prefixes).collect()
}

async fn enis_view(state: &Arc<Shared>) -> Result<EnisView, IntrospectError> {
    let (details, status) = match &state.pods {
        Some(pods) => (
            pods.manager().enis().await,
            Some(pods.manager().status().await),
        ),
        None => (Vec::new(), None),
    };
    let links = state.netlink.links().await?;
    let names = link_names(&links);
    let entries = read_maps(state, |s| {
        let entries = s
            .maps
            .enis
            .iter()
            .collect::<Result<Vec<(u32, Eni)>, _>>()
            .map_err(DatapathError::map(names::ENIS))?;
        let datapath = s.datapath();
        Ok(entries
            .into_iter()
            .map(|(ifindex, entry)| (ifindex, (entry, datapath.is_attached(ifindex))))
            .collect::<BTreeMap<_, _>>())
    })
    .await?;
    let mut managed_links = BTreeSet::new();
    let enis: Vec<EniView> = details
        .iter()
        .map(|eni| {
            // A vlan inherits its parent's MAC: the ENI is the first link.
            let link = eni.mac.parse::<MacAddr>().ok().and_then(|mac| {
                links
                    .iter()
                    .filter(|l| l.mac == Some(mac))
                    .min_by_key(|l| l.index)
            });
            if let Some(link) = link {
                managed_links.insert(link.index);
            }
            let addresses = eni_addresses(eni);
            EniView {
                id: eni.id.clone(),
                device_number: eni.device_number,
                mac: eni.mac.clone(),
                attachment_id: eni.attachment_id.clone(),
                primary: eni.primary,
                no_manage: eni.no_manage,
                excluded_for_pods: eni.excluded_for_pods,
                subnet: eni.subnet.to_string(),
                gateway: crate::ipam::manager::gateway_of(eni.subnet),
                primary_address: eni.primary_addr,
                link: link.map(|l| LinkView {
                    name: l.name.clone(),
                    ifindex: l.index,
                }),
                datapath: link
                    .and_then(|l| entries.get(&l.index))
                    .map(|(entry, attached)| eni_entry(*entry, *attached)),
                total_addresses: addresses.len(),
                assigned_addresses: eni.assigned.len(),
                prefixes: eni.prefixes.iter().map(ToString::to_string).collect(),
                addresses,
            }
        })
        .collect();
    let datapath_only = entries
        .iter()
        .filter(|(ifindex, _)| !managed_links.contains(*ifindex))
        .map(|(ifindex, (entry, attached))| DatapathEniView {
            ifindex: *ifindex,
            interface: names.get(ifindex).cloned(),
            entry: eni_entry(*entry, *attached),
        })
        .collect();
    Ok(EnisView {
        ipam: state.pods.is_some(),
        count: enis.len(),
        max_enis: status.as_ref().map(|s| s.max_enis),
        total_addresses: status.as_ref().map_or(0, |s| s.stats.total_ips),
        assigned_addresses: status.as_ref().map_or(0, |s| s.stats.assigned_ips),
        enis,
        datapath_only,
    })
}

fn flow_view(flow: &Flow, now_ns: u64) -> FlowView {
    FlowView {
        proto: proto_name(flow.key.proto),
        kind: flow.kind().map_or("?", FlowKind::name).to_owned(),
        state: flow.state().name().to_owned(),
        original: endpoint(flow.key.saddr, flow.key.sport),
        remote: endpoint(flow.key.daddr, flow.key.dport),
        translated: endpoint(flow.fwd.addr, flow.fwd.port),
        idle_seconds: now_ns.saturating_sub(flow.last_seen_ns()) / 1_000_000_000,
    }
}

fn nat_table_size(maps: &DatapathMaps) -> Result<u32, DatapathError> {
    Ok(IterableMap::map(&maps.nat_fwd)
        .info()
        .map_err(DatapathError::map(names::NAT_FWD))?
        .max_entries())
}

/// The first `limit` flows with their claims, and how many there are.
async fn nat_view(state: &Arc<Shared>, limit: usize) -> Result<NatView, IntrospectError> {
    read_maps(state, move |s| {
        let now = monotonic_now_ns();
        let mut flows = Vec::new();
        let mut total = 0;
        for item in &s.maps.nat_fwd {
            let (key, fwd) = item.map_err(DatapathError::map(names::NAT_FWD))?;
            total += 1;
            if flows.len() >= limit {
                continue;
            }
            flows.push(flow_view(&Flow::read(&s.maps, key, fwd), now));
        }
        Ok(NatView {
            total,
            table_size: nat_table_size(&s.maps)?,
            limit,
            returned: flows.len(),
            truncated: flows.len() < total,
            flows,
        })
    })
    .await
}

/// The NAT pressure summary (see [`NatSummaryView`]).
async fn nat_summary_of(state: &Arc<Shared>) -> Result<NatSummaryView, IntrospectError> {
    read_maps(state, |s| {
        let config = s.maps.config()?;
        Ok(nat_summary_view(
            &s.maps.nat_pressure()?,
            &s.collector(),
            u32::from(config.port_max) - u32::from(config.port_min) + 1,
        ))
    })
    .await
}

/// What `/v1/nat/summary` and `vpcnet-agent nat --summary` show.
#[must_use]
pub fn nat_summary_view(
    pressure: &NatPressure,
    collector: &CollectorReport,
    port_range: u32,
) -> NatSummaryView {
    NatSummaryView {
        maps: [
            (names::NAT_FWD, pressure.nat_fwd),
            (names::NAT_REV, pressure.nat_rev),
            (names::STACK_FLOWS, pressure.stack_flows),
        ]
        .into_iter()
        .map(|(map, fill)| MapFillView {
            map: map.to_owned(),
            entries: fill.entries,
            capacity: fill.capacity,
        })
        .collect(),
        busiest_remote_endpoints: pressure
            .busiest
            .iter()
            .map(|e| RemoteEndpointView {
                proto: proto_name(e.proto),
                remote: endpoint(e.addr, e.port),
                ports: e.ports,
            })
            .collect(),
        port_range,
        collector: CollectorView {
            passes: collector.passes,
            last_pass_microseconds: u64::try_from(collector.last_pass.as_micros())
                .unwrap_or(u64::MAX),
            expired: collector.expired,
            orphans: collector.orphans,
        },
    }
}

fn cidr_kind_name(kind: Option<CidrKind>) -> &'static str {
    match kind {
        Some(CidrKind::Vpc) => "vpc",
        Some(CidrKind::Excluded) => "excluded",
        Some(CidrKind::Local) => "local",
        Some(CidrKind::Service) => "service",
        None => "unknown",
    }
}

async fn config_view(state: &Arc<Shared>) -> Result<ConfigView, IntrospectError> {
    let (cfg, cidrs, attached) = read_maps(state, |s| {
        let attached: Vec<String> = s.datapath().attached().map(str::to_owned).collect();
        Ok((s.maps.config()?, s.maps.cidrs()?, attached))
    })
    .await?;
    let mut by_kind: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (net, kind) in cidrs {
        by_kind
            .entry(cidr_kind_name(kind).to_owned())
            .or_default()
            .push(net.to_string());
    }
    Ok(ConfigView {
        datapath: DatapathConfigView {
            node_address: Ipv4Addr::from(raw_to_addr(cfg.node_addr)),
            external_snat: cfg.external_snat(),
            randomize_snat: cfg.randomize_mode().env_value().to_owned(),
            port_min: cfg.port_min,
            port_max: cfg.port_max,
            cidrs: by_kind,
        },
        primary_interface: state.primary_interface.clone(),
        attached_interfaces: attached,
        ipam: state.ipam_settings.as_ref().map(IpamSettings::env_view),
        introspection_address: state
            .endpoints
            .introspection
            .as_ref()
            .map(ToString::to_string),
        metrics_address: state.endpoints.metrics.as_ref().map(ToString::to_string),
    })
}

/// `GET /metrics`.
pub(super) async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let scrape = match scrape::snapshot(&shared).await {
        Ok(snapshot) => scrape::render_metrics(&snapshot).map_err(IntrospectError::from),
        Err(e) => Err(e),
    };
    match scrape {
        Ok(text) => reply(StatusCode::OK, scrape::CONTENT_TYPE, text),
        Err(e) => {
            warn!(error = %e, "metrics");
            error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nat_limit_from_the_query() {
        assert_eq!(nat_limit(""), Ok(DEFAULT_NAT_LIMIT));
        assert_eq!(nat_limit("limit=5"), Ok(5));
        assert_eq!(nat_limit("x=1&limit=0"), Ok(0));
        assert!(nat_limit("limit=lots").is_err());
    }
}
