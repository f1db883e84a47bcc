//! The ENI's address: its primary private IP with the subnet's prefix
//! length, and no other IPv4 address.

use std::net::IpAddr;

use futures_util::TryStreamExt;
use ipnet::Ipv4Net;
use rtnetlink::packet_route::{
    AddressFamily,
    address::{AddressAttribute, AddressFlags, AddressMessage},
};
use tracing::{debug, info};

use super::{LinkRef, NetlinkError, NetlinkHandle, errno};

/// The IPv4 address an address message carries (`IFA_LOCAL`, the address
/// itself; `IFA_ADDRESS` is the peer's on point-to-point links).
fn ipv4_of(message: &AddressMessage) -> Option<Ipv4Net> {
    if message.header.family != AddressFamily::Inet {
        return None;
    }
    message
        .attributes
        .iter()
        .find_map(|attribute| match attribute {
            AddressAttribute::Local(IpAddr::V4(addr)) => {
                Ipv4Net::new(*addr, message.header.prefix_len).ok()
            }
            _ => None,
        })
}

impl NetlinkHandle {
    /// The IPv4 addresses of `link`, with their messages (which delete
    /// exactly that address when sent back).
    async fn ipv4_address_messages(
        &self,
        link: &LinkRef,
    ) -> Result<Vec<(Ipv4Net, AddressMessage)>, NetlinkError> {
        self.handle
            .address()
            .get()
            .set_link_index_filter(link.index)
            .execute()
            .try_filter_map(
                |message| async move { Ok(ipv4_of(&message).map(|net| (net, message))) },
            )
            .try_collect()
            .await
            .map_err(|source| NetlinkError::ListAddresses {
                link: link.clone(),
                source: Box::new(source),
            })
    }

    /// The IPv4 addresses of `link`, each with its prefix length.
    pub async fn ipv4_addresses(&self, link: &LinkRef) -> Result<Vec<Ipv4Net>, NetlinkError> {
        Ok(self
            .ipv4_address_messages(link)
            .await?
            .into_iter()
            .map(|(net, _)| net)
            .collect())
    }

    /// Makes `addr` the one IPv4 address of `link`, as ipamd does for an ENI:
    /// an address already there is left alone, any other (a previous
    /// owner's, or this one with another prefix) is removed first: removing
    /// a primary address takes the secondaries of its subnet with it, so
    /// adding first could lose the new one.
    ///
    /// The address is added with `noprefixroute`: the kernel then never puts
    /// the subnet route into `main`, not now and not when the link comes
    /// back up after being down (it re-adds prefix routes on every up).
    /// Returns whether anything changed.
    pub async fn set_only_ipv4_address(
        &self,
        link: &LinkRef,
        addr: Ipv4Net,
    ) -> Result<bool, NetlinkError> {
        let mut present = false;
        let mut changed = false;
        for (net, message) in self.ipv4_address_messages(link).await? {
            if net == addr {
                present = true;
                continue;
            }
            info!(link = %link.name, stale = %net, wanted = %addr, "removing a stale address");
            match self.handle.address().del(message).execute().await {
                Ok(()) => changed = true,
                // Already gone with the primary address of its subnet.
                Err(err) if errno(&err) == Some(libc::EADDRNOTAVAIL) => {}
                Err(source) => {
                    return Err(NetlinkError::DelAddress {
                        link: link.clone(),
                        addr: net,
                        source: Box::new(source),
                    });
                }
            }
        }
        if present {
            debug!(link = %link.name, %addr, "address already present");
            return Ok(changed);
        }
        let mut request =
            self.handle
                .address()
                .add(link.index, addr.addr().into(), addr.prefix_len());
        request
            .message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Noprefixroute));
        match request.execute().await {
            Ok(()) => info!(link = %link.name, %addr, "address added"),
            // Someone added it between the dump and now: the same result.
            Err(err) if errno(&err) == Some(libc::EEXIST) => {}
            Err(source) => {
                return Err(NetlinkError::AddAddress {
                    link: link.clone(),
                    addr,
                    source: Box::new(source),
                });
            }
        }
        Ok(true)
    }
}
