//! Network policy on this node: which local pods there are, what the
//! cluster's policies say of each, and the datapath kept to it. A pod's
//! rules are in the maps before its CNI ADD returns (the ADD waits, bounded,
//! for the cluster's policies to be known; past that the pod gets its
//! mode's default and the policies follow), and every change of the
//! policies is written as it arrives.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    sync::{Arc, Mutex},
};

use tracing::{debug, info, warn};
use vpcnet_common::{cidr::CidrKind, policy::PodVerdicts};

use super::{
    Enforcer, cluster_endpoints, cluster_policies,
    endpoints::{self, LocalPod, Named},
    fields::Problem,
    maps,
    network_policies::{Cluster, ClusterPod, Resolved},
    rules::{ClusterRule, PodRules},
    settings::{EnforcingMode, PolicySettings},
};
use crate::{
    datapath::{Datapath, DatapathError},
    k8s::{
        Progress,
        network_policies::NetworkPolicySources,
        pods::NodePods,
        policy_endpoints::{ClusterNetworkPolicies, ClusterPolicyEndpoints, PolicyEndpoints},
    },
};

/// Where the policies come from (see `settings::Source`).
#[derive(Clone)]
pub enum Policies {
    /// EKS's controller's resolution.
    Endpoints(PolicyEndpoints),
    /// NetworkPolicy, resolved here.
    NetworkPolicies(NetworkPolicySources),
}

impl Policies {
    const fn progress(&self) -> &Progress {
        match self {
            Self::Endpoints(p) => p.progress(),
            Self::NetworkPolicies(p) => p.progress(),
        }
    }

    const fn what(&self) -> &'static str {
        match self {
            Self::Endpoints(_) => "PolicyEndpoints",
            Self::NetworkPolicies(_) => "NetworkPolicies",
        }
    }
}

/// Where AWS's ClusterNetworkPolicy comes from, as NetworkPolicy does.
#[derive(Clone)]
pub enum ClusterPolicies {
    /// EKS's controller's resolution.
    Endpoints(ClusterPolicyEndpoints),
    /// The policies, resolved here (with [`Policies::NetworkPolicies`]).
    Resolved(ClusterNetworkPolicies),
}

impl ClusterPolicies {
    const fn progress(&self) -> &Progress {
        match self {
            Self::Endpoints(p) => p.progress(),
            Self::Resolved(p) => p.progress(),
        }
    }
}

/// What the agent says while the policies are not known yet and the
/// datapath keeps the rules it holds.
pub const HELD: &str = "the pods the datapath enforces policy for keep the rules it holds";

/// Problems waiting to be sent as Events, at most.
pub const PROBLEMS_QUEUED: usize = 64;

/// A local pod, as the CNI named it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodName {
    pub namespace: String,
    pub name: String,
}

/// A local pod as network policy has it.
#[derive(Clone, Debug)]
pub struct PodSnapshot {
    pub addr: Ipv4Addr,
    pub name: PodName,
    /// `None` while held (the rules the maps held at start stay).
    pub rules: Option<PodRules>,
    pub verdicts: PodVerdicts,
}

/// Network policy on this node; cheap to clone.
#[derive(Clone)]
pub struct NodePolicy {
    inner: Arc<Inner>,
}

struct Inner {
    settings: PolicySettings,
    datapath: Arc<Mutex<Datapath>>,
    policies: Policies,
    /// AWS's ClusterNetworkPolicy (none where the cluster serves none).
    cluster_policies: ClusterPolicies,
    cluster_pods: Option<NodePods>,
    state: tokio::sync::Mutex<State>,
    /// Each problem, when first found.
    problems: tokio::sync::broadcast::Sender<Problem>,
}

struct State {
    enforcer: Enforcer,
    pods: BTreeMap<Ipv4Addr, LocalPodState>,
    /// The problems reported last, so each is said once.
    problems: Vec<Problem>,
    /// Whether the pods the maps hold were last kept as they were.
    held: bool,
}

struct LocalPodState {
    name: PodName,
    /// The pod as the API has it (labels, named ports), once known.
    seen: Option<ClusterPod>,
}

