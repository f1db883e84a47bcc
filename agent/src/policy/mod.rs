//! Network policy on the node: each local pod's rules in one form
//! ([`rules`]), compiled into the datapath's tries ([`compile`],
//! [`tables`]) and written into its maps ([`maps`]); connections a change
//! newly denies are marked so, and their packets dropped.

pub mod cluster_endpoints;
pub mod cluster_policies;
pub mod compile;
pub mod endpoints;
pub mod events;
pub mod fields;
pub mod maps;
pub mod metrics;
pub mod network_policies;
pub mod node;
pub mod rules;
pub mod settings;
pub mod tables;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use vpcnet_common::{
    nat::FlowKey,
    policy::{FLOW_REVOKED, OPENED_BY_KEY_DESTINATION, PolicyFlow},
    raw_to_addr, raw_to_port,
};

use self::{
    rules::PodRules,
    tables::{Numbering, Tables},
};
use crate::datapath::{DatapathError, DatapathMaps};

/// The rules of every local pod under policy, and what the maps hold.
#[derive(Debug)]
pub struct Enforcer {
    pods: BTreeMap<Ipv4Addr, PodRules>,
    /// Pods whose rules are not known (the policies not listed yet): they
    /// keep what the maps hold for them.
    held: BTreeSet<Ipv4Addr>,
    numbering: Numbering,
    written: Tables,
    /// The node's own addresses: they always reach its pods.
    node_addrs: BTreeSet<Ipv4Addr>,
}

impl Enforcer {
    /// Takes over what the maps hold (a previous agent's identities stay
    /// until the first [`Enforcer::sync`] has written their successors).
    pub fn new(maps: &DatapathMaps) -> Result<Self, DatapathError> {
        let written = maps::read(maps)?;
        let highest = written
            .cidrs
            .keys()
            .map(|(id, _)| *id)
            .chain(written.cidrs.values().copied())
            .chain(written.ports.iter().map(|(set, ..)| *set))
            .chain(written.pods.values().flat_map(|p| [p.ingress, p.egress]))
            .max()
            .unwrap_or(0);
        Ok(Self {
            pods: BTreeMap::new(),
            held: BTreeSet::new(),
            numbering: Numbering::starting_at(highest.saturating_add(1)),
            written,
            node_addrs: BTreeSet::new(),
        })
    }

    /// The node's own addresses (the datapath reads them from its CIDR
    /// trie's node-local prefixes).
    pub fn set_node_addresses(&mut self, addrs: impl IntoIterator<Item = Ipv4Addr>) {
        self.node_addrs = addrs.into_iter().collect();
    }

    /// Sets the rules of the local pod at `addr` (written at the next sync).
    pub fn set_pod(&mut self, addr: Ipv4Addr, rules: PodRules) {
        self.pods.insert(addr, rules);
    }

    /// Sets the rules of every local pod, the pods not named gone (written
    /// at the next sync). A pod in `held` keeps what the maps hold for it,
    /// if they hold anything, and `pods`' rules for it otherwise.
    pub fn set_pods(&mut self, pods: BTreeMap<Ipv4Addr, PodRules>, held: BTreeSet<Ipv4Addr>) {
        self.pods = pods;
        self.held = held;
    }

    /// How many pods keep what the maps held for them (since the last
    /// sync).
    #[must_use]
    pub fn held_pods(&self) -> usize {
        self.held.len()
    }

    /// The rules of the pod at `addr`; `None` for a held one.
    #[must_use]
    pub fn pod(&self, addr: Ipv4Addr) -> Option<&PodRules> {
        if self.held.contains(&addr) {
            return None;
        }
        self.pods.get(&addr)
    }

    /// Makes the maps hold the pods' rules, then revokes the tracked
    /// connections they no longer allow (and restores the revoked ones they
    /// allow again). Returns how many were revoked.
    pub fn sync(&mut self, maps: &mut DatapathMaps) -> Result<usize, DatapathError> {
        let mut kept = Tables::default();
        self.held.retain(|addr| kept.keep_pod(&self.written, *addr));
        let held = &self.held;
        let mut next = self
            .numbering
            .tables(self.pods.iter().filter(|(addr, _)| !held.contains(addr)));
        next.pods.extend(kept.pods);
        next.cidrs.extend(kept.cidrs);
        next.ports.extend(kept.ports);
        let writes = self.written.writes_to(&next);
        if writes.is_empty() {
            return Ok(0);
        }
        maps::apply(maps, &writes)?;
        self.written = next;
        let mut revoked = 0;
        for (key, flow) in maps::flows(maps)? {
            let allowed = self.allows(&key, &flow);
            if allowed == (flow.revoked == FLOW_REVOKED) {
                maps::set_flow_revoked(maps, &key, &flow, !allowed)?;
                revoked += usize::from(!allowed);
            }
        }
        Ok(revoked)
    }

    /// Whether the tracked connection `key` would be let through now, as
    /// opened by the end its entry names.
    fn allows(&self, key: &FlowKey, flow: &PolicyFlow) -> bool {
        let opened = if flow.opener == OPENED_BY_KEY_DESTINATION {
            key.reversed()
        } else {
            *key
        };
        let from = Ipv4Addr::from(raw_to_addr(opened.saddr));
        let to = Ipv4Addr::from(raw_to_addr(opened.daddr));
        // A held pod's rules are not known: its connections stay as they
        // are.
        if self.held.contains(&from) || self.held.contains(&to) {
            return flow.revoked != FLOW_REVOKED;
        }
        let port = raw_to_port(opened.dport);
        let egress = self
            .pods
            .get(&from)
            .is_none_or(|r| r.egress().allows(to, opened.proto, port));
        // The node's own addresses always reach its pods, as in the
        // datapath.
        let ingress = self.node_addrs.contains(&from)
            || self
                .pods
                .get(&to)
                .is_none_or(|r| r.ingress().allows(from, opened.proto, port));
        egress && ingress
    }
}
