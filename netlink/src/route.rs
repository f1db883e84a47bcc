//! Routes in table `main` by an ENI's link: there should be none. And the
//! routes of one table, read and written: the VPC CNI's VLAN tables, which
//! a take-over reads and a hand-back writes again.

use std::net::{IpAddr, Ipv4Addr};

use futures_util::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::{
    RouteMessageBuilder,
    packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope},
};
use tracing::info;

use super::{LinkRef, NetlinkError, NetlinkHandle, errno};

/// Table `main` (`RT_TABLE_MAIN`).
const MAIN_TABLE: u32 = 254;

/// The table a route message is in (the header holds 8 bits; larger ids
/// come as an attribute).
fn table_of(message: &RouteMessage) -> u32 {
    message
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            RouteAttribute::Table(table) => Some(*table),
            _ => None,
        })
        .unwrap_or_else(|| u32::from(message.header.table))
}

fn oif_of(message: &RouteMessage) -> Option<u32> {
    message
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            RouteAttribute::Oif(index) => Some(*index),
            _ => None,
        })
}

/// `dst/len` of a route message, for logs.
fn destination_of(message: &RouteMessage) -> String {
    let addr = message
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            RouteAttribute::Destination(RouteAddress::Inet(addr)) => Some(IpAddr::V4(*addr)),
            _ => None,
        })
        .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    format!("{addr}/{}", message.header.destination_prefix_length)
}

/// One IPv4 unicast route: where to, through which gateway, by which link.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ipv4Route {
    pub dst: Ipv4Net,
    pub via: Option<Ipv4Addr>,
    pub oif: Option<u32>,
}

impl Ipv4Route {
    fn from_message(message: &RouteMessage) -> Option<Self> {
        let mut dst = Ipv4Addr::UNSPECIFIED;
        let mut via = None;
        for attribute in &message.attributes {
            match attribute {
                RouteAttribute::Destination(RouteAddress::Inet(addr)) => dst = *addr,
                RouteAttribute::Gateway(RouteAddress::Inet(addr)) => via = Some(*addr),
                _ => {}
            }
        }
        Some(Self {
            dst: Ipv4Net::new(dst, message.header.destination_prefix_length).ok()?,
            via,
            oif: oif_of(message),
        })
    }
}

impl NetlinkHandle {
    /// Deletes every IPv4 route in `main` that leaves by `link`, and returns
    /// how many there were. As ipamd does for the subnet route the ENI's
    /// address brings, and for what else lands there: a DHCP client's
    /// subnet and default routes (systemd-networkd configuring an ENI it
    /// should leave alone). The node's own traffic keeps leaving by the
    /// primary ENI, and what leaves by a secondary ENI is steered there by
    /// the datapath.
    pub async fn delete_main_routes(&self, link: &LinkRef) -> Result<usize, NetlinkError> {
        let list_error = |source| NetlinkError::ListRoutes {
            link: link.clone(),
            source: Box::new(source),
        };
        let routes: Vec<RouteMessage> = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute()
            .try_filter(|message| {
                let ours = table_of(message) == MAIN_TABLE && oif_of(message) == Some(link.index);
                async move { ours }
            })
            .try_collect()
            .await
            .map_err(list_error)?;
        let mut deleted = 0;
        for route in routes {
            let destination = destination_of(&route);
            match self.handle.route().del(route).execute().await {
                Ok(()) => {
                    info!(link = %link.name, %destination, "route deleted from main");
                    deleted += 1;
                }
                // Gone with its address or its link meanwhile.
                Err(err) if errno(&err) == Some(libc::ESRCH) => {}
                Err(source) => {
                    return Err(NetlinkError::DelRoute {
                        link: link.clone(),
                        destination,
                        source: Box::new(source),
                    });
                }
            }
        }
        Ok(deleted)
    }

    /// The IPv4 routes of `table`.
    pub async fn ipv4_routes(&self, table: u32) -> Result<Vec<Ipv4Route>, NetlinkError> {
        let messages: Vec<RouteMessage> = self
            .handle
            .route()
            .get(RouteMessageBuilder::<Ipv4Addr>::new().build())
            .execute()
            .try_filter(|message| {
                let ours = table_of(message) == table;
                async move { ours }
            })
            .try_collect()
            .await
            .map_err(|source| NetlinkError::ListTable {
                table,
                source: Box::new(source),
            })?;
        Ok(messages
            .iter()
            .filter_map(Ipv4Route::from_message)
            .collect())
    }

    /// Adds `route` to `table`, or replaces the one it has to that
    /// destination: through its gateway, or on its link.
    pub async fn replace_ipv4_route(
        &self,
        route: &Ipv4Route,
        table: u32,
    ) -> Result<(), NetlinkError> {
        let mut message = RouteMessageBuilder::<Ipv4Addr>::new()
            .protocol(RouteProtocol::Boot)
            .table_id(table)
            .destination_prefix(route.dst.addr(), route.dst.prefix_len());
        message = match route.via {
            Some(via) => message.gateway(via),
            None => message.scope(RouteScope::Link),
        };
        if let Some(oif) = route.oif {
            message = message.output_interface(oif);
        }
        self.handle
            .route()
            .add(message.build())
            .replace()
            .execute()
            .await
            .map_err(|source| NetlinkError::AddRoute {
                route: format!("{route:?} table {table}"),
                source: Box::new(source),
            })
    }
}
