//! The lab's network policy controller: what EKS's control plane runs
//! (amazon-network-policy-controller-k8s) to turn each NetworkPolicy into
//! PolicyEndpoints for the nodes' agents. It runs inside the API server
//! process, on its store, so it is on whenever the lab's cluster is.
//!
//! Written from the API's definition of NetworkPolicy and from what the
//! EKS controller is known to write; it shares nothing with the agent's own
//! resolver, so tests can hold one against the other. What it does:
//!
//! - one or more PolicyEndpoints per policy, in its namespace, named
//!   `<policy>-xxxxx` (`generateName`), owned by the policy; `policyRef`,
//!   `podSelector` (copied), `podIsolation` (the defaulted `policyTypes`);
//! - `podSelectorEndpoints`: the selected pods that have an address and do
//!   not use the host's network;
//! - ingress and egress `EndpointInfo`s: a pod peer is its address (no
//!   mask), an `ipBlock` its CIDR and exceptions, a rule without peers
//!   `0.0.0.0/0` and `::/0`; ports with their protocol (TCP when missing),
//!   named ports resolved against container ports (ingress: the selected
//!   pods'; egress: each peer pod's, and dropped for CIDR peers); a rule
//!   whose ports all fail to resolve gives nothing;
//! - lists of [`CHUNK`] entries at most per object; objects updated in
//!   place, the ones no longer needed deleted, and those of a deleted
//!   policy deleted too (the garbage collector's work in a real cluster).
//!
//! Left out: Services' cluster IPs in egress (EKS adds them), the
//! finalizer EKS puts on policies, its `last-change-trigger-time`
//! annotation. AWS's ClusterNetworkPolicy is resolved beside, in the same
//! passes ([`super::cluster_policy_controller`]).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;
use tracing::{debug, info, warn};
use vpcnet_api::policy_endpoint::{
    self as pe, CHUNK, EndpointInfo, LabelSelector, PodEndpoint, PolicyEndpointSpec,
    PolicyReference, Port,
};

use super::{
    resources::{self, Resource},
    selector::Selector,
    store::{Change, Store},
};

/// The annotation with a pod's addresses when its status has none yet
/// (the EKS controller reads it too).
const POD_IPS_ANNOTATION: &str = "vpc.amazonaws.com/pod-ips";
const ALL_V4: &str = "0.0.0.0/0";
const ALL_V6: &str = "::/0";
const NETWORK_POLICY_API: &str = "networking.k8s.io/v1";

/// Why a policy cannot be resolved (it is then left as it was).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("the policy cannot be read: {0}")]
    Unreadable(String),
    #[error("a label selector has the operator {0:?}, which the API does not define")]
    Operator(String),
}

/// A container port a named port can resolve to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerPort {
    pub name: String,
    pub port: i32,
    pub protocol: String,
}

/// A pod as the resolution reads it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Its address; `None` while it has none (not network-ready).
    pub ip: Option<String>,
    pub host_ip: String,
    pub host_network: bool,
    pub container_ports: Vec<ContainerPort>,
}

pub(super) fn str_at<'a>(object: &'a Value, pointer: &str) -> Option<&'a str> {
    object
        .pointer(pointer)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

