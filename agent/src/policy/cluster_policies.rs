//! AWS's ClusterNetworkPolicy resolved by the agent itself, where no
//! controller writes ClusterPolicyEndpoints
//! (`VPCNET_NETWORK_POLICY_SOURCE=network-policies`): a policy whose
//! subject takes a local pod gives it its rules, each peer the addresses
//! of the pods its selectors take or its networks, each named port the
//! number the destination serves it on (ingress: the local pod; egress:
//! each peer pod). The same form as the controller's resolution
//! ([`super::cluster_endpoints`]).
//!
//! Bad input is reported and left out, as there: a selector that cannot
//! be read takes nothing, an unreadable network, action, port or a name
//! nothing serves drops what it names, an unreadable tier or priority the
//! policy.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use vpcnet_api::cluster_policy::{
    ACTION_ACCEPT, ACTION_DENY, ACTION_PASS, API_VERSION, ClusterNetworkPolicySpec, ClusterPort,
    NamespacedPods, POLICY_KIND, PRIORITIES, Peer, TIER_ADMIN, TIER_BASELINE,
};

use super::{
    fields::{self, Kind, Problem, Report},
    network_policies::{Cluster, ClusterPod, takes},
    rules::{Action, ClusterRule, Origin, Ports, Tier},
};

const KIND: Kind = Kind {
    name: POLICY_KIND,
    api_version: API_VERSION,
};

/// A ClusterNetworkPolicy by its name.
#[derive(Clone, Copy, Debug)]
pub struct Named<'a> {
    pub name: &'a str,
    pub spec: &'a ClusterNetworkPolicySpec,
}

/// The cluster rules, ingress and egress, of the local pod `pod` (its
/// labels and named ports known) from every policy in `all` whose subject
/// takes it.
pub fn pod_rules<'a>(
    all: impl IntoIterator<Item = Named<'a>>,
    cluster: &Cluster,
    pod: &ClusterPod,
    problems: &mut Vec<Problem>,
) -> (Vec<ClusterRule>, Vec<ClusterRule>) {
    let (mut ingress, mut egress) = (Vec::new(), Vec::new());
    for policy in all {
        let mut report = Report {
            kind: KIND,
            object: policy.name.to_owned(),
            problems,
        };
        let mut resolver = Resolver {
            cluster,
            report: &mut report,
        };
        if let Some((i, e)) = resolver.policy(&policy, pod) {
            ingress.extend(i);
            egress.extend(e);
        }
    }
    (ingress, egress)
}

struct Resolver<'r, 'p> {
    cluster: &'r Cluster,
    report: &'r mut Report<'p>,
}

/// What a rule is, before its peers: where it sits and what it does.
#[derive(Clone)]
struct Head {
    tier: Tier,
    priority: u16,
    action: Action,
    origin: Origin,
}

impl Head {
    fn rule(&self, peers: Vec<Ipv4Net>, ports: Vec<Ports>) -> ClusterRule {
        ClusterRule {
            tier: self.tier,
            priority: self.priority,
            action: self.action,
            peers,
            ports,
            origin: self.origin.clone(),
        }
    }
}

type Rules = (Vec<ClusterRule>, Vec<ClusterRule>);

