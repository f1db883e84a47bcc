//! The address datastore: the node's ENIs, their secondary addresses and
//! /28 prefixes, which pod holds which address, and the cooldown a released
//! address rests before another pod gets it (`IP_COOLDOWN_PERIOD`: the old
//! pod's peers may still send to it).
//!
//! Time is passed in (`now`), so the cooldown is tested without waiting.

use std::{
    collections::BTreeMap,
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use ipnet::Ipv4Net;

use super::{
    checkpoint::{Checkpoint, CheckpointEntry, IpamKey, IpamMetadata},
    pool::PoolStats,
};

/// What an address is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
enum AddrState {
    /// Free since `released` (`None`: never used, or long enough ago).
    Free { released: Option<Instant> },
    /// Held by a pod.
    Assigned {
        key: IpamKey,
        metadata: IpamMetadata,
        /// Nanoseconds since the epoch, as the checkpoint keeps it.
        since_unix_ns: i64,
    },
}

/// An address and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Addr {
    state: AddrState,
    /// The prefix it belongs to, if it came with one.
    prefix: Option<Ipv4Net>,
}

/// One ENI's share of the pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EniRecord {
    pub device_number: u32,
    /// The primary ENI (its primary address is the node's).
    pub primary: bool,
    /// With custom networking the primary ENI serves no pod.
    pub excluded_for_pods: bool,
    addrs: BTreeMap<Ipv4Addr, Addr>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DatastoreError {
    #[error("no free address on this node (all assigned or cooling down)")]
    NoFreeAddress,
    #[error("ENI {0} is not in the datastore")]
    UnknownEni(String),
    #[error("ENI {eni} still has {assigned} addresses assigned to pods")]
    EniInUse { eni: String, assigned: usize },
    #[error("address {0} is assigned to a pod")]
    AddressInUse(Ipv4Addr),
}

/// A pod's address as handed out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub addr: Ipv4Addr,
    pub eni: String,
}

/// An assigned address and whose it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssignedAddr {
    pub key: IpamKey,
    pub metadata: IpamMetadata,
    pub addr: Ipv4Addr,
    pub eni: String,
    /// Nanoseconds since the epoch.
    pub since_unix_ns: i64,
}

#[derive(Clone, Debug)]
pub struct Datastore {
    enis: BTreeMap<String, EniRecord>,
    cooldown: Duration,
}

impl Datastore {
    #[must_use]
    pub fn new(cooldown: Duration) -> Self {
        Self {
            enis: BTreeMap::new(),
            cooldown,
        }
    }

    /// Adds an ENI (no-op if known).
    pub fn add_eni(
        &mut self,
        id: &str,
        device_number: u32,
        primary: bool,
        excluded_for_pods: bool,
    ) {
        self.enis.entry(id.to_owned()).or_insert_with(|| EniRecord {
            device_number,
            primary,
            excluded_for_pods,
            addrs: BTreeMap::new(),
        });
    }

    /// Removes an ENI that no pod uses.
    pub fn remove_eni(&mut self, id: &str) -> Result<(), DatastoreError> {
        let eni = self
            .enis
            .get(id)
            .ok_or_else(|| DatastoreError::UnknownEni(id.to_owned()))?;
        let assigned = eni.assigned();
        if assigned > 0 {
            return Err(DatastoreError::EniInUse {
                eni: id.to_owned(),
                assigned,
            });
        }
        self.enis.remove(id);
        Ok(())
    }

    /// Adds secondary addresses to an ENI.
    pub fn add_addrs(&mut self, eni: &str, addrs: &[Ipv4Addr]) -> Result<(), DatastoreError> {
        let record = self.eni_mut(eni)?;
        for addr in addrs {
            record.addrs.entry(*addr).or_insert(Addr {
                state: AddrState::Free { released: None },
                prefix: None,
            });
        }
        Ok(())
    }

