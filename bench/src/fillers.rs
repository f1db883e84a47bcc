//! Scale for the eBPF datapath: pods' worth of endpoint entries in the
//! running agent's pinned map, the counterpart of the iptables lab's filler
//! pods (`LabOptions::filler_pods`, their ip rules 512 and 1536).
//!
//! The entries are for the custom-networking subnet's top half
//! ([`addrs::filler_pod_addr`]), which nothing in the lab uses, on
//! interfaces that exist nowhere, so nothing is ever routed to them.

use std::{net::Ipv4Addr, path::Path};

use anyhow::{Context, Result, bail};
use vpcnet_agent::datapath::DatapathMaps;
use vpcnet_common::{addr_to_raw, cidr::CidrKind, endpoint::Endpoint};
use vpcnet_lab::addrs;

/// Endpoint entries put into the agent's map, taken out again when
/// dropped (also when a run fails; the lab's teardown removes the pins
/// anyway).
pub struct FillerEndpoints {
    maps: DatapathMaps,
    addrs: Vec<Ipv4Addr>,
}

impl FillerEndpoints {
    /// Interface indexes no link has.
    const FIRST_FAKE_IFINDEX: u32 = 0x4000_0000;

    /// Puts `count` filler endpoints into the map pinned in the lab's pin
    /// directory.
    pub fn insert(count: usize) -> Result<Self> {
        let pins = Path::new(addrs::BPF_PIN_DIR);
        let maps = DatapathMaps::open_pinned(pins)
            .with_context(|| format!("opening the agent's maps in {}", pins.display()))?;
        let mut fillers = Self {
            maps,
            addrs: Vec::with_capacity(count),
        };
        for index in 0..count {
            let addr = addrs::filler_pod_addr(index)
                .with_context(|| format!("filler {index}: the lab has no address for it"))?;
            let key = addr_to_raw(addr.octets());
            if fillers.maps.endpoints.get(&key, 0).is_ok() {
                bail!("{addr} is already an endpoint");
            }
            let ifindex = Self::FIRST_FAKE_IFINDEX + u32::try_from(index)?;
            let [a, b] = u16::try_from(index)?.to_be_bytes();
            let endpoint = Endpoint {
                ifindex,
                eni_ifindex: ifindex,
                mac: [0x02, 0xfe, 0, 0, a, b],
                host_mac: [0x02, 0xfd, 0, 0, a, b],
                flags: 0,
            };
            fillers
                .maps
                .set_endpoint(addr, &endpoint)
                .with_context(|| format!("endpoint {addr}"))?;
            fillers.addrs.push(addr);
        }
        Ok(fillers)
    }

    /// Writes `addr`'s entry again, after every filler: the entry a lookup
    /// of a hash map finds last, where the rules of an ip rule list would
    /// come last.
    pub fn rewrite_last(&mut self, addr: Ipv4Addr) -> Result<()> {
        let key = addr_to_raw(addr.octets());
        let endpoint = self
            .maps
            .endpoints
            .get(&key, 0)
            .with_context(|| format!("{addr} is not an endpoint"))?;
        self.maps.endpoints.remove(&key).context("removing it")?;
        self.maps
            .set_endpoint(addr, &endpoint)
            .context("putting it back")?;
        Ok(())
    }

    /// Entries in the endpoint map, the fillers' and the pods'.
    pub fn count(&self) -> Result<usize> {
        Ok(self
            .maps
            .endpoints
            .keys()
            .collect::<Result<Vec<_>, _>>()
            .context("reading the endpoint map")?
            .len())
    }

    /// Excluded CIDRs in the CIDR trie.
    pub fn exclusions(&self) -> Result<usize> {
        let cidrs = self.maps.cidrs().context("reading the CIDR trie")?;
        Ok(cidrs
            .iter()
            .filter(|(_, kind)| *kind == Some(CidrKind::Excluded))
            .count())
    }

    /// Takes the fillers out of the map again; returns the entries left.
    pub fn remove(mut self) -> Result<usize> {
        for addr in std::mem::take(&mut self.addrs) {
            self.maps
                .endpoints
                .remove(&addr_to_raw(addr.octets()))
                .with_context(|| format!("removing the endpoint {addr}"))?;
        }
        self.count()
    }
}

impl Drop for FillerEndpoints {
    fn drop(&mut self) {
        for addr in &self.addrs {
            let _ = self.maps.endpoints.remove(&addr_to_raw(addr.octets()));
        }
    }
}