impl NodePolicy {
    /// Takes over what the maps hold and turns enforcement on once every
    /// pod in `pods` has its rules written. Fields of the policies that
    /// cannot be enforced as written go to `problems`, each when first
    /// found. Taking over another enforcer's policies
    /// (`taking_over_enforcement`), the pods wait for the cluster's
    /// policies however long they take: the other enforcer's programs
    /// judge them meanwhile, and a mode's default would not.
    #[allow(clippy::too_many_arguments)]
    pub async fn start(
        settings: PolicySettings,
        datapath: Arc<Mutex<Datapath>>,
        policies: Policies,
        cluster_policies: ClusterPolicies,
        cluster_pods: Option<NodePods>,
        pods: Vec<(Ipv4Addr, PodName)>,
        problems: tokio::sync::broadcast::Sender<Problem>,
        taking_over_enforcement: bool,
    ) -> Result<Self, DatapathError> {
        let enforcer = Enforcer::new(&lock(&datapath).maps)?;
        let node = Self {
            inner: Arc::new(Inner {
                settings,
                datapath,
                policies,
                cluster_policies,
                cluster_pods,
                state: tokio::sync::Mutex::new(State {
                    enforcer,
                    pods: BTreeMap::new(),
                    problems: Vec::new(),
                    held: false,
                }),
                problems,
            }),
        };
        if taking_over_enforcement {
            node.wait_until_listed().await;
        } else {
            node.wait_for_policies().await;
        }
        {
            let mut state = node.inner.state.lock().await;
            for (addr, name) in pods {
                let seen = node.seen(&name).await;
                state.pods.insert(addr, LocalPodState { name, seen });
            }
            node.write(&mut state)?;
        }
        {
            let mut datapath = lock(&node.inner.datapath);
            let mut config = datapath.maps.config()?;
            config.flags |= node.inner.settings.config_flags();
            datapath.maps.set_config(&config)?;
        }
        info!(mode = %node.inner.settings.mode, "network policy enforced");
        Ok(node)
    }

    /// A pod joins the node: its rules are written before this returns.
    pub async fn pod_added(&self, addr: Ipv4Addr, name: PodName) -> Result<(), DatapathError> {
        self.wait_for_policies().await;
        let seen = self.seen(&name).await;
        let mut state = self.inner.state.lock().await;
        state.pods.insert(addr, LocalPodState { name, seen });
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
        let mut policies = self.inner.policies.progress().changes();
        let mut cluster_policies = self.inner.cluster_policies.progress().changes();
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
                changed = cluster_policies.changed() => changed.is_ok(),
                changed = pods_changed => changed,
            };
            if !more {
                return;
            }
            policies.borrow_and_update();
            cluster_policies.borrow_and_update();
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

    /// Every local pod's rules, as enforced now (a pod whose rules are held
    /// from before the policies were listed has none), and what policy
    /// decided for it.
    ///
    /// # Errors
    /// The verdicts' map cannot be read.
    pub async fn snapshot(&self) -> Result<Vec<PodSnapshot>, DatapathError> {
        let state = self.inner.state.lock().await;
        let verdicts = maps::verdicts(&lock(&self.inner.datapath).maps)?;
        Ok(state
            .pods
            .iter()
            .map(|(addr, pod)| PodSnapshot {
                addr: *addr,
                name: pod.name.clone(),
                rules: state.enforcer.pod(*addr).cloned(),
                verdicts: verdicts.get(addr).copied().unwrap_or_default(),
            })
            .collect())
    }

    /// Resolves once every kind of policy followed is listed.
    async fn listed(&self) {
        self.inner.policies.progress().listed().await;
        self.inner.cluster_policies.progress().listed().await;
    }

    fn listed_now(&self) -> bool {
        self.inner.policies.progress().listed_now()
            && self.inner.cluster_policies.progress().listed_now()
    }

    async fn wait_for_policies(&self) {
        let wait = self.inner.settings.add_wait;
        if tokio::time::timeout(wait, self.listed()).await.is_err() {
            warn!(
                ?wait,
                mode = %self.inner.settings.mode,
                "the cluster's {} are not known yet: the pod gets its mode's default until they are",
                self.inner.policies.what()
            );
        }
    }

    async fn wait_until_listed(&self) {
        let wait = self.inner.settings.add_wait;
        while tokio::time::timeout(wait, self.listed()).await.is_err() {
            warn!(
                ?wait,
                "the cluster's {} are not known yet: the enforcement taken over stays as it is until they are",
                self.inner.policies.what()
            );
        }
    }

