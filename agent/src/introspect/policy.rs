//! `GET /v1/policy`: the rules in force for each local pod, from the
//! agent's network policy, each with the policy it came from.

use std::sync::Arc;

use axum::{
    extract::{RawQuery, State},
    http::StatusCode,
    response::Response,
};

use super::{
    handlers::Shared,
    routes::{error, json},
    views::{ClusterRuleView, DirectionView, PodPolicyView, PolicyView, RuleView, VerdictsView},
};
use crate::policy::rules::{ClusterRule, Direction, Peers};

pub(super) async fn policy(
    State(shared): State<Arc<Shared>>,
    RawQuery(query): RawQuery,
) -> Response {
    let wanted = match pod_filter(query.as_deref().unwrap_or("")) {
        Ok(wanted) => wanted,
        Err(message) => return error(StatusCode::BAD_REQUEST, &message),
    };
    let Some(node) = shared.pods.as_ref().and_then(|p| p.policy()) else {
        return json(
            StatusCode::OK,
            &PolicyView {
                enforced: false,
                mode: None,
                pods: Vec::new(),
            },
        );
    };
    let snapshot = match node.snapshot().await {
        Ok(snapshot) => snapshot,
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, &e.to_string()),
    };
    let pods: Vec<PodPolicyView> = snapshot
        .into_iter()
        .filter(|pod| {
            wanted
                .as_ref()
                .is_none_or(|(ns, n)| *ns == pod.name.namespace && *n == pod.name.name)
        })
        .map(|pod| {
            let rules = pod.rules.clone().unwrap_or_default();
            PodPolicyView {
                namespace: pod.name.namespace,
                name: pod.name.name,
                address: pod.addr,
                held: pod.rules.is_none(),
                ingress: direction(&rules.ingress, &rules.cluster_ingress),
                egress: direction(&rules.egress, &rules.cluster_egress),
                verdicts: VerdictsView {
                    ingress_allowed: pod.verdicts.ingress_allowed,
                    ingress_denied: pod.verdicts.ingress_denied,
                    egress_allowed: pod.verdicts.egress_allowed,
                    egress_denied: pod.verdicts.egress_denied,
                },
            }
        })
        .collect();
    if let Some((ns, name)) = &wanted
        && pods.is_empty()
    {
        return error(
            StatusCode::NOT_FOUND,
            &format!("no pod {ns}/{name} on this node"),
        );
    }
    json(
        StatusCode::OK,
        &PolicyView {
            enforced: true,
            mode: Some(node.mode().to_string()),
            pods,
        },
    )
}

/// `pod=NAMESPACE/NAME`, or nothing.
fn pod_filter(query: &str) -> Result<Option<(String, String)>, String> {
    if query.is_empty() {
        return Ok(None);
    }
    let value = query
        .strip_prefix("pod=")
        .ok_or_else(|| format!("unknown query {query:?}: only pod=NAMESPACE/NAME"))?;
    value
        .split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
        .map(|(ns, name)| Some((ns.to_owned(), name.to_owned())))
        .ok_or_else(|| format!("pod={value:?} is not NAMESPACE/NAME"))
}

fn direction(direction: &Direction, cluster: &[ClusterRule]) -> DirectionView {
    let mut cluster: Vec<&ClusterRule> = cluster.iter().collect();
    cluster.sort_by_key(|r| (r.tier, r.priority, r.action));
    let cluster = cluster
        .into_iter()
        .map(|rule| ClusterRuleView {
            tier: rule.tier.name().to_owned(),
            priority: rule.priority,
            action: rule.action.name().to_owned(),
            peers: rule.peers.iter().map(ToString::to_string).collect(),
            ports: rule.ports.iter().map(ToString::to_string).collect(),
            policy: rule.origin.name.clone(),
        })
        .collect();
    match direction {
        Direction::Open => DirectionView {
            isolated: false,
            rules: Vec::new(),
            cluster,
        },
        Direction::Isolated(rules) => DirectionView {
            isolated: true,
            rules: rules
                .iter()
                .map(|rule| RuleView {
                    peers: rule.peers.iter().map(peers).collect(),
                    ports: rule.ports.iter().map(ToString::to_string).collect(),
                    policy: rule.origin.to_string(),
                })
                .collect(),
            cluster,
        },
    }
}

fn peers(peers: &Peers) -> String {
    if peers.except.is_empty() {
        return peers.cidr.to_string();
    }
    let except: Vec<String> = peers.except.iter().map(ToString::to_string).collect();
    format!("{} except {}", peers.cidr, except.join(","))
}
