//! CHECK: the attachment is still what ADD made of it. Compared, in this
//! order, and the first difference reported (105): the agent's record (the
//! address of `prevResult`, no problem in its datapath entry), the host veth
//! (there, up), the node's route to the pod, the pod's interface (there, up,
//! its MAC if `prevResult` has one, exactly the `prevResult` address), its
//! two routes, and the permanent neighbour entry for the gateway with the
//! host veth's MAC. Routes and neighbours others added are allowed.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use vpcnet_api::cni::CheckNetworkReply;
use vpcnet_netlink::{
    MacAddr, NetlinkHandle,
    pod::{NeighbourInfo, POD_GATEWAY, PodNetError, RouteInfo},
    veth::LinkDetails,
};

use crate::{
    error::{self, CniError, code},
    plugin::{Ctx, netns_error},
    result::{CniResult, version_at_least},
};

/// `ip route`'s scope number of link-scoped routes.
const SCOPE_LINK: u8 = 253;

/// What the attachment should be, from `prevResult`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expected {
    pub addr: Ipv4Addr,
    pub host_veth: String,
    pub ifname: String,
    /// The pod interface's MAC in `prevResult`, if it has one.
    pub pod_mac: Option<String>,
}

/// The pod's side as found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodState {
    pub link: LinkDetails,
    pub addrs: Vec<Ipv4Net>,
    pub routes: Vec<RouteInfo>,
    pub neighbours: Vec<NeighbourInfo>,
}

/// What there is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub record: CheckNetworkReply,
    pub host: Option<LinkDetails>,
    pub node_routes: Vec<RouteInfo>,
    pub pod: Option<PodState>,
}

fn differs(msg: String) -> CniError {
    CniError::new(code::CHECK_FAILED, msg, "")
}

/// What `prevResult` says ADD made, or why it cannot say.
pub fn expected(ctx: &Ctx, prev: &CniResult) -> Result<Expected, CniError> {
    let ifname = &ctx.env.ifname;
    let (index, iface) = prev.sandbox_interface(ifname).ok_or_else(|| {
        differs(format!(
            "prevResult has no interface {ifname} in a container"
        ))
    })?;
    if iface.sandbox != ctx.env.netns {
        return Err(differs(format!(
            "prevResult has {ifname} in {}, CNI_NETNS is {}",
            iface.sandbox, ctx.env.netns
        )));
    }
    let addrs = prev.ipv4_of(index);
    let [ip] = addrs.as_slice() else {
        return Err(differs(format!(
            "prevResult gives {ifname} {} IPv4 addresses, vpcnet-cni gives one",
            addrs.len()
        )));
    };
    let addr = match ip.address {
        ipnet::IpNet::V4(net) if net.prefix_len() == 32 => net.addr(),
        other => {
            return Err(differs(format!(
                "prevResult gives {ifname} {other}, vpcnet-cni gives a /32"
            )));
        }
    };
    Ok(Expected {
        addr,
        host_veth: prev
            .host_interface()
            .map_or_else(|| ctx.host_veth_name(), |iface| iface.name.clone()),
        ifname: ifname.clone(),
        pod_mac: (!iface.mac.is_empty()).then(|| iface.mac.clone()),
    })
}

/// The first difference between `expected` and `observed`.
pub fn compare(expected: &Expected, observed: &Observed) -> Result<(), CniError> {
    compare_record(expected, &observed.record)?;
    let host_mac = compare_node(expected, observed)?;
    compare_pod(expected, observed.pod.as_ref(), host_mac)
}

/// The agent's record against `prevResult`.
fn compare_record(expected: &Expected, record: &CheckNetworkReply) -> Result<(), CniError> {
    let Expected {
        addr, host_veth, ..
    } = expected;
    if record.ipv4_addr.is_empty() {
        return Err(differs(format!(
            "the vpcnet agent holds no address for the attachment (prevResult has {addr})"
        )));
    }
    if record.ipv4_addr != addr.to_string() {
        return Err(differs(format!(
            "the vpcnet agent holds {} for the attachment, prevResult has {addr}",
            record.ipv4_addr
        )));
    }
    if !record.problem.is_empty() {
        return Err(differs(format!(
            "the vpcnet agent reports: {}",
            record.problem
        )));
    }
    if !record.host_veth.is_empty() && record.host_veth != *host_veth {
        return Err(differs(format!(
            "the vpcnet agent's datapath entry is on {}, not on {host_veth}",
            record.host_veth
        )));
    }
    Ok(())
}

