//! What the agent resolves NetworkPolicy from, where no controller writes
//! PolicyEndpoints: the cluster's NetworkPolicy objects, Namespaces (their
//! labels) and Pods (their labels, addresses and named ports), each
//! followed with a reflector in every namespace. Pods are kept stripped to
//! what policy reads of them, as kube-rs's own pod reflector example does.

use std::sync::{
    Arc,
    atomic::{AtomicU8, Ordering},
};

use k8s_openapi::api::{
    core::v1::{Container, Namespace, Pod, PodSpec, PodStatus},
    networking::v1::NetworkPolicy,
};
use kube::{
    Api, Resource,
    runtime::{
        WatchStreamExt,
        reflector::{self, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::pods::POD_IPS_ANNOTATION;

/// The objects known, and news of them.
#[derive(Clone)]
pub struct NetworkPolicySources {
    policies: Store<NetworkPolicy>,
    namespaces: Store<Namespace>,
    pods: Store<Pod>,
    /// Changes of any of them; listed once each is.
    progress: super::Progress,
}

/// How many kinds are followed (each sets its bit in the listed mask).
const KINDS: u8 = 3;

impl NetworkPolicySources {
    /// The handle, and the reflectors that keep it current (spawn them).
    pub fn follow(client: &kube::Client) -> (Self, impl Future<Output = ()> + Send + 'static) {
        let (changes_tx, changes) = watch::channel(0u64);
        let (listed_tx, listed) = watch::channel(false);
        let news = Arc::new(News {
            changes: changes_tx,
            listed: listed_tx,
            listed_mask: AtomicU8::new(0),
        });
        let (policies, follow_policies) = reflect(
            Api::<NetworkPolicy>::all(client.clone()),
            "NetworkPolicies",
            |_| {},
            0,
            Arc::clone(&news),
        );
        let (namespaces, follow_namespaces) = reflect(
            Api::<Namespace>::all(client.clone()),
            "Namespaces",
            |ns| ns.metadata.managed_fields = None,
            1,
            Arc::clone(&news),
        );
        let (pods, follow_pods) =
            reflect(Api::<Pod>::all(client.clone()), "Pods", strip_pod, 2, news);
        let follow = async move {
            tokio::join!(follow_policies, follow_namespaces, follow_pods);
        };
        (
            Self {
                policies,
                namespaces,
                pods,
                progress: super::Progress::new(changes, listed),
            },
            follow,
        )
    }

    #[must_use]
    pub fn policies(&self) -> Vec<Arc<NetworkPolicy>> {
        self.policies.state()
    }

    #[must_use]
    pub fn namespaces(&self) -> Vec<Arc<Namespace>> {
        self.namespaces.state()
    }

    #[must_use]
    pub fn pods(&self) -> Vec<Arc<Pod>> {
        self.pods.state()
    }

    /// Its changes, and whether the first list is in.
    #[must_use]
    pub const fn progress(&self) -> &super::Progress {
        &self.progress
    }
}

struct News {
    changes: watch::Sender<u64>,
    listed: watch::Sender<bool>,
    listed_mask: AtomicU8,
}

fn reflect<K>(
    api: Api<K>,
    what: &'static str,
    strip: impl FnMut(&mut K) + Send + 'static,
    bit: u8,
    news: Arc<News>,
) -> (Store<K>, impl Future<Output = ()> + Send + 'static)
where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store();
    let stream = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default())
            .default_backoff()
            .modify(strip),
    );
    let follow = async move {
        let followed = super::Followed {
            what,
            while_failing: "the policies in force stay as they are",
        };
        super::drive(stream, followed, |listed| {
            if listed {
                let mask = news.listed_mask.fetch_or(1 << bit, Ordering::Relaxed) | (1 << bit);
                if mask == (1 << KINDS) - 1 {
                    news.listed.send_replace(true);
                }
            }
            news.changes.send_modify(|n| *n += 1);
        })
        .await;
    };
    (store, follow)
}

/// A pod less what policy never reads (`ClusterPod::of` reads the rest).
fn strip_pod(pod: &mut Pod) {
    pod.metadata.managed_fields = None;
    pod.metadata.owner_references = None;
    if let Some(annotations) = &mut pod.metadata.annotations {
        annotations.retain(|key, _| key == POD_IPS_ANNOTATION);
    }
    let ports_only = |c: &Container| Container {
        name: c.name.clone(),
        ports: c.ports.clone(),
        ..Container::default()
    };
    if let Some(spec) = &pod.spec {
        pod.spec = Some(PodSpec {
            containers: spec.containers.iter().map(ports_only).collect(),
            init_containers: spec
                .init_containers
                .as_ref()
                .map(|cs| cs.iter().map(ports_only).collect()),
            host_network: spec.host_network,
            ..PodSpec::default()
        });
    }
    if let Some(status) = &pod.status {
        pod.status = Some(PodStatus {
            phase: status.phase.clone(),
            pod_ip: status.pod_ip.clone(),
            pod_ips: status.pod_ips.clone(),
            ..PodStatus::default()
        });
    }
}
