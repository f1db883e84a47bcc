//! The node's sync with IMDS and EC2 (aws-node's node IP pool reconcile):
//! ENIs, addresses and prefixes attached, assigned or taken away by someone
//! else, and the VPC's CIDRs.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use ipnet::Ipv4Net;
use tracing::{info, warn};

use super::{Manager, ManagerError, Severity, State, bump};
use crate::{
    cloud::{EniInfo, ImdsEni},
    ipam::pool::IPS_PER_PREFIX,
};

/// How long what the agent itself assigned or gave back is left out of the
/// node's reconcile: IMDS and EC2 may show it late (aws-node waits as long).
const RECENT_GRACE: Duration = Duration::from_mins(1);

impl State {
    /// Records addresses or prefixes the agent just assigned or gave back.
    pub(super) fn recently_changed(&mut self, nets: impl IntoIterator<Item = Ipv4Net>) {
        let now = Instant::now();
        self.recent.extend(nets.into_iter().map(|n| (n, now)));
    }

    /// Whether the agent changed `net` within [`RECENT_GRACE`].
    fn changed_recently(&self, net: Ipv4Net, now: Instant) -> bool {
        self.recent
            .get(&net)
            .is_some_and(|at| now.saturating_duration_since(*at) < RECENT_GRACE)
    }
}

impl Manager {
    /// Brings the pool in line with what is attached to the instance,
    /// whoever attached or assigned it (aws-node's node IP pool
    /// reconcile): ENIs attached or detached, addresses and prefixes
    /// assigned or unassigned by someone else. IMDS says whether anything
    /// differs; EC2, the authority, then says what. The only way to the
    /// pool with `DISABLE_NETWORK_RESOURCE_PROVISIONING`.
    pub(super) async fn reconcile_attached(&self) -> Result<(), ManagerError> {
        let _action =
            crate::telemetry::action(crate::telemetry::ACTION_NODE_RECONCILE);
        let me = &self.inner;
        bump(&me.counters.node_reconciles, 1);
        let imds = me.cloud.imds_enis().await?;
        if !self.differs_from(&imds).await {
            return Ok(());
        }
        let attached: Vec<EniInfo> = me
            .cloud
            .instance_enis(&me.node.instance.instance_id)
            .await?
            .into_iter()
            .filter(|e| e.attachment_status.as_deref() == Some("attached"))
            .collect();
        let (new, gone): (Vec<EniInfo>, Vec<String>) = {
            let st = me.state.lock().await;
            (
                attached
                    .iter()
                    .filter(|e| !st.enis.contains_key(&e.id) && !st.draining.contains_key(&e.id))
                    .cloned()
                    .collect(),
                st.enis
                    .keys()
                    .filter(|id| !attached.iter().any(|e| &e.id == *id))
                    .cloned()
                    .collect(),
            )
        };
        for id in gone {
            self.forget_eni(&id).await?;
        }
        if !new.is_empty() {
            let excluded = self.subnets().excluded().await?;
            for eni in &new {
                info!(eni = %eni.id, device = ?eni.device_index, "ENI attached by someone else");
                self.track(eni, excluded.contains(&eni.subnet_id)).await?;
                bump(&me.counters.enis_found, 1);
            }
        }
        for eni in &attached {
            self.reconcile_addrs(eni).await?;
        }
        me.pool_changed.notify_waiters();
        Ok(())
    }

    /// Whether IMDS shows other ENIs, addresses or prefixes than the pool
    /// holds.
    async fn differs_from(&self, imds: &[ImdsEni]) -> bool {
        let st = self.inner.state.lock().await;
        if imds.len() != st.enis.len() {
            return true;
        }
        imds.iter().any(|listed| {
            let Some((id, tracked)) = st.enis.iter().find(|(_, t)| t.mac == listed.mac) else {
                return true;
            };
            let Some(record) = st.datastore.eni(id) else {
                // Left alone: only its being there matters.
                return false;
            };
            let addrs: BTreeSet<Ipv4Addr> = listed
                .local_ipv4s
                .iter()
                .copied()
                .filter(|a| Some(*a) != tracked.primary_addr)
                .collect();
            let prefixes: BTreeSet<Ipv4Net> = listed.prefixes.iter().copied().collect();
            addrs != record.secondary_addrs().into_iter().collect()
                || prefixes != record.prefixes().into_iter().collect()
        })
    }

    /// Takes an ENI detached by someone else out of the pool; the pods that
    /// held its addresses lost them.
    async fn forget_eni(&self, id: &str) -> Result<(), ManagerError> {
        let me = &self.inner;
        let mut st = me.state.lock().await;
        if st.enis.remove(id).is_none() {
            return Ok(());
        }
        let lost = st.datastore.forget_eni(id);
        st.datastore
            .checkpoint()
            .write(&me.opts.settings.backing_store)?;
        drop(st);
        for (key, addr) in &lost {
            warn!(eni = id, %addr, pod = %key.container_id, "the pod's address left with its ENI");
        }
        bump(&me.counters.enis_lost, 1);
        self.event(
            Severity::Warning,
            "ENIDetached",
            "NodeReconcile",
            format!(
                "ENI {id} was detached by someone else: out of the pool ({} pods held its addresses)",
                lost.len()
            ),
        );
        Ok(())
    }

