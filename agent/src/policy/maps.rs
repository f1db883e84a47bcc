//! The policy tables written into, and read back from, the datapath's maps.

use std::{collections::BTreeMap, net::Ipv4Addr};

use aya::maps::{MapError, PerCpuValues, lpm_trie::Key};
use ipnet::Ipv4Net;
use vpcnet_common::{
    addr_to_raw,
    maps::{POLICY_CIDRS, POLICY_FLOWS, POLICY_PODS, POLICY_PORTS, POLICY_VERDICTS},
    nat::FlowKey,
    policy::{
        FLOW_REVOKED, OPENED_BY_KEY_DESTINATION, OPENED_BY_KEY_SOURCE, POLICY_ID_BITS,
        PORT_ALLOWED, PORT_DENIED, PodVerdicts, PolicyFlow, PortSet, PortVerdict, TIER_ADMIN,
        TIER_BASELINE, TIER_DEFAULT, TIER_NETWORK_POLICY, cidr_key_data, flow_key, port_key_data,
    },
    port_to_raw, raw_to_addr,
};

use super::{
    rules::{Decider, Verdict},
    tables::{PortEntry, Tables, Write},
};
use crate::datapath::{DatapathError, DatapathMaps, batch};

fn cidr_key(identity: u32, prefix: Ipv4Net) -> Key<[u8; 8]> {
    Key::new(
        POLICY_ID_BITS + u32::from(prefix.prefix_len()),
        cidr_key_data(identity, addr_to_raw(prefix.network().octets())),
    )
}

fn port_key(&(set, len, proto, port, _): &PortEntry) -> Key<[u8; 8]> {
    Key::new(len, port_key_data(set, proto, port_to_raw(port)))
}

/// A verdict as a `POLICY_PORTS` value.
#[must_use]
pub fn port_value(verdict: Verdict) -> PortVerdict {
    PortVerdict {
        verdict: if verdict.allowed {
            PORT_ALLOWED
        } else {
            PORT_DENIED
        },
        tier: match verdict.by {
            Decider::Admin => TIER_ADMIN,
            Decider::NetworkPolicy => TIER_NETWORK_POLICY,
            Decider::Baseline => TIER_BASELINE,
            Decider::Default => TIER_DEFAULT,
        },
        _pad: 0,
    }
}

/// A `POLICY_PORTS` value as a verdict (an unknown tier as NetworkPolicy's).
#[must_use]
pub fn verdict_of(value: PortVerdict) -> Verdict {
    Verdict {
        allowed: value.verdict != PORT_DENIED,
        by: match value.tier {
            TIER_ADMIN => Decider::Admin,
            TIER_BASELINE => Decider::Baseline,
            TIER_DEFAULT => Decider::Default,
            _ => Decider::NetworkPolicy,
        },
    }
}

/// Absent is no error when removing.
fn removed(result: Result<(), MapError>, name: &'static str) -> Result<(), DatapathError> {
    match result {
        Ok(()) | Err(MapError::KeyNotFound) => Ok(()),
        Err(e) => Err(DatapathError::map(name)(e)),
    }
}

/// Carries out `writes` in their order.
pub fn apply(maps: &mut DatapathMaps, writes: &[Write]) -> Result<(), DatapathError> {
    for write in writes {
        match write {
            Write::SetPort(entry) => maps
                .policy_ports
                .insert(&port_key(entry), port_value(entry.4), 0)
                .map_err(DatapathError::map(POLICY_PORTS))?,
            Write::SetCidr(identity, prefix, set) => maps
                .policy_cidrs
                .insert(&cidr_key(*identity, *prefix), PortSet { id: *set }, 0)
                .map_err(DatapathError::map(POLICY_CIDRS))?,
            Write::SetPod(addr, policy) => {
                let key = addr_to_raw(addr.octets());
                // Counted from its first verdict: the entry is there
                // first, and a pod whose identities change keeps its
                // counts.
                if maps.policy_verdicts.get(&key, 0).is_err() {
                    let zeros = PerCpuValues::try_from(vec![PodVerdicts::default(); cpus()?])
                        .map_err(DatapathError::Cpus)?;
                    maps.policy_verdicts
                        .insert(key, zeros, 0)
                        .map_err(DatapathError::map(POLICY_VERDICTS))?;
                }
                maps.policy_pods
                    .insert(key, *policy, 0)
                    .map_err(DatapathError::map(POLICY_PODS))?;
            }
            Write::RemovePod(addr) => {
                let key = addr_to_raw(addr.octets());
                removed(maps.policy_pods.remove(&key), POLICY_PODS)?;
                removed(maps.policy_verdicts.remove(&key), POLICY_VERDICTS)?;
            }
            Write::RemoveCidr(identity, prefix) => removed(
                maps.policy_cidrs.remove(&cidr_key(*identity, *prefix)),
                POLICY_CIDRS,
            )?,
            Write::RemovePort(entry) => {
                removed(maps.policy_ports.remove(&port_key(entry)), POLICY_PORTS)?;
            }
        }
    }
    Ok(())
}

