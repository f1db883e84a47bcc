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

/// The lab's EC2 endpoint: the EC2 emulator's Query API listens here (port
/// 80, plain HTTP), on the VPC router's `lo` in `vpcnet-vpc`, as an EC2
/// interface endpoint (`PrivateLink`) sits at an address of the VPC. The node
/// reaches it through its default route (the VPC router), so the agent's
/// `AWS_ENDPOINT_URL_EC2` is `http://10.20.0.10`. 10.20.0.0/24 holds no
/// subnet of the lab.
pub const EC2_ENDPOINT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 10);
/// The instance metadata service's link-local address (IMDSv2, port 80).
/// On EC2 it is answered by the Nitro card; in the lab by the EC2 emulator,
/// on the VPC router's `lo` in `vpcnet-vpc`, reached by the node through
/// its default route. The emulator tells instances apart by the request's
/// source address (the node asks from 10.20.11.162).
pub const IMDS_ADDR: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);

/// The lab's Kubernetes API server (HTTPS, port [`KUBE_API_PORT`]), on the
/// VPC router's `lo` in `vpcnet-vpc`, as EKS's control plane is reached
/// through its cross-account ENIs at addresses of the VPC. In
/// 10.20.0.0/24 with the EC2 endpoint: no subnet of the lab.
pub const KUBE_API_ADDR: Ipv4Addr = Ipv4Addr::new(10, 20, 0, 20);
/// The API server's port.
pub const KUBE_API_PORT: u16 = 443;
/// The cluster's service CIDR. EKS picks 10.100.0.0/16 or, for a VPC in
/// 10.0.0.0/8 like the lab's, 172.20.0.0/16 unless the cluster names one;
/// the lab's cluster names 10.100.0.0/16, the CIDR its node port service
/// always had.
pub const SERVICE_CIDR: Ipv4Net = Ipv4Net::new_assert(Ipv4Addr::new(10, 100, 0, 0), 16);
/// The `kubernetes` Service's cluster IP: the service CIDR's first address.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);

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
pub const CONNMARK: u32 = vpcnet_api::vpc_cni::DEFAULT_CONNMARK;

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
    host_veth_name_with_prefix(VETH_PREFIX, k8s_namespace, pod_name)
}

/// The host-side veth name with another prefix (the VPC CNI's rule, see
/// [`vpcnet_api::pod::host_veth_name`]).
pub fn host_veth_name_with_prefix(prefix: &str, k8s_namespace: &str, pod_name: &str) -> String {
    vpcnet_api::pod::host_veth_name(prefix, k8s_namespace, pod_name)
}

/// The VPC CNI's default host veth prefix (`AWS_VPC_K8S_CNI_VETHPREFIX`).
pub const VETH_PREFIX: &str = vpcnet_api::pod::DEFAULT_VETH_PREFIX;
/// The host veth prefix of branch-ENI pods in strict mode: the VPC CNI's
/// `sgpp.BuildHostVethNamePrefix` (`pkg/sgpp/utils.go`) gives them `vlan`
/// so that neither its SNAT/connmark rules (`-i eni+`) nor Calico touch
/// them; in standard mode they keep the usual prefix.
pub const STRICT_BRANCH_VETH_PREFIX: &str = "vlan";

// ENIs. The node has eth0 (device 0, the primary ENI) and up to two
// secondary ENIs eth1 and eth2 in the same subnet. Each secondary ENI has a
// primary address of its own, below the pods' range (pods start at .20) and
// away from the node's .162: eth1 is 10.20.11.11, eth2 10.20.11.12.

/// How many ENIs the lab's node can have (eth0, eth1, eth2).
pub const MAX_ENIS: usize = 3;
/// The host part of secondary ENI N's primary address is this plus N.
const SECONDARY_ENI_HOST_BASE: u8 = 10;

/// The node's interface for ENI `device` (its device number): `eth<N>`.
pub fn eni_ifname(device: usize) -> String {
    format!("eth{device}")
}

/// The primary address of ENI `device`: 10.20.11.162 for eth0, 10.20.11.11
/// for eth1, 10.20.11.12 for eth2.
pub fn eni_primary_addr(device: usize) -> Ipv4Addr {
    if device == 0 {
        return NODE_PRIMARY_ADDR;
    }
    let host = u8::try_from(device)
        .ok()
        .and_then(|d| SECONDARY_ENI_HOST_BASE.checked_add(d))
        .filter(|h| *h < FIRST_POD_HOST)
        .expect("at most MAX_ENIS ENIs");
    let [a, b, c, _] = NODE_SUBNET.network().octets();
    Ipv4Addr::new(a, b, c, host)
}

