//! The cluster's service CIDRs, which the datapath must leave to
//! kube-proxy: the `networking.k8s.io/v1` ServiceCIDR objects where the API
//! server serves them (Kubernetes 1.33 on), followed as they change; else
//! the EKS default that holds the `kubernetes` Service's address.
//! `VPCNET_SERVICE_CIDRS` overrides both.

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use futures_util::StreamExt;
use ipnet::Ipv4Net;
use k8s_openapi::api::{core::v1::Service, networking::v1::ServiceCIDR};
use kube::{
    Api,
    runtime::{WatchStreamExt, watcher},
};
use tracing::{info, warn};

use super::{K8sError, START_CALL_TIMEOUT};
use crate::{
    env::{ConfigError, Env, parse_cidrs},
    retry,
};

/// vpcnet's own: the cluster's service CIDRs, whose packets go through the
/// node's stack (kube-proxy). Unset or blank: the cluster's, from the
/// Kubernetes API ([`discover`]); without an API server, EKS's two possible
/// service ranges. Set: an override of both.
pub const ENV_SERVICE_CIDRS: &str = "VPCNET_SERVICE_CIDRS";
pub const DEFAULT_SERVICE_CIDRS: &str = "10.100.0.0/16,172.20.0.0/16";

/// The service CIDRs the override names, else the defaults.
pub fn from_env(env: &Env) -> Result<Vec<Ipv4Net>, ConfigError> {
    let value = env.get(ENV_SERVICE_CIDRS).unwrap_or(DEFAULT_SERVICE_CIDRS);
    parse_cidrs(ENV_SERVICE_CIDRS, value)
}

/// Where the service CIDRs came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The ServiceCIDR objects.
    ServiceCidrObjects,
    /// The EKS default around the `kubernetes` Service's address.
    KubernetesService(Ipv4Addr),
}

/// The service CIDRs and where they came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCidrs {
    pub cidrs: Vec<Ipv4Net>,
    pub origin: Origin,
}

/// The IPv4 CIDRs of ServiceCIDR objects, sorted, without repeats.
pub fn of_objects<'a>(objects: impl IntoIterator<Item = &'a ServiceCIDR>) -> Vec<Ipv4Net> {
    let mut cidrs: Vec<Ipv4Net> = objects
        .into_iter()
        .filter_map(|o| o.spec.as_ref()?.cidrs.as_ref())
        .flatten()
        .filter_map(|c| c.parse::<Ipv4Net>().ok())
        .map(|c| c.trunc())
        .collect();
    cidrs.sort();
    cidrs.dedup();
    cidrs
}

/// The EKS default service CIDR that holds `ip`; an address outside both
/// (a cluster made with its own `serviceIpv4Cidr`) gives the /12 around it,
/// the largest range EKS allows, with a warning: better too wide than
/// cluster-IP traffic past kube-proxy.
pub fn around_kubernetes_service(ip: Ipv4Addr) -> Vec<Ipv4Net> {
    let defaults =
        parse_cidrs(ENV_SERVICE_CIDRS, DEFAULT_SERVICE_CIDRS).expect("the defaults parse");
    if let Some(cidr) = defaults.iter().find(|c| c.contains(&ip)) {
        return vec![*cidr];
    }
    let wide = Ipv4Net::new(ip, 12).expect("12 is a prefix length").trunc();
    warn!(
        kubernetes_service = %ip,
        assumed = %wide,
        "the kubernetes Service's address is in no EKS default service CIDR and the API serves no ServiceCIDR: set {} to the cluster's",
        ENV_SERVICE_CIDRS
    );
    vec![wide]
}

/// The service CIDRs now.
pub async fn discover(client: &kube::Client) -> Result<ServiceCidrs, K8sError> {
    let objects = Api::<ServiceCIDR>::all(client.clone());
    match objects.list(&kube::api::ListParams::default()).await {
        Ok(list) if !of_objects(&list.items).is_empty() => {
            return Ok(ServiceCidrs {
                cidrs: of_objects(&list.items),
                origin: Origin::ServiceCidrObjects,
            });
        }
        Ok(_) => {}
        // Not served before Kubernetes 1.33.
        Err(kube::Error::Api(status)) if status.code == 404 => {}
        Err(source) => return Err(K8sError::api("listing ServiceCIDRs")(source)),
    }
    let service = Api::<Service>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await
        .map_err(K8sError::api("reading the default/kubernetes Service"))?;
    let ip = service
        .spec
        .and_then(|s| s.cluster_ip)
        .and_then(|ip| ip.parse::<Ipv4Addr>().ok())
        .ok_or_else(|| K8sError::Api {
            what: "reading the default/kubernetes Service".into(),
            source: kube::Error::Api(
                kube::core::Status::failure("it has no IPv4 cluster IP", "Invalid").boxed(),
            ),
        })?;
    Ok(ServiceCidrs {
        cidrs: around_kubernetes_service(ip),
        origin: Origin::KubernetesService(ip),
    })
}

/// What to do about the service CIDRs once the agent runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// Follow the ServiceCIDR objects.
    Follow,
    /// The API did not answer at start: look them up until it does.
    Retry,
    Nothing,
}