/// The node's side: the host veth and the route to the pod. Returns the
/// host veth's MAC.
fn compare_node(expected: &Expected, observed: &Observed) -> Result<MacAddr, CniError> {
    let Expected {
        addr, host_veth, ..
    } = expected;
    let Some(host) = &observed.host else {
        return Err(differs(format!("the host veth {host_veth} does not exist")));
    };
    if !host.link.up {
        return Err(differs(format!("the host veth {host_veth} is down")));
    }
    let pod_net = Ipv4Net::new(*addr, 32).expect("32 is a valid IPv4 prefix length");
    if !observed.node_routes.iter().any(|route| {
        route.dst == pod_net && route.oif == Some(host.link.index) && route.scope == SCOPE_LINK
    }) {
        return Err(differs(format!(
            "the node has no route {pod_net} dev {host_veth} scope link"
        )));
    }
    host.link
        .mac
        .ok_or_else(|| differs(format!("the host veth {host_veth} has no MAC")))
}

/// The pod's side: its interface, address, routes and gateway neighbour.
fn compare_pod(
    expected: &Expected,
    pod: Option<&PodState>,
    host_mac: MacAddr,
) -> Result<(), CniError> {
    let Expected {
        addr,
        ifname,
        pod_mac,
        ..
    } = expected;
    let pod_net = Ipv4Net::new(*addr, 32).expect("32 is a valid IPv4 prefix length");
    let Some(pod) = pod else {
        return Err(differs(format!("the container has no interface {ifname}")));
    };
    if !pod.link.link.up {
        return Err(differs(format!("{ifname} is down in the container")));
    }
    if let Some(mac) = pod_mac {
        let actual = pod
            .link
            .link
            .mac
            .map(|mac| mac.to_string())
            .unwrap_or_default();
        if !actual.eq_ignore_ascii_case(mac) {
            return Err(differs(format!(
                "{ifname} has the MAC {actual}, prevResult has {mac}"
            )));
        }
    }
    if pod.addrs != [pod_net] {
        let found: Vec<String> = pod.addrs.iter().map(ToString::to_string).collect();
        return Err(differs(format!(
            "{ifname} has the addresses [{}], expected exactly {pod_net}",
            found.join(", ")
        )));
    }
    let gateway_net = Ipv4Net::new(POD_GATEWAY, 32).expect("a valid prefix length");
    let index = pod.link.link.index;
    if !pod.routes.iter().any(|route| {
        route.dst == gateway_net && route.oif == Some(index) && route.scope == SCOPE_LINK
    }) {
        return Err(differs(format!(
            "the container has no route {POD_GATEWAY} dev {ifname} scope link"
        )));
    }
    if !pod.routes.iter().any(|route| {
        route.dst == Ipv4Net::default()
            && route.gateway == Some(POD_GATEWAY)
            && route.oif == Some(index)
    }) {
        return Err(differs(format!(
            "the container has no route default via {POD_GATEWAY} dev {ifname}"
        )));
    }
    match pod
        .neighbours
        .iter()
        .find(|entry| entry.addr == POD_GATEWAY)
    {
        None => Err(differs(format!(
            "the container has no neighbour entry for {POD_GATEWAY} on {ifname}"
        ))),
        Some(entry) if !entry.permanent => Err(differs(format!(
            "the neighbour entry for {POD_GATEWAY} on {ifname} is not permanent"
        ))),
        Some(entry) if entry.mac != Some(host_mac) => Err(differs(format!(
            "the neighbour entry for {POD_GATEWAY} on {ifname} is {}, the host veth's MAC is {host_mac}",
            entry.mac.map(|mac| mac.to_string()).unwrap_or_default()
        ))),
        Some(_) => Ok(()),
    }
}

