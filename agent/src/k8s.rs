//! The Kubernetes API, as aws-node uses it: in-cluster configuration with
//! the pod's ServiceAccount token, the node's own Node object, the
//! cluster's service CIDRs. Each part reads and follows its objects with
//! kube-rs's watchers (which list again after `410 Gone` and reconnect
//! with backoff); without an API server the agent runs on what it has.
//!
//! - [`node`]: max pods, the unschedulable taint, the ENIConfig name;
//! - [`cninode`]: the `SecurityGroupsForPods` feature with `ENABLE_POD_ENI`;
//! - [`pods`]: this node's pods, for ADD's branch ENI and `ANNOTATE_POD_IP`;
//! - [`events`]: the agent's events on its pod;
//! - [`policy_endpoints`], [`network_policies`]: what network policy is
//!   read from (EKS's PolicyEndpoints, or NetworkPolicy with Namespaces
//!   and Pods);
//! - [`eni_config`]: custom networking's ENIConfig objects;
//! - [`service_cidrs`]: the `networking.k8s.io/v1` ServiceCIDR objects, else the
//!   `kubernetes` Service's address within EKS's defaults.

pub mod cninode;
pub mod eni_config;
pub mod events;
pub mod metrics;
pub mod network_policies;
pub mod node;
pub mod pods;
pub mod policy_endpoints;
pub mod service_cidrs;

use std::time::Duration;

use futures_util::{Stream, StreamExt};
use kube::runtime::watcher;
use tracing::{debug, info, warn};

use crate::env::Env;

/// What a follower tells of the objects it follows: a count bumped on
/// every change, and whether its first list is in.
#[derive(Clone)]
pub struct Progress {
    changes: tokio::sync::watch::Receiver<u64>,
    listed: tokio::sync::watch::Receiver<bool>,
}

impl Progress {
    #[must_use]
    pub const fn new(
        changes: tokio::sync::watch::Receiver<u64>,
        listed: tokio::sync::watch::Receiver<bool>,
    ) -> Self {
        Self { changes, listed }
    }

    /// Resolves once the first list is in (at once when it is).
    pub async fn listed(&self) {
        let mut listed = self.listed.clone();
        let _ = listed.wait_for(|l| *l).await;
    }

    /// Whether the first list is in.
    #[must_use]
    pub fn listed_now(&self) -> bool {
        *self.listed.borrow()
    }

    /// A receiver that sees every change.
    #[must_use]
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.clone()
    }
}

/// What a followed kind is to the agent, for its watch's log lines: what
/// is watched, and what the agent does while the watch fails.
pub struct Followed<'a> {
    pub what: &'a str,
    pub while_failing: &'a str,
}

/// Drives a reflector's stream to its end: says once when the watch fails
/// (and once when it is back), and calls `changed` on every change and at
/// the end of every list (`true` then).
pub async fn drive<K>(
    stream: impl Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    followed: Followed<'_>,
    mut changed: impl FnMut(bool),
) {
    // On the heap: a reflector's stream is a large value to keep in the
    // task's future.
    let mut stream = stream.boxed();
    let mut failing = false;
    while let Some(event) = stream.next().await {
        match event {
            Err(error) if !failing => {
                failing = true;
                warn!(%error, "watching {}: {}, retrying", followed.what, followed.while_failing);
            }
            Err(error) => debug!(%error, "watching {}", followed.what),
            Ok(watcher::Event::InitDone) => {
                if failing {
                    info!("watching {} again", followed.what);
                }
                failing = false;
                changed(true);
            }
            Ok(watcher::Event::Apply(_) | watcher::Event::Delete(_)) => changed(false),
            Ok(_) => {}
        }
    }
}

/// Where the in-cluster configuration finds the API server (set in every
/// pod; kube-rs reads it with `KUBERNETES_SERVICE_PORT`).
pub const ENV_SERVICE_HOST: &str = "KUBERNETES_SERVICE_HOST";
/// aws-node's override of the API server's URL (its `rest.Config.Host`).
pub const ENV_CLUSTER_ENDPOINT: &str = "CLUSTER_ENDPOINT";
/// The node's name (the chart fills it from `spec.nodeName`).
pub const ENV_MY_NODE_NAME: &str = "MY_NODE_NAME";
/// The agent's pod (Events are about it).
pub const ENV_MY_POD_NAME: &str = "MY_POD_NAME";
/// The variables of this module the ConfigMap does not hold: the
/// DaemonSet sets the node's and the pod's names from the pod (`fieldRef`),
/// and an operator sets the endpoint only to bypass the service address.
pub const VARIABLES: &[&str] = &[ENV_MY_NODE_NAME, ENV_MY_POD_NAME, ENV_CLUSTER_ENDPOINT];

