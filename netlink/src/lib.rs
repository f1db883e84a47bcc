//! Link setup through rtnetlink: what the VPC CNI's ipamd does with
//! netlink for a secondary ENI (`setupENINetwork`), minus its policy
//! routing, which the eBPF datapath replaces.
//!
//! The job is split the way the kernel's objects are: [`link`] (find, list,
//! wait for a link to appear, MTU and up), [`addr`] (the ENI's one address),
//! [`route`] (the subnet route that address would bring into `main`),
//! [`neigh`] (the gateway kept resolved) and [`eni`], which puts them
//! together for one ENI; [`vlan`] makes a branch ENI's 802.1Q link.
//!
//! Everything goes through one [`NetlinkHandle`]: a netlink socket whose
//! connection task runs on the caller's tokio runtime. The socket belongs to
//! the network namespace of the thread that opened it, so the agent (and the
//! tests, which run it inside their own namespaces) choose the namespace by
//! choosing the thread.
//!
//! A detached ENI needs no teardown: the kernel removes its link, and with
//! the link go its addresses, its routes and its neighbour entries.

pub mod addr;
pub mod eni;
pub mod link;
pub mod neigh;
pub mod netns;
pub mod pod;
pub mod route;
pub mod rule;
pub mod veth;
pub mod vlan;

use std::{fmt, net::Ipv4Addr, str::FromStr, time::Duration};

pub use eni::{EniLinkConfig, EniLinkSetup};
use ipnet::Ipv4Net;
pub use link::{LinkInfo, LinkWatch, OperState};
use rtnetlink::packet_core::ErrorMessage;
use tokio::task::JoinHandle;

/// A link's hardware address. The agent learns an ENI's MAC from IMDS
/// (`network/interfaces/macs/<mac>/...`), which is how it finds the ENI's
/// link: names are the kernel's choice, the MAC is the cloud's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// The MAC in a link attribute, if it is an Ethernet one.
    fn from_bytes(bytes: &[u8]) -> Option<Self> {
        <[u8; 6]>::try_from(bytes).ok().map(Self)
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, byte) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

/// A MAC that could not be parsed.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a MAC address (six hex bytes separated by colons)")]
pub struct BadMac(pub String);

impl FromStr for MacAddr {
    type Err = BadMac;

    /// Parses `0a:1b:2c:3d:4e:5f` (either case), the form IMDS uses.
    fn from_str(text: &str) -> Result<Self, BadMac> {
        let bad = || BadMac(text.to_owned());
        let mut mac = [0u8; 6];
        let mut parts = text.split(':');
        for byte in &mut mac {
            let part = parts.next().ok_or_else(bad)?;
            if part.len() != 2 {
                return Err(bad());
            }
            *byte = u8::from_str_radix(part, 16).map_err(|_| bad())?;
        }
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(Self(mac))
    }
}

/// A link named in an error: the name an operator greps for and the index
/// the kernel uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkRef {
    pub name: String,
    pub index: u32,
}

impl fmt::Display for LinkRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (ifindex {})", self.name, self.index)
    }
}

