//! Links: finding one by name or MAC, listing them, waiting for one to
//! appear, and the two settings an ENI needs (MTU, up).

use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt, stream::BoxStream};
use rtnetlink::{
    LinkUnspec, MulticastGroup,
    packet_core::{NetlinkMessage, NetlinkPayload},
    packet_route::{
        RouteNetlinkMessage,
        link::{LinkAttribute, LinkFlags, LinkMessage, State},
    },
    sys::SocketAddr,
};
use tracing::{debug, info};

use super::{AbortOnDrop, LinkRef, MacAddr, NetlinkError, NetlinkHandle, errno};

/// A link's operational state (RFC 2863, `IFLA_OPERSTATE`), what `ip link`
/// shows as `state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OperState {
    Unknown,
    NotPresent,
    Down,
    LowerLayerDown,
    Testing,
    Dormant,
    Up,
    Other(u8),
}

impl From<State> for OperState {
    fn from(state: State) -> Self {
        match state {
            State::NotPresent => Self::NotPresent,
            State::Down => Self::Down,
            State::LowerLayerDown => Self::LowerLayerDown,
            State::Testing => Self::Testing,
            State::Dormant => Self::Dormant,
            State::Up => Self::Up,
            State::Other(value) => Self::Other(value),
            _ => Self::Unknown,
        }
    }
}

/// One link as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkInfo {
    pub index: u32,
    pub name: String,
    /// `None` for links without an Ethernet address (loopback has one of
    /// zeros, which is kept; tunnels have none).
    pub mac: Option<MacAddr>,
    pub mtu: u32,
    /// Administratively up (`IFF_UP`, what `ip link set up` sets).
    pub up: bool,
    pub oper_state: OperState,
}

impl LinkInfo {
    pub(crate) fn from_message(message: &LinkMessage) -> Self {
        let mut link = Self {
            index: message.header.index,
            name: String::new(),
            mac: None,
            mtu: 0,
            up: message.header.flags.contains(LinkFlags::Up),
            oper_state: OperState::Unknown,
        };
        for attribute in &message.attributes {
            match attribute {
                LinkAttribute::IfName(name) => link.name.clone_from(name),
                LinkAttribute::Address(bytes) => link.mac = MacAddr::from_bytes(bytes),
                LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
                LinkAttribute::OperState(state) => link.oper_state = (*state).into(),
                _ => {}
            }
        }
        link
    }

    /// The link as errors name it.
    pub fn link_ref(&self) -> LinkRef {
        LinkRef {
            name: self.name.clone(),
            index: self.index,
        }
    }
}

/// How one link is asked for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LinkKey<'a> {
    Name(&'a str),
    Index(u32),
}

/// The link among `links` with `mac`. A VLAN link inherits its parent's MAC
/// unless given one, so several links may match: the parent is made first
/// and has the lowest index, and it is the ENI.
fn pick_by_mac(links: impl IntoIterator<Item = LinkInfo>, mac: MacAddr) -> Option<LinkInfo> {
    links
        .into_iter()
        .filter(|link| link.mac == Some(mac))
        .min_by_key(|link| link.index)
}

/// The index of each MAC's link (the one [`pick_by_mac`] picks) at the
/// last dump of the handle's links. Finding a link by MAC is a dump of every
/// link, some 13 ms on a node of a thousand pods, and a start looks up each
/// ENI's more than once: a hit is one request for that index, kept only if
/// the link there still has the MAC, and a link gone or changed is a miss.
/// Links that share a MAC are a VLAN and its parent, made here in that
/// order, and a new link gets an index above the last one given: no
/// lower-indexed link with the MAC comes after a dump.
#[derive(Debug, Default)]
pub(crate) struct MacIndex(std::sync::Mutex<std::collections::HashMap<MacAddr, u32>>);

impl MacIndex {
    fn get(&self, mac: MacAddr) -> Option<u32> {
        self.lock().get(&mac).copied()
    }

