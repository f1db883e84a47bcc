//! The subnet gateway of an ENI, kept resolved by the kernel.

use std::net::Ipv4Addr;

use futures_util::{StreamExt, TryStreamExt};
use rtnetlink::{
    packet_core::{
        NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload,
    },
    packet_route::{
        AddressFamily, RouteNetlinkMessage,
        neighbour::{
            NeighbourAddress, NeighbourAttribute, NeighbourExtFlags, NeighbourMessage,
            NeighbourState,
        },
        route::RouteType,
    },
};
use tracing::{debug, info};

use super::{LinkRef, NetlinkError, NetlinkHandle};

/// Whether `message` is the IPv4 entry for `gateway` on `link`, and if so
/// whether it is managed.
fn entry_for(message: &NeighbourMessage, link: &LinkRef, gateway: Ipv4Addr) -> Option<bool> {
    if message.header.ifindex != link.index {
        return None;
    }
    let mut is_gateway = false;
    let mut managed = false;
    for attribute in &message.attributes {
        match attribute {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(dst)) => {
                is_gateway = *dst == gateway;
            }
            NeighbourAttribute::ExtFlags(flags) => {
                managed = flags.contains(NeighbourExtFlags::Managed);
            }
            _ => {}
        }
    }
    is_gateway.then_some(managed)
}

impl NetlinkHandle {
    /// Whether `link` has a managed neighbour entry for `gateway`.
    pub async fn gateway_entry_managed(
        &self,
        link: &LinkRef,
        gateway: Ipv4Addr,
    ) -> Result<Option<bool>, NetlinkError> {
        let entries: Vec<NeighbourMessage> = self
            .handle
            .neighbours()
            .get()
            .set_address_family(AddressFamily::Inet)
            .execute()
            .try_collect()
            .await
            .map_err(|source| NetlinkError::ListNeighbours {
                link: link.clone(),
                source: Box::new(source),
            })?;
        Ok(entries
            .iter()
            .find_map(|message| entry_for(message, link, gateway)))
    }

    /// Asks the kernel to keep `gateway` resolved on `link`: a managed
    /// neighbour entry (`NTF_EXT_MANAGED`, Linux 5.16), which the kernel
    /// probes on its own and never lets expire. Packets the datapath sends
    /// there with `bpf_redirect_neigh` then never wait in the neighbour
    /// queue, where a packet the stack had routed out of another ENI would
    /// be re-resolved through its old route and leave with that ENI's MAC.
    ///
    /// An entry that is already managed is left as it is, so a resolved one
    /// stays resolved; any other is replaced by a managed one. Returns
    /// whether it had to write one.
    pub async fn keep_gateway_resolved(
        &self,
        link: &LinkRef,
        gateway: Ipv4Addr,
    ) -> Result<bool, NetlinkError> {
        if self.gateway_entry_managed(link, gateway).await? == Some(true) {
            debug!(link = %link.name, %gateway, "gateway entry already managed");
            return Ok(false);
        }
        // `ip neigh replace <gw> dev <link> managed`: no state and no
        // address of our own, the kernel resolves it.
        let mut message = NeighbourMessage::default();
        message.header.family = AddressFamily::Inet;
        message.header.ifindex = link.index;
        message.header.state = NeighbourState::None;
        message.header.kind = RouteType::Unspec;
        message
            .attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
                gateway,
            )));
        message
            .attributes
            .push(NeighbourAttribute::ExtFlags(NeighbourExtFlags::Managed));
        let mut request = NetlinkMessage::from(RouteNetlinkMessage::NewNeighbour(message));
        request.header.flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE;
        let fail = |source| NetlinkError::ManagedNeighbour {
            link: link.clone(),
            gateway,
            source: Box::new(source),
        };
        let mut answers = self.handle.clone().request(request).map_err(fail)?;
        while let Some(answer) = answers.next().await {
            // Acknowledgements are not passed on; an error is the answer.
            if let NetlinkPayload::Error(err) = answer.payload
                && err.code.is_some()
            {
                return Err(fail(rtnetlink::Error::NetlinkError(err)));
            }
        }
        info!(link = %link.name, %gateway, "gateway kept resolved (managed neighbour)");
        Ok(true)
    }
}
