//! The NAT table and the stack flows seen from user space: listing flows
//! and garbage-collecting the ones that are over, a whole pair at a time.

use foldhash::{HashMap, HashMapExt as _};
use vpcnet_common::nat::{
    FlowKey, FlowKind, FlowState, NatEntry, Timeouts, flow_expired, flow_last_seen_ns,
    flow_timeout_ns, forward_key, pair_state, reply_key,
};

use super::{
    DatapathError, DatapathMaps,
    batch::{self, BPF_NOEXIST},
};

fn is_eexist(e: &aya::maps::MapError) -> bool {
    matches!(e, aya::maps::MapError::SyscallError(e) if e.io_error.raw_os_error() == Some(libc::EEXIST))
}

/// The tuple of a node socket's packets whose replies are `reply`.
fn alias_key(reply: &FlowKey) -> FlowKey {
    reply.reversed()
}

/// One flow: its forward entry and its reverse entry (the claim of a
/// translated flow).
#[derive(Clone, Copy, Debug)]
pub struct Flow {
    pub key: FlowKey,
    pub fwd: NatEntry,
    /// The reply tuple and the reverse entry (`None` for a half being
    /// created or removed, or an untranslated flow an earlier version kept
    /// as a single entry).
    pub rev: Option<(FlowKey, NatEntry)>,
}

impl Flow {
    /// The flow whose forward entry is `fwd` (keyed `key`), with its
    /// reverse entry as the table has it now.
    pub fn read(maps: &DatapathMaps, key: FlowKey, fwd: NatEntry) -> Self {
        let mut flow = Self {
            key,
            fwd,
            rev: None,
        };
        let reply = flow.reply_key();
        flow.rev = maps.nat_rev.get(&reply, 0).ok().map(|rev| (reply, rev));
        flow
    }

    pub fn kind(&self) -> Option<FlowKind> {
        FlowKind::from_raw(self.fwd.kind)
    }

    /// Whether the flow keeps its addresses (no port claimed).
    pub fn untranslated(&self) -> bool {
        FlowKind::untranslated(self.fwd.kind)
    }

    /// The reverse entry, or the forward one for a single entry, which is
    /// then judged alone.
    fn rev_or_fwd(&self) -> NatEntry {
        self.rev.map_or(self.fwd, |(_, rev)| rev)
    }

    /// The flow's state.
    pub fn state(&self) -> FlowState {
        pair_state(self.key.proto, &self.fwd, &self.rev_or_fwd())
    }

    /// The reply tuple the reverse entry is keyed by (for an untranslated
    /// flow, the reverse of its own).
    pub fn reply_key(&self) -> FlowKey {
        reply_key(&self.key, self.fwd.addr, self.fwd.port)
    }

    /// When either direction last saw a packet.
    pub fn last_seen_ns(&self) -> u64 {
        flow_last_seen_ns(&self.fwd, &self.rev_or_fwd())
    }

    /// How long the flow lives after its last packet.
    pub fn timeout_ns(&self, timeouts: &Timeouts) -> u64 {
        flow_timeout_ns(self.key.proto, &self.fwd, &self.rev_or_fwd(), timeouts)
    }

    fn expired(&self, timeouts: &Timeouts, now_ns: u64) -> bool {
        flow_expired(
            self.key.proto,
            &self.fwd,
            &self.rev_or_fwd(),
            timeouts,
            now_ns,
        )
    }
}

/// What one garbage collection did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcStats {
    pub flows: usize,
    pub expired: usize,
    /// Halves found without their other half and removed.
    pub orphans: usize,
    /// Untranslated flows an earlier version kept as one entry, given
    /// their reverse entry.
    pub paired: usize,
}

/// A claim without its forward entry is normal for the instant a CPU takes
/// between the two inserts; older than this, its flow is gone.
pub const ORPHAN_GRACE_NS: u64 = 10 * vpcnet_common::nat::NS_PER_SEC;

