//! The agent's events as Kubernetes Events on its pod (`events.k8s.io/v1`,
//! as aws-node sends its `MissingIAMPermissions`), so `kubectl describe
//! pod` and `kubectl get events` show them: the address manager's, and
//! network policy's fields that cannot be enforced.

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::{
    Api, Resource,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tokio::sync::broadcast::{Receiver, error::RecvError};
use tracing::{debug, info, warn};

use super::{ENV_MY_POD_NAME, K8sSettings};
use crate::ipam::manager::{IpamEvent, Severity};

/// The events' reporting controller.
pub const REPORTING_CONTROLLER: &str = "vpcnet-agent";

/// Something the agent tells the cluster about.
pub trait AgentEvent: Clone + Send + 'static {
    /// Whose events these are, for the log.
    const SOURCE: &'static str;
    fn event(&self) -> Event;
}

impl AgentEvent for IpamEvent {
    const SOURCE: &'static str = "the address manager";

    fn event(&self) -> Event {
        Event {
            type_: match self.severity {
                Severity::Normal => EventType::Normal,
                Severity::Warning => EventType::Warning,
            },
            reason: self.reason.to_owned(),
            note: Some(self.message.clone()),
            action: self.action.to_owned(),
            secondary: None,
        }
    }
}

/// Publishes `events` until their sender is gone. Without `MY_POD_NAME`
/// the events stay in the agent's log (and its introspection).
pub async fn publish<E: AgentEvent>(
    client: kube::Client,
    settings: K8sSettings,
    mut events: Receiver<E>,
) {
    let Some(pod_name) = settings.pod_name.clone() else {
        info!(
            "{ENV_MY_POD_NAME} is not set: {}'s events are logged, not sent to the Kubernetes API",
            E::SOURCE
        );
        return;
    };
    let namespace = client.default_namespace().to_owned();
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: REPORTING_CONTROLLER.to_owned(),
            instance: Some(pod_name.clone()),
        },
    );
    let mut regarding: Option<ObjectReference> = None;
    loop {
        let event = match events.recv().await {
            Ok(event) => event,
            Err(RecvError::Lagged(lost)) => {
                warn!(
                    lost,
                    "events lost before they were sent to the Kubernetes API"
                );
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        // The pod's UID makes `kubectl describe pod` find the events: it
        // is read once; until it can be, the pod is named without it.
        if regarding.is_none() {
            match Api::<Pod>::namespaced(client.clone(), &namespace)
                .get(&pod_name)
                .await
            {
                Ok(pod) => regarding = Some(pod.object_ref(&())),
                Err(error) => debug!(%error, "reading the agent's Pod for its events"),
            }
        }
        let reference = regarding
            .clone()
            .unwrap_or_else(|| pod_reference(&namespace, &pod_name));
        let event = event.event();
        let sent = recorder.publish(&event, &reference).await;
        if let Err(error) = sent {
            // Events are best effort: the log and introspection have them.
            warn!(%error, reason = event.reason, "sending an event to the Kubernetes API");
        }
    }
}

/// A reference to a pod by name, for when its UID cannot be read.
fn pod_reference(namespace: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Pod".to_owned()),
        namespace: Some(namespace.to_owned()),
        name: Some(name.to_owned()),
        ..ObjectReference::default()
    }
}
