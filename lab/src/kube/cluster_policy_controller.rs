//! The lab's resolution of AWS's ClusterNetworkPolicy into
//! ClusterPolicyEndpoints, as EKS's network policy controller (v1.1 on)
//! does it for the nodes' agents, in the same passes as NetworkPolicy
//! ([`super::policy_controller`]). Written from the CRD's definition; it
//! shares nothing with the agent.
//!
//! - one or more ClusterPolicyEndpoints per policy (cluster-scoped), named
//!   `<policy>-xxxxx`, owned by the policy; `policyRef`, `tier`,
//!   `priority` and `subject` copied;
//! - `podSelectorEndpoints`: the subject's pods that have an address and
//!   do not use the host's network;
//! - ingress and egress entries, each with its rule's action: a pod peer
//!   is its address (no mask), a network its CIDR, a domain name its own
//!   entry (Accept and Pass only, as EKS's); ports as `protocol`, `port`,
//!   `endPort` (a range's start and end), named ports resolved against
//!   container ports (ingress: the subject's pods'; egress: each peer
//!   pod's, and dropped for networks); a rule whose ports all fail to
//!   resolve gives nothing;
//! - lists of `CHUNK` entries at most per object, as for
//!   PolicyEndpoints.
//!
//! Where EKS's controller is known to differ, this one follows the CRD:
//! an ingress rule's peers are each resolved (EKS's reads namespaces from
//! the first peer only), and ingress named ports name the subject's ports.

use serde::Deserialize;
use serde_json::{Value, json};
use tracing::{info, warn};
use vpcnet_api::{
    cluster_policy::{
        self as cp, ACTION_DENY, ClusterEndpointInfo, ClusterNetworkPolicySpec,
        ClusterPolicyEndpointSpec, ClusterPolicyReference, ClusterPort, NamespacedPods, Peer,
    },
    policy_endpoint::{LabelSelector, PodEndpoint, Port},
};

use super::{
    policy_controller::{
        Cluster, PodView, ResolveError, add_ports, find, objects_for, part, plan, selects, str_at,
    },
    resources::Resource,
    store::{Change, Store},
};

#[derive(Debug, Deserialize)]
struct ClusterNetworkPolicy {
    metadata: Metadata,
    spec: ClusterNetworkPolicySpec,
}

#[derive(Debug, Deserialize)]
struct Metadata {
    name: String,
}

/// A cluster policy resolved, before it is cut into objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub name: String,
    pub spec: ClusterNetworkPolicySpec,
    pub endpoints: Vec<PodEndpoint>,
    pub ingress: Vec<ClusterEndpointInfo>,
    pub egress: Vec<ClusterEndpointInfo>,
}

impl Cluster {
    /// The network-ready pods (off the host's network) of the namespaces
    /// `namespaces` selects whose labels `pods` selects (none: all).
    fn select(
        &self,
        namespaces: &LabelSelector,
        pods: Option<&LabelSelector>,
    ) -> Result<Vec<&PodView>, ResolveError> {
        let mut chosen = Vec::new();
        for (name, labels) in &self.namespaces {
            if selects(namespaces, labels)? {
                chosen.push(name.as_str());
            }
        }
        let mut out = Vec::new();
        for pod in &self.pods {
            if pod.ip.is_none() || pod.host_network || !chosen.contains(&pod.namespace.as_str()) {
                continue;
            }
            if pods.map_or(Ok(true), |s| selects(s, &pod.labels))? {
                out.push(pod);
            }
        }
        Ok(out)
    }

    fn select_by(
        &self,
        namespaces: Option<&LabelSelector>,
        pods: Option<&NamespacedPods>,
    ) -> Result<Vec<&PodView>, ResolveError> {
        match (namespaces, pods) {
            (Some(namespaces), _) => self.select(namespaces, None),
            (None, Some(pods)) => self.select(&pods.namespace_selector, Some(&pods.pod_selector)),
            (None, None) => Ok(Vec::new()),
        }
    }
}