/// How long connecting to the API server may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a lookup at start may hold the start up before the agent goes
/// on with what it knows (aws-node gives its Node GET 3 s).
pub const START_CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// One rule of the agent's ClusterRole: API group, resource, verbs.
pub type AccessRule = (&'static str, &'static str, &'static [&'static str]);

/// What the agent does with the API, by group and resource. The ClusterRole
/// `deploy/` ships grants exactly this (its tests compare), and the lab's
/// API server enforces it.
pub const API_ACCESS: &[AccessRule] = &[
    ("", "nodes", &["list", "watch"]),
    (eni_config::GROUP, eni_config::PLURAL, &["list", "watch"]),
    ("vpcresources.k8s.aws", "cninodes", &["get", "patch"]),
    ("", "services", &["get"]),
    ("networking.k8s.io", "servicecidrs", &["list", "watch"]),
    ("", "pods", &["get", "list", "watch", "patch"]),
    ("events.k8s.io", "events", &["create", "patch"]),
    (
        vpcnet_api::policy_endpoint::GROUP,
        vpcnet_api::policy_endpoint::PLURAL,
        &["list", "watch"],
    ),
    (
        vpcnet_api::cluster_policy::GROUP,
        vpcnet_api::cluster_policy::ENDPOINT_PLURAL,
        &["list", "watch"],
    ),
    (
        vpcnet_api::cluster_policy::GROUP,
        vpcnet_api::cluster_policy::POLICY_PLURAL,
        &["list", "watch"],
    ),
    ("", "namespaces", &["list", "watch"]),
    ("networking.k8s.io", "networkpolicies", &["list", "watch"]),
];

/// What can go wrong with the Kubernetes API.
#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    #[error(
        "the in-cluster configuration could not be read ({ENV_SERVICE_HOST}, the ServiceAccount's token and CA): {0}"
    )]
    InCluster(#[source] kube::config::InClusterError),

    #[error("{ENV_CLUSTER_ENDPOINT}={value:?} is not a URL: {reason}")]
    ClusterEndpoint { value: String, reason: String },

    #[error("making the Kubernetes client: {0}")]
    Client(#[source] kube::Error),

    #[error("{ENV_MY_NODE_NAME} is not set: the agent cannot find its Node")]
    NoNodeName,

    #[error("{what}: no answer within {after:?}")]
    Timeout {
        what: String,
        after: std::time::Duration,
    },

    #[error("{object} has what vpcnet cannot read ({why}): it is left as it is")]
    Unreadable { object: String, why: String },

    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
}

impl K8sError {
    pub(crate) fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| Self::Api { what, source }
    }

    /// The API server's answer, when it gave one.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            Self::Api {
                source: kube::Error::Api(status),
                ..
            } => Some(status.code),
            _ => None,
        }
    }
}

/// How the agent reaches the API server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct K8sSettings {
    /// Whether the agent runs with an API server: in a pod (the in-cluster
    /// variables are set) or with [`ENV_CLUSTER_ENDPOINT`].
    pub enabled: bool,
    pub cluster_endpoint: Option<String>,
    pub node_name: Option<String>,
    pub pod_name: Option<String>,
    pub eni_config_label: String,
    pub eni_config_annotation: String,
    /// `ANNOTATE_POD_IP`.
    pub annotate_pod_ip: bool,
}

/// Whether the agent runs with an API server: in a pod (the in-cluster
/// variables are set) or with [`ENV_CLUSTER_ENDPOINT`].
pub fn api_server_configured(env: &Env) -> bool {
    env.get(ENV_SERVICE_HOST).is_some() || env.get(ENV_CLUSTER_ENDPOINT).is_some()
}

