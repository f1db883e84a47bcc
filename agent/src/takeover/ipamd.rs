//! aws-node's ipamd still on the node: the take-over must not start while
//! it runs (both would manage the node's ENIs and write
//! `/var/run/aws-node/ipam.json`), so the agent waits, changing nothing,
//! until ipamd's socket stops answering and no aws-node pod is bound to
//! the node. What moves a node from one to the other is the daemon sets'
//! node selection; this is the guard for when both land at once.

use std::{fmt, net::SocketAddr, time::Duration};

use k8s_openapi::api::core::v1::Pod;
use kube::{Api, api::ListParams};
use tokio::{net::TcpStream, sync::watch, time::timeout};
use tracing::{info, warn};
use vpcnet_api::vpc_cni::{AWS_NODE_NAMESPACE, AWS_NODE_POD_LABEL, IPAMD_GRPC_ADDRESS};

/// How often the agent looks again while ipamd runs.
pub const RECHECK: Duration = Duration::from_secs(5);
/// How long a connection attempt to ipamd's socket may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the API server may take to list aws-node's pods (its client
/// retries a failing server): the socket alone tells after that.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the agent repeats why it waits.
const REMIND_EVERY: u32 = 12;

/// What shows aws-node's ipamd on the node.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Presence {
    /// ipamd's gRPC socket answers.
    pub socket: bool,
    /// aws-node's pods bound to the node, not finished.
    pub pods: Vec<String>,
}

impl Presence {
    /// Nothing of ipamd on the node.
    #[must_use]
    pub fn gone(&self) -> bool {
        !self.socket && self.pods.is_empty()
    }
}

impl fmt::Display for Presence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut signs = Vec::new();
        if self.socket {
            signs.push(format!("its socket {IPAMD_GRPC_ADDRESS} answers"));
        }
        if !self.pods.is_empty() {
            signs.push(format!("its pod {} is on this node", self.pods.join(", ")));
        }
        write!(
            f,
            "aws-node's ipamd runs on this node ({}): vpcnet changes nothing until it is gone; \
             keep aws-node off this node (see the take-over in deploy/README.md)",
            signs.join("; ")
        )
    }
}

/// What shows ipamd on the node now: its socket, and with the Kubernetes
/// API, aws-node's pods on `node`. A failed or unanswered lookup of the
/// pods counts as none (the socket still tells) and is logged.
pub async fn presence(kube: Option<&kube::Client>, node: Option<&str>) -> Presence {
    let socket = socket_answers().await;
    let pods = match (kube, node) {
        (Some(client), Some(node)) => {
            match timeout(LOOKUP_TIMEOUT, aws_node_pods(client, node)).await {
                Ok(Ok(pods)) => pods,
                Ok(Err(error)) => {
                    warn!(%error, "listing aws-node's pods on this node");
                    Vec::new()
                }
                Err(_) => {
                    warn!(timeout = ?LOOKUP_TIMEOUT, "listing aws-node's pods on this node: no answer");
                    Vec::new()
                }
            }
        }
        _ => Vec::new(),
    };
    Presence { socket, pods }
}

async fn socket_answers() -> bool {
    let Ok(addr) = IPAMD_GRPC_ADDRESS.parse::<SocketAddr>() else {
        return false;
    };
    matches!(
        timeout(CONNECT_TIMEOUT, TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

/// aws-node's pods bound to `node` that have not finished.
async fn aws_node_pods(client: &kube::Client, node: &str) -> Result<Vec<String>, kube::Error> {
    let (key, value) = AWS_NODE_POD_LABEL;
    let params = ListParams::default()
        .labels(&format!("{key}={value}"))
        .fields(&format!("spec.nodeName={node}"));
    let pods = Api::<Pod>::namespaced(client.clone(), AWS_NODE_NAMESPACE)
        .list(&params)
        .await?;
    Ok(pods
        .items
        .into_iter()
        .filter(|pod| {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Succeeded" | "Failed"))
        })
        .filter_map(|pod| pod.metadata.name)
        .map(|name| format!("{AWS_NODE_NAMESPACE}/{name}"))
        .collect())
}

/// Returns once ipamd is gone from the node, having waited as long as it
/// runs, `now` being what was last seen of it; `why` carries the reason
/// the agent is not ready meanwhile.
pub async fn wait_until_gone(
    kube: Option<&kube::Client>,
    node: Option<&str>,
    mut now: Presence,
    why: &watch::Sender<String>,
) {
    let mut checks = 0u32;
    while !now.gone() {
        let reason = now.to_string();
        if checks.is_multiple_of(REMIND_EVERY) || *why.borrow() != reason {
            warn!("{reason}");
        }
        why.send_replace(reason);
        checks = checks.saturating_add(1);
        tokio::time::sleep(RECHECK).await;
        now = presence(kube, node).await;
    }
    if checks > 0 {
        info!("aws-node's ipamd is gone from this node: the take-over starts");
    }
}