/// A rule's ports resolved against `pods`' container ports. `None`: the
/// rule names ports and none resolved, so it matches nothing. An empty
/// list: every port.
fn resolve_ports(ports: Option<&[ClusterPort]>, pods: &[&PodView]) -> Option<Vec<Port>> {
    let Some(ports) = ports.filter(|p| !p.is_empty()) else {
        return Some(Vec::new());
    };
    let mut out: Vec<Port> = Vec::new();
    let mut push = |port: Port| {
        if !out.contains(&port) {
            out.push(port);
        }
    };
    let tcp = |protocol: &Option<String>| protocol.clone().unwrap_or_else(|| "TCP".to_owned());
    for port in ports {
        if let Some(number) = &port.port_number {
            push(Port {
                protocol: Some(tcp(&number.protocol)),
                port: Some(number.port),
                end_port: None,
            });
        }
        if let Some(range) = &port.port_range {
            push(Port {
                protocol: Some(tcp(&range.protocol)),
                port: Some(range.start),
                end_port: Some(range.end),
            });
        }
        if let Some(name) = &port.named_port {
            for pod in pods {
                for container in pod.container_ports.iter().filter(|c| c.name == *name) {
                    push(Port {
                        protocol: Some(container.protocol.clone()),
                        port: Some(container.port),
                        end_port: None,
                    });
                }
            }
        }
    }
    (!out.is_empty()).then_some(out)
}

fn entry(cidr: &str, ports: &[Port], action: &str) -> ClusterEndpointInfo {
    ClusterEndpointInfo {
        cidr: cidr.to_owned(),
        ports: ports.to_vec(),
        domain_name: String::new(),
        action: action.to_owned(),
    }
}

/// The entries of one rule's peers.
fn peer_entries(
    cluster: &Cluster,
    peers: &[Peer],
    ports: Option<&[ClusterPort]>,
    action: &str,
    subject: &[&PodView],
    ingress: bool,
) -> Result<Vec<ClusterEndpointInfo>, ResolveError> {
    let mut out = Vec::new();
    // Named ports name the destination's ports: the subject's for
    // ingress, each peer pod's for egress (and none for networks).
    let numeric = resolve_ports(ports, if ingress { subject } else { &[] });
    for peer in peers {
        for network in &peer.networks {
            if let Some(ports) = &numeric {
                out.push(entry(network, ports, action));
            }
        }
        for domain in &peer.domain_names {
            if action != ACTION_DENY {
                out.push(ClusterEndpointInfo {
                    domain_name: domain.clone(),
                    ..entry("", numeric.as_deref().unwrap_or_default(), action)
                });
            }
        }
        for pod in cluster.select_by(peer.namespaces.as_ref(), peer.pods.as_ref())? {
            let ports = if ingress {
                numeric.clone()
            } else {
                resolve_ports(ports, &[pod])
            };
            if let Some(ports) = ports {
                out.push(entry(pod.ip.as_deref().unwrap_or_default(), &ports, action));
            }
        }
    }
    Ok(out)
}

/// Resolves one ClusterNetworkPolicy object against `cluster`.
pub fn resolve(policy: &Value, cluster: &Cluster) -> Result<Resolved, ResolveError> {
    let policy: ClusterNetworkPolicy = serde_json::from_value(policy.clone())
        .map_err(|err| ResolveError::Unreadable(err.to_string()))?;
    let spec = &policy.spec;
    let subject =
        cluster.select_by(spec.subject.namespaces.as_ref(), spec.subject.pods.as_ref())?;
    let endpoints = subject
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
        ingress.extend(peer_entries(
            cluster,
            &rule.from,
            rule.ports.as_deref(),
            &rule.action,
            &subject,
            true,
        )?);
    }
    let mut egress = Vec::new();
    for rule in &spec.egress {
        egress.extend(peer_entries(
            cluster,
            &rule.to,
            rule.ports.as_deref(),
            &rule.action,
            &subject,
            false,
        )?);
    }
    Ok(Resolved {
        name: policy.metadata.name.clone(),
        spec: spec.clone(),
        endpoints,
        ingress: merge(ingress),
        egress: merge(egress),
    })
}

