//! What the policy maps hold for a set of pods' rules: one identity per
//! distinct compiled direction and one port set per distinct set of ports,
//! shared by every pod and prefix that has them, and the writes that take
//! the maps from one content to another without a moment in which a pod's
//! packets meet a half-written identity.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use ipnet::Ipv4Net;
use vpcnet_common::policy::{POLICY_UNISOLATED, PodPolicy};

use super::{
    compile::{Compiled, PortSet, compile},
    rules::{PodRules, Tiers, Verdict},
};

/// A `POLICY_PORTS` entry: port set, trie prefix length, protocol, port,
/// and its verdict (a port set's content, so its entries, never change
/// under its id).
pub type PortEntry = (u32, u32, u8, u16, Verdict);

/// The content of the three policy maps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tables {
    pub pods: BTreeMap<Ipv4Addr, PodPolicy>,
    /// (identity, peer prefix) to port set.
    pub cidrs: BTreeMap<(u32, Ipv4Net), u32>,
    pub ports: BTreeSet<PortEntry>,
}

/// One write to a policy map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    SetPort(PortEntry),
    SetCidr(u32, Ipv4Net, u32),
    SetPod(Ipv4Addr, PodPolicy),
    RemovePod(Ipv4Addr),
    RemoveCidr(u32, Ipv4Net),
    RemovePort(PortEntry),
}

impl Tables {
    /// Adds what `from` holds for the pod at `addr` (its identities, their
    /// prefixes and port sets) to `self`; `false` when `from` holds nothing
    /// for it. The ids cannot meet new ones: numbering starts above them.
    pub fn keep_pod(&mut self, from: &Self, addr: Ipv4Addr) -> bool {
        let Some(policy) = from.pods.get(&addr) else {
            return false;
        };
        self.pods.insert(addr, *policy);
        let ids = [policy.ingress, policy.egress];
        let mut sets = BTreeSet::new();
        for (&(id, prefix), &set) in &from.cidrs {
            if ids.contains(&id) {
                self.cidrs.insert((id, prefix), set);
                sets.insert(set);
            }
        }
        self.ports.extend(
            from.ports
                .iter()
                .filter(|(set, ..)| sets.contains(set))
                .copied(),
        );
        true
    }

    /// The writes that make `self` into `next`: what is added first (port
    /// sets, then prefixes, then the pods that point at them), what is
    /// removed last (pods, then prefixes, then port sets), so every lookup
    /// in between finds either the old answer or the new one.
    #[must_use]
    pub fn writes_to(&self, next: &Self) -> Vec<Write> {
        let mut out = Vec::new();
        out.extend(
            next.ports
                .difference(&self.ports)
                .map(|e| Write::SetPort(*e)),
        );
        out.extend(
            next.cidrs
                .iter()
                .filter(|(key, set)| self.cidrs.get(key) != Some(set))
                .map(|(&(id, prefix), &set)| Write::SetCidr(id, prefix, set)),
        );
        out.extend(
            next.pods
                .iter()
                .filter(|(addr, policy)| self.pods.get(addr) != Some(policy))
                .map(|(&addr, &policy)| Write::SetPod(addr, policy)),
        );
        out.extend(
            self.pods
                .keys()
                .filter(|addr| !next.pods.contains_key(addr))
                .map(|&addr| Write::RemovePod(addr)),
        );
        out.extend(
            self.cidrs
                .keys()
                .filter(|key| !next.cidrs.contains_key(key))
                .map(|&(id, prefix)| Write::RemoveCidr(id, prefix)),
        );
        out.extend(
            self.ports
                .difference(&next.ports)
                .map(|e| Write::RemovePort(*e)),
        );
        out
    }
}

/// Identities and port set ids, kept while their content is in use so a
/// pod whose rules did not change keeps its identity; new content gets ids
/// never handed out before by this numbering.
#[derive(Debug)]
pub struct Numbering {
    identities: BTreeMap<Compiled, u32>,
    port_sets: BTreeMap<PortSet, u32>,
    next: u32,
}

impl Numbering {
    /// Numbers from `first` on (above anything a previous agent left in
    /// pinned maps: the new content is written beside the old).
    #[must_use]
    pub fn starting_at(first: u32) -> Self {
        Self {
            identities: BTreeMap::new(),
            port_sets: BTreeMap::new(),
            next: first.max(1),
        }
    }

    fn take(&mut self) -> u32 {
        let id = self.next;
        self.next = self.next.checked_add(1).expect("2^32 policy identities");
        debug_assert_ne!(id, POLICY_UNISOLATED);
        id
    }

    /// The tables for `pods`; ids of content no pod has any more are
    /// forgotten.
    pub fn tables<'p>(
        &mut self,
        pods: impl IntoIterator<Item = (&'p Ipv4Addr, &'p PodRules)>,
    ) -> Tables {
        let mut building = Building {
            numbering: self,
            compiled: BTreeMap::new(),
            identities: BTreeMap::new(),
            port_sets: BTreeMap::new(),
            tables: Tables::default(),
        };
        for (&addr, rules) in pods {
            let policy = PodPolicy {
                ingress: building.identity(rules.ingress()),
                egress: building.identity(rules.egress()),
            };
            building.tables.pods.insert(addr, policy);
        }
        let Building {
            identities,
            port_sets,
            tables,
            ..
        } = building;
        self.identities = identities;
        self.port_sets = port_sets;
        tables
    }
}

/// One [`Numbering::tables`] under way: the content in use so far.
struct Building<'a, 'n> {
    numbering: &'n mut Numbering,
    /// Each distinct direction compiled once.
    compiled: BTreeMap<Tiers<'a>, Compiled>,
    identities: BTreeMap<Compiled, u32>,
    port_sets: BTreeMap<PortSet, u32>,
    tables: Tables,
}