/// The MAC of ENI `device` (fixed, locally administered; its last byte is
/// its address's host part, as for eth0).
pub fn eni_mac(device: usize) -> String {
    if device == 0 {
        return NODE_ETH0_MAC.to_owned();
    }
    format!(
        "02:ee:0a:14:0b:{:02x}",
        eni_primary_addr(device).octets()[3]
    )
}

/// The VPC router's side of ENI `device`: `n0-eth<N>`.
pub fn vpc_eni_link(device: usize) -> String {
    if device == 0 {
        return VPC_NODE_ETH0_LINK.to_owned();
    }
    format!("n0-eth{device}")
}

/// The VPC router's MAC on [`vpc_eni_link`].
pub fn vpc_eni_link_mac(device: usize) -> String {
    if device == 0 {
        return VPC_NODE_ETH0_LINK_MAC.to_owned();
    }
    format!("02:1f:0a:14:0b:{:02x}", 0x10 + device)
}

/// The route table of ENI `device` in the VPC CNI's policy routing:
/// `CalculateRouteTableId` (`pkg/networkutils/helper.go`) is device number
/// + 1 on network card 0, and the main table for the primary ENI.
pub fn eni_route_table(device: usize) -> u32 {
    vpcnet_api::vpc_cni::eni_route_table(u32::try_from(device).expect("small"))
}

/// The kernel's main route table.
pub const RT_TABLE_MAIN: u32 = vpcnet_api::vpc_cni::MAIN_TABLE;

// Branch ENIs (security groups for pods). On EKS a branch ENI is a VLAN on
// the trunk ENI, `vlan.eth.<vlan id>` with the branch ENI's MAC. Where the
// kernel has 802.1Q (the VM kernels) the lab's own branch ENIs are exactly
// that, on a trunk link [`STATIC_TRUNK_LINK`], and the VPC router's side of
// each, `n0-vlan<vlan id>`, is a VLAN on the trunk's other end; elsewhere
// (this machine's kernel has no 8021q module) each is a veth whose peer is
// `n0-vlan<vlan id>`. The k-th branch pod (in pod order) gets VLAN id k+1.
// A branch ENI has one address: its pod's (the pod keeps the address its
// index gives it).

/// The trunk link of the lab's own branch ENIs (`--branch-pods`,
/// [`crate::Lab::add_branch_eni`]), in the node, where the kernel has
/// 802.1Q. Not an `ethN` name: the EC2 emulator's attachments own those.
pub const STATIC_TRUNK_LINK: &str = "trunk0";
/// The VPC router's end of [`STATIC_TRUNK_LINK`].
pub const VPC_STATIC_TRUNK_LINK: &str = "n0-trunk0";
/// The MACs of the two ends of [`STATIC_TRUNK_LINK`].
pub const STATIC_TRUNK_MAC: &str = "02:ee:0c:00:00:01";
pub const VPC_STATIC_TRUNK_MAC: &str = "02:1f:0c:00:00:01";

/// How many branch-ENI pods a lab can have.
pub const MAX_BRANCH_PODS: usize = 16;

/// The VLAN id of the `k`-th branch pod (0-based, in pod order).
pub fn branch_vlan_id(k: usize) -> u16 {
    u16::try_from(k + 1).expect("at most MAX_BRANCH_PODS")
}

/// The node's link for a branch ENI (the VPC CNI's name).
pub fn branch_link(vlan_id: u16) -> String {
    vpcnet_api::pod::branch_link_name(vlan_id)
}

/// The VPC router's side of a branch ENI.
pub fn vpc_branch_link(vlan_id: u16) -> String {
    format!("n0-vlan{vlan_id}")
}

/// The branch ENI's MAC (the VLAN link gets it, as the VPC CNI sets it).
pub fn branch_eni_mac(vlan_id: u16) -> String {
    let [hi, lo] = vlan_id.to_be_bytes();
    format!("02:ee:0b:00:{hi:02x}:{lo:02x}")
}

/// The VPC router's MAC on [`vpc_branch_link`].
pub fn vpc_branch_link_mac(vlan_id: u16) -> String {
    let [hi, lo] = vlan_id.to_be_bytes();
    format!("02:1f:0b:00:{hi:02x}:{lo:02x}")
}

/// The VLAN route table of a branch ENI: VLAN id + 100, as the VPC CNI's
/// `SetupBranchENIPodNetwork` computes it.
pub fn branch_route_table(vlan_id: u16) -> u32 {
    vpcnet_api::vpc_cni::vlan_route_table(vlan_id)
}