    /// Takes into the pool the addresses and prefixes EC2 lists on a
    /// managed ENI that the pool lacks, and out of it those EC2 no longer
    /// lists; what the agent itself changed lately is left as it is.
    async fn reconcile_addrs(&self, eni: &EniInfo) -> Result<(), ManagerError> {
        let me = &self.inner;
        let now = Instant::now();
        let mut st = me.state.lock().await;
        st.recent
            .retain(|_, at| now.saturating_duration_since(*at) < RECENT_GRACE);
        let Some(record) = st.datastore.eni(&eni.id) else {
            return Ok(());
        };
        let pooled_addrs: BTreeSet<Ipv4Addr> = record.secondary_addrs().into_iter().collect();
        let pooled_prefixes: BTreeSet<Ipv4Net> = record.prefixes().into_iter().collect();
        let listed_addrs: BTreeSet<Ipv4Addr> = eni
            .secondary_addrs
            .iter()
            .copied()
            .filter(|a| Some(*a) != eni.primary_addr)
            .collect();
        let listed_prefixes: BTreeSet<Ipv4Net> = eni.prefixes.iter().copied().collect();
        let settled_addr = |a: &&Ipv4Addr| !st.changed_recently(Ipv4Net::from(**a), now);
        let settled_prefix = |p: &&Ipv4Net| !st.changed_recently(**p, now);
        let found_addrs: Vec<Ipv4Addr> = listed_addrs
            .difference(&pooled_addrs)
            .filter(settled_addr)
            .copied()
            .collect();
        let found_prefixes: Vec<Ipv4Net> = listed_prefixes
            .difference(&pooled_prefixes)
            .filter(settled_prefix)
            .copied()
            .collect();
        let lost_addrs: Vec<Ipv4Addr> = pooled_addrs
            .difference(&listed_addrs)
            .filter(settled_addr)
            .copied()
            .collect();
        let lost_prefixes: Vec<Ipv4Net> = pooled_prefixes
            .difference(&listed_prefixes)
            .filter(settled_prefix)
            .copied()
            .collect();
        if found_addrs.is_empty()
            && found_prefixes.is_empty()
            && lost_addrs.is_empty()
            && lost_prefixes.is_empty()
        {
            return Ok(());
        }
        st.datastore.add_addrs(&eni.id, &found_addrs)?;
        for p in &found_prefixes {
            st.datastore.add_prefix(&eni.id, *p)?;
        }
        let held = st
            .datastore
            .forget_addrs(&eni.id, &lost_addrs, &lost_prefixes)?;
        if !held.is_empty() {
            st.datastore
                .checkpoint()
                .write(&me.opts.settings.backing_store)?;
        }
        drop(st);
        for (key, addr) in &held {
            warn!(eni = %eni.id, %addr, pod = %key.container_id, "the pod's address was unassigned by someone else");
        }
        let per_prefix = IPS_PER_PREFIX;
        bump(
            &me.counters.cidrs_found,
            found_addrs.len() + found_prefixes.len(),
        );
        bump(
            &me.counters.cidrs_lost,
            lost_addrs.len() + lost_prefixes.len(),
        );
        bump(
            &me.counters.addrs_found,
            found_addrs.len() + found_prefixes.len() * per_prefix,
        );
        bump(
            &me.counters.addrs_lost,
            lost_addrs.len() + lost_prefixes.len() * per_prefix,
        );
        info!(
            eni = %eni.id,
            found = ?found_addrs,
            found_prefixes = ?found_prefixes,
            lost = ?lost_addrs,
            lost_prefixes = ?lost_prefixes,
            "addresses assigned or unassigned by someone else"
        );
        Ok(())
    }

    /// Re-reads the VPC's CIDRs from IMDS; a change reaches the datapath.
    pub(super) async fn refresh_vpc_cidrs(&self) -> Result<(), ManagerError> {
        let me = &self.inner;
        let mut cidrs = me.cloud.vpc_cidrs(&me.node.instance.primary_mac).await?;
        cidrs.sort();
        let mut st = me.state.lock().await;
        if st.vpc_cidrs == cidrs {
            return Ok(());
        }
        me.network
            .vpc_cidrs_changed(&cidrs)
            .map_err(|e| ManagerError::Network {
                eni: me.node.primary_eni.interface_id.clone(),
                reason: e.to_string(),
            })?;
        if !st.vpc_cidrs.is_empty() {
            info!(?cidrs, "the VPC's CIDRs changed");
        }
        st.vpc_cidrs = cidrs;
        Ok(())
    }
}