    async fn seen(&self, name: &PodName) -> Option<ClusterPod> {
        let pods = self.inner.cluster_pods.as_ref()?;
        match pods.object(&name.namespace, &name.name).await {
            Ok(pod) => Some(ClusterPod::of(&pod)),
            Err(error) => {
                debug!(%error, pod = %format!("{}/{}", name.namespace, name.name), "the pod is not known: selected by the controller's lists only");
                None
            }
        }
    }

    /// Every local pod's rules from the policies known now, into the maps.
    fn write(&self, state: &mut State) -> Result<(), DatapathError> {
        // The pods as the pods' watch has them now; one read at ADD until
        // it delivers the pod.
        if let Some(cluster_pods) = &self.inner.cluster_pods {
            for pod in state.pods.values_mut() {
                if let Some(object) = cluster_pods.cached(&pod.name.namespace, &pod.name.name) {
                    pod.seen = Some(ClusterPod::of(&object));
                }
            }
        }
        let mut problems = Vec::new();
        let selected = match &self.inner.policies {
            Policies::Endpoints(policies) => from_endpoints(policies, &state.pods, &mut problems),
            Policies::NetworkPolicies(sources) => {
                from_network_policies(sources, &state.pods, &mut problems)
            }
        };
        let cluster_rules = self.cluster_rules(&state.pods, &mut problems);
        let rules = selected
            .into_iter()
            .map(|(addr, selected)| {
                let mut rules = match selected {
                    Some(rules) => PodRules {
                        selected: true,
                        ..rules
                    },
                    None => match self.inner.settings.mode {
                        EnforcingMode::Standard => PodRules::default(),
                        EnforcingMode::Strict => PodRules::deny_all(),
                    },
                };
                if let Some((ingress, egress)) = cluster_rules.get(&addr) {
                    rules.cluster_ingress.clone_from(ingress);
                    rules.cluster_egress.clone_from(egress);
                }
                (addr, rules)
            })
            .collect();
        problems.sort();
        problems.dedup();
        for problem in &problems {
            if !state.problems.contains(problem) {
                warn!("{problem}");
                // No one listening (no API server) is no error.
                let _ = self.inner.problems.send(problem.clone());
            }
        }
        state.problems = problems;
        // Until the policies are listed (the API server away at start),
        // the rules the maps hold are the last ones known: a pod they hold
        // keeps them, and only a pod they do not gets its mode's default.
        let held: BTreeSet<Ipv4Addr> = if self.listed_now() {
            BTreeSet::new()
        } else {
            state.pods.keys().copied().collect()
        };
        state.enforcer.set_pods(rules, held);
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
        let held = state.enforcer.held_pods();
        if held > 0 && !state.held {
            warn!(
                pods = held,
                "the cluster's {} are not known yet: {HELD} until they are",
                self.inner.policies.what()
            );
        }
        state.held = held > 0;
        if revoked > 0 {
            info!(revoked, "connections a policy change denies were stopped");
        }
        Ok(())
    }
}

/// Each local pod's cluster rules, ingress and egress.
type ClusterRules = BTreeMap<Ipv4Addr, (Vec<ClusterRule>, Vec<ClusterRule>)>;

impl NodePolicy {
    /// What the cluster policies say of each local pod.
    fn cluster_rules(
        &self,
        pods: &BTreeMap<Ipv4Addr, LocalPodState>,
        problems: &mut Vec<Problem>,
    ) -> ClusterRules {
        match &self.inner.cluster_policies {
            ClusterPolicies::Endpoints(endpoints) => {
                let all = endpoints.all();
                let named: Vec<cluster_endpoints::Named<'_>> = all
                    .iter()
                    .map(|cpe| cluster_endpoints::Named {
                        name: cpe.metadata.name.as_deref().unwrap_or_default(),
                        spec: &cpe.spec,
                    })
                    .collect();
                pods.iter()
                    .map(|(addr, pod)| {
                        let local = cluster_endpoints::LocalPod {
                            addr: *addr,
                            namespace: &pod.name.namespace,
                            name: &pod.name.name,
                        };
                        let rules =
                            cluster_endpoints::pod_rules(named.iter().copied(), &local, problems);
                        (*addr, rules)
                    })
                    .collect()
            }
            ClusterPolicies::Resolved(policies) => {
                let Policies::NetworkPolicies(sources) = &self.inner.policies else {
                    return ClusterRules::new();
                };
                let all = policies.all();
                let named: Vec<cluster_policies::Named<'_>> = all
                    .iter()
                    .map(|cnp| cluster_policies::Named {
                        name: cnp.metadata.name.as_deref().unwrap_or_default(),
                        spec: &cnp.spec,
                    })
                    .collect();
                let cluster = cluster_of(sources, pods);
                pods.iter()
                    .filter_map(|(addr, pod)| {
                        // A pod's labels and ports, once the API has it.
                        let mut seen = pod.seen.clone()?;
                        seen.addr = Some(*addr);
                        let rules = cluster_policies::pod_rules(
                            named.iter().copied(),
                            &cluster,
                            &seen,
                            problems,
                        );
                        Some((*addr, rules))
                    })
                    .collect()
            }
        }
    }
}

