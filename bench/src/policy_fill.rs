//! A node's worth of network policy for the benchmark: rules for the
//! filler pods and the measured ones, compiled and written into the running
//! agent's pinned maps by the agent's own enforcer, and enforcement turned
//! on; as [`crate::fillers`] writes endpoints. The lab's agent runs without
//! `ENABLE_NETWORK_POLICY`, so nothing else writes these maps.
//!
//! The rules: [`RULE_SETS`] sets of [`CIDRS_PER_SET`] rules for the
//! fillers (each filler pod gets one set, both ways), and one more set for
//! the measured pods with the rules that allow the measured flows; each
//! rule a /24 of 198.18.0.0/15 less a /28, on a TCP port range and a UDP
//! port. The peers are nobody the lab has: the measured flows' lookups go
//! through the full tries to the rule that allows them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    os::fd::{AsFd, AsRawFd},
    path::Path,
};

use anyhow::{Context, Result};
use ipnet::Ipv4Net;
use vpcnet_agent::{
    datapath::{DatapathMaps, pins},
    policy::{
        Enforcer,
        rules::{Direction, Origin, Peers, PodRules, Ports, Protocol, Rule},
    },
};
use vpcnet_common::{config::FLAG_NETWORK_POLICY, maps as names};
use vpcnet_lab::addrs;

/// Distinct rule sets among the filler pods.
pub const RULE_SETS: usize = 4;
/// Rules (CIDRs with an exception) per set.
pub const CIDRS_PER_SET: usize = 100;

/// Policy written into the agent's maps, taken out again when dropped
/// (also when a run fails).
pub struct PolicyFill {
    maps: DatapathMaps,
    enforcer: Enforcer,
    rules: usize,
}

/// The policy maps, for their memory.
const POLICY_MAPS: [&str; 5] = [
    names::POLICY_PODS,
    names::POLICY_CIDRS,
    names::POLICY_PORTS,
    names::POLICY_FLOWS,
    names::POLICY_VERDICTS,
];

fn origin() -> Origin {
    Origin {
        namespace: "bench".into(),
        name: "policy".into(),
    }
}

/// Rule set `set`: [`CIDRS_PER_SET`] /24s of 198.18.0.0/15 less a /28
/// each, on a TCP range and a UDP port.
fn rule_set(set: usize) -> Vec<Rule> {
    (0..CIDRS_PER_SET)
        .map(|i| {
            let index = u32::try_from((set * CIDRS_PER_SET + i) % 512).unwrap_or(0);
            let base = u32::from(Ipv4Addr::new(198, 18, 0, 0)) + (index << 8);
            let cidr = Ipv4Net::new(Ipv4Addr::from(base), 24).expect("a /24");
            let except = Ipv4Net::new(Ipv4Addr::from(base + 16), 28).expect("a /28");
            let first = 1000 + u16::try_from(i * 10).unwrap_or(0);
            let extra = u16::try_from(set).unwrap_or(0);
            Rule {
                peers: vec![Peers {
                    cidr,
                    except: vec![except],
                }],
                ports: vec![
                    Ports {
                        protocol: Protocol::Tcp,
                        first,
                        last: first + 4 + extra,
                    },
                    Ports::one(Protocol::Udp, 5000 + u16::try_from(i).unwrap_or(0)),
                ],
                origin: origin(),
            }
        })
        .collect()
}

/// A host on TCP `port`.
fn allow(peers: &[Ipv4Addr], port: u16) -> Rule {
    Rule {
        peers: peers
            .iter()
            .map(|addr| Peers {
                cidr: Ipv4Net::from(*addr),
                except: Vec::new(),
            })
            .collect(),
        ports: vec![Ports::one(Protocol::Tcp, port)],
        origin: origin(),
    }
}

