//! An isolated direction's rules as the datapath's tries hold them: peer
//! prefixes, each with the one set of ports an address whose longest
//! matching prefix it is may use; and each port set as protocol and port
//! prefixes. Two trie lookups then answer for any number of rules, prefixes,
//! exceptions and ports.
//!
//! Why that is exact: for an address, the longest listed prefix holding it
//! lies inside every listed prefix that holds it. So a rule's peers hold the
//! address exactly when their prefix holds that longest one and none of
//! their exceptions does; the union of those rules' ports is its answer.
//! An exception no rule covers gets an empty set, so no shorter prefix
//! answers for it.

use std::collections::{BTreeMap, BTreeSet};

use ipnet::Ipv4Net;
use vpcnet_common::policy::{PORTS_ALL_OF_PROTOCOL, PORTS_ANY_PROTOCOL};

use super::rules::{Protocol, Rule};

/// What a peer prefix may use.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortSet {
    /// Every protocol and port.
    pub any: bool,
    /// Otherwise, per protocol, disjoint sorted inclusive ranges.
    pub ranges: BTreeMap<Protocol, Vec<(u16, u16)>>,
}

impl PortSet {
    fn add(&mut self, rule: &Rule) {
        if rule.ports.is_empty() {
            self.any = true;
            self.ranges.clear();
            return;
        }
        if self.any {
            return;
        }
        for ports in &rule.ports {
            let ranges = self.ranges.entry(ports.protocol).or_default();
            ranges.push((ports.first, ports.last));
            *ranges = merged(std::mem::take(ranges));
        }
    }

    /// Whether the set allows `port` of IP protocol `protocol`.
    #[must_use]
    pub fn allows(&self, protocol: u8, port: u16) -> bool {
        self.any
            || self.ranges.iter().any(|(p, ranges)| {
                p.number() == protocol
                    && ranges
                        .iter()
                        .any(|&(first, last)| first <= port && port <= last)
            })
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        !self.any && self.ranges.is_empty()
    }

    /// The set as `POLICY_PORTS` prefixes: (trie prefix length, protocol,
    /// first port of the block), the protocol and port meaningless where
    /// the length does not reach them.
    #[must_use]
    pub fn prefixes(&self) -> Vec<(u32, u8, u16)> {
        if self.any {
            return vec![(PORTS_ANY_PROTOCOL, 0, 0)];
        }
        let mut out = Vec::new();
        for (protocol, ranges) in &self.ranges {
            for &(first, last) in ranges {
                for (port, bits) in port_blocks(first, last) {
                    out.push((PORTS_ALL_OF_PROTOCOL + bits, protocol.number(), port));
                }
            }
        }
        out
    }
}

