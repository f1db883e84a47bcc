//! Typed handles on the datapath's maps, taken from a freshly loaded object
//! or opened from their pins (the CLI, a restarted agent).

use std::{net::Ipv4Addr, path::Path};

use aya::maps::{Array, HashMap, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap, lpm_trie::Key};
use ipnet::Ipv4Net;
use vpcnet_common::{
    addr_to_raw,
    cidr::{CidrKind, CidrValue, EXTERNAL_SERVICE_CIDR, ExternalServiceCidr},
    config::Config,
    counters::Counter,
    endpoint::{ENI_PRIMARY, Endpoint, Eni},
    maps,
    nat::{FlowKey, NatEntry, Timeouts},
    policy::{PodPolicy, PodVerdicts, PolicyFlow, PortSet, PortVerdict},
    raw_to_addr,
};

use super::{DatapathError, batch};

pub struct DatapathMaps {
    pub config: Array<MapData, Config>,
    /// How long flows live in each state (netfilter's timeouts).
    pub ct_timeouts: Array<MapData, Timeouts>,
    pub cidrs: LpmTrie<MapData, [u8; 4], CidrValue>,
    pub nat_fwd: HashMap<MapData, FlowKey, NatEntry>,
    pub nat_rev: HashMap<MapData, FlowKey, NatEntry>,
    pub counters: PerCpuArray<MapData, u64>,
    /// Local pods, by address (network order).
    pub endpoints: HashMap<MapData, u32, Endpoint>,
    /// ENIs and branch links, by ifindex.
    pub enis: HashMap<MapData, u32, Eni>,
    /// Flows whose packets the stack must see (kube-proxy's DNAT), a pair
    /// each (see `vpcnet_common::maps::STACK_FLOWS`).
    pub stack_flows: HashMap<MapData, FlowKey, NatEntry>,
    /// `AWS_EXTERNAL_SERVICE_CIDRS`.
    pub external_service_cidrs: LpmTrie<MapData, [u8; 4], ExternalServiceCidr>,
    /// Network policy (see `vpcnet_common::policy`): each local pod's
    /// identities, their peer prefixes, the port sets, and the connections
    /// policy let through.
    pub policy_pods: HashMap<MapData, u32, PodPolicy>,
    pub policy_cidrs: LpmTrie<MapData, [u8; 8], PortSet>,
    pub policy_ports: LpmTrie<MapData, [u8; 8], PortVerdict>,
    pub policy_flows: HashMap<MapData, FlowKey, PolicyFlow>,
    /// What policy decided for each pod under it, per CPU.
    pub policy_verdicts: PerCpuHashMap<MapData, u32, PodVerdicts>,
}

impl DatapathMaps {
    /// Takes the maps out of a loaded object.
    pub fn from_ebpf(ebpf: &mut aya::Ebpf) -> Result<Self, DatapathError> {
        Self::from_named(|name| ebpf.take_map(name).ok_or(DatapathError::MissingMap(name)))
    }

    /// Opens the maps a running (or previous) agent pinned in `pin_dir`.
    pub fn open_pinned(pin_dir: &Path) -> Result<Self, DatapathError> {
        Self::from_named(|name| {
            let map = maps::ALL
                .into_iter()
                .find(|map| map.name == name)
                .ok_or(DatapathError::MissingMap(name))?;
            let path = super::pins::pin_path(pin_dir, &map);
            MapData::from_pin(&path)
                .and_then(Map::from_map_data)
                .map_err(|source| DatapathError::OpenPinned { path, source })
        })
    }

