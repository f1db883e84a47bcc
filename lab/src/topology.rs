//! Building the lab's namespaces, links and addresses.
//!
//! Every veth pair is created inside a lab namespace with its peer placed
//! straight into another one; nothing is ever created in, or moved through,
//! the caller's namespace.

use std::{net::Ipv4Addr, time::Duration};

use ipnet::Ipv4Net;
use tracing::{info, warn};
use vpcnet_api::iptables::{IptablesBackend, KUBELET_CHAINS, KUBELET_CHAINS_TABLE};

use crate::{
    addrs::{
        INET_ADDR, INET_ETH0_MAC, INET_GW, INET_NET, NODE_ETH0, NODE_ETH0_MAC, NODE_LOCAL_DNS_ADDR,
        NODE_LOCAL_DNS_IFACE, NODE_PRIMARY_ADDR, NODE_SUBNET, NODE_SUBNET_GW, NS_INET, NS_NODE,
        NS_ONPREM, NS_PEER, NS_VPC, ONPREM_ADDR, ONPREM_ETH0_MAC, ONPREM_GW, ONPREM_NET, PEER_ADDR,
        PEER_ETH0_MAC, PEER_SUBNET, PEER_SUBNET_GW, POD_GATEWAY, STATIC_TRUNK_LINK,
        STATIC_TRUNK_MAC, VPC_CIDRS, VPC_DX_LINK, VPC_DX_LINK_MAC, VPC_IGW_LINK, VPC_IGW_LINK_MAC,
        VPC_MTU, VPC_NODE_ETH0_LINK, VPC_NODE_ETH0_LINK_MAC, VPC_PEER_LINK, VPC_PEER_LINK_MAC,
        VPC_STATIC_TRUNK_LINK, VPC_STATIC_TRUNK_MAC, WAN_MTU, eni_ifname, eni_mac,
        eni_primary_addr, vpc_eni_link, vpc_eni_link_mac,
    },
    error::Result,
    netlink::wait_links_up,
    netns::{exec_ok, ip_batch, set_sysctls},
    options::{Datapath, LabOptions},
    router::{self, Assignments},
    state::{BranchEni, PodInfo},
    vpc_cni,
};

/// How long links may take to come up once created.
const LINKS_UP_TIMEOUT: Duration = Duration::from_secs(20);

/// A host with one interface `eth0` on a link to the VPC router.
struct Host {
    ns: &'static str,
    mac: &'static str,
    addr: Ipv4Addr,
    subnet: Ipv4Net,
    gateway: Ipv4Addr,
    mtu: u32,
    /// The router's side of the link.
    router_link: &'static str,
    router_mac: &'static str,
    /// Whether the router's side is an ENI (AWS checks its sources) rather
    /// than a gateway to outside the VPC.
    is_eni: bool,
}

const HOSTS: [Host; 4] = [
    Host {
        ns: NS_NODE,
        mac: NODE_ETH0_MAC,
        addr: NODE_PRIMARY_ADDR,
        subnet: NODE_SUBNET,
        gateway: NODE_SUBNET_GW,
        mtu: VPC_MTU,
        router_link: VPC_NODE_ETH0_LINK,
        router_mac: VPC_NODE_ETH0_LINK_MAC,
        is_eni: true,
    },
    Host {
        ns: NS_PEER,
        mac: PEER_ETH0_MAC,
        addr: PEER_ADDR,
        subnet: PEER_SUBNET,
        gateway: PEER_SUBNET_GW,
        mtu: VPC_MTU,
        router_link: VPC_PEER_LINK,
        router_mac: VPC_PEER_LINK_MAC,
        is_eni: true,
    },
    Host {
        ns: NS_INET,
        mac: INET_ETH0_MAC,
        addr: INET_ADDR,
        subnet: INET_NET,
        gateway: INET_GW,
        mtu: WAN_MTU,
        router_link: VPC_IGW_LINK,
        router_mac: VPC_IGW_LINK_MAC,
        is_eni: false,
    },
    Host {
        ns: NS_ONPREM,
        mac: ONPREM_ETH0_MAC,
        addr: ONPREM_ADDR,
        subnet: ONPREM_NET,
        gateway: ONPREM_GW,
        mtu: WAN_MTU,
        router_link: VPC_DX_LINK,
        router_mac: VPC_DX_LINK_MAC,
        is_eni: false,
    },
];

