//! Network policy on this node: which local pods there are, what the
//! cluster's policies say of each, and the datapath kept to it. A pod's
//! rules are in the maps before its CNI ADD returns (the ADD waits, bounded,
//! for the cluster's policies to be known; past that the pod gets its
//! mode's default and the policies follow), and every change of the
//! policies is written as it arrives.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

use tracing::{debug, info, warn};
use vpcnet_common::{
    cidr::CidrKind,
    config::{FLAG_NETWORK_POLICY, FLAG_POLICY_EVENTS},
};

use super::{
    Enforcer,
    endpoints::{self, LocalPod, Named, Problem},
    rules::PodRules,
    settings::{EnforcingMode, PolicySettings},
};
use crate::{
    datapath::{Datapath, DatapathError},
    k8s::{pods::NodePods, policy_endpoints::PolicyEndpoints},
};

/// A local pod, as the CNI named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodName {
    pub namespace: String,
    pub name: String,
}

/// Network policy on this node; cheap to clone.
#[derive(Clone)]
pub struct NodePolicy {
    inner: Arc<Inner>,
}

struct Inner {
    settings: PolicySettings,
    datapath: Arc<Mutex<Datapath>>,
    policies: PolicyEndpoints,
    cluster_pods: Option<NodePods>,
    state: tokio::sync::Mutex<State>,
}

struct State {
    enforcer: Enforcer,
    pods: BTreeMap<Ipv4Addr, LocalPodState>,
    /// The problems reported last, so each is said once.
    problems: Vec<Problem>,
}

struct LocalPodState {
    name: PodName,
    labels: Option<BTreeMap<String, String>>,
}

impl NodePolicy {
    /// Takes over what the maps hold and turns enforcement on once every
    /// pod in `pods` has its rules written.
    pub async fn start(
        settings: PolicySettings,
        datapath: Arc<Mutex<Datapath>>,
        policies: PolicyEndpoints,
        cluster_pods: Option<NodePods>,
        pods: Vec<(Ipv4Addr, PodName)>,
    ) -> Result<Self, DatapathError> {
        let enforcer = Enforcer::new(&lock(&datapath).maps)?;
        let node = Self {
            inner: Arc::new(Inner {
                settings,
                datapath,
                policies,
                cluster_pods,
                state: tokio::sync::Mutex::new(State {
                    enforcer,
                    pods: BTreeMap::new(),
                    problems: Vec::new(),
                }),
            }),
        };
        node.wait_for_policies().await;
        {
            let mut state = node.inner.state.lock().await;
            for (addr, name) in pods {
                let labels = node.labels(&name).await;
                state.pods.insert(addr, LocalPodState { name, labels });
            }
            node.write(&mut state)?;
        }
        {
            let mut datapath = lock(&node.inner.datapath);
            let mut config = datapath.maps.config()?;
            config.flags |= FLAG_NETWORK_POLICY;
            if node.inner.settings.event_log.is_some() {
                config.flags |= FLAG_POLICY_EVENTS;
            }
            datapath.maps.set_config(&config)?;
        }
        info!(mode = %node.inner.settings.mode, "network policy enforced");
        Ok(node)
    }

    /// A pod joins the node: its rules are written before this returns.
    pub async fn pod_added(&self, addr: Ipv4Addr, name: PodName) -> Result<(), DatapathError> {
        self.wait_for_policies().await;
        let labels = self.labels(&name).await;
        let mut state = self.inner.state.lock().await;
        state.pods.insert(addr, LocalPodState { name, labels });
        self.write(&mut state)
    }

    /// A pod left the node.
    pub async fn pod_removed(&self, addr: Ipv4Addr) -> Result<(), DatapathError> {
        let mut state = self.inner.state.lock().await;
        if state.pods.remove(&addr).is_none() {
            return Ok(());
        }
        self.write(&mut state)
    }

    /// Writes every change of the cluster's policies, and of the labels of
    /// this node's pods, as it arrives, until the watches end.
    pub async fn follow(self) {
        let mut policies = self.inner.policies.changes();
        let mut pods = self.inner.cluster_pods.as_ref().map(NodePods::changes);
        loop {
            let pods_changed = async {
                match &mut pods {
                    Some(pods) => pods.changed().await.is_ok(),
                    None => std::future::pending().await,
                }
            };
            let more = tokio::select! {
                changed = policies.changed() => changed.is_ok(),
                changed = pods_changed => changed,
            };
            if !more {
                return;
            }
            policies.borrow_and_update();
            if let Some(pods) = &mut pods {
                pods.borrow_and_update();
            }
            let mut state = self.inner.state.lock().await;
            if let Err(error) = self.write(&mut state) {
                warn!(%error, "writing network policy into the datapath");
            }
        }
    }

