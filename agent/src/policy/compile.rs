//! A direction's rules, every tier, as the datapath's tries hold them: peer
//! prefixes, each with the one port set that answers for an address whose
//! longest listed prefix it is; and each port set as protocol and port
//! prefixes, each with its verdict. Two trie lookups then answer for any
//! number of rules, tiers, prefixes, exceptions and ports.
//!
//! Why that is exact: for an address, the longest listed prefix holding it
//! lies inside every listed prefix that holds it. So a rule's peers hold the
//! address exactly when they hold that whole longest prefix (and none of
//! their exceptions does); the rules that do decide its verdicts. An
//! exception no rule covers gets its own answer, so no shorter prefix
//! answers for it.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::Ipv4Net;
use vpcnet_common::policy::{PORTS_ALL_OF_PROTOCOL, PORTS_ANY_PROTOCOL};

use super::rules::{ClusterRule, Decider, Direction, Peer, Ports, Protocol, Rule, Tiers, Verdict};

/// What the tries answer where they hold nothing: denied, by the
/// NetworkPolicy tier.
pub const ABSENT: Verdict = Verdict {
    allowed: false,
    by: Decider::NetworkPolicy,
};

/// A protocol no rule with ports names (the tries' "every other protocol").
const OTHER_PROTOCOL: u8 = 0;

/// What a peer prefix may use: a verdict for every protocol and port.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortSet {
    /// For every protocol and port not in `ranges` (ICMP among them).
    pub any: Verdict,
    /// Per protocol, disjoint sorted inclusive ranges whose verdict is not
    /// `any`'s.
    pub ranges: BTreeMap<Protocol, Vec<(u16, u16, Verdict)>>,
}

impl Default for PortSet {
    fn default() -> Self {
        Self {
            any: ABSENT,
            ranges: BTreeMap::new(),
        }
    }
}

impl PortSet {
    /// The verdict for `port` of IP protocol `protocol`.
    #[must_use]
    pub fn verdict(&self, protocol: u8, port: u16) -> Verdict {
        self.ranges
            .iter()
            .filter(|(p, _)| p.number() == protocol)
            .flat_map(|(_, ranges)| ranges)
            .find(|&&(first, last, _)| first <= port && port <= last)
            .map_or(self.any, |&(.., verdict)| verdict)
    }

    /// Whether the set allows `port` of IP protocol `protocol`.
    #[must_use]
    pub fn allows(&self, protocol: u8, port: u16) -> bool {
        self.verdict(protocol, port).allowed
    }

    /// Whether the set allows nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        !self.any.allowed && self.ranges.values().flatten().all(|r| !r.2.allowed)
    }

    /// The set as `POLICY_PORTS` entries: (trie prefix length, protocol,
    /// first port of the block, verdict), the protocol and port
    /// meaningless where the length does not reach them. Where the set
    /// says what absence says, nothing is written.
    #[must_use]
    pub fn prefixes(&self) -> Vec<(u32, u8, u16, Verdict)> {
        let mut out = Vec::new();
        if self.any != ABSENT {
            out.push((PORTS_ANY_PROTOCOL, 0, 0, self.any));
        }
        for (protocol, ranges) in &self.ranges {
            for &(first, last, verdict) in ranges {
                for (port, bits) in port_blocks(first, last) {
                    out.push((
                        PORTS_ALL_OF_PROTOCOL + bits,
                        protocol.number(),
                        port,
                        verdict,
                    ));
                }
            }
        }
        out
    }
}

/// An inclusive port range as aligned blocks: (first port, prefix bits of
/// the 16-bit port). At most 30 blocks.
fn port_blocks(first: u16, last: u16) -> Vec<(u16, u32)> {
    let mut out = Vec::new();
    let mut lo = u32::from(first);
    let hi = u32::from(last);
    while lo <= hi {
        // The largest block aligned at `lo` that fits before `hi`.
        let mut size_bits = if lo == 0 {
            16
        } else {
            lo.trailing_zeros().min(16)
        };
        while lo + (1 << size_bits) - 1 > hi {
            size_bits -= 1;
        }
        out.push((u16::try_from(lo).expect("below 65536"), 16 - size_bits));
        lo += 1 << size_bits;
    }
    out
}

/// A direction, compiled: each listed prefix with its port set. Equal
/// rules compile equal, so pods with the same rules share one identity.
pub type Compiled = BTreeMap<Ipv4Net, PortSet>;