impl<'a> Building<'a, '_> {
    fn identity(&mut self, tiers: Tiers<'a>) -> u32 {
        if tiers.is_open() {
            return POLICY_UNISOLATED;
        }
        let content = self
            .compiled
            .entry(tiers)
            .or_insert_with(|| compile(&tiers))
            .clone();
        if let Some(&id) = self.identities.get(&content) {
            return id;
        }
        let id = match self.numbering.identities.get(&content) {
            Some(&id) => id,
            None => self.numbering.take(),
        };
        for (prefix, set) in &content {
            let set_id = self.port_set(set);
            self.tables.cidrs.insert((id, *prefix), set_id);
        }
        self.identities.insert(content, id);
        id
    }

    fn port_set(&mut self, set: &PortSet) -> u32 {
        if let Some(&id) = self.port_sets.get(set) {
            return id;
        }
        let id = match self.numbering.port_sets.get(set) {
            Some(&id) => id,
            None => self.numbering.take(),
        };
        self.port_sets.insert(set.clone(), id);
        self.tables.ports.extend(
            set.prefixes()
                .into_iter()
                .map(|(len, proto, port, verdict)| (id, len, proto, port, verdict)),
        );
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::rules::{Direction, Origin, Peers, Ports, Protocol, Rule};

    fn rules(cidr: &str, port: u16) -> PodRules {
        PodRules {
            ingress: Direction::Isolated(vec![Rule {
                peers: vec![Peers {
                    cidr: cidr.parse().unwrap(),
                    except: vec![],
                }],
                ports: vec![Ports::one(Protocol::Tcp, port)],
                origin: Origin::default(),
            }]),
            ..PodRules::default()
        }
    }

    fn pod(last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 20, 11, last)
    }

    #[test]
    fn pods_with_the_same_rules_share_an_identity_and_keep_it() {
        let mut numbering = Numbering::starting_at(1);
        let mut pods = BTreeMap::from([
            (pod(1), rules("10.0.0.0/8", 80)),
            (pod(2), rules("10.0.0.0/8", 80)),
            (pod(3), PodRules::default()),
        ]);
        let first = numbering.tables(&pods);
        assert_eq!(first.pods[&pod(1)], first.pods[&pod(2)]);
        assert_eq!(first.pods[&pod(3)], PodPolicy::default());
        assert_eq!(first.pods[&pod(1)].egress, POLICY_UNISOLATED);
        assert_eq!(first.cidrs.len(), 1);

        pods.insert(pod(2), rules("10.0.0.0/8", 443));
        let second = numbering.tables(&pods);
        assert_eq!(second.pods[&pod(1)], first.pods[&pod(1)], "unchanged");
        assert_ne!(second.pods[&pod(2)], first.pods[&pod(2)]);

        let writes = first.writes_to(&second);
        let set_pod = writes
            .iter()
            .position(|w| matches!(w, Write::SetPod(..)))
            .unwrap();
        assert!(
            writes[..set_pod]
                .iter()
                .all(|w| matches!(w, Write::SetPort(_) | Write::SetCidr(..))),
            "{writes:?}"
        );
        assert!(
            writes[set_pod + 1..]
                .iter()
                .all(|w| !matches!(w, Write::SetPort(_) | Write::SetCidr(..))),
            "{writes:?}"
        );
        assert_eq!(second.writes_to(&second), vec![]);
    }

    #[test]
    fn a_kept_pod_keeps_its_identities_prefixes_and_ports_and_nothing_else() {
        let mut numbering = Numbering::starting_at(1);
        let written = numbering.tables(&BTreeMap::from([
            (pod(1), rules("10.0.0.0/8", 80)),
            (pod(2), rules("192.0.2.0/24", 443)),
        ]));
        let mut kept = Tables::default();
        assert!(kept.keep_pod(&written, pod(1)));
        assert!(!kept.keep_pod(&written, pod(9)), "nothing held for it");
        let only = numbering.tables(&BTreeMap::from([(pod(1), rules("10.0.0.0/8", 80))]));
        assert_eq!(kept.pods, BTreeMap::from([(pod(1), written.pods[&pod(1)])]));
        assert_eq!(kept.cidrs.len(), only.cidrs.len());
        assert_eq!(kept.ports.len(), only.ports.len());
        let id = written.pods[&pod(1)].ingress;
        assert!(kept.cidrs.keys().all(|(identity, _)| *identity == id));
    }

    #[test]
    fn content_no_pod_has_is_removed() {
        let mut numbering = Numbering::starting_at(100);
        let before = numbering.tables(&BTreeMap::from([(pod(1), rules("10.0.0.0/8", 80))]));
        assert!(before.pods[&pod(1)].ingress >= 100);
        let after = numbering.tables(&BTreeMap::new());
        assert_eq!(after, Tables::default());
        let writes = before.writes_to(&after);
        assert!(writes.contains(&Write::RemovePod(pod(1))));
        assert_eq!(
            writes
                .iter()
                .filter(|w| matches!(w, Write::RemoveCidr(..) | Write::RemovePort(_)))
                .count(),
            before.cidrs.len() + before.ports.len()
        );
    }

    #[test]
    fn strict_modes_deny_all_has_an_identity_and_no_prefix() {
        let mut numbering = Numbering::starting_at(1);
        let tables = numbering.tables(&BTreeMap::from([(pod(1), PodRules::deny_all())]));
        let policy = tables.pods[&pod(1)];
        assert_ne!(policy.ingress, POLICY_UNISOLATED);
        assert_eq!(
            policy.ingress, policy.egress,
            "one identity: nothing allowed"
        );
        assert!(tables.cidrs.is_empty());
    }
}
