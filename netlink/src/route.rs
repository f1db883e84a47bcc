//! The subnet route an ENI's address brings into table `main`.

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use rtnetlink::{
    RouteMessageBuilder,
    packet_route::route::{RouteProtocol, RouteScope, RouteType},
};
use tracing::{debug, info};

use super::{LinkRef, NetlinkError, NetlinkHandle, errno};

/// Table `main` (`RT_TABLE_MAIN`).
const MAIN_TABLE: u32 = 254;

impl NetlinkHandle {
    /// Deletes the route to `addr`'s subnet by `link` that the kernel adds
    /// to `main` with the address (`proto kernel scope link src <addr>`),
    /// as ipamd does: the node's own traffic to the subnet keeps leaving by
    /// the primary ENI, and what leaves by a secondary ENI is steered there
    /// by the datapath. Returns whether there was one.
    pub async fn delete_subnet_route(
        &self,
        link: &LinkRef,
        addr: Ipv4Net,
    ) -> Result<bool, NetlinkError> {
        let subnet = addr.trunc();
        let route = RouteMessageBuilder::<Ipv4Addr>::new()
            .table_id(MAIN_TABLE)
            .protocol(RouteProtocol::Kernel)
            .scope(RouteScope::Link)
            .kind(RouteType::Unicast)
            .destination_prefix(subnet.network(), subnet.prefix_len())
            .output_interface(link.index)
            .pref_source(addr.addr())
            .build();
        match self.handle.route().del(route).execute().await {
            Ok(()) => {
                info!(link = %link.name, %subnet, "subnet route deleted from main");
                Ok(true)
            }
            Err(err) if errno(&err) == Some(libc::ESRCH) => {
                debug!(link = %link.name, %subnet, "no subnet route in main");
                Ok(false)
            }
            Err(source) => Err(NetlinkError::DelRoute {
                link: link.clone(),
                subnet,
                source: Box::new(source),
            }),
        }
    }
}
