//! This node's pods, as the CNI backend needs them.
//!
//! - With `ENABLE_POD_ENI`, an ADD looks at the pod: one whose first
//!   container asks for `vpc.amazonaws.com/pod-eni` gets the branch ENI the
//!   resource controller wrote in its annotation, and, while that
//!   annotation is missing, no address at all: the ADD fails and kubelet
//!   tries again (aws-node's `AddNetwork`).
//! - With `ANNOTATE_POD_IP`, a pod's address is written into its
//!   `vpc.amazonaws.com/pod-ips` annotation on ADD and blanked on DEL, so
//!   controllers learn it before kubelet reports it.
//!
//! The pods are followed with a reflector on `spec.nodeName`, so an ADD
//! does not wait for the API server, and pods known before the API became
//! unreachable still start.

use std::{collections::BTreeMap, net::Ipv4Addr, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use kube::{
    Api,
    api::{Patch, PatchParams},
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde_json::json;
use tracing::{debug, warn};

use super::{K8sError, K8sSettings};
use crate::{env::Env, retry};

/// aws-node's variable: write each pod's address into its annotation.
pub const ENV_ANNOTATE_POD_IP: &str = "ANNOTATE_POD_IP";
pub use vpcnet_api::pod::POD_ENI_RESOURCE;
/// The annotation `ANNOTATE_POD_IP` writes.
pub const POD_IPS_ANNOTATION: &str = "vpc.amazonaws.com/pod-ips";

/// How long an ADD waits for the API server when the pod is not in the
/// reflector's store yet (a pod created a moment ago).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(3);
/// How long an annotation is retried before it is given up.
const ANNOTATE_RETRY_FOR: Duration = Duration::from_mins(5);

/// What an ADD needs to know about a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodView {
    /// Its first container asks for [`POD_ENI_RESOURCE`].
    pub asks_pod_eni: bool,
    /// The `vpc.amazonaws.com/pod-eni` annotation, as the controller wrote it.
    pub pod_eni_annotation: Option<String>,
}

impl PodView {
    pub fn of(pod: &Pod) -> Self {
        // aws-node looks at the first container only: the webhook puts the
        // resource there.
        let asks_pod_eni = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .and_then(|c| c.resources.as_ref())
            .and_then(|r| r.limits.as_ref())
            .is_some_and(|limits| limits.keys().any(|k| k.starts_with(POD_ENI_RESOURCE)));
        Self {
            asks_pod_eni,
            pod_eni_annotation: pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(vpcnet_api::pod::POD_ENI_ANNOTATION))
                .cloned(),
        }
    }
}

/// This node's pods through the API server.
#[derive(Clone)]
pub struct NodePods {
    client: kube::Client,
    store: Store<Pod>,
    annotate_pod_ip: bool,
    /// Bumped on every change the watch delivers.
    changes: tokio::sync::watch::Receiver<u64>,
}

impl std::fmt::Debug for NodePods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodePods")
            .field("pods_known", &self.store.state().len())
            .field("annotate_pod_ip", &self.annotate_pod_ip)
            .finish_non_exhaustive()
    }
}

/// `ANNOTATE_POD_IP`, as aws-node parses it (anything but a true value is
/// false).
pub fn annotate_pod_ip(env: &Env) -> bool {
    env.bool_or(ENV_ANNOTATE_POD_IP, false)
}

impl NodePods {
    /// The handle, and the reflector that keeps it current (spawn it).
    pub fn follow(
        client: kube::Client,
        settings: &K8sSettings,
    ) -> Result<(Self, impl Future<Output = ()> + Send + 'static), K8sError> {
        let node = settings.node_name()?.to_owned();
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().fields(&format!("spec.nodeName={node}"));
        let stream = reflector::reflector(
            writer,
            watcher(Api::<Pod>::all(client.clone()), config).default_backoff(),
        );
        let (changes_tx, changes) = tokio::sync::watch::channel(0u64);
        let follow = async move {
            let followed = super::Followed {
                what: "this node's pods",
                while_failing: "ADDs use what is known",
            };
            super::drive(stream, followed, |_| changes_tx.send_modify(|n| *n += 1)).await;
        };
        Ok((
            Self {
                client,
                store,
                annotate_pod_ip: settings.annotate_pod_ip,
                changes,
            },
            follow,
        ))
    }