impl DatapathMaps {
    /// Records a flow translated elsewhere (by iptables, before the agent
    /// took the node over) as the datapath's own: `fwd` leaves as
    /// `addr:port`, its replies find their way back, and it is in `state`
    /// as conntrack had it. An existing entry
    /// for either half is left as it is: the datapath knows better.
    /// Returns whether the flow was added.
    pub fn import_translated_flow(
        &mut self,
        fwd: FlowKey,
        addr: u32,
        port: u16,
        state: FlowState,
        now_ns: u64,
    ) -> Result<bool, DatapathError> {
        let (opener, answer) = state.halves(fwd.proto);
        let entry = NatEntry {
            addr,
            port,
            kind: FlowKind::Snat as u8,
            seen: opener.seen,
            tcp: opener.tcp,
            last_seen_ns: now_ns,
            created_ns: now_ns,
            ..NatEntry::default()
        };
        let reply = reply_key(&fwd, addr, port);
        let claim = NatEntry {
            addr: fwd.saddr,
            port: fwd.sport,
            seen: answer.seen,
            tcp: answer.tcp,
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

    /// Whether the datapath carries `fwd` as the flow translated to
    /// `addr:port` (both halves): one [`DatapathMaps::import_translated_flow`]
    /// added, here or in an earlier start.
    pub fn carries_translated_flow(&self, fwd: FlowKey, addr: u32, port: u16) -> bool {
        let snat = FlowKind::Snat as u8;
        let forward = self
            .nat_fwd
            .get(&fwd, 0)
            .is_ok_and(|held| held.kind == snat && held.addr == addr && held.port == port);
        forward
            && self
                .nat_rev
                .get(&reply_key(&fwd, addr, port), 0)
                .is_ok_and(|claim| {
                    claim.kind == snat && claim.addr == fwd.saddr && claim.port == fwd.sport
                })
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

    /// Remembers the established connection whose pod-side tuple is
    /// `pod_tuple` as a flow of the stack's (kube-proxy DNATs it), as the
    /// programs do for the flows they see start. An entry of either tuple
    /// already there is replaced.
    pub fn import_stack_flow(
        &mut self,
        pod_tuple: FlowKey,
        now_ns: u64,
    ) -> Result<(), DatapathError> {
        let half = NatEntry {
            addr: pod_tuple.saddr,
            port: pod_tuple.sport,
            kind: FlowKind::StackToPod as u8,
            seen: FlowState::Established.halves(pod_tuple.proto).0.seen,
            last_seen_ns: now_ns,
            created_ns: now_ns,
            ..NatEntry::default()
        };
        for key in [pod_tuple.reversed(), pod_tuple] {
            self.stack_flows
                .insert(key, half, 0)
                .map_err(DatapathError::map(vpcnet_common::maps::STACK_FLOWS))?;
        }
        Ok(())
    }

    /// Removes the stack flows that are over by `timeouts`, each pair whole,
    /// and halves left alone past [`ORPHAN_GRACE_NS`]. The map is read in
    /// batches; a half a packet touched since it was read stays (see
    /// [`batch::remove_if_unchanged`]), and so does its pair.
    pub fn collect_stack_flows(
        &self,
        timeouts: &Timeouts,
        now_ns: u64,
    ) -> Result<GcStats, DatapathError> {
        let map_error = || DatapathError::map(vpcnet_common::maps::STACK_FLOWS);
        let halves: HashMap<FlowKey, NatEntry> = batch::read_all(&self.stack_flows)
            .map_err(map_error())?
            .into_iter()
            .collect();
        let mut stats = GcStats::default();
        for (key, half) in &halves {
            let other_key = key.reversed();
            if other_key == *key {
                // A tuple that is its own reverse (a pod's ICMP to itself
                // through a service): its one entry is the whole pair.
                stats.flows += 1;
                if flow_expired(key.proto, half, half, timeouts, now_ns)
                    && batch::remove_if_unchanged(&self.stack_flows, key, half)
                        .map_err(map_error())?
                {
                    stats.expired += 1;
                }
                continue;
            }
            let other = halves.get(&other_key);
            let pod_side = key.saddr == half.addr && key.sport == half.port;
            let gone = match other {
                None => now_ns.saturating_sub(half.created_ns) > ORPHAN_GRACE_NS,
                // Each pair once, from its pod's side.
                Some(_) if !pod_side => continue,
                Some(other) => {
                    stats.flows += 1;
                    flow_expired(key.proto, half, other, timeouts, now_ns)
                }
            };
            if !gone
                || !batch::remove_if_unchanged(&self.stack_flows, key, half).map_err(map_error())?
            {
                continue;
            }
            let Some(other) = other else {
                stats.orphans += 1;
                continue;
            };
            if batch::remove_if_unchanged(&self.stack_flows, &other_key, other)
                .map_err(map_error())?
            {
                stats.expired += 1;
            } else {
                // The other direction saw a packet since: the flow lives.
                batch::put_if_absent(&self.stack_flows, key, half).map_err(map_error())?;
            }
        }
        Ok(stats)
    }

    /// Every flow in the table, read in batches (forward entries first: a
    /// flow is made claim first, so none read is missing its claim for
    /// having been made meanwhile).
    pub fn flows(&self) -> Result<Vec<Flow>, DatapathError> {
        Ok(self.read_table()?.0)
    }

    /// The flows, and the claims without a forward entry.
    fn read_table(&self) -> Result<(Vec<Flow>, Claims), DatapathError> {
        let forward = batch::read_all(&self.nat_fwd)
            .map_err(DatapathError::map(vpcnet_common::maps::NAT_FWD))?;
        let mut claims: HashMap<FlowKey, NatEntry> = batch::read_all(&self.nat_rev)
            .map_err(DatapathError::map(vpcnet_common::maps::NAT_REV))?
            .into_iter()
            .collect();
        // Each claim taken by its flow: what is left has no forward entry.
        let flows = forward
            .into_iter()
            .map(|(key, fwd)| {
                let mut flow = Flow {
                    key,
                    fwd,
                    rev: None,
                };
                let reply = flow.reply_key();
                flow.rev = claims.remove(&reply).map(|rev| (reply, rev));
                flow
            })
            .collect();
        Ok((flows, claims.into_iter().collect()))
    }

    /// Judges the table at `now_ns` by `timeouts`: what a collection would
    /// remove, as read now. Reads only.
    pub fn judge_garbage(
        &self,
        timeouts: &Timeouts,
        now_ns: u64,
    ) -> Result<Judgement, DatapathError> {
        let (flows, claims) = self.read_table()?;
        let mut judgement = Judgement {
            stats: GcStats {
                flows: flows.len(),
                ..GcStats::default()
            },
            ..Judgement::default()
        };
        for flow in flows {
            if flow.untranslated() && flow.rev.is_none() {
                // Not an orphan: an earlier version's single entry, or one
                // whose pair the datapath is making or dropping right now.
                judgement.singles.push(flow);
            } else if flow.rev.is_none() || flow.expired(timeouts, now_ns) {
                judgement.flows.push(flow);
            }
        }
        // Claims whose forward half never came or is gone.
        judgement.claims = claims
            .into_iter()
            .filter(|(_, rev)| now_ns.saturating_sub(rev.created_ns) > ORPHAN_GRACE_NS)
            .collect();
        Ok(judgement)
    }

    /// Removes what `judgement` found over, each entry only if it is still
    /// as judged: a flow a packet refreshed since lives on, and a new flow
    /// that took a judged flow's tuple or port keeps its entries.
    ///
    /// A packet in the instant between a removal and its putting back
    /// finds no flow and starts a new one: that packet came after the
    /// flow was idle past its whole timeout (see
    /// `vpcnet_common::nat::idle_past`), which conntrack too takes for a
    /// new connection. A flow whose packets come within its timeout is
    /// never judged, so never in that instant
    /// (`bpf-tests/tests/gc.rs`: `a_flow_alive_within_its_timeout_...`).
    pub fn collect_judged(&self, judgement: &Judgement) -> Result<GcStats, DatapathError> {
        let fwd_error = || DatapathError::map(vpcnet_common::maps::NAT_FWD);
        let rev_error = || DatapathError::map(vpcnet_common::maps::NAT_REV);
        let mut stats = judgement.stats;
        for flow in &judgement.singles {
            if batch::put_if_absent(&self.nat_rev, &flow.reply_key(), &flow.fwd)
                .map_err(rev_error())?
            {
                stats.paired += 1;
            }
        }
        for flow in &judgement.flows {
            // The forward half first: a packet racing the collection then
            // starts a new flow, whose port choice still sees the old claim.
            if !batch::remove_if_unchanged(&self.nat_fwd, &flow.key, &flow.fwd)
                .map_err(fwd_error())?
            {
                continue;
            }
            let Some((reply, rev)) = flow.rev else {
                stats.orphans += 1;
                continue;
            };
            if batch::remove_if_unchanged(&self.nat_rev, &reply, &rev).map_err(rev_error())? {
                stats.expired += 1;
                continue;
            }
            // The claim changed since: a reply refreshed it (the flow
            // lives: its forward half goes back), or a new flow holds the
            // port now (the judged flow is gone for good).
            let still_this_flow = batch::get(&self.nat_rev, &reply)
                .map_err(rev_error())?
                .is_some_and(|now| {
                    flow.untranslated()
                        || (now.addr == flow.key.saddr && now.port == flow.key.sport)
                });
            if still_this_flow {
                batch::put_if_absent(&self.nat_fwd, &flow.key, &flow.fwd).map_err(fwd_error())?;
            }
        }
        for (reply, rev) in &judgement.claims {
            if batch::remove_if_unchanged(&self.nat_rev, reply, rev).map_err(rev_error())? {
                stats.orphans += 1;
            }
        }
        Ok(stats)
    }

    /// Removes the flows that are over by `timeouts`, each pair whole:
    /// [`DatapathMaps::judge_garbage`], then
    /// [`DatapathMaps::collect_judged`]. `now_ns` is on the datapath's
    /// clock (`CLOCK_MONOTONIC`).
    pub fn collect_garbage(
        &self,
        timeouts: &Timeouts,
        now_ns: u64,
    ) -> Result<GcStats, DatapathError> {
        let judgement = self.judge_garbage(timeouts, now_ns)?;
        self.collect_judged(&judgement)
    }
}

/// How many remote endpoints [`NatPressure::busiest`] lists.
pub const BUSIEST_ENDPOINTS: usize = 10;

/// How full the flow maps are, and the remote endpoints whose flows hold
/// the most of the node address's ports: a SNAT port is unique per remote
/// address, port and protocol, so the port range runs out one remote
/// endpoint at a time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatPressure {
    pub nat_fwd: MapFill,
    pub nat_rev: MapFill,
    pub stack_flows: MapFill,
    /// The busiest first, at most [`BUSIEST_ENDPOINTS`].
    pub busiest: Vec<EndpointPorts>,
}

/// A map's entries and the most it holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MapFill {
    pub entries: usize,
    pub capacity: u32,
}

/// A remote endpoint and how many of the node address's ports its flows
/// hold (pods' SNAT flows and the node's own sockets).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EndpointPorts {
    pub proto: u8,
    /// Network order, as in the maps.
    pub addr: u32,
    pub port: u16,
    pub ports: usize,
}