/// Entries for the same peer and action become one: every port if either
/// has every port, else the union of their ports.
fn merge(entries: Vec<ClusterEndpointInfo>) -> Vec<ClusterEndpointInfo> {
    let mut merged: Vec<ClusterEndpointInfo> = Vec::new();
    for entry in entries {
        match merged.iter_mut().find(|e| {
            e.cidr == entry.cidr && e.domain_name == entry.domain_name && e.action == entry.action
        }) {
            None => merged.push(entry),
            Some(existing) => add_ports(&mut existing.ports, entry.ports),
        }
    }
    merged
}

/// The objects' specs: each list cut into `CHUNK`s, the n-th object
/// taking the n-th chunk of each; one object at least.
pub fn chunk(resolved: &Resolved) -> Vec<ClusterPolicyEndpointSpec> {
    let count = objects_for([
        resolved.endpoints.len(),
        resolved.ingress.len(),
        resolved.egress.len(),
    ]);
    (0..count)
        .map(|n| ClusterPolicyEndpointSpec {
            policy_ref: ClusterPolicyReference {
                name: resolved.name.clone(),
            },
            tier: resolved.spec.tier.clone(),
            priority: resolved.spec.priority,
            subject: Some(resolved.spec.subject.clone()),
            pod_selector_endpoints: part(&resolved.endpoints, n),
            ingress: part(&resolved.ingress, n),
            egress: part(&resolved.egress, n),
        })
        .collect()
}

/// The ClusterNetworkPolicy (uid) that controls a ClusterPolicyEndpoint.
fn owner_uid(object: &Value) -> Option<&str> {
    object
        .pointer("/metadata/ownerReferences")?
        .as_array()?
        .iter()
        .find(|r| {
            r.get("kind").and_then(Value::as_str) == Some(cp::POLICY_KIND)
                && r.get("apiVersion").and_then(Value::as_str) == Some(cp::API_VERSION)
        })?
        .get("uid")?
        .as_str()
}

/// One pass: every cluster policy's objects made what they should be.
/// Returns the store's revision after it.
pub fn sync(store: &mut Store) -> u64 {
    let all = super::selector::Selector::default();
    let policies_res = find(cp::GROUP, cp::VERSION, cp::POLICY_PLURAL);
    let endpoints_res = find(cp::GROUP, cp::VERSION, cp::ENDPOINT_PLURAL);
    if !super::resources::served().any(|r| r == policies_res || r == endpoints_res) {
        return store.revision();
    }
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
        let name = str_at(policy, "/metadata/name").unwrap_or_default();
        let resolved = match resolve(policy, &cluster) {
            Ok(resolved) => resolved,
            Err(err) => {
                warn!(policy = %name, %err, "the cluster policy is left as it was");
                continue;
            }
        };
        let owned: Vec<&Value> = objects
            .iter()
            .filter(|o| owner_uid(o) == Some(uid.as_str()))
            .collect();
        let existing: Vec<(String, Option<ClusterPolicyEndpointSpec>)> = owned
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
            if let Err(err) = store.update(endpoints_res, None, &object_name, object) {
                warn!(object = %object_name, %err, "updating a ClusterPolicyEndpoint");
            }
        }
        for spec in plan.create {
            let object = json!({
                "apiVersion": cp::API_VERSION,
                "kind": cp::ENDPOINT_KIND,
                "metadata": {
                    "generateName": format!("{name}-"),
                    "ownerReferences": [{
                        "apiVersion": cp::API_VERSION,
                        "kind": cp::POLICY_KIND,
                        "name": name,
                        "uid": uid,
                        "controller": true,
                        "blockOwnerDeletion": true,
                    }],
                },
                "spec": spec,
            });
            match store.create(endpoints_res, None, object) {
                Ok(made) => info!(
                    policy = %name,
                    object = str_at(&made, "/metadata/name").unwrap_or_default(),
                    "created a ClusterPolicyEndpoint"
                ),
                Err(err) => warn!(policy = %name, %err, "creating a ClusterPolicyEndpoint"),
            }
        }
        for object_name in plan.delete {
            delete(store, endpoints_res, &object_name);
        }
    }
    for object in &objects {
        if owner_uid(object).is_some_and(|uid| !live.iter().any(|l| l == uid)) {
            delete(
                store,
                endpoints_res,
                str_at(object, "/metadata/name").unwrap_or_default(),
            );
        }
    }
    store.revision()
}

