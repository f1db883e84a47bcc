//! The node's own Node object: what aws-node reads from it.
//!
//! - max pods: `status.capacity.pods` (kubelet's `--max-pods`), which
//!   bounds the address pool;
//! - cordoned: the `node.kubernetes.io/unschedulable:NoSchedule` taint,
//!   which stops ENI and address allocation unless
//!   `AWS_MANAGE_ENIS_NON_SCHEDULABLE` says otherwise;
//! - custom networking's ENIConfig: the label
//!   `vpc.amazonaws.com/externalEniConfig`, else the annotation
//!   `ENI_CONFIG_ANNOTATION_DEF`, else the label `ENI_CONFIG_LABEL_DEF`,
//!   else `default` (aws-node's `GetNodeSpecificENIConfigName`).
//!
//! [`follow`] watches the Node and publishes its [`NodeView`] on one
//! `tokio::sync::watch` channel; the parts that act on it subscribe.

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api,
    runtime::{WatchStreamExt, watcher},
};
use tokio::sync::watch;
use tracing::{error, info, warn};

use super::{K8sError, K8sSettings, START_CALL_TIMEOUT};

/// The node label key that names the node's ENIConfig.
pub const ENV_ENI_CONFIG_LABEL_DEF: &str = "ENI_CONFIG_LABEL_DEF";
/// The node annotation key that names the node's ENIConfig.
pub const ENV_ENI_CONFIG_ANNOTATION_DEF: &str = "ENI_CONFIG_ANNOTATION_DEF";
/// Both keys' default.
pub const DEFAULT_ENI_CONFIG_KEY: &str = "k8s.amazonaws.com/eniConfig";
/// The label an external controller names the ENIConfig with; it wins.
pub const EXTERNAL_ENI_CONFIG_LABEL: &str = "vpc.amazonaws.com/externalEniConfig";
/// The ENIConfig of a node that names none.
pub const DEFAULT_ENI_CONFIG: &str = "default";
/// The taint of a cordoned node.
pub use vpcnet_api::node::UNSCHEDULABLE_TAINT;
/// The node label with its availability zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// What the agent takes from its Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeView {
    pub name: String,
    /// `status.capacity.pods`; `None` when kubelet has not said yet.
    pub max_pods: Option<usize>,
    /// Cordoned: tainted `node.kubernetes.io/unschedulable:NoSchedule`.
    pub unschedulable: bool,
    /// The ENIConfig custom networking uses on this node.
    pub eni_config: String,
    pub zone: Option<String>,
}

impl NodeView {
    pub fn of(node: &Node, settings: &K8sSettings) -> Self {
        let labels = node.metadata.labels.as_ref();
        let annotations = node.metadata.annotations.as_ref();
        let label = |key: &str| labels.and_then(|l| l.get(key)).filter(|v| !v.is_empty());
        let annotation = |key: &str| {
            annotations
                .and_then(|a| a.get(key))
                .filter(|v| !v.is_empty())
        };
        let eni_config = label(EXTERNAL_ENI_CONFIG_LABEL)
            .or_else(|| annotation(&settings.eni_config_annotation))
            .or_else(|| label(&settings.eni_config_label))
            .map_or(DEFAULT_ENI_CONFIG, String::as_str)
            .to_owned();
        let max_pods = node
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("pods"))
            .and_then(|q| q.0.parse().ok());
        let unschedulable = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|taints| {
                taints
                    .iter()
                    .any(|t| t.key == UNSCHEDULABLE_TAINT && t.effect == "NoSchedule")
            });
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            max_pods,
            unschedulable,
            eni_config,
            zone: label(ZONE_LABEL).cloned(),
        }
    }
}

/// The channel [`follow`] publishes on: `None` until the Node is first
/// read; a deleted Node leaves its last view.
pub type NodeViews = watch::Receiver<Option<NodeView>>;

/// A channel for [`follow`] and its first subscriber.
#[must_use]
pub fn channel() -> (watch::Sender<Option<NodeView>>, NodeViews) {
    watch::channel(None)
}

/// Follows the node's Node (a watch on `metadata.name`: kube-rs lists
/// again after `410 Gone` and reconnects with backoff), publishing its view
/// on `views` each time it changes. Runs until every subscriber is gone or
/// the task is dropped; an error is logged once until the watch recovers.
pub async fn follow(
    client: kube::Client,
    settings: K8sSettings,
    views: watch::Sender<Option<NodeView>>,
) -> Result<(), K8sError> {
    let name = settings.node_name()?.to_owned();
    let nodes = Api::<Node>::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(nodes, config).default_backoff().boxed();
    let mut failing: Option<String> = None;
    loop {
        let event = tokio::select! {
            event = events.next() => event,
            () = views.closed() => return Ok(()),
        };
        let Some(event) = event else {
            return Ok(());
        };
        let node = match event {
            Ok(watcher::Event::Apply(node) | watcher::Event::InitApply(node)) => node,
            Ok(_) => continue,
            Err(error) => {
                let error = error.to_string();
                if failing.as_ref() != Some(&error) {
                    warn!(node = %name, %error, "watching the Node: retrying with backoff");
                    failing = Some(error);
                }
                continue;
            }
        };
        if failing.take().is_some() {
            info!(node = %name, "watching the Node again");
        }
        let view = NodeView::of(&node, &settings);
        views.send_if_modified(|current| {
            let changed = current.as_ref() != Some(&view);
            *current = Some(view);
            changed
        });
    }
}

