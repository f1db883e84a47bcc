//! The one form every source of network policy lands in (PolicyEndpoints,
//! NetworkPolicy resolved by the agent, ClusterPolicyEndpoints): for one
//! direction of one pod, the NetworkPolicy rules that allow peers, each a
//! set of prefixes with exceptions and the ports they may use, and the
//! cluster policies' rules around them (tiers Admin and Baseline, each rule
//! with a priority and an action). The datapath's maps are written from
//! this form.

use std::{fmt, net::Ipv4Addr};

use ipnet::Ipv4Net;
use vpcnet_api::cluster_policy;

/// The protocols NetworkPolicy names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// The IP protocol number.
    #[must_use]
    pub const fn number(self) -> u8 {
        match self {
            Self::Tcp => 6,
            Self::Udp => 17,
            Self::Sctp => 132,
        }
    }

    /// As NetworkPolicy and PolicyEndpoint spell it (`TCP`, `UDP`, `SCTP`).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "TCP" => Some(Self::Tcp),
            "UDP" => Some(Self::Udp),
            "SCTP" => Some(Self::Sctp),
            _ => None,
        }
    }

    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Tcp => "TCP",
            Self::Udp => "UDP",
            Self::Sctp => "SCTP",
        }
    }
}

/// Ports of one protocol a rule allows: an inclusive range (a single port
/// is a range of one; every port is `0..=65535`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ports {
    pub protocol: Protocol,
    pub first: u16,
    pub last: u16,
}

impl Ports {
    #[must_use]
    pub const fn all(protocol: Protocol) -> Self {
        Self {
            protocol,
            first: 0,
            last: u16::MAX,
        }
    }

    #[must_use]
    pub const fn one(protocol: Protocol, port: u16) -> Self {
        Self {
            protocol,
            first: port,
            last: port,
        }
    }

    #[must_use]
    pub const fn contains(&self, protocol: Protocol, port: u16) -> bool {
        self.protocol as u8 == protocol as u8 && self.first <= port && port <= self.last
    }
}

impl fmt::Display for Ports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.first, self.last) {
            (0, u16::MAX) => write!(f, "{}", self.protocol.name()),
            (first, last) if first == last => write!(f, "{}/{first}", self.protocol.name()),
            (first, last) => write!(f, "{}/{first}-{last}", self.protocol.name()),
        }
    }
}

/// Peers as a prefix less its exceptions.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Peers {
    pub cidr: Ipv4Net,
    pub except: Vec<Ipv4Net>,
}

impl Peers {
    #[must_use]
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        self.cidr.contains(&addr) && !self.except.iter().any(|e| e.contains(&addr))
    }
}

/// Which policy a rule came from, for operators.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Origin {
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One rule: any of `peers` on any of `ports`; no ports: every protocol
/// and port (ICMP included, as NetworkPolicy's rule without ports).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    pub peers: Vec<Peers>,
    pub ports: Vec<Ports>,
    pub origin: Origin,
}

impl Rule {
    /// Whether the rule lets `peer` be the other end on `protocol`'s
    /// `port` (`protocol`: the IP protocol number).
    #[must_use]
    pub fn allows(&self, peer: Ipv4Addr, protocol: u8, port: u16) -> bool {
        self.allows_at(Peer::Addr(peer), protocol, port)
    }

    fn allows_at(&self, peer: Peer, protocol: u8, port: u16) -> bool {
        self.holds(peer) && ports_match(&self.ports, protocol, port)
    }

    /// Whether the rule's peers hold `peer`.
    #[must_use]
    pub fn holds(&self, peer: Peer) -> bool {
        self.peers.iter().any(|p| peer.in_peers(p))
    }
}

/// Whether `ports` (none: every protocol and port) hold `protocol`'s `port`.
fn ports_match(ports: &[Ports], protocol: u8, port: u16) -> bool {
    ports.is_empty()
        || ports
            .iter()
            .any(|p| p.protocol.number() == protocol && p.first <= port && port <= p.last)
}