fn delete(store: &mut Store, resource: &'static Resource, name: &str) {
    match store.delete(resource, None, name) {
        Ok(_) => info!(object = %name, "deleted a ClusterPolicyEndpoint"),
        Err(err) => warn!(object = %name, %err, "deleting a ClusterPolicyEndpoint"),
    }
}

/// Whether a change can change some cluster policy's objects.
pub(super) fn relevant(change: &Change) -> bool {
    change.resource.group == cp::GROUP
        && matches!(
            change.resource.plural,
            cp::POLICY_PLURAL | cp::ENDPOINT_PLURAL
        )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::kube::policy_controller::ContainerPort;

    fn pod(ns: &str, name: &str, ip: &str, labels: &[(&str, &str)]) -> PodView {
        PodView {
            namespace: ns.to_owned(),
            name: name.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ip: Some(ip.to_owned()),
            host_ip: "10.20.11.162".to_owned(),
            host_network: false,
            container_ports: vec![ContainerPort {
                name: "http".into(),
                port: 8080,
                protocol: "TCP".into(),
            }],
        }
    }

    fn cluster() -> Cluster {
        let namespaces = [("x", "prod"), ("y", "dev")]
            .into_iter()
            .map(|(ns, env)| {
                (
                    ns.to_owned(),
                    BTreeMap::from([
                        ("kubernetes.io/metadata.name".to_owned(), ns.to_owned()),
                        ("env".to_owned(), env.to_owned()),
                    ]),
                )
            })
            .collect();
        Cluster {
            pods: vec![
                pod("x", "a", "10.20.11.20", &[("app", "web")]),
                pod("x", "b", "10.20.11.21", &[("app", "db")]),
                pod("y", "c", "10.20.11.22", &[("app", "web")]),
            ],
            namespaces,
        }
    }

    fn policy(spec: Value) -> Value {
        let mut policy = json!({"metadata": {"name": "p"}});
        policy["spec"] = spec;
        policy
    }

    #[test]
    fn subjects_peers_and_ports_resolve_with_each_rules_action() {
        let resolved = resolve(
            &policy(json!({
                "tier": "Admin", "priority": 5,
                "subject": {"pods": {"namespaceSelector": {"matchLabels": {"env": "prod"}},
                                     "podSelector": {"matchLabels": {"app": "db"}}}},
                "ingress": [
                    {"action": "Deny", "from": [{"namespaces": {"matchLabels": {"env": "dev"}}}]},
                    {"action": "Accept", "from": [{"pods": {"namespaceSelector": {},
                                                            "podSelector": {"matchLabels": {"app": "web"}}}}],
                     "ports": [{"namedPort": "http"}, {"portRange": {"start": 9000, "end": 9100}}]}
                ],
                "egress": [
                    {"action": "Pass", "to": [{"networks": ["10.0.0.0/8"]}, {"domainNames": ["example.com"]}]},
                    {"action": "Deny", "to": [{"domainNames": ["blocked.example"]}]}
                ]
            })),
            &cluster(),
        )
        .unwrap();
        assert_eq!(resolved.endpoints.len(), 1);
        assert_eq!(resolved.endpoints[0].pod_ip, "10.20.11.21");
        let ingress: Vec<(&str, &str, usize)> = resolved
            .ingress
            .iter()
            .map(|e| (e.cidr.as_str(), e.action.as_str(), e.ports.len()))
            .collect();
        assert_eq!(
            ingress,
            [
                ("10.20.11.22", "Deny", 0),
                ("10.20.11.20", "Accept", 2),
                ("10.20.11.22", "Accept", 2)
            ]
        );
        assert_eq!(
            resolved.ingress[1].ports[0].port,
            Some(8080),
            "the subject's named port"
        );
        assert_eq!(resolved.ingress[1].ports[1].end_port, Some(9100));
        assert_eq!(
            resolved.egress.len(),
            2,
            "a Deny's domain names are not resolved"
        );
        assert_eq!(resolved.egress[1].domain_name, "example.com");
        let specs = chunk(&resolved);
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].tier, "Admin");
        assert_eq!(specs[0].policy_ref.name, "p");
    }
}