/// What the maps hold now (a previous agent's content, at start).
pub fn read(maps: &DatapathMaps) -> Result<Tables, DatapathError> {
    let mut tables = Tables::default();
    for item in &maps.policy_pods {
        let (addr, policy) = item.map_err(DatapathError::map(POLICY_PODS))?;
        tables
            .pods
            .insert(Ipv4Addr::from(raw_to_addr(addr)), policy);
    }
    for item in &maps.policy_cidrs {
        let (key, set) = item.map_err(DatapathError::map(POLICY_CIDRS))?;
        let data = key.data();
        let identity = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
        let len = key.prefix_len().saturating_sub(POLICY_ID_BITS).min(32);
        let prefix = Ipv4Net::new(
            Ipv4Addr::new(data[4], data[5], data[6], data[7]),
            u8::try_from(len).expect("at most 32"),
        )
        .expect("a valid prefix length");
        tables.cidrs.insert((identity, prefix), set.id);
    }
    for item in &maps.policy_ports {
        let (key, value) = item.map_err(DatapathError::map(POLICY_PORTS))?;
        let data = key.data();
        let set = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
        let port = u16::from_be_bytes([data[5], data[6]]);
        tables
            .ports
            .insert((set, key.prefix_len(), data[4], port, verdict_of(value)));
    }
    Ok(tables)
}

fn cpus() -> Result<usize, DatapathError> {
    aya::util::nr_cpus().map_err(|(_, source)| DatapathError::Cpus(source))
}

/// What policy decided for each pod under it, summed over the CPUs.
pub fn verdicts(maps: &DatapathMaps) -> Result<BTreeMap<Ipv4Addr, PodVerdicts>, DatapathError> {
    let mut out = BTreeMap::new();
    for item in &maps.policy_verdicts {
        let (addr, per_cpu) = item.map_err(DatapathError::map(POLICY_VERDICTS))?;
        let sum = per_cpu
            .iter()
            .fold(PodVerdicts::default(), |sum, v| sum.plus(*v));
        out.insert(Ipv4Addr::from(raw_to_addr(addr)), sum);
    }
    Ok(out)
}

/// The connections policy let through: each by its key and entry.
pub fn flows(maps: &DatapathMaps) -> Result<Vec<(FlowKey, PolicyFlow)>, DatapathError> {
    maps.policy_flows
        .iter()
        .collect::<Result<_, _>>()
        .map_err(DatapathError::map(POLICY_FLOWS))
}

/// Marks a tracked connection denied (its packets are dropped until it is
/// opened again) or allowed again.
pub fn set_flow_revoked(
    maps: &mut DatapathMaps,
    key: &FlowKey,
    flow: &PolicyFlow,
    revoked: bool,
) -> Result<(), DatapathError> {
    let entry = PolicyFlow {
        revoked: if revoked { FLOW_REVOKED } else { 0 },
        ..*flow
    };
    maps.policy_flows
        .insert(key, entry, 0)
        .map_err(DatapathError::map(POLICY_FLOWS))
}

/// Tracks the connection whose packets from its opener carry `opened`
/// (a connection another enforcer let through, taken over with the node),
/// unless it is tracked already. Returns whether it was added.
pub fn track_flow(
    maps: &DatapathMaps,
    opened: &FlowKey,
    now_ns: u64,
) -> Result<bool, DatapathError> {
    let (key, reversed) = flow_key(opened);
    let flow = PolicyFlow {
        last_seen_ns: now_ns,
        opener: if reversed {
            OPENED_BY_KEY_DESTINATION
        } else {
            OPENED_BY_KEY_SOURCE
        },
        ..PolicyFlow::default()
    };
    batch::put_if_absent(&maps.policy_flows, &key, &flow).map_err(DatapathError::map(POLICY_FLOWS))
}