    /// Each map by its name from `get`, in the order `from_maps` takes them.
    fn from_named(
        mut get: impl FnMut(&'static str) -> Result<Map, DatapathError>,
    ) -> Result<Self, DatapathError> {
        Self::from_maps([
            get(maps::CONFIG)?,
            get(maps::CT_TIMEOUTS)?,
            get(maps::CIDRS)?,
            get(maps::NAT_FWD)?,
            get(maps::NAT_REV)?,
            get(maps::COUNTERS)?,
            get(maps::ENDPOINTS)?,
            get(maps::ENIS)?,
            get(maps::STACK_FLOWS)?,
            get(maps::EXTERNAL_SERVICE_CIDRS)?,
            get(maps::POLICY_PODS)?,
            get(maps::POLICY_CIDRS)?,
            get(maps::POLICY_PORTS)?,
            get(maps::POLICY_FLOWS)?,
            get(maps::POLICY_VERDICTS)?,
        ])
    }

    /// From the maps in the order `from_named` gives them.
    fn from_maps(
        [
            config,
            ct_timeouts,
            cidrs,
            nat_fwd,
            nat_rev,
            counters,
            endpoints,
            enis,
            stack_flows,
            external_service_cidrs,
            policy_pods,
            policy_cidrs,
            policy_ports,
            policy_flows,
            policy_verdicts,
        ]: [Map; 15],
    ) -> Result<Self, DatapathError> {
        Ok(Self {
            config: Array::try_from(config).map_err(DatapathError::map(maps::CONFIG))?,
            ct_timeouts: Array::try_from(ct_timeouts)
                .map_err(DatapathError::map(maps::CT_TIMEOUTS))?,
            cidrs: LpmTrie::try_from(cidrs).map_err(DatapathError::map(maps::CIDRS))?,
            nat_fwd: HashMap::try_from(nat_fwd).map_err(DatapathError::map(maps::NAT_FWD))?,
            nat_rev: HashMap::try_from(nat_rev).map_err(DatapathError::map(maps::NAT_REV))?,
            counters: PerCpuArray::try_from(counters)
                .map_err(DatapathError::map(maps::COUNTERS))?,
            endpoints: HashMap::try_from(endpoints).map_err(DatapathError::map(maps::ENDPOINTS))?,
            enis: HashMap::try_from(enis).map_err(DatapathError::map(maps::ENIS))?,
            stack_flows: HashMap::try_from(stack_flows)
                .map_err(DatapathError::map(maps::STACK_FLOWS))?,
            external_service_cidrs: LpmTrie::try_from(external_service_cidrs)
                .map_err(DatapathError::map(maps::EXTERNAL_SERVICE_CIDRS))?,
            policy_pods: HashMap::try_from(policy_pods)
                .map_err(DatapathError::map(maps::POLICY_PODS))?,
            policy_cidrs: LpmTrie::try_from(policy_cidrs)
                .map_err(DatapathError::map(maps::POLICY_CIDRS))?,
            policy_ports: LpmTrie::try_from(policy_ports)
                .map_err(DatapathError::map(maps::POLICY_PORTS))?,
            policy_flows: HashMap::try_from(policy_flows)
                .map_err(DatapathError::map(maps::POLICY_FLOWS))?,
            policy_verdicts: PerCpuHashMap::try_from(policy_verdicts)
                .map_err(DatapathError::map(maps::POLICY_VERDICTS))?,
        })
    }

    /// Adds or replaces the local pod at `addr`.
    pub fn set_endpoint(
        &mut self,
        addr: Ipv4Addr,
        endpoint: &Endpoint,
    ) -> Result<(), DatapathError> {
        self.endpoints
            .insert(addr_to_raw(addr.octets()), *endpoint, 0)
            .map_err(DatapathError::map(maps::ENDPOINTS))
    }

    /// Removes the local pod at `addr` (absent: nothing to do).
    pub fn remove_endpoint(&mut self, addr: Ipv4Addr) -> Result<(), DatapathError> {
        match self.endpoints.remove(&addr_to_raw(addr.octets())) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(DatapathError::map(maps::ENDPOINTS)(e)),
        }
    }

