//! The node each episode fuzzes: the same pods and ENIs always, and the
//! settings drawn for the episode (SNAT, ports, policy, timeouts).

use std::{
    collections::{BTreeMap, HashMap},
    net::Ipv4Addr,
};

use ipnet::Ipv4Net;
use vpcnet_agent::policy::rules::PodRules;
use vpcnet_common::{
    addr_to_raw,
    cidr::CidrKind,
    config::{Config, FLAG_EXTERNAL_SNAT, FLAG_NETWORK_POLICY, RandomizeMode},
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT, ENI_BRANCH, ENI_PRIMARY, Endpoint, Eni},
    nat::{DEFAULT_TIMEOUTS, Timeouts},
};

use super::{
    TableSizes,
    generate::{self, Cast},
    model::World,
    policy,
};
use crate::{
    INET, NODE, NODE_LOCAL_DNS, ONPREM, PEER, POD, POD2, SERVICE_CIDR, TEST_RUN_IFINDEX, VPC_CIDRS,
};

/// A local pod of the world: address, link, ENI link, flags.
struct PodSpec {
    addr: Ipv4Addr,
    ifindex: u32,
    eni_ifindex: u32,
    flags: u32,
}

const PRIMARY_ENI: u32 = 2;
const SECONDARY_ENI: u32 = 3;
const BRANCH_ENI: u32 = 4;
/// An ENI link no ENI map entry names.
const MISSING_ENI: u32 = 9;
const STRICT_POD: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 30);
const ORPHAN_POD: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 40);

fn pod_specs() -> [PodSpec; 4] {
    [
        PodSpec {
            addr: POD,
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: PRIMARY_ENI,
            flags: 0,
        },
        PodSpec {
            addr: STRICT_POD,
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: BRANCH_ENI,
            flags: ENDPOINT_BRANCH | ENDPOINT_STRICT,
        },
        PodSpec {
            addr: ORPHAN_POD,
            ifindex: TEST_RUN_IFINDEX,
            eni_ifindex: MISSING_ENI,
            flags: 0,
        },
        PodSpec {
            addr: POD2,
            ifindex: 5,
            eni_ifindex: SECONDARY_ENI,
            flags: 0,
        },
    ]
}

fn mac(kind: u8, addr: Ipv4Addr) -> [u8; 6] {
    let o = addr.octets();
    [0x02, kind, o[0], o[1], o[2], o[3]]
}

fn raw(addr: Ipv4Addr) -> u32 {
    addr_to_raw(addr.octets())
}

/// The episode's node: the same pods and ENIs always; SNAT settings, the
/// primary ENI, the test run link's role and the flow timeouts drawn from
/// `rng`; tables of `sizes`.
pub(super) fn world(rng: &mut fastrand::Rng, sizes: TableSizes) -> World {
    let randomize = [
        RandomizeMode::Prng,
        RandomizeMode::HashRandom,
        RandomizeMode::None,
    ][rng.usize(0..3)];
    // Wide ranges no episode fills, and ranges of one to three ports
    // (holding the generator's 40000 and 40001) that its flows to one
    // remote endpoint hold through and through.
    let (port_min, port_max) = [
        (1024, 65535),
        (1024, 65535),
        (30000, 30999),
        (0, 0),
        (40000, 40000),
        (40000, 40001),
        (39999, 40001),
    ][rng.usize(0..7)];
    let config = Config {
        node_addr: raw(NODE),
        flags: if rng.u32(0..5) == 0 {
            FLAG_EXTERNAL_SNAT
        } else {
            0
        },
        randomize: randomize as u32,
        port_min,
        port_max,
        hash_seed: rng.u32(..),
        primary_ifindex: if rng.u32(0..10) == 0 { 0 } else { PRIMARY_ENI },
        // vpcnet's default bits, the ones the generator marks with.
        mark_decided_bit: 0,
        mark_via_service_bit: 0,
    };
    let mut prefixes = vec![];
    for cidr in VPC_CIDRS {
        let net: Ipv4Net = cidr.parse().expect("VPC CIDR");
        prefixes.push((raw(net.network()), net.prefix_len(), CidrKind::Vpc));
    }
    if rng.bool() {
        prefixes.push((raw(Ipv4Addr::new(192, 0, 2, 0)), 24, CidrKind::Excluded));
    }
    prefixes.push((raw(NODE), 32, CidrKind::Local));
    prefixes.push((raw(NODE_LOCAL_DNS), 32, CidrKind::Local));
    let service: Ipv4Net = SERVICE_CIDR.parse().expect("service CIDR");
    prefixes.push((
        raw(service.network()),
        service.prefix_len(),
        CidrKind::Service,
    ));
    let endpoints = pod_specs()
        .iter()
        .map(|p| {
            let ep = Endpoint {
                ifindex: p.ifindex,
                eni_ifindex: p.eni_ifindex,
                mac: mac(1, p.addr),
                host_mac: mac(2, p.addr),
                flags: p.flags,
            };
            (raw(p.addr), ep)
        })
        .collect();
    let gateway = raw(Ipv4Addr::new(10, 20, 11, 1));
    let mut enis: HashMap<u32, Eni> = [
        (
            PRIMARY_ENI,
            Eni {
                gateway,
                flags: ENI_PRIMARY,
            },
        ),
        (SECONDARY_ENI, Eni { gateway, flags: 0 }),
        (
            BRANCH_ENI,
            Eni {
                gateway,
                flags: ENI_BRANCH,
            },
        ),
    ]
    .into();
    if rng.u32(0..10) == 0 {
        enis.insert(
            TEST_RUN_IFINDEX,
            Eni {
                gateway,
                flags: ENI_BRANCH,
            },
        );
    }
    let mut config = config;
    let policy = episode_policy(rng, &mut config);
    World {
        config,
        prefixes,
        endpoints,
        enis,
        ifindex: TEST_RUN_IFINDEX,
        policy,
        timeouts: episode_timeouts(rng),
        nat_capacity: sizes.nat as usize,
        stack_capacity: sizes.stack as usize,
    }
}