fn labels_of(object: &Value) -> BTreeMap<String, String> {
    object
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .map(|labels| {
            labels
                .iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

impl PodView {
    /// Reads a Pod object. A pod that has finished is not network-ready.
    pub fn from_object(pod: &Value) -> Self {
        let finished = matches!(str_at(pod, "/status/phase"), Some("Succeeded" | "Failed"));
        let annotated = || {
            let ips = str_at(
                pod,
                &format!("/metadata/annotations/{}", escape(POD_IPS_ANNOTATION)),
            )?;
            ips.split(',')
                .map(str::trim)
                .find(|ip| !ip.is_empty())
                .map(str::to_owned)
        };
        let ip = str_at(pod, "/status/podIP")
            .map(str::to_owned)
            .or_else(annotated)
            .filter(|_| !finished);
        let containers = pod.pointer("/spec/containers").and_then(Value::as_array);
        let container_ports = containers
            .into_iter()
            .flatten()
            .filter_map(|c| c.get("ports").and_then(Value::as_array))
            .flatten()
            .filter_map(|p| {
                Some(ContainerPort {
                    name: p.get("name")?.as_str()?.to_owned(),
                    port: i32::try_from(p.get("containerPort")?.as_i64()?).ok()?,
                    protocol: p
                        .get("protocol")
                        .and_then(Value::as_str)
                        .unwrap_or("TCP")
                        .to_owned(),
                })
            })
            .collect();
        Self {
            namespace: str_at(pod, "/metadata/namespace")
                .unwrap_or_default()
                .to_owned(),
            name: str_at(pod, "/metadata/name").unwrap_or_default().to_owned(),
            labels: labels_of(pod),
            ip,
            host_ip: str_at(pod, "/status/hostIP").unwrap_or_default().to_owned(),
            host_network: pod
                .pointer("/spec/hostNetwork")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            container_ports,
        }
    }
}

/// A JSON pointer's escaping of one key.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The cluster the policies are resolved against.
#[derive(Debug, Clone, Default)]
pub struct Cluster {
    pub pods: Vec<PodView>,
    /// Every namespace with its labels.
    pub namespaces: BTreeMap<String, BTreeMap<String, String>>,
}

impl Cluster {
    /// Reads Pod and Namespace objects.
    pub fn from_objects(pods: &[Value], namespaces: &[Value]) -> Self {
        let mut pods: Vec<PodView> = pods.iter().map(PodView::from_object).collect();
        pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let namespaces = namespaces
            .iter()
            .filter_map(|ns| Some((str_at(ns, "/metadata/name")?.to_owned(), labels_of(ns))))
            .collect();
        Self { pods, namespaces }
    }
}

// A NetworkPolicy as this controller reads it (its own reading, on purpose:
// see the module's documentation).

#[derive(Debug, Deserialize)]
struct NetworkPolicy {
    metadata: Metadata,
    #[serde(default)]
    spec: NetworkPolicySpec,
}

#[derive(Debug, Deserialize)]
struct Metadata {
    name: String,
    #[serde(default)]
    namespace: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkPolicySpec {
    #[serde(default)]
    pod_selector: LabelSelector,
    #[serde(default)]
    policy_types: Vec<String>,
    #[serde(default)]
    ingress: Vec<Rule>,
    #[serde(default)]
    egress: Vec<Rule>,
}

/// An ingress rule (`from`) or an egress rule (`to`).
#[derive(Debug, Default, Deserialize)]
struct Rule {
    #[serde(default)]
    ports: Vec<PolicyPort>,
    #[serde(default, alias = "to")]
    from: Vec<Peer>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Peer {
    pod_selector: Option<LabelSelector>,
    namespace_selector: Option<LabelSelector>,
    ip_block: Option<IpBlock>,
}

#[derive(Debug, Deserialize)]
struct IpBlock {
    cidr: String,
    #[serde(default)]
    except: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PolicyPort {
    protocol: Option<String>,
    port: Option<IntOrName>,
    end_port: Option<i32>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum IntOrName {
    Int(i32),
    Name(String),
}

/// Whether `labels` satisfy `selector` (the API's semantics; an empty
/// selector selects everything).
pub(super) fn selects(
    selector: &LabelSelector,
    labels: &BTreeMap<String, String>,
) -> Result<bool, ResolveError> {
    for (key, value) in &selector.match_labels {
        if labels.get(key) != Some(value) {
            return Ok(false);
        }
    }
    for requirement in &selector.match_expressions {
        let value = labels.get(&requirement.key);
        let listed = value.is_some_and(|v| requirement.values.iter().any(|x| x == v));
        let holds = match requirement.operator.as_str() {
            "In" => listed,
            "NotIn" => !listed,
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => return Err(ResolveError::Operator(other.to_owned())),
        };
        if !holds {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The ports of a rule, resolved against `pods`' container ports (named
/// ports resolve to nothing without pods). `None`: the rule names ports and
/// none resolved, so it allows nothing. An empty list: every port.
fn resolve_ports(ports: &[PolicyPort], pods: &[&PodView]) -> Option<Vec<Port>> {
    if ports.is_empty() {
        return Some(Vec::new());
    }
    let mut resolved: Vec<Port> = Vec::new();
    let mut push = |port: Port| {
        if !resolved.contains(&port) {
            resolved.push(port);
        }
    };
    for port in ports {
        let protocol = port.protocol.clone().unwrap_or_else(|| "TCP".to_owned());
        match &port.port {
            None => push(Port {
                protocol: Some(protocol),
                port: None,
                end_port: None,
            }),
            Some(IntOrName::Int(number)) => push(Port {
                protocol: Some(protocol),
                port: Some(*number),
                end_port: port.end_port,
            }),
            Some(IntOrName::Name(name)) => {
                for pod in pods {
                    for container in &pod.container_ports {
                        if container.name == *name && container.protocol == protocol {
                            push(Port {
                                protocol: Some(protocol.clone()),
                                port: Some(container.port),
                                end_port: None,
                            });
                        }
                    }
                }
            }
        }
    }
    (!resolved.is_empty()).then_some(resolved)
}

fn entry(cidr: &str, except: &[String], ports: &[Port]) -> EndpointInfo {
    EndpointInfo {
        cidr: cidr.to_owned(),
        except: except.to_vec(),
        ports: ports.to_vec(),
        domain_name: String::new(),
    }
}

/// A policy resolved, before it is cut into objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub policy_ref: PolicyReference,
    pub pod_selector: LabelSelector,
    pub pod_isolation: Vec<String>,
    pub endpoints: Vec<PodEndpoint>,
    pub ingress: Vec<EndpointInfo>,
    pub egress: Vec<EndpointInfo>,
}

impl Cluster {
    /// The network-ready pods a peer selects (`policy_ns`: the policy's).
    fn peer_pods(
        &self,
        pod_selector: Option<&LabelSelector>,
        namespace_selector: Option<&LabelSelector>,
        policy_ns: &str,
    ) -> Result<Vec<&PodView>, ResolveError> {
        let mut namespaces = Vec::new();
        match namespace_selector {
            None => namespaces.push(policy_ns),
            Some(selector) => {
                for (name, labels) in &self.namespaces {
                    if selects(selector, labels)? {
                        namespaces.push(name);
                    }
                }
            }
        }
        let mut pods = Vec::new();
        for pod in &self.pods {
            if pod.ip.is_none() || !namespaces.contains(&pod.namespace.as_str()) {
                continue;
            }
            if pod_selector.map_or(Ok(true), |s| selects(s, &pod.labels))? {
                pods.push(pod);
            }
        }
        Ok(pods)
    }
}

/// Resolves one NetworkPolicy object against `cluster`.
pub fn resolve(policy: &Value, cluster: &Cluster) -> Result<Resolved, ResolveError> {
    let policy: NetworkPolicy = serde_json::from_value(policy.clone())
        .map_err(|err| ResolveError::Unreadable(err.to_string()))?;
    let ns = policy.metadata.namespace.as_str();
    let spec = &policy.spec;

    let mut selected = Vec::new();
    for pod in &cluster.pods {
        if pod.namespace == ns
            && pod.ip.is_some()
            && !pod.host_network
            && selects(&spec.pod_selector, &pod.labels)?
        {
            selected.push(pod);
        }
    }
    let endpoints = selected
        .iter()
        .map(|pod| PodEndpoint {
            host_ip: pod.host_ip.clone(),
            pod_ip: pod.ip.clone().unwrap_or_default(),
            name: pod.name.clone(),
            namespace: pod.namespace.clone(),
        })
        .collect();

    let mut ingress = Vec::new();
    for rule in &spec.ingress {
        // Named ports name the destination's ports: the selected pods'.
        let Some(ports) = resolve_ports(&rule.ports, &selected) else {
            continue;
        };
        if rule.from.is_empty() {
            ingress.push(entry(ALL_V4, &[], &ports));
            ingress.push(entry(ALL_V6, &[], &ports));
        }
        for peer in &rule.from {
            if let Some(block) = &peer.ip_block {
                ingress.push(entry(&block.cidr, &block.except, &ports));
                continue;
            }
            let pods = cluster.peer_pods(
                peer.pod_selector.as_ref(),
                peer.namespace_selector.as_ref(),
                ns,
            )?;
            for pod in pods {
                ingress.push(entry(pod.ip.as_deref().unwrap_or_default(), &[], &ports));
            }
        }
    }

    let mut egress = Vec::new();
    for rule in &spec.egress {
        // Without pods, only numeric ports stay.
        let numeric = resolve_ports(&rule.ports, &[]);
        if rule.from.is_empty()
            && let Some(ports) = &numeric
        {
            egress.push(entry(ALL_V4, &[], ports));
            egress.push(entry(ALL_V6, &[], ports));
        }
        for peer in &rule.from {
            if let Some(block) = &peer.ip_block {
                if let Some(ports) = &numeric {
                    egress.push(entry(&block.cidr, &block.except, ports));
                }
                continue;
            }
            let pods = cluster.peer_pods(
                peer.pod_selector.as_ref(),
                peer.namespace_selector.as_ref(),
                ns,
            )?;
            for pod in pods {
                // Named ports name each destination's own ports.
                if let Some(ports) = resolve_ports(&rule.ports, &[pod]) {
                    egress.push(entry(pod.ip.as_deref().unwrap_or_default(), &[], &ports));
                }
            }
        }
    }

    let pod_isolation = if spec.policy_types.is_empty() {
        // The API server's default, for a policy stored without it.
        let mut types = vec![pe::ISOLATION_INGRESS.to_owned()];
        if !spec.egress.is_empty() {
            types.push(pe::ISOLATION_EGRESS.to_owned());
        }
        types
    } else {
        spec.policy_types.clone()
    };
    Ok(Resolved {
        policy_ref: PolicyReference {
            name: policy.metadata.name.clone(),
            namespace: ns.to_owned(),
        },
        pod_selector: spec.pod_selector.clone(),
        pod_isolation,
        endpoints,
        ingress: merge(ingress),
        egress: merge(egress),
    })
}

/// Entries for the same CIDR and exceptions become one: every port if
/// either allows every port, else the union of their ports.
fn merge(entries: Vec<EndpointInfo>) -> Vec<EndpointInfo> {
    let mut merged: Vec<EndpointInfo> = Vec::new();
    for mut entry in entries {
        entry.except.sort();
        match merged
            .iter_mut()
            .find(|e| e.cidr == entry.cidr && e.except == entry.except)
        {
            None => merged.push(entry),
            Some(existing) => add_ports(&mut existing.ports, entry.ports),
        }
    }
    merged
}

/// `more` added to `ports`, where no ports is every port.
pub(super) fn add_ports(ports: &mut Vec<Port>, more: Vec<Port>) {
    if ports.is_empty() {
        return;
    }
    if more.is_empty() {
        ports.clear();
        return;
    }
    for port in more {
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
}

/// The `n`-th chunk of `list`.
pub(super) fn part<T: Clone>(list: &[T], n: usize) -> Vec<T> {
    list.iter().skip(n * CHUNK).take(CHUNK).cloned().collect()
}

/// How many objects lists of these lengths take, [`CHUNK`] entries each at
/// most: one at least.
pub(super) fn objects_for(lens: [usize; 3]) -> usize {
    lens.into_iter()
        .map(|len| len.div_ceil(CHUNK))
        .max()
        .unwrap_or(0)
        .max(1)
}

/// The objects' specs: each list cut into [`CHUNK`]s, the n-th object
/// taking the n-th chunk of each; one object at least.
pub fn chunk(resolved: &Resolved) -> Vec<PolicyEndpointSpec> {
    let count = objects_for([
        resolved.endpoints.len(),
        resolved.ingress.len(),
        resolved.egress.len(),
    ]);
    (0..count)
        .map(|n| PolicyEndpointSpec {
            pod_selector: Some(resolved.pod_selector.clone()),
            policy_ref: resolved.policy_ref.clone(),
            pod_isolation: resolved.pod_isolation.clone(),
            pod_selector_endpoints: part(&resolved.endpoints, n),
            ingress: part(&resolved.ingress, n),
            egress: part(&resolved.egress, n),
        })
        .collect()
}

/// What to write for one policy, given its objects (by name) and the
/// specs wanted.
#[derive(Debug, PartialEq, Eq)]
pub struct Plan<S = PolicyEndpointSpec> {
    /// Existing objects whose spec changes.
    pub update: Vec<(String, S)>,
    pub create: Vec<S>,
    pub delete: Vec<String>,
}

impl<S> Default for Plan<S> {
    fn default() -> Self {
        Self {
            update: Vec::new(),
            create: Vec::new(),
            delete: Vec::new(),
        }
    }
}

/// Existing objects (in name order) take the wanted specs in turn; the
/// rest are created, or deleted.
pub fn plan<S: PartialEq>(existing: &[(String, Option<S>)], wanted: Vec<S>) -> Plan<S> {
    let mut existing: Vec<_> = existing.iter().collect();
    existing.sort_by(|a, b| a.0.cmp(&b.0));
    let mut plan = Plan::default();
    let mut wanted = wanted.into_iter();
    for (name, current) in existing {
        match wanted.next() {
            Some(spec) if current.as_ref() == Some(&spec) => {}
            Some(spec) => plan.update.push((name.clone(), spec)),
            None => plan.delete.push(name.clone()),
        }
    }
    plan.create.extend(wanted);
    plan
}

pub(super) fn find(group: &str, version: &str, plural: &str) -> &'static Resource {
    resources::find(group, version, plural).expect("a served resource")
}

/// The NetworkPolicy (uid) that controls a PolicyEndpoint object.
fn owner_uid(object: &Value) -> Option<&str> {
    object
        .pointer("/metadata/ownerReferences")?
        .as_array()?
        .iter()
        .find(|r| {
            r.get("kind").and_then(Value::as_str) == Some("NetworkPolicy")
                && r.get("apiVersion").and_then(Value::as_str) == Some(NETWORK_POLICY_API)
        })?
        .get("uid")?
        .as_str()
}

/// One pass: every policy's objects made what they should be. Returns the
/// store's revision after it.
pub fn sync(store: &mut Store) -> u64 {
    let all = Selector::default();
    let policies_res = find("networking.k8s.io", "v1", "networkpolicies");
    let endpoints_res = find(pe::GROUP, pe::VERSION, pe::PLURAL);
    let policies = store.list(policies_res, None, &all, &all);
    let cluster = Cluster::from_objects(
        &store.list(find("", "v1", "pods"), None, &all, &all),
        &store.list(find("", "v1", "namespaces"), None, &all, &all),
    );
    let objects = store.list(endpoints_res, None, &all, &all);
    let uid_of = |o: &Value| str_at(o, "/metadata/uid").unwrap_or_default().to_owned();
    let live: Vec<String> = policies.iter().map(uid_of).collect();

    for policy in &policies {
        let uid = uid_of(policy);
        let ns = str_at(policy, "/metadata/namespace").unwrap_or_default();
        let name = str_at(policy, "/metadata/name").unwrap_or_default();
        let resolved = match resolve(policy, &cluster) {
            Ok(resolved) => resolved,
            Err(err) => {
                warn!(policy = %format!("{ns}/{name}"), %err, "the policy is left as it was");
                continue;
            }
        };
        let owned: Vec<&Value> = objects
            .iter()
            .filter(|o| owner_uid(o) == Some(uid.as_str()))
            .collect();
        let existing: Vec<(String, Option<PolicyEndpointSpec>)> = owned
            .iter()
            .map(|o| {
                let spec = o
                    .get("spec")
                    .and_then(|s| serde_json::from_value(s.clone()).ok());
                (
                    str_at(o, "/metadata/name").unwrap_or_default().to_owned(),
                    spec,
                )
            })
            .collect();
        let plan = plan(&existing, chunk(&resolved));
        for (object_name, spec) in plan.update {
            let Some(current) = owned
                .iter()
                .find(|o| str_at(o, "/metadata/name") == Some(object_name.as_str()))
            else {
                continue;
            };
            let mut object = (*current).clone();
            object["spec"] = serde_json::to_value(&spec).expect("serializes");
            match store.update(endpoints_res, Some(ns), &object_name, object) {
                Ok(_) => debug!(policy = %format!("{ns}/{name}"), object = %object_name, "updated"),
                Err(err) => warn!(object = %object_name, %err, "updating a PolicyEndpoint"),
            }
        }
        for spec in plan.create {
            let object = json!({
                "apiVersion": format!("{}/{}", pe::GROUP, pe::VERSION),
                "kind": pe::KIND,
                "metadata": {
                    "generateName": format!("{name}-"),
                    "namespace": ns,
                    "ownerReferences": [{
                        "apiVersion": NETWORK_POLICY_API,
                        "kind": "NetworkPolicy",
                        "name": name,
                        "uid": uid,
                        "controller": true,
                        "blockOwnerDeletion": true,
                    }],
                },
                "spec": spec,
            });
            match store.create(endpoints_res, Some(ns), object) {
                Ok(made) => info!(
                    policy = %format!("{ns}/{name}"),
                    object = str_at(&made, "/metadata/name").unwrap_or_default(),
                    "created a PolicyEndpoint"
                ),
                Err(err) => {
                    warn!(policy = %format!("{ns}/{name}"), %err, "creating a PolicyEndpoint");
                }
            }
        }
        for object_name in plan.delete {
            delete(store, endpoints_res, ns, &object_name);
        }
    }
    // Those of policies that are gone: what the garbage collector does
    // with owned objects.
    for object in &objects {
        if owner_uid(object).is_some_and(|uid| !live.iter().any(|l| l == uid)) {
            let ns = str_at(object, "/metadata/namespace").unwrap_or_default();
            let name = str_at(object, "/metadata/name").unwrap_or_default();
            delete(store, endpoints_res, ns, name);
        }
    }
    store.revision()
}

fn delete(store: &mut Store, resource: &'static Resource, ns: &str, name: &str) {
    match store.delete(resource, Some(ns), name) {
        Ok(_) => info!(object = %format!("{ns}/{name}"), "deleted a PolicyEndpoint"),
        Err(err) => warn!(object = %format!("{ns}/{name}"), %err, "deleting a PolicyEndpoint"),
    }
}

/// Whether a change can change some policy's objects.
fn relevant(change: &Change) -> bool {
    matches!(
        (change.resource.group, change.resource.plural),
        ("", "pods" | "namespaces")
            | ("networking.k8s.io", "networkpolicies")
            | (pe::GROUP, pe::PLURAL)
    ) || super::cluster_policy_controller::relevant(change)
}

/// Runs the controller on `store` until the process ends: a pass at start,
/// then one after each relevant change (changes that come together are
/// taken in one pass; a pass's own writes start none).
pub async fn run(store: &std::sync::Mutex<Store>) {
    let lock = || {
        store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    let (mut live, mut synced) = {
        let mut store = lock();
        let live = store
            .subscribe(store.revision())
            .expect("the current revision is in the history")
            .live;
        let synced = sync(&mut store);
        (
            live,
            super::cluster_policy_controller::sync(&mut store).max(synced),
        )
    };
    info!("the network policy controller runs");
    loop {
        match live.recv().await {
            Ok(change) if change.revision <= synced || !relevant(&change) => continue,
            Ok(_) | Err(RecvError::Lagged(_)) => {}
            Err(RecvError::Closed) => return,
        }
        let mut store = lock();
        sync(&mut store);
        synced = super::cluster_policy_controller::sync(&mut store);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, ip: &str, labels: &[(&str, &str)]) -> PodView {
        PodView {
            namespace: ns.to_owned(),
            name: name.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ip: (!ip.is_empty()).then(|| ip.to_owned()),
            host_ip: "10.20.11.162".to_owned(),
            host_network: false,
            container_ports: Vec::new(),
        }
    }

    fn cluster(pods: Vec<PodView>) -> Cluster {
        let namespaces = [("x", "blue"), ("y", "red"), ("z", "blue")]
            .into_iter()
            .map(|(ns, team)| {
                (
                    ns.to_owned(),
                    BTreeMap::from([
                        ("kubernetes.io/metadata.name".to_owned(), ns.to_owned()),
                        ("team".to_owned(), team.to_owned()),
                    ]),
                )
            })
            .collect();
        Cluster { pods, namespaces }
    }

    fn policy(spec: Value) -> Value {
        let mut policy = json!({"metadata": {"name": "p", "namespace": "x"}});
        policy["spec"] = spec;
        policy
    }

    fn tcp(port: i32) -> Port {
        Port {
            protocol: Some("TCP".into()),
            port: Some(port),
            end_port: None,
        }
    }

    fn cidrs(entries: &[EndpointInfo]) -> Vec<&str> {
        entries.iter().map(|e| e.cidr.as_str()).collect()
    }

    fn sample() -> Cluster {
        let mut web = pod("x", "web", "10.20.11.20", &[("app", "web")]);
        web.container_ports.push(ContainerPort {
            name: "http".into(),
            port: 8080,
            protocol: "TCP".into(),
        });
        let mut host = pod("x", "host", "10.20.11.162", &[("app", "web")]);
        host.host_network = true;
        let mut db = pod("y", "db", "10.20.11.22", &[("app", "db")]);
        db.container_ports.push(ContainerPort {
            name: "sql".into(),
            port: 5432,
            protocol: "TCP".into(),
        });
        cluster(vec![
            web,
            host,
            pod("x", "pending", "", &[("app", "web")]),
            pod("x", "client", "10.20.11.21", &[("app", "client")]),
            db,
            pod("z", "client", "10.20.11.23", &[("app", "client")]),
        ])
    }

    #[test]
    fn selected_pods_are_those_with_an_address_off_the_hosts_network() {
        let resolved = resolve(
            &policy(json!({"podSelector": {"matchLabels": {"app": "web"}}})),
            &sample(),
        )
        .unwrap();
        let names: Vec<_> = resolved.endpoints.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["web"]);
        assert_eq!(resolved.endpoints[0].pod_ip, "10.20.11.20");
        assert_eq!(resolved.endpoints[0].host_ip, "10.20.11.162");
        // Ingress only: isolated, no rules.
        assert_eq!(resolved.pod_isolation, ["Ingress"]);
        assert!(resolved.ingress.is_empty() && resolved.egress.is_empty());
    }

    #[test]
    fn pod_peers_follow_the_and_and_or_forms() {
        let cluster = sample();
        // One peer with both selectors: client pods of the blue namespaces.
        let and = resolve(
            &policy(json!({"podSelector": {}, "ingress": [{"from": [
                {"namespaceSelector": {"matchLabels": {"team": "blue"}},
                 "podSelector": {"matchLabels": {"app": "client"}}}
            ]}]})),
            &cluster,
        )
        .unwrap();
        assert_eq!(cidrs(&and.ingress), ["10.20.11.21", "10.20.11.23"]);
        // Two peers: every pod of blue namespaces, or client pods of x.
        let or = resolve(
            &policy(json!({"podSelector": {}, "ingress": [{"from": [
                {"namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["red"]}]}},
                {"podSelector": {"matchLabels": {"app": "client"}}}
            ]}]})),
            &cluster,
        )
        .unwrap();
        assert_eq!(cidrs(&or.ingress), ["10.20.11.22", "10.20.11.21"]);
        assert!(or.ingress.iter().all(|e| e.ports.is_empty()));
        let bad = resolve(
            &policy(
                json!({"podSelector": {"matchExpressions": [{"key": "a", "operator": "Like"}]}}),
            ),
            &cluster,
        );
        assert_eq!(bad, Err(ResolveError::Operator("Like".into())));
    }

    #[test]
    fn ports_default_to_tcp_and_named_ports_resolve_by_direction() {
        let cluster = sample();
        let resolved = resolve(
            &policy(json!({"podSelector": {"matchLabels": {"app": "web"}},
                "ingress": [
                    {"ports": [{"port": "http"}, {"port": 9000, "endPort": 9010, "protocol": "UDP"}]},
                    {"ports": [{"port": "nothing"}], "from": [{"podSelector": {}}]}
                ],
                "egress": [
                    {"ports": [{"port": "sql"}],
                     "to": [{"namespaceSelector": {}}, {"ipBlock": {"cidr": "192.0.2.0/24"}}]},
                    {"ports": [{"port": 53, "protocol": "UDP"}, {"port": "dns"}]}
                ],
                "policyTypes": ["Ingress", "Egress"]})),
            &cluster,
        )
        .unwrap();
        let ingress_ports = vec![
            tcp(8080),
            Port {
                protocol: Some("UDP".into()),
                port: Some(9000),
                end_port: Some(9010),
            },
        ];
        // No peers: everything, both families; the second rule's named port
        // resolves nowhere, so the rule gives nothing.
        assert_eq!(
            resolved.ingress,
            vec![
                entry(ALL_V4, &[], &ingress_ports),
                entry(ALL_V6, &[], &ingress_ports)
            ]
        );
        // Egress: only db has `sql`; the ipBlock peer gets no named port,
        // so nothing; the rule without peers keeps its numeric port.
        let udp53 = Port {
            protocol: Some("UDP".into()),
            port: Some(53),
            end_port: None,
        };
        assert_eq!(
            resolved.egress,
            vec![
                entry("10.20.11.22", &[], &[tcp(5432)]),
                entry(ALL_V4, &[], std::slice::from_ref(&udp53)),
                entry(ALL_V6, &[], &[udp53]),
            ]
        );
        assert_eq!(resolved.pod_isolation, ["Ingress", "Egress"]);
    }

    #[test]
    fn ip_blocks_keep_their_exceptions_and_duplicates_merge() {
        let resolved = resolve(
            &policy(json!({"podSelector": {}, "egress": [
                {"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.2.0.0/16", "10.1.0.0/16"]}}],
                 "ports": [{"port": 80}]},
                {"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16", "10.2.0.0/16"]}}],
                 "ports": [{"port": 443}]},
                {"to": [{"podSelector": {"matchLabels": {"app": "client"}}}], "ports": [{"port": 80}]},
                {"to": [{"podSelector": {"matchLabels": {"app": "client"}}}]}
            ]})),
            &sample(),
        )
        .unwrap();
        assert_eq!(
            resolved.egress,
            vec![
                entry(
                    "10.0.0.0/8",
                    &["10.1.0.0/16".into(), "10.2.0.0/16".into()],
                    &[tcp(80), tcp(443)]
                ),
                // Every port wins over port 80.
                entry("10.20.11.21", &[], &[]),
            ]
        );
        // Egress rules given, no policyTypes: both, as the API defaults.
        assert_eq!(resolved.pod_isolation, ["Ingress", "Egress"]);
    }

    #[test]
    fn long_lists_are_cut_into_chunks_and_objects_are_reused_in_name_order() {
        let pods = (0..450)
            .map(|i| {
                pod(
                    "x",
                    &format!("p{i:03}"),
                    &format!("10.1.{}.{}", i / 250, i % 250),
                    &[],
                )
            })
            .collect();
        let resolved = resolve(
            &policy(json!({"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}]}]})),
            &cluster(pods),
        )
        .unwrap();
        let specs = chunk(&resolved);
        let lens: Vec<_> = specs
            .iter()
            .map(|s| (s.pod_selector_endpoints.len(), s.ingress.len()))
            .collect();
        assert_eq!(lens, [(200, 200), (200, 200), (50, 50)]);
        assert!(specs.iter().all(|s| s.policy_ref.name == "p"));

        let empty = chunk(&resolve(&policy(json!({})), &cluster(Vec::new())).unwrap());
        assert_eq!(empty.len(), 1, "one object, even empty");
        let existing = vec![
            ("p-b".to_owned(), Some(specs[1].clone())),
            ("p-a".to_owned(), Some(specs[0].clone())),
        ];
        let grown = plan(&existing, specs.clone());
        assert_eq!(grown.update, []);
        assert_eq!(grown.create, [specs[2].clone()]);
        let shrunk = plan(&existing, empty.clone());
        assert_eq!(shrunk.update, [("p-a".to_owned(), empty[0].clone())]);
        assert_eq!(shrunk.delete, ["p-b"]);
    }

    #[test]
    fn a_pass_writes_owned_objects_follows_labels_and_collects_a_deleted_policys() {
        let mut store = Store::new(super::super::store::DEFAULT_HISTORY);
        let all = Selector::default();
        let (pods, namespaces) = (find("", "v1", "pods"), find("", "v1", "namespaces"));
        let policies = find("networking.k8s.io", "v1", "networkpolicies");
        let objects = find(pe::GROUP, pe::VERSION, pe::PLURAL);
        store
            .create(namespaces, None, json!({"metadata": {"name": "x"}}))
            .unwrap();
        for (name, ip, app) in [("a", "10.20.11.20", "web"), ("b", "10.20.11.21", "db")] {
            store
                .create(
                    pods,
                    Some("x"),
                    json!({"metadata": {"name": name, "labels": {"app": app}},
                        "status": {"podIP": ip, "hostIP": "10.20.11.162"}}),
                )
                .unwrap();
        }
        let policy = store
            .create(
                policies,
                Some("x"),
                json!({"metadata": {"name": "web"}, "spec": {
                    "podSelector": {"matchLabels": {"app": "web"}},
                    "ingress": [{"from": [{"namespaceSelector": {"matchLabels":
                        {"kubernetes.io/metadata.name": "x"}}}], "ports": [{"port": 80}]}]}}),
            )
            .unwrap();
        // The server's defaults.
        assert_eq!(policy["spec"]["policyTypes"], json!(["Ingress"]));
        assert_eq!(policy["spec"]["ingress"][0]["ports"][0]["protocol"], "TCP");
        let read = |store: &Store| -> Vec<Value> { store.list(objects, Some("x"), &all, &all) };

        let revision = sync(&mut store);
        let made = read(&store);
        assert_eq!(made.len(), 1);
        let name = made[0]["metadata"]["name"].as_str().unwrap().to_owned();
        assert!(name.starts_with("web-"), "{name}");
        assert_eq!(
            made[0]["metadata"]["ownerReferences"][0]["uid"],
            policy["metadata"]["uid"]
        );
        let spec: PolicyEndpointSpec = serde_json::from_value(made[0]["spec"].clone()).unwrap();
        assert_eq!(spec.pod_selector_endpoints[0].name, "a");
        assert_eq!(cidrs(&spec.ingress), ["10.20.11.20", "10.20.11.21"]);
        assert_eq!(
            sync(&mut store),
            revision,
            "nothing to change: nothing written"
        );

        store
            .patch(
                pods,
                Some("x"),
                "b",
                super::super::store::PatchKind::Merge,
                &json!({"metadata": {"labels": {"app": "web"}}}),
            )
            .unwrap();
        sync(&mut store);
        let updated = read(&store);
        assert_eq!(
            updated[0]["metadata"]["name"],
            name.as_str(),
            "updated in place"
        );
        assert_eq!(
            updated[0]["spec"]["podSelectorEndpoints"]
                .as_array()
                .unwrap()
                .len(),
            2
        );

        store.delete(policies, Some("x"), "web").unwrap();
        sync(&mut store);
        assert!(read(&store).is_empty());
    }

    #[test]
    fn a_pod_without_status_address_uses_its_annotation() {
        let view = PodView::from_object(&json!({
            "metadata": {"name": "a", "namespace": "x", "labels": {"app": "web"},
                "annotations": {"vpc.amazonaws.com/pod-ips": "10.20.11.30"}},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 80}]}]},
            "status": {"phase": "Pending"}
        }));
        assert_eq!(view.ip.as_deref(), Some("10.20.11.30"));
        assert_eq!(view.container_ports[0].protocol, "TCP");
        let done = PodView::from_object(&json!({"metadata": {"name": "a"},
            "status": {"phase": "Succeeded", "podIP": "10.20.11.31"}}));
        assert_eq!(done.ip, None);
    }
}
