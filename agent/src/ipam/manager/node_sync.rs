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
    ipam::{datastore::EniRecord, pool::IPS_PER_PREFIX},
};

/// How long what the agent itself assigned or gave back is left out of the
/// node's reconcile: IMDS and EC2 may show it late (aws-node waits as long).
const RECENT_GRACE: Duration = Duration::from_mins(1);

/// ENIs attached or detached by someone else, as EC2 lists them.
#[derive(Debug, PartialEq, Eq)]
struct EniChanges {
    new: Vec<EniInfo>,
    gone: Vec<String>,
}

/// Addresses and prefixes assigned or unassigned by someone else on one ENI.
#[derive(Debug, Default, PartialEq, Eq)]
struct AddrChanges {
    found_addrs: Vec<Ipv4Addr>,
    found_prefixes: Vec<Ipv4Net>,
    lost_addrs: Vec<Ipv4Addr>,
    lost_prefixes: Vec<Ipv4Net>,
}

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

    /// Whether IMDS shows other ENIs, addresses or prefixes than the pool
    /// holds.
    fn differs_from(&self, imds: &[ImdsEni]) -> bool {
        if imds.len() != self.enis.len() {
            return true;
        }
        imds.iter().any(|listed| {
            let Some((id, tracked)) = self.enis.iter().find(|(_, t)| t.mac == listed.mac) else {
                return true;
            };
            let Some(record) = self.datastore.eni(id) else {
                // Left alone: only its being there matters.
                return false;
            };
            listed_sets(&listed.local_ipv4s, tracked.primary_addr, &listed.prefixes)
                != pooled_sets(record)
        })
    }

    /// ENIs EC2 lists as attached that the pool neither tracks nor drains
    /// (new), and tracked ones it no longer lists (gone).
    fn eni_changes(&self, attached: &[EniInfo]) -> EniChanges {
        EniChanges {
            new: attached
                .iter()
                .filter(|e| !self.enis.contains_key(&e.id) && !self.draining.contains_key(&e.id))
                .cloned()
                .collect(),
            gone: self
                .enis
                .keys()
                .filter(|id| !attached.iter().any(|e| &e.id == *id))
                .cloned()
                .collect(),
        }
    }

    /// What EC2 lists on `eni` that the pool lacks (found) and what the
    /// pool holds that EC2 no longer lists (lost), leaving out what the
    /// agent itself changed within [`RECENT_GRACE`] of `now`.
    fn addr_changes(&self, record: &EniRecord, eni: &EniInfo, now: Instant) -> AddrChanges {
        let (pooled_addrs, pooled_prefixes) = pooled_sets(record);
        let (listed_addrs, listed_prefixes) =
            listed_sets(&eni.secondary_addrs, eni.primary_addr, &eni.prefixes);
        let settled_addr = |a: &Ipv4Addr| !self.changed_recently(Ipv4Net::from(*a), now);
        let settled_prefix = |p: &Ipv4Net| !self.changed_recently(*p, now);
        let found_addrs = settled_beyond(&listed_addrs, &pooled_addrs, settled_addr);
        let found_prefixes = settled_beyond(&listed_prefixes, &pooled_prefixes, settled_prefix);
        let lost_addrs = settled_beyond(&pooled_addrs, &listed_addrs, settled_addr);
        let lost_prefixes = settled_beyond(&pooled_prefixes, &listed_prefixes, settled_prefix);
        AddrChanges {
            found_addrs,
            found_prefixes,
            lost_addrs,
            lost_prefixes,
        }
    }
}

/// A listed ENI's secondary addresses (all but its `primary`) and its
/// prefixes, as sets to compare with [`pooled_sets`].
fn listed_sets(
    addrs: &[Ipv4Addr],
    primary: Option<Ipv4Addr>,
    prefixes: &[Ipv4Net],
) -> (BTreeSet<Ipv4Addr>, BTreeSet<Ipv4Net>) {
    (
        addrs
            .iter()
            .copied()
            .filter(|a| Some(*a) != primary)
            .collect(),
        prefixes.iter().copied().collect(),
    )
}

/// The secondary addresses and prefixes the pool holds on an ENI.
fn pooled_sets(record: &EniRecord) -> (BTreeSet<Ipv4Addr>, BTreeSet<Ipv4Net>) {
    (
        record.secondary_addrs().into_iter().collect(),
        record.prefixes().into_iter().collect(),
    )
}