/// What went wrong, with the link, address or route it went wrong on.
/// rtnetlink's errors are boxed: one can carry a whole netlink message, and
/// every `Result` of the agent that holds this one would be as large.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("opening a netlink socket")]
    Connect(#[source] std::io::Error),
    #[error("subscribing to link events (RTNLGRP_LINK)")]
    Subscribe(#[source] std::io::Error),
    #[error("starting a thread for netlink")]
    Thread(#[source] std::io::Error),
    #[error("listing links")]
    ListLinks(#[source] Box<rtnetlink::Error>),
    #[error("listing the IPv4 rules")]
    ListRules(#[source] Box<rtnetlink::Error>),
    #[error("deleting the rule {rule}")]
    DelRule {
        rule: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("adding the rule {rule}")]
    AddRule {
        rule: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("reading the peer of {0}")]
    PeerLink(String, #[source] Box<rtnetlink::Error>),
    #[error("no link is named {0}")]
    NoLinkNamed(String),
    #[error("no link has the MAC {0}")]
    NoLinkWithMac(MacAddr),
    #[error(
        "no link with the MAC {mac} appeared within {timeout:?} (is the ENI attached to this instance?)"
    )]
    LinkTimeout { mac: MacAddr, timeout: Duration },
    #[error("the link event stream closed while waiting for the MAC {0}")]
    EventsClosed(MacAddr),
    #[error("setting the MTU of {link} to {mtu}")]
    SetMtu {
        link: LinkRef,
        mtu: u32,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("creating the VLAN link {name} (802.1Q id {vlan_id}) on ifindex {parent_index}")]
    CreateVlan {
        name: String,
        vlan_id: u16,
        parent_index: u32,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("setting {link} up")]
    SetUp {
        link: LinkRef,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("listing the addresses of {link}")]
    ListAddresses {
        link: LinkRef,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("adding {addr} to {link}")]
    AddAddress {
        link: LinkRef,
        addr: Ipv4Net,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("removing the stale address {addr} from {link}")]
    DelAddress {
        link: LinkRef,
        addr: Ipv4Net,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("listing the routes of {link}")]
    ListRoutes {
        link: LinkRef,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("listing the routes of table {table}")]
    ListTable {
        table: u32,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("adding the route {route}")]
    AddRoute {
        route: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("deleting the route to {destination} by {link} from table main")]
    DelRoute {
        link: LinkRef,
        destination: String,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error("listing the neighbours of {link}")]
    ListNeighbours {
        link: LinkRef,
        #[source]
        source: Box<rtnetlink::Error>,
    },
    #[error(
        "keeping the gateway {gateway} of {link} resolved (a managed neighbour entry needs Linux 5.16 or later)"
    )]
    ManagedNeighbour {
        link: LinkRef,
        gateway: Ipv4Addr,
        #[source]
        source: Box<rtnetlink::Error>,
    },
}

/// The errno in a netlink error answer (positive, as in `libc`).
fn errno(err: &rtnetlink::Error) -> Option<i32> {
    match err {
        rtnetlink::Error::NetlinkError(ErrorMessage {
            code: Some(code), ..
        }) => Some(-code.get()),
        _ => None,
    }
}

/// Aborts a spawned task when dropped: a netlink connection lives exactly
/// as long as what uses it, and never outlives a runtime it was spawned on.
#[derive(Debug)]
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A netlink (`NETLINK_ROUTE`) socket and its connection task. The socket is
/// in the network namespace of the thread that called [`NetlinkHandle::new`].
#[derive(Debug)]
pub struct NetlinkHandle {
    handle: rtnetlink::Handle,
    /// Where the last dump of links found each MAC ([`link::MacIndex`]).
    macs: link::MacIndex,
    _connection: AbortOnDrop,
}

impl NetlinkHandle {
    /// Opens the socket and spawns its connection on the current tokio
    /// runtime (so this must be called from within one).
    pub fn new() -> Result<Self, NetlinkError> {
        let (connection, handle, _) = rtnetlink::new_connection().map_err(NetlinkError::Connect)?;
        Ok(Self {
            handle,
            macs: link::MacIndex::default(),
            _connection: AbortOnDrop(tokio::spawn(connection)),
        })
    }
}

/// Runs `f` with a fresh [`NetlinkHandle`] on a thread of its own with a
/// current-thread runtime, and waits for it: for callers that are not async
/// (the layout applied at start-up) or that must not block their runtime.
/// The thread is new, so it starts in the caller's network namespace.
pub fn blocking<T, F>(f: F) -> Result<T, NetlinkError>
where
    T: Send,
    F: AsyncFnOnce(&NetlinkHandle) -> Result<T, NetlinkError> + Send,
{
    std::thread::scope(|scope| {
        let thread = std::thread::Builder::new()
            .name("netlink".into())
            .spawn_scoped(scope, move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(NetlinkError::Thread)?;
                runtime.block_on(async move {
                    let handle = NetlinkHandle::new()?;
                    f(&handle).await
                })
            })
            .map_err(NetlinkError::Thread)?;
        thread
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// [`NetlinkHandle::keep_gateway_resolved`] for the link named `interface`,
/// from a caller that is not async.
pub fn keep_gateway_resolved_blocking(
    interface: &str,
    gateway: Ipv4Addr,
) -> Result<(), NetlinkError> {
    blocking(async |netlink: &NetlinkHandle| {
        let link = netlink
            .link_by_name(interface)
            .await?
            .ok_or_else(|| NetlinkError::NoLinkNamed(interface.to_owned()))?;
        netlink
            .keep_gateway_resolved(&link.link_ref(), gateway)
            .await
            .map(drop)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_parse_and_print_like_imds() {
        let mac: MacAddr = "0A:1b:2c:3d:4e:5F".parse().unwrap();
        assert_eq!(mac, MacAddr([0x0a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f]));
        assert_eq!(mac.to_string(), "0a:1b:2c:3d:4e:5f");
        for bad in [
            "",
            "0a:1b:2c:3d:4e",
            "0a:1b:2c:3d:4e:5f:00",
            "0a:1b:2c:3d:4e:zz",
            "a:1b:2c:3d:4e:5f0",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn errors_name_what_they_were_about() {
        let link = LinkRef {
            name: "eth1".into(),
            index: 3,
        };
        let err = NetlinkError::AddAddress {
            link,
            addr: "10.20.11.200/24".parse().unwrap(),
            source: Box::new(rtnetlink::Error::RequestFailed),
        };
        assert_eq!(
            err.to_string(),
            "adding 10.20.11.200/24 to eth1 (ifindex 3)"
        );
    }
}
