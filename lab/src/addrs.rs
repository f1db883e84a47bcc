//! The lab's names and addresses. They are a contract (DESIGN.md, "The lab:
//! a node in a box"): tests, benchmarks and docs rely on them, so change
//! none of them without changing the design.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

/// Every namespace of the lab starts with this; `down` removes all of them.
pub const NS_PREFIX: &str = "vpcnet-";
/// The VPC router: subnet gateways, source/destination check, internet gateway.
pub const NS_VPC: &str = "vpcnet-vpc";
/// The Kubernetes node.
pub const NS_NODE: &str = "vpcnet-node";
/// Another instance in the VPC, in its own subnet.
pub const NS_PEER: &str = "vpcnet-peer";
/// A host on the internet, behind the internet gateway.
pub const NS_INET: &str = "vpcnet-inet";
/// A host reached the way Direct Connect or a transit gateway is.
pub const NS_ONPREM: &str = "vpcnet-onprem";

/// The namespace of pod `index`.
pub fn pod_ns(index: usize) -> String {
    format!("{NS_PREFIX}pod-{index}")
}

/// The VPC's primary CIDR.
pub const VPC_CIDR: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 20, 0, 0), 16);
/// The VPC's secondary CIDR (custom networking pod subnets live here).
pub const VPC_SECONDARY_CIDR: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(100, 64, 0, 0), 16);
/// Both VPC CIDRs, in the order the agent's `--vpc-cidrs` gets them.
pub const VPC_CIDRS: [Ipv4Net; 2] = [VPC_CIDR, VPC_SECONDARY_CIDR];
/// The custom-networking pod subnet (no ENI uses it yet).
pub const CUSTOM_POD_SUBNET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(100, 64, 0, 0), 18);

/// The node's subnet.
pub const NODE_SUBNET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 20, 11, 0), 24);
/// The node subnet's gateway, on the VPC router.
pub const NODE_SUBNET_GW: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 1);
/// The node's primary address, on `eth0` (its primary ENI).
pub const NODE_PRIMARY_ADDR: Ipv4Addr = Ipv4Addr::new(10, 20, 11, 162);
/// The node's primary interface.
pub const NODE_ETH0: &str = "eth0";
/// The primary ENI's MAC (locally administered, fixed so tests can name it).
pub const NODE_ETH0_MAC: &str = "02:ee:0a:14:0b:a2";

/// A node-local address outside the VPC, as `NodeLocal DNSCache` uses.
pub const NODE_LOCAL_DNS_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 20, 10);
/// The dummy interface that holds [`NODE_LOCAL_DNS_ADDR`].
pub const NODE_LOCAL_DNS_IFACE: &str = "nodelocaldns";

/// The peer instance's subnet.
pub const PEER_SUBNET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 20, 12, 0), 24);
/// The peer subnet's gateway, on the VPC router.
pub const PEER_SUBNET_GW: Ipv4Addr = Ipv4Addr::new(10, 20, 12, 1);
/// The peer instance's address.
pub const PEER_ADDR: Ipv4Addr = Ipv4Addr::new(10, 20, 12, 50);
/// The peer ENI's MAC.
pub const PEER_ETH0_MAC: &str = "02:ee:0a:14:0c:32";

/// The internet host's network (TEST-NET-3).
pub const INET_NET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(203, 0, 113, 0), 24);
/// The internet gateway's address on the internet side.
pub const INET_GW: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// The internet host.
pub const INET_ADDR: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The internet host's MAC.
pub const INET_ETH0_MAC: &str = "02:ee:cb:00:71:0a";

/// The on-premises network (TEST-NET-1).
pub const ONPREM_NET: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(192, 0, 2, 0), 24);
/// The Direct Connect gateway's address on the on-premises side.
pub const ONPREM_GW: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The on-premises host.
pub const ONPREM_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
/// The on-premises host's MAC.
pub const ONPREM_ETH0_MAC: &str = "02:ee:c0:00:02:0a";

/// The VPC router's side of the node's primary ENI.
pub const VPC_NODE_ETH0_LINK: &str = "n0-eth0";
/// The VPC router's MAC on [`VPC_NODE_ETH0_LINK`].
pub const VPC_NODE_ETH0_LINK_MAC: &str = "02:1f:0a:14:0b:01";
/// The VPC router's side of the peer's ENI.
pub const VPC_PEER_LINK: &str = "peer-eth0";
/// The VPC router's MAC on [`VPC_PEER_LINK`].
pub const VPC_PEER_LINK_MAC: &str = "02:1f:0a:14:0c:01";
/// The internet gateway: the VPC router's link to `inet`.
pub const VPC_IGW_LINK: &str = "igw0";
/// The VPC router's MAC on [`VPC_IGW_LINK`].
pub const VPC_IGW_LINK_MAC: &str = "02:1f:cb:00:71:01";
/// The Direct Connect link: the VPC router's link to `onprem`.
pub const VPC_DX_LINK: &str = "dx0";
/// The VPC router's MAC on [`VPC_DX_LINK`].
pub const VPC_DX_LINK_MAC: &str = "02:1f:c0:00:02:01";