    /// The pod as an ADD needs it: from the reflector, else from the API
    /// server (a pod the watch has not delivered yet).
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<PodView, K8sError> {
        let Some(cached) = self.store.get(&ObjectRef::new(name).within(namespace)) else {
            return self.read(namespace, name).await;
        };
        let cached = PodView::of(&cached);
        if !matches!(cached.branch_decision(), BranchDecision::Pending) {
            return Ok(cached);
        }
        // The controller may have annotated the pod since the watch last
        // delivered it: kubelet's retry should not fail on a stale copy.
        match self.read(namespace, name).await {
            Ok(fresh) => Ok(fresh),
            Err(error) => {
                debug!(%error, namespace, name, "rereading a pod waiting for its branch ENI");
                Ok(cached)
            }
        }
    }

    /// A receiver that sees every change of this node's pods.
    #[must_use]
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.clone()
    }

    /// The pod as the watch last delivered it.
    #[must_use]
    pub fn cached(&self, namespace: &str, name: &str) -> Option<std::sync::Arc<Pod>> {
        self.store.get(&ObjectRef::new(name).within(namespace))
    }

    /// The pod: from the reflector, else from the API server (a pod the
    /// watch has not delivered yet).
    pub async fn object(
        &self,
        namespace: &str,
        name: &str,
    ) -> Result<std::sync::Arc<Pod>, K8sError> {
        match self.cached(namespace, name) {
            Some(cached) => Ok(cached),
            None => Ok(std::sync::Arc::new(self.get(namespace, name).await?)),
        }
    }

    /// The pod from the API server, bounded by [`LOOKUP_TIMEOUT`].
    async fn read(&self, namespace: &str, name: &str) -> Result<PodView, K8sError> {
        Ok(PodView::of(&self.get(namespace, name).await?))
    }

    async fn get(&self, namespace: &str, name: &str) -> Result<Pod, K8sError> {
        let what = format!("reading Pod {namespace}/{name}");
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        match tokio::time::timeout(LOOKUP_TIMEOUT, api.get(name)).await {
            Ok(pod) => pod.map_err(K8sError::api(what)),
            Err(_) => Err(K8sError::Timeout {
                what,
                after: LOOKUP_TIMEOUT,
            }),
        }
    }

    /// With `ANNOTATE_POD_IP`: the pod's address into its annotation, in
    /// the background (an ADD does not wait for the API server; the patch
    /// is retried with backoff while the server fails).
    pub fn annotate_added(&self, namespace: &str, name: &str, addr: Ipv4Addr) {
        self.annotate(namespace, name, addr.to_string(), None);
    }

    /// With `ANNOTATE_POD_IP`: the annotation blanked on DEL, if it still
    /// holds the address released (a pod deleted meanwhile is fine).
    pub fn annotate_deleted(&self, namespace: &str, name: &str, released: Ipv4Addr) {
        self.annotate(namespace, name, String::new(), Some(released));
    }

    /// With `ANNOTATE_POD_IP`: [`Self::set_pod_ips`] in the background,
    /// retried.
    fn annotate(&self, namespace: &str, name: &str, value: String, released: Option<Ipv4Addr>) {
        if !self.annotate_pod_ip {
            return;
        }
        let (pods, namespace, name) = (self.clone(), namespace.to_owned(), name.to_owned());
        tokio::spawn(async move {
            pods.retry_annotation(&namespace, &name, || async {
                pods.set_pod_ips(&namespace, &name, &value, released).await
            })
            .await;
        });
    }

    async fn retry_annotation<F, Fut>(&self, namespace: &str, name: &str, mut attempt: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<(), K8sError>>,
    {
        let deadline = tokio::time::Instant::now() + ANNOTATE_RETRY_FOR;
        let mut delays = retry::delays(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            let Err(error) = attempt().await else {
                return;
            };
            let Some(delay) = delays
                .next()
                .filter(|delay| tokio::time::Instant::now() + *delay < deadline)
            else {
                warn!(%error, pod = %format!("{namespace}/{name}"), "the pod's {POD_IPS_ANNOTATION} annotation given up");
                return;
            };
            debug!(%error, pod = %format!("{namespace}/{name}"), retry_in = ?delay, "annotating the pod's address");
            tokio::time::sleep(delay).await;
        }
    }

    /// One merge patch of the annotation. On DEL (`released`), only when it
    /// still holds that address, guarded by the pod's resourceVersion.
    async fn set_pod_ips(
        &self,
        namespace: &str,
        name: &str,
        value: &str,
        released: Option<Ipv4Addr>,
    ) -> Result<(), K8sError> {
        let api = Api::<Pod>::namespaced(self.client.clone(), namespace);
        let what = format!("annotating Pod {namespace}/{name}");
        let mut metadata = json!({"annotations": {POD_IPS_ANNOTATION: value}});
        if let Some(released) = released {
            let Some(pod) = api.get_opt(name).await.map_err(K8sError::api(&what))? else {
                return Ok(());
            };
            let annotations = pod.metadata.annotations.unwrap_or_default();
            if annotations.get(POD_IPS_ANNOTATION).map(String::as_str)
                != Some(released.to_string().as_str())
            {
                return Ok(());
            }
            metadata["resourceVersion"] = json!(pod.metadata.resource_version);
        }
        let patch: BTreeMap<&str, serde_json::Value> = [("metadata", metadata)].into();
        api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(K8sError::api(what))?;
        debug!(pod = %format!("{namespace}/{name}"), value, "{POD_IPS_ANNOTATION} annotation written");
        Ok(())
    }
}

