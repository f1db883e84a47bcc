//! The NAT table seen from user space: listing flows and garbage-collecting
//! the ones that are over, a whole pair at a time.

use vpcnet_common::nat::{
    FlowKey, FlowKind, FlowState, NatEntry, flow_expired, flow_state, forward_key, reply_key,
};

use super::{DatapathError, DatapathMaps};

/// `BPF_NOEXIST`: insert only if absent.
const BPF_NOEXIST: u64 = 1;

fn is_eexist(e: &aya::maps::MapError) -> bool {
    matches!(e, aya::maps::MapError::SyscallError(e) if e.io_error.raw_os_error() == Some(libc::EEXIST))
}

/// The tuple of a node socket's packets whose replies are `reply`.
fn alias_key(reply: &FlowKey) -> FlowKey {
    reply.reversed()
}

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
        reply_key(&self.key, self.fwd.addr, self.fwd.port)
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
    /// Records a flow translated elsewhere (by iptables, before the agent
    /// took the node over) as the datapath's own: `fwd` leaves as
    /// `addr:port`, and its replies find their way back. An existing entry
    /// for either half is left as it is: the datapath knows better.
    /// Returns whether the flow was added.
    pub fn import_translated_flow(
        &mut self,
        fwd: FlowKey,
        addr: u32,
        port: u16,
        (fwd_seen, rev_seen): (u8, u8),
        now_ns: u64,
    ) -> Result<bool, DatapathError> {
        let entry = NatEntry {
            addr,
            port,
            kind: FlowKind::Snat as u8,
            seen: fwd_seen,
            last_seen_ns: now_ns,
            created_ns: now_ns,
        };
        let reply = reply_key(&fwd, addr, port);
        let claim = NatEntry {
            addr: fwd.saddr,
            port: fwd.sport,
            seen: rev_seen,
            ..entry
        };
        // A packet iptables translated, seen by `eni_egress` before the
        // pods were taken over, looked like a node socket's: that claim is
        // this very flow, and gives way to it.
        if let Ok(held) = self.nat_rev.get(&reply, 0) {
            if held.kind != FlowKind::Host as u8 || held.addr != addr {
                return Ok(false);
            }
            let _ = self.nat_fwd.remove(&forward_key(&reply, &held));
            let _ = self.nat_rev.remove(&reply);
        }
        // The claim first, as the datapath does, so the port is never
        // handed to another flow meanwhile.
        match self.nat_rev.insert(reply, claim, BPF_NOEXIST) {
            Ok(()) => {}
            Err(e) if is_eexist(&e) => return Ok(false),
            Err(e) => return Err(DatapathError::map(vpcnet_common::maps::NAT_REV)(e)),
        }
        // Until the pod's programs take the flow, iptables still translates
        // its packets, which `eni_egress` would take for a node socket's
        // whose port is held: an identity entry of the node's lets them
        // pass unchanged ([`DatapathMaps::forget_stack_alias`] removes it).
        let alias = NatEntry {
            kind: FlowKind::Host as u8,
            ..entry
        };
        let _ = self.nat_fwd.insert(alias_key(&reply), alias, BPF_NOEXIST);
        match self.nat_fwd.insert(fwd, entry, BPF_NOEXIST) {
            Ok(()) => Ok(true),
            Err(e) => {
                let _ = self.nat_rev.remove(&reply);
                if is_eexist(&e) {
                    Ok(false)
                } else {
                    Err(DatapathError::map(vpcnet_common::maps::NAT_FWD)(e))
                }
            }
        }
    }

    /// Removes the identity entry [`DatapathMaps::import_translated_flow`]
    /// gave the packets iptables translated, once the pod's programs carry
    /// the flow.
    pub fn forget_stack_alias(&mut self, fwd: FlowKey, addr: u32, port: u16) {
        let key = alias_key(&reply_key(&fwd, addr, port));
        if self
            .nat_fwd
            .get(&key, 0)
            .is_ok_and(|held| held.kind == FlowKind::Host as u8 && held.port == port)
        {
            let _ = self.nat_fwd.remove(&key);
        }
    }

    /// Forgets that the pod flow `fwd` went through the stack, in either
    /// direction: a flow iptables carried until the pod was adopted is
    /// remembered by `pod_ingress` as one of the stack's, and would stay
    /// on the stack's path, where conntrack's view of it is out of date.
    pub fn forget_stack_flow(&mut self, fwd: FlowKey) {
        let _ = self.stack_flows.remove(&fwd);
        let _ = self.stack_flows.remove(&fwd.reversed());
    }

    /// Marks `key` (the tuple of packets the stack must see) as a flow of
    /// the stack's, as the programs do for kube-proxy's flows.
    pub fn import_stack_flow(&mut self, key: FlowKey, now_ns: u64) -> Result<(), DatapathError> {
        self.stack_flows
            .insert(key, now_ns, 0)
            .map_err(DatapathError::map(vpcnet_common::maps::STACK_FLOWS))
    }

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
            let fwd_key = forward_key(&reply, &rev);
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