/// The MTU of the VPC's links, as the VPC CNI sets it (`AWS_VPC_ENI_MTU`).
pub const VPC_MTU: u32 = 9001;
/// The MTU past the internet gateway and on the on-premises link.
pub const WAN_MTU: u32 = 1500;

/// The pods' dummy next hop (the VPC CNI's).
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The Kubernetes namespace the lab's pods are named in (for the veth name).
pub const POD_K8S_NAMESPACE: &str = "default";
/// The first pod address: pods take node-subnet addresses upwards from here,
/// as secondary IPs of `eth0`, skipping the node's primary address.
pub const FIRST_POD_HOST: u8 = 20;
/// The last usable host of the node subnet (.255 is broadcast).
pub const LAST_POD_HOST: u8 = 254;
/// How many pods fit: hosts 20..=254 of the node subnet less the primary.
pub const MAX_PODS: usize = (LAST_POD_HOST - FIRST_POD_HOST) as usize;

/// The connection mark the VPC CNI uses (`AWS_VPC_K8S_CNI_CONNMARK` default).
pub const CONNMARK: u32 = 0x80;

/// Where the agent pins its maps and links; `down` removes it.
pub const BPF_PIN_DIR: &str = "/sys/fs/bpf/vpcnet";
/// Where the lab records what it built.
pub const STATE_DIR: &str = "/run/vpcnet-lab";

/// The address of pod `index`, or `None` if it does not fit in the subnet.
pub fn pod_addr(index: usize) -> Option<Ipv4Addr> {
    let primary_host = NODE_PRIMARY_ADDR.octets()[3];
    let mut host = usize::from(FIRST_POD_HOST) + index;
    // The primary address belongs to the node: pods go around it.
    if host >= usize::from(primary_host) {
        host += 1;
    }
    let host = u8::try_from(host).ok().filter(|h| *h <= LAST_POD_HOST)?;
    let [a, b, c, _] = NODE_SUBNET.network().octets();
    Some(Ipv4Addr::new(a, b, c, host))
}

/// The MAC of pod `index`'s `eth0`.
pub fn pod_mac(index: usize) -> String {
    let [hi, lo] = u16::try_from(index).unwrap_or(u16::MAX).to_be_bytes();
    format!("02:cb:00:00:{hi:02x}:{lo:02x}")
}

/// The MAC of pod `index`'s host-side veth (the pod's gateway MAC).
pub fn pod_host_veth_mac(index: usize) -> String {
    let [hi, lo] = u16::try_from(index).unwrap_or(u16::MAX).to_be_bytes();
    format!("02:ca:00:00:{hi:02x}:{lo:02x}")
}

/// The Kubernetes name of pod `index`.
pub fn pod_name(index: usize) -> String {
    format!("pod-{index}")
}

/// The host-side veth name the VPC CNI gives a pod: `eni` followed by the
/// first 11 hex digits of sha1("<namespace>.<pod name>").
pub fn host_veth_name(k8s_namespace: &str, pod_name: &str) -> String {
    use std::fmt::Write;

    use sha1::{Digest, Sha1};
    let digest = Sha1::digest(format!("{k8s_namespace}.{pod_name}").as_bytes());
    let hex = digest.iter().fold(String::new(), |mut hex, byte| {
        let _ = write!(hex, "{byte:02x}");
        hex
    });
    format!("eni{}", &hex[..11])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_addresses_skip_the_primary_and_stop_at_the_subnet_end() {
        assert_eq!(pod_addr(0), Some(Ipv4Addr::new(10, 20, 11, 20)));
        assert_eq!(pod_addr(141), Some(Ipv4Addr::new(10, 20, 11, 161)));
        assert_eq!(pod_addr(142), Some(Ipv4Addr::new(10, 20, 11, 163)));
        assert_eq!(pod_addr(MAX_PODS - 1), Some(Ipv4Addr::new(10, 20, 11, 254)));
        assert_eq!(pod_addr(MAX_PODS), None);
        let all: std::collections::HashSet<_> = (0..MAX_PODS).filter_map(pod_addr).collect();
        assert_eq!(all.len(), MAX_PODS);
        assert!(!all.contains(&NODE_PRIMARY_ADDR));
    }

    #[test]
    fn host_veth_name_matches_the_vpc_cni() {
        // `printf default.pod-0 | sha1sum` = c220f2ba28177a355f83...
        assert_eq!(host_veth_name("default", "pod-0"), "enic220f2ba281");
        assert_eq!(host_veth_name("default", "pod-1"), "eni83dbd022cd5");
    }

    #[test]
    fn macs_are_locally_administered_unicast() {
        for mac in [pod_mac(300), pod_host_veth_mac(7), NODE_ETH0_MAC.to_owned()] {
            let first = u8::from_str_radix(&mac[..2], 16).unwrap();
            assert_eq!(first & 0b11, 0b10, "{mac}");
        }
    }
}