    /// Adds a /28 prefix to an ENI: its 16 addresses become assignable.
    pub fn add_prefix(&mut self, eni: &str, prefix: Ipv4Net) -> Result<(), DatastoreError> {
        let record = self.eni_mut(eni)?;
        // All 16 addresses of a delegated prefix go to pods.
        let prefix = prefix.trunc();
        for addr in ipnet::Ipv4AddrRange::new(prefix.network(), prefix.broadcast()) {
            record.addrs.entry(addr).or_insert(Addr {
                state: AddrState::Free { released: None },
                prefix: Some(prefix),
            });
        }
        Ok(())
    }

    /// Removes a free secondary address (to give it back to EC2).
    pub fn remove_addr(&mut self, eni: &str, addr: Ipv4Addr) -> Result<(), DatastoreError> {
        let record = self.eni_mut(eni)?;
        if matches!(record.addrs.get(&addr), Some(a) if matches!(a.state, AddrState::Assigned { .. }))
        {
            return Err(DatastoreError::AddressInUse(addr));
        }
        record.addrs.remove(&addr);
        Ok(())
    }

    /// Removes a /28 prefix none of whose addresses a pod holds.
    pub fn remove_prefix(&mut self, eni: &str, prefix: Ipv4Net) -> Result<(), DatastoreError> {
        let record = self.eni_mut(eni)?;
        let prefix = prefix.trunc();
        if let Some((addr, _)) = record.addrs.iter().find(|(_, a)| {
            a.prefix == Some(prefix) && matches!(a.state, AddrState::Assigned { .. })
        }) {
            return Err(DatastoreError::AddressInUse(*addr));
        }
        record.addrs.retain(|_, a| a.prefix != Some(prefix));
        Ok(())
    }

    /// Removes an ENI gone from the instance with all its addresses, those
    /// pods hold too (they no longer work); returns the pods that held one.
    pub fn forget_eni(&mut self, id: &str) -> Vec<(IpamKey, Ipv4Addr)> {
        let Some(eni) = self.enis.remove(id) else {
            return Vec::new();
        };
        eni.addrs
            .into_iter()
            .filter_map(|(addr, a)| match a.state {
                AddrState::Assigned { key, .. } => Some((key, addr)),
                AddrState::Free { .. } => None,
            })
            .collect()
    }

    /// Removes secondary addresses and whole prefixes EC2 no longer lists
    /// on `eni`, those pods hold too; returns the pods that held one.
    pub fn forget_addrs(
        &mut self,
        eni: &str,
        addrs: &[Ipv4Addr],
        prefixes: &[Ipv4Net],
    ) -> Result<Vec<(IpamKey, Ipv4Addr)>, DatastoreError> {
        let record = self.eni_mut(eni)?;
        let mut held = Vec::new();
        record.addrs.retain(|addr, a| {
            let gone = match a.prefix {
                Some(prefix) => prefixes.contains(&prefix),
                None => addrs.contains(addr),
            };
            if gone && let AddrState::Assigned { key, .. } = &a.state {
                held.push((key.clone(), *addr));
            }
            !gone
        });
        Ok(held)
    }

    /// The ENIs, by id.
    pub fn enis(&self) -> impl Iterator<Item = (&String, &EniRecord)> {
        self.enis.iter()
    }

    /// One ENI.
    #[must_use]
    pub fn eni(&self, id: &str) -> Option<&EniRecord> {
        self.enis.get(id)
    }

    /// The cooldown released addresses rest for.
    #[must_use]
    pub fn cooldown(&self) -> Duration {
        self.cooldown
    }

