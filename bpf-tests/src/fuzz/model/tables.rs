//! Inserting into the flow maps as a full one behaves: a NAT map keeps an
//! entry already there and makes room by early drop, the stack flows map
//! replaces one and makes room the same way; each map's ring of recent
//! flows.

use vpcnet_common::{
    counters::Counter,
    nat::{FlowKey, RecentFlows},
};

use super::{Half, Model, Run};

/// One of the flow maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Map {
    NatFwd,
    NatRev,
    Stack,
}

impl Model {
    /// Inserts `half` under `key` in `map`: a NAT map keeps an entry
    /// already there, the stack flows map replaces it. A full map first
    /// drops the oldest unanswered recent flow, counted in `run`. Whether
    /// the entry is in.
    pub(super) fn insert_making_room(
        &mut self,
        run: &mut Run,
        map: Map,
        key: FlowKey,
        half: Half,
    ) -> bool {
        if !self.has_room(map, &key) {
            let dropped = if map == Map::Stack {
                self.early_drop_stack()
            } else {
                self.early_drop_nat()
            };
            if !dropped {
                return false;
            }
            run.count(if map == Map::Stack {
                Counter::StackFlowEarlyDrop
            } else {
                Counter::NatEarlyDrop
            });
            if !self.has_room(map, &key) {
                return false;
            }
        }
        match map {
            Map::NatFwd => {
                self.tables.nat_fwd.entry(key).or_insert(half);
            }
            Map::NatRev => {
                self.tables.nat_rev.entry(key).or_insert(half);
            }
            Map::Stack => {
                self.tables.stack.insert(key, half);
            }
        }
        true
    }

    /// Whether `key` is in `map` or `map` has room for it.
    fn has_room(&self, map: Map, key: &FlowKey) -> bool {
        let (entries, capacity) = match map {
            Map::NatFwd => (&self.tables.nat_fwd, self.world.nat_capacity),
            Map::NatRev => (&self.tables.nat_rev, self.world.nat_capacity),
            Map::Stack => (&self.tables.stack, self.world.stack_capacity),
        };
        entries.contains_key(key) || entries.len() < capacity
    }

    /// A new flow's key goes into `ring`, over the oldest.
    pub(super) fn remember_recent(ring: &mut RecentFlows, key: FlowKey) {
        ring.keys[RecentFlows::slot(ring.next)] = key;
        ring.next = ring.next.wrapping_add(1);
    }
}