impl DatapathMaps {
    /// The maps' fill and the busiest remote endpoints, read in batches.
    pub fn nat_pressure(&self) -> Result<NatPressure, DatapathError> {
        use aya::maps::IterableMap as _;
        use vpcnet_common::maps::{NAT_FWD, NAT_REV, STACK_FLOWS};
        let fill = |entries: usize, info: Result<aya::maps::MapInfo, _>, name| {
            Ok::<_, DatapathError>(MapFill {
                entries,
                capacity: info.map_err(DatapathError::map(name))?.max_entries(),
            })
        };
        let claims = batch::read_all(&self.nat_rev).map_err(DatapathError::map(NAT_REV))?;
        let forward = batch::read_all(&self.nat_fwd).map_err(DatapathError::map(NAT_FWD))?;
        let stack = batch::read_all(&self.stack_flows).map_err(DatapathError::map(STACK_FLOWS))?;
        let mut by_endpoint: HashMap<(u8, u32, u16), usize> = HashMap::new();
        for (reply, claim) in &claims {
            if !FlowKind::untranslated(claim.kind) {
                *by_endpoint
                    .entry((reply.proto, reply.saddr, reply.sport))
                    .or_default() += 1;
            }
        }
        let mut busiest: Vec<EndpointPorts> = by_endpoint
            .into_iter()
            .map(|((proto, addr, port), ports)| EndpointPorts {
                proto,
                addr,
                port,
                ports,
            })
            .collect();
        busiest.sort_by_key(|e| (std::cmp::Reverse(e.ports), e.proto, e.addr, e.port));
        busiest.truncate(BUSIEST_ENDPOINTS);
        Ok(NatPressure {
            nat_fwd: fill(forward.len(), self.nat_fwd.map().info(), NAT_FWD)?,
            nat_rev: fill(claims.len(), self.nat_rev.map().info(), NAT_REV)?,
            stack_flows: fill(stack.len(), self.stack_flows.map().info(), STACK_FLOWS)?,
            busiest,
        })
    }
}