// Scale filler: pods' worth of policy routing entries for addresses that
// carry no traffic, installed before the lab's own pods so that theirs sit
// last. They come from the top half of the custom-networking pod subnet
// (100.64.32.0/19), which nothing else in the lab uses.

/// How many filler pods a lab can have.
pub const MAX_FILLER_PODS: usize = 8192;

/// The address of filler pod `index` (100.64.32.0 upwards), `None` past
/// [`MAX_FILLER_PODS`].
pub fn filler_pod_addr(index: usize) -> Option<Ipv4Addr> {
    if index >= MAX_FILLER_PODS {
        return None;
    }
    let base = u32::from(Ipv4Addr::new(100, 64, 32, 0));
    Some(Ipv4Addr::from(base + u32::try_from(index).ok()?))
}

// The node port service: kube-proxy's DNAT from the node's addresses to one
// pod (externalTrafficPolicy=Local: the client address is kept).

/// The node port clients connect to on 10.20.11.162 (TCP and UDP).
pub const NODE_PORT: u16 = 30080;
/// The node port service's cluster IP (in the default service CIDR,
/// 10.100.0.0/16).
pub const NODE_PORT_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 80);

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
    fn eni_addresses_collide_with_nothing() {
        let pods: std::collections::HashSet<_> = (0..MAX_PODS).filter_map(pod_addr).collect();
        let enis: Vec<_> = (0..MAX_ENIS).map(eni_primary_addr).collect();
        assert_eq!(enis[0], NODE_PRIMARY_ADDR);
        assert_eq!(enis[1], Ipv4Addr::new(10, 20, 11, 11));
        assert_eq!(enis[2], Ipv4Addr::new(10, 20, 11, 12));
        for addr in &enis {
            assert!(NODE_SUBNET.contains(addr) && *addr != NODE_SUBNET_GW);
            assert!(!pods.contains(addr), "{addr}");
        }
        assert_eq!(eni_route_table(0), RT_TABLE_MAIN);
        assert_eq!(eni_route_table(2), 3);
        assert_eq!(vpc_eni_link(1), "n0-eth1");
        assert!(SERVICE_CIDR.contains(&NODE_PORT_CLUSTER_IP));
        assert!(SERVICE_CIDR.contains(&KUBERNETES_SERVICE_IP));
        assert!(VPC_CIDR.contains(&KUBE_API_ADDR) && KUBE_API_ADDR != EC2_ENDPOINT_ADDR);
        assert!(!NODE_SUBNET.contains(&KUBE_API_ADDR) && !PEER_SUBNET.contains(&KUBE_API_ADDR));
        let links: std::collections::HashSet<_> = (0..MAX_ENIS)
            .flat_map(|d| [eni_mac(d), vpc_eni_link_mac(d)])
            .collect();
        assert_eq!(links.len(), 2 * MAX_ENIS, "every ENI MAC is distinct");
    }

    #[test]
    fn filler_addresses_stay_in_the_custom_subnet() {
        assert_eq!(filler_pod_addr(0), Some(Ipv4Addr::new(100, 64, 32, 0)));
        let last = filler_pod_addr(MAX_FILLER_PODS - 1).unwrap();
        assert_eq!(last, Ipv4Addr::new(100, 64, 63, 255));
        assert!(CUSTOM_POD_SUBNET.contains(&last));
        assert_eq!(filler_pod_addr(MAX_FILLER_PODS), None);
    }

    #[test]
    fn branch_names_follow_the_vpc_cni() {
        assert_eq!(branch_link(branch_vlan_id(0)), "vlan.eth.1");
        assert_eq!(branch_route_table(1), 101);
        // Strict-mode branch pods' host veths: prefix "vlan", 15 characters.
        let veth = host_veth_name_with_prefix(STRICT_BRANCH_VETH_PREFIX, "default", "pod-0");
        assert_eq!(veth, "vlanc220f2ba281");
        assert!(veth.len() <= 15);
        assert!(vpc_branch_link(u16::try_from(MAX_BRANCH_PODS).unwrap()).len() <= 15);
    }

    #[test]
    fn macs_are_locally_administered_unicast() {
        for mac in [
            pod_mac(300),
            pod_host_veth_mac(7),
            NODE_ETH0_MAC.to_owned(),
            eni_mac(2),
            vpc_eni_link_mac(2),
            branch_eni_mac(3),
            vpc_branch_link_mac(3),
            STATIC_TRUNK_MAC.to_owned(),
            VPC_STATIC_TRUNK_MAC.to_owned(),
        ] {
            let first = u8::from_str_radix(&mac[..2], 16).unwrap();
            assert_eq!(first & 0b11, 0b10, "{mac}");
        }
    }
}