/// The other end of a packet as the rules are read: an address, or (the
/// compiler's reading) every address whose longest listed prefix is this
/// one, which a rule's peers hold when they hold the whole prefix.
#[derive(Clone, Copy, Debug)]
pub enum Peer {
    Addr(Ipv4Addr),
    Prefix(Ipv4Net),
}

impl Peer {
    fn in_peers(self, peers: &Peers) -> bool {
        match self {
            Self::Addr(addr) => peers.contains(addr),
            Self::Prefix(prefix) => {
                peers.cidr.trunc().contains(&prefix)
                    && !peers.except.iter().any(|e| e.trunc().contains(&prefix))
            }
        }
    }

    fn in_net(self, net: Ipv4Net) -> bool {
        match self {
            Self::Addr(addr) => net.contains(&addr),
            Self::Prefix(prefix) => net.trunc().contains(&prefix),
        }
    }
}

/// The tiers of AWS's ClusterNetworkPolicy: Admin is judged before any
/// NetworkPolicy, Baseline after them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Tier {
    Admin,
    Baseline,
}

impl Tier {
    /// As the CRD spells it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Admin => cluster_policy::TIER_ADMIN,
            Self::Baseline => cluster_policy::TIER_BASELINE,
        }
    }
}

/// What a cluster rule does with what it matches. The order is the one
/// at equal priority: Deny wins over Accept, Accept over Pass (as
/// aws-node's agent breaks ties).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Action {
    Deny,
    Accept,
    /// Leaves the packet to the next tier.
    Pass,
}

impl Action {
    /// As the CRD spells it.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Deny => cluster_policy::ACTION_DENY,
            Self::Accept => cluster_policy::ACTION_ACCEPT,
            Self::Pass => cluster_policy::ACTION_PASS,
        }
    }
}

/// One rule of a cluster policy, resolved: `action` for any of `peers` on
/// any of `ports` (none: every protocol and port), at `priority` in
/// `tier` (lower wins).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClusterRule {
    pub tier: Tier,
    pub priority: u16,
    pub action: Action,
    pub peers: Vec<Ipv4Net>,
    pub ports: Vec<Ports>,
    /// The ClusterNetworkPolicy (its namespace empty).
    pub origin: Origin,
}

impl ClusterRule {
    fn matches(&self, peer: Peer, protocol: u8, port: u16) -> bool {
        self.holds(peer) && ports_match(&self.ports, protocol, port)
    }

    /// Whether the rule's peers hold `peer`.
    #[must_use]
    pub fn holds(&self, peer: Peer) -> bool {
        self.peers.iter().any(|n| peer.in_net(*n))
    }
}

/// The rule of `tier` that decides for the packet: the lowest priority,
/// then Deny, Accept, Pass; `None` when none matches.
fn winner(
    rules: &[ClusterRule],
    tier: Tier,
    peer: Peer,
    protocol: u8,
    port: u16,
) -> Option<&ClusterRule> {
    rules
        .iter()
        .filter(|r| r.tier == tier && r.matches(peer, protocol, port))
        .min_by_key(|r| (r.priority, r.action))
}

/// Which tier decided a verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Decider {
    Admin,
    NetworkPolicy,
    Baseline,
    /// No rule: the enforcing mode's default.
    Default,
}

/// A verdict and the tier that gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Verdict {
    pub allowed: bool,
    pub by: Decider,
}

/// One direction of one pod, every tier: what the datapath answers, and
/// what the compiler flattens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tiers<'a> {
    pub cluster: &'a [ClusterRule],
    pub policy: &'a Direction,
    /// A NetworkPolicy selects the pod: see [`PodRules::selected`].
    pub selected: bool,
}

