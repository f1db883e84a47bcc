//! Pods' addresses: assigning (on disk before the answer, waiting for the
//! pool to grow), releasing, and what the node holds, for the CNI server
//! and introspection; the trunk ENI branch pods hang on.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    pin::pin,
    time::{Duration, Instant},
};

use tracing::info;

use super::{EniDetail, IpamStatus, Manager, ManagerError, PodAddress, State, bump, gateway_of};
use crate::ipam::{
    checkpoint::{IpamKey, IpamMetadata},
    datastore::{AssignedAddr, Assignment, DatastoreError, EniRecord},
    manager::unix_ns,
    pool,
};

/// How often an ADD waiting on cooling addresses looks again.
const COOLDOWN_RECHECK: Duration = Duration::from_millis(100);

impl Manager {
    /// Hands the pod an address (the one it holds if the ADD is retried),
    /// written to the checkpoint before it is returned. With the pool empty
    /// it waits up to `assign_wait` for the pool to grow, then says
    /// [`ManagerError::NoAddressYet`] (or [`ManagerError::NoAddress`] at
    /// once when the pool cannot grow: no address cooling down, no ENI
    /// slot coming free, and nothing more to ask EC2 for).
    pub async fn assign(
        &self,
        key: &IpamKey,
        metadata: &IpamMetadata,
    ) -> Result<PodAddress, ManagerError> {
        let me = &self.inner;
        let deadline = tokio::time::Instant::now() + me.opts.assign_wait;
        loop {
            let mut changed = pin!(me.pool_changed.notified());
            changed.as_mut().enable();
            // Free addresses ADD could not take are cooling down.
            let cooling;
            // An ENI the pool gave back still holds its slot until EC2
            // deletes it: the node is not full.
            let slot_coming_free;
            {
                let mut st = me.state.lock().await;
                match st
                    .datastore
                    .assign(key, metadata, Instant::now(), unix_ns())
                {
                    Ok(assignment) => {
                        if let Err(e) = st
                            .datastore
                            .checkpoint()
                            .write(&me.opts.settings.backing_store)
                        {
                            // Not on disk: not handed out.
                            // Released as if long ago: it never left, so no cooldown.
                            let long_ago = Instant::now()
                                .checked_sub(me.opts.settings.ip_cooldown)
                                .unwrap_or_else(Instant::now);
                            st.datastore.release(key, long_ago);
                            return Err(e.into());
                        }
                        let eni = &st.enis[&assignment.eni];
                        let reply = PodAddress {
                            addr: assignment.addr,
                            device_number: eni.device_number,
                            eni_mac: eni.mac.clone(),
                            branch: false,
                            subnet: eni.subnet,
                            gateway: gateway_of(eni.subnet),
                            eni_id: assignment.eni,
                        };
                        drop(st);
                        bump(&me.counters.assigned, 1);
                        me.wake.notify_one();
                        return Ok(reply);
                    }
                    Err(DatastoreError::NoFreeAddress) => {
                        cooling = st.datastore.stats(Instant::now()).available() > 0;
                        slot_coming_free = !st.draining.is_empty();
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if !cooling && !me.opts.settings.provisioning {
                bump(&me.counters.assign_failures, 1);
                return Err(ManagerError::NoAddress(
                    "no free address, and DISABLE_NETWORK_RESOURCE_PROVISIONING leaves adding any to others",
                ));
            }
            if !cooling && !slot_coming_free && self.plan_growth().await.is_none() {
                // Full: every ENI slot and address in use, or max pods.
                bump(&me.counters.assign_failures, 1);
                return Err(ManagerError::NoAddress(
                    "the node is at its ENI, address or max-pods limit",
                ));
            }
            me.wake.notify_one();
            // A cooldown ends without an event: look again shortly.
            let wake_at = if cooling {
                deadline.min(tokio::time::Instant::now() + COOLDOWN_RECHECK)
            } else {
                deadline
            };
            if tokio::time::timeout_at(wake_at, changed).await.is_err()
                && tokio::time::Instant::now() >= deadline
            {
                bump(&me.counters.assign_failures, 1);
                return Err(ManagerError::NoAddressYet(
                    "no free address on the node and the pool could not grow in time",
                ));
            }
        }
    }

    /// Releases the pod's address (none held: `None`, not an error), on
    /// disk before the answer.
    pub async fn release(&self, key: &IpamKey) -> Result<Option<Ipv4Addr>, ManagerError> {
        let me = &self.inner;
        let mut st = me.state.lock().await;
        let Some(released) = st.datastore.release(key, Instant::now()) else {
            return Ok(None);
        };
        st.datastore
            .checkpoint()
            .write(&me.opts.settings.backing_store)?;
        drop(st);
        bump(&me.counters.released, 1);
        me.wake.notify_one();
        Ok(Some(released.addr))
    }

    /// The address `key` holds, with the MAC of the ENI that owns it.
    pub async fn assignment(&self, key: &IpamKey) -> Option<(Assignment, String)> {
        let st = self.inner.state.lock().await;
        let assignment = st.datastore.assignment_of(key)?;
        let mac = st
            .enis
            .get(&assignment.eni)
            .map(|e| e.mac.clone())
            .unwrap_or_default();
        Some((assignment, mac))
    }

    /// Every pod's address, with the MAC of the ENI that owns it.
    pub async fn assignments(&self) -> Vec<(AssignedAddr, String)> {
        let st = self.inner.state.lock().await;
        st.datastore
            .assignments()
            .into_iter()
            .map(|a| {
                let mac = st
                    .enis
                    .get(&a.eni)
                    .map(|e| e.mac.clone())
                    .unwrap_or_default();
                (a, mac)
            })
            .collect()
    }

    /// Addresses an ADD could take now (out of their cooldown).
    pub async fn available(&self) -> usize {
        let st = self.inner.state.lock().await;
        let stats = st.datastore.stats(Instant::now());
        stats.available().saturating_sub(stats.cooling_ips)
    }

    /// The MTU pods get (`AWS_VPC_ENI_MTU`).
    #[must_use]
    pub fn eni_mtu(&self) -> u32 {
        self.inner.opts.settings.eni_mtu
    }

    /// The pool's figures, counters and recent events.
    pub async fn status(&self) -> IpamStatus {
        let me = &self.inner;
        let st = me.state.lock().await;
        IpamStatus {
            stats: st.datastore.stats(Instant::now()),
            enis: st.enis.len(),
            max_enis: me.node.max_enis,
            max_pods: me.node.max_pods,
            max_ips: pool::max_ips(
                me.node.limits,
                me.node.max_enis,
                me.opts.settings.prefix_delegation,
            ),
            prefix_fallback: st.prefix_fallback,
            counters: me.counters.snapshot(),
            events: me.events.recent(),
        }
    }

    /// The node's trunk ENI (security groups for pods): its id and MAC.
    /// One the manager does not know yet (the resource controller attached
    /// it since the node's last reconcile) is looked up in EC2 now, so a
    /// branch pod does not wait for that reconcile. `None`: no trunk.
    pub async fn trunk(&self) -> Result<Option<(String, String)>, ManagerError> {
        let known = |st: &State| {
            st.enis
                .iter()
                .find(|(_, tracked)| tracked.trunk)
                .map(|(id, tracked)| (id.clone(), tracked.mac.clone()))
        };
        if let Some(trunk) = known(&*self.inner.state.lock().await) {
            return Ok(Some(trunk));
        }
        let me = &self.inner;
        let Some(trunk) = me
            .cloud
            .instance_enis(&me.node.instance.instance_id)
            .await?
            .into_iter()
            .find(|e| e.is_trunk() && e.attachment_status.as_deref() == Some("attached"))
        else {
            return Ok(None);
        };
        if !me.state.lock().await.enis.contains_key(&trunk.id) {
            info!(eni = %trunk.id, device = ?trunk.device_index, "trunk ENI found for a branch pod");
            self.track(&trunk, false).await?;
        }
        Ok(Some((trunk.id, trunk.mac)))
    }

    /// The node's ENIs as introspection shows them, in device order: what
    /// each holds and which pod holds which of its addresses.
    pub async fn enis(&self) -> Vec<EniDetail> {
        let me = &self.inner;
        let st = me.state.lock().await;
        let mut assigned: BTreeMap<&str, Vec<AssignedAddr>> = BTreeMap::new();
        let assignments = st.datastore.assignments();
        for a in &assignments {
            assigned.entry(a.eni.as_str()).or_default().push(a.clone());
        }
        let mut enis: Vec<EniDetail> = st
            .enis
            .iter()
            .map(|(id, tracked)| {
                let record = st.datastore.eni(id);
                EniDetail {
                    id: id.clone(),
                    device_number: tracked.device_number,
                    mac: tracked.mac.clone(),
                    attachment_id: tracked.attachment_id.clone(),
                    subnet: tracked.subnet,
                    primary_addr: tracked.primary_addr,
                    primary: tracked.mac == me.node.instance.primary_mac,
                    no_manage: tracked.no_manage,
                    excluded_for_pods: record.is_some_and(|r| r.excluded_for_pods),
                    secondary_addrs: record.map(EniRecord::secondary_addrs).unwrap_or_default(),
                    prefixes: record.map(EniRecord::prefixes).unwrap_or_default(),
                    assigned: assigned.remove(id.as_str()).unwrap_or_default(),
                }
            })
            .collect();
        enis.sort_by_key(|e| e.device_number);
        enis
    }
}
