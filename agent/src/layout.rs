//! Putting a node layout (ENIs, pods) into the datapath: the ENI and
//! endpoint maps, and the programs on every ENI and pod veth.

use std::{collections::HashMap, net::Ipv4Addr};

use vpcnet_api::layout::{EnforcingMode, NodeLayout};
use vpcnet_common::{
    addr_to_raw,
    endpoint::{ENDPOINT_BRANCH, ENDPOINT_STRICT, ENI_BRANCH, ENI_PRIMARY, Endpoint, Eni},
};

use crate::{
    datapath::{Datapath, DatapathError},
    netlink::{self, NetlinkError},
};

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("listing the node's interfaces")]
    Interfaces(#[source] nix::Error),
    #[error("interface {0} of the node layout does not exist")]
    NoInterface(String),
    #[error("interface {0} has no MAC address")]
    NoMac(String),
    #[error("pod {addr}: {mac:?} is not a MAC address")]
    BadMac { addr: Ipv4Addr, mac: String },
    #[error("keeping the gateway {gateway} of {interface} resolved")]
    Neighbour {
        interface: String,
        gateway: Ipv4Addr,
        #[source]
        source: NetlinkError,
    },
    #[error(transparent)]
    Datapath(#[from] DatapathError),
}

/// Asks the kernel to keep the ENI's gateway resolved (a managed neighbour
/// entry, refreshed on its own). Packets sent there with
/// `bpf_redirect_neigh` then never wait in the neighbour queue, where a
/// packet the stack had routed out of another ENI would be re-resolved
/// through its old route and leave with that ENI's MAC.
fn keep_gateway_resolved(interface: &str, gateway: Ipv4Addr) -> Result<(), LayoutError> {
    netlink::keep_gateway_resolved_blocking(interface, gateway).map_err(|source| {
        LayoutError::Neighbour {
            interface: interface.to_owned(),
            gateway,
            source,
        }
    })
}

/// A link of the node's namespace: its index and MAC.
#[derive(Clone, Copy, Debug)]
struct Link {
    ifindex: u32,
    mac: Option<[u8; 6]>,
}

/// The links of the calling thread's network namespace, by name.
fn links() -> Result<HashMap<String, Link>, LayoutError> {
    let mut links = HashMap::new();
    for ifaddr in nix::ifaddrs::getifaddrs().map_err(LayoutError::Interfaces)? {
        let Some(link) = ifaddr.address.as_ref().and_then(|a| a.as_link_addr()) else {
            continue;
        };
        links.insert(
            ifaddr.interface_name.clone(),
            Link {
                ifindex: u32::try_from(link.ifindex()).unwrap_or(0),
                mac: link.addr(),
            },
        );
    }
    Ok(links)
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// Fills the ENI and endpoint maps from `layout` and attaches the programs
/// to every ENI and pod veth. A pod's entry is in the map before its veth's
/// program runs, so its first packet is not taken for a spoofed one.
pub fn apply(datapath: &mut Datapath, layout: &NodeLayout) -> Result<(), LayoutError> {
    let links = links()?;
    let link = |name: &str| {
        links
            .get(name)
            .copied()
            .ok_or_else(|| LayoutError::NoInterface(name.to_owned()))
    };
    for eni in &layout.enis {
        let is_branch = layout
            .endpoints
            .iter()
            .any(|ep| ep.eni == eni.interface && ep.enforcing_mode.is_some());
        let mut flags = 0;
        if eni.primary {
            flags |= ENI_PRIMARY;
        }
        if is_branch {
            flags |= ENI_BRANCH;
        }
        let entry = Eni {
            gateway: addr_to_raw(eni.gateway.octets()),
            flags,
        };
        datapath
            .maps
            .set_eni(link(&eni.interface)?.ifindex, &entry)?;
        keep_gateway_resolved(&eni.interface, eni.gateway)?;
        datapath.attach_eni(&eni.interface)?;
    }
    for ep in &layout.endpoints {
        let veth = link(&ep.host_veth)?;
        let mac = parse_mac(&ep.mac).ok_or_else(|| LayoutError::BadMac {
            addr: ep.addr,
            mac: ep.mac.clone(),
        })?;
        let flags = match ep.enforcing_mode {
            None => 0,
            Some(EnforcingMode::Standard) => ENDPOINT_BRANCH,
            Some(EnforcingMode::Strict) => ENDPOINT_BRANCH | ENDPOINT_STRICT,
        };
        let entry = Endpoint {
            ifindex: veth.ifindex,
            eni_ifindex: link(&ep.eni)?.ifindex,
            mac,
            host_mac: veth
                .mac
                .ok_or_else(|| LayoutError::NoMac(ep.host_veth.clone()))?,
            flags,
        };
        datapath.maps.set_endpoint(ep.addr, &entry)?;
        datapath.attach_pod(&ep.host_veth)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse_strictly() {
        assert_eq!(
            parse_mac("02:ee:0a:14:0b:A2"),
            Some([2, 0xee, 10, 20, 11, 0xa2])
        );
        assert_eq!(parse_mac("02:ee:0a:14:0b"), None);
        assert_eq!(parse_mac("02:ee:0a:14:0b:a2:00"), None);
        assert_eq!(parse_mac("zz:ee:0a:14:0b:a2"), None);
    }
}