/// Every namespace of a lab with `pods` pods.
pub fn namespaces(pods: &[PodInfo]) -> Vec<String> {
    [NS_VPC, NS_NODE, NS_PEER, NS_INET, NS_ONPREM]
        .into_iter()
        .map(str::to_owned)
        .chain(pods.iter().map(|pod| pod.netns.clone()))
        .collect()
}

/// Settings every lab namespace gets before its links exist (a device takes
/// the `default` values when it is created).
fn base_sysctls(ns: &str) -> Result<()> {
    // IPv4 only: no router solicitations, DAD or MLD reports on the links,
    // so counters and captures show only what tests send.
    set_sysctls(
        ns,
        &[
            ("net.ipv6.conf.all.disable_ipv6", "1"),
            ("net.ipv6.conf.default.disable_ipv6", "1"),
        ],
    )
}

/// Builds everything but the pods: router, node, peer, internet, on-prem.
pub fn build_network(opts: &LabOptions) -> Result<()> {
    for ns in [NS_VPC, NS_NODE, NS_PEER, NS_INET, NS_ONPREM] {
        base_sysctls(ns)?;
    }
    // The router forwards and never redirects: in AWS the VPC router is the
    // next hop for everything, even within a subnet.
    // Nor does it filter by reverse path: AWS's check is the
    // source/destination check, which the router does itself, and a host
    // default inherited from the machine (IPv4 settings of a new namespace
    // are copied from the initial one) must not make it drop, say, a branch
    // ENI's ARP from the node's primary address.
    set_sysctls(
        NS_VPC,
        &[
            ("net.ipv4.ip_forward", "1"),
            ("net.ipv4.conf.all.send_redirects", "0"),
            ("net.ipv4.conf.default.send_redirects", "0"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ],
    )?;

    for host in &HOSTS {
        let lines = vec![
            "link set lo up".to_owned(),
            format!(
                "link add eth0 address {} mtu {} type veth peer name {} address {} mtu {} netns {NS_VPC}",
                host.mac, host.mtu, host.router_link, host.router_mac, host.mtu
            ),
            format!(
                "addr add {}/{} dev eth0",
                host.addr,
                host.subnet.prefix_len()
            ),
            "link set eth0 up".to_owned(),
            format!("route add default via {} dev eth0", host.gateway),
        ];
        ip_batch(Some(host.ns), &lines)?;
    }
    add_node_local_dns()?;

    // The node as aws-node's init container leaves it: forwarding on, loose
    // reverse-path filtering on the primary ENI (pods' replies come in on
    // eth0 for addresses routed out of veths).
    set_sysctls(
        NS_NODE,
        &[
            ("net.ipv4.ip_forward", "1"),
            (&format!("net.ipv4.conf.{NODE_ETH0}.rp_filter"), "2"),
        ],
    )?;

    build_router()?;
    build_secondary_enis(opts.enis)?;
    add_kubelet_chains(opts.iptables_backend)?;
    if opts.datapath == Datapath::Iptables {
        vpc_cni::wire_node(opts)?;
    }
    Ok(())
}

/// kubelet's chains, as it creates them at start in its backend's mangle
/// table: what tells the node's iptables backend.
fn add_kubelet_chains(backend: IptablesBackend) -> Result<()> {
    for chain in KUBELET_CHAINS {
        exec_ok(
            NS_NODE,
            &[
                backend.iptables(),
                "-w",
                "-t",
                KUBELET_CHAINS_TABLE,
                "-N",
                chain,
            ],
        )?;
    }
    Ok(())
}

/// A link of the VPC router to one ENI of the node: the router side of an
/// ENI (`n0-eth1`) or of a branch ENI (`n0-vlan1`).
struct EniLink {
    vpc_link: String,
    /// The ENI's MAC: the router delivers the ENI's addresses to it.
    mac: String,
    addrs: Vec<Ipv4Addr>,
}

/// The router's side of ENI links, as for `eth0`: the subnet gateway as a
/// /32 (no connected route), up, proxy ARP, the source/destination check,
/// and delivery of the ENI's addresses to its MAC.
fn add_router_eni_links(links: &[EniLink]) -> Result<()> {
    if links.is_empty() {
        return Ok(());
    }
    let mut addr_lines = Vec::new();
    for link in links {
        addr_lines.push(format!(
            "addr add {NODE_SUBNET_GW}/32 dev {}",
            link.vpc_link
        ));
        addr_lines.push(format!("link set {} up", link.vpc_link));
    }
    ip_batch(Some(NS_VPC), &addr_lines)?;
    let proxy_arp: Vec<String> = links
        .iter()
        .map(|link| format!("net.ipv4.conf.{}.proxy_arp", link.vpc_link))
        .collect();
    let proxy_arp: Vec<(&str, &str)> = proxy_arp.iter().map(|key| (key.as_str(), "1")).collect();
    set_sysctls(NS_VPC, &proxy_arp)?;
    let names: Vec<&str> = links.iter().map(|link| link.vpc_link.as_str()).collect();
    router::add_eni_links(&names)?;
    let mut assignments = Assignments::default();
    for link in links {
        assignments.add(&link.vpc_link, &link.mac, &link.addrs);
    }
    assignments.apply()
}

/// The secondary ENIs `eth1`... as the cloud attaches them and ipamd sets
/// them up (`setupENINetwork`) outside policy routing, for both datapaths:
/// the ENI's MAC and MTU, up, its primary address with the subnet's prefix,
/// and the subnet route that address brings into `main` removed (the node's
/// own traffic to the subnet keeps leaving by `eth0`). The ENI's route table
/// and rule are the iptables datapath's (`vpc_cni::eni_table_lines`).
fn build_secondary_enis(enis: usize) -> Result<()> {
    let mut node_lines = Vec::new();
    let mut links = Vec::new();
    for device in 1..enis {
        let ifname = eni_ifname(device);
        let addr = eni_primary_addr(device);
        let vpc_link = vpc_eni_link(device);
        let prefix = NODE_SUBNET.prefix_len();
        node_lines.extend([
            format!(
                "link add {ifname} address {mac} mtu {VPC_MTU} type veth peer name {vpc_link} address {vpc_mac} mtu {VPC_MTU} netns {NS_VPC}",
                mac = eni_mac(device),
                vpc_mac = vpc_eni_link_mac(device),
            ),
            format!("link set {ifname} up"),
            format!("addr add {addr}/{prefix} dev {ifname}"),
            format!("route del {NODE_SUBNET} dev {ifname} src {addr} scope link table main"),
        ]);
        links.push(EniLink {
            vpc_link,
            mac: eni_mac(device),
            addrs: vec![addr],
        });
    }
    ip_batch(Some(NS_NODE), &node_lines)?;
    add_router_eni_links(&links)
}

/// The branch ENIs of `pods` (security groups for pods). On EKS each is a
/// VLAN link `vlan.eth.<id>` on the trunk ENI with the branch ENI's MAC,
/// made up without an address (`setupVlan`); so here where the kernel has
/// 802.1Q, else a veth to the router (see [`crate::addrs::branch_link`]).
/// The router delivers the pod's address to it and checks sources against
/// it. The VLAN route table is the iptables datapath's
/// (`vpc_cni::pod_lines`).
pub fn build_branch_enis(pods: &[PodInfo]) -> Result<()> {
    let branches: Vec<(&BranchEni, Ipv4Addr)> = pods
        .iter()
        .filter_map(|pod| pod.branch.as_ref().map(|branch| (branch, pod.addr)))
        .collect();
    build_branch_links(&branches)
}

/// Branch ENIs, each with the one address it delivers.
pub fn build_branch_links(branches: &[(&BranchEni, Ipv4Addr)]) -> Result<()> {
    if branches.is_empty() {
        return Ok(());
    }
    let vlans = kernel_has_vlans();
    if vlans {
        ensure_static_trunk()?;
    }
    let mut node_lines = Vec::new();
    let mut vpc_lines = Vec::new();
    let mut links = Vec::new();
    for (branch, addr) in branches {
        let vpc_mac = crate::addrs::vpc_branch_link_mac(branch.vlan_id);
        if vlans {
            node_lines.push(vlan_link_line(
                STATIC_TRUNK_LINK,
                &branch.link,
                &branch.mac,
                branch.vlan_id,
            ));
            vpc_lines.push(vlan_link_line(
                VPC_STATIC_TRUNK_LINK,
                &branch.vpc_link,
                &vpc_mac,
                branch.vlan_id,
            ));
        } else {
            node_lines.push(format!(
                "link add {link} address {mac} mtu {VPC_MTU} type veth peer name {vpc_link} address {vpc_mac} mtu {VPC_MTU} netns {NS_VPC}",
                link = branch.link,
                mac = branch.mac,
                vpc_link = branch.vpc_link,
            ));
        }
        node_lines.push(format!("link set {} up", branch.link));
        links.push(EniLink {
            vpc_link: branch.vpc_link.clone(),
            mac: branch.mac.clone(),
            addrs: vec![*addr],
        });
    }
    ip_batch(Some(NS_NODE), &node_lines)?;
    ip_batch(Some(NS_VPC), &vpc_lines)?;
    add_router_eni_links(&links)
}

/// `ip` batch line: an 802.1Q link `name` with `mac` and VLAN id `vlan_id`
/// on `parent`. Its MTU is the parent's, as the VPC CNI leaves it.
pub fn vlan_link_line(parent: &str, name: &str, mac: &str, vlan_id: u16) -> String {
    format!(
        "link add link {parent} name {name} address {mac} type vlan protocol 802.1Q id {vlan_id}"
    )
}

/// The trunk of the lab's own branch ENIs, once: a link from the node to
/// the router, up at both ends, carrying nothing but VLANs.
fn ensure_static_trunk() -> Result<()> {
    if crate::netlink::link_exists(NS_NODE, STATIC_TRUNK_LINK)? {
        return Ok(());
    }
    ip_batch(
        Some(NS_NODE),
        &[
            format!(
                "link add {STATIC_TRUNK_LINK} address {STATIC_TRUNK_MAC} mtu {VPC_MTU} type veth peer name {VPC_STATIC_TRUNK_LINK} address {VPC_STATIC_TRUNK_MAC} mtu {VPC_MTU} netns {NS_VPC}"
            ),
            format!("link set {STATIC_TRUNK_LINK} up"),
        ],
    )?;
    ip_batch(
        Some(NS_VPC),
        &[format!("link set {VPC_STATIC_TRUNK_LINK} up")],
    )
}

/// Whether this kernel makes 802.1Q links (its `8021q` module loads on
/// demand): tried once, in the router's namespace, on a veth made for it.
pub fn kernel_has_vlans() -> bool {
    static HAS_VLANS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS_VLANS.get_or_init(|| {
        // Names of this process's own: the lab and its EC2 emulator each ask.
        let (veth, peer) = (
            format!("vlp{}a", std::process::id()),
            format!("vlp{}b", std::process::id()),
        );
        let probe = ip_batch(
            Some(NS_VPC),
            &[
                format!("link add {veth} type veth peer name {peer}"),
                vlan_link_line(&veth, &format!("{veth}.1"), "02:00:00:00:00:01", 1),
            ],
        );
        if let Err(err) = ip_batch(Some(NS_VPC), &[format!("link del {veth}")]) {
            warn!(%err, "removing the 802.1Q probe's veth");
        }
        match probe {
            Ok(()) => true,
            Err(err) => {
                info!(%err, "no 802.1Q links in this kernel: branch ENIs are veths");
                false
            }
        }
    })
}

/// `NodeLocal DNSCache`'s address: node-local, outside the VPC, on a dummy
/// interface as `NodeLocal DNSCache` makes it. Kernels built without dummy
/// devices get an ifb device instead: also a link of its own that never
/// carries traffic, so the address behaves the same (local delivery).
fn add_node_local_dns() -> Result<()> {
    let address = [
        format!("addr add {NODE_LOCAL_DNS_ADDR}/32 dev {NODE_LOCAL_DNS_IFACE}"),
        format!("link set {NODE_LOCAL_DNS_IFACE} up"),
    ];
    let dummy = ip_batch(
        Some(NS_NODE),
        &[format!("link add {NODE_LOCAL_DNS_IFACE} type dummy")],
    );
    if let Err(err) = dummy {
        warn!(%err, "no dummy devices in this kernel; {NODE_LOCAL_DNS_IFACE} is an ifb device");
        ip_batch(
            Some(NS_NODE),
            &[format!("link add {NODE_LOCAL_DNS_IFACE} type ifb")],
        )?;
    }
    ip_batch(Some(NS_NODE), &address)
}

fn build_router() -> Result<()> {
    let mut lines = vec!["link set lo up".to_owned()];
    for host in &HOSTS {
        let link = host.router_link;
        if host.is_eni {
            // The gateway address alone (/32): no connected route, so the
            // router reaches instances only through their assigned addresses.
            lines.push(format!("addr add {}/32 dev {link}", host.gateway));
        } else {
            lines.push(format!(
                "addr add {}/{} dev {link}",
                host.gateway,
                host.subnet.prefix_len()
            ));
        }
        lines.push(format!("link set {link} up"));
    }
    for cidr in VPC_CIDRS {
        // Addresses nobody owns go nowhere, as in AWS.
        lines.push(format!("route add blackhole {cidr}"));
    }
    // The VPC route table's 0.0.0.0/0 -> igw. `inet` stands for the whole
    // internet and forwards nothing, so nothing leaves the lab.
    lines.push(format!(
        "route add default via {INET_ADDR} dev {VPC_IGW_LINK}"
    ));
    ip_batch(Some(NS_VPC), &lines)?;

    // Proxy ARP on ENI links: an instance that ARPs for another address of
    // its subnet gets the router's MAC (in AWS the VPC answers every ARP).
    let proxy_arp: Vec<(String, &str)> = HOSTS
        .iter()
        .filter(|host| host.is_eni)
        .map(|host| (format!("net.ipv4.conf.{}.proxy_arp", host.router_link), "1"))
        .collect();
    let proxy_arp: Vec<(&str, &str)> = proxy_arp.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    set_sysctls(NS_VPC, &proxy_arp)?;

    router::nft_apply(&router::base_ruleset())?;
    let eni_links: Vec<&str> = HOSTS
        .iter()
        .filter(|host| host.is_eni)
        .map(|host| host.router_link)
        .collect();
    router::add_eni_links(&eni_links)?;
    let mut assignments = Assignments::default();
    for host in HOSTS.iter().filter(|host| host.is_eni) {
        assignments.add(host.router_link, host.mac, &[host.addr]);
    }
    assignments.apply()?;
    router::add_igw_addresses(&[NODE_PRIMARY_ADDR])
}

/// Wires `pods` the way the VPC CNI plugin wires them, and tells the router
/// which ENI (or branch ENI) owns each address.
pub fn wire_pods(pods: &[PodInfo], datapath: Datapath) -> Result<()> {
    let mut node_lines = Vec::new();
    let mut router_assignments = Assignments::default();
    for pod in pods {
        base_sysctls(&pod.netns)?;
        // The pod side, created in the pod with its peer put straight into
        // the node (as the plugin does), then addressed like the plugin:
        // a /32, a link route to the dummy gateway, a default route through
        // it, and a permanent neighbour so the pod never ARPs for it.
        ip_batch(
            Some(&pod.netns),
            &[
                "link set lo up".to_owned(),
                format!(
                    "link add {ifname} address {mac} mtu {VPC_MTU} type veth peer name {host} address {host_mac} mtu {VPC_MTU} netns {NS_NODE}",
                    ifname = pod.ifname,
                    mac = pod.mac,
                    host = pod.host_veth,
                    host_mac = pod.host_veth_mac,
                ),
                format!("link set {} up", pod.ifname),
                format!("route replace {POD_GATEWAY} dev {} scope link", pod.ifname),
                format!("route add default via {POD_GATEWAY} dev {}", pod.ifname),
                format!("addr add {}/32 dev {}", pod.addr, pod.ifname),
                format!(
                    "neigh add {POD_GATEWAY} lladdr {} dev {} nud permanent",
                    pod.host_veth_mac, pod.ifname
                ),
            ],
        )?;
        node_lines.push(format!("link set {} up", pod.host_veth));
        match datapath {
            // The plugin's routes and rules, policy routing included.
            Datapath::Iptables => node_lines.extend(vpc_cni::pod_lines(pod)),
            // No policy routing: the route to the pod in `main` (for what
            // goes through the stack, e.g. after kube-proxy's DNAT) and
            // nothing else; the agent (if any) does the rest.
            Datapath::Ebpf | Datapath::Routed => node_lines.push(format!(
                "route replace {}/32 dev {} scope link",
                pod.addr, pod.host_veth
            )),
        }
        router_assignments.add(&pod.vpc_link(), &pod.eni_mac(), &[pod.addr]);
    }
    ip_batch(Some(NS_NODE), &node_lines)?;
    router_assignments.apply()?;
    if datapath == Datapath::Routed {
        let addrs: Vec<Ipv4Addr> = pods.iter().map(|pod| pod.addr).collect();
        router::add_igw_addresses(&addrs)?;
    }
    Ok(())
}

/// Waits until every veth of the lab is up (see [`crate::netlink`]).
pub fn wait_ready(pods: &[PodInfo], enis: usize) -> Result<()> {
    let branches = || pods.iter().filter_map(|pod| pod.branch.as_ref());
    let router_links: Vec<String> = HOSTS
        .iter()
        .map(|host| host.router_link.to_owned())
        .chain((1..enis).map(vpc_eni_link))
        .chain(branches().map(|branch| branch.vpc_link.clone()))
        .collect();
    wait_links_up(NS_VPC, &router_links, LINKS_UP_TIMEOUT)?;
    for host in &HOSTS {
        wait_links_up(host.ns, &["eth0".to_owned()], LINKS_UP_TIMEOUT)?;
    }
    let node_links: Vec<String> = (1..enis)
        .map(eni_ifname)
        .chain(branches().map(|branch| branch.link.clone()))
        .collect();
    wait_links_up(NS_NODE, &node_links, LINKS_UP_TIMEOUT)?;
    let host_veths: Vec<String> = pods.iter().map(|pod| pod.host_veth.clone()).collect();
    wait_links_up(NS_NODE, &host_veths, LINKS_UP_TIMEOUT)?;
    for pod in pods {
        wait_links_up(
            &pod.netns,
            std::slice::from_ref(&pod.ifname),
            LINKS_UP_TIMEOUT,
        )?;
    }
    Ok(())
}