/// Sorted, overlapping and adjacent ranges joined.
fn merged(mut ranges: Vec<(u16, u16)>) -> Vec<(u16, u16)> {
    ranges.sort_unstable();
    let mut out: Vec<(u16, u16)> = Vec::with_capacity(ranges.len());
    for (first, last) in ranges {
        match out.last_mut() {
            Some(prev) if u32::from(first) <= u32::from(prev.1) + 1 => prev.1 = prev.1.max(last),
            _ => out.push((first, last)),
        }
    }
    out
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

/// An isolated direction, compiled: each listed prefix with its port set.
/// Equal rules compile equal, so pods with the same rules share one
/// identity.
pub type Compiled = BTreeMap<Ipv4Net, PortSet>;

/// Compiles the rules of an isolated direction (none: nothing allowed).
#[must_use]
pub fn compile(rules: &[Rule]) -> Compiled {
    let prefixes: BTreeSet<Ipv4Net> = rules
        .iter()
        .flat_map(|r| &r.peers)
        .flat_map(|p| std::iter::once(p.cidr).chain(p.except.iter().copied()))
        .map(|n| n.trunc())
        .collect();
    prefixes
        .into_iter()
        .map(|prefix| {
            let mut ports = PortSet::default();
            for rule in rules {
                let covers = rule.peers.iter().any(|p| {
                    p.cidr.trunc().contains(&prefix)
                        && !p.except.iter().any(|e| e.trunc().contains(&prefix))
                });
                if covers {
                    ports.add(rule);
                }
            }
            (prefix, ports)
        })
        .collect()
}

/// What the datapath answers for `peer`, `protocol`, `port` from a compiled
/// direction: the longest prefix's set. (The agent's own reading of the
/// tries, for revalidating tracked connections and for tests.)
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
    use crate::policy::rules::{Direction, Origin, Peers, Ports};

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
        let compiled = compile(&[
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
    }

    #[test]
    fn a_rule_without_ports_allows_every_protocol() {
        let compiled = compile(&[
            rule(&[("0.0.0.0/0", &[])], &[Ports::one(Protocol::Tcp, 443)]),
            rule(&[("192.0.2.0/24", &[])], &[]),
        ]);
        assert!(lookup(&compiled, Ipv4Addr::new(192, 0, 2, 1), 1, 0));
        assert!(lookup(&compiled, Ipv4Addr::new(192, 0, 2, 1), 6, 443));
        assert!(!lookup(&compiled, Ipv4Addr::new(198, 51, 100, 1), 1, 0));
        assert_eq!(
            compiled[&net("192.0.2.0/24")].prefixes(),
            vec![(PORTS_ANY_PROTOCOL, 0, 0)]
        );
    }

    /// The compiled tries answer exactly as the rules read one by one, for
    /// random rules over a small address space where prefixes collide.
    #[test]
    fn compiled_answers_equal_the_rules_read_one_by_one() {
        let mut rng = fastrand::Rng::with_seed(7);
        let prefix = |rng: &mut fastrand::Rng| {
            let len = rng.u8(24..=32);
            Ipv4Net::new(Ipv4Addr::new(10, 0, 0, rng.u8(..)), len)
                .unwrap()
                .trunc()
        };
        for _ in 0..300 {
            let rules: Vec<Rule> = (0..rng.usize(0..5))
                .map(|_| Rule {
                    peers: (0..rng.usize(1..3))
                        .map(|_| Peers {
                            cidr: prefix(&mut rng),
                            except: (0..rng.usize(0..3)).map(|_| prefix(&mut rng)).collect(),
                        })
                        .collect(),
                    ports: (0..rng.usize(0..3))
                        .map(|_| {
                            let protocol = [Protocol::Tcp, Protocol::Udp][rng.usize(0..2)];
                            let first = rng.u16(0..8);
                            Ports {
                                protocol,
                                first,
                                last: first + rng.u16(0..4),
                            }
                        })
                        .collect(),
                    origin: Origin::default(),
                })
                .collect();
            let compiled = compile(&rules);
            let direction = Direction::Isolated(rules.clone());
            for last in 0..=255 {
                let peer = Ipv4Addr::new(10, 0, 0, last);
                for (protocol, port) in [(6, 0), (6, 3), (6, 9), (17, 5), (1, 0)] {
                    assert_eq!(
                        lookup(&compiled, peer, protocol, port),
                        direction.allows(peer, protocol, port),
                        "{peer} {protocol}/{port} with {rules:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_set_prefixes_cover_exactly_its_ports() {
        let mut set = PortSet::default();
        set.add(&rule(
            &[],
            &[
                Ports {
                    protocol: Protocol::Tcp,
                    first: 1000,
                    last: 2000,
                },
                Ports::one(Protocol::Tcp, 2001),
                Ports::all(Protocol::Udp),
            ],
        ));
        assert_eq!(set.ranges[&Protocol::Tcp], vec![(1000, 2001)]);
        let prefixes = set.prefixes();
        let covered = |protocol: u8, port: u16| {
            prefixes.iter().any(|&(len, p, start)| {
                let bits = len - PORTS_ALL_OF_PROTOCOL;
                p == protocol && (bits == 0 || port >> (16 - bits) == start >> (16 - bits))
            })
        };
        for port in [0u16, 999, 1000, 1500, 2001, 2002, 65535] {
            assert_eq!(covered(6, port), (1000..=2001).contains(&port), "{port}");
            assert!(covered(17, port));
            assert!(!covered(132, port));
        }
    }
}