impl K8sSettings {
    pub fn from_env(env: &Env) -> Self {
        let cluster_endpoint = env.get(ENV_CLUSTER_ENDPOINT).map(str::to_owned);
        Self {
            enabled: api_server_configured(env),
            cluster_endpoint,
            node_name: env.get(ENV_MY_NODE_NAME).map(str::to_owned),
            pod_name: env.get(ENV_MY_POD_NAME).map(str::to_owned),
            eni_config_label: env
                .get(node::ENV_ENI_CONFIG_LABEL_DEF)
                .unwrap_or(node::DEFAULT_ENI_CONFIG_KEY)
                .to_owned(),
            eni_config_annotation: env
                .get(node::ENV_ENI_CONFIG_ANNOTATION_DEF)
                .unwrap_or(node::DEFAULT_ENI_CONFIG_KEY)
                .to_owned(),
            annotate_pod_ip: pods::annotate_pod_ip(env),
        }
    }

    /// The settings by variable, for `vpcnet-agent settings`.
    pub fn view(&self) -> Vec<(&'static str, serde_json::Value)> {
        use serde_json::json;
        vec![
            ("kubernetes_api", json!(self.enabled)),
            (ENV_CLUSTER_ENDPOINT, json!(self.cluster_endpoint)),
            (ENV_MY_NODE_NAME, json!(self.node_name)),
            (ENV_MY_POD_NAME, json!(self.pod_name)),
            (node::ENV_ENI_CONFIG_LABEL_DEF, json!(self.eni_config_label)),
            (
                node::ENV_ENI_CONFIG_ANNOTATION_DEF,
                json!(self.eni_config_annotation),
            ),
            (pods::ENV_ANNOTATE_POD_IP, json!(self.annotate_pod_ip)),
        ]
    }

    /// The node's name, which every per-node call needs.
    pub fn node_name(&self) -> Result<&str, K8sError> {
        self.node_name.as_deref().ok_or(K8sError::NoNodeName)
    }
}

/// The client: the in-cluster configuration (the ServiceAccount's token,
/// re-read as kubelet rotates it, and CA), with [`ENV_CLUSTER_ENDPOINT`]'s
/// URL instead of the service address when set.
pub fn connect(settings: &K8sSettings) -> Result<kube::Client, K8sError> {
    // Both of rustls's providers are built in (the SDK's aws-lc-rs, kube's
    // ring): rustls then needs the process's named. Already named is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut config = kube::Config::incluster_env().map_err(K8sError::InCluster)?;
    if let Some(endpoint) = &settings.cluster_endpoint {
        config.cluster_url =
            endpoint
                .parse()
                .map_err(|e: http::uri::InvalidUri| K8sError::ClusterEndpoint {
                    value: endpoint.clone(),
                    reason: e.to_string(),
                })?;
    }
    config.connect_timeout = Some(CONNECT_TIMEOUT);
    let builder = kube::client::ClientBuilder::try_from(config).map_err(K8sError::Client)?;
    // Every request's answer is counted, so that an API server that fails
    // (the watchers retry in silence after their first warning) shows in
    // `/metrics`.
    Ok(builder
        .with_layer(&tower::util::MapResultLayer::new(count_answer))
        .build())
}

fn count_answer<B, E>(result: Result<http::Response<B>, E>) -> Result<http::Response<B>, E> {
    crate::telemetry::kubernetes_answer(
        result.as_ref().ok().map(|answer| answer.status().as_u16()),
    );
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_api_is_used_in_a_pod_or_with_an_endpoint() {
        let none = K8sSettings::from_env(&Env::from_pairs::<&str, &str>([]));
        assert!(!none.enabled);
        assert_eq!(none.eni_config_label, "k8s.amazonaws.com/eniConfig");
        assert!(matches!(none.node_name(), Err(K8sError::NoNodeName)));
        let pod = K8sSettings::from_env(&Env::from_pairs([
            (ENV_SERVICE_HOST, "10.100.0.1"),
            (
                ENV_MY_NODE_NAME,
                "ip-10-20-11-162.us-west-2.compute.internal",
            ),
            (
                node::ENV_ENI_CONFIG_LABEL_DEF,
                "topology.kubernetes.io/zone",
            ),
        ]));
        assert!(pod.enabled);
        assert_eq!(pod.eni_config_label, "topology.kubernetes.io/zone");
        let endpoint = K8sSettings::from_env(&Env::from_pairs([(
            ENV_CLUSTER_ENDPOINT,
            "https://10.20.0.20",
        )]));
        assert!(endpoint.enabled);
    }
}
