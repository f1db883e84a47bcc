//! Growing the pool: addresses or prefixes on an attached ENI, or a new
//! ENI (created, attached, set up), as far as the targets ask; prefix
//! delegation falls back to addresses when the subnet has no /28 left.

use std::time::Instant;

use ipnet::Ipv4Net;
use tracing::info;

use super::{Manager, ManagerError, Severity, bump, placement};
use crate::{
    cloud::NewEni,
    ipam::{
        pool::{self, EniRoom, Growth, PoolTargets},
        subnets::EniPlacement,
    },
};

impl Manager {
    /// The targets in force: prefixes unless they fell back.
    pub(super) fn targets(&self, prefixes: bool) -> PoolTargets {
        let node = &self.inner.node;
        let mut settings = self.inner.opts.settings.clone();
        settings.prefix_delegation = prefixes;
        settings.pool_targets(node.limits.ips_per_eni.saturating_sub(1), node.max_pods)
    }

    /// What growing the pool takes next ([`plan_growth`]), if it is too
    /// low.
    pub(super) async fn plan_growth(&self) -> Option<Growth> {
        let me = &self.inner;
        let st = me.state.lock().await;
        let configured = me.opts.settings.prefix_delegation;
        let room = EniRoom {
            slots_per_eni: me.node.limits.ips_per_eni,
            devices_used: st.enis.values().map(|e| e.device_number).collect(),
            attached: st.enis.len() + st.draining.len(),
            max_enis: me.node.max_enis,
            can_make_eni: placement(&me.opts) != EniPlacement::NoEniConfig,
        };
        let now = Instant::now();
        pool::plan_growth(
            &self.targets(configured),
            &self.targets(configured && !st.prefix_fallback),
            &st.datastore.stats(now),
            &self.eni_snapshot(&st, now),
            &room,
        )
    }

    pub(super) async fn grow(&self, plan: Growth) -> Result<(), ManagerError> {
        let _action = crate::telemetry::action(crate::telemetry::ACTION_INCREASE_POOL);
        let me = &self.inner;
        let (result, prefixes) = match &plan {
            Growth::OnEni { eni, n, prefixes } => {
                (self.add_to_eni(eni, *n, *prefixes).await, *prefixes)
            }
            Growth::NewEni {
                device,
                n,
                prefixes,
            } => (self.new_eni(*device, *n, *prefixes).await, *prefixes),
        };
        match result {
            Err(ManagerError::Cloud(e)) if prefixes && e.is_insufficient_cidr_blocks() => {
                let subnet = {
                    let mut st = me.state.lock().await;
                    st.prefix_fallback = true;
                    match &plan {
                        Growth::OnEni { eni, .. } => st
                            .enis
                            .get(eni)
                            .map_or_else(String::new, |e| format!("subnet {}", e.subnet_id)),
                        Growth::NewEni { .. } => "every subnet tried for a new ENI".to_owned(),
                    }
                };
                bump(&me.counters.prefix_fallbacks, 1);
                self.event(
                    Severity::Warning,
                    "PrefixDelegationFallback",
                    if matches!(plan, Growth::NewEni { .. }) {
                        "CreateNetworkInterface"
                    } else {
                        "AssignPrivateIpAddresses"
                    },
                    format!(
                        "{subnet} has no free /28 block (InsufficientCidrBlocks): \
                         assigning single secondary addresses instead"
                    ),
                );
                Ok(())
            }
            Err(ManagerError::Cloud(e)) if e.code() == Some("PrivateIpAddressLimitExceeded") => {
                // Our count of the ENI's slots is behind EC2's: re-read it.
                if let Growth::OnEni { eni, .. } = &plan {
                    let info = me.cloud.eni(eni).await?;
                    let mut st = me.state.lock().await;
                    st.datastore.add_addrs(eni, &info.secondary_addrs)?;
                    for p in &info.prefixes {
                        st.datastore.add_prefix(eni, *p)?;
                    }
                }
                Err(ManagerError::Cloud(e))
            }
            other => other,
        }
    }