    /// Hands `key` an address: the one it already holds (CNI ADD is retried
    /// by runtimes), else a free one out of its cooldown, taken from the
    /// ENIs in device order so lower ENIs fill first and higher ones empty
    /// out and can be freed.
    pub fn assign(
        &mut self,
        key: &IpamKey,
        metadata: &IpamMetadata,
        now: Instant,
        since_unix_ns: i64,
    ) -> Result<Assignment, DatastoreError> {
        if let Some(existing) = self.assignment_of(key) {
            return Ok(existing);
        }
        let cooldown = self.cooldown;
        let mut enis: Vec<(&String, &mut EniRecord)> = self
            .enis
            .iter_mut()
            .filter(|(_, e)| !e.excluded_for_pods)
            .collect();
        enis.sort_by_key(|(_, e)| e.device_number);
        for (id, eni) in enis {
            let free = eni.addrs.iter_mut().find(|(_, a)| a.is_idle(now, cooldown));
            if let Some((addr, a)) = free {
                a.state = AddrState::Assigned {
                    key: key.clone(),
                    metadata: metadata.clone(),
                    since_unix_ns,
                };
                return Ok(Assignment {
                    addr: *addr,
                    eni: id.clone(),
                });
            }
        }
        Err(DatastoreError::NoFreeAddress)
    }

    /// Frees `key`'s address; it rests for the cooldown. `None` if `key`
    /// held none (CNI DEL is called twice, and for pods never added).
    pub fn release(&mut self, key: &IpamKey, now: Instant) -> Option<Assignment> {
        for (id, eni) in &mut self.enis {
            for (addr, a) in &mut eni.addrs {
                if matches!(&a.state, AddrState::Assigned { key: k, .. } if k == key) {
                    a.state = AddrState::Free {
                        released: Some(now),
                    };
                    return Some(Assignment {
                        addr: *addr,
                        eni: id.clone(),
                    });
                }
            }
        }
        None
    }

    /// Every assignment: key, metadata, address, ENI and since when
    /// (nanoseconds since the epoch).
    pub fn assignments(&self) -> Vec<AssignedAddr> {
        let mut all = Vec::new();
        for (id, eni) in &self.enis {
            for (addr, a) in &eni.addrs {
                if let AddrState::Assigned {
                    key,
                    metadata,
                    since_unix_ns,
                } = &a.state
                {
                    all.push(AssignedAddr {
                        key: key.clone(),
                        metadata: metadata.clone(),
                        addr: *addr,
                        eni: id.clone(),
                        since_unix_ns: *since_unix_ns,
                    });
                }
            }
        }
        all
    }

    /// The address `key` holds.
    #[must_use]
    pub fn assignment_of(&self, key: &IpamKey) -> Option<Assignment> {
        self.enis.iter().find_map(|(id, eni)| {
            eni.addrs.iter().find_map(|(addr, a)| {
                matches!(&a.state, AddrState::Assigned { key: k, .. } if k == key).then(|| {
                    Assignment {
                        addr: *addr,
                        eni: id.clone(),
                    }
                })
            })
        })
    }

    /// The counts the pool decisions use at `now` (ENIs excluded for pods
    /// do not count): addresses still in their cooldown at `now` are
    /// `cooling_ips`.
    #[must_use]
    pub fn stats(&self, now: Instant) -> PoolStats {
        let mut stats = PoolStats::default();
        let mut prefixes: BTreeMap<Ipv4Net, bool> = BTreeMap::new();
        for eni in self.enis.values().filter(|e| !e.excluded_for_pods) {
            for a in eni.addrs.values() {
                stats.total_ips += 1;
                let assigned = matches!(a.state, AddrState::Assigned { .. });
                if assigned {
                    stats.assigned_ips += 1;
                } else if !a.is_idle(now, self.cooldown) {
                    stats.cooling_ips += 1;
                }
                if let Some(prefix) = a.prefix {
                    *prefixes.entry(prefix).or_default() |= assigned;
                }
            }
        }
        stats.total_prefixes = prefixes.len();
        stats.free_prefixes = prefixes.values().filter(|used| !**used).count();
        stats
    }

    /// What goes on disk: every assignment, in the VPC CNI's format.
    #[must_use]
    pub fn checkpoint(&self) -> Checkpoint {
        let allocations = self
            .assignments()
            .into_iter()
            .map(|a| CheckpointEntry {
                key: a.key,
                ipv4: Some(a.addr),
                ipv6: None,
                allocation_timestamp: a.since_unix_ns,
                metadata: a.metadata,
            })
            .collect();
        Checkpoint::new(allocations)
    }