/// Compiles a direction's tiers (an open one, nothing to deny, is never
/// looked up and compiles to nothing).
#[must_use]
pub fn compile(tiers: &Tiers<'_>) -> Compiled {
    let policy_rules: &[Rule] = match tiers.policy {
        Direction::Isolated(rules) => rules,
        Direction::Open => &[],
    };
    let mut prefixes: BTreeSet<Ipv4Net> = policy_rules
        .iter()
        .flat_map(|r| &r.peers)
        .flat_map(|p| std::iter::once(p.cidr).chain(p.except.iter().copied()))
        .chain(tiers.cluster.iter().flat_map(|r| r.peers.iter().copied()))
        .map(|n| n.trunc())
        .collect();
    if !tiers.cluster.is_empty() {
        // What no cluster rule names still has the lower tiers' answer.
        prefixes.insert(Ipv4Net::default());
    }
    prefixes
        .into_iter()
        .map(|prefix| (prefix, port_set(tiers, prefix)))
        .collect()
}

/// The verdicts for the addresses whose longest listed prefix is `prefix`.
fn port_set(tiers: &Tiers<'_>, prefix: Ipv4Net) -> PortSet {
    let peer = Peer::Prefix(prefix);
    // Only the rules whose peers hold the prefix decide there.
    let policy = match tiers.policy {
        Direction::Open => Direction::Open,
        Direction::Isolated(rules) => {
            Direction::Isolated(rules.iter().filter(|r| r.holds(peer)).cloned().collect())
        }
    };
    let cluster: Vec<ClusterRule> = tiers
        .cluster
        .iter()
        .filter(|r| r.holds(peer))
        .cloned()
        .collect();
    let here = Tiers {
        cluster: &cluster,
        policy: &policy,
        selected: tiers.selected,
    };
    let any = here.verdict(peer, OTHER_PROTOCOL, 0);
    let mut ranges = BTreeMap::new();
    for protocol in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
        let named = |ports: &[Ports]| -> Vec<(u16, u16)> {
            ports
                .iter()
                .filter(|p| p.protocol == protocol)
                .map(|p| (p.first, p.last))
                .collect()
        };
        let bounds: Vec<(u16, u16)> = match &policy {
            Direction::Isolated(rules) => rules.iter().flat_map(|r| named(&r.ports)).collect(),
            Direction::Open => Vec::new(),
        }
        .into_iter()
        .chain(cluster.iter().flat_map(|r| named(&r.ports)))
        .collect();
        if bounds.is_empty() {
            // Every rule treats this protocol as any other.
            continue;
        }
        // Where some rule's ports begin or end, the verdict may change.
        let mut starts: BTreeSet<u32> = BTreeSet::from([0]);
        for (first, last) in bounds {
            starts.insert(u32::from(first));
            starts.insert(u32::from(last) + 1);
        }
        starts.remove(&0x1_0000);
        let starts: Vec<u32> = starts.into_iter().collect();
        let mut out: Vec<(u16, u16, Verdict)> = Vec::new();
        for (i, &start) in starts.iter().enumerate() {
            let first = u16::try_from(start).expect("below 65536");
            let last = starts.get(i + 1).map_or(u16::MAX, |next| {
                u16::try_from(next - 1).expect("below 65536")
            });
            let verdict = here.verdict(peer, protocol.number(), first);
            if verdict == any {
                continue;
            }
            match out.last_mut() {
                Some(prev) if prev.2 == verdict && u32::from(prev.1) + 1 == start => prev.1 = last,
                _ => out.push((first, last, verdict)),
            }
        }
        if !out.is_empty() {
            ranges.insert(protocol, out);
        }
    }
    PortSet { any, ranges }
}