/// The cluster's service CIDRs at start; the defaults (`fallback`) when
/// the API does not answer in time.
pub async fn at_start(client: &kube::Client, fallback: Vec<Ipv4Net>) -> (Vec<Ipv4Net>, Next) {
    let error = match tokio::time::timeout(START_CALL_TIMEOUT, discover(client)).await {
        Ok(Ok(found)) => {
            info!(cidrs = ?found.cidrs, origin = ?found.origin, "the cluster's service CIDRs");
            let next = match found.origin {
                Origin::ServiceCidrObjects => Next::Follow,
                Origin::KubernetesService(_) => Next::Nothing,
            };
            return (found.cidrs, next);
        }
        Ok(Err(error)) => error.to_string(),
        Err(_) => format!("no answer within {START_CALL_TIMEOUT:?}"),
    };
    warn!(%error, defaults = ?fallback, "the cluster's service CIDRs are unknown: the defaults until the API answers");
    (fallback, Next::Retry)
}

/// Keeps the service CIDRs the cluster's after [`at_start`] found
/// `current`, calling `set` with them each time they change.
pub async fn keep(
    client: kube::Client,
    next: Next,
    current: Vec<Ipv4Net>,
    mut set: impl FnMut(&[Ipv4Net]),
) {
    let current = match next {
        Next::Nothing => return,
        Next::Follow => current,
        Next::Retry => {
            let Some(found) = once_answered(&client).await else {
                return;
            };
            info!(cidrs = ?found.cidrs, origin = ?found.origin, "the cluster's service CIDRs, now that the API answers");
            set(&found.cidrs);
            if found.origin != Origin::ServiceCidrObjects {
                return;
            }
            found.cidrs
        }
    };
    follow(client, current, set).await;
}

/// The service CIDRs once the API answers, asked again after each delay
/// of the agent's backoff from 1 s to 30 s.
async fn once_answered(client: &kube::Client) -> Option<ServiceCidrs> {
    for delay in retry::delays(Duration::from_secs(1), Duration::from_secs(30)) {
        tokio::time::sleep(delay).await;
        match discover(client).await {
            Ok(found) => return Some(found),
            Err(error) => warn!(%error, waited = ?delay, "looking up the cluster's service CIDRs"),
        }
    }
    None
}

/// Follows the ServiceCIDR objects, calling `changed` with their CIDRs each
/// time the set changes (a resync that changes nothing calls nothing).
/// Runs until the task is dropped; errors are logged and retried with
/// kube-rs's default backoff.
pub async fn follow(
    client: kube::Client,
    mut current: Vec<Ipv4Net>,
    mut changed: impl FnMut(&[Ipv4Net]),
) {
    let objects = Api::<ServiceCIDR>::all(client);
    let mut known: BTreeMap<String, ServiceCIDR> = BTreeMap::new();
    let mut listing: Option<BTreeMap<String, ServiceCIDR>> = None;
    let mut events = watcher(objects, watcher::Config::default())
        .default_backoff()
        .boxed();
    while let Some(event) = events.next().await {
        let event = match event {
            Ok(event) => event,
            Err(error) => {
                warn!(%error, "watching ServiceCIDRs");
                continue;
            }
        };
        let key = |o: &ServiceCIDR| o.metadata.name.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => listing = Some(BTreeMap::new()),
            watcher::Event::InitApply(object) => {
                if let Some(listing) = listing.as_mut() {
                    listing.insert(key(&object), object);
                }
            }
            watcher::Event::InitDone => {
                if let Some(listed) = listing.take() {
                    known = listed;
                }
            }
            watcher::Event::Apply(object) => {
                known.insert(key(&object), object);
            }
            watcher::Event::Delete(object) => {
                known.remove(&key(&object));
            }
        }
        if listing.is_some() {
            continue;
        }
        let cidrs = of_objects(known.values());
        if cidrs != current && !cidrs.is_empty() {
            info!(?cidrs, "the cluster's service CIDRs changed");
            changed(&cidrs);
            current = cidrs;
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn service_cidr_objects_give_their_ipv4_cidrs() {
        let objects: Vec<ServiceCIDR> = [
            json!({"metadata": {"name": "kubernetes"}, "spec": {"cidrs": ["10.100.0.0/16", "fd00:10:96::/112"]}}),
            json!({"metadata": {"name": "extra"}, "spec": {"cidrs": ["10.101.0.5/24", "10.100.0.0/16"]}}),
        ]
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect();
        let cidrs: Vec<String> = of_objects(&objects)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(cidrs, ["10.100.0.0/16", "10.101.0.0/24"]);
    }

    #[test]
    fn the_kubernetes_service_address_picks_the_eks_default_that_holds_it() {
        let of = |ip: &str| around_kubernetes_service(ip.parse().unwrap())[0].to_string();
        assert_eq!(of("10.100.0.1"), "10.100.0.0/16");
        assert_eq!(of("172.20.0.1"), "172.20.0.0/16");
        assert_eq!(of("10.96.0.1"), "10.96.0.0/12");
    }

    #[test]
    fn the_override_stops_on_a_bad_value() {
        let env = Env::from_pairs([(ENV_SERVICE_CIDRS, "10.100.0.0/16,nowhere")]);
        assert_eq!(from_env(&env).unwrap_err().variable, ENV_SERVICE_CIDRS);
    }
}