/// The garbage collector's work since the agent started, as its metrics
/// show it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CollectorReport {
    pub passes: u64,
    /// How long the last pass took.
    pub last_pass: std::time::Duration,
    /// Flows removed, NAT and stack flows together: over by their
    /// timeouts, and halves left alone.
    pub expired: u64,
    pub orphans: u64,
}

impl CollectorReport {
    /// Counts one pass.
    pub fn record(&mut self, passes: [&GcStats; 2], took: std::time::Duration) {
        self.passes += 1;
        self.last_pass = took;
        for stats in passes {
            self.expired += u64::try_from(stats.expired).unwrap_or(u64::MAX);
            self.orphans += u64::try_from(stats.orphans).unwrap_or(u64::MAX);
        }
    }
}

/// Claims (reverse entries) by their reply tuple.
type Claims = Vec<(FlowKey, NatEntry)>;

/// What one collection judged over, as it read the table.
#[derive(Debug, Default)]
pub struct Judgement {
    /// Flows to remove whole: over by their timeouts, or forward halves
    /// without their claim.
    flows: Vec<Flow>,
    /// Claims without a forward half, past the grace period.
    claims: Claims,
    /// Untranslated flows an earlier version kept as a single entry: they
    /// get their reverse entry.
    singles: Vec<Flow>,
    stats: GcStats,
}

impl Judgement {
    /// How many flows it judged over (orphan halves included).
    pub fn over(&self) -> usize {
        self.flows.len() + self.claims.len()
    }
}

/// The datapath's clock.
pub fn monotonic_now_ns() -> u64 {
    let ts = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    u64::try_from(ts.tv_sec()).unwrap_or(0) * 1_000_000_000
        + u64::try_from(ts.tv_nsec()).unwrap_or(0)
}