/// Following the node's Node for as long as the agent runs: the views, and
/// the task to spawn (it says why when the Node cannot be followed).
pub fn following(
    client: kube::Client,
    settings: K8sSettings,
) -> (NodeViews, impl Future<Output = ()> + Send + 'static) {
    let (views, subscribed) = channel();
    let task = async move {
        if let Err(error) = follow(client, settings, views).await {
            error!(%error, "the Node cannot be followed");
        }
    };
    (subscribed, task)
}

/// Max pods from the Node's capacity (what kubelet was started with), as
/// aws-node reads it; `None` (computed from the instance type) when the
/// API does not say in time.
pub async fn max_pods(views: &NodeViews) -> Option<usize> {
    let Some(node) = first(views, START_CALL_TIMEOUT).await else {
        warn!(timeout = ?START_CALL_TIMEOUT, "max pods computed from the instance type: the Node could not be read in time");
        return None;
    };
    info!(node = %node.name, max_pods = ?node.max_pods, "the Node read");
    node.max_pods
}

/// The node's view once [`follow`] has read it, within `timeout`.
pub async fn first(views: &NodeViews, timeout: std::time::Duration) -> Option<NodeView> {
    let mut views = views.clone();
    match tokio::time::timeout(timeout, views.wait_for(Option::is_some)).await {
        Ok(Ok(view)) => view.clone(),
        _ => None,
    }
}

/// A channel of what `pick` takes from each view of the Node, `initial`
/// until it is read, and the task that keeps it up to date (to be spawned;
/// it ends when either side goes).
pub fn derived<T: Clone + PartialEq + Send + Sync + 'static>(
    mut views: NodeViews,
    initial: T,
    pick: impl Fn(&NodeView) -> T + Send + 'static,
) -> (
    watch::Receiver<T>,
    impl Future<Output = ()> + Send + 'static,
) {
    let (tx, rx) = watch::channel(initial);
    let task = async move {
        loop {
            if let Some(view) = views.borrow_and_update().as_ref() {
                let value = pick(view);
                tx.send_if_modified(|current| {
                    let changed = *current != value;
                    *current = value;
                    changed
                });
            }
            tokio::select! {
                changed = views.changed() => if changed.is_err() { return },
                () = tx.closed() => return,
            }
        }
    };
    (rx, task)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::json;

    use super::*;
    use crate::env::Env;

    fn node(value: serde_json::Value) -> Node {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn the_eni_config_name_is_found_in_aws_nodes_order() {
        let settings = K8sSettings::from_env(&Env::from_pairs::<&str, &str>([]));
        let bare = node(json!({"metadata": {"name": "n"}}));
        assert_eq!(NodeView::of(&bare, &settings).eni_config, "default");
        let labelled = node(
            json!({"metadata": {"name": "n", "labels": {"k8s.amazonaws.com/eniConfig": "by-label"},
            "annotations": {"k8s.amazonaws.com/eniConfig": "by-annotation"}}}),
        );
        assert_eq!(
            NodeView::of(&labelled, &settings).eni_config,
            "by-annotation"
        );
        let external = node(json!({"metadata": {"name": "n", "labels": {
            "k8s.amazonaws.com/eniConfig": "by-label", "vpc.amazonaws.com/externalEniConfig": "external"}}}));
        assert_eq!(NodeView::of(&external, &settings).eni_config, "external");
        let by_zone =
            K8sSettings::from_env(&Env::from_pairs([(ENV_ENI_CONFIG_LABEL_DEF, ZONE_LABEL)]));
        let zoned = node(json!({"metadata": {"name": "n", "labels": {ZONE_LABEL: "us-west-2a"}}}));
        let view = NodeView::of(&zoned, &by_zone);
        assert_eq!(
            (view.eni_config.as_str(), view.zone.as_deref()),
            ("us-west-2a", Some("us-west-2a"))
        );
    }

    #[test]
    fn max_pods_and_the_cordon_come_from_status_and_taints() {
        let settings = K8sSettings::from_env(&Env::from_pairs::<&str, &str>([]));
        let mut cordoned = node(json!({"metadata": {"name": "n"},
            "spec": {"taints": [{"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}]}}));
        cordoned.status = Some(k8s_openapi::api::core::v1::NodeStatus {
            capacity: Some([("pods".to_owned(), Quantity("29".to_owned()))].into()),
            ..Default::default()
        });
        let view = NodeView::of(&cordoned, &settings);
        assert_eq!((view.max_pods, view.unschedulable), (Some(29), true));
        let other_taint = node(json!({"metadata": {"name": "n"},
            "spec": {"taints": [{"key": UNSCHEDULABLE_TAINT, "effect": "PreferNoSchedule"}]}}));
        assert!(!NodeView::of(&other_taint, &settings).unschedulable);
    }
}
