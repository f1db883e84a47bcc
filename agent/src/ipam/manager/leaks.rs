//! The leaked-ENI sweep: detached ENIs an agent made and nobody deleted
//! (a crash between create and attach, another node's), deleted once their
//! grace has passed.

use std::time::{Duration, SystemTime};

use super::{Manager, ManagerError, Severity, bump};
use crate::cloud::{TAG_CREATED_AT, time_now_rfc3339};

/// How long a detached ENI made by an agent may live before leaked-ENI
/// cleanup deletes it (aws-node's grace: another node may be attaching it).
pub const LEAKED_ENI_GRACE: Duration = Duration::from_mins(5);

impl Manager {
    /// Deletes detached ENIs made by an agent (tagged with an instance id)
    /// once they are older than the grace period; tags untagged ones with
    /// `createdAt` first, as aws-node does.
    pub(super) async fn sweep_leaked_enis(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let cluster = me.opts.settings.cluster_name.as_deref();
        for eni in me.cloud.detached_agent_enis(cluster).await? {
            if eni.no_manage() || me.state.lock().await.draining.contains_key(&eni.id) {
                continue;
            }
            let Some(created) = eni.tags.get(TAG_CREATED_AT) else {
                me.cloud
                    .tag(&eni.id, &[(TAG_CREATED_AT, &time_now_rfc3339())])
                    .await?;
                continue;
            };
            let age = aws_sdk_ec2::primitives::DateTime::from_str(
                created,
                aws_sdk_ec2::primitives::DateTimeFormat::DateTime,
            )
            .ok()
            .and_then(|t| SystemTime::try_from(t).ok())
            .and_then(|t| SystemTime::now().duration_since(t).ok());
            if age.is_some_and(|age| age >= LEAKED_ENI_GRACE) {
                match me.cloud.delete_eni(&eni.id).await {
                    Ok(()) => {
                        bump(&me.counters.leaked_enis_deleted, 1);
                        self.event(
                            Severity::Normal,
                            "LeakedENIDeleted",
                            "DeleteNetworkInterface",
                            format!("deleted leaked ENI {}", eni.id),
                        );
                    }
                    // Another node's sweep got it first.
                    Err(e) if e.code() == Some("InvalidNetworkInterfaceID.NotFound") => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }
}