pub async fn check(ctx: &Ctx) -> Result<(), CniError> {
    if !version_at_least(&ctx.conf.cni_version, "0.4.0") {
        return Err(CniError::new(
            code::INCOMPATIBLE_VERSION,
            "config version does not allow CHECK",
            format!(
                "cniVersion {} (CHECK needs 0.4.0 or later)",
                ctx.conf.cni_version
            ),
        ));
    }
    let Some(prev) = &ctx.conf.prev_result else {
        return Err(CniError::new(
            code::INVALID_CONFIG,
            "required prevResult missing",
            "CHECK compares the attachment with the result of its ADD",
        ));
    };
    let prev = CniResult::from_prev_result(prev)?;
    let expected = expected(ctx, &prev)?;
    let netns = ctx.pod_netns()?;

    let agent = ctx.agent().await.map_err(|err| err.to_cni())?;
    let record = agent
        .check_network(ctx.pod_key())
        .await
        .map_err(|err| err.to_cni())?;
    let node = NetlinkHandle::new()
        .map_err(|err| error::netlink("opening netlink", &PodNetError::from(err)))?;
    let host = node
        .link_details(&expected.host_veth)
        .await
        .map_err(|err| error::netlink("looking up the host veth", &err))?;
    let node_routes = node
        .main_routes()
        .await
        .map_err(|err| error::netlink("listing the node's routes", &err))?;
    let ifname = expected.ifname.clone();
    let pod = netns
        .run(async move |netlink| {
            let Some(link) = netlink.link_details(&ifname).await? else {
                return Ok(None);
            };
            let link_ref = link.link.link_ref();
            Ok(Some(PodState {
                addrs: netlink.ipv4_addresses(&link_ref).await?,
                routes: netlink.main_routes().await?,
                neighbours: netlink.ipv4_neighbours(&link_ref).await?,
                link,
            }))
        })
        .await
        .map_err(|err| netns_error(&err))?;
    compare(
        &expected,
        &Observed {
            record,
            host,
            node_routes,
            pod,
        },
    )
}

#[cfg(test)]
mod tests {
    use vpcnet_netlink::{LinkInfo, OperState};

    use super::*;

    const HOST_MAC: MacAddr = MacAddr([0x02, 0, 0, 0, 0, 0x01]);
    const POD_MAC: MacAddr = MacAddr([0x02, 0, 0, 0, 0, 0x02]);

    fn link(index: u32, name: &str, mac: MacAddr) -> LinkDetails {
        LinkDetails {
            link: LinkInfo {
                index,
                name: name.into(),
                mac: Some(mac),
                mtu: 9001,
                up: true,
                oper_state: OperState::Up,
            },
            veth: true,
            peer_index: Some(1),
        }
    }

    fn route(dst: &str, gateway: Option<Ipv4Addr>, oif: u32, scope: u8) -> RouteInfo {
        RouteInfo {
            dst: dst.parse().unwrap(),
            gateway,
            oif: Some(oif),
            scope,
        }
    }

    fn good() -> (Expected, Observed) {
        let addr = Ipv4Addr::new(10, 20, 11, 20);
        let expected = Expected {
            addr,
            host_veth: "enic220f2ba281".into(),
            ifname: "eth0".into(),
            pod_mac: Some(POD_MAC.to_string()),
        };
        let observed = Observed {
            record: CheckNetworkReply {
                ipv4_addr: addr.to_string(),
                host_veth: "enic220f2ba281".into(),
                problem: String::new(),
            },
            host: Some(link(7, "enic220f2ba281", HOST_MAC)),
            node_routes: vec![route("10.20.11.20/32", None, 7, SCOPE_LINK)],
            pod: Some(PodState {
                link: link(2, "eth0", POD_MAC),
                addrs: vec!["10.20.11.20/32".parse().unwrap()],
                routes: vec![
                    route("169.254.1.1/32", None, 2, SCOPE_LINK),
                    route("0.0.0.0/0", Some(POD_GATEWAY), 2, 0),
                ],
                neighbours: vec![NeighbourInfo {
                    addr: POD_GATEWAY,
                    mac: Some(HOST_MAC),
                    permanent: true,
                }],
            }),
        };
        (expected, observed)
    }