/// What `of` has beyond `than`, leaving out what is not `settled`.
fn settled_beyond<T: Ord + Copy>(
    of: &BTreeSet<T>,
    than: &BTreeSet<T>,
    settled: impl Fn(&T) -> bool,
) -> Vec<T> {
    of.difference(than)
        .copied()
        .filter(|x| settled(x))
        .collect()
}

impl Manager {
    /// Brings the pool in line with what is attached to the instance,
    /// whoever attached or assigned it (aws-node's node IP pool
    /// reconcile): ENIs attached or detached, addresses and prefixes
    /// assigned or unassigned by someone else. IMDS says whether anything
    /// differs; EC2, the authority, then says what. The only way to the
    /// pool with `DISABLE_NETWORK_RESOURCE_PROVISIONING`.
    pub(super) async fn reconcile_attached(&self) -> Result<(), ManagerError> {
        let _action = crate::telemetry::action(crate::telemetry::ACTION_NODE_RECONCILE);
        let me = &self.inner;
        bump(&me.counters.node_reconciles, 1);
        let imds = me.cloud.imds_enis().await?;
        if !me.state.lock().await.differs_from(&imds) {
            return Ok(());
        }
        let attached: Vec<EniInfo> = me
            .cloud
            .instance_enis(&me.node.instance.instance_id)
            .await?
            .into_iter()
            .filter(|e| e.attachment_status.as_deref() == Some("attached"))
            .collect();
        let EniChanges { new, gone } = me.state.lock().await.eni_changes(&attached);
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
        let AddrChanges {
            found_addrs,
            found_prefixes,
            lost_addrs,
            lost_prefixes,
        } = st.addr_changes(record, eni, now);
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

#[cfg(test)]
mod tests {
    //! What the node's sync concludes from IMDS's and EC2's answers, on a
    //! pool of two ENIs: the primary (10.0.0.10, pods on .11 and .12) and
    //! eni-1 (10.0.1.10, .11 and .12).

    use std::collections::BTreeMap;

    use super::*;
    use crate::ipam::{datastore::Datastore, manager::TrackedEni};

    fn addr(eni: u8, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 0, eni, host)
    }

    fn mac(eni: u8) -> String {
        format!("0a:00:00:00:00:{eni:02x}")
    }

    fn id(eni: u8) -> String {
        if eni == 0 {
            "eni-primary".to_owned()
        } else {
            format!("eni-{eni}")
        }
    }

    fn tracked(eni: u8) -> TrackedEni {
        TrackedEni {
            device_number: eni.into(),
            mac: mac(eni),
            attachment_id: None,
            subnet_id: "subnet-1".to_owned(),
            subnet: Ipv4Net::new(addr(eni, 0), 24).unwrap(),
            subnet_excluded: false,
            primary_addr: Some(addr(eni, 10)),
            no_manage: false,
            trunk: false,
            attached_at: Instant::now(),
        }
    }

    fn pool() -> State {
        let mut datastore = Datastore::new(Duration::ZERO);
        let mut enis = BTreeMap::new();
        for eni in [0, 1] {
            datastore.add_eni(&id(eni), eni.into(), eni == 0, false);
            datastore
                .add_addrs(&id(eni), &[addr(eni, 11), addr(eni, 12)])
                .unwrap();
            enis.insert(id(eni), tracked(eni));
        }
        State {
            datastore,
            enis,
            draining: BTreeMap::new(),
            prefix_fallback: false,
            recent: BTreeMap::new(),
            vpc_cidrs: Vec::new(),
        }
    }

    /// IMDS's view of ENI `eni` with these secondary addresses.
    fn imds(eni: u8, secondary: &[u8]) -> ImdsEni {
        ImdsEni {
            mac: mac(eni),
            device_number: eni.into(),
            interface_id: id(eni),
            subnet_id: "subnet-1".to_owned(),
            subnet_cidr: Ipv4Net::new(addr(eni, 0), 24).unwrap(),
            local_ipv4s: std::iter::once(10)
                .chain(secondary.iter().copied())
                .map(|h| addr(eni, h))
                .collect(),
            prefixes: Vec::new(),
            security_groups: Vec::new(),
            vpc_cidrs: Vec::new(),
        }
    }

    /// EC2's view of attached ENI `eni` with these secondary addresses.
    fn ec2(eni: u8, secondary: &[u8]) -> EniInfo {
        EniInfo {
            id: id(eni),
            mac: mac(eni),
            subnet_id: "subnet-1".to_owned(),
            status: "in-use".to_owned(),
            attachment_id: Some(format!("attach-{eni}")),
            attachment_status: Some("attached".to_owned()),
            device_index: Some(eni.into()),
            primary_addr: Some(addr(eni, 10)),
            secondary_addrs: secondary.iter().map(|h| addr(eni, *h)).collect(),
            prefixes: Vec::new(),
            tags: BTreeMap::new(),
            interface_type: None,
        }
    }

    #[test]
    fn imds_as_the_pool_holds_it_needs_no_look_at_ec2() {
        let st = pool();
        assert!(!st.differs_from(&[imds(0, &[11, 12]), imds(1, &[11, 12])]));
    }

    #[test]
    fn imds_with_other_enis_or_addresses_sends_the_sync_to_ec2() {
        let st = pool();
        let cases = [
            (
                "an ENI attached by someone else",
                vec![imds(0, &[11, 12]), imds(1, &[11, 12]), imds(2, &[])],
            ),
            ("an ENI detached by someone else", vec![imds(0, &[11, 12])]),
            (
                "an address assigned by someone else",
                vec![imds(0, &[11, 12]), imds(1, &[11, 12, 13])],
            ),
            (
                "an address unassigned by someone else",
                vec![imds(0, &[11]), imds(1, &[11, 12])],
            ),
            (
                "another ENI in a tracked one's place",
                vec![imds(0, &[11, 12]), imds(3, &[11, 12])],
            ),
        ];
        for (case, listed) in cases {
            assert!(st.differs_from(&listed), "{case}");
        }
    }

    #[test]
    fn an_eni_left_alone_counts_by_its_being_there() {
        let mut st = pool();
        let mut foreign = tracked(2);
        foreign.no_manage = true;
        st.enis.insert(id(2), foreign);
        let listed = [imds(0, &[11, 12]), imds(1, &[11, 12]), imds(2, &[20, 21])];
        assert!(
            !st.differs_from(&listed),
            "its addresses are not the pool's"
        );
    }

    #[test]
    fn ec2_says_which_enis_came_and_went() {
        let mut st = pool();
        st.draining.insert(id(3), None);
        let changes = st.eni_changes(&[ec2(0, &[11, 12]), ec2(2, &[]), ec2(3, &[])]);
        assert_eq!(
            changes,
            EniChanges {
                new: vec![ec2(2, &[])],
                gone: vec![id(1)],
            },
            "eni-2 is new; eni-3 is being deleted by the agent, not new; eni-1 is gone"
        );
        assert_eq!(
            st.eni_changes(&[ec2(0, &[]), ec2(1, &[])]),
            EniChanges {
                new: Vec::new(),
                gone: Vec::new(),
            }
        );
    }

    #[test]
    fn ec2_says_which_addresses_came_and_went() {
        let st = pool();
        let now = Instant::now();
        let prefix = Ipv4Net::new(addr(1, 32), 28).unwrap();
        let mut listed = ec2(1, &[12, 13]);
        listed.prefixes.push(prefix);
        let record = st.datastore.eni(&id(1)).unwrap();
        assert_eq!(
            st.addr_changes(record, &listed, now),
            AddrChanges {
                found_addrs: vec![addr(1, 13)],
                found_prefixes: vec![prefix],
                lost_addrs: vec![addr(1, 11)],
                lost_prefixes: Vec::new(),
            }
        );
        assert_eq!(
            st.addr_changes(record, &ec2(1, &[11, 12]), now),
            AddrChanges::default(),
            "EC2 as the pool holds it"
        );
    }

    #[test]
    fn what_the_agent_changed_lately_is_not_someone_elses() {
        let mut st = pool();
        // The agent just assigned .13 and gave back .11: EC2 may not show
        // either yet.
        st.recently_changed([addr(1, 13), addr(1, 11)].map(Ipv4Net::from));
        let now = Instant::now();
        let record = st.datastore.eni(&id(1)).unwrap();
        assert_eq!(
            st.addr_changes(record, &ec2(1, &[11, 12]), now),
            AddrChanges::default()
        );
        assert_eq!(
            st.addr_changes(record, &ec2(1, &[12, 13]), now + RECENT_GRACE),
            AddrChanges {
                found_addrs: vec![addr(1, 13)],
                lost_addrs: vec![addr(1, 11)],
                ..AddrChanges::default()
            },
            "once the grace has passed, EC2 is believed"
        );
    }
}
