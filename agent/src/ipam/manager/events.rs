//! What operators should hear about: each event logged, kept for the
//! status and published to whoever raises Kubernetes events.

use std::{collections::VecDeque, time::SystemTime};

use tokio::sync::broadcast;
use tracing::{info, warn};

use super::{IpamEvent, Manager, Severity};
use crate::cloud::CloudError;

/// Events kept for `IpamStatus`.
const EVENTS_KEPT: usize = 64;

/// The events kept and their publisher.
pub(super) struct Events {
    kept: std::sync::Mutex<VecDeque<IpamEvent>>,
    /// The events as they happen, for whoever publishes them.
    published: broadcast::Sender<IpamEvent>,
}

impl Events {
    pub(super) fn new() -> Self {
        Self {
            kept: std::sync::Mutex::new(VecDeque::new()),
            published: broadcast::channel(EVENTS_KEPT).0,
        }
    }

    /// The events kept, oldest first.
    pub(super) fn recent(&self) -> Vec<IpamEvent> {
        self.kept
            .lock()
            .map(|e| e.iter().cloned().collect())
            .unwrap_or_default()
    }
}

impl Manager {
    pub(super) fn event(
        &self,
        severity: Severity,
        reason: &'static str,
        action: &'static str,
        message: String,
    ) {
        match severity {
            Severity::Normal => info!(reason, action, "{message}"),
            Severity::Warning => warn!(reason, action, "{message}"),
        }
        let event = IpamEvent {
            time: SystemTime::now(),
            severity,
            reason,
            action,
            message,
        };
        let events = &self.inner.events;
        // Nobody listening (no API server) is fine.
        let _ = events.published.send(event.clone());
        if let Ok(mut kept) = events.kept.lock() {
            if kept.len() == EVENTS_KEPT {
                kept.pop_front();
            }
            kept.push_back(event);
        }
    }

    /// The events from now on (a lagging receiver loses the oldest).
    pub fn subscribe_events(&self) -> broadcast::Receiver<IpamEvent> {
        self.inner.events.published.subscribe()
    }

    /// The events an EC2 error is worth: the ones aws-node raises, and the
    /// ones an operator acts on. Raised when the error's code changes, not
    /// on every retry.
    pub(super) fn cloud_error_event(&self, error: &CloudError) {
        let Some(action) = error.action() else {
            return;
        };
        if error.code() == Some("UnauthorizedOperation") {
            self.event(
                Severity::Warning,
                "MissingIAMPermissions",
                action,
                format!(
                    "Unauthorized operation: ec2:{action} was refused for missing permissions; \
                     the node's IAM role needs the VPC CNI's policy (AmazonEKS_CNI_Policy)"
                ),
            );
        } else if error.is_subnet_exhausted() {
            self.event(
                Severity::Warning,
                "SubnetExhausted",
                action,
                format!("the subnet has no free address for the pool: {error}"),
            );
        }
    }
}
