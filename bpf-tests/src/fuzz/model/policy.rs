//! Network policy, judged from the rules' own form (prefixes less their
//! exceptions, port ranges per protocol, cluster rules with their tiers,
//! priorities and actions), never from the tries the agent compiles them
//! into: the sender's egress rules and the receiver's ingress rules for a
//! connection's first packet, and the connections let through, each known
//! by its two ends whichever way a packet goes.

use std::{fmt, net::Ipv4Addr};

use vpcnet_agent::policy::rules::{Action, ClusterRule, Direction, PodRules, Ports, Tier};
use vpcnet_common::{
    cidr::CidrKind,
    counters::Counter,
    nat::{FlowKey, PROTO_ICMP, PROTO_TCP},
    raw_to_addr, raw_to_port,
};

use super::{
    Frag, IP, Model, Run, Stamp,
    headers::{ip_at, is_icmp_error, l4_at, quoted},
};

const PROTO_SCTP: u8 = 132;

/// One end of a connection: address and port (ICMP: the echo identifier,
/// or zero), network order.
pub type End = (u32, u16);

/// What is known of a connection policy let through: the end that opened
/// it, and when its entry was last refreshed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyTrack {
    pub opener: End,
    pub last: Stamp,
}

/// A connection policy let through: its two ends, the lower first, and its
/// protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Connection {
    pub ends: [End; 2],
    pub proto: u8,
}

impl Connection {
    /// The connection a packet with tuple `key` belongs to, either way.
    pub fn of(key: &FlowKey) -> Self {
        let (a, b) = ((key.saddr, key.sport), (key.daddr, key.dport));
        Self {
            ends: if a <= b { [a, b] } else { [b, a] },
            proto: key.proto,
        }
    }
}

impl fmt::Display for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b] = self.ends;
        write!(f, "{} <> {}/{}", show_end(a), show_end(b), self.proto)
    }
}

/// An end as `address:port`, the port in host order.
pub fn show_end((addr, port): End) -> String {
    format!("{}:{}", host(addr), raw_to_port(port))
}

fn host(addr: u32) -> Ipv4Addr {
    Ipv4Addr::from(raw_to_addr(addr))
}

/// Whether `ports` (none: all) hold `proto`'s `port` (host order).
fn ports_in(ports: &[Ports], proto: u8, port: u16) -> bool {
    ports.is_empty()
        || ports
            .iter()
            .any(|p| p.protocol.number() == proto && (p.first..=p.last).contains(&port))
}

/// Whether one direction's NetworkPolicy rules let `peer` be the other end
/// on `proto`'s `port` (network order).
fn allows(direction: &Direction, peer: u32, proto: u8, port: u16) -> bool {
    let Direction::Isolated(rules) = direction else {
        return true;
    };
    let (peer, port) = (host(peer), raw_to_port(port));
    rules.iter().any(|rule| {
        let peer_in = rule
            .peers
            .iter()
            .any(|p| p.cidr.contains(&peer) && !p.except.iter().any(|e| e.contains(&peer)));
        peer_in && ports_in(&rule.ports, proto, port)
    })
}

/// What `tier`'s rules among `cluster` say of `peer` on `proto`'s `port`
/// (network order): the lowest priority's, Deny before Accept before
/// Pass; `None` for Pass or no rule.
fn tier_says(cluster: &[ClusterRule], tier: Tier, peer: u32, proto: u8, port: u16) -> Option<bool> {
    let (peer, port) = (host(peer), raw_to_port(port));
    let rank = |action: Action| match action {
        Action::Deny => 0,
        Action::Accept => 1,
        Action::Pass => 2,
    };
    cluster
        .iter()
        .filter(|r| {
            r.tier == tier
                && r.peers.iter().any(|n| n.contains(&peer))
                && ports_in(&r.ports, proto, port)
        })
        .min_by_key(|r| (r.priority, rank(r.action)))
        .and_then(|r| match r.action {
            Action::Accept => Some(true),
            Action::Deny => Some(false),
            Action::Pass => None,
        })
}