    /// Replays a checkpoint onto the ENIs rebuilt from EC2 and IMDS: every
    /// address a running pod holds is marked held again, so it is never
    /// handed out twice. Returns the entries whose address no ENI has (their
    /// pods lost the address; the caller reports them).
    pub fn restore(&mut self, checkpoint: &Checkpoint) -> Vec<CheckpointEntry> {
        let mut orphans = Vec::new();
        for entry in &checkpoint.allocations {
            let Some(addr) = entry.ipv4 else {
                orphans.push(entry.clone());
                continue;
            };
            let slot = self
                .enis
                .values_mut()
                .find_map(|eni| eni.addrs.get_mut(&addr));
            match slot {
                Some(a) => {
                    a.state = AddrState::Assigned {
                        key: entry.key.clone(),
                        metadata: entry.metadata.clone(),
                        since_unix_ns: entry.allocation_timestamp,
                    };
                }
                None => orphans.push(entry.clone()),
            }
        }
        orphans
    }

    fn eni_mut(&mut self, id: &str) -> Result<&mut EniRecord, DatastoreError> {
        self.enis
            .get_mut(id)
            .ok_or_else(|| DatastoreError::UnknownEni(id.to_owned()))
    }
}

impl Addr {
    /// Free and out of its cooldown: it may go to a pod, or back to EC2.
    fn is_idle(&self, now: Instant, cooldown: Duration) -> bool {
        match self.state {
            AddrState::Free { released } => {
                released.is_none_or(|at| now.saturating_duration_since(at) >= cooldown)
            }
            AddrState::Assigned { .. } => false,
        }
    }
}

impl EniRecord {
    /// Addresses of this ENI held by pods.
    #[must_use]
    pub fn assigned(&self) -> usize {
        self.addrs
            .values()
            .filter(|a| matches!(a.state, AddrState::Assigned { .. }))
            .count()
    }

    /// Secondary addresses (not from prefixes).
    #[must_use]
    pub fn secondary_addrs(&self) -> Vec<Ipv4Addr> {
        self.addrs
            .iter()
            .filter(|(_, a)| a.prefix.is_none())
            .map(|(addr, _)| *addr)
            .collect()
    }

    /// The /28 prefixes.
    #[must_use]
    pub fn prefixes(&self) -> Vec<Ipv4Net> {
        let mut prefixes: Vec<Ipv4Net> = self.addrs.values().filter_map(|a| a.prefix).collect();
        prefixes.dedup();
        prefixes
    }

    /// The ENI's EC2 address slots in use: its primary address, each
    /// secondary address, each prefix.
    #[must_use]
    pub fn slots_used(&self) -> usize {
        1 + self.secondary_addrs().len() + self.prefixes().len()
    }

    /// Addresses in the pool (secondary addresses and prefix addresses).
    #[must_use]
    pub fn total(&self) -> usize {
        self.addrs.len()
    }

    /// Secondary addresses no pod holds and out of their cooldown: these may
    /// go back to EC2.
    #[must_use]
    pub fn idle_secondary_addrs(&self, now: Instant, cooldown: Duration) -> Vec<Ipv4Addr> {
        self.addrs
            .iter()
            .filter(|(_, a)| a.prefix.is_none() && a.is_idle(now, cooldown))
            .map(|(addr, _)| *addr)
            .collect()
    }

