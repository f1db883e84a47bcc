//! The one form every source of network policy lands in (PolicyEndpoints,
//! NetworkPolicy resolved by the agent): for one direction of one pod, the
//! rules that allow peers, each a set of prefixes with exceptions and the
//! ports they may use. The datapath's maps are written from this form.

use std::{fmt, net::Ipv4Addr};

use ipnet::Ipv4Net;

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
        self.peers.iter().any(|p| p.contains(peer))
            && (self.ports.is_empty()
                || self
                    .ports
                    .iter()
                    .any(|p| p.protocol.number() == protocol && p.first <= port && port <= p.last))
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
    pub ingress: Direction,
    pub egress: Direction,
}

impl PodRules {
    /// A pod no policy allows anything: strict mode's pod that no policy
    /// selects yet.
    #[must_use]
    pub const fn deny_all() -> Self {
        Self {
            ingress: Direction::Isolated(Vec::new()),
            egress: Direction::Isolated(Vec::new()),
        }
    }
}