    /// Remembers `links`, a whole dump, in place of the last.
    fn remember(&self, links: &[LinkInfo]) {
        let mut macs = self.lock();
        macs.clear();
        for link in links {
            if let Some(mac) = link.mac {
                let index = macs.entry(mac).or_insert(link.index);
                *index = (*index).min(link.index);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<MacAddr, u32>> {
        // A map of hints: whatever a panic left in it is checked before use.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Every link of `handle`'s namespace.
async fn dump_links(handle: &rtnetlink::Handle) -> Result<Vec<LinkInfo>, NetlinkError> {
    handle
        .link()
        .get()
        .execute()
        .map_ok(|message| LinkInfo::from_message(&message))
        .try_collect()
        .await
        .map_err(|err| NetlinkError::ListLinks(Box::new(err)))
}

impl NetlinkHandle {
    /// Every link of the namespace, with index, name, MAC, MTU and states.
    pub async fn links(&self) -> Result<Vec<LinkInfo>, NetlinkError> {
        let links = dump_links(&self.handle).await?;
        self.macs.remember(&links);
        Ok(links)
    }

    /// The link named `name`, if there is one.
    pub async fn link_by_name(&self, name: &str) -> Result<Option<LinkInfo>, NetlinkError> {
        Ok(self
            .link_message(LinkKey::Name(name))
            .await?
            .map(|message| LinkInfo::from_message(&message)))
    }

    /// The kernel's message for one link, if it exists.
    pub(crate) async fn link_message(
        &self,
        key: LinkKey<'_>,
    ) -> Result<Option<LinkMessage>, NetlinkError> {
        let request = self.handle.link().get();
        let request = match key {
            LinkKey::Name(name) => request.match_name(name.to_owned()),
            LinkKey::Index(index) => request.match_index(index),
        };
        match request.execute().try_next().await {
            Ok(message) => Ok(message),
            Err(err) if errno(&err) == Some(libc::ENODEV) => Ok(None),
            Err(err) => Err(NetlinkError::ListLinks(Box::new(err))),
        }
    }

    /// The link with `mac`, if there is one (see [`NetlinkHandle::wait_for_link`]
    /// for one that is still to come).
    pub async fn link_by_mac(&self, mac: MacAddr) -> Result<Option<LinkInfo>, NetlinkError> {
        if let Some(index) = self.macs.get(mac)
            && let Some(link) = self.link_message(LinkKey::Index(index)).await?
        {
            let link = LinkInfo::from_message(&link);
            if link.mac == Some(mac) {
                return Ok(Some(link));
            }
        }
        Ok(pick_by_mac(self.links().await?, mac))
    }

    /// Sets the MTU of `link` (the caller reads `AWS_VPC_ENI_MTU`).
    pub async fn set_mtu(&self, link: &LinkRef, mtu: u32) -> Result<(), NetlinkError> {
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(link.index).mtu(mtu).build())
            .execute()
            .await
            .map_err(|source| NetlinkError::SetMtu {
                link: link.clone(),
                mtu,
                source: Box::new(source),
            })
    }

    /// Sets `link` administratively up.
    pub async fn set_up(&self, link: &LinkRef) -> Result<(), NetlinkError> {
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(link.index).up().build())
            .execute()
            .await
            .map_err(|source| NetlinkError::SetUp {
                link: link.clone(),
                source: Box::new(source),
            })
    }

    /// Starts watching for the link with `mac`: subscribes to link events
    /// first and only then looks at the links there are, so a link that
    /// appears in between is seen either way.
    pub async fn watch_link(&self, mac: MacAddr) -> Result<LinkWatch, NetlinkError> {
        // A connection of its own: its group membership must not send every
        // link event of the node to the main socket for its whole life.
        let (connection, handle, events) =
            rtnetlink::new_multicast_connection(&[MulticastGroup::Link])
                .map_err(NetlinkError::Subscribe)?;
        let connection = AbortOnDrop(tokio::spawn(connection));
        let present = self.link_by_mac(mac).await?;
        Ok(LinkWatch {
            mac,
            present,
            handle,
            events: events.boxed(),
            _connection: connection,
        })
    }

    /// Waits up to `timeout` for the link with `mac`. EC2 attaches an ENI
    /// and the kernel makes its link some time later, so the agent waits for
    /// the link after the attachment instead of assuming it is there.
    pub async fn wait_for_link(
        &self,
        mac: MacAddr,
        timeout: Duration,
    ) -> Result<LinkInfo, NetlinkError> {
        self.watch_link(mac).await?.wait(timeout).await
    }
}

/// Link events as they come (the unsolicited messages of the subscribed
/// socket).
type Events = BoxStream<'static, (NetlinkMessage<RouteNetlinkMessage>, SocketAddr)>;

/// A wait for a link with a given MAC, subscribed to link events; see
/// [`NetlinkHandle::watch_link`].
pub struct LinkWatch {
    mac: MacAddr,
    present: Option<LinkInfo>,
    handle: rtnetlink::Handle,
    events: Events,
    _connection: AbortOnDrop,
}

impl std::fmt::Debug for LinkWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkWatch")
            .field("mac", &self.mac)
            .field("present", &self.present)
            .finish_non_exhaustive()
    }
}

impl LinkWatch {
    /// The link, if it was there when the watch started.
    pub fn present(&self) -> Option<&LinkInfo> {
        self.present.as_ref()
    }

    /// The link, as soon as it exists, or an error after `timeout`.
    pub async fn wait(mut self, timeout: Duration) -> Result<LinkInfo, NetlinkError> {
        if let Some(link) = self.present.take() {
            debug!(mac = %self.mac, link = %link.name, "link already present");
            return Ok(link);
        }
        let mac = self.mac;
        debug!(%mac, ?timeout, "waiting for the link");
        let outcome = tokio::time::timeout(timeout, async {
            while let Some((message, _)) = self.events.next().await {
                if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link)) =
                    message.payload
                {
                    let link = LinkInfo::from_message(&link);
                    if link.mac == Some(mac) {
                        return Some(link);
                    }
                }
            }
            None
        })
        .await;
        if let Ok(Some(link)) = outcome {
            info!(%mac, link = %link.name, index = link.index, "link appeared");
            return Ok(link);
        }
        // A full socket buffer drops events; one last look settles it.
        if let Some(link) = pick_by_mac(dump_links(&self.handle).await?, mac) {
            info!(%mac, link = %link.name, index = link.index, "link found");
            return Ok(link);
        }
        match outcome {
            Err(_) => Err(NetlinkError::LinkTimeout { mac, timeout }),
            Ok(_) => Err(NetlinkError::EventsClosed(mac)),
        }
    }
}