/// What the datapath answers for `peer`, `protocol`, `port` from a compiled
/// direction: the longest prefix's set. (The agent's own reading of the
/// tries, for tests.)
#[must_use]
pub fn lookup(compiled: &Compiled, peer: std::net::Ipv4Addr, protocol: u8, port: u16) -> bool {
    compiled
        .iter()
        .filter(|(prefix, _)| prefix.contains(&peer))
        .max_by_key(|(prefix, _)| prefix.prefix_len())
        .is_some_and(|(_, ports)| ports.allows(protocol, port))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::policy::rules::{Action, Origin, Peers, Tier};

    fn net(s: &str) -> Ipv4Net {
        s.parse().unwrap()
    }

    fn rule(peers: &[(&str, &[&str])], ports: &[Ports]) -> Rule {
        Rule {
            peers: peers
                .iter()
                .map(|(cidr, except)| Peers {
                    cidr: net(cidr),
                    except: except.iter().map(|e| net(e)).collect(),
                })
                .collect(),
            ports: ports.to_vec(),
            origin: Origin::default(),
        }
    }

    /// A pod's direction isolated by `rules` alone.
    fn isolated(rules: &[Rule]) -> Compiled {
        let policy = Direction::Isolated(rules.to_vec());
        compile(&Tiers {
            cluster: &[],
            policy: &policy,
            selected: true,
        })
    }

    fn cluster(
        tier: Tier,
        priority: u16,
        action: Action,
        peer: &str,
        ports: &[Ports],
    ) -> ClusterRule {
        ClusterRule {
            tier,
            priority,
            action,
            peers: vec![net(peer)],
            ports: ports.to_vec(),
            origin: Origin::default(),
        }
    }

    #[test]
    fn port_ranges_become_aligned_blocks() {
        assert_eq!(port_blocks(0, u16::MAX), vec![(0, 0)]);
        assert_eq!(port_blocks(80, 80), vec![(80, 16)]);
        assert_eq!(port_blocks(8080, 8083), vec![(8080, 14)]);
        assert_eq!(port_blocks(1, 3), vec![(1, 16), (2, 15)]);
        let worst = port_blocks(1, u16::MAX - 1);
        assert_eq!(worst.len(), 30);
        for port in [1u16, 2, 1000, 32768, 65534] {
            assert!(
                worst
                    .iter()
                    .any(|&(start, bits)| port >> (16 - bits) == start >> (16 - bits)),
                "{port}"
            );
        }
        assert!(
            !worst
                .iter()
                .any(|&(start, bits)| bits == 0 || u16::MAX >> (16 - bits) == start >> (16 - bits))
        );
    }

    #[test]
    fn an_exception_is_its_own_prefix_with_only_what_other_rules_give_it() {
        let tcp80 = Ports::one(Protocol::Tcp, 80);
        let udp53 = Ports::one(Protocol::Udp, 53);
        let compiled = isolated(&[
            rule(&[("10.0.0.0/8", &["10.1.0.0/16"])], &[tcp80]),
            rule(&[("10.1.2.0/24", &[])], &[udp53]),
        ]);
        let at = |a: [u8; 4], proto, port| lookup(&compiled, Ipv4Addr::from(a), proto, port);
        assert!(at([10, 9, 0, 1], 6, 80));
        assert!(!at([10, 9, 0, 1], 17, 53));
        assert!(!at([10, 1, 9, 1], 6, 80), "excepted");
        assert!(
            at([10, 1, 2, 1], 17, 53),
            "inside the exception, another rule"
        );
        assert!(!at([10, 1, 2, 1], 6, 80));
        assert!(!at([11, 0, 0, 1], 6, 80));
        assert!(compiled[&net("10.1.0.0/16")].is_empty());
        assert!(compiled[&net("10.1.0.0/16")].prefixes().is_empty());
    }

    #[test]
    fn a_rule_without_ports_allows_every_protocol() {
        let compiled = isolated(&[
            rule(&[("0.0.0.0/0", &[])], &[Ports::one(Protocol::Tcp, 443)]),
            rule(&[("192.0.2.0/24", &[])], &[]),
        ]);
        assert!(lookup(&compiled, Ipv4Addr::new(192, 0, 2, 1), 1, 0));
        assert!(lookup(&compiled, Ipv4Addr::new(192, 0, 2, 1), 6, 443));
        assert!(!lookup(&compiled, Ipv4Addr::new(198, 51, 100, 1), 1, 0));
        let allowed = Verdict {
            allowed: true,
            by: Decider::NetworkPolicy,
        };
        assert_eq!(
            compiled[&net("192.0.2.0/24")].prefixes(),
            vec![(PORTS_ANY_PROTOCOL, 0, 0, allowed)]
        );
    }

    #[test]
    fn the_set_prefixes_cover_exactly_its_ports() {
        let compiled = isolated(&[rule(
            &[("10.0.0.0/8", &[])],
            &[
                Ports {
                    protocol: Protocol::Tcp,
                    first: 1000,
                    last: 2000,
                },
                Ports::one(Protocol::Tcp, 2001),
                Ports::all(Protocol::Udp),
            ],
        )]);
        let set = &compiled[&net("10.0.0.0/8")];
        assert_eq!(set.ranges[&Protocol::Tcp].len(), 1, "{set:?}");
        assert_eq!(
            set.ranges[&Protocol::Tcp][0].0..=set.ranges[&Protocol::Tcp][0].1,
            1000..=2001
        );
        let prefixes = set.prefixes();
        let covered = |protocol: u8, port: u16| {
            prefixes.iter().any(|&(len, p, start, verdict)| {
                let bits = len - PORTS_ALL_OF_PROTOCOL;
                verdict.allowed
                    && p == protocol
                    && (bits == 0 || port >> (16 - bits) == start >> (16 - bits))
            })
        };
        for port in [0u16, 999, 1000, 1500, 2001, 2002, 65535] {
            assert_eq!(covered(6, port), (1000..=2001).contains(&port), "{port}");
            assert!(covered(17, port));
            assert!(!covered(132, port));
        }
    }

    #[test]
    fn an_admin_deny_carves_out_of_what_a_policy_allows() {
        let policy = Direction::Isolated(vec![rule(&[("10.0.0.0/8", &[])], &[])]);
        let rules = [
            cluster(
                Tier::Admin,
                10,
                Action::Deny,
                "10.1.0.0/16",
                &[Ports::one(Protocol::Tcp, 22)],
            ),
            cluster(Tier::Admin, 20, Action::Accept, "203.0.113.0/24", &[]),
        ];
        let tiers = Tiers {
            cluster: &rules,
            policy: &policy,
            selected: true,
        };
        let compiled = compile(&tiers);
        let at = |a: [u8; 4], proto, port| lookup(&compiled, Ipv4Addr::from(a), proto, port);
        assert!(at([10, 1, 0, 1], 6, 80));
        assert!(!at([10, 1, 0, 1], 6, 22), "Admin's Deny");
        assert!(at([10, 2, 0, 1], 6, 22));
        assert!(
            at([203, 0, 113, 5], 17, 53),
            "Admin's Accept past the policy"
        );
        assert!(!at([192, 0, 2, 1], 6, 80), "the policy isolates");
        let denied = compiled[&net("10.1.0.0/16")].prefixes();
        assert!(
            denied.iter().any(|&(_, p, port, v)| p == 6
                && port == 22
                && v.by == Decider::Admin
                && !v.allowed),
            "{denied:?}"
        );
    }

    /// The compiled tries answer exactly as the rules read one by one, for
    /// random rules of every tier over a small address space where
    /// prefixes collide.
    #[test]
    fn compiled_answers_equal_the_rules_read_one_by_one() {
        let mut rng = fastrand::Rng::with_seed(7);
        let prefix = |rng: &mut fastrand::Rng| {
            let len = rng.u8(24..=32);
            Ipv4Net::new(Ipv4Addr::new(10, 0, 0, rng.u8(..)), len)
                .unwrap()
                .trunc()
        };
        let ports = |rng: &mut fastrand::Rng| -> Vec<Ports> {
            (0..rng.usize(0..3))
                .map(|_| {
                    let protocol = [Protocol::Tcp, Protocol::Udp][rng.usize(0..2)];
                    let first = rng.u16(0..8);
                    Ports {
                        protocol,
                        first,
                        last: first + rng.u16(0..4),
                    }
                })
                .collect()
        };
        for round in 0..600 {
            let rules: Vec<Rule> = (0..rng.usize(0..5))
                .map(|_| Rule {
                    peers: (0..rng.usize(1..3))
                        .map(|_| Peers {
                            cidr: prefix(&mut rng),
                            except: (0..rng.usize(0..3)).map(|_| prefix(&mut rng)).collect(),
                        })
                        .collect(),
                    ports: ports(&mut rng),
                    origin: Origin::default(),
                })
                .collect();
            // Half the rounds with cluster rules, a third of the
            // directions open.
            let cluster_rules: Vec<ClusterRule> =
                (0..if round % 2 == 0 { rng.usize(0..5) } else { 0 })
                    .map(|_| ClusterRule {
                        tier: [Tier::Admin, Tier::Baseline][rng.usize(0..2)],
                        priority: rng.u16(0..3),
                        action: [Action::Deny, Action::Accept, Action::Pass][rng.usize(0..3)],
                        peers: (0..rng.usize(1..3)).map(|_| prefix(&mut rng)).collect(),
                        ports: ports(&mut rng),
                        origin: Origin::default(),
                    })
                    .collect();
            let policy = if rng.usize(0..3) == 0 {
                Direction::Open
            } else {
                Direction::Isolated(rules)
            };
            let tiers = Tiers {
                cluster: &cluster_rules,
                policy: &policy,
                selected: rng.bool(),
            };
            if tiers.is_open() {
                continue;
            }
            let compiled = compile(&tiers);
            let outside = Ipv4Addr::new(192, 0, 2, 1);
            for peer in (0..=255)
                .map(|last| Ipv4Addr::new(10, 0, 0, last))
                .chain([outside])
            {
                for (protocol, port) in [(6, 0), (6, 3), (6, 9), (17, 5), (1, 0)] {
                    assert_eq!(
                        lookup(&compiled, peer, protocol, port),
                        tiers.allows(peer, protocol, port),
                        "{peer} {protocol}/{port} with {tiers:?}"
                    );
                }
            }
        }
    }
}