    /// Prefixes whose 16 addresses are all idle.
    #[must_use]
    pub fn idle_prefixes(&self, now: Instant, cooldown: Duration) -> Vec<Ipv4Net> {
        self.prefixes()
            .into_iter()
            .filter(|p| {
                self.addrs
                    .values()
                    .filter(|a| a.prefix == Some(*p))
                    .all(|a| a.is_idle(now, cooldown))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> IpamKey {
        IpamKey {
            network_name: "aws-cni".into(),
            container_id: id.into(),
            if_name: "eth0".into(),
        }
    }

    fn pod(name: &str) -> IpamMetadata {
        IpamMetadata {
            k8s_pod_namespace: "default".into(),
            k8s_pod_name: name.into(),
            interfaces_count: 1,
        }
    }

    fn addr(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 20, 11, last)
    }

    fn node() -> Datastore {
        let mut ds = Datastore::new(Duration::from_secs(30));
        ds.add_eni("eni-1", 1, false, false);
        ds.add_eni("eni-0", 0, true, false);
        ds.add_addrs("eni-0", &[addr(20), addr(21)]).unwrap();
        ds.add_addrs("eni-1", &[addr(30)]).unwrap();
        ds
    }

    #[test]
    fn assigns_from_lower_enis_first_and_is_idempotent() {
        let mut ds = node();
        let now = Instant::now();
        let a = ds.assign(&key("a"), &pod("a"), now, 1).unwrap();
        assert_eq!(
            a,
            Assignment {
                addr: addr(20),
                eni: "eni-0".into()
            }
        );
        assert_eq!(
            ds.assign(&key("a"), &pod("a"), now, 1).unwrap(),
            a,
            "ADD retried"
        );
        ds.assign(&key("b"), &pod("b"), now, 1).unwrap();
        assert_eq!(
            ds.assign(&key("c"), &pod("c"), now, 1).unwrap().eni,
            "eni-1"
        );
        assert_eq!(
            ds.assign(&key("d"), &pod("d"), now, 1),
            Err(DatastoreError::NoFreeAddress)
        );
        assert_eq!(
            ds.stats(now),
            PoolStats {
                total_ips: 3,
                assigned_ips: 3,
                ..PoolStats::default()
            }
        );
    }

    #[test]
    fn a_released_address_rests_for_the_cooldown() {
        let mut ds = node();
        let t0 = Instant::now();
        for k in ["a", "b", "c"] {
            ds.assign(&key(k), &pod(k), t0, 1).unwrap();
        }
        let freed = ds.release(&key("a"), t0).unwrap();
        assert_eq!(ds.release(&key("a"), t0), None, "DEL twice");
        let cooling = |at: Duration| {
            let s = ds.stats(t0 + at);
            (s.assigned_ips, s.cooling_ips, s.available())
        };
        assert_eq!(cooling(Duration::ZERO), (2, 1, 1), "cooling, yet available");
        assert_eq!(cooling(Duration::from_secs(29)), (2, 1, 1));
        assert_eq!(cooling(Duration::from_secs(30)), (2, 0, 1), "rested");
        assert_eq!(
            ds.assign(&key("d"), &pod("d"), t0 + Duration::from_secs(29), 1),
            Err(DatastoreError::NoFreeAddress),
            "not within the cooldown"
        );
        let d = ds
            .assign(&key("d"), &pod("d"), t0 + Duration::from_secs(30), 1)
            .unwrap();
        assert_eq!(d.addr, freed.addr);
    }

    #[test]
    fn prefixes_count_free_and_used() {
        let mut ds = Datastore::new(Duration::ZERO);
        ds.add_eni("eni-0", 0, true, false);
        ds.add_prefix("eni-0", "10.20.11.32/28".parse().unwrap())
            .unwrap();
        ds.add_prefix("eni-0", "10.20.11.48/28".parse().unwrap())
            .unwrap();
        ds.assign(&key("a"), &pod("a"), Instant::now(), 1).unwrap();
        let s = ds.stats(Instant::now());
        assert_eq!(
            (
                s.total_ips,
                s.assigned_ips,
                s.total_prefixes,
                s.free_prefixes
            ),
            (32, 1, 2, 1)
        );
    }

    #[test]
    fn custom_networking_keeps_pods_off_the_primary_eni() {
        let mut ds = Datastore::new(Duration::ZERO);
        ds.add_eni("eni-0", 0, true, true);
        ds.add_eni("eni-1", 1, false, false);
        ds.add_addrs("eni-0", &[addr(20)]).unwrap();
        ds.add_addrs("eni-1", &[Ipv4Addr::new(100, 64, 0, 5)])
            .unwrap();
        assert_eq!(
            ds.assign(&key("a"), &pod("a"), Instant::now(), 1)
                .unwrap()
                .eni,
            "eni-1"
        );
        assert_eq!(ds.stats(Instant::now()).total_ips, 1);
    }

    #[test]
    fn enis_and_addresses_in_use_are_never_removed() {
        let mut ds = node();
        ds.assign(&key("a"), &pod("a"), Instant::now(), 1).unwrap();
        assert_eq!(
            ds.remove_addr("eni-0", addr(20)),
            Err(DatastoreError::AddressInUse(addr(20)))
        );
        assert!(matches!(
            ds.remove_eni("eni-0"),
            Err(DatastoreError::EniInUse { assigned: 1, .. })
        ));
        ds.remove_addr("eni-0", addr(21)).unwrap();
        ds.remove_eni("eni-1").unwrap();
    }

    #[test]
    fn a_restart_never_hands_out_a_held_address() {
        let mut ds = node();
        let now = Instant::now();
        ds.assign(&key("a"), &pod("a"), now, 111).unwrap();
        ds.assign(&key("b"), &pod("b"), now, 222).unwrap();
        let saved = ds.checkpoint();
        assert_eq!(saved.allocations.len(), 2);

        // The restarted agent rebuilds the ENIs (eni-1 lost its address
        // meanwhile) and replays the checkpoint.
        let mut restarted = Datastore::new(Duration::from_secs(30));
        restarted.add_eni("eni-0", 0, true, false);
        restarted.add_eni("eni-1", 1, false, false);
        restarted.add_addrs("eni-0", &[addr(20), addr(21)]).unwrap();
        let mut with_orphan = saved.clone();
        with_orphan.allocations.push(CheckpointEntry {
            ipv4: Some(Ipv4Addr::new(10, 20, 11, 99)),
            ..saved.allocations[0].clone()
        });
        let orphans = restarted.restore(&with_orphan);
        assert_eq!(orphans.len(), 1);
        assert_eq!(restarted.assignment_of(&key("b")).unwrap().addr, addr(21));
        assert_eq!(
            restarted.assign(&key("c"), &pod("c"), now, 1),
            Err(DatastoreError::NoFreeAddress),
            "both addresses are held"
        );
        assert_eq!(restarted.checkpoint().allocations, saved.allocations);
    }

    #[test]
    fn what_ec2_no_longer_lists_is_forgotten_held_or_not() {
        let mut ds = Datastore::new(Duration::ZERO);
        let now = Instant::now();
        let a1 = Ipv4Addr::new(10, 0, 0, 11);
        let a2 = Ipv4Addr::new(10, 0, 0, 12);
        let prefix: Ipv4Net = "10.0.1.0/28".parse().unwrap();
        ds.add_eni("eni-1", 1, false, false);
        ds.add_addrs("eni-1", &[a1, a2]).unwrap();
        ds.add_prefix("eni-1", prefix).unwrap();
        let held = ds.assign(&key("c1"), &pod("p"), now, 0).unwrap();
        let lost = ds.forget_addrs("eni-1", &[held.addr], &[prefix]).unwrap();
        assert_eq!(lost, [(key("c1"), held.addr)]);
        let eni = ds.eni("eni-1").unwrap();
        assert_eq!(eni.total(), 1, "the other address stays");
        assert!(eni.prefixes().is_empty());
        assert_eq!(ds.assignment_of(&key("c1")), None);
        let other = ds.assign(&key("c2"), &pod("p"), now, 0).unwrap();
        assert_eq!(ds.forget_eni("eni-1"), [(key("c2"), other.addr)]);
        assert!(ds.eni("eni-1").is_none());
        assert!(ds.forget_eni("eni-1").is_empty(), "gone already");
    }
}