    async fn add_to_eni(&self, eni: &str, n: usize, prefixes: bool) -> Result<(), ManagerError> {
        let me = &self.inner;
        if prefixes {
            let got = me.cloud.assign_prefixes(eni, n).await?;
            let mut st = me.state.lock().await;
            for p in &got {
                st.datastore.add_prefix(eni, *p)?;
            }
            st.recently_changed(got.iter().copied());
            bump(&me.counters.prefixes_allocated, got.len());
            info!(eni, prefixes = ?got, "prefixes assigned");
        } else {
            let mut got = me.cloud.assign_addrs(eni, n).await?;
            let mut st = me.state.lock().await;
            // EC2 answers with the new addresses; an EC2-alike (moto)
            // answers with all of them, the ENI's own among them.
            let primary = st.enis.get(eni).and_then(|e| e.primary_addr);
            got.retain(|a| Some(*a) != primary);
            st.datastore.add_addrs(eni, &got)?;
            st.recently_changed(got.iter().map(|a| Ipv4Net::from(*a)));
            drop(st);
            bump(&me.counters.addrs_allocated, got.len());
            info!(eni, addrs = got.len(), "secondary addresses assigned");
        }
        me.pool_changed.notify_waiters();
        Ok(())
    }

    /// Creates, attaches and sets up an ENI. If anything fails after the
    /// create, the ENI is drained (detached, deleted) on later passes.
    async fn new_eni(&self, device: u32, n: usize, prefixes: bool) -> Result<(), ManagerError> {
        let me = &self.inner;
        let node = &me.node;
        // The config in force now, for the whole of this ENI.
        let placement = placement(&me.opts);
        // Custom networking's subnet may be tagged 0 too; a discovered one
        // is not.
        let (excluded, security_groups) = match &placement {
            EniPlacement::Custom(config) => (
                self.subnets().excluded().await?.contains(&config.subnet_id),
                if config.security_groups.is_empty() {
                    node.primary_eni.security_groups.clone()
                } else {
                    config.security_groups.clone()
                },
            ),
            // Discovered subnets' ENIs get the primary ENI's groups, as
            // aws-node gives them.
            _ => (false, node.primary_eni.security_groups.clone()),
        };
        // Tried in order until EC2 makes one, as aws-node does.
        let mut created = Err(ManagerError::NoSubnet("none to try".to_owned()));
        for subnet_id in self.subnets().for_new_eni(&placement).await? {
            created = me
                .cloud
                .create_eni(&NewEni {
                    subnet_id: &subnet_id,
                    security_groups: &security_groups,
                    instance_id: &node.instance.instance_id,
                    tags: &node.eni_tags,
                    secondary_addrs: if prefixes { 0 } else { n },
                    prefixes: if prefixes { n } else { 0 },
                })
                .await
                .map_err(ManagerError::from);
            match &created {
                Ok(_) => break,
                Err(e) => info!(subnet = %subnet_id, error = %e, "no ENI in this subnet"),
            }
        }
        let created = created?;
        info!(eni = %created.id, device, subnet = %created.subnet_id, "ENI created");
        let attachment = match me
            .cloud
            .attach_eni(&created.id, &node.instance.instance_id, device)
            .await
        {
            Ok(id) => id,
            Err(e) => {
                // Maybe attached anyway (the answer was lost): drain looks.
                me.state
                    .lock()
                    .await
                    .draining
                    .insert(created.id.clone(), None);
                return Err(e.into());
            }
        };
        let attached = match self.wait_attachment(&created.id, "attached").await {
            Ok(eni) => eni,
            Err(e) => {
                me.state
                    .lock()
                    .await
                    .draining
                    .insert(created.id.clone(), Some(attachment));
                return Err(e);
            }
        };
        if let Err(e) = self.track(&attached, excluded).await {
            let mut st = me.state.lock().await;
            st.enis.remove(&created.id);
            let _ = st.datastore.remove_eni(&created.id);
            st.draining.insert(created.id.clone(), Some(attachment));
            return Err(e);
        }
        me.state.lock().await.recently_changed(
            attached
                .secondary_addrs
                .iter()
                .map(|a| Ipv4Net::from(*a))
                .chain(attached.prefixes.iter().copied()),
        );
        bump(&me.counters.enis_created, 1);
        let (addrs, pfx) = (attached.secondary_addrs.len(), attached.prefixes.len());
        bump(&me.counters.addrs_allocated, addrs);
        bump(&me.counters.prefixes_allocated, pfx);
        info!(eni = %created.id, device, addrs, prefixes = pfx, "ENI attached and set up");
        Ok(())
    }
}
