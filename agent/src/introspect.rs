//! Introspection and Prometheus metrics over HTTP, where aws-node serves
//! them: introspection on `127.0.0.1:61679` (`INTROSPECTION_BIND_ADDRESS`,
//! `unix:` for a Unix socket; off with `DISABLE_INTROSPECTION`), metrics on
//! port 61678 of every interface (off with `DISABLE_METRICS`; the VPC CNI
//! has no variable for its address, `run --metrics-address` sets it).
//!
//! Introspection (JSON): `/v1/enis`, `/v1/pods`, `/v1/policy?pod=NS/NAME`,
//! `/v1/nat?limit=N`,
//! `/v1/config`, and aws-node's `/v1/eni-configs`,
//! `/v1/ipamd-env-settings`, `/v1/networkutils-env-settings`. Metrics:
//! `/metrics`, the `awscni_` names that mean what they mean with aws-node,
//! `vpcnet_ipam_*` for the address manager's own counters,
//! `vpcnet_datapath_*` and `vpcnet_nat_*` for the datapath: each owner's
//! `metrics` module describes its own, this side gathers and encodes them.
//!
//! In parts: `server` listens and serves connections, `routes` maps the
//! paths of each endpoint to the `handlers`, which ask the owners and
//! answer with `views`, or with a `scrape` of the owners' metrics; `client`
//! is the operator's side.
//!
//! The maps are read through handles of their own, opened from their pins,
//! on the blocking pool: a scrape walking a large NAT table neither holds
//! the datapath's lock (which pod ADDs take) nor stalls the runtime.

pub mod client;
pub mod env_settings;
mod handlers;
mod policy;
mod routes;
mod scrape;
pub mod server;
pub mod views;

use std::sync::{Arc, Mutex};

use tokio::{sync::watch, task::JoinSet};
use tracing::{info, warn};

pub use self::{
    client::{ClientError, get},
    handlers::nat_summary_view,
    scrape::{CONTENT_TYPE, MetricsSnapshot, render_metrics},
    server::ListenAddr,
};
use self::{handlers::Shared, server::Listener};
use crate::{
    datapath::{CollectorReport, Datapath, DatapathError},
    env::{ConfigError, Env},
    ipam::settings::{EniConfig, IpamSettings},
    netlink::NetlinkError,
    pods::{PodError, Pods},
};

/// The VPC CNI's variables.
pub const ENV_INTROSPECTION_BIND_ADDRESS: &str = "INTROSPECTION_BIND_ADDRESS";
pub const ENV_DISABLE_INTROSPECTION: &str = "DISABLE_INTROSPECTION";
pub const ENV_DISABLE_METRICS: &str = "DISABLE_METRICS";
/// aws-node's addresses.
pub const DEFAULT_INTROSPECTION_ADDRESS: &str = "127.0.0.1:61679";
pub const DEFAULT_METRICS_ADDRESS: &str = "0.0.0.0:61678";
/// The label cni-metrics-helper finds aws-node's pods by (in
/// `kube-system`, not configurable): vpcnet's pods carry it only when the
/// operator asks (`deploy/README.md`, "cni-metrics-helper").
pub const METRICS_HELPER_POD_LABEL: (&str, &str) = ("k8s-app", "aws-node");
/// Flows `/v1/nat` returns unless `?limit=` says otherwise.
pub const DEFAULT_NAT_LIMIT: usize = 1000;

/// The introspection endpoints, in the order `GET /` lists them.
pub const PATHS: [&str; 9] = [
    "/v1/enis",
    "/v1/pods",
    "/v1/policy",
    "/v1/nat",
    "/v1/nat/summary",
    "/v1/config",
    PATH_ENI_CONFIGS,
    PATH_IPAMD_ENV_SETTINGS,
    PATH_NETWORKUTILS_ENV_SETTINGS,
];
/// aws-node's paths (see [`env_settings`]).
pub const PATH_ENI_CONFIGS: &str = "/v1/eni-configs";
pub const PATH_IPAMD_ENV_SETTINGS: &str = "/v1/ipamd-env-settings";
pub const PATH_NETWORKUTILS_ENV_SETTINGS: &str = "/v1/networkutils-env-settings";
pub const METRICS_PATH: &str = "/metrics";

/// Where introspection and metrics are served; `None`: not served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoints {
    pub introspection: Option<ListenAddr>,
    pub metrics: Option<ListenAddr>,
}

impl Endpoints {
    /// From the VPC CNI's variables; a flag (`run --introspection-address`,
    /// `--metrics-address`) names the address and serves it whatever the
    /// variables say. An address aws-node cannot listen on leaves it
    /// without introspection (it retries forever, silently): here too,
    /// said at start.
    pub fn from_env(
        env: &Env,
        introspection_flag: Option<&str>,
        metrics_flag: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let parse = |source: &'static str, value: &str| {
            value.parse::<ListenAddr>().map_err(|_| ConfigError {
                variable: source,
                value: value.to_owned(),
                allowed: "address:port (:port for every interface) or unix:/path/to/socket",
            })
        };
        let introspection = match introspection_flag {
            Some(flag) => Some(parse("--introspection-address", flag)?),
            None if env.bool_or(ENV_DISABLE_INTROSPECTION, false) => None,
            None => {
                let value = env
                    .get(ENV_INTROSPECTION_BIND_ADDRESS)
                    .unwrap_or(DEFAULT_INTROSPECTION_ADDRESS);
                parse(ENV_INTROSPECTION_BIND_ADDRESS, value)
                    .inspect_err(|_| {
                        env.tolerate(
                            ENV_INTROSPECTION_BIND_ADDRESS,
                            value,
                            "not address:port or unix:/path",
                            "no introspection endpoint",
                        );
                    })
                    .ok()
            }
        };
        let metrics = match metrics_flag {
            Some(flag) => Some(parse("--metrics-address", flag)?),
            None if env.bool_or(ENV_DISABLE_METRICS, false) => None,
            None => Some(parse("--metrics-address", DEFAULT_METRICS_ADDRESS)?),
        };
        Ok(Self {
            introspection,
            metrics,
        })
    }
}