/// One side's verdict: Admin; then NetworkPolicy, final for a pod a
/// NetworkPolicy selects (or where its rules allow); then Baseline; then
/// the default (an open direction allows, strict mode's does not).
fn side(rules: &PodRules, egress: bool, peer: u32, proto: u8, port: u16) -> bool {
    let (cluster, direction) = if egress {
        (&rules.cluster_egress, &rules.egress)
    } else {
        (&rules.cluster_ingress, &rules.ingress)
    };
    if let Some(verdict) = tier_says(cluster, Tier::Admin, peer, proto, port) {
        return verdict;
    }
    let by_policy = allows(direction, peer, proto, port);
    if rules.selected || (by_policy && matches!(direction, Direction::Isolated(_))) {
        return by_policy;
    }
    tier_says(cluster, Tier::Baseline, peer, proto, port).unwrap_or(*direction == Direction::Open)
}

impl Model {
    fn policy_on(&self) -> bool {
        self.world.config.network_policy()
    }

    /// Judges the packet now in `run` (after any rewrite) by the rules of
    /// whichever of its ends is a local pod with rules. `Err`: the drop
    /// reason.
    pub(super) fn admit(&mut self, run: &mut Run) -> Result<(), Counter> {
        if !self.policy_on() || !Self::ipv4(&run.p) {
            return Ok(());
        }
        let ip = ip_at(&run.p, IP)?;
        if ip.frag == Frag::Later {
            return Ok(());
        }
        let (sport, dport, syn, icmp_type) = match l4_at(&run.p, &ip)? {
            Some(l4) => (
                l4.sport,
                l4.dport,
                ip.proto == PROTO_TCP && l4.syn_only(),
                l4.icmp_type,
            ),
            None if ip.proto == PROTO_SCTP => {
                let ports = run.p.get(ip.l4..ip.l4 + 4).ok_or(Counter::DropTruncated)?;
                (
                    u16::from_ne_bytes([ports[0], ports[1]]),
                    u16::from_ne_bytes([ports[2], ports[3]]),
                    false,
                    0,
                )
            }
            None => (0, 0, false, 0),
        };
        // An error about a connection let through belongs to it.
        if ip.proto == PROTO_ICMP
            && is_icmp_error(icmp_type)
            && quoted(&run.p, &ip).is_some_and(|(_, about)| self.fresh(&Connection::of(&about)))
        {
            return Ok(());
        }
        let key = FlowKey::new(ip.saddr, ip.daddr, sport, dport, ip.proto);
        let pods = &self.world.policy;
        let (sender, receiver) = (pods.get(&key.saddr), pods.get(&key.daddr));
        if sender.is_none() && receiver.is_none() {
            return Ok(());
        }
        let connection = Connection::of(&key);
        let now = self.now;
        if !syn && self.fresh(&connection) {
            // Refreshed at most once a second.
            if let Some(track) = self.tables.policy_flows.get_mut(&connection)
                && now.seconds_since(track.last) >= 1
            {
                track.last = now;
            }
            return Ok(());
        }
        let opener = match self.judge(&key, sender, receiver) {
            Ok(()) => {
                run.count(Counter::PolicyFlowNew);
                (key.saddr, key.sport)
            }
            // A TCP connection already under way is let through when its
            // other end may open it.
            Err(reason) if key.proto == PROTO_TCP && !syn => {
                if self.judge(&key.reversed(), receiver, sender).is_err() {
                    return Err(reason);
                }
                run.count(Counter::PolicyFlowPickedUp);
                (key.daddr, key.dport)
            }
            Err(reason) => return Err(reason),
        };
        self.tables
            .policy_flows
            .insert(connection, PolicyTrack { opener, last: now });
        Ok(())
    }

    /// Whether `connection` is tracked and has not been idle as long as an
    /// established connection of its protocol lives.
    fn fresh(&self, connection: &Connection) -> bool {
        self.tables
            .policy_flows
            .get(connection)
            .is_some_and(|track| {
                self.now.seconds_since(track.last) < self.established_timeout(connection.proto)
            })
    }

    /// `key` as a connection's first packet from `sender`'s pod to
    /// `receiver`'s.
    fn judge(
        &self,
        key: &FlowKey,
        sender: Option<&PodRules>,
        receiver: Option<&PodRules>,
    ) -> Result<(), Counter> {
        if sender.is_some_and(|rules| !side(rules, true, key.daddr, key.proto, key.dport)) {
            return Err(Counter::DropPolicyEgress);
        }
        // The node's own addresses always reach its pods.
        let from_node = self.world.prefix_kind(key.saddr) == Some(CidrKind::Local);
        if !from_node
            && receiver.is_some_and(|rules| !side(rules, false, key.saddr, key.proto, key.dport))
        {
            return Err(Counter::DropPolicyIngress);
        }
        Ok(())
    }
}