    /// The local pod at `addr`.
    pub fn endpoint(&self, addr: Ipv4Addr) -> Result<Option<Endpoint>, DatapathError> {
        match self.endpoints.get(&addr_to_raw(addr.octets()), 0) {
            Ok(endpoint) => Ok(Some(endpoint)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(DatapathError::map(maps::ENDPOINTS)(e)),
        }
    }

    /// Every local pod, by address.
    pub fn endpoints(&self) -> Result<Vec<(Ipv4Addr, Endpoint)>, DatapathError> {
        self.endpoints
            .iter()
            .map(|entry| {
                entry
                    .map(|(addr, endpoint)| (Ipv4Addr::from(raw_to_addr(addr)), endpoint))
                    .map_err(DatapathError::map(maps::ENDPOINTS))
            })
            .collect()
    }

    /// Every ENI (and branch link), by link index.
    pub fn enis(&self) -> Result<Vec<(u32, Eni)>, DatapathError> {
        self.enis
            .iter()
            .map(|entry| entry.map_err(DatapathError::map(maps::ENIS)))
            .collect()
    }

    /// Adds or replaces the ENI (or branch link) with link index `ifindex`.
    /// The primary ENI's link also goes in the configuration, after its
    /// entry: `pod_egress` then sends SNATed packets straight out of it.
    pub fn set_eni(&mut self, ifindex: u32, eni: &Eni) -> Result<(), DatapathError> {
        self.enis
            .insert(ifindex, *eni, 0)
            .map_err(DatapathError::map(maps::ENIS))?;
        if eni.flags & ENI_PRIMARY != 0 {
            let mut config = self.config()?;
            if config.primary_ifindex != ifindex {
                config.primary_ifindex = ifindex;
                self.set_config(&config)?;
            }
        }
        Ok(())
    }

    /// Removes the entry of the ENI (or branch link) with link index
    /// `ifindex`; none is no error.
    pub fn remove_eni(&mut self, ifindex: u32) -> Result<(), DatapathError> {
        match self.enis.remove(&ifindex) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(DatapathError::map(maps::ENIS)(e)),
        }
    }

    pub fn config(&self) -> Result<Config, DatapathError> {
        only_entry(&self.config, maps::CONFIG)
    }

    /// Writes the configuration: the programs read it on the next packet.
    pub fn set_config(&mut self, config: &Config) -> Result<(), DatapathError> {
        set_only_entry(&mut self.config, maps::CONFIG, *config)
    }

    /// The flow timeouts the programs and the garbage collector use (zero
    /// fields: netfilter's defaults).
    pub fn timeouts(&self) -> Result<Timeouts, DatapathError> {
        only_entry(&self.ct_timeouts, maps::CT_TIMEOUTS)
    }

    /// Writes the flow timeouts: the programs judge the next flow by them.
    pub fn set_timeouts(&mut self, timeouts: &Timeouts) -> Result<(), DatapathError> {
        set_only_entry(&mut self.ct_timeouts, maps::CT_TIMEOUTS, *timeouts)
    }

    /// Makes the CIDR trie hold exactly `prefixes`: adds the new ones first,
    /// then removes the ones no longer wanted, so no lookup in between sees
    /// a prefix missing that is in both the old and the new set.
    pub fn set_cidrs(&mut self, prefixes: &[(Ipv4Net, CidrKind)]) -> Result<(), DatapathError> {
        let wanted: Vec<(Key<[u8; 4]>, CidrValue)> = prefixes
            .iter()
            .map(|(net, kind)| (cidr_key(*net), CidrValue { kind: *kind as u32 }))
            .collect();
        for (key, value) in &wanted {
            self.cidrs
                .insert(key, *value, 0)
                .map_err(DatapathError::map(maps::CIDRS))?;
        }
        let present: Vec<Key<[u8; 4]>> = self
            .cidrs
            .keys()
            .collect::<Result<_, _>>()
            .map_err(DatapathError::map(maps::CIDRS))?;
        for key in present {
            let keep = wanted
                .iter()
                .any(|(w, _)| w.prefix_len() == key.prefix_len() && w.data() == key.data());
            if !keep {
                self.cidrs
                    .remove(&key)
                    .map_err(DatapathError::map(maps::CIDRS))?;
            }
        }
        Ok(())
    }