impl PolicyFill {
    /// Rules for `fillers` filler pods, for `client` (egress to each of
    /// `servers` on `port`) and for `server_pod` (ingress from `client` on
    /// `port`); enforcement on.
    pub fn insert(
        fillers: usize,
        client: Ipv4Addr,
        servers: &[Ipv4Addr],
        server_pod: Ipv4Addr,
        port: u16,
    ) -> Result<Self> {
        let pins = Path::new(addrs::BPF_PIN_DIR);
        let mut maps = DatapathMaps::open_pinned(pins)
            .with_context(|| format!("opening the agent's maps in {}", pins.display()))?;
        let mut enforcer = Enforcer::new(&maps).context("reading the policy maps")?;
        let sets: Vec<Vec<Rule>> = (0..=RULE_SETS).map(rule_set).collect();
        let mut pods = BTreeMap::new();
        for index in 0..fillers {
            let addr = addrs::filler_pod_addr(index)
                .with_context(|| format!("filler {index}: the lab has no address for it"))?;
            let rules = sets[index % RULE_SETS].clone();
            pods.insert(
                addr,
                PodRules {
                    ingress: Direction::Isolated(rules.clone()),
                    egress: Direction::Isolated(rules),
                    ..PodRules::default()
                },
            );
        }
        let measured = &sets[RULE_SETS];
        let with = |extra: Rule| {
            let mut rules = measured.clone();
            rules.push(extra);
            Direction::Isolated(rules)
        };
        pods.insert(
            client,
            PodRules {
                ingress: Direction::Isolated(measured.clone()),
                egress: with(allow(servers, port)),
                ..PodRules::default()
            },
        );
        pods.insert(
            server_pod,
            PodRules {
                ingress: with(allow(&[client], port)),
                egress: Direction::Isolated(measured.clone()),
                ..PodRules::default()
            },
        );
        enforcer.set_pods(pods, BTreeSet::new());
        enforcer
            .sync(&mut maps)
            .context("writing the policy maps")?;
        let mut fill = Self {
            maps,
            enforcer,
            rules: RULE_SETS * CIDRS_PER_SET + CIDRS_PER_SET + 2,
        };
        fill.enforce(true)?;
        Ok(fill)
    }

    /// Turns enforcement on or off, the rules staying in the maps: what a
    /// flip of `ENABLE_NETWORK_POLICY` in the config map does to the
    /// datapath, without rewriting the maps between measurements.
    pub fn enforce(&mut self, on: bool) -> Result<()> {
        let mut config = self.maps.config().context("reading the config")?;
        if on {
            config.flags |= FLAG_NETWORK_POLICY;
        } else {
            config.flags &= !FLAG_NETWORK_POLICY;
        }
        self.maps
            .set_config(&config)
            .context("turning policy on or off")
    }

    /// Distinct rules written.
    #[must_use]
    pub const fn rules(&self) -> usize {
        self.rules
    }

    /// Each policy map's memory (the kernel's `memlock` of it), bytes.
    pub fn memory() -> Result<Vec<(&'static str, u64)>> {
        let pins = Path::new(addrs::BPF_PIN_DIR);
        POLICY_MAPS
            .into_iter()
            .map(|name| {
                let map = names::ALL
                    .into_iter()
                    .find(|m| m.name == name)
                    .context("a pinned map")?;
                let path = pins::pin_path(pins, &map);
                let data = aya::maps::MapData::from_pin(&path)
                    .with_context(|| format!("opening {}", path.display()))?;
                let fd = data.fd().as_fd().as_raw_fd();
                let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
                    .context("reading the map's fdinfo")?;
                let bytes = info
                    .lines()
                    .find_map(|l| l.strip_prefix("memlock:"))
                    .and_then(|v| v.trim().parse().ok())
                    .context("no memlock in the map's fdinfo")?;
                Ok((name, bytes))
            })
            .collect()
    }

    /// Turns policy off and empties its maps.
    fn take_out(&mut self) -> Result<()> {
        self.enforce(false)?;
        self.enforcer.set_pods(BTreeMap::new(), BTreeSet::new());
        self.enforcer.sync(&mut self.maps)?;
        Ok(())
    }
}

impl Drop for PolicyFill {
    fn drop(&mut self) {
        let _ = self.take_out();
    }
}
