//! A pod's network as the CNI plugin wires it, the VPC CNI's way: the pod
//! has its address as a /32 on its end of the veth and reaches everything
//! through a link-local gateway, [`POD_GATEWAY`], which a permanent
//! neighbour entry resolves to the host veth's MAC (so the pod never ARPs
//! for it); the node reaches the pod through a /32 route by the host veth.
//!
//! Also what CNI CHECK compares with a previous result: the routes of table
//! `main` and the IPv4 neighbours of a link, as the kernel reports them.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
};

use futures_util::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::{
    RouteMessageBuilder,
    packet_route::{
        AddressFamily,
        neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
        route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope},
    },
};
use tracing::debug;

use crate::{LinkRef, MacAddr, NetlinkError, NetlinkHandle, errno};

/// The pod's default gateway: a link-local address nobody has, answered by
/// the permanent neighbour entry (the VPC CNI's choice too).
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

/// Table `main` (`RT_TABLE_MAIN`).
const MAIN_TABLE: u32 = 254;

/// What went wrong wiring or reading a pod's network, with what it was
/// about.
#[derive(Debug, thiserror::Error)]
pub enum PodNetError {
    #[error(transparent)]
    Netlink(#[from] NetlinkError),
    #[error("the network namespace {0} does not exist")]
    NetnsMissing(PathBuf),
    #[error("opening the network namespace {path}")]
    OpenNetns {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("entering the network namespace {path} (is it one?)")]
    Setns {
        path: PathBuf,
        #[source]
        source: nix::Error,
    },
    #[error("starting a thread for a network namespace")]
    Thread(#[source] std::io::Error),
    #[error("a link named {host} (node) or {peer} (pod) exists already")]
    LinkExists { host: String, peer: String },
    #[error("creating the veth pair {host} (node) / {peer} (pod)")]
    CreateVeth {
        host: String,
        peer: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("deleting the link {name}")]
    DeleteLink {
        name: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("listing the routes")]
    ListRoutes(#[source] Box<rtnetlink::Error>),
    #[error("adding the permanent neighbour {addr} lladdr {mac} on {link}")]
    AddNeighbour {
        link: LinkRef,
        addr: Ipv4Addr,
        mac: MacAddr,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("no link is named {0}")]
    NoLink(String),
}

/// The pod's end of the veth, as it is configured from inside the pod's
/// namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSide {
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// The pod's address (a /32).
    pub addr: Ipv4Addr,
    /// The host veth's MAC, which [`POD_GATEWAY`] resolves to.
    pub gateway_mac: MacAddr,
    /// A new MTU for the interface, if it must change.
    pub mtu: Option<u32>,
}

/// An IPv4 route of table `main`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteInfo {
    pub dst: Ipv4Net,
    pub gateway: Option<Ipv4Addr>,
    /// The output interface's index.
    pub oif: Option<u32>,
    /// `ip route`'s scope number: 0 global, 253 link, 254 host.
    pub scope: u8,
}

impl RouteInfo {
    /// The route in `message`, if it is an IPv4 one of table `main`.
    fn from_message(message: &RouteMessage) -> Option<Self> {
        if message.header.address_family != AddressFamily::Inet {
            return None;
        }
        let mut table = u32::from(message.header.table);
        let mut dst = Ipv4Addr::UNSPECIFIED;
        let mut gateway = None;
        let mut oif = None;
        for attribute in &message.attributes {
            match attribute {
                RouteAttribute::Table(id) => table = *id,
                RouteAttribute::Destination(RouteAddress::Inet(addr)) => dst = *addr,
                RouteAttribute::Gateway(RouteAddress::Inet(addr)) => gateway = Some(*addr),
                RouteAttribute::Oif(index) => oif = Some(*index),
                _ => {}
            }
        }
        if table != MAIN_TABLE {
            return None;
        }
        Some(Self {
            dst: Ipv4Net::new(dst, message.header.destination_prefix_length).ok()?,
            gateway,
            oif,
            scope: message.header.scope.into(),
        })
    }
}

/// An IPv4 neighbour entry of a link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeighbourInfo {
    pub addr: Ipv4Addr,
    pub mac: Option<MacAddr>,
    /// `NUD_PERMANENT`: never probed, never expires.
    pub permanent: bool,
}

impl NeighbourInfo {
    fn from_message(message: &NeighbourMessage) -> Option<Self> {
        let mut addr = None;
        let mut mac = None;
        for attribute in &message.attributes {
            match attribute {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(dst)) => addr = Some(*dst),
                NeighbourAttribute::LinkLayerAddress(bytes) => mac = MacAddr::from_bytes(bytes),
                _ => {}
            }
        }
        Some(Self {
            addr: addr?,
            mac,
            permanent: message.header.state == NeighbourState::Permanent,
        })
    }
}