/// What the endpoints show.
pub struct Sources {
    pub datapath: Arc<Mutex<Datapath>>,
    /// The pods and the address manager (`None` without `--ipam`).
    pub pods: Option<Pods>,
    pub ipam_settings: Option<IpamSettings>,
    pub primary_interface: String,
    /// The garbage collector's work so far.
    pub collector: Arc<Mutex<CollectorReport>>,
    /// Custom networking's ENIConfig in force, when followed from the
    /// Kubernetes API.
    pub eni_config_objects: Option<tokio::sync::watch::Receiver<Option<EniConfig>>>,
}
#[derive(Debug, thiserror::Error)]
pub enum IntrospectError {
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error(transparent)]
    Pods(#[from] PodError),
    #[error("reading the datapath: {0}")]
    Blocking(#[from] tokio::task::JoinError),
    #[error("writing the metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}
/// Starts serving `endpoints` (tasks in `tasks`, stopping when `shutdown`
/// turns true). An address that cannot be bound now (another agent still
/// holding it) is retried in the background, with backoff, as aws-node does.
/// Called from within the runtime.
pub fn start(
    endpoints: &Endpoints,
    sources: Sources,
    shutdown: &watch::Receiver<bool>,
    tasks: &mut JoinSet<()>,
) -> Result<(), IntrospectError> {
    if endpoints.introspection.is_none() && endpoints.metrics.is_none() {
        info!("introspection and metrics disabled");
        return Ok(());
    }
    let shared = Arc::new(Shared::new(endpoints, sources)?);
    for (what, addr, routes) in [
        (
            "introspection",
            &endpoints.introspection,
            routes::introspection(Arc::clone(&shared)),
        ),
        (
            "metrics",
            &endpoints.metrics,
            routes::metrics(Arc::clone(&shared)),
        ),
    ] {
        let Some(addr) = addr.clone() else {
            info!(what, "disabled");
            continue;
        };
        let listener = match Listener::bind(&addr) {
            Ok(listener) => {
                info!(what, address = %addr, "serving");
                Some(listener)
            }
            Err(e) => {
                warn!(what, address = %addr, error = %e, "cannot listen yet: retrying in the background");
                None
            }
        };
        tasks.spawn(server::serve(
            what,
            addr,
            listener,
            routes,
            shutdown.clone(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(vars: &[(&str, &str)], intro: Option<&str>, metrics: Option<&str>) -> Endpoints {
        Endpoints::from_env(&Env::from_pairs(vars.iter().copied()), intro, metrics).unwrap()
    }

    #[test]
    fn endpoints_from_the_vpc_cni_variables_and_flags() {
        let defaults = endpoints(&[], None, None);
        assert_eq!(
            defaults.introspection.unwrap().to_string(),
            DEFAULT_INTROSPECTION_ADDRESS
        );
        assert_eq!(
            defaults.metrics.unwrap().to_string(),
            DEFAULT_METRICS_ADDRESS
        );

        let set = endpoints(
            &[(ENV_INTROSPECTION_BIND_ADDRESS, "0.0.0.0:9000")],
            None,
            None,
        );
        assert_eq!(set.introspection.unwrap().to_string(), "0.0.0.0:9000");

        let off = endpoints(
            &[
                (ENV_DISABLE_INTROSPECTION, "true"),
                (ENV_DISABLE_METRICS, "true"),
            ],
            None,
            None,
        );
        assert_eq!(off.introspection, None);
        assert_eq!(off.metrics, None);

        // The flags win over the variables, disabled or not.
        let flags = endpoints(
            &[
                (ENV_DISABLE_INTROSPECTION, "true"),
                (ENV_INTROSPECTION_BIND_ADDRESS, "127.0.0.1:1"),
            ],
            Some("127.0.0.1:2"),
            Some("127.0.0.1:3"),
        );
        assert_eq!(flags.introspection.unwrap().to_string(), "127.0.0.1:2");
        assert_eq!(flags.metrics.unwrap().to_string(), "127.0.0.1:3");

        // What aws-node tolerates: metrics stay on, introspection goes.
        let env = Env::from_pairs([
            (ENV_DISABLE_METRICS, "maybe"),
            (ENV_INTROSPECTION_BIND_ADDRESS, "localhost"),
        ]);
        let tolerant = Endpoints::from_env(&env, None, None).unwrap();
        assert!(tolerant.metrics.is_some() && tolerant.introspection.is_none());
        let said: Vec<&str> = env.tolerated().iter().map(|t| t.variable).collect();
        assert_eq!(said, [ENV_INTROSPECTION_BIND_ADDRESS, ENV_DISABLE_METRICS]);
        let none = Env::from_pairs(std::iter::empty::<(&str, &str)>());
        let err = Endpoints::from_env(&none, Some("nowhere"), None).unwrap_err();
        assert_eq!(err.variable, "--introspection-address");
    }
}
