//! The cluster's objects of EKS's network policy CRDs
//! (`networking.k8s.aws/v1alpha1`, see `vpcnet_api::policy_endpoint` and
//! `vpcnet_api::cluster_policy`): PolicyEndpoints and ClusterPolicyEndpoints
//! as aws-node's node agent follows them, and ClusterNetworkPolicies where
//! the agent resolves them itself. Each is followed with a reflector in
//! every namespace: its store, a signal on every change, and whether the
//! first list is in (a CRD the cluster lacks lists as empty).

use std::{fmt::Debug, sync::Arc};

use futures_util::StreamExt;
use kube::{
    Api,
    core::{ApiResource, GroupVersionKind, Object},
    runtime::{
        WatchStreamExt,
        reflector::{self, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tracing::warn;
use vpcnet_api::{
    cluster_policy::{
        ClusterNetworkPolicySpec, ClusterPolicyEndpointSpec, ENDPOINT_KIND, ENDPOINT_PLURAL,
        POLICY_KIND, POLICY_PLURAL,
    },
    policy_endpoint::{GROUP, KIND, PLURAL, PolicyEndpointSpec, VERSION},
};

/// What the agent says, once, when the cluster does not serve
/// PolicyEndpoints (their list answers 404).
pub const NOT_SERVED: &str = "the cluster serves no PolicyEndpoints";

/// A PolicyEndpoint as read (its status, empty in the CRD, is not read).
pub type PolicyEndpoint = Object<PolicyEndpointSpec, serde_json::Value>;
/// A ClusterPolicyEndpoint as read.
pub type ClusterPolicyEndpoint = Object<ClusterPolicyEndpointSpec, serde_json::Value>;

/// The PolicyEndpoints known, and news of them.
pub type PolicyEndpoints = PolicyObjects<PolicyEndpointSpec>;
/// The ClusterPolicyEndpoints known, and news of them.
pub type ClusterPolicyEndpoints = PolicyObjects<ClusterPolicyEndpointSpec>;
/// The ClusterNetworkPolicies known, and news of them.
pub type ClusterNetworkPolicies = PolicyObjects<ClusterNetworkPolicySpec>;

/// A kind of these objects, as the agent follows it.
struct ObjectKind {
    kind: &'static str,
    plural: &'static str,
    /// For the log: what is followed, and what it says when the cluster
    /// does not serve them.
    what: &'static str,
    not_served: &'static str,
}

/// Objects of one kind known, and news of them.
#[derive(Clone)]
pub struct PolicyObjects<S: Clone + Send + Sync + 'static> {
    store: Store<Object<S, serde_json::Value>>,
    progress: super::Progress,
}

impl PolicyEndpoints {
    /// The handle, and the reflector that keeps it current (spawn it).
    pub fn follow(client: kube::Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        Self::follow_kind(
            client,
            &ObjectKind {
                kind: KIND,
                plural: PLURAL,
                what: "PolicyEndpoints",
                not_served: NOT_SERVED,
            },
        )
    }
}

impl ClusterPolicyEndpoints {
    /// The handle, and the reflector that keeps it current (spawn it).
    pub fn follow(client: kube::Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        Self::follow_kind(
            client,
            &ObjectKind {
                kind: ENDPOINT_KIND,
                plural: ENDPOINT_PLURAL,
                what: "ClusterPolicyEndpoints",
                not_served: "the cluster serves no ClusterPolicyEndpoints",
            },
        )
    }
}

impl ClusterNetworkPolicies {
    /// The handle, and the reflector that keeps it current (spawn it).
    pub fn follow(client: kube::Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        Self::follow_kind(
            client,
            &ObjectKind {
                kind: POLICY_KIND,
                plural: POLICY_PLURAL,
                what: "ClusterNetworkPolicies",
                not_served: "the cluster serves no ClusterNetworkPolicies",
            },
        )
    }
}

impl<S> PolicyObjects<S>
where
    S: Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    fn follow_kind(
        client: kube::Client,
        kind: &ObjectKind,
    ) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let resource = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(GROUP, VERSION, kind.kind),
            kind.plural,
        );
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        let api = Api::<Object<S, serde_json::Value>>::all_with(client, &resource);
        let (changes_tx, changes) = watch::channel(0u64);
        let (listed_tx, listed) = watch::channel(false);
        let listed_tx = Arc::new(listed_tx);
        // A cluster without the CRD (no network policy controller, or one
        // from before ClusterNetworkPolicy) answers the list with 404: an
        // empty list, not one to hold ADDs for. The watch goes on, and
        // finds the CRD once it is installed.
        let mut said = false;
        let not_served = Arc::clone(&listed_tx);
        let (what, not_served_line) = (kind.what, kind.not_served);
        let stream = reflector::reflector(
            writer,
            watcher(api, watcher::Config::default()).default_backoff(),
        )
        .inspect(move |event| {
            if let Err(watcher::Error::InitialListFailed(kube::Error::Api(status))) = event
                && status.is_not_found()
            {
                if !said {
                    said = true;
                    warn!(
                        "{not_served_line} (their CRD, which EKS's network policy controller \
                         installs, is missing): none are in force until it is"
                    );
                }
                not_served.send_replace(true);
            }
        });
        let follow = async move {
            let followed = super::Followed {
                what,
                while_failing: "the policies in force stay as they are",
            };
            super::drive(stream, followed, |listed| {
                if listed {
                    listed_tx.send_replace(true);
                }
                changes_tx.send_modify(|n| *n += 1);
            })
            .await;
        };
        (
            Self {
                store,
                progress: super::Progress::new(changes, listed),
            },
            follow,
        )
    }

    /// Every object known now.
    #[must_use]
    pub fn all(&self) -> Vec<Arc<Object<S, serde_json::Value>>> {
        self.store.state()
    }

    /// Its changes, and whether the first list is in.
    #[must_use]
    pub const fn progress(&self) -> &super::Progress {
        &self.progress
    }
}