/// The link-scoped route to one address by `link`, as `ip route add
/// <addr>/32 dev <link> scope link` makes it.
fn host_route(link: &LinkRef, addr: Ipv4Addr) -> RouteMessage {
    RouteMessageBuilder::<Ipv4Addr>::new()
        .protocol(RouteProtocol::Boot)
        .scope(RouteScope::Link)
        .destination_prefix(addr, 32)
        .output_interface(link.index)
        .build()
}

impl NetlinkHandle {
    /// The link named `name`, or [`PodNetError::NoLink`].
    async fn existing_link(&self, name: &str) -> Result<LinkRef, PodNetError> {
        self.link_by_name(name)
            .await?
            .map(|link| link.link_ref())
            .ok_or_else(|| PodNetError::NoLink(name.to_owned()))
    }

    /// Adds (or replaces: the newest pod owns the address) the route
    /// `<addr>/32 dev <link> scope link` to table `main`.
    pub async fn replace_link_route(
        &self,
        link: &LinkRef,
        addr: Ipv4Addr,
    ) -> Result<(), PodNetError> {
        self.handle
            .route()
            .add(host_route(link, addr))
            .replace()
            .execute()
            .await
            .map_err(|source| {
                NetlinkError::AddRoute {
                    route: format!("{addr}/32 dev {} scope link", link.name),
                    source: Box::new(source),
                }
                .into()
            })
    }

    /// Configures the pod's side from inside its namespace: `lo` up, the
    /// interface's MTU (if it changes) and address, the interface up, the
    /// route to [`POD_GATEWAY`] by the interface, the default route through
    /// it, and the permanent neighbour entry for it.
    pub async fn configure_pod_side(&self, side: &PodSide) -> Result<(), PodNetError> {
        let lo = self.existing_link("lo").await?;
        self.set_up(&lo).await?;
        let link = self.existing_link(&side.ifname).await?;
        if let Some(mtu) = side.mtu {
            self.set_mtu(&link, mtu).await?;
        }
        let addr = Ipv4Net::new(side.addr, 32).expect("32 is a valid IPv4 prefix length");
        match self
            .handle
            .address()
            .add(link.index, IpAddr::V4(side.addr), 32)
            .execute()
            .await
        {
            Ok(()) => {}
            Err(err) if errno(&err) == Some(libc::EEXIST) => {}
            Err(source) => {
                return Err(NetlinkError::AddAddress {
                    link: link.clone(),
                    addr,
                    source: Box::new(source),
                }
                .into());
            }
        }
        self.set_up(&link).await?;
        self.replace_link_route(&link, POD_GATEWAY).await?;
        let default = RouteMessageBuilder::<Ipv4Addr>::new()
            .protocol(RouteProtocol::Boot)
            .destination_prefix(Ipv4Addr::UNSPECIFIED, 0)
            .gateway(POD_GATEWAY)
            .output_interface(link.index)
            .build();
        self.handle
            .route()
            .add(default)
            .replace()
            .execute()
            .await
            .map_err(|source| NetlinkError::AddRoute {
                route: format!("default via {POD_GATEWAY} dev {}", link.name),
                source: Box::new(source),
            })?;
        self.handle
            .neighbours()
            .add(link.index, IpAddr::V4(POD_GATEWAY))
            .link_layer_address(&side.gateway_mac.0)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(|source| PodNetError::AddNeighbour {
                link: link.clone(),
                addr: POD_GATEWAY,
                mac: side.gateway_mac,
                source: Box::new(source),
            })?;
        debug!(ifname = %side.ifname, addr = %side.addr, "pod side configured");
        Ok(())
    }

    /// The IPv4 routes of table `main`.
    pub async fn main_routes(&self) -> Result<Vec<RouteInfo>, PodNetError> {
        let request = RouteMessageBuilder::<Ipv4Addr>::new().build();
        self.handle
            .route()
            .get(request)
            .execute()
            .try_filter_map(|message| async move { Ok(RouteInfo::from_message(&message)) })
            .try_collect()
            .await
            .map_err(|source| PodNetError::ListRoutes(Box::new(source)))
    }

    /// The IPv4 neighbour entries of `link`.
    pub async fn ipv4_neighbours(&self, link: &LinkRef) -> Result<Vec<NeighbourInfo>, PodNetError> {
        let index = link.index;
        self.handle
            .neighbours()
            .get()
            .set_address_family(AddressFamily::Inet)
            .execute()
            .try_filter_map(|message| async move {
                Ok((message.header.ifindex == index)
                    .then(|| NeighbourInfo::from_message(&message))
                    .flatten())
            })
            .try_collect()
            .await
            .map_err(|source| {
                NetlinkError::ListNeighbours {
                    link: link.clone(),
                    source: Box::new(source),
                }
                .into()
            })
    }
}