/// Timeouts no episode outlives: flows end only by being closed, taken
/// over or dropped early.
const FOREVER: u32 = 1_000_000_000;

/// Half the episodes give flows the node's timeouts, each netfilter's
/// default or a few seconds (so the clock's jumps end flows in every
/// state), and move the clock on; the others give flows no end in time.
fn episode_timeouts(rng: &mut fastrand::Rng) -> Timeouts {
    let mut timeouts = Timeouts::default();
    let timed = rng.bool();
    for (name, field) in Timeouts::SYSCTLS {
        *field(&mut timeouts) = match name {
            "tcp_max_retrans" => rng.u32(0..5),
            _ if !timed => FOREVER,
            _ if rng.bool() => {
                let mut default = DEFAULT_TIMEOUTS;
                *field(&mut default)
            }
            _ => rng.u32(1..=6),
        };
    }
    timeouts
}

/// Whether flows of `timeouts` end in time.
pub(super) fn timed(timeouts: &Timeouts) -> bool {
    timeouts.tcp_syn_sent != FOREVER
}

/// A third of the episodes judge policy: policy on, and rules for some
/// pods, over the addresses and ports the generator sends to.
fn episode_policy(rng: &mut fastrand::Rng, config: &mut Config) -> BTreeMap<u32, PodRules> {
    if rng.u32(0..3) != 0 {
        return BTreeMap::new();
    }
    config.flags |= FLAG_NETWORK_POLICY;
    let cast = cast();
    let addresses: Vec<Ipv4Addr> = cast
        .others
        .iter()
        .chain(&cast.pods)
        .chain([&NODE])
        .copied()
        .collect();
    policy::pod_rules(rng, &cast.pods, &addresses, &generate::PORTS)
        .into_iter()
        .map(|(addr, rules)| (raw(addr), rules))
        .collect()
}

pub(super) fn cast() -> Cast {
    let specs = pod_specs();
    Cast {
        node: NODE,
        senders: specs
            .iter()
            .filter(|p| p.ifindex == TEST_RUN_IFINDEX)
            .map(|p| (p.addr, mac(1, p.addr)))
            .collect(),
        pods: specs.iter().map(|p| p.addr).collect(),
        others: vec![
            PEER,
            Ipv4Addr::new(100, 64, 3, 4),
            Ipv4Addr::new(10, 20, 11, 99),
            INET,
            Ipv4Addr::new(203, 0, 113, 77),
            ONPREM,
            NODE_LOCAL_DNS,
            Ipv4Addr::new(10, 100, 0, 10),
        ],
    }
}