impl<'r> Resolver<'r, '_> {
    fn policy(&mut self, policy: &Named<'_>, pod: &ClusterPod) -> Option<Rules> {
        let spec = policy.spec;
        if !self.names(
            spec.subject.namespaces.as_ref(),
            spec.subject.pods.as_ref(),
            pod,
            "spec.subject",
        ) {
            return None;
        }
        let tier = match spec.tier.as_str() {
            TIER_ADMIN => Tier::Admin,
            TIER_BASELINE => Tier::Baseline,
            other => {
                self.report.add(
                    "spec.tier".into(),
                    other,
                    "not Admin or Baseline: this cluster policy is not enforced",
                );
                return None;
            }
        };
        let Some(priority) = Some(spec.priority)
            .filter(|p| PRIORITIES.contains(p))
            .and_then(|p| u16::try_from(p).ok())
        else {
            self.report.add(
                "spec.priority".into(),
                &spec.priority.to_string(),
                "not from 0 to 1000: this cluster policy is not enforced",
            );
            return None;
        };
        let origin = Origin {
            namespace: String::new(),
            name: policy.name.to_owned(),
        };
        let mut ingress = Vec::new();
        for (i, rule) in spec.ingress.iter().enumerate() {
            let at = format!("spec.ingress[{i}]");
            let Some(head) = self.head(&rule.action, tier, priority, &origin, &at) else {
                continue;
            };
            let peers: Vec<Ipv4Net> = self
                .peer_pods(&rule.from, &format!("{at}.from"))
                .into_iter()
                .map(|(_, addr)| Ipv4Net::from(addr))
                .chain(self.networks(&rule.from, &format!("{at}.from")))
                .collect();
            // Named ports are the local pod's: it is the destination.
            if let Some(ports) =
                self.ports(rule.ports.as_deref(), Some(pod), &format!("{at}.ports"))
            {
                ingress.push(head.rule(peers, ports));
            }
        }
        let mut egress = Vec::new();
        for (i, rule) in spec.egress.iter().enumerate() {
            let at = format!("spec.egress[{i}]");
            let Some(head) = self.head(&rule.action, tier, priority, &origin, &at) else {
                continue;
            };
            let field = format!("{at}.ports");
            // Named ports are each destination's own: a rule per peer pod;
            // networks take the numbered ports only.
            for (peer, addr) in self.peer_pods(&rule.to, &format!("{at}.to")) {
                if let Some(ports) = self.ports(rule.ports.as_deref(), Some(peer), &field) {
                    egress.push(head.rule(vec![Ipv4Net::from(addr)], ports));
                }
            }
            let networks = self.networks(&rule.to, &format!("{at}.to"));
            if !networks.is_empty()
                && let Some(ports) = self.ports(rule.ports.as_deref(), None, &field)
            {
                egress.push(head.rule(networks, ports));
            }
        }
        Some((ingress, egress))
    }

    fn head(
        &mut self,
        action: &str,
        tier: Tier,
        priority: u16,
        origin: &Origin,
        field: &str,
    ) -> Option<Head> {
        let action = match action {
            ACTION_ACCEPT => Action::Accept,
            ACTION_DENY => Action::Deny,
            ACTION_PASS => Action::Pass,
            other => {
                self.report.add(
                    format!("{field}.action"),
                    other,
                    "not Accept, Deny or Pass: this rule is not enforced",
                );
                return None;
            }
        };
        Some(Head {
            tier,
            priority,
            action,
            origin: origin.clone(),
        })
    }

    /// Whether `namespaces` (every pod of the namespaces it takes) or
    /// `pods` names `pod`.
    fn names(
        &mut self,
        namespaces: Option<&vpcnet_api::cluster_policy::LabelSelector>,
        pods: Option<&NamespacedPods>,
        pod: &ClusterPod,
        field: &str,
    ) -> bool {
        let namespace_labels = self.cluster.namespace_labels(&pod.namespace);
        match (namespaces, pods) {
            (Some(namespaces), _) => takes(
                namespaces,
                &namespace_labels,
                &format!("{field}.namespaces"),
                self.report,
            ),
            (None, Some(pods)) => {
                takes(
                    &pods.namespace_selector,
                    &namespace_labels,
                    &format!("{field}.pods.namespaceSelector"),
                    self.report,
                ) && takes(
                    &pods.pod_selector,
                    &pod.labels,
                    &format!("{field}.pods.podSelector"),
                    self.report,
                )
            }
            (None, None) => false,
        }
    }

    /// The pods (that can be peers) the `namespaces` and `pods` peers take.
    fn peer_pods(&mut self, peers: &[Peer], field: &str) -> Vec<(&'r ClusterPod, Ipv4Addr)> {
        let cluster = self.cluster;
        let mut out: Vec<(&ClusterPod, Ipv4Addr)> = Vec::new();
        for (j, peer) in peers.iter().enumerate() {
            if peer.namespaces.is_none() && peer.pods.is_none() {
                continue;
            }
            let at = format!("{field}[{j}]");
            for (pod, addr) in cluster.peers() {
                if !out.iter().any(|(_, a)| *a == addr)
                    && self.names(peer.namespaces.as_ref(), peer.pods.as_ref(), pod, &at)
                {
                    out.push((pod, addr));
                }
            }
        }
        out
    }

    /// The `networks` of `peers`, each readable one.
    fn networks(&mut self, peers: &[Peer], field: &str) -> Vec<Ipv4Net> {
        let mut out = Vec::new();
        for (j, peer) in peers.iter().enumerate() {
            for (k, network) in peer.networks.iter().enumerate() {
                let at = format!("{field}[{j}].networks[{k}]");
                out.extend(fields::peers(network, &[], &at, self.report).map(|p| p.cidr));
            }
        }
        out
    }

    /// A rule's ports (`None`: none resolved of those it names, so it
    /// matches nothing; empty: every port), named ones as `server` serves
    /// them (none: named ports resolve to nothing).
    fn ports(
        &mut self,
        ports: Option<&[ClusterPort]>,
        server: Option<&ClusterPod>,
        field: &str,
    ) -> Option<Vec<Ports>> {
        let Some(ports) = ports.filter(|p| !p.is_empty()) else {
            return Some(Vec::new());
        };
        let mut out = Vec::new();
        for (j, port) in ports.iter().enumerate() {
            let at = format!("{field}[{j}]");
            if let Some(number) = &port.port_number {
                let at = format!("{at}.portNumber");
                out.extend(
                    fields::protocol(number.protocol.as_deref(), &at, self.report).and_then(
                        |protocol| {
                            fields::ports(protocol, Some(number.port), None, &at, self.report)
                        },
                    ),
                );
            }
            if let Some(range) = &port.port_range {
                let at = format!("{at}.portRange");
                out.extend(
                    fields::protocol(range.protocol.as_deref(), &at, self.report).and_then(
                        |protocol| {
                            fields::ports(
                                protocol,
                                Some(range.start),
                                Some(range.end),
                                &at,
                                self.report,
                            )
                        },
                    ),
                );
            }
            if let (Some(name), Some(server)) = (&port.named_port, server) {
                out.extend(
                    server
                        .ports
                        .iter()
                        .filter(|p| p.name == *name)
                        .map(|p| Ports::one(p.protocol, p.port)),
                );
            }
        }
        (!out.is_empty()).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::policy::{network_policies::NamedPort, rules::Protocol};

    fn pod(ns: &str, name: &str, last: u8, app: &str) -> ClusterPod {
        ClusterPod {
            namespace: ns.into(),
            name: name.into(),
            labels: BTreeMap::from([("app".into(), app.into())]),
            addr: Some(Ipv4Addr::new(10, 20, 11, last)),
            ports: vec![NamedPort {
                name: "http".into(),
                protocol: Protocol::Tcp,
                port: 8000 + u16::from(last),
            }],
        }
    }

    #[test]
    fn subjects_peers_and_named_ports_resolve_against_the_cluster() {
        let cluster = Cluster {
            namespaces: BTreeMap::from([
                ("x".into(), BTreeMap::from([("env".into(), "prod".into())])),
                ("y".into(), BTreeMap::from([("env".into(), "dev".into())])),
            ]),
            pods: vec![
                pod("x", "web", 20, "web"),
                pod("y", "db", 21, "db"),
                pod("y", "cache", 22, "cache"),
            ],
        };
        let spec: ClusterNetworkPolicySpec = serde_json::from_value(serde_json::json!({
            "tier": "Baseline", "priority": 3,
            "subject": {"namespaces": {"matchLabels": {"env": "prod"}}},
            "ingress": [{"action": "Deny", "from": [{"namespaces": {"matchLabels": {"env": "dev"}}}],
                         "ports": [{"namedPort": "http"}]}],
            "egress": [
                {"action": "Accept", "to": [{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "db"}}}},
                                            {"networks": ["203.0.113.0/24", "nonsense"]}],
                 "ports": [{"namedPort": "http"}, {"portRange": {"protocol": "UDP", "start": 53, "end": 54}}]},
                {"action": "Allow", "to": [{"networks": ["0.0.0.0/0"]}]}
            ]
        }))
        .unwrap();
        let mut problems = Vec::new();
        let web = cluster.pods[0].clone();
        let (ingress, egress) = pod_rules(
            [Named {
                name: "p",
                spec: &spec,
            }],
            &cluster,
            &web,
            &mut problems,
        );
        assert_eq!(ingress.len(), 1);
        assert_eq!(ingress[0].tier, Tier::Baseline);
        assert_eq!(ingress[0].peers.len(), 2, "both pods of y");
        assert_eq!(
            ingress[0].ports,
            vec![Ports::one(Protocol::Tcp, 8020)],
            "web's own port"
        );
        assert_eq!(egress.len(), 2, "{egress:?}");
        assert_eq!(
            egress[0].peers,
            vec!["10.20.11.21/32".parse::<Ipv4Net>().unwrap()]
        );
        assert!(
            egress[0].ports.contains(&Ports::one(Protocol::Tcp, 8021)),
            "db's port"
        );
        assert_eq!(
            egress[1].peers,
            vec!["203.0.113.0/24".parse::<Ipv4Net>().unwrap()]
        );
        assert_eq!(
            egress[1].ports.len(),
            1,
            "a network takes numbered ports only"
        );
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.egress[0].to[1].networks[1].cidr",
                "spec.egress[1].action"
            ]
        );
        let db = cluster.pods[1].clone();
        assert_eq!(
            pod_rules(
                [Named {
                    name: "p",
                    spec: &spec
                }],
                &cluster,
                &db,
                &mut problems
            ),
            (vec![], vec![]),
            "not its subject"
        );
    }
}
