//! The cluster's PolicyEndpoints (`networking.k8s.aws/v1alpha1`, see
//! `vpcnet_api::policy_endpoint`), followed with a reflector in every
//! namespace, as aws-node's node agent follows them: its store, a signal on
//! every change, and whether the first list is in.

use std::sync::Arc;

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
use tokio::sync::watch;
use tracing::warn;
use vpcnet_api::policy_endpoint::{GROUP, KIND, PLURAL, PolicyEndpointSpec, VERSION};

/// What the agent says, once, when the cluster does not serve
/// PolicyEndpoints (their list answers 404).
pub const NOT_SERVED: &str = "the cluster serves no PolicyEndpoints";

/// A PolicyEndpoint as read (its status, empty in the CRD, is not read).
pub type PolicyEndpoint = Object<PolicyEndpointSpec, serde_json::Value>;

fn api_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

/// The PolicyEndpoints known, and news of them.
#[derive(Clone)]
pub struct PolicyEndpoints {
    store: Store<PolicyEndpoint>,
    progress: super::Progress,
}

impl PolicyEndpoints {
    /// The handle, and the reflector that keeps it current (spawn it).
    pub fn follow(client: kube::Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let resource = api_resource();
        let writer = reflector::store::Writer::new(resource.clone());
        let store = writer.as_reader();
        let api = Api::<PolicyEndpoint>::all_with(client, &resource);
        let (changes_tx, changes) = watch::channel(0u64);
        let (listed_tx, listed) = watch::channel(false);
        let listed_tx = Arc::new(listed_tx);
        // A cluster without the CRD (no network policy controller) answers
        // the list with 404: an empty list, not one to hold ADDs for. The
        // watch goes on, and finds the CRD once it is installed.
        let mut said = false;
        let not_served = Arc::clone(&listed_tx);
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
                        "{NOT_SERVED} (their CRD, which EKS's network policy controller \
                         installs, is missing): none are in force until it is"
                    );
                }
                not_served.send_replace(true);
            }
        });
        let follow = async move {
            let followed = super::Followed {
                what: "PolicyEndpoints",
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

    /// Every PolicyEndpoint known now.
    #[must_use]
    pub fn all(&self) -> Vec<Arc<PolicyEndpoint>> {
        self.store.state()
    }

    /// Its changes, and whether the first list is in.
    #[must_use]
    pub const fn progress(&self) -> &super::Progress {
        &self.progress
    }
}