fn local_pod(addr: Ipv4Addr, pod: &LocalPodState) -> LocalPod<'_> {
    LocalPod {
        addr,
        namespace: &pod.name.namespace,
        labels: pod.seen.as_ref().map(|seen| &seen.labels),
    }
}

/// What the PolicyEndpoints that select each local pod say of it.
fn from_endpoints(
    policies: &PolicyEndpoints,
    pods: &BTreeMap<Ipv4Addr, LocalPodState>,
    problems: &mut Vec<Problem>,
) -> Vec<(Ipv4Addr, Option<PodRules>)> {
    let all = policies.all();
    let named: Vec<Named<'_>> = all
        .iter()
        .map(|pe| Named {
            namespace: pe.metadata.namespace.as_deref().unwrap_or_default(),
            name: pe.metadata.name.as_deref().unwrap_or_default(),
            spec: &pe.spec,
        })
        .collect();
    pods.iter()
        .map(|(addr, pod)| {
            let local = local_pod(*addr, pod);
            let rules = endpoints::pod_rules(named.iter().copied(), &local, problems);
            (*addr, rules)
        })
        .collect()
}

/// What the NetworkPolicy objects that select each local pod say of it, resolved
/// against the cluster, this node's pods at the addresses they were given
/// (before kubelet reports them).
fn from_network_policies(
    sources: &NetworkPolicySources,
    pods: &BTreeMap<Ipv4Addr, LocalPodState>,
    problems: &mut Vec<Problem>,
) -> Vec<(Ipv4Addr, Option<PodRules>)> {
    let cluster = cluster_of(sources, pods);
    let policies = sources.policies();
    let resolved = Resolved::new(policies.iter().map(|p| &**p), &cluster, problems);
    pods.iter()
        .map(|(addr, pod)| {
            let ports = pod.seen.as_ref().map_or(&[][..], |seen| &seen.ports);
            let rules = resolved.pod_rules(&local_pod(*addr, pod), ports, problems);
            (*addr, rules)
        })
        .collect()
}

/// The cluster as policy reads it, this node's pods at the addresses they
/// were given (before kubelet reports them).
fn cluster_of(sources: &NetworkPolicySources, pods: &BTreeMap<Ipv4Addr, LocalPodState>) -> Cluster {
    let mut cluster = Cluster {
        namespaces: sources
            .namespaces()
            .iter()
            .map(|ns| {
                let name = ns.metadata.name.clone().unwrap_or_default();
                (name, ns.metadata.labels.clone().unwrap_or_default())
            })
            .collect(),
        pods: sources.pods().iter().map(|p| ClusterPod::of(p)).collect(),
    };
    let local: BTreeMap<(&str, &str), Ipv4Addr> = pods
        .iter()
        .map(|(addr, pod)| ((pod.name.namespace.as_str(), pod.name.name.as_str()), *addr))
        .collect();
    // A local pod is at the address it was given; no other pod is there.
    cluster.pods.retain(|p| {
        !local.contains_key(&(p.namespace.as_str(), p.name.as_str()))
            && p.addr.is_none_or(|addr| !pods.contains_key(&addr))
    });
    cluster.pods.extend(pods.iter().filter_map(|(addr, pod)| {
        let mut seen = pod.seen.clone()?;
        seen.addr = Some(*addr);
        Some(seen)
    }));
    cluster
}

fn lock(datapath: &Mutex<Datapath>) -> std::sync::MutexGuard<'_, Datapath> {
    // A panic elsewhere leaves the maps as they were: usable.
    datapath
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