    fn first_difference(change: impl FnOnce(&mut Observed)) -> String {
        let (expected, mut observed) = good();
        change(&mut observed);
        let err = compare(&expected, &observed).unwrap_err();
        assert_eq!(err.code, code::CHECK_FAILED);
        err.msg
    }

    #[test]
    fn what_add_made_passes() {
        let (expected, observed) = good();
        compare(&expected, &observed).unwrap();
    }

    #[test]
    fn each_difference_is_named() {
        let pod = |o: &mut Observed| o.pod.as_mut().unwrap().clone();
        assert_eq!(
            first_difference(|o| o.record.ipv4_addr.clear()),
            "the vpcnet agent holds no address for the attachment (prevResult has 10.20.11.20)"
        );
        assert_eq!(
            first_difference(|o| o.record.ipv4_addr = "10.20.11.21".into()),
            "the vpcnet agent holds 10.20.11.21 for the attachment, prevResult has 10.20.11.20"
        );
        assert_eq!(
            first_difference(|o| o.record.problem = "no endpoint entry".into()),
            "the vpcnet agent reports: no endpoint entry"
        );
        assert_eq!(
            first_difference(|o| o.host = None),
            "the host veth enic220f2ba281 does not exist"
        );
        assert_eq!(
            first_difference(|o| o.host.as_mut().unwrap().link.up = false),
            "the host veth enic220f2ba281 is down"
        );
        assert_eq!(
            first_difference(|o| o.node_routes.clear()),
            "the node has no route 10.20.11.20/32 dev enic220f2ba281 scope link"
        );
        assert_eq!(
            first_difference(|o| o.pod = None),
            "the container has no interface eth0"
        );
        assert_eq!(
            first_difference(|o| o.pod.as_mut().unwrap().link.link.up = false),
            "eth0 is down in the container"
        );
        assert!(
            first_difference(|o| o.pod.as_mut().unwrap().link.link.mac = Some(HOST_MAC))
                .starts_with("eth0 has the MAC")
        );
        assert_eq!(
            first_difference(|o| {
                let mut state = pod(o);
                state.addrs.push("10.0.0.9/24".parse().unwrap());
                o.pod = Some(state);
            }),
            "eth0 has the addresses [10.20.11.20/32, 10.0.0.9/24], expected exactly 10.20.11.20/32"
        );
        assert_eq!(
            first_difference(|o| {
                o.pod.as_mut().unwrap().routes.remove(0);
            }),
            "the container has no route 169.254.1.1 dev eth0 scope link"
        );
        assert_eq!(
            first_difference(|o| {
                o.pod.as_mut().unwrap().routes.remove(1);
            }),
            "the container has no route default via 169.254.1.1 dev eth0"
        );
        assert_eq!(
            first_difference(|o| o.pod.as_mut().unwrap().neighbours.clear()),
            "the container has no neighbour entry for 169.254.1.1 on eth0"
        );
        assert_eq!(
            first_difference(|o| o.pod.as_mut().unwrap().neighbours[0].permanent = false),
            "the neighbour entry for 169.254.1.1 on eth0 is not permanent"
        );
        assert!(
            first_difference(|o| o.pod.as_mut().unwrap().neighbours[0].mac = Some(POD_MAC))
                .contains("the host veth's MAC is 02:00:00:00:00:01")
        );
    }

    #[test]
    fn routes_others_added_are_allowed() {
        let (expected, mut observed) = good();
        let pod = observed.pod.as_mut().unwrap();
        pod.routes
            .push(route("10.100.0.0/16", Some(POD_GATEWAY), 2, 0));
        observed.node_routes.push(route(
            "10.0.0.0/8",
            Some(Ipv4Addr::new(10, 20, 11, 1)),
            1,
            0,
        ));
        compare(&expected, &observed).unwrap();
    }
}
