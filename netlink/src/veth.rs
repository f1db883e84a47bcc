//! A pod's veth pair: created from the node's namespace with its peer put
//! straight into the pod's (`IFLA_NET_NS_FD`), so the pod's end never
//! exists under its name in the node's namespace; found again by name, with
//! its peer's index, to tell whose pair a host veth is; and deleted, which
//! takes the peer, the addresses and the routes through it along.

use std::os::fd::AsRawFd;

use futures_util::TryStreamExt;
use rtnetlink::{
    LinkMessageBuilder, LinkUnspec,
    packet_core::DefaultNla,
    packet_route::link::{
        InfoData, InfoKind, InfoVeth, LinkAttribute, LinkInfo as PacketLinkInfo, LinkMessage,
    },
};
use tracing::{debug, info};

use crate::{
    LinkInfo, MacAddr, NetlinkError, NetlinkHandle, errno, link::LinkKey, netns::Netns,
    pod::PodNetError,
};

/// What the pair is made of: a name and a MAC for each end, one MTU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VethSpec {
    /// The end that stays in the node's namespace.
    pub host_name: String,
    pub host_mac: MacAddr,
    /// The end that goes into the pod's namespace (`CNI_IFNAME`).
    pub peer_name: String,
    pub peer_mac: MacAddr,
    pub mtu: u32,
}

/// A link with what tells a veth and its peer apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkDetails {
    pub link: LinkInfo,
    /// The link is a veth.
    pub veth: bool,
    /// The index of the other end (`IFLA_LINK`), in the other end's
    /// namespace; `None` for links without a peer.
    pub peer_index: Option<u32>,
}

impl LinkDetails {
    fn from_message(message: &LinkMessage) -> Self {
        let link = LinkInfo::from_message(message);
        let mut veth = false;
        let mut peer_index = None;
        for attribute in &message.attributes {
            match attribute {
                LinkAttribute::Link(index) => peer_index = Some(*index),
                LinkAttribute::LinkInfo(infos) => {
                    veth = infos
                        .iter()
                        .any(|info| matches!(info, PacketLinkInfo::Kind(InfoKind::Veth)));
                }
                _ => {}
            }
        }
        Self {
            link,
            veth,
            peer_index,
        }
    }
}

impl NetlinkHandle {
    /// Creates the veth pair `spec` with its peer end in `peer_netns`, both
    /// ends down. Either name being taken is [`PodNetError::LinkExists`]
    /// (the kernel does not say which); nothing is created then.
    pub async fn create_veth(
        &self,
        spec: &VethSpec,
        peer_netns: &Netns,
    ) -> Result<(), PodNetError> {
        let peer = LinkMessageBuilder::<LinkUnspec>::new()
            .name(spec.peer_name.clone())
            .address(spec.peer_mac.0.to_vec())
            .mtu(spec.mtu)
            .setns_by_fd(peer_netns.file().as_raw_fd())
            .build();
        let message = LinkMessageBuilder::<LinkUnspec>::new_with_info_kind(InfoKind::Veth)
            .name(spec.host_name.clone())
            .address(spec.host_mac.0.to_vec())
            .mtu(spec.mtu)
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
            .build();
        match self.handle.link().add(message).execute().await {
            Ok(()) => {
                info!(
                    host = %spec.host_name,
                    peer = %spec.peer_name,
                    netns = %peer_netns.path().display(),
                    "veth pair created"
                );
                Ok(())
            }
            Err(err) if errno(&err) == Some(libc::EEXIST) => Err(PodNetError::LinkExists {
                host: spec.host_name.clone(),
                peer: spec.peer_name.clone(),
            }),
            Err(source) => Err(PodNetError::CreateVeth {
                host: spec.host_name.clone(),
                peer: spec.peer_name.clone(),
                source: Box::new(source),
            }),
        }
    }

    /// The link named `name` with its kind and peer, if there is one.
    pub async fn link_details(&self, name: &str) -> Result<Option<LinkDetails>, PodNetError> {
        Ok(self
            .link_message(LinkKey::Name(name))
            .await?
            .map(|message| LinkDetails::from_message(&message)))
    }

    /// The MAC of the other end of the veth `host_veth`, read in the other
    /// end's namespace through its namespace id (`IFLA_LINK_NETNSID`, then
    /// `RTM_GETLINK` with `IFLA_TARGET_NETNSID`): how a pod wired by
    /// someone else is adopted without entering its namespace or sending it
    /// a packet. `None` when `host_veth` is gone or has no peer elsewhere.
    pub async fn peer_mac(&self, host_veth: &str) -> Result<Option<MacAddr>, NetlinkError> {
        /// `IFLA_TARGET_NETNSID` (not in the packet crate's attributes).
        const IFLA_TARGET_NETNSID: u16 = 46;
        let Some(message) = self.link_message(LinkKey::Name(host_veth)).await? else {
            return Ok(None);
        };
        let (mut peer_index, mut netns_id) = (None, None);
        for attribute in &message.attributes {
            match attribute {
                LinkAttribute::Link(index) => peer_index = Some(*index),
                LinkAttribute::LinkNetNsId(id) => netns_id = Some(*id),
                _ => {}
            }
        }
        let (Some(peer_index), Some(netns_id)) = (peer_index, netns_id) else {
            return Ok(None);
        };
        let mut request = self.handle.link().get().match_index(peer_index);
        request
            .message_mut()
            .attributes
            .push(LinkAttribute::Other(DefaultNla::new(
                IFLA_TARGET_NETNSID,
                netns_id.to_ne_bytes().to_vec(),
            )));
        let mut answers = request.execute();
        match answers.try_next().await {
            Ok(Some(peer)) => Ok(LinkInfo::from_message(&peer).mac),
            Ok(None) => Ok(None),
            Err(err) if errno(&err) == Some(libc::ENODEV) => Ok(None),
            Err(err) => Err(NetlinkError::PeerLink(host_veth.to_owned(), Box::new(err))),
        }
    }

    /// Deletes the link with `index` (`name` is for the log and errors). A
    /// link that is already gone is not an error: returns whether this call
    /// deleted it.
    pub async fn delete_link(&self, index: u32, name: &str) -> Result<bool, PodNetError> {
        match self.handle.link().del(index).execute().await {
            Ok(()) => {
                info!(link = %name, index, "link deleted");
                Ok(true)
            }
            Err(err) if errno(&err) == Some(libc::ENODEV) => {
                debug!(link = %name, index, "link already gone");
                Ok(false)
            }
            Err(source) => Err(PodNetError::DeleteLink {
                name: name.to_owned(),
                source: Box::new(source),
            }),
        }
    }

    /// Deletes the link named `name` if there is one; returns whether there
    /// was.
    pub async fn delete_link_named(&self, name: &str) -> Result<bool, PodNetError> {
        match self.link_details(name).await? {
            Some(details) => self.delete_link(details.link.index, name).await,
            None => Ok(false),
        }
    }
}