    #[must_use]
    pub fn mode(&self) -> EnforcingMode {
        self.inner.settings.mode
    }

    /// Every local pod's rules, as enforced now.
    pub async fn snapshot(&self) -> Vec<(Ipv4Addr, PodName, PodRules)> {
        let state = self.inner.state.lock().await;
        state
            .pods
            .iter()
            .filter_map(|(addr, pod)| {
                let rules = state.enforcer.pod(*addr)?.clone();
                Some((*addr, pod.name.clone(), rules))
            })
            .collect()
    }

    async fn wait_for_policies(&self) {
        let wait = self.inner.settings.add_wait;
        if tokio::time::timeout(wait, self.inner.policies.listed())
            .await
            .is_err()
        {
            warn!(
                ?wait,
                mode = %self.inner.settings.mode,
                "the cluster's PolicyEndpoints are not known yet: the pod gets its mode's default until they are"
            );
        }
    }

    async fn labels(&self, name: &PodName) -> Option<BTreeMap<String, String>> {
        let pods = self.inner.cluster_pods.as_ref()?;
        match pods.labels(&name.namespace, &name.name).await {
            Ok(labels) => Some(labels),
            Err(error) => {
                debug!(%error, pod = %format!("{}/{}", name.namespace, name.name), "the pod's labels are not known: selected by the controller's lists only");
                None
            }
        }
    }

    /// Every local pod's rules from the policies known now, into the maps.
    fn write(&self, state: &mut State) -> Result<(), DatapathError> {
        let all = self.inner.policies.all();
        let named: Vec<Named<'_>> = all
            .iter()
            .map(|pe| Named {
                namespace: pe.metadata.namespace.as_deref().unwrap_or_default(),
                name: pe.metadata.name.as_deref().unwrap_or_default(),
                spec: &pe.spec,
            })
            .collect();
        let mut problems = Vec::new();
        let mut rules = BTreeMap::new();
        // Labels as the pods' watch has them now; one read at ADD until it
        // delivers the pod.
        if let Some(cluster_pods) = &self.inner.cluster_pods {
            for pod in state.pods.values_mut() {
                if let Some(labels) =
                    cluster_pods.cached_labels(&pod.name.namespace, &pod.name.name)
                {
                    pod.labels = Some(labels);
                }
            }
        }
        for (addr, pod) in &state.pods {
            let local = LocalPod {
                addr: *addr,
                namespace: &pod.name.namespace,
                labels: pod.labels.as_ref(),
            };
            let selected = endpoints::pod_rules(named.iter().copied(), &local, &mut problems);
            let pod_rules = selected.unwrap_or_else(|| match self.inner.settings.mode {
                EnforcingMode::Standard => PodRules::default(),
                EnforcingMode::Strict => PodRules::deny_all(),
            });
            rules.insert(*addr, pod_rules);
        }
        problems.sort();
        problems.dedup();
        for problem in &problems {
            if !state.problems.contains(problem) {
                warn!("{problem}");
            }
        }
        state.problems = problems;
        state.enforcer.set_pods(rules);
        let mut datapath = lock(&self.inner.datapath);
        // The node's own addresses, as the datapath knows them.
        let node_addrs: Vec<Ipv4Addr> = datapath
            .maps
            .cidrs()?
            .into_iter()
            .filter(|(net, kind)| *kind == Some(CidrKind::Local) && net.prefix_len() == 32)
            .map(|(net, _)| net.addr())
            .collect();
        state.enforcer.set_node_addresses(node_addrs);
        let revoked = state.enforcer.sync(&mut datapath.maps)?;
        if revoked > 0 {
            info!(revoked, "connections a policy change denies were stopped");
        }
        Ok(())
    }
}

fn lock(datapath: &Mutex<Datapath>) -> std::sync::MutexGuard<'_, Datapath> {
    // A panic elsewhere leaves the maps as they were: usable.
    datapath
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