/// What a pod's ADD gets, with `ENABLE_POD_ENI`, from what the API says.
#[derive(Debug, PartialEq, Eq)]
pub enum BranchDecision {
    /// An ordinary pod: an address from the pool.
    Pool,
    /// A pod with security groups: the controller's annotation.
    Branch(String),
    /// A pod with security groups whose branch ENI is not there yet.
    Pending,
}

impl PodView {
    pub fn branch_decision(&self) -> BranchDecision {
        match (&self.pod_eni_annotation, self.asks_pod_eni) {
            (Some(annotation), _) => BranchDecision::Branch(annotation.clone()),
            (None, true) => BranchDecision::Pending,
            (None, false) => BranchDecision::Pool,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(value: serde_json::Value) -> Pod {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_pod_asking_for_a_branch_eni_waits_for_its_annotation() {
        let asking = json!({"metadata": {"name": "web"},
            "spec": {"containers": [{"name": "app",
                "resources": {"limits": {"vpc.amazonaws.com/pod-eni": "1"}}}]}});
        let view = PodView::of(&pod(asking.clone()));
        assert!(view.asks_pod_eni);
        assert_eq!(view.branch_decision(), BranchDecision::Pending);

        let mut annotated = asking;
        annotated["metadata"]["annotations"] =
            json!({"vpc.amazonaws.com/pod-eni": "[{\"eniId\":\"eni-1\"}]"});
        assert_eq!(
            PodView::of(&pod(annotated)).branch_decision(),
            BranchDecision::Branch("[{\"eniId\":\"eni-1\"}]".to_owned())
        );

        // Only the first container counts, as in aws-node.
        let second = json!({"metadata": {"name": "web"},
            "spec": {"containers": [{"name": "app"}, {"name": "side",
                "resources": {"limits": {"vpc.amazonaws.com/pod-eni": "1"}}}]}});
        assert_eq!(
            PodView::of(&pod(second)).branch_decision(),
            BranchDecision::Pool
        );
        let plain = json!({"metadata": {"name": "web"}, "spec": {"containers": [{"name": "app",
            "resources": {"limits": {"cpu": "1"}}}]}});
        assert_eq!(
            PodView::of(&pod(plain)).branch_decision(),
            BranchDecision::Pool
        );
    }
}
