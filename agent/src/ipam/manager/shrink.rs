//! Shrinking the pool: idle addresses or prefixes back to EC2, those of
//! excluded subnets' ENIs too, and whole ENIs the targets do not need,
//! detached and deleted (draining until done).

use std::{net::Ipv4Addr, time::Instant};

use ipnet::Ipv4Net;
use tracing::info;

use super::{Manager, ManagerError, State, bump};
use crate::{
    cloud::CloudError,
    ipam::pool::{Shrink, plan_shrink},
};

impl Manager {
    /// Gives back what the targets do not need, as [`plan_shrink`]
    /// decides: idle addresses or prefixes (highest ENIs first), else a
    /// whole ENI when that is safe. `held`: the node is cordoned, no ENI
    /// is freed.
    pub(super) async fn shrink(&self, held: bool) -> Result<(), ManagerError> {
        let _action = crate::telemetry::action(crate::telemetry::ACTION_DECREASE_POOL);
        let me = &self.inner;
        let now = Instant::now();
        let plan = {
            let mut st = me.state.lock().await;
            let targets = self.targets(me.opts.settings.prefix_delegation);
            let stats = st.datastore.stats(now);
            match plan_shrink(&targets, &stats, &self.eni_snapshot(&st, now), held) {
                Some(Shrink::Release {
                    eni,
                    addrs,
                    prefixes,
                }) => {
                    // Out of the datastore first: no pod may get them meanwhile.
                    for a in &addrs {
                        st.datastore.remove_addr(&eni, *a)?;
                    }
                    for p in &prefixes {
                        st.datastore.remove_prefix(&eni, *p)?;
                    }
                    Some(Shrink::Release {
                        eni,
                        addrs,
                        prefixes,
                    })
                }
                Some(Shrink::FreeEni(id)) => {
                    start_freeing(&mut st, &id).then_some(Shrink::FreeEni(id))
                }
                None => None,
            }
        };
        match plan {
            Some(Shrink::Release {
                eni,
                addrs,
                prefixes,
            }) => self.return_to_ec2(&eni, &addrs, &prefixes).await,
            Some(Shrink::FreeEni(_)) => self.drain().await,
            None => Ok(()),
        }
    }

    /// Gives EC2 back addresses or prefixes already out of the datastore;
    /// if EC2 refuses, they go back into the pool.
    async fn return_to_ec2(
        &self,
        eni: &str,
        addrs: &[Ipv4Addr],
        pfx: &[Ipv4Net],
    ) -> Result<(), ManagerError> {
        let me = &self.inner;
        let result = if addrs.is_empty() {
            me.cloud.unassign_prefixes(eni, pfx).await
        } else {
            me.cloud.unassign_addrs(eni, addrs).await
        };
        if let Err(e) = result {
            // Still the ENI's: back into the pool.
            let mut st = me.state.lock().await;
            st.datastore.add_addrs(eni, addrs)?;
            for p in pfx {
                st.datastore.add_prefix(eni, *p)?;
            }
            return Err(e.into());
        }
        me.state.lock().await.recently_changed(
            addrs
                .iter()
                .map(|a| Ipv4Net::from(*a))
                .chain(pfx.iter().copied()),
        );
        bump(&me.counters.addrs_freed, addrs.len());
        bump(&me.counters.prefixes_freed, pfx.len());
        info!(
            eni,
            addrs = addrs.len(),
            prefixes = pfx.len(),
            "returned to EC2"
        );
        Ok(())
    }

    /// Gives back the idle addresses and prefixes of ENIs in excluded
    /// subnets, which no pod may get (aws-node does so at start; here
    /// also for those pods release later).
    pub(super) async fn release_excluded(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let now = Instant::now();
        let cooldown = me.opts.settings.ip_cooldown;
        // One ENI a pass, as `shrink` does.
        let release = {
            let mut st = me.state.lock().await;
            let found = st
                .enis
                .iter()
                .filter(|(_, e)| e.subnet_excluded && !e.no_manage)
                .find_map(|(id, _)| {
                    let record = st.datastore.eni(id)?;
                    let addrs = record.idle_secondary_addrs(now, cooldown);
                    let pfx = record.idle_prefixes(now, cooldown);
                    (!addrs.is_empty() || !pfx.is_empty()).then(|| (id.clone(), addrs, pfx))
                });
            if let Some((eni, addrs, pfx)) = &found {
                for a in addrs {
                    st.datastore.remove_addr(eni, *a)?;
                }
                for p in pfx {
                    st.datastore.remove_prefix(eni, *p)?;
                }
            }
            found
        };
        let Some((eni, addrs, pfx)) = release else {
            return Ok(());
        };
        // EC2 takes addresses or prefixes in one call, not both.
        if !pfx.is_empty()
            && let Err(e) = self.return_to_ec2(&eni, &[], &pfx).await
        {
            me.state.lock().await.datastore.add_addrs(&eni, &addrs)?;
            return Err(e);
        }
        if !addrs.is_empty() {
            self.return_to_ec2(&eni, &addrs, &[]).await?;
        }
        Ok(())
    }

    /// Detaches and deletes every ENI in `draining`; what fails stays for
    /// the next pass.
    pub(super) async fn drain(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let draining: Vec<(String, Option<String>)> = me
            .state
            .lock()
            .await
            .draining
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (eni, attachment) in draining {
            let current = match me.cloud.eni(&eni).await {
                Ok(info) => info,
                Err(CloudError::Incomplete { .. }) => {
                    // Gone already.
                    me.state.lock().await.draining.remove(&eni);
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(attachment) = current.attachment_id.clone().or(attachment)
                && current.status != "available"
            {
                me.cloud.detach_eni(&attachment).await?;
                self.wait_attachment(&eni, "detached").await?;
            }
            match me.cloud.delete_eni(&eni).await {
                Ok(()) => {}
                Err(e) if e.code() == Some("InvalidNetworkInterfaceID.NotFound") => {}
                Err(e) => return Err(e.into()),
            }
            me.state.lock().await.draining.remove(&eni);
            bump(&me.counters.enis_deleted, 1);
            info!(eni, "ENI detached and deleted");
        }
        Ok(())
    }
}

/// Moves the ENI out of the pool into `draining`; `false` if it is not
/// there to move.
fn start_freeing(st: &mut State, id: &str) -> bool {
    if st.datastore.remove_eni(id).is_err() {
        return false;
    }
    let Some(tracked) = st.enis.remove(id) else {
        return false;
    };
    st.draining.insert(id.to_owned(), tracked.attachment_id);
    info!(eni = %id, "freeing an ENI the pool does not need");
    true
}
