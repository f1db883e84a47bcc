//! The NAT table seen from user space: listing flows and garbage-collecting
//! the ones that are over, a whole pair at a time.

use vpcnet_common::nat::{FlowKey, FlowKind, FlowState, NatEntry, flow_expired, flow_state};

use super::{DatapathError, DatapathMaps};

/// One flow: its forward entry and, for translated flows, its claim.
#[derive(Clone, Copy, Debug)]
pub struct Flow {
    pub key: FlowKey,
    pub fwd: NatEntry,
    /// The reply tuple and the reverse entry (`None` for un-translated
    /// flows, which have none, or a half being created or removed).
    pub rev: Option<(FlowKey, NatEntry)>,
}

impl Flow {
    pub fn kind(&self) -> Option<FlowKind> {
        FlowKind::from_raw(self.fwd.kind)
    }

    pub fn state(&self) -> FlowState {
        let rev_seen = self.rev.map_or(self.fwd.seen, |(_, rev)| rev.seen);
        flow_state(self.key.proto, self.fwd.seen, rev_seen)
    }

    /// The reply tuple a translated flow's claim is keyed by.
    pub fn reply_key(&self) -> FlowKey {
        FlowKey::new(
            self.key.daddr,
            self.fwd.addr,
            self.key.dport,
            self.fwd.port,
            self.key.proto,
        )
    }

    fn expired(&self, now_ns: u64) -> bool {
        match self.rev {
            Some((_, rev)) => flow_expired(self.key.proto, &self.fwd, &rev, now_ns),
            // Un-translated flows keep both directions in their one entry.
            None => flow_expired(self.key.proto, &self.fwd, &self.fwd, now_ns),
        }
    }
}

/// What one garbage collection did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcStats {
    pub flows: usize,
    pub expired: usize,
    /// Halves found without their other half and removed.
    pub orphans: usize,
}

/// A claim without its forward entry is normal for the instant a CPU takes
/// between the two inserts; older than this, its flow is gone.
const ORPHAN_GRACE_NS: u64 = 10 * vpcnet_common::nat::NS_PER_SEC;

impl DatapathMaps {
    /// Every flow in the table.
    pub fn flows(&self) -> Result<Vec<Flow>, DatapathError> {
        let mut flows = Vec::new();
        for item in &self.nat_fwd {
            let (key, fwd) = item.map_err(DatapathError::map(vpcnet_common::maps::NAT_FWD))?;
            let mut flow = Flow {
                key,
                fwd,
                rev: None,
            };
            if flow.kind() != Some(FlowKind::NoSnat) {
                let reply = flow.reply_key();
                flow.rev = self.nat_rev.get(&reply, 0).ok().map(|rev| (reply, rev));
            }
            flows.push(flow);
        }
        Ok(flows)
    }

    /// Removes the flows that are over, each pair whole. `now_ns` is on the
    /// datapath's clock (`CLOCK_MONOTONIC`).
    pub fn collect_garbage(&mut self, now_ns: u64) -> Result<GcStats, DatapathError> {
        let flows = self.flows()?;
        let mut stats = GcStats {
            flows: flows.len(),
            ..GcStats::default()
        };
        for flow in &flows {
            let translated = flow.kind() != Some(FlowKind::NoSnat);
            let orphan = translated && flow.rev.is_none();
            if !orphan && !flow.expired(now_ns) {
                continue;
            }
            // The forward half first: a packet racing the collection then
            // starts a new flow, whose port choice still sees the old claim.
            let _ = self.nat_fwd.remove(&flow.key);
            // Only the claim of this flow, not one a new flow took since.
            if let Some((reply, rev)) = flow.rev
                && let Ok(current) = self.nat_rev.get(&reply, 0)
                && (current == rev
                    || (current.addr == flow.key.saddr && current.port == flow.key.sport))
            {
                let _ = self.nat_rev.remove(&reply);
            }
            if orphan {
                stats.orphans += 1;
            } else {
                stats.expired += 1;
            }
        }
        // Claims whose forward half never came or is gone.
        let claims: Vec<(FlowKey, NatEntry)> = self.nat_rev.iter().filter_map(Result::ok).collect();
        for (reply, rev) in claims {
            let fwd_key = FlowKey::new(rev.addr, reply.saddr, rev.port, reply.sport, reply.proto);
            let has_forward = self
                .nat_fwd
                .get(&fwd_key, 0)
                .is_ok_and(|fwd| fwd.port == reply.dport && fwd.addr == reply.daddr);
            if !has_forward && now_ns.saturating_sub(rev.created_ns) > ORPHAN_GRACE_NS {
                let _ = self.nat_rev.remove(&reply);
                stats.orphans += 1;
            }
        }
        Ok(stats)
    }
}

/// The datapath's clock.
pub fn monotonic_now_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    u64::try_from(ts.tv_sec()).unwrap_or(0) * 1_000_000_000
        + u64::try_from(ts.tv_nsec()).unwrap_or(0)
}