    /// Makes the external service trie hold exactly `prefixes`, added
    /// before the others go (as [`Self::set_cidrs`]).
    pub fn set_external_service_cidrs(
        &mut self,
        prefixes: &[Ipv4Net],
    ) -> Result<(), DatapathError> {
        let err = |source| DatapathError::Map {
            name: maps::EXTERNAL_SERVICE_CIDRS,
            source,
        };
        let wanted: Vec<Key<[u8; 4]>> = prefixes.iter().map(|net| cidr_key(net.trunc())).collect();
        let value = ExternalServiceCidr {
            marker: EXTERNAL_SERVICE_CIDR,
        };
        for key in &wanted {
            self.external_service_cidrs
                .insert(key, value, 0)
                .map_err(err)?;
        }
        let present: Vec<Key<[u8; 4]>> = self
            .external_service_cidrs
            .keys()
            .collect::<Result<_, _>>()
            .map_err(err)?;
        for key in present {
            let keep = wanted
                .iter()
                .any(|w| w.prefix_len() == key.prefix_len() && w.data() == key.data());
            if !keep {
                self.external_service_cidrs.remove(&key).map_err(err)?;
            }
        }
        Ok(())
    }

    /// The external service trie's prefixes.
    pub fn external_service_cidrs(&self) -> Result<Vec<Ipv4Net>, DatapathError> {
        self.external_service_cidrs
            .keys()
            .map(|key| {
                key.map(|key| {
                    Ipv4Net::new(Ipv4Addr::from(key.data()), prefix_len_u8(key.prefix_len()))
                        .expect("the trie holds valid prefix lengths")
                })
            })
            .collect::<Result<_, _>>()
            .map_err(DatapathError::map(maps::EXTERNAL_SERVICE_CIDRS))
    }

    /// The prefixes in the trie.
    pub fn cidrs(&self) -> Result<Vec<(Ipv4Net, Option<CidrKind>)>, DatapathError> {
        self.cidrs
            .iter()
            .map(|item| {
                item.map(|(key, value)| {
                    let net =
                        Ipv4Net::new(Ipv4Addr::from(key.data()), prefix_len_u8(key.prefix_len()))
                            .expect("the trie holds valid prefix lengths");
                    (net, CidrKind::from_raw(value.kind))
                })
            })
            .collect::<Result<_, _>>()
            .map_err(DatapathError::map(maps::CIDRS))
    }

    /// Every counter summed over the CPUs.
    pub fn counters(&self) -> Result<Vec<(Counter, u64)>, DatapathError> {
        let len = u32::try_from(Counter::ALL.len()).expect("a few counters");
        let sums =
            batch::per_cpu_sums(&self.counters, len).map_err(DatapathError::map(maps::COUNTERS))?;
        Ok(Counter::ALL.iter().copied().zip(sums).collect())
    }

    /// One counter summed over the CPUs.
    pub fn counter(&self, counter: Counter) -> Result<u64, DatapathError> {
        self.counters
            .get(&(counter as u32), 0)
            .map(|per_cpu| per_cpu.iter().sum())
            .map_err(DatapathError::map(maps::COUNTERS))
    }
}

/// The one entry of single-entry array map `name` (the configuration, the
/// timeouts).
fn only_entry<T: aya::Pod>(
    array: &Array<MapData, T>,
    name: &'static str,
) -> Result<T, DatapathError> {
    array.get(&0, 0).map_err(DatapathError::map(name))
}

/// Writes the one entry of single-entry array map `name`.
fn set_only_entry<T: aya::Pod>(
    array: &mut Array<MapData, T>,
    name: &'static str,
    value: T,
) -> Result<(), DatapathError> {
    array.set(0, value, 0).map_err(DatapathError::map(name))
}

fn prefix_len_u8(len: u32) -> u8 {
    u8::try_from(len.min(32)).expect("at most 32")
}

fn cidr_key(net: Ipv4Net) -> Key<[u8; 4]> {
    Key::new(
        u32::from(net.prefix_len()),
        addr_to_raw(net.network().octets()).to_ne_bytes(),
    )
}