impl Tiers<'_> {
    /// Whether nothing can deny in this direction: no lookup needed.
    #[must_use]
    pub fn is_open(&self) -> bool {
        self.cluster.is_empty() && *self.policy == Direction::Open
    }

    #[must_use]
    pub fn allows(&self, peer: Ipv4Addr, protocol: u8, port: u16) -> bool {
        self.verdict(Peer::Addr(peer), protocol, port).allowed
    }

    /// The verdict for `peer`'s packet on `protocol`'s `port`: Admin, then
    /// NetworkPolicy, then Baseline, then the default.
    #[must_use]
    pub fn verdict(&self, peer: Peer, protocol: u8, port: u16) -> Verdict {
        let decided = |tier: Tier, by| {
            winner(self.cluster, tier, peer, protocol, port).and_then(|rule| match rule.action {
                Action::Accept => Some(Verdict { allowed: true, by }),
                Action::Deny => Some(Verdict { allowed: false, by }),
                Action::Pass => None,
            })
        };
        if let Some(verdict) = decided(Tier::Admin, Decider::Admin) {
            return verdict;
        }
        let by_policy = |allowed| Verdict {
            allowed,
            by: Decider::NetworkPolicy,
        };
        match self.policy {
            Direction::Isolated(rules)
                if rules.iter().any(|r| r.allows_at(peer, protocol, port)) =>
            {
                return by_policy(true);
            }
            policy if self.selected => return by_policy(*policy == Direction::Open),
            _ => {}
        }
        decided(Tier::Baseline, Decider::Baseline).unwrap_or(Verdict {
            allowed: *self.policy == Direction::Open,
            by: Decider::Default,
        })
    }
}

/// What the policies selecting a pod say of one direction: not isolated
/// (everything passes), or only what one of the rules allows (none: deny
/// everything).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Direction {
    #[default]
    Open,
    Isolated(Vec<Rule>),
}

impl Direction {
    #[must_use]
    pub fn allows(&self, peer: Ipv4Addr, protocol: u8, port: u16) -> bool {
        match self {
            Self::Open => true,
            Self::Isolated(rules) => rules.iter().any(|r| r.allows(peer, protocol, port)),
        }
    }

    /// Adds another policy's say: isolation wins over openness, rules add up.
    pub fn merge(&mut self, other: Self) {
        match (&mut *self, other) {
            (_, Self::Open) => {}
            (Self::Open, isolated) => *self = isolated,
            (Self::Isolated(rules), Self::Isolated(more)) => rules.extend(more),
        }
    }
}

/// Both directions of one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PodRules {
    /// The NetworkPolicy tier: for a pod no NetworkPolicy selects, its
    /// enforcing mode's default (open, or strict mode's deny).
    pub ingress: Direction,
    pub egress: Direction,
    /// Whether a NetworkPolicy selects the pod: its tier then decides both
    /// directions (an open one allows), and Baseline is never read, as
    /// aws-node's agent does. Otherwise Baseline decides before the
    /// default.
    pub selected: bool,
    /// The cluster policies' rules for what reaches the pod and what it
    /// sends (none without ClusterNetworkPolicy).
    pub cluster_ingress: Vec<ClusterRule>,
    pub cluster_egress: Vec<ClusterRule>,
}

impl PodRules {
    #[must_use]
    pub fn ingress(&self) -> Tiers<'_> {
        Tiers {
            cluster: &self.cluster_ingress,
            policy: &self.ingress,
            selected: self.selected,
        }
    }

    #[must_use]
    pub fn egress(&self) -> Tiers<'_> {
        Tiers {
            cluster: &self.cluster_egress,
            policy: &self.egress,
            selected: self.selected,
        }
    }

    /// A pod no policy allows anything: strict mode's pod that no policy
    /// selects yet.
    #[must_use]
    pub const fn deny_all() -> Self {
        Self {
            ingress: Direction::Isolated(Vec::new()),
            egress: Direction::Isolated(Vec::new()),
            selected: false,
            cluster_ingress: Vec::new(),
            cluster_egress: Vec::new(),
        }
    }
}
