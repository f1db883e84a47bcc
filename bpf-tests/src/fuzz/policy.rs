//! The episodes' network policy: rules drawn at random for the local pods,
//! over the addresses and ports the generator sends to, written into the
//! maps by the agent's own enforcer; and the connections the programs let
//! through, read back as the model keeps them.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::Ipv4Addr,
};

use ipnet::Ipv4Net;
use vpcnet_agent::{
    datapath::DatapathMaps,
    policy::{
        Enforcer,
        rules::{
            Action, ClusterRule, Direction, Origin, Peers, PodRules, Ports, Protocol, Rule, Tier,
        },
    },
};
use vpcnet_common::policy::OPENED_BY_KEY_SOURCE;

use super::model::{Connection, End};

/// Rules for some of `pods` (the others are not judged), each direction
/// open or isolated with up to three rules, and for half of them cluster
/// rules around those; peers are prefixes around
/// `addresses`, ports ranges over `ports`.
pub fn pod_rules(
    rng: &mut fastrand::Rng,
    pods: &[Ipv4Addr],
    addresses: &[Ipv4Addr],
    ports: &[u16],
) -> BTreeMap<Ipv4Addr, PodRules> {
    let mut out = BTreeMap::new();
    for pod in pods {
        if rng.u32(0..4) == 0 {
            continue;
        }
        // Half the pods under cluster policies too.
        let cluster = rng.bool();
        let rules = PodRules {
            ingress: direction(rng, addresses, ports),
            egress: direction(rng, addresses, ports),
            selected: rng.bool(),
            cluster_ingress: cluster_rules(rng, cluster, addresses, ports),
            cluster_egress: cluster_rules(rng, cluster, addresses, ports),
        };
        out.insert(*pod, rules);
    }
    out
}

fn pick<T: Copy>(rng: &mut fastrand::Rng, items: &[T]) -> T {
    items[rng.usize(..items.len())]
}

/// The prefix of one of `lengths` around `addr`.
fn around(rng: &mut fastrand::Rng, addr: Ipv4Addr, lengths: &[u8]) -> Ipv4Net {
    Ipv4Net::new(addr, pick(rng, lengths))
        .expect("a prefix length up to 32")
        .trunc()
}

fn direction(rng: &mut fastrand::Rng, addresses: &[Ipv4Addr], ports: &[u16]) -> Direction {
    if rng.u32(0..4) == 0 {
        return Direction::Open;
    }
    Direction::Isolated(
        (0..rng.usize(0..=3))
            .map(|_| rule(rng, addresses, ports))
            .collect(),
    )
}

/// Up to three cluster rules (none unless `any`), of either tier, with
/// priorities that collide.
fn cluster_rules(
    rng: &mut fastrand::Rng,
    any: bool,
    addresses: &[Ipv4Addr],
    ports: &[u16],
) -> Vec<ClusterRule> {
    if !any {
        return Vec::new();
    }
    (0..rng.usize(0..=3))
        .map(|_| {
            let Rule { peers, ports, .. } = rule(rng, addresses, ports);
            ClusterRule {
                tier: [Tier::Admin, Tier::Baseline][rng.usize(0..2)],
                priority: rng.u16(0..3),
                action: [Action::Deny, Action::Accept, Action::Pass][rng.usize(0..3)],
                peers: peers.into_iter().map(|p| p.cidr).collect(),
                ports,
                origin: Origin::default(),
            }
        })
        .collect()
}

fn rule(rng: &mut fastrand::Rng, addresses: &[Ipv4Addr], ports: &[u16]) -> Rule {
    Rule {
        peers: (0..rng.usize(1..=2))
            .map(|_| peers(rng, addresses))
            .collect(),
        // A rule without ports allows every protocol and port.
        ports: if rng.u32(0..3) == 0 {
            Vec::new()
        } else {
            (0..rng.usize(1..=3))
                .map(|_| port_range(rng, ports))
                .collect()
        },
        origin: Origin::default(),
    }
}

/// A prefix around one of `addresses` (or everything), less at most two
/// smaller prefixes around addresses inside it.
fn peers(rng: &mut fastrand::Rng, addresses: &[Ipv4Addr]) -> Peers {
    let cidr = if rng.u32(0..6) == 0 {
        Ipv4Net::default()
    } else {
        let addr = pick(rng, addresses);
        around(rng, addr, &[8, 16, 24, 32])
    };
    let inside: Vec<Ipv4Addr> = addresses
        .iter()
        .copied()
        .filter(|a| cidr.contains(a))
        .collect();
    let except = if cidr.prefix_len() == 32 || inside.is_empty() {
        Vec::new()
    } else {
        (0..rng.usize(0..=2))
            .map(|_| {
                let addr = pick(rng, &inside);
                around(rng, addr, &[28, 32])
            })
            .filter(|e| e.prefix_len() > cidr.prefix_len())
            .collect()
    };
    Peers { cidr, except }
}

fn port_range(rng: &mut fastrand::Rng, ports: &[u16]) -> Ports {
    let protocol = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp][rng.usize(0..3)];
    let first = pick(rng, ports);
    match rng.u32(0..4) {
        0 => Ports::all(protocol),
        1 => {
            let ends: Vec<u16> = ports.iter().copied().filter(|p| *p >= first).collect();
            Ports {
                protocol,
                first,
                last: pick(rng, &ends),
            }
        }
        _ => Ports::one(protocol, first),
    }
}

/// Writes the episode's rules (`pods`, by address) with `enforcer`, and
/// forgets every connection tracked before.
pub fn install(enforcer: &mut Enforcer, maps: &mut DatapathMaps, pods: &BTreeMap<u32, PodRules>) {
    let pods: BTreeMap<Ipv4Addr, PodRules> = pods
        .iter()
        .map(|(addr, rules)| {
            (
                Ipv4Addr::from(vpcnet_common::raw_to_addr(*addr)),
                rules.clone(),
            )
        })
        .collect();
    let keys: Vec<_> = maps.policy_flows.keys().filter_map(Result::ok).collect();
    for key in keys {
        let _ = maps.policy_flows.remove(&key);
    }
    enforcer.set_pods(pods, BTreeSet::new());
    enforcer.sync(maps).expect("writing the episode's rules");
}

/// The connections the programs track, each with the end that opened it.
pub fn real_flows(maps: &DatapathMaps) -> HashMap<Connection, End> {
    vpcnet_agent::policy::maps::flows(maps)
        .expect("the policy flows")
        .into_iter()
        .map(|(key, flow)| {
            let opener = if flow.opener == OPENED_BY_KEY_SOURCE {
                (key.saddr, key.sport)
            } else {
                (key.daddr, key.dport)
            };
            (Connection::of(&key), opener)
        })
        .collect()
}
